"""Plots and tables of notebook 13 (decode for real models), drawn from :mod:`iokernels.models`.

=============================  ====================================================
:func:`roofline_figure`        decode intensities against three GPUs' bf16 roofs
:func:`kv_quant_figure`        decode error against N per cache kind, bounds dashed
:func:`recorded_mla_figure`    the recorded MLA decode runs: TFLOP/s per runner
:func:`recorded_cache_figure`  the recorded quantized-cache runs: speed vs 16 bits
:func:`ridge_table`, :func:`model_table`, :func:`source_table`, :func:`mla_comparison_tables`
                               the chapter's numbers as tables
:class:`Table`                 a small table that shows as HTML in a notebook
=============================  ====================================================
"""
from __future__ import annotations

import html

import numpy as np

from . import exact_log
from .. import models
from ..core import roofline as rl
from .figures import _figure
from .palette import colour as runner_colour

#: one colour and one marker per model (the same in every figure of the chapter)
MODEL_STYLE = {"Llama-2-7B": ("#ff7f0e", "o"), "Llama-3-8B": ("#1f77b4", "s"), "Mistral-7B": ("#17becf", "P"),
               "Llama-3-70B": ("#9467bd", "D"), "Falcon-7B": ("#8c564b", "^"), "DeepSeek-V3": ("#2ca02c", "*")}
#: one line style per GPU roof
GPU_STYLE = {"H100 SXM": ("#7f7f7f", "--"), "H200": ("black", "-"), "B200": ("#d62728", ":")}
#: one colour per cache kind
CACHE_COLOURS = {"float32": "#555555", "bfloat16": "#1f77b4", "float8_e4m3fn": "#c0392b", "int8": "#27ae60"}


class Table:
    """Rows under a header: HTML in a notebook, aligned text elsewhere (``str``)."""

    def __init__(self, header, rows, caption=None):
        self.header, self.rows, self.caption = list(header), [list(r) for r in rows], caption

    def _repr_html_(self) -> str:
        cell = 'style="padding:2px 10px;text-align:right"'
        out = ['<table style="border-collapse:collapse">']
        if self.caption:
            out.append(f'<caption style="text-align:left">{html.escape(self.caption)}</caption>')
        out.append("<tr>" + "".join(f"<th {cell}>{html.escape(str(h))}</th>" for h in self.header) + "</tr>")
        out += ["<tr>" + "".join(f"<td {cell}>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in self.rows]
        return "".join(out + ["</table>"])

    def __str__(self) -> str:
        cols = [self.header] + self.rows
        widths = [max(len(str(r[i])) for r in cols) for i in range(len(self.header))]
        lines = ([self.caption] if self.caption else []) + [
            "  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in cols]
        return "\n".join(lines)

    __repr__ = __str__


def ridge_table(gpus=models.RIDGE_GPUS) -> Table:
    """:func:`iokernels.models.ridge_table` as a table: intensity, then bound per GPU."""
    rows = models.ridge_table(gpus=gpus)
    header = ["model", "kind", "g", "FLOP/byte"] + [f"{g} (ridge {rows[0]['by_gpu'][g]['ridge']:.0f})" for g in gpus]
    body = [[r["model"], r["kind"], r["group"], f"{r['intensity']:.0f}"]
            + [f"{r['by_gpu'][g]['bound']}-bound, {r['by_gpu'][g]['peak_fraction']:.0%} of peak" for g in gpus]
            for r in rows]
    return Table(header, body, caption="decode attention, 16-bit cache, one query token per step")


def roofline_figure(gpus=models.RIDGE_GPUS, points_on="H200", itemsize=2, extra=models.ROOFLINE_EXTRA, ax=None):
    """Decode intensities (:func:`iokernels.models.roofline_points`) against several bf16 roofs.

    Each GPU's roof and ridge are drawn in its own style; the points sit on ``points_on``'s
    roof, one marker and colour per model, labelled next to the point (models with the same
    intensity share a point and a label); the legend, roofs only, sits below the axes.
    """
    fig = None
    if ax is None:
        fig = _figure((8.4, 5.6))
        ax = fig.add_subplot()
    x = np.logspace(-0.3, 3.1, 200)
    for g in gpus:
        spec = rl.get_gpu(g)
        ridge = rl.ridge_point(g, "bf16")
        peak = ridge * spec["hbm_tbps"]
        colour, ls = GPU_STYLE.get(g, ("grey", "-"))
        exact_log.loglog(ax, x, np.minimum(peak, x * spec["hbm_tbps"]), color=colour, ls=ls, lw=1.8,
                  label=f"{g}: {spec['hbm_tbps']} TB/s, {peak:.0f} TFLOP/s, ridge {ridge:.0f} FLOP/B")
        ax.axvline(ridge, color=colour, ls=ls, lw=0.8, alpha=0.6)
    on = rl.get_gpu(points_on)
    top = rl.ridge_point(points_on, "bf16") * on["hbm_tbps"]
    for n, p in enumerate(models.roofline_points(itemsize=itemsize, extra=extra)):
        i = p["intensity"]
        y = min(top, i * on["hbm_tbps"])
        first = p["names"][0].split(" (")[0]
        colour, marker = MODEL_STYLE.get(first, ("black", "o"))
        open_marker = p["variant"] is not None
        ax.plot([i], [y], marker, color=colour, ms=(13 if marker == "*" else 9) + (3 if open_marker else 0),
                mfc="none" if open_marker else colour, mew=1.6, zorder=3 if open_marker else 4)
        text = ", ".join(p["names"]) + f": {i:.0f} FLOP/B"
        above = n % 2 == 0                                  # alternate sides so neighbours do not collide
        ax.annotate(text, (i, y), xytext=(-10, 10) if above else (10, -16), textcoords="offset points",
                    fontsize=7.5, color=colour, ha="right" if above else "left", zorder=5,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    ax.set_xlim(x[0], x[-1])
    ax.set_ylim(1, 6000)
    ax.set_xlabel("decode intensity (FLOP per byte of KV cache read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Decode attention on three bf16 roofs (points on the {points_on}'s; open markers: "
                 "a 1-byte cache or 2 query tokens)", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    return fig if fig is not None else ax


def kv_quant_figure(rows, ax=None):
    """Error of decode against the oracle vs N for each cache (from
    :func:`iokernels.models.kv_quant_accuracy`), the 1-byte caches' stated bounds dashed; the
    legend sits right of the axes, off the lines."""
    fig = None
    if ax is None:
        fig = _figure((8.6, 4.2))
        ax = fig.add_subplot()
    for label in dict.fromkeys(r["cache"] for r in rows):
        mine = [r for r in rows if r["cache"] == label]
        ns = [r["N"] for r in mine]
        c = CACHE_COLOURS.get(label)
        bpt = mine[0]["bytes_per_token"]
        exact_log.loglog(ax, ns, [r["o_error"] for r in mine], "o-", color=c,
                         label=f"{label} cache ({bpt:g} B/token): error")
        if mine[0]["bound"] is not None:
            exact_log.loglog(ax, ns, [r["bound"] for r in mine], "--", color=c, lw=1, label=f"{label}: stated bound")
    ax.set_xlabel("cache length N (tokens)")
    ax.set_ylabel("max |O - O_float64|")
    ax.set_title("Paged decode over quantized caches against the float64 oracle", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return fig if fig is not None else ax


def _grouped_bars(ax, groups, runners, value):
    """One bar per runner in each group, in the runner's colour of :mod:`iokernels.viz.palette`."""
    width = 0.8 / max(1, len(runners))
    for j, run in enumerate(runners):
        xs = [i + (j - (len(runners) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [value(g, run) for g in groups], width, color=runner_colour(run), label=run)
    ax.set_xticks(range(len(groups)))


def recorded_mla_figure(label, rows):
    """Recorded MLA decode runs (:func:`iokernels.models.recorded_mla_data`): TFLOP/s per runner
    for each (batch, context), and the share of the GPU's roofline each reached."""
    groups = list(dict.fromkeys((r["batch"], r["seqlen"]) for r in rows))
    runners = list(dict.fromkeys(r["runner"] for r in rows))
    cell = {(r["batch"], r["seqlen"], r["runner"]): r for r in rows}
    fig = _figure((9.0, 3.8))
    axes = fig.subplots(1, 2)
    for ax, key, ylabel in ((axes[0], "tflops", "TFLOP/s"), (axes[1], "roofline_fraction", "share of the roofline")):
        _grouped_bars(ax, groups, runners, lambda g, run: (cell.get((*g, run)) or {}).get(key) or 0.0)
        ax.set_xticklabels([f"B={b}\nN={n // 1024}K" for b, n in groups], fontsize=7.5)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("MLA decode (DeepSeek-V3 shapes), " + label, fontsize=8)
    return fig


def recorded_cache_figure(label, rows):
    """Recorded quantized- and windowed-cache decode runs (:func:`iokernels.models.recorded_cache_data`):
    each runner's speed against its own 16-bit cache, one panel a batch size."""
    batches = sorted({r["batch"] for r in rows})
    fig = _figure((9.0, 3.8))
    axes = np.atleast_1d(fig.subplots(1, len(batches), sharey=True))
    runners = list(dict.fromkeys(r["runner"] for r in rows))
    for ax, b in zip(axes, batches):
        mine = [r for r in rows if r["batch"] == b]
        groups = list(dict.fromkeys((r["cache"], r["window"]) for r in mine))
        cell = {(r["cache"], r["window"], r["runner"]): r for r in mine}
        _grouped_bars(ax, groups, runners, lambda g, run: (cell.get((*g, run)) or {}).get("speed_vs_16bit") or 0.0)
        ax.set_xticklabels([f"{c.replace('float8_e4m3fn', 'fp8')}\n{w}" for c, w in groups], fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"batch {b}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("speed vs the same runner's\n16-bit cache, whole context")
    axes[-1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle(label, fontsize=7)
    return fig


def model_table(context=32768, gpu=models.DEFAULT_GPU) -> Table:
    """:func:`iokernels.models.model_table` as a table (the sources go in :func:`source_table`)."""
    rows = models.model_table(context=context, gpu=gpu)
    return Table(["model", "kind", "L", "Hq", "Hkv", "values/layer", "KV/token", f"cache @{context // 1024}K",
                  f"read once ({gpu})"],
                 [[r["model"], r["kind"], r["layers"], r["heads_q"], r["heads_kv"], f"{r['values_per_layer']:,}",
                   f"{r['bytes_per_token'] / 1024:.1f} KiB", f"{r['cache_bytes'] / 1e9:.2f} GB",
                   f"{r['read_s'] * 1e3:.2f} ms"] for r in rows])


def source_table() -> Table:
    """Where each model's shape comes from (paper or model card, and its config.json)."""
    return Table(["model", "source"], [[m.name, m.source] for m in models.MODELS.values()])


def mla_comparison_tables(c) -> tuple[Table, Table]:
    """:func:`iokernels.models.mla_comparison`'s result as two tables: the small problem's
    exactness and counted traffic, and the full-size bytes and FLOPs of the two forms."""
    small = Table(["form", "max |O - O_float64|", "counted == modelled bytes"],
                  [[f, f"{e:.1e}",
                    ("yes" if c["counted"][f]["equal"] else "NO") if f in c["counted"] else "not counted"]
                   for f, e in c["errors"].items()],
                  caption="a scaled-down MLA problem in float64")
    full = Table(["form", "MB moved", "GFLOP", "of which attention", "FLOP/byte"],
                 [[f, f"{r['bytes'] / 1e6:,.1f}", f"{r['flops'] / 1e9:,.2f}", f"{r['attention_flops'] / 1e9:,.2f}",
                   f"{r['intensity']:.0f}"] for f, r in c["full"].items()],
                 caption="DeepSeek-V3's shapes, one layer, one sequence (closed-form models)")
    return small, full


def kv_quant_table(rows) -> Table:
    """:func:`iokernels.models.kv_quant_accuracy`'s rows as a table."""
    return Table(["N", "cache", "B/token", "max |O err|", "stated bound", "|LSE err|"],
                 [[r["N"], r["cache"], f"{r['bytes_per_token']:g}", f"{r['o_error']:.1e}",
                   "" if r["bound"] is None else f"{r['bound']:.3f}", f"{r['lse_error']:.1e}"] for r in rows])
