"""The exercises of chapters 09a and 09b (asynchrony and low precision), in NumPy.

=======================  ==================================================================
exercise                 what the learner writes (names as in the lab notebook)
=======================  ==================================================================
fwht                     ``fwht``: the fast Walsh-Hadamard transform along the last axis
randomized_hadamard      ``randomized_hadamard``: x D H / sqrt(d), the incoherent processing
                         of FlashAttention-3's FP8 path (Q K^T unchanged, outliers spread)
rescale_threshold_step   ``rescale_step``: the online-softmax step with FlashAttention-4's
                         conditional rescale (graded on O, LSE and the number of rescales)
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
from ..fp8 import outlier_inputs as _outlier_inputs
from ..fp8 import random_signs as _random_signs
from ..fp8 import randomized_hadamard as _ref_randomized
from ..tiled import LOG2_E, RescaleCount, _Rescale
from .engine import Case, CaseReport, Exercise, Mistake, fail, oracle_problem
from .exercises import MASKED_NAN

__all__ = ["FWHT", "RANDOMIZED_HADAMARD", "RESCALE_THRESHOLD_STEP", "EXERCISES"]

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
    cases=lambda: [_case("x (5, 8)", shape=(5, 8)),
                   _case("x (3, 2, 64)", shape=(3, 2, 64)), _case("x (4, 1): d = 1", shape=(4, 1)),
                   _case("x (6, 2)", shape=(6, 2)),
                   _case("x (2, 128) float32", shape=(2, 128), dtype="float32"),
                   _case("x (3, 12): not a power of two", shape=(3, 12), bad=True)],
    grade_case=_grade_fwht, seed=939,
    hint="one stage per bit of d; each stage touches every element once; divide by sqrt(d) at the end.",
    mistakes=(NOT_NORMALIZED, DIVIDED_BY_D, PAIR_OVERWRITTEN, SWAPPED_DIFFERENCE, INPUT_OVERWRITTEN,
              NO_POWER_CHECK),
    references=_FP8_REFS)



# =========================================================================== randomized Hadamard (09b)
SIGNS_AFTER = Mistake("the signs applied after the transform",
                      "the randomized transform is x D H / sqrt(d): multiply x by the signs first, then transform "
                      "(x H D is orthogonal too, but it is not the transform Q and K were specified to share).")
SIGNS_IGNORED = Mistake("the random signs ignored",
                        "multiply each column j of x by signs[j] before the transform: without D an adversarial "
                        "(or unlucky) input can stay spiky after H.")
RH_NOT_NORMALIZED = Mistake("the 1/sqrt(d) normalization missing",
                            "x D H with entries +-1 scales Q K^T by d: divide by sqrt(d) so the transform is "
                            "orthonormal and Q K^T is unchanged.")
NO_SIGNS_CHECK = Mistake("no check of the signs' shape",
                         "raise ValueError naming signs when signs.shape != (x.shape[-1],).")


def _incoherence(x) -> float:
    """max |x| / rms(x): how spiky a tensor is (about 4 for Gaussian data of this size, far more with outliers)."""
    x = np.asarray(x, np.float64)
    return float(np.max(np.abs(x)) / np.sqrt(np.mean(x * x)))


def _grade_randomized(rh, case, rng):
    p = case.params
    d = p["d"]
    q, k, _ = _outlier_inputs(rng, batch=1, heads=p["heads"], seqlen_q=p["Nq"], seqlen_k=p["Nk"], head_dim=d)
    signs = _random_signs(d, rng)
    if p.get("bad"):
        try:
            rh(q.copy(), signs[:-1].copy())
        except ValueError as exc:
            return CaseReport(notes=[f"signs of the wrong length are refused: {exc}"])
        fail(f"randomized_hadamard accepted {d - 1} signs for a head dim of {d}: raise ValueError naming signs",
             mistake=NO_SIGNS_CHECK)
    qr = _shape_of(_call_keeping_input(rh, "randomized_hadamard", q, signs), "randomized_hadamard", q.shape)
    kr = _shape_of(_call_keeping_input(rh, "randomized_hadamard", k, signs), "randomized_hadamard", k.shape)
    mutants = [(SIGNS_AFTER, lambda x: _ref_fwht(x) * signs), (SIGNS_IGNORED, _ref_fwht),
               (RH_NOT_NORMALIZED, lambda x: _butterflies(x * signs))]
    report = CaseReport()
    oracle_problem(np.asarray(kr, np.float64), _ref_randomized(k, signs), None, name="randomized_hadamard(K)",
                   dtype="float64", report=report, mistakes=[(m, f(k)) for m, f in mutants])
    scores = np.einsum("bhqd,bhkd->bhqk", q, k)
    rotated = np.einsum("bhqd,bhkd->bhqk", np.asarray(qr, np.float64), np.asarray(kr, np.float64))
    oracle_problem(rotated, scores, None, name="Q' K'^T", dtype="float64", report=report,
                   mistakes=[(RH_NOT_NORMALIZED, scores * d)])
    before, after, ref_after = _incoherence(k), _incoherence(kr), _incoherence(_ref_randomized(k, signs))
    if after > ref_after * (1 + 1e-9):
        fail(f"max|K'| / rms(K') = {after:.3g} after the transform, the reference reaches {ref_after:.3g}", report)
    report.notes.append(f"K's max |x| / rms fell from {before:.1f} to {after:.1f}; Q K^T unchanged to "
                        f"{report.error:.1e}")
    return report


RANDOMIZED_HADAMARD = Exercise(
    name="randomized_hadamard", title="The randomized Hadamard transform: Q K^T unchanged, outliers spread",
    entry="randomized_hadamard",
    spec=("randomized_hadamard(x, signs) -> x D H / sqrt(d) along the last axis: D = diag(signs), signs (d,) "
          "of +-1, H the Sylvester Hadamard matrix, d = x.shape[-1] a power of two (use your fwht).  Q and K "
          "rotated with the same signs give the same Q K^T, since D H / sqrt(d) is orthogonal.  Return a new "
          "array; raise ValueError naming signs when its shape is not (d,).  Graded on K' against the float64 "
          "oracle, on Q' K'^T against Q K^T, and on the outlier reduction (max |K'| / rms K') on inputs with "
          "FlashAttention-3's outliers (N(0, 1) plus rare N(0, 10^2) entries)."),
    cases=lambda: [_case("Q (1, 2, 9, 64), K (1, 2, 33, 64)", heads=2, Nq=9, Nk=33, d=64),
                   _case("Q (1, 1, 5, 128), K (1, 1, 70, 128)", heads=1, Nq=5, Nk=70, d=128),
                   _case("Q (1, 3, 4, 16), K (1, 3, 7, 16)", heads=3, Nq=4, Nk=7, d=16),
                   _case("signs of the wrong length", heads=1, Nq=2, Nk=2, d=32, bad=True)],
    grade_case=_grade_randomized, seed=919,
    hint="signs first (x * signs), then your fwht; the same signs for Q and for K.",
    mistakes=(SIGNS_AFTER, SIGNS_IGNORED, RH_NOT_NORMALIZED, NO_SIGNS_CHECK, INPUT_OVERWRITTEN),
    references=_FP8_REFS + ("iokernels.fp8.fp8_attention",))


# =========================================================================== conditional rescale (09a)
ALWAYS_RESCALE = Mistake("the threshold ignored (the maximum moved every time it grew)",
                         "keep the old m while the growth (tile max - m) * log2(e) is at most tau: only a larger "
                         "growth moves m and rescales l and O.")
NATURAL_UNITS = Mistake("the growth compared in natural-log units",
                        "tau is in log2 units (the kernel works with exp2): compare (tile max - m) * log2(e), "
                        "not (tile max - m), against tau.")
TEST_REVERSED = Mistake("the test reversed (skipped when the growth is large)",
                        "skip the rescale when the growth is small (<= tau); a large growth must move m, or P "
                        "grows as 2^growth and overflows.")
STALE_P = Mistake("P against the new max while l and O keep the old one",
                  "when the rescale is skipped, P = exp(S - m_old) too: l, O and P must all be relative to the "
                  "same (kept) maximum.")


def _threshold_mutant(kind):
    """The conditional step with one known mistake (a model of the error, not the kernel)."""
    def step(m, l, o, s, v, threshold):
        tile = s.max(axis=1)
        grown = np.maximum(m, tile)
        need = np.isfinite(m) & (tile > m)
        with np.errstate(invalid="ignore"):
            growth = (tile - m) * (1.0 if kind == "natural" else LOG2_E)
            keep = need & ((growth > threshold) if kind == "reversed" else (growth <= threshold))
        if kind == "always":
            keep = np.zeros_like(need)
        m_new = np.where(keep, m, grown)
        ref = np.where(np.isneginf(m_new), 0.0, m_new)
        p_ref = np.where(np.isneginf(grown), 0.0, grown) if kind == "stale" else ref
        alpha = np.exp(m - ref)
        pe = np.exp(s - p_ref[:, None])
        return m_new, alpha * l + pe.sum(axis=1), alpha[:, None] * o + pe @ v
    return step


_THRESHOLD_MUTANTS = ((ALWAYS_RESCALE, "always"), (NATURAL_UNITS, "natural"), (TEST_REVERSED, "reversed"),
                      (STALE_P, "stale"))


def _fold_counting(step, s, v, bc, threshold):
    """Fold the blocks; finalize to (O, LSE); count the rescales: steps where a finite m moved."""
    rows, d = s.shape[0], v.shape[1]
    m, l, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d))
    moves = 0
    with np.errstate(all="ignore"):
        for c0 in range(0, s.shape[1], bc):
            out = step(m.copy(), l.copy(), o.copy(), s[:, c0:c0 + bc].copy(), v[c0:c0 + bc].copy(), threshold)
            if not (isinstance(out, tuple) and len(out) == 3):
                fail("rescale_step must return the triple (m_new, l_new, o_new)")
            m_new, l, o = (np.asarray(x, float) for x in out)
            if m_new.shape != (rows,) or l.shape != (rows,) or o.shape != (rows, d):
                fail(f"rescale_step returned m, l, o of shapes {m_new.shape}, {l.shape}, {o.shape}; expected "
                     f"{(rows,)}, {(rows,)}, {(rows, d)}")
            moves += int(np.sum(np.isfinite(m) & (m_new != m)))
            m = m_new
        empty = l == 0
        out_o = np.where(empty[:, None], 0.0, o / np.where(empty, 1.0, l)[:, None])
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return out_o, lse, moves


def _reference_rescales(s, bc, threshold) -> int:
    """The package's count (its conditional rescale, iokernels.tiled): rescales needed minus skipped."""
    count = RescaleCount()
    rule, m = _Rescale(threshold, count), np.full(s.shape[0], -np.inf)
    for c0 in range(0, s.shape[1], bc):
        m = rule.new_max(m, s[:, c0:c0 + bc].max(axis=1))
    return count.needed - count.skipped


def _grade_threshold(step, case, rng):
    from .exercises import _scores
    p = case.params
    s = _scores(rng, p["rows"], p["N"], p["Bc"]) * p.get("spread", 1.0)
    v = rng.standard_normal((p["N"], p["d"]))
    tau = p["tau"]
    e = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(s).any(1), np.max(s, 1), 0)[:, None]), 0.0)
    tot = e.sum(axis=1)
    with np.errstate(all="ignore"):
        ref_o = np.where(tot[:, None] > 0, (e @ v) / np.where(tot > 0, tot, 1)[:, None], 0.0)
        ref_lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1)) + np.max(s, 1), -np.inf)
    out, lse, moves = _fold_counting(step, s, v, p["Bc"], tau)
    mutants = [(m, _fold_counting(_threshold_mutant(kind), s, v, p["Bc"], tau)) for m, kind in _THRESHOLD_MUTANTS]
    report = CaseReport()
    if np.isnan(out).any() or np.isnan(lse).any():
        fail("O or LSE has NaN (row 0 is fully masked, row 1's first block too)", report, MASKED_NAN)
    oracle_problem(out, ref_o, None, name="O", dtype="float64", report=report, masked_rows=(tot == 0)[:, None],
                   mistakes=[(m, w[0]) for m, w in mutants])
    oracle_problem(lse, ref_lse, None, name="LSE", dtype="float64", report=report,
                   mistakes=[(m, w[1]) for m, w in mutants])
    want = _reference_rescales(s, p["Bc"], tau)
    if moves != want:
        named = next((m for m, w in mutants if w[2] == moves and w[2] != want), None)
        fail(f"the running max moved (a rescale of l and O) {moves} times over the blocks; with tau = {tau:g} "
             f"the conditional rule rescales {want} times", report, named)
    report.notes.append(f"tau = {tau:g}: {moves} rescales, the same count as the reference")
    return report


RESCALE_THRESHOLD_STEP = Exercise(
    name="rescale_threshold_step", title="The online-softmax step with FlashAttention-4's rescale threshold",
    entry="rescale_step",
    spec=("rescale_step(m, l, o, s, v, threshold) -> (m_new, l_new, o_new): online_step (lab 02) with a "
          "conditional rescale.  A row that has seen keys (m finite) keeps its old maximum, and l and O are not "
          "rescaled, while the block's maximum exceeds m by at most tau = threshold in log2 units, i.e. "
          "(rowmax(s) - m) * log2(e) <= tau; a larger growth moves m to the new maximum and rescales as "
          "before.  A row that has seen nothing takes the block's maximum.  P = exp(s - m_new) with the max "
          "actually kept.  Graded on the final O and LSE (float64 oracle) and on the number of rescales: the "
          "(row, block) steps where a finite m changed must equal the reference rule's count."),
    cases=lambda: [_case("rows=6 N=29 Bc=8 d=5 tau=8", rows=6, N=29, Bc=8, d=5, tau=8.0),
                   _case("rows=7 N=64 Bc=8 d=3 tau=8, scores x3", rows=7, N=64, Bc=8, d=3, tau=8.0, spread=3.0),
                   _case("rows=6 N=40 Bc=5 d=9 tau=2", rows=6, N=40, Bc=5, d=9, tau=2.0),
                   _case("rows=5 N=23 Bc=4 d=7 tau=0", rows=5, N=23, Bc=4, d=7, tau=0.0)],
    grade_case=_grade_threshold, seed=929,
    hint="keep = (m finite) & (rowmax(s) > m) & ((rowmax(s) - m) * log2(e) <= tau); m_new = where(keep, m, max).",
    mistakes=(ALWAYS_RESCALE, NATURAL_UNITS, TEST_REVERSED, STALE_P, MASKED_NAN),
    references=("iokernels.tiled._Rescale.new_max", "iokernels.tiled._online_step", "iokernels.tiled.forward_fa2",
                "iokernels.tiled.forward_fa1", "iokernels.tiled.attention", "iokernels.fa4.rescale_survey"))


EXERCISES = (RESCALE_THRESHOLD_STEP, FWHT, RANDOMIZED_HADAMARD)
