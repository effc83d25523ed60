"""Notebook 09's plots and widget: Gantt charts of the SM schedule model, the exp budget.

==============================  ========================================================
:func:`gantt`                   one schedule's ops on the SM's four units, by agent
:func:`schedule_figure`         a Gantt chart per schedule, one problem and GPU
:func:`schedule_report`         the predicted tensor-core utilisation per schedule (HTML)
:func:`schedule_explorer`       d, Br, Bc and the GPU in; the report and the charts out
:func:`ablation_table`          the FlashAttention-3 paper's ablation beside the model
:func:`hopper_kernel_record`    the recorded results of the Hopper kernel, if there are any
==============================  ========================================================

The numbers come from :mod:`iokernels.hopper_schedule`; matplotlib and ipywidgets are
imported inside the functions.
"""
from __future__ import annotations

import html

from .. import hopper_schedule as hs
from ..core import roofline as rl
from .widgets import _table

__all__ = ["gantt", "schedule_figure", "schedule_report", "schedule_explorer", "ablation_table",
           "hopper_kernel_record"]

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
    ax.set_title(title or f"{hs.SCHEDULES[schedule.name][0]}: tensor cores busy "
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
        rows.append((hs.SCHEDULES[kind][0], f"{s.utilisation:.1%}",
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


def ablation_table(problem: hs.Problem | None = None, gpu="H100 SXM") -> str:
    """The FlashAttention-3 paper's ablation (H100 SXM, FP16, d = 128) beside the model, as text."""
    rows = hs.ablation_comparison(problem, gpu)
    lines = [f"{'paper configuration':<50}{'TFLOP/s':>9}{'of peak':>9}{'vs FA2':>8}   {'model schedule':<17}"
             f"{'modelled':>9}{'vs fa2':>8}"]
    for r in rows:
        lines.append(f"{r['paper']:<50}{r['paper_tflops']:>9.0f}{r['paper_fraction']:>9.0%}"
                     f"{r['paper_tflops'] / rows[0]['paper_tflops']:>7.2f}x   {r['schedule']:<17}"
                     f"{r['model_utilisation']:>9.0%}{r['model_utilisation'] / rows[0]['model_utilisation']:>7.2f}x")
    return "\n".join(lines)


#: the Hopper forward kernels of :mod:`iokernels.cupy_raw` (wgmma, TMA, warp specialization)
HOPPER_RUNNERS = ("cupy:v3*", "cupy:v4*", "cupy:v5*")


def hopper_kernel_record(results_dir=None) -> str:
    """The recorded results of the Hopper forward kernels (cupy_raw v3-v5) beside SDPA's FLASH
    and cuDNN kernels, labelled with the record; or a line saying that none is recorded yet."""
    from ..core import recorded
    pending = ("no recorded results of the Hopper forward kernels (iokernels.cupy_raw, versions v3-v5) "
               "yet: they appear here once a GPU run has recorded them")
    try:
        rec = recorded.load(results_dir=results_dir)
    except FileNotFoundError:
        return pending
    if not recorded.bench_rows(rec, runners=HOPPER_RUNNERS):
        return pending
    return recorded.label(rec) + "\n" + recorded.table(
        rec, "prefill", runners=("sdpa:cudnn", "sdpa:flash", *HOPPER_RUNNERS), vs="sdpa:flash",
        columns=("dtype", "causal", "batch", "seqlen", "runner", "ms", "rate", "unit"))


def hopper_ablation_record(results_dir=None) -> str:
    """FlashAttention-3's ablation redone on the recorded GPU: our Hopper versions (v3 TMA +
    wgmma, v4 warp specialization, v5 ping-pong) beside the Ampere-style v2 and SDPA's FLASH
    and cuDNN kernels, in TFLOP/s, for each head dim and mask over N (B * N fixed); the last
    line of each block is v5's ratio to FLASH.  Or a line saying that none is recorded yet."""
    from ..core import recorded
    pending = ("no recorded ablation of the Hopper forward kernels yet: it appears here once "
               "scripts/hopper_bench.py --parts ablation has run on a GPU and been filed")
    try:
        rows, env = recorded.hopper_ablation_rows(recorded.load("hopper", results_dir=results_dir))
    except FileNotFoundError:
        return pending
    if not rows:
        return pending
    lengths = sorted({r["seqlen"] for r in rows})
    out = [f"recorded: {env.get('gpu')}, {env.get('date')}, torch {env.get('torch')}, CUDA {env.get('cuda')}; "
           "bf16, B x N = " + f"{rows[0]['batch'] * rows[0]['seqlen']:,} tokens, TFLOP/s (causal counts the visible half)"]
    for d in sorted({r["head_dim"] for r in rows}):
        for causal in (False, True):
            block = {r["seqlen"]: r for r in rows if r["head_dim"] == d and r["causal"] == causal}
            heads = next(iter(block.values()))["heads"]
            out.append("")
            out.append(f"d = {d}, H = {heads}, {'causal' if causal else 'non-causal'}".ljust(28)
                       + "".join(f"{f'N={n}':>9}" for n in lengths))
            for name in recorded.ABLATION_RUNNERS:
                cells = [block.get(n, {}).get(name, {}).get("tflops") for n in lengths]
                out.append(f"  {name:<26}" + "".join(f"{c:>9.0f}" if c is not None else f"{'-':>9}" for c in cells))
            ratio = [block.get(n, {}).get("v5", {}).get("x_flash") for n in lengths]
            out.append(f"  {'v5 / FLASH':<26}" + "".join(f"{c:>8.2f}x" if c else f"{'-':>9}" for c in ratio))
    return "\n".join(out)
