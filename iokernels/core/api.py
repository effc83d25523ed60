"""The public functions: check every argument first, then dispatch to a backend.

All checks run before any work, so a bad call raises a ValueError that names the
argument and changes nothing.  Backends receive resolved arguments (a float scale, a
(left, right) window) and return (out, lse); the public functions drop the LSE unless
``return_lse=True``.

Backends: "naive" and "tiled" (NumPy, steps 1-4), "numba" (Numba CUDA, the simulator on
a CPU), "cupy" (CuPy RawKernel), "torch" (scaled_dot_product_attention, for comparison).

The NumPy backends are looked up in one table (:data:`_DISPATCH`).  The GPU backends each
own a kernel registry (:mod:`iokernels.core.registry`): a call asks the backend what it
needs (``need``: dtype, head dim, compute capability, contiguity), the registry picks the
version (the config's ``version``, or the best default that can run) and its launcher
runs it.  Every op dispatches the same way: attention, decode, paged decode and paged
gather all take ``config=``.

Inputs: the NumPy backends check that q, k and v are finite (a ValueError names the
array); the GPU backends do not scan device memory, and a non-finite input gives
non-finite output rows there.
"""
from __future__ import annotations

import importlib
import inspect
import numbers

import numpy as np

from . import conventions as cv

BACKENDS = ("naive", "tiled", "numba", "cupy", "torch")
NUMPY_BACKENDS = ("naive", "tiled")
#: the backends whose paged decode reads a quantized cache's codes and scales
QUANT_DECODE_BACKENDS = ("tiled", "numba", "cupy")
#: the backends with a kernel registry: backend -> its package
GPU_BACKENDS = {"numba": "iokernels.numba_cuda", "cupy": "iokernels.cupy_raw"}

#: (backend, operation) -> "module:function".  One table, so what exists is visible.
_DISPATCH = {
    ("naive", "attention"): "iokernels.naive:attention",
    ("tiled", "attention"): "iokernels.tiled:attention",
    ("torch", "attention"): "iokernels.torch_sdpa:attention",
    ("naive", "attention_backward"): "iokernels.backward:attention_backward_naive",
    ("tiled", "attention_backward"): "iokernels.backward:attention_backward_tiled",
    ("torch", "attention_backward"): "iokernels.torch_sdpa:attention_backward",
    ("tiled", "attention_varlen"): "iokernels.tiled:attention_varlen",
    ("naive", "decode"): "iokernels.decode:decode_naive",
    ("tiled", "decode"): "iokernels.decode:decode_split_kv",
    ("torch", "decode"): "iokernels.torch_sdpa:decode",
    ("tiled", "paged_decode"): "iokernels.decode:paged_decode_split_kv",
}


def registry_of(backend: str):
    """The kernel registry of GPU backend ``backend`` (imports the backend)."""
    cv.check_choice(backend, "backend", tuple(GPU_BACKENDS))
    return importlib.import_module(GPU_BACKENDS[backend]).REGISTRY


class _Registered:
    """A GPU backend's op as a callable: resolve the version for this call, then launch it."""

    def __init__(self, backend: str, op: str):
        self.backend, self.op = backend, op
        self.module = importlib.import_module(GPU_BACKENDS[backend])
        if op not in self.module.REGISTRY.ops():
            have = sorted(b for b in BACKENDS if _implements(b, op))
            raise ValueError(f"backend: {backend!r} does not implement {op}; available: {', '.join(have)}")

    #: where each op's arrays sit in its positional arguments (what ``need`` describes)
    _NEED_ARGS = {"attention": ("q", "k", "v"), "decode": ("q", "k", "v"), "paged_decode": ("q", "cache"),
                  "paged_gather": ("cache",), "attention_backward": (None, "q", "k", "v")}

    def accepts(self, name: str) -> bool:
        """Whether every registered version of this op takes keyword ``name``."""
        return all(name in inspect.signature(k.launcher).parameters for k in self.module.REGISTRY.kernels(self.op))

    def __call__(self, *args, config=None, need=None, **kw):
        if need is None:             # called directly (scripts): the arrays are the leading arguments
            need = {n: a for n, a in zip(self._NEED_ARGS[self.op], args) if n is not None}
        kernel, cfg = self.module.REGISTRY.resolve(self.op, config, self.module.need(self.op, **need))
        return kernel.launcher(*args, config=cfg, **kw)


def _implements(backend: str, op: str) -> bool:
    if (backend, op) in _DISPATCH:
        return True
    if backend in GPU_BACKENDS:
        try:
            return op in registry_of(backend).ops()
        except ImportError:
            return False
    return False


def _resolve(backend: str, op: str):
    cv.check_choice(backend, "backend", BACKENDS)
    if backend in GPU_BACKENDS:
        return _Registered(backend, op)
    target = _DISPATCH.get((backend, op))
    if target is None:
        have = sorted(b for b in BACKENDS if _implements(b, op))
        raise ValueError(f"backend: {backend!r} does not implement {op}; available: {', '.join(have)}")
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def _numpy_only(backend, **arrays):
    """The NumPy backends take NumPy arrays, and finite ones."""
    if backend in NUMPY_BACKENDS:
        for name, a in arrays.items():
            if a is not None and not isinstance(a, np.ndarray):
                raise ValueError(f"{name}: the {backend!r} backend works on NumPy arrays; got "
                                 f"{type(a).__module__}.{type(a).__name__} (use backend='numba' or 'cupy')")
        for name, a in arrays.items():
            if a is not None and name != "lse":
                cv.check_finite(a, name)


def _call(fn, backend, need, *args, **kw):
    """Run a resolved backend function; GPU backends also get what the call needs."""
    if backend in GPU_BACKENDS:
        return fn(*args, need=need, **kw)
    return fn(*args, **kw)


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits: expected None or an integer >= 1, got {num_splits!r}")
    return int(num_splits)


# --------------------------------------------------------------------------- prefill
def attention(q, k, v, causal=False, scale=None, window=None, backend="tiled", config=None,
              return_lse=False):
    """Attention over (batch, heads, seq, head_dim) inputs; the conventions are in :mod:`iokernels.core.conventions`.

    Returns O (same kind of array and dtype as q), and LSE (batch, heads_q, seqlen_q) when
    ``return_lse``.  ``config`` is the backend's tile config (None: its default).
    """
    info = cv.check_qkv(q, k, v)
    causal = cv.check_bool(causal, "causal")
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    fn = _resolve(backend, "attention")
    _numpy_only(backend, q=q, k=k, v=v)
    o, lse = _call(fn, backend, dict(q=q, k=k, v=v), q, k, v, causal=causal, scale=scale, window=window,
                   config=config)
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o, lse, causal=False, scale=None, window=None,
                       backend="tiled", config=None):
    """Gradients (dq, dk, dv) of attention, given the forward's O and LSE (recomputation)."""
    info = cv.check_qkv(q, k, v)
    for name, x, shape in (("do", do, np.shape(q)), ("o", o, np.shape(q)),
                           ("lse", lse, (info["batch"], info["heads_q"], info["seqlen_q"]))):
        s = tuple(getattr(x, "shape", ()) or ())
        if getattr(x, "shape", None) is None or s != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {s if s else type(x).__name__}")
    if cv.dtype_name(do) != info["dtype"] or cv.dtype_name(o) != info["dtype"]:
        raise ValueError(f"do, o: dtype must equal q's {info['dtype']}; got do {cv.dtype_name(do)}, "
                         f"o {cv.dtype_name(o)}")
    cv.check_dtype(lse, "lse", ("float32", "float64"))
    causal = cv.check_bool(causal, "causal")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    fn = _resolve(backend, "attention_backward")
    _numpy_only(backend, do=do, q=q, k=k, v=v, o=o, lse=lse)
    return _call(fn, backend, dict(q=q, k=k, v=v), do, q, k, v, o, lse, causal=causal, scale=scale,
                 window=window, config=config)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None,
                     backend="tiled", config=None, return_lse=False):
    """Attention over packed sequences: q (total_q, heads_q, d), k/v (total_k, heads_kv, d).

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and the matching rows of k, v;
    zero-length sequences are allowed.  LSE has shape (heads_q, total_q).
    """
    info = cv.check_qkv(q, k, v, rank=3)
    cq = cv.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", info["total_q"])
    ck = cv.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", info["total_k"])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_k: must have as many entries as cu_seqlens_q ({len(cq)}), got {len(ck)}")
    causal = cv.check_bool(causal, "causal")
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    window = cv.resolve_window(window)
    cv.check_choice(backend, "backend", BACKENDS)
    _numpy_only(backend, q=q, k=k, v=v)
    if (backend, "attention_varlen") in _DISPATCH:
        fn = _resolve(backend, "attention_varlen")
        o, lse = fn(q, k, v, cq, ck, causal=causal, scale=scale, window=window, config=config)
    else:
        o, lse = _varlen_by_sequence(q, k, v, cq, ck, causal, scale, window, backend, config)
    return (o, lse) if return_lse else o


def _varlen_by_sequence(q, k, v, cq, ck, causal, scale, window, backend, config):
    """Generic varlen: run the backend's batched kernel once per sequence (NumPy arrays)."""
    fn = _resolve(backend, "attention")
    q, k, v = (np.asarray(x) for x in (q, k, v))
    o = np.zeros_like(q)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=cv.accum_dtype(cv.dtype_name(q)))
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        ob, lb = fn(q[qs].transpose(1, 0, 2)[None], k[ks].transpose(1, 0, 2)[None],
                    v[ks].transpose(1, 0, 2)[None], causal=causal, scale=scale, window=window,
                    config=config)
        o[qs] = np.asarray(ob)[0].transpose(1, 0, 2)
        lse[:, qs] = np.asarray(lb)[0]
    return o, lse


# --------------------------------------------------------------------------- decode
def _check_decode(q, k, v, seq_lens):
    qs = tuple(getattr(q, "shape", ()) or ())
    if getattr(q, "shape", None) is None or len(qs) != 3:
        raise ValueError(f"q: expected rank 3 (batch, heads_q, head_dim) for decode, got shape {qs}")
    info = cv.check_qkv(_Shape4(q), k, v)
    lens = None
    if seq_lens is not None:
        ls = tuple(getattr(seq_lens, "shape", np.shape(seq_lens)))
        lens = np.asarray(seq_lens.get() if hasattr(seq_lens, "get") else seq_lens)
        if ls != (info["batch"],) or lens.dtype.kind not in "iu":
            raise ValueError(f"seq_lens: expected {info['batch']} integers (one per sequence), got "
                             f"shape {ls} dtype {lens.dtype}")
        if np.any(lens < 0) or np.any(lens > info["seqlen_k"]):
            raise ValueError(f"seq_lens: each length must be in [0, {info['seqlen_k']}], got {lens.tolist()}")
    return info, lens


class _Shape4:
    """A view of a decode q as (B, H, 1, d) for shape checks, without touching device memory."""

    def __init__(self, q):
        b, h, d = q.shape
        self.shape, self.dtype = (b, h, 1, d), q.dtype


def _window_kwargs(window, backend, fn):
    """``window`` as a backend keyword: passed only when bounded, and only to a backend that takes it."""
    window = cv.resolve_window(window)
    if window == (-1, -1):
        return {}
    takes = fn.accepts("window") if isinstance(fn, _Registered) else "window" in inspect.signature(fn).parameters
    if not takes:
        raise ValueError(f"window: the {backend!r} backend has no sliding-window decode; use window=None "
                         f"or backend 'naive', 'tiled', 'numba' or 'cupy'")
    return {"window": window}


def decode(q, k, v, num_splits=None, scale=None, backend="tiled", return_lse=False, seq_lens=None,
           config=None, window=None):
    """One new query token per sequence: q (B, Hq, d) over k, v (B, Hkv, N, d).

    ``seq_lens`` (B,) makes the cache ragged (sequence b uses keys [0, seq_lens[b]));
    ``num_splits`` splits each sequence's keys into that many chunks (Flash-Decoding);
    None picks it from the occupancy heuristic.  ``config``: the backend's decode config
    (the tiled backend's is a TileConfig whose ``block_k`` is the keys per tile; None: its
    default).  ``window`` (left, right): the query is the last position n - 1 (bottom-right
    alignment), so it sees key j iff j >= n - 1 - left; ``right`` cannot reach past the end.
    """
    info, lens = _check_decode(q, k, v, seq_lens)
    num_splits = _check_num_splits(num_splits)
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, info["head_dim"])
    fn = _resolve(backend, "decode")
    extra = _window_kwargs(window, backend, fn)
    _numpy_only(backend, q=q, k=k, v=v)
    o, lse = _call(fn, backend, dict(q=q, k=k, v=v), q, k, v, seq_lens=lens, num_splits=num_splits,
                   scale=scale, config=config, **extra)
    return (o, lse) if return_lse else o


def paged_decode(q, cache, seq_ids, num_splits=None, scale=None, backend="tiled", return_lse=False,
                 config=None, window=None):
    """Decode over a :class:`PagedKVCache`: q (len(seq_ids), Hq, d), one token per sequence.

    A quantized cache (``kv_dtype`` set) is read as its 1-byte codes and block scales and
    dequantized on chip by the 'tiled', 'numba' and 'cupy' kernels; ``window`` as in
    :func:`decode`.
    """
    from ..paged import PagedKVCache
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    if cache.keys_only:
        raise ValueError("cache: a keys-only cache (multi-head latent attention's) holds no V pool; "
                         "decode it with iokernels.mla.paged_mla_decode")
    if cache.quantized and backend not in QUANT_DECODE_BACKENDS:
        raise ValueError(f"cache: a {cache.kv_dtype} cache is dequantized by the "
                         f"{', '.join(map(repr, QUANT_DECODE_BACKENDS))} backends; the {backend!r} backend "
                         f"reads unquantized pools")
    seq_ids = list(seq_ids)
    for sid in seq_ids:
        cache._check_sid(sid)
    qs = tuple(getattr(q, "shape", ()) or ())
    if len(qs) != 3 or qs[0] != len(seq_ids) or qs[2] != cache.head_dim or qs[1] % cache.num_kv_heads:
        raise ValueError(f"q: expected shape ({len(seq_ids)}, a multiple of {cache.num_kv_heads} heads, "
                         f"{cache.head_dim}), got {qs}")
    if cv.dtype_name(q) != np.dtype(cache.dtype).name:
        raise ValueError(f"q: dtype must equal the cache's {np.dtype(cache.dtype).name}, got {cv.dtype_name(q)}")
    num_splits = _check_num_splits(num_splits)
    return_lse = cv.check_bool(return_lse, "return_lse")
    scale = cv.resolve_scale(scale, cache.head_dim)
    fn = _resolve(backend, "paged_decode")
    extra = _window_kwargs(window, backend, fn)
    _numpy_only(backend, q=q)
    o, lse = _call(fn, backend, dict(q=q, cache=cache), q, cache, seq_ids, num_splits=num_splits,
                   scale=scale, config=config, **extra)
    return (o, lse) if return_lse else o


def paged_gather(cache, sid, backend="numpy", config=None):
    """Sequence ``sid``'s K and V copied out of the cache's block pool, contiguous (Hkv, n, d).

    backend "numpy" (counted HBM traffic; "tiled" is accepted as its other name), "numba"
    or "cupy" (their gather kernels, chosen by ``config``).  What ``cache.gather`` calls.
    """
    from ..paged import PagedKVCache
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    sid = cache._check_sid(sid)
    cv.check_choice(backend, "backend", ("numpy", "tiled") + tuple(GPU_BACKENDS))
    if backend in GPU_BACKENDS:
        if cache.quantized or cache.keys_only:
            raise ValueError(f"backend: a {cache.kv_dtype or 'keys-only'} cache is gathered by the 'numpy' "
                             f"backend only; the {backend!r} gather copies unquantized K and V pools")
        fn = _Registered(backend, "paged_gather")
        return fn(cache, sid, config=config, need=dict(cache=cache))
    if config is not None:
        raise ValueError(f"config: the NumPy gather has no config, got {type(config).__name__}")
    return cache._gather_numpy(sid)


def merge_states(o_parts, lse_parts):
    """Exact log-sum-exp merge over axis 0: parts (S, ..., d) and (S, ...) -> (o, lse).

    Parts with LSE -inf (empty chunks) weigh nothing; all parts empty gives 0 and -inf.
    """
    from ..decode import merge_states as _merge
    os_, ls_ = tuple(np.shape(o_parts)), tuple(np.shape(lse_parts))
    if len(os_) < 2 or os_[:-1] != ls_:
        raise ValueError(f"lse_parts: shape must be o_parts' shape without its last axis "
                         f"({os_[:-1]}), got {ls_}")
    if os_[0] < 1:
        raise ValueError("o_parts: need at least one part on axis 0")
    o_parts, lse_parts = np.asarray(o_parts), np.asarray(lse_parts)
    lse64 = lse_parts.astype(np.float64)
    if np.any(np.isnan(lse64)) or np.any(np.isposinf(lse64)):
        bad = np.argwhere(np.isnan(lse64) | np.isposinf(lse64))[0]
        raise ValueError(f"lse_parts: {lse64[tuple(bad)]} at index {tuple(int(i) for i in bad)}; an LSE is "
                         f"finite, or -inf for an empty part (some libraries write +inf for an empty "
                         f"split: pass -inf there)")
    live = ~np.isneginf(lse64)
    o64 = o_parts.astype(np.float64)
    if not np.all(np.isfinite(o64[live])):
        bad = np.argwhere(live[..., None] & ~np.isfinite(o64))[0]
        raise ValueError(f"o_parts: non-finite value at index {tuple(int(i) for i in bad)} in a part whose "
                         f"LSE is finite")
    return _merge(o_parts, lse_parts)
