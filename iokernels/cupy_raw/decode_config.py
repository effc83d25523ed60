"""The decode family's config: DecodeConfig (decode.cu, decode_v2.cu ... decode_v5.cu), its
constants and the shared memory each version's ring takes.

DecodeConfig is a frozen dataclass whose first field is ``version`` (None: the default
the registry picks for each call); its other fields are the settings of that version,
injected into the kernel as ``-D`` defines by :meth:`DecodeConfig.defines`.  The .cu files
hold no defaults: a define this module does not pass is a compile error, so the values
here (which tests pin) are the only ones.  The choose-a-size rules of the decode (the split
count, v4's block shape) are small pure functions in :mod:`iokernels.cupy_raw.policy`.

Notation (the papers' names):

=======  ===========================================================================
Bc       key/value rows per K/V tile (tile_rows)
d        head dim
g        query heads per KV head (GQA group), what one decode block serves
S        splits of the key axis (Flash-Decoding)
SRAM     shared memory of one thread block; HBM device memory
=======  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core import conventions as cv
from .config_checks import check_positive
from .launch import DTYPE_IDS, REGISTRY, round_up
# the choose-a-size rules and their constants (re-exported: the config's readers use them)
from .policy import (DECODE_MAX_SPLITS, DECODE_MIN_KEYS_PER_SPLIT, DECODE_SATURATING_FRACTION,  # noqa: F401
                     DECODE_V4_MAX_GROUP_ROWS, DECODE_V4_PAIRS_SPLIT_BLOCK, DECODE_V4_SMALL_STAGES,
                     DECODE_WAVE_COST_BYTES,
                     DECODE_COMBINE_DEFAULT, DECODE_COMBINES, DECODE_FUSE_BY_RULE, decode_fuse_combine,
                     decode_v4_block)

__all__ = [
    "CC_L1", "CHUNK_BYTES", "COMBINE_REG_SPLITS", "DECODE_MAX_SPLITS", "DECODE_MIN_BLOCKS",
    "DECODE_MIN_KEYS_PER_SPLIT", "DECODE_SATURATING_FRACTION", "DECODE_UNROLL", "DECODE_V2_MIN_BLOCKS",
    "DECODE_V2_STAGES", "DECODE_V2_TILE_BYTES", "DECODE_V3_QUANT_STAGES", "DECODE_V3_QUANT_TILE_BYTES",
    "DECODE_V3_STAGES", "DECODE_V3_TABLE_CAP", "DECODE_V3_WARPS", "DECODE_V3_WARP_CHOICES", "DECODE_V4_L1",
    "DECODE_V4_L1_MAX_RING", "DECODE_V4_MAX_GROUP", "DECODE_V4_MAX_HEAD_DIM", "DECODE_V4_MIN_BLOCKS",
    "DECODE_V4_PAIRS_SPLIT_BLOCK", "DECODE_V4_SMALL_STAGES", "DECODE_V4_SMALL_WARPS", "DECODE_V4_STAGES",
    "DECODE_V4_TILE_ROWS",
    "DECODE_V4_WARPS", "DECODE_V5_HEAD_DIMS", "DECODE_V5_TILE_ROWS", "DECODE_V5_WIDE_MAX_DIM",
    "DECODE_WARPS", "DECODE_WAVE_COST_BYTES", "DecodeConfig", "KV_QUANT_IDS",
    "CACHE_KINDS", "LAYOUTS", "MAX_ROW_CHUNKS", "MIN_STAGES", "MMA_K", "QUANT_UNIT_BYTES",
    "V4_ROW_PAD_BYTES", "V5_SCALE_BYTES", "VERSION_RULES", "code_readers", "decode_facts", "decode_v2_geometry",
    "decode_v2_smem", "decode_v3_smem", "decode_v4_smem", "decode_v4_swizzled", "decode_v5_smem", "kv_itemsize",
    "lane_words_a_head", "layout_of", "ring_smem_bound", "tc_smem", "v4_limits",
]

#: the k depth of one m16n8k16 tensor-core step (decode v4 / v5 tile rows and head dims are
#: multiples of it)
MMA_K = 16
# --------------------------------------------------------------------------- decode constants
#: the launch layouts a decode version's record names (``extra["layout"]``), which fix the
#: settings its config takes and the defines it is compiled with: "plain" (decode.cu: rows
#: into registers, decode.cu's combine), "ring" (decode_v2.cu: a per-warp cp.async ring),
#: "ring_fused" (decode_v3.cu: the ring with the fused combine, SRAM sized a launch, the staged
#: block table), "tensor_core" (decode_v4.cu, decode_v5.cu: the ring-fused launch with the
#: group's products on the tensor cores), "tma" (decode_v8.cu: the fused combine's launch with
#: the K/V tiles described by TMA tensor maps, on Hopper).  A record also says which caches its kernel reads
#: (``extra["reads"]``: "16-bit", "codes"; -DKV_QUANT for a kernel that reads codes)
LAYOUTS = ("plain", "ring", "ring_fused", "tensor_core", "tma")
CACHE_KINDS = ("16-bit", "codes")
#: versions whose ring depth and defines live in their own module, which registers them here
#: on import ({"stages": fn(config, head_dim, group, smem_limit), "defines": fn(config, base,
#: head_dim, dtype, group, smem_limit, kv, cc)}; decode_v6_config.py: "v6"; decode_v7_config.py:
#: "v7", defines only: its ring depth is v3's for the heads a block holds)
VERSION_RULES: dict = {}
#: decode v1 and v2: 4 warps a block; each v1 sub-group keeps UNROLL rows of K and V in
#: flight; the compiler is asked to fit DECODE_MIN_BLOCKS blocks an SM (__launch_bounds__)
DECODE_WARPS = 4
DECODE_UNROLL = 4
DECODE_MIN_BLOCKS = 3
#: decode v2 and v3 copy rows as 16-byte chunks, at most one chunk per lane of a warp
CHUNK_BYTES = 16
MAX_ROW_CHUNKS = 32
#: decode v2: each warp's ring holds this many K/V tiles (STAGES - 1 in flight while one is
#: used); 3 tiles of about DECODE_V2_TILE_BYTES of K and of V a warp keep 4 blocks an SM
DECODE_V2_STAGES = 3
#: ... and the registers are capped for this many blocks an SM (128 a thread at 4)
DECODE_V2_MIN_BLOCKS = 4
#: ... a tile is about this many bytes of K (and as many of V): 8 rows at bf16 d=128
DECODE_V2_TILE_BYTES = 2048
#: decode v3: v2's ring with the combine fused into the split kernel, 8 warps a block and a
#: 4-tile ring: one block an SM with 8 warps x 3 tiles in flight, the shape the tuning sweep
#: (iokernels.bench.sweeps_cupy) found best on a Hopper GPU
DECODE_V3_WARPS = 8
DECODE_V3_STAGES = 4
DECODE_V3_WARP_CHOICES = (4, 8)
#: the shallowest ring: one tile computed on while one is in flight
MIN_STAGES = 2
#: decode_common.cuh's fused combine merges up to this many splits a thread in registers at
#: once (more take its general path: the weights through SRAM)
COMBINE_REG_SPLITS = 16
#: -DKV_QUANT of a quantized cache's code format (common.cuh); None: an unquantized cache
KV_QUANT_IDS = {None: 0, "int8": 1, "float8_e4m3fn": 2}
#: quantized caches (1-byte codes): a lane computes on 8 codes of a row, so a row of d codes
#: takes d / 8 lanes, the 16-bit path's d / 8; at most 32 lanes a row (d <= 256)
QUANT_UNIT_BYTES = 8
#: ... and a v3 tile is this many bytes of K (half the 16-bit tile: the same rows a lane
#: scores per tile, whose scores sit in registers) ...
DECODE_V3_QUANT_TILE_BYTES = 1024
#: ... with twice the 16-bit ring's stages, so as many bytes are in flight
DECODE_V3_QUANT_STAGES = 8
#: ... a paged split's block-table entries are staged in SRAM when there are at most this
#: many (4 KB: 1024 pages of 16 rows = 16384 keys a split); longer splits read them from HBM/L2
DECODE_V3_TABLE_CAP = 1024
#: decode v4 (the GQA group on the tensor cores): v3's ring and combine with K_j, V_j tiles of
#: Bc = DECODE_V4_TILE_ROWS keys, the k depth of one m16n8k16 P V step (a multiple of
#: MMA_K); the defaults are chosen with SRAM rows counted padded by V4_ROW_PAD_BYTES (so
#: ldmatrix's 8 rows hit 8 bank groups; rows of whole 128-byte halves use the XOR swizzle
#: instead and take less, an upper bound either way; the launcher allocates what the rows
#: take).  8 warps x 3 stages at bf16 d=128 take 192 KB a block (204 KB counted padded): one
#: block an SM (the registers are capped for DECODE_V4_MIN_BLOCKS at 8 warps, twice that at
#: 4), 16 tiles of K and V in flight an SM, the best of the serving-shape rows of the tuning
#: sweep (iokernels.bench.sweeps_cupy, which times 4 and 8 warps, 2 to 4 stages, 16- and
#: 32-row tiles)
DECODE_V4_WARPS = 8
#: ... and where 8 warps' shallowest ring does not fit the SRAM (e.g. 99 KB on sm_86), 4
DECODE_V4_SMALL_WARPS = 4
DECODE_V4_STAGES = 3
DECODE_V4_TILE_ROWS = 16
DECODE_V4_MIN_BLOCKS = 1
V4_ROW_PAD_BYTES = 16
#: v4 over a contiguous 16-bit cache copies through L1 (cp.async.ca, -DLOAD_L1) rather than
#: around it (.cg): the copies then reach L2 as whole-line requests.  A missed line is
#: allocated in L1, which is what remains of the SM's combined L1 and shared memory (256 KB
#: on Hopper) beside the blocks' SRAM, so this needs the rings' SRAM sized exactly
#: (decode_v4_smem with swizzled rows): the default 3-stage ring of 8 warps then takes
#: 192 KB and leaves L1 60 KB; the same ring allocated for padded rows leaves it 28 KB, and
#: there .ca is slower than .cg (benchmarks/results/sweeps).  The default wherever a block's
#: ring is at most DECODE_V4_L1_MAX_RING, on compute capability CC_L1 and newer (where it was
#: measured), and a lane's chunks are fixed (rows of 2^k chunks, 32 % chunks == 0:
#: decode_v4.cu's contiguous issue); a paged cache, whose copies find their rows one by one,
#: keeps .cg
DECODE_V4_L1 = True
DECODE_V4_L1_MAX_RING = 192 * 1024
CC_L1 = 90
#: v4's (and v5's) limits, stated here once (:func:`v4_limits`; the registry's checks and
#: DecodeConfig.defines call it): the g query heads are the 16 rows of one mma A operand;
#: head dims are whole 16-deep k-steps, and O (d / 8 x 4 float32 a lane) stays in registers
#: up to d = 256
DECODE_V4_MAX_GROUP = DECODE_V4_MAX_GROUP_ROWS
DECODE_V4_MAX_HEAD_DIM = 256
#: decode v5 (v4 over a quantized cache, 1-byte codes, mma_codes.cuh): unpadded rows whose
#: 16-byte chunks are swizzled, which takes rows of 64 bytes or whole 128-byte lines
DECODE_V5_HEAD_DIMS = (64, 128, 256)
#: ... tiles of 32 keys (the bytes of the 16-bit default's 16-key tile, so the same ring depth
#: keeps as many bytes in flight, and each tile's softmax work -- O's rescale -- is spread over
#: twice the keys) up to head_dim DECODE_V5_WIDE_MAX_DIM, where S, O and the 4 V rows a
#: lane transposes still fit the registers; 16 keys beyond
DECODE_V5_TILE_ROWS = 32
DECODE_V5_WIDE_MAX_DIM = 128
#: ... and each stage holds its rows' scales next to the codes: one float32 s_K and one s_V a row
V5_SCALE_BYTES = 4


# =========================================================================== the records' facts
#: what a version without a record (None: the registry's default, resolved per call) is built as
_NONE_FACTS = dict(layout="plain", reads=CACHE_KINDS)


def decode_facts(version: str | None) -> dict:
    """The facts DecodeConfig reads from decode ``version``'s record (the contiguous or the
    paged one): ``layout`` (one of LAYOUTS) and ``reads`` (CACHE_KINDS it reads).  A
    ValueError naming config.version for a version no record has."""
    if version is None:
        return _NONE_FACTS
    for op in ("decode", "paged_decode"):
        rec = REGISTRY.find(op, version)
        if rec is not None and rec.config_class is DecodeConfig:
            layout, reads = rec.extra.get("layout"), rec.extra.get("reads")
            if layout not in LAYOUTS or not reads or not set(reads) <= set(CACHE_KINDS):
                raise ValueError(f"record.extra: decode {version}'s record must name its layout (one of "
                                 f"{', '.join(LAYOUTS)}) and the caches it reads (of {', '.join(CACHE_KINDS)}); "
                                 f"got layout={layout!r}, reads={reads!r}")
            return dict(layout=layout, reads=tuple(reads))
    have = sorted({r.version for op in ("decode", "paged_decode") for r in REGISTRY.kernels(op)
                   if r.config_class is DecodeConfig})
    raise ValueError(f"config.version: no decode version {version!r}; expected one of {', '.join(have)}")


def code_readers() -> list[str]:
    """The paged decode versions whose records say they read a quantized cache's codes."""
    return sorted(r.version for r in REGISTRY.kernels("paged_decode") if "codes" in r.extra.get("reads", ()))


def layout_of(version: str | None) -> str:
    """The launch layout of decode ``version`` (None: "plain", as v1)."""
    return decode_facts(version)["layout"]


# =========================================================================== decode
@dataclass(frozen=True)
class DecodeConfig:
    """Which decode kernel, and its settings (``config=`` of decode / paged_decode).

    version: "v1" (decode.cu: plain loads into registers), "v2" (decode_v2.cu: a per-warp
    cp.async ring of K/V tiles in SRAM), "v3" (decode_v3.cu: v2's ring with the combine
    fused into the split kernel, 8 warps x 4 stages), "v4" (decode_v4.cu: v3's ring and
    combine with the GQA group's products on the tensor cores, 16-bit caches; limits:
    :func:`v4_limits`), "v5" (decode_v5.cu: v4 reading a quantized paged cache's 1-byte
    codes; head dims DECODE_V5_HEAD_DIMS), "v6" (decode_v6_config.py: v4 with groups past 16
    split across teams of warps), "v7" (decode_v7_config.py: v3 with the group split over
    blocks; v3's fields) or "v8" (decode_v8_config.py: on Hopper, the group as one warpgroup's
    wgmma rows, K/V by TMA, a contiguous cache; stages, tile_rows and fused); None: the
    registry's default (v5 for a quantized cache where it applies, v4 for a 16-bit one up to 16
    query heads a KV head, v8 from 17 to 64 on Hopper over a contiguous cache, v6 past 16
    elsewhere, else v3 where its rows and ring fit, else v1).  v2 to v5 need rows of whole
    16-byte chunks, at most 32 of them, 16-byte aligned.
    stages (v2 to v5): the ring depth (>= 2; None: DECODE_V2_STAGES, or DECODE_V3_STAGES /
    DECODE_V4_STAGES made shallower until the ring fits).  tile_rows (v2 to v5): key rows a
    tile (v2, v3: a multiple of the rows a warp reads side by side, None: about
    DECODE_V2_TILE_BYTES of K; v4, v5: Bc, a multiple of 16, None: DECODE_V4_TILE_ROWS,
    DECODE_V5_TILE_ROWS).  num_warps (v3 to v5): 4 or 8 warps a block (None: DECODE_V3_WARPS;
    v4 over 16-bit rows: :func:`iokernels.cupy_raw.policy.decode_v4_block`, which also makes the
    ring shallower when it picks the smaller block).  fused (v3 to v8): the
    combine inside the split kernel (True) or decode.cu's separate combine launch (False, v2's
    structure); None: v4 and v8 by group x head_dim (:func:`iokernels.cupy_raw.policy.decode_fuse_combine`),
    the others fused.  combine: the separate combine's kernel where the split kernel does not
    fuse it, "serial" (decode.cu's: a thread a column walks the splits one after another) or
    "parallel" (decode_combine.cu's: the splits' LSEs read side by side, a split a thread, the
    weights in SRAM, several partials in flight a thread); None: DECODE_COMBINE_DEFAULT.
    min_blocks: blocks an SM the registers are capped for (None: DECODE_MIN_BLOCKS for v1,
    DECODE_V2_MIN_BLOCKS at 4 warps, half that at 8; v4, v5: DECODE_V4_MIN_BLOCKS at 8 warps,
    twice that at 4).  unroll (v1): rows of K and V each sub-group keeps in flight
    (None: DECODE_UNROLL).  load_l1 (v4, v5): the cp.async chunks pass through L1 (True, .ca)
    or bypass it (False, .cg); None: DECODE_V4_L1 over a contiguous 16-bit cache on compute
    capability CC_L1+, .cg over pages and quantized codes.
    """

    version: str | None = None
    stages: int | None = None
    tile_rows: int | None = None
    num_warps: int | None = None
    fused: bool | None = None
    min_blocks: int | None = None
    unroll: int | None = None
    load_l1: bool | None = None
    combine: str | None = None

    def __post_init__(self):
        layout = layout_of(self.version)                    # the record's facts, or a ValueError
        check_positive(self, ("stages", "tile_rows", "num_warps", "min_blocks", "unroll"))
        if self.stages is not None and self.stages < MIN_STAGES:
            raise ValueError(f"config.stages: must be at least 2 (one tile used, one in flight), got {self.stages}")
        if self.num_warps not in (None, *DECODE_V3_WARP_CHOICES):
            raise ValueError(f"config.num_warps: must be 4 or 8 (v3), got {self.num_warps}")
        sized = self.version is None or layout in ("ring_fused", "tensor_core")
        if self.num_warps not in (None, DECODE_WARPS) and not sized:
            raise ValueError(f"config.num_warps: a v3 / v4 / v5 setting; version {self.version!r} runs {DECODE_WARPS}")
        if layout == "tma":
            for name in ("num_warps", "min_blocks"):
                if getattr(self, name) is not None:
                    raise ValueError(f"config.{name}: decode {self.version} has one producer and one or two "
                                     f"consumer warpgroups a block by head dim, one block an SM; got {name}="
                                     f"{getattr(self, name)}")
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ValueError(f"config.fused: must be True, False or None, got {self.fused!r}")
        if self.combine not in (None, *DECODE_COMBINES):
            raise ValueError(f"config.combine: must be one of {DECODE_COMBINES} or None, got {self.combine!r}")
        ring = ("stages", "tile_rows")
        for name in ring:
            if self.version is not None and layout == "plain" and getattr(self, name) is not None:
                raise ValueError(f"config.{name}: a setting of the v2/v3 ring; version {self.version!r} has none")
        if self.unroll is not None and self.version is not None and layout != "plain":
            raise ValueError(f"config.unroll: a v1 setting; version {self.version!r} streams a ring")
        if self.load_l1 is not None:
            if not isinstance(self.load_l1, bool):
                raise ValueError(f"config.load_l1: must be True, False or None, got {self.load_l1!r}")
            if self.version is not None and layout != "tensor_core":
                raise ValueError(f"config.load_l1: a v4 / v5 / v6 setting; version {self.version!r} copies around L1")

    @property
    def layout(self) -> str:
        """This version's launch layout (its record's ``extra["layout"]``; None: "plain")."""
        return layout_of(self.version)

    def replace(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)

    # -- v2 / v3: the ring
    def ring_warps(self) -> int:
        """v2's / v3's warps a block (v4's depend on the SRAM: :meth:`_v4_warps`)."""
        return (self.num_warps or DECODE_V3_WARPS) if self.layout == "ring_fused" else DECODE_WARPS

    def ring_stages(self, head_dim: int, dtype: str, group: int, smem_limit: int | None = None,
                    kv: str | None = None) -> int:
        """The ring depth: the given one, or the default (v3: made shallower until the ring, the
        fused combine's weights at DECODE_MAX_SPLITS and a full staged block table fit
        ``smem_limit``, down to MIN_STAGES).  ``kv``: a quantized cache's code format."""
        if self.stages is not None:
            return self.stages
        if "stages" in VERSION_RULES.get(self.version, {}):
            return VERSION_RULES[self.version]["stages"](self, head_dim, group, smem_limit)
        layout = self.layout
        if layout == "tensor_core":
            return self._v4_stages(head_dim, dtype, group, smem_limit, kv)
        if layout != "ring_fused":
            return DECODE_V2_STAGES
        rows = decode_v2_geometry(head_dim, dtype, self.tile_rows, kv)["tile_rows"]
        top = DECODE_V3_STAGES if kv is None else DECODE_V3_QUANT_STAGES
        for st in range(top, MIN_STAGES - 1, -1):
            need = decode_v3_smem(head_dim, dtype, group, st, rows, self.ring_warps(), DECODE_MAX_SPLITS, True,
                                  DECODE_V3_TABLE_CAP, kv)[0]
            if smem_limit is None or need <= smem_limit:
                return st
        return MIN_STAGES

    def defines(self, head_dim: int, dtype: str, group: int, paged: bool, block_size: int, *,
                aligned: bool = True, smem_limit: int | None = None, kv: str | None = None,
                cc: int | None = None, pairs: int | None = None, sms: int | None = None) -> dict:
        """The -D defines of this version's split kernel (v1's also compile decode.cu's combine).

        ``kv``: a quantized (paged) cache's code format, "int8" or "float8_e4m3fn" (-DKV_QUANT;
        the rows are then d bytes); ``dtype`` stays the queries' and outputs' dtype.  ``cc``:
        the GPU's compute capability x 10 (v4's load_l1 default; None: unknown, .cg).
        ``pairs``, ``sms``: the batch's (b, kv head) pairs and the GPU's SMs (v4's block shape,
        :func:`~.policy.decode_v4_block`; None: the 8-warp block)."""
        d = head_dim
        facts = decode_facts(self.version)
        layout = facts["layout"]
        if kv is not None and (not paged or (layout != "tensor_core" and "codes" not in facts["reads"])):
            raise ValueError(f"kv_dtype: a {kv} cache is read by the paged decode of versions "
                             f"{', '.join(code_readers())}, not "
                             f"{'a contiguous cache' if not paged else 'version ' + str(self.version)}")
        base = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=d, GROUP=group, PAGED=int(paged))
        if "codes" in facts["reads"]:                    # the kernels that can read codes: which (0: none)
            base["KV_QUANT"] = KV_QUANT_IDS[kv]
        if paged:
            base["BLOCK_SIZE"] = block_size
        if self.version in VERSION_RULES:
            return VERSION_RULES[self.version]["defines"](self, base, d, dtype, group, smem_limit, kv, cc)
        if layout == "tensor_core":
            return self._v4_defines(base, d, dtype, group, smem_limit, kv, cc, pairs, sms)
        if layout == "plain":
            itemsize = kv_itemsize(dtype, kv)
            load = CHUNK_BYTES if kv is None else QUANT_UNIT_BYTES
            vec = int((d * itemsize) % load == 0 and d * itemsize <= MAX_ROW_CHUNKS * load and aligned)
            return dict(base, VEC_IO=vec, NUM_WARPS=DECODE_WARPS, UNROLL=self.unroll or DECODE_UNROLL,
                        DECODE_MIN_BLOCKS=self.min_blocks or DECODE_MIN_BLOCKS)
        return self.ring_defines(base, d, dtype, group, smem_limit, kv)

    def combine_fused(self, group: int, head_dim: int) -> bool:
        """Whether the split kernel merges its splits itself (its FUSED define) at ``group``
        query heads a block of ``head_dim``: the given ``fused``, else
        :func:`~.policy.decode_fuse_combine` for the versions of DECODE_FUSE_BY_RULE, else True."""
        if self.fused is not None:
            return self.fused
        return decode_fuse_combine(group, head_dim) if self.version in DECODE_FUSE_BY_RULE else True

    def combine_kernel(self) -> str:
        """The separate combine's kernel: the given ``combine``, else DECODE_COMBINE_DEFAULT."""
        return self.combine or DECODE_COMBINE_DEFAULT

    def ring_defines(self, base: dict, d: int, dtype: str, group: int, smem_limit: int | None = None,
                     kv: str | None = None) -> dict:
        """v2's and v3's defines (the ring, and v3's fused combine) on top of ``base`` for
        ``group`` query heads a block (decode_v7_config.py calls it with a block's slice)."""
        layout = self.layout
        geo = decode_v2_geometry(d, dtype, self.tile_rows, kv)
        if geo is None:
            raise ValueError(f"config.version: {self.version} needs rows of whole 16-byte chunks, at most "
                             f"{MAX_ROW_CHUNKS}; head_dim={d} ({kv or dtype}) is not (use version 'v1')")
        stages = self.ring_stages(d, dtype, group, smem_limit, kv)
        if layout == "ring":
            return dict(base, NUM_WARPS=DECODE_WARPS, STAGES=stages, TILE_ROWS=geo["tile_rows"],
                        DECODE_MIN_BLOCKS=self.min_blocks or DECODE_V2_MIN_BLOCKS)
        nw = self.ring_warps()
        mb = self.min_blocks or max(1, DECODE_V2_MIN_BLOCKS * DECODE_WARPS // nw)
        return dict(base, NUM_WARPS=nw, STAGES=stages, TILE_ROWS=geo["tile_rows"], DECODE_MIN_BLOCKS=mb,
                    FUSED=int(self.combine_fused(group, d)), COMBINE_REG_SPLITS=COMBINE_REG_SPLITS)

    # -- v4, v5: the tensor-core decode (v5: ``kv``, a quantized cache's code format)
    def v4_tile_rows(self, head_dim: int | None = None, kv: str | None = None) -> int:
        """Bc of decode v4: the given tile_rows (a multiple of 16) or DECODE_V4_TILE_ROWS
        (v5, a quantized cache ``kv``: DECODE_V5_TILE_ROWS up to head_dim
        DECODE_V5_WIDE_MAX_DIM, else 16)."""
        default = DECODE_V4_TILE_ROWS
        if kv is not None:
            default = DECODE_V5_TILE_ROWS if (head_dim or 0) <= DECODE_V5_WIDE_MAX_DIM else MMA_K
        rows = self.tile_rows or default
        if rows % MMA_K:
            raise ValueError(f"config.tile_rows: decode v4 / v5 take multiples of {MMA_K} (the k depth of one "
                             f"P V product), got {rows}")
        return rows

    def _v4_fits(self, head_dim, dtype, group, stages, warps, smem_limit, kv=None) -> bool:
        """Whether v4's ring of ``stages`` x ``warps``, the fused combine's weights at
        DECODE_MAX_SPLITS and a full staged block table fit ``smem_limit`` (None: no limit).
        ``kv``: a quantized cache's code format (1-byte rows and their scales)."""
        need = tc_smem(head_dim, dtype, group, stages, self.v4_tile_rows(head_dim, kv), warps,
                       DECODE_MAX_SPLITS, True, DECODE_V3_TABLE_CAP, kv)[0]
        return smem_limit is None or need <= smem_limit

    def _v4_warps(self, head_dim, dtype, group, smem_limit, kv=None) -> int:
        """v4's warps a block: the given ones, or DECODE_V4_WARPS where its shallowest ring
        fits, else DECODE_V4_SMALL_WARPS."""
        if self.num_warps is not None:
            return self.num_warps
        fits = self._v4_fits(head_dim, dtype, group, MIN_STAGES, DECODE_V4_WARPS, smem_limit, kv)
        return DECODE_V4_WARPS if fits else DECODE_V4_SMALL_WARPS

    def _v4_stages(self, head_dim, dtype, group, smem_limit, kv=None) -> int:
        """v4's default ring depth: DECODE_V4_STAGES, made shallower until the ring, the fused
        combine's weights at DECODE_MAX_SPLITS and a full staged block table fit."""
        warps = self._v4_warps(head_dim, dtype, group, smem_limit, kv)
        for st in range(DECODE_V4_STAGES, MIN_STAGES - 1, -1):
            if self._v4_fits(head_dim, dtype, group, st, warps, smem_limit, kv):
                return st
        return MIN_STAGES

    def _v4_defines(self, base, d, dtype, group, smem_limit, kv=None, cc=None, pairs=None, sms=None) -> dict:
        why = v4_limits(dtype, d, group) or _v5_cache(self.version, d, kv)
        if why:
            raise ValueError(f"config.version: {self.version}: {why}")
        nw = self._v4_warps(d, dtype, group, smem_limit, kv)
        stages = self.ring_stages(d, dtype, group, smem_limit, kv)
        l1 = self.v4_load_l1(bool(base["PAGED"]), kv, d, nw, stages, cc)
        if self.num_warps is None and kv is None:    # the batch's block shape over 16-bit rows (v5's
            # quantized rows have no timed rows of their own); a given ring depth stays
            nw, by_rule = decode_v4_block(nw, stages, DECODE_V4_SMALL_WARPS, pairs, sms)
            stages = stages if self.stages is not None else by_rule
        # the registers a thread may use: those of 8 warps x 1 block an SM
        mb = self.min_blocks or max(1, DECODE_V4_MIN_BLOCKS * DECODE_V4_WARPS // nw)
        return dict(base, NUM_WARPS=nw, STAGES=stages, TILE_ROWS=self.v4_tile_rows(d, kv), DECODE_MIN_BLOCKS=mb,
                    FUSED=int(self.combine_fused(group, d)), LOAD_L1=int(l1),
                    COMBINE_REG_SPLITS=COMBINE_REG_SPLITS)

    def v4_load_l1(self, paged: bool, kv: str | None = None, head_dim: int = 128,
                   warps: int = DECODE_V4_WARPS, stages: int = DECODE_V4_STAGES, cc: int | None = None) -> bool:
        """Whether v4's (v5's) cp.async chunks pass through L1: the given load_l1, or
        DECODE_V4_L1 on compute capability ``cc`` >= CC_L1 over a contiguous 16-bit cache whose
        rows are 2^k 16-byte chunks (at most 32) and whose ring of ``warps`` x ``stages`` takes
        at most DECODE_V4_L1_MAX_RING bytes."""
        if self.load_l1 is None:
            chunks = head_dim * 2 // CHUNK_BYTES
            ring = decode_v4_smem(head_dim, "float16", 1, stages, self.v4_tile_rows(head_dim), warps,
                                  swizzled=True)[0]        # what the launcher allocates
            return (DECODE_V4_L1 and cc is not None and cc >= CC_L1 and not paged and kv is None
                    and 32 % chunks == 0 and ring <= DECODE_V4_L1_MAX_RING)
        return self.load_l1

    def combine_defines(self, head_dim: int, dtype: str, group: int, paged: bool, block_size: int,
                        aligned: bool = True) -> dict:
        """decode.cu's defines, for its combine kernel (every version's two-launch path).

        The combine reads only the head dim and the dtype.  decode.cu's split kernel, in the
        same module, holds a group's queries in registers, and built at a large group it spills
        and takes ptxas minutes (at 128 query heads a KV head).  So v1 builds the module it
        launches anyway (its own split kernel's defines), and every other version one at group 1
        over a contiguous cache: one cheap build, whatever the group, layout or cache."""
        if self.version == "v1":
            return self.defines(head_dim, dtype, group, paged, block_size, aligned=aligned)
        return DecodeConfig("v1").defines(head_dim, dtype, 1, False, 0, aligned=aligned)


def kv_itemsize(dtype: str, kv: str | None = None) -> int:
    """Bytes of one stored K/V element: 1 for a quantized cache's codes, else ``dtype``'s."""
    return 1 if kv is not None else cv.itemsize_of(dtype)


def decode_v2_geometry(head_dim: int, dtype: str, tile_rows: int | None = None, kv: str | None = None) -> dict | None:
    """decode_v2.cu's / decode_v3.cu's layout for one row shape, or None when the ring cannot
    take it (rows not whole 16-byte chunks, or more than 32 of them, or more than 32 lanes).

    The row's bytes are d times the stored element's (``kv``: a quantized cache's code
    format, 1 byte).  chunks: 16-byte chunks a row (what cp.async copies); lanes: lanes a
    row (a power of two; a lane computes on 16 bytes, or 8 bytes of codes); rows_side_by_side:
    32 / lanes; tile_rows: rows a tile.  Mirrors the kernels' macros (CPR, UPR, LANES, RPW,
    TILE_ROWS).
    """
    row_bytes = head_dim * kv_itemsize(dtype, kv)
    if row_bytes % CHUNK_BYTES or row_bytes > MAX_ROW_CHUNKS * CHUNK_BYTES:
        return None
    cpr = row_bytes // CHUNK_BYTES
    units = cpr if kv is None else row_bytes // QUANT_UNIT_BYTES
    if units > MAX_ROW_CHUNKS:
        return None
    lanes = 1 << (units - 1).bit_length()
    rpw = 32 // lanes
    if tile_rows is None:
        per = (DECODE_V2_TILE_BYTES if kv is None else DECODE_V3_QUANT_TILE_BYTES) // row_bytes
        tile_rows = rpw if per < rpw else per // rpw * rpw
    elif tile_rows % rpw:
        raise ValueError(f"config.tile_rows: must be a multiple of {rpw} at head_dim={head_dim} ({dtype}), "
                         f"got {tile_rows}")
    return dict(chunks=cpr, lanes=lanes, rows_side_by_side=rpw, tile_rows=tile_rows)


def lane_words_a_head(head_dim: int, dtype: str, tile_rows: int | None = None, kv: str | None = None) -> int | None:
    """The 32-bit registers a lane of decode v3 / v7 keeps for each query head of its block:
    its EPL values of q and of O (EPL: 16 bytes of a row, or 8 bytes of codes, in elements),
    one score a row step of the tile (tile rows / rows side by side), m, l and the tile's
    softmax base, all in the accumulator type (float64: two registers each).  None where
    :func:`decode_v2_geometry` does not take the rows.  Mirrors decode_v3.cu's q, acc, sc, m,
    l and base arrays."""
    geo = decode_v2_geometry(head_dim, dtype, tile_rows, kv)
    if geo is None:
        return None
    epl = CHUNK_BYTES // kv_itemsize(dtype) if kv is None else QUANT_UNIT_BYTES
    steps = geo["tile_rows"] // geo["rows_side_by_side"]
    words = cv.accum_dtype(dtype).itemsize // 4
    return (2 * epl + steps + 3) * words


def decode_v2_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int) -> int:
    """decode_v2.cu's dynamic SRAM a block: the warps' rings, or the final merge if larger."""
    ring = DECODE_WARPS * stages * 2 * tile_rows * head_dim * cv.itemsize_of(dtype)
    merge = DECODE_WARPS * group * head_dim * cv.accum_dtype(dtype).itemsize
    return max(ring, merge)


def decode_v3_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0, kv: str | None = None) -> tuple:
    """decode_v3.cu's dynamic SRAM a block, as (total bytes, byte offset of the block table):
    max(the rings, the warps' merge buffer, the fused combine's weights), then ``table_cap``
    int32 block-table entries (paged).  ``kv``: a quantized cache's code format (1-byte rows)."""
    acc = cv.accum_dtype(dtype).itemsize
    ring = num_warps * stages * 2 * tile_rows * head_dim * kv_itemsize(dtype, kv)
    merge = num_warps * group * head_dim * acc
    weights = group * num_splits * acc if fused and num_splits > 1 else 0
    offset = round_up(max(ring, merge, weights), 16)
    return offset + 4 * table_cap, offset


def decode_v4_swizzled(head_dim: int) -> bool:
    """decode_v4.cu's SWIZZLE for 16-bit rows: rows of whole 128-byte halves (d a multiple of
    64) are stored unpadded with the XOR swizzle; other rows are padded."""
    return head_dim % 64 == 0


def _ring_fused_smem(stage: int, head_dim: int, group: int, stages: int, num_warps: int, num_splits: int,
                     fused: bool, table_cap: int) -> tuple:
    """(total, table offset) of v4's / v5's dynamic SRAM: max(the rings of ``stage`` bytes a
    stage, the warps' float32 merge buffer, the fused combine's weights), then the table."""
    ring = num_warps * stages * stage
    merge = num_warps * group * head_dim * 4
    weights = group * num_splits * 4 if fused and num_splits > 1 else 0
    offset = round_up(max(ring, merge, weights), 16)
    return offset + 4 * table_cap, offset


def decode_v4_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0, kv: str | None = None,
                   swizzled: bool = False) -> tuple:
    """decode_v4.cu's dynamic SRAM a block, as (total bytes, byte offset of the block table):
    max(the rings, the warps' float32 merge buffer, the fused combine's weights), then
    ``table_cap`` int32 block-table entries (paged).  16-bit rows are counted padded by
    V4_ROW_PAD_BYTES (what rows that are not whole 128-byte halves take: an upper bound for
    every layout), or exactly when ``swizzled`` (:func:`decode_v4_swizzled`; the launcher
    allocates that, so the L1 beside it keeps what the ring does not use).  ``kv``: must be
    None (v4 reads 16-bit caches; :func:`decode_v5_smem` takes the codes)."""
    if kv is not None:
        raise ValueError(f"kv_dtype: decode v4 reads 16-bit caches; a {kv} cache is v5's (decode_v5_smem)")
    pad = 0 if swizzled else V4_ROW_PAD_BYTES
    stage = 2 * tile_rows * (head_dim * cv.itemsize_of(dtype) + pad)
    return _ring_fused_smem(stage, head_dim, group, stages, num_warps, num_splits, fused, table_cap)


def decode_v5_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0, kv: str | None = "int8",
                   swizzled: bool = True) -> tuple:
    """decode_v5.cu's dynamic SRAM a block, as :func:`decode_v4_smem`: a quantized cache's
    rows are head_dim bytes, unpadded (their chunks are swizzled), and each stage also holds
    its rows' float32 s_K and s_V.  ``dtype``: the queries' (the merge is float32 either way)."""
    if kv is None:
        raise ValueError("kv_dtype: decode v5 reads a quantized cache's codes (int8 or float8_e4m3fn)")
    stage = 2 * tile_rows * (head_dim * kv_itemsize(dtype, kv) + V5_SCALE_BYTES)
    return _ring_fused_smem(stage, head_dim, group, stages, num_warps, num_splits, fused, table_cap)


def tc_smem(head_dim, dtype, group, stages, tile_rows, num_warps, num_splits=1, fused=True, table_cap=0,
            kv=None) -> tuple:
    """v4's SRAM for a 16-bit cache (rows counted padded), v5's for a quantized one (``kv``)."""
    fn = decode_v4_smem if kv is None else decode_v5_smem
    return fn(head_dim, dtype, group, stages, tile_rows, num_warps, num_splits, fused, table_cap, kv)


def ring_smem_bound(version: str, head_dim: int, dtype: str, group: int, num_warps: int | None = None,
                    stages: int = MIN_STAGES, kv: str | None = None) -> int:
    """The most dynamic SRAM a v2 to v5 call at ``stages`` can ask for: the ring (or merge),
    plus, for v3 to v5, the fused combine's weights at DECODE_MAX_SPLITS and a full staged
    block table.  A registry check compares it with the GPU's limit.  ``kv``: a quantized
    cache's code format (its rows are d bytes)."""
    layout = layout_of(version)
    if layout == "tensor_core":
        return tc_smem(head_dim, dtype, group, stages, DecodeConfig(version).v4_tile_rows(head_dim, kv),
                       num_warps or DECODE_V4_SMALL_WARPS, DECODE_MAX_SPLITS, True, DECODE_V3_TABLE_CAP, kv)[0]
    rows = decode_v2_geometry(head_dim, dtype, None, kv)["tile_rows"]
    if layout == "ring":
        return decode_v2_smem(head_dim, dtype, group, stages, rows)
    return decode_v3_smem(head_dim, dtype, group, stages, rows, num_warps or DECODE_V3_WARPS,
                          DECODE_MAX_SPLITS, True, DECODE_V3_TABLE_CAP, kv)[0]


def v4_limits(dtype: str, head_dim: int, group: int) -> str | None:
    """Why decode v4 (and v5) cannot take (dtype, head_dim, group), or None: 16-bit queries,
    head dims of whole 16-deep mma k-steps up to DECODE_V4_MAX_HEAD_DIM (O in registers), and
    at most DECODE_V4_MAX_GROUP query heads a KV head (one 16-row A operand).  The one
    statement of v4's limits: the registry's checks and DecodeConfig.defines call it."""
    if dtype not in ("float16", "bfloat16"):
        return f"the float16/bfloat16 tensor-core decode, got {dtype}"
    if head_dim % MMA_K or head_dim > DECODE_V4_MAX_HEAD_DIM:
        return (f"head_dim must be a multiple of {MMA_K} up to {DECODE_V4_MAX_HEAD_DIM} "
                f"(whole mma k-steps, O in registers), got {head_dim}")
    if group > DECODE_V4_MAX_GROUP:
        return f"group: at most {DECODE_V4_MAX_GROUP} query heads a KV head (one mma row block), got {group}"
    return None


def _v5_cache(version: str, head_dim: int, kv: str | None) -> str | None:
    """Why tensor-core ``version`` does not read a cache of code format ``kv`` (None: 16-bit),
    from the caches its record says it reads; a reader of codes takes DECODE_V5_HEAD_DIMS."""
    reads = decode_facts(version)["reads"]
    if kv is not None and "codes" not in reads:
        return f"kv_dtype: reads 16-bit caches; a {kv} cache is read by v5"
    if kv is None and "16-bit" not in reads:
        return "kv_dtype: reads a quantized cache's 1-byte codes (int8 or float8_e4m3fn); v4 reads 16-bit caches"
    if kv is not None and head_dim not in DECODE_V5_HEAD_DIMS:
        return (f"kv_dtype: reads {kv} codes at head dims {', '.join(map(str, DECODE_V5_HEAD_DIMS))} "
                f"(the swizzle of its unpadded 1-byte rows), got {head_dim}; v3 reads the rest")
    return None
