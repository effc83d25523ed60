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

import json
from pathlib import Path

#: where the records live (a checkout's benchmarks/results)
RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

#: kind -> file name pattern
KINDS = {"h200": "h200_*.json", "sanitizer": "sanitizer_*.txt"}


def available(kind: str = "h200", results_dir=None) -> list[Path]:
    """Recorded files of ``kind``, oldest first (the date in the name sorts them)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    return sorted(d.glob(KINDS[kind]))


def load(kind: str = "h200", results_dir=None):
    """The latest record of ``kind``: a dict for "h200", the text for "sanitizer"."""
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


def label(rec: dict) -> str:
    """'recorded on <GPU>, <date>, driver ..., CUDA ..., torch ..., numba ..., cupy ...'."""
    env = rec.get("env", rec)
    return (f"recorded on {env.get('gpu', '?')}, {env.get('date_utc', '?')}, "
            f"driver {env.get('driver', '?')}, CUDA {env.get('cuda_torch', '?')}, "
            f"torch {env.get('torch', '?')}, numba {env.get('numba', '?')} "
            f"(numba-cuda {env.get('numba_cuda', '?')}), cupy {env.get('cupy', '?')}")


def bench_rows(rec: dict, *, section=None, kind=None, dtype=None, causal=None, ok_only=True) -> list[dict]:
    """The benchmark's rows flattened: one dict per (case, runner), case fields merged in."""
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
            out.append(row)
    return out


def traffic_rows(rec: dict, ok_only=True) -> list[dict]:
    """Measured vs modelled DRAM bytes, one dict per (case, size)."""
    cases = rec.get("traffic", {}).get("cases", [])
    return [c for c in cases if not ok_only or "measured_read" in c]
