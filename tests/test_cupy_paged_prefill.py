"""The CuPy paged prefill (paged_prefill_v1.cu): its record, its argument checks and (on the CuPy
stand-in) device tables, lengths and offsets used in place, on a CPU; on a GPU
(``gpu``-marked tests, skipped without one) the kernel against the float64 oracle by the 2x rule.

The GPU cases are ragged: several sequences in one launch, chunks of 1 (a decode row), 5, 37 and
128 rows, whole prompts and partial chunks, cached lengths that are no multiple of the block
size, GQA 8/2 and MHA, head dims 64 and 128, float16 and bfloat16, causal and not, over a host
PagedKVCache and over device pools with device tables, lengths and offsets (CuPy, and torch
where it sees a GPU).  The oracle attends, in float64, to a contiguous copy of each sequence
(:meth:`PagedKVCache.gather`); the baseline is the naive algorithm in the same precision.
"""
from __future__ import annotations

import numpy as np
import pytest

import iokernels as ik
from iokernels import api
from iokernels.core import testing
from iokernels.core.gpu import cupy_gpu, torch_gpu
from iokernels.core.registry import Need
from iokernels.cupy_raw import REGISTRY, PagedPrefillConfig, need, paged_prefill_pools
from iokernels.paged import PagedKVCache

#: the GPU tests' marks: run with the GPU tests, skipped where CuPy sees no GPU
gpu = pytest.mark.skipif(not cupy_gpu(), reason="CuPy sees no CUDA GPU")
#: absolute LSE tolerance (nats) on top of the 2x rule: the kernel's exp2 / log2 conversions
LSE_ATOL = 1e-4


def _filled(rng, lens, hkv, d, dtype, block_size=16, spare=3):
    """A cache holding sequences of ``lens`` tokens, their blocks shuffled in the pool."""
    need_blocks = sum(-(-n // block_size) for n in lens)
    cache = PagedKVCache(need_blocks + spare, block_size, num_kv_heads=hkv, head_dim=d,
                         dtype=testing.numpy_dtype(dtype))
    sids = [cache.new_sequence() for _ in lens]
    # append in rounds so the sequences' blocks interleave in the pool (the table matters)
    left = list(lens)
    while any(left):
        for sid, i in zip(sids, range(len(lens))):
            m = min(left[i], block_size + 3)
            if m:
                cache.append(sid, *(rng.standard_normal((m, hkv, d)).astype(cache.dtype) for _ in range(2)))
                left[i] -= m
    return cache, sids




def _case(rng, lens, chunks, hq, hkv, d, dtype, block_size=16):
    cache, sids = _filled(rng, lens, hkv, d, dtype, block_size)
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), hq, d)).astype(cache.dtype)
    return cache, sids, cq, q


def _check(o, lse, q, cache, sids, cq, dtype, causal, label):
    ref, ref_lse = testing.paged_prefill_oracle(q, cache, sids, cq, causal)
    base, base_lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, backend="naive", return_lse=True)
    testing.assert_close(o, ref, base, dtype=dtype, name=f"{label} O")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=LSE_ATOL, name=f"{label} LSE")


#: (cached lengths, chunk lengths): decode rows, short and 37-row partial chunks, 128-row chunks,
#: whole prompts (chunk == cached), lengths no multiple of 16, an empty chunk
RAGGED = (((301, 45, 5, 1, 200, 133), (37, 45, 5, 1, 128, 1)),
          ((77, 128, 259, 0, 16), (5, 128, 37, 0, 16)))


# =========================================================================== CPU
def test_cupy_implements_paged_prefill_through_its_record():
    assert "cupy" in api.backends_implementing("paged_prefill")
    rec = REGISTRY.get("paged_prefill", "v1")
    assert rec.file == "paged_prefill_v1.cu" and rec.config_class is PagedPrefillConfig


@pytest.mark.parametrize("need_kw,words", [
    (dict(dtype="float32", head_dim=128), "float16/bfloat16"),
    (dict(dtype="float16", head_dim=96), "head_dim 64 and 128"),
    (dict(dtype="bfloat16", head_dim=64, cc=75), "compute capability 8.0"),
    (dict(dtype="float16", head_dim=128, extra=dict(smem=16 * 1024)), "shared memory"),
    (dict(dtype="float16", head_dim=128, extra=dict(kv_dtype="int8")), "kv_dtype"),
])
def test_the_record_says_why_it_cannot_run(need_kw, words):
    n = Need(**{"cc": None, "extra": {}, **need_kw})
    why = REGISTRY.get("paged_prefill", "v1").unavailable(n)
    assert why and words in why, why
    assert REGISTRY.get("paged_prefill", "v1").unavailable(Need(dtype="bfloat16", head_dim=128, cc=80)) is None


def test_the_sanitizer_runs_it_with_its_variants():
    """scripts/sanitize.py runs every registered op through sanitize.RUNNERS; the paged prefill's
    variant tiles are valid configs."""
    from iokernels.cupy_raw import sanitize as S
    assert set(REGISTRY.ops()) <= set(S.RUNNERS)
    for version in REGISTRY.versions("paged_prefill"):             # v2 next to v1, with the same tiles
        rec = REGISTRY.get("paged_prefill", version)
        for kw in S.VARIANTS[("paged_prefill", version)]:
            cfg = rec.config_class(version, **kw).resolve(128, 227 * 1024)
            assert cfg.version == version
            if rec.config_class is PagedPrefillConfig:                 # v3 (Hopper) has its own tiles
                assert cfg.block_k % 16 == 0 and cfg.num_warps in (2, 4, 8)


def test_need_counts_the_group_from_pools():
    q = np.zeros((5, 8, 64), np.float16)
    pool = np.zeros((4, 16, 2, 64), np.float16)
    assert need("paged_prefill", q=q, k=pool, v=pool).extra["group"] == 4


def _pools_call(rng, **change):
    cache, sids, cq, q = _case(rng, (40, 9), (7, 9), 4, 2, 64, "float16")
    tables, lens = cache.block_tables_array(sids)
    kw = dict(q=q, k_pool=cache.k_pool, v_pool=cache.v_pool, block_tables=tables, seq_lens=lens, cu_seqlens_q=cq)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,name", [
    (dict(q=np.zeros((16, 3, 64), np.float16)), "q"),                  # 3 heads over 2 KV heads
    (dict(q=np.zeros((16, 4, 64), np.float32)), "q"),                  # not the pools' dtype
    (dict(v_pool=np.zeros((5, 16, 2, 64), np.float16)), "v_pool"),
    (dict(cu_seqlens_q=np.array([0, 7], np.int32)), "cu_seqlens_q"),   # one offset short
    (dict(cu_seqlens_q=np.array([0, 5, 15], np.int32)), "cu_seqlens_q"),   # ends at 15, not total_q 16
    (dict(cu_seqlens_q=np.array([0, 6, 16], np.int32)), "cu_seqlens_q"),   # 10 queries over 9 cached tokens
    (dict(seq_lens=np.array([40, 900])), "seq_lens"),
    (dict(block_tables=np.array([[0, 1, 2], [99, 0, 0]], np.int32)), "block_tables"),
    (dict(causal="yes"), "causal"),
    (dict(max_seqlen_q=8), "max_seqlen_q"),                             # shorter than the chunk of 9
    (dict(max_seqlen_q=17), "max_seqlen_q"),                            # past total_q
])
def test_bad_arguments_raise_naming_the_argument(rng, change, name):
    """Every check runs on the host before anything touches a GPU (so it holds on a CPU)."""
    kw = _pools_call(rng, **change)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        paged_prefill_pools(**kw)


def test_a_bad_config_raises_naming_config(rng):
    cache, sids, cq, q = _case(rng, (40,), (7,), 4, 2, 64, "float16")
    with pytest.raises(ValueError, match="config"):
        ik.paged_prefill(q, cache, sids, cq, backend="cupy", config=ik.TileConfig(16, 16))
    with pytest.raises(ValueError, match="config.num_warps"):
        PagedPrefillConfig("v1", num_warps=3)


def test_v2_is_the_portable_default():
    """v2 (GQA packed into the Q tile), measured (its GPU tests passed and the paged_prefill
    section recorded it at v1's speed or better), is out of policy.HELD_BACK: the default
    wherever the Hopper v3 does not run (here: no Hopper, so every compute capability)."""
    from iokernels.cupy_raw import policy
    v1, v2 = REGISTRY.get("paged_prefill", "v1"), REGISTRY.get("paged_prefill", "v2")
    assert v2.file == "paged_prefill_v2.cu" and v2.config_class is PagedPrefillConfig and v2.extra["packs_heads"]
    assert ("paged_prefill", "v2") not in policy.HELD_BACK and v2.rank > v1.rank
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128):
            for cc in (80, 90):
                n = Need(dtype=dtype, head_dim=d, cc=cc, extra={"smem": 227 * 1024, "group": 4})
                assert REGISTRY.default("paged_prefill", n).version == "v2"
                assert v2.unavailable(n) is None and v2.not_default(n) is None
    q, pool = np.zeros((5, 8, 64), np.float16), np.zeros((4, 16, 2, 64), np.float16)
    spec, cfg = REGISTRY.resolve("paged_prefill", PagedPrefillConfig("v2"), need("paged_prefill", q=q, k=pool, v=pool))
    assert spec is v2 and cfg.version == "v2"
    assert v2.unavailable(Need(dtype="float32", head_dim=128, cc=90, extra={}))    # v1's limits, said the same way


def test_v2_config_validation():
    assert PagedPrefillConfig("v2", num_warps=2, block_k=16).resolve(128, 227 * 1024).block_q == 32
    for bad, name in ((dict(version="v3"), "config.version"), (dict(version="v2", num_warps=3), "config.num_warps"),
                      (dict(version="v2", block_k=24), "config.block_k")):
        with pytest.raises(ValueError, match=name):
            PagedPrefillConfig(**bad)


def test_the_grid_packs_the_group_into_the_tile_for_v2():
    """v1: a block a (Q tile, query head); v2: a block a (Q tile of packed rows, KV head)."""
    from iokernels.cupy_raw.paged_prefill import prefill_grid, tile_rows_per_token
    v1, v2 = REGISTRY.get("paged_prefill", "v1"), REGISTRY.get("paged_prefill", "v2")
    cfg = PagedPrefillConfig("v2", num_warps=4, block_k=64)                 # Br = 64
    assert [tile_rows_per_token(r, 4) for r in (v1, v2)] == [1, 4]
    assert prefill_grid(cfg, 1, 37, 8, 3) == (1, 8, 3)
    assert prefill_grid(cfg, 4, 37, 8, 3) == (3, 2, 3)                      # 148 packed rows, 2 KV heads
    assert prefill_grid(cfg, 3, 1, 6, 2) == (1, 2, 2)                       # a decode row: g rows of one tile


# =========================================================================== GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa8/2", "mha"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_paged_prefill_matches_the_oracle(rng, dtype, d, heads, causal, case):
    lens, chunks = RAGGED[case]
    cache, sids, cq, q = _case(rng, lens, chunks, *heads, d, dtype)
    o, lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, backend="cupy", return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (heads[0], q.shape[0])
    assert lse.dtype == np.float32
    _check(o, lse, q, cache, sids, cq, dtype, causal, f"cupy paged prefill {dtype} d={d} {heads} causal={causal}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [PagedPrefillConfig("v1", num_warps=2, block_k=16),
                                    PagedPrefillConfig("v1", num_warps=8, block_k=128),
                                    PagedPrefillConfig("v1", block_k=32)], ids=str)
def test_other_tiles_and_an_odd_block_size(rng, config):
    """Tiles other than the default, over blocks of 7 keys (a K tile spans a partial block)."""
    cache, sids, cq, q = _case(rng, (301, 45, 5), (37, 45, 1), 8, 2, 128, "bfloat16", block_size=7)
    o, lse = ik.paged_prefill(q, cache, sids, cq, backend="cupy", config=config, return_lse=True)
    _check(o, lse, q, cache, sids, cq, "bfloat16", True, f"cupy paged prefill {config}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_device_pools_tables_and_offsets(rng, lib):
    """Device pools, device int32 tables, lengths and offsets used in place; outputs of q's kind.
    A chunk longer than its (device) length has rows that see no key: O 0, LSE -inf."""
    if lib == "torch" and not torch_gpu():
        pytest.skip("torch sees no CUDA GPU")
    import cupy
    cache, sids, cq, q = _case(rng, (301, 45, 5, 1), (37, 45, 5, 1), 8, 2, 64, "float16")
    tables, lens = cache.block_tables_array(sids)
    if lib == "cupy":
        to = cupy.asarray
    else:
        import torch

        def to(a):
            return torch.from_numpy(np.ascontiguousarray(a)).cuda()
    args = [to(x) for x in (q, cache.k_pool, cache.v_pool, tables.astype(np.int32), lens.astype(np.int32), cq)]
    o, lse = paged_prefill_pools(*args)
    assert type(o) is type(args[0]) and type(lse) is type(args[0])
    o_b, _ = paged_prefill_pools(*args, max_seqlen_q=45)           # the grid sized by the caller's bound
    assert np.array_equal(testing.as_numpy(o_b), testing.as_numpy(o))
    host = testing.as_numpy
    _check(host(o), host(lse), q, cache, sids, cq, "float16", True, f"{lib} pools")
    # the last sequence said to hold 0 tokens: its one query row sees nothing
    short = lens.astype(np.int32).copy()
    short[3] = 0
    o2, lse2 = paged_prefill_pools(*args[:4], to(short), args[5])
    o2, lse2 = host(o2), host(lse2)
    assert np.all(o2[-1] == 0) and np.all(np.isneginf(lse2[:, -1]))
    assert np.array_equal(o2[:-1], host(o)[:-1])
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@gpu
def test_chunked_equals_one_shot_and_a_decode_row_equals_paged_decode(rng):
    """A prompt prefilled in chunks of 37 gives the rows the one-shot prefill gives (to rounding),
    and a one-row chunk is the paged decode of that query."""
    cache, sids, cq, q = _case(rng, (150,), (150,), 8, 2, 128, "float16")
    whole = ik.paged_prefill(q, cache, sids, cq, backend="cupy")
    ref, _ = testing.paged_prefill_oracle(q, cache, sids, cq)
    base = ik.paged_prefill(q, cache, sids, cq, backend="naive")
    last = q[-1:]
    row = ik.paged_prefill(last, cache, sids, np.array([0, 1], np.int32), backend="cupy")
    dec = ik.paged_decode(last, cache, sids, backend="cupy")
    testing.assert_close(row[0], ref[-1], base[-1], dtype="float16", name="one-row chunk")
    testing.assert_close(dec[0], ref[-1], base[-1], dtype="float16", name="paged decode")
    testing.assert_close(whole[-1], ref[-1], base[-1], dtype="float16", name="whole prompt's last row")


@pytest.mark.gpu
@gpu
def test_strided_pools_are_read_in_place(rng):
    """A pool stored heads-outer, (blocks, Hkv, slots, d), passed as its (blocks, slots, Hkv, d)
    view: read through its strides, the same output bit for bit as the slots-outer pool."""
    if not torch_gpu():
        pytest.skip("torch sees no CUDA GPU")
    import torch
    cache, sids, cq, q = _case(rng, (301, 45, 5), (37, 45, 1), 8, 2, 128, "float16")
    tables, lens = cache.block_tables_array(sids)
    tq, kp, vp = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in (q, cache.k_pool, cache.v_pool))
    outer = [p.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for p in (kp, vp)]
    assert not outer[0].is_contiguous() and outer[0].stride(-1) == 1
    o1, l1 = paged_prefill_pools(tq, kp, vp, tables, lens, cq)
    o2, l2 = paged_prefill_pools(tq, outer[0], outer[1], tables, lens, cq)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


#: run on the CuPy stand-in (tests/stand_ins/cupy): device tables, lengths and offsets reach the
#: launch as they are, and no host array is uploaded during the call
_IN_PLACE = r'''
import json, sys
import numpy as np
import cupy
from iokernels import cupy_raw as cr
rng = np.random.default_rng(0)
pool = cupy.asarray(rng.standard_normal((12, 16, 2, 64)).astype(np.float16))
q = cupy.asarray(rng.standard_normal((50, 8, 64)).astype(np.float16))
tables = cupy.asarray(np.array([[3, 1, 4, 9], [2, 6, 5, 0]], np.int32))
lens = cupy.asarray(np.array([60, 20], np.int32))
cu = cupy.asarray(np.array([0, 40, 50], np.int32))
uploads = []
real = cupy.asarray
cupy.asarray = lambda x, dtype=None: (uploads.append(type(x).__name__), real(x, dtype))[1]
V2 = cr.PagedPrefillConfig("v2")       # (v3, the Hopper default, encodes tensor maps: test_cupy_plans.py)
cr.paged_prefill_pools(q, pool, pool, tables, lens, cu, max_seqlen_q=40, config=V2)
(L,) = cupy.LAUNCHES
ptrs = [int(a) for a in L["args"][3:6]]
device_uploads = list(uploads)
cr.paged_prefill_pools(q, pool, pool, tables, lens, np.array([0, 40, 50], np.int32), config=V2)   # host: uploaded
json.dump(dict(uploads=device_uploads, host_uploads=uploads[len(device_uploads):],
               same=ptrs == [x.data.ptr for x in (tables, lens, cu)], grid=list(L["grid"])), sys.stdout)
'''


def test_device_tables_lengths_and_offsets_are_used_in_place():
    import json
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{here / 'stand_ins'}{os.pathsep}{here.parent}")
    r = subprocess.run([sys.executable, "-c", _IN_PLACE], capture_output=True, text=True, env=env, cwd=here.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["same"] and got["uploads"] == [] and got["grid"] == [3, 2, 2]     # v2: a block a KV head
    assert got["host_uploads"] == ["ndarray"]               # the check that the count sees uploads


# =========================================================================== GPU: v2
#: v2's head layouts: MHA (g = 1), GQA 8/2 (g = 4), 16/2 (g = 8) and 6/2 (g = 3, no divisor of a
#: tile's rows: a token's heads straddle two warps or two tiles)
V2_HEADS = ((4, 4), (8, 2), (16, 2), (6, 2))
V2 = PagedPrefillConfig("v2")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", V2_HEADS, ids=["g1", "g4", "g8", "g3"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_v2_matches_the_oracle(rng, dtype, d, heads, causal, case):
    lens, chunks = RAGGED[case]
    cache, sids, cq, q = _case(rng, lens, chunks, *heads, d, dtype)
    o, lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, backend="cupy", return_lse=True, config=V2)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (heads[0], q.shape[0])
    _check(o, lse, q, cache, sids, cq, dtype, causal, f"cupy paged prefill v2 {dtype} d={d} {heads} causal={causal}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [PagedPrefillConfig("v2", num_warps=2, block_k=16),
                                    PagedPrefillConfig("v2", num_warps=8, block_k=128),
                                    PagedPrefillConfig("v2", num_warps=1, block_k=32)], ids=str)
@pytest.mark.parametrize("heads", [(16, 2), (6, 2)], ids=["g8", "g3"])
def test_v2_other_tiles_and_an_odd_block_size(rng, config, heads):
    """Tiles other than the default over blocks of 7 keys; a 16-row tile holds 2 tokens of 8 heads."""
    cache, sids, cq, q = _case(rng, (301, 45, 5), (37, 45, 1), *heads, 128, "bfloat16", block_size=7)
    o, lse = ik.paged_prefill(q, cache, sids, cq, backend="cupy", config=config, return_lse=True)
    _check(o, lse, q, cache, sids, cq, "bfloat16", True, f"cupy paged prefill {config} {heads}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [(8, 2), (16, 2)], ids=["g4", "g8"])
def test_v2_chunked_appends(rng, heads):
    """A chunked prefill: two prompts appended chunk by chunk (chunks of 37 and 16 rows, each
    shorter than what is cached by then, the last one ragged); after each append the chunk
    attends to the whole cache, checked against the oracle."""
    hq, hkv = heads
    d, dtype = 128, "float16"
    cache = PagedKVCache(40, 16, num_kv_heads=hkv, head_dim=d, dtype=testing.numpy_dtype(dtype))
    sids = [cache.new_sequence(), cache.new_sequence()]
    prompts = (150, 70)
    steps = ((37, 16), (37, 16), (37, 16), (37, 16), (2, 6))              # sums: 150 and 70
    for chunk in steps:
        for sid, m in zip(sids, chunk):
            cache.append(sid, *(rng.standard_normal((m, hkv, d)).astype(cache.dtype) for _ in range(2)))
        cq = np.array([0, chunk[0], chunk[0] + chunk[1]], np.int32)
        q = rng.standard_normal((int(cq[-1]), hq, d)).astype(cache.dtype)
        o, lse = ik.paged_prefill(q, cache, sids, cq, backend="cupy", return_lse=True, config=V2)
        _check(o, lse, q, cache, sids, cq, dtype, True, f"v2 chunk {chunk} of {prompts}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [(8, 2), (6, 2), (4, 4)], ids=["g4", "g3", "g1"])
def test_v2_gives_v1s_bits_without_a_mask(rng, heads):
    """The same tiles, not causal: each row's arithmetic is v1's (the same K tiles in the same
    order, the same mma per row), so O and LSE equal v1's bit for bit.  (Causal, a v2 tile may
    stop at an earlier K tile than v1's, which only skips tiles its rows cannot see; the oracle
    tests above hold it by the 2x rule.)"""
    cache, sids, cq, q = _case(rng, (301, 45, 5, 1, 200, 133), (37, 45, 5, 1, 128, 1), *heads, 128, "bfloat16")
    for nw, bk in ((4, 64), (2, 16)):
        o1, l1 = ik.paged_prefill(q, cache, sids, cq, causal=False, backend="cupy", return_lse=True,
                                  config=PagedPrefillConfig("v1", num_warps=nw, block_k=bk))
        o2, l2 = ik.paged_prefill(q, cache, sids, cq, causal=False, backend="cupy", return_lse=True,
                                  config=PagedPrefillConfig("v2", num_warps=nw, block_k=bk))
        assert np.array_equal(o1.view(np.uint16), o2.view(np.uint16)) and np.array_equal(l1, l2), (nw, bk)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_v2_device_pools_through_the_plan(rng, lib):
    """Device pools, tables, lengths and offsets: the planned v2 call (the public
    paged_prefill_pools) equals the eager launcher bit for bit and the oracle by the 2x rule."""
    if lib == "torch" and not torch_gpu():
        pytest.skip("torch sees no CUDA GPU")
    import importlib

    import cupy
    from iokernels.cupy_raw import PLANS, PagedPrefillPlan
    eager = importlib.import_module("iokernels.cupy_raw.paged_prefill")
    cache, sids, cq, q = _case(rng, (301, 45, 5, 1), (37, 45, 5, 1), 16, 2, 64, "float16")
    tables, lens = cache.block_tables_array(sids)
    if lib == "cupy":
        to = cupy.asarray
    else:
        import torch

        def to(a):
            return torch.from_numpy(np.ascontiguousarray(a)).cuda()
    args = [to(x) for x in (q, cache.k_pool, cache.v_pool, tables.astype(np.int32), lens.astype(np.int32), cq)]
    o, lse = paged_prefill_pools(*args, config=V2, max_seqlen_q=45)
    assert any(isinstance(p, PagedPrefillPlan) and p.config.version == "v2" for p in PLANS._plans.values())
    o_e, lse_e = eager.paged_prefill_pools(*args, config=V2, max_seqlen_q=45)
    host = testing.as_numpy
    assert np.array_equal(host(o), host(o_e)) and np.array_equal(host(lse), host(lse_e))
    _check(host(o), host(lse), q, cache, sids, cq, "float16", True, f"{lib} pools v2")
    cupy.cuda.Device().synchronize()
