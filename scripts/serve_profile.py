"""Where a serving step's time goes on a GPU: the host's Python and the device's kernels.

    python scripts/serve_profile.py [--warm-steps 120] [--steps 30] [--top 14]

The serve-bench's setup (the Llama-3-8B-shaped model, two layers, bfloat16, a 1.25 GB KV
budget, 4096 ShareGPT-like requests at 1000 a second, the CuPy kernels; :mod:`iokernels.serving.bench`),
one side at a time (paged, then contiguous): ``--warm-steps`` steps to fill the batch, then
``--steps`` steps under torch's profiler (the device's kernels, summed) and as many under
cProfile (the host's Python).  Printed per side: the running sequences, the wall time a step
and its phases (:class:`~iokernels.serving.engine.StepRecord`), the kernels' time a step (the
device busy; the rest of the wall time the device waited for the host, or the host for
it), the kernels that take the most of it, and the Python functions that take the most of
the host's time (``tottime``: inside the function itself; the profiler's own cost inflates
them, so compare them with each other).  Needs CUDA and CuPy: without them it says so and
exits 0.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        if engine.done:
            break
        engine.step()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).strip_dirs().sort_stats("tottime").print_stats(a.top)
    lines = [ln[:150] for ln in out.getvalue().splitlines() if ln.strip() and "Ordered by" not in ln
             and "List reduced" not in ln]
    print("\n".join(lines[1:]))
    del engine
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm-steps", type=int, default=120)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args(argv)
    try:
        import torch
        import cupy  # noqa: F401
        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
    except ImportError as e:
        print(f"serve_profile: needs torch with CUDA and CuPy ({e}); nothing measured")
        return 0
    from iokernels.paged import kv_bytes_per_token
    from iokernels.serving import bench as B
    from iokernels.serving.llama import MODELS, Llama
    from iokernels.serving.trace import sharegpt_like_trace
    preset = dict(B.PRESETS["llama3-8b-shape"], rate=1000.0)
    shape, block = MODELS["llama3-8b-shape"](2), 16
    per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, 2)
    slots = B._kv_slots(None, 1.25, preset, per_token, block)
    llama = Llama(shape, seed=0, dtype=torch.bfloat16, device="cuda")
    trace = sharegpt_like_trace(4096, seed=0, vocab=shape.vocab, scale=preset["scale"], max_prompt=preset["max_prompt"],
                                max_new_tokens=preset["max_new_tokens"], rate=preset["rate"])
    paged, contiguous = B._memories("cuda", "cupy", slots // block, block, llama.memory_shape())
    for label, make in (("paged", paged), ("contiguous", contiguous)):
        _side(label, make, llama, trace, preset, a, torch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
