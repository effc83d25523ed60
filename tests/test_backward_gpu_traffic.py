"""The GPU backward's closed-form traffic (iokernels.backward.traffic_model_gpu_kernels), on the CPU:
against the NumPy tiled backward's counted bytes at the same tiles, and against hand-worked cases.

The GPU kernels themselves are held to measured DRAM bytes by scripts/profile_traffic.py."""
import numpy as np
import pytest

import iokernels as ik
from iokernels import backward as bw
from iokernels import traffic
from iokernels.core import testing
from iokernels.core.config import TileConfig

#: SRAM large enough for any tile set below: the tiles are the GPU's, not the NumPy default's
BIG_SRAM = 1 << 30


def _counted_tiled(rng, case, Br, Bc):
    q, k, v, do = testing.make_inputs(rng, case["batch"], case["heads_q"], case["heads_kv"], case["seqlen_q"],
                                      case["seqlen_k"], case["head_dim"], case["dtype"], with_grad=True)
    causal, window = case.get("causal", False), case.get("window")
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    cfg = TileConfig(block_q=Br, block_k=Bc, sram_bytes=BIG_SRAM)
    with traffic.count() as t:
        ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="tiled", config=cfg)
    return t


SAME_TILING = [
    (dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=113, seqlen_k=203, head_dim=59, dtype="float32"), 32, 32),
    (dict(batch=2, heads_q=4, heads_kv=1, seqlen_q=100, seqlen_k=70, head_dim=24, dtype="float16",
          causal=True), 16, 32),
    (dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=131, head_dim=16, dtype="bfloat16",
          causal=True), 8, 16),
    (dict(batch=1, heads_q=3, heads_kv=3, seqlen_q=61, seqlen_k=1, head_dim=8, dtype="float32",
          causal=True), 16, 16),
]


@pytest.mark.parametrize("case,Br,Bc", SAME_TILING)
def test_atomic_mode_equals_the_counted_numpy_backward(rng, case, Br, Bc):
    """Same tiling, no band that hides a K/V tile: every tensor's bytes agree exactly."""
    counted = _counted_tiled(rng, case, Br, Bc)
    gpu = traffic.model("gpu_backward", block_q=Br, block_k=Bc, **case)
    assert gpu.as_dict() == counted.as_dict(), f"\nGPU model\n{gpu.table()}\ncounted NumPy\n{counted.table()}"


def test_a_window_that_hides_key_tiles_differs_only_in_k_and_v(rng):
    """Keys no query sees: the NumPy backward skips their K_j, V_j; a GPU block loads them anyway."""
    case = dict(batch=1, heads_q=2, heads_kv=1, seqlen_q=40, seqlen_k=120, head_dim=8, dtype="float32",
                window=(4, 2))
    counted = _counted_tiled(rng, case, 8, 16).as_dict()
    gpu = traffic.model("gpu_backward", block_q=8, block_k=16, **case).as_dict()
    differ = {n for n in set(counted) | set(gpu) if counted.get(n) != gpu.get(n)}
    assert differ == {"K", "V"}, differ
    assert gpu["K"][0] == 120 * 8 * 4 > counted["K"][0]


def test_hand_worked_causal_case():
    """N_q = N_k = 4, d = 2, Br = Bc = 2, float32, causal.  K/V tile 0 (keys 0-1) is seen by
    rows 0-3 (both Q tiles), tile 1 (keys 2-3) by rows 2-3 only: R = 4 + 2 = 6 rows."""
    kw = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=4, seqlen_k=4, head_dim=2, dtype="float32",
              block_q=2, block_k=2, causal=True)
    k = bw.traffic_model_gpu_kernels(**kw)
    assert k["zero"].as_dict() == {"dQaccum": (0, 32)}                       # 4 x 2 x 4 B
    assert k["rowsum"].as_dict() == {"D": (0, 16), "O": (32, 0), "dO": (32, 0)}
    assert k["main"].as_dict() == {"K": (32, 0), "V": (32, 0), "dK": (0, 32), "dV": (0, 32),
                                   "Q": (48, 0), "dO": (48, 0), "LSE": (24, 0), "D": (24, 0),
                                   "dQaccum": (48, 48)}                      # 6 rows x 2 x 4 B
    assert k["finish"].as_dict() == {"dQaccum": (32, 0), "dQ": (0, 32)}
    det = bw.traffic_model_gpu_kernels(**kw, deterministic=True)
    assert det["zero"].as_dict() == {"dQaccum": (0, 64)}                     # Tc = 2 slots
    assert det["main"].by_tensor["dQaccum"] == [0, 48]                      # written, never read
    assert det["finish"].as_dict() == {"dQaccum": (64, 0), "dQ": (0, 32)}
    total = bw.traffic_model_gpu(**kw)
    assert total.total == sum(t.total for t in k.values()) == 32 + 80 + 368 + 64


def test_hand_worked_gqa_bf16_case():
    """B = 2, Hq = 4, Hkv = 2, N_q = 5, N_k = 7, d = 3, Br = 4, Bc = 4, bf16, no mask: Tc = 2
    tiles each see all 5 rows (R = 10); K, V per (b, kv head) once, Q per query head R times."""
    k = bw.traffic_model_gpu_kernels(batch=2, heads_q=4, heads_kv=2, seqlen_q=5, seqlen_k=7, head_dim=3,
                                     dtype="bfloat16", block_q=4, block_k=4)
    m = k["main"].by_tensor
    assert m["K"] == [2 * 2 * 7 * 3 * 2, 0] and m["dV"] == [0, 2 * 2 * 7 * 3 * 2]
    assert m["Q"] == [2 * 4 * 10 * 3 * 2, 0] and m["LSE"] == [2 * 4 * 10 * 4, 0]
    assert m["dQaccum"] == [2 * 4 * 10 * 3 * 4] * 2
    assert k["finish"].by_tensor["dQ"] == [0, 2 * 4 * 5 * 3 * 2]


def test_causal_skipping_against_the_tile_plan():
    """Causal, N = 2048, Br = Bc = 32: R is the rows of the tile plan's visited tiles."""
    N, Br, Bc = 2048, 32, 32
    plan = bw.tile_plan(N, N, Br, Bc, causal=True)
    R = int((plan != "skip").sum()) * Br
    k = bw.traffic_model_gpu_kernels(batch=1, heads_q=8, heads_kv=8, seqlen_q=N, seqlen_k=N, head_dim=128,
                                     dtype="bfloat16", block_q=Br, block_k=Bc, causal=True)
    full = bw.traffic_model_gpu_kernels(batch=1, heads_q=8, heads_kv=8, seqlen_q=N, seqlen_k=N, head_dim=128,
                                        dtype="bfloat16", block_q=Br, block_k=Bc)
    assert k["main"].by_tensor["Q"][0] == 8 * R * 128 * 2
    assert R == (N // Bc) * (N // Bc + 1) // 2 * Br                        # about half of Tc x N
    assert full["main"].by_tensor["Q"][0] == 8 * (N // Bc) * N * 128 * 2


# --------------------------------------------------------------------------- the GPU tests' helpers
def test_grid_inputs_are_exact_in_every_dtype(rng):
    xs = testing.make_grid_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=53, head_dim=59)
    assert [x.shape for x in xs] == [(2, 4, 37, 59), (2, 2, 53, 59), (2, 2, 53, 59), (2, 4, 37, 59)]
    for x in xs:
        assert np.all(x != 0) and x.dtype == np.float64
        for name in ("float16", "bfloat16", "float32"):
            assert np.array_equal(x.astype(testing.numpy_dtype(name)).astype(np.float64), x), name


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_by_head_equals_the_whole_oracle(rng, causal):
    from iokernels.core import reference
    q, k, v, do = testing.make_grid_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=29, seqlen_k=41,
                                           head_dim=11)
    got = testing.oracle_by_head(do, q, k, v, causal=causal)
    want = reference.attention(q, k, v, causal=causal) + reference.attention_backward(do, q, k, v, causal=causal)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert np.max(np.abs(a - b)) < 1e-12, name


@pytest.mark.parametrize("causal", [False, True])
def test_torch_naive_backward_is_the_numpy_naive_backward(rng, causal):
    """The GPU tests' baseline, torch_sdpa.naive_backward (here on the CPU), gives the NumPy naive
    backward's numbers from the same O and LSE: bit for bit in 16 bits, to float32's summation
    order in float32, to 1e-12 in float64; fully masked rows (N_q > N_k, causal) give 0."""
    torch = pytest.importorskip("torch")
    from iokernels.core import reference
    from iokernels.torch_sdpa import naive_backward
    Nq, Nk = (37, 23) if causal else (19, 31)
    q, k, v, do = testing.make_grid_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=Nq, seqlen_k=Nk,
                                           head_dim=12)
    o64, lse64 = reference.attention(q, k, v, causal=causal)
    for dtype, tol in (("float16", 0.0), ("bfloat16", 0.0), ("float32", 1e-6), ("float64", 1e-12)):
        nd = testing.numpy_dtype(dtype)
        lse_dt = np.float64 if dtype == "float64" else np.float32
        args = [x.astype(nd) for x in (do, q, k, v, o64)] + [lse64.astype(lse_dt)]
        want = ik.attention_backward(*args, causal=causal, backend="naive")
        tt = [torch.from_numpy(np.asarray(x, np.float32)).to(getattr(torch, dtype)) if dtype != "float64"
              else torch.from_numpy(x) for x in args[:5]] + [torch.from_numpy(args[5])]
        got = naive_backward(*tt, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert str(a.dtype) == f"torch.{dtype}" and torch.isfinite(a).all(), (dtype, name)
            assert np.max(np.abs(testing.as_numpy(a) - testing.as_numpy(b))) <= tol, (dtype, name)
        if causal:
            assert np.all(testing.as_numpy(got[0])[:, :, :Nq - Nk] == 0)


def test_recorded_backward_traffic_table():
    """The notebook's view of a record: per kernel, measured next to the model; nothing when absent."""
    from iokernels.core import recorded
    assert recorded.backward_traffic_table({"traffic": {"cases": []}}) == ""
    case = dict(case="cupy backward v1", size="large", measured_read=3.0e6, measured_written=1.0e6,
                model_read=4.0e6, model_written=2.0e6,
                model_by_kernel={"zero": [0, 1e6], "rowsum": [1e6, 0], "main": [2e6, 0], "finish": [1e6, 1e6]},
                measured_by_kernel={"zero": [0, 0.5e6, 1], "rowsum": [1e6, 0, 1], "main": [1e6, 0, 1],
                                    "finish": [1e6, 0.5e6, 1], "other": [0, 0, 1]})
    text = recorded.backward_traffic_table({"traffic": {"cases": [case, dict(case="cupy attention", size="small",
                                                                             measured_read=1, measured_written=1)]}})
    lines = text.splitlines()
    assert len(lines) == 1 + 5 + 1 and "cupy attention" not in text
    assert lines[3].split()[-1] == "0.50" and lines[5].split()[-1] == "-"     # main 1/2; other: no model
    assert lines[-1].split()[-1] == "0.67"


def test_check_gradients_and_the_report(rng):
    """Three named checks at once; the report lists the failed ones first, then all."""
    ref = [rng.standard_normal((2, 3)) for _ in range(3)]
    base = [r + 1e-3 for r in ref]
    got = [ref[0] + 1e-3, ref[1] + 5e-3, ref[2]]                  # dk is 5x the baseline's error
    checks = testing.check_gradients(got, ref, base, dtype="float16", factor=2.0, label="v9 atomic")
    assert [c.name for c in checks] == ["v9 atomic dq", "v9 atomic dk", "v9 atomic dv"]
    assert [c.ok for c in checks] == [True, False, True]
    text = testing.report(checks)
    assert text.startswith("1 of 3 checks failed:\nv9 atomic dk") and text.count("v9 atomic dq") == 1


@pytest.mark.parametrize("bad", [dict(block_q=0), dict(block_k=-4), dict(block_q=2.5), dict(block_k=True)])
def test_bad_tiles_raise_naming_the_argument(bad):
    kw = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=8, seqlen_k=8, head_dim=4, dtype="float32",
              block_q=4, block_k=4)
    kw.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        bw.traffic_model_gpu_kernels(**kw)
