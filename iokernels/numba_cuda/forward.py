"""FlashAttention forward in Numba CUDA: four versions side by side, each mirroring iokernels.tiled.

Read this next to :func:`iokernels.tiled.forward_fa2`: the NumPy loop over query tiles
becomes the grid, the loop over K/V tiles stays a loop inside one thread block, and the
NumPy tile arrays become registers (per thread) and shared memory (per block).

Notation (the papers' names, as in :mod:`iokernels.tiled`):

=======  =========================================================================
Br, Bc   query rows per thread block, key/value rows per K/V tile (``block_q``, ``block_k``)
Tr, Tc   ceil(N_q / Br) query tiles (grid x), ceil(N_k / Bc) key tiles (inner loop)
S_ij     scale * Q_i K_j^T for the keys of tile j: registers only
m, l     running row max and row sum of exp(S - m): one pair per query row, in registers
O        the unnormalized output accumulator in registers; O / l written once to HBM
LSE      m + log(l), written once
SRAM     shared memory (``cuda.shared.array``): K_j, V_j staged for the whole block
L, R     v3/v4: lanes sharing a row (``threads_per_row``), rows a thread keeps (``rows_per_thread``)
=======  =========================================================================

The grid: ``(Tr, batch * heads_q)``; thread block (x, y) owns query tile x of
(sequence, query head) y and reads K/V head ``h // (heads_q // heads_kv)`` (GQA/MQA).

The versions (``ForwardConfig(version=...)``; each changes one thing from the one before):

* **v1** one thread per query row; each thread reads the K and V rows it needs straight
  from global memory (HBM, through the caches).  No shared memory, no ``syncthreads``.
  Counted traffic: every row reads its visible keys itself, so K and V are read about Br
  times more than FlashAttention's model (the caches absorb part of that on a GPU).
* **v2** block-cooperative, the FlashAttention-2 loop order exactly: the Br threads of a
  block load K_j and V_j into shared memory together, ``syncthreads``, then each thread
  folds the tile into its row's (m, l, O).  Counted traffic == ``traffic.model("fa2")``.
  What limits it: one thread per row, so the row's q and O (2d values) sit in per-thread
  arrays that spill out of registers for d = 128, and every multiply-add reads one value
  from shared memory (one load per FMA): it is bound by shared-memory bandwidth.
* **v3** several threads per row and several rows per thread (register tiling): a row is
  shared by L lanes of one warp, each owning d / L of its dims, and each thread keeps R
  rows, so one value read from shared memory feeds R multiply-adds.  The lanes of a row
  add their partial dot products with warp shuffles (``shfl_xor_sync``).  Keys are folded
  ``KEYS_PER_STEP`` at a time (the online softmax rescales once per step: the same
  recurrence with smaller tiles).  Counted traffic == ``traffic.model("fa2")``.
  What limits it: NVVM does not unroll its 8-key step, so the step's scores live in local
  memory instead of registers.
* **v4** (the default until v5, :mod:`.forward_v5`) v3 with a step of ``V4_KEYS_PER_STEP`` = 4 keys whose R x 4 partial
  dot products go through one butterfly together.  A step this small is unrolled, so its
  scores stay in registers (no local memory in the PTX, checked by tests/test_numba_ptx.py),
  and the butterfly's shuffles are independent of each other, so they overlap instead of
  waiting in a chain.  The price: O is rescaled every 4 keys instead of 8.  What still
  limits it: instruction issue (a shared-memory load per R multiply-adds, a shuffle
  butterfly every step, about 250 registers a thread), and Numba exposes no tensor-core
  (mma) instructions, so float16 gains nothing here; the CuPy backend's v2 is the
  tensor-core step.  Counted traffic == v3's.

v3 and v4 add a tile's probabilities up apart (``l_j``) and add that into the row sum l once
per K/V tile: N/Bc sequential float32 additions into l instead of N/4 keep the LSE within
the 2x rule at long N, which is how the FlashAttention papers' Algorithm 1 writes it (a tile's row
sum, then l; FlashAttention-2's kernel adds each element into a thread's running sum).

The simulator (no GPU) has no warp shuffles: there v3's lane sum goes through shared
memory and ``syncthreads`` (:func:`.device.make_lane_sum`); the arithmetic is the same, the
order of the additions of the lanes' partial sums differs.

``buggy_skip_sync=True`` (teaching only, used by notebook 05) removes v2's
``syncthreads`` after the K_j/V_j load, the classic shared-memory race.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core import conventions as cv
from . import launch as ln
from .config import KEYS_PER_STEP, ForwardConfig, acc_dtype
from .device import make_lane_sum, warp_mask
from .launch import cuda
import numba  # noqa: E402  (after the NumPy fix, through .launch)
from numba import int32  # noqa: E402


# --------------------------------------------------------------------------- device helpers
@cuda.jit(device=True)
def key_range(i, Nq, Nk, left, right):
    """Keys [lo, hi) visible to query row i: conventions.key_range, one row, on the device.

    left/right is the effective window (causal folded in, -1 = unbounded)."""
    diag = i + Nk - Nq                       # the key aligned with row i (bottom-right)
    lo = 0
    if left >= 0:
        lo = min(max(diag - left, 0), Nk)
    hi = Nk
    if right >= 0:
        hi = min(max(diag + right + 1, 0), Nk)
    if hi < lo:
        hi = lo                              # a fully masked row: lo == hi
    return lo, hi


@cuda.jit(device=True)
def tile_span(r0, r1, Nq, Nk, left, right):
    """Keys [kmin, kmax) that rows [r0, r1) see together (one interval: the rows' intervals
    never move left), as tiled._kv_span; kmax <= kmin when every row is masked."""
    kmin = Nk
    kmax = 0
    for i in range(r0, r1):
        lo, hi = key_range(i, Nq, Nk, left, right)
        if hi > lo:
            kmin = min(kmin, lo)
            kmax = max(kmax, hi)
    return kmin, kmax

# --------------------------------------------------------------------------- v1
@functools.lru_cache(maxsize=None)
def make_v1(D: int, BR: int, BC: int, acc_name: str):
    """v1: one thread per query row; K and V read straight from global memory."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))

    def fwd_v1(q, k, v, o, lse, scale, left, right):
        Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // Hq, cuda.blockIdx.y % Hq
        hk = h // (Hq // Hkv)                                # GQA: the KV head of query head h
        i = cuda.blockIdx.x * BR + cuda.threadIdx.x          # this thread's query row
        if i >= Nq:
            return
        lo, hi = key_range(i, Nq, Nk, left, right)
        q_i = cuda.local.array(D, ACC)                       # registers / local memory
        o_i = cuda.local.array(D, ACC)
        s = cuda.local.array(BC, ACC)
        m_i, l_i = NEG_INF, ZERO
        for dd in range(D):
            o_i[dd] = ZERO
            if hi > lo:
                q_i[dd] = ACC(q[b, h, i, dd])                # read q_i <- HBM (once)
        for c0 in range((lo // BC) * BC, hi, BC):            # keys in chunks of Bc
            c_lo, c_hi = max(lo, c0), min(hi, c0 + BC)
            m_new = m_i
            for j in range(c_lo, c_hi):                      # S_ij = scale q_i . k_j
                dot = ZERO
                for dd in range(D):
                    dot += q_i[dd] * ACC(k[b, hk, j, dd])    # read k_j <- HBM (per row!)
                s[j - c0] = dot * scale
                m_new = max(m_new, s[j - c0])
            alpha = math.exp(m_i - m_new)                    # m_i = -inf -> 0, never NaN
            for dd in range(D):
                o_i[dd] *= alpha
            row_sum = ZERO
            for j in range(c_lo, c_hi):
                p = math.exp(s[j - c0] - m_new)
                row_sum += p
                for dd in range(D):
                    o_i[dd] += p * ACC(v[b, hk, j, dd])      # read v_j <- HBM (per row!)
            l_i = alpha * l_i + row_sum
            m_i = m_new
        if l_i > ZERO:                                       # write O_i, LSE_i -> HBM
            inv = ONE / l_i
            for dd in range(D):
                o[b, h, i, dd] = o_i[dd] * inv
            lse[b, h, i] = m_i + math.log(l_i)
        else:                                                # fully masked row: 0 and -inf
            for dd in range(D):
                o[b, h, i, dd] = ZERO
            lse[b, h, i] = NEG_INF

    return fwd_v1


# --------------------------------------------------------------------------- v2
@functools.lru_cache(maxsize=None)
def make_v2(D: int, BR: int, BC: int, acc_name: str, buggy_skip_sync: bool = False):
    """v2: FlashAttention-2 exactly; K_j, V_j staged in shared memory by the whole block."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    SYNC_AFTER_LOAD = not buggy_skip_sync

    def fwd_v2(q, k, v, o, lse, scale, left, right):
        Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // Hq, cuda.blockIdx.y % Hq
        hk = h // (Hq // Hkv)
        t = cuda.threadIdx.x
        r0 = cuda.blockIdx.x * BR                            # query tile i: rows [r0, r0 + Br)
        i = r0 + t                                           # this thread's row
        kmin, kmax = tile_span(r0, min(r0 + BR, Nq), Nq, Nk, left, right)
        K_j = cuda.shared.array((BC, D), ACC)                # SRAM tiles, shared by the block
        V_j = cuda.shared.array((BC, D), ACC)
        q_i = cuda.local.array(D, ACC)                       # registers (spill for large d)
        o_i = cuda.local.array(D, ACC)
        s = cuda.local.array(BC, ACC)
        lo, hi = 0, 0
        if i < Nq:
            lo, hi = key_range(i, Nq, Nk, left, right)
        m_i, l_i = NEG_INF, ZERO
        for dd in range(D):
            o_i[dd] = ZERO
            if i < Nq and kmax > kmin:
                q_i[dd] = ACC(q[b, h, i, dd])                # load Q_i -> registers (once)
        for c0 in range((kmin // BC) * BC, kmax, BC):        # for each visible K/V tile j
            n = min(BC, Nk - c0)
            for e in range(t, BC * D, BR):                   # load K_j, V_j -> SRAM (together)
                r, dd = e // D, e % D
                if r < n:
                    K_j[r, dd] = ACC(k[b, hk, c0 + r, dd])
                    V_j[r, dd] = ACC(v[b, hk, c0 + r, dd])
            if SYNC_AFTER_LOAD:
                cuda.syncthreads()                           # the tile is complete for everyone
            c_lo, c_hi = max(lo, c0), min(hi, c0 + n)        # this row's visible keys in the tile
            if c_hi > c_lo:
                m_new = m_i
                for j in range(c_lo, c_hi):                  # S_ij = scale q_i K_j^T (on chip)
                    dot = ZERO
                    for dd in range(D):
                        dot += q_i[dd] * K_j[j - c0, dd]
                    s[j - c0] = dot * scale
                    m_new = max(m_new, s[j - c0])
                alpha = math.exp(m_i - m_new)                # rescale what was summed so far
                for dd in range(D):
                    o_i[dd] *= alpha
                row_sum = ZERO
                for j in range(c_lo, c_hi):                  # P_ij = exp(S_ij - m); O += P_ij V_j
                    p = math.exp(s[j - c0] - m_new)
                    row_sum += p
                    for dd in range(D):
                        o_i[dd] += p * V_j[j - c0, dd]
                l_i = alpha * l_i + row_sum                  # l = alpha l + rowsum(P_ij)
                m_i = m_new
            cuda.syncthreads()                               # everyone done before the next load
        if i < Nq:                                           # write O_i, LSE_i -> HBM (once)
            if l_i > ZERO:
                inv = ONE / l_i
                for dd in range(D):
                    o[b, h, i, dd] = o_i[dd] * inv
                lse[b, h, i] = m_i + math.log(l_i)
            else:
                for dd in range(D):
                    o[b, h, i, dd] = ZERO
                lse[b, h, i] = NEG_INF

    return fwd_v2


# --------------------------------------------------------------------------- v3
@functools.lru_cache(maxsize=None)
def make_v3(D: int, BR: int, BC: int, L: int, R: int, acc_name: str, simulated: bool, batched: bool = False,
            keys_per_step: int = KEYS_PER_STEP):
    """v3: L lanes per row (each d/L dims), R rows per thread, K_j/V_j in shared memory.

    v4 is this kernel with ``keys_per_step = V4_KEYS_PER_STEP`` (a step NVVM unrolls)."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    NT = BR // R * L                                         # threads per block
    DPT = -(-D // L)                                         # dims per lane
    DPAD = DPT * L                                           # d padded to a multiple of L (zeros)
    CH = min(keys_per_step, BC)                              # keys folded per softmax step
    BATCH = batched                                          # one butterfly for the step's R*CH dots
    RCH = R * CH
    SCRATCH = ((R * CH if batched else R), NT) if simulated else (1, 1)   # simulator's lane sums
    lane_sum = make_lane_sum(L, R, simulated, warp_mask(NT))
    lane_sum_step = make_lane_sum(L, R * CH, simulated, warp_mask(NT))

    def fwd_v3(q, k, v, o, lse, scale, left, right):
        Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // Hq, cuda.blockIdx.y % Hq
        hk = h // (Hq // Hkv)
        tid = cuda.threadIdx.x
        grp, lane = tid // L, tid % L                        # row group, lane within it
        r0 = cuda.blockIdx.x * BR
        kmin, kmax = tile_span(r0, min(r0 + BR, Nq), Nq, Nk, left, right)
        K_j = cuda.shared.array((BC, DPAD), ACC)             # SRAM tiles
        V_j = cuda.shared.array((BC, DPAD), ACC)
        scratch = cuda.shared.array(SCRATCH, ACC)
        q_r = cuda.local.array((R, DPT), ACC)                # registers: R rows x d/L dims
        o_r = cuda.local.array((R, DPT), ACC)
        m = cuda.local.array(R, ACC)
        l = cuda.local.array(R, ACC)                         # row sums of the tiles before j
        l_j = cuda.local.array(R, ACC)                       # ... and of tile j so far
        lo = cuda.local.array(R, int32)
        hi = cuda.local.array(R, int32)
        s = cuda.local.array((R, CH), ACC)                   # S (then P) for CH keys
        part = cuda.local.array(R, ACC)                      # a lane's partial dot products
        part_step = cuda.local.array(RCH, ACC)               # ... for all CH keys of a step
        for rr in range(R):
            i = r0 + grp * R + rr
            m[rr], l[rr] = NEG_INF, ZERO
            lo[rr], hi[rr] = 0, 0                            # rows past N_q: fully masked
            if i < Nq:
                lo[rr], hi[rr] = key_range(i, Nq, Nk, left, right)
            for u in range(DPT):
                dd = lane + L * u                            # interleaved dims: no bank conflicts
                o_r[rr, u] = ZERO
                q_r[rr, u] = ZERO
                if i < Nq and dd < D and kmax > kmin:
                    q_r[rr, u] = ACC(q[b, h, i, dd])         # load Q_i -> registers (once)
        for c0 in range((kmin // BC) * BC, kmax, BC):        # for each visible K/V tile j
            n = min(BC, Nk - c0)
            for e in range(tid, BC * DPAD, NT):              # load K_j, V_j -> SRAM (together)
                r, dd = e // DPAD, e % DPAD
                if r < n and dd < D:
                    K_j[r, dd] = ACC(k[b, hk, c0 + r, dd])
                    V_j[r, dd] = ACC(v[b, hk, c0 + r, dd])
                else:                                        # padding: zeros, never garbage
                    K_j[r, dd] = ZERO
                    V_j[r, dd] = ZERO
            cuda.syncthreads()
            for rr in range(R):
                l_j[rr] = ZERO
            for cc in range(0, BC, CH):                      # CH keys per online-softmax step
                if BATCH:                                    # S = scale q K^T: all CH keys' partial
                    for c in range(CH):                      # dots, then one butterfly of R*CH
                        for rr in range(R):                  # independent sums (more in flight)
                            dot = ZERO
                            for u in range(DPT):
                                dot += q_r[rr, u] * K_j[cc + c, lane + L * u]
                            part_step[rr * CH + c] = dot
                    lane_sum_step(part_step, scratch, tid)
                    for c in range(CH):
                        j = c0 + cc + c
                        for rr in range(R):
                            visible = j >= lo[rr] and j < hi[rr]
                            s[rr, c] = part_step[rr * CH + c] * scale if visible else NEG_INF
                else:
                    for c in range(CH):                      # S = scale q K^T, key by key
                        j = c0 + cc + c
                        for rr in range(R):
                            part[rr] = ZERO
                            for u in range(DPT):
                                part[rr] += q_r[rr, u] * K_j[cc + c, lane + L * u]
                        lane_sum(part, scratch, tid)
                        for rr in range(R):
                            s[rr, c] = part[rr] * scale if (j >= lo[rr] and j < hi[rr]) else NEG_INF
                for rr in range(R):                          # the online softmax, per row
                    m_new = m[rr]
                    for c in range(CH):
                        m_new = max(m_new, s[rr, c])
                    if m_new == NEG_INF:                     # nothing visible yet: P = 0
                        for c in range(CH):
                            s[rr, c] = ZERO
                    else:
                        alpha = math.exp(m[rr] - m_new)
                        m[rr] = m_new
                        row_sum = ZERO
                        for c in range(CH):
                            p = math.exp(s[rr, c] - m_new)
                            s[rr, c] = p
                            row_sum += p
                        l[rr] *= alpha                       # the tile's sum joins l once, at
                        l_j[rr] = l_j[rr] * alpha + row_sum  # its end: N/Bc sequential adds, not
                        for u in range(DPT):                 # N/CH (float32 rounding in LSE)
                            o_r[rr, u] *= alpha
                for c in range(CH):                          # O += P V: one V value, R FMAs
                    for u in range(DPT):
                        vv = V_j[cc + c, lane + L * u]
                        for rr in range(R):
                            o_r[rr, u] += s[rr, c] * vv
            for rr in range(R):
                l[rr] += l_j[rr]
            cuda.syncthreads()                               # everyone done before the next load
        for rr in range(R):                                  # write O_i, LSE_i -> HBM (once)
            i = r0 + grp * R + rr
            if i < Nq:
                inv = ZERO
                if l[rr] > ZERO:
                    inv = ONE / l[rr]
                for u in range(DPT):
                    dd = lane + L * u
                    if dd < D:
                        o[b, h, i, dd] = o_r[rr, u] * inv    # fully masked: 0 * 0 = 0
                if lane == 0:
                    if l[rr] > ZERO:
                        lse[b, h, i] = m[rr] + math.log(l[rr])
                    else:
                        lse[b, h, i] = NEG_INF

    return fwd_v3


# --------------------------------------------------------------------------- launch
def kernel_function(cfg: ForwardConfig, head_dim: int, dtype: str, simulated: bool | None = None):
    """The Python function of the kernel ``cfg`` selects (before ``cuda.jit``); for PTX tests."""
    cfg = cfg.resolved(head_dim, dtype)
    acc_name = np.dtype(acc_dtype(dtype)).name
    if simulated is None:
        simulated = ln.simulated()
    if cfg.version == "v1":
        return make_v1(head_dim, cfg.block_q, cfg.block_k, acc_name)
    if cfg.version == "v2":
        return make_v2(head_dim, cfg.block_q, cfg.block_k, acc_name, cfg.buggy_skip_sync)
    return make_v3(head_dim, cfg.block_q, cfg.block_k, cfg.threads_per_row, cfg.rows_per_thread,
                   acc_name, simulated, cfg.batched, cfg.keys_per_step)


def launch(cfg: ForwardConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """Launch the forward (``cfg`` resolved) on device (or counting) arrays already allocated,
    on ``stream``; returns nothing."""
    launch_forward(lambda d, dtype: kernel_function(cfg, d, dtype), cfg, q, k, v, o, lse,
                   causal=causal, scale=scale, window=window, stream=stream)


def launch_forward(make, cfg: ForwardConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """The launch every forward version shares: the kernel ``make(head_dim, dtype)`` returns
    (its Python function, jitted here), a block a (query tile, batch x head), on ``stream``."""
    B, Hq, Nq, d = q.shape
    dtype = str(np.dtype(o.dtype))
    left, right = cv.effective_window(causal, window)
    if Nq == 0 or B * Hq == 0:
        return
    kern = ln.jitted(make(d, dtype))
    grid = (max(1, -(-Nq // cfg.block_q)), B * Hq)
    kern[grid, cfg.threads, stream](q, k, v, o, lse, acc_dtype(dtype)(scale), left, right)


def attention(q, k, v, *, causal=False, scale=None, window=None, config):
    """The forward launcher (v1 to v4): (o, lse) of the kind and dtype given (LSE in the
    accumulator dtype).  ``config``: a :class:`ForwardConfig` naming its version (the registry
    resolves the default)."""
    return call_forward(launch, q, k, v, causal=causal, scale=scale, window=window, config=config)


def call_forward(launch_fn, q, k, v, *, causal, scale, window, config):
    """What every forward version's public launcher does around its ``launch_fn``: check the
    arguments, resolve the config, bring the inputs to the device, allocate O and LSE, launch on
    the caller's stream; (o, lse) of the caller's kind."""
    call = ln.call_for(q)
    for name, x in (("k", k), ("v", v)):
        call.check(x, name)
    dtype = ln.check_dtype(q, "q")
    B, Hq, Nq, d = (int(x) for x in q.shape)
    cfg = config.resolved(d, dtype)
    scale, window = cv.resolve_scale(scale, d), cv.resolve_window(window)
    dq, dk, dv = (ln.device_in(call, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    o_h, o_d = ln.empty(call, (B, Hq, Nq, d), dtype)
    lse_h, lse_d = ln.empty(call, (B, Hq, Nq), acc_dtype(dtype))
    launch_fn(cfg, dq, dk, dv, o_d, lse_d, causal=causal, scale=scale, window=window, stream=ln.stream(call))
    return call.finish(o_h, dtype), call.finish(lse_h, np.dtype(acc_dtype(dtype)).name)
