"""The exercises of chapters 09-13: a correct solution passes, a stub fails, each known mistake
is named, and a wrong shape gets a message that says what was expected."""
from __future__ import annotations

import numpy as np
import pytest

from iokernels import labs
from iokernels.labs import exercises_hopper as eh
from iokernels.labs import exercises_scale as es


# --------------------------------------------------------------------------- correct solutions
def fwht(x):
    a = np.array(x, dtype=np.float64)
    d = a.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: the last axis must have a power-of-two length, got {d}")
    h = 1
    while h < d:
        pairs = a.reshape(*a.shape[:-1], d // (2 * h), 2, h)
        top, bottom = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :] = top + bottom
        pairs[..., 1, :] = top - bottom
        h *= 2
    return a / np.sqrt(d)


def merge_pair(o, lse, o_b, lse_b):
    live, live_b = np.isfinite(lse), np.isfinite(lse_b)
    both = live & live_b
    m = np.where(both, np.maximum(lse, lse_b), 0.0)
    w = np.where(both, np.exp(np.where(both, lse - m, 0.0)), 0.0)
    w_b = np.where(both, np.exp(np.where(both, lse_b - m, 0.0)), 0.0)
    tot = np.where(both, w + w_b, 1.0)
    o_both = (w[:, None] * o + w_b[:, None] * np.where(both[:, None], o_b, 0.0)) / tot[:, None]
    o_new = np.where(both[:, None], o_both, np.where(live_b[:, None], o_b, o))
    lse_new = np.where(both, m + np.log(tot), np.where(live_b, lse_b, lse))
    return o_new, lse_new


SOLUTIONS = {"fwht": fwht, "merge_pair": merge_pair}


def _grade(name, solution):
    return labs.check(name, solution)


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_solution_passes(name):
    r = _grade(name, SOLUTIONS[name])
    assert r.passed, str(r)
    assert r.cases_run == len(labs.EXERCISES[name].cases())


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_stub_and_none_fail(name):
    def stub(*args, **kw):
        raise NotImplementedError("write this part")
    r = _grade(name, stub)
    assert not r.passed and "not written yet" in r.message
    r = labs.check(name, None)
    assert not r.passed and "nothing to grade yet" in r.message


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_exercise_declares_references_and_mistakes(name):
    e = labs.EXERCISES[name]
    assert e.references and all(r.startswith("iokernels.") for r in e.references)
    assert e.mistakes


# --------------------------------------------------------------------------- fwht
def test_fwht_mutants_are_named():
    for mistake, wrong in [(eh.NOT_NORMALIZED, lambda x: eh._butterflies(x)),
                           (eh.DIVIDED_BY_D, lambda x: eh._butterflies(x) / x.shape[-1]),
                           (eh.PAIR_OVERWRITTEN, lambda x: eh._butterflies(x, overwrite=True) / np.sqrt(x.shape[-1])),
                           (eh.SWAPPED_DIFFERENCE, lambda x: eh._butterflies(x, swapped=True) / np.sqrt(x.shape[-1]))]:
        r = labs.check("fwht", wrong)
        assert not r.passed and r.mistake == mistake.name, str(r)


def test_fwht_in_place_and_missing_check_are_named():
    def in_place(x):
        x[...] = fwht(x)
        return x
    r = labs.check("fwht", in_place)
    assert r.mistake == eh.INPUT_OVERWRITTEN.name, str(r)

    def no_check(x):
        d = x.shape[-1]
        if d & (d - 1):
            return np.zeros_like(x)
        return fwht(x)
    r = labs.check("fwht", no_check)
    assert r.mistake == eh.NO_POWER_CHECK.name and "not a power of two" in r.message, str(r)


def test_fwht_bad_shape_teaches():
    r = labs.check("fwht", lambda x: fwht(x).reshape(-1))
    assert not r.passed and "expected" in r.message and "last axis" in r.message, str(r)


def test_fwht_grader_agrees_with_the_matrix():
    x = np.random.default_rng(0).standard_normal((3, 16))
    from iokernels import fp8
    assert np.allclose(fwht(x), x @ fp8.hadamard_matrix(16), atol=1e-13)


# --------------------------------------------------------------------------- merge_pair
@pytest.mark.parametrize("mistake, kind", es._PAIR_MUTANTS)
def test_merge_pair_mutants_are_named(mistake, kind):
    r = labs.check("merge_pair", es._mutant_pair(kind))
    assert not r.passed and r.mistake == mistake.name, str(r)


def test_merge_pair_empty_block_nan_is_named():
    def careless(o, lse, o_b, lse_b):              # multiplies an empty block's NaN O by weight 0
        m = np.maximum(lse, lse_b)
        mm = np.where(np.isfinite(m), m, 0.0)
        w, w_b = np.exp(lse - mm), np.exp(lse_b - mm)
        return ((w[:, None] * o + w_b[:, None] * o_b) / (w + w_b)[:, None], mm + np.log(w + w_b))
    with np.errstate(all="ignore"):
        r = labs.check("merge_pair", careless)
    assert not r.passed and r.mistake == es.EMPTY_PART_NAN.name and "NaN" in r.message, str(r)


def test_merge_pair_bad_shape_and_return_teach():
    r = labs.check("merge_pair", lambda o, lse, o_b, lse_b: merge_pair(o, lse, o_b, lse_b)[0])
    assert not r.passed and "pair" in r.message, str(r)
    r = labs.check("merge_pair", lambda o, lse, o_b, lse_b: (merge_pair(o, lse, o_b, lse_b)[0].T,
                                                               merge_pair(o, lse, o_b, lse_b)[1]))
    assert not r.passed and "expected" in r.message and "shape" in r.message, str(r)


def test_the_package_merge_passes_its_own_grader():
    from iokernels.context_parallel.merge import merge_pair as package_merge
    assert labs.check("merge_pair", package_merge).passed
