"""The Hopper attention kernels' constants and their config (:class:`HopperConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, replace as _dc_replace

from ...core import conventions as cv
from ..config_checks import check_version
from ..launch import DTYPE_IDS
from ..policy import HOPPER_WIDE_HEAD_DIM, hopper_tiles, hopper_v7_default_at, hopper_v8_default_at

VERSIONS = ("v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11")
DTYPES = ("float16", "bfloat16")
#: head dims the kernels are built for (the registry's default picks them at those
#: :func:`~iokernels.cupy_raw.policy.hopper_default_at` allows)
HEAD_DIMS = (64, 128, 256)
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
#: ... by version: v6 and v10 have three consumer warpgroups (192 rows), at head_dim 64 only
BLOCK_MS = {"v3": BLOCK_M, "v4": BLOCK_M, "v5": BLOCK_M, "v6": 192, "v7": BLOCK_M, "v8": BLOCK_M, "v9": BLOCK_M,
            "v10": 192, "v11": BLOCK_M}
#: threads: v3 has only the two computing warpgroups; v4, v5, v7 .. v9 and v11 add a producer
#: warpgroup; v6 and v10 are 1 producer + 3 consumers
THREADS = {"v3": 256, "v4": 384, "v5": 384, "v6": 512, "v7": 384, "v8": 384, "v9": 384, "v10": 512, "v11": 384}
#: mbarriers a K/V stage: k_full, v_full and one empty barrier (v3 .. v6); v7 .. v11 release K and
#: V apart, so they have an empty barrier for each (fa_v7.cu)
BARRIERS_A_STAGE = {"v7": 4, "v8": 4, "v9": 4, "v10": 4, "v11": 4}
#: SRAM bytes a version takes beyond its tiles and barriers: v9's Q empty barrier and the index of
#: the tile it holds (fa_v9.cu)
EXTRA_SMEM_BYTES = {"v9": 16}
#: the versions whose consumers use K_j and V_{j-1} together (two stages at least) and take turns
#: on the tensor cores (ping-pong, or v6's and v10's round of three): v5 onwards
PIPELINED = ("v5", "v6", "v7", "v8", "v9", "v10", "v11")
#: the persistent versions: a grid of at most one block an SM (:func:`grid`), which claim query
#: tiles from a counter the launcher gives each stream (fa_v9.cu)
PERSISTENT = ("v9",)
#: the versions whose blocks take the query tiles longest first, the (batch, head) pairs in groups
#: whose K and V fit the L2 cache (fa_v11.cu; the launcher passes the group's size,
#: :func:`~iokernels.cupy_raw.policy.forward_lpt_pairs`)
LONGEST_FIRST = ("v11",)
#: the versions that take FlashAttention-3's 80-key tile at head_dim 256 (fa_v8.cu's, and v9 and v11
#: after it)
WIDE_KEY_VERSIONS = ("v8", "v9", "v11")
#: the head dims a version takes where it does not take all of HEAD_DIMS: v6's and v10's three
#: consumer warpgroups have 160 registers a thread (setmaxnreg: 128 x 24 + 384 x 160 of the SM's
#: 65536), room for O, S and P of 64 x 128 tiles only at head_dim 64
VERSION_HEAD_DIMS = {"v6": (64,), "v10": (64,)}
BLOCK_N_CHOICES = (64, 128)
#: v8 and v9 (fa_v8.cu, fa_v9.cu) also take FlashAttention-3's 80-key tile at head_dim 256
#: (:func:`block_n_choices`)
V8_BLOCK_N_CHOICES = (64, 80, 128)
#: at head_dim 256 only Bc = 64: O (64 x 256) is 128 float32 registers a consumer thread, and S, P
#: of 128 keys beside it spill (hopper_attention.cuh refuses BLOCK_N 128 there)
WIDE_BLOCK_N_CHOICES = (64,)
MAX_STAGES = 4
#: the GEMM's tile: 128 x 256 (two consumer warpgroups of 64 x 256), 64 deep (one panel),
#: 4 stages (192 KB of SRAM), tile order grouped 8 row-tiles high for L2 reuse
GEMM_BM, GEMM_BN, GEMM_BK, GEMM_STAGES, GEMM_GROUP_M = 128, 256, 64, 4, 8
GEMM_THREADS = 384
#: the H100/H200 per-block SRAM limit after opting in (read off the device when there is one)
FALLBACK_SMEM_OPTIN = 232448


def check_tile_fields(cfg, min_stages: int = 1, why: str = "", block_ns: tuple = BLOCK_N_CHOICES) -> None:
    """The fields a Hopper config shares (block_n, stages, pingpong), each a ValueError naming it;
    ``min_stages`` (and ``why``, said after the range): the fewest stages the kernel takes;
    ``block_ns``: the key tiles it takes."""
    if cfg.block_n is not None and cfg.block_n not in block_ns:
        raise ValueError(f"config.block_n: expected one of {block_ns} or None, got {cfg.block_n!r}")
    if cfg.stages is not None and (isinstance(cfg.stages, bool) or not isinstance(cfg.stages, int)
                                   or not min_stages <= cfg.stages <= MAX_STAGES):
        raise ValueError(f"config.stages: expected an integer in {min_stages}..{MAX_STAGES}{why} or None, got "
                         f"{cfg.stages!r}")
    cv.check_bool(cfg.pingpong, "config.pingpong")


@dataclass(frozen=True)
class HopperConfig:
    """Tile settings of the Hopper attention kernels.

    version: "v3" .. "v11" or None (the default: at a call, the version the registry's default
    picks for its lengths and band, :func:`~iokernels.cupy_raw.policy.hopper_forward_for_length`;
    :meth:`resolve` alone, :func:`default_version`: v8 at every head dim).
    block_n (Bc): keys a K/V tile holds, 64 or 128 (64 only at head_dim 256, where v8, v9 and v11
    also take 80: :func:`block_n_choices`); None: the version's default at the head dim,
    :func:`~iokernels.cupy_raw.policy.hopper_tiles` (128; at head_dim 256 64, and v8, v9, v11 80).
    stages: K/V tiles the SRAM ring holds (1 .. MAX_STAGES; v5 .. v11 at least 2; None: the version's
    default at the head dim, :func:`~iokernels.cupy_raw.policy.hopper_tiles`; 2 at head_dim 256,
    where Q alone is 64 KB and a third stage does not fit).
    pingpong: v5 .. v11; False keeps the overlap inside a warpgroup but lets the consumer
    warpgroups issue their products whenever they are ready (to measure what ping-pong adds).
    blocks: v9 (persistent) only: the most blocks it launches (None: one an SM, :func:`grid`); a
    smaller grid makes each block claim more tiles (the tests and the sanitizer use it).
    The query tile is BLOCK_M = 128 rows (two consumer warpgroups); v6's and v10's are 192 (three,
    at head_dim 64 only: :data:`VERSION_HEAD_DIMS`, :meth:`block_m`).  Head dims:
    :data:`HEAD_DIMS` (64, 128, 256); the tiles depend on the head dim, so :meth:`resolve` takes it.
    At head_dim 256 the kernels run when a config names the version; the registry's default
    picks them only at the head dims :func:`~iokernels.cupy_raw.policy.hopper_default_at` allows.
    """

    version: str | None = None
    block_n: int | None = None
    stages: int | None = None
    pingpong: bool = True
    blocks: int | None = None

    def __post_init__(self):
        check_version(self, VERSIONS)
        wide = self.version in WIDE_KEY_VERSIONS
        if not wide and self.block_n in V8_BLOCK_N_CHOICES and self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"config.block_n: {self.block_n} keys is a tile of {', '.join(WIDE_KEY_VERSIONS)} "
                             f"only (at head_dim 256), got version={self.version!r}")
        check_tile_fields(self, block_ns=V8_BLOCK_N_CHOICES if wide else BLOCK_N_CHOICES)
        if self.blocks is not None:
            if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
                raise ValueError(f"config.blocks: expected a positive integer or None, got {self.blocks!r}")
            if self.version not in PERSISTENT:
                raise ValueError(f"config.blocks: only the persistent versions {PERSISTENT} take a block count, "
                                 f"got version={self.version!r}")

    def replace(self, **kw) -> "HopperConfig":
        return _dc_replace(self, **kw)

    def resolve(self, head_dim: int) -> "HopperConfig":
        """Every None filled with its default at ``head_dim`` (the version: :func:`default_version`)."""
        version = self.version or default_version(head_dim)
        dims = head_dims(version)
        if head_dim not in dims:
            raise ValueError(f"config.version: {version} takes head_dim {' or '.join(map(str, dims))} only "
                             f"(three consumer warpgroups leave 160 registers a thread, room for O, S and P "
                             f"of 64 x 128 tiles only there), got head_dim {head_dim}")
        return HopperConfig(version, *hopper_tiles(version, head_dim, self.block_n, self.stages), self.pingpong,
                            self.blocks)

    def block_m(self) -> int:
        """Br: the query rows a block of this version owns (:data:`BLOCK_MS`)."""
        return BLOCK_MS[self.version or DEFAULT_VERSION]

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic SRAM a block asks for: Q_i, stages x (K_j + V_j), the mbarriers (q_full and
        :data:`BARRIERS_A_STAGE` a stage), alignment slack."""
        c = self.resolve(head_dim)
        tiles = 2 * head_dim * (c.block_m() + 2 * c.stages * c.block_n)
        return (tiles + MBARRIER_BYTES * (1 + BARRIERS_A_STAGE.get(c.version, 3) * c.stages)
                + EXTRA_SMEM_BYTES.get(c.version, 0) + SMEM_ALIGN)

    def check_fits(self, head_dim: int, smem_optin: int) -> None:
        """ValueError naming the field when this config cannot run at ``head_dim`` on a GPU
        allowing ``smem_optin`` bytes of SRAM a block."""
        c = self.resolve(head_dim)
        choices = block_n_choices(c.version, head_dim)
        if c.block_n not in choices:
            why = (f"O is 128 registers a thread; S and P of {c.block_n} keys beside it spill"
                   if head_dim == HOPPER_WIDE_HEAD_DIM
                   else f"80 is a key tile of {', '.join(WIDE_KEY_VERSIONS)} at head_dim 256 only")
            raise ValueError(f"config.block_n: at head_dim {head_dim} {c.version} takes Bc in {choices} ({why}), "
                             f"got {c.block_n}")
        if c.version in PIPELINED and c.stages < 2:
            raise ValueError(f"config.stages: {c.version} uses K_j and V_{{j-1}} together, so it needs at least "
                             f"2 stages")
        need = self.smem_bytes(head_dim)
        if need > smem_optin:
            raise ValueError(f"config.stages: {c.stages} stages of Bc = {c.block_n} "
                             f"at head_dim {head_dim} need {need} bytes of SRAM; this GPU allows {smem_optin}")

    def defines(self, head_dim: int, dtype: str) -> dict:
        c = self.resolve(head_dim)
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BLOCK_M=c.block_m(), BLOCK_N=c.block_n,
                   STAGES=c.stages)
        if c.version in PIPELINED:
            out["PINGPONG"] = int(c.pingpong)
        return out


#: what HopperConfig() runs where no later version's gate opens (:func:`default_version`): the
#: fastest version measured there (benchmarks/results)
DEFAULT_VERSION = "v5"


def default_version(head_dim: int) -> str:
    """The version HopperConfig().resolve(head_dim) takes, where the call's lengths are not known:
    the highest-ranked of v8 and v7 whose head-dim gate opens there
    (:func:`~iokernels.cupy_raw.policy.hopper_v8_default_at`: every head dim; ``hopper_v7_default_at``: 256),
    else :data:`DEFAULT_VERSION`.  A call knows them: :func:`~iokernels.cupy_raw.hopper.attention`
    and the registry's default take v9, v10 or v11 where
    :func:`~iokernels.cupy_raw.policy.hopper_forward_for_length` says so."""
    if hopper_v8_default_at(head_dim):
        return "v8"
    return "v7" if hopper_v7_default_at(head_dim) else DEFAULT_VERSION


def block_n_choices(version: str, head_dim: int) -> tuple[int, ...]:
    """The key tiles (Bc) ``version`` takes at ``head_dim``: 64 and 128, 64 alone at head_dim 256
    (:data:`WIDE_BLOCK_N_CHOICES`), where v8, v9 and v11 also take 80 (fa_v8.cu)."""
    if head_dim == HOPPER_WIDE_HEAD_DIM:
        return WIDE_BLOCK_N_CHOICES + ((80,) if version in WIDE_KEY_VERSIONS else ())
    return BLOCK_N_CHOICES


def head_dims(version: str) -> tuple[int, ...]:
    """The head dims ``version`` takes: :data:`VERSION_HEAD_DIMS`, else all of :data:`HEAD_DIMS`."""
    return VERSION_HEAD_DIMS.get(version, HEAD_DIMS)


def grid(config: "HopperConfig", batch: int, heads_q: int, seqlen_q: int, sms: int) -> tuple[int, int, int]:
    """The launch grid of a resolved ``config``: a block a query tile, (Tr, heads_q, batch), or for
    the persistent versions (:data:`PERSISTENT`) min(query tiles, ``config.blocks`` or ``sms``)
    blocks in a row, each claiming tiles until none is left (fa_v9.cu)."""
    tiles = -(-seqlen_q // config.block_m())
    if config.version in PERSISTENT:
        return (max(1, min(tiles * heads_q * batch, config.blocks or sms)), 1, 1)
    return (tiles, heads_q, batch)
