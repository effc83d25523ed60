"""The Triton kernels compiled for a CUDA GPU, at sizes the interpreter cannot reach.

The same oracle and the same 2x rule as tests/test_conformance.py, at the shapes a model
runs (head dims 64 and 128, thousands of keys), every dtype the kernels take, through torch
CUDA tensors (no copies); the oracle runs one head at a time in float64 on the host.
Skipped without a CUDA GPU (the interpreter runs tests/test_triton.py instead).
"""
from __future__ import annotations

import numpy as np
import pytest

import iokernels as ik
from iokernels.core import testing
from iokernels.triton_backend import REGISTRY, DecodeConfig, ForwardConfig, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(launch.unavailable() is not None or not launch.cuda_gpu()
                                 or launch.interpreting(), reason="needs triton and a CUDA GPU")]


def _cuda(x):
    import torch
    return launch.to_torch(x, "x") if torch.cuda.is_available() else None


@pytest.mark.parametrize("version", REGISTRY.versions("attention"))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 300, 2085, 64), (1, 6, 3, 129, 77, 96)],
                         ids=["gqa4-d128", "nq<nk-d64", "nq>nk-d96"])
def test_forward_at_model_sizes(version, dtype, shape, rng):
    B, Hq, Hkv, Nq, Nk, d = shape
    q, k, v, do = testing.make_inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype="float64", with_grad=True)
    dt = testing.numpy_dtype(dtype)
    q, k, v, do = (x.astype(dt) for x in (q, k, v, do))
    for causal, window in ((False, None), (True, None), (True, (200, 0))):
        ref, ref_lse = testing.oracle_by_head(do, q, k, v, causal=causal, window=window)[:2]
        o, lse = ik.attention(_cuda(q), _cuda(k), _cuda(v), causal=causal, window=window, backend="triton",
                              config=ForwardConfig(version=version), return_lse=True)
        base, base_lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
        masked = np.isneginf(ref_lse)[..., None]
        testing.assert_close(o, ref, base, dtype=dtype, masked_rows=masked, name=f"{version} O {dtype} {shape}")
        testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=1e-4, name=f"{version} LSE {dtype}")


@pytest.mark.parametrize("version", REGISTRY.versions("decode"))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_at_serving_sizes(dtype, num_splits, version, rng):
    from iokernels.core import reference
    B, Hq, Hkv, N, d = 16, 32, 8, 3000, 128
    dt = testing.numpy_dtype(dtype)
    q = rng.standard_normal((B, Hq, d)).astype(dt)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(dt) for _ in range(2))
    lens = rng.integers(0, N + 1, B).astype(np.int32)
    lens[:2] = (N, 0)
    for window in (None, (511, 0)):
        o, lse = ik.decode(_cuda(q), _cuda(k), _cuda(v), seq_lens=lens, num_splits=num_splits, window=window,
                           backend="triton", return_lse=True, config=DecodeConfig(version=version))
        ref, ref_lse = reference.decode(q, k, v, seq_lens=lens, window=window)
        base = ik.decode(q, k, v, seq_lens=lens, window=window, backend="naive")
        testing.assert_close(o, ref, base, dtype=dtype, masked_rows=(lens == 0)[:, None, None], name=f"decode {dtype}")
        assert np.all(np.isneginf(testing.as_numpy(lse)[1]))


@pytest.mark.parametrize("version", REGISTRY.versions("paged_decode"))
def test_paged_decode_pools_on_the_gpu(version, rng):
    import torch
    from iokernels.core import reference
    from iokernels.triton_backend import paged_decode_pools
    B, Hq, Hkv, d, page, blocks = 8, 16, 4, 128, 16, 600
    lens = rng.integers(1, 1000, B).astype(np.int32)
    per = -(-lens // page)
    perm = rng.permutation(blocks)[:int(per.sum())]
    tables = np.full((B, int(per.max())), -1, np.int32)
    at = 0
    for b in range(B):
        tables[b, :per[b]] = perm[at:at + per[b]]
        at += per[b]
    k_pool, v_pool = (rng.standard_normal((blocks, page, Hkv, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((B, Hq, d)).astype(np.float16)
    o, lse = paged_decode_pools(_cuda(q), _cuda(k_pool), _cuda(v_pool), torch.from_numpy(tables).cuda(),
                                torch.from_numpy(lens).cuda(), config=DecodeConfig(version=version))
    n = int(lens.max())
    idx = np.clip(tables, 0, None)
    kk, vv = (pool[idx].reshape(B, -1, Hkv, d)[:, :n].transpose(0, 2, 1, 3) for pool in (k_pool, v_pool))
    ref, _ = reference.decode(q, kk, vv, seq_lens=lens)
    base = ik.decode(q, kk, vv, seq_lens=lens, backend="naive")
    testing.assert_close(o, ref, base, dtype="float16", name="paged decode pools")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_backward_at_model_sizes(dtype, deterministic, rng):
    from iokernels.triton_backend import BackwardConfig
    B, Hq, Hkv, Nq, Nk, d = 1, 4, 2, 500, 700, 128
    q, k, v, do = testing.make_inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype=dtype, with_grad=True)
    cfg = BackwardConfig(deterministic=deterministic)
    for causal in (False, True):
        _, _, rq, rk, rv = testing.oracle_by_head(do, q, k, v, causal=causal)
        o, lse = ik.attention(q, k, v, causal=causal, backend="tiled", return_lse=True)
        grads = ik.attention_backward(*(_cuda(x) for x in (do, q, k, v, o)), _cuda(lse), causal=causal,
                                      backend="triton", config=cfg)
        bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend="naive")
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, (rq, rk, rv), bases):
            testing.assert_close(g, r, b, dtype=dtype, factor=testing.GRADIENT_FACTOR, name=f"{name} {dtype}")
        if deterministic:                       # the same bits on a second run
            again = ik.attention_backward(*(_cuda(x) for x in (do, q, k, v, o)), _cuda(lse), causal=causal,
                                          backend="triton", config=cfg)
            assert all(bool((a == g).all()) for a, g in zip(again, grads))
