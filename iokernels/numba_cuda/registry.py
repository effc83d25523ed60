"""The Numba backend's kernels, keyed by (op, version), and the calls that dispatch through them.

:data:`REGISTRY` holds one :class:`iokernels.core.records.Record` per (op, version), all
written in :data:`RECORDS` below: its module and kernel, its launcher, its config class, one
line on what the version adds, its rank, a check that says whether it can run a call
(:func:`need` describes the call) and, for decode, its split launcher (``args``, bound into
the launcher).  The default for a call is the highest-ranked version whose check passes:

============  =======================================================================
op            default
============  =======================================================================
attention     v4 (every version runs every supported dtype and head dim; v5-v7 by name)
decode        v4 for C-contiguous float16 / float32 K/V with rows of whole 16-byte pairs
              (16-byte loads), else v3 when K and V are C-contiguous (it reads flat
              views), else v1 (any strides); v5 (v4 with exp2), v6 (v5 unchecked
              inside a split) by name
paged_decode  the same, on the pools
paged_gather  v1 (any strides); v3 on request (C-contiguous pools)
paged_        v1 (the one version: one launch for a packed batch of chunks, unquantized
prefill       pools, a cache block of K and V in shared memory)
attention_    v1 (the one version: FlashAttention-2's backward, atomic or deterministic dQ)
backward
============  =======================================================================

Every version refuses bfloat16 (these kernels are written for float16/32/64 only; the CuPy backend
runs it) and says so.  The module-level :func:`attention`, :func:`decode`,
:func:`paged_decode`, :func:`paged_decode_pools`, :func:`paged_prefill`, :func:`paged_gather` and
:func:`gather_pools` resolve the config through the registry and launch.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..core import conventions as cv
from ..core.records import Record, held_back_reason
from ..core.registry import Need, Registry, forward_lengths
from . import backward as bwd
from . import decode as dec
from . import decode_v3 as d3
from . import decode_v4 as d4
from . import decode_v5 as d5
from . import decode_v6 as d6
from . import forward as fwd
from . import forward_v5 as fv5
from . import forward_v6 as fv6
from . import forward_v7 as fv7
from . import gather as gat
from . import launch as ln
from . import paged_prefill as ppf
from .decode import smem_reason
from .policy import HELD_BACK
from .device import WORD_BYTES
from .config import (NUMBA_DTYPES, PAIR_DECODE_VERSIONS, PIPELINED_DECODE_VERSIONS, BackwardConfig, DecodeConfig,
                     ForwardConfig, GatherConfig, PrefillConfig)

REGISTRY = Registry("numba")


def need(op: str, q=None, k=None, v=None, cache=None, *, causal=False, window=None) -> Need:
    """What a call needs: dtype and head dim (of q, or of the cache), whether K/V (or the pools)
    are C-contiguous (NumPy input is copied contiguous), the compute capability (None on the
    simulator), and ``extra["group"]``: query heads per KV head (decode).  A quantized cache's
    need has its compute dtype (``cache.dtype``) and ``extra["kv_dtype"]`` /
    ``extra["scale_granularity"]``; the forward's, its lengths and band
    (:func:`~iokernels.core.registry.forward_lengths`)."""
    extra = {}
    if cache is not None:
        dtype, d, hkv = cv.dtype_name(cache.k_pool), int(cache.head_dim), int(cache.num_kv_heads)
        if cache.quantized:
            dtype = cache.dtype.name
            extra.update(kv_dtype=cache.kv_dtype, scale_granularity=cache.scale_granularity)
        contiguous = True
    else:
        x = q if q is not None else k
        dtype, d = cv.dtype_name(x), int(tuple(x.shape)[-1])
        hkv = None
        if k is not None and op in ("decode", "paged_decode"):
            hkv = int(k.shape[2] if op == "paged_decode" else k.shape[1])
        contiguous = all(isinstance(a, np.ndarray) or ln.c_contiguous(a) for a in (k, v) if a is not None)
        if k is not None and op in ("decode", "paged_decode"):        # NumPy input is copied aligned
            extra["aligned"] = all(isinstance(a, np.ndarray) or ln.aligned(a, WORD_BYTES) for a in (k, v))
    if q is not None and hkv:
        extra["group"] = max(1, int(q.shape[1]) // hkv)
    if cache is not None:
        extra["block_size"] = int(cache.block_size)
    extra.update(forward_lengths(op, q, k, causal, window))
    return Need(dtype=dtype, head_dim=d, cc=ln.compute_capability(), contiguous=contiguous,
                simulator=ln.simulated(), extra=extra)


# --------------------------------------------------------------------------- checks
def _dtype_reason(n: Need) -> str | None:
    if n.dtype == "bfloat16":
        return "the Numba kernels are written for float16/32/64 only (the CuPy backend runs bfloat16)"
    if n.dtype not in NUMBA_DTYPES:
        return f"dtype {n.dtype} is not one of {', '.join(NUMBA_DTYPES)}"
    if n.head_dim < 1:
        return f"head_dim {n.head_dim} < 1"
    return None


def _forward_check(version):
    def check(n: Need):
        why = _dtype_reason(n)
        if why is None:
            try:
                ForwardConfig(version=version).resolved(n.head_dim, n.dtype)
            except ValueError as e:
                why = str(e)
        return why
    return check


#: what split kernel v3 reads of a quantized cache: code formats and scale granularities
QUANT_KV = ("int8", "float8_e4m3fn")
QUANT_GRANULARITIES = ("block_head", "block")


def _quant_reason(version, n: Need) -> str | None:
    kv = n.extra.get("kv_dtype")
    if kv is None:
        return None
    if version != "v3":
        return f"kv_dtype: reads unquantized pools; a {kv} cache is read by split kernel v3"
    if kv not in QUANT_KV:
        return f"kv_dtype: {kv} codes are not decoded (v3 decodes {', '.join(QUANT_KV)})"
    if n.extra.get("scale_granularity") not in QUANT_GRANULARITIES:
        return f"scale_granularity: {n.extra.get('scale_granularity')!r} scales are not read by v3"
    return None


def _decode_check(version, needs_contiguous):
    def check(n: Need):
        why = _quant_reason(version, n) or _dtype_reason(n)
        if why is None and needs_contiguous and not n.contiguous:
            why = "k, v: not C-contiguous (this version reads K/V through flat views)"
        if why is None and version in PAIR_DECODE_VERSIONS:
            why = d4.pair_reason(n.dtype, n.head_dim)
            if why is None and not n.extra.get("aligned", True):
                why = (f"k, v: not on an 8-byte boundary ({version} reads words; v3 reads such K/V element by "
                       "element)")
        if why is None:
            why = smem_reason(DecodeConfig(version=version), n.head_dim, n.extra.get("group", 1), n.dtype)
        return why
    return check


def _gather_check(needs_contiguous):
    def check(n: Need):
        why = _dtype_reason(n)
        if why is None and needs_contiguous and not n.contiguous:
            why = "k_pool, v_pool: not C-contiguous (this version copies flat runs of the pools)"
        return why
    return check


def _backward_check(n: Need):
    why = _dtype_reason(n)
    if why is None:
        try:
            BackwardConfig().resolved(n.head_dim, n.dtype)
        except ValueError as e:
            why = str(e)
    return why


def _prefill_check(n: Need):
    why = _dtype_reason(n)
    if why is None and n.extra.get("kv_dtype") is not None:
        why = f"kv_dtype: reads unquantized pools; a {n.extra['kv_dtype']} cache is prefilled by the 'tiled' backend"
    if why is None and "block_size" in n.extra:
        why = ppf.launch_reason(PrefillConfig(), n.extra.get("group", 1), n.extra["block_size"], n.head_dim, n.dtype)
    return why


def _timed_at_float32(n: Need) -> str | None:
    """forward v7's default_check: the default where it was timed (float32), v4 elsewhere."""
    if n.dtype != "float32":
        return f"not the default at {n.dtype}: timed against SDPA's kernel at float32 only (v4 is the default)"
    return None


# --------------------------------------------------------------------------- the records
def _forward(version, rank, summary):
    kernel = "fwd_v3" if version == "v4" else f"fwd_{version}"          # v4: make_v3 with a 4-key step
    return Record("numba", "attention", version, "numba_cuda/forward.py", kernel, ForwardConfig,
                  fwd.attention, summary, _forward_check(version), rank)


def _decode(version, split, rank, needs_contiguous, summary):
    """One split kernel's records: decode over a contiguous cache and over the pools; a version
    :data:`.policy.HELD_BACK` names runs by name only (its summary says so)."""
    file = f"numba_cuda/decode_{version}.py" if version in PIPELINED_DECODE_VERSIONS else "numba_cuda/decode.py"
    name = "split" if version == "v1" else f"split_{version}"
    check = _decode_check(version, needs_contiguous)
    held = " (held back from the default until measured)" if ("decode", version) in HELD_BACK else ""
    return tuple(Record("numba", op, version, file, name, DecodeConfig, functools.partial(fn, split=split),
                        summary + held, check, rank, split,
                        default_check=lambda need, op=op: held_back_reason(HELD_BACK, op, version))
                 for op, fn in (("decode", dec.decode), ("paged_decode", dec.paged_decode)))


def _gather(version, rank, needs_contiguous, summary):
    kernel = "gather" if version == "v1" else "gather_v3"
    return Record("numba", "paged_gather", version, "numba_cuda/gather.py", kernel, GatherConfig, gat.paged_gather,
                  summary, _gather_check(needs_contiguous), rank)


#: forward ranks: v7 is the float32 default (its record: the Numba forward sweep of
#: benchmarks/results/sweeps/2026-12-07_1520_numba_fwd_v7_h100.json, well ahead of v4 at
#: B8 H16 N4096 d128, its GPU tests passed in the same call), v4 the default of the dtypes v7 was
#: not timed at; v5 and v6 run by name (config=ForwardConfig("v6")): the sweeps measured them
#: level with v4 (the simulator checks their numbers, not their speed).
#: decode ranks: v6 first, then v5, v4 and v3 (each where its checks pass: v4-v6 read 16-byte
#: pairs); where v3 cannot run (strided K/V) v1, the kernel written for any strides; v2 on request
#: (on strided K/V it loads elements, as v1 does).  A version named in policy.HELD_BACK runs by
#: name only until a recorded run shows it ahead
RECORDS = (
    _forward("v1", 1, "one thread per query row, K and V read from global memory by every row"),
    _forward("v2", 2, "the block stages K_j, V_j in shared memory once for all its rows (FlashAttention-2's loop)"),
    _forward("v3", 3, "several lanes a row and several rows a thread (register tiling), warp-shuffle sums"),
    _forward("v4", 4, "v3 with a 4-key step NVVM unrolls (scores in registers) and batched butterflies"),
    Record("numba", "attention", "v5", "numba_cuda/forward_v5.py", "fwd_v5", ForwardConfig, fv5.attention,
           "register tiling as a GEMM does it: each thread a TM x TN block of S and a TM-row block of O, "
           "Q_i and K_j/V_j in shared memory, no lane sums", _forward_check("v5"), 0),
    Record("numba", "attention", "v6", "numba_cuda/forward_v6.py", "fwd_v6", ForwardConfig, fv6.attention,
           "v5 with 16-byte shared-memory loads: W = 4 float32 values a load along the head dim, rows "
           "padded by one 16-byte bank group", _forward_check("v6"), 0),
    Record("numba", "attention", "v7", "numba_cuda/forward_v7.py", "fwd_v7", ForwardConfig, fv7.attention,
           "v6 with its K/V tile copies in 16-byte chunks: one vector load a chunk from the row's flat "
           "offset (C-contiguous, 16-byte aligned K/V; else v6's element copy)", _forward_check("v7"), 7,
           default_check=_timed_at_float32),
    *_decode("v1", dec.launch_split_v1, 2, False, "a key's dims over L lanes, element loads, split + combine"),
    *_decode("v2", dec.launch_split_v2, 1, False,
             "8-byte word loads unpacked by bit-casts in registers, unrolled loops"),
    *_decode("v3", d3.launch_split_v3, 3, True,
             "software-pipelined word loads, reduce-scatter lane sums, flat raw-pointer loads"),
    *_decode("v4", d4.launch_split_v4, 4, True,
             "v3 with 16-byte loads (two words by one vector load): half the lanes a key, so half the lane "
             "sums and softmax work a key"),
    *_decode("v5", d5.launch_split_v5, 5, True,
             "v4 with its scores in log2 units: every exponential one exp2 (the SFU's instruction), no expf "
             "argument reduction"),
    *_decode("v6", d6.launch_split_v6, 6, True,
             "v5 with no bounds checks in a split's interior (the steps whose keys and next keys all exist); "
             "v5's checked step for the last ones"),
    _gather("v1", 2, False, "a thread block per logical block, 8- or 4-byte words, loads before stores"),
    _gather("v3", 1, True, "a thread block per pool block, flat runs of 8-byte words, UN loads before stores"),
    Record("numba", "paged_prefill", "v1", "numba_cuda/paged_prefill.py", "paged_prefill", PrefillConfig,
           ppf.paged_prefill, "one launch for a packed batch of chunks: a block per (Q tile of a chunk, KV "
           "head), its query heads packed, one cache block of K/V staged in shared memory through the block "
           "table, bottom-right causal", _prefill_check, 1),
    Record("numba", "attention_backward", "v1", "numba_cuda/backward.py", "main_kernel", BackwardConfig,
           bwd.attention_backward, "FlashAttention-2's backward: K/V tile per block, dK/dV in registers over the "
           "GQA group, P recomputed from LSE, dQ by atomics or deterministic partials", _backward_check, 1),
)
REGISTRY.add(*RECORDS)


# --------------------------------------------------------------------------- dispatch
def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Forward: the registry's kernel for this call (``config`` None: the default)."""
    return REGISTRY.call("attention", config, need("attention", q=q, k=k, v=v, causal=causal, window=window), q, k, v,
                         causal=causal, scale=scale, window=window)


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """Flash-Decoding over a contiguous (ragged) cache: (o, lse)."""
    return REGISTRY.call("decode", config, need("decode", q=q, k=k, v=v), q, k, v, seq_lens=seq_lens,
                         num_splits=num_splits, scale=scale, window=window)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None, window=None):
    """Decode over a :class:`~iokernels.paged.PagedKVCache` (quantized: by v3): (o, lse)."""
    return REGISTRY.call("paged_decode", config, need("paged_decode", q=q, cache=cache), q, cache, seq_ids,
                         num_splits=num_splits, scale=scale, window=window)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None,
                       window=None, quant=None):
    """Paged decode over device (or NumPy) pools and a host block table: (o, lse).  ``quant``:
    None, or dict(kv=code format, k_scale, v_scale) for pools of 1-byte codes (uint8 views)
    and float32 scales (num_blocks, Hkv or 1) of the pools' kind."""
    n = need("paged_decode", q=q, k=k_pool, v=v_pool)
    if quant is not None:
        gran = "block_head" if int(quant["k_scale"].shape[1]) == int(k_pool.shape[2]) else "block"
        n = dataclasses.replace(n, extra=dict(n.extra, kv_dtype=quant["kv"], scale_granularity=gran))
    kernel, cfg = REGISTRY.resolve("paged_decode", config, n)
    return dec.paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                  config=cfg, split=kernel.args, window=window, quant=quant)


def paged_prefill(q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config=None):
    """Chunked prefill over a :class:`~iokernels.paged.PagedKVCache`, one launch: (o, lse (Hq, total_q))."""
    return REGISTRY.call("paged_prefill", config, need("paged_prefill", q=q, cache=cache), q, cache, seq_ids,
                         cu_seqlens_q, causal=causal, scale=scale)


def paged_gather(cache, sid, *, config=None):
    """What ``cache.gather(sid, backend="numba")`` calls: (k, v) of one sequence."""
    return REGISTRY.call("paged_gather", config, need("paged_gather", cache=cache), cache, sid)


def gather_pools(k_pool, v_pool, block_table, seq_len, *, words=True, config=None):
    """The paged gather on device (or NumPy) pools: (k, v) of the pools' kind."""
    _, cfg = REGISTRY.resolve("paged_gather", config, need("paged_gather", k=k_pool, v=v_pool))
    return gat.gather_pools(k_pool, v_pool, block_table, seq_len, words=words, config=cfg)
