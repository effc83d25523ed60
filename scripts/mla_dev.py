"""Check and time the MLA decode kernel (iokernels.cupy_raw.mla, mla_decode.cu) on an H100 / H200.

    python3 scripts/mla_dev.py                  # check, then time (about a minute)
    python3 scripts/mla_dev.py --parts check    # only the 2x-rule checks
    python3 scripts/mla_dev.py --parts time     # only the timing table

Each part runs in a child process with its own time limit, so a kernel that hangs (a barrier
that never completes) costs that part, not the run.  Parts:

* check: bf16 and fp16, Hq 16 / 64 / 80 / 128, B 1 .. 5, N not a multiple of the 64-row tile,
  seq_lens with zeros, split counts 1 .. 4 and the heuristic's, contiguous and paged (shuffled
  pages, rows past N NaN): each case by FlashAttention's 2x rule against the float64 oracle
  (:func:`iokernels.cupy_raw.mla.oracle_check`; baseline: the absorbed form in torch matmuls in
  the same precision).  A failing case prints where its error sits (head block, O column half,
  sequence, row position) to tell a layout bug from a masking or a merge bug.
* time: bf16, Hq = 128, rows 512 + 64, (B, N) in the benchmark's shapes: mla_decode v1, the
  torch matmul baseline and SDPA (heads as query rows), in ms, TFLOP/s, cache TB/s and the
  fraction of the roofline bound max(FLOPs / bf16 matmul ceiling, cache bytes / copy
  ceiling) (iokernels.bench.runners.mla_roofline: the measured ceilings when recorded).

Timings: iokernels.bench.time_cuda (warm-up, median, L2 flushed).  A JSON record goes to
$OUT/mla_dev.json (or --out) when either is given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: seconds each part may run before it is stopped (the first check compiles the kernels)
PART_LIMITS = {"check": 180, "time": 120}
#: (batch, N) timed: the benchmark's MLA shapes
TIME_SHAPES = ((64, 8192), (8, 8192), (1, 8192), (64, 4096), (8, 32768), (1, 32768))
HEADS = 128


def _profile(o, ref, lens):
    """Where the error of O (B, Hq, 512) against the oracle sits."""
    err = np.abs(np.asarray(o, np.float64) - ref)
    B, Hq, D = err.shape
    print(f"    max err per sequence: {[f'{e:.3g}' for e in err.max(axis=(1, 2))]} (lens {lens})")
    print(f"    per head block of 64: {[f'{err[:, h:h + 64].max():.3g}' for h in range(0, Hq, 64)]}")
    print(f"    per O column half (warpgroup): {[f'{err[..., c:c + D // 2].max():.3g}' for c in (0, D // 2)]}")
    print(f"    per 64-column panel: {[f'{err[..., c:c + 64].max():.3g}' for c in range(0, D, 64)]}")
    print(f"    per row position in a 16-row warp slab: "
          f"{[f'{err[:, r::16].max():.3g}' for r in range(min(16, Hq))]}")


def part_check():
    import torch
    from iokernels.core.testing import as_numpy
    from iokernels.cupy_raw import mla as cm
    from iokernels.mla import reference_latent
    rng = np.random.default_rng(0)
    out, failed = [], 0
    for dtype, B, Hq, N, lens, splits, page in cm.CHECK_CASES:
        tdt = getattr(torch, dtype)
        q = torch.from_numpy(rng.standard_normal((B, Hq, cm.ROW)).astype(np.float32)).cuda().to(tdt)
        kv = torch.from_numpy(rng.standard_normal((B, N, cm.ROW)).astype(np.float32)).cuda().to(tdt)
        label = f"{dtype} B={B} Hq={Hq} N={N} lens={lens} splits={splits} page={page}"
        try:
            checks = cm.oracle_check(q, kv, seq_lens=lens, num_splits=splits, paged_page=page, seed=B * N)
        except Exception as e:  # a launch error: say so and go on with the next case
            # the whole message the first time (an NVRTC log runs over many lines), one line after
            text = str(e) if not any("error" in r for r in out) else str(e).splitlines()[0][:300]
            print(f"ERROR {label}: {type(e).__name__}: {text[:3000]}", flush=True)
            out.append(dict(case=label, ok=False, error=f"{type(e).__name__}: {e}"[:500]))
            failed += 1
            continue
        ok = all(checks)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
        for c in checks:
            print(f"    {c}", flush=True)
        if not ok:
            o, _ = cm.mla_decode(q, kv, seq_lens=None if lens is None else np.asarray(lens, np.int32),
                                 num_splits=splits)
            n = np.full(B, N) if lens is None else np.asarray(lens)
            ref, _ = reference_latent(as_numpy(q), as_numpy(kv), 512, seq_lens=n)
            _profile(as_numpy(o), ref, n.tolist())
        out.append(dict(case=label, ok=ok, checks=[str(c) for c in checks]))
    print(f"check: {len(cm.CHECK_CASES) - failed} of {len(cm.CHECK_CASES)} cases pass", flush=True)
    return dict(checks=out, failed=failed)


def part_time():
    import torch
    from iokernels import torch_sdpa as ts
    from iokernels.bench import release_device_cache, time_cuda
    from iokernels.bench.runners import mla_roofline
    from iokernels.cupy_raw import mla as cm
    rows = []
    print(f"{'B':>3} {'N':>6} {'runner':<14}{'ms':>9}{'TFLOP/s':>9}{'TB/s':>7}{'of bound':>9}{'vs torch':>9}",
          flush=True)
    for B, N in TIME_SHAPES:
        q = torch.randn((B, HEADS, cm.ROW), device="cuda", dtype=torch.bfloat16)
        kv = torch.randn((B, N, cm.ROW), device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * B * HEADS * N * (cm.ROW + 512)
        nbytes = 2.0 * B * N * cm.ROW
        roof = mla_roofline(flops, nbytes)
        runners = {"cupy:v1": lambda: cm.mla_decode(q, kv),
                   "torch:matmul": lambda: ts.mla_decode_matmul(q, kv),
                   "torch:sdpa": lambda: ts.mla_decode_sdpa(q, kv)}
        case = {}
        for name, fn in runners.items():
            try:
                t = time_cuda(fn, reps=20)
                case[name] = dict(ms=t.median_ms, tflops=t.tflops(flops), tbps=t.tbps(nbytes),
                                  of_bound=roof["bound_ms"] / t.median_ms)
            except Exception as e:  # a row that cannot run says why, the others still run
                case[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        base = case.get("torch:matmul", {}).get("ms")
        for name, r in case.items():
            if "ms" in r:
                r["vs_torch"] = base / r["ms"] if base else None
                print(f"{B:>3} {N:>6} {name:<14}{r['ms']:>9.4f}{r['tflops']:>9.1f}{r['tbps']:>7.2f}"
                      f"{r['of_bound']:>9.3f}{(r['vs_torch'] or 0):>9.2f}", flush=True)
            else:
                print(f"{B:>3} {N:>6} {name:<14}  {r['error']}", flush=True)
        rows.append(dict(batch=B, seqlen=N, roofline=roof, rows=case))
        del q, kv
        release_device_cache()
    print(f"roofline: {rows[0]['roofline']['gpu']}; bound = max(FLOPs / matmul ceiling, bytes / copy ceiling)")
    return dict(timings=rows)


PARTS = {"check": part_check, "time": part_time}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="check,time", help="comma-separated subset of check,time")
    p.add_argument("--out", default=None, help="write the JSON record here (default: $OUT/mla_dev.json if $OUT)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:                                  # one part, in this process; JSON on the last line
        print("RESULT " + json.dumps(PARTS[args.child]()), flush=True)
        return 0
    record = {}
    for part in [s.strip() for s in args.parts.split(",") if s.strip()]:
        if part not in PARTS:
            p.error(f"--parts: unknown {part!r}; choose from {', '.join(PARTS)}")
        print(f"== {part}", flush=True)
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", part], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=PART_LIMITS[part])
            lines = r.stdout.splitlines()
            print("\n".join(ln for ln in lines if not ln.startswith("RESULT ")), flush=True)
            res = [ln for ln in lines if ln.startswith("RESULT ")]
            record[part] = json.loads(res[-1][7:]) if res else dict(error=f"exit {r.returncode}, no result")
        except subprocess.TimeoutExpired as e:
            text = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            print(text, flush=True)
            print(f"!! {part}: stopped after {PART_LIMITS[part]} s (a hang?)", flush=True)
            record[part] = dict(error="timeout")
    out = args.out or (os.path.join(os.environ["OUT"], "mla_dev.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
