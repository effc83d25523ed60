"""``python -m iokernels serve-bench``: paged against contiguous at the same KV memory.

PagedAttention's argument (Kwon et al., SOSP 2023, paper), measured: with the same bytes
of KV cache, a server that reserves each request's maximum length up front holds few
sequences, most of whose reservation is never written; a paged server holds many more,
and decode, which is memory-bound, turns a larger batch into more tokens per second.

Both runs serve the same seeded ShareGPT-like trace (:mod:`.trace`) with the same model
and scheduler; only the memory differs.  Reported per side: ``max_concurrent`` (running
sequences), ``tokens_per_s`` (output tokens over the busy time), ``waste_fraction``
(allocated KV slots not holding a token, over the run), ``p50_ms`` / ``p99_ms`` (time per
output token), and ``tokens_equal``: whether both produced the same tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..paged import kv_bytes_per_token
from .engine import Engine
from .llama import MODELS, Llama
from .memory import ContiguousMemory, PagedMemory
from .trace import sharegpt_like_trace

__all__ = ["serve_bench", "main", "PRESETS"]

#: per model: dtype, trace scale and caps, KV slots (per layer) of the fixed budget, arrival rate
PRESETS = {
    "tiny": dict(dtype=torch.float64, scale=1 / 8, max_prompt=96, max_new_tokens=128, kv_slots=2048, rate=50.0,
                 token_budget=256, max_seqs=256),
    "llama3-8b-shape": dict(dtype=torch.float32, scale=1.0, max_prompt=1024, max_new_tokens=1024,
                            kv_slots=65536, rate=20.0, token_budget=2048, max_seqs=256),
}


def _run(model, memory, trace, label, preset, progress):
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

    res = engine.run(tick if bar is not None else None)
    if bar is not None:
        bar.close()
    return res


def serve_bench(model="tiny", backend="tiled", requests=64, *, seed=0, block_size=16, kv_slots=None,
                layers=2, progress=False, **overrides) -> dict:
    """Serve one trace twice, paged and contiguous, at the same KV memory; the JSON's dict.

    ``overrides`` replace the model's :data:`PRESETS` entries (``rate``, ``token_budget``,
    ...); ``step_time`` (seconds) makes the clock advance by that much a step instead of by
    the step's wall time, so arrivals, and the whole schedule, no longer depend on speed.
    """
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    preset = dict(PRESETS[model], **overrides)
    kv_slots = preset["kv_slots"] if kv_slots is None else int(kv_slots)
    if kv_slots % block_size:
        raise ValueError(f"kv_slots: {kv_slots} is not a whole number of blocks of {block_size}")
    shape = MODELS[model]() if model == "tiny" else MODELS[model](layers)
    llama = Llama(shape, seed=seed, dtype=preset["dtype"])
    trace = sharegpt_like_trace(requests, seed=seed, vocab=shape.vocab, scale=preset["scale"],
                                max_prompt=preset["max_prompt"], max_new_tokens=preset["max_new_tokens"],
                                rate=preset["rate"])
    ms = llama.memory_shape()
    paged = _run(llama, PagedMemory(kv_slots // block_size, block_size, backend=backend, **ms), trace,
                 "paged", preset, progress)
    contiguous = _run(llama, ContiguousMemory(kv_slots, backend=backend, **ms), trace, "contiguous", preset,
                      progress)
    itemsize = torch.tensor([], dtype=preset["dtype"]).element_size()
    kv_bytes = kv_slots * kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)
    return {"paged": paged.summary(), "contiguous": contiguous.summary(),
            "tokens_equal": paged.outputs == contiguous.outputs,
            "setup": dict(model=shape.name, backend=backend, requests=requests, seed=seed, kv_slots=kv_slots,
                          kv_bytes=kv_bytes, block_size=block_size, dtype=str(preset["dtype"]).replace("torch.", ""),
                          trace="ShareGPT-like (Kwon et al., SOSP 2023, Fig. 11 means)",
                          scale=preset["scale"], max_new_tokens=preset["max_new_tokens"], rate=preset["rate"],
                          step_time=preset.get("step_time"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m iokernels serve-bench",
                                description="Serve a ShareGPT-like trace paged and contiguous at the same KV memory.")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--backend", default="tiled", help="attention backend (default: tiled, NumPy)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-slots", type=int, default=None, help="KV slots per layer of the budget (default: the "
                   "model's preset)")
    p.add_argument("--layers", type=int, default=2, help="layers of the llama3-8b-shape model (default 2)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: the model's preset)")
    p.add_argument("--step-time", type=float, default=None, help="advance the clock this many seconds a step "
                   "(a schedule that does not depend on speed); default: each step's wall time")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.requests < 1:
        p.error("--requests: expected at least 1")
    extra = {k: v for k, v in (("rate", a.rate), ("step_time", a.step_time)) if v is not None}
    out = serve_bench(a.model, a.backend, a.requests, seed=a.seed, block_size=a.block_size, kv_slots=a.kv_slots,
                      layers=a.layers, progress=not a.quiet, **extra)
    text = json.dumps(out, indent=2)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0 if out["tokens_equal"] else 1
