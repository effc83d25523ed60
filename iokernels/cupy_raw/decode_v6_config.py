"""decode v6's settings (decode_v6.cu: a GQA group of more than 16 query heads on the tensor
cores), its limits, its shared memory and its registry check.

decode v6 is v4 (:mod:`.decode_config`) with the group split across the warps of a block:
a team of :func:`~.policy.decode_v6_team_warps` warps shares one stream of K/V tiles, each
warp holding 16 query rows.  :class:`~.decode_config.DecodeConfig` with ``version="v6"``
takes the same fields as v4 (stages, tile_rows, num_warps, fused, min_blocks, load_l1); its
defines and ring depth come from here (:func:`v6_defines`, :func:`v6_stages`, registered in
``decode_config.VERSION_RULES`` when this module is imported, as the package does).

Notation: g query heads per KV head (the group), d head dim, Bc key rows a tile, S splits.
"""
from __future__ import annotations

from ..core.registry import Need
from . import decode_config as D
from .policy import decode_v6_default_at, decode_v6_stages, decode_v6_team_warps, held_back

#: the largest group: 16 rows a warp, a team of at most DECODE_V6_WARPS warps (past 64 query
#: heads one team fills the block; the registry's default takes v6 up to the groups
#: :func:`~.policy.decode_v6_default_at` allows)
DECODE_V6_MAX_GROUP = 128
#: warps a block (whole teams): 8, or 4 where 8 warps' shallowest ring does not fit the SRAM
#: and a team is at most 4 warps
DECODE_V6_WARPS = 8
DECODE_V6_SMALL_WARPS = 4
#: Bc: 32 key rows a tile up to head_dim DECODE_V6_WIDE_MAX_DIM (a team's copies are then at
#: least 2 chunks of K and of V a lane, and S, O and Q's fragments fit the registers, as v4's
#: 32-row variant does), 16 above
DECODE_V6_TILE_ROWS = 32
DECODE_V6_WIDE_MAX_DIM = 128
#: the key rows a block's rings hold by default: v4's default ring (8 warps x 3 stages x 16
#: rows), so teams of more warps take deeper rings (at most DECODE_V6_MAX_STAGES)
DECODE_V6_RING_ROWS = D.DECODE_V4_WARPS * D.DECODE_V4_STAGES * D.DECODE_V4_TILE_ROWS
DECODE_V6_MAX_STAGES = 8
#: compute capability (x 10) of mma.sync m16n8k16 with bfloat16 and cp.async
CC_AMPERE = 80


def v6_limits(dtype: str, head_dim: int, group: int) -> str | None:
    """Why decode v6 cannot take (dtype, head_dim, group), or None: 16-bit queries, head dims of
    whole 16-deep mma k-steps up to D.DECODE_V4_MAX_HEAD_DIM (O in registers, as v4), at most
    DECODE_V6_MAX_GROUP query heads a KV head."""
    if dtype not in ("float16", "bfloat16"):
        return f"the float16/bfloat16 tensor-core decode, got {dtype}"
    if head_dim % D.MMA_K or head_dim > D.DECODE_V4_MAX_HEAD_DIM:
        return (f"head_dim must be a multiple of {D.MMA_K} up to {D.DECODE_V4_MAX_HEAD_DIM} "
                f"(whole mma k-steps, O in registers), got {head_dim}")
    if group > DECODE_V6_MAX_GROUP:
        return (f"group: at most {DECODE_V6_MAX_GROUP} query heads a KV head (16 rows a warp, "
                f"{DECODE_V6_WARPS} warps a team), got {group}")
    return None


def decode_v6_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0,
                   swizzled: bool = False) -> tuple:
    """decode_v6.cu's dynamic SRAM a block, as (total bytes, byte offset of the block table):
    max(the teams' rings, the teams' float32 merge buffer (one g x d row block a team), the
    fused combine's weights), then ``table_cap`` int32 entries.  Rows counted padded by
    V4_ROW_PAD_BYTES unless ``swizzled`` (exact), as :func:`~.decode_config.decode_v4_smem`."""
    teams = num_warps // decode_v6_team_warps(group)
    pad = 0 if swizzled else D.V4_ROW_PAD_BYTES
    stage = 2 * tile_rows * (head_dim * 2 + pad)
    return D._ring_fused_smem(stage, head_dim, group, stages, teams, num_splits, fused, table_cap)


def v6_tile_rows(cfg, head_dim: int) -> int:
    """Bc: the config's tile_rows (a multiple of 16), or DECODE_V6_TILE_ROWS up to head_dim
    DECODE_V6_WIDE_MAX_DIM, 16 above."""
    rows = cfg.tile_rows or (DECODE_V6_TILE_ROWS if head_dim <= DECODE_V6_WIDE_MAX_DIM else D.MMA_K)
    if rows % D.MMA_K:
        raise ValueError(f"config.tile_rows: decode v6 takes multiples of {D.MMA_K} (the k depth of one "
                         f"P V product), got {rows}")
    return rows


def _fits(cfg, head_dim, group, stages, warps, smem_limit) -> bool:
    need = decode_v6_smem(head_dim, "float16", group, stages, v6_tile_rows(cfg, head_dim), warps,
                          D.DECODE_MAX_SPLITS, True, D.DECODE_V3_TABLE_CAP)[0]
    return smem_limit is None or need <= smem_limit


def v6_warps(cfg, head_dim: int, group: int, smem_limit: int | None) -> int:
    """Warps a block: the config's num_warps, or DECODE_V6_WARPS where its shallowest ring
    fits, else :func:`v6_small_warps`."""
    if cfg.num_warps is not None:
        return cfg.num_warps
    fits = _fits(cfg, head_dim, group, D.MIN_STAGES, DECODE_V6_WARPS, smem_limit)
    return DECODE_V6_WARPS if fits else v6_small_warps(group)


def v6_small_warps(group: int) -> int:
    """The smallest block v6 runs ``group`` in: DECODE_V6_SMALL_WARPS warps, or one whole team
    where a team is wider (past 64 query heads a KV head)."""
    return max(DECODE_V6_SMALL_WARPS, decode_v6_team_warps(group))


def v6_stages(cfg, head_dim: int, group: int, smem_limit: int | None) -> int:
    """The ring depth: the config's stages, or :func:`~.policy.decode_v6_stages` (the key rows
    of v4's default ring), made shallower until the rings, the fused combine's weights at
    DECODE_MAX_SPLITS and a full staged block table fit ``smem_limit``."""
    if cfg.stages is not None:
        return cfg.stages
    warps = v6_warps(cfg, head_dim, group, smem_limit)
    teams = warps // decode_v6_team_warps(group)
    top = decode_v6_stages(DECODE_V6_RING_ROWS, teams, v6_tile_rows(cfg, head_dim), DECODE_V6_MAX_STAGES,
                           D.MIN_STAGES)
    for st in range(top, D.MIN_STAGES - 1, -1):
        if _fits(cfg, head_dim, group, st, warps, smem_limit):
            return st
    return D.MIN_STAGES


def v6_load_l1(cfg, paged: bool, head_dim: int, group: int, warps: int, stages: int, cc: int | None) -> bool:
    """Whether the copies pass through L1: the config's load_l1, or v4's rule
    (D.DECODE_V4_L1 on compute capability D.CC_L1+, a contiguous cache whose rows divide a
    warp, a ring of at most D.DECODE_V4_L1_MAX_RING bytes as allocated)."""
    if cfg.load_l1 is not None:
        return cfg.load_l1
    chunks = head_dim * 2 // D.CHUNK_BYTES
    ring = decode_v6_smem(head_dim, "float16", group, stages, v6_tile_rows(cfg, head_dim), warps,
                          swizzled=True)[0]
    return bool(D.DECODE_V4_L1 and cc is not None and cc >= D.CC_L1 and not paged and 32 % chunks == 0
                and ring <= D.DECODE_V4_L1_MAX_RING)


def v6_defines(cfg, base: dict, head_dim: int, dtype: str, group: int, smem_limit: int | None = None,
               kv: str | None = None, cc: int | None = None) -> dict:
    """decode_v6.cu's -D defines: ``base`` (dtype, head dim, group, paged, block size) plus the
    team, the block, the ring and the combine."""
    why = v6_limits(dtype, head_dim, group)
    if why is None and kv is not None:
        why = f"kv_dtype: reads 16-bit caches; a {kv} cache is read by v5 or v3"
    if why:
        raise ValueError(f"config.version: v6: {why}")
    team = decode_v6_team_warps(group)
    nw = v6_warps(cfg, head_dim, group, smem_limit)
    if nw % team:
        raise ValueError(f"config.num_warps: decode v6 at group {group} runs teams of {team} warps; "
                         f"{nw} warps are not whole teams")
    stages = v6_stages(cfg, head_dim, group, smem_limit)
    l1 = v6_load_l1(cfg, bool(base["PAGED"]), head_dim, group, nw, stages, cc)
    mb = cfg.min_blocks or max(1, D.DECODE_V4_MIN_BLOCKS * DECODE_V6_WARPS // nw)
    return dict(base, TEAM_WARPS=team, NUM_WARPS=nw, STAGES=stages, TILE_ROWS=v6_tile_rows(cfg, head_dim),
                DECODE_MIN_BLOCKS=mb, FUSED=int(cfg.combine_fused(group, head_dim)), LOAD_L1=int(l1),
                COMBINE_REG_SPLITS=D.COMBINE_REG_SPLITS)


def v6_smem_bound(head_dim: int, dtype: str, group: int) -> int:
    """The most dynamic SRAM a v6 call can ask for at its smallest block (:func:`v6_small_warps`
    warps), the shallowest ring, the fused combine's weights at DECODE_MAX_SPLITS and a full
    staged block table (the registry's check compares it with the GPU's limit)."""
    rows = DECODE_V6_TILE_ROWS if head_dim <= DECODE_V6_WIDE_MAX_DIM else D.MMA_K
    return decode_v6_smem(head_dim, dtype, group, D.MIN_STAGES, rows, v6_small_warps(group),
                          D.DECODE_MAX_SPLITS, True, D.DECODE_V3_TABLE_CAP)[0]


def check_decode_v6(n: Need) -> str | None:
    """The registry's check of decode v6: :func:`v6_limits`, a 16-bit cache, mma.sync m16n8k16 and
    cp.async (compute capability 8.0), rows of whole 16-byte chunks that start on 16 bytes,
    and its smallest block's SRAM."""
    group = n.extra.get("group", 1)
    why = v6_limits(n.dtype, n.head_dim, group)
    if why:
        return why
    kv = n.extra.get("kv_dtype")
    if kv is not None:
        return f"kv_dtype: reads 16-bit caches; a {kv} cache is read by v5 or v3"
    if n.cc is not None and n.cc < CC_AMPERE:
        return f"mma.sync m16n8k16 and cp.async need compute capability 8.0 or newer; this GPU is {n.cc / 10:.1f}"
    if D.decode_v2_geometry(n.head_dim, n.dtype) is None:
        return f"rows must be whole 16-byte chunks, at most {D.MAX_ROW_CHUNKS}; head_dim={n.head_dim} is not"
    if not n.extra.get("aligned16", True):
        return "rows must start on 16-byte boundaries (base pointer and strides)"
    smem, bound = n.extra.get("smem"), v6_smem_bound(n.head_dim, n.dtype, group)
    if smem is not None and bound > smem:
        return (f"its smallest block needs up to {bound:,} B of shared memory at head_dim={n.head_dim} "
                f"({n.dtype}), group {group}; this GPU allows {smem:,} B")
    return None


def v6_default_check(op: str):
    """The ``default_check`` of v6's record for ``op``: :data:`~.policy.HELD_BACK`, then the
    groups :func:`~.policy.decode_v6_default_at` allows (asked on every call)."""
    def why_not(n: Need) -> str | None:
        group = n.extra.get("group", 1)
        if not decode_v6_default_at(group):
            return (f"not the default at group {group} until measured on a GPU; a config naming the "
                    f"version runs it (DecodeConfig('v6'))")
        return held_back(op, "v6")
    return why_not


D.VERSION_RULES["v6"] = {"stages": v6_stages, "defines": v6_defines}
