"""Compile every Numba kernel to PTX without a GPU, and look for float64 arithmetic in it.

``numba.cuda.compile_ptx`` needs only NVVM (pip-installable with numba-cuda), not a GPU, but
it needs the real CUDA target: the simulator must be off (NUMBA_ENABLE_CUDASIM=0) when numba
is first imported.  ``python -m iokernels.numba_cuda.ptx 75 90 float32 d=128 only=fwd`` (run that way by
tests/test_numba_ptx.py in a subprocess) prints a JSON report; every argument optional.

Why look for float64: a float32 kernel that mixes in a Python float (``0.0``, ``1.0 / l``)
silently computes in float64, which runs at 1/64 of the float32 rate on most GPUs.
"""
from __future__ import annotations

import json
import re
import sys

import numpy as np

#: PTX instructions that compute in float64 (arithmetic, special functions, conversions to it)
F64_ARITHMETIC = re.compile(r"^\s*(?:@!?%p\d+\s+)?(add|sub|mul|fma|mad|div|neg|abs|min|max|rcp|sqrt|rsqrt|"
                            r"ex2|lg2|sin|cos|setp|selp|testp|cvt)[.a-z0-9]*\.f64\b", re.M)

#: PTX lines that access local memory (per-thread arrays the compiler could not keep in registers)
LOCAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.local\b", re.M)

#: head dims compiled: 128 (the benchmark's) and 59 (ragged: lanes own padded dims)
HEAD_DIMS = (128, 59)


def _arr(t, nd, layout="C"):
    from numba import types
    return types.Array(t, nd, layout)


def kernel_signatures(head_dims=HEAD_DIMS):
    """(name, storage dtype, python function, numba signature) for every kernel we launch."""
    from numba import types
    from . import decode_kernels as dk
    from . import flash_fwd as ff
    out = []
    for dtype in ("float32", "float16", "float64"):
        st = getattr(types, dtype)
        acc = types.float64 if dtype == "float64" else types.float32
        for d in head_dims:
            fwd_sig = (_arr(st, 4), _arr(st, 4), _arr(st, 4), _arr(st, 4), _arr(acc, 3), acc, types.int64, types.int64)
            for version in (1, 2, 3, 4):
                cfg = ff.NumbaConfig(version=version)
                fn = ff.kernel_function(cfg, d, dtype, simulated=False)
                out.append((f"fwd_v{version}_d{d}", dtype, fn, fwd_sig))
            for paged in (False, True):
                sig = (_arr(st, 3), _arr(st, 4), _arr(st, 4), _arr(types.int32, 2), _arr(types.int32, 1),
                       _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64, types.int64)
                fn = dk.split_kernel_function(d, 4, dtype, paged, simulated=False)
                out.append((f"decode_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
            sig = (_arr(acc, 4), _arr(acc, 3), _arr(st, 3), _arr(acc, 2))
            out.append((f"decode_combine_d{d}", dtype, dk.combine_kernel_function(d, dtype), sig))
            from .decode_v2 import word_layout
            word, _ = word_layout(dtype, d)                   # version 2: K/V as 8-byte words
            wt = getattr(types, word)
            for paged in (False, True):
                sig = (_arr(st, 3), _arr(wt, 4), _arr(wt, 4), _arr(types.int32, 2), _arr(types.int32, 1),
                       _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64)
                fn = dk.split_v2_kernel_function(d, 4, dtype, paged, 16, word, simulated=False)
                out.append((f"decode_v2_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
            from .decode_v2 import make_gather_v2
            W = d * np.dtype(dtype).itemsize // np.dtype(word).itemsize
            sig = (_arr(wt, 2), _arr(wt, 2), _arr(types.int32, 1), _arr(wt, 3), _arr(wt, 3)) + (types.int64,) * 4
            out.append((f"gather_v2_d{d}", dtype, make_gather_v2(word, W, 8, 16, False), sig))
        gather_t = types.uint64 if dtype != "float64" else st     # the launcher's 8-byte words
        sig = (_arr(gather_t, 4), _arr(gather_t, 4), _arr(types.int32, 1), _arr(gather_t, 3), _arr(gather_t, 3),
               types.int64)
        out.append(("gather", dtype, dk.make_gather(str(gather_t)), sig))
    return out


def f64_lines(ptx: str) -> list[str]:
    return [m.group(0).strip() for m in F64_ARITHMETIC.finditer(ptx)]


class _TargetOnly:
    """Stands in for "the current device" when there is none: only its compute capability."""

    def __init__(self, cc):
        self.compute_capability = cc


def _no_device_for_device_functions(cc):
    """numba-cuda compiles a kernel's ``@cuda.jit(device=True)`` callees for the *current
    device's* compute capability, which needs a driver.  ``compile_ptx`` itself does not; with
    no GPU we tell the device-function compiler the target instead.  (Their LLVM IR does not
    depend on it; the kernel's PTX is generated for each requested cc.)"""
    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: _TargetOnly(cc)


def compile_all(ccs=((7, 5), (9, 0)), dtypes=("float32", "float16", "float64"), head_dims=HEAD_DIMS,
                only=None, dump=None) -> dict:
    """{f"{name}/{dtype}/sm_{cc}": {"f64": [lines], "bytes": n, "shfl": bool, "local": n, "ld_u64": n,
    "ld_u16": n}} per kernel and cc: float64 lines, PTX size, shuffles, local-memory accesses
    (per-thread arrays that did not stay in registers), 8-byte and 2-byte global loads.

    ``only``: a regular expression a kernel's name must contain (None: all); ``dump``: a folder to write
    each PTX to (for ``ptxas -v``)."""
    from numba import cuda, types
    _no_device_for_device_functions(ccs[0])
    report = {}
    for name, dtype, fn, sig in kernel_signatures(head_dims):
        if dtype not in dtypes or (only and not re.search(only, name)):
            continue
        for cc in ccs:
            ptx, _ = cuda.compile_ptx(fn, types.void(*sig), cc=cc)
            report[f"{name}/{dtype}/sm_{cc[0]}{cc[1]}"] = {
                "f64": f64_lines(ptx)[:5], "bytes": len(ptx), "shfl": "shfl.sync" in ptx,
                "local": len(LOCAL_ACCESS.findall(ptx)),            # ld.local / st.local lines
                "ld_u64": len(re.findall(r"ld\.global(?:\.nc)?\.u64", ptx)),
                "ld_u16": len(re.findall(r"ld\.global(?:\.nc)?\.(?:u16|b16|f16)", ptx))}
            if dump:
                with open(f"{dump}/{name}_{dtype}_sm{cc[0]}{cc[1]}.ptx", "w") as f:
                    f.write(ptx)
    return report


def main(argv=None):
    import os
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise SystemExit("ptx: run with NUMBA_ENABLE_CUDASIM=0 (compile_ptx needs the real CUDA target)")
    argv = sys.argv[1:] if argv is None else argv
    ccs = tuple((int(a[:-1]), int(a[-1])) for a in argv if a.isdigit()) or ((7, 5), (9, 0))
    dtypes = tuple(a for a in argv if a.startswith("float")) or ("float32", "float16", "float64")
    dims = tuple(int(a[2:]) for a in argv if a.startswith("d=")) or HEAD_DIMS
    only = next((a[5:] for a in argv if a.startswith("only=")), None)
    dump = next((a[5:] for a in argv if a.startswith("dump=")), None)
    print(json.dumps(compile_all(ccs, dtypes, dims, only, dump)))


if __name__ == "__main__":
    main()
