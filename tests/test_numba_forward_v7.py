"""Numba forward v7 (v6 with its K/V tile copies in 16-byte chunks) on the simulator: the float64
oracle (1e-12) and the 2x rule, with the chunk copy (C-contiguous K/V whose rows are whole 16-byte
chunks) and with v6's element copy (strided K, rows that are not whole chunks) giving the same
results; GQA, causal with Nq != Nk, a window, ragged tiles; the counted traffic; the config.  Its
PTX (16-byte global loads) is checked in tests/test_numba_ptx.py, its speed on a GPU by the
benchmark."""
from __future__ import annotations

import numpy as np
import pytest

import iokernels as ik
from iokernels import conventions as cv
from iokernels import gpu, reference, testing, traffic
from iokernels.core.config import TileConfig
from iokernels.numba_cuda import ForwardConfig, counting
import iokernels.numba_cuda as nc
from iokernels.numba_cuda import forward_v7 as fv7

sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counted traffic needs Numba's CUDA simulator")

#: small tiles (quick on the simulator) with several ragged tiles: 4 lanes a row group, 2 rows a thread
TINY = ForwardConfig(version="v7", block_q=8, block_k=8, threads_per_row=4, rows_per_thread=2)
#: 3 keys a lane (Bc = 12 over 4 lanes), one row a thread
TN3 = ForwardConfig(version="v7", block_q=4, block_k=12, threads_per_row=4, rows_per_thread=1)


def _masked(Nq, Nk, causal, window):
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    return (hi <= lo)[None, None, :, None]


def _strided(x):
    """The same values in a view whose rows are not contiguous (every other dim of a wider array)."""
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


# float64: 2 values a chunk, d = 6 and 20 whole chunks (the chunk copy), d = 7 not (element copy)
@pytest.mark.parametrize("cfg, causal, window, d", [(TINY, True, None, 6), (TN3, False, (3, 2), 7),
                                                    (TN3, True, None, 20), (TINY, False, None, 8)])
def test_forward_v7_float64_matches_oracle(rng, cfg, causal, window, d):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13,
                                  head_dim=d, dtype="float64")
    assert (fv7.chunk_reason(k, d, "k") is None) == (d % 2 == 0)
    ro, rl = reference.attention(q, k, v, causal=causal, window=window)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="numba", config=cfg, return_lse=True)
    testing.assert_close(o, ro, masked_rows=_masked(19, 13, causal, window))
    testing.assert_close(lse, rl, name="lse")
    if causal:
        assert np.isneginf(lse[:, :, :6]).all() and (o[:, :, :6] == 0).all()


@pytest.mark.parametrize("dtype, d", [("float32", 8), ("float16", 16), ("float32", 13)])
def test_forward_v7_low_precision_two_x_rule(rng, dtype, d):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, heads_kv=1, seqlen_q=13, seqlen_k=29,
                                  head_dim=d, dtype=dtype)
    ro, rl = reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    o, lse = nc.attention(q, k, v, causal=True, config=TINY)
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")


@pytest.mark.parametrize("dtype, d", [("float32", 8), ("float16", 16)])
def test_forward_v7_chunk_and_element_copies_agree(rng, dtype, d):
    """A strided K and V take v6's element copy; the results are the chunk copy's, bit for bit."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=9, seqlen_k=21,
                                  head_dim=d, dtype=dtype)
    ks, vs = _strided(k), _strided(v)
    assert fv7.chunk_reason(k, d, "k") is None and "not C-contiguous" in fv7.chunk_reason(ks, d, "k")
    o, lse = nc.attention(q, k, v, causal=True, config=TINY)
    o2, lse2 = nc.attention(q, ks, vs, causal=True, config=TINY)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)


def test_forward_v7_chunk_reasons():
    x = np.zeros((1, 1, 4, 8), np.float32)
    assert fv7.chunk_reason(x, 8, "k") is None
    assert "16-byte chunks" in fv7.chunk_reason(np.zeros((1, 1, 4, 6), np.float32), 6, "v")
    assert "16-byte chunks" in fv7.chunk_reason(np.zeros((1, 1, 4, 4), np.float16), 4, "k")
    buf = np.zeros(1 + 32, np.float32)[1:].reshape(1, 1, 4, 8)     # 4 bytes past a 16-byte boundary
    if buf.ctypes.data % 16:
        assert "16-byte boundary" in fv7.chunk_reason(buf, 8, "k")


def test_forward_v7_runs_by_name_and_v4_stays_the_default(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=3, seqlen_k=30, head_dim=4, dtype="float64")
    need = nc.need("attention", q=q, k=k, v=v)
    assert nc.REGISTRY.resolve("attention", None, need)[1].version == "v4"
    kern, cfg = nc.REGISTRY.resolve("attention", nc.ForwardConfig("v7"), need)
    assert cfg.version == "v7" and kern.file == "numba_cuda/forward_v7.py"
    o, lse = ik.attention(q, k, v, backend="numba", return_lse=True, config=nc.ForwardConfig("v7"))  # one tile
    ro, rl = reference.attention(q, k, v)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


@sim_only
@pytest.mark.parametrize("causal, window", [(False, None), (True, (5, 1))])
def test_forward_v7_counted_traffic_equals_fa2_model(rng, causal, window):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26,
                                  head_dim=4, dtype="float32")
    o, lse, counted = counting.count_attention(q, k, v, causal=causal, window=window, config=TINY)
    model = traffic.model("fa2", batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26, head_dim=4,
                          dtype="float32", causal=causal, window=window,
                          config=TileConfig(block_q=TINY.block_q, block_k=TINY.block_k))
    assert counted.as_dict() == model.as_dict()
    testing.assert_close(o, reference.attention(q, k, v, causal=causal, window=window)[0],
                         ik.attention(q, k, v, causal=causal, window=window, backend="naive"))


def test_forward_v7_tiles_are_v6s():
    for d in (8, 64, 128, 256):
        for dtype in ("float16", "float32", "float64"):
            assert ForwardConfig(version="v7").resolved(d, dtype).replace(version="v6") == \
                ForwardConfig(version="v6").resolved(d, dtype)
    with pytest.raises(ValueError, match="config.block_k: 6 must be a multiple of threads_per_row"):
        ForwardConfig(version="v7", block_k=6).resolved(8, "float32")
