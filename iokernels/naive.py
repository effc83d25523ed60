"""Step 1: naive attention, which writes the whole score matrix to HBM and reads it back.

This is "standard attention" as the FlashAttention paper (Dao et al., 2022) describes it
in its Algorithm 0: three separate kernels, each reading its inputs from HBM and writing
its result back to HBM.

Notation (per batch entry b and query head h):

=====  ==================================================================
N_q    query rows (seqlen_q);  N_k  key rows (seqlen_k);  d  head_dim
Q      (N_q, d) queries;  K, V  (N_k, d) keys and values of KV head h // g
S      (N_q, N_k) scores,  S = scale * Q K^T, masked entries set to -inf
P      (N_q, N_k) probabilities,  P = softmax(S) row by row
O      (N_q, d) output,  O = P V
LSE    (N_q,) log-sum-exp of each score row (natural log)
g      query heads per KV head (GQA/MQA), heads_q // heads_kv
=====  ==================================================================

The three kernels and what each moves (elements; bytes = elements * itemsize):

1. ``S = scale * Q K^T``   read N_q*d (Q) + N_k*d (K); write N_q*N_k (S)
2. ``P = softmax(S)``      read N_q*N_k (S); write N_q*N_k (P) and N_q (LSE)
3. ``O = P V``             read N_q*N_k (P) + N_k*d (V); write N_q*d (O)

The softmax reads S exactly once.  Like the fused row-softmax kernels of deep-learning
frameworks, it holds one row of S on chip while it computes the row's maximum (pass 1)
and then its exponentials and their sum (pass 2); both passes run over the on-chip
copy.  A softmax whose rows did not fit on chip would read S twice (max pass, then
exponential pass) or three times (with a separate normalisation pass); this module
counts the one-read version, which is the count the source article uses
(write S, read S, write P, read P = 4 N^2 elements).

Precision: every product and sum is accumulated in float32 (float64 for float64
inputs), but S and P are *stored* in HBM in the input dtype, as a naive pipeline of
separate fp16 kernels does.  Rounding S and P to fp16 is what makes naive attention less
accurate in low precision than the tiled version (which never stores them), and this
algorithm in the same precision is the baseline of FlashAttention's 2x accuracy rule
(:mod:`iokernels.core.testing`).

Per (b, h) the query head reads its KV head's K and V afresh: with GQA the naive
pipeline reads K and V ``g`` times, once per query head of the group.

Frank notes: this is slow and memory hungry on purpose (S and P are (B, H, N_q, N_k)
arrays); it exists to be measured, not used.
"""
from __future__ import annotations

import numpy as np

from .core import conventions as cv
from .core.traffic import HBM, Traffic

__all__ = ["attention", "traffic_model"]


def attention(q, k, v, *, causal, scale, window, config=None):
    """Naive attention that materializes S and P in HBM.  Returns (O, LSE).

    q: (B, Hq, Nq, d); k, v: (B, Hkv, Nk, d) NumPy arrays of one float dtype.
    ``config`` is accepted for the common backend signature and ignored (no tiles here).
    """
    storage = q.dtype                                   # S and P are stored in this dtype
    acc = cv.accum_dtype(storage.name)                  # products and sums in this dtype
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    visible = cv.mask(Nq, Nk, causal, window)           # (Nq, Nk) boolean, on chip (free)
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    empty_rows = (hi <= lo)[:, None]                    # fully masked rows: O = 0, LSE = -inf

    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    S = HBM.empty((B, Hq, Nq, Nk), storage, "S")
    P = HBM.empty((B, Hq, Nq, Nk), storage, "P")
    O = HBM.empty((B, Hq, Nq, d), storage, "O")
    LSE = HBM.empty((B, Hq, Nq), acc, "LSE")

    for b in range(B):
        for h in range(Hq):
            hk = cv.kv_head(h, Hq, Hkv)

            # kernel 1: S = scale * Q K^T
            q_bh = Q[b, h].astype(acc)                  # read Nq*d (Q)
            k_bh = K[b, hk].astype(acc)                 # read Nk*d (K)
            s = (q_bh @ k_bh.T) * acc.type(scale)
            S[b, h] = np.where(visible, s, -np.inf)     # write Nq*Nk (S), rounded to storage

            # kernel 2: P = softmax(S), one read of each row (held on chip for both passes)
            s = S[b, h].astype(acc)                     # read Nq*Nk (S)
            m = s.max(axis=-1, keepdims=True) if Nk else np.full((Nq, 1), -np.inf, acc)
            m = np.where(empty_rows, 0.0, m).astype(acc)  # pass 1: row max (0 for empty rows)
            e = np.where(visible, np.exp(s - m), 0.0).astype(acc)  # pass 2: exponentials
            l = e.sum(axis=-1, keepdims=True)
            P[b, h] = e / np.where(empty_rows, 1.0, l)  # write Nq*Nk (P), rounded to storage
            with np.errstate(divide="ignore"):
                lse = np.where(empty_rows, -np.inf, m + np.log(np.where(empty_rows, 1.0, l)))
            LSE[b, h] = lse[:, 0]                       # write Nq (LSE)

            # kernel 3: O = P V
            p = P[b, h].astype(acc)                     # read Nq*Nk (P)
            v_bh = V[b, hk].astype(acc)                 # read Nk*d (V)
            O[b, h] = p @ v_bh                          # write Nq*d (O)
    return O.result(), LSE.result()


def traffic_model(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                  causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`attention`, tensor by tensor.

    Masks change nothing here: naive attention computes, stores and reads every entry
    of S and P, visible or not.  ``heads_kv`` does not reduce K/V traffic either: each
    query head reads its KV head's K and V itself.
    """
    st = cv.itemsize_of(dtype)                   # bytes per stored element
    acc = cv.accum_dtype(dtype).itemsize         # LSE is stored in the accumulator dtype
    heads = batch * heads_q                      # one (b, h) pass per query head
    Nq, Nk, d = seqlen_q, seqlen_k, head_dim
    t = Traffic()
    t.add("Q", read=heads * Nq * d * st)
    t.add("K", read=heads * Nk * d * st)
    t.add("V", read=heads * Nk * d * st)
    t.add("S", read=heads * Nq * Nk * st, written=heads * Nq * Nk * st)
    t.add("P", read=heads * Nq * Nk * st, written=heads * Nq * Nk * st)
    t.add("O", written=heads * Nq * d * st)
    t.add("LSE", written=heads * Nq * acc)
    return t
