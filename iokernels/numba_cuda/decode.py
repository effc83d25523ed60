"""Flash-Decoding in Numba CUDA: the split kernels v1 and v2, the combine kernel, and the
decode launchers (contiguous and paged), mirroring iokernels.decode.

Read next to :func:`iokernels.decode.decode_split_kv` (contiguous cache) and
:func:`iokernels.decode.paged_decode_split_kv` (paged cache).  Split kernel v3 is in
:mod:`.decode_v3`; the device functions the three versions share (lane sums, 8-byte word
loads and their unpack, the merge of the key groups) are in :mod:`.device`.

Notation:

=========  ===========================================================================
B, Hq, Hkv sequences, query heads, KV heads; g = Hq / Hkv query heads per KV head
n_b        keys of sequence b (``seq_lens``); Bn keys per tile (16; the block size if paged)
S          ``num_splits``: split s takes tiles [s*ceil(Tc/S), (s+1)*ceil(Tc/S)), as
           :func:`iokernels.decode.split_ranges`
L          lanes per key (``lanes_per_key``): a key's d dims are shared by L lanes
KG         key groups per block; threads = KG * L; group k takes keys start+k, start+k+KG, ...
KPI        keys per key group per iteration, all loaded before any arithmetic
m, l, O    running max, sum and unnormalized output, per (group, query head), registers
O_s, LSE_s a split's partial output (float32) and log-sum-exp, in HBM
word       8 bytes of a K/V row read by one load (v2, v3): uint64, a ``.view`` of the array
           (no copy); EPW elements a word (4 float16, 2 float32); EPW = 1, the element
           itself, when the row's bytes are not a multiple of 8, for float64, or when the
           array is not 8-byte aligned.  W words a row, WPL = ceil(W / L) words a lane
=========  ===========================================================================

Kernels:

* **split** (grid (S, Hkv, B)): one thread block per (split, KV head, sequence), GQA
  packed: the block's g query heads all use each K/V row it loads (the g rows of Q are
  staged through shared memory once).  Each key group walks its keys with the online
  softmax, KPI keys a step, then the KG groups' states are merged through shared memory
  (the same log-sum-exp merge as the combine kernel, :func:`.device.make_group_merge`),
  and the block writes O_s, LSE_s; with S = 1 it writes O and LSE directly.  Paged: the
  block first stages its block-table entries in shared memory, then reads key c at
  ``pool[table[c // Bn], c % Bn, kv_head]``.
* **combine** (grid B*Hq): LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s,
  exactly :func:`iokernels.decode.merge_kernel`; all splits empty gives 0 and -inf.

The versions of the split kernel (``DecodeConfig(version=...)``):

* **v1** a key's dims shared by L lanes, each loading its elements one at a time (2-byte
  loads for float16).  What limits it: Numba has no 16-byte vector loads of 16-bit
  values, so too few bytes are in flight to stream HBM.
* **v2** K and V rows read as 8-byte words, so a warp's load instruction moves four times
  the bytes of v1's, each word unpacked into its EPW values in registers by a bit-cast (no
  memory round trip) and used by all g query heads.  The lane, word and key loops have
  compile-time trip counts, so NVVM unrolls them and the per-thread arrays stay in
  registers; Bn is a compile-time constant (no run-time division per key of the paged
  kernel); the paged table stage is four times larger (fewer barriers).  What limits it:
  the next step's loads start only after this step's math.
* **v3** (the default for C-contiguous K/V, :mod:`.decode_v3`) software-pipelined: the
  next step's words are loaded before this step's math; a reduce-scatter lane sum needs
  far fewer shuffles; flat raw-pointer addressing; over a paged cache, one block-table
  lookup per key group and step instead of one per key (``paged_addressing="page"``).
* **v4** (the default for C-contiguous float16 / float32 K/V whose rows are whole 16-byte
  pairs, :mod:`.decode_v4`) v3 with 16-byte loads: a lane reads two words with one vector
  load, so a key needs half the lanes, and the lane sums and the online softmax that each
  of a key's lanes repeats cost half as much per key.
* **v5** (by name, :mod:`.decode_v5`) v4 with its scores in log2 units, so every
  exponential is one exp2 (the SFU's instruction), not an expf with its argument reduction.
* **v6** (by name, :mod:`.decode_v6`) v5 with no bounds checks in a split's interior.

Host side of a call: every buffer (O, LSE, O_s, LSE_s) comes from the caller's library
through :class:`iokernels.core.arrays.Call` (torch's caching allocator for a torch caller),
the block table and lengths are uploaded once and reused while their content is unchanged,
and the kernels launch on the caller's stream.  A repeated call from a torch or CuPy caller
makes no Numba allocation (which would go around the caching allocator, and whose deferred
frees, once enough are pending, flush with a device synchronisation), no host-device copy
and no synchronisation.  Profiled on a GPU, the split and combine kernels of one call take
a small fraction of the time a benchmark once reported for it: the rest was the call's
Python host time (wrapping the caller's arrays, the split-count heuristic, two launches of
a dozen arguments each), which had grown past the launch slack the timer queues ahead of
the call, so the timer counted the GPU waiting for the host, more in one run than the
next.  The split count is now cached per shape; a benchmark that wants the kernel's time
must queue more slack than the call's host time (or replay a captured graph).

A quantized :class:`~iokernels.paged.PagedKVCache` (1-byte int8 / float8 e4m3 codes with
float32 block scales) is read by v3 (:mod:`.decode_v3`) as it is stored; v1 and v2 read
unquantized pools and refuse one by name.  ``window=(left, right)`` (every version): the
query is the last key n - 1, so only keys [n - 1 - left, n) are split among the blocks and
counted by the split heuristic.

Counted traffic (simulator, :mod:`.counting`) equals ``traffic.model("decode")`` /
``("paged_decode")`` of the NumPy versions; the device kernels also read ``seq_lens`` (one
int per block), which the NumPy versions hold on the host.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core import conventions as cv
from ..decode import DEFAULT_BLOCK_N, MAX_SPLITS
from . import decode_v3 as d3
from . import decode_v4 as d4
from .decode_v3 import split_range_dev, visible_first_dev
from . import launch as ln
from .config import PAIR_DECODE_VERSIONS, PIPELINED_DECODE_VERSIONS, SHARED_LIMIT_BYTES, DecodeConfig, acc_dtype
from .policy import DECODE_EVEN_SPLITS, DECODE_SLOTS_PER_SM, lanes_per_row, numba_decode_splits
from .device import WORD_BYTES, make_group_merge, make_lane_sum, make_unpack, warp_mask, word_layout
from .launch import cuda
import numba  # noqa: E402
from numba import int32  # noqa: E402

#: v1: block-table entries a paged split block stages in shared memory at once.
TABLE_STAGE = 32
#: v1: lanes per key and key groups per split block: 8 groups of 16 lanes = 128 threads for
#: d = 128 (8 dims a lane); lanes stay inside one warp so their sum is a shuffle.  Small d
#: gets fewer lanes (and so fewer threads).
LANES_PER_KEY = 16
KEY_GROUPS = 8
#: v1: keys each group loads per iteration before any arithmetic: more loads in flight per
#: thread (decode is bound by how many bytes are in flight), one softmax rescale per 4 keys.
KEYS_PER_ITER = 4
#: v2 defaults: lanes per key, key groups per block, keys a group loads per iteration
LANES_PER_KEY_V2 = 16
KEY_GROUPS_V2 = 8
KEYS_PER_ITER_V2 = 4
#: v2: block-table entries staged in shared memory per barrier (four times v1's)
TABLE_STAGE_V2 = 128
#: threads of a combine block (they share the d dims of one (sequence, head)).
COMBINE_THREADS = 128
#: partial outputs O_s a combine thread loads before it adds them up (the loop over s is
#: unrolled by this much, so the loads overlap; rolled, each load waits for the one before).
COMBINE_UNROLL = 8
def lanes_for(head_dim: int) -> int:
    """v1's lanes per key: LANES_PER_KEY, fewer for small d (at least one dim per lane)."""
    return lanes_per_row(LANES_PER_KEY, head_dim)


# --------------------------------------------------------------------------- split v1
@functools.lru_cache(maxsize=None)
def make_split(D: int, G: int, L: int, paged: bool, acc_name: str, simulated: bool):
    """The split kernel for head_dim D, g = G query heads per KV head, NT threads, L lanes."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO = (np.dtype(acc_name).type(x) for x in (-np.inf, 0))
    KG = KEY_GROUPS                                           # key groups per block
    NT = KG * L                                               # threads per block
    DPT = -(-D // L)                                          # dims per lane
    DPAD = DPT * L
    KPI = KEYS_PER_ITER
    KPIG = KPI * G
    SCRATCH = (KPI * G, NT) if simulated else (1, 1)
    STAGE = TABLE_STAGE
    PAGED = paged
    lane_sum = make_lane_sum(L, KPI * G, simulated, warp_mask(NT))
    merge = make_group_merge(D, G, L, KG, NT, DPT, 1, acc_name)

    def split(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, bn, nsplit, left):
        sp, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg, lane = tid // L, tid % L
        n_s = cuda.shared.array(1, int32)
        if tid == 0:
            n_s[0] = lens[b]                                  # read n_b (once per block)
        cuda.syncthreads()
        n = n_s[0]
        a = visible_first_dev(n, left)                          # the first key the query sees
        start, end = split_range_dev(n, nsplit, sp, bn, a)     # its tiles of [a, n) (core/splits.py)
        Q_s = cuda.shared.array((G, DPAD), ACC)               # SRAM: the g query rows
        tbl = cuda.shared.array(STAGE, int32)                 # SRAM: block-table entries
        red_m = cuda.shared.array(KG, ACC)                    # SRAM: per-group states to merge
        red_l = cuda.shared.array(KG, ACC)
        red_o = cuda.shared.array((KG, DPAD), ACC)
        scratch = cuda.shared.array(SCRATCH, ACC)
        for e in range(tid, G * DPAD, NT):                    # load Q group -> SRAM (if busy)
            g, dd = e // DPAD, e % DPAD
            Q_s[g, dd] = ZERO
            if dd < D and end > start:
                Q_s[g, dd] = ACC(q[b, hk * G + g, dd]) * scale
        cuda.syncthreads()
        q_r = cuda.local.array((G, DPT), ACC)                 # registers
        o_r = cuda.local.array((G, DPT), ACC)
        m = cuda.local.array(G, ACC)
        l = cuda.local.array(G, ACC)
        sc = cuda.local.array(KPIG, ACC)                      # scores of KPI keys x g heads
        kk = cuda.local.array((KPI, DPT), ACC)
        vv = cuda.local.array((KPI, DPT), ACC)
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(DPT):
                q_r[g, u] = Q_s[g, lane + L * u]
                o_r[g, u] = ZERO
        chunk = STAGE * bn if PAGED else max(end - start, 1)
        lo = start - start % bn if PAGED else start           # stages start on a page
        for pa in range(lo, end, chunk):                      # paged: a stage of table entries
            p0, p1 = max(pa, start), min(pa + chunk, end)
            if PAGED:
                for e in range(tid, (p1 - pa + bn - 1) // bn, NT):
                    tbl[e] = tables[b, pa // bn + e]          # load table entries -> SRAM
                cuda.syncthreads()
            for base in range(p0, p1, KG * KPI):              # every thread the same trip count
                for e in range(KPI):                          # load KPI keys' k, v -> registers
                    c = base + kg + e * KG                    # (all loads issued before any math)
                    for u in range(DPT):
                        dd = lane + L * u
                        kk[e, u] = ZERO
                        vv[e, u] = ZERO
                        if c < p1 and dd < D:
                            if PAGED:
                                blk, slot = tbl[(c - pa) // bn], (c - pa) % bn
                                kk[e, u] = ACC(k[blk, slot, hk, dd])
                                vv[e, u] = ACC(v[blk, slot, hk, dd])
                            else:
                                kk[e, u] = ACC(k[b, hk, c, dd])
                                vv[e, u] = ACC(v[b, hk, c, dd])
                for e in range(KPI):                          # s = q . k, lanes summed below
                    for g in range(G):
                        dot = ZERO
                        for u in range(DPT):
                            dot += q_r[g, u] * kk[e, u]
                        sc[e * G + g] = dot
                lane_sum(sc, scratch, tid)                    # KPI*G independent butterflies
                for g in range(G):                            # online softmax over the KPI keys
                    m_new = m[g]
                    for e in range(KPI):
                        if base + kg + e * KG < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new != NEG_INF:
                        alpha = math.exp(m[g] - m_new)
                        for u in range(DPT):
                            o_r[g, u] *= alpha
                        row_sum = ZERO
                        for e in range(KPI):
                            if base + kg + e * KG < p1:
                                p = math.exp(sc[e * G + g] - m_new)
                                row_sum += p
                                for u in range(DPT):
                                    o_r[g, u] += p * vv[e, u]
                        l[g] = alpha * l[g] + row_sum
                        m[g] = m_new
            if PAGED:
                cuda.syncthreads()                            # before the next stage's entries
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split


# --------------------------------------------------------------------------- split v2
@functools.lru_cache(maxsize=None)
def make_split_v2(D: int, G: int, L: int, KPI: int, BN: int, paged: bool, store_name: str, word_name: str,
                  acc_name: str, simulated: bool):
    """Split kernel v2 for head_dim D, g = G, L lanes per key, KPI keys per group and step,
    Bn = BN keys per tile (the block size if paged), K/V given as words of ``word_name``."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO = (np.dtype(acc_name).type(x) for x in (-np.inf, 0))
    EPW = np.dtype(word_name).itemsize // np.dtype(store_name).itemsize
    held_name = word_name if EPW > 1 else acc_name            # what registers hold per word
    WORD = numba.from_dtype(np.dtype(held_name))
    WZERO = np.dtype(held_name).type(0)                       # all bits 0: the value 0.0
    W = -(-D // EPW)                                          # words per row
    WPL = -(-W // L)                                          # words per lane
    DPL = WPL * EPW                                           # dims per lane
    DPAD = WPL * L * EPW                                      # d padded (zeros)
    KG = KEY_GROUPS_V2
    NT = KG * L
    KPIG = KPI * G
    SCRATCH = (KPIG, NT) if simulated else (1, 1)
    STAGE = TABLE_STAGE_V2
    PAGED = paged
    lane_sum = make_lane_sum(L, KPIG, simulated, warp_mask(NT))
    merge = make_group_merge(D, G, L, KG, NT, WPL, EPW, acc_name)
    held, unpack = make_unpack(store_name, word_name, acc_name, simulated)

    def split_v2(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, left):
        sp, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg, lane = tid // L, tid % L
        n_s = cuda.shared.array(1, int32)
        if tid == 0:
            n_s[0] = lens[b]                                  # read n_b (once per block)
        cuda.syncthreads()
        n = n_s[0]
        a = visible_first_dev(n, left)                          # the first key the query sees
        start, end = split_range_dev(n, nsplit, sp, BN, a)     # its tiles of [a, n) (core/splits.py)
        Q_s = cuda.shared.array((G, DPAD), ACC)               # SRAM: the g query rows
        tbl = cuda.shared.array(STAGE, int32)                 # SRAM: block-table entries
        red_m = cuda.shared.array(KG, ACC)
        red_l = cuda.shared.array(KG, ACC)
        red_o = cuda.shared.array((KG, DPAD), ACC)
        scratch = cuda.shared.array(SCRATCH, ACC)
        for e in range(tid, G * DPAD, NT):                    # load Q group -> SRAM (if busy)
            g, dd = e // DPAD, e % DPAD
            Q_s[g, dd] = ZERO
            if dd < D and end > start:
                Q_s[g, dd] = ACC(q[b, hk * G + g, dd]) * scale
        cuda.syncthreads()
        q_r = cuda.local.array((G, DPL), ACC)                 # registers (unrolled loops)
        o_r = cuda.local.array((G, DPL), ACC)
        m = cuda.local.array(G, ACC)
        l = cuda.local.array(G, ACC)
        sc = cuda.local.array(KPIG, ACC)                      # scores, then P, of KPI keys x g
        kw = cuda.local.array((KPI, WPL), WORD)               # the words in flight
        vw = cuda.local.array((KPI, WPL), WORD)
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(WPL):
                for ee in range(EPW):                         # word lane + L*u, element ee
                    q_r[g, u * EPW + ee] = Q_s[g, (lane + L * u) * EPW + ee]
                    o_r[g, u * EPW + ee] = ZERO
        chunk = STAGE * BN if PAGED else max(end - start, 1)
        lo = start - start % BN if PAGED else start           # stages start on a page
        for pa in range(lo, end, chunk):                      # paged: a stage of table entries
            p0, p1 = max(pa, start), min(pa + chunk, end)
            if PAGED:
                for e in range(tid, (p1 - pa + BN - 1) // BN, NT):
                    tbl[e] = tables[b, pa // BN + e]          # load table entries -> SRAM
                cuda.syncthreads()
            for base in range(p0, p1, KG * KPI):              # every thread the same trip count
                for e in range(KPI):                          # load KPI keys' words -> registers
                    c = base + kg + e * KG                    # (all loads before any math)
                    blk, slot = 0, 0
                    if PAGED and c < p1:
                        blk, slot = tbl[(c - pa) // BN], (c - pa) % BN
                    for u in range(WPL):
                        w = lane + L * u
                        kw[e, u] = WZERO
                        vw[e, u] = WZERO
                        if c < p1 and w < W:
                            if PAGED:
                                kw[e, u] = held(k[blk, slot, hk, w])
                                vw[e, u] = held(v[blk, slot, hk, w])
                            else:
                                kw[e, u] = held(k[b, hk, c, w])
                                vw[e, u] = held(v[b, hk, c, w])
                for e in range(KPIG):
                    sc[e] = ZERO
                for e in range(KPI):                          # s = q . k: unpack each k value
                    for u in range(WPL):                      # once, use it for the g heads
                        for ee in range(EPW):
                            kv = unpack(kw[e, u], ee)
                            for g in range(G):
                                sc[e * G + g] += q_r[g, u * EPW + ee] * kv
                lane_sum(sc, scratch, tid)                    # KPI*g butterflies over the L lanes
                for g in range(G):                            # online softmax over the KPI keys
                    m_new = m[g]
                    for e in range(KPI):
                        if base + kg + e * KG < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new == NEG_INF:                      # no key here: P = 0
                        for e in range(KPI):
                            sc[e * G + g] = ZERO
                    else:
                        alpha = math.exp(m[g] - m_new)
                        row_sum = ZERO
                        for e in range(KPI):
                            p = ZERO
                            if base + kg + e * KG < p1:
                                p = math.exp(sc[e * G + g] - m_new)
                            sc[e * G + g] = p
                            row_sum += p
                        for u in range(DPL):
                            o_r[g, u] *= alpha
                        l[g] = alpha * l[g] + row_sum
                        m[g] = m_new
                for e in range(KPI):                          # O += P V: unpack each v value once
                    for u in range(WPL):
                        for ee in range(EPW):
                            vv = unpack(vw[e, u], ee)
                            for g in range(G):
                                o_r[g, u * EPW + ee] += sc[e * G + g] * vv
            if PAGED:
                cuda.syncthreads()                            # before the next stage's entries
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split_v2


# --------------------------------------------------------------------------- combine
@functools.lru_cache(maxsize=None)
def make_combine(D: int, NT: int, acc_name: str):
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    SMAX = MAX_SPLITS
    UN = COMBINE_UNROLL

    def combine(o_part, lse_part, o, lse):
        Hq = o.shape[1]
        b, h = cuda.blockIdx.x // Hq, cuda.blockIdx.x % Hq
        tid = cuda.threadIdx.x
        S = lse_part.shape[0]
        lse_s = cuda.shared.array(SMAX, ACC)
        w_s = cuda.shared.array(SMAX, ACC)
        part = cuda.local.array(UN, ACC)
        for s in range(tid, S, NT):
            lse_s[s] = lse_part[s, b, h]                      # load LSE_s -> SRAM (once)
        cuda.syncthreads()
        mx = NEG_INF
        for s in range(S):
            mx = max(mx, lse_s[s])
        m_ref = ZERO if mx == NEG_INF else mx                 # all empty: weights exp(-inf) = 0
        for s in range(tid, S, NT):
            w_s[s] = math.exp(lse_s[s] - m_ref)               # each weight once -> SRAM
        cuda.syncthreads()
        den = ZERO
        for s in range(S):
            den += w_s[s]
        inv = ZERO if den == ZERO else ONE / den
        for dd in range(tid, D, NT):
            num = ZERO
            for s0 in range(0, S, UN):                        # UN independent loads in flight:
                for e in range(UN):                           # a rolled loop would wait for
                    part[e] = ZERO                            # each O_s before asking for the next
                    if s0 + e < S:
                        part[e] = o_part[s0 + e, b, h, dd]    # read O_s <- HBM
                for e in range(UN):
                    if s0 + e < S:
                        num += w_s[s0 + e] * part[e]
            o[b, h, dd] = num * inv                           # write O -> HBM
        if tid == 0:
            lse[b, h] = NEG_INF if den == ZERO else m_ref + math.log(den)

    return combine


# --------------------------------------------------------------------------- tiling and SRAM
def _padded(head_dim, dtype, word_name, L):
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    w = -(-head_dim // epw)
    return -(-w // L) * L * epw


def lanes_v2(head_dim, dtype, word_name, config=None):
    """v2's lanes per key: the config's (or LANES_PER_KEY_V2), fewer when a row has fewer words
    than lanes."""
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    words = -(-head_dim // epw)
    return lanes_per_row((config.lanes_per_key if config is not None else None) or LANES_PER_KEY_V2, words)


def split_smem_bytes(config: DecodeConfig, head_dim: int, g: int, dtype: str, word_name: str,
                     store: str | None = None) -> int:
    """Static shared memory of one split block of ``config.version``: the g query rows, the KG
    groups' states for the merge, the staged table entries.  ``store``: what K/V hold when it
    is not ``dtype`` (a quantized cache's "uint8" codes)."""
    acc = np.dtype(acc_dtype(dtype)).itemsize
    if config.version == "v1":
        L = lanes_for(head_dim)
        dpad, kg, stage = -(-head_dim // L) * L, KEY_GROUPS, TABLE_STAGE
    elif config.version == "v2":
        dpad, kg, stage = _padded(head_dim, dtype, word_name, lanes_v2(head_dim, dtype, word_name, config)), \
            KEY_GROUPS_V2, TABLE_STAGE_V2
    elif config.version in PAIR_DECODE_VERSIONS:                  # v5, v6: v4's block
        return d4.split_v4_smem_bytes(config, head_dim, g, dtype)
    else:
        L, _, kg = d3.split_v3_tiling(head_dim, store or dtype, word_name, config)
        dpad, stage = _padded(head_dim, store or dtype, word_name, L), d3.TABLE_STAGE_V3
    return (g * dpad + kg * (dpad + 2)) * acc + stage * 4


def smem_reason(config: DecodeConfig, head_dim: int, g: int, dtype: str) -> str | None:
    """Why ``config`` cannot run g query heads per KV head at this head dim (None: it can)."""
    word, _ = word_layout(dtype, head_dim) if config.version != "v1" else (dtype, 1)
    need = split_smem_bytes(config, head_dim, g, dtype, word)
    if need > SHARED_LIMIT_BYTES:
        return (f"{g} query heads per KV head at head_dim {head_dim} ({dtype}) need {need:,} B of shared "
                f"memory in split kernel {config.version}, more than {SHARED_LIMIT_BYTES:,}")
    return None


def split_kernel_function(head_dim, g, dtype, paged, simulated=None):
    """v1's split kernel (Python function, before ``cuda.jit``)."""
    acc_name = np.dtype(acc_dtype(dtype)).name
    if simulated is None:
        simulated = ln.simulated()
    return make_split(head_dim, g, lanes_for(head_dim), paged, acc_name, simulated)


def split_v2_kernel_function(head_dim, g, dtype, paged, block_n, word_name, config=None, simulated=None):
    if simulated is None:
        simulated = ln.simulated()
    acc_name = np.dtype(acc_dtype(dtype)).name
    kpi = (config.keys_per_iter if config is not None else None) or KEYS_PER_ITER_V2
    return make_split_v2(head_dim, g, lanes_v2(head_dim, dtype, word_name, config), kpi, int(block_n), paged,
                         dtype, word_name, acc_name, simulated)


def combine_kernel_function(head_dim, dtype):
    return make_combine(head_dim, COMBINE_THREADS, np.dtype(acc_dtype(dtype)).name)


# --------------------------------------------------------------------------- split counts
def default_num_splits(batch, heads_kv, max_len, block_n, version="v3") -> int:
    """The ``num_splits=None`` split count of split kernel ``version``: the rule is
    :func:`.policy.numba_decode_splits` (its slots per SM and evenness from
    :data:`.policy.DECODE_SLOTS_PER_SM`, :data:`.policy.DECODE_EVEN_SPLITS`); this adds the
    device's SM count."""
    return numba_decode_splits(int(batch), int(heads_kv), int(max_len), int(block_n), ln.num_sms(),
                               DECODE_SLOTS_PER_SM[version], version in DECODE_EVEN_SPLITS)


def resolve_splits(num_splits, B, Hkv, max_len, block_n, version):
    """``num_splits``, or the heuristic's for ``max_len`` keys (the most a query sees)."""
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, max_len, block_n, version)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: the numba combine kernel merges at most {MAX_SPLITS} splits, "
                         f"got {num_splits}")
    return num_splits


# --------------------------------------------------------------------------- launch
def launch_split_v1(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config, stream,
                     left=-1, quant=None):
    B, Hq, d = q.shape
    Hkv = k.shape[2] if paged else k.shape[1]
    dtype = str(np.dtype(o.dtype))
    split = ln.jitted(split_kernel_function(d, Hq // Hkv, dtype, paged))
    split[(int(lse_part.shape[0]), Hkv, B), KEY_GROUPS * lanes_for(d), stream](
        q, k, v, tables, lens, o, lse, o_part, lse_part, acc_dtype(dtype)(scale), block_n, int(lse_part.shape[0]),
        int(left))


def launch_split_v2(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config, stream,
                     left=-1, quant=None):
    B, Hq, d = q.shape
    Hkv = k.shape[2] if paged else k.shape[1]
    dtype, word = str(np.dtype(o.dtype)), str(np.dtype(k.dtype))
    S = int(lse_part.shape[0])
    split = ln.jitted(split_v2_kernel_function(d, Hq // Hkv, dtype, paged, block_n, word, config))
    split[(S, Hkv, B), KEY_GROUPS_V2 * lanes_v2(d, dtype, word, config), stream](
        q, k, v, tables, lens, o, lse, o_part, lse_part, acc_dtype(dtype)(scale), S, int(left))


def launch_decode(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config, split,
                  stream=0, left=-1, quant=None):
    """Launch split (+ combine when S > 1) on device or counting arrays already allocated, on
    ``stream``.  o_part / lse_part: (S, B, Hq, d) / (S, B, Hq) float32 scratch (any shape when
    S == 1).  v2, v3: k and v are the word views of :func:`kv_words`.  ``left``: the sliding
    window's left extent (-1: none); ``quant`` (v3, paged): None or dict(kv=code format,
    k_scale, v_scale), k and v then the code pools' words.  ``split``: the version's split
    launcher (its record's ``args``); the combine is the same for all."""
    B, Hq, d = q.shape
    if B == 0:
        return
    if quant is not None and config.version != "v3":
        raise ValueError(f"config.version: a {quant['kv']} cache is read by split kernel v3, not {config.version}")
    split(q, k, v, tables, lens, o, lse, o_part, lse_part, scale=scale,
          block_n=block_n, paged=paged, config=config, stream=stream, left=left, quant=quant)
    if int(lse_part.shape[0]) > 1:
        comb = ln.jitted(combine_kernel_function(d, str(np.dtype(o.dtype))))
        comb[B * Hq, COMBINE_THREADS, stream](o_part, lse_part, o, lse)


def kv_words(k, v, head_dim, dtype):
    """v2's and v3's K and V: 8-byte word views (no copy) when the row bytes, contiguity and
    alignment allow, else the arrays themselves (one element a word)."""
    ok = all(ln.c_contiguous(x) and ln.aligned(x, WORD_BYTES) for x in (k, v))
    word, epw = word_layout(dtype, head_dim, aligned=ok)
    if epw == 1:
        return k, v, word
    return k.view(np.dtype(word)), v.view(np.dtype(word)), word


def _decode_common(call, q, k, v, tables_h, lens_h, num_splits, scale, block_n, paged, max_len, cfg, split,
                   window=None, quant=None):
    dtype = ln.check_dtype(q, "q")
    left = cv.resolve_window(window)[0]
    if left >= 0:                                         # the heuristic counts the visible keys
        max_len = int(np.minimum(np.asarray(lens_h), left + 1).max(initial=0))
    B, Hq, d = (int(x) for x in q.shape)
    scale = cv.resolve_scale(scale, d)
    Hkv = int(k.shape[2] if paged else k.shape[1])
    acc = acc_dtype(dtype)
    if paged and cfg.version in PIPELINED_DECODE_VERSIONS:
        d3.paged_addressing(cfg, block_n, left)           # an explicit "page" that cannot run raises
    dq, dk, dv = (ln.device_in(call, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if cfg.version in PIPELINED_DECODE_VERSIONS and not all(ln.c_contiguous(x) for x in (dk, dv)):
        raise ValueError(f"k, v: decode {cfg.version} reads the cache through flat views and needs C-contiguous "
                         "K and V (call .contiguous() / np.ascontiguousarray, or use v1 or v2)")
    if cfg.version in PAIR_DECODE_VERSIONS:
        why = d4.pair_reason(dtype, d) if quant is None else f"a {quant['kv']} cache is read by split kernel v3"
        if why is None and not all(ln.aligned(x, WORD_BYTES) for x in (dk, dv)):
            why = "K and V do not start on an 8-byte boundary (v3 reads them element by element)"
        if why is not None:
            raise ValueError(f"config.version: {why}")
    store = dtype if quant is None else "uint8"
    word = store
    if cfg.version != "v1":
        dk, dv, word = kv_words(dk, dv, d, store)
    need = split_smem_bytes(cfg, d, Hq // Hkv, dtype, word, store)
    if need > SHARED_LIMIT_BYTES:
        raise ValueError(f"q: {Hq // Hkv} query heads per KV head at head_dim {d} ({dtype}) need {need:,} B "
                         f"of shared memory in the numba decode kernel {cfg.version}, more than "
                         f"{SHARED_LIMIT_BYTES:,}")
    S = resolve_splits(num_splits, B, Hkv, max_len, block_n, cfg.version)
    tables = ln.upload_constant(np.asarray(tables_h, dtype=np.int32))
    lens = ln.upload_constant(np.asarray(lens_h, dtype=np.int32))
    o_h, o_d = ln.empty(call, (B, Hq, d), dtype)
    lse_h, lse_d = ln.empty(call, (B, Hq), acc)
    part = (S, B, Hq) if S > 1 else (1, 1, 1)             # S == 1 writes O, LSE directly
    _, op = ln.empty(call, part + (d if S > 1 else 1,), acc)
    _, lp = ln.empty(call, part, acc)
    qd = None
    if quant is not None:                                 # the scales travel as the pools do
        qd = dict(kv=quant["kv"], k_scale=ln.device_in(call, quant["k_scale"], "k_scale"),
                  v_scale=ln.device_in(call, quant["v_scale"], "v_scale"))
    launch_decode(dq, dk, dv, tables, lens, o_d, lse_d, op, lp, scale=scale, block_n=block_n, paged=paged,
                  config=cfg, split=split, stream=ln.stream(call), left=left, quant=qd)
    return call.finish(o_h, dtype), call.finish(lse_h, np.dtype(acc).name)


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config, split, window=None):
    """The decode launcher (every version): Flash-Decoding over a contiguous (ragged) cache,
    (o, lse).  ``config``: a :class:`DecodeConfig` naming its version; ``window`` (left,
    right): the query (key n - 1) sees keys [n - 1 - left, n); ``split``: the version's split
    launcher (the record binds it)."""
    call = ln.call_for(q)
    call.check(k, "k")
    call.check(v, "v")
    B, N = int(k.shape[0]), int(k.shape[2])
    lens = np.full(B, N, np.int32) if seq_lens is None else np.asarray(seq_lens, np.int32)
    dummy_table = np.zeros((1, 1), np.int32)
    return _decode_common(call, q, k, v, dummy_table, lens, num_splits, scale, DEFAULT_BLOCK_N, False,
                          int(lens.max(initial=0)), config, split, window)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config, split,
                       window=None, quant=None):
    """Paged Flash-Decoding over pools (num_blocks, block_size, Hkv, d) of any array kind.

    block_tables: int32 (B, max_blocks) NumPy, seq_lens: (B,) NumPy (host: they size the launch).
    ``quant``: None, or dict(kv=code format, k_scale, v_scale) for pools of 1-byte codes
    (uint8 views) with float32 scales (num_blocks, Hkv or 1) of the pools' kind.
    """
    call = ln.call_for(q)
    call.check(k_pool, "k_pool")
    call.check(v_pool, "v_pool")
    lens = np.asarray(seq_lens, np.int32)
    tables = np.asarray(block_tables, np.int32)
    if tables.ndim != 2 or tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables: expected ({q.shape[0]}, max_blocks) int32, got shape {tables.shape}")
    if tables.size == 0:
        tables = np.zeros((q.shape[0], 1), np.int32)
    return _decode_common(call, q, k_pool, v_pool, tables, lens, num_splits, scale, int(k_pool.shape[1]),
                          True, int(lens.max(initial=0)), config, split, window, quant)


def host_like(call, arrays):
    """Host arrays as the caller's kind (NumPy: themselves, copied in at launch)."""
    if call.kind == "torch":
        import torch
        return tuple(torch.as_tensor(p, device=call.like.device) for p in arrays)
    if call.kind == "cupy":
        import cupy
        return tuple(cupy.asarray(p) for p in arrays)
    if call.kind == "numba":
        return tuple(cuda.to_device(p) for p in arrays)
    return tuple(arrays)


def pools_like(call, cache):
    """The cache's NumPy pools as the caller's kind; a quantized cache's codes as their bytes
    (uint8: Numba has no float8 type)."""
    pools = (cache.k_pool, cache.v_pool)
    if cache.quantized:
        pools = tuple(p.view(np.uint8) for p in pools)
    return host_like(call, pools)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config, split, window=None):
    """The paged decode launcher (every version): decode over a PagedKVCache (its NumPy pools,
    and a quantized cache's scales, are copied to the device)."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    call = ln.call_for(q)
    k_pool, v_pool = pools_like(call, cache)
    quant = None
    if cache.quantized:
        ks, vs = host_like(call, (cache.k_scale, cache.v_scale))
        quant = dict(kv=cache.kv_dtype, k_scale=ks, v_scale=vs)
    return paged_decode_pools(q, k_pool, v_pool, tables, lens, num_splits=num_splits, scale=scale, config=config,
                              split=split, window=window, quant=quant)
