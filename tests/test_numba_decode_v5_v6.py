"""Numba decode split kernels v5 (v4 with its scores in log2 units, every exponential an exp2)
and v6 (v5 with no bounds checks in a split's interior) on the simulator: the float64 oracle
by the 2x rule (float16, float32) through each path of the lane all-reduce, GQA, empty
sequences and splits, a window, the paged cache with both addressings, the counted traffic,
v6 equal to v5 bit for bit, which calls they refuse, and that v6 is the default.
Their PTX is checked in tests/test_numba_ptx.py."""
from __future__ import annotations

import numpy as np
import pytest

from iokernels import gpu, traffic
from iokernels.numba_cuda import DecodeConfig, counting
import iokernels.numba_cuda as nc
from decode_support import check_decode as _check, decode_inputs as _inputs
from iokernels.paged import PagedKVCache

sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counting arrays run on the simulator")

#: small tilings (quick on the simulator): R = KPI*g values over L lanes with R > L, R == L, R < L;
#: steps of 4 to 6 keys, so a split of 37 keys has interior steps (v6) and checked ones
V5_SMALL = DecodeConfig(version="v5", lanes_per_key=2, keys_per_iter=2, key_groups=2)
V5_R_EQ_L = DecodeConfig(version="v5", lanes_per_key=4, keys_per_iter=2, key_groups=3)
V5_R_LT_L = DecodeConfig(version="v5", lanes_per_key=4, keys_per_iter=1, key_groups=2)
VERSIONS = ("v5", "v6")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype,d,Hq,cfg,S,window", [
    ("float16", 16, 4, V5_SMALL, 2, None),            # R = 4 > L = 2
    ("float16", 24, 6, V5_R_EQ_L, 1, (17, 0)),        # 3 pairs over 4 lanes; g = 3: R = 6 -> 8; a window
    ("float32", 8, 2, V5_R_LT_L, 3, None),            # g = 1: R = 1 < L = 4: plain butterflies
    ("float32", 12, 4, V5_R_EQ_L, 5, (9, 0))])        # more splits than a short sequence's tiles
def test_decode_v5_v6_ragged_gqa_matches_oracle(rng, dtype, d, Hq, cfg, S, window, version):
    q, k, v = _inputs(rng, 3, Hq, 2, 37, d, dtype)   # 37 keys: not a multiple of the 16-key tile
    lens = np.array([37, 9, 0])                      # the short one leaves splits empty; one empty sequence
    o, lse = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg.replace(version=version), window=window)
    assert o.dtype == np.dtype(dtype)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()
    _check(o, lse, q, k, v, lens, window)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("addressing", ["page", "key"])
def test_paged_decode_v5_v6_matches_oracle(rng, addressing, version):
    lens = [13, 0, 6]
    cache = PagedKVCache(12, block_size=4, num_kv_heads=2, head_dim=8, dtype=np.float16)
    sids = [cache.new_sequence() for _ in lens]
    for step in range(13):                                   # one token at a time, interleaved: scattered blocks
        for sid, n in zip(sids, lens):
            if step < n:
                cache.append(sid, *(rng.standard_normal((1, 2, 8)).astype(np.float16) for _ in range(2)))
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    kk, vv = np.zeros((3, 2, 13, 8), np.float16), np.zeros((3, 2, 13, 8), np.float16)
    for b, s in enumerate(sids):
        if lens[b]:
            kk[b, :, :lens[b]], vv[b, :, :lens[b]] = cache.gather(s)
    o, lse = nc.paged_decode(q, cache, sids, num_splits=2,
                             config=V5_SMALL.replace(paged_addressing=addressing, version=version))
    _check(o, lse, q, kk, vv, lens)


@sim_only
@pytest.mark.parametrize("version", VERSIONS)
def test_decode_v5_v6_counted_traffic_equals_model(rng, version):
    """v4's bytes: K and V read once as pairs of words, the prefetch past the last key reading
    nothing (v6: the interior's unchecked loads never reach past a split's end)."""
    q, k, v = _inputs(rng, 2, 4, 1, 40, 8, np.float16)
    lens = np.array([40, 17])
    o, lse, counted = counting.count_decode(q, k, v, seq_lens=lens, num_splits=2,
                                            config=V5_SMALL.replace(version=version))
    _check(o, lse, q, k, v, lens)
    model = traffic.model("decode", batch=2, heads_q=4, heads_kv=1, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16")
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()


def test_v6_equals_v5_bit_for_bit(rng):
    """The interior's unchecked steps compute what v5's checked ones do for keys that exist."""
    q, k, v = _inputs(rng, 2, 4, 2, 45, 16, "float16")
    lens = np.array([45, 30])
    for cfg, S in ((V5_SMALL, 1), (V5_R_EQ_L, 3)):
        a = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg)
        b = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg.replace(version="v6"))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_default_and_refusing_what_v4_refuses(rng, version, monkeypatch):
    """v6 is the default wherever v4 runs (v5 ranks between them); a version put back into
    policy.HELD_BACK runs by name only, and the default passes over it."""
    from iokernels.numba_cuda import policy
    R = nc.REGISTRY
    q, k, v = _inputs(rng, 1, 4, 2, 5, 8, "float16")
    n = nc.need("decode", q=q, k=k, v=v)
    rec = R.get("decode", version)
    assert rec.unavailable(n) is None and R.get("decode", "v6").rank > R.get("decode", "v5").rank > \
        R.get("decode", "v4").rank
    assert R.resolve("decode", None, n)[1].version == "v6" and rec.not_default(n) is None
    monkeypatch.setitem(policy.HELD_BACK, ("decode", "v6"), "a record with v6 ahead of v5")
    assert "not the default until measured" in R.get("decode", "v6").not_default(n)
    assert R.resolve("decode", None, n)[1].version == "v5"
    for dtype, d in (("float16", 12), ("float64", 8)):              # rows not whole 16-byte pairs
        q, k, v = _inputs(rng, 1, 2, 1, 5, d, dtype)
        assert R.get("decode", version).unavailable(nc.need("decode", q=q, k=k, v=v))
        with pytest.raises(ValueError, match="pairs|float64"):
            nc.decode(q, k, v, config=DecodeConfig(version=version))
    cache = PagedKVCache(4, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16", kv_dtype="int8")
    q16 = rng.standard_normal((1, 2, 8)).astype(np.float16)
    assert "v3" in R.get("paged_decode", version).unavailable(nc.need("paged_decode", q=q16, cache=cache))
