"""``python -m iokernels bench``: run the declared sections, print the table, write the record."""
from __future__ import annotations

import argparse
import json
import time as _time
from pathlib import Path

from .environment import environment, label
from .runners import (Unavailable, _numpy_only_cases, backward_cases, decode_cases, gather_cases,  # noqa: F401
                      prefill_cases, quant_decode_cases, row_backends, set_row_backends)
from .runners_fp8 import FP8, fp8_cases
from .runners_mla import mla_cases
from .runners_prefill import paged_prefill_cases
from .specs import (BACKWARD, BACKWARD_FP32, DECODE_QUANT, DECODE_SWEEP, DEFAULT_SECTIONS, GATHER_SIZES, MLA,
                    PAGED_PREFILL, PREFILL_COMPARE, PREFILL_SWEEP, QUICK, SECTIONS, TARGET_MS_PER_RUNNER)
from .timer import DEFAULT_REPS, DEFAULT_WARMUP, _torch_cuda


def run(sections=DEFAULT_SECTIONS, *, quick=False, seed=0, progress=True, target_ms=TARGET_MS_PER_RUNNER,
        cliff_budget_s=None, cliff_start=0, checkpoint=None, backends=None) -> dict:
    """:func:`_run` with only ``backends``' rows timed (None: every GPU backend's; SDPA's rows
    always), the selection in the record's settings."""
    before = set_row_backends(backends)
    try:
        return _run(sections, quick=quick, seed=seed, progress=progress, target_ms=target_ms,
                    cliff_budget_s=cliff_budget_s, cliff_start=cliff_start, checkpoint=checkpoint)
    finally:
        set_row_backends(before)


def _run(sections=DEFAULT_SECTIONS, *, quick=False, seed=0, progress=True, target_ms=TARGET_MS_PER_RUNNER,
         cliff_budget_s=None, cliff_start=0, checkpoint=None) -> dict:
    """Run the benchmark; returns the record (env + cases).  See :func:`main`.

    ``target_ms``: device time each runner's timed loop aims at (repetitions adapt to it,
    between 3 and DEFAULT_REPS); lower it to fit a tight time box.  ``cliff_budget_s``: the
    cliff sweep's time box (None: :data:`.cliff.CLIFF_BUDGET_S`); ``cliff_start``: the index of
    its first case (a slice of a sweep longer than one box).  ``checkpoint``: called
    with the record whenever a case starts and after every section (``record["complete"]``
    False until the end), so a run stopped by a time box still leaves every case it finished.
    """
    from . import cliff
    t0 = _time.perf_counter()
    env = environment()
    record = {"env": env, "label": label(env), "quick": bool(quick), "seed": seed, "complete": False,
              "settings": dict(warmup=DEFAULT_WARMUP, max_reps=DEFAULT_REPS, statistic="median",
                               l2_flush=True, timer="CUDA events (iokernels.bench.time_cuda)",
                               target_ms_per_runner=float(target_ms), backends=list(row_backends())),
              "cases": []}
    gpu = _torch_cuda() is not None
    if not gpu:
        record["note"] = ("no CUDA GPU visible to torch: only the NumPy rows ran; see "
                          "benchmarks/results/ for numbers recorded on a GPU")
        record["cases"] = _numpy_only_cases(QUICK["prefill"], seed)
        record["elapsed_s"] = round(_time.perf_counter() - t0, 1)
        record["complete"] = True
        return record
    plan = []
    if quick:
        plan = [("prefill", QUICK["prefill"]), ("decode", QUICK["decode"]), ("gather", QUICK["gather"]),
                ("backward", QUICK["backward"]), ("mla", QUICK["mla"]), ("paged_prefill", QUICK["paged_prefill"])]
        plan = [(s, p) for s, p in plan if s in sections or (s == "prefill" and "compare" in sections)]
    else:
        for s in sections:
            if s == "prefill":
                plan.append(("prefill", PREFILL_SWEEP))
            elif s == "compare":
                plan.append(("compare", PREFILL_COMPARE))
            elif s == "decode":
                plan += [("decode", DECODE_SWEEP), ("decode_quant", DECODE_QUANT)]
            elif s == "gather":
                plan.append(("gather", GATHER_SIZES))
            elif s == "backward":
                plan += [("backward", BACKWARD), ("backward", BACKWARD_FP32)]
            elif s == "mla":
                plan.append(("mla", MLA))
            elif s == "paged_prefill":
                plan.append(("paged_prefill", PAGED_PREFILL))
            elif s == "cliff":
                plan.append(("cliff", cliff.CLIFF))
            elif s == "captured":
                plan.append(("captured", cliff.CAPTURED))
            elif s == "fp8":
                plan.append(("fp8", FP8))
    total = 0
    for s, p in plan:
        if s in ("prefill", "compare"):
            total += len(p["seqlens"]) * len(p["causal"]) * len(p["dtypes"]) * 8
        elif s == "decode":
            total += len(p["batches"]) * len(p["seqlens"]) * len(p["dtypes"]) * 9
        elif s == "decode_quant":
            total += (len(p["batches"]) * len(p["seqlens"]) * len(p["dtypes"]) * len(p["variants"])
                      * (1 + len(p.get("cupy_versions", (None,)))))
        elif s == "backward":
            total += len(p["seqlens"]) * len(p["causal"]) * len(p["dtypes"]) * 2
        elif s == "mla":
            total += len(p["shapes"]) * len(p["dtypes"]) * 3
        elif s == "paged_prefill":
            total += len(p["shapes"]) * len(p["dtypes"]) * 2
        elif s == "cliff":
            total += len(cliff.decode_plan(p)) + len(cliff.prefill_plan(p))
        elif s == "captured":
            total += 1
        elif s == "fp8":
            total += len(p["seqlens"]) * len(p["causal"])
        else:
            total += len(p["seqlens"]) * 3
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, unit="row", dynamic_ncols=True)
        except ImportError:  # pragma: no cover
            bar = _LogBar(t0)
    else:
        bar = _LogBar(t0)
    cases = record["cases"]               # each section appends its cases here as they finish
    if checkpoint is not None:            # and a case's start is the moment to save those before it
        bar = _Checkpoints(bar, lambda: checkpoint(record))
    with bar:
        for s, p in plan:
            if s in ("prefill", "compare"):
                prefill_cases(p, seed, bar, section=s, target_ms=target_ms, into=cases)
            elif s == "decode":
                decode_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "decode_quant":
                quant_decode_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "backward":
                backward_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "mla":
                mla_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "paged_prefill":
                paged_prefill_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "cliff":
                cliff.cliff_cases(p, seed, bar, target_ms=target_ms, budget_s=cliff_budget_s or cliff.CLIFF_BUDGET_S,
                                  start=cliff_start, into=cases)
            elif s == "captured":
                cliff.captured_cases(p, seed, bar, target_ms=target_ms, into=cases)
            elif s == "fp8":
                fp8_cases(p, seed, bar, target_ms=target_ms, into=cases)
            else:
                gather_cases(p, seed, bar, target_ms=target_ms, into=cases)
            record["elapsed_s"] = round(_time.perf_counter() - t0, 1)
            if checkpoint is not None:
                checkpoint(record)
    record["elapsed_s"] = round(_time.perf_counter() - t0, 1)
    record["complete"] = True
    return record


def write_record(record, path) -> Path:
    """Write ``record`` as JSON to ``path`` (a file, or a folder: ``bench.json`` in it), whole or not at all.

    The text goes to a temporary file beside it, then replaces ``path`` in one rename, so a
    reader (or a time box that kills the run) never sees half a file.
    """
    out = Path(path)
    if out.is_dir() or str(path).endswith("/"):
        out.mkdir(parents=True, exist_ok=True)
        out = out / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    tmp.write_text(json.dumps(record, indent=1, default=float))
    tmp.replace(out)
    return out


class _Checkpoints:
    """A progress bar that saves the record whenever a case starts (its description is set)."""

    def __init__(self, bar, save):
        self.bar, self.save = bar, save

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *a):
        return self.bar.__exit__(*a)

    def update(self, n=1):
        self.bar.update(n)

    def set_description(self, s):
        self.save()
        self.bar.set_description(s)


class _LogBar:
    """The progress bar of a run without one: a line per case, with the seconds since the
    start, so the log of a run its time box stopped says where the time went."""

    def __init__(self, t0: float):
        self.t0 = t0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, n=1):
        pass

    def set_description(self, s):
        print(f"[{_time.perf_counter() - self.t0:7.1f} s] {s}", flush=True)


# --------------------------------------------------------------------------- the table
def _shape_text(case) -> str:
    s = case["shape"]
    if case["kind"] == "prefill" and s.get("heads_kv", s["heads"]) != s["heads"]:
        return (f"B{s['batch']} {s['heads']}/{s['heads_kv']} N{s['seqlen']} d{s['head_dim']}"
                + (" causal" if case["causal"] else ""))
    if case["kind"] == "prefill":
        return f"B{s['batch']} H{s['heads']} N{s['seqlen']} d{s['head_dim']}" + (" causal" if case["causal"] else "")
    if case["kind"] == "decode":
        return f"B{s['batch']} {s['heads_q']}/{s['heads_kv']} N{s['seqlen']} d{s['head_dim']}"
    if case["kind"] == "decode_step":
        return f"{s['layers']}x B{s['batch']} {s['heads_q']}/{s['heads_kv']} N{s['seqlen']} d{s['head_dim']}"
    if case["kind"] == "cliff_budget":
        return "summary"
    if case["kind"] == "paged_prefill":
        return f"B{s['batch']} {s['heads_q']}/{s['heads_kv']} n{s['seqlen']} c{s['chunk']} d{s['head_dim']}"
    if case["kind"] == "mla":
        return f"B{s['batch']} H{s['heads_q']} N{s['seqlen']} {s['latent_dim']}+{s['rope_dim']}"
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
            ratio = r.get("speed_vs_best_sdpa", r.get("speed_vs_copy", r.get("speed_vs_numpy_naive",
                                                                                r.get("speed_vs_torch_matmul",
                                                                                      r.get("speed_vs_contiguous")))))
            ratio = f"{ratio:.3f}" if ratio is not None else "-"
            note = "" if ok else r.get("status", "")
            if r.get("suspect"):
                note += " SUSPECT: " + r["suspect"]
            if r.get("ran"):
                note += f" ran {r['ran']}"
            if ok and r.get("roofline_fraction") is not None:
                note += f" {r['cache_TBps']:.2f} TB/s of cache, {r['roofline_fraction']:.2f} of the roofline bound"
            if ok and r.get("host_ms", 0) > r["ms"]:
                note += f" host-bound: {r['host_ms']:.4f} ms of Python a call"
            lines.append(f"{c['section']:<9}{c['dtype']:<10}{_shape_text(c):<30}{r['runner']:<22}{ms:>11}"
                         f"{rate:>17}{mem:>9}{ratio:>9}  {note.strip()[:90]}")
        if c.get("status"):                 # a case that did not run (the cliff sweep's memory check)
            lines.append(f"{c['section']:<9}{c['dtype']:<10}{_shape_text(c):<30}{c['status'][:110]}")
        if c.get("summary"):
            lines.append(f"{c['section']:<9}{'':<10}{'summary':<30}"
                         + ", ".join(f"{k} {v}" for k, v in c["summary"].items())[:140])
        if c.get("silent_fallback"):
            lines.append(f"{'':<48}!! silent fall-back: {c['silent_fallback']}")
    lines.append("")
    lines.append("ms: median of CUDA-event timings, L2 flushed between runs.  rate: TFLOP/s (prefill, "
                 "visible pairs only) or TB/s (decode: K+V bytes read; gather: read+write).  "
                 "MiB+: device memory above the inputs during one call.  vs best: best SDPA time / this "
                 "time (1 = as fast as the best SDPA kernel; gather rows: vs the device copy; mla rows: "
                 "vs torch:matmul; paged_prefill rows: vs the contiguous CuPy prefill of the same chunks, "
                 "and the fraction of the roofline bound max(FLOPs / matmul peak, cache bytes / bandwidth)).")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m iokernels bench [--quick] [--sections ...] [--out FILE] [--no-progress]``."""
    p = argparse.ArgumentParser(prog="python -m iokernels bench",
                                description="Every available backend next to torch SDPA, on the same "
                                            "shapes, in one process; a table and a JSON record.")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)})")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds; runs on a CPU too)")
    p.add_argument("--out", default=None, help="write the JSON record here (a file, or a folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--target-ms", type=float, default=TARGET_MS_PER_RUNNER,
                   help=f"device time each runner's timed loop aims at (default {TARGET_MS_PER_RUNNER:.0f}); "
                        "repetitions adapt, between 3 and 20")
    p.add_argument("--cliff-budget-s", type=float, default=None,
                   help="seconds the cliff sweep may take (default: iokernels.bench.cliff.CLIFF_BUDGET_S)")
    p.add_argument("--cliff-start", type=int, default=0,
                   help="index of the cliff sweep's first case (a slice: the last slice's summary row says "
                        "where it stopped)")
    p.add_argument("--backends", default=None,
                   help="comma-separated GPU backends whose rows the prefill, compare, decode and backward "
                        "sections time (default: every one; SDPA's rows are timed either way)")
    args = p.parse_args(argv)
    backends = None if args.backends is None else [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        set_row_backends(set_row_backends(backends))          # checked before anything runs
    except ValueError as e:
        p.error(f"--{e}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    checkpoint = (lambda rec: write_record(rec, args.out)) if args.out else None
    record = run(sections, quick=args.quick, seed=args.seed, progress=not args.no_progress,
                 target_ms=args.target_ms, cliff_budget_s=args.cliff_budget_s, cliff_start=args.cliff_start,
                 checkpoint=checkpoint, backends=backends)
    print(table(record))
    if args.out:
        print(f"wrote {write_record(record, args.out)}")
    return 0
