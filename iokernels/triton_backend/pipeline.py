"""What Triton's software pipeliner made of the split-KV decode's key loop, read from its PTX (no GPU).

:func:`compile_decode` compiles a Triton decode kernel (``decode_v1.split_kv``, which v1 and v2
launch, or ``decode_v3.split_kv_v3``) for an NVIDIA target with ``triton.compile`` -- no GPU is
needed, only the ``ptxas`` Triton's wheel carries -- at float16, head_dim 128, a group of 16 rows,
over a contiguous or a paged cache, at one pipeline depth (``num_stages``), and returns the shared
memory the kernel asks for, the ``cp.async`` groups it commits and the ``cp.async.wait_group N``
inside its key loop (:func:`loop_waits`: a loop is the range of a backward branch).
``wait_group N`` lets the N most recently committed groups stay in flight: N = 0 means the loop
waits for every copy it issued before it computes, so within one program no copy overlaps the
arithmetic; a larger N keeps the copies of later steps in flight while the current one computes.
:func:`pipeline_table` sets them side by side (notebook 15), as does the command line

    python -m iokernels.triton_backend.pipeline [--arch 90] [--stages 2,3,4,5] [--block-n 32]

The arguments are specialised as a launch on a GPU specialises them: the strides of the head
dimension are 1 (Triton compiles an integer argument equal to 1 as a constant), the pointers and
the other strides divisible by 16 (the ``tt.divisibility`` hint Triton gives an integer argument
or pointer that is).  The pipeliner is Triton's, and what it does can change between versions:
the table says which version compiled it.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

_LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.M)
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_WAIT = re.compile(r"cp\.async\.wait_group\s+(\d+);")

#: the pointer arguments' element types (float16 K/V and Q, int32 table and lengths, float32 partials)
POINTERS = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "TABLE": "*i32", "LENS": "*i32", "O_PART": "*fp32",
            "LSE_PART": "*fp32"}
#: the head dimension's strides: 1 in a launch (compiled as constants)
UNIT_STRIDES = ("sqd", "skd", "svd")
#: the integer arguments a launch finds divisible by 16 (the other strides, and the head dim)
DIVISIBLE = ("sqb", "sqh", "skb", "skh", "skn", "svb", "svh", "svn", "stb", "HEAD_DIM")


def _need_triton(arg: str) -> None:
    """Compiling needs Triton alone (no torch, no GPU): a ValueError naming ``arg`` without it."""
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        from .launch import INSTALL_HINT
        raise ValueError(f"{arg}: Triton is not installed ({INSTALL_HINT})")


def loop_waits(ptx: str) -> list[int]:
    """The ``cp.async.wait_group`` counts inside the loops of ``ptx`` (the text between a label
    and a later branch back to it), in order."""
    where = {m.group(1): m.start() for m in _LABEL.finditer(ptx)}
    waits = []
    for m in _BRANCH.finditer(ptx):
        top = where.get(m.group(1))
        if top is not None and top < m.start():
            waits += [int(w) for w in _WAIT.findall(ptx[top:m.start()])]
    return waits


def compile_decode(kernel, paged: bool, stages: int, block_n: int = 32, arch: int = 90):
    """(shared memory bytes, cp.async groups committed, waits inside the loop) of ``kernel``
    compiled for sm_``arch`` at ``stages`` (a ValueError where Triton is not installed)."""
    _need_triton("kernel")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    consts = dict(BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=128, PAGED=bool(paged), F32=False,
                  **{n: 1 for n in UNIT_STRIDES})
    signature = {n: POINTERS.get(n, "constexpr" if n in consts else "fp32" if n == "qk_scale" else "i32")
                 for n in kernel.arg_names}
    hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in POINTERS or n in DIVISIBLE}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=hints)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, num_stages=stages))
    ptx = k.asm["ptx"]
    return int(k.metadata.shared), ptx.count("cp.async.commit_group"), loop_waits(ptx)


def pipeline_table(stages=(2, 3, 4, 5), block_n: int = 32, arch: int = 90) -> str:
    """The decode kernels' shared memory, copy groups and loop waits at each of ``stages``,
    contiguous and paged, as text (v1/v2's kernel, then v3's).

    Where this process runs Triton's interpreter (``TRITON_INTERPRET=1``: its kernels are then
    interpreted functions, which Triton does not compile), the table comes from a fresh Python
    process without it."""
    _need_triton("stages")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", __name__, "--stages", ",".join(map(str, stages)), "--block-n", str(block_n),
               "--arch", str(arch)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return done.stdout.rstrip("\n")
    import triton

    from .decode_v1 import split_kv
    from .decode_v3 import split_kv_v3
    lines = [f"triton {triton.__version__}, sm_{arch}, float16, head_dim 128, 16 rows, {block_n} keys a tile, 4 warps",
             f"{'kernel':<20}{'cache':<12}{'stages':>7}{'shared B':>10}{'groups':>8}  waits in the loop"]
    for name, kernel in (("split_kv (v1, v2)", split_kv), ("split_kv_v3 (v3)", split_kv_v3)):
        for paged in (False, True):
            for n in stages:
                smem, groups, waits = compile_decode(kernel, paged, n, block_n, arch)
                lines.append(f"{name:<20}{'paged' if paged else 'contiguous':<12}{n:>7}{smem:>10}{groups:>8}  "
                             f"{', '.join(map(str, waits)) or '-'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: sm_90)")
    p.add_argument("--stages", default="2,3,4,5")
    p.add_argument("--block-n", type=int, default=32)
    a = p.parse_args(argv)
    print(pipeline_table(tuple(int(s) for s in a.stages.split(",")), a.block_n, a.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
