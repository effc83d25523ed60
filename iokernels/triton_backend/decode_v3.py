"""Triton split-KV decode v3: v2 with a paged tile's block ids loaded one step ahead.

The one idea.  Triton pipelines a loop's loads for you (``num_stages``: its software pipeliner
issues the copies of later steps while the current one computes, as ``cp.async`` groups on
NVIDIA GPUs).  It can run a load ahead only as far as its address is known.  In v1 and v2 a paged
tile's K/V addresses come from the block table, loaded in the same step (the ids of the tile's
keys, ``table[b, c // page]``): the pipeliner schedules that table load too, and the K/V copies
it addresses get the stages that are left.  Compiled for sm_90 (``python -m
iokernels.triton_backend.pipeline`` prints this without a GPU; the record is
benchmarks/results/sweeps/2026-12-07_1900_triton_decode_pipeline_ptx.txt), the paged loop of v1's
and v2's kernel waits for every copy it issued (``cp.async.wait_group 0``) at three and at four
stages, where the contiguous loop at three stages keeps the next tiles' copies in flight while it
computes (``wait_group 2``); only five stages give the paged loop a tile in flight.

v3 loads the next tile's block ids at the end of each step, into a register the loop carries
(the first tile's before the loop).  No load of a step then feeds that step's K/V addresses, and
the pipeliner schedules the paged copies as it does the contiguous ones (the same waits and the
same shared memory at every stage count).  It runs three stages, three programs a
multiprocessor (:data:`.config.DECODE_DEPTH`): the depth at which the contiguous rows of the
Triton decode sweep were fastest.  Everything else is v1's kernel (:mod:`.decode_v1`: the split,
the online softmax, P V in two 16-bit products, the partials and the merge, which v3 shares).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .decode_v1 import _pv
from .tiles import mm

@triton.jit(do_not_specialize=["LEFT", "NUM_SPLITS"])
def split_kv_v3(Q, K, V, TABLE, LENS, O_PART, LSE_PART,
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
    # v3: the first tile's block ids before the loop; every step loads the next tile's
    blk_next = tl.zeros([BLOCK_N], tl.int32)
    if PAGED:
        first = a + tl.arange(0, BLOCK_N)
        blk_next = tl.load(TABLE + b * stb + first // PAGE, mask=first < e, other=0)
    for c in range(a, e, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        ok = cols < e
        if PAGED:                                   # key c: block table[b, c // PAGE], slot c % PAGE
            blk = blk_next                          # loaded a step ago: no load of this step feeds K/V's addresses
            ahead = cols + BLOCK_N
            blk_next = tl.load(TABLE + b * stb + ahead // PAGE, mask=ahead < e, other=0)
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
