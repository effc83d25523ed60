"""Split kernel v5 of the Numba decode: the exponential as the hardware computes it.  Runs by
name (``DecodeConfig(version="v5")``), on what v4 runs (C-contiguous float16 / float32 K/V
whose rows are whole 16-byte pairs); the launchers are in :mod:`.decode`.

Read next to :mod:`.decode_v4`: the 16-byte loads, the pipeline, the lane sums, the paged
addressing, the merge of the key groups and the combine are v4's, line for line.  One thing
changes: how a probability is computed.

Why.  v4 takes ``math.exp(s - m)``, which Numba lowers to CUDA's ``expf`` (libdevice's
``__nv_expf``): the SFU computes only 2^x (PTX ``ex2.approx``), so expf first turns e^x into
2^(x log2 e) in a few instructions of its own (in v4's PTX, each ``ex2.approx`` of the load
loop comes with an ``fma.rm``, a ``cvt.sat``, a shift and a negation).  v5 keeps the scores
in log2 units instead: Q is multiplied by scale * log2 e once, when a split loads it, so a
score is s * log2 e and every exponential of the loop is ``math.exp2(s2 - m2)``, which
lowers to the SFU's instruction with no argument reduction (tests/test_numba_ptx.py reads
both loops).  FlashAttention-2 does the same (code: the ``scale_softmax_log2`` field of its
parameters in csrc/flash_attn/src/flash.h, and ``scale_apply_exp2`` in softmax.h beside it).
At g = 4 a step of KPI = 4 keys takes 20 exponentials a lane (16 probabilities and 4
rescales): at d = 128 float16 the step loop's PTX loses about a fifth of its instructions
(moves aside; the test holds v5 under nine tenths of v4's).  v4's docstring says why
instructions per key can matter: a decode whose scalar math cannot keep up with the GPU's HBM
is bound by what it issues.  Whether it is, on a given GPU, is for the benchmark's decode
section and the profiler (``scripts/profile_traffic.py limits``) to say.

The exponents and the maximum m are in log2 units inside the loop; the split leaves it in
natural units (m * ln 2, and l is the same sum in either), so the merge of the key groups,
the LSE it writes and the combine are v4's.  Accuracy: CUDA's ``exp2f`` and ``expf`` both
have a maximum error of 2 ulp (the CUDA C++ Programming Guide's mathematical functions
appendix: docs); the rescaled Q adds one float32 rounding a value.

Counted traffic (simulator): equal to ``traffic.model("decode" | "paged_decode")``, as v4.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import launch as ln
from .config import acc_dtype
from .decode_v3 import TABLE_STAGE_V3, paged_addressing, split_range_dev, visible_first_dev
from .decode_v4 import PAIR_BYTES, make_pair_load, make_word_unpack, pair_reason, split_v4_tiling
from .device import make_group_merge, make_lane_allreduce, pow2_at_least, warp_mask
from .launch import cuda
import numba  # noqa: E402
from numba import int32  # noqa: E402

#: log2(e) and ln(2): a score to log2 units, and the maximum back to natural ones
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


# --------------------------------------------------------------------------- split v5
@functools.lru_cache(maxsize=None)
def make_split_v5(D: int, G: int, L: int, KPI: int, KG: int, BN: int, paged: bool, store_name: str,
                  acc_name: str, simulated: bool, addressing: str = "key", aligned: bool = True):
    """Split kernel v5 for head_dim D, g = G, L lanes a key, KPI keys a group and step, KG key
    groups, Bn = BN keys a tile (the block size if paged): v4's (:func:`.decode_v4.make_split_v4`)
    with its scores in log2 units and exp2 for every exponential."""
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

    @cuda.jit(device=True)
    def fetch(k, v, kn, vn, first, pa, p1, row0, hkv, tbl, kg, lane):
        """Issue the 16-byte loads of the step whose first key is ``first`` into kn, vn."""
        rowp = -1
        if PAGE and first + kg * KPI < p1:                # its KPI keys lie in one page
            pg, slot = page_slot(first + kg * KPI - pa)
            rowp = (tbl[pg] * BN + slot) * hkv + row0
        for e in range(KPI):
            c = first + kg * GS + e * KS
            row = -1
            if c < p1:
                if PAGE:
                    row = rowp + e * hkv
                elif PAGED:
                    pg, slot = page_slot(c - pa)
                    row = (tbl[pg] * BN + slot) * hkv + row0
                else:
                    row = row0 + c
            for u in range(PPL):
                p = lane + L * u
                kn[e, 2 * u] = WZERO
                kn[e, 2 * u + 1] = WZERO
                vn[e, 2 * u] = WZERO
                vn[e, 2 * u + 1] = WZERO
                if row >= 0 and p < P:
                    k0, k1 = load2(k, row * P + p)        # load a K pair, a V pair -> registers
                    v0, v1 = load2(v, row * P + p)
                    kn[e, 2 * u] = k0
                    kn[e, 2 * u + 1] = k1
                    vn[e, 2 * u] = v0
                    vn[e, 2 * u + 1] = v1

    @cuda.jit(device=True)
    def stage_entries(tables, tbl, b, pa, p1, tid):
        for e in range(tid, (p1 - pa + BN - 1) // BN, NT):
            tbl[e] = tables[b, pa // BN + e]

    def split_v5(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, hkv, n_max, left):
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
            for base in range(p0, p1, STEP):
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
                        if base + kg * GS + e * KS < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new == NEG_INF:
                        for e in range(KPI):
                            sc[e * G + g] = ZERO
                    else:
                        alpha = math.exp2(m[g] - m_new)
                        row_sum = ZERO
                        for e in range(KPI):
                            p = ZERO
                            if base + kg * GS + e * KS < p1:
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
        for g in range(G):                                    # the maximum back in natural units
            m[g] = m[g] * LN2
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split_v5


def pair_kernel_function(make, version: str):
    """``kernel_function(head_dim, g, dtype, paged, block_n, config=None, simulated=None, left=-1,
    aligned=True)`` of a split kernel that reads v4's pairs with v4's tiling
    (:func:`.decode_v4.split_v4_tiling`); ``make``: its factory (``make_split_v5``, ...)."""
    def kernel_function(head_dim, g, dtype, paged, block_n, config=None, simulated=None, left=-1, aligned=True):
        if simulated is None:
            simulated = ln.simulated()
        why = pair_reason(dtype, head_dim)
        if why is not None:
            raise ValueError(f"config.version: {why.replace('split kernel v4', f'split kernel {version}')}")
        L, KPI, KG = split_v4_tiling(head_dim, dtype, config)
        acc_name = np.dtype(acc_dtype(dtype)).name
        addressing = paged_addressing(config, int(block_n), left) if paged else "key"
        return make(head_dim, g, L, KPI, KG, int(block_n), paged, dtype, acc_name, simulated, addressing,
                    bool(aligned))
    return kernel_function


def pair_launcher(kernel_function, version: str):
    """The launch of such a split kernel (not the combine) on device or counting arrays: v4's
    (:func:`.decode_v4.launch_split_v4`) with ``kernel_function``'s kernel."""
    def launch(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config=None,
               stream=0, left=-1, quant=None):
        if quant is not None:
            raise ValueError(f"config.version: a {quant['kv']} cache is read by split kernel v3, not {version}")
        B, Hq, d = (int(x) for x in q.shape)
        Hkv = int(k.shape[2] if paged else k.shape[1])
        n_max = 0 if paged else int(k.shape[2])
        dtype = str(np.dtype(o.dtype))
        if str(np.dtype(k.dtype)) != "uint64":
            raise ValueError(f"k, v: split kernel {version} reads 8-byte word views, got {np.dtype(k.dtype)}")
        S = int(lse_part.shape[0])
        L, _, KG = split_v4_tiling(d, dtype, config)
        aligned = all(ln.aligned(x, PAIR_BYTES) for x in (k, v))
        kern = ln.jitted(kernel_function(d, Hq // Hkv, dtype, paged, block_n, config, left=int(left),
                                         aligned=aligned))
        size = int(np.prod(k.shape))
        kern[(S, Hkv, B), KG * L, stream](q, k.reshape(size), v.reshape(size), tables, lens, o, lse, o_part,
                                          lse_part, acc_dtype(dtype)(scale), S, Hkv, n_max, int(left))
    launch.__doc__ = f"Launch split {version} (not the combine): :func:`pair_launcher`'s launch of its kernel."
    return launch


split_v5_kernel_function = pair_kernel_function(make_split_v5, "v5")
launch_split_v5 = pair_launcher(split_v5_kernel_function, "v5")
