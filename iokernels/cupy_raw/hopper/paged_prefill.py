"""Prefill on a paged cache for Hopper (sm_90a): the launcher of paged_prefill_v3.cu.

Read this next to :mod:`iokernels.cupy_raw.paged_prefill` (v1, the portable tensor-core kernel
whose arguments it takes) and :mod:`.attention` (fa_v5, the contiguous Hopper forward whose
pipeline it copies).  A packed batch of chunks -- q (total_q, Hq, d), sequence b's chunk the
rows cu_seqlens_q[b]:cu_seqlens_q[b+1], the LAST n_q of the n tokens it has cached -- attends to
each sequence's cache through its block table, in one launch.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   packed query rows a tile (128 = 128 / g tokens x g query heads), keys a K/V tile
         (``HopperPagedPrefillConfig.block_n``, 128 by default)
n, n_q   tokens a sequence has cached (its chunk included), rows of its chunk
p        block_size, the keys a cache block holds; a K tile is Bc / p TMA boxes a panel
g        query heads per KV head, packed into the rows of one query tile
S, P     S_ij = Q_i K_j^T (float32 wgmma accumulators), P_ij = exp2(S_ij scale log2(e) - m)
m, l     running row max and row sum of the online softmax, in registers
O        float32 accumulators, written once, packed (total_q, Hq, d) in q's dtype
LSE      m + log(l), natural log, float32, (Hq, total_q) like v1
=======  ===========================================================================

What v3 adds to v1, and why: v1 (mma.sync and cp.async, a thread block per query head) runs
far below the contiguous Hopper prefill, which has wgmma and TMA (the benchmark records the
ratio in its paged_prefill section); v3 is fa_v5's pipeline (TMA into
swizzled SRAM, a producer warpgroup, wgmma, ping-pong, the softmax overlapped with P V) with
each K/V tile copied as Bc / p TMA boxes through the block table (a 4-D tensor map over the
pool), and the g query heads of a KV head packed into one 128-row query tile (one 3-D TMA box
over q), so each K/V tile is read once per KV head.  The kernel's header says how.

Limits, frankly: block_size a multiple of 8 that divides Bc or is a multiple of Bc (8, 16,
32, 64, 128, 256, ...; :func:`check_block_size`); g a power of two up to 128; head_dim 64 and
128; float16 and bfloat16; no window; no quantized cache; compute capability 9.0 only.  Where
those hold it is the default (it outranks v1 and v2; benchmarks/results has its paged_prefill
rows next to our contiguous prefill), and a config names it as
``HopperPagedPrefillConfig(version="v3")`` with :func:`paged_prefill_pools`,
:func:`paged_prefill` or ``iokernels.paged_prefill(..., backend="cupy", config=...)``.  With
device tables, lengths and offsets the launch reads none of their values on the host (the grid
is sized by ``max_seqlen_q``, else by total_q).  This module is the eager path (each call checks
its arguments, resolves its config and encodes its tensor maps); through
:func:`iokernels.cupy_raw.paged_prefill_pools`, device q and pools take a plan made once per shape
(:class:`iokernels.cupy_raw.PagedPrefillPlan`), which checks once and encodes the maps once per
address set of q and the pools.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ...core import conventions as cv
from ...core.arrays import Call, device_array
from ...core.records import Record
from ..config_checks import check_version
from ..decode import _pool_device, check_pools
from ..paged_prefill_args import call_values as paged_values, check_q as check_q_shape, table_or_one
from ..launch import DTYPE_IDS, HOPPER_OPTIONS, HOPPER_SOURCES, device_info, function, on_stream
from ..policy import default_check_for, held_back_note, hopper_tiles
from ..registry import REGISTRY, need
from .config import (BLOCK_M, DTYPES, FALLBACK_SMEM_OPTIN, HOPPER_CC, MBARRIER_BYTES, PANEL, SMEM_ALIGN,
                     check_tile_fields)

__all__ = ["HopperPagedPrefillConfig", "paged_prefill", "paged_prefill_pools", "launch_paged_prefill_v3",
           "prefill_v3_args", "checked", "names_v3", "tma_ready", "check_paged_prefill_v3", "check_block_size",
           "V3_RANK", "V3_BLOCK_SIZES", "RECORDS"]

#: the versions HopperPagedPrefillConfig describes
VERSIONS = ("v3",)
#: v3's rank among the CuPy paged prefill versions: above v1's and v2's, the default wherever its
#: check passes (and it is not in :data:`iokernels.cupy_raw.policy.HELD_BACK`)
V3_RANK = 30
#: the head dims v3 takes (hopper_paged.cuh: its O accumulator and wgmma shapes stop at 128)
HEAD_DIMS = (64, 128)
#: the smallest block a TMA box may be: 8 rows of 128 bytes are one 128-byte-swizzle atom, so a
#: box of a multiple of 8 rows lands exactly as those rows of a whole swizzled tile
BLOCK_SIZE_QUANTUM = 8
#: the block sizes the compile test builds (every one :func:`check_block_size` takes up to 256)
V3_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
#: the largest GQA group packed into one tile (the tile's 128 rows; g a power of two)
MAX_GROUP = BLOCK_M


def _barriers(stages: int) -> int:
    """The mbarriers after the tiles: q_full, k_full / v_full / empty per stage, v_tail."""
    return 2 + 3 * stages


def check_block_size(block_size: int, block_n: int) -> None:
    """A ValueError naming block_size unless a K/V tile of ``block_n`` keys is whole TMA boxes of
    whole swizzle atoms: a multiple of 8 that divides block_n or is a multiple of it."""
    if (block_size < BLOCK_SIZE_QUANTUM or block_size % BLOCK_SIZE_QUANTUM
            or (block_n % block_size and block_size % block_n)):
        raise ValueError(f"block_size: paged prefill v3 copies each cache block by TMA into 8-row swizzle atoms, "
                         f"so block_size must be a multiple of {BLOCK_SIZE_QUANTUM} that divides Bc = {block_n} "
                         f"or is a multiple of it; got {block_size} (v1 takes any block_size)")


def _check_group(group: int) -> str | None:
    if group < 1 or group > MAX_GROUP or group & (group - 1):
        return (f"packs the g query heads of a KV head into a {BLOCK_M}-row tile: g must be a power of two "
                f"up to {MAX_GROUP}, got {group}")
    return None


def paged_v3_smem(head_dim: int, block_n: int, stages: int) -> int:
    """Dynamic SRAM a block asks for: Q_i, stages x (K_j + V_j), the mbarriers, alignment slack."""
    return 2 * head_dim * (BLOCK_M + 2 * stages * block_n) + MBARRIER_BYTES * _barriers(stages) + SMEM_ALIGN


@dataclass(frozen=True)
class HopperPagedPrefillConfig:
    """The tiles of the Hopper paged prefill (paged_prefill_v3.cu).

    version: "v3" (None: the registry's default, v3 wherever it runs).
    block_n (Bc): keys a K/V tile, 64 or 128 (None: 128, fa_v5's).  stages: K/V tiles the SRAM
    ring holds, 2 .. 4 (None: fa_v5's 3, fewer where the SRAM does not hold them).  pingpong:
    False lets the two consumer warpgroups issue their products whenever ready (fa_v5's switch).
    The query tile is fixed at Br = 128 packed rows.
    """

    version: str | None = None
    block_n: int | None = None
    stages: int | None = None
    pingpong: bool = True

    def __post_init__(self):
        check_version(self, VERSIONS)
        check_tile_fields(self, 2, " (K_j and V_j-1 are held together)")

    def replace(self, **changes) -> "HopperPagedPrefillConfig":
        return replace(self, **changes)

    def resolve(self, head_dim: int, smem_limit: int | None = None) -> "HopperPagedPrefillConfig":
        """Concrete sizes for ``head_dim`` on a GPU whose blocks may take ``smem_limit`` bytes of
        SRAM (None: the H100/H200's); a ValueError naming config when they do not fit."""
        if self.version is None:
            raise ValueError("config.version: None is the registry's default; name 'v3' to run the Hopper "
                             "paged prefill")
        limit = FALLBACK_SMEM_OPTIN if smem_limit is None else smem_limit
        block_n, stages = hopper_tiles("v5", head_dim, self.block_n, self.stages)
        if self.stages is None:
            while stages > 2 and paged_v3_smem(head_dim, block_n, stages) > limit:
                stages -= 1
        if paged_v3_smem(head_dim, block_n, stages) > limit:
            raise ValueError(f"config.stages: {stages} stages of Bc = {block_n} at head_dim {head_dim} need "
                             f"{paged_v3_smem(head_dim, block_n, stages):,} B of SRAM; this GPU allows {limit:,}")
        return HopperPagedPrefillConfig(self.version, block_n, stages, self.pingpong)

    def smem_bytes(self, head_dim: int) -> int:
        return paged_v3_smem(head_dim, self.block_n, self.stages)

    def threads(self) -> int:
        """A producer warpgroup and two consumer warpgroups."""
        return 3 * 128

    def defines(self, head_dim: int, dtype: str, block_size: int) -> dict:
        """The kernel's -D defines (resolved config)."""
        return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=self.block_n,
                    STAGES=self.stages, PAGE_SIZE=block_size, PINGPONG=int(self.pingpong))


# --------------------------------------------------------------------------- the registry check
def check_paged_prefill_v3(n) -> str | None:
    """Compute capability 9.0 (wgmma, TMA), a 16-bit cache, head_dim 64 or 128, g a power of two
    up to 128, the block size when the need names it (``extra["block_size"]``, from the cache or
    the pools; the launcher refuses a bad one by name in any case), and a GPU with
    cuda-python here (:func:`~iokernels.cupy_raw.hopper.available`)."""
    if n.simulator:
        return "runs on a GPU only (not the simulator)"
    if n.cc is not None and n.cc != HOPPER_CC:
        return f"needs compute capability 9.0 (Hopper: wgmma, TMA, sm_90a); this GPU is {n.cc / 10:.1f}"
    if n.extra.get("kv_dtype") is not None:
        return f"kv_dtype: reads 16-bit pools; a {n.extra['kv_dtype']} cache is not dequantized by this kernel"
    if n.dtype not in DTYPES:
        return f"takes float16 / bfloat16 (wgmma operands), not {n.dtype}"
    if n.head_dim not in HEAD_DIMS:
        return f"takes head_dim in {HEAD_DIMS}, not {n.head_dim}"
    why = _check_group(int(n.extra.get("group") or 1))
    if why:
        return why
    bs = n.extra.get("block_size")
    if bs is not None:
        try:
            check_block_size(int(bs), hopper_tiles("v5", n.head_dim)[0])
        except ValueError as e:
            return str(e)
    return _hp().available()


def _hp():
    """The hopper package, looked up at call time (its available and tensor_map, which the
    launch-argument test replaces with stand-ins)."""
    from .. import hopper
    return hopper


def _need(q, k_pool, v_pool, block_size):
    nd = need("paged_prefill", q=q, k=k_pool, v=v_pool)
    if nd.extra.get("block_size") is None:
        nd.extra["block_size"] = int(block_size)
    return nd


# --------------------------------------------------------------------------- the calls
def paged_prefill(q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config=None):
    """The record's launcher (``iokernels.paged_prefill(..., backend="cupy", config=
    HopperPagedPrefillConfig(version="v3"))``): a :class:`~iokernels.paged.PagedKVCache`'s NumPy
    pools are copied to the device with its tables and lengths on every call."""
    config = _named(config)
    tables, lens = cache.block_tables_array(list(seq_ids))
    return _run(q, cache.k_pool, cache.v_pool, tables, lens, cu_seqlens_q, causal=causal, scale=scale,
                config=config)


def paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                        config=None, max_seqlen_q=None):
    """v1's :func:`~iokernels.cupy_raw.paged_prefill_pools` on paged_prefill_v3.cu: the same
    arguments (pools (num_blocks, block_size, Hkv, d); device tables, lengths and offsets used in
    place, never read on the host; ``max_seqlen_q`` sizes the grid), (O (total_q, Hq, d), LSE
    (Hq, total_q)).  ``config`` must name v3 (:func:`iokernels.cupy_raw.paged_prefill_pools` resolves the default)."""
    config = _named(config)
    return _run(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale, config=config,
                max_seqlen_q=max_seqlen_q)


def names_v3(config) -> bool:
    """Whether ``config`` names the Hopper paged prefill (a HopperPagedPrefillConfig with its
    version set): the rule by which :func:`iokernels.cupy_raw.paged_prefill_pools` and its plan
    take this module's checks and launch; any other config resolves through the registry."""
    return isinstance(config, HopperPagedPrefillConfig) and config.version is not None


def _named(config):
    if not names_v3(config):
        raise ValueError(f"config: the Hopper paged prefill runs when a config names it "
                         f"(HopperPagedPrefillConfig(version='v3')), got {config!r}")
    return config


def _check_q(q, heads_kv, d, dtype):
    """v1's check of q (shape, dtype), and the group sizes v3's packed tile takes."""
    check_q_shape(q, heads_kv, d, dtype)
    why = _check_group(int(q.shape[1]) // heads_kv)
    if why:
        raise ValueError(f"q: {why}")


def checked(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal, scale, config, max_seqlen_q=None):
    """Every check of a call naming v3, in order, before any GPU work (the argument handling is
    v1's): (the call, the pools' (num_blocks, block_size, Hkv, d, dtype), causal, scale, the
    checked tables, lengths and offsets (:func:`iokernels.cupy_raw.paged_prefill_args.call_values`), the
    record, the resolved config).  The eager call and the plan
    (:class:`iokernels.cupy_raw.PagedPrefillPlan`) both start here, so a bad call raises the same."""
    config = _named(config)
    nb, bs, Hkv, d, dtype = check_pools(k_pool, v_pool)
    _check_q(q, Hkv, d, dtype)
    causal = cv.check_bool(causal, "causal")
    scale = cv.resolve_scale(scale, d)
    call = Call(q)
    values = paged_values(call, block_tables, seq_lens, cu_seqlens_q, nb, bs, int(q.shape[0]), max_seqlen_q)
    check_block_size(bs, config.block_n or hopper_tiles("v5", d)[0])
    # every argument checked on the host; now whether v3 runs here (compute capability 9.0)
    spec, _ = REGISTRY.resolve("paged_prefill", config, _need(q, k_pool, v_pool, bs))
    return call, (nb, bs, Hkv, d, dtype), causal, scale, values, spec, config.resolve(d, device_info()["smem_optin"])


def _run(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal, scale, config, max_seqlen_q=None):
    """One call with a config naming v3: (O, LSE) of q's kind."""
    call, (nb, bs, Hkv, d, dtype), causal, scale, values, _, cfg = checked(
        q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale, config=config,
        max_seqlen_q=max_seqlen_q)
    (dev_t, dev_l, dev_c), B, max_blocks, tables_h, lens_h, cq, longest = values
    total_q, Hq = int(q.shape[0]), int(q.shape[1])
    with on_stream(call.stream_ptr()):
        qd = call.to_device(q, "q")
        kp, vp = _pool_device(call, k_pool, "k_pool"), _pool_device(call, v_pool, "v_pool")
        o, lse = call.empty((total_q, Hq, d), dtype), call.empty((Hq, total_q), "float32")
        if B and total_q and longest:
            tables_d = block_tables if dev_t else call.constant(table_or_one(tables_h))
            lens_d = seq_lens if dev_l else call.constant(lens_h.astype(np.int32))
            cu_d = cu_seqlens_q if dev_c else call.constant(cq.astype(np.int32))
            launch_paged_prefill_v3(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, dtype=dtype, block_size=bs,
                                    max_blocks=max(max_blocks, 1), longest=longest, scale=scale, causal=causal,
                                    config=cfg)
    return call.finish(o, dtype), call.finish(lse, "float32")


# --------------------------------------------------------------------------- the launch
#: TMA addresses global memory in 16-byte units: the base and every stride but the innermost
TMA_ALIGN = 16


def tma_ready(a) -> bool:
    """Whether TMA may read device array ``a`` in place: rows unit-stride, base and strides on 16 bytes."""
    return a.strides[-1] == 1 and a.aligned(TMA_ALIGN)


def _tma_ready(x, dtype):
    """``x`` as TMA may read it (:func:`tma_ready`), else one copy."""
    from ..launch import contiguous
    a = device_array(x, dtype)
    if tma_ready(a):
        return a
    return device_array(contiguous(a.owner, TMA_ALIGN), dtype)      # the caller's library copies


def launch_paged_prefill_v3(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, *, dtype, block_size, max_blocks, longest,
                            scale, causal, config):
    """The kernel on device arrays: qd (total_q, Hq, d), pools (num_blocks, block_size, Hkv, d),
    int32 tables (B, max_blocks), lengths (B,), offsets (B + 1,); o (total_q, Hq, d), lse (Hq,
    total_q) preallocated (tests poison them first).  ``longest``: the grid's bound on a chunk's
    rows; ``config`` resolved.  Grid (ceil(longest * g / 128), Hkv, B)."""
    qd, kp, vp = (_tma_ready(a, dtype) for a in (qd, kp, vp))
    o, lse = device_array(o, dtype), device_array(lse, "float32")
    tables_d, lens_d, cu_d = (device_array(a) for a in (tables_d, lens_d, cu_d))
    B = lens_d.shape[0]
    total_q, Hq, d = qd.shape
    Hkv = kp.shape[2]
    if B * total_q * Hq * longest == 0:
        return
    check_block_size(block_size, config.block_n)
    g = Hq // Hkv
    smem = config.smem_bytes(d)
    rec = REGISTRY.get("paged_prefill", config.version)
    fn = function(rec.file, rec.kernel, config.defines(d, dtype, block_size), smem, options=HOPPER_OPTIONS,
                  sources=HOPPER_SOURCES)
    grid = (-(-int(longest) * g // BLOCK_M), Hkv, B)
    fn(grid, (config.threads(),), rec.args(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, dtype=dtype, config=config,
                                            max_blocks=max_blocks, scale=scale, causal=causal), shared_mem=smem)


def prefill_v3_args(qd, kp, vp, tables_d, lens_d, cu_d, o, lse, *, dtype, config, max_blocks, scale, causal) -> tuple:
    """paged_prefill_v3.cu: the tensor maps of q (d, Hq, total_q) with boxes (64, g, 128 / g)
    and of the pools (d, Hkv, block_size, num_blocks) with boxes (64, 1, min(block_size, Bc), 1);
    the tables, lengths, offsets, outputs; the table width, the pool's block count (the index
    past it reads zeros), log2(g), the scale in log2 units, causal, O's and LSE's strides."""
    total_q, Hq, d = qd.shape
    nb, bs, Hkv, _ = kp.shape
    g = Hq // Hkv
    box_rows = min(bs, config.block_n)
    hp = _hp()
    map_q = hp.tensor_map(qd.ptr, dtype, (d, Hq, total_q), (2 * qd.strides[1], 2 * qd.strides[0]),
                       (PANEL, g, BLOCK_M // g))
    maps_kv = [hp.tensor_map(p.ptr, dtype, (d, Hkv, bs, nb), (2 * p.strides[2], 2 * p.strides[1], 2 * p.strides[0]),
                          (PANEL, 1, box_rows, 1)) for p in (kp, vp)]
    i32, i64 = np.int32, np.int64
    return (map_q, *maps_kv, tables_d.arg, lens_d.arg, cu_d.arg, o.arg, lse.arg,
            i32(max_blocks), i32(nb), i32(g.bit_length() - 1), np.float32(scale * math.log2(math.e)),
            i32(bool(causal)), *map(i64, o.strides[:2]), *map(i64, lse.strides[:2]))


# --------------------------------------------------------------------------- the record
RECORDS = (
    Record("cupy", "paged_prefill", "v3", "paged_prefill_v3.cu", "paged_prefill_v3", HopperPagedPrefillConfig,
           paged_prefill, "Hopper: fa_v5's pipeline over a paged cache, K/V tiles as TMA boxes through the block "
           "table, GQA packed into the 128-row tile" + held_back_note("paged_prefill", "v3"), check_paged_prefill_v3,
           V3_RANK, prefill_v3_args, dict(options=HOPPER_OPTIONS), default_check_for("paged_prefill", "v3")),
)
REGISTRY.add(*RECORDS)
