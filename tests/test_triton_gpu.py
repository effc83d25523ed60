"""The Triton kernels compiled for a CUDA GPU, at sizes the interpreter cannot reach.

The same oracle and the same 2x rule as tests/test_conformance.py, at the shapes a model
runs (head dims 64 and 128, thousands of keys), every dtype the kernels take, through torch
CUDA tensors (no copies); the oracle runs one head at a time in float64 on the host.  Each op is
also captured in a CUDA graph and replayed after its inputs change in place.
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


def _captured(run):
    """(a CUDA graph of ``run()``, its output): warmed up on a side stream first (Triton compiles
    on its first launch), then captured."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


@pytest.mark.parametrize("version", REGISTRY.versions("decode"))
def test_decode_replays_under_a_cuda_graph(version, rng):
    """With the lengths (and a paged call's block tables) on the device, a decode makes no host
    synchronisation and no host copy: torch.cuda.graph captures ik.decode and paged_decode_pools,
    and each replay after q, the lengths and the tables change in place gives the eager call's
    bits (the same split count: both plan for the cache's capacity)."""
    import torch
    from iokernels.triton_backend import paged_decode_pools
    B, Hq, Hkv, N, d, page = 6, 32, 8, 1024, 128, 16         # the paged capacity is N too: the same splits
    cfg = DecodeConfig(version=version)
    q = torch.randn((B, Hq, d), device="cuda", dtype=torch.float16)
    k, v = (torch.randn((B, Hkv, N, d), device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    graph, out = _captured(lambda: ik.decode(q, k, v, seq_lens=lens, backend="triton", config=cfg))
    per = N // page
    kp, vp = (x.view(B, Hkv, per, page, d).permute(0, 2, 3, 1, 4).reshape(B * per, page, Hkv, d).contiguous()
              for x in (k, v))
    tables = torch.arange(B * per, device="cuda", dtype=torch.int32).view(B, per)
    pgraph, pout = _captured(lambda: paged_decode_pools(q, kp, vp, tables, lens, config=cfg)[0])
    for new in ([N, 0, 7, N - 1, 500, 64], [3, N, N, 0, 1, 256]):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ik.decode(q, k, v, seq_lens=lens, backend="triton", config=cfg)), new
        order = torch.from_numpy(rng.permutation(B * per).astype(np.int32)).cuda()
        moved_k, moved_v = torch.empty_like(kp), torch.empty_like(vp)
        moved_k[order.long()], moved_v[order.long()] = kp.clone(), vp.clone()
        kp.copy_(moved_k)
        vp.copy_(moved_v)
        tables.copy_(order[tables.long()])                # the blocks moved, the tables follow in place
        pgraph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(pout.float(), out.float(), rtol=1e-2, atol=2e-3), new   # the keys, through moved blocks
        assert torch.equal(pout, paged_decode_pools(q, kp, vp, tables, lens, config=cfg)[0]), new
    with pytest.raises(ValueError, match="seq_lens: a CUDA graph reads it"):      # host values: refused, not baked in
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ik.decode(q, k, v, seq_lens=np.full(B, N, np.int32), backend="triton", config=cfg)
    host_tables = tables.cpu().numpy()                   # copied out before the capture: a copy there is refused
    with pytest.raises(ValueError, match="block_tables: a CUDA graph reads it"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            paged_decode_pools(q, kp, vp, host_tables, lens, config=cfg)


@pytest.mark.parametrize("version", REGISTRY.versions("attention"))
def test_attention_and_its_backward_replay_under_a_cuda_graph(version):
    """The forward and the (deterministic) backward make no host synchronisation either: captured
    after a warm-up (which autotunes v2's tile), a replay after q or dO changes in place gives
    the eager call's bits."""
    import torch
    from iokernels.triton_backend import BackwardConfig
    B, Hq, Hkv, N, d = 2, 8, 2, 1000, 128
    q = torch.randn((B, Hq, N, d), device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn((B, Hkv, N, d), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cfg = ForwardConfig(version=version)

    def forward():
        return ik.attention(q, k, v, causal=True, backend="triton", config=cfg, return_lse=True)
    graph, out = _captured(forward)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    o, lse = forward()
    assert torch.equal(out[0], o) and torch.equal(out[1], lse)
    do = torch.randn_like(q)

    def backward():
        return ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="triton",
                                     config=BackwardConfig(deterministic=True))
    bgraph, grads = _captured(backward)
    do.copy_(torch.randn_like(do))
    bgraph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(grads, backward()))


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
