"""ForwardConfig: the tiles of fa_v1.cu, fa_v1b.cu, fa_v2.cu, and the fit to a GPU's SRAM."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core import conventions as cv
from .config_checks import check_positive, check_version
from .launch import DTYPE_IDS, round_up
from .policy import v2_default_block_k

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
