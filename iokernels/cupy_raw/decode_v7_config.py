"""decode v7's settings (decode_v7.cu: decode v3 with the query group split over blocks), its
registry check and the split it launches.

decode v7 is v3 (:mod:`.decode_config`) with each KV head's g query heads served by
GROUP_SPLIT blocks of g / GROUP_SPLIT heads each (:func:`v7_group_split`), so a lane's
registers hold its block's slice of the group, at one 8-warp block an SM.
:class:`~.decode_config.DecodeConfig` with ``version="v7"`` takes v3's fields (stages,
tile_rows, num_warps, fused, min_blocks); its defines come from here (:func:`v7_defines`,
registered in ``decode_config.VERSION_RULES`` when this module is imported, as the package
does), and its ring depth is v3's for the slice.

The launcher reads the split back from the defines (GROUP: the heads a block holds,
GROUP_SPLIT: blocks a KV head) and launches heads_kv x GROUP_SPLIT blocks along the grid's y
(decode_launch.split_static).

Notation: g query heads per KV head (the group), d head dim.
"""
from __future__ import annotations

from dataclasses import replace

from ..core.registry import Need
from . import decode_config as D
from .policy import (DECODE_V3_LANE_WORDS, DECODE_V7_LANE_WORDS, DECODE_V7_LANE_WORDS_FLOAT64,
                     DECODE_V7_MIN_BLOCKS, decode_v7_group_split)


def v7_budget(dtype: str) -> int:
    """A lane's words for its block's query heads at one 8-warp block an SM (float64's
    accumulators take pairs of registers, and their addresses and shuffles more besides)."""
    return DECODE_V7_LANE_WORDS_FLOAT64 if dtype == "float64" else DECODE_V7_LANE_WORDS


def v7_group_split(head_dim: int, dtype: str, group: int, kv: str | None = None,
                   tile_rows: int | None = None) -> int | None:
    """GROUP_SPLIT: :func:`~.policy.decode_v7_group_split` for a lane's words a head
    (:func:`~.decode_config.lane_words_a_head`); None where v3's ring does not take the rows."""
    words = D.lane_words_a_head(head_dim, dtype, tile_rows, kv)
    if words is None:
        return None
    return decode_v7_group_split(group, words, v7_budget(dtype))


def v7_defines(cfg, base: dict, head_dim: int, dtype: str, group: int, smem_limit: int | None = None,
               kv: str | None = None, cc: int | None = None) -> dict:
    """decode_v7.cu's -D defines: v3's for the slice of the group a block holds (GROUP), plus
    GROUP_SPLIT and DECODE_MIN_BLOCKS (the config's min_blocks, else
    :data:`~.policy.DECODE_V7_MIN_BLOCKS`)."""
    split = v7_group_split(head_dim, dtype, group, kv, cfg.tile_rows)
    if split is None:
        raise ValueError(f"config.version: v7 needs rows of whole 16-byte chunks, at most {D.MAX_ROW_CHUNKS}; "
                         f"head_dim={head_dim} ({kv or dtype}) is not (use version 'v1')")
    heads = group // split
    out = cfg.ring_defines(dict(base, GROUP=heads), head_dim, dtype, heads, smem_limit, kv)
    return dict(out, GROUP_SPLIT=split, DECODE_MIN_BLOCKS=cfg.min_blocks or DECODE_V7_MIN_BLOCKS)


def check_decode_v7(n: Need, check_ring) -> str | None:
    """The registry's check of decode v7: the groups v3 cannot hold in its registers
    (:data:`~.policy.DECODE_V3_LANE_WORDS`), then v3's checks (``check_ring``: the registry's
    ring check, cache kinds, row alignment, SRAM) at the slice of the group a block holds."""
    group, kv = n.extra.get("group", 1), n.extra.get("kv_dtype")
    words = D.lane_words_a_head(n.head_dim, n.dtype, None, kv)
    if words is None:
        return (f"rows must be whole 16-byte chunks, at most {D.MAX_ROW_CHUNKS}; head_dim={n.head_dim} "
                f"({kv or n.dtype}) is not")
    if words * group <= DECODE_V3_LANE_WORDS:
        return (f"group: v3 holds {group} query heads a KV head in its registers at head_dim={n.head_dim} "
                f"({kv or n.dtype}); v7 takes the groups it does not")
    split = decode_v7_group_split(group, words, v7_budget(n.dtype))
    return check_ring("v7", replace(n, extra=dict(n.extra, group=group // split)))


D.VERSION_RULES["v7"] = {"defines": v7_defines}
