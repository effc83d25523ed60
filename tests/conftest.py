"""Test-wide set-up.

Numba's CUDA simulator must be switched on before numba is first imported, so it is
decided here, once, before any test module loads: with no NVIDIA device on the machine,
the Numba kernels run on the simulator (slow: tests keep sizes tiny), and the Triton
kernels on Triton's interpreter (TRITON_INTERPRET=1; small sizes too).

The order of the test files: ``bash dev.sh test`` runs the suite on two workers
(pytest-xdist, ``--dist loadfile --no-loadscope-reorder``), which take whole files in the
order collected here.  The long files (LONG_FILES) come first, longest first, so that the
short ones fill in around them and neither worker is left with a long file at the end.
"""
import os
import shutil
import threading
import time
import zlib

import numpy as np
import pytest


def _nvidia_device_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if not _nvidia_device_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # Triton's kernels run on its interpreter (read when a kernel is defined, so set first)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _simulator_poll_yields() -> None:
    """Let the simulator's barrier loop give up the GIL between its checks.

    Numba's simulator runs each thread of a block as a Python thread; the launching thread
    releases a barrier (cuda.syncthreads) once every thread waits at it, and finds that out
    by polling the threads in a loop without pause.  That loop holds the GIL whenever it has
    it, so the block's own threads, the ones doing the work, wait for the loop.  Here each
    of its checks (``BlockThread.is_alive``) first yields the GIL (``time.sleep(0)``): the
    same kernels, the same barriers, the same results, with the CPU spent on the threads.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
        return
    try:
        from numba.cuda.simulator import kernel as sim_kernel
    except ImportError:                     # no numba: the simulator tests skip themselves
        return
    if not hasattr(sim_kernel, "BlockThread"):  # another simulator: left as it is
        return

    def is_alive(self):
        time.sleep(0)
        return threading.Thread.is_alive(self)
    sim_kernel.BlockThread.is_alive = is_alive


_simulator_poll_yields()

#: the files that take a minute or more on two cores without a GPU, longest first (the
#: simulator, nvcc, NVVM, the notebooks); every other file keeps its place after them
LONG_FILES = ("test_numba_ptx.py", "test_notebooks.py", "test_cupy_compile.py", "test_labs.py",
              "test_numba.py", "test_browser_course.py", "test_gpu_decode_window_quant.py", "test_conformance.py",
              "test_wheel.py")


def pytest_collection_modifyitems(config, items):
    """The long files first (LONG_FILES' order), then the rest as collected (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, never shared)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
