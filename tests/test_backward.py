"""The attention backward pass: naive (v1) and FlashAttention-2 tiled (v2).

Every check uses fresh seeded inputs (the ``rng`` fixture) and an independent truth:
the float64 analytic gradients of :mod:`iokernels.core.reference`, central finite differences
of the float64 forward, and torch autograd on the CPU.  Low precision follows
FlashAttention's rule for gradients (<= 3x the error of the naive backward in the same
precision).  Traffic: counted == modelled, tensor by tensor, and one model is checked
against a formula written out here by hand.
"""
import math
import tracemalloc

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as hs

import iokernels as ik
from iokernels import backward as bw
from iokernels import conventions as cv
from iokernels import reference as ref
from iokernels import testing, traffic
from iokernels.core.config import TileConfig

# The foundation issue's shape sweep: (seqlen_q, seqlen_k), each paired with a head dim
# so that all five head dims appear, and run causal and not; every other one with GQA.
SHAPES = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1, 239), (3, 799),
          (127, 513), (239, 1)]
HEAD_DIMS = [32, 59, 64, 111, 128]
SWEEP = [(nq, nk, HEAD_DIMS[n % len(HEAD_DIMS)], (2, 1) if n % 2 else (2, 2))
         for n, (nq, nk) in enumerate(SHAPES)]


def forward_state(q, k, v, causal=False, window=None):
    """O and LSE as a forward in q's precision hands them over: O in q's dtype, LSE in the
    accumulator dtype (from the float64 oracle, rounded)."""
    o, lse = ref.attention(q, k, v, causal=causal, window=window)
    return o.astype(q.dtype), lse.astype(cv.accum_dtype(q.dtype.name))


def run_both(do, q, k, v, o, lse, **kw):
    return (ik.attention_backward(do, q, k, v, o, lse, backend="naive", **kw),
            ik.attention_backward(do, q, k, v, o, lse, backend="tiled", **kw))


def masked_query_rows(nq, nk, causal, window):
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal, window)
    return hi <= lo


def unseen_keys(nq, nk, causal, window):
    return ~cv.mask(nq, nk, causal, window).any(axis=0) if nq else np.ones(nk, bool)


# --------------------------------------------------------------------------- float64 exactness
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d,heads", SWEEP)
def test_float64_matches_analytic_gradients(rng, nq, nk, d, heads, causal):
    hq, hkv = heads
    q, k, v, do = testing.make_inputs(rng, 1, hq, hkv, nq, nk, d, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, causal)
    want = ref.attention_backward(do, q, k, v, causal=causal)
    for got in run_both(do, q, k, v, o, lse, causal=causal):
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.dtype == np.float64 and g.shape == w.shape
            testing.assert_close(g, w, name=name)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_head_dim_gqa_causal(rng, d, dtype):
    q, k, v, do = testing.make_inputs(rng, 1, 4, 2, 113, 203, d, dtype, with_grad=True)
    o, lse = forward_state(q, k, v, True)
    want = ref.attention_backward(do, q, k, v, causal=True)
    naive, tiled = run_both(do, q, k, v, o, lse, causal=True)
    for name, t, n, w in zip(("dq", "dk", "dv"), tiled, naive, want):
        testing.assert_close(t, w, None if dtype == "float64" else n, name=name,
                             factor=testing.GRADIENT_FACTOR)
        if dtype == "float64":
            testing.assert_close(n, w, name=name)


@pytest.mark.parametrize("window,causal,nq,nk", [
    ((8, 0), False, 70, 90),     # sliding window, keys at the start unseen by late queries
    ((16, 4), True, 90, 70),     # causal + window, Nq > Nk: the first 20 query rows see nothing
    ((0, 0), False, 33, 33),     # each query sees exactly one key
    ((-1, 5), False, 50, 20),    # right bound only, Nq > Nk: query rows 0..23 see nothing
    ((3, -1), True, 40, 100),    # left window with causal, keys 0..56 unseen by anyone
])
def test_float64_window_masked_rows_and_unseen_keys(rng, window, causal, nq, nk):
    config = TileConfig(block_q=16, block_k=24)        # many partial tiles
    q, k, v, do = testing.make_inputs(rng, 2, 4, 2, nq, nk, 24, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, causal, window)
    want = ref.attention_backward(do, q, k, v, causal=causal, window=window)
    empty_q = masked_query_rows(nq, nk, causal, window)
    empty_k = unseen_keys(nq, nk, causal, window)
    for got in run_both(do, q, k, v, o, lse, causal=causal, window=window, config=config):
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            testing.assert_close(g, w, name=name)
            assert not np.isnan(g).any()
        assert np.all(got[0][:, :, empty_q] == 0)      # fully masked rows: exactly zero
        assert np.all(got[1][:, :, empty_k] == 0) and np.all(got[2][:, :, empty_k] == 0)


def test_fully_masked_rows_exist_in_the_window_cases():
    """The masked-row assertions above are not vacuous."""
    assert masked_query_rows(90, 70, True, (16, 4)).sum() == 20
    assert unseen_keys(40, 100, True, (3, -1)).sum() == 57
    assert unseen_keys(70, 90, False, (8, 0)).sum() == 12


@pytest.mark.parametrize("config", [TileConfig(block_q=1, block_k=1), TileConfig(block_q=7, block_k=5),
                                    TileConfig(block_q=128, block_k=16), TileConfig(block_q=300, block_k=300,
                                                                                    sram_bytes=10**8)])
def test_float64_any_tile_size(rng, config):
    q, k, v, do = testing.make_inputs(rng, 1, 3, 1, 37, 29, 11, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, True)
    want = ref.attention_backward(do, q, k, v, causal=True)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=True, config=config)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        testing.assert_close(g, w, name=name)


def test_scale_and_mqa_batch(rng):
    q, k, v, do = testing.make_inputs(rng, 3, 4, 1, 45, 61, 17, "float64", with_grad=True)
    o, lse = ref.attention(q, k, v, scale=0.37)
    want = ref.attention_backward(do, q, k, v, scale=0.37)
    for got in run_both(do, q, k, v, o, lse, scale=0.37):
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            testing.assert_close(g, w, name=name)


# --------------------------------------------------------------------------- finite differences
@pytest.mark.parametrize("nq,nk,d,hq,hkv,causal,window", [
    (5, 7, 3, 2, 2, False, None),
    (6, 4, 4, 4, 2, True, None),      # causal, Nq > Nk: two fully masked query rows
    (7, 9, 3, 2, 1, False, (2, 1)),   # MQA with a window
])
def test_tiled_matches_finite_differences(rng, nq, nk, d, hq, hkv, causal, window):
    q, k, v, do = testing.make_inputs(rng, 1, hq, hkv, nq, nk, d, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, causal, window)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window,
                                config=TileConfig(block_q=2, block_k=3))
    fds = bw.finite_difference_grads(q, k, v, do, causal=causal, window=window)
    for name, g, fd in zip(("dq", "dk", "dv"), got, fds):
        # central differences with h = 1e-6 are good to about 1e-9 here
        assert np.max(np.abs(g - fd)) < 1e-8, name
        assert np.max(np.abs(fd)) > 1e-2, name        # the gradient is not trivially zero


# --------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("nq,nk,d,heads,causal", [
    (113, 203, 59, (2, 1), True), (256, 512, 64, (2, 2), False), (127, 513, 111, (4, 2), True),
    (3, 799, 128, (2, 2), False), (239, 1, 32, (2, 1), True)])
def test_low_precision_gradient_rule(rng, dtype, nq, nk, d, heads, causal):
    hq, hkv = heads
    q, k, v, do = testing.make_inputs(rng, 1, hq, hkv, nq, nk, d, dtype, with_grad=True)
    o, lse = forward_state(q, k, v, causal)
    assert lse.dtype == np.float32
    want = ref.attention_backward(do, q, k, v, causal=causal)
    naive, tiled = run_both(do, q, k, v, o, lse, causal=causal)
    for name, t, n, w in zip(("dq", "dk", "dv"), tiled, naive, want):
        assert t.dtype == np.dtype(dtype) and n.dtype == np.dtype(dtype)
        testing.assert_close(t, w, n, name=name, factor=testing.GRADIENT_FACTOR)


def test_float16_fully_masked_rows_never_nan(rng):
    q, k, v, do = testing.make_inputs(rng, 1, 2, 1, 40, 24, 16, "float16", with_grad=True)
    o, lse = forward_state(q, k, v, True)
    assert np.isneginf(lse[0, 0, :16]).all()          # rows 0..15 see no key
    for dq, dk, dv in run_both(do, q, k, v, o, lse, causal=True):
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert np.all(dq[:, :, :16] == 0)


# --------------------------------------------------------------------------- torch autograd
@pytest.mark.parametrize("nq,nk,hq,hkv,window", [(37, 53, 4, 2, None), (48, 48, 2, 1, (9, 2))])
def test_against_torch_autograd(rng, nq, nk, hq, hkv, window):
    torch = pytest.importorskip("torch")
    d = 24
    q, k, v, do = testing.make_inputs(rng, 2, hq, hkv, nq, nk, d, "float64", with_grad=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    # the same attention written in torch, with the explicit bottom-right causal mask
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    visible = j <= i + (nk - nq)
    if window is not None:
        visible &= (j >= i + (nk - nq) - window[0]) & (j <= i + (nk - nq) + window[1])
    g = hq // hkv
    ke, ve = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
    s = (tq @ ke.transpose(-1, -2)) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    (p @ ve * torch.tensor(do)).sum().backward()

    o, lse = forward_state(q, k, v, True, window)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=True, window=window,
                                config=TileConfig(block_q=16, block_k=16))
    for name, mine, t in zip(("dq", "dk", "dv"), got, (tq.grad, tk.grad, tv.grad)):
        testing.assert_close(mine, t.numpy(), name=name)


def test_with_the_tiled_forward_end_to_end(rng):
    """O and LSE from the package's own tiled forward."""
    for dtype in ("float64", "float16"):
        q, k, v, do = testing.make_inputs(rng, 1, 4, 2, 97, 130, 48, dtype, with_grad=True)
        o, lse = ik.attention(q, k, v, causal=True, backend="tiled", return_lse=True)
        want = ref.attention_backward(do, q, k, v, causal=True)
        naive, tiled = run_both(do, q, k, v, o, lse, causal=True)
        for name, t, n, w in zip(("dq", "dk", "dv"), tiled, naive, want):
            testing.assert_close(t, w, n, name=name, factor=testing.GRADIENT_FACTOR)


# --------------------------------------------------------------------------- traffic
TRAFFIC_CASES = [
    dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=113, seqlen_k=203, head_dim=59, dtype="float64"),
    dict(batch=2, heads_q=4, heads_kv=1, seqlen_q=100, seqlen_k=70, head_dim=32, dtype="float16",
         causal=True),
    dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_k=150, head_dim=40, dtype="float32",
         window=(20, 3), config=TileConfig(block_q=16, block_k=32)),
    dict(batch=1, heads_q=3, heads_kv=3, seqlen_q=239, seqlen_k=1, head_dim=16, dtype="float32",
         causal=True),
    dict(batch=1, heads_q=2, heads_kv=1, seqlen_q=50, seqlen_k=90, head_dim=8, dtype="float16",
         causal=True, window=(5, -1), config=TileConfig(block_q=7, block_k=9)),
]


@pytest.mark.parametrize("case", TRAFFIC_CASES)
def test_counted_traffic_equals_model(rng, case):
    q, k, v, do = testing.make_inputs(rng, case["batch"], case["heads_q"], case["heads_kv"],
                                      case["seqlen_q"], case["seqlen_k"], case["head_dim"],
                                      case["dtype"], with_grad=True)
    causal, window = case.get("causal", False), case.get("window")
    o, lse = forward_state(q, k, v, causal, window)
    for backend, kind in (("naive", "naive_backward"), ("tiled", "fa2_backward")):
        with traffic.count() as t:
            ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window,
                                  backend=backend, config=case.get("config"))
        modelled = traffic.model(kind, **case)
        assert t.as_dict() == modelled.as_dict(), f"{backend}\n{t.table()}\n{modelled.table()}"


def test_which_tensors_each_version_moves(rng):
    q, k, v, do = testing.make_inputs(rng, 1, 2, 2, 64, 64, 16, "float32", with_grad=True)
    o, lse = forward_state(q, k, v)
    with traffic.count() as tn:
        ik.attention_backward(do, q, k, v, o, lse, backend="naive")
    with traffic.count() as tt:
        ik.attention_backward(do, q, k, v, o, lse, backend="tiled")
    assert {"P", "dP", "dS"} <= set(tn.as_dict()) and "S" not in tn.as_dict()
    assert not {"S", "P", "dP", "dS"} & set(tt.as_dict())
    n = 2 * 64 * 64 * 4                                # one N x N float32 matrix per head, both heads
    assert tn.by_tensor["P"] == [2 * n, n] and tn.by_tensor["dS"] == [2 * n, n]


def test_tiled_model_against_a_hand_formula():
    """No mask, N a multiple of both tiles, MHA: every count written out by hand."""
    N, d, Br, Bc, H = 512, 64, 32, 64, 3
    Tr, Tc = N // Br, N // Bc
    cfg = TileConfig(block_q=Br, block_k=Bc)
    t = traffic.model("fa2_backward", batch=1, heads_q=H, heads_kv=H, seqlen_q=N, seqlen_k=N,
                      head_dim=d, dtype="float16", config=cfg)
    st, acc = 2, 4
    nd = H * N * d
    assert t.by_tensor["K"] == [nd * st, 0] and t.by_tensor["V"] == [nd * st, 0]   # once
    assert t.by_tensor["Q"] == [Tc * nd * st, 0]                                 # once per K/V tile
    assert t.by_tensor["dO"] == [(1 + Tc) * nd * st, 0]                          # + the D pass
    assert t.by_tensor["LSE"] == [Tc * H * N * acc, 0]
    assert t.by_tensor["D"] == [Tc * H * N * acc, H * N * acc]
    assert t.by_tensor["dQaccum"] == [(Tc + 1) * nd * acc, (1 + Tc) * nd * acc]  # RMW + zero/convert
    assert t.by_tensor["dQ"] == [0, nd * st] and t.by_tensor["dK"] == [0, nd * st]
    assert Tr == 16  # (used by the naive comparison below)
    naive = traffic.model("naive_backward", batch=1, heads_q=H, heads_kv=H, seqlen_q=N,
                          seqlen_k=N, head_dim=d, dtype="float16")
    assert naive.by_tensor["P"][0] + naive.by_tensor["P"][1] == 3 * H * N * N * st
    assert naive.total > t.total


@pytest.mark.parametrize("nq,nk,br,bc,causal,window", [
    (100, 70, 16, 24, False, None), (90, 70, 16, 24, True, (16, 4)), (40, 100, 7, 9, True, (3, -1)),
    (50, 20, 8, 8, False, (-1, 5)), (33, 33, 5, 4, False, (0, 0)), (239, 1, 64, 128, True, None),
    (1, 239, 64, 16, True, (10, 0)), (128, 256, 32, 32, True, None)])
def test_tile_plan_agrees_with_tile_state(nq, nk, br, bc, causal, window):
    plan = bw.tile_plan(nq, nk, br, bc, causal, window)
    assert plan.shape == (math.ceil(nq / br), math.ceil(nk / bc))
    for (i, j), state in np.ndenumerate(plan):
        want = cv.tile_state(i * br, min((i + 1) * br, nq), j * bc, min((j + 1) * bc, nk), nq, nk,
                             causal, window)
        assert state == want, (i, j)
    assert set(np.unique(plan)) <= {"skip", "full", "partial"}


def test_gqa_reads_each_kv_tile_once_per_kv_head():
    """dK_j, dV_j sum the whole query-head group on chip: K and V are read once per KV head."""
    N, d, Hq, Hkv = 256, 32, 8, 2
    kw = dict(batch=2, heads_q=Hq, heads_kv=Hkv, seqlen_q=N, seqlen_k=N, head_dim=d, dtype="float32",
              config=TileConfig(block_q=32, block_k=64))
    t = traffic.model("fa2_backward", **kw)
    assert t.by_tensor["K"] == [2 * Hkv * N * d * 4, 0] and t.by_tensor["dK"] == [0, 2 * Hkv * N * d * 4]
    assert t.by_tensor["Q"] == [2 * Hq * (N // 64) * N * d * 4, 0]
    naive = traffic.model("naive_backward", **kw)
    assert naive.by_tensor["K"] == [2 * 2 * Hq * N * d * 4, 0]                 # per query head, twice
    assert naive.by_tensor["dK"] == [2 * (Hq - Hkv) * N * d * 4, 2 * Hq * N * d * 4]


def test_causal_skips_tiles_in_the_model():
    kw = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=256, seqlen_k=256, head_dim=32,
              dtype="float32", config=TileConfig(block_q=64, block_k=64))
    full = traffic.model("fa2_backward", **kw)
    causal = traffic.model("fa2_backward", causal=True, **kw)
    # 4 x 4 tiles, causal visits the 10 on or below the diagonal
    assert causal.by_tensor["Q"][0] * 16 == full.by_tensor["Q"][0] * 10
    naive = traffic.model("naive_backward", **kw)
    assert naive == traffic.model("naive_backward", causal=True, **kw)


# --------------------------------------------------------------------------- memory
def test_tiled_never_allocates_an_n_by_n_array(rng):
    N, d = 1024, 16
    q, k, v, do = testing.make_inputs(rng, 1, 1, 1, N, N, d, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, True)
    nn_bytes = N * N * 8
    peaks = {}
    for backend in ("tiled", "naive"):
        tracemalloc.start()
        ik.attention_backward(do, q, k, v, o, lse, causal=True, backend=backend)
        peaks[backend] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # tiled: outputs and D/dQaccum (five N*d arrays of 128 KiB) plus tiles, about 1 MiB.
    # An N x N array of float64 (8 MiB) or even float32 (4 MiB) would break this bound.
    assert peaks["tiled"] < nn_bytes / 2, peaks
    assert peaks["naive"] > 3 * nn_bytes, peaks       # the test can tell the difference


# --------------------------------------------------------------------------- SRAM and config
def test_backward_tile_set_is_checked_against_sram(rng):
    cfg = TileConfig(block_q=64, block_k=64)
    assert bw.backward_sram_usage(cfg, 128, "float32") > cfg.sram_usage(128, "float32")
    q, k, v, do = testing.make_inputs(rng, 1, 1, 1, 70, 70, 128, "float32", with_grad=True)
    o, lse = forward_state(q, k, v)
    with pytest.raises(ValueError, match="config"):
        ik.attention_backward(do, q, k, v, o, lse, config=cfg)       # 64 x 64 at d=128 fp32: too big
    with pytest.raises(ValueError, match="config"):
        ik.attention_backward(do, q, k, v, o, lse, config=TileConfig(block_q=8, block_k=8, sram_bytes=4096))
    with pytest.raises(ValueError, match="config"):
        ik.attention_backward(do, q, k, v, o, lse, config={"block_q": 8})
    with pytest.raises(ValueError, match="config"):
        traffic.model("fa2_backward", batch=1, heads_q=1, heads_kv=1, seqlen_q=8, seqlen_k=8,
                      head_dim=128, dtype="float32", config=cfg)


@pytest.mark.parametrize("d,dtype", [(32, "float16"), (128, "float32"), (128, "float64"), (256, "float64")])
def test_default_config_fits(d, dtype):
    cfg = bw.default_backward_config(d, dtype)
    assert bw.backward_sram_usage(cfg, d, dtype) <= cfg.sram_bytes
    assert cfg.block_q >= 16 and cfg.block_k >= 8
    # as large as the rule allows: Bc first (it sets the traffic), then Br
    if cfg.block_k < bw.DEFAULT_BLOCK_K:
        wider = cfg.replace(block_k=cfg.block_k * 2)
        assert bw.backward_sram_usage(wider, d, dtype) > cfg.sram_bytes
    if cfg.block_q < bw.DEFAULT_BLOCK_Q:
        taller = cfg.replace(block_q=cfg.block_q * 2)
        assert bw.backward_sram_usage(taller, d, dtype) > cfg.sram_bytes


def test_bad_arguments_name_themselves(rng):
    q, k, v, do = testing.make_inputs(rng, 1, 2, 1, 9, 9, 8, "float32", with_grad=True)
    o, lse = forward_state(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        ik.attention_backward(do, q, k, v, o, lse[:, :, :4])
    with pytest.raises(ValueError, match="do"):
        ik.attention_backward(do.astype(np.float16), q, k, v, o, lse)
    with pytest.raises(ValueError, match="backend"):
        ik.attention_backward(do, q, k, v, o, lse, backend="fast")


def test_tiled_is_deterministic(rng):
    q, k, v, do = testing.make_inputs(rng, 1, 2, 2, 77, 91, 16, "float32", with_grad=True)
    o, lse = forward_state(q, k, v, True)
    a = ik.attention_backward(do, q, k, v, o, lse, causal=True)
    b = ik.attention_backward(do, q, k, v, o, lse, causal=True)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- notebook helpers
def test_recompute_flops():
    f = bw.recompute_flops(100, 100, 64)
    assert f["visible_entries"] == 100 * 100
    assert f["forward"] == 4 * 64 * 100 * 100 and f["backward_overhead"] == 0.25
    assert math.isclose(f["training_step_overhead"], 1 / 6)
    c = bw.recompute_flops(100, 120, 64, causal=True, heads_q=3)
    assert c["visible_entries"] == 3 * int(cv.mask(100, 120, True).sum())


def test_memory_footprint_and_traffic_curve():
    m = bw.memory_footprint(4096, 4096, 128, "float16")
    assert m["P"] == 4096 * 4096 * 2 and m["LSE"] == 4096 * 4 and m["O"] == 4096 * 128 * 2
    cur = bw.traffic_vs_seqlen([256, 1024], head_dim=64)
    assert cur["N"] == [256, 1024]
    assert cur["naive_backward"][1] / cur["fa2_backward"][1] > cur["naive_backward"][0] / cur["fa2_backward"][0]
    assert all(m < f for m, f in zip(cur["mandatory"], cur["fa2_backward"]))


def test_gradient_checks_helper(rng):
    checks = bw.gradient_checks(rng, seqlen_q=40, seqlen_k=70, head_dim=24)
    assert len(checks) == 9 and all(checks), "\n".join(map(str, checks))
    assert all(c.baseline_error is not None for c in checks[3:])


def test_counted_traffic_helper(rng):
    out = bw.counted_traffic_vs_seqlen(rng, [64, 100], head_dim=16, dtype="float32")
    assert out["matches_model"] and out["N"] == [64, 100]
    cur = bw.traffic_vs_seqlen([64, 100], head_dim=16, dtype="float32")
    assert out["naive_backward"] == cur["naive_backward"] and out["fa2_backward"] == cur["fa2_backward"]


# --------------------------------------------------------------------------- property test


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(nq=hs.integers(1, 40), nk=hs.integers(1, 40), d=hs.integers(1, 9),
                  group=hs.sampled_from([(1, 1), (2, 1), (4, 2)]), causal=hs.booleans(),
                  left=hs.integers(-1, 12), right=hs.integers(-1, 12),
                  br=hs.integers(1, 17), bc=hs.integers(1, 17), seed=hs.integers(0, 2**32 - 1))
def test_property_random_problems(nq, nk, d, group, causal, left, right, br, bc, seed):
    """Random shapes, masks and tiles: gradients match the oracle, traffic matches the model."""
    rng = np.random.default_rng(seed)
    hq, hkv = group
    window = (left, right)
    config = TileConfig(block_q=br, block_k=bc)
    q, k, v, do = testing.make_inputs(rng, 1, hq, hkv, nq, nk, d, "float64", with_grad=True)
    o, lse = forward_state(q, k, v, causal, window)
    want = ref.attention_backward(do, q, k, v, causal=causal, window=window)
    with traffic.count() as t:
        got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, config=config)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        testing.assert_close(g, w, name=name)
    assert t == traffic.model("fa2_backward", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                              seqlen_k=nk, head_dim=d, dtype="float64", causal=causal,
                              window=window, config=config)
