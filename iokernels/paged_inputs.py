"""Seeded paged-decode problems: a filled :class:`~iokernels.paged.PagedKVCache` and what it holds.

The input factory of :mod:`iokernels.core.testing` for the paged cache; it sits above the
lesson :mod:`iokernels.paged` (the core imports no lesson).
"""
from __future__ import annotations

import numpy as np

from .core.testing import make_inputs
from .paged import PagedKVCache


def make_paged_decode_inputs(rng: np.random.Generator, batch, heads_q, heads_kv, seqlen, head_dim, dtype,
                             kv_dtype=None, scale_granularity="block_head", block_size=16):
    """A decode problem over a filled :class:`~iokernels.paged.PagedKVCache`: ragged lengths
    (the first sequence empty, the last ``seqlen`` long), optionally quantized.

    Returns (q (B, Hq, d), k, v (B, Hkv, N, d) the exact values, lens, cache, seq ids,
    k_hat, v_hat): k_hat, v_hat (float64) are what the cache holds (its codes times its
    scales when quantized; zeros past each length).
    """
    q, k, v = make_inputs(rng, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1, seqlen_k=seqlen,
                          head_dim=head_dim, dtype=dtype)
    q = q[:, :, 0]
    lens = rng.integers(1, seqlen + 1, size=batch)
    lens[0], lens[-1] = 0, seqlen
    return (q, k, v, lens, *paged_cache_of(k, v, lens, dtype, kv_dtype, scale_granularity, block_size))


def paged_cache_of(k, v, lens, dtype, kv_dtype=None, scale_granularity="block_head", block_size=16):
    """A :class:`~iokernels.paged.PagedKVCache` holding sequence b's first lens[b] rows of k, v
    (B, Hkv, N, d), one append each: (cache, seq ids, k_hat, v_hat), k_hat and v_hat (float64)
    what it holds (zeros past each length)."""
    batch, heads_kv, seqlen, head_dim = k.shape
    cache = PagedKVCache(batch * (-(-seqlen // block_size)) + 2, block_size, num_kv_heads=heads_kv,
                         head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype, scale_granularity=scale_granularity)
    sids = [cache.new_sequence() for _ in range(batch)]
    k_hat, v_hat = np.zeros(k.shape), np.zeros(v.shape)
    for b, (sid, n) in enumerate(zip(sids, lens)):
        if n:
            cache.append(sid, k[b, :, :n].transpose(1, 0, 2).copy(), v[b, :, :n].transpose(1, 0, 2).copy())
            k_hat[b, :, :n], v_hat[b, :, :n] = cache.gather(sid)
    return cache, sids, k_hat, v_hat
