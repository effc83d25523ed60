"""Prefill on a paged cache: exact against the oracle on a contiguous copy, traffic counted ==
modelled, chunked prefill == one-shot prefill, argument checks that change nothing."""
import numpy as np
import pytest

import iokernels as ik
from iokernels import traffic
from iokernels.core import testing
from iokernels.core.config import TileConfig
from iokernels.paged import PagedKVCache
from iokernels.paged_prefill import chunk_tiles


def _filled(rng, lens, hkv, d, dtype="float64", block_size=4, kv_dtype=None, extra_blocks=2):
    """A cache holding sequences of the given lengths, with random rows; returns (cache, sids)."""
    cache = PagedKVCache(sum(-(-n // block_size) for n in lens) + extra_blocks, block_size, num_kv_heads=hkv,
                         head_dim=d, dtype=dtype, kv_dtype=kv_dtype)
    sids = []
    for n in lens:
        sid = cache.new_sequence()
        if n:
            cache.append(sid, rng.standard_normal((n, hkv, d)).astype(cache.dtype),
                         rng.standard_normal((n, hkv, d)).astype(cache.dtype))
        sids.append(sid)
    return cache, sids




@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (6, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_float64_exact_against_oracle(hq, hkv, causal):
    rng = np.random.default_rng(hq * 10 + hkv + causal)
    lens = [1, 7, 12, 0, 9]
    chunks = [1, 3, 12, 0, 5]          # a decode row, partial chunks, a whole prompt, an empty chunk
    cache, sids = _filled(rng, lens, hkv, 5)
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), hq, 5))
    o, lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, return_lse=True,
                              config=TileConfig(block_q=2, block_k=4))
    ro, rl = testing.paged_prefill_oracle(q, cache, sids, cq, causal)
    assert np.max(np.abs(o - ro)) <= 1e-12 * max(1.0, np.max(np.abs(ro)))
    assert np.max(np.abs(lse - rl)) <= 1e-12 * max(1.0, np.max(np.abs(rl)))


def test_chunked_equals_one_shot():
    """Appending a prompt chunk by chunk and attending after each gives the rows of one shot."""
    rng = np.random.default_rng(3)
    n, hkv, hq, d = 23, 2, 4, 8
    k, v, q = (rng.standard_normal((n, h, d)) for h in (hkv, hkv, hq))
    one = PagedKVCache(8, 4, num_kv_heads=hkv, head_dim=d, dtype="float64")
    s1 = one.new_sequence()
    one.append(s1, k, v)
    whole = ik.paged_prefill(q, one, [s1], np.array([0, n], np.int32))
    parts = PagedKVCache(8, 4, num_kv_heads=hkv, head_dim=d, dtype="float64")
    s2 = parts.new_sequence()
    out = []
    for a, z in [(0, 5), (5, 6), (6, 16), (16, 23)]:
        parts.append(s2, k[a:z], v[a:z])
        out.append(ik.paged_prefill(q[a:z], parts, [s2], np.array([0, z - a], np.int32)))
    assert np.max(np.abs(np.concatenate(out) - whole)) <= 1e-12


def test_one_row_chunk_is_paged_decode():
    rng = np.random.default_rng(4)
    cache, sids = _filled(rng, [5, 9, 16], 2, 4)
    q = rng.standard_normal((3, 4, 4))
    a = ik.paged_prefill(q, cache, sids, np.arange(4, dtype=np.int32))
    b = ik.paged_decode(q, cache, sids, num_splits=1)
    assert np.max(np.abs(a - b)) <= 1e-12


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("causal,block_q", [(True, 3), (False, 32), (True, 32)])
def test_traffic_counted_equals_model(kv_dtype, causal, block_q):
    rng = np.random.default_rng(5)
    lens, chunks = [13, 4, 21], [6, 4, 1]
    dtype = "float32"
    cache, sids = _filled(rng, lens, 2, 8, dtype=dtype, block_size=4, kv_dtype=kv_dtype)
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), 6, 8)).astype(dtype)
    with traffic.count() as t:
        ik.paged_prefill(q, cache, sids, cq, causal=causal, config=TileConfig(block_q=block_q, block_k=4))
    m = traffic.model("paged_prefill", heads_q=6, heads_kv=2, head_dim=8, seq_lens=lens, chunk_lens=chunks,
                      dtype=dtype, block_size=4, block_q=block_q, causal=causal, kv_dtype=kv_dtype)
    assert t.as_dict() == m.as_dict()


def test_causal_skips_future_blocks():
    """A chunk's first Q tile reads no block past its last row's position."""
    tiles = chunk_tiles(n=40, n_q=16, block_q=8, block_size=8)
    assert [x[2][-1][1] for x in tiles] == [32, 40]
    assert sum(y - x for x, y in tiles[0][2]) == 32


def test_quantized_within_cache_values():
    """A quantized cache is read as its dequantized values: equal to the oracle on what it holds."""
    rng = np.random.default_rng(6)
    cache, sids = _filled(rng, [10, 7], 1, 4, dtype="float32", kv_dtype="int8")
    cq = np.array([0, 4, 7], np.int32)
    q = rng.standard_normal((7, 2, 4)).astype(np.float32)
    o = ik.paged_prefill(q, cache, sids, cq)
    ro, _ = testing.paged_prefill_oracle(q, cache, sids, cq)
    assert np.max(np.abs(o - ro)) <= 1e-5


def test_bad_arguments_raise_and_change_nothing():
    rng = np.random.default_rng(7)
    cache, sids = _filled(rng, [5, 3], 2, 4)
    q = rng.standard_normal((4, 2, 4))
    good = np.array([0, 2, 4], np.int32)
    before = cache.snapshot()
    cases = [
        (dict(q=q.astype(np.float32)), "q: dtype"),
        (dict(q=q[:, :, :3]), "q: expected shape"),
        (dict(q=rng.standard_normal((4, 3, 4))), "q: expected shape"),
        (dict(cu_seqlens_q=np.array([0, 4], np.int32)), "cu_seqlens_q: expected len"),
        (dict(cu_seqlens_q=np.array([0, 1, 3], np.int32)), "cu_seqlens_q: last offset"),
        (dict(cu_seqlens_q=np.array([0, 0, 4], np.int32)), "cu_seqlens_q: sequence 1 has a chunk of 4"),
        (dict(seq_ids=[0, 9]), "seq_id: unknown"),
        (dict(cache="nope"), "cache: expected a PagedKVCache"),
        (dict(causal=1), "causal"),
        (dict(backend="nope"), "backend"),
        (dict(config=TileConfig(block_q=4)), "config: block_k"),
        (dict(config="x"), "config: expected None or a TileConfig"),
    ]
    for change, msg in cases:
        kw = dict(q=q, cache=cache, seq_ids=sids, cu_seqlens_q=good)
        kw.update(change)
        with pytest.raises(ValueError, match=msg):
            ik.paged_prefill(**kw)
    bad = q.copy()
    bad[1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="q: holds a non-finite"):
        ik.paged_prefill(bad, cache, sids, good)
    assert cache.snapshot() == before


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_gather_then_attend_backends_match_the_kernel(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    cache, sids = _filled(rng, [6, 13, 1], 2, 4)
    cq = np.array([0, 2, 15, 16], np.int32)
    q = rng.standard_normal((16, 4, 4))
    o, lse = ik.paged_prefill(q, cache, sids, cq, backend=backend, return_lse=True)
    ro, rl = testing.paged_prefill_oracle(q, cache, sids, cq)
    assert np.max(np.abs(o - ro)) <= 1e-12 and np.max(np.abs(lse - rl)) <= 1e-12
