"""Time the opt-in FP8 forward (iokernels.cupy_raw.hopper.fp8_attention) on an H100 / H200.

    python3 scripts/fp8_bench.py [--out DIR] [--shape B,H,N] [--causal]

Rows, bf16 inputs, d = 128 (default B=8 H=16 N=4096, non-causal), each in ms and TFLOP/s
(4 B H N^2 d FLOPs, halved for causal):

* fp8 total: the quantization kernels (Q, K rows; V -> V^T) and the forward, what a caller of
  fp8_attention waits for; fp8 + Hadamard: the same after fwht of Q and K;
* fp8 quantize only, and fp8 forward only (fp8_attention_codes on codes made once): where the
  time goes;
* the 16-bit Hopper v5 and SDPA's FLASH and cuDNN kernels on the same inputs, for scale.

Timings: iokernels.bench.time_cuda (warm-up, median, L2 flushed).  One JSON file under $OUT (or
--out), a short table printed.  Checks nothing: tests/test_hopper_fp8.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="8,16,4096", help="B,H,N")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from iokernels.bench import time_cuda
    from iokernels.cupy_raw import hopper as hp
    from iokernels.torch_sdpa import force
    B, H, N = (int(x) for x in args.shape.split(","))
    d, causal = 128, args.causal
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((B, H, N, d), dtype=np.float32)).cuda().to(torch.bfloat16)
               for _ in range(3))
    codes = hp.quantize_qkv(q, k, v)
    flops = 4 * B * H * N * N * d / (2 if causal else 1)

    def sdpa(backend):
        def run():
            with force(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    runners = {
        "fp8 total": lambda: hp.fp8_attention(q, k, v, causal=causal),
        "fp8 + Hadamard total": lambda: hp.fp8_attention(q, k, v, causal=causal, hadamard=True),
        "fp8 quantize only": lambda: hp.quantize_qkv(q, k, v),
        "fp8 forward only": lambda: hp.fp8_attention_codes(codes, causal=causal),
        "v5 (bf16)": lambda: hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v5")),
        "SDPA flash": sdpa("flash"),
        "SDPA cudnn": sdpa("cudnn"),
    }
    rows = {}
    for name, fn in runners.items():
        try:
            t = time_cuda(fn)
            rows[name] = dict(ms=t.median_ms, p10=t.p10, p90=t.p90, tflops=t.tflops(flops))
        except Exception as e:  # a runner that cannot run here is reported, not fatal
            rows[name] = dict(error=f"{type(e).__name__}: {e}")
    record = dict(shape=dict(B=B, H=H, N=N, d=d, causal=causal), gpu=torch.cuda.get_device_name(), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_bench.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{record['gpu']}  B={B} H={H} N={N} d={d} causal={causal}")
    for name, r in rows.items():
        print(f"  {name:<22}" + (f"{r['ms']:9.3f} ms {r['tflops']:8.1f} TFLOP/s" if "ms" in r else f"  {r['error']}"))
    print(f"written {path}")


if __name__ == "__main__":
    main()
