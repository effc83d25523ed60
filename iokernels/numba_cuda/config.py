"""One config class per op of the Numba backend: what a caller may choose, and what it costs.

=================  ==============================================================
class              op(s) and its fields
=================  ==============================================================
ForwardConfig      ``attention``: version, Br (``block_q``), Bc (``block_k``), the v3/v4
                   register tiling (``threads_per_row``, ``rows_per_thread``), the
                   online-softmax step (``step_keys``, ``batched_lane_sums``)
DecodeConfig       ``decode`` and ``paged_decode``: version and the split kernel's tiling
                   (``lanes_per_key``, ``keys_per_iter``, ``key_groups``)
GatherConfig       ``paged_gather``: version and v3's words in flight (``unroll``)
=================  ==============================================================

Every class is a frozen dataclass whose first field is ``version`` ("v1", "v2", ...;
None: the backend's default for the call, chosen by :data:`iokernels.numba_cuda.REGISTRY`),
with ``replace(**changes)``.  Tile sizes are fields that know their shared-memory (SRAM)
bytes; a bad explicit value raises a ValueError naming ``config.<field>``.  The defaults
fit every supported dtype (float16, float32, float64) and head dim up to 256.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core import conventions as cv
from .policy import backward_block, forward_block_k, forward_v5_row, forward_v5_tiles, forward_v6_row, forward_v6_tiles

#: Static shared memory a thread block may use without an opt-in: 48 KiB on every CUDA GPU
#: (more needs dynamic shared memory and cudaFuncSetAttribute, which these kernels avoid).
SHARED_LIMIT_BYTES = 48 * 1024
#: a warp: lanes that share a row (forward v3/v4) or a key (decode) sit in one warp, so
#: their sums are shuffles.
WARP_SIZE = 32
#: every lane of the warp takes part in each shuffle.
FULL_MASK = 0xFFFFFFFF
#: the most threads a CUDA thread block may have.
MAX_THREADS = 1024
#: storage dtypes the Numba kernels take.  bfloat16 is not among them: Numba has no
#: bfloat16 arithmetic type (the CuPy backend runs bfloat16).
NUMBA_DTYPES = ("float16", "float32", "float64")
#: forward: query rows per block (Br) when the config leaves ``block_q`` None.
DEFAULT_BLOCK_Q = 64
#: forward: the largest key tile (Bc) the default tries; halved until K_j, V_j fit SRAM.
DEFAULT_BLOCK_K = 32
#: keys folded into the online softmax at once by v3 (its scores for them stay in registers).
KEYS_PER_STEP = 8
#: v4's step: 4 keys, their lane sums batched.  NVVM fully unrolls a step this small, so
#: the scores of the step are indexed by constants and stay in registers (v3's 8-key step
#: is not unrolled and goes through local memory; tests/test_numba_ptx.py checks both).
V4_KEYS_PER_STEP = 4

FORWARD_VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7")
DECODE_VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6")
#: the decode versions that read K/V rows as 16-byte pairs (v5 is v4 with exp2, v6 v5 with an
#: unchecked interior), and those with key groups and v3's paged addressing
PAIR_DECODE_VERSIONS = ("v4", "v5", "v6")
PIPELINED_DECODE_VERSIONS = ("v3", "v4", "v5", "v6")
GATHER_VERSIONS = ("v1", "v3")
PREFILL_VERSIONS = ("v1",)
#: decode v3's ways of finding a key's row in a paged cache (DecodeConfig.paged_addressing)
PAGED_ADDRESSING = ("page", "key")


def acc_dtype(dtype: str):
    """The accumulator NumPy dtype for a storage dtype: float64 for float64, else float32."""
    return np.float64 if dtype == "float64" else np.float32


def _check_version(version, allowed, what):
    if version is not None and version not in allowed:
        raise ValueError(f"config.version: the numba {what} versions are {', '.join(allowed)} (strings) or "
                         f"None for the default, got {version!r}")


def _check_int(value, name, lo=1, hi=None, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"config.{name}: expected {'None or ' if allow_none else ''}an integer {rng}, "
                         f"got {value!r}")


# --------------------------------------------------------------------------- forward
@dataclass(frozen=True)
class ForwardConfig:
    """Launch shape of the Numba FlashAttention forward.

    version: "v1" .. "v7" (None: the default, v7 at float32, v4 at float16 and float64); block_q
    (Br), block_k (Bc): tile rows, None for the default (Br = 64; Bc the largest of 32, 16, 8
    whose K_j, V_j tiles fit the static shared-memory limit at this head dim and dtype; v5:
    :func:`.policy.forward_v5_tiles`, v6, v7: :func:`.policy.forward_v6_tiles`); threads_per_row,
    rows_per_thread: v3/v4's register tiling (v1 and v2 use one thread per row), v5-v7's lanes a
    row group and rows a thread (their S and O blocks); batched_lane_sums: v3/v4 sum
    the lanes' partial dot products of a whole step of keys in one butterfly (True) or key by
    key (False), None: the version's choice (v4 batched, v3 key by key); step_keys: keys per
    online-softmax step of v3/v4 (None: the version's, 8 for v3, 4 for v4).
    ``buggy_skip_sync`` is a v2 teaching flag (the shared-memory race of notebook 05).
    """

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    threads_per_row: int = 8
    rows_per_thread: int = 4
    batched_lane_sums: bool | None = None
    step_keys: int | None = None
    buggy_skip_sync: bool = False

    def __post_init__(self):
        _check_version(self.version, FORWARD_VERSIONS, "forward")
        _check_int(self.block_q, "block_q")
        _check_int(self.block_k, "block_k")
        L, R = self.threads_per_row, self.rows_per_thread
        if isinstance(L, bool) or not isinstance(L, int) or L < 1 or L > WARP_SIZE or WARP_SIZE % L:
            raise ValueError(f"config.threads_per_row: must divide {WARP_SIZE} (lanes of one warp), got {L!r}")
        _check_int(R, "rows_per_thread", allow_none=False)
        _check_int(self.step_keys, "step_keys")
        if self.buggy_skip_sync and self.version != "v2":
            raise ValueError("config.buggy_skip_sync: a v2 teaching flag (version='v2')")

    def replace(self, **changes) -> "ForwardConfig":
        return replace(self, **changes)

    @property
    def _tiled(self) -> bool:
        """v3 to v7: several lanes a row, several rows a thread."""
        return self.version in ("v3", "v4", "v5", "v6", "v7")

    @property
    def keys_per_step(self) -> int:
        """Keys per online-softmax step of v3 / v4 (before clipping to block_k)."""
        if self.step_keys is not None:
            return self.step_keys
        return V4_KEYS_PER_STEP if self.version == "v4" else KEYS_PER_STEP

    @property
    def batched(self) -> bool:
        """Whether v3/v4 sum a step's partial dot products in one butterfly."""
        if self.batched_lane_sums is not None:
            return bool(self.batched_lane_sums)
        return self.version == "v4"

    @property
    def threads(self) -> int:
        """Threads per block: Br for v1 and v2; Br / rows_per_thread * threads_per_row for v3 to v7."""
        if self._tiled:
            return self.block_q // self.rows_per_thread * self.threads_per_row
        return self.block_q

    def padded_head_dim(self, head_dim: int) -> int:
        """d as laid out in SRAM: v3/v4 pad it to a multiple of threads_per_row (zeros)."""
        if self._tiled:
            return -(-head_dim // self.threads_per_row) * self.threads_per_row
        return head_dim

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        """Static shared memory of one block: the K_j and V_j tiles (v2, v3, v4) in the
        accumulator dtype; v1 uses none.  Needs block_k (see :meth:`resolved`)."""
        if self.version == "v1":
            return 0
        acc = np.dtype(acc_dtype(dtype)).itemsize
        if self.version == "v5":                 # Q_i and one K/V tile, rows padded (forward_v5_row)
            return (self.block_q + self.block_k) * forward_v5_row(head_dim, self.threads_per_row) * acc
        if self.version in ("v6", "v7"):         # the same, rows of 16-byte chunks (forward_v6_row)
            return (self.block_q + self.block_k) * forward_v6_row(head_dim, self.threads_per_row, acc) * acc
        return 2 * self.block_k * self.padded_head_dim(head_dim) * acc

    def resolved(self, head_dim: int, dtype: str) -> "ForwardConfig":
        """This config with the default tiles filled in for ``head_dim`` and ``dtype``, checked.
        ``version`` must be set (the registry sets it)."""
        if self.version is None:
            raise ValueError("config.version: resolve the default version first (REGISTRY.resolve)")
        br = DEFAULT_BLOCK_Q if self.block_q is None else self.block_q
        bc = self.block_k
        if self.version in ("v5", "v6", "v7"):
            rule = forward_v5_tiles if self.version == "v5" else forward_v6_tiles
            tiles = rule(head_dim, np.dtype(acc_dtype(dtype)).itemsize, SHARED_LIMIT_BYTES,
                         self.threads_per_row, self.rows_per_thread)
            br = tiles[0] if self.block_q is None else self.block_q
            bc = tiles[1] if bc is None else bc
        if bc is None:
            bc = forward_block_k(DEFAULT_BLOCK_K, KEYS_PER_STEP, self.padded_head_dim(head_dim),
                                 np.dtype(acc_dtype(dtype)).itemsize, SHARED_LIMIT_BYTES)
        cfg = self.replace(block_q=br, block_k=bc)
        cfg.check(head_dim, dtype)
        return cfg

    def check(self, head_dim: int, dtype: str) -> None:
        """ValueError naming the field when resolved tiles cannot run at this head dim, dtype."""
        if self.block_q is None or self.block_k is None:
            raise ValueError("config.block_q: block_q and block_k must be resolved (call .resolved)")
        v = self.version
        if self._tiled:
            ch = self.keys_per_step
            if self.block_q % self.rows_per_thread:
                raise ValueError(f"config.block_q: {self.block_q} must be a multiple of rows_per_thread "
                                 f"({self.rows_per_thread}) for {v}")
            if self.threads % WARP_SIZE and self.threads > WARP_SIZE:
                raise ValueError(f"config.block_q: {v} needs whole warps; {self.threads} threads")
            if v in ("v5", "v6", "v7") and self.block_k % self.threads_per_row:
                raise ValueError(f"config.block_k: {self.block_k} must be a multiple of threads_per_row "
                                 f"({self.threads_per_row}) for {v} (the keys of a tile are dealt to the lanes)")
            if v not in ("v5", "v6", "v7") and self.block_k % min(ch, self.block_k):
                raise ValueError(f"config.block_k: {self.block_k} must be a multiple of {ch} for {v}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"config.block_q: {self.threads} threads per block, more than CUDA's {MAX_THREADS}")
        need = self.shared_bytes(head_dim, dtype)
        if need > SHARED_LIMIT_BYTES:
            raise ValueError(f"config.block_k: {v} tiles Br={self.block_q}, Bc={self.block_k} at head_dim="
                             f"{head_dim} ({dtype}) need {need:,} B of shared memory, more than the "
                             f"{SHARED_LIMIT_BYTES:,} B static limit")


# --------------------------------------------------------------------------- decode
@dataclass(frozen=True)
class DecodeConfig:
    """Which split kernel a (paged) decode runs, and its tiling.

    version: "v1" (a thread group a key, element loads), "v2" (8-byte word loads, bit-cast
    unpack), "v3" (software-pipelined word loads, reduce-scatter lane sums), "v4" (v3 with
    16-byte loads: float16 / float32 rows of whole 16-byte pairs), "v5" (v4 with its scores in
    log2 units: every exponential an exp2), "v6" (v5 with no bounds checks in a split's
    interior); None: the default (v6 where it
    applies, else v3 when K and V are C-contiguous, else v1).  lanes_per_key (L),
    keys_per_iter (KPI): v2's to v6's split tiling; key_groups (KG): v3's to v6's key
    groups per block (v1 and v2 use a fixed KG); None: the version's defaults.  v1 ignores
    them all.
    paged_addressing: how v3 (and v4 to v6) finds a key's row in a paged cache: "page" (a key group's KPI
    keys of a step are consecutive slots of one page: one block-table lookup for them; needs
    a block size that is a multiple of KPI and no sliding window), "key" (a lookup per key,
    any block size); None: "page" where it applies, else "key".  Contiguous K/V ignore it.
    """

    version: str | None = None
    lanes_per_key: int | None = None
    keys_per_iter: int | None = None
    key_groups: int | None = None
    paged_addressing: str | None = None

    def __post_init__(self):
        _check_version(self.version, DECODE_VERSIONS, "decode")
        L = self.lanes_per_key
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1 or WARP_SIZE % L):
            raise ValueError(f"config.lanes_per_key: must divide {WARP_SIZE} (lanes of one warp), got {L!r}")
        _check_int(self.keys_per_iter, "keys_per_iter", 1, 16)
        _check_int(self.key_groups, "key_groups", 1, 32)
        if self.version not in (None,) + PIPELINED_DECODE_VERSIONS and self.key_groups is not None:
            raise ValueError("config.key_groups: a setting of v3 to v6 (version='v3', 'v4', 'v5' or 'v6')")
        if self.paged_addressing not in (None,) + PAGED_ADDRESSING:
            raise ValueError(f"config.paged_addressing: one of {', '.join(map(repr, PAGED_ADDRESSING))} or None, "
                             f"got {self.paged_addressing!r}")
        if self.version not in (None,) + PIPELINED_DECODE_VERSIONS and self.paged_addressing is not None:
            raise ValueError("config.paged_addressing: a setting of v3 to v6 (version='v3', 'v4', 'v5' or 'v6')")

    def replace(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)


# --------------------------------------------------------------------------- gather
@dataclass(frozen=True)
class GatherConfig:
    """Which paged gather runs.

    version: "v1" (a thread block per logical block, reading through the block table) or
    "v3" (a thread block per pool block copying flat runs of 8-byte words, ``unroll`` words
    of K and of V loaded before any store); None: the default, v1 (it takes any strides).
    unroll: v3 only (None: its default).
    """

    version: str | None = None
    unroll: int | None = None

    def __post_init__(self):
        _check_version(self.version, GATHER_VERSIONS, "gather")
        _check_int(self.unroll, "unroll", 1, 32)
        if self.version not in (None, "v3") and self.unroll is not None:
            raise ValueError("config.unroll: a v3 setting (version='v3')")

    def replace(self, **changes) -> "GatherConfig":
        return replace(self, **changes)


# --------------------------------------------------------------------------- paged prefill
@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the paged prefill (its K/V tile is always one cache block).

    version: "v1" (None: the default, v1); block_q: chunk rows a Q tile, None for as many as
    make 64 packed rows (chunk rows x query heads of a KV head), at least 1.
    """

    version: str | None = None
    block_q: int | None = None

    def __post_init__(self):
        _check_version(self.version, PREFILL_VERSIONS, "paged prefill")
        _check_int(self.block_q, "block_q", 1, MAX_THREADS)

    def replace(self, **changes) -> "PrefillConfig":
        return replace(self, **changes)


# --------------------------------------------------------------------------- backward
#: threads of the backward's main kernel: enough for a Br x d dQ tile to take a few strided passes
BACKWARD_THREADS = 128
#: Br = Bc = 16 for head dims up to 128 (Q_i, dO_i, K_j, V_j in float32 take 32 KiB);
#: halved where that would pass the static shared-memory limit
BACKWARD_BLOCK = 16


@dataclass(frozen=True)
class BackwardConfig:
    """The Numba backward's settings.  ``deterministic``: dQ by per-tile partials summed in
    order (same bits every run) instead of atomic adds."""

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    deterministic: bool = False

    def __post_init__(self):
        if self.version not in (None, "v1"):
            raise ValueError(f"config.version: the Numba backward has version 'v1', got {self.version!r}")
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > BACKWARD_THREADS):
                raise ValueError(f"config.{name}: an integer in [1, {BACKWARD_THREADS}], got {v!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"config.deterministic: True or False, got {self.deterministic!r}")

    def replace(self, **kw) -> "BackwardConfig":
        return replace(self, **kw)

    def smem_bytes(self, head_dim: int, dtype: str) -> int:
        acc = cv.accum_dtype(dtype).itemsize
        br, bc = self.block_q, self.block_k
        return (2 * br * head_dim + 2 * bc * head_dim + br * bc + 2 * br) * acc

    def resolved(self, head_dim: int, dtype: str) -> "BackwardConfig":
        """Tile sizes filled in (the default fits every dtype and head dim up to 256); an
        explicit tile set that does not fit raises."""
        cfg = self
        if cfg.block_q is None or cfg.block_k is None:
            b = backward_block(BACKWARD_BLOCK, lambda b: self.replace(block_q=b, block_k=b).smem_bytes(head_dim, dtype),
                               SHARED_LIMIT_BYTES)
            cfg = cfg.replace(block_q=cfg.block_q or b, block_k=cfg.block_k or b)
        need = cfg.smem_bytes(head_dim, dtype)
        if need > SHARED_LIMIT_BYTES:
            raise ValueError(f"config: Br={cfg.block_q}, Bc={cfg.block_k} at head_dim={head_dim} ({dtype}) need "
                             f"{need:,} B of shared memory, more than the {SHARED_LIMIT_BYTES:,} B static limit")
        return cfg.replace(version="v1")


