"""The packed kernel arguments of a plan's run (iokernels/cupy_raw/packed.py), on the CPU:
what cuLaunchKernel would read through each kernelParams pointer is the argument's bytes, the
slots a run rewrites hold the new pointers, and two threads never share a buffer."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from iokernels.cupy_raw.packed import MAP_ALIGN, ArgBuffer, placeholder, slots_of


def _tensor_map(fill: int) -> np.ndarray:
    """A stand-in for a 128-byte CUtensorMap (a one-element NumPy void array, as tensor_map returns)."""
    return np.frombuffer(bytes(range(fill, fill + 128)), dtype=np.dtype((np.void, 128))).copy()


def _args():
    return (np.uint64(0x1234_5678_9ABC), np.int32(-7), _tensor_map(3), np.float32(0.125), np.int64(1 << 40),
            placeholder(0), np.int32(5), placeholder(1), np.float64(2.5), np.uint8(9), placeholder(2))


def _read_params(buf: ArgBuffer, args) -> list[bytes]:
    """The bytes behind each kernelParams pointer, read from host memory as the driver would."""
    params_addr = buf.set()                       # no values: the slots keep their bytes
    ptrs = (ctypes.c_uint64 * len(args)).from_address(params_addr)
    return [ctypes.string_at(int(p), np.asarray(a).nbytes) for p, a in zip(ptrs, args)]


def test_each_param_pointer_reads_its_argument():
    args = _args()
    buf = ArgBuffer(args)
    assert _read_params(buf, args) == [np.asarray(a).tobytes() for a in args]
    offsets = buf.param_offsets()
    for off, a in zip(offsets, args):
        n = np.asarray(a).nbytes
        assert off % (MAP_ALIGN if n >= MAP_ALIGN else min(n, 8)) == 0
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_slots_take_the_runs_pointers():
    args = _args()
    where = slots_of(args, range(3))
    assert where == [5, 7, 10]
    buf = ArgBuffer(args, where)
    buf.set(0xAAAA_0000, 0xBBBB_0008, 0xCCCC_0010)
    got = _read_params(buf, args)
    want = list(args)
    want[5], want[7], want[10] = np.uint64(0xAAAA_0000), np.uint64(0xBBBB_0008), np.uint64(0xCCCC_0010)
    assert got == [np.asarray(a).tobytes() for a in want]
    buf.set(1, 2, 3)                                # a second run rewrites the same slots only
    assert _read_params(buf, args)[0] == args[0].tobytes()
    assert [int(np.frombuffer(_read_params(buf, args)[i], np.uint64)[0]) for i in where] == [1, 2, 3]


def test_threads_get_their_own_buffer():
    args = _args()
    buf = ArgBuffer(args, slots_of(args, range(3)))
    buf.set(10, 20, 30)
    seen = {}

    def other():
        seen["fresh"] = _read_params(buf, args)[5]           # the template's placeholder, not 10
        buf.set(40, 50, 60)
        seen["own"] = _read_params(buf, args)[5]

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["fresh"] == placeholder(0).tobytes()
    assert seen["own"] == np.uint64(40).tobytes()
    assert _read_params(buf, args)[5] == np.uint64(10).tobytes()   # this thread's is untouched


def test_what_does_not_pack():
    assert ArgBuffer.of((np.int32(1), 2)) is None                   # a Python int has no fixed width
    assert ArgBuffer.of((np.zeros(2, np.int32),)) is None           # an array is no scalar argument
    assert ArgBuffer.of((np.int32(1), np.uint64(2))) is not None
    with pytest.raises(ValueError, match="slots"):
        ArgBuffer((np.int32(1), np.uint64(2)), [0])
    assert slots_of((np.uint64(5), placeholder(0)), range(2)) is None


def test_kept_is_a_bounded_lru_that_a_concurrent_drop_does_not_break():
    """packed.kept: a miss builds and keeps, a hit returns the kept value and makes it the most
    recent, past the cap the least recently used go; an entry dropped by another thread between
    the lookup and the reordering (or a cache emptied while trimming) is not an error."""
    from collections import OrderedDict

    from iokernels.cupy_raw.packed import kept
    built = []
    cache = OrderedDict()
    for key in "abc":
        assert kept(cache, key, lambda key=key: built.append(key) or key.upper(), cap=2) == key.upper()
    assert list(cache) == ["b", "c"] and built == ["a", "b", "c"]
    assert kept(cache, "b", lambda: "never", cap=2) == "B" and list(cache) == ["c", "b"]
    kept(cache, "d", lambda: "D", cap=2)
    assert list(cache) == ["b", "d"] and built == ["a", "b", "c"]

    class Racy(OrderedDict):
        def move_to_end(self, key, last=True):
            raise KeyError(key)          # another thread dropped it after the get

        def popitem(self, last=True):
            raise KeyError("empty")      # another thread emptied it
    racy = Racy(a=1)
    assert kept(racy, "a", lambda: 2, cap=1) == 1
    assert kept(racy, "b", lambda: 3, cap=1) == 3 and dict(racy) == {"a": 1, "b": 3}
