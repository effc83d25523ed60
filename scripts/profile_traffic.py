"""Measured DRAM traffic (Nsight Compute) next to the traffic model's prediction.

    python3 scripts/profile_traffic.py all --out DIR      # runs ncu over "run", then "parse"
    python3 scripts/profile_traffic.py run --out DIR      # the process ncu profiles
    python3 scripts/profile_traffic.py parse --out DIR    # DIR/ncu_raw.csv + DIR/plan.json -> DIR/traffic.json
    python3 scripts/profile_traffic.py plan [--only X]    # the cases, in order, with their model: no GPU

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


def plan(only=None) -> list:
    """The cases in measuring order with their modelled bytes, without a GPU (a dry run)."""
    entries = []
    for name, family, size, kw in _problems():
        if only and only not in name:
            continue
        entry = dict(index=len(entries), case=name, family=family, size=size, problem=kw)
        _add_model(entry, name, family, kw)
        entries.append(entry)
    return entries


def plan_table(entries) -> str:
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


def run(out_dir, only=None, budget_s=None):
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
    for idx, (name, family, size, kw) in enumerate(_problems()):
        if only and only not in name:
            continue
        entry = dict(index=len(plan), case=name, family=family, size=size, problem=kw)
        if budget_s is not None and time.time() - t_start > budget_s:
            entry["status"] = f"skipped: the profiled run's time box ({budget_s:.0f} s) ran out"
            plan.append(entry)
            continue
        _add_model(entry, name, family, kw)
        fn = None
        try:
            fn = _build(name, family, kw, gen)
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
    with open(os.path.join(out_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)


# --------------------------------------------------------------------------- parse
def _read_ncu_csv(path):
    """Per kernel, in launch order: (id, name, {metric: value}).  Handles raw and details pages."""
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
        cols = {m: hdr.index(m) for m in METRICS if m in hdr}
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


def parse(out_dir):
    plan = json.load(open(os.path.join(out_dir, "plan.json")))
    kernels = _read_ncu_csv(os.path.join(out_dir, "ncu_raw.csv"))
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
    with open(os.path.join(out_dir, "traffic.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(table(rec))
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


def all_(out_dir, ncu="ncu", timeout=300, only=None):
    os.makedirs(out_dir, exist_ok=True)
    ncu = shutil.which(ncu) or ncu
    cmd = [ncu, "--clock-control", "none", "--cache-control", "none", "--profile-from-start", "off",
           "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base",
           "--log-file", os.path.join(out_dir, "ncu_raw.csv"),
           sys.executable, os.path.abspath(__file__), "run", "--out", out_dir,
           "--budget", str(max(10, int(timeout * 0.6)))]
    if only:
        cmd += ["--only", only]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        print(f"ncu exit {p.returncode} after {time.time() - t0:.0f} s", flush=True)
    except subprocess.TimeoutExpired:
        print(f"ncu timed out after {timeout} s", flush=True)
    if os.path.exists(os.path.join(out_dir, "plan.json")):
        return parse(out_dir)
    print("no plan.json: the profiled run did not finish", flush=True)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("all", "run", "parse", "plan"))
    p.add_argument("--out", default=None, help="the output folder (every mode but plan)")
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--budget", type=float, default=None,
                   help="run: stop starting new cases after this many seconds (ncu writes its CSV at exit)")
    a = p.parse_args(argv)
    if a.mode != "plan" and not a.out:
        p.error(f"{a.mode} needs --out DIR")
    try:
        if a.mode == "plan":
            print(plan_table(plan(a.only)))
        elif a.mode == "run":
            run(a.out, a.only, a.budget)
        elif a.mode == "parse":
            parse(a.out)
        else:
            all_(a.out, a.ncu, a.timeout, a.only)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
