"""Where the host time of one call goes: cProfile over a loop of calls, on a GPU.

    python scripts/host_profile.py [--op decode|attention|both] [--calls 1000] [--top 14]

Each op runs at one small shape (:data:`SHAPES`; bfloat16, torch CUDA tensors, the CuPy
backend's default) and, beside it, torch's SDPA on the same tensors.  It
prints the loop's microseconds a call (what :func:`iokernels.bench.timer.host_ms_loop`
records in the benchmark's ``host_ms``) for both, then the functions that take the most of
ours (``tottime``: time inside the function itself).  The profiler's own cost inflates every
entry; compare entries with each other, not with the unprofiled loop.  Needs CUDA, torch and
CuPy: without them it says so and exits 0.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: small shapes: the kernels take a few microseconds, so the loop measures the host, not a full
#: launch queue waiting on the device
SHAPES = {"decode": dict(batch=1, heads_q=32, heads_kv=8, seqlen=1024, head_dim=128),
          "attention": dict(batch=1, heads_q=16, heads_kv=16, seqlen=256, head_dim=128)}


def _calls(op, torch):
    import iokernels as ik
    s = SHAPES[op]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    B, Hq, Hkv, N, d = (s[k] for k in ("batch", "heads_q", "heads_kv", "seqlen", "head_dim"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if op == "decode":
        q, k, v = randn(B, Hq, d), randn(B, Hkv, N, d), randn(B, Hkv, N, d)
        q4 = q[:, :, None, :]
        return (lambda: ik.decode(q, k, v, backend="cupy"),
                lambda: sdpa(q4, k, v, enable_gqa=Hq != Hkv))
    q, k, v = randn(B, Hq, N, d), randn(B, Hkv, N, d), randn(B, Hkv, N, d)
    return (lambda: ik.attention(q, k, v, causal=True, backend="cupy"),
            lambda: sdpa(q, k, v, is_causal=True))


def _loop_us(fn, calls, torch):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = 1e6 * (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("decode", "attention", "both"), default="both")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args(argv)
    try:
        import torch
        import cupy  # noqa: F401
        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
    except ImportError as e:
        print(f"host_profile: needs torch with CUDA and CuPy ({e}); nothing measured")
        return 0
    for op in (("decode", "attention") if a.op == "both" else (a.op,)):
        ours, sdpa = _calls(op, torch)
        us_ours, us_sdpa = _loop_us(ours, a.calls, torch), _loop_us(sdpa, a.calls, torch)
        print(f"== {op} {SHAPES[op]}: {us_ours:.1f} us a call (ours), {us_sdpa:.1f} us (SDPA), "
              f"ratio {us_ours / us_sdpa:.2f}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            ours()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(a.top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip() and "Ordered by" not in ln
                 and "List reduced" not in ln]
        print("\n".join(lines[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
