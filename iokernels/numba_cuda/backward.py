"""FlashAttention-2's backward in Numba CUDA: recompute S and P from the saved LSE, tile by tile.

Read this next to :func:`iokernels.backward.attention_backward_tiled`, which it mirrors
loop for loop: the NumPy loop over K/V tiles becomes the grid, the loop over Q tiles stays
a loop inside one thread block.

Notation (FlashAttention-2, Algorithm 2):

=========  ==========================================================================
Br, Bc     query rows per Q tile, key rows per K/V tile (``block_q``, ``block_k``)
D_i        rowsum(dO_i * O_i): one number per query row (the preprocessing kernel)
S_ij       scale * Q_i K_j^T, recomputed;  P_ij = exp(S_ij - LSE_i) (0 where masked)
dP_ij      dO_i V_j^T;   dS_ij = P_ij * (dP_ij - D_i)
dV_j       sum_i P_ij^T dO_i;  dK_j = scale * sum_i dS_ij^T Q_i  (per thread, registers)
dQ_i       scale * sum_j dS_ij K_j: a sum over K/V tiles, i.e. over thread blocks
=========  ==========================================================================

Three kernels:

1. ``D = rowsum(dO * O)``: one thread per query row.
2. The main loop: one thread block per (K/V tile j, KV head, sequence).  Thread c of the
   block owns key row c of the tile: its dK_c and dV_c accumulate in registers over every
   query head of the GQA group and every Q tile (so dK, dV are summed over the group with
   no atomics, and written once).  Per Q tile: load Q_i, dO_i, LSE_i, D_i -> SRAM; each
   thread recomputes its column of S_ij and P_ij, sums the tile's Br contributions to dV_c
   and dK_c apart and then adds them in (two-level sums: in float32 a single running sum
   over all N query rows loses more bits than the naive backward's blocked matmuls), and
   leaves its column of dS_ij in SRAM; then the block computes dS_ij K_j (one thread per
   element of dQ_i) and adds it to dQ.
3. dQ as the caller's dtype.

dQ is where the thread blocks meet: every K/V tile adds to every dQ_i it sees.  Two modes:

* **atomic** (the default): each block adds its dS_ij K_j into a float32 (float64)
  ``dQaccum`` with atomic adds, as FlashAttention-2 does.  The order of the additions
  depends on which block gets there first, so dQ can differ in its last bits from run to
  run: fast, not bitwise reproducible.
* **deterministic**: each block writes its dS_ij K_j to its own slot of a (Tc, ...)
  partial buffer, and kernel 3 sums the slots in tile order: the same bits every run, for
  Tc times the dQ bytes written and read.

Causal and windowed masks skip whole Q tiles a K/V tile cannot see (the bottom-right
diagonal bounds the visible rows), and mask the partial tiles element by element.  A
fully masked query row (LSE = -inf) contributes nothing: P = 0 there, never NaN.

Versions: ``v1`` is this structure, readable first: one thread per key row for the
recomputation (so Br x Bc scores cost Br dot products of d per thread) and one thread per
dQ element for dS K.  It is simple, not fast: no register tiling, no tensor cores (Numba
exposes none), every product reads shared memory.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core import arrays
from ..core import conventions as cv
from ..core import gpu
from ..core.registry import Need
from .config import BACKWARD_THREADS, BackwardConfig, SHARED_LIMIT_BYTES  # noqa: F401

gpu.numba_numpy_fix()
from numba import cuda  # noqa: E402

#: threads of the two row-wise kernels (D, and dQ's cast / reduction)
ROW_THREADS = 128
BACKWARD_DTYPES = ("float16", "float32", "float64")


# --------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _visible(i, j, Nq, Nk, left, right):
    """Query row i sees key j (bottom-right aligned; left/right the effective window)."""
    diag = i + Nk - Nq
    if left >= 0 and j < diag - left:
        return False
    if right >= 0 and j > diag + right:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _make_kernels(D: int, BR: int, BC: int, acc_name: str, deterministic: bool):
    acc = np.dtype(acc_name).type
    NT = BACKWARD_THREADS

    @cuda.jit
    def rowsum_kernel(do, o, dvec):
        """Kernel 1: D_i = rowsum(dO_i * O_i), one thread per row of (B, Hq, Nq)."""
        B, Hq, Nq = dvec.shape
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t >= B * Hq * Nq:
            return
        b = t // (Hq * Nq)
        h = (t // Nq) % Hq
        i = t % Nq
        s = acc(0)
        for x in range(D):                                   # read dO_i, O_i -> registers
            s += acc(do[b, h, i, x]) * acc(o[b, h, i, x])
        dvec[b, h, i] = s                                    # write D_i -> HBM

    @cuda.jit
    def main_kernel(q, k, v, do, lse, dvec, dk, dv, dq_acc, scale, left, right):
        """Kernel 2: block (j, kv head, sequence); thread c owns key row c of K/V tile j."""
        B, Hq, Nq, _ = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        g = Hq // Hkv
        j0 = cuda.blockIdx.x * BC
        hk = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        Qs = cuda.shared.array((BR, D), acc)
        dOs = cuda.shared.array((BR, D), acc)
        Ks = cuda.shared.array((BC, D), acc)
        Vs = cuda.shared.array((BC, D), acc)
        dSs = cuda.shared.array((BR, BC), acc)
        Ls = cuda.shared.array(BR, acc)
        Ds = cuda.shared.array(BR, acc)
        dk_c = cuda.local.array(D, acc)                      # dK_c, dV_c: registers
        dv_c = cuda.local.array(D, acc)
        dk_t = cuda.local.array(D, acc)                      # this Q tile's share of them
        dv_t = cuda.local.array(D, acc)
        for x in range(D):
            dk_c[x] = 0
            dv_c[x] = 0
        nk_tile = min(BC, Nk - j0)
        for e in range(tid, BC * D, NT):                     # load K_j, V_j -> SRAM
            c, x = e // D, e % D
            if c < nk_tile:
                Ks[c, x] = k[b, hk, j0 + c, x]
                Vs[c, x] = v[b, hk, j0 + c, x]
            else:
                Ks[c, x] = 0
                Vs[c, x] = 0
        # the query rows that can see some key of this tile: [i_lo, i_hi) (diagonal bounds)
        i_lo = 0
        i_hi = Nq
        if right >= 0:
            i_lo = max(0, j0 - right - (Nk - Nq))
        if left >= 0:
            i_hi = min(Nq, j0 + nk_tile - 1 + left - (Nk - Nq) + 1)
        cuda.syncthreads()
        for hh in range(g):                                  # the query heads of this KV head's group
            h = hk * g + hh
            t0 = (i_lo // BR) * BR
            for i0 in range(t0, i_hi, BR):                   # loop over Q tiles i
                nq_tile = min(BR, Nq - i0)
                for e in range(tid, BR * D, NT):             # load Q_i, dO_i -> SRAM
                    r, x = e // D, e % D
                    if r < nq_tile:
                        Qs[r, x] = q[b, h, i0 + r, x]
                        dOs[r, x] = do[b, h, i0 + r, x]
                    else:
                        Qs[r, x] = 0
                        dOs[r, x] = 0
                for r in range(tid, BR, NT):                 # load LSE_i, D_i -> SRAM
                    if r < nq_tile:
                        Ls[r] = lse[b, h, i0 + r]
                        Ds[r] = dvec[b, h, i0 + r]
                    else:
                        Ls[r] = -math.inf
                        Ds[r] = 0
                cuda.syncthreads()
                if tid < BC:                                 # thread c: column c of S, P, dP, dS
                    c = tid
                    for x in range(D):
                        dk_t[x] = 0
                        dv_t[x] = 0
                    for r in range(BR):
                        p = acc(0)
                        if c < nk_tile and r < nq_tile and Ls[r] != -math.inf and \
                                _visible(i0 + r, j0 + c, Nq, Nk, left, right):
                            s = acc(0)
                            for x in range(D):
                                s += Qs[r, x] * Ks[c, x]
                            p = math.exp(s * scale - Ls[r])   # P_ij, recomputed from LSE
                        dp = acc(0)
                        for x in range(D):
                            dp += dOs[r, x] * Vs[c, x]       # dP_ij = dO_i . V_j
                        ds = p * (dp - Ds[r])                # dS_ij
                        dSs[r, c] = ds
                        for x in range(D):
                            dv_t[x] += p * dOs[r, x]         # dV_j += P^T dO
                            dk_t[x] += ds * Qs[r, x]         # dK_j += dS^T Q (scale at the end)
                    for x in range(D):                       # two-level sums: a tile's Br rows,
                        dv_c[x] += dv_t[x]                   # then the tiles, so the rounding
                        dk_c[x] += dk_t[x]                   # grows with Br + Tr, not N
                cuda.syncthreads()
                for e in range(tid, BR * D, NT):             # dQ_i += scale * dS_ij K_j
                    r, x = e // D, e % D
                    if r < nq_tile:
                        s = acc(0)
                        for c in range(BC):
                            s += dSs[r, c] * Ks[c, x]
                        if deterministic:
                            dq_acc[cuda.blockIdx.x, b, h, i0 + r, x] = s * scale   # write partial -> HBM
                        else:
                            cuda.atomic.add(dq_acc, (b, h, i0 + r, x), s * scale)  # add -> HBM
                cuda.syncthreads()
        if tid < nk_tile:                                    # write dK_j, dV_j -> HBM, once
            for x in range(D):
                dk[b, hk, j0 + tid, x] = dk_c[x] * scale
                dv[b, hk, j0 + tid, x] = dv_c[x]

    @cuda.jit
    def finish_kernel(dq_acc, dq, tiles):
        """Kernel 3: dQ in the caller's dtype; deterministic mode sums the partials in order."""
        B, Hq, Nq, _ = dq.shape
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t >= B * Hq * Nq * D:
            return
        x = t % D
        i = (t // D) % Nq
        h = (t // (D * Nq)) % Hq
        b = t // (D * Nq * Hq)
        if deterministic:
            s = acc(0)
            for jt in range(tiles):                          # tile order: the same bits every run
                s += dq_acc[jt, b, h, i, x]
            dq[b, h, i, x] = s
        else:
            dq[b, h, i, x] = dq_acc[b, h, i, x]

    return rowsum_kernel, main_kernel, finish_kernel


# --------------------------------------------------------------------------- launcher
def _numba_view(x):
    """A Numba device view of a device object (no copy, no host synchronisation)."""
    if type(x).__module__.split(".")[0] == "numba":
        return x
    return cuda.as_cuda_array(x, sync=False)


def need(q, k=None, v=None) -> Need:
    return Need(dtype=cv.dtype_name(q), head_dim=int(q.shape[-1]), simulator=gpu.simulator_enabled())


def check(n: Need) -> str | None:
    if n.dtype not in BACKWARD_DTYPES:
        return (f"{n.dtype} is not supported (the Numba kernels are written for float16/32/64 only; "
                "use float16 or float32)")
    return None


def attention_backward(do, q, k, v, o, lse, *, causal, scale, window, config=None):
    """(dq, dk, dv) of the kind and dtype given; dK, dV summed over each GQA group."""
    call = arrays.Call(q, upload="numba")
    for name, x in (("do", do), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        call.check(x, name)
    dtype = cv.dtype_name(q)
    why = check(need(q))
    if why:
        raise ValueError(f"q: {why}")
    B, Hq, Nq, d = (int(s) for s in q.shape)
    Hkv, Nk = int(k.shape[1]), int(k.shape[2])
    cfg = (config or BackwardConfig()).resolved(d, dtype)
    left, right = cv.effective_window(bool(causal), window)
    acc_name = cv.accum_dtype(dtype).name
    acc = np.dtype(acc_name).type
    rowsum, main, finish = _make_kernels(d, cfg.block_q, cfg.block_k, acc_name, cfg.deterministic)
    stream = call.stream_ptr()
    st = cuda.external_stream(stream) if stream else 0
    dev = [_numba_view(call.to_device(x, n)) for x, n in ((q, "q"), (k, "k"), (v, "v"), (do, "do"),
                                                          (o, "o"), (lse, "lse"))]
    qd, kd, vd, dod, od, lsed = dev
    dq_out, dk_out, dv_out = (call.empty(s, dtype) for s in ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d)))
    dvec = call.empty((B, Hq, Nq), acc_name)
    tiles = -(-Nk // cfg.block_k)
    acc_shape = (tiles, B, Hq, Nq, d) if cfg.deterministic else (B, Hq, Nq, d)
    dq_acc = call.empty(acc_shape, acc_name)
    dqa, dqv, dkv, dvv, dvecv = (_numba_view(x) for x in (dq_acc, dq_out, dk_out, dv_out, dvec))
    rows = B * Hq * Nq
    _zero(dqa, st)                  # atomic adds start from 0; skipped (masked) tiles' partials read as 0
    if rows and d:
        rowsum[-(-rows // ROW_THREADS), ROW_THREADS, st](dod, od, dvecv)
    if B * Hkv * Nk and d:
        if rows == 0:
            _zero(dkv, st)
            _zero(dvv, st)
        else:
            main[(tiles, Hkv, B), BACKWARD_THREADS, st](qd, kd, vd, dod, lsed, dvecv, dkv, dvv, dqa,
                                                        acc(scale), left, right)
    if rows and d:
        finish[-(-(rows * d) // ROW_THREADS), ROW_THREADS, st](dqa, dqv, tiles)
    return call.finish(dq_out, dtype), call.finish(dk_out, dtype), call.finish(dv_out, dtype)


@functools.lru_cache(maxsize=None)
def _zero_kernel():
    @cuda.jit
    def zero(flat):
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t < flat.size:
            flat[t] = 0
    return zero


def _zero(x, stream):
    """Fill a contiguous device array with zeros on ``stream`` (the allocators hand out
    uninitialised memory)."""
    flat = x.reshape(x.size) if x.size else x
    if x.size:
        _zero_kernel()[-(-x.size // ROW_THREADS), ROW_THREADS, stream](flat)
