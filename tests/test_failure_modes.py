"""The experiments of notebook 11 (iokernels.failure_modes) give the results they claim."""
import numpy as np
import pytest

import iokernels as ik
from iokernels import failure_modes as fm
from iokernels import reference, testing


def test_float32_accumulator_matches_the_tiled_kernel(rng):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, seqlen_q=37, seqlen_k=203, head_dim=24,
                                  dtype="float32")
    o = fm.attention_accumulating_in(q, k, v, "float32", block_k=32)
    ref, _ = reference.attention(q, k, v)
    assert testing.check(o, ref, ik.attention(q, k, v, backend="naive"))
    o16 = fm.attention_accumulating_in(q, k, v, "float16", block_k=32)
    assert np.max(np.abs(o16 - ref)) > 10 * np.max(np.abs(o - ref))       # the rounding is real


def test_low_precision_drift_grows_with_n(rng):
    d = fm.accumulation_drift(rng, seqlens=(256, 4096), head_dim=32, queries=8)
    for acc in ("bfloat16", "float16"):
        assert d[acc][1] > 1.5 * d[acc][0], (acc, d[acc])
        assert d[acc][0] > 100 * d["float32"][0]
    assert d["bfloat16"][1] > d["float16"][1]                             # 8 vs 11 mantissa bits


def test_tile_sizes_agree_to_rounding_but_not_bitwise(rng):
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=70, seqlen_k=150, head_dim=32, dtype="float32")
    r = fm.bitwise_differences(q, k, v, tiles=((16, 16), (32, 64)))
    assert all(r["checks"].values())
    for a, b, diff, share in r["pairs"]:
        assert 0 < diff < 1e-5 and share > 0.1, (a, b, diff, share)


def test_shuffled_dq_is_not_bitwise_reproducible_fixed_order_is(rng):
    q, k, v, do = testing.make_inputs(rng, heads_q=1, seqlen_q=40, seqlen_k=300, head_dim=16, dtype="float32",
                                      with_grad=True)
    parts = fm.dq_contributions(q[0, 0], k[0, 0], v[0, 0], do[0, 0], block_k=32)
    assert len(parts) == 10
    ref = reference.attention_backward(do, q, k, v)[0][0, 0]
    fixed = [fm.accumulate_dq(parts) for _ in range(3)]
    assert all(np.array_equal(fixed[0], f) for f in fixed)
    shuffled = [fm.accumulate_dq(parts, rng.permutation(len(parts))) for _ in range(4)]
    assert any(not np.array_equal(shuffled[0], s) for s in shuffled[1:])
    for s in shuffled + fixed:
        assert np.max(np.abs(s - ref)) < 1e-4 * np.max(np.abs(ref))


def test_deterministic_dq_costs_memory():
    c = fm.deterministic_dq_cost(seqlen_q=1000, seqlen_k=1000, head_dim=64, block_k=128)
    one = 1000 * 64 * 4
    assert c["Tc"] == 8 and c["atomic_memory"] == one and c["atomic_bytes"] == 2 * 8 * one
    # one head on 132 SMs: ceil(132 / 1) = 132 splits, but only Tc = 8 of them have a tile to walk
    assert c["splits"] == 132 and c["deterministic_memory"] == 132 * one
    assert c["blocks_per_head"] == {"atomic": 8, "deterministic": 8}
    assert c["deterministic_bytes"] == 2 * 8 * one + 132 * one


def test_deterministic_dq_splits_follow_the_sm_count_not_the_tiles():
    # FlashAttention-2's flash_api.cpp: ceil(#SMs / (batch * heads)) accumulators
    big = fm.deterministic_dq_cost(seqlen_q=4096, seqlen_k=4096, head_dim=128, block_k=128, batch=8, heads=16)
    assert big["Tc"] == 32 and big["splits"] == 2                       # ceil(132 / 128)
    assert big["deterministic_memory"] == 2 * big["atomic_memory"]
    assert big["blocks_per_head"] == {"atomic": 32, "deterministic": 2}
    few = fm.deterministic_dq_cost(seqlen_q=4096, seqlen_k=4096, head_dim=128, block_k=128, batch=1, heads=4,
                                   num_sms=108)
    assert few["splits"] == 27 and few["deterministic_memory"] == 27 * few["atomic_memory"]
    many = fm.deterministic_dq_cost(seqlen_q=64, seqlen_k=64, head_dim=16, block_k=64, batch=64, heads=32)
    assert many["splits"] == 1 and many["deterministic_memory"] == many["atomic_memory"]
    for bad in (dict(num_sms=0), dict(batch=0), dict(block_k=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fm.deterministic_dq_cost(**{**dict(seqlen_q=64, seqlen_k=64, head_dim=16, block_k=64), **bad})


def test_bias_costs_n_squared_score_mod_nothing(rng):
    r = fm.bias_vs_score_mod(rng, seqlen=96, head_dim=16, heads=2, docs=3, block=16)
    assert r["bias_bytes"] == 2 * 96 * 96 * 4 == r["traffic"]["dense bias"].by_tensor["bias"][0]
    assert r["alibi_difference"] < 1e-5 and r["document_error"] < 1e-5
    assert r["blocks"].num_skipped > 0
    assert r["traffic"]["document mask"].by_tensor["K"][0] < r["traffic"]["score_mod"].by_tensor["K"][0]


def test_textbook_softmax_nans_where_the_package_gives_zero(rng):
    s = np.array([[0.5, -1.0, 2.0], [-np.inf] * 3])
    p = fm.textbook_softmax(s)
    assert np.isnan(p[1]).all() and np.isclose(p[0].sum(), 1.0)
    q, k, v = testing.make_inputs(rng, seqlen_q=9, seqlen_k=4, head_dim=8)
    for backend in ("naive", "tiled"):
        o, lse = ik.attention(q, k, v, causal=True, backend=backend, return_lse=True)
        assert np.all(o[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5])) and not np.isnan(o).any()


def test_varlen_savings_and_off_by_one_caught(rng):
    lens = [37, 90, 5, 61]
    s = fm.varlen_savings(lens, heads=2, head_dim=16)
    assert s["flops_packed"] == sum(4 * n * n * 16 * 2 for n in lens)
    assert s["flops_padded"] == 4 * 4 * 90 * 90 * 16 * 2
    assert 0 < s["bytes_saved"] < 1 and 0 < s["flops_saved"] < 1
    q, k, v, cu, _ = testing.make_varlen_inputs(rng, lens, heads_q=2, head_dim=16)
    good = ik.attention_varlen(q, k, v, cu, cu)
    assert all(fm.check_varlen_per_sequence(good, q, k, v, lens))
    bad_cu = cu.copy()
    bad_cu[1] += 1                                      # sequence 0 takes sequence 1's first token
    bad = ik.attention_varlen(q, k, v, bad_cu, bad_cu)  # passes every argument check
    verdict = [bool(c) for c in fm.check_varlen_per_sequence(bad, q, k, v, lens)]
    assert verdict == [False, False, True, True]


def test_accuracy_report_names_what_ran(rng):
    rows = fm.accuracy_report(rng, backends=("naive", "tiled"), seqlen=40, head_dim=16)
    assert [r["ran"] for r in rows] == ["naive", "tiled"] and all(r["check"] for r in rows)
    assert fm.versions()["numpy"] == np.__version__


def test_plots_draw(rng):
    pytest.importorskip("matplotlib")
    from iokernels.viz import failure_modes as vf
    d = fm.accumulation_drift(rng, seqlens=(64, 128), head_dim=8, queries=2)
    assert vf.drift_figure(d).axes
    r = fm.bias_vs_score_mod(rng, seqlen=64, head_dim=8, heads=1, docs=2, block=16)
    assert vf.block_mask_figure(r["blocks"], r["doc_ids"]).axes


def test_accuracy_report_runs_torch_inside_the_callers_quiet_block(rng):
    pytest.importorskip("torch")
    import contextlib
    entered = []

    @contextlib.contextmanager
    def quiet():
        entered.append(True)
        yield

    rows = fm.accuracy_report(rng, backends=("naive", "torch"), seqlen=24, head_dim=16, quiet=quiet)
    assert entered == [True]                                  # once, around the torch run only
    assert rows[1]["backend"] == "torch" and rows[1]["check"]
