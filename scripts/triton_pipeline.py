"""What Triton's software pipeliner made of the split-KV decode's key loop, read from its PTX (no GPU).

    python scripts/triton_pipeline.py [--arch 90] [--stages 2,3,4,5] [--block-n 32]

Compiles the Triton decode kernels (``decode_v1.split_kv``, which v1 and v2 launch, and
``decode_v3.split_kv_v3``) for an NVIDIA target with ``triton.compile`` -- no GPU is needed, only
Triton's bundled ``ptxas`` -- at float16, head_dim 128, a group of 16 rows, over a contiguous and
a paged cache, at each pipeline depth (``num_stages``), and prints for each: the shared memory the
kernel asks for, the ``cp.async`` groups it commits, and the ``cp.async.wait_group N`` inside the
key loop (a loop is the range of a backward branch).  ``wait_group N`` lets the N most recently
committed groups stay in flight: N = 0 means the loop waits for every copy it issued before it
computes, so within one program no copy overlaps the arithmetic; a larger N keeps copies of later
steps in flight while the current one computes.

The arguments are specialised as a launch on a GPU specialises them: the strides of the head
dimension are 1 (Triton compiles an integer argument equal to 1 as a constant), the pointers and
the other strides divisible by 16 (Triton's ``tt.divisibility`` hint, which it gives any integer
argument or pointer that is).  Triton's version is printed first: the pipeliner is Triton's, and
what it does can change between versions.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    """(shared memory bytes, cp.async groups committed, waits inside the loop) of ``kernel``."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: sm_90)")
    p.add_argument("--stages", default="2,3,4,5")
    p.add_argument("--block-n", type=int, default=32)
    a = p.parse_args(argv)
    import triton

    from iokernels.triton_backend.decode_v1 import split_kv
    from iokernels.triton_backend.decode_v3 import split_kv_v3
    print(f"triton {triton.__version__}, sm_{a.arch}, float16, head_dim 128, 16 rows, {a.block_n} keys a tile, 4 warps")
    print(f"{'kernel':<28}{'cache':<12}{'stages':>7}{'shared B':>10}{'groups':>8}  waits in the loop")
    for name, kernel in (("split_kv (v1, v2)", split_kv), ("split_kv_v3 (v3)", split_kv_v3)):
        for paged in (False, True):
            for stages in (int(s) for s in a.stages.split(",")):
                smem, groups, waits = compile_decode(kernel, paged, stages, a.block_n, a.arch)
                print(f"{name:<28}{'paged' if paged else 'contiguous':<12}{stages:>7}{smem:>10}{groups:>8}  "
                      f"{', '.join(map(str, waits)) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
