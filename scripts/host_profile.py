"""Where the host's time goes on a GPU: a call of ours beside SDPA's, and a serving step.

    python scripts/host_profile.py [--op decode|paged|attention|serve|gemm|all] [--calls 1000] [--top 14]
                                   [--warm-steps 120] [--steps 30] [--rows-granule N] [--layers N]

decode, paged, attention: each op at one small shape (:data:`SHAPES`; bfloat16, torch CUDA tensors,
the CuPy backend's default; paged: ``iokernels.cupy_raw.paged_decode_pools`` over device pools,
block tables and lengths) and, beside it, torch's SDPA on the same tensors (paged: on a
contiguous cache of the same length): the loop's
microseconds a call (what :func:`iokernels.bench.timer.host_ms_loop` records in the
benchmark's ``host_ms``) for both, then the functions that take the most of ours.

serve: the serve-bench's setup (the Llama-3-8B-shaped model, ``--layers`` of it (default two),
bfloat16, a KV budget of 0.625 GB a layer (1.25 GB for two, 20 GB for all 32: the same slots a layer),
4096 ShareGPT-like requests at 1000 a second, the CuPy kernels;
:mod:`iokernels.serving.bench`), one side at a time (paged, then contiguous): ``--warm-steps``
steps to fill the batch, then ``--steps`` steps under torch's profiler and as many under
cProfile.  Per side: the running sequences, a step's wall time and its phases
(:class:`~iokernels.serving.engine.StepRecord`), the kernels' time a step (the device busy;
the rest of the step the device waited for the host, or the host for it), the kernels that
take the most of it, and the Python functions that take the most of the host.

``--rows-granule N`` pads the model's rows of a step to a multiple of N (1: none;
default: the model's, :data:`iokernels.serving.llama.ROWS_GRANULE`).

gemm: the host's microseconds a call of a bfloat16 ``x @ W.T`` (W: Llama-3-8B's MLP, 14336 x
4096), where x has the same row count every call, a row count that changes every call (a new
one each time: what a server's step sees when its batch changes), and the same changing counts
padded to a multiple of 64; each loop ends with one synchronize.  A call's host time beyond
the first loop's is what choosing a kernel for a new shape costs the host.

The functions are ranked by ``tottime`` (time inside the function itself); the profiler's own
cost inflates every entry, so compare entries with each other, not with the unprofiled
times.  Needs CUDA, torch and CuPy: without them it says so and exits 0.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: small shapes: the kernels take a few microseconds, so the loop measures the host, not a full
#: launch queue waiting on the device
SHAPES = {"decode": dict(batch=1, heads_q=32, heads_kv=8, seqlen=1024, head_dim=128),
          "paged": dict(batch=1, heads_q=32, heads_kv=8, seqlen=1024, head_dim=128, block_size=16),
          "attention": dict(batch=1, heads_q=16, heads_kv=16, seqlen=256, head_dim=128)}


#: serve: the KV budget a layer, GB (20 GB over Llama-3-8B's 32 layers, gpu_all.sh's serving record)
KV_GB_A_LAYER = 20 / 32


def _calls(op, torch):
    import iokernels as ik
    s = SHAPES[op]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    B, Hq, Hkv, N, d = (s[k] for k in ("batch", "heads_q", "heads_kv", "seqlen", "head_dim"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if op == "decode":
        q, k, v = randn(B, Hq, d), randn(B, Hkv, N, d), randn(B, Hkv, N, d)
        q4 = q[:, :, None, :]
        return (lambda: ik.decode(q, k, v, backend="cupy"),
                lambda: sdpa(q4, k, v, enable_gqa=Hq != Hkv))
    if op == "paged":                   # device pools, tables and lengths (what a server passes)
        from iokernels.cupy_raw import paged_decode_pools
        bs = s["block_size"]
        blocks = B * N // bs
        q, pools = randn(B, Hq, d), [randn(blocks, bs, Hkv, d) for _ in range(2)]
        tables = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).reshape(B, N // bs)
        lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
        k, v = randn(B, Hkv, N, d), randn(B, Hkv, N, d)
        q4 = q[:, :, None, :]
        return (lambda: paged_decode_pools(q, *pools, tables, lens),
                lambda: sdpa(q4, k, v, enable_gqa=Hq != Hkv))
    q, k, v = randn(B, Hq, N, d), randn(B, Hkv, N, d), randn(B, Hkv, N, d)
    return (lambda: ik.attention(q, k, v, causal=True, backend="cupy"),
            lambda: sdpa(q, k, v, is_causal=True))


def _side(label, make_memory, llama, trace, preset, a, torch, activity="CUDA"):
    """One side's report; ``activity``: what torch's profiler records (CUDA: the device's kernels)."""
    from iokernels.serving.engine import Engine
    engine = Engine(llama, make_memory(), token_budget=preset["token_budget"], max_seqs=preset["max_seqs"])
    for r in trace:
        engine.submit(r)
    for _ in range(a.warm_steps):
        if engine.done:
            break
        engine.step()
    torch.cuda.synchronize()
    steps = engine.results.steps
    first = len(steps)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / a.steps / 1e3
    rec = steps[first:]
    phases = {k: 1e3 * sum(s.phases[k] for s in rec) / len(rec) for k in rec[0].phases}
    wall = sum(phases.values())                         # a step's wall time: its phases add up to it
    print(f"== {label}: {sum(s.running for s in rec) / len(rec):.0f} running, {wall:.2f} ms a step "
          f"(phases, ms: {', '.join(f'{k} {v:.2f}' for k, v in phases.items())}); kernels {busy:.2f} ms a step")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:a.top]:
        print(f"   {e.self_device_time_total / a.steps / 1e3:7.3f} ms  {e.count / a.steps:5.1f}x  {e.key[:90]}")
    _print_top(_profiled(engine.step, a.steps), a.top)
    del engine
    torch.cuda.empty_cache()


def _loop_us(fn, calls, torch):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = 1e6 * (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return us


def _profiled(fn, times) -> cProfile.Profile:
    """cProfile over ``times`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(times):
        fn()
    prof.disable()
    return prof


def _print_top(prof, top) -> None:
    """The ``top`` functions by time inside themselves, one line each."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    lines = [ln[:150] for ln in out.getvalue().splitlines() if ln.strip() and "Ordered by" not in ln
             and "List reduced" not in ln]
    print("\n".join(lines[1:]))


def _serve(a, torch) -> None:
    from iokernels.paged import kv_bytes_per_token
    from iokernels.serving import bench as B
    from iokernels.serving.llama import MODELS, Llama
    from iokernels.serving.trace import sharegpt_like_trace
    preset = dict(B.PRESETS["llama3-8b-shape"], rate=1000.0)
    shape, block = MODELS["llama3-8b-shape"](a.layers), 16
    per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, 2)
    slots = B._kv_slots(None, KV_GB_A_LAYER * a.layers, preset, per_token, block)
    llama = Llama(shape, seed=0, dtype=torch.bfloat16, device="cuda")
    if a.rows_granule is not None:
        llama.rows_granule = a.rows_granule
    print(f"(the model: {shape.name}, {slots} KV slots a layer; it pads a step's rows to a multiple of "
          f"{llama.rows_granule})")
    trace = sharegpt_like_trace(4096, seed=0, vocab=shape.vocab, scale=preset["scale"], max_prompt=preset["max_prompt"],
                                max_new_tokens=preset["max_new_tokens"], rate=preset["rate"])
    paged, contiguous = B._memories("cuda", "cupy", slots // block, block, llama.memory_shape())
    for label, make in (("paged", paged), ("contiguous", contiguous)):
        _side(label, make, llama, trace, preset, a, torch)


def _gemm(a, torch) -> None:
    """Host time a call of x @ W.T: one row count, a new row count every call, those padded."""
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    rng = random.Random(0)
    fresh = rng.sample(range(300, 1000), 600)        # 600 distinct row counts, none seen before
    loops = {"the same 541 rows": [541] * len(fresh), "a new row count each call (300-999)": fresh,
             "those counts padded to a multiple of 64": [-(-m // 64) * 64 for m in fresh]}
    xs[:1000] @ w.T                                   # cuBLAS's handle and workspace, outside the loops
    for label, ms in loops.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in ms:
            xs[:m] @ w.T
        us = 1e6 * (time.perf_counter() - t0) / len(ms)
        torch.cuda.synchronize()
        print(f"== gemm, {label}: {us:.1f} us of host a call ({len(set(ms))} row counts)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("decode", "paged", "attention", "serve", "gemm", "all"), default="all")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--warm-steps", type=int, default=120, help="serve: steps before the profiled ones")
    ap.add_argument("--steps", type=int, default=30, help="serve: steps profiled, by each profiler")
    ap.add_argument("--layers", type=int, default=2, help="serve: layers of the Llama-3-8B-shaped model (default 2)")
    ap.add_argument("--rows-granule", type=int, default=None, help="serve: pad a step's rows to a multiple of "
                    "this (1: none; default: the model's)")
    a = ap.parse_args(argv)
    try:
        import torch
        import cupy  # noqa: F401
        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
    except ImportError as e:
        print(f"host_profile: needs torch with CUDA and CuPy ({e}); nothing measured")
        return 0
    for op in (("decode", "paged", "attention", "gemm", "serve") if a.op == "all" else (a.op,)):
        if op in ("serve", "gemm"):
            (_serve if op == "serve" else _gemm)(a, torch)
            continue
        ours, sdpa = _calls(op, torch)
        us_ours, us_sdpa = _loop_us(ours, a.calls, torch), _loop_us(sdpa, a.calls, torch)
        print(f"== {op} {SHAPES[op]}: {us_ours:.1f} us a call (ours), {us_sdpa:.1f} us (SDPA), "
              f"ratio {us_ours / us_sdpa:.2f}")
        prof = _profiled(ours, a.calls)
        torch.cuda.synchronize()
        _print_top(prof, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
