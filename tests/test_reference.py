"""The oracle and the conventions, checked against definitions written out by hand.

Everything else is judged by iokernels.core.reference and iokernels.core.testing.check, so these
tests hold them against independent definitions: double loops for the masks and the
log-sum-exp, PyTorch's scaled_dot_product_attention (CPU, float64) for the attention
itself, and deliberately broken outputs for the checker.
"""
import math

import numpy as np
import pytest

from iokernels import conventions as cv
from iokernels import reference, testing

torch = pytest.importorskip("torch")

MASK_CASES = [  # (Nq, Nk, causal, window)
    (7, 7, False, None), (7, 7, True, None), (5, 11, True, None), (11, 5, True, None),
    (9, 13, False, (3, 2)), (13, 9, False, (0, 0)), (10, 10, True, (4, -1)),
    (6, 15, False, (-1, 1)), (15, 6, True, (2, 5)), (1, 9, True, None), (9, 1, True, None),
]


def brute_visible(i, j, Nq, Nk, causal, window):
    """The mask rule written out for one (query, key) pair, straight from the definition."""
    left, right = (-1, -1) if window is None else window
    diag = i + Nk - Nq                      # bottom-right alignment
    ok = True
    if causal:
        ok = ok and j <= diag
    if left >= 0:
        ok = ok and j >= diag - left
    if right >= 0:
        ok = ok and j <= diag + right
    return ok


@pytest.mark.parametrize("Nq,Nk,causal,window", MASK_CASES)
def test_mask_matches_double_loop_definition(Nq, Nk, causal, window):
    expect = np.array([[brute_visible(i, j, Nq, Nk, causal, window) for j in range(Nk)]
                       for i in range(Nq)], dtype=bool).reshape(Nq, Nk)
    np.testing.assert_array_equal(cv.mask(Nq, Nk, causal, window), expect)
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    for i in range(Nq):                      # each row's visible keys are one interval [lo, hi)
        cols = np.flatnonzero(expect[i])
        if cols.size:
            assert (lo[i], hi[i]) == (cols[0], cols[-1] + 1)
        else:
            assert hi[i] <= lo[i]


@pytest.mark.parametrize("Nq,Nk,causal,window", MASK_CASES)
def test_tile_state_matches_mask(Nq, Nk, causal, window):
    full = cv.mask(Nq, Nk, causal, window)
    for br, bc in ((2, 3), (4, 4), (3, 5)):
        for r0 in range(0, Nq, br):
            for c0 in range(0, Nk, bc):
                r1, c1 = min(r0 + br, Nq), min(c0 + bc, Nk)
                tile = full[r0:r1, c0:c1]
                expect = "skip" if not tile.any() else ("full" if tile.all() else "partial")
                assert cv.tile_state(r0, r1, c0, c1, Nq, Nk, causal, window) == expect


def test_bottom_right_and_top_left_causal_differ_when_lengths_differ():
    # Nq = 3, Nk = 5: bottom-right lets query 0 see keys 0..2; top-left (SDPA) only key 0.
    br = cv.mask(3, 5, causal=True)
    assert br[0].tolist() == [True, True, True, False, False]
    top_left = np.tril(np.ones((3, 5), dtype=bool))
    assert top_left[0].tolist() == [True, False, False, False, False]
    assert not np.array_equal(br, top_left)
    np.testing.assert_array_equal(cv.mask(6, 6, causal=True), np.tril(np.ones((6, 6), dtype=bool)))


def _sdpa(q, k, v, **kw):
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)]
    return torch.nn.functional.scaled_dot_product_attention(*t, **kw).numpy()


@pytest.mark.parametrize("Nq,Nk,causal", [(37, 37, True), (37, 37, False), (29, 70, False),
                                          (70, 29, False), (1, 50, False)])
def test_oracle_matches_torch_sdpa_float64(rng, Nq, Nk, causal):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=3, seqlen_q=Nq, seqlen_k=Nk, head_dim=24)
    o, _ = reference.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, _sdpa(q, k, v, is_causal=causal), rtol=0, atol=1e-12)


def test_oracle_bottom_right_causal_matches_sdpa_with_explicit_mask(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=13, seqlen_k=31, head_dim=16)
    o, _ = reference.attention(q, k, v, causal=True)
    m = torch.from_numpy(cv.mask(13, 31, causal=True))
    np.testing.assert_allclose(o, _sdpa(q, k, v, attn_mask=m), rtol=0, atol=1e-12)
    # and SDPA's own is_causal (top-left) gives a different answer on the same inputs
    assert np.max(np.abs(o - _sdpa(q, k, v, is_causal=True))) > 1e-3


def test_oracle_gqa_equals_repeated_kv(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=6, heads_kv=2, seqlen_q=20, head_dim=8)
    o, lse = reference.attention(q, k, v)
    o2, lse2 = reference.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_allclose(o, o2, atol=1e-14)
    np.testing.assert_allclose(lse, lse2, atol=1e-14)


def test_oracle_lse_is_logsumexp_of_visible_scores(rng):
    Nq, Nk, d = 9, 14, 5
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d)
    scale = 0.37
    _, lse = reference.attention(q, k, v, causal=True, scale=scale, window=(6, -1))
    for i in range(Nq):
        terms = [scale * float(q[0, 0, i] @ k[0, 0, j]) for j in range(Nk)
                 if brute_visible(i, j, Nq, Nk, True, (6, -1))]
        m = max(terms)
        assert lse[0, 0, i] == pytest.approx(m + math.log(sum(math.exp(t - m) for t in terms)), abs=1e-13)


def test_oracle_fully_masked_rows_give_zero_and_minus_inf(rng):
    # causal with Nq > Nk: the first Nq - Nk query rows see no key at all
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=10, seqlen_k=4, head_dim=8)
    with np.errstate(all="raise"):
        o, lse = reference.attention(q, k, v, causal=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[:, :, :6] == 0) and np.all(np.isneginf(lse[:, :, :6]))
    assert np.all(np.isfinite(lse[:, :, 6:]))


def test_oracle_varlen_matches_per_sequence_batched(rng):
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, [4, 0, 9], [6, 3, 0], heads_q=2, head_dim=8)
    o, lse = reference.attention_varlen(q, k, v, cq, ck, causal=True)
    o0, l0 = reference.attention(q[:4].transpose(1, 0, 2)[None], k[:6].transpose(1, 0, 2)[None],
                                 v[:6].transpose(1, 0, 2)[None], causal=True)
    np.testing.assert_allclose(o[:4], o0[0].transpose(1, 0, 2), atol=1e-14)
    np.testing.assert_allclose(lse[:, :4], l0[0], atol=1e-14)
    assert np.all(o[4:] == 0) and np.all(np.isneginf(lse[:, 4:]))   # sequence 2 has no keys


# --------------------------------------------------------------------------- the checker
def test_checker_passes_the_oracle_and_fails_a_perturbed_output(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=16, head_dim=8)
    o, lse = reference.attention(q, k, v)
    assert testing.check(o, o).ok and testing.check(lse, lse).ok
    bad = o.copy()
    bad[0, 1, 3, 2] += 1e-9
    c = testing.check(bad, o)
    assert not c.ok and "FAIL" in str(c)
    with pytest.raises(AssertionError):
        testing.assert_close(bad, o)


def test_checker_fails_on_nan_and_on_wrong_masked_rows(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=8, seqlen_k=3, head_dim=4)
    o, lse = reference.attention(q, k, v, causal=True)
    nan = o.copy()
    nan[0, 0, 7, 0] = np.nan
    assert not testing.check(nan, o).ok
    masked = np.isneginf(lse)[..., None]
    assert testing.check(o, o, masked_rows=masked).ok
    nonzero = o.copy()
    nonzero[0, 0, 0, 0] = 1e-30                  # a masked row that is not exactly zero
    assert not testing.check(nonzero, o, masked_rows=masked).ok
    finite_lse = np.where(np.isneginf(lse), -1e30, lse)   # masked LSE must be -inf, not just small
    assert not testing.check(finite_lse, lse).ok


def test_checker_low_precision_rule_uses_the_baseline(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=32, head_dim=16, dtype="float16")
    ref, _ = reference.attention(q, k, v)
    base = ref.astype(np.float16)                          # a baseline in the same precision
    base_err = np.max(np.abs(base.astype(np.float64) - ref))
    near = ref + 1.5 * base_err                            # within twice the baseline's error
    far = ref + 3.0 * base_err + 1e-3                      # well outside it
    assert testing.check(near.astype(np.float32), ref, base, dtype="float16").ok
    assert not testing.check(far.astype(np.float32), ref, base, dtype="float16").ok
    with pytest.raises(ValueError, match="baseline"):
        testing.check(base, ref)                           # low precision needs a baseline
