"""Run every CUDA kernel of the project at ragged shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --report-api-errors no --error-exitcode 99 python3 scripts/sanitize.py
    (likewise --tool racecheck, synccheck, initcheck; --only numba|cupy|triton for one family;
    --only cupy --kernel attention_backward:v2 for one registered CuPy kernel)

``--report-api-errors no``: CUDA Python's bindings probe the driver with cuGetProcAddress
for entry points it may lack; those failed host calls are not kernel errors but would each
count in the ERROR SUMMARY (seen on the H200).

The kernels come from the kernel modules themselves: ``iokernels.numba_cuda.sanitize_cases()``
and ``iokernels.cupy_raw.sanitize_cases()`` return the cases (each one launches a kernel at
an awkward shape -- lengths not a multiple of the tile, odd head dims, Nq != Nk, empty
sequences -- and checks its result).  Accepted forms: a dict name -> callable, or an
iterable of (name, callable) pairs or of callables.

A self-test case (a tiny CuPy kernel, correct on purpose) runs first, so a broken tool
invocation is told apart from "no kernels yet".  This script imports neither torch nor
anything else that launches CUDA kernels of its own, so what the sanitizer reports is
ours; the Triton family is the exception (Triton launches through torch), and runs with
torch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, set here before torch is
imported), so an access past a tensor is not hidden inside a larger pooled block.
Exit status: 0 when every case ran and passed its own check, 1 otherwise (the
sanitizer's verdict comes from its own exit code and ERROR SUMMARY).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iokernels.core.gpu import numba_numpy_fix  # noqa: E402

numba_numpy_fix()   # before numba is imported


def _selftest():
    """A correct CuPy kernel with an odd length: the sanitizer must report nothing here."""
    import cupy as cp
    k = cp.RawKernel(r'''
    extern "C" __global__ void ik_selftest(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = 2.0f * x[i];
    }''', "ik_selftest")
    n = 1000 + 37
    x = cp.arange(n, dtype=cp.float32)
    y = cp.empty_like(x)
    k(((n + 127) // 128,), (128,), (x, y, np.int32(n)))
    assert float(cp.max(cp.abs(y - 2 * x))) == 0.0


#: launchers whose calls are logged with a timestamp while a family's cases run, so a slow
#: step under a sanitizer (compilation, a first import) shows in the log
TRACED = ("attention", "decode", "paged_decode", "paged_decode_pools", "gather_pools")


def _trace_calls(module, family, t0):
    """Wrap the module's launchers (looked up as globals by its sanitize_cases) to log calls."""
    import functools
    for name in TRACED:
        f = getattr(module, name, None)
        if f is None or getattr(f, "_ik_traced", False):
            continue

        def wrap(f=f, name=name):
            @functools.wraps(f)
            def traced(*a, **kw):
                shapes = [tuple(getattr(x, "shape", ())) for x in a[:3]]
                print(f"[{time.perf_counter() - t0:6.1f}s]   {family}.{name} {shapes} ...", flush=True)
                out = f(*a, **kw)
                print(f"[{time.perf_counter() - t0:6.1f}s]   {family}.{name} done", flush=True)
                return out
            traced._ik_traced = True
            return traced
        setattr(module, name, wrap())


def _run_family(module, t0, kernels=None):
    """Call ``module.sanitize_cases()``; returns (cases run, cases failed, reason if none).

    Two forms are accepted: the function runs every kernel itself and returns what ran
    (a list of names or (name, error) pairs), or it returns callables (a dict name ->
    callable, or (name, callable) pairs), which are run here one by one.
    """
    try:
        m = importlib.import_module(module)
    except Exception as e:
        return 0, 0, f"{module} not importable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    fn = getattr(m, "sanitize_cases", None)
    if fn is None:
        return 0, 0, f"{module}.sanitize_cases does not exist yet"
    family = module.rsplit(".", 1)[-1]
    _trace_calls(m, family, t0)
    try:
        result = fn() if kernels is None else fn(kernels=kernels)
    except Exception as e:
        print(f"[{time.perf_counter() - t0:6.1f}s] case {family}:sanitize_cases: FAILED {type(e).__name__}: "
              f"{str(e)[:300]}", flush=True)
        traceback.print_exc(limit=4)
        return 0, 1, None
    items = list(result.items()) if isinstance(result, dict) else list(result or [])
    ran = failed = 0
    for i, item in enumerate(items):
        name, f = (item if isinstance(item, tuple) and len(item) == 2 else (None, item))
        if callable(f):
            name = name or getattr(f, "__name__", f"case{i}")
            t = time.perf_counter()
            try:
                f()
                ran += 1
                print(f"[{time.perf_counter() - t0:6.1f}s] case {family}:{name}: ok "
                      f"({time.perf_counter() - t:.1f} s)", flush=True)
            except Exception as e:
                failed += 1
                print(f"[{time.perf_counter() - t0:6.1f}s] case {family}:{name}: FAILED {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                traceback.print_exc(limit=3)
        else:                                  # already run by sanitize_cases itself
            ran += 1
            if isinstance(item, tuple) and item:
                label, extra = str(item[0]), " ".join(f"{x:.2e}" if isinstance(x, float) else str(x)
                                                      for x in item[1:])
            else:
                label, extra = str(item), ""
            print(f"[{time.perf_counter() - t0:6.1f}s] case {family}:{label.replace(' ', '_')}: ok"
                  + (f" (max err {extra})" if extra else ""), flush=True)
    return ran, failed, None if items else "sanitize_cases returned nothing"


#: the kernel families, each a module with ``sanitize_cases()``; gpu_all.sh runs one
#: sanitizer process per (tool, family)
FAMILIES = {"numba": "iokernels.numba_cuda", "cupy": "iokernels.cupy_raw", "triton": "iokernels.triton_backend"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=tuple(FAMILIES), default=None, help="one kernel family")
    p.add_argument("--kernel", action="append", default=None, metavar="OP:VERSION",
                   help="with --only cupy: only this registered kernel (repeatable)")
    args = p.parse_args(argv)
    if args.kernel and args.only != "cupy":
        p.error("--kernel: needs --only cupy (the CuPy registry's op:version names)")
    modules = dict(FAMILIES)
    if "triton" in modules:
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    if args.only:
        modules = {args.only: modules[args.only]}
    failed = 0
    ran = 0
    t0 = time.perf_counter()
    try:
        _selftest()
        print(f"[{time.perf_counter() - t0:6.1f}s] case selftest:ik_selftest: ok", flush=True)
    except Exception as e:
        print(f"case selftest: FAILED {type(e).__name__}: {e}", flush=True)
        failed += 1
    for family, module in modules.items():
        print(f"[{time.perf_counter() - t0:6.1f}s] family {family}: starting", flush=True)
        r, f, why = _run_family(module, t0, args.kernel)
        ran += r
        failed += f
        print(f"[{time.perf_counter() - t0:6.1f}s] family {family}: {r} cases ok, {f} failed"
              + (f" ({why})" if why else ""), flush=True)
    print(f"sanitize.py: {ran} kernel cases ran, {failed} failed, {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0



# --------------------------------------------------------------------------- summary
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def summarize(log_dir, env_line="") -> str:
    """One summary from the logs ``sanitize_<tool>[_<family>].log`` (and their ``.rc`` files).

    gpu_all.sh runs each tool once per kernel family (``--only numba``, ``--only cupy``), so a
    slow family cannot keep the other from its verdict.
    """
    import glob
    import re
    lines = ["compute-sanitizer over scripts/sanitize.py (every CUDA kernel of the project at ragged shapes)"]
    if env_line:
        lines.append(env_line)
    total_errors = 0
    detail = []
    unfinished = []
    for tool in TOOLS:
        paths = sorted(glob.glob(os.path.join(log_dir, f"sanitize_{tool}.log")) +
                       glob.glob(os.path.join(log_dir, f"sanitize_{tool}_*.log")))
        if not paths:
            lines.append(f"{tool:<10} not run")
            unfinished.append(tool)
            continue
        for path in paths:
            run = os.path.basename(path)[len("sanitize_"):-len(".log")]
            text = open(path, errors="replace").read()
            rc = open(path[:-4] + ".rc").read().strip() if os.path.exists(path[:-4] + ".rc") else "?"
            # memcheck/synccheck/initcheck end with "ERROR SUMMARY: N errors"; racecheck with
            # "RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)"
            # (a second "ERROR SUMMARY: N errors were not printed" line counts the unprinted ones)
            m = re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, flags=re.M)
            r = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
            errors = int(m[-1]) if m else (int(r[-1][0]) if r else None)
            cases = re.findall(r"case (\S+): ok", text)
            failed = re.findall(r"case (\S+): FAILED", text)
            families = re.findall(r"family \S+: \d+ cases.*$", text, flags=re.M)
            verdict = ("no ERROR SUMMARY (timed out or crashed)" if errors is None else f"{errors} errors")
            if errors is None:
                unfinished.append(run)
            total_errors += errors or 0
            lines.append(f"{run:<18} {verdict:<14} exit {rc:<4} {len(cases)} cases ok, {len(failed)} failed")
            detail.append(f"--- {run}: " + "; ".join(families))
            detail += [f"    ok: {c}" for c in cases] + [f"    FAILED: {c}" for c in failed]
            if errors:
                errs = [ln for ln in text.splitlines() if ln.startswith("=========")][:40]
                detail += ["    " + e for e in errs]
    if unfinished:
        lines.append(f"total sanitizer errors: {total_errors} in the runs that finished; INCOMPLETE: "
                     f"{', '.join(unfinished)} did not finish (no ERROR SUMMARY)")
    else:
        lines.append(f"total sanitizer errors: {total_errors}")
    return "\n".join(lines + [""] + detail) + "\n"


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--summarize":   # --summarize LOGDIR [ENV LINE]
        text = summarize(sys.argv[2], " ".join(sys.argv[3:]))
        print(text, end="")
        sys.exit(0)
    sys.exit(main())
