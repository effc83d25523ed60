"""A small, deterministic SIMT runner for the GPU labs: traffic, and shared-memory races.

A Numba CUDA kernel is a Python function.  This module runs that function the way a GPU
runs it -- one Python thread per GPU thread, one block at a time, ``syncthreads`` a real
barrier -- with two instruments the simulator lacks:

* global arrays are :class:`iokernels.numba_cuda.counting.CountingArray` objects, so every
  element the kernel reads or writes in global memory (HBM) is counted by tensor name;
* shared arrays are tracked: each element remembers which thread last wrote it and who
  read it, in which *barrier interval* (the number of ``syncthreads`` the thread has passed).
  Two threads touching the same element in the same interval, one of them writing, is a
  hazard (a race), whatever the order the threads happened to run in: the check is
  deterministic, like ``compute-sanitizer --tool racecheck``.

Notation: an *interval* (epoch) is the stretch of a thread's execution between two
barriers; a hazard is a write and another thread's read (RW) or write (WAW) of one element
in the same interval.

Only what the labs' kernels use is provided: ``threadIdx``, ``blockIdx``, ``blockDim``,
``gridDim`` (x, y), ``shared.array``, ``local.array``, ``syncthreads``.
"""
from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass

import numpy as np

from ..core.traffic import Traffic

__all__ = ["Race", "RaceError", "BarrierError", "launch", "python_function"]

#: a barrier no thread reaches for this long means some threads skipped it (a deadlock)
BARRIER_TIMEOUT_S = 20.0


@dataclass(frozen=True, order=True)
class Race:
    """One hazard on a shared-array element: a write and another thread's access, unordered.

    ``kind`` is "WAW" (two threads write it) or "RW" (one writes, another reads; RAW or WAR
    depending on which ran first, which the schedule decides: the report does not say).
    Of all the hazards of a block the smallest (array, index, interval) is reported, so the
    report is the same whatever order the threads ran in.
    """

    array: int           # which shared array of the kernel (0-based, in allocation order)
    index: tuple
    interval: int
    kind: str
    write_line: int
    other_line: int

    def describe(self) -> str:
        other = "written again" if self.kind == "WAW" else "read"
        return (f"race on shared array #{self.array} element {list(self.index)}: written (kernel line "
                f"{self.write_line}) and {other} (line {self.other_line}) by two different threads in the "
                f"same barrier interval (number {self.interval}): no cuda.syncthreads() separates them")


class RaceError(Exception):
    def __init__(self, race: Race):
        super().__init__(race.describe())
        self.race = race


class BarrierError(Exception):
    """Some threads of a block never reached a syncthreads the others wait at."""


def python_function(kernel):
    """The Python function behind a Numba CUDA kernel (simulator or GPU dispatcher) or a plain function."""
    for attr in ("py_func", "fn"):
        fn = getattr(kernel, attr, None)
        if isinstance(fn, types.FunctionType):
            return fn
    if isinstance(kernel, types.FunctionType):
        return kernel
    raise TypeError(f"expected a @cuda.jit kernel or a Python function, got {type(kernel).__name__}")


def _as_dtype(dtype):
    try:
        return np.dtype(dtype)
    except TypeError:
        from numba.np.numpy_support import as_dtype
        return as_dtype(dtype)


class _Dim3:
    __slots__ = ("x", "y", "z")

    def __init__(self, x=1, y=1, z=1):
        self.x, self.y, self.z = x, y, z


class _Block:
    """The state one thread block shares: its barrier, its shared arrays, the race records."""

    def __init__(self, nthreads, code):
        self.barrier = threading.Barrier(nthreads, timeout=BARRIER_TIMEOUT_S)
        self.lock = threading.Lock()
        self.shared: list = []
        self.code = code
        self.races: set = set()

    @property
    def race(self):
        return min(self.races) if self.races else None


class _Tracked:
    """A shared-memory array whose element accesses are checked for hazards."""

    def __init__(self, block: _Block, number: int, shape, dtype, thread_state):
        self.data = np.zeros(shape, dtype)
        self.shape, self.dtype, self.ndim = self.data.shape, self.data.dtype, self.data.ndim
        self._ids = np.arange(self.data.size).reshape(self.data.shape)
        self._block, self._number, self._state = block, number, thread_state
        self._writer = {}        # flat id -> (thread, interval, line)
        self._readers = {}       # flat id -> (interval, {thread: line})

    def _line(self):
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not self._block.code:
            frame = frame.f_back
        return frame.f_lineno if frame is not None else -1

    def _hazard(self, kind, flat, write_line, other_line, interval):
        idx = tuple(int(i) for i in np.unravel_index(flat, self.shape))
        self._block.races.add(Race(self._number, idx, interval, kind, write_line, other_line))

    def __getitem__(self, idx):
        t, e = self._state.tid, self._state.interval
        with self._block.lock:
            for flat in np.ravel(self._ids[idx]):
                w = self._writer.get(flat)
                if w is not None and w[0] != t and w[1] == e:
                    self._hazard("RW", flat, w[2], self._line(), e)
                r = self._readers.get(flat)
                if r is None or r[0] != e:
                    r = (e, {})
                    self._readers[flat] = r
                r[1].setdefault(t, self._line())
        return self.data[idx]

    def __setitem__(self, idx, value):
        t, e = self._state.tid, self._state.interval
        with self._block.lock:
            line = self._line()
            for flat in np.ravel(self._ids[idx]):
                w = self._writer.get(flat)
                if w is not None and w[0] != t and w[1] == e:
                    self._hazard("WAW", flat, w[2], line, e)
                r = self._readers.get(flat)
                if r is not None and r[0] == e:
                    other = next((u for u in r[1] if u != t), None)
                    if other is not None:
                        self._hazard("RW", flat, line, r[1][other], e)
                self._writer[flat] = (t, e, line)
            self.data[idx] = value


class _FakeCuda:
    """The part of ``numba.cuda`` a kernel sees, per thread."""

    def __init__(self, grid, block_dim):
        self._local = threading.local()
        self.gridDim, self.blockDim = _Dim3(*grid), _Dim3(*block_dim)
        outer = self

        class _Shared:
            @staticmethod
            def array(shape, dtype):
                st = outer._local
                n = st.shared_calls
                st.shared_calls += 1
                blk = st.block
                with blk.lock:
                    if n == len(blk.shared):
                        blk.shared.append(_Tracked(blk, n, shape, _as_dtype(dtype), st))
                arr = blk.shared[n]
                view = _Tracked.__new__(_Tracked)     # the same storage, this thread's identity
                view.__dict__.update(arr.__dict__)
                view._state = st
                return view

        class _LocalMem:
            @staticmethod
            def array(shape, dtype):
                return np.zeros(shape, _as_dtype(dtype))

        self.shared, self.local = _Shared, _LocalMem

    @property
    def threadIdx(self):
        return self._local.thread_idx

    @property
    def blockIdx(self):
        return self._local.block_idx

    def syncthreads(self):
        st = self._local
        try:
            st.block.barrier.wait()
        except threading.BrokenBarrierError:
            raise BarrierError("a cuda.syncthreads() was not reached by every thread of the block "
                               "(is it inside a branch some threads skip, or after an early return?)") from None
        st.interval += 1


def launch(kernel, grid, block, *args, traffic: Traffic | None = None):
    """Run ``kernel`` (a @cuda.jit kernel or its Python function) on ``grid`` x ``block``.

    ``args``: NumPy arrays are passed as they are; wrap them in CountingArray first to count
    global traffic.  Raises :class:`RaceError` on the first shared-memory hazard,
    :class:`BarrierError` on a barrier not every thread reaches, and re-raises the first
    exception a thread raised.
    """
    lab_guard = getattr(kernel, "lab_guard", None)      # a graded learner's kernel: references out of reach
    if lab_guard is not None:
        with lab_guard():
            return launch(python_function(kernel), grid, block, *args, traffic=traffic)
    fn = python_function(kernel)
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    block = (block,) if isinstance(block, int) else tuple(block)
    fake = _FakeCuda(grid, block)
    glb = dict(fn.__globals__)
    glb["cuda"] = fake
    run = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    nthreads = int(np.prod(block))
    for bidx in np.ndindex(*reversed(grid)):                  # blocks one after another
        bidx = tuple(reversed(bidx))
        blk = _Block(nthreads, fn.__code__)
        errors = []

        def body(tid, bidx=bidx, blk=blk):
            st = fake._local
            st.tid, st.interval, st.shared_calls, st.block = tid, 0, 0, blk
            tx = np.unravel_index(tid, tuple(reversed(block)))[::-1]
            st.thread_idx, st.block_idx = _Dim3(*map(int, tx)), _Dim3(*bidx)
            try:
                run(*args)
            except BaseException as exc:                      # noqa: BLE001 - reported below
                errors.append(exc)
                blk.barrier.abort()

        threads = [threading.Thread(target=body, args=(t,)) for t in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if blk.race is not None:
            raise RaceError(blk.race)
        real = [e for e in errors if not isinstance(e, BarrierError)]
        if real:
            raise real[0]
        if errors:
            raise errors[0]
