"""One config class per op of the Triton backend, and the tile configurations kept as data.

=================  ==============================================================
class              op(s) and its fields
=================  ==============================================================
ForwardConfig      ``attention``: version, Br (``block_q``), Bc (``block_k``), ``num_warps``,
                   ``num_stages``; all None: the version's choice (v1 a fixed tile, v2
                   autotuned on a GPU from :data:`FORWARD_TILES`)
DecodeConfig       ``decode`` and ``paged_decode``: version, keys per tile (``block_n``)
BackwardConfig     ``attention_backward``: version, Br, Bc, ``deterministic`` (dQ summed
                   in order by a second kernel, the default; False: atomic adds)
=================  ==============================================================

Every class is a frozen dataclass whose first field is ``version`` (None: the backend's
default for the call, chosen by :data:`iokernels.triton_backend.REGISTRY`), with
``replace(**changes)``; a bad explicit value raises a ValueError naming ``config.<field>``.

Triton's ``tl.arange`` takes power-of-two lengths only (its check in
triton/language/semantic.py; code), and a 16-bit ``tl.dot`` takes K >= 16 (its
backends/nvidia/compiler.py, min_dot_size; code; Triton before 3.5 also asked M, N >= 16), so every
tile side here is a power of two >= 16, and the head dim is padded up to one
(:func:`padded_head_dim`; the padded columns are masked on load and store).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

#: log2(e) and ln(2): the kernels keep scores in base 2 and write the LSE in natural log
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: the storage dtypes the Triton kernels take (float32 accumulation for all three);
#: float64 runs on the numba and cupy backends
TRITON_DTYPES = ("float16", "bfloat16", "float32")
#: the largest head dim a tile holds (Q, K, V tiles and the O accumulator live on chip)
MAX_HEAD_DIM = 256
#: the smallest tile side ``tl.dot`` takes
MIN_TILE = 16
#: the largest tile side a config may name
MAX_TILE = 256

#: how the kernels' matrix product (:func:`.tiles.mm`, its ``F32``) multiplies float32 operands:
#: in IEEE precision on the CUDA cores, or as three TF32 products on the tensor cores
IEEE = 1
TF32X3 = 2

FORWARD_VERSIONS = ("v1", "v2")
DECODE_VERSIONS = ("v1", "v2", "v3")
BACKWARD_VERSIONS = ("v1",)

#: forward v1's fixed tile (Br, Bc, warps, stages): one tile for every call
V1_TILE = (64, 64, 4, 2)
#: forward v2's candidate tiles (Br, Bc, warps, stages), the list the autotuner times on a GPU
#: (once per problem shape; ``triton.autotune``); under the interpreter the first one that
#: fits runs, untimed (timing the interpreter would say nothing about a GPU)
FORWARD_TILES = (
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (128, 32, 4, 4),
    (64, 32, 4, 4),
)
#: ... and for float32 inputs (three TF32 products, :data:`TF32X3`): their operand tiles are twice
#: as wide in bytes, and the split operands need shared memory too.  Compiled for sm_90 at
#: head_dim 128, (64, 64, 4, 2) asks for 192 KiB, (128, 64, 8, 2) for 256 KiB, over the 227 KiB a
#: block may have; smaller tiles only
FORWARD_TILES_F32 = (
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (32, 64, 4, 2),
)
#: the one tile v2 runs under the interpreter (small: every program is NumPy work)
INTERPRET_TILE = (16, 16, 4, 1)
#: decode: keys per tile (a smaller tile leaves shared memory for more programs per
#: multiprocessor, which a kernel bound by memory traffic needs); the query heads of one KV
#: head are packed into a tile of at least 16 rows
DECODE_BLOCK_N = 32
INTERPRET_DECODE_BLOCK_N = 16
#: decode, per version: the programs the split count fills on every multiprocessor, and the
#: software pipeline's depth (None: Triton's default).  v1 takes FlashAttention-2's occupancy
#: rule with one program a multiprocessor (FlashAttention-2 counts two of its blocks); v2 asks it for four programs a
#: multiprocessor with a two-stage pipeline, the fastest row of the tuning sweep over the
#: serving shapes (iokernels.bench.sweeps_triton); v3 (its paged copies pipelined as the contiguous
#: ones are, :mod:`.decode_v3`) three programs a multiprocessor with a three-stage pipeline, the
#: contiguous cache's fastest row of the sweep at batch 8 x 32768 keys
#: (benchmarks/results/sweeps/2026-12-07_1326_triton_decode_b8n32768_h200.json and its H100 twin)
DECODE_DEPTH = {"v1": (1, None), "v2": (4, 2), "v3": (3, 3)}
#: the versions the registry's default does not pick until a recorded run has measured them, and
#: what that run has to show (a config naming one runs it)
HELD_BACK = {(op, "v3"): "the serving sweep's paged and contiguous rows beside v2's, on the H200"
             for op in ("decode", "paged_decode")}
#: backward tiles (Br, Bc) on a GPU and under the interpreter
BACKWARD_TILE = (64, 64)
INTERPRET_BACKWARD_TILE = (16, 16)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The head dim a tile holds: the next power of two, at least :data:`MIN_TILE`."""
    return max(MIN_TILE, next_pow2(head_dim))


def _check_version(version, allowed, what):
    if version is not None and version not in allowed:
        raise ValueError(f"config.version: the triton {what} versions are {', '.join(allowed)} (strings) or "
                         f"None for the default, got {version!r}")


def _check_tile(value, name):
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or value < MIN_TILE or value > MAX_TILE
            or value & (value - 1)):
        raise ValueError(f"config.{name}: expected None or a power of two in [{MIN_TILE}, {MAX_TILE}] "
                         f"(Triton tiles), got {value!r}")


def _check_small(value, name, allowed):
    if value is not None and (isinstance(value, bool) or value not in allowed):
        raise ValueError(f"config.{name}: expected None or one of {', '.join(map(str, allowed))}, got {value!r}")


def check_head_dim(head_dim: int) -> str | None:
    """Why the Triton kernels cannot take ``head_dim`` (None: they can)."""
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM} (a tile holds a whole head)"
    return None


# --------------------------------------------------------------------------- forward
@dataclass(frozen=True)
class ForwardConfig:
    """The Triton forward's launch: version "v1" or "v2" (None: the default, v2); block_q (Br),
    block_k (Bc), num_warps, num_stages: None for the version's choice (v1: :data:`V1_TILE`;
    v2: autotuned over :data:`FORWARD_TILES` on a GPU (:data:`FORWARD_TILES_F32` for float32
    inputs), :data:`INTERPRET_TILE` under the interpreter).  Naming block_q and block_k fixes
    the tile (no autotuning)."""

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        _check_version(self.version, FORWARD_VERSIONS, "forward")
        _check_tile(self.block_q, "block_q")
        _check_tile(self.block_k, "block_k")
        if (self.block_q is None) != (self.block_k is None):
            raise ValueError("config.block_q: name both block_q and block_k, or neither")
        _check_small(self.num_warps, "num_warps", (1, 2, 4, 8, 16))
        _check_small(self.num_stages, "num_stages", (1, 2, 3, 4, 5))

    def replace(self, **changes) -> "ForwardConfig":
        return replace(self, **changes)

    def tile(self, interpreting: bool) -> tuple[int, int, int, int] | None:
        """(Br, Bc, warps, stages) this config runs; None: v2's autotuner picks on a GPU."""
        if self.block_q is not None:
            base = V1_TILE if self.version == "v1" else FORWARD_TILES[0]
            return (self.block_q, self.block_k, self.num_warps or base[2], self.num_stages or base[3])
        if interpreting:
            return INTERPRET_TILE
        if self.version == "v1":
            return (V1_TILE[0], V1_TILE[1], self.num_warps or V1_TILE[2], self.num_stages or V1_TILE[3])
        return None


# --------------------------------------------------------------------------- decode
@dataclass(frozen=True)
class DecodeConfig:
    """The Triton split-KV decode: version "v1" or "v2" (the same kernel, launched
    :data:`DECODE_DEPTH` deep) or "v3" (a paged tile's block ids loaded a step ahead); block_n:
    keys per tile (None: 32 on a GPU, 16 under the interpreter); the query heads of one KV head
    share each K/V tile it loads; num_warps (None: 4); num_stages: the software pipeline's depth
    (None: the version's, DECODE_DEPTH; with no version, that of the newest one not held back)."""

    version: str | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        _check_version(self.version, DECODE_VERSIONS, "decode")
        _check_tile(self.block_n, "block_n")
        _check_small(self.num_warps, "num_warps", (1, 2, 4, 8))
        _check_small(self.num_stages, "num_stages", (1, 2, 3, 4, 5))

    def replace(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)

    def keys_per_tile(self, interpreting: bool) -> int:
        if self.block_n is not None:
            return self.block_n
        return INTERPRET_DECODE_BLOCK_N if interpreting else DECODE_BLOCK_N

    def depth(self) -> tuple[int, int | None]:
        """(programs a multiprocessor the split count fills, pipeline stages or None for Triton's)."""
        default = [v for v in DECODE_VERSIONS if ("decode", v) not in HELD_BACK][-1]
        programs, stages = DECODE_DEPTH[self.version or default]
        return programs, self.num_stages if self.num_stages is not None else stages


# --------------------------------------------------------------------------- backward
@dataclass(frozen=True)
class BackwardConfig:
    """The Triton backward: version "v1"; block_q (Br), block_k (Bc): None for the default
    (64 x 64 on a GPU, 16 x 16 under the interpreter); ``deterministic``: dQ by a second
    kernel that sums each Q tile's K/V tiles in order (the same bits every run; the default:
    it needs no float32 dQ buffer and no atomics), or (False) by atomic adds from the dK/dV
    kernel's programs into a float32 buffer."""

    version: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    deterministic: bool = True
    num_warps: int | None = None

    def __post_init__(self):
        _check_version(self.version, BACKWARD_VERSIONS, "backward")
        _check_tile(self.block_q, "block_q")
        _check_tile(self.block_k, "block_k")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"config.deterministic: True or False, got {self.deterministic!r}")
        _check_small(self.num_warps, "num_warps", (1, 2, 4, 8))

    def replace(self, **changes) -> "BackwardConfig":
        return replace(self, **changes)

    def tile(self, interpreting: bool) -> tuple[int, int]:
        base = INTERPRET_BACKWARD_TILE if interpreting else BACKWARD_TILE
        return (self.block_q or base[0], self.block_k or base[1])
