"""FP8 attention on a CPU: the Hadamard transform, quantization, and the FlashAttention-3
accuracy experiment (seeded) with its error ratio."""
import numpy as np
import pytest

from iokernels import fp8
from iokernels.core import reference


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_fwht_equals_the_dense_matrix_and_is_orthogonal(rng, d):
    x = rng.standard_normal((3, 5, d))
    h = fp8.hadamard_matrix(d)
    np.testing.assert_allclose(h @ h.T, np.eye(d), rtol=0, atol=1e-14)     # orthonormal
    fast = fp8.fwht(x)
    np.testing.assert_allclose(fast, x @ h, rtol=0, atol=1e-13 * np.sqrt(d))
    np.testing.assert_allclose(fp8.fwht(fast), x, rtol=0, atol=1e-13)        # symmetric: its own inverse
    np.testing.assert_allclose(np.linalg.norm(fast, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-14)


def test_fwht_along_another_axis(rng):
    x = rng.standard_normal((16, 7))
    np.testing.assert_allclose(fp8.fwht(x, axis=0), fp8.hadamard_matrix(16) @ x, atol=1e-13)


def test_randomized_hadamard_leaves_scores_exact(rng):
    q, k = rng.standard_normal((2, 3, 37, 64)), rng.standard_normal((2, 3, 53, 64))
    signs = fp8.random_signs(64, rng)
    qm, km = fp8.randomized_hadamard(q, signs), fp8.randomized_hadamard(k, signs)
    s, sm = q @ k.swapaxes(-1, -2), qm @ km.swapaxes(-1, -2)
    assert np.max(np.abs(sm - s)) <= 1e-12 * max(1.0, np.max(np.abs(s)))
    assert not np.allclose(qm, q)                          # it did change Q


def test_transform_spreads_an_outlier():
    x = np.zeros(128)
    x[5] = 40.0
    y = fp8.randomized_hadamard(x, np.ones(128))
    np.testing.assert_allclose(np.abs(y), 40.0 / np.sqrt(128))


def test_smoothing_k_is_exact_for_attention(rng):
    q, k, v = (rng.standard_normal((1, 2, n, 24)) for n in (19, 41, 41))
    k = k + rng.standard_normal(24) * 5                    # a mean key far from 0
    o, lse = reference.attention(q, k, v)
    o2, _ = reference.attention(q, fp8.smooth_k(k), v)
    np.testing.assert_allclose(o2, o, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [0, 3, 96])
def test_non_power_of_two_raises(rng, bad):
    with pytest.raises(ValueError, match="power-of-2"):
        fp8.fwht(rng.standard_normal((2, bad)) if bad else np.zeros((2, 0)))


@pytest.mark.parametrize("fmt,bits", [("e4m3", 3), ("e5m2", 2)])
def test_quantize_rounds_to_the_format(rng, fmt, bits):
    x = rng.standard_normal((2, 1, 70, 16)) * 3
    for block in (None, 16):
        xq = fp8.quantize(x, fmt, block)
        big = np.abs(x) > np.max(np.abs(x)) / 8             # well inside the normal range
        rel = np.abs(xq - x)[big] / np.abs(x)[big]
        assert 0 < rel.max() <= 2.0 ** -(bits + 1) * (1 + 1e-6)   # half a unit in the last place
    # a block's scale ignores an outlier in another block
    x[0, 0, 3, 0] = 1000.0
    err_tensor = np.abs(fp8.quantize(x, fmt)[..., 32:, :] - x[..., 32:, :]).max()
    err_block = np.abs(fp8.quantize(x, fmt, 16)[..., 32:, :] - x[..., 32:, :]).max()
    assert err_block <= err_tensor


def test_experiment_rejects_unknown_variants():
    with pytest.raises(ValueError, match="variants"):
        fp8.accuracy_experiment(variants=["fp9"], seqlen_q=8, seqlen_k=8, head_dim=8)


def test_bad_format_and_block_raise(rng):
    x = rng.standard_normal((1, 1, 8, 8))
    with pytest.raises(ValueError, match="fmt"):
        fp8.quantize(x, "e3m4")
    with pytest.raises(ValueError, match="block"):
        fp8.quantize(x, "e4m3", 0)
    with pytest.raises(ValueError, match="q, k, v"):
        fp8.fp8_attention(x, x[..., :4], x)


def test_fp8_attention_is_close_and_scaling_p_matters(rng):
    q, k, v = (rng.standard_normal((1, 2, 300, 32)) for _ in range(3))
    ref, _ = reference.attention(q, k, v)
    e8 = fp8.rmse(fp8.fp8_attention(q, k, v), ref)
    e16 = fp8.rmse(fp8.fp16_attention(q, k, v), ref)
    assert e16 < e8 < 0.05                                 # fp8 is coarser than fp16, still attention
    # without the 2^8 scale, small probabilities fall into e4m3's subnormals and lose bits
    assert fp8.rmse(fp8.fp8_attention(q, k, v, p_scale=1.0), ref) > e8


def test_accuracy_experiment_error_ratio_is_at_least_two():
    """The seeded FlashAttention-3 experiment: per-tensor FP8 vs FP8 after the transform."""
    rows = fp8.accuracy_experiment()
    by = {r.name: r.rmse for r in rows}
    assert fp8.error_ratio(rows) >= 2.0, fp8.experiment_table(rows)
    assert fp8.error_ratio(rows, "per block, after the Hadamard") >= 2.0, fp8.experiment_table(rows)
    # nearly all of the gain is the transform, as in the paper: blocks alone help far less
    assert by["fp8 e4m3, per-block scales (128 rows)"] > 1.5 * by["fp8 e4m3, per block, after the Hadamard transform"]
    fp16 = by.pop("fp16 (fp32 accumulation)")
    assert fp16 * 10 < min(by.values())                   # fp16 is far more accurate than any fp8
    assert by["fp8 e5m2, one scale per tensor"] > by["fp8 e4m3, one scale per tensor"]


def test_smoothing_k_helps_when_keys_share_a_component(rng):
    q, k, v = (rng.standard_normal((1, 2, n, 64)) for n in (150, 400, 400))
    k = k + 5 * rng.standard_normal(64)                   # a component every key shares
    ref, _ = reference.attention(q, k, v)
    plain = fp8.rmse(fp8.fp8_attention(q, k, v), ref)
    assert fp8.rmse(fp8.fp8_attention(q, k, v, smooth=True), ref) < 0.6 * plain


def test_experiment_key_offset_is_what_smoothing_removes():
    """Seeded, like the paper's experiment: a shared key component raises the per-tensor error,
    and smoothing takes it back out."""
    names = ("fp8 e4m3, one scale per tensor", "fp8 e4m3, per tensor, K smoothed (SageAttention)")
    kw = dict(seqlen_q=512, seqlen_k=4096, variants=names)
    plain0, _ = (r.rmse for r in fp8.accuracy_experiment(**kw))
    plain5, smooth5 = (r.rmse for r in fp8.accuracy_experiment(key_offset=5.0, **kw))
    assert plain5 > plain0 and smooth5 < 0.9 * plain5


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_error_typical_against_worst_case(rng, fmt):
    """Half an ulp over the binade's bottom bounds every normal value; the mean is far below it."""
    s = fp8.rounding_error(fmt, rng)
    m = fp8.MANTISSA_BITS[fmt]
    assert s["mantissa_bits"] == m and s["worst_case"] == 2.0 ** -(m + 1)
    sup = s["worst_case"] / (1 + s["worst_case"])          # a value half an ulp above a binade's bottom
    assert 0.9 * sup < s["max"] <= sup * (1 + 1e-6)
    assert 0.25 * s["worst_case"] < s["mean"] < 0.5 * s["worst_case"] and s["mean"] < s["rms"] < s["max"]
    assert s["flushed"] <= s["subnormal"] < 1e-3


def test_e4m3_typical_error_is_two_to_three_percent(rng):
    s = fp8.rounding_error("e4m3", rng, n=1 << 15)
    assert s["worst_case"] == 0.0625
    assert 0.02 <= s["mean"] <= 0.03 and 0.02 <= s["rms"] <= 0.03
    assert fp8.rounding_error("e5m2", rng)["mean"] > s["mean"]           # one bit fewer: about twice


def test_rounding_error_bad_input():
    with pytest.raises(ValueError, match="fmt"):
        fp8.rounding_error("e3m4")
    with pytest.raises(ValueError, match="n"):
        fp8.rounding_error("e4m3", n=1)


def test_threshold_headroom_and_a_stale_maximum(rng):
    h = fp8.threshold_headroom(8.0)
    assert not h["fits"] and h["largest_scaled_p"] == 256.0 * 256.0
    assert h["max_threshold"] == pytest.approx(np.log2(448 / 256)) and h["max_p_scale"] == pytest.approx(1.75)
    assert fp8.threshold_headroom(h["max_threshold"])["fits"]
    for r in fp8.threshold_experiment(rng, thresholds=(0.0, 0.5, 2.0), seqlen_q=16, seqlen_k=256, head_dim=32):
        overflow = r["p_scale"] * 2.0 ** r["lag"] > 448 * (1 + 1e-9)
        assert (r["nan_share"] == 1.0) == overflow and (r["nan_share"] == 0.0) != overflow, r
        if not overflow:
            assert r["rmse"] < 0.05
    q, k, v = (rng.standard_normal((1, 1, n, 16)) for n in (8, 40, 40))
    ref, _ = reference.attention(q, k, v)
    # a stale maximum is a scale of P: with P's scale shrunk by the same factor, the cast sees the same values
    a = fp8.fp8_attention(q, k, v, stale_by=3.0, p_scale=32.0)
    b = fp8.fp8_attention(q, k, v, p_scale=256.0)
    assert fp8.rmse(a, ref) == pytest.approx(fp8.rmse(b, ref), rel=1e-3)
    with pytest.raises(ValueError, match="stale_by"):
        fp8.fp8_attention(q, k, v, stale_by=-1.0)
    with pytest.raises(ValueError, match="threshold"):
        fp8.threshold_headroom(-1.0)
