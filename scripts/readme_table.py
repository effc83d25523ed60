"""File a GPU run's outputs as the committed records, and write the README's results table.

    python scripts/readme_table.py --from OUTDIR   # OUTDIR: what scripts/gpu_all.sh wrote
    python scripts/readme_table.py                 # only regenerate the README table

``--from`` writes ``benchmarks/results/h200_<date>.json`` (env + bench + traffic + serve-bench
+ test summary) and ``benchmarks/results/sanitizer_<date>.txt``; then the section of README.md
between ``<!-- recorded-results:start -->`` and ``<!-- recorded-results:end -->`` is
rewritten from the latest records (nothing else in README.md is touched), and the figures
that show a recorded run are redrawn.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from iokernels import recorded  # noqa: E402

START, END = "<!-- recorded-results:start -->", "<!-- recorded-results:end -->"


def _read_json(path: Path) -> dict:
    """A run's JSON output: {} where the stage wrote none, an error entry where it is unreadable."""
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"error": f"{path.name} unreadable"}


def file_run(outdir: Path) -> tuple[Path, Path]:
    """Copy one gpu_all.sh run into benchmarks/results/ under its date."""
    bench = json.loads((outdir / "bench.json").read_text())
    env = bench["env"]
    if not env.get("gpu") or env.get("gpu") == "no GPU":
        raise SystemExit(f"{outdir}: this run saw no GPU; nothing to record")
    date = env["date_utc"][:10]
    traffic, serve = _read_json(outdir / "traffic.json"), _read_json(outdir / "serve.json")
    tests = ""
    if (outdir / "pytest.txt").exists():
        tests = "\n".join(ln for ln in (outdir / "pytest.txt").read_text().splitlines()
                          if re.search(r"^== python3|^=* ?\d+ (passed|failed)|no tests ran|FAILED|^ERROR ", ln))
    stages = ""
    if (outdir / "summary.txt").exists():
        stages = "\n".join(ln for ln in (outdir / "summary.txt").read_text().splitlines()
                           if ln.startswith("[") or ln.startswith("total wall"))
    rec = {"env": env, "label": recorded.label({"env": env}), "bench": bench, "traffic": traffic,
           "serve": serve, "gpu_tests": tests, "stages": stages,
           "produced_by": "scripts/gpu_all.sh OUTDIR; filed by scripts/readme_table.py --from OUTDIR"}
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^a-z0-9]+", "", env.get("gpu", "gpu").lower().replace("nvidia", "")) or "gpu"
    jpath = res / f"{gpu}_{date}.json"
    if not traffic.get("cases") and jpath.exists():
        old = json.loads(jpath.read_text()).get("traffic", {})
        if old.get("cases"):                  # keep an earlier run's measurement, say so
            old["note"] = (old.get("note", "") + "; kept from the earlier record of this date: the run of "
                           f"{env['date_utc']} produced no traffic measurement").lstrip("; ")
            if traffic.get("limits"):         # ... but this run's profile of what bounds each kernel
                old["limits"] = traffic["limits"]
            rec["traffic"] = old
    jpath.write_text(json.dumps(rec, indent=1))
    spath = res / f"sanitizer_{date}.txt"
    if (outdir / "sanitizer.txt").exists():
        spath.write_text((outdir / "sanitizer.txt").read_text())
    return jpath, spath


# --------------------------------------------------------------------------- the table
def _fmt_ms(r):
    return f"{r['ms']:.3f}" if r else "–"


def _find(rows, runner):
    for r in rows:
        if r["runner"] == runner:
            return r
    return None


#: the prefill tables' first columns, in this order; then every runner of OUR_FAMILIES in the record
#: ("numba", "numba:v1", ..., "cupy:v1", "cupy:v1b", ...), a family at a time, sorted by name
SDPA_COLUMNS = ("sdpa:cudnn", "sdpa:flash", "sdpa:efficient", "sdpa:math", "torch naive")
OUR_FAMILIES = ("numba", "cupy")


def prefill_table(rec) -> list[str]:
    lines = []
    for dtype in ("bfloat16", "float32"):
        rows = recorded.bench_rows(rec, section="prefill", dtype=dtype)
        if not rows:
            continue
        present = {x["runner"] for x in rows}
        runners = [r for r in SDPA_COLUMNS if r in present]
        runners += sorted((r for r in present if r.split(":")[0] in OUR_FAMILIES),   # every version recorded
                          key=lambda r: (OUR_FAMILIES.index(r.split(":")[0]), r))
        Ns = sorted({r["seqlen"] for r in rows})
        shape = rows[0]
        lines.append(f"**Prefill, {dtype}, B={shape['batch']} H={shape['heads']} d={shape['head_dim']}, causal** "
                     f"(ms, median; TFLOP/s in brackets)")
        lines.append("")
        lines.append("| N | " + " | ".join(runners) + " |")
        lines.append("|---" * (len(runners) + 1) + "|")
        for N in Ns:
            cells = []
            for rn in runners:
                r = next((x for x in rows if x["seqlen"] == N and x["runner"] == rn), None)
                cells.append(f"{r['ms']:.3f} ({r['rate']:.0f})" if r else "–")
            lines.append(f"| {N} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def compare_table(rec) -> list[str]:
    rows = recorded.bench_rows(rec, section="compare")
    if not rows:
        return []
    lines = ["**Our kernels vs the best SDPA kernel, prefill B=8 H=16 N=4096 d=128** "
             "(speed = best SDPA time / this time)", "",
             "| dtype | causal | best SDPA | kernel | ms | TFLOP/s | speed vs best SDPA |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["group"] in ("numba", "cupy", "torch"):
            lines.append(f"| {r['dtype']} | {r['causal']} | {r['best_sdpa']} | {r['runner']} | {r['ms']:.3f} | "
                         f"{r['rate']:.1f} | {r.get('speed_vs_best_sdpa', float('nan')):.3f} |")
    return lines + [""]


#: records made before rows carried a ``default`` flag name each family's default decode row
LEGACY_DECODE_DEFAULTS = {"numba": "numba:v3", "cupy": "cupy:split"}


def _default_runner(rows, family: str) -> str:
    """The runner the family's public decode picks: the row flagged ``default`` in the record
    (the benchmark marks the version the registry chooses), else the legacy name."""
    flagged = sorted({r["runner"] for r in rows if r.get("default") and r["runner"].split(":")[0] == family
                      and not r["runner"].endswith((" paged", " gather"))})
    return flagged[0] if flagged else LEGACY_DECODE_DEFAULTS[family]


def decode_table(rec) -> list[str]:
    rows = [r for r in recorded.bench_rows(rec, section="decode") if r.get("best_sdpa")]   # not the cache rows
    if not rows:
        return []
    nb, cu = _default_runner(rows, "numba"), _default_runner(rows, "cupy")
    lines = ["**Decode, GQA 32/8, d=128, each library's default kernel** (TB/s of K+V read; speed vs "
             "best SDPA; every version's row is in the record)", "",
             f"| dtype | B | N | best SDPA | TB/s | {nb} | {cu} | {nb} paged | {cu} paged | "
             "paged / contiguous (numba, cupy) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["dtype"], r["batch"], r["seqlen"]) for r in rows})
    for dt, B, N in keys:
        rs = [r for r in rows if (r["dtype"], r["batch"], r["seqlen"]) == (dt, B, N)]
        best = rs[0]["best_sdpa"]
        b = _find(rs, best)
        cells, found = [], {}
        for name in (nb, cu, f"{nb} paged", f"{cu} paged"):
            r = next((x for x in rs if x["runner"] == name), None)
            found[name] = r
            cells.append(f"{r['rate']:.2f} ({r['speed_vs_best_sdpa']:.2f}x)" if r else "–")
        ratios = []
        for fam in (nb, cu):
            c, p = found[fam], found[f"{fam} paged"]
            ratios.append(f"{c['ms'] / p['ms']:.2f}" if c and p else "–")
        lines.append(f"| {dt} | {B} | {N} | {best} | {b['rate']:.2f} | " + " | ".join(cells) + " | "
                     + ", ".join(ratios) + " |")
    return lines + [""]


def cache_table(rec) -> list[str]:
    """Paged decode over quantized caches and a sliding window, next to the 16-bit cache."""
    rows = recorded.cache_rows(rec)
    if not rows:
        return []
    lines = ["**Paged decode over a quantized cache and a sliding window** (GQA 32/8, d=128, N=32768, "
             "bfloat16 queries; TB/s of the bytes the cache holds; speed vs the 16-bit cache, whole window)", "",
             "| B | cache | window | runner | ms | TB/s | speed vs 16-bit cache |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = "" if r["speed_vs_16bit"] is None else f"{r['speed_vs_16bit']:.2f}"
        lines.append(f"| {r['batch']} | {r['cache']} | {r['window']} | {r['runner']} | "
                     f"{r['ms']:.3f} | {r['rate']:.2f} | {speed} |")
    return lines + [""]


def mla_table(rec) -> list[str]:
    """MLA decode (absorbed form) next to torch implementations of the same math."""
    rows = recorded.bench_rows(rec, section="mla")
    if not rows:
        return []
    lines = ["**MLA decode, absorbed form** (bfloat16, 128 query heads, latent 512 + rope 64; TFLOP/s, TB/s of "
             "latent cache read, fraction of the roofline bound of the shape, speed vs torch matmuls)", "",
             "| B | N | runner | ms | TFLOP/s | cache TB/s | of roofline bound | speed vs torch:matmul |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['seqlen']} | {r['runner']} | {r['ms']:.4f} | {r['tflops']:.0f} | "
                     f"{r['cache_TBps']:.2f} | {r['roofline_fraction']:.2f} | {r['speed_vs_torch_matmul']:.2f} |")
    return lines + [""]


def gather_table(rec) -> list[str]:
    rows = recorded.bench_rows(rec, section="gather")
    if not rows:
        return []
    lines = ["**Paged gather vs a device copy of the same bytes** (TB/s, read + write)", "",
             "| N | runner | ms | TB/s | speed vs copy |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seqlen']} | {r['runner']} | {r['ms']:.4f} | {r['rate']:.2f} | "
                     f"{r.get('speed_vs_copy', float('nan')):.3f} |")
    return lines + [""]


def traffic_table(rec) -> list[str]:
    rows = recorded.traffic_rows(rec)
    if not rows:
        return []
    lines = ["**DRAM bytes: measured (Nsight Compute) vs the traffic model**", "",
             "| kernel | size | measured MB (read + write) | model MB | measured / model | measured / minimum |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        m = (r.get("model_read") or 0) + (r.get("model_written") or 0)
        lines.append(f"| {r['case']} | {r['size']} | {(r['measured_read'] + r['measured_written']) / 1e6:.1f} | "
                     f"{m / 1e6:.1f} | {r.get('measured_over_model') or float('nan'):.3f} | "
                     f"{r.get('measured_over_mandatory') or float('nan'):.3f} |")
    note = rec.get("traffic", {}).get("note")
    lines += ["", "minimum: each input read once, each output written once. Why the ratios differ: "
              "benchmarks/NOTES.md."] + ([f"({note})"] if note else [])
    return lines + [""]


def limits_table(rec) -> list[str]:
    table = recorded.limits_table(rec)
    if not table:
        return []
    return ["**What bounds each kernel that misses a bar** (Nsight Compute; `scripts/profile_traffic.py limits`: "
            "the share of peak of the SM, DRAM and issue slots, occupancy, the busiest pipes, the costliest "
            "stalls in cycles an issued instruction)", "", "```", table, "```", ""]


def _cliff_shape(r) -> str:
    if r["kind"] == "decode":
        return f"B={r['batch']} {r['heads_q']}/{r['heads_kv']} N={r['seqlen']} d={r['head_dim']}"
    gqa = f"{r['heads']}/{r['heads_kv']}" if r.get("heads_kv", r["heads"]) != r["heads"] else f"H={r['heads']}"
    return f"B={r['batch']} {gqa} N={r['seqlen']} d={r['head_dim']}" + (" causal" if r.get("causal") else "")


def cliff_table(rec) -> list[str]:
    """The cliff sweep: for each family (decode, prefill), our default's worst and median speed
    vs the best SDPA kernel of the same case, where the worst one is, and the median host cost
    of a call next to the best SDPA kernel's."""
    rows = [r for r in recorded.bench_rows(rec, section="cliff") if r.get("default")
            and r.get("speed_vs_best_sdpa") is not None]
    if not rows:
        return []
    summary = next((c["summary"] for c in rec.get("bench", rec).get("cases", [])
                    if c.get("section") == "cliff" and c.get("summary")), {})
    lines = ["**Cliff sweep: our default vs the best SDPA kernel of each case** (bfloat16; speed = best SDPA "
             "time / ours, device time; host = median Python cost of one call, ours / the best SDPA kernel's)", "",
             "| family | cases | worst speed | at | median speed | median host ms (ours / SDPA) |",
             "|---|---|---|---|---|---|"]
    for kind in ("decode", "prefill"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        worst = min(rs, key=lambda r: r["speed_vs_best_sdpa"])
        speeds = sorted(r["speed_vs_best_sdpa"] for r in rs)
        ours = sorted(r["host_ms"] for r in rs if r.get("host_ms") is not None)
        sdpa = sorted(b["host_ms"] for b in recorded.bench_rows(rec, section="cliff", kind=kind)
                      if b["runner"] == b.get("best_sdpa") and b.get("host_ms") is not None)
        host = (f"{ours[len(ours) // 2]:.3f} / {sdpa[len(sdpa) // 2]:.3f}" if ours and sdpa else "–")
        lines.append(f"| {kind} | {len(rs)} | {worst['speed_vs_best_sdpa']:.2f} ({worst['runner']}) | "
                     f"{_cliff_shape(worst)} | {speeds[len(speeds) // 2]:.2f} | {host} |")
    if summary:
        lines += ["", f"({summary.get('ran')} of {summary.get('planned')} planned cases ran in the "
                      f"{summary.get('budget_s'):.0f} s time box, {summary.get('skipped_memory')} skipped for "
                      f"memory; the order: {summary.get('order')}.)"]
    return lines + [""]


def captured_table(rec) -> list[str]:
    """The 32-layer decode step, eager and captured as a CUDA graph, ours next to SDPA's."""
    cases = [c for c in rec.get("bench", rec).get("cases", []) if c.get("section") == "captured"]
    if not cases:
        return []
    c = cases[0]
    s = c["shape"]
    lines = [f"**A decode step of {s['layers']} layers** (B={s['batch']}, GQA {s['heads_q']}/{s['heads_kv']}, "
             f"N={s['seqlen']}, d={s['head_dim']}, {c['dtype']}; speed = SDPA's captured step time / this one)", "",
             "| runner | ms | host ms | speed vs SDPA captured | note |", "|---|---|---|---|---|"]
    for r in c["results"]:
        ok = r.get("status") == "ok"
        ms = f"{r['ms']:.3f}" if ok else "–"
        host = f"{r['host_ms']:.3f}" if ok and r.get("host_ms") is not None else "–"
        speed = "" if r.get("speed_vs_sdpa_captured") is None else f"{r['speed_vs_sdpa_captured']:.2f}"
        note = "" if ok else r.get("status", "")[:120].replace("|", "/")
        lines.append(f"| {r['runner']} | {ms} | {host} | {speed} | {note} |")
    return lines + [""]


def fp8_table(rec) -> list[str]:
    """The opt-in FP8 forward next to the 16-bit Hopper v5 and SDPA (speed = v5's time / this time)."""
    cases = [c for c in rec.get("bench", rec).get("cases", []) if c.get("section") == "fp8"]
    lines = []
    for c in cases:
        s = c["shape"]
        lines += [f"**FP8 forward (opt-in), B={s['batch']} H={s['heads']} N={s['seqlen']} d={s['head_dim']}, "
                  f"{c['dtype']} in and out, {'causal' if c['causal'] else 'non-causal'}** "
                  "(speed vs bf16 = the 16-bit v5's time / this time)", "",
                  "| runner | ms | TFLOP/s | speed vs bf16 | speed vs best SDPA | note |", "|---|---|---|---|---|---|"]
        for r in c["results"]:
            if r.get("runner") == "sdpa:default":
                continue
            ok = r.get("status") == "ok"
            cells = [f"{r['ms']:.3f}", f"{r['rate']:.0f}"] if ok else ["–", "–"]
            cells += ["" if r.get(k) is None else f"{r[k]:.2f}" for k in ("speed_vs_bf16", "speed_vs_best_sdpa")]
            cells.append("" if ok else r.get("status", "")[:120].replace("|", "/"))
            lines.append(f"| {r['runner']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def sanitizer_lines() -> list[str]:
    try:
        text = recorded.load("sanitizer")
    except FileNotFoundError:
        return []
    head = text.split("\n\n", 1)[0].splitlines()
    keep = [ln for ln in head if re.match(r"(memcheck|racecheck|synccheck|initcheck|total)", ln)]
    return ["**compute-sanitizer** over every CUDA kernel at ragged shapes:", "", "```"] + keep + ["```", ""]


def backward_table(rec) -> list[str]:
    """Forward + backward (a training step) next to SDPA, and the cost of a deterministic dQ."""
    rows = recorded.bench_rows(rec, section="backward")
    if not rows:
        return []
    lines = ["**Forward + backward, and the backward alone: atomic vs deterministic dQ** (ms, median; "
             "speed = best SDPA fwd+bwd time / this time; dQ elements that differ between two runs)", "",
             "| dtype | shape | causal | runner | ms | TFLOP/s | speed vs best SDPA | dQ elements differing |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = r.get("dq_elements_differing_between_two_runs")
        lines.append(f"| {r['dtype']} | B={r['batch']} H={r['heads']} N={r['seqlen']} d={r['head_dim']} | "
                     f"{r['causal']} | {r['runner']} | {r['ms']:.3f} | {r['rate']:.1f} | "
                     f"{r.get('speed_vs_best_sdpa', float('nan')):.3f} | {'' if diff is None else f'{diff:,}'} |")
    return lines + [""]


def hopper_table() -> list[str]:
    """The Hopper forward kernels' ablation (the last whole one in the "hopper" record)."""
    try:
        rows, env = recorded.hopper_ablation_rows(recorded.load("hopper"))
    except FileNotFoundError:
        return []
    if not rows:
        return []
    names = recorded.ABLATION_RUNNERS
    lines = [f"**Hopper forward ablation** (`scripts/hopper_bench.py --parts ablation`, {env.get('gpu')}, "
             f"{env.get('date')}; bf16, B x N = {rows[0]['batch'] * rows[0]['seqlen']:,} tokens; TFLOP/s, "
             "causal counting the visible half; v5's speed as a ratio to FLASH and cuDNN of the same run)", "",
             "| d | causal | N | " + " | ".join(names) + " | v5 / FLASH | v5 / cuDNN |",
             "|---" * (len(names) + 5) + "|"]
    for r in sorted(rows, key=lambda r: (-r["head_dim"], r["causal"], r["seqlen"])):
        cells = [f"{r[n]['tflops']:.0f}" if n in r else "" for n in names]
        v5 = r.get("v5", {})
        lines.append(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | " + " | ".join(cells)
                     + f" | {v5.get('x_flash', float('nan')):.2f} | {v5.get('x_cudnn', float('nan')):.2f} |")
    return lines + [""]


def section_text() -> str:
    try:
        rec = recorded.load("h200")
    except FileNotFoundError:
        return "_No recorded results yet: run `scripts/gpu_all.sh` on a GPU machine; its generator fills this section._"
    lines = [f"Generated by `scripts/readme_table.py` from `benchmarks/results/{rec['source_file']}`: "
             f"{rec['label']}.", ""]
    if rec.get("bench", {}).get("note"):
        lines += [f"({rec['bench']['note']}.)", ""]
    tables = (prefill_table, compare_table, decode_table, cliff_table, captured_table, cache_table, mla_table,
              gather_table, backward_table, fp8_table, traffic_table, limits_table)
    parts = [lambda p=p: p(rec) for p in tables] + [hopper_table]
    for part, name in zip(parts, [t.__name__.replace("_table", "") for t in tables] + ["hopper"]):
        try:
            lines += part()
        except Exception as e:  # a partial record still gives the other tables
            lines += [f"_({name} table: {type(e).__name__}: {e})_", ""]
    lines += sanitizer_lines()
    lines.append("Notes on these numbers: benchmarks/NOTES.md.")
    return "\n".join(lines).rstrip()


def write_readme(readme=ROOT / "README.md") -> bool:
    text = Path(readme).read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: markers {START} / {END} not found")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + START + "\n" + section_text() + "\n" + END + tail
    if new != text:
        Path(readme).write_text(new)
        return True
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", default=None, help="a gpu_all.sh output folder to file first")
    a = p.parse_args(argv)
    if a.src:
        j, s = file_run(Path(a.src))
        print(f"wrote {os.path.relpath(j, ROOT)}, {os.path.relpath(s, ROOT)}")
        # two committed figures (roofline.png, traffic_vs_n.png) show the latest record's measured
        # bytes: redraw them with it, as `python -m iokernels figures` would
        from iokernels.viz import figures
        figures.write_all(ROOT / "figures", progress=False)
        print("figures/ redrawn from the new record")
    changed = write_readme()
    print("README.md table " + ("updated" if changed else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
