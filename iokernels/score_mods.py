"""score_mod and mask_mod factories for :func:`iokernels.tiled.forward_flex` (FlexAttention's idea).

Each factory returns a function of indices only, so the change to the scores is computed
on chip inside the tile loop and no N_q x N_k bias tensor is read from HBM:

    score_mod(s, b, h, q_idx, kv_idx) -> s'     s: (Br, Bc) scores scale * Q_i K_j^T
    mask_mod(b, h, q_idx, kv_idx) -> bool       True = visible

They are re-exported by :mod:`iokernels.tiled`, where the loop that calls them lives.
"""
from __future__ import annotations

import numpy as np

__all__ = ["alibi_slopes", "alibi", "softcap", "document_mask"]


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's per-head slopes 2^(-8 h / H), h = 1..H (Press, Smith, Lewis, "ALiBi", 2022)."""
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


def alibi(slopes, seqlen_q: int, seqlen_k: int):
    """score_mod adding -slope_h * |distance| between a query and a key (bottom-right aligned
    positions, like the causal mask): ALiBi's linear bias, from indices only."""
    slopes = np.asarray(slopes, dtype=np.float64)
    shift = seqlen_k - seqlen_q

    def score_mod(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * np.abs(q_idx + shift - kv_idx)
    return score_mod


def softcap(cap: float):
    """score_mod s -> cap * tanh(s / cap): Gemma 2's logit soft-capping (Gemma Team, 2024)."""
    if not cap > 0:
        raise ValueError(f"cap: expected a positive number, got {cap!r}")

    def score_mod(s, b, h, q_idx, kv_idx):
        return cap * np.tanh(s / cap)
    return score_mod


def document_mask(doc_ids_q, doc_ids_k=None):
    """mask_mod: a query sees a key only within its own document (packed sequences).

    ``doc_ids_q[i]`` is the document of query position i (and ``doc_ids_k`` of key j;
    the same ids when omitted).
    """
    dq = np.asarray(doc_ids_q)
    dk = dq if doc_ids_k is None else np.asarray(doc_ids_k)

    def mask_mod(b, h, q_idx, kv_idx):
        return dq[q_idx] == dk[kv_idx]
    return mask_mod
