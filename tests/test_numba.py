"""The Numba CUDA kernels on the simulator (no GPU here): results against the float64
oracle, traffic counted by running the kernels against the NumPy versions' models, errors.

Sizes are tiny on purpose: the simulator runs every thread as a Python thread.
"""
import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import conventions as cv
from iokernels import gpu, reference, testing, traffic
from iokernels.core.config import TileConfig

pytestmark = pytest.mark.skipif(not gpu.simulator_enabled() and not gpu.has_gpu(),
                                reason="needs Numba's CUDA simulator or a GPU")
#: counting arrays are Python objects: the kernels count their loads and stores only on the
#: simulator (on a GPU, tests/test_numba_gpu.py checks results at real sizes instead)
sim_only = pytest.mark.skipif(not gpu.simulator_enabled(), reason="counted traffic needs Numba's CUDA simulator")

nc = pytest.importorskip("iokernels.numba_cuda")
from iokernels.numba_cuda import ForwardConfig, GatherConfig, counting  # noqa: E402
from iokernels.paged import PagedKVCache  # noqa: E402

#: small tiles so that tiny problems still have ragged tiles, several tiles, and skipped ones
TINY = {1: ForwardConfig(version="v1", block_q=8, block_k=8),
        2: ForwardConfig(version="v2", block_q=8, block_k=8),
        3: ForwardConfig(version="v3", block_q=8, block_k=8, threads_per_row=4, rows_per_thread=2),
        4: ForwardConfig(version="v4", block_q=8, block_k=8, threads_per_row=4, rows_per_thread=2)}


def _masked_rows(Nq, Nk, causal, window):
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    return (hi <= lo)[None, None, :, None]


# --------------------------------------------------------------------------- forward
@pytest.mark.parametrize("version", [1, 2, 3])
def test_forward_float64_matches_oracle(rng, version):
    # GQA (4 query heads on 2 KV heads), Nq > Nk with causal: the top rows are fully masked
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13,
                                  head_dim=7, dtype="float64")
    ro, rl = reference.attention(q, k, v, causal=True)
    o, lse = ik.attention(q, k, v, causal=True, backend="numba", config=TINY[version], return_lse=True)
    testing.assert_close(o, ro, masked_rows=_masked_rows(19, 13, True, None))
    testing.assert_close(lse, rl, name="lse")
    assert np.isneginf(lse[0, :, :6]).all() and (o[0, :, :6] == 0).all()


@pytest.mark.parametrize("step_keys,batched", [(4, True), (1, False), (8, False)])
def test_forward_step_keys_and_batched_sums_float64(rng, step_keys, batched):
    """The online-softmax step (keys folded per rescale) and the batched lane sums change the
    order of the arithmetic, never the result: float64 against the oracle, a window, GQA."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=11, seqlen_k=21,
                                  head_dim=6, dtype="float64")
    ro, rl = reference.attention(q, k, v, causal=True, window=(6, 2))
    cfg = TINY[4].replace(step_keys=step_keys, batched_lane_sums=batched)
    o, lse = ik.attention(q, k, v, causal=True, window=(6, 2), backend="numba", config=cfg, return_lse=True)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")
    with pytest.raises(ValueError, match="step_keys"):
        ForwardConfig(version="v4", step_keys=0)


@pytest.mark.parametrize("version", [2, 3])
def test_forward_window_nq_lt_nk_float64(rng, version):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, heads_kv=1, seqlen_q=9, seqlen_k=23,
                                  head_dim=5, dtype="float64")
    ro, rl = reference.attention(q, k, v, window=(4, 2), scale=0.37)
    o, lse = ik.attention(q, k, v, window=(4, 2), scale=0.37, backend="numba", config=TINY[version],
                          return_lse=True)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_forward_low_precision_two_x_rule(rng, dtype):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=17, seqlen_k=21,
                                  head_dim=11, dtype=dtype)
    ro, rl = reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    for version in (2, 3, 4) if dtype == "float16" else (2, 3):     # v4 float32: the float64 test's kernel
        o, lse = ik.attention(q, k, v, causal=True, backend="numba", config=TINY[version], return_lse=True)
        assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
        testing.assert_close(o, ro, bo)
        testing.assert_close(lse, rl, bl, name="lse")


def test_forward_default_config_and_device_arrays(rng):
    """The default (v4, Br=64) on a ragged problem; Numba device arrays in -> device arrays out."""
    from numba import cuda
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=5, seqlen_k=6, head_dim=3,
                                  dtype="float32")
    ro, _ = reference.attention(q, k, v)
    bo = ik.attention(q, k, v, backend="naive")
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    o = ik.attention(dq, dk, dv, backend="numba")
    assert not isinstance(o, np.ndarray) and hasattr(o, "copy_to_host")
    testing.assert_close(o.copy_to_host(), ro, bo)


# --------------------------------------------------------------------------- traffic
@sim_only
@pytest.mark.parametrize("version,causal,window", [(2, False, None), (2, True, None), (3, True, (5, 1))])
def test_counted_traffic_equals_fa2_model(rng, version, causal, window):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26,
                                  head_dim=3, dtype="float32")
    cfg = TINY[version]
    o, lse, counted = counting.count_attention(q, k, v, causal=causal, window=window, config=cfg)
    model = traffic.model("fa2", batch=1, heads_q=2, heads_kv=1, seqlen_q=19, seqlen_k=26, head_dim=3,
                          dtype="float32", causal=causal, window=window,
                          config=TileConfig(block_q=cfg.block_q, block_k=cfg.block_k))
    assert counted.as_dict() == model.as_dict()
    testing.assert_close(o, reference.attention(q, k, v, causal=causal, window=window)[0],
                         ik.attention(q, k, v, causal=causal, window=window, backend="naive"))


@sim_only
def test_forward_v4_float64_oracle_and_counted_traffic(rng):
    """v4 (4-key steps) in one simulated run: GQA, Nq > Nk causal (the top rows fully masked:
    O = 0, LSE = -inf) against the float64 oracle, and its traffic == the fa2 model."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13,
                                  head_dim=7, dtype="float64")
    o, lse, counted = counting.count_attention(q, k, v, causal=True, config=TINY[4])
    ro, rl = reference.attention(q, k, v, causal=True)
    testing.assert_close(o, ro, masked_rows=_masked_rows(19, 13, True, None))
    testing.assert_close(lse, rl, name="lse")
    assert np.isneginf(lse[0, :, :6]).all() and (o[0, :, :6] == 0).all()
    model = traffic.model("fa2", batch=1, heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=13, head_dim=7,
                          dtype="float64", causal=True, config=TileConfig(block_q=8, block_k=8))
    assert counted.as_dict() == model.as_dict()


@sim_only
def test_v1_reads_kv_once_per_row(rng):
    """v1 has no shared memory: each query row reads its visible keys itself."""
    Nq, Nk, d = 13, 17, 3
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                                  dtype="float32")
    _, _, counted = counting.count_attention(q, k, v, causal=True, config=TINY[1])
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, True)
    per_row = int(np.sum(hi - lo)) * d * 4
    assert counted.by_tensor["K"] == [per_row, 0] and counted.by_tensor["V"] == [per_row, 0]
    model = traffic.model("fa2", batch=1, heads_q=1, heads_kv=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                          dtype="float32", causal=True, config=TileConfig(block_q=8, block_k=8))
    assert per_row > model.by_tensor["K"][0]


# --------------------------------------------------------------------------- decode
def _decode_inputs(rng, B, Hq, Hkv, N, d, dtype):
    q = rng.standard_normal((B, Hq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, N, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, N, d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged_gqa_float64(rng, num_splits):
    q, k, v = _decode_inputs(rng, 3, 4, 2, 37, 5, np.float64)
    lens = np.array([37, 9, 0])
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    o, lse = ik.decode(q, k, v, seq_lens=lens, num_splits=num_splits, backend="numba", return_lse=True)
    testing.assert_close(o, ro, masked_rows=(lens == 0)[:, None, None])
    testing.assert_close(lse, rl, name="lse")


@sim_only
def test_decode_float16_and_counted_traffic(rng):
    q, k, v = _decode_inputs(rng, 2, 4, 1, 40, 6, np.float16)
    lens = np.array([40, 17])
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    o, lse, counted = counting.count_decode(q, k, v, seq_lens=lens, num_splits=2)
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")
    model = traffic.model("decode", batch=2, heads_q=4, heads_kv=1, head_dim=6, seq_lens=lens,
                          num_splits=2, dtype="float16")
    got = counted.as_dict()
    assert got.pop("seq_lens") == (2 * 1 * 2 * 4, 0)   # one int32 per (split, kv head, sequence) block
    assert got == model.as_dict()


def _cache(rng, lens, hkv=2, d=5, dtype=np.float32, bs=4):
    cache = PagedKVCache(24, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    sids = []
    for n in lens:
        sid = cache.new_sequence()
        sids.append(sid)
        if n:
            cache.append(sid, rng.standard_normal((n, hkv, d)).astype(dtype),
                         rng.standard_normal((n, hkv, d)).astype(dtype))
    cache.free(cache.new_sequence())   # a freed sequence: its table is no one's
    return cache, sids


@sim_only
def test_paged_decode_matches_oracle_and_model(rng):
    lens = [13, 0, 6]
    cache, sids = _cache(rng, lens)
    # interleave the sequences' blocks so tables are not contiguous runs
    q = rng.standard_normal((3, 4, 5)).astype(np.float32)
    kk = np.zeros((3, 2, 13, 5), np.float32)
    vv = np.zeros_like(kk)
    for b, s in enumerate(sids):
        kg, vg = cache.gather(s)
        kk[b, :, :lens[b]], vv[b, :, :lens[b]] = kg, vg
    ro, rl = reference.decode(q, kk, vv, seq_lens=lens)
    bo, bl = ik.paged_decode(q, cache, sids, backend="tiled", return_lse=True)
    o, lse = ik.paged_decode(q, cache, sids, num_splits=2, backend="numba", return_lse=True)
    testing.assert_close(o, ro, bo, masked_rows=(np.array(lens) == 0)[:, None, None])
    testing.assert_close(lse, rl, bl, name="lse")
    _, _, counted = counting.count_paged_decode(q, cache, sids, num_splits=2)
    model = traffic.model("paged_decode", batch=3, heads_q=4, heads_kv=2, head_dim=5, seq_lens=lens,
                          num_splits=2, dtype="float32", block_size=4)
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()


@sim_only
def test_paged_gather_equals_numpy_and_model(rng):
    cache, sids = _cache(rng, [11, 6], dtype=np.float16, d=6)
    for sid in sids:
        kn, vn = cache.gather(sid)
        kg, vg = cache.gather(sid, backend="numba")
        np.testing.assert_array_equal(kg, kn)
        np.testing.assert_array_equal(vg, vn)
    kc, vc, counted = counting.count_gather(cache, sids[0])
    np.testing.assert_array_equal(kc, cache.gather(sids[0])[0])
    model = traffic.model("paged_gather", seq_len=11, heads_kv=2, head_dim=6, block_size=4, dtype="float16")
    assert counted.as_dict() == model.as_dict()


# --------------------------------------------------------------------------- errors
def test_bad_inputs_raise_value_errors_naming_the_argument(rng):
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=4, head_dim=128, dtype="float64")
    with pytest.raises(ValueError, match="config"):   # 2 x 64 x 128 x 8 B = 128 KiB > 48 KiB
        ik.attention(q, k, v, backend="numba", config=ForwardConfig(version="v2", block_k=64))
    with pytest.raises(ValueError, match="config"):
        ik.attention(q, k, v, backend="numba", config=TileConfig())
    with pytest.raises(ValueError, match="config"):
        ForwardConfig(version="v8")
    with pytest.raises(ValueError, match="block_k"):   # v4 steps over keys 4 at a time
        ik.attention(q, k, v, backend="numba", config=ForwardConfig(version="v4", block_k=6))
    with pytest.raises(ValueError, match="config"):
        ForwardConfig(version="v3", buggy_skip_sync=True)
    with pytest.raises(ValueError, match="threads_per_row"):
        ForwardConfig(threads_per_row=3)
    with pytest.raises(ValueError, match="q"):
        nc.attention(q.astype(np.int32), k, v)
    from numba import cuda
    with pytest.raises(ValueError, match="k: all arrays must be of one kind"):
        nc.attention(q, cuda.to_device(k), v)
    qd = np.ones((1, 2, 4), np.float32)
    kd = np.ones((1, 1, 300, 4), np.float32)
    with pytest.raises(ValueError, match="num_splits"):
        nc.decode(qd, kd, kd, num_splits=129)


def test_buggy_skip_sync_is_a_v2_flag_and_still_runs(rng):
    """The race demo kernel runs; whether its result is wrong depends on thread timing (a
    GPU shows it, see notebook 05), so only the race-free kernel is held to the oracle."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=9, seqlen_k=9, head_dim=4,
                                  dtype="float64")
    o = ik.attention(q, k, v, backend="numba", config=TINY[2].replace(buggy_skip_sync=True))
    assert o.shape == q.shape


# --------------------------------------------------------------------------- decode / gather v2
from iokernels.numba_cuda import DecodeConfig  # noqa: E402
dk = importlib.import_module("iokernels.numba_cuda.decode")  # the module (nc.decode is the function)

V2 = DecodeConfig(version="v2")
#: two lanes a key, two keys in flight: 16-thread blocks, quick on the simulator
V2_SMALL = DecodeConfig(version="v2", lanes_per_key=2, keys_per_iter=2)


@pytest.mark.parametrize("dtype,d,cfg,S", [("float64", 5, V2, 2), ("float16", 12, V2, 1),
                                           ("float32", 6, V2_SMALL, 1)])
def test_decode_v2_ragged_gqa_matches_oracle(rng, dtype, d, cfg, S):
    """float16 d=12 and float32 d=6: 8-byte words (3 words of 4 halves; 3 of 2 floats);
    float64: one element a word (float16 d=59, the same path, is checked on the GPU)."""
    q, k, v = _decode_inputs(rng, 3, 4, 2, 37, d, dtype)
    lens = np.array([37, 9, 0])
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    o, lse = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg)
    assert o.dtype == np.dtype(dtype)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()           # the empty sequence
    if dtype == "float64":
        testing.assert_close(o, ro, masked_rows=(lens == 0)[:, None, None])
        testing.assert_close(lse, rl, name="lse")
    else:
        testing.assert_close(o, ro, bo)
        testing.assert_close(lse, rl, bl, name="lse")


@sim_only
def test_decode_v2_words_counted_traffic_equals_model(rng):
    """K and V read once, as 8-byte words: the bytes equal the NumPy version's model."""
    q, k, v = _decode_inputs(rng, 2, 4, 1, 40, 8, np.float16)
    lens = np.array([40, 17])
    o, lse, counted = counting.count_decode(q, k, v, seq_lens=lens, num_splits=2, config=V2_SMALL)
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")
    model = traffic.model("decode", batch=2, heads_q=4, heads_kv=1, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16")
    got = counted.as_dict()
    assert got.pop("seq_lens") == (2 * 1 * 2 * 4, 0)
    assert got == model.as_dict()


@sim_only
def test_paged_decode_v2_matches_oracle_and_model(rng):
    lens = [13, 0, 6]
    cache, sids = _cache(rng, lens, hkv=1, d=8, dtype=np.float16)
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    kk = np.zeros((3, 1, 13, 8), np.float16)
    vv = np.zeros_like(kk)
    for b, s in enumerate(sids):
        kg, vg = cache.gather(s)
        kk[b, :, :lens[b]], vv[b, :, :lens[b]] = kg, vg
    ro, rl = reference.decode(q, kk, vv, seq_lens=lens)
    bo, bl = ik.decode(q, kk, vv, seq_lens=np.array(lens), backend="naive", return_lse=True)
    # the kernels run once, on counting arrays (the launcher path is the contiguous test's)
    o, lse, counted = counting.count_paged_decode(q, cache, sids, num_splits=2, config=V2_SMALL)
    testing.assert_close(o, ro, bo, masked_rows=(np.array(lens) == 0)[:, None, None])
    testing.assert_close(lse, rl, bl, name="lse")
    model = traffic.model("paged_decode", batch=3, heads_q=4, heads_kv=1, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16", block_size=4)
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()


def test_v2_word_views_need_alignment_and_whole_words(rng):
    """Misaligned (a 2-byte offset) or 14-byte rows fall back to one element a word."""
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    assert dk.kv_words(k, k, 8, "float16")[2] == "uint64"
    buf = np.empty(k.size + 1, np.float16)[1:].reshape(k.shape)
    buf[...] = k
    assert dk.kv_words(buf, buf, 8, "float16")[2] == "float16"
    k7 = rng.standard_normal((1, 2, 5, 7)).astype(np.float16)
    assert dk.kv_words(k7, k7, 7, "float16")[2] == "float16"


def test_decode_config_errors():
    with pytest.raises(ValueError, match="config"):
        DecodeConfig(version="v7")
    with pytest.raises(ValueError, match="key_groups"):
        DecodeConfig(version="v3", key_groups=0)
    with pytest.raises(ValueError, match="key_groups"):
        DecodeConfig(version="v2", key_groups=4)
    with pytest.raises(ValueError, match="config.version"):
        DecodeConfig(version=3)                          # versions are strings
    with pytest.raises(ValueError, match="config.unroll"):
        GatherConfig(version="v1", unroll=4)
    with pytest.raises(ValueError, match="config.version"):
        GatherConfig(version="v2")                       # the gathers are v1 and v3
    with pytest.raises(ValueError, match="lanes_per_key"):
        DecodeConfig(version="v2", lanes_per_key=3)
    with pytest.raises(ValueError, match="keys_per_iter"):
        DecodeConfig(version="v2", keys_per_iter=0)
    qd = np.ones((1, 2, 4), np.float32)
    kd = np.ones((1, 1, 30, 4), np.float32)
    with pytest.raises(ValueError, match="config"):
        nc.decode(qd, kd, kd, config=ForwardConfig())


# --------------------------------------------------------------------------- decode / gather v3
from iokernels.numba_cuda import device as dv  # noqa: E402
from iokernels.numba_cuda import launch as ln  # noqa: E402

#: small tilings, quick on the simulator, that take each path of the lane all-reduce:
#: R = KPI * g values over L lanes with R > L (halvings only), R < L (halvings, then plain
#: butterfly steps), and R = L
V3_SMALL = DecodeConfig(version="v3", lanes_per_key=2, keys_per_iter=2, key_groups=2)
V3_R_LT_L = DecodeConfig(version="v3", lanes_per_key=4, keys_per_iter=1, key_groups=2)
V3_R_EQ_L = DecodeConfig(version="v3", lanes_per_key=4, keys_per_iter=2, key_groups=3)


@pytest.mark.parametrize("dtype,d,Hq,cfg,S", [
    ("float64", 5, 4, V3_SMALL, 2),          # one element a word; R = 4 > L = 2
    ("float64", 9, 6, V3_R_EQ_L, 1),         # g = 3: R = 6 padded to 8 > L = 4
    ("float64", 7, 2, V3_R_LT_L, 3),         # g = 1: R = 1 < L = 4: plain butterflies
    ("float16", 12, 4, DecodeConfig(version="v3"), 1),   # 8-byte words (3 a row), the defaults
    ("float32", 6, 4, V3_R_EQ_L, 2)])        # 8-byte words of 2 floats
def test_decode_v3_ragged_gqa_matches_oracle(rng, dtype, d, Hq, cfg, S):
    q, k, v = _decode_inputs(rng, 3, Hq, 2, 37, d, dtype)
    lens = np.array([37, 9, 0])
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    o, lse = nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=cfg)
    assert o.dtype == np.dtype(dtype)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()           # the empty sequence
    if dtype == "float64":
        testing.assert_close(o, ro, masked_rows=(lens == 0)[:, None, None])
        testing.assert_close(lse, rl, name="lse")
    else:
        bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
        testing.assert_close(o, ro, bo)
        testing.assert_close(lse, rl, bl, name="lse")


@sim_only
def test_decode_v3_words_counted_traffic_equals_model(rng):
    """K and V read once, as 8-byte words, the prefetch past the last key reading nothing."""
    q, k, v = _decode_inputs(rng, 2, 4, 1, 40, 8, np.float16)
    lens = np.array([40, 17])
    o, lse, counted = counting.count_decode(q, k, v, seq_lens=lens, num_splits=2, config=V3_SMALL)
    ro, rl = reference.decode(q, k, v, seq_lens=lens)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True)
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")
    model = traffic.model("decode", batch=2, heads_q=4, heads_kv=1, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16")
    got = counted.as_dict()
    assert got.pop("seq_lens") == (2 * 1 * 2 * 4, 0)
    assert got == model.as_dict()


def _shuffled_cache(rng, lens, hkv, d, dtype, bs=4):
    """Sequences appended a few tokens at a time in turn, after a freed sequence left holes:
    each block table is a scattered, non-monotonic set of pool blocks."""
    cache = PagedKVCache(40, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    hole = cache.new_sequence()
    cache.append(hole, *(rng.standard_normal((3 * bs, hkv, d)).astype(dtype) for _ in range(2)))
    sids = [cache.new_sequence() for _ in lens]
    cache.free(hole)
    left = list(lens)
    while any(left):
        for i, sid in enumerate(sids):
            t = min(left[i], int(rng.integers(1, 2 * bs)))
            if t:
                cache.append(sid, *(rng.standard_normal((t, hkv, d)).astype(dtype) for _ in range(2)))
                left[i] -= t
    return cache, sids


@sim_only
def test_paged_decode_v3_matches_oracle_and_model(rng):
    lens = [13, 0, 6]
    cache, sids = _shuffled_cache(rng, lens, 2, 8, np.float16)
    tables, _ = cache.block_tables_array(sids)
    assert np.any(np.diff(tables[0][:4]) != 1)                          # not one contiguous run
    q = rng.standard_normal((3, 4, 8)).astype(np.float16)
    kk = np.zeros((3, 2, 13, 8), np.float16)
    vv = np.zeros_like(kk)
    for b, s in enumerate(sids):
        kg, vg = cache.gather(s)
        kk[b, :, :lens[b]], vv[b, :, :lens[b]] = kg, vg
    ro, rl = reference.decode(q, kk, vv, seq_lens=lens)
    bo, bl = ik.decode(q, kk, vv, seq_lens=np.array(lens), backend="naive", return_lse=True)
    o, lse, counted = counting.count_paged_decode(q, cache, sids, num_splits=2, config=V3_SMALL)
    testing.assert_close(o, ro, bo, masked_rows=(np.array(lens) == 0)[:, None, None])
    testing.assert_close(lse, rl, bl, name="lse")
    model = traffic.model("paged_decode", batch=3, heads_q=4, heads_kv=2, head_dim=8, seq_lens=lens,
                          num_splits=2, dtype="float16", block_size=4)
    got = counted.as_dict()
    got.pop("seq_lens")
    assert got == model.as_dict()


def test_paged_decode_v3_float64_launcher_matches_oracle(rng):
    """Through the public launcher (NumPy pools copied in), float64, one split."""
    lens = [11, 5]
    cache, sids = _shuffled_cache(rng, lens, 1, 5, np.float64)
    q = rng.standard_normal((2, 3, 5))
    kk = np.zeros((2, 1, 11, 5))
    vv = np.zeros_like(kk)
    for b, s in enumerate(sids):
        kk[b, :, :lens[b]], vv[b, :, :lens[b]] = cache.gather(s)
    ro, rl = reference.decode(q, kk, vv, seq_lens=lens)
    o, lse = nc.paged_decode(q, cache, sids, num_splits=1, config=V3_R_EQ_L)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


@pytest.mark.parametrize("dtype,d", [("float16", 8), ("float16", 7), ("float64", 3)])
def test_gather_v3_equals_numpy(rng, dtype, d):
    """8-byte words (float16 d=8), elements (float16 d=7: 14-byte rows), float64."""
    cache, sids = _shuffled_cache(rng, [11, 6, 0], 2, d, np.dtype(dtype).type)
    for sid in sids:
        kg, vg = nc.paged_gather(cache, sid, config=GatherConfig(version="v3", unroll=2))
        kn, vn = cache.gather(sid)
        assert kg.shape == kn.shape
        np.testing.assert_array_equal(kg, kn)
        np.testing.assert_array_equal(vg, vn)


@sim_only
def test_gather_v3_counted_traffic_equals_model(rng):
    """One table read per pool block, every valid word read and written once."""
    cache, sids = _shuffled_cache(rng, [11, 6], 2, 8, np.float16)
    kc, vc, counted = counting.count_gather(cache, sids[0], config=GatherConfig(version="v3"))
    kn, vn = cache.gather(sids[0])
    np.testing.assert_array_equal(kc, kn)
    np.testing.assert_array_equal(vc, vn)
    model = traffic.model("paged_gather", seq_len=11, heads_kv=2, head_dim=8, block_size=4, dtype="float16")
    assert counted.as_dict() == model.as_dict()


def test_v3_allreduce_plan_counts_shuffles():
    """2 (RP - 1) shuffles when RP >= L (v2's butterflies: RP log2 L); plain steps once a
    lane is down to one value."""
    assert dv.allreduce_shuffles(16, 16) == 30 and 16 * 4 == 64
    assert dv.allreduce_shuffles(32, 32) == 62
    assert dv.allreduce_shuffles(2, 8) == 2 * 4
    assert dv.allreduce_plan(4, 1) == ([], [2, 1])
    assert dv.allreduce_plan(16, 4) == ([(8, 2), (4, 1)], [2, 1])
    assert dv.allreduce_shuffles(16, 4) == 2 * 3 + 2


def test_bench_sweep_cases_build_on_the_simulator():
    from iokernels.bench.sweeps_numba import SWEEPS, run_sweep
    rows = run_sweep("decode_gather", tiny=True)
    names = {r["name"] for r in rows}
    assert {"numba v3 S=None", "numba v3 paged S=None", "numba gather v3"} <= names
    assert all(r["max_err"] < 1e-2 for r in rows if "max_err" in r), rows
    rows = run_sweep("forward", tiny=True)               # float32: every tiling near the oracle
    assert len(rows) == len(SWEEPS["forward"].rows) and all(r["max_err"] < 1e-5 for r in rows), rows


def test_v3_contiguity_check():
    """v3 reads K/V through flat views, so the launchers refuse strided device arrays (the
    simulator's device arrays are always contiguous copies: the check is tested on stand-ins
    shaped like them and like Numba's device arrays)."""
    class Sim:
        def __init__(self, a):
            self._ary = a

    class Dev:
        def __init__(self, c):
            self.c = c

        def is_c_contiguous(self):
            return self.c
    base = np.zeros((1, 2, 24, 4), np.float32)
    assert ln.c_contiguous(Sim(base)) and not ln.c_contiguous(Sim(base[:, :, :12]))
    assert ln.c_contiguous(Dev(True)) and not ln.c_contiguous(Dev(False))
    assert ln.c_contiguous(base) and not ln.c_contiguous(base[:, :, :12])


def test_default_versions_per_operation_and_the_strided_fallback(rng):
    """A config without a version runs the registry's default for the call (decode: v3 on
    C-contiguous K/V, gather: v1); on a strided cache the default decode runs v1 (v3 reads
    flat views) while an explicit v3 refuses it by name."""
    q, k, v = _decode_inputs(rng, 2, 4, 2, 30, 5, np.float64)
    R = nc.REGISTRY
    assert R.resolve("decode", None, nc.need("decode", q=q, k=k, v=v))[1] == DecodeConfig(version="v3")
    from numba import cuda
    kd_, vd_ = cuda.to_device(k), cuda.to_device(v)
    strided = nc.need("decode", q=q, k=kd_[:, :, :21], v=vd_[:, :, :21])
    assert not strided.contiguous and R.resolve("decode", DecodeConfig(), strided)[1].version == "v1"
    assert nc.need("decode", q=q, k=k[:, :, :21], v=v[:, :, :21]).contiguous   # NumPy: copied contiguous
    kern, cfg = R.resolve("decode", DecodeConfig(lanes_per_key=2), nc.need("decode", q=q, k=k, v=v))
    assert cfg == DecodeConfig(version="v3", lanes_per_key=2)          # the fields the caller set stay
    cache, sids = _cache(rng, [5])
    assert R.resolve("paged_gather", None, nc.need("paged_gather", cache=cache))[1] == GatherConfig(version="v1")
    assert R.resolve("attention", None, nc.need("attention", q=q[:, :, None], k=k, v=v))[1].version == "v4"
    from numba import cuda
    q, k, v = _decode_inputs(rng, 2, 4, 2, 30, 5, np.float64)
    qd, kd, vd = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    ks, vs = kd[:, :, :21], vd[:, :, :21]                # a view of the first 21 keys: strided
    assert not ks.is_c_contiguous()
    lens = np.array([21, 9])
    ro, rl = reference.decode(q, k[:, :, :21], v[:, :, :21], seq_lens=lens)
    o, lse = nc.decode(qd, ks, vs, seq_lens=lens, num_splits=2)
    testing.assert_close(o.copy_to_host(), ro)
    testing.assert_close(lse.copy_to_host(), rl, name="lse")
    with pytest.raises(ValueError, match="k, v"):
        nc.decode(qd, ks, vs, seq_lens=lens, config=DecodeConfig(version="v3"))


def test_default_num_splits_is_the_policy_rule_at_this_device():
    """decode.default_num_splits adds the SM count to policy.numba_decode_splits (the rule and
    its tests: tests/test_numba_policy.py)."""
    from iokernels.numba_cuda import policy
    from iokernels.numba_cuda.decode import default_num_splits
    assert default_num_splits(1, 8, 32768, 16) == 64     # 56 by occupancy, 64 divides 2048 tiles
    for version in ("v1", "v2", "v3", "v4", "v5", "v6"):
        assert default_num_splits(3, 8, 5000, 16, version) == policy.numba_decode_splits(
            3, 8, 5000, 16, ln.num_sms(), policy.DECODE_SLOTS_PER_SM[version], version in policy.DECODE_EVEN_SPLITS)


# --------------------------------------------------------------------------- registry, defaults, host side
def test_registry_lists_every_version_with_a_reason_when_it_cannot_run(rng):
    R = nc.REGISTRY
    assert R.versions("attention") == ["v1", "v2", "v3", "v4", "v5", "v6", "v7"]
    assert R.versions("decode") == R.versions("paged_decode") == ["v1", "v2", "v3", "v4", "v5", "v6"]
    assert R.versions("paged_gather") == ["v1", "v3"]
    assert all(row["summary"] for row in R.table())
    bf16 = nc.need("attention", q=np.zeros((1, 1, 2, 8), testing.numpy_dtype("bfloat16")))
    for kern in R.kernels("attention"):
        assert "bfloat16" in kern.unavailable(bf16)
    with pytest.raises(ValueError, match="bfloat16"):
        R.resolve("attention", None, bf16)
    from numba import cuda
    with pytest.raises(ValueError, match="k, v"):
        R.resolve("decode", DecodeConfig(version="v3"),
                  nc.need("decode", q=np.zeros((1, 2, 4)), k=cuda.to_device(np.zeros((1, 2, 9, 4)))[:, :, :5],
                          v=cuda.to_device(np.zeros((1, 2, 5, 4)))))
    with pytest.raises(ValueError, match="config"):                  # another op's config class
        R.resolve("decode", ForwardConfig(), nc.need("decode", q=np.zeros((1, 2, 4)), k=np.zeros((1, 1, 9, 4)),
                                                     v=np.zeros((1, 1, 9, 4))))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_default_configs_fit_every_head_dim(dtype):
    """Every version's default config resolves (tiles within the 48 KiB static shared-memory
    limit) at head dims up to 256, for forward and decode (g = 4 query heads per KV head)."""
    dec = importlib.import_module("iokernels.numba_cuda.decode")
    for d in (8, 59, 64, 128, 256):
        for version in ("v1", "v2", "v3", "v4", "v5", "v6", "v7"):
            cfg = ForwardConfig(version=version).resolved(d, dtype)
            assert cfg.shared_bytes(d, dtype) <= 48 * 1024
        need = nc.need("attention", q=np.zeros((1, 1, 1, d), dtype))
        want = "v7" if dtype == "float32" else "v4"           # v7 timed at float32; v5, v6 by name
        assert nc.REGISTRY.resolve("attention", None, need)[1].version == want
        for version in ("v1", "v2", "v3", "v4", "v5", "v6"):
            assert dec.smem_reason(DecodeConfig(version=version), d, 4, dtype) is None, (version, d)
        need = nc.need("decode", q=np.zeros((1, 4, d), dtype), k=np.zeros((1, 1, 2, d), dtype),
                       v=np.zeros((1, 1, 2, d), dtype))
        pairs = dtype != "float64" and d * np.dtype(dtype).itemsize % 16 == 0       # v4's 16-byte rows
        assert nc.REGISTRY.resolve("decode", None, need)[1].version == ("v6" if pairs else "v3")
    with pytest.raises(ValueError, match="config.block_k"):        # an explicit misfit still raises
        ForwardConfig(version="v2", block_k=64).resolved(256, dtype)


def test_default_forward_runs_at_head_dim_256_float64(rng):
    """The default (v4, its tiles shrunk to fit) on a tiny float64 problem at d = 256."""
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=1, seqlen_q=3, seqlen_k=5, head_dim=256, dtype="float64")
    ro, rl = reference.attention(q, k, v, causal=True)
    o, lse = ik.attention(q, k, v, causal=True, backend="numba", return_lse=True)
    testing.assert_close(o, ro)
    testing.assert_close(lse, rl, name="lse")


def test_decode_makes_no_numba_allocation_on_a_repeated_call(rng, monkeypatch):
    """Every output and scratch buffer comes from the caller's allocator (Call.empty) and the
    constants (block table, lengths) are uploaded once: a repeated call allocates nothing
    through Numba outside the array layer.  (For a torch or CuPy caller Call.empty is
    torch.empty / cupy.empty; here, with Numba device arrays in, it is Numba's.)"""
    import inspect
    from numba import cuda
    q, k, v = _decode_inputs(rng, 2, 4, 2, 21, 8, np.float16)
    dq, dk_, dv_ = (cuda.to_device(x) for x in (q, k, v))
    lens = np.array([21, 6])
    outside = []
    for name in ("device_array", "to_device", "device_array_like"):
        real = getattr(cuda, name)

        def counted(*a, _real=real, _name=name, **kw):
            caller = inspect.stack()[1].filename
            if not caller.endswith(("core/arrays.py", "tests/test_numba.py")):
                outside.append((_name, caller))
            return _real(*a, **kw)
        monkeypatch.setattr(cuda, name, counted)
    nc.decode(dq, dk_, dv_, seq_lens=lens, num_splits=2)            # first call: constants uploaded
    outside.clear()
    for _ in range(2):
        o, _ = nc.decode(dq, dk_, dv_, seq_lens=lens, num_splits=2)
    assert outside == []
    testing.assert_close(o.copy_to_host(), reference.decode(q, k, v, seq_lens=lens)[0],
                         ik.decode(q, k, v, seq_lens=lens, backend="naive"))


def test_every_module_imports_alone_and_there_is_no_import_cycle():
    """Each module of the package imports first in a fresh interpreter, and the graph of the
    package's own imports (module level and inside functions) has no cycle."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path
    pkg = Path(__file__).resolve().parents[1] / "iokernels" / "numba_cuda"
    mods = sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__")
    edges = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((pkg / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        edges[m] = deps & set(mods)
    state = {}

    def visit(m, path):
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        if state.get(m) is None:
            state[m] = "open"
            for n in sorted(edges[m]):
                visit(n, path + [m])
            state[m] = "done"
    for m in mods:
        visit(m, [])
    env = dict(os.environ, PYTHONPATH=str(pkg.parents[1]))
    for m in mods:
        r = subprocess.run([sys.executable, "-c", f"import iokernels.numba_cuda.{m}"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (m, r.stderr[-2000:])
