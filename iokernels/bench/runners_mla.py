"""The benchmark's MLA decode rows: the CuPy kernels of op "mla_decode" next to torch, on the roofline.

Split from :mod:`iokernels.bench.runners` (the measuring helpers live there).
"""
from __future__ import annotations

from .. import torch_sdpa as ts
from ..core import roofline as rl
from .runners import _first_line, _gpu_module, _gpu_rows, _measure, _torch_dtype
from .specs import MLA_ROOFLINE_GPU
from .timer import release_device_cache


def mla_roofline(flops: float, cache_bytes: float, gpu=None) -> dict:
    """The time bound of one MLA decode call on the roofline: the first of MLA_ROOFLINE_GPU in the
    roofline table (the measured ceilings when recorded), or ``gpu``.  dict(gpu, bound_ms, bound)."""
    table = {**rl.GPUS, **rl.MEASURED}
    name = gpu or next(n for n in MLA_ROOFLINE_GPU if n in table)
    tb = rl.time_bounds(flops, cache_bytes, name, "bf16")
    return dict(gpu=name, bound_ms=tb["time_s"] * 1e3, bound=tb["bound"])


def _mla_rates(row, flops, cache_bytes, bound_ms):
    """Add TFLOP/s, cache TB/s and the fraction of the roofline bound to an "ok" row."""
    if row.get("status") == "ok":
        s = row["ms"] * 1e-3
        row.update(tflops=round(flops / s / 1e12, 2), cache_TBps=round(cache_bytes / s / 1e12, 3),
                   roofline_fraction=round(bound_ms / row["ms"], 3))
    return row


def mla_cases(spec, seed, progress, section="mla", target_ms=None, into=None):
    """MLA decode (absorbed form): the CuPy kernels of the registry's op "mla_decode" and the
    torch formulations (:func:`iokernels.torch_sdpa.mla_decode_matmul`, :func:`mla_decode_sdpa`)
    on the same inputs.  Work: FLOPs 2 B Hq N (row + latent); bytes: the cache, read once."""
    import torch
    cases = [] if into is None else into
    Hq, dc, dr = spec["heads_q"], spec["latent_dim"], spec["rope_dim"]
    row_w = dc + dr
    for dtype in spec["dtypes"]:
        tdt = _torch_dtype(dtype)
        for B, N in spec["shapes"]:
            flops = 2.0 * B * Hq * N * (row_w + dc)
            cache_bytes = float(B * N * row_w * tdt.itemsize)
            roof = mla_roofline(flops, cache_bytes)
            case = dict(section=section, kind="mla", dtype=dtype, causal=False,
                        shape=dict(batch=B, heads_q=Hq, seqlen=N, latent_dim=dc, rope_dim=dr),
                        work=dict(flops=flops, cache_bytes=cache_bytes), unit="TFLOP/s",
                        roofline=roof, results=[])
            progress.set_description(f"{section} {dtype} B={B} N={N}")
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q = torch.randn((B, Hq, row_w), device="cuda", dtype=tdt, generator=gen)
            kv = torch.randn((B, N, row_w), device="cuda", dtype=tdt, generator=gen)
            ref, _ = ts.mla_decode_matmul(q, kv, latent_dim=dc)
            rows = [_measure("torch:matmul", "torch", lambda: ts.mla_decode_matmul(q, kv, latent_dim=dc),
                             work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms),
                    _measure("torch:sdpa", "torch", lambda: ts.mla_decode_sdpa(q, kv, latent_dim=dc),
                             work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms)]
            try:
                _, ran = ts.backend_that_ran(ts.mla_decode_sdpa, q, kv, latent_dim=dc)
                rows[1]["ran"] = ran[0] if ran else "unknown"
            except Exception as e:
                rows[1]["ran"] = f"unknown ({_first_line(e)})"
            progress.update(2)
            rows += _gpu_rows("cupy", "mla_decode",
                              lambda cfg: _gpu_module("cupy").mla_decode(q, kv, config=cfg),
                              need=dict(q=q, k=kv), work=flops, unit="TFLOP/s", ref=ref, dtype=dtype,
                              target_ms=target_ms)
            progress.update(1)
            for r in rows:
                _mla_rates(r, flops, cache_bytes, roof["bound_ms"])
            base = next((r for r in rows if r["runner"] == "torch:matmul" and r.get("status") == "ok"), None)
            for r in rows:
                if base and r.get("status") == "ok":
                    r["speed_vs_torch_matmul"] = round(base["ms"] / r["ms"], 4)
            case["results"] = rows
            cases.append(case)
            q = kv = ref = None            # drop the case's tensors before the cache is released
            release_device_cache()
    return cases
