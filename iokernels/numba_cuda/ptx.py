"""Compile every Numba kernel to PTX without a GPU, and look for float64 arithmetic in it.

``numba.cuda.compile_ptx`` needs only NVVM (pip-installable with numba-cuda), not a GPU, but
it needs the real CUDA target: the simulator must be off (NUMBA_ENABLE_CUDASIM=0) when numba
is first imported.  ``python -m iokernels.numba_cuda.ptx 75 90 float32 d=128 only=fwd`` (run that way by
tests/test_numba_ptx.py in a subprocess) prints a JSON report; every argument optional.

Why look for float64: a float32 kernel that mixes in a Python float (``0.0``, ``1.0 / l``)
silently computes in float64, which consumer and Ada GPUs run at 1/64 of the float32 rate and
the A100, H100 and H200 at about half of it (their datasheets).
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
#: the code formats of the quantized paged v3 kernels compiled next to the unquantized ones
QUANT_PTX = ("int8", "float8_e4m3fn")


def _arr(t, nd, layout="C"):
    from numba import types
    return types.Array(t, nd, layout)


def kernel_signatures(head_dims=HEAD_DIMS):
    """(name, storage dtype, python function, numba signature) for the kernels of forward
    v1-v4, decode v1/v2 (split, paged split), the combine, gather v1 and the paged prefill; the v3 kernels are
    in :func:`kernel_signatures_v3`."""
    from numba import types
    from .decode import combine_kernel_function, split_kernel_function, split_v2_kernel_function
    from . import forward as fwd
    from . import forward_v5 as fv5
    from . import forward_v6 as fv6
    from . import forward_v7 as fv7
    from . import gather as gat
    from .config import ForwardConfig
    from .paged_prefill import make_prefill
    from .device import word_layout
    out = []
    for dtype in ("float32", "float16", "float64"):
        st = getattr(types, dtype)
        acc = types.float64 if dtype == "float64" else types.float32
        for d in head_dims:
            fwd_sig = (_arr(st, 4), _arr(st, 4), _arr(st, 4), _arr(st, 4), _arr(acc, 3), acc, types.int64, types.int64)
            for version in ("v1", "v2", "v3", "v4"):
                fn = fwd.kernel_function(ForwardConfig(version=version), d, dtype, simulated=False)
                out.append((f"fwd_{version}_d{d}", dtype, fn, fwd_sig))
            fn = fv5.kernel_function(ForwardConfig(version="v5"), d, dtype, simulated=False)
            out.append((f"fwd_v5_d{d}", dtype, fn, fwd_sig))
            fn = fv6.kernel_function(ForwardConfig(version="v6"), d, dtype, simulated=False)
            out.append((f"fwd_v6_d{d}", dtype, fn, fwd_sig))
            fn = fv7.kernel_function(ForwardConfig(version="v7"), d, dtype, simulated=False)
            out.append((f"fwd_v7_d{d}", dtype, fn, fwd_sig))
            for paged in (False, True):
                sig = (_arr(st, 3), _arr(st, 4), _arr(st, 4), _arr(types.int32, 2), _arr(types.int32, 1),
                       _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64, types.int64,
                       types.int64)
                fn = split_kernel_function(d, 4, dtype, paged, simulated=False)
                out.append((f"decode_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
            sig = (_arr(acc, 4), _arr(acc, 3), _arr(st, 3), _arr(acc, 2))
            out.append((f"decode_combine_d{d}", dtype, combine_kernel_function(d, dtype), sig))
            word, _ = word_layout(dtype, d)                   # v2: K/V as 8-byte words
            wt = getattr(types, word)
            for paged in (False, True):
                sig = (_arr(st, 3), _arr(wt, 4), _arr(wt, 4), _arr(types.int32, 2), _arr(types.int32, 1),
                       _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64, types.int64)
                fn = split_v2_kernel_function(d, 4, dtype, paged, 16, word, simulated=False)
                out.append((f"decode_v2_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
            sig = (_arr(st, 3), _arr(st, 4), _arr(st, 4), _arr(types.int32, 2), _arr(types.int32, 1),
                   _arr(types.int32, 1), _arr(st, 3), _arr(acc, 2), acc, types.int32)
            out.append((f"paged_prefill_d{d}", dtype, make_prefill(d, 4, 16, 16, str(acc)), sig))
        gather_t = types.uint64 if dtype != "float64" else st     # the launcher's 8-byte words
        sig = (_arr(gather_t, 4), _arr(gather_t, 4), _arr(types.int32, 1), _arr(gather_t, 3), _arr(gather_t, 3),
               types.int64)
        out.append(("gather", dtype, gat.make_gather(str(gather_t)), sig))
    return out


def kernel_signatures_v3(dtypes=("float16", "float32"), head_dims=(128,), configs=None):
    """(name, storage dtype, python function, numba signature) for the v3 kernels (decode split
    v3, gather v3) at the launch arguments' types; ``configs``: {name tag: (DecodeConfig,
    GatherConfig)} (None: the defaults)."""
    from numba import types
    from . import decode_v3 as d3
    from . import gather as gat
    from .config import DecodeConfig, GatherConfig
    from .device import word_layout
    configs = configs or {"": (DecodeConfig(version="v3"), GatherConfig(version="v3"))}
    out = []
    for dtype in dtypes:
        st = getattr(types, dtype)
        acc = types.float64 if dtype == "float64" else types.float32
        for d in head_dims:
            word, _ = word_layout(dtype, d)
            wt = getattr(types, word)
            for tag, (dcfg, gcfg) in configs.items():
                i32 = _arr(types.int32, 1)
                for paged in (False, True):
                    sig = (_arr(st, 3), _arr(wt, 1), _arr(wt, 1), _arr(types.int32, 2), i32,
                           _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64, types.int64,
                           types.int64, types.int64, i32, i32, types.int64, types.int64)
                    fn = d3.split_v3_kernel_function(d, 4, dtype, paged, 16, word, dcfg, simulated=False)
                    out.append((f"decode_v3{tag}_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
                for kv in QUANT_PTX:                   # a quantized paged cache: words of 1-byte codes
                    cword, _ = word_layout("uint8", d)
                    cw = getattr(types, cword)
                    f32 = _arr(types.float32, 1)
                    sig = (_arr(st, 3), _arr(cw, 1), _arr(cw, 1), _arr(types.int32, 2), i32,
                           _arr(st, 3), _arr(acc, 2), _arr(acc, 4), _arr(acc, 3), acc, types.int64, types.int64,
                           types.int64, types.int64, f32, f32, types.int64, types.int64)
                    fn = d3.split_v3_kernel_function(d, 4, dtype, True, 16, cword, dcfg, simulated=False, quant=kv)
                    out.append((f"decode_v3{tag}_split_paged_{kv}_d{d}", dtype, fn, sig))
                W = d * np.dtype(dtype).itemsize // np.dtype(word).itemsize
                sig = (_arr(wt, 1), _arr(wt, 1), _arr(types.int32, 1), _arr(wt, 1), _arr(wt, 1), types.int64)
                out.append((f"gather_v3{tag}_d{d}", dtype, gat.gather_v3_kernel_function(word, W, 8, 16, gcfg, False),
                            sig))
    return out


def kernel_signatures_v4(dtypes=("float16", "float32"), head_dims=(128,), configs=None, aligned=True,
                         version="v4"):
    """(name, storage dtype, python function, numba signature) for decode split v4 (or, with
    ``version`` "v5" or "v6", that version: v4's arguments) (contiguous and paged) at the launch arguments' types;
    ``configs``: {name tag: DecodeConfig} (None: the defaults); ``aligned``: the 16-byte load
    (True) or the two-word form."""
    from numba import types
    from . import decode_v4 as d4
    from . import decode_v5 as d5
    from . import decode_v6 as d6
    from .config import DecodeConfig
    make = {"v4": d4.split_v4_kernel_function, "v5": d5.split_v5_kernel_function,
            "v6": d6.split_v6_kernel_function}[version]
    configs = configs or {"": DecodeConfig(version=version)}
    out = []
    for dtype in dtypes:
        st = getattr(types, dtype)
        acc = types.float64 if dtype == "float64" else types.float32
        wt, i32 = _arr(types.uint64, 1), _arr(types.int32, 1)
        for d in head_dims:
            for tag, cfg in configs.items():
                for paged in (False, True):
                    sig = (_arr(st, 3), wt, wt, _arr(types.int32, 2), i32, _arr(st, 3), _arr(acc, 2), _arr(acc, 4),
                           _arr(acc, 3), acc, types.int64, types.int64, types.int64, types.int64)
                    fn = make(d, 4, dtype, paged, 16, cfg, simulated=False, aligned=aligned)
                    form = ("" if aligned else "_unaligned") + "_split" + ("_paged" if paged else "")
                    name = f"decode_{version}{tag}{form}_d{d}"
                    out.append((name, dtype, fn, sig))
    return out


def ptx_report_v4(ccs=((9, 0),), dtypes=("float16", "float32"), head_dims=(128,), configs=None, aligned=True,
                  dump=None, version="v4") -> dict:
    """:func:`compile_all`'s report for decode split v4, v5 or v6 (:func:`kernel_signatures_v4`)."""
    return _compile(kernel_signatures_v4(dtypes, head_dims, configs, aligned, version), ccs, dump)


#: a global load of 8 or 16 bytes (the K/V words and pairs of decode v2-v4)
WIDE_LOAD = re.compile(r"\bld\.global(?:\.nc)?\.(?:v2\.)?u64\b")


def in_load_loops(ptx: str, pattern: re.Pattern) -> int:
    """Lines matching ``pattern`` inside the loops that load K/V words: the most, over every
    loop (a label and a branch back to it) with an 8- or 16-byte global load in it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$\w+):", line))}
    worst = 0
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = "\n".join(lines[labels[m.group(1)]:i + 1])
            if WIDE_LOAD.search(body):
                worst = max(worst, len(pattern.findall(body)))
    return worst


def inner_load_loops(ptx: str, pattern: re.Pattern) -> list[int]:
    """Lines matching ``pattern`` in each innermost loop that loads K/V words (a loop, as in
    :func:`in_load_loops`, with no other loop inside it), smallest first: one count a loop
    where a kernel walks its keys in more than one loop (decode v6: an interior, then a tail)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$\w+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    bodies = ["\n".join(lines[a:b + 1]) for a, b in inner]
    return sorted(len(pattern.findall(body)) for body in bodies if WIDE_LOAD.search(body))


#: a 64-bit shift (how decode v2/v3 take a value out of a word)
SHIFT_64 = re.compile(r"\bshr\.[bus]64\b")


def loop_local_accesses(ptx: str) -> int:
    """ld.local / st.local lines inside the loops that load K/V words (:func:`in_load_loops`).
    0: the main loop keeps its arrays in registers (the state handed to a merge after the loop
    may still sit in a stack frame)."""
    return in_load_loops(ptx, LOCAL_ACCESS)


#: an SFU exponential (2^x); and the argument reduction of expf before it (an FMA rounding
#: toward -inf, a saturating convert), which decode v5's exp2 does without
EX2 = re.compile(r"\bex2\.approx\b")
#: a 16-byte load from global memory: four 4-byte or two 8-byte values
GLOBAL_16B = re.compile(r"ld\.global(?:\.nc)?\.v(?:4\.(?:f32|b32|u32)|2\.(?:f64|b64|u64))")
EXPF_REDUCTION = re.compile(r"\b(?:fma\.rm|cvt\.sat)\.")
#: an instruction line other than a register move (ptxas removes most moves)
NOT_A_MOVE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?!mov\.)[a-z][a-z0-9]*(?:\.[a-z0-9]+)*\s", re.M)


def _ptx_counts(ptx: str) -> dict:
    return {"f64": f64_lines(ptx)[:5], "bytes": len(ptx), "shfl": len(re.findall(r"\bshfl\.sync", ptx)),
            "local": len(LOCAL_ACCESS.findall(ptx)),            # ld.local / st.local lines
            "loop_local": loop_local_accesses(ptx),
            "loop_shr_u64": in_load_loops(ptx, SHIFT_64),           # 64-bit shifts in the load loops
            "ld_v2_u64": len(re.findall(r"ld\.global(?:\.nc)?\.v2\.u64", ptx)),   # 16-byte loads
            "ld_u64": len(re.findall(r"ld\.global(?:\.nc)?\.u64", ptx)),
            "st_u64": len(re.findall(r"st\.global\.u64", ptx)),
            "ld_u16": len(re.findall(r"ld\.global(?:\.nc)?\.(?:u16|b16|f16)", ptx)),
            "ld_shared_i32": len(re.findall(r"ld\.shared\.[us]32", ptx)),   # decode v3: n_b, table entries
            "ld_shared_16B": len(re.findall(r"ld\.shared\.(?:v4\.f32|v2\.f64)", ptx)),   # forward v6
            "ld_shared_f": len(re.findall(r"ld\.shared\.f(?:32|64)", ptx)),   # ... and 4/8-byte float loads
            "ld_global_16B": len(GLOBAL_16B.findall(ptx)),            # forward v7's tile copies
            "loop_ex2": in_load_loops(ptx, EX2), "loop_expf_reduction": in_load_loops(ptx, EXPF_REDUCTION),
            "loop_instructions": in_load_loops(ptx, NOT_A_MOVE),
            "inner_loop_instructions": inner_load_loops(ptx, NOT_A_MOVE)}


def _compile(signatures, ccs, dump):
    from numba import cuda, types
    _no_device_for_device_functions(ccs[0])
    report = {}
    for name, dtype, fn, sig in signatures:
        for cc in ccs:
            ptx, _ = cuda.compile_ptx(fn, types.void(*sig), cc=cc)
            report[f"{name}/{dtype}/sm_{cc[0]}{cc[1]}"] = _ptx_counts(ptx)
            if dump:
                with open(f"{dump}/{name}_{dtype}_sm{cc[0]}{cc[1]}.ptx", "w") as f:
                    f.write(ptx)
    return report


def ptx_report(ccs=((9, 0),), dtypes=("float16", "float32"), head_dims=(128,), configs=None, dump=None) -> dict:
    """:func:`compile_all`'s report for the v3 kernels (:func:`kernel_signatures_v3`), compiled
    with the simulator off (run in a process started with NUMBA_ENABLE_CUDASIM=0)."""
    return _compile(kernel_signatures_v3(dtypes, head_dims, configs), ccs, dump)


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
    """{f"{name}/{dtype}/sm_{cc}": {"f64": [lines], "bytes": n, "shfl": n, "local": n, "ld_u64": n,
    "st_u64": n, "ld_u16": n, "ld_shared_i32": n, "ld_shared_16B": n, "ld_shared_f": n, "ld_global_16B": n}}
    per kernel of :func:`kernel_signatures` and cc:
    float64 lines, PTX size, shuffles, local-memory accesses (per-thread arrays that did not stay
    in registers), 8-byte global loads and stores, 2-byte global loads, 32-bit integer loads
    from shared memory (in decode v3: the sequence length and the block-table entries), 16-byte
    and 4/8-byte float loads from shared memory (forward v6 against v5), 16-byte global loads
    (forward v7's tile copies; decode v4's pairs count there too).

    ``only``: a regular expression a kernel's name must contain (None: all); ``dump``: a folder to write
    each PTX to (for ``ptxas -v``)."""
    sigs = [s for s in kernel_signatures(head_dims) if s[1] in dtypes and not (only and not re.search(only, s[0]))]
    return _compile(sigs, ccs, dump)


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
