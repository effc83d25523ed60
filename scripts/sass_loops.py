"""The instruction mix of each loop of a compiled kernel, read from its SASS (no GPU needed).

    python scripts/sass_loops.py [--top 3] FILE.sass ...     (the output of ``cuobjdump -sass``)
    python scripts/sass_loops.py --forward-fp32 [--top 3]     (compile and read the float32 forwards)

A loop is the range of a backward branch.  For each of the ``--top`` innermost loops (holding no
other loop) with the most FFMA (float32 multiply-adds) it prints the loop's length in
instructions, its FFMA and their share, its shared-memory loads by width (``LDS`` 4 bytes,
``LDS.64``, ``LDS.128``), its shuffles, its integer instructions, and the 64-bit integer
arithmetic among them (the ``.EX`` compares and ``.X`` adds and multiplies that carry a 64-bit
counter's high word).

``--forward-fp32`` compiles the float32 forwards at head_dim 128 for sm_90: Numba's v4 to v7
through ``numba.cuda.compile_ptx`` (iokernels.numba_cuda.ptx, no GPU) and ``ptxas``, and the CUDA
C++ v1b (kernels/fa_v1b.cu, the launcher's defines) through ``nvcc``; then it reads their SASS
with ``cuobjdump``.  numba-cuda's NVVM may stamp its PTX with a newer ISA version than the local
``ptxas`` reads; the script lowers the stamp to 9.0 (ptxas then refuses any instruction that
version lacks, so nothing passes unnoticed).  Needs nvcc and ptxas (the CUDA toolkit) and
cuobjdump (the toolkit's, or the copy Triton's wheel carries).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_OP = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)")
_BACK = re.compile(r"\bBRA\s+(?:`\([^)]*\)\s*)?0x([0-9a-f]+)")
_INT = ("IMAD", "IADD3", "ISETP", "LEA", "SEL", "LOP3", "SHF", "IABS", "VIADD")


def loops(sass: str) -> list[dict]:
    """Each loop of ``sass`` (cuobjdump -sass text), most FFMA first: its start and end address,
    its instructions, FFMA and their share, shared loads by width, shuffles, integer instructions
    and the 64-bit ones among them, and whether it is innermost (holds no other loop)."""
    ins = [(int(a, 16), t) for a, t in _LINE.findall(sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = _BACK.search(text)
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in at:
            continue
        body = [t for _, t in ins[at[int(m.group(1), 16)]:i + 1]]
        ops = [(_OP.match(t).group(1) if _OP.match(t) else "") for t in body]
        base = collections.Counter(op.split(".")[0] for op in ops)
        lds = collections.Counter(op for op in ops if op.split(".")[0] == "LDS")
        wide = sum(1 for op in ops if op.split(".")[0] in ("ISETP", "IADD3", "IMAD", "LEA")
                   and (".EX" in op or ".X" in op.split(".")[1:] or op.endswith(".X")))
        out.append(dict(start=hex(int(m.group(1), 16)), end=hex(a), instructions=len(body), ffma=base["FFMA"],
                        ffma_share=round(base["FFMA"] / len(body), 3), lds=dict(sorted(lds.items())),
                        shfl=base["SHFL"], integer=sum(base[k] for k in _INT), integer_64bit=wide))
    for r in out:                       # a loop holding no other loop: where a kernel spends its time
        r["innermost"] = not any(o is not r and int(r["start"], 16) <= int(o["start"], 16)
                                 and int(o["end"], 16) <= int(r["end"], 16) for o in out)
    return sorted(out, key=lambda r: -r["ffma"])


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
        bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise SystemExit("sass_loops: no cuobjdump (install the CUDA toolkit, or triton, which carries one)")


def _sass_of_cubin(cubin: pathlib.Path) -> str:
    return subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def forward_fp32(work: pathlib.Path) -> dict:
    """{name: sass} of the float32 d = 128 forwards for sm_90: Numba v4 to v7 and CUDA C++ v1b."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "iokernels.numba_cuda.ptx", "90", "float32", "d=128", "only=fwd_v[4-7]",
                    f"dump={work}"], check=True, capture_output=True, text=True, env=env)
    out = {}
    for v in ("v4", "v5", "v6", "v7"):
        ptx = work / f"fwd_{v}_d128_float32_sm90.ptx"
        ptx.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx.read_text(), count=1, flags=re.M))
        cubin = work / f"numba_{v}.cubin"
        subprocess.run(["ptxas", "-arch=sm_90", str(ptx), "-o", str(cubin)], check=True, capture_output=True, text=True)
        out[f"numba forward {v}"] = _sass_of_cubin(cubin)
    sys.path.insert(0, str(ROOT))
    from iokernels import cupy_raw as cr
    from iokernels.cupy_raw.launch import source
    defines = cr.ForwardConfig(version="v1b").resolve(128, "float32").defines(128, "float32")
    src = work / "fa_v1b.cu"
    src.write_text(source("fa_v1b"))
    cubin = work / "cupy_v1b.cubin"
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", *[f"-D{k}={v}" for k, v in sorted(defines.items())],
                    str(src), "-o", str(cubin)], check=True, capture_output=True, text=True)
    out["cuda c++ forward v1b"] = _sass_of_cubin(cubin)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="cuobjdump -sass outputs")
    p.add_argument("--forward-fp32", action="store_true", help="compile and read the float32 forwards")
    p.add_argument("--top", type=int, default=3, help="loops a kernel, most FFMA first")
    a = p.parse_args(argv)
    if not a.files and not a.forward_fp32:
        p.error("give SASS files or --forward-fp32")
    sass = {f: pathlib.Path(f).read_text() for f in a.files}
    if a.forward_fp32:
        with tempfile.TemporaryDirectory() as tmp:
            sass.update(forward_fp32(pathlib.Path(tmp)))
    for name, text in sass.items():
        print(name)
        for r in [r for r in loops(text) if r["innermost"]][:a.top]:
            print(f"  loop {r['start']}-{r['end']}: {r['instructions']} instructions, FFMA {r['ffma']} "
                  f"({r['ffma_share']:.0%}), shared loads {r['lds'] or '-'}, SHFL {r['shfl']}, integer "
                  f"{r['integer']} ({r['integer_64bit']} of them 64-bit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
