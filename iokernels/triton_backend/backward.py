"""The backward launcher: (dq, dk, dv) from do, q, k, v, o and the forward's LSE.

Inputs are made contiguous (one layout for q, do and o, one for k and v); dK and dV come
back summed over each GQA group, in the inputs' dtype.  ``BackwardConfig.deterministic``
picks how dQ is summed over the K/V tiles (:mod:`.backward_v1`): a second kernel by Q tile
that sums them in order (the default), or atomic adds into a float32 buffer.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from . import launch as ln
from .config import LOG2E, BackwardConfig, padded_head_dim
from .forward import f32_dot


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=None, config=None):
    """Backward v1 (:mod:`.backward_v1`): (dq, dk, dv) of the caller's kind."""
    ln.prepare()
    from .backward_v1 import dkdv, dq, row_dot
    cfg = config or BackwardConfig(version="v1")
    numpy_caller = isinstance(q, np.ndarray)
    qt, kt, vt, dot, ot = (ln.to_torch(x, n).contiguous() for x, n in
                           ((q, "q"), (k, "k"), (v, "v"), (do, "do"), (o, "o")))
    lse_t = ln.to_torch(np.asarray(lse, dtype=np.float32) if isinstance(lse, np.ndarray) else lse, "lse")
    lse_t = lse_t.float().contiguous()
    B, Hq, Nq, d = (int(s) for s in qt.shape)
    Hkv, Nk = int(kt.shape[1]), int(kt.shape[2])
    dtype = cv.dtype_name(qt)
    scale = cv.default_scale(d) if scale is None else float(scale)
    left, right = cv.effective_window(bool(causal), window)
    bq, bk = cfg.tile(ln.interpreting())
    bd = padded_head_dim(d)
    warps = cfg.num_warps or 4
    dk_t, dv_t = ln.empty(kt.shape, dtype, like=kt), ln.empty(vt.shape, dtype, like=vt)
    if B * Hq * Nq == 0 or Nk == 0:
        dk_t.zero_(), dv_t.zero_()
        dq_t = ln.zeros(qt.shape, dtype, like=qt)
        return tuple(ln.to_caller(t, numpy_caller) for t in (dq_t, dk_t, dv_t))
    delta = ln.empty((B, Hq, Nq), "float32", like=qt)
    row_dot[(-(-Nq // bq), B * Hq)](dot, ot, delta, *ln.strides(ot), Hq, Nq, d, BLOCK_Q=bq, BLOCK_D=bd)
    common = dict(BLOCK_Q=bq, BLOCK_K=bk, BLOCK_D=bd, F32=f32_dot(dtype), num_warps=warps)
    band = (scale, scale * LOG2E, left, right)
    atomic = not cfg.deterministic
    dq_acc = ln.zeros(qt.shape, "float32", like=qt) if atomic else delta        # (unused when deterministic)
    dkdv[(-(-Nk // bk), B * Hkv)](qt, kt, vt, dot, lse_t, delta, dk_t, dv_t, dq_acc, *ln.strides(qt),
                                  *ln.strides(kt), *ln.strides(dk_t), Hq, Hkv, Hq // Hkv, Nq, Nk, d, *band,
                                  ATOMIC_DQ=atomic, **common)
    if atomic:
        dq_t = dq_acc.to(qt.dtype)
    else:
        dq_t = ln.empty(qt.shape, dtype, like=qt)
        dq[(-(-Nq // bq), B * Hq)](qt, kt, vt, dot, lse_t, delta, dq_t, *ln.strides(qt), *ln.strides(kt), Hq,
                                   Hq // Hkv, Nq, Nk, d, *band, **common)
    return tuple(ln.to_caller(t, numpy_caller) for t in (dq_t, dk_t, dv_t))
