"""A kernel's arguments packed once and launched through the driver: the run half of a plan.

``cuLaunchKernel`` takes a kernel's arguments as an array of pointers, one per parameter,
each to that parameter's bytes (``kernelParams``; CUDA Driver API reference, documentation).
A CuPy ``RawKernel`` call builds both from Python objects on every launch, one conversion per
argument, and enters the caller's stream as CuPy's current stream around it.  A plan's
arguments are the same on every run but for a few pointers (its inputs' and outputs'), so
:class:`ArgBuffer` lays their bytes out once in one host buffer, keeps the pointer array beside
it, and a launch rewrites only the pointer slots that change and calls the driver once, on the
stream it is given.

The driver reads the arguments during the call and keeps no reference to the buffer (a CUDA
graph that captures the launch keeps its own copy), so the next launch may rewrite it at once.
Each thread gets its own copy of the buffer: two threads running one plan never see each
other's pointers.
"""
from __future__ import annotations

import threading

import numpy as np

#: byte alignment of a 128-byte TMA tensor map (CUtensorMap is declared 64-byte aligned)
MAP_ALIGN = 64
#: placeholder pointers of an argument template (a run writes the arrays' pointers there)
SLOT = 0x7FF0_0000_0000_0000


def placeholder(j: int) -> np.uint64:
    """The placeholder of the j-th pointer a run writes (an address no allocation has)."""
    return np.uint64(SLOT + j)


def kept(cache, key, build, cap: int):
    """``cache[key]`` (an OrderedDict), made by ``build()`` on a miss and kept; past ``cap`` entries
    the least recently used go first.  Threads may share ``cache``: an entry another thread drops
    meanwhile is made again on its next miss, never raised over."""
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = build()
        while len(cache) > cap:
            try:
                cache.popitem(last=False)
            except KeyError:                 # emptied by another thread
                break
    else:
        try:
            cache.move_to_end(key)
        except KeyError:                     # dropped by another thread since the get
            pass
    return hit


def kept_until_full(cache: dict, key, build, cap: int):
    """``cache[key]``, made by ``build()`` on a miss; a miss on a full cache (``cap`` entries)
    empties it first (a plan launches few shapes: a hit costs one lookup, no bookkeeping)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= cap:
            cache.clear()
        hit = cache[key] = build()
    return hit


def slots_of(args: tuple, ids) -> list[int] | None:
    """Where the placeholders ``placeholder(j)`` (j in ``ids``) sit in ``args``; None where one
    of them is missing."""
    where = {int(a) - SLOT: i for i, a in enumerate(args) if type(a) is np.uint64 and int(a) >= SLOT}
    return None if any(j not in where for j in ids) else [where[j] for j in ids]


def _layout(args) -> tuple[list[int], int] | None:
    """(byte offset of each argument, total bytes), each at its natural alignment (8 at most, 64
    for a tensor map), or None when an argument is not a NumPy scalar or a one-element NumPy array
    (a Python int or float has no fixed width: such arguments go through CuPy's own launch)."""
    offsets, end = [], 0
    for a in args:
        if isinstance(a, np.ndarray):
            if a.size != 1:
                return None
        elif not isinstance(a, np.generic):
            return None
        n = a.nbytes
        align = MAP_ALIGN if n >= MAP_ALIGN else min(8, 1 << (n - 1).bit_length()) if n else 1
        end = -(-end // align) * align
        offsets.append(end)
        end += n
    return offsets, end


class ArgBuffer:
    """The arguments ``args`` (NumPy scalars; tensor maps as one-element arrays) of one kernel,
    packed for ``cuLaunchKernel``; ``slots``: the indices of the 8-byte arguments (pointers) a
    launch rewrites, in the order :meth:`launch` takes their values.

    Build it with :meth:`of`, which returns None for arguments it cannot pack."""

    def __init__(self, args: tuple, slots=()):
        lay = _layout(args)
        if lay is None:
            raise TypeError("args: NumPy scalars or one-element NumPy arrays only")
        self.offsets, self.nbytes = lay
        for i in slots:
            if np.asarray(args[i]).nbytes != 8:
                raise ValueError(f"slots: argument {i} is not 8 bytes wide (a pointer)")
        self.slots = tuple(slots)
        self._bytes = b"".join(self._placed(args))
        self._local = threading.local()

    @classmethod
    def of(cls, args: tuple, slots=()) -> ArgBuffer | None:
        """An ArgBuffer of ``args``, or None where an argument is no NumPy scalar or array."""
        return None if _layout(args) is None else cls(args, slots)

    def _placed(self, args):
        """The argument bytes with the padding between them, in order."""
        at = 0
        for a, off in zip(args, self.offsets):
            yield bytes(off - at)
            raw = np.asarray(a).tobytes()
            yield raw
            at = off + len(raw)

    def _mine(self) -> tuple:
        """This thread's (uint64 view of the slots' words, kernelParams address, the buffers)."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            store = np.zeros(self.nbytes + MAP_ALIGN, np.uint8)
            start = (-store.ctypes.data) % MAP_ALIGN                # the buffer starts on 64 bytes
            buf = store[start:start + self.nbytes]
            buf[:] = np.frombuffer(self._bytes, np.uint8)
            base = buf.ctypes.data
            params = np.array([base + off for off in self.offsets], np.uint64)
            words = memoryview(store[start:start + self.nbytes // 8 * 8].view(np.uint64))
            word_of = tuple(self.offsets[i] // 8 for i in self.slots)
            mine = self._local.mine = (words, word_of, int(params.ctypes.data), (store, params))
        return mine

    def param_offsets(self) -> list[int]:
        """Where each kernelParams pointer points, as an offset into this thread's buffer."""
        _, _, _, (store, params) = self._mine()
        start = store.ctypes.data + (-store.ctypes.data) % MAP_ALIGN
        return [int(p) - start for p in params]

    def set(self, *values: int) -> int:
        """Write ``values`` (ints: device pointers) into the slots; returns the kernelParams address."""
        words, word_of, params, _ = self._mine()
        for w, x in zip(word_of, values):
            words[w] = x
        return params

    def launch(self, function_ptr: int, grid: tuple, block: tuple, smem: int, stream: int, *values: int) -> None:
        """One ``cuLaunchKernel`` of the function at ``function_ptr`` on ``stream`` (a pointer; 0:
        the legacy default stream), with ``values`` in the slots."""
        params = self.set(*values)
        _driver().launchKernel(function_ptr, grid[0], grid[1] if len(grid) > 1 else 1,
                               grid[2] if len(grid) > 2 else 1, block[0], block[1] if len(block) > 1 else 1,
                               block[2] if len(block) > 2 else 1, smem, stream, params, 0)


_DRIVER: list = []


def _driver():
    if not _DRIVER:
        from cupy.cuda import driver
        _DRIVER.append(driver)
    return _DRIVER[0]


def function_ptr(fn) -> int:
    """The CUfunction handle of a compiled ``cupy.RawKernel`` on the current device."""
    return int(fn.kernel.ptr)
