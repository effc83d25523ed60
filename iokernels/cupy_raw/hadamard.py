"""The randomized Hadamard transform on the GPU (fwht.cu): incoherent processing before FP8.

:func:`fwht` computes exactly :func:`iokernels.fp8.randomized_hadamard` along the last axis,
x D H / sqrt(d): the same signs (``seed`` draws them with :func:`iokernels.fp8.random_signs`
from ``numpy.random.default_rng(seed)``, or pass ``signs``), applied first; then the same
butterfly stages in the same order and pairing as :func:`iokernels.fp8.fwht` ((a, b) at
distance h -> (a + b, a - b), h = 1, 2, ..., d / 2); then one multiplication by 1 / sqrt(d).
The arithmetic is float32 (NumPy's is float64), so a 16-bit result differs from the float64
transform by its rounding, which the tests hold to FlashAttention's 2x rule.

One warp transforms one row in registers (lanes exchange halves of a pair with shuffles;
no shared memory).  It is not Hopper-specific: it compiles for sm_75 (float16, float32),
sm_80 and sm_90 like the other portable kernels.

Notation: d the row length (head_dim), D = diag(signs), H the d x d Hadamard matrix
(Sylvester), M = D H / sqrt(d) orthogonal, so Q M (K M)^T = Q K^T exactly.
"""
from __future__ import annotations

import numpy as np

from .. import fp8
from ..core import conventions as cv
from ..core.arrays import Call, device_array
from .launch import DTYPE_IDS, contiguous, function, on_stream

#: row lengths the kernel takes: powers of two whose d / 32 elements fill whole registers of a lane
FWHT_HEAD_DIMS = (64, 128, 256)
FWHT_DTYPES = ("float16", "bfloat16", "float32")
#: rows (warps) a block transforms: 128 threads, small enough that short inputs still fill the SMs
FWHT_ROWS_PER_BLOCK = 4
#: the sign mask's 32-bit words (fwht.cu's SignBits): covers the longest row, 256
SIGN_WORDS = 8


def signs_for(head_dim: int, seed: int) -> np.ndarray:
    """The diagonal D that :func:`iokernels.fp8.random_signs` draws from ``default_rng(seed)``."""
    return fp8.random_signs(head_dim, np.random.default_rng(seed))


def sign_bits(signs) -> np.ndarray:
    """``signs`` (d values of +-1) as fwht.cu's SignBits: bit i set where signs[i] < 0, passed by
    value (a one-element array of 32 raw bytes, as the tensor maps are)."""
    s = np.asarray(signs, dtype=np.float64)
    if s.ndim != 1 or s.size > 32 * SIGN_WORDS or not np.all(np.abs(s) == 1.0):
        raise ValueError(f"signs: expected a 1-D array of +1 / -1 of length <= {32 * SIGN_WORDS}, "
                         f"got shape {s.shape}")
    words = np.zeros(SIGN_WORDS, np.uint32)
    for i in np.flatnonzero(s < 0):
        words[i // 32] |= np.uint32(1 << (i % 32))
    return np.frombuffer(words.tobytes(), dtype=np.dtype((np.void, 4 * SIGN_WORDS))).copy()


def fwht_defines(head_dim: int, dtype: str, out_f32: bool) -> dict:
    return dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, ROWS_PER_BLOCK=FWHT_ROWS_PER_BLOCK,
                OUT_F32=int(out_f32))


def resolve_signs(head_dim: int, signs=None, seed=None):
    """The signs of a call: ``signs`` as given, else drawn from ``seed``, else None (no D)."""
    if signs is not None and seed is not None:
        raise ValueError("signs: pass signs or seed, not both")
    if signs is not None:
        s = np.asarray(signs, dtype=np.float64)
        if s.shape != (head_dim,):
            raise ValueError(f"signs: expected shape ({head_dim},), got {s.shape}")
        return s
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed: expected an int or None, got {seed!r}")
        return signs_for(head_dim, int(seed))
    return None


def _check(x, out_dtype):
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        raise ValueError(f"x: expected an array whose last axis is the row, got {type(x).__name__}")
    dtype = cv.check_dtype(x, "x", FWHT_DTYPES)
    d = int(shape[-1])
    if d not in FWHT_HEAD_DIMS:
        raise ValueError(f"x: the last axis must be one of {FWHT_HEAD_DIMS} (a power of two), got {d}")
    if out_dtype not in (None, dtype, "float32"):
        raise ValueError(f"out_dtype: expected None (x's dtype) or 'float32', got {out_dtype!r}")
    return dtype, d, (out_dtype or dtype)


def fwht(x, *, signs=None, seed=None, out_dtype=None):
    """x D H / sqrt(d) along the last axis on the GPU: :func:`iokernels.fp8.randomized_hadamard`.

    ``x``: (..., d), d in (64, 128, 256), float16, bfloat16 or float32; NumPy (copied to the
    device and back) or a device array (torch, CuPy; used in place when contiguous).
    ``signs`` (d values of +-1) or ``seed`` (signs drawn by :func:`signs_for`); neither: no
    sign flips (the plain transform, :func:`iokernels.fp8.fwht`).  ``out_dtype``: None (x's)
    or "float32".  Returns an array of x's kind and shape.
    """
    dtype, d, odt = _check(x, out_dtype)
    s = resolve_signs(d, signs, seed)
    call = Call(x, name="x")
    with on_stream(call.stream_ptr()):
        xd = call.to_device(x, "x")
        y = call.empty(tuple(x.shape), odt)
        launch_fwht(xd, y, dtype=dtype, signs=s, out_f32=odt == "float32" and dtype != "float32")
    return call.finish(y, odt)


def launch_fwht(x, y, *, dtype, signs, out_f32):
    """Launch fwht.cu on device arrays ``x`` -> ``y`` (same shape, ``y`` contiguous), on the
    current stream."""
    xd = device_array(contiguous(x), dtype)
    d = int(xd.shape[-1])
    rows = xd.size // d if d else 0
    if rows == 0:
        return
    yd = device_array(y)
    fn = function("fwht", "fwht", fwht_defines(d, dtype, out_f32))
    bits = sign_bits(signs if signs is not None else np.ones(d))
    grid = (-(-rows // FWHT_ROWS_PER_BLOCK),)
    fn(grid, (32 * FWHT_ROWS_PER_BLOCK,), fwht_args(bits, xd, yd, rows, signs is not None))


def fwht_args(bits, xd, yd, rows, use_signs) -> tuple:
    """fwht.cu: the sign mask (by value), x, y, the row count, whether D is applied."""
    return (bits, xd.arg, yd.arg, np.int32(rows), np.int32(bool(use_signs)))
