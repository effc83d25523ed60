"""Numba forward v6 (v5 with 16-byte shared-memory loads) on the simulator: the float64 oracle
(1e-12) and the 2x rule (float32, float16), GQA, causal with Nq != Nk (fully masked rows), a
window, ragged tiles and head dims that are not a multiple of a 16-byte chunk, the counted
traffic, its rows and tiles (iokernels.numba_cuda.policy) and its config checks.  Its PTX (the
16-byte loads) is checked in tests/test_numba_ptx.py, its speed on a GPU by the benchmark."""
from __future__ import annotations

import numpy as np
import pytest

import iokernels as ik
from iokernels import conventions as cv
from iokernels import gpu, reference, testing, traffic
from iokernels.core.config import TileConfig
from iokernels.numba_cuda import ForwardConfig, counting
import iokernels.numba_cuda as nc
from iokernels.numba_cuda import policy as NP
from iokernels.numba_cuda.config import SHARED_LIMIT_BYTES

sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counted traffic needs Numba's CUDA simulator")

#: small tiles (quick on the simulator) with several ragged tiles: 4 lanes a row group, 2 rows a thread
TINY = ForwardConfig(version="v6", block_q=8, block_k=8, threads_per_row=4, rows_per_thread=2)
#: 3 keys a lane (Bc = 12 over 4 lanes), one row a thread
TN3 = ForwardConfig(version="v6", block_q=4, block_k=12, threads_per_row=4, rows_per_thread=1)


def _masked(Nq, Nk, causal, window):
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    return (hi <= lo)[None, None, :, None]


# d = 7, 5, 9: not a multiple of a float32 chunk (4) nor of a float64 one (2); d = 20 float64:
# 10 chunks over 4 lanes, so the O block has a chunk past d (padding)
@pytest.mark.parametrize("cfg, causal, window, d", [(TINY, True, None, 7), (TN3, False, (3, 2), 5),
                                                    (TINY, False, None, 9), (TN3, True, None, 20)])
def test_forward_v6_float64_matches_oracle(rng, cfg, causal, window, d):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13,
                                  head_dim=d, dtype="float64")
    ro, rl = reference.attention(q, k, v, causal=causal, window=window)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="numba", config=cfg, return_lse=True)
    testing.assert_close(o, ro, masked_rows=_masked(19, 13, causal, window))
    testing.assert_close(lse, rl, name="lse")
    if causal:
        assert np.isneginf(lse[:, :, :6]).all() and (o[:, :, :6] == 0).all()


@pytest.mark.parametrize("dtype, d", [("float32", 8), ("float16", 8), ("float32", 13)])
def test_forward_v6_low_precision_two_x_rule(rng, dtype, d):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, heads_kv=1, seqlen_q=13, seqlen_k=29,
                                  head_dim=d, dtype=dtype)
    ro, rl = reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    o, lse = nc.attention(q, k, v, causal=True, config=TINY)
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")


def test_forward_v6_runs_by_name_at_its_default_tiles_and_v4_stays_the_default(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=3, seqlen_k=30, head_dim=4, dtype="float64")
    need = nc.need("attention", q=q, k=k, v=v)
    assert nc.REGISTRY.resolve("attention", None, need)[1].version == "v4"
    kern, cfg = nc.REGISTRY.resolve("attention", nc.ForwardConfig("v6"), need)
    assert cfg.version == "v6" and kern.file == "numba_cuda/forward_v6.py"
    o, lse = ik.attention(q, k, v, backend="numba", return_lse=True, config=nc.ForwardConfig("v6"))  # one tile
    ro, rl = reference.attention(q, k, v)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


@sim_only
@pytest.mark.parametrize("causal, window", [(False, None), (True, (5, 1))])
def test_forward_v6_counted_traffic_equals_fa2_model(rng, causal, window):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26,
                                  head_dim=3, dtype="float32")
    o, lse, counted = counting.count_attention(q, k, v, causal=causal, window=window, config=TINY)
    model = traffic.model("fa2", batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26, head_dim=3,
                          dtype="float32", causal=causal, window=window,
                          config=TileConfig(block_q=TINY.block_q, block_k=TINY.block_k))
    assert counted.as_dict() == model.as_dict()
    testing.assert_close(o, reference.attention(q, k, v, causal=causal, window=window)[0],
                         ik.attention(q, k, v, causal=causal, window=window, backend="naive"))


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


def test_forward_v6_tiles_are_the_largest_that_fit():
    assert NP.forward_v6_tiles(128, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 24)     # 64 + 32 rows do not fit
    assert (64 + 32) * 132 * 4 > SHARED_LIMIT_BYTES >= (64 + 24) * 132 * 4
    assert NP.forward_v6_tiles(64, 4, SHARED_LIMIT_BYTES, 8, 4) == (64, 32)
    assert NP.forward_v6_tiles(128, 8, SHARED_LIMIT_BYTES, 8, 4) == (32, 8)
    for d in (8, 59, 64, 128, 256):
        for dtype in ("float16", "float32", "float64"):
            cfg = ForwardConfig(version="v6").resolved(d, dtype)
            assert cfg.shared_bytes(d, dtype) <= SHARED_LIMIT_BYTES
            assert cfg.block_k % cfg.threads_per_row == 0 and cfg.block_q % cfg.rows_per_thread == 0
            assert cfg.threads <= 1024 and (cfg.threads % 32 == 0 or cfg.threads < 32)


def test_forward_v6_config_errors():
    with pytest.raises(ValueError, match="config.block_k: 6 must be a multiple of threads_per_row"):
        ForwardConfig(version="v6", block_k=6).resolved(8, "float32")
    with pytest.raises(ValueError, match="config.block_k"):                     # Q_i + K/V tile > 48 KiB
        ForwardConfig(version="v6", block_q=64, block_k=64).resolved(128, "float32")
    with pytest.raises(ValueError, match="config.block_q"):
        ForwardConfig(version="v6", block_q=6).resolved(8, "float32")
