"""One config class per op of the CuPy kernels: the sizes a .cu file is compiled with.

Every config is a frozen dataclass whose first field is ``version`` ("v1", "v2", ...;
None: the default, which :data:`iokernels.cupy_raw.REGISTRY` picks for each call).  Its
other fields are the tile sizes and settings of that version, injected into the kernel as
``-D`` defines; each config knows the shared memory (SRAM) its tiles take, so a size that
does not fit the GPU is a ValueError naming ``config.<field>`` before anything is launched.
Sizes left as None are chosen per call so that the tiles fit (:func:`fit_config`, and the
ring depth of decode v3), for every supported dtype and head dim up to 256.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows per thread block, key/value rows per K/V tile (block_q, block_k)
d        head dim; ``D_PAD`` rounds it up to the 16 a tensor-core step covers
g        query heads per KV head (GQA group), what one decode block serves
S        splits of the key axis (Flash-Decoding)
SRAM     shared memory of one thread block; HBM device memory
=======  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core import conventions as cv
from .config_checks import check_positive, check_version
from .launch import DTYPE_IDS, round_up
from .policy import backward_v1_tiles, v2_default_block_k

# --------------------------------------------------------------------------- forward constants
#: the versions ForwardConfig describes (their sizes, SRAM and defines are below)
FORWARD_VERSIONS = ("v1", "v1b", "v2")
#: what one tensor-core tile is: v2 rows are handled 16 a warp, keys 16 an mma k-step
MMA_ROWS = 16
#: v1's thread grid: 16 x 16 threads; a tile side is 16 x (rows or keys a thread owns)
V1_THREADS_SIDE = 16
#: v1 / v1b tile sides: a whole number of rows or keys per thread of the 16 x 16 grid
V1_TILE_SIDES = (16, 32, 64)
#: v1 / v1b default tiles (Br = Bc = 64), the largest the 16 x 16 grid takes
V1_DEFAULT_TILE = 64
#: v2's default: 8 warps (Br = 128), so each K_j / V_j tile read into SRAM feeds 128 query rows
V2_DEFAULT_WARPS = 8
#: v2's warps a block (each owns 16 query rows)
V2_WARP_CHOICES = (1, 2, 4, 8)
#: v2's key tiles: multiples of the 16 keys of one mma k-step
V2_BLOCK_K_CHOICES = (16, 32, 64, 128)
#: v2 keeps O for d <= 256 in registers (d / 8 * 4 floats a lane); larger d would spill
V2_MAX_HEAD_DIM = 256
#: fa_v1b: registers capped so this many blocks fit an SM (its SRAM at 64 x 64 allows two)
V1B_MIN_BLOCKS = 2
#: the tile sets fit_config tries, largest first, when the default ones do not fit: (Br, Bc);
#: v2 runs Br / 16 warps
SHRINK_TILES = ((64, 32), (32, 32), (32, 16), (16, 16))

# --------------------------------------------------------------------------- gather constants
#: paged gather: threads a block, and blocks per SM the grid-stride loop launches
GATHER_THREADS = 256
GATHER_BLOCKS_PER_SM = 8


# =========================================================================== forward
@dataclass(frozen=True)
class ForwardConfig:
    """Tile sizes of the CuPy FlashAttention forward kernels (fa_v1.cu, fa_v1b.cu, fa_v2.cu).

    version: "v1" (CUDA cores, any dtype), "v1b" (CUDA cores, float32, K/V tiles copied with
    cp.async while the previous product runs) or "v2" (tensor cores, float16/bfloat16);
    None: the registry's default for the call (v2 for 16-bit inputs, v1b for float32 on
    compute capability 8.0+, v1 otherwise).
    block_q (Br), block_k (Bc): v1 and v1b take 16, 32 or 64 each; v2 takes block_q = 16 *
    num_warps and block_k in 16, 32, 64, 128.  num_warps: v2 only (1, 2, 4, 8).  None: the
    largest sizes whose tiles fit the GPU's shared memory (:func:`fit_config`).
    """

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        check_version(self, FORWARD_VERSIONS)
        check_positive(self, ("block_q", "block_k", "num_warps"))

    def replace(self, **changes) -> "ForwardConfig":
        return replace(self, **changes)

    # -- resolution: concrete sizes for one problem
    def resolve(self, head_dim: int, dtype: str) -> "ForwardConfig":
        """This version's concrete sizes for (head_dim, dtype): the given ones, checked, and
        the defaults for the rest (before the shared-memory fit of :func:`fit_config`)."""
        if self.version is None:
            raise ValueError("config.version: None is the registry's default; resolve it with "
                             "REGISTRY.resolve('attention', config, need) first")
        if self.version == "v2":
            if dtype not in ("float16", "bfloat16"):
                raise ValueError(f"config.version: 'v2' is the tensor-core kernel for float16/bfloat16, "
                                 f"got dtype {dtype} (use version 'v1')")
            if head_dim > V2_MAX_HEAD_DIM:
                raise ValueError(f"config.version: 'v2' supports head_dim <= {V2_MAX_HEAD_DIM}, got {head_dim}")
            nw = self.num_warps or (self.block_q // MMA_ROWS if self.block_q else V2_DEFAULT_WARPS)
            if nw not in V2_WARP_CHOICES:
                raise ValueError(f"config.num_warps: must be 1, 2, 4 or 8 for v2, got {nw}")
            bq = self.block_q or MMA_ROWS * nw
            if bq != MMA_ROWS * nw:
                raise ValueError(f"config.block_q: v2 needs block_q == 16 * num_warps ({MMA_ROWS * nw}), got {bq}")
            bk = self.block_k or v2_default_block_k(head_dim)
            if bk not in V2_BLOCK_K_CHOICES:
                raise ValueError(f"config.block_k: v2 takes 16, 32, 64 or 128, got {bk}")
            return ForwardConfig("v2", bq, bk, nw)
        if self.version == "v1b" and dtype != "float32":
            raise ValueError(f"config.version: 'v1b' is the float32 kernel (cp.async copies the stored "
                             f"bytes), got dtype {dtype} (use version 'v1' or 'v2')")
        bq, bk = self.block_q or V1_DEFAULT_TILE, self.block_k or V1_DEFAULT_TILE
        for name, val in (("block_q", bq), ("block_k", bk)):
            if val not in V1_TILE_SIDES:
                raise ValueError(f"config.{name}: {self.version} takes 16, 32 or 64, got {val}")
        if self.num_warps not in (None, 8):
            raise ValueError(f"config.num_warps: {self.version} always runs 8 warps (16 x 16 threads), "
                             f"got {self.num_warps}")
        return ForwardConfig(self.version, bq, bk, 8)

    def smem_bytes(self, head_dim: int, dtype: str) -> int:
        """Dynamic shared memory of one block (the config must be resolved)."""
        d = head_dim
        if self.version == "v2":
            srow = round_up(d, 16) + 8                   # fa_v2.cu: SROW
            return 2 * srow * (self.block_q + 4 * self.block_k)   # Q_i + 2 x (K_j, V_j)
        if self.version == "v1b":                        # fa_v1b.cu: Qs, Ks, Vs, PsT (float32)
            dq, dk, dv = round_up(d, 4), round_up(d, 32), round_up(d, 64)
            return 4 * (self.block_q * dq + self.block_k * dk + self.block_k * dv + self.block_k * self.block_q)
        acc = cv.accum_dtype(dtype).itemsize
        dv = 64 * -(-d // 64)                            # fa_v1.cu: DV
        return acc * (d * self.block_q + d * self.block_k + self.block_k * dv + self.block_k * self.block_q)

    def check_fits(self, head_dim: int, dtype: str, limit: int) -> None:
        need = self.smem_bytes(head_dim, dtype)
        if need > limit:
            raise ValueError(f"config: {self} needs {need:,} B of shared memory at head_dim={head_dim} "
                             f"({dtype}), more than this GPU's {limit:,} B per block")

    def defines(self, head_dim: int, dtype: str) -> dict:
        if self.version == "v2":
            return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, D_PAD=round_up(head_dim, 16),
                        NUM_WARPS=self.num_warps, BLOCK_K=self.block_k, VEC_IO=int(head_dim % 8 == 0))
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, RM=self.block_q // V1_THREADS_SIDE,
                   RN=self.block_k // V1_THREADS_SIDE)
        if self.version == "v1b":
            out.update(VEC_IO=int(head_dim % 4 == 0), V1B_MIN_BLOCKS=V1B_MIN_BLOCKS)
        return out

    def threads(self) -> int:
        return 32 * self.num_warps if self.version == "v2" else V1_THREADS_SIDE * V1_THREADS_SIDE

    def candidates(self, head_dim: int, dtype: str):
        """The resolved tile sets fit_config tries, largest first: the defaults, then
        SHRINK_TILES; sizes the config gives are kept in every one."""
        yield self.resolve(head_dim, dtype)
        for bq, bk in SHRINK_TILES:
            nw = bq // MMA_ROWS if self.version == "v2" else None
            trial = ForwardConfig(self.version, bq, bk, nw)
            if self.block_q is not None or self.num_warps is not None:
                trial = trial.replace(block_q=self.block_q, num_warps=self.num_warps)
            if self.block_k is not None:
                trial = trial.replace(block_k=self.block_k)
            yield trial.resolve(head_dim, dtype)


def fit_config(config: ForwardConfig, head_dim: int, dtype: str, dev: dict) -> ForwardConfig:
    """``config`` resolved for this GPU (``dev``: at least ``smem_optin``, the opt-in shared
    memory a block).  Sizes left as None shrink until the tiles fit; an explicit size that
    does not fit is a ValueError naming config."""
    limit = dev["smem_optin"]
    first = None
    for cfg in config.candidates(head_dim, dtype):
        first = first or cfg
        if cfg.smem_bytes(head_dim, dtype) <= limit:
            return cfg
    smallest = min_forward_smem(config.version, head_dim, dtype)
    if config.block_q is None and config.block_k is None and config.num_warps is None:
        raise ValueError(f"config.version: {config.version} needs at least {smallest:,} B of shared memory "
                         f"at head_dim={head_dim} ({dtype}), more than this GPU's {limit:,} B per block")
    first.check_fits(head_dim, dtype, limit)
    raise ValueError(f"config: {config} does not fit this GPU's {limit:,} B of shared memory per block "
                     f"at head_dim={head_dim} ({dtype}) at any smaller tile size")


def min_forward_smem(version: str, head_dim: int, dtype: str) -> int:
    """The shared memory of ``version``'s smallest tile set (what a GPU must offer at least)."""
    return list(ForwardConfig(version).candidates(head_dim, dtype))[-1].smem_bytes(head_dim, dtype)


# =========================================================================== gather
@dataclass(frozen=True)
class GatherConfig:
    """The paged gather (paged_gather.cu): one version, "v1"; None: the default.

    threads: threads a block (None: GATHER_THREADS); blocks_per_sm: blocks per SM the
    grid-stride loop launches (None: GATHER_BLOCKS_PER_SM).  The gather holds no SRAM.
    """

    version: str | None = None
    threads: int | None = None
    blocks_per_sm: int | None = None

    def __post_init__(self):
        check_version(self, ("v1",))
        check_positive(self, ("threads", "blocks_per_sm"))
        if self.threads is not None and (self.threads % 32 or self.threads > 1024):
            raise ValueError(f"config.threads: a multiple of 32 up to 1024, got {self.threads}")

    def replace(self, **changes) -> "GatherConfig":
        return replace(self, **changes)


# =========================================================================== backward
#: v1: CUDA cores, every dtype; v2: tensor cores, float16/bfloat16 (bwd_v2.cu)
BACKWARD_VERSIONS = ("v1", "v2")
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


@dataclass(frozen=True)
class BackwardConfig:
    """The CuPy backward: version "v1" (bwd_v1.cu, CUDA cores, every dtype) or "v2"
    (bwd_v2.cu, tensor cores, float16/bfloat16, head_dim <= 128); None: the registry's default.

    block_q (Br), block_k (Bc): Q-tile rows and K/V-tile keys.  v1: None means the largest
    that fit 48 KB of static SRAM, from 32 x 32.  v2: block_k = 16 * num_warps (64 or 128),
    block_q a multiple of 16 up to 128; None: Bc = 128 and Br = 64 (32 above d = 96), shrunk
    (Bc first, then Br) until the SRAM fits the GPU (``resolve(..., smem_limit=)``).
    num_warps: v2 only (4 or 8).  lanes_per_key: v1 only, threads per key row (a power of two
    up to 32).  deterministic: dQ by per-tile partials summed in tile order (the same bits
    every run) instead of atomic adds.
    """

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    lanes_per_key: int | None = None
    deterministic: bool = False
    num_warps: int | None = None

    def __post_init__(self):
        check_version(self, BACKWARD_VERSIONS)
        check_positive(self, ("block_q", "block_k", "lanes_per_key", "num_warps"))
        lpk = self.lanes_per_key
        if lpk is not None and (lpk & (lpk - 1) or lpk > 32):
            raise ValueError(f"config.lanes_per_key: a power of two up to 32, got {lpk}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"config.deterministic: True or False, got {self.deterministic!r}")
        if self.version == "v2" and lpk is not None:
            raise ValueError("config.lanes_per_key: a v1 setting; v2 gives each warp 16 keys")
        if self.version == "v1" and self.num_warps is not None:
            raise ValueError("config.num_warps: a v2 setting; v1 runs block_k x lanes_per_key threads")

    def replace(self, **changes) -> "BackwardConfig":
        return replace(self, **changes)

    @staticmethod
    def smem_bytes(block_q: int, block_k: int, head_dim: int, dtype: str, version: str = "v1") -> int:
        """v1: Q_i, dO_i, K_j, dS_ij (padded a column), LSE_i, D_i in the accumulator type.
        v2 (bwd_v2.cu): K_j, V_j, 2 x (Q_i, dO_i) rows of SROW 16-bit values, dS_ij^T
        [Bc][Br + 8] in 16 bits, 2 x (LSE_i, D_i) in float32."""
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

    def v2_min_smem(self, head_dim: int, dtype: str) -> int:
        """SRAM of v2's smallest tile set for this config (what a GPU must offer at least)."""
        bq, bk, _ = list(self._v2_candidates(head_dim))[-1]
        return self.smem_bytes(bq, bk, head_dim, dtype, "v2")

    def defines(self, head_dim: int, dtype: str, smem_limit: int | None = None) -> dict:
        c = self.resolve(head_dim, dtype, smem_limit)
        if c.version == "v2":
            return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, D_PAD=round_up(head_dim, 16),
                        NUM_WARPS=c.num_warps, BLOCK_Q=c.block_q, VEC_IO=int(head_dim % 8 == 0),
                        DETERMINISTIC=int(c.deterministic))
        return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BR=c.block_q, BC=c.block_k,
                    LPK=c.lanes_per_key, DETERMINISTIC=int(c.deterministic))


# =========================================================================== MLA decode
#: the versions MLADecodeConfig describes (mla_decode.cu, Hopper only)
MLA_VERSIONS = ("v1",)
#: the row mla_decode.cu is built for: DeepSeek-V3's latent (the value) and rotary key widths
MLA_LATENT, MLA_ROPE = 512, 64
#: Bc: cache rows a tile (one m64n64 wgmma of S); Br: query heads a block (one warpgroup's rows)
MLA_BLOCK_N = 64
MLA_HEADS_BLOCK = 64
#: KV tiles in SRAM: Q and two tiles of 64 x 576 16-bit values fill what a block may have
MLA_STAGES = 2
#: a split keeps at least this many rows (two tiles): its partial O (64 x 512 float32 a block)
#: costs about as many bytes as two tiles of rows, so shorter splits would mostly move partials
MLA_MIN_KEYS_PER_SPLIT = 128
#: at most this many splits (the combine reads them all)
MLA_MAX_SPLITS = 128
#: the page sizes a paged MLA cache may have: whole tiles (a tile never crosses a page)
MLA_PAGE_MULTIPLE = MLA_BLOCK_N


@dataclass(frozen=True)
class MLADecodeConfig:
    """Which MLA decode kernel, and its settings (``config=`` of iokernels.cupy_raw.mla).

    version: "v1" (mla_decode.cu: wgmma + TMA on Hopper) or None (the registry's default).
    min_keys_per_split: the fewest cache rows a split of the key axis takes when the split
    count is chosen (None: MLA_MIN_KEYS_PER_SPLIT); rounded up to whole tiles of MLA_BLOCK_N.
    """

    version: str | None = None
    min_keys_per_split: int | None = None

    def __post_init__(self):
        check_version(self, MLA_VERSIONS)
        check_positive(self, ("min_keys_per_split",))

    def replace(self, **changes) -> "MLADecodeConfig":
        return replace(self, **changes)

    @staticmethod
    def smem_bytes() -> int:
        """Q (64 x 576), MLA_STAGES tiles (64 x 576), P (64 x 64), alpha/l/m (64 floats each),
        three mbarriers, and the slack that puts the tiles on a 1024-byte boundary."""
        row = (MLA_LATENT + MLA_ROPE) * 2
        tiles = MLA_HEADS_BLOCK * row + MLA_STAGES * MLA_BLOCK_N * row + MLA_HEADS_BLOCK * MLA_BLOCK_N * 2
        return tiles + 3 * MLA_HEADS_BLOCK * 4 + 8 * (1 + MLA_STAGES) + 1024

    def keys_per_split(self) -> int:
        return round_up(self.min_keys_per_split or MLA_MIN_KEYS_PER_SPLIT, MLA_BLOCK_N)

    def defines(self, dtype: str, paged: bool = False, page_size: int = MLA_BLOCK_N) -> dict:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"q: MLA decode takes float16 or bfloat16, got {dtype}")
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], LATENT=MLA_LATENT, ROPE=MLA_ROPE, PAGED=int(bool(paged)))
        if paged:
            out["PAGE_SIZE"] = int(page_size)
        return out


# =========================================================================== decode
# The decode family's config and constants live in decode_config.py; re-exported here for the
# readers of ``cupy_raw.config`` (config.DecodeConfig, config.DECODE_*).
from .decode_config import *  # noqa: E402,F401,F403
from .decode_config import MMA_K  # noqa: E402,F401
