"""FlashAttention forward v7 in Numba CUDA: v6 with its K/V tile copies by 16-byte loads.

Read next to :mod:`.forward_v6` (v7 changes one thing: how K_j and V_j reach shared memory).
v5 and v6 copy a tile an element a thread: element e of the tile is row e // DP, dim e % DP of
the padded row, read as ``k[b, hk, c0 + r, dd]`` (a 4-D index with its strides and bounds
tests) and converted.  Compiled, that is about 70 instructions an element, nearly all integer,
and at v6's tiles nearly as many instructions a tile as its two products
(benchmarks/results/sweeps/2026-12-07_1330_numba_fp32_forward_sass_v6.txt).  v7 copies a tile the
way its products read it, in 16-byte chunks:

=========  ===========================================================================
chunk      16 bytes of a K (or V) row in the input dtype: WIN = 16 / itemsize values
           (8 float16, 4 float32, 2 float64); a row holds CPR = d / WIN of them
copy       chunk i of the tile is row i // CPR, chunk i % CPR (a shift where CPR is a
           power of two); its address is the row's flat offset in the C-contiguous
           cache, ((b Hkv + hk) N + c0 + r) d, plus the chunk's; one 16-byte load
           (:func:`.device.make_vector_load`), WIN conversions to the accumulator dtype, WIN
           stores into the padded row
padding    the rows' pad dims (d to DP) are zeroed once, before the first tile; the copies
           never write them
=========  ===========================================================================

Where the chunks cannot be read that way -- K or V not C-contiguous, not starting on a 16-byte
boundary, or rows that are not whole chunks (d x itemsize not a multiple of 16) -- v7 copies
element by element as v6 does (the launcher decides, ``chunked``); the results are the same.
On the simulator a chunk is read by WIN element reads at the same (row, chunk) indices, so the
tests run the chunk arithmetic.  Q_i is copied once a block, as in v6.  Tiles, traffic and
everything else: v6's.
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
def make_v7(D: int, BR: int, BC: int, L: int, TM: int, acc_name: str, in_name: str, simulated: bool,
            chunked: bool):
    """v7 for head_dim D, Br = BR rows, Bc = BC keys a tile (a multiple of L), L lanes a row
    group, TM rows a thread, K/V of dtype ``in_name`` copied in 16-byte chunks (``chunked``) or
    element by element."""
    ACC = getattr(numba, acc_name)
    IN = numba.from_dtype(np.dtype(in_name))
    WIN = 16 // np.dtype(in_name).itemsize                   # input values a 16-byte chunk
    CPR = D // WIN                                           # chunks a row (chunked: D % WIN == 0)
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
    gld = make_vector_load(False, WIN) if not simulated else None   # a chunk of a cache row
    PADW = DP - D                                            # pad dims a row (zeroed once)
    ZERO_PADS = chunked and PADW > 0

    if not chunked:
        @cuda.jit(device=True)
        def copy_tile(X, KV, cin, b, hk, c0, n, tid):
            """v6's copy: an element a thread."""
            for e in range(tid, BC * DP, NT):
                r, dd = e // DP, e % DP
                st(KV, e, ACC(X[b, hk, c0 + r, dd]) if r < n and dd < D else ZERO)
    elif simulated:
        @cuda.jit(device=True)
        def copy_tile(X, KV, cin, b, hk, c0, n, tid):
            """A chunk a thread, its WIN values read one by one (the simulator)."""
            for i in range(tid, BC * CPR, NT):
                r = i // CPR
                c = i - r * CPR
                for j in range(WIN):
                    st(KV, r * DP + c * WIN + j, ACC(X[b, hk, c0 + r, c * WIN + j]) if r < n else ZERO)
    else:
        @cuda.jit(device=True)
        def copy_tile(X, KV, cin, b, hk, c0, n, tid):
            """A chunk a thread: one 16-byte load from the row's flat offset, WIN stores."""
            Hkv, Nk = X.shape[1], X.shape[2]
            row0 = (b * Hkv + hk) * Nk + c0                  # flat row of the tile's first key
            for i in range(tid, BC * CPR, NT):
                r = i // CPR
                c = i - r * CPR
                if r < n:
                    gld(cin, 0, X, (row0 + r) * D + c * WIN)
                    for j in range(WIN):
                        st(KV, r * DP + c * WIN + j, ACC(cin[j]))
                else:
                    for j in range(WIN):
                        st(KV, r * DP + c * WIN + j, ZERO)

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

    def fwd_v7(q, k, v, o, lse, scale, left, right):
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
        cin = cuda.local.array(WIN, IN)                      # a chunk of a K or V row
        if ZERO_PADS:                                        # the K/V rows' pad dims: zeros, once
            for e in range(tid, BC * PADW, NT):              # (the chunk copies never write them)
                st(KV, (e // PADW) * DP + D + e % PADW, ZERO)
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
            copy_tile(k, KV, cin, b, hk, c0, n, tid)         # load K_j -> SRAM
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
            copy_tile(v, KV, cin, b, hk, c0, n, tid)         # load V_j -> SRAM (during the softmax)
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

    return fwd_v7


def chunk_reason(x, head_dim: int, name: str) -> str | None:
    """Why v7 copies ``x`` (K or V: a NumPy, Numba or torch array) element by element rather than
    in 16-byte chunks (None: it can read chunks): rows of whole chunks, C-contiguous, starting on a
    16-byte boundary."""
    try:
        itemsize = np.dtype(x.dtype).itemsize
    except TypeError:                                        # a torch tensor
        itemsize = x.element_size()
    if head_dim * itemsize % 16:
        return f"{name}: rows of {head_dim * itemsize} bytes are not whole 16-byte chunks"
    if not ln.c_contiguous(x):
        return f"{name}: not C-contiguous"
    if not ln.aligned(x, 16):
        return f"{name}: does not start on a 16-byte boundary"
    return None


def kernel_function(cfg: ForwardConfig, head_dim: int, dtype: str, simulated: bool | None = None,
                    chunked: bool = True):
    """The Python function of v7 for ``cfg`` (resolved here), before ``cuda.jit``; ``chunked``:
    K/V in 16-byte chunks (the caller has checked :func:`chunk_reason`), else element by element."""
    cfg = cfg.resolved(head_dim, dtype)
    if simulated is None:
        simulated = ln.simulated()
    return make_v7(head_dim, cfg.block_q, cfg.block_k, cfg.threads_per_row, cfg.rows_per_thread,
                   np.dtype(acc_dtype(dtype)).name, np.dtype(dtype).name, simulated,
                   bool(chunked) and head_dim * np.dtype(dtype).itemsize % 16 == 0)


def launch(cfg: ForwardConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """Launch v7 (``cfg`` resolved) on device (or counting) arrays already allocated: in 16-byte
    chunks where :func:`chunk_reason` finds both K and V readable that way."""
    hd = q.shape[3]                                          # (the simulator's shapes take no -1)
    chunked = chunk_reason(k, hd, "k") is None and chunk_reason(v, hd, "v") is None
    fwd.launch_forward(lambda d, dtype: kernel_function(cfg, d, dtype, chunked=chunked), cfg, q, k, v, o, lse,
                       causal=causal, scale=scale, window=window, stream=stream)


def attention(q, k, v, *, causal=False, scale=None, window=None, config):
    """v7's launcher: (o, lse) of the kind and dtype given (LSE in the accumulator dtype)."""
    return fwd.call_forward(launch, q, k, v, causal=causal, scale=scale, window=window, config=config)
