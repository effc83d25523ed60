"""decode v8's settings (decode_v8.cu: on Hopper, the GQA group as the 64 rows of one
warpgroup's wgmma tile, K/V tiles streamed by the copy engine), its limits, its shared memory,
its registry check and its launch arguments (TMA tensor maps).

:class:`~.decode_config.DecodeConfig` with ``version="v8"`` takes ``stages`` (the ring depth),
``tile_rows`` (Bc: 64 or 128 keys a tile; 64 only at head_dim 256) and ``fused``; its defines
and ring depth come from here (:func:`v8_defines`, :func:`v8_stages`, registered in
``decode_config.VERSION_RULES`` when this module is imported, as the package does).  Over a
contiguous cache only: a page's rows are not one box of a tensor map.

Notation: g query heads per KV head (the group), d head dim, Bc key rows a tile, S splits.
"""
from __future__ import annotations

from collections import OrderedDict

from ..core.registry import Need
from . import decode_config as D
from .launch import round_up
from .packed import kept
from .policy import decode_v8_default_at, held_back

#: the head dims of the Hopper tiles (64-column TMA panels, hopper_tile.cuh's products)
DECODE_V8_HEAD_DIMS = (64, 128, 256)
#: the most query heads a KV head: one consumer warpgroup's 64 rows
DECODE_V8_MAX_GROUP = 64
#: Bc by head dim.  A consumer thread holds O (d / 2 float32), S (Bc / 2) and P (Bc / 4 words);
#: two consumer warpgroups and the producer's (384 threads, one block an SM) leave 168
#: registers a thread, which hold O, S and P at d 64 with 128-key tiles and at d 128 with
#: 64-key ones; at d 256 O alone is 128, so one consumer (255 registers) with 64-key tiles
DECODE_V8_BLOCK_N = {64: 128, 128: 64, 256: 64}
DECODE_V8_CONSUMERS = {64: 2, 128: 2, 256: 1}
#: the key tiles a config may name (one wgmma's N; 128 would not fit beside O at d 256)
DECODE_V8_BLOCK_N_CHOICES = (64, 128)
#: the ring's default bytes (K and V tiles in flight a block, one block an SM): about v4's
#: default ring, so as many bytes are in flight an SM
DECODE_V8_RING_BYTES = 192 * 1024
DECODE_V8_MAX_STAGES = 8
#: the query rows a block computes (the group, padded with zero rows): one consumer's tile
DECODE_V8_ROWS = 64
#: the kernel aligns its dynamic SRAM to one 128-byte-swizzle atom itself
SWIZZLE_ATOM_BYTES = 1024
#: compute capability x 10 of wgmma and TMA (sm_90a)
CC_HOPPER = 90


def v8_limits(dtype: str, head_dim: int, group: int) -> str | None:
    """Why decode v8 cannot take (dtype, head_dim, group), or None: 16-bit queries, head dims
    DECODE_V8_HEAD_DIMS, at most DECODE_V8_MAX_GROUP query heads a KV head."""
    if dtype not in ("float16", "bfloat16"):
        return f"the float16/bfloat16 Hopper decode, got {dtype}"
    if head_dim not in DECODE_V8_HEAD_DIMS:
        dims = ", ".join(map(str, DECODE_V8_HEAD_DIMS))
        return f"head_dim must be one of {dims} (64-column TMA panels), got {head_dim}"
    if group > DECODE_V8_MAX_GROUP:
        return f"group: at most {DECODE_V8_MAX_GROUP} query heads a KV head (one warpgroup's rows), got {group}"
    return None


def v8_block_n(cfg, head_dim: int) -> int:
    """Bc: the config's tile_rows (64 or 128; 64 at head_dim 256), or DECODE_V8_BLOCK_N."""
    rows = cfg.tile_rows or DECODE_V8_BLOCK_N[head_dim]
    if rows not in DECODE_V8_BLOCK_N_CHOICES or (head_dim == 256 and rows != 64):
        raise ValueError(f"config.tile_rows: decode v8 takes {' or '.join(map(str, DECODE_V8_BLOCK_N_CHOICES))} "
                         f"keys a tile (64 at head_dim 256, where O fills the registers), got {rows}")
    return rows


def decode_v8_smem(head_dim: int, block_n: int, stages: int) -> int:
    """decode_v8.cu's dynamic SRAM a block: the alignment slack, Q_g (64 rows), ``stages`` x
    (K_j, V_j).  The consumers' merge buffer and the fused combine's weights reuse the ring
    (:func:`v8_fits_merge` checks they fit)."""
    return SWIZZLE_ATOM_BYTES + DECODE_V8_ROWS * head_dim * 2 + stages * 2 * block_n * head_dim * 2


def v8_fits_merge(head_dim: int, group: int, block_n: int, stages: int, consumers: int) -> bool:
    """Whether the ring holds the consumers' float32 merge rows and the combine's weights at
    DECODE_MAX_SPLITS (what the kernel writes there after its key loop)."""
    ring = stages * 2 * block_n * head_dim * 2
    return consumers * group * head_dim * 4 <= ring and group * D.DECODE_MAX_SPLITS * 4 <= ring


def v8_stages(cfg, head_dim: int, group: int, smem_limit: int | None) -> int:
    """The ring depth: the config's stages, or as many as hold DECODE_V8_RING_BYTES of K/V
    (at most DECODE_V8_MAX_STAGES), made shallower until the block's SRAM fits ``smem_limit``;
    always a multiple of the consumer warpgroups (a stage's tiles then go to one consumer, which
    the ring's barrier phases need: decode_v8.cu)."""
    consumers = DECODE_V8_CONSUMERS[head_dim]
    if cfg.stages is not None:
        if cfg.stages % consumers:
            raise ValueError(f"config.stages: decode v8 at head_dim={head_dim} takes a multiple of its "
                             f"{consumers} consumer warpgroups, got {cfg.stages}")
        return cfg.stages
    bn = v8_block_n(cfg, head_dim)
    top = min(DECODE_V8_MAX_STAGES, max(D.MIN_STAGES, DECODE_V8_RING_BYTES // (2 * bn * head_dim * 2)))
    for st in range(top - top % consumers, D.MIN_STAGES - 1, -consumers):
        if smem_limit is None or decode_v8_smem(head_dim, bn, st) <= smem_limit:
            return st
    return D.MIN_STAGES


def v8_defines(cfg, base: dict, head_dim: int, dtype: str, group: int, smem_limit: int | None = None,
               kv: str | None = None, cc: int | None = None) -> dict:
    """decode_v8.cu's -D defines: ``base`` (dtype, head dim, group, paged) plus the tile, the
    ring, the consumers and the combine."""
    why = v8_limits(dtype, head_dim, group)
    if why is None and (kv is not None or base.get("PAGED")):
        why = "reads a contiguous 16-bit cache (a page's rows are not one box of a tensor map)"
    if why:
        raise ValueError(f"config.version: v8: {why}")
    bn = v8_block_n(cfg, head_dim)
    stages = v8_stages(cfg, head_dim, group, smem_limit)
    consumers = DECODE_V8_CONSUMERS[head_dim]
    if not v8_fits_merge(head_dim, group, bn, stages, consumers):
        raise ValueError(f"config.stages: decode v8's ring of {stages} x {bn} keys is too small for its merge "
                         f"at head_dim={head_dim}, group {group} (more stages)")
    return dict(base, BLOCK_N=bn, STAGES=stages, CONSUMERS=consumers, NUM_WARPS=4 * (consumers + 1),
                FUSED=int(cfg.combine_fused(group, head_dim)), COMBINE_REG_SPLITS=D.COMBINE_REG_SPLITS)


def smem_v8(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0) -> tuple:
    """(bytes, table offset) of a launch (the split kernels' SRAM rule; no block table)."""
    total = decode_v8_smem(d, defines["BLOCK_N"], defines["STAGES"])
    return total, round_up(total, 16)


def check_decode_v8(n: Need) -> str | None:
    """The registry's check of decode v8: a GPU of compute capability 9.0 (wgmma, TMA; not the
    simulator), :func:`v8_limits`, a contiguous 16-bit cache whose rows start on 16 bytes, the
    shallowest ring's SRAM, and cuda-python to encode the tensor maps."""
    if n.simulator:
        return "runs on a GPU only (not the simulator)"
    group = n.extra.get("group", 1)
    why = v8_limits(n.dtype, n.head_dim, group)
    if why:
        return why
    if n.extra.get("kv_dtype") is not None:
        return f"kv_dtype: reads 16-bit caches; a {n.extra['kv_dtype']} cache is read by v5 or v3"
    if n.cc is not None and n.cc != CC_HOPPER:
        return f"needs compute capability 9.0 (Hopper: wgmma, TMA, sm_90a); this GPU is {n.cc / 10:.1f}"
    if not n.extra.get("aligned16", True):
        return "rows must start on 16-byte boundaries (base pointer and strides)"
    smem, least = n.extra.get("smem"), decode_v8_smem(n.head_dim, DECODE_V8_BLOCK_N[n.head_dim], D.MIN_STAGES)
    if smem is not None and least > smem:
        return f"needs {least:,} B of shared memory a block at head_dim={n.head_dim}; this GPU allows {smem:,} B"
    from .hopper.checks import available       # here: hopper imports the registry
    return available()


def v8_default_check(op: str):
    """The ``default_check`` of v8's record: the groups :func:`~.policy.decode_v8_default_at`
    allows, then :data:`~.policy.HELD_BACK` (asked on every call)."""
    def why_not(n: Need) -> str | None:
        group = n.extra.get("group", 1)
        if not decode_v8_default_at(group):
            return (f"not the default at group {group}: v4 is, up to its 16 rows (a config naming the version "
                    f"runs it: DecodeConfig('v8'))")
        return held_back(op, "v8")
    return why_not


#: tensor-map triples (Q, K, V) kept by what they encode: the addresses, sizes, strides and tile
#: (a map holds nothing else, so a hit is the map a fresh encode would give); a decode loop over
#: one cache reuses its maps instead of asking the driver for three a call
MAPS_KEPT = 64
_MAPS: OrderedDict = OrderedDict()


def v8_maps(key: tuple) -> tuple:
    """(map_q, map_k, map_v) of ``key`` = (q, k, v addresses, B, Hq, Hkv, N, d, dtype, Bc, K's and
    V's byte strides (batch, head, row)), encoded once and kept (the last MAPS_KEPT)."""
    from . import hopper as hp                 # here: hopper imports the registry

    def encode():
        q, k, v, B, Hq, Hkv, nk, d, dtype, bn, ks, vs = key
        g = Hq // Hkv
        return (hp.tensor_map(q, dtype, (d, g, B * Hkv), (2 * d, 2 * d * g), (64, DECODE_V8_ROWS, 1)),
                hp.tensor_map(k, dtype, (d, nk, Hkv, B), (ks[2], ks[1], ks[0]), (64, bn, 1, 1)),
                hp.tensor_map(v, dtype, (d, nk, Hkv, B), (vs[2], vs[1], vs[0]), (64, bn, 1, 1)))
    return kept(_MAPS, key, encode, MAPS_KEPT)


def args_v8(a) -> tuple:
    """decode_v8.cu's arguments from a :class:`~.decode_launch.SplitArgs`: the tensor maps of Q
    (the groups' rows, (d, g, B * Hkv)), K and V ((d, N, Hkv, B) with the cache's strides: a view
    of a longer cache is read in place; :func:`v8_maps`), then the lengths, sizes, splits, window
    and partials, the fused combine's counters, O and LSE."""
    st = a.static
    ks, vs = tuple(int(x) * 2 for x in a.cache[:3]), tuple(int(x) * 2 for x in a.cache[3:6])
    for name, s in (("k", ks), ("v", vs)):
        if any(x % 16 for x in s):
            raise ValueError(f"{name}: decode v8's tensor maps need strides of whole 16 bytes, got {s} bytes")
    maps = v8_maps((*(int(x) for x in a.head), st.batch, st.heads_q, st.heads_kv, int(a.tail[1]), st.head_dim,
                    st.dtype, st.defines["BLOCK_N"], ks, vs))
    return (*maps, *a.tail, *a.counters, *a.out)


D.VERSION_RULES["v8"] = {"stages": v8_stages, "defines": v8_defines}
