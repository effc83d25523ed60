"""Triton backward v1: FlashAttention-2's backward, P recomputed from the LSE, dK/dV by K/V tile.

The one idea: the forward kept only O and the LSE, so the backward recomputes each score
tile and its probabilities P = exp(S - LSE) on chip instead of reading an N x N matrix
back (Dao, 2023, Algorithm 2; paper).  The work is cut by K/V tile, so that dK_j and dV_j
accumulate in registers and are written once:

* :func:`row_dot` (grid (ceil(Nq / Br), B * Hq)): D_i = rowsum(dO_i * O_i), the term the
  softmax's derivative needs, once per query row;
* :func:`dkdv` (grid (ceil(Nk / Bc), B * Hkv)): the program of K/V tile j loads K_j, V_j
  once, then for each query head of its GQA group and each Q tile whose rows see the tile
  recomputes S = Q_i K_j^T and P, and accumulates dV_j += P^T dO_i, dP = dO_i V_j^T,
  dS = P * (dP - D_i), dK_j += dS^T Q_i (scaled at the end); with ``ATOMIC_DQ`` it also adds
  dQ_i += dS K_j into a float32 buffer by atomic adds (programs of different K/V tiles add
  to the same rows, in whatever order they run: not bitwise reproducible; relaxed order,
  since only the sum matters and the kernel's end orders it before the next launch);
* :func:`dq` (grid (ceil(Nq / Br), B * Hq), the deterministic path): the program of Q tile i
  walks the K/V tiles in order and accumulates dQ_i in registers, recomputing S and P a
  second time: the same bits every run, for one more pass over K and V.

Masks as in forward v1 (every tile masked by :func:`.tiles.key_bounds`); rows with no
visible key (LSE -inf) get P = 0, so their gradients are 0.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tiles
from .tiles import mm

LOG2E = tl.constexpr(tiles.LOG2E)


@triton.jit
def row_dot(DO, O, DELTA, sb, sh, sn, sd, H, NQ, HEAD_DIM, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    bh = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    ok = (rows < NQ)[:, None] & (dims < HEAD_DIM)[None, :]
    off = (bh // H) * sb + (bh % H) * sh + rows[:, None] * sn + dims[None, :] * sd
    do = tl.load(DO + off, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * NQ + rows, tl.sum(do * o, 1), mask=rows < NQ)


@triton.jit
def _p_ds(q, kt, v, do, lse2, delta, rows, cols, NQ, NK, LEFT, RIGHT, qk_scale, F32: tl.constexpr):
    """P and dS of one (Q tile, K/V tile) pair, recomputed from the LSE (base 2)."""
    lo, hi = tiles.key_bounds(rows, NQ, NK, LEFT, RIGHT)
    seen = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & (rows < NQ)[:, None]
    s = mm(q, kt, F32) * qk_scale
    p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)
    dp = mm(do, tl.trans(v), F32)
    return p, p * (dp - delta[:, None])


@triton.jit(do_not_specialize=["NQ", "NK", "LEFT", "RIGHT"])
def dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
         sqb, sqh, sqn, sqd, skb, skh, skn, skd, sdkb, sdkh, sdkn, sdkd,
         HQ, HKV, GROUP, NQ, NK, HEAD_DIM, scale, qk_scale, LEFT, RIGHT,
         BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
         F32: tl.constexpr):
    c0 = tl.program_id(0) * BLOCK_K
    bk = tl.program_id(1)
    b = bk // HKV
    hk = bk % HKV
    cols = c0 + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_D)
    kv_ok = (cols < NK)[:, None] & (dims < HEAD_DIM)[None, :]
    kv_off = b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd     # K, V share a layout
    k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
    v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
    kt = tl.trans(k)
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    # the rows that see a key of [c0, c0 + Bc): lo(i) < c0 + Bc and hi(i) > c0
    shift = NK - NQ
    r_lo = tl.where(RIGHT >= 0, tl.maximum(c0 - RIGHT - shift, 0), 0)
    r_hi = tl.where(LEFT >= 0, tl.minimum(c0 + BLOCK_K + LEFT - shift, NQ), NQ)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        for r0 in range((r_lo // BLOCK_Q) * BLOCK_Q, r_hi, BLOCK_Q):
            rows = r0 + tl.arange(0, BLOCK_Q)
            q_ok = (rows < NQ)[:, None] & (dims < HEAD_DIM)[None, :]
            q_off = b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :] * sqd   # Q, dO share a layout
            q = tl.load(Q + q_off, mask=q_ok, other=0.0)
            do = tl.load(DO + q_off, mask=q_ok, other=0.0)
            lse = tl.load(LSE + bh * NQ + rows, mask=rows < NQ, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
            delta = tl.load(DELTA + bh * NQ + rows, mask=rows < NQ, other=0.0)
            p, ds = _p_ds(q, kt, v, do, lse2, delta, rows, cols, NQ, NK, LEFT, RIGHT, qk_scale, F32)
            dv += mm(tl.trans(p).to(do.dtype), do, F32)
            dk += mm(tl.trans(ds).to(q.dtype), q, F32)
            if ATOMIC_DQ:
                dq_part = mm(ds.to(k.dtype), k, F32) * scale
                dq_off = bh * NQ * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
                tl.atomic_add(DQ_ACC + dq_off, dq_part, mask=q_ok, sem="relaxed")
    out_off = b * sdkb + hk * sdkh + cols[:, None] * sdkn + dims[None, :] * sdkd     # dK, dV share a layout
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit(do_not_specialize=["NQ", "NK", "LEFT", "RIGHT"])
def dq(Q, K, V, DO, LSE, DELTA, DQ,
       sqb, sqh, sqn, sqd, skb, skh, skn, skd,
       H, GROUP, NQ, NK, HEAD_DIM, scale, qk_scale, LEFT, RIGHT,
       BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_Q
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = r0 + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q_ok = (rows < NQ)[:, None] & (dims < HEAD_DIM)[None, :]
    q_off = b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :] * sqd
    q = tl.load(Q + q_off, mask=q_ok, other=0.0)
    do = tl.load(DO + q_off, mask=q_ok, other=0.0)
    lse = tl.load(LSE + bh * NQ + rows, mask=rows < NQ, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    delta = tl.load(DELTA + bh * NQ + rows, mask=rows < NQ, other=0.0)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    span_lo, span_hi = tiles.tile_span(r0, tl.minimum(r0 + BLOCK_Q, NQ), NQ, NK, LEFT, RIGHT)
    for c0 in range((span_lo // BLOCK_K) * BLOCK_K, span_hi, BLOCK_K):          # in order: deterministic
        cols = c0 + tl.arange(0, BLOCK_K)
        kv_ok = (cols < NK)[:, None] & (dims < HEAD_DIM)[None, :]
        kv_off = b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        _, ds = _p_ds(q, tl.trans(k), v, do, lse2, delta, rows, cols, NQ, NK, LEFT, RIGHT, qk_scale, F32)
        acc += mm(ds.to(k.dtype), k, F32)
    tl.store(DQ + q_off, (acc * scale).to(DQ.dtype.element_ty), mask=q_ok)
