"""The CuPy backend's public calls: a cached plan for device arrays, the eager path otherwise.

Each function keeps the signature (and the docstring) of its eager implementation in
:mod:`.decode`, :mod:`.forward`, :mod:`.backward`, :mod:`.gather`, :mod:`.mla` or
:mod:`.paged_prefill` (a config naming the Hopper v3: :mod:`.hopper.paged_prefill`); device
arrays (torch CUDA, CuPy) go through :data:`.plans.PLANS` (a hit checks one key and
launches), NumPy arrays and versions with their own launchers through the eager path, which
copies NumPy inputs in and out.
:data:`PLANNED` is what :mod:`iokernels.api` asks first for ``backend="cupy"``.
"""
from __future__ import annotations

from .backward import attention_backward as eager_attention_backward
from .decode import decode as eager_decode
from .decode import paged_decode_pools as eager_paged_decode_pools
from .forward import attention as eager_attention
from .gather import gather_pools as eager_gather_pools
from .mla import mla_decode as eager_mla_decode
from .mla import paged_mla_decode as eager_paged_mla_decode
from .paged_prefill import paged_prefill_pools as eager_paged_prefill_pools
from .hopper.paged_prefill import names_v3, paged_prefill_pools as eager_v3_paged_prefill_pools
from .attention_plan import cached_attention
from .backward_plan import cached_attention_backward
from .gather_plan import cached_gather_pools
from .mla_plan import cached_mla_decode, cached_paged_mla_decode
from .paged_prefill_plan import cached_paged_prefill_pools
from .plans import cached_decode, cached_paged_decode_pools


def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    out = cached_attention(q, k, v, causal=causal, scale=scale, window=window, config=config)
    if out is NotImplemented:
        return eager_attention(q, k, v, causal=causal, scale=scale, window=window, config=config)
    return out


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    out = cached_decode(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config,
                        window=window)
    if out is NotImplemented:
        return eager_decode(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config,
                        window=window)
    return out


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None,
                       window=None, quant=None):
    out = cached_paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                    config=config, window=window, quant=quant)
    if out is NotImplemented:
        return eager_paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                    config=config, window=window, quant=quant)
    return out


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=None, config=None):
    out = cached_attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, window=window, config=config)
    if out is NotImplemented:
        return eager_attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, window=window, config=config)
    return out


def gather_pools(k_pool, v_pool, block_table, seq_len, *, config=None):
    out = cached_gather_pools(k_pool, v_pool, block_table, seq_len, config=config)
    if out is NotImplemented:
        return eager_gather_pools(k_pool, v_pool, block_table, seq_len, config=config)
    return out


def mla_decode(q, kv, *, seq_lens=None, num_splits=None, scale=None, config=None):
    out = cached_mla_decode(q, kv, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config)
    if out is NotImplemented:
        return eager_mla_decode(q, kv, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config)
    return out


def paged_mla_decode(q, pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None):
    out = cached_paged_mla_decode(q, pool, block_tables, seq_lens, num_splits=num_splits, scale=scale, config=config)
    if out is NotImplemented:
        return eager_paged_mla_decode(q, pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                      config=config)
    return out


def paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                        config=None, max_seqlen_q=None):
    out = cached_paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal,
                                     scale=scale, config=config, max_seqlen_q=max_seqlen_q)
    if out is NotImplemented:                    # a config naming the Hopper v3 takes its own launcher
        eager = eager_v3_paged_prefill_pools if names_v3(config) else eager_paged_prefill_pools
        return eager(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale,
                     config=config, max_seqlen_q=max_seqlen_q)
    return out


attention.__doc__ = eager_attention.__doc__
decode.__doc__ = eager_decode.__doc__
paged_decode_pools.__doc__ = eager_paged_decode_pools.__doc__
attention_backward.__doc__ = eager_attention_backward.__doc__
gather_pools.__doc__ = eager_gather_pools.__doc__
mla_decode.__doc__ = eager_mla_decode.__doc__
paged_mla_decode.__doc__ = eager_paged_mla_decode.__doc__
paged_prefill_pools.__doc__ = eager_paged_prefill_pools.__doc__

#: op -> its cached call (the public functions of :mod:`iokernels.api` ask it first)
PLANNED = {"attention": cached_attention, "decode": cached_decode, "attention_backward": cached_attention_backward}
