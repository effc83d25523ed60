"""What every CuPy op shares: the .cu sources, NVRTC compilation and its cache, the device.

A kernel is compiled the first time a (file, kernel, defines, device) combination is
launched, through ``cupy.RawModule`` (NVRTC), with the config's sizes as ``-D`` defines;
:data:`_MODULES` keeps the compiled functions (CuPy also caches the binaries on disk).
That cache is the only state this module holds.  Nothing here touches a GPU at import.
"""
from __future__ import annotations

import contextlib
import functools
import pathlib
import re
from collections.abc import Mapping

from ..core.registry import Registry

#: the CuPy backend's records, keyed by (op, version): filled by the family modules
#: (:mod:`.registry` re-exports it with the checks)
REGISTRY = Registry("cupy")
#: where the CUDA C++ sources live (this package's kernels/ folder)
KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels"
#: NVRTC options of the Hopper kernels (wgmma, setmaxnreg need sm_90a)
HOPPER_OPTIONS = ("-arch=sm_90a",)
#: the record-less sm_90a files (the GEMM is a ceiling to compare with, not a registered op; the
#: FP8 forward's versions are opt-in, called by name: hopper/fp8_forward.py);
#: every other Hopper file is a record's whose ``extra["options"]`` is HOPPER_OPTIONS
HOPPER_UNRECORDED = ("hopper_gemm", "fa_fp8_v1", "fa_fp8_v2")


def hopper_files() -> frozenset:
    """The stems of the sm_90a kernel files: those of the records compiled with
    HOPPER_OPTIONS, and HOPPER_UNRECORDED."""
    return frozenset({r.file.removesuffix(".cu") for r in REGISTRY if r.extra.get("options") == HOPPER_OPTIONS}
                     | set(HOPPER_UNRECORDED))


class KernelFiles(Mapping):
    """The kernel files in kernels/ by stem (``hopper``: the sm_90a ones, else the portable
    ones), read from the records when asked (so a new record's file is in the right table)."""

    def __init__(self, hopper: bool):
        self.hopper = hopper

    def _table(self) -> dict:
        hop = hopper_files()
        return {p.stem: p.name for p in sorted(KERNEL_DIR.glob("*.cu")) if (p.stem in hop) == self.hopper}

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())

    def __repr__(self):
        return f"KernelFiles({self._table()!r})"


#: every portable kernel file, by name, found in kernels/ (tests/test_cupy_compile.py compiles
#: each one for every arch); :data:`HOPPER_SOURCES` the Hopper ones
SOURCES = KernelFiles(hopper=False)
HOPPER_SOURCES = KernelFiles(hopper=True)
#: -DIK_DTYPE values (base.cuh, shared by the portable and the Hopper kernels)
DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
#: above this much dynamic shared memory a kernel must opt in to more (48 KB less the
#: static shared memory some kernels also declare); opting in early costs nothing
OPT_IN_ABOVE_BYTES = 32 * 1024

_MODULES: dict = {}


def cupy():
    """CuPy, once we know there is a GPU; a RuntimeError that says so otherwise."""
    if not cupy_ok():
        raise RuntimeError("backend 'cupy' needs a CUDA GPU (cupy.is_available() is False); "
                           "use backend='numba' (the simulator) or 'tiled' without one")
    import cupy as cp
    return cp


def cupy_ok() -> bool:
    """True when CuPy is installed and sees a CUDA device (asked once, lazily)."""
    from ..core.gpu import cupy_gpu
    return cupy_gpu()


def device_info() -> dict:
    """Compute capability (x 10), SM count, opt-in shared memory per block and L2 cache bytes (0:
    not reported) of the current GPU."""
    cp = cupy()
    return dict(_device_info(cp.cuda.Device().id))


@functools.lru_cache(maxsize=None)
def _device_info(dev_id: int) -> dict:
    import cupy as cp
    dev = cp.cuda.Device(dev_id)
    attrs = dev.attributes                      # one query of every attribute: slow, so cached
    return dict(id=dev.id, cc=int(dev.compute_capability), sms=int(attrs["MultiProcessorCount"]),
                smem_optin=int(attrs.get("MaxSharedMemoryPerBlockOptin", attrs.get("MaxSharedMemoryPerBlock", 49152))),
                l2=int(attrs.get("L2CacheSize", 0)))


def source(name: str, sources: dict | None = None) -> str:
    """The CUDA source of kernel file ``name`` (a key of ``sources``, default :data:`SOURCES`,
    with or without ``.cu``) with its ``#include "....cuh"`` files inlined, each once (what
    NVRTC compiles)."""
    name = name.removesuffix(".cu")
    return inline_headers((KERNEL_DIR / (sources or SOURCES)[name]).read_text(), KERNEL_DIR)


def inline_headers(text: str, header_dir: pathlib.Path) -> str:
    """``text`` with each ``#include "....cuh"`` replaced by that header from ``header_dir``,
    itself inlined, each header once."""
    seen = set()

    def inline(text):
        def sub(m):
            if m.group(1) in seen:
                return ""
            seen.add(m.group(1))
            return inline((header_dir / m.group(1)).read_text().replace("#pragma once", ""))
        return re.sub(r'#include "([a-z_0-9]+\.cuh)"', sub, text)

    return inline(text)


def hopper_source(name: str) -> str:
    """:func:`source` of a Hopper kernel file (a key of :data:`HOPPER_SOURCES`)."""
    return source(name, HOPPER_SOURCES)


def function(name: str, kernel: str, defines: dict, smem: int = 0, *, options=(), sources=None):
    """Compile (once) and return ``kernel`` from file ``name`` with ``defines``; ``options``:
    more NVRTC flags (the Hopper kernels add ``-arch=sm_90a``), ``sources``: the file table
    ``name`` is looked up in (default :data:`SOURCES`)."""
    cp = cupy()
    name = name.removesuffix(".cu")
    dev = cp.cuda.Device().id
    key = (name, kernel, tuple(sorted(defines.items())), tuple(options), dev)
    fn = _MODULES.get(key)
    if fn is None:
        opts = ("-std=c++17",) + tuple(options) + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))
        mod = cp.RawModule(code=source(name, sources), options=opts)
        fn = mod.get_function(kernel)
        if smem > OPT_IN_ABOVE_BYTES:
            fn.max_dynamic_shared_size_bytes = int(smem)
        _MODULES[key] = fn
    return fn


def blocks_per_sm(fn, threads, smem=0) -> int:
    """How many blocks of ``fn`` an SM holds at once (registers, shared memory), from the driver."""
    from cupy.cuda import driver
    try:
        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, int(smem)))
    except Exception:  # an older CuPy without the binding: the figure the heuristic assumes
        return 4


def on_stream(stream_ptr: int):
    """The one stream rule: every launch (and allocation) runs inside this context, which makes
    CuPy launch on the caller's stream ``stream_ptr`` (from ``Call.stream_ptr()``; 0: CuPy's
    current stream, left as it is)."""
    if not stream_ptr:
        return contextlib.nullcontext()
    return cupy().cuda.ExternalStream(stream_ptr)


def contiguous(x, align: int = 1):
    """``x`` (a device object) C-contiguous and starting on ``align`` bytes: x itself when it
    is, else one contiguous copy made by x's own library (torch, CuPy)."""
    from ..core.arrays import device_array
    a = device_array(x)
    if a.c_contiguous() and a.ptr % align == 0:
        return x
    if type(x).__module__.split(".")[0] == "torch":
        return x.contiguous() if not x.is_contiguous() else x.clone()
    cp = cupy()
    return cp.array(cp.asarray(x), order="C", copy=True)


def fill(x, value) -> None:
    """Fill a device buffer of the caller's library (torch or CuPy) in place, on the current
    stream (the allocators hand out uninitialised memory)."""
    if type(x).__module__.split(".")[0] == "torch":
        x.fill_(value)
    else:
        x.fill(value)


def current_stream_ptr() -> int:
    """CuPy's current stream (inside :func:`on_stream`: the caller's), as a pointer."""
    return int(cupy().cuda.get_current_stream().ptr)


def unit_rows(x):
    """``x`` (a device object) as a :class:`~iokernels.core.arrays.DeviceArray` whose rows have
    unit stride on the last axis: the same memory when they do (other strides are passed
    to the kernels), else one contiguous copy made by x's own library."""
    from ..core.arrays import device_array
    a = device_array(x)
    if not a.shape or a.shape[-1] <= 1 or a.strides[-1] == 1:
        return a
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return device_array(x.contiguous())
    cp = cupy()
    return device_array(cp.ascontiguousarray(cp.asarray(x)), a.dtype)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
