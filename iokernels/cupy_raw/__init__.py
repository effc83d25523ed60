"""Step 5b: the kernels in CUDA C++, compiled at run time and launched through CuPy.

The .cu files beside this module hold the kernels; this module holds their launchers:
argument checks, the tile config (:class:`CupyConfig`), compilation with the config's
``-D`` defines (NVRTC, through ``cupy.RawModule``), the launch, and the conversion of
inputs and outputs.  Read each .cu file next to the NumPy step it implements.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows per thread block, key/value rows per K/V tile (block_q, block_k)
Tr, Tc   ceil(Nq / Br) query tiles (the grid's x), ceil(Nk / Bc) K/V tiles (inner loop)
S, P     S_ij = scale * Q_i K_j^T and P_ij = exp(S_ij - m): registers (v2) or SRAM (v1's P)
m, l     running row max and row sum of the online softmax, in registers
O        output accumulator (float32; float64 for float64 inputs), written once to HBM
LSE      m + log(l), natural log, float32 (float64 for float64 inputs)
SRAM     shared memory; HBM device memory
=======  ===========================================================================

The versions (numbered side by side, simplest first; ``CupyConfig(version=...)``)
-----------------------------------------------------------------------------------
FlashAttention forward:

* **v1** ``fa_v1.cu``: CUDA cores, any dtype (float32 is its job; float64 matches the
  oracle to ~1e-12; float16/bfloat16 load and store 16 bits, compute in float32).  The
  structure of the Numba block-cooperative kernel (numba_cuda v2/v3): a block owns Q_i,
  loads K_j, V_j into SRAM together, ``__syncthreads``, folds the tile into (m, l, O).
  256 threads as a 16 x 16 grid, each owning Br/16 rows x Bc/16 keys of S_ij (register
  tiling, like Numba's v3); Q_i and K_j are stored transposed in SRAM so the inner loop
  reads vectors (float4).
  Measured (H200, float32, B=8 H=16 N=4096 d=128): 17.6 TFLOP/s non-causal = 0.377x SDPA's
  EFFICIENT kernel (46.7) in the same run; causal 16.7 = 0.367x.  Frank note on why: K_j/V_j
  loads are synchronous (the block waits for HBM/L2 every tile, three ``__syncthreads`` a
  tile), and at 112 KB of SRAM only two blocks share an SM, so nothing hides that wait;
  SDPA's fp32 kernel pipelines its loads.  That is what v1b changes.
* **v1b** ``fa_v1b.cu`` (``CupyConfig(version="v1b")``, float32 only; what ``"auto"`` runs
  for float32 on compute capability 8.0+): v1 with every tile in HBM's row layout, copied
  as coalesced 16-byte chunks by ``cp.async``; K_j+1 is copied while O += P V_j runs and
  V_j+1 while S_j+1 = Q K_j+1^T runs, so SRAM holds one K and one V tile (112 KB at
  Br = Bc = 64, d = 128, like v1; 72 KB at Bc = 32) instead of the 179 KB plain double
  buffering would need; XOR-swizzled K and P^T chunks (no bank conflicts without padding);
  each thread owns keys tx, tx+16, ...; exp2 with the scale folded in.
  Measured (same run): 31.4 TFLOP/s = 0.672x EFFICIENT non-causal, 30.5 = 0.672x causal
  (Bc = 32: 0.606x): the loads were the limit of v1, hidden now behind the products.
* **v2** ``fa_v2.cu``: float16 / bfloat16 on the tensor cores with inline-PTX
  ``mma.sync.m16n8k16`` and ``ldmatrix``, FlashAttention-2's structure: each warp owns
  16 query rows, S and P never leave registers, online softmax in registers with exp2,
  K_j / V_j double-buffered with ``cp.async`` (sm_80+; synchronous copies on sm_75, which
  also splits each mma into two m16n8k8), causal/window tile skipping, GQA/MQA, LSE.
  Measured (H200, bfloat16, B=8 H=16 N=4096 d=128, 8 warps x Bc 64): 230 TFLOP/s
  non-causal = 0.640x SDPA FLASH (360) and 218 causal = 0.666x FLASH (327), same run (ratios of times).
  cuDNN's kernel (Hopper wgmma/TMA) reached 680 / 597: the gap to it is the Hopper path
  this file does not take.  4 warps x Bc 64 reached 0.49x in an earlier run: with 4 warps
  the K_j/V_j tile feeds only 64 query rows, so each byte read from SRAM does half the work.
* (v3, a Hopper wgmma/TMA kernel, is not written: the issue makes it optional.)

Decode: Flash-Decoding's split kernel (GQA packed: one block reads a K/V row once for all g
query heads of its group) over a contiguous or a paged cache, and the exact LSE combine;
:func:`num_splits_heuristic` from the SM count and the kernel's occupancy (one full wave).
Three versions (``DecodeConfig(version=...)``), all measured in one run (bf16, GQA 32/8,
d=128, B=1, N=32768, K+V = 134 MB; cuDNN SDPA 0.0503 ms = 2.67 TB/s, FLASH 2.32):

* **v1** ``decode.cu``: each warp walks its keys with plain 16-byte loads, four rows a lane
  in flight and the math in between; 159 registers, three blocks an SM.  0.0705 ms =
  1.90 TB/s = 0.71x cuDNN.  Too few bytes in flight to stream HBM.
* **v2** ``decode_v2.cu``: each warp streams its tiles of K/V rows through a private ring of
  DECODE_V2_STAGES tiles in SRAM with ``cp.async`` (copies in flight hold no registers),
  only ``__syncwarp`` in the key loop; block-table entries loaded a tile ahead; tail rows
  zero-filled by cp.async's src-size form; 127-128 registers, 48 KB SRAM, 4 blocks an SM.
  0.0694 ms = 0.725x: deeper queues alone did not move it.
* **v3** ``decode_v3.cu`` (the default): v2's ring, 8 warps a block x 4 stages (~128 KB of
  SRAM, one block an SM) and the combine fused into the split kernel -- each split block
  writes its partial, ``__threadfence()``, bumps an atomic counter of its (batch, kv head);
  the last block to arrive merges the S partials and resets the counter (one launch
  instead of two; the counters are a per-stream workspace, :func:`_decode_counters`);
  ``fused=False`` keeps the two-kernel structure of the Flash-Decoding paper.  Paged
  splits stage their block-table entries in SRAM once.  **0.0544 ms = 2.47 TB/s = 0.925x
  cuDNN** (float16: 0.95x; at 4 warps x 3 stages, v2's shape, 0.756x): chosen by the
  sweeps in benchmarks/results/sweeps/.  Rows that are not whole 16-byte chunks (or over
  32 of them, or unaligned) run v1 (:func:`decode_version_used`).

Paged decode (the same kernels through a block table, pool (blocks, slots, Hkv, d), 16-row
pages, a shuffled table): v3 0.0702 ms = 0.77x of contiguous v3 (float16 0.82-0.87x across
sizes).  Below the issue's 0.9x.  What it is not (``quick_bench.paged_layout_probe``,
benchmarks/results/sweeps/): not the head-interleaved pool layout (a heads-outer pool,
read through its strides, measured 0.76-0.83x; MQA, with no interleaving, 0.77x), and only
partly the page size (1024-row pages: 0.85x).  What remains is the paged code path itself
(the likely part, not yet profiled with ncu: a table lookup and its address arithmetic for
every tile row before its cp.async, which the contiguous path replaces by one increment).
Paged calls upload lengths and tables in one copy.

Paged gather (``paged_gather.cu``): 16-byte chunks through the block table.  0.302 ms =
3.55 TB/s = 0.85x a device copy of the same bytes (4.18 TB/s) at 131072 tokens.

Every number above: NVIDIA H200, driver 580.159.04, CUDA 13.0, torch 2.11, cupy 14.2,
2026-11-29 12:47 UTC, ``scripts/gpu_all.sh`` (benchmarks/results/h200_2026-11-29.json),
ratios to torch timed in the same run.  compute-sanitizer memcheck, racecheck, synccheck and
initcheck over :func:`sanitize_cases` (52 cases, every version, ragged shapes): 0 errors.

Not done: a Hopper version (wgmma, TMA, warp specialization: optional in the issue).

Inputs and outputs
------------------
CuPy arrays, torch CUDA tensors (float16, bfloat16, float32, float64) and other
``__cuda_array_interface__`` arrays are used in place (DLPack / CAI, no copies) and the
result is the same kind of array; NumPy arrays (and torch CPU tensors) are copied in
and out.  bfloat16 travels as its 16-bit pattern (CuPy has no bfloat16 dtype).  Rows
must have unit stride on head_dim (other strides are fine); otherwise one copy is made.

Nothing here touches a GPU at import time; compiled modules are kept in ``_MODULES``
(keyed by kernel, defines and device), the only state this module holds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core import conventions as cv
from .launch import DTYPE_IDS, KERNEL_DIR, SOURCES, device_info, source  # noqa: F401
from .launch import blocks_per_sm as _blocks_per_sm, cupy as _cupy, function as _function

#: the kernel file (and function) of each CupyConfig version
FA_KERNELS = {"v1": "fa_v1", "v1b": "fa_v1b", "v2": "fa_v2"}
#: what one tensor-core tile is: v2 rows are handled 16 a warp, keys 16 an mma k-step
MMA_ROWS = 16
#: v1's thread grid: 16 x 16 threads; a tile side is 16 x (rows or keys a thread owns)
V1_THREADS_SIDE = 16
#: v2's default: 8 warps (Br = 128) and Bc = 64 was the fastest of {4, 8} x {32, 64} on the
#: H200 at d = 128 (bf16, N = 4096; the module docstring)
V2_DEFAULT_WARPS = 8
#: v2 keeps O for d <= 256 in registers (d / 8 * 4 floats a lane); larger d would spill
V2_MAX_HEAD_DIM = 256
#: decode: 4 warps a block; each sub-group keeps UNROLL rows of K and V in flight; the
#: compiler is asked to fit DECODE_MIN_BLOCKS blocks an SM (__launch_bounds__)
DECODE_WARPS = 4
DECODE_UNROLL = 4
DECODE_MIN_BLOCKS = 3
#: num_splits heuristic: this many full waves of decode blocks over the SMs ...
DECODE_WAVES = 1
#: ... but keep at least this many keys a split (its partial O write is amortized) ...
DECODE_MIN_KEYS_PER_SPLIT = 256
#: ... and at most this many splits (the combine reads them all)
DECODE_MAX_SPLITS = 128
#: decode v2 (decode_v2.cu): each warp's ring holds this many K/V tiles (STAGES - 1 in flight
#: while one is used); 3 x ~4 KB a warp = 48 KB a block at bf16 d=128, so 4 blocks fit an SM
DECODE_V2_STAGES = 3
#: ... and the registers are capped for this many blocks an SM (128 a thread at 4)
DECODE_V2_MIN_BLOCKS = 4
#: ... a tile is about this many bytes of K (and as many of V): 8 rows at bf16 d=128
DECODE_V2_TILE_BYTES = 2048
#: decode v3 (decode_v3.cu): v2's ring with the combine fused into the split kernel, 8 warps
#: a block and a 4-tile ring (~128 KB of SRAM at bf16 d=128: one block an SM, 8 warps with 3
#: tiles each in flight).  Chosen by quick_bench.sweep_decode on the H200 (12:26 UTC, bf16
#: B=1 N=32768 GQA 32/8): 0.0528 ms = 0.92x cuDNN; 4 warps x 3 stages (v2's shape) 0.0657 ms
DECODE_V3_WARPS = 8
DECODE_V3_STAGES = 4
#: ... a paged split's block-table entries are staged in SRAM when there are at most this
#: many (4 KB: 1024 pages of 16 rows = 16384 keys a split); longer splits read them from HBM/L2
DECODE_V3_TABLE_CAP = 1024
#: fa_v1b: registers capped so this many blocks fit an SM (its 112 KB of SRAM allow two)
V1B_MIN_BLOCKS = 2
#: paged gather: threads a block, and blocks per SM the grid-stride loop launches
GATHER_THREADS = 256
GATHER_BLOCKS_PER_SM = 8



# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CupyConfig:
    """Tile sizes of the CuPy FlashAttention kernels, injected as -D defines.

    version: "v1" (CUDA cores), "v1b" (CUDA cores, float32 only, K/V tiles by cp.async),
    "v2" (tensor cores, float16/bfloat16) or "auto": v2 for 16-bit inputs, v1b for float32
    on compute capability 8.0+ (1.8x v1 on the H200), v1 otherwise (float64, sm_75).
    block_q (Br), block_k (Bc): v1 and v1b take 16, 32 or 64 each; v2 takes block_q = 16 *
    num_warps and block_k in 16, 32, 64, 128.  None: the default for the head dim.
    num_warps: v2 only (1, 2, 4, 8): each warp owns 16 query rows.
    """

    version: str = "auto"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        cv.check_choice(self.version, "config.version", ("auto", "v1", "v1b", "v2"))
        for name in ("block_q", "block_k", "num_warps"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"config: {name} must be a positive integer or None, got {val!r}")

    def replace(self, **changes) -> "CupyConfig":
        return replace(self, **changes)

    # -- resolution: concrete sizes for one problem
    def resolve(self, head_dim: int, dtype: str, cc: int | None = None) -> "CupyConfig":
        """The concrete config for (head_dim, dtype) on compute capability ``cc`` (e.g. 90)."""
        version = self.version
        if version == "auto":                            # the fastest measured kernel that applies
            sixteen = dtype in ("float16", "bfloat16")
            async_copies = cc is None or cc >= 80        # cp.async: v1b's whole point
            version = ("v2" if sixteen and head_dim <= V2_MAX_HEAD_DIM
                       else "v1b" if dtype == "float32" and async_copies else "v1")
        if version == "v2":
            if dtype not in ("float16", "bfloat16"):
                raise ValueError(f"config: version 'v2' is the tensor-core kernel for float16/bfloat16, "
                                 f"got dtype {dtype} (use version 'v1')")
            if head_dim > V2_MAX_HEAD_DIM:
                raise ValueError(f"config: version 'v2' supports head_dim <= {V2_MAX_HEAD_DIM}, got {head_dim}")
            nw = self.num_warps or (self.block_q // MMA_ROWS if self.block_q else V2_DEFAULT_WARPS)
            if nw not in (1, 2, 4, 8):
                raise ValueError(f"config: num_warps must be 1, 2, 4 or 8 for v2, got {nw}")
            bq = self.block_q or MMA_ROWS * nw
            if bq != MMA_ROWS * nw:
                raise ValueError(f"config: v2 needs block_q == 16 * num_warps ({MMA_ROWS * nw}), got {bq}")
            bk = self.block_k or (64 if head_dim <= 128 else 32)
            if bk not in (16, 32, 64, 128):
                raise ValueError(f"config: v2 block_k must be 16, 32, 64 or 128, got {bk}")
            return CupyConfig("v2", bq, bk, nw)
        if version == "v1b" and dtype != "float32":
            raise ValueError(f"config: version 'v1b' is the float32 kernel (cp.async copies the stored "
                             f"bytes), got dtype {dtype} (use version 'v1' or 'v2')")
        bq, bk = self.block_q or 64, self.block_k or 64
        for name, val in (("block_q", bq), ("block_k", bk)):
            if val not in (16, 32, 64):
                raise ValueError(f"config: {version} {name} must be 16, 32 or 64, got {val}")
        if self.num_warps not in (None, 8):
            raise ValueError(f"config: {version} always runs 8 warps (16 x 16 threads), got num_warps={self.num_warps}")
        return CupyConfig(version, bq, bk, 8)

    def smem_bytes(self, head_dim: int, dtype: str) -> int:
        """Dynamic shared memory of one block (the config must be resolved)."""
        d = head_dim
        if self.version == "v2":
            srow = _round_up(d, 16) + 8                  # fa_v2.cu: SROW
            return 2 * srow * (self.block_q + 4 * self.block_k)   # Q_i + 2 x (K_j, V_j)
        if self.version == "v1b":                        # fa_v1b.cu: Qs, Ks, Vs, PsT (float32)
            dq, dk, dv = _round_up(d, 4), _round_up(d, 32), _round_up(d, 64)
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
            return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, D_PAD=_round_up(head_dim, 16),
                        NUM_WARPS=self.num_warps, BLOCK_K=self.block_k, VEC_IO=int(head_dim % 8 == 0))
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, RM=self.block_q // V1_THREADS_SIDE,
                   RN=self.block_k // V1_THREADS_SIDE)
        if self.version == "v1b":
            out.update(VEC_IO=int(head_dim % 4 == 0), V1B_MIN_BLOCKS=V1B_MIN_BLOCKS)
        return out

    def threads(self) -> int:
        return 32 * self.num_warps if self.version == "v2" else V1_THREADS_SIDE * V1_THREADS_SIDE


@dataclass(frozen=True)
class DecodeConfig:
    """Which decode kernel, for :func:`decode` / :func:`paged_decode_pools` (``config=``).

    version: "v1" (decode.cu: plain loads into registers), "v2" (decode_v2.cu: a per-warp
    cp.async ring of K/V tiles in SRAM) or "v3" (decode_v3.cu, the default: v2's ring with
    the combine fused into the split kernel, 8 warps x 4 stages).
    v2 and v3 need rows of whole 16-byte chunks, at most 32 of them, 16-byte aligned
    (:func:`decode_version_used` says which kernel a call runs); otherwise v1 runs.
    stages: the ring depth of v2/v3 (>= 2; None: DECODE_V2_STAGES / DECODE_V3_STAGES).  tile_rows: key rows a
    tile (a multiple of the rows a warp reads side by side; None: about DECODE_V2_TILE_BYTES
    of K).  num_warps (v3): 4 or 8 warps a block (None: DECODE_V3_WARPS).  fused (v3): the
    combine inside the split kernel (True, the default) or decode.cu's separate combine
    launch (False, v2's structure).  min_blocks (v2/v3): blocks an SM the registers are
    capped for (None: DECODE_V2_MIN_BLOCKS at 4 warps, half that at 8).
    """

    version: str = "v3"
    stages: int | None = None
    tile_rows: int | None = None
    num_warps: int | None = None
    fused: bool = True
    min_blocks: int | None = None

    def __post_init__(self):
        cv.check_choice(self.version, "config.version", ("v1", "v2", "v3"))
        for name in ("stages", "tile_rows", "num_warps", "min_blocks"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"config: {name} must be a positive integer or None, got {val!r}")
        if self.stages is not None and self.stages < 2:
            raise ValueError(f"config: stages must be at least 2 (one tile used, one in flight), got {self.stages}")
        if self.num_warps not in (None, 4, 8):
            raise ValueError(f"config: num_warps must be 4 or 8 (v3), got {self.num_warps}")
        if self.num_warps not in (None, DECODE_WARPS) and self.version != "v3":
            raise ValueError(f"config: num_warps is a v3 setting; version {self.version!r} runs {DECODE_WARPS}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"config: fused must be True or False, got {self.fused!r}")


def _check_decode_config(config) -> DecodeConfig:
    if config is None:
        return DecodeConfig()
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config: expected a DecodeConfig or None for cupy decode, got {type(config).__name__}")
    return config


def decode_v2_geometry(head_dim: int, dtype: str, tile_rows: int | None = None) -> dict | None:
    """decode_v2.cu's layout for one row shape, or None when v2 cannot take it.

    chunks: 16-byte chunks a row; lanes: lanes a row (a power of two); rows_side_by_side:
    32 / lanes; tile_rows: rows a tile.  Mirrors the kernel's macros (CPR, LANES, RPW, TILE_ROWS).
    """
    row_bytes = head_dim * cv.itemsize_of(dtype)
    if row_bytes % 16 or row_bytes > 32 * 16:
        return None
    cpr = row_bytes // 16
    lanes = 1 << (cpr - 1).bit_length()
    rpw = 32 // lanes
    if tile_rows is None:
        per = DECODE_V2_TILE_BYTES // row_bytes
        tile_rows = rpw if per < rpw else per // rpw * rpw
    elif tile_rows % rpw:
        raise ValueError(f"config: tile_rows must be a multiple of {rpw} at head_dim={head_dim} ({dtype}), "
                         f"got {tile_rows}")
    return dict(chunks=cpr, lanes=lanes, rows_side_by_side=rpw, tile_rows=tile_rows)


def decode_v2_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int) -> int:
    """decode_v2.cu's dynamic SRAM a block: the warps' rings, or the final merge if larger."""
    ring = DECODE_WARPS * stages * 2 * tile_rows * head_dim * cv.itemsize_of(dtype)
    merge = DECODE_WARPS * group * head_dim * cv.accum_dtype(dtype).itemsize
    return max(ring, merge)


def decode_v3_smem(head_dim: int, dtype: str, group: int, stages: int, tile_rows: int, num_warps: int,
                   num_splits: int = 1, fused: bool = True, table_cap: int = 0) -> tuple:
    """decode_v3.cu's dynamic SRAM a block, as (total bytes, byte offset of the block table):
    max(the rings, the warps' merge buffer, the fused combine's weights), then ``table_cap``
    int32 block-table entries (paged)."""
    acc = cv.accum_dtype(dtype).itemsize
    ring = num_warps * stages * 2 * tile_rows * head_dim * cv.itemsize_of(dtype)
    merge = num_warps * group * head_dim * acc
    weights = group * num_splits * acc if fused and num_splits > 1 else 0
    offset = _round_up(max(ring, merge, weights), 16)
    return offset + 4 * table_cap, offset


def decode_version_used(head_dim: int, dtype: str, aligned16: bool, config=None) -> str:
    """The decode kernel a call runs: "v2"/"v3" when asked for and the rows allow it, else "v1"."""
    cfg = _check_decode_config(config)
    if cfg.version in ("v2", "v3") and aligned16 and decode_v2_geometry(head_dim, dtype, cfg.tile_rows) is not None:
        return cfg.version
    return "v1"


def fit_config(config: CupyConfig, head_dim: int, dtype: str, dev: dict) -> CupyConfig:
    """Resolve ``config`` for this GPU.  Sizes left as None shrink until the tiles fit the
    device's shared memory (a T4 has 64 KB a block, an H200 227 KB); sizes given must fit."""
    cfg = config.resolve(head_dim, dtype, dev["cc"])
    if cfg.smem_bytes(head_dim, dtype) > dev["smem_optin"] and config.block_q is None and config.block_k is None:
        for bq, bk in ((64, 32), (32, 32), (32, 16), (16, 16)):
            nw = bq // MMA_ROWS if cfg.version == "v2" else None
            trial = config.replace(version=cfg.version, block_q=bq, block_k=bk, num_warps=nw).resolve(
                head_dim, dtype, dev["cc"])
            if trial.smem_bytes(head_dim, dtype) <= dev["smem_optin"]:
                return trial
    cfg.check_fits(head_dim, dtype, dev["smem_optin"])
    return cfg


def _round_up(x, m):
    return -(-x // m) * m


def _check_config(config) -> CupyConfig:
    if config is None:
        return CupyConfig()
    if not isinstance(config, CupyConfig):
        raise ValueError(f"config: expected a CupyConfig or None for backend 'cupy', got {type(config).__name__}")
    return config


# --------------------------------------------------------------------------- array kinds
class _Dev:
    """A device array as a kernel sees it: pointer, shape, strides in elements.

    Kernels receive the bare pointer (a 64-bit integer argument), which costs far less
    host time a launch than wrapping every torch tensor as a CuPy array.  ``keep`` holds
    whatever owns the memory, so it outlives the launch.
    """

    __slots__ = ("ptr", "shape", "strides", "itemsize", "keep")

    def __init__(self, ptr, shape, strides, itemsize, keep):
        self.ptr, self.shape, self.strides, self.itemsize, self.keep = int(ptr), tuple(shape), tuple(strides), itemsize, keep

    @classmethod
    def of(cls, a):
        """From a CuPy array, a torch CUDA tensor, or a _Dev."""
        if isinstance(a, cls):
            return a
        if hasattr(a, "data_ptr"):
            return cls(a.data_ptr(), a.shape, a.stride(), a.element_size(), a)
        return cls(a.data.ptr, a.shape, [st // a.itemsize for st in a.strides], a.itemsize, a)

    @property
    def arg(self):
        return np.uint64(self.ptr)

    def aligned16(self) -> bool:
        return self.ptr % 16 == 0 and all((st * self.itemsize) % 16 == 0 for st in self.strides[:-1])


class _IO:
    """Converts the caller's arrays to device views (no copy for device arrays) and back."""

    def __init__(self, like, name="q"):
        self.kind = _kind(like, name)
        self.like = like
        self.cupy = _cupy()

    def dev(self, x, name) -> "_Dev":
        """A device view of ``x`` (no copy for device arrays), unit stride on the last axis."""
        cp = self.cupy
        kind = _kind(x, name)
        if kind != self.kind:
            raise ValueError(f"{name}: all arrays must be of one kind; got {kind} and {self.kind}")
        dt = cv.dtype_name(x)
        if kind == "torch":
            import torch
            t = x.detach()
            if t.is_cuda:
                if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
                    t = t.contiguous()
                return _Dev.of(t)
            t = t.contiguous()
            a = cp.asarray(t.view(torch.int16).numpy().view(np.uint16) if dt == "bfloat16" else t.numpy())
        elif kind == "numpy":
            a = np.asarray(x)
            a = cp.asarray(a.view(np.uint16) if dt == "bfloat16" else a)
        else:
            a = cp.asarray(x)
        if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
            a = cp.ascontiguousarray(a)
        return _Dev.of(a)

    def empty(self, shape, dtype):
        """(what the caller gets, a device view to write into)."""
        if self.kind == "torch" and self.like.is_cuda:
            import torch
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.like.device)
            return t, _Dev.of(t)
        a = self.cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else dtype)
        return a, _Dev.of(a)

    def finish(self, out, dtype):
        if self.kind == "cupy":
            return out
        if self.kind == "torch":
            if self.like.is_cuda:
                return out
            import torch
            h = out.get()
            return torch.from_numpy(h.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(h)
        if self.kind == "numpy":
            h = out.get()
            if dtype == "bfloat16":
                from ..core.testing import numpy_dtype
                h = h.view(numpy_dtype("bfloat16"))
            return h
        if self.kind == "numba":
            from numba import cuda
            return cuda.as_cuda_array(out)
        return out

    def stream(self):
        """torch's current stream when the arrays are torch's (so the order with torch holds)."""
        if self.kind == "torch" and self.like.is_cuda:
            import torch
            ptr = torch.cuda.current_stream(self.like.device).cuda_stream
            if ptr:
                return self.cupy.cuda.ExternalStream(ptr)
        return _NullContext()


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _kind(x, name):
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if mod == "numba" and hasattr(x, "__cuda_array_interface__"):
        return "numba"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    raise ValueError(f"{name}: expected a NumPy, CuPy, torch or CUDA-array-interface array, got {type(x).__name__}")


def _aligned16(*arrays) -> bool:
    """Every row start 16-byte aligned (base pointer and strides): the vector paths' condition."""
    return all(_Dev.of(a).aligned16() for a in arrays)


# --------------------------------------------------------------------------- attention
def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """FlashAttention forward on the GPU: (O, LSE).  ``config``: a :class:`CupyConfig`."""
    info = cv.check_qkv(q, k, v)
    dtype, d = info["dtype"], info["head_dim"]
    scale = cv.resolve_scale(scale, d)
    left, right = cv.effective_window(bool(causal), window)
    cfg = _check_config(config)
    cfg.resolve(d, dtype)                                # config errors before any GPU work
    dev = device_info()
    if dtype == "bfloat16" and dev["cc"] < 80:
        raise ValueError(f"q: bfloat16 needs compute capability 8.0 or newer; this GPU is {dev['cc'] / 10:.1f}")
    cfg = fit_config(cfg, d, dtype, dev)
    io = _IO(q)
    B, Hq, Nq = info["batch"], info["heads_q"], info["seqlen_q"]
    Hkv, Nk = info["heads_kv"], info["seqlen_k"]
    acc = cv.accum_dtype(dtype)
    with io.stream():
        qd, kd, vd = io.dev(q, "q"), io.dev(k, "k"), io.dev(v, "v")
        o_user, o = io.empty((B, Hq, Nq, d), dtype)
        lse_user, lse = io.empty((B, Hq, Nq), acc.name)
        launch_attention(qd, kd, vd, o, lse, dtype=dtype, scale=scale, window=(left, right), config=cfg)
    return io.finish(o_user, dtype), io.finish(lse_user, acc.name)


def launch_attention(qd, kd, vd, o, lse, *, dtype, scale, window, config):
    """Launch v1, v1b or v2 on device arrays (CuPy, torch or _Dev; o, lse preallocated: tests
    poison them first).  O and LSE must be contiguous."""
    qd, kd, vd, o, lse = (_Dev.of(a) for a in (qd, kd, vd, o, lse))
    B, Hq, Nq, d = qd.shape
    Hkv, Nk = kd.shape[1], kd.shape[2]
    if B * Hq * Nq == 0:
        return
    cfg = config
    defines = cfg.defines(d, dtype)
    if cfg.version in ("v2", "v1b") and not _aligned16(qd, kd, vd):
        defines["VEC_IO"] = 0                            # rows not 16-byte aligned: element copies
    smem = cfg.smem_bytes(d, dtype)
    name = FA_KERNELS[cfg.version]
    fn = _function(name, name, defines, smem)
    acc_t = np.float64 if dtype == "float64" else np.float32
    i32, i64 = np.int32, np.int64
    args = (qd.arg, kd.arg, vd.arg, o.arg, lse.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            *map(i64, qd.strides[:3]), *map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]),
            acc_t(scale), i32(window[0]), i32(window[1]))
    grid = (-(-Nq // cfg.block_q), Hq, B)
    fn(grid, (cfg.threads(),), args, shared_mem=smem)


# --------------------------------------------------------------------------- decode
def num_splits_heuristic(batch: int, heads_kv: int, seq_len: int, num_sms: int,
                         blocks_per_sm: int = 4) -> int:
    """Splits of the key axis so one wave of decode blocks fills the GPU.

    There are batch * heads_kv * splits blocks, ``blocks_per_sm`` fit on an SM at once
    (the launcher asks the driver for its kernel's occupancy): a whole number of waves
    wastes nothing, and with DECODE_WAVES = 1 a sequence's keys are read in one wave.
    Each split keeps at least DECODE_MIN_KEYS_PER_SPLIT keys; at most DECODE_MAX_SPLITS.
    """
    if seq_len <= 0:
        return 1
    slots = DECODE_WAVES * num_sms * max(1, blocks_per_sm)
    want = max(1, slots // max(1, batch * heads_kv))
    cap = max(1, seq_len // DECODE_MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, cap, DECODE_MAX_SPLITS)))


def _decode_defines(d, dtype, group, paged, block_size, vec_ok, unroll=None, min_blocks=None):
    itemsize = cv.itemsize_of(dtype)
    vec = int((d * itemsize) % 16 == 0 and d * itemsize <= 512 and vec_ok)
    out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=d, GROUP=group, PAGED=int(paged), VEC_IO=vec,
               NUM_WARPS=DECODE_WARPS, UNROLL=unroll or DECODE_UNROLL,
               DECODE_MIN_BLOCKS=min_blocks or DECODE_MIN_BLOCKS)
    if paged:
        out["BLOCK_SIZE"] = block_size
    return out


def _decode_v2_defines(d, dtype, group, paged, block_size, config, min_blocks=None):
    """(defines, dynamic SRAM bytes) of decode_v2.cu for one call (the rows must allow v2)."""
    geo = decode_v2_geometry(d, dtype, config.tile_rows)
    stages = config.stages or DECODE_V2_STAGES
    out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=d, GROUP=group, PAGED=int(paged), NUM_WARPS=DECODE_WARPS,
               STAGES=stages, TILE_ROWS=geo["tile_rows"], DECODE_MIN_BLOCKS=min_blocks or DECODE_V2_MIN_BLOCKS)
    if paged:
        out["BLOCK_SIZE"] = block_size
    return out, decode_v2_smem(d, dtype, group, stages, geo["tile_rows"])


def _decode_v3_defines(d, dtype, group, paged, block_size, config, min_blocks=None):
    """decode_v3.cu's defines for one call (the rows must allow it; SRAM: decode_v3_smem)."""
    geo = decode_v2_geometry(d, dtype, config.tile_rows)
    nw = config.num_warps or DECODE_V3_WARPS
    mb = min_blocks or config.min_blocks or max(1, DECODE_V2_MIN_BLOCKS * DECODE_WARPS // nw)
    out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=d, GROUP=group, PAGED=int(paged), NUM_WARPS=nw,
               STAGES=config.stages or DECODE_V3_STAGES, TILE_ROWS=geo["tile_rows"], DECODE_MIN_BLOCKS=mb,
               FUSED=int(config.fused))
    if paged:
        out["BLOCK_SIZE"] = block_size
    return out


#: decode v3's fused-combine counters: one int32 workspace per (device, stream), zero between
#: calls (the last block of each group sets its counter back to 0).  Keyed by stream so two
#: streams never share counts; the only state here besides the compiled modules.
_DECODE_COUNTERS: dict = {}


def _decode_counters(n: int):
    """At least ``n`` zeroed int32 counters for decode v3 on the current device and stream."""
    cp = _cupy()
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    buf = _DECODE_COUNTERS.get(key)
    if buf is None or buf.size < n:
        buf = cp.zeros(max(n, 1024), dtype=np.int32)     # zeroed once, on this stream
        _DECODE_COUNTERS[key] = buf
    return buf


def _check_decode_q(q, heads_kv, d, dtype):
    s = tuple(getattr(q, "shape", ()))
    if len(s) != 3 or s[2] != d or s[1] % heads_kv:
        raise ValueError(f"q: expected (batch, a multiple of {heads_kv} heads, {d}), got {s}")
    if cv.dtype_name(q) != dtype:
        raise ValueError(f"q: dtype must equal the cache's {dtype}, got {cv.dtype_name(q)}")


def _contiguous(x):
    """q of decode must be contiguous (it is small: one token a sequence); copy when not."""
    if hasattr(x, "is_contiguous"):
        return x if x.is_contiguous() else x.contiguous()
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.ascontiguousarray(x)
    return x


def _check_bf16(dtype, dev):
    if dtype == "bfloat16" and dev["cc"] < 80:
        raise ValueError(f"q: bfloat16 needs compute capability 8.0 or newer; this GPU is {dev['cc'] / 10:.1f}")


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """Flash-Decoding over a contiguous cache: q (B, Hq, d), k, v (B, Hkv, N, d) -> (O, LSE).

    ``config``: a :class:`DecodeConfig` (None: version v1, decode.cu)."""
    config = _check_decode_config(config)
    ks = tuple(k.shape)
    if len(ks) != 4:
        raise ValueError(f"k: expected (batch, heads_kv, seq, head_dim), got {ks}")
    B, Hkv, N, d = ks
    dtype = cv.check_dtype(k, "k")
    _check_decode_q(q, Hkv, d, dtype)
    if tuple(v.shape) != ks or cv.dtype_name(v) != dtype:
        raise ValueError(f"v: expected shape {ks} and dtype {dtype}, got {tuple(v.shape)} {cv.dtype_name(v)}")
    if q.shape[0] != B:
        raise ValueError(f"q: batch must equal k's {B}, got {q.shape[0]}")
    lens = None
    if seq_lens is not None:
        lens = np.asarray(seq_lens.get() if hasattr(seq_lens, "get") else seq_lens).astype(np.int64)
        if lens.shape != (B,) or np.any(lens < 0) or np.any(lens > N):
            raise ValueError(f"seq_lens: expected {B} lengths in [0, {N}], got {lens.tolist()}")
    scale = cv.resolve_scale(scale, d)
    dev = device_info()
    _check_bf16(dtype, dev)
    io = _IO(q)
    with io.stream():
        qd, kd, vd = io.dev(_contiguous(q), "q"), io.dev(k, "k"), io.dev(v, "v")
        lens_d = None if lens is None else io.cupy.asarray(lens.astype(np.int32))
        longest = N if lens is None else int(lens.max(initial=0))
        o_user, o, lse_user, lse = _decode_outputs(io, q.shape, dtype)
        launch_decode(qd, kd, vd, lens_d, o, lse, dtype=dtype, scale=scale, num_splits=num_splits,
                      longest=longest, nk=N, config=config)
    acc = cv.accum_dtype(dtype).name
    return io.finish(o_user, dtype), io.finish(lse_user, acc)


def _decode_outputs(io, qshape, dtype):
    B, Hq, d = qshape
    o_user, o = io.empty((B, Hq, d), dtype)
    lse_user, lse = io.empty((B, Hq), cv.accum_dtype(dtype).name)
    return o_user, o, lse_user, lse


def launch_decode(qd, kd, vd, lens_d, o, lse, *, dtype, scale, num_splits=None, paged=None,
                  longest=None, nk=None, unroll=None, min_blocks=None, config=None):
    """Split kernel (+ combine when num_splits > 1) on device arrays.

    ``lens_d``: int32 device lengths (B,), or None when every sequence uses all ``nk`` keys.
    ``paged``: None for a contiguous cache, else (block_tables int32 device array (B, max_blocks),
    block_size): then kd, vd are the pools (num_blocks, block_size, Hkv, d).
    ``num_splits`` None: :func:`num_splits_heuristic` for ``longest`` keys.
    ``config``: a :class:`DecodeConfig`; version v2 runs decode_v2.cu when the rows allow it
    (:func:`decode_version_used`), v1 otherwise.  ``unroll`` / ``min_blocks`` tune v1 only
    (v2: ``min_blocks`` overrides DECODE_V2_MIN_BLOCKS).
    """
    cp = _cupy()
    qd, kd, vd, o, lse = (_Dev.of(a) for a in (qd, kd, vd, o, lse))
    B, Hq, d = qd.shape
    Hkv = kd.shape[2] if paged is not None else kd.shape[1]
    nk = int(nk if nk is not None else (kd.shape[2] if paged is None else 0))
    if B * Hq == 0:
        return
    if qd.strides != (Hq * d, d, 1):
        raise ValueError("q: decode needs a contiguous (batch, heads_q, head_dim) q")
    acc = np.float64 if dtype == "float64" else np.float32
    block_size = paged[1] if paged is not None else 0
    aligned = _aligned16(qd, kd, vd)
    defines = _decode_defines(d, dtype, Hq // Hkv, paged is not None, block_size, aligned, unroll, min_blocks)
    cfg = _check_decode_config(config)
    smem = 0
    used = decode_version_used(d, dtype, aligned, cfg)
    threads = 32 * DECODE_WARPS
    if used == "v3":
        return _launch_decode_v3(qd, kd, vd, lens_d, o, lse, dtype=dtype, scale=scale, num_splits=num_splits,
                                 paged=paged, longest=longest, nk=nk, config=cfg, min_blocks=min_blocks,
                                 combine_defines=defines)
    if used == "v2":
        v2, smem = _decode_v2_defines(d, dtype, Hq // Hkv, paged is not None, block_size, cfg, min_blocks)
        fn = _function("decode_v2", "decode_split_v2", v2, smem)
    else:
        fn = _function("decode", "decode_split", defines)
    if num_splits is None:
        num_splits = num_splits_heuristic(B, Hkv, nk if longest is None else longest, device_info()["sms"],
                                          _blocks_per_sm(fn, threads, smem))
    S = int(num_splits)
    i32, i64 = np.int32, np.int64
    if S > 1:
        o_part = cp.empty((S, B, Hq, d), dtype=acc)
        lse_part = cp.empty((S, B, Hq), dtype=acc)
        parts = (o_part, lse_part)
    else:
        parts = (np.uint64(0), np.uint64(0))           # unused by the kernel when S == 1
    if paged is None:
        layout = (*map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]))
    else:
        tables = paged[0]
        layout = (tables, i32(tables.shape[1]), *map(i64, kd.strides[:3]))
    lens_arg = lens_d if lens_d is not None else np.uint64(0)
    args = (qd.arg, kd.arg, vd.arg, *layout, lens_arg, i32(nk), i32(Hq), i32(Hkv), acc(scale), i32(S),
            *parts, o.arg, lse.arg)
    fn((S, Hkv, B), (threads,), args, shared_mem=smem)
    if S > 1:                                          # both versions: decode.cu's combine
        comb = _function("decode", "decode_combine", defines)
        comb((B * Hq,), (min(256, _round_up(d, 32)),), (o_part, lse_part, i32(S), i32(B * Hq), o.arg, lse.arg))


def _launch_decode_v3(qd, kd, vd, lens_d, o, lse, *, dtype, scale, num_splits, paged, longest, nk, config,
                      min_blocks, combine_defines):
    """decode_v3.cu on device arrays (launch_decode's arguments, already converted).

    Fused (the default): one launch; the last split block of each (batch, kv head) merges.
    Unfused: the split kernel, then decode.cu's combine (v2's two launches).
    The dynamic SRAM depends on num_splits (the combine's weights) and, paged, on the table
    entries a split needs; the compiled kernel does not (both are launch arguments).
    """
    cp = _cupy()
    B, Hq, d = qd.shape
    Hkv = kd.shape[2] if paged is not None else kd.shape[1]
    group = Hq // Hkv
    block_size = paged[1] if paged is not None else 0
    dev = device_info()
    if config.stages is None:          # the default ring: DECODE_V3_STAGES deep, shallower where
        rows = decode_v2_geometry(d, dtype, config.tile_rows)["tile_rows"]   # the tiles are bigger
        nw = config.num_warps or DECODE_V3_WARPS                            # (float32/64, tile_rows)
        fits = [st for st in range(DECODE_V3_STAGES, 1, -1)
                if decode_v3_smem(d, dtype, group, st, rows, nw)[0] <= dev["smem_optin"]]
        config = replace(config, stages=fits[0] if fits else 2)
    defines = _decode_v3_defines(d, dtype, group, paged is not None, block_size, config, min_blocks)
    nw, stages, tile_rows = defines["NUM_WARPS"], defines["STAGES"], defines["TILE_ROWS"]
    fused = bool(defines["FUSED"])
    longest = nk if longest is None else longest
    # the kernel is compiled once per defines; its SRAM is sized a launch (at least the rings)
    base_smem, _ = decode_v3_smem(d, dtype, group, stages, tile_rows, nw)
    if base_smem > dev["smem_optin"]:
        raise ValueError(f"config: decode v3 with {nw} warps x {stages} stages x {tile_rows} rows needs "
                         f"{base_smem:,} B of shared memory a block at head_dim={d} ({dtype}), more than this "
                         f"GPU's {dev['smem_optin']:,} (fewer stages, warps or tile rows)")
    fn = _function("decode_v3", "decode_split_v3", defines, max(base_smem, 48 * 1024))
    threads = 32 * nw
    if num_splits is None:
        num_splits = num_splits_heuristic(B, Hkv, longest, dev["sms"], _blocks_per_sm(fn, threads, base_smem))
    S = int(num_splits)
    table_cap = 0
    if paged is not None:
        per_split = -(-max(longest, 1) // S)
        need = -(-per_split // block_size) + 1            # a split may straddle one more page
        table_cap = need if need <= DECODE_V3_TABLE_CAP else 0
    smem, table_offset = decode_v3_smem(d, dtype, group, stages, tile_rows, nw, S, fused, table_cap)
    if smem > dev["smem_optin"]:
        raise ValueError(f"config: decode v3 needs {smem:,} B of shared memory a block, more than this GPU's "
                         f"{dev['smem_optin']:,} (fewer stages, smaller tiles or more splits)")
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = int(smem)
    acc = np.float64 if dtype == "float64" else np.float32
    i32, i64 = np.int32, np.int64
    if S > 1:
        o_part = cp.empty((S, B, Hq, d), dtype=acc)
        lse_part = cp.empty((S, B, Hq), dtype=acc)
        parts = (o_part, lse_part)
    else:
        parts = (np.uint64(0), np.uint64(0))
    counters = _decode_counters(B * Hkv) if fused and S > 1 else np.uint64(0)
    if paged is None:
        layout = (*map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]))
    else:
        tables = paged[0]
        layout = (tables, i32(tables.shape[1]), *map(i64, kd.strides[:3]), i32(table_cap), i32(table_offset))
    lens_arg = lens_d if lens_d is not None else np.uint64(0)
    args = (qd.arg, kd.arg, vd.arg, *layout, lens_arg, i32(nk), i32(Hq), i32(Hkv), acc(scale), i32(S),
            *parts, counters, o.arg, lse.arg)
    fn((S, Hkv, B), (threads,), args, shared_mem=smem)
    if S > 1 and not fused:
        comb = _function("decode", "decode_combine", combine_defines)
        comb((B * Hq,), (min(256, _round_up(d, 32)),), (o_part, lse_part, i32(S), i32(B * Hq), o.arg, lse.arg))


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None):
    """Decode over a PagedKVCache.  Its pools are NumPy arrays: they are copied to the device
    on every call (use :func:`paged_decode_pools` with device pools to time the kernel)."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    return paged_decode_pools(q, cache.k_pool, cache.v_pool, tables, lens, num_splits=num_splits, scale=scale,
                              config=config)


def _check_tables(tables, lens, num_blocks, block_size, name="block_tables"):
    """Every block a sequence uses is a real block of the pool (vectorized: tables can be long)."""
    need = -(-lens // block_size)
    cols = np.arange(tables.shape[1])[None, :]
    used = cols < need[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{name}: sequence {b}, entry {j} is block {int(tables[b, j])}, outside [0, {num_blocks})")


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None,
                       config=None):
    """Decode over paged pools (num_blocks, block_size, Hkv, d) with int32 block tables (B, max_blocks).

    Pools on the device (CuPy, torch CUDA) are used in place; NumPy pools are copied in.
    ``config``: a :class:`DecodeConfig` (None: version v1).
    """
    config = _check_decode_config(config)
    ps = tuple(getattr(k_pool, "shape", ()))
    if len(ps) != 4:
        raise ValueError(f"k_pool: expected (num_blocks, block_size, heads_kv, head_dim), got {ps}")
    nb, bs, Hkv, d = ps
    dtype = cv.check_dtype(k_pool, "k_pool")
    if tuple(v_pool.shape) != ps or cv.dtype_name(v_pool) != dtype:
        raise ValueError(f"v_pool: expected shape {ps} and dtype {dtype}")
    _check_decode_q(q, Hkv, d, dtype)
    B = q.shape[0]
    tables = np.asarray(block_tables.get() if hasattr(block_tables, "get") else block_tables)
    lens = np.asarray(seq_lens.get() if hasattr(seq_lens, "get") else seq_lens).astype(np.int64)
    if tables.ndim != 2 or tables.shape[0] != B:
        raise ValueError(f"block_tables: expected ({B}, max_blocks), got {tables.shape}")
    if lens.shape != (B,) or np.any(lens < 0) or np.any(lens > tables.shape[1] * bs):
        raise ValueError(f"seq_lens: expected {B} lengths in [0, {tables.shape[1] * bs}], got {lens.tolist()}")
    _check_tables(tables, lens, nb, bs)
    scale = cv.resolve_scale(scale, d)
    dev = device_info()
    _check_bf16(dtype, dev)
    io = _IO(q)
    with io.stream():
        qd = io.dev(_contiguous(q), "q")
        kp, vp = _pool_dev(io, k_pool, strided=True), _pool_dev(io, v_pool, strided=True)
        # lengths and tables travel in one host -> device copy (each copy is a few us on the
        # GPU's timeline, inside the call's time): lens_d = packed[:B], the tables after it
        packed = io.cupy.asarray(np.concatenate([lens.astype(np.int32), tables.astype(np.int32).ravel()]))
        lens_d, t_d = packed[:B], packed[B:].reshape(tables.shape)
        o_user, o, lse_user, lse = _decode_outputs(io, q.shape, dtype)
        launch_decode(qd, kp, vp, lens_d, o, lse, dtype=dtype, scale=scale, num_splits=num_splits,
                      paged=(t_d, bs), longest=int(lens.max(initial=0)), nk=0, config=config)
    return io.finish(o_user, dtype), io.finish(lse_user, cv.accum_dtype(dtype).name)


def _pool_dev(io, pool, strided=False) -> "_Dev":
    """A pool as the kernels see it: device pools in place, NumPy pools copied in.
    ``strided`` (the decode kernels, which take the block, slot and head strides): any
    strides with unit-stride rows stay as they are (e.g. a pool stored heads-outer, (blocks,
    Hkv, slots, d), passed as its (blocks, slots, Hkv, d) view); otherwise (the gather) and
    for rows with another stride on head_dim, one contiguous copy."""
    cp = io.cupy
    dt = cv.dtype_name(pool)
    if isinstance(pool, np.ndarray):
        return _Dev.of(cp.asarray(np.ascontiguousarray(pool.view(np.uint16) if dt == "bfloat16" else pool)))
    if type(pool).__module__.split(".")[0] == "torch":
        t = pool.detach()
        t = t if t.is_cuda else t.cuda()
        return _Dev.of(t if strided and t.stride(-1) == 1 else t.contiguous())
    a = cp.asarray(pool)
    return _Dev.of(a if strided and a.strides[-1] == a.itemsize else cp.ascontiguousarray(a))


# --------------------------------------------------------------------------- paged gather
def gather_pools(k_pool, v_pool, block_table, seq_len):
    """Paged gather: pools (num_blocks, bs, Hkv, d) + a block table -> contiguous (Hkv, n, d) K, V.

    Device pools (CuPy / torch CUDA) give device outputs of the same kind, with no copy of
    the pools; NumPy pools are copied in and the result copied out.
    """
    ps = tuple(getattr(k_pool, "shape", ()))
    if len(ps) != 4:
        raise ValueError(f"k_pool: expected (num_blocks, block_size, heads_kv, head_dim), got {ps}")
    if tuple(getattr(v_pool, "shape", ())) != ps or cv.dtype_name(v_pool) != cv.dtype_name(k_pool):
        raise ValueError(f"v_pool: must match k_pool's shape {ps} and dtype {cv.dtype_name(k_pool)}")
    nb, bs, hkv, d = ps
    dtype = cv.check_dtype(k_pool, "k_pool")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
        raise ValueError(f"seq_len: expected an integer >= 0, got {seq_len!r}")
    seq_len = int(seq_len)
    table = np.asarray(block_table.get() if hasattr(block_table, "get") else block_table)
    need = -(-seq_len // bs)
    if table.ndim != 1 or (table.size and table.dtype.kind not in "iu") or table.size < need:
        raise ValueError(f"block_table: expected at least {need} integer block ids for {seq_len} tokens, "
                         f"got shape {table.shape} dtype {table.dtype}")
    table = table[:need]
    _check_tables(table[None], np.array([seq_len]), nb, bs, "block_table")
    io = _IO(k_pool, "k_pool")
    cp = io.cupy
    with io.stream():
        kp, vp = _pool_dev(io, k_pool), _pool_dev(io, v_pool)
        k_user, k_out = io.empty((hkv, seq_len, d), dtype)
        v_user, v_out = io.empty((hkv, seq_len, d), dtype)
        t_d = cp.asarray(np.ascontiguousarray(table, dtype=np.int32) if len(table) else np.zeros(1, np.int32))
        launch_gather(kp, vp, t_d, k_out, v_out, seq_len)
    return io.finish(k_user, dtype), io.finish(v_user, dtype)


def launch_gather(kp, vp, t_d, k_out, v_out, seq_len):
    """The gather kernel on device arrays (pools and outputs contiguous)."""
    kp, vp, k_out, v_out = (_Dev.of(a) for a in (kp, vp, k_out, v_out))
    nb, bs, hkv, d = kp.shape
    if seq_len == 0 or hkv * d == 0:
        return
    row_bytes = d * kp.itemsize
    chunk = next(c for c in (16, 8, 4, 2, 1) if row_bytes % c == 0 and all(
        a.ptr % c == 0 for a in (kp, vp, k_out, v_out)))
    if chunk == 1:                                   # rows of 1-byte elements do not occur
        chunk = kp.itemsize
    defines = dict(BLOCK_SIZE=bs, CHUNK_BYTES=chunk, CHUNKS_PER_ROW=row_bytes // chunk)
    fn = _function("paged_gather", "paged_gather", defines)
    total = hkv * seq_len * (row_bytes // chunk)
    grid = max(1, min(-(-total // GATHER_THREADS), GATHER_BLOCKS_PER_SM * device_info()["sms"]))
    fn((grid,), (GATHER_THREADS,), (kp.arg, vp.arg, t_d, np.int32(seq_len), np.int32(hkv), k_out.arg, v_out.arg))


def paged_gather(cache, sid):
    """What ``cache.gather(sid, backend="cupy")`` calls: NumPy pools in, NumPy K, V out."""
    return gather_pools(cache.k_pool, cache.v_pool, cache.block_table(sid), cache.seq_len(sid))


# --------------------------------------------------------------------------- bench, sanitizer
def bench_versions(op: str, dtype: str) -> dict:
    """The numbered versions the benchmark times (iokernels.bench reads this): {label: config}.

    attention: v1 (and v2 for 16-bit); float32 also v1b at Br x Bc = 64 x 64 (112 KB SRAM,
    2 blocks an SM) and 64 x 32 (72 KB).  decode and paged_decode: "split" (config None: the
    public default, decode_v3.cu at 8 warps x 4 stages), "split-v1" (decode.cu), "split-v2"
    (decode_v2.cu) and "split-v3 4w" (decode_v3.cu at v2's 4 warps x 3 stages); the bench
    passes a version's config as ``config=`` (rows ``cupy:split``, ``cupy:split-v1 paged``,
    ...).  gather: one version (config None).
    """
    if op == "attention":
        out = {"v1": CupyConfig(version="v1")}
        if dtype == "float32":
            out["v1b"] = CupyConfig(version="v1b")
            out["v1b 64x32"] = CupyConfig(version="v1b", block_q=64, block_k=32)
        if dtype in ("float16", "bfloat16"):
            out["v2"] = CupyConfig(version="v2")
        return out
    if op in ("decode", "paged_decode"):
        return {"split": None, "split-v1": DecodeConfig(version="v1"), "split-v2": DecodeConfig(version="v2"),
                "split-v3 4w": DecodeConfig(version="v3", num_warps=4, stages=3)}
    return {"split": None}


def sanitize_cases(seed: int = 0) -> list:
    """Run every kernel once at a ragged shape (for compute-sanitizer); returns what ran.

    Shapes are multiples of no tile: Nq = 37, Nk = 77, head_dim 64 and 72, GQA 4/2, a
    window, ragged decode lengths (one of them 0), a paged cache with a partial last block.
    Every version runs (attention v1, v1b in float32, v2; decode v1, v2 and v3 contiguous
    and paged; v3 fused and unfused, twice in a row so a counter left behind would show).
    Only CuPy is used (bfloat16 as its bit pattern), so the sanitizer loads no other library.
    """
    cp = _cupy()
    from ..paged import PagedKVCache
    from ..core.testing import make_inputs
    rng = np.random.default_rng(seed)
    dev = device_info()
    ran = []
    dtypes = ["float32", "float16"] + (["bfloat16"] if dev["cc"] >= 80 else [])

    def to_dev(x, dt):
        h = np.ascontiguousarray(x, dtype=np.float32)
        if dt == "bfloat16":                                  # round to nearest even, keep the bits
            u = h.view(np.uint32).astype(np.uint64)
            return cp.asarray(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))
        return cp.asarray(h.astype(dt))

    def out(shape, dt):
        return cp.empty(shape, dtype=np.uint16 if dt == "bfloat16" else dt)

    for dt in dtypes:
        for version in (("v1", "v2") if dt != "float32" else ("v1", "v1b")):
            for d, causal, window in ((64, True, (-1, -1)), (72, False, (5, 3))):
                q, k, v = make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=77,
                                      head_dim=d, dtype="float32")
                cfg = fit_config(CupyConfig(version=version), d, dt, dev)
                left, right = cv.effective_window(causal, window)
                launch_attention(to_dev(q, dt), to_dev(k, dt), to_dev(v, dt), out(q.shape, dt),
                                 out(q.shape[:3], "float32"), dtype=dt, scale=0.125, window=(left, right),
                                 config=cfg)
                ran.append(f"attention {version} {dt} d={d} causal={causal} window={window}")
        q, k, v = make_inputs(rng, batch=3, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_k=301, head_dim=64,
                              dtype="float32")
        lens = cp.asarray(np.array([301, 0, 129], np.int32))
        dec_cfgs = {"v1": DecodeConfig(version="v1"), "v2": DecodeConfig(version="v2"),
                    "v3": DecodeConfig(version="v3"), "v3 unfused 8w": DecodeConfig(version="v3", fused=False,
                                                                                    num_warps=8)}
        for splits in (1, 5):
            for dv, dcfg in dec_cfgs.items():
                for _ in range(2 if dv == "v3" else 1):        # v3 twice: its counters must reset
                    launch_decode(to_dev(q[:, :, 0], dt), to_dev(k, dt), to_dev(v, dt), lens, out((3, 4, 64), dt),
                                  out((3, 4), "float32"), dtype=dt, scale=0.125, num_splits=splits, nk=301,
                                  config=dcfg)
                ran.append(f"decode {dv} {dt} splits={splits}")
        np_dt = np.float32 if dt == "bfloat16" else np.dtype(dt)
        cache = PagedKVCache(64, block_size=16, num_kv_heads=2, head_dim=64, dtype=np_dt)
        sids = []
        for n in (301, 45):
            sid = cache.new_sequence()
            cache.append(sid, rng.standard_normal((n, 2, 64)).astype(np_dt), rng.standard_normal((n, 2, 64)).astype(np_dt))
            sids.append(sid)
        tables, lens_h = cache.block_tables_array(sids)
        kp = to_dev(np.nan_to_num(cache.k_pool), dt)
        vp = to_dev(np.nan_to_num(cache.v_pool), dt)
        for dv, dcfg in dec_cfgs.items():
            for splits in ((3, 1) if dv.startswith("v3") else (3,)):   # v3 at 1 split: table of 20 pages
                launch_decode(to_dev(q[:2, :, 0], dt), kp, vp, cp.asarray(lens_h), out((2, 4, 64), dt),
                              out((2, 4), "float32"), dtype=dt, scale=0.125, num_splits=splits,
                              paged=(cp.asarray(tables), 16), longest=301, nk=0, config=dcfg)
            ran.append(f"paged decode {dv} {dt}")
        ko, vo = out((2, 45, 64), dt), out((2, 45, 64), dt)
        launch_gather(kp, vp, cp.asarray(np.asarray(cache.block_table(sids[1]), np.int32)), ko, vo, 45)
        ran.append(f"paged decode + gather {dt}")
    cp.cuda.Device().synchronize()
    return ran


# --------------------------------------------------------------------------- for notebook 06
def nonmatmul_budget(head_dim: int, matmul_flops_per_s: float = 989e12, exp_per_s: float = 3.9e12) -> dict:
    """Time for the exponentials against time for the matmuls, per score S_ij.

    Each score costs 4 * head_dim matmul FLOPs (2d in Q K^T, 2d in P V) and one exp.
    Defaults: H100 SXM's dense 16-bit tensor-core peak and its special-function (exp)
    throughput as the FlashAttention-3 paper quotes them (Shah et al., 2024).
    """
    t_mm = 4 * head_dim / matmul_flops_per_s
    t_exp = 1 / exp_per_s
    return dict(matmul_ps_per_score=t_mm * 1e12, exp_ps_per_score=t_exp * 1e12,
                exp_over_matmul=t_exp / t_mm)


def v2_registers(head_dim: int, block_k: int) -> dict:
    """32-bit registers a lane of v2 holds for its 16 query rows (fa_v2.cu): the O
    accumulator, the S/P tile, the Q fragments, (m, l) -- before addresses and temporaries."""
    d = _round_up(head_dim, 16)
    o = d // 8 * 4            # NT_O n-tiles x 4 floats
    s = block_k // 8 * 4      # NT_S n-tiles x 4 floats
    q = d // 16 * 4           # KT_Q k-steps x 4 registers of two 16-bit values
    return dict(O=o, S_P=s, Q=q, m_l=4, total=o + s + q + 4)
