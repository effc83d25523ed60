"""The SM schedule model of notebook 09a: closed-form lockstep, orderings, the exp budget, the widget."""
import dataclasses
import re

import pytest

from iokernels import hopper_schedule as hs
from iokernels.core import roofline as rl

#: a hand-workable SM: every op of a (Br = Bc = 2, d = 4) tile lasts a round number of seconds
HAND_RATES = hs.SMRates(name="hand", tensor_flops=64.0, sfu_ops=4.0, cuda_ops=8.0, copy_bytes=16.0,
                        mma_sync_fraction=0.5)
HAND = hs.Problem(head_dim=4, block_q=2, block_k=2, n_tiles=3, itemsize=2)


def test_lockstep_matches_the_hand_worked_bound():
    """Per tile: load K and V, 16 B each at 16 B/s (1 s + 1 s); GEMM0 and GEMM1, 2*2*2*4 = 32 FLOP
    each at 64 FLOP/s (0.5 s each); max and scale, 2 ops x 4 scores at 8/s (1 s); 4 exps at 4/s
    (1 s); sum, convert and rescale, (2 x 4 + 2 x 4) ops at 8/s (2 s).  Serialized, nothing
    overlaps: 7 s a tile, of which the ideal GEMM time is 1 s: utilisation 1/7.  With mma.sync at
    half rate the GEMMs take 1 s each: 8 s a tile, utilisation still 1 s of ideal GEMM time / 8 s."""
    s2 = hs.simulate("fa2_serial", HAND, HAND_RATES)
    assert s2.makespan == pytest.approx(3 * 8.0, rel=1e-12)
    assert s2.utilisation == pytest.approx(1 / 8, rel=1e-12)
    assert hs.lockstep_bound(HAND, HAND_RATES, mma_sync=True) == pytest.approx(1 / 8, rel=1e-12)
    full = dataclasses.replace(HAND_RATES, mma_sync_fraction=1.0)
    s = hs.simulate("fa2_serial", HAND, full)
    assert s.makespan == pytest.approx(3 * 7.0, rel=1e-12)
    assert s.utilisation == pytest.approx(1 / 7, rel=1e-12)
    assert hs.lockstep_bound(HAND, full) == pytest.approx(1 / 7, rel=1e-12)


def test_fa2_prefetch_hides_the_loads_by_hand():
    """Copies at 64 B/s: 0.25 s each, shorter than the 1 s mma.sync GEMM0 that V_j hides under and
    the 5 s of softmax + GEMM1 that K_{j+1} hides under.  Only K_0 is exposed: 0.25 s + 3 tiles x
    (1 + 1 + 1 + 2 + 1) s of compute = 18.25 s, for 3 s of ideal GEMM time."""
    fast = dataclasses.replace(HAND_RATES, copy_bytes=64.0)
    s = hs.simulate("fa2", HAND, fast)
    assert s.makespan == pytest.approx(18.25, rel=1e-12)
    assert s.utilisation == pytest.approx(3 / 18.25, rel=1e-12)
    assert hs.lockstep_bound(HAND, fast, mma_sync=True, prefetch=True) == pytest.approx(3 / 18.25, rel=1e-12)
    serial = hs.simulate("fa2_serial", HAND, fast)                   # 0.5 s of copies a tile more
    assert serial.makespan == pytest.approx(3 * 6.5, rel=1e-12)
    loads = [op for op in s.ops if op.unit == "copy"]
    assert [op.name for op in loads] == ["load K0", "load V0", "load K1", "load V1", "load K2", "load V2"]


def test_fa2_with_its_prefetch_lands_near_43_percent_on_an_h100():
    """The serialized counterfactual is the paper's 35% by coincidence; FA2's real load order gives more."""
    u_serial = hs.simulate("fa2_serial").utilisation
    u = hs.simulate("fa2").utilisation
    assert 0.33 < u_serial < 0.37 and 0.42 < u < 0.44
    r = hs.SMRates.from_gpu("H100 SXM")
    assert u == pytest.approx(hs.lockstep_bound(hs.Problem(), r, mma_sync=True, prefetch=True), rel=1e-9)


def test_software_exp_share_runs_beside_the_sfu():
    """Half of the 4 exps in software: the SFU's 2 take 0.5 s, the polynomial's 2 x 8 ops at 8/s
    take 2 s, side by side: the exp phase costs 2 s instead of 1 s, so a tile costs 8 s."""
    p = hs.Problem(head_dim=4, block_q=2, block_k=2, n_tiles=3, sw_exp_fraction=0.5)
    full = dataclasses.replace(HAND_RATES, mma_sync_fraction=1.0)
    assert hs.simulate("fa2_serial", p, full).utilisation == pytest.approx(1 / 8, rel=1e-12)
    assert hs.lockstep_bound(p, full) == pytest.approx(1 / 8, rel=1e-12)


def test_software_exp_helps_where_the_sfu_is_the_bottleneck():
    r = hs.SMRates.from_gpu("B200")           # d = 128: exps take as long as the matmuls
    u = [hs.simulate("fa3", hs.Problem(sw_exp_fraction=f), r).utilisation for f in (0.0, 0.25)]
    assert u[1] > u[0]


@pytest.mark.parametrize("gpu", ["H100 SXM", "H200", "A100 80GB SXM", "B200"])
def test_lockstep_bound_holds_on_real_rates(rng, gpu):
    p = hs.Problem(head_dim=int(rng.choice([64, 96, 128, 256])), block_q=int(rng.integers(1, 5)) * 32,
                   block_k=int(rng.integers(1, 5)) * 32, n_tiles=int(rng.integers(2, 9)),
                   sw_exp_fraction=float(rng.choice([0.0, 0.3, 0.9])))
    r = hs.SMRates.from_gpu(gpu)
    assert hs.simulate("fa2_serial", p, r).utilisation == pytest.approx(hs.lockstep_bound(p, r, True), rel=1e-9)
    for kind, mma_sync in (("fa2", True), ("lockstep", False)):
        u = hs.simulate(kind, p, r).utilisation
        bound = hs.lockstep_bound(p, r, mma_sync, prefetch=True)
        f = r.mma_sync_fraction if mma_sync else 1.0
        t_load = p.block_k * p.head_dim * p.itemsize / r.copy_bytes
        t_gemm = 2 * p.block_q * p.block_k * p.head_dim / (r.tensor_flops * f)
        if t_load <= t_gemm:                                  # every copy hides: the closed form is exact
            assert u == pytest.approx(bound, rel=1e-9), kind
        else:                                                 # copies show: the closed form bounds it
            assert u <= bound * (1 + 1e-12), kind


def _check_schedule(s):
    by_unit = {}
    for op in s.ops:
        assert op.start is not None and op.end == pytest.approx(op.start + op.seconds)
        for dep in op.deps:
            assert op.start >= dep.end - 1e-18, (op.name, dep.name)
        by_unit.setdefault(op.unit, []).append(op)
    for ops in by_unit.values():                       # a unit runs one op at a time
        ops.sort(key=lambda o: o.start)
        for a, b in zip(ops, ops[1:]):
            assert b.start >= a.end - 1e-18, (a.name, b.name)
    agents = {}
    for op in s.ops:                                   # each agent issues in program order
        agents.setdefault(op.agent, []).append(op)
    for ops in agents.values():
        for a, b in zip(ops, ops[1:]):
            assert b.start >= (a.end if a.sync else a.start) - 1e-18


@pytest.mark.parametrize("kind", list(hs.SCHEDULES))
def test_every_schedule_respects_units_deps_and_program_order(rng, kind):
    p = hs.Problem(head_dim=int(rng.choice([64, 128, 256])), block_q=128, block_k=int(rng.choice([64, 128])),
                   n_tiles=int(rng.integers(3, 8)), stages=int(rng.integers(1, 4)),
                   sw_exp_fraction=float(rng.choice([0.0, 0.5])))
    s = hs.simulate(kind, p, hs.SMRates.from_gpu("H100 SXM"))
    _check_schedule(s)
    assert 0 < s.utilisation <= 1 + 1e-12
    assert s.busy["tensor"] >= s.utilisation - 1e-12   # busy includes mma.sync's slower GEMMs


@pytest.mark.parametrize("d", [64, 128, 256])
def test_each_idea_helps_on_hopper(d):
    u = {k: s.utilisation for k, s in hs.run_all(hs.Problem(head_dim=d)).items()}
    assert u["fa2_serial"] < u["fa2"] < u["lockstep"] <= u["warp_specialized"] + 1e-12
    assert u["warp_specialized"] < u["intra_wg"] <= u["fa3"] + 1e-12
    assert u["warp_specialized"] < u["pingpong"] <= u["fa3"] + 1e-12
    assert u["fa3"] <= 1


def test_schedules_have_readable_unique_names():
    labels = [hs.label(k) for k in hs.SCHEDULES]
    assert len(set(labels)) == len(labels)
    assert hs.label("fa3") == "FA3: ping-pong + intra-warpgroup overlap"
    assert hs.label("warp_specialized") == "FA3: warp-specialized" and hs.label("pingpong") == "FA3: ping-pong"
    assert all(k not in lab for k, lab in zip(hs.SCHEDULES, labels) if "_" in k)    # no code names in labels
    with pytest.raises(ValueError, match="schedule"):
        hs.label("fa5")


def test_table2_has_its_three_rows_and_the_model_misorders_two_of_them_at_the_default():
    rows = hs.ablation_comparison()
    assert [r["paper_tflops"] for r in rows] == [661.0, 582.0, 570.0]
    assert "batch 4" in hs.PAPER_TABLE2_SETTING and "8448" in hs.PAPER_TABLE2_SETTING
    fa3, ws, pipe = rows
    assert fa3["model_utilisation"] > max(ws["model_utilisation"], pipe["model_utilisation"])
    # the paper: warp specialization alone (582) beats the pipelining alone (570); the model at
    # its default L2 reuse says the reverse (the notebook states it), and agrees at a reuse of 1
    assert ws["model_utilisation"] < pipe["model_utilisation"]
    low = {r["schedule"]: r["model_utilisation"] for r in hs.ablation_comparison(l2_reuse=1)}
    assert low["warp_specialized"] > low["intra_wg_no_ws"]


def test_blog_steps_beside_the_model():
    rows = hs.blog_comparison()
    assert [r["schedule"] for r in rows] == ["fa2", "warp_specialized", "pingpong", "fa3"]
    assert rows[0]["blog_low"] == 350.0 and rows[0]["model_gain"] is None
    pp, intra = rows[2], rows[3]
    assert pp["blog_gain"][1] < 1.2 and pp["model_gain"] > 1.5      # ping-pong: small in the blog, huge here
    assert intra["model_gain"] == pytest.approx(1.0, abs=0.01) and intra["blog_gain"][1] > 1.0


def test_sensitivity_table_shape_and_monotonic_in_l2_reuse():
    rows = hs.sensitivity()
    assert [r["l2_reuse"] for r in rows] == list(hs.SENSITIVITY_REUSE)
    kinds = [k for k in rows[0] if k in hs.SCHEDULES]
    assert kinds == list(hs.SENSITIVITY_KINDS)
    for k in kinds:                                  # faster copies never slow a schedule down
        us = [r[k] for r in rows]
        assert all(a <= b + 1e-12 for a, b in zip(us, us[1:])), k
        assert all(0 < x <= 1 for x in us)
    gap = [r["fa2"] - r["fa2_serial"] for r in rows]  # the prefetch matters less as copies speed up
    assert all(a >= b - 1e-12 for a, b in zip(gap, gap[1:])) and gap[0] > 0
    holds = [r["table2_order_holds"] for r in rows]
    assert holds[0] and not holds[hs.SENSITIVITY_REUSE.index(hs.L2_REUSE)]
    one = hs.sensitivity(l2_reuses=(2.5,), kinds=("fa3",))
    assert list(one[0]) == ["l2_reuse", "fa3", "table2_order_holds"]
    for bad in ((), (0,), (True,), ("4",)):
        with pytest.raises(ValueError, match="l2_reuses"):
            hs.sensitivity(l2_reuses=bad)
    with pytest.raises(ValueError, match="schedule"):
        hs.sensitivity(kinds=("fa5",))


def test_exp_budget_and_sfu_share():
    assert [hs.exp_budget(d) for d in (64, 128, 256)] == [256, 512, 1024]
    rows = {(r["gpu"], r["head_dim"]): r for r in hs.sfu_share_table()}
    # the FlashAttention-3 paper: 3.9 T exponentials/s on an H100 SXM; exp about half of matmul at d = 128
    assert rows[("H100 SXM", 128)]["exp_tops"] == pytest.approx(3.9, rel=0.02)
    for d in (64, 128, 256):
        assert rows[("H100 SXM", d)]["exp_fraction_of_matmul"] == pytest.approx(64 / d)
        assert rows[("H200", d)]["exp_fraction_of_matmul"] == rows[("H100 SXM", d)]["exp_fraction_of_matmul"]
        # Blackwell doubles the tensor cores, not the SFU: twice the share
        assert rows[("B200", d)]["exp_fraction_of_matmul"] == pytest.approx(128 / d)


def test_rates_come_from_the_roofline_table():
    g = rl.get_gpu("H200")
    r = hs.SMRates.from_gpu("H200", l2_reuse=3)
    assert r.tensor_flops == pytest.approx(g["fp16_tflops"] * 1e12 / g["sms"])
    assert r.copy_bytes == pytest.approx(3 * g["hbm_tbps"] * 1e12 / g["sms"])
    assert r.cuda_ops == pytest.approx(g["fp32_tflops"] * 1e12 / 2 / g["sms"])


def test_bad_inputs_raise_naming_them():
    with pytest.raises(ValueError, match="gpu"):
        hs.SMRates.from_gpu("T4")                     # Turing: no per-clock figure in the model
    with pytest.raises(ValueError, match="l2_reuse"):
        hs.SMRates.from_gpu("H100 SXM", l2_reuse=0)
    with pytest.raises(ValueError, match="block_k"):
        hs.Problem(block_k=0)
    with pytest.raises(ValueError, match="sw_exp_fraction"):
        hs.Problem(sw_exp_fraction=1.5)
    with pytest.raises(ValueError, match="schedule"):
        hs.simulate("fa5")


def _text(h):
    return re.sub(r"<[^>]+>", " ", h)


def test_report_and_figure():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from iokernels.viz import hopper
    t = _text(hopper.schedule_report(128, 128, 128, "H100 SXM"))
    u = hs.simulate("fa2").utilisation
    assert f"{u:.1%}" in t and "does not fit" not in t
    assert "does not fit" in _text(hopper.schedule_report(256, 256, 256, "H100 SXM"))
    fig = hopper.schedule_figure(hs.Problem(n_tiles=3))
    assert len(fig.axes) == len(hopper.DRAWN)
    assert all(ax.get_title().startswith(hs.label(k) + ":") for ax, k in zip(fig.axes, hopper.DRAWN))
    t = hopper.ablation_table()
    assert t.column("TFLOP/s") == ["661", "582", "570"] and "batch 4" in t.caption
    assert "<table" in t._repr_html_() and hs.label("fa3") in t.column("model schedule")
    assert hopper.blog_table().column("TFLOP/s") == ["350", "540-570", "620-640", "640-660"]
    sens = hopper.sensitivity_table()
    assert len(sens.rows) == len(hs.SENSITIVITY_REUSE) and "4 (default)" in sens.column("L2 reuse")
    guide = hopper.reading_guide_figure()
    texts = {t.get_text() for t in guide.axes[0].texts}
    assert {"S0", "load K1", "idle: softmax"} <= texts
    assert len(hopper.sensitivity_figure().axes[0].lines) == len(hs.SENSITIVITY_KINDS) + 1   # + the default


def test_schedule_explorer_reacts():
    pytest.importorskip("ipywidgets")
    from iokernels.viz import hopper
    box = hopper.schedule_explorer()
    numbers = next(c for c in box.children if c.__class__.__name__ == "HTML")
    d, gpu = box.children[0].children
    before = numbers.value
    d.value = 64
    assert numbers.value != before and "d = 64" in _text(numbers.value)
    gpu.value = "B200"
    share = hs.SMRates.from_gpu("B200")
    assert f"{share.tensor_flops / (256 * share.sfu_ops):.2f} x matmul" in _text(numbers.value)
    sw = box.children[1].children[2]
    before = numbers.value
    sw.value = 0.5
    expect = hs.simulate("fa3", hs.Problem(head_dim=64, sw_exp_fraction=0.5), share).utilisation
    assert numbers.value != before and f"{expect:.1%}" in _text(numbers.value)


def _record(tmp_path, runners):
    import json
    results = [{"runner": r, "group": r.split(":")[0], "status": "ok", "ms": 1.0 + i, "rate": 100.0 / (1 + i),
                "unit": "TFLOP/s"} for i, r in enumerate(runners)]
    case = {"section": "prefill", "kind": "prefill", "dtype": "bfloat16", "causal": False,
            "shape": {"batch": 2, "heads": 4, "seqlen": 4096, "head_dim": 128}, "results": results}
    (tmp_path / "h200_2030-01-01.json").write_text(json.dumps({"env": {"gpu": "TEST GPU"}, "bench": {"cases": [case]}}))
    return tmp_path


def test_hopper_kernel_record_shows_rows_only_when_recorded(tmp_path):
    from iokernels.viz import hopper
    assert "appear here once" in hopper.hopper_kernel_record(tmp_path)              # no record at all
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert "appear here once" in hopper.hopper_kernel_record(_record(tmp_path / "a", ["sdpa:flash", "cupy:v2"]))
    text = hopper.hopper_kernel_record(_record(tmp_path / "b", ["sdpa:flash", "cupy:v3"]))
    assert "TEST GPU" in text and "cupy:v3" in text and "cupy:v2" not in text
