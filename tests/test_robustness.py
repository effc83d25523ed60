"""What a new user hits first: defaults that must work, inputs that could give a silent NaN,
and the traffic counter that labs score by (every path to an HBM array's bytes counts or
raises)."""
import copy
import pickle

import numpy as np
import pytest

import iokernels as ik
from iokernels.core import reference, testing, traffic
from iokernels.core.config import DEFAULT_SRAM_BYTES, TileConfig
from iokernels.core.traffic import HBM

DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (8, 59, 64, 128, 256)


# --------------------------------------------------------------------------- defaults fit
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_tiles_fit_every_dtype_and_head_dim(dtype, head_dim):
    cfg = TileConfig.default(head_dim, dtype)
    assert cfg.sram_usage(head_dim, dtype) <= DEFAULT_SRAM_BYTES
    cfg.check_fits(head_dim, dtype)
    if head_dim <= 64 and dtype != "float64":
        assert (cfg.block_q, cfg.block_k) == (64, 64)        # shrunk only where needed


@pytest.mark.parametrize("dtype,head_dim", [("float64", 128), ("float32", 256), ("float64", 256)])
def test_default_calls_run_where_64x64_does_not_fit(rng, dtype, head_dim):
    with pytest.raises(ValueError, match="config"):
        TileConfig(64, 64).check_fits(head_dim, dtype)           # the explicit config still raises
    q, k, v = testing.make_inputs(rng, heads_q=2, heads_kv=1, seqlen_q=37, seqlen_k=45,
                                  head_dim=head_dim, dtype=dtype)
    o, lse = ik.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True)
    base, _ = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    testing.assert_close(o, ref, base, dtype=dtype)
    if dtype == "float64":
        assert np.max(np.abs(o - ref)) < 1e-12 and np.max(np.abs(lse - ref_lse)) < 1e-12
    with traffic.count() as t:
        ik.attention(q, k, v, causal=True)
    m = traffic.model("fa2", batch=1, heads_q=2, heads_kv=1, seqlen_q=37, seqlen_k=45,
                      head_dim=head_dim, dtype=dtype, causal=True)
    assert t == m                                                # the model uses the same default tiles
    do = testing.make_inputs(rng, heads_q=2, heads_kv=1, seqlen_q=37, seqlen_k=45,
                             head_dim=head_dim, dtype=dtype)[0]
    dq, dk, dv = ik.attention_backward(do, q, k, v, o, lse, causal=True)
    assert all(np.all(np.isfinite(x.astype(np.float64))) for x in (dq, dk, dv))


def test_default_varlen_and_decode_at_float64_d128(rng):
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, [5, 0, 17], [9, 3, 20], heads_q=2, heads_kv=1,
                                                 head_dim=128, dtype="float64")
    o = ik.attention_varlen(q, k, v, cq, ck, causal=True)
    assert np.all(np.isfinite(o))
    qd = rng.standard_normal((2, 4, 128))
    kd, vd = rng.standard_normal((2, 2, 33, 128)), rng.standard_normal((2, 2, 33, 128))
    o, lse = ik.decode(qd, kd, vd, return_lse=True)
    ref, ref_lse = reference.decode(qd, kd, vd)
    assert np.max(np.abs(o - ref)) < 1e-12 and np.max(np.abs(lse - ref_lse)) < 1e-12


def test_decode_takes_a_config_like_attention(rng):
    qd = rng.standard_normal((2, 4, 24)).astype(np.float32)
    kd = rng.standard_normal((2, 2, 50, 24)).astype(np.float32)
    vd = rng.standard_normal((2, 2, 50, 24)).astype(np.float32)
    ref, _ = reference.decode(qd, kd, vd)
    for bc in (1, 7, 16, 64):
        o = ik.decode(qd, kd, vd, num_splits=3, config=TileConfig(block_q=1, block_k=bc))
        assert np.max(np.abs(o - ref)) < 1e-5
    with pytest.raises(ValueError, match="config"):
        ik.decode(qd, kd, vd, config="v3")
    with pytest.raises(ValueError, match="config"):
        ik.decode(qd, kd, vd, backend="naive", config=TileConfig())


# --------------------------------------------------------------------------- silent NaN
def test_merge_states_refuses_plus_inf_and_nan_lse(rng):
    o = rng.standard_normal((3, 4, 8))
    lse = rng.standard_normal((3, 4))
    for bad in (np.inf, np.nan):
        l2 = lse.copy()
        l2[1, 2] = bad
        with pytest.raises(ValueError, match="lse_parts"):
            ik.merge_states(o, l2)
    o2 = o.copy()
    o2[0, 1, 3] = np.nan
    with pytest.raises(ValueError, match="o_parts"):
        ik.merge_states(o2, lse)
    # a NaN in an empty part (LSE -inf) weighs nothing: allowed, and the result is finite
    l3 = lse.copy()
    l3[0, 1] = -np.inf
    out, out_lse = ik.merge_states(o2, l3)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(out_lse))


def test_merge_states_all_empty_gives_zero_and_minus_inf(rng):
    o = rng.standard_normal((2, 3, 5))
    out, lse = ik.merge_states(o, np.full((2, 3), -np.inf))
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("backend", ["naive", "tiled"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_finite_inputs_are_refused_by_name(rng, backend, name):
    arrays = dict(zip("qkv", testing.make_inputs(rng, seqlen_q=9, seqlen_k=11, head_dim=16)))
    arrays[name][0, 0, 3, 5] = np.nan if name != "v" else np.inf
    with pytest.raises(ValueError, match=rf"^{name}: .*non-finite"):
        ik.attention(arrays["q"], arrays["k"], arrays["v"], backend=backend)
    qd = rng.standard_normal((1, 2, 16))
    qd[0, 1, 2] = -np.inf
    with pytest.raises(ValueError, match="^q: "):
        ik.decode(qd, arrays["k"][:, :, :, :], arrays["k"], backend=backend)


def test_empty_sequences_and_zero_batches(rng):
    q, k, v = testing.make_inputs(rng, batch=2, seqlen_q=5, seqlen_k=7, head_dim=8)
    o, lse = ik.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)      # no keys at all
    assert o.shape == q.shape and np.all(o == 0) and np.all(np.isneginf(lse))
    o, lse = ik.attention(q[:0], k[:0], v[:0], return_lse=True)              # zero-size batch
    assert o.shape == (0,) + q.shape[1:] and lse.shape == (0, q.shape[1], q.shape[2])
    o, lse = ik.attention(q[:, :, :0], k, v, return_lse=True)                # no queries
    assert o.shape == (2, q.shape[1], 0, 8) and lse.shape == (2, q.shape[1], 0)
    qd = rng.standard_normal((3, 2, 8))
    kd, vd = rng.standard_normal((3, 1, 6, 8)), rng.standard_normal((3, 1, 6, 8))
    o, lse = ik.decode(qd, kd, vd, seq_lens=np.array([6, 0, 2]), return_lse=True)
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1])) and np.all(np.isfinite(o))


# --------------------------------------------------------------------------- the counter
def test_every_path_to_hbm_bytes_counts_or_raises(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    a = HBM(x, "X")
    with traffic.count() as t:
        tile = a[1:3]                                                         # counts
        rows = list(a)                                                        # counts, row by row
    assert t.as_dict() == {"X": (2 * 6 * 4 + 4 * 6 * 4, 0)}
    assert np.array_equal(tile, x[1:3]) and np.array_equal(np.stack(rows), x)
    for path in (lambda: np.asarray(a), lambda: np.array(a), lambda: a + 1, lambda: np.exp(a),
                 lambda: np.sum(a), lambda: np.shape(a), lambda: copy.copy(a), lambda: copy.deepcopy(a),
                 lambda: pickle.dumps(a)):
        with traffic.count() as t:
            with pytest.raises(TypeError, match="X"):
                path()
        assert t.total == 0
    assert not hasattr(a, "data")
    with pytest.raises(ValueError, match="X: result"):
        a.result()                                                            # inputs are read by tiles


def test_result_hands_an_output_back_once(rng):
    o = HBM.empty((2, 3), np.float32, "O")
    with traffic.count() as t:
        o[:] = 1.5
    assert t.as_dict() == {"O": (0, 24)}
    out = o.result()
    assert np.all(out == 1.5)
    for path in (lambda: o[0], lambda: o.__setitem__(0, 2.0), lambda: o.result(), lambda: o.shape):
        with pytest.raises(ValueError, match="O: .*handed back"):
            path()
    z = HBM.zeros((3,), np.float64, "Z")
    f = HBM.full((2,), -np.inf, np.float32, "F")
    assert np.all(z.result() == 0) and np.all(np.isneginf(f.result()))
