"""The exercises of chapters 11-13 (varlen batches, the ring, decode at model scale), in NumPy.

=======================  ==================================================================
exercise                 what the learner writes (names as in the lab notebooks)
=======================  ==================================================================
merge_pair               ``merge_pair``: ring attention's exact merge of two (O, LSE) states
zigzag_split             ``zigzag_split``: the load-balanced causal split of a sequence over
                         W ranks (exact attention after reassembly, bytes and work per rank)
kv_bytes_per_token       ``kv_bytes_per_token``: a model's KV-cache bytes per token from its
                         config.json (MHA, GQA, MQA, MLA's latent row)
=======================  ==================================================================

The graders use the package's own implementations as the reference
(:mod:`iokernels.context_parallel`, :mod:`iokernels.models`), bound when this module is
imported; each exercise names them in ``references`` so a solution cannot call them.
Notation as in :mod:`iokernels.context_parallel`: W ranks, O and LSE the running state,
O_b and LSE_b one block's partial result.
"""
from __future__ import annotations

import numpy as np

from ..context_parallel.merge import merge_pair as _ref_merge_pair
from .engine import Case, CaseReport, Exercise, Mistake, fail, oracle_problem
from .exercises import EMPTY_PART_NAN, NO_MAX_SHIFT, _parts

__all__ = ["MERGE_PAIR", "EXERCISES"]


def _case(label: str, **p) -> Case:
    return Case(label, p)


# =========================================================================== merge_pair (12)
SWAPPED_WEIGHTS = Mistake("the two sides' weights swapped",
                          "O' = O - sigmoid(LSE_b - LSE) (O - O_b): the block's weight grows with LSE_b, "
                          "so a block that saw much larger scores takes over O.")
MAX_NOT_LOGADDEXP = Mistake("LSE' = max(LSE, LSE_b)",
                            "the merged LSE is log(exp LSE + exp LSE_b) = max + log(1 + exp(-|LSE - LSE_b|)), "
                            "not the max: the smaller side's keys still add to the sum.")


def _mutant_pair(kind):
    """merge_pair with one known mistake (a model of the error; empty sides handled correctly)."""
    def merge(o, lse, o_b, lse_b):
        live, live_b = np.isfinite(lse), np.isfinite(lse_b)
        both = live & live_b
        with np.errstate(all="ignore"):
            if kind == "no shift":
                w, w_b = np.exp(lse), np.exp(lse_b)
                o_m = (w[:, None] * o + w_b[:, None] * o_b) / (w + w_b)[:, None]
                lse_m = np.log(w + w_b)
            else:
                sig = 1.0 / (1.0 + np.exp(-(lse_b - lse)))
                if kind == "swapped":
                    sig = 1.0 - sig
                o_m = o - sig[:, None] * (o - o_b)
                lse_m = np.maximum(lse, lse_b) if kind == "max" else np.logaddexp(lse, lse_b)
        o_new = np.where(both[:, None], o_m, np.where(live_b[:, None], o_b, o))
        lse_new = np.where(both, lse_m, np.where(live_b, lse_b, lse))
        return o_new, lse_new
    return merge


_PAIR_MUTANTS = ((NO_MAX_SHIFT, "no shift"), (SWAPPED_WEIGHTS, "swapped"), (MAX_NOT_LOGADDEXP, "max"))


def _ring_chain(merge, o_parts, lse_parts, acc=np.float64):
    """Fold every block into the running state as a ring does: start O = 0, LSE = -inf."""
    S, R, d = o_parts.shape
    o, lse = np.zeros((R, d), acc), np.full(R, -np.inf, acc)
    for s in range(S):
        out = merge(o.copy(), lse.copy(), o_parts[s].astype(acc), lse_parts[s].astype(acc))
        if not (isinstance(out, tuple) and len(out) == 2):
            fail("merge_pair must return the pair (o_new, lse_new)")
        o, lse = out
        if np.shape(o) != (R, d) or np.shape(lse) != (R,):
            fail(f"merge_pair returned o of shape {np.shape(o)} and lse of shape {np.shape(lse)}; expected "
                 f"{(R, d)} and {(R,)}: the same shapes as the running state it was given")
        o, lse = np.asarray(o), np.asarray(lse)
    return o, lse


def _grade_merge_pair(merge, case, rng):
    p = case.params
    o_parts, lse_parts, ref_o, ref_lse = _parts(rng, p)
    acc = np.dtype(p.get("dtype", "float64"))
    with np.errstate(all="ignore"):
        o, lse = _ring_chain(merge, o_parts, lse_parts, acc)
        wrong = [(m, _ring_chain(_mutant_pair(kind), o_parts, lse_parts)) for m, kind in _PAIR_MUTANTS]
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    report = CaseReport()
    if np.isnan(o).any() or np.isnan(lse).any():
        rows = sorted(set(np.flatnonzero(np.isnan(o).any(1))) | set(np.flatnonzero(np.isnan(lse))))
        mistake = NO_MAX_SHIFT if p.get("boost") else EMPTY_PART_NAN
        fail(f"the merged state has NaN in rows {rows[:6]} (row 0 sees no key in any block; block 1 is "
             f"empty, with O_b = NaN)", report, mistake)
    baseline = None
    if acc != np.float64:                                    # the package's merge in the same precision
        b_o, b_lse = _ring_chain(_ref_merge_pair, o_parts, lse_parts, acc)
        baseline = (b_o.astype(np.float64), b_lse.astype(np.float64))
    dtype = acc.name
    oracle_problem(o, ref_o, None if baseline is None else baseline[0], name="O", dtype=dtype, report=report,
                   masked_rows=np.isneginf(ref_lse)[:, None], mistakes=[(m, w[0]) for m, w in wrong])
    oracle_problem(lse, ref_lse, None if baseline is None else baseline[1], name="LSE", dtype=dtype,
                   report=report, mistakes=[(m, w[1]) for m, w in wrong])
    return report


MERGE_PAIR = Exercise(
    name="merge_pair", title="Ring attention's pairwise merge, empty blocks included", entry="merge_pair",
    spec=("merge_pair(o, lse, o_b, lse_b) -> (o_new, lse_new): merge one block's partial result (o_b (rows, d) "
          "normalized, lse_b (rows,)) into the running state (o, lse), exactly: lse_new = log(exp lse + exp "
          "lse_b), o_new = the two outputs weighted by exp(lse - lse_new) and exp(lse_b - lse_new).  No "
          "overflow for LSEs in the hundreds; a side with LSE = -inf (no key seen) weighs exactly 0 and its O "
          "may hold anything, even NaN; two empty sides give (o, -inf).  The grader chains it over a ring's "
          "blocks from o = 0, lse = -inf, in the precision of its inputs (float64, and float32: 2x the package's "
          "merge in float32)."),
    cases=lambda: [_case("rows=6 blocks=4 d=9", rows=6, N=40, parts=4, d=9),
                   _case("rows=5 blocks=3 d=7, scores in the hundreds", rows=5, N=31, parts=3, d=7, boost=400.0),
                   _case("rows=7 blocks=5 d=16 float32", rows=7, N=45, parts=5, d=16, dtype="float32")],
    grade_case=_grade_merge_pair, seed=1212,
    hint="LSE' = max + log(exp(LSE - max) + exp(LSE_b - max)); O' = O - sigmoid(LSE_b - LSE) (O - O_b).",
    mistakes=(EMPTY_PART_NAN, NO_MAX_SHIFT, SWAPPED_WEIGHTS, MAX_NOT_LOGADDEXP),
    references=("iokernels.context_parallel.merge.merge_pair", "iokernels.context_parallel.merge_pair",
                "iokernels.decode.merge_states", "iokernels.merge_states", "iokernels.api.merge_states"))


EXERCISES = (MERGE_PAIR,)
