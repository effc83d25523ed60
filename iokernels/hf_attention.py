"""iokernels as an attention implementation of Hugging Face transformers.

transformers looks a model's attention up by name in its ``AttentionInterface`` (code:
``transformers.modeling_utils.AttentionInterface``; the docs' "Attention Interface"
page): a function ``(module, query, key, value, attention_mask, scaling=..., ...)`` that
takes query (B, Hq, N_q, d) and key, value (B, Hkv, N_k, d) and returns the output as
(B, N_q, Hq, d) with None for the weights.  :func:`register` adds ours under a name, and
a model built with ``attn_implementation=<that name>`` runs every attention layer
through :func:`iokernels.attention` on the chosen backend::

    from transformers import LlamaConfig, LlamaForCausalLM
    name = iokernels.hf_attention.register(backend="tiled")
    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation=name))   # random init, no download

GQA goes to the kernel as it is (no ``repeat_kv``): key and value keep their Hkv heads.
The mask: the mask function registered with it is transformers' own SDPA one, which
hands over None when the mask is plain causal; a boolean mask is accepted only when it
is exactly the bottom-right causal mask (or all visible), since the kernels take no
arbitrary masks: a padding mask raises a ValueError rather than being ignored.

``CALLS[name]`` counts the calls, so a test can prove that our kernel ran, not SDPA.
transformers is an optional dependency (``pip install iokernels[hf]``).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .api import attention
from .core import conventions as cv

__all__ = ["register", "CALLS", "DEFAULT_NAME"]

DEFAULT_NAME = "iokernels"
#: attention calls per registered name
CALLS: Counter = Counter()


def _causal_flag(mask, n_q, n_k):
    """The mask as the kernels' causal flag: None or bottom-right causal -> True, all visible -> False."""
    if mask is None:
        return True
    m = mask.detach().cpu().numpy()
    if m.dtype != np.bool_:
        raise ValueError(f"attention_mask: expected a boolean mask (True: attend), got {m.dtype}")
    causal = cv.mask(n_q, n_k, causal=True)
    if np.all(m == np.broadcast_to(causal, m.shape[:-2] + causal.shape)):
        return True
    if m.all():
        return False
    raise ValueError("attention_mask: only the bottom-right causal mask is supported (no padding); "
                     "pass unpadded sequences")


def register(name: str = DEFAULT_NAME, backend: str = "tiled") -> str:
    """Register iokernels attention (on ``backend``) with transformers under ``name``; returns the name."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cv.check_choice(backend, "backend", ("naive", "tiled", "numba", "cupy"))

    def iokernels_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError(f"dropout: the iokernels kernels have no dropout, got {dropout}")
        if kwargs.get("softcap") is not None:
            raise ValueError("softcap: not supported by the iokernels kernels")
        n_q, n_k = query.shape[2], key.shape[2]
        causal = _causal_flag(attention_mask, n_q, n_k) and bool(getattr(module, "is_causal", True))
        CALLS[name] += 1
        q, k, v = (x.detach().cpu().contiguous().numpy() for x in (query, key, value))
        o = attention(q, k, v, causal=causal, scale=scaling, backend=backend)
        out = torch.from_numpy(np.ascontiguousarray(o)).to(device=query.device, dtype=query.dtype)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, iokernels_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
