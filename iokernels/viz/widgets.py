"""Interactive widgets for the notebooks (ipywidgets); the numbers come from the package.

==========================  ============================================================
:func:`roofline_calculator` notebook 00: N, d, dtype and GPU in; FLOPs, bytes,
                            intensity, time bounds and a roofline plot out
:func:`online_softmax_stepper`  notebook 02: step through the blocks of a score row,
                            watching m, l and the rescale factor alpha
:func:`tile_explorer`       notebook 03: block sizes, SRAM capacity and loop order in;
                            SRAM use, tile counts and modelled HBM traffic out
==========================  ============================================================

Each function returns the widget (display it, or let the notebook cell show it).  The
text part of every widget is an ``HTML`` widget whose value is rebuilt on every change,
so a browser test can watch it change.  ipywidgets and matplotlib are imported inside
the functions.
"""
from __future__ import annotations

import html

from ..core import conventions as cv
from ..core import roofline as rl
from . import figures

__all__ = ["roofline_calculator", "roofline_table", "online_softmax_stepper", "online_softmax_table",
           "tile_explorer", "tile_report"]

#: the article's problem: the calculator opens on it
ARTICLE_SEQLEN, ARTICLE_HEAD_DIM, ARTICLE_DTYPE, ARTICLE_GPU = 4096, 128, "float16", "H100 SXM"
DTYPES = ("float16", "bfloat16", "float32")
#: the calculator's sequence lengths: powers of two, so one step of the slider doubles N
SEQLENS = tuple(2 ** k for k in range(8, 16))
HEAD_DIMS = (32, 64, 96, 128, 256)


def _table(rows, header=None) -> str:
    """An HTML table from rows of cells (strings are escaped)."""
    out = ['<table style="border-collapse:collapse;font-family:monospace">']
    if header:
        out.append("<tr>" + "".join(f'<th style="padding:2px 10px;text-align:right">{html.escape(str(h))}</th>'
                                    for h in header) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f'<td style="padding:2px 10px;text-align:right">{html.escape(str(c))}</td>'
                                    for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _time(s: float) -> str:
    return f"{s * 1e6:,.1f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms"


# --------------------------------------------------------------------------- notebook 00
def roofline_table(seqlen=ARTICLE_SEQLEN, head_dim=ARTICLE_HEAD_DIM, dtype=ARTICLE_DTYPE, gpu=ARTICLE_GPU) -> str:
    """The calculator's numbers as an HTML table (also usable without widgets)."""
    pts = figures.roofline_points(seqlen, head_dim, dtype, gpu)
    cfg = pts["config"]
    rows = [("forward FLOPs (4 N^2 d)", f"{pts['flops'] / 1e9:,.2f} GFLOP", "", "")]
    for key, label in (("ideal", "mandatory: Q, K, V, O once"), ("naive", "naive: + write/read S and P"),
                       ("fa2", f"FlashAttention-2 model (Br={cfg.block_q}, Bc={cfg.block_k})")):
        p = pts[key]
        rows.append((label, f"{p['bytes'] / 1e6:,.2f} MB", f"{p['intensity']:,.1f} FLOP/B",
                     f"{p['bound']}-bound: memory {_time(p['memory_s'])}, compute {_time(p['compute_s'])}"))
        if key == "fa2":
            parts = p["parts"]
            rows.append(("  of which K/V re-reads (per query tile)", f"{parts['tile re-reads'] / 1e6:,.2f} MB",
                         "", "an L2 cache serves most of these on a GPU"))
    rows.append((f"ridge point of {gpu} ({dtype})", "", f"{pts['ridge']:,.1f} FLOP/B", ""))
    return _table(rows, header=("", "HBM bytes", "intensity", "time bounds (one head)"))


def roofline_calculator(seqlen=ARTICLE_SEQLEN, head_dim=ARTICLE_HEAD_DIM, dtype=ARTICLE_DTYPE, gpu=ARTICLE_GPU):
    """A slider for N (powers of two), drop-downs for d, dtype and GPU; the numbers and the roofline below."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display
    n = w.SelectionSlider(options=sorted(set(SEQLENS) | {seqlen}), value=seqlen, description="N",
                          continuous_update=False, style={"description_width": "initial"})
    d = w.Dropdown(options=HEAD_DIMS, value=head_dim, description="head dim d")
    dt = w.Dropdown(options=DTYPES, value=dtype, description="dtype")
    g = w.Dropdown(options=list(rl.GPUS) + list(rl.MEASURED), value=gpu, description="GPU")
    numbers = w.HTML()
    plot = w.Output()

    def update(_=None):
        numbers.value = roofline_table(n.value, d.value, dt.value, g.value)
        plot.clear_output(wait=True)
        with plot:
            fig, ax = plt.subplots(figsize=(6.5, 4.0))
            figures.roofline(n.value, d.value, dt.value, g.value, ax=ax)
            display(fig)
            plt.close(fig)

    for c in (n, d, dt, g):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([n, d]), w.HBox([dt, g]), numbers, plot])


# --------------------------------------------------------------------------- notebook 02
def online_softmax_table(row, block, upto=None, values=None) -> str:
    """The steps of :func:`iokernels.online_softmax.online_softmax_steps` as an HTML table.

    ``upto``: show blocks 1..upto only (None: all), and the running result after them.
    """
    from ..online_softmax import online_softmax_steps
    r = online_softmax_steps(row, block, values=values)
    steps = r.steps if upto is None else r.steps[:upto]
    body = [(s.index, ", ".join(f"{x:g}" for x in s.block), f"{s.m_old:g}", f"{s.m_new:g}", f"{s.alpha:.4f}",
             f"{s.l_old:.4f}", f"{s.l_rescaled:.4f}", f"{s.block_sum:.4f}", f"{s.l_new:.4f}") for s in steps]
    last = steps[-1]
    done = len(steps) == len(r.steps)
    tail = (f"<p>after block {last.index} of {len(r.steps)}: m = {last.m_new:g}, l = {last.l_new:.4f}"
            + (f"; the row is done: LSE = m + log l = {r.lse:.4f}, softmax = "
               f"[{', '.join(f'{p:.4f}' for p in r.softmax)}]" if done else "") + "</p>")
    return _table(body, header=("block", "scores", "m old", "m new", "alpha = e^(m_old - m_new)", "l old",
                                "alpha * l old", "block sum e^(x - m_new)", "l new")) + tail


def online_softmax_stepper(row=(2.0, 1.0, 3.0, 0.0), block=2):
    """Step through the blocks of a score row: a text box for the row, sliders for the
    block size and the number of blocks seen so far."""
    import ipywidgets as w
    text = w.Text(value=", ".join(f"{x:g}" for x in row), description="row",
                  continuous_update=False)
    size = w.IntSlider(value=block, min=1, max=8, description="block size", continuous_update=False)
    upto = w.IntSlider(value=1, min=1, max=max(1, -(-len(row) // block)), description="blocks seen",
                       continuous_update=False)
    out = w.HTML()

    def parse():
        try:
            xs = [float(t) for t in text.value.replace(";", ",").split(",") if t.strip()]
            return xs if xs else None
        except ValueError:
            return None

    def update(_=None):
        xs = parse()
        if xs is None:
            out.value = "<p>row: type numbers separated by commas, e.g. 2, 1, 3, 0 (-inf for a masked score)</p>"
            return
        nblocks = -(-len(xs) // size.value)
        upto.max = max(1, nblocks)
        upto.value = min(upto.value, upto.max)
        out.value = online_softmax_table(xs, size.value, upto.value)

    for c in (text, size, upto):
        c.observe(update, names="value")
    update()
    return w.VBox([text, w.HBox([size, upto]), out])


# --------------------------------------------------------------------------- notebook 03
def tile_report(seqlen=2048, head_dim=64, dtype="float16", block_q=64, block_k=64, sram_kib=228,
                causal=False) -> str:
    """SRAM use, tile counts and modelled traffic (naive, FA1, FA2) of one tile choice, as HTML."""
    import iokernels as ik
    from ..core import traffic
    cfg = ik.TileConfig(block_q=block_q, block_k=block_k, sram_bytes=sram_kib * 1024)
    need = cfg.sram_usage(head_dim, dtype)
    head = (f"<p>tiles Br={block_q}, Bc={block_k} at d={head_dim} ({dtype}) need {need:,} B of SRAM "
            f"of {cfg.sram_bytes:,} B ({need / cfg.sram_bytes:.0%}); Tr = {-(-seqlen // block_q)}, "
            f"Tc = {-(-seqlen // block_k)}</p>")
    try:
        cfg.check_fits(head_dim, dtype)
    except ValueError as e:
        return head + f'<p style="color:#c0392b"><b>does not fit:</b> {html.escape(str(e))}</p>'
    kw = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
              dtype=dtype, causal=causal)
    naive = traffic.model("naive", **kw)
    rows = []
    for kind, label in (("naive", "naive"), ("fa1", "FlashAttention-1 (K/V outer)"),
                        ("fa2", "FlashAttention-2 (Q outer)")):
        t = naive if kind == "naive" else traffic.model(kind, config=cfg.replace(loop_order=kind), **kw)
        per = t.as_dict()
        rows.append((label, f"{t.total / 1e6:,.2f} MB", f"{t.total / naive.total:.2f}",
                     "; ".join(f"{k} {(r + wr) / 1e6:,.2f}" for k, (r, wr) in per.items())))
    mand = rl.mandatory_bytes(seqlen, seqlen, head_dim, itemsize=cv.itemsize_of(dtype))
    rows.append(("mandatory floor", f"{mand / 1e6:,.2f} MB", f"{mand / naive.total:.2f}", "Q, K, V, O once"))
    return head + _table(rows, header=("", "HBM traffic", "vs naive", "per tensor (MB)"))


def tile_explorer(seqlen=2048, head_dim=64, dtype="float16"):
    """Sliders over Br, Bc and SRAM capacity: does the tile set fit, and what traffic follows."""
    import ipywidgets as w
    n = w.IntSlider(value=seqlen, min=128, max=16384, step=128, description="N", continuous_update=False)
    br = w.IntSlider(value=64, min=16, max=256, step=16, description="Br", continuous_update=False)
    bc = w.IntSlider(value=64, min=16, max=256, step=16, description="Bc", continuous_update=False)
    sram = w.IntSlider(value=228, min=16, max=256, step=4, description="SRAM KiB", continuous_update=False)
    d = w.Dropdown(options=HEAD_DIMS, value=head_dim, description="d")
    dt = w.Dropdown(options=("float16", "float32"), value=dtype, description="dtype")
    causal = w.Checkbox(value=False, description="causal")
    out = w.HTML()

    def update(_=None):
        out.value = tile_report(n.value, d.value, dt.value, br.value, bc.value, sram.value, causal.value)

    for c in (n, br, bc, sram, d, dt, causal):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([n, d, dt, causal]), w.HBox([br, bc, sram]), out])
