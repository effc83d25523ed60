"""The one array layer: the caller's arrays in, the same kind of arrays out.

Every GPU backend (Numba, CuPy, torch) goes through this module, so "what kind of array
did the caller give, where is its memory, which stream is it ordered on, and what do we
hand back" is answered once.

========  =============================================================================
kind      what it is, and how a kernel reaches its memory
========  =============================================================================
numpy     host memory: copied to the device on the way in, copied back on the way out
torch     a torch tensor on a CUDA device: its pointer, no copy; outputs come from
          torch's caching allocator; kernels launch on torch's current stream
cupy      a CuPy array: its pointer, no copy; outputs from CuPy's memory pool; kernels
          launch on CuPy's current stream
numba     a Numba device array (or anything else with ``__cuda_array_interface__``):
          its pointer, no copy; outputs from Numba; the default stream
========  =============================================================================

Outputs are always allocated by the library that owns the inputs.  A device allocation
by another library (``numba.cuda.device_array`` for a torch caller, say) goes around the
caching allocator: a ``cudaMalloc`` now, and a deallocation later that may synchronize
the device, inside the caller's timed region.  Host inputs (NumPy) are the one case that
copies.

:class:`DeviceArray` is a device array as a kernel sees it: a pointer, a shape, strides in
elements, an itemsize and the object that owns the memory (kept alive for the launch).
Nothing here imports a GPU library at module import time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import conventions as cv
from .testing import numpy_dtype

KINDS = ("numpy", "torch", "cupy", "numba")


def _numpy_dtype(name):
    return numpy_dtype(name)


def kind_of(x, name: str = "array") -> str:
    """The kind of ``x`` (see the module table); ValueError naming ``name`` otherwise."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        if not x.is_cuda:
            raise ValueError(f"{name}: a CPU torch tensor; pass a NumPy array (tensor.numpy()) or move "
                             f"it to a CUDA device")
        return "torch"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "__cuda_array_interface__"):
        return "numba"
    if mod == "numba" and hasattr(x, "copy_to_host"):   # Numba's CUDA simulator's device arrays
        return "numba"
    raise ValueError(f"{name}: expected a NumPy array or a CUDA device array (torch, CuPy, Numba), "
                     f"got {type(x).__module__}.{type(x).__name__}")


def check_kinds(**arrays) -> str:
    """All named arrays of one kind; returns it, or a ValueError naming the odd one out."""
    first_name, first_kind = None, None
    for name, a in arrays.items():
        if a is None:
            continue
        k = kind_of(a, name)
        if first_kind is None:
            first_name, first_kind = name, k
        elif k != first_kind:
            raise ValueError(f"{name}: all arrays must be of one kind; {first_name} is {first_kind}, "
                             f"{name} is {k}")
    return first_kind or "numpy"


@dataclass(frozen=True)
class DeviceArray:
    """A device array as a kernel sees it.  ``strides`` are in elements; ``owner`` keeps the
    memory alive (a torch tensor, a CuPy array, a Numba device array)."""

    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    itemsize: int
    owner: object

    @property
    def arg(self):
        """The pointer as a kernel argument (a 64-bit unsigned integer)."""
        return np.uint64(self.ptr)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def aligned(self, nbytes: int) -> bool:
        """Base pointer and every stride but the last a multiple of ``nbytes`` (the condition
        for loading each row in ``nbytes``-wide words)."""
        return self.ptr % nbytes == 0 and all((s * self.itemsize) % nbytes == 0 for s in self.strides[:-1])

    def c_contiguous(self) -> bool:
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and s != expect:
                return False
            expect *= n
        return True


def _interface(x) -> dict:
    return x.__cuda_array_interface__


def device_array(x, dtype: str | None = None) -> DeviceArray:
    """A :class:`DeviceArray` over a torch CUDA tensor, a CuPy array or a CUDA-array-interface
    object, without a copy.  ``dtype`` overrides the element type name (bfloat16 data held as
    uint16, for example)."""
    if isinstance(x, DeviceArray):
        return x
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return DeviceArray(int(x.data_ptr()), tuple(x.shape), tuple(x.stride()), dtype or cv.dtype_name(x),
                           int(x.element_size()), x)
    if mod == "cupy":
        return DeviceArray(int(x.data.ptr), tuple(x.shape), tuple(s // x.itemsize for s in x.strides),
                           dtype or cv.dtype_name(x), int(x.itemsize), x)
    cai = _interface(x)
    item = np.dtype(cai["typestr"]).itemsize
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        elems, acc = [], 1
        for n in reversed(shape):
            elems.append(acc)
            acc *= n
        strides = tuple(reversed(elems))
    else:
        strides = tuple(s // item for s in cai["strides"])
    return DeviceArray(int(cai["data"][0]), shape, strides, dtype or np.dtype(cai["typestr"]).name, item, x)


#: device copies of small host constants (tables, lengths), by content: see Call.constant
_CONSTANTS: dict = {}
CONSTANT_CACHE_ENTRIES = 64


class Call:
    """One call's arrays: what kind the caller gave, its device and stream, and how outputs
    are made and handed back.

    ``upload`` says which library holds device copies of NumPy inputs ("cupy", "torch" or
    "numba"); the Numba backend passes "numba" so that its kernels also run on Numba's CUDA
    simulator.
    """

    def __init__(self, like, *, name: str = "q", upload: str = "cupy"):
        self.kind = kind_of(like, name)
        self.like = like
        self.upload = upload

    # -- in
    def check(self, x, name: str):
        k = kind_of(x, name)
        if k != self.kind:
            raise ValueError(f"{name}: all arrays must be of one kind; expected {self.kind}, got {k}")
        return x

    def to_device(self, x, name: str):
        """The device object for ``x``: the caller's own for device arrays, a device copy
        (made by the ``upload`` library) for NumPy input."""
        self.check(x, name)
        if self.kind != "numpy":
            return x
        a = np.ascontiguousarray(x)
        if cv.dtype_name(a) == "bfloat16":
            a = a.view(np.uint16)
        if self.upload == "numba":
            from numba import cuda
            return cuda.to_device(a)
        if self.upload == "torch":
            import torch
            return torch.from_numpy(a).cuda()
        import cupy
        return cupy.asarray(a)

    def from_host(self, a: np.ndarray):
        """A device copy of the host array ``a`` (block tables, lengths), made by the caller's
        library (the ``upload`` library for NumPy callers), on its current stream."""
        a = np.ascontiguousarray(a)
        lib = self.kind if self.kind in ("torch", "cupy") else self.upload
        if lib == "torch":
            import torch
            device = self.like.device if self.kind == "torch" else "cuda"
            return torch.from_numpy(a).to(device)
        if lib == "cupy":
            import cupy
            if self.kind == "cupy":
                with cupy.cuda.Device(self.like.device.id):
                    return cupy.asarray(a)
            return cupy.asarray(a)
        from numba import cuda
        return cuda.to_device(a)

    def constant(self, a: np.ndarray):
        """A device copy of a small host array that calls repeat (block tables, lengths), kept
        and reused while its content is unchanged: :meth:`from_host` in every call would put a
        host -> device copy from pageable memory, which makes the host wait for the stream,
        into every call.  Keyed by library, device and content; the oldest of
        :data:`CONSTANT_CACHE_ENTRIES` goes first."""
        a = np.ascontiguousarray(a)
        lib = self.kind if self.kind in ("torch", "cupy") else self.upload
        dev = getattr(getattr(self.like, "device", None), "index", None) if self.kind == "torch" else \
            getattr(getattr(self.like, "device", None), "id", None)
        key = (lib, dev, a.dtype.str, a.shape, a.tobytes())
        hit = _CONSTANTS.pop(key, None)
        if hit is None:
            hit = self.from_host(a)
            while len(_CONSTANTS) >= CONSTANT_CACHE_ENTRIES:
                _CONSTANTS.pop(next(iter(_CONSTANTS)))
        _CONSTANTS[key] = hit                   # most recently used last
        return hit

    # -- out
    def empty(self, shape, dtype: str):
        """An uninitialised output of the caller's kind, from the caller's library's allocator."""
        shape = tuple(int(s) for s in shape)
        if self.kind == "torch":
            import torch
            return torch.empty(shape, dtype=getattr(torch, dtype), device=self.like.device)
        store = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(self.like.device.id):
                return cupy.empty(shape, dtype=store)
        lib = self.upload if self.kind == "numpy" else "numba"
        if lib == "cupy":
            import cupy
            return cupy.empty(shape, dtype=store)
        if lib == "torch":
            import torch
            return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        from numba import cuda
        return cuda.device_array(shape, dtype=store)

    def finish(self, out, dtype: str):
        """What the caller gets back: a NumPy copy for NumPy input, else ``out`` itself."""
        if self.kind != "numpy":
            return out
        mod = type(out).__module__.split(".")[0]
        if mod == "torch":
            h = out.detach().cpu()
            if dtype == "bfloat16":
                import torch
                return h.view(torch.int16).numpy().view(_numpy_dtype("bfloat16"))
            return h.numpy()
        h = out.get() if mod == "cupy" else out.copy_to_host()
        return h.view(_numpy_dtype("bfloat16")) if dtype == "bfloat16" else h

    # -- order
    def stream_ptr(self) -> int:
        """The raw stream handle the caller's library is using on the inputs' device (0: the
        default stream).  Launching there orders the kernels after the work that produced the
        inputs and before the work that reads the outputs, with no host synchronisation."""
        if self.kind == "torch":
            import torch
            return int(torch.cuda.current_stream(self.like.device).cuda_stream)
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(self.like.device.id):
                return int(cupy.cuda.get_current_stream().ptr)
        return 0
