"""Figures for notebook 12 (ring attention).  Data comes from :mod:`iokernels.context_parallel`.

Every function takes an optional matplotlib ``ax`` (or ``axes``) and returns it; matplotlib
is imported inside the functions, so importing this module is cheap.
"""
from __future__ import annotations

import math

import numpy as np

from . import exact_log
from .. import context_parallel as cp

_MB = 1e6  # bytes per megabyte (decimal)
#: colours of the event kinds in a timeline
_KIND_COLOR = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:red"}


def _axes(ax, ncols=1, figsize=(6.0, 4.0)):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(1, ncols, figsize=figsize)
    return ax


def plot_ring(world_size=4, seqlen=32, split="zigzag", causal=True, axes=None):
    """Left: the ring, rank r sending its K/V block to r + 1, labelled with its tokens.
    Right: the (query, key) matrix, each computed block coloured by the ring step that
    computes it (white: skipped, above the causal diagonal)."""
    import matplotlib.pyplot as plt
    axes = _axes(axes, 2, (11.0, 4.8))
    ring, mat = axes
    W = world_size
    pos = cp.split_positions(seqlen, W, split)
    cmap = plt.get_cmap("viridis", max(W, 2))
    angles = [math.pi / 2 - 2 * math.pi * r / W for r in range(W)]
    xy = [(math.cos(a), math.sin(a)) for a in angles]
    for r in range(W):
        (x0, y0), (x1, y1) = xy[r], xy[(r + 1) % W]
        if W > 1:
            ring.annotate("", xy=(0.8 * x1 + 0.2 * x0, 0.8 * y1 + 0.2 * y0),
                          xytext=(0.8 * x0 + 0.2 * x1, 0.8 * y0 + 0.2 * y1),
                          arrowprops=dict(arrowstyle="->", lw=2, color="tab:orange"))
        ring.add_patch(plt.Circle((x0, y0), 0.22, color="tab:blue", alpha=0.85))
        ring.text(x0, y0, f"rank {r}", ha="center", va="center", color="white", fontsize=9)
        toks = ", ".join(f"{a}:{b}" for a, b in pos[r])
        ha = "left" if x0 > 0.3 else "right" if x0 < -0.3 else "center"
        ring.text(x0 + 0.28 * np.sign(round(x0, 6)), y0 + 0.32 * np.sign(round(y0, 6)) * (ha == "center"),
                  f"tokens {toks}", ha=ha, va="center", fontsize=8)
    ring.set_xlim(-2.3, 2.3)
    ring.set_ylim(-1.7, 1.7)
    ring.set_aspect("equal")
    ring.axis("off")
    ring.set_title(f"K/V blocks travel r -> r+1 ({split} split)")
    step = np.full((seqlen, seqlen), np.nan)
    for r in range(W):
        for s in range(W):
            c = (r - s) % W
            for qrows, krows, diag in cp.block_schedule(pos[r], pos[c], causal):
                qg = _global_rows(pos[r], qrows)
                kg = _global_rows(pos[c], krows)
                vis = np.ones((len(qg), len(kg)), bool)
                if diag:
                    vis = kg[None, :] <= qg[:, None]
                sub = step[np.ix_(qg, kg)]
                sub[vis] = s
                step[np.ix_(qg, kg)] = sub
    im = mat.imshow(step, cmap=cmap, vmin=-0.5, vmax=W - 0.5, interpolation="nearest")
    mat.set_xlabel("key position")
    mat.set_ylabel("query position")
    mat.set_title("ring step computing each (query, key) pair", fontsize=10)
    plt.colorbar(im, ax=mat, ticks=range(W), label="ring step s")
    return axes


def _global_rows(segments, local_ranges):
    """Global token indices of local row ranges of a rank holding ``segments``."""
    glob = np.concatenate([np.arange(a, b) for a, b in segments])
    return np.concatenate([glob[a:b] for a, b in local_ranges])


def plot_timeline(events_per_rank, title="ring timeline", ax=None, unit=1.0, unit_name="s"):
    """One row per rank: compute (blue), transfers in flight (orange, thin), time blocked
    waiting for a transfer (red).  ``events_per_rank``: lists of (kind, step, t0, t1).

    Each rank's clock starts at its first event (ranks of separate processes do not share
    a time origin)."""
    ax = _axes(ax, 1, (9.0, 0.6 + 0.7 * len(events_per_rank)))
    for r, events in enumerate(events_per_rank):
        origin = min((e[2] for e in events), default=0.0)
        for kind, step, t0, t1 in events:
            t0, t1 = t0 - origin, t1 - origin
            y, h = (r - 0.3, 0.6) if kind != "comm" else (r + 0.3, 0.15)
            ax.broken_barh([(t0 / unit, max(t1 - t0, 0) / unit)], (y, h), color=_KIND_COLOR[kind],
                           alpha=0.85, edgecolor="black", linewidth=0.3)
            if kind == "compute":
                ax.text((t0 + t1) / 2 / unit, r, f"s{step}", ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(events_per_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(events_per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit_name})")
    ax.set_title(title)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=c, label=k if k != "comm" else "transfer in flight")
                       for k, c in _KIND_COLOR.items()], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_work(work, ax=None):
    """Measured (query, key) pairs per rank for each split (from :func:`work_per_rank`)."""
    ax = _axes(ax, 1, (6.5, 3.8))
    W = len(next(iter(work.values()))["pairs"])
    width = 0.8 / len(work)
    for i, (split, w) in enumerate(work.items()):
        pairs = np.asarray(w["pairs"], float)
        ax.bar(np.arange(W) + i * width, pairs, width, label=f"{split} (max / mean {pairs.max() / pairs.mean():.2f})")
    ax.set_xticks(np.arange(W) + width * (len(work) - 1) / 2)
    ax.set_xticklabels([f"rank {r}" for r in range(W)])
    ax.set_ylabel("(query, key) pairs computed")
    ax.set_title("causal work per rank: every step waits for the busiest")
    ax.legend(fontsize=8)
    return ax


def plot_memory(seqlen, world_sizes, *, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16", ax=None):
    """Activation bytes one rank holds (:func:`memory_per_rank`) against one device, vs W."""
    ax = _axes(ax, 1, (6.0, 3.8))
    rows = [cp.memory_per_rank(seqlen, W, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype)
            for W in world_sizes]
    ax.plot(world_sizes, [r["per_rank"] / _MB for r in rows], "o-", label="one rank of the ring")
    ax.plot(world_sizes, [r["one_device"] / _MB for r in rows], "k--", label="one device, whole sequence")
    exact_log.set_log(ax, "x", base=2)
    exact_log.set_log(ax, "y")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("MB (Q, K/V, O, LSE)")
    ax.set_title(f"memory per rank, N={seqlen}, Hq={heads_q}, Hkv={heads_kv}, d={head_dim}, {dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_merge_error(world_sizes, errors, ax=None):
    """max|O - ref64| against W for each dtype of the partial outputs (from
    :func:`merge_error_vs_world_size`)."""
    ax = _axes(ax, 1, (6.0, 3.8))
    for pd, errs in errors.items():
        ax.plot(world_sizes, errs, "o-", label=f"partial outputs in {pd}")
    exact_log.set_log(ax, "x", base=2)
    exact_log.set_log(ax, "y")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("mean |O - O_ref64|")
    ax.set_title("merge error against the ring size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
