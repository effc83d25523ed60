"""The public functions: check every argument first, then dispatch to a backend.

All checks run before any work (:mod:`iokernels.core.api`), so a bad call raises a
ValueError that names the argument and changes nothing.  Backends receive resolved
arguments (a float scale, a (left, right) window) and return (out, lse); the public
functions drop the LSE unless ``return_lse=True``.

Backends: "naive" and "tiled" (NumPy, steps 1-4), "numba" (Numba CUDA, the simulator on
a CPU), "cupy" (CuPy RawKernel), "triton" (Triton, its interpreter on a CPU), "torch"
(scaled_dot_product_attention, for comparison).

This module sits above the lessons: the NumPy and torch implementations are looked up
in one table (:data:`_DISPATCH`); the GPU backends through their kernel registries
(:class:`iokernels.core.api.Registered`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from . import backward, naive, paged, paged_prefill as _prefill, tiled, torch_sdpa
from . import decode as _decode
from .core import api as _core
from .core import conventions as cv
from .core import traffic as _traffic
from .core.api import BACKENDS, GPU_BACKENDS, NUMPY_BACKENDS, QUANT_DECODE_BACKENDS, registry_of
from .paged import PagedKVCache

__all__ = ["attention", "attention_backward", "attention_varlen", "decode", "paged_decode", "paged_prefill",
           "paged_gather", "merge_states", "backends_implementing", "BACKENDS", "NUMPY_BACKENDS", "GPU_BACKENDS",
           "QUANT_DECODE_BACKENDS", "registry_of"]

#: (backend, operation) -> function.  One table, so what exists is visible.
_DISPATCH: dict[tuple[str, str], Callable[..., Any]] = {
    ("naive", "attention"): naive.attention,
    ("tiled", "attention"): tiled.attention,
    ("torch", "attention"): torch_sdpa.attention,
    ("naive", "attention_backward"): backward.attention_backward_naive,
    ("tiled", "attention_backward"): backward.attention_backward_tiled,
    ("torch", "attention_backward"): torch_sdpa.attention_backward,
    ("tiled", "attention_varlen"): tiled.attention_varlen,
    ("naive", "decode"): _decode.decode_naive,
    ("tiled", "decode"): _decode.decode_split_kv,
    ("torch", "decode"): torch_sdpa.decode,
    ("tiled", "paged_decode"): _decode.paged_decode_split_kv,
    ("tiled", "paged_prefill"): _prefill.paged_prefill_tiled,
    ("naive", "paged_prefill"): functools.partial(_prefill.gather_then_attend, naive.attention),
    ("torch", "paged_prefill"): functools.partial(_prefill.gather_then_attend, torch_sdpa.attention),
}


# Each kernel module's closed-form traffic, by the kind ik.traffic.model takes.
_traffic.register_models(
    naive=naive.traffic_model, naive_backward=backward.traffic_model_naive,
    fa1=tiled.traffic_model_fa1, fa2=tiled.traffic_model_fa2,
    fa2_backward=backward.traffic_model_tiled, gpu_backward=backward.traffic_model_gpu,
    decode=_decode.traffic_model, paged_decode=_decode.traffic_model_paged,
    paged_gather=paged.traffic_model_gather, paged_prefill=_prefill.traffic_model)


def _implements(backend: str, op: str) -> bool:
    return (backend, op) in _DISPATCH or _core.gpu_implements(backend, op)


def backends_implementing(op: str) -> list[str]:
    """The backends that run ``op`` ("attention_varlen" also runs on every backend with "attention")."""
    ops = (op, "attention") if op == "attention_varlen" else (op,)
    return [b for b in BACKENDS if any(_implements(b, o) for o in ops)]


def _resolve(backend: str, op: str) -> Callable[..., Any]:
    """The function (or registered GPU op) that runs ``op`` on ``backend``."""
    cv.check_choice(backend, "backend", BACKENDS)
    if backend in GPU_BACKENDS:
        if not _implements(backend, op):
            have = sorted(b for b in BACKENDS if _implements(b, op))
            raise ValueError(f"backend: {backend!r} does not implement {op}; available: {', '.join(have)}")
        return _core.Registered(backend, op)
    fn = _DISPATCH.get((backend, op))
    if fn is None:
        have = sorted(b for b in BACKENDS if _implements(b, op))
        raise ValueError(f"backend: {backend!r} does not implement {op}; available: {', '.join(have)}")
    return fn


# --------------------------------------------------------------------------- prefill
def attention(q, k, v, causal: bool = False, scale: float | None = None, window=None, backend: str = "tiled",
              config=None, return_lse: bool = False):
    """Attention over (batch, heads, seq, head_dim) inputs; the conventions are in :mod:`iokernels.core.conventions`.

    Returns O (same kind of array and dtype as q), and LSE (batch, heads_q, seqlen_q) when
    ``return_lse``.  ``config`` is the backend's tile config (None: its default).
    """
    fast = _core.planned(backend, "attention")      # device arrays: a cached plan (its checks ran once)
    if fast is not None:
        return_lse = cv.check_bool(return_lse, "return_lse")
        out = fast(q, k, v, causal=causal, scale=scale, window=window, config=config)
        if out is not NotImplemented:
            return out if return_lse else out[0]
    info = cv.check_qkv(q, k, v)
    causal = cv.check_bool(causal, "causal")
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    fn = _resolve(backend, "attention")
    _core.numpy_only(backend, q=q, k=k, v=v)
    o, lse = _core.call(fn, backend, dict(q=q, k=k, v=v), q, k, v, causal=causal, scale=scale, window=window,
                        config=config)
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o, lse, causal: bool = False, scale: float | None = None, window=None,
                       backend: str = "tiled", config=None):
    """Gradients (dq, dk, dv) of attention, given the forward's O and LSE (recomputation)."""
    fast = _core.planned(backend, "attention_backward")    # device arrays: a cached plan (its checks ran once)
    if fast is not None:
        out = fast(do, q, k, v, o, lse, causal=causal, scale=scale, window=window, config=config)
        if out is not NotImplemented:
            return out
    info = _core.check_backward_args(do, q, k, v, o, lse)
    causal = cv.check_bool(causal, "causal")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    fn = _resolve(backend, "attention_backward")
    _core.numpy_only(backend, do=do, q=q, k=k, v=v, o=o, lse=lse)
    return _core.call(fn, backend, dict(q=q, k=k, v=v), do, q, k, v, o, lse, causal=causal, scale=scale,
                      window=window, config=config)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale: float | None = None,
                     window=None, backend: str = "tiled", config=None, return_lse: bool = False):
    """Attention over packed sequences: q (total_q, heads_q, d), k/v (total_k, heads_kv, d).

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and the matching rows of k, v;
    zero-length sequences are allowed.  LSE has shape (heads_q, total_q).
    """
    info = cv.check_qkv(q, k, v, rank=3)
    cq, ck = _core.check_cu_pair(info, cu_seqlens_q, cu_seqlens_k)
    causal = cv.check_bool(causal, "causal")
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    cv.check_choice(backend, "backend", BACKENDS)
    _core.numpy_only(backend, q=q, k=k, v=v)
    if (backend, "attention_varlen") in _DISPATCH:
        o, lse = _DISPATCH[backend, "attention_varlen"](q, k, v, cq, ck, causal=causal, scale=scale,
                                                        window=window, config=config)
    else:
        o, lse = _core.varlen_by_sequence(_resolve(backend, "attention"), q, k, v, cq, ck, causal, scale,
                                          window, config)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------- decode
def decode(q, k, v, num_splits: int | None = None, scale: float | None = None, backend: str = "tiled",
           return_lse: bool = False, seq_lens=None, config=None, window=None):
    """One new query token per sequence: q (B, Hq, d) over k, v (B, Hkv, N, d).

    ``seq_lens`` (B,) makes the cache ragged (sequence b uses keys [0, seq_lens[b]));
    ``num_splits`` splits each sequence's keys into that many chunks (Flash-Decoding);
    None picks it from the occupancy heuristic.  ``config``: the backend's decode config
    (the tiled backend's is a TileConfig whose ``block_k`` is the keys per tile; None: its
    default).  ``window`` (left, right): the query is the last position n - 1 (bottom-right
    alignment), so it sees key j iff j >= n - 1 - left; ``right`` cannot reach past the end.
    """
    fast = _core.planned(backend, "decode")         # device arrays: a cached plan (its checks ran once)
    if fast is not None:
        return_lse = cv.check_bool(return_lse, "return_lse")
        out = fast(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config, window=window)
        if out is not NotImplemented:
            return out if return_lse else out[0]
    info, lens = _core.check_decode(q, k, v, seq_lens)
    num_splits = _core.check_num_splits(num_splits)
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    fn = _resolve(backend, "decode")
    extra = _core.window_kwargs(window, backend, fn)
    _core.numpy_only(backend, q=q, k=k, v=v)
    o, lse = _core.call(fn, backend, dict(q=q, k=k, v=v), q, k, v, seq_lens=lens, num_splits=num_splits,
                        scale=scale, config=config, **extra)
    return (o, lse) if return_lse else o


def _check_cache(cache) -> None:
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")


def paged_decode(q, cache, seq_ids, num_splits: int | None = None, scale: float | None = None,
                 backend: str = "tiled", return_lse: bool = False, config=None, window=None):
    """Decode over a :class:`PagedKVCache`: q (len(seq_ids), Hq, d), one token per sequence.

    A quantized cache (``kv_dtype`` set) is read as its 1-byte codes and block scales and
    dequantized on chip by the 'tiled', 'numba' and 'cupy' kernels; ``window`` as in
    :func:`decode`.
    """
    _check_cache(cache)
    seq_ids = _core.check_paged_decode(q, cache, seq_ids, backend)
    num_splits = _core.check_num_splits(num_splits)
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, cache.head_dim)
    fn = _resolve(backend, "paged_decode")
    extra = _core.window_kwargs(window, backend, fn)
    _core.numpy_only(backend, q=q)
    o, lse = _core.call(fn, backend, dict(q=q, cache=cache), q, cache, seq_ids, num_splits=num_splits,
                        scale=scale, config=config, **extra)
    return (o, lse) if return_lse else o


def paged_prefill(q, cache, seq_ids, cu_seqlens_q, causal: bool = True, scale: float | None = None,
                  backend: str = "tiled", return_lse: bool = False, config=None):
    """Chunked prefill over a :class:`PagedKVCache`: each sequence's new queries attend to its cache.

    q (total_q, Hq, d) packed as in :func:`attention_varlen`: sequence seq_ids[b]'s chunk is
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1].  The chunk's K and V must already be appended
    (they are the sequence's last rows), and ``causal`` masks bottom-right: chunk row i of
    a sequence holding n tokens sits at position n - n_q + i and sees keys 0..that
    position.  A chunk of one row is a decode step; an empty chunk is allowed.  ``config``:
    a TileConfig whose block_q is the Q tile rows (its block_k must be the cache's block
    size), on "numba" a PrefillConfig, on "cupy" a PagedPrefillConfig; None: the default.  LSE
    has shape (Hq, total_q).  Backends: "tiled" reads the blocks in the kernel; "numba" too, in
    one launch for the whole packed batch (:mod:`iokernels.numba_cuda.paged_prefill`); "cupy"
    on the tensor cores, one launch too (:mod:`iokernels.cupy_raw.paged_prefill`; device pools
    through :func:`iokernels.cupy_raw.paged_prefill_pools`); "naive" and "torch" gather each
    sequence out of the pool first and attend on the copy
    (:func:`iokernels.paged_prefill.gather_then_attend`).  See :mod:`iokernels.paged_prefill`.
    """
    _check_cache(cache)
    seq_ids, cq = _core.check_paged_prefill(q, cache, seq_ids, cu_seqlens_q, backend)
    causal = cv.check_bool(causal, "causal")
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, cache.head_dim)
    fn = _resolve(backend, "paged_prefill")
    _core.numpy_only(backend, q=q)
    if backend == "tiled":
        _prefill.block_q_of(config, cache.block_size)         # a bad config fails before any work
    o, lse = _core.call(fn, backend, dict(q=q, cache=cache), q, cache, seq_ids, cq, causal=causal,
                        scale=scale, config=config)
    return (o, lse) if return_lse else o


def paged_gather(cache, sid, backend: str = "numpy", config=None):
    """Sequence ``sid``'s K and V copied out of the cache's block pool, contiguous (Hkv, n, d).

    backend "numpy" (counted HBM traffic; "tiled" is accepted as its other name), "numba"
    or "cupy" (their gather kernels, chosen by ``config``): :meth:`PagedKVCache.gather`.
    """
    _check_cache(cache)
    return cache.gather(sid, backend=backend, config=config)


def merge_states(o_parts, lse_parts):
    """Exact log-sum-exp merge over axis 0: parts (S, ..., d) and (S, ...) -> (o, lse).

    Parts with LSE -inf (empty chunks) weigh nothing; all parts empty gives 0 and -inf.
    """
    o_parts, lse_parts = _core.check_merge_parts(o_parts, lse_parts)
    return _decode.merge_states(o_parts, lse_parts)
