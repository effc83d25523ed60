"""A stand-in for CuPy over NumPy host memory, for tests/test_cupy_launch_args.py only.

It has just enough of CuPy's surface (arrays with .data.ptr, RawModule, a device with an
H200's attributes) to drive the CuPy launchers without a GPU: compiled "kernels" record
their launches (grid, block, shared memory, arguments, -D options) in LAUNCHES instead of
running.  It is put on sys.path only in the subprocess that test starts.
"""
import numpy as _np
__version__ = "fake"
uint16 = _np.uint16
LAUNCHES = []


class _Data:
    def __init__(self, ptr): self.ptr = ptr


class _Dev:
    id = 0


class ndarray:
    """A NumPy array seen as a device array (its host pointer stands in for a device one)."""

    def __init__(self, a):
        self._a = a
    @property
    def shape(self): return self._a.shape
    @property
    def strides(self): return self._a.strides
    @property
    def itemsize(self): return self._a.itemsize
    @property
    def dtype(self): return self._a.dtype
    @property
    def size(self): return self._a.size
    @property
    def ndim(self): return self._a.ndim
    @property
    def data(self): return _Data(self._a.ctypes.data)
    @property
    def device(self): return _Dev()
    def get(self): return self._a.copy()
    def fill(self, value): self._a.fill(value)
    def view(self, dt): return ndarray(self._a.view(dt))
    def reshape(self, *s): return ndarray(self._a.reshape(*s))
    def __getitem__(self, i): return ndarray(self._a[i])


def asarray(x, dtype=None):
    if isinstance(x, ndarray):
        return x
    return ndarray(_np.array(x, dtype=dtype, copy=True))


def array(x, order="C", copy=True):
    a = x._a if isinstance(x, ndarray) else x
    return ndarray(_np.array(a, order=order, copy=copy))


def empty(shape, dtype=_np.float32):
    return ndarray(_np.empty(shape, dtype=dtype))


def zeros(shape, dtype=_np.float32):
    return ndarray(_np.zeros(shape, dtype=dtype))


def ascontiguousarray(x):
    return ndarray(_np.ascontiguousarray(x._a))


def is_available():
    return True


#: the stand-in kernels by their handle (the ``kernel.ptr`` a driver launch names)
FUNCTIONS = {}


class _Fn:
    def __init__(self, name, code, options):
        self.name, self.code, self.options = name, code, options
        self.max_dynamic_shared_size_bytes = 0
        self.kernel = type("K", (), {"ptr": 0x1000 + len(FUNCTIONS)})()
        FUNCTIONS[self.kernel.ptr] = self
        self.arg_types = None             # each argument's NumPy type, from a CuPy-style launch

    def __call__(self, grid, block, args, shared_mem=0):
        self.arg_types = [_np.asarray(a).dtype for a in args]
        self.dims = (len(grid), len(block))
        LAUNCHES.append(dict(name=self.name, grid=grid, block=block, args=args, smem=shared_mem,
                             options=self.options, via="cupy"))


def _launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """cuLaunchKernel's stand-in: the arguments read through the kernelParams pointers, typed as
    an earlier CuPy-style launch of the same kernel passed them (tests launch eagerly first)."""
    import ctypes
    fn = FUNCTIONS[f]
    if fn.arg_types is None:
        raise RuntimeError(f"stand-in: {fn.name} launched through the driver before any CuPy-style launch")
    ptrs = (ctypes.c_uint64 * len(fn.arg_types)).from_address(params)
    args = []
    for p, t in zip(ptrs, fn.arg_types):
        a = _np.frombuffer(ctypes.string_at(int(p), t.itemsize), t)
        args.append(a.copy() if t.kind == "V" else a[0])
    ng, nb = fn.dims                      # recorded with as many sizes as the CuPy-style launch gave
    LAUNCHES.append(dict(name=fn.name, grid=(gx, gy, gz)[:ng], block=(bx, by, bz)[:nb], args=tuple(args),
                         smem=smem, options=fn.options, via="driver"))


class _Module:
    def __init__(self, code, options):
        self.code, self.options = code, options

    def get_function(self, name):
        return _Fn(name, self.code, self.options)


class _Stream:
    ptr = 0


class _Cuda:
    class Device:
        def __init__(self, i=0): self.id = 0
        compute_capability = "90"
        attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448, "L2CacheSize": 50 << 20}
        def synchronize(self): pass
        def __enter__(self): return self
        def __exit__(self, *a): return False

    @staticmethod
    def get_current_stream():
        return _Stream()

    class ExternalStream:
        def __init__(self, ptr): self.ptr = ptr
        def __enter__(self): return self
        def __exit__(self, *a): return False

    class driver:
        @staticmethod
        def occupancyMaxActiveBlocksPerMultiprocessor(ptr, threads, smem):
            return 2

        launchKernel = staticmethod(_launch_kernel)


cuda = _Cuda()
import sys as _sys  # noqa: E402
_sys.modules["cupy.cuda"] = cuda
_sys.modules["cupy.cuda.driver"] = cuda.driver
RawModule = _Module
