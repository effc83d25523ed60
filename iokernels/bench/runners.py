"""The benchmark's rows: every registered kernel version next to torch SDPA on the same inputs.

One row per runner and case.  Everything a row needs to be trusted is in it: status ("ok" /
"unavailable: why" / "failed: why"), the median and spread, the rate, peak memory, the speed
relative to the best SDPA kernel of the same case, and the largest difference from SDPA's
output (a fast kernel with a wrong answer is not fast).  GPU rows come from the backends'
registries (:mod:`iokernels.core.registry`): one row per registered version, named
``<backend>:<version>``, the version the public function would pick marked ``default``.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import re
import sys
import time

import numpy as np

import iokernels as ik

from .. import api, autograd
from .. import torch_sdpa as ts
from ..core.conventions import key_range
from ..core.gpu import simulator_enabled
from ..core.testing import make_inputs
from ..paged import MIN_SCALE, QUANT_FORMATS
from .backends import GPU_ROW_BACKENDS, row_backends, set_row_backends  # noqa: F401 (the bench's names)
from .paged_tables import paged_call_tables
from .specs import CHECK_TOL, NUMPY_MAX_FLOPS, PAGED_BLOCK, SDPA_NAMES, SLOW_CALL_MS, SLOW_ROW_S, TARGET_MS_PER_RUNNER
from .timer import (DEFAULT_REPS, DEFAULT_WARMUP, _Device, host_calls, host_ms_loop, peak_memory,
                    release_device_cache, time_cpu, time_cuda)


class Unavailable(Exception):
    """A runner that cannot run here (module missing, dtype unsupported, ...): reported, not fatal."""


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
    lo, hi = key_range(np.arange(nq), nq, nk, causal, None)
    return int(np.sum(hi - lo))


def _resolve_backend(backend, op):
    """The backend function for (backend, op), or Unavailable with the reason."""
    if backend == "numba":
        if simulator_enabled():
            raise Unavailable("NUMBA_ENABLE_CUDASIM is set: the Numba kernels would run on the "
                              "CPU simulator, not the GPU")
    try:
        return api._resolve(backend, op)
    except (ImportError, AttributeError, ValueError) as e:
        raise Unavailable(f"{backend}.{op} not available: {_first_line(e)}") from None



def registry_versions(backend, op, **need_args) -> list:
    """[(row name, config, is_default)] for every version of ``op`` in ``backend``'s registry.

    The config is the version's config class with its defaults; is_default marks the version
    the public function picks for these inputs.  A backend that cannot be imported gives one
    row whose config is the Unavailable reason.
    """

    try:
        _resolve_backend(backend, "attention")              # refuses the Numba simulator
        mod = importlib.import_module(api.GPU_BACKENDS[backend])
        reg = mod.REGISTRY
    except Unavailable as e:
        return [(backend, e, False)]
    except Exception as e:  # ImportError, or no CUDA driver
        return [(backend, Unavailable(f"{backend} not importable: {_first_line(e)}"), False)]
    try:
        default = reg.default(op, mod.need(op, **need_args)).version
    except Exception:
        default = None
    return [(f"{backend}:{k.version}", k.config_class(version=k.version), k.version == default)
            for k in sorted(reg.kernels(op), key=lambda k: version_order(k.version))]


def version_order(version: str) -> tuple:
    """A version's place in a section's rows: by number, then suffix (v1, v1b, v2, ..., v10), so
    the order does not depend on which module registered its records first."""
    m = re.match(r"v(\d+)(.*)", version)
    return (int(m.group(1)), m.group(2)) if m else (float("inf"), version)


def _gpu_rows(backend, op, fn_of_config, *, suffix="", **measure_kw) -> list:
    """One measured row per registered version: ``fn_of_config(config)`` is the timed call."""
    rows = []
    need = measure_kw.pop("need")
    for name, cfg, is_default in registry_versions(backend, op, **need):
        if isinstance(cfg, Exception):
            rows.append({"runner": name + suffix, "group": backend, "status": f"unavailable: {cfg}"})
            continue
        row = _measure(name + suffix, backend, lambda cfg=cfg: fn_of_config(cfg), **measure_kw)
        if is_default:
            row["default"] = True
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- one timed row
def _measure(name, group, fn, *, work, unit, ref=None, dtype="float32", device=True, reps=None,
             warmup=None, cpu_reps=1, check=True, target_ms=None) -> dict:
    """Run, check, time and size one runner; any failure becomes a row that says why.

    ``wall_s``: the row's whole cost in wall time (compile, check, probe, timed loop, host loop),
    what a benchmark's time box pays for it."""
    row = {"runner": name, "group": group}
    t_row = time.perf_counter()
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
            if t.median_ms < SLOW_CALL_MS:      # host time per call: only short calls can be host-bound
                calls = host_calls(t.median_ms)         # a loop of calls, one synchronize at its end
                row["host_ms"] = round(host_ms_loop(fn, calls, _Device().synchronize), 5)
                row["host_calls"] = calls
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
        release_device_cache()
        row["wall_s"] = math.ceil((time.perf_counter() - t_row) * 1e3) / 1e3   # rounded up: a cost
        if row["wall_s"] > SLOW_ROW_S:
            print(f"    {name}: {row['wall_s']:.1f} s ({row.get('status', 'stopped')})", file=sys.stderr, flush=True)
    return row


def speed_vs_first(rows: list, key: str) -> None:
    """Set ``row[key]`` = the first row's time / the row's, on every ok row, when the first row
    (the section's own baseline: a device copy, our contiguous kernel) ran."""
    base = rows[0] if rows and rows[0].get("status") == "ok" else None
    for r in rows:
        if base and r.get("status") == "ok":
            r[key] = round(base["ms"] / r["ms"], 4)


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


def _prefill_grid(spec, section, progress, flops_per_pair):
    """The prefill cases of ``spec`` (dtype x causal x N), each an empty case dict; FLOPs are
    ``flops_per_pair`` x B H d x the visible (query, key) pairs."""
    B, H, d = spec["batch"], spec["heads"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        for causal in spec["causal"]:
            for N in spec["seqlens"]:
                flops = flops_per_pair * B * H * _visible_pairs(N, N, causal) * d
                if progress is not None:
                    progress.set_description(f"{section} {dtype} N={N} causal={causal}")
                yield dict(section=section, kind="prefill", dtype=dtype, causal=causal,
                           shape=dict(batch=B, heads=H, seqlen=N, head_dim=d),
                           work=dict(flops=flops), unit="TFLOP/s", results=[])


def _device_randn(seed, dtype, *shapes):
    """Seeded standard-normal CUDA tensors of ``shapes``, one generator in order."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, device="cuda", dtype=_torch_dtype(dtype), generator=gen) for s in shapes)


def _prefill_inputs(case, seed, count):
    s = case["shape"]
    return _device_randn(seed, case["dtype"], *[(s["batch"], s["heads"], s["seqlen"], s["head_dim"])] * count)


def prefill_cases(spec, seed, progress, numpy_max_flops=NUMPY_MAX_FLOPS, section="prefill",
                  target_ms=None, into=None):
    cases = [] if into is None else into
    for case in _prefill_grid(spec, section, progress, 4.0):
        case["results"] = _prefill_rows(case, seed, progress, numpy_max_flops, target_ms)
        cases.append(_finish_case(case))
        release_device_cache()          # the case's tensors died with _prefill_rows' frame
    return cases


def _prefill_rows(case, seed, progress, numpy_max_flops, target_ms):
    dtype, causal, flops = case["dtype"], case["causal"], case["work"]["flops"]
    q, k, v = _prefill_inputs(case, seed, 3)
    ref = _reference(q, k, v, causal, False, False)
    scale = 1.0 / np.sqrt(case["shape"]["head_dim"])
    rows = _sdpa_rows(case, q, k, v, causal, ref, dtype, False, flops, "TFLOP/s", False, target_ms)
    progress.update(5)
    rows.append(_measure("torch naive", "torch", lambda: ts.naive_attention(q, k, v, causal=causal),
                         work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms))
    progress.update(1)
    for backend in row_backends():
        rows += _gpu_rows(backend, "attention",
                          lambda cfg, backend=backend: ik.attention(
                              q, k, v, causal=causal, scale=scale, backend=backend, config=cfg, return_lse=True),
                          need=dict(q=q, k=k, v=v, causal=causal), work=flops, unit="TFLOP/s", ref=ref,
                          dtype=dtype, target_ms=target_ms)
        progress.update(1)
    rows += _numpy_rows(q, k, v, causal, scale, ref, dtype, flops, numpy_max_flops, target_ms)
    return rows


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
        f = api._resolve(backend, "attention")
        rows.append(_measure(name, "numpy", lambda f=f: f(hq, hk, hv, causal=causal, scale=scale,
                                                          window=(-1, -1), config=None),
                             work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, device=False,
                             target_ms=target_ms))
    return rows


def device_pages(k, v, seed=0, block_size=PAGED_BLOCK, scattered=True):
    """The same K/V as the contiguous (B, Hkv, N, d) tensors, in paged pools on the device.

    Returns (k_pool, v_pool, block_tables, seq_lens): pools (num_blocks, block_size, Hkv, d)
    in k's dtype (bfloat16 too), int32 NumPy tables (B, N / block_size) holding a random
    permutation of the pool's blocks -- scattered as in a server with many live requests
    -- and the lengths.  ``scattered=False`` hands the blocks out in order (block j of
    sequence b is pool block b * N / block_size + j), which separates what the page jumps
    cost from what the block-table path costs.  Built on the device (no host copy), so any
    size that fits runs.
    """
    import torch
    B, Hkv, N, d = k.shape
    if N % block_size:
        raise Unavailable(f"device_pages: N={N} must be a multiple of the block size {block_size}")
    nblk = N // block_size
    rng = np.random.default_rng(seed)
    order = rng.permutation(B * nblk) if scattered else np.arange(B * nblk)
    tables = order.astype(np.int32).reshape(B, nblk)
    kp = torch.empty((B * nblk, block_size, Hkv, d), dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    for b in range(B):                                    # block j of sequence b -> pool[tables[b, j]]
        idx = torch.from_numpy(tables[b]).to(k.device).long()
        kp[idx] = k[b].permute(1, 0, 2).reshape(nblk, block_size, Hkv, d)
        vp[idx] = v[b].permute(1, 0, 2).reshape(nblk, block_size, Hkv, d)
    return kp, vp, tables, np.full(B, N, dtype=np.int32)


def _gpu_module(backend):
    if backend == "numba":
        _resolve_backend("numba", "attention")             # refuses the simulator
    mod = api.GPU_BACKENDS[backend]
    try:
        return importlib.import_module(mod)
    except Exception as e:
        raise Unavailable(f"{mod} not importable: {_first_line(e)}") from None


def _pool_fn(backend, name):
    f = getattr(_gpu_module(backend), name, None)
    if f is None:
        raise Unavailable(f"{backend}.{name} does not exist")
    return f


#: device_quant_pages quantizes this many pool blocks at a time (their float32 copy: 64 MB
#: at 16 rows x 8 heads x 128 dims)
QUANT_CHUNK_BLOCKS = 8192


def decode_cases(spec, seed, progress, section="decode", target_ms=None, into=None):
    cases = [] if into is None else into
    Hq, Hkv, d = spec["heads_q"], spec["heads_kv"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        for B in spec["batches"]:
            for N in spec["seqlens"]:
                kv_bytes = 2.0 * B * Hkv * N * d * _torch_dtype(dtype).itemsize
                case = dict(section=section, kind="decode", dtype=dtype, causal=False,
                            shape=dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=N, head_dim=d),
                            work=dict(kv_bytes=kv_bytes), unit="TB/s", results=[])
                progress.set_description(f"{section} {dtype} B={B} N={N}")
                case["results"] = _decode_rows(case, seed, progress, target_ms)
                cases.append(_finish_case(case))
                release_device_cache()
    return cases


def _decode_inputs(case, seed):
    s = case["shape"]
    B, Hq, Hkv, N, d = s["batch"], s["heads_q"], s["heads_kv"], s["seqlen"], s["head_dim"]
    return _device_randn(seed, case["dtype"], (B, Hq, d), (B, Hkv, N, d), (B, Hkv, N, d))


def _decode_rows(case, seed, progress, target_ms):
    dtype, kv_bytes = case["dtype"], case["work"]["kv_bytes"]
    q, k, v = _decode_inputs(case, seed)
    gqa = q.shape[1] != k.shape[1]
    q4 = q[:, :, None, :]
    ref4 = _reference(q4, k, v, False, True, gqa)
    ref = None if ref4 is None else ref4[:, :, 0, :]
    rows = _sdpa_rows(case, q4, k, v, False, ref4, dtype, True, kv_bytes, "TB/s", gqa, target_ms)
    progress.update(5)
    scale = 1.0 / np.sqrt(q.shape[-1])
    for backend in row_backends():
        rows += _gpu_rows(backend, "decode",
                          lambda cfg, backend=backend: ik.decode(
                              q, k, v, scale=scale, backend=backend, config=cfg, return_lse=True),
                          need=dict(q=q, k=k, v=v), work=kv_bytes, unit="TB/s", ref=ref,
                          dtype=dtype, target_ms=target_ms)
        progress.update(1)
    try:
        pages = device_pages(k, v, seed)
    except (Unavailable, RuntimeError) as e:   # e.g. out of device memory
        pages = e
    for backend in row_backends():
        held = None if isinstance(pages, Exception) else paged_call_tables(backend, pages[2], pages[3], q.device)

        def fn(cfg, backend=backend, held=held):
            if isinstance(pages, Exception):
                raise Unavailable(f"paged pools: {_first_line(pages)}")
            f = _pool_fn(backend, "paged_decode_pools")
            return f(q, pages[0], pages[1], held[0], held[1], num_splits=None, scale=scale, config=cfg)
        rows += _gpu_rows(backend, "paged_decode", fn, suffix=" paged", need=dict(q=q, k=k, v=v),
                          work=kv_bytes, unit="TB/s", ref=ref, dtype=dtype, target_ms=target_ms)
        progress.update(1)
    return rows


def device_quant_pages(k_pool, v_pool, kv_dtype):
    """A quantized cache's pools built on the device from 16-bit pools, as
    :class:`~iokernels.paged.PagedKVCache` quantizes: per (block, KV head) the smallest
    power-of-two scale s with amax / s <= the format's largest value, codes x / s rounded
    to the format.  Returns (k_codes, v_codes, k_scale, v_scale): uint8 views of the codes
    (num_blocks, block_size, Hkv, d) and float32 scales (num_blocks, Hkv)."""
    import torch
    qmax = QUANT_FORMATS[kv_dtype]
    out = []
    for pool in (k_pool, v_pool):
        amax = pool.abs().amax(dim=(1, 3)).float()                        # (blocks, Hkv)
        s = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / qmax, min=MIN_SCALE)))).contiguous()
        codes = torch.empty(pool.shape, dtype=torch.uint8, device=pool.device)
        for b0 in range(0, pool.shape[0], QUANT_CHUNK_BLOCKS):            # bounded float32 scratch
            y = pool[b0:b0 + QUANT_CHUNK_BLOCKS].float() / s[b0:b0 + QUANT_CHUNK_BLOCKS, None, :, None]
            if kv_dtype == "int8":
                c = torch.clamp(torch.round(y), -qmax, qmax).to(torch.int8).view(torch.uint8)
            else:
                c = y.to(torch.float8_e4m3fn).view(torch.uint8)
            codes[b0:b0 + QUANT_CHUNK_BLOCKS] = c
        out.append((codes, s))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def quant_decode_cases(spec, seed, progress, section="decode", target_ms=None, into=None):
    """Paged decode over a quantized cache (1-byte codes + scales) and with a sliding window,
    next to the 16-bit paged decode of the same values (numba's default version; cupy's
    ``spec["cupy_versions"]``, None: its default)."""
    import torch

    from ..cupy_raw.config import DecodeConfig as CupyDecodeConfig
    cases = [] if into is None else into
    Hq, Hkv, d = spec["heads_q"], spec["heads_kv"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        tdt = _torch_dtype(dtype)
        for B in spec["batches"]:
            for N in spec["seqlens"]:
                progress.set_description(f"{section} quantized/windowed {dtype} B={B} N={N}")
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q = torch.randn((B, Hq, d), device="cuda", dtype=tdt, generator=gen)
                k = torch.randn((B, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
                v = torch.randn((B, Hkv, N, d), device="cuda", dtype=tdt, generator=gen)
                pages = device_pages(k, v, seed)
                scale = 1.0 / np.sqrt(d)
                for kv, window in spec["variants"]:
                    seen = N if window is None else min(N, window[0] + 1)
                    itemsize = 1 if kv else tdt.itemsize
                    kv_bytes = 2.0 * B * Hkv * seen * d * itemsize
                    case = dict(section=section, kind="decode", dtype=dtype, causal=False, kv_dtype=kv or dtype,
                                window=window, shape=dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=N, head_dim=d),
                                work=dict(kv_bytes=kv_bytes), unit="TB/s", results=[])
                    ref = None
                    if kv is None and window is None:
                        ref4 = _reference(q[:, :, None, :], k, v, False, True, Hq != Hkv)
                        ref = None if ref4 is None else ref4[:, :, 0, :]
                    quant, kp, vp = None, pages[0], pages[1]
                    if kv is not None:
                        kp, vp, ks, vs = device_quant_pages(pages[0], pages[1], kv)
                        quant = dict(kv=kv, k_scale=ks, v_scale=vs)
                    rows = []
                    runs = [("numba", None)] + [("cupy", v) for v in spec.get("cupy_versions", (None,))]
                    for backend, version in runs:
                        cfg = None if version is None else CupyDecodeConfig(version)

                        def fn(backend=backend, cfg=cfg, kp=kp, vp=vp, quant=quant, window=window):
                            f = _pool_fn(backend, "paged_decode_pools")
                            return f(q, kp, vp, pages[2], pages[3], scale=scale, window=window, quant=quant,
                                     config=cfg)
                        name = backend if version is None else f"{backend} {version}"
                        label = f"{name} paged {kv or dtype}{'' if window is None else f' window {window[0]}'}"
                        rows.append(_measure(label, backend, fn, work=kv_bytes, unit="TB/s", ref=ref, dtype=dtype,
                                             target_ms=target_ms))
                        progress.update(1)
                    case["results"] = rows
                    cases.append(_finish_case(case))
                    del kp, vp, quant
                q = k = v = pages = None       # drop the case's tensors (the runners close over them)
                release_device_cache()
    return cases


def gather_cases(spec, seed, progress, section="gather", target_ms=None, into=None):
    """Paged gather (numba, cupy) vs a device-to-device copy of the same bytes."""
    import torch
    cases = [] if into is None else into
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
            def fn(cfg, backend=backend):
                if isinstance(pages, Exception):
                    raise Unavailable(f"paged pools: {_first_line(pages)}")
                return _pool_fn(backend, "gather_pools")(pages[0], pages[1], pages[2][0], int(pages[3][0]),
                                                         config=cfg)
            rows += _gpu_rows(backend, "paged_gather", fn, suffix=" gather", need=dict(q=k[:, :, 0], k=k, v=v),
                              work=nbytes, unit="TB/s", ref=k[0], dtype=dtype, target_ms=target_ms)
            progress.update(1)
        progress.update(1)
        speed_vs_first(rows, "speed_vs_copy")      # the copy is this section's baseline (no SDPA here)
        case["results"] = rows
        cases.append(case)
        k = v = dst_k = dst_v = pages = None   # drop the case's tensors (the runners close over them)
        release_device_cache()
    return cases


def _numpy_only_cases(spec, seed):
    """Without a GPU: the NumPy rows of the (quick) prefill shapes, so the harness still runs."""
    cases = []
    rng = np.random.default_rng(seed)
    for case in _prefill_grid(spec, "cpu", None, 4.0):
        s, causal = case["shape"], case["causal"]
        q, k, v = make_inputs(rng, batch=s["batch"], heads_q=s["heads"], seqlen_q=s["seqlen"],
                              head_dim=s["head_dim"], dtype=case["dtype"])
        rows = []
        for backend in ("naive", "tiled"):
            f = api._resolve(backend, "attention")
            rows.append(_measure(f"numpy {backend}", "numpy",
                                 lambda f=f: f(q, k, v, causal=causal, scale=1 / np.sqrt(s["head_dim"]),
                                               window=(-1, -1), config=None),
                                 work=case["work"]["flops"], unit="TFLOP/s", device=False, cpu_reps=3))
        base = rows[0] if rows[0].get("status") == "ok" else None
        for r in rows:
            if base and r.get("status") == "ok":
                r["speed_vs_numpy_naive"] = round(base["ms"] / r["ms"], 4)
        case.update(results=rows, note="no CUDA GPU here: only the NumPy rows ran")
        cases.append(case)
    return cases


# --------------------------------------------------------------------------- forward + backward
def _bitwise_differences(a, b) -> int:
    """How many elements of two device tensors differ in any bit."""
    import torch
    ta, tb = _to_torch_device(a), _to_torch_device(b)
    return int((ta.view(torch.int16 if ta.element_size() == 2 else torch.int32)
                != tb.view(torch.int16 if tb.element_size() == 2 else torch.int32)).sum().item())


def backward_cases(spec, seed, progress, section="backward", target_ms=None, into=None):
    """Forward + backward (what a training step pays) of each backend with a backward, next to
    SDPA's kernels through torch autograd; then each registered backward version's atomic and
    deterministic modes, run twice: the bits of dQ that differ between two runs, and the cost
    of determinism (same-run time ratio)."""
    cases = [] if into is None else into
    # forward 4 N^2 d (2 matmuls) + backward 10 N^2 d (5 matmuls), visible pairs only
    for case in _prefill_grid(spec, section, progress, 14.0):
        case["results"] = _backward_rows(case, seed, progress, target_ms)
        cases.append(_finish_case(case))
        release_device_cache()
    return cases


def _backward_rows(case, seed, progress, target_ms):
    dtype, causal, flops = case["dtype"], case["causal"], case["work"]["flops"]
    q, k, v, do = _prefill_inputs(case, seed, 4)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step(attn):
        for x in leaves:
            x.grad = None
        o = attn(*leaves)
        o.backward(do)
        return leaves[0].grad

    rows = []
    for name in SDPA_NAMES:
        rows.append(_measure(f"sdpa:{name} fwd+bwd", "sdpa", lambda name=name: _sdpa_step(ts, step, name, causal),
                             work=flops, unit="TFLOP/s", dtype=dtype, check=False, target_ms=target_ms))
    for backend in row_backends():               # outputs are gradients: compared in the tests
        rows += _gpu_rows(backend, "attention_backward",
                          lambda cfg, backend=backend: step(lambda a, b, c: autograd.attention(
                              a, b, c, causal=causal, backend=backend, backward_config=cfg)),
                          suffix=" fwd+bwd", need=dict(q=q, k=k, v=v), work=flops, unit="TFLOP/s",
                          dtype=dtype, target_ms=target_ms, check=False)
        rows += _determinism_rows(backend, q, k, v, do, causal, dtype, target_ms)
        progress.update(1)
    return rows


def _sdpa_step(ts, step, name, causal):
    with ts.force(name):
        return step(lambda a, b, c: ts.sdpa(a, b, c, causal=causal))


def _determinism_rows(backend, q, k, v, do, causal, dtype, target_ms):
    """Backward alone, atomic and deterministic, for each registered version with a
    ``deterministic`` setting: time, and dQ's differing elements between two runs."""
    rows = []
    o = lse = None
    for name, cfg, _ in registry_versions(backend, "attention_backward", q=q, k=k, v=v):
        if isinstance(cfg, Exception) or "deterministic" not in {f.name for f in dataclasses.fields(cfg)}:
            continue
        try:
            if o is None:
                o, lse = ik.attention(q, k, v, causal=causal, backend="torch", return_lse=True)
        except Exception as e:
            rows.append({"runner": f"{name} bwd", "group": backend, "status": f"failed: {_first_line(e)}"})
            return rows
        for det in (False, True):
            c = cfg.replace(deterministic=det)
            def fn(c=c):
                return ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend=backend, config=c)
            row = _measure(f"{name} bwd {'deterministic' if det else 'atomic'}", backend, fn,
                           work=10.0 * q.shape[0] * q.shape[1] * _visible_pairs(q.shape[2], k.shape[2], causal)
                           * q.shape[3], unit="TFLOP/s", dtype=dtype, check=False, target_ms=target_ms)
            if row.get("status") == "ok":
                try:
                    row["dq_elements_differing_between_two_runs"] = _bitwise_differences(fn()[0], fn()[0])
                except Exception as e:
                    row["determinism_check"] = f"failed: {_first_line(e)}"
            rows.append(row)
    return rows
