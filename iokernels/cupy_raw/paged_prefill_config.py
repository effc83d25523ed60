"""PagedPrefillConfig: the tiles of paged_prefill_v1.cu and paged_prefill_v2.cu, their SRAM and
their defines (the two kernels take the same ones: v2's Br counts packed (token, head) rows)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config_checks import check_positive, check_version
from .launch import DTYPE_IDS, round_up
from .policy import paged_prefill_tiles

__all__ = ["PagedPrefillConfig", "PAGED_PREFILL_VERSIONS", "PAGED_PREFILL_HEAD_DIMS", "PAGED_PREFILL_DTYPES",
           "PAGED_PREFILL_WARP_CHOICES", "PAGED_PREFILL_BLOCK_K_CHOICES", "paged_prefill_smem"]

#: the versions PagedPrefillConfig describes
PAGED_PREFILL_VERSIONS = ("v1", "v2")
#: the head dims v1 is compiled and tested at (its rows are whole 16-byte chunks and whole mma
#: k-steps there); others are refused by its record's check
PAGED_PREFILL_HEAD_DIMS = (64, 128)
#: the dtypes it computes in: the tensor cores' 16-bit operands (float32 accumulation)
PAGED_PREFILL_DTYPES = ("float16", "bfloat16")
#: warps a block (each owns 16 chunk rows: Br = 16 * num_warps)
PAGED_PREFILL_WARP_CHOICES = (1, 2, 4, 8)
#: K tiles: multiples of the 16 keys of one mma k-step
PAGED_PREFILL_BLOCK_K_CHOICES = (16, 32, 64, 128)
#: the rows one warp owns (one m16n8k16 A operand)
MMA_ROWS = 16


def paged_prefill_smem(head_dim: int, num_warps: int, block_k: int) -> int:
    """Dynamic shared memory of one block: Q_i [Br][SROW] and two buffers each of K_j and V_j
    [Bc][SROW], 16-bit, SROW = D_PAD + 8 (paged_prefill_v1.cu, as fa_v2.cu)."""
    srow = round_up(head_dim, 16) + 8
    return 2 * srow * (MMA_ROWS * num_warps + 4 * block_k)


@dataclass(frozen=True)
class PagedPrefillConfig:
    """The tiles of the CuPy paged prefill (paged_prefill_v1.cu, paged_prefill_v2.cu).

    version: "v1" or "v2" (None: the registry's default).  num_warps: warps a block, each
    owning 16 tile rows (Br = 16 * num_warps; 1, 2, 4 or 8): chunk rows of one query head in
    v1, (token, head-in-group) rows in v2, whose tile holds Br / g tokens of the g query heads
    of one KV head.  block_k: keys a K/V tile (Bc; 16, 32,
    64 or 128), read through the block table, so a tile spans Bc / block_size cache blocks.
    None: :func:`.policy.paged_prefill_tiles` (by the batch's mean chunk length, shrunk to fit
    the GPU's SRAM; v2's mean is in packed rows, g per token).
    """

    version: str | None = None
    num_warps: int | None = None
    block_k: int | None = None

    def __post_init__(self):
        check_version(self, PAGED_PREFILL_VERSIONS)
        check_positive(self, ("num_warps", "block_k"))
        if self.num_warps is not None and self.num_warps not in PAGED_PREFILL_WARP_CHOICES:
            raise ValueError(f"config.num_warps: must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.block_k is not None and self.block_k not in PAGED_PREFILL_BLOCK_K_CHOICES:
            raise ValueError(f"config.block_k: must be 16, 32, 64 or 128, got {self.block_k}")

    def replace(self, **changes) -> "PagedPrefillConfig":
        return replace(self, **changes)

    def resolve(self, head_dim: int, smem_limit: int | None = None, mean_rows: float | None = None
                ) -> "PagedPrefillConfig":
        """Concrete sizes for ``head_dim`` on a GPU whose blocks may take ``smem_limit`` bytes
        of shared memory (None: unknown), for chunks of ``mean_rows`` rows on average (None:
        unknown); a ValueError naming config when they do not fit."""
        if self.version is None:
            raise ValueError("config.version: None is the registry's default; resolve it with "
                             "REGISTRY.resolve('paged_prefill', config, need) first")
        got = paged_prefill_tiles(self.num_warps, self.block_k,
                                  lambda nw, bk: paged_prefill_smem(head_dim, nw, bk), smem_limit, mean_rows)
        if got is None:
            raise ValueError(f"config: {self} needs more than this GPU's {smem_limit:,} B of shared memory per "
                             f"block at head_dim={head_dim}; choose a smaller block_k or num_warps")
        return PagedPrefillConfig(self.version, *got)

    @property
    def block_q(self) -> int:
        """Br: chunk rows a Q tile (the config must be resolved)."""
        return MMA_ROWS * self.num_warps

    def smem_bytes(self, head_dim: int) -> int:
        return paged_prefill_smem(head_dim, self.num_warps, self.block_k)

    def threads(self) -> int:
        return 32 * self.num_warps

    def defines(self, head_dim: int, dtype: str, page_size: int, vec_io: bool = True) -> dict:
        """The kernel's -D defines (resolved config); ``vec_io``: every row is whole 16-byte
        chunks starting on 16 bytes (else the element-wise copies)."""
        return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, D_PAD=round_up(head_dim, 16),
                    NUM_WARPS=self.num_warps, BLOCK_K=self.block_k, PAGE_SIZE=page_size,
                    VEC_IO=int(bool(vec_io) and head_dim % 8 == 0))
