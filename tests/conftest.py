"""Test-wide set-up.

Numba's CUDA simulator must be switched on before numba is first imported, so it is
decided here, once, before any test module loads: with no NVIDIA device on the machine,
the Numba kernels run on the simulator (slow: tests keep sizes tiny).
"""
import os
import shutil
import zlib

import numpy as np
import pytest


def _nvidia_device_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if not _nvidia_device_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, never shared)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
