"""Predict-then-check questions of notebooks 09a and 09b, added to :data:`iokernels.labs.predict.QUESTIONS`.

Importing this module registers them; :func:`reveal` is re-exported so a notebook can write::

    from iokernels.labs.predict_hopper import reveal

Every answer is computed by the package (the lesson modules), never typed in.
"""
from __future__ import annotations

from .predict import QUESTIONS, Question, reveal

__all__ = ["reveal", "HOPPER_QUESTIONS"]


# --------------------------------------------------------------------------- notebook 09a
def _pingpong():
    from .. import hopper_schedule as hs
    return {"utilisation": hs.simulate("pingpong").utilisation}


def _blog_step(kind):
    """The blog post's reported range for the step the model's ``kind`` stands for, as text."""
    from .. import hopper_schedule as hs
    before, (lo, hi) = next((b[2], (s[1], s[2])) for b, s in zip(hs.BLOG_STEPS, hs.BLOG_STEPS[1:]) if s[3] == kind)
    return f"{before:.0f} -> {lo:.0f}-{hi:.0f} TFLOP/s"


def _fa2_prefetch():
    from .. import hopper_schedule as hs
    return {"utilisation": hs.simulate("fa2").utilisation}


def _order_flip():
    from .. import hopper_schedule as hs
    rows = hs.sensitivity(kinds=("warp_specialized", "intra_wg_no_ws"))
    return {"l2_reuse": next(r["l2_reuse"] for r in rows if not r["table2_order_holds"])}


# --------------------------------------------------------------------------- notebook 09b
def _e4m3_mean():
    from .. import fp8
    return {"mean": fp8.rounding_error("e4m3")["mean"]}


def _hadamard_ratio():
    from .. import fp8
    return {"ratio": fp8.error_ratio(fp8.accuracy_experiment(variants=fp8.RATIO_VARIANTS))}


def _max_threshold():
    from .. import fp8
    return {"threshold": fp8.threshold_headroom(8.0)["max_threshold"]}


HOPPER_QUESTIONS = {
    "fa2_prefetch_utilisation": Question(
        "fa2_prefetch_utilisation",
        "the model's tensor-core utilisation for FA2 with its cp.async prefetch (H100 SXM, d = 128, "
        "Br = Bc = 128), as a fraction (the serialized model gives about 0.35)",
        _fa2_prefetch,
        lambda a: (f"{a['utilisation']:.3f}: the prefetch hides every copy under a matmul or the softmax, so only "
                   "the compute is left on the critical path; the paper's 35% for FA2 on an H100 is a "
                   "measurement, and the model with FA2's real load order lands above it."),
        rel_tol=0.1),
    "pingpong_utilisation": Question(
        "pingpong_utilisation",
        "the model's tensor-core utilisation for ping-pong (a producer, two consumer warpgroups; H100 SXM, "
        "d = 128), as a fraction",
        _pingpong,
        lambda a: (f"{a['utilisation']:.3f}: with the exps taking about half of the matmul time, one warpgroup's "
                   "softmax hides entirely under the other's GEMMs, so the model has the tensor cores almost "
                   "never wait; the blog post reports only " + _blog_step("pingpong") + " for this step, since "
                   "the model has no register limits, issue limits or barrier latencies."),
        rel_tol=0.1),
    "table2_order_flip": Question(
        "table2_order_flip",
        "the smallest L2 reuse factor (of 1, 2, 3, 4, 6, 8, 16) at which the model stops ranking warp "
        "specialization alone above GEMM-softmax pipelining alone, as Table 2 does (582 > 570)",
        _order_flip,
        lambda a: (f"{a['l2_reuse']:g}: with slow copies the producer's ring matters most, so warp specialization "
                   "wins; once L2 serves the copies fast enough, the pipelining's overlap of the softmax wins "
                   "instead. An ordering that flips inside the plausible range of an unmeasured constant is "
                   "not something the model can claim.")),
    "e4m3_mean_error": Question(
        "e4m3_mean_error",
        "the mean relative rounding error of one e4m3 cast on N(0, 1) data with a per-tensor scale, as a "
        "fraction (the worst case is 2^-4 = 0.0625)",
        _e4m3_mean,
        lambda a: (f"{a['mean']:.4f}: a value's error is spread between 0 and half an ulp, and relative to the "
                   "value it shrinks towards the top of a binade, so the typical error is about a third of the "
                   "worst case."),
        rel_tol=0.2),
    "hadamard_rmse_ratio": Question(
        "hadamard_rmse_ratio",
        "RMSE of per-tensor FP8 attention divided by the RMSE after the randomized Hadamard transform, on the "
        "paper's outlier inputs (seed 0, 1,024 queries, 8,192 keys)",
        _hadamard_ratio,
        lambda a: (f"{a['ratio']:.2f}x: the transform spreads each outlier over all 128 coordinates, so the "
                   "per-tensor scale is no longer set by a few huge values; the paper reports 2.6x for "
                   "its blocks plus transform."),
        rel_tol=0.25),
    "fp8_max_threshold": Question(
        "fp8_max_threshold",
        "the largest rescale threshold tau (log2 units) that cannot overflow e4m3 when P is scaled by 2^8 "
        "before its cast (e4m3's largest value is 448)",
        _max_threshold,
        lambda a: (f"log2(448 / 256) = {a['threshold']:.3f}: a maximum stale by tau multiplies P by up to 2^tau, "
                   "so FlashAttention-4's tau = 8 for 16-bit P would overflow an FP8 cast unless P's scale "
                   "shrinks by the same 2^8."),
        rel_tol=0.05),
}

QUESTIONS.update(HOPPER_QUESTIONS)
