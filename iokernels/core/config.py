"""Tile sizes as named settings that know the on-chip memory (SRAM) they need.

Notation (FlashAttention paper):

=====  ==========================================================
Br     query rows per tile (block_q)
Bc     key/value rows per tile (block_k)
Tr     number of query tiles, ceil(Nq / Br)
Tc     number of key/value tiles, ceil(Nk / Bc)
M      SRAM capacity in bytes (the paper counts elements; we count bytes)
tau    ``rescale_threshold``: FlashAttention-4's conditional rescaling, in log2 units
=====  ==========================================================

A tile set that does not fit ``sram_bytes`` is a ValueError naming ``config``, so the
Theta(N^2 d^2 / M) trade-off can be explored by shrinking M.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import conventions as cv

#: 228 KiB: shared memory per SM on an H100/H200 (the largest of the GPUs in the roofline
#: table); the default capacity a config is checked against.
DEFAULT_SRAM_BYTES = 228 * 1024

#: Br = Bc = 64: the tile FlashAttention-2 uses for head dims up to 128 in 16-bit types;
#: :meth:`TileConfig.default` shrinks it where the tile set would not fit.
DEFAULT_BLOCK = 64
#: the largest ``rescale_threshold`` allowed: a kept maximum lets exp(S - m) reach 2^tau, and
#: 2^64 times a row sum over up to 2^60 keys still fits float32's range (about 2^128).
MAX_RESCALE_THRESHOLD = 64.0


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of a tiled attention kernel.

    block_q (Br), block_k (Bc): tile rows.  loop_order: "fa2" (Q tiles outer, FlashAttention-2)
    or "fa1" (K/V tiles outer, FlashAttention-1).  sram_bytes: the capacity M the tiles must
    fit in.  rescale_threshold: None (the default) rescales O and l whenever a row's maximum
    grows; a number tau >= 0 (log2 units) keeps the old maximum while it has grown by at most
    tau, FlashAttention-4's conditional rescaling (see :mod:`iokernels.tiled`).
    """

    block_q: int = DEFAULT_BLOCK
    block_k: int = DEFAULT_BLOCK
    loop_order: str = "fa2"
    sram_bytes: int = DEFAULT_SRAM_BYTES
    rescale_threshold: float | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "sram_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config: {name} must be a positive integer, got {v!r}")
        cv.check_choice(self.loop_order, "config.loop_order", ("fa1", "fa2"))
        t = self.rescale_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 <= t <= MAX_RESCALE_THRESHOLD):
            raise ValueError(f"config: rescale_threshold must be None or a number in "
                             f"[0, {MAX_RESCALE_THRESHOLD:g}] (log2 units), got {t!r}")

    def replace(self, **changes) -> "TileConfig":
        return replace(self, **changes)

    def sram_usage(self, head_dim: int, dtype: str = "float32") -> int:
        """Bytes on chip for one tile set: Q_i, K_j, V_j in the storage dtype; S_ij/P_ij,
        O_i and the row statistics m_i, l_i in the accumulator dtype."""
        st = cv.itemsize_of(dtype)
        acc = cv.accum_dtype(dtype).itemsize
        Br, Bc, d = self.block_q, self.block_k, head_dim
        return (Br * d + 2 * Bc * d) * st + (Br * Bc + Br * d + 2 * Br) * acc

    def check_fits(self, head_dim: int, dtype: str = "float32") -> None:
        need = self.sram_usage(head_dim, dtype)
        if need > self.sram_bytes:
            raise ValueError(
                f"config: tiles Br={self.block_q}, Bc={self.block_k} at head_dim={head_dim} ({dtype}) "
                f"need {need:,} B of SRAM, more than sram_bytes={self.sram_bytes:,}")

    @classmethod
    def default(cls, head_dim: int, dtype: str = "float32", sram_bytes: int = DEFAULT_SRAM_BYTES,
                **kw) -> "TileConfig":
        """The tiles a call gets when it passes no config: Br x Bc = 64 x 64, the larger of the
        two halved until the tile set fits ``sram_bytes`` (as FlashAttention picks smaller tiles
        for larger head dims).  At head_dim=128 in float64, or 256 in float32, 64 x 64 does not
        fit 228 KiB; 32 x 32 does."""
        cfg = cls(block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK, sram_bytes=sram_bytes, **kw)
        while cfg.sram_usage(head_dim, dtype) > sram_bytes and (cfg.block_q > 1 or cfg.block_k > 1):
            if cfg.block_k >= cfg.block_q and cfg.block_k > 1:
                cfg = cfg.replace(block_k=cfg.block_k // 2)
            else:
                cfg = cfg.replace(block_q=cfg.block_q // 2)
        cfg.check_fits(head_dim, dtype)
        return cfg

    @classmethod
    def from_sram(cls, sram_bytes: int, head_dim: int, dtype: str = "float32", **kw) -> "TileConfig":
        """The paper's choice (:func:`paper_tiles`): Bc = ceil(M / 4d), Br = min(Bc, d), M in
        elements, Bc halved until the tile set fits ``sram_bytes``."""
        br, bc = paper_tiles(sram_bytes, head_dim, dtype)
        return cls(block_q=br, block_k=bc, sram_bytes=sram_bytes, **kw)


def paper_tiles(sram_bytes: int, head_dim: int, dtype: str = "float32") -> tuple[int, int]:
    """(Br, Bc) by FlashAttention's Algorithm 1 (Dao et al., 2022, line 1): Bc = ceil(M / 4d)
    and Br = min(Bc, d) with M the SRAM in elements of ``dtype``; where that tile set does not
    fit ``sram_bytes`` (this package also counts S_ij, O_i and the statistics on chip), Bc is
    halved and Br recomputed from it, so Br = min(Bc, d) holds for the tiles returned."""
    bc = max(1, math.ceil(sram_bytes // cv.itemsize_of(dtype) / (4 * head_dim)))
    while True:
        br = max(1, min(bc, head_dim))
        if bc == 1 or TileConfig(br, bc, sram_bytes=sram_bytes).sram_usage(head_dim, dtype) <= sram_bytes:
            return br, bc
        bc = max(1, bc // 2)
