"""The float64 oracle: the plain mathematical definition of attention, written for clarity.

Everything else in the package is checked against these functions.  They upcast to
float64, build the explicit visibility mask from :mod:`iokernels.core.conventions`, and use
the two-pass softmax (max first, then exponentials and their sum).  They allocate the
full N x N matrices on purpose: the oracle is for small problems and for truth, not speed.
The products are batched matmuls (``@``), so the BLAS library computes them in float64.

Notation: S = scale * Q K^T, P = softmax(S) row-wise over visible keys,
O = P V, LSE_i = log sum_j exp(S_ij) over visible keys (natural log).
"""
from __future__ import annotations

import numpy as np

from . import conventions as cv


def _f64(x):
    """Any supported array as a float64 NumPy array (device arrays are copied to the host)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().float().cpu().numpy() if str(x.dtype) == "torch.bfloat16" else x.detach().cpu().numpy()
    elif hasattr(x, "get"):  # CuPy
        x = x.get()
    elif hasattr(x, "copy_to_host"):  # Numba device array
        x = x.copy_to_host()
    x = np.asarray(x)
    if x.dtype.name == "bfloat16" or x.dtype.kind == "V":  # ml_dtypes bfloat16
        x = x.astype(np.float32)
    return x.astype(np.float64)


def _expand_kv(x, heads_q):
    """(B, Hkv, N, d) -> (B, Hq, N, d) by the GQA mapping."""
    return x[:, cv.kv_head_index(heads_q, x.shape[1])]


def attention(q, k, v, causal=False, scale=None, window=None, score_mod=None, mask_mod=None):
    """Float64 attention: returns (O, LSE) with O (B, Hq, Nq, d) and LSE (B, Hq, Nq).

    ``score_mod(S, b, h, q_idx, kv_idx)`` changes the scores and ``mask_mod(b, h, q_idx,
    kv_idx)`` hides (query, key) pairs, as in :func:`iokernels.tiled.forward_flex`; here they
    are called once on the whole matrix with broadcasting index arrays b (B,1,1,1),
    h (1,H,1,1), q_idx (Nq,1), kv_idx (1,Nk).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    scale = cv.resolve_scale(scale, d)
    k, v = _expand_kv(k, Hq), _expand_kv(v, Hq)
    visible = cv.mask(Nq, Nk, causal, window)                        # (Nq, Nk)
    S = q @ k.swapaxes(-1, -2) * scale
    if score_mod is not None or mask_mod is not None:
        b_idx, h_idx = np.arange(B)[:, None, None, None], np.arange(Hq)[None, :, None, None]
        q_idx, kv_idx = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
        if score_mod is not None:
            S = np.broadcast_to(score_mod(S, b_idx, h_idx, q_idx, kv_idx), S.shape).astype(np.float64)
        if mask_mod is not None:
            visible = visible & np.broadcast_to(mask_mod(b_idx, h_idx, q_idx, kv_idx), S.shape)
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=-1, keepdims=True) if Nk > 0 else np.full((B, Hq, Nq, 1), -np.inf)
    empty = ~np.isfinite(m)                                          # fully masked rows
    P = np.where(visible, np.exp(S - np.where(empty, 0.0, m)), 0.0)  # pass 2: exponentials
    l = P.sum(axis=-1, keepdims=True)
    O = P @ v / np.where(empty, 1.0, l)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))[..., 0]
    return O, lse


def attention_backward(do, q, k, v, causal=False, scale=None, window=None):
    """Analytic float64 gradients (dQ, dK, dV) of sum(O * dO); dK, dV summed over GQA groups.

    dV = P^T dO;  dP = dO V^T;  D_i = rowsum(dO_i * O_i);  dS = P * (dP - D);
    dQ = scale * dS K;  dK = scale * dS^T Q.
    """
    do, q, k, v = _f64(do), _f64(q), _f64(k), _f64(v)
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = cv.resolve_scale(scale, d)
    O, lse = attention(q, k, v, causal, scale, window)
    ke, ve = _expand_kv(k, Hq), _expand_kv(v, Hq)
    visible = cv.mask(Nq, Nk, causal, window)
    S = q @ ke.swapaxes(-1, -2) * scale
    finite = np.isfinite(lse)[..., None]
    P = np.where(visible & finite, np.exp(S - np.where(finite, lse[..., None], 0.0)), 0.0)
    dV = P.swapaxes(-1, -2) @ do
    dP = do @ ve.swapaxes(-1, -2)
    D = np.sum(do * O, axis=-1, keepdims=True)
    dS = P * (dP - D)
    dQ = dS @ ke * scale
    dK = dS.swapaxes(-1, -2) @ q * scale
    g = Hq // Hkv
    dK = dK.reshape(B, Hkv, g, Nk, d).sum(axis=2)
    dV = dV.reshape(B, Hkv, g, Nk, d).sum(axis=2)
    return dQ, dK, dV


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None):
    """Packed varlen oracle: each sequence attends only within itself. Returns (O, LSE).

    q: (total_q, Hq, d); LSE: (Hq, total_q), as FlashAttention's varlen API returns it.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    cq = np.asarray(cu_seqlens_q, dtype=np.int64)
    ck = np.asarray(cu_seqlens_k, dtype=np.int64)
    O = np.zeros_like(q)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        o_b, lse_b = attention(q[qs].transpose(1, 0, 2)[None], k[ks].transpose(1, 0, 2)[None],
                               v[ks].transpose(1, 0, 2)[None], causal, scale, window)
        O[qs] = o_b[0].transpose(1, 0, 2)
        lse[:, qs] = lse_b[0]
    return O, lse


def decode(q, k, v, seq_lens=None, scale=None, window=None):
    """One new query token per sequence over a (ragged) KV cache. Returns (O, LSE).

    q: (B, Hq, d); k, v: (B, Hkv, N, d); sequence b uses keys [0, seq_lens[b]).  The query
    is that sequence's last position, so ``window`` masks it bottom-right aligned, as
    :func:`attention` does with one query row.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, Hq, d = q.shape
    N = k.shape[2]
    lens = np.full(B, N) if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
    O = np.zeros((B, Hq, d))
    lse = np.full((B, Hq), -np.inf)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        o_b, lse_b = attention(q[b][None, :, None, :], k[b][None, :, :n], v[b][None, :, :n],
                               scale=scale, window=window)
        O[b], lse[b] = o_b[0, :, 0], lse_b[0, :, 0]
    return O, lse
