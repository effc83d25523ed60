"""Split kernel v3 of the Numba decode: software-pipelined 8-byte word loads and a
reduce-scatter lane sum.  The default decode for C-contiguous K/V (``DecodeConfig()``;
``DecodeConfig(version="v3")`` asks for it); the launchers are in :mod:`.decode`.

Read next to :mod:`.decode` (v1, v2): the algorithm (split-KV online softmax, GQA packing,
the merge of the key groups, the combine kernel), the notation (B, Hq, Hkv, g, n_b, Bn, S,
L, KG, KPI, word, EPW, W, WPL, m, l, O, O_s, LSE_s) and the 8-byte word loads with their
bit-cast unpack are the same.  New names:

=========  ===========================================================================
R          scores one lane sums per iteration: KPI keys x g query heads, padded to RP,
           the next power of two (padding lanes sum zeros)
row        the flat index of a K/V row in the word view (rows, W) of the cache:
           contiguous (b * Hkv + h) * N + c; paged (table[c // Bn] * Bn + c % Bn) * Hkv + h
GS, KS     the key a group takes: base + kg * GS + e * KS (e < KPI) at a step whose first
           key is base; contiguous GS = 1, KS = KG (interleaved); paged GS = KPI, KS = 1
           (each group KPI consecutive keys)
kn, vn     the *next* iteration's words (in flight); kc, vc this iteration's
s_K, s_V   a quantized cache's scales of a key's block (per KV head or per block): a
           stored code c stands for c * s
=========  ===========================================================================

A quantized paged cache (``kv_dtype`` "int8" or "float8_e4m3fn" of
:class:`~iokernels.paged.PagedKVCache`) is read as it is stored: words of eight 1-byte
codes, decoded bit by bit in registers (:func:`.device.make_code_decode`), each key's
block scales s_K, s_V loaded with its words (into the same two-deep pipeline); a value is
c * s, exactly what :func:`iokernels.paged.dequantize` gives, so the kernel agrees with the
NumPy paged decode to float32 rounding.  A sliding window (``left`` >= 0) splits only the
visible keys [n - 1 - left, n), tiled as :func:`iokernels.decode.split_ranges` tiles them.

Paged addressing (``DecodeConfig.paged_addressing``).  Over a contiguous cache a key's row
is one add away from the last.  Over a paged cache, looked up key by key, it costs a
division and a remainder by Bn (Numba's signed ``//`` and ``%`` each add a floor
correction), a shared-memory load of the table entry and a 64-bit multiply: per key, in a
main loop whose math is scalar float32, so the kernel is issuing instructions more than it
is waiting on HBM, and that work slows it against the contiguous kernel.  Two ways:

* **"page"** (the default where it applies): over a paged cache each key group takes KPI
  *consecutive* keys of a step (GS, KS above).  With Bn a multiple of KPI and every step
  starting on a multiple of KPI (no window), those keys are consecutive slots of one page:
  the group looks its page up once per step, and its e-th row is the first + e * Hkv, an
  add, as over a contiguous cache.
* **"key"**: a table lookup per key; any block size, and a sliding window, whose first
  split starts mid-page.  A power-of-two Bn turns its ``//`` and ``%`` into a shift and a
  mask.

Both read the same rows in the same order and give the same bits.  The table is staged
:data:`TABLE_STAGE_V3` entries at a time, so a long split seldom restarts its pipeline (a
barrier, then a table load, then the first K/V loads); the first stage loads next to Q,
behind the barrier that publishes Q, so a short split waits for one round trip to HBM
before its first K/V loads, not two.

What changes from v2, and why (from reading v2's PTX):

====================  ======================================  =============================
                      v2                                      v3
====================  ======================================  =============================
loads vs math         load KPI keys, wait, compute, repeat:   software pipeline: issue the
                      the loads of step i+1 start only after  next step's loads (kn, vn)
                      step i's math                           first, then compute on kc, vc
lane sum of R values  a butterfly per value: R * log2(L)      reduce-scatter + all-gather:
                      shuffles                                2 * (RP - 1)
K/V addressing        4-D ``k[b, h, c, w]``: a multiply-add   one row index per key, then
                      chain per access, and Numba's           ``row * W + w`` into a flat
                      negative-index wraparound for each      view, loaded through a raw
                      signed index                            pointer (no wraparound code)
tiling                L=16, KPI=4, KG=8                       L=32, KPI=4, KG=8 (all three
                                                              configurable): one word a lane
                                                              at d=128 float16, so fewer
                                                              registers for the second buffer
====================  ======================================  =============================

The reduce-scatter (a lane sum that ends with each lane owning a different total): at the
first step lanes ``lane`` and ``lane ^ L/2`` swap halves of their R values -- the lower
lane sends its upper half, keeps its lower half and adds what it receives -- so each now
holds R/2 partial sums over 2 lanes; after log2(L) halvings lane j holds value j summed over
all L lanes (R/2 + R/4 + ... + R/L shuffles).  The all-gather runs the same exchanges in
reverse, doubling the values a lane holds, until every lane has all R totals, which the
online softmax and P V need.  (When R < L the halving stops at one value and the smaller
offsets are plain butterfly steps.)  On the simulator (no shuffles) each shuffle is an
exchange through shared memory with two barriers, so the same index logic is tested
(:func:`.device.make_lane_allreduce`).

The pipeline's second buffer costs registers: at v2's tiling (16 lanes a key) v3 would need
many more, so v3 takes 32 lanes a key.  The per-thread state handed to the final merge of
the key groups (which has barriers and is not unrolled) sits in a small stack frame, as in
v1 and v2; the main loop keeps everything in registers (checked by tests/test_numba_ptx.py).
What still limits it: Numba has no 16-byte loads of 16-bit rows and no ``cp.async``, so
fewer bytes are in flight per thread than in the CuPy backend's C++ kernel, and the math
between loads is issued as scalar float32.  The tilings are rows of the decode sweep
(:mod:`iokernels.bench.sweeps_numba`).

Counted traffic (simulator, :func:`.counting.count_decode` with a v3 config): split v3 ==
``traffic.model("decode" | "paged_decode")`` (each K/V byte read once, as words; the
prefetch past the last key reads nothing).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core.splits import split_range, visible_first
from . import launch as ln
from .config import acc_dtype
from .policy import lanes_per_row
from .device import (make_code_unpack, make_flat_access, make_group_merge, make_lane_allreduce, make_unpack,
                     pow2_at_least, warp_mask)
from .launch import cuda
import numba  # noqa: E402
from numba import int32  # noqa: E402

#: the split-range contract (iokernels.core.splits, written once) as device functions: which
#: keys a split owns, in tiles of Bn keys, and the first key a window leaves visible
split_range_dev = cuda.jit(device=True)(split_range)
visible_first_dev = cuda.jit(device=True)(visible_first)

#: split v3 defaults: lanes per key, key groups per block, keys a group loads per step.
#: 32 lanes x 4 keys x 8 groups: one word a lane at d=128 float16, 2 blocks of 256 threads
#: an SM; the other tilings are rows of the decode sweep.
LANES_PER_KEY_V3 = 32
KEY_GROUPS_V3 = 8
KEYS_PER_ITER_V3 = 4
#: block-table entries staged in shared memory per barrier (2 KiB): 8192 keys at Bn = 16, so a
#: long split restarts its load pipeline (a barrier, a table load, then the first K/V loads)
#: rarely
TABLE_STAGE_V3 = 512


# --------------------------------------------------------------------------- split v3
@functools.lru_cache(maxsize=None)
def make_split_v3(D: int, G: int, L: int, KPI: int, KG: int, BN: int, paged: bool, store_name: str,
                  word_name: str, acc_name: str, simulated: bool, quant: str | None = None,
                  addressing: str = "key"):
    """Split kernel v3 for head_dim D, g = G, L lanes a key, KPI keys a group and step, KG key
    groups, Bn = BN keys a tile (the block size if paged); K and V come as flat (1-D) views of
    ``word_name`` words (rows of W words).  ``quant``: a quantized paged cache's code format
    (``store_name`` is then "uint8", the codes' bytes).  ``addressing`` (paged): "page", one
    table lookup per key group and step (needs Bn % KPI == 0 and steps that start on a page),
    or "key", one per key (:func:`paged_addressing` chooses)."""
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
    NT = KG * L
    STEP = KG * KPI                                           # keys a block takes per step
    RP = pow2_at_least(KPI * G)                              # scores a lane sums per step
    XCH = (NT,) if simulated else (1,)
    STAGE = TABLE_STAGE_V3
    PAGED = paged
    PAGE = paged and addressing == "page"                     # else a table lookup per key
    GS, KS = (KPI, 1) if paged else (1, KG)                   # key kg*GS + e*KS of a step
    POW2, LOG2_BN = BN & (BN - 1) == 0, BN.bit_length() - 1
    allreduce = make_lane_allreduce(L, RP, simulated, warp_mask(NT))
    QUANT = quant is not None
    if QUANT:
        held, unpack = make_code_unpack(quant, word_name, acc_name, simulated)
    else:
        held, unpack = make_unpack(store_name, word_name, acc_name, simulated)
    load, _ = make_flat_access(simulated)
    merge = make_group_merge(D, G, L, KG, NT, WPL, EPW, acc_name)

    @cuda.jit(device=True)
    def page_slot(x):
        """(x // Bn, x % Bn) of a key offset x >= 0 into a stage: a shift and a mask when Bn is
        a power of two (Numba's signed // and % add a floor correction each)."""
        if POW2:
            return x >> LOG2_BN, x & (BN - 1)
        return x // BN, x % BN

    @cuda.jit(device=True)
    def fetch(k, v, kn, vn, ksn, vsn, k_scale, v_scale, sb, sh, first, pa, p1, row0, hkv, tbl, kg, lane):
        """Issue the loads of the step whose first key is ``first`` into kn, vn (and, for a
        quantized cache, its keys' scales into ksn, vsn)."""
        rowp = -1                                         # page addressing: the group's first row
        ksp = vsp = ZERO
        if PAGE and first + kg * KPI < p1:                # its KPI keys lie in one page:
            pg, slot = page_slot(first + kg * KPI - pa)   # one table lookup a step (SRAM)
            blk = tbl[pg]
            rowp = (blk * BN + slot) * hkv + row0
            if QUANT:                                     # load the block's s_K, s_V -> registers
                ksp = k_scale[blk * sb + row0 * sh]
                vsp = v_scale[blk * sb + row0 * sh]
        for e in range(KPI):
            c = first + kg * GS + e * KS
            row = -1
            if c < p1:
                if PAGE:
                    row = rowp + e * hkv                  # the next slot of the same page
                    ksn[e] = ksp
                    vsn[e] = vsp
                elif PAGED:                               # key addressing: a lookup a key
                    pg, slot = page_slot(c - pa)
                    blk = tbl[pg]
                    row = (blk * BN + slot) * hkv + row0
                    if QUANT:                             # load the block's s_K, s_V -> registers
                        ksn[e] = k_scale[blk * sb + row0 * sh]
                        vsn[e] = v_scale[blk * sb + row0 * sh]
                else:
                    row = row0 + c
            for u in range(WPL):
                w = lane + L * u
                kn[e, u] = WZERO
                vn[e, u] = WZERO
                if row >= 0 and w < W:
                    kn[e, u] = held(load(k, row * W + w))   # load K, V words -> registers
                    vn[e, u] = held(load(v, row * W + w))

    @cuda.jit(device=True)
    def stage_entries(tables, tbl, b, pa, p1, tid):
        """Load the block-table entries of keys [pa, p1) -> SRAM (pa on a page boundary)."""
        for e in range(tid, (p1 - pa + BN - 1) // BN, NT):
            tbl[e] = tables[b, pa // BN + e]

    def split_v3(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, hkv, n_max, left,
                 k_scale, v_scale, sb, sh):
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
        xch = cuda.shared.array(XCH, ACC)                     # the simulator's shuffles
        row0 = hk if PAGED else (b * hkv + hk) * n_max        # paged: + (blk*Bn + slot)*Hkv
        chunk = STAGE * BN if PAGED else max(end - start, 1)
        lo = start - start % BN if PAGED else start           # stages start on a page
        if PAGED and lo < end:                                # the first stage's entries, behind
            stage_entries(tables, tbl, b, lo, min(lo + chunk, end), tid)   # the same barrier as Q
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
        sc = cuda.local.array(RP, ACC)                        # scores, then P, of KPI keys x g
        kc = cuda.local.array((KPI, WPL), WORD)               # this step's words
        vc = cuda.local.array((KPI, WPL), WORD)
        kn = cuda.local.array((KPI, WPL), WORD)               # the next step's words (in flight)
        vn = cuda.local.array((KPI, WPL), WORD)
        ksc = cuda.local.array(KPI, ACC)                      # quantized: this step's scales
        vsc = cuda.local.array(KPI, ACC)
        ksn = cuda.local.array(KPI, ACC)                      # ... and the next step's
        vsn = cuda.local.array(KPI, ACC)
        for e in range(KPI):
            ksn[e] = ZERO
            vsn[e] = ZERO
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(WPL):
                for ee in range(EPW):                         # word lane + L*u, element ee
                    q_r[g, u * EPW + ee] = Q_s[g, (lane + L * u) * EPW + ee]
                    o_r[g, u * EPW + ee] = ZERO
        for pa in range(lo, end, chunk):                      # paged: a stage of table entries
            p0, p1 = max(pa, start), min(pa + chunk, end)
            if PAGED and pa > lo:
                cuda.syncthreads()                            # every group done with the last stage
                stage_entries(tables, tbl, b, pa, p1, tid)    # load table entries -> SRAM
                cuda.syncthreads()
            fetch(k, v, kn, vn, ksn, vsn, k_scale, v_scale, sb, sh, p0, pa, p1, row0, hkv, tbl, kg,
                  lane)                                       # prologue: step 0
            for base in range(p0, p1, STEP):                  # every thread the same trip count
                for e in range(KPI):                          # the words that arrived ...
                    ksc[e] = ksn[e]
                    vsc[e] = vsn[e]
                    for u in range(WPL):
                        kc[e, u] = kn[e, u]
                        vc[e, u] = vn[e, u]
                fetch(k, v, kn, vn, ksn, vsn, k_scale, v_scale, sb, sh, base + STEP, pa, p1, row0, hkv, tbl,
                      kg, lane)                               # ... next in flight
                for i in range(RP):
                    sc[i] = ZERO
                for e in range(KPI):                          # s = q . k: unpack each k value
                    for u in range(WPL):                      # once, use it for the g heads
                        for ee in range(EPW):
                            kv = unpack(kc[e, u], ee)
                            if QUANT:
                                kv *= ksc[e]                  # c * s_K: the stored value
                            for g in range(G):
                                sc[e * G + g] += q_r[g, u * EPW + ee] * kv
                allreduce(sc, xch, tid, lane)                 # sum the L lanes' partial dots
                for g in range(G):                            # online softmax over the KPI keys
                    m_new = m[g]
                    for e in range(KPI):
                        if base + kg * GS + e * KS < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new == NEG_INF:                      # no key here: P = 0
                        for e in range(KPI):
                            sc[e * G + g] = ZERO
                    else:
                        alpha = math.exp(m[g] - m_new)
                        row_sum = ZERO
                        for e in range(KPI):
                            p = ZERO
                            if base + kg * GS + e * KS < p1:
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
                            vv = unpack(vc[e, u], ee)
                            if QUANT:
                                vv *= vsc[e]                  # c * s_V
                            for g in range(G):
                                o_r[g, u * EPW + ee] += sc[e * G + g] * vv
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split_v3


def split_v3_tiling(head_dim: int, dtype: str, word_name: str, config=None):
    """(L, KPI, KG) for v3: the config's values or the defaults, with fewer lanes when a
    row has fewer words than lanes."""
    L = (config.lanes_per_key if config is not None else None) or LANES_PER_KEY_V3
    KPI = (config.keys_per_iter if config is not None else None) or KEYS_PER_ITER_V3
    KG = (config.key_groups if config is not None else None) or KEY_GROUPS_V3
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    return lanes_per_row(L, -(-head_dim // epw)), KPI, KG


def paged_addressing(config, block_n: int, left: int = -1) -> str:
    """How paged split v3 finds a key's row: the config's ``paged_addressing``, or "page"
    where it applies (the block size a multiple of keys_per_iter and no sliding window, whose
    first split may start mid-page), else "key".  ValueError for "page" where it cannot run."""
    kpi = (config.keys_per_iter if config is not None else None) or KEYS_PER_ITER_V3
    fits = block_n % kpi == 0 and left < 0
    want = getattr(config, "paged_addressing", None)
    if want == "page" and not fits:
        why = "a sliding window" if left >= 0 else f"block_size {block_n}"
        raise ValueError(f"config.paged_addressing: 'page' needs a block size that is a multiple of keys_per_iter "
                         f"({kpi}) and no sliding window; got {why} (use 'key' or None)")
    return want or ("page" if fits else "key")


def split_v3_kernel_function(head_dim, g, dtype, paged, block_n, word_name, config=None, simulated=None,
                             quant=None, left=-1):
    """``dtype``: q's and O's; ``quant``: a quantized cache's code format (K/V are then bytes);
    ``left``: the sliding window's left extent (-1: none), which the paged addressing needs."""
    if simulated is None:
        simulated = ln.simulated()
    store = dtype if quant is None else "uint8"
    L, KPI, KG = split_v3_tiling(head_dim, store, word_name, config)
    acc_name = np.dtype(acc_dtype(dtype)).name
    addressing = paged_addressing(config, int(block_n), left) if paged else "key"
    return make_split_v3(head_dim, g, L, KPI, KG, int(block_n), paged, store, word_name, acc_name, simulated,
                         quant, addressing)


def launch_split_v3(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config=None,
                    stream=0, left=-1, quant=None):
    """Launch split v3 (not the combine) on device or counting arrays.  k, v: the caches as
    word views ((B, Hkv, N, W) or pools (num_blocks, Bn, Hkv, W)); flattened here (no copy).
    ``left``: the sliding window's left extent (-1: none).  ``quant``: None, or dict(kv=code
    format, k_scale, v_scale (float32 (num_blocks, Hkv or 1), device or counting arrays))."""
    B, Hq, d = (int(x) for x in q.shape)
    Hkv = int(k.shape[2] if paged else k.shape[1])
    n_max = 0 if paged else int(k.shape[2])
    dtype = str(np.dtype(o.dtype))
    word = str(np.dtype(k.dtype))
    S = int(lse_part.shape[0])
    kv = None if quant is None else quant["kv"]
    L, _, KG = split_v3_tiling(d, dtype if kv is None else "uint8", word, config)
    kern = ln.jitted(split_v3_kernel_function(d, Hq // Hkv, dtype, paged, block_n, word, config, quant=kv,
                                              left=int(left)))
    size = int(np.prod(k.shape))
    if quant is None:
        ks = vs = lens                                        # not read: any int array of the launch
        sb = sh = 0
    else:
        ks, vs = quant["k_scale"], quant["v_scale"]
        sb, sh = int(ks.shape[1]), int(ks.shape[1] == Hkv)
        ks, vs = ks.reshape(int(np.prod(ks.shape))), vs.reshape(int(np.prod(vs.shape)))
    kern[(S, Hkv, B), KG * L, stream](q, k.reshape(size), v.reshape(size), tables, lens, o, lse, o_part,
                                      lse_part, acc_dtype(dtype)(scale), S, Hkv, n_max, int(left), ks, vs, sb, sh)
