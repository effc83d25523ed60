"""Arrays in and out of the Numba kernels: NumPy, Numba device arrays, CuPy, torch CUDA.

Device arrays (anything with ``__cuda_array_interface__``: Numba, CuPy, torch CUDA tensors)
are wrapped with ``numba.cuda.as_cuda_array``: no copy, and no host synchronization: the
kernels launch on the stream the caller's library is using (:func:`stream_of`), which
orders them after the work that produced the inputs.  (``as_cuda_array``'s default,
``sync=True``, makes the *host* wait for that stream on every array it wraps: the queue
drains before each launch, and the launch overhead of every call shows up as GPU idle
time.  The H200 runs before 2026-11-29 12:30 UTC timed the Numba kernels that way.)
NumPy arrays are copied to the device and the results copied back.  Outputs are allocated
by the library that owns the inputs (torch's caching allocator for torch, CuPy's pool for
CuPy), so the caller gets back the kind of array it gave.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core import gpu as _gpu  # noqa: E402
_gpu.numba_numpy_fix()  # before numba is imported
from numba import cuda  # noqa: E402

#: storage dtypes the Numba kernels accept (bfloat16 has no Numba arithmetic type we use)
NUMBA_DTYPES = ("float16", "float32", "float64")


def kind_of(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        if not x.is_cuda:
            return "torch_cpu"
        return "torch"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "copy_to_host"):
        return "numba"
    return "unknown"


def check_kinds(**arrays) -> str:
    """All arrays of one kind (numpy / numba / cupy / torch); ValueError naming the odd one."""
    kinds = {name: kind_of(a) for name, a in arrays.items()}
    for name, k in kinds.items():
        if k in ("unknown", "torch_cpu"):
            what = "a CPU torch tensor (use .numpy() or move it to CUDA)" if k == "torch_cpu" else type(arrays[name]).__name__
            raise ValueError(f"{name}: the numba backend takes NumPy arrays or CUDA device arrays; got {what}")
    if not cuda.is_available():
        raise RuntimeError("numba backend: no CUDA GPU is usable here; to run the kernels on Numba's CUDA "
                           "simulator set NUMBA_ENABLE_CUDASIM=1 before numba is first imported")
    first_name, first = next(iter(kinds.items()))
    for name, k in kinds.items():
        if k != first:
            raise ValueError(f"{name}: all arrays must be of one kind; {first_name} is {first}, {name} is {k}")
    return first


def check_dtype(x, name) -> str:
    dt = cv.dtype_name(x)
    if dt not in NUMBA_DTYPES:
        raise ValueError(f"{name}: the numba backend supports {', '.join(NUMBA_DTYPES)}; got {dt}")
    return dt


def to_device(x, kind):
    """A Numba device view of ``x`` (a copy to the device for NumPy input)."""
    if kind == "numpy":
        return cuda.to_device(np.ascontiguousarray(x))
    if kind == "numba":
        return x
    return cuda.as_cuda_array(x, sync=False)      # ordered by the launch stream instead


def empty(kind, like, shape, dtype):
    """(handle, device view): an uninitialized output of the caller's kind."""
    dtype = np.dtype(dtype)
    if kind == "torch":
        import torch
        t = torch.empty(tuple(shape), dtype=getattr(torch, dtype.name), device=like.device)
        return t, cuda.as_cuda_array(t, sync=False)
    if kind == "cupy":
        import cupy
        with cupy.cuda.Device(like.device.id):
            a = cupy.empty(tuple(shape), dtype=dtype)
        return a, cuda.as_cuda_array(a, sync=False)
    d = cuda.device_array(tuple(shape), dtype=dtype)
    return d, d


def stream_of(kind, like):
    """The stream the kernels of one call launch on (the third launch-config element).

    torch and CuPy inputs: that library's current stream on the inputs' device, so the
    kernels run after the work that produced the inputs and before the work that will read
    the outputs, as torch's and CuPy's own kernels would, without the host waiting.
    NumPy and Numba inputs: 0, Numba's default stream (the simulator ignores streams).
    """
    ptr = 0
    if kind == "torch":
        import torch
        ptr = torch.cuda.current_stream(like.device).cuda_stream
    elif kind == "cupy":
        import cupy
        with cupy.cuda.Device(like.device.id):
            ptr = cupy.cuda.get_current_stream().ptr
    return cuda.external_stream(ptr) if ptr else 0


def finish(kind, handle):
    """What the caller gets back: a host copy for NumPy input, else the device array itself."""
    if kind == "numpy":
        return handle.copy_to_host()
    return handle


#: small host constants (block tables, lengths, dummy outputs) uploaded once and reused:
#: a synchronous host-to-device copy in every call would stall the launch queue.  Keyed by
#: content, bounded, never shared between devices.
_UPLOADS: "dict" = {}
UPLOAD_CACHE_ENTRIES = 32


def _device_id():
    try:
        return cuda.get_current_device().id
    except Exception:  # the simulator's fake device
        return 0


def upload_constant(a: np.ndarray):
    """A device copy of a small host array, reused while its content is unchanged."""
    a = np.ascontiguousarray(a)
    key = (_device_id(), a.dtype.str, a.shape, a.tobytes())
    dev = _UPLOADS.get(key)
    if dev is None:
        if len(_UPLOADS) >= UPLOAD_CACHE_ENTRIES:
            _UPLOADS.pop(next(iter(_UPLOADS)))
        dev = _UPLOADS[key] = cuda.to_device(a)
    return dev
