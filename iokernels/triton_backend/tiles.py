"""The Triton device functions the kernel versions share: the matrix product, the key band.

* :func:`mm` is ``tl.dot`` with float32 accumulation.  ``F32`` (a compile-time value) says how
  it treats float32 operands.  0: the operands as they come (16-bit products).  :data:`IEEE`
  (1, or True): float32 operands multiplied in IEEE precision, which Triton unrolls into
  CUDA-core multiply-adds (on a GPU ``tl.dot``'s default precision for float32 operands is
  TF32, 10 mantissa bits: ``input_precision`` in its documentation; docs).  :data:`TF32X3` (2):
  float32 operands split as a = a_big + a_small, both TF32, and a b taken as
  a_big b_big + a_big b_small + a_small b_big: three tensor-core products that recover about
  float32's precision (the "3xTF32" trick; NVIDIA/cutlass discussion 385, and Triton's
  F32DotTC pass, lib/Dialect/TritonGPU/Transforms/F32DotTC.cpp; code).
  The forward's float32 inputs take TF32X3 on a GPU; decode and the backward take IEEE (see
  :func:`.forward.f32_dot`).  Under the interpreter every F32 value is one ``np.matmul`` in
  float32: it ignores ``input_precision``.  The interpreter needs F32 for bfloat16 too: its
  ``tl.dot`` multiplies bfloat16's raw 16-bit patterns instead of their values (it holds
  bfloat16 as uint16 for NumPy and passes the arrays to ``np.matmul``: ``create_dot`` in
  triton/runtime/interpreter.py, Triton 3.9; code).  A bfloat16 value is exactly a float32
  value, and the product of two is exact in float32, so this computes what a bfloat16
  product with float32 sums computes on a GPU (up to the order of the sums).
* :func:`to_storage` narrows float32 results to the storage dtype, rounding to nearest even.
  A GPU's conversion rounds so; Triton's interpreter narrows float32 to bfloat16 by dropping
  the low 16 bits (truncation, up to twice the rounding error: seen with Triton 3.9, code),
  so for bfloat16 the rounding is done here in integer arithmetic, the same bits on both.
* :func:`key_bounds` is :func:`iokernels.core.conventions.key_range` written in Triton:
  the keys [lo, hi) each query row sees under the bottom-right causal mask and the window
  (``left``, ``right``; -1 unbounded), for a vector of rows.
* :func:`tile_span` is the key range a whole tile of rows touches (the union of its rows'
  bands): a kernel loops over the key tiles in it and over no others.

Scores are kept in base 2 (``qk_scale`` = scale * log2(e), :func:`tl.exp2`), as the
FlashAttention-2 kernels do; the LSE is converted back to natural log at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .config import IEEE, LN2, LOG2E, TF32X3  # noqa: F401  (the kernels' constants, re-exported)


@triton.jit
def mm(a, b, F32: tl.constexpr):
    """a @ b, accumulated in float32 (see the module docstring for ``F32``)."""
    if F32 == 2:                                    # TF32X3
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    elif F32:                                       # IEEE
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """float32 ``x`` in ``dtype``, rounded to nearest even (see the module docstring)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)                 # round half to even, then drop 16 bits
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def key_bounds(rows, NQ, NK, LEFT, RIGHT):
    """(lo, hi): row i sees keys lo <= j < hi; lo == hi is a fully masked row."""
    diag = rows + (NK - NQ)
    lo = tl.where(LEFT >= 0, tl.minimum(tl.maximum(diag - LEFT, 0), NK), 0)
    hi = tl.where(RIGHT >= 0, tl.minimum(tl.maximum(diag + RIGHT + 1, 0), NK), NK)
    return lo, tl.maximum(hi, lo)


@triton.jit
def tile_span(r0, r1, NQ, NK, LEFT, RIGHT):
    """The keys [lo, hi) that rows r0 .. r1 - 1 see between them (lo >= hi: none)."""
    lo = tl.where(LEFT >= 0, tl.minimum(tl.maximum(r0 + (NK - NQ) - LEFT, 0), NK), 0)
    hi = tl.where(RIGHT >= 0, tl.minimum(tl.maximum(r1 - 1 + (NK - NQ) + RIGHT + 1, 0), NK), NK)
    return lo, hi
