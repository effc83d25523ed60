"""The Triton backend's kernels, keyed by (op, version), and the calls that dispatch through them.

:data:`REGISTRY` holds one :class:`iokernels.core.records.Record` per (op, version), all
written in :data:`RECORDS` below.  The default for a call is the highest-ranked version
whose check passes.  Every check first asks whether Triton can run here at all
(:func:`.launch.unavailable`: triton and torch installed, and a CUDA GPU or Triton's
interpreter), then the dtype (float16, bfloat16, float32: the kernels accumulate in
float32; float64 runs on the numba and cupy backends) and the head dim (1..256).

This module imports neither triton nor torch: the records are readable (version tables,
the conformance suite's list) on a machine without them, where every check says what to
install.
"""
from __future__ import annotations

from ..core import api as core_api
from ..core import conventions as cv
from ..core.records import Record, held_back_reason
from ..core.registry import Need, Registry, forward_lengths
from . import backward as bwd
from . import decode as dec
from . import forward as fwd
from . import launch as ln
from .config import HELD_BACK, TRITON_DTYPES, BackwardConfig, DecodeConfig, ForwardConfig, check_head_dim

REGISTRY = Registry("triton")


def need(op: str, q=None, k=None, v=None, cache=None, *, causal=False, window=None) -> Need:
    """What a call needs: dtype and head dim (of q, or of the cache); ``extra["interpreter"]``
    says whether the kernels run on Triton's interpreter, ``extra["quantized"]`` whether a
    paged cache holds 1-byte codes; the forward's, its lengths and band
    (:func:`~iokernels.core.registry.forward_lengths`)."""
    extra: dict = {"interpreter": ln.interpreting() or not ln.cuda_gpu()}
    if cache is not None:
        dtype, d = cv.dtype_name(cache.k_pool), int(cache.head_dim)
        extra["quantized"] = bool(cache.quantized)
        if cache.quantized:
            dtype = cache.dtype.name
    else:
        x = q if q is not None else k
        dtype, d = cv.dtype_name(x), int(tuple(x.shape)[-1])
    extra.update(forward_lengths(op, q, k, causal, window))
    return Need(dtype=dtype, head_dim=d, cc=None, contiguous=True, simulator=extra["interpreter"], extra=extra)


def _reason(n: Need) -> str | None:
    why = ln.unavailable()
    if why is None and n.dtype not in TRITON_DTYPES:
        why = (f"dtype {n.dtype} is not one of {', '.join(TRITON_DTYPES)} (the Triton kernels accumulate in "
               f"float32; float64 runs on the numba and cupy backends)")
    if why is None:
        why = check_head_dim(n.head_dim)
    if why is None and n.extra.get("quantized"):
        why = "kv_dtype: the Triton paged decode reads unquantized pools"
    return why


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("triton", "attention", "v1", "triton_backend/forward_v1.py", "fwd_v1", ForwardConfig, fwd.attention_v1,
           "one program per Q tile, the online softmax over K/V tiles in a loop, every tile masked",
           _reason, 1),
    Record("triton", "attention", "v2", "triton_backend/forward_v2.py", "fwd_v2", ForwardConfig, fwd.attention_v2,
           "off-band key tiles in a loop with no mask or bounds check, on-band tiles masked; tiles "
           "autotuned from a list on a GPU", _reason, 2),
    *(Record("triton", op, "v1", "triton_backend/decode_v1.py", "split_kv", DecodeConfig, fn,
             "split-KV with the exact LSE merge; the query heads of one KV head share each K/V tile (GQA "
             "packed); paged: keys gathered through the block table", _reason, 1)
      for op, fn in (("decode", dec.decode), ("paged_decode", dec.paged_decode))),
    *(Record("triton", op, "v2", "triton_backend/decode_v1.py", "split_kv", DecodeConfig, fn,
             "v1's kernel four programs deep: the split count fills four programs a multiprocessor, each "
             "with a two-stage pipeline, so enough loads are in flight to stream at memory speed", _reason, 2)
      for op, fn in (("decode", dec.decode), ("paged_decode", dec.paged_decode))),
    *(Record("triton", op, "v3", "triton_backend/decode_v3.py", "split_kv_v3", DecodeConfig, fn,
             "v2 with a paged tile's block ids loaded a step ahead, so the pipeliner runs the paged K/V copies "
             "ahead; three programs an SM, three stages (held back from the default until measured)", _reason, 3,
             default_check=lambda need, op=op: held_back_reason(HELD_BACK, op, "v3"))
      for op, fn in (("decode", dec.decode), ("paged_decode", dec.paged_decode))),
    Record("triton", "attention_backward", "v1", "triton_backend/backward_v1.py", "dkdv", BackwardConfig,
           bwd.attention_backward, "FlashAttention-2's backward: P recomputed from the LSE, dK/dV by K/V tile over "
           "the GQA group, dQ by atomic adds or by a deterministic Q-tile pass", _reason, 1),
)
REGISTRY.add(*RECORDS)


# --------------------------------------------------------------------------- dispatch
def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Forward: the registry's kernel for this call (``config`` None: the default)."""
    return REGISTRY.call("attention", config, need("attention", q=q, k=k, v=v, causal=causal, window=window), q, k, v,
                         causal=causal, scale=scale, window=window)


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """Split-KV decode over a contiguous (ragged) cache: (o, lse)."""
    return REGISTRY.call("decode", config, need("decode", q=q, k=k, v=v), q, k, v, seq_lens=seq_lens,
                         num_splits=num_splits, scale=scale, window=window)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None, window=None):
    """Decode over a :class:`~iokernels.paged.PagedKVCache`: (o, lse)."""
    return REGISTRY.call("paged_decode", config, need("paged_decode", q=q, cache=cache), q, cache, seq_ids,
                         num_splits=num_splits, scale=scale, window=window)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None,
                       window=None):
    """Paged decode over device (or NumPy) pools and block tables: (o, lse)."""
    _, cfg = REGISTRY.resolve("paged_decode", config, need("paged_decode", q=q, k=k_pool, v=v_pool))
    return dec.paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                  config=cfg, window=window)


def planned_decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """``ik.decode(..., backend="triton")``'s path for torch tensors whose lengths are None or on
    q's device: the shape checks (no length is read on the host, so a CUDA graph can capture
    the call; :mod:`.decode` says what the lengths are trusted to be), then :func:`decode`.
    NotImplemented for anything else: the public path then checks the lengths on the host."""
    if not ln.is_torch(q) or not (seq_lens is None or (ln.is_torch(seq_lens) and seq_lens.device == q.device)):
        return NotImplemented
    core_api.check_decode(q, k, v, None)
    return decode(q, k, v, seq_lens=seq_lens, num_splits=core_api.check_num_splits(num_splits),
                  scale=cv.resolve_scale(scale, int(q.shape[-1])), config=config, window=window)


#: op -> the call :mod:`iokernels.api` asks first for ``backend="triton"``
PLANNED = {"decode": planned_decode}
