"""Numba forwards v5 to v7 (register tiling as a GEMM does it; v6: 16-byte shared loads; v7: 16-byte
tile copies) on the simulator, each test looped over the versions: the float64 oracle (1e-12) and
the 2x rule (float32, float16), GQA, causal with Nq != Nk (fully masked rows), a window, ragged
tiles and head dims that are not whole 16-byte chunks, the counted traffic, the tiles and padded
rows (iokernels.numba_cuda.policy), the config checks; v7's chunk copy against its element copy.
Their PTX is checked in tests/test_numba_ptx.py, their speed on a GPU by tests/test_numba_gpu.py
and the benchmark."""
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
from iokernels.numba_cuda import policy as NP
from iokernels.numba_cuda.config import SHARED_LIMIT_BYTES

sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counted traffic needs Numba's CUDA simulator")

VERSIONS = ("v5", "v6", "v7")


def tiny(version):
    """Small tiles (quick on the simulator) with several ragged tiles: 4 lanes a row group, 2 rows a thread."""
    return ForwardConfig(version=version, block_q=8, block_k=8, threads_per_row=4, rows_per_thread=2)


def tn3(version):
    """3 keys a lane (Bc = 12 over 4 lanes), one row a thread."""
    return ForwardConfig(version=version, block_q=4, block_k=12, threads_per_row=4, rows_per_thread=1)


def _masked(Nq, Nk, causal, window):
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    return (hi <= lo)[None, None, :, None]


# d = 7, 5, 9: not whole 16-byte chunks of float64 (2 values) or float32 (4); d = 6, 20 whole float64
# chunks (v7's chunk copy); d = 20 over 4 lanes leaves v6/v7's O block a chunk past d (padding)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("cfg, causal, window, d", [(tiny, True, None, 7), (tn3, False, (3, 2), 5),
                                                    (tiny, False, None, 9), (tn3, True, None, 20),
                                                    (tiny, True, None, 6)])
def test_forward_float64_matches_oracle(rng, version, cfg, causal, window, d):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13,
                                  head_dim=d, dtype="float64")
    ro, rl = reference.attention(q, k, v, causal=causal, window=window)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="numba", config=cfg(version),
                          return_lse=True)
    testing.assert_close(o, ro, masked_rows=_masked(19, 13, causal, window))
    testing.assert_close(lse, rl, name="lse")
    if causal:
        assert np.isneginf(lse[:, :, :6]).all() and (o[:, :, :6] == 0).all()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype, d", [("float32", 8), ("float16", 16), ("float32", 13)])
def test_forward_low_precision_two_x_rule(rng, version, dtype, d):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, heads_kv=1, seqlen_q=13, seqlen_k=29,
                                  head_dim=d, dtype=dtype)
    ro, rl = reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    o, lse = nc.attention(q, k, v, causal=True, config=tiny(version))
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")


@pytest.mark.parametrize("version", VERSIONS)
def test_forward_runs_by_name_at_its_default_tiles_and_v4_stays_the_default(rng, version):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=3, seqlen_k=30, head_dim=4, dtype="float64")
    need = nc.need("attention", q=q, k=k, v=v)
    assert nc.REGISTRY.resolve("attention", None, need)[1].version == "v4"
    kern, cfg = nc.REGISTRY.resolve("attention", nc.ForwardConfig(version), need)
    assert cfg.version == version and kern.file == f"numba_cuda/forward_{version}.py"
    o, lse = ik.attention(q, k, v, backend="numba", return_lse=True, config=nc.ForwardConfig(version))  # one tile
    ro, rl = reference.attention(q, k, v)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


@sim_only
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal, window", [(False, None), (True, (5, 1))])
def test_forward_counted_traffic_equals_fa2_model(rng, version, causal, window):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26,
                                  head_dim=4, dtype="float32")
    cfg = tiny(version)
    o, lse, counted = counting.count_attention(q, k, v, causal=causal, window=window, config=cfg)
    model = traffic.model("fa2", batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26, head_dim=4,
                          dtype="float32", causal=causal, window=window,
                          config=TileConfig(block_q=cfg.block_q, block_k=cfg.block_k))
    assert counted.as_dict() == model.as_dict()
    testing.assert_close(o, reference.attention(q, k, v, causal=causal, window=window)[0],
                         ik.attention(q, k, v, causal=causal, window=window, backend="naive"))


@pytest.mark.parametrize("version", VERSIONS)
def test_forward_default_tiles_fit_and_are_whole(version):
    for d in (8, 59, 64, 128, 256):
        for dtype in ("float16", "float32", "float64"):
            cfg = ForwardConfig(version=version).resolved(d, dtype)
            assert cfg.shared_bytes(d, dtype) <= SHARED_LIMIT_BYTES
            assert cfg.block_k % cfg.threads_per_row == 0 and cfg.block_q % cfg.rows_per_thread == 0
            assert cfg.threads <= 1024 and (cfg.threads % 32 == 0 or cfg.threads < 32)
            if version == "v7":                                  # v7 copies differently, tiles as v6
                assert cfg.replace(version="v6") == ForwardConfig(version="v6").resolved(d, dtype)


@pytest.mark.parametrize("version", VERSIONS)
def test_forward_config_errors(version):
    with pytest.raises(ValueError, match="config.block_k: 6 must be a multiple of threads_per_row"):
        ForwardConfig(version=version, block_k=6).resolved(8, "float32")
    with pytest.raises(ValueError, match="config.block_k"):                     # Q_i + K/V tile > 48 KiB
        ForwardConfig(version=version, block_q=64, block_k=64).resolved(128, "float32")
    with pytest.raises(ValueError, match="config.block_q"):
        ForwardConfig(version=version, block_q=6).resolved(8, "float32")


def test_forward_v5_tiles_are_the_largest_that_fit():
    assert NP.forward_v5_tiles(128, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 24)     # 64 + 32 rows do not fit
    assert (64 + 32) * 129 * 4 > SHARED_LIMIT_BYTES >= (64 + 24) * 129 * 4
    assert NP.forward_v5_tiles(64, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 32)
    assert NP.forward_v5_tiles(128, 8, SHARED_LIMIT_BYTES, 8, 4) == (32, 8)
    assert NP.forward_v5_tiles(10 ** 5, 8, SHARED_LIMIT_BYTES, 8, 4) == (8, 8)   # nothing fits: the smallest


def test_forward_v6_tiles_are_the_largest_that_fit():
    assert NP.forward_v6_tiles(128, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 24)     # 64 + 32 rows do not fit
    assert (64 + 32) * 132 * 4 > SHARED_LIMIT_BYTES >= (64 + 24) * 132 * 4
    assert NP.forward_v6_tiles(64, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 32)
    assert NP.forward_v6_tiles(128, 8, SHARED_LIMIT_BYTES, 8, 4) == (32, 8)


@pytest.mark.parametrize("d, lanes, itemsize, row", [(128, 8, 4, 132), (64, 8, 4, 68), (256, 8, 4, 260),
                                                     (7, 4, 4, 36), (100, 8, 4, 132), (128, 8, 8, 130),
                                                     (5, 4, 8, 18)])
def test_forward_v6_row_is_whole_chunks_one_bank_group_apart(d, lanes, itemsize, row):
    """A row covers the S loop's chunks and the O block's (lanes x chunks), is whole 16-byte
    chunks, and is 16 bytes past a multiple of 128: 8 rows at one dim start in 8 bank groups."""
    w = NP.vector_width(itemsize)
    assert NP.forward_v6_row(d, lanes, itemsize) == row
    assert row >= d and row >= lanes * w * -(-d // (lanes * w)) and row % w == 0
    assert (row * itemsize) % 128 == 16
    assert len({(r * row * itemsize // 16) % 8 for r in range(8)}) == 8


def _strided(x):
    """The same values in a view whose rows are not contiguous (every other dim of a wider array)."""
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


@pytest.mark.parametrize("dtype, d", [("float32", 8), ("float16", 16), ("float64", 6)])
def test_forward_v7_chunk_and_element_copies_agree(rng, dtype, d):
    """A strided K and V take v6's element copy; the results are the chunk copy's, bit for bit."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=9, seqlen_k=21,
                                  head_dim=d, dtype=dtype)
    ks, vs = _strided(k), _strided(v)
    assert fv7.chunk_reason(k, d, "k") is None and "not C-contiguous" in fv7.chunk_reason(ks, d, "k")
    o, lse = nc.attention(q, k, v, causal=True, config=tiny("v7"))
    o2, lse2 = nc.attention(q, ks, vs, causal=True, config=tiny("v7"))
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)


def test_forward_v7_chunk_reasons():
    assert fv7.chunk_reason(np.zeros((1, 1, 4, 8), np.float32), 8, "k") is None
    assert "16-byte chunks" in fv7.chunk_reason(np.zeros((1, 1, 4, 6), np.float32), 6, "v")
    assert "16-byte chunks" in fv7.chunk_reason(np.zeros((1, 1, 4, 4), np.float16), 4, "k")
    buf = np.zeros(1 + 32, np.float32)[1:].reshape(1, 1, 4, 8)     # 4 bytes past the buffer's start
    if buf.ctypes.data % 16:
        assert "16-byte boundary" in fv7.chunk_reason(buf, 8, "k")
