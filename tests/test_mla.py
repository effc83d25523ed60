"""Multi-head latent attention decode: absorbed == unabsorbed == the float64 oracle, contiguous
and paged (quantized latent caches too), the 2x rule in low precision, traffic counted ==
modelled, and DeepSeek-V3's FLOPs per byte."""
import numpy as np
import pytest

from iokernels import mla, testing, traffic
from iokernels.paged import OutOfBlocks

#: awkward MLA shapes: latent, rotary, per-head key and value widths, heads
SHAPES = [dict(latent_dim=45, rope_dim=7, head_dim=19, v_head_dim=13, heads=6),
          dict(latent_dim=32, rope_dim=8, head_dim=16, v_head_dim=16, heads=5)]


def problem(rng, shape, B=4, N=70, dtype="float64"):
    x = mla.make_mla_inputs(rng, batch=B, seqlen=N, dtype=dtype, **shape)
    lens = rng.integers(1, N + 1, size=B)
    lens[0], lens[-1] = 0, N                                  # an empty sequence and a full one
    return x, lens


def fill(cache, kv_latent, lens):
    sids = []
    for b, n in enumerate(lens):
        sids.append(cache.new_sequence())
        cache.append(sids[-1], kv_latent[b, :n, None, :].copy())
    return sids


def check64(o, lse, ro, rl):
    testing.assert_close(o, ro, name="O", masked_rows=np.isneginf(rl)[..., None])
    testing.assert_close(lse, rl, name="LSE")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, (9, 0), (40, -1)])
def test_absorbed_equals_unabsorbed_equals_oracle(rng, shape, num_splits, window):
    x, lens = problem(rng, shape)
    ro, rl = mla.reference_mla(**x, seq_lens=lens, window=window)
    for fn in (mla.mla_decode_unabsorbed, mla.mla_decode_absorbed):
        o, lse = fn(**x, seq_lens=lens, num_splits=num_splits, window=window)
        assert o.shape == (4, shape["heads"], shape["v_head_dim"]) and o.dtype == np.float64
        check64(o, lse, ro, rl)
        assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 2, None])
def test_paged_latent_cache_matches_the_oracle(rng, shape, num_splits):
    x, lens = problem(rng, shape)
    cache = mla.latent_cache(30, shape["latent_dim"], shape["rope_dim"], dtype=np.float64)
    assert cache.v_pool is None and cache.bytes_per_token() == (shape["latent_dim"] + shape["rope_dim"]) * 8
    sids = fill(cache, x["kv_latent"], lens)
    child = cache.fork(sids[1])                               # shares its blocks; CoW on append
    extra = np.random.default_rng(1).standard_normal((3, 1, cache.head_dim))
    cache.append(child, extra)
    o, lse = mla.paged_mla_decode(x["q_nope"], x["q_rope"], cache, sids, x["w_uk"], x["w_uv"], num_splits=num_splits)
    check64(o, lse, *mla.reference_mla(**x, seq_lens=lens))
    kv = np.concatenate([x["kv_latent"][1:2, :lens[1]], extra[None, :, 0]], axis=1)
    q = {k: x[k][1:2] for k in ("q_nope", "q_rope")}
    o, lse = mla.paged_mla_decode(q["q_nope"], q["q_rope"], cache, [child], x["w_uk"], x["w_uv"])
    check64(o, lse, *mla.reference_mla(q["q_nope"], q["q_rope"], kv, x["w_uk"], x["w_uv"]))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "int8"])
def test_quantized_latent_cache_is_exact_on_its_own_rows(rng, kv_dtype):
    shape = SHAPES[0]
    x, lens = problem(rng, shape)
    cache = mla.latent_cache(30, shape["latent_dim"], shape["rope_dim"], dtype=np.float64, kv_dtype=kv_dtype)
    sids = fill(cache, x["kv_latent"], lens)
    rows = np.zeros_like(x["kv_latent"])                      # what the cache holds, dequantized
    for b, (s, n) in enumerate(zip(sids, lens)):
        k, v = cache.gather(s)
        assert v is None
        rows[b, :n] = k[0]
    valid = np.arange(70)[None, :] < lens[:, None]
    assert 0 < np.abs(rows - x["kv_latent"])[valid].max() < 0.5
    o, lse = mla.paged_mla_decode(x["q_nope"], x["q_rope"], cache, sids, x["w_uk"], x["w_uv"], num_splits=3)
    check64(o, lse, *mla.reference_mla(**dict(x, kv_latent=rows), seq_lens=lens))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_absorbed_follows_the_2x_rule(rng, dtype):
    """The baseline is the definition (unabsorbed) in the same precision."""
    shape = dict(latent_dim=64, rope_dim=16, head_dim=32, v_head_dim=32, heads=8)
    x, lens = problem(rng, shape, B=3, N=150, dtype=dtype)
    ro, rl = mla.reference_mla(**x, seq_lens=lens)
    bo, bl = mla.mla_decode_unabsorbed(**x, seq_lens=lens)
    cache = mla.latent_cache(40, 64, 16, dtype=dtype)
    sids = fill(cache, x["kv_latent"], lens)
    for ns in (1, 4):
        o, lse = mla.mla_decode_absorbed(**x, seq_lens=lens, num_splits=ns)
        assert o.dtype == testing.numpy_dtype(dtype) and lse.dtype == np.float32
        testing.assert_close(o, ro, bo, name="O")
        testing.assert_close(lse, rl, bl, name="LSE")
        po, pl = mla.paged_mla_decode(x["q_nope"], x["q_rope"], cache, sids, x["w_uk"], x["w_uv"], num_splits=ns)
        testing.assert_close(po, ro, bo, name="paged O")
        testing.assert_close(pl, rl, bl, name="paged LSE")


# --------------------------------------------------------------------------- traffic and FLOPs
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, (20, 0)])
def test_traffic_counted_equals_modelled(rng, num_splits, window):
    shape = SHAPES[0]
    x, lens = problem(rng, shape, dtype="float32")
    kw = dict(batch=4, seq_lens=lens, num_splits=num_splits, dtype="float32", window=window, **shape)
    for form, fn in (("absorbed", mla.mla_decode_absorbed), ("unabsorbed", mla.mla_decode_unabsorbed)):
        with traffic.count() as t:
            fn(**x, seq_lens=lens, num_splits=num_splits, window=window)
        assert t.as_dict() == mla.traffic_model(form, **kw).as_dict(), form
    for kv_dtype in (None, "int8"):
        cache = mla.latent_cache(30, shape["latent_dim"], shape["rope_dim"], dtype=np.float32, kv_dtype=kv_dtype)
        sids = fill(cache, x["kv_latent"], lens)
        with traffic.count() as t:
            mla.paged_mla_decode(x["q_nope"], x["q_rope"], cache, sids, x["w_uk"], x["w_uv"], num_splits=num_splits,
                                 window=window)
        m = mla.traffic_model("absorbed", paged=True, kv_dtype=kv_dtype, **kw)
        assert t.as_dict() == m.as_dict()
        if window is None:                                    # each row read once, for all heads
            row = shape["latent_dim"] + shape["rope_dim"]
            assert t.by_tensor["K_cache"][0] == int(lens.sum()) * row * (1 if kv_dtype else 4)


def test_unabsorbed_moves_heads_times_more_than_absorbed():
    v3 = mla.DEEPSEEK_V3_MLA
    kw = dict(batch=1, seq_lens=[4096], dtype="bfloat16", num_splits=1, **v3)
    a, u = mla.traffic_model("absorbed", **kw), mla.traffic_model("unabsorbed", **kw)
    assert a.by_tensor["KV_latent"][0] == 4096 * 576 * 2
    per_head_kv = 4096 * v3["heads"] * (128 + 64 + 128) * 2
    assert u.by_tensor["K"][1] + u.by_tensor["V"][1] == per_head_kv   # written, then read back
    assert u.total > 2 * per_head_kv > 100 * a.total


def test_deepseek_v3_decode_intensity_is_past_the_h200_ridge():
    """2 * 128 * (576 + 512) FLOPs per 1,152-byte row: about 242 FLOP/byte (the H200's ridge is about 206)."""
    from iokernels.core import roofline
    v3 = mla.DEEPSEEK_V3_MLA
    f = mla.mla_flops("absorbed", seq_lens=[1], **v3)
    assert f["attention"] == 2 * 128 * (576 + 512)
    assert round(f["attention"] / (576 * 2)) == 242
    assert f["attention"] / (576 * 2) > roofline.ridge_point("H200")
    u = mla.mla_flops("unabsorbed", seq_lens=[1], **v3)
    assert u["attention"] < f["attention"] and u["projection"] == 128 * 2 * 512 * 256


def test_errors_name_the_argument(rng):
    x, lens = problem(rng, SHAPES[1])
    with pytest.raises(ValueError, match="kv_latent"):
        mla.mla_decode_absorbed(**dict(x, kv_latent=x["kv_latent"][..., :-1]))
    with pytest.raises(ValueError, match="w_uk"):
        mla.mla_decode_absorbed(**dict(x, w_uk=x["w_uk"][:-1]))
    with pytest.raises(ValueError, match="q_rope"):
        mla.mla_decode_unabsorbed(**dict(x, q_rope=x["q_rope"][:, :-1]))
    with pytest.raises(ValueError, match="form"):
        mla.traffic_model("fused", batch=1, seq_lens=[1], **SHAPES[1])
    cache = mla.latent_cache(2, 32, 8, block_size=4)
    with pytest.raises(ValueError, match="cache"):
        import iokernels as ik
        ik.paged_decode(x["q_nope"][:1].astype(np.float32), cache, [cache.new_sequence()])
    s = cache.new_sequence()
    with pytest.raises(ValueError, match="v_new"):
        cache.append(s, np.ones((1, 1, 40), np.float32), np.ones((1, 1, 40), np.float32))
    before = cache.snapshot()
    with pytest.raises(OutOfBlocks):
        cache.append(s, np.ones((9, 1, 40), np.float32))
    assert cache.snapshot() == before
    with pytest.raises(ValueError, match="q_nope: dtype"):
        mla.paged_mla_decode(x["q_nope"][:1], x["q_rope"][:1], cache, [s], x["w_uk"], x["w_uv"])


def test_dtype_mismatches_name_the_argument(rng):
    x, _ = problem(rng, SHAPES[1])
    for fn in (mla.mla_decode_absorbed, mla.mla_decode_unabsorbed):
        with pytest.raises(ValueError, match="kv_latent: dtype"):
            fn(**dict(x, kv_latent=x["kv_latent"].astype(np.float32)))
        with pytest.raises(ValueError, match="w_uk, w_uv"):
            fn(**dict(x, w_uv=x["w_uv"].astype(np.float32)))
