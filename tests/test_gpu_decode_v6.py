"""Decode v6 (decode_v6.cu: a group of more than 16 query heads a KV head, split across a team of
warps that shares each K/V tile) against the float64 oracle.  CuPy: skipped without a GPU.

Groups 32, 64 and 128 (teams of 2, 4 and 8 warps; past 64, one team fills the block), 71 (Falcon-7B's multi-query
shape: the last warp of the team holds 7 heads), multi-query attention (one KV head) and GQA
with 8 KV heads, head dims 64 and 128, float16 and bfloat16, contiguous and paged caches, ragged
lengths with a length-0 sequence (O = 0, LSE = -inf), 1 / 7 / the heuristic's splits, a
sliding window, and partial slices (g = 24, 40: the last warp of a team holds fewer than 16
heads).  O is held to FlashAttention's 2x rule (:func:`iokernels.core.testing.check`: at most
twice the naive decode's error in the same dtype, on the GPU), LSE to the oracle's within
LSE_TOL.  The default (config None) runs v6 at the groups policy.HELD_BACK and
policy.decode_v6_default_at let it (v3 or v1 elsewhere; on Hopper, over a contiguous cache, v8 from
17 to 64 query heads a KV head), held to the same rule.
"""
import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, reference
from iokernels.core.testing import make_inputs

from decode_support import gpu_naive_decode, hold_decode
from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

#: |LSE - LSE_ref| allowed (float32 log-sum-exp of 16-bit products)
LSE_TOL = 2e-2
SPLITS = (None, 1, 7)
LENS = (300, 0, 77)
#: one ulp of |O| in its dtype: paged and contiguous decodes of the same keys agree to it
OUT_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _cr():
    from iokernels import cupy_raw
    return cupy_raw


def _default_is_v6(cr, n) -> bool:
    """Whether the default runs v6 for these inputs: past 16 query heads a KV head it must,
    unless decode v8 takes them (on Hopper, a contiguous cache, up to 64), policy.HELD_BACK
    holds it or the group is past policy.decode_v6_default_at (then it must not: v3, or v1
    where v3's ring does not fit)."""
    picked = cr.REGISTRY.resolve("decode", None, n)[0].version
    group = n.extra["group"]
    v8 = cr.REGISTRY.get("decode", "v8")
    if v8.unavailable(n) is None and v8.not_default(n) is None:      # on Hopper: decode v8 takes the group
        assert picked == "v8", (picked, group)
        return False
    assert (picked == "v6") == (cr.policy.held_back("decode", "v6") is None
                                and cr.policy.decode_v6_default_at(group)), (picked, group)
    return picked == "v6"


def _inputs(rng, torch, group, hkv, d, dtype):
    B, N = len(LENS), max(LENS)
    q, k, v = make_inputs(rng, batch=B, heads_q=group * hkv, heads_kv=hkv, seqlen_q=1, seqlen_k=N, head_dim=d,
                          dtype="float32")
    tq, tk, tv = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q[:, :, 0], k, v))
    return tq, tk, tv


def _baseline(torch, tq, tk, tv, lens, window=None):
    return gpu_naive_decode(torch, tq, tk, tv, lens, window)


def _hold(label, o, lse, ref_o, ref_l, base, dtype, problems):
    hold_decode(label, o, lse, ref_o, ref_l, base, dtype, problems, LSE_TOL)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group,hkv", [(32, 1), (32, 8), (64, 1), (64, 8), (128, 1), (71, 1)])
def test_decode_v6_large_groups_against_oracle(rng, group, hkv, d, dtype):
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, group, hkv, d, dtype)
    lens = np.array(LENS)
    n = cr.need("decode", q=tq, k=tk, v=tv)
    _default_is_v6(cr, n)
    problems = []
    for window in (None, (40, 0)):
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens, window=window)
        base = _baseline(torch, tq, tk, tv, lens, window)
        for config in (None, cr.DecodeConfig("v6"), cr.DecodeConfig("v6", fused=False, stages=2)):
            for S in SPLITS:
                o, lse = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=config, window=window)
                _hold(f"g={group} Hkv={hkv} d={d} {dtype} window={window} {config} S={S}", o, lse,
                      ref_o, ref_l, base, dtype, problems)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("group,hkv,d,dtype,block_size", [
    (32, 1, 128, "bfloat16", 16),      # MQA, pages of 16
    (64, 8, 64, "float16", 7),         # odd page size: each copy finds its row
    (24, 2, 128, "float16", 16),       # a partial slice: the team's second warp holds 8 heads
    (40, 1, 64, "bfloat16", 5),        # a team of 4 warps, the last one idle
])
def test_paged_decode_v6_matches_the_oracle(rng, group, hkv, d, dtype, block_size):
    torch = _torch()
    cr = _cr()
    lens = [300, 1, 77]                                   # every sequence holds a block
    cache = ik.PagedKVCache(sum(-(-n // block_size) for n in lens) + 3, block_size=block_size,
                            num_kv_heads=hkv, head_dim=d, dtype=np.dtype("float32"))
    sids = [cache.new_sequence() for _ in lens]
    for step in range(0, max(lens), 40):                  # interleaved appends: scattered blocks
        for sid, n in zip(sids, lens):
            m = min(40, n - step)
            if m > 0:
                cache.append(sid, rng.standard_normal((m, hkv, d)).astype(np.float32),
                             rng.standard_normal((m, hkv, d)).astype(np.float32))
    N = max(lens)
    kc = np.zeros((len(lens), hkv, N, d), np.float32)
    vc = np.zeros_like(kc)
    for b, (sid, n) in enumerate(zip(sids, lens)):
        if n:
            kc[b, :, :n], vc[b, :, :n] = cache.gather(sid, backend="numpy")
    tdt = getattr(torch, dtype)
    tq = torch.from_numpy(rng.standard_normal((len(lens), group * hkv, d)).astype(np.float32)).cuda().to(tdt)
    tk, tv = (torch.from_numpy(x).cuda().to(tdt) for x in (kc, vc))
    pools = [torch.from_numpy(p).cuda().to(tdt) for p in (cache.k_pool, cache.v_pool)]
    tables, tl = cache.block_tables_array(sids)
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=np.array(lens))
    base = _baseline(torch, tq, tk, tv, lens)
    problems = []
    for config in (None, cr.DecodeConfig("v6"), cr.DecodeConfig("v6", tile_rows=16, num_warps=4)):
        for S in SPLITS:
            o, lse = cr.paged_decode_pools(tq, pools[0], pools[1], tables, tl, num_splits=S, config=config)
            _hold(f"paged g={group} Hkv={hkv} d={d} {dtype} pages of {block_size} {config} S={S}", o, lse,
                  ref_o, ref_l, base, dtype, problems)
        # contiguous, same splits: the same arithmetic over the same keys
        o_c, _ = cr.decode(tq, tk, tv, seq_lens=np.array(lens), num_splits=4, config=config)
        o_p, _ = cr.paged_decode_pools(tq, pools[0], pools[1], tables, tl, num_splits=4, config=config)
        gap = float((o_c.float() - o_p.float()).abs().max())
        if gap > OUT_ULP[dtype] * float(o_c.float().abs().max()):
            problems.append(f"paged and contiguous at 4 splits differ by {gap:.3g}: {config}")
    assert not problems, "\n".join(problems)


def test_decode_v6_twice_and_in_the_public_api(rng):
    """The fused combine's counters are back at 0 after a call (a second call gives the same
    bits), and ik.decode(backend="cupy") runs the registry's default at MQA with g = 32 (v6
    once policy.HELD_BACK lets it)."""
    torch = _torch()
    tq, tk, tv = _inputs(rng, torch, 32, 1, 128, "bfloat16")
    lens = np.array(LENS)
    cr = _cr()
    a = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=7, config=cr.DecodeConfig("v6"))
    b = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=7, config=cr.DecodeConfig("v6"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    o = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens)
    assert torch.equal(o, cr.decode(tq, tk, tv, seq_lens=lens)[0])
    if _default_is_v6(cr, cr.need("decode", q=tq, k=tk, v=tv)):
        assert torch.equal(o, cr.decode(tq, tk, tv, seq_lens=lens, config=cr.DecodeConfig("v6"))[0])
