"""Check and time the Numba paged decode (split kernel v3) at both paged addressings, one GPU run.

    python3 scripts/numba_paged_dev.py                 # check, then time (compiles included)
    python3 scripts/numba_paged_dev.py --parts check   # only the correctness checks (small shapes)
    python3 scripts/numba_paged_dev.py --parts time    # only the timings

* check: GQA 32/8, d = 128, ragged lengths with an empty sequence, scattered pages: Numba
  decode v3 with ``paged_addressing`` "page" and "key" (float16, block size 16) and the
  contiguous decode of the same values; "page" at float32 block 16 and float16 block 64;
  "key" at float16 block 5 (where "page" cannot run); the default split count and an uneven
  one, against the float64 oracle by the 2x rule (O and LSE).  One line a case, with the
  errors, and whether "page" and "key" gave the same bits.
* time: GQA 32/8, d = 128, float16, B in {1, 8, 64} x N in {4096, 32768}: Numba decode v3
  over the contiguous cache, and over the same values in scattered pages (the benchmark's
  device_pages, block size 16) with "page" (the default) and "key" addressing; torch SDPA's
  decode (the flash kernel) on the contiguous cache as the baseline.  Prints ms and each
  paged call's speed relative to the contiguous one (contiguous ms / paged ms).

Timings: iokernels.bench.time_cuda (warm-up, median, L2 flushed).  Exit status 1 when a
check fails (every case still runs and prints).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

#: the benchmark's decode serving shapes: GQA 32/8 heads, d = 128, float16
HQ, HKV, D = 32, 8, 128
TIME_BATCHES = (1, 8, 64)
TIME_SEQLENS = (4096, 32768)
#: check shapes: a length every checked block size divides (device_pages needs it), ragged
#: lengths (one empty), and an uneven split count next to the default
CHECK_N = 960
CHECK_LENS = (960, 0, 333, 517)
CHECK_SPLITS = (None, 7)
#: (dtype, block size, paged addressings, with the contiguous decode?) of the checks: the
#: float16 block-16 kernels are the timed ones; each other case compiles one more kernel (block
#: size and dtype are compile-time constants), so it checks only what its kernel changes
CHECK_CASES = (("float16", 16, ("page", "key"), True), ("float32", 16, ("page",), False),
               ("float16", 64, ("page",), False), ("float16", 5, ("key",), False))
#: the speed a paged call should reach relative to the contiguous one
TARGET_RATIO = 0.9


def _cfg(addressing=None):
    from iokernels.numba_cuda import DecodeConfig
    return DecodeConfig(version="v3", paged_addressing=addressing)


def check_part() -> int:
    import torch
    import iokernels as ik
    from iokernels import reference, testing
    from iokernels.bench import device_pages, release_device_cache
    from iokernels import numba_cuda as nc
    failed = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = np.array(CHECK_LENS, np.int32)
    for dtype, bs, addressings, contiguous in CHECK_CASES:
        tdt = getattr(torch, dtype)
        q = torch.randn((len(lens), HQ, D), device="cuda", generator=gen).to(tdt)
        k = torch.randn((len(lens), HKV, CHECK_N, D), device="cuda", generator=gen).to(tdt)
        v = torch.randn((len(lens), HKV, CHECK_N, D), device="cuda", generator=gen).to(tdt)
        kp, vp, tables, _ = device_pages(k, v, seed=1, block_size=bs)
        qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
        ro, rl = reference.decode(qn, kn, vn, seq_lens=lens)
        bo, bl = ik.decode(qn, kn, vn, seq_lens=lens, backend="naive", return_lse=True)
        empty = (lens == 0)[:, None, None]
        runs = [("contiguous", lambda S: nc.decode(q, k, v, seq_lens=lens, num_splits=S, config=_cfg()))][:contiguous]
        for a in addressings:
            runs.append((f"paged {a}", lambda S, a=a: nc.paged_decode_pools(q, kp, vp, tables, lens, num_splits=S,
                                                                             config=_cfg(a))))
        for S in CHECK_SPLITS:
            outs = {}
            for name, fn in runs:
                label = f"{dtype} block {bs} {name} num_splits={S}"
                try:
                    t0 = time.perf_counter()
                    o, lse = fn(S)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    outs[name] = (o, lse)
                    c_o = testing.check(o, ro, bo, masked_rows=empty)
                    c_l = testing.check(lse, rl, bl, name="lse")
                    ok = c_o.ok and c_l.ok
                    print(f"{'ok  ' if ok else 'FAIL'} {label}: {c_o} | {c_l} ({dt:.1f} s incl. compile)", flush=True)
                except Exception as e:                        # a crash is a failed case, not the run
                    ok = False
                    print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                    traceback.print_exc(limit=4)
                failed += not ok
            if "paged page" in outs and "paged key" in outs:
                same = all(torch.equal(x, y) for x, y in zip(outs["paged page"], outs["paged key"]))
                print(f"     {dtype} block {bs} num_splits={S}: page and key outputs bit-equal: {same}")
        del q, k, v, kp, vp
        release_device_cache()
    return failed


def time_part():
    import torch
    from iokernels import torch_sdpa as ts
    from iokernels.bench import device_pages, release_device_cache, time_cuda
    from iokernels import numba_cuda as nc
    F = torch.nn.functional
    print(f"\n{'B':>3} {'N':>6}  {'sdpa flash':>10} {'contig':>9} {'page':>9} {'key':>9}  {'page/contig':>11} "
          f"{'key/contig':>10}  (ms; ratios: contiguous ms / paged ms, target >= {TARGET_RATIO})")
    worst = 1.0
    for B in TIME_BATCHES:
        for N in TIME_SEQLENS:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn((B, HQ, D), device="cuda", dtype=torch.float16, generator=gen)
            k = torch.randn((B, HKV, N, D), device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn((B, HKV, N, D), device="cuda", dtype=torch.float16, generator=gen)
            kp, vp, tables, lens = device_pages(k, v, seed=0)
            q4 = q[:, :, None, :]

            def sdpa():
                with ts.force("flash"):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

            fns = {"sdpa": sdpa,
                   "contig": lambda: nc.decode(q, k, v, config=_cfg()),
                   "page": lambda: nc.paged_decode_pools(q, kp, vp, tables, lens, config=_cfg("page")),
                   "key": lambda: nc.paged_decode_pools(q, kp, vp, tables, lens, config=_cfg("key"))}
            ms = {}
            for name, fn in fns.items():
                try:
                    ms[name] = time_cuda(fn).median_ms
                except Exception as e:
                    ms[name] = None
                    print(f"    {name} B={B} N={N}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            r = {a: (ms["contig"] / ms[a]) if ms.get(a) and ms.get("contig") else float("nan") for a in ("page", "key")}
            if r["page"] == r["page"]:
                worst = min(worst, r["page"])
            cells = " ".join(f"{ms[n]:9.4f}" if ms[n] else f"{'-':>9}" for n in ("contig", "page", "key"))
            sd = f"{ms['sdpa']:10.4f}" if ms["sdpa"] else f"{'-':>10}"
            print(f"{B:>3} {N:>6}  {sd} {cells}  {r['page']:11.3f} {r['key']:10.3f}", flush=True)
            del q, k, v, kp, vp, q4
            release_device_cache()
    print(f"worst page/contig ratio: {worst:.3f} ({'meets' if worst >= TARGET_RATIO else 'BELOW'} the "
          f"{TARGET_RATIO} target)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="check,time", help="comma-separated: check, time")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    failed = 0
    if "check" in parts:
        failed = check_part()
        print(f"checks: {failed} failed ({time.perf_counter() - t0:.1f} s)", flush=True)
    if "time" in parts:
        t1 = time.perf_counter()
        time_part()
        print(f"timings: {time.perf_counter() - t1:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
