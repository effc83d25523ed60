"""The checks and dispatch primitives under the public functions (:mod:`iokernels.api`).

All checks run before any work, so a bad call raises a ValueError that names the
argument and changes nothing.  This module knows no lesson: the public functions, one
level up in :mod:`iokernels.api`, hold the table of NumPy implementations and call the
checks here.

The GPU backends (Numba CUDA, CUDA C++ through CuPy, Triton) each own a kernel registry
(:mod:`iokernels.core.registry`), loaded by package name from :data:`GPU_BACKENDS`: a call
asks the backend what it needs (``need``: dtype, head dim, compute capability, contiguity),
the registry picks the version (the config's ``version``, or the best default that can run)
and its launcher runs it.  Every
op dispatches the same way: attention, decode, paged decode and paged gather all take
``config=``.

A GPU backend may also hold cached calls (its package's ``PLANNED``, found by
:func:`planned`): the public functions ask them first, and they run a plan made once per
shape for device arrays, or return NotImplemented, and the call goes the way above.

Inputs: the NumPy backends check that q, k and v are finite (a ValueError names the
array); the GPU backends do not scan device memory, and a non-finite input gives
non-finite output rows there.
"""
from __future__ import annotations

import importlib
import inspect
import numbers
from typing import Any, Callable

import numpy as np

from . import conventions as cv

BACKENDS = ("naive", "tiled", "numba", "cupy", "triton", "torch")
NUMPY_BACKENDS = ("naive", "tiled")
#: the backends whose paged decode reads a quantized cache's codes and scales
QUANT_DECODE_BACKENDS = ("tiled", "numba", "cupy")
#: the backends with a kernel registry: backend -> its package (loaded by name, on first use)
GPU_BACKENDS = {"numba": "iokernels.numba_cuda", "cupy": "iokernels.cupy_raw", "triton": "iokernels.triton_backend"}


def registry_of(backend: str) -> Any:
    """The kernel registry of GPU backend ``backend`` (imports the backend)."""
    cv.check_choice(backend, "backend", tuple(GPU_BACKENDS))
    return importlib.import_module(GPU_BACKENDS[backend]).REGISTRY


def gpu_implements(backend: str, op: str) -> bool:
    """Whether GPU backend ``backend`` registers ``op`` (False where it cannot be imported)."""
    if backend not in GPU_BACKENDS:
        return False
    try:
        return op in registry_of(backend).ops()
    except ImportError:
        return False


_PLANNED: dict = {}


def planned(backend: str, op: str) -> Callable | None:
    """GPU backend ``backend``'s cached call of ``op`` (its package's ``PLANNED``: a plan cache
    for device arrays that returns NotImplemented where it does not apply), or None.  Looked up
    once per (backend, op)."""
    if not isinstance(backend, str) or backend not in GPU_BACKENDS:
        return None
    fn = _PLANNED.get((backend, op), False)
    if fn is False:
        try:
            fn = getattr(importlib.import_module(GPU_BACKENDS[backend]), "PLANNED", {}).get(op)
        except ImportError:
            fn = None
        _PLANNED[(backend, op)] = fn
    return fn


class Registered:
    """A GPU backend's op as a callable: resolve the version for this call, then launch it."""

    #: where each op's arrays sit in its positional arguments (what ``need`` describes)
    _NEED_ARGS = {"attention": ("q", "k", "v"), "decode": ("q", "k", "v"), "paged_decode": ("q", "cache"),
                  "paged_prefill": ("q", "cache"),
                  "paged_gather": ("cache",), "attention_backward": (None, "q", "k", "v")}

    def __init__(self, backend: str, op: str):
        self.backend, self.op = backend, op
        self.module = importlib.import_module(GPU_BACKENDS[backend])
        if op not in self.module.REGISTRY.ops():
            have = sorted(b for b in GPU_BACKENDS if gpu_implements(b, op))
            raise ValueError(f"backend: {backend!r} does not implement {op}; GPU backends that do: "
                             f"{', '.join(have) or 'none'}")

    def accepts(self, name: str) -> bool:
        """Whether every registered version of this op takes keyword ``name``."""
        return all(name in inspect.signature(k.launcher).parameters for k in self.module.REGISTRY.kernels(self.op))

    def __call__(self, *args, config=None, need=None, **kw):
        if need is None:             # called directly (scripts): the arrays are the leading arguments
            need = {n: a for n, a in zip(self._NEED_ARGS[self.op], args) if n is not None}
        kernel, cfg = self.module.REGISTRY.resolve(self.op, config, self.module.need(self.op, **need))
        return kernel.launcher(*args, config=cfg, **kw)


def numpy_only(backend: str, **arrays) -> None:
    """The NumPy backends take NumPy arrays, and finite ones."""
    if backend in NUMPY_BACKENDS:
        for name, a in arrays.items():
            if a is not None and not isinstance(a, np.ndarray):
                raise ValueError(f"{name}: the {backend!r} backend works on NumPy arrays; got "
                                 f"{type(a).__module__}.{type(a).__name__} (use backend='numba' or 'cupy')")
        for name, a in arrays.items():
            if a is not None and name != "lse":
                cv.check_finite(a, name)


def call(fn: Callable, backend: str, need: dict, *args, **kw):
    """Run a resolved backend function; GPU backends also get what the call needs."""
    if backend in GPU_BACKENDS:
        return fn(*args, need=need, **kw)
    return fn(*args, **kw)


def check_num_splits(num_splits) -> int | None:
    """None, or a positive int (bools refused)."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits: expected None or an integer >= 1, got {num_splits!r}")
    return int(num_splits)


def check_backward_args(do, q, k, v, o, lse) -> dict:
    """The checks of a backward call: q, k, v as in the forward; do, o like q; lse (B, Hq, Nq)."""
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
    return info


def check_cu_pair(info: dict, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """Both cu_seqlens checked against the packed totals, and of equal length."""
    cq = cv.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", info["total_q"])
    ck = cv.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", info["total_k"])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_k: must have as many entries as cu_seqlens_q ({len(cq)}), got {len(ck)}")
    return cq, ck


def varlen_by_sequence(fn: Callable, q, k, v, cq, ck, causal, scale, window, config):
    """Generic varlen: run a backend's batched kernel ``fn`` once per sequence (NumPy arrays)."""
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
def check_decode(q, k, v, seq_lens) -> tuple:
    """(info, seq_lens as a NumPy array or None) of a decode call: q (B, Hq, d), k, v (B, Hkv, N, d)."""
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


def window_kwargs(window, backend: str, fn: Callable) -> dict:
    """``window`` as a backend keyword: passed only when bounded, and only to a backend that takes it."""
    window = cv.resolve_window(window)
    if window == (-1, -1):
        return {}
    takes = fn.accepts("window") if isinstance(fn, Registered) else "window" in inspect.signature(fn).parameters
    if not takes:
        raise ValueError(f"window: the {backend!r} backend has no sliding-window decode; use window=None "
                         f"or backend 'naive', 'tiled', 'numba' or 'cupy'")
    return {"window": window}


def _check_paged_cache(cache, seq_ids, backend: str, keys_only_hint: str) -> list:
    """The checks a paged decode and a paged prefill share: the cache's kind, the backend that
    can read it, and every sequence id; the ids as a list."""
    if cache.keys_only:
        raise ValueError("cache: a keys-only cache (multi-head latent attention's) holds no V pool" + keys_only_hint)
    if cache.quantized and backend not in QUANT_DECODE_BACKENDS:
        raise ValueError(f"cache: a {cache.kv_dtype} cache is dequantized by the "
                         f"{', '.join(map(repr, QUANT_DECODE_BACKENDS))} backends; the {backend!r} backend "
                         f"reads unquantized pools")
    seq_ids = list(seq_ids)
    for sid in seq_ids:
        cache._check_sid(sid)
    return seq_ids


def _check_q_dtype(q, cache) -> None:
    if cv.dtype_name(q) != np.dtype(cache.dtype).name:
        raise ValueError(f"q: dtype must equal the cache's {np.dtype(cache.dtype).name}, got {cv.dtype_name(q)}")


def check_paged_decode(q, cache, seq_ids, backend: str) -> list:
    """The checks of a paged decode call on a (type-checked by the caller) paged cache; the ids as a list."""
    seq_ids = _check_paged_cache(cache, seq_ids, backend, "; decode it with iokernels.mla.paged_mla_decode")
    qs = tuple(getattr(q, "shape", ()) or ())
    if len(qs) != 3 or qs[0] != len(seq_ids) or qs[2] != cache.head_dim or qs[1] % cache.num_kv_heads:
        raise ValueError(f"q: expected shape ({len(seq_ids)}, a multiple of {cache.num_kv_heads} heads, "
                         f"{cache.head_dim}), got {qs}")
    _check_q_dtype(q, cache)
    return seq_ids


def check_paged_prefill(q, cache, seq_ids, cu_seqlens_q, backend: str) -> tuple:
    """The checks of a paged prefill call: (seq ids as a list, cu_seqlens_q as a NumPy array).

    Sequence b's chunk (rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q) must already be the
    last rows the cache holds for seq_ids[b], so it can be no longer than that sequence.
    """
    seq_ids = _check_paged_cache(cache, seq_ids, backend, "")
    qs = tuple(getattr(q, "shape", ()) or ())
    if len(qs) != 3 or qs[2] != cache.head_dim or qs[1] < 1 or qs[1] % cache.num_kv_heads:
        raise ValueError(f"q: expected shape (total_q, a multiple of {cache.num_kv_heads} heads, "
                         f"{cache.head_dim}), got {qs}")
    _check_q_dtype(q, cache)
    cq = cv.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qs[0])
    if len(cq) != len(seq_ids) + 1:
        raise ValueError(f"cu_seqlens_q: expected len(seq_ids) + 1 = {len(seq_ids) + 1} offsets, got {len(cq)}")
    for b, sid in enumerate(seq_ids):
        n_q, n = int(cq[b + 1] - cq[b]), cache.seq_len(sid)
        if n_q > n:
            raise ValueError(f"cu_seqlens_q: sequence {sid} has a chunk of {n_q} queries but the cache holds "
                             f"{n} of its tokens; append the chunk's K and V before attending")
    return seq_ids, cq


def gpu_gather(cache, sid, backend: str, config=None):
    """A paged cache's sequence gathered by GPU backend ``backend``'s registered kernels."""
    if cache.quantized or cache.keys_only:
        raise ValueError(f"backend: a {cache.kv_dtype or 'keys-only'} cache is gathered by the 'numpy' "
                         f"backend only; the {backend!r} gather copies unquantized K and V pools")
    return Registered(backend, "paged_gather")(cache, sid, config=config, need=dict(cache=cache))


def check_merge_parts(o_parts, lse_parts) -> tuple:
    """The checks of an LSE merge; the parts as NumPy arrays."""
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
    return o_parts, lse_parts
