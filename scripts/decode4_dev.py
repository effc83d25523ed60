"""Decode v4 (the GQA group on the tensor cores) end to end on one GPU: correctness, then speed.

    python scripts/decode4_dev.py [--no-timing | --no-correctness] [--reps N] [--rounds R]
                                  [--batches B ...] [--seqlens N ...] [--default-only]

Part 1 holds decode v4 against the float64 oracle (iokernels.core.reference) at awkward
shapes -- ragged lengths with an empty sequence, GQA groups 1 to 16, head dims 64 to 256,
pages of odd sizes, 1 / 7 / heuristic splits, contiguous and paged -- with the shared
checker's 2x rule, and prints one line a case: max |O - ref64|, the naive baseline's error
in the same precision, max |LSE - ref|, and whether the empty sequence gave O = 0 and
LSE = -inf.

Part 2 times, at the serving shapes (GQA 32/8, d=128, B in 1, 8, 64 x N in 4096, 32768,
float16 and bfloat16), torch SDPA's cuDNN and FLASH backends (enable_gqa) and the CuPy
decode v4 in the settings of V4_TIMED (cp.async and bulk copies) over a contiguous cache
and over paged pools (a shuffled block table,
iokernels.bench.device_pages), each with iokernels.bench.time_cuda (CUDA events, L2
flushed), and prints TB/s of K/V read, v4's ratio to the best SDPA backend and paged over
contiguous.  With ``--rounds R`` the runners take turns R times (a drift of clocks or
temperature then falls on all of them alike) and each time is the median of its rounds;
near a tie, at the shapes where both kernels stream at the HBM ceiling, one pass can come
out either way.  ``--batches`` and ``--seqlens`` time other shapes (e.g. batches 17, 24 and
32, whose (b, KV head) pairs overfill one wave of blocks), ``--default-only`` only v4's default
settings.  Exits 1 when a correctness case fails.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

#: correctness cases: (dtype, head_dim, heads_q, heads_kv, lengths, block_size, DecodeConfig kwargs)
CASES = (
    ("float16", 128, 32, 8, (1000, 0, 333, 5), 16, {}),
    ("bfloat16", 128, 32, 8, (1000, 0, 333, 5), 16, {}),
    ("float16", 64, 16, 2, (517, 0, 1, 130), 7, dict(num_warps=8)),
    ("bfloat16", 128, 8, 8, (203, 0, 64, 1), 16, dict(stages=2, tile_rows=32)),
    ("bfloat16", 128, 32, 2, (203, 0, 64, 1), 16, dict(fused=False)),
    ("float16", 112, 24, 2, (203, 0, 64, 1), 5, dict(tile_rows=48, stages=2)),
    ("float16", 256, 16, 2, (777, 0, 64, 1), 16, {}),
    ("bfloat16", 128, 32, 8, (1000, 0, 333, 5), 16, dict(load_bulk=True)),
    ("float16", 64, 16, 2, (517, 0, 1, 130), 7, dict(num_warps=8, tile_rows=32, load_bulk=True)),
)
#: the v4 settings timed next to SDPA (the first is the default: cp.async chunks, through L1
#: where DecodeConfig's load_l1 rule picks it; ".cg": past L1 to L2; "bulk": the copy engine,
#: sm_90); the paged pools are timed for those marked True
V4_TIMED = (("v4", {}, True), ("v4 .cg", dict(load_l1=False), False), ("v4 bulk", dict(load_bulk=True), True),
            ("v4 4w x 4", dict(num_warps=4, stages=4), False), ("v4 8w x 2", dict(num_warps=8, stages=2), False),
            ("v4 4w x 3 tile=32", dict(num_warps=4, stages=3, tile_rows=32), False))
SPLITS = (None, 1, 7)
#: the serving shapes of the timing part
SERVING = tuple((B, N) for B in (1, 8, 64) for N in (4096, 32768))
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def correctness(torch, cr, reference, check, as_numpy, naive, rng) -> int:
    """Part 1: one printed line a case; returns the number of failures."""
    from iokernels import bench
    failures = 0
    for dtype, d, Hq, Hkv, lens, bs, kw in CASES:
        tdt = getattr(torch, dtype)
        B, N = len(lens), max(lens)
        N_pad = -(-N // bs) * bs
        q = torch.from_numpy(rng.standard_normal((B, Hq, d)).astype(np.float32)).cuda().to(tdt)
        k, v = (torch.from_numpy(rng.standard_normal((B, Hkv, N_pad, d)).astype(np.float32)).cuda().to(tdt)
                for _ in range(2))
        ln = np.array(lens, np.int32)
        ref_o, ref_l = reference.decode(q, k[:, :, :N], v[:, :, :N], seq_lens=ln)
        base = torch.zeros_like(q)
        for b, n in enumerate(lens):
            if n:
                base[b] = naive(q[b:b + 1, :, None], k[b:b + 1, :, :n], v[b:b + 1, :, :n])[0, :, 0]
        kp, vp, tables, _ = bench.device_pages(k, v, seed=int(rng.integers(1 << 30)), block_size=bs)
        cfg = cr.DecodeConfig(version="v4", **kw)
        masked = ~np.isfinite(ref_l)[..., None]
        fin = np.isfinite(ref_l)
        base_err = float(np.max(np.abs(as_numpy(base).astype(np.float64) - ref_o)))
        for S in SPLITS:
            for kind in ("contiguous", "paged"):
                label = f"{dtype} d={d} g={Hq // Hkv} lens={lens} bs={bs} {kw} S={S} {kind}"
                try:
                    if kind == "paged":
                        o, lse = cr.paged_decode_pools(q, kp, vp, tables, ln, num_splits=S, config=cfg)
                    else:
                        o, lse = cr.decode(q, k[:, :, :N], v[:, :, :N], seq_lens=ln, num_splits=S, config=cfg)
                    torch.cuda.synchronize()
                    c = check(o, ref_o, base, dtype=dtype, masked_rows=masked)
                    on, ln_ = as_numpy(o).astype(np.float64), as_numpy(lse)
                    err = float(np.max(np.abs(on - ref_o)))
                    lse_err = float(np.max(np.abs(ln_[fin] - ref_l[fin])))
                    empty = bool(np.all(on[1] == 0) and np.all(np.isneginf(ln_[1])))
                    ok = bool(c) and lse_err < 2e-2 and empty and np.all(np.isfinite(on))
                    print(f"{'ok  ' if ok else 'FAIL'} {label}: max|O-ref64| {err:.3g} (naive {base_err:.3g}), "
                          f"max|LSE-ref| {lse_err:.3g}, empty seq 0/-inf {empty}" + ("" if c else f" [{c}]"),
                          flush=True)
                except Exception as e:                      # say what failed and go on
                    ok = False
                    print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                failures += not ok
    return failures


def timings(torch, cr, reps: int, rounds: int = 1, shapes=SERVING, settings=V4_TIMED) -> None:
    """Part 2: the serving shapes, SDPA cuDNN / FLASH and CuPy v4's settings, contiguous and paged.

    Each runner is timed ``rounds`` times, the runners taking turns; its time is the median
    of its rounds' medians, and with more than one round each v4 row lists its ratio to the
    best SDPA backend round by round."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    print(f"\n# timings ({reps} reps x {rounds} interleaved round(s), L2 flushed): TB/s of K/V read; "
          "ratio = best SDPA ms / v4 ms")
    for dtype in ("float16", "bfloat16"):
        tdt = getattr(torch, dtype)
        for B, N in shapes:
            gen = torch.Generator(device="cuda").manual_seed(B * 7 + N)
            q = torch.randn((B, HEADS_Q, HEAD_DIM), device="cuda", dtype=tdt, generator=gen)
            k, v = (torch.randn((B, HEADS_KV, N, HEAD_DIM), device="cuda", dtype=tdt, generator=gen)
                    for _ in range(2))
            kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
            kv_bytes = 2.0 * B * HEADS_KV * N * HEAD_DIM * 2
            q4 = q[:, :, None, :]
            out = {}

            def sdpa(backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            runs = {"sdpa CUDNN": (sdpa, (SDPBackend.CUDNN_ATTENTION,), {}),
                    "sdpa FLASH": (sdpa, (SDPBackend.FLASH_ATTENTION,), {})}
            for label, kw, paged in settings:
                cfg = cr.DecodeConfig(version="v4", **kw)
                runs[f"cupy {label}"] = (cr.decode, (q, k, v), dict(config=cfg))
                if paged:
                    runs[f"cupy {label} paged"] = (cr.paged_decode_pools, (q, kp, vp, tables, lens), dict(config=cfg))
            for name, (fn, args, kw) in runs.items():
                try:
                    r = fn(*args, **kw)
                    out[name] = (r[0] if isinstance(r, tuple) else r[:, :, 0]).float()
                except Exception as e:                      # a backend that cannot run: say so
                    print(f"  {dtype} B={B} N={N} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            # interleaved rounds: every runner once a round, so a drift of the GPU's clocks or
            # temperature over the shape's timings falls on all runners alike
            per = {name: [] for name in out}
            for _ in range(rounds):
                for name in per:
                    fn, args, kw = runs[name]
                    per[name].append(bench.time_cuda(fn, *args, reps=reps, **kw).median_ms)
            ms = {name: float(np.median(t)) for name, t in per.items()}
            best = min((ms[n] for n in ms if n.startswith("sdpa")), default=None)
            best_by_round = [min(per[n][i] for n in per if n.startswith("sdpa")) for i in range(rounds)] if best else []
            ref = next((out[n] for n in ("sdpa CUDNN", "sdpa FLASH") if n in out), None)
            for name in ms:
                tbps = kv_bytes / ms[name] / 1e9
                line = f"  {dtype} B={B:2d} N={N:5d} {name:28s} {ms[name]:8.4f} ms {tbps:6.2f} TB/s"
                if best and name.startswith("cupy"):
                    line += f"  ratio to best SDPA {best / ms[name]:.3f}"
                    if rounds > 1:
                        line += " (rounds " + " ".join(f"{b / t:.3f}" for b, t in zip(best_by_round, per[name])) + ")"
                if name.endswith("paged") and name[:-6] in ms:
                    line += f"  paged/contiguous {ms[name[:-6]] / ms[name]:.3f}"
                if ref is not None and name.startswith("cupy"):
                    line += f"  max|diff vs SDPA| {float((out[name] - ref).abs().max()):.3g}"
                print(line, flush=True)
            del q, k, v, kp, vp, q4, out
            bench.release_device_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions a runner")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved rounds: every runner timed once a round, the median of rounds kept")
    p.add_argument("--no-correctness", action="store_true", help="timing only")
    p.add_argument("--batches", type=int, nargs="+", default=sorted({b for b, _ in SERVING}),
                   help="batch sizes of the timing part")
    p.add_argument("--seqlens", type=int, nargs="+", default=sorted({n for _, n in SERVING}),
                   help="cache lengths of the timing part")
    p.add_argument("--default-only", action="store_true", help="time v4's default settings only")
    a = p.parse_args(argv)
    if a.reps < 1 or a.rounds < 1:
        p.error(f"--reps, --rounds: need at least 1, got {a.reps}, {a.rounds}")
    if min(a.batches) < 1 or min(a.seqlens) < 1:
        p.error(f"--batches, --seqlens: need sizes of at least 1, got {a.batches}, {a.seqlens}")
    import torch

    from iokernels import cupy_raw as cr
    from iokernels import reference
    from iokernels.core.testing import as_numpy, check
    from iokernels.torch_sdpa import naive_attention
    t0 = time.time()
    dev = cr.device_info()
    print(f"# device cc {dev['cc']}, {dev['sms']} SMs, {dev['smem_optin']:,} B SRAM a block; "
          f"decode v4 default defines at bf16 d=128 g=4: "
          f"{cr.DecodeConfig('v4').defines(128, 'bfloat16', 4, False, 0, smem_limit=dev['smem_optin'], cc=dev['cc'])}")
    failures = 0
    if not a.no_correctness:
        failures = correctness(torch, cr, reference, check, as_numpy, naive_attention, np.random.default_rng(0))
        print(f"# correctness: {failures} failing case(s), {time.time() - t0:.1f} s", flush=True)
    if not a.no_timing:
        timings(torch, cr, a.reps, a.rounds, tuple((B, N) for B in a.batches for N in a.seqlens),
                V4_TIMED[:1] if a.default_only else V4_TIMED)
    print(f"# done in {time.time() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
