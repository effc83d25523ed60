"""Plots of notebook 11 (what goes wrong), drawn from :mod:`iokernels.failure_modes`' results."""
from __future__ import annotations

import numpy as np

from . import exact_log
from .figures import _figure

_COLORS = {"float32": "#1f77b4", "bfloat16": "#c0392b", "float16": "#8e44ad"}


def drift_figure(drift: dict, ax=None):
    """Relative error against N on log-log axes, one line per accumulator dtype."""
    fig = None
    if ax is None:
        fig = _figure((8.2, 4.2))
        ax = fig.add_subplot()
    for name, errs in drift.items():
        if name != "N":
            exact_log.loglog(ax, drift["N"], errs, "o-", color=_COLORS.get(name), label=f"l and O kept in {name}")
    ax.set_xlabel("keys N (one K/V tile of 64 keys = one rounding of the accumulators)")
    ax.set_ylabel("max |O - O_ref64| / max |O_ref64|")
    ax.set_title("Low-precision accumulators drift as N grows", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)   # off the lines
    return fig if fig is not None else ax


def block_mask_figure(blocks, doc_ids, ax=None):
    """The block mask of head 0 (every head has the same document mask): skipped (never
    loaded), partial and full tiles.  The title counts this one head's tiles, and says so."""
    from matplotlib.colors import ListedColormap
    fig = None
    if ax is None:
        fig = _figure((5.0, 4.6))
        ax = fig.add_subplot()
    states = blocks.states[0, 0]
    ax.imshow(states, cmap=ListedColormap(["#eeeeee", "#f9e79f", "#aed6f1"]), vmin=0, vmax=2)
    ax.set_xlabel(f"K/V tile j (Bc = {blocks.block_k})")
    ax.set_ylabel(f"query tile i (Br = {blocks.block_q})")
    heads = blocks.states.shape[0] * blocks.states.shape[1]
    ax.set_title(f"document mask, {len(np.unique(doc_ids))} documents\n"
                 f"head 0: {int((states == 0).sum())} of {states.size} tiles skipped "
                 f"(all {heads} heads: {blocks.num_skipped} of {blocks.states.size})\n"
                 "grey: skipped; yellow: masked inside; blue: full", fontsize=9)
    return fig if fig is not None else ax
