"""The SM schedule model of notebook 09: closed-form lockstep, orderings, the exp budget, the widget."""
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
    (1 s); sum, convert and rescale, (2 x 4 + 2 x 4) ops at 8/s (2 s).  Nothing overlaps: 7 s a
    tile, of which the ideal GEMM time is 1 s: utilisation 1/7.  With mma.sync at half rate the
    GEMMs take 1 s each: 8 s a tile, utilisation still 1 s of ideal GEMM time / 8 s = 1/8."""
    s = hs.simulate("lockstep", HAND, HAND_RATES)
    assert s.makespan == pytest.approx(3 * 7.0, rel=1e-12)
    assert s.utilisation == pytest.approx(1 / 7, rel=1e-12)
    assert hs.lockstep_bound(HAND, HAND_RATES) == pytest.approx(1 / 7, rel=1e-12)
    s2 = hs.simulate("fa2", HAND, HAND_RATES)
    assert s2.utilisation == pytest.approx(1 / 8, rel=1e-12)
    assert hs.lockstep_bound(HAND, HAND_RATES, mma_sync=True) == pytest.approx(1 / 8, rel=1e-12)


def test_software_exp_share_runs_beside_the_sfu():
    """Half of the 4 exps in software: the SFU's 2 take 0.5 s, the polynomial's 2 x 8 ops at 8/s
    take 2 s, side by side: the exp phase costs 2 s instead of 1 s, so a tile costs 8 s."""
    p = hs.Problem(head_dim=4, block_q=2, block_k=2, n_tiles=3, sw_exp_fraction=0.5)
    assert hs.simulate("lockstep", p, HAND_RATES).utilisation == pytest.approx(1 / 8, rel=1e-12)
    assert hs.lockstep_bound(p, HAND_RATES) == pytest.approx(1 / 8, rel=1e-12)


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
    assert hs.simulate("fa2", p, r).utilisation == pytest.approx(hs.lockstep_bound(p, r, True), rel=1e-9)
    assert hs.simulate("lockstep", p, r).utilisation == pytest.approx(hs.lockstep_bound(p, r), rel=1e-9)


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
    assert u["fa2"] < u["lockstep"] < u["warp_specialized"] < u["intra_wg"] <= u["fa3"] + 1e-12
    assert u["warp_specialized"] < u["pingpong"] <= u["fa3"] + 1e-12
    assert u["fa3"] <= 1


def test_model_ordering_agrees_with_the_paper():
    rows = hs.ablation_comparison()
    fa2, *middle, fa3 = rows
    assert fa2["paper_tflops"] < min(m["paper_tflops"] for m in middle) < fa3["paper_tflops"]
    assert fa2["model_utilisation"] < min(m["model_utilisation"] for m in middle) < fa3["model_utilisation"]
    assert fa2["paper_fraction"] == pytest.approx(350 / 989.4)


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
    assert "FlashAttention-3 (both)" in hopper.ablation_table()


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
