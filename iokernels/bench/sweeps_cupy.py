"""Tuning sweeps of the CuPy kernels: the settings around each default, timed side by side.

The sweeps are data (:data:`PREFILL_ROWS`, :data:`DECODE_ROWS`, :data:`PAGE_SIZES`); each
row is a label and the config keyword arguments of one version.  Every time comes from
:func:`iokernels.bench.time_cuda` through the public launchers (what a caller gets),
next to torch's SDPA timed in the same run; paged pools come from
:func:`iokernels.bench.device_pages` (a shuffled block table).  One JSON line a row.

    python -m iokernels.bench.sweeps_cupy prefill|decode|paged_layout [out.json]
    python -m iokernels.bench.sweeps_cupy decode [out.json] --shapes serving --only v3,v4
    python -m iokernels.bench.sweeps_cupy decode [out.json] --shapes short --only v4,v6 --splits 1,2,3,4,6,8
    python -m iokernels.bench.sweeps_cupy decode [out.json] --shapes small_batch --only v4,v8 --splits 1,3,8,16,32
    python -m iokernels.bench.sweeps_cupy decode [out.json] --shapes small_batch --only v8 --splits 8,32,128 \
        --combine serial,parallel

(a GPU with CuPy and torch).  ``scripts/gpu_sweep.py`` runs the decode sweep.
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np

#: forward tile rows per dtype: (label, ForwardConfig keyword arguments)
PREFILL_ROWS = {
    "float32": (("v1 64x64", dict(version="v1", block_q=64, block_k=64)),
                ("v1 64x32", dict(version="v1", block_q=64, block_k=32)),
                ("v1 32x64", dict(version="v1", block_q=32, block_k=64)),
                ("v1b 64x64", dict(version="v1b", block_q=64, block_k=64)),
                ("v1b 64x32", dict(version="v1b", block_q=64, block_k=32)),
                ("v1b 32x64", dict(version="v1b", block_q=32, block_k=64))),
    "bfloat16": (("v2 4w bk64", dict(version="v2", num_warps=4, block_k=64)),
                 ("v2 8w bk64", dict(version="v2", num_warps=8, block_k=64)),
                 ("v2 4w bk32", dict(version="v2", num_warps=4, block_k=32)),
                 ("v2 8w bk32", dict(version="v2", num_warps=8, block_k=32))),
    "float16": (("v2 4w bk64", dict(version="v2", num_warps=4, block_k=64)),
                ("v2 8w bk64", dict(version="v2", num_warps=8, block_k=64))),
}
PREFILL_SHAPE = dict(batch=8, heads=16, seqlen=4096, head_dim=128)

#: decode rows around the default (v3, 8 warps x 4 stages): (label, DecodeConfig keyword
#: arguments, num_splits or None for the heuristic).  SRAM a block at bf16 d=128 (4 KB a
#: stage a warp): 4 warps x 3 stages 48 KB, 8 warps x 4 stages 128 KB.
DECODE_ROWS = (
    ("v1", dict(version="v1"), None),
    ("v1 unroll=2 min_blocks=4", dict(version="v1", unroll=2, min_blocks=4), None),
    ("v1 unroll=8 min_blocks=2", dict(version="v1", unroll=8, min_blocks=2), None),
    ("v2", dict(version="v2"), None),
    ("v2 x 2", dict(version="v2", stages=2), None),
    ("v2 x 4", dict(version="v2", stages=4), None),
    ("v3 4w x 3", dict(version="v3", num_warps=4, stages=3), None),
    ("v3", dict(version="v3"), None),
    ("v3 S=24", dict(version="v3"), 24),
    ("v3 S=32", dict(version="v3"), 32),
    ("v3 8w x 5", dict(version="v3", stages=5), None),
    ("v3 8w x 6", dict(version="v3", stages=6), None),
    ("v3 8w x 3 tile=16", dict(version="v3", stages=3, tile_rows=16), None),
    ("v3 8w x 4 unfused", dict(version="v3", fused=False), None),
    # v4 (tensor cores): swizzled 256-byte rows at bf16 d=128, so a 16-row stage of K and V is
    # 8 KB a warp: 4 warps x 2 stages 64 KB, 4 x 3 96 KB, 4 x 4 128 KB, 8 x 3 192 KB (4-warp
    # blocks: two an SM, by their registers).  The default copies a contiguous cache through L1
    # on sm_90 (.ca) and picks 4-warp blocks of 2 stages when the batch's pairs give every SM
    # one (policy.decode_v4_block); the rows after it take each of those away
    ("v4", dict(version="v4"), None),
    ("v4 .cg", dict(version="v4", load_l1=False), None),
    ("v4 8w", dict(version="v4", num_warps=8), None),
    ("v4 .ca 8w x 2", dict(version="v4", num_warps=8, stages=2, load_l1=True), None),
    ("v4 4w x 2", dict(version="v4", num_warps=4, stages=2), None),
    ("v4 4w x 3", dict(version="v4", num_warps=4, stages=3), None),
    ("v4 4w x 4", dict(version="v4", num_warps=4, stages=4), None),
    ("v4 8w x 2", dict(version="v4", num_warps=8, stages=2), None),
    ("v4 4w x 2 tile=32", dict(version="v4", num_warps=4, stages=2, tile_rows=32), None),
    ("v4 4w x 3 tile=32", dict(version="v4", num_warps=4, stages=3, tile_rows=32), None),
    ("v4 S=32", dict(version="v4"), 32),
    ("v4 unfused", dict(version="v4", fused=False), None),
)
#: v4's load experiments (iokernels.bench.decode_loads, kernels/decode_v4_loads.cu): (label,
#: load path); "same" is decode_v4.cu's own path compiled from that file, so a row's ratio to
#: it is the experiment's alone
DECODE_LOAD_ROWS = (
    ("v4 loads: same", "same"),
    ("v4 loads: bulk copies", "bulk"),          # sm_90: the copy engine, one row a copy
    ("v4 loads: padded rows", "padded"),        # d + 8 rows where v4 swizzles
)
DECODE_SHAPE = dict(batch=1, heads_q=32, heads_kv=8, seqlen=32768, head_dim=128)
#: the serving shapes the decode kernels are held to cuDNN's at: GQA 32/8, d=128,
#: B in (1, 8, 64) x N in (4096, 32768)
SERVING_SHAPES = tuple(dict(batch=B, heads_q=32, heads_kv=8, seqlen=N, head_dim=128)
                       for B in (1, 8, 64) for N in (4096, 32768))
#: the cliff section's decode shapes between the serving grid's points where the default fell
#: short of the best SDPA kernel (batch 17, short caches, groups of 1 to 16 query heads a KV head)
SHORT_CACHE_SHAPES = tuple(dict(batch=17, heads_q=hq, heads_kv=8, seqlen=n, head_dim=128)
                           for hq, n in ((8, 1000), (32, 1000), (8, 4096), (32, 4096), (64, 4096), (128, 4096)))
#: the cliff section's decode shapes of one to three sequences where the default fell furthest behind
#: (large groups: few (b, kv head) pairs, so the split count decides how many SMs work)
SMALL_BATCH_SHAPES = tuple(dict(batch=b, heads_q=hq, heads_kv=hkv, seqlen=n, head_dim=128)
                           for b, hq, hkv, n in ((1, 64, 1, 1000), (1, 64, 1, 4096), (1, 64, 1, 50000),
                                                 (3, 64, 1, 1000), (1, 256, 8, 1000), (1, 256, 8, 4096),
                                                 (3, 256, 8, 4096), (1, 16, 1, 4096)))
#: batch 17's decode at four cache lengths a group (1024 to 4096 keys, and 256), so a line
#: t = a + b * N through each kernel's times splits a launch's fixed cost (a) from its streaming
#: rate (b): which of the two the short-cache gap to cuDNN is
SHORT_LINE_SHAPES = tuple(dict(batch=17, heads_q=hq, heads_kv=8, seqlen=n, head_dim=128)
                          for hq in (32, 128) for n in (256, 1024, 2048, 4096))
#: the cliff section's decode shapes at 16 query heads a KV head (128 / 8, d=128), where decode v4
#: (one 16-row mma.sync operand, the default up to g = 16) fell short of cuDNN and v8 (one
#: warpgroup's 64-row wgmma tile, the Hopper default past 16) may not: batches 1 to 128 over
#: 1000 and 4096 keys, and batches 1, 3 and 17 over 50000 (a shorter sweep; the larger batches at
#: that length are the cliff section's to time)
G16_SHAPES = tuple(dict(batch=b, heads_q=128, heads_kv=8, seqlen=n, head_dim=128)
                   for n, batches in ((1000, (1, 3, 17, 64, 128)), (4096, (1, 3, 17, 64, 128)), (50000, (1, 3, 17)))
                   for b in batches)
#: decode v4's block shape away from head_dim 128: batches that give every SM a (b, kv head)
#: pair (17, 64), where the default takes 4-warp blocks of 2 stages, at head_dim 64 (where a
#: stage is half the bytes), groups of 4 and 16, over 1024 and 4096 keys
D64_SHAPES = tuple(dict(batch=b, heads_q=hq, heads_kv=8, seqlen=n, head_dim=64)
                   for b in (17, 64) for hq in (32, 128) for n in (1024, 4096))
#: the shape sets ``--shapes`` names
DECODE_SHAPE_SETS = {"default": (DECODE_SHAPE,), "serving": SERVING_SHAPES, "short": SHORT_CACHE_SHAPES,
                     "small_batch": SMALL_BATCH_SHAPES, "short_lines": SHORT_LINE_SHAPES, "g16": G16_SHAPES,
                     "d64": D64_SHAPES}
#: paged_layout: rows a page (runs of block_size * 256 bytes between random jumps, MQA)
PAGE_SIZES = (16, 64, 256, 1024)
#: paged_layout: the GQA and the MQA shape, (heads_q, heads_kv, seqlen), K+V the same bytes
LAYOUT_SHAPES = ((32, 8, 32768), (4, 1, 262144))
#: paged_serving: (batch, seqlen) of the serving shapes (fp16, GQA 32/8, d=128) and the page
#: sizes tried there, each with the blocks scattered and in order
PAGED_SERVING_SHAPES = ((8, 32768), (64, 32768), (64, 4096))
SERVING_PAGE_SIZES = (16, 64, 256)
REPS = 30


def prefill_cases(dtype: str) -> list:
    """(label, ForwardConfig) of the prefill sweep for ``dtype``; builds without a GPU."""
    from iokernels.cupy_raw import ForwardConfig
    return [(label, ForwardConfig(**kw)) for label, kw in PREFILL_ROWS[dtype]]


def decode_cases(only=None, splits=None, combines=None) -> list:
    """(label, DecodeConfig, num_splits) of the decode sweep; builds without a GPU.
    ``only``: version names ("v3", "v4", ...) to keep, None for every row.  ``splits``: split
    counts to time each kept version's default config at (its own row first, the split
    policy's pick), instead of the tuning rows; ``combines`` (with ``splits``): each of those
    rows once a separate combine kernel ("serial", "parallel": DecodeConfig.combine; a launch
    that fuses the combine runs neither)."""
    from iokernels.cupy_raw import DecodeConfig
    from iokernels.cupy_raw.decode_config import DECODE_MAX_SPLITS
    if splits is not None:
        versions = only or ("v4",)
        return [(f"{v}" + (f" {c}" if c else "") + (f" S={s}" if s else ""), DecodeConfig(version=v, combine=c),
                 s and min(s, DECODE_MAX_SPLITS))
                for v in versions for c in (combines or (None,)) for s in (None, *splits)]
    return [(label, DecodeConfig(**kw), None if s is None else min(s, DECODE_MAX_SPLITS))
            for label, kw, s in DECODE_ROWS if only is None or kw["version"] in only]


def _emit(rows, row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def _save(out_path, rows):
    from iokernels import bench
    result = dict(env=bench.environment(), rows=rows)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _visible_pairs(nq, nk, causal):
    from iokernels.core import conventions as cv
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal, None)
    return int(np.sum(hi - lo))


def sweep_prefill(out_path=None, reps=REPS):
    """Forward tile shapes of v1, v1b (float32) and v2 (16-bit) next to SDPA's kernels."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    from iokernels import cupy_raw as cr
    B, H, N, d = (PREFILL_SHAPE[k] for k in ("batch", "heads", "seqlen", "head_dim"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in PREFILL_ROWS:
        tdt = getattr(torch, dtype)
        q, k, v = (torch.randn((B, H, N, d), device="cuda", dtype=tdt, generator=gen) for _ in range(3))
        for causal in (False, True):
            flops = 4.0 * B * H * _visible_pairs(N, N, causal) * d
            group = f"fwd {dtype} B={B} H={H} N={N} d={d} causal={causal}"
            base_name = "EFFICIENT" if dtype == "float32" else "FLASH"
            backend = getattr(SDPBackend, "EFFICIENT_ATTENTION" if dtype == "float32" else "FLASH_ATTENTION")

            def sdpa():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ref = sdpa()
            base_ms = bench.time_cuda(sdpa, reps=reps).median_ms
            _emit(rows, dict(group=group, runner=f"sdpa {base_name}", ms=round(base_ms, 5),
                             tflops=round(flops / (base_ms * 1e-3) / 1e12, 2)))
            for label, cfg in prefill_cases(dtype):
                try:
                    o, _ = cr.attention(q, k, v, causal=causal, scale=1 / math.sqrt(d), config=cfg)
                    err = float((o.float() - ref.float()).abs().max())
                    ms = bench.time_cuda(cr.attention, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                         config=cfg, reps=reps).median_ms
                    _emit(rows, dict(group=group, runner=f"cupy {label}", ms=round(ms, 5),
                                     tflops=round(flops / (ms * 1e-3) / 1e12, 2),
                                     **{f"ratio_to_{base_name}": round(base_ms / ms, 3)},
                                     max_abs_diff_vs_sdpa=err))
                except Exception as e:                 # a config that does not fit: say so, go on
                    print(f"# {group} cupy {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        q = k = v = None                # drop the tensors (sdpa() above closes over them)
        bench.release_device_cache()
    return _save(out_path, rows)


def sweep_decode(out_path=None, reps=REPS, shapes=(DECODE_SHAPE,), only=None, splits=None, combines=None):
    """Decode settings at bf16 GQA 32/8 d=128 (``shapes``: DECODE_SHAPE, or e.g. SERVING_SHAPES),
    contiguous and paged, next to cuDNN's and FLASH's SDPA (enable_gqa).  Paged rows also give
    their ratio to the same row contiguous.  ``only``: the versions to time (None: every row);
    ``splits``, ``combines``: split counts and combine kernels (see :func:`decode_cases`)."""
    from iokernels import bench

    rows = []
    for shape in shapes:
        _sweep_decode_shape(rows, shape, reps, only, splits, combines)
        bench.release_device_cache()
    return _save(out_path, rows)


def decode_inputs(shape: dict, dtype: str) -> tuple:
    """Seeded decode inputs on the GPU: (q (B, Hq, d), k, v (B, Hkv, N, d), q as SDPA's one-row
    (B, Hq, 1, d), the bytes of K and V, the rows' group label)."""
    import torch
    B, Hq, Hkv, N, d = (shape[k] for k in ("batch", "heads_q", "heads_kv", "seqlen", "head_dim"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, dtype)
    q = torch.randn((B, Hq, d), device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn((B, Hkv, N, d), device="cuda", dtype=dt, generator=gen) for _ in range(2))
    kv_bytes = 2.0 * B * Hkv * N * d * q.element_size()
    return q, k, v, q[:, :, None, :], kv_bytes, f"decode {dtype} B={B} Hq={Hq} Hkv={Hkv} N={N} d={d}"


def _sweep_decode_shape(rows, shape, reps, only, split_counts=None, combines=None):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    from iokernels import cupy_raw as cr
    q, k, v, q4, kv_bytes, group = decode_inputs(shape, "bfloat16")

    def sdpa(backend=SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    ref = sdpa()[:, :, 0].float()
    cudnn_ms = bench.time_cuda(sdpa, reps=reps).median_ms
    _emit(rows, dict(group=group, runner="sdpa CUDNN", ms=round(cudnn_ms, 5),
                     tbps=round(kv_bytes / (cudnn_ms * 1e-3) / 1e12, 3)))
    try:
        flash_ms = bench.time_cuda(sdpa, SDPBackend.FLASH_ATTENTION, reps=reps).median_ms
        _emit(rows, dict(group=group, runner="sdpa FLASH", ms=round(flash_ms, 5),
                         tbps=round(kv_bytes / (flash_ms * 1e-3) / 1e12, 3),
                         ratio_to_cudnn=round(cudnn_ms / flash_ms, 3)))
    except RuntimeError as e:                          # FLASH refuses some shapes: say so, go on
        print(f"# {group} sdpa FLASH: {str(e).splitlines()[0][:160]}", flush=True)
    try:
        pools = bench.device_pages(k, v, seed=0)
    except bench.Unavailable as e:                     # N not whole pages: contiguous rows only
        print(f"# {group} paged: {e}", flush=True)
        pools = None
    contiguous = {}
    for label, cfg, splits in decode_cases(only, split_counts, combines):
        for paged in (False, True) if pools else (False,):
            name = f"cupy {label}" + (" paged" if paged else "")
            fn, args = (cr.paged_decode_pools, (q, *pools)) if paged else (cr.decode, (q, k, v))
            try:
                o, _ = fn(*args, num_splits=splits, config=cfg)
                err = float((o.float() - ref).abs().max())
                ms = bench.time_cuda(fn, *args, num_splits=splits, config=cfg, reps=reps).median_ms
                row = dict(group=group, runner=name, ms=round(ms, 5), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3),
                           ratio_to_cudnn=round(cudnn_ms / ms, 3), max_abs_diff_vs_sdpa=err, config=repr(cfg),
                           num_splits=splits or "heuristic")
                if paged and label in contiguous:
                    row["ratio_to_contiguous"] = round(contiguous[label] / ms, 3)
                if not paged:
                    contiguous[label] = ms
                _emit(rows, row)
            except Exception as e:                     # a config that does not fit: say so, go on
                print(f"# {group} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    if pools and (only is None or "v4" in only):
        _sweep_decode_loads(rows, group, (q, k, v), (q, *pools), ref, cudnn_ms, kv_bytes, reps)


def _sweep_decode_loads(rows, group, contiguous_args, paged_args, ref, cudnn_ms, kv_bytes, reps):
    """The rows of DECODE_LOAD_ROWS, contiguous and paged, as _sweep_decode_shape's."""
    from iokernels import bench
    from iokernels.bench import decode_loads as dl
    for label, load in DECODE_LOAD_ROWS:
        for paged in (False, True):
            name = f"cupy {label}" + (" paged" if paged else "")
            fn, args = (dl.paged_decode_pools, paged_args) if paged else (dl.decode, contiguous_args)
            try:
                o, _ = fn(*args, load)
                err = float((o.float() - ref).abs().max())
                ms = bench.time_cuda(fn, *args, load, reps=reps).median_ms
                tbps = round(kv_bytes / (ms * 1e-3) / 1e12, 3)
                _emit(rows, dict(group=group, runner=name, ms=round(ms, 5), tbps=tbps,
                                 ratio_to_cudnn=round(cudnn_ms / ms, 3), max_abs_diff_vs_sdpa=err, load=load))
            except Exception as e:                     # bulk copies off sm_90, say: say so, go on
                print(f"# {group} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def paged_layout_probe(out_path=None, reps=REPS):
    """Paged against contiguous decode (bf16, B=1, the default kernel) over three layouts of
    the same K/V bytes -- the pool as (blocks, slots, Hkv, d), the same pool stored
    heads-outer and passed as a strided view, and MQA where the two coincide -- then MQA
    with pages of PAGE_SIZES rows.  One JSON line a row."""
    import torch

    from iokernels import bench
    from iokernels import cupy_raw as cr
    rows = []
    for Hq, Hkv, N in LAYOUT_SHAPES:
        d = 128
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
        shape = f"B1 Hq{Hq} Hkv{Hkv} N{N} d{d} bf16"
        for name, (fn, args) in runs.items():
            try:
                o, _ = fn(*args)
                err = float((o.float() - ref.float()).abs().max())
                ms = bench.time_cuda(fn, *args, reps=reps).median_ms
                base = base or ms
                row = dict(shape=shape, runner=name, ms=round(ms, 5), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3),
                           vs_contiguous=round(base / ms, 3), max_diff_vs_contiguous=err)
            except Exception as e:
                row = dict(shape=shape, runner=name, error=f"{type(e).__name__}: {e}"[:200])
            _emit(rows, row)
    Hq, Hkv, N = LAYOUT_SHAPES[-1]
    d = 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn((1, Hq, d), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((1, Hkv, N, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    kv_bytes = 2.0 * Hkv * N * d * 2
    base = bench.time_cuda(cr.decode, q, k, v, reps=reps).median_ms
    for bs in PAGE_SIZES:
        kp, vp, tables, lens = bench.device_pages(k, v, seed=0, block_size=bs)
        ms = bench.time_cuda(cr.paged_decode_pools, q, kp, vp, tables, lens, reps=reps).median_ms
        _emit(rows, dict(shape=f"B1 Hq{Hq} Hkv{Hkv} N{N} d{d} bf16", runner=f"paged, block_size {bs}",
                         ms=round(ms, 5), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3),
                         vs_contiguous=round(base / ms, 3), contiguous_ms=round(base, 5)))
    return _save(out_path, rows)


def paged_serving_probe(out_path=None, reps=REPS, versions=None):
    """Paged against contiguous decode at serving shapes (fp16, GQA 32/8, d=128, PAGED_SERVING_SHAPES),
    for each registered CuPy decode version (or ``versions``): pages of SERVING_PAGE_SIZES rows,
    the blocks scattered (a random permutation, as in a busy server) and in order.  In-order
    pages at contiguous speed put the gap on the page jumps (DRAM pages, TLB reach);
    in-order pages slower than contiguous put it on the block-table path.  One JSON line a row."""
    import torch

    from iokernels import bench
    from iokernels import cupy_raw as cr
    rows = []
    versions = versions or [k.version for k in cr.REGISTRY.kernels("paged_decode")]
    Hq, Hkv, d = 32, 8, 128
    for B, N in PAGED_SERVING_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn((B, Hq, d), device="cuda", dtype=torch.float16, generator=gen)
        k, v = (torch.randn((B, Hkv, N, d), device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        kv_bytes = 2.0 * B * Hkv * N * d * 2
        shape = f"B{B} Hq{Hq} Hkv{Hkv} N{N} d{d} fp16"
        for version in versions:
            cfg = cr.DecodeConfig(version=version)
            try:
                base = bench.time_cuda(cr.decode, q, k, v, config=cfg, reps=reps).median_ms
            except Exception as e:
                _emit(rows, dict(shape=shape, runner=f"{version} contiguous", error=f"{type(e).__name__}: {e}"[:200]))
                continue
            _emit(rows, dict(shape=shape, runner=f"{version} contiguous", ms=round(base, 5),
                             tbps=round(kv_bytes / (base * 1e-3) / 1e12, 3)))
            for bs in SERVING_PAGE_SIZES:
                for scattered in (True, False):
                    kp, vp, tables, lens = bench.device_pages(k, v, seed=0, block_size=bs, scattered=scattered)
                    ms = bench.time_cuda(cr.paged_decode_pools, q, kp, vp, tables, lens, config=cfg,
                                         reps=reps).median_ms
                    order = "scattered" if scattered else "in order"
                    _emit(rows, dict(shape=shape, runner=f"{version} paged {bs} {order}",
                                     ms=round(ms, 5), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3),
                                     vs_contiguous=round(base / ms, 3)))
                    del kp, vp
        del q, k, v
        bench.release_device_cache()
    return _save(out_path, rows)


SWEEPS = {"prefill": sweep_prefill, "decode": sweep_decode, "paged_layout": paged_layout_probe,
          "paged_serving": paged_serving_probe}


def parse_args(argv) -> tuple:
    """(sweep name, out path or None, keyword arguments) of a command line; None when it is wrong.
    ``--shapes default|serving|short|small_batch``, ``--only v3,v4``, ``--splits 1,2,4`` and (with
    ``--splits``) ``--combine serial,parallel`` are the decode sweep's options."""
    from iokernels.cupy_raw.policy import DECODE_COMBINES
    if not argv or argv[0] not in SWEEPS:
        return None
    name, rest, kw, out = argv[0], list(argv[1:]), {}, None
    while rest:
        a = rest.pop(0)
        if a in ("--shapes", "--only", "--splits", "--combine") and rest and name == "decode":
            val = rest.pop(0)
            if a == "--shapes":
                if val not in DECODE_SHAPE_SETS:
                    return None
                kw["shapes"] = DECODE_SHAPE_SETS[val]
            elif a == "--splits":
                if not all(x.isdigit() and int(x) > 0 for x in val.split(",")):
                    return None
                kw["splits"] = tuple(int(x) for x in val.split(","))
            elif a == "--combine":
                if not set(val.split(",")) <= set(DECODE_COMBINES):
                    return None
                kw["combines"] = tuple(val.split(","))
            else:
                kw["only"] = tuple(val.split(","))
        elif out is None and not a.startswith("--"):
            out = a
        else:
            return None
    if "combines" in kw and "splits" not in kw:
        return None
    return name, out, kw


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parsed = parse_args(argv)
    if parsed is None:
        print(f"usage: python -m iokernels.bench.sweeps_cupy {'|'.join(SWEEPS)} [out.json] "
              f"[decode: --shapes {'|'.join(DECODE_SHAPE_SETS)}] [--only v3,v4] [--splits 1,2,4] "
              f"[--combine serial,parallel]")
        return 2
    name, out, kw = parsed
    SWEEPS[name](out, **kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
