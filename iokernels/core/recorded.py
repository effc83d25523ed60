"""Results recorded on a real GPU, for notebooks and the README when there is no GPU here.

``scripts/gpu_all.sh OUTDIR`` runs the benchmark, the profiler and the sanitizers on a GPU;
``python scripts/readme_table.py --from OUTDIR`` files what it wrote under
``benchmarks/results/``:

=================================  ===========================================================
file                               what
=================================  ===========================================================
``h200_<date>.json``               env (GPU, driver, CUDA, versions, date), the benchmark
                                   record (``bench``), measured vs modelled DRAM bytes
                                   (``traffic``), the GPU test summary
``sanitizer_<date>.txt``           compute-sanitizer memcheck / racecheck / synccheck /
                                   initcheck summary
=================================  ===========================================================

Every number shown from here must carry :func:`label`: "recorded on NVIDIA H200, <date>,
driver ..., torch ..., numba ..., cupy ...".  Nothing here touches a GPU.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
#: where the records live: a checkout's benchmarks/results (a checkout holds pyproject.toml), else
#: the copy an installed wheel carries inside the package, iokernels/data/results (setup.py)
RESULTS_DIR = (_PACKAGE.parent / "benchmarks" / "results" if (_PACKAGE.parent / "pyproject.toml").is_file()
               else _PACKAGE / "data" / "results")

#: kind -> file name pattern
KINDS = {"h200": "h200_*.json", "sanitizer": "sanitizer_*.txt", "ceilings": "ceilings_*.json",
         "hopper": "hopper_h200_*.json"}


def available(kind: str = "h200", results_dir=None) -> list[Path]:
    """Recorded files of ``kind``, oldest first (the date in the name sorts them)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    return sorted(d.glob(KINDS[kind]))


def load(kind: str = "h200", results_dir=None):
    """The latest record of ``kind``: a dict for "h200" (the benchmark) and "ceilings" (copy
    bandwidth and matmul rates of one GPU), the text for "sanitizer"."""
    files = available(kind, results_dir)
    if not files:
        raise FileNotFoundError(f"no recorded {kind} results under {results_dir or RESULTS_DIR}; "
                                f"run scripts/gpu_all.sh on a GPU, then scripts/readme_table.py --from OUTDIR")
    path = files[-1]
    if kind == "sanitizer":
        return path.read_text()
    rec = json.loads(path.read_text())
    rec.setdefault("source_file", path.name)
    return rec


def load_file(name: str, results_dir=None) -> dict:
    """One recorded benchmark run by its file name under the results folder (a run filed for one
    question, ``h100_<date>_<what>.json``, rather than the latest of a kind); ValueError naming
    ``name`` when there is no such record."""
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".json"):
        raise ValueError(f"name: the file name of a .json record under {d}, got {name!r}")
    path = d / name
    if not path.is_file():
        raise ValueError(f"name: no record {name!r} under {d}")
    rec = json.loads(path.read_text())
    rec.setdefault("source_file", path.name)
    return rec


def load_profiled(results_dir=None) -> dict | None:
    """The record a limits profile (:func:`limits_table`) comes from: the latest H200 record when
    it holds one, else the newest record of any GPU that does (files named ``<gpu>_<date>...``,
    newest date first; the label says which GPU), else None."""
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    h200 = available("h200", d)
    others = sorted((p for p in d.glob("*_20??-??-??*.json") if p not in h200),
                    key=lambda p: (p.name.split("_")[1], p.name), reverse=True)
    for path in ([h200[-1]] if h200 else []) + others:
        rec = json.loads(path.read_text())
        if isinstance(rec, dict) and rec.get("traffic", {}).get("limits", {}).get("cases"):
            rec.setdefault("source_file", path.name)
            return rec
    return None


def label(rec: dict) -> str:
    """'recorded on <GPU>, <date>, driver ..., CUDA ..., torch ..., numba ..., cupy ...'."""
    env = rec.get("env", rec)
    return (f"recorded on {env.get('gpu', '?')}, {env.get('date_utc', '?')}, "
            f"driver {env.get('driver', '?')}, CUDA {env.get('cuda_torch', '?')}, "
            f"torch {env.get('torch', '?')}, numba {env.get('numba', '?')} "
            f"(numba-cuda {env.get('numba_cuda', '?')}), cupy {env.get('cupy', '?')}")


def bench_rows(rec: dict, *, section=None, kind=None, dtype=None, causal=None, ok_only=True,
               runners=None, vs=None, **where) -> list[dict]:
    """The benchmark's rows flattened: one dict per (case, runner), case fields merged in.

    ``runners``: keep only these runners, in this order; names may be shell patterns
    ("numba:*").  ``vs``: a runner name; each row gets ``speed_vs_<vs>`` = that runner's time
    / this row's time, both from the same case (absent where ``vs`` did not run there).
    ``where``: other fields a row must equal, e.g. ``batch=1, seqlen=32768``.
    """
    out = []
    for c in rec.get("bench", rec).get("cases", []):
        if section is not None and c.get("section") != section:
            continue
        if kind is not None and c.get("kind") != kind:
            continue
        if dtype is not None and c.get("dtype") != dtype:
            continue
        if causal is not None and c.get("causal") != causal:
            continue
        for r in c.get("results", []):
            if ok_only and r.get("status") != "ok":
                continue
            row = dict(r)
            row.update({k: c[k] for k in ("section", "kind", "dtype", "causal") if k in c})
            row.update(c.get("shape", {}))
            row["default_ran"] = c.get("default_ran")
            row["best_sdpa"] = c.get("best_sdpa")
            if any(row.get(k) != want for k, want in where.items()):
                continue
            if runners is not None and not any(fnmatch.fnmatchcase(row["runner"], p) for p in runners):
                continue
            if vs is not None:
                base = next((b for b in c.get("results", []) if b["runner"] == vs and b.get("status") == "ok"), None)
                if base is not None and row.get("ms"):
                    row[f"speed_vs_{vs}"] = base["ms"] / row["ms"]
            out.append(row)
    if runners is not None:       # case by case, runners in the order asked for (stable sort)
        case_of = {id(r): i for i, r in enumerate(out)}
        out.sort(key=lambda r: (r["section"], r.get("dtype"), r.get("causal"), r.get("batch"), r.get("seqlen"),
                                next(i for i, p in enumerate(runners) if fnmatch.fnmatchcase(r["runner"], p)),
                                case_of[id(r)]))
    return out


def ratio(rec: dict, runner: str, baseline: str, **filters) -> float:
    """Speed of ``runner`` relative to ``baseline`` (baseline ms / runner ms) in the ONE recorded case
    that ``filters`` (as for :func:`bench_rows`) select; ValueError unless exactly one matches."""
    rows = [r for r in bench_rows(rec, runners=(runner,), vs=baseline, **filters) if f"speed_vs_{baseline}" in r]
    if len(rows) != 1:
        raise ValueError(f"filters: {len(rows)} recorded cases have both {runner!r} and {baseline!r} "
                         f"for {filters}; narrow them to one")
    return rows[0][f"speed_vs_{baseline}"]


def traffic_rows(rec: dict, ok_only=True) -> list[dict]:
    """Measured vs modelled DRAM bytes, one dict per (case, size)."""
    cases = rec.get("traffic", {}).get("cases", [])
    return [c for c in cases if not ok_only or "measured_read" in c]


# --------------------------------------------------------------------------- tables
def backward_traffic_table(rec: dict) -> str:
    """The GPU backward's DRAM bytes per kernel: Nsight Compute's next to the model's, in MB.

    From the record's traffic cases named "<backend> backward <version>" (written by
    scripts/profile_traffic.py); one block per case, one line per kernel part of
    :func:`iokernels.backward.traffic_model_gpu_kernels` ("other": kernels the model does
    not name, such as a copy).  An empty string when the record has no such case.
    """
    rows = [r for r in traffic_rows(rec) if " backward " in r.get("case", "") and r.get("measured_by_kernel")]
    if not rows:
        return ""
    lines = [f"{'case':<20}{'size':<18}{'kernel':<8}{'read MB':>10}{'model':>10}{'write MB':>10}{'model':>10}"
             f"{'meas/model':>11}"]
    for r in rows:
        model = r.get("model_by_kernel") or {}
        parts = list(model) + [p for p in r["measured_by_kernel"] if p not in model]
        for part in parts:
            rd, wr, _ = r["measured_by_kernel"].get(part, (0.0, 0.0, 0))
            mr, mw = model.get(part, (0, 0))
            ratio = f"{(rd + wr) / (mr + mw):>11.2f}" if mr + mw else f"{'-':>11}"
            lines.append(f"{r['case']:<20}{r['size']:<18}{part:<8}{rd / 1e6:>10.1f}{mr / 1e6:>10.1f}"
                         f"{wr / 1e6:>10.1f}{mw / 1e6:>10.1f}{ratio}")
        total = (r["measured_read"] + r["measured_written"]) / max(1, r["model_read"] + r["model_written"])
        lines.append(f"{r['case']:<20}{r['size']:<18}{'all':<8}{r['measured_read'] / 1e6:>10.1f}"
                     f"{r['model_read'] / 1e6:>10.1f}{r['measured_written'] / 1e6:>10.1f}"
                     f"{r['model_written'] / 1e6:>10.1f}{total:>11.2f}")
    return "\n".join(lines)

def limits_table(rec: dict, cases=None) -> str:
    """What bounds each profiled kernel (scripts/profile_traffic.py's limits profile, filed in
    the record's traffic under "limits"): a line a kernel that takes at least a tenth of its
    case's time -- its time, the SM's, DRAM's and issue slots' share of their peak, the
    achieved occupancy, the registers a thread, the busiest pipes (% of peak) and the costliest
    stall reasons (cycles an issued instruction).  ``cases``: only the cases of these names, in
    the record's order.  An empty string when the record has none of them."""
    cases = [c for c in rec.get("traffic", {}).get("limits", {}).get("cases", [])
             if c.get("kernels") and (cases is None or c.get("case") in cases)]
    if not cases:
        return ""

    def num(v, width, fmt=".0f"):
        return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"

    def top(d, n=3):
        return ", ".join(f"{k} {v:.0f}" if v >= 10 else f"{k} {v:.1f}" for k, v in list(d.items())[:n]) or "-"
    lines = [f"{'case':<27}{'kernel':<30}{'share':>6}{'us':>9}{'SM%':>5}{'DRAM%':>6}{'issue%':>7}{'occ%':>5}"
             f"{'regs':>5}  busiest pipes (%)  |  costliest stalls (cycles an instruction)"]
    for c in cases:
        for k in c["kernels"]:
            if (k.get("share") or 0) < 0.1:
                continue
            lines.append(f"{c['case']:<27}{k['kernel'][:29]:<30}{num(k.get('share'), 6, '.2f')}"
                         f"{num(k.get('time_us'), 9, '.1f')}{num(k.get('sm_pct'), 5)}{num(k.get('dram_pct'), 6)}"
                         f"{num(k.get('issue_pct'), 7)}{num(k.get('occupancy_pct'), 5)}{num(k.get('registers'), 5)}"
                         f"  {top(k.get('pipes') or {})}  |  {top(k.get('stalls') or {})}")
    return "\n".join(lines)


def short_label(rec: dict) -> str:
    env = rec.get("env", rec)
    return f"recorded on {env.get('gpu', '?')}, {env.get('date_utc', '?')[:10]}, torch {env.get('torch', '?')}"


def table(rec: dict, section: str, columns=("dtype", "causal", "batch", "seqlen", "runner", "ms", "rate",
                                            "unit", "speed_vs_best_sdpa"), **filters) -> str:
    """A plain-text table of one section's rows (ok rows only); ``filters`` as for :func:`bench_rows`
    (with ``vs=...`` the column ``speed_vs_<vs>`` is added unless ``columns`` names it)."""
    rows = bench_rows(rec, section=section, **filters)
    if filters.get("vs") and f"speed_vs_{filters['vs']}" not in columns:
        columns = (*columns, f"speed_vs_{filters['vs']}")
    return format_rows(rows, columns)


def format_rows(rows: list[dict], columns) -> str:
    """Rows (dicts) as a plain-text table of ``columns``: floats to 4 significant digits, a
    missing value or None as an empty cell."""
    def cell(r, c):
        v = r.get(c)
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(cell(r, c)) for r in rows)) if rows else len(c) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(r, c).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def cache_rows(rec: dict) -> list[dict]:
    """The paged decode rows over quantized caches and sliding windows (the bench's decode
    cases that name a ``kv_dtype``), one dict a timed runner: batch, cache (its kv_dtype),
    window ("all" or "<left> keys"), runner (backend and version, "cupy v4"; "<backend>
    default" for rows without a version), ms, rate (TB/s of the bytes the cache holds) and
    speed_vs_16bit (the same runner's time over the 16-bit cache, whole window, over this one)."""
    cases = [c for c in rec.get("bench", rec).get("cases", []) if c.get("section") == "decode" and "kv_dtype" in c]

    def runner(x):
        words = x["runner"].split(" paged ")[0]
        return words if words != x["group"] else f"{x['group']} default"

    out = []
    for c in cases:
        for x in (x for x in c["results"] if x.get("ms")):
            base = next((y["ms"] for b in cases if b["shape"] == c["shape"] and b["kv_dtype"] == c["dtype"]
                         and not b.get("window") for y in b["results"] if y.get("ms") and runner(y) == runner(x)),
                        None)
            out.append(dict(batch=c["shape"]["batch"], cache=c["kv_dtype"],
                            window=f"{c['window'][0]} keys" if c.get("window") else "all", runner=runner(x),
                            ms=x["ms"], rate=x["rate"], speed_vs_16bit=base / x["ms"] if base else None))
    return out


def fallback_report(rec: dict) -> str:
    """Per case: the kernel SDPA's default dispatch ran, and which forced kernels were unavailable.

    "not recorded": the case did not ask the default dispatch (the backward times forced
    kernels only; the quantized-cache decode cases time no SDPA kernel).
    ``iokernels.viz.sdpa.fallback_table`` shows the same, grouped, as a table."""
    lines = []
    for c in rec.get("bench", rec).get("cases", []):
        if c.get("kind") not in ("prefill", "decode"):
            continue
        unavailable = [r["runner"].split(":")[1] for r in c["results"]
                       if r["group"] == "sdpa" and r.get("status", "").startswith("unavailable")]
        s = c["shape"]
        lines.append(f"{c['section']:<9}{c['dtype']:<9} N={s.get('seqlen'):<6} B={s.get('batch'):<3} "
                     f"default ran: {c.get('default_ran') or 'not recorded':<12} refused when forced: "
                     f"{', '.join(unavailable) or 'none'}"
                     + (f"   !! {c['silent_fallback']}" if c.get("silent_fallback") else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- two records
#: runner names of records made before every row was named ``<backend>:<version>``
LEGACY_RUNNERS = {"cupy:split": "cupy:v3", "cupy:split-v1": "cupy:v1", "cupy:split-v2": "cupy:v2",
                  "cupy gather": "cupy:v1 gather"}


def _canonical(runner: str) -> str:
    base, _, suffix = runner.partition(" ")
    base = LEGACY_RUNNERS.get(base, base)
    return LEGACY_RUNNERS.get(runner, f"{base} {suffix}".strip())


#: the same-run ratio of a section that has no SDPA row: the gathers' (vs the device copy) and
#: MLA decode's (vs torch's two matrix products)
OWN_BASELINES = ("speed_vs_copy", "speed_vs_torch_matmul")


def compare(old: dict, new: dict, key: str = "speed_vs_best_sdpa") -> list[dict]:
    """Each runner's same-run ratio (``key``: vs the best SDPA kernel; in a section without
    one, vs its own baseline, :data:`OWN_BASELINES`) in two records, case by case: one dict per
    (case, runner) present in both, with ``old``, ``new`` and ``change`` = new / old.  Ratios,
    never absolute times, so two runs on different days compare fairly."""
    def index(rec):
        out = {}
        for r in bench_rows(rec):
            k = r.get(key)
            for own in OWN_BASELINES:
                k = r.get(own) if k is None else k
            if k is None:
                continue
            shape = tuple(r.get(f) for f in ("batch", "heads", "heads_q", "heads_kv", "seqlen", "head_dim"))
            out[(r["section"], r.get("dtype"), r.get("causal"), shape, _canonical(r["runner"]))] = k
        return out
    a, b = index(old), index(new)
    rows = []
    for k in sorted(set(a) & set(b), key=str):
        section, dtype, causal, shape, runner = k
        rows.append(dict(section=section, dtype=dtype, causal=causal, shape=shape, runner=runner,
                         old=a[k], new=b[k], change=b[k] / a[k] if a[k] else float("nan")))
    return rows



def hopper_gemm_rows(rec: dict) -> list[dict]:
    """The wgmma GEMM's timings next to torch's matmul, from the last run of a "hopper" record
    that timed it: one dict per size (n, ours_ms, torch_ms, ours_tflops, torch_tflops, ratio)."""
    runs = [r for r in rec.get("runs", []) if r.get("gemm", {}).get("result", {}).get("timings")]
    if not runs:
        return []
    run = runs[-1]
    return [dict(t, date=run["env"].get("date")) for t in run["gemm"]["result"]["timings"]]


#: the columns of the Hopper ablation, in the order FlashAttention-3's table puts them
ABLATION_RUNNERS = ("v2 (Ampere)", "v3", "v4", "v5", "SDPA flash", "SDPA cudnn")


def hopper_ablation_rows(rec: dict) -> tuple[list[dict], dict | None]:
    """The ablation of the Hopper forward kernels from the last run of a "hopper" record whose
    ablation part finished (every case of ``scripts/hopper_bench.py``'s grid): one dict per
    (head_dim, causal, seqlen) with batch, heads and, for each of ABLATION_RUNNERS that ran,
    TFLOP/s and the ratios to the same run's FLASH and cuDNN kernels.  Returns (rows, env of
    that run); ([], None) when no run has a whole ablation."""
    def whole(run):                      # every (head_dim, seqlen, causal) the run names was timed
        cases = (run.get("ablation") or {}).get("result") or []
        grid = {(c["head_dim"], c["seqlen"], c["causal"]) for c in cases}
        dims, lengths = {g[0] for g in grid}, {g[1] for g in grid}
        return bool(cases) and len(grid) == len(dims) * len(lengths) * 2

    runs = [r for r in rec.get("runs", []) if whole(r)]
    if not runs:
        return [], None
    run = runs[-1]
    rows = []
    for case in run["ablation"]["result"]:
        row = dict(head_dim=case["head_dim"], causal=case["causal"], seqlen=case["seqlen"],
                   batch=case["batch"], heads=case["heads"])
        for name in ABLATION_RUNNERS:
            r = case["rows"].get(name)
            if r and r.get("tflops") is not None:
                row[name] = dict(tflops=r["tflops"], x_flash=r.get("x flash"), x_cudnn=r.get("x cudnn"))
        rows.append(row)
    return rows, run["env"]
