"""The issue's performance bars for the CuPy kernels, timed next to torch SDPA in one run.

``python -m iokernels.cupy_raw.quick_bench [out.json]`` on a GPU machine.  Every number
comes from :func:`iokernels.bench.time_cuda` (CUDA events, warm-up, median, L2 flushed),
and every ratio is to a baseline timed in the same process.  The full side-by-side
sweep is ``python -m iokernels bench``; this script is the short list the docstrings of
an earlier docstring of :mod:`iokernels.cupy_raw` quoted.  It also times fa v1b (float32) and
decode v2 (ring depths 2, 3, 4; contiguous and paged) next to v1 and SDPA; the recorded
numbers now come from ``scripts/gpu_all.sh`` and the sweeps below.

``python -m iokernels.cupy_raw.quick_bench sweep_decode [out.json]``: :func:`sweep_decode`,
decode v2 and v3 settings (fused / unfused combine, warps, ring depth, tile rows, splits)
at bf16 B=1 N=32768 GQA 32/8, contiguous and paged, next to cuDNN's SDPA.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import sys

import numpy as np


def _env():
    import cupy
    import torch
    props = torch.cuda.get_device_properties(0)
    try:
        drv = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        drv = None
    return dict(gpu=props.name, sms=props.multi_processor_count, cc=f"{props.major}.{props.minor}",
                cuda_driver_api=drv, torch=torch.__version__, cupy=cupy.__version__, numpy=np.__version__,
                python=platform.python_version(), date=datetime.date.today().isoformat())


def _visible_pairs(nq, nk, causal):
    from iokernels import conventions as cv
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal, None)
    return int(np.sum(hi - lo))


def main(out_path=None, sections=("prefill", "decode")):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from iokernels import bench
    from iokernels import cupy_raw as cr
    rows = []
    t = bench.time_cuda

    def rec(group, name, ms, work, unit, base=None, extra=None):
        val = work / (ms * 1e-3) / 1e12
        row = dict(group=group, runner=name, ms=round(ms, 5), **{unit: round(val, 2)})
        if base is not None:
            row["ratio_to_" + base[0]] = round(base[1] / ms, 3)
        if extra:
            row.update(extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return ms

    def sdpa(q, k, v, causal, backend, gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    gen = torch.Generator(device="cuda").manual_seed(0)
    # ---------------------------------------------------------------- prefill
    B, H, N, d = 8, 16, 4096, 128
    for dtype in (("bfloat16", "float16", "float32") if "prefill" in sections else ()):
        tdt = getattr(torch, dtype)
        q, k, v = (torch.randn((B, H, N, d), device="cuda", dtype=tdt, generator=gen) for _ in range(3))
        for causal in (False, True):
            flops = 4.0 * B * H * _visible_pairs(N, N, causal) * d
            group = f"fwd {dtype} B={B} H={H} N={N} d={d} causal={causal}"
            best = {}
            backends = [("FLASH", SDPBackend.FLASH_ATTENTION), ("CUDNN", SDPBackend.CUDNN_ATTENTION),
                        ("EFFICIENT", SDPBackend.EFFICIENT_ATTENTION)]
            for name, be in backends:
                try:
                    ms = t(sdpa, q, k, v, causal, be).median_ms
                    best[name] = rec(group, f"sdpa {name}", ms, flops, "TFLOP/s")
                except Exception as e:  # a backend that does not take this dtype
                    print(f"# {group} sdpa {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            ref = sdpa(q, k, v, causal, SDPBackend.EFFICIENT_ATTENTION if dtype == "float32"
                       else SDPBackend.FLASH_ATTENTION)
            base_name = "EFFICIENT" if dtype == "float32" else "FLASH"
            base = (base_name, best[base_name]) if base_name in best else None
            if dtype == "float32":
                cfgs = {"v1 64x64": cr.CupyConfig("v1", 64, 64), "v1 64x32": cr.CupyConfig("v1", 64, 32),
                        "v1 32x64": cr.CupyConfig("v1", 32, 64),
                        "v1b 64x64": cr.CupyConfig("v1b", 64, 64), "v1b 64x32": cr.CupyConfig("v1b", 64, 32),
                        "v1b 32x64": cr.CupyConfig("v1b", 32, 64)}
            else:
                cfgs = {"v2 4w bk64": cr.CupyConfig("v2", num_warps=4, block_k=64),
                        "v2 8w bk64": cr.CupyConfig("v2", num_warps=8, block_k=64),
                        "v2 4w bk32": cr.CupyConfig("v2", num_warps=4, block_k=32),
                        "v2 8w bk32": cr.CupyConfig("v2", num_warps=8, block_k=32)}
                if dtype == "float16":
                    cfgs = {k_: v_ for k_, v_ in cfgs.items() if k_ in ("v2 4w bk64", "v2 8w bk64")}
            for name, cfg in cfgs.items():
                try:
                    o, _ = cr.attention(q, k, v, causal=causal, scale=1 / math.sqrt(d), window=None, config=cfg)
                    err = float((o.float() - ref.float()).abs().max())
                    ms = t(cr.attention, q, k, v, causal=causal, scale=1 / math.sqrt(d), window=None,
                           config=cfg).median_ms
                    rec(group, f"cupy {name}", ms, flops, "TFLOP/s", base, {"max_abs_diff_vs_sdpa": err})
                except Exception as e:
                    print(f"# {group} cupy {name}: {type(e).__name__}: {e}")
        del q, k, v
        torch.cuda.empty_cache()

    # ---------------------------------------------------------------- decode
    Hq, Hkv, d, N = 32, 8, 128, 32768
    for dtype in (("bfloat16",) if "decode" in sections else ()):
        tdt = getattr(torch, dtype)
        q = torch.randn((1, Hq, d), device="cuda", dtype=tdt, generator=gen)
        k, v = (torch.randn((1, Hkv, N, d), device="cuda", dtype=tdt, generator=gen) for _ in range(2))
        kv_bytes = 2.0 * Hkv * N * d * 2
        group = f"decode {dtype} B=1 Hq={Hq} Hkv={Hkv} N={N} d={d}"
        q4 = q[:, :, None, :]
        best = None
        for name, be in (("FLASH", SDPBackend.FLASH_ATTENTION), ("CUDNN", SDPBackend.CUDNN_ATTENTION),
                         ("EFFICIENT", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                ms = t(sdpa, q4, k, v, False, be, True).median_ms
            except Exception:
                try:
                    ke, ve = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
                    ms = t(sdpa, q4, ke, ve, False, be).median_ms
                    name += " (K/V expanded)"
                except Exception as e:
                    print(f"# {group} sdpa {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
            rec(group, f"sdpa {name}", ms, kv_bytes, "TB/s")
            if best is None or ms < best[1]:
                best = (f"best_sdpa({name})", ms)
        ref = sdpa(q4, k, v, False, SDPBackend.FLASH_ATTENTION, True)[:, :, 0]
        contiguous_ms = None
        heur = cr.num_splits_heuristic(1, Hkv, N, torch.cuda.get_device_properties(0).multi_processor_count)
        v2_ms = None
        for version, S in (("v1", None), ("v1", 64), ("v2", None), ("v2", 64)):
            cfg = cr.DecodeConfig(version=version)
            o, _ = cr.decode(q, k, v, seq_lens=None, num_splits=S, scale=None, config=cfg)
            err = float((o.float() - ref.float()).abs().max())
            ms = t(cr.decode, q, k, v, seq_lens=None, num_splits=S, scale=None, config=cfg).median_ms
            label = f"cupy decode {version} splits={S if S else 'heuristic'}"
            rec(group, label, ms, kv_bytes, "TB/s", best, {"max_abs_diff_vs_sdpa": err})
            if S is None and version == "v1":
                contiguous_ms = ms
            if S is None and version == "v2":
                v2_ms = ms
        # the kernels alone (device arrays prepared once): what the GPU spends
        import cupy
        io = cr._IO(q)
        qd, kd, vd = io.dev(q, "q"), io.dev(k, "k"), io.dev(v, "v")
        od, ld = cupy.empty((1, Hq, d), np.uint16), cupy.empty((1, Hq), np.float32)
        for unroll, mb in ((4, 3), (2, 4), (8, 2)):
            for S in (None,):
                try:
                    ms = t(cr.launch_decode, qd, kd, vd, None, od, ld, dtype=dtype, scale=1 / math.sqrt(d),
                           num_splits=S, nk=N, unroll=unroll, min_blocks=mb).median_ms
                    rec(group, f"cupy decode kernels only unroll={unroll} min_blocks={mb} splits={S or 'heuristic'}",
                        ms, kv_bytes, "TB/s", best)
                except Exception as e:
                    print(f"# decode unroll={unroll} mb={mb} S={S}: {type(e).__name__}: {e}")
        for stages in (2, 3, 4):                    # decode v2: ring depth
            try:
                ms = t(cr.launch_decode, qd, kd, vd, None, od, ld, dtype=dtype, scale=1 / math.sqrt(d),
                       num_splits=None, nk=N, config=cr.DecodeConfig("v2", stages=stages)).median_ms
                rec(group, f"cupy decode v2 kernels only stages={stages} splits=heuristic", ms, kv_bytes, "TB/s", best)
            except Exception as e:
                print(f"# decode v2 stages={stages}: {type(e).__name__}: {e}")
        # paged: pools on the device, blocks in a random order (as in a busy server)
        bs = 16
        nblk = N // bs
        perm = torch.randperm(nblk, device="cuda", generator=gen)
        kp = torch.empty((nblk, bs, Hkv, d), device="cuda", dtype=tdt)
        vp = torch.empty_like(kp)
        kp[perm] = k[0].permute(1, 0, 2).reshape(nblk, bs, Hkv, d)
        vp[perm] = v[0].permute(1, 0, 2).reshape(nblk, bs, Hkv, d)
        tables = perm.to(torch.int32)[None].cpu().numpy()
        lens = np.array([N], np.int32)
        o, _ = cr.paged_decode_pools(q, kp, vp, tables, lens)
        err = float((o.float() - ref.float()).abs().max())
        ms = t(cr.paged_decode_pools, q, kp, vp, tables, lens).median_ms
        rec(group, "cupy paged decode (heuristic)", ms, kv_bytes, "TB/s", ("contiguous_cupy", contiguous_ms),
            {"max_abs_diff_vs_sdpa": err, "ratio_to_best_sdpa": round(best[1] / ms, 3) if best else None})
        cfg2 = cr.DecodeConfig(version="v2")
        o, _ = cr.paged_decode_pools(q, kp, vp, tables, lens, config=cfg2)
        err = float((o.float() - ref.float()).abs().max())
        ms = t(cr.paged_decode_pools, q, kp, vp, tables, lens, config=cfg2).median_ms
        rec(group, "cupy paged decode v2 (heuristic)", ms, kv_bytes, "TB/s", ("contiguous_cupy_v2", v2_ms) if v2_ms else None,
            {"max_abs_diff_vs_sdpa": err, "ratio_to_best_sdpa": round(best[1] / ms, 3) if best else None,
             "ratio_to_contiguous_cupy_v1": round(contiguous_ms / ms, 3) if contiguous_ms else None})

        # ---------------------------------------------------------------- paged gather
        group = f"paged gather {dtype} Hkv={Hkv} N={N} d={d} block={bs}"
        nbytes = 2 * kv_bytes                                    # read + write, K and V
        dk, dv = torch.empty_like(k[0]), torch.empty_like(v[0])

        def copy():
            dk.copy_(k[0])
            dv.copy_(v[0])
        ms_copy = rec(group, "device copy (torch)", t(copy).median_ms, nbytes, "TB/s")
        table1 = perm.to(torch.int32).cpu().numpy()
        gk, gv = cr.gather_pools(kp, vp, table1, N)
        exact = bool(torch.equal(gk, k[0]) and torch.equal(gv, v[0]))
        ms = t(cr.gather_pools, kp, vp, table1, N).median_ms
        rec(group, "cupy paged gather", ms, nbytes, "TB/s", ("device_copy", ms_copy), {"exact": exact})
        # the same launch without the per-call host work (table upload, checks)
        kpd, vpd = cr._pool_dev(cr._IO(kp, "k_pool"), kp), cr._pool_dev(cr._IO(vp, "v_pool"), vp)
        ko, vo = cupy.empty((Hkv, N, d), np.uint16), cupy.empty((Hkv, N, d), np.uint16)
        td = cupy.asarray(table1)
        ms = t(cr.launch_gather, kpd, vpd, td, ko, vo, N).median_ms
        rec(group, "cupy paged gather (kernel only)", ms, nbytes, "TB/s", ("device_copy", ms_copy))

    result = dict(env=_env(), rows=rows)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


#: sweep_decode's candidates: (label, DecodeConfig keyword arguments, num_splits or None for
#: the heuristic).  At most 16 a layout; v2 is the baseline, the rest are v3.  SRAM a block
#: at bf16 d=128 (4 KB a stage a warp): 4 warps x 3 stages 48 KB (4 blocks an SM), x 4 stages
#: 64 KB (3), tile=16 x 3 stages 96 KB (2); 8 warps x 3 stages 96 KB (2), x 4 stages 128 KB (1).
SWEEP_DECODE_CONFIGS = (                                      # around the default (v3, 8 warps x 4 stages)
    ("v2", dict(version="v2"), None),
    ("v3 4w x 3", dict(version="v3", num_warps=4, stages=3), None),
    ("v3", dict(version="v3"), None),
    ("v3 S=24", dict(version="v3"), 24),
    ("v3 S=32", dict(version="v3"), 32),
    ("v3 8w x 5", dict(version="v3", stages=5), None),
    ("v3 8w x 6", dict(version="v3", stages=6), None),
    ("v3 8w x 3 tile=16", dict(version="v3", stages=3, tile_rows=16), None),
    ("v3 8w x 4 unfused", dict(version="v3", fused=False), None),
)


def sweep_decode_cases():
    """(label, DecodeConfig, num_splits) of the sweep; builds without a GPU."""
    from iokernels import cupy_raw as cr
    out = []
    for label, kw, splits in SWEEP_DECODE_CONFIGS:
        out.append((label, cr.DecodeConfig(**kw), None if splits is None else min(splits, cr.DECODE_MAX_SPLITS)))
    return out


def sweep_decode(out_path=None, reps=30):
    """Time decode v2 and v3 settings at bf16 B=1 N=32768 GQA 32/8 d=128, contiguous and paged.

    Next to cuDNN's SDPA (sdpa_kernel CUDNN_ATTENTION, enable_gqa) in the same run; every
    time from :func:`iokernels.bench.time_cuda` through the public launchers (the call as
    the benchmark times it), the paged pools from :func:`iokernels.bench.device_pages` (a
    shuffled block table).  One JSON line a row: ms, TB/s of K+V read, ratio to cuDNN,
    paged rows also their ratio to the same config contiguous, and the max difference to
    SDPA's output.  About 24 NVRTC compiles + 26 timings: well under 90 s on an H200.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    from iokernels import cupy_raw as cr
    cases = sweep_decode_cases()
    B, Hq, Hkv, N, d = 1, 32, 8, 32768, 128
    tdt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B, Hq, d), device="cuda", dtype=tdt, generator=gen)
    k, v = (torch.randn((B, Hkv, N, d), device="cuda", dtype=tdt, generator=gen) for _ in range(2))
    kv_bytes = 2.0 * B * Hkv * N * d * 2
    group = f"decode bfloat16 B={B} Hq={Hq} Hkv={Hkv} N={N} d={d}"
    rows = []

    def rec(runner, ms, **extra):
        row = dict(group=group, runner=runner, ms=round(ms, 5), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3), **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)

    q4 = q[:, :, None, :]

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    ref = sdpa()[:, :, 0].float()
    cudnn_ms = bench.time_cuda(sdpa, reps=reps).median_ms
    rec("sdpa CUDNN", cudnn_ms)
    kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
    contiguous = {}
    for label, cfg, splits in cases:
        for paged in (False, True):
            name = f"cupy {label}" + (" paged" if paged else "")
            try:
                if paged:
                    fn, args = cr.paged_decode_pools, (q, kp, vp, tables, lens)
                else:
                    fn, args = cr.decode, (q, k, v)
                o, _ = fn(*args, num_splits=splits, config=cfg)
                err = float((o.float() - ref).abs().max())
                ms = bench.time_cuda(fn, *args, num_splits=splits, config=cfg, reps=reps).median_ms
                extra = dict(ratio_to_cudnn=round(cudnn_ms / ms, 3), max_abs_diff_vs_sdpa=err,
                             config=repr(cfg), num_splits=splits or "heuristic")
                if paged and label in contiguous:
                    extra["ratio_to_contiguous"] = round(contiguous[label] / ms, 3)
                if not paged:
                    contiguous[label] = ms
                rec(name, ms, **extra)
            except Exception as e:                         # one config that does not fit: say so, go on
                print(f"# {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    result = dict(env=_env(), rows=rows)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sweep_decode":      # python -m ... sweep_decode [out.json]
        sweep_decode(sys.argv[2] if len(sys.argv) > 2 else None)
        sys.exit(0)
    main(sys.argv[1] if len(sys.argv) > 1 else None,
         tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("prefill", "decode"))


def paged_layout_probe(out_path=None, reps=30):
    """Why paged decode trails contiguous decode: the pool layout, measured.

    bf16 decode, B=1, the default kernel, K+V = 134 MB in three ways: GQA 32/8 with the
    pool as (blocks, slots, Hkv, d) -- one head's rows of a block are 256-byte pieces 2 KB
    apart, interleaved with the other heads' --; the same pool stored heads-outer,
    (blocks, Hkv, slots, d), and passed as a strided view (each head's rows of a block
    contiguous, 4 KB); and MQA (Hkv = 1, N = 262144), where the two layouts coincide.
    Each next to contiguous decode of the same K/V.  Then MQA with pages of 16 to 1024 rows
    (runs of 4 KB to 256 KB between random jumps).  One JSON line a row.
    """
    import torch

    from iokernels import bench
    from iokernels import cupy_raw as cr
    rows = []
    for Hq, Hkv, N in ((32, 8, 32768), (4, 1, 262144)):
        d, bs = 128, bench.PAGED_BLOCK
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn((1, Hq, d), device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn((1, Hkv, N, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        kv_bytes = 2.0 * Hkv * N * d * 2
        kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
        ho = [p.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for p in (kp, vp)]   # heads-outer storage
        ref, _ = cr.decode(q, k, v)
        runs = {"contiguous": (cr.decode, (q, k, v)),
                "paged (blocks, slots, Hkv, d)": (cr.paged_decode_pools, (q, kp, vp, tables, lens)),
                "paged heads-outer (blocks, Hkv, slots, d)": (cr.paged_decode_pools, (q, ho[0], ho[1], tables, lens))}
        base = None
        for name, (fn, args) in runs.items():
            try:
                o, _ = fn(*args)
                err = float((o.float() - ref.float()).abs().max())
                ms = bench.time_cuda(fn, *args, reps=reps).median_ms
                base = base or ms
                row = dict(shape=f"B1 Hq{Hq} Hkv{Hkv} N{N} d{d} bf16", runner=name, ms=round(ms, 5),
                           tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3), vs_contiguous=round(base / ms, 3),
                           max_diff_vs_contiguous=err)
            except Exception as e:
                row = dict(shape=f"B1 Hq{Hq} Hkv{Hkv} N{N}", runner=name, error=f"{type(e).__name__}: {e}"[:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the page size: a page holds block_size rows of a head, one contiguous run of
    # block_size * 256 bytes (MQA) that the kernel reads before jumping to a random next page
    Hq, Hkv, N, d = 4, 1, 262144, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn((1, Hq, d), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((1, Hkv, N, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    kv_bytes = 2.0 * Hkv * N * d * 2
    base = bench.time_cuda(cr.decode, q, k, v, reps=reps).median_ms
    for bs in (16, 64, 256, 1024):
        kp, vp, tables, lens = bench.device_pages(k, v, seed=0, block_size=bs)
        ms = bench.time_cuda(cr.paged_decode_pools, q, kp, vp, tables, lens, reps=reps).median_ms
        row = dict(shape=f"B1 Hq{Hq} Hkv{Hkv} N{N} d{d} bf16", runner=f"paged, block_size {bs}", ms=round(ms, 5),
                   tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3), vs_contiguous=round(base / ms, 3),
                   contiguous_ms=round(base, 5))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dict(env=_env(), rows=rows), f, indent=1)
    return rows
