"""The one GPU probe: is there a CUDA GPU here, and the one compatibility fix for Numba.

Asked lazily: nothing touches a GPU at import time.  The Numba backend also runs without
a GPU, on Numba's CUDA simulator, which must be switched on (NUMBA_ENABLE_CUDASIM=1)
before numba is first imported; see :mod:`iokernels.numba_cuda`.

The compatibility fix: numba-cuda 0.30.4 calls ``np.row_stack`` while compiling a kernel;
NumPy 2.5 removed that alias of ``np.vstack`` (deprecated since NumPy 2.0), and the first
compile then fails with ``module 'numpy' has no attribute 'row_stack'``.
:func:`numba_numpy_fix` restores the alias only when it is missing, so NumPy versions that
still have it are left untouched.  The Numba backend and every script that imports numba
call it first.
"""
from __future__ import annotations

import functools
import os

import numpy as np


def numba_numpy_fix() -> bool:
    """Set ``np.row_stack = np.vstack`` when NumPy lacks it; True when the fix was needed."""
    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    return True


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
