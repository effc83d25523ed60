"""iokernels: IO-aware attention kernels, from NumPy to the GPU, for learning.

The progression (one module a step):

1. :mod:`iokernels.naive`      naive attention that materializes S and P
2. :mod:`iokernels.tiled`      FlashAttention (online softmax, tiles), forward and backward
3. :mod:`iokernels.paged`      PagedAttention's block pool and block tables
4. :mod:`iokernels.decode`     Flash-Decoding: split-KV with an exact LSE merge
5. :mod:`iokernels.numba_cuda` and :mod:`iokernels.cupy_raw`: the same kernels on a GPU
6. :mod:`iokernels.torch_sdpa` the comparison with PyTorch
7. :mod:`iokernels.hopper_schedule`, :mod:`iokernels.fp8`, :mod:`iokernels.fa4` and
   :mod:`iokernels.generations`: FlashAttention-3 and -4 on a CPU (notebook 09)

Importing the package is light: nothing touches a GPU, and heavy modules load on first use.
"""
from __future__ import annotations

import importlib

from .core import conventions, reference, testing, traffic
# The submodule iokernels.decode is imported here, before the function of the same name:
# importing a submodule for the first time sets it as a package attribute, which would
# otherwise replace ik.decode (the function) by the module on the first decode call.
from . import decode as _decode_module  # noqa: F401,E402
from .core.api import (BACKENDS, attention, attention_backward, attention_varlen, decode, merge_states,
                  paged_decode)
from .core.config import TileConfig

__version__ = "0.1.0"

_LAZY = {
    "PagedKVCache": ("iokernels.paged", "PagedKVCache"),
    "OutOfBlocks": ("iokernels.paged", "OutOfBlocks"),
    "roofline": ("iokernels.core.roofline", None),
    "recorded": ("iokernels.core.recorded", None),
    "gpu": ("iokernels.core.gpu", None),
    "config": ("iokernels.core.config", None),
    "api": ("iokernels.core.api", None),
    "naive": ("iokernels.naive", None),
    "tiled": ("iokernels.tiled", None),
    "online_softmax": ("iokernels.online_softmax", None),
    "paged": ("iokernels.paged", None),
    "bench": ("iokernels.bench", None),
    "context_parallel": ("iokernels.context_parallel", None),
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


__all__ = ["attention", "attention_backward", "attention_varlen", "decode", "paged_decode",
           "merge_states", "PagedKVCache", "OutOfBlocks", "TileConfig", "traffic", "reference",
           "testing", "conventions", "roofline", "BACKENDS"]
