"""Figures for notebook 04 (the backward pass).  Data comes from :mod:`iokernels.backward`.

Every function takes an optional matplotlib ``ax`` and returns it; matplotlib is imported
inside the functions, so importing this module is cheap.
"""
from __future__ import annotations

import numpy as np

from . import exact_log
from .. import backward as bw

_MB = 1e6  # bytes per megabyte (decimal, as datasheets count)


def _axes(ax, figsize=(6.0, 4.0)):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_saved_memory(seqlens, head_dim=128, dtype="float16", ax=None):
    """What the forward keeps for the backward, per head: P (N x N) against LSE (N), and O."""
    ax = _axes(ax)
    rows = [bw.memory_footprint(n, n, head_dim, dtype) for n in seqlens]
    for key, style, label in (("P", "o-", "P (N x N): what a naive backward needs"),
                              ("O", "s-", "O (N x d): kept either way"),
                              ("LSE", "^-", "LSE (N): what FlashAttention keeps")):
        exact_log.loglog(ax, seqlens, [r[key] / _MB for r in rows], style, label=label)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MB per head")
    ax.set_title(f"Saved for the backward (d={head_dim}, {dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_backward_traffic(curve, counted=None, ax=None):
    """Modelled HBM bytes against N (from :func:`iokernels.backward.traffic_vs_seqlen`),
    with counted runs (``{"N": [...], "naive_backward": [...], "fa2_backward": [...]}``)
    drawn as crosses on top."""
    ax = _axes(ax)
    n = curve["N"]
    exact_log.loglog(ax, n, np.array(curve["naive_backward"]) / _MB, "o-", label="naive backward (model)")
    exact_log.loglog(ax, n, np.array(curve["fa2_backward"]) / _MB, "s-", label="FA2 backward (model)")
    exact_log.loglog(ax, n, np.array(curve["mandatory"]) / _MB, "k--", label="mandatory: inputs + gradients once")
    if counted is not None:
        exact_log.loglog(ax, counted["N"], np.array(counted["naive_backward"]) / _MB, "kx", ms=9,
                  label="counted by running")
        exact_log.loglog(ax, counted["N"], np.array(counted["fa2_backward"]) / _MB, "kx", ms=9)
    ax.set_xlabel("sequence length N (= N_q = N_k)")
    ax.set_ylabel("HBM traffic (MB)")
    ax.set_title("Backward pass HBM traffic")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_recompute_flops(flops, ax=None):
    """Bars: forward, backward with P stored, backward with S/P recomputed (GFLOP)."""
    ax = _axes(ax, figsize=(5.5, 3.5))
    keys = ["forward", "backward_stored_P", "backward_recompute"]
    labels = ["forward", "backward\n(P stored)", "backward\n(recompute S, P)"]
    vals = [flops[k] / 1e9 for k in keys]
    bars = ax.bar(labels, vals, color=["#888888", "#4c72b0", "#dd8452"])
    for b_, v in zip(bars, vals):
        ax.text(b_.get_x() + b_.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("matmul GFLOP")
    ax.set_title(f"Recomputation: +{100 * flops['backward_overhead']:.0f}% backward FLOPs")
    return ax
