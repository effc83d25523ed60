"""Version 2 of the Numba decode kernels: wide loads (split, paged split) and a grid-stride
gather, selected by ``DecodeConfig(version=2)``.  Measured on the H200 (2026-11-29 12:47
UTC, float16 GQA 32/8 d=128 B=1 N=32768): split 0.88 TB/s = 0.33x cuDNN (v1 0.12x), paged
0.31x; gather 0.90x a device copy at 131072 tokens.  Version 3 (:mod:`.decode_v3`) went
further and is the default decode.

Read next to :mod:`.decode_kernels` (version 1): the algorithm, the notation (B, Hq, Hkv, g,
n_b, Bn, S, L, KG, m, l, O, O_s, LSE_s) and the combine kernel are the same; what changed
is how K and V travel from HBM to registers, and the gather's work distribution.

=========  ===========================================================================
word       8 bytes of a K/V row read by one load: uint64 (a ``.view`` of the array made on
           the host; no copy).  EPW elements per word: 4 float16, 2 float32; EPW = 1
           (the element itself) when the row's bytes are not a multiple of 8 (d = 59 in
           float16), for float64, or when the array is not 8-byte aligned
W          words per K/V row (d / EPW); lane ``lane`` of a key owns words lane + L*u
WPL        words per lane, ceil(W / L)
KPI        keys per key group per iteration, all loaded before any arithmetic
=========  ===========================================================================

What changed vs version 1, and why (version 1 measured 0.30 TB/s contiguous and 0.17 TB/s
paged on the H200, against cuDNN's 2.7; 0.58 TB/s gather at 131072 tokens vs a 4.19 TB/s
copy):

* **split v2**: K and V rows are read as 8-byte words, so a warp's load instruction moves
  256 bytes instead of 64 (2-byte float16 loads in v1), and each word is unpacked into
  its EPW values in registers by a bit-cast (``mov.b16`` + ``cvt.f32.f16`` in the PTX, no
  memory round trip).  The lane, word and key loops have compile-time trip counts, so
  NVVM unrolls them and the per-thread arrays stay in registers (v1's PTX had local-memory
  stores); the block size Bn is a compile-time constant too (v1 divided by a run-time Bn
  for every key of the paged kernel).  Each word is unpacked once and used by the g query
  heads.  The table stage of the paged kernel is 4x larger (128 entries): one barrier per
  2048 keys instead of per 512.
* **gather v2**: a grid-stride copy.  One warp takes one (logical block, part) work item:
  lane 0 reads the table entry once and hands it to the warp's lanes with a shuffle (no
  shared memory, no barrier), then the warp copies the part's words, a flat run of the
  pool block (coalesced reads) into the (Hkv, n, d) outputs, with ``GATHER2_UNROLL`` words
  of K and of V loaded before their stores.  The grid is at most
  ``GATHER2_BLOCKS_PER_SM`` blocks per SM, each looping over work items, so a thread
  block handles many table entries.  A sequence with few blocks is cut into P parts per
  block so that the GPU still has enough warps; each part reads its table entry, so the
  table is read P times (P = 1 from ~``GATHER2_TARGET_WARPS_PER_SM`` x SMs blocks up).

Predicted before any GPU run: a few x v1 for the split kernels (the same bytes with a
quarter of the load instructions and no local memory), and the gather near a device copy.
Measured: 2.8x v1 (0.153 vs 0.425 ms) and 0.90x of the copy (bench rows ``numba:v2``,
``numba:v2 paged``, ``numba:v2 gather``).

What the compiler says (no GPU needed: ``python -m iokernels.numba_cuda.ptx 90 float16 d=128
dump=DIR``, then ``ptxas -arch=sm_90 -v``; NVVM 13.0 writes PTX 9.5, the local ptxas reads
9.0, so the version line was edited), float16, d=128, g=4, sm_90:

==============================  =========  ======  ====================================
kernel                          registers  spills  8-byte loads in the main loop (PTX)
==============================  =========  ======  ====================================
split v1 (for comparison)       168        0       0 (69 two-byte loads)
split v2 (L=16, KPI=4)          155        0       16 (4 keys x 2 words x K, V)
split v2-L32K8                  128        0       16 (8 keys x 1 word x K, V)
gather v1                       58         0       --
gather v2                       72         0       8 words of K and of V a lane
==============================  =========  ======  ====================================

The splits' 160- (v2) / 96-byte (L32K8) stack frames hold the per-thread state handed to
the final merge loop (which has barriers and is not unrolled), as in v1; the main loop
keeps everything in registers.  At 155 registers 3 blocks of 128 threads fit an SM (12
warps, ~48 KB of loads in flight); L32K8 fits 2 blocks of 256 (16 warps, ~64 KB).

On Numba's CUDA simulator the bit-casts are NumPy ``.view`` calls on scalars and the
gather's broadcast goes through shared memory with barriers (the simulator has no
shuffles), so the tests run the same index arithmetic; the bit-cast intrinsics themselves
are checked by compiling to PTX (tests/test_numba_ptx.py) and on the GPU.

Counted traffic (simulator): split v2 == ``traffic.model("decode" | "paged_decode")`` (each
K/V byte read once, as words); gather v2 == ``traffic.model("paged_gather")`` with P = 1,
and P table reads per block otherwise.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .flash_fwd import FULL_MASK, WARP_SIZE, _make_lane_sum, warp_mask
from numba import cuda, int32  # noqa: E402
import numba  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

#: bytes of one wide load (numba has no 16-byte integer type; uint64 is the widest)
WORD_BYTES = 8
#: split v2 defaults: lanes per key, key groups per block, keys a group loads per iteration
LANES_PER_KEY_V2 = 16
KEY_GROUPS_V2 = 8
KEYS_PER_ITER_V2 = 4
#: block-table entries staged in shared memory per barrier (v1: 32)
TABLE_STAGE_V2 = 128
#: gather v2: threads per block (8 warps), words of K and of V each lane loads before
#: storing them, at most this many resident blocks per SM in the grid, and the warps per SM
#: the part split aims for when a sequence has few blocks
GATHER2_THREADS = 256
GATHER2_UNROLL = 8
GATHER2_BLOCKS_PER_SM = 8
GATHER2_TARGET_WARPS_PER_SM = 32


# --------------------------------------------------------------------------- bit-casts
@intrinsic
def _f16_bits(typingctx, bits):
    """The low 16 bits of an integer, read as a float16, widened to float32 (no memory)."""
    from llvmlite import ir
    sig = numba.float32(bits)

    def codegen(context, builder, signature, args):
        h = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(h, ir.FloatType())
    return sig, codegen


@intrinsic
def _f32_bits(typingctx, bits):
    """The low 32 bits of an integer, read as a float32."""
    from llvmlite import ir
    sig = numba.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return sig, codegen


def word_layout(store_name: str, head_dim: int, aligned: bool = True):
    """(word dtype name, EPW): uint64 words when d's bytes and the alignment allow, else the
    element itself (EPW = 1)."""
    size = np.dtype(store_name).itemsize
    if aligned and size < WORD_BYTES and (head_dim * size) % WORD_BYTES == 0:
        return "uint64", WORD_BYTES // size
    return store_name, 1


def make_unpack(store_name: str, word_name: str, acc_name: str, simulated: bool):
    """(``held``, ``unpack``): ``held(x)`` is what a thread keeps in registers for a loaded
    word (the word itself; for one element a word, the element already in the accumulator
    type: NVVM rejected a float16 per-thread array), ``unpack(held, e)`` its element e in
    the accumulator type."""
    ACC = getattr(numba, acc_name)
    epw = np.dtype(word_name).itemsize // np.dtype(store_name).itemsize
    if epw == 1:
        @cuda.jit(device=True)
        def held1(x):
            return ACC(x)

        @cuda.jit(device=True)
        def unpack1(w, e):
            return w
        return held1, unpack1

    @cuda.jit(device=True)
    def held(x):
        return x
    bits = 8 * np.dtype(store_name).itemsize
    if simulated:                        # the simulator runs Python: NumPy's scalar .view
        uint = np.dtype(f"uint{bits}")
        mask = (1 << bits) - 1
        store, acc = np.dtype(store_name), np.dtype(acc_name).type

        @cuda.jit(device=True)
        def unpack(w, e):
            return acc(uint.type((int(w) >> (bits * e)) & mask).view(store))
        return held, unpack
    cast = {"float16": _f16_bits, "float32": _f32_bits}[store_name]
    BITS = numba.uint64(bits)

    @cuda.jit(device=True)
    def unpack(w, e):
        return cast(w >> (BITS * numba.uint64(e)))
    return held, unpack


# --------------------------------------------------------------------------- split v2
@functools.lru_cache(maxsize=None)
def make_split_v2(D: int, G: int, L: int, KPI: int, BN: int, paged: bool, store_name: str, word_name: str,
                  acc_name: str, simulated: bool):
    """Split kernel v2 for head_dim D, g = G, L lanes per key, KPI keys per group and step,
    Bn = BN keys per tile (the block size if paged), K/V given as words of ``word_name``."""
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
    KG = KEY_GROUPS_V2
    NT = KG * L
    KPIG = KPI * G
    SCRATCH = (KPIG, NT) if simulated else (1, 1)
    STAGE = TABLE_STAGE_V2
    PAGED = paged
    lane_sum = _make_lane_sum(L, KPIG, simulated, warp_mask(NT))
    held, unpack = make_unpack(store_name, word_name, acc_name, simulated)

    def split_v2(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit):
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
        for p0 in range(start, end, chunk):                   # paged: a stage of table entries
            p1 = min(p0 + chunk, end)
            if PAGED:
                for e in range(tid, (p1 - p0 + BN - 1) // BN, NT):
                    tbl[e] = tables[b, p0 // BN + e]          # load table entries -> SRAM
                cuda.syncthreads()
            for base in range(p0, p1, KG * KPI):              # every thread the same trip count
                for e in range(KPI):                          # load KPI keys' words -> registers
                    c = base + kg + e * KG                    # (all loads before any math)
                    blk, slot = 0, 0
                    if PAGED and c < p1:
                        blk, slot = tbl[(c - p0) // BN], (c - p0) % BN
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

    return split_v2


def split_v2_smem_bytes(head_dim, g, dtype, word_name, lanes=LANES_PER_KEY_V2):
    acc = 8 if dtype == "float64" else 4
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    w = -(-head_dim // epw)
    dpad = -(-w // lanes) * lanes * epw
    return (g * dpad + KEY_GROUPS_V2 * (dpad + 2)) * acc + TABLE_STAGE_V2 * 4


# --------------------------------------------------------------------------- gather v2
@functools.lru_cache(maxsize=None)
def make_gather_v2(word_name: str, W: int, H: int, BS: int, simulated: bool):
    """Gather v2 for pools of ``word_name`` words, W words a row, H KV heads, BS slots a block.

    Pools come in as (num_blocks, BS * H * W) (one flat run per pool block), outputs as
    (H, n, W).  W, H and BS are compile-time constants: the index divisions become
    multiply-shifts.
    """
    WORD = numba.from_dtype(np.dtype(word_name))
    ROWW = H * W                                              # words of one slot (all heads)
    UN = GATHER2_UNROLL
    WARPS = GATHER2_THREADS // WARP_SIZE
    SLOTS = (WARPS,) if simulated else (1,)
    SIM = simulated

    def gather_v2(k_pool, v_pool, table, k_out, v_out, n, nblk, parts, part_words):
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        items = nblk * parts                                  # (logical block, part) pairs
        stride = cuda.gridDim.x * WARPS
        iters = (items + stride - 1) // stride                # the same in every thread
        slot_s = cuda.shared.array(SLOTS, int32)
        ka = cuda.local.array(UN, WORD)
        va = cuda.local.array(UN, WORD)
        for it in range(iters):                               # grid-stride over work items
            item = (it * cuda.gridDim.x + cuda.blockIdx.x) * WARPS + warp
            j, p = item // parts, item % parts
            if SIM:                                           # no shuffles: SRAM + barriers
                if lane == 0 and item < items:
                    slot_s[warp] = table[j]                   # read the table entry (once)
                cuda.syncthreads()
                blk = slot_s[warp]
                cuda.syncthreads()
            else:
                mine = 0
                if lane == 0 and item < items:
                    mine = table[j]                           # read the table entry (once)
                blk = cuda.shfl_sync(FULL_MASK, mine, 0)      # ... and hand it to the warp
            if item < items:
                t0 = j * BS
                total = min(BS, n - t0) * ROWW                # valid slots only
                x_lo = p * part_words
                x_hi = min(x_lo + part_words, total)
                for x0 in range(x_lo + lane, x_hi, WARP_SIZE * UN):
                    for e in range(UN):                       # UN words of K and V: loads ...
                        x = x0 + e * WARP_SIZE
                        if x < x_hi:
                            ka[e] = k_pool[blk, x]            # a flat run of the pool block
                            va[e] = v_pool[blk, x]
                    for e in range(UN):                       # ... then their stores
                        x = x0 + e * WARP_SIZE
                        if x < x_hi:
                            slot = x // ROWW
                            hh = (x - slot * ROWW) // W
                            w = x - slot * ROWW - hh * W
                            k_out[hh, t0 + slot, w] = ka[e]
                            v_out[hh, t0 + slot, w] = va[e]

    return gather_v2


def gather_v2_plan(nblk: int, words_per_block: int, num_sms: int):
    """(grid blocks, parts P, words per part) for a gather of nblk logical blocks."""
    target = num_sms * GATHER2_TARGET_WARPS_PER_SM
    min_words = WARP_SIZE * GATHER2_UNROLL                    # a part is at least one full step
    parts = 1
    if 0 < nblk < target:
        parts = max(1, min(target // nblk, -(-words_per_block // min_words)))
    part_words = -(-words_per_block // parts)
    part_words = -(-part_words // WARP_SIZE) * WARP_SIZE      # whole warp steps
    parts = -(-words_per_block // part_words)
    warps = GATHER2_THREADS // WARP_SIZE
    grid = max(1, min(-(-(nblk * parts) // warps), num_sms * GATHER2_BLOCKS_PER_SM))
    return grid, parts, part_words
