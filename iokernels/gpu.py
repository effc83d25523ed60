"""Is there a CUDA GPU here?  Asked lazily: nothing touches a GPU at import time.

The Numba backend also runs without a GPU, on Numba's CUDA simulator, which must be
switched on (NUMBA_ENABLE_CUDASIM=1) before numba is first imported; see
:mod:`iokernels.numba_cuda`.
"""
from __future__ import annotations

import functools
import os


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is switched on for this process."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def cupy_gpu() -> bool:
    """True when CuPy is installed and sees a CUDA device."""
    try:
        import cupy
        return bool(cupy.is_available())
    except Exception:  # ImportError, or a CUDA driver error on a machine with no GPU
        return False


@functools.lru_cache(maxsize=None)
def torch_gpu() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def has_gpu() -> bool:
    """True when a real CUDA GPU can be used (by CuPy or torch)."""
    return cupy_gpu() or torch_gpu()
