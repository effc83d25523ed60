"""The decode split kernels' launch, in two halves: what a shape fixes, and what a call packs.

:func:`split_static` does what depends only on the call's shapes, dtypes, alignment, the
version and the GPU: the defines, the compiled kernel, its threads and the shared memory of
its ring.  :func:`split_dynamic` adds what the split count S and the longest sequence fix
(the SRAM sized for S splits and a paged split's staged block-table entries).  :func:`pack`
builds one launch's argument tuple in the kernel's order (the record's argument builder).
:func:`iokernels.cupy_raw.decode.launch_decode` runs the three on every call; a
:class:`~iokernels.cupy_raw.plans.DecodePlan` runs the first once and memoizes the second.

The fused combine's counters (v3 to v5) must be zero before a launch; the last block of each
group sets its counter back to 0, so a buffer zeroed once stays zero between launches that
complete.  They are allocated by the caller's library, zeroed on the caller's stream (a
memset kernel, which a CUDA graph captures as well).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import decode_config as C
from .launch import DTYPE_IDS, REGISTRY, blocks_per_sm, function, round_up
from .packed import function_ptr
from .policy import decode_balanced_deal, decode_pair_deal, decode_wave_splits

#: threads a block of decode.cu's combine: one per element of a row, up to this many
COMBINE_MAX_THREADS = 256
#: at least this many counters are allocated, so a workspace is rarely regrown
COUNTERS_MIN = 1024
#: v3's kernel is compiled with at least this much dynamic shared memory opted in
V3_COMPILE_SMEM = 48 * 1024


# --------------------------------------------------------------------------- argument builders
@dataclass(frozen=True)
class SplitArgs:
    """One launch's kernel arguments, grouped as the kernels' parameter lists are:
    head (Q, K, V), cache (a contiguous cache's 6 strides, or a paged one's block table,
    its width and the pool's 3 strides), table (a paged ring's staged-table capacity and SRAM
    offset; empty for a contiguous cache), scales (a quantized cache's K_scale, V_scale and
    their strides; empty for a 16-bit one), tail (lengths, nk, heads, scale, splits, the
    window, the partials), counters (the fused combine's), out (O, LSE); static, the launch's
    :class:`SplitStatic` (shapes, dtype, defines: what a kernel reading its tiles through TMA
    tensor maps encodes them from)."""

    head: tuple
    cache: tuple
    table: tuple
    scales: tuple
    tail: tuple
    counters: tuple
    out: tuple
    static: object = None


def _args_v1(a: SplitArgs) -> tuple:      # decode.cu: decode_split
    return (*a.head, *a.cache, *a.scales, *a.tail, *a.out)


def _args_v2(a: SplitArgs) -> tuple:      # decode_v2.cu: decode_split_v2 (16-bit caches only)
    return (*a.head, *a.cache, *a.tail, *a.out)


def _args_v3(a: SplitArgs) -> tuple:      # decode_v3.cu: decode_split_v3
    return (*a.head, *a.cache, *a.table, *a.scales, *a.tail, *a.counters, *a.out)


def _args_v4(a: SplitArgs) -> tuple:      # decode_v4.cu: decode_split_v4 (16-bit caches only)
    return (*a.head, *a.cache, *a.table, *a.tail, *a.counters, *a.out)


def _args_v5(a: SplitArgs) -> tuple:      # decode_v5.cu: decode_split_v5 (quantized paged caches only)
    return (*a.head, *a.cache, *a.table, *a.scales, *a.tail, *a.counters, *a.out)


def _smem_v3(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0):
    return C.decode_v3_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"], defines["NUM_WARPS"],
                            num_splits, fused, table_cap, kv)


def _smem_v4(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0):
    # the swizzled rows are allocated exactly: the L1 beside the SRAM keeps the rest
    return C.decode_v4_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"], defines["NUM_WARPS"],
                            num_splits, fused, table_cap, swizzled=C.decode_v4_swizzled(d))


def _smem_v5(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0):
    return C.decode_v5_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"], defines["NUM_WARPS"],
                            num_splits, fused, table_cap, kv)


# --------------------------------------------------------------------------- the two halves
@dataclass
class SplitStatic:
    """What a decode launch's shapes fix (see :func:`split_static`)."""

    spec: object                 # the record launched
    config: object
    fn: object                   # the compiled split kernel
    defines: dict
    threads: int
    fused: bool
    ring_fused: bool
    base_smem: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    group: int
    kv: str | None
    paged: bool
    block_size: int
    aligned: bool
    smem_limit: int
    sms: int
    acc: type
    blocks_per_sm: int | None = None     # the kernel's occupancy, asked of the driver once
    group_split: int = 1                 # blocks a KV head (decode v7's GROUP_SPLIT; else 1)
    undealt: SplitStatic | None = None   # a balanced record's launch where its deal is declined
    fn_ptr: int | None = None            # the kernel's CUfunction handle (kernel_ptr), asked once

    @property
    def heads_grid(self) -> int:
        """The grid's y and the kernel's heads_kv: a block's slice of a KV head's group
        (heads_kv x GROUP_SPLIT; heads_kv where a block holds the whole group)."""
        return self.heads_kv * self.group_split


def split_static(spec, config, *, batch, heads_q, heads_kv, head_dim, dtype, paged, block_size, aligned, kv,
                 dev) -> SplitStatic:
    """Compile (once) the split kernel of record ``spec`` for these shapes; ValueError naming
    config when its ring cannot fit this GPU (``dev``: :func:`.launch.device_info`)."""
    d, group = head_dim, heads_q // heads_kv
    defines = config.defines(d, dtype, group, paged, block_size, aligned=aligned, smem_limit=dev["smem_optin"],
                             kv=kv, cc=dev["cc"], pairs=batch * heads_kv, sms=dev["sms"])
    layout = C.layout_of(config.version) if "layout" not in spec.extra else spec.extra["layout"]
    ring_fused = layout in ("ring_fused", "tensor_core", "tma")
    ring_smem, sources = spec.extra.get("smem"), spec.extra.get("sources")
    defines = dict(defines, **spec.extra.get("defines", {}))
    group = defines["GROUP"]                 # the query heads a block holds (decode v7: a slice)
    if ring_fused:
        # compiled once per defines; its SRAM is sized a launch (at least the rings)
        base_smem, _ = ring_smem(d, dtype, group, defines, kv)
        if base_smem > dev["smem_optin"]:
            raise ValueError(f"config: decode {config.version} with {defines['NUM_WARPS']} warps x "
                             f"{defines['STAGES']} stages x {defines['TILE_ROWS']} rows needs "
                             f"{base_smem:,} B of shared memory a block at "
                             f"head_dim={d} ({dtype}), more than this GPU's {dev['smem_optin']:,} (fewer stages, "
                             f"warps or tile rows)")
        fn = function(spec.file, spec.kernel, defines, max(base_smem, V3_COMPILE_SMEM), sources=sources,
                      options=spec.extra.get("options", ()))
    elif layout == "ring":
        base_smem = C.decode_v2_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"])
        if base_smem > dev["smem_optin"]:
            raise ValueError(f"config: decode v2 with {defines['STAGES']} stages x {defines['TILE_ROWS']} rows needs "
                             f"{base_smem:,} B of shared memory a block, more than this GPU's {dev['smem_optin']:,}")
        fn = function(spec.file, spec.kernel, defines, base_smem, sources=sources)
    else:
        base_smem = 0
        fn = function(spec.file, spec.kernel, defines, sources=sources)
    undealt = None
    if spec.extra.get("undealt"):
        # decode v9: the version whose launch it makes where the balanced deal is declined (v4),
        # compiled from the same config, so the two kernels take the same defines
        other = spec.extra["undealt"]
        undealt = split_static(REGISTRY.get(spec.op, other), dataclasses.replace(config, version=other),
                               batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
                               paged=paged, block_size=block_size, aligned=aligned, kv=kv, dev=dev)
    return SplitStatic(spec, config, fn, defines, 32 * defines["NUM_WARPS"], bool(defines.get("FUSED", 0)),
                       ring_fused, base_smem, batch, heads_q, heads_kv, d, dtype, group, kv, paged, block_size,
                       aligned, dev["smem_optin"], dev["sms"], np.float64 if dtype == "float64" else np.float32,
                       group_split=defines.get("GROUP_SPLIT", 1), undealt=undealt)


def kernel_ptr(st: SplitStatic) -> int:
    """The CUfunction handle of ``st``'s kernel (what a packed launch takes), asked once."""
    if st.fn_ptr is None:
        st.fn_ptr = function_ptr(st.fn)
    return st.fn_ptr


def occupancy(st: SplitStatic) -> int:
    """The split kernel's blocks an SM, asked of the driver once and kept on ``st``."""
    if st.blocks_per_sm is None:
        st.blocks_per_sm = blocks_per_sm(st.fn, st.threads, st.base_smem)
    return st.blocks_per_sm


def num_splits_for(st: SplitStatic, longest: int) -> int:
    """:func:`.policy.decode_wave_splits` (or the record's ``extra["splits"]``, a rule of the same
    arguments: decode v8's) for ``longest`` keys at the kernel's occupancy."""
    return st.spec.extra.get("splits", decode_wave_splits)(st.batch, st.heads_grid, longest, st.sms, occupancy(st),
                              2 * st.head_dim * C.kv_itemsize(st.dtype, st.kv))


def split_dynamic(st: SplitStatic, splits: int, longest: int, per_split: int | None = None) -> tuple[int, tuple]:
    """(shared memory, the table arguments) of a launch of ``splits`` splits whose longest
    sequence sees ``longest`` keys (sets the kernel's opt-in when it grows); ``per_split``: the
    most keys a block reads of one sequence (None: ceil(longest / splits))."""
    if not st.ring_fused:
        return st.base_smem, ()
    table_cap = 0
    if st.paged:
        per_split = per_split or -(-max(longest, 1) // splits)
        want = -(-per_split // st.block_size) + 1          # a split may straddle one more page
        table_cap = want if want <= C.DECODE_V3_TABLE_CAP else 0
    smem, table_offset = st.spec.extra["smem"](st.head_dim, st.dtype, st.group, st.defines, st.kv, splits, st.fused,
                                               table_cap)
    if smem > st.smem_limit:
        raise ValueError(f"config: decode {st.config.version} needs {smem:,} B of shared memory a block, more "
                         f"than this GPU's {st.smem_limit:,} (fewer stages, smaller tiles or more splits)")
    if smem > V3_COMPILE_SMEM and smem > st.fn.max_dynamic_shared_size_bytes:
        st.fn.max_dynamic_shared_size_bytes = int(smem)
    return smem, ((np.int32(table_cap), np.int32(table_offset)) if st.paged else ())


def split_launch(st: SplitStatic, num_splits: int | None,
                 longest: int) -> tuple[int, int, tuple, tuple, SplitStatic]:
    """(S, shared memory, table arguments, grid, the static launched) of a launch whose longest
    sequence sees ``longest`` keys: S the partials' slots a (b, kv head) pair (the combine's
    splits).  The static launched is ``st``, or its ``undealt`` (below): its kernel and its
    argument builder make the launch.

    The records of ``extra["balanced"]`` (decode v9) take the pairs' keys laid end to end in
    runs of W, block j the run [j W, (j + 1) W): grid (G, 1, 1), and (batch, keys a pair, W)
    after the table arguments.  Where :func:`.policy.decode_balanced_deal` finds a last wave to
    remove (and the call names no split count) the runs are equal over one wave.  Where it
    declines, the launch is the ``undealt`` version's (v4's: its kernel, its splits, its grid),
    so v9 runs what v4 runs there by construction.  Where the call names a split count, the
    runs are v4's splits dealt by v9's kernel, each pair padded to whole runs
    (:func:`.policy.decode_pair_deal`).  The others: S = ``num_splits`` or
    :func:`num_splits_for`, grid (S, heads_grid, batch)."""
    if not st.spec.extra.get("balanced"):
        S = int(num_splits) if num_splits is not None else num_splits_for(st, longest)
        smem, table = split_dynamic(st, S, longest)
        return S, smem, table, (S, st.heads_grid, st.batch), st
    pairs, keys = st.batch * st.heads_grid, max(1, int(longest))
    deal = None if num_splits is not None else decode_balanced_deal(pairs, keys, st.sms * occupancy(st))
    if deal is None and num_splits is None and st.undealt is not None:
        return split_launch(st.undealt, None, longest)
    if deal is None:
        W, S, keys = decode_pair_deal(keys, int(num_splits) if num_splits is not None else num_splits_for(st, longest))
        G = pairs * S
    else:
        G, W, S = deal
    smem, table = split_dynamic(st, S, keys, per_split=W)
    return S, smem, (*table, np.int32(st.batch), np.int32(keys), np.int32(W)), (G, 1, 1), st


def pack(st: SplitStatic, splits: int, table: tuple, *, q, k, v, cache: tuple, scales: tuple, lens, nk: int,
         scale: float, window_left: int, parts: tuple, counters, o, lse) -> tuple:
    """One launch's arguments in the kernel's order (pointers as ``np.uint64``)."""
    i32 = np.int32
    a = SplitArgs(head=(q, k, v), cache=cache, table=table, scales=scales,
                  tail=(lens, i32(nk), i32(st.heads_q), i32(st.heads_grid), st.acc(scale), i32(splits),
                        i32(window_left), *parts),
                  counters=(counters,), out=(o, lse), static=st)
    return st.spec.args(a)


def combine_threads(head_dim: int) -> int:
    """Threads a block of either combine: one a column of a row, up to COMBINE_MAX_THREADS."""
    return min(COMBINE_MAX_THREADS, round_up(head_dim, 32))


def parallel_combine_defines(head_dim: int, dtype: str) -> dict:
    """decode_combine.cu's defines (the config's combine "parallel")."""
    return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, COMBINE_THREADS=combine_threads(head_dim))


def combine_launch(st: SplitStatic, splits: int, o_part, lse_part, o, lse) -> tuple:
    """(kernel, grid, block, arguments) of the separate combine over ``splits`` partials, one
    block a query row: decode.cu's (the config's combine "serial") or decode_combine.cu's
    ("parallel"); both take the same arguments."""
    cfg = st.config
    threads = combine_threads(st.head_dim)
    if cfg.combine_kernel() == "parallel":
        comb = function("decode_combine", "decode_combine_parallel", parallel_combine_defines(st.head_dim, st.dtype))
    else:
        comb = function("decode", "decode_combine",
                        cfg.combine_defines(st.head_dim, st.dtype, st.group, st.paged, st.block_size, st.aligned))
    rows = st.batch * st.heads_q
    return comb, (rows,), (threads,), (o_part, lse_part, np.int32(splits), np.int32(rows), o, lse)


def launch_combine(st: SplitStatic, splits: int, o_part, lse_part, o, lse) -> None:
    """The separate combine over ``splits`` partials (the launches that do not fuse it), through
    CuPy's launch on its current stream."""
    comb, grid, block, args = combine_launch(st, splits, o_part, lse_part, o, lse)
    comb(grid, block, args)
