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
from .launch import DTYPE_IDS, round_up

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
#: v2's default Bc: 64 keys up to d = 128; 32 above (the S/P tile and O share the registers)
V2_DEFAULT_BLOCK_K = {128: 64, 256: 32}
#: v2 keeps O for d <= 256 in registers (d / 8 * 4 floats a lane); larger d would spill
V2_MAX_HEAD_DIM = 256
#: fa_v1b: registers capped so this many blocks fit an SM (its SRAM at 64 x 64 allows two)
V1B_MIN_BLOCKS = 2
#: the tile sets fit_config tries, largest first, when the default ones do not fit: (Br, Bc);
#: v2 runs Br / 16 warps
SHRINK_TILES = ((64, 32), (32, 32), (32, 16), (16, 16))

# --------------------------------------------------------------------------- decode constants
#: the versions DecodeConfig describes
DECODE_VERSIONS = ("v1", "v2", "v3", "v4")
#: decode v1 and v2: 4 warps a block; each v1 sub-group keeps UNROLL rows of K and V in
#: flight; the compiler is asked to fit DECODE_MIN_BLOCKS blocks an SM (__launch_bounds__)
DECODE_WARPS = 4
DECODE_UNROLL = 4
DECODE_MIN_BLOCKS = 3
#: num_splits heuristic, a cost model of the split kernel's waves (blocks_per_sm x SMs blocks
#: run at once): a wave of n blocks of k keys streams for about k x max(n, rho) key-times, as
#: rho = DECODE_SATURATING_FRACTION of a full wave's blocks already keep HBM busy (fewer
#: stream at their own rate, more share it), and each wave adds what rho blocks take to
#: stream DECODE_WAVE_COST_BYTES of K and V (its blocks' first tiles in flight, the warps'
#: merge, the partials and the fused combine); fitted to decode v4's timings at batches 1 to
#: 32 on the H200 (benchmarks/results/sweeps), which hold one full wave, two waves whose second
#: is nearly empty, and split counts that leave a sliver of a last wave
DECODE_SATURATING_FRACTION = 0.7
DECODE_WAVE_COST_BYTES = 160 * 1024
#: ... keep at least this many keys a split (its partial O write is amortized) ...
DECODE_MIN_KEYS_PER_SPLIT = 256
#: ... and at most this many splits (the combine reads them all)
DECODE_MAX_SPLITS = 128
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
#: MMA_ROWS); the defaults are chosen with SRAM rows counted padded by V4_ROW_PAD_BYTES (so
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
#: v4 on sm_90 and newer may load each K/V row with one bulk copy through the copy engine
#: (-DLOAD_BULK, decode_v4.cu) rather than 16-byte cp.async chunks; off by default, as the
#: row copies stream no faster over a contiguous cache and slower over pages (decode4_dev's
#: timings, recorded with the bench)
DECODE_V4_BULK = False
CC_BULK = 90
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
#: ... and there, when the batch's (b, kv head) pairs give every SM at least
#: DECODE_V4_PAIRS_SPLIT_BLOCK of them, a block is DECODE_V4_SMALL_WARPS warps and two share
#: an SM (the same warps and ring bytes an SM): one block's start (its first tiles' latency)
#: and end (the warps' merge, the write of O) then overlap the other's streaming, where one
#: 8-warp block an SM leaves the SM idle for both, once per (b, kv head)
DECODE_V4_PAIRS_SPLIT_BLOCK = 2
#: v4's limits: the g query heads are the 16 rows of one mma A operand; head dims are whole
#: 16-deep k-steps, and O (d / 8 x 4 float32 a lane) stays in registers up to d = 256
DECODE_V4_MAX_GROUP = 16
DECODE_V4_MAX_HEAD_DIM = 256
#: v4 on a quantized cache (1-byte codes, mma_codes.cuh): unpadded rows whose 16-byte chunks
#: are swizzled, which takes rows of 64 bytes or whole 128-byte lines
DECODE_V4_QUANT_HEAD_DIMS = (64, 128, 256)
#: ... tiles of 32 keys (the bytes of the 16-bit default's 16-key tile, so the same ring depth
#: keeps as many bytes in flight, and each tile's softmax work -- O's rescale -- is spread over
#: twice the keys) up to head_dim DECODE_V4_QUANT_WIDE_MAX_DIM, where S, O and the 4 V rows a
#: lane transposes still fit the registers; 16 keys beyond
DECODE_V4_QUANT_TILE_ROWS = 32
DECODE_V4_QUANT_WIDE_MAX_DIM = 128
#: ... and each stage holds its rows' scales next to the codes: one float32 s_K and one s_V a row
V4_SCALE_BYTES = 4

# --------------------------------------------------------------------------- gather constants
#: paged gather: threads a block, and blocks per SM the grid-stride loop launches
GATHER_THREADS = 256
GATHER_BLOCKS_PER_SM = 8


def _positive(cfg, names):
    for name in names:
        val = getattr(cfg, name)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"config.{name}: must be a positive integer or None, got {val!r}")


def _version(cfg, choices):
    if cfg.version is not None:
        cv.check_choice(cfg.version, "config.version", choices)


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
        _version(self, FORWARD_VERSIONS)
        _positive(self, ("block_q", "block_k", "num_warps"))

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
            bk = self.block_k or V2_DEFAULT_BLOCK_K[128 if head_dim <= 128 else 256]
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


# =========================================================================== decode
@dataclass(frozen=True)
class DecodeConfig:
    """Which decode kernel, and its settings (``config=`` of decode / paged_decode).

    version: "v1" (decode.cu: plain loads into registers), "v2" (decode_v2.cu: a per-warp
    cp.async ring of K/V tiles in SRAM) or "v3" (decode_v3.cu: v2's ring with the combine
    fused into the split kernel, 8 warps x 4 stages) or "v4" (decode_v4.cu: v3's ring and
    combine with the GQA group's products on the tensor cores, float16/bfloat16, head dims
    multiples of 16 up to 256, g <= 16, compute capability 8.0+); None: the registry's
    default (v4 where it applies, else v3 where its rows and ring fit, else v1).  v2, v3
    and v4 need rows of whole 16-byte chunks, at most 32 of them, 16-byte aligned.
    stages (v2, v3): the ring depth (>= 2; None: DECODE_V2_STAGES, or DECODE_V3_STAGES made
    shallower until the ring fits).  tile_rows (v2, v3): key rows a tile (a multiple of the
    rows a warp reads side by side; None: about DECODE_V2_TILE_BYTES of K; v4: Bc, a
    multiple of 16, None: DECODE_V4_TILE_ROWS).  num_warps (v3, v4): 4 or 8 warps a block
    (None: DECODE_V3_WARPS, DECODE_V4_WARPS).  fused (v3): the combine inside the split
    kernel (True) or decode.cu's separate combine launch (False, v2's structure).
    min_blocks: blocks an SM the registers are capped for (None: DECODE_MIN_BLOCKS for v1,
    DECODE_V2_MIN_BLOCKS at 4 warps, half that at 8; v4: DECODE_V4_MIN_BLOCKS at 4 warps,
    half that at 8).  unroll (v1): rows of K and V each
    sub-group keeps in flight (None: DECODE_UNROLL).  load_bulk (v4): rows loaded by the
    copy engine, one bulk copy a row (True, compute capability 9.0+) or by cp.async 16-byte
    chunks (False); None: DECODE_V4_BULK where the GPU has bulk copies (cp.async by default).
    load_l1 (v4): the cp.async chunks pass through L1 (True, .ca) or bypass it (False, .cg);
    None: DECODE_V4_L1 over a contiguous 16-bit cache on compute capability CC_L1+, .cg over
    pages, quantized codes and bulk copies.
    """

    version: str | None = None
    stages: int | None = None
    tile_rows: int | None = None
    num_warps: int | None = None
    fused: bool = True
    min_blocks: int | None = None
    unroll: int | None = None
    load_bulk: bool | None = None
    load_l1: bool | None = None

    def __post_init__(self):
        _version(self, DECODE_VERSIONS)
        _positive(self, ("stages", "tile_rows", "num_warps", "min_blocks", "unroll"))
        if self.stages is not None and self.stages < MIN_STAGES:
            raise ValueError(f"config.stages: must be at least 2 (one tile used, one in flight), got {self.stages}")
        if self.num_warps not in (None, *DECODE_V3_WARP_CHOICES):
            raise ValueError(f"config.num_warps: must be 4 or 8 (v3), got {self.num_warps}")
        if self.num_warps not in (None, DECODE_WARPS) and self.version not in (None, "v3", "v4"):
            raise ValueError(f"config.num_warps: a v3 / v4 setting; version {self.version!r} runs {DECODE_WARPS}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"config.fused: must be True or False, got {self.fused!r}")
        ring = ("stages", "tile_rows")
        for name in ring:
            if self.version == "v1" and getattr(self, name) is not None:
                raise ValueError(f"config.{name}: a setting of the v2/v3 ring; version 'v1' has none")
        if self.unroll is not None and self.version not in (None, "v1"):
            raise ValueError(f"config.unroll: a v1 setting; version {self.version!r} streams a ring")
        if self.load_bulk is not None:
            if not isinstance(self.load_bulk, bool):
                raise ValueError(f"config.load_bulk: must be True, False or None, got {self.load_bulk!r}")
            if self.version not in (None, "v4"):
                raise ValueError(f"config.load_bulk: a v4 setting; version {self.version!r} loads with cp.async")
        if self.load_l1 is not None:
            if not isinstance(self.load_l1, bool):
                raise ValueError(f"config.load_l1: must be True, False or None, got {self.load_l1!r}")
            if self.version not in (None, "v4"):
                raise ValueError(f"config.load_l1: a v4 setting; version {self.version!r} copies around L1")
            if self.load_l1 and self.load_bulk:
                raise ValueError("config.load_l1: bulk copies (load_bulk=True) do not pass through L1")

    def replace(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)

    # -- v2 / v3: the ring
    def ring_warps(self) -> int:
        """v2's / v3's warps a block (v4's depend on the SRAM: :meth:`_v4_warps`)."""
        return (self.num_warps or DECODE_V3_WARPS) if self.version == "v3" else DECODE_WARPS

    def ring_stages(self, head_dim: int, dtype: str, group: int, smem_limit: int | None = None,
                    kv: str | None = None) -> int:
        """The ring depth: the given one, or the default (v3: made shallower until the ring, the
        fused combine's weights at DECODE_MAX_SPLITS and a full staged block table fit
        ``smem_limit``, down to MIN_STAGES).  ``kv``: a quantized cache's code format."""
        if self.stages is not None:
            return self.stages
        if self.version == "v4":
            return self._v4_stages(head_dim, dtype, group, smem_limit, kv)
        if self.version != "v3":
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
        the GPU's compute capability x 10 (v4's load_bulk default; None: no bulk copies).
        ``pairs``, ``sms``: the batch's (b, kv head) pairs and the GPU's SMs (v4's block size
        default, DECODE_V4_PAIRS_SPLIT_BLOCK; None: 8-warp blocks)."""
        d = head_dim
        if kv is not None and (not paged or self.version == "v2"):
            raise ValueError(f"kv_dtype: a {kv} cache is read by the paged decode of versions v1, v3 and v4, "
                             f"not {'a contiguous cache' if not paged else 'version v2'}")
        base = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=d, GROUP=group, PAGED=int(paged))
        if kv is not None:
            base["KV_QUANT"] = KV_QUANT_IDS[kv]
        if paged:
            base["BLOCK_SIZE"] = block_size
        if self.version == "v4":
            return self._v4_defines(base, d, dtype, group, smem_limit, kv, cc, pairs, sms)
        if self.version in (None, "v1"):
            itemsize = kv_itemsize(dtype, kv)
            load = CHUNK_BYTES if kv is None else QUANT_UNIT_BYTES
            vec = int((d * itemsize) % load == 0 and d * itemsize <= MAX_ROW_CHUNKS * load and aligned)
            return dict(base, VEC_IO=vec, NUM_WARPS=DECODE_WARPS, UNROLL=self.unroll or DECODE_UNROLL,
                        DECODE_MIN_BLOCKS=self.min_blocks or DECODE_MIN_BLOCKS)
        geo = decode_v2_geometry(d, dtype, self.tile_rows, kv)
        if geo is None:
            raise ValueError(f"config.version: {self.version} needs rows of whole 16-byte chunks, at most "
                             f"{MAX_ROW_CHUNKS}; head_dim={d} ({kv or dtype}) is not (use version 'v1')")
        stages = self.ring_stages(d, dtype, group, smem_limit, kv)
        if self.version == "v2":
            return dict(base, NUM_WARPS=DECODE_WARPS, STAGES=stages, TILE_ROWS=geo["tile_rows"],
                        DECODE_MIN_BLOCKS=self.min_blocks or DECODE_V2_MIN_BLOCKS)
        nw = self.ring_warps()
        mb = self.min_blocks or max(1, DECODE_V2_MIN_BLOCKS * DECODE_WARPS // nw)
        return dict(base, NUM_WARPS=nw, STAGES=stages, TILE_ROWS=geo["tile_rows"], DECODE_MIN_BLOCKS=mb,
                    FUSED=int(self.fused))

    # -- v4: the tensor-core decode
    def v4_tile_rows(self, head_dim: int | None = None, kv: str | None = None) -> int:
        """Bc of decode v4: the given tile_rows (a multiple of 16) or DECODE_V4_TILE_ROWS
        (a quantized cache, ``kv``: DECODE_V4_QUANT_TILE_ROWS up to head_dim
        DECODE_V4_QUANT_WIDE_MAX_DIM, else 16)."""
        default = DECODE_V4_TILE_ROWS
        if kv is not None:
            default = DECODE_V4_QUANT_TILE_ROWS if (head_dim or 0) <= DECODE_V4_QUANT_WIDE_MAX_DIM else MMA_ROWS
        rows = self.tile_rows or default
        if rows % MMA_ROWS:
            raise ValueError(f"config.tile_rows: decode v4 takes multiples of {MMA_ROWS} (the k depth of one "
                             f"P V product), got {rows}")
        return rows

    def _v4_fits(self, head_dim, dtype, group, stages, warps, smem_limit, kv=None) -> bool:
        """Whether v4's ring of ``stages`` x ``warps``, the fused combine's weights at
        DECODE_MAX_SPLITS and a full staged block table fit ``smem_limit`` (None: no limit).
        ``kv``: a quantized cache's code format (1-byte rows and their scales)."""
        need = decode_v4_smem(head_dim, dtype, group, stages, self.v4_tile_rows(head_dim, kv), warps,
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

    def v4_load_bulk(self, cc: int | None, kv: str | None = None) -> bool:
        """Whether v4 loads with bulk copies: the given load_bulk (True needs cc >= CC_BULK and
        16-bit rows), or DECODE_V4_BULK where ``cc`` (compute capability x 10; None: unknown)
        has them and the rows are 16-bit (``kv`` None)."""
        if self.load_bulk is None:
            return DECODE_V4_BULK and kv is None and cc is not None and cc >= CC_BULK
        if self.load_bulk and kv is not None:
            raise ValueError(f"config.load_bulk: v4's bulk copies read 16-bit rows; a {kv} cache loads "
                             f"with cp.async (load_bulk=None or False)")
        if self.load_bulk and cc is not None and cc < CC_BULK:
            raise ValueError(f"config.load_bulk: bulk copies (cp.async.bulk) need compute capability "
                             f"{CC_BULK / 10:.1f}; this GPU is {cc / 10:.1f}")
        return self.load_bulk

    def _v4_defines(self, base, d, dtype, group, smem_limit, kv=None, cc=None, pairs=None, sms=None) -> dict:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"config.version: v4 is the float16/bfloat16 tensor-core decode, got {dtype} "
                             f"(use 'v3')")
        if d % MMA_ROWS or d > DECODE_V4_MAX_HEAD_DIM:
            raise ValueError(f"config.version: v4 takes head dims that are multiples of {MMA_ROWS} up to "
                             f"{DECODE_V4_MAX_HEAD_DIM}, got {d} (use 'v3')")
        if group > DECODE_V4_MAX_GROUP:
            raise ValueError(f"config.version: v4 packs at most {DECODE_V4_MAX_GROUP} query heads a KV head "
                             f"(one mma row block), got {group} (use 'v3')")
        if kv is not None and d not in DECODE_V4_QUANT_HEAD_DIMS:
            raise ValueError(f"config.version: v4 reads {kv} codes at head dims "
                             f"{', '.join(map(str, DECODE_V4_QUANT_HEAD_DIMS))}, got {d} (use 'v3')")
        nw = self._v4_warps(d, dtype, group, smem_limit, kv)
        bulk = self.v4_load_bulk(cc, kv)
        stages = self.ring_stages(d, dtype, group, smem_limit, kv)
        l1 = self.v4_load_l1(bool(base["PAGED"]), kv, bulk, d, nw, stages, cc)
        if (l1 and self.num_warps is None and nw == DECODE_V4_WARPS and pairs is not None and sms
                and pairs >= DECODE_V4_PAIRS_SPLIT_BLOCK * sms):
            nw = DECODE_V4_SMALL_WARPS                       # two blocks an SM (DECODE_V4_PAIRS_SPLIT_BLOCK)
        # the registers a thread may use: those of 8 warps x 1 block an SM
        mb = self.min_blocks or max(1, DECODE_V4_MIN_BLOCKS * DECODE_V4_WARPS // nw)
        return dict(base, NUM_WARPS=nw, STAGES=stages, TILE_ROWS=self.v4_tile_rows(d, kv), DECODE_MIN_BLOCKS=mb,
                    FUSED=int(self.fused), LOAD_BULK=int(bulk), LOAD_L1=int(l1))

    def v4_load_l1(self, paged: bool, kv: str | None = None, bulk: bool = False, head_dim: int = 128,
                   warps: int = DECODE_V4_WARPS, stages: int = DECODE_V4_STAGES, cc: int | None = None) -> bool:
        """Whether v4's cp.async chunks pass through L1: the given load_l1 (__post_init__ refuses
        it with load_bulk=True), or DECODE_V4_L1 on compute capability ``cc`` >= CC_L1 over a contiguous 16-bit
        cache loaded by cp.async whose rows are 2^k 16-byte chunks (at most 32) and whose ring
        of ``warps`` x ``stages`` takes at most DECODE_V4_L1_MAX_RING bytes."""
        if self.load_l1 is None:
            chunks = head_dim * 2 // CHUNK_BYTES
            ring = decode_v4_smem(head_dim, "float16", 1, stages, self.v4_tile_rows(head_dim), warps,
                                  swizzled=True)[0]        # what the launcher allocates
            return (DECODE_V4_L1 and cc is not None and cc >= CC_L1 and not paged and kv is None and not bulk
                    and 32 % chunks == 0 and ring <= DECODE_V4_L1_MAX_RING)
        return self.load_l1

    def combine_defines(self, head_dim: int, dtype: str, group: int, paged: bool, block_size: int,
                        aligned: bool = True) -> dict:
        """decode.cu's defines, for its combine kernel (every version's two-launch path)."""
        v1 = self if self.version == "v1" else DecodeConfig("v1")
        return v1.defines(head_dim, dtype, group, paged, block_size, aligned=aligned)


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


def decode_v4_swizzled(head_dim: int, bulk: bool = False) -> bool:
    """decode_v4.cu's SWIZZLE default for 16-bit rows: rows of whole 128-byte halves (d a
    multiple of 64) loaded in 16-byte chunks are stored unpadded with the XOR swizzle."""
    return head_dim % 64 == 0 and not bulk


def decode_v4_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0, kv: str | None = None,
                   swizzled: bool = False) -> tuple:
    """decode_v4.cu's dynamic SRAM a block, as (total bytes, byte offset of the block table):
    max(the rings, the warps' float32 merge buffer, the fused combine's weights), then
    ``table_cap`` int32 block-table entries (paged).  16-bit rows are counted padded by
    V4_ROW_PAD_BYTES (what bulk copies and rows that are not whole 128-byte halves take: an
    upper bound for every layout), or exactly when ``swizzled`` (:func:`decode_v4_swizzled`;
    the launcher allocates that, so the L1 beside it keeps what the ring does not use).
    ``kv``: a quantized cache's code format: its rows are head_dim bytes, unpadded (their
    chunks are swizzled), and each stage also holds its rows' float32 s_K and s_V."""
    if kv is None:
        pad = 0 if swizzled else V4_ROW_PAD_BYTES
        stage = 2 * tile_rows * (head_dim * cv.itemsize_of(dtype) + pad)
    else:
        stage = 2 * tile_rows * (head_dim * kv_itemsize(dtype, kv) + V4_SCALE_BYTES)
    ring = num_warps * stages * stage
    merge = num_warps * group * head_dim * 4
    weights = group * num_splits * 4 if fused and num_splits > 1 else 0
    offset = round_up(max(ring, merge, weights), 16)
    return offset + 4 * table_cap, offset


#: the dynamic SRAM function of each ring version with a fused combine (v3, v4)
RING_SMEM = {"v3": decode_v3_smem, "v4": decode_v4_smem}


def ring_smem_bound(version: str, head_dim: int, dtype: str, group: int, num_warps: int | None = None,
                    stages: int = MIN_STAGES, kv: str | None = None) -> int:
    """The most dynamic SRAM a v2 / v3 call at ``stages`` can ask for: the ring (or merge),
    plus, for v3, the fused combine's weights at DECODE_MAX_SPLITS and a full staged block
    table.  A registry check compares it with the GPU's limit.  ``kv``: a quantized cache's
    code format (its rows are d bytes)."""
    if version == "v4":
        return decode_v4_smem(head_dim, dtype, group, stages, DecodeConfig("v4").v4_tile_rows(head_dim, kv),
                              num_warps or DECODE_V4_SMALL_WARPS,
                              DECODE_MAX_SPLITS, True, DECODE_V3_TABLE_CAP, kv)[0]
    rows = decode_v2_geometry(head_dim, dtype, None, kv)["tile_rows"]
    if version == "v2":
        return decode_v2_smem(head_dim, dtype, group, stages, rows)
    return decode_v3_smem(head_dim, dtype, group, stages, rows, num_warps or DECODE_V3_WARPS,
                          DECODE_MAX_SPLITS, True, DECODE_V3_TABLE_CAP, kv)[0]


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
        _version(self, ("v1",))
        _positive(self, ("threads", "blocks_per_sm"))
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
        _version(self, BACKWARD_VERSIONS)
        _positive(self, ("block_q", "block_k", "lanes_per_key", "num_warps"))
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
        bq, bk = self.block_q or BWD_DEFAULT_BLOCK_Q, self.block_k or BWD_DEFAULT_BLOCK_K
        while self.smem_bytes(bq, bk, head_dim, dtype) > STATIC_SMEM_BYTES:
            if self.block_q is None and bq > 8:
                bq //= 2
            elif self.block_k is None and bk > 8:
                bk //= 2
            else:
                raise ValueError(f"config: Br={bq}, Bc={bk} at head_dim={head_dim} ({dtype}) need "
                                 f"{self.smem_bytes(bq, bk, head_dim, dtype):,} B of SRAM, more than the "
                                 f"{STATIC_SMEM_BYTES:,} B a block may declare")
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
        _version(self, MLA_VERSIONS)
        _positive(self, ("min_keys_per_split",))

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
