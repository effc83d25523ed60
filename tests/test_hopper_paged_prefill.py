"""The Hopper paged prefill (paged_prefill_v3.cu, iokernels.cupy_raw.hopper.paged_prefill).

Without a GPU: the kernel compiles with nvcc for sm_90a (``-cubin``) from exactly the source
and defines the launcher hands NVRTC, for every dtype x head_dim x block_size it takes and the
config's variants; ``-Xptxas -v`` must show no local memory (no spills, no stack frame), no
wgmma serialisation (C7515) and no ignored setmaxnreg (C7508); the source refuses what it
cannot run with #error; the config, the block-size rule, the record's check, the registry's
default (never v3 yet) and v3 by name, the tensor maps and argument list the launch builds,
and the argument checks (before any GPU) are pure Python; the kernel's schedule (grid, tile
ranges, boxes through the table, the zeroed V tail, the packed rows) is modelled in NumPy and
held to the oracle.

With compute capability 9.0 (``gpu``: skipped elsewhere, with the reason): FlashAttention's 2x
rule against the float64 oracle (:func:`iokernels.core.testing.paged_prefill_oracle`), the
baseline being the naive algorithm in the same precision, for g in 1, 4, 8, causal and not,
varlen batches with awkward lengths (1, 17, 127, 300), chunks shorter than the cache, block
tables shuffled across the pool (unwritten slots are NaN), head dims 64 and 128, float16 and
bfloat16, every block size, outputs poisoned with NaN first, and device tables, lengths and
offsets used in place.
"""
from __future__ import annotations


import numpy as np
import pytest

import iokernels as ik
from iokernels.core import testing
from iokernels.core.arrays import DeviceArray
from iokernels.core.registry import Need
from iokernels.cupy_raw import REGISTRY
from iokernels.cupy_raw import hopper as hp
from iokernels.cupy_raw.hopper import paged_prefill as PP
from iokernels.paged import PagedKVCache

from nvcc_support import NVCC, PTXAS_V, compile_all, compile_source, registers_only
from test_cupy_paged_prefill import _case     # a cache of interleaved sequences and a packed q

#: absolute LSE tolerance (nats) on top of the 2x rule: the kernel's exp2 / log2 conversions
LSE_ATOL = 1e-4
V3 = PP.HopperPagedPrefillConfig("v3")


def _gpu_reason():
    why = hp.available()
    return None if why is None else f"Hopper paged prefill: {why}"


gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


# =========================================================================== compile (no GPU)
def _compile(tmp_path, defines, extra=PTXAS_V):
    return compile_source(tmp_path, "pp3", hp.source("paged_prefill_v3"), defines, extra=extra)


def _jobs():
    """(label, defines): the launcher's defaults at every dtype x head_dim x block_size, and the
    config's variants (Bc = 64, two stages, no ping-pong) at the widest and narrowest blocks."""
    jobs = []
    for dtype in hp.DTYPES:
        for d in PP.HEAD_DIMS:
            for bs in PP.V3_BLOCK_SIZES:
                jobs.append((f"{dtype} d={d} block_size={bs}", V3.resolve(d).defines(d, dtype, bs)))
    for kw in (dict(block_n=64), dict(stages=2), dict(pingpong=False), dict(block_n=64, stages=4)):
        for bs in (8, 256):
            cfg = V3.replace(**kw).resolve(128)
            jobs.append((f"{kw} bfloat16 d=128 block_size={bs}", cfg.defines(128, "bfloat16", bs)))
    return jobs


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_combination_compiles_for_sm90a_in_registers(tmp_path):
    jobs = _jobs()
    results = compile_all(lambda j: _compile(tmp_path, j[1]), jobs)
    for (label, _), (rc, err) in zip(jobs, results):
        registers_only(label, rc, err)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_source_refuses_what_it_cannot_run(tmp_path):
    base = V3.resolve(128).defines(128, "bfloat16", 16)
    for change, message in ((dict(PAGE_SIZE=24), "PAGE_SIZE"), (dict(PAGE_SIZE=4), "PAGE_SIZE"),
                            (dict(PAGE_SIZE=48), "PAGE_SIZE"), (dict(STAGES=1), "at least two stages"),
                            (dict(HEAD_DIM=96), "HEAD_DIM 64 or 128"), (dict(BLOCK_N=32), "BLOCK_N 64 or 128")):
        rc, err = _compile(tmp_path, dict(base, **change), extra=())
        assert rc != 0 and message in err, f"{change}: rc={rc} {err[:300]}"


def test_its_file_is_a_hopper_source_with_the_header_inlined():
    text = hp.source("paged_prefill_v3")
    assert "paged_prefill_v3" in hp.SOURCES
    assert "#include" not in text and text.count("struct __align__(64) TmaMap") == 1


# =========================================================================== config, checks (no GPU)
def test_config_validation_names_the_field():
    for kw, field in ((dict(version="v1"), "config.version"), (dict(block_n=96), "config.block_n"),
                      (dict(stages=1), "config.stages"), (dict(stages=5), "config.stages"),
                      (dict(stages=True), "config.stages"), (dict(pingpong=1), "config.pingpong")):
        with pytest.raises(ValueError, match=field):
            PP.HopperPagedPrefillConfig(**kw)
    with pytest.raises(ValueError, match="config.version"):
        PP.HopperPagedPrefillConfig().resolve(128)


def test_resolve_fits_the_sram():
    c = V3.resolve(128)
    assert (c.block_n, c.stages, c.pingpong) == (128, 3, True)
    assert c.smem_bytes(128) <= hp.FALLBACK_SMEM_OPTIN
    assert V3.resolve(128, smem_limit=200_000).stages == 2            # 3 stages of Bc = 128 do not fit
    with pytest.raises(ValueError, match="config.stages"):
        V3.replace(stages=4).resolve(128)
    with pytest.raises(ValueError, match="config.stages"):
        V3.resolve(128, smem_limit=100_000)
    d = V3.resolve(64).defines(64, "float16", 16)
    assert d == dict(IK_DTYPE=1, HEAD_DIM=64, BLOCK_M=128, BLOCK_N=128, STAGES=3, PAGE_SIZE=16, PINGPONG=1)


def test_block_size_rule():
    for bs in PP.V3_BLOCK_SIZES:
        PP.check_block_size(bs, 128)
        PP.check_block_size(bs, 64)
    PP.check_block_size(192, 64)                    # a multiple of Bc = 64: three tiles a block
    for bs, bn in ((4, 128), (12, 128), (24, 128), (48, 128), (192, 128), (1, 64)):
        with pytest.raises(ValueError, match=r"^block_size\b.*" + str(bs)):
            PP.check_block_size(bs, bn)


def _need(**kw):
    extra = dict(smem=hp.FALLBACK_SMEM_OPTIN, group=4, aligned16=True, kv_dtype=None, scale_granularity=None)
    extra.update(kw.pop("extra", {}))
    return Need(**{"dtype": "bfloat16", "head_dim": 128, "cc": 90, "extra": extra, **kw})


@pytest.fixture
def hopper_here(monkeypatch):
    """The record's check as on an H100/H200 with cuda-python (available() says nothing against)."""
    monkeypatch.setattr(hp, "available", lambda: None)


@pytest.mark.parametrize("need_kw,words", [
    (dict(cc=80), "compute capability 9.0"),
    (dict(cc=100), "compute capability 9.0"),
    (dict(simulator=True), "GPU only"),
    (dict(dtype="float32"), "float16 / bfloat16"),
    (dict(head_dim=96), "head_dim"),
    (dict(extra=dict(group=3)), "power of two"),
    (dict(extra=dict(group=256)), "power of two"),
    (dict(extra=dict(block_size=24)), "block_size"),
    (dict(extra=dict(kv_dtype="int8")), "kv_dtype"),
])
def test_the_record_says_why_it_cannot_run(hopper_here, need_kw, words):
    rec = REGISTRY.get("paged_prefill", "v3")
    why = rec.unavailable(_need(**need_kw))
    assert why and words in why, why
    for d in PP.HEAD_DIMS:
        for dt in hp.DTYPES:
            for g in (1, 4, 8, 128):
                assert rec.unavailable(_need(dtype=dt, head_dim=d, extra=dict(group=g, block_size=16))) is None


def test_the_need_carries_the_block_size(hopper_here):
    """need() reads the block size off the cache or the pools, so the default dispatch and the
    conformance tests skip v3 on a cache it cannot copy (block_size 4) instead of failing."""
    from iokernels.cupy_raw import need
    q = np.zeros((5, 8, 64), np.float16)
    for bs, ok in ((4, False), (12, False), (16, True), (256, True)):
        cache = PagedKVCache(4, bs, num_kv_heads=2, head_dim=64, dtype=np.float16)
        pool = np.zeros((4, bs, 2, 64), np.float16)
        for n in (need("paged_prefill", q=q, cache=cache), need("paged_prefill", q=q, k=pool, v=pool)):
            assert n.extra["block_size"] == bs
            why = REGISTRY.get("paged_prefill", "v3").unavailable(n if n.cc else _need(extra=n.extra))
            assert (why is None) == ok and (ok or "block_size" in why), why


def test_without_hopper_it_says_so():
    if hp.available() is None:
        pytest.skip("this machine has a Hopper GPU")
    assert REGISTRY.get("paged_prefill", "v3").unavailable(_need()) == hp.available()


def test_v3_is_the_default_on_hopper(hopper_here, monkeypatch):
    """Measured (its GPU tests passed, and the paged_prefill section recorded it at >= 0.9x our
    contiguous prefill), v3 is out of policy.HELD_BACK: it outranks v1 and v2, so the default
    resolves to it on Hopper at every dtype, head dim and group size it takes; put it back in
    HELD_BACK and the default is v2 again, while a config naming v3 still runs it."""
    from iokernels.cupy_raw import policy
    rec = REGISTRY.get("paged_prefill", "v3")
    assert ("paged_prefill", "v3") not in policy.HELD_BACK and rec.rank == PP.V3_RANK
    assert all(k.rank < PP.V3_RANK for k in REGISTRY.kernels("paged_prefill") if k.version != "v3")
    needs = [_need(dtype=dt, head_dim=d, extra=dict(group=g, block_size=16))
             for d in PP.HEAD_DIMS for dt in hp.DTYPES for g in (1, 4, 8)]
    for n in needs:
        assert REGISTRY.default("paged_prefill", n).version == "v3"
        k, cfg = REGISTRY.resolve("paged_prefill", None, n)
        assert k.version == "v3" and k.launcher is PP.paged_prefill
        k, cfg = REGISTRY.resolve("paged_prefill", PP.HopperPagedPrefillConfig(), n)
        assert k.version == cfg.version == "v3"
        k, cfg = REGISTRY.resolve("paged_prefill", V3, n)
        assert k.version == "v3" and cfg is V3
    monkeypatch.setitem(policy.HELD_BACK, ("paged_prefill", "v3"), "a test holds it back")
    for n in needs:
        assert REGISTRY.default("paged_prefill", n).version == "v2"
        assert REGISTRY.resolve("paged_prefill", PP.HopperPagedPrefillConfig(), n)[0].version == "v2"
        k, cfg = REGISTRY.resolve("paged_prefill", V3, n)
        assert k.version == "v3" and cfg is V3
    assert rec.file == "paged_prefill_v3.cu" and rec.extra["options"] == hp.NVRTC_OPTIONS


def test_the_sanitizer_and_the_bench_know_v3():
    from iokernels.cupy_raw import sanitize as S
    for kw in S.VARIANTS[("paged_prefill", "v3")]:
        PP.HopperPagedPrefillConfig("v3", **kw).resolve(128)
    assert S.PREFILL_DIMS and set(S.PREFILL_DIMS) <= set(PP.HEAD_DIMS)
    from iokernels.bench import runners_prefill as RP
    from iokernels import cupy_raw
    assert RP.paged_prefill_call() is cupy_raw.paged_prefill_pools      # the planned call, every version


# --------------------------------------------------------------------------- the launch's arguments
def _fake(shape, dtype="float16", ptr=1 << 20):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return DeviceArray(ptr, tuple(shape), tuple(strides), dtype, 4 if dtype in ("float32", "int32") else 2, None)


@pytest.mark.parametrize("g,bs,d", [(1, 16, 128), (4, 8, 64), (8, 256, 128), (128, 64, 64)])
def test_the_tensor_maps_and_arguments(monkeypatch, g, bs, d):
    maps = []

    def fake_map(ptr, dtype, dims, strides, box):
        maps.append(dict(dims=list(dims), strides=list(strides), box=list(box)))
        return np.zeros(1, dtype=np.dtype((np.void, 128)))
    monkeypatch.setattr(hp, "tensor_map", fake_map)
    total_q, Hkv, nb, B, max_blocks = 83, 2, 40, 3, 7
    Hq = g * Hkv
    q, o = _fake((total_q, Hq, d)), _fake((total_q, Hq, d))
    kp, vp = _fake((nb, bs, Hkv, d)), _fake((nb, bs, Hkv, d))
    lse = _fake((Hq, total_q), "float32")
    ints = [_fake(s, "int32") for s in ((B, max_blocks), (B,), (B + 1,))]
    cfg = V3.resolve(d)
    args = PP.prefill_v3_args(q, kp, vp, *ints, o, lse, dtype="float16", config=cfg, max_blocks=max_blocks,
                              scale=0.125, causal=True)
    assert maps[0] == dict(dims=[d, Hq, total_q], strides=[2 * d, 2 * Hq * d], box=[64, g, 128 // g])
    for m in maps[1:]:
        assert m == dict(dims=[d, Hkv, bs, nb], strides=[2 * d, 2 * Hkv * d, 2 * bs * Hkv * d],
                         box=[64, 1, min(bs, cfg.block_n), 1])
    assert len(args) == 17
    max_b, num_b, shift, scale_log2, causal = args[8:13]
    assert (int(max_b), int(num_b), 1 << int(shift), int(causal)) == (max_blocks, nb, g, 1)
    assert abs(float(scale_log2) - 0.125 * np.log2(np.e)) < 1e-6
    assert [int(x) for x in args[13:]] == [Hq * d, d, total_q, 1]


# --------------------------------------------------------------------------- argument checks (no GPU)
def _shuffled(rng, cache, sids):
    """The cache's pools with their blocks permuted across the pool (and the tables to match)."""
    tables, lens = cache.block_tables_array(sids)
    perm = rng.permutation(cache.num_blocks)
    kp, vp = np.empty_like(cache.k_pool), np.empty_like(cache.v_pool)
    kp[perm], vp[perm] = cache.k_pool, cache.v_pool
    return kp, vp, np.where(tables >= 0, perm[np.maximum(tables, 0)], -1).astype(np.int32), lens


@pytest.mark.parametrize("change,name", [
    (dict(q=np.zeros((16, 6, 64), np.float16)), "q"),                  # g = 3: not a power of two
    (dict(q=np.zeros((16, 3, 64), np.float16)), "q"),                  # 3 heads over 2 KV heads
    (dict(q=np.zeros((16, 4, 64), np.float32)), "q"),
    (dict(cu_seqlens_q=np.array([0, 7], np.int32)), "cu_seqlens_q"),
    (dict(cu_seqlens_q=np.array([0, 6, 16], np.int32)), "cu_seqlens_q"),   # 10 queries over 9 cached tokens
    (dict(seq_lens=np.array([40, 900])), "seq_lens"),
    (dict(causal="yes"), "causal"),
    (dict(max_seqlen_q=8), "max_seqlen_q"),
    (dict(config=None), "config"),
    (dict(config=PP.HopperPagedPrefillConfig()), "config"),
])
def test_bad_arguments_raise_naming_the_argument(rng, change, name):
    cache, sids, cq, q = _case(rng, (40, 9), (7, 9), 4, 2, 64, "float16")
    tables, lens = cache.block_tables_array(sids)
    kw = dict(q=q, k_pool=cache.k_pool, v_pool=cache.v_pool, block_tables=tables, seq_lens=lens, cu_seqlens_q=cq,
              config=V3)
    kw.update(change)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        PP.paged_prefill_pools(**kw)


def test_a_block_size_it_cannot_copy_is_refused_by_name(rng):
    cache, sids, cq, q = _case(rng, (40, 9), (7, 9), 4, 2, 64, "float16", block_size=12)
    tables, lens = cache.block_tables_array(sids)
    with pytest.raises(ValueError, match=r"^block_size\b.*12"):
        PP.paged_prefill_pools(q, cache.k_pool, cache.v_pool, tables, lens, cq, config=V3)
    with pytest.raises(ValueError, match=r"^block_size\b.*12"):
        PP.paged_prefill(q, cache, sids, cq, config=V3)


# --------------------------------------------------------------------------- the schedule, modelled (no GPU)
def _model_v3(q, kp, vp, tables, lens, cq, causal, block_n, zero_tail=True):
    """paged_prefill_v3.cu's schedule in float64 NumPy, step for step: the grid (heavy tiles
    first), a block's tile range, the boxes through the table (a block past the pool reads as
    zeros), the zeroed V tail, the per-row key limit (a select), the packed (token, head) rows
    and the rows written.  Returns O, LSE and how often each (token, head) row was written."""
    total_q, Hq, d = q.shape
    nb, bs, Hkv, _ = kp.shape
    g, BM = Hq // Hkv, hp.BLOCK_M
    tokens, box_rows = BM // g, min(bs, block_n)
    o, lse = np.full(q.shape, np.nan), np.full((Hq, total_q), np.nan)
    writes = np.zeros((total_q, Hq), int)
    grid_x = -(-int(np.diff(cq).max(initial=0)) * g // BM)
    for b in range(len(lens)):
        qbeg, nq, n = int(cq[b]), int(cq[b + 1] - cq[b]), int(lens[b])
        for hk in range(Hkv):
            for x in range(grid_x):
                t0 = (grid_x - 1 - x if causal else x) * tokens
                if t0 >= nq:
                    continue
                t_last, off = min(t0 + tokens, nq) - 1, n - nq
                hi = min(n, t_last + off + 1) if causal else n
                n_tiles = -(-hi // block_n) if hi > 0 else 0
                tail = n_tiles > 0 and n % bs != 0 and n < n_tiles * block_n
                rows = np.arange(BM)
                tok, head = t0 + rows // g, hk * g + rows % g
                Q = np.zeros((BM, d))
                inside = qbeg + tok < total_q                  # past total_q: TMA's zeros
                Q[inside] = q[qbeg + tok[inside], head[inside]]
                lim = np.minimum(n, tok + off + 1) if causal else np.full(BM, n)
                K, V = np.zeros((n_tiles * block_n, d)), np.zeros((n_tiles * block_n, d))
                for it in range(n_tiles):
                    key0 = it * block_n
                    for i in range(block_n // box_rows):
                        key = key0 + i * box_rows
                        blk = int(tables[b, key // bs]) if key < n else nb
                        if blk < nb:
                            sl = slice(key0 % bs, key0 % bs + box_rows)
                            K[key:key + box_rows], V[key:key + box_rows] = kp[blk, sl, hk], vp[blk, sl, hk]
                if tail and zero_tail:
                    V[n:] = 0.0
                with np.errstate(invalid="ignore"):
                    S = Q @ K.T / np.sqrt(d)
                S = np.where(np.arange(len(K))[None, :] >= lim[:, None], -np.inf, S)
                m = S.max(axis=1, initial=-np.inf)
                base = np.where(np.isfinite(m), m, 0.0)
                P = np.exp(S - base[:, None])
                l_ = P.sum(axis=1)
                with np.errstate(invalid="ignore"):
                    O = (P @ V) / np.where(l_ > 0, l_, 1.0)[:, None]
                for r in np.flatnonzero(tok < nq):
                    o[qbeg + tok[r], head[r]] = O[r]
                    lse[head[r], qbeg + tok[r]] = m[r] + np.log(l_[r]) if l_[r] > 0 else -np.inf
                    writes[qbeg + tok[r], head[r]] += 1
    return o, lse, writes


@pytest.mark.parametrize("block_size", [8, 16, 64, 256])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_schedule_model_matches_the_oracle(rng, block_size, g, block_n):
    """The kernel's index arithmetic, modelled in NumPy over a NaN-padded shuffled pool: every
    chunk row written once, O and LSE the oracle's; without the V tail zeroed, NaN leaks in."""
    lens, chunks = ((300, 127, 17, 1, 200), (37, 64, 5, 1, 128))
    cache, sids, cq, q = _case(rng, lens, chunks, 2 * g, 2, 64, "float16", block_size=block_size)
    kp, vp, tables, lns = _shuffled(rng, cache, sids)
    f64 = [np.asarray(x, np.float64) for x in (q, kp, vp)]
    for causal in (True, False):
        o, lse, writes = _model_v3(*f64, tables, lns, cq, causal, block_n)
        assert (writes == 1).all()
        ref, ref_lse = testing.paged_prefill_oracle(q, cache, sids, cq, causal)
        assert np.allclose(o, ref, atol=1e-9) and np.allclose(lse, ref_lse, atol=1e-9)
    o, _, _ = _model_v3(*f64, tables, lns, cq, True, block_n, zero_tail=False)
    assert np.isnan(o).any()                    # the unwritten slots of a partial block are NaN


# =========================================================================== GPU (compute capability 9.0)
def _hold(o, lse, q, cache, sids, cq, dtype, causal, label):
    ref, ref_lse = testing.paged_prefill_oracle(q, cache, sids, cq, causal)
    base, base_lse = ik.paged_prefill(q, cache, sids, cq, causal=causal, backend="naive", return_lse=True)
    testing.assert_close(o, ref, base, dtype=dtype, name=f"{label} O")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=LSE_ATOL, name=f"{label} LSE")


#: (cached lengths, chunk lengths): whole prompts of awkward lengths; chunks shorter than the
#: cache (a decode row, 5, 37, 64 rows); an empty chunk next to a whole one
RAGGED = (((1, 17, 127, 300), (1, 17, 127, 300)),
          ((300, 127, 17, 1, 200), (37, 64, 5, 1, 128)),
          ((300, 45), (0, 45)))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_oracle(rng, dtype, d, g, causal):
    """Host cache (NaN in every unwritten slot), the shuffled pools with host tables."""
    for lens, chunks in RAGGED:
        cache, sids, cq, q = _case(rng, lens, chunks, 2 * g, 2, d, dtype)
        label = f"{dtype} d={d} g={g} causal={causal} lens={lens} chunks={chunks}"
        o, lse = PP.paged_prefill(q, cache, sids, cq, causal=causal, config=V3)
        _hold(o, lse, q, cache, sids, cq, dtype, causal, label)
        kp, vp, tables, lns = _shuffled(rng, cache, sids)
        o, lse = PP.paged_prefill_pools(q, kp, vp, tables, lns, cq, causal=causal, config=V3)
        _hold(o, lse, q, cache, sids, cq, dtype, causal, label + " shuffled")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", PP.V3_BLOCK_SIZES)
@pytest.mark.parametrize("kw", [{}, dict(block_n=64), dict(stages=2, pingpong=False)])
def test_every_block_size_and_variant(rng, block_size, kw):
    cfg = V3.replace(**kw)
    for lens, chunks in RAGGED[:2]:
        cache, sids, cq, q = _case(rng, lens, chunks, 8, 2, 128, "bfloat16", block_size=block_size)
        kp, vp, tables, lns = _shuffled(rng, cache, sids)
        for causal in (True, False):
            o, lse = PP.paged_prefill_pools(q, kp, vp, tables, lns, cq, causal=causal, config=cfg)
            _hold(o, lse, q, cache, sids, cq, "bfloat16", causal, f"block_size={block_size} {kw} causal={causal}")


@gpu
@pytest.mark.gpu
def test_device_tables_in_place_and_every_row_written(rng):
    """CuPy outputs poisoned with NaN, device tables / lengths / offsets (int32, used in place),
    max_seqlen_q sizing the grid; float16 (CuPy has no bfloat16), g = 4 and 16, the public call."""
    import cupy as cp
    from iokernels.cupy_raw.launch import on_stream
    for g in (4, 16):
        lens, chunks = RAGGED[1]
        cache, sids, cq, q = _case(rng, lens, chunks, 2 * g, 2, 64, "float16")
        kp, vp, tables, lns = _shuffled(rng, cache, sids)
        dev = [cp.asarray(x.astype(np.int32)) for x in (tables, lns, cq)]
        qd, kd, vd = (cp.asarray(x) for x in (q, kp, vp))
        o = cp.full(q.shape, cp.nan, cp.float16)
        lse = cp.full((q.shape[1], q.shape[0]), cp.nan, cp.float32)
        with on_stream(cp.cuda.get_current_stream().ptr):
            PP.launch_paged_prefill_v3(qd, kd, vd, *dev, o, lse, dtype="float16", block_size=16,
                                       max_blocks=tables.shape[1], longest=max(chunks), scale=0.125, causal=True,
                                       config=V3.resolve(64))
        assert not cp.isnan(o).any() and not cp.isnan(lse).any(), "a row of a chunk was not written"
        o2, lse2 = PP.paged_prefill_pools(qd, kd, vd, *dev, config=V3, max_seqlen_q=max(chunks))
        _hold(cp.asnumpy(o2), cp.asnumpy(lse2), q, cache, sids, cq, "float16", True, f"device tables g={g}")
        o3, lse3 = ik.paged_prefill(q, cache, sids, cq, backend="cupy", config=V3, return_lse=True)
        _hold(o3, lse3, q, cache, sids, cq, "float16", True, f"ik.paged_prefill g={g}")


@gpu
@pytest.mark.gpu
def test_torch_bfloat16_device_pools(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    lens, chunks = RAGGED[0]
    cache, sids, cq, q = _case(rng, lens, chunks, 8, 2, 128, "bfloat16")
    kp, vp, tables, lns = _shuffled(rng, cache, sids)
    to = lambda x: torch.from_numpy(np.asarray(x).view(np.uint16)).cuda().view(torch.bfloat16)  # noqa: E731
    ints = [torch.from_numpy(x.astype(np.int32)).cuda() for x in (tables, lns, cq)]
    o, lse = PP.paged_prefill_pools(to(q), to(kp), to(vp), *ints, config=V3, max_seqlen_q=max(chunks))
    torch.cuda.synchronize()
    o_np = o.float().cpu().numpy()
    _hold(o_np, lse.cpu().numpy(), q, cache, sids, cq, "bfloat16", True, "torch bfloat16")
