"""The conventions every backend shares, as code.

One set of rules, used by the oracle, the NumPy kernels, the GPU launchers and the
tests:

=================  ==========================================================
thing              convention
=================  ==========================================================
layout             (batch, heads, seq, head_dim), like torch SDPA
scale              1/sqrt(head_dim) unless given
causal             bottom-right aligned: query i sees key j iff j <= i + Nk - Nq
                   (FlashAttention >= 2.1).  torch SDPA's ``is_causal`` is
                   top-left aligned (j <= i); the two agree only when Nq == Nk.
window             (left, right) like FlashAttention's window_size; -1 = unbounded.
                   Query i sees key j iff  i + Nk - Nq - left <= j <= i + Nk - Nq + right
GQA / MQA          heads_q % heads_kv == 0; query head h reads kv head
                   h // (heads_q // heads_kv)
LSE                natural log, float32 (float64 for float64 inputs), (batch, heads, Nq)
fully masked row   output 0 and LSE = -inf, never NaN
=================  ==========================================================

Because causal and window masks are both "a band around the shifted diagonal",
the keys a query row may see always form one contiguous interval
``[lo(i), hi(i))``.  Every backend uses :func:`key_range` for that interval, so
masks, tile skipping and the traffic models cannot disagree.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

#: dtypes the package accepts, by name (torch and CuPy arrays are matched by name too)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


# --------------------------------------------------------------------------- dtypes
def dtype_name(x) -> str:
    """The dtype of a NumPy / CuPy / Numba / torch array as a plain name ('float16', ...)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise ValueError(f"expected an array, got {type(x).__name__}")
    name = str(dt)
    if name.startswith("torch."):
        name = name[len("torch."):]
    return name


def accum_dtype(storage: str) -> np.dtype:
    """Accumulator dtype for a storage dtype: float64 stays float64, everything else float32."""
    return np.dtype(np.float64) if storage == "float64" else np.dtype(np.float32)


def itemsize_of(name: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[name]


# --------------------------------------------------------------------------- scale
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def resolve_scale(scale, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number or None, got {scale!r}")
    return float(scale)


# --------------------------------------------------------------------------- window / causal
def resolve_window(window) -> tuple[int, int]:
    """Normalize ``window`` to a pair (left, right) of ints >= -1; None means (-1, -1)."""
    if window is None:
        return (-1, -1)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window: expected None or a pair (left, right), got {window!r}") from None
    for side, v in (("left", left), ("right", right)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < -1:
            raise ValueError(f"window: {side} must be an integer >= -1 (-1 = unbounded), got {v!r}")
    return (int(left), int(right))


def effective_window(causal: bool, window) -> tuple[int, int]:
    """Causal is the window (-1, 0); both together is the intersection of the two bands."""
    left, right = resolve_window(window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def key_range(rows, seqlen_q: int, seqlen_k: int, causal: bool = False, window=None):
    """Keys visible to each query row: arrays (lo, hi) with row i seeing j in [lo[i], hi[i]).

    ``rows`` may be an int or an integer array.  An empty interval (hi <= lo) is a fully
    masked row: its output is 0 and its LSE -inf.
    """
    left, right = effective_window(causal, window)
    rows = np.asarray(rows, dtype=np.int64)
    diag = rows + (seqlen_k - seqlen_q)  # the key aligned with query i (bottom-right)
    lo = np.zeros_like(rows) if left < 0 else np.clip(diag - left, 0, seqlen_k)
    hi = np.full_like(rows, seqlen_k) if right < 0 else np.clip(diag + right + 1, 0, seqlen_k)
    hi = np.maximum(hi, lo)  # empty rows as lo == hi
    return lo, hi


def mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window=None,
         rows=None, cols=None) -> np.ndarray:
    """Boolean visibility mask (True = query i may attend to key j) for a tile.

    ``rows`` and ``cols`` are (start, stop) ranges; the default is the whole matrix.
    """
    r0, r1 = rows if rows is not None else (0, seqlen_q)
    c0, c1 = cols if cols is not None else (0, seqlen_k)
    lo, hi = key_range(np.arange(r0, r1), seqlen_q, seqlen_k, causal, window)
    j = np.arange(c0, c1)[None, :]
    return (j >= lo[:, None]) & (j < hi[:, None])


def tile_state(r0: int, r1: int, c0: int, c1: int, seqlen_q: int, seqlen_k: int,
               causal: bool = False, window=None) -> str:
    """Classify the tile rows [r0, r1) x cols [c0, c1): 'skip', 'full' or 'partial'.

    'skip': no query row of the tile sees any key of it (the tile is never loaded);
    'full': every entry is visible (no mask needs applying);
    'partial': a mask is applied inside the tile.
    """
    lo, hi = key_range(np.arange(r0, r1), seqlen_q, seqlen_k, causal, window)
    a = np.maximum(lo, c0)
    b = np.minimum(hi, c1)
    if np.all(b <= a):
        return "skip"
    if np.all((lo <= c0) & (hi >= c1)):
        return "full"
    return "partial"


# --------------------------------------------------------------------------- GQA
def kv_head(h: int, heads_q: int, heads_kv: int) -> int:
    """The KV head that query head ``h`` reads (GQA/MQA grouping)."""
    return h // (heads_q // heads_kv)


def kv_head_index(heads_q: int, heads_kv: int) -> np.ndarray:
    return np.arange(heads_q) // (heads_q // heads_kv)


# --------------------------------------------------------------------------- argument checks
def _shape(x, name):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"{name}: expected an array (NumPy, CuPy, Numba or torch), got {type(x).__name__}")
    return tuple(int(s) for s in shape)


def check_dtype(x, name, allowed=SUPPORTED_DTYPES) -> str:
    dt = dtype_name(x)
    if dt not in allowed:
        raise ValueError(f"{name}: dtype must be one of {', '.join(allowed)}; got {dt}")
    return dt


def check_qkv(q, k, v, *, rank: int = 4, allowed=SUPPORTED_DTYPES):
    """Validate q, k, v for attention. Returns a dict of the problem's sizes.

    rank 4: (batch, heads, seq, head_dim); rank 3: packed varlen (total, heads, head_dim).
    """
    sq, sk, sv = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    layout = "(batch, heads, seq, head_dim)" if rank == 4 else "(total_tokens, heads, head_dim)"
    for name, s in (("q", sq), ("k", sk), ("v", sv)):
        if len(s) != rank:
            raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {s}")
    dq, dk, dv = check_dtype(q, "q", allowed), check_dtype(k, "k", allowed), check_dtype(v, "v", allowed)
    if not (dq == dk == dv):
        raise ValueError(f"k, v: dtypes must match q ({dq}); got k {dk}, v {dv}")
    if sk != sv:
        raise ValueError(f"v: shape must equal k's {sk}, got {sv}")
    if sq[-1] != sk[-1]:
        raise ValueError(f"k: head_dim (last axis) must equal q's {sq[-1]}, got {sk[-1]}")
    if sq[-1] < 1:
        raise ValueError(f"q: head_dim must be >= 1, got {sq[-1]}")
    if rank == 4:
        if sq[0] != sk[0]:
            raise ValueError(f"k: batch (axis 0) must equal q's {sq[0]}, got {sk[0]}")
        hq, hkv = sq[1], sk[1]
    else:
        hq, hkv = sq[1], sk[1]
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"k: heads_q ({hq}) must be a positive multiple of heads_kv ({hkv}) for GQA/MQA")
    out = dict(heads_q=hq, heads_kv=hkv, head_dim=sq[-1], dtype=dq)
    if rank == 4:
        out.update(batch=sq[0], seqlen_q=sq[2], seqlen_k=sk[2])
    else:
        out.update(total_q=sq[0], total_k=sk[0])
    return out


def check_cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    """Validate cumulative sequence offsets: int32, 1-D, starts at 0, non-decreasing, ends at total."""
    shape = _shape(cu, name)
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D int32 array of batch+1 offsets, got shape {shape}")
    if dtype_name(cu) not in ("int32", "int64"):
        raise ValueError(f"{name}: dtype must be int32 (or int64), got {dtype_name(cu)}")
    arr = np.asarray(cu.get() if hasattr(cu, "get") else cu, dtype=np.int64)
    if arr[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {arr[0]}")
    if np.any(np.diff(arr) < 0):
        raise ValueError(f"{name}: must be non-decreasing (zero-length sequences are fine), got {arr.tolist()}")
    if arr[-1] != total:
        raise ValueError(f"{name}: last offset must equal the packed length {total}, got {arr[-1]}")
    return arr


def check_finite(x, name: str) -> None:
    """ValueError naming ``name`` when a host (NumPy) array holds inf or NaN.

    The NumPy backends check their inputs: a NaN in q, k or v would otherwise come out as
    NaN rows with no word of where it came from.  Device arrays are not scanned (that would
    cost a pass over HBM and a host synchronisation per call); on the GPU backends a
    non-finite input gives non-finite output in the rows that read it, as IEEE arithmetic
    propagates it.
    """
    a = np.asarray(x)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        af = a.astype(np.float32) if a.dtype.name == "bfloat16" else a
        if not np.all(np.isfinite(af)):
            bad = np.argwhere(~np.isfinite(af))[0]
            raise ValueError(f"{name}: holds a non-finite value ({af[tuple(bad)]}) at index "
                             f"{tuple(int(i) for i in bad)}; "
                             f"attention inputs must be finite")


def check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}; got {value!r}")
    return value
