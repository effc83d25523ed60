"""The Numba paged prefill (one launch for a packed batch of chunks) on the simulator: exact
against the float64 oracle on a gathered contiguous copy, chunked == one shot, a one-row
chunk == paged decode, ragged batches, argument checks that raise and change nothing."""
import numpy as np
import pytest

import iokernels as ik
from iokernels.core import testing
from iokernels.core.gpu import cupy_gpu, simulator_enabled, torch_gpu
from iokernels.paged import PagedKVCache

if not (simulator_enabled() or torch_gpu() or cupy_gpu()):
    pytest.skip("no GPU and no Numba simulator", allow_module_level=True)

from iokernels.numba_cuda import PrefillConfig  # noqa: E402


def _filled(rng, lens, hkv, d, dtype="float64", block_size=4, kv_dtype=None):
    cache = PagedKVCache(sum(-(-n // block_size) for n in lens) + 2, block_size, num_kv_heads=hkv, head_dim=d,
                         dtype=dtype, kv_dtype=kv_dtype)
    sids = []
    for n in lens:
        sid = cache.new_sequence()
        if n:
            cache.append(sid, rng.standard_normal((n, hkv, d)).astype(cache.dtype),
                         rng.standard_normal((n, hkv, d)).astype(cache.dtype))
        sids.append(sid)
    return cache, sids




def _cu(chunks):
    return np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)


@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_float64_exact_against_oracle(hq, hkv, causal):
    rng = np.random.default_rng(hq * 10 + hkv + causal)
    lens, chunks = [1, 7, 9, 0], [1, 3, 9, 0]      # a decode row, a partial chunk, a whole cache, an empty one
    cache, sids = _filled(rng, lens, hkv, 5)
    cq = _cu(chunks)
    q = rng.standard_normal((int(cq[-1]), hq, 5))
    o, lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, backend="numba", return_lse=True,
                              config=PrefillConfig(block_q=2))
    ro, rl = testing.paged_prefill_oracle(q, cache, sids, cq, causal)
    assert np.max(np.abs(o - ro)) <= 1e-12 * max(1.0, np.max(np.abs(ro)))
    assert np.max(np.abs(lse - rl)) <= 1e-12 * max(1.0, np.max(np.abs(rl)))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lower_precision_within_the_2x_rule(dtype):
    rng = np.random.default_rng(11)
    cache, sids = _filled(rng, [6, 10], 2, 8, dtype=dtype)
    cq = _cu([6, 4])
    q = rng.standard_normal((10, 4, 8)).astype(dtype)
    o, lse = ik.paged_prefill(q, cache, sids, cq, backend="numba", return_lse=True)
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    ro, rl = testing.paged_prefill_oracle(q, cache, sids, cq)
    base, base_lse = ik.paged_prefill(q, cache, sids, cq, backend="naive", return_lse=True)
    testing.assert_close(o, ro, base, dtype=dtype, name=f"numba paged prefill O {dtype}")
    testing.assert_close(lse, rl, base_lse, dtype=dtype, atol=1e-4, name=f"numba paged prefill LSE {dtype}")


def test_chunked_equals_one_shot():
    rng = np.random.default_rng(3)
    n, hkv, hq, d = 11, 1, 2, 4
    k, v, q = (rng.standard_normal((n, h, d)) for h in (hkv, hkv, hq))
    one = PagedKVCache(4, 4, num_kv_heads=hkv, head_dim=d, dtype="float64")
    s1 = one.new_sequence()
    one.append(s1, k, v)
    whole = ik.paged_prefill(q, one, [s1], np.array([0, n], np.int32), backend="numba")
    parts = PagedKVCache(4, 4, num_kv_heads=hkv, head_dim=d, dtype="float64")
    s2 = parts.new_sequence()
    out = []
    for a, z in [(0, 3), (3, 4), (4, 11)]:
        parts.append(s2, k[a:z], v[a:z])
        out.append(ik.paged_prefill(q[a:z], parts, [s2], np.array([0, z - a], np.int32), backend="numba"))
    assert np.max(np.abs(np.concatenate(out) - whole)) <= 1e-12


def test_one_row_chunk_is_paged_decode():
    rng = np.random.default_rng(4)
    cache, sids = _filled(rng, [5, 9], 2, 4)
    q = rng.standard_normal((2, 4, 4))
    a, la = ik.paged_prefill(q, cache, sids, np.arange(3, dtype=np.int32), backend="numba", return_lse=True)
    b, lb = ik.paged_decode(q, cache, sids, num_splits=1, backend="tiled", return_lse=True)
    assert np.max(np.abs(a - b)) <= 1e-12 and np.max(np.abs(la.T - lb)) <= 1e-12


def test_ragged_batch_with_default_tiles_matches_the_numpy_kernel():
    """Chunks of several Q tiles next to one-tile chunks, a group of 3 query heads, default config."""
    rng = np.random.default_rng(5)
    cache, sids = _filled(rng, [13, 2, 8], 1, 3, block_size=2)
    cq = _cu([13, 1, 5])
    q = rng.standard_normal((19, 3, 3))
    for bq in (None, 4):
        cfg = None if bq is None else PrefillConfig(block_q=bq)
        o, lse = ik.paged_prefill(q, cache, sids, cq, backend="numba", return_lse=True, config=cfg)
        ro, rl = ik.paged_prefill(q, cache, sids, cq, backend="tiled", return_lse=True)
        assert np.max(np.abs(o - ro)) <= 1e-12 and np.max(np.abs(lse - rl)) <= 1e-12


def test_bad_arguments_raise_and_change_nothing():
    rng = np.random.default_rng(7)
    cache, sids = _filled(rng, [5, 3], 2, 4)
    q = rng.standard_normal((4, 2, 4))
    good = np.array([0, 2, 4], np.int32)
    before = cache.snapshot()
    cases = [
        (dict(q=q.astype(np.float32)), "q: dtype"),
        (dict(q=rng.standard_normal((4, 3, 4))), "q: expected shape"),
        (dict(cu_seqlens_q=np.array([0, 4], np.int32)), "cu_seqlens_q: expected len"),
        (dict(cu_seqlens_q=np.array([0, 0, 4], np.int32)), "cu_seqlens_q: sequence 1 has a chunk of 4"),
        (dict(seq_ids=[0, 9]), "seq_id: unknown"),
        (dict(causal=1), "causal"),
        (dict(config="x"), "config: numba paged_prefill takes a PrefillConfig"),
        (dict(q=rng.standard_normal((4, 4, 4)), config=PrefillConfig(block_q=600)), "config.block_q: 600 chunk rows"),
    ]
    for change, msg in cases:
        kw = dict(q=q, cache=cache, seq_ids=sids, cu_seqlens_q=good, backend="numba")
        kw.update(change)
        with pytest.raises(ValueError, match=msg):
            ik.paged_prefill(**kw)
    with pytest.raises(ValueError, match="config.block_q"):
        PrefillConfig(block_q=0)
    with pytest.raises(ValueError, match="config.version"):
        PrefillConfig(version="v9")
    qc, sc = _filled(rng, [5], 1, 4, dtype="float32", kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype: reads unquantized pools"):
        ik.paged_prefill(rng.standard_normal((5, 1, 4)).astype(np.float32), qc, sc, np.array([0, 5], np.int32),
                         backend="numba")
    assert cache.snapshot() == before


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    """On raw pools, a chunk longer than its sequence's length: the rows before key 0 see nothing."""
    from iokernels.numba_cuda.paged_prefill import paged_prefill_pools
    rng = np.random.default_rng(9)
    cache, sids = _filled(rng, [3], 1, 4)
    tables, lens = cache.block_tables_array(sids)
    q = rng.standard_normal((5, 2, 4))
    o, lse = paged_prefill_pools(q, cache.k_pool, cache.v_pool, tables, lens, np.array([0, 5], np.int32),
                                 config=PrefillConfig(block_q=2))
    assert np.all(o[:2] == 0) and np.all(np.isneginf(lse[:, :2]))
    ro, rl = testing.paged_prefill_oracle(q[2:], cache, sids, np.array([0, 3]))
    assert np.max(np.abs(o[2:] - ro)) <= 1e-12 and np.max(np.abs(lse[:, 2:] - rl)) <= 1e-12
