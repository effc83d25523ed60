"""Sliding-window decode and quantized paged caches in the GPU decode kernels.

Numba (the simulator in CI, tiny sizes; a GPU when there is one) and CuPy (skipped without
a GPU), each against:

* the float64 oracle, for windowed decode (contiguous and paged): float64 to about 1e-12,
  16-bit by FlashAttention's 2x rule (``testing.check``).  Windows: only the last key
  (left = 0), one that leaves whole splits without keys, one longer than the sequence, and
  a length-0 sequence (O = 0, LSE = -inf);
* the NumPy paged decode of the same quantized cache (backend "tiled"): the kernels read
  the same 1-byte codes and scales, and a value c * s is exact in float32 (s is a power of
  two), so the two differ only by the order of their float32 sums: within
  QUANT_AGREE_ULPS float32 ulps of max|V| (float64 caches: 1e-12); CuPy's v5 also rounds
  P s_V / sigma to float16 (cupy_raw.decode.v5_rounding_bound);
* the float64 oracle on the values *before* quantization, within
  :func:`iokernels.decode.perturbed_decode_error_bound` of the cache's own values
  (which :func:`iokernels.paged.quantization_error_bound` bounds), plus float32 rounding.

Every failure message names the case and its error, so one GPU run says what broke.
"""
import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, paged_inputs, reference, testing

dec = importlib.import_module("iokernels.decode")
QUANT = ["int8", "float8_e4m3fn"]
GRAN = ["block_head", "block"]
#: float32 ulps (of max|V|, or of max|LSE|) two decodes of the same codes may differ by:
#: different orders of float32 sums over d dims, a few dozen keys and the split merge (far
#: below the quantization error itself, about 1e-2 here)
QUANT_AGREE_ULPS = 512
#: the float32 arithmetic the quantized-vs-exact bound leaves out (O(1) values)
F32_ARITH = 1e-5


def _v5_p_rounding(v_hat_max, keys):
    """CuPy decode v5's float16 rounding of P s_V / sigma on a quantized cache (its docstring)."""
    from iokernels.cupy_raw.decode import v5_rounding_bound
    return float(v5_rounding_bound(v_hat_max, keys))

numba_ok = pytest.mark.skipif(not gpu.simulator_enabled() and not gpu.has_gpu(),
                              reason="needs Numba's CUDA simulator or a GPU")
def cupy_ok(test):
    """A CuPy test: marked gpu (scripts/gpu_all.sh runs -m gpu) and skipped without a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")(test))


def _windows(n):
    """(left, right) windows for a sequence of n keys: only the last key, one that leaves the
    first splits without keys, one longer than the sequence."""
    return [(0, 0), (n // 3, -1), (n + 5, 0)]


def _filled(rng, B, hq, hkv, N, d, dtype, kv_dtype=None, gran="block_head", bs=8):
    """q, the exact k, v, ragged lengths (one empty), the cache, its ids, and what it holds."""
    return paged_inputs.make_paged_decode_inputs(rng, B, hq, hkv, N, d, dtype, kv_dtype, gran, bs)


def _check_oracle(o, lse, q, k, v, lens, window, dtype, label):
    ro, rl = reference.decode(q, k, v, seq_lens=lens, window=window)
    bo, bl = (None, None) if dtype == "float64" else \
        ik.decode(q, k, v, seq_lens=lens, window=window, backend="naive", return_lse=True)
    masked = ~np.isfinite(rl)[..., None]
    c = testing.check(o, ro, bo, dtype=dtype, name="O", masked_rows=masked)
    assert c, f"{label}: {c}"
    c = testing.check(lse, rl, bl, dtype=dtype, name="LSE")
    assert c, f"{label}: {c}"
    assert np.all(np.isneginf(testing.as_numpy(lse)[lens == 0])), f"{label}: an empty sequence's LSE is not -inf"


def _windowed(rng, backend, dtype, configs, d=64, N=70, splits=(1, 3, None), hq=8):
    B, hkv = 3, 2
    q, k, v, lens, cache, sids, _, _ = _filled(rng, B, hq, hkv, N, d, dtype)
    kh = np.zeros(k.shape, k.dtype)                             # the paged cache's rows, contiguous
    vh = np.zeros(v.shape, v.dtype)
    for b, (sid, n) in enumerate(zip(sids, lens)):
        if n:
            kh[b, :, :n], vh[b, :, :n] = cache.gather(sid)
    for cfg in configs:
        for window in _windows(N):
            for ns in splits:
                label = f"{backend} {cfg} {dtype} window={window} num_splits={ns}"
                o, lse = ik.decode(q, k, v, seq_lens=lens, num_splits=ns, window=window, backend=backend,
                                   config=cfg, return_lse=True)
                _check_oracle(o, lse, q, k, v, lens, window, dtype, "decode " + label)
                o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, window=window, backend=backend,
                                         config=cfg, return_lse=True)
                _check_oracle(o, lse, q, kh, vh, lens, window, dtype, "paged_decode " + label)


def _quantized(rng, backend, dtype, configs, d=64, hq=8, hkv=2, N=45, splits=(1, 3, None), B=4, quant=None):
    """Each (code format, granularity) of ``quant`` (None: all of them), windows None and (20, 0)."""
    for kv, gran in quant or [(kv, g) for kv in QUANT for g in GRAN]:
        q, k, v, lens, cache, sids, k_hat, v_hat = _filled(rng, B, hq, hkv, N, d, dtype, kv, gran)
        ob, lb = dec.perturbed_decode_error_bound(q, k, v, k_hat, v_hat, seq_lens=lens)
        agree = 1e-12 if dtype == "float64" else QUANT_AGREE_ULPS * 2.0 ** -23 * max(1.0, np.abs(v_hat).max())
        for cfg in configs:
            for window in (None, (20, 0)):
                for ns in splits:
                    label = f"{backend} {cfg} {kv} {gran} {dtype} window={window} num_splits={ns}"
                    o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, window=window, backend=backend,
                                             config=cfg, return_lse=True)
                    o, lse = testing.as_numpy(o).astype(np.float64), testing.as_numpy(lse).astype(np.float64)
                    no, nl = ik.paged_decode(q, cache, sids, num_splits=ns, window=window, return_lse=True)
                    no, nl = np.asarray(no, np.float64), np.asarray(nl, np.float64)
                    if dtype in ("float16", "bfloat16"):   # O rounded to 16 bits: one ulp apart at most
                        tol = agree + 2.0 ** -(7 if dtype == "bfloat16" else 10) * np.abs(no).max()
                        if backend == "cupy" and getattr(cfg, "version", None) in (None, "v5"):
                            tol += _v5_p_rounding(np.abs(v_hat).max(), N)   # v5 rounds P s_V / sigma to float16
                    else:
                        tol = agree
                    err = np.abs(o - no).max()
                    assert err <= tol, f"{label}: |O - O(tiled)| = {err:.3g} > {tol:.3g}"
                    fin = np.isfinite(nl)
                    assert np.array_equal(np.isneginf(lse), ~fin), f"{label}: LSE -inf where tiled's is not"
                    lerr = np.abs(lse[fin] - nl[fin]).max()
                    ltol = 1e-12 if dtype == "float64" else \
                        QUANT_AGREE_ULPS * 2.0 ** -23 * max(1.0, np.abs(nl[fin]).max())
                    assert lerr <= ltol, f"{label}: |LSE - LSE(tiled)| = {lerr:.3g} > {ltol:.3g}"
                    if window is None and dtype in ("float32", "float64"):
                        ro, rl = reference.decode(q, k, v, seq_lens=lens)   # the values before quantization
                        e = np.abs(o - ro).max(axis=-1)
                        assert np.all(e <= ob + F32_ARITH), f"{label}: |O - oracle| {e.max():.3g} > bound"
                        el = np.abs(lse[fin] - rl[fin])
                        assert np.all(el <= lb[fin] + F32_ARITH), f"{label}: |LSE - oracle| {el.max():.3g}"


# --------------------------------------------------------------------------- Numba
# the simulator runs every thread as a Python thread: tiny shapes, a few cases each
@numba_ok
@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_numba_windowed_decode_matches_the_oracle(rng, dtype):
    from iokernels.numba_cuda import DecodeConfig
    # the default (v3) in float64, v1 in float16: each version once, at the cost of one
    _windowed(rng, "numba", dtype, [None] if dtype == "float64" else [DecodeConfig("v1")], d=16, N=21,
              splits=(2,), hq=4)


@numba_ok
@pytest.mark.parametrize("kv", QUANT)
def test_numba_quantized_paged_decode_reads_the_codes(rng, kv):
    _quantized(rng, "numba", "float32", [None], d=16, hq=4, N=20, splits=(2,), B=3,
               quant=[(kv, "block_head"), (kv, "block")])


@numba_ok
def test_numba_quantized_decode_d11_reads_single_codes(rng):
    """d = 11: rows are not whole 8-byte words, so v3 loads the codes one at a time."""
    _quantized(rng, "numba", "float64", [None], d=11, hq=2, hkv=1, N=12, splits=(1,), B=2,
               quant=[("float8_e4m3fn", "block_head")])


@numba_ok
def test_numba_quantized_cache_refused_by_v1_and_v2_by_name(rng):
    from iokernels.numba_cuda import DecodeConfig
    q, _, _, _, cache, sids, _, _ = _filled(rng, 2, 4, 2, 9, 16, "float32", "int8")
    for version in ("v1", "v2"):
        with pytest.raises(ValueError, match="kv_dtype"):
            ik.paged_decode(q, cache, sids, backend="numba", config=DecodeConfig(version))


def test_quantized_caches_refused_where_no_kernel_decodes_them(rng):
    q, _, _, _, cache, sids, _, _ = _filled(rng, 2, 4, 2, 9, 16, "float32", "float8_e4m3fn")
    with pytest.raises(ValueError, match="cache: a float8_e4m3fn cache is dequantized by"):
        ik.paged_decode(q, cache, sids, backend="torch")


# --------------------------------------------------------------------------- CuPy
def _cupy_configs(dtype, quant=False):
    from iokernels import cupy_raw
    tc = ("v5",) if quant else ("v4",)              # the tensor-core version of each cache
    tc = tc if dtype in ("float16", "bfloat16") else ()
    versions = ("v1", "v3") + tc if quant else ("v1", "v2", "v3") + tc
    return [None] + [cupy_raw.DecodeConfig(v) for v in versions] + \
        [cupy_raw.DecodeConfig("v3", fused=False, num_warps=4)]


@cupy_ok
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "float32"])
def test_cupy_windowed_decode_matches_the_oracle(rng, dtype):
    _windowed(rng, "cupy", dtype, _cupy_configs(dtype))


@cupy_ok
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_cupy_quantized_paged_decode_reads_the_codes(rng, dtype):
    _quantized(rng, "cupy", dtype, _cupy_configs(dtype, quant=True))
    _quantized(rng, "cupy", dtype, _cupy_configs(dtype, quant=True), d=128, hq=32, hkv=8)


@cupy_ok
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cupy_decode_v7_windowed_and_quantized(rng, dtype):
    """decode v7 (the group split over blocks) named and the default, at 32 query heads a KV
    head: windows over contiguous and paged caches, and 1-byte codes at head_dim 96 (v5 does
    not take it)."""
    from iokernels import cupy_raw
    configs = [None, cupy_raw.DecodeConfig("v7")]
    _windowed(rng, "cupy", dtype, configs, hq=64)
    _quantized(rng, "cupy", dtype, configs, d=96, hq=64, hkv=2,
               quant=[("int8", "block_head"), ("float8_e4m3fn", "block")])


@cupy_ok
def test_cupy_quantized_decode_d59_takes_the_scalar_path(rng):
    _quantized(rng, "cupy", "float32", [None], d=59, hq=3, hkv=3)


@cupy_ok
def test_cupy_quantized_cache_refused_by_v2_by_name(rng):
    from iokernels import cupy_raw
    q, _, _, _, cache, sids, _, _ = _filled(rng, 2, 4, 2, 9, 16, "float32", "int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        ik.paged_decode(q, cache, sids, backend="cupy", config=cupy_raw.DecodeConfig("v2"))


@cupy_ok
def test_cupy_long_window_splits_only_the_visible_keys(rng):
    """N = 4096, window 300: the 301 visible keys are what the splits share (the second
    sequence's 1000 keys too), at 16 splits and at the heuristic's count."""
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=8, heads_kv=2, seqlen_q=1, seqlen_k=4096, head_dim=128,
                                  dtype="float16")
    q = q[:, :, 0]
    lens = np.array([4096, 1000])
    for ns in (16, None):
        o, lse = ik.decode(q, k, v, seq_lens=lens, num_splits=ns, window=(300, 0), backend="cupy", return_lse=True)
        _check_oracle(o, lse, q, k, v, lens, (300, 0), "float16", f"cupy N=4096 window=300 num_splits={ns}")
