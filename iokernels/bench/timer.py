"""The timer: the one way this project times device code, and host code.

There is ONE timing helper for device code, :func:`time_cuda`, and one for host code,
:func:`time_cpu`.  Every speed the project reports comes from them.

``time_cuda`` follows the usual rules for timing asynchronous GPU work:

* CUDA events around the timed call (torch.cuda.Event when torch has CUDA, else
  cupy.cuda.Event); the host clock never times device work;
* warm-up calls first, so compilation, module load and library handle creation stay out;
* many repetitions, the **median** reported (with the 10th and 90th percentiles, so the
  spread is visible: two versions closer than that spread are not different);
* the L2 cache is flushed before every repetition by writing a buffer larger than L2
  (its size is read off the device), and the flush is *outside*
  the timed region.  Without the flush a problem that fits in L2 is timed from L2, which
  is not the HBM-bound number the traffic model talks about.

Events are recorded on the current stream of the library that owns them (the legacy
default stream, unless you changed it), which is also where Numba and CuPy launch by
default, so the events bracket their kernels too.

Peak memory: :func:`peak_memory` reports the most device memory the torch caching
allocator and CuPy's memory pool held during one call.  Numba's own allocations
(``cuda.device_array``) go through neither and are not counted: a frank gap.

Handing memory back: :func:`release_device_cache` empties torch's cache between runners
and cases, and pauses after a release of many GB.  Memory handed back to the driver in
bulk leaves the GPU's next kernels slower for a moment (most likely the driver clearing
the released pages while they run, which takes HBM bandwidth), so a memory-bound runner
timed right after a large unfused one would read slow through no fault of its own.

Speeds are always reported next to a baseline measured in the same run (ratios), never
as absolute claims in tests.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

#: warm-up and repetitions when the caller says nothing: enough that the median of a
#: short kernel is stable to a few percent, few enough that the whole sweep fits in minutes.
DEFAULT_WARMUP = 3
DEFAULT_REPS = 20
#: the flush buffer is this many times L2, so nothing of the previous run survives.
L2_FLUSH_FACTOR = 2
#: when the device cannot tell its L2 size (should not happen), assume 64 MiB, more than
#: any GPU in the roofline table has.
FALLBACK_L2_BYTES = 64 * 1024 * 1024
#: after the flush and before the start event, the GPU spins this long (a busy-wait kernel)
#: so that the host's Python overhead of calling ``fn`` (argument checks, context managers,
#: several launches) is queued up behind it instead of showing up as idle GPU time inside
#: the timed region.  Without it, a kernel shorter than the Python that launches it is timed
#: at the Python's speed, not its own.  Host overhead longer than this still shows, and is
#: then part of the cost a caller sees.
LAUNCH_SLACK_US = 3000
#: the spin kernel counts SM clock cycles; the H200 runs at up to 1.98 GHz
SPIN_CYCLES_PER_US = 1980
#: release_device_cache pauses when torch's cache hands back more than this many bytes:
#: RELEASE_SETTLE_S_PER_GIB seconds a GiB released, at most RELEASE_SETTLE_MAX_S
RELEASE_SETTLE_BYTES = 4 * 2**30
RELEASE_SETTLE_S_PER_GIB = 0.015
RELEASE_SETTLE_MAX_S = 3.0


@dataclass(frozen=True)
class Timing:
    """The distribution of one timed call, in milliseconds."""

    median_ms: float
    p10: float
    p90: float
    reps: int

    def tflops(self, flops: float) -> float:
        """Achieved TFLOP/s for ``flops`` floating-point operations per call."""
        return flops / (self.median_ms * 1e-3) / 1e12

    def tbps(self, nbytes: float) -> float:
        """Achieved TB/s for ``nbytes`` bytes moved per call."""
        return nbytes / (self.median_ms * 1e-3) / 1e12

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median_ms:.4f} ms (p10 {self.p10:.4f}, p90 {self.p90:.4f}, {self.reps} reps)"


def _percentile(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def _summarize(samples_ms) -> Timing:
    return Timing(float(statistics.median(samples_ms)), _percentile(samples_ms, 10),
                  _percentile(samples_ms, 90), len(samples_ms))


# --------------------------------------------------------------------------- device access
def _torch_cuda():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:  # ImportError, or a broken CUDA install
        return None


def _cupy_cuda():
    try:
        import cupy
        return cupy if cupy.is_available() else None
    except Exception:
        return None


def l2_cache_bytes() -> int:
    """The current device's L2 cache size in bytes (read off the device)."""
    torch = _torch_cuda()
    if torch is not None:
        size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        if size:
            return int(size)
    cp = _cupy_cuda()
    if cp is not None:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        if props.get("l2CacheSize"):
            return int(props["l2CacheSize"])
    return FALLBACK_L2_BYTES


class _Device:
    """Events, synchronization and the L2 flush buffer, from torch or CuPy."""

    def __init__(self, l2_bytes=None):
        self.torch, self.cupy = _torch_cuda(), None
        if self.torch is None:
            self.cupy = _cupy_cuda()
            if self.cupy is None:
                raise RuntimeError("time_cuda: no CUDA device (neither torch nor CuPy sees one); "
                                   "use time_cpu for host code")
        self.flush_bytes = L2_FLUSH_FACTOR * int(l2_bytes or l2_cache_bytes())
        self._buf = None

    def event(self):
        if self.torch is not None:
            return self.torch.cuda.Event(enable_timing=True)
        return self.cupy.cuda.Event()

    def record(self, ev):
        ev.record()

    def elapsed_ms(self, start, end) -> float:
        if self.torch is not None:
            return float(start.elapsed_time(end))
        return float(self.cupy.cuda.get_elapsed_time(start, end))

    def synchronize(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()
        if self.cupy is not None or _cupy_loaded():
            import cupy
            cupy.cuda.Device().synchronize()

    def flush_l2(self):
        """Write a buffer larger than L2, evicting whatever the previous run left there."""
        if self._buf is None:
            if self.torch is not None:
                self._buf = self.torch.empty(self.flush_bytes, dtype=self.torch.uint8, device="cuda")
            else:
                self._buf = self.cupy.empty(self.flush_bytes, dtype=self.cupy.uint8)
        if self.torch is not None:
            self._buf.zero_()
        else:
            self._buf.fill(0)

    def spin(self, us=None):
        """Keep the GPU busy for about ``us`` microseconds (default :data:`LAUNCH_SLACK_US`, read
        at the call), untimed, so launches queue up."""
        us = LAUNCH_SLACK_US if us is None else us
        if us <= 0:
            return
        cycles = int(us * SPIN_CYCLES_PER_US)
        if self.torch is not None and hasattr(self.torch.cuda, "_sleep"):
            self.torch.cuda._sleep(cycles)
            return
        import cupy
        if getattr(self, "_spin_kernel", None) is None:
            self._spin_kernel = cupy.RawKernel(r'''
            extern "C" __global__ void ik_spin(long long cycles) {
                long long t0 = clock64();
                while (clock64() - t0 < cycles) { }
            }''', "ik_spin")
        self._spin_kernel((1,), (1,), (np.int64(cycles),))

    def release(self):
        self._buf = None


def _cupy_loaded() -> bool:
    return "cupy" in sys.modules


# --------------------------------------------------------------------------- the timers
def time_cuda(fn, *args, warmup: int = DEFAULT_WARMUP, reps: int = DEFAULT_REPS,
              flush_l2: bool = True, l2_bytes: int | None = None,
              launch_slack_us: float | None = None, **kwargs) -> Timing:
    """Time ``fn(*args, **kwargs)`` on the GPU with CUDA events: warm-up, median, L2 flushed.

    Each repetition: flush L2 and spin ``launch_slack_us`` (both untimed) -> record start
    -> fn() -> record end.  All event pairs are read after one final synchronize, so the
    host never stalls the queue between repetitions.  Returns a :class:`Timing` in ms.
    What is timed is device time from the start event to the end event: the kernels, and
    any gap between them that the host's overhead leaves once the slack is used up.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps, warmup: need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    dev = _Device(l2_bytes)
    try:
        for _ in range(warmup):
            fn(*args, **kwargs)
        dev.synchronize()
        pairs = []
        for _ in range(reps):
            if flush_l2:
                dev.flush_l2()              # untimed: outside the start/end events
            dev.spin(launch_slack_us)       # untimed: lets fn's launches queue up
            start, end = dev.event(), dev.event()
            dev.record(start)
            fn(*args, **kwargs)
            dev.record(end)
            pairs.append((start, end))
        for _, end in pairs:
            end.synchronize()
        dev.synchronize()
        return _summarize([dev.elapsed_ms(s, e) for s, e in pairs])
    finally:
        dev.release()


def time_cpu(fn, *args, warmup: int = 1, reps: int = 5, **kwargs) -> Timing:
    """Time host code (NumPy) with ``time.perf_counter``: warm-up, median of ``reps``."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps, warmup: need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    for _ in range(warmup):
        fn(*args, **kwargs)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarize(samples)


# --------------------------------------------------------------------------- peak memory
class _CupyPeakHook:
    """A CuPy memory hook that tracks the bytes handed out by the pool, and their peak."""

    def __new__(cls):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = "iokernels_peak"

            def __init__(self):
                self.current = 0
                self.peak = 0

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                self.current += mem_size
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                self.current -= mem_size

        return Hook()


def peak_memory(fn, *args, **kwargs) -> dict:
    """Run ``fn`` once; return the device memory it needed, in bytes.

    ``{"peak_bytes": ..., "extra_bytes": ...}``: peak_bytes is the most the torch allocator
    held during the call (inputs included) plus the most CuPy's pool handed out during
    it; extra_bytes is the part above what torch held before the call (outputs and
    workspace, e.g. the N x N S and P of naive attention).  Numba allocations are not seen.
    """
    torch = _torch_cuda()
    out = {"peak_bytes": 0, "extra_bytes": 0}
    hook = None
    if _cupy_loaded() and _cupy_cuda() is not None:
        hook = _CupyPeakHook()
    if torch is not None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    if hook is not None:
        with hook:
            fn(*args, **kwargs)
    else:
        fn(*args, **kwargs)
    if torch is not None:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out["peak_bytes"] += int(peak)
        out["extra_bytes"] += int(peak - before)
    if hook is not None:
        import cupy
        cupy.cuda.Device().synchronize()
        out["peak_bytes"] += int(hook.peak)
        out["extra_bytes"] += int(hook.peak)
    return out


def host_ms(fn, *args, reps: int = 5, **kwargs) -> float:
    """The host (Python) time one call of ``fn`` takes, median of ``reps``: what a caller pays
    before the call returns, whatever the GPU does.  A caller that launches in a loop gets
    the larger of this and the device time :func:`time_cuda` measures."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(samples))


#: host_ms_loop: the loop of calls aims at about this much wall time, between HOST_MIN_CALLS and
#: HOST_MAX_CALLS calls
HOST_LOOP_MS = 50.0
HOST_MIN_CALLS, HOST_MAX_CALLS = 10, 500


def host_calls(device_ms: float, loop_ms: float = HOST_LOOP_MS) -> int:
    """How many calls :func:`host_ms_loop` makes for a call of ``device_ms``: about ``loop_ms``
    of them, between HOST_MIN_CALLS and HOST_MAX_CALLS."""
    return int(min(HOST_MAX_CALLS, max(HOST_MIN_CALLS, loop_ms // max(device_ms, 1e-3))))


def host_ms_loop(fn, calls: int, synchronize=None, clock=time.perf_counter) -> float:
    """The Python cost of one call of ``fn``, as a program calling it in a loop pays it: ``calls``
    calls back to back, then one ``synchronize`` (not timed), the loop's wall time / ``calls``.
    Where the device is slower than the host the launch queue fills and this approaches the
    device time; below that it is the host's cost per call (argument checks, the launch)."""
    if calls < 1:
        raise ValueError(f"calls: at least 1, got {calls}")
    t0 = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - t0
    if synchronize is not None:
        synchronize()
    return 1e3 * elapsed / calls


def release_device_cache(sleep=time.sleep) -> int:
    """Empty torch's caching allocator; returns the bytes it handed back to the driver.

    After a release larger than RELEASE_SETTLE_BYTES it waits (RELEASE_SETTLE_S_PER_GIB a
    GiB, at most RELEASE_SETTLE_MAX_S) before returning, so that whatever is timed next
    does not share the GPU with the aftermath of the release.  The CuPy backend's plans
    (where it is loaded) are forgotten first, except those a CUDA graph uses: their
    workspaces would otherwise stay allocated from one case to the next.  Without torch's
    CUDA nothing else happens and it returns 0."""
    plans = sys.modules.get("iokernels.cupy_raw.plans")
    if plans is not None:
        plans.PLANS.release()
    torch = _torch_cuda()
    if torch is None:
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    freed = max(0, int(before) - int(torch.cuda.memory_reserved()))
    if freed > RELEASE_SETTLE_BYTES:
        sleep(min(RELEASE_SETTLE_MAX_S, RELEASE_SETTLE_S_PER_GIB * freed / 2**30))
    return freed
