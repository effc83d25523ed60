"""The serving engine on a GPU: the KV pools on the device (iokernels.serving.device).

Paged and contiguous serve the tiny Llama on "cuda" with the same tokens as each other and
as the NumPy memories on the host (float64); every step's logits in bfloat16 and float16
are within FlashAttention's 2x rule of the float64 oracle (the same rounded weights); a
short ``serve-bench --device cuda`` writes its JSON.  The CuPy kernels over device pools
(the paged decode for one-query chunks, the paged prefill for the others) are tried where
``iokernels.cupy_raw.calls`` has both.
Skipped without torch CUDA.
"""
import json

import numpy as np
import pytest

from iokernels import gpu
from iokernels.__main__ import main as cli
from iokernels.core.testing import check
from iokernels.serving import Engine, PagedMemory, Request, pool_invariants

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.torch_gpu(), reason="needs torch CUDA")]

from iokernels.serving.device import (DeviceContiguousMemory, DevicePagedMemory, cupy_paged_decode,  # noqa: E402
                                      cupy_paged_prefill)
from iokernels.serving.llama import TINY, Llama, LlamaShape  # noqa: E402

from test_serving_device import low_precision_requests, step_logits_against_reference  # noqa: E402

DEV = "cuda"
#: head dim 64, a size the tensor-core kernels take
SMALL = LlamaShape("small", vocab=512, dim=256, layers=2, heads=4, kv_heads=2, ffn_dim=512)


def _serve(model, memory, reqs, token_budget=12):
    def check_books(engine):
        if hasattr(memory, "cache"):
            assert not pool_invariants(memory.cache)

    engine = Engine(model, memory, token_budget=token_budget, step_time=1.0, check=check_books)
    for r in reqs:
        engine.submit(r)
    return engine.run()


def test_tiny_paged_and_contiguous_on_cuda_give_the_host_tokens():
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, TINY.vocab, int(n)).tolist(), 7, arrival=0.5 * i,
                    n=2 if n < 20 and i % 2 else 1, temperature=0.7 if i % 2 else 0.0)
            for i, n in enumerate([3, 17, 9, 26, 5, 12])]
    gpu_model, cpu_model = Llama(TINY, seed=3, device=DEV), Llama(TINY, seed=3)
    ms = gpu_model.memory_shape()
    paged = _serve(gpu_model, DevicePagedMemory(14, 4, device=DEV, **ms), reqs)
    contiguous = _serve(gpu_model, DeviceContiguousMemory(96, block_size=4, device=DEV, **ms), reqs)
    host = _serve(cpu_model, PagedMemory(14, 4, **ms), reqs)
    assert paged.preemptions
    assert paged.outputs == contiguous.outputs == host.outputs


@pytest.mark.parametrize("backend", ["torch", "cupy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_step_logits_on_cuda_within_the_2x_rule(dtype, backend):
    if backend == "cupy" and (cupy_paged_prefill() is None or cupy_paged_decode() is None):
        pytest.skip("iokernels.cupy_raw.calls has no paged_prefill_pools or paged_decode_pools here")
    model = Llama(SMALL, seed=4, dtype=dtype, device=DEV)
    ms = model.memory_shape()
    reqs = [Request(r.rid, [t % SMALL.vocab for t in r.prompt] * 3, r.max_new_tokens, arrival=r.arrival)
            for r in low_precision_requests()]
    for mem in (DevicePagedMemory(24, 16, device=DEV, backend=backend, **ms),
                DeviceContiguousMemory(384, block_size=16, device=DEV, backend=backend, **ms)):
        assert mem.k_pools.device.type == "cuda"
        got, ref, base = step_logits_against_reference(model, mem, reqs, token_budget=40)
        c = check(got, ref, base, dtype=str(dtype).replace("torch.", ""), name=f"{type(mem).__name__} {backend}")
        assert c.ok, str(c)


def test_serve_bench_tiny_on_cuda(tmp_path):
    out = tmp_path / "serve.json"
    rc = cli(["serve-bench", "--model", "tiny", "--device", "cuda", "--requests", "10", "--kv-slots", "512",
              "--step-time", "0.01", "--quiet", "--json", str(out)])        # the schedule of the CPU test
    res = json.loads(out.read_text())
    assert rc == 0 and res["tokens_equal"] is True and res["device"] == "cuda"
    assert res["setup"]["pools"] == "torch" and res["setup"]["gpu"]
    assert res["kv_budget_gb"] == pytest.approx(512 * 2 * 2 * 2 * 16 * 8 / 1e9)
    for side in ("paged", "contiguous"):
        assert {"max_concurrent", "tokens_per_s", "waste_fraction", "p50_ms", "p99_ms"} <= set(res[side])
        assert res[side]["tokens_per_s"] > 0
    assert res["paged"]["max_concurrent"] >= 2 * res["contiguous"]["max_concurrent"]


def test_serve_bench_llama3_8b_shape_builds_on_cuda_at_a_gb_budget(tmp_path):
    """bfloat16 weights on the device, a KV budget in GB; low precision: the tokens are reported, not asserted."""
    out = tmp_path / "serve.json"
    rc = cli(["serve-bench", "--model", "llama3-8b-shape", "--device", "cuda", "--requests", "6",
              "--kv-budget-gb", "1", "--quiet", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["setup"]["dtype"] == "bfloat16" and res["kv_budget_gb"] <= 1.0
    assert res["setup"]["kv_slots"] == int(1e9 // (2 * 2 * 8 * 128 * 2)) // 16 * 16
    assert 0.0 <= res["requests_equal_fraction"] <= 1.0
    assert res["paged"]["output_tokens"] == res["contiguous"]["output_tokens"] > 0


@pytest.mark.parametrize("memory", ["paged", "contiguous"])
def test_a_layer_stores_and_attends_without_touching_the_host(memory):
    """After the step's one upload, write_attend (store, gather, SDPA) runs with no host synchronization:
    torch's sync debug mode "error" raises at any device-to-host copy or pageable upload."""
    model = Llama(SMALL, seed=1, dtype=torch.bfloat16, device=DEV)
    ms = model.memory_shape()
    mem = (DevicePagedMemory(16, 16, device=DEV, **ms) if memory == "paged"
           else DeviceContiguousMemory(256, block_size=16, device=DEV, **ms))
    from iokernels.serving.requests import Group
    groups = [Group(Request(i, list(range(1, n + 1)), 4), i) for i, n in enumerate([20, 1, 33])]
    for g in groups:
        assert mem.admit(g)
        mem.start(g.seqs[0])
    seqs = [g.seqs[0] for g in groups]
    g = torch.Generator(device=DEV).manual_seed(0)

    def qkv(n):
        return (torch.randn(n, h, SMALL.head_dim, device=DEV, generator=g).to(torch.bfloat16)
                for h in (SMALL.heads, SMALL.kv_heads, SMALL.kv_heads))

    plan = mem.prepare(seqs, [20, 1, 33], [list(range(1, n + 1)) for n in (20, 1, 33)])
    mem.write_attend(0, plan, *qkv(54))                                   # the prompts, layer 0
    for s, n in zip(seqs, (20, 1, 33)):
        s.computed = n
    plan = mem.prepare(seqs, [1, 1, 5], [[7], [7], [7] * 5])          # two decodes and a chunk
    q, k, v = qkv(7)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o = mem.write_attend(0, plan, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert o.shape == q.shape and bool(torch.isfinite(o).all())
