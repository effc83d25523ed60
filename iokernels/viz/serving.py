"""Figures of notebook 14: the block pool over time, waste against block size, decode throughput.

Each draws what :mod:`iokernels.serving.lesson` computed; matplotlib is imported inside the
functions, and each returns its figure.
"""
from __future__ import annotations

import numpy as np

from . import exact_log

__all__ = ["pool_over_time_figure", "block_size_figure", "throughput_figure"]

_SHARED = "#555555"


def pool_over_time_figure(history, num_blocks):
    """Which request holds each physical block at each step (grey: shared by several samples)."""
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    owners = sorted({label.split("/")[0] for tables in history for label in tables})
    cmap = matplotlib.colormaps["tab10"]
    img = np.ones((len(history), num_blocks, 4))
    for t, tables in enumerate(history):
        holders: dict[int, set] = {}
        for label, table in tables.items():
            for b in table:
                holders.setdefault(b, set()).add(label)
        for b, labels in holders.items():
            rids = {lab.split("/")[0] for lab in labels}
            img[t, b] = matplotlib.colors.to_rgba(_SHARED) if len(labels) > 1 else cmap(owners.index(rids.pop()) % 10)
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(history) + 1.5))
    ax.imshow(img, aspect="auto", interpolation="nearest")
    ax.set_xlabel("physical block")
    ax.set_ylabel("step")
    ax.set_xticks(range(num_blocks))
    handles = [Patch(color=cmap(i % 10), label=f"request {r}") for i, r in enumerate(owners)]
    handles.append(Patch(color=_SHARED, label="shared (refcount > 1)"))
    ax.legend(handles=handles, bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8)
    ax.set_title("the block pool, step by step (white: free)")
    fig.tight_layout()
    return fig


def block_size_figure(rows):
    """Max concurrent sequences and wasted fraction per memory (the block-size sweep's rows)."""
    import matplotlib.pyplot as plt

    labels = [r["memory"].replace("paged, ", "").replace(" (max length reserved)", "") for r in rows]
    x = np.arange(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    colours = ["#1f77b4" if r["block_size"] else "#d62728" for r in rows]
    a.bar(x, [r["max_concurrent"] for r in rows], color=colours)
    a.set_ylabel("max concurrent sequences")
    b.bar(x, [100 * r["waste_fraction"] for r in rows], color=colours)
    b.set_ylabel("allocated slots not holding a token (%)")
    for ax in (a, b):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    fig.suptitle("same KV memory: paged at each block size (blue) against contiguous reservation (red)")
    fig.tight_layout()
    return fig


def throughput_figure(curve, title="decode, modelled"):
    """Tokens/s against batch size (log-log), with where the step time comes from."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    exact_log.loglog(a, curve["batch"], curve["tokens_per_s"], "o-")
    a.set_xlabel("sequences in the batch")
    a.set_ylabel("tokens / s")
    a.set_title(title)
    b.plot(curve["batch"], 1e3 * curve["memory_s"], "o-", label="bytes / bandwidth")
    b.plot(curve["batch"], 1e3 * curve["compute_s"], "s--", label="FLOP / peak")
    exact_log.set_log(b, "x")
    b.set_xlabel("sequences in the batch")
    b.set_ylabel("ms per step")
    b.legend()
    fig.tight_layout()
    return fig
