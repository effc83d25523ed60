"""Check and time the quantized-cache and sliding-window decode of the GPU backends, one run.

    python3 scripts/decode_dev.py                  # check, then time (about two minutes, compiles included)
    python3 scripts/decode_dev.py --parts check    # only the correctness checks (small shapes)
    python3 scripts/decode_dev.py --parts time     # only the timings

* check: small ragged GQA shapes (one empty sequence), for CuPy decode v1 and the default (v3)
  and Numba's default (v3): a quantized paged cache (float8 e4m3 and int8, scales per (block,
  head) and per block) against the NumPy paged decode of the same cache (the same codes:
  float32 rounding apart) and against the float64 oracle on the values before quantization
  (within iokernels.decode.perturbed_decode_error_bound); windowed decode, contiguous and
  paged (left 0, a window that leaves whole splits empty, one longer than the sequence),
  and a bfloat16 paged cache, against the float64 oracle by the 2x rule.  One line a case.
* time: GQA 32/8, d = 128, B in {8, 64}, N = 32768, bfloat16: the paged decode of the
  bfloat16 pools, of float8 e4m3 and int8 codes of the same values, and of a 4096-key window,
  for CuPy (default version, and v1) and Numba (default), next to torch SDPA's decode over
  the contiguous cache; effective TB/s counts the K/V bytes each call must read.

Timings: iokernels.bench.time_cuda (warm-up, median, L2 flushed).  Exit status 1 when a
check fails (every case still runs and prints).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

import numpy as np

#: the timed shapes (the benchmark's DECODE_QUANT section)
TIME_BATCHES = (8, 64)
TIME_SEQLEN = 32768
TIME_WINDOW = (4096, 0)
HQ, HKV, D = 32, 8, 128
#: float32 ulps of max|V| a kernel may differ from the NumPy decode of the same codes by
AGREE_ULPS = 512


def _filled(rng, B, hq, hkv, N, d, dtype, kv_dtype=None, gran="block_head"):
    from iokernels import testing
    return testing.make_paged_decode_inputs(rng, B, hq, hkv, N, d, dtype, kv_dtype, gran)


class Checks:
    def __init__(self):
        self.failed = 0

    def run(self, label, fn):
        try:
            ok, msg = fn()
        except Exception as e:                                # a crash is a failed case, not the run
            ok, msg = False, f"{type(e).__name__}: {e}".splitlines()[0]
            traceback.print_exc(limit=3)
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {msg}", flush=True)


def _configs(backend):
    if backend == "numba":
        return [None]
    from iokernels import cupy_raw
    # None: the registry's default (v4 for 16-bit unquantized caches, v3 for quantized ones
    # and float32); v3 explicitly where it runs (rows of whole 16-byte chunks, at most 32)
    return [None, cupy_raw.DecodeConfig("v3"), cupy_raw.DecodeConfig("v1")]


def check_part(checks: Checks):
    import iokernels as ik
    from iokernels import reference, testing
    dec = importlib.import_module("iokernels.decode")
    rng = np.random.default_rng(0)
    for backend in ("cupy", "numba"):
        for cfg in _configs(backend):
            name = f"{backend} {cfg.version if cfg else 'default'}"
            # quantized paged caches
            for dtype in ("float32", "float16", "bfloat16"):
                if backend == "numba" and dtype == "bfloat16":
                    continue
                for kv in ("float8_e4m3fn", "int8"):
                    for gran in ("block_head", "block"):
                        q, k, v, lens, cache, sids, kh, vh = _filled(rng, 4, 8, 2, 300, 128, dtype, kv, gran)

                        def quant(q=q, k=k, v=v, lens=lens, cache=cache, sids=sids, kh=kh, vh=vh, dtype=dtype):
                            out = []
                            ok = True
                            for window in (None, (100, 0)):
                                o, lse = ik.paged_decode(q, cache, sids, backend=backend, config=cfg, window=window,
                                                         return_lse=True)
                                no = np.asarray(ik.paged_decode(q, cache, sids, window=window), np.float64)
                                o = testing.as_numpy(o).astype(np.float64)
                                tol = AGREE_ULPS * 2.0 ** -23 * max(1.0, np.abs(vh).max())
                                if dtype != "float32":
                                    tol += 2.0 ** -(7 if dtype == "bfloat16" else 10) * np.abs(no).max()
                                e = np.abs(o - no).max()
                                ok &= bool(e <= tol) and not np.isnan(o).any()
                                out.append(f"window={window} |O-tiled|={e:.2e} (tol {tol:.1e})")
                            ob, _ = dec.perturbed_decode_error_bound(q, k, v, kh, vh, seq_lens=lens)
                            o = testing.as_numpy(ik.paged_decode(q, cache, sids, backend=backend,
                                                                 config=cfg)).astype(np.float64)
                            ro, _ = reference.decode(q, k, v, seq_lens=lens)
                            e = np.abs(o - ro).max(axis=-1)
                            slack = 1e-5 if dtype == "float32" else 2.0 ** -(7 if dtype == "bfloat16" else 10) * 4
                            ok &= bool(np.all(e <= ob + slack))
                            out.append(f"|O-oracle|={e.max():.2e} (bound {ob.max():.2e})")
                            return ok, "; ".join(out)
                        checks.run(f"{name} quantized {kv} {gran} {dtype} d=128 GQA 4", quant)
            # windows, contiguous and paged, float64 / float16 / bfloat16
            for dtype in ("float64", "float16", "bfloat16"):
                if backend == "numba" and dtype == "bfloat16":
                    continue
                if cfg is not None and cfg.version == "v3" and dtype == "float64":
                    continue                     # 1 KB rows: more than v3's 32 chunks a row
                q, k, v, lens, cache, sids, kh, vh = _filled(rng, 3, 8, 2, 700, 128, dtype)

                def windowed(q=q, k=k, v=v, lens=lens, cache=cache, sids=sids, kh=kh, vh=vh, dtype=dtype):
                    out, ok = [], True
                    for window in ((0, 0), (150, -1), (5000, 0)):
                        for ns in (None, 5):
                            ro, rl = reference.decode(q, k, v, seq_lens=lens, window=window)
                            bo = None if dtype == "float64" else ik.decode(q, k, v, seq_lens=lens, window=window,
                                                                            backend="naive")
                            masked = ~np.isfinite(rl)[..., None]
                            for what, fn in (("decode", lambda: ik.decode(q, k, v, seq_lens=lens, num_splits=ns,
                                                                         window=window, backend=backend,
                                                                         config=cfg, return_lse=True)),
                                             ("paged", lambda: ik.paged_decode(q, cache, sids, num_splits=ns,
                                                                               window=window, backend=backend,
                                                                               config=cfg, return_lse=True))):
                                o, lse = fn()
                                c = testing.check(o, ro, bo, dtype=dtype, name="O", masked_rows=masked)
                                empty = bool(np.all(np.isneginf(testing.as_numpy(lse)[lens == 0])))
                                ok &= bool(c) and empty
                                if not c or not empty:
                                    out.append(f"{what} window={window} S={ns}: {c}, empty LSE -inf: {empty}")
                    return ok, "; ".join(out) or "all windows within the rule"
                checks.run(f"{name} windowed {dtype} d=128 GQA 4, N=700 ragged", windowed)


def time_part():
    import torch
    import iokernels as ik  # noqa: F401
    from iokernels.bench.runners import device_pages, device_quant_pages
    from iokernels.bench.timer import release_device_cache, time_cuda
    from iokernels import cupy_raw, numba_cuda
    rows = []
    for B in TIME_BATCHES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((B, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn((B, HKV, TIME_SEQLEN, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        kp, vp, tables, lens = device_pages(k, v)
        full = 2.0 * B * HKV * TIME_SEQLEN * D
        q4 = q[:, :, None, :]
        sdpa = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
                         warmup=3, reps=10)
        rows.append((B, "torch SDPA decode (contiguous bf16)", sdpa.median_ms, full * 2))
        variants = [("bfloat16", None, None), ("float8_e4m3fn", "float8_e4m3fn", None), ("int8", "int8", None),
                    ("bfloat16 window 4096", None, TIME_WINDOW), ("float8 window 4096", "float8_e4m3fn", TIME_WINDOW)]
        for label, kv, window in variants:
            quant, pk, pv = None, kp, vp
            if kv is not None:
                pk, pv, ks, vs = device_quant_pages(kp, vp, kv)
                quant = dict(kv=kv, k_scale=ks, v_scale=vs)
            seen = TIME_SEQLEN if window is None else window[0] + 1
            nbytes = 2.0 * B * HKV * seen * D * (1 if kv else 2)
            runs = [("cupy default", cupy_raw.paged_decode_pools, None),
                    ("cupy v1", cupy_raw.paged_decode_pools, cupy_raw.DecodeConfig("v1"))]
            if B <= 8:                                    # Numba has no bfloat16: float16 q (and pools)
                runs.append(("numba default (float16)", numba_cuda.paged_decode_pools, None))
            for who, f, cfg in runs:
                qq, kk, vv = q, pk, pv
                if who.startswith("numba"):
                    qq = q.half()
                    kk, vv = (pk, pv) if kv else (pk.half(), pv.half())
                try:
                    t = time_cuda(lambda: f(qq, kk, vv, tables, lens, config=cfg, window=window, quant=quant),
                                  warmup=3, reps=10)
                    rows.append((B, f"{who} paged {label}", t.median_ms, nbytes))
                except Exception as e:
                    rows.append((B, f"{who} paged {label}: {type(e).__name__}: {str(e).splitlines()[0]}", None,
                                 nbytes))
            del pk, pv, quant
        del q, k, v, kp, vp
        release_device_cache()
    print(f"\n{'B':>3}  {'runner':<46} {'ms':>9} {'TB/s':>7}")
    for B, name, ms, nbytes in rows:
        if ms is None:
            print(f"{B:>3}  {name}")
        else:
            print(f"{B:>3}  {name:<46} {ms:9.4f} {nbytes / ms / 1e9:7.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="check,time", help="comma-separated: check, time")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    checks = Checks()
    if "check" in parts:
        check_part(checks)
    if "time" in parts:
        try:
            time_part()
        except Exception:
            traceback.print_exc()
            checks.failed += 1
    print(f"\n{checks.failed} failed; {time.perf_counter() - t0:.1f} s")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
