"""MLADecodeConfig: MLA decode's sizes (mla_decode.cu)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config_checks import check_positive, check_version
from .launch import DTYPE_IDS, round_up

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
