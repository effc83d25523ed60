"""Tuning sweeps on a GPU: alternative tilings of the Numba and CuPy kernels, each next to its
torch baseline in the same run, before a winner becomes a default.

    python scripts/gpu_sweep.py OUTDIR [numba_fwd] [numba_decode] [cupy_decode] [cupy_prefill] [cupy_paged_layout]

The CuPy sweeps are declared as data in iokernels/bench/sweeps_cupy.py.

Writes OUTDIR/sweep_<name>.json(l) and prints one JSON line a row.  Every
time comes from iokernels.bench.time_cuda (the project's one timer: CUDA events, L2 flushed).
Each part is time-boxed by the caller (gpu_all.sh style ``timeout``); none is needed for
correctness: scripts/gpu_all.sh records the defaults.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def numba_fwd(outdir):
    """Numba forward float32 B=8 H=16 N=4096 d=128 (the issue's bar shape) vs SDPA EFFICIENT."""
    out = open(outdir / "sweep_numba_fwd.jsonl", "w")
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import iokernels as ik
    from iokernels import bench
    from iokernels.numba_cuda import NumbaConfig
    B, H, N, d = 8, 16, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((B, H, N, d), device="cuda", generator=g) for _ in range(3))
    flops = 4.0 * B * H * N * N * d

    def row(name, fn, ref_ms=None):
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        ms = bench.time_cuda(fn, warmup=1, reps=5).median_ms
        r = dict(group=f"fwd float32 B{B} H{H} N{N} d{d}", runner=name, ms=round(ms, 3),
                 tflops=round(flops / ms / 1e9, 2), first_call_s=round(compile_s, 1))
        if ref_ms:
            r["vs_efficient"] = round(ref_ms / ms, 3)
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")
        return ms

    def sdpa():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)
    ref = row("sdpa:efficient", sdpa)
    configs = {
        "v3": NumbaConfig(version=3),
        "v4": NumbaConfig(version=4),
        "v4 step4 batched": NumbaConfig(version=4, step_keys=4, batched_lane_sums=True),
        "v4 step4 batched Bc64": NumbaConfig(version=4, step_keys=4, batched_lane_sums=True, block_k=64),
    }
    for name, cfg in configs.items():
        try:
            row(f"numba:{name}", lambda cfg=cfg: ik.attention(q, k, v, backend="numba", config=cfg), ref)
        except Exception as e:  # a config that does not fit is a row, not a crash
            print(json.dumps(dict(runner=f"numba:{name}", error=str(e)[:200])), flush=True)
    row("sdpa:efficient (again)", sdpa)


def numba_decode(outdir):
    from iokernels.numba_cuda import bench_gpu
    fn = getattr(bench_gpu, "sweep_decode_gather", None)
    if fn is None:
        print("numba_decode: bench_gpu.sweep_decode_gather not found", flush=True)
        return
    fn(out_path=str(outdir / "sweep_numba_decode.json"))


def cupy_decode(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.sweep_decode(out_path=str(outdir / "sweep_cupy_decode.json"))


def cupy_prefill(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.sweep_prefill(out_path=str(outdir / "sweep_cupy_prefill.json"))


def cupy_paged_layout(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.paged_layout_probe(out_path=str(outdir / "sweep_cupy_paged_layout.json"))


PARTS = {"numba_fwd": numba_fwd, "numba_decode": numba_decode, "cupy_decode": cupy_decode}
#: run only when named on the command line
OPTIONAL_PARTS = {"cupy_prefill": cupy_prefill, "cupy_paged_layout": cupy_paged_layout}


def main(argv):
    outdir = pathlib.Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or list(PARTS):
        t0 = time.time()
        try:
            {**PARTS, **OPTIONAL_PARTS}[name](outdir)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
