"""Triton forward v1: one program per Q tile, the online softmax over K/V tiles in a loop.

The one idea: a Triton program owns a whole tile of Br query rows and works on tiles, not
threads.  It loads Q_i once, then walks the key tiles K_j, V_j its rows can see, and for
each one computes the Br x Bc scores with one ``tl.dot``, folds them into the running
maximum m, sum l and unnormalised output O (the online softmax), and moves on; at the end
it writes O / l and the LSE.  Which thread holds which element, what goes through shared
memory and how loads are pipelined is Triton's business (the compiler's layouts), not the
kernel's: compare :mod:`iokernels.numba_cuda.forward`, where each of those is written out.

The masks: every tile the loop visits is masked the same way, with the per-row key band of
:func:`.tiles.key_bounds` (bottom-right causal, the window, the end of the sequence), so a
causal tile on the diagonal and a tile far below it cost the same (v2 separates them).  The
loop runs over the key tiles of :func:`.tiles.tile_span` only, so the tiles no row of the
Q tile sees are never loaded.  GQA: query head h reads KV head h // (Hq / Hkv).  A fully
masked row keeps m = -inf and l = 0 and is written as 0 with LSE -inf.

Grid: (ceil(Nq / Br), B * Hq).  The structure follows FlashAttention-2's forward (Dao,
2023, Algorithm 1; paper) as Triton's fused-attention tutorial writes it
(python/tutorials/06-fused-attention.py in triton-lang/triton; code).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tiles
from .tiles import mm

LN2 = tl.constexpr(tiles.LN2)


@triton.jit(do_not_specialize=["NQ", "NK", "LEFT", "RIGHT"])
def fwd_v1(Q, K, V, O, LSE,
           sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
           H, GROUP, NQ, NK, HEAD_DIM, qk_scale, LEFT, RIGHT,
           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    r0 = pid_q * BLOCK_Q
    rows = r0 + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < NQ
    dim_ok = dims < HEAD_DIM
    q_ptr = Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :] * sqd
    q = tl.load(q_ptr, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    lo, hi = tiles.key_bounds(rows, NQ, NK, LEFT, RIGHT)

    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    span_lo, span_hi = tiles.tile_span(r0, tl.minimum(r0 + BLOCK_Q, NQ), NQ, NK, LEFT, RIGHT)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range((span_lo // BLOCK_K) * BLOCK_K, span_hi, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < NK
        kt = tl.load(k_base + cols[None, :] * skn + dims[:, None] * skd,
                     mask=col_ok[None, :] & dim_ok[:, None], other=0.0)          # K_j^T: (d, Bc)
        s = mm(q, kt, F32) * qk_scale                                           # base-2 scores
        seen = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                    # a row with nothing yet
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + cols[:, None] * svn + dims[None, :] * svd,
                     mask=col_ok[:, None] & dim_ok[None, :], other=0.0)          # V_j: (Bc, d)
        acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt, F32)
        m = m_new

    empty = l == 0.0
    l_use = tl.where(empty, 1.0, l)
    out = acc / l_use[:, None]
    o_ptr = O + b * sob + h * soh + rows[:, None] * son + dims[None, :] * sod
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_use)) * LN2)
    tl.store(LSE + bh * NQ + rows, lse, mask=row_ok)
