"""The exercises of chapters 09a and 09b (asynchrony and low precision), in NumPy.

=======================  ==================================================================
exercise                 what the learner writes (names as in the lab notebook)
=======================  ==================================================================
fwht                     ``fwht``: the fast Walsh-Hadamard transform along the last axis
=======================  ==================================================================

The graders use the package's own implementations (:mod:`iokernels.fp8`,
:mod:`iokernels.tiled`'s conditional rescale) as the reference, bound when this module is
imported; each exercise names them in ``references`` so a solution cannot call them.
Notation: d the head dim (a power of two), H the orthonormal Hadamard matrix, D = diag(signs),
m, l, O the running max, sum and output of the online softmax, tau the threshold (log2 units).
"""
from __future__ import annotations

import numpy as np

from ..fp8 import fwht as _ref_fwht
from ..fp8 import hadamard_matrix as _ref_hadamard
from .engine import Case, CaseReport, Exercise, Mistake, fail, oracle_problem

__all__ = ["FWHT", "EXERCISES"]

_FP8_REFS = ("iokernels.fp8.fwht", "iokernels.fp8.hadamard_matrix", "iokernels.fp8.randomized_hadamard")


def _case(label: str, **p) -> Case:
    return Case(label, p)


def _call_keeping_input(fn, name, *args):
    """fn(*args) on copies; fail if it wrote into the caller's arrays."""
    copies = [np.array(a, copy=True) for a in args]
    out = fn(*copies)
    for a, c in zip(args, copies):
        if c.shape != np.shape(a) or not np.array_equal(c, a, equal_nan=True):
            fail(f"{name} wrote into its input array: return a new array and leave the caller's x as it was",
                 mistake=INPUT_OVERWRITTEN)
    return out


def _shape_of(out, name, expected):
    if out is None:
        fail(f"{name} returned None: return the transformed array")
    if np.shape(out) != tuple(expected):
        fail(f"{name} returned shape {np.shape(out)}, expected {tuple(expected)}: the transform keeps the "
             f"shape of x (it acts along the last axis only)")
    return np.asarray(out)


# =========================================================================== fwht (09b)
NOT_NORMALIZED = Mistake("the 1/sqrt(d) normalization missing",
                         "the butterflies compute x H with entries +-1; divide by sqrt(d) once at the end "
                         "(or by sqrt(2) per stage) so the transform is orthonormal and applying it twice gives x.")
DIVIDED_BY_D = Mistake("divided by d instead of sqrt(d)",
                       "H H = d I for the +-1 matrix, so the orthonormal transform is x H / sqrt(d), not / d.")
PAIR_OVERWRITTEN = Mistake("a pair overwritten before it is used",
                           "keep a copy of a before writing a + b into it: the pair (a, b) becomes "
                           "(a + b, a - b), both from the old values.")
SWAPPED_DIFFERENCE = Mistake("b - a instead of a - b",
                             "the butterfly is (a, b) -> (a + b, a - b): Sylvester's H_2n = [[H, H], [H, -H]].")
INPUT_OVERWRITTEN = Mistake("the input modified in place",
                            "work on a copy (np.array(x, dtype=float)): the caller's x must not change.")
NO_POWER_CHECK = Mistake("no check that the length is a power of two",
                         "raise ValueError naming x when x.shape[-1] is not a power of two (d & (d - 1) != 0).")


def _butterflies(x, overwrite=False, swapped=False):
    """The unnormalized transform, optionally with one known mistake (a model of the error)."""
    a = np.array(x, dtype=np.float64)
    d, h = a.shape[-1], 1
    while h < d:
        pairs = a.reshape(*a.shape[:-1], d // (2 * h), 2, h)
        top, bottom = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :] = top + bottom
        if overwrite:
            pairs[..., 1, :] = (top + bottom) - bottom
        else:
            pairs[..., 1, :] = bottom - top if swapped else top - bottom
        h *= 2
    return a


def _fwht_mutants(x):
    d = x.shape[-1]
    raw = _butterflies(x)
    return [(NOT_NORMALIZED, raw), (DIVIDED_BY_D, raw / d),
            (PAIR_OVERWRITTEN, _butterflies(x, overwrite=True) / np.sqrt(d)),
            (SWAPPED_DIFFERENCE, _butterflies(x, swapped=True) / np.sqrt(d))]


def _grade_fwht(fwht, case, rng):
    p = case.params
    shape, dtype = p["shape"], p.get("dtype", "float64")
    x = rng.standard_normal(shape) * 3
    if p.get("bad"):
        try:
            fwht(x.copy())
        except ValueError as exc:
            return CaseReport(notes=[f"a length of {shape[-1]} is refused: {exc}"])
        fail(f"fwht accepted a last axis of length {shape[-1]}, which is not a power of two: raise ValueError",
             mistake=NO_POWER_CHECK)
    x = x.astype(dtype)
    out = _shape_of(_call_keeping_input(fwht, "fwht", x), "fwht", shape)
    ref = _ref_fwht(x.astype(np.float64))
    baseline = None
    if dtype != "float64":                                 # the naive O(d^2) product in the same precision
        baseline = (x @ _ref_hadamard(shape[-1]).astype(dtype)).astype(np.float64)
    report = CaseReport()
    oracle_problem(np.asarray(out, np.float64), ref, baseline, name="fwht(x)", dtype=dtype, report=report,
                   mistakes=_fwht_mutants(x))
    return report


FWHT = Exercise(
    name="fwht", title="The fast Walsh-Hadamard transform", entry="fwht",
    spec=("fwht(x) -> y: y = x H / sqrt(d) along the last axis, H the d x d Sylvester Hadamard matrix "
          "(H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), d = x.shape[-1] a power of two.  Work in "
          "O(d log d) per row: log2(d) butterfly stages, stage h (h = 1, 2, 4, ...) replacing each pair (a, b) "
          "at distance h, within blocks of 2h, by (a + b, a - b).  Any leading axes are batch axes.  Return a "
          "new float array (leave x unchanged); raise ValueError naming x when d is not a power of two.  "
          "Graded against the float64 oracle (float32 inputs: 2x the naive x @ H in float32)."),
    cases=lambda: [_case("x (5, 8)", shape=(5, 8)), _case("x (3, 2, 64)", shape=(3, 2, 64)),
                   _case("x (4, 1): d = 1", shape=(4, 1)), _case("x (6, 2)", shape=(6, 2)),
                   _case("x (2, 128) float32", shape=(2, 128), dtype="float32"),
                   _case("x (3, 12): not a power of two", shape=(3, 12), bad=True)],
    grade_case=_grade_fwht, seed=909,
    hint="one stage per bit of d; each stage touches every element once; divide by sqrt(d) at the end.",
    mistakes=(NOT_NORMALIZED, DIVIDED_BY_D, PAIR_OVERWRITTEN, SWAPPED_DIFFERENCE, INPUT_OVERWRITTEN,
              NO_POWER_CHECK),
    references=_FP8_REFS)


EXERCISES = (FWHT,)
