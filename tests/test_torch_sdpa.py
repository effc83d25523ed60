"""The torch SDPA backend against the float64 oracle, on CPU torch.

Covers bottom-right causal with Nq != Nk, windows, GQA, fully masked rows (0 / -inf,
never NaN), low precision by FlashAttention's 2x rule, decode with ragged lengths,
backward through autograd, forcing and detecting SDPA kernels, and the top-left vs
bottom-right demonstration.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import iokernels as ik
from iokernels import reference, testing
from iokernels import torch_sdpa as ts


def _masked_rows(lse_ref):
    return np.isneginf(lse_ref)[..., None]


@pytest.mark.parametrize("nq,nk,causal,window", [
    (37, 53, False, None),
    (37, 53, True, None),        # bottom-right: the last query sees every key
    (53, 37, True, None),        # Nq > Nk: the first 16 rows see nothing
    (41, 41, True, None),        # equal lengths: is_causal path
    (45, 61, False, (7, 3)),     # sliding window
    (61, 29, True, (4, -1)),     # causal + window, masked rows
])
def test_float64_matches_oracle(rng, nq, nk, causal, window):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk,
                                  head_dim=59, dtype="float64")
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="torch", return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, window=window)
    assert isinstance(o, np.ndarray) and o.dtype == np.float64 and lse.dtype == np.float64
    testing.assert_close(o, o_ref, name="O", masked_rows=_masked_rows(lse_ref))
    testing.assert_close(lse, lse_ref, name="LSE")
    if nq > nk and causal:
        assert np.isneginf(lse_ref).any()           # the case really has masked rows


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_low_precision_two_x_rule(rng, dtype):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=1, seqlen_q=33, seqlen_k=70,
                                  head_dim=111, dtype=dtype)
    o, lse = ik.attention(q, k, v, causal=True, backend="torch", return_lse=True)
    base_o, base_lse = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    assert str(o.dtype) == str(q.dtype) and lse.dtype == np.float32
    testing.assert_close(o, o_ref, base_o, name="O")
    testing.assert_close(lse, lse_ref, base_lse, name="LSE")


def test_bfloat16_torch_two_x_rule(rng):
    # NumPy has no bfloat16 here (ml_dtypes optional): bf16 goes in as torch tensors, and the
    # baseline is the naive algorithm in bf16 (torch ops, S and P stored in bf16).
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_k=57,
                                  head_dim=64, dtype="float32")
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    o, lse = ik.attention(tq, tk, tv, causal=True, backend="torch", return_lse=True)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    base = ts.naive_attention(tq, tk, tv, causal=True)
    o_ref, lse_ref = reference.attention(tq, tk, tv, causal=True)
    testing.assert_close(o, o_ref, base, dtype="bfloat16", name="O")
    # the LSE is computed in float32 from the bf16 inputs: only float32 rounding remains
    assert np.max(np.abs(lse.numpy() - lse_ref)) < 1e-5 * np.max(np.abs(lse_ref))


@pytest.mark.parametrize("config", ["math", "flash"])
def test_forced_cpu_kernels_match(rng, config):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=29, seqlen_k=47, head_dim=24)
    o, lse = ik.attention(q, k, v, causal=True, backend="torch", config=config, return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    testing.assert_close(o, o_ref, name=f"O[{config}]")
    testing.assert_close(lse, lse_ref, name=f"LSE[{config}]")


def test_fully_masked_rows_are_zero_not_nan(rng):
    # window (0, -1) with causal: row i sees only key i + Nk - Nq; Nq > Nk hides early rows
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=20, seqlen_k=9, head_dim=16)
    for config in (None, "math"):
        o, lse = ik.attention(q, k, v, causal=True, backend="torch", config=config, return_lse=True)
        assert not np.isnan(o).any() and not np.isnan(lse).any()
        assert np.all(o[:, :, :11] == 0) and np.all(np.isneginf(lse[:, :, :11]))
        assert np.all(np.isfinite(lse[:, :, 11:]))


def test_torch_in_torch_out(rng):
    q, k, v = (torch.from_numpy(x) for x in testing.make_inputs(rng, heads_q=4, heads_kv=2,
                                                                 seqlen_q=17, seqlen_k=23, head_dim=8))
    o, lse = ik.attention(q, k, v, causal=True, backend="torch", return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    testing.assert_close(o, o_ref)
    testing.assert_close(lse, lse_ref)


def test_bad_config_names_the_argument(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=8, head_dim=8)
    with pytest.raises(ValueError, match="config"):
        ik.attention(q, k, v, backend="torch", config="flash3")


def test_forced_unavailable_kernel_raises_instead_of_falling_back(rng):
    # On a CPU there is no efficient / cuDNN kernel: forced alone, SDPA must refuse.
    q, k, v = (torch.from_numpy(x) for x in testing.make_inputs(rng, seqlen_q=16, head_dim=8,
                                                                 dtype="float32"))
    # (CPU tensors: the same answer whether or not the machine has a GPU)
    status = ts.backend_status(q, k, v, causal=True)
    assert status["math"] == "ok"
    assert status["efficient"].startswith("unavailable")
    assert status["cudnn"].startswith("unavailable")
    assert status["default"] in ("flash", "math")
    with pytest.raises(RuntimeError):
        with ts.force("efficient"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_backend_that_ran_sees_the_forced_kernel(rng):
    q, k, v = (torch.from_numpy(x) for x in testing.make_inputs(rng, seqlen_q=16, head_dim=8,
                                                                 dtype="float32"))
    _, ran = ts.backend_that_ran(ts.sdpa, q, k, v, backend="math")
    assert ran == ["math"]
    # a list of allowed kernels lets the dispatcher fall back; the profiler shows where
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        _, ran = ts.backend_that_ran(torch.nn.functional.scaled_dot_product_attention, q, k, v)
    assert ran == ["math"]          # CPU tensors: no efficient kernel, so math ran, silently


def test_top_left_vs_bottom_right_demo():
    demo = ts.causal_alignment_demo(seqlen_q=3, seqlen_k=7)
    tl, br = demo["top_left_mask"], demo["bottom_right_mask"]
    assert tl.sum() == 1 + 2 + 3 and br.sum() == 5 + 6 + 7
    assert br[-1].all() and not tl[-1].all()
    assert demo["is_causal_is_top_left"]
    assert demo["max_difference"] > 1e-3
    ref, _ = reference.attention(demo["q"], demo["k"], demo["v"], causal=True)
    np.testing.assert_allclose(demo["bottom_right"], ref, atol=1e-12)


def test_decode_ragged_gqa(rng):
    q4, k, v = testing.make_inputs(rng, batch=4, heads_q=8, heads_kv=2, seqlen_q=1, seqlen_k=45,
                                   head_dim=40)
    q = q4[:, :, 0]
    lens = np.array([45, 0, 17, 1])
    o, lse = ik.decode(q, k, v, seq_lens=lens, backend="torch", return_lse=True)
    o_ref, lse_ref = reference.decode(q, k, v, seq_lens=lens)
    testing.assert_close(o, o_ref, name="O", masked_rows=_masked_rows(lse_ref))
    testing.assert_close(lse, lse_ref, name="LSE")
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))


@pytest.mark.parametrize("nq,nk,causal,window", [(23, 31, True, None), (31, 12, True, None),
                                                 (19, 26, False, (3, 5))])
def test_backward_matches_oracle(rng, nq, nk, causal, window):
    q, k, v, do = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk,
                                      head_dim=12, with_grad=True)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="torch", return_lse=True)
    dq, dk, dv = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window,
                                       backend="torch")
    rq, rk, rv = reference.attention_backward(do, q, k, v, causal=causal, window=window)
    for name, got, ref in (("dQ", dq, rq), ("dK", dk, rk), ("dV", dv, rv)):
        assert not np.isnan(got).any(), name
        testing.assert_close(got, ref, name=name)


def test_naive_torch_matches_oracle(rng):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=30, seqlen_k=21,
                                  head_dim=16)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    o = ts.naive_attention(tq, tk, tv, causal=True)
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    testing.assert_close(o, o_ref, masked_rows=_masked_rows(lse_ref))
