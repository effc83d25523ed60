"""Decode v5 (v4's tensor cores over quantized paged caches): int8 and float8 e4m3 codes as
float16 mma operands (decode_v5.cu, mma_codes.cuh).  CuPy: skipped without a GPU.

Each call is held against two references, with bounds stated here:

* the float64 oracle on the values the cache holds (its codes times its scales, ``k_hat``,
  ``v_hat``) and the NumPy paged decode of the same cache.  v5's products of codes are exact
  (float16 x float16 into float32); what differs is P rounded to float16 after s_V / sigma is
  folded in -- at most 2^-11 P + 2^-25 a weight, so (2^-11 + 2 n 2^-25) max|V| a row over n keys
  (sigma times the largest code is below twice its block's largest value) --, the order of
  the float32 sums (QUANT_AGREE_ULPS float32 ulps), and O's rounding to its 16-bit dtype;
* the float64 oracle on the values *before* quantization, within
  :func:`iokernels.decode.perturbed_decode_error_bound` more.

A bfloat16 query is converted to float16 with a power-of-two row scale (exact down to 2^-28
of the row's largest element), which the bounds neglect; the case with a query 2^-20 times
smaller (and the scale 2^20 times larger) checks that the row scale keeps it exact.  Cases:
fp8 and int8, both scale granularities, float16 and bfloat16 compute dtypes, GQA groups 1, 4,
8, 16, head dims 64, 128, 256, ragged lengths with a length-0 sequence (O = 0, LSE = -inf),
pages of 16, 7 and 5 rows, 1 / 7 / heuristic splits, windows, blocks whose scales span
2^-24 .. 2^24.  Every failure message names the case and its errors, so one GPU run says
what broke.
"""
import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, paged_inputs, reference, testing

from iokernels.cupy_raw.decode import v5_rounding_bound

dec = importlib.import_module("iokernels.decode")
#: float32 ulps (of max|V| or max|LSE|) two decodes of the same codes may differ by (orders of sums)
QUANT_AGREE_ULPS = 512
#: O stored in its dtype: one ulp of |O| (twice the rounding: both decodes round)
OUT_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
SPLITS = (1, 7, None)
WINDOWS = (None, (20, 0))

#: (dtype, kv_dtype, granularity, head_dim, heads_q, heads_kv, seqlen, block_size, DecodeConfig kwargs)
CASES = (
    ("float16", "int8", "block_head", 128, 32, 8, 300, 16, {}),
    ("bfloat16", "float8_e4m3fn", "block", 128, 32, 8, 300, 16, {}),
    ("float16", "float8_e4m3fn", "block", 128, 32, 8, 97, 16, {}),
    ("bfloat16", "int8", "block_head", 128, 32, 8, 97, 16, {}),
    ("float16", "float8_e4m3fn", "block_head", 64, 8, 8, 200, 7, {}),                 # MHA, d=64, odd pages
    ("bfloat16", "int8", "block", 256, 16, 2, 150, 5, {}),                           # g=8, d=256
    ("float16", "float8_e4m3fn", "block", 128, 16, 1, 333, 16, dict(tile_rows=16, num_warps=4)),   # g=16
    ("bfloat16", "int8", "block_head", 64, 32, 2, 100, 16, dict(fused=False, stages=2)),           # g=16
)


def cupy_ok(test):
    """A CuPy test: marked gpu (scripts/gpu_all.sh runs -m gpu) and skipped without a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")(test))


def _lens_per_row(lens, hq, window):
    """Keys each (sequence, query head) sees."""
    seen = np.asarray(lens) if window is None else np.minimum(lens, window[0] + 1)
    return np.repeat(seen[:, None], hq, axis=1)


def check_v5(q, k, v, lens, cache, sids, k_hat, v_hat, dtype, label, cfg, scale=None):
    """Every split count and window of one case; returns the printed lines (one a call)."""
    lines = []
    hq = q.shape[1]
    vmax = float(np.abs(v_hat).max())
    agree = QUANT_AGREE_ULPS * 2.0 ** -23 * max(1.0, vmax)
    for window in WINDOWS:
        ro, rl = reference.decode(q, k_hat, v_hat, seq_lens=lens, window=window, scale=scale)   # the held values
        xo, xl = reference.decode(q, k, v, seq_lens=lens, window=window, scale=scale)           # before quantization
        ob, lb = dec.perturbed_decode_error_bound(q, k, v, k_hat, v_hat, seq_lens=lens, window=window, scale=scale)
        n = _lens_per_row(lens, hq, window)
        fin = np.isfinite(rl)
        p_bound = v5_rounding_bound(vmax, n)                          # (B, Hq)
        same = agree + OUT_ULP[dtype] * np.abs(ro).max(axis=-1) + p_bound
        for ns in SPLITS:
            name = f"{label} window={window} num_splits={ns}"
            o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, window=window, backend="cupy", config=cfg,
                                     scale=scale, return_lse=True)
            o, lse = testing.as_numpy(o).astype(np.float64), testing.as_numpy(lse).astype(np.float64)
            to, tl = ik.paged_decode(q, cache, sids, num_splits=ns, window=window, scale=scale, return_lse=True)
            to = np.asarray(to, np.float64)
            e_hat = np.abs(o - ro).max(axis=-1)
            e_tiled = np.abs(o - to).max(axis=-1)
            e_exact = np.abs(o - xo).max(axis=-1)
            lerr = float(np.abs(lse[fin] - rl[fin]).max()) if fin.any() else 0.0
            ltol = QUANT_AGREE_ULPS * 2.0 ** -23 * float(np.abs(rl[fin]).max(initial=1.0))
            lines.append(f"{name}: |O-ref(held)| {e_hat.max():.3g} (bound {same.max():.3g}), |O-tiled| "
                         f"{e_tiled.max():.3g}, |O-ref(exact)| {e_exact.max():.3g} (bound {(ob + same).max():.3g}), "
                         f"|LSE-ref| {lerr:.3g} (bound {ltol:.3g})")
            assert np.all(e_hat <= same), lines[-1]
            assert np.all(e_tiled <= same + OUT_ULP[dtype] * np.abs(to).max(axis=-1)), lines[-1]
            assert np.all(e_exact <= ob + same), lines[-1]
            assert lerr <= ltol, lines[-1]
            lse_exact = np.abs(lse[fin] - xl[fin])
            assert np.all(lse_exact <= lb[fin] + ltol), f"{name}: |LSE - oracle(exact)| {lse_exact.max():.3g}"
            assert np.array_equal(np.isneginf(lse), ~fin), f"{name}: LSE -inf where the oracle's is not"
            empty = np.asarray(lens) == 0
            assert np.all(o[empty] == 0), f"{name}: an empty sequence's O is not 0"
    return lines


@cupy_ok
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-d{c[3]}-g{c[4] // c[5]}-bs{c[7]}" for c in CASES])
def test_cupy_v5_quantized_paged_decode(rng, case):
    from iokernels import cupy_raw
    dtype, kv, gran, d, hq, hkv, N, bs, kw = case
    q, k, v, lens, cache, sids, k_hat, v_hat = paged_inputs.make_paged_decode_inputs(rng, 4, hq, hkv, N, d, dtype, kv,
                                                                                 gran, bs)
    cfg = cupy_raw.DecodeConfig("v5", **kw)
    check_v5(q, k, v, lens, cache, sids, k_hat, v_hat, dtype, f"v5 {dtype} {kv} {gran} d={d} g={hq // hkv} "
                   f"bs={bs} {kw}", cfg)


def make_wide_scale_inputs(rng, dtype, kv, gran, span, d=128, hq=16, hkv=4, N=160, bs=16):
    """A cache whose blocks' values differ by powers of two up to 2^+-span (block b of a
    sequence times 2^e_b), so its scales (and s_V / sigma) span 2^(2 span)."""
    q, k, v = testing.make_inputs(rng, batch=3, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_k=N, head_dim=d,
                                  dtype="float32")
    q = q[:, :, 0].astype(testing.numpy_dtype(dtype))
    e = rng.integers(-span, span + 1, size=(3, 1, -(-N // bs), 1))
    f = np.repeat(np.exp2(e.astype(np.float64)), bs, axis=2)[:, :, :N]
    k = (k * np.minimum(f, 1.0)).astype(testing.numpy_dtype(dtype))      # scores stay O(1)
    v = (v * f).astype(testing.numpy_dtype(dtype))
    lens = np.array([0, N - 37, N])
    return (q, k, v, lens, *paged_inputs.paged_cache_of(k, v, lens, dtype, kv, gran, bs))


@cupy_ok
@pytest.mark.parametrize("dtype,kv,span", [("float16", "float8_e4m3fn", 12), ("bfloat16", "int8", 24),
                                           ("bfloat16", "float8_e4m3fn", 24)])
def test_cupy_v5_quantized_scales_spanning_many_powers_of_two(rng, dtype, kv, span):
    """V blocks 2^-span .. 2^span apart: P' = P s_V / sigma stays in float16's range (sigma the
    largest s_V seen, O rescaled when it grows); a block far below sigma is lost only to the
    bound's subnormal term."""
    from iokernels import cupy_raw
    inputs = make_wide_scale_inputs(rng, dtype, kv, "block_head", span)
    check_v5(*inputs, dtype, f"v5 {dtype} {kv} scales 2^+-{span}", cupy_raw.DecodeConfig("v5"))


@cupy_ok
def test_cupy_v5_quantized_tiny_bfloat16_query_keeps_its_bits(rng):
    """A bfloat16 query 2^-20 times smaller (scale 2^20 times larger): without its power-of-two
    row scale its float16 copy would be subnormal or zero; with it the scores are exact."""
    from iokernels import cupy_raw
    q, k, v, lens, cache, sids, k_hat, v_hat = paged_inputs.make_paged_decode_inputs(
        rng, 4, 32, 8, 120, 128, "bfloat16", "float8_e4m3fn", "block_head")
    q = (q.astype(np.float64) * 2.0 ** -20).astype(q.dtype)                    # exact: a power of two
    scale = 2.0 ** 20 / np.sqrt(128)
    check_v5(q, k, v, lens, cache, sids, k_hat, v_hat, "bfloat16", "v5 bf16 query 2^-20", cupy_raw.DecodeConfig("v5"),
                   scale=scale)


@cupy_ok
def test_cupy_default_reads_a_quantized_cache_with_v5(rng):
    """The registry's default for a quantized paged cache on compute capability 8.0+ is v5 (it
    ranks above v3); head dims v5 has no swizzle for go to v3, and v5 refuses them by name."""
    from iokernels import cupy_raw
    from iokernels.cupy_raw.launch import device_info
    if device_info()["cc"] < 80:
        pytest.skip("v5 needs compute capability 8.0")
    for kv, d, want in (("int8", 128, "v5"), ("float8_e4m3fn", 64, "v5"), ("int8", 96, "v3")):
        q, _, _, _, cache, sids, _, _ = paged_inputs.make_paged_decode_inputs(rng, 2, 8, 2, 40, d, "float16", kv)
        kernel, _ = cupy_raw.REGISTRY.resolve("paged_decode", None, cupy_raw.need("paged_decode", q=q, cache=cache))
        assert kernel.version == want, (kv, d, kernel.version)
        if want == "v3":
            with pytest.raises(ValueError, match="kv_dtype"):
                ik.paged_decode(q, cache, sids, backend="cupy", config=cupy_raw.DecodeConfig("v5"))
