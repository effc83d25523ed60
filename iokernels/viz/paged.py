"""Figures and widgets for steps 3 and 4: the paged KV cache and Flash-Decoding.

Everything here draws what the package computes: the pool and tables come from a real
:class:`iokernels.paged.PagedKVCache`, the split-KV numbers from :mod:`iokernels.decode`.
Figures are deterministic (fixed seeds, passed in).  matplotlib and ipywidgets are
imported inside the functions.

* :func:`draw_cache`            logical blocks -> block tables -> physical pool, any cache
* :func:`block_table_figure`    the article's Figure 3: two sequences sharing one block
* :class:`PoolExplorer`, :func:`pool_explorer`  new / append / fork / free, redrawn
* :func:`fragmentation_figure`, :func:`block_size_figure`   reservation vs paging
* :func:`split_kv_figure`       the article's Figure 4: split the keys, merge by LSE
* :func:`occupancy_figure`, :func:`heuristic_figure`        why decode starves a GPU
* :func:`split_cost_figure`     the GPU launcher's wave model: modelled time against splits
"""
from __future__ import annotations

from . import exact_log

import importlib

import numpy as np

#: one colour per sequence (matplotlib's tab10, cycled); shared blocks are drawn grey
_SHARED_COLOR = "#bbbbbb"
_FREE_COLOR = "white"


def _colors(n):
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _dec():
    # the module, not the public function ik.decode that shares its name
    return importlib.import_module("iokernels.decode")


# --------------------------------------------------------------------------- the pool and tables
def draw_cache(cache, seq_ids=None, tokens=None, labels=None, title=None, ax=None, show_free=True):
    """Draw logical blocks, block tables and the physical pool of ``cache``.

    tokens: {seq_id: list of words}, written into the cells (else slot numbers);
    labels: {seq_id: name}.  Shared blocks (ref > 1) are grey; each physical row shows its
    reference count, and free blocks that still hold a prefix-cache key say so.
    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    seq_ids = cache.seq_ids if seq_ids is None else list(seq_ids)
    tokens = tokens or {}
    labels = labels or {}
    bs, nb = cache.block_size, cache.num_blocks
    refs = cache.ref_counts()
    cached = cache.cached_blocks()
    colors = dict(zip(seq_ids, _colors(len(seq_ids))))
    tables = {s: cache.block_table(s) for s in seq_ids}
    lens = {s: cache.seq_len(s) for s in seq_ids}

    # what each physical slot holds, from any table that points at it
    slot_word, owner = {}, {}
    for s in seq_ids:
        for j, p in enumerate(tables[s]):
            owner.setdefault(p, s)
            for i in range(bs):
                t = j * bs + i
                if t < lens[s]:
                    words = tokens.get(s)
                    slot_word[(p, i)] = words[t] if words is not None and t < len(words) else str(t)

    n_logical = sum(max(1, len(tables[s])) for s in seq_ids) + max(0, len(seq_ids) - 1)
    rows = max(n_logical, nb)
    if ax is None:
        unit = 0.42                                      # inches per cell
        fig, ax = plt.subplots(figsize=(unit * (2 * bs + 12.5), unit * (rows + 2.5)))
    else:
        fig = ax.figure
    x_phys = bs + 6.0
    cell = dict(lw=0.8, ec="black")

    # logical blocks, one sequence under another
    y = 0
    anchors = {}
    for s in seq_ids:
        name = labels.get(s, f"seq {s}")
        ax.text(-0.4, -(y + 0.5), name, ha="right", va="center", fontsize=10, color=colors[s],
                fontweight="bold")
        for j in range(max(1, len(tables[s]))):
            for i in range(bs):
                t = j * bs + i
                filled = j < len(tables[s]) and t < lens[s]
                ax.add_patch(Rectangle((i, -(y + 1)), 1, 1, fc=colors[s] if filled else _FREE_COLOR,
                                       alpha=0.35 if filled else 1.0, **cell))
                if filled:
                    words = tokens.get(s)
                    w = words[t] if words is not None and t < len(words) else str(t)
                    ax.text(i + 0.5, -(y + 0.5), w, ha="center", va="center", fontsize=7)
            if j < len(tables[s]):
                ax.text(bs + 0.2, -(y + 0.5), f"{j} \u2192 {tables[s][j]}", ha="left", va="center",
                        fontsize=8, family="monospace")
                anchors[(s, j)] = -(y + 0.5)
            y += 1
        y += 1

    # the physical pool
    for p in range(nb):
        yp = -(p + 0.5)
        shared = refs[p] > 1
        used = refs[p] > 0
        for i in range(bs):
            fc = (_SHARED_COLOR if shared else colors[owner[p]]) if used and (p, i) in slot_word else _FREE_COLOR
            ax.add_patch(Rectangle((x_phys + i, -(p + 1)), 1, 1, fc=fc, alpha=0.35 if used and not shared else 1.0,
                                   **cell))
            if used and (p, i) in slot_word:
                ax.text(x_phys + i + 0.5, yp, slot_word[(p, i)], ha="center", va="center", fontsize=7)
        ax.text(x_phys - 0.3, yp, str(p), ha="right", va="center", fontsize=8, family="monospace")
        note = f"ref {refs[p]}" if used else ("free, cached" if p in cached else "free")
        if used or show_free:
            ax.text(x_phys + bs + 0.2, yp, note, ha="left", va="center", fontsize=8,
                    color="black" if used else "gray")

    for (s, j), ya in anchors.items():
        p = tables[s][j]
        ax.annotate("", xy=(x_phys - 1.0, -(p + 0.5)), xytext=(bs + 2.2, ya),
                    arrowprops=dict(arrowstyle="->", color=colors[s], lw=1.0, alpha=0.8))

    ax.text(bs / 2, 0.6, "logical blocks", ha="center", fontsize=9)
    ax.text(bs + 1.2, 0.6, "table", ha="center", fontsize=9)
    ax.text(x_phys + bs / 2, 0.6, f"physical blocks ({cache.num_free_blocks()} free)", ha="center", fontsize=9)
    ax.set_xlim(-3.2, x_phys + bs + 3.2)
    ax.set_ylim(-(rows + 0.3), 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def demo_cache():
    """The two-sequence example of :func:`block_table_figure`, built with the real cache.

    Returns (cache, tokens, labels).  The free list is shuffled first (one-block sequences
    freed in a fixed order), so consecutive logical blocks land in scattered physical blocks,
    as they do in a busy server.
    """
    from ..paged import PagedKVCache
    bs, nb = 4, 8
    cache = PagedKVCache(nb, bs, num_kv_heads=1, head_dim=2, dtype=np.float32)
    one = np.ones((bs, 1, 2), np.float32)
    fillers = []
    for _ in range(nb):
        s = cache.new_sequence()
        cache.append(s, one, one)
        fillers.append(s)
    for i in (5, 2, 7, 0, 3, 6, 1, 4):                      # a fixed, scrambled free order
        cache.free(fillers[i])
    words_a = "Four score and seven years ago our".split()
    a = cache.new_sequence()
    row = np.ones((len(words_a), 1, 2), np.float32)
    cache.append(a, row, row)
    b = cache.fork(a)                                        # parallel sampling: share everything
    cache.append(a, row[:1], row[:1])                        # A writes into the shared tail: copy
    cache.append(b, row[:2], row[:2])                        # B now owns the original tail
    tokens = {a: words_a + ["fathers"], b: words_a + ["great", "grand"]}
    return cache, tokens, {a: "A", b: "B"}


def block_table_figure():
    """The article's Figure 3 idea: two sequences' block tables, one shared physical block.

    A and B share their prompt's first block (reference count 2); A's first write into the
    shared, partially filled second block copied it (copy-on-write).
    """
    cache, tokens, labels = demo_cache()
    shared = [int(p) for p in np.flatnonzero(cache.ref_counts() > 1)]
    return draw_cache(cache, tokens=tokens, labels=labels,
                      title=f"A and B share block {shared[0]} (ref 2); A's write into the shared tail copied it")


class PoolExplorer:
    """A cache plus the actions of the explorer widget, usable without widgets.

    Appends draw K/V rows from ``rng``; with ``use_token_ids`` the tokens appended to a
    sequence continue a fixed prompt, so two requests with the same start hit the prefix
    cache.
    """

    PROMPT_VOCAB = 50

    def __init__(self, num_blocks=12, block_size=4, rng=None, use_token_ids=True):
        from ..paged import PagedKVCache
        self.rng = np.random.default_rng(0) if rng is None else rng
        self.cache = PagedKVCache(num_blocks, block_size, num_kv_heads=1, head_dim=2, dtype=np.float32)
        self.use_token_ids = use_token_ids
        self.prompt = [int(x) for x in np.random.default_rng(7).integers(0, self.PROMPT_VOCAB, 4096)]
        self.ids = {}
        self.log = []

    def new(self):
        s = self.cache.new_sequence()
        self.ids[s] = []
        self.log.append(f"new sequence {s}")
        return s

    def append(self, sid, n, diverge=False):
        """Append n tokens; ``diverge`` makes them differ from the shared prompt."""
        start = len(self.ids[sid])
        ids = [(self.prompt[start + i] + (1 if diverge else 0)) % self.PROMPT_VOCAB for i in range(n)]
        kv = self.rng.standard_normal((n, 1, 2)).astype(np.float32)
        try:
            self.cache.append(sid, kv, kv, token_ids=ids if self.use_token_ids else None)
        except ValueError as e:
            self.log.append(f"append failed: {e}")
            return False
        self.ids[sid] += ids
        self.log.append(f"append {n} to {sid}")
        return True

    def fork(self, sid):
        c = self.cache.fork(sid)
        self.ids[c] = list(self.ids[sid])
        self.log.append(f"fork {sid} -> {c}")
        return c

    def free(self, sid):
        self.cache.free(sid)
        del self.ids[sid]
        self.log.append(f"free {sid}")

    def draw(self, ax=None):
        tokens = {s: [str(t) for t in ids] for s, ids in self.ids.items()}
        st = self.cache.stats
        return draw_cache(self.cache, tokens=tokens, ax=ax,
                          title=f"prefix hits {st['prefix_hits']}, copies on write {st['copy_on_write']}")


#: tokens of the request the explorer opens with, so every button does something at once
EXPLORER_FIRST_TOKENS = 5


def pool_explorer(explorer=None):
    """An ipywidgets explorer: new sequence, append, fork, free; pool and tables redrawn.

    It opens with one request of EXPLORER_FIRST_TOKENS tokens, selected, when the explorer
    holds none, so append, fork and free work from the first click.
    """
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    ex = explorer or PoolExplorer()
    if not ex.cache.seq_ids:
        ex.append(ex.new(), EXPLORER_FIRST_TOKENS)
        ex.log.append("a first request is selected: append tokens to it, fork it, or press new")
    out = W.Output()
    seq = W.Dropdown(description="sequence", options=[])
    n = W.IntSlider(description="tokens", value=3, min=1, max=12)
    diverge = W.Checkbox(description="diverge from the prompt", value=False)
    status = W.HTML()
    buttons = {name: W.Button(description=name) for name in ("new", "append", "fork", "free")}

    def redraw(*_):
        seq.options = ex.cache.seq_ids
        status.value = f"<code>{ex.log[-1] if ex.log else ''}</code>"
        with out:
            out.clear_output(wait=True)
            fig = ex.draw()
            display(fig)
            plt.close(fig)

    def act(name):
        def run(_):
            if name == "new":
                seq.value = None
                s = ex.new()
                redraw()
                seq.value = s
                return
            if seq.value is None:
                ex.log.append("pick a sequence first")
            elif name == "append":
                ex.append(seq.value, n.value, diverge.value)
            elif name == "fork":
                ex.fork(seq.value)
            elif name == "free":
                ex.free(seq.value)
            redraw()
        return run

    for name, b in buttons.items():
        b.on_click(act(name))
    redraw()
    seq.value = ex.cache.seq_ids[-1]
    return W.VBox([W.HBox(list(buttons.values())), W.HBox([seq, n, diverge]), status, out])


# --------------------------------------------------------------------------- fragmentation
def request_lengths(rng, count=1000, median=300, sigma=1.0, max_len=4096):
    """A made-up, long-tailed distribution of final request lengths (log-normal, clipped).

    Not measured from any service: a stand-in to show the effect of the shape.
    """
    x = rng.lognormal(np.log(median), sigma, size=count)
    return np.clip(np.round(x), 1, max_len).astype(np.int64)


def fragmentation_figure(lengths, max_len=4096, block_size=16):
    """Memory allocated per request: a max_len reservation vs paging, and the waste of each."""
    import matplotlib.pyplot as plt
    from ..paged import fragmentation

    f = fragmentation(lengths, block_size, max_len)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.hist(lengths, bins=60, color="C0")
    a.axvline(max_len, color="C3", ls="--", label=f"reservation {max_len}")
    a.set_xlabel("final request length (tokens)")
    a.set_ylabel("requests")
    a.legend()
    names = ["tokens used", "reserved", f"paged ({block_size})"]
    vals = [f["used"], f["reserved_slots"], f["paged_slots"]]
    b.bar(names, vals, color=["C2", "C3", "C0"])
    b.set_ylabel("KV slots allocated")
    b.set_title(f"waste: reserved {f['reserved_waste']:.1%}, paged {f['paged_waste']:.2%}", fontsize=10)
    fig.tight_layout()
    return fig


def block_size_figure(lengths, block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)):
    """The block-size trade-off: internal waste grows with the block, table entries shrink."""
    import matplotlib.pyplot as plt
    from ..paged import fragmentation

    lengths = np.asarray(lengths)
    waste = [fragmentation(lengths, bsz, max(int(lengths.max()), 1))["paged_waste"] for bsz in block_sizes]
    entries = [float(np.mean(-(-lengths // bsz))) for bsz in block_sizes]
    fig, a = plt.subplots(figsize=(6.5, 3.4))
    a.plot(block_sizes, np.array(waste) * 100, "o-", color="C3", label="slots wasted (%)")
    exact_log.set_log(a, "x", base=2)
    a.set_xlabel("block size (tokens)")
    a.set_ylabel("slots wasted (%)", color="C3")
    b = a.twinx()
    b.plot(block_sizes, entries, "s-", color="C0", label="table entries per request")
    exact_log.set_log(b, "y")
    b.set_ylabel("table entries per request (mean)", color="C0")
    a.set_title("small blocks waste little but mean more indirection and smaller tiles", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- Flash-Decoding
def split_kv_example(seqlen=64, num_splits=4, head_dim=16, block_n=16, seed=0):
    """The numbers behind :func:`split_kv_figure`: partial states of one query row and their merge.

    Returns a dict with ranges, lse_parts, weights exp(LSE_s - LSE), lse, and the max error of
    the merged O against the float64 oracle.
    """
    import iokernels as ik
    from ..core.reference import decode as ref_decode

    dec = _dec()
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, head_dim))
    k = rng.standard_normal((1, 1, seqlen, head_dim))
    v = rng.standard_normal((1, 1, seqlen, head_dim))
    ranges = dec.split_ranges(seqlen, num_splits, block_n)
    o_parts, lse_parts = [], []
    for a, z in ranges:
        o, lse = ik.decode(q, k[:, :, a:z], v[:, :, a:z], num_splits=1, return_lse=True)
        o_parts.append(o), lse_parts.append(lse)
    o, lse = ik.merge_states(np.stack(o_parts), np.stack(lse_parts))
    ro, rl = ref_decode(q, k, v)
    lse_s = np.array([x[0, 0] for x in lse_parts])
    return dict(ranges=ranges, lse_parts=lse_s, weights=np.exp(lse_s - lse[0, 0]), lse=float(lse[0, 0]),
                o_error=float(np.abs(o - ro).max()), lse_error=float(abs(lse[0, 0] - rl[0, 0])))


def split_kv_figure(seqlen=64, num_splits=4, head_dim=16, block_n=16, seed=0):
    """The article's Figure 4 idea: the keys split across workers, partial (O_s, LSE_s), merge.

    Top: the cache of one sequence cut into ``num_splits`` chunks, each a thread block that
    reads its chunk once.  Bottom: each chunk's merge weight exp(LSE_s - LSE) (they sum to 1),
    and the merged result's error against the float64 oracle.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    ex = split_kv_example(seqlen, num_splits, head_dim, block_n, seed)
    colors = _colors(num_splits)
    fig, (top, bot) = plt.subplots(2, 1, figsize=(9, 5.2), gridspec_kw=dict(height_ratios=[1.5, 1]))
    for s, (a, z) in enumerate(ex["ranges"]):
        top.add_patch(Rectangle((a, 2.2), max(z - a, 0), 0.8, fc=colors[s], alpha=0.5, ec="black"))
        mid = (a + z) / 2 if z > a else a
        top.add_patch(FancyBboxPatch((mid - seqlen / num_splits * 0.4, 0.4), seqlen / num_splits * 0.8, 0.9,
                                     boxstyle="round,pad=0.05", fc=colors[s], alpha=0.25, ec=colors[s]))
        top.text(mid, 0.85, f"thread block {s}\nLSE$_{s}$ = {ex['lse_parts'][s]:.2f}", ha="center", va="center",
                 fontsize=8)
        top.annotate("", xy=(mid, 1.35), xytext=(mid, 2.15), arrowprops=dict(arrowstyle="->"))
    top.text(seqlen / 2, 3.3, f"KV cache of one sequence: {seqlen} keys, {num_splits} splits in tiles of {block_n}",
             ha="center", fontsize=10)
    top.text(seqlen / 2, -0.3, "each writes a partial O$_s$ (normalized) and LSE$_s$ to HBM", ha="center",
             fontsize=9)
    top.set_xlim(-1, seqlen + 1)
    top.set_ylim(-0.6, 3.7)
    top.axis("off")
    bot.bar(range(num_splits), ex["weights"], color=colors)
    bot.set_xticks(range(num_splits), [f"split {s}" for s in range(num_splits)])
    bot.set_ylabel("exp(LSE$_s$ - LSE)")
    bot.set_title(f"merge: O = \u03a3 exp(LSE$_s$ - LSE) O$_s$, LSE = log \u03a3 exp(LSE$_s$) = {ex['lse']:.3f};"
                  f"  max|O - oracle| = {ex['o_error']:.1e}", fontsize=9)
    fig.tight_layout()
    return fig


def occupancy_figure(batch=1, heads=32, num_sms=132, num_splits=1, ax=None):
    """Thread blocks of a decode launch placed on the SMs (first wave), idle SMs left empty."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    blocks = batch * heads * num_splits
    cols = 12
    rows_ = -(-num_sms // cols)
    if ax is None:
        fig, ax = plt.subplots(figsize=(4.2, 0.35 * rows_ + 0.9))
    else:
        fig = ax.figure
    for sm in range(num_sms):
        r, c = divmod(sm, cols)
        busy = sm < blocks
        ax.add_patch(Rectangle((c, -r - 1), 0.9, 0.9, fc="C0" if busy else "#eeeeee", ec="gray", lw=0.5))
    waves = blocks / num_sms
    ax.set_title(f"B={batch} x H={heads} x splits={num_splits}: {blocks} blocks on {num_sms} SMs\n"
                 f"busy in wave 1: {min(blocks, num_sms) / num_sms:.0%}; waves {waves:.2f}", fontsize=9)
    ax.set_xlim(-0.2, cols)
    ax.set_ylim(-rows_ - 0.2, 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def heuristic_figure(heads_kv=8, num_sms=132, block_n=128, seqlens=None, batches=(1, 2, 4, 8, 16, 32)):
    """num_splits chosen by the heuristic vs context length, one curve per batch size; and
    the wave efficiency of every candidate for the first batch at the longest context."""
    import matplotlib.pyplot as plt

    dec = _dec()
    seqlens = seqlens if seqlens is not None else [2 ** p for p in range(7, 18)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for bsz in batches:
        a.plot(seqlens, [dec.occupancy_splits(bsz, heads_kv, n, num_sms, block_n=block_n) for n in seqlens],
               "o-", ms=3, label=f"batch {bsz}")
    exact_log.set_log(a, "x", base=2)
    a.set_xlabel("context length (keys)")
    a.set_ylabel("num_splits chosen")
    a.set_title(f"{heads_kv} KV heads, {num_sms} SMs, tiles of {block_n}", fontsize=10)
    a.legend(fontsize=7)
    s, eff = dec.occupancy_splits(batches[0], heads_kv, seqlens[-1], num_sms, block_n=block_n,
                                      return_efficiency=True)
    xs = np.arange(1, len(eff) + 1)
    b.bar(xs, eff, color=["C3" if x == s else "C0" for x in xs])
    b.axhline(dec.EFFICIENCY_FRACTION * max(eff), color="gray", ls="--", lw=1, label="85% of best")
    b.set_xlabel("candidate num_splits")
    b.set_ylabel("wave efficiency")
    b.set_xlim(0, min(len(eff), 64) + 1)
    b.set_title(f"batch {batches[0]}, {seqlens[-1]} keys: picks {s} (red)", fontsize=10)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def split_cost_figure(batches=(1, 8, 17, 24, 32), seq_len=32768, heads_kv=8, num_sms=132, blocks_per_sm=1,
                      max_splits=24, row_bytes=512, ax=None):
    """The CuPy decode launcher's wave model (iokernels.cupy_raw.split_cost): modelled time of
    S splits over the best S, one curve per batch size, the heuristic's choice circled.
    Defaults: decode v4's 8-warp blocks (one an SM) on a 132-SM GPU, 16-bit rows of d = 128."""
    import matplotlib.pyplot as plt

    cr = importlib.import_module("iokernels.cupy_raw")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
    else:
        fig = ax.figure
    splits = np.arange(1, max_splits + 1)
    for bsz in batches:
        cost = np.array([cr.split_cost(bsz * heads_kv, seq_len, int(s), num_sms, blocks_per_sm, row_bytes)
                         for s in splits])
        pick = cr.decode_wave_splits(bsz, heads_kv, seq_len, num_sms, blocks_per_sm, row_bytes)
        label = f"batch {bsz} ({bsz * heads_kv} pairs): S = {pick}"
        line, = ax.plot(splits, cost / cost.min(), "o-", ms=3, label=label)
        if pick <= max_splits:
            ax.plot([pick], [cost[pick - 1] / cost.min()], "o", ms=10, mfc="none", color=line.get_color())
    ax.set_xlabel("num_splits S")
    ax.set_ylabel("modelled time / best")
    ax.set_ylim(0.95, 2.0)
    ax.set_title(f"{seq_len} keys, {heads_kv} KV heads, {num_sms} SMs x {blocks_per_sm} block(s)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
