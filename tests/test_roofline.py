"""The roofline calculator reproduces the source article's first-principles numbers.

The figures below are the published ones (SOURCE_FACTS.md: the article, the vendor
datasheets, the PagedAttention and Flash-Decoding write-ups); the code computes them
from the counts (FLOPs, bytes) and the GPU table, so a wrong count or a wrong table
entry fails here.
"""
import pytest

from iokernels import roofline as rl

N, D = 4096, 128


def test_forward_flops_of_one_head():
    assert rl.attention_flops(N, N, D) / 1e9 == pytest.approx(8.59, abs=0.005)
    assert rl.attention_flops(N, N, D, batch=8, heads=16) == 128 * rl.attention_flops(N, N, D)


def test_causal_flops_count_visible_pairs():
    exact = rl.attention_flops(N, N, D, causal=True)
    assert exact == 4 * D * N * (N + 1) // 2
    assert exact / rl.attention_flops(N, N, D) == pytest.approx(0.5, abs=1e-3)


def test_mandatory_and_naive_bytes():
    mand = rl.mandatory_bytes(N, N, D, itemsize=2)
    assert mand / 1e6 == pytest.approx(4.19, abs=0.005)
    assert N * N * 2 / 1e6 == pytest.approx(33.5, abs=0.06)                # one N x N fp16 matrix
    extra = rl.naive_extra_bytes(N, N, itemsize=2)
    assert extra / 1e6 == pytest.approx(134, abs=0.5)
    assert (mand + extra) / 1e6 == pytest.approx(138, abs=0.5)
    # GQA: K and V are read once per KV head
    assert rl.mandatory_bytes(N, N, D, heads=32, heads_kv=8) == 2 * (32 + 8) * N * D * 2


def test_intensity_and_ridge_points():
    ex = rl.worked_example()
    assert ex["naive_intensity"] == pytest.approx(62, abs=0.5)
    assert rl.ridge_point("H100 SXM") == pytest.approx(295, abs=1)
    assert rl.ridge_point("A100 80GB SXM") == pytest.approx(153, abs=1)
    assert rl.ridge_point("H200") == pytest.approx(206, abs=1)
    assert ex["below_ridge"] == pytest.approx(4.7, abs=0.1)
    assert rl.arithmetic_intensity(100.0, 4.0) == 25.0


def test_time_bounds_of_the_worked_example():
    ex = rl.worked_example()
    assert ex["memory_s"] * 1e6 == pytest.approx(41, abs=0.5)
    assert ex["compute_s"] * 1e6 == pytest.approx(8.7, abs=0.05)
    assert ex["bound"] == "memory" and ex["flash_bound"] == "compute"
    assert ex["fraction_moving_s_p"] == pytest.approx(0.8, abs=0.02)
    tb = rl.time_bounds(ex["flops"], ex["mandatory_bytes"], "H100 SXM")
    assert tb["bound"] == "compute" and tb["time_s"] == tb["compute_s"]


def test_kv_cache_figures():
    assert rl.kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024               # 0.5 MiB (Llama-2-7B)
    assert rl.kv_bytes_per_token(32, 32, 128, 2) * 4096 == 2 * 1024 ** 3    # 4,096-token reservation: 2 GiB
    per_token = rl.kv_bytes_per_token(32, 8, 128, 2)
    assert per_token == 128 * 1024                                            # 128 KiB (Llama-3-8B)
    ctx = per_token * 32 * 1024
    assert ctx / 1e9 == pytest.approx(4.29, abs=0.005)
    t = rl.time_bounds(0, ctx, "H100 SXM")
    assert t["memory_s"] * 1e3 == pytest.approx(1.28, abs=0.005)
    assert rl.worked_example()["decode_ms_per_token_32k"] == pytest.approx(1.28, abs=0.005)


@pytest.mark.parametrize("g", [1, 4, 8])
def test_decode_intensity_is_about_g(g):
    assert rl.decode_intensity(g, itemsize=2) == pytest.approx(g)
    assert rl.decode_intensity(g, itemsize=4) == pytest.approx(g / 2)
    # the same from first principles: one query token, N keys, g query heads per KV head
    n, d = 1000, 128
    flops = rl.attention_flops(1, n, d, heads=g)
    kv_bytes = 2 * n * d * 2
    assert flops / kv_bytes == pytest.approx(rl.decode_intensity(g))


def test_gpu_table_is_complete_and_cited():
    for name in ("A100 40GB SXM", "A100 80GB SXM", "H100 SXM", "H100 PCIe", "H200", "L4", "T4", "B200"):
        g = rl.get_gpu(name)
        assert g["name"] == name and g["source"] and not g["measured"]
        assert g["hbm_tbps"] > 0 and g["fp16_tflops"] > g["fp32_tflops"] > 0
        assert g["sms"] > 0 and g["smem_per_sm_kib"] <= g["l1_smem_per_sm_kib"]
    assert rl.get_gpu("H100 SXM")["fp16_tflops"] == pytest.approx(989, abs=1)
    assert rl.get_gpu("H200")["hbm_tbps"] == 4.8
    m = rl.get_gpu("H200 (measured)")
    assert m["measured"] and "measured" in m["source"]
    assert m["hbm_tbps"] < rl.get_gpu("H200")["hbm_tbps"]
    assert m["fp16_tflops"] < rl.get_gpu("H200")["fp16_tflops"]


def test_custom_gpu_and_errors():
    mine = dict(hbm_tbps=1.0, fp16_tflops=100.0, fp32_tflops=10.0)
    assert rl.ridge_point(mine) == pytest.approx(100)
    assert rl.ridge_point(mine, precision="fp32") == pytest.approx(10)
    with pytest.raises(ValueError, match="gpu"):
        rl.get_gpu("H900")
    with pytest.raises(ValueError, match="gpu"):
        rl.ridge_point(dict(hbm_tbps=1.0))
    with pytest.raises(ValueError, match="precision"):
        rl.ridge_point("H100 SXM", precision="fp8")
    with pytest.raises(ValueError, match="nbytes"):
        rl.arithmetic_intensity(1.0, 0)
