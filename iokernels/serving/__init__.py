"""Serving: continuous batching over the paged cache, read top to bottom.

PagedAttention exists to serve many requests from one device's memory (Kwon et al., SOSP
2023, paper).  Prefill reads the paged cache too (:func:`iokernels.paged_prefill`, in
:mod:`iokernels.paged_prefill`), so a step is one kernel call per layer for its mix of
prompt chunks and decodes.  This package is a small serving engine in plain Python and torch that
shows why, with the pieces in the order a request meets them:

==================================  ==========================================================
:mod:`.requests`                    a request, its samples, how a token is drawn
:mod:`.engine`                      the queue and the step: continuous batching, chunked
                                    prefill under a token budget, preemption by recomputation
:mod:`.memory`                      paged blocks (one PagedKVCache per layer) against
                                    contiguous reservations, and the block pool's invariants
:mod:`.device`                      the same two memories with torch pools on the model's
                                    device (a GPU): the books on the host, the values where
                                    the model runs, one upload of the step's books a step
                                    (needs torch; import it from ``iokernels.serving.device``)
:mod:`.fake`                        a checksum model that tests the scheduler exactly
:mod:`.llama`                       a Llama-architecture model in torch (RMSNorm, RoPE, GQA,
                                    SwiGLU), random seeded weights, attention through iokernels
:mod:`.trace`                       a seeded ShareGPT-like trace with Poisson arrivals
:mod:`.bench`                       ``python -m iokernels serve-bench``: paged against contiguous
:mod:`.lesson`                      what notebook 14 computes
==================================  ==========================================================
"""
from __future__ import annotations

from .engine import Engine, Results, StepRecord
from .memory import ContiguousMemory, PagedMemory, pool_invariants
from .requests import Group, Request, Sequence, sample_token, sample_tokens

__all__ = ["Engine", "Results", "StepRecord", "ContiguousMemory", "PagedMemory", "pool_invariants",
           "Group", "Request", "Sequence", "sample_token", "sample_tokens"]
