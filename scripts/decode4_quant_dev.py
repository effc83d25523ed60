"""Decode v4 over quantized paged caches (int8, float8 e4m3) on one GPU: correctness, then speed.

    python scripts/decode4_quant_dev.py [--no-timing] [--reps N]

Part 1 runs CuPy decode v4 over small quantized PagedKVCaches at awkward shapes (ragged
lengths with an empty sequence, GQA groups 1 to 16, head dims 64 / 128 / 256, pages of 16,
7 and 5 rows, 1 / 7 / heuristic splits, a window, both scale granularities, float16 and
bfloat16 queries) and prints one line a case: max |O - ref| against the float64 oracle on
the values the cache holds (bound: cupy_raw.decode.v5_rounding_bound, float32 sum
order and O's rounding) and against the oracle on the values before quantization (bound:
iokernels.decode.perturbed_decode_error_bound on top), max |LSE - ref|, and whether the
empty sequence gave O = 0 and LSE = -inf.

Part 2 times, at B in 8, 64, N = 32768, GQA 32/8, d = 128, a bfloat16 cache and the fp8 and
int8 caches of the same values (iokernels.bench.device_pages, device_quant_pages), read by
CuPy decode v4 and v3 (and v4 with 16-key tiles x 6 stages on the 1-byte caches), next to torch SDPA (cuDNN, FLASH) on the contiguous bfloat16 cache,
each with iokernels.bench.time_cuda (CUDA events, L2 flushed); prints TB/s of cache read
(codes or 16-bit values, K and V) and each row's speed-up over the bfloat16 cache with the
same version.  Exits 1 when a correctness case fails.
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

#: correctness cases: (dtype, kv_dtype, granularity, head_dim, heads_q, heads_kv, seqlen, block_size,
#: DecodeConfig kwargs)
CASES = (
    ("float16", "int8", "block_head", 128, 32, 8, 300, 16, {}),
    ("bfloat16", "float8_e4m3fn", "block", 128, 32, 8, 300, 16, {}),
    ("float16", "float8_e4m3fn", "block_head", 64, 8, 8, 200, 7, {}),
    ("bfloat16", "int8", "block", 256, 16, 2, 150, 5, {}),
    ("float16", "float8_e4m3fn", "block", 128, 16, 1, 333, 16, dict(tile_rows=16, num_warps=4)),
    ("bfloat16", "int8", "block_head", 64, 32, 2, 100, 16, dict(fused=False, stages=2)),
)
SPLITS = (None, 1, 7)
WINDOWS = (None, (20, 0))
#: float32 ulps two decodes' sums may differ by; O's rounding to its dtype (one ulp)
AGREE_ULPS = 512
OUT_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
#: the CuPy rows timed: v4's default, v3's, and v4 with 16-key tiles in a 6-deep ring (as many
#: bytes in flight as the default 32-key tiles x 3 stages) on the 1-byte caches
RUNS = (("cupy v4", dict(version="v4")), ("cupy v3", dict(version="v3")),
        ("cupy v4 16x6", dict(version="v4", tile_rows=16, stages=6)))
#: the timed shapes (the benchmark's DECODE_QUANT section)
SERVING = ((8, 32768), (64, 32768))
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def correctness(ik, cr, reference, testing, rng) -> int:
    """Part 1: one printed line a call; returns the number of failures."""
    from iokernels.cupy_raw.decode import v5_rounding_bound
    dec = importlib.import_module("iokernels.decode")
    failures = 0
    for dtype, kv, gran, d, hq, hkv, N, bs, kw in CASES:
        q, k, v, lens, cache, sids, k_hat, v_hat = testing.make_paged_decode_inputs(rng, 4, hq, hkv, N, d, dtype, kv,
                                                                                     gran, bs)
        cfg = cr.DecodeConfig("v4", **kw)
        vmax = float(np.abs(v_hat).max())
        for window in WINDOWS:
            ro, rl = reference.decode(q, k_hat, v_hat, seq_lens=lens, window=window)
            xo, _ = reference.decode(q, k, v, seq_lens=lens, window=window)
            ob, _ = dec.perturbed_decode_error_bound(q, k, v, k_hat, v_hat, seq_lens=lens, window=window)
            seen = lens if window is None else np.minimum(lens, window[0] + 1)
            same = (AGREE_ULPS * 2.0 ** -23 * max(1.0, vmax) + OUT_ULP[dtype] * np.abs(ro).max(axis=-1)
                    + v5_rounding_bound(vmax, np.repeat(seen[:, None], hq, axis=1)))
            fin = np.isfinite(rl)
            for S in SPLITS:
                label = f"{dtype} {kv} {gran} d={d} g={hq // hkv} bs={bs} {kw} window={window} S={S}"
                try:
                    o, lse = ik.paged_decode(q, cache, sids, num_splits=S, window=window, backend="cupy",
                                             config=cfg, return_lse=True)
                    o, lse = testing.as_numpy(o).astype(np.float64), testing.as_numpy(lse).astype(np.float64)
                    e_hat = np.abs(o - ro).max(axis=-1)
                    e_exact = np.abs(o - xo).max(axis=-1)
                    lerr = float(np.abs(lse[fin] - rl[fin]).max())
                    ltol = AGREE_ULPS * 2.0 ** -23 * float(np.abs(rl[fin]).max())
                    empty = bool(np.all(o[0] == 0) and np.all(np.isneginf(lse[0])))
                    ok = bool(np.all(e_hat <= same) and np.all(e_exact <= ob + same) and lerr <= ltol and empty)
                    print(f"{'ok  ' if ok else 'FAIL'} {label}: |O-ref(held)| {e_hat.max():.3g} (bound "
                          f"{same.max():.3g}), |O-ref(exact)| {e_exact.max():.3g} (bound {(ob + same).max():.3g}), "
                          f"|LSE-ref| {lerr:.3g} (bound {ltol:.3g}), empty seq 0/-inf {empty}", flush=True)
                except Exception as e:                      # say what failed and go on
                    ok = False
                    print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                failures += not ok
    return failures


def timings(torch, cr, reps: int) -> None:
    """Part 2: bf16 / fp8 / int8 caches through v4 and v3, and SDPA on the contiguous bf16 cache."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    from iokernels.bench.runners import device_quant_pages
    print(f"\n# timings ({reps} reps, L2 flushed): TB/s of K/V read (1-byte codes or 16-bit values); "
          f"x bf16 = the bf16 cache's ms / this row's ms, same version")
    for B, N in SERVING:
        gen = torch.Generator(device="cuda").manual_seed(B * 7 + N)
        q = torch.randn((B, HEADS_Q, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn((B, HEADS_KV, N, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
        caches = {"bfloat16": (kp, vp, None)}
        for kv in ("float8_e4m3fn", "int8"):
            kc, vc, ks, vs = device_quant_pages(kp, vp, kv)
            caches[kv] = (kc, vc, dict(kv=kv, k_scale=ks, v_scale=vs))
        q4 = q[:, :, None, :]
        ms = {}

        def sdpa(backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        runs = {("sdpa CUDNN", "bfloat16"): (sdpa, (SDPBackend.CUDNN_ATTENTION,), {}),
                ("sdpa FLASH", "bfloat16"): (sdpa, (SDPBackend.FLASH_ATTENTION,), {})}
        for row, kw in RUNS:
            for name, (kc, vc, quant) in caches.items():
                if quant is None and kw.get("tile_rows"):
                    continue                                # a 1-byte-cache setting
                runs[row, name] = (cr.paged_decode_pools, (q, kc, vc, tables, lens),
                                   dict(config=cr.DecodeConfig(**kw), quant=quant))
        ref = None
        for (row, cache), (fn, args, kw) in runs.items():
            try:
                r = fn(*args, **kw)
                o = (r[0] if isinstance(r, tuple) else r[:, :, 0]).float()
                if ref is None and row.startswith("sdpa"):
                    ref = o
                ms[row, cache] = bench.time_cuda(fn, *args, reps=reps, **kw).median_ms
                itemsize = 2 if cache == "bfloat16" else 1
                tbps = 2.0 * B * HEADS_KV * N * HEAD_DIM * itemsize / ms[row, cache] / 1e9
                line = f"  B={B:2d} N={N:5d} {row:12s} {cache:14s} {ms[row, cache]:8.4f} ms {tbps:6.2f} TB/s"
                base = (row if (row, "bfloat16") in runs else "cupy v4", "bfloat16")   # 16x6: v4's default
                if base in ms and cache != "bfloat16":
                    line += f"  x bf16 {ms[base] / ms[row, cache]:.3f}"
                if ref is not None and row.startswith("cupy"):
                    line += f"  max|O - SDPA(bf16)| {float((o - ref).abs().max()):.3g}"
                print(line, flush=True)
            except Exception as e:                          # a row that cannot run: say so
                print(f"  B={B} N={N} {row} {cache}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        del q, k, v, kp, vp, caches, q4, ref
        bench.release_device_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions a runner")
    a = p.parse_args(argv)
    import torch

    import iokernels as ik
    from iokernels import cupy_raw as cr
    from iokernels import reference, testing
    t0 = time.time()
    dev = cr.device_info()
    print(f"# device cc {dev['cc']}, {dev['sms']} SMs, {dev['smem_optin']:,} B SRAM a block; decode v4 fp8 defines "
          f"at bf16 d=128 g=4: {cr.DecodeConfig('v4').defines(128, 'bfloat16', 4, True, 16, smem_limit=dev['smem_optin'], kv='float8_e4m3fn')}")
    failures = correctness(ik, cr, reference, testing, np.random.default_rng(0))
    print(f"# correctness: {failures} failing call(s), {time.time() - t0:.1f} s", flush=True)
    if not a.no_timing:
        timings(torch, cr, a.reps)
    print(f"# done in {time.time() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
