"""Attention as a torch autograd function: an iokernels backend inside a torch model.

:func:`attention` behaves like ``torch.nn.functional.scaled_dot_product_attention`` for
the conventions of this package (bottom-right causal, ``window``, GQA): the forward runs
``ik.attention(..., return_lse=True)`` on the chosen backend and saves only O and the
log-sum-exp (N numbers a row, never the N x N probabilities); the backward runs
``ik.attention_backward`` with that O and LSE, recomputing S and P tile by tile as
FlashAttention does.

=============  ==============================================================
forward saves  Q, K, V, O, LSE  (no P: the backward recomputes it from LSE)
backward       dQ, dK, dV from dO (dK, dV summed over each GQA group)
backends       any the public functions take: "tiled" / "naive" (NumPy: CPU tensors are
               copied to NumPy and back), "torch", and the GPU backends for CUDA tensors
=============  ==============================================================

The backward backend defaults to the forward's.  A backend without a backward raises a
ValueError naming ``backward_backend`` when the forward is called with inputs that need
gradients, before any work; it never falls back silently to another backend.
"""
from __future__ import annotations

import numpy as np

from . import api
from .core import conventions as cv
from .core.testing import numpy_dtype


def _torch():
    import torch
    return torch


def _to_backend(t, backend):
    """A torch tensor as the backend takes it: NumPy for the NumPy backends, else itself."""
    if backend in api.NUMPY_BACKENDS:
        x = t.detach().cpu().contiguous()
        torch = _torch()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return x.numpy()
    return t.detach()


def _to_torch(x, like):
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    a = np.ascontiguousarray(x)
    if cv.dtype_name(a) == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a.copy()).to(like.device)


def _function():
    torch = _torch()

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, window, backend, config, backward_backend, backward_config):
            o, lse = api.attention(*(_to_backend(t, backend) for t in (q, k, v)), causal=causal, scale=scale,
                                   window=window, backend=backend, config=config, return_lse=True)
            o, lse = _to_torch(o, q), _to_torch(lse, q)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.args = (causal, scale, window, backward_backend, backward_config)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            causal, scale, window, bb, bcfg = ctx.args
            grads = api.attention_backward(*(_to_backend(t, bb) for t in (do.contiguous(), q, k, v, o)),
                                           _to_backend(lse, bb), causal=causal, scale=scale, window=window,
                                           backend=bb, config=bcfg)
            dq, dk, dv = (_to_torch(g, q) for g in grads)
            return dq, dk, dv, None, None, None, None, None, None, None

    return Attention


_ATTENTION = None


def attention(q, k, v, causal=False, scale=None, window=None, backend="tiled", config=None,
              backward_backend=None, backward_config=None):
    """O = attention(Q, K, V) as a differentiable torch operation (see the module docstring).

    q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) torch tensors; returns O like q.
    """
    global _ATTENTION
    torch = _torch()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch tensor, got {type(t).__name__} (use ik.attention for arrays)")
    bb = backend if backward_backend is None else backward_backend
    if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        if not api._implements(bb, "attention_backward"):
            have = ", ".join(b for b in api.BACKENDS if api._implements(b, "attention_backward"))
            raise ValueError(f"backward_backend: {bb!r} has no attention_backward; choose one of {have}")
    if _ATTENTION is None:
        _ATTENTION = _function()
    return _ATTENTION.apply(q, k, v, causal, scale, window, backend, config, bb, backward_config)


def train_toy(attention_fn=None, *, steps: int = 30, seqlen: int = 12, head_dim: int = 8, lr: float = 0.5,
              seed: int = 0, dtype=None):
    """A one-layer attention model learning to read its input backwards; returns the loss of
    each step.  ``attention_fn(q, k, v)`` is the attention it uses (None: :func:`attention` on
    the tiled backend); pass torch's SDPA, or another backend, to compare loss curves from the
    same initial weights and data."""
    torch = _torch()
    dtype = dtype or torch.float64
    attn = attention_fn or (lambda q, k, v: attention(q, k, v, backend="tiled"))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((4, 1, seqlen, head_dim), generator=gen, dtype=dtype)
    target = x.flip(2)
    weights = [torch.nn.Parameter(torch.randn(head_dim, head_dim, generator=gen, dtype=dtype) * 0.3)
               for _ in range(3)]
    opt = torch.optim.SGD(weights, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = attn(x @ weights[0], x @ weights[1], x @ weights[2])
        loss = torch.mean((out - target) ** 2)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses
