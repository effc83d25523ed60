"""FlashAttention-4's two softmax tricks, in NumPy: a software exp2 and conditional rescaling.

On Blackwell the tensor cores doubled their throughput while the exponential units (SFU)
did not (Zadouri, Hoehnerbach, Shah, Liu, Thakkar, Dao, "FlashAttention-4", 2026), so at
d = 128 the exponentials alone take about as long as the matmuls
(:func:`iokernels.hopper_schedule.sfu_share_table`).  FlashAttention-4 answers twice:

- **Software exp2.**  Compute 2^x for part of the elements on the FMA units instead of the
  SFU: clamp x, split it into an integer n = floor(x) and a fraction f = x - n in [0, 1),
  approximate 2^f with a degree-3 polynomial (Horner's rule: 3 FMAs), and add n to the
  exponent bits of the result with one integer add.  The paper gives the method and its
  error; the coefficients are in the code (``POLY_EX2`` in flash_attn/cute/utils.py of the
  FlashAttention repository, fitted there with Sollya's fpminimax).  Its relative error only needs to be
  below what rounding P to bfloat16 for the next matmul loses anyway.
- **Conditional rescaling.**  Only move the running maximum, and rescale O and l, when the
  maximum has grown by more than a threshold (8 in log2 units for 16-bit inputs); the
  final O / l is exact either way.  It is an option of the tiled forward,
  ``TileConfig(rescale_threshold=...)`` (:mod:`iokernels.tiled`); :func:`rescale_survey`
  counts how often it skips.

Notation:

=========  ================================================================
x          the exponent, S * log2(e) - m in log2 units (x <= 0 in a softmax)
n, f       floor(x) and x - floor(x), the integer and fraction parts
c_k        the polynomial's coefficients: 2^f ~ c0 + c1 f + c2 f^2 + c3 f^3
tau        the rescale threshold, log2 units
m, l, O    running maximum, row sum and output accumulator (as in ``tiled``)
=========  ================================================================

Frank notes: NumPy runs the polynomial as vector arithmetic, so nothing here is faster
than ``np.exp2``; the point is the error bound and the bit trick, which are exactly those
of the GPU version.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FA4_EXP2_COEFFS", "BF16_HALF_ULP", "EXP2_MIN", "EXP2_MAX", "software_exp2", "fit_exp2_poly",
           "exp2_max_rel_error", "rescale_survey"]

#: the degree-3 polynomial for 2^f on [0, 1) that FlashAttention-4 uses (c0 .. c3), rounded to
#: four digits: from the code, POLY_EX2 in flash_attn/cute/utils.py (a Sollya fpminimax fit),
#: not from the paper, which gives the method and the error bound
FA4_EXP2_COEFFS = (1.0, 0.6951, 0.2276, 0.0771)
#: the smallest relative half-ulp of bfloat16 (7 mantissa bits: the spacing is 2^-7 of the
#: binade's bottom, so half of it, near the binade's top, is 2^-8 / 2 = 2^-9 relative)
BF16_HALF_ULP = 2.0 ** -9
#: clamp range of x: n = floor(x) in [-126, 127] keeps 2^n a normal float32 (exponent field 1 .. 254)
EXP2_MIN, EXP2_MAX = -126.0, 127.0
#: float32's mantissa bits (stored fraction bits): the exponent field starts at bit 23
F32_MANTISSA_BITS = 23


def software_exp2(x, coeffs=FA4_EXP2_COEFFS) -> np.ndarray:
    """2^x in float32 the FlashAttention-4 way: clamp, split, polynomial, exponent bits added.

    Inputs below -126 give 2^-126 (about 1e-38) instead of a smaller number: in a softmax,
    next to a maximum term of 1, that is 0 for every practical purpose.
    """
    x = np.clip(np.asarray(x, dtype=np.float32), np.float32(EXP2_MIN), np.float32(EXP2_MAX))
    n = np.floor(x)
    f = x - n                                            # in [0, 1)
    c = [np.float32(ci) for ci in coeffs]
    p = c[-1]
    for ck in reversed(c[:-1]):                          # Horner: one FMA per coefficient
        p = p * f + ck
    p = np.asarray(p, dtype=np.float32)                  # 2^f, in [1, 2)
    bits = p.view(np.int32) + (n.astype(np.int32) << F32_MANTISSA_BITS)   # multiply by 2^n: add to the exponent
    return bits.view(np.float32)


def fit_exp2_poly(degree: int = 3, nodes: int = 64) -> tuple:
    """Coefficients (c0, c1, ...) of a near-minimax polynomial for 2^f on [0, 1]: least squares
    of the relative error at Chebyshev nodes, with c0 = 1 so that 2^0 is exact."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= 8:
        raise ValueError(f"degree: expected an int in [1, 8], got {degree!r}")
    t = 0.5 - 0.5 * np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)     # Chebyshev nodes on [0, 1]
    y = np.exp2(t)
    a = np.stack([t ** k for k in range(1, degree + 1)], axis=1) / y[:, None]   # relative-error weights
    rest, *_ = np.linalg.lstsq(a, (y - 1.0) / y, rcond=None)
    return (1.0, *map(float, rest))


def exp2_max_rel_error(coeffs=FA4_EXP2_COEFFS, samples: int = 1 << 16, lo: float = -30.0,
                       hi: float = 30.0) -> float:
    """max |software_exp2(x) - 2^x| / 2^x over ``samples`` points of [lo, hi) (float64 truth),
    every fraction f covered: the same relative error repeats in every binade."""
    x = np.linspace(lo, hi, samples, endpoint=False, dtype=np.float32)
    exact = np.exp2(x.astype(np.float64))
    return float(np.max(np.abs(software_exp2(x, coeffs).astype(np.float64) - exact) / exact))


def rescale_survey(rng: np.random.Generator, seqlens=(256, 1024, 4096), spreads=(1.0, 3.0), threshold=8.0,
                   head_dim=64, seqlen_q=64, block=64, dtype="float32") -> list[dict]:
    """How often conditional rescaling skips, against the key count N and the score spread.

    For each N and spread s: q, k ~ s * N(0, 1) (so scores q.k / sqrt(d) have standard
    deviation s^2), ``seqlen_q`` queries against N keys, tiles of ``block``.  Each row reports
    the rescales needed (a row maximum grew) and skipped, and the largest error against the
    float64 oracle next to always rescaling's.
    """
    from . import tiled
    from .core import reference
    from .core.config import TileConfig
    from .core.testing import numpy_dtype
    dt = numpy_dtype(dtype)
    rows = []
    for n in seqlens:
        for s in spreads:
            q = (s * rng.standard_normal((1, 1, seqlen_q, head_dim))).astype(dt)
            k = (s * rng.standard_normal((1, 1, n, head_dim))).astype(dt)
            v = rng.standard_normal((1, 1, n, head_dim)).astype(dt)
            ref, _ = reference.attention(q, k, v)
            kw = dict(causal=False, scale=head_dim ** -0.5, window=None)
            count = tiled.RescaleCount()
            cond, _ = tiled.forward_fa2(q, k, v, config=TileConfig(block_q=block, block_k=block,
                                        rescale_threshold=threshold), rescale_stats=count, **kw)
            always, _ = tiled.forward_fa2(q, k, v, config=TileConfig(block_q=block, block_k=block), **kw)
            rows.append(dict(seqlen_k=n, spread=s, tiles=-(-n // block), needed=count.needed,
                             skipped=count.skipped, skipped_fraction=count.skipped / max(1, count.needed),
                             err_conditional=float(np.max(np.abs(cond.astype(np.float64) - ref))),
                             err_always=float(np.max(np.abs(always.astype(np.float64) - ref)))))
    return rows
