"""Triton forward v2: v1 with the key tiles split into masked (on-band) and unmasked (off-band) loops.

The one idea: most key tiles a Q tile visits are seen whole by every one of its rows, and
those need no mask at all.  v1 masks every tile; v2 sorts the tiles of :func:`.tiles.tile_span`
by what the band does to them, once per program, from the first and last row's key ranges:

* **off-band** tiles lie inside every row's band ([lo of the last row, hi of the first row)):
  scores go straight into the online softmax, with no comparison, no ``-inf`` select, no
  check of the sequence end, and no guard for a row that has seen nothing yet;
* **on-band** tiles cross the edge of some row's band (the causal diagonal, the window's
  edges, the sequence end): masked as in v1.

Under a causal mask alone a Q tile of Br rows has ceil(Br / Bc) or so on-band tiles on the
diagonal and every tile left of them off-band.  The inner loop is one function compiled
twice (``MASKED`` a compile-time flag), called for the on-band tiles before the off-band
ones, the off-band ones, and the on-band ones after; the order does not change the result
(the online softmax is exact in any order).  The structure is that of the two stages of
Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py in
triton-lang/triton; code), generalised to windows and to Nq != Nk.

An off-band tile cannot cross the end of the sequence either, so its loads carry no bounds
check (only the head dim's padding, when the head dim is not a power of two).  The tile
sizes are data: :data:`.config.FORWARD_TILES` (:data:`.config.FORWARD_TILES_F32` for float32),
timed by ``triton.autotune`` on a GPU once per problem class (head dim, dtype, mask, length
bucket), and a single fixed tile under the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tiles
from .config import FORWARD_TILES, FORWARD_TILES_F32
from .tiles import mm

LN2 = tl.constexpr(tiles.LN2)


@triton.jit
def _tiles(acc, l, m, q, k_base, v_base, skn, skd, svn, svd, start, stop, lo, hi, NK, HEAD_DIM,
           qk_scale, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, F32: tl.constexpr,
           MASKED: tl.constexpr):
    """The online softmax over key tiles [start, stop) (multiples of Bc), masked or not."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    for c in range(start, stop, BLOCK_K):
        cols = c + tl.arange(0, BLOCK_K)
        kt_ptr = k_base + cols[None, :] * skn + dims[:, None] * skd            # K_j^T: (d, Bc)
        v_ptr = v_base + cols[:, None] * svn + dims[None, :] * svd              # V_j: (Bc, d)
        if MASKED:
            col_ok = cols < NK
            kt = tl.load(kt_ptr, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
            v = tl.load(v_ptr, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
            s = mm(q, kt, F32) * qk_scale
            seen = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            if EVEN_D:                                                          # no bounds at all
                kt = tl.load(kt_ptr)
                v = tl.load(v_ptr)
            else:                                                               # the head dim's padding only
                kt = tl.load(kt_ptr, mask=dim_ok[:, None], other=0.0)
                v = tl.load(v_ptr, mask=dim_ok[None, :], other=0.0)
            s = mm(q, kt, F32) * qk_scale
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, F32)
        m = m_new
    return acc, l, m


@triton.jit(do_not_specialize=["NQ", "NK", "LEFT", "RIGHT"])
def fwd_v2(Q, K, V, O, LSE,
           sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
           H, GROUP, NQ, NK, HEAD_DIM, qk_scale, LEFT, RIGHT, TUNE_N, BANDED,
           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
           F32: tl.constexpr):
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    r0 = pid_q * BLOCK_Q
    r1 = tl.minimum(r0 + BLOCK_Q, NQ)                       # one past the tile's last real row
    rows = r0 + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    io_ok = (rows < NQ)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :] * sqd, mask=io_ok, other=0.0)
    lo, hi = tiles.key_bounds(rows, NQ, NK, LEFT, RIGHT)

    # the tiles: [t0, f0) on-band, [f0, f1) off-band, [f1, span_hi) on-band
    span_lo, span_hi = tiles.tile_span(r0, r1, NQ, NK, LEFT, RIGHT)
    t0 = (span_lo // BLOCK_K) * BLOCK_K
    all_lo, _ = tiles.tile_span(r1 - 1, r1, NQ, NK, LEFT, RIGHT)    # every row sees [all_lo, all_hi)
    _, all_hi = tiles.tile_span(r0, r0 + 1, NQ, NK, LEFT, RIGHT)
    f0 = tl.minimum(tl.maximum(((all_lo + BLOCK_K - 1) // BLOCK_K) * BLOCK_K, t0), span_hi)
    f1 = tl.minimum(tl.maximum((all_hi // BLOCK_K) * BLOCK_K, f0), span_hi)

    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc, l, m = _tiles(acc, l, m, q, k_base, v_base, skn, skd, svn, svd, t0, f0, lo, hi, NK, HEAD_DIM, qk_scale,
                       BLOCK_K, BLOCK_D, EVEN_D, F32, True)
    acc, l, m = _tiles(acc, l, m, q, k_base, v_base, skn, skd, svn, svd, f0, f1, lo, hi, NK, HEAD_DIM, qk_scale,
                       BLOCK_K, BLOCK_D, EVEN_D, F32, False)
    acc, l, m = _tiles(acc, l, m, q, k_base, v_base, skn, skd, svn, svd, f1, span_hi, lo, hi, NK, HEAD_DIM,
                       qk_scale, BLOCK_K, BLOCK_D, EVEN_D, F32, True)

    empty = l == 0.0
    l_use = tl.where(empty, 1.0, l)
    o_ptr = O + b * sob + h * soh + rows[:, None] * son + dims[None, :] * sod
    tl.store(o_ptr, (acc / l_use[:, None]).to(O.dtype.element_ty), mask=io_ok)
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_use)) * LN2)
    tl.store(LSE + bh * NQ + rows, lse, mask=rows < NQ)


#: fwd_v2 timed over the tile list on a GPU; the autotuner's key is the problem class:
#: the length bucket TUNE_N, whether a band applies (BANDED), the padded head dim, and the dtypes
def _tuned(tile_list):
    return triton.autotune(
        configs=[triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bq, bk, w, s in tile_list],
        key=["TUNE_N", "BANDED", "BLOCK_D"])(fwd_v2)


fwd_v2_tuned = _tuned(FORWARD_TILES)
#: ... for float32 inputs (F32 = TF32X3: three TF32 products), over the smaller tiles
fwd_v2_tuned_f32 = _tuned(FORWARD_TILES_F32)
