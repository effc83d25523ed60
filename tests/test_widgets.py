"""The notebooks' widgets and figure helpers compute from the package, and say so correctly."""
import re

import numpy as np
import pytest

import iokernels as ik
from iokernels import roofline as rl
from iokernels.viz import figures, widgets


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", html)


def test_roofline_table_reproduces_the_article():
    t = _text(widgets.roofline_table())      # N=4096, d=128, fp16, H100 SXM
    for figure in ("8.59 GFLOP", "4.19 MB", "138.41 MB", "62.1 FLOP/B", "295.3 FLOP/B", "41.3 us", "8.7 us"):
        assert figure in t, (figure, t)


@pytest.mark.parametrize("n,d,dtype,gpu", [(1000, 96, "float32", "A100 80GB SXM"), (8192, 64, "bfloat16", "T4")])
def test_roofline_points_follow_the_formulas(n, d, dtype, gpu):
    pts = figures.roofline_points(n, d, dtype, gpu)
    item = 4 if dtype == "float32" else 2
    assert pts["flops"] == 4 * n * n * d
    assert pts["ideal"]["bytes"] == 4 * n * d * item
    assert pts["naive"]["bytes"] == 4 * n * d * item + 4 * n * n * item
    assert pts["ridge"] == pytest.approx(rl.ridge_point(gpu, dtype))
    cfg = pts["config"]
    cfg.check_fits(d, dtype)
    assert pts["ideal"]["bytes"] < pts["fa2"]["bytes"] < pts["naive"]["bytes"]
    for key in ("ideal", "fa2", "naive"):
        p = pts[key]
        assert p["bound"] == ("memory" if p["intensity"] < pts["ridge"] else "compute")


def test_online_softmax_table_steps_and_finishes():
    one = _text(widgets.online_softmax_table([2, 1, 3, 0], 2, upto=1))
    assert "1.3679" in one and "1.5530" not in one and "row is done" not in one
    both = _text(widgets.online_softmax_table([2, 1, 3, 0], 2))
    assert "0.5032" in both and "1.0498" in both and "1.5530" in both and "row is done" in both


def test_tile_report_reports_misfit_and_traffic():
    bad = _text(widgets.tile_report(seqlen=512, head_dim=64, block_q=256, block_k=256, sram_kib=32))
    assert "does not fit" in bad and "config" in bad
    good = _text(widgets.tile_report(seqlen=512, head_dim=64, block_q=64, block_k=64, sram_kib=228))
    naive = ik.traffic.model("naive", batch=1, heads_q=1, heads_kv=1, seqlen_q=512, seqlen_k=512, head_dim=64,
                             dtype="float16").total
    assert f"{naive / 1e6:,.2f} MB" in good and "does not fit" not in good


def test_counted_traffic_equals_model_curves():
    counted = figures.counted_traffic(seqlens=(64, 96), head_dim=16, dtype="float32")
    model = figures.traffic_curves(seqlens=(64, 96), head_dim=16, dtype="float32")
    for kind in ("naive", "fa1", "fa2"):
        assert counted[kind] == model[kind]
    assert np.all(np.diff(model["naive"]) > 0)


def test_widgets_build_and_react():
    pytest.importorskip("ipywidgets")
    calc = widgets.roofline_calculator()
    html = next(c for c in calc.children if c.__class__.__name__ == "HTML")
    before = html.value
    slider = calc.children[0].children[0]
    slider.value = 2048
    assert html.value != before and "2.15 GFLOP" in _text(html.value)   # 4 * 2048^2 * 128
    stepper = widgets.online_softmax_stepper()
    out = stepper.children[-1]
    stepper.children[0].value = "1, 5, 2, 7, 0"
    assert "5" in _text(out.value)
    stepper.children[0].value = "not, numbers"
    assert "type numbers" in out.value
