"""Timing, environment capture, the side-by-side benchmark and the tuning sweeps, in one place.

=================  =============================================================
:mod:`.timer`      :func:`time_cuda` (CUDA events, warm-up, median, L2 flushed) and
                   :func:`time_cpu`; :func:`peak_memory`
:mod:`.environment`  the label of every recorded number (GPU, driver, versions, date)
:mod:`.specs`      the benchmark's shapes, declared as data
:mod:`.runners`    one row per registered kernel version and SDPA kernel
:mod:`.paged_tables`  where the paged rows keep their block tables (as a program does)
:mod:`.cli`        ``python -m iokernels bench``: run, table, JSON record
:mod:`.cliff`      the cliff sweep (shapes off the serving grid, time-boxed) and the
                   captured decode step (eager against a CUDA graph)
:mod:`.sweeps_numba`, :mod:`.sweeps_cupy`  tuning sweeps of alternative tilings
=================  =============================================================

Speeds are always reported next to a baseline measured in the same run (ratios), never
as absolute claims in tests.
"""
from __future__ import annotations

from . import cliff  # noqa: F401  (the cliff sweep and the captured decode step)
from .cli import main, run, table
from .environment import environment, label
from .runners import Unavailable, device_pages
from .specs import SECTIONS
from .timer import (DEFAULT_REPS, DEFAULT_WARMUP, Timing, l2_cache_bytes, peak_memory, release_device_cache, time_cpu,
                    time_cuda)

__all__ = ["time_cuda", "time_cpu", "peak_memory", "release_device_cache", "Timing", "l2_cache_bytes",
           "environment", "label", "run", "table", "main", "device_pages", "Unavailable", "SECTIONS",
           "DEFAULT_REPS", "DEFAULT_WARMUP"]
