"""The few array operations a rank's steps need, for NumPy arrays or torch tensors alike.

The simulated ring (:func:`iokernels.context_parallel.simulate`) runs on NumPy arrays by
default, so it needs no torch; the process-group driver and the torch local kernels run the
same steps on torch tensors.  Each helper looks at the array it is given and does the same
thing in its library.
"""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def is_cuda(x) -> bool:
    return bool(getattr(x, "is_cuda", False))


def accumulator(like):
    """The accumulator dtype for ``like``'s dtype: float64 for float64, else float32."""
    if is_torch(like):
        import torch
        return torch.float64 if like.dtype == torch.float64 else torch.float32
    return np.dtype(np.float64) if like.dtype == np.float64 else np.dtype(np.float32)


def full(shape, value, dtype, like):
    if is_torch(like):
        import torch
        return torch.full(tuple(shape), value, dtype=dtype, device=like.device)
    return np.full(tuple(shape), value, dtype=dtype)


def zeros(shape, dtype, like):
    return full(shape, 0, dtype, like)


def cast(x, dtype):
    return x.to(dtype) if is_torch(x) else x.astype(dtype)


def cat(parts, axis):
    if is_torch(parts[0]):
        import torch
        return torch.cat(parts, axis)
    return np.concatenate(parts, axis)


def stack(parts):
    if is_torch(parts[0]):
        import torch
        return torch.stack(parts)
    return np.stack(parts)


def copy(x):
    return x.clone() if is_torch(x) else x.copy()


def itemsize(x) -> int:
    return int(x.element_size()) if is_torch(x) else int(x.dtype.itemsize)


def nbytes(*xs) -> int:
    return int(sum(int(np.prod(tuple(x.shape))) * itemsize(x) for x in xs))


def storage_dtype(name, like):
    """The dtype named ``name`` ("bfloat16", "float16", "float32") in ``like``'s library; None stays."""
    if name is None:
        return None
    if is_torch(like):
        import torch
        return getattr(torch, name)
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
