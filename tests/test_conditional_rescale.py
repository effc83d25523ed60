"""FlashAttention-4's conditional rescaling in the tiled forward: exact after the final
normalisation, within the 2x rule at FlashAttention-4's threshold, and counted."""
import numpy as np
import pytest

import iokernels as ik
from iokernels import tiled
from iokernels.core import reference, testing

#: FlashAttention-4's threshold for 16-bit inputs (log2 units)
FA4_THRESHOLD = 8.0


@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
@pytest.mark.parametrize("causal", [False, True])
def test_threshold_zero_matches_the_oracle_in_float64(rng, loop_order, causal):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=131,
                                  head_dim=59, dtype="float64")
    cfg = ik.TileConfig(block_q=32, block_k=48, loop_order=loop_order, rescale_threshold=0.0)
    count = tiled.RescaleCount()
    o, lse = tiled.attention(q, k, v, causal=causal, scale=59 ** -0.5, window=None, config=cfg,
                             rescale_stats=count)
    ro, rl = reference.attention(q, k, v, causal=causal)
    testing.assert_close(o, ro, name="O")
    testing.assert_close(lse, rl, name="LSE")
    assert count.needed > 0 and count.skipped == 0      # tau = 0 skips nothing: the standard recurrence


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
def test_fa4_threshold_keeps_the_2x_rule(rng, dtype, loop_order):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=70, seqlen_k=203,
                                  head_dim=40, dtype=dtype)
    q = (q.astype(np.float32) * 2.5).astype(q.dtype)    # wider scores: some maxima grow past tau
    cfg = ik.TileConfig(block_q=16, block_k=16, loop_order=loop_order, rescale_threshold=FA4_THRESHOLD)
    count = tiled.RescaleCount()
    o, lse = tiled.attention(q, k, v, causal=True, scale=40 ** -0.5, window=None, config=cfg,
                             rescale_stats=count)
    ro, rl = reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    testing.assert_close(o, ro, bo, name="O")
    testing.assert_close(lse, rl, bl, name="LSE")
    assert 0 < count.skipped <= count.needed


def test_float64_at_fa4_threshold_is_still_exact(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=3, seqlen_q=45, seqlen_k=100, head_dim=24)
    count = tiled.RescaleCount()
    cfg = ik.TileConfig(block_q=16, block_k=16, rescale_threshold=FA4_THRESHOLD)
    o, lse = tiled.forward_fa2(q, k, v, causal=False, scale=0.3, window=(30, 7), config=cfg,
                               rescale_stats=count)
    ro, rl = reference.attention(q, k, v, scale=0.3, window=(30, 7))
    testing.assert_close(o, ro, name="O")
    testing.assert_close(lse, rl, name="LSE")
    assert count.skipped > 0


def test_skip_count_of_a_hand_worked_row():
    """One query row (d = 1, scale 1) whose scores are the keys: tiles of two keys.

    tile 1: scores [0, 1] -> m = 1 (the first tile sets m: no rescale counted)
    tile 2: scores [5, 2] -> grows by 4 nats = 5.77 log2 units <= 8: skipped, m stays 1
    tile 3: scores [12, 3] -> grows by 11 nats = 15.9 log2 units > 8: rescaled, m = 12
    tile 4: scores [6, 11] -> does not grow: nothing needed
    so 2 rescales needed, 1 skipped.  With tau = 5 (< 5.77) none is skipped.
    """
    q = np.ones((1, 1, 1, 1))
    keys = np.array([0, 1, 5, 2, 12, 3, 6, 11], dtype=np.float64)
    k = keys.reshape(1, 1, -1, 1)
    v = np.random.default_rng(7).standard_normal((1, 1, keys.size, 1))
    for tau, skipped in ((8.0, 1), (5.0, 0)):
        count = tiled.RescaleCount()
        cfg = ik.TileConfig(block_q=1, block_k=2, rescale_threshold=tau)
        o, lse = tiled.forward_fa2(q, k, v, causal=False, scale=1.0, window=None, config=cfg, rescale_stats=count)
        assert (count.needed, count.skipped) == (2, skipped)
        ro, rl = reference.attention(q, k, v, scale=1.0)
        testing.assert_close(o, ro, name="O")
        testing.assert_close(lse, rl, name="LSE")


def test_fully_masked_rows_stay_zero_with_minus_inf_lse(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=40, seqlen_k=9, head_dim=16)
    cfg = ik.TileConfig(block_q=8, block_k=4, rescale_threshold=FA4_THRESHOLD)
    o, lse = tiled.forward_fa2(q, k, v, causal=True, scale=0.25, window=None, config=cfg)
    ro, rl = reference.attention(q, k, v, causal=True, scale=0.25)
    masked = np.isneginf(rl)
    assert masked.any()
    testing.assert_close(o, ro, name="O", masked_rows=masked[..., None])
    testing.assert_close(lse, rl, name="LSE")


@pytest.mark.parametrize("bad", [-1.0, 65.0, float("nan"), "8", True])
def test_bad_threshold_raises_naming_it(bad):
    with pytest.raises(ValueError, match="rescale_threshold"):
        ik.TileConfig(rescale_threshold=bad)


def test_threshold_reaches_the_public_api(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=33, seqlen_k=70, head_dim=20)
    cfg = ik.TileConfig(block_q=16, block_k=16, rescale_threshold=FA4_THRESHOLD)
    o = ik.attention(q, k, v, config=cfg)
    testing.assert_close(o, reference.attention(q, k, v)[0], name="O")
