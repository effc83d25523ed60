"""FlashAttention forward v5 in Numba CUDA: register tiling as a GEMM kernel does it.

Read next to :mod:`.forward` (v1-v4: the notation, the grid, the online softmax, the
masks).  v3 and v4 share a row's d dims among L lanes, so every score S_ij is a sum over
lanes: a shuffle butterfly per step of keys, and one value read from shared memory feeds
the R rows of a thread.  v5 computes S and O the way a CUDA-core GEMM computes C = A B
(e.g. CUTLASS's SIMT GEMMs, code): each thread owns a small block of each output and
accumulates it with no communication,

=========  ===========================================================================
S block    TM rows x TN keys of S_ij = Q_i K_j^T: TM = ``rows_per_thread`` rows, the keys
           lane + L * t (t < TN = Bc / L) of the tile; the sum over d is a loop inside
           the thread: per dim, TM values of Q and TN values of K from shared memory
           feed TM * TN FMAs
O block    the same TM rows x the dims lane + L * u (u < d / L) of O: per key, TM values
           of P and d / L values of V feed TM * d / L FMAs
=========  ===========================================================================

with Q_i staged in shared memory once (pre-scaled), K_j and then V_j in one shared buffer
(the limit of 48 KiB of static shared memory holds Q_i and one K/V tile, not two: V_j is
loaded after S is computed, while the softmax runs).  The online softmax works on a whole
tile: the row max over the tile is a 3-step butterfly over the L = 8 lanes of a row, the
row sum stays a per-lane partial sum until the end, and each lane's probabilities reach
the other lanes of its row by ``shfl_sync`` (on the simulator: through shared memory).
Rows of the shared arrays are padded to an odd length (:func:`.policy.forward_v5_row`), so
the lanes' reads of K_j, V_j and Q_i fall in different banks, and they are read through raw
pointers into flat arrays (:func:`.device.make_flat_access`): a thread's rows and keys are
constant offsets from one base, so the S loop is loads and FMAs, without the address
arithmetic and negative-index wraparound code of 2-D indexing.

What limits it: the S loop reads TM + TN values from shared memory per TM * TN FMAs (at the
default 4 x 3, 7 loads per 12 FMAs) -- a GEMM kernel uses 8 x 8 blocks and 16-byte shared
loads, which would need 128 accumulator registers for S and O each and a shared-memory
layout whose transposing stores conflict; the 48 KiB of static shared memory these kernels
keep to (:data:`.config.SHARED_LIMIT_BYTES`; more needs dynamic shared memory and a
``cuFuncSetAttribute`` call on the compiled kernel) caps the tiles at Br = 64, Bc = 24 for
d = 128 float32; and Numba exposes no tensor-core (mma) instructions, so float16 inputs
compute in float32 FMAs like float32 ones.  Tiles: :func:`.policy.forward_v5_tiles`.

Counted traffic (simulator): ``traffic.model("fa2")`` with Br = ``block_q``, Bc =
``block_k`` (Q once, each K/V tile once per query tile, O once).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import forward as fwd
from . import launch as ln
from .config import ForwardConfig, acc_dtype
from .device import make_flat_access, warp_mask
from .forward import key_range, tile_span
from .launch import cuda
from .policy import forward_v5_row
import numba  # noqa: E402
from numba import int32  # noqa: E402


@functools.lru_cache(maxsize=None)
def make_v5(D: int, BR: int, BC: int, L: int, TM: int, acc_name: str, simulated: bool):
    """v5 for head_dim D, Br = BR rows, Bc = BC keys a tile (a multiple of L), L lanes a row
    group, TM rows a thread."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    NT = BR // TM * L                                        # threads: Br / TM row groups of L lanes
    TN = BC // L                                             # keys of the S block
    DPL = -(-D // L)                                         # dims of the O block
    DP = forward_v5_row(D, L)                                # padded row (bank conflicts)
    QROW, KROW = TM * DP, L * DP                             # flat offsets: a thread's next row, key
    QN, KN = BR * DP, BC * DP                                # SRAM values of Q_i, of a K/V tile
    MASK = warp_mask(NT)
    SIM = simulated
    PS = (BR, BC) if simulated else (1, 1)                   # the simulator's P exchange
    XS = (NT,) if simulated else (1,)                        # ... and its row-max exchange
    ld, st = make_flat_access(simulated)                     # raw-pointer SRAM access: no
    #                                                          negative-index wraparound code

    def pv_step(T):
        """O block += P V for the keys lane' + L * T of the tile (lane' < L): a device function
        per T, so that ``s[rr, T]`` has constant indices and the S block stays in registers."""
        @cuda.jit(device=True)
        def step(s, o_r, KV, P_s, pv, grp, lane, base):
            for w in range(L):
                c = w + L * T                                # key c of the tile, held by lane w
                for rr in range(TM):
                    if SIM:
                        pv[rr] = P_s[grp * TM + rr, c]
                    else:
                        pv[rr] = cuda.shfl_sync(MASK, s[rr, T], base + w)
                vrow = c * DP + lane
                for u in range(DPL):                         # dims past D: padding, never written out
                    vv = ld(KV, vrow + L * u)
                    for rr in range(TM):
                        o_r[rr, u] += pv[rr] * vv
        return step

    @cuda.jit(device=True)
    def pv_none(s, o_r, KV, P_s, pv, grp, lane, base):
        pass

    def chain(f, g):
        @cuda.jit(device=True)
        def both(s, o_r, KV, P_s, pv, grp, lane, base):
            f(s, o_r, KV, P_s, pv, grp, lane, base)
            g(s, o_r, KV, P_s, pv, grp, lane, base)
        return both

    pv_all = pv_none
    for T in range(TN):
        pv_all = chain(pv_all, pv_step(T))

    def fwd_v5(q, k, v, o, lse, scale, left, right):
        Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // Hq, cuda.blockIdx.y % Hq
        hk = h // (Hq // Hkv)
        tid = cuda.threadIdx.x
        grp, lane = tid // L, tid % L                        # row group, lane within it
        base = (tid % 32) - lane                             # the group's first lane in the warp
        qrow, krow = grp * QROW, lane * DP                   # flat index of its first row, first key
        r0 = cuda.blockIdx.x * BR
        kmin, kmax = tile_span(r0, min(r0 + BR, Nq), Nq, Nk, left, right)
        Q_s = cuda.shared.array(QN, ACC)                     # SRAM: Q_i (scaled), once; rows of DP
        KV = cuda.shared.array(KN, ACC)                      # SRAM: K_j, then V_j
        P_s = cuda.shared.array(PS, ACC)
        X_s = cuda.shared.array(XS, ACC)
        s = cuda.local.array((TM, TN), ACC)                  # registers: the S (then P) block
        o_r = cuda.local.array((TM, DPL), ACC)               # ... the O block
        m = cuda.local.array(TM, ACC)
        l = cuda.local.array(TM, ACC)                        # this lane's part of the row sums
        lo = cuda.local.array(TM, int32)
        hi = cuda.local.array(TM, int32)
        qv = cuda.local.array(TM, ACC)
        kv = cuda.local.array(TN, ACC)
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
            for u in range(DPL):
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
            for dd in range(D):                              # S block = Q K^T: TM + TN loads, TM*TN FMAs
                for rr in range(TM):
                    qv[rr] = ld(Q_s, qrow + rr * DP + dd)
                for t in range(TN):
                    kv[t] = ld(KV, krow + t * KROW + dd)
                for rr in range(TM):
                    for t in range(TN):
                        s[rr, t] += qv[rr] * kv[t]
            cuda.syncthreads()                               # everyone done with K_j
            for e in range(tid, BC * DP, NT):                # load V_j -> SRAM (during the softmax)
                r, dd = e // DP, e % DP
                st(KV, e, ACC(v[b, hk, c0 + r, dd]) if r < n and dd < D else ZERO)
            for rr in range(TM):                             # the online softmax over the tile
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
                    for u in range(DPL):
                        o_r[rr, u] *= alpha
                if SIM:
                    for t in range(TN):
                        P_s[grp * TM + rr, lane + L * t] = s[rr, t]
            cuda.syncthreads()                               # V_j (and the simulator's P) complete
            pv_all(s, o_r, KV, P_s, pv, grp, lane, base)   # O block += P V: per key, TM values of P
            #                                                  (shuffled from the lane that owns the key)
            #                                                  and DPL of V feed TM * DPL FMAs
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
                for u in range(DPL):
                    dd = lane + L * u
                    if dd < D:
                        o[b, h, i, dd] = o_r[rr, u] * inv    # fully masked: 0 * 0 = 0
                if lane == 0:
                    lse[b, h, i] = m[rr] + math.log(l[rr]) if l[rr] > ZERO else NEG_INF

    return fwd_v5


def kernel_function(cfg: ForwardConfig, head_dim: int, dtype: str, simulated: bool | None = None):
    """The Python function of v5 for ``cfg`` (resolved here), before ``cuda.jit``."""
    cfg = cfg.resolved(head_dim, dtype)
    if simulated is None:
        simulated = ln.simulated()
    return make_v5(head_dim, cfg.block_q, cfg.block_k, cfg.threads_per_row, cfg.rows_per_thread,
                   np.dtype(acc_dtype(dtype)).name, simulated)


def launch(cfg: ForwardConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """Launch v5 (``cfg`` resolved) on device (or counting) arrays already allocated."""
    fwd.launch_forward(lambda d, dtype: kernel_function(cfg, d, dtype), cfg, q, k, v, o, lse,
                       causal=causal, scale=scale, window=window, stream=stream)


def attention(q, k, v, *, causal=False, scale=None, window=None, config):
    """v5's launcher: (o, lse) of the kind and dtype given (LSE in the accumulator dtype)."""
    return fwd.call_forward(launch, q, k, v, causal=causal, scale=scale, window=window, config=config)
