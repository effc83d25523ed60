"""Decode for real models: KV bytes per token and decode intensity for MHA, GQA, MQA and MLA.

A decode step reads every sequence's whole KV cache to produce one token per sequence.
How many bytes that is, and how many FLOPs each byte feeds, is fixed by the model's
attention shape, so this module starts from real configurations (each with where it
comes from) and places them on the roofline of :mod:`iokernels.core.roofline`'s GPU table:

* MHA (Llama-2-7B): every query head has its own K and V head: g = 1 query head per
  cached row, about 1 FLOP per byte at 16 bits.
* GQA (Llama-3-8B, -70B; Mistral-7B): g = 4 or 8 query heads share a KV head: about g
  FLOP/byte, 25-50x below an H200's ridge (about 206: 206 / 8 ~ 26, 206 / 4 ~ 52):
  memory-bound, and the time per token is the cache's bytes over the bandwidth.
* MQA (Falcon-7B): one KV head for all 71 query heads: g = 71.
* MLA (DeepSeek-V3, :mod:`iokernels.mla`): one 576-value latent row per token serves all
  128 heads as key (576 wide) and value (its first 512): 2 * 128 * (576 + 512) FLOPs per
  1,152 bytes, about 242 FLOP/byte: past the H200's ridge (about 206), so decode moves to
  the compute roof there, but short of the H100 SXM's (about 295; the H800 has the same
  compute and bandwidth) and the B200's (about 292), where it stays memory-bound
  (:func:`ridge_table`; datasheet figures in :mod:`iokernels.core.roofline`).

Notation
========

==========  ===============================================================
L           layers
Hq, Hkv     query heads, KV heads; g = Hq / Hkv query heads per cached row
d           head dim
d_c, d_R    MLA's latent and rotary widths (one row of d_c + d_R per token per layer)
W           a sliding window: the cache holds at most W tokens (a rolling buffer)
t           query tokens per step (1; more with speculative decoding)
==========  ===============================================================

Counts per layer and token of context: MHA/GQA/MQA cache 2 Hkv d values and do
4 Hq d t FLOPs over them (q K^T and P V); absorbed MLA caches d_c + d_R values and does
2 Hq (2 d_c + d_R) t FLOPs.  Bytes are values times the cache's bytes per value.

Frank notes
-----------
* Intensity here counts only the attention over the cache (the few bytes of q and o,
  and the weights, which a batch shares, are left out), so it is the intensity of the
  cache read, the part that grows with context and batch.
* The bounds are bounds: a real decode step also reads the weights and runs the MLPs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core import roofline as rl

__all__ = ["ModelShape", "MODELS", "kv_values_per_token", "kv_bytes_per_token", "decode_step", "model_table",
           "roofline_placement", "ridge_table", "roofline_points", "kv_quant_accuracy", "mla_comparison",
           "window_traffic", "recorded_mla_rows", "recorded_mla_data", "recorded_cache_data", "DEFAULT_GPU",
           "RIDGE_GPUS"]

#: the GPU the chapter places models on (datasheet row of the roofline table)
DEFAULT_GPU = "H200"
#: the GPUs whose ridges the chapter compares: MLA decode crosses the middle one only
RIDGE_GPUS = ("H100 SXM", "H200", "B200")
#: the points the roofline adds to the models' own: (bytes per value, model, query tokens)
ROOFLINE_EXTRA = ((1, "Llama-3-8B", 1), (1, "DeepSeek-V3", 2))


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of one model, and where the numbers come from."""

    name: str
    kind: str                 # "MHA", "GQA", "MQA" or "MLA"
    layers: int
    heads_q: int
    heads_kv: int             # MLA: 1 (the latent row is shared by all heads)
    head_dim: int             # MLA: the per-head key width without the rotary part
    source: str
    latent_dim: int = 0       # MLA only
    rope_dim: int = 0         # MLA only
    v_head_dim: int = 0       # MLA only
    window: int | None = None  # sliding window (tokens), None: full attention

    @property
    def group(self) -> int:
        """Query heads served by one cached row: g = Hq / Hkv (MLA: all Hq)."""
        return self.heads_q // self.heads_kv


#: Real configurations.  Each ``source`` names the paper or model card and the released
#: config.json fields the numbers are read from.
MODELS = {m.name: m for m in (
    ModelShape("Llama-2-7B", "MHA", layers=32, heads_q=32, heads_kv=32, head_dim=128,
               source="Touvron et al., Llama 2 (2023); meta-llama/Llama-2-7b-hf config.json "
                      "(num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 32, hidden 4096)"),
    ModelShape("Llama-3-8B", "GQA", layers=32, heads_q=32, heads_kv=8, head_dim=128,
               source="Meta, Llama 3 model card (2024); meta-llama/Meta-Llama-3-8B config.json "
                      "(32 layers, 32 heads, num_key_value_heads 8, hidden 4096)"),
    ModelShape("Llama-3-70B", "GQA", layers=80, heads_q=64, heads_kv=8, head_dim=128,
               source="Meta, Llama 3 model card (2024); meta-llama/Meta-Llama-3-70B config.json "
                      "(80 layers, 64 heads, num_key_value_heads 8, hidden 8192)"),
    ModelShape("Mistral-7B", "GQA", layers=32, heads_q=32, heads_kv=8, head_dim=128, window=4096,
               source="Jiang et al., Mistral 7B (2023): sliding-window attention, W = 4096, rolling "
                      "buffer cache; mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096)"),
    ModelShape("Falcon-7B", "MQA", layers=32, heads_q=71, heads_kv=1, head_dim=64,
               source="Almazrouei et al., The Falcon Series of Open Language Models (2023); "
                      "tiiuae/falcon-7b config.json (multi_query, 71 heads, hidden 4544, 32 layers)"),
    ModelShape("DeepSeek-V3", "MLA", layers=61, heads_q=128, heads_kv=1, head_dim=128, latent_dim=512,
               rope_dim=64, v_head_dim=128,
               source="DeepSeek-AI, DeepSeek-V3 Technical Report (2024); deepseek-ai/DeepSeek-V3 config.json "
                      "(61 layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, "
                      "v_head_dim 128)"),
)}


def _model(model) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(map(repr, MODELS))} or a ModelShape; got {model!r}")
    return MODELS[model]


def kv_values_per_token(model) -> int:
    """Values one token adds to one layer's cache: 2 Hkv d (K and V), or d_c + d_R for MLA."""
    m = _model(model)
    return m.latent_dim + m.rope_dim if m.kind == "MLA" else 2 * m.heads_kv * m.head_dim


def kv_bytes_per_token(model, itemsize=2) -> int:
    """Cache bytes per token, all layers: 0.5 MiB for Llama-2-7B, 128 KiB for Llama-3-8B at 16 bits."""
    m = _model(model)
    return m.layers * kv_values_per_token(m) * itemsize


def decode_step(model, context, batch=1, itemsize=2, query_tokens=1) -> dict:
    """FLOPs and cache bytes of one decode step's attention, all layers, and their ratio.

    ``context`` tokens per sequence (a sliding window caps what is read at W); returns
    dict(flops, bytes, intensity, cached_tokens).  Intensity is independent of context and
    batch: both scale FLOPs and bytes alike.
    """
    m = _model(model)
    n = context if m.window is None else min(context, m.window)
    if m.kind == "MLA":
        per_token = 2 * m.heads_q * (2 * m.latent_dim + m.rope_dim)       # score (d_c + d_R) + values (d_c)
    else:
        per_token = 4 * m.heads_q * m.head_dim                            # q K^T and P V
    flops = batch * n * m.layers * per_token * query_tokens
    nbytes = batch * n * kv_bytes_per_token(m, itemsize)
    return dict(flops=flops, bytes=nbytes, intensity=flops / nbytes, cached_tokens=n)


def roofline_placement(models=None, gpu=DEFAULT_GPU, itemsize=2, query_tokens=1) -> list[dict]:
    """Each model's decode intensity against ``gpu``'s ridge: bound, and the fraction of peak
    FLOP/s the cache read can feed (min(1, intensity / ridge))."""
    ridge = rl.ridge_point(gpu, "bf16")
    rows = []
    for name in models or MODELS:
        m = _model(name)
        step = decode_step(m, 1, itemsize=itemsize, query_tokens=query_tokens)
        rows.append(dict(model=m.name, kind=m.kind, group=m.group, intensity=step["intensity"], ridge=ridge,
                         bound="memory" if step["intensity"] < ridge else "compute",
                         peak_fraction=min(1.0, step["intensity"] / ridge)))
    return rows


def model_table(context=32768, gpu=DEFAULT_GPU, itemsize=2) -> list[dict]:
    """One row per model: shape, KV bytes per token, one sequence's cache at ``context``, the
    intensity, and the time bound of reading that cache once on ``gpu`` (bytes / bandwidth)."""
    bw = rl.get_gpu(gpu)["hbm_tbps"] * rl.TB
    rows = []
    for m in MODELS.values():
        step = decode_step(m, context, itemsize=itemsize)
        rows.append(dict(model=m.name, kind=m.kind, layers=m.layers, heads_q=m.heads_q, heads_kv=m.heads_kv,
                         values_per_layer=kv_values_per_token(m), bytes_per_token=kv_bytes_per_token(m, itemsize),
                         cache_bytes=step["bytes"], cached_tokens=step["cached_tokens"],
                         intensity=step["intensity"], read_s=step["bytes"] / bw, source=m.source))
    return rows


def ridge_table(models=None, gpus=RIDGE_GPUS, itemsize=2, query_tokens=1) -> list[dict]:
    """Each model's decode intensity against several GPUs' ridges (bf16 datasheet figures).

    One row per model: model, kind, group, intensity, and ``by_gpu`` {gpu: dict(ridge, bound,
    peak_fraction)}.  DeepSeek-V3's MLA (about 242 FLOP/byte) is compute-bound on an H200
    only: the H100 SXM's ridge (about 295) and the B200's (about 292) lie past it.
    """
    per_gpu = {g: roofline_placement(models, gpu=g, itemsize=itemsize, query_tokens=query_tokens) for g in gpus}
    rows = []
    for i, r in enumerate(per_gpu[gpus[0]]):
        rows.append(dict(model=r["model"], kind=r["kind"], group=r["group"], intensity=r["intensity"],
                         by_gpu={g: {k: per_gpu[g][i][k] for k in ("ridge", "bound", "peak_fraction")}
                                 for g in gpus}))
    return rows


def roofline_points(itemsize=2, extra=ROOFLINE_EXTRA) -> list[dict]:
    """The points a decode roofline shows, models with equal intensity joined into one.

    One dict per distinct (intensity, kind): intensity, kind, names (the models there, each
    with its variant, e.g. "Llama-3-8B, 1-byte cache"), variant (None for the plain
    ``itemsize`` cache and one query token).  ``extra``: (bytes per value, model, query
    tokens) variants to add, e.g. a 1-byte cache or two query tokens per step.
    """
    points = {}
    for size, name, t in [(itemsize, n, 1) for n in MODELS] + list(extra):
        m = _model(name)
        i = decode_step(m, 1, itemsize=size, query_tokens=t)["intensity"]
        variant = None if (size, t) == (itemsize, 1) else ", ".join(
            x for x in (f"{size}-byte cache" if size != itemsize else "",
                        f"{t} query tokens" if t != 1 else "") if x)
        label = m.name if variant is None else f"{m.name} ({variant})"
        key = (round(i, 9), m.kind, variant is None)
        p = points.setdefault(key, dict(intensity=i, kind=m.kind, names=[], variant=variant))
        p["names"].append(label)
    return sorted(points.values(), key=lambda p: p["intensity"])


# --------------------------------------------------------------------------- quantized caches
#: the caches :func:`kv_quant_accuracy` compares: (label, cache dtype, kv_dtype)
QUANT_CASES = (("float32", "float32", None), ("bfloat16", "bfloat16", None),
               ("float8_e4m3fn", "float32", "float8_e4m3fn"), ("int8", "float32", "int8"))


def kv_quant_accuracy(rng, lengths=(16, 64, 256, 1024), heads_q=8, heads_kv=2, head_dim=64, block_size=16,
                      cases=QUANT_CASES) -> list[dict]:
    """Paged decode over each cache kind against the float64 oracle of the exact inputs, per N.

    Fresh float32 inputs for every length; each cache holds them in its own format (a
    bfloat16 cache rounds q too).  Per row: N, the cache, max |O - O_64| and |LSE - LSE_64|,
    the stated bound of :func:`iokernels.decode.perturbed_decode_error_bound` for the
    1-byte caches (None otherwise), and the cache's bytes per token.
    """
    from .core import reference, testing
    from .decode import paged_decode_split_kv, perturbed_decode_error_bound
    from .paged import PagedKVCache
    rows = []
    for n in lengths:
        q, k, v = testing.make_inputs(rng, batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1, seqlen_k=n,
                                      head_dim=head_dim, dtype="float32")
        q = q[:, :, 0]
        ro, rl_ = reference.decode(q, k, v)
        for label, dtype, kv_dtype in cases:
            cache = PagedKVCache(-(-n // block_size), block_size, num_kv_heads=heads_kv, head_dim=head_dim,
                                 dtype=dtype, kv_dtype=kv_dtype)
            dt = cache.dtype
            sid = cache.new_sequence()
            cache.append(sid, k[0].transpose(1, 0, 2).astype(dt), v[0].transpose(1, 0, 2).astype(dt))
            o, lse = paged_decode_split_kv(q.astype(dt), cache, [sid], num_splits=1)
            bound = None
            if kv_dtype is not None:
                k_hat, v_hat = (x[None] for x in cache.gather(sid))
                bound = float(perturbed_decode_error_bound(q, k, v, k_hat, v_hat)[0].max())
            rows.append(dict(N=n, cache=label, o_error=float(np.abs(testing.as_numpy(o) - ro).max()),
                             lse_error=float(np.abs(lse - rl_).max()), bound=bound,
                             bytes_per_token=cache.bytes_per_token()))
    return rows


# --------------------------------------------------------------------------- MLA
def mla_comparison(rng, seqlen=96, batch=2, shape=None, model_context=4096, dtype="bfloat16") -> dict:
    """MLA's two forms side by side: exactness on a small problem, bytes and FLOPs at full size.

    ``shape`` (small MLA widths, run in NumPy) defaults to a scaled-down DeepSeek-V3.
    Returns dict(errors: float64 max errors of absorbed, unabsorbed and paged against the
    oracle, counted_equals_model: bool per form, full: per form bytes, FLOPs and intensity
    of DeepSeek-V3 at ``model_context`` tokens and ``dtype``, one layer, one sequence).
    """
    from . import mla
    from .core import traffic
    shape = shape or dict(latent_dim=64, rope_dim=8, head_dim=16, v_head_dim=16, heads=16)
    x = mla.make_mla_inputs(rng, batch=batch, seqlen=seqlen, **shape)
    lens = [seqlen] * batch
    ro, _ = mla.reference_mla(**x)
    errors, counted = {}, {}
    for form, fn in (("absorbed", mla.mla_decode_absorbed), ("unabsorbed", mla.mla_decode_unabsorbed)):
        with traffic.count() as t:
            o, _ = fn(**x)
        errors[form] = float(np.abs(o - ro).max())
        model = mla.traffic_model(form, batch=batch, seq_lens=lens, dtype="float64", **shape)
        counted[form] = dict(counted=t.total, modelled=model.total, equal=t.as_dict() == model.as_dict())
    cache = mla.latent_cache(batch * -(-seqlen // 16), shape["latent_dim"], shape["rope_dim"], dtype=np.float64)
    sids = [cache.new_sequence() for _ in range(batch)]
    for b, s in enumerate(sids):
        cache.append(s, x["kv_latent"][b][:, None, :].copy())
    o, _ = mla.paged_mla_decode(x["q_nope"], x["q_rope"], cache, sids, x["w_uk"], x["w_uv"])
    errors["paged absorbed"] = float(np.abs(o - ro).max())
    v3 = mla.DEEPSEEK_V3_MLA
    full = {}
    for form in ("absorbed", "unabsorbed"):
        t = mla.traffic_model(form, batch=1, seq_lens=[model_context], num_splits=1, dtype=dtype, **v3)
        f = mla.mla_flops(form, seq_lens=[model_context], **v3)
        full[form] = dict(bytes=t.total, flops=f["total"], attention_flops=f["attention"],
                          intensity=f["total"] / t.total)
    return dict(errors=errors, counted=counted, full=full, shape=shape)


# --------------------------------------------------------------------------- sliding windows
def window_traffic(rng, lengths=(64, 256, 1024), window=(127, 0), heads_q=4, heads_kv=1, head_dim=32) -> list[dict]:
    """K bytes a windowed decode reads against a full one, counted and modelled, per N."""
    from .core import reference, testing, traffic
    from .decode import decode_split_kv, traffic_model
    rows = []
    for n in lengths:
        q, k, v = testing.make_inputs(rng, batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1, seqlen_k=n,
                                      head_dim=head_dim, dtype="float32")
        q = q[:, :, 0]
        row = dict(N=n)
        for label, w in (("full", None), ("window", window)):
            with traffic.count() as t:
                o, _ = decode_split_kv(q, k, v, num_splits=1, window=w)
            m = traffic_model(batch=1, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, seqlen_k=n,
                                  num_splits=1, window=w)
            ro, _ = reference.decode(q, k, v, window=w)
            row[label] = dict(k_bytes=t.by_tensor["K"][0], equal=t.as_dict() == m.as_dict(),
                              error=float(np.abs(o - ro).max()))
        rows.append(row)
    return rows


#: the columns of the recorded MLA decode rows (benchmark section "mla")
MLA_RECORD_COLUMNS = ("batch", "seqlen", "runner", "ms", "tflops", "cache_TBps", "roofline_fraction",
                      "speed_vs_torch_matmul")


def _latest_record(results_dir):
    from .core import recorded
    try:
        return recorded.load("h200", results_dir)
    except FileNotFoundError:
        return None


def recorded_cache_data(results_dir=None):
    """(label, rows) of :func:`iokernels.core.recorded.cache_rows` in the latest benchmark
    record, for a plot; (None, a sentence saying why not) when there are none."""
    from .core import recorded
    rec = _latest_record(results_dir)
    if rec is None:
        return None, "No benchmark record in this checkout (python -m iokernels bench on a GPU writes one)."
    rows = recorded.cache_rows(rec)
    if not rows:
        return None, ("The latest benchmark record has no quantized-cache decode rows: python -m iokernels bench "
                      "--sections decode on a GPU records them.")
    return recorded.label(rec), rows


def recorded_mla_data(results_dir=None):
    """(label, rows) of the MLA decode rows (section "mla") of the latest benchmark record,
    each with batch, seqlen, runner, ms, tflops, cache_TBps, roofline_fraction; (None, a
    sentence saying why not) when there are none."""
    from .core import recorded
    rec = _latest_record(results_dir)
    if rec is None:
        return None, "No benchmark record in this checkout (python -m iokernels bench on a GPU writes one)."
    rows = recorded.bench_rows(rec, section="mla")
    if not rows:
        return None, ("The latest benchmark record has no MLA decode rows: python -m iokernels bench --sections mla "
                      "on a Hopper GPU records them.")
    return recorded.label(rec), rows


def recorded_cache_rows(results_dir=None) -> str:
    """The quantized- and windowed-cache decode rows of the latest benchmark record
    (:func:`iokernels.core.recorded.cache_rows`: each runner over int8 / fp8 / bfloat16 pools
    and its speed against its own 16-bit cache), under the record's label; or a sentence saying
    there are none.  Reads files only, touches no GPU."""
    from .core import recorded
    try:
        rec = recorded.load("h200", results_dir)
    except FileNotFoundError:
        return "No benchmark record in this checkout (python -m iokernels bench on a GPU writes one)."
    rows = recorded.cache_rows(rec)
    if not rows:
        return ("The latest benchmark record has no quantized-cache decode rows: python -m iokernels bench "
                "--sections decode on a GPU records them.")
    return (recorded.label(rec) + "  (rate: TB/s of the bytes the cache holds)\n"
            + recorded.format_rows(rows, ("batch", "cache", "window", "runner", "ms", "rate", "speed_vs_16bit")))


def recorded_mla_rows(results_dir=None) -> str:
    """The MLA decode rows of the latest benchmark record (section "mla": the Hopper kernel of
    :mod:`iokernels.cupy_raw.mla` next to torch formulations of the same absorbed form), under the
    record's label; or a sentence saying there are none.  Reads files only, touches no GPU."""
    from .core import recorded
    try:
        rec = recorded.load("h200", results_dir)
    except FileNotFoundError:
        return "No benchmark record in this checkout (python -m iokernels bench on a GPU writes one)."
    if not recorded.bench_rows(rec, section="mla"):
        return ("The latest benchmark record has no MLA decode rows: python -m iokernels bench --sections mla "
                "on a Hopper GPU records them.")
    return recorded.label(rec) + "\n" + recorded.table(rec, "mla", columns=MLA_RECORD_COLUMNS)
