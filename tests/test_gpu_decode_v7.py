"""Decode v7 (decode_v7.cu: decode v3 with the query group split over blocks, so a lane's registers
hold its block's slice) against the float64 oracle.  CuPy: skipped without a GPU.

float32 groups 8 (one block a KV head, one 8-warp block an SM), 32, 64 and 128 (2, 4 and 8
blocks a KV head; past 32 at head_dim 128 v3's merge buffer does not fit the SRAM), 71 (a prime
group: one head a block), multi-query attention and GQA with 8 KV heads, head dims 64 and 128;
float64 at head_dim 64; 16-bit rows the tensor-core versions do not take (head_dim 72), and by name at
head dims where they do (80, 96);
contiguous and paged caches (quantized caches and windows: test_gpu_decode_window_quant.py); ragged
lengths with a length-0 sequence (O = 0, LSE = -inf), 1 / 7 / the heuristic's splits, a sliding
window, the fused combine and the separate one.  O is held to FlashAttention's 2x rule
(:func:`iokernels.core.testing.check`: float64 to the oracle within its tolerance, the others at
most twice the naive decode's error in the same dtype, on the GPU), LSE to the oracle's.  Each
head's arithmetic in v7 is v3's in the same order, so v7 and v3 (where v3 runs) agree to a few
ulps.  The default (config None) runs v7 where the registry picks it (policy.HELD_BACK).
"""
import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, reference
from iokernels.core.testing import make_inputs

from decode_support import gpu_naive_decode, hold_decode
from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

#: |LSE - LSE_ref| allowed, by dtype (float32 log-sum-exp of the products in that dtype)
LSE_TOL = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-10}
SPLITS = (None, 1, 7)
LENS = (300, 0, 77)


def _cr():
    from iokernels import cupy_raw
    return cupy_raw


def _inputs(rng, torch, group, hkv, d, dtype):
    B, N = len(LENS), max(LENS)
    q, k, v = make_inputs(rng, batch=B, heads_q=group * hkv, heads_kv=hkv, seqlen_q=1, seqlen_k=N, head_dim=d,
                          dtype="float32")
    return (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q[:, :, 0], k, v))


def _baseline(torch, tq, tk, tv, lens, window=None):
    return gpu_naive_decode(torch, tq, tk, tv, lens, window)


def _hold(label, o, lse, ref_o, ref_l, base, dtype, problems):
    hold_decode(label, o, lse, ref_o, ref_l, base, dtype, problems, LSE_TOL[dtype])


def _split_of(cr, tq, tk, tv) -> int:
    """GROUP_SPLIT of v7's launch for these inputs (what the policy picks)."""
    n = cr.need("decode", q=tq, k=tk, v=tv)
    return cr.decode_v7_config.v7_group_split(n.head_dim, n.dtype, n.extra["group"])


@pytest.mark.parametrize("dtype,d,group,hkv", [
    ("float32", 128, 8, 2),      # one block a KV head at one block an SM
    ("float32", 128, 32, 8),     # two blocks a KV head, GQA
    ("float32", 128, 64, 1),     # MQA: four blocks, where v3's merge buffer does not fit
    ("float32", 64, 128, 1),     # eight blocks a KV head
    ("float32", 128, 71, 1),     # Falcon-7B's group: prime, one head a block
    ("float64", 64, 16, 2),      # float64: four heads a block
    ("bfloat16", 72, 16, 2),     # 16-bit rows v4 / v6 do not take (head_dim not a multiple of 16): the default
    ("bfloat16", 80, 16, 2),     # by name where v4 (d = 80) and v6 (d = 96, g = 32) are the default
    ("float16", 96, 32, 1),
])
def test_decode_v7_against_oracle(rng, dtype, d, group, hkv):
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, group, hkv, d, dtype)
    lens = np.array(LENS)
    assert cr.REGISTRY.get("decode", "v7").unavailable(cr.need("decode", q=tq, k=tk, v=tv)) is None
    split = _split_of(cr, tq, tk, tv)
    assert group % split == 0
    problems = []
    for window in (None, (40, 0)):
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens, window=window)
        base = _baseline(torch, tq, tk, tv, lens, window)
        for config in (None, cr.DecodeConfig("v7"), cr.DecodeConfig("v7", fused=False, stages=2, num_warps=4)):
            for S in SPLITS:
                o, lse = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=config, window=window)
                _hold(f"g={group} Hkv={hkv} d={d} {dtype} split={split} window={window} {config} S={S}", o, lse,
                      ref_o, ref_l, base, dtype, problems)
    assert not problems, "\n".join(problems)


def test_decode_v7_gives_v3s_arithmetic(rng):
    """At float32 g = 16 (v3 runs it, spilling; v7 at two blocks of 8 heads with a named
    min_blocks of 2 would too): v7 at its default and v3 agree to a few float32 ulps of |O|,
    at every split count; a second v7 call gives the same bits (the counters are back at 0)."""
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, 16, 2, 128, "float32")
    lens = np.array(LENS)
    for S in SPLITS:
        o7, l7 = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=cr.DecodeConfig("v7"))
        o3, l3 = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=cr.DecodeConfig("v3"))
        scale = float(o3.abs().max())
        assert float((o7 - o3).abs().max()) <= 8 * 2.0 ** -23 * scale, S
        fin = torch.isfinite(l3)
        assert torch.equal(fin, torch.isfinite(l7)) and float((l7[fin] - l3[fin]).abs().max()) < 1e-5, S
        again = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=cr.DecodeConfig("v7"))
        assert torch.equal(again[0], o7) and torch.equal(again[1], l7), S


@pytest.mark.parametrize("dtype,d,group,hkv,block_size", [
    ("float32", 128, 64, 1, 16),        # MQA over pages of 16
    ("float32", 64, 32, 2, 7),          # an odd page size: each copy finds its row
    ("float64", 64, 8, 2, 16),
])
def test_paged_decode_v7_matches_the_oracle(rng, dtype, d, group, hkv, block_size):
    torch = _torch()
    cr = _cr()
    lens = [300, 1, 77]
    cache = ik.PagedKVCache(sum(-(-n // block_size) for n in lens) + 3, block_size=block_size,
                            num_kv_heads=hkv, head_dim=d, dtype=np.dtype(dtype))
    sids = [cache.new_sequence() for _ in lens]
    for step in range(0, max(lens), 40):                  # interleaved appends: scattered blocks
        for sid, n in zip(sids, lens):
            m = min(40, n - step)
            if m > 0:
                cache.append(sid, rng.standard_normal((m, hkv, d)).astype(dtype),
                             rng.standard_normal((m, hkv, d)).astype(dtype))
    N = max(lens)
    kc = np.zeros((len(lens), hkv, N, d), dtype)
    vc = np.zeros_like(kc)
    for b, (sid, n) in enumerate(zip(sids, lens)):
        if n:
            kc[b, :, :n], vc[b, :, :n] = cache.gather(sid, backend="numpy")
    tq = torch.from_numpy(rng.standard_normal((len(lens), group * hkv, d)).astype(dtype)).cuda()
    tk, tv = (torch.from_numpy(x).cuda() for x in (kc, vc))
    pools = [torch.from_numpy(p).cuda() for p in (cache.k_pool, cache.v_pool)]
    tables, tl = cache.block_tables_array(sids)
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=np.array(lens))
    base = _baseline(torch, tq, tk, tv, lens)
    assert cr.REGISTRY.get("paged_decode", "v7").unavailable(cr.need("paged_decode", q=tq, cache=cache)) is None
    problems = []
    for config in (None, cr.DecodeConfig("v7"), cr.DecodeConfig("v7", num_warps=4, fused=False)):
        for S in SPLITS:
            o, lse = cr.paged_decode_pools(tq, pools[0], pools[1], tables, tl, num_splits=S, config=config)
            _hold(f"paged g={group} Hkv={hkv} d={d} {dtype} pages of {block_size} {config} S={S}", o, lse,
                  ref_o, ref_l, base, dtype, problems)
            o2, l2 = cr.paged_decode(tq, cache, sids, num_splits=S, config=config)   # the cache's host pools
            if not (torch.equal(o2, o) and torch.equal(l2, lse)):
                problems.append(f"paged_decode over the cache differs from the device pools: {config} S={S}")
    assert not problems, "\n".join(problems)


def test_decode_v7_through_the_public_api_and_a_plan(rng):
    """ik.decode(backend="cupy") on device arrays (its planned launch: workspaces, counters and
    the grid sized by the plan) gives what the eager launch gives, bit for bit, at float32 MQA
    g = 64 with v7 named; and the default, whichever version it picks, holds the 2x rule."""
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, 64, 1, 128, "float32")
    lens = np.array(LENS)
    cfg = cr.DecodeConfig("v7")
    eager = cr.decode(tq, tk, tv, seq_lens=lens, config=cfg)
    for _ in range(2):
        planned = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg, return_lse=True)
        assert torch.equal(planned[0], eager[0]) and torch.equal(planned[1], eager[1])
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens)
    problems = []
    _hold("default", *cr.decode(tq, tk, tv, seq_lens=lens), ref_o, ref_l,
          _baseline(torch, tq, tk, tv, lens), "float32", problems)
    assert not problems, "\n".join(problems)
