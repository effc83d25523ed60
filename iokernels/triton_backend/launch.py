"""Where the Triton kernels run, and the caller's arrays in and out.

Two places to run:

* a CUDA GPU (torch sees one): each kernel is compiled by Triton for it on first use;
* Triton's interpreter (``TRITON_INTERPRET=1``): every program of the grid runs one after
  the other in NumPy on the CPU, the tile operations as whole-array NumPy calls, so the
  same kernel source is checked on a machine with no GPU (small problems only).  Triton's
  ``@triton.jit`` reads the variable when a kernel is defined, so :func:`prepare` sets it,
  on a machine with no CUDA GPU, before the kernel modules are first imported.

Arrays: NumPy inputs are copied to torch tensors (on the GPU, or on the CPU under the
interpreter) and the results copied back as NumPy; torch tensors are used as they are
(CUDA tensors, or CPU tensors under the interpreter) and results come back as torch
tensors from torch's allocator.  Nothing here imports triton or torch at module import.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from ..core import conventions as cv
from ..core.testing import numpy_dtype

#: what to install when triton is missing
INSTALL_HINT = "pip install 'iokernels[triton]'"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None


@functools.lru_cache(maxsize=None)
def cuda_gpu() -> bool:
    """True when torch sees a CUDA GPU."""
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def interpreting() -> bool:
    """Whether Triton kernels defined now run on the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prepare() -> None:
    """Without a CUDA GPU, switch Triton's interpreter on before any kernel is defined."""
    if not cuda_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def unavailable() -> str | None:
    """Why the Triton kernels cannot run here (None: they can)."""
    if not triton_installed():
        return f"triton (and torch) are not installed ({INSTALL_HINT})"
    if not cuda_gpu() and os.environ.get("TRITON_INTERPRET") == "0":
        return "no CUDA GPU, and TRITON_INTERPRET=0 switches the interpreter off"
    return None


def device() -> str:
    """Where new tensors go: "cpu" under the interpreter, else "cuda"."""
    return "cpu" if interpreting() else "cuda"


def device_count_sms() -> int | None:
    """The GPU's streaming multiprocessors (None under the interpreter)."""
    if interpreting() or not cuda_gpu():
        return None
    import torch
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


# --------------------------------------------------------------------------- arrays
def _torch_dtype(name: str):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}[name]


def is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def to_torch(x, name: str):
    """``x`` as a torch tensor where the kernels run: NumPy copied in, torch used as it is."""
    import torch
    dev = device()
    if is_torch(x):
        if dev == "cuda" and not x.is_cuda:
            raise ValueError(f"{name}: a CPU torch tensor; pass a NumPy array or move it to a CUDA device")
        if dev == "cpu" and x.is_cuda:
            raise ValueError(f"{name}: a CUDA tensor, but the kernels run on Triton's interpreter (CPU) here")
        return x
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name}: the triton backend takes NumPy arrays or torch tensors, got "
                         f"{type(x).__module__}.{type(x).__name__}")
    a = np.ascontiguousarray(x)
    if cv.dtype_name(a) == "bfloat16":
        t = torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(dev)


#: host arrays uploaded lately (block tables, lengths), by (device, dtype, shape, bytes): a
#: repeated call with the same content makes no host-to-device copy, which would wait for
#: the copy on every call
_UPLOADED: dict = {}
UPLOAD_CACHE_SIZE = 16


def upload_int32(a, like):
    """A host integer array as an int32 tensor on ``like``'s device, reused while unchanged."""
    import torch
    a = np.ascontiguousarray(a, dtype=np.int32)
    key = (str(like.device), a.shape, a.tobytes())
    t = _UPLOADED.get(key)
    if t is None:
        if len(_UPLOADED) >= UPLOAD_CACHE_SIZE:
            _UPLOADED.pop(next(iter(_UPLOADED)))
        t = _UPLOADED[key] = torch.from_numpy(a.copy()).to(like.device)
    return t


def empty(shape, dtype: str, like=None):
    import torch
    dev = like.device if like is not None else device()
    return torch.empty(tuple(int(s) for s in shape), dtype=_torch_dtype(dtype), device=dev)


def zeros(shape, dtype: str, like=None):
    import torch
    dev = like.device if like is not None else device()
    return torch.zeros(tuple(int(s) for s in shape), dtype=_torch_dtype(dtype), device=dev)


def to_caller(t, numpy_caller: bool):
    """A result back in the caller's kind: NumPy (bfloat16 through ml_dtypes) or the torch tensor."""
    if not numpy_caller:
        return t
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(numpy_dtype("bfloat16")) if hasattr(torch, "uint16") else \
            t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def strides(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.stride())
