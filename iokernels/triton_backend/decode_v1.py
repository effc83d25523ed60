"""Triton split-KV decode v1: Flash-Decoding with the query heads of one KV head packed in a tile.

The one idea: one new query token per sequence is too little work for one program per
(sequence, head), so the keys are split too (Flash-Decoding; Dao et al., 2023, blog post),
and the g = Hq / Hkv query heads that read the same KV head share one program: their g
rows of Q form the Q tile (padded to 16 rows, the smallest M ``tl.dot`` took on NVIDIA GPUs before
Triton 3.5, which asks only K >= 16: its backends/nvidia/compiler.py, min_dot_size, code), so each K/V tile read
from memory serves all g heads (GQA packed).

Kernels:

* :func:`split_kv` (grid (S, B * Hkv)): split s of sequence b and KV head hk walks the keys
  :func:`iokernels.core.splits.split_range` gives it (granule Bn, the visible keys of a
  sliding window only), Bn keys a step, with the online softmax, and writes its normalised
  partial output O_s (float32) and LSE_s; an empty split writes 0 and -inf.  ``PAGED``
  (a compile-time flag): key c of sequence b lives in the pool at block
  ``table[b, c // page]``, slot ``c % page`` (vLLM's PagedAttention layout; Kwon et al.,
  2023, paper), read through the block table by a gather load; otherwise at row c of the
  contiguous cache.
  P keeps its float32 values in P V (the forward kernels round P to the storage dtype for the
  16-bit matrix units; every other decode here keeps float32 weights): P is cut into a
  16-bit high part and the 16-bit rounding of what is left, P = hi + lo to about 16
  significant bits, and P V = hi V + lo V, two products on the matrix units.  Decode is
  bound by memory traffic, so the second product costs next to nothing.
* :func:`merge` (grid B * Hq): the exact log-sum-exp merge of the S parts,
  LSE = M + log sum_s exp(LSE_s - M), O = sum_s exp(LSE_s - LSE) O_s with M the largest
  LSE_s; all parts empty gives O = 0 and LSE = -inf (as :func:`iokernels.decode.merge_states`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import mm, to_storage


@triton.jit
def _pv(p, v, F32: tl.constexpr):
    """P V with P's float32 values kept: P = hi + lo, two 16-bit products (F32: one float32 product)."""
    if F32:
        return mm(p, v, True)
    else:
        hi = p.to(v.dtype)
        lo = (p - hi.to(tl.float32)).to(v.dtype)
        return tl.dot(hi, v) + tl.dot(lo, v)


@triton.jit(do_not_specialize=["LEFT", "NUM_SPLITS"])
def split_kv(Q, K, V, TABLE, LENS, O_PART, LSE_PART,
             sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, stb,
             B, HKV, GROUP, HEAD_DIM, qk_scale, LEFT, NUM_SPLITS, PAGE,
             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
             F32: tl.constexpr):
    split = tl.program_id(0)
    bk = tl.program_id(1)
    b = bk // HKV
    hk = bk % HKV
    n = tl.load(LENS + b)
    start = tl.where(LEFT >= 0, tl.maximum(n - 1 - LEFT, 0), 0)
    # the split's keys [a, e): iokernels.core.splits.split_range with granule BLOCK_N
    t0 = start // BLOCK_N
    per = ((n + BLOCK_N - 1) // BLOCK_N - t0 + NUM_SPLITS - 1) // NUM_SPLITS
    a = tl.minimum(tl.maximum((t0 + split * per) * BLOCK_N, start), n)
    e = tl.maximum(tl.minimum((t0 + (split + 1) * per) * BLOCK_N, n), a)

    g = tl.arange(0, BLOCK_G)
    heads = hk * GROUP + g
    g_ok = g < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + dims[None, :] * sqd, mask=g_ok[:, None] & dim_ok[None, :],
                other=0.0)                                                      # the group's rows: (G, d)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for c in range(a, e, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        ok = cols < e
        if PAGED:                                   # key c: block table[b, c // PAGE], slot c % PAGE
            blk = tl.load(TABLE + b * stb + cols // PAGE, mask=ok, other=0)
            k_rows = K + blk * skb + (cols % PAGE) * skn + hk * skh
            v_rows = V + blk * svb + (cols % PAGE) * svn + hk * svh
        else:
            k_rows = K + b * skb + hk * skh + cols * skn
            v_rows = V + b * svb + hk * svh + cols * svn
        k = tl.load(k_rows[:, None] + dims[None, :] * skd, mask=ok[:, None] & dim_ok[None, :], other=0.0)
        s = mm(q, tl.trans(k), F32) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + dims[None, :] * svd, mask=ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _pv(p, v, F32)
        m = m_new

    empty = l == 0.0
    l_use = tl.where(empty, 1.0, l)
    hq = GROUP * HKV
    row = (split * B + b) * hq + heads                                         # O_PART (S, B, Hq, d)
    tl.store(O_PART + row[:, None] * HEAD_DIM + dims[None, :], acc / l_use[:, None],
             mask=g_ok[:, None] & dim_ok[None, :])
    lse2 = tl.where(empty, float("-inf"), m + tl.log2(l_use))                  # base 2
    tl.store(LSE_PART + row, lse2, mask=g_ok)


@triton.jit
def merge(O_PART, LSE_PART, O, LSE, BHQ, HEAD_DIM, NUM_SPLITS, LN2: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)                                                        # (b, query head), flat
    sp = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    s_ok = sp < NUM_SPLITS
    lse = tl.load(LSE_PART + sp * BHQ + r, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top_use = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top_use)                                                  # empty parts weigh 0
    total = tl.sum(w, 0)
    parts = tl.load(O_PART + (sp * BHQ + r)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(s_ok & (lse > float("-inf")))[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    total_use = tl.where(total == 0.0, 1.0, total)
    o = tl.sum(parts * w[:, None], 0) / total_use
    tl.store(O + r * HEAD_DIM + dims, to_storage(o, O.dtype.element_ty), mask=dims < HEAD_DIM)
    tl.store(LSE + r, tl.where(total == 0.0, float("-inf"), (top_use + tl.log2(total_use)) * LN2))
