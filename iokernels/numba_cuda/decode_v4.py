"""Split kernel v4 of the Numba decode: 16-byte loads.  The default decode for C-contiguous
float16 / float32 K/V whose rows are whole 16-byte pairs (``DecodeConfig(version="v4")``
asks for it); the launchers are in :mod:`.decode`.

Read next to :mod:`.decode_v3`: the pipeline (the next step's loads issued before this
step's math), the reduce-scatter lane sum, the flat addressing, the paged addressing ("page"
and "key"), the merge of the key groups and the combine are v3's, line for line.  One thing
changes: what one lane loads at once.

=========  ===========================================================================
pair       16 bytes of a K/V row: two consecutive 8-byte words (uint64), read by one
           16-byte load (``ld.global.v2.u64``); 8 float16 or 4 float32 values
P          pairs a row (d * itemsize / 16); PPL = ceil(P / L) pairs a lane
EPP        elements a pair (2 * EPW)
=========  ===========================================================================

Why.  Numba has no 16-byte integer type, so v2 and v3 read 8-byte words (``uint64``, the
widest), and at d = 128 float16 v3 spreads a key over 32 lanes of 4 values.  Here a lane
reads a *pair* of words with one vector load -- an LLVM ``load <2 x i64>, align 16``
written as a Numba intrinsic (:func:`_ld_pair`), which NVVM emits as ``ld.global.v2.u64``
(tests/test_numba_ptx.py asserts it) -- so at d = 128 float16 a key needs 16 lanes and a
warp holds two keys' groups.  Per key that halves what v3 repeats on each of its lanes:

* the lane sums: a warp's shuffles sum two keys' scores at once (each 16 lanes wide),
* the online softmax, which every lane of a key computes (its max, exp, rescale),

while the float32 FMAs, the converts and the bytes are the same.  Why that should matter:
decode streams K and V once, and a Numba kernel does its math as scalar float32
instructions, so at g = 4 and d = 128 the instructions an SM issues per key (the FMAs,
converts, shuffles and softmax, read off the PTX of the load loop: tests/test_numba_ptx.py
compiles it) come close to the time HBM takes to deliver that key; instructions saved per
key are then time saved (the benchmark's decode section says whether they are).  And every
load moves twice v3's bytes, so the same KPI keys of a step put twice the bytes in flight
per thread.

A pair needs a 16-byte aligned row start: rows of a multiple of 16 bytes (the check refuses
others by name, and v3 runs them) in an array that starts on a 16-byte boundary.  A
C-contiguous array that does not (a torch slice at an odd offset) runs the same kernel with
each pair read as two 8-byte loads (``aligned=False``, the same results).  float64 (one
element a word in v3) and quantized caches are v3's.

A wide load is only cheaper if its values come out of the registers cheaply: v3 takes value
e of a word by a 64-bit shift, a truncation and a convert; here :func:`_word_lane` bit-casts
the word to a vector of 4 halves (or 2 floats) and takes element e, which NVVM emits as a
register split (``mov.b64 {..}``) and a convert, no shift (tests/test_numba_ptx.py counts
the shifts in the load loop).

What it does not do, and why (Numba): there is no ``cp.async`` (nor any asynchronous copy
to shared memory), so the loads in flight are bounded by the registers of the two buffers
(kc/vc and kn/vn: 2 x KPI x 2 x PPL pairs a thread), and the q.k and p.v products are scalar
float32 FMAs (no packed half2 arithmetic that would keep float32 accumulation).  The tilings
(lanes_per_key, keys_per_iter, key_groups) and the split count are tuning points of
:mod:`iokernels.bench.sweeps_numba`.

Counted traffic (simulator): equal to ``traffic.model("decode" | "paged_decode")``, as v3.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import launch as ln
from .config import acc_dtype
from .decode_v3 import TABLE_STAGE_V3, paged_addressing, split_range_dev, visible_first_dev
from .device import make_flat_access, make_group_merge, make_lane_allreduce, make_unpack, pow2_at_least, warp_mask
from .launch import cuda
from .policy import lanes_per_row
import numba  # noqa: E402
from numba import int32  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

#: bytes of one pair load
PAIR_BYTES = 16
#: split v4 defaults: lanes per key (16 pairs a row at d = 128 float16: one pair a lane),
#: key groups per block (8 x 16 = 128 threads), keys a group loads per step
LANES_PER_KEY_V4 = 16
KEY_GROUPS_V4 = 8
KEYS_PER_ITER_V4 = 4
#: the storage dtypes v4 reads as pairs of 8-byte words
PAIR_DTYPES = ("float16", "float32")


def pair_reason(dtype: str, head_dim: int) -> str | None:
    """Why split v4 cannot read rows of ``head_dim`` values of ``dtype`` as 16-byte pairs (None: it can)."""
    if dtype not in PAIR_DTYPES:
        return f"split kernel v4 reads {' and '.join(PAIR_DTYPES)} rows as 16-byte pairs; {dtype} is v3's"
    if head_dim * np.dtype(dtype).itemsize % PAIR_BYTES:
        return (f"head_dim {head_dim} ({dtype}): rows of {head_dim * np.dtype(dtype).itemsize} bytes are not whole "
                f"16-byte pairs (split kernel v4); v3 reads them")
    return None


# --------------------------------------------------------------------------- the 16-byte load
@intrinsic
def _ld_pair(typingctx, ary, idx):
    """(words 2i, 2i + 1) of a flat uint64 array by one 16-byte vector load (``load <2 x i64>,
    align 16``: NVVM emits ``ld.global.v2.u64``).  The address must be 16-byte aligned."""
    from llvmlite import ir
    from numba.core import types
    sig = types.UniTuple(ary.dtype, 2)(ary, idx)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
        p = builder.gep(a.data, [builder.shl(i, ir.Constant(ir.IntType(64), 1))])
        vec = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(64), 2).as_pointer()), align=PAIR_BYTES)
        w0 = builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))
        w1 = builder.extract_element(vec, ir.Constant(ir.IntType(32), 1))
        return context.make_tuple(builder, signature.return_type, (w0, w1))
    return sig, codegen


@intrinsic
def _word_lane(typingctx, word, e, like):
    """Element ``e`` of a uint64 word read as a vector of 16- or 32-bit floats (``bitcast i64 to
    <4 x half>`` / ``<2 x float>``, then ``extractelement``), as float32.  With ``e`` a constant
    (the unrolled loops) NVVM splits the word's register into its halves (``mov.b64 {..}``):
    no shift and no truncation a value.  ``like``: a float16 or float32 value naming the type."""
    from llvmlite import ir
    from numba.core import types
    sig = types.float32(word, e, like)
    half = like == types.float16

    def codegen(context, builder, signature, args):
        vt = ir.VectorType(ir.HalfType(), 4) if half else ir.VectorType(ir.FloatType(), 2)
        x = builder.extract_element(builder.bitcast(args[0], vt), args[1])
        return builder.fpext(x, ir.FloatType()) if half else x
    return sig, codegen


def make_word_unpack(store_name: str, simulated: bool):
    """``unpack(w, e)``: element e of 8-byte word w as float32, by :func:`_word_lane` on a GPU,
    by :func:`.device.make_unpack`'s NumPy bit view on the simulator (the same values)."""
    if simulated:
        return make_unpack(store_name, "uint64", "float32", True)[1]
    LIKE = getattr(np, store_name)(0)

    @cuda.jit(device=True)
    def unpack(w, e):
        return _word_lane(w, e, LIKE)
    return unpack


def make_pair_load(simulated: bool, aligned: bool = True):
    """``load2(a, i)``: words 2i and 2i + 1 of the flat word array ``a``: one 16-byte load on a
    GPU (``aligned``), two 8-byte loads where the array is not 16-byte aligned, plain indexing
    on the simulator (where ``a`` may be a counting array)."""
    load, _ = make_flat_access(simulated)
    if simulated or not aligned:
        @cuda.jit(device=True)
        def load2_words(a, i):
            return load(a, 2 * i), load(a, 2 * i + 1)
        return load2_words

    @cuda.jit(device=True)
    def load2(a, i):
        return _ld_pair(a, i)
    return load2


# --------------------------------------------------------------------------- split v4
@functools.lru_cache(maxsize=None)
def make_split_v4(D: int, G: int, L: int, KPI: int, KG: int, BN: int, paged: bool, store_name: str,
                  acc_name: str, simulated: bool, addressing: str = "key", aligned: bool = True):
    """Split kernel v4 for head_dim D, g = G, L lanes a key, KPI keys a group and step, KG key
    groups, Bn = BN keys a tile (the block size if paged); K and V come as flat (1-D) uint64
    views, rows of P = D * itemsize / 16 pairs, a pair read by one 16-byte load (``aligned``)
    or two 8-byte ones.  ``addressing`` (paged): as v3's (:func:`.decode_v3.paged_addressing`)."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO = (np.dtype(acc_name).type(x) for x in (-np.inf, 0))
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

    def split_v4(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, nsplit, hkv, n_max, left):
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
        for e in range(tid, G * DPAD, NT):                    # load Q group -> SRAM (if busy)
            g, dd = e // DPAD, e % DPAD
            Q_s[g, dd] = ZERO
            if dd < D and end > start:
                Q_s[g, dd] = ACC(q[b, hk * G + g, dd]) * scale
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
                for e in range(KPI):                          # s = q . k
                    for u in range(PPL):
                        for ee in range(EPP):
                            kv = unpack(kc[e, 2 * u + ee // EPW], ee % EPW)
                            for g in range(G):
                                sc[e * G + g] += q_r[g, u * EPP + ee] * kv
                allreduce(sc, xch, tid, lane)                 # sum the L lanes' partial dots
                for g in range(G):                            # online softmax over the KPI keys
                    m_new = m[g]
                    for e in range(KPI):
                        if base + kg * GS + e * KS < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new == NEG_INF:
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
                for e in range(KPI):                          # O += P V
                    for u in range(PPL):
                        for ee in range(EPP):
                            vv = unpack(vc[e, 2 * u + ee // EPW], ee % EPW)
                            for g in range(G):
                                o_r[g, u * EPP + ee] += sc[e * G + g] * vv
        merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
              nsplit)                                  # merge the KG groups -> O_s, LSE_s

    return split_v4


def split_v4_tiling(head_dim: int, dtype: str, config=None):
    """(L, KPI, KG) for v4: the config's values or the defaults, with fewer lanes when a row
    has fewer pairs than lanes (:func:`.policy.lanes_per_row`)."""
    L = (config.lanes_per_key if config is not None else None) or LANES_PER_KEY_V4
    KPI = (config.keys_per_iter if config is not None else None) or KEYS_PER_ITER_V4
    KG = (config.key_groups if config is not None else None) or KEY_GROUPS_V4
    pairs = -(-head_dim * np.dtype(dtype).itemsize // PAIR_BYTES)
    return lanes_per_row(L, pairs), KPI, KG


def split_v4_smem_bytes(config, head_dim: int, g: int, dtype: str) -> int:
    """Static shared memory of one v4 split block: Q's g rows, the KG groups' states, the table stage."""
    L, _, KG = split_v4_tiling(head_dim, dtype, config)
    epp = PAIR_BYTES // np.dtype(dtype).itemsize
    pairs = -(-head_dim // epp)
    dpad = -(-pairs // L) * L * epp
    return (g * dpad + KG * (dpad + 2)) * np.dtype(acc_dtype(dtype)).itemsize + TABLE_STAGE_V3 * 4


def split_v4_kernel_function(head_dim, g, dtype, paged, block_n, config=None, simulated=None, left=-1,
                             aligned=True):
    if simulated is None:
        simulated = ln.simulated()
    why = pair_reason(dtype, head_dim)
    if why is not None:
        raise ValueError(f"config.version: {why}")
    L, KPI, KG = split_v4_tiling(head_dim, dtype, config)
    acc_name = np.dtype(acc_dtype(dtype)).name
    addressing = paged_addressing(config, int(block_n), left) if paged else "key"
    return make_split_v4(head_dim, g, L, KPI, KG, int(block_n), paged, dtype, acc_name, simulated, addressing,
                         bool(aligned))


def launch_split_v4(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config=None,
                    stream=0, left=-1, quant=None):
    """Launch split v4 (not the combine) on device or counting arrays.  k, v: the caches as
    8-byte word views ((B, Hkv, N, W) or pools (num_blocks, Bn, Hkv, W)), flattened here (no
    copy); 16-byte loads where both start on a 16-byte boundary."""
    if quant is not None:
        raise ValueError(f"config.version: a {quant['kv']} cache is read by split kernel v3, not v4")
    B, Hq, d = (int(x) for x in q.shape)
    Hkv = int(k.shape[2] if paged else k.shape[1])
    n_max = 0 if paged else int(k.shape[2])
    dtype = str(np.dtype(o.dtype))
    if str(np.dtype(k.dtype)) != "uint64":
        raise ValueError(f"k, v: split kernel v4 reads 8-byte word views, got {np.dtype(k.dtype)}")
    S = int(lse_part.shape[0])
    L, _, KG = split_v4_tiling(d, dtype, config)
    aligned = all(ln.aligned(x, PAIR_BYTES) for x in (k, v))
    kern = ln.jitted(split_v4_kernel_function(d, Hq // Hkv, dtype, paged, block_n, config, left=int(left),
                                              aligned=aligned))
    size = int(np.prod(k.shape))
    kern[(S, Hkv, B), KG * L, stream](q, k.reshape(size), v.reshape(size), tables, lens, o, lse, o_part,
                                      lse_part, acc_dtype(dtype)(scale), S, Hkv, n_max, int(left))
