"""Check that the kernel sources of this checkout compile to the same PTX as those of a git ref.

A rename of a helper, a moved #define or a comment must not change what a kernel does; the
proof is that nvcc emits the same PTX for it.  For every compile the tests make
(tests/test_cupy_compile.py's jobs on sm_75/80/90; tests/test_hopper.py's, fa_v6's every config
among them, the Hopper backward's, the Hopper paged prefill's and the FP8 forward's, v1 and v2,
on sm_90a), this
script inlines the headers exactly as the launcher does, once from this checkout's kernel
folders and once from ``--ref`` (default main), runs ``nvcc -ptx`` on both with the same
defines, drops comments and ``.file`` / ``.loc`` lines, and compares.

    python scripts/ptx_same.py [--ref main] [-k SUBSTRING] [--workers 2]

Exit status 0 when every PTX is identical; otherwise the differing jobs are listed with the
first differing lines.  Needs nvcc, no GPU.
"""
from __future__ import annotations

import argparse
import difflib
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = "iokernels/cupy_raw/kernels"
BENCH_KERNELS = "iokernels/bench/kernels"
NVCC = "nvcc"

sys.path.insert(0, str(ROOT))
from iokernels.cupy_raw.launch import inline_headers  # noqa: E402  (this checkout's rule, applied to both trees)


def _jobs():
    """(label, kernel file name, defines, arch flag): the tests' own compile lists."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import test_cupy_compile as tc
    import test_hopper as th
    jobs = [(f"sm_{arch} {label}", name, defines, f"-arch=sm_{arch}") for label, name, defines, arch in tc._jobs()]
    jobs += [(f"sm_90a {label}", name, defines, "-arch=sm_90a") for label, name, defines in th._jobs()]
    jobs += [(f"sm_90a {label}", name, defines, "-arch=sm_90a")
             for v in ("v6", "v10") for label, name, defines in th._jobs_round(v)]
    # the Hopper kernels whose own test files list their compiles
    import test_hopper_backward as tb
    import test_hopper_paged_prefill as tp
    from iokernels.cupy_raw.hopper import fp8_forward as F
    jobs += [(f"sm_90a bwd_v3 {label}", "bwd_v3", defines, "-arch=sm_90a") for label, defines in tb._jobs()]
    jobs += [(f"sm_90a bwd_{v} {label}", f"bwd_{v}", defines, "-arch=sm_90a") for v in ("v4", "v5")
             for label, defines in tb._jobs(v)]
    jobs += [(f"sm_90a paged_prefill_v3 {label}", "paged_prefill_v3", defines, "-arch=sm_90a")
             for label, defines in tp._jobs()]
    jobs += [(f"sm_90a fa_fp8_v1 {dt} stages={s}", F.FP8_FILE, F.Fp8Config(stages=s).defines(dt), "-arch=sm_90a")
             for dt in F.FP8_DTYPES for s in range(1, F.FP8_MAX_STAGES + 1)]
    jobs += [(f"sm_90a fa_fp8_v2 {dt} stages={s} pingpong={pp}", F.FP8_FILES["v2"],
              F.Fp8Config(stages=s, version="v2", pingpong=pp).defines(dt), "-arch=sm_90a")
             for dt in F.FP8_DTYPES for s in range(2, F.FP8_MAX_STAGES + 1) for pp in (True, False)]
    return jobs


def _inline(root: pathlib.Path, name: str) -> str:
    """The source of kernel file ``name`` under ``root`` with its headers inlined, each once
    (launch.source's rule: headers live in the portable kernels' folder)."""
    kdir = root / KERNELS
    path = kdir / f"{name}.cu"
    if not path.exists():
        path = root / BENCH_KERNELS / f"{name}.cu"
    return inline_headers(path.read_text(), kdir)


def _ptx(src: str, defines: dict, arch: str, work: pathlib.Path, tag: str) -> str:
    cu = work / f"{tag}.cu"          # same name for both trees: nothing of the path reaches the PTX
    cu.write_text(src)
    out = work / f"{tag}.ptx"
    cmd = [NVCC, "-ptx", arch, "-std=c++17", *(f"-D{k}={v}" for k, v in sorted(defines.items())),
           str(cu), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if r.returncode:
        return f"<compile failed>\n{r.stderr}"
    keep = []
    for line in out.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s.startswith(".file") or s.startswith(".loc"):
            continue
        keep.append(line)
    return "\n".join(keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="the git ref to compare against (default main)")
    ap.add_argument("-k", default="", help="only jobs whose label contains this")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    jobs = [j for j in _jobs() if args.k in j[0]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        old = tmp / "ref"
        blob = subprocess.run(["git", "archive", args.ref, KERNELS, BENCH_KERNELS], cwd=ROOT,
                              capture_output=True, check=True).stdout
        tarfile.open(fileobj=BytesIO(blob)).extractall(old, filter="data")

        def one(i_job):
            i, (label, name, defines, arch) = i_job
            if not any((old / d / f"{name}.cu").exists() for d in (KERNELS, BENCH_KERNELS)):
                return label, None, None                # a file the ref does not have: nothing to compare
            work = tmp / f"w{i}"
            work.mkdir()
            a = _ptx(_inline(old, name), defines, arch, work, "kernel")
            b = _ptx(_inline(ROOT, name), defines, arch, work, "kernel")
            return label, a, b

        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            results = list(pool.map(one, enumerate(jobs)))
    new = sorted({label.split()[1] for label, a, _ in results if a is None})
    results = [r for r in results if r[1] is not None]
    if new:
        print(f"new in this tree (not compared): {', '.join(new)}")
    bad = 0
    for label, a, b in results:
        if a != b or a.startswith("<compile failed>"):
            bad += 1
            diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), args.ref, "this tree", lineterm="", n=1))
            print(f"DIFFERS {label}\n  " + "\n  ".join(diff[:20] or a.splitlines()[:10]))
    print(f"{len(results) - bad} of {len(results)} compiles: identical PTX against {args.ref}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
