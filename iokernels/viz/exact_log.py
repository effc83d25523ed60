"""A log scale whose pixels do not depend on the CPU: the logarithm taken one value at a time.

matplotlib's ``"log"`` scale maps every coordinate through ``np.log10`` (``np.log2`` for
base 2).  NumPy picks a SIMD implementation of those functions for the CPU at run time
(AVX2, AVX-512, ...; NumPy's documentation, "CPU build options", on runtime dispatch and
``NPY_DISABLE_CPU_FEATURES``), and the implementations do not all agree to the last bit
(on an AVX-512 CPU, ``np.exp2(np.float32(127))`` is one unit in the last place above
2^127).  A last bit can move an anti-aliased line's edge by one grey level, so a figure on a
log scale came out a few pixels apart on two CPUs.  This scale is matplotlib's log scale
(the same ticks, limits and labels) with the transform done by Python's ``math.log10`` /
``math.log2`` one element at a time and its inverse by ``base ** x``: scalar C-library
calls, the same whatever NumPy dispatches to.

``ax.set_xscale(exact_log.NAME)`` (or :func:`loglog`, :func:`set_log`) uses it; importing
this module registers it with matplotlib.  :func:`logspace` makes log-spaced data the same
way.  Figures have at most a few thousand points, so the per-element loop costs nothing
visible.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib import scale as mscale
from matplotlib.transforms import Transform

__all__ = ["NAME", "ExactLogScale", "ExactLogTransform", "InvertedExactLogTransform", "set_log",
           "loglog", "logspace"]

#: the scale's name for ``set_xscale`` / ``set_yscale``
NAME = "exact_log"
#: where a non-positive value goes with nonpositive="clip" (matplotlib's LogTransform does the same)
_CLIPPED = -1000.0


def _log_function(base: float):
    if base == 10:
        return math.log10
    if base == 2:
        return math.log2
    if base == math.e:
        return math.log
    log_base = math.log(base)
    return lambda v: math.log(v) / log_base


def _pow(base: float, v: float) -> float:
    try:
        return base ** v
    except OverflowError:
        return math.inf


def _elementwise(fn, values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return np.fromiter((fn(float(v)) for v in a.flat), dtype=np.float64, count=a.size).reshape(a.shape)


class ExactLogTransform(Transform):
    """log_base(x) per element with the C library's scalar logarithm."""

    input_dims = output_dims = 1

    def __init__(self, base: float = 10, nonpositive: str = "clip"):
        super().__init__()
        if base <= 0 or base == 1:
            raise ValueError(f"base: the log base must be > 0 and != 1, got {base!r}")
        if nonpositive not in ("clip", "mask"):
            raise ValueError(f"nonpositive: expected 'clip' or 'mask', got {nonpositive!r}")
        self.base, self.nonpositive = base, nonpositive
        log, bad = _log_function(base), (_CLIPPED if nonpositive == "clip" else math.nan)
        self._log = lambda v: log(v) if v > 0 else (bad if v <= 0 else v)      # NaN stays NaN

    def __str__(self):
        return f"{type(self).__name__}(base={self.base}, nonpositive={self.nonpositive!r})"

    def transform_non_affine(self, values):
        return _elementwise(self._log, values)

    def inverted(self):
        return InvertedExactLogTransform(self.base)


class InvertedExactLogTransform(Transform):
    """base ** x per element (Python's float power, the C library's pow)."""

    input_dims = output_dims = 1

    def __init__(self, base: float = 10):
        super().__init__()
        self.base = base

    def __str__(self):
        return f"{type(self).__name__}(base={self.base})"

    def transform_non_affine(self, values):
        base = float(self.base)
        return _elementwise(lambda v: _pow(base, v), values)

    def inverted(self):
        return ExactLogTransform(self.base)


class ExactLogScale(mscale.LogScale):
    """matplotlib's LogScale (locators, formatters, limits) over :class:`ExactLogTransform`."""

    name = NAME

    def __init__(self, *_axis, base=10, subs=None, nonpositive="clip"):
        # matplotlib < 3.11 passes the Axis first; 3.11 and later pass none to a scale whose
        # signature names no ``axis`` (its LogScale still takes one, optionally, until 3.15)
        try:
            super().__init__(base=base, subs=subs, nonpositive=nonpositive)
        except TypeError:
            super().__init__(None, base=base, subs=subs, nonpositive=nonpositive)
        self._transform = ExactLogTransform(base, nonpositive)


mscale.register_scale(ExactLogScale)


def set_log(ax, axis: str = "both", base: float = 10, **kw) -> None:
    """Put ``ax``'s x axis, y axis or both on the exact log scale (``kw``: subs, nonpositive)."""
    if axis not in ("x", "y", "both"):
        raise ValueError(f"axis: expected 'x', 'y' or 'both', got {axis!r}")
    if axis in ("x", "both"):
        ax.set_xscale(NAME, base=base, **kw)
    if axis in ("y", "both"):
        ax.set_yscale(NAME, base=base, **kw)


def loglog(ax, *args, base: float = 10, **kw):
    """``ax.loglog(*args, **kw)`` on the exact log scale: plots, then sets both axes; returns the lines."""
    lines = ax.plot(*args, **kw)
    set_log(ax, "both", base=base)
    return lines


def logspace(start: float, stop: float, num: int = 50, base: float = 10.0) -> np.ndarray:
    """``np.logspace`` with the powers taken one at a time (``base ** x``), not by a SIMD loop."""
    exps = np.linspace(start, stop, num)
    return _elementwise(lambda v: _pow(float(base), v), exps)
