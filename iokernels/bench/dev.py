"""One development tool for any registered op, version and shape: check, then time next to torch.

    python -m iokernels dev OP [--backend cupy] [--version v4] [--shape B=8,Hq=32,Hkv=8,N=32768,d=128]
                               [--dtype float16] [--causal] [--kv-dtype int8] [--rounds 5] [--reps R]
                               [--against sdpa:cudnn,sdpa:flash] [--no-correctness] [--no-timing]
                               [--config key=value ...] [--seed S] [--json FILE]

OP is one of the registry's ops (:data:`iokernels.core.registry.OPS`): attention,
attention_backward, decode, paged_decode, paged_prefill, paged_gather, mla_decode.  ``--backend`` is any
public backend ("naive", "tiled", "numba", "cupy", "torch"); for "numba" and "cupy" the
version is looked up in the backend's ``REGISTRY`` and the call goes through the public
function with ``config=ConfigClass(version=..., **config)`` (``--config`` sets the other
fields: ``--config block_n=64 --config num_stages=3``).

1. check: the call's outputs (O and LSE; dQ, dK, dV for the backward; K and V for the
   gather) against the float64 oracle (:mod:`iokernels.core.reference`), by FlashAttention's
   2x rule (:func:`iokernels.core.testing.check`: the baseline is the naive algorithm in
   the same precision; factor 3 for gradients).  A gather is a copy: it must be exact.
2. time: the subject and every ``--against`` runner take turns, ``--rounds`` times (the
   runners are interleaved, so a clock or thermal drift hits them alike); each turn is one
   :func:`iokernels.bench.timer.time_cuda` (device events, L2 flushed between repetitions;
   :func:`~iokernels.bench.timer.time_cpu` on a CPU).  Printed: each runner's median over
   the rounds, and the subject's time ratio to each runner per round and its median.

Runners: ``sdpa:NAME`` (torch SDPA forced to the "cudnn", "flash", "efficient" or "math"
kernel, or "default"; attention, decode and paged decode, the latter over the contiguous
cache), ``torch:matmul`` (MLA's absorbed form in torch matmuls), or ``BACKEND[:VERSION]``
(any public backend on the same inputs, e.g. ``cupy:v3``, ``tiled``).

On a CPU the tool runs the NumPy backends and Numba's CUDA simulator (tiny shapes); the
GPU rows need a GPU.  Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import api, paged_inputs
from .. import torch_sdpa as ts
from ..core import conventions as cv
from ..core import reference, testing
from ..core.config import TileConfig
from ..core.gpu import has_gpu, simulator_enabled
from ..core.registry import OPS
from ..mla import reference_latent
from ..paged import PagedKVCache
from ..torch_sdpa import _to_torch, mla_decode_matmul
from .timer import release_device_cache, time_cpu, time_cuda

#: shape keys and what they mean (Hkv defaults to Hq, Nq to N; dc, dr: MLA's latent and rope widths)
SHAPE_KEYS = {"B": "batch", "Hq": "query heads", "Hkv": "key/value heads", "N": "keys (cache length)",
              "Nq": "query rows (prefill)", "d": "head dim", "dc": "MLA latent dim", "dr": "MLA rope dim"}
DEFAULT_SHAPE = {"B": 1, "Hq": 4, "N": 64, "d": 32, "dc": 512, "dr": 64}
SDPA_KERNELS = ("cudnn", "flash", "efficient", "math", "default")


def parse_shape(text: str | None) -> dict:
    """``"B=8,Hq=32,N=4096"`` -> {"B": 8, "Hq": 32, "N": 4096, ...} over :data:`DEFAULT_SHAPE`."""
    shape = dict(DEFAULT_SHAPE)
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS:
            raise ValueError(f"shape: expected KEY=INT items with KEY in {', '.join(SHAPE_KEYS)}, got {item!r}")
        try:
            shape[key] = int(value)
        except ValueError:
            raise ValueError(f"shape: {key} must be an integer, got {value!r}") from None
        if shape[key] < 1:
            raise ValueError(f"shape: {key} must be >= 1, got {shape[key]}")
    shape.setdefault("Hkv", shape["Hq"])
    shape.setdefault("Nq", shape["N"])
    if shape["Hq"] % shape["Hkv"]:
        raise ValueError(f"shape: Hq={shape['Hq']} must be a multiple of Hkv={shape['Hkv']}")
    return shape


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_config(items) -> dict:
    """``["block_n=64", "deterministic=true"]`` -> {"block_n": 64, "deterministic": True}."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"config: expected key=value, got {item!r}")
        out[key] = _value(value)
    return out


# --------------------------------------------------------------------------- the problem
@dataclass
class Problem:
    """One op's inputs (NumPy), the public call's arguments, and the float64 oracle."""

    op: str
    dtype: str
    shape: dict
    causal: bool
    args: tuple                      # positional arguments of the public call
    kwargs: dict                     # keyword arguments of the public call (not backend/config)
    refs: dict                       # output name -> float64 oracle
    baselines: dict = field(default_factory=dict)   # output name -> naive in the same precision
    factor: float = testing.FORWARD_FACTOR
    exact: bool = False              # a copy: must match exactly
    contiguous: tuple = ()           # (q, k, v) for the SDPA runners (decode: the contiguous cache)
    work: float = 0.0                # FLOPs or bytes of one call
    unit: str = "TFLOP/s"


def _names(op: str) -> tuple:
    return {"attention_backward": ("dq", "dk", "dv"), "paged_gather": ("k", "v")}.get(op, ("o", "lse"))


def _visible_pairs(nq: int, nk: int, causal: bool) -> int:
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal, None)
    return int(np.sum(hi - lo))


def make_problem(op: str, shape: dict, dtype: str, *, causal: bool = False, kv_dtype: str | None = None,
                 seed: int = 0, oracle: bool = True) -> Problem:
    """Seeded inputs for ``op`` at ``shape`` in ``dtype``, and what they must give (``oracle``
    False: no oracle and no baseline, whose NumPy float64 and 16-bit work takes minutes at the
    shapes a timing-only run names; the problem then has no ``refs`` to check against)."""
    cv.check_choice(op, "op", OPS)
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, N, Nq, d = (shape[k] for k in ("B", "Hq", "Hkv", "N", "Nq", "d"))
    low = dtype != "float64"
    item = cv.itemsize_of(dtype)
    if op in ("attention", "attention_backward"):
        q, k, v, do = testing.make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=N,
                                          head_dim=d, dtype=dtype, with_grad=True)
        pairs = B * Hq * _visible_pairs(Nq, N, causal) * d
        if op == "attention":
            refs = dict(zip(("o", "lse"), reference.attention(q, k, v, causal=causal))) if oracle else {}
            base = dict(zip(("o", "lse"), api.attention(q, k, v, causal=causal, backend="naive",
                                                        return_lse=True))) if low and oracle else {}
            return Problem(op, dtype, shape, causal, (q, k, v), dict(causal=causal, return_lse=True),
                           refs, base, contiguous=(q, k, v), work=4.0 * pairs)
        o, lse = api.attention(q, k, v, causal=causal, backend="naive", return_lse=True)
        refs = dict(zip(("dq", "dk", "dv"), reference.attention_backward(do, q, k, v, causal=causal))) \
            if oracle else {}
        base = dict(zip(("dq", "dk", "dv"), api.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                   backend="naive"))) if low and oracle else {}
        return Problem(op, dtype, shape, causal, (do, q, k, v, o, lse), dict(causal=causal), refs, base,
                       factor=testing.GRADIENT_FACTOR, work=10.0 * pairs)
    if op == "paged_prefill":
        return _paged_prefill_problem(rng, shape, dtype, causal)
    if causal:
        raise ValueError(f"causal: {op} has one query token per sequence; drop --causal")
    kv_bytes = 2.0 * B * Hkv * N * d * item
    if op == "decode":
        q, k, v = testing.make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=1, seqlen_k=N,
                                      head_dim=d, dtype=dtype)
        q = np.ascontiguousarray(q[:, :, 0])
        refs = dict(zip(("o", "lse"), reference.decode(q, k, v))) if oracle else {}
        base = dict(zip(("o", "lse"), api.decode(q, k, v, backend="naive", return_lse=True))) \
            if low and oracle else {}
        return Problem(op, dtype, shape, False, (q, k, v), dict(return_lse=True), refs, base,
                       contiguous=(q[:, :, None], k, v), work=kv_bytes, unit="TB/s")
    if op in ("paged_decode", "paged_gather"):
        q, k, v, lens, cache, sids, kh, vh = paged_inputs.make_paged_decode_inputs(
            rng, B, Hq, Hkv, N, d, dtype, kv_dtype)
        if op == "paged_gather":
            n = int(lens[-1])
            return Problem(op, dtype, shape, False, (cache, sids[-1]), {},
                           dict(k=kh[-1, :, :n], v=vh[-1, :, :n]), exact=True,
                           work=2.0 * 2 * Hkv * n * d * item, unit="TB/s")
        refs = dict(zip(("o", "lse"), reference.decode(q, kh, vh, seq_lens=lens))) if oracle else {}
        base = {}
        if low and oracle:           # the naive algorithm on what the cache holds, in q's precision
            dt = testing.numpy_dtype(dtype)
            base = dict(zip(("o", "lse"), api.decode(q, kh.astype(dt), vh.astype(dt), seq_lens=lens,
                                                     backend="naive", return_lse=True)))
        return Problem(op, dtype, shape, False, (q, cache, sids), dict(return_lse=True), refs,
                       base, contiguous=(q[:, :, None], k, v), work=kv_bytes, unit="TB/s")
    # mla_decode: q (B, Hq, dc + dr) over a latent cache (B, N, dc + dr)
    dc, row = shape["dc"], shape["dc"] + shape["dr"]
    dt = testing.numpy_dtype(dtype)
    q = rng.standard_normal((B, Hq, row)).astype(dt)
    kv = rng.standard_normal((B, N, row)).astype(dt)
    refs = dict(zip(("o", "lse"), reference_latent(q, kv, dc))) if oracle else {}
    return Problem(op, dtype, shape, False, (q, kv), {}, refs,
                   work=2.0 * B * Hq * N * (row + dc), unit="TFLOP/s")


def _paged_prefill_problem(rng, shape: dict, dtype: str, causal: bool) -> Problem:
    """B sequences of N, N - 3, ... tokens (at least 1) in a paged cache, each with a chunk of its
    last min(Nq, n) tokens as the queries; the oracle on each sequence's contiguous copy."""
    B, Hq, Hkv, N, Nq, d = (shape[k] for k in ("B", "Hq", "Hkv", "N", "Nq", "d"))
    dt = testing.numpy_dtype(dtype)
    lens = [max(1, N - 3 * b) for b in range(B)]
    chunks = [min(Nq, n) for n in lens]
    cache = PagedKVCache(sum(-(-n // 16) for n in lens) + 1, 16, num_kv_heads=Hkv, head_dim=d, dtype=dt)
    sids = [cache.new_sequence() for _ in lens]
    for sid, n in zip(sids, lens):
        cache.append(sid, *(rng.standard_normal((n, Hkv, d)).astype(dt) for _ in range(2)))
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), Hq, d)).astype(dt)
    ro, rl = np.zeros(q.shape), np.full((Hq, q.shape[0]), -np.inf)
    for b, sid in enumerate(sids):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        k, v = (x.astype(np.float64)[None] for x in cache.gather(sid))
        o, lse = reference.attention(q[rows].astype(np.float64).transpose(1, 0, 2)[None], k, v, causal=causal)
        ro[rows], rl[:, rows] = o[0].transpose(1, 0, 2), lse[0]
    base = {}
    if dtype != "float64":
        base = dict(zip(("o", "lse"), api.paged_prefill(q, cache, sids, cq, causal=causal, backend="naive",
                                                        return_lse=True)))
    pairs = sum(Hq * _visible_pairs(c, n, causal) * d for c, n in zip(chunks, lens))
    return Problem("paged_prefill", dtype, shape, causal, (q, cache, sids, cq), dict(causal=causal, return_lse=True),
                   dict(o=ro, lse=rl), base, work=4.0 * pairs)


# --------------------------------------------------------------------------- runners
def _on_device(x):
    """A NumPy array as a torch CUDA tensor (bfloat16 bit-exact); anything else unchanged."""
    if not isinstance(x, np.ndarray):
        return x
    return _to_torch(x).cuda()


def config_for(backend: str, op: str, version: str | None, overrides: dict):
    """The config a call passes: the registry's config class of ``version`` (GPU backends),
    a TileConfig (tiled), or None (defaults)."""
    if backend in api.GPU_BACKENDS:
        reg = api.registry_of(backend)
        if op not in reg.ops():
            raise ValueError(f"op: {backend} registers no {op}; it has {', '.join(reg.ops())}")
        if version is None and not overrides:
            return None
        cls = reg.get(op, version).config_class if version else reg.kernels(op)[0].config_class
        return cls(version=version, **overrides)
    if version is not None:
        raise ValueError(f"version: the {backend!r} backend has no versions (got {version!r})")
    if overrides:
        if backend != "tiled":
            raise ValueError(f"config: the {backend!r} backend takes no config (got {sorted(overrides)})")
        return TileConfig(**overrides)
    return None


def _device_pools(cache):
    """A paged cache's pools (1-byte codes as uint8) and scales as torch CUDA tensors, moved once."""
    pools = [np.asarray(x).view(np.uint8) if cache.quantized else x for x in (cache.k_pool, cache.v_pool)]
    quant = None
    if cache.quantized:
        quant = dict(kv=cache.kv_dtype, k_scale=_on_device(cache.k_scale), v_scale=_on_device(cache.v_scale))
    return _on_device(pools[0]), _on_device(pools[1]), quant


def _paged_on_device(p: Problem, backend: str, config) -> Callable[[], Any]:
    """Paged decode / gather (and CuPy's paged prefill) on a GPU over pools moved to the device once:
    the public call would hand the backend the cache's NumPy pools, which it copies in at every call."""
    module = importlib.import_module(api.GPU_BACKENDS[backend])
    if p.op == "paged_gather":
        cache, sid = p.args
        kp, vp, _ = _device_pools(cache)
        table = np.asarray(cache.block_table(sid), dtype=np.int32)
        n = int(cache.seq_len(sid))
        return lambda: module.gather_pools(kp, vp, table, n, config=config)
    q, cache, sids = p.args[:3]
    qd = _on_device(q)
    kp, vp, quant = _device_pools(cache)
    tables, lens = cache.block_tables_array(list(sids))
    if p.op == "paged_prefill":                    # CuPy's pools entry point: (O, LSE), as return_lse=True
        return lambda: module.paged_prefill_pools(qd, kp, vp, tables, lens, p.args[3], causal=p.kwargs["causal"],
                                                  config=config)
    return lambda: module.paged_decode_pools(qd, kp, vp, tables, lens, config=config, quant=quant)


def public_call(p: Problem, backend: str, config, device: bool) -> Callable[[], Any]:
    """The public function of ``p.op`` on ``backend`` as a no-argument call (inputs moved once)."""
    if device and backend in api.GPU_BACKENDS and (p.op in ("paged_decode", "paged_gather")
                                                   or (p.op == "paged_prefill" and backend == "cupy")):
        return _paged_on_device(p, backend, config)
    args = tuple(_on_device(a) for a in p.args) if device and backend in ("numba", "cupy", "torch") else p.args
    if p.op == "paged_prefill":                    # the offsets stay on the host (they size the grid)
        args = args[:3] + p.args[3:]
    if p.op == "mla_decode":
        if backend != "cupy":
            raise ValueError(f"backend: mla_decode is a CuPy kernel; got {backend!r}")
        from ..cupy_raw import mla_decode
        return lambda: mla_decode(*args, config=config)
    if p.op == "paged_gather":
        return lambda: api.paged_gather(*args, backend="numpy" if backend == "tiled" else backend, config=config)
    fn = getattr(api, p.op)
    return lambda: fn(*args, backend=backend, config=config, **p.kwargs)


def _sdpa_call(p: Problem, kernel: str) -> Callable[[], Any]:
    import torch

    if p.op not in ("attention", "decode", "paged_decode"):
        raise ValueError(f"against: sdpa runs attention and decode, not {p.op}")
    q, k, v = (_on_device(x) for x in p.contiguous)
    name = None if kernel == "default" else kernel
    if p.op == "attention":
        return lambda: ts.sdpa(q, k, v, causal=p.causal, backend=name)
    gqa = q.shape[1] != k.shape[1]

    def fn():
        with ts.force(name):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return fn


def runner(spec: str, p: Problem, device: bool) -> Callable[[], Any]:
    """The call a ``--against`` item names: sdpa:KERNEL, torch:matmul or BACKEND[:VERSION]."""
    head, _, tail = spec.partition(":")
    if head == "sdpa":
        cv.check_choice(tail, "against (sdpa kernel)", SDPA_KERNELS)
        return _sdpa_call(p, tail)
    if spec == "torch:matmul":
        if p.op != "mla_decode":
            raise ValueError("against: torch:matmul is MLA's baseline (op mla_decode)")
        q, kv = (_on_device(x) for x in p.args)
        return lambda: mla_decode_matmul(q, kv, latent_dim=p.shape["dc"])
    cv.check_choice(head, "against (backend)", api.BACKENDS)
    return public_call(p, head, config_for(head, p.op, tail or None, {}), device)


# --------------------------------------------------------------------------- check and time
def check(p: Problem, out) -> list:
    """The outputs of one call against the oracle: a list of :class:`~iokernels.core.testing.Check`."""
    outs = dict(zip(_names(p.op), out if isinstance(out, tuple) else (out,)))
    checks = []
    for name, ref in p.refs.items():
        got = testing.as_numpy(outs[name])
        if p.exact:
            err = float(np.max(np.abs(got - ref))) if got.shape == ref.shape and got.size else 0.0
            ok = got.shape == ref.shape and err == 0.0
            checks.append(testing.Check(name, err if got.shape == ref.shape else np.inf, 0.0, None, ok,
                                        "" if ok else " (a copy must be exact)"))
            continue
        checks.append(testing.check(got, ref, p.baselines.get(name), dtype=p.dtype, name=name, factor=p.factor))
    return checks


def cannot_run(fn: Callable[[], Any]) -> str | None:
    """Why one call of a comparison runner fails (an SDPA kernel that refuses the shape: torch
    says "No available kernel"), or None when it runs."""
    try:
        fn()
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def time_interleaved(runners: dict, rounds: int, *, device: bool, reps: int | None = None) -> dict:
    """Each runner timed once a round, the runners taking turns: {name: [median ms of each round]}."""
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    times: dict = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            t = time_cuda(fn, reps=reps or 20) if device else time_cpu(fn, warmup=0, reps=reps or 1)
            times[name].append(t.median_ms)
    release_device_cache()
    return times


def summarize(times: dict, subject: str) -> dict:
    """Median ms a runner, and the subject's per-round ratio (runner ms / subject ms: > 1 is faster)."""
    out = {}
    for name, ms in times.items():
        row: dict = dict(median_ms=statistics.median(ms), rounds_ms=ms)
        if name != subject:
            ratios = [b / a for a, b in zip(times[subject], ms)]
            row.update(speed_ratios=ratios, median_speed_ratio=statistics.median(ratios))
        out[name] = row
    return out


def run(op: str, *, backend: str = "cupy", version: str | None = None, shape: str | dict | None = None,
        dtype: str = "float16", causal: bool = False, kv_dtype: str | None = None, rounds: int = 5,
        reps: int | None = None, against=(), correctness: bool = True, timing: bool = True,
        config=None, seed: int = 0, out=print) -> dict:
    """Check and time one (op, backend, version, shape); returns the record (see the module doc)."""
    shape = parse_shape(shape) if not isinstance(shape, dict) else shape
    cv.check_choice(backend, "backend", api.BACKENDS)
    overrides = parse_config(config) if not isinstance(config, dict) else config
    cfg = config_for(backend, op, version, overrides)
    p = make_problem(op, shape, dtype, causal=causal, kv_dtype=kv_dtype, seed=seed, oracle=correctness)
    device = has_gpu() and not simulator_enabled()
    subject = backend if version is None else f"{backend}:{version}"
    record: dict = dict(op=op, subject=subject, dtype=dtype, causal=causal, kv_dtype=kv_dtype, shape=shape,
                        config=None if cfg is None else dataclasses.asdict(cfg), device=device)
    call = public_call(p, backend, cfg, device)
    ok = True
    if correctness:
        checks = check(p, call())
        ok = all(checks)
        record["checks"] = [dict(name=c.name, error=c.error, bound=c.bound, ok=c.ok) for c in checks]
        for c in checks:
            out(f"check {subject} {c}")
    if timing:
        runners = {subject: call}
        for spec in against:
            fn = runner(spec, p, device)
            why = cannot_run(fn)
            if why is None:
                runners[spec] = fn
            else:                               # say so, and time the others
                record.setdefault("skipped", {})[spec] = why
                out(f"skip  {spec}: it cannot run this problem ({why})")
        record["times"] = summarize(time_interleaved(runners, rounds, device=device, reps=reps), subject)
        for name, row in record["times"].items():
            rate = p.work / (row["median_ms"] * 1e-3) / 1e12
            ratio = "" if name == subject else (f"  subject x{row['median_speed_ratio']:.4g} "
                                                f"(rounds {', '.join(f'{r:.4g}' for r in row['speed_ratios'])})")
            out(f"time  {name:<16} {row['median_ms']:.4f} ms  {rate:.4g} {p.unit}{ratio}")
    record["ok"] = ok
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m iokernels dev", description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=OPS)
    ap.add_argument("--backend", default="cupy", choices=api.BACKENDS)
    ap.add_argument("--version", default=None, help="a registered version (default: the registry's pick)")
    ap.add_argument("--shape", default=None, help=f"KEY=INT,... with KEY in {', '.join(SHAPE_KEYS)}")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kv-dtype", default=None, help="a quantized paged cache: float8_e4m3fn or int8")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions a round (default: 20 on a GPU, 1 on a CPU)")
    ap.add_argument("--against", default="", help="comma-separated runners: sdpa:cudnn,sdpa:flash,cupy:v3,...")
    ap.add_argument("--no-correctness", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the record to this file")
    a = ap.parse_args(argv)
    try:
        record = run(a.op, backend=a.backend, version=a.version, shape=a.shape, dtype=a.dtype, causal=a.causal,
                     kv_dtype=a.kv_dtype, rounds=a.rounds, reps=a.reps,
                     against=[s for s in a.against.split(",") if s], correctness=not a.no_correctness,
                     timing=not a.no_timing, config=a.config, seed=a.seed)
    except ValueError as e:
        print(f"dev: {e}", file=sys.stderr)
        return 2
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0 if record["ok"] else 1
