"""``python -m iokernels serve-bench``: paged against contiguous at the same KV memory.

PagedAttention's argument (Kwon et al., SOSP 2023, paper), measured: with the same bytes
of KV cache, a server that reserves each request's maximum length up front holds few
sequences, most of whose reservation is never written; a paged server holds many more,
and decode, which is memory-bound, turns a larger batch into more tokens per second.

Both runs serve the same seeded ShareGPT-like trace (:mod:`.trace`) with the same model and
scheduler; only the memory differs.  Reported per side: ``max_concurrent`` (running
sequences), ``tokens_per_s`` (tokens drawn over the busy time, ``generated_tokens``,
counting the requests a time-boxed run had not finished), ``waste_fraction`` (allocated KV
slots not holding a token, over the run), ``p50_ms`` / ``p99_ms`` (time per output token),
``finished`` and ``complete`` (whether every request was served before ``max_seconds``), and
``phase_ms``: where a step's time goes (the scheduler, the model's forward pass as the host
sees it, the sampling that waits for the device, the books kept after it; median and total
per phase, :class:`~.engine.StepRecord`); then ``tokens_equal`` (whether both produced the
same tokens, over the ``requests_compared`` both finished: always so in float64; in 16-bit
on a GPU the two runs batch different sequences together, the matrix products then sum in
another order, and a near-tie in a greedy argmax can flip, so there the GPU tests hold each
step's logits to FlashAttention's 2x rule instead) and ``requests_equal_fraction``, the
``device`` and the KV budget (``kv_budget_gb``), ``wall_s`` (seconds spent building the
model, warming up, and serving each side), and the whole setup.  ``--repeats N`` serves the
pair N times in turn and adds each pair's tokens/s and ratio (``repeats``,
``tokens_per_s_ratio``): a time-shared host's speed drifts, and a host-bound step shows it.

``--layers``: how many of Llama-3-8B's 32 layers the model has (default 2, which fits a small
GPU; all 32 take 16 GB of bfloat16 weights).  The engine's books (scheduling, placing each
sequence's token, sampling) are paid once a step, the model's work once a layer: the fewer
the layers, the more a step's time is books per sequence, which the paged side, running
more sequences, pays more of.  So the tokens/s ratio depends on the layer count; the GPU
record (scripts/gpu_all.sh) serves all 32, at 20 GB of KV cache.

Where the KV cache lives is part of what is measured.  Without ``--device`` the pools are
NumPy arrays on the host and the model runs on the CPU: the lesson's path, every kernel
readable.  With ``--device cuda`` the model, its weights and both memories' pools are on
the GPU (:mod:`.device`), so a step's time is the GPU's work plus one small upload of the
step's books and one download of its token ids, not copies of the cache.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..paged import _check_int, blocks_needed, kv_bytes_per_token
from .engine import Engine, check_max_seconds
from .llama import MODELS, Llama
from .device import DeviceContiguousMemory, DevicePagedMemory
from .memory import ContiguousMemory, PagedMemory
from .trace import sharegpt_like_trace

__all__ = ["serve_bench", "main", "PRESETS", "DTYPES"]

#: per model: dtype (host pools; on a GPU ``gpu_dtype``), trace scale and caps, KV slots (per layer) of the
#: fixed budget, arrival rate, step budget.  The Llama-3-8B-shaped preset's scheduler caps are vLLM's
#: defaults for its OpenAI server on a GPU of 70 GiB or more that is not an A100 (H100, H200):
#: max_num_batched_tokens 8192, max_num_seqs 1024 (``EngineArgs`` in vllm/engine/arg_utils.py; code).
#: With them the KV memory, not the sequence cap, bounds how many sequences each side runs at once,
#: which is what the paged-against-contiguous comparison measures.
PRESETS = {
    "tiny": dict(dtype=torch.float64, gpu_dtype=torch.float64, scale=1 / 8, max_prompt=96, max_new_tokens=128,
                 kv_slots=2048, rate=50.0, token_budget=256, max_seqs=256),
    "llama3-8b-shape": dict(dtype=torch.float32, gpu_dtype=torch.bfloat16, scale=1.0, max_prompt=1024,
                            max_new_tokens=1024, kv_slots=65536, rate=20.0, token_budget=8192, max_seqs=1024),
}
#: --dtype's names
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GB = 1e9


def _memories(device, backend, num_blocks, block_size, ms):
    """(paged, contiguous) memory makers: NumPy pools on the host (device None), else torch pools on ``device``."""
    if device is None:
        return (lambda: PagedMemory(num_blocks, block_size, backend=backend, **ms),
                lambda: ContiguousMemory(num_blocks * block_size, backend=backend, **ms))
    return (lambda: DevicePagedMemory(num_blocks, block_size, backend=backend, device=device, **ms),
            lambda: DeviceContiguousMemory(num_blocks * block_size, block_size=block_size, backend=backend,
                                           device=device, **ms))


def _run(model, make_memory, trace, label, preset, progress, max_seconds=None):
    """Serve ``trace`` on a fresh memory (for at most ``max_seconds`` of wall time); the memory is dropped (its
    device memory returned) before returning."""
    memory = make_memory()
    engine = Engine(model, memory, token_budget=preset["token_budget"], max_seqs=preset["max_seqs"],
                    step_time=preset.get("step_time"))
    for r in trace:
        engine.submit(r)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(trace), desc=f"serving ({label})", unit="req", leave=False, file=sys.stderr)

    def tick(done, total):
        bar.n = done
        bar.refresh()

    res = engine.run(tick if bar is not None else None, max_seconds=max_seconds)
    if bar is not None:
        bar.close()
    del engine, memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _kv_slots(kv_slots, kv_budget_gb, preset, per_token, block_size):
    if kv_slots is not None and kv_budget_gb is not None:
        raise ValueError("kv_budget_gb: give the KV budget as kv_slots or as kv_budget_gb, not both")
    if kv_budget_gb is not None:
        if not kv_budget_gb > 0:
            raise ValueError(f"kv_budget_gb: expected a number of GB > 0, got {kv_budget_gb!r}")
        kv_slots = int(kv_budget_gb * GB // per_token) // block_size * block_size
        if kv_slots < block_size:
            raise ValueError(f"kv_budget_gb: {kv_budget_gb} GB holds {kv_slots} slots of {per_token} bytes, "
                             f"less than one block of {block_size}")
    kv_slots = preset["kv_slots"] if kv_slots is None else int(kv_slots)
    if kv_slots % block_size:
        raise ValueError(f"kv_slots: {kv_slots} is not a whole number of blocks of {block_size}")
    return kv_slots


def serve_bench(model="tiny", backend=None, requests=64, *, seed=0, block_size=16, kv_slots=None,
                kv_budget_gb=None, layers=2, device=None, dtype=None, max_seconds=None, progress=False,
                rows_granule=None, repeats=1, **overrides) -> dict:
    """Serve one trace twice, paged and contiguous, at the same KV memory; the JSON's dict.

    ``device`` None keeps the KV pools in NumPy on the host and the model on the CPU (the
    lesson's path; ``backend`` "tiled" by default); a torch device ("cpu", "cuda") puts the
    model and torch pools there (:mod:`.device`; ``backend`` "torch" by default, or
    "cupy").  The KV budget is ``kv_slots`` per layer or ``kv_budget_gb`` (10^9 bytes, K and
    V of every layer), else the preset's.  ``dtype`` (a name of :data:`DTYPES`) replaces the
    preset's.  ``overrides`` replace the model's :data:`PRESETS` entries (``rate``,
    ``token_budget``, ...); ``step_time`` (seconds) makes the clock advance by that much a
    step instead of by the step's wall time, so arrivals, and the whole schedule, no longer
    depend on speed.  On a device a short warm-up run of each memory comes first, untimed.
    ``max_seconds`` limits each side's run to about that much wall time (the step that
    crosses it is the last); a side cut short says ``complete: false``, and the tokens are
    compared over the requests both sides finished (``requests_compared``).
    ``rows_granule`` replaces the model's :attr:`Llama.rows_granule` (a device memory's rows of
    a step padded to a multiple of it; the padded rows reach neither cache nor output).
    ``repeats`` > 1 serves the pair (paged, then contiguous) that many times in turn, so a
    drift in the machine's speed reaches both sides alike; ``paged``, ``contiguous`` and the
    token comparison are the first pair's, and ``repeats`` lists every pair's tokens/s and
    their ratio (``tokens_per_s_ratio``: each pair's, and their median, min and max).
    """
    check_max_seconds(max_seconds)
    repeats = _check_int(repeats, "repeats", 1)
    rows_granule = None if rows_granule is None else _check_int(rows_granule, "rows_granule", 1)
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    preset = dict(PRESETS[model], **overrides)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    torch_dtype = DTYPES[dtype] if dtype is not None else preset["gpu_dtype" if on_gpu else "dtype"]
    backend = backend or ("tiled" if device is None else "torch")
    shape = MODELS[model]() if model == "tiny" else MODELS[model](layers)
    per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim,
                                   torch.tensor([], dtype=torch_dtype).element_size())
    kv_slots = _kv_slots(kv_slots, kv_budget_gb, preset, per_token, block_size)
    wall, t0 = {}, time.perf_counter()
    llama = Llama(shape, seed=seed, dtype=torch_dtype, device=device or "cpu")
    if rows_granule is not None:
        llama.rows_granule = rows_granule
    wall["model"] = time.perf_counter() - t0
    trace = sharegpt_like_trace(requests, seed=seed, vocab=shape.vocab, scale=preset["scale"],
                                max_prompt=preset["max_prompt"], max_new_tokens=preset["max_new_tokens"],
                                rate=preset["rate"])
    make_paged, make_contiguous = _memories(device, backend, kv_slots // block_size, block_size,
                                            llama.memory_shape())
    if device is not None:                            # compile and allocate once, outside the timed runs
        warm = [replace(r, arrival=0.0, max_new_tokens=2, stop_after=None) for r in trace[:2]]
        need = sum(r.n * blocks_needed(r.max_len, block_size) for r in warm)
        small = _memories(device, backend, need, block_size, llama.memory_shape())
        t0 = time.perf_counter()
        for make in small:
            _run(llama, make, warm, "warm-up", preset, False)
        wall["warm_up"] = time.perf_counter() - t0
    pairs = []
    wall.update(paged=0.0, contiguous=0.0)
    for _ in range(repeats):                     # in turn: a drift in the machine's speed reaches both sides
        pair = {}
        for side, make in (("paged", make_paged), ("contiguous", make_contiguous)):
            t0 = time.perf_counter()
            pair[side] = _run(llama, make, trace, side, preset, progress, max_seconds)
            wall[side] += time.perf_counter() - t0
        pairs.append(pair)
    paged, contiguous = pairs[0]["paged"], pairs[0]["contiguous"]
    kv_bytes = kv_slots * per_token
    both = [r.rid for r in trace if r.rid in paged.outputs and r.rid in contiguous.outputs]
    same = [paged.outputs[rid] == contiguous.outputs[rid] for rid in both]
    out = {"paged": paged.summary(), "contiguous": contiguous.summary(),
           "tokens_equal": all(same), "requests_compared": len(both),
           "requests_equal_fraction": sum(same) / len(same) if same else 0.0,
           "device": str(torch.device(device)) if device is not None else "cpu (NumPy pools)",
           "kv_budget_gb": kv_bytes / GB, "wall_s": wall,
           "setup": dict(model=shape.name, backend=backend, requests=requests, seed=seed, kv_slots=kv_slots,
                         kv_bytes=kv_bytes, block_size=block_size, dtype=str(torch_dtype).replace("torch.", ""),
                         device=str(torch.device(device)) if device is not None else None,
                         pools="numpy" if device is None else "torch",
                         gpu=torch.cuda.get_device_name() if on_gpu else None,
                         trace="ShareGPT-like (Kwon et al., SOSP 2023, Fig. 11 means)",
                         scale=preset["scale"], max_new_tokens=preset["max_new_tokens"], rate=preset["rate"],
                         step_time=preset.get("step_time"), max_seconds=max_seconds,
                         rows_granule=llama.rows_granule, repeats=repeats)}
    if repeats > 1:
        out["repeats"] = [_pair_summary(p["paged"].summary(), p["contiguous"].summary()) for p in pairs]
        ratios = [r["ratio"] for r in out["repeats"] if r["ratio"] is not None]
        if ratios:
            out["tokens_per_s_ratio"] = dict(each=ratios, median=float(np.median(ratios)), min=min(ratios),
                                             max=max(ratios))
    return out


def _pair_summary(paged: dict, contiguous: dict) -> dict:
    """One pair of a repeated run: each side's tokens/s and step phases (medians, ms), and the ratio."""
    def side(s):
        return dict(tokens_per_s=s["tokens_per_s"], finished=s["finished"], max_concurrent=s["max_concurrent"],
                    phase_median_ms={k: v["median"] for k, v in s["phase_ms"].items()})
    return dict(paged=side(paged), contiguous=side(contiguous),
                ratio=paged["tokens_per_s"] / contiguous["tokens_per_s"] if contiguous["tokens_per_s"] else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m iokernels serve-bench",
                                description="Serve a ShareGPT-like trace paged and contiguous at the same KV memory. "
                                "Exit status 1 when the two runs' tokens differ in float64 (where they must agree; "
                                "in lower precisions a different batch may round differently, and the JSON says "
                                "how many requests agree).")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--backend", default=None, help="attention backend (default: tiled, NumPy; with --device: torch; "
                   "cupy: the CuPy paged decode for a step's decodes, the paged prefill for its longer chunks)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-slots", type=int, default=None, help="KV slots per layer of the budget (default: the "
                   "model's preset)")
    p.add_argument("--kv-budget-gb", type=float, default=None, help="the KV budget in GB (10^9 bytes, K and V of "
                   "every layer) instead of --kv-slots")
    p.add_argument("--layers", type=int, default=2, help="layers of the llama3-8b-shape model (default 2)")
    p.add_argument("--device", default=None, help="put the model and torch KV pools on this torch device (cpu, "
                   "cuda); default: NumPy pools on the host")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the model's and the cache's dtype "
                   "(default: the preset's; on a GPU llama3-8b-shape runs in bfloat16)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: the model's preset)")
    p.add_argument("--step-time", type=float, default=None, help="advance the clock this many seconds a step "
                   "(a schedule that does not depend on speed); default: each step's wall time")
    p.add_argument("--max-seconds", type=float, default=None, help="stop each side after about this many "
                   "seconds of wall time (its summary then says complete: false; tokens are compared over the "
                   "requests both sides finished)")
    p.add_argument("--rows-granule", type=int, default=None, help="pad a device step's model rows to a multiple "
                   "of this (default: the model's, 1: no padding)")
    p.add_argument("--repeats", type=int, default=1, help="serve the pair (paged, then contiguous) this many "
                   "times in turn; the JSON lists each pair's tokens/s and their ratio (default 1)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.requests < 1:
        p.error("--requests: expected at least 1")
    extra = {k: v for k, v in (("rate", a.rate), ("step_time", a.step_time)) if v is not None}
    try:
        out = serve_bench(a.model, a.backend, a.requests, seed=a.seed, block_size=a.block_size,
                          kv_slots=a.kv_slots, kv_budget_gb=a.kv_budget_gb, layers=a.layers, device=a.device,
                          dtype=a.dtype, max_seconds=a.max_seconds, progress=not a.quiet,
                          rows_granule=a.rows_granule, repeats=a.repeats, **extra)
    except ValueError as e:
        p.error(str(e))
    text = json.dumps(out, indent=2)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0 if out["tokens_equal"] or out["setup"]["dtype"] != "float64" else 1
