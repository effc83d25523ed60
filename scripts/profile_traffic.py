"""Measured DRAM traffic (Nsight Compute) next to the traffic model's prediction.

    python3 scripts/profile_traffic.py all --out DIR      # runs ncu over "run", then "parse"
    python3 scripts/profile_traffic.py run --out DIR      # the process ncu profiles
    python3 scripts/profile_traffic.py parse --out DIR    # DIR/ncu_raw.csv + DIR/plan.json -> DIR/traffic.json

What is measured: for each kernel family (torch naive attention, SDPA flash, the Numba and
CuPy attention, decode, paged decode and paged gather kernels, and a plain device copy as
a sanity check of the counters), the profiler's ``dram__bytes_read.sum`` and
``dram__bytes_write.sum`` summed over every kernel the call launched, at a size whose
working set fits in the H200's 60 MB L2 and at one several times larger.

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
def _problems():
    """(name, family, size, builder kwargs) for every case; sizes small (fits L2) and large."""
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
    return P


def _model(name, kw):
    """The traffic model's bytes for a case: (read, written, by_tensor, what)."""
    from iokernels import traffic
    if name == "copy":
        return kw["nbytes"], kw["nbytes"], {"src": [kw["nbytes"], 0], "dst": [0, kw["nbytes"]]}, "copy"
    if "paged gather" in name:
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
        try:
            entry["model_read"], entry["model_written"], entry["model_by_tensor"], entry["model_kind"] = \
                _model(name, kw)
        except Exception as e:
            entry["model_error"] = f"{type(e).__name__}: {e}"
        entry["mandatory_read"], entry["mandatory_written"] = _mandatory(name, kw)
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


def table(rec) -> str:
    lines = [f"{'case':<22}{'size':<7}{'read MB':>10}{'model':>10}{'write MB':>10}{'model':>10}"
             f"{'meas/model':>11}{'meas/min':>10}  status"]
    for r in rec["cases"]:
        if "measured_read" in r:
            lines.append(f"{r['case']:<22}{r['size']:<7}{r['measured_read'] / 1e6:>10.2f}"
                         f"{r.get('model_read', 0) / 1e6:>10.2f}{r['measured_written'] / 1e6:>10.2f}"
                         f"{r.get('model_written', 0) / 1e6:>10.2f}{r.get('measured_over_model') or 0:>11.3f}"
                         f"{r['measured_over_mandatory']:>10.3f}  ok ({len(r['kernels'])} kernels)")
        else:
            lines.append(f"{r['case']:<22}{r['size']:<7}{'':>62}  {r.get('status')}")
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
    p.add_argument("mode", choices=("all", "run", "parse"))
    p.add_argument("--out", required=True)
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--budget", type=float, default=None,
                   help="run: stop starting new cases after this many seconds (ncu writes its CSV at exit)")
    a = p.parse_args(argv)
    try:
        if a.mode == "run":
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
