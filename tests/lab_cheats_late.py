"""Solutions that call the package's own implementation of what the learner writes, one per
exercise of chapters 09-13: while an exercise is graded, each must fail with a message that
says why (the guard of :mod:`iokernels.labs.engine`).  Imported by the guard's tests."""
from __future__ import annotations


def _fwht(x):
    from iokernels import fp8
    return fp8.fwht(x)


def _merge_pair(o, lse, o_b, lse_b):
    from iokernels.context_parallel import merge_pair
    return merge_pair(o, lse, o_b, lse_b)


def _randomized_hadamard(x, signs):
    from iokernels import fp8
    return fp8.randomized_hadamard(x, signs)


def _rescale_step(m, l, o, s, v, threshold):
    import numpy as np

    from iokernels import tiled
    m_new = tiled._Rescale(threshold).new_max(m, s.max(axis=1))
    ref = np.where(np.isneginf(m_new), 0.0, m_new)
    alpha = np.exp(m - ref)
    p = np.exp(s - ref[:, None])
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v


def _zigzag_split(seqlen, world_size):
    from iokernels.context_parallel import split_positions
    return [list(segs) for segs in split_positions(seqlen, world_size, "zigzag")]


def _kv_bytes_per_token(config):
    from iokernels import models
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", 1 if config.get("multi_query") else heads)
    shape = models.ModelShape("config", "MLA" if "kv_lora_rank" in config else "GQA",
                              layers=config["num_hidden_layers"], heads_q=heads, heads_kv=kv,
                              head_dim=config.get("head_dim", config["hidden_size"] // heads), source="config.json",
                              latent_dim=config.get("kv_lora_rank", 0), rope_dim=config.get("qk_rope_head_dim", 0))
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(config["torch_dtype"], 1)
    return models.kv_bytes_per_token(shape, itemsize)


def _absorbed_mla(q_nope, q_rope, KV_latent, w_uk, w_uv, *, scale):
    from iokernels import mla
    return mla.reference_mla(q_nope, q_rope, KV_latent[:], w_uk, w_uv, scale=scale)


def _varlen_attention(q, k, v, cu_q, cu_k, *, causal, scale):
    from iokernels import tiled
    return tiled.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window=None)


class _TritonForward:
    """Not a kernel: launched like one, it asks the package's Triton forward for O and the LSE."""

    __name__ = "fwd_lab"

    def __getitem__(self, grid):
        def launch(Q, K, V, O, LSE, *args, **meta):
            from iokernels.triton_backend import forward
            left, right = args[-2:]
            o, lse = forward.attention_v1(Q, K, V, causal=right == 0, scale=None, window=None)
            O.copy_(o)
            LSE.copy_(lse.reshape(LSE.shape))
        return launch

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it with a grid: fwd_lab[grid](...)")


CHEATS = {"absorbed_mla_query": _absorbed_mla, "varlen_bug_hunt": _varlen_attention,
          "zigzag_split": _zigzag_split, "kv_bytes_per_token": _kv_bytes_per_token,
          "fwht": _fwht, "merge_pair": _merge_pair, "randomized_hadamard": _randomized_hadamard,
          "rescale_threshold_step": _rescale_step, "triton_forward": _TritonForward()}
