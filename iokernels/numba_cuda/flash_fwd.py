"""FlashAttention forward in Numba CUDA: three versions, each mirroring iokernels.tiled.

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
=======  =========================================================================

The grid: ``(Tr, batch * heads_q)``; thread block (x, y) owns query tile x of
(sequence, query head) y and reads K/V head ``h // (heads_q // heads_kv)`` (GQA/MQA).

The versions (``NumbaConfig(version=...)``):

* **v1** one thread per query row; each thread reads the K and V rows it needs straight
  from global memory (HBM, through the caches).  No shared memory, no ``syncthreads``.
  Counted traffic: every row reads its visible keys itself, so K and V are read about Br
  times more than FlashAttention's model (the caches absorb part of that on a GPU).
* **v2** block-cooperative, the FlashAttention-2 loop order exactly: the Br threads of a
  block load K_j and V_j into shared memory together, ``syncthreads``, then each thread
  folds the tile into its row's (m, l, O).  Counted traffic == ``traffic.model("fa2")``.
  Still one thread per row: the row's q and O (2d values) sit in per-thread local arrays,
  which spill out of registers for d = 128, and every multiply-add reads one value from
  shared memory (one load per FMA): it is bound by shared-memory bandwidth.
* **v3** several threads per row and several rows per thread (register tiling): a row is
  shared by ``threads_per_row`` lanes of one warp, each owning d / lanes of its dims, and
  each thread keeps ``rows_per_thread`` rows, so one value read from shared memory feeds
  ``rows_per_thread`` multiply-adds.  The lanes of a row add their partial dot products
  with warp shuffles (``shfl_xor_sync``).  Keys are folded ``KEYS_PER_STEP`` at a time
  (the online softmax rescales once per step, which is the same recurrence with smaller
  tiles).  Counted traffic == ``traffic.model("fa2")`` with its Br and Bc.
* **v4** (the default) v3 with a step of ``V4_KEYS_PER_STEP`` = 4 keys and batched lane
  sums.  What changed: NVVM does not unroll v3's 8-key step, so the step's scores live in
  local memory (PTX: 33 local loads/stores a step, ptxas: 233 registers, 128-byte stack
  frame); a 4-key step whose R x 4 partial dot products go through one butterfly together
  is unrolled (PTX: no local memory, 254 registers, no stack frame, sm_90), and the
  butterfly's 3 x 16 shuffles are independent of each other, so they overlap instead of
  waiting in a chain.  The price: the online softmax rescales O every 4 keys instead of 8.
  Occupancy stays at ~8 warps an SM (2 blocks of 128 threads at ~250 registers).  A
  2-key step without batching (tried first) was also free of local memory but only 4%
  faster than v3 (0.24x SDPA EFFICIENT in the 11:53 UTC run); the batched 4-key step
  reached 0.272x in a sweep at 12:26 UTC (0.271x in the 12:47 record).  Counted traffic == v3's.
* v3 and v4 add a tile's probabilities up apart (``l_j``) and add that into the row sum
  l once per K/V tile: added one step at a time, N/4 float32 terms made the LSE error
  at N = 8192 about 2e-6 (the 2x rule allows ~1.2e-6 there); N/Bc additions keep it
  near 5e-7, which is how FlashAttention sums too (a tile's row sum, then l).

Measured on an H200 (float32, B=8, H=16, N=4096, d=128, non-causal; torch SDPA EFFICIENT
46.7 TFLOP/s in the same run, 2026-11-29 12:47 UTC; benchmarks/results/h200_2026-11-29.json,
details in :mod:`iokernels.numba_cuda`):

======  ============  ============  ==============================================
v1      2.8 TFLOP/s   0.060x SDPA   K/V re-read per row (L1/L2 absorb part of it)
v2      7.1 TFLOP/s   0.152x        one shared-memory load per FMA; q, O spill
v3     10.7 TFLOP/s   0.229x        R = 4 FMAs per shared load; shuffle sums
v4     12.7 TFLOP/s   0.271x        4-key step in registers, batched butterflies
======  ============  ============  ==============================================

The simulator (no GPU) has no warp shuffles: there v3's lane sum goes through shared
memory and ``syncthreads`` (:func:`_make_lane_sum`); the arithmetic is the same, the
order of the additions of the lanes' partial sums differs.

``buggy_skip_sync=True`` (teaching only, used by notebook 05) removes v2's
``syncthreads`` after the K_j/V_j load, the classic shared-memory race.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..core import conventions as cv
from ..core import gpu
from . import _arrays as arr
from numba import cuda, int32  # noqa: E402  (after the NumPy fix, through _arrays)
import numba  # noqa: E402

#: Static shared memory a thread block may use without an opt-in: 48 KiB on every CUDA GPU
#: (more needs dynamic shared memory and cudaFuncSetAttribute, which these kernels avoid).
SHARED_LIMIT_BYTES = 48 * 1024
#: keys folded into the online softmax at once by v3 (its scores for them stay in registers).
KEYS_PER_STEP = 8
#: v4's step: 4 keys, their lane sums batched.  NVVM fully unrolls a step this small, so
#: the scores of the step are indexed by constants and stay in registers (v3's 8-key step
#: is not unrolled: its PTX has 33 local-memory loads/stores, v4's has none; checked by
#: tests/test_numba_ptx.py).
V4_KEYS_PER_STEP = 4
#: a warp: lanes that share a row in v3 must sit in one warp for the shuffles.
WARP_SIZE = 32
#: every lane of the warp takes part in each shuffle.
FULL_MASK = 0xFFFFFFFF
#: the most threads a CUDA thread block may have.
MAX_THREADS = 1024


def _acc_types(dtype: str):
    """(NumPy accumulator dtype, Numba accumulator type) for a storage dtype."""
    if dtype == "float64":
        return np.float64, numba.float64
    return np.float32, numba.float32


# --------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class NumbaConfig:
    """Launch shape of the Numba FlashAttention forward.

    version: 1, 2, 3 or 4 (see the module docstring; 4, the fastest measured, is the default);
    block_q (Br), block_k (Bc): tile rows, None for the version's default; threads_per_row,
    rows_per_thread: v3/v4's register tiling (v1 and v2 use one thread per row);
    batched_lane_sums: v3/v4 sum the lanes' partial dot
    products of a whole step of keys in one butterfly (True) or key by key (False); None:
    the version's choice (v4 batched, v3 key by key).
    step_keys: keys per online-softmax step of v3/v4 (None: the version's, 8 or 2).
    ``buggy_skip_sync`` is for the notebook's race demo.
    """

    version: int = 4
    block_q: int | None = None
    block_k: int | None = None
    threads_per_row: int = 8
    rows_per_thread: int = 4
    batched_lane_sums: bool | None = None
    step_keys: int | None = None
    buggy_skip_sync: bool = False

    def __post_init__(self):
        if self.version not in (1, 2, 3, 4):
            raise ValueError(f"config: version must be 1, 2, 3 or 4, got {self.version!r}")
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"config: {name} must be None or a positive integer, got {v!r}")
        L, R = self.threads_per_row, self.rows_per_thread
        if not isinstance(L, int) or L < 1 or L > WARP_SIZE or WARP_SIZE % L:
            raise ValueError(f"config: threads_per_row must divide {WARP_SIZE} (lanes of one warp), got {L!r}")
        if not isinstance(R, int) or R < 1:
            raise ValueError(f"config: rows_per_thread must be a positive integer, got {R!r}")
        if self.step_keys is not None and (isinstance(self.step_keys, bool) or not isinstance(self.step_keys, int)
                                           or self.step_keys < 1):
            raise ValueError(f"config: step_keys must be None or a positive integer, got {self.step_keys!r}")
        if self.buggy_skip_sync and self.version != 2:
            raise ValueError("config: buggy_skip_sync is a v2 teaching flag (version=2)")

    def replace(self, **changes) -> "NumbaConfig":
        return replace(self, **changes)

    def resolved(self, head_dim: int, dtype: str) -> "NumbaConfig":
        """Fill in the version's default tiles for this head_dim and dtype, and check them."""
        acc = np.dtype(_acc_types(dtype)[0]).itemsize
        br, bc = self.block_q, self.block_k
        if br is None:
            br = 64
        if bc is None:  # the largest power of two <= 32 whose K_j, V_j tiles fit
            bc = 32
            while bc > KEYS_PER_STEP and 2 * bc * self._dpad(head_dim) * acc > SHARED_LIMIT_BYTES:
                bc //= 2
        cfg = self.replace(block_q=br, block_k=bc)
        cfg.check(head_dim, dtype)
        return cfg

    @property
    def keys_per_step(self) -> int:
        """Keys per online-softmax step of v3 / v4 (before clipping to block_k)."""
        if self.step_keys is not None:
            return self.step_keys
        return V4_KEYS_PER_STEP if self.version == 4 else KEYS_PER_STEP

    def _dpad(self, head_dim: int) -> int:
        if self.version >= 3:
            return -(-head_dim // self.threads_per_row) * self.threads_per_row
        return head_dim

    @property
    def batched(self) -> bool:
        """Whether v3/v4 sum a step's partial dot products in one butterfly."""
        if self.batched_lane_sums is not None:
            return bool(self.batched_lane_sums)
        return self.version == 4

    @property
    def threads(self) -> int:
        """Threads per block: Br for v1 and v2; Br / rows_per_thread * threads_per_row for v3, v4."""
        if self.version >= 3:
            return self.block_q // self.rows_per_thread * self.threads_per_row
        return self.block_q

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        """Static shared memory of one block on a GPU: the K_j and V_j tiles (v2, v3) in the
        accumulator dtype (v3's rows padded to a multiple of threads_per_row)."""
        if self.version == 1:
            return 0
        acc = np.dtype(_acc_types(dtype)[0]).itemsize
        return 2 * self.block_k * self._dpad(head_dim) * acc

    def check(self, head_dim: int, dtype: str) -> None:
        if self.block_q is None or self.block_k is None:
            raise ValueError("config: block_q and block_k must be resolved (call .resolved)")
        if self.version >= 3:
            v, ch = self.version, self.keys_per_step
            if self.block_q % self.rows_per_thread:
                raise ValueError(f"config: block_q ({self.block_q}) must be a multiple of rows_per_thread "
                                 f"({self.rows_per_thread}) for version {v}")
            if self.threads % WARP_SIZE and self.threads > WARP_SIZE:
                raise ValueError(f"config: version {v} needs whole warps; {self.threads} threads")
            if self.block_k % min(ch, self.block_k):
                raise ValueError(f"config: block_k ({self.block_k}) must be a multiple of {ch} for version {v}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"config: {self.threads} threads per block, more than CUDA's {MAX_THREADS}")
        need = self.shared_bytes(head_dim, dtype)
        if need > SHARED_LIMIT_BYTES:
            raise ValueError(f"config: version {self.version} tiles Br={self.block_q}, Bc={self.block_k} at "
                             f"head_dim={head_dim} ({dtype}) need {need:,} B of shared memory, more than the "
                             f"{SHARED_LIMIT_BYTES:,} B static limit")


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


def warp_mask(threads: int) -> int:
    """The lanes that exist in a block's (first) warp: all 32, or fewer for a tiny block."""
    return FULL_MASK if threads >= WARP_SIZE else (1 << threads) - 1


def _make_lane_sum(L: int, R: int, simulated: bool, mask: int = FULL_MASK):
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
    lane_sum = _make_lane_sum(L, R, simulated, warp_mask(NT))
    lane_sum_step = _make_lane_sum(L, R * CH, simulated, warp_mask(NT))

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
def kernel_function(cfg: NumbaConfig, head_dim: int, dtype: str, simulated: bool | None = None):
    """The Python function of the kernel ``cfg`` selects (before ``cuda.jit``); for PTX tests."""
    cfg = cfg.resolved(head_dim, dtype)
    acc_name = np.dtype(_acc_types(dtype)[0]).name
    if simulated is None:
        simulated = gpu.simulator_enabled()
    if cfg.version == 1:
        return make_v1(head_dim, cfg.block_q, cfg.block_k, acc_name)
    if cfg.version == 2:
        return make_v2(head_dim, cfg.block_q, cfg.block_k, acc_name, cfg.buggy_skip_sync)
    return make_v3(head_dim, cfg.block_q, cfg.block_k, cfg.threads_per_row, cfg.rows_per_thread,
                   acc_name, simulated, cfg.batched, cfg.keys_per_step)


@functools.lru_cache(maxsize=None)
def _jitted(pyfunc):
    return cuda.jit(pyfunc)


def resolve_config(config, head_dim: int, dtype: str) -> NumbaConfig:
    if config is None:
        config = NumbaConfig()
    if not isinstance(config, NumbaConfig):
        raise ValueError(f"config: expected an iokernels.numba_cuda.NumbaConfig or None, got "
                         f"{type(config).__name__}")
    return config.resolved(head_dim, dtype)


def launch(cfg: NumbaConfig, q, k, v, o, lse, *, causal, scale, window, stream=0):
    """Launch the forward on device (or counting) arrays already allocated, on ``stream``
    (:func:`._arrays.stream_of`); returns nothing."""
    B, Hq, Nq, d = q.shape
    dtype = str(np.dtype(o.dtype))
    acc_t = _acc_types(dtype)[0]
    left, right = cv.effective_window(causal, window)
    kern = _jitted(kernel_function(cfg, d, dtype))
    grid = (max(1, -(-Nq // cfg.block_q)), B * Hq)
    if Nq == 0 or B * Hq == 0:
        return
    kern[grid, cfg.threads, stream](q, k, v, o, lse, acc_t(scale), left, right)


def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """The public backend function: (o, lse) of the kind and dtype given (LSE float32/64)."""
    kind = arr.check_kinds(q=q, k=k, v=v)
    dtype = arr.check_dtype(q, "q")
    B, Hq, Nq, d = (int(x) for x in q.shape)
    cfg = resolve_config(config, d, dtype)
    scale, window = cv.resolve_scale(scale, d), cv.resolve_window(window)
    acc_t = _acc_types(dtype)[0]
    dq, dk, dv = (arr.to_device(x, kind) for x in (q, k, v))
    o_h, o_d = arr.empty(kind, q, (B, Hq, Nq, d), dtype)
    lse_h, lse_d = arr.empty(kind, q, (B, Hq, Nq), acc_t)
    launch(cfg, dq, dk, dv, o_d, lse_d, causal=causal, scale=scale, window=window,
           stream=arr.stream_of(kind, q))
    return arr.finish(kind, o_h), arr.finish(kind, lse_h)
