"""FlashAttention-4's software exp2 (error bound, bit trick) and the rescale survey."""
import math

import numpy as np
import pytest

from iokernels import fa4


def test_software_exp2_is_within_a_tenth_of_a_bf16_half_ulp(rng):
    x = rng.uniform(-60, 60, 200_000).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(fa4.software_exp2(x).astype(np.float64) - exact) / exact
    assert 0 < rel.max() <= fa4.BF16_HALF_ULP / 10
    assert fa4.exp2_max_rel_error() <= fa4.BF16_HALF_ULP / 10
    assert fa4.BF16_HALF_ULP == pytest.approx(1.953125e-3)


def test_fitted_polynomial_matches_the_codes_coefficients():
    c = fa4.fit_exp2_poly(3)
    np.testing.assert_allclose(c, fa4.FA4_EXP2_COEFFS, atol=6e-4)
    assert fa4.exp2_max_rel_error(c) <= fa4.exp2_max_rel_error()      # unrounded is no worse
    errs = [fa4.exp2_max_rel_error(fa4.fit_exp2_poly(k)) for k in (2, 3, 4)]
    assert errs[0] > fa4.BF16_HALF_ULP > errs[1] > errs[2]             # degree 2 is not enough for bf16


def test_exact_on_integers_and_clamped_to_normal_floats(rng):
    # Every integer of the clamp range, and a random sample again: 2^n is a power of two, so
    # the expected value is built exactly (math.ldexp), never by a library's exp2, whose last
    # bit depends on its SIMD path (NumPy's AVX-512 np.exp2(float32(127)) is one ulp above 2^127).
    n = np.concatenate([np.arange(-126, 128), rng.integers(-126, 128, 50)]).astype(np.float32)
    exact = np.array([math.ldexp(1.0, int(k)) for k in n], dtype=np.float32)
    got = fa4.software_exp2(n)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.int32), exact.view(np.int32))   # f = 0: p(0) = 1, bit for bit
    low = fa4.software_exp2(np.array([-1e4, -127.5], np.float32))
    np.testing.assert_array_equal(low, np.float32(2.0 ** -126))        # clamped: normal, never garbage
    assert np.isfinite(fa4.software_exp2(np.array([1e4], np.float32))).all()


def test_bad_degree_raises():
    with pytest.raises(ValueError, match="degree"):
        fa4.fit_exp2_poly(0)


def test_rescale_survey_counts_and_stays_accurate(rng):
    rows = fa4.rescale_survey(rng, seqlens=(96, 200), spreads=(1.0, 3.0), head_dim=16, seqlen_q=20, block=32)
    assert len(rows) == 4
    for r in rows:
        assert 0 <= r["skipped"] <= r["needed"]
        assert r["err_conditional"] <= 2 * r["err_always"] + 1e-6        # the 2x rule, float32
    narrow = [r for r in rows if r["spread"] == 1.0]
    assert all(r["skipped"] == r["needed"] > 0 for r in narrow)          # scores ~ N(0, 1): never 8 log2 units
