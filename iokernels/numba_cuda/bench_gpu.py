"""The Numba kernels next to torch SDPA on one GPU, in one run: the issue's three bars.

``PYTHONPATH=. python3 -m iokernels.numba_cuda.bench_gpu out.json`` (needs a GPU and torch).
Times come from :func:`iokernels.bench.time_cuda` (CUDA events, warm-up, median, L2
flushed outside the timed region).  Everything is called through the public launchers
with torch CUDA tensors, so the times include Numba's per-launch host overhead when the
GPU would otherwise wait for it.

1. FA forward, float32, B=8, H=16, N=4096, d=128, non-causal: each Numba version (and a
   few v3 tilings) vs SDPA EFFICIENT (FLASH has no float32); float16 vs FLASH too.
2. Decode, float16, GQA 32/8, d=128, B=1, N=32768: Numba (contiguous, paged; v1 and the
   other versions) vs the best SDPA backend with enable_gqa, in KV bytes per second.
3. Paged gather of the same cache (v1, v2) vs a device-to-device copy of the same bytes.
(An earlier script than :func:`sweep_decode_gather` and ``scripts/gpu_sweep.py``; kept
because it also times the forward tilings.)

The same versions also appear in ``python -m iokernels bench`` (scripts/gpu_all.sh) through
:func:`iokernels.numba_cuda.bench_versions`; this script adds the num_splits sweep.
"""
from __future__ import annotations

import json
import platform
import sys
import time


def _env():
    import numba
    import numpy as np
    import torch
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "numba": numba.__version__,
           "numpy": np.__version__, "python": platform.python_version(),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import importlib.metadata as md
        env["numba_cuda"] = md.version("numba-cuda")
    except Exception:
        pass
    try:
        import subprocess
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except Exception:
        pass
    return env


def _sdpa(q, k, v, backend, enable_gqa=False):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = getattr(SDPBackend, backend)
    with sdpa_kernel([be]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def _time(fn, reps=10, warmup=2):
    from iokernels.bench import time_cuda
    try:
        t = time_cuda(fn, reps=reps, warmup=warmup)
        return {"ms": round(t.median_ms, 4), "p10": round(t.p10, 4), "p90": round(t.p90, 4)}
    except Exception as e:  # a backend that does not support the case
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def forward_bench(results):
    import torch
    import iokernels as ik
    from iokernels.numba_cuda import NumbaConfig
    B, H, N, d = 8, 16, 4096, 128
    flops = 4.0 * B * H * N * N * d
    for dtype in ("float32", "float16"):
        tdt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((B, H, N, d), device="cuda", generator=g).to(tdt) for _ in range(3))
        rows = {}
        for be in ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):
            rows[f"sdpa {be}"] = _time(lambda be=be: _sdpa(q, k, v, be))
        configs = {"numba v3": NumbaConfig(version=3), "numba v4": NumbaConfig(version=4)}
        if dtype == "float32":  # the tilings tried, and the simpler versions
            configs.update({"numba v3 batched lane sums": NumbaConfig(version=3, batched_lane_sums=True),
                            "numba v3 L8 R2": NumbaConfig(version=3, threads_per_row=8, rows_per_thread=2),
                            "numba v3 L8 R4 Bc16": NumbaConfig(version=3, block_k=16),
                            "numba v2": NumbaConfig(version=2),
                            "numba v1": NumbaConfig(version=1)})
        for name, cfg in configs.items():
            reps = 3 if name in ("numba v1", "numba v2") else 10
            rows[name] = _time(lambda cfg=cfg: ik.attention(q, k, v, backend="numba", config=cfg), reps=reps,
                               warmup=1)
        for r in rows.values():
            if "ms" in r:
                r["tflops"] = round(flops / (r["ms"] * 1e-3) / 1e12, 2)
        base = rows["sdpa EFFICIENT_ATTENTION"].get("ms")
        for r in rows.values():
            if "ms" in r and base:
                r["speed_vs_sdpa_efficient"] = round(base / r["ms"], 3)
        results[f"forward_{dtype}_B{B}_H{H}_N{N}_d{d}"] = rows
        print(json.dumps({dtype: rows}, indent=1), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def decode_bench(results):
    import numpy as np
    import torch
    import iokernels as ik
    from iokernels.bench import device_pages
    from iokernels.numba_cuda import DecodeConfig, decode, gather_pools, paged_decode_pools
    B, Hq, Hkv, N, d = 1, 32, 8, 32768, 128
    tdt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((B, Hq, d), device="cuda", generator=g).to(tdt)
    k = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    v = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    kv_bytes = 2.0 * B * Hkv * N * d * 2
    rows = {}
    q4 = q[:, :, None, :]
    for be in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        rows[f"sdpa {be}"] = _time(lambda be=be: _sdpa(q4, k, v, be, enable_gqa=True))
    for s in (None, 32, 64, 128):
        rows[f"numba decode S={s}"] = _time(lambda s=s: ik.decode(q, k, v, num_splits=s, backend="numba"))
    v2s = {"v2": DecodeConfig(version=2), "v2-L32K8": DecodeConfig(version=2, lanes_per_key=32, keys_per_iter=8)}
    for name, cfg in v2s.items():          # version 2 (module docstring of decode_v2)
        for s in (None, 64):
            rows[f"numba decode {name} S={s}"] = _time(lambda s=s, cfg=cfg: decode(q, k, v, num_splits=s, config=cfg))
    kp, vp, tables, lens = device_pages(k, v, seed=1)
    for s in (None, 64):
        rows[f"numba paged decode S={s}"] = _time(lambda s=s: paged_decode_pools(q, kp, vp, tables, lens,
                                                                                num_splits=s))
    for name, cfg in v2s.items():
        rows[f"numba paged decode {name} S=None"] = _time(lambda cfg=cfg: paged_decode_pools(q, kp, vp, tables, lens,
                                                                                           config=cfg))
    for r in rows.values():
        if "ms" in r:
            r["kv_TBps"] = round(kv_bytes / (r["ms"] * 1e-3) / 1e12, 3)
    best = min((r["ms"] for n, r in rows.items() if n.startswith("sdpa") and "ms" in r), default=None)
    for r in rows.values():
        if "ms" in r and best:
            r["speed_vs_best_sdpa"] = round(best / r["ms"], 3)
    results[f"decode_float16_B{B}_Hq{Hq}_Hkv{Hkv}_N{N}_d{d}"] = rows
    print(json.dumps({"decode": rows}, indent=1), flush=True)

    # gather: sequence 0's K and V through its table vs a copy of the same bytes
    nbytes = 2 * 2.0 * Hkv * N * d * 2
    dst_k, dst_v = torch.empty_like(k[0]), torch.empty_like(v[0])

    def copy():
        dst_k.copy_(k[0])
        dst_v.copy_(v[0])
    grows = {"device copy (torch)": _time(copy),
             "numba gather (8-byte words)": _time(lambda: gather_pools(kp, vp, tables[0], N)),
             "numba gather (float16 elements)": _time(lambda: gather_pools(kp, vp, tables[0], N, words=False)),
             "numba gather v2 (grid-stride, 8-byte words)": _time(lambda: gather_pools(kp, vp, tables[0], N,
                                                                                      config=DecodeConfig(version=2)))}
    for r in grows.values():
        if "ms" in r:
            r["TBps_read_plus_write"] = round(nbytes / (r["ms"] * 1e-3) / 1e12, 3)
    base = grows["device copy (torch)"].get("ms")
    for r in grows.values():
        if "ms" in r and base:
            r["speed_vs_copy"] = round(base / r["ms"], 3)
    results[f"gather_float16_Hkv{Hkv}_N{N}_d{d}_bs16"] = grows
    print(json.dumps({"gather": grows}, indent=1), flush=True)
    del np


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "numba_bench.json"
    from iokernels import gpu
    if gpu.simulator_enabled():
        raise SystemExit("bench_gpu: NUMBA_ENABLE_CUDASIM is set; this times the real GPU")
    results = {"env": _env()}
    for part in (decode_bench, forward_bench):
        try:
            part(results)
        except Exception as e:
            results[part.__name__] = {"error": repr(e)[:500]}
            print(part.__name__, "failed:", repr(e)[:500], flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    print("wrote", out)


# --------------------------------------------------------------------------- decode/gather sweep
def _sweep_configs():
    """{row name: (function name, DecodeConfig, num_splits)} of :func:`sweep_decode_gather`."""
    from .decode_kernels import DecodeConfig as C
    v3 = C(version=3)                                        # 32 lanes x 4 keys x 8 groups
    k8 = C(version=3, keys_per_iter=8, key_groups=4)         # the first v3 tiling
    dec = {"numba v2 S=None": ("decode", C(version=2), None),
           "numba v3 S=None": ("decode", v3, None),
           "numba v3 S=32": ("decode", v3, 32),
           "numba v3 S=64": ("decode", v3, 64),
           "numba v3 S=128": ("decode", v3, 128),
           "numba v3-K8G4 S=None": ("decode", k8, None),
           "numba v3-K8G4 S=32": ("decode", k8, 32),
           "numba v3 paged S=None": ("paged", v3, None),
           "numba v3 paged S=32": ("paged", v3, 32),
           "numba v3-K8G4 paged S=None": ("paged", k8, None)}
    gat = {"numba gather v1": C(version=1), "numba gather v2": C(version=2), "numba gather v3": v3,
           "numba gather v3-U16": C(version=3, gather_unroll=16)}
    return dec, gat


def _numpy_pages(k, v, seed, block_size):
    """device_pages for NumPy arrays (the simulator sweep): the same random block permutation."""
    import numpy as np
    B, Hkv, N, d = k.shape
    nblk = N // block_size
    tables = np.random.default_rng(seed).permutation(B * nblk).astype(np.int32).reshape(B, nblk)
    kp = np.empty((B * nblk, block_size, Hkv, d), k.dtype)
    vp = np.empty_like(kp)
    for b in range(B):
        kp[tables[b]] = k[b].transpose(1, 0, 2).reshape(nblk, block_size, Hkv, d)
        vp[tables[b]] = v[b].transpose(1, 0, 2).reshape(nblk, block_size, Hkv, d)
    return kp, vp, tables, np.full(B, N, dtype=np.int32)


def sweep_decode_gather(out_path=None, tiny=False, reps=20):
    """Decode v2 vs v3 tilings and splits, and gather v1/v2/v3, next to cuDNN/FLASH SDPA and a
    torch copy of the same bytes, in one run (about a minute on an H200, compiles included).

    Decode: float16, GQA 32/8, d=128, B=1, N=32768 (contiguous, and paged with a random block
    table, Bn 16), KV bytes per second and speed vs the best SDPA in the same run.  Gather: the
    131072-token sequence of one (Hkv=8, d=128, bs=16) pool, read+write bytes per second and
    speed vs the copy.  One JSON line printed per row; all rows written to ``out_path``.

    ``tiny=True`` builds the same cases at a tiny size with NumPy arrays and runs each Numba
    row once, checked against the float64 oracle (no timing, no torch): what the simulator
    test runs.  Returns the rows (dicts).
    """
    import numpy as np
    from ..core import reference
    from ..bench import PAGED_BLOCK
    from . import decode, gather_pools, paged_decode_pools
    dec, gat = _sweep_configs()
    B, Hq, Hkv, N, d = (1, 2, 1, 32, 8) if tiny else (1, 32, 8, 32768, 128)
    NG = 32 if tiny else 131072                              # gather tokens
    Hg = 1 if tiny else 8
    rows = []
    t_start = time.time()

    def emit(row):
        row["t_s"] = round(time.time() - t_start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if tiny:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((B, Hq, d), (B, Hkv, N, d), (B, Hkv, N, d)))
        pages = _numpy_pages(k, v, 1, PAGED_BLOCK)
        ref, _ = reference.decode(q, k, v)
        kg, vg = (rng.standard_normal((1, Hg, NG, d)).astype(np.float16) for _ in range(2))
        gpages = _numpy_pages(kg, vg, 2, PAGED_BLOCK)
    else:
        import torch
        from ..bench import device_pages
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((B, Hq, d), device="cuda", dtype=torch.float16, generator=gen)
        k = torch.randn((B, Hkv, N, d), device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn((B, Hkv, N, d), device="cuda", dtype=torch.float16, generator=gen)
        pages = device_pages(k, v, seed=1)
        kg = torch.randn((1, Hg, NG, d), device="cuda", dtype=torch.float16, generator=gen)
        vg = torch.randn((1, Hg, NG, d), device="cuda", dtype=torch.float16, generator=gen)
        gpages = device_pages(kg, vg, seed=2)
    kv_bytes = 2.0 * B * Hkv * N * d * 2
    g_bytes = 2 * 2.0 * Hg * NG * d * 2                      # K and V, read + written

    def run(name, fn, work, unit_key, ref_out):
        row = {"section": "gather" if "gather" in name or "copy" in name else "decode", "name": name}
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            if tiny:
                row["max_err"] = float(np.max(np.abs(np.asarray(out, np.float64) - ref_out)))
                return emit(row)
            row["max_err"] = float((out.float() - ref_out.float()).abs().max())
            row.update(_time(fn, reps=reps, warmup=2))
            if "ms" in row:
                row[unit_key] = round(work / (row["ms"] * 1e-3) / 1e12, 3)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        emit(row)

    best_sdpa = None
    if not tiny:                                             # the baselines first
        q4 = q[:, :, None, :]
        sd = {}
        for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            r = _time(lambda be=be: _sdpa(q4, k, v, be, enable_gqa=True), reps=reps, warmup=2)
            r.update(section="decode", name=f"sdpa {be}")
            if "ms" in r:
                r["kv_TBps"] = round(kv_bytes / (r["ms"] * 1e-3) / 1e12, 3)
                sd[be] = r["ms"]
            emit(r)
        best_sdpa = min(sd.values(), default=None)
        ref = _sdpa(q4, k, v, "CUDNN_ATTENTION" if "CUDNN_ATTENTION" in sd else "FLASH_ATTENTION",
                    enable_gqa=True)[:, :, 0, :]
    for name, (kind, cfg, S) in dec.items():
        if tiny and S is not None:
            S = min(S, 3)                                    # 32 keys: a few splits (one empty)
        if kind == "decode":
            def fn(cfg=cfg, S=S):
                return decode(q, k, v, num_splits=S, config=cfg)
        else:
            def fn(cfg=cfg, S=S):
                return paged_decode_pools(q, pages[0], pages[1], pages[2], pages[3], num_splits=S, config=cfg)
        run(name, fn, kv_bytes, "kv_TBps", ref)
    copy_ms = None
    if not tiny:
        dst_k, dst_v = torch.empty_like(kg[0]), torch.empty_like(vg[0])

        def copy():
            dst_k.copy_(kg[0])
            dst_v.copy_(vg[0])
        r = _time(copy, reps=reps, warmup=2)
        r.update(section="gather", name="device copy (torch)")
        if "ms" in r:
            r["TBps_read_plus_write"] = round(g_bytes / (r["ms"] * 1e-3) / 1e12, 3)
            copy_ms = r["ms"]
        emit(r)
        gref = kg[0]
    else:
        gref = kg[0].astype(np.float64)
    for name, cfg in gat.items():
        run(name, lambda cfg=cfg: gather_pools(gpages[0], gpages[1], gpages[2][0], NG, config=cfg), g_bytes,
            "TBps_read_plus_write", gref)
    for r in rows:                                           # same-run ratios
        if "ms" in r and r["section"] == "decode" and best_sdpa:
            r["speed_vs_best_sdpa"] = round(best_sdpa / r["ms"], 3)
        if "ms" in r and r["section"] == "gather" and copy_ms:
            r["speed_vs_copy"] = round(copy_ms / r["ms"], 3)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"env": {} if tiny else _env(), "rows": rows}, f, indent=1)
    if not tiny:
        print(json.dumps({"summary": {r["name"]: r.get("speed_vs_best_sdpa", r.get("speed_vs_copy"))
                                      for r in rows}}), flush=True)
    return rows


if __name__ == "__main__":
    main()
