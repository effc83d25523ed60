"""Decode v8 (decode_v8.cu: on Hopper, the query group as one warpgroup's wgmma rows, K/V tiles by
TMA) against the float64 oracle.  CuPy on a Hopper GPU: skipped elsewhere.

Groups 1 (one row of 64), 4, 16, 32 and 64 (a full tile), GQA with several KV heads and
multi-query attention, head dims 64, 128 (two consumer warpgroups) and 256 (one), float16 and
bfloat16; ragged lengths with a length-0 sequence (O = 0, LSE = -inf) whose unused cache rows hold
NaN (a split's last tile reads past its end: those keys must vanish, not poison O), 1 / 7 / the
heuristic's splits, a sliding window, the fused combine and the separate one, 128-key tiles by
name, a view of a longer cache (the tensor maps take its strides).  O is held to FlashAttention's
2x rule (:func:`iokernels.core.testing.check`: at most twice the naive decode's error in the same
dtype, on the GPU), LSE to the oracle's.  The planned public call and a CUDA graph's replay give
the eager launch's bits.
"""
import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, reference
from iokernels.core.testing import make_inputs

from decode_support import gpu_naive_decode, hold_decode
from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

LSE_TOL = {"float16": 2e-2, "bfloat16": 2e-2}
SPLITS = (None, 1, 7)
LENS = (300, 0, 77)


def _cr():
    from iokernels import cupy_raw
    from iokernels.cupy_raw.hopper.checks import available
    if available() is not None:
        pytest.skip(f"decode v8 runs on Hopper: {available()}")
    return cupy_raw


def _inputs(rng, torch, group, hkv, d, dtype, n=max(LENS)):
    """q (B, g * hkv, d), k, v (B, hkv, n, d) on the GPU; each sequence's rows past its LENS
    length are NaN (a cache's unused rows may hold anything)."""
    B = len(LENS)
    q, k, v = make_inputs(rng, batch=B, heads_q=group * hkv, heads_kv=hkv, seqlen_q=1, seqlen_k=n, head_dim=d,
                          dtype="float32")
    for b, m in enumerate(LENS):
        k[b, :, m:] = np.nan
        v[b, :, m:] = np.nan
    return (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q[:, :, 0], k, v))


def _configs(cr, d):
    out = [cr.DecodeConfig("v8"), cr.DecodeConfig("v8", fused=False, stages=2)]
    if d <= 128:
        out.append(cr.DecodeConfig("v8", tile_rows=128 if d == 128 else 64, stages=4 if d == 64 else 2))
    return out


@pytest.mark.parametrize("dtype,d,group,hkv", [
    ("bfloat16", 128, 32, 2),    # GQA, half a tile of rows
    ("bfloat16", 128, 64, 1),    # MQA: a full tile
    ("float16", 128, 4, 2),      # Llama-3's group
    ("bfloat16", 64, 16, 2),     # 128-key tiles
    ("float16", 64, 1, 3),       # one row of 64
    ("bfloat16", 256, 32, 2),    # one consumer warpgroup
    ("float16", 256, 8, 1),
])
def test_decode_v8_against_oracle(rng, dtype, d, group, hkv):
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, group, hkv, d, dtype)
    lens = np.array(LENS)
    assert cr.REGISTRY.get("decode", "v8").unavailable(cr.need("decode", q=tq, k=tk, v=tv)) is None
    problems = []
    for window in (None, (40, 0)):
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens, window=window)
        base = gpu_naive_decode(torch, tq, tk, tv, lens, window)
        for config in _configs(cr, d):
            for S in SPLITS:
                o, lse = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=config, window=window)
                hold_decode(f"g={group} Hkv={hkv} d={d} {dtype} window={window} {config} S={S}", o, lse,
                            ref_o, ref_l, base, dtype, problems, LSE_TOL[dtype])
    assert not problems, "\n".join(problems)


def test_decode_v8_reads_a_view_of_a_longer_cache(rng):
    """k, v as the first 300 rows of a 512-row cache (strides of the longer cache): the tensor maps
    take the view's strides, so v8 reads it in place and gives what it gives the contiguous copy,
    bit for bit; the splits of a 1000-key cache with every length full give the 2x rule."""
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, 8, 2, 128, "bfloat16")
    big_k = torch.full((3, 2, 512, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    big_v = big_k.clone()
    big_k[:, :, :300], big_v[:, :, :300] = tk, tv
    vk, vv = big_k[:, :, :300], big_v[:, :, :300]
    assert not vk.is_contiguous()
    lens = np.array(LENS)
    cfg = cr.DecodeConfig("v8")
    for S in SPLITS:
        a = cr.decode(tq, vk, vv, seq_lens=lens, num_splits=S, config=cfg)
        b = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=cfg)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), S
    tq, tk, tv = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((2, 32, 128), (2, 4, 1000, 128),
                                                                                 (2, 4, 1000, 128)))
    ref_o, ref_l = reference.decode(tq, tk, tv)
    problems = []
    for S in (None, 3, 128):
        hold_decode(f"full lengths S={S}", *cr.decode(tq, tk, tv, num_splits=S, config=cfg), ref_o, ref_l,
                    gpu_naive_decode(torch, tq, tk, tv, [1000, 1000]), "bfloat16", problems, LSE_TOL["bfloat16"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("group", [4, 32])
def test_decode_v8_through_the_public_api_a_plan_and_a_graph(rng, group):
    """ik.decode(backend="cupy") on device arrays (the planned launch) gives the eager launch's
    bits, twice (the fused combine's counters are back at 0), and so does a CUDA graph's replay
    of it after the inputs change in place; at 4 query heads a KV head (head dim 128) the split
    kernel merges the splits itself, at 32 it leaves the merge to decode.cu's combine
    (policy.decode_fuse_combine), both launches packed."""
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(rng, torch, group, 8, 128, "bfloat16")
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    cfg = cr.DecodeConfig("v8")
    eager = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), config=cfg)
    for _ in range(2):
        planned = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg, return_lse=True)
        assert torch.equal(planned[0], eager[0]) and torch.equal(planned[1], eager[1])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg)       # plan and compile first
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg)
    tq.copy_(torch.randn_like(tq))
    graph.replay()
    torch.cuda.synchronize()
    again = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), config=cfg)
    assert torch.equal(out, again[0])
