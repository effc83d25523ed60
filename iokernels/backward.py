"""Step 2b: the attention backward pass, naive (materialized) and FlashAttention-2 (tiled).

Training needs the gradients of a loss with respect to Q, K and V, given dO = dLoss/dO.
The forward keeps only O and the per-row log-sum-exp LSE (N_q numbers per head, not an
N_q x N_k matrix): from Q, K and LSE the backward can rebuild any tile of the
probabilities exactly, P_ij = exp(S_ij - LSE_i), when it needs it.  Recomputing S costs
one extra matmul; storing P would cost N_q x N_k memory per head and two trips of it
through HBM (FlashAttention, Dao et al., 2022, section 3.1; FlashAttention-2, Dao, 2023).

Notation (per batch entry b and query head h; tiles as in :mod:`iokernels.core.config`):

=========  ================================================================
N_q, N_k   query rows (seqlen_q), key rows (seqlen_k);  d  head_dim
Br, Bc     query rows per tile (block_q), key rows per tile (block_k)
Tr, Tc     number of query tiles ceil(N_q / Br), key tiles ceil(N_k / Bc)
Q_i        rows i*Br .. (i+1)*Br of Q; likewise dO_i, O_i, dQ_i, LSE_i, D_i
K_j, V_j   rows j*Bc .. (j+1)*Bc of K, V; likewise dK_j, dV_j
S_ij       scale * Q_i K_j^T, masked entries -inf             (Br x Bc, on chip)
P_ij       exp(S_ij - LSE_i): the forward's probabilities      (Br x Bc, on chip)
dP_ij      dO_i V_j^T                                          (Br x Bc, on chip)
D_i        rowsum(dO_i * O_i)  (elementwise product, summed over d)
dS_ij      P_ij * (dP_ij - D_i)                                (Br x Bc, on chip)
LSE_i      log sum_j exp(S_ij) over visible keys (natural log)
g          query heads per KV head (GQA/MQA), heads_q // heads_kv
=========  ================================================================

The equations (O = P V, P = softmax(S), S = scale * Q K^T):

    dV = P^T dO            dP = dO V^T
    dS = P * (dP - D)      with D_i = sum_j P_ij dP_ij = dO_i . O_i
    dQ = scale * dS K      dK = scale * dS^T Q

The softmax's Jacobian gives dS_ij = P_ij (dP_ij - sum_l P_il dP_il).  The row sum
sum_l P_il dP_il equals dO_i . (P V)_i = dO_i . O_i, so it can be computed *before* the
main loop from dO and O alone (N_q*d reads each), instead of needing a whole row of P
and dP: that is what makes the tiled backward possible.  With GQA the K and V of a KV
head are shared by g query heads, so dK and dV are summed over the group.

The two versions
----------------

v1 :func:`attention_backward_naive` -- the standard backward as separate kernels, each
   a full-matrix operation that reads its inputs from HBM and writes its result back.
   It materializes **P, dP and dS** (each B x Hq x N_q x N_k) in HBM, in the input
   dtype; it never stores S (P is rebuilt in one kernel from Q, K and LSE, step 1
   below).  In a framework's autograd P would have been saved by the forward instead;
   our API hands the backward only O and LSE, so v1 writes P itself: the same N_q*N_k
   write the forward would have made.  Traffic (counted = modelled; one head, N = 4096,
   fp16): 274.8 MB at d = 64, 281.1 MB at d = 128, causal or not.

v2 :func:`attention_backward_tiled` -- FlashAttention-2's backward: D first, then K/V
   tiles in the outer loop (one GPU thread block per (b, kv head, j)), Q/dO/LSE/D tiles
   streamed through the inner loop, S_ij and P_ij recomputed on chip, dK_j and dV_j
   accumulated on chip and written once, dQ accumulated in HBM by read-modify-writes.
   No N_q x N_k array exists at any time (tests bound the allocation peak).  Traffic
   (same problem, default tiles 64 x 128 at d = 64, 16 x 128 at d = 128): 107.5 MB at
   d = 64 (2.6x less than v1), 213.9 MB at d = 128 (1.3x less); causal 58.2 MB and
   115.9 MB (4.7x and 2.4x less).  Errors (113 x 203, d = 59, GQA, causal): float64
   ~1.5e-15 against the analytic gradients; float32 and float16 errors 0.4-1.1x v1's
   in the same precision (the rule allows 3x).  See notebooks/04_backward.

The GPU kernels' bytes
----------------------

The CUDA kernels (Numba and CuPy) run v2's loops with the GPU's own tiles, as three kernels
after a fill that zeroes dQaccum; :func:`traffic_model_gpu_kernels` gives each kernel's
bytes as written (``traffic.model("gpu_backward", ...)`` their sum), and
``scripts/profile_traffic.py`` holds them against the DRAM bytes Nsight Compute measures.

Why dQ is accumulated in HBM, and why that makes dQ nondeterministic on a GPU
-----------------------------------------------------------------------------

Each K/V tile j owns dK_j and dV_j (only its own key rows contribute to them), so they
live on chip for the whole inner loop and are written once.  dQ_i is the opposite: it
is a sum over *all* key tiles, dQ_i = scale * sum_j dS_ij K_j, and each term is
produced by a different K/V tile, i.e. on a GPU by a different thread block running at
the same time.  They cannot each hold dQ_i on chip, so each adds its term into a
float32 buffer in HBM (FlashAttention-2's ``dq_accum``); a final pass multiplies by the
scale and converts to the input dtype.  Concurrent blocks adding to the same address
must use atomic adds (``atomicAdd``), or the updates would overwrite each other.  The
atomics make the result correct but not bitwise reproducible: floating-point addition
is not associative, and the order in which thread blocks reach the atomic differs from
run to run, so dQ differs in its last bits between identical runs, while dK and dV
(owned by one block each) do not.  FlashAttention offers a ``deterministic`` backward
that fixes the order at some cost in speed; another way out is a second kernel with
Q tiles outer that recomputes P once more to produce dQ without atomics.  This NumPy
version runs its loops one after another, so it is deterministic; the counted
read-modify-writes of ``dQaccum`` are exactly the traffic the atomics cause.

Precision: matmul operands are the input dtype (as tensor cores take them), products
and sums are accumulated in float32 (float64 for float64 inputs).  P_ij and dS_ij are
rounded to the input dtype before they enter the matmuls that consume them, as a
GPU kernel must do to feed fp16 tensor cores.  D, LSE and dQaccum are kept in the
accumulator dtype; dQ, dK, dV are returned in the input dtype.  The LSE passed in is
converted to the accumulator dtype first (the forward already produces it so).

Fully masked query rows (LSE = -inf) get P = 0, so their dQ is exactly 0 and they add
nothing to dK, dV; keys no query sees get dK = dV = 0.  Never NaN.

Frank notes: v2 is a Python loop over tiles; on a CPU it is much slower than v1 for
small N (many small matmuls instead of a few large ones).  It exists to show the
memory traffic and the algorithm, not to be fast.  Its traffic is not free either:
Q_i, dO_i, LSE_i, D_i and the dQaccum read-modify-write stream past every K/V tile, so
the tiled backward is Theta(N^2 d^2 / M) like the forward, not Theta(N d).  Per visible
(query, key) entry, fp16 inputs, no caches: v1 moves 16 bytes (P written once and read
twice, dP written and read, dS written and read twice: 8 touches of 2 bytes); v2 moves
(12 d + 8) / Bc bytes (Q and dO rows 2d bytes each, LSE and D 4 each, the float32
dQaccum row read and written 8d).  The ratio, about 4 Bc / (3 d), does not grow with N:
1.3x at d = 128, Bc = 128, 2.7x at d = 64 (causal masks double it by skipping tiles).
The large, N-dependent win of recomputation is memory (P is N^2 per head, LSE is N),
and on a GPU the streamed Q/dO/dQaccum tiles are shared by thread blocks that run at
the same time and are largely served by the L2 cache, which this model does not have.
"""
from __future__ import annotations

import math

import numpy as np

from .core import conventions as cv
from .core.config import DEFAULT_SRAM_BYTES, TileConfig
from .core.traffic import HBM, Traffic

__all__ = ["attention_backward_naive", "attention_backward_tiled", "traffic_model_naive",
           "traffic_model_tiled", "traffic_model_gpu", "traffic_model_gpu_kernels",
           "GPU_BACKWARD_KERNELS", "backward_sram_usage", "check_backward_fits",
           "default_backward_config", "resolve_backward_config", "tile_plan", "recompute_flops",
           "memory_footprint", "traffic_vs_seqlen", "counted_traffic_vs_seqlen",
           "finite_difference_grads", "gradient_checks"]

#: The default backward tiles, Br x Bc = 64 x 128: the shape FlashAttention-2's CUDA backward
#: uses at head_dim 128 on GPUs whose blocks may have >= 144 KiB of shared memory.  The
#: backward's traffic falls as Bc grows (Q, dO, LSE, D and dQaccum stream past every K/V
#: tile) and does not depend on Br, so SRAM is spent on Bc first.
DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = 64, 128
#: When the default tiles do not fit, Br is halved first, down to this; then Bc.
MIN_DEFAULT_BLOCK_Q = 16


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


# --------------------------------------------------------------------------- SRAM
def backward_sram_usage(config: TileConfig, head_dim: int, dtype="float32") -> int:
    """Bytes on chip for the backward's tile set, which is larger than the forward's.

    Input dtype: K_j, V_j (Bc x d each) and Q_i, dO_i (Br x d each).
    Accumulator dtype: dK_j, dV_j (Bc x d each, live for the whole inner loop),
    S_ij/P_ij/dS_ij and dP_ij (two Br x Bc tiles), the dQ_i term (Br x d) and LSE_i, D_i.
    """
    st = cv.itemsize_of(_dtype_name(dtype))
    acc = cv.accum_dtype(_dtype_name(dtype)).itemsize
    Br, Bc, d = config.block_q, config.block_k, head_dim
    return (2 * Bc * d + 2 * Br * d) * st + (2 * Bc * d + 2 * Br * Bc + Br * d + 2 * Br) * acc


def check_backward_fits(config: TileConfig, head_dim: int, dtype="float32") -> None:
    """ValueError naming ``config`` when the backward's tile set exceeds config.sram_bytes."""
    need = backward_sram_usage(config, head_dim, dtype)
    if need > config.sram_bytes:
        raise ValueError(
            f"config: backward tiles Br={config.block_q}, Bc={config.block_k} at head_dim={head_dim} "
            f"({_dtype_name(dtype)}) need {need:,} B of SRAM (K_j, V_j, dK_j, dV_j, Q_i, dO_i, "
            f"S/P/dS_ij, dP_ij, dQ_i, LSE_i, D_i), more than sram_bytes={config.sram_bytes:,}")


def default_backward_config(head_dim: int, dtype="float32",
                            sram_bytes: int = DEFAULT_SRAM_BYTES) -> TileConfig:
    """Br x Bc = 64 x 128, shrunk until the backward's tile set fits ``sram_bytes``:
    halve Br down to 16, then Bc, then Br again; once Bc is settled, Br grows back as far
    as it fits (traffic depends on Bc, not on Br)."""
    cfg = TileConfig(block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, sram_bytes=sram_bytes)
    while backward_sram_usage(cfg, head_dim, dtype) > sram_bytes and (cfg.block_q > 1 or cfg.block_k > 1):
        if cfg.block_q > MIN_DEFAULT_BLOCK_Q or cfg.block_k == 1:
            cfg = cfg.replace(block_q=max(1, cfg.block_q // 2))
        else:
            cfg = cfg.replace(block_k=cfg.block_k // 2)
    while cfg.block_q < DEFAULT_BLOCK_Q:                # Bc settled: give Br back what is left
        taller = cfg.replace(block_q=cfg.block_q * 2)
        if backward_sram_usage(taller, head_dim, dtype) > sram_bytes:
            break
        cfg = taller
    check_backward_fits(cfg, head_dim, dtype)
    return cfg


def resolve_backward_config(config, head_dim: int, dtype="float32") -> TileConfig:
    """None -> :func:`default_backward_config`; a TileConfig is checked against its SRAM.

    The backward always runs K/V tiles outer; ``config.loop_order`` is not used here.
    """
    if config is None:
        return default_backward_config(head_dim, dtype)
    if not isinstance(config, TileConfig):
        raise ValueError(f"config: expected a TileConfig or None, got {type(config).__name__}")
    check_backward_fits(config, head_dim, dtype)
    return config


def tile_plan(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, causal=False,
              window=None) -> np.ndarray:
    """(Tr, Tc) array of 'skip' / 'full' / 'partial' for every (Q tile i, K/V tile j).

    The same classification as :func:`iokernels.core.conventions.tile_state` (a test holds them
    equal), computed one Q tile at a time for all K/V tiles at once, from the rows' visible
    key intervals [lo, hi) of :func:`iokernels.core.conventions.key_range`.  The kernel and the
    traffic model both read this plan, so they cannot disagree on what is visited.
    """
    Tr, Tc = math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
    plan = np.full((Tr, Tc), "skip", dtype="<U7")
    c0 = np.arange(Tc) * block_k                        # first key of each K/V tile
    c1 = np.minimum(c0 + block_k, seqlen_k)             # one past its last key
    for i in range(Tr):
        rows = np.arange(i * block_q, min((i + 1) * block_q, seqlen_q))
        lo, hi = (x[:, None] for x in cv.key_range(rows, seqlen_q, seqlen_k, causal, window))
        seen = ((lo < hi) & (lo < c1) & (hi > c0)).any(axis=0)    # some row sees some key of j
        whole = ((lo <= c0) & (hi >= c1)).all(axis=0)             # every row sees all of j
        plan[i] = np.where(~seen, "skip", np.where(whole, "full", "partial"))
    return plan


def _safe_lse(lse_rows):
    """LSE with -inf (fully masked rows) replaced by +inf, so exp(S - LSE) is 0, never NaN."""
    return np.where(np.isneginf(lse_rows), np.inf, lse_rows)


def _mma_operand(x, storage, acc):
    """Round an on-chip accumulator tile to the input dtype, as a tensor-core operand must be."""
    return x.astype(storage).astype(acc) if storage != acc else x


# --------------------------------------------------------------------------- v1: naive
def attention_backward_naive(do, q, k, v, o, lse, *, causal, scale, window, config=None):
    """v1: the standard backward, full matrices P, dP, dS materialized in HBM.

    Returns (dq, dk, dv) in the input dtype.  ``config`` is accepted for the common
    backend signature and ignored (no tiles).  Per (b, h), one kernel a step (0 to 6);
    the per-line comments give each kernel's HBM traffic in elements.
    """
    st = q.dtype                                        # P, dP, dS and gradients stored so
    acc = cv.accum_dtype(st.name)                       # products and sums in this dtype
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    visible = cv.mask(Nq, Nk, causal, window)           # (Nq, Nk) boolean, on chip (free)
    sc = acc.type(scale)

    Q, K, V, O, dO = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V"), HBM(o, "O"), HBM(do, "dO")
    LSE = HBM(np.asarray(lse, dtype=acc), "LSE")
    D = HBM.empty((B, Hq, Nq), acc, "D")
    P = HBM.empty((B, Hq, Nq, Nk), st, "P")
    dP = HBM.empty((B, Hq, Nq, Nk), st, "dP")
    dS = HBM.empty((B, Hq, Nq, Nk), st, "dS")
    dQ = HBM.empty((B, Hq, Nq, d), st, "dQ")
    dK = HBM.empty((B, Hkv, Nk, d), st, "dK")
    dV = HBM.empty((B, Hkv, Nk, d), st, "dV")

    for b in range(B):
        for h in range(Hq):
            hk = cv.kv_head(h, Hq, Hkv)
            first_of_group = h % g == 0                 # writes dK, dV; the others add to them

            # kernel 0: D = rowsum(dO * O)
            do_bh = dO[b, h].astype(acc)                # read Nq*d (dO)
            D[b, h] = np.sum(do_bh * O[b, h].astype(acc), axis=-1)  # read Nq*d (O); write Nq (D)

            # kernel 1: P = exp(scale * Q K^T - LSE), rebuilt (a framework's forward would save it)
            s = Q[b, h].astype(acc) @ K[b, hk].astype(acc).T * sc  # read Nq*d (Q) + Nk*d (K)
            lse_bh = _safe_lse(LSE[b, h])[:, None]      # read Nq (LSE)
            P[b, h] = np.where(visible, np.exp(np.where(visible, s, -np.inf) - lse_bh), 0.0)
            #                                             write Nq*Nk (P), rounded to storage

            # kernel 2: dV = P^T dO
            dv = P[b, h].astype(acc).T @ dO[b, h].astype(acc)  # read Nq*Nk (P) + Nq*d (dO)
            if first_of_group:
                dV[b, hk] = dv                          # write Nk*d (dV)
            else:
                dV[b, hk] = dV[b, hk].astype(acc) + dv  # read + write Nk*d (dV): GQA group sum

            # kernel 3: dP = dO V^T
            dP[b, h] = dO[b, h].astype(acc) @ V[b, hk].astype(acc).T  # read Nq*d + Nk*d; write Nq*Nk

            # kernel 4: dS = P * (dP - D)
            p = P[b, h].astype(acc)                     # read Nq*Nk (P)
            dS[b, h] = p * (dP[b, h].astype(acc) - D[b, h][:, None])  # read Nq*Nk (dP) + Nq (D); write Nq*Nk

            # kernel 5: dQ = scale * dS K
            dQ[b, h] = dS[b, h].astype(acc) @ K[b, hk].astype(acc) * sc  # read Nq*Nk + Nk*d; write Nq*d

            # kernel 6: dK = scale * dS^T Q
            dk = dS[b, h].astype(acc).T @ Q[b, h].astype(acc) * sc  # read Nq*Nk (dS) + Nq*d (Q)
            if first_of_group:
                dK[b, hk] = dk                          # write Nk*d (dK)
            else:
                dK[b, hk] = dK[b, hk].astype(acc) + dk  # read + write Nk*d (dK): GQA group sum
    return dQ.result(), dK.result(), dV.result()


def traffic_model_naive(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                        causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`attention_backward_naive`, tensor by tensor.

    Masks change nothing: every entry of P, dP and dS is computed, stored and read.
    Per query head (elements): P written once, read twice (kernels 2, 4); dP written,
    read once; dS written, read twice (kernels 5, 6).  dK and dV: each query head writes
    its share, the g - 1 later heads of a GQA group read it back first.
    """
    name = _dtype_name(dtype)
    st = cv.itemsize_of(name)
    acc = cv.accum_dtype(name).itemsize
    heads = batch * heads_q                     # one (b, h) pass per query head
    Nq, Nk, d = seqlen_q, seqlen_k, head_dim
    nn = heads * Nq * Nk * st                   # one N_q x N_k matrix of every head, in bytes
    qd = heads * Nq * d * st                    # one N_q x d matrix of every head
    kd = heads * Nk * d * st                    # one N_k x d matrix, once per query head
    rmw = batch * (heads_q - heads_kv) * Nk * d * st  # GQA group sums (read back before adding)
    t = Traffic()
    t.add("Q", read=2 * qd)                     # kernels 1, 6
    t.add("K", read=2 * kd)                     # kernels 1, 5
    t.add("V", read=kd)                         # kernel 3
    t.add("O", read=qd)                         # kernel 0
    t.add("dO", read=3 * qd)                    # kernels 0, 2, 3
    t.add("LSE", read=heads * Nq * acc)         # kernel 1
    t.add("D", read=heads * Nq * acc, written=heads * Nq * acc)  # kernel 0 writes, 4 reads
    t.add("P", read=2 * nn, written=nn)
    t.add("dP", read=nn, written=nn)
    t.add("dS", read=2 * nn, written=nn)
    t.add("dQ", written=qd)
    t.add("dK", read=rmw, written=kd)
    t.add("dV", read=rmw, written=kd)
    return t


# --------------------------------------------------------------------------- v2: tiled
def attention_backward_tiled(do, q, k, v, o, lse, *, causal, scale, window, config=None):
    """v2: FlashAttention-2's backward with recomputation.  Returns (dq, dk, dv).

    ``config``: a :class:`TileConfig` (Br = block_q, Bc = block_k) whose backward tile set
    must fit its ``sram_bytes`` (ValueError naming config otherwise); None picks
    :func:`default_backward_config`.  GQA: the K/V tile loop sits outside the loop over
    the g query heads of the group, so dK_j, dV_j sum the whole group on chip and are
    still written once (FlashAttention-2's CUDA code instead writes per-query-head dK, dV
    and sums them afterwards).
    """
    st = q.dtype
    acc = cv.accum_dtype(st.name)
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    cfg = resolve_backward_config(config, d, st.name)
    Br, Bc = cfg.block_q, cfg.block_k
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    plan = tile_plan(Nq, Nk, Br, Bc, causal, window)
    sc = acc.type(scale)

    Q, K, V, O, dO = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V"), HBM(o, "O"), HBM(do, "dO")
    LSE = HBM(np.asarray(lse, dtype=acc), "LSE")
    D = HBM.empty((B, Hq, Nq), acc, "D")
    dQacc = HBM.empty((B, Hq, Nq, d), acc, "dQaccum")   # FlashAttention-2's dq_accum
    dQ = HBM.empty((B, Hq, Nq, d), st, "dQ")
    dK = HBM.empty((B, Hkv, Nk, d), st, "dK")
    dV = HBM.empty((B, Hkv, Nk, d), st, "dV")

    # Pass 1 (a small kernel before the main one): D = rowsum(dO * O); dQaccum = 0.
    for b in range(B):
        for h in range(Hq):
            for i in range(Tr):                         # load dO_i, O_i -> SRAM
                r0, r1 = i * Br, min((i + 1) * Br, Nq)
                D[b, h, r0:r1] = np.sum(dO[b, h, r0:r1].astype(acc) * O[b, h, r0:r1].astype(acc),
                                        axis=-1)        # write D_i -> HBM
                dQacc[b, h, r0:r1] = 0.0                # write zeros to dQaccum_i (a memset)

    # Pass 2, the main kernel: one GPU thread block per (b, kv head, K/V tile j).
    for b in range(B):
        for hk in range(Hkv):
            for j in range(Tc):                         # K/V tiles outer
                c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
                rows = [i for i in range(Tr) if plan[i, j] != "skip"]
                if not rows:                            # no query sees these keys
                    dK[b, hk, c0:c1] = 0.0              # write dK_j, dV_j = 0 -> HBM
                    dV[b, hk, c0:c1] = 0.0
                    continue
                Kj = K[b, hk, c0:c1].astype(acc)        # load K_j, V_j -> SRAM (once)
                Vj = V[b, hk, c0:c1].astype(acc)
                dKj = np.zeros((c1 - c0, d), acc)       # dK_j, dV_j accumulate on chip
                dVj = np.zeros((c1 - c0, d), acc)
                for h in range(hk * g, (hk + 1) * g):   # the g query heads sharing K_j, V_j
                    for i in rows:                      # Q tiles inner (streamed)
                        r0, r1 = i * Br, min((i + 1) * Br, Nq)
                        Qi = Q[b, h, r0:r1].astype(acc)     # load Q_i, dO_i -> SRAM
                        dOi = dO[b, h, r0:r1].astype(acc)
                        lse_i = _safe_lse(LSE[b, h, r0:r1])[:, None]  # load LSE_i, D_i -> SRAM
                        Di = D[b, h, r0:r1][:, None]
                        Sij = Qi @ Kj.T * sc                # recompute S_ij (on chip)
                        if plan[i, j] == "partial":
                            Sij = np.where(cv.mask(Nq, Nk, causal, window, rows=(r0, r1),
                                                   cols=(c0, c1)), Sij, -np.inf)
                        Pij = np.exp(Sij - lse_i)           # recompute P_ij, no row max needed
                        dVj += _mma_operand(Pij, st, acc).T @ dOi
                        dPij = dOi @ Vj.T
                        dSij = _mma_operand(Pij * (dPij - Di), st, acc)
                        dKj += dSij.T @ Qi
                        dQacc[b, h, r0:r1] += dSij @ Kj     # read-modify-write dQaccum_i in HBM
                dK[b, hk, c0:c1] = dKj * sc             # write dK_j, dV_j -> HBM (once)
                dV[b, hk, c0:c1] = dVj

    # Pass 3 (a small kernel after): dQ = scale * dQaccum, in the input dtype.
    for b in range(B):
        for h in range(Hq):
            for i in range(Tr):                         # load dQaccum_i -> SRAM
                r0, r1 = i * Br, min((i + 1) * Br, Nq)
                dQ[b, h, r0:r1] = dQacc[b, h, r0:r1] * sc  # write dQ_i -> HBM
    return dQ.result(), dK.result(), dV.result()


def traffic_model_tiled(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                        causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`attention_backward_tiled`, tensor by tensor.

    With V = the number of visited (Q tile, K/V tile) pairs of the mask (:func:`tile_plan`;
    Tr*Tc without a mask), rows(V) = the query rows those pairs cover (sum of Br_eff), and
    J = the K/V tiles that some query sees, per (b, query head):

    - D pass:        read N_q*d of dO and of O; write N_q of D; write N_q*d of dQaccum (zeros)
    - main loop:     K_j, V_j read once per (b, kv head) for the J tiles (their rows);
                     Q_i, dO_i read rows(V)*d, LSE_i, D_i rows(V), dQaccum read + written rows(V)*d
    - dK, dV:        written once, N_k*d per (b, kv head)
    - dQ pass:       read N_q*d of dQaccum, write N_q*d of dQ

    LSE, D and dQaccum use the accumulator dtype's bytes; the rest the input dtype's.
    """
    name = _dtype_name(dtype)
    st = cv.itemsize_of(name)
    acc = cv.accum_dtype(name).itemsize
    cfg = resolve_backward_config(config, head_dim, name)
    Br, Bc = cfg.block_q, cfg.block_k
    Nq, Nk, d = seqlen_q, seqlen_k, head_dim
    plan = tile_plan(Nq, Nk, Br, Bc, causal, window)
    visited = plan != "skip"                                       # (Tr, Tc)
    row_sizes = np.minimum(Br, Nq - Br * np.arange(plan.shape[0]))  # Br_eff per Q tile
    col_sizes = np.minimum(Bc, Nk - Bc * np.arange(plan.shape[1]))  # Bc_eff per K/V tile
    rows_visited = int((visited * row_sizes[:, None]).sum())       # rows(V)
    kv_rows_loaded = int((visited.any(axis=0) * col_sizes).sum()) if plan.size else 0
    heads, kv_heads = batch * heads_q, batch * heads_kv
    t = Traffic()
    t.add("O", read=heads * Nq * d * st)
    t.add("dO", read=heads * (Nq + rows_visited) * d * st)
    t.add("D", read=heads * rows_visited * acc, written=heads * Nq * acc)
    t.add("Q", read=heads * rows_visited * d * st)
    t.add("LSE", read=heads * rows_visited * acc)
    t.add("K", read=kv_heads * kv_rows_loaded * d * st)
    t.add("V", read=kv_heads * kv_rows_loaded * d * st)
    t.add("dQaccum", read=heads * (rows_visited + Nq) * d * acc,
          written=heads * (Nq + rows_visited) * d * acc)
    t.add("dQ", written=heads * Nq * d * st)
    t.add("dK", written=kv_heads * Nk * d * st)
    t.add("dV", written=kv_heads * Nk * d * st)
    return t


# --------------------------------------------------------------------------- the GPU kernels' bytes
#: the kernels of the GPU backward (CuPy bwd_v1.cu, Numba), in launch order; each name is a
#: word of the kernel's own name, so a profiler's kernel list can be matched to it
GPU_BACKWARD_KERNELS = ("zero", "rowsum", "main", "finish")


def _gpu_q_rows_per_kv_tile(seqlen_q, seqlen_k, block_q, block_k, causal, window) -> int:
    """Query rows the GPU main kernel loads per K/V tile, summed over the Tc tiles.

    The kernels bound the rows that can see a K/V tile by the band's diagonals
    (i_lo from the right edge, i_hi from the left edge) and visit the Q tiles from the
    one holding i_lo up to i_hi, Br rows at a time (fewer in the last tile).
    """
    left, right = cv.effective_window(bool(causal), window)
    Nq, Nk, Br, Bc = seqlen_q, seqlen_k, block_q, block_k
    total = 0
    for j0 in range(0, Nk, Bc):                          # one thread block per K/V tile j
        nk_tile = min(Bc, Nk - j0)
        i_lo = max(0, j0 - right - (Nk - Nq)) if right >= 0 else 0
        i_hi = min(Nq, j0 + nk_tile - 1 + left - (Nk - Nq) + 1) if left >= 0 else Nq
        for i0 in range((i_lo // Br) * Br, i_hi, Br):    # the Q tiles i it visits
            total += min(Br, Nq - i0)
    return total


def traffic_model_gpu_kernels(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                              block_q, block_k, deterministic=False, causal=False,
                              window=None) -> dict:
    """HBM bytes of each kernel of the GPU backward, as the kernels are written: {kernel: Traffic}.

    The GPU kernels (``cupy_raw/kernels/bwd_v1.cu`` and ``numba_cuda/backward.py``) follow
    :func:`attention_backward_tiled` with the GPU's tiles Br = ``block_q``, Bc = ``block_k``
    (their configs' resolved sizes).  With R = the query rows the main kernel loads, summed
    over its Tc K/V tiles (each tile visits the Q tiles from the first row that can see it;
    R = Tc * N_q without a mask), per (b, query head):

    =========  ==========================================================================
    zero       write dQaccum = 0: N_q*d accumulator values (atomic mode), Tc*N_q*d
               (deterministic mode: one slot per K/V tile, the skipped tiles' slots read
               as 0 later)
    rowsum     read dO, O (N_q*d each); write D (N_q)
    main       per (b, KV head): read K_j, V_j once per thread block (N_k*d each in all),
               write dK, dV once (N_k*d each); per query head: read Q_i, dO_i (R*d each),
               LSE_i, D_i (R each); dQ: atomic adds, read + write R*d of dQaccum (a
               read-modify-write; it happens in the L2 cache, and how much of it reaches
               DRAM is what a profiler measures), or deterministic, write R*d into the
               K/V tile's slot
    finish     read dQaccum (N_q*d, or Tc*N_q*d: every slot), write dQ (N_q*d)
    =========  ==========================================================================

    LSE, D and dQaccum take the accumulator dtype's bytes, the rest the input dtype's.
    Without a band that leaves some K/V tile unseen, the atomic mode's total equals
    :func:`traffic_model_tiled` at the same Br, Bc, tensor by tensor.  Not counted: the
    CuPy kernel loads K_j twice in a block (once to SRAM for dQ, once to registers); the
    second load asks for a tile the block has just read, which the cache should hold.
    """
    for arg, val in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{arg}: a positive integer (the GPU config's resolved tile size), got {val!r}")
    name = _dtype_name(dtype)
    st = cv.itemsize_of(name)
    acc = cv.accum_dtype(name).itemsize
    Nq, Nk, d = seqlen_q, seqlen_k, head_dim
    Tc = math.ceil(Nk / block_k)
    R = _gpu_q_rows_per_kv_tile(Nq, Nk, block_q, block_k, causal, window)
    heads, kv_heads = batch * heads_q, batch * heads_kv
    slots = Tc if deterministic else 1
    zero = Traffic().add("dQaccum", written=slots * heads * Nq * d * acc)
    rowsum = (Traffic().add("dO", read=heads * Nq * d * st).add("O", read=heads * Nq * d * st)
              .add("D", written=heads * Nq * acc))
    main = Traffic()
    for t in ("K", "V"):
        main.add(t, read=kv_heads * Nk * d * st)
    for t in ("dK", "dV"):
        main.add(t, written=kv_heads * Nk * d * st)
    for t in ("Q", "dO"):
        main.add(t, read=heads * R * d * st)
    for t in ("LSE", "D"):
        main.add(t, read=heads * R * acc)
    main.add("dQaccum", read=0 if deterministic else heads * R * d * acc, written=heads * R * d * acc)
    finish = Traffic().add("dQaccum", read=slots * heads * Nq * d * acc).add("dQ", written=heads * Nq * d * st)
    return dict(zip(GPU_BACKWARD_KERNELS, (zero, rowsum, main, finish)))


def traffic_model_gpu(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, block_q,
                      block_k, deterministic=False, causal=False, window=None, config=None) -> Traffic:
    """The GPU backward's bytes, all kernels together (:func:`traffic_model_gpu_kernels`).

    ``config`` is accepted for the models' common signature; the tiles are ``block_q``,
    ``block_k``, the GPU config's resolved sizes.
    """
    parts = traffic_model_gpu_kernels(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                                      seqlen_k=seqlen_k, head_dim=head_dim, dtype=dtype, block_q=block_q,
                                      block_k=block_k, deterministic=deterministic, causal=causal,
                                      window=window)
    total = Traffic()
    for t in parts.values():
        total.merge(t)
    return total


# --------------------------------------------------------------------------- for notebook 04
def recompute_flops(seqlen_q: int, seqlen_k: int, head_dim: int, causal=False, window=None,
                    batch: int = 1, heads_q: int = 1) -> dict:
    """Matmul FLOPs of the forward and of the backward, with and without recomputing S.

    Counted per visible (query, key) entry (2 FLOPs per multiply-add), so masks count:
    forward  QK^T, PV                                   4 d per entry
    backward dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q   8 d per entry
    recompute S = scale Q K^T again in the backward      2 d per entry
    Exponentials (one per visible entry) are counted apart: the recomputation repeats them.
    """
    lo, hi = cv.key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window)
    entries = int(np.sum(hi - lo)) * batch * heads_q
    fwd = 4 * head_dim * entries
    bwd = 8 * head_dim * entries
    rec = 2 * head_dim * entries
    return {
        "visible_entries": entries,
        "forward": fwd,
        "backward_stored_P": bwd,
        "backward_recompute": bwd + rec,
        "recompute_extra": rec,
        "backward_overhead": rec / bwd if bwd else 0.0,                 # 0.25
        "training_step_overhead": rec / (fwd + bwd) if bwd else 0.0,    # 1/6
        "exp_forward": entries,
        "exp_backward_recompute": entries,
    }


def memory_footprint(seqlen_q: int, seqlen_k: int, head_dim: int, dtype="float16",
                     batch: int = 1, heads_q: int = 1) -> dict:
    """Bytes the forward must keep for the backward: P (N_q x N_k) versus O and LSE (N_q x d, N_q).

    O is needed by both (the next layer uses it anyway), so the saving is P against LSE.
    """
    name = _dtype_name(dtype)
    st, acc = cv.itemsize_of(name), cv.accum_dtype(name).itemsize
    heads = batch * heads_q
    return {"P": heads * seqlen_q * seqlen_k * st, "O": heads * seqlen_q * head_dim * st,
            "LSE": heads * seqlen_q * acc}


def traffic_vs_seqlen(seqlens, head_dim: int = 64, dtype="float16", causal=False, config=None,
                      batch: int = 1, heads_q: int = 1, heads_kv: int | None = None) -> dict:
    """Modelled HBM bytes of the forward (FA2, if available), naive and tiled backward per N.

    Returns {"N": [...], "naive_backward": [...], "fa2_backward": [...], "mandatory": [...]};
    mandatory = read Q, K, V, O, dO and write dQ, dK, dV once each (the floor).
    """
    heads_kv = heads_q if heads_kv is None else heads_kv
    name = _dtype_name(dtype)
    st = cv.itemsize_of(name)
    out = {"N": [], "naive_backward": [], "fa2_backward": [], "mandatory": []}
    for n in seqlens:
        kw = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=n, seqlen_k=n,
                  head_dim=head_dim, dtype=name, causal=causal, config=config)
        out["N"].append(n)
        out["naive_backward"].append(traffic_model_naive(**kw).total)
        out["fa2_backward"].append(traffic_model_tiled(**kw).total)
        out["mandatory"].append(batch * (4 * heads_q + 4 * heads_kv) * n * head_dim * st)
    return out


def counted_traffic_vs_seqlen(rng: np.random.Generator, seqlens, head_dim: int = 64,
                              dtype="float16", causal=False, config=None) -> dict:
    """Run both backward versions (one head) under :func:`iokernels.core.traffic.count` and return
    their counted bytes, in the form of :func:`traffic_vs_seqlen`; ``matches_model`` says
    whether every count equalled its closed-form model, tensor by tensor."""
    from .core import reference, testing, traffic
    name = _dtype_name(dtype)
    acc = cv.accum_dtype(name)
    out = {"N": [], "naive_backward": [], "fa2_backward": [], "matches_model": True}
    for n in seqlens:
        q, k, v, do = testing.make_inputs(rng, 1, 1, 1, n, n, head_dim, name, with_grad=True)
        o, lse = reference.attention(q, k, v, causal=causal)
        o, lse = o.astype(q.dtype), lse.astype(acc)
        kw = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=head_dim,
                  dtype=name, causal=causal, config=config)
        out["N"].append(n)
        for fn, kind in ((attention_backward_naive, "naive_backward"),
                         (attention_backward_tiled, "fa2_backward")):
            with traffic.count() as t:
                fn(do, q, k, v, o, lse, causal=causal, scale=cv.default_scale(head_dim),
                   window=(-1, -1), config=config)
            out[kind].append(t.total)
            out["matches_model"] &= t == traffic.model(kind, **kw)
    return out


def finite_difference_grads(q, k, v, do, causal=False, window=None, step=1e-6):
    """Central differences of sum(O * dO) with respect to every entry of q, k and v, using
    the float64 oracle's forward (for tiny problems: two forwards per entry)."""
    from .core import reference
    q, k, v = (np.array(x, dtype=np.float64) for x in (q, k, v))

    def loss():
        return float(np.sum(reference.attention(q, k, v, causal=causal, window=window)[0] * do))

    grads = []
    for x in (q, k, v):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + step
            up = loss()
            x[idx] = old - step
            down = loss()
            x[idx] = old
            g[idx] = (up - down) / (2 * step)
        grads.append(g)
    return tuple(grads)


def gradient_checks(rng: np.random.Generator, batch=1, heads_q=4, heads_kv=2, seqlen_q=113,
                    seqlen_k=203, head_dim=59, causal=True, dtypes=("float64", "float32", "float16"),
                    config=None) -> list:
    """The checks of notebook 04, as :class:`iokernels.core.testing.Check` results.

    For each dtype: the tiled backward's dq, dk, dv against the float64 analytic gradients
    (float64: ~1e-12; lower precision: <= 3x the naive backward's error in that dtype).
    O and LSE come from the float64 oracle rounded to what a forward in that dtype stores.
    """
    from .core import reference, testing
    checks = []
    for name in dtypes:
        q, k, v, do = testing.make_inputs(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
                                          head_dim, name, with_grad=True)
        o, lse = reference.attention(q, k, v, causal=causal)
        o, lse = o.astype(q.dtype), lse.astype(cv.accum_dtype(name))
        want = reference.attention_backward(do, q, k, v, causal=causal)
        args = dict(causal=causal, scale=cv.default_scale(head_dim), window=(-1, -1))
        naive = attention_backward_naive(do, q, k, v, o, lse, config=None, **args)
        tiled = attention_backward_tiled(do, q, k, v, o, lse, config=config, **args)
        for g, t, n, w in zip(("dq", "dk", "dv"), tiled, naive, want):
            checks.append(testing.check(t, w, None if name == "float64" else n, dtype=name,
                                        name=f"{name} {g}", factor=testing.GRADIENT_FACTOR))
    return checks
