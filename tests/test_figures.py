"""The figures in git are what ``python -m iokernels figures`` writes.

Each figure is regenerated into a temporary folder (fixed seeds, matplotlib's default
style, no metadata) and compared with the committed copy: same pixel size and an RMS
difference of at most FIGURE_RMS_TOL grey levels, a tolerance that absorbs font
rasterisation differences between FreeType builds but not a moved line or a changed label.
"""
from pathlib import Path

import numpy as np
import pytest

from iokernels.viz import figures

ROOT = Path(__file__).resolve().parents[1]
#: RMS difference allowed, in grey levels of 0..255 (a changed character of a label is ~2)
FIGURE_RMS_TOL = 1.0
ADVICE = "regenerate them with `bash dev.sh figures` and commit figures/"


def _pixels(path):
    from matplotlib import image
    return np.asarray(image.imread(path), dtype=np.float64)[..., :3] * 255


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    return {p.name: p for p in figures.write_all(out, progress=False)}


def test_every_generated_figure_is_committed(regenerated):
    committed = {p.name for p in (ROOT / "figures").glob("*.png")}
    assert committed == set(regenerated), f"figures/ holds {sorted(committed)}; {ADVICE}"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "figures").glob("*.png")))
def test_committed_figure_equals_generated(regenerated, name):
    new, old = _pixels(regenerated[name]), _pixels(ROOT / "figures" / name)
    assert new.shape == old.shape, f"figures/{name} is {old.shape[:2]}, the command draws {new.shape[:2]}; {ADVICE}"
    rms = float(np.sqrt(np.mean((new - old) ** 2)))
    assert rms <= FIGURE_RMS_TOL, f"figures/{name} differs from what the command draws (RMS {rms:.2f}); {ADVICE}"


@pytest.mark.parametrize("kind", ["naive", "fa1", "fa2"])
def test_decompose_sums_to_total_and_names_the_parts(rng, kind):
    import iokernels as ik
    from iokernels import traffic
    nq, nk, d = int(rng.integers(70, 200)), int(rng.integers(70, 200)), 48
    cfg = None if kind == "naive" else ik.TileConfig(block_q=32, block_k=48, loop_order=kind)
    q, k, v = ik.testing.make_inputs(rng, batch=2, heads_q=3, seqlen_q=nq, seqlen_k=nk, head_dim=d,
                                     dtype="float32")
    with traffic.count() as t:
        ik.attention(q, k, v, backend="naive" if kind == "naive" else "tiled", config=cfg)
    parts = traffic.decompose(t, heads=6, seqlen_q=nq, seqlen_k=nk, head_dim=d, itemsize=4)
    assert sum(parts.values()) == t.total
    assert parts["mandatory"] == 6 * (2 * nq + 2 * nk) * d * 4
    assert parts["LSE"] == 6 * nq * 4
    if kind == "naive":
        assert parts["S and P"] == 6 * 4 * nq * nk * 4 and parts["tile re-reads"] == 0
    elif kind == "fa2":                                  # K, V read Tr times: Tr - 1 extra each
        assert parts["tile re-reads"] == 6 * 2 * (-(-nq // 32) - 1) * nk * d * 4
        assert parts["S and P"] == 0


def test_traffic_parts_follow_the_tile_law():
    """FA2's re-reads are 2 N^2 d / Br - 2 N d elements; FA1's fall as Bc (so M) grows."""
    p = figures.traffic_parts(seqlens=(1024, 4096), head_dim=64, dtype="float16", sram_kib=(16, 64, 228))
    for m, entry in p["fa2"].items():
        br = entry["config"].block_q
        assert entry["tile re-reads"] == [2 * (n // br - 1) * n * 64 * 2 for n in p["N"]]
    fa1 = [p["fa1"][m]["tile re-reads"][1] for m in (16, 64, 228)]
    assert fa1[0] > fa1[1] > fa1[2]
    assert p["S and P"] == [4 * n * n * 2 for n in p["N"]]


# --------------------------------------------------------------------------- one colour per runner
def _rec():
    from iokernels import recorded
    return recorded.load("h200")


def _runner_artists(fig):
    """(label, colour) of every line and bar in ``fig`` that names a runner (its label or gid)."""
    from matplotlib.colors import to_hex
    out = []
    for ax in fig.axes:
        for line in ax.get_lines():
            name = line.get_gid() or line.get_label()
            if name and not name.startswith("_"):
                out.append((name, to_hex(line.get_color()), line.get_gid() is not None))
        for container in ax.containers:
            name = container.get_label()
            if name and not name.startswith("_"):
                out += [(name, to_hex(p.get_facecolor()), False) for p in container.patches]
    return out


def _runner_figures():
    import matplotlib.pyplot as plt

    from iokernels import models
    from iokernels.viz import decode_models as dm
    from iokernels.viz import sdpa
    rec = _rec()
    figs = {"prefill bf16": sdpa.plot_prefill(rec, "bfloat16")[0].figure,
            "prefill fp32": sdpa.plot_prefill(rec, "float32")[0].figure,
            "decode summary": figures.recorded_decode_summary(rec, dtype="float16"),
            "traffic": sdpa.plot_traffic(rec)}
    label, runs = models.recorded_mla_data()
    if label is not None:
        figs["mla"] = dm.recorded_mla_figure(label, runs)
    label, runs = models.recorded_cache_data()
    if label is not None:
        figs["caches"] = dm.recorded_cache_figure(label, runs)
    yield figs
    for f in figs.values():
        plt.close(f)


@pytest.fixture(scope="module")
def runner_figures():
    yield from _runner_figures()


def test_every_runner_has_its_palette_colour_in_every_figure(runner_figures):
    from iokernels.viz.palette import colour, traffic_colour
    seen = {}
    for name, fig in runner_figures.items():
        artists = _runner_artists(fig)
        assert artists, f"{name}: no runner drawn"
        for runner, c, is_traffic_case in artists:
            want = traffic_colour(runner) if is_traffic_case else colour(runner)
            assert c == want, f"{name}: {runner} drawn in {c}, the palette says {want}"
            seen.setdefault(runner, set()).add(c)
    assert all(len(cs) == 1 for cs in seen.values()), seen
    # the runners the issue of colours was about: one colour, in both prefill plots
    assert seen["sdpa:math"] == {colour("sdpa:math")} and colour("sdpa:math") != colour("sdpa:flash")


def test_palette_colours_are_distinct_and_variants_share_them():
    from iokernels.viz.palette import RUNNER_COLOURS, colour, traffic_colour
    named = {k: v for k, v in RUNNER_COLOURS.items() if ":" in k or k == "torch naive"}
    named.pop("torch:sdpa")                   # the MLA record's torch formulation: the default dispatch's grey
    assert len(set(named.values())) == len(named), "two runners share a colour"
    assert colour("cupy:v4 paged") == colour("cupy v4 paged bfloat16") == colour("cupy:v4")
    assert colour("sdpa:flash fwd+bwd") == colour("sdpa:flash") == traffic_colour("sdpa flash")
    assert traffic_colour("cupy backward v2") == colour("cupy:v2") and colour("numba:v9") == colour("numba")


def _legend_boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if not hasattr(fig.canvas, "get_renderer"):           # a Figure made without pyplot
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = [lg for ax in fig.axes for lg in ([ax.get_legend()] if ax.get_legend() else [])] + list(fig.legends)
    return [lg.get_window_extent(r) for lg in legends]


def _data_points(fig):
    """Display coordinates of every line vertex and every bar's top corners."""
    import numpy as np
    pts = []
    for ax in fig.axes:
        for line in ax.get_lines():
            xy = np.column_stack(line.get_data())
            if len(xy) and line.get_label() != "_nolegend_" and not (line.get_linestyle() == ":" and len(xy) == 2):
                pts.append(ax.transData.transform(xy.astype(float)))
        for container in ax.containers:
            for p in container.patches:
                x0, y0, w, h = p.get_x(), p.get_y(), p.get_width(), p.get_height()
                pts.append(ax.transData.transform([(x0, y0 + h), (x0 + w, y0 + h)]))
    return np.concatenate(pts) if pts else np.zeros((0, 2))


def _covered(fig) -> int:
    """How many data points lie under a legend of ``fig``."""
    boxes = _legend_boxes(fig)                   # draws the figure first: the axes limits are final
    pts, n = _data_points(fig), 0
    for box in boxes:
        n += int(((pts[:, 0] > box.x0) & (pts[:, 0] < box.x1) & (pts[:, 1] > box.y0) & (pts[:, 1] < box.y1)).sum())
    return n


def test_legends_sit_off_the_data(runner_figures):
    for name, fig in runner_figures.items():
        assert _covered(fig) == 0, f"{name}: the legend covers {_covered(fig)} data points"


def test_the_legend_check_sees_a_legend_on_the_data():
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(4, 3))
    x = np.linspace(0, 1, 200)
    for k in range(4):
        ax.plot(x, np.full_like(x, k), label=f"line {k}")
    ax.legend(loc="center")
    assert _covered(fig) > 0
    plt.close(fig)


def test_decode_roofline_models_have_their_own_colours_and_labels_do_not_collide():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from iokernels.viz import decode_models as dm
    styles = list(dm.MODEL_STYLE.values())
    assert len({c for c, _ in styles}) == len(styles) and len({m for _, m in styles}) == len(styles)
    assert not {c for c, _ in styles} & {c for c, _ in dm.GPU_STYLE.values()}     # a point is never a roof's colour
    fig = dm.roofline_figure()
    FigureCanvasAgg(fig).draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [t.get_window_extent(r) for t in ax.texts]
    assert len(boxes) >= 6
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), "two labels of the decode roofline overlap"
    assert _covered(fig) == 0


def test_chapter_figures_keep_their_legends_off_the_data(rng):
    """Notebooks 09a, 10, 11 and 13's other figures with a legend: none covers a data point."""
    import matplotlib.pyplot as plt

    from iokernels import models
    from iokernels.viz import decode_models as dm
    from iokernels.viz import failure_modes as vf
    from iokernels.viz import figures
    from iokernels.viz import hopper as vh
    from iokernels.viz import sdpa
    n = [256, 1024, 4096, 16384]
    drift = {"N": n, "float32": [3e-7, 3e-7, 5e-7, 1e-6], "bfloat16": [6e-3, 1.5e-2, 3.4e-2, 7.7e-2],
             "float16": [8e-4, 2e-3, 4.6e-3, 9.5e-3]}
    rows = models.kv_quant_accuracy(rng, lengths=(16, 64), heads_q=4, heads_kv=2, head_dim=32)
    made = {"drift": vf.drift_figure(drift), "kv caches": dm.kv_quant_figure(rows),
            "sensitivity": vh.sensitivity_figure(), "schedules": vh.schedule_figure(),
            "traffic parts": sdpa.measured_parts_figure(_rec()),
            "traffic vs N": figures.traffic_vs_n(rec=_rec())}
    for name, fig in made.items():
        fig = fig if hasattr(fig, "axes") else fig.figure
        assert _covered(fig) == 0, f"{name}: the legend covers {_covered(fig)} data points"
        plt.close(fig)
