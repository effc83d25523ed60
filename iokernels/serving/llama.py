"""A Llama-architecture decoder in plain torch, with random seeded weights and iokernels attention.

The architecture (Touvron et al., "LLaMA", 2023, paper; Meta's Llama 3 model card and
its ``config.json``, 2024, code/config), one layer::

    h = x + Wo · attention(RoPE(Wq · RMSNorm(x)), RoPE(Wk · RMSNorm(x)), Wv · RMSNorm(x))
    x' = h + W2 · (SiLU(W1 · RMSNorm(h)) * (W3 · RMSNorm(h)))          # SwiGLU

* **RMSNorm** (Zhang and Sennrich, 2019, paper): x / sqrt(mean(x^2) + eps) * w, no mean
  subtracted, no bias;
* **RoPE** (Su et al., RoFormer, 2021, paper): each query and key is rotated by angles
  position * theta^(-2i/d), so that q·k depends on the distance between the positions
  only.  Values i and i + d/2 form a pair, as Hugging Face transformers' Llama code pairs
  them (code); Meta's reference code pairs neighbours 2i, 2i + 1, the same rotation up to
  a permutation of the weights' rows;
* **GQA** (Ainslie et al., 2023, paper): ``kv_heads`` < ``heads``; each KV head serves
  heads / kv_heads query heads, so the cache is that many times smaller;
* **SwiGLU** (Shazeer, 2020, paper): the gated MLP above.

Weights are drawn from seeded generators on the CPU (:func:`draw_weights`; no download,
the same weights whatever the device): the shapes are the point, not the words.  Attention goes through
``memory`` (:mod:`iokernels.serving.memory`): the chunk's K and V are written to the
cache, then the chunk's queries attend through the memory's backend
(:func:`iokernels.paged_prefill` over the blocks, or :func:`iokernels.attention_varlen`
over contiguous regions).  A device memory (:mod:`iokernels.serving.device`) does both
on the model's device.  :meth:`Llama.reference_logits` computes the same model with no
cache at all, in torch, to check both against.
"""
from __future__ import annotations

import functools
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from .device import upload

__all__ = ["LlamaShape", "TINY", "LLAMA3_8B", "llama3_8b_shape", "Llama", "MODELS"]


@dataclass(frozen=True)
class LlamaShape:
    """A Llama config: vocabulary, model width, layers, query and KV heads, MLP width, RoPE base."""

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.heads or self.heads % self.kv_heads or (self.dim // self.heads) % 2:
            raise ValueError(f"shape: dim {self.dim} must split into {self.heads} heads of an even head dim, "
                             f"and heads into groups of kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


#: a model small enough to serve a trace through the NumPy kernels on a CPU
TINY = LlamaShape("tiny", vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128)
#: Llama-3-8B's shapes (meta-llama/Meta-Llama-3-8B config.json, code/config): hidden 4096,
#: 32 layers, 32 query and 8 KV heads of 128, MLP 14336, vocabulary 128256, RoPE base 500000
LLAMA3_8B = LlamaShape("llama3-8b", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim=14336,
                       rope_theta=500000.0)


def llama3_8b_shape(layers=2) -> LlamaShape:
    """Llama-3-8B's shapes with fewer layers (each layer holds 218 M weights)."""
    return replace(LLAMA3_8B, name=f"llama3-8b-shape ({layers} layers)", layers=int(layers))


#: the models ``serve-bench --model`` names
MODELS = {"tiny": lambda: TINY, "llama3-8b-shape": llama3_8b_shape}


def rms_norm(x, w, eps):
    """x / sqrt(mean(x^2) + eps) * w over the last dim, through torch's ``rms_norm``: PyTorch
    registers a fused kernel for it (``aten::_fused_rms_norm`` in native_functions.yaml, code),
    one launch where the formula written out in tensor operations is six (pow, mean, add,
    rsqrt, two products).  In float64 it is the formula to rounding."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def rope_tables(positions, d, theta, dtype, device):
    """(cos, sin) of each token's angles, (tokens, 1, d) in ``dtype``: what :func:`rotate` needs.

    The pair (i, i + d/2) turns by angle a_i, so both halves take cos(a); the first half
    takes -sin(a), the second +sin(a).  The angles and their cosines and sines are computed in
    float64 and only then rounded to the model's dtype: an angle of a few thousand radians in
    bfloat16 would be off by whole radians.  A forward pass makes them once and every
    layer's Q and K use them.
    """
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    ang = positions.to(device=device, dtype=torch.float64)[:, None] * inv[None, :]        # (tokens, d/2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    return tuple(t.to(dtype)[:, None, :] for t in (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)))


def rotate(x, cos, sin):
    """Rotate (tokens, heads, d) by the tables of :func:`rope_tables`, pairs (i, i + d/2):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as x * cos + (x2, x1) * sin, four tensor
    operations (the same roundings as the pairs written out: a - b is a + (-b) exactly)."""
    d = x.shape[-1]
    return x * cos + torch.cat([x[..., d // 2:], x[..., :d // 2]], dim=-1) * sin


def rope(x, positions, theta):
    """Rotate (tokens, heads, d) by each token's position: :func:`rotate` by :func:`rope_tables`."""
    return rotate(x, *rope_tables(positions, x.shape[-1], theta, x.dtype, x.device))


#: on a device memory, a step's token rows (and its rows of logits) may be padded with zeros to a
#: multiple of this many, so the model's matrix products see a few dozen distinct row counts over a
#: run instead of a new one almost every step: a GEMM library picks its kernel per shape (cuBLASLt
#: runs a heuristic and caches its answer per shape: the discussion of pytorch/pytorch pull request
#: 191700, code), and a shape it has not seen costs that choice on the host again.  Padding rows are
#: dropped before they reach the cache or the logits.  1 (no padding) is the default: a product at
#: an unseen row count does cost the host far more than one at a seen count, but over a whole
#: serving run the row counts repeat, and the recorded runs with rows padded to 64 serve no faster
#: (benchmarks/results/sweeps/README.md; ``scripts/host_profile.py --op gemm`` and
#: ``serve-bench --rows-granule 64 --repeats 3`` measure it again).
ROWS_GRANULE = 1


def padded_rows(a, granule) -> np.ndarray:
    """``a`` with zeros appended up to a multiple of ``granule`` rows (at least one granule)."""
    n = -(-max(len(a), 1) // granule) * granule
    return np.concatenate([a, np.zeros(n - len(a), a.dtype)])


def _attend_rows(attend, rows, q, k, v):
    """``attend`` over the step's ``rows`` real rows of q, k, v; its output with the padding rows zero."""
    o = attend(q[:rows], k[:rows], v[:rows])
    return torch.nn.functional.pad(o, (0, 0, 0, 0, 0, len(q) - rows)) if len(q) > rows else o


def _attend_on_host(memory, layer, seqs, chunk_lens, ids, cu, q, k, v):
    """A host memory's layer: K, V written a sequence at a time, then one attention call, all in NumPy."""
    k_np, v_np = k.cpu().numpy(), v.cpu().numpy()
    for i, s in enumerate(seqs):                      # write the chunk's K, V first
        memory.write(layer, s, k_np[cu[i]:cu[i + 1]], v_np[cu[i]:cu[i + 1]], ids[i])
    o = memory.attend(layer, q.cpu().numpy(), seqs, list(chunk_lens))
    return torch.from_numpy(np.ascontiguousarray(o)).to(q.device)


def draw_weights(specs, seed, dtype, device, workers=None) -> dict:
    """{name: a (shape) matrix of N(0, std^2) values} for each (name, shape, std) of ``specs``
    (std None: 1/sqrt(shape[-1])), in ``dtype`` on ``device``; ``workers``: threads drawing
    (None: the CPU's cores, at most 16).

    Each matrix is drawn in float32 on the CPU by a generator of its own, seeded by (``seed``, its
    place in ``specs``), so a matrix's values depend on neither the device nor the order the
    matrices are drawn in, and they are drawn in parallel threads (torch releases the GIL
    while it draws): a model of Llama-3-8B's 32 layers draws 8 billion values."""
    def one(i):
        name, size, std = specs[i]
        seeds = np.random.SeedSequence([int(seed), i]).generate_state(1, np.uint64)
        g = torch.Generator(device="cpu").manual_seed(int(seeds[0] >> np.uint64(1)))
        std = (1.0 / size[-1]) ** 0.5 if std is None else std
        return name, (torch.randn(*size, generator=g, dtype=torch.float32) * std).to(dtype).to(device)

    workers = min(len(specs), os.cpu_count() or 1, 16) if workers is None else workers
    if workers <= 1:
        return dict(map(one, range(len(specs))))
    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, range(len(specs))))


class Llama:
    """A Llama decoder with weights drawn from ``seed``; ``forward`` is what the engine calls.

    ``rows_granule``: a step's rows on a device memory are padded to a multiple of it
    (:data:`ROWS_GRANULE`; 1 pads nothing).
    """

    rows_granule = ROWS_GRANULE

    def __init__(self, shape: LlamaShape = TINY, seed=0, dtype=torch.float64, device="cpu"):
        self.shape, self.dtype, self.device = shape, dtype, device
        s = shape
        # every matrix: (name, shape, std); std 1/sqrt(fan-in) keeps activations O(1), the embedding 1.
        # Wq, Wk, Wv are one stacked matrix (the query heads' rows, then the KV heads' K rows, then
        # their V rows), W1 and W3 another (W1's rows, then W3's): one matrix product, one kernel
        # launch, each where there would be three and two, as vLLM's QKVParallelLinear and
        # MergedColumnParallelLinear pack them (vllm/model_executor/layers/linear.py, code)
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        specs = [("embed", (s.vocab, s.dim), 1.0), ("lm_head", (s.vocab, s.dim), None)]
        for i in range(s.layers):
            specs += [(f"{i}.wqkv", (qkv_rows, s.dim), None), (f"{i}.wo", (s.dim, s.heads * s.head_dim), None),
                      (f"{i}.w13", (2 * s.ffn_dim, s.dim), None), (f"{i}.w2", (s.dim, s.ffn_dim), None)]
        w = draw_weights(specs, seed, dtype, device)

        def ones():
            return torch.ones(s.dim, dtype=dtype, device=device)

        self.layers = [dict(attn_norm=ones(), wqkv=w[f"{i}.wqkv"], wo=w[f"{i}.wo"], mlp_norm=ones(),
                            w13=w[f"{i}.w13"], w2=w[f"{i}.w2"]) for i in range(s.layers)]
        self.embed, self.lm_head, self.norm = w["embed"], w["lm_head"], ones()

    @property
    def vocab(self) -> int:
        return self.shape.vocab

    def memory_shape(self) -> dict:
        """What a memory for this model holds per token: layers, KV heads, head dim, dtype (its name)."""
        return dict(layers=self.shape.layers, kv_heads=self.shape.kv_heads, head_dim=self.shape.head_dim,
                    dtype=str(self.dtype).replace("torch.", ""))

    def _angles(self, positions):
        return rope_tables(positions, self.shape.head_dim, self.shape.rope_theta, self.dtype, self.device)

    def _block(self, p, x, angles, attend):
        s = self.shape
        hq, hkv = s.heads, s.kv_heads
        h = rms_norm(x, p["attn_norm"], s.norm_eps)
        qkv = (h @ p["wqkv"].T).view(-1, hq + 2 * hkv, s.head_dim)        # Q, K, V heads side by side
        q, k, v = rotate(qkv[:, :hq], *angles), rotate(qkv[:, hq:hq + hkv], *angles), qkv[:, hq + hkv:]
        x = x + attend(q, k, v).reshape(-1, hq * s.head_dim) @ p["wo"].T
        h = rms_norm(x, p["mlp_norm"], s.norm_eps)
        gate, up = (h @ p["w13"].T).chunk(2, dim=-1)                        # W1 h, W3 h
        return x + (torch.nn.functional.silu(gate) * up) @ p["w2"].T

    @torch.no_grad()
    def forward(self, memory, seqs, chunk_lens):
        """Compute each sequence's next chunk through ``memory``; the logits of each chunk's last token.

        A device memory (:mod:`.device`, one with ``prepare``) does the step's books once and
        every layer stores and attends on the model's device.  A host memory (:mod:`.memory`,
        NumPy pools) takes each layer's K, V and queries as NumPy arrays: on a GPU, copies
        to the host and back, every layer of every step.  Returns (len(seqs), vocab) logits
        on the model's device.
        """
        ids = [s.tokens[s.computed:s.computed + c] for s, c in zip(seqs, chunk_lens)]
        cu = np.concatenate([[0], np.cumsum(chunk_lens)]).astype(np.int64)
        starts = np.fromiter((s.computed for s in seqs), np.int64, len(seqs))
        pos = np.arange(cu[-1]) + np.repeat(starts - cu[:-1], chunk_lens)           # computed, + 1, ...
        tok = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(cu[-1]))
        plan = memory.prepare(seqs, chunk_lens, ids) if hasattr(memory, "prepare") else None
        rows, last = len(tok), cu[1:] - 1                                      # each chunk's last row: last
        padded = plan is not None and self.rows_granule > 1                    # a device memory's rows
        if padded:
            tok, pos, last = (padded_rows(a, self.rows_granule) for a in (tok, pos, last))
        tok, pos, last = upload([tok, pos, last], self.device)                # one copy, before any work
        x, angles = self.embed[tok], self._angles(pos)          # the rotary tables once, for every layer
        for layer, p in enumerate(self.layers):
            if plan is not None:
                attend = functools.partial(memory.write_attend, layer, plan)
                attend = functools.partial(_attend_rows, attend, rows) if padded else attend
            else:
                attend = functools.partial(_attend_on_host, memory, layer, seqs, chunk_lens, ids, cu)
            x = self._block(p, x, angles, attend)
        return (rms_norm(x[last], self.norm, self.shape.norm_eps) @ self.lm_head.T)[:len(seqs)]

    @torch.no_grad()
    def reference_logits(self, tokens):
        """Every position's logits of one sequence, all at once, no cache: plain torch attention."""
        s = self.shape
        tok = torch.tensor(list(tokens), device=self.device)
        n, g = len(tok), s.heads // s.kv_heads
        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()

        def attend(q, k, v):
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)      # (n, H, d)
            sc = torch.einsum("ihd,jhd->hij", q, k) / s.head_dim ** 0.5
            p = torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=-1)
            return torch.einsum("hij,jhd->ihd", p, v)

        x, angles = self.embed[tok], self._angles(torch.arange(n, device=self.device))
        for p in self.layers:
            x = self._block(p, x, angles, attend)
        return (rms_norm(x, self.norm, s.norm_eps) @ self.lm_head.T).double().cpu().numpy()

    def reference_greedy(self, prompt, new_tokens):
        """Greedy tokens from :meth:`reference_logits`, recomputing the whole sequence each time."""
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(self.reference_logits(tokens)[-1])))
        return tokens[len(prompt):]
