"""Notebook 10's figures and tables: SDPA's kernels next to ours, from a recorded GPU run.

Every function reads a record (``iokernels.recorded.load("h200")`` or one measured now) and
draws or tabulates it; nothing here times anything.  Runner colours come from
:mod:`iokernels.viz.palette`; legends sit outside the axes.
"""
from __future__ import annotations

from ..core import recorded
from . import exact_log
from .htmltable import Table
from .palette import colour, traffic_colour

__all__ = ["plot_prefill", "traffic_groups", "plot_traffic", "traffic_table", "compare_table",
           "fallback_table", "decode_table", "backend_status_table"]


#: line styles of the runners in the prefill plot (our kernels dashed)
PREFILL_STYLE = {"sdpa:cudnn": "o-", "sdpa:flash": "s-", "sdpa:efficient": "^-", "sdpa:math": "x-",
                 "torch naive": "D-", "numba": "v--", "numba:v1": "1--", "numba:v2": "2--", "numba:v3": "v--",
                 "cupy": "<--", "cupy:v1": "<--", "cupy:v2": ">--"}


def plot_prefill(rec: dict, dtype: str = "bfloat16", section: str = "prefill", axes=None):
    """Time and extra device memory vs N, one line per runner (naive, each SDPA kernel, ours),
    in the runner's palette colour; the legend to the right of the axes."""
    import matplotlib.pyplot as plt
    rows = recorded.bench_rows(rec, section=section, dtype=dtype)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw=dict(right=0.84, wspace=0.25))
    runners = [r for r in PREFILL_STYLE if any(x["runner"] == r for x in rows)]
    runners += sorted({x["runner"] for x in rows if x["group"] in ("numba", "cupy", "triton")} - set(runners))
    for rn in runners:
        rs = sorted((x for x in rows if x["runner"] == rn), key=lambda x: x["seqlen"])
        style = PREFILL_STYLE.get(rn, "--")          # a version not named above: dashed, like our kernels
        axes[0].plot([x["seqlen"] for x in rs], [x["ms"] for x in rs], style, color=colour(rn), label=rn)
        mem = [(x["seqlen"], x["extra_MiB"]) for x in rs if x.get("extra_MiB") is not None and x["group"] != "numba"]
        if mem:
            axes[1].plot(*zip(*mem), style, color=colour(rn), label=rn)
    for ax, yl in zip(axes, ("time per call (ms, median)", "device memory above the inputs (MiB)")):
        exact_log.set_log(ax, "x", base=2)
        exact_log.set_log(ax, "y")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
    axes[-1].legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                    frameon=False)
    shape = rows[0] if rows else {}
    axes[0].figure.suptitle(f"{dtype}, B={shape.get('batch')} H={shape.get('heads')} d={shape.get('head_dim')}"
                            f"{', causal' if shape.get('causal') else ''} -- {recorded.short_label(rec)}", fontsize=9)
    return axes


# --------------------------------------------------------------------------- traffic
#: the traffic record's cases in groups, each a panel (the first word that matches decides)
TRAFFIC_GROUPS = (("prefill forward", ("attention", "flash")), ("decode", ("decode",)),
                  ("copy and paged gather", ("copy", "gather")), ("backward", ("backward",)))


def _split_size(size: str) -> tuple[str, str]:
    """"large det causal" -> ("large", "det causal"): the problem size and the variant."""
    first, _, rest = size.partition(" ")
    return first, rest


def traffic_groups(rec: dict) -> list[tuple[str, list[dict]]]:
    """The measured traffic cases as (group, rows): one row per (case, variant), with the
    ratios measured / model and measured / mandatory of each size ("small", "large")."""
    groups: dict[str, dict] = {g: {} for g, _ in TRAFFIC_GROUPS}
    for r in recorded.traffic_rows(rec):
        size, variant = _split_size(r["size"])
        group = next((g for g, words in TRAFFIC_GROUPS if any(w in r["case"] for w in words)), "other")
        key = (r["case"], variant)
        row = groups.setdefault(group, {}).setdefault(key, dict(case=r["case"], variant=variant, sizes={}))
        model = (r.get("model_read") or 0) + (r.get("model_written") or 0)
        row["sizes"][size] = dict(model_MB=model / 1e6,
                                  measured_MB=(r["measured_read"] + r["measured_written"]) / 1e6,
                                  over_model=r.get("measured_over_model"),
                                  over_mandatory=r.get("measured_over_mandatory"))
    return [(g, list(rows.values())) for g, rows in groups.items() if rows]


#: marker per problem size: small fits in L2, large is several times larger
SIZE_MARKERS = {"small": dict(marker="o", mfc="white"), "large": dict(marker="o")}


def plot_traffic(rec: dict):
    """Measured DRAM bytes over the model's (left) and over the mandatory minimum (right),
    one row per kernel and variant, grouped by what the kernel does; hollow marker: the size
    that fits in L2, filled: the larger one.  Colours: the runner's palette colour."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    groups = traffic_groups(rec)
    if not groups:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no traffic measurements in this record", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    heights = [len(rows) + 0.6 for _, rows in groups]
    inches = 0.27 * sum(heights) + 0.45 * len(groups) + 1.4
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, inches), sharex="col", squeeze=False,
                             gridspec_kw=dict(height_ratios=heights, hspace=0.45, wspace=0.08))
    for (group, rows), row_axes in zip(groups, axes):
        labels = [f"{r['case']} {r['variant']}".strip() for r in rows]
        for ax, key in zip(row_axes, ("over_model", "over_mandatory")):
            for y, r in enumerate(rows):
                for size, style in SIZE_MARKERS.items():
                    v = r["sizes"].get(size, {}).get(key)
                    if v:
                        ax.plot([v], [y], linestyle="none", color=traffic_colour(r["case"]), ms=7, gid=r["case"],
                                **style)
            ax.axvline(1.0, color="grey", lw=0.8, ls=":")
            exact_log.set_log(ax, "x")
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_yticks(range(len(rows)))
            ax.grid(True, axis="x", which="both", alpha=0.3)
        row_axes[0].set_yticklabels(labels, fontsize=8)
        row_axes[1].set_yticklabels([])
        row_axes[0].set_title(group, loc="left", fontsize=9, weight="bold")
    axes[-1][0].set_xlabel("measured / model (bytes as written, no caches)", fontsize=9)
    axes[-1][1].set_xlabel("measured / mandatory (Q, K, V read and O written once)", fontsize=9)
    handles = [Line2D([], [], linestyle="none", color="black", label=label, **SIZE_MARKERS[size])
               for size, label in (("small", "small: fits in L2"), ("large", "large: several times L2"))]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"DRAM bytes measured by Nsight Compute against the model -- {recorded.short_label(rec)}",
                 fontsize=9)
    fig.subplots_adjust(left=0.22, right=0.98, bottom=0.9 / inches, top=1 - 0.55 / inches)
    return fig


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def traffic_table(rec: dict) -> Table:
    """The numbers behind :func:`plot_traffic`: one row per kernel and variant."""
    rows = []
    for group, rs in traffic_groups(rec):
        for r in rs:
            s, large = r["sizes"].get("small", {}), r["sizes"].get("large", {})
            rows.append((group, f"{r['case']} {r['variant']}".strip(),
                         _ratio(s.get("over_model")), _ratio(large.get("over_model")),
                         _ratio(s.get("over_mandatory")), _ratio(large.get("over_mandatory"))))
    return Table(("what", "kernel", "small / model", "large / model", "small / minimum", "large / minimum"),
                 rows, caption=("Measured DRAM bytes over the model's and over the mandatory minimum -- "
                                + recorded.short_label(rec)),
                 note="'-': that size was not profiled for this kernel.")


# --------------------------------------------------------------------------- speed tables
def _cell(r) -> str:
    speed = r.get("speed_vs_best_sdpa")
    return "" if speed is None else f"{speed:.2f}x ({r['rate']:.0f})"


def compare_table(rec: dict) -> Table:
    """Prefill at one shape: each runner's speed vs the best SDPA kernel of the same case and
    its TFLOP/s, one column per (dtype, causal)."""
    rows = recorded.bench_rows(rec, section="compare")
    cols = sorted({(r["dtype"], r["causal"]) for r in rows}, key=lambda c: (c[0] != "bfloat16", c[1]))
    runners = list(dict.fromkeys(r["runner"] for r in rows))
    cell = {(r["runner"], r["dtype"], r["causal"]): _cell(r) for r in rows}
    best = {(r["dtype"], r["causal"]): r["best_sdpa"] for r in rows}
    shape = rows[0] if rows else {}
    return Table(("runner", *(f"{d}{', causal' if c else ''}" for d, c in cols)),
                 [(rn, *(cell.get((rn, *c), "") for c in cols)) for rn in runners],
                 caption=(f"Prefill B={shape.get('batch')} H={shape.get('heads')} N={shape.get('seqlen')} "
                          f"d={shape.get('head_dim')}: speed vs the best SDPA kernel (TFLOP/s) -- "
                          f"{recorded.short_label(rec)}"),
                 note=("speed = the best SDPA kernel's time / this time, both in the same case of the same run; "
                       "best: " + ", ".join(f"{d}{' causal' if c else ''} {best[(d, c)]}" for d, c in cols)
                       + ". An empty cell: that runner does not take that dtype."))


def fallback_table(rec: dict) -> Table:
    """Per recorded group of cases (section, dtype): what SDPA's default dispatch ran and which
    kernels refused the inputs when forced alone.  Cases that time no SDPA kernel (quantized
    caches, sliding windows) are left out, and the note says so; the backward times forced
    kernels only, so its default is "not recorded"."""
    groups: dict = {}
    skipped = 0
    for c in rec.get("bench", rec).get("cases", []):
        if c.get("kind") not in ("prefill", "decode"):
            continue
        sdpa = [r for r in c["results"] if r["group"] == "sdpa"]
        if not sdpa:
            skipped += 1
            continue
        refused = sorted({r["runner"].split(":")[1].split(" ")[0] for r in sdpa
                          if r.get("status", "").startswith("unavailable")})
        ran = c.get("default_ran") or "not recorded"
        key = (c["section"], c["dtype"], ran, ", ".join(refused) or "none", c.get("silent_fallback") or "")
        g = groups.setdefault(key, dict(N=set(), B=set()))
        g["N"].add(c["shape"].get("seqlen"))
        g["B"].add(c["shape"].get("batch"))
    def values(v):
        v = sorted(v)
        return ", ".join(map(str, v)) if len(v) <= 3 else f"{len(v)} from {v[0]} to {v[-1]}"
    rows = [(sec, dt, values(g["N"]), values(g["B"]), ran, refused, fb)
            for (sec, dt, ran, refused, fb), g in groups.items()]
    note = ("'not recorded': the backward section times each kernel forced on its own and does not ask the "
            "default dispatch which one it ran.")
    if skipped:
        note += (f" Left out: {skipped} decode case{'s' if skipped != 1 else ''} over int8 / fp8 caches or a "
                 "sliding window, which time "
                 "only this project's kernels (SDPA takes no quantized cache).")
    header = ("section", "dtype", "N", "B", "default ran", "refused when forced", "silent fall-back")
    if not any(r[-1] for r in rows):                  # no case fell back: no empty column
        header, rows = header[:-1], [r[:-1] for r in rows]
    return Table(header, rows,
                 caption=f"SDPA's dispatch per recorded case -- {recorded.short_label(rec)}", note=note)


def decode_table(rec: dict, dtype: str = "float16", paged: bool = False) -> Table:
    """Decode speed vs the best SDPA kernel, one row per runner, one column per (batch, N)."""
    rows = [r for r in recorded.bench_rows(rec, section="decode", dtype=dtype)
            if "kv_dtype" not in r and (" paged" in r["runner"]) == paged]
    cases = sorted({(r["batch"], r["seqlen"]) for r in rows})
    runners = list(dict.fromkeys(r["runner"] for r in rows))
    speed = {(r["runner"], r["batch"], r["seqlen"]): r.get("speed_vs_best_sdpa") for r in rows}
    shape = rows[0] if rows else {}
    return Table(("runner", *(f"B={b} N={n}" for b, n in cases)),
                 [(rn, *("" if speed.get((rn, *c)) is None else f"{speed[(rn, *c)]:.2f}x" for c in cases))
                  for rn in runners],
                 caption=(f"Decode {dtype}{', paged cache' if paged else ''}, GQA {shape.get('heads_q')}/"
                          f"{shape.get('heads_kv')}, d={shape.get('head_dim')}: speed vs the best SDPA kernel "
                          f"-- {recorded.short_label(rec)}"),
                 note="speed = the best SDPA kernel's time / this time, same case, same run.")


def backend_status_table(status: dict) -> Table:
    """``torch_sdpa.backend_status``'s dict as a table: each kernel runs or refuses, the reason
    once (torch gives every refused kernel the same message on a CPU)."""
    reasons: list[str] = []
    rows = []
    for name, s in status.items():
        if name == "default":
            continue
        if s == "ok":
            rows.append((name, "runs", ""))
            continue
        reason = s.removeprefix("unavailable: ")
        if reason not in reasons:
            reasons.append(reason)
        rows.append((name, "refuses", f"reason {reasons.index(reason) + 1}"))
    note = " ".join(f"Reason {i + 1}: {r}" for i, r in enumerate(reasons))
    return Table(("kernel forced alone", "result", "why"), rows,
                 caption=f"default dispatch ran: {status.get('default', 'not asked')}", note=note or None)


def measured_parts_figure(rec: dict):
    """:func:`iokernels.viz.figures.measured_vs_model` on a figure of its own."""
    from .figures import _figure, measured_vs_model
    fig = _figure((7.0, 5.0))
    measured_vs_model(rec, ax=fig.add_subplot())
    return fig
