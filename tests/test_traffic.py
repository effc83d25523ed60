"""HBM traffic: the bytes counted while the NumPy kernels run equal the closed-form models.

Counted (iokernels.core.traffic.count, every HBM tile read and write) == modelled
(iokernels.core.traffic.model), tensor by tensor, exactly, over awkward shapes, both loop
orders, causal and window tile skipping, ragged last tiles and GQA.  Then the scaling
laws the notebooks teach: naive grows like N^2, FlashAttention's K/V re-reads like
N^2 d^2 / M, and a tile set that does not fit SRAM is refused.
"""
import itertools
import math

import pytest

import iokernels as ik
from iokernels import testing, traffic
from iokernels.core.config import TileConfig

SHAPES = [(113, 203), (128, 128), (1, 239), (239, 1), (100, 37), (64, 300), (257, 255)]
MASKS = [(False, None), (True, None), (False, (30, 10)), (True, (45, -1)), (False, (0, 0))]
TILES = [(16, 16), (32, 48), (64, 24)]


def _problem(nq, nk, d=24, hq=4, hkv=2, b=2, dtype="float32"):
    return dict(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)


def counted(backend, rng, prob, causal, window, config=None):
    q, k, v = testing.make_inputs(rng, **prob)
    with traffic.count() as t:
        ik.attention(q, k, v, causal=causal, window=window, backend=backend, config=config)
    return t


def _cases():
    out = []
    for n, ((nq, nk), (causal, window), order) in enumerate(itertools.product(SHAPES, MASKS, ("fa2", "fa1"))):
        tiles = TILES[n % 3]
        dtype = ("float32", "float16", "float64")[n % 3]
        heads = ((4, 2), (3, 1), (2, 2))[(n // 3) % 3]
        out.append(pytest.param(nq, nk, causal, window, order, tiles, dtype, heads,
                                id=f"{nq}x{nk}-{causal}-{window}-{order}-{tiles}-{dtype}-{heads}"))
    return out


@pytest.mark.parametrize("nq,nk,causal,window,order,tiles,dtype,heads", _cases())
def test_tiled_counted_equals_model(rng, nq, nk, causal, window, order, tiles, dtype, heads):
    prob = _problem(nq, nk, hq=heads[0], hkv=heads[1], dtype=dtype)
    cfg = TileConfig(block_q=tiles[0], block_k=tiles[1], loop_order=order)
    t = counted("tiled", rng, prob, causal, window, cfg)
    m = traffic.model(order, causal=causal, window=window, config=cfg, **prob)
    assert t.as_dict() == m.as_dict()
    assert t == m


@pytest.mark.parametrize("nq,nk,causal,window", [(113, 203, False, None), (239, 1, True, None),
                                                 (64, 300, False, (5, 5)), (1, 1, True, None)])
@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_naive_counted_equals_model(rng, nq, nk, causal, window, dtype):
    prob = _problem(nq, nk, hq=6, hkv=2, dtype=dtype)
    t = counted("naive", rng, prob, causal, window)
    assert t == traffic.model("naive", causal=causal, window=window, **prob)


def test_naive_model_by_hand():
    """One head, N = 4096, d = 128, fp16: 4 N d mandatory + 4 N^2 for S and P (+ LSE)."""
    N, d = 4096, 128
    t = traffic.model("naive", **_problem(N, N, d=d, hq=1, hkv=1, b=1, dtype="float16"))
    assert t.by_tensor["S"] == [N * N * 2, N * N * 2]
    assert t.by_tensor["P"] == [N * N * 2, N * N * 2]
    assert t.total - t.by_tensor["LSE"][1] == 4 * N * d * 2 + 4 * N * N * 2   # 138,412,032 B
    assert t.total - t.by_tensor["LSE"][1] == ik.roofline.worked_example()["naive_total_bytes"]


@pytest.mark.parametrize("nq,nk,br,bc", [(256, 256, 64, 64), (250, 130, 64, 32), (7, 500, 16, 128)])
def test_unmasked_models_by_hand(nq, nk, br, bc):
    """Without masks: FA2 reads K, V Tr times and Q once; FA1 reads K, V once and Q, O Tc times."""
    d, st, acc = 40, 2, 4
    prob = _problem(nq, nk, d=d, hq=1, hkv=1, b=1, dtype="float16")
    Tr, Tc = math.ceil(nq / br), math.ceil(nk / bc)
    fa2 = traffic.model("fa2", config=TileConfig(br, bc, "fa2"), **prob).as_dict()
    assert fa2 == {"Q": (nq * d * st, 0), "K": (Tr * nk * d * st, 0), "V": (Tr * nk * d * st, 0),
                   "O": (0, nq * d * st), "LSE": (0, nq * acc)}
    fa1 = traffic.model("fa1", config=TileConfig(br, bc, "fa1"), **prob).as_dict()
    assert fa1 == {"Q": (Tc * nq * d * st, 0), "K": (nk * d * st, 0), "V": (nk * d * st, 0),
                   "O": (Tc * nq * d * st, (Tc + 1) * nq * d * st),
                   "m": ((Tc + 1) * nq * acc, (Tc + 1) * nq * acc),
                   "l": ((Tc + 1) * nq * acc, (Tc + 1) * nq * acc), "LSE": (0, nq * acc)}


def test_causal_skips_about_half_the_kv_tiles():
    prob = _problem(2048, 2048, d=64, hq=1, hkv=1, b=1, dtype="float16")
    cfg = TileConfig(64, 64)
    full = traffic.model("fa2", config=cfg, **prob).by_tensor["K"][0]
    causal = traffic.model("fa2", causal=True, config=cfg, **prob).by_tensor["K"][0]
    Tr = 2048 // 64
    assert causal == full * (Tr + 1) / (2 * Tr)          # tiles on and below the diagonal
    naive = traffic.model("naive", **prob)               # naive skips nothing
    assert naive == traffic.model("naive", causal=True, **prob)


def test_window_reads_a_band():
    """A (left, right) window reads only the band's tiles: K bytes grow like N, not N^2."""
    cfg = TileConfig(32, 32)
    k_bytes = [traffic.model("fa2", window=(64, 0), config=cfg,
                             **_problem(n, n, hq=1, hkv=1, b=1)).by_tensor["K"][0]
               for n in (512, 1024, 2048)]
    assert k_bytes[1] / k_bytes[0] == pytest.approx(2, rel=0.05)
    assert k_bytes[2] / k_bytes[1] == pytest.approx(2, rel=0.05)


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_varlen_traffic_is_the_sum_of_its_sequences(rng, order):
    lens_q, lens_k = [40, 0, 70, 13], [9, 30, 0, 100]
    q, k, v, cq, ck = testing.make_varlen_inputs(rng, lens_q, lens_k, heads_q=4, heads_kv=2, head_dim=24)
    cfg = TileConfig(16, 32, order)
    with traffic.count() as t:
        ik.attention_varlen(q, k, v, cq, ck, causal=True, config=cfg)
    expect = traffic.Traffic()
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            expect.merge(traffic.model(order, causal=True, config=cfg,
                                       **_problem(nq, nk, hq=4, hkv=2, b=1, dtype="float64")))
    assert t == expect
    assert t == ik.tiled.traffic_model_varlen(seqlens_q=lens_q, seqlens_k=lens_k, heads_q=4, heads_kv=2,
                                              head_dim=24, dtype="float64", causal=True, config=cfg)


# --------------------------------------------------------------------------- scaling laws
def test_naive_traffic_grows_like_n_squared():
    totals = [traffic.model("naive", **_problem(n, n, d=64, hq=1, hkv=1, b=1, dtype="float16")).total
              for n in (1024, 2048, 4096)]
    assert totals[1] / totals[0] == pytest.approx(4, rel=0.06)
    assert totals[2] / totals[1] == pytest.approx(4, rel=0.03)


def test_fa2_kv_rereads_double_when_tiles_halve():
    """For fixed N, halving Br doubles Tr and so doubles the K/V bytes (N^2 d / Br)."""
    prob = _problem(4096, 4096, d=64, hq=1, hkv=1, b=1, dtype="float16")
    kv = [traffic.model("fa2", config=TileConfig(br, 64), **prob).by_tensor["K"][0] for br in (128, 64, 32)]
    assert kv[1] == 2 * kv[0] and kv[2] == 2 * kv[1]


def test_fa2_traffic_follows_n2_d2_over_m():
    """Choose tiles from M the paper's way: halving M roughly doubles the K/V re-reads,
    doubling N roughly quadruples them."""
    d, dt = 64, "float16"
    def kv(n, m):
        cfg = TileConfig.from_sram(m, d, dt)
        return traffic.model("fa2", config=cfg, **_problem(n, n, d=d, hq=1, hkv=1, b=1, dtype=dt)).by_tensor["K"][0]
    for m in (32 * 1024, 64 * 1024):
        assert kv(4096, m // 2) / kv(4096, m) == pytest.approx(2, rel=0.3)
    assert kv(8192, 64 * 1024) / kv(4096, 64 * 1024) == pytest.approx(4, rel=0.05)


def test_io_complexity_table_shapes():
    rows = ik.tiled.io_complexity_table(seqlens=(1024, 2048, 4096), sram_bytes=(32 * 1024, 128 * 1024),
                                        head_dim=64, dtype="float16")
    by = {(r["seqlen"], r["sram_bytes"]): r for r in rows}
    assert len(rows) == 6
    for n in (1024, 2048, 4096):
        small, big = by[(n, 32 * 1024)], by[(n, 128 * 1024)]
        assert small["naive_bytes"] == big["naive_bytes"]            # naive ignores SRAM size
        assert big["flash_bytes"] < small["flash_bytes"] < small["naive_bytes"] * 1.01
        assert big["flash_bytes"] < big["naive_bytes"] * 0.6
        assert big["block_q"] * big["block_k"] > small["block_q"] * small["block_k"]
    assert by[(4096, 128 * 1024)]["flash_theta"] == by[(2048, 128 * 1024)]["flash_theta"] * 4


# --------------------------------------------------------------------------- SRAM capacity
def test_config_that_does_not_fit_sram_is_refused(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=32, head_dim=128, dtype="float32")
    big = TileConfig(block_q=256, block_k=256)
    assert big.sram_usage(128, "float32") > big.sram_bytes
    for order in ("fa2", "fa1"):
        with pytest.raises(ValueError, match="config"):
            ik.attention(q, k, v, config=big.replace(loop_order=order))
        with pytest.raises(ValueError, match="config"):
            traffic.model(order, config=big, **_problem(32, 32, d=128))
    tiny = TileConfig(block_q=16, block_k=16, sram_bytes=8 * 1024)
    with pytest.raises(ValueError, match="sram_bytes"):
        ik.attention(q, k, v, config=tiny)
    ik.attention(q, k, v, config=tiny.replace(sram_bytes=64 * 1024))   # the same tiles, more room: fine
