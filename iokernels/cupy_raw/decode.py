"""Flash-Decoding in CUDA C++: the launchers of decode.cu and decode_v2.cu ... decode_v8.cu.

One new query token per sequence over a contiguous cache (B, Hkv, N, d) or a paged pool
(num_blocks, block_size, Hkv, d) read through a block table.  Every version splits each
sequence's keys into S chunks (one thread block per (split, kv head, sequence), GQA
packed: a block reads each K/V row once for all g query heads of its group), writes a
normalised partial O_s and its LSE_s, and merges them exactly:
O = sum_s exp(LSE_s - LSE) O_s, LSE = log sum_s exp(LSE_s).  The versions differ in how
the K/V bytes reach the block (:mod:`iokernels.cupy_raw` has the table) and where the
merge runs (decode.cu's combine kernel, or inside the split kernels of v3 to v5), and
which cores compute q . k and p v (CUDA cores; v4, v5: the tensor cores).

A quantized :class:`~iokernels.paged.PagedKVCache` (``kv_dtype`` "int8" or "float8_e4m3fn")
is read by v1, v3 and v5 as it is stored: 1-byte codes and the float32 scale of each row's
block (per KV head or per block), so K and V cross HBM at 1 byte a value.  v1 and v3 decode
the codes to float32 in registers; v5 turns them into float16 tensor-core operands
(decode_v5.cu, mma_codes.cuh), with the scales applied to S's and P's columns.
``window=(left, right)``: the query is the last key n - 1, so it sees keys
[n - 1 - left, n); only those are split among the blocks (and counted by the split
heuristic), keys before them are never read.

Notation (Flash-Decoding, Dao et al., 2023; PagedAttention, Kwon et al., 2023):

=======  ===========================================================================
S        splits of the key axis (num_splits); :func:`.policy.decode_wave_splits` picks it
g        query heads per KV head (GQA group)
O_s      the partial output of split s, normalised, in the accumulator dtype (HBM)
LSE_s    its log-sum-exp (natural log); a split with no keys has LSE_s = -inf
s_K, s_V a quantized block's scales: a stored code c stands for c * s
(l, r)   ``window``: keys j >= n - 1 - l are visible (r bounds nothing past the last key)
=======  ===========================================================================
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from ..core.records import Record
from . import decode_config as C
from .decode_config import DecodeConfig
from .decode_launch import (COMBINE_MAX_THREADS, COUNTERS_MIN, V3_COMPILE_SMEM, SplitArgs,  # noqa: F401
                            _args_v1, _args_v2, _args_v3, _args_v4, _args_v5, _smem_v3, _smem_v4, _smem_v5,
                            launch_combine, num_splits_for, pack, split_dynamic, split_launch,
                            split_static)
from .launch import HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, current_stream_ptr, device_info, on_stream, unit_rows
from .decode_v6_config import check_decode_v6, decode_v6_smem, v6_default_check
from .decode_v8_config import args_v8, check_decode_v8, smem_v8, v8_default_check
from .policy import decode_v8_splits, default_check_for, held_back_note
from .registry import (REGISTRY, check_decode_v1, check_decode_v2, check_decode_v3, check_decode_v4,
                       check_decode_v5, check_decode_v7, need)


#: decode v5 (a quantized cache) rounds P' = P s_V / sigma (<= 1) to float16: a relative
#: half-ulp and the subnormal half-step (mma_codes.cuh)
V5_P_REL = 2.0 ** -11
V5_P_SUB = 2.0 ** -25


def v5_rounding_bound(v_hat_max: float, keys) -> np.ndarray:
    """How far decode v5's O over a quantized cache can be from the exact decode of the values
    the cache holds, from rounding P' to float16: (2^-11 + 2 n 2^-25) max|V| for a row over
    n = ``keys`` keys (sigma times the largest code is below twice its block's largest value).
    The float32 sums' order and O's rounding to its dtype come on top."""
    return (V5_P_REL + 2 * np.asarray(keys, np.float64) * V5_P_SUB) * float(v_hat_max)


#: decode v3's fused-combine counters: one int32 workspace per (device, stream), zero between
#: calls (the last block of each group sets its counter back to 0).  Keyed by stream so two
#: streams never share counts; allocated by the caller's library and zeroed on its stream.
#: (A :class:`~iokernels.cupy_raw.plans.DecodePlan` owns its own.)
_DECODE_COUNTERS: dict = {}


def _decode_counters(n: int, like):
    """At least ``n`` zeroed int32 counters for decode v3 on ``like``'s device and the current
    stream (the caller's: the launch runs inside :func:`.launch.on_stream`), allocated by
    ``like``'s library."""
    dev = getattr(like, "device", None)
    key = (type(like), getattr(dev, "id", getattr(dev, "index", None)), current_stream_ptr())
    buf = _DECODE_COUNTERS.get(key)
    if buf is None or device_array(buf).size < n:
        buf = zeroed(Call(like, name="o"), max(n, COUNTERS_MIN))
        _DECODE_COUNTERS[key] = buf
    return buf


def zeroed(call, n: int):
    """``n`` int32 zeros from ``call``'s library, zeroed on the current stream (a memset
    kernel: no host copy)."""
    buf = call.empty((n,), "int32")
    if hasattr(buf, "zero_"):
        buf.zero_()
    else:
        buf.fill(0)
    return buf


# --------------------------------------------------------------------------- argument checks
def _check_decode_q(q, heads_kv, d, dtype):
    s = tuple(getattr(q, "shape", ()))
    if len(s) != 3 or s[2] != d or s[1] % heads_kv:
        raise ValueError(f"q: expected (batch, a multiple of {heads_kv} heads, {d}), got {s}")
    if cv.dtype_name(q) != dtype:
        raise ValueError(f"q: dtype must equal the cache's {dtype}, got {cv.dtype_name(q)}")


def _host(x) -> np.ndarray:
    """Lengths or tables as a host array (they are checked on the host, then uploaded once)."""
    if hasattr(x, "get"):
        return np.asarray(x.get())
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _window_left(window) -> int:
    """The window's left extent as the kernels take it (-1: unbounded)."""
    return cv.resolve_window(window)[0]


def _visible(lens: np.ndarray, left: int) -> np.ndarray:
    """Per sequence, the keys its query sees: min(n, left + 1), or n when unbounded."""
    return lens if left < 0 else np.minimum(lens, left + 1)


def _check_tables(tables, lens, num_blocks, block_size, name="block_tables"):
    """Every block a sequence uses is a real block of the pool (vectorized: tables can be long)."""
    need_blocks = -(-lens // block_size)
    cols = np.arange(tables.shape[1])[None, :]
    used = cols < need_blocks[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{name}: sequence {b}, entry {j} is block {int(tables[b, j])}, outside [0, {num_blocks})")


def check_paged_lengths(block_tables, seq_lens, batch, num_blocks, block_size):
    """Host copies (tables, lens int64) of a paged call's block tables (batch, max_blocks) and
    lengths, checked: every length fits its table, every block it uses is in the pool."""
    tables = _host(block_tables)
    lens = _host(seq_lens).astype(np.int64)
    if tables.ndim != 2 or tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected ({batch}, max_blocks), got {tables.shape}")
    cap = tables.shape[1] * block_size
    if lens.shape != (batch,) or np.any(lens < 0) or np.any(lens > cap):
        raise ValueError(f"seq_lens: expected {batch} lengths in [0, {cap}], got {lens.tolist()}")
    _check_tables(tables, lens, num_blocks, block_size)
    return tables, lens


def check_pools(k_pool, v_pool):
    """(num_blocks, block_size, heads_kv, head_dim, dtype) of two matching pools."""
    ps = tuple(getattr(k_pool, "shape", ()))
    if len(ps) != 4:
        raise ValueError(f"k_pool: expected (num_blocks, block_size, heads_kv, head_dim), got {ps}")
    dtype = cv.check_dtype(k_pool, "k_pool")
    if tuple(getattr(v_pool, "shape", ())) != ps or cv.dtype_name(v_pool) != dtype:
        raise ValueError(f"v_pool: must match k_pool's shape {ps} and dtype {dtype}")
    return (*ps, dtype)


def _check_cache(q, k, v):
    """(B, Hkv, N, d, dtype) of a contiguous cache k, v (B, Hkv, N, d) and its q (B, Hq, d)."""
    ks = tuple(getattr(k, "shape", ()))
    if len(ks) != 4:
        raise ValueError(f"k: expected (batch, heads_kv, seq, head_dim), got {ks}")
    B, Hkv, N, d = ks
    dtype = cv.check_dtype(k, "k")
    _check_decode_q(q, Hkv, d, dtype)
    if tuple(v.shape) != ks or cv.dtype_name(v) != dtype:
        raise ValueError(f"v: expected shape {ks} and dtype {dtype}, got {tuple(v.shape)} {cv.dtype_name(v)}")
    if q.shape[0] != B:
        raise ValueError(f"q: batch must equal k's {B}, got {q.shape[0]}")
    return B, Hkv, N, d, dtype


# --------------------------------------------------------------------------- contiguous cache
def run_decode(q, k, v, *, seq_lens, num_splits, scale, config, window=None, kernel=None):
    """Decode over a contiguous cache with a resolved config: (O, LSE) of q's kind (``kernel``:
    launch_decode's)."""
    B, Hkv, N, d, dtype = _check_cache(q, k, v)
    lens = None
    if seq_lens is not None:
        lens = _host(seq_lens).astype(np.int64)
        if lens.shape != (B,) or np.any(lens < 0) or np.any(lens > N):
            raise ValueError(f"seq_lens: expected {B} lengths in [0, {N}], got {lens.tolist()}")
    scale = cv.resolve_scale(scale, d)
    call = Call(q)
    acc = cv.accum_dtype(dtype).name
    with on_stream(call.stream_ptr()):
        qd = unit_rows(contiguous(call.to_device(q, "q")))
        kd, vd = unit_rows(call.to_device(k, "k")), unit_rows(call.to_device(v, "v"))
        lens_d = None if lens is None else call.constant(lens.astype(np.int32))
        left = _window_left(window)
        longest = int(_visible(np.full(B, N) if lens is None else lens, left).max(initial=0))
        o, lse = call.empty(q.shape, dtype), call.empty(q.shape[:2], acc)
        launch_decode(qd, kd, vd, lens_d, o, lse, dtype=dtype, scale=scale, num_splits=num_splits,
                      longest=longest, nk=N, config=config, window_left=left, kernel=kernel)
    return call.finish(o, dtype), call.finish(lse, acc)


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """Flash-Decoding over a contiguous cache: q (B, Hq, d), k, v (B, Hkv, N, d) -> (O, LSE).

    ``config``: a :class:`DecodeConfig` (None, or version None: the registry's default);
    ``window`` (left, right): the query (key n - 1) sees keys [n - 1 - left, n)."""
    _check_cache(q, k, v)
    kernel, cfg = REGISTRY.resolve("decode", config, need("decode", q=q, k=k, v=v))
    return kernel.launcher(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=cfg,
                           window=window)


# --------------------------------------------------------------------------- paged cache
def run_paged_decode(q, cache, seq_ids, *, num_splits, scale, config, window=None):
    """Decode over a PagedKVCache with a resolved config.  Its pools (and a quantized cache's
    scales) are NumPy arrays: they are copied to the device on every call
    (:func:`paged_decode_pools` takes device pools)."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    quant = None
    if cache.quantized:
        quant = dict(kv=cache.kv_dtype, dtype=cache.dtype.name, k_scale=cache.k_scale, v_scale=cache.v_scale)
    return _paged_pools(q, cache.k_pool, cache.v_pool, tables, lens, num_splits=num_splits, scale=scale,
                        config=config, window=window, quant=quant)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None, window=None):
    """Decode over a :class:`~iokernels.paged.PagedKVCache` (``config``: a :class:`DecodeConfig`;
    a quantized cache is read as its codes and scales, by v1, v3 and v5)."""
    _check_decode_q(q, cache.num_kv_heads, cache.head_dim, np.dtype(cache.dtype).name)
    kernel, cfg = REGISTRY.resolve("paged_decode", config, need("paged_decode", q=q, cache=cache))
    return kernel.launcher(q, cache, seq_ids, num_splits=num_splits, scale=scale, config=cfg, window=window)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None,
                       config=None, window=None, quant=None):
    """Decode over paged pools (num_blocks, block_size, Hkv, d) with int32 block tables (B, max_blocks).

    Pools on the device (CuPy, torch CUDA) are used in place, through their strides when
    their rows have unit stride (a heads-outer pool passed as its (blocks, slots, Hkv, d)
    view, say); NumPy pools are copied in.  ``config``: a :class:`DecodeConfig`.
    ``quant``: None, or dict(kv=code format, k_scale, v_scale) for pools of 1-byte codes
    (uint8 or int8) with float32 scales (num_blocks, Hkv or 1), NumPy or of q's kind; the
    queries' dtype is then the compute dtype.
    """
    quant, (_, _, Hkv, d, dtype), n = pools_need(q, k_pool, v_pool, quant)
    _check_decode_q(q, Hkv, d, dtype)
    kernel, cfg = REGISTRY.resolve("paged_decode", config, n)
    return _paged_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=scale, config=cfg,
                        window=window, quant=quant)


def pools_need(q, k_pool, v_pool, quant):
    """(quant with the compute dtype added, (num_blocks, block_size, Hkv, d, dtype) of the
    pools, the registry's Need) of a paged-pools decode; ``quant`` None for a 16-bit cache."""
    if quant is None:
        shape = check_pools(k_pool, v_pool)
        return None, shape, need("paged_decode", q=q, k=k_pool, v=v_pool)
    quant = dict(quant, dtype=cv.dtype_name(q))
    shape = _quant_pools(k_pool, v_pool, quant)
    n = need("paged_decode", q=q, k=k_pool, v=v_pool)
    gran = "block_head" if int(quant["k_scale"].shape[1]) == shape[2] else "block"
    return quant, shape, replace(n, dtype=shape[4], extra=dict(n.extra, kv_dtype=quant["kv"],
                                                               scale_granularity=gran))


def _quant_pools(k_pool, v_pool, quant):
    """(num_blocks, block_size, Hkv, d, compute dtype) of a quantized cache's code pools."""
    ps = tuple(k_pool.shape)
    size = [x.element_size() if hasattr(x, "element_size") else x.itemsize for x in (k_pool, v_pool)]
    if tuple(v_pool.shape) != ps or size != [1, 1]:
        raise ValueError(f"v_pool: a {quant['kv']} cache's pools are 1-byte codes of one shape, got {ps}, "
                         f"{tuple(v_pool.shape)}")
    return (*ps, quant["dtype"])


def _paged_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits, scale, config, window=None, quant=None,
                 kernel=None):
    nb, bs, Hkv, d, dtype = check_pools(k_pool, v_pool) if quant is None else _quant_pools(k_pool, v_pool, quant)
    _check_decode_q(q, Hkv, d, dtype)
    B = q.shape[0]
    tables, lens = check_paged_lengths(block_tables, seq_lens, B, nb, bs)
    scale = cv.resolve_scale(scale, d)
    left = _window_left(window)
    call = Call(q)
    acc = cv.accum_dtype(dtype).name
    with on_stream(call.stream_ptr()):
        qd = unit_rows(contiguous(call.to_device(q, "q")))
        kp, vp = _pool_device(call, k_pool, "k_pool"), _pool_device(call, v_pool, "v_pool")
        kv = None
        if quant is not None:                       # the scales travel as the pools do
            ks, vs = (_scales_device(call, quant[n], n) for n in ("k_scale", "v_scale"))
            kv = dict(kv=quant["kv"], k_scale=ks, v_scale=vs, scale_blk=ks.shape[1],
                      scale_head=int(ks.shape[1] == Hkv))
        # lengths and tables travel in one host -> device copy, made once while their content
        # stays the same (Call.constant): lens = packed[:B], the tables after it
        packed = device_array(call.constant(np.concatenate([lens.astype(np.int32),
                                                             tables.astype(np.int32).ravel()])))
        o, lse = call.empty(q.shape, dtype), call.empty(q.shape[:2], acc)
        launch_decode(qd, kp, vp, _offset(packed, 0, (B,)), o, lse, dtype=dtype, scale=scale,
                      num_splits=num_splits, paged=(_offset(packed, B, tables.shape), bs),
                      longest=int(_visible(lens, left).max(initial=0)), nk=0, config=config,
                      window_left=left, quant=kv, kernel=kernel)
    return call.finish(o, dtype), call.finish(lse, acc)


def _pool_device(call, pool, name):
    """A pool as the kernels see it: device pools of the caller's kind in place (their rows
    unit-stride, other strides kept); NumPy pools (a PagedKVCache's) copied in by the
    caller's library, whatever kind q is."""
    if isinstance(pool, np.ndarray):
        a = np.ascontiguousarray(pool)
        if a.dtype.name in ("bfloat16", "float8_e4m3fn"):       # ml_dtypes: their bits, as unsigned ints
            a = a.view(np.uint16 if a.itemsize == 2 else np.uint8)
        return device_array(call.from_host(a))
    return unit_rows(call.to_device(pool, name))


def _scales_device(call, s, name):
    """A quantized cache's float32 scales (num_blocks, Hkv or 1), contiguous on the device:
    NumPy ones (a PagedKVCache's) copied in as the pools are, device ones used in place."""
    if isinstance(s, np.ndarray):
        return device_array(call.from_host(np.ascontiguousarray(s, np.float32)))
    return check_device_scales(device_array(call.to_device(s, name)), name)


def check_device_scales(a, name):
    """``a`` (a device array) when it is contiguous float32 (num_blocks, Hkv or 1), else a ValueError."""
    if a.dtype != "float32" or len(a.shape) != 2 or not a.c_contiguous():
        raise ValueError(f"{name}: expected contiguous float32 scales (num_blocks, Hkv or 1), got {a.dtype} "
                         f"{a.shape}")
    return a


def _offset(a, start: int, shape: tuple):
    """A view of int32 device array ``a`` from element ``start``, as ``shape`` (row-major)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return type(a)(a.ptr + 4 * start, tuple(shape), tuple(reversed(strides)), a.dtype, a.itemsize, a.owner)



def _smem_v6(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0):
    # decode_v6.cu: the teams' rings (swizzled rows allocated exactly, as v4)
    return decode_v6_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"], defines["NUM_WARPS"],
                          num_splits, fused, table_cap, swizzled=C.decode_v4_swizzled(d))


# --------------------------------------------------------------------------- the launch
def launch_decode(qd, kd, vd, lens_d, o, lse, *, dtype, scale, num_splits=None, paged=None,
                  longest=None, nk=None, config, window_left=-1, quant=None, kernel=None):
    """Split kernel (+ combine when num_splits > 1 and the version does not fuse it) on
    device arrays.

    ``window_left``: the sliding window's left extent (-1: none); ``longest`` is then the most
    keys a query sees.  ``quant`` (paged only): None, or dict(kv=code format, k_scale, v_scale
    (float32 device arrays (num_blocks, Hkv or 1)), scale_blk, scale_head (the scales'
    strides a block and a KV head)); kd, vd are then the 1-byte code pools.

    ``lens_d``: int32 device lengths (B,), or None when every sequence uses all ``nk`` keys.
    ``paged``: None for a contiguous cache, else (block_tables int32 device array (B, max_blocks),
    block_size): then kd, vd are the pools (num_blocks, block_size, Hkv, d).
    ``num_splits`` None: :func:`.policy.decode_wave_splits` for ``longest`` keys at the
    kernel's occupancy.  ``config``: a :class:`DecodeConfig` with its version set.  Scratch
    (the partials) comes from the library that owns ``o``.  ``kernel``: a
    :class:`~iokernels.core.records.Record` to launch instead of the version's (the sweeps'
    load experiments; its defines are the version's plus its ``extra["defines"]``).
    """
    qd, kd, vd, o, lse = (device_array(a) for a in (qd, kd, vd, o, lse))
    B, Hq, d = qd.shape
    Hkv = kd.shape[2] if paged is not None else kd.shape[1]
    nk = int(nk if nk is not None else (kd.shape[2] if paged is None else 0))
    if B * Hq == 0:
        return
    if qd.strides != (Hq * d, d, 1):
        raise ValueError("q: decode needs a contiguous (batch, heads_q, head_dim) q")
    if config.version is None:
        raise ValueError("config.version: launch_decode needs a resolved config (REGISTRY.resolve)")
    aligned = all(a.aligned(C.CHUNK_BYTES) for a in (qd, kd, vd))
    if config.version != "v1" and not aligned:
        raise ValueError(f"config.version: {config.version} needs rows that start on 16 bytes (use 'v1')")
    longest = nk if longest is None else longest
    spec = kernel or REGISTRY.get("paged_decode" if paged is not None else "decode", config.version)
    st = split_static(spec, config, batch=B, heads_q=Hq, heads_kv=Hkv, head_dim=d, dtype=dtype,
                      paged=paged is not None, block_size=paged[1] if paged is not None else 0, aligned=aligned,
                      kv=None if quant is None else quant["kv"], dev=device_info())
    S, smem, table, grid, st = split_launch(st, num_splits, longest)
    i32, i64 = np.int32, np.int64
    if S > 1:
        scratch = Call(o.owner, name="o")
        o_part = device_array(scratch.empty((S, B, Hq, d), np.dtype(st.acc).name))
        lse_part = device_array(scratch.empty((S, B, Hq), np.dtype(st.acc).name))
        parts = (o_part.arg, lse_part.arg)
    else:
        parts = (np.uint64(0), np.uint64(0))           # unused by the kernel when S == 1
    if paged is None:
        cache = (*map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]))
    else:
        tables = device_array(paged[0])
        cache = (tables.arg, i32(tables.shape[1]), *map(i64, kd.strides[:3]))
    scales = () if quant is None else (quant["k_scale"].arg, quant["v_scale"].arg, i32(quant["scale_blk"]),
                                       i32(quant["scale_head"]))
    lens_arg = device_array(lens_d).arg if lens_d is not None else np.uint64(0)
    counters = device_array(_decode_counters(B * st.heads_grid, o.owner)).arg if st.fused and S > 1 else np.uint64(0)
    args = pack(st, S, table, q=qd.arg, k=kd.arg, v=vd.arg, cache=cache, scales=scales, lens=lens_arg, nk=nk,
                scale=scale, window_left=window_left, parts=parts, counters=counters, o=o.arg, lse=lse.arg)
    st.fn(grid, (st.threads,), args, shared_mem=smem)
    if S > 1 and not st.fused:                         # decode.cu's combine
        launch_combine(st, S, o_part.arg, lse_part.arg, o.arg, lse.arg)


# --------------------------------------------------------------------------- the records
def _records(version, file, kernel, args, check, rank, summary, ops=("decode", "paged_decode"), default_check=None,
             **extra):
    """One version's records: the same kernel over a contiguous cache and a paged one, each
    with a ``default_check``: ``default_check(op)``, else :data:`.policy.HELD_BACK`'s (None while
    neither op is listed).  ``extra`` holds what DecodeConfig reads
    (:func:`.decode_config.decode_facts`: ``layout``, the caches it ``reads``) and what the
    launch reads (``smem``: the SRAM of a ring-fused layout)."""
    return tuple(Record("cupy", op, version, file, kernel, DecodeConfig,
                        run_decode if op == "decode" else run_paged_decode, summary + held_back_note(op, version),
                        check, rank, args, extra,
                        default_check(op) if default_check else default_check_for(op, version))
                 for op in ops)


#: ranks: v5 (tensor cores, 1-byte codes) for a quantized paged cache where its check passes, v4
#: (tensor cores, 16-bit) for a 16-bit cache up to a group of 16 query heads, v6 (v4 with teams
#: of warps) past 16 where :data:`.policy.HELD_BACK` lets it, else v3; v5 and v4 never both
#: pass; v2 is v3 without its two additions: not a default
RECORDS = (
    *_records("v1", "decode.cu", "decode_split", _args_v1, check_decode_v1, 10,
              "each warp reads its key rows with plain 16-byte loads into registers, four rows a lane in "
              "flight; decode.cu's combine kernel merges the splits", layout="plain", reads=("16-bit", "codes")),
    *_records("v2", "decode_v2.cu", "decode_split_v2", _args_v2, check_decode_v2, 0,
              "K/V tiles stream through a per-warp cp.async ring in SRAM (copies in flight hold no "
              "registers), only __syncwarp in the key loop", layout="ring", reads=("16-bit",)),
    *_records("v3", "decode_v3.cu", "decode_split_v3", _args_v3, check_decode_v3, 30,
              "v2's ring at 8 warps x 4 stages, the combine fused into the split kernel (the last block of "
              "a group merges), paged block-table entries staged in SRAM",
              layout="ring_fused", reads=("16-bit", "codes"), smem=_smem_v3),
    *_records("v4", "decode_v4.cu", "decode_split_v4", _args_v4, check_decode_v4, 40,
              "v3's ring and fused combine with S = Q_g K^T and O += P V on the tensor cores (mma.sync "
              "m16n8k16, the g query heads as the rows of the A operand, P kept in registers)",
              layout="tensor_core", reads=("16-bit",), smem=_smem_v4),
    # v5 reads quantized caches, which are paged only
    *_records("v5", "decode_v5.cu", "decode_split_v5", _args_v5, check_decode_v5, 50,
              "v4 reading a quantized paged cache as it is stored: 1-byte codes turned into float16 "
              "tensor-core operands in registers, the per-key scales applied to S's and P's columns",
              ops=("paged_decode",), layout="tensor_core", reads=("codes",), smem=_smem_v5),
    # v6 takes the groups v4 refuses (more than 16 query heads a KV head).  racecheck reported
    # hazards while its teams ordered the ring with named barriers; with the block barrier all
    # four sanitizers are clean on it (benchmarks/results/sanitizer_2026-12-05.txt).  It left
    # policy.HELD_BACK on the cliff section of benchmarks/results/h100_2026-12-05_cliff_serve.json
    # (v6 beside v3 / v1 at g = 32, 64) and its GPU tests; past 64 query heads (one team of 8
    # warps) the default waits for the same at those groups (policy.decode_v6_default_at); its
    # arguments are v4's
    *_records("v6", "decode_v6.cu", "decode_split_v6", _args_v4, check_decode_v6, 35,
              "v4 with a group past 16 query heads split across a team of warps (16 rows each) sharing each "
              "K/V tile of its cp.async ring: g = 32, 64 and MQA read K/V once a KV head",
              layout="tensor_core", reads=("16-bit",), smem=_smem_v6, default_check=v6_default_check),
    # v7 takes the groups v3's registers do not hold (float32 from 8 query heads a KV head at
    # head_dim 128, float64, 16-bit rows v4 and v6 do not take, quantized caches v5 does not);
    # ranked above v3 and below the tensor-core versions, which hold large groups in fragments.
    # It became the default there on its GPU tests, its sanitizer runs and its timings against
    # v3 and v1 (faster at every shape timed: benchmarks/results/sweeps/2026-12-06_1425_decode_v7_h100.txt)
    *_records("v7", "decode_v7.cu", "decode_split_v7", _args_v3, check_decode_v7, 32,
              "v3 with the query group split over blocks (a slice of g / GROUP_SPLIT heads each, reading "
              "the same K/V rows, the repeats from L2) so a lane's registers hold its slice, at one "
              "8-warp block an SM", layout="ring_fused", reads=("16-bit", "codes"), smem=_smem_v3),
    # v8 (Hopper, a contiguous cache) takes the group as one warpgroup's 64 wgmma rows and its K/V
    # tiles by TMA; ranked above v4 and v6, the default past v4's 16 rows (policy.decode_v8_default_at),
    # where it ran faster than v6 at the g = 32 / 64 shapes timed, with its own split rule
    # (policy.decode_v8_splits)
    # v9 is v4 with every block the same number of keys where one block a pair would leave a last
    # wave: the pairs' keys laid end to end and dealt in equal runs to one wave of blocks
    # (decode_launch.split_launch, policy.decode_balanced_deal); elsewhere it launches v4 itself;
    # ranked above v4 and v8 and held back (policy.HELD_BACK) until its timings beside v4 are
    # recorded: the cliff section times a held-back version next to the default at every shape
    *_records("v9", "decode_v9.cu", "decode_split_v9", _args_v4, check_decode_v4, 47,
              "v4 with the (b, kv head) pairs' keys laid end to end and dealt in equal runs to one wave "
              "of blocks where one block a pair would leave a last wave", layout="tensor_core", reads=("16-bit",),
              smem=_smem_v4, balanced=True, undealt="v4"),
    *_records("v8", "decode_v8.cu", "decode_split_v8", args_v8, check_decode_v8, 45,
              "Hopper: the group's query heads are the rows of one warpgroup's wgmma tile, and the copy "
              "engine streams K/V tiles into a ring one thread keeps full",
              ops=("decode",), layout="tma", reads=("16-bit",), smem=smem_v8, options=HOPPER_OPTIONS,
              sources=HOPPER_SOURCES, splits=decode_v8_splits, default_check=v8_default_check),
)
REGISTRY.add(*RECORDS)
