"""The Numba paged decode (split kernel v3) over scattered pools, on the simulator: both ways
of finding a key's row (``DecodeConfig.paged_addressing``: "page", one block-table lookup per
key group and step; "key", one per key) against the float64 oracle, at block sizes that are
and are not multiples of keys_per_iter, ragged lengths with an empty sequence, shuffled block
tables, GQA, several table stages, a sliding window, a quantized cache, and the errors.

Sizes are tiny (the simulator runs every thread as a Python thread); the small tilings keep a
block at a few threads while the page, step and stage arithmetic stays the kernel's own.
"""
import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, reference, testing, traffic

pytestmark = pytest.mark.skipif(not gpu.simulator_enabled() and not gpu.has_gpu(),
                                reason="needs Numba's CUDA simulator or a GPU")
sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counted traffic needs Numba's CUDA simulator")

nc = pytest.importorskip("iokernels.numba_cuda")
from iokernels.numba_cuda import DecodeConfig, counting  # noqa: E402
from iokernels.numba_cuda.decode_v3 import TABLE_STAGE_V3, paged_addressing  # noqa: E402
from iokernels.paged import PagedKVCache  # noqa: E402


def _cfg(kpi, addressing=None, lanes=1, groups=2):
    return DecodeConfig(version="v3", lanes_per_key=lanes, keys_per_iter=kpi, key_groups=groups,
                        paged_addressing=addressing)


def _pools(rng, lens, bs, hkv, d, dtype, spare=3):
    """Pools (num_blocks, bs, Hkv, d) of random values (unused slots too: they must not be read
    as keys), each sequence's blocks a random, non-monotonic set of pool blocks; the dense
    (B, Hkv, max_len, d) copies the oracle reads."""
    nblk = [-(-n // bs) for n in lens]
    total = sum(nblk) + spare
    order = rng.permutation(total)
    k_pool = rng.standard_normal((total, bs, hkv, d)).astype(dtype)
    v_pool = rng.standard_normal((total, bs, hkv, d)).astype(dtype)
    tables = np.zeros((len(lens), max(max(nblk), 1)), np.int32)
    kk = np.zeros((len(lens), hkv, max(max(lens), 1), d), dtype)
    vv = np.zeros_like(kk)
    at = 0
    for b, (n, nb) in enumerate(zip(lens, nblk)):
        tables[b, :nb] = order[at:at + nb]
        at += nb
        for c in range(n):                               # key c: pool[table[c // bs], c % bs]
            kk[b, :, c] = k_pool[tables[b, c // bs], c % bs]
            vv[b, :, c] = v_pool[tables[b, c // bs], c % bs]
    return k_pool, v_pool, tables, kk, vv


def _check(o, lse, q, kk, vv, lens, window=None):
    ro, rl = reference.decode(q, kk, vv, seq_lens=lens, window=window)
    empty = (np.asarray(lens) == 0)[:, None, None]
    if q.dtype == np.float64:
        testing.assert_close(o, ro, masked_rows=empty)
        testing.assert_close(lse, rl, name="lse")
    else:
        bo, bl = ik.decode(q, kk, vv, seq_lens=np.asarray(lens), window=window, backend="naive",
                           return_lse=True)
        testing.assert_close(o, ro, bo, masked_rows=empty)
        testing.assert_close(lse, rl, bl, name="lse")
    assert (o[empty[:, 0, 0]] == 0).all() and np.isneginf(lse[empty[:, 0, 0]]).all()


@pytest.mark.parametrize("bs,kpi,lanes,dtype,d,hq,hkv,lens,S", [
    (1, 2, 1, "float64", 5, 4, 2, [9, 0, 4], 1),        # one key a page: "key" addressing
    (5, 2, 1, "float64", 3, 3, 1, [13, 0, 7], 2),       # 5 keys a page, not a multiple of KPI: "key"
    (5, 5, 1, "float64", 4, 2, 1, [23, 11, 0], 3),      # 5 = KPI: "page" with Bn not a power of two
    (16, 2, 2, "float16", 12, 4, 2, [37, 0, 16], 1),    # 16: a step (4 keys) inside a page; words
    (16, 4, 1, "float32", 6, 3, 1, [50, 0], 3),         # g = 3; splits of one and two pages
    (64, 2, 1, "float64", 7, 2, 2, [70, 0], 2),         # 64: 16 steps a page, a 6-key split, g = 1
])
def test_paged_addressing_matches_oracle(rng, bs, kpi, lanes, dtype, d, hq, hkv, lens, S):
    """Each addressing the block size allows against the oracle (1e-12 in float64, the 2x rule
    below), and "page" and "key" bit for bit equal where both run: they read the same rows in
    the same order."""
    k_pool, v_pool, tables, kk, vv = _pools(rng, lens, bs, hkv, d, np.dtype(dtype))
    q = rng.standard_normal((len(lens), hq, d)).astype(dtype)
    results = []
    for addressing in ("page", "key"):
        if addressing == "page" and bs % kpi:
            continue
        cfg = _cfg(kpi, addressing, lanes)
        o, lse = nc.paged_decode_pools(q, k_pool, v_pool, tables, np.array(lens), num_splits=S, config=cfg)
        _check(o, lse, q, kk, vv, lens)
        results.append((o, lse))
    assert paged_addressing(_cfg(kpi), bs) == ("page" if bs % kpi == 0 else "key")
    if len(results) == 2:
        np.testing.assert_array_equal(results[0][0], results[1][0])
        np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bs,kpi", [(1, 2), (2, 2)])
def test_paged_decode_over_several_table_stages(rng, bs, kpi):
    """More pages than one stage of table entries in SRAM: the split walks 2-3 stages ("key"
    at 1 key a page, "page" at 2), float64, one split."""
    n0 = (2 * TABLE_STAGE_V3 + 6) * bs
    lens = [n0, 0, TABLE_STAGE_V3 * bs + 3]
    k_pool, v_pool, tables, kk, vv = _pools(rng, lens, bs, 1, 3, np.float64)
    q = rng.standard_normal((3, 2, 3))
    o, lse = nc.paged_decode_pools(q, k_pool, v_pool, tables, np.array(lens), num_splits=1, config=_cfg(kpi))
    _check(o, lse, q, kk, vv, lens)


def test_windowed_paged_decode_takes_key_addressing(rng):
    """A sliding window starts the first split mid-page (a split boundary inside a page), which
    "page" addressing cannot read: None picks "key", which matches the oracle; an explicit
    "page" raises, naming the field."""
    lens, bs, window = [29, 0, 6], 4, (9, 0)
    k_pool, v_pool, tables, kk, vv = _pools(rng, lens, bs, 1, 5, np.float64)
    q = rng.standard_normal((3, 2, 5))
    assert paged_addressing(_cfg(2), bs, left=9) == "key"
    o, lse = nc.paged_decode_pools(q, k_pool, v_pool, tables, np.array(lens), num_splits=2, config=_cfg(2),
                                   window=window)
    _check(o, lse, q, kk, vv, lens, window=window)
    with pytest.raises(ValueError, match="config.paged_addressing"):
        nc.paged_decode_pools(q, k_pool, v_pool, tables, np.array(lens), config=_cfg(2, "page"), window=window)
    with pytest.raises(ValueError, match="config.paged_addressing: 'page' needs .* block_size 5"):
        paged_addressing(_cfg(2, "page"), 5)


def test_paged_addressing_config_is_checked():
    with pytest.raises(ValueError, match="config.paged_addressing: one of 'page', 'key'"):
        DecodeConfig(version="v3", paged_addressing="row")
    with pytest.raises(ValueError, match="config.paged_addressing: a setting of v3 to v6"):
        DecodeConfig(version="v2", paged_addressing="page")


def test_quantized_paged_decode_page_equals_key(rng):
    """An int8 cache (codes and block scales): "page" loads a block's scales once per key
    group and step, "key" once per key; the same values, the same result bit for bit, and
    the NumPy paged decode's to float32 rounding."""
    cache = PagedKVCache(12, block_size=4, num_kv_heads=2, head_dim=8, dtype=np.float32, kv_dtype="int8")
    sids = [cache.new_sequence() for _ in range(3)]
    for sid, n in zip(sids, (14, 0, 9)):
        if n:
            cache.append(sid, *(rng.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(2)))
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    got = [nc.paged_decode(q, cache, sids, num_splits=1, config=_cfg(2, a)) for a in ("page", "key")]
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    ro, rl = ik.paged_decode(q, cache, sids, num_splits=1, backend="tiled", return_lse=True)
    np.testing.assert_allclose(got[0][0], ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0][1][[0, 2]], rl[[0, 2]], rtol=1e-5, atol=1e-5)
    assert np.isneginf(got[0][1][1]).all() and (got[0][0][1] == 0).all()


@sim_only
@pytest.mark.parametrize("bs,kpi", [(5, 2), (4, 2)])
def test_paged_addressing_counted_traffic_equals_model(rng, bs, kpi):
    """Either addressing reads each K/V word and each needed table entry once."""
    lens = [13, 0, 6]
    k_pool, v_pool, tables, kk, vv = _pools(rng, lens, bs, 2, 8, np.float16)
    cache = PagedKVCache(len(k_pool), block_size=bs, num_kv_heads=2, head_dim=8, dtype=np.float16)
    sids = [cache.new_sequence() for _ in lens]
    for b, sid in enumerate(sids):
        if lens[b]:
            cache.append(sid, kk[b, :, :lens[b]].transpose(1, 0, 2), vv[b, :, :lens[b]].transpose(1, 0, 2))
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    o, lse, counted = counting.count_paged_decode(q, cache, sids, num_splits=2, config=_cfg(kpi))
    _check(o, lse, q, kk, vv, lens)
    model = traffic.model("paged_decode", batch=3, heads_q=4, heads_kv=2, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16", block_size=bs)
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()
