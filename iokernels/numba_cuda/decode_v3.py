"""Version 3 of the Numba decode kernels: a software-pipelined split kernel with a cheaper
lane sum, and a gather that copies one pool block per thread block.  The split kernels
are the default decode (``DecodeConfig()``; ``DecodeConfig(version=3)`` asks for them).
Measured on the H200 (2026-11-29 12:47 UTC, float16 GQA 32/8 d=128 B=1 N=32768): 0.098 ms
= 1.37 TB/s = 0.51x cuDNN (v2 0.33x, v1 0.12x), paged 0.45x; gather 0.94x a device copy at
131072 tokens.

Read next to :mod:`.decode_v2`: the algorithm (split-KV online softmax, GQA packing, the
merge of the key groups, the combine kernel), the notation (B, Hq, Hkv, g, n_b, Bn, S, L,
KG, KPI, word, EPW, W, WPL, m, l, O, O_s, LSE_s) and the 8-byte word loads with their
bit-cast unpack are the same.  New names:

=========  ===========================================================================
R          scores one lane sums per iteration: KPI keys x g query heads, padded to RP,
           the next power of two (padding lanes sum zeros)
row        the flat index of a K/V row in the word view (rows, W) of the cache:
           contiguous (b * Hkv + h) * N + c; paged (table[c // Bn] * Bn + c % Bn) * Hkv + h
kn, vn     the *next* iteration's words (in flight); kc, vc this iteration's
UN         gather: words of K and of V a thread loads before it stores any
=========  ===========================================================================

What version 2 measured on the H200 (float16, GQA 32/8, d=128, B=1, N=32768, cuDNN SDPA
2.7 TB/s of K+V in the same run): 0.76 TB/s (0.29x; v2-L32K8 0.77), paged 0.71; 1.58 TB/s
at B=64 (cuDNN 4.5), so the kernel itself, not only launch overhead, is ~3x short.  The
CUDA C++ split kernel of the CuPy backend (plain 16-byte loads) reached 1.85 TB/s at B=1.
Gather v1 1.94 TB/s read+write at 131072 tokens (0.46x a 4.19 TB/s device copy), gather v2
1.77 (0.42x).  What changed, and why (reasons from reading v2's PTX, not from a profiler):

====================  ======================================  =============================
                      version 2                               version 3
====================  ======================================  =============================
loads vs math         load KPI keys, wait, compute, repeat:   software pipeline: issue the
                      the loads of step i+1 start only after  next step's loads (kn, vn)
                      step i's math                           first, then compute on kc, vc
lane sum of R values  a butterfly per value: R * log2(L)      reduce-scatter + all-gather:
                      shuffles (R=16, L=16: 64 a step;        2 * (RP - 1) (R=16: 30;
                      R=32, L=32: 160)                        R=32: 62)
K/V addressing        4-D ``k[b, h, c, w]``: a multiply-add   one row index per key, then
                      chain per access, and Numba's           ``row * W + w`` into a flat
                      negative-index wraparound for each      view, loaded through a raw
                      signed index                            pointer (no wraparound code)
tiling                L=16, KPI=4, KG=8 (configurable L, KPI) L=32, KPI=8, KG=4 (all three
                                                              configurable): fewer registers
gather work unit      a warp per (block, part) item, grid-    a thread block per pool block
                      stride loop, 8 words of K and V a lane  (no loop over items, big
                      before the stores                       grid), UN = 8 words of K and
                                                              8 of V a thread before its
                                                              stores, one table read and
                                                              one barrier a block
====================  ======================================  =============================

The reduce-scatter (a lane sum that ends with each lane owning a different total): at the
first step lanes ``lane`` and ``lane ^ L/2`` swap halves of their R values -- the lower
lane sends its upper half, keeps its lower half and adds what it receives -- so each now
holds R/2 partial sums over 2 lanes; after log2(L) halvings lane j holds value j summed over
all L lanes (R/2 + R/4 + ... + R/L shuffles).  The all-gather runs the same exchanges in
reverse, doubling the values a lane holds, until every lane has all R totals, which the
online softmax and P V need.  (When R < L the halving stops at one value and the smaller
offsets are plain butterfly steps.)  On the simulator (no shuffles) each shuffle is an
exchange through shared memory with two barriers, so the same index logic is tested.

Predicted before the first GPU run, kept next to what was measured (above): the pipeline
keeps one step's loads (KPI keys x WPL words x K,V x 8 bytes a thread) in flight during the
math, which v2 left idle; with 2-2.5x fewer shuffles and fewer integer instructions per
load we expected the split kernel to approach the CUDA C++ kernel (1.5-2 TB/s at B=1,
0.55-0.75x cuDNN).  It reached 1.37 TB/s (0.51x), after two changes the first GPU run
showed were needed: the 8-group tiling (32 lanes x 4 keys x 8 groups, 113 registers, 16
warps an SM: 0.100 vs 0.114 ms for 32 x 8 x 4) and even split counts.  The gather: one
table read and one barrier per pool block (64 KiB of K and V read), 8 independent 8-byte
loads of K and 8 of V a thread before its stores, 54 registers; predicted near a device
copy, measured 0.94x.

What the compiler says (no GPU: ``ptx_report(dump=DIR)`` here, then ``ptxas -arch=sm_90 -v``;
the PTX version line edited from 9.5 to 9.0 for the local ptxas), d=128, g=4, sm_90; shuffles
and u64 loads counted in the PTX (all of them are in the main loop):

=====================================  ===========  ======  =======  ========  ============
kernel                                 registers    stack   spills   shuffles  u64 loads
                                       f16 / f32    f16     f16      a step    (K+V, 2 bufs)
=====================================  ===========  ======  =======  ========  ============
split v2 L16 KPI4 KG8 (for scale)      155          160 B   0        64        16
split v2 L32 KPI8 KG8 (for scale)      128          96 B    0        160       16
split v3 L32 KPI8 KG4                  155 / 242    0       0        62        32
split v3 L32 KPI4 KG8 (default)        113 / 128    96 B    0        31        16
split v3 L16 KPI4 KG8                  187 / 246    160 B   0        30        32
gather v3 256 threads, UN=8 (default)  54           0       0        --        16 (+16 st)
gather v3 256 threads, UN=16           114          0       0        --        32 (+32 st)
=====================================  ===========  ======  =======  ========  ============

(paged splits: within 10 registers of the contiguous ones.)  The pipeline's second buffer
costs registers: v3 at v2's tiling (L16 KPI4) needs 187, so v3 takes 32 lanes a key (one
word a lane at d=128 float16: 16 query and 16 output values a thread instead of 32 and 32).
Written first with 8 keys in flight a group and 4 groups (155 registers, no local memory
at all, 3 blocks of 128 threads an SM: 12 warps, 128 bytes of K/V a thread in flight); the
H200 preferred 4 keys and 8 groups (113 registers, 2 blocks of 256 an SM: 16 warps, 64
bytes a thread), now the default.  The stack frames are the state handed to the final
merge loop (v2 has the same).  The benchmark rows and
:func:`iokernels.numba_cuda.bench_gpu.sweep_decode_gather` time these tilings.

Counted traffic (simulator, :func:`count_decode_v3`, :func:`count_paged_decode_v3`,
:func:`count_gather_v3`): split v3 == ``traffic.model("decode" | "paged_decode")`` (each
K/V byte read once, as words; the prefetch past the last key reads nothing), gather v3 ==
``traffic.model("paged_gather")`` (one table read per pool block).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .decode_v2 import make_unpack, word_layout
from .flash_fwd import warp_mask
from numba import cuda, int32  # noqa: E402
import numba  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

#: split v3 defaults: lanes per key, key groups per block, keys a group loads per step.
#: 32 lanes x 4 keys x 8 groups: 113 registers, 2 blocks of 256 threads an SM (16 warps) at
#: d=128 float16; on the H200 (12:40 UTC sweep, B=1 N=32768 GQA 32/8, 64 splits) 0.100 ms vs
#: 0.114 ms for 32 x 8 x 4 (155 registers, 12 warps an SM).  v2's 16 x 4 x 8 needs 187
#: registers once the step's words are double-buffered.
LANES_PER_KEY_V3 = 32
KEY_GROUPS_V3 = 8
KEYS_PER_ITER_V3 = 4
#: block-table entries staged in shared memory per barrier (as v2)
TABLE_STAGE_V3 = 128
#: gather v3: threads per block (8 warps) and words of K and of V each thread loads before
#: it stores any (float16 d=128, Bs=16, Hkv=8: a pool block is 4096 words = 2 passes of
#: 256 x 8; UN=16 makes it one pass but needs 114 registers instead of 54)
GATHER3_THREADS = 256
GATHER3_UNROLL = 8


def c_contiguous(x) -> bool:
    """Whether a device (or simulator) array is C-contiguous, so that a flat view of it is
    the same memory.  (The simulator's arrays report ``is_c_contiguous()`` True even for a
    strided slice; the NumPy array they wrap knows better.)"""
    ary = getattr(x, "_ary", None)
    if isinstance(ary, np.ndarray):
        return ary.flags.c_contiguous
    f = getattr(x, "is_c_contiguous", None)
    return bool(f()) if callable(f) else bool(getattr(getattr(x, "flags", None), "c_contiguous", False))


# --------------------------------------------------------------------------- raw loads/stores
@intrinsic
def _ld(typingctx, ary, idx):
    """``ary.ravel()[idx]`` through the data pointer: no negative-index wraparound code."""
    from llvmlite import ir
    sig = ary.dtype(ary, idx)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
        return builder.load(builder.gep(a.data, [i]))
    return sig, codegen


@intrinsic
def _st(typingctx, ary, idx, val):
    """``ary.ravel()[idx] = val`` through the data pointer."""
    from llvmlite import ir
    from numba.core import types
    sig = types.void(ary, idx, ary.dtype)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
        builder.store(args[2], builder.gep(a.data, [i]))
        return context.get_dummy_value()
    return sig, codegen


def make_flat_access(simulated: bool):
    """(load, store) on a flat (1-D) array: raw pointer access on a GPU, plain indexing on the
    simulator (where the arrays may be counting arrays)."""
    if simulated:
        @cuda.jit(device=True)
        def load(a, i):
            return a[i]

        @cuda.jit(device=True)
        def store(a, i, x):
            a[i] = x
        return load, store

    @cuda.jit(device=True)
    def load_gpu(a, i):
        return _ld(a, i)

    @cuda.jit(device=True)
    def store_gpu(a, i, x):
        _st(a, i, x)
    return load_gpu, store_gpu


# --------------------------------------------------------------------------- lane all-reduce
def make_xor_shuffle(simulated: bool, mask: int):
    """``shfl(x, off, xch, tid)``: the value of lane ``lane ^ off`` (a warp shuffle; on the
    simulator an exchange through the shared array ``xch`` with two barriers)."""
    if simulated:
        @cuda.jit(device=True)
        def shfl_sim(x, off, xch, tid):
            xch[tid] = x
            cuda.syncthreads()
            y = xch[tid ^ off]
            cuda.syncthreads()
            return y
        return shfl_sim

    @cuda.jit(device=True)
    def shfl(x, off, xch, tid):
        return cuda.shfl_xor_sync(mask, x, off)
    return shfl


def allreduce_plan(L: int, RP: int):
    """(halvings, plain offsets): the reduce-scatter steps as (offset, values kept) pairs,
    then the butterfly offsets left once a lane holds one value.  Shuffles a step:
    sum(kept) + len(plain) + sum(kept) (the all-gather replays the halvings)."""
    halvings, plain = [], []
    off, c = L // 2, RP
    while off >= 1:
        if c > 1:
            c //= 2
            halvings.append((off, c))
        else:
            plain.append(off)
        off //= 2
    return halvings, plain


def allreduce_shuffles(L: int, RP: int) -> int:
    halvings, plain = allreduce_plan(L, RP)
    return 2 * sum(c for _, c in halvings) + len(plain)


def make_lane_allreduce(L: int, RP: int, simulated: bool, mask: int):
    """``allreduce(x, xch, tid, lane)``: every lane of a key's L lanes ends with the sum over
    those lanes of each of the RP values of ``x`` (a local array), by a reduce-scatter then an
    all-gather.  Each step is its own device function with constant offsets and counts, so
    every index into ``x`` is a constant and ``x`` stays in registers."""
    shfl = make_xor_shuffle(simulated, mask)
    halvings, plain = allreduce_plan(L, RP)

    def halve(OFF, KEEP):
        @cuda.jit(device=True)
        def step(x, xch, tid, lane):
            upper = (lane & OFF) != 0               # this lane keeps the upper half
            for i in range(KEEP):
                lo, hi = x[i], x[KEEP + i]
                send = lo if upper else hi
                keep = hi if upper else lo
                x[i] = keep + shfl(send, OFF, xch, tid)
        return step

    def butterfly(OFF):
        @cuda.jit(device=True)
        def step(x, xch, tid, lane):
            x[0] += shfl(x[0], OFF, xch, tid)
        return step

    def double(OFF, HELD):
        @cuda.jit(device=True)
        def step(x, xch, tid, lane):
            upper = (lane & OFF) != 0               # this lane's values are the upper half
            for i in range(HELD):
                mine = x[i]
                other = shfl(mine, OFF, xch, tid)
                x[i] = other if upper else mine
                x[HELD + i] = mine if upper else other
        return step

    @cuda.jit(device=True)
    def nothing(x, xch, tid, lane):
        pass

    def chain(f, g):
        @cuda.jit(device=True)
        def both(x, xch, tid, lane):
            f(x, xch, tid, lane)
            g(x, xch, tid, lane)
        return both

    fn = nothing
    for off, keep in halvings:
        fn = chain(fn, halve(off, keep))
    for off in plain:
        fn = chain(fn, butterfly(off))
    for off, held in reversed(halvings):
        fn = chain(fn, double(off, held))
    return fn


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


# --------------------------------------------------------------------------- split v3
@functools.lru_cache(maxsize=None)
def make_split_v3(D: int, G: int, L: int, KPI: int, KG: int, BN: int, paged: bool, store_name: str,
                  word_name: str, acc_name: str, simulated: bool):
    """Split kernel v3 for head_dim D, g = G, L lanes a key, KPI keys a group and step, KG key
    groups, Bn = BN keys a tile (the block size if paged); K and V come as flat (1-D) views of
    ``word_name`` words (rows of W words)."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
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
    RP = _pow2_at_least(KPI * G)                              # scores a lane sums per step
    XCH = (NT,) if simulated else (1,)
    STAGE = TABLE_STAGE_V3
    PAGED = paged
    allreduce = make_lane_allreduce(L, RP, simulated, warp_mask(NT))
    held, unpack = make_unpack(store_name, word_name, acc_name, simulated)
    load, _ = make_flat_access(simulated)

    @cuda.jit(device=True)
    def fetch(k, v, kn, vn, first, p0, p1, row0, hkv, tbl, kg, lane):
        """Issue the loads of the step whose first key is ``first`` into kn, vn."""
        for e in range(KPI):
            c = first + kg + e * KG
            row = -1
            if c < p1:
                if PAGED:
                    row = (tbl[(c - p0) // BN] * BN + (c - p0) % BN) * hkv + row0
                else:
                    row = row0 + c
            for u in range(WPL):
                w = lane + L * u
                kn[e, u] = WZERO
                vn[e, u] = WZERO
                if row >= 0 and w < W:
                    kn[e, u] = held(load(k, row * W + w))   # load K, V words -> registers
                    vn[e, u] = held(load(v, row * W + w))

    def split_v3(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, hkv, n_max):
        sp, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg, lane = tid // L, tid % L
        n_s = cuda.shared.array(1, int32)
        if tid == 0:
            n_s[0] = lens[b]                                  # read n_b (once per block)
        cuda.syncthreads()
        n = n_s[0]
        tiles = (n + BN - 1) // BN                            # split_ranges, in tiles of Bn keys
        per = (tiles + nsplit - 1) // nsplit
        start, end = min(sp * per * BN, n), min((sp + 1) * per * BN, n)
        Q_s = cuda.shared.array((G, DPAD), ACC)               # SRAM: the g query rows
        tbl = cuda.shared.array(STAGE, int32)                 # SRAM: block-table entries
        red_m = cuda.shared.array(KG, ACC)
        red_l = cuda.shared.array(KG, ACC)
        red_o = cuda.shared.array((KG, DPAD), ACC)
        xch = cuda.shared.array(XCH, ACC)                     # the simulator's shuffles
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
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(WPL):
                for ee in range(EPW):                         # word lane + L*u, element ee
                    q_r[g, u * EPW + ee] = Q_s[g, (lane + L * u) * EPW + ee]
                    o_r[g, u * EPW + ee] = ZERO
        row0 = hk if PAGED else (b * hkv + hk) * n_max        # paged: + (blk*Bn + slot)*Hkv
        chunk = STAGE * BN if PAGED else max(end - start, 1)
        for p0 in range(start, end, chunk):                   # paged: a stage of table entries
            p1 = min(p0 + chunk, end)
            if PAGED:
                for e in range(tid, (p1 - p0 + BN - 1) // BN, NT):
                    tbl[e] = tables[b, p0 // BN + e]          # load table entries -> SRAM
                cuda.syncthreads()
            fetch(k, v, kn, vn, p0, p0, p1, row0, hkv, tbl, kg, lane)   # prologue: step 0
            for base in range(p0, p1, STEP):                  # every thread the same trip count
                for e in range(KPI):                          # the words that arrived ...
                    for u in range(WPL):
                        kc[e, u] = kn[e, u]
                        vc[e, u] = vn[e, u]
                fetch(k, v, kn, vn, base + STEP, p0, p1, row0, hkv, tbl, kg, lane)  # ... next in flight
                for i in range(RP):
                    sc[i] = ZERO
                for e in range(KPI):                          # s = q . k: unpack each k value
                    for u in range(WPL):                      # once, use it for the g heads
                        for ee in range(EPW):
                            kv = unpack(kc[e, u], ee)
                            for g in range(G):
                                sc[e * G + g] += q_r[g, u * EPW + ee] * kv
                allreduce(sc, xch, tid, lane)                 # sum the L lanes' partial dots
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
                            vv = unpack(vc[e, u], ee)
                            for g in range(G):
                                o_r[g, u * EPW + ee] += sc[e * G + g] * vv
            if PAGED:
                cuda.syncthreads()                            # before the next stage's entries
        for g in range(G):                                    # merge the KG groups (SRAM)
            if lane == 0:
                red_m[kg] = m[g]
                red_l[kg] = l[g]
            for u in range(WPL):
                for ee in range(EPW):
                    red_o[kg, (lane + L * u) * EPW + ee] = o_r[g, u * EPW + ee]
            cuda.syncthreads()
            mx = NEG_INF
            for w in range(KG):
                mx = max(mx, red_m[w])
            m_ref = ZERO if mx == NEG_INF else mx
            den = ZERO
            for w in range(KG):
                den += red_l[w] * math.exp(red_m[w] - m_ref)
            inv = ZERO if den == ZERO else ONE / den
            h = hk * G + g
            for dd in range(tid, D, NT):
                num = ZERO
                for w in range(KG):
                    num += red_o[w, dd] * math.exp(red_m[w] - m_ref)
                if nsplit == 1:
                    o[b, h, dd] = num * inv                   # write O -> HBM
                else:
                    o_part[sp, b, h, dd] = num * inv          # write O_s -> HBM
            if tid == 0:
                val = NEG_INF if den == ZERO else m_ref + math.log(den)
                if nsplit == 1:
                    lse[b, h] = val                           # write LSE -> HBM
                else:
                    lse_part[sp, b, h] = val                  # write LSE_s -> HBM
            cuda.syncthreads()

    return split_v3


def split_v3_tiling(head_dim: int, dtype: str, word_name: str, config=None):
    """(L, KPI, KG) for version 3: the config's values or the defaults, with fewer lanes when a
    row has fewer words than lanes."""
    L = (config.lanes_per_key if config is not None else None) or LANES_PER_KEY_V3
    KPI = (config.keys_per_iter if config is not None else None) or KEYS_PER_ITER_V3
    KG = (config.key_groups if config is not None else None) or KEY_GROUPS_V3
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    words = -(-head_dim // epw)
    while L > 1 and L > words:
        L //= 2
    return L, KPI, KG


def split_v3_smem_bytes(head_dim, g, dtype, word_name, L, KG):
    acc = 8 if dtype == "float64" else 4
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    w = -(-head_dim // epw)
    dpad = -(-w // L) * L * epw
    return (g * dpad + KG * (dpad + 2)) * acc + TABLE_STAGE_V3 * 4


def split_v3_kernel_function(head_dim, g, dtype, paged, block_n, word_name, config=None, simulated=None):
    from ..core import gpu
    from .flash_fwd import _acc_types
    if simulated is None:
        simulated = gpu.simulator_enabled()
    L, KPI, KG = split_v3_tiling(head_dim, dtype, word_name, config)
    acc_name = np.dtype(_acc_types(dtype)[0]).name
    return make_split_v3(head_dim, g, L, KPI, KG, int(block_n), paged, dtype, word_name, acc_name, simulated)


def launch_split_v3(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config=None,
                    stream=0):
    """Launch split v3 (not the combine) on device or counting arrays.  k, v: the caches as
    word views ((B, Hkv, N, W) or pools (num_blocks, Bn, Hkv, W)); flattened here (no copy)."""
    from .decode_kernels import _jitted
    from .flash_fwd import _acc_types
    B, Hq, d = (int(x) for x in q.shape)
    Hkv = int(k.shape[2] if paged else k.shape[1])
    n_max = 0 if paged else int(k.shape[2])
    dtype = str(np.dtype(o.dtype))
    word = str(np.dtype(k.dtype))
    S = int(lse_part.shape[0])
    L, KPI, KG = split_v3_tiling(d, dtype, word, config)
    kern = _jitted(split_v3_kernel_function(d, Hq // Hkv, dtype, paged, block_n, word, config))
    size = int(np.prod(k.shape))
    kern[(S, Hkv, B), KG * L, stream](q, k.reshape(size), v.reshape(size), tables, lens, o, lse, o_part,
                                      lse_part, _acc_types(dtype)[0](scale), S, Hkv, n_max)


# --------------------------------------------------------------------------- gather v3
@functools.lru_cache(maxsize=None)
def make_gather_v3(word_name: str, W: int, H: int, BS: int, NT: int, UN: int, simulated: bool):
    """Gather v3 for pools of ``word_name`` words: W words a row, H KV heads, BS slots a block,
    NT threads, UN words of K and of V in flight a thread.  Pools and outputs come in flat
    (1-D); W, H and BS are compile-time constants, so the index divisions are multiply-shifts."""
    WORD = numba.from_dtype(np.dtype(word_name))
    ROWW = H * W                                              # words of one slot (all heads)
    BLKW = BS * ROWW                                          # words of one pool block
    PASS = NT * UN                                            # words a block moves per pass
    load, store = make_flat_access(simulated)

    def gather_v3(k_pool, v_pool, table, k_out, v_out, n):
        j = cuda.blockIdx.x                                   # logical block j of the sequence
        tid = cuda.threadIdx.x
        blk_s = cuda.shared.array(1, int32)
        if tid == 0:
            blk_s[0] = table[j]                               # read the table entry (once)
        cuda.syncthreads()
        src = blk_s[0] * BLKW                                 # the pool block's first word
        t0 = j * BS
        valid = min(BS, n - t0) * ROWW                        # valid slots only
        ka = cuda.local.array(UN, WORD)
        va = cuda.local.array(UN, WORD)
        for x0 in range(0, valid, PASS):                      # one pass at the defaults
            for e in range(UN):                               # UN words of K and V: loads ...
                x = x0 + tid + e * NT                         # (coalesced: a flat run)
                if x < valid:
                    ka[e] = load(k_pool, src + x)
                    va[e] = load(v_pool, src + x)
            for e in range(UN):                               # ... then their stores
                x = x0 + tid + e * NT
                if x < valid:
                    slot = x // ROWW                          # constants: multiply-shifts
                    hh = (x - slot * ROWW) // W
                    w = x - slot * ROWW - hh * W
                    dst = (hh * n + t0 + slot) * W + w        # out[hh, t0 + slot, w]
                    store(k_out, dst, ka[e])
                    store(v_out, dst, va[e])

    return gather_v3


def gather_v3_kernel_function(word_name, W, H, BS, config=None, simulated=None):
    from ..core import gpu
    if simulated is None:
        simulated = gpu.simulator_enabled()
    UN = (config.gather_unroll if config is not None else None) or GATHER3_UNROLL
    return make_gather_v3(word_name, int(W), int(H), int(BS), GATHER3_THREADS, UN, simulated)


def launch_gather_v3(kw, vw, table, k_out, v_out, seq_len, *, config=None, stream=0):
    """Gather v3 on pools (num_blocks, bs, Hkv, W) and outputs (Hkv, n, W) of words (device or
    counting arrays): one thread block per logical block."""
    from .decode_kernels import _jitted
    nb, bs, hkv, W = (int(x) for x in kw.shape)
    nblk = -(-seq_len // bs)
    if nblk == 0:
        return
    kern = _jitted(gather_v3_kernel_function(str(np.dtype(kw.dtype)), W, hkv, bs, config))
    ps, os_ = nb * bs * hkv * W, hkv * seq_len * W
    kern[nblk, GATHER3_THREADS, stream](kw.reshape(ps), vw.reshape(ps), table, k_out.reshape(os_),
                                        v_out.reshape(os_), seq_len)


# --------------------------------------------------------------------------- counted traffic
def count_decode_v3(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """Split v3 (+ combine) on counting arrays over a contiguous cache: (o, lse, Traffic)."""
    from .counting import count_decode
    from .decode_kernels import DecodeConfig
    return count_decode(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale,
                        config=config or DecodeConfig(version=3))


def count_paged_decode_v3(q, cache, seq_ids, *, num_splits=None, scale=None, config=None):
    """Paged split v3 (+ combine) on counting arrays: (o, lse, Traffic)."""
    from .counting import count_paged_decode
    from .decode_kernels import DecodeConfig
    return count_paged_decode(q, cache, seq_ids, num_splits=num_splits, scale=scale,
                              config=config or DecodeConfig(version=3))


def count_gather_v3(cache, sid, *, config=None):
    """Gather v3 on counting arrays (8-byte words when the rows allow): (k, v, Traffic)."""
    from .counting import _Counter, _require_simulator
    _require_simulator()
    n, table = cache.seq_len(sid), np.asarray(cache.block_table(sid), np.int32)
    hkv, d = cache.num_kv_heads, cache.head_dim
    word, _ = word_layout(np.dtype(cache.dtype).name, d)
    wd = np.dtype(word)
    c = _Counter()
    k_out, v_out = np.zeros((hkv, n, d), cache.dtype), np.zeros((hkv, n, d), cache.dtype)
    ko, vo = c(k_out.view(wd), "K"), c(v_out.view(wd), "V")
    launch_gather_v3(c(np.ascontiguousarray(cache.k_pool).view(wd), "K_cache"),
                     c(np.ascontiguousarray(cache.v_pool).view(wd), "V_cache"),
                     c(table if table.size else np.zeros(1, np.int32), "block_table"), ko, vo, n, config=config)
    return ko.data.view(cache.dtype), vo.data.view(cache.dtype), c.traffic


# --------------------------------------------------------------------------- PTX (no GPU)
def kernel_signatures_v3(dtypes=("float16", "float32"), head_dims=(128,), configs=None):
    """(name, storage dtype, python function, numba signature) for the v3 kernels (the launch
    arguments' types), as :func:`iokernels.numba_cuda.ptx.kernel_signatures` lists the others."""
    from numba import types
    from .decode_kernels import DecodeConfig
    configs = configs or {"": DecodeConfig(version=3)}

    def arr(t, nd):
        return types.Array(t, nd, "C")
    out = []
    for dtype in dtypes:
        st = getattr(types, dtype)
        acc = types.float64 if dtype == "float64" else types.float32
        for d in head_dims:
            word, _ = word_layout(dtype, d)
            wt = getattr(types, word)
            for tag, cfg in configs.items():
                for paged in (False, True):
                    sig = (arr(st, 3), arr(wt, 1), arr(wt, 1), arr(types.int32, 2), arr(types.int32, 1),
                           arr(st, 3), arr(acc, 2), arr(acc, 4), arr(acc, 3), acc, types.int64, types.int64,
                           types.int64)
                    fn = split_v3_kernel_function(d, 4, dtype, paged, 16, word, cfg, simulated=False)
                    out.append((f"decode_v3{tag}_split{'_paged' if paged else ''}_d{d}", dtype, fn, sig))
                W = d * np.dtype(dtype).itemsize // np.dtype(word).itemsize
                sig = (arr(wt, 1), arr(wt, 1), arr(types.int32, 1), arr(wt, 1), arr(wt, 1), types.int64)
                out.append((f"gather_v3{tag}_d{d}", dtype, gather_v3_kernel_function(word, W, 8, 16, cfg, False),
                            sig))
    return out


def ptx_report(ccs=((9, 0),), dtypes=("float16", "float32"), head_dims=(128,), configs=None, dump=None) -> dict:
    """{f"{name}/{dtype}/sm_{cc}": {"f64", "local", "ld_u64", "shfl", "bytes"}} for the v3 kernels,
    compiled with the simulator off (run in a process started with NUMBA_ENABLE_CUDASIM=0).
    ``shfl``: the number of shuffle instructions; ``dump``: a folder for the PTX files."""
    import re
    from numba.core import types
    from .ptx import LOCAL_ACCESS, _no_device_for_device_functions, f64_lines
    _no_device_for_device_functions(ccs[0])
    report = {}
    for name, dtype, fn, sig in kernel_signatures_v3(dtypes, head_dims, configs):
        for cc in ccs:
            ptx, _ = cuda.compile_ptx(fn, types.void(*sig), cc=cc)
            report[f"{name}/{dtype}/sm_{cc[0]}{cc[1]}"] = {
                "f64": f64_lines(ptx)[:5], "bytes": len(ptx), "shfl": len(re.findall(r"\bshfl\.sync", ptx)),
                "local": len(LOCAL_ACCESS.findall(ptx)),
                "ld_u64": len(re.findall(r"ld\.global(?:\.nc)?\.u64", ptx)),
                "st_u64": len(re.findall(r"st\.global\.u64", ptx))}
            if dump:
                with open(f"{dump}/{name}_{dtype}_sm{cc[0]}{cc[1]}.ptx", "w") as f:
                    f.write(ptx)
    return report
