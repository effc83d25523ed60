"""Split kernel v6 of the Numba decode: no bounds checks in the interior of a split.  Runs by
name (``DecodeConfig(version="v6")``), on what v4 and v5 run (C-contiguous float16 / float32
K/V whose rows are whole 16-byte pairs); the launchers are in :mod:`.decode`.

Read next to :mod:`.decode_v5`: everything is v5's, line for line, but the loop over a split's
steps, which becomes two loops.

Why.  Every step of v5 checks, key by key, whether its keys lie before the split's end: the
online softmax keeps a key out of the maximum and gives it probability 0 (a compare and a
select per key and query head), and the prefetch of the next step loads a key only when it
exists, zeroing the registers of one that does not (a compare, a predicated address, four
moves per key).  Only the last step or two of a split can have such keys, yet the checks cost
every step.  v6 walks a split in two loops: the **interior**, the steps whose own keys and
whose next step's keys all exist (base + 2 STEP <= the split's end), with no checks at all;
then v5's checked step for what remains (at most two steps).  At d = 128 float16 the
interior's step loop has about a seventh fewer PTX instructions than v5's (moves aside; the
test reads both loops), and v4's docstring says why instructions per key can matter.  The
same keys, in the same order, with the same arithmetic (on the simulator the tests find v5's
results bit for bit).

Counted traffic (simulator): equal to ``traffic.model("decode" | "paged_decode")``, as v4.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .decode_v3 import TABLE_STAGE_V3, split_range_dev, visible_first_dev
from .decode_v4 import make_pair_load, make_word_unpack
from .decode_v5 import LN_2, LOG2_E, pair_kernel_function, pair_launcher
from .device import make_group_merge, make_lane_allreduce, pow2_at_least, warp_mask
from .launch import cuda
import numba  # noqa: E402
from numba import int32  # noqa: E402

# --------------------------------------------------------------------------- split v6
@functools.lru_cache(maxsize=None)
def make_split_v6(D: int, G: int, L: int, KPI: int, KG: int, BN: int, paged: bool, store_name: str,
                  acc_name: str, simulated: bool, addressing: str = "key", aligned: bool = True):
    """Split kernel v6 for head_dim D, g = G, L lanes a key, KPI keys a group and step, KG key
    groups, Bn = BN keys a tile (the block size if paged): v5's (:func:`.decode_v5.make_split_v5`)
    with the steps of a split's interior unchecked."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, LOG2E, LN2 = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, LOG2_E, LN_2))
    EPW = 8 // np.dtype(store_name).itemsize                  # elements a word
    EPP = 2 * EPW                                             # elements a pair
    P = D // EPP                                              # pairs a row (D * itemsize % 16 == 0)
    PPL = -(-P // L)                                          # pairs a lane
    WPT = 2 * PPL                                             # words a lane holds a key
    DPL = PPL * EPP                                           # dims per lane
    DPAD = PPL * L * EPP                                      # d padded (zeros)
    WORD = numba.uint64
    WZERO = np.uint64(0)
    NT = KG * L
    STEP = KG * KPI
    RP = pow2_at_least(KPI * G)
    XCH = (NT,) if simulated else (1,)
    STAGE = TABLE_STAGE_V3
    PAGED = paged
    PAGE = paged and addressing == "page"
    GS, KS = (KPI, 1) if paged else (1, KG)
    POW2, LOG2_BN = BN & (BN - 1) == 0, BN.bit_length() - 1
    allreduce = make_lane_allreduce(L, RP, simulated, warp_mask(NT))
    unpack = make_word_unpack(store_name, simulated)
    load2 = make_pair_load(simulated, aligned)
    merge = make_group_merge(D, G, L, KG, NT, PPL, EPP, acc_name)

    @cuda.jit(device=True)
    def page_slot(x):
        if POW2:
            return x >> LOG2_BN, x & (BN - 1)
        return x // BN, x % BN

    EXACT = P == PPL * L                                  # every lane's pairs exist (no padding lanes)

    def make_fetch(CHECKED: bool):
        """``fetch(...)``: issue the 16-byte loads of the step whose first key is ``first`` into
        kn, vn; CHECKED (v5's) loads only the keys before p1 and zeroes the others, unchecked
        (the interior: every key exists) loads them all."""
        @cuda.jit(device=True)
        def fetch(k, v, kn, vn, first, pa, p1, row0, hkv, tbl, kg, lane):
            rowp = -1
            if PAGE and (not CHECKED or first + kg * KPI < p1):   # its KPI keys lie in one page
                pg, slot = page_slot(first + kg * KPI - pa)
                rowp = (tbl[pg] * BN + slot) * hkv + row0
            for e in range(KPI):
                c = first + kg * GS + e * KS
                row = -1
                if not CHECKED or c < p1:
                    if PAGE:
                        row = rowp + e * hkv
                    elif PAGED:
                        pg, slot = page_slot(c - pa)
                        row = (tbl[pg] * BN + slot) * hkv + row0
                    else:
                        row = row0 + c
                for u in range(PPL):
                    p = lane + L * u
                    if CHECKED or not EXACT:              # a key or pair not loaded reads as zeros
                        kn[e, 2 * u] = WZERO
                        kn[e, 2 * u + 1] = WZERO
                        vn[e, 2 * u] = WZERO
                        vn[e, 2 * u + 1] = WZERO
                    if (not CHECKED or row >= 0) and (EXACT or p < P):
                        k0, k1 = load2(k, row * P + p)    # load a K pair, a V pair -> registers
                        v0, v1 = load2(v, row * P + p)
                        kn[e, 2 * u] = k0
                        kn[e, 2 * u + 1] = k1
                        vn[e, 2 * u] = v0
                        vn[e, 2 * u + 1] = v1
        return fetch

    def make_step(CHECKED: bool):
        """``step(...)``: one step of KPI keys a group -- the pairs that arrived, the next step's
        loads, s2 = (q log2 e) . k, the lane sums, the online softmax in base 2, O += P V;
        CHECKED (v5's) keeps the keys from p1 on out of it, unchecked (the interior) has none."""
        fetch = make_fetch(CHECKED)

        @cuda.jit(device=True)
        def step(k, v, kc, vc, kn, vn, sc, xch, q_r, o_r, m, l, base, pa, p1, row0, hkv, tbl, kg, lane, tid):
            for e in range(KPI):                          # the pairs that arrived ...
                for u in range(WPT):
                    kc[e, u] = kn[e, u]
                    vc[e, u] = vn[e, u]
            fetch(k, v, kn, vn, base + STEP, pa, p1, row0, hkv, tbl, kg, lane)   # ... next in flight
            for i in range(RP):
                sc[i] = ZERO
            for e in range(KPI):                          # s2 = (q log2 e) . k
                for u in range(PPL):
                    for ee in range(EPP):
                        kv = unpack(kc[e, 2 * u + ee // EPW], ee % EPW)
                        for g in range(G):
                            sc[e * G + g] += q_r[g, u * EPP + ee] * kv
            allreduce(sc, xch, tid, lane)                 # sum the L lanes' partial dots
            for g in range(G):                            # online softmax over the KPI keys, base 2
                m_new = m[g]
                for e in range(KPI):
                    if not CHECKED or base + kg * GS + e * KS < p1:
                        m_new = max(m_new, sc[e * G + g])
                if m_new == NEG_INF:
                    for e in range(KPI):
                        sc[e * G + g] = ZERO
                else:
                    alpha = math.exp2(m[g] - m_new)
                    row_sum = ZERO
                    for e in range(KPI):
                        p = ZERO
                        if not CHECKED or base + kg * GS + e * KS < p1:
                            p = math.exp2(sc[e * G + g] - m_new)
                        sc[e * G + g] = p
                        row_sum += p
                    for u in range(DPL):
                        o_r[g, u] *= alpha
                    l[g] = alpha * l[g] + row_sum
                    m[g] = m_new
            for e in range(KPI):                          # O += P V
                for u in range(PPL):
                    for ee in range(EPP):
                        vv = unpack(vc[e, 2 * u + ee // EPW], ee % EPW)
                        for g in range(G):
                            o_r[g, u * EPP + ee] += sc[e * G + g] * vv
        return step

    fetch = make_fetch(True)
    interior_step, checked_step = make_step(False), make_step(True)

    @cuda.jit(device=True)
    def stage_entries(tables, tbl, b, pa, p1, tid):
        for e in range(tid, (p1 - pa + BN - 1) // BN, NT):
            tbl[e] = tables[b, pa // BN + e]

    def split_v6(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, hkv, n_max, left):
        sp, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg, lane = tid // L, tid % L
        n_s = cuda.shared.array(1, int32)
        if tid == 0:
            n_s[0] = lens[b]
        cuda.syncthreads()
        n = n_s[0]
        a = visible_first_dev(n, left)
        start, end = split_range_dev(n, nsplit, sp, BN, a)     # the split-range contract (core/splits.py)
        Q_s = cuda.shared.array((G, DPAD), ACC)
        tbl = cuda.shared.array(STAGE, int32)
        red_m = cuda.shared.array(KG, ACC)
        red_l = cuda.shared.array(KG, ACC)
        red_o = cuda.shared.array((KG, DPAD), ACC)
        xch = cuda.shared.array(XCH, ACC)
        row0 = hk if PAGED else (b * hkv + hk) * n_max
        chunk = STAGE * BN if PAGED else max(end - start, 1)
        lo = start - start % BN if PAGED else start
        if PAGED and lo < end:
            stage_entries(tables, tbl, b, lo, min(lo + chunk, end), tid)
        scale_log2 = scale * LOG2E                            # scores in log2 units
        for e in range(tid, G * DPAD, NT):                    # load Q group -> SRAM (if busy)
            g, dd = e // DPAD, e % DPAD
            Q_s[g, dd] = ZERO
            if dd < D and end > start:
                Q_s[g, dd] = ACC(q[b, hk * G + g, dd]) * scale_log2
        cuda.syncthreads()
        q_r = cuda.local.array((G, DPL), ACC)
        o_r = cuda.local.array((G, DPL), ACC)
        m = cuda.local.array(G, ACC)
        l = cuda.local.array(G, ACC)
        sc = cuda.local.array(RP, ACC)
        kc = cuda.local.array((KPI, WPT), WORD)           # this step's pairs (as words)
        vc = cuda.local.array((KPI, WPT), WORD)
        kn = cuda.local.array((KPI, WPT), WORD)           # the next step's (in flight)
        vn = cuda.local.array((KPI, WPT), WORD)
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(PPL):
                for ee in range(EPP):                         # pair lane + L*u, element ee
                    q_r[g, u * EPP + ee] = Q_s[g, (lane + L * u) * EPP + ee]
                    o_r[g, u * EPP + ee] = ZERO
        for pa in range(lo, end, chunk):
            p0, p1 = max(pa, start), min(pa + chunk, end)
            if PAGED and pa > lo:
                cuda.syncthreads()
                stage_entries(tables, tbl, b, pa, p1, tid)
                cuda.syncthreads()
            fetch(k, v, kn, vn, p0, pa, p1, row0, hkv, tbl, kg, lane)        # prologue: step 0
            base = p0
            while base + 2 * STEP <= p1:                  # the interior: this step's keys and the next's exist
                interior_step(k, v, kc, vc, kn, vn, sc, xch, q_r, o_r, m, l, base, pa, p1, row0, hkv, tbl, kg,
                              lane, tid)
                base += STEP
            while base < p1:                              # the last steps: v5's checks
                checked_step(k, v, kc, vc, kn, vn, sc, xch, q_r, o_r, m, l, base, pa, p1, row0, hkv, tbl, kg,
                             lane, tid)
                base += STEP
        for g in range(G):                                    # the maximum back in natural units
            m[g] = m[g] * LN2
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split_v6


split_v6_kernel_function = pair_kernel_function(make_split_v6, "v6")
launch_split_v6 = pair_launcher(split_v6_kernel_function, "v6")
