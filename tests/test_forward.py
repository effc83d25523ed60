"""Forward pass of the NumPy kernels (naive, tiled FA2 and FA1) against the float64 oracle.

FlashAttention's own test sweep, on the CPU: awkward (seqlen_q, seqlen_k) pairs, head
dims that are not powers of two, causal and not, sliding windows, MQA and GQA, float64
(held to ~1e-12) and float32 / float16 (FlashAttention's 2x rule against the naive
algorithm in the same precision).  Every axis value is covered; the combinations are
sampled (a cartesian product would take minutes), deterministically, so a failure
names its case.  Outputs and LSE are both checked, fully masked rows exactly.
"""
import itertools

import numpy as np
import pytest

import iokernels as ik
from iokernels import conventions as cv
from iokernels import reference, testing
from iokernels.core.config import TileConfig

SEQLENS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1, 239), (3, 799),
           (127, 513), (239, 1)]
HEAD_DIMS = [32, 59, 64, 111, 128]
DTYPES = ["float64", "float32", "float16"]
HEADS = [(2, 2), (4, 1), (6, 2)]           # MHA, MQA, GQA (heads_q, heads_kv)
WINDOWS = [None, (64, 0), (-1, 17), (100, 100)]
ORDERS = ["fa2", "fa1"]
#: tiles chosen so most lengths above leave a ragged last tile
TILES = [(64, 64), (32, 48), (128, 64)]
#: float64 tiles of 128 x 64 at d = 128 need ~420 KB; these tests are about numerics, so
#: give the tiles room (SRAM limits are tested in test_traffic.py)
ROOMY_SRAM = 1 << 20


def _cases():
    """Every shape, both loop orders, causal and not; the other axes cycled through with
    coprime periods (3, 4, 5) so dtypes, heads, windows and head dims mix."""
    cases = []
    combos = itertools.product((0, 7), SEQLENS, ORDERS, (False, True))   # two passes, shifted
    for n, (shift, (nq, nk), order, causal) in enumerate(combos):
        n += shift
        d, dtype = HEAD_DIMS[n % 5], DTYPES[n % 3]
        heads, window, tiles = HEADS[(n // 3) % 3], WINDOWS[n % 4], TILES[(n // 4) % 3]
        cases.append(pytest.param(
            nq, nk, d, dtype, heads, order, causal, window, tiles,
            id=f"{nq}x{nk}-d{d}-{dtype}-h{heads[0]}.{heads[1]}-{order}-"
               f"{'causal' if causal else 'full'}-w{window}-t{tiles[0]}.{tiles[1]}"))
    return cases


def masked_rows(nq, nk, causal, window):
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal, window)
    return (hi <= lo)[None, None, :, None]


def check_against_oracle(o, lse, q, k, v, dtype, causal, window, baseline=None):
    """Output and LSE against the float64 oracle: 1e-12 for float64, else the 2x rule."""
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, window=window)
    mr = masked_rows(q.shape[2], k.shape[2], causal, window)
    assert o.dtype == q.dtype
    assert lse.dtype == cv.accum_dtype(dtype) and lse.shape == q.shape[:3]
    if dtype == "float64":
        testing.assert_close(o, ref_o, masked_rows=mr, name="O")
        testing.assert_close(lse, ref_lse, name="LSE")
    else:
        base_o, base_lse = baseline
        testing.assert_close(o, ref_o, base_o, masked_rows=mr, name="O")
        testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, name="LSE")


@pytest.mark.parametrize("nq,nk,d,dtype,heads,order,causal,window,tiles", _cases())
def test_tiled_forward(rng, nq, nk, d, dtype, heads, order, causal, window, tiles):
    q, k, v = testing.make_inputs(rng, batch=2 if nq * nk < 40_000 else 1, heads_q=heads[0],
                                  heads_kv=heads[1], seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)
    cfg = TileConfig(block_q=tiles[0], block_k=tiles[1], loop_order=order, sram_bytes=ROOMY_SRAM)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="tiled", config=cfg,
                          return_lse=True)
    baseline = None
    if dtype != "float64":
        baseline = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    check_against_oracle(o, lse, q, k, v, dtype, causal, window, baseline)


@pytest.mark.parametrize("nq,nk,d,causal,window,heads", [
    (113, 203, 59, True, None, (4, 1)), (239, 1, 32, True, None, (2, 2)),
    (3, 799, 111, False, (50, 3), (6, 2)), (256, 512, 128, False, None, (2, 2)),
])
def test_naive_forward_float64(rng, nq, nk, d, causal, window, heads):
    q, k, v = testing.make_inputs(rng, heads_q=heads[0], heads_kv=heads[1], seqlen_q=nq, seqlen_k=nk,
                                  head_dim=d)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    check_against_oracle(o, lse, q, k, v, "float64", causal, window)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_naive_low_precision_is_no_better_than_it_should_be(rng, dtype):
    """The naive baseline stores S and P in the input dtype: its error is that of the dtype."""
    q, k, v = testing.make_inputs(rng, seqlen_q=128, seqlen_k=217, head_dim=64, dtype=dtype)
    o, lse = ik.attention(q, k, v, backend="naive", return_lse=True)
    ref, _ = reference.attention(q, k, v)
    err = np.max(np.abs(o.astype(np.float64) - ref))
    eps = np.finfo(dtype).eps
    assert 0 < err < 64 * eps                 # rounded, but only by a few ulps
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32


def test_default_config_and_default_backend(rng):
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=130, seqlen_k=70, head_dim=40)
    o, lse = ik.attention(q, k, v, causal=True, return_lse=True)           # tiled, TileConfig()
    check_against_oracle(o, lse, q, k, v, "float64", True, None)
    o1 = ik.attention(q, k, v, causal=True, config=TileConfig(loop_order="fa1"))
    np.testing.assert_allclose(o1, o, atol=1e-13)


@pytest.mark.parametrize("order", ORDERS)
def test_fully_masked_rows_exact_zero_and_minus_inf(rng, order):
    """Causal with Nq > Nk and a window that leaves rows empty: no NaN, exact 0 and -inf."""
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=90, seqlen_k=20, head_dim=16, dtype="float16")
    cfg = TileConfig(block_q=16, block_k=8, loop_order=order)
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        o, lse = ik.attention(q, k, v, causal=True, window=(5, 0), config=cfg, return_lse=True)
    empty = masked_rows(90, 20, True, (5, 0))[0, 0, :, 0]
    assert empty.sum() == 70
    assert np.all(o[:, :, empty] == 0) and np.all(np.isneginf(lse[:, :, empty]))
    assert np.all(np.isfinite(lse[:, :, ~empty])) and not np.isnan(o).any()


@pytest.mark.parametrize("order", ORDERS)
def test_inputs_unchanged(rng, order):
    q, k, v = testing.make_inputs(rng, seqlen_q=50, seqlen_k=60, head_dim=16, dtype="float32")
    copies = [x.copy() for x in (q, k, v)]
    ik.attention(q, k, v, causal=True, config=TileConfig(16, 16, order))
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


def test_scale_is_used(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=40, head_dim=16)
    o, lse = ik.attention(q, k, v, scale=0.9, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, scale=0.9)
    testing.assert_close(o, ref_o)
    testing.assert_close(lse, ref_lse)
    assert np.max(np.abs(o - reference.attention(q, k, v)[0])) > 1e-3


# --------------------------------------------------------------------------- varlen
VARLEN = [  # (seqlens_q, seqlens_k)
    ([5, 0, 70, 33, 0], [9, 4, 0, 100, 0]),
    ([1, 129, 64], [300, 65, 64]),
    ([0, 0, 17], [3, 0, 17]),
]


@pytest.mark.parametrize("lens", VARLEN)
@pytest.mark.parametrize("order,causal,window", [("fa2", False, None), ("fa1", True, None),
                                                  ("fa2", True, (20, 3)), ("fa1", False, (-1, 10))])
def test_varlen_float64_vs_per_sequence_oracle(rng, lens, order, causal, window):
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, *lens, heads_q=4, heads_kv=2, head_dim=59)
    cfg = TileConfig(block_q=32, block_k=16, loop_order=order)
    o, lse = ik.attention_varlen(q, k, v, cq, ck, causal=causal, window=window, config=cfg,
                                 return_lse=True)
    ref_o, ref_lse = reference.attention_varlen(q, k, v, cq, ck, causal=causal, window=window)
    assert lse.shape == (4, q.shape[0])
    empty = np.isneginf(ref_lse).T[:, :, None]             # (total_q, heads, 1)
    testing.assert_close(o, ref_o, masked_rows=empty, name="O")
    testing.assert_close(lse, ref_lse, name="LSE")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_varlen_low_precision_2x_rule(rng, dtype):
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, [40, 0, 111], [77, 5, 111], heads_q=2,
                                                 head_dim=64, dtype=dtype)
    o, lse = ik.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    base_o, base_lse = ik.attention_varlen(q, k, v, cq, ck, causal=True, backend="naive", return_lse=True)
    ref_o, ref_lse = reference.attention_varlen(q, k, v, cq, ck, causal=True)
    testing.assert_close(o, ref_o, base_o, name="O")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, name="LSE")


def test_varlen_sequences_do_not_see_each_other(rng):
    """Changing one sequence's keys changes only that sequence's outputs."""
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, [30, 20, 25], [40, 35, 10], heads_q=2, head_dim=16)
    o = ik.attention_varlen(q, k, v, cq, ck)
    k2, v2 = k.copy(), v.copy()
    k2[40:75] = rng.standard_normal(k2[40:75].shape)
    v2[40:75] = rng.standard_normal(v2[40:75].shape)
    o2 = ik.attention_varlen(q, k2, v2, cq, ck)
    np.testing.assert_array_equal(o[:30], o2[:30])
    np.testing.assert_array_equal(o[50:], o2[50:])
    assert np.max(np.abs(o[30:50] - o2[30:50])) > 1e-3


@pytest.mark.parametrize("order", ORDERS)
def test_bfloat16_when_ml_dtypes_is_installed(rng, order):
    pytest.importorskip("ml_dtypes")
    q, k, v = testing.make_inputs(rng, heads_q=4, heads_kv=2, seqlen_q=113, seqlen_k=203, head_dim=59,
                                  dtype="bfloat16")
    o, lse = ik.attention(q, k, v, causal=True, config=TileConfig(32, 48, order), return_lse=True)
    baseline = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    check_against_oracle(o, lse, q, k, v, "bfloat16", True, None, baseline)


@pytest.mark.parametrize("order", ORDERS)
def test_online_softmax_worked_by_hand(order):
    """SOURCE_FACTS' hand example: the score row [2, 1, 3, 0] in blocks of two.

    Block 1 gives m = 2, l = e^0 + e^-1; block 2 raises m to 3 and rescales l by e^-1;
    the result is l = e^-1 + e^-2 + e^0 + e^-3 = 1.5530 and LSE = 3 + log(1.5530).
    """
    q = np.ones((1, 1, 1, 1))                                   # d = 1, scale 1: S = K^T
    k = np.array([2.0, 1.0, 3.0, 0.0]).reshape(1, 1, 4, 1)
    v = np.array([10.0, 20.0, 30.0, 40.0]).reshape(1, 1, 4, 1)
    o, lse = ik.attention(q, k, v, scale=1.0, config=TileConfig(1, 2, order), return_lse=True)
    l_final = np.exp(-1) + np.exp(-2) + np.exp(0) + np.exp(-3)
    assert round(l_final, 4) == 1.5530
    assert lse[0, 0, 0] == pytest.approx(3 + np.log(l_final), abs=1e-15)
    w = np.exp(np.array([2.0, 1.0, 3.0, 0.0]) - 3) / l_final
    assert o[0, 0, 0, 0] == pytest.approx(w @ [10.0, 20.0, 30.0, 40.0], abs=1e-13)
