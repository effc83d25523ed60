"""Decode (contiguous and paged) against the float64 oracle, merge_states, the num_splits
heuristic, traffic counted == modelled, and the decode calculators."""
import importlib
import itertools

import numpy as np
import pytest

import iokernels as ik
from iokernels import reference, testing, traffic
from iokernels.paged import PagedKVCache

# ``ik.decode`` is the public function; the module of the same name is reached by its full name
dec = importlib.import_module("iokernels.decode")

SPLITS = [1, 2, 3, 7, 17, 64]          # 64: more splits than any sequence here has tiles
HEADS = [(4, 4), (6, 2), (5, 1)]       # MHA, GQA (g = 3), MQA


def make_decode(rng, B, hq, hkv, N, d, dtype="float64"):
    q, k, v = testing.make_inputs(rng, batch=B, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_k=N,
                                  head_dim=d, dtype=dtype)
    return q[:, :, 0], k, v


def ragged_lens(rng, B, N):
    lens = rng.integers(1, N + 1, size=B)
    lens[0], lens[-1] = 0, N               # an empty sequence and a full one
    return lens


def fill_cache(cache, k, v, lens):
    sids = []
    for b, n in enumerate(lens):
        s = cache.new_sequence()
        cache.append(s, k[b, :, :n].transpose(1, 0, 2).copy(), v[b, :, :n].transpose(1, 0, 2).copy())
        sids.append(s)
    return sids


def check64(o, lse, ro, rl):
    empty = np.isneginf(rl)
    testing.assert_close(o, ro, name="O", masked_rows=empty[..., None])
    testing.assert_close(lse, rl, name="LSE")


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("num_splits", SPLITS + [None])
def test_decode_matches_oracle(rng, hq, hkv, num_splits):
    B, N, d = 4, 83, 59
    q, k, v = make_decode(rng, B, hq, hkv, N, d)
    lens = ragged_lens(rng, B, N)
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    o, lse = ik.decode(q, k, v, num_splits=num_splits, seq_lens=lens, return_lse=True)
    assert o.dtype == np.float64 and lse.shape == (B, hq)
    check64(o, lse, ro, rl)
    assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))   # the empty sequence


def test_decode_naive_matches_oracle(rng):
    q, k, v = make_decode(rng, 3, 6, 2, 40, 111)
    lens = ragged_lens(rng, 3, 40)
    o, lse = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    check64(o, lse, *reference.decode(q, k, v, seq_lens=lens))


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("num_splits", SPLITS + [None])
def test_paged_decode_matches_oracle(rng, hq, hkv, num_splits):
    B, N, d = 4, 70, 33
    q, k, v = make_decode(rng, B, hq, hkv, N, d)
    lens = ragged_lens(rng, B, N)
    cache = PagedKVCache(40, 16, num_kv_heads=hkv, head_dim=d, dtype=np.float64)
    sids = fill_cache(cache, k, v, lens)
    o, lse = ik.paged_decode(q, cache, sids, num_splits=num_splits, return_lse=True)
    check64(o, lse, *reference.decode(q, k, v, seq_lens=lens))


def test_paged_decode_over_forked_and_prefix_shared_blocks(rng):
    hq, hkv, d, bs = 4, 2, 24, 4
    cache = PagedKVCache(30, bs, num_kv_heads=hkv, head_dim=d, dtype=np.float64)
    base_k, base_v = rng.standard_normal((2, 10, hkv, d))
    a = cache.new_sequence()
    cache.append(a, base_k, base_v)
    b = cache.fork(a)
    extra = rng.standard_normal((2, 5, hkv, d))
    cache.append(b, extra[0], extra[1])                       # copy-on-write of a's last block
    c = cache.new_sequence()
    ids = rng.integers(0, 50, size=8)
    cache.append(c, base_k[:8], base_v[:8], token_ids=ids)
    e = cache.new_sequence()
    cache.append(e, base_k[:8], base_v[:8], token_ids=ids)    # prefix hits
    assert cache.block_table(e) == cache.block_table(c)
    sids = [a, b, c, e]
    q = rng.standard_normal((4, hq, d))
    full = [(base_k, base_v), (np.concatenate([base_k, extra[0]]), np.concatenate([base_v, extra[1]])),
            (base_k[:8], base_v[:8]), (base_k[:8], base_v[:8])]
    N = 15
    k = np.zeros((4, hkv, N, d))
    v = np.zeros((4, hkv, N, d))
    for i, (kk, vv) in enumerate(full):
        k[i, :, :len(kk)], v[i, :, :len(vv)] = kk.transpose(1, 0, 2), vv.transpose(1, 0, 2)
    lens = np.array([len(x[0]) for x in full])
    for ns in (1, 3):
        o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, return_lse=True)
        check64(o, lse, *reference.decode(q, k, v, seq_lens=lens))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_low_precision_follows_the_2x_rule(rng, dtype):
    q, k, v = make_decode(rng, 3, 6, 2, 150, 64, dtype=dtype)
    lens = ragged_lens(rng, 3, 150)
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    cache = PagedKVCache(40, 16, num_kv_heads=2, head_dim=64, dtype=dtype)
    sids = fill_cache(cache, k, v, lens)
    for ns in (1, 5):
        o, lse = ik.decode(q, k, v, num_splits=ns, seq_lens=lens, return_lse=True)
        assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
        testing.assert_close(o, ro, bo, name="O")
        testing.assert_close(lse, rl, bl, name="LSE")
        po, pl = ik.paged_decode(q, cache, sids, num_splits=ns, return_lse=True)
        testing.assert_close(po, ro, bo, name="paged O")
        testing.assert_close(pl, rl, bl, name="paged LSE")


# --------------------------------------------------------------------------- merge_states
def partial_states(rng, q, k, v, cuts):
    """Partial (O_s, LSE_s) of one decode problem over key chunks, from the float64 oracle."""
    os_, ls_ = [], []
    for a, z in zip(cuts[:-1], cuts[1:]):
        if z > a:
            o, lse = reference.decode(q, k[:, :, a:z], v[:, :, a:z])
        else:                                                 # an empty chunk: O garbage, LSE -inf
            o = np.full(q.shape, np.nan)
            lse = np.full(q.shape[:2], -np.inf)
        os_.append(o), ls_.append(lse)
    return np.stack(os_), np.stack(ls_)


def test_merge_states_is_exact(rng):
    q, k, v = make_decode(rng, 2, 4, 2, 90, 31)
    ro, rl = reference.decode(q, k, v)
    op, lp = partial_states(rng, q, k, v, [0, 13, 13, 50, 90, 90])
    o, lse = ik.merge_states(op, lp)
    check64(o, lse, ro, rl)


def test_merge_states_associative_and_order_independent(rng):
    q, k, v = make_decode(rng, 2, 3, 3, 64, 17)
    op, lp = partial_states(rng, q, k, v, [0, 10, 30, 31, 64])
    whole = ik.merge_states(op, lp)
    left = ik.merge_states(op[:2], lp[:2])
    right = ik.merge_states(op[2:], lp[2:])
    nested = ik.merge_states(np.stack([left[0], right[0]]), np.stack([left[1], right[1]]))
    inner = ik.merge_states(op[1:3], lp[1:3])
    other = ik.merge_states(np.stack([op[0], inner[0], op[3]]), np.stack([lp[0], inner[1], lp[3]]))
    for o, lse in (nested, other):
        np.testing.assert_allclose(o, whole[0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse, whole[1], rtol=0, atol=1e-13)
    for perm in itertools.permutations(range(4)):
        o, lse = ik.merge_states(op[list(perm)], lp[list(perm)])
        np.testing.assert_allclose(o, whole[0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse, whole[1], rtol=0, atol=1e-13)


def test_merge_states_with_empty_parts_is_never_nan(rng):
    o_parts = rng.standard_normal((3, 2, 5, 8))
    lse_parts = rng.standard_normal((3, 2, 5))
    o_parts[1] = np.nan                                       # an empty split's garbage
    lse_parts[1] = -np.inf
    lse_parts[:, 0, 2] = -np.inf                              # a row where every part is empty
    o, lse = ik.merge_states(o_parts, lse_parts)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[0, 2] == 0) and np.isneginf(lse[0, 2])
    keep = [0, 2]
    o2, lse2 = ik.merge_states(o_parts[keep], lse_parts[keep])   # -inf parts weigh exactly nothing
    np.testing.assert_allclose(o, o2, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(lse, lse2)
    # float32 parts: float32 LSE, o_parts' dtype kept
    o3, lse3 = ik.merge_states(o_parts.astype(np.float32), lse_parts.astype(np.float32))
    assert o3.dtype == np.float32 and lse3.dtype == np.float32 and not np.isnan(o3).any()


def test_merge_states_shape_errors(rng):
    with pytest.raises(ValueError, match="lse_parts"):
        ik.merge_states(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4)))
    with pytest.raises(ValueError, match="o_parts"):
        ik.merge_states(np.zeros((0, 3, 4)), np.zeros((0, 3)))


# --------------------------------------------------------------------------- the heuristic
@pytest.mark.parametrize("batch,heads_kv,seqlen,sms", [(1, 8, 32768, 132), (1, 32, 4096, 132), (2, 2, 1000, 108),
                                                        (4, 32, 8192, 132), (1, 1, 16, 132), (3, 5, 777, 80)])
def test_occupancy_splits_follows_its_rule(batch, heads_kv, seqlen, sms):
    bn = 128
    s, eff = dec.occupancy_splits(batch, heads_kv, seqlen, sms, block_n=bn, return_efficiency=True)
    tiles = -(-seqlen // bn)
    blocks = batch * heads_kv
    if blocks >= 0.8 * sms or tiles <= 1:
        assert s == 1
        return
    assert 1 <= s <= min(sms, tiles, dec.MAX_SPLITS)
    waves = blocks * s / sms
    assert np.isclose(eff[s - 1], waves / np.ceil(waves))
    assert eff[s - 1] >= 0.85 * max(eff)
    assert all(e < 0.85 * max(eff) for e in eff[:s - 1] if e > 0)  # no smaller S would do


def test_occupancy_splits_splits_small_grids_and_not_full_ones():
    assert dec.occupancy_splits(1, 8, 32768, 132, block_n=128) > 4       # 8 blocks on 132 SMs
    assert dec.occupancy_splits(16, 8, 32768, 132, block_n=128) == 1     # 128 blocks: full
    assert dec.occupancy_splits(1, 8, 100, 132, block_n=128) == 1        # one tile: nothing to split
    with pytest.raises(ValueError, match="num_sms"):
        dec.occupancy_splits(1, 8, 100, 0)


def test_split_ranges_cover_the_sequence_in_whole_tiles():
    for n, S, bn in [(83, 3, 16), (83, 17, 16), (0, 4, 16), (16, 2, 16), (100, 7, 8)]:
        r = dec.split_ranges(n, S, bn)
        assert len(r) == S and r[0][0] == 0 and r[-1][1] == n
        assert all(a == b_ for (_, a), (b_, _) in zip(r[:-1], r[1:]))       # contiguous
        assert all(a % bn == 0 for a, z in r if z > a)


# --------------------------------------------------------------------------- traffic
@pytest.mark.parametrize("num_splits", [1, 3, 17, None])
def test_decode_traffic_counted_equals_modelled(rng, num_splits):
    B, hq, hkv, N, d = 3, 6, 2, 75, 40
    q, k, v = make_decode(rng, B, hq, hkv, N, d, dtype="float32")
    lens = ragged_lens(rng, B, N)
    with traffic.count() as t:
        ik.decode(q, k, v, num_splits=num_splits, seq_lens=lens)
    m = traffic.model("decode", batch=B, heads_q=hq, heads_kv=hkv, head_dim=d, seq_lens=lens,
                      num_splits=num_splits, dtype="float32")
    assert t.as_dict() == m.as_dict()
    assert t.by_tensor["K"][0] == hkv * int(lens.sum()) * d * 4             # K read exactly once
    with traffic.count() as t:
        ik.decode(q, k, v, seq_lens=lens, backend="naive")
    assert t.as_dict() == dec.traffic_model_naive(batch=B, heads_q=hq, heads_kv=hkv, head_dim=d,
                                                  seq_lens=lens, dtype="float32").as_dict()


@pytest.mark.parametrize("num_splits", [1, 2, 9, None])
def test_paged_decode_traffic_counted_equals_modelled(rng, num_splits):
    B, hq, hkv, N, d = 3, 4, 4, 50, 16
    q, k, v = make_decode(rng, B, hq, hkv, N, d, dtype="float32")
    lens = ragged_lens(rng, B, N)
    cache = PagedKVCache(20, 16, num_kv_heads=hkv, head_dim=d, dtype=np.float32)
    sids = fill_cache(cache, k, v, lens)
    with traffic.count() as t:
        ik.paged_decode(q, cache, sids, num_splits=num_splits)
    m = traffic.model("paged_decode", batch=B, heads_q=hq, heads_kv=hkv, head_dim=d, seq_lens=lens,
                      num_splits=num_splits, dtype="float32", block_size=16)
    assert t.as_dict() == m.as_dict()


# --------------------------------------------------------------------------- errors, calculators
def test_decode_errors_name_the_argument(rng):
    q, k, v = make_decode(rng, 2, 4, 2, 10, 8)
    with pytest.raises(ValueError, match="num_splits"):
        ik.decode(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="seq_lens"):
        ik.decode(q, k, v, seq_lens=np.array([3, 11]))
    cache = PagedKVCache(4, 4, num_kv_heads=2, head_dim=8, dtype=np.float64)
    s = cache.new_sequence()
    with pytest.raises(ValueError, match="seq_id"):
        ik.paged_decode(q, cache, [s, 99])
    with pytest.raises(ValueError, match="q: dtype"):
        ik.paged_decode(q[:1].astype(np.float32), cache, [s])


def test_decode_calculators_reproduce_the_articles_numbers():
    r = dec.decode_bytes_per_token(32768, batch=1, layers=32, kv_heads=8, head_dim=128, itemsize=2)
    assert r["kv_bytes"] == 32768 * 128 * 1024                             # 4.29 GB
    assert round(r["kv_bytes"] / 1e9, 2) == 4.29
    assert round(dec.decode_time_bound(r["kv_bytes"], 3.35e12) * 1e3, 2) == 1.28
    assert round(dec.decode_time_bound(16e9, 3.35e12) * 1e3, 1) == 4.8      # weights, once per step
    r8 = dec.decode_bytes_per_token(32768, batch=8, weight_bytes=16e9)
    t_kv = dec.decode_time_bound(r8["kv_bytes"], 3.35e12)
    assert round(t_kv * 1e3) == 10 and r8["kv_bytes"] > 2 * r8["weight_bytes"]
    with pytest.raises(ValueError, match="bandwidth"):
        dec.decode_time_bound(1, 0)


# --------------------------------------------------------------------------- sliding window
WINDOWS = [(0, -1), (1, 0), (5, -1), (16, 3), (37, 0), (200, -1), (-1, 4)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_windowed_decode_matches_oracle(rng, window, num_splits):
    B, hq, hkv, N, d = 4, 6, 2, 83, 59
    q, k, v = make_decode(rng, B, hq, hkv, N, d)
    lens = ragged_lens(rng, B, N)
    ro, rl = reference.decode(q, k, v, seq_lens=lens, window=window)
    for backend in ("tiled", "naive"):
        o, lse = ik.decode(q, k, v, num_splits=num_splits, seq_lens=lens, window=window, backend=backend,
                           return_lse=True)
        check64(o, lse, ro, rl)
    cache = PagedKVCache(40, 16, num_kv_heads=hkv, head_dim=d, dtype=np.float64)
    sids = fill_cache(cache, k, v, lens)
    o, lse = ik.paged_decode(q, cache, sids, num_splits=num_splits, window=window, return_lse=True)
    check64(o, lse, ro, rl)


def test_window_sees_the_last_left_plus_one_keys(rng):
    """Bottom-right alignment: the query is position n - 1, so (left, right) keeps keys >= n - 1 - left."""
    q, k, v = make_decode(rng, 1, 2, 1, 50, 8)
    for left in (0, 7, 48, 49, 60):
        o, lse = ik.decode(q, k, v, window=(left, 0), return_lse=True)
        keep = max(50 - 1 - left, 0)
        wo, wl = reference.decode(q, k[:, :, keep:], v[:, :, keep:])    # the same keys, unmasked
        check64(o, lse, wo, wl)
    assert dec.visible_start(50, (7, 3)) == 42 and dec.visible_start(0, (7, 0)) == 0


@pytest.mark.parametrize("window", [(0, 0), (20, -1), (33, 0), (-1, -1)])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_windowed_decode_traffic_counted_equals_modelled(rng, window, num_splits):
    B, hq, hkv, N, d = 3, 4, 2, 75, 24
    q, k, v = make_decode(rng, B, hq, hkv, N, d, dtype="float32")
    lens = ragged_lens(rng, B, N)
    kw = dict(batch=B, heads_q=hq, heads_kv=hkv, head_dim=d, seq_lens=lens, num_splits=num_splits,
              dtype="float32", window=window)
    with traffic.count() as t:
        ik.decode(q, k, v, num_splits=num_splits, seq_lens=lens, window=window)
    assert t.as_dict() == traffic.model("decode", **kw).as_dict()
    visible = sum(n - dec.visible_start(n, window) for n in lens)
    assert t.by_tensor["K"][0] == hkv * visible * d * 4                    # keys left of the window: never read
    cache = PagedKVCache(30, 16, num_kv_heads=hkv, head_dim=d, dtype=np.float32)
    sids = fill_cache(cache, k, v, lens)
    with traffic.count() as t:
        ik.paged_decode(q, cache, sids, num_splits=num_splits, window=window)
    assert t.as_dict() == traffic.model("paged_decode", block_size=16, **kw).as_dict()
    with traffic.count() as t:
        ik.decode(q, k, v, seq_lens=lens, window=window, backend="naive")
    assert t.as_dict() == dec.traffic_model_naive(**{x: kw[x] for x in kw if x != "num_splits"}).as_dict()


def test_window_errors_name_the_argument(rng):
    q, k, v = make_decode(rng, 2, 4, 2, 10, 8)
    for bad in ((3,), (-2, 0), (1.5, 0), "left"):
        with pytest.raises(ValueError, match="window"):
            ik.decode(q, k, v, window=bad)
    cache = PagedKVCache(4, 4, num_kv_heads=2, head_dim=8, dtype=np.float64)
    s = cache.new_sequence()
    with pytest.raises(ValueError, match="window"):
        ik.paged_decode(q[:1], cache, [s], window=(1, 2, 3))


def test_window_on_a_backend_without_it_is_a_clear_error(rng, monkeypatch):
    """A backend whose decode takes no ``window`` is refused by name; unbounded windows pass it nothing."""
    from iokernels import api
    calls = []

    def plain(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None):
        calls.append(1)
        return dec.decode_split_kv(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale)

    monkeypatch.setattr(api, "_resolve", lambda backend, op: plain)
    q, k, v = make_decode(rng, 1, 2, 1, 9, 4)
    with pytest.raises(ValueError, match="window: the 'tiled' backend has no sliding-window decode"):
        ik.decode(q, k, v, window=(3, 0))
    assert not calls
    ik.decode(q, k, v, window=(-1, -1))
    ik.decode(q, k, v, window=None)
    assert len(calls) == 2


def test_torch_refuses_a_window_by_name(rng):
    """torch's decode (SDPA) has no sliding window; numba and cupy take one (tests/test_gpu_decode_window_quant.py)."""
    q, k, v = make_decode(rng, 1, 2, 1, 9, 4, dtype="float32")
    with pytest.raises(ValueError, match="window: the 'torch' backend has no sliding-window decode"):
        ik.decode(q, k, v, window=(3, 0), backend="torch")
