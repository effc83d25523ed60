"""BackwardConfig: the tiles of bwd_v1.cu .. bwd_v6.cu."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core import conventions as cv
from .config_checks import check_positive, check_version
from .launch import DTYPE_IDS, round_up
from .policy import BWD_V3_STAGES, BWD_V4_STAGES, backward_v1_tiles

# =========================================================================== backward
#: v1: CUDA cores, every dtype; v2: tensor cores, float16/bfloat16 (bwd_v2.cu); v3: Hopper
#: (sm_90a: wgmma, TMA), float16/bfloat16 at head_dim 64 and 128 (bwd_v3.cu); v4: v3 with two
#: consumer warpgroups sharing each Q_i / dO_i tile (bwd_v4.cu); v5: v4's kernel, its blocks
#: longest first (bwd_v5.cu: v4's tiles, ring and limits); v6: v5 with dQ handed through SRAM to a
#: producer warp that adds it to HBM by bulk reductions (bwd_v6.cu: v4's tiles and limits)
BACKWARD_VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6")
#: bwd_v1: keys per tile and query rows per tile, shrunk (Br first) until the static SRAM fits
BWD_DEFAULT_BLOCK_K = 32
BWD_DEFAULT_BLOCK_Q = 32
#: lanes that share one key row (its dot products joined by warp shuffles)
BWD_LANES_PER_KEY = 8
#: static shared memory a block may declare without an opt-in, on every GPU
STATIC_SMEM_BYTES = 48 * 1024
#: bwd_v2 keeps dK_j, dV_j (D_PAD / 2 floats each a lane) in registers: head dims up to 128
BWD_V2_MAX_HEAD_DIM = 128
#: bwd_v2's Bc = 16 keys a warp x num_warps; 8 warps (Bc = 128, FlashAttention-2's) first
BWD_V2_WARP_CHOICES = (8, 4)
#: bwd_v2's Br: multiples of the 16 queries of one mma k-step
BWD_V2_BLOCK_Q_CHOICES = (16, 32, 64, 128)
#: bwd_v2: the accumulator floats a lane (dK_j + dV_j: D_PAD, S^T + dP^T: Br) the default
#: allows; the default Br (BWD_V2_BLOCK_Q) is 64 while D_PAD + 64 stays within it (d <= 128),
#: else 32.  At d = 128, Br = 64 ptxas spills a few bytes of 255 registers, and it still beats
#: Br = 32: half the Q-tile steps, so half the barriers, LSE/D loads and loop overhead per key
#: (the backward sweep rows of scripts/bwd_dev.py time both)
BWD_V2_ACC_FLOATS = 192
BWD_V2_BLOCK_Q = (64, 32)
#: bwd_v3: one consumer warpgroup owns Bc = 64 keys (the M of a wgmma is 64 rows), and takes
#: Br = 64 query rows a step (the M of the dQ product; S^T, dP^T are 64 x 64)
BWD_V3_BLOCK = 64
#: bwd_v3: dK_j and dV_j (64 x d float32 each) live in one warpgroup's registers, so d <= 128;
#: TMA boxes and the swizzle are 64-element panels, so d is a multiple of 64
BWD_V3_HEAD_DIMS = (64, 128)
BWD_V3_DTYPES = ("float16", "bfloat16")
#: bwd_v3: the Q_i / dO_i ring holds 1 to 4 stages (the file's #error says the same)
BWD_V3_MAX_STAGES = 4
#: bwd_v3: a producer warpgroup and one consumer warpgroup
BWD_V3_THREADS = 256
#: bwd_v3's SRAM: every tile starts on a 1024-byte swizzle atom (the launcher adds this slack);
#: mbarriers are 8 bytes
BWD_V3_SMEM_ALIGN = 1024
MBARRIER_BYTES = 8
#: bwd_v4: two consumer warpgroups of 64 keys each, so Bc = 128; Br = 64 query rows a step (the
#: M of the dQ product), as v3
BWD_V4_BLOCK_Q = 64
BWD_V4_BLOCK_K = 128
#: bwd_v4: v3's head dims (each warpgroup's dK_j, dV_j in its registers; 64-column panels) and dtypes
BWD_V4_HEAD_DIMS = BWD_V3_HEAD_DIMS
BWD_V4_DTYPES = BWD_V3_DTYPES
#: bwd_v4: the ring's depths the file takes (at d = 128 four do not fit a block's SRAM: resolve says so)
BWD_V4_MAX_STAGES = 4
#: bwd_v4: a producer warpgroup and two consumer warpgroups
BWD_V4_THREADS = 384
#: the versions with a Q_i / dO_i ring (``stages``), their Hopper kernels
BWD_RING_VERSIONS = ("v3", "v4", "v5", "v6")
#: the versions that add dQ from SRAM by bulk reductions: each consumer warpgroup's dQ panel (Br x 64
#: float32) has its own SRAM buffer (bwd_v6.cu)
BWD_SRAM_DQ_VERSIONS = ("v6",)
BWD_V6_DQ_PANEL_BYTES = BWD_V4_BLOCK_Q * 64 * 4


@dataclass(frozen=True)
class BackwardConfig:
    """The CuPy backward: version "v1" (bwd_v1.cu, CUDA cores, every dtype), "v2"
    (bwd_v2.cu, tensor cores, float16/bfloat16, head_dim <= 128), "v3" (bwd_v3.cu, Hopper
    only: wgmma and TMA, float16/bfloat16, head_dim 64 or 128), "v4" (bwd_v4.cu: v3 with two
    consumer warpgroups, the same limits), "v5" (bwd_v5.cu: v4's kernel with its blocks longest
    first; v4's fields and limits) or "v6" (bwd_v6.cu: v5 with dQ added to HBM from SRAM by a
    producer warp; v4's fields and limits); None: the registry's default.

    block_q (Br), block_k (Bc): Q-tile rows and K/V-tile keys.  v1: None means the largest
    that fit 48 KB of static SRAM, from 32 x 32.  v2: block_k = 16 * num_warps (64 or 128),
    block_q a multiple of 16 up to 128; None: Bc = 128 and Br = 64 (32 above d = 96), shrunk
    (Bc first, then Br) until the SRAM fits the GPU (``resolve(..., smem_limit=)``).
    v3: block_q = block_k = 64 (None: 64), a fixed block of two warpgroups.  v4: block_q = 64,
    block_k = 128 (None: those), a fixed block of three warpgroups; v5 and v6 the same.
    num_warps: v2 only (4 or 8).  lanes_per_key: v1 only, threads per key row (a power of two
    up to 32).  stages: v3 .. v6, Q_i / dO_i tiles the SRAM ring holds (1 .. 4, as the SRAM
    allows; None: :data:`~iokernels.cupy_raw.policy.BWD_V3_STAGES` /
    :data:`~iokernels.cupy_raw.policy.BWD_V4_STAGES`).  deterministic: dQ by per-tile partials
    summed in tile order (the same bits every run) instead of atomic adds.
    """

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    lanes_per_key: int | None = None
    deterministic: bool = False
    num_warps: int | None = None
    stages: int | None = None

    def __post_init__(self):
        check_version(self, BACKWARD_VERSIONS)
        check_positive(self, ("block_q", "block_k", "lanes_per_key", "num_warps", "stages"))
        lpk = self.lanes_per_key
        if lpk is not None and (lpk & (lpk - 1) or lpk > 32):
            raise ValueError(f"config.lanes_per_key: a power of two up to 32, got {lpk}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"config.deterministic: True or False, got {self.deterministic!r}")
        if self.version == "v2" and lpk is not None:
            raise ValueError("config.lanes_per_key: a v1 setting; v2 gives each warp 16 keys")
        if self.version == "v1" and self.num_warps is not None:
            raise ValueError("config.num_warps: a v2 setting; v1 runs block_k x lanes_per_key threads")
        if self.stages is not None and self.version not in BWD_RING_VERSIONS:
            raise ValueError(f"config.stages: a v3 .. v6 setting (their Q_i / dO_i ring), got {self.stages} for "
                             f"version {self.version!r}")
        if self.version == "v3":
            self._check_v3()
        if self.version in ("v4", "v5", "v6"):
            self._check_v4()

    def _check_v3(self) -> None:
        """v3's fields: its tiles are fixed (one consumer warpgroup), its ring 1 .. 4 stages."""
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if val is not None and val != BWD_V3_BLOCK:
                raise ValueError(f"config.{name}: v3 takes {BWD_V3_BLOCK} (one warpgroup's 64-row wgmma), got {val}")
        if self.lanes_per_key is not None:
            raise ValueError("config.lanes_per_key: a v1 setting; v3 gives a consumer warpgroup 64 keys")
        if self.num_warps is not None:
            raise ValueError("config.num_warps: a v2 setting; v3 runs a producer and a consumer warpgroup")
        if self.stages is not None and self.stages > BWD_V3_MAX_STAGES:
            raise ValueError(f"config.stages: v3 takes 1 to {BWD_V3_MAX_STAGES}, got {self.stages}")

    def _check_v4(self) -> None:
        """v4's (and v5's, v6's) fields: its tiles are fixed (two consumer warpgroups of 64 keys), its ring
        1 .. 4 stages."""
        v = self.version
        for name, fixed, why in (("block_q", BWD_V4_BLOCK_Q, "the 64 rows of its dQ product"),
                                 ("block_k", BWD_V4_BLOCK_K, "two consumer warpgroups of 64 keys")):
            val = getattr(self, name)
            if val is not None and val != fixed:
                raise ValueError(f"config.{name}: {v} takes {fixed} ({why}), got {val}")
        if self.lanes_per_key is not None:
            raise ValueError(f"config.lanes_per_key: a v1 setting; {v} gives each consumer warpgroup 64 keys")
        if self.num_warps is not None:
            raise ValueError(f"config.num_warps: a v2 setting; {v} runs a producer and two consumer warpgroups")
        if self.stages is not None and self.stages > BWD_V4_MAX_STAGES:
            raise ValueError(f"config.stages: {v} takes 1 to {BWD_V4_MAX_STAGES}, got {self.stages}")

    def replace(self, **changes) -> "BackwardConfig":
        return replace(self, **changes)

    @staticmethod
    def smem_bytes(block_q: int, block_k: int, head_dim: int, dtype: str, version: str = "v1",
                   stages: int = BWD_V3_STAGES) -> int:
        """v1: Q_i, dO_i, K_j, dS_ij (padded a column), LSE_i, D_i in the accumulator type.
        v2 (bwd_v2.cu): K_j, V_j, 2 x (Q_i, dO_i) rows of SROW 16-bit values, dS_ij^T
        [Bc][Br + 8] in 16 bits, 2 x (LSE_i, D_i) in float32.
        v3 (bwd_v3.cu; ``stages``): K_j, V_j, stages x (Q_i, dO_i) 16-bit tiles, two dS^T
        buffers [Bc][Br], stages x (LSE_i, D_i) float32, 1 + 2 stages mbarriers, the
        1024-byte alignment slack.  v4 (bwd_v4.cu), v5 and v6: the same tiles at Bc = 128; v6 adds the
        two consumer warpgroups' dQ panels (64 x 64 float32 each)."""
        if version in BWD_RING_VERSIONS:
            tiles = 2 * block_k * head_dim * 2 + stages * 2 * block_q * head_dim * 2 + 2 * block_k * block_q * 2
            tiles += 2 * BWD_V6_DQ_PANEL_BYTES if version in BWD_SRAM_DQ_VERSIONS else 0
            return tiles + stages * 2 * block_q * 4 + MBARRIER_BYTES * (1 + 2 * stages) + BWD_V3_SMEM_ALIGN
        if version == "v2":
            srow = round_up(head_dim, 16) + 8
            return 2 * (2 * block_k * srow + 4 * block_q * srow + block_k * (block_q + 8)) + 4 * 4 * block_q
        acc = cv.accum_dtype(dtype).itemsize
        return (2 * block_q * head_dim + block_k * head_dim + block_q * (block_k + 1) + 2 * block_q) * acc

    def resolve(self, head_dim: int, dtype: str, smem_limit: int | None = None) -> "BackwardConfig":
        """Concrete sizes: the given ones (checked), the largest defaults that fit otherwise
        (v2: that fit ``smem_limit`` bytes of SRAM a block, when given).  Version None
        resolves as v1 (the registry picks the version before this)."""
        if self.version == "v2":
            return self._resolve_v2(head_dim, dtype, smem_limit)
        if self.version in BWD_RING_VERSIONS:
            return self._resolve_ring(head_dim, dtype, smem_limit)
        lpk = self.lanes_per_key or BWD_LANES_PER_KEY
        tiles = backward_v1_tiles(self.block_q, self.block_k, lambda q, k: self.smem_bytes(q, k, head_dim, dtype),
                                  STATIC_SMEM_BYTES, (BWD_DEFAULT_BLOCK_Q, BWD_DEFAULT_BLOCK_K))
        if tiles is None:
            bq, bk = self.block_q or 8, self.block_k or 8
            raise ValueError(f"config: Br={bq}, Bc={bk} at head_dim={head_dim} ({dtype}) need "
                             f"{self.smem_bytes(bq, bk, head_dim, dtype):,} B of SRAM, more than the "
                             f"{STATIC_SMEM_BYTES:,} B a block may declare")
        bq, bk = tiles
        if bk * lpk > 1024:
            raise ValueError(f"config: block_k x lanes_per_key = {bk * lpk} threads, more than 1024")
        return self.replace(version=self.version or "v1", block_q=bq, block_k=bk, lanes_per_key=lpk)

    def _v2_candidates(self, head_dim: int):
        """(Br, Bc, warps) tile sets, largest first, keeping the sizes the config gives."""
        if self.num_warps is not None and self.num_warps not in BWD_V2_WARP_CHOICES:
            raise ValueError(f"config.num_warps: v2 runs 4 or 8 warps, got {self.num_warps}")
        if self.block_k is not None and self.block_k not in tuple(16 * w for w in BWD_V2_WARP_CHOICES):
            raise ValueError(f"config.block_k: v2 takes 64 or 128 (16 keys a warp), got {self.block_k}")
        if self.block_k is not None and self.num_warps is not None and self.block_k != 16 * self.num_warps:
            raise ValueError(f"config.block_k: v2 needs block_k == 16 * num_warps ({16 * self.num_warps}), "
                             f"got {self.block_k}")
        if self.block_q is not None and self.block_q not in BWD_V2_BLOCK_Q_CHOICES:
            raise ValueError(f"config.block_q: v2 takes 16, 32, 64 or 128, got {self.block_q}")
        fixed_w = self.num_warps or (self.block_k // 16 if self.block_k else None)
        warps = (fixed_w,) if fixed_w else BWD_V2_WARP_CHOICES
        d_pad = round_up(head_dim, 16)
        first = BWD_V2_BLOCK_Q[0] if d_pad + BWD_V2_BLOCK_Q[0] <= BWD_V2_ACC_FLOATS else BWD_V2_BLOCK_Q[1]
        rows = (self.block_q,) if self.block_q else tuple(sorted({b for b in (first, 32, 16) if b <= first},
                                                                  reverse=True))
        for bq in rows:
            for w in warps:
                yield bq, 16 * w, w

    def _resolve_v2(self, head_dim: int, dtype: str, smem_limit: int | None) -> "BackwardConfig":
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"config.version: 'v2' is the tensor-core backward for float16/bfloat16, "
                             f"got dtype {dtype} (use version 'v1')")
        if head_dim > BWD_V2_MAX_HEAD_DIM:
            raise ValueError(f"config.version: 'v2' keeps dK_j, dV_j in registers up to head_dim "
                             f"{BWD_V2_MAX_HEAD_DIM}, got {head_dim} (use version 'v1')")
        tried = []
        for bq, bk, w in self._v2_candidates(head_dim):
            need = self.smem_bytes(bq, bk, head_dim, dtype, "v2")
            cfg = self.replace(block_q=bq, block_k=bk, num_warps=w)
            if smem_limit is None or need <= smem_limit:
                return cfg
            tried.append(f"Br={bq}, Bc={bk}: {need:,} B")
        raise ValueError(f"config: v2 at head_dim={head_dim} ({dtype}) does not fit this GPU's {smem_limit:,} B "
                         f"of shared memory a block ({'; '.join(tried)})")

    def _resolve_ring(self, head_dim: int, dtype: str, smem_limit: int | None) -> "BackwardConfig":
        """v3's .. v6's fixed tiles and their ring's depth (the default, or the given one, checked
        against ``smem_limit``)."""
        v = self.version
        if dtype not in BWD_V3_DTYPES:
            raise ValueError(f"config.version: {v!r} is the Hopper backward for float16/bfloat16, got dtype {dtype} "
                             f"(use version 'v1')")
        if head_dim not in BWD_V3_HEAD_DIMS:
            raise ValueError(f"config.version: {v!r} takes head_dim 64 or 128 (dK_j, dV_j in one warpgroup's "
                             f"registers, 64-column TMA panels), got {head_dim} (use version 'v2' or 'v1')")
        bq, bk, default = (BWD_V3_BLOCK, BWD_V3_BLOCK, BWD_V3_STAGES) if v == "v3" else \
            (BWD_V4_BLOCK_Q, BWD_V4_BLOCK_K, BWD_V4_STAGES)
        cfg = self.replace(block_q=bq, block_k=bk, stages=self.stages or default)
        need = self.smem_bytes(bq, bk, head_dim, dtype, v, cfg.stages)
        if smem_limit is not None and need > smem_limit:
            raise ValueError(f"config.stages: {v} with {cfg.stages} stages at head_dim={head_dim} needs {need:,} B of "
                             f"SRAM; this GPU allows {smem_limit:,} B a block")
        return cfg

    def v2_min_smem(self, head_dim: int, dtype: str) -> int:
        """SRAM of v2's smallest tile set for this config (what a GPU must offer at least)."""
        bq, bk, _ = list(self._v2_candidates(head_dim))[-1]
        return self.smem_bytes(bq, bk, head_dim, dtype, "v2")

    def defines(self, head_dim: int, dtype: str, smem_limit: int | None = None) -> dict:
        c = self.resolve(head_dim, dtype, smem_limit)
        if c.version in BWD_RING_VERSIONS:
            return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BLOCK_M=c.block_q, BLOCK_N=c.block_k,
                        STAGES=c.stages, DETERMINISTIC=int(c.deterministic))
        if c.version == "v2":
            return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, D_PAD=round_up(head_dim, 16),
                        NUM_WARPS=c.num_warps, BLOCK_Q=c.block_q, VEC_IO=int(head_dim % 8 == 0),
                        DETERMINISTIC=int(c.deterministic))
        return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BR=c.block_q, BC=c.block_k,
                    LPK=c.lanes_per_key, DETERMINISTIC=int(c.deterministic))
