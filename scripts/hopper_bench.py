"""Check and time the Hopper kernels (iokernels.cupy_raw.hopper) on an H100 / H200, one run.

    python3 scripts/hopper_bench.py                 # everything: gemm, check, time, ablation
    python3 scripts/hopper_bench.py --parts check   # only the 2x-rule checks
    python3 scripts/hopper_bench.py --sanitize      # compute-sanitizer on each version (tiny)

Each part runs in a child process with its own time limit, so a kernel that hangs (a
barrier that never completes) costs that part, not the run.  Parts:

* gemm: C = A B (bf16) against the float64 product by the 2x rule (ragged shapes), then
  4096^3 and 8192^3 timed next to torch.matmul;
* check: every version at d 64 / 128, N in {1, 127, 1024, 4096, 8192}, causal and not, GQA,
  Nq != Nk (both ways), a window, float16 and bfloat16, by the 2x rule against the float64
  oracle (iokernels.cupy_raw.hopper.oracle_check);
* time: bf16, B=8 H=16 N=4096 d=128, causal and not: v3, v4, v5, the Ampere v2
  (cupy_raw), SDPA's FLASH and cuDNN kernels, in TFLOP/s and as ratios to FLASH and cuDNN;
* ablation: the same versions at N in {1024 .. 16384} (B * N = 32768 tokens), d 64
  (H = 32) and 128 (H = 16), causal and not.

Timings: iokernels.bench.time_cuda (warm-up, median, L2 flushed).  FLOPs: 4 B H Nq Nk d,
halved for causal.  Results: one JSON file under $OUT (or --out), a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: seconds each part may run before it is stopped (a hang costs only its part)
PART_LIMITS = {"gemm": 40, "check": 40, "time": 50, "ablation": 150}
#: one sanitizer run (every version at the tiny shapes under one tool): seconds
SANITIZE_LIMIT = 80
SANITIZE_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: every report printed (so each is attributed to its kernel below), without backtraces; the log
#: keeps only the first lines of each tool's output (torch's own kernels can report thousands)
SANITIZE_PRINT_LIMIT = 1_000_000
SANITIZE_LOG_LINES = 300
VERSIONS = ("v3", "v4", "v5")
#: tuning points timed beside the defaults (HopperConfig fields): a third stage for v4, v5 with
#: two, and v5 without ping-pong (its overlap inside a warpgroup only)
VARIANTS = {"v4 s3": dict(version="v4", stages=3), "v5 s2": dict(version="v5", stages=2),
            "v5 no-pp": dict(version="v5", pingpong=False)}
MAIN = dict(batch=8, heads=16, seqlen=4096, head_dim=128)
ABLATION_TOKENS = 32768
ABLATION_N = (1024, 2048, 4096, 8192, 16384)
ABLATION_HEADS = {64: 32, 128: 16}          # hidden size 2048 either way
GEMM_SIZES = (4096, 8192)


# --------------------------------------------------------------------------- helpers
def _torch_inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype):
    import torch
    from iokernels.core.testing import make_inputs
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                          dtype="float32")
    return tuple(torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q, k, v))


def _flops(B, H, Nq, Nk, d, causal):
    return 4.0 * B * H * Nq * Nk * d / (2 if causal else 1)


def _runners(causal, versions=VERSIONS, variants=True):
    """name -> fn(q, k, v) for every kernel a timed row compares."""
    import torch
    from iokernels import cupy_raw as cr
    from iokernels.cupy_raw import hopper as hp
    from iokernels.torch_sdpa import force
    F = torch.nn.functional

    def sdpa(backend):
        def run(q, k, v):
            with force(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    configs = {v: dict(version=v) for v in versions}
    if variants:
        configs.update({name: kw for name, kw in VARIANTS.items() if kw["version"] in versions})
    out = {name: (lambda q, k, v, _kw=kw: hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(**_kw)))
           for name, kw in configs.items()}
    out["v2 (Ampere)"] = lambda q, k, v: cr.attention(q, k, v, causal=causal, config=cr.ForwardConfig(version="v2"))
    out["SDPA flash"] = sdpa("flash")
    out["SDPA cudnn"] = sdpa("cudnn")
    return out


def _time_case(rng, B, H, N, d, causal, versions=VERSIONS, variants=True):
    from iokernels.bench import time_cuda
    q, k, v = _torch_inputs(rng, B, H, H, N, N, d, "bfloat16")
    flops = _flops(B, H, N, N, d, causal)
    rows = {}
    for name, fn in _runners(causal, versions, variants).items():
        try:
            t = time_cuda(fn, q, k, v)
            rows[name] = dict(ms=t.median_ms, p10=t.p10, p90=t.p90, tflops=t.tflops(flops))
        except Exception as e:  # a row that cannot run says why, the others still run
            rows[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    for base in ("SDPA flash", "SDPA cudnn"):
        if "ms" in rows.get(base, {}):
            for r in rows.values():
                if "ms" in r:
                    r[f"x {base.split()[1]}"] = rows[base]["ms"] / r["ms"]
    return dict(batch=B, heads=H, seqlen=N, head_dim=d, causal=causal, rows=rows)


# --------------------------------------------------------------------------- parts
def part_gemm(rng):
    import torch
    from iokernels.bench import time_cuda
    from iokernels.cupy_raw import hopper as hp
    out = dict(checks=[], timings=[])
    for (M, K, N) in ((128, 64, 256), (300, 200, 264), (1000, 1032, 776), (2048, 4096, 1024)):
        for dtype in ("bfloat16", "float16"):
            a = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32)).cuda().to(getattr(torch, dtype))
            b = torch.from_numpy(rng.standard_normal((K, N), dtype=np.float32)).cuda().to(getattr(torch, dtype))
            c = hp.gemm_check(a, b)
            out["checks"].append(dict(case=f"{dtype} {M}x{K}x{N}", ok=bool(c.ok), text=str(c)))
            print(f"gemm check {dtype} {M}x{K}x{N}: {c}", flush=True)
            if not c.ok and len(out["checks"]) == 1:
                ref = torch.matmul(a.double(), b.double()).cpu().numpy()
                _profile(hp.gemm(a, b).float().cpu().numpy()[None, None], ref[None, None], "gemm C")
    for n in GEMM_SIZES:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * n ** 3
        t_ours = time_cuda(hp.gemm, a, b)
        t_torch = time_cuda(torch.matmul, a, b)
        row = dict(n=n, ours_ms=t_ours.median_ms, torch_ms=t_torch.median_ms, ours_tflops=t_ours.tflops(flops),
                   torch_tflops=t_torch.tflops(flops), ratio=t_torch.median_ms / t_ours.median_ms)
        out["timings"].append(row)
        print(f"gemm {n}^3 bf16: ours {row['ours_tflops']:.0f} TFLOP/s, torch {row['torch_tflops']:.0f}: "
              f"{row['ratio']:.3f}x", flush=True)
    return out


CHECK_CASES = [
    # (B, Hq, Hkv, Nq, Nk, d, causal, window, dtype)
    (1, 2, 2, 1, 1, 64, False, None, "bfloat16"),
    (1, 2, 2, 1, 1, 128, True, None, "bfloat16"),
    (2, 2, 2, 127, 127, 64, True, None, "bfloat16"),
    (2, 2, 2, 127, 127, 128, False, None, "float16"),
    (1, 4, 2, 1024, 1024, 64, False, None, "bfloat16"),
    (1, 4, 2, 1024, 1024, 128, True, None, "float16"),
    (1, 4, 1, 1024, 1024, 128, False, None, "bfloat16"),
    (1, 2, 2, 4096, 4096, 128, True, None, "bfloat16"),
    (1, 2, 2, 4096, 4096, 64, False, None, "float16"),
    (1, 2, 1, 8192, 8192, 128, True, None, "bfloat16"),
    (1, 2, 2, 100, 333, 128, True, None, "bfloat16"),
    (1, 2, 2, 333, 100, 128, True, None, "bfloat16"),      # rows 0..232 see no key: O = 0, LSE = -inf
    (1, 2, 2, 333, 100, 64, False, None, "float16"),
    (1, 2, 2, 500, 500, 128, False, (100, 20), "bfloat16"),
]


def _profile(out, ref, label):
    """Where a failing output is wrong: mean |error| per 8 rows and per 8 columns (first head)."""
    err = np.abs(np.nan_to_num(out, nan=1e9) - ref)[0, 0]
    if err.ndim == 1:
        err = err[:, None]
    rows = [float(err[i:i + 8].mean()) for i in range(0, err.shape[0], 8)]
    cols = [float(err[:, j:j + 8].mean()) for j in range(0, err.shape[1], 8)]
    print(f"  {label} error per 8 rows: " + " ".join(f"{x:.2g}" for x in rows[:24]), flush=True)
    print(f"  {label} error per 8 cols: " + " ".join(f"{x:.2g}" for x in cols), flush=True)


def _diagnose(rng, version, cfg):
    """A small failing case, shown as error profiles of O and LSE (to tell layout from mask bugs)."""
    import torch
    from iokernels.core import reference
    from iokernels.core.testing import as_numpy
    from iokernels.cupy_raw import hopper as hp
    q, k, v = _torch_inputs(rng, 1, 1, 1, 64, 128, 64, "bfloat16")
    o, lse = hp.attention(q, k, v, causal=False, config=cfg)
    torch.cuda.synchronize()
    ro, rl = reference.attention(as_numpy(q), as_numpy(k), as_numpy(v))
    _profile(as_numpy(o), ro, f"{version} O 64x128 d64")
    _profile(as_numpy(lse)[..., None], rl[..., None], f"{version} LSE")
    print(f"  {version} O[0,0,0,:8] {as_numpy(o)[0, 0, 0, :8].round(3)} ref {ro[0, 0, 0, :8].round(3)}", flush=True)


def _config(spec):
    """"v5" or "v4:stages=3,pingpong=0" -> (label, HopperConfig)."""
    from iokernels.cupy_raw import hopper as hp
    version, _, rest = spec.partition(":")
    kw = {k: int(v) for k, v in (item.split("=") for item in rest.split(",") if item)}
    if "pingpong" in kw:
        kw["pingpong"] = bool(kw["pingpong"])
    return spec, hp.HopperConfig(version=version, **kw)


def part_check(rng, specs):
    from iokernels.cupy_raw import hopper as hp
    out = []
    for spec in specs:
        version, cfg = _config(spec)
        for (B, Hq, Hkv, Nq, Nk, d, causal, window, dtype) in CHECK_CASES:
            q, k, v = _torch_inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype)
            label = f"{version} {dtype} B{B} H{Hq}/{Hkv} Nq{Nq} Nk{Nk} d{d} causal={causal} window={window}"
            try:
                checks = hp.oracle_check(q, k, v, causal=causal, window=window, config=cfg)
                ok = all(c.ok for c in checks)
                worst = max(checks, key=lambda c: c.error / max(c.bound, 1e-30))
                text = str(worst) if ok else "; ".join(str(c) for c in checks if not c.ok)
            except Exception as e:
                ok, text = False, f"{type(e).__name__}: {e}"
            out.append(dict(version=version, case=label, ok=ok, text=text))
            print(f"{'ok  ' if ok else 'FAIL'} {label}: {text[:300]}", flush=True)
            if not ok and sum(not r["ok"] for r in out if r["version"] == version) == 1:
                try:
                    _diagnose(rng, version, cfg)
                except Exception as e:
                    print(f"  diagnose: {type(e).__name__}: {e}", flush=True)
    return out


def part_time(rng, versions):
    res = [_time_case(rng, MAIN["batch"], MAIN["heads"], MAIN["seqlen"], MAIN["head_dim"], c, versions)
           for c in (False, True)]
    for r in res:
        _print_case(r)
    return res


def part_ablation(rng, versions, deadline):
    res = []
    for d, H in ABLATION_HEADS.items():
        for N in ABLATION_N:
            for causal in (False, True):
                if time.time() > deadline:
                    print("ablation: out of time, the rest skipped", flush=True)
                    return res
                r = _time_case(rng, ABLATION_TOKENS // N, H, N, d, causal, versions, variants=False)
                res.append(r)
                _print_case(r, short=True)
    return res


def part_tiny(rng, versions):
    """Tiny ragged cases for compute-sanitizer: each version at GQA, Nq != Nk, causal and not;
    the GEMM at a shape that is no multiple of its tile."""
    import torch
    from iokernels.cupy_raw import hopper as hp
    out = []
    for version in versions:
        for (B, Hq, Hkv, Nq, Nk, d, causal) in ((1, 2, 1, 70, 200, 64, True), (1, 2, 2, 150, 90, 128, False)):
            q, k, v = _torch_inputs(rng, B, Hq, Hkv, Nq, Nk, d, "bfloat16")
            checks = hp.oracle_check(q, k, v, causal=causal, config=hp.HopperConfig(version=version))
            out.append(dict(version=version, ok=all(c.ok for c in checks), text="; ".join(map(str, checks))))
            print(out[-1], flush=True)
    a = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 264, device="cuda", dtype=torch.bfloat16)
    c = hp.gemm_check(a, b)
    out.append(dict(version="gemm", ok=bool(c.ok), text=str(c)))
    print(out[-1], flush=True)
    return out


def _print_case(r, short=False):
    head = f"B{r['batch']} H{r['heads']} N{r['seqlen']} d{r['head_dim']} {'causal' if r['causal'] else 'non-causal'}"
    cells = []
    for name, row in r["rows"].items():
        if "tflops" in row:
            cells.append(f"{name} {row['tflops']:.0f}" + (f" ({row.get('x flash', float('nan')):.2f}xF "
                                                           f"{row.get('x cudnn', float('nan')):.2f}xC)"
                                                           if name[:2] in VERSIONS else ""))
        else:
            cells.append(f"{name} ERR {row['error'][:80]}")
    print(f"{head}: " + " | ".join(cells), flush=True)


# --------------------------------------------------------------------------- driver
def _child(args):
    rng = np.random.default_rng(args.seed)
    if args.part == "gemm":
        res = part_gemm(rng)
    elif args.part == "check":
        res = part_check(rng, [args.versions])
    elif args.part == "time":
        res = part_time(rng, args.versions.split(","))
    elif args.part == "ablation":
        res = part_ablation(rng, args.versions.split(","), time.time() + args.limit - 15)
    elif args.part == "tiny":
        res = part_tiny(rng, args.versions.split(","))
    else:
        raise SystemExit(f"--part: unknown {args.part}")
    with open(args.result, "w") as f:
        json.dump(res, f)


def _run_child(part, extra, limit, out_dir, log, prefix=(), keep_lines=None):
    result = os.path.join(out_dir, f".{part}.json")
    cmd = [*prefix, sys.executable, os.path.abspath(__file__), "--part", part, "--result", result, *extra]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    shown = text if keep_lines is None else "\n".join(text.splitlines()[:keep_lines])
    log.write(f"===== {part} {' '.join(prefix[:3])} {' '.join(extra)} rc={rc} {time.time() - t0:.0f}s\n{shown}\n")
    log.flush()
    print(f"[{part} {' '.join(extra)}] rc={rc} in {time.time() - t0:.0f}s", flush=True)
    res = None
    if os.path.exists(result):
        with open(result) as f:
            res = json.load(f)
        os.remove(result)
    return rc, res, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="gemm,check,time,ablation")
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--check-configs", default="",
                    help="extra configs for the check part, e.g. v4:stages=3;v5:pingpong=0")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=285.0, help="seconds the whole run may take")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=100.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        return _child(args)
    deadline = time.time() + args.budget
    os.makedirs(args.out, exist_ok=True)
    from iokernels.cupy_raw import hopper as hp
    why = hp.available()
    if why is not None:
        print(f"the Hopper kernels cannot run here: {why}")
        return 1
    summary = dict(env=_env())
    print(summary["env"], flush=True)
    with open(os.path.join(args.out, "hopper_bench.log"), "w") as log:
        if args.sanitize:
            summary["sanitize"] = {}
            for tool in SANITIZE_TOOLS:
                prefix = ("compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                          "--print-limit", str(SANITIZE_PRINT_LIMIT), "--show-backtrace", "no",
                          *(("--check-api-memory-access", "no") if tool == "initcheck" else ()))
                limit = min(SANITIZE_LIMIT, deadline - time.time() - 5)
                if limit < 10:
                    print(f"sanitize {tool}: out of time, skipped", flush=True)
                    continue
                rc, res, text = _run_child("tiny", ["--versions", args.versions], limit, args.out, log, prefix,
                                           keep_lines=SANITIZE_LOG_LINES)
                tail = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
                # where reported errors come from: the kernel (or API call) of each report, counted
                where = {}
                for ln in text.splitlines():
                    if ln.startswith("=========     at ") or "on access by" in ln:
                        key = re.sub(r"0x[0-9a-f]+", "", ln.strip("= "))[:160]
                        where[key] = where.get(key, 0) + 1
                ours = sum(n for k, n in where.items() if re.search(r"\b(fa_v[345]|hopper_gemm)\b", k))
                summary["sanitize"][tool] = dict(rc=rc, summary=tail[-2:] or ["(none)"], checks=res, ours=ours,
                                                 where=sorted(where.items(), key=lambda kv: -kv[1])[:10])
                print(f"  {tool}: rc={rc} {tail[-2:]}; reports in fa_v3/4/5 or hopper_gemm: {ours}", flush=True)
        runnable = args.versions.split(",")      # versions that neither hung nor crashed
        for part in filter(None, args.parts.split(",")):
            if part == "check":
                jobs = [(part, v) for v in runnable] + [(part, c) for c in filter(None, args.check_configs.split(";"))]
            else:
                jobs = [(part, ",".join(runnable))]
            for part_, versions in jobs:
                limit = min(PART_LIMITS[part_], deadline - time.time() - 5)
                if limit < 10:
                    print(f"{part_} {versions}: out of time, skipped", flush=True)
                    continue
                extra = ["--versions", versions, "--seed", str(args.seed), "--limit", str(limit)]
                rc, res, _ = _run_child(part_, extra, limit, args.out, log)
                if part_ == "check":
                    summary.setdefault("check", dict(rc={}, result=[]))
                    summary["check"]["rc"][versions] = rc
                    summary["check"]["result"] += res or []
                    if rc != 0 and versions in runnable:
                        runnable = [v for v in runnable if v != versions]
                else:
                    summary[part_] = dict(rc=rc, result=res)
    with open(os.path.join(args.out, "hopper_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    _final_table(summary)
    return 0


def _env():
    import torch
    import cupy
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cupy=cupy.__version__,
                cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def _final_table(summary):
    print("\n==================== summary")
    chk = (summary.get("check") or {}).get("result") or []
    for v in dict.fromkeys(c["version"] for c in chk):
        rows = [c for c in chk if c["version"] == v]
        print(f"check {v}: {sum(c['ok'] for c in rows)}/{len(rows)} pass")
    g = (summary.get("gemm") or {}).get("result")
    if g:
        print(f"gemm checks: {sum(c['ok'] for c in g['checks'])}/{len(g['checks'])} pass")
        for t in g["timings"]:
            print(f"gemm {t['n']}^3: {t['ours_tflops']:.0f} vs torch {t['torch_tflops']:.0f} TFLOP/s "
                  f"= {t['ratio']:.3f}x")
    for r in (summary.get("time") or {}).get("result") or []:
        _print_case(r)
    for k, s in (summary.get("sanitize") or {}).items():
        print(f"sanitize {k}: rc={s['rc']} {s['summary'][:1]}; in our kernels: {s['ours']}; "
              f"most reported at: {[w[:80] for w, _ in s['where'][:2]]}")


if __name__ == "__main__":
    sys.exit(main())
