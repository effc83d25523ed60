"""Numba decode split kernel v4 (16-byte loads) on the simulator: the float64 oracle by the 2x
rule (float16, float32), GQA, empty sequences and empty splits, lengths off the tile, a
window, the paged cache, the counted traffic, and which calls it refuses (and the default
then falls back to v3).  Its PTX (16-byte loads) is checked in tests/test_numba_ptx.py, its
speed on a GPU by tests/test_numba_gpu.py and the benchmark."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from iokernels import gpu, traffic
from iokernels.numba_cuda import DecodeConfig, counting
import iokernels.numba_cuda as nc
from decode_support import check_decode as _check, decode_inputs as _inputs
from iokernels.paged import PagedKVCache

d4 = importlib.import_module("iokernels.numba_cuda.decode_v4")
sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counting arrays run on the simulator")

#: small tilings (quick on the simulator) through each path of the lane all-reduce: R = KPI*g
#: values over L lanes with R > L, R < L (plain butterfly steps), R == L
V4_SMALL = DecodeConfig(version="v4", lanes_per_key=2, keys_per_iter=2, key_groups=2)
V4_R_LT_L = DecodeConfig(version="v4", lanes_per_key=4, keys_per_iter=1, key_groups=2)
V4_R_EQ_L = DecodeConfig(version="v4", lanes_per_key=4, keys_per_iter=2, key_groups=3)


@pytest.mark.parametrize("dtype,d,Hq,cfg,S", [
    ("float16", 16, 4, V4_SMALL, 2),         # 2 pairs a row, one a lane; R = 4 > L = 2
    ("float16", 24, 6, V4_R_EQ_L, 1),        # 3 pairs over 4 lanes (one lane idle); g = 3: R = 6 -> 8
    ("float32", 8, 2, V4_R_LT_L, 3),         # g = 1: R = 1 < L = 4: plain butterflies
    ("float16", 16, 4, DecodeConfig(version="v4"), 3),   # the defaults (L clipped to the row's pairs)
    ("float32", 12, 4, V4_R_EQ_L, 5)])       # 3 pairs of 4 floats; more splits than a short sequence's tiles
def test_decode_v4_ragged_gqa_matches_oracle(rng, dtype, d, Hq, cfg, S):
    q, k, v = _inputs(rng, 3, Hq, 2, 37, d, dtype)         # 37 keys: not a multiple of the 16-key tile
    lens = np.array([37, 9, 0])                            # the short one leaves splits empty; one empty sequence
    o, lse = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg)
    assert o.dtype == np.dtype(dtype)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()
    _check(o, lse, q, k, v, lens)


def test_decode_v4_window_and_default_dispatch(rng):
    q, k, v = _inputs(rng, 2, 4, 2, 41, 8, "float16")
    lens = np.array([41, 20])
    o, lse = nc.decode(q, k, v, seq_lens=lens, num_splits=3, config=V4_SMALL, window=(17, 0))
    _check(o, lse, q, k, v, lens, window=(17, 0))
    need = nc.need("decode", q=q, k=k, v=v)
    assert nc.REGISTRY.resolve("decode", None, need)[1].version == "v6"     # the default here: v4 runs, so v6 does


@sim_only
def test_decode_v4_counted_traffic_equals_model(rng):
    """K and V read once (as pairs of words), the prefetch past the last key reading nothing."""
    q, k, v = _inputs(rng, 2, 4, 1, 40, 8, np.float16)
    lens = np.array([40, 17])
    o, lse, counted = counting.count_decode(q, k, v, seq_lens=lens, num_splits=2, config=V4_SMALL)
    _check(o, lse, q, k, v, lens)
    model = traffic.model("decode", batch=2, heads_q=4, heads_kv=1, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16")
    got = counted.as_dict()
    assert got.pop("seq_lens") == (2 * 1 * 2 * 4, 0)
    assert got == model.as_dict()


def _scattered_cache(rng, lens, hkv, d, dtype, bs=4):
    cache = PagedKVCache(40, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    hole = cache.new_sequence()
    cache.append(hole, *(rng.standard_normal((3 * bs, hkv, d)).astype(dtype) for _ in range(2)))
    sids = [cache.new_sequence() for _ in lens]
    cache.free(hole)
    left = list(lens)
    while any(left):
        for i, sid in enumerate(sids):
            t = min(left[i], int(rng.integers(1, 2 * bs)))
            if t:
                cache.append(sid, *(rng.standard_normal((t, hkv, d)).astype(dtype) for _ in range(2)))
                left[i] -= t
    return cache, sids


@pytest.mark.parametrize("addressing", ["page", "key"])
def test_paged_decode_v4_matches_oracle(rng, addressing):
    lens = [13, 0, 6]
    cache, sids = _scattered_cache(rng, lens, 2, 8, np.float16)
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    kk, vv = np.zeros((3, 2, 13, 8), np.float16), np.zeros((3, 2, 13, 8), np.float16)
    for b, s in enumerate(sids):
        kg, vg = cache.gather(s)
        kk[b, :, :lens[b]], vv[b, :, :lens[b]] = kg, vg
    cfg = V4_SMALL.replace(paged_addressing=addressing)
    o, lse = nc.paged_decode(q, cache, sids, num_splits=2, config=cfg)
    _check(o, lse, q, kk, vv, lens)


@sim_only
def test_paged_decode_v4_counted_traffic_equals_model(rng):
    lens = [13, 0, 6]
    cache, sids = _scattered_cache(rng, lens, 2, 8, np.float16)
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    _, _, counted = counting.count_paged_decode(q, cache, sids, num_splits=2, config=V4_SMALL)
    model = traffic.model("paged_decode", batch=3, heads_q=4, heads_kv=2, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16", block_size=4)
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()


def test_v4_refuses_what_it_cannot_read_and_the_default_falls_back(rng):
    R = nc.REGISTRY
    for dtype, d in (("float16", 12), ("float32", 6), ("float64", 8)):      # rows not whole 16-byte pairs
        q, k, v = _inputs(rng, 1, 2, 1, 5, d, dtype)
        n = nc.need("decode", q=q, k=k, v=v)
        assert R.get("decode", "v4").unavailable(n), (dtype, d)
        assert R.resolve("decode", None, n)[1].version == "v3"
        with pytest.raises(ValueError, match="pairs|float64"):
            nc.decode(q, k, v, config=DecodeConfig(version="v4"))
    assert d4.pair_reason("float16", 64) is None and "16-byte" in d4.pair_reason("float16", 60)
    from numba import cuda
    q, k, v = _inputs(rng, 1, 2, 1, 5, 8, "float16")
    kd = cuda.to_device(np.zeros((1, 2, 9, 8), np.float16))
    strided = nc.need("decode", q=q, k=kd[:, :, :5], v=kd[:, :, :5])
    assert "C-contiguous" in R.get("decode", "v4").unavailable(strided)
    cache = PagedKVCache(4, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16", kv_dtype="int8")
    assert "v3" in R.get("paged_decode", "v4").unavailable(nc.need("paged_decode", q=q, cache=cache))


def test_v4_tiling_and_shared_memory():
    assert d4.split_v4_tiling(128, "float16") == (16, d4.KEYS_PER_ITER_V4, d4.KEY_GROUPS_V4)   # one pair a lane
    assert d4.split_v4_tiling(128, "float32")[0] == 16                                        # two pairs a lane
    assert d4.split_v4_tiling(64, "float16")[0] == 8
    assert d4.split_v4_tiling(16, "float16", DecodeConfig(version="v4", lanes_per_key=8))[0] == 2
    dec = importlib.import_module("iokernels.numba_cuda.decode")
    for d in (8, 64, 128, 256):
        assert dec.smem_reason(DecodeConfig(version="v4"), d, 8, "float16") is None
    with pytest.raises(ValueError, match="key_groups"):
        DecodeConfig(version="v2", key_groups=2)
