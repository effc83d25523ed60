"""Tuning sweeps of the Numba kernels, declared as data: named configs and the shapes they
run at, each next to its torch baseline in the same run.

A sweep is a :class:`Sweep`: its shapes (the real one for the GPU, a tiny one for the
simulator) and its rows, each a (name, op, config, num_splits) tuple.  The rows are the
registered versions at their defaults plus the tilings that are tuning points of one
version (v3's 8-key groups, v2's 32 lanes a key, ...): a tiling that wins here becomes that
version's default, it does not become a version.  :func:`run_sweep` times every row with
:func:`iokernels.bench.time_cuda` (CUDA events, L2 flushed) and prints one JSON line a row;
with ``tiny=True`` it runs each row once on NumPy arrays against the float64 oracle (no
timing, no torch): what the simulator test runs.

    python scripts/gpu_sweep.py OUTDIR numba_fwd numba_decode
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sweep:
    """Rows (name, op, config keyword arguments, num_splits) at one shape."""

    name: str
    shape: dict          # the GPU shape
    tiny: dict           # the simulator's
    dtype: str
    rows: tuple


def _fwd(version, **kw):
    return ("attention", dict(version=version, **kw), None)


def _dec(op, version, splits=None, **kw):
    return (op, dict(version=version, **kw), splits)


#: forward float32, B=8 H=16 N=4096 d=128, non-causal, against SDPA EFFICIENT (FLASH and cuDNN
#: have no float32 kernel)
FORWARD = Sweep("forward", dict(B=8, H=16, N=4096, d=128), dict(B=1, H=1, N=24, d=8), "float32", (
    ("numba v1", *_fwd("v1")),
    ("numba v2", *_fwd("v2")),
    ("numba v3", *_fwd("v3")),
    ("numba v3 batched lane sums", *_fwd("v3", batched_lane_sums=True)),
    ("numba v3 L8 R2", *_fwd("v3", threads_per_row=8, rows_per_thread=2)),
    ("numba v3 Bc16", *_fwd("v3", block_k=16)),
    ("numba v4", *_fwd("v4")),
    ("numba v4 Bc64", *_fwd("v4", block_k=64)),
    ("numba v5", *_fwd("v5")),
    ("numba v5 Br32 Bc32", *_fwd("v5", block_q=32, block_k=32)),
    ("numba v5 Br64 Bc16", *_fwd("v5", block_q=64, block_k=16)),
    ("numba v5 TM2", *_fwd("v5", rows_per_thread=2)),
    ("numba v6", *_fwd("v6")),
    ("numba v6 Br32 Bc32", *_fwd("v6", block_q=32, block_k=32)),
    ("numba v6 Br64 Bc16", *_fwd("v6", block_q=64, block_k=16)),
    ("numba v6 TM2", *_fwd("v6", rows_per_thread=2)),
    ("numba v7", *_fwd("v7")),
    ("numba v7 Br64 Bc16", *_fwd("v7", block_q=64, block_k=16)),
))

#: decode float16, GQA 32/8, d=128, B=1, N=32768 (contiguous, and paged with a random block
#: table of block size 16) against the best of cuDNN / FLASH SDPA; gather of a 131072-token
#: sequence of one (Hkv=8, d=128, bs=16) pool against a torch copy of the same bytes
DECODE_GATHER = Sweep("decode_gather", dict(B=1, Hq=32, Hkv=8, N=32768, d=128, NG=131072, Hg=8),
                      dict(B=1, Hq=2, Hkv=1, N=32, d=8, NG=32, Hg=1), "float16", (
    ("numba v1 S=None", *_dec("decode", "v1")),
    ("numba v2 S=None", *_dec("decode", "v2")),
    ("numba v2-L32K8 S=None", *_dec("decode", "v2", lanes_per_key=32, keys_per_iter=8)),
    ("numba v3 S=None", *_dec("decode", "v3")),
    ("numba v3 S=32", *_dec("decode", "v3", 32)),
    ("numba v3 S=64", *_dec("decode", "v3", 64)),
    ("numba v3 S=128", *_dec("decode", "v3", 128)),
    ("numba v3-K8G4 S=None", *_dec("decode", "v3", keys_per_iter=8, key_groups=4)),
    ("numba v3-K8G4 S=32", *_dec("decode", "v3", 32, keys_per_iter=8, key_groups=4)),
    ("numba v4 S=None", *_dec("decode", "v4")),
    ("numba v4 S=32", *_dec("decode", "v4", 32)),
    ("numba v4 S=64", *_dec("decode", "v4", 64)),
    ("numba v4-K2G16 S=None", *_dec("decode", "v4", keys_per_iter=2, key_groups=16)),
    ("numba v4-K8G4 S=None", *_dec("decode", "v4", keys_per_iter=8, key_groups=4)),
    ("numba v4-G16 S=None", *_dec("decode", "v4", key_groups=16)),
    ("numba v4 paged S=None", *_dec("paged_decode", "v4")),
    ("numba v3 paged S=None", *_dec("paged_decode", "v3")),
    ("numba v3 paged S=32", *_dec("paged_decode", "v3", 32)),
    ("numba v3 paged key addressing S=None", *_dec("paged_decode", "v3", paged_addressing="key")),
    ("numba v3-K8G4 paged S=None", *_dec("paged_decode", "v3", keys_per_iter=8, key_groups=4)),
    ("numba gather v1", "paged_gather", dict(version="v1"), None),
    ("numba gather v1 elements", "paged_gather", dict(version="v1", words=False), None),
    ("numba gather v3", "paged_gather", dict(version="v3"), None),
    ("numba gather v3-U16", "paged_gather", dict(version="v3", unroll=16), None),
))

SWEEPS = {s.name: s for s in (FORWARD, DECODE_GATHER)}
#: slices of a tiny sweep: few splits for a few keys
TINY_MAX_SPLITS = 3


def _time(fn, reps, warmup=2):
    from . import time_cuda
    t = time_cuda(fn, reps=reps, warmup=warmup)
    return {"ms": round(t.median_ms, 4), "p10": round(t.p10, 4), "p90": round(t.p90, 4)}


def _sdpa(q, k, v, backend, enable_gqa=False):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def numpy_pages(k, v, seed, block_size):
    """:func:`iokernels.bench.device_pages` for NumPy arrays: the same random block permutation."""
    B, Hkv, N, d = k.shape
    nblk = N // block_size
    tables = np.random.default_rng(seed).permutation(B * nblk).astype(np.int32).reshape(B, nblk)
    kp = np.empty((B * nblk, block_size, Hkv, d), k.dtype)
    vp = np.empty_like(kp)
    for b in range(B):
        kp[tables[b]] = k[b].transpose(1, 0, 2).reshape(nblk, block_size, Hkv, d)
        vp[tables[b]] = v[b].transpose(1, 0, 2).reshape(nblk, block_size, Hkv, d)
    return kp, vp, tables, np.full(B, N, dtype=np.int32)


def _inputs(sweep, tiny, seed=0):
    """{name: array} for the sweep (NumPy when tiny, torch CUDA otherwise) and the references."""
    from .specs import PAGED_BLOCK
    s = sweep.tiny if tiny else sweep.shape
    if tiny:
        rng = np.random.default_rng(seed)

        def randn(shape):
            return rng.standard_normal(shape).astype(sweep.dtype)
    else:
        import torch
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def randn(shape):
            return torch.randn(shape, device="cuda", dtype=getattr(torch, sweep.dtype), generator=gen)
    if sweep is FORWARD:
        return {name: randn((s["B"], s["H"], s["N"], s["d"])) for name in "qkv"}
    x = {"q": randn((s["B"], s["Hq"], s["d"])), "k": randn((s["B"], s["Hkv"], s["N"], s["d"])),
         "v": randn((s["B"], s["Hkv"], s["N"], s["d"])), "kg": randn((1, s["Hg"], s["NG"], s["d"])),
         "vg": randn((1, s["Hg"], s["NG"], s["d"]))}
    if tiny:
        x["pages"] = numpy_pages(x["k"], x["v"], 1, PAGED_BLOCK)
        x["gpages"] = numpy_pages(x["kg"], x["vg"], 2, PAGED_BLOCK)
    else:
        from . import device_pages
        x["pages"] = device_pages(x["k"], x["v"], seed=1)
        x["gpages"] = device_pages(x["kg"], x["vg"], seed=2)
    return x


def _call(op, cfg_kw, splits, x):
    """The row's call: the public Numba functions with the row's config."""
    import iokernels.numba_cuda as nc
    kw = dict(cfg_kw)
    version, words = kw.pop("version"), kw.pop("words", True)
    if op == "attention":
        cfg = nc.ForwardConfig(version=version, **kw)
        return lambda: nc.attention(x["q"], x["k"], x["v"], config=cfg)
    if op == "paged_gather":
        cfg = nc.GatherConfig(version=version, **kw)
        kp, vp, tables, lens = x["gpages"]
        return lambda: nc.gather_pools(kp, vp, tables[0], int(lens[0]), words=words, config=cfg)
    cfg = nc.DecodeConfig(version=version, **kw)
    if op == "decode":
        return lambda: nc.decode(x["q"], x["k"], x["v"], num_splits=splits, config=cfg)
    kp, vp, tables, lens = x["pages"]
    return lambda: nc.paged_decode_pools(x["q"], kp, vp, tables, lens, num_splits=splits, config=cfg)


def run_sweep(name, *, tiny=False, out_path=None, reps=20, seed=0):
    """Run the sweep ``name`` (a key of :data:`SWEEPS`); returns its rows (dicts), one JSON line
    printed per row, all written to ``out_path`` (one JSON line a row) when given."""
    from ..core import reference
    sweep = SWEEPS[name]
    x = _inputs(sweep, tiny, seed)
    s = sweep.tiny if tiny else sweep.shape
    rows, t_start = [], time.time()

    def emit(row):
        row["t_s"] = round(time.time() - t_start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if sweep is FORWARD:
        work, unit = 4.0 * s["B"] * s["H"] * s["N"] ** 2 * s["d"], "tflops"
        refs = {"attention": reference.attention(x["q"], x["k"], x["v"])[0] if tiny else None}
        baselines = {} if tiny else {
            "sdpa EFFICIENT_ATTENTION": lambda: _sdpa(x["q"], x["k"], x["v"], "EFFICIENT_ATTENTION")}
    else:
        itemsize = np.dtype(sweep.dtype).itemsize
        work = {"decode": 2.0 * s["B"] * s["Hkv"] * s["N"] * s["d"] * itemsize,
                "paged_gather": 2 * 2.0 * s["Hg"] * s["NG"] * s["d"] * itemsize}
        unit = "TBps"
        if tiny:
            ref = reference.decode(x["q"], x["k"], x["v"])[0]
            refs = {"decode": ref, "paged_decode": ref, "paged_gather": x["kg"][0].astype(np.float64)}
            baselines = {}
        else:
            q4 = x["q"][:, :, None, :]
            refs = {}
            baselines = {f"sdpa {be}": (lambda be=be: _sdpa(q4, x["k"], x["v"], be, enable_gqa=True))
                         for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION")}
            dst = [None, None]

            def copy():
                dst[0] = x["kg"][0].clone()
                dst[1] = x["vg"][0].clone()
            baselines["device copy (torch)"] = copy
    base_ms = {}
    for bname, fn in baselines.items():
        row = {"section": sweep.name, "name": bname}
        try:
            row.update(_time(fn, reps))
            base_ms[bname] = row["ms"]
        except Exception as e:  # a baseline the GPU lacks is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        emit(row)
    if not tiny and sweep is not FORWARD:
        be = "sdpa CUDNN_ATTENTION" if "sdpa CUDNN_ATTENTION" in base_ms else "sdpa FLASH_ATTENTION"
        out = baselines[be]()
        refs = {"decode": out[:, :, 0, :], "paged_decode": out[:, :, 0, :], "paged_gather": x["kg"][0]}
    for rname, op, cfg_kw, splits in sweep.rows:
        if tiny and splits is not None:
            splits = min(splits, TINY_MAX_SPLITS)
        row = {"section": sweep.name, "name": rname}
        try:
            fn = _call(op, cfg_kw, splits, x)
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            ref = refs.get(op)
            if tiny:
                row["max_err"] = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
            else:
                if ref is not None:
                    row["max_err"] = float((out.float() - ref.float()).abs().max())
                row.update(_time(fn, reps))
                w = work if sweep is FORWARD else work["paged_gather" if op == "paged_gather" else "decode"]
                row[unit] = round(w / (row["ms"] * 1e-3) / 1e12, 3)
                base = (base_ms.get("sdpa EFFICIENT_ATTENTION") if sweep is FORWARD else
                        base_ms.get("device copy (torch)") if op == "paged_gather" else
                        min((v for k, v in base_ms.items() if k.startswith("sdpa")), default=None))
                if base:
                    row["speed_vs_baseline"] = round(base / row["ms"], 3)
        except Exception as e:  # a config that does not fit is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        emit(row)
    if out_path:
        with open(out_path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows
