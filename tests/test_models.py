"""The decode-for-real-models chapter: KV bytes per token and decode intensity from real
configurations, their roofline placement, and the notebook's report functions."""
import pytest

from iokernels import mla, models
from iokernels.core import roofline


def test_bytes_per_token_reproduce_the_sources():
    assert models.kv_bytes_per_token("Llama-2-7B") == 524288 == 512 * 1024            # 0.5 MiB
    assert models.kv_bytes_per_token("Llama-3-8B") == 128 * 1024
    assert models.kv_bytes_per_token("Llama-3-70B") == 2 * 80 * 8 * 128 * 2
    assert models.kv_values_per_token("DeepSeek-V3") == 512 + 64                       # one latent row
    assert models.kv_bytes_per_token("DeepSeek-V3", itemsize=1) == 61 * 576
    for name in ("Llama-2-7B", "Llama-3-8B"):
        m = models.MODELS[name]
        assert models.kv_bytes_per_token(name) == roofline.kv_bytes_per_token(m.layers, m.heads_kv, m.head_dim)
    with pytest.raises(ValueError, match="model"):
        models.kv_bytes_per_token("GPT-5")


@pytest.mark.parametrize("name", [n for n, m in models.MODELS.items() if m.kind != "MLA"])
@pytest.mark.parametrize("itemsize", [1, 2])
def test_grouped_decode_intensity_is_g_per_two_bytes(name, itemsize):
    m = models.MODELS[name]
    step = models.decode_step(name, context=1000, batch=3, itemsize=itemsize)
    assert step["intensity"] == pytest.approx(roofline.decode_intensity(m.group, itemsize))
    assert step["intensity"] == pytest.approx(2 * m.group / itemsize)


def test_gqa_stays_memory_bound_and_mla_reaches_the_compute_roof():
    rows = {r["model"]: r for r in models.roofline_placement(gpu="H200")}
    assert rows["Llama-3-8B"]["bound"] == rows["Llama-3-70B"]["bound"] == "memory"
    assert rows["Llama-3-70B"]["peak_fraction"] < 0.05
    assert rows["DeepSeek-V3"]["bound"] == "compute" and rows["DeepSeek-V3"]["peak_fraction"] == 1.0
    assert rows["DeepSeek-V3"]["intensity"] == pytest.approx(2 * 128 * (576 + 512) / 1152)
    v3 = mla.DEEPSEEK_V3_MLA                                     # the same count as the MLA module's
    per_layer = mla.mla_flops("absorbed", seq_lens=[1], **v3)["attention"]
    assert models.decode_step("DeepSeek-V3", 1)["flops"] == 61 * per_layer
    on_a100 = {r["model"]: r for r in models.roofline_placement(gpu="A100 80GB SXM")}
    assert on_a100["DeepSeek-V3"]["bound"] == "compute"


def test_a_sliding_window_caps_the_cache():
    full = models.decode_step("Llama-3-8B", 32768)
    windowed = models.decode_step("Mistral-7B", 32768)
    assert windowed["cached_tokens"] == 4096 and full["bytes"] == 8 * windowed["bytes"]
    table = {r["model"]: r for r in models.model_table(context=32768)}
    assert table["Llama-3-8B"]["cache_bytes"] == 32768 * 128 * 1024
    assert table["Llama-3-8B"]["read_s"] == pytest.approx(32768 * 128 * 1024 / 4.8e12)
    assert all(r["source"] for r in table.values())


def test_quant_accuracy_report_keeps_its_bound_and_halves_the_bytes(rng):
    rows = models.kv_quant_accuracy(rng, lengths=(16, 100), heads_q=4, heads_kv=2, head_dim=32)
    by = {(r["N"], r["cache"]): r for r in rows}
    for n in (16, 100):
        assert by[(n, "float32")]["o_error"] < 1e-5
        for q in ("float8_e4m3fn", "int8"):
            r = by[(n, q)]
            assert 1e-4 < r["o_error"] <= r["bound"]
            assert r["bytes_per_token"] == by[(n, "bfloat16")]["bytes_per_token"] / 2 + 2 * 2 * 4 / 16
    pytest.importorskip("matplotlib")
    from iokernels.viz import decode_models as dm
    fig = dm.kv_quant_figure(rows)
    assert len(fig.axes[0].lines) == 6


def test_mla_comparison_and_window_report(rng):
    c = models.mla_comparison(rng, seqlen=40, batch=2, shape=dict(latent_dim=24, rope_dim=8, head_dim=8,
                                                                 v_head_dim=8, heads=4))
    assert max(c["errors"].values()) < 1e-12
    assert all(v["equal"] for v in c["counted"].values())
    assert c["full"]["unabsorbed"]["bytes"] > 100 * c["full"]["absorbed"]["bytes"]
    rows = models.window_traffic(rng, lengths=(64, 300), window=(63, 0), heads_q=2, head_dim=8)
    assert all(r[x]["equal"] and r[x]["error"] < 1e-5 for r in rows for x in ("full", "window"))
    assert rows[1]["window"]["k_bytes"] < rows[1]["full"]["k_bytes"]



def test_mla_crosses_the_h200_ridge_only():
    rows = {r["model"]: r for r in models.ridge_table()}
    mla_row = rows["DeepSeek-V3"]
    assert mla_row["intensity"] == pytest.approx(2 * 128 * (576 + 512) / 1152)          # ~242 FLOP/B
    assert {g: v["bound"] for g, v in mla_row["by_gpu"].items()} == {
        "H100 SXM": "memory", "H200": "compute", "B200": "memory"}
    assert mla_row["by_gpu"]["H100 SXM"]["ridge"] == pytest.approx(989 / 3.35, rel=1e-3)
    for name in ("Llama-3-8B", "Llama-3-70B"):                     # GQA: 25-50x below the H200's ridge
        factor = rows[name]["by_gpu"]["H200"]["ridge"] / rows[name]["intensity"]
        assert 25 <= factor <= 52
        assert all(v["bound"] == "memory" for v in rows[name]["by_gpu"].values())


def test_roofline_points_join_equal_intensities():
    pts = models.roofline_points()
    names = [n for p in pts for n in p["names"]]
    assert sorted(n for n in names if "(" not in n) == sorted(models.MODELS)        # every model once
    four = next(p for p in pts if p["intensity"] == 4 and p["variant"] is None)
    assert four["names"] == ["Llama-3-8B", "Mistral-7B"]
    variants = [p for p in pts if p["variant"] is not None]
    assert [p["intensity"] for p in variants] == [8, pytest.approx(4 * 241.77777, rel=1e-5)]
    assert [p["intensity"] for p in pts] == sorted(p["intensity"] for p in pts)


def test_decode_figures_draw_and_tables_show():
    pytest.importorskip("matplotlib")
    from iokernels.viz import decode_models as dm
    fig = dm.roofline_figure()
    ax = fig.axes[0]
    assert len(ax.get_legend().get_texts()) == len(models.RIDGE_GPUS)             # roofs only
    assert len(ax.texts) == len(models.roofline_points())                          # one label per point
    t = dm.ridge_table()
    assert "compute-bound" in str(t) and "<table" in t._repr_html_() and len(t.rows) == len(models.MODELS)
    label, rows = models.recorded_mla_data()
    if label is not None:
        assert dm.recorded_mla_figure(label, rows).axes
    label, rows = models.recorded_cache_data()
    if label is not None:
        assert dm.recorded_cache_figure(label, rows).axes


def test_recorded_data_says_why_when_there_is_none(tmp_path):
    data, why = models.recorded_mla_data(tmp_path)
    assert data is None and "No benchmark record" in why
    assert models.recorded_cache_data(tmp_path)[0] is None


@pytest.mark.parametrize("module", ["models", "failure_modes", "mla", "context_parallel"])
def test_lesson_modules_import_no_plotting(module):
    """Layering: a lesson imports core and other lessons, never viz, bench or labs."""
    import ast
    import importlib
    mod = importlib.import_module(f"iokernels.{module}")
    paths = [mod.__file__] if not hasattr(mod, "__path__") else [str(p) for p in __import__("pathlib").Path(
        mod.__path__[0]).glob("*.py")]
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                parts = n.replace(".", " ").split()
                assert not any(part in ("viz", "bench", "labs", "matplotlib") for part in parts), f"{path} imports {n}"


def test_chapter_tables_carry_the_numbers(rng):
    pytest.importorskip("matplotlib")
    from iokernels.viz import decode_models as dm
    t = dm.model_table(context=32768)
    llama2 = next(r for r in t.rows if r[0] == "Llama-2-7B")
    assert llama2[6] == "512.0 KiB" and len(t.rows) == len(models.MODELS)
    assert [r[1] for r in dm.source_table().rows] == [m.source for m in models.MODELS.values()]
    c = models.mla_comparison(rng, seqlen=40, batch=2, shape=dict(latent_dim=24, rope_dim=8, head_dim=8,
                                                                 v_head_dim=8, heads=4))
    small, full = dm.mla_comparison_tables(c)
    assert [r[0] for r in small.rows] == list(c["errors"]) and {r[2] for r in small.rows} <= {"yes", "not counted"}
    assert [r[0] for r in full.rows] == list(c["full"])
    rows = models.kv_quant_accuracy(rng, lengths=(16,), heads_q=2, heads_kv=1, head_dim=16)
    q = dm.kv_quant_table(rows)
    assert len(q.rows) == len(rows) and all((r[4] == "") == (x["bound"] is None) for r, x in zip(q.rows, rows))
