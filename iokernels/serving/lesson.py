"""What notebook 14 ("Serving: why paging pays") computes: small traces, step tables, sweeps, models.

Everything here runs on a CPU: the scheduling experiments use the checksum
model (:mod:`.fake`), whose tokens depend on every cached token, so each run still proves
that paging changed nothing but the memory; :func:`paged_vs_contiguous` runs the tiny Llama.
"""
from __future__ import annotations

import json
import re

import numpy as np

from ..core.roofline import GPUS, TB
from ..core.recorded import RESULTS_DIR as _RESULTS_DIR
from ..paged import kv_bytes_per_token
from .bench import serve_bench
from .engine import Engine
from .fake import ChecksumModel
from .llama import LLAMA3_8B, LlamaShape, llama3_8b_shape
from .memory import ContiguousMemory, PagedMemory
from .requests import Request
from .trace import sharegpt_like_trace

__all__ = ["small_trace", "run_small", "step_rows", "block_table_history", "block_size_sweep",
           "weights", "decode_throughput", "paged_vs_contiguous", "recorded_serving", "serving_summary",
           "modelled_serving", "compute_bound_batch", "datasheet_gpu"]

#: where recorded benchmark results live: a checkout's benchmarks/results, or an installed
#: wheel's copy of it (the same folder iokernels.core.recorded reads)
RESULTS = _RESULTS_DIR


def small_trace():
    """Six requests: two share a system prompt, one asks for two samples, arrivals spread out."""
    system = [7, 7, 1, 2, 3, 4, 5, 6]
    return [Request("A", system + [10, 11], 6, arrival=0.0),
            Request("B", [20, 21, 22], 9, arrival=0.0),
            Request("C", system + [12], 5, n=2, temperature=1.0, arrival=1.0),
            Request("D", list(range(30, 48)), 4, arrival=2.0),
            Request("E", [50], 7, arrival=3.0),
            Request("F", [59, 60, 61, 62, 63], 3, arrival=3.0)]


def _engine(memory, token_budget, check=None):
    return Engine(ChecksumModel(), memory, token_budget=token_budget, step_time=1.0, check=check)


def _fake_paged(num_blocks, block_size):
    return PagedMemory(num_blocks, block_size, layers=1, kv_heads=1, head_dim=2)


def run_small(trace=None, num_blocks=12, block_size=4, token_budget=12, check=None):
    """Serve ``trace`` (default :func:`small_trace`) on a small paged memory: (engine, results)."""
    engine = _engine(_fake_paged(num_blocks, block_size), token_budget, check)
    for r in small_trace() if trace is None else trace:
        engine.submit(r)
    return engine, engine.run()


def step_rows(results, limit=None):
    """One row per step: its time, the batch as rid/sample:tokens, running sequences, free blocks, preemptions."""
    rows = []
    for s in results.steps[:limit]:
        rows.append(dict(step=s.step, batch=" ".join(f"{r}{k}:{c}" for r, k, c in s.batch), running=s.running,
                         free_blocks=s.free_blocks, preempted=", ".join(str(p["victim"]) for p in s.preempted)))
    return rows


def block_table_history(trace=None, num_blocks=12, block_size=4, token_budget=12):
    """Every step's block tables, {"rid/sample": [physical blocks]}, and the results."""
    history = []

    def record(engine):
        cache = engine.memory.caches[0]
        tables = {}
        for g in engine.running:
            for s in g.live:
                if s.handle is not None:
                    tables[f"{g.request.rid}/{s.sample}"] = cache.block_table(s.handle)
        history.append(tables)

    _, res = run_small(trace, num_blocks, block_size, token_budget, check=record)
    return history, res


def block_size_sweep(block_sizes=(1, 2, 4, 8, 16, 32, 64), *, slots=1024, requests=200, seed=0, scale=1 / 16,
                     max_new_tokens=64, token_budget=128):
    """Max concurrent sequences and waste, paged at each block size and contiguous, one memory size.

    The trace is :func:`~.trace.sharegpt_like_trace` scaled by ``scale``, all arrived at
    once (so memory, not arrivals, limits the batch); the model is the checksum model.
    """
    trace = sharegpt_like_trace(requests, seed=seed, vocab=64, scale=scale, max_prompt=64,
                                max_new_tokens=max_new_tokens, rate=1e9)
    rows = []
    for bs in block_sizes:
        engine = _engine(_fake_paged(slots // bs, bs), token_budget)
        for r in trace:
            engine.submit(r)
        res = engine.run()
        rows.append(dict(memory=f"paged, block {bs}", block_size=bs, **_pick(res.summary())))
    engine = _engine(ContiguousMemory(slots, layers=1, kv_heads=1, head_dim=2), token_budget)
    for r in trace:
        engine.submit(r)
    rows.append(dict(memory="contiguous (max length reserved)", block_size=None, **_pick(engine.run().summary())))
    return rows


def _pick(summary):
    return {k: summary[k] for k in ("max_concurrent", "waste_fraction", "steps", "preemptions")}


def weights(shape: LlamaShape = LLAMA3_8B) -> dict:
    """Weights of a Llama shape: those every decode step reads (the layers and the output head) and the embedding."""
    s = shape
    per_layer = (2 * s.dim * s.heads * s.head_dim + 2 * s.dim * s.kv_heads * s.head_dim + 3 * s.dim * s.ffn_dim
                 + 2 * s.dim)
    read = s.layers * per_layer + s.dim + s.vocab * s.dim
    return dict(read_per_step=read, embedding=s.vocab * s.dim, total=read + s.vocab * s.dim)


def decode_throughput(batches, *, context=1024, shape: LlamaShape = LLAMA3_8B, gpu="H200", itemsize=2):
    """A roofline model of decode: tokens/s at each batch size, with the time's two bounds.

    One step reads every weight once, whatever the batch, plus each sequence's KV cache
    (``context`` tokens); it does 2 FLOP per weight per sequence plus the attention's
    4 * layers * heads * d * context per sequence.  time = max(bytes / bandwidth, FLOP /
    peak) with the GPU's datasheet figures (:data:`iokernels.core.roofline.GPUS`): a model,
    not a measurement.  Returns arrays: batch, tokens_per_s, memory_s, compute_s, kv_fraction
    (the KV cache's share of the bytes).
    """
    b = np.asarray(batches, dtype=np.float64)
    g = GPUS[gpu]
    w = weights(shape)["read_per_step"]
    kv = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)
    bytes_ = w * itemsize + b * context * kv
    flops = b * (2 * w + 4 * shape.layers * shape.heads * shape.head_dim * context)
    mem_s, comp_s = bytes_ / (g["hbm_tbps"] * TB), flops / (g["fp16_tflops"] * 1e12)
    return dict(batch=b, tokens_per_s=b / np.maximum(mem_s, comp_s), memory_s=mem_s, compute_s=comp_s,
                kv_fraction=b * context * kv / bytes_)


def paged_vs_contiguous(requests=12, kv_slots=512, seed=0):
    """:func:`~.bench.serve_bench` with the tiny Llama on the CPU, small enough for a notebook."""
    return serve_bench("tiny", "tiled", requests, seed=seed, kv_slots=kv_slots, step_time=0.01)


def serving_summary(rec: dict) -> dict:
    """The numbers of one serve-bench result a reader compares: the GPU and attention backend,
    per side the concurrency, tokens/s and waste, and their ratios (paged / contiguous); for a
    run served as several pairs in turn (``--repeats``), the tokens/s ratio's median, min and
    max over the pairs too, and the model's row padding where the run set it."""
    setup, p, c = rec.get("setup", {}), rec["paged"], rec["contiguous"]

    def side(r):
        return dict(max_concurrent=r["max_concurrent"], tokens_per_s=round(r["tokens_per_s"], 1),
                    waste_fraction=round(r["waste_fraction"], 3))

    def ratio(k):
        return round(p[k] / c[k], 2) if c[k] else None
    out = dict(gpu=setup.get("gpu"), model=setup.get("model"), backend=setup.get("backend"),
               dtype=setup.get("dtype"), paged=side(p), contiguous=side(c),
               concurrency_ratio=ratio("max_concurrent"), tokens_per_s_ratio=ratio("tokens_per_s"),
               tokens_equal=rec.get("tokens_equal"))
    spread = rec.get("tokens_per_s_ratio")
    if spread:
        out["tokens_per_s_ratio_over_pairs"] = dict(pairs=len(spread["each"]),
                                                    **{k: round(spread[k], 2) for k in ("median", "min", "max")})
    if setup.get("rows_granule", 1) != 1:
        out["rows_granule"] = setup["rows_granule"]
    return out


def recorded_serving():
    """The recorded serve-bench results in benchmarks/results (serve_bench*.json): {file name: result}."""
    if not RESULTS.is_dir():
        return {}
    return {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob("serve_bench*.json"))}


def compute_bound_batch(gpu="H200", itemsize=2) -> float:
    """The decode batch past which a step's matrix products take longer than reading the weights,
    on the GPU's datasheet figures: each weight is read once a step (``itemsize`` bytes) and does
    2 FLOP per sequence, so the two times are equal at peak FLOP/s x itemsize / (2 x bytes/s)
    sequences (the KV cache's bytes left out: they move the point further out)."""
    g = GPUS[gpu]
    return g["fp16_tflops"] * 1e12 * itemsize / (2 * g["hbm_tbps"] * TB)


#: the datasheet entry (:data:`iokernels.core.roofline.GPUS`) of a recorded GPU, by a word of its
#: name, first match: an "H100 80GB HBM3" is the SXM card (the PCIe card has HBM2e)
DATASHEET_GPU = (("H200", "H200"), ("H100 PCIe", "H100 PCIe"), ("H100", "H100 SXM"))


def datasheet_gpu(name: str | None) -> str | None:
    """The :data:`~iokernels.core.roofline.GPUS` key of a GPU's name as a record holds it, or None."""
    return next((key for word, key in DATASHEET_GPU if word in (name or "")), None)


def modelled_serving(rec: dict, scales=(0.5, 1.0, 2.0), budgets=(0.25, 0.5, 1.0, 2.0)) -> dict | None:
    """What :func:`decode_throughput`, the roofline model, says of a recorded serve-bench run,
    beside what the run measured; None where the record's GPU has no datasheet entry.

    Each side is modelled as a decode step at its largest batch (``max_concurrent``), each
    sequence holding ``context`` tokens: the slots the run kept written, kv_slots x (1 -
    waste_fraction), over that batch.  The waste is averaged over the run's steps and the batch
    is its largest, so the context is an estimate; the model's ratio is also given at the
    context times each of ``scales``, and at the KV budget times each of ``budgets`` (both
    batches scaled with it, the contexts kept).  The model's layers are the record's (its
    ``model`` names them).

    Returns: the GPU's datasheet key and the layers; per side the batch, the context, the
    modelled tokens/s and what bounds it ("memory" or "compute"), the measured tokens/s and
    the fraction of the modelled figure it reached; the modelled tokens/s ratio (paged /
    contiguous) at each scale of the context and of the budget; the measured ratio (the median
    over the pairs of a repeated run).
    """
    setup = rec.get("setup", {})
    gpu = datasheet_gpu(setup.get("gpu"))
    if gpu is None:
        return None
    layers = re.search(r"\((\d+) layers\)", setup.get("model", ""))
    shape = llama3_8b_shape(int(layers.group(1))) if layers else LLAMA3_8B
    names = ("paged", "contiguous")
    batch = {n: rec[n]["max_concurrent"] for n in names}
    context = {n: setup["kv_slots"] * (1.0 - rec[n]["waste_fraction"]) / batch[n] for n in names}

    def model(name, batch_scale=1.0, context_scale=1.0):
        m = decode_throughput([batch[name] * batch_scale], context=context[name] * context_scale, shape=shape,
                              gpu=gpu)
        return float(m["tokens_per_s"][0]), "compute" if m["compute_s"][0] > m["memory_s"][0] else "memory"

    sides = {}
    for n in names:
        tps, bound = model(n)
        sides[n] = dict(batch=batch[n], context=round(context[n], 1), modelled_tokens_per_s=round(tps, 1),
                        bound=bound, measured_tokens_per_s=round(rec[n]["tokens_per_s"], 1),
                        fraction_of_modelled=round(rec[n]["tokens_per_s"] / tps, 3))

    def ratio(**kw):
        return round(model("paged", **kw)[0] / model("contiguous", **kw)[0], 2)
    measured = rec.get("tokens_per_s_ratio", {}).get("median",
                                                      rec["paged"]["tokens_per_s"] / rec["contiguous"]["tokens_per_s"])
    return dict(gpu=gpu, layers=shape.layers, **sides,
                modelled_ratio={s: ratio(context_scale=s) for s in scales},
                modelled_ratio_by_budget={b: ratio(batch_scale=b) for b in budgets},
                measured_ratio=round(measured, 2))
