"""Timing, and the one side-by-side benchmark (``python -m iokernels bench``).

The timer
---------
There is ONE timing helper for device code, :func:`time_cuda`, and one for host code,
:func:`time_cpu`.  Every speed the project reports comes from them.

``time_cuda`` follows the usual rules for timing asynchronous GPU work:

* CUDA events around the timed call (torch.cuda.Event when torch has CUDA, else
  cupy.cuda.Event); the host clock never times device work;
* warm-up calls first, so compilation, module load and library handle creation stay out;
* many repetitions, the **median** reported (with the 10th and 90th percentiles, so the
  spread is visible: two versions closer than that spread are not different);
* the L2 cache is flushed before every repetition by writing a buffer larger than L2
  (the H200's L2 is 60 MB; the size is read off the device), and the flush is *outside*
  the timed region.  Without the flush a problem that fits in L2 is timed from L2, which
  is not the HBM-bound number the traffic model talks about.

Events are recorded on the current stream of the library that owns them (the legacy
default stream, unless you changed it), which is also where Numba and CuPy launch by
default, so the events bracket their kernels too.

Peak memory: :func:`peak_memory` reports the most device memory the torch caching
allocator and CuPy's memory pool held during one call.  Numba's own allocations
(``cuda.device_array``) go through neither and are not counted: a frank gap.

Speeds are always reported next to a baseline measured in the same run (ratios), never
as absolute claims in tests.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

#: warm-up and repetitions when the caller says nothing: enough that the median of a
#: 50 us kernel is stable to a few percent, few enough that the whole sweep fits in minutes.
DEFAULT_WARMUP = 3
DEFAULT_REPS = 20
#: the flush buffer is this many times L2, so nothing of the previous run survives.
L2_FLUSH_FACTOR = 2
#: when the device cannot tell its L2 size (should not happen), assume the H200's 60 MB.
FALLBACK_L2_BYTES = 60 * 1024 * 1024
#: after the flush and before the start event, the GPU spins this long (a busy-wait kernel)
#: so that the host's Python overhead of calling ``fn`` (argument checks, context managers,
#: several launches) is queued up behind it instead of showing up as idle GPU time inside
#: the timed region.  Without it, a 50 us kernel called through 150 us of Python measures
#: as 150 us (seen on the H200: forced SDPA kernels timed 2-3x slower than the same kernel
#: called bare).  Host overhead longer than this still shows, and is then part of the cost.
LAUNCH_SLACK_US = 1000
#: the spin kernel counts SM clock cycles; the H200 runs at up to 1.98 GHz
SPIN_CYCLES_PER_US = 1980


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

    def spin(self, us=LAUNCH_SLACK_US):
        """Keep the GPU busy for about ``us`` microseconds (untimed), so launches queue up."""
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
    import sys
    return "cupy" in sys.modules


# --------------------------------------------------------------------------- the timers
def time_cuda(fn, *args, warmup: int = DEFAULT_WARMUP, reps: int = DEFAULT_REPS,
              flush_l2: bool = True, l2_bytes: int | None = None,
              launch_slack_us: float = LAUNCH_SLACK_US, **kwargs) -> Timing:
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


# =========================================================================== the benchmark
# ``python -m iokernels bench``: every available backend next to torch on the same shapes,
# in one process, timed by time_cuda above.  Everything a row needs to be trusted is in it:
# status ("ok" / "unavailable: why" / "failed: why"), the median and spread, the rate, peak
# memory, the speed relative to the best SDPA kernel of the same case, and the largest
# difference from SDPA's output (a fast kernel with a wrong answer is not fast).

#: the article's prefill sweep and the decode sweep (the issue's shapes)
PREFILL_SWEEP = dict(batch=4, heads=16, head_dim=128, seqlens=(1024, 2048, 4096, 8192),
                     causal=(True,), dtypes=("bfloat16", "float32"))
PREFILL_COMPARE = dict(batch=8, heads=16, head_dim=128, seqlens=(4096,), causal=(False, True),
                       dtypes=("bfloat16", "float32"))
DECODE_SWEEP = dict(heads_q=32, heads_kv=8, head_dim=128, batches=(1, 8, 64), seqlens=(4096, 32768),
                    dtypes=("float16",))
DECODE_EXTRA = dict(heads_q=32, heads_kv=8, head_dim=128, batches=(1,), seqlens=(32768,),
                    dtypes=("bfloat16",))
GATHER_SIZES = dict(heads_kv=8, head_dim=128, seqlens=(4096, 131072), dtype="float16")
#: --quick: tiny shapes that run everywhere in seconds (also on a CPU, NumPy only)
QUICK = dict(prefill=dict(batch=1, heads=2, head_dim=64, seqlens=(256,), causal=(True,),
                          dtypes=("float32",)),
             decode=dict(heads_q=4, heads_kv=2, head_dim=64, batches=(2,), seqlens=(512,),
                         dtypes=("float16",)),
             gather=dict(heads_kv=2, head_dim=64, seqlens=(512,), dtype="float16"))

SDPA_NAMES = ("flash", "efficient", "cudnn", "math")
#: NumPy runs (host, one repetition) only when the problem is this small (FLOPs): beyond it
#: a CPU run takes longer than the whole GPU sweep and teaches nothing new.
NUMPY_MAX_FLOPS = 2.0e10
#: each runner's timed loop aims at about this much device time (reps adapt, 3..DEFAULT_REPS)
TARGET_MS_PER_RUNNER = 400.0
#: calls slower than this (ms) get one warm-up call, not DEFAULT_WARMUP (they are past any
#: start-up effect after the check call and the probe, and each costs a lot of the time box)
SLOW_CALL_MS = 50.0
#: largest |out - SDPA| accepted before a row is flagged "suspect" (per storage dtype)
CHECK_TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 6e-2}
#: a problem's block size for the paged cache (vLLM's default)
PAGED_BLOCK = 16


class Unavailable(Exception):
    """A runner that cannot run here (module missing, dtype unsupported, ...): reported, not fatal."""


def environment() -> dict:
    """GPU, driver, CUDA and library versions, and the date: the label of every recorded number."""
    import datetime
    import platform
    import subprocess
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version()}
    for mod in ("numpy", "torch", "numba", "numba_cuda", "cupy"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # not installed here
            env[mod] = f"missing ({type(e).__name__})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            name, driver, mem, clk = [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]
            env.update(gpu=name, driver=driver, gpu_memory=mem, max_sm_clock=clk)
    except Exception:
        pass
    torch = _torch_cuda()
    if torch is not None:
        p = torch.cuda.get_device_properties(0)
        env.setdefault("gpu", p.name)
        env.update(cuda_torch=torch.version.cuda, sms=p.multi_processor_count,
                   l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0),
                   compute_capability=f"{p.major}.{p.minor}")
    env["simulator"] = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    return env


def label(env: dict) -> str:
    """'recorded on NVIDIA H200, <date>, driver ..., torch ..., numba ..., cupy ...'."""
    return (f"recorded on {env.get('gpu', 'no GPU')}, {env.get('date_utc', '?')}, "
            f"driver {env.get('driver', '?')}, CUDA {env.get('cuda_torch', '?')}, "
            f"torch {env.get('torch', '?')}, numba {env.get('numba', '?')} "
            f"(numba-cuda {env.get('numba_cuda', '?')}), cupy {env.get('cupy', '?')}")


# --------------------------------------------------------------------------- helpers
def _to_torch_device(x):
    """Any device array (torch, CuPy, Numba) as a torch CUDA tensor, without a copy."""
    import torch
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except Exception:
            pass
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x, device="cuda")
    return torch.from_numpy(np.asarray(x))


def _max_diff(out, ref) -> float:
    import torch
    if isinstance(out, tuple):
        out = out[0]
    o = _to_torch_device(out).float()
    r = ref.float().to(o.device)
    if o.shape != r.shape:
        try:
            o = o.reshape(r.shape)
        except RuntimeError:
            return float("nan")
    return float(torch.max(torch.abs(o - r)).item())


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:240]


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def _visible_pairs(nq, nk, causal) -> int:
    from ..core.conventions import key_range
    lo, hi = key_range(np.arange(nq), nq, nk, causal, None)
    return int(np.sum(hi - lo))


def _resolve_backend(backend, op):
    """The backend function for (backend, op), or Unavailable with the reason."""
    from ..core import api
    if backend == "numba":
        from ..core.gpu import simulator_enabled
        if simulator_enabled():
            raise Unavailable("NUMBA_ENABLE_CUDASIM is set: the Numba kernels would run on the "
                              "CPU simulator, not the GPU")
    try:
        return api._resolve(backend, op)
    except (ImportError, AttributeError, ValueError) as e:
        raise Unavailable(f"{backend}.{op} not available: {_first_line(e)}") from None


def _versions(backend) -> list:
    """The numbered kernel versions a GPU module advertises, as (label, config).

    A module may define ``BENCH_VERSIONS = {"v1": config, ...}`` (or a function
    ``bench_versions(op, dtype)`` returning such a dict); otherwise it runs once, config None.
    """
    import importlib
    mod = {"numba": "iokernels.numba_cuda", "cupy": "iokernels.cupy_raw"}[backend]
    try:
        m = importlib.import_module(mod)
    except Exception:
        return [(backend, None)]
    versions = getattr(m, "BENCH_VERSIONS", None)
    if callable(getattr(m, "bench_versions", None)):
        return [("bench_versions", m.bench_versions)]
    if isinstance(versions, dict) and versions:
        return [(f"{backend}:{k}", v) for k, v in versions.items()]
    return [(backend, None)]


#: the benchmark's op names -> the registry's (iokernels.core.registry.OPS)
_REGISTRY_OPS = {"gather": "paged_gather"}


def _expand_versions(backend, op, dtype):
    import importlib
    mod = {"numba": "iokernels.numba_cuda", "cupy": "iokernels.cupy_raw"}[backend]
    try:
        registry = getattr(importlib.import_module(mod), "REGISTRY", None)
    except Exception:
        registry = None
    if registry is not None:          # a backend with a kernel registry: one row per version
        kernels = registry.kernels(_REGISTRY_OPS.get(op, op))
        if kernels:
            return [(f"{backend}:{k.version}", k.config_class(version=k.version)) for k in kernels]
    out = []
    for name, cfg in _versions(backend):
        if name == "bench_versions":
            try:
                d = cfg(op, dtype) or {}
            except Exception:
                d = {}
            out.extend((f"{backend}:{k}", v) for k, v in d.items())
            if not d:
                out.append((backend, None))
        else:
            out.append((name, cfg))
    return out


def _pool_versions(backend, op, dtype):
    """Versions of a pool-based runner (paged decode, gather): as _expand_versions, but a
    module whose versions all have config None keeps its one unversioned row."""
    versions = _expand_versions(backend, op, dtype)
    if all(cfg is None for _, cfg in versions):
        return [(backend, None)]
    return versions


def _config_kw(cfg) -> dict:
    """Keyword arguments that pass a version's config to a decode/gather function (none for None)."""
    return {} if cfg is None else {"config": cfg}


# --------------------------------------------------------------------------- one timed row
def _measure(name, group, fn, *, work, unit, ref=None, dtype="float32", device=True, reps=None,
             warmup=None, cpu_reps=1, check=True, target_ms=None) -> dict:
    """Run, check, time and size one runner; any failure becomes a row that says why."""
    row = {"runner": name, "group": group}
    try:
        out = fn()                                        # first call: compile, and check
        if device:
            _Device().synchronize()
        if check and ref is not None:
            err = _max_diff(out, ref)
            row["max_abs_diff_vs_sdpa"] = err
            if not (err <= CHECK_TOL.get(dtype, 1e-3)):
                row["suspect"] = f"output differs from SDPA by {err:.3g} (> {CHECK_TOL.get(dtype, 1e-3)})"
        del out
        if device:
            probe = time_cuda(fn, warmup=0, reps=1)
            target = TARGET_MS_PER_RUNNER if target_ms is None else target_ms
            n = reps or int(min(DEFAULT_REPS, max(3, target // max(probe.median_ms, 1e-3))))
            if warmup is None:          # the check call and the probe already warmed it up
                warmup = DEFAULT_WARMUP if probe.median_ms < SLOW_CALL_MS else 1
            t = time_cuda(fn, warmup=warmup, reps=n)
            mem = peak_memory(fn)
            row.update(peak_MiB=round(mem["peak_bytes"] / 2**20, 1),
                       extra_MiB=round(mem["extra_bytes"] / 2**20, 1))
            if group == "numba":
                row["memory_note"] = "Numba allocations are not tracked"
        else:
            t = time_cpu(fn, warmup=0, reps=cpu_reps)
        row.update(status="ok", ms=round(t.median_ms, 5), p10=round(t.p10, 5), p90=round(t.p90, 5),
                   reps=t.reps)
        row["rate"] = round(t.tflops(work) if unit == "TFLOP/s" else t.tbps(work), 4)
        row["unit"] = unit
    except Unavailable as e:
        row["status"] = f"unavailable: {e}"
    except ValueError as e:             # the backend refused the inputs (dtype, head dim, ...)
        row["status"] = f"unavailable: {_first_line(e)}"
    except RuntimeError as e:
        msg = _first_line(e)
        kind = "unavailable" if "No available kernel" in msg or "No viable backend" in msg else "failed"
        row["status"] = f"{kind}: {msg}"
    except Exception as e:  # a kernel helper's bug must not stop the sweep
        row["status"] = f"failed: {type(e).__name__}: {_first_line(e)}"
    finally:
        torch = _torch_cuda()
        if torch is not None:
            torch.cuda.empty_cache()
    return row


def _finish_case(case: dict) -> dict:
    """Speed relative to the best SDPA kernel of the case; the silent fall-back verdict."""
    sdpa_ok = [r for r in case["results"] if r["group"] == "sdpa" and r.get("status") == "ok"
               and r["runner"] != "sdpa:default"]
    best = min(sdpa_ok, key=lambda r: r["ms"]) if sdpa_ok else None
    case["best_sdpa"] = best["runner"] if best else None
    for r in case["results"]:
        if best and r.get("status") == "ok":
            r["speed_vs_best_sdpa"] = round(best["ms"] / r["ms"], 4)
    fused_ok = [r["runner"] for r in sdpa_ok if r["runner"] != "sdpa:math"]
    ran = case.get("default_ran")
    if ran == "math" and fused_ok:
        case["silent_fallback"] = f"default dispatch ran math although {', '.join(fused_ok)} can run"
    elif ran == "math":
        case["silent_fallback"] = "default dispatch ran math: no fused kernel accepts these inputs"
    return case


# --------------------------------------------------------------------------- sections
def _sdpa_rows(case, q, k, v, causal, ref, dtype, is_decode, work, unit, gqa, target_ms=None):
    from .. import torch_sdpa as ts
    import torch
    F = torch.nn.functional
    rows = []
    for name in SDPA_NAMES + ("default",):
        backend = None if name == "default" else name
        if is_decode:
            def fn(backend=backend):
                with ts.force(backend):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:
            def fn(backend=backend):
                return ts.sdpa(q, k, v, causal=causal, backend=backend)
        rows.append(_measure(f"sdpa:{name}", "sdpa", fn, work=work, unit=unit, ref=ref, dtype=dtype,
                             target_ms=target_ms))
    try:
        if is_decode:
            _, ran = ts.backend_that_ran(F.scaled_dot_product_attention, q, k, v, enable_gqa=gqa)
        else:
            _, ran = ts.backend_that_ran(ts.sdpa, q, k, v, causal=causal)
        case["default_ran"] = ran[0] if ran else "unknown"
    except Exception as e:
        case["default_ran"] = f"unknown ({_first_line(e)})"
    for r in rows:
        if r["runner"] == "sdpa:default":
            r["ran"] = case["default_ran"]
    return rows


def _reference(q, k, v, causal, is_decode, gqa):
    """SDPA's output from the first kernel that runs (cudnn, flash, efficient, math)."""
    from .. import torch_sdpa as ts
    import torch
    for name in ("cudnn", "flash", "efficient", "math"):
        try:
            with ts.force(name):
                if is_decode:
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                return ts.sdpa(q, k, v, causal=causal)
        except RuntimeError:
            continue
    return None


def prefill_cases(spec, seed, progress, numpy_max_flops=NUMPY_MAX_FLOPS, section="prefill",
                  target_ms=None):
    import torch
    from .. import torch_sdpa as ts
    cases = []
    B, H, d = spec["batch"], spec["heads"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        for causal in spec["causal"]:
            for N in spec["seqlens"]:
                flops = 4.0 * B * H * _visible_pairs(N, N, causal) * d
                case = dict(section=section, kind="prefill", dtype=dtype, causal=causal,
                            shape=dict(batch=B, heads=H, seqlen=N, head_dim=d),
                            work=dict(flops=flops), unit="TFLOP/s", results=[])
                progress.set_description(f"{section} {dtype} N={N} causal={causal}")
                gen = torch.Generator(device="cuda").manual_seed(seed)
                tdt = _torch_dtype(dtype)
                q, k, v = (torch.randn((B, H, N, d), device="cuda", dtype=tdt, generator=gen)
                           for _ in range(3))
                ref = _reference(q, k, v, causal, False, False)
                scale = 1.0 / np.sqrt(d)
                rows = _sdpa_rows(case, q, k, v, causal, ref, dtype, False, flops, "TFLOP/s", False, target_ms)
                progress.update(5)
                rows.append(_measure("torch naive", "torch",
                                     lambda: ts.naive_attention(q, k, v, causal=causal),
                                     work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms))
                progress.update(1)
                for backend in ("numba", "cupy"):
                    for name, cfg in _expand_versions(backend, "attention", dtype):
                        def fn(backend=backend, cfg=cfg):
                            f = _resolve_backend(backend, "attention")
                            return f(q, k, v, causal=causal, scale=scale, window=(-1, -1), config=cfg)
                        rows.append(_measure(name, backend, fn, work=flops, unit="TFLOP/s", ref=ref,
                                             dtype=dtype, target_ms=target_ms))
                    progress.update(1)
                rows += _numpy_rows(q, k, v, causal, scale, ref, dtype, flops, numpy_max_flops, target_ms)
                case["results"] = rows
                cases.append(_finish_case(case))
                del q, k, v, ref
                torch.cuda.empty_cache()
    return cases


def _numpy_rows(q, k, v, causal, scale, ref, dtype, flops, numpy_max_flops, target_ms=None):
    rows = []
    for backend in ("naive", "tiled"):
        name = f"numpy {backend}"
        if dtype not in ("float32", "float64"):
            rows.append({"runner": name, "group": "numpy",
                         "status": f"unavailable: NumPy runs are float32/float64 here ({dtype} needs ml_dtypes)"})
            continue
        if flops > numpy_max_flops:
            rows.append({"runner": name, "group": "numpy",
                         "status": f"skipped: {flops:.3g} FLOP > {numpy_max_flops:.3g} (too slow on a CPU)"})
            continue
        hq, hk, hv = (x.detach().cpu().numpy() for x in (q, k, v))
        from ..core import api
        f = api._resolve(backend, "attention")
        rows.append(_measure(name, "numpy", lambda f=f: f(hq, hk, hv, causal=causal, scale=scale,
                                                          window=(-1, -1), config=None),
                             work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, device=False,
                             target_ms=target_ms))
    return rows


def device_pages(k, v, seed=0, block_size=PAGED_BLOCK):
    """The same K/V as the contiguous (B, Hkv, N, d) tensors, in paged pools on the device.

    Returns (k_pool, v_pool, block_tables, seq_lens): pools (num_blocks, block_size, Hkv, d)
    in k's dtype (bfloat16 too), int32 NumPy tables (B, N / block_size) holding a random
    permutation of the pool's blocks -- scattered as in a server with many live requests
    -- and the lengths.  Built on the device (no host copy), so any size that fits runs.
    """
    import torch
    B, Hkv, N, d = k.shape
    if N % block_size:
        raise Unavailable(f"device_pages: N={N} must be a multiple of the block size {block_size}")
    nblk = N // block_size
    rng = np.random.default_rng(seed)
    tables = rng.permutation(B * nblk).astype(np.int32).reshape(B, nblk)
    kp = torch.empty((B * nblk, block_size, Hkv, d), dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    for b in range(B):                                    # block j of sequence b -> pool[tables[b, j]]
        idx = torch.from_numpy(tables[b]).to(k.device).long()
        kp[idx] = k[b].permute(1, 0, 2).reshape(nblk, block_size, Hkv, d)
        vp[idx] = v[b].permute(1, 0, 2).reshape(nblk, block_size, Hkv, d)
    return kp, vp, tables, np.full(B, N, dtype=np.int32)


def _gpu_module(backend):
    import importlib
    if backend == "numba":
        _resolve_backend("numba", "attention")             # refuses the simulator
    mod = "iokernels.numba_cuda" if backend == "numba" else "iokernels.cupy_raw"
    try:
        return importlib.import_module(mod)
    except Exception as e:
        raise Unavailable(f"{mod} not importable: {_first_line(e)}") from None


def _pool_fn(backend, name):
    f = getattr(_gpu_module(backend), name, None)
    if f is None:
        raise Unavailable(f"{backend}.{name} does not exist")
    return f


def decode_cases(spec, seed, progress, section="decode", target_ms=None):
    import torch
    cases = []
    Hq, Hkv, d = spec["heads_q"], spec["heads_kv"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        for B in spec["batches"]:
            for N in spec["seqlens"]:
                tdt = _torch_dtype(dtype)
                kv_bytes = 2.0 * B * Hkv * N * d * tdt.itemsize
                case = dict(section=section, kind="decode", dtype=dtype, causal=False,
                            shape=dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=N, head_dim=d),
                            work=dict(kv_bytes=kv_bytes), unit="TB/s", results=[])
                progress.set_description(f"{section} {dtype} B={B} N={N}")
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q = torch.randn((B, Hq, d), device="cuda", dtype=tdt, generator=gen)
                k = torch.randn((B, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
                v = torch.randn((B, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
                q4 = q[:, :, None, :]
                ref4 = _reference(q4, k, v, False, True, Hq != Hkv)
                ref = None if ref4 is None else ref4[:, :, 0, :]
                rows = _sdpa_rows(case, q4, k, v, False, ref4, dtype, True, kv_bytes, "TB/s", Hq != Hkv,
                                  target_ms)
                progress.update(5)
                scale = 1.0 / np.sqrt(d)
                for backend in ("numba", "cupy"):
                    for name, cfg in _expand_versions(backend, "decode", dtype):
                        def fn(backend=backend, cfg=cfg):
                            f = _resolve_backend(backend, "decode")
                            return f(q, k, v, seq_lens=None, num_splits=None, scale=scale, **_config_kw(cfg))
                        rows.append(_measure(name, backend, fn, work=kv_bytes, unit="TB/s", ref=ref,
                                             dtype=dtype, target_ms=target_ms))
                    progress.update(1)
                try:
                    pages = device_pages(k, v, seed)
                except (Unavailable, RuntimeError) as e:   # e.g. out of device memory
                    pages = e
                for backend in ("numba", "cupy"):
                    for name, cfg in _pool_versions(backend, "paged_decode", dtype):
                        def fn(backend=backend, cfg=cfg):
                            if isinstance(pages, Exception):
                                raise Unavailable(f"paged pools: {_first_line(pages)}")
                            f = _pool_fn(backend, "paged_decode_pools")
                            return f(q, pages[0], pages[1], pages[2], pages[3], num_splits=None, scale=scale,
                                     **_config_kw(cfg))
                        rows.append(_measure(f"{name} paged", backend, fn, work=kv_bytes, unit="TB/s", ref=ref,
                                             dtype=dtype, target_ms=target_ms))
                    progress.update(1)
                case["results"] = rows
                cases.append(_finish_case(case))
                del q, k, v, q4, ref4, ref, pages
                torch.cuda.empty_cache()
    return cases


def gather_cases(spec, seed, progress, section="gather", target_ms=None):
    """Paged gather (numba, cupy) vs a device-to-device copy of the same bytes."""
    import torch
    cases = []
    Hkv, d, dtype = spec["heads_kv"], spec["head_dim"], spec["dtype"]
    for N in spec["seqlens"]:
        tdt = _torch_dtype(dtype)
        nbytes = 2 * 2.0 * Hkv * N * d * tdt.itemsize               # K and V, read + write
        case = dict(section=section, kind="gather", dtype=dtype, causal=False,
                    shape=dict(batch=1, heads_kv=Hkv, seqlen=N, head_dim=d, block_size=PAGED_BLOCK),
                    work=dict(bytes_read_plus_written=nbytes), unit="TB/s", results=[])
        progress.set_description(f"{section} N={N}")
        gen = torch.Generator(device="cuda").manual_seed(seed)
        k = torch.randn((1, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
        v = torch.randn((1, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
        dst_k, dst_v = torch.empty_like(k[0]), torch.empty_like(v[0])

        def copy():
            dst_k.copy_(k[0])
            dst_v.copy_(v[0])
            return dst_k
        rows = [_measure("device copy (torch)", "copy", copy, work=nbytes, unit="TB/s", ref=k[0],
                         dtype=dtype, target_ms=target_ms)]
        try:
            pages = device_pages(k, v, seed)
        except (Unavailable, RuntimeError) as e:
            pages = e
        for backend in ("numba", "cupy"):
            for name, cfg in _pool_versions(backend, "gather", dtype):
                def fn(backend=backend, cfg=cfg):
                    if isinstance(pages, Exception):
                        raise Unavailable(f"paged pools: {_first_line(pages)}")
                    return _pool_fn(backend, "gather_pools")(pages[0], pages[1], pages[2][0], int(pages[3][0]),
                                                             **_config_kw(cfg))
                rows.append(_measure(f"{name} gather", backend, fn, work=nbytes, unit="TB/s", ref=k[0],
                                     dtype=dtype, target_ms=target_ms))
            progress.update(1)
        progress.update(1)
        # the copy is the baseline of this section (no SDPA here)
        base = rows[0] if rows[0].get("status") == "ok" else None
        for r in rows:
            if base and r.get("status") == "ok":
                r["speed_vs_copy"] = round(base["ms"] / r["ms"], 4)
        case["results"] = rows
        cases.append(case)
        del k, v, dst_k, dst_v, pages
        torch.cuda.empty_cache()
    return cases


def _numpy_only_cases(spec, seed):
    """Without a GPU: the NumPy rows of the (quick) prefill shapes, so the harness still runs."""
    from ..core.testing import make_inputs
    cases = []
    rng = np.random.default_rng(seed)
    for dtype in spec["dtypes"]:
        for causal in spec["causal"]:
            for N in spec["seqlens"]:
                B, H, d = spec["batch"], spec["heads"], spec["head_dim"]
                flops = 4.0 * B * H * _visible_pairs(N, N, causal) * d
                q, k, v = make_inputs(rng, batch=B, heads_q=H, seqlen_q=N, head_dim=d, dtype=dtype)
                rows = []
                for backend in ("naive", "tiled"):
                    from ..core import api
                    f = api._resolve(backend, "attention")
                    rows.append(_measure(f"numpy {backend}", "numpy",
                                         lambda f=f: f(q, k, v, causal=causal, scale=1 / np.sqrt(d),
                                                       window=(-1, -1), config=None),
                                         work=flops, unit="TFLOP/s", device=False, cpu_reps=3))
                base = rows[0] if rows[0].get("status") == "ok" else None
                for r in rows:
                    if base and r.get("status") == "ok":
                        r["speed_vs_numpy_naive"] = round(base["ms"] / r["ms"], 4)
                cases.append(dict(section="cpu", kind="prefill", dtype=dtype, causal=causal,
                                  shape=dict(batch=B, heads=H, seqlen=N, head_dim=d),
                                  work=dict(flops=flops), unit="TFLOP/s", results=rows,
                                  note="no CUDA GPU here: only the NumPy rows ran"))
    return cases


SECTIONS = ("prefill", "compare", "decode", "gather")


def run(sections=SECTIONS, *, quick=False, seed=0, progress=True, target_ms=TARGET_MS_PER_RUNNER) -> dict:
    """Run the benchmark; returns the record (env + cases).  See :func:`main`.

    ``target_ms``: device time each runner's timed loop aims at (repetitions adapt to it,
    between 3 and DEFAULT_REPS); lower it to fit a tight time box.
    """
    import time as _time
    t0 = _time.perf_counter()
    env = environment()
    record = {"env": env, "label": label(env), "quick": bool(quick), "seed": seed,
              "settings": dict(warmup=DEFAULT_WARMUP, max_reps=DEFAULT_REPS, statistic="median",
                               l2_flush=True, timer="CUDA events (iokernels.bench.time_cuda)",
                               target_ms_per_runner=float(target_ms)),
              "cases": []}
    gpu = _torch_cuda() is not None
    if not gpu:
        record["note"] = ("no CUDA GPU visible to torch: only the NumPy rows ran; see "
                          "benchmarks/results/ for numbers recorded on a GPU")
        record["cases"] = _numpy_only_cases(QUICK["prefill"], seed)
        record["elapsed_s"] = round(_time.perf_counter() - t0, 1)
        return record
    plan = []
    if quick:
        plan = [("prefill", QUICK["prefill"]), ("decode", QUICK["decode"]), ("gather", QUICK["gather"])]
        plan = [(s, p) for s, p in plan if s in sections or (s == "prefill" and "compare" in sections)]
    else:
        for s in sections:
            if s == "prefill":
                plan.append(("prefill", PREFILL_SWEEP))
            elif s == "compare":
                plan.append(("compare", PREFILL_COMPARE))
            elif s == "decode":
                plan += [("decode", DECODE_SWEEP), ("decode", DECODE_EXTRA)]
            elif s == "gather":
                plan.append(("gather", GATHER_SIZES))
    total = 0
    for s, p in plan:
        if s in ("prefill", "compare"):
            total += len(p["seqlens"]) * len(p["causal"]) * len(p["dtypes"]) * 8
        elif s == "decode":
            total += len(p["batches"]) * len(p["seqlens"]) * len(p["dtypes"]) * 9
        else:
            total += len(p["seqlens"]) * 3
    try:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, disable=not progress, unit="row", dynamic_ncols=True)
    except ImportError:  # pragma: no cover
        bar = _NoBar()
    with bar:
        for s, p in plan:
            if s in ("prefill", "compare"):
                record["cases"] += prefill_cases(p, seed, bar, section=s, target_ms=target_ms)
            elif s == "decode":
                record["cases"] += decode_cases(p, seed, bar, target_ms=target_ms)
            else:
                record["cases"] += gather_cases(p, seed, bar, target_ms=target_ms)
    record["elapsed_s"] = round(_time.perf_counter() - t0, 1)
    return record


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, n=1):
        pass

    def set_description(self, s):
        pass


# --------------------------------------------------------------------------- the table
def _shape_text(case) -> str:
    s = case["shape"]
    if case["kind"] == "prefill":
        return f"B{s['batch']} H{s['heads']} N{s['seqlen']} d{s['head_dim']}" + (" causal" if case["causal"] else "")
    if case["kind"] == "decode":
        return f"B{s['batch']} {s['heads_q']}/{s['heads_kv']} N{s['seqlen']} d{s['head_dim']}"
    return f"Hkv{s['heads_kv']} N{s['seqlen']} d{s['head_dim']} bs{s['block_size']}"


def table(record) -> str:
    """The end-of-run table: one line per (case, runner)."""
    lines = [record.get("label", ""), ""]
    hdr = (f"{'section':<9}{'dtype':<10}{'shape':<30}{'runner':<22}{'ms':>11}{'rate':>17}{'MiB+':>9}"
           f"{'vs best':>9}  note")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for c in record["cases"]:
        for r in c["results"]:
            ok = r.get("status") == "ok"
            ms = f"{r['ms']:.4f}" if ok else "-"
            rate = f"{r['rate']:.3g} {r['unit']}" if ok else "-"
            mem = f"{r['extra_MiB']:.0f}" if ok and r.get("extra_MiB") is not None and r["group"] != "numba" else "-"
            ratio = r.get("speed_vs_best_sdpa", r.get("speed_vs_copy", r.get("speed_vs_numpy_naive")))
            ratio = f"{ratio:.3f}" if ratio is not None else "-"
            note = "" if ok else r.get("status", "")
            if r.get("suspect"):
                note += " SUSPECT: " + r["suspect"]
            if r.get("ran"):
                note += f" ran {r['ran']}"
            lines.append(f"{c['section']:<9}{c['dtype']:<10}{_shape_text(c):<30}{r['runner']:<22}{ms:>11}"
                         f"{rate:>17}{mem:>9}{ratio:>9}  {note.strip()[:90]}")
        if c.get("silent_fallback"):
            lines.append(f"{'':<48}!! silent fall-back: {c['silent_fallback']}")
    lines.append("")
    lines.append("ms: median of CUDA-event timings, L2 flushed between runs.  rate: TFLOP/s (prefill, "
                 "visible pairs only) or TB/s (decode: K+V bytes read; gather: read+write).  "
                 "MiB+: device memory above the inputs during one call.  vs best: best SDPA time / this "
                 "time (1 = as fast as the best SDPA kernel; gather rows: vs the device copy).")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m iokernels bench [--quick] [--sections ...] [--out FILE] [--no-progress]``."""
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(prog="python -m iokernels bench",
                                description="Every available backend next to torch SDPA, on the same "
                                            "shapes, in one process; a table and a JSON record.")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds; runs on a CPU too)")
    p.add_argument("--out", default=None, help="write the JSON record here (a file, or a folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--target-ms", type=float, default=TARGET_MS_PER_RUNNER,
                   help=f"device time each runner's timed loop aims at (default {TARGET_MS_PER_RUNNER:.0f}); "
                        "repetitions adapt, between 3 and 20")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    record = run(sections, quick=args.quick, seed=args.seed, progress=not args.no_progress,
                 target_ms=args.target_ms)
    print(table(record))
    if args.out:
        out = Path(args.out)
        if out.is_dir() or args.out.endswith("/"):
            out.mkdir(parents=True, exist_ok=True)
            out = out / "bench.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=float))
        print(f"wrote {out}")
    return 0
