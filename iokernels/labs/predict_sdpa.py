"""Predict-then-check questions of notebook 10 (PyTorch SDPA), added to :data:`iokernels.labs.predict.QUESTIONS`.

Importing this module registers them; :func:`reveal` is re-exported so a notebook can write::

    from iokernels.labs.predict_sdpa import reveal

Every answer is read from the recorded GPU run (``benchmarks/results/h200_*.json``, loaded
by :func:`iokernels.recorded.load`), never typed in: a newer record changes the answer and
the explanation with it.
"""
from __future__ import annotations

from .predict import QUESTIONS, Question, reveal

__all__ = ["reveal", "SDPA_QUESTIONS", "SDPA_KERNELS"]

#: the four kernels behind SDPA, as the benchmark names them (sdpa:<name>)
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")


def _record():
    from ..core import recorded
    return recorded.load("h200")


def _refused(case) -> list[str]:
    return sorted(r["runner"].split(":")[1] for r in case["results"]
                  if r["group"] == "sdpa" and r["runner"].split(":")[1] in SDPA_KERNELS
                  and r.get("status", "").startswith("unavailable"))


def _fp32_case():
    return next(c for c in _record()["bench"]["cases"] if c["section"] == "compare" and c["dtype"] == "float32")


def _fp32_refusals():
    return {"refused": len(_refused(_fp32_case()))}


def _fp32_explain(a):
    c = _fp32_case()
    return (f"{a['refused']} of 4: {' and '.join(_refused(c))} refuse float32 on CUDA (FlashAttention-2 and cuDNN's "
            f"fused attention take fp16 / bf16 only; code: PyTorch's sdp_utils.cpp dtype checks), so the default "
            f"dispatch ran {c.get('default_ran')}, the memory-efficient kernel, and the unfused math path stays "
            "the last resort.")


def _math_slowdown():
    from ..core import recorded
    speed = recorded.ratio(_record(), "sdpa:math", "sdpa:cudnn", section="compare", dtype="bfloat16", causal=False)
    return {"slowdown": 1.0 / speed}


def _flash_dram():
    from ..core import recorded
    row = next(r for r in recorded.traffic_rows(_record()) if r["case"] == "sdpa flash" and r["size"] == "large")
    return {"over_minimum": row["measured_over_mandatory"], "over_model": row["measured_over_model"]}


SDPA_QUESTIONS = {
    "sdpa_fp32_refusals": Question(
        "sdpa_fp32_refusals",
        "float32 inputs on the H200 (B=8, H=16, N=4096, d=128): how many of SDPA's four kernels "
        "(flash, efficient, cudnn, math) refuse them when forced alone",
        _fp32_refusals,
        _fp32_explain),
    "sdpa_math_slowdown": Question(
        "sdpa_math_slowdown",
        "bf16, B=8, H=16, N=4096, d=128, not causal, on the H200: how many times slower the math path is than "
        "cuDNN's fused kernel (within 30%)",
        _math_slowdown,
        lambda a: (f"{a['slowdown']:.0f}x (recorded run): the math path writes S and P, 2 x B x H x N^2 values, "
                   "to HBM and reads them back, and runs softmax as separate kernels, while the fused kernel keeps "
                   "them on chip and is bound by the tensor cores (code: _scaled_dot_product_attention_math in "
                   "PyTorch's aten/src/ATen/native/transformers/attention.cpp)."),
        rel_tol=0.3),
    "sdpa_flash_dram": Question(
        "sdpa_flash_dram",
        "SDPA's flash kernel at the large size (several times the GPU's L2): its measured DRAM bytes over the "
        "mandatory minimum (Q, K, V read and O written once), within 25%",
        lambda: {"over_minimum": _flash_dram()["over_minimum"]},
        lambda a: (f"{a['over_minimum']:.2f} (Nsight Compute, recorded run), while the model, which reads K and V "
                   f"once per query tile, predicts {1 / _flash_dram()['over_model'] * a['over_minimum']:.0f}x the "
                   "minimum: the thread blocks of one head share K/V tiles through L2, so DRAM sees K and V "
                   "about once (the recorded measurements, discussed in benchmarks/NOTES.md)."),
        rel_tol=0.25),
}

QUESTIONS.update(SDPA_QUESTIONS)
