"""The Triton backend on a CPU: its kernels on Triton's interpreter, its configs, its refusals.

tests/test_conformance.py holds every registered Triton version to the float64 oracle at
one awkward shape; this file adds the cases a Triton kernel gets wrong first: GQA groups
other than 2, head dims that are not a power of two (padded tiles), fully masked rows
(Nq > Nk under the bottom-right causal mask), windows, explicit tile configs, torch tensors
in and out, strided inputs, and the calls it must refuse.  Shapes are small: the interpreter
runs every program of the grid in NumPy.  Without triton every kernel test skips with the
reason; the refusal tests run anyway.
"""
from __future__ import annotations

import numpy as np
import pytest

import iokernels as ik
from iokernels.core import reference, testing
from iokernels.triton_backend import REGISTRY, BackwardConfig, DecodeConfig, ForwardConfig, launch

WHY = launch.unavailable()
needs_triton = pytest.mark.skipif(WHY is not None, reason=WHY or "")
FORWARD = REGISTRY.versions("attention")


def _check_forward(q, k, v, out, dtype, causal=False, window=None):
    o, lse = out
    ref, ref_lse = reference.attention(q, k, v, causal=causal, window=window)
    base, base_lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    masked = np.isneginf(ref_lse)[..., None]
    testing.assert_close(o, ref, base, dtype=dtype, masked_rows=masked, name=f"O {dtype}")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=1e-4, name=f"LSE {dtype}")
    return masked


# --------------------------------------------------------------------------- configs and refusals
@pytest.mark.parametrize("kw,field", [(dict(block_q=24, block_k=16), "block_q"),
                                      (dict(block_q=8, block_k=8), "block_q"), (dict(block_q=32), "block_q"),
                                      (dict(version="v9"), "version"), (dict(num_warps=3), "num_warps"),
                                      (dict(block_q=32, block_k=True), "block_k")])
def test_forward_config_refuses_bad_fields_by_name(kw, field):
    with pytest.raises(ValueError, match=rf"config\.{field}"):
        ForwardConfig(**kw)


def test_decode_and_backward_configs_refuse_bad_fields_by_name():
    with pytest.raises(ValueError, match=r"config\.block_n"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match=r"config\.deterministic"):
        BackwardConfig(deterministic=1)
    with pytest.raises(ValueError, match=r"config\.version"):
        BackwardConfig(version="v2")


def test_without_triton_every_call_says_what_to_install(monkeypatch, rng):
    monkeypatch.setattr(launch, "triton_installed", lambda: False)
    q, k, v = testing.make_inputs(rng, seqlen_q=4, head_dim=16, dtype="float16")
    with pytest.raises(ValueError, match=r"iokernels\[triton\]"):
        ik.attention(q, k, v, backend="triton")
    for r in REGISTRY:                                 # each record gives the same reason
        assert "pip install" in r.unavailable(launch_need(r.op, q, k, v))


def launch_need(op, q, k, v):
    from iokernels.triton_backend import need
    return need(op, q=q, k=k, v=v)


@needs_triton
def test_float64_is_refused_with_the_backends_that_run_it(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=4, head_dim=16, dtype="float64")
    with pytest.raises(ValueError, match="float64 runs on the numba and cupy"):
        ik.attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="head_dim 300"):
        q, k, v = testing.make_inputs(rng, seqlen_q=2, head_dim=300, dtype="float16")
        ik.attention(q, k, v, backend="triton")


# --------------------------------------------------------------------------- forward
@needs_triton
@pytest.mark.parametrize("version", FORWARD)
@pytest.mark.parametrize("case", ["gqa3-d40", "masked-rows", "window-left", "window-long-k"])
def test_forward_matches_the_oracle(version, case, rng):
    shape = dict(batch=1, heads_q=3, heads_kv=1, seqlen_q=18, seqlen_k=29, head_dim=40)
    causal, window = False, None
    if case == "masked-rows":                         # Nq > Nk: the first Nq - Nk rows see no key
        shape.update(heads_q=2, seqlen_q=25, seqlen_k=7, head_dim=16)
        causal = True
    elif case == "window-left":
        shape.update(heads_q=2, head_dim=32)
        window = (5, -1)
    elif case == "window-long-k":
        shape.update(heads_q=2, seqlen_q=5, seqlen_k=70, head_dim=16)
        causal, window = True, (9, 0)
    for dtype in ("float16", "float32"):
        q, k, v = testing.make_inputs(rng, dtype=dtype, **shape)
        out = ik.attention(q, k, v, causal=causal, window=window, backend="triton",
                           config=ForwardConfig(version=version), return_lse=True)
        masked = _check_forward(q, k, v, out, dtype, causal, window)
        assert masked.any() == (case == "masked-rows")


@needs_triton
@pytest.mark.parametrize("version", FORWARD)
def test_forward_with_an_explicit_tile(version, rng):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, seqlen_q=40, seqlen_k=33, head_dim=16, dtype="bfloat16")
    cfg = ForwardConfig(version=version, block_q=32, block_k=16)
    out = ik.attention(q, k, v, causal=True, backend="triton", config=cfg, return_lse=True)
    _check_forward(q, k, v, out, "bfloat16", causal=True)


@needs_triton
def test_no_keys_gives_zero_and_minus_infinity(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=5, seqlen_k=0, head_dim=16, dtype="float16")
    o, lse = ik.attention(q, k, v, backend="triton", return_lse=True)
    assert o.dtype == q.dtype and np.all(o == 0) and np.all(np.isneginf(lse))


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_torch_tensors_in_torch_tensors_out_strided_too(rng):
    import torch
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=9, seqlen_k=12, head_dim=16, dtype="float32")
    # (B, N, H, d) storage viewed as (B, H, N, d): strided along every axis but the last
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(1, 2)
                  for x in (q, k, v))
    assert not qt.is_contiguous()
    o, lse = ik.attention(qt, kt, vt, causal=True, backend="triton", return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32 and lse.shape == (1, 2, 9)
    _check_forward(q, k, v, (o.numpy(), lse.numpy()), "float32", causal=True)
