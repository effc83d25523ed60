"""Quantized and bfloat16 KV caches: power-of-two block scales, the stated error bounds
(per value and for decode), paged decode and gather dequantizing on chip, traffic counted
== modelled with bytes per token halved, and the cache's invariants kept."""
import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import paged, reference, testing, traffic
from iokernels.paged import OutOfBlocks, PagedKVCache

dec = importlib.import_module("iokernels.decode")
QUANT = ["float8_e4m3fn", "int8"]
GRAN = ["block_head", "block"]


def outliers(rng, shape, dtype=np.float64):
    """Normal values with rare large ones (the FlashAttention-3 paper's FP8 test mix)."""
    x = rng.standard_normal(shape) + rng.standard_normal(shape) * 10 * (rng.random(shape) < 0.01)
    return x.astype(dtype)


def per_token_scales(cache, sid, scales):
    """A sequence's block scales expanded to (Hkv or 1, n, 1): the scale each stored value used."""
    n = cache.seq_len(sid)
    table = np.repeat(np.asarray(cache.block_table(sid), dtype=np.int64), cache.block_size)[:n]
    return scales[table].T[:, :, None]


# --------------------------------------------------------------------------- the format
@pytest.mark.parametrize("kv_dtype", QUANT)
def test_power_of_two_scale_is_the_smallest_that_fits(rng, kv_dtype):
    amax = np.abs(rng.standard_normal(200)) * 10.0 ** rng.integers(-6, 6, 200)
    s = paged.power_of_two_scale(amax, kv_dtype).astype(np.float64)
    qmax = paged.QUANT_FORMATS[kv_dtype]
    assert np.all(np.frexp(s)[0] == 0.5)                            # powers of two
    assert np.all(amax / s <= qmax) and np.all(amax / (s / 2) > qmax)
    assert paged.power_of_two_scale(0.0, kv_dtype) == paged.MIN_SCALE


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_one_rounding_stays_within_the_stated_bound(rng, kv_dtype, dtype):
    x = outliers(rng, (64, 3, 40)).astype(testing.numpy_dtype(dtype))
    s = paged.power_of_two_scale(np.abs(x.astype(np.float32)).max(axis=(0, 2)), kv_dtype)[None, :, None]
    xq = paged.dequantize(paged.quantize(x, s, kv_dtype), s, np.float64)
    err = np.abs(xq - testing.as_numpy(x))
    bound = paged.quantization_error_bound(testing.as_numpy(x), s, kv_dtype)
    if kv_dtype == "int8":
        bound = bound / 2                                           # one rounding: half a step
    assert np.all(err <= bound) and err.max() > 0.1 * bound.max()   # the bound is near-tight
    assert np.isfinite(xq).all()


# --------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("gran", GRAN)
def test_appends_token_by_token_stay_within_the_bound(rng, kv_dtype, gran):
    """Growing values force requantization of partial blocks; the stated bound still holds."""
    hkv, d, bs, n = 3, 19, 8, 45
    k = outliers(rng, (n, hkv, d)) * np.linspace(0.01, 3, n)[:, None, None]   # magnitudes grow
    v = outliers(rng, (n, hkv, d))
    cache = PagedKVCache(12, bs, num_kv_heads=hkv, head_dim=d, dtype=np.float64, kv_dtype=kv_dtype,
                         scale_granularity=gran)
    one, many = cache.new_sequence(), cache.new_sequence()
    cache.append(one, k, v)
    for t in range(n):
        cache.append(many, k[t:t + 1], v[t:t + 1])
    assert cache.k_pool.dtype.itemsize == 1 and cache.k_scale.shape == (12, hkv if gran == "block_head" else 1)
    for sid in (one, many):
        kg, vg = cache.gather(sid)
        assert kg.dtype == np.float64 and np.isfinite(kg).all()
        for x, xg, sc in ((k, kg, cache.k_scale), (v, vg, cache.v_scale)):
            s = per_token_scales(cache, sid, sc)
            err = np.abs(xg - x.transpose(1, 0, 2))
            bound = paged.quantization_error_bound(x.transpose(1, 0, 2), s, kv_dtype)
            assert np.all(err <= bound)
            if sid == one and kv_dtype == "int8":
                assert np.all(err <= bound / 2)                     # no requantization: one rounding


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_copy_on_write_and_out_of_blocks_with_scales(rng, kv_dtype):
    hkv, d = 2, 5
    cache = PagedKVCache(3, 4, num_kv_heads=hkv, head_dim=d, dtype=np.float32, kv_dtype=kv_dtype)
    a = cache.new_sequence()
    k, v = outliers(rng, (6, hkv, d), np.float32), outliers(rng, (6, hkv, d), np.float32)
    cache.append(a, k, v)
    b = cache.fork(a)
    before_a = cache.gather(a)
    tail = cache.block_table(a)[-1]
    scale_before = cache.k_scale[tail].copy()
    big = 100 * outliers(rng, (1, hkv, d), np.float32)              # forces the copy's scale up
    cache.append(b, big, big)
    assert cache.block_table(b)[-1] != tail and np.array_equal(cache.k_scale[tail], scale_before)
    for x, y in zip(before_a, cache.gather(a)):                     # the shared block is untouched
        assert np.array_equal(x, y)
    assert np.all(cache.k_scale[cache.block_table(b)[-1]] >= scale_before)
    snap = cache.snapshot()
    with pytest.raises(OutOfBlocks, match="k_new"):
        cache.append(b, *(outliers(rng, (9, hkv, d), np.float32),) * 2)
    assert cache.snapshot() == snap


@pytest.mark.parametrize("kv_dtype", QUANT + [None])
def test_unwritten_slots_read_as_nan(kv_dtype):
    cache = PagedKVCache(2, 4, num_kv_heads=1, head_dim=3, dtype=np.float32, kv_dtype=kv_dtype)
    scale = np.ones((1, 1, 1)) if kv_dtype else None
    codes = cache.k_pool[0]
    x = codes if kv_dtype is None else paged.dequantize(codes, scale, np.float32)
    assert np.isnan(x).all()


def test_bad_quantization_arguments_name_themselves(rng):
    for kw, name in ((dict(kv_dtype="fp4"), "kv_dtype"), (dict(kv_dtype="int8", scale_granularity="token"),
                                                          "scale_granularity"), (dict(dtype=np.int8), "dtype")):
        with pytest.raises(ValueError, match=name):
            PagedKVCache(4, **kw)
    cache = PagedKVCache(4, 4, num_kv_heads=1, head_dim=3, dtype=np.float32, kv_dtype="int8")
    s = cache.new_sequence()
    cache.append(s, *(rng.standard_normal((2, 1, 3)).astype(np.float32),) * 2)
    with pytest.raises(ValueError, match="backend"):
        cache.gather(s, backend="numba")
    with pytest.raises(ValueError, match="cache: a int8 cache is dequantized by the 'tiled', 'numba', 'cupy'"):
        ik.paged_decode(rng.standard_normal((1, 2, 3)).astype(np.float32), cache, [s], backend="torch")


# --------------------------------------------------------------------------- decode
def _filled(rng, kv_dtype, dtype, B, hq, hkv, N, d, bs=16, gran="block_head"):
    q, k, v = testing.make_inputs(rng, batch=B, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_k=N,
                                  head_dim=d, dtype=dtype)
    q = q[:, :, 0]
    lens = rng.integers(1, N + 1, size=B)
    lens[-1] = N
    cache = PagedKVCache(B * (-(-N // bs)) + 2, bs, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                         kv_dtype=kv_dtype, scale_granularity=gran)
    sids = []
    for b, n in enumerate(lens):
        sids.append(cache.new_sequence())
        cache.append(sids[-1], k[b, :, :n].transpose(1, 0, 2).copy(), v[b, :, :n].transpose(1, 0, 2).copy())
    k_hat, v_hat = np.zeros(k.shape), np.zeros(v.shape)             # what the cache holds, dequantized
    for b, (sid, n) in enumerate(zip(sids, lens)):
        k_hat[b, :, :n], v_hat[b, :, :n] = cache.gather(sid)
    return q, k, v, lens, cache, sids, k_hat, v_hat


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("gran", GRAN)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_quantized_paged_decode_is_exact_on_the_dequantized_cache(rng, kv_dtype, gran, num_splits):
    """The kernel itself adds nothing: float64 decode matches the oracle on the cache's own values."""
    q, k, v, lens, cache, sids, k_hat, v_hat = _filled(rng, kv_dtype, "float64", 3, 6, 2, 70, 33, gran=gran)
    o, lse = ik.paged_decode(q, cache, sids, num_splits=num_splits, return_lse=True)
    ro, rl = reference.decode(q, k_hat, v_hat, seq_lens=lens)
    testing.assert_close(o, ro, name="O")
    testing.assert_close(lse, rl, name="LSE")
    for window in ((0, 0), (20, -1)):
        o, lse = ik.paged_decode(q, cache, sids, num_splits=num_splits, window=window, return_lse=True)
        testing.assert_close(o, reference.decode(q, k_hat, v_hat, seq_lens=lens, window=window)[0], name="O")


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("N", [17, 200])
def test_quantized_decode_error_against_the_oracle_is_within_the_stated_bound(rng, kv_dtype, N):
    q, k, v, lens, cache, sids, k_hat, v_hat = _filled(rng, kv_dtype, "float32", 3, 8, 2, N, 64)
    o, lse = ik.paged_decode(q, cache, sids, return_lse=True)
    ro, rl = reference.decode(q, k, v, seq_lens=lens)                # the oracle on the exact values
    ob, lb = dec.perturbed_decode_error_bound(q, k, v, k_hat, v_hat, seq_lens=lens)
    f32 = 1e-5                                                      # float32 arithmetic on O(1) values
    assert np.all(np.abs(o - ro).max(axis=-1) <= ob + f32)
    assert np.all(np.abs(lse - rl) <= lb + f32)
    assert np.abs(o - ro).max() > 1e-4                              # quantization is visible ...
    assert np.abs(o - ro).max() < 0.2                               # ... and small


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_caches_follow_the_2x_rule(rng, dtype):
    q, k, v, lens, cache, sids, k_hat, v_hat = _filled(rng, None, dtype, 3, 6, 2, 90, 64)
    assert cache.k_pool.dtype == testing.numpy_dtype(dtype)
    assert np.array_equal(k_hat, testing.as_numpy(k) * (np.arange(90)[:, None] < lens[:, None, None, None]))
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    for ns in (1, 4):
        o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, return_lse=True)
        assert o.dtype == testing.numpy_dtype(dtype) and lse.dtype == np.float32
        testing.assert_close(o, ro, bo, name="O")
        testing.assert_close(lse, rl, bl, name="LSE")


# --------------------------------------------------------------------------- traffic
@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("gran", GRAN)
@pytest.mark.parametrize("num_splits", [1, 2, None])
def test_quantized_traffic_counted_equals_modelled_and_halves_the_cache_bytes(rng, kv_dtype, gran, num_splits):
    B, hq, hkv, N, d = 3, 4, 2, 50, 16
    q, _, _, lens, cache, sids, _, _ = _filled(rng, kv_dtype, "float16", B, hq, hkv, N, d, gran=gran)
    kw = dict(batch=B, heads_q=hq, heads_kv=hkv, head_dim=d, seq_lens=lens, num_splits=num_splits,
              dtype="float16", block_size=16)
    with traffic.count() as t:
        ik.paged_decode(q, cache, sids, num_splits=num_splits)
    m = traffic.model("paged_decode", kv_dtype=kv_dtype, **kw)
    assert t.as_dict() == m.as_dict()
    plain = traffic.model("paged_decode", **kw)
    assert 2 * t.by_tensor["K_cache"][0] == plain.by_tensor["K_cache"][0]      # 1 byte a value, not 2
    with traffic.count() as t:
        cache.gather(sids[0])
    g = traffic.model("paged_gather", seq_len=int(lens[0]), heads_kv=hkv, head_dim=d, block_size=16,
                      dtype="float16", kv_dtype=kv_dtype, scale_granularity=gran)
    assert t.as_dict() == g.as_dict()
    f16 = PagedKVCache(2, 16, num_kv_heads=hkv, head_dim=d, dtype=np.float16)
    assert cache.bytes_per_token() == f16.bytes_per_token() / 2 + 2 * cache.k_scale.shape[1] * 4 / 16
