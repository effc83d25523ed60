"""Prefill on a paged cache in CUDA C++: the launcher of paged_prefill_v1.cu and paged_prefill_v2.cu.

Read this next to :func:`iokernels.paged_prefill.paged_prefill_tiled` (the NumPy kernel, its
traffic counted) and :mod:`iokernels.numba_cuda.paged_prefill` (the same grid in Numba).  A
packed batch of chunks -- q (total_q, Hq, d), sequence b's chunk the rows
cu_seqlens_q[b]:cu_seqlens_q[b+1], the LAST n_q of the n tokens it has cached -- attends to
each sequence's cache through its block table, in one launch.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   chunk rows a Q tile (16 a warp: 64, or 128 where chunks are long on average, by
         :func:`.policy.paged_prefill_tiles`), keys a K/V tile (64 by default)
n, n_q   tokens a sequence has cached (its chunk included), rows of its chunk
p        block_size, the keys a cache block holds; a K tile spans Bc / p blocks
g        query heads per KV head: query head h reads KV head h // g
S, P     S_ij = scale * Q_i K_j^T, P_ij = exp(S_ij - m): registers (tensor-core fragments)
m, l     running row max and row sum of the online softmax, in registers
O        float32 accumulators, written once, packed (total_q, Hq, d) in q's dtype
LSE      m + log(l), natural log, float32, (Hq, total_q) like the other backends' paged prefill
=======  ===========================================================================

What v1 adds, and why: fa_v2.cu's tensor-core forward (mma.sync, S and P in registers,
cp.async double buffering) with its K/V tiles read through the block table, so a chunk
attends to its cache where it lies, with no gather into a contiguous copy (the copy the
"naive" and "torch" backends make writes every cached row once more and reads it back).
A K tile spans several cache blocks (Bc = 64 keys = 4 blocks of 16 by default) so each mma
still sees a full tile; each row's address comes from the table.  Bottom-right causal per
sequence: chunk row i sees key j iff j <= i + n - n_q; K tiles entirely in the future of a
Q tile are never read.  One launch serves every chunk of the batch (grid: Q tile, query
head, sequence); a block whose chunk has fewer tiles exits.

What v2 adds (paged_prefill_v2.cu, the record "v2"): the g query heads of a KV head packed
into the Q tile's rows (FlashAttention's pack_gqa), so a block a (tile, KV head) reads each K/V
tile once for all g heads; the grid's head axis is the KV heads and a tile of Br rows covers
Br / g tokens (:func:`prefill_grid`).  It is the default where the Hopper v3 does not run
(its GPU tests passed and the benchmark's paged_prefill section recorded it at v1's speed or
better); ``config=PagedPrefillConfig("v1")`` runs v1.

Limits of v1, frankly: the g query heads of a KV head are g thread blocks, each reading the K/V
tiles (L2 can serve the repeats, but they still cost load instructions and L2 bandwidth;
packing the g heads into one tile's rows is the next idea); a chunk of one row (a decode
step) still costs a Br-row tile of tensor-core work, so a batch of mostly decode rows is
the paged decode kernels' job; head dims 64 and 128, float16 and bfloat16 only (the
record's check says so for others); a quantized cache is not read.  With device block
tables, lengths and offsets the launch reads none of their values on the host, so the grid
is sized by ``max_seqlen_q`` when the caller passes it (as FlashAttention's varlen calls
take it), else by the longest chunk possible (total_q rows), and then most blocks of short
chunks exit at once; with host offsets it is sized by the longest chunk.  This module is the
eager path (each call checks its arguments, resolves its config and looks up the compiled
kernel); the public :func:`iokernels.cupy_raw.paged_prefill_pools` of device arrays goes
through a plan made once per shape (:mod:`.paged_prefill_plan`), which does that work once.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from ..core.records import Record
from .config import CHUNK_BYTES
from .decode import _pool_device, check_pools
from .launch import device_info, function, on_stream, unit_rows
from .paged_prefill_args import call_values, check_q, table_or_one
from .paged_prefill_config import PagedPrefillConfig
from .policy import default_check_for, held_back_note
from .registry import REGISTRY, check_paged_prefill_v1, need

__all__ = ["paged_prefill", "paged_prefill_pools", "launch_paged_prefill", "prefill_args"]


def paged_prefill(q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config=None):
    """The launcher of ``ik.paged_prefill(..., backend="cupy")``: a
    :class:`~iokernels.paged.PagedKVCache` holds NumPy pools, which are copied to the device
    (with its tables and lengths) on every call; :func:`paged_prefill_pools` takes device pools.
    ``config``: a :class:`PagedPrefillConfig` (None, or version None: the registry's default)."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    return paged_prefill_pools(q, cache.k_pool, cache.v_pool, tables, lens, cu_seqlens_q, causal=causal, scale=scale,
                               config=config)


def paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                        config=None, max_seqlen_q=None):
    """Paged prefill over pools (num_blocks, block_size, Hkv, d): (O (total_q, Hq, d), LSE (Hq, total_q)).

    q (total_q, Hq, d) packed; sequence b's chunk is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and
    the last rows of the seq_lens[b] tokens it has cached; block_tables (B, max_blocks) int32.
    Device q and pools (CuPy, torch CUDA) are used in place and the outputs are of their kind;
    NumPy ones are copied in and out.  block_tables, seq_lens and cu_seqlens_q may each be host
    arrays (checked, then uploaded once per distinct content) or contiguous int32 device arrays
    of q's kind, used in place: their values are not read on the host (keep them in range), so
    with device ones a call neither synchronizes the host nor copies host memory.
    ``max_seqlen_q`` (as FlashAttention's varlen calls take it): the longest chunk, which sizes
    the grid when cu_seqlens_q is a device array (None: total_q, the most a chunk can hold, so
    the blocks of shorter chunks exit at once); with host offsets it is read from them.
    Through :func:`iokernels.cupy_raw.paged_prefill_pools`, device q and pools take a plan made
    once per shape (:class:`iokernels.cupy_raw.PagedPrefillPlan`: the checks, the config and
    the compiled kernel once; a repeat call compares one key and launches), and ``config`` may
    also be a :class:`~iokernels.cupy_raw.hopper.paged_prefill.HopperPagedPrefillConfig` naming
    the Hopper v3 (planned the same way; its eager call is
    :func:`iokernels.cupy_raw.hopper.paged_prefill.paged_prefill_pools`).
    """
    _, _, Hkv, d, dtype = check_pools(k_pool, v_pool)
    check_q(q, Hkv, d, dtype)
    _, cfg = REGISTRY.resolve("paged_prefill", config, need("paged_prefill", q=q, k=k_pool, v=v_pool))
    if not isinstance(cfg, PagedPrefillConfig):      # the registry's choice is the Hopper v3: its launcher
        from .hopper.paged_prefill import paged_prefill_pools as hopper_pools
        return hopper_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale,
                            config=cfg, max_seqlen_q=max_seqlen_q)
    return _run(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale, config=cfg,
                max_seqlen_q=max_seqlen_q)


# --------------------------------------------------------------------------- checks
# --------------------------------------------------------------------------- the call
def _run(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal, scale, config, max_seqlen_q=None):
    """One call with a resolved config (its version set): (O, LSE) of q's kind."""
    nb, bs, Hkv, d, dtype = check_pools(k_pool, v_pool)
    check_q(q, Hkv, d, dtype)
    causal = cv.check_bool(causal, "causal")
    scale = cv.resolve_scale(scale, d)
    if not isinstance(config, PagedPrefillConfig) or config.version is None:
        raise ValueError(f"config: expected a PagedPrefillConfig with its version set, got {config!r}")
    total_q, Hq = int(q.shape[0]), int(q.shape[1])
    call = Call(q)
    (dev_t, dev_l, dev_c), B, max_blocks, tables_h, lens_h, cq, longest = call_values(
        call, block_tables, seq_lens, cu_seqlens_q, nb, bs, total_q, max_seqlen_q)
    acc = cv.accum_dtype(dtype).name
    rows = tile_rows_per_token(REGISTRY.get("paged_prefill", config.version), Hq // Hkv)
    cfg = config.resolve(d, device_info()["smem_optin"], rows * total_q / max(B, 1))   # shapes only
    with on_stream(call.stream_ptr()):
        qd = unit_rows(call.to_device(q, "q"))
        kp, vp = _pool_device(call, k_pool, "k_pool"), _pool_device(call, v_pool, "v_pool")
        o, lse = call.empty((total_q, Hq, d), dtype), call.empty((Hq, total_q), acc)
        if B and total_q and longest:
            tables_d = block_tables if dev_t else call.constant(table_or_one(tables_h))
            lens_d = seq_lens if dev_l else call.constant(lens_h.astype(np.int32))
            cu_d = cu_seqlens_q if dev_c else call.constant(cq.astype(np.int32))
            launch_paged_prefill(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, dtype=dtype, page_size=bs,
                                 max_blocks=max(max_blocks, 1), longest=longest, scale=scale, causal=causal,
                                 config=cfg)
    return call.finish(o, dtype), call.finish(lse, acc)


def launch_paged_prefill(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, *, dtype, page_size, max_blocks, longest,
                         scale, causal, config):
    """The kernel on device arrays: qd (total_q, Hq, d) rows unit-stride, pools (num_blocks,
    page_size, Hkv, d), int32 tables (B, max_blocks), lengths (B,), offsets (B + 1,); o, lse
    preallocated (tests poison them first).  ``longest``: the grid's bound on a chunk's rows;
    ``config`` resolved."""
    qd, kp, vp, o, lse = (device_array(a) for a in (qd, kp, vp, o, lse))
    tables_d, lens_d, cu_d = (device_array(a) for a in (tables_d, lens_d, cu_d))
    B = lens_d.shape[0]
    total_q, Hq, d = qd.shape
    if B * total_q * Hq * longest == 0:
        return
    vec = all(a.aligned(CHUNK_BYTES) for a in (qd, kp, vp, o))
    defines = config.defines(d, dtype, page_size, vec_io=vec)
    smem = config.smem_bytes(d)
    rec = REGISTRY.get("paged_prefill", config.version)
    fn = function(rec.file, rec.kernel, defines, smem)
    grid = prefill_grid(config, tile_rows_per_token(rec, Hq // kp.shape[2]), int(longest), Hq, B)
    fn(grid, (config.threads(),), rec.args(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, max_blocks=max_blocks,
                                           scale=scale, causal=causal), shared_mem=smem)


def tile_rows_per_token(record, group: int) -> int:
    """The Q-tile rows one chunk token fills: 1 where a block serves one query head (v1), the
    group g where the record packs the g query heads of a KV head into the tile's rows
    (``extra["packs_heads"]``: v2)."""
    return group if record.extra.get("packs_heads") else 1


def prefill_grid(config, rows_per_token: int, longest: int, heads_q: int, batch: int) -> tuple:
    """The launch grid (Q tile, head, sequence) for chunks of at most ``longest`` rows: a tile
    covers Br packed rows, ``rows_per_token`` a token; the head axis is the query heads (one
    a block) or, where the g query heads of a KV head share a tile, the KV heads."""
    return (-(-longest * rows_per_token // config.block_q), heads_q // rows_per_token, batch)


def prefill_args(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, *, max_blocks, scale, causal) -> tuple:
    """paged_prefill_v1.cu: pointers, heads, table width, strides in elements (q and O by token
    and head; the pools by block, slot, head; LSE by head and token), scale, causal."""
    i32, i64 = np.int32, np.int64
    Hq, Hkv = qd.shape[1], kp.shape[2]
    return (qd.arg, kp.arg, vp.arg, tables_d.arg, lens_d.arg, cu_d.arg, o.arg, lse.arg,
            i32(Hq), i32(Hkv), i32(max_blocks),
            *map(i64, qd.strides[:2]), *map(i64, o.strides[:2]),
            *map(i64, kp.strides[:3]), *map(i64, vp.strides[:3]),
            *map(i64, lse.strides[:2]), np.float32(scale), i32(bool(causal)))


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("cupy", "paged_prefill", "v1", "paged_prefill_v1.cu", "paged_prefill_v1", PagedPrefillConfig,
           paged_prefill, "fa_v2's tensor-core forward over a paged cache: K/V tiles of several cache blocks read "
           "through the block table, bottom-right causal per sequence, one launch for a packed batch of chunks",
           check_paged_prefill_v1, 10, prefill_args),
    Record("cupy", "paged_prefill", "v2", "paged_prefill_v2.cu", "paged_prefill_v2", PagedPrefillConfig,
           paged_prefill, "v1 with the g query heads of a KV head packed into the Q tile's rows (pack_gqa): a "
           "block a KV head reads each K/V tile once for all g heads" + held_back_note("paged_prefill", "v2"),
           check_paged_prefill_v1, 20, prefill_args, extra={"packs_heads": True},
           default_check=default_check_for("paged_prefill", "v2")),
)
REGISTRY.add(*RECORDS)
