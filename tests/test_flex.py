"""score_mod and block masks in the tiled kernel (iokernels.tiled.forward_flex).

Exact against the float64 oracle given the same score_mod / mask_mod (ALiBi, soft-capping,
a document mask, and both with causal), at awkward shapes; fully masked tiles are skipped
and counted; counted traffic equals the closed-form model; a dense bias costs exactly
Br*Bc elements per visited tile while the same values as a score_mod cost nothing.
"""
import numpy as np
import pytest

from iokernels import reference, testing, traffic
from iokernels import tiled
from iokernels.core.config import TileConfig

TOL64 = 1e-12


def _docs(rng, n, parts):
    """Document ids 0..parts-1 over n positions, cut at random sorted points."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=parts - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right")


def _check64(o, lse, ref_o, ref_lse):
    assert np.max(np.abs(o - ref_o)) < TOL64
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.max(np.abs(lse[fin] - ref_lse[fin])) < TOL64


@pytest.mark.parametrize("nq, nk, d, heads, causal", [(113, 203, 59, (4, 2), False),
                                                       (97, 97, 32, (3, 1), True),
                                                       (70, 131, 64, (2, 2), True)])
def test_alibi_softcap_document_exact(rng, nq, nk, d, heads, causal):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=heads[0], heads_kv=heads[1], seqlen_q=nq,
                                  seqlen_k=nk, head_dim=d, dtype="float64")
    q *= 3.0                                         # large scores, so the soft cap bites
    cfg = TileConfig(block_q=32, block_k=48, sram_bytes=1 << 20)
    slopes = rng.uniform(0.05, 0.5, heads[0])
    docs_q, docs_k = _docs(rng, nq, 3), _docs(rng, nk, 3)
    for score_mod, mask_mod in ((tiled.alibi(slopes, nq, nk), None),
                                (tiled.softcap(float(rng.uniform(2.0, 4.0))), None),
                                (None, tiled.document_mask(docs_q, docs_k)),
                                (tiled.alibi(slopes, nq, nk), tiled.document_mask(docs_q, docs_k))):
        o, lse = tiled.forward_flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=causal,
                                    config=cfg)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, score_mod=score_mod,
                                             mask_mod=mask_mod)
        _check64(o, lse, ref_o, ref_lse)


def test_score_mod_changes_the_result(rng):
    """The oracle really applies the score_mod (the exactness test cannot pass vacuously)."""
    q, k, v = testing.make_inputs(rng, seqlen_q=40, seqlen_k=50, head_dim=16)
    plain, _ = reference.attention(q, k, v)
    capped, _ = reference.attention(q * 4, k, v, score_mod=tiled.softcap(1.0))
    biased, _ = reference.attention(q, k, v, score_mod=tiled.alibi([0.7, 0.3], 40, 50))
    assert np.max(np.abs(biased - plain)) > 1e-2
    assert np.max(np.abs(capped - reference.attention(q * 4, k, v)[0])) > 1e-2


def test_fully_masked_tiles_skipped_and_counted(rng):
    nq = nk = 150
    docs = _docs(rng, nq, 4)
    mask_mod = tiled.document_mask(docs)
    cfg = TileConfig(block_q=16, block_k=32, sram_bytes=1 << 20)
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=nq, head_dim=24, dtype="float32")
    bm = tiled.block_mask(mask_mod, batch=1, heads=2, seqlen_q=nq, seqlen_k=nk, block_q=16,
                          block_k=32)
    Tr, Tc = -(-nq // 16), -(-nk // 32)
    assert bm.num_skipped + bm.num_visited == 2 * Tr * Tc
    # a tile is skipped exactly when no (query, key) pair in it shares a document
    expect_skip = sum(not np.any(docs[i * 16:(i + 1) * 16, None] == docs[None, j * 32:(j + 1) * 32])
                      for i in range(Tr) for j in range(Tc)) * 2
    assert bm.num_skipped == expect_skip > 0
    with traffic.count() as t:
        tiled.forward_flex(q, k, v, mask_mod=mask_mod, config=cfg)
    keys_visited = sum(min((j + 1) * 32, nk) - j * 32 for i in range(Tr) for j in range(Tc)
                       if bm.states[0, 0, i, j]) * 2
    assert t.by_tensor["K"][0] == keys_visited * 24 * 4 < 2 * Tr * nk * 24 * 4


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_counted_equals_model(rng, dtype):
    nq, nk, d = 77, 130, 40
    cfg = TileConfig(block_q=16, block_k=32)
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk,
                                  head_dim=d, dtype=dtype)
    mask_mod = tiled.document_mask(_docs(rng, nq, 3), _docs(rng, nk, 3))
    problem = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype,
                   causal=True, config=cfg, mask_mod=mask_mod)
    bias = rng.standard_normal((2, 4, nq, nk)).astype(q.dtype)
    for with_bias in (False, True):
        with traffic.count() as t:
            tiled.forward_flex(q, k, v, causal=True, mask_mod=mask_mod, config=cfg,
                               bias=bias if with_bias else None,
                               score_mod=None if with_bias else tiled.softcap(5.0))
        assert t == tiled.traffic_model_flex(bias=with_bias, **problem)


def test_dense_bias_costs_n_squared_score_mod_costs_nothing(rng):
    """The same ALiBi values as a dense HBM tensor and as a score_mod: same output, and the
    bias adds exactly Nq*Nk elements per head of reads (no mask: every tile visited)."""
    nq, nk, d, H = 90, 110, 32, 2
    q, k, v = testing.make_inputs(rng, heads_q=H, seqlen_q=nq, seqlen_k=nk, head_dim=d)
    mod = tiled.alibi(tiled.alibi_slopes(H), nq, nk)
    dense = mod(np.zeros((1, H, nq, nk)), np.arange(1)[:, None, None, None],
                np.arange(H)[None, :, None, None], np.arange(nq)[:, None], np.arange(nk)[None, :])
    cfg = TileConfig(block_q=32, block_k=32, sram_bytes=1 << 20)
    with traffic.count() as t_bias:
        o_bias, _ = tiled.forward_flex(q, k, v, bias=dense, config=cfg)
    with traffic.count() as t_mod:
        o_mod, _ = tiled.forward_flex(q, k, v, score_mod=mod, config=cfg)
    assert np.max(np.abs(o_bias - o_mod)) < TOL64
    assert t_bias.total - t_mod.total == H * nq * nk * 8 == t_bias.by_tensor["bias"][0]


def test_fully_masked_rows_zero_and_bad_bias_raises(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=20, seqlen_k=30, head_dim=8)
    hide_first = lambda b, h, qi, kj: qi >= 5          # rows 0-4 see no key  # noqa: E731
    o, lse = tiled.forward_flex(q, k, v, mask_mod=hide_first,
                                config=TileConfig(block_q=4, block_k=8))
    assert np.all(o[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(o))
    with pytest.raises(ValueError, match="bias"):
        tiled.forward_flex(q, k, v, bias=np.ones((1, 2, 20, 29)))
    with pytest.raises(ValueError, match="cap"):
        tiled.softcap(0.0)
    with pytest.raises(ValueError, match="score_mod"):
        tiled.forward_flex(q, k, v, score_mod=3.0)
    with pytest.raises(ValueError):
        tiled.forward_flex(q, k[..., :4], v)               # head-dim mismatch
