"""The separate decode combine in its two kernels: decode.cu's (a thread a column walks the splits
one after another, DecodeConfig(combine="serial")) and decode_combine.cu's (the splits' LSEs read
side by side, their weights in SRAM, combine="parallel").  CuPy on a GPU: skipped elsewhere.

Decode v1 (every dtype, float64 to the oracle's tolerance), v4 and, on Hopper, v8 (16-bit, their
combine left separate with fused=False) over ragged lengths with a length-0 sequence and one
shorter than a split count (splits with no keys: LSE -inf, they must weigh nothing), at 7 splits
and at 1100 (more than the 1024 weights decode_combine.cu holds in SRAM at once, so it merges in
two chunks).  O is held to FlashAttention's 2x rule against the naive decode in the same dtype,
LSE to the oracle's; the two combines agree to the rounding of their sums' order.
"""
import numpy as np
import pytest

from iokernels import gpu, reference
from iokernels.core.testing import as_numpy, make_inputs

from decode_support import gpu_naive_decode, hold_decode
from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

LSE_TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2, "float64": 1e-10}
#: how far the two combines may differ (absolute up to 1, relative past it; about two units in the
#: last place of the output dtype): their sums are the same terms, the row sum added in another order
AGREE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}
LENS = (2300, 0, 5)
SPLITS = (7, 1100)


def _cr():
    from iokernels import cupy_raw
    return cupy_raw


@pytest.mark.parametrize("version", ["v1", "v4", "v8"])
@pytest.mark.parametrize("d", [64, 128])
def test_parallel_combine_merges_what_the_serial_one_does(rng, version, d):
    torch = _torch()
    cr = _cr()
    dtypes = ("float32", "float64", "float16", "bfloat16") if version == "v1" else ("float16", "bfloat16")
    fused = {} if version == "v1" else {"fused": False}
    problems, ran = [], 0
    for dtype in dtypes:
        q, k, v = make_inputs(rng, batch=len(LENS), heads_q=8, heads_kv=2, seqlen_q=1, seqlen_k=max(LENS),
                              head_dim=d, dtype="float32")
        tq, tk, tv = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q[:, :, 0], k, v))
        serial = cr.DecodeConfig(version, combine="serial", **fused)
        parallel = cr.DecodeConfig(version, combine="parallel", **fused)
        why = cr.REGISTRY.get("decode", version).unavailable(cr.need("decode", q=tq, k=tk, v=tv))
        if why is not None:
            assert version != "v1" or dtype == "bfloat16", why      # v1 runs every dtype (bf16 from sm_80)
            continue
        ran += 1
        lens = np.array(LENS)
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens)
        base = gpu_naive_decode(torch, tq, tk, tv, LENS) if dtype != "float64" else None
        for S in SPLITS:
            o_s, l_s = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=serial)
            o_p, l_p = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, config=parallel)
            label = f"{version} {dtype} d={d} S={S}"
            hold_decode(f"{label} parallel", o_p, l_p, ref_o, ref_l, base, dtype, problems, LSE_TOL[dtype])
            hold_decode(f"{label} serial", o_s, l_s, ref_o, ref_l, base, dtype, problems, LSE_TOL[dtype])
            a, b = (as_numpy(x).astype(np.float64) for x in (o_p, o_s))
            gap = float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b))))
            if gap > AGREE[dtype]:
                problems.append(f"{label}: the combines differ by {gap:.3g} (relative past 1)")
            if not np.array_equal(np.isneginf(as_numpy(l_p)), np.isneginf(as_numpy(l_s))):
                problems.append(f"{label}: the combines disagree on which rows are empty")
    assert not problems, "\n".join(problems)
    if version == "v8" and ran == 0:
        pytest.skip("decode v8 runs on Hopper")
    assert ran, f"decode {version} ran no dtype"


def test_parallel_combine_in_the_plan_and_a_graph(rng):
    """The public call's planned launch packs decode_combine.cu's launch like decode.cu's: its bits
    are the eager call's, and a CUDA graph of it replays them after the query changes in place."""
    import iokernels as ik
    torch = _torch()
    cr = _cr()
    q, k, v = make_inputs(rng, batch=3, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_k=2000, head_dim=128,
                          dtype="float32")
    tq, tk, tv = (torch.from_numpy(x).cuda().half() for x in (q[:, :, 0], k, v))
    lens = torch.tensor([2000, 17, 900], dtype=torch.int32, device="cuda")
    cfg = cr.DecodeConfig("v4", fused=False, combine="parallel")
    eager = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), num_splits=9, config=cfg)
    planned = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, num_splits=9, config=cfg, return_lse=True)
    assert torch.equal(planned[0], eager[0]) and torch.equal(planned[1], eager[1])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, num_splits=9, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ik.decode(tq, tk, tv, backend="cupy", seq_lens=lens, num_splits=9, config=cfg)
    tq.copy_(torch.randn_like(tq))
    graph.replay()
    torch.cuda.synchronize()
    again = cr.decode(tq, tk, tv, seq_lens=lens.cpu().numpy(), num_splits=9, config=cfg)
    assert torch.equal(out, again[0])
