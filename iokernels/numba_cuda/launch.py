"""What every Numba op shares at launch: the jit cache, the caller's stream, device views of
the caller's arrays, constants uploaded once, and whether this is the simulator.

Arrays come in and go out through :class:`iokernels.core.arrays.Call` (``upload="numba"``, so
that NumPy input also runs on Numba's CUDA simulator): device arrays are used without a
copy, outputs and scratch buffers come from the caller's library (torch's caching allocator
for torch, CuPy's pool for CuPy), and NumPy input is copied in and out.  A Numba kernel
needs Numba device arrays, so the caller's arrays are wrapped with
``numba.cuda.as_cuda_array(x, sync=False)``: no copy, and no host synchronisation (the
default ``sync=True`` makes the host wait for the array's stream on every array it wraps);
the kernels launch on the caller's stream instead (:func:`stream`), which orders them after
the work that produced the inputs.

The NumPy 2.5 fix for numba-cuda is applied before numba is first imported
(:func:`iokernels.core.gpu.numba_numpy_fix`).  Nothing here touches a GPU at import.
"""
from __future__ import annotations

import functools

import numpy as np

from ..core import gpu
from ..core.arrays import Call
from .config import NUMBA_DTYPES

gpu.numba_numpy_fix()  # before numba is imported
from numba import cuda  # noqa: E402

#: small host constants (block tables, lengths) uploaded once and reused: a synchronous
#: host-to-device copy in every call would stall the launch queue.  Keyed by content,
#: bounded, never shared between devices.
UPLOAD_CACHE_ENTRIES = 32
#: SM count assumed where the device cannot say (the simulator's fake device): an H100/H200.
FALLBACK_SMS = 132
_UPLOADS: dict = {}


def simulated() -> bool:
    """Whether the kernels run on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return gpu.simulator_enabled()


@functools.lru_cache(maxsize=None)
def jitted(pyfunc):
    """The compiled kernel of a kernel factory's Python function (compiled once, reused)."""
    return cuda.jit(pyfunc)


def call_for(like, name: str = "q") -> Call:
    """The :class:`~iokernels.core.arrays.Call` of one launch; RuntimeError when there is no
    usable GPU and the simulator is off."""
    call = Call(like, name=name, upload="numba")
    if not cuda.is_available():
        raise RuntimeError("numba backend: no CUDA GPU is usable here; to run the kernels on Numba's CUDA "
                           "simulator set NUMBA_ENABLE_CUDASIM=1 before numba is first imported")
    return call


def check_dtype(x, name: str) -> str:
    from ..core import conventions as cv
    dt = cv.dtype_name(x)
    if dt not in NUMBA_DTYPES:
        why = (" (these Numba kernels are written for float16/32/64 only; the CuPy backend runs bfloat16)"
               if dt == "bfloat16" else "")
        raise ValueError(f"{name}: the numba backend supports {', '.join(NUMBA_DTYPES)}; got {dt}{why}")
    return dt


def is_numba_array(x) -> bool:
    """A Numba device array (or the simulator's stand-in): it copies itself to the host."""
    return hasattr(x, "copy_to_host") and type(x).__module__.split(".")[0] == "numba"


def view(x):
    """A Numba device view of a device array (no copy, no host synchronisation)."""
    if is_numba_array(x):
        return x
    return cuda.as_cuda_array(x, sync=False)


def device_in(call: Call, x, name: str):
    """The caller's ``x`` as a Numba device array: a view of a device array, a copy of NumPy."""
    return view(call.to_device(x, name))


def empty(call: Call, shape, dtype):
    """(what the caller gets, its Numba view): an output or scratch buffer from the caller's
    library's allocator (Call.empty)."""
    out = call.empty(shape, np.dtype(dtype).name)
    return out, view(out)


def stream(call: Call):
    """The stream the kernels of one call launch on: the caller's library's current stream
    (torch, CuPy), Numba's default stream (0) for NumPy and Numba input and on the simulator."""
    ptr = call.stream_ptr()
    return cuda.external_stream(ptr) if ptr else 0


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


@functools.lru_cache(maxsize=None)
def _sms(device_id: int) -> int:
    try:
        n = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None)
        return int(n) if n else FALLBACK_SMS
    except Exception:  # the simulator's fake device has no SM count
        return FALLBACK_SMS


def num_sms() -> int:
    """Streaming multiprocessors of the current device (read once per device)."""
    return _sms(_device_id())


@functools.lru_cache(maxsize=None)
def _cc(device_id: int) -> int | None:
    try:
        major, minor = cuda.get_current_device().compute_capability
        return 10 * major + minor
    except Exception:
        return None


def compute_capability() -> int | None:
    """The current device's compute capability x 10 (90 for an H100), None on the simulator
    (read once per device: every call's registry need asks for it)."""
    if simulated():
        return None
    return _cc(_device_id())


def c_contiguous(x) -> bool:
    """Whether an array of any kind is C-contiguous, so that a flat view of it is the same
    memory.  (The simulator's arrays report ``is_c_contiguous()`` True even for a strided
    slice; the NumPy array they wrap knows better.)"""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    ary = getattr(x, "_ary", None)
    if isinstance(ary, np.ndarray):
        return ary.flags.c_contiguous
    f = getattr(x, "is_c_contiguous", None)
    if callable(f):
        return bool(f())
    f = getattr(x, "is_contiguous", None)          # torch
    if callable(f):
        return bool(f())
    return bool(getattr(getattr(x, "flags", None), "c_contiguous", False))


def aligned(x, nbytes: int) -> bool:
    """Whether a (C-contiguous) device array starts on an nbytes boundary: word views need it
    (a torch slice with an odd storage offset does not)."""
    try:
        return x.__cuda_array_interface__["data"][0] % nbytes == 0
    except (AttributeError, KeyError, TypeError):   # the simulator's arrays wrap NumPy ones
        ary = getattr(x, "_ary", x)
        return isinstance(ary, np.ndarray) and ary.flags.c_contiguous and ary.ctypes.data % nbytes == 0
