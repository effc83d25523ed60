"""Check and time the CuPy backward (v2 on the tensor cores, v1 on CUDA cores) on one GPU, one run.

    python3 scripts/bwd_dev.py                 # check, then time (about a minute on an H200)
    python3 scripts/bwd_dev.py --parts check   # only the checks
    python3 scripts/bwd_dev.py --parts time    # only the timings

check: backward v2 at small awkward shapes (ragged N, Nq != Nk, GQA group 4, windows, rows that
see no key, d 59 / 64 / 96 / 128, float16 and bfloat16, both dQ modes, smaller tiles) against the
float64 gradients (iokernels.core.reference); each line prints max|grad - ref64| of v2 and of the
naive backward in the same precision (the baseline), their ratio, and the 3x rule's verdict;
a failing gradient also prints where its largest error sits.

time: bfloat16 B=8 H=16 N=4096 d=128, causal and not: forward + backward of torch SDPA's FLASH
kernel (autograd) against this package's default forward (ik.attention, backend "cupy") + backward
v2; the backward alone for v2 (default tiles, Br = 64, 4 warps, deterministic) and v1.  TFLOP/s count the
visible (query, key) pairs: 4 d a pair for the forward, 10 d for the backward (2.5x); "ratio"
is this package's forward + backward over FLASH's.  Timings: iokernels.bench.time_cuda (warm-up,
median, L2 flushed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the 3x gradient rule of the GPU tests (tests/test_cupy.py)
FACTOR = 3.0
#: (label, dtype, d, heads_q, heads_kv, Nq, Nk, causal, window, BackwardConfig keywords)
CHECKS = [
    ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
    ("full N=1000 Nk=1037", "float16", 64, 4, 1, 1000, 1037, False, None, {}),
    ("deterministic causal", "bfloat16", 128, 4, 2, 300, 333, True, None, dict(deterministic=True)),
    ("window (64, 16)", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), {}),
    ("causal Nq>Nk: blind rows", "float16", 128, 4, 4, 400, 150, True, None, {}),
    ("d=59 window (-1, 5)", "bfloat16", 59, 4, 2, 200, 333, False, (-1, 5), {}),
    ("d=96 Br=128", "float16", 96, 4, 2, 257, 129, True, None, dict(block_q=128)),
    ("4 warps Br=16", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(num_warps=4, block_q=16)),
    ("Br=64 d=128", "bfloat16", 128, 4, 2, 513, 513, True, None, dict(block_q=64)),
]
#: the timed shape (the benchmark's backward section)
TIME_SHAPE = dict(batch=8, heads=16, seqlen=4096, head_dim=128)


def _check_part(seed):
    import iokernels as ik
    from iokernels import cupy_raw as cr
    from iokernels import conventions as cv
    from iokernels import reference
    from iokernels.core.testing import as_numpy, make_inputs
    rng = np.random.default_rng(seed)
    failed = 0
    print(f"{'case':28s} {'cfg':22s} grad  {'v2 err':>9s} {'naive err':>9s} {'ratio':>6s}  verdict")
    for label, dtype, d, hq, hkv, nq, nk, causal, window, kw in CHECKS:
        try:
            q, k, v = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d,
                                  dtype=dtype)
            do = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hq, seqlen_q=nq, seqlen_k=1, head_dim=d,
                             dtype=dtype)[0]
            o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
            refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
            bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
            cfg = cr.BackwardConfig("v2", **kw)
            res = cfg.resolve(d, dtype, cr.device_info()["smem_optin"])
            got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="cupy",
                                        config=cfg)
            blind = ~cv.mask(nq, nk, causal, window).any(axis=-1)
            tiles = f"Br={res.block_q} Bc={res.block_k}{' det' if res.deterministic else ''}"
            for name, g, r, b in zip(("dq", "dk", "dv"), got, refs, bases):
                g = as_numpy(g)
                err = np.abs(np.nan_to_num(g, nan=np.inf) - r)
                e, be = float(err.max()), float(np.abs(as_numpy(b) - r).max())
                ok = e <= FACTOR * be + 1e-3 and not np.isnan(g).any()
                if name == "dq" and blind.any():
                    ok = ok and not np.any(g[:, :, blind] != 0)
                print(f"{label:28s} {tiles:22s} {name}  {e:9.3g} {be:9.3g} {e / max(be, 1e-30):6.2f}  "
                      f"{'ok' if ok else 'FAIL'}")
                if not ok:
                    failed += 1
                    at = np.unravel_index(int(np.argmax(err)), err.shape)
                    print(f"    largest error at (b, h, row, col) = {tuple(int(x) for x in at)}: got "
                          f"{g[at]:.4g}, want {r[at]:.4g}; NaN: {int(np.isnan(g).sum())}; rows with an error "
                          f"> bound: {sorted(set(np.nonzero(err.max(axis=(0, 1, 3)) > FACTOR * be + 1e-3)[0]))[:12]}")
        except Exception:
            failed += 1
            print(f"{label:28s} raised:\n{traceback.format_exc()[-3000:]}")
    print(f"check: {len(CHECKS)} cases, {failed} failures")
    return failed


def _time_part(seed):
    import torch
    import torch.nn.functional as F

    import iokernels as ik
    from iokernels import cupy_raw as cr
    from iokernels import torch_sdpa as ts
    from iokernels.bench import release_device_cache, time_cuda
    B, H, N, d = (TIME_SHAPE[x] for x in ("batch", "heads", "seqlen", "head_dim"))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn((B, H, N, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    print(f"bfloat16 B={B} H={H} N={N} d={d}")
    for causal in (False, True):
        pairs = N * (N + 1) // 2 if causal else N * N
        fwd_flops, bwd_flops = 4.0 * B * H * pairs * d, 10.0 * B * H * pairs * d
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def flash_step():
            for x in leaves:
                x.grad = None
            with ts.force("flash"):
                F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(do)

        o, lse = ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True)

        def ours_step(cfg=None):
            o2, l2 = ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True)
            return ik.attention_backward(do, q, k, v, o2, l2, causal=causal, backend="cupy", config=cfg)

        def bwd(cfg):
            return lambda: ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cupy", config=cfg)

        rows = []
        try:
            t = time_cuda(flash_step, warmup=2, reps=10)
            flash = t.tflops(fwd_flops + bwd_flops)
            rows.append(("sdpa FLASH fwd+bwd", t.median_ms, flash))
        except Exception as e:
            flash = None
            rows.append((f"sdpa FLASH fwd+bwd failed: {str(e).splitlines()[0][:100]}", float("nan"), float("nan")))
        try:
            t = time_cuda(lambda: ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True),
                          warmup=2, reps=10)
            rows.append(("ours fwd (default version)", t.median_ms, t.tflops(fwd_flops)))
        except Exception as e:
            rows.append((f"ours fwd failed: {str(e).splitlines()[0][:100]}", float("nan"), float("nan")))
        variants = [("v2 bwd (default tiles)", cr.BackwardConfig("v2"), 10),
                    ("v2 bwd Br=64", cr.BackwardConfig("v2", block_q=64), 10),
                    ("v2 bwd 4 warps (Bc=64)", cr.BackwardConfig("v2", num_warps=4), 10),
                    ("v2 bwd deterministic", cr.BackwardConfig("v2", deterministic=True), 5),
                    ("v1 bwd", cr.BackwardConfig("v1"), 2)]
        for name, cfg, reps in variants:
            try:
                t = time_cuda(bwd(cfg), warmup=1, reps=reps)
                rows.append((name, t.median_ms, t.tflops(bwd_flops)))
            except Exception as e:
                rows.append((f"{name} failed: {str(e).splitlines()[0][:100]}", float("nan"), float("nan")))
        ours = None
        try:
            t = time_cuda(lambda: ours_step(cr.BackwardConfig("v2")), warmup=2, reps=10)
            ours = t.tflops(fwd_flops + bwd_flops)
            rows.append(("ours fwd + v2 bwd", t.median_ms, ours))
        except Exception as e:
            rows.append((f"ours fwd + v2 bwd failed: {str(e).splitlines()[0][:100]}", float("nan"), float("nan")))
        print(f"causal={causal}")
        for name, ms, tf in rows:
            print(f"  {name:40s} {ms:9.3f} ms {tf:8.1f} TFLOP/s")
        if flash and ours:
            print(f"  ratio (ours fwd + v2 bwd) / (FLASH fwd + bwd) = {ours / flash:.3f}")
        del leaves
        release_device_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="check,time", help="comma-separated: check, time")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    failed = 0
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            failed += {"check": _check_part, "time": _time_part}[part](args.seed) or 0
        except Exception:
            failed += 1
            traceback.print_exc()
        print(f"== {part}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
