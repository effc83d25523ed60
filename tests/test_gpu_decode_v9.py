"""decode v9 (decode_v9.cu): v4 with the pairs' keys laid end to end and dealt in equal runs to
one wave of blocks.  CuPy on a GPU (sm_80 and up): skipped elsewhere.

The deal is new; the products are v4's.  So: against the float64 oracle by the 2x rule over
batches whose runs cross pairs (batches 17 and 34 x 8 KV heads, where policy.decode_balanced_deal
deals across pairs on 132 SMs; a test in test_policy.py says so without a GPU; batch 17 with the
8-warp block, one an SM, since the default's two 4-warp blocks an SM give its 136 pairs a wave of
their own and the deal is declined there), v4's splits dealt
as runs (3 blocks a pair, and the shapes the balanced deal leaves alone), ragged lengths with an
empty sequence and one shorter than a tile, a sliding window, both merges (fused, and the
separate combine reading slots a pair does not use), contiguous and paged; with one block a pair
(num_splits=1) it is v4 at one split bit for bit; where the deal is declined its launch is v4's
(test_policy.py says which without a GPU; here the same bits, eager and planned, contiguous and
paged); and its planned launch replays bit for bit under a CUDA graph after the query changes in
place.
"""
import numpy as np
import pytest

from iokernels import gpu, reference

from decode_support import gpu_naive_decode, hold_decode
from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

LSE_TOL = 2e-2
#: the warps of v4's large block (one an SM): batch 17 x 8 KV heads then leaves a last wave to deal
ONE_BLOCK_AN_SM = 8


def _cr():
    from iokernels import cupy_raw
    if cupy_raw.device_info()["cc"] < 80:
        pytest.skip("decode v9 (v4's tensor-core products) needs sm_80")
    return cupy_raw


def _inputs(torch, rng, B, Hq, Hkv, N, d, dtype):
    q = rng.standard_normal((B, Hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(np.float32) for _ in range(2))
    tdt = getattr(torch, dtype)
    return tuple(torch.from_numpy(x).cuda().to(tdt) for x in (q, k, v))


@pytest.mark.parametrize("B,Hq,Hkv,N,d,dtype", [
    (17, 32, 8, 1000, 128, "bfloat16"),        # 136 pairs on the SMs: runs cross pairs at one block an SM
    (34, 32, 8, 1000, 128, "float16"),         # 272 pairs: the balanced deal at one or two blocks an SM
    (17, 128, 8, 700, 64, "float16"),          # g = 16: rows 8..15 of the A operand
    (3, 8, 1, 2300, 256, "bfloat16"),          # g = 8 on one KV head, few pairs: several runs a pair
    (5, 4, 4, 333, 128, "float16"),            # MHA, keys not whole tiles
])
def test_v9_against_the_oracle(rng, B, Hq, Hkv, N, d, dtype):
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(torch, rng, B, Hq, Hkv, N, d, dtype)
    lens = np.full(B, N)
    lens[1], lens[-1] = 0, min(5, N)
    problems = []
    for window in (None, (300, 0)):
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens, window=window)
        base = gpu_naive_decode(torch, tq, tk, tv, lens, window)
        for fused in (None, True, False):
            for S in (None, 1, 3):
                cfg = cr.DecodeConfig("v9", fused=fused, num_warps=ONE_BLOCK_AN_SM if B == 17 else None)
                o, lse = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=cfg, window=window)
                hold_decode(f"fused={fused} S={S} window={window}", o, lse, ref_o, ref_l, base, dtype, problems,
                            LSE_TOL)
    assert not problems, "\n".join(problems)


def test_v9_paged_against_the_oracle(rng):
    torch = _torch()
    cr = _cr()
    from iokernels import bench
    B, Hq, Hkv, N, d = 17, 32, 8, 640, 128
    tq, tk, tv = _inputs(torch, rng, B, Hq, Hkv, N, d, "bfloat16")
    lens = np.full(B, N)
    lens[2], lens[5] = 0, 17
    kp, vp, tables, _ = bench.device_pages(tk, tv, seed=0, block_size=16)
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens)
    base = gpu_naive_decode(torch, tq, tk, tv, lens)
    problems = []
    for fused in (True, False):
        for S in (None, 2):
            o, lse = cr.paged_decode_pools(tq, kp, vp, tables, lens, num_splits=S,
                                           config=cr.DecodeConfig("v9", fused=fused))
            hold_decode(f"paged fused={fused} S={S}", o, lse, ref_o, ref_l, base, "bfloat16", problems, LSE_TOL)
    assert not problems, "\n".join(problems)


def test_v9_at_one_block_a_pair_is_v4_at_one_split(rng):
    """num_splits=1 deals each pair's keys to one block: v4's split, the same tiles, the same bits."""
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(torch, rng, 9, 32, 8, 1500, 128, "float16")
    lens = np.array([1500, 0, 3, 1499, 700, 1500, 16, 17, 1000])
    o9, l9 = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=1, config=cr.DecodeConfig("v9"))
    o4, l4 = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=1, config=cr.DecodeConfig("v4"))
    assert torch.equal(o9, o4) and torch.equal(l9, l4)


def test_v9_where_the_deal_is_declined_is_v4(rng):
    """Batch 17 x 8 KV heads at 256 keys (runs too short to deal) and batch 3 (fewer pairs than
    SMs): v9 without a split count launches v4, eager and through the public call's plan, over
    a contiguous cache and pages."""
    import iokernels as ik
    torch = _torch()
    cr = _cr()
    from iokernels import bench
    for B, N in ((17, 256), (3, 3008)):                 # whole pages of 16 keys
        tq, tk, tv = _inputs(torch, rng, B, 32, 8, N, 128, "float16")
        lens = np.full(B, N)
        lens[-1] = N // 3
        dl = torch.from_numpy(lens.astype(np.int32)).cuda()
        want = cr.decode(tq, tk, tv, seq_lens=lens, config=cr.DecodeConfig("v4"))
        for got in (cr.decode(tq, tk, tv, seq_lens=lens, config=cr.DecodeConfig("v9")),
                    ik.decode(tq, tk, tv, backend="cupy", seq_lens=dl, config=cr.DecodeConfig("v9"),
                              return_lse=True)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (B, N)
        kp, vp, tables, _ = bench.device_pages(tk, tv, seed=0, block_size=16)
        pw = cr.paged_decode_pools(tq, kp, vp, tables, lens, config=cr.DecodeConfig("v4"))
        pg = cr.paged_decode_pools(tq, kp, vp, tables, lens, config=cr.DecodeConfig("v9"))
        assert torch.equal(pg[0], pw[0]) and torch.equal(pg[1], pw[1]), ("paged", B, N)


def test_v9_in_the_plan_and_a_graph(rng):
    """The public call's planned launch of v9 gives the eager call's bits, and a CUDA graph of it
    replays them after the query changes in place (the deal is fixed by the plan: no host work)."""
    import iokernels as ik
    torch = _torch()
    cr = _cr()
    tq, tk, tv = _inputs(torch, rng, 17, 32, 8, 1200, 128, "bfloat16")
    lens = torch.tensor([1200] * 16 + [7], dtype=torch.int32, device="cuda")
    for cfg in (cr.DecodeConfig("v9", num_warps=ONE_BLOCK_AN_SM),
                cr.DecodeConfig("v9", fused=False, num_warps=ONE_BLOCK_AN_SM)):
        eager = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), config=cfg)
        planned = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg, return_lse=True)
        assert torch.equal(planned[0], eager[0]) and torch.equal(planned[1], eager[1])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, config=cfg)
        tq.copy_(torch.randn_like(tq))
        graph.replay()
        torch.cuda.synchronize()
        again = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), config=cfg)
        assert torch.equal(out, again[0])
