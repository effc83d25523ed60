"""The project's figures: drawn from what the package computes, rebuilt by one command.

``python -m iokernels figures [--out DIR]`` calls :func:`write_all`, which writes

====================================  ===================================================
memory_hierarchy.png                  on-chip SRAM, L2 and HBM (H100 SXM figures from the
                                      roofline table), and where naive attention and
                                      FlashAttention keep their intermediates
flash_forward_loop.png                the tile grid of S with the visit order of the
                                      FlashAttention-1 (K/V outer) and -2 (Q outer) loops
traffic_vs_n.png                      where the bytes go against N: mandatory, naive's S
                                      and P, FA1/FA2 tile re-reads for three SRAM sizes
                                      (counted runs on top), beside the DRAM bytes a GPU
                                      measured (the recorded run)
roofline.png                          the article's problem on an H100 SXM roofline
paged_block_table.png                 a paged KV cache's block tables (from
                                      :mod:`iokernels.viz.paged`, when present)
paged_split_kv.png                    Flash-Decoding's split KV and merge (likewise)
====================================  ===================================================

Every function that draws returns a matplotlib Figure (or draws on the ``ax`` it is
given); notebooks call the same functions.  Inputs are fixed (and random inputs come
from fixed seeds), the backend is Agg when writing files, and PNG metadata carries no
version or date, so the files are the same on every run on the same software.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core import conventions as cv
from ..core import roofline as rl
from . import exact_log

#: dots per inch of the committed PNGs: readable on a screen, small in git.
DPI = 110
#: the seed of the random inputs of the counted runs (fixed, so figures are reproducible).
SEED = 20220527
#: sizes of the traffic-vs-N figure: one head, d = 64, fp16, as in the FlashAttention paper's plots.
TRAFFIC_SEQLENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: lengths at which the NumPy kernels are run (and counted) on top of the model curves.
COUNTED_SEQLENS = (128, 256, 512)
MB = 1e6

_NAIVE_COLOR, _FLASH_COLOR, _FA1_COLOR, _FLOOR_COLOR = "#c0392b", "#1f77b4", "#8e44ad", "#555555"


def _figure(figsize):
    from matplotlib.figure import Figure
    return Figure(figsize=figsize, layout="constrained")


# --------------------------------------------------------------------------- memory hierarchy
def memory_hierarchy(gpu: str = "H100 SXM"):
    """Memory levels of ``gpu`` and where each algorithm keeps S, P and its statistics."""
    from matplotlib.patches import FancyArrowPatch, Rectangle
    g = rl.get_gpu(gpu)
    sram_total_mb = g["smem_per_sm_kib"] * 1024 * g["sms"] / MB
    levels = [  # (name, detail, y, width, colour)
        ("registers + SRAM (shared memory)",
         f"on chip: {g['smem_per_sm_kib']} KiB per SM x {g['sms']} SMs = {sram_total_mb:.0f} MB",
         2.0, 3.0, "#f6e58d"),
        ("L2 cache", f"{g['l2_mib']} MiB, shared by all SMs" if g.get("l2_mib") else "shared by all SMs",
         1.0, 4.6, "#dff9fb"),
        ("HBM (device memory)", f"{g['memory_gb']} GB at {g['hbm_tbps']} TB/s", 0.0, 6.2, "#c7ecee"),
    ]
    fig = _figure((10.5, 4.6))
    ax = fig.add_subplot()
    cx = 5.0
    for name, detail, y, w, colour in levels:
        ax.add_patch(Rectangle((cx - w / 2, y + 0.08), w, 0.8, facecolor=colour, edgecolor="black"))
        ax.text(cx, y + 0.6, name, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(cx, y + 0.3, detail, ha="center", va="center", fontsize=8.5)
    # where each algorithm keeps what
    ax.text(0.0, 3.25, "naive attention", ha="left", fontsize=10, weight="bold", color=_NAIVE_COLOR)
    ax.text(0.0, 2.45, "one row or tile at a time", ha="left", fontsize=8.5, color=_NAIVE_COLOR)
    ax.text(0.0, 0.45, "S = QK^T and P = softmax(S):\nN x N each, written and read back\n"
            "(4 N^2 elements of traffic)", ha="left", va="center", fontsize=8.5, color=_NAIVE_COLOR)
    ax.text(10.0, 3.25, "FlashAttention", ha="right", fontsize=10, weight="bold", color=_FLASH_COLOR)
    ax.text(10.0, 2.45, "Q_i, K_j, V_j, S_ij, P_ij tiles;\nrunning m_i, l_i and O_i",
            ha="right", va="center", fontsize=8.5, color=_FLASH_COLOR)
    ax.text(10.0, 0.45, "only Q, K, V, O and LSE\n(S and P never leave the chip)", ha="right",
            va="center", fontsize=8.5, color=_FLASH_COLOR)
    for x, colour in ((1.2, _NAIVE_COLOR), (8.8, _FLASH_COLOR)):
        ax.add_patch(FancyArrowPatch((x, 0.95), (x, 2.2), arrowstyle="<|-|>", mutation_scale=12,
                                     color=colour, lw=1.5))
    ax.text(1.35, 1.55, "traffic grows\nas N^2", fontsize=8, color=_NAIVE_COLOR, va="center")
    ax.text(8.65, 1.55, "traffic grows\nas N^2 d^2 / M", fontsize=8, color=_FLASH_COLOR, va="center",
            ha="right")
    ax.set_xlim(-0.1, 10.1)
    ax.set_ylim(-0.1, 3.5)
    ax.axis("off")
    ax.set_title(f"Memory hierarchy ({gpu}; datasheet and whitepaper figures) and where the "
                 "intermediates of attention live", fontsize=10)
    return fig


# --------------------------------------------------------------------------- the loop
def _visit_order(Tr, Tc, Nq, Nk, Br, Bc, causal, loop_order):
    """{(i, j): visit number} over the tiles that are not skipped, in the loop's order."""
    pairs = [(i, j) for i in range(Tr) for j in range(Tc)] if loop_order == "fa2" else \
            [(i, j) for j in range(Tc) for i in range(Tr)]
    order, n = {}, 0
    for i, j in pairs:
        state = cv.tile_state(i * Br, min((i + 1) * Br, Nq), j * Bc, min((j + 1) * Bc, Nk), Nq, Nk, causal)
        if state != "skip":
            n += 1
            order[(i, j)] = (n, state)
    return order


def flash_forward_loop(seqlen_q: int = 4 * 64, seqlen_k: int = 6 * 64, block_q: int = 64,
                       block_k: int = 64, causal: bool = True):
    """The S matrix in Br x Bc tiles, numbered in the order each loop visits them."""
    from matplotlib.patches import Rectangle
    Tr, Tc = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    fig = _figure((10.5, 5.2))
    axes = fig.subplots(1, 2)
    colours = {"full": "#aed6f1", "partial": "#f9e79f", "skip": "#eeeeee"}
    titles = {
        "fa1": "FlashAttention-1: K/V tiles outer\nload K_j, V_j -> SRAM once; at every visit read Q_i,\n"
               "and read and write back O_i, m_i, l_i in HBM",
        "fa2": "FlashAttention-2: Q tiles outer\nload Q_i -> SRAM once; K_j, V_j streamed;\n"
               "write O_i, LSE_i -> HBM once per row of tiles",
    }
    for ax, order_name in zip(axes, ("fa1", "fa2")):
        order = _visit_order(Tr, Tc, seqlen_q, seqlen_k, block_q, block_k, causal, order_name)
        for i in range(Tr):
            for j in range(Tc):
                n, state = order.get((i, j), (None, "skip"))
                ax.add_patch(Rectangle((j, Tr - 1 - i), 1, 1, facecolor=colours[state], edgecolor="grey"))
                if n is not None:
                    ax.text(j + 0.5, Tr - 0.5 - i, str(n), ha="center", va="center", fontsize=9)
        ax.set_xlim(0, Tc)
        ax.set_ylim(0, Tr)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(Tc) + 0.5, [f"K{j},V{j}" for j in range(Tc)], fontsize=7)
        ax.set_yticks(np.arange(Tr) + 0.5, [f"Q{i}" for i in reversed(range(Tr))], fontsize=7)
        ax.set_title(titles[order_name], fontsize=9)
    mask = "bottom-right causal" if causal else "no mask"
    fig.suptitle(f"Tiles of S = QK^T (Nq={seqlen_q}, Nk={seqlen_k}, Br={block_q}, Bc={block_k}, {mask})\n"
                 "numbers: visit order; blue: whole tile visible; yellow: masked inside; "
                 "grey: skipped, never loaded", fontsize=9)
    return fig


# --------------------------------------------------------------------------- traffic vs N
#: SRAM capacities M of the traffic figure (KiB): the FlashAttention paper's tile choice for each
#: (:meth:`TileConfig.from_sram`) shows the Theta(N^2 d^2 / M) law; 228 KiB is an H100/H200 SM.
SRAM_KIB = (16, 64, 228)
_M_STYLES = {16: ":", 64: "-.", 228: "-"}


def paper_config(head_dim: int = 64, dtype: str = "float16", sram_kib: int = SRAM_KIB[-1],
                 loop_order: str = "fa2"):
    """The FlashAttention paper's tiles for an SRAM of ``sram_kib``: Bc = ceil(M / 4d), Br = min(Bc, d)."""
    import iokernels as ik
    return ik.TileConfig.from_sram(sram_kib * 1024, head_dim, dtype, loop_order=loop_order)


def _one_head(n, head_dim, dtype, causal):
    return dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=head_dim, dtype=dtype,
                causal=causal)


def _parts(t, n, head_dim, dtype):
    from ..core import traffic
    return traffic.decompose(t, heads=1, seqlen_q=n, seqlen_k=n, head_dim=head_dim,
                             itemsize=cv.itemsize_of(dtype))


def traffic_curves(seqlens=TRAFFIC_SEQLENS, head_dim: int = 64, dtype: str = "float16", config=None,
                   causal: bool = False) -> dict:
    """Modelled HBM bytes per N (one head): naive, fa1, fa2 and the mandatory floor.

    ``config`` defaults to the paper's tiles for 228 KiB of SRAM (:func:`paper_config`).
    """
    from ..core import traffic
    config = paper_config(head_dim, dtype) if config is None else config
    out = {"N": list(seqlens), "naive": [], "fa1": [], "fa2": [], "mandatory": []}
    for n in seqlens:
        kw = _one_head(n, head_dim, dtype, causal)
        out["naive"].append(traffic.model("naive", **kw).total)
        out["fa1"].append(traffic.model("fa1", config=config.replace(loop_order="fa1"), **kw).total)
        out["fa2"].append(traffic.model("fa2", config=config.replace(loop_order="fa2"), **kw).total)
        out["mandatory"].append(rl.mandatory_bytes(n, n, head_dim, itemsize=cv.itemsize_of(dtype)))
    return out


def traffic_parts(seqlens=TRAFFIC_SEQLENS, head_dim: int = 64, dtype: str = "float16",
                  sram_kib=SRAM_KIB, causal: bool = False) -> dict:
    """Where the modelled bytes go, per N (one head), split by :func:`iokernels.traffic.decompose`.

    Returns {"N", "mandatory", "S and P" (naive's intermediates), "fa2", "fa1"}, where "fa2"
    and "fa1" map each SRAM size in ``sram_kib`` to {"config", "tile re-reads"}: FA2 re-reads
    K and V once per query tile (2 N^2 d / Br elements), FA1 re-reads Q and O once per key
    tile (about 3 N^2 d / Bc, plus m and l): with Bc = M / 4d that is Theta(N^2 d^2 / M).
    """
    from ..core import traffic
    out = {"N": list(seqlens), "mandatory": [], "S and P": [],
           "fa2": {m: {"config": paper_config(head_dim, dtype, m, "fa2"), "tile re-reads": []} for m in sram_kib},
           "fa1": {m: {"config": paper_config(head_dim, dtype, m, "fa1"), "tile re-reads": []} for m in sram_kib}}
    for n in seqlens:
        kw = _one_head(n, head_dim, dtype, causal)
        naive = _parts(traffic.model("naive", **kw), n, head_dim, dtype)
        out["mandatory"].append(naive["mandatory"])
        out["S and P"].append(naive["S and P"])
        for order in ("fa2", "fa1"):
            for m, entry in out[order].items():
                t = traffic.model(order, config=entry["config"], **kw)
                entry["tile re-reads"].append(_parts(t, n, head_dim, dtype)["tile re-reads"])
    return out


def counted_traffic(seqlens=COUNTED_SEQLENS, head_dim: int = 64, dtype: str = "float16", config=None,
                    causal: bool = False, seed: int = SEED, progress: bool = False) -> dict:
    """Run the NumPy kernels at each N and count their HBM bytes (fixed-seed inputs).

    Returns {"N", "naive", "fa1", "fa2"} (totals) and "parts": {kind: [decompose(...) per N]}.
    ``config`` defaults to :func:`paper_config` (the tiles of the figure's 228 KiB lines).
    """
    import iokernels as ik
    from ..core import testing, traffic
    config = paper_config(head_dim, dtype) if config is None else config
    rng = np.random.default_rng(seed)
    out = {"N": list(seqlens), "naive": [], "fa1": [], "fa2": [], "parts": {"naive": [], "fa1": [], "fa2": []}}
    jobs = [(n, kind) for n in seqlens for kind in ("naive", "fa1", "fa2")]
    if progress:
        from tqdm.auto import tqdm
        jobs = tqdm(jobs, desc="counting traffic", unit="run", leave=False)
    inputs = {}
    for n, kind in jobs:
        if n not in inputs:
            inputs[n] = testing.make_inputs(rng, heads_q=1, seqlen_q=n, head_dim=head_dim, dtype=dtype)
        q, k, v = inputs[n]
        backend = "naive" if kind == "naive" else "tiled"
        cfg = None if kind == "naive" else config.replace(loop_order=kind)
        with traffic.count() as t:
            ik.attention(q, k, v, causal=causal, backend=backend, config=cfg)
        out[kind].append(t.total)
        out["parts"][kind].append(_parts(t, n, head_dim, dtype))
    return out


#: profiled cases shown beside the model, in this order (names as scripts/profile_traffic.py writes them)
MEASURED_CASES = ("naive attention", "sdpa flash", "cupy attention", "numba attention")


def measured_parts(rec=None, size: str = "large") -> list[dict]:
    """For each recorded attention case: the model's parts and the measured DRAM bytes, per mandatory byte.

    Each dict: case, problem, model (decompose() of the model the profiler script used,
    divided by the mandatory bytes), measured (ncu DRAM read + write / mandatory).  ``rec``
    defaults to :func:`iokernels.core.recorded.load`; [] when there is no record.
    """
    from ..core import recorded, traffic
    if rec is None:
        try:
            rec = recorded.load()
        except (FileNotFoundError, ValueError):
            return []
    rows = {r["case"]: r for r in recorded.traffic_rows(rec) if r.get("size") == size}
    out = []
    for case in MEASURED_CASES:
        r = rows.get(case)
        if not (r and r.get("mandatory_read") and r.get("model_by_tensor")):
            continue
        p = r["problem"]
        t = traffic.Traffic()
        for name, (rd, wr) in r["model_by_tensor"].items():
            t.add(name, rd, wr)
        parts = traffic.decompose(t, heads=p["B"] * p["H"], seqlen_q=p["N"], seqlen_k=p["N"], head_dim=p["d"],
                                  itemsize=cv.itemsize_of(p["dtype"]))
        mand = r["mandatory_read"] + r["mandatory_written"]
        out.append(dict(case=case, problem=p, model={k: v / mand for k, v in parts.items()},
                        measured=(r["measured_read"] + r["measured_written"]) / mand))
    return out


_PART_COLORS = {"mandatory": _FLOOR_COLOR, "S and P": _NAIVE_COLOR, "tile re-reads": _FLASH_COLOR,
                "LSE": "#95a5a6", "other": "#f39c12"}


def measured_vs_model(rec=None, size: str = "large", ax=None):
    """Bars per recorded case: the model's bytes split into parts, and what the GPU's DRAM moved,
    both as multiples of the mandatory bytes (log scale)."""
    from ..core import recorded
    fig = None
    if ax is None:
        fig = _figure((7.0, 4.0))
        ax = fig.add_subplot()
    if rec is None:
        try:
            rec = recorded.load()
        except (FileNotFoundError, ValueError):
            rec = None
    rows = measured_parts(rec, size) if rec is not None else []
    if not rows:
        ax.text(0.5, 0.5, "no recorded GPU run in benchmarks/results", ha="center", va="center",
                transform=ax.transAxes)
        ax.axis("off")
        return fig if fig is not None else ax
    y = 0.0
    ticks, labels = [], []
    for r in rows:
        left = 0.0
        for part in ("mandatory", "S and P", "tile re-reads"):
            w = r["model"][part]
            if w:
                ax.barh(y + 0.2, w, left=left if left else None, height=0.38, color=_PART_COLORS[part])
                left += w
        ax.barh(y - 0.2, r["measured"], height=0.38, color="black")
        ax.text(r["measured"] * 1.1, y - 0.2, f"{r['measured']:.2f}x", va="center", fontsize=7)
        p = r["problem"]
        ticks.append(y)
        labels.append(f"{r['case']}\nB={p['B']} H={p['H']} N={p['N']} d={p['d']} {p['dtype']}")
        y -= 1.2
    exact_log.set_log(ax, "x")
    ax.set_yticks(ticks, labels, fontsize=7)
    from matplotlib.patches import Patch
    handles = [Patch(color=_PART_COLORS[part], label=f"model as written: {part}")
               for part in ("mandatory", "S and P", "tile re-reads")]
    handles.append(Patch(color="black", label="measured DRAM bytes (Nsight Compute)"))
    ax.set_xlabel("bytes / mandatory bytes (log)")
    # below the axes: inside, any corner covers a bar of some record
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.14), ncol=2, frameon=False)
    ax.set_title(f"On a GPU: K/V re-reads hit the L2 cache, S and P do not\n{recorded.short_label(rec)}",
                 fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return fig if fig is not None else ax


def traffic_vs_n(seqlens=TRAFFIC_SEQLENS, head_dim: int = 64, dtype: str = "float16", sram_kib=SRAM_KIB,
                 causal: bool = False, counted: dict | None = None, rec=None, axes=None):
    """Where the bytes go, against N (log-log, one head), and what a GPU measured.

    Left: the mandatory bytes (linear in N); naive attention's S and P (quadratic); the tile
    re-reads of FlashAttention-2 (K, V once per query tile) and -1 (Q, O once per key tile)
    for each SRAM size M, tiles as the paper chooses them: quadratic too, but divided by
    the tile size, so they fall as M grows.  ``counted`` (from :func:`counted_traffic`) adds
    markers.  Right: :func:`measured_vs_model` for the recorded GPU run.
    """
    parts = traffic_parts(seqlens, head_dim, dtype, sram_kib, causal)
    fig = None
    if axes is None:
        fig = _figure((13.0, 4.8))
        axes = fig.subplots(1, 2, width_ratios=(1.25, 1))
    ax = axes[0]
    N = np.array(parts["N"])
    exact_log.loglog(ax, N, np.array(parts["mandatory"]) / MB, "--", color=_FLOOR_COLOR,
              label="mandatory: read Q, K, V and write O once (~N d)")
    exact_log.loglog(ax, N, np.array(parts["S and P"]) / MB, color=_NAIVE_COLOR, lw=2,
              label="naive: write and read S and P (~N^2)")
    orders = (("fa2", _FLASH_COLOR, "FA2 re-reads K, V"), ("fa1", _FA1_COLOR, "FA1 re-reads Q, O, m, l"))
    for order, colour, what in orders:
        for m, entry in parts[order].items():
            cfg = entry["config"]
            exact_log.loglog(ax, N, np.array(entry["tile re-reads"]) / MB, _M_STYLES.get(m, "-"), color=colour,
                      label=f"{what}: M={m} KiB (Br={cfg.block_q}, Bc={cfg.block_k})")
    if counted:
        for kind, key, colour in (("naive", "S and P", _NAIVE_COLOR), ("fa2", "tile re-reads", _FLASH_COLOR),
                                  ("fa1", "tile re-reads", _FA1_COLOR)):
            exact_log.loglog(ax, counted["N"], [p[key] / MB for p in counted["parts"][kind]], "o", color=colour,
                      mfc="none", ms=8)
        ax.plot([], [], "o", color="black", mfc="none", label="counted while running (NumPy, M=228 KiB)")
    ax.set_xlabel("sequence length N (= Nq = Nk)")
    ax.set_ylabel("HBM bytes (MB), as written, no cache")
    ax.set_title(f"Where the bytes go: one head, d={head_dim}, {dtype}" + (", causal" if causal else "")
                 + "\ntile re-reads ~ N^2 d / (tile size); FA1's ~ N^2 d^2 / M"
                 "\n(FA2's Br = min(Bc, d) stops growing at d: its 64 and 228 KiB lines coincide)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    measured_vs_model(rec, ax=axes[1])
    return fig if fig is not None else axes


#: the decode kernels the recorded decode summary compares (default versions, contiguous and paged)
DECODE_SUMMARY_RUNNERS = ("sdpa:cudnn", "sdpa:flash", "cupy:v4", "cupy:v4 paged", "cupy:v3", "cupy:v3 paged",
                          "numba:v3", "numba:v3 paged")


def recorded_decode_summary(rec=None, dtype: str = "float16", runners=DECODE_SUMMARY_RUNNERS, ax=None):
    """Decode speed of each kernel as a share of the best SDPA backend of the same case, one
    group of bars per (batch, seqlen) case of the recorded GPU run, labelled with the record."""
    from ..core import recorded
    from .palette import colour
    rec = recorded.load() if rec is None else rec
    rows = recorded.bench_rows(rec, section="decode", dtype=dtype, runners=runners)
    cases = sorted({(r["batch"], r["seqlen"]) for r in rows})
    present = [rn for rn in runners if any(r["runner"] == rn for r in rows)]
    fig = None
    if ax is None:
        fig = _figure((9.0, 3.8))
        ax = fig.add_subplot()
    width = 0.8 / max(1, len(present))
    for k, rn in enumerate(present):
        speed = {(r["batch"], r["seqlen"]): r.get("speed_vs_best_sdpa") for r in rows if r["runner"] == rn}
        ax.bar(np.arange(len(cases)) + (k - (len(present) - 1) / 2) * width,
               [speed.get(c) or 0.0 for c in cases], width, label=rn, color=colour(rn),
               hatch="//" if "paged" in rn else None)
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    ax.set_xticks(np.arange(len(cases)), [f"B={b}, N={n}" for b, n in cases], fontsize=8)
    ax.set_ylabel("speed / best SDPA backend\n(same case, same run)")
    ax.set_title(f"Decode, {dtype}, GQA {rows[0]['heads_q']}/{rows[0]['heads_kv']} heads, "
                 f"d={rows[0]['head_dim']} -- {recorded.short_label(rec)}" if rows else "no decode rows", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return fig if fig is not None else ax


# --------------------------------------------------------------------------- roofline
def roofline_points(seqlen: int = 4096, head_dim: int = 128, dtype: str = "float16",
                    gpu: str = "H100 SXM", config=None) -> dict:
    """FLOPs, bytes, intensity and time bounds of naive attention and FlashAttention-2 (one head).

    FlashAttention-2's bytes are its traffic model with ``config`` (default: the paper's
    tile choice for the GPU's shared memory, :meth:`TileConfig.from_sram`).  The model
    counts every re-read of K and V from HBM (once per query tile), as written, no caches;
    ``out["fa2"]["parts"]`` splits its bytes (:func:`iokernels.traffic.decompose`).  On a real
    GPU the L2 cache serves most of those re-reads: ``out["measured"]``, when a recorded GPU
    run exists, places FlashAttention-2 at the DRAM bytes the profiler measured for torch's
    flash kernel, as a multiple of the mandatory bytes (``ratio``) with the record's label.
    """
    import iokernels as ik
    from ..core import recorded, traffic
    itemsize = cv.itemsize_of(dtype)
    flops = rl.attention_flops(seqlen, seqlen, head_dim)
    mand = rl.mandatory_bytes(seqlen, seqlen, head_dim, itemsize=itemsize)
    naive = mand + rl.naive_extra_bytes(seqlen, seqlen, itemsize=itemsize)
    if config is None:
        config = ik.TileConfig.from_sram(rl.get_gpu(gpu)["smem_per_sm_kib"] * 1024, head_dim, dtype)
    cfg = config
    fa2_t = traffic.model("fa2", batch=1, heads_q=1, heads_kv=1, seqlen_q=seqlen, seqlen_k=seqlen,
                          head_dim=head_dim, dtype=dtype, config=cfg)
    out = {"flops": flops, "ridge": rl.ridge_point(gpu, dtype), "gpu": gpu, "dtype": dtype, "config": cfg}
    for name, nbytes in (("naive", naive), ("fa2", fa2_t.total), ("ideal", mand)):
        out[name] = dict(bytes=nbytes, **rl.time_bounds(flops, nbytes, gpu, dtype))
    out["fa2"]["parts"] = traffic.decompose(fa2_t, heads=1, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
                                            itemsize=itemsize)
    flash = next((r for r in measured_parts() if r["case"] == "sdpa flash"), None)
    if flash is not None:
        nbytes = flash["measured"] * mand
        out["measured"] = dict(bytes=nbytes, ratio=flash["measured"], problem=flash["problem"],
                               label=recorded.short_label(recorded.load()),
                               **rl.time_bounds(flops, nbytes, gpu, dtype))
    return out


def draw_roof(ax, gpu: str, dtype: str, intensities):
    """Draw ``gpu``'s roof (bandwidth slope, then the ``dtype`` peak) over ``intensities`` and its ridge.

    Returns the peak in TFLOP/s (ridge in FLOP/B times bandwidth in TB/s).
    """
    g = rl.get_gpu(gpu)
    ridge = rl.ridge_point(gpu, dtype)
    peak = ridge * g["hbm_tbps"]
    exact_log.loglog(ax, intensities, np.minimum(peak, intensities * g["hbm_tbps"]), color="black", lw=2,
              label=f"{gpu}: {g['hbm_tbps']} TB/s, {peak:.0f} TFLOP/s ({dtype})")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.text(ridge * 1.08, peak * 0.04, f"ridge {ridge:.0f} FLOP/B", fontsize=8, color="grey")
    return peak


def roofline(seqlen: int = 4096, head_dim: int = 128, dtype: str = "float16", gpu: str = "H100 SXM",
             ax=None):
    """A roofline for ``gpu`` with naive attention, FlashAttention-2 and the floor placed on it.

    FlashAttention-2 appears twice: as written (every K/V re-read from HBM, the model) and
    at the DRAM bytes a profiler measured for a fused flash kernel (the recorded GPU run,
    when there is one), where the L2 cache has served the re-reads.
    """
    pts = roofline_points(seqlen, head_dim, dtype, gpu)
    g = rl.get_gpu(gpu)
    fig = None
    if ax is None:
        fig = _figure((7.0, 4.6))
        ax = fig.add_subplot()
    peak = draw_roof(ax, gpu, dtype, exact_log.logspace(0, 4, 200))
    cfg = pts["config"]
    rereads = pts["fa2"]["parts"]["tile re-reads"] / pts["fa2"]["bytes"]
    points = [("naive", _NAIVE_COLOR, "o", "naive (S and P through HBM)"),
              ("fa2", _FLASH_COLOR, "o", f"FlashAttention-2 as written, Br={cfg.block_q}, Bc={cfg.block_k}:\n"
                                         f"  {rereads:.0%} of its bytes are K/V re-reads (no L2)")]
    if "measured" in pts:
        m = pts["measured"]
        points.append(("measured", _FLASH_COLOR, "*", f"FlashAttention-2, measured DRAM bytes\n"
                                                      f"  ({m['ratio']:.2f}x mandatory at N={m['problem']['N']}; "
                                                      f"{m['label']})"))
    points.append(("ideal", _FLOOR_COLOR, "o", "mandatory bytes only"))
    for key, colour, marker, label in points:
        p = pts[key]
        intensity = pts["flops"] / p["bytes"]
        attainable = min(peak, intensity * g["hbm_tbps"])
        ax.plot([intensity], [attainable], marker, color=colour, ms=12 if marker == "*" else 9,
                mfc="white" if key == "measured" else colour,
                label=f"{label}: {intensity:.0f} FLOP/B, {p['bound']}-bound")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Roofline: attention, N={seqlen}, d={head_dim}, one head", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return fig if fig is not None else ax


# --------------------------------------------------------------------------- all of them
def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def figure_makers(progress: bool = False) -> dict:
    """{file name: function returning a Figure} for every figure :func:`write_all` writes."""
    def traffic():
        counted = counted_traffic(progress=progress)
        return traffic_vs_n(counted=counted)

    makers = {
        "memory_hierarchy.png": memory_hierarchy,
        "flash_forward_loop.png": flash_forward_loop,
        "traffic_vs_n.png": traffic,
        "roofline.png": roofline,
    }
    try:
        from . import paged as vp
    except ImportError:     # the paged figures come with iokernels.viz.paged
        vp = None
    for name, attr in (("paged_block_table.png", "block_table_figure"), ("paged_split_kv.png", "split_kv_figure")):
        fn = getattr(vp, attr, None)
        if fn is not None:
            makers[name] = fn
    return makers


def _as_figure(obj):
    """A Figure from what a maker returned (a Figure, or Axes, or (fig, ...) tuple)."""
    if isinstance(obj, tuple):
        obj = obj[0]
    return obj.get_figure() if hasattr(obj, "get_figure") and not hasattr(obj, "savefig") else obj


def write_all(out_dir, progress: bool = True, names=None) -> list[Path]:
    """Write every figure (or those in ``names``) into ``out_dir``; returns the paths written.

    Drawn under matplotlib's default style, whatever the user's matplotlibrc says, so the
    files depend only on the package and the software versions (tests/test_figures.py holds
    the committed copies to what this writes).
    """
    import matplotlib
    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with matplotlib.style.context("default"):
        for name, make in figure_makers(progress).items():
            if names is not None and name not in names:
                continue
            fig = _as_figure(make())
            paths.append(_save(fig, out / name))
            plt.close(fig)
    return paths
