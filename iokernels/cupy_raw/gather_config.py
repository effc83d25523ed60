"""GatherConfig: the paged gather's launch shape (paged_gather.cu)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config_checks import check_positive, check_version

# --------------------------------------------------------------------------- gather constants
#: paged gather: threads a block, and blocks per SM the grid-stride loop launches
GATHER_THREADS = 256
GATHER_BLOCKS_PER_SM = 8


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
