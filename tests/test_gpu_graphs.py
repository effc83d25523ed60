"""Every GPU op of the CuPy backend captured in a CUDA graph replays bit for bit like eager calls.

For attention, decode, paged decode, paged prefill, paged gather, the backward and MLA decode
(each through its plan in :data:`iokernels.cupy_raw.PLANS` where it has one; the paged
prefill, gather, backward and MLA tests assert that their plan was the one captured, and pinned): the call is
warmed up on a side stream (what ``torch.cuda.graph`` asks for: plans, compiled kernels and
workspaces exist before capture), captured under ``torch.cuda.graph``, then the inputs are
rewritten in place and the graph replayed; its outputs must equal, bit for bit, an eager
call on the same inputs.  Paged decode and the gather read block tables that are rewritten
in place between replays (as vLLM's decode steps do); the paged prefill its tables, lengths
and chunk offsets.  The captured calls run with torch's sync debug mode set to "error": a
call that synchronized the host would raise.  Skipped without torch CUDA and CuPy.
"""
import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import cupy_raw as cr
from iokernels import gpu

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (gpu.cupy_gpu() and gpu.torch_gpu()), reason="needs CuPy and torch CUDA")]
mla = importlib.import_module("iokernels.cupy_raw.mla")
paged_prefill = importlib.import_module("iokernels.cupy_raw.paged_prefill")
DEV = "cuda"


#: the paged prefill versions a PagedPrefillPlan runs: every registered one (each named by its config class)
PLANNED_PREFILL = list(cr.REGISTRY.versions("paged_prefill"))


def prefill_version(version, q, k_pool, v_pool):
    """(config naming ``version``, its eager pools call), or a skip saying why this GPU cannot run
    it (the Hopper v3 off compute capability 9.0)."""
    rec = cr.REGISTRY.get("paged_prefill", version)
    why = rec.unavailable(cr.need("paged_prefill", q=q, k=k_pool, v=v_pool))
    if why is not None:
        pytest.skip(f"paged prefill {version}: {why}")
    config = rec.config_class(version=version)
    v3 = cr.hopper_paged_prefill
    return config, v3.paged_prefill_pools if v3.names_v3(config) else paged_prefill.paged_prefill_pools


def capture(fn, warmup: int = 2):
    """(graph, the outputs its replays write) of ``fn``, warmed up on a side stream first and
    captured on it (so the plans' workspaces for that stream exist before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(g, stream=side):
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return g, out


def replay_equals_eager(fn, refill, rounds: int = 2):
    """Capture ``fn``, then ``rounds`` times: ``refill()`` rewrites the inputs in place, the graph
    replays, and its outputs equal an eager ``fn()`` bit for bit."""
    g, out = capture(fn)
    for r in range(rounds):
        refill(r)
        g.replay()
        want = fn()
        torch.cuda.synchronize()
        for got, ref in zip(out, want):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got, ref), f"round {r}: the replay differs from the eager call"


def planned(cls) -> bool:
    """Whether the captured call went through a plan of class ``cls`` (cached, and pinned by the capture)."""
    return any(isinstance(p, cls) and p.pinned for p in cr.PLANS._plans.values())


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def _refill(*tensors):
    def refill(r):
        gen = torch.Generator(device=DEV).manual_seed(100 + r)
        for t in tensors:
            t.copy_(torch.randn(t.shape, device=DEV, generator=gen, dtype=torch.float32).to(t.dtype))
    return refill


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_replays_like_eager(dtype, causal):
    q, k, v = randn(2, 8, 300, 64, dtype=dtype), randn(2, 4, 300, 64, dtype=dtype), randn(2, 4, 300, 64, dtype=dtype)
    replay_equals_eager(lambda: ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True),
                        _refill(q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_at_head_dim_256_replays_like_eager(causal):
    """Head dim 256 takes the Hopper forward's own tiles there (on Hopper the default at 333 keys is
    v9, the persistent kernel, with v8's 80-key tiles in two stages, K and V released apart);
    elsewhere the portable kernel."""
    q, k, v = (randn(1, 4, 333, 256, dtype=torch.bfloat16), randn(1, 2, 333, 256, dtype=torch.bfloat16),
               randn(1, 2, 333, 256, dtype=torch.bfloat16))
    replay_equals_eager(lambda: ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True),
                        _refill(q, k, v))


@pytest.mark.skipif(not gpu.cupy_gpu() or cr.hopper.available() is not None, reason="attention v10 needs Hopper")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_v10_replays_like_eager(causal):
    """Attention v10 (held back; three consumer warpgroups, head_dim 64), named by its config,
    captured and replayed like eager with the inputs rewritten in place."""
    q, k, v = (randn(2, 8, 777, 64, dtype=torch.bfloat16), randn(2, 2, 777, 64, dtype=torch.bfloat16),
               randn(2, 2, 777, 64, dtype=torch.bfloat16))
    cfg = cr.hopper.HopperConfig(version="v10")
    replay_equals_eager(lambda: ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True, config=cfg),
                        _refill(q, k, v))


@pytest.mark.parametrize("config", [None, cr.DecodeConfig("v1"), cr.DecodeConfig("v3"),
                                    cr.DecodeConfig("v3", fused=False)])
def test_decode_replays_like_eager(config):
    q, k, v = randn(4, 32, 128), randn(4, 8, 3000, 128), randn(4, 8, 3000, 128)
    lens = torch.tensor([3000, 17, 0, 1500], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q, k, v)(r)
        lens.copy_(torch.tensor([[5, 3000, 2999, 1], [0, 64, 3000, 700]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: ik.decode(q, k, v, seq_lens=lens, backend="cupy", return_lse=True, config=config),
                        refill)


@pytest.mark.parametrize("config", [None, cr.DecodeConfig("v7"), cr.DecodeConfig("v7", fused=False)])
def test_large_float32_group_decode_replays_like_eager(config):
    """float32 multi-query decode, 64 query heads a KV head: the default (decode v7, the group split
    over 4 blocks a KV head) and v7 with the separate combine, captured, replay like eager with
    the inputs and lengths rewritten in place."""
    q, k, v = (randn(3, 64, 128, dtype=torch.float32), randn(3, 1, 2000, 128, dtype=torch.float32),
               randn(3, 1, 2000, 128, dtype=torch.float32))
    lens = torch.tensor([2000, 9, 0], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q, k, v)(r)
        lens.copy_(torch.tensor([[0, 2000, 1999], [640, 1, 2000]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: ik.decode(q, k, v, seq_lens=lens, backend="cupy", return_lse=True, config=config),
                        refill)


def test_paged_decode_replays_like_eager_with_tables_changed_in_place():
    B, Hq, Hkv, d, bs, per = 3, 16, 4, 128, 16, 12
    nb = B * per + 5
    q, kp, vp = randn(B, Hq, d), randn(nb, bs, Hkv, d), randn(nb, bs, Hkv, d)
    rng = np.random.default_rng(0)
    tables = torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32)
    lens = torch.tensor([per * bs, 100, 1], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q)(r)
        tables.copy_(torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32))
        lens.copy_(torch.tensor([[7, per * bs, 33], [per * bs - 1, 0, 150]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: cr.paged_decode_pools(q, kp, vp, tables, lens), refill)


@pytest.mark.parametrize("config", [None, cr.DecodeConfig("v3")])
@pytest.mark.parametrize("scale_heads", [4, 1])
def test_quantized_paged_decode_replays_like_eager_with_tables_and_scales_changed_in_place(config, scale_heads):
    """A float8 cache (codes in uint8, float32 scales per block and KV head, or per block): the
    plan reads the scales in place, so rewriting them between replays is seen as a table is."""
    B, Hq, Hkv, d, bs, per = 3, 16, 4, 128, 16, 12
    nb = B * per + 5
    q = randn(B, Hq, d)
    codes = [torch.randint(0, 0x78, (nb, bs, Hkv, d), device=DEV, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.rand(nb, scale_heads, device=DEV) * 0.1 + 0.01 for _ in range(2)]
    quant = dict(kv="float8_e4m3fn", k_scale=scales[0], v_scale=scales[1])
    rng = np.random.default_rng(3)
    tables = torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32)
    lens = torch.tensor([per * bs, 100, 1], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q, *scales)(r)
        scales[0].abs_().add_(0.01)
        scales[1].abs_().add_(0.01)
        tables.copy_(torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32))
        lens.copy_(torch.tensor([[7, per * bs, 33], [per * bs - 1, 0, 150]][r], device=DEV, dtype=torch.int32))
    cr.PLANS.clear()
    replay_equals_eager(lambda: cr.paged_decode_pools(q, *codes, tables, lens, quant=quant, config=config), refill)
    assert planned(cr.PagedDecodePlan)


@pytest.mark.parametrize("version", PLANNED_PREFILL)
def test_paged_prefill_replays_like_eager_with_tables_lengths_and_offsets_changed_in_place(version):
    """The paged prefill over device pools with device tables, lengths and offsets (the grid sized
    by max_seqlen_q): no host read of them, so the chunks may change between replays.  The
    captured call is the planned one (pinned); the eager launcher gives the same bits."""
    B, Hq, Hkv, d, bs, per = 3, 8, 2, 128, 16, 12
    nb = B * per + 5
    q, kp, vp = randn(83, Hq, d), randn(nb, bs, Hkv, d), randn(nb, bs, Hkv, d)
    config, eager = prefill_version(version, q, kp, vp)
    rng = np.random.default_rng(2)
    tables = torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32)
    lens = torch.tensor([150, 45, 45], device=DEV, dtype=torch.int32)
    cu = torch.tensor([0, 37, 38, 83], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q)(r)
        tables.copy_(torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32))
        lens.copy_(torch.tensor([[100, 35, 190], [64, 150, 13]][r], device=DEV, dtype=torch.int32))
        cu.copy_(torch.tensor([[0, 5, 40, 83], [0, 64, 70, 83]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: cr.paged_prefill_pools(q, kp, vp, tables, lens, cu, max_seqlen_q=64, config=config),
                        refill)
    assert planned(cr.PagedPrefillPlan)
    got = cr.paged_prefill_pools(q, kp, vp, tables, lens, cu, max_seqlen_q=64, config=config)
    want = eager(q, kp, vp, tables, lens, cu, max_seqlen_q=64, config=config)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("version", PLANNED_PREFILL)
def test_one_paged_prefill_plan_serves_every_layer_of_a_captured_step(version):
    """One PagedPrefillPlan run for each layer's pools in a captured step; tables, lengths and
    offsets rewritten in place between replays; a layer's replayed output equals the public call's."""
    layers, B, Hq, Hkv, d, bs, per = 3, 2, 16, 2, 64, 16, 8
    nb = B * per + 3
    qs = [randn(40, Hq, d) for _ in range(layers)]
    pools = [(randn(nb, bs, Hkv, d), randn(nb, bs, Hkv, d)) for _ in range(layers)]
    rng = np.random.default_rng(5)
    tables = torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32)
    lens = torch.tensor([128, 9], device=DEV, dtype=torch.int32)
    cu = torch.tensor([0, 31, 40], device=DEV, dtype=torch.int32)
    config, _ = prefill_version(version, qs[0], *pools[0])
    plan = cr.PagedPrefillPlan(qs[0], *pools[0], tables, lens, cu, config=config)

    def step():
        return [x for i in range(layers) for x in plan.run(qs[i], *pools[i], tables, lens, cu)]

    def refill(r):
        _refill(*qs)(r)
        tables.copy_(torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32))
        lens.copy_(torch.tensor([[40, 128], [1, 100]][r], device=DEV, dtype=torch.int32))
        cu.copy_(torch.tensor([[0, 1, 40], [0, 1, 40]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(step, refill)
    o, lse = cr.paged_prefill_pools(qs[2], *pools[2], tables, lens, cu, config=config)
    mine = plan.run(qs[2], *pools[2], tables, lens, cu)
    torch.cuda.synchronize()
    assert torch.equal(o, mine[0]) and torch.equal(lse, mine[1])


def test_paged_gather_replays_like_eager_with_the_table_changed_in_place():
    bs, Hkv, d, n = 16, 4, 64, 200
    nb = 40
    kp, vp = randn(nb, bs, Hkv, d), randn(nb, bs, Hkv, d)
    rng = np.random.default_rng(1)
    table = torch.tensor(rng.permutation(nb)[:-(-n // bs)], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(kp, vp)(r)
        table.copy_(torch.tensor(rng.permutation(nb)[:len(table)], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: cr.gather_pools(kp, vp, table, n), refill)
    assert planned(cr.GatherPlan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_replays_like_eager(dtype):
    q, k, v = randn(2, 8, 200, 64, dtype=dtype), randn(2, 2, 200, 64, dtype=dtype), randn(2, 2, 200, 64, dtype=dtype)
    o, lse = ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
    do = randn(*q.shape, dtype=dtype)
    cfg = cr.BackwardConfig(deterministic=True)          # the atomic adds' order is not fixed
    replay_equals_eager(lambda: ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg),
                        _refill(do, q, k, v))
    assert planned(cr.BackwardPlan)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_backward_plan_zeroes_its_dq_accumulator_on_every_replay(deterministic):
    q, k, v = randn(1, 4, 130, 64), randn(1, 2, 130, 64), randn(1, 2, 130, 64)
    o, lse = ik.attention(q, k, v, backend="cupy", return_lse=True)
    do = randn(*q.shape)
    plan = cr.BackwardPlan(do, q, k, v, o, lse, config=cr.BackwardConfig(deterministic=deterministic))
    g, (dq, _, _) = capture(lambda: plan.run(do, q, k, v, o, lse))
    assert plan.pinned
    for _ in range(3):                                   # dQ would grow replay by replay if not zeroed
        g.replay()
        want = ik.attention_backward(do, q, k, v, o, lse, backend="cupy", config=plan.config)[0]
        torch.cuda.synchronize()
        torch.testing.assert_close(dq, want, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not gpu.cupy_gpu() or cr.hopper.available() is not None, reason="MLA decode needs Hopper")
def test_mla_decode_replays_like_eager():
    B, Hq, N = 2, 128, 1000
    q, kv = randn(B, Hq, mla.ROW, dtype=torch.bfloat16), randn(B, N, mla.ROW, dtype=torch.bfloat16)
    lens = torch.tensor([1000, 333], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q, kv)(r)
        lens.copy_(torch.tensor([[1, 1000], [640, 65]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: cr.mla_decode(q, kv, seq_lens=lens), refill)
    assert planned(cr.MLADecodePlan)


@pytest.mark.skipif(not gpu.cupy_gpu() or cr.hopper.available() is not None, reason="MLA decode needs Hopper")
def test_paged_mla_decode_replays_like_eager_with_tables_changed_in_place():
    B, Hq, page, per = 3, 64, 64, 8
    nb = B * per + 4
    q, pool = randn(B, Hq, mla.ROW, dtype=torch.bfloat16), randn(nb, page, mla.ROW, dtype=torch.bfloat16)
    rng = np.random.default_rng(2)
    tables = torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32)
    lens = torch.tensor([per * page, 100, 1], device=DEV, dtype=torch.int32)

    def refill(r):
        _refill(q)(r)
        tables.copy_(torch.tensor(rng.permutation(nb)[:B * per].reshape(B, per), device=DEV, dtype=torch.int32))
        lens.copy_(torch.tensor([[7, per * page, 65], [per * page - 1, 0, 300]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(lambda: cr.paged_mla_decode(q, pool, tables, lens), refill)
    assert planned(cr.PagedMLADecodePlan)


@pytest.mark.skipif(not gpu.cupy_gpu() or cr.hopper.available() is not None, reason="MLA decode needs Hopper")
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_the_mla_plans_give_the_eager_launch_bit_for_bit(num_splits):
    B, Hq, N, page = 3, 80, 640, 64
    q, kv = randn(B, Hq, mla.ROW, dtype=torch.bfloat16), randn(B, N, mla.ROW, dtype=torch.bfloat16)
    lens = torch.tensor([N, 333, 0], device=DEV, dtype=torch.int32)     # the longest fills the tables
    per = N // page
    tables = torch.arange(B * per, device=DEV, dtype=torch.int32).flip(0).reshape(B, per).contiguous()
    pool = torch.empty(B * per, page, mla.ROW, device=DEV, dtype=torch.bfloat16)
    pool[tables.flatten().long()] = kv.reshape(B * per, page, mla.ROW)
    for planned_call, eager_call in (
            (lambda: cr.mla_decode(q, kv, seq_lens=lens, num_splits=num_splits),
             lambda: mla.mla_decode(q, kv, seq_lens=lens, num_splits=num_splits)),
            (lambda: cr.paged_mla_decode(q, pool, tables, lens, num_splits=num_splits),
             lambda: mla.paged_mla_decode(q, pool, tables, lens, num_splits=num_splits))):
        got, want = planned_call(), eager_call()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    kinds = {type(p) for p in cr.PLANS._plans.values()}
    assert cr.MLADecodePlan in kinds and cr.PagedMLADecodePlan in kinds          # the public calls were planned


def test_the_second_call_of_a_shape_hits_the_plan_cache():
    q, k, v = randn(2, 8, 128), randn(2, 2, 1000, 128), randn(2, 2, 1000, 128)
    ik.decode(q, k, v, backend="cupy")
    n, hits = len(cr.PLANS), cr.PLANS.hits
    for _ in range(3):
        ik.decode(randn(2, 8, 128), k, v, backend="cupy")      # new arrays, the same shape
    assert len(cr.PLANS) == n and cr.PLANS.hits == hits + 3
    plan = cr.DecodePlan(q, k, v)
    o, lse = plan.run(q, k, v)
    ref_o, ref_lse = ik.decode(q, k, v, backend="cupy", return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    with pytest.raises(ValueError, match="q: this plan was made for"):
        plan.run(randn(3, 8, 128), k, v)


def test_one_decode_plan_serves_every_layer_of_a_captured_step():
    layers, B, Hq, Hkv, N, d = 4, 3, 32, 8, 2000, 128
    qs = [randn(B, Hq, d) for _ in range(layers)]
    ks = [randn(B, Hkv, N, d) for _ in range(layers)]
    vs = [randn(B, Hkv, N, d) for _ in range(layers)]
    lens = torch.tensor([2000, 5, 999], device=DEV, dtype=torch.int32)
    plan = cr.DecodePlan(qs[0], ks[0], vs[0], seq_lens=lens)

    def step():
        return [x for i in range(layers) for x in plan.run(qs[i], ks[i], vs[i], seq_lens=lens)]

    def refill(r):
        _refill(*qs)(r)
        lens.copy_(torch.tensor([[1, 2000, 64], [1999, 0, 1000]][r], device=DEV, dtype=torch.int32))
    replay_equals_eager(step, refill)
    o, lse = ik.decode(qs[1], ks[1], vs[1], seq_lens=lens, backend="cupy", return_lse=True)
    mine = plan.run(qs[1], ks[1], vs[1], seq_lens=lens)
    torch.cuda.synchronize()
    assert torch.equal(o, mine[0]) and torch.equal(lse, mine[1])     # the public call runs the same plan
