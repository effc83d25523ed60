"""The forward launchers: the caller's arrays to torch tensors, the grid, the kernel, back.

One launcher per version (:func:`attention_v1`, :func:`attention_v2`); both take the
arguments :func:`iokernels.attention` resolves (a float scale, a (left, right) window) and
return (O, LSE) of the caller's kind: O in q's dtype, LSE float32 (B, Hq, Nq).  The kernel
modules (which import triton) are imported on the first call, after :func:`.launch.prepare`.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from . import launch as ln
from .config import IEEE, LOG2E, TF32X3, ForwardConfig, next_pow2, padded_head_dim


def _problem(q, k, v, causal, window):
    numpy_caller = isinstance(q, np.ndarray)
    qt, kt, vt = (ln.to_torch(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    B, Hq, Nq, d = (int(s) for s in qt.shape)
    Hkv, Nk = int(kt.shape[1]), int(kt.shape[2])
    left, right = cv.effective_window(bool(causal), window)
    dtype = cv.dtype_name(qt)
    o = ln.empty((B, Hq, Nq, d), dtype, like=qt)
    lse = ln.empty((B, Hq, Nq), "float32", like=qt)
    return numpy_caller, (qt, kt, vt, o, lse), (B, Hq, Hkv, Nq, Nk, d), (left, right), dtype


def _args(tensors, sizes, band, scale):
    qt, kt, vt, o, lse = tensors
    B, Hq, Hkv, Nq, Nk, d = sizes
    return (qt, kt, vt, o, lse, *ln.strides(qt), *ln.strides(kt), *ln.strides(vt), *ln.strides(o),
            Hq, Hq // Hkv, Nq, Nk, d, float(scale) * LOG2E, *band)


def f32_dot(dtype: str, *, tensor_cores: bool = False) -> int:
    """:func:`.tiles.mm`'s ``F32`` for inputs of ``dtype``: 0 for 16-bit inputs on a GPU; for
    float32 inputs, :data:`.config.TF32X3` where the caller asks for the tensor cores
    (``tensor_cores``: the forward, on a GPU), :data:`.config.IEEE` otherwise; IEEE for bfloat16
    under the interpreter (see :mod:`.tiles`).

    Why the forward only: with IEEE products (unrolled into multiply-adds) it was tens of times
    slower than SDPA's float32 kernel in the recorded H200 runs (benchmarks/results), and its
    TF32X3 tiles fit in shared memory.  The backward's TF32X3 tiles at head_dim 128 would not
    (compiled for sm_90, its dK/dV kernel asks for more than the 227 KiB a block may have), and
    decode is bound by memory traffic, not by its products."""
    if dtype == "float32":
        return TF32X3 if tensor_cores and not ln.interpreting() else IEEE
    return IEEE if dtype == "bfloat16" and ln.interpreting() else 0


def attention_v1(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Forward v1 (:mod:`.forward_v1`): (O, LSE)."""
    ln.prepare()
    from .forward_v1 import fwd_v1
    cfg = config or ForwardConfig(version="v1")
    numpy_caller, tensors, sizes, band, dtype = _problem(q, k, v, causal, window)
    B, Hq, Hkv, Nq, Nk, d = sizes
    scale = cv.default_scale(d) if scale is None else scale
    bq, bk, warps, stages = cfg.tile(ln.interpreting())
    if B * Hq * Nq:
        grid = (-(-Nq // bq), B * Hq)
        fwd_v1[grid](*_args(tensors, sizes, band, scale), BLOCK_Q=bq, BLOCK_K=bk, BLOCK_D=padded_head_dim(d),
                     F32=f32_dot(dtype, tensor_cores=True), num_warps=warps, num_stages=stages)
    o, lse = tensors[3], tensors[4]
    return ln.to_caller(o, numpy_caller), ln.to_caller(lse, numpy_caller)


def tune_bucket(nq: int, nk: int) -> int:
    """The autotuner's length class: the next power of two of the longer side, 128 .. 32768."""
    return min(32768, max(128, next_pow2(max(nq, nk))))


def attention_v2(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Forward v2 (:mod:`.forward_v2`): (O, LSE); the tile autotuned on a GPU unless the config names one."""
    ln.prepare()
    from .forward_v2 import fwd_v2, fwd_v2_tuned, fwd_v2_tuned_f32
    cfg = config or ForwardConfig(version="v2")
    numpy_caller, tensors, sizes, band, dtype = _problem(q, k, v, causal, window)
    B, Hq, Hkv, Nq, Nk, d = sizes
    scale = cv.default_scale(d) if scale is None else scale
    tile = cfg.tile(ln.interpreting())
    if B * Hq * Nq:
        args = (*_args(tensors, sizes, band, scale), tune_bucket(Nq, Nk), int(band != (-1, -1)))
        meta = dict(BLOCK_D=padded_head_dim(d), EVEN_D=padded_head_dim(d) == d,
                    F32=f32_dot(dtype, tensor_cores=True))
        if tile is None:
            tuned = fwd_v2_tuned_f32 if meta["F32"] else fwd_v2_tuned
            tuned[lambda m: (-(-Nq // m["BLOCK_Q"]), B * Hq)](*args, **meta)
        else:
            bq, bk, warps, stages = tile
            fwd_v2[(-(-Nq // bq), B * Hq)](*args, BLOCK_Q=bq, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                          **meta)
    o, lse = tensors[3], tensors[4]
    return ln.to_caller(o, numpy_caller), ln.to_caller(lse, numpy_caller)
