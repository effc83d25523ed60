"""The GPU backward end to end, in one run: correctness by the 2x rule, then time against torch.

    python3 scripts/backward_check.py [--no-time]     # on a CUDA GPU

For every registered backward version (``cupy_raw.REGISTRY`` and ``numba_cuda.REGISTRY``,
op "attention_backward") and both dQ modes (atomic adds, deterministic partials):

1. check: dQ, dK, dV against the float64 oracle by FlashAttention's 2x rule, the naive
   backward in the same dtype from the same O and LSE as the baseline (the GPU tests'
   rule: tests/test_cupy.py, tests/test_numba_backward.py), at one awkward shape
   (GQA, N_k = N_q + 37, causal);
2. time: the backward alone (``ik.attention_backward``) next to torch SDPA's backward
   (autograd of the default dispatch) on the same inputs, L2 flushed between runs, with
   the backward's matmul rate and the modelled bytes
   (``iokernels.backward.traffic_model_gpu``) over the time.

Prints one line per case; a failing case prints its error and the run goes on.  Exit
status 1 when any check failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from iokernels.core.gpu import numba_numpy_fix  # noqa: E402

numba_numpy_fix()   # before numba is imported

#: the check's shape: (batch, heads_q, heads_kv, N_q, N_k, head_dim), GQA and N_k not a tile multiple
CHECK_SHAPE = (1, 4, 2, 1000, 1037, 128)
#: the timed shapes: CuPy in bf16 at the benchmark's head-to-head size, Numba in float32 smaller
TIME_CUPY = dict(B=2, H=16, N=4096, d=128, dtype="bfloat16")
TIME_NUMBA = dict(B=1, H=4, N=1024, d=64, dtype="float32")
FAMILIES = (("cupy", "cupy_raw", "bfloat16", TIME_CUPY), ("numba", "numba_cuda", "float32", TIME_NUMBA))


def _versions(module):
    import importlib
    return importlib.import_module(f"iokernels.{module}").REGISTRY.kernels("attention_backward")


def check_case(family, kern, det, dtype, causal=True) -> list:
    """The 2x-rule checks of one (version, dQ mode) at CHECK_SHAPE: a list of Check."""
    import torch

    import iokernels as ik
    from iokernels.core import testing
    from iokernels.torch_sdpa import naive_backward
    B, Hq, Hkv, Nq, Nk, d = CHECK_SHAPE
    rng = np.random.default_rng(0)
    q, k, v, do = testing.make_grid_inputs(rng, B, Hq, Hkv, Nq, Nk, d)
    o64, lse64, *refs = testing.oracle_by_head(do, q, k, v, causal=causal)
    nd = testing.numpy_dtype(dtype)
    args = [x.astype(nd) for x in (do, q, k, v, o64)] + [lse64.astype(np.float32)]
    dev = [torch.from_numpy(np.asarray(x, np.float32)).cuda().to(getattr(torch, dtype)) for x in args[:5]]
    bases = naive_backward(*dev, torch.from_numpy(args[5]).cuda(), causal=causal)
    cfg = kern.config_class(version=kern.version, deterministic=det)
    got = ik.attention_backward(*args, causal=causal, backend=family, config=cfg)
    return testing.check_gradients(got, refs, [testing.as_numpy(b) for b in bases], dtype=dtype, factor=2.0)


def time_case(family, kern, det, shape, causal, reps=5):
    """(ours ms, SDPA backward ms, backward FLOPs, modelled bytes) at ``shape``."""
    import torch

    import iokernels as ik
    from iokernels import backward
    from iokernels.bench import time_cuda
    B, H, N, d, dtype = shape["B"], shape["H"], shape["N"], shape["d"], shape["dtype"]
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((B, H, N, d), device="cuda", dtype=dt, generator=gen) for _ in range(4))
    o, lse = ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True)
    cfg = kern.config_class(version=kern.version, deterministic=det)
    ours = time_cuda(lambda: ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend=family,
                                                   config=cfg), warmup=1, reps=reps)
    tq, tk, tv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    theirs = time_cuda(lambda: torch.autograd.grad(out, (tq, tk, tv), grad_outputs=do, retain_graph=True),
                       warmup=1, reps=reps)
    flops = backward.recompute_flops(N, N, d, causal=causal, batch=B, heads_q=H)["backward_recompute"]
    resolve = getattr(cfg, "resolve", None) or getattr(cfg, "resolved")
    tiles = resolve(d, dtype)
    model = backward.traffic_model_gpu(batch=B, heads_q=H, heads_kv=H, seqlen_q=N, seqlen_k=N, head_dim=d,
                                       dtype=dtype, block_q=tiles.block_q, block_k=tiles.block_k,
                                       deterministic=det, causal=causal)
    return ours.median_ms, theirs.median_ms, flops, model.total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-time", action="store_true", help="the checks only")
    a = p.parse_args(argv)
    import torch
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    failed = 0
    for family, module, dtype, shape in FAMILIES:
        try:
            kernels = _versions(module)
        except Exception as e:
            print(f"{family}: registry not importable: {type(e).__name__}: {e}", flush=True)
            continue
        for kern in kernels:
            for det in (False, True):
                mode = "deterministic" if det else "atomic"
                where = f"{family}:{kern.version} {mode}"
                try:
                    checks = check_case(family, kern, det, dtype)
                    ok = all(checks)
                    failed += not ok
                    print(f"check {where} {dtype} {CHECK_SHAPE}: {'ok' if ok else 'FAIL'}\n    "
                          + "\n    ".join(map(str, checks)), flush=True)
                except Exception as e:
                    failed += 1
                    print(f"check {where}: {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc()
                if a.no_time:
                    continue
                for causal in (False, True):
                    try:
                        ms, sdpa_ms, flops, nbytes = time_case(family, kern, det, shape, causal)
                        print(f"time  {where} {shape} causal={causal}: {ms:.3f} ms ({flops / ms / 1e9:.1f} "
                              f"TFLOP/s, model {nbytes / 1e6:.0f} MB -> {nbytes / ms / 1e9:.2f} TB/s); "
                              f"SDPA backward {sdpa_ms:.3f} ms; ours / SDPA = {ms / sdpa_ms:.1f}x", flush=True)
                    except Exception as e:
                        print(f"time  {where} causal={causal}: {type(e).__name__}: {e}", flush=True)
    print(f"{failed} failed check(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
