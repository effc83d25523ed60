"""Predict-then-check questions of notebooks 11, 12 and 13, added to :data:`iokernels.labs.predict.QUESTIONS`.

Importing this module registers them; :func:`reveal` is re-exported so a notebook can write::

    from iokernels.labs.predict_chapters import reveal

Every answer is computed by the package (the lesson modules), never typed in.
"""
from __future__ import annotations

from .predict import QUESTIONS, Question, reveal

__all__ = ["reveal", "CHAPTER_QUESTIONS"]


# --------------------------------------------------------------------------- notebook 11
def _dq_splits():
    from ..failure_modes import deterministic_dq_cost
    c = deterministic_dq_cost(seqlen_q=4096, seqlen_k=4096, head_dim=128, block_k=128, batch=8, heads=16)
    return {"accumulators": c["splits"]}


def _varlen_flops():
    from ..failure_modes import varlen_savings
    return {"flops_saved": varlen_savings([37, 512, 5, 130, 260, 64], heads=8, head_dim=64)["flops_saved"]}


# --------------------------------------------------------------------------- notebook 12
def _contiguous_imbalance():
    from ..context_parallel import causal_work
    work = causal_work(4096, 8, "contiguous")
    return {"busiest_over_mean": max(work) / (sum(work) / len(work))}


def _ring_memory():
    from ..context_parallel import memory_per_rank
    m = memory_per_rank(262144, 8, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16")
    return {"share": m["per_rank"] / m["one_device"]}


# --------------------------------------------------------------------------- notebook 13
def _llama3_kib():
    from ..models import kv_bytes_per_token
    return {"kib": kv_bytes_per_token("Llama-3-8B") / 1024}


def _mla_intensity():
    from ..models import decode_step
    return {"flop_per_byte": decode_step("DeepSeek-V3", 1)["intensity"]}


CHAPTER_QUESTIONS = {
    "deterministic_dq_accumulators": Question(
        "deterministic_dq_accumulators",
        "how many float32 dQ accumulators FlashAttention-2's deterministic backward allocates on an H100 "
        "(132 SMs) at batch 8, 16 heads, N = 4096, Bc = 128 (Tc = 32 K/V tiles)",
        _dq_splits,
        lambda a: (f"ceil(132 / (8 x 16)) = {a['accumulators']}: the deterministic mode sizes its accumulators "
                   "from the SM count and the batch x heads (code: flash_api.cpp), not from the number of K/V "
                   "tiles; the cost is parallelism (that many thread blocks per head walk the tiles in order), "
                   "not Tc buffers of memory.")),
    "varlen_flops_saved": Question(
        "varlen_flops_saved",
        "the share of attention FLOPs packing saves over padding for lengths 37, 512, 5, 130, 260, 64",
        _varlen_flops,
        lambda a: (f"{a['flops_saved']:.0%}: padding costs 6 x 512^2 pairs per head, packing the sum of N_b^2; "
                   "one long sequence dominates both, so the saving is the short ones' padding."),
        rel_tol=0.05),
    "ring_contiguous_imbalance": Question(
        "ring_contiguous_imbalance",
        "causal attention, contiguous split, W = 8 ranks, N = 4096: the busiest rank's work over the mean",
        _contiguous_imbalance,
        lambda a: (f"{a['busiest_over_mean']:.2f}: the last rank computes W - 1 full blocks and a diagonal, "
                   "(2W - 1) half-blocks, while the mean is W half-blocks (the triangle's W^2 / 2 blocks over W "
                   "ranks), so (2W - 1) / W, which tends to 2 as W grows; every ring step waits for it, "
                   "which is what the zig-zag split removes."),
        rel_tol=0.05),
    "ring_memory_share": Question(
        "ring_memory_share",
        "bf16, 32 query / 8 KV heads, d = 128, N = 262,144, W = 8: a rank's attention activations as a share "
        "of one device holding everything",
        _ring_memory,
        lambda a: (f"{a['share']:.3f}: more than 1/8 = 0.125, because a rank holds two K/V blocks (its own and "
                   "the one arriving) and keeps its output in float32 between steps."),
        rel_tol=0.1),
    "llama3_kv_kib": Question(
        "llama3_kv_kib",
        "Llama-3-8B's KV cache per token in KiB (32 layers, 8 KV heads, d = 128, 16-bit values)",
        _llama3_kib,
        lambda a: (f"2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes = {a['kib']:.0f} KiB, a quarter of "
                   "Llama-2-7B's 512 KiB, which has 32 KV heads."),
        rel_tol=0.02),
    "mla_decode_intensity": Question(
        "mla_decode_intensity",
        "DeepSeek-V3's absorbed MLA decode: FLOPs per byte of cache read (a 576-value bf16 row serves 128 heads "
        "as key, its first 512 values as their value)",
        _mla_intensity,
        lambda a: (f"2 x 128 x (576 + 512) / 1,152 bytes = {a['flop_per_byte']:.0f} FLOP/byte: past the H200's "
                   "ridge (about 206) but short of the H100 SXM's (about 295) and the B200's (about 292)."),
        rel_tol=0.1),
}

QUESTIONS.update(CHAPTER_QUESTIONS)
