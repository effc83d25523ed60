"""Notebooks 09a and 09b's plots, tables and widget: the SM schedule model, the exp budget, FP8.

==============================  ========================================================
:func:`reading_guide_figure`    one small labelled timing diagram: how to read the charts
:func:`gantt`                   one schedule's ops on the SM's four units, by agent
:func:`schedule_figure`         a Gantt chart per schedule, one problem and GPU
:func:`schedule_report`         the predicted tensor-core utilisation per schedule (HTML)
:func:`schedule_explorer`       d, Br, Bc and the GPU in; the report and the charts out
:func:`sfu_table`               the exp budget per GPU and head dim
:func:`ablation_table`          the FlashAttention-3 paper's Table 2 beside the model
:func:`blog_table`              the FlashAttention-3 blog post's steps beside the model
:func:`sensitivity_table`       the model's utilisations over its L2 reuse factor
:func:`sensitivity_figure`      the same as a plot
:func:`fp8_table`               the FP8 accuracy experiment beside the paper's figures
:func:`seed_table`              the error ratio per seed
:func:`rounding_table`          worst-case and typical rounding error per format
:func:`generations_tables`      FlashAttention 1-4, the hardware matrix, the caveats
:func:`hopper_kernel_record`    the recorded results of the Hopper kernel, if there are any
:func:`hopper_ablation_record`  the recorded ablation of the Hopper kernels, if any
==============================  ========================================================

The numbers come from :mod:`iokernels.hopper_schedule`, :mod:`iokernels.fp8` and
:mod:`iokernels.generations`; tables are :class:`iokernels.viz.htmltable.Table` (HTML in
a notebook, text elsewhere); matplotlib and ipywidgets are imported inside the functions.
"""
from __future__ import annotations

import html

from . import exact_log
from .. import hopper_schedule as hs
from ..core import roofline as rl
from .htmltable import Table
from .widgets import _table

__all__ = ["reading_guide_figure", "gantt", "schedule_figure", "schedule_report", "schedule_explorer",
           "sfu_table", "ablation_table", "blog_table", "sensitivity_table", "sensitivity_figure", "fp8_table",
           "seed_table", "rounding_table", "generations_tables", "hopper_kernel_record",
           "hopper_ablation_record"]

#: the GPUs the model knows the per-clock rates of (the widget's choices)
GPUS = ("H100 SXM", "H200", "H100 PCIe", "A100 80GB SXM", "B200")
#: the schedules drawn by default (the others are in the report)
DRAWN = ("fa2", "warp_specialized", "pingpong", "intra_wg", "fa3")
#: one colour per agent
_COLOURS = {"consumer 1": "#1f77b4", "consumer 2": "#ff7f0e", "producer": "#2ca02c"}
_UNIT_LABELS = {"copy": "copy (TMA)", "tensor": "tensor cores", "sfu": "SFU (exp)", "cuda": "CUDA cores"}


def gantt(schedule: hs.Schedule, ax=None, title: str | None = None):
    """Bars per unit (rows) in time (microseconds), coloured by the agent that issued them."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.2))
    units = list(hs.UNITS)
    for op in schedule.ops:
        y = len(units) - 1 - units.index(op.unit)
        ax.broken_barh([(op.start * 1e6, op.seconds * 1e6)], (y - 0.4, 0.8),
                       facecolors=_COLOURS.get(op.agent, "grey"), edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(units)))
    ax.set_yticklabels([_UNIT_LABELS[u] for u in reversed(units)], fontsize=8)
    ax.set_xlim(0, schedule.makespan * 1e6)
    ax.set_xlabel("time (us, modelled)", fontsize=8)
    ax.set_title(title or f"{hs.label(schedule.name)}: tensor cores busy "
                 f"{schedule.utilisation:.0%} of peak", fontsize=9)
    return ax


def schedule_figure(problem: hs.Problem | None = None, gpu: str = "H100 SXM", kinds=DRAWN):
    """One Gantt chart per schedule on a shared time axis; returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    rates = hs.SMRates.from_gpu(gpu)
    runs = [hs.simulate(k, problem, rates) for k in kinds]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.9 * len(runs)), sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for s, ax in zip(runs, axes):
        gantt(s, ax)
        ax.set_xlabel("")
    axes[-1].set_xlim(0, max(s.makespan for s in runs) * 1e6)
    axes[-1].set_xlabel("time (us, modelled)", fontsize=8)
    fig.legend(handles=[Patch(color=c, label=a) for a, c in _COLOURS.items()], loc="upper right", fontsize=8,
               ncol=3)
    p = problem or hs.Problem()
    fig.suptitle(f"one thread block on one SM of an {gpu}: d={p.head_dim}, Br={p.block_q}, Bc={p.block_k}, "
                 f"{p.n_tiles} K/V tiles", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


def schedule_report(head_dim=128, block_q=128, block_k=128, gpu="H100 SXM", n_tiles=12, sw_exp_fraction=0.0) -> str:
    """Per schedule: predicted tensor-core utilisation and each unit's busy share, as HTML."""
    p = hs.Problem(head_dim=head_dim, block_q=block_q, block_k=block_k, n_tiles=n_tiles,
                   sw_exp_fraction=sw_exp_fraction)
    rates = hs.SMRates.from_gpu(gpu)
    smem = p.smem_bytes()
    limit = rl.get_gpu(gpu)["smem_per_sm_kib"] * 1024
    fits = (f"shared memory: Q_i and {p.stages} K/V buffers need {smem:,} B of {limit:,} B"
            + ("" if smem <= limit else " -- does not fit: a real kernel could not use these tiles"))
    rows = []
    for kind, s in hs.run_all(p, rates).items():
        rows.append((hs.label(kind), f"{s.utilisation:.1%}",
                     *(f"{s.busy[u]:.0%}" for u in hs.UNITS)))
    share = rates.tensor_flops / (hs.exp_budget(head_dim) * rates.sfu_ops)
    return (f"<p>{html.escape(fits)}; exp time = {share:.2f} x matmul time at d = {head_dim}</p>"
            + _table(rows, header=("schedule", "tensor-core utilisation (modelled)",
                            *(f"{_UNIT_LABELS[u]} busy" for u in hs.UNITS))))


def schedule_explorer(head_dim=128, block_q=128, block_k=128, gpu="H100 SXM"):
    """Dropdowns for d and the GPU, sliders for Br, Bc and the share of exps computed in
    software (FlashAttention-4): the report and the Gantt charts."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display
    d = w.Dropdown(options=(64, 128, 256), value=head_dim, description="head dim d")
    br = w.IntSlider(value=block_q, min=64, max=256, step=64, description="Br", continuous_update=False)
    bc = w.IntSlider(value=block_k, min=32, max=256, step=32, description="Bc", continuous_update=False)
    g = w.Dropdown(options=GPUS, value=gpu, description="GPU")
    sw = w.FloatSlider(value=0.0, min=0.0, max=0.75, step=0.25, description="software exp share",
                       continuous_update=False, style={"description_width": "initial"})
    numbers = w.HTML()
    plot = w.Output()

    def update(_=None):
        numbers.value = schedule_report(d.value, br.value, bc.value, g.value, sw_exp_fraction=sw.value)
        plot.clear_output(wait=True)
        with plot:
            fig = schedule_figure(hs.Problem(head_dim=d.value, block_q=br.value, block_k=bc.value,
                                             sw_exp_fraction=sw.value), g.value)
            display(fig)
            plt.close(fig)

    for c in (d, br, bc, g, sw):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([d, g]), w.HBox([br, bc, sw]), numbers, plot])


def reading_guide_figure():
    """How to read a Gantt chart: FA2's first two tiles on an H100 SXM, every bar named, the
    idle gaps and one dependency pointed out.  Returns the figure."""
    import matplotlib.pyplot as plt
    s = hs.simulate("fa2", hs.Problem(n_tiles=2))
    fig, ax = plt.subplots(figsize=(10, 3.4))
    gantt(s, ax, title=f"how to read the charts: {hs.label('fa2')}, two K/V tiles, one SM of an H100 SXM")
    units = list(hs.UNITS)
    short = {"cuda": {"max, scale": "max", "sum, convert, rescale": "sum/cvt"}}
    for op in s.ops:
        y = len(units) - 1 - units.index(op.unit)
        name = op.name.split(" = ")[0] if op.unit == "tensor" else op.name
        for long, brief in short.get(op.unit, {}).items():
            name = name.replace(long, brief)
        if op.seconds > 0.04 * s.makespan:
            ax.text((op.start + op.seconds / 2) * 1e6, y, name, ha="center", va="center", fontsize=7, color="white")
    tensor = sorted((o for o in s.ops if o.unit == "tensor"), key=lambda o: o.start)
    gap = max(zip(tensor, tensor[1:]), key=lambda ab: ab[1].start - ab[0].end)
    y_t = len(units) - 1 - units.index("tensor")
    ax.annotate("", xy=(gap[1].start * 1e6, y_t - 0.2), xytext=(gap[0].end * 1e6, y_t - 0.2),
                arrowprops=dict(arrowstyle="<->", color="black"))
    ax.text((gap[0].end + gap[1].start) / 2 * 1e6, y_t + 0.1, "idle: softmax", ha="center", va="center", fontsize=8)
    load = next(o for o in s.ops if o.name == "load K1")
    ax.annotate("load K1 was issued early: it runs under the softmax and the matmul (prefetch)",
                xy=((load.start + load.seconds / 2) * 1e6, len(units) - 1 + 0.4),
                xytext=(load.start * 1e6, len(units) + 0.15), fontsize=8, va="center",
                arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_ylim(-0.6, len(units) + 0.4)
    ax.set_xlabel("time (us, modelled): one row per unit, one bar per op, colour = the warpgroup that issued it",
                  fontsize=8)
    fig.tight_layout()
    return fig


def sfu_table(gpus=("H100 SXM", "H200", "B200"), head_dims=(64, 128, 256)) -> Table:
    """:func:`iokernels.hopper_schedule.sfu_share_table` as a table."""
    rows = [(r["gpu"], r["head_dim"], r["flop_per_exp"], f"{r['tensor_tflops']:,.1f}", f"{r['exp_tops']:.2f}",
             f"{r['exp_fraction_of_matmul']:.2f}") for r in hs.sfu_share_table(gpus, head_dims)]
    return Table(("GPU", "d", "matmul FLOP per exp", "matmul TFLOP/s (datasheet)", "exp T/s (16 per clock per SM)",
                  "exp time / matmul time"), rows,
                 caption="The exp budget: how long the exponentials take next to the matmuls, if nothing overlaps")


def ablation_table(problem: hs.Problem | None = None, gpu="H100 SXM", l2_reuse=hs.L2_REUSE) -> Table:
    """The FlashAttention-3 paper's Table 2 (its three rows) beside the model."""
    rows = hs.ablation_comparison(problem, gpu, l2_reuse)
    return Table(("paper, Table 2", "TFLOP/s", "of peak", "model schedule", "modelled utilisation"),
                 [(r["paper"], f"{r['paper_tflops']:.0f}", f"{r['paper_fraction']:.0%}", r["label"],
                   f"{r['model_utilisation']:.1%}") for r in rows],
                 caption=f"FlashAttention-3 paper, Table 2 ({hs.PAPER_TABLE2_SETTING}); model at "
                         f"L2 reuse {l2_reuse:g}")


def blog_table(problem: hs.Problem | None = None, gpu="H100 SXM", l2_reuse=hs.L2_REUSE) -> Table:
    """The FlashAttention-3 blog post's steps beside the model, with each step's gain."""
    rows = []
    for r in hs.blog_comparison(problem, gpu, l2_reuse):
        lo, hi = r["blog_low"], r["blog_high"]
        reported = f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"
        gain = "" if r["blog_gain"] is None else f"{r['blog_gain'][0]:.2f}-{r['blog_gain'][1]:.2f}x"
        mgain = "" if r["model_gain"] is None else f"{r['model_gain']:.2f}x"
        rows.append((r["step"], reported, gain, r["label"], f"{r['model_utilisation']:.1%}", mgain))
    return Table(("blog post step", "TFLOP/s", "gain", "model schedule", "modelled utilisation", "model gain"), rows,
                 caption=f"FlashAttention-3 blog post (PyTorch blog, 2024-07-11), H100, FP16; model at "
                         f"L2 reuse {l2_reuse:g}")


def sensitivity_table(rows=None) -> Table:
    """:func:`iokernels.hopper_schedule.sensitivity` as a table (computed when ``rows`` is None)."""
    rows = hs.sensitivity() if rows is None else rows
    kinds = [k for k in rows[0] if k in hs.SCHEDULES]
    return Table(("L2 reuse", *(hs.label(k) for k in kinds), "Table 2 order (582 > 570) holds"),
                 [(f"{r['l2_reuse']:g}" + (" (default)" if r["l2_reuse"] == hs.L2_REUSE else ""),
                   *(f"{r[k]:.1%}" for k in kinds), "yes" if r["table2_order_holds"] else "no") for r in rows],
                 caption="Modelled tensor-core utilisation against the model's one free constant")


def sensitivity_figure(rows=None):
    """The utilisations of :func:`iokernels.hopper_schedule.sensitivity` against the L2 reuse factor."""
    import matplotlib.pyplot as plt
    rows = hs.sensitivity() if rows is None else rows
    kinds = [k for k in rows[0] if k in hs.SCHEDULES]
    xs = [r["l2_reuse"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    for k in kinds:
        ax.plot(xs, [r[k] for r in rows], marker="o", label=hs.label(k),
                linestyle="--" if k == "fa2_serial" else "-")
    ax.axvline(hs.L2_REUSE, color="grey", linewidth=0.8)
    ax.text(hs.L2_REUSE, 0.02, " default", color="grey", fontsize=8)
    exact_log.set_log(ax, "x", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_ylim(0, 1)
    ax.set_xlabel("L2 reuse factor (copy rate = L2 reuse x the SM's share of HBM bandwidth)")
    ax.set_ylabel("modelled tensor-core utilisation")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def fp8_table(rows) -> Table:
    """The rows of :func:`iokernels.fp8.accuracy_experiment` beside the paper's figures."""
    return Table(("variant", "RMSE (measured here)", "FlashAttention-3 paper", "paper's row"),
                 [(r.name, f"{r.rmse:.2e}", "-" if r.paper is None else f"{r.paper:.1e}", r.paper_label or "-")
                  for r in rows], caption="RMSE against a float64 reference, inputs with rare outliers")


def seed_table(seeds, ratios) -> Table:
    """The error ratio (per-tensor FP8 / FP8 after the Hadamard transform) for each seed."""
    seeds, ratios = list(seeds), list(ratios)
    if len(seeds) != len(ratios):
        raise ValueError(f"ratios: expected one per seed ({len(seeds)}), got {len(ratios)}")
    return Table(("seed", "RMSE per tensor / RMSE after the Hadamard transform"),
                 [(s, f"{r:.2f}x") for s, r in zip(seeds, ratios)],
                 caption="The error ratio, redrawn with other seeds")


def rounding_table(stats) -> Table:
    """The rows of :func:`iokernels.fp8.rounding_error` (one per format)."""
    return Table(("format", "mantissa bits", "worst case (half an ulp)", "largest seen", "mean", "RMS",
                  "flushed to 0"),
                 [(s["format"], s["mantissa_bits"], f"{s['worst_case']:.2%}", f"{s['max']:.2%}",
                   f"{s['mean']:.2%}", f"{s['rms']:.2%}", f"{s['flushed']:.2%}") for s in stats],
                 caption="Relative rounding error of one cast, on random data scaled to the format's range")


def generations_tables():
    """(generations, hardware matrix, caveats) from :mod:`iokernels.generations`, as tables."""
    from .. import generations as gen
    rows = []
    for g in gen.GENERATIONS:
        rows.append((g.name, g.paper, "; ".join(g.changed),
                     "; ".join(f"{claim} ({where})" for claim, where in g.reported), g.status or "-"))
    gens = Table(("generation", "paper", "what changed", "what it reported (with its framing)", "status"), rows,
                 caption="FlashAttention 1 to 4, as their papers report them")
    hw = Table(("", *gen.ARCHITECTURES),
               [(name, *(row[a] or "-" for a in gen.ARCHITECTURES)) for name, row in gen.HARDWARE.items()],
               caption="Where each runs", note=" ".join(gen.HARDWARE_NOTES))
    cav = Table(("", "read every number above with this in mind"),
                [(i + 1, c) for i, c in enumerate(gen.CAVEATS)], caption="Caveats")
    return gens, hw, cav


#: the Hopper forward kernels of :mod:`iokernels.cupy_raw` (wgmma, TMA, warp specialization)
HOPPER_RUNNERS = ("cupy:v3*", "cupy:v4*", "cupy:v5*")


def hopper_kernel_record(results_dir=None) -> Table:
    """The recorded results of the Hopper forward kernels (cupy_raw v3-v5) beside SDPA's FLASH
    and cuDNN kernels, labelled with the record; or a note saying that none is recorded yet."""
    from ..core import recorded
    pending = ("no recorded results of the Hopper forward kernels (iokernels.cupy_raw, versions v3-v5) "
               "yet: they appear here once a GPU run has recorded them")
    try:
        rec = recorded.load(results_dir=results_dir)
    except FileNotFoundError:
        return Table(("",), [], note=pending)
    if not recorded.bench_rows(rec, runners=HOPPER_RUNNERS):
        return Table(("",), [], note=pending)
    rows = recorded.bench_rows(rec, section="prefill", runners=("sdpa:cudnn", "sdpa:flash", *HOPPER_RUNNERS),
                               vs="sdpa:flash")
    return Table(("dtype", "causal", "batch", "N", "kernel", "ms", "rate", "unit", "speed vs sdpa:flash"),
                 [(r.get("dtype"), "causal" if r.get("causal") else "non-causal", r.get("batch"), r.get("seqlen"),
                   r["runner"], f"{r['ms']:.4g}", f"{r['rate']:.4g}", r.get("unit"),
                   "" if r.get("speed_vs_sdpa:flash") is None else f"{r['speed_vs_sdpa:flash']:.2f}x")
                  for r in rows], caption=recorded.label(rec))


def hopper_ablation_record(results_dir=None) -> Table:
    """FlashAttention-3's ablation redone on the recorded GPU: our Hopper versions (v3 TMA +
    wgmma, v4 warp specialization, v5 ping-pong) beside the Ampere-style v2 and SDPA's FLASH
    and cuDNN kernels, in TFLOP/s, for each head dim and mask over N (B * N fixed); the last
    row of each block is v5's ratio to FLASH.  Or a note saying that none is recorded yet."""
    from ..core import recorded
    pending = ("no recorded ablation of the Hopper forward kernels yet: it appears here once "
               "scripts/hopper_bench.py --parts ablation has run on a GPU and been filed")
    try:
        rows, env = recorded.hopper_ablation_rows(recorded.load("hopper", results_dir=results_dir))
    except FileNotFoundError:
        return Table(("",), [], note=pending)
    if not rows:
        return Table(("",), [], note=pending)
    lengths = sorted({r["seqlen"] for r in rows})
    out = []
    for d in sorted({r["head_dim"] for r in rows}):
        for causal in (False, True):
            block = {r["seqlen"]: r for r in rows if r["head_dim"] == d and r["causal"] == causal}
            heads = next(iter(block.values()))["heads"]
            setting = f"d = {d}, H = {heads}, {'causal' if causal else 'non-causal'}"
            for name in recorded.ABLATION_RUNNERS:
                cells = [block.get(n, {}).get(name, {}).get("tflops") for n in lengths]
                out.append((setting, name, *(f"{c:.0f}" if c is not None else "-" for c in cells)))
            ratio = [block.get(n, {}).get("v5", {}).get("x_flash") for n in lengths]
            out.append((setting, "v5 / FLASH", *(f"{c:.2f}x" if c else "-" for c in ratio)))
    caption = (f"recorded: {env.get('gpu')}, {env.get('date')}, torch {env.get('torch')}, CUDA {env.get('cuda')}; "
               f"bf16, B x N = {rows[0]['batch'] * rows[0]['seqlen']:,} tokens, TFLOP/s "
               "(causal counts the visible half)")
    return Table(("setting", "kernel", *(f"N={n}" for n in lengths)), out, caption=caption)
