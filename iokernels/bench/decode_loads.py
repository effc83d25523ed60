"""The sweeps' load experiments of decode v4: bulk copies and padded rows (kernels/decode_v4_loads.cu).

decode_v4.cu keeps one load path (16-byte cp.async chunks, rows swizzled where they are whole
128-byte halves, the cache operator of DecodeConfig.v4_load_l1).  The other paths it once
carried are timed here, through cupy_raw.decode's own launcher with v4's config and defines
plus the experiment's: :data:`LOADS` names them.  Only the sweeps use this module.
"""
from __future__ import annotations

import importlib
import pathlib
from dataclasses import replace

from ..core.records import Record
from ..cupy_raw import decode_config as D

#: the launcher module (``cupy_raw.decode`` the attribute is the decode function)
cd = importlib.import_module("iokernels.cupy_raw.decode")

#: the sweeps-only kernel file, by name (launch.function's ``sources`` table)
SOURCES = {"decode_v4_loads": str(pathlib.Path(__file__).resolve().parent / "kernels" / "decode_v4_loads.cu")}
#: the experiments: their extra defines (None: SWIZZLE as decode_v4.cu sets it)
LOADS = {
    "bulk": dict(LOAD_BULK=1, SWIZZLE=0, LOAD_L1=0),      # the copy engine, one row a copy (sm_90)
    "padded": dict(LOAD_BULK=0, SWIZZLE=0),              # padded rows where v4 swizzles
    "same": dict(LOAD_BULK=0, SWIZZLE=None),             # decode_v4.cu's path, from this file
}
#: compute capability the bulk copies need
CC_BULK = 90


def _smem(swizzle: bool):
    def smem(d, dtype, group, defines, kv, num_splits=1, fused=True, table_cap=0):
        return D.decode_v4_smem(d, dtype, group, defines["STAGES"], defines["TILE_ROWS"], defines["NUM_WARPS"],
                                num_splits, fused, table_cap, swizzled=swizzle)
    return smem


def loads_kernel(load: str, head_dim: int) -> Record:
    """The split kernel of experiment ``load`` (a key of :data:`LOADS`) at ``head_dim``."""
    if load not in LOADS:
        raise ValueError(f"load: one of {', '.join(LOADS)}, got {load!r}")
    extra = dict(LOADS[load])
    if extra["SWIZZLE"] is None:
        extra["SWIZZLE"] = int(D.decode_v4_swizzled(head_dim))
    v4 = cd.REGISTRY.get("decode", "v4")
    return replace(v4, file="decode_v4_loads", kernel="decode_split_v4_loads",
                   extra=dict(v4.extra, smem=_smem(bool(extra["SWIZZLE"])), defines=extra, sources=SOURCES))


def decode(q, k, v, load: str, *, seq_lens=None, num_splits=None, config=None):
    """decode v4 over a contiguous cache with load path ``load``: (O, LSE)."""
    cfg = config or D.DecodeConfig("v4")
    return cd.run_decode(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=None, config=cfg,
                         kernel=loads_kernel(load, q.shape[-1]))


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, load: str, *, num_splits=None, config=None):
    """decode v4 over paged pools with load path ``load``: (O, LSE)."""
    cfg = config or D.DecodeConfig("v4")
    return cd._paged_pools(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits, scale=None,
                           config=cfg, kernel=loads_kernel(load, q.shape[-1]))
