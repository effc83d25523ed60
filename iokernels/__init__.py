"""iokernels: IO-aware attention kernels, from NumPy to the GPU, for learning.

The progression (one module a step, in the order of the notebooks):

======================================  ============================================================
:mod:`iokernels.naive`                  naive attention that materializes S and P (notebook 01)
:mod:`iokernels.online_softmax`         the online softmax by hand (02)
:mod:`iokernels.tiled`                  FlashAttention's tiles, FA1 and FA2 loop orders, score_mod (03)
:mod:`iokernels.backward`               the backward with recomputation (04); :mod:`iokernels.autograd`
                                        puts any backend inside a torch model
:mod:`iokernels.numba_cuda`             the kernels in Numba CUDA (05)
:mod:`iokernels.cupy_raw`               the kernels in CUDA C++, up to Hopper's wgmma and TMA (06)
:mod:`iokernels.paged`                  PagedAttention's block pool and block tables (07)
:mod:`iokernels.decode`                 Flash-Decoding: split-KV with an exact LSE merge (08)
:mod:`iokernels.hopper_schedule`,       FlashAttention-3 and -4's asynchrony on a CPU: the SM model,
:mod:`.fa4`                             FA4's software exp2 and conditional rescaling (09a)
:mod:`iokernels.fp8`,                   low precision: FP8, Hadamard, K smoothing; the generations
:mod:`.generations`                     FA1-4 and where they run (09b)
:mod:`iokernels.torch_sdpa`             the comparison with PyTorch (10)
:mod:`iokernels.failure_modes`          what goes wrong (11)
:mod:`iokernels.context_parallel`       ring attention over torch.distributed (12)
:mod:`iokernels.models`, :mod:`.mla`    decode for real model shapes, MLA (13)
:mod:`iokernels.serving`,               serving: continuous batching over the paged cache, chunked
:mod:`.paged_prefill`                   prefill on paged KV, a Llama-shaped model, paged vs contiguous (14)
======================================  ============================================================

Infrastructure lives in :mod:`iokernels.core` (the public functions, conventions, the float64
oracle, the shared checker and input factory, the traffic counter, tile configs, the
roofline table, recorded results, the array layer, the kernel registry, the GPU probe);
timing and the benchmark in :mod:`iokernels.bench`; plots and widgets in
:mod:`iokernels.viz`; the graded labs in :mod:`iokernels.labs`; notebooks' kernel metadata, as
JupyterLab writes it on open, in :mod:`iokernels.notebook_meta`; iokernels as a Hugging Face
transformers attention implementation in :mod:`iokernels.hf_attention`.

Importing the package is light: nothing touches a GPU, and heavy modules load on first use.
"""
from __future__ import annotations

import importlib

from .core import conventions, reference, testing, traffic
# iokernels.api imports the submodule iokernels.decode before the function of the same name
# is bound here: importing a submodule sets it as a package attribute, and binding the
# function afterwards keeps ik.decode the function.
from .api import (BACKENDS, attention, attention_backward, attention_varlen, decode, merge_states,
                  paged_decode, paged_prefill)
from .core.config import TileConfig

__version__ = "0.1.0"

_LAZY = {
    "PagedKVCache": ("iokernels.paged", "PagedKVCache"),
    "OutOfBlocks": ("iokernels.paged", "OutOfBlocks"),
    "roofline": ("iokernels.core.roofline", None),
    "recorded": ("iokernels.core.recorded", None),
    "gpu": ("iokernels.core.gpu", None),
    "config": ("iokernels.core.config", None),
    "api": ("iokernels.api", None),
    "naive": ("iokernels.naive", None),
    "tiled": ("iokernels.tiled", None),
    "online_softmax": ("iokernels.online_softmax", None),
    "paged": ("iokernels.paged", None),
    "bench": ("iokernels.bench", None),
    "context_parallel": ("iokernels.context_parallel", None),
    "serving": ("iokernels.serving", None),
    "viz": ("iokernels.viz", None),
}


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        value = m if attr is None else getattr(m, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'iokernels' has no attribute {name!r}")


__all__ = ["attention", "attention_backward", "attention_varlen", "decode", "paged_decode", "paged_prefill",
           "merge_states", "PagedKVCache", "OutOfBlocks", "TileConfig", "traffic", "reference",
           "testing", "conventions", "roofline", "BACKENDS"]
