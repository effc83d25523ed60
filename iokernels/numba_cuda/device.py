"""Device functions the Numba kernels share, written once.

===========================  ====================================================================
factory / function           what it gives a kernel
===========================  ====================================================================
make_lane_sum                each of R values summed over the L lanes of its row or key: a
                             butterfly of warp shuffles (forward v3/v4, decode v1/v2)
make_lane_allreduce          the same sum as a reduce-scatter then an all-gather, fewer shuffles
                             for many values (decode v3)
word_layout, make_unpack     K/V rows read as 8-byte words (uint64) and unpacked into their
                             elements by a bit-cast in registers (decode v2/v3, gather)
make_code_unpack             a quantized cache's 1-byte codes (int8, float8 e4m3) decoded bit by
                             bit from the same words (decode v3)
make_flat_access             loads/stores through a flat array's data pointer, with no
                             negative-index wraparound code (decode v3, gather v3)
make_vector_load             16 bytes of a shared or global array (2 float64, 4 float32, 8
                             float16) by one vector load into a local array (forward v6, v7)
make_group_merge             the in-block merge of the key groups' (m, l, O) states through
                             shared memory, then O_s, LSE_s (or O, LSE) written to HBM (decode
                             v1/v2/v3: one log-sum-exp merge, the combine kernel's)
===========================  ====================================================================

On the simulator (no shuffles, no intrinsics) each factory returns a stand-in that does the
same arithmetic through shared memory and barriers, or NumPy scalar views: the tests run the
same index logic; the GPU forms are checked by compiling to PTX (:mod:`.ptx`).
"""
from __future__ import annotations

import math

import numpy as np

from .config import FULL_MASK, WARP_SIZE
from .launch import cuda  # noqa: F401  (numba imported after the NumPy fix)
import numba  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

#: bytes of one wide load (numba has no 16-byte integer type; uint64 is the widest)
WORD_BYTES = 8


# --------------------------------------------------------------------------- lane sums (butterfly)
def warp_mask(threads: int) -> int:
    """The lanes that exist in a block's (first) warp: all 32, or fewer for a tiny block."""
    return FULL_MASK if threads >= WARP_SIZE else (1 << threads) - 1


def make_lane_sum(L: int, R: int, simulated: bool, mask: int = FULL_MASK):
    """Sum each of the R values in ``x`` over the L lanes of its row, in place.

    Lanes of a row are aligned groups of L threads within one warp.  On a GPU: a butterfly
    of warp shuffles per value, log2(L) steps, after which every lane holds the total
    (``mask``: the lanes taking part, fewer than 32 only for blocks smaller than a warp).  On
    the simulator (no shuffles): through shared memory ``scratch`` (R, threads) with two
    barriers; every thread of the block must call it the same number of times.
    """
    if not simulated:
        @cuda.jit(device=True)
        def lane_sum(x, scratch, tid):
            for r in range(R):
                off = L // 2
                while off > 0:
                    x[r] += cuda.shfl_xor_sync(mask, x[r], off)
                    off //= 2
    else:
        @cuda.jit(device=True)
        def lane_sum(x, scratch, tid):
            for r in range(R):
                scratch[r, tid] = x[r]
            cuda.syncthreads()
            base = tid - tid % L
            for r in range(R):
                total = scratch[r, base]
                for u in range(1, L):
                    total += scratch[r, base + u]
                x[r] = total
            cuda.syncthreads()
    return lane_sum


# --------------------------------------------------------------------------- 8-byte words
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


@cuda.jit(device=True)
def _itself(w, e):
    """``unpack`` of one element a word: the value held is the element, already converted."""
    return w


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
        return held1, _itself

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




# --------------------------------------------------------------------------- 1-byte codes
#: float8 e4m3: the exponent-field offset from its bias (7) to float32's (127), the field's
#: place in a float32 word, a mantissa's shift into float32's top mantissa bits, the
#: subnormal step (2^-9: mantissa m of a code with exponent field 0 is m * 2^-9), and the
#: magnitude bits of its NaN (the format has no infinity)
FP8_REBIAS = 120
F32_EXP_SHIFT = 23
FP8_MANT_SHIFT = 20
FP8_SUBNORMAL_STEP = 2.0 ** -9
FP8_NAN_BITS = 0x7F
#: the codes' formats: those a quantized cache (iokernels.paged) stores
CODE_FORMATS = ("int8", "float8_e4m3fn")


def make_code_decode(kv: str, simulated: bool):
    """``decode(c)``: the value of 1-byte code ``c`` (an integer 0..255, the byte's bits) of
    format ``kv`` as float32, before its block's scale.  int8: the byte read as a signed
    integer.  float8 e4m3 (sign, 4 exponent bits of bias 7, 3 mantissa bits): a normal code
    keeps its mantissa as float32's top 3 bits and moves its exponent field by +120 (bias 7
    -> 127); a subnormal code is m * 2^-9; 0x7f / 0xff are NaN.  The same integer arithmetic
    on the simulator (the bit-cast is NumPy's ``.view`` there)."""
    if kv not in CODE_FORMATS:
        raise ValueError(f"kv_dtype: expected one of {', '.join(CODE_FORMATS)}, got {kv!r}")
    F32 = numba.float32
    if kv == "int8":
        @cuda.jit(device=True)
        def decode_int8(c):
            return F32(c - 256 if c >= 128 else c)
        return decode_int8
    if simulated:
        @cuda.jit(device=True)
        def bits_f32(x):
            return np.float32(np.uint32(x).view(np.float32))
    else:
        @cuda.jit(device=True)
        def bits_f32(x):
            return _f32_bits(numba.uint64(x))
    NAN = F32(np.nan)
    STEP = F32(FP8_SUBNORMAL_STEP)

    @cuda.jit(device=True)
    def decode_fp8(c):
        mag = c & 0x7F
        if mag >= 8:                                          # exponent field > 0: normal
            x = bits_f32((mag << FP8_MANT_SHIFT) + (FP8_REBIAS << F32_EXP_SHIFT))
        else:
            x = F32(mag) * STEP
        if mag == FP8_NAN_BITS:
            x = NAN
        return -x if c & 0x80 else x
    return decode_fp8


def make_code_unpack(kv: str, word_name: str, acc_name: str, simulated: bool):
    """(``held``, ``unpack``) for a quantized cache's codes, as :func:`make_unpack` for values:
    words of 8 codes (uint64) stay words and ``unpack(w, e)`` decodes code e; single codes
    (uint8, when a row is not whole words) are decoded as loaded.  In the accumulator type."""
    ACC = getattr(numba, acc_name)
    decode = make_code_decode(kv, simulated)
    if np.dtype(word_name).itemsize == 1:
        @cuda.jit(device=True)
        def held1(x):
            return ACC(decode(int(x)))
        return held1, _itself

    @cuda.jit(device=True)
    def held(x):
        return x

    if simulated:
        @cuda.jit(device=True)
        def unpack_sim(w, e):
            return ACC(decode((int(w) >> (8 * e)) & 0xFF))
        return held, unpack_sim
    EIGHT = numba.uint64(8)

    @cuda.jit(device=True)
    def unpack(w, e):
        return ACC(decode(numba.int32((w >> (EIGHT * numba.uint64(e))) & numba.uint64(0xFF))))
    return held, unpack


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


def _vector_copy(width: int):
    """An intrinsic ``copy(dst, di, src, si)``: ``src.ravel()[si:si + width]`` by ONE vector load
    (``ld.v2`` / ``ld.v4``: 16 bytes, ``width`` = 2 / 4 / 8 values of 8 / 4 / 2 bytes; in shared
    memory LDS.128, in global memory LDG.E.128) into ``dst.ravel()[di:di + width]``
    (a local array: registers once NVVM has unrolled the caller's loops).  The caller promises
    that ``src``'s element ``si`` sits at a multiple of ``width`` elements from a 16-byte aligned
    base (a shared array declared with ``alignment=16``, or a C-contiguous device array that starts
    on a 16-byte boundary)."""
    @intrinsic
    def copy(typingctx, dst, di, src, si):
        from llvmlite import ir
        from numba.core import types
        sig = types.void(dst, di, src, si)

        def codegen(context, builder, signature, args):
            d = context.make_array(signature.args[0])(context, builder, args[0])
            a = context.make_array(signature.args[2])(context, builder, args[2])
            wide = [builder.sext(x, ir.IntType(64)) if x.type.width < 64 else x for x in (args[1], args[3])]
            elem = context.get_value_type(signature.args[2].dtype)
            p = builder.gep(a.data, [wide[1]])
            if width == 8:      # 16-bit values: two 8-byte words by one load, each split in registers
                words = ir.VectorType(ir.IntType(64), 2)        # (NVPTX splits a <8 x half> load in two)
                w2 = builder.load(builder.bitcast(p, words.as_pointer()), align=16)
                quarter = ir.VectorType(elem, 4)
                vals = [builder.extract_element(builder.bitcast(builder.extract_element(
                    w2, ir.Constant(ir.IntType(32), j // 4)), quarter), ir.Constant(ir.IntType(32), j % 4))
                    for j in range(width)]
            else:
                v = builder.load(builder.bitcast(p, ir.VectorType(elem, width).as_pointer()), align=16)
                vals = [builder.extract_element(v, ir.Constant(ir.IntType(32), j)) for j in range(width)]
            for j, x in enumerate(vals):
                builder.store(x, builder.gep(d.data, [builder.add(wide[0], ir.Constant(ir.IntType(64), j))]))
            return context.get_dummy_value()
        return sig, codegen
    return copy


_VECTOR_COPY = {2: _vector_copy(2), 4: _vector_copy(4), 8: _vector_copy(8)}


def make_vector_load(simulated: bool, width: int):
    """``load(dst, di, src, si)``: ``width`` values of the flat array ``src`` from ``si`` into the
    local array ``dst`` from ``di``, one 16-byte load on a GPU (:func:`_vector_copy`: ``width`` =
    16 / itemsize: 2 float64, 4 float32, 8 float16), ``width`` element reads on the simulator."""
    if simulated:
        @cuda.jit(device=True)
        def load_sim(dst, di, src, si):
            for j in range(width):
                dst[di + j] = src[si + j]
        return load_sim
    copy = _VECTOR_COPY[width]

    @cuda.jit(device=True)
    def load_gpu(dst, di, src, si):
        copy(dst, di, src, si)
    return load_gpu


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


def pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


# --------------------------------------------------------------------------- key-group merge
def make_group_merge(D: int, G: int, L: int, KG: int, NT: int, WPL: int, EPW: int, acc_name: str):
    """``merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid,
    nsplit)``: the KG key groups of a split block each hold (m, l, O) for the g = G query
    heads; merged through shared memory (``red_*``) with the log-sum-exp rule of the combine
    kernel, one head at a time, the block writes O_s, LSE_s (or O, LSE when nsplit == 1).

    A lane holds WPL words of EPW elements (its dims are ``(lane + L*u) * EPW + ee``); decode
    v1 is WPL = d/L, EPW = 1."""
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))

    @cuda.jit(device=True)
    def merge(m, l, o_r, red_m, red_l, red_o, o, lse, o_part, lse_part, sp, b, hk, kg, lane, tid, nsplit):
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
    return merge
