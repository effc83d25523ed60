"""Measured DRAM traffic (Nsight Compute) next to the traffic model's prediction.

    python3 scripts/profile_traffic.py all --out DIR      # runs ncu over "run", then "parse"
    python3 scripts/profile_traffic.py run --out DIR      # the process ncu profiles
    python3 scripts/profile_traffic.py parse --out DIR    # DIR/ncu_raw.csv + DIR/plan.json -> DIR/traffic.json
    python3 scripts/profile_traffic.py plan [--only X]    # the cases, in order, with their model: no GPU
    python3 scripts/profile_traffic.py limits --out DIR   # what bounds each kernel that misses a bar
    python3 scripts/profile_traffic.py plan --limits      # the limits profile's cases: no GPU

What is measured: for each kernel family (torch naive attention, SDPA flash, the Numba and
CuPy attention, decode, paged decode and paged gather kernels, every registered version of
the CuPy and Numba backward in both dQ modes, and a plain device copy as a sanity check of
the counters), the profiler's ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` summed
over every kernel the call launched, at a size whose working set fits in the H200's 60 MB
L2 and at one several times larger.  The backward's three kernels (and the fill that zeroes
its dQ accumulator) are also compared one by one with the model's per-kernel bytes
(``iokernels.backward.traffic_model_gpu_kernels``).

Order: the first case of every family, then the second of every family, and so on, so that
when the time box runs out every family has been measured at least once.

How: ncu runs with ``--clock-control none`` (the card's clocks are left alone) and
``--cache-control none`` (ncu does not flush caches between kernels, so a multi-kernel call
like naive attention keeps what it wrote in L2 for the next kernel, as it does in real
use).  Before each case this script flushes L2 itself by *reading* a buffer three times
the L2 size (reading leaves no dirty lines behind to be written back during the case),
then launches a tiny marker kernel ``ik_marker``; the kernels between one marker and the
next flush belong to that case.  Warm-up calls (compilation, autotuning) run before
``cudaProfilerStart``, and ncu is started with ``--profile-from-start off``.

**What bounds a kernel** (``limits``, run by ``all`` after the bytes when its time box allows,
filed in traffic.json under "limits"): where a kernel of ours misses a bar, the question is not
only how many bytes it moves but which unit of the GPU it keeps busy.  Each case of
:func:`_limit_problems` (a kernel of ours and the SDPA kernel its bar names, at the bar's
shape, scaled down where Nsight Compute's replays would take long) is profiled with Nsight
Compute's sections LIMIT_SECTIONS, and :func:`limits_summary` keeps, per kernel: its time, the
SM's and DRAM's throughput as a share of their peak, the share of issue slots busy, the achieved
occupancy, the registers a thread, the busiest pipes (FMA, the XU pipe of exp2 and converts,
the tensor cores, the load/store unit), and the stall reasons that cost the most cycles between
issued instructions.  The numbers are Nsight Compute's (its Profiling Guide defines them: docs);
which one limits a kernel is read off them, in the notes, not decided here.  A section's
metrics take several replays of a kernel, so this run leaves ncu's cache control at its default
(caches flushed before each replay: every pass sees the same cold start).

The model: ``iokernels.core.traffic.model(kind, ...)``, bytes as the algorithm is written,
no caches.  Where they differ, the notes explain why (benchmarks/NOTES.md): L2 reuse of
K/V tiles across thread blocks, S and P staying in L2 between the naive kernels when they
fit, the block table, the split-KV partial results.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from iokernels.core.gpu import numba_numpy_fix  # noqa: E402

numba_numpy_fix()   # before numba is imported

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
#: L2 flush buffer, in multiples of the L2 size (read, not written: see the module notes)
FLUSH_FACTOR = 3


# --------------------------------------------------------------------------- the cases
#: the backward cases of each registered version: (size label, B, H, N, causal, deterministic),
#: in the order they are measured (bf16, d = 128; the first above the L2 size)
BACKWARD_CUPY = (("large", 2, 16, 4096, False, False), ("large causal", 2, 16, 4096, True, False),
                 ("large det", 1, 8, 4096, False, True), ("small", 1, 8, 2048, False, False),
                 ("small det causal", 1, 8, 2048, True, True))
#: the Numba backward runs on CUDA cores in float32: one small size (d = 64), both dQ modes
BACKWARD_NUMBA = (("small", 1, 4, 1024, False, False), ("small det", 1, 4, 1024, False, True))


def _registry(family):
    return importlib.import_module(f"iokernels.{'cupy_raw' if family == 'cupy' else 'numba_cuda'}").REGISTRY


def _backward_problems():
    """One case list per registered backward version (CuPy, Numba), read off the registries,
    so a version registered later is measured too."""
    P = []
    for fam, cases, dtype, d in (("cupy", BACKWARD_CUPY, "bfloat16", 128), ("numba", BACKWARD_NUMBA, "float32", 64)):
        try:
            versions = [kern.version for kern in _registry(fam).kernels("attention_backward")]
        except Exception as e:                          # the backend cannot be imported here
            versions = [f"? ({type(e).__name__})"]
        for version in versions:
            for size, B, H, N, causal, det in cases:
                P.append((f"{fam} backward {version}", fam, size,
                          dict(B=B, H=H, N=N, d=d, dtype=dtype, causal=causal, deterministic=det, version=version)))
    return P


def _in_order(P):
    """The first case of every name, then every name's second case, ... (stable)."""
    seen = {}
    ranked = []
    for i, case in enumerate(P):
        rank = seen.get(case[0], 0)
        seen[case[0]] = rank + 1
        ranked.append((rank, i, case))
    return [case for _, _, case in sorted(ranked, key=lambda x: x[:2])]


def _problems():
    """(name, family, size, builder kwargs) for every case, in measuring order; sizes small
    (fits L2) and large."""
    P = []
    P += [("copy", "torch", "small", dict(nbytes=16 << 20)),
          ("copy", "torch", "large", dict(nbytes=512 << 20))]
    P += [("naive attention", "torch", "small", dict(B=1, H=2, N=1024, d=64, dtype="float16")),
          ("naive attention", "torch", "large", dict(B=1, H=16, N=4096, d=64, dtype="float16"))]
    P += [("sdpa flash", "torch", "small", dict(B=1, H=4, N=2048, d=128, dtype="bfloat16")),
          ("sdpa flash", "torch", "large", dict(B=4, H=16, N=8192, d=128, dtype="bfloat16"))]
    for fam in ("numba", "cupy"):
        P += [(f"{fam} attention", fam, "small", dict(B=1, H=4, N=1024, d=64, dtype="float32")),
              (f"{fam} attention", fam, "large", dict(B=2, H=16, N=4096, d=64, dtype="float32"))]
    for fam in ("torch", "numba", "cupy"):
        P += [(f"{fam} decode" if fam != "torch" else "sdpa decode", fam, "small",
               dict(B=1, Hq=32, Hkv=8, N=4096, d=128, dtype="float16")),
              (f"{fam} decode" if fam != "torch" else "sdpa decode", fam, "large",
               dict(B=8, Hq=32, Hkv=8, N=32768, d=128, dtype="float16"))]
    for fam in ("numba", "cupy"):
        P += [(f"{fam} paged decode", fam, "small", dict(B=1, Hq=32, Hkv=8, N=4096, d=128, dtype="float16")),
              (f"{fam} paged decode", fam, "large", dict(B=2, Hq=32, Hkv=8, N=32768, d=128, dtype="float16"))]
        P += [(f"{fam} paged gather", fam, "small", dict(Hkv=8, N=4096, d=128, dtype="float16")),
              (f"{fam} paged gather", fam, "large", dict(Hkv=8, N=131072, d=128, dtype="float16"))]
    return _in_order(P + _backward_problems())


# --------------------------------------------------------------------------- the limits profile
#: Nsight Compute's sections whose raw metrics the limits profile reads (``ncu --list-sections``)
LIMIT_SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats")
#: the bars' shapes (the batch cut where ncu's replays of a long call would eat the time box)
_DECODE_BAR = dict(B=8, Hq=32, Hkv=8, N=32768, d=128, dtype="float16")   # the Numba decode's bar
_GROUP64 = dict(B=17, Hq=512, Hkv=8, N=4096, d=128, dtype="bfloat16")  # the decode cliff's worst case
_GROUP16 = dict(B=17, Hq=128, Hkv=8, N=4096, d=128, dtype="bfloat16")  # one 16-row tile a group, between grid points
_FP32 = dict(B=2, H=16, N=4096, d=128, dtype="float32")               # the Numba float32 forward's (B8)
_BF16 = dict(B=2, H=16, N=4096, d=128, dtype="bfloat16")              # FP8's and the backward's (B8)


def _limit_problems():
    """(name, family, what its bar holds it to, builder kwargs) of the limits profile, in order:
    each kernel of ours that misses a bar, next to the kernel the bar names."""
    causal = dict(_BF16, causal=True)
    return [("numba decode", "numba", "0.8x SDPA cuDNN", _DECODE_BAR),
            ("numba decode v5", "numba", "0.8x SDPA cuDNN (held back: v4 with exp2)", _DECODE_BAR),
            ("numba decode v6", "numba", "0.8x SDPA cuDNN (held back: v5 unchecked inside)", _DECODE_BAR),
            ("sdpa decode cudnn", "torch", "the Numba decode's bar", _DECODE_BAR),
            ("numba attention", "numba", "0.5x SDPA EFFICIENT", _FP32),
            ("numba attention v5", "numba", "0.5x SDPA EFFICIENT (by name: a GEMM's register tiles)", _FP32),
            ("numba attention v6", "numba", "0.5x SDPA EFFICIENT (by name: v5 with 16-byte shared loads)", _FP32),
            ("numba attention v7", "numba", "0.5x SDPA EFFICIENT (by name: v6 with 16-byte tile copies)", _FP32),
            ("cupy attention v1b", "cupy", "what CUDA C++ reaches on the same CUDA cores (fp32, by name)", _FP32),
            ("sdpa attention efficient", "torch", "the Numba float32 forward's bar", _FP32),
            ("cupy fp8 forward v1", "cupy", "1.5x cupy attention (v5), quantization included", _BF16),
            ("cupy fp8 forward v2", "cupy", "1.5x cupy attention (v5), quantization included", _BF16),
            ("cupy attention", "cupy", "the FP8 forward's baseline", _BF16),
            ("cupy backward causal", "cupy", "forward + backward 1.3x SDPA FLASH's", causal),
            ("sdpa backward flash causal", "torch", "the backward's bar", causal),
            ("cupy decode", "cupy", "1.0x the best SDPA decode (g = 64)", _GROUP64),
            ("sdpa decode flash", "torch", "the large-group decode's bar", _GROUP64),
            ("cupy decode g16", "cupy", "1.0x the best SDPA decode (g = 16, a batch between grid points)", _GROUP16),
            ("sdpa decode g16 cudnn", "torch", "the g = 16 decode's bar", _GROUP16)]


def _build_limit(name, family, kw, gen):
    """The call a limits case profiles (a zero-argument function): the package's default
    kernel for ``family``, or the SDPA kernel the case names last."""
    import torch

    import iokernels as ik
    from iokernels import torch_sdpa as ts
    dt = getattr(torch, kw["dtype"])

    def rand(*shape):
        return torch.randn(shape, device="cuda", dtype=dt, generator=gen)
    if "decode" in name:
        B, Hq, Hkv, N, d = kw["B"], kw["Hq"], kw["Hkv"], kw["N"], kw["d"]
        q, k, v = rand(B, Hq, d), rand(B, Hkv, N, d), rand(B, Hkv, N, d)
        if family != "torch":
            cfg = None
            if name.split()[-1] in ("v5", "v6"):         # a version by name
                from iokernels.numba_cuda import DecodeConfig
                cfg = DecodeConfig(version=name.split()[-1])
            return lambda: ik.decode(q, k, v, backend=family, config=cfg)
        q4, sdpa = q[:, :, None, :], torch.nn.functional.scaled_dot_product_attention

        def call(backend=name.split()[-1]):
            with ts.force(backend):
                return sdpa(q4, k, v, enable_gqa=Hq != Hkv)
        return call
    B, H, N, d, causal = kw["B"], kw["H"], kw["N"], kw["d"], kw.get("causal", False)
    q, k, v = rand(B, H, N, d), rand(B, H, N, d), rand(B, H, N, d)
    if "fp8" in name:
        from iokernels.cupy_raw import hopper as hp
        codes, cfg = hp.quantize_qkv(q, k, v), hp.Fp8Config(version=name.split()[-1])
        return lambda: hp.fp8_attention_codes(codes, config=cfg)
    if "backward" in name:
        do = rand(B, H, N, d)
        if family != "torch":
            o, lse = ik.attention(q, k, v, causal=causal, backend=family, return_lse=True)   # not profiled
            return lambda: ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend=family)
        qg, kg, vg = (x.requires_grad_() for x in (q, k, v))
        with ts.force(name.split()[-2]):                 # the backward runs the forward's kernel's
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    if family != "torch":
        cfg = None
        if name.split()[-1].startswith("v"):                # a version by name
            cfg = _registry(family).get("attention", name.split()[-1]).config_class(version=name.split()[-1])
        return lambda: ik.attention(q, k, v, causal=causal, backend=family, config=cfg)
    return lambda: ts.sdpa(q, k, v, causal=causal, backend=name.split()[-1])


def _backward_config(family, kw):
    """The version's config with the case's dQ mode, and its resolved tiles (Br, Bc)."""
    kern = _registry(family).get("attention_backward", kw["version"])
    cfg = kern.config_class(version=kern.version, deterministic=kw["deterministic"])
    resolve = getattr(cfg, "resolve", None) or getattr(cfg, "resolved")
    tiles = resolve(kw["d"], kw["dtype"])
    return cfg, tiles.block_q, tiles.block_k


def _backward_model(family, kw):
    """The GPU backward's model for a case: (total Traffic, {kernel: [read, written]}, Br, Bc)."""
    from iokernels import backward
    _, Br, Bc = _backward_config(family, kw)
    problem = dict(batch=kw["B"], heads_q=kw["H"], heads_kv=kw["H"], seqlen_q=kw["N"], seqlen_k=kw["N"],
                   head_dim=kw["d"], dtype=kw["dtype"], block_q=Br, block_k=Bc,
                   deterministic=kw["deterministic"], causal=kw["causal"])
    parts = backward.traffic_model_gpu_kernels(**problem)
    return (backward.traffic_model_gpu(**problem), {k: [t.bytes_read, t.bytes_written] for k, t in parts.items()},
            Br, Bc)


def backward_kernel_part(kernel_name: str) -> str:
    """Which part of the GPU backward's model a profiled kernel belongs to (by its name):
    one of iokernels.backward.GPU_BACKWARD_KERNELS, or "other" (a copy, a conversion)."""
    n = kernel_name.lower()
    for part, words in (("rowsum", ("rowsum",)), ("finish", ("finish",)), ("zero", ("zero", "fill")),
                        ("main", ("main",))):
        if any(w in n for w in words):
            return part
    return "other"


def _model(name, kw):
    """The traffic model's bytes for a case: (read, written, by_tensor, what)."""
    from iokernels import traffic
    if name == "copy":
        return kw["nbytes"], kw["nbytes"], {"src": [kw["nbytes"], 0], "dst": [0, kw["nbytes"]]}, "copy"
    if " backward " in name:
        t = _backward_model(name.split()[0], kw)[0]
        kind = "gpu_backward"
    elif "paged gather" in name:
        t = traffic.model("paged_gather", seq_len=kw["N"], heads_kv=kw["Hkv"], head_dim=kw["d"],
                          dtype=kw["dtype"])
        kind = "paged_gather"
    elif "paged decode" in name:
        t = traffic.model("paged_decode", batch=kw["B"], heads_q=kw["Hq"], heads_kv=kw["Hkv"],
                          head_dim=kw["d"], seq_lens=[kw["N"]] * kw["B"], dtype=kw["dtype"])
        kind = "paged_decode"
    elif "decode" in name:
        t = traffic.model("decode", batch=kw["B"], heads_q=kw["Hq"], heads_kv=kw["Hkv"], head_dim=kw["d"],
                          seqlen_k=kw["N"], dtype=kw["dtype"])
        kind = "decode"
    else:
        kind = "naive" if name.startswith("naive") else "fa2"
        t = traffic.model(kind, batch=kw["B"], heads_q=kw["H"], heads_kv=kw["H"], seqlen_q=kw["N"],
                          seqlen_k=kw["N"], head_dim=kw["d"], dtype=kw["dtype"], causal=False, window=None,
                          config=None)
    return t.bytes_read, t.bytes_written, {k: list(v) for k, v in t.as_dict().items()}, kind


def _mandatory(name, kw):
    """Each input read once, each output written once: the floor no kernel goes under."""
    it = {"float16": 2, "bfloat16": 2, "float32": 4}.get(kw.get("dtype"), 4)
    if name == "copy":
        return kw["nbytes"], kw["nbytes"]
    if " backward " in name:                         # read Q, K, V, O, dO, LSE; write dQ, dK, dV
        x = kw["B"] * kw["H"] * kw["N"] * kw["d"] * it
        return 5 * x + kw["B"] * kw["H"] * kw["N"] * 4, 3 * x
    if "gather" in name:
        b = 2 * kw["N"] * kw["Hkv"] * kw["d"] * it
        return b, b
    if "decode" in name:
        kv = 2 * kw["B"] * kw["Hkv"] * kw["N"] * kw["d"] * it
        return kv + kw["B"] * kw["Hq"] * kw["d"] * it, kw["B"] * kw["Hq"] * kw["d"] * it
    x = kw["B"] * kw["H"] * kw["N"] * kw["d"] * it
    return 3 * x, x


def _build(name, family, kw, gen):
    """Inputs and the call to profile (a zero-argument function)."""
    import torch
    if name == "copy":
        # an elementwise kernel (x * 1 -> y), not copy_: a contiguous copy_ is a cudaMemcpy,
        # which the copy engines do and ncu does not profile
        src = torch.randn(kw["nbytes"] // 4, device="cuda", generator=gen)
        dst = torch.empty_like(src)
        return lambda: torch.mul(src, 1.0, out=dst)
    dt = getattr(torch, kw["dtype"])
    if " backward " in name:
        import iokernels as ik
        cfg = _backward_config(family, kw)[0]
        B, H, N, d, causal = kw["B"], kw["H"], kw["N"], kw["d"], kw["causal"]
        q, k, v, do = (torch.randn((B, H, N, d), device="cuda", dtype=dt, generator=gen) for _ in range(4))
        o, lse = ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True)   # not profiled
        return lambda: ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend=family, config=cfg)
    if "gather" in name or "decode" in name:
        from iokernels.bench.runners import _pool_fn, _resolve_backend, device_pages
        Hkv, N, d = kw["Hkv"], kw["N"], kw["d"]
        B = kw.get("B", 1)
        k = torch.randn((B, Hkv, N, d), device="cuda", dtype=dt, generator=gen)
        v = torch.randn((B, Hkv, N, d), device="cuda", dtype=dt, generator=gen)
        if "gather" in name:
            kp, vp, tables, lens = device_pages(k, v)
            del k, v
            g = _pool_fn(family, "gather_pools")
            return lambda: g(kp, vp, tables[0], int(lens[0]))
        q = torch.randn((B, kw["Hq"], d), device="cuda", dtype=dt, generator=gen)
        scale = 1.0 / np.sqrt(d)
        if family == "torch":
            q4 = q[:, :, None, :]
            return lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        if "paged" in name:
            kp, vp, tables, lens = device_pages(k, v)
            del k, v
            f = _pool_fn(family, "paged_decode_pools")
            return lambda: f(q, kp, vp, tables, lens, num_splits=None, scale=scale)
        f = _resolve_backend(family, "decode")
        return lambda: f(q, k, v, seq_lens=None, num_splits=None, scale=scale)
    B, H, N, d = kw["B"], kw["H"], kw["N"], kw["d"]
    q, k, v = (torch.randn((B, H, N, d), device="cuda", dtype=dt, generator=gen) for _ in range(3))
    from iokernels import torch_sdpa as ts
    if name.startswith("naive"):
        return lambda: ts.naive_attention(q, k, v)
    if name == "sdpa flash":
        return lambda: ts.sdpa(q, k, v, backend="flash")
    from iokernels.bench.runners import _resolve_backend
    f = _resolve_backend(family, "attention")
    scale = 1.0 / np.sqrt(d)
    return lambda: f(q, k, v, causal=False, scale=scale, window=(-1, -1), config=None)


# --------------------------------------------------------------------------- run (under ncu)
_MARK_SRC = r'''
extern "C" __global__ void ik_marker(int id, int* sink) { if (id < 0) sink[0] = id; }
extern "C" __global__ void ik_l2flush(const float4* buf, long long n, float* sink) {
    float acc = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float4 x = buf[i]; acc += x.x + x.y + x.z + x.w;
    }
    if (acc == 1234.5f) sink[0] = acc;   // never true for this buffer; keeps the loads alive
}
'''


def _add_model(entry, name, family, kw):
    """The model's bytes (total, per tensor and, for the backward, per kernel) into a plan entry."""
    try:
        entry["model_read"], entry["model_written"], entry["model_by_tensor"], entry["model_kind"] = \
            _model(name, kw)
        if " backward " in name:
            _, entry["model_by_kernel"], entry["block_q"], entry["block_k"] = _backward_model(family, kw)
    except Exception as e:
        entry["model_error"] = f"{type(e).__name__}: {e}"
    entry["mandatory_read"], entry["mandatory_written"] = _mandatory(name, kw)


def _entry(index, name, family, size, kw, limits, model=True):
    """A case's plan entry: for the traffic, ``size`` and (``model``) the model's bytes; for the
    limits profile (``limits``), what the case's bar holds it to."""
    if limits:
        return dict(index=index, case=name, family=family, held_to=size, problem=kw)
    entry = dict(index=index, case=name, family=family, size=size, problem=kw)
    if model:
        _add_model(entry, name, family, kw)
    return entry


def plan(only=None, limits=False) -> list:
    """The cases in measuring order with their modelled bytes (or, with ``limits``, the limits
    profile's cases), without a GPU (a dry run)."""
    entries = []
    for name, family, size, kw in (_limit_problems() if limits else _problems()):
        if only and only not in name:
            continue
        entries.append(_entry(len(entries), name, family, size, kw, limits))
    return entries


def plan_table(entries) -> str:
    if entries and "held_to" in entries[0]:                 # the limits profile's cases
        return "\n".join([f"{'#':>3} {'case':<28}{'held to':<50}problem"] +
                         [f"{e['index']:>3} {e['case']:<28}{e['held_to']:<50}{e['problem']}" for e in entries])
    lines = [f"{'#':>3} {'case':<22}{'size':<17}{'model read MB':>14}{'model write MB':>15}  problem"]
    for e in entries:
        if "model_read" in e:
            mr, mw = f"{e['model_read'] / 1e6:>14.2f}", f"{e['model_written'] / 1e6:>15.2f}"
        else:
            mr, mw = f"{'?':>14}", f"{'?':>15}"
        extra = f"  Br={e['block_q']} Bc={e['block_k']}" if "block_q" in e else ""
        lines.append(f"{e['index']:>3} {e['case']:<22}{e['size']:<17}{mr}{mw}  {e['problem']}{extra}"
                     + (f"  model: {e['model_error']}" if "model_error" in e else ""))
    return "\n".join(lines)


def run(out_dir, only=None, budget_s=None, limits=False):
    """The process ncu profiles: each case's call between a flush and a marker; its plan to
    ``plan.json`` (``limits``: the limits profile's cases, to ``limits_plan.json``)."""
    import cupy as cp
    import torch
    from iokernels.bench import l2_cache_bytes
    os.makedirs(out_dir, exist_ok=True)
    mod = cp.RawModule(code=_MARK_SRC)
    marker, flush = mod.get_function("ik_marker"), mod.get_function("ik_l2flush")
    sink_i = cp.zeros(1, dtype=cp.int32)
    sink_f = cp.zeros(1, dtype=cp.float32)
    nflush = FLUSH_FACTOR * l2_cache_bytes() // 16
    buf = cp.full(nflush * 4, 0.5, dtype=cp.float32)
    cp.cuda.Device().synchronize()

    def do_flush():
        flush((264,), (512,), (buf, np.int64(nflush), sink_f))   # one read pass, 3x L2

    do_flush()
    do_flush()                        # the first pass evicts the fill's dirty lines
    plan = []
    t_start = time.time()
    n_markers = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    build = _build_limit if limits else _build
    for name, family, size, kw in (_limit_problems() if limits else _problems()):
        if only and only not in name:
            continue
        if budget_s is not None and time.time() - t_start > budget_s:
            entry = _entry(len(plan), name, family, size, kw, limits, model=False)
            entry["status"] = f"skipped: the profiled run's time box ({budget_s:.0f} s) ran out"
            plan.append(entry)
            continue
        entry = _entry(len(plan), name, family, size, kw, limits)
        fn = None
        try:
            fn = build(name, family, kw, gen)
            fn()
            fn()                                          # compile, autotune, allocate
            torch.cuda.synchronize()
            cp.cuda.Device().synchronize()
            entry["status"] = "ok"
        except Exception as e:
            entry["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if entry["status"] != "ok":
            plan.append(entry)
            print(f"[{entry['index']}] {name} {size}: {entry['status']}", flush=True)
            continue
        entry["marker"] = n_markers                      # the n-th ik_marker opens this case's kernels
        n_markers += 1
        torch.cuda.profiler.start()
        do_flush()
        marker((1,), (1,), (np.int32(entry["index"]), sink_i))
        if fn is not None and entry["status"] == "ok":
            try:
                fn()
            except Exception as e:
                entry["status"] = f"failed: {type(e).__name__}: {e}"
        torch.cuda.synchronize()
        cp.cuda.Device().synchronize()
        torch.cuda.profiler.stop()
        plan.append(entry)
        print(f"[{entry['index']}] {name} {size}: {entry['status']}", flush=True)
        del fn
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "limits_plan.json" if limits else "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)


# --------------------------------------------------------------------------- parse
#: the raw page's columns that name a kernel's launch, not a metric
_IDENTITY = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
             "Grid Size", "Device", "CC")


def _read_ncu_csv(path, metrics=METRICS):
    """Per kernel, in launch order: (id, name, {metric: value}).  Handles raw and details pages;
    from a raw page the columns ``metrics`` names, or (None) every numeric one."""
    text = open(path, errors="replace").read()
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]   # drop ==PROF== lines
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows:
        return []
    hdr = rows[0]
    kernels = {}
    order = []
    if "Metric Name" in hdr:                                # details page: one row per metric
        i_id, i_nm = hdr.index("ID"), hdr.index("Kernel Name")
        i_mn, i_mv = hdr.index("Metric Name"), hdr.index("Metric Value")
        for r in rows[1:]:
            if len(r) <= i_mv:
                continue
            kid = int(r[i_id])
            if kid not in kernels:
                kernels[kid] = (r[i_nm], {})
                order.append(kid)
            try:
                kernels[kid][1][r[i_mn]] = float(r[i_mv].replace(",", ""))
            except ValueError:
                pass
    else:                                                   # raw page: one row per kernel
        i_id, i_nm = hdr.index("ID"), hdr.index("Kernel Name")
        names = [m for m in hdr if m not in _IDENTITY] if metrics is None else metrics
        cols = {m: hdr.index(m) for m in names if m in hdr}
        for r in rows[1:]:
            if len(r) < len(hdr) or not r[i_id].strip().isdigit():
                continue                                    # the units row
            kid = int(r[i_id])
            vals = {}
            for m, c in cols.items():
                try:
                    vals[m] = float(r[c].replace(",", ""))
                except ValueError:
                    pass
            kernels[kid] = (r[i_nm], vals)
            order.append(kid)
    return [(k, kernels[k][0], kernels[k][1]) for k in order]


def _groups(kernels) -> dict:
    """{n: [(kernel name, metrics), ...]}: the kernels after the n-th ik_marker, up to the next
    flush (a case's kernels)."""
    groups, cur = {}, None
    for kid, name, vals in kernels:
        if "ik_marker" in name:
            cur = len(groups)
            groups[cur] = []
            continue
        if "ik_l2flush" in name:
            cur = None
            continue
        if cur is not None:
            groups[cur].append((name, vals))
    return groups


def parse(out_dir):
    plan = json.load(open(os.path.join(out_dir, "plan.json")))
    groups = _groups(_read_ncu_csv(os.path.join(out_dir, "ncu_raw.csv")))
    results = []
    for e in plan:
        g = groups.get(e.get("marker", -1), [])
        r = dict(e)
        if e.get("status") == "ok" and g:
            rd = sum(v.get("dram__bytes_read.sum", 0.0) for _, v in g)
            wr = sum(v.get("dram__bytes_write.sum", 0.0) for _, v in g)
            r.update(measured_read=rd, measured_written=wr,
                     kernel_time_us=round(sum(v.get("gpu__time_duration.sum", 0.0) for _, v in g) / 1e3, 2),
                     kernels=[n[:80] for n, _ in g])
            if e.get("model_read") is not None:
                m = e["model_read"] + e["model_written"]
                r["measured_over_model"] = round((rd + wr) / m, 4) if m else None
                r["read_over_model"] = round(rd / e["model_read"], 4) if e["model_read"] else None
                r["write_over_model"] = round(wr / e["model_written"], 4) if e["model_written"] else None
            mand = e["mandatory_read"] + e["mandatory_written"]
            r["measured_over_mandatory"] = round((rd + wr) / mand, 4)
            if "model_by_kernel" in e:
                r["measured_by_kernel"] = _by_kernel(g)
        elif e.get("status") == "ok":
            r["status"] = "no kernels profiled (ncu not run, or the group was empty)"
        results.append(r)
    from iokernels.bench import environment
    rec = {"env": environment(), "metrics": list(METRICS),
           "note": os.environ.get("IK_TRAFFIC_NOTE", ""),
           "ncu_options": "--clock-control none --cache-control none --profile-from-start off",
           "cases": results}
    limits = os.path.join(out_dir, "limits.json")
    if os.path.exists(limits):
        rec["limits"] = json.load(open(limits))
    with open(os.path.join(out_dir, "traffic.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(table(rec))
    return rec


# --------------------------------------------------------------------------- parse: what bounds a kernel
#: the figures of a kernel's limits summary: (name, the raw metrics that give it, the first present
#: wins; a factor to its unit).  Names as Nsight Compute's sections collect them (its Profiling
#: Guide defines each: docs); DRAM's share has had two names
LIMIT_FIGURES = (
    ("time_us", ("gpu__time_duration.sum",), 1e-3),
    ("sm_pct", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), 1.0),
    ("dram_pct", ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                  "dram__throughput.avg.pct_of_peak_sustained_elapsed"), 1.0),
    ("issue_pct", ("sm__inst_issued.avg.pct_of_peak_sustained_active",
                   "smsp__issue_active.avg.pct_of_peak_sustained_active"), 1.0),
    ("occupancy_pct", ("sm__warps_active.avg.pct_of_peak_sustained_active",), 1.0),
    ("registers", ("launch__registers_per_thread",), 1.0),
    ("cycles_per_issue", ("smsp__average_warp_latency_per_inst_issued.ratio",), 1.0),
)
#: a pipe's utilization (the share of its peak while the SM is active): instructions executed on
#: it, or the cycles it was busy (the larger of the two where both are collected)
PIPE_METRIC = re.compile(r"^sm__(?:inst_executed_pipe_|pipe_)(\w+?)(?:_cycles_active)?"
                         r"\.avg\.pct_of_peak_sustained_active$")
#: a stall reason's cycles per issued instruction (the warp-state breakdown), in its two spellings
STALL_METRIC = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(_per_issue_active)?\.ratio$")
#: pipes and stall reasons a summary keeps (the busiest, the costliest)
LIMIT_TOP = 4


def limits_summary(vals: dict) -> dict:
    """One kernel's raw metrics -> its limits figures (LIMIT_FIGURES; None where not collected),
    its LIMIT_TOP busiest pipes {pipe: %} and costliest stall reasons {reason: cycles an
    issued instruction}, largest first."""
    out = {}
    for key, names, factor in LIMIT_FIGURES:
        v = next((vals[n] for n in names if n in vals), None)
        out[key] = None if v is None else round(v * factor, 3)
    pipes, stalls, per_issue = {}, {}, set()
    for name, v in vals.items():
        m = PIPE_METRIC.match(name)
        if m:
            pipes[m.group(1)] = max(pipes.get(m.group(1), 0.0), v)
        m = STALL_METRIC.match(name)
        if m and m.group(1) != "selected":                   # "selected": the cycle that issues
            reason = m.group(1)
            if m.group(2) or reason not in per_issue:          # the per-issue spelling wins
                stalls[reason] = v
                if m.group(2):
                    per_issue.add(reason)
    def top(d):
        return {k: round(v, 3) for k, v in sorted(d.items(), key=lambda x: -x[1])[:LIMIT_TOP]}
    out["pipes"], out["stalls"] = top(pipes), top(stalls)
    return out


def short_kernel_name(name: str) -> str:
    """A profiled kernel's name, short: a mangled name's last two components (Numba's
    module.function), a C++ name without its template arguments and parameters."""
    if name.startswith("_ZN"):                  # <length><name> ... up to the first non-digit
        parts, i = [], 3
        while (m := re.match(r"\d+", name[i:])):
            n, i = int(m.group()), i + len(m.group())
            parts.append(name[i:i + n])
            i += n
        parts = [p for p in parts if "locals" not in p]       # a closure's "<locals>"
        return ".".join(parts[-2:])[:48] if parts else name[:48]
    base = name.split("(")[0]
    while "<" in base:
        cut = re.sub(r"<[^<>]*>", "", base)
        if cut == base:
            break
        base = cut
    return base.split()[-1][:48] if base.split() else name[:48]


def parse_limits(out_dir):
    """DIR/limits_raw.csv + DIR/limits_plan.json -> DIR/limits.json: per case, each kernel it
    launched with its :func:`limits_summary` and its share of the case's time."""
    plan = json.load(open(os.path.join(out_dir, "limits_plan.json")))
    groups = _groups(_read_ncu_csv(os.path.join(out_dir, "limits_raw.csv"), metrics=None))
    cases = []
    for e in plan:
        c = dict(e)
        g = groups.get(e.get("marker", -1), [])
        if e.get("status") == "ok" and g:
            kernels = [dict(kernel=short_kernel_name(n), **limits_summary(v)) for n, v in g]
            total = sum(k["time_us"] or 0.0 for k in kernels)
            for k in kernels:
                k["share"] = round((k["time_us"] or 0.0) / total, 3) if total else None
            c["kernels"], c["time_us"] = kernels, round(total, 2)
        elif e.get("status") == "ok":
            c["status"] = "no kernels profiled (ncu not run, or the group was empty)"
        cases.append(c)
    rec = {"sections": list(LIMIT_SECTIONS), "cases": cases}
    with open(os.path.join(out_dir, "limits.json"), "w") as f:
        json.dump(rec, f, indent=1)
    from iokernels.core.recorded import limits_table
    print(limits_table({"traffic": {"limits": rec}}))
    return rec


def _by_kernel(group) -> dict:
    """{part: [read, written, kernels launched]} of a backward case's profiled kernels."""
    out = {}
    for name, vals in group:
        part = out.setdefault(backward_kernel_part(name), [0.0, 0.0, 0])
        part[0] += vals.get("dram__bytes_read.sum", 0.0)
        part[1] += vals.get("dram__bytes_write.sum", 0.0)
        part[2] += 1
    return out


def table(rec) -> str:
    lines = [f"{'case':<22}{'size':<17}{'read MB':>10}{'model':>10}{'write MB':>10}{'model':>10}"
             f"{'meas/model':>11}{'meas/min':>10}  status"]
    for r in rec["cases"]:
        if "measured_read" in r:
            lines.append(f"{r['case']:<22}{r['size']:<17}{r['measured_read'] / 1e6:>10.2f}"
                         f"{(r.get('model_read') or 0) / 1e6:>10.2f}{r['measured_written'] / 1e6:>10.2f}"
                         f"{(r.get('model_written') or 0) / 1e6:>10.2f}{r.get('measured_over_model') or 0:>11.3f}"
                         f"{r['measured_over_mandatory']:>10.3f}  ok ({len(r['kernels'])} kernels)")
        else:
            lines.append(f"{r['case']:<22}{r['size']:<17}{'':>62}  {r.get('status')}")
    from iokernels.core.recorded import backward_traffic_table
    per_kernel = backward_traffic_table({"traffic": rec})
    if per_kernel:
        lines += ["", "the backward, kernel by kernel (measured DRAM bytes next to the model):", per_kernel]
    return "\n".join(lines)


def _ncu_run(out_dir, ncu, timeout, only, limits):
    """ncu over this script's ``run`` (the traffic's cases, or with ``limits`` the limits
    profile's): True when the profiled run wrote its plan."""
    if limits:                                  # every section's replays, caches flushed between passes
        what = [x for sec in LIMIT_SECTIONS for x in ("--section", sec)]
        log, plan_file, extra = "limits_raw.csv", "limits_plan.json", ["--limits"]
    else:
        what = ["--cache-control", "none", "--metrics", ",".join(METRICS)]
        log, plan_file, extra = "ncu_raw.csv", "plan.json", []
    cmd = [shutil.which(ncu) or ncu, "--clock-control", "none", "--profile-from-start", "off", *what,
           "--csv", "--page", "raw", "--print-units", "base", "--log-file", os.path.join(out_dir, log),
           sys.executable, os.path.abspath(__file__), "run", "--out", out_dir,
           "--budget", str(max(10, int(timeout * 0.6))), *extra]
    if only:
        cmd += ["--only", only]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        print(f"ncu exit {p.returncode} after {time.time() - t0:.0f} s", flush=True)
    except subprocess.TimeoutExpired:
        print(f"ncu timed out after {timeout} s", flush=True)
    if os.path.exists(os.path.join(out_dir, plan_file)):
        return True
    print(f"no {plan_file}: the profiled run did not finish", flush=True)
    return False


def all_(out_dir, ncu="ncu", timeout=300, only=None, limits_timeout=0):
    """The traffic's bytes, then (``limits_timeout`` > 0) the limits profile, in one traffic.json."""
    os.makedirs(out_dir, exist_ok=True)
    traffic = _ncu_run(out_dir, ncu, timeout, only, limits=False)
    limits = limits_timeout > 0 and _ncu_run(out_dir, ncu, limits_timeout, only, limits=True)
    if limits:
        parse_limits(out_dir)
    if traffic:
        return parse(out_dir)
    if limits:                                  # no bytes measured: the record keeps the limits
        rec = {"error": "the traffic's profiled run did not finish", "cases": [],
               "limits": json.load(open(os.path.join(out_dir, "limits.json")))}
        with open(os.path.join(out_dir, "traffic.json"), "w") as f:
            json.dump(rec, f, indent=1)
        return rec
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("all", "run", "parse", "plan", "limits"))
    p.add_argument("--out", default=None, help="the output folder (every mode but plan)")
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--limits-timeout", type=int, default=0,
                   help="all: then the limits profile, in this many seconds (0: not run)")
    p.add_argument("--limits", action="store_true",
                   help="run, parse, plan: the limits profile's cases instead of the traffic's")
    p.add_argument("--budget", type=float, default=None,
                   help="run: stop starting new cases after this many seconds (ncu writes its CSV at exit)")
    a = p.parse_args(argv)
    if a.mode != "plan" and not a.out:
        p.error(f"{a.mode} needs --out DIR")
    try:
        if a.mode == "plan":
            print(plan_table(plan(a.only, a.limits)))
        elif a.mode == "run":
            run(a.out, a.only, a.budget, a.limits)
        elif a.mode == "parse":
            parse_limits(a.out) if a.limits else parse(a.out)
        elif a.mode == "limits":
            os.makedirs(a.out, exist_ok=True)
            if _ncu_run(a.out, a.ncu, a.timeout, a.only, limits=True):
                parse_limits(a.out)
        else:
            all_(a.out, a.ncu, a.timeout, a.only, a.limits_timeout)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
