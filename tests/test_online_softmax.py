"""The online softmax by hand (iokernels.online_softmax) against direct computation."""
import math

import numpy as np
import pytest

from iokernels.online_softmax import online_softmax_steps


def test_article_row_in_blocks_of_two():
    r = online_softmax_steps([2, 1, 3, 0], 2)
    s1, s2 = r.steps
    assert (s1.m_new, s2.m_old, s2.m_new) == (2.0, 2.0, 3.0)
    assert s1.l_new == pytest.approx(math.exp(0) + math.exp(-1))
    assert s2.alpha == pytest.approx(math.exp(-1))
    assert s2.l_rescaled == pytest.approx(0.5032, abs=5e-5)
    assert s2.block_sum == pytest.approx(1.0498, abs=5e-5)
    direct = math.exp(-1) + math.exp(-2) + math.exp(0) + math.exp(-3)
    assert r.l == pytest.approx(direct, rel=1e-15) and round(r.l, 4) == 1.5530


@pytest.mark.parametrize("n,block", [(1, 1), (7, 2), (13, 4), (16, 16), (33, 5)])
def test_random_rows_match_direct_softmax(rng, n, block):
    x = rng.standard_normal(n) * 4
    v = rng.standard_normal(n)
    r = online_softmax_steps(x, block, values=v)
    ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    np.testing.assert_allclose(r.softmax, ref, rtol=1e-13, atol=1e-15)
    assert r.lse == pytest.approx(x.max() + np.log(np.exp(x - x.max()).sum()), rel=1e-14)
    assert r.output == pytest.approx(float(ref @ v), rel=1e-12, abs=1e-14)
    assert len(r.steps) == -(-n // block)
    assert all(0.0 < s.alpha <= 1.0 for s in r.steps[1:])


def test_masked_entries_and_fully_masked_row(rng):
    x = rng.standard_normal(6)
    x[:3] = -np.inf                                  # a whole first block masked
    r = online_softmax_steps(x, 3, values=rng.standard_normal(6))
    assert r.steps[0].alpha == 1.0 and r.steps[0].l_new == 0.0
    assert np.all(r.softmax[:3] == 0) and r.softmax.sum() == pytest.approx(1.0)
    empty = online_softmax_steps([-np.inf] * 5, 2, values=np.ones(5))
    assert empty.lse == -np.inf and empty.output == 0.0 and not np.isnan(empty.softmax).any()


@pytest.mark.parametrize("row,block,values,arg", [([], 2, None, "row"), ([[1, 2]], 2, None, "row"),
                                                  ([1, np.nan], 2, None, "row"), ([1, 2], 0, None, "block"),
                                                  ([1, 2], 1.5, None, "block"), ([1, 2], 1, [1], "values")])
def test_bad_input_names_the_argument(row, block, values, arg):
    with pytest.raises(ValueError, match=arg):
        online_softmax_steps(row, block, values=values)
