"""The CuPy RawKernel kernels on a real GPU, against the float64 oracle.

Skipped cleanly when CuPy sees no GPU (the compile checks in test_cupy_compile.py run
everywhere).  Low precision follows FlashAttention's rule through testing.check: the
error against the float64 oracle may be at most twice the error of the naive algorithm
in the same precision (torch_sdpa.naive_attention, on the GPU).  Outputs are poisoned
with NaN before each launch, so an element a kernel forgets to write fails the check.

Real sizes: N up to 8192.  The oracle is run on the first and the last rows of the
output only (reference.attention on a slice of Q with the keys those rows may see:
bottom-right alignment makes the last rows of Q with all of K exactly the same problem),
so the test stays fast; NaN checks cover every element.

The first run on a machine compiles about 50 kernel variants with NVRTC; CuPy caches them
on disk, so later runs skip the compilation.

Every version comes from the registry (``cupy_raw.REGISTRY``): each forward version runs
wherever its check accepts the dtype, and every decode version in every decode test
(contiguous and paged, ragged and empty sequences, several split counts, the benchmark's
B=1 N=32768 shape); a version whose check refuses a dtype must refuse with a ValueError
naming config.
"""
import math

import numpy as np
import pytest

import iokernels as ik
from iokernels import conventions as cv
from iokernels import cupy_raw, gpu, reference
from iokernels.core.arrays import device_array
from iokernels.core.registry import Need
from iokernels.core.testing import (as_numpy, check, check_gradients, make_grid_inputs, make_inputs,
                                    numpy_dtype, oracle_by_head, report)

from gpu_support import cuda_torch as _torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")]

#: rows of each end of the output held against the oracle at large N
ORACLE_ROWS = 192


def _cr():
    from iokernels import cupy_raw
    return cupy_raw


def _cc():
    return _cr().device_info()["cc"]


def _to_torch(x, dtype):
    torch = _torch()
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda().to(getattr(torch, dtype))


def _run_attention(q, k, v, dtype, causal, window, version):
    """Launch through launch_attention with NaN-poisoned outputs; returns (o, lse) as torch."""
    torch = _torch()
    cr = _cr()
    B, Hq, Nq, d = q.shape
    o = torch.full((B, Hq, Nq, d), float("nan"), dtype=getattr(torch, dtype), device="cuda")
    acc = torch.float64 if dtype == "float64" else torch.float32
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=acc, device="cuda")
    cfg = cr.fit_config(cr.ForwardConfig(version=version), d, dtype, cr.device_info())
    left, right = cv.effective_window(causal, window)
    cr.launch_attention(q, k, v, o, lse, dtype=dtype, scale=1 / math.sqrt(d), window=(left, right), config=cfg)
    torch.cuda.synchronize()
    return o, lse


def _baseline(q, k, v, causal, window, dtype):
    """Naive attention in the same precision (O) and its LSE from the same rounded S."""
    torch = _torch()
    from iokernels.torch_sdpa import naive_attention
    o = naive_attention(q, k, v, causal=causal, window=window)
    Hq, Hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    s = torch.matmul(q * (1 / math.sqrt(q.shape[-1])), kk.transpose(-1, -2))
    vis = torch.from_numpy(cv.mask(q.shape[2], k.shape[2], causal, window)).to(q.device)
    lse = torch.logsumexp(s.float().masked_fill(~vis, -math.inf), dim=-1)
    return o, lse


def _check_slices(q, k, v, o, lse, dtype, causal, window):
    """Oracle on the first and last ORACLE_ROWS rows (or all of them); NaN check on all."""
    Nq, Nk = q.shape[2], k.shape[2]
    assert not np.isnan(as_numpy(o)).any(), "unwritten / NaN output"
    assert not np.isnan(as_numpy(lse)).any(), "unwritten / NaN LSE"
    slices = [(0, Nq)] if Nq <= 2 * ORACLE_ROWS else [(Nq - ORACLE_ROWS, Nq), (0, ORACLE_ROWS)]
    for r0, r1 in slices:
        if r1 == Nq:
            ks = (0, Nk)                              # the last rows with all keys: the same problem
        elif causal and window is None and Nq == Nk:
            ks = (0, r1)                              # first rows, causal, square: they see keys < r1
        elif not causal and window is None:
            ks = (0, Nk)
        else:
            continue
        qs, kk, vv = q[:, :, r0:r1], k[:, :, ks[0]:ks[1]], v[:, :, ks[0]:ks[1]]
        ref_o, ref_l = reference.attention(qs, kk, vv, causal=causal, window=window)
        masked = ~np.isfinite(ref_l)[..., None]
        if dtype == "float64":
            c1 = check(o[:, :, r0:r1], ref_o, dtype=dtype, name="O", masked_rows=masked)
            c2 = check(lse[:, :, r0:r1], ref_l, dtype=dtype, name="LSE")
        else:
            bo, bl = _baseline(qs, kk, vv, causal, window, dtype)
            c1 = check(o[:, :, r0:r1], ref_o, bo, dtype=dtype, name="O", masked_rows=masked)
            c2 = check(lse[:, :, r0:r1], ref_l, bl, dtype=dtype, name="LSE")
        assert c1, f"rows {r0}:{r1}: {c1}"
        assert c2, f"rows {r0}:{r1}: {c2}"


def _inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype):
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                          dtype="float32")
    if dtype == "float64":
        torch = _torch()
        return tuple(torch.from_numpy(x.astype(np.float64)).cuda() for x in (q, k, v))
    return tuple(_to_torch(x, dtype) for x in (q, k, v))


def _versions(dtype, d=128):
    """The portable forward versions (launch_attention's: v1, v1b, v2) that run ``dtype`` on this
    GPU, the default first (the registry); the Hopper versions are tests/test_hopper.py's."""
    n = Need(dtype=dtype, head_dim=d, cc=_cc(), extra=dict(smem=_cr().device_info()["smem_optin"]))
    ks = sorted((k for k in _cr().REGISTRY.kernels("attention") if k.config_class is _cr().ForwardConfig),
                key=lambda k: -k.rank)
    return tuple(k.version for k in ks if k.unavailable(n) is None)


def _dtypes():
    return ["float32", "float16"] + (["bfloat16"] if _cc() >= 80 else [])


# --------------------------------------------------------------------------- forward, real sizes
@pytest.mark.parametrize("N", [1, 127, 1024, 4096, 8192])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_real_sizes(rng, N, d, causal):
    """Every dtype, every version it has, GQA 4/2 (2/1 at large N), against the oracle."""
    B, Hq, Hkv = (2, 4, 2) if N <= 1024 else (1, 2, 1)
    for dtype in _dtypes():
        q, k, v = _inputs(rng, B, Hq, Hkv, N, N, d, dtype)
        for version in _versions(dtype):
            if version == "v1" and dtype != "float32" and N > 1024:
                continue                                  # v1 on 16-bit: checked at small N only
            o, lse = _run_attention(q, k, v, dtype, causal, None, version)
            _check_slices(q, k, v, o, lse, dtype, causal, None)


@pytest.mark.parametrize("d", [59, 72, 111])
def test_forward_awkward_shapes(rng, d):
    """Head dims off the 16/64 grid, Nq != Nk, windows, fully masked rows (Nq > Nk causal)."""
    for dtype in _dtypes():
        for (Nq, Nk, causal, window) in ((37, 300, True, None), (300, 37, True, None),
                                         (129, 200, False, (17, 5)), (65, 65, True, (0, -1))):
            q, k, v = _inputs(rng, 2, 6, 3, Nq, Nk, d, dtype)
            # v1 on 16-bit: covered at real sizes; float32 runs v1 and v1b
            for version in (_versions(dtype) if dtype == "float32" else _versions(dtype)[:1]):
                o, lse = _run_attention(q, k, v, dtype, causal, window, version)
                _check_slices(q, k, v, o, lse, dtype, causal, window)


@pytest.mark.parametrize("bq,bk", [(64, 32), (32, 64), (16, 16)])
def test_forward_v1b_tiles(rng, bq, bk):
    """v1b at its other tile shapes (the swizzles and the K/V stages depend on Br, Bc)."""
    torch = _torch()
    cr = _cr()
    for (Nq, Nk, causal, window, d) in ((300, 300, True, None, 64), (129, 517, False, (40, 7), 72),
                                         (77, 45, True, None, 128)):
        q, k, v = _inputs(rng, 2, 4, 2, Nq, Nk, d, "float32")
        o = torch.full(q.shape, float("nan"), device="cuda")
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        cfg = cr.fit_config(cr.ForwardConfig(version="v1b", block_q=bq, block_k=bk), d, "float32", cr.device_info())
        left, right = cv.effective_window(causal, window)
        cr.launch_attention(q, k, v, o, lse, dtype="float32", scale=1 / math.sqrt(d), window=(left, right),
                            config=cfg)
        torch.cuda.synchronize()
        _check_slices(q, k, v, o, lse, "float32", causal, window)


def test_forward_v1b_unaligned_rows(rng):
    """K, V rows that do not start on 16 bytes: v1b falls back to element copies (VEC_IO=0)."""
    torch = _torch()
    q, k, v = _inputs(rng, 1, 4, 2, 100, 140, 64, "float32")
    kb = torch.zeros((1, 2, 140, 65), device="cuda")
    vb = torch.zeros((1, 2, 140, 65), device="cuda")
    kb[..., 1:], vb[..., 1:] = k, v
    ku, vu = kb[..., 1:], vb[..., 1:]                         # unit stride, rows 4 bytes off 16
    assert not device_array(ku).aligned(16)
    o, lse = _run_attention(q, ku, vu, "float32", True, None, "v1b")
    _check_slices(q, k, v, o, lse, "float32", True, None)


def test_forward_float64_matches_oracle(rng):
    """v1 in float64: the same algorithm, no rounding to hide behind (1e-12)."""
    for causal, window in ((False, None), (True, None), (False, (30, 2))):
        q, k, v = _inputs(rng, 1, 4, 2, 150, 211, 64, "float64")
        o, lse = _run_attention(q, k, v, "float64", causal, window, "v1")
        _check_slices(q, k, v, o, lse, "float64", causal, window)


def test_public_api_kinds_round_trip(rng):
    """CuPy in -> CuPy out, torch in -> torch out (same tensor kind, device), NumPy in -> NumPy out."""
    import cupy
    torch = _torch()
    q, k, v = make_inputs(rng, batch=1, heads_q=2, seqlen_q=70, seqlen_k=90, head_dim=64, dtype="float16")
    ref_o, ref_l = reference.attention(q, k, v, causal=True)
    base = ik.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal=True,
                        backend="naive").astype(np.float16)
    outs = {
        "numpy": ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True),
        "cupy": ik.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True, backend="cupy",
                             return_lse=True),
        "torch": ik.attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal=True, backend="cupy",
                              return_lse=True),
    }
    assert isinstance(outs["numpy"][0], np.ndarray) and outs["numpy"][0].dtype == np.float16
    assert isinstance(outs["cupy"][0], cupy.ndarray)
    assert isinstance(outs["torch"][0], torch.Tensor) and outs["torch"][0].is_cuda
    assert outs["torch"][1].dtype == torch.float32
    for kind, (o, lse) in outs.items():
        assert check(o, ref_o, base, dtype="float16"), kind
        assert np.allclose(as_numpy(lse), ref_l, atol=1e-3), kind


def test_strided_inputs_without_copy(rng):
    """K and V as permuted views of a (B, N, H, d) buffer: strides are passed, not copied."""
    torch = _torch()
    q, k, v = _inputs(rng, 2, 4, 2, 100, 130, 64, "float16")
    kb = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)   # non-contiguous view
    vb = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not kb.is_contiguous()
    o, lse = _run_attention(q, kb, vb, "float16", False, None, "v2")
    _check_slices(q, k, v, o, lse, "float16", False, None)
    from iokernels.cupy_raw.launch import unit_rows
    assert unit_rows(kb).ptr == kb.data_ptr()                    # the same memory, no copy
    del torch


def test_config_errors_name_config():
    cr = _cr()
    with pytest.raises(ValueError, match="config"):
        cr.ForwardConfig(version="v9")
    with pytest.raises(ValueError, match="config"):
        cr.ForwardConfig(version="v2").resolve(64, "float32")
    with pytest.raises(ValueError, match="config"):
        cr.ForwardConfig(version="v2", num_warps=4, block_q=32).resolve(64, "float16")
    with pytest.raises(ValueError, match="config"):
        cr.ForwardConfig(version="v1", block_q=48).resolve(64, "float32")
    for dt in ("float16", "bfloat16", "float64"):                 # v1b is the float32 kernel
        with pytest.raises(ValueError, match="config"):
            cr.ForwardConfig(version="v1b").resolve(64, dt)
    with pytest.raises(ValueError, match="config"):
        cr.DecodeConfig(version="v99")
    for bad in (dict(version="v3", num_warps=6), dict(version="v2", num_warps=8), dict(version="v3", fused=1)):
        with pytest.raises(ValueError, match="config"):
            cr.DecodeConfig(**bad)
    with pytest.raises(ValueError, match="config"):
        cr.DecodeConfig(version="v2", stages=1)
    with pytest.raises(ValueError, match="config"):
        cr.decode_v2_geometry(128, "bfloat16", tile_rows=3)        # 2 rows side by side
    big = cr.ForwardConfig(version="v1").resolve(256, "float64")
    with pytest.raises(ValueError, match="config"):
        big.check_fits(256, "float64", cr.device_info()["smem_optin"])


# --------------------------------------------------------------------------- decode, paged, gather
DECODE_VERSIONS = tuple(sorted(cupy_raw.REGISTRY.versions("decode")))
PAGED_DECODE_VERSIONS = tuple(sorted(cupy_raw.REGISTRY.versions("paged_decode")))   # v8 reads a contiguous cache only


@pytest.mark.parametrize("version", DECODE_VERSIONS)
@pytest.mark.parametrize("d", [64, 128])
def test_decode_against_oracle(rng, d, version):
    """Split-KV decode, GQA 8/2, ragged lengths incl. 0 and shorter than a tile, several split
    counts (more splits than a short sequence has tiles), every dtype, every version; where the
    version's check refuses the call (float64 at d=128: 64 chunks a row; v4: float32/float64)
    the explicit config raises naming config, and the registry's default runs instead."""
    torch = _torch()
    cr = _cr()
    config = cr.DecodeConfig(version=version)
    B, Hq, Hkv, N = 4, 8, 2, 1000
    lens = np.array([1000, 0, 333, 5])
    for dtype in _dtypes() + ["float64"]:
        q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=1, seqlen_k=N, head_dim=d,
                              dtype="float32")
        q = q[:, :, 0]
        tq, tk, tv = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q, k, v))
        ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens)
        if dtype != "float64":
            base = torch.zeros_like(tq)
            for b in range(B):
                n = int(lens[b])
                if n:
                    base[b] = cr_naive(tq[b:b + 1, :, None], tk[b:b + 1, :, :n], tv[b:b + 1, :, :n])[0, :, 0]
        n = cr.need("decode", q=tq, k=tk, v=tv)
        run_config = config
        refused = cr.REGISTRY.get("decode", version).unavailable(n) is not None
        if refused:
            with pytest.raises(ValueError, match="config.version"):
                cr.decode(tq, tk, tv, seq_lens=lens, config=config)
            run_config = None
        rows_fit = cr.decode_v2_geometry(d, dtype) is not None
        assert refused == {"v1": False, "v2": not rows_fit, "v3": not rows_fit,
                           "v4": dtype not in ("float16", "bfloat16"),
                           "v6": dtype not in ("float16", "bfloat16"),
                           "v9": dtype not in ("float16", "bfloat16")}.get(version, refused), (version, dtype)
        for S in (None, 1, 7):
            o, lse = cr.decode(tq, tk, tv, seq_lens=lens, num_splits=S, scale=None, config=run_config)
            masked = ~np.isfinite(ref_l)[..., None]
            if dtype == "float64":
                assert check(o, ref_o, dtype=dtype, masked_rows=masked), (dtype, S)
                assert check(lse, ref_l, dtype=dtype), (dtype, S)
            else:
                c = check(o, ref_o, base, dtype=dtype, masked_rows=masked)
                assert c, (dtype, S, str(c))
                assert np.all(np.isneginf(as_numpy(lse)[1])), "empty sequence: LSE must be -inf"
                fin = np.isfinite(ref_l)
                assert np.max(np.abs(as_numpy(lse)[fin] - ref_l[fin])) < 2e-2, (dtype, S)


def cr_naive(q, k, v):
    from iokernels.torch_sdpa import naive_attention
    return naive_attention(q, k, v)


def _paged_cache(rng, lens, Hkv, d, dtype, block_size=16):
    cache = ik.PagedKVCache(sum(-(-n // block_size) for n in lens) + 3, block_size=block_size,
                            num_kv_heads=Hkv, head_dim=d, dtype=np.dtype(dtype))
    sids = [cache.new_sequence() for _ in lens]
    for step in range(0, max(lens), 40):                  # interleaved appends: scattered blocks
        for sid, n in zip(sids, lens):
            m = min(40, n - step)
            if m > 0:
                cache.append(sid, rng.standard_normal((m, Hkv, d)).astype(dtype),
                             rng.standard_normal((m, Hkv, d)).astype(dtype))
    return cache, sids


@pytest.mark.parametrize("version", PAGED_DECODE_VERSIONS)
@pytest.mark.parametrize("d", [64, 128])
def test_paged_decode_matches_contiguous(rng, d, version):
    """Paged decode == the oracle on the gathered cache; device pools and NumPy pools.  Where the
    version's check refuses the call (v4, v6: 16-bit only; v7: a group of 4 heads, which v3
    holds) the named config raises naming config, and the default runs instead."""
    import cupy
    cr = _cr()
    lens = [517, 1, 130]
    for dtype in ("float16", "float32"):
        cache, sids = _paged_cache(rng, lens, 2, d, dtype)
        q = rng.standard_normal((3, 8, d)).astype(dtype)
        config = cr.DecodeConfig(version=version)
        refused = cr.REGISTRY.get("paged_decode", version).unavailable(cr.need("paged_decode", q=q, cache=cache))
        # v5 reads only a quantized cache's codes (its own tests: test_gpu_decode_window_quant.py)
        assert (refused is not None) == {"v4": dtype == "float32", "v6": dtype == "float32", "v5": True,
                                         "v7": True, "v9": dtype == "float32"}.get(version, False), (version, dtype,
                                                                                                    refused)
        if refused:
            with pytest.raises(ValueError, match="config.version"):
                cr.paged_decode(q, cache, sids, config=config)
            config = None
        ks, vs = zip(*(cache.gather(s, backend="numpy") for s in sids))
        N = max(lens)
        kc = np.zeros((3, 2, N, d), dtype)
        vc = np.zeros((3, 2, N, d), dtype)
        for b, n in enumerate(lens):
            kc[b, :, :n], vc[b, :, :n] = ks[b], vs[b]
        ref_o, ref_l = reference.decode(q, kc, vc, seq_lens=np.array(lens))
        o_c, l_c = cr.decode(q, kc, vc, seq_lens=np.array(lens), num_splits=4, scale=None, config=config)
        # the same split count over the same keys: paged and contiguous do the same arithmetic
        o_p, l_p = cr.paged_decode(q, cache, sids, num_splits=4, scale=None, config=config)
        assert np.allclose(o_p.astype(np.float64), o_c.astype(np.float64), rtol=2e-3, atol=2e-3)
        assert np.allclose(l_p, l_c, rtol=1e-5, atol=1e-5)
        for S in (None, 1, 5):
            o, lse = cr.paged_decode(q, cache, sids, num_splits=S, scale=None, config=config)
            base = np.max(np.abs(o_c.astype(np.float64) - ref_o))
            assert np.max(np.abs(o.astype(np.float64) - ref_o)) <= 2 * base + 2e-3
            assert np.max(np.abs(lse - ref_l)) < 1e-3
        t, ln = cache.block_tables_array(sids)
        o2, _ = cr.paged_decode_pools(cupy.asarray(q), cupy.asarray(cache.k_pool), cupy.asarray(cache.v_pool),
                                      t, ln, num_splits=3, config=config)
        assert isinstance(o2, cupy.ndarray)
        assert np.max(np.abs(o2.get().astype(np.float64) - ref_o)) < 5e-3


@pytest.mark.parametrize("dtype,d,group,block_size,stages,tile_rows", [
    ("float16", 72, 4, 7, None, None),         # 9 chunks a row on 16 lanes; pages of 7 rows
    ("bfloat16", 128, 8, 16, 2, None),         # shallowest ring
    ("bfloat16", 128, 1, 16, 4, 2),            # MHA, deep ring, tiles of one row step
    ("float32", 128, 4, 5, None, 8),           # 32 lanes a row
    ("float64", 64, 2, 16, None, None),        # float64 accumulators, 32 chunks a row
])
def test_decode_v2_configs(rng, dtype, d, group, block_size, stages, tile_rows):
    """decode v2 across ring depths, tile sizes, GQA groups and page sizes: contiguous and
    paged against the oracle, ragged lengths with an empty sequence, 1 and 6 splits."""
    _check_ring_config(rng, dict(version="v2", stages=stages, tile_rows=tile_rows), dtype, d, group, block_size)


@pytest.mark.parametrize("dtype,d,group,block_size,kw", [
    ("float16", 72, 4, 7, dict()),                                  # 9 chunks a row; pages of 7 rows
    ("bfloat16", 128, 4, 16, dict(num_warps=8)),                    # 8 warps a block
    ("bfloat16", 128, 8, 16, dict(fused=False, stages=4)),          # the two-launch structure
    ("bfloat16", 128, 1, 16, dict(num_warps=8, stages=2, tile_rows=2)),   # MHA, one row step a tile
    ("float32", 128, 4, 5, dict(tile_rows=8, num_warps=8)),         # 32 lanes a row
    ("float64", 64, 2, 16, dict()),                                 # float64 fused combine
])
def test_decode_v3_configs(rng, dtype, d, group, block_size, kw):
    """decode v3 (fused combine) across warps, ring depths, tiles, groups and page sizes, as
    v2's test: contiguous and paged against the oracle, ragged lengths incl. 0 and 1."""
    _check_ring_config(rng, dict(version="v3", **kw), dtype, d, group, block_size)


@pytest.mark.parametrize("dtype,d,group,block_size,kw", [
    ("bfloat16", 128, 4, 16, dict()),                               # the default (GQA 32/8's group)
    ("float16", 128, 4, 16, dict()),
    ("float16", 64, 8, 7, dict(num_warps=8)),                       # pages of 7 rows, 8 warps
    ("bfloat16", 64, 1, 16, dict(stages=2, tile_rows=32)),          # MHA: one useful A row in 16
    ("bfloat16", 128, 16, 16, dict(fused=False)),                   # rows 8..15 used; two launches
    ("float16", 112, 12, 5, dict(tile_rows=48, stages=2)),          # 12 of 16 rows, odd page size
    ("float16", 256, 8, 16, dict()),                                # the largest head dim
    ("bfloat16", 128, 4, 16, dict(load_l1=False)),                 # contiguous: fixed offsets, .cg, 3 stages
    ("float16", 112, 12, 5, dict(load_l1=True)),                   # .ca on the per-copy path; pages too
    ("float16", 64, 2, 16, dict(num_warps=4, min_blocks=2)),       # the two-an-SM block of large batches
])
def test_decode_v4_configs(rng, dtype, d, group, block_size, kw):
    """decode v4 (tensor cores) across groups 1..16, head dims 64..256, tiles, warps, ring
    depths and page sizes, as v3's test: contiguous and paged against the oracle, ragged
    lengths incl. 0 and 1, splits 1, 6 and 37; the errors printed per case."""
    if _cc() < 80:
        pytest.skip("decode v4 needs sm_80")
    _check_ring_config(rng, dict(version="v4", **kw), dtype, d, group, block_size)


@pytest.mark.parametrize("load,dtype,d,group,kw", [
    ("same", "bfloat16", 128, 4, dict()),
    ("same", "float16", 112, 12, dict(tile_rows=48, stages=2)),
    ("padded", "bfloat16", 128, 4, dict()),
    ("bulk", "bfloat16", 128, 4, dict()),                          # bulk copies (sm_90)
    ("bulk", "float16", 112, 12, dict(tile_rows=48, stages=2)),     # 3 rows a lane, odd page size
])
def test_decode_v4_load_experiments(rng, load, dtype, d, group, kw):
    """The sweeps' load experiments (iokernels.bench.decode_loads, decode_v4_loads.cu) change
    only where the bytes land in SRAM, never the products: each gives decode v4's output bit
    for bit, contiguous and paged (pages of 5 rows), ragged lengths incl. 0, splits 1 and 6."""
    if _cc() < (90 if load == "bulk" else 80):
        pytest.skip("decode v4 needs sm_80 (its bulk copies sm_90)")
    torch = _torch()
    cr = _cr()
    from iokernels import bench
    from iokernels.bench import decode_loads as dl
    B, Hkv, N = 3, 2, 335
    tdt = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((B, Hkv * group, d)).astype(np.float32)).cuda().to(tdt)
    k, v = (torch.from_numpy(rng.standard_normal((B, Hkv, N, d)).astype(np.float32)).cuda().to(tdt) for _ in range(2))
    lens = np.array([N, 0, 200])
    kp, vp, tables, _ = bench.device_pages(k, v, seed=0, block_size=5)
    cfg = cr.DecodeConfig("v4", **kw)
    ref_o, _ = reference.decode(q, k, v, seq_lens=lens)
    for splits in (1, 6):
        got = {"contiguous": dl.decode(q, k, v, load, seq_lens=lens, num_splits=splits, config=cfg),
               "paged": dl.paged_decode_pools(q, kp, vp, tables, lens, load, num_splits=splits, config=cfg)}
        want = {"contiguous": cr.decode(q, k, v, seq_lens=lens, num_splits=splits, config=cfg),
                "paged": cr.paged_decode_pools(q, kp, vp, tables, lens, num_splits=splits, config=cfg)}
        for name in got:
            label = f"{load} {name} splits={splits}"
            assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1]), label
            err = np.max(np.abs(as_numpy(got[name][0]).astype(np.float64) - ref_o))
            assert err < 2e-2, f"{label}: max |O - ref| = {err:.3g}"


def test_decode_v4_strided_cache(rng):
    """decode v4 on views: K/V a slice of a longer cache (the row stride and the head stride
    are not N x d) and q a strided view, bit for bit what the contiguous copies give."""
    if _cc() < 80:
        pytest.skip("decode v4 needs sm_80")
    torch = _torch()
    cr = _cr()
    B, Hq, Hkv, N, d = 3, 16, 4, 701, 128
    big = [torch.from_numpy(rng.standard_normal((B, Hkv, N + 67, d)).astype(np.float32)).cuda().half()
           for _ in range(2)]
    kv = [x[:, :, 30:30 + N] for x in big]
    qbig = torch.from_numpy(rng.standard_normal((B, 2 * Hq, d)).astype(np.float32)).cuda().half()
    q = qbig[:, ::2]
    assert not kv[0].is_contiguous() and not q.is_contiguous()
    lens = np.array([701, 0, 250])
    config = cr.DecodeConfig(version="v4")
    o1, l1 = cr.decode(q, *kv, seq_lens=lens, num_splits=5, config=config)
    o2, l2 = cr.decode(q.contiguous(), *(x.contiguous() for x in kv), seq_lens=lens, num_splits=5, config=config)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    ref_o, ref_l = reference.decode(q, *kv, seq_lens=lens)
    fin = np.isfinite(ref_l)
    err = np.max(np.abs(as_numpy(o1).astype(np.float64) - ref_o))
    assert err < 1e-2 and np.all(np.isneginf(as_numpy(l1)[1])), f"max |O - ref| = {err:.3g}"
    assert np.max(np.abs(as_numpy(l1)[fin] - ref_l[fin])) < 2e-2


def _check_ring_config(rng, cfg_kw, dtype, d, group, block_size):
    if dtype == "bfloat16" and _cc() < 80:
        pytest.skip("bfloat16 needs sm_80")
    torch = _torch()
    cr = _cr()
    config = cr.DecodeConfig(**cfg_kw)
    lens = [203, 0, 64, 1]
    Hkv = 2
    cache, sids = _paged_cache(rng, lens, Hkv, d, "float32", block_size=block_size)
    N = max(lens)
    kc = np.zeros((len(lens), Hkv, N, d), np.float32)
    vc = np.zeros((len(lens), Hkv, N, d), np.float32)
    for b, sid in enumerate(sids):
        n = lens[b]
        if n:
            kc[b, :, :n], vc[b, :, :n] = cache.gather(sid, backend="numpy")
    q = rng.standard_normal((len(lens), Hkv * group, d)).astype(np.float32)
    tdt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(x).cuda().to(tdt) for x in (q, kc, vc))
    assert cr.REGISTRY.resolve("decode", config, cr.need("decode", q=tq, k=tk, v=tv))[0].version == config.version
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=np.array(lens))
    masked = ~np.isfinite(ref_l)[..., None]
    tables, tl = cache.block_tables_array(sids)
    # the pools keep their NaN fill in unused rows: a kernel that reads past a sequence's end fails
    kp, vp = (torch.from_numpy(p).cuda().to(tdt) for p in (cache.k_pool, cache.v_pool))
    for S in (1, 6, 37):                              # 37: more splits than the short sequences have keys
        outs = {"contiguous": cr.decode(tq, tk, tv, seq_lens=np.array(lens), num_splits=S, config=config),
                "paged": cr.paged_decode_pools(tq, kp, vp, tables, tl, num_splits=S, config=config)}
        for kind, (o, lse) in outs.items():
            assert np.all(np.isneginf(as_numpy(lse)[1])), (kind, S, "empty sequence: LSE must be -inf")
            assert np.all(as_numpy(o)[1].astype(np.float64) == 0), (kind, S, "empty sequence: O must be 0")
            fin = np.isfinite(ref_l)
            if dtype == "float64":
                assert check(o, ref_o, dtype=dtype, masked_rows=masked), (kind, S)
                assert check(lse, ref_l, dtype=dtype), (kind, S)
            else:
                base = torch.zeros_like(tq)
                for b, n in enumerate(lens):
                    if n:
                        base[b] = cr_naive(tq[b:b + 1, :, None], tk[b:b + 1, :, :n], tv[b:b + 1, :, :n])[0, :, 0]
                c = check(o, ref_o, base, dtype=dtype, masked_rows=masked)
                assert c, (cfg_kw, dtype, d, group, kind, S, str(c))
                lse_err = np.max(np.abs(as_numpy(lse)[fin] - ref_l[fin]))
                assert lse_err < 2e-2, (cfg_kw, dtype, d, group, kind, S, f"max |LSE - ref| = {lse_err:.3g}")


def test_paged_gather_is_exact(rng):
    """Gather is a copy: bit-exact against the NumPy gather, every dtype and awkward widths."""
    import cupy
    cr = _cr()
    for dtype, d, bs in (("float16", 128, 16), ("float32", 59, 16), ("float64", 64, 7), ("float16", 3, 5)):
        cache, sids = _paged_cache(rng, [203, 17], 3, d, dtype, block_size=bs)
        for sid in sids:
            want_k, want_v = cache.gather(sid, backend="numpy")
            got_k, got_v = cache.gather(sid, backend="cupy")
            assert got_k.dtype == want_k.dtype and np.array_equal(got_k, want_k)
            assert np.array_equal(got_v, want_v)
        kd, vd = cr.gather_pools(cupy.asarray(cache.k_pool), cupy.asarray(cache.v_pool),
                                 cache.block_table(sids[0]), cache.seq_len(sids[0]))
        assert isinstance(kd, cupy.ndarray)
        assert np.array_equal(kd.get(), cache.gather(sids[0], backend="numpy")[0])


# decode_wave_splits (cupy_raw.policy) is pure Python: tests/test_cupy_compile.py tests its properties without a GPU.


@pytest.mark.parametrize("version", ["v2", "v3", "v4"])
def test_decode_large_b1(rng, version):
    """The benchmark's shape: bf16 (fp16 below sm_80), B=1, N=32768, GQA 32/8, d=128, at the
    heuristic's split count, contiguous and paged (a shuffled block table), against the
    float64 oracle by the 2x rule; the same call twice gives the same bits (v3's counters
    reset), and paged equals contiguous at the same split count."""
    torch = _torch()
    cr = _cr()
    from iokernels import bench
    dtype = "bfloat16" if _cc() >= 80 else "float16"
    tdt = getattr(torch, dtype)
    B, Hq, Hkv, N, d = 1, 32, 8, 32768, 128
    q = rng.standard_normal((B, Hq, d)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, N, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, d)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).cuda().to(tdt) for x in (q, k, v))
    ref_o, ref_l = reference.decode(tq, tk, tv)
    base = cr_naive(tq[:, :, None], tk, tv)[:, :, 0]
    config = cr.DecodeConfig(version=version)
    o1, l1 = cr.decode(tq, tk, tv, config=config)
    o2, l2 = cr.decode(tq, tk, tv, config=config)
    assert torch.equal(o1, o2) and torch.equal(l1, l2), "a second call differs"
    c = check(o1, ref_o, base, dtype=dtype)
    assert c, str(c)
    assert np.max(np.abs(as_numpy(l1) - ref_l)) < 2e-2
    kp, vp, tables, lens = bench.device_pages(tk, tv, seed=int(rng.integers(1 << 30)))
    assert not np.array_equal(tables[0], np.arange(tables.shape[1])), "the table should be shuffled"
    S = cr.decode_wave_splits(B, Hkv, N, cr.device_info()["sms"])
    for splits in (S, 1, 128):
        o_c, l_c = cr.decode(tq, tk, tv, num_splits=splits, config=config)
        o_p, l_p = cr.paged_decode_pools(tq, kp, vp, tables, lens, num_splits=splits, config=config)
        # the same keys in the same order through the same arithmetic: paged == contiguous
        # (a small tolerance: the two are separately compiled kernels)
        assert torch.allclose(o_p.float(), o_c.float(), rtol=1e-2, atol=1e-3), splits
        assert torch.allclose(l_p, l_c, rtol=0, atol=1e-5), splits
        c = check(o_p, ref_o, base, dtype=dtype)
        assert c, (splits, str(c))


def test_decode_v4_default_at_a_batch_that_fills_the_sms(rng):
    """A batch whose (b, kv head) pairs give every SM one or more (the default then runs 4-warp
    blocks with a 2-stage ring, two an SM): ragged lengths incl. 0 and 1 with NaN past each
    sequence's end (a kernel that reads a row it should not fails), against the float64 oracle by
    the 2x rule, and close to the 8-warp block's result (the same keys, merged over more warps);
    then the same cache paged (shuffled 16-row blocks, NaN past each end), by the same rule."""
    if _cc() < 80:
        pytest.skip("decode v4 needs sm_80")
    torch = _torch()
    cr = _cr()
    Hq, Hkv, d = 32, 8, 128
    B = -(-cupy_raw.config.DECODE_V4_PAIRS_SPLIT_BLOCK * cr.device_info()["sms"] // Hkv) + 1
    lens = rng.integers(2, 300, size=B)
    lens[:2] = (0, 1)
    N = int(lens.max())
    q = rng.standard_normal((B, Hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(np.float32) for _ in range(2))
    past = np.arange(N)[None, None, :] >= lens[:, None, None]
    k[np.broadcast_to(past, (B, Hkv, N))] = np.nan
    v[np.broadcast_to(past, (B, Hkv, N))] = np.nan
    tq, tk, tv = (torch.from_numpy(x).cuda().bfloat16() for x in (q, k, v))
    ref_o, ref_l = reference.decode(tq, tk, tv, seq_lens=lens)
    masked = ~np.isfinite(ref_l)[..., None]
    o, lse = cr.decode(tq, tk, tv, seq_lens=lens)
    base = torch.zeros_like(tq)
    for b, n in enumerate(lens):
        if n:
            base[b] = cr_naive(tq[b:b + 1, :, None], tk[b:b + 1, :, :n], tv[b:b + 1, :, :n])[0, :, 0]
    c = check(o, ref_o, base, dtype="bfloat16", masked_rows=masked)
    assert c, str(c)
    fin = np.isfinite(ref_l)
    assert np.all(np.isneginf(as_numpy(lse)[0])) and np.all(as_numpy(o)[0].astype(np.float64) == 0)
    assert np.max(np.abs(as_numpy(lse)[fin] - ref_l[fin])) < 2e-2
    o8, _ = cr.decode(tq, tk, tv, seq_lens=lens, config=cr.DecodeConfig("v4", num_warps=8))
    assert torch.allclose(o.float(), o8.float(), rtol=2e-2, atol=2e-3)
    # the same cache in 16-row pages, dealt to shuffled blocks (the paged default's small block)
    bs = 16
    per = -(-N // bs)
    order = rng.permutation(B * per)
    tables = torch.from_numpy(order.reshape(B, per).astype(np.int32)).cuda()
    pools = []
    for t in (tk, tv):
        pool = torch.full((B * per, bs, Hkv, d), float("nan"), device="cuda", dtype=t.dtype)
        pad = torch.full((B, Hkv, per * bs, d), float("nan"), device="cuda", dtype=t.dtype)
        pad[:, :, :N] = t
        pool[tables.long().flatten()] = pad.reshape(B, Hkv, per, bs, d).permute(0, 2, 3, 1, 4).reshape(-1, bs, Hkv, d)
        pools.append(pool)
    o_p, lse_p = cr.paged_decode_pools(tq, *pools, tables, torch.from_numpy(lens.astype(np.int32)).cuda())
    c = check(o_p, ref_o, base, dtype="bfloat16", masked_rows=masked)
    assert c, "paged: " + str(c)
    assert np.max(np.abs(as_numpy(lse_p)[fin] - ref_l[fin])) < 2e-2 and np.all(np.isneginf(as_numpy(lse_p)[0]))


def test_sanitize_cases_run():
    """The compute-sanitizer entry point runs every registered kernel, each against the oracle."""
    ran = _cr().sanitize_cases(verbose=False)
    for k in _cr().REGISTRY:
        assert any(r.startswith(f"{k.op} {k.version} ") for r in ran), k.name
    assert any("unfused" in r or "'fused': False" in r for r in ran)
    assert any("'combine': 'parallel'" in r for r in ran)              # decode_combine.cu's kernel too
    assert any(r.startswith("decode v9") and "dealt across pairs" in r for r in ran)   # v9's own deal too
    for kv in ("int8", "float8_e4m3fn"):                 # decode v5, the quantized codes, both formats
        assert any(r.startswith("paged_decode v5") and f" {kv} " in r for r in ran), kv


@pytest.mark.parametrize("version", PAGED_DECODE_VERSIONS)
def test_paged_decode_takes_strided_pools_in_place(rng, version):
    """A pool stored heads-outer, (blocks, Hkv, slots, d), passed as its (blocks, slots, Hkv,
    d) view: the decode kernels read it through its strides (no copy) and give what the
    slots-outer pool gives, bit for bit; a view whose rows are not unit-stride is copied."""
    torch = _torch()
    cr = _cr()
    from iokernels import bench
    B, Hq, Hkv, N, d = 2, 8, 2, 777, 64
    if version == "v7":                     # v7 takes only the groups v3's registers do not hold
        Hq = 64
    tq = torch.from_numpy(rng.standard_normal((B, Hq, d)).astype(np.float32)).cuda().half()
    tk, tv = (torch.from_numpy(rng.standard_normal((B, Hkv, N + 15, d)).astype(np.float32)).cuda().half()
              for _ in range(2))
    kp, vp, tables, _ = bench.device_pages(tk[:, :, :784], tv[:, :, :784], seed=3)
    lens = np.array([777, 300], np.int32)
    outer = [p.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for p in (kp, vp)]
    assert not outer[0].is_contiguous() and outer[0].stride(-1) == 1
    config = cr.DecodeConfig(version=version)
    if version == "v5":                     # v5 reads a quantized cache's codes, not 16-bit rows
        with pytest.raises(ValueError, match="config.version"):
            cr.paged_decode_pools(tq, kp, vp, tables, lens, num_splits=3, config=config)
        return
    o1, l1 = cr.paged_decode_pools(tq, kp, vp, tables, lens, num_splits=3, config=config)
    o2, l2 = cr.paged_decode_pools(tq, outer[0], outer[1], tables, lens, num_splits=3, config=config)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    ref_o, _ = reference.decode(tq, tk[:, :, :777], tv[:, :, :777], seq_lens=lens)
    assert np.max(np.abs(as_numpy(o1) - ref_o)) < 1e-2


# --------------------------------------------------------------------------- backward
#: FlashAttention's rule for gradients: at most twice the naive backward's error in the same dtype
GRAD_FACTOR = 2.0
GRAD_DTYPES = ("float16", "bfloat16", "float32")


def _grad_shape(N):
    """(batch, heads_q, heads_kv, N_q, N_k): GQA and N_k = N_q + 37 (not a multiple of any tile);
    at N = 4096 two query heads, so the float64 oracle takes seconds."""
    return (1, 2, 1, N, N + 37) if N >= 4096 else (1, 4, 2, N, N + 37)


def _naive_grads(do, q, k, v, o, lse, causal, dtype):
    """The naive backward in ``dtype`` on the GPU, from the same O and LSE as the kernel's."""
    from iokernels.torch_sdpa import naive_backward
    torch = _torch()
    args = [_to_torch(x, dtype) for x in (do, q, k, v, o)] + [torch.from_numpy(lse).cuda()]
    return [as_numpy(g) for g in naive_backward(*args, causal=causal)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("N,causal", [(1, False), (127, True), (1024, False), (1024, True), (4096, False),
                                      (4096, True)])
def test_backward_by_the_gradient_rule(rng, d, N, causal):
    """dQ, dK, dV of every registered backward version, both dQ modes, in float16, bfloat16 and
    float32, GQA, N_q != N_k, held to the float64 gradients by the 2x rule (the naive backward in
    the same dtype, on the GPU, from the same O and LSE, is the baseline).  The inputs sit on a
    grid all three dtypes hold exactly, so one float64 oracle serves them all; O and LSE are the
    oracle's, rounded as a forward in that dtype stores them (LSE in float32: P recomputed from
    it carries its rounding, in the kernel and in the baseline alike).  A failure lists every
    (dtype, version, mode, tensor)."""
    B, Hq, Hkv, Nq, Nk = _grad_shape(N)
    q, k, v, do = make_grid_inputs(rng, B, Hq, Hkv, Nq, Nk, d)
    o64, lse64, *refs = oracle_by_head(do, q, k, v, causal=causal)
    checks, refused = [], []
    for dtype in GRAD_DTYPES:
        if dtype == "bfloat16" and _cc() < 80:
            continue
        nd = numpy_dtype(dtype)
        qd, kd, vd, dod, od = (x.astype(nd) for x in (q, k, v, do, o64))
        lse = lse64.astype(np.float32)
        bases = _naive_grads(dod, qd, kd, vd, od, lse, causal, dtype)
        for kern in _cr().REGISTRY.kernels("attention_backward"):
            for det in (False, True):
                cfg = kern.config_class(version=kern.version, deterministic=det)
                where = f"{dtype} {kern.version} {'deterministic' if det else 'atomic'}"
                try:
                    got = ik.attention_backward(dod, qd, kd, vd, od, lse, causal=causal, backend="cupy", config=cfg)
                except ValueError as e:                  # a version that refuses this dtype says why
                    assert "config" in str(e), f"{where}: refused without naming config: {e}"
                    refused.append(f"{where}: refused: {e}")
                    continue
                checks += check_gradients(got, refs, bases, dtype=dtype, factor=GRAD_FACTOR, label=where)
    assert all(checks), report(checks) + "\n" + "\n".join(refused)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_backward_against_sdpa_autograd(rng, dtype, causal):
    """ik.autograd.attention on the CuPy backend inside torch autograd: its dQ, dK, dV are held to
    the float64 gradients by the 2x rule with torch SDPA's own autograd in the same dtype as the
    baseline (GQA; N_q = N_k, where SDPA's top-left causal is the bottom-right one)."""
    torch = _torch()
    if dtype == "bfloat16" and _cc() < 80:
        pytest.skip("bfloat16 needs compute capability 8.0")
    B, Hq, Hkv, N, d = 1, 4, 2, 1000, 128
    q, k, v, do = make_grid_inputs(rng, B, Hq, Hkv, N, N, d)
    _, _, *refs = oracle_by_head(do, q, k, v, causal=causal)
    tq, tk, tv = (_to_torch(x, dtype).requires_grad_() for x in (q, k, v))
    tdo = _to_torch(do, dtype)
    from iokernels import autograd
    out = autograd.attention(tq, tk, tv, causal=causal, backend="cupy")
    mine = torch.autograd.grad(out, (tq, tk, tv), grad_outputs=tdo)
    sq, sk, sv = (_to_torch(x, dtype).requires_grad_() for x in (q, k, v))
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, is_causal=causal, enable_gqa=True)
    theirs = torch.autograd.grad(sdpa_out, (sq, sk, sv), grad_outputs=tdo)
    checks = check_gradients(mine, refs, theirs, dtype=dtype, factor=GRAD_FACTOR,
                             label=f"{dtype} causal={causal} ik.autograd (cupy) vs SDPA autograd:")
    assert all(checks), report(checks)


def test_backward_holds_no_n_by_n_buffer():
    """Peak device memory of the backward at N=4096: far below one N x N score matrix."""
    torch = _torch()
    B, H, N, d = 1, 8, 4096, 128
    q, k, v, do = (torch.randn((B, H, N, d), device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = ik.attention(q, k, v, backend="cupy", return_lse=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ik.attention_backward(do, q, k, v, o, lse, backend="cupy")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    n_by_n = B * H * N * N * 2                       # one bf16 score matrix
    assert extra < n_by_n / 4, f"the backward took {extra:,} B beyond its inputs; one S is {n_by_n:,} B"


def test_deterministic_backward_repeats_bit_for_bit():
    torch = _torch()
    q, k, v, do = (torch.randn((2, 4, 1000, 64), device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = ik.attention(q, k, v, backend="cupy", return_lse=True)
    cfg = _cr().BackwardConfig(deterministic=True)
    a = ik.attention_backward(do, q, k, v, o, lse, backend="cupy", config=cfg)
    b = ik.attention_backward(do, q, k, v, o, lse, backend="cupy", config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


#: the tensor-core backward's own cases: (label, dtype, d, heads_q, heads_kv, Nq, Nk, causal,
#: window, config keywords); GQA group 4, ragged lengths, windows, fully masked rows
BWD_V2_CASES = [
    ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
    ("full N=1000 deterministic", "float16", 64, 8, 2, 1000, 1000, False, None, dict(deterministic=True)),
    ("window (64, 16) Nq<Nk", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), {}),
    ("causal Nq>Nk: masked rows", "float16", 128, 4, 4, 1000, 300, True, None, {}),
    ("d=59 window (-1, 5)", "bfloat16", 59, 4, 2, 200, 333, False, (-1, 5), dict(deterministic=True)),
    ("d=96 Br=128", "float16", 96, 4, 2, 257, 129, True, None, dict(block_q=128)),
    ("4 warps Br=16 window (7, 0)", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(num_warps=4, block_q=16)),
]


@pytest.mark.parametrize("case", BWD_V2_CASES, ids=[c[0] for c in BWD_V2_CASES])
def test_backward_v2_awkward_shapes(rng, case):
    """The tensor-core backward (v2) against the float64 gradients by the 3x rule, at the shapes
    its tiles make awkward: lengths not a multiple of Br or Bc, Nq != Nk, GQA group 4, windows
    cut through tiles, head dims padded to 16, rows that see no key (their dQ must be exactly 0,
    never NaN).  The message lists every gradient's error and bound."""
    label, dtype, d, hq, hkv, nq, nk, causal, window, kw = case
    if _cc() < 80:
        pytest.skip("backward v2 needs compute capability 8.0")
    q, k, v = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)
    do = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hq, seqlen_q=nq, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
    bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
    cfg = _cr().BackwardConfig("v2", **kw)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="cupy", config=cfg)
    blind = ~cv.mask(nq, nk, causal, window).any(axis=-1)[None, None, :, None]     # rows that see no key
    checks = [check(g, r, b, dtype=dtype, name=n, factor=3.0, masked_rows=blind if n == "dq" else None)
              for n, g, r, b in zip(("dq", "dk", "dv"), got, refs, bases)]
    assert all(checks), f"v2 {label} {cfg}: " + "; ".join(str(c) for c in checks)


def test_backward_v2_is_the_16_bit_default(rng):
    """With no version, 16-bit inputs at d <= 128 run v2 on this GPU: the default call and an
    explicit v2 give the same bits (deterministic dQ), and v1 does not."""
    if _cc() < 80:
        pytest.skip("backward v2 needs compute capability 8.0")
    q, k, v = make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=200, head_dim=64,
                          dtype="bfloat16")
    do = make_inputs(rng, batch=1, heads_q=4, heads_kv=4, seqlen_q=200, seqlen_k=1, head_dim=64, dtype="bfloat16")[0]
    o, lse = ik.attention(q, k, v, backend="naive", return_lse=True)
    BC = _cr().BackwardConfig

    def run(cfg):
        return [as_numpy(g) for g in ik.attention_backward(do, q, k, v, o, lse, backend="cupy", config=cfg)]
    default, v2, v1 = run(BC(deterministic=True)), run(BC("v2", deterministic=True)), run(BC("v1", deterministic=True))
    assert all(np.array_equal(a, b) for a, b in zip(default, v2))
    assert not all(np.array_equal(a, b) for a, b in zip(default, v1))
