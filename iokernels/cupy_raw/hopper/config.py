"""The Hopper attention kernels' constants and their config (:class:`HopperConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, replace as _dc_replace

from ...core import conventions as cv
from ..config_checks import check_version
from ..launch import DTYPE_IDS
from ..policy import hopper_tiles

VERSIONS = ("v3", "v4", "v5")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
#: the one compute capability these kernels are built for (sm_90a: wgmma, setmaxnreg)
HOPPER_CC = 90
#: one swizzle panel: 128 bytes of 16-bit elements (the TMA box width and the wgmma swizzle)
PANEL = 64
#: every tile starts on a 1024-byte boundary (a 128-byte-swizzle atom); dynamic SRAM is only
#: 16-byte aligned, so the kernels round up and the launcher adds this slack
SMEM_ALIGN = 1024
MBARRIER_BYTES = 8
#: attention: query rows a block owns: two consumer warpgroups of 64 rows (v5's ping-pong pair)
BLOCK_M = 128
#: threads: v3 has only the two computing warpgroups; v4, v5 add a producer warpgroup
THREADS = {"v3": 256, "v4": 384, "v5": 384}
BLOCK_N_CHOICES = (64, 128)
MAX_STAGES = 4
#: the GEMM's tile: 128 x 256 (two consumer warpgroups of 64 x 256), 64 deep (one panel),
#: 4 stages (192 KB of SRAM), tile order grouped 8 row-tiles high for L2 reuse
GEMM_BM, GEMM_BN, GEMM_BK, GEMM_STAGES, GEMM_GROUP_M = 128, 256, 64, 4, 8
GEMM_THREADS = 384
#: the H100/H200 per-block SRAM limit after opting in (read off the device when there is one)
FALLBACK_SMEM_OPTIN = 232448


@dataclass(frozen=True)
class HopperConfig:
    """Tile settings of the Hopper attention kernels.

    version: "v3", "v4", "v5" or None (the default: :data:`DEFAULT_VERSION`).
    block_n (Bc): keys a K/V tile holds, 64 or 128 (None: :data:`~iokernels.cupy_raw.policy.HOPPER_BLOCK_N`).
    stages: K/V tiles the SRAM ring holds (1 .. MAX_STAGES; v5 at least 2; None: the version's
    default, :func:`~iokernels.cupy_raw.policy.hopper_tiles`).
    pingpong: v5 only; False keeps v5's overlap inside a warpgroup but lets the two consumer
    warpgroups issue their products whenever they are ready (to measure what ping-pong adds).
    The query tile is fixed at BLOCK_M = 128 rows (two consumer warpgroups).
    """

    version: str | None = None
    block_n: int | None = None
    stages: int | None = None
    pingpong: bool = True

    def __post_init__(self):
        check_version(self, VERSIONS)
        if self.block_n is not None and self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"config.block_n: expected one of {BLOCK_N_CHOICES} or None, got {self.block_n!r}")
        if self.stages is not None and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                        or not 1 <= self.stages <= MAX_STAGES):
            raise ValueError(f"config.stages: expected an integer in 1..{MAX_STAGES} or None, got {self.stages!r}")
        cv.check_bool(self.pingpong, "config.pingpong")

    def replace(self, **kw) -> "HopperConfig":
        return _dc_replace(self, **kw)

    def resolve(self) -> "HopperConfig":
        """Every None filled with its default."""
        version = self.version or DEFAULT_VERSION
        return HopperConfig(version, *hopper_tiles(version, self.block_n, self.stages), self.pingpong)

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic SRAM a block asks for: Q_i, stages x (K_j + V_j), the mbarriers, alignment slack."""
        c = self.resolve()
        tiles = 2 * head_dim * (BLOCK_M + 2 * c.stages * c.block_n)
        return tiles + MBARRIER_BYTES * (1 + 3 * c.stages) + SMEM_ALIGN

    def check_fits(self, head_dim: int, smem_optin: int) -> None:
        c = self.resolve()
        if c.version == "v5" and c.stages < 2:
            raise ValueError("config.stages: v5 uses K_j and V_{j-1} together, so it needs at least 2 stages")
        need = self.smem_bytes(head_dim)
        if need > smem_optin:
            raise ValueError(f"config.stages: {self.resolve().stages} stages of Bc = {self.resolve().block_n} "
                             f"at head_dim {head_dim} need {need} bytes of SRAM; this GPU allows {smem_optin}")

    def defines(self, head_dim: int, dtype: str) -> dict:
        c = self.resolve()
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=c.block_n,
                   STAGES=c.stages)
        if c.version == "v5":
            out["PINGPONG"] = int(c.pingpong)
        return out


#: what HopperConfig() runs: the fastest version measured on the H200 (benchmarks)
DEFAULT_VERSION = "v5"
