"""FlashAttention forward v6 in Numba CUDA: v5 with 16-byte shared-memory loads.

Read next to :mod:`.forward_v5` (v6 changes one thing; the grid, the register blocks, the online
softmax, the masks and the traffic are v5's).  v5's products read shared memory one value at a
time: its S loop, per dim, loads TM values of Q_i and TN of K_j (4-byte loads, ``LDS``) for
TM * TN FMAs, and the SASS of that loop is more loads and index arithmetic than FMAs
(``scripts/sass_loops.py --forward-fp32``).  A GEMM kernel feeds its FMAs with 16-byte loads
(``LDS.128``: four float32 values an instruction; e.g. CUTLASS's SIMT GEMMs, code).  v6 does
that, along the dim both products leave alone or sum over:

=========  ===========================================================================
S block    per chunk of W = 16 / itemsize dims (4 float32, 2 float64): one 16-byte load of
           each of the thread's TM rows of Q_i and of its TN keys of K_j, then TM * TN * W
           FMAs (at 4 x 3 float32: 7 loads a 48 FMAs, where v5 needs 28)
O block    the thread's dims are chunks of W (lane * W + L * W * u, u < UC): per key, one
           16-byte load of V_j a chunk, then TM * W FMAs a chunk
=========  ===========================================================================

Numba has no 16-byte type for shared arrays (its float32x4 cannot be an array's dtype), so the
load is an LLVM intrinsic (:func:`.device.make_vector_load`): a ``<W x float>`` load with
16-byte alignment, which NVVM emits as ``ld.shared.v4.f32`` (``ld.shared.v2.f64``), its
elements stored into a local array that stays in registers.  It needs every chunk 16-byte
aligned: the shared arrays are declared ``alignment=16`` and a row holds a multiple of W values.
The row is padded so that its length in bytes is 16 more than a multiple of 128
(:func:`.policy.forward_v6_row`): the 8 lanes that share a 16-byte load's phase read 8 rows at
one dim chunk, and the pad shifts each row by one 16-byte bank group (v5 pads to an odd length
instead, for 4-byte reads, which would break the alignment).  Pad dims hold zeros.

Tiles: :func:`.policy.forward_v6_tiles` (v5's rule with v6's rows; Br = 64, Bc = 24 at d = 128
float32 under the 48 KiB of static shared memory).  Counted traffic (simulator):
``traffic.model("fa2")`` with Br = ``block_q``, Bc = ``block_k``, as v5.

What it showed: the products' loops now look like the CUDA C++ v1b's (mostly FFMA, fed by
LDS.128), yet on a GPU v6 ran level with v4, not near v1b
(benchmarks/results/sweeps/2026-12-07_1317_numba_fwd_v6_h200.json).  The rest of the kernel is
the reason: the K_j and V_j copies into shared memory, kept from v5 (an element a thread, its row
and dim found by a division, a 4-D index and a bounds test each), compile to nearly as many
instructions a tile as the products (the SASS counts:
benchmarks/results/sweeps/2026-12-07_1330_numba_fp32_forward_sass_v6.txt).  That copy is the
next idea; v6 runs by name until a version is ahead of v4.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import forward as fwd
from . import launch as ln
from .config import ForwardConfig, acc_dtype
from .device import make_flat_access, make_vector_load, warp_mask
from .forward import key_range, tile_span
from .launch import cuda
from .policy import forward_v6_row, vector_width
import numba  # noqa: E402
from numba import int32  # noqa: E402


@functools.lru_cache(maxsize=None)
def make_v6(D: int, BR: int, BC: int, L: int, TM: int, acc_name: str, simulated: bool):
    """v6 for head_dim D, Br = BR rows, Bc = BC keys a tile (a multiple of L), L lanes a row
    group, TM rows a thread."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    W = vector_width(np.dtype(acc_name).itemsize)            # values a 16-byte load
    NT = BR // TM * L                                        # threads: Br / TM row groups of L lanes
    TN = BC // L                                             # keys of the S block
    DV = -(-D // W) * W                                      # dims the S loop covers (zeros past D)
    UC = -(-D // (L * W))                                    # 16-byte chunks of the O block
    OW = UC * W                                              # ... its dims a row
    QW, KW = TM * W, TN * W                                  # a chunk of the S block's rows, keys
    DP = forward_v6_row(D, L, np.dtype(acc_name).itemsize)   # padded row (16-byte bank groups)
    QROW, KROW = TM * DP, L * DP                             # flat offsets: a thread's next row, key
    QN, KN = BR * DP, BC * DP                                # SRAM values of Q_i, of a K/V tile
    MASK = warp_mask(NT)
    SIM = simulated
    ALIGN = None if simulated else 16                        # (the simulator takes no alignment)
    PS = (BR, BC) if simulated else (1, 1)                   # the simulator's P exchange
    XS = (NT,) if simulated else (1,)                        # ... and its row-max exchange
    ld, st = make_flat_access(simulated)                     # raw-pointer SRAM access
    ldv = make_vector_load(simulated, W)                     # W values by one 16-byte load

    def pv_step(T):
        """O block += P V for the keys lane' + L * T of the tile (lane' < L): a device function
        per T, so that ``s[rr, T]`` has constant indices and the S block stays in registers."""
        @cuda.jit(device=True)
        def step(s, o_r, KV, P_s, pv, vv, grp, lane, base):
            for w in range(L):
                c = w + L * T                                # key c of the tile, held by lane w
                for rr in range(TM):
                    if SIM:
                        pv[rr] = P_s[grp * TM + rr, c]
                    else:
                        pv[rr] = cuda.shfl_sync(MASK, s[rr, T], base + w)
                vrow = c * DP + lane * W
                for u in range(UC):                          # dims past D: padding, never written out
                    ldv(vv, 0, KV, vrow + L * W * u)
                    for rr in range(TM):
                        for j in range(W):
                            o_r[rr, u * W + j] += pv[rr] * vv[j]
        return step

    @cuda.jit(device=True)
    def pv_none(s, o_r, KV, P_s, pv, vv, grp, lane, base):
        pass

    def chain(f, g):
        @cuda.jit(device=True)
        def both(s, o_r, KV, P_s, pv, vv, grp, lane, base):
            f(s, o_r, KV, P_s, pv, vv, grp, lane, base)
            g(s, o_r, KV, P_s, pv, vv, grp, lane, base)
        return both

    pv_all = pv_none
    for T in range(TN):
        pv_all = chain(pv_all, pv_step(T))

    def fwd_v6(q, k, v, o, lse, scale, left, right):
        Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // Hq, cuda.blockIdx.y % Hq
        hk = h // (Hq // Hkv)
        tid = cuda.threadIdx.x
        grp, lane = tid // L, tid % L                        # row group, lane within it
        base = (tid % 32) - lane                             # the group's first lane in the warp
        qrow, krow = grp * QROW, lane * DP                   # flat index of its first row, first key
        r0 = cuda.blockIdx.x * BR
        kmin, kmax = tile_span(r0, min(r0 + BR, Nq), Nq, Nk, left, right)
        Q_s = cuda.shared.array(QN, ACC, alignment=ALIGN)    # SRAM: Q_i (scaled), once; rows of DP
        KV = cuda.shared.array(KN, ACC, alignment=ALIGN)     # SRAM: K_j, then V_j
        P_s = cuda.shared.array(PS, ACC)
        X_s = cuda.shared.array(XS, ACC)
        s = cuda.local.array((TM, TN), ACC)                  # registers: the S (then P) block
        o_r = cuda.local.array((TM, OW), ACC)                # ... the O block (UC chunks of W dims)
        m = cuda.local.array(TM, ACC)
        l = cuda.local.array(TM, ACC)                        # this lane's part of the row sums
        lo = cuda.local.array(TM, int32)
        hi = cuda.local.array(TM, int32)
        qv = cuda.local.array(QW, ACC)                       # a chunk of each of the TM rows of Q_i
        kv = cuda.local.array(KW, ACC)                       # ... of each of the TN keys of K_j
        vv = cuda.local.array(W, ACC)                        # ... of a key of V_j
        pv = cuda.local.array(TM, ACC)
        for e in range(tid, BR * DP, NT):                    # load Q_i -> SRAM (once)
            r, dd = e // DP, e % DP
            x = ZERO
            if r0 + r < Nq and dd < D and kmax > kmin:
                x = ACC(q[b, h, r0 + r, dd]) * scale
            st(Q_s, e, x)
        for rr in range(TM):
            i = r0 + grp * TM + rr
            m[rr], l[rr] = NEG_INF, ZERO
            lo[rr], hi[rr] = 0, 0                            # rows past N_q: fully masked
            if i < Nq:
                lo[rr], hi[rr] = key_range(i, Nq, Nk, left, right)
            for u in range(OW):
                o_r[rr, u] = ZERO
        for c0 in range((kmin // BC) * BC, kmax, BC):        # for each visible K/V tile j
            n = min(BC, Nk - c0)
            for e in range(tid, BC * DP, NT):                # load K_j -> SRAM
                r, dd = e // DP, e % DP
                st(KV, e, ACC(k[b, hk, c0 + r, dd]) if r < n and dd < D else ZERO)
            cuda.syncthreads()                               # K_j (and, the first time, Q_i) complete
            for rr in range(TM):
                for t in range(TN):
                    s[rr, t] = ZERO
            for dc in range(0, DV, W):                       # S block = Q K^T, W dims a step:
                for rr in range(TM):                         # TM + TN 16-byte loads, TM*TN*W FMAs
                    ldv(qv, rr * W, Q_s, qrow + rr * DP + dc)
                for t in range(TN):
                    ldv(kv, t * W, KV, krow + t * KROW + dc)
                for rr in range(TM):
                    for t in range(TN):
                        acc = s[rr, t]
                        for j in range(W):
                            acc += qv[rr * W + j] * kv[t * W + j]
                        s[rr, t] = acc
            cuda.syncthreads()                               # everyone done with K_j
            for e in range(tid, BC * DP, NT):                # load V_j -> SRAM (during the softmax)
                r, dd = e // DP, e % DP
                st(KV, e, ACC(v[b, hk, c0 + r, dd]) if r < n and dd < D else ZERO)
            for rr in range(TM):                             # the online softmax over the tile (v5's)
                mx = NEG_INF
                for t in range(TN):
                    j = c0 + lane + L * t
                    if j < lo[rr] or j >= hi[rr]:
                        s[rr, t] = NEG_INF
                    mx = max(mx, s[rr, t])
                if SIM:                                      # the row max over the L lanes
                    X_s[tid] = mx
                    cuda.syncthreads()
                    for w in range(L):
                        mx = max(mx, X_s[tid - lane + w])
                    cuda.syncthreads()
                else:
                    off = L // 2
                    while off > 0:
                        mx = max(mx, cuda.shfl_xor_sync(MASK, mx, off))
                        off //= 2
                m_new = max(m[rr], mx)
                if m_new == NEG_INF:                         # nothing visible yet: P = 0
                    for t in range(TN):
                        s[rr, t] = ZERO
                else:
                    alpha = math.exp(m[rr] - m_new)
                    m[rr] = m_new
                    part = ZERO
                    for t in range(TN):
                        p = math.exp(s[rr, t] - m_new)
                        s[rr, t] = p
                        part += p
                    l[rr] = l[rr] * alpha + part
                    for u in range(OW):
                        o_r[rr, u] *= alpha
                if SIM:
                    for t in range(TN):
                        P_s[grp * TM + rr, lane + L * t] = s[rr, t]
            cuda.syncthreads()                               # V_j (and the simulator's P) complete
            pv_all(s, o_r, KV, P_s, pv, vv, grp, lane, base)   # O block += P V: per key, TM values of
            #                                                      P (shuffled from the key's lane),
            #                                                      UC 16-byte loads of V, TM*UC*W FMAs
            cuda.syncthreads()                               # everyone done before the next load
        for rr in range(TM):                                 # the row sums: add the lanes' parts
            tot = l[rr]
            if SIM:
                X_s[tid] = tot
                cuda.syncthreads()
                tot = ZERO
                for w in range(L):
                    tot += X_s[tid - lane + w]
                cuda.syncthreads()
            else:
                off = L // 2
                while off > 0:
                    tot += cuda.shfl_xor_sync(MASK, tot, off)
                    off //= 2
            l[rr] = tot
        for rr in range(TM):                                 # write O_i, LSE_i -> HBM (once)
            i = r0 + grp * TM + rr
            if i < Nq:
                inv = ZERO
                if l[rr] > ZERO:
                    inv = ONE / l[rr]
                for u in range(UC):
                    for j in range(W):
                        dd = lane * W + L * W * u + j
                        if dd < D:
                            o[b, h, i, dd] = o_r[rr, u * W + j] * inv    # fully masked: 0 * 0 = 0
                if lane == 0:
                    lse[b, h, i] = m[rr] + math.log(l[rr]) if l[rr] > ZERO else NEG_INF

    return fwd_v6


def kernel_function(cfg: ForwardConfig, head_dim: int, dtype: str, simulated: bool | None = None):
    """The Python function of v6 for ``cfg`` (resolved here), before ``cuda.jit``."""
    cfg = cfg.resolved(head_dim, dtype)
    if simulated is None:
        simulated = ln.simulated()
    return make_v6(head_dim, cfg.block_q, cfg.block_k, cfg.threads_per_row, cfg.rows_per_thread,
                   np.dtype(acc_dtype(dtype)).name, simulated)


def launch(cfg: ForwardConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """Launch v6 (``cfg`` resolved) on device (or counting) arrays already allocated."""
    fwd.launch_forward(lambda d, dtype: kernel_function(cfg, d, dtype), cfg, q, k, v, o, lse,
                       causal=causal, scale=scale, window=window, stream=stream)


def attention(q, k, v, *, causal=False, scale=None, window=None, config):
    """v6's launcher: (o, lse) of the kind and dtype given (LSE in the accumulator dtype)."""
    return fwd.call_forward(launch, q, k, v, causal=causal, scale=scale, window=window, config=config)
