"""The ``cliff`` section: our default kernel next to every SDPA kernel over a grid of shapes
that the serving-shape sections never visit, and the ``captured`` section: a 32-layer decode
step, eager and captured as a CUDA graph.

A cliff is a shape where the default falls off: a group size one kernel version refuses
(the call goes to a slower one), a head dim a kernel does not take, a batch between the
points a heuristic was tuned at.  :data:`CLIFF` declares the grid (decode: query heads per KV
head g, KV heads, head dim, batch, cache length; prefill: head dim, length, causal, GQA); each
case is one row of our default (the CuPy registry's choice, named ``cupy:<version>`` and
flagged ``default``) and one row per SDPA kernel, timed in the same run in the case format of
the ``compare`` section (``rate``, ``ms`` of device time, ``host_ms``: the Python cost of one
call in a loop of calls with one synchronize at the end, :func:`.timer.host_ms_loop`).  A
prefill case also times the version the default would pick but for its record's
``default_check`` (a Hopper version at head_dim 256: it runs when a config names it), flagged
``held_back`` with the reason: the row that says whether the default should take it.

The whole grid (540 decode and 36 prefill cases) takes longer than a benchmark's time box,
so the cases run in the order :func:`cliff_order` gives -- the centre shape first, then every
shape one axis away from it, then two axes away, and so on -- until ``budget_s`` is spent:
a cut-short sweep has still moved every axis on its own before it combines them.  The cases
it did not reach are counted in the section's summary case (kind ``cliff_budget``), never
silently dropped; cases whose tensors would not fit the free device memory are recorded as
skipped.
"""
from __future__ import annotations

import importlib
import itertools
import time

import numpy as np

import iokernels as ik

from .. import api
from .. import torch_sdpa as ts
from ..core import conventions as cv
from .runners import (Unavailable, _device_randn, _finish_case, _first_line, _measure, _reference, _sdpa_rows,
                      _resolve_backend, _torch_dtype, _visible_pairs, registry_versions)
from .specs import CHECK_TOL
from .timer import _Device, release_device_cache

#: the sweep: decode over query heads per KV head x KV heads (8, and 1: multi-query) x head dim x
#: batch x cache length; prefill over head dim x length x causal x GQA (H query heads over
#: heads_kv, or H) at about ``tokens`` query rows a case (batch = tokens // N, at least 1)
CLIFF = dict(
    decode=dict(groups=(1, 4, 8, 16, 32, 64), heads_kv=(8, 1), head_dims=(64, 128, 256),
                batches=(1, 3, 17, 64, 128), seqlens=(1000, 4096, 50000),
                centre=dict(group=4, heads_kv=8, head_dim=128, batch=17, seqlen=4096)),
    prefill=dict(head_dims=(64, 128, 256), seqlens=(1000, 3000, 8192), causal=(False, True), gqa=(False, True),
                 heads=16, heads_kv=4, tokens=16384,
                 centre=dict(head_dim=128, seqlen=3000, causal=False, gqa=False)),
    dtype="bfloat16")
#: the sweep's default time box (seconds of wall time, whatever the GPU)
CLIFF_BUDGET_S = 150.0
#: a case runs only if its inputs take at most this fraction of the free device memory (the
#: SDPA math kernel and the checks need the rest)
MEMORY_FRACTION = 0.4
#: the captured decode step: one decode a layer over that layer's GQA cache
CAPTURED = dict(layers=32, batch=8, heads_q=32, heads_kv=8, seqlen=4096, head_dim=128, dtype="bfloat16")


# --------------------------------------------------------------------------- the grid
def cliff_order(axes: dict, centre: dict) -> list[dict]:
    """Every combination of ``axes`` (name -> values), the ``centre`` first, then those one axis
    away from it, then two, ...; ties in the grid's order.  Pure: the plan of the sweep."""
    names = list(axes)
    grid = [dict(zip(names, vals)) for vals in itertools.product(*(axes[n] for n in names))]
    missing = [n for n in names if centre.get(n) not in axes[n]]
    if missing:
        raise ValueError(f"centre: {missing} not among the axes' values")
    return sorted(grid, key=lambda c: sum(c[n] != centre[n] for n in names))    # a stable sort


def decode_plan(spec=CLIFF) -> list[dict]:
    """The decode cases' shapes, in :func:`cliff_order`."""
    d = spec["decode"]
    axes = dict(group=d["groups"], heads_kv=d["heads_kv"], head_dim=d["head_dims"], batch=d["batches"],
                seqlen=d["seqlens"])
    return [dict(c, heads_q=c["group"] * c["heads_kv"]) for c in cliff_order(axes, d["centre"])]


def prefill_plan(spec=CLIFF) -> list[dict]:
    """The prefill cases' shapes, in :func:`cliff_order`."""
    p = spec["prefill"]
    axes = dict(head_dim=p["head_dims"], seqlen=p["seqlens"], causal=p["causal"], gqa=p["gqa"])
    out = []
    for c in cliff_order(axes, p["centre"]):
        out.append(dict(head_dim=c["head_dim"], seqlen=c["seqlen"], causal=c["causal"],
                        batch=max(1, p["tokens"] // c["seqlen"]), heads=p["heads"],
                        heads_kv=p["heads_kv"] if c["gqa"] else p["heads"]))
    return out


def interleave(*plans: list) -> list:
    """The plans' entries taken in turn (a, b, a, b, ...), so a cut-short sweep has some of each."""
    out = []
    for group in itertools.zip_longest(*plans):
        out += [x for x in group if x is not None]
    return out


def input_bytes(kind: str, shape: dict, itemsize: int) -> int:
    """Bytes of one case's q, k, v (and O) on the device."""
    if kind == "decode":
        B, Hq, Hkv, N, d = (shape[k] for k in ("batch", "heads_q", "heads_kv", "seqlen", "head_dim"))
        return itemsize * (2 * B * Hq * d + 2 * B * Hkv * N * d)
    B, H, Hkv, N, d = (shape[k] for k in ("batch", "heads", "heads_kv", "seqlen", "head_dim"))
    return itemsize * (2 * B * H * N * d + 2 * B * Hkv * N * d)


# --------------------------------------------------------------------------- one case
def registry_held_back(backend, op, **need_args):
    """(row name, config, why) of the version of ``op`` the default would pick for these inputs
    but for its record's ``default_check`` (a version that runs them when a config names it, not
    yet measured there), ranked above the default's own choice; None when there is none or the
    backend cannot be imported."""
    try:
        _resolve_backend(backend, "attention")
        mod = importlib.import_module(api.GPU_BACKENDS[backend])
        n = mod.need(op, **need_args)
        reg = mod.REGISTRY
    except Exception:  # Unavailable, ImportError, or no CUDA driver: no row
        return None
    try:
        floor = reg.default(op, n).rank
    except ValueError:
        floor = None
    for k in sorted(reg.kernels(op), key=lambda k: -k.rank):
        if floor is not None and k.rank <= floor:
            return None
        why = k.not_default(n)
        if k.unavailable(n) is None and why is not None:
            return f"{backend}:{k.version}", k.config_class(version=k.version), why
    return None


def _default_row(op, fn, need, **measure_kw) -> dict:
    """Our default: the CuPy registry's choice for these inputs, as ``cupy:<version>``."""
    versions = registry_versions("cupy", op, **need)
    picked = [(name, cfg) for name, cfg, is_default in versions if is_default]
    if not picked:
        why = next((cfg for _, cfg, _ in versions if isinstance(cfg, Exception)), None)
        return {"runner": "cupy", "group": "cupy", "status": f"unavailable: {why or 'no version runs these inputs'}"}
    name, cfg = picked[0]
    row = _measure(name, "cupy", lambda: fn(cfg), **measure_kw)
    row["default"] = True
    return row


def _held_back_rows(op, fn, need, **measure_kw) -> list[dict]:
    """The row of the version the default would pick but for its ``default_check``
    (:func:`registry_held_back`), flagged ``held_back`` with the reason; [] when there is none."""
    held = registry_held_back("cupy", op, **need)
    if held is None:
        return []
    name, cfg, why = held
    row = _measure(name, "cupy", lambda: fn(cfg), **measure_kw)
    row["held_back"] = why
    return [row]


def _decode_case(shape, dtype, seed, target_ms) -> dict:
    B, Hq, Hkv, N, d = (shape[k] for k in ("batch", "heads_q", "heads_kv", "seqlen", "head_dim"))
    kv_bytes = 2.0 * B * Hkv * N * d * _torch_dtype(dtype).itemsize
    case = dict(section="cliff", kind="decode", dtype=dtype, causal=False,
                shape=dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=N, head_dim=d),
                work=dict(kv_bytes=kv_bytes), unit="TB/s", results=[])
    q, k, v = _device_randn(seed, dtype, (B, Hq, d), (B, Hkv, N, d), (B, Hkv, N, d))
    gqa = Hq != Hkv
    q4 = q[:, :, None, :]
    ref4 = _reference(q4, k, v, False, True, gqa)
    rows = _sdpa_rows(case, q4, k, v, False, ref4, dtype, True, kv_bytes, "TB/s", gqa, target_ms)
    scale = 1.0 / np.sqrt(d)
    ours = dict(work=kv_bytes, unit="TB/s", ref=None if ref4 is None else ref4[:, :, 0, :], dtype=dtype,
                target_ms=target_ms)

    def run(cfg):
        return ik.decode(q, k, v, scale=scale, backend="cupy", config=cfg)
    rows.append(_default_row("decode", run, dict(q=q, k=k, v=v), **ours))
    rows += _held_back_rows("decode", run, dict(q=q, k=k, v=v), **ours)
    case["results"] = rows
    return _finish_case(case)


def _prefill_case(shape, dtype, seed, target_ms) -> dict:
    B, H, Hkv, N, d, causal = (shape[k] for k in ("batch", "heads", "heads_kv", "seqlen", "head_dim", "causal"))
    flops = 4.0 * B * H * _visible_pairs(N, N, causal) * d
    case = dict(section="cliff", kind="prefill", dtype=dtype, causal=causal,
                shape=dict(batch=B, heads=H, heads_kv=Hkv, seqlen=N, head_dim=d),
                work=dict(flops=flops), unit="TFLOP/s", results=[])
    q, k, v = _device_randn(seed, dtype, (B, H, N, d), (B, Hkv, N, d), (B, Hkv, N, d))
    gqa = H != Hkv
    # SDPA takes GQA through enable_gqa; its kernels see the same tensors ours do
    ref = _gqa_reference(q, k, v, causal, gqa)
    rows = []
    for name in ("flash", "efficient", "cudnn", "math"):
        def fn(name=name):
            with ts.force(name):
                return _sdpa(q, k, v, causal, gqa)
        rows.append(_measure(f"sdpa:{name}", "sdpa", fn, work=flops, unit="TFLOP/s", ref=ref, dtype=dtype,
                             target_ms=target_ms))
    scale = 1.0 / np.sqrt(d)
    ours = dict(work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms)

    def run(cfg):
        return ik.attention(q, k, v, causal=causal, scale=scale, backend="cupy", config=cfg)
    rows.append(_default_row("attention", run, dict(q=q, k=k, v=v, causal=causal), **ours))
    rows += _held_back_rows("attention", run, dict(q=q, k=k, v=v, causal=causal), **ours)
    case["results"] = rows
    return _finish_case(case)


def _sdpa(q, k, v, causal, gqa):
    import torch
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _gqa_reference(q, k, v, causal, gqa):
    for name in ("cudnn", "flash", "efficient", "math"):
        try:
            with ts.force(name):
                return _sdpa(q, k, v, causal, gqa)
        except RuntimeError:
            continue
    return None


def _free_bytes() -> int | None:
    try:
        import torch
        return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return None


def cliff_cases(spec=CLIFF, seed=0, progress=None, *, target_ms=None, budget_s=CLIFF_BUDGET_S, start=0,
                clock=time.perf_counter, run_case=None, free_bytes=_free_bytes, into=None) -> list[dict]:
    """The cliff sweep within ``budget_s`` seconds: the cases of :func:`decode_plan` and
    :func:`prefill_plan`, interleaved, in order from the ``start``-th until the budget is spent
    (a sweep longer than one time box runs in slices: the next slice starts where the last
    one's summary says it stopped, ``start + ran + skipped_memory``; every case carries its own
    SDPA rows, so its ratios are same-run whichever slice ran it); then one summary case (kind
    ``cliff_budget``) with what was planned, where it started, run, skipped and left out.  A case is
    skipped (recorded with a ``skipped`` status) when its inputs exceed MEMORY_FRACTION of the
    free device memory.  ``run_case(kind, shape, dtype, seed, target_ms)`` runs one case (the
    tests pass a fake; None: the timed runners)."""
    if budget_s <= 0:
        raise ValueError(f"budget_s: must be positive, got {budget_s}")
    run_case = run_case or (lambda kind, *a: (_decode_case if kind == "decode" else _prefill_case)(*a))
    dtype = spec["dtype"]
    plan = interleave([("decode", s) for s in decode_plan(spec)], [("prefill", s) for s in prefill_plan(spec)])
    if type(start) is not int or not 0 <= start <= len(plan):
        raise ValueError(f"start: a case index in [0, {len(plan)}], got {start!r}")
    t0 = clock()
    cases, skipped, left = ([] if into is None else into), 0, 0
    first = len(cases)
    itemsize = cv.itemsize_of(dtype)
    for i, (kind, shape) in enumerate(plan):
        if i < start:
            continue
        if clock() - t0 > budget_s:
            left = len(plan) - i
            break
        if progress is not None:
            progress.set_description(f"cliff {kind} {shape}")
        free = free_bytes()
        need = input_bytes(kind, shape, itemsize)
        if free is not None and need > MEMORY_FRACTION * free:
            skipped += 1
            cases.append(dict(section="cliff", kind=kind, dtype=dtype, causal=shape.get("causal", False),
                              shape={k: v for k, v in shape.items() if k not in ("group", "causal")},
                              results=[], status=f"skipped: inputs {need / 2**30:.1f} GiB > "
                                                 f"{MEMORY_FRACTION:.0%} of the free {free / 2**30:.1f} GiB"))
            continue
        try:
            cases.append(run_case(kind, shape, dtype, seed, target_ms))
        except (Unavailable, RuntimeError, ValueError) as e:     # e.g. out of memory while building inputs
            cases.append(dict(section="cliff", kind=kind, dtype=dtype, causal=shape.get("causal", False),
                              shape={k: v for k, v in shape.items() if k not in ("group", "causal")},
                              results=[], status=f"failed: {_first_line(e)}"))
        finally:
            release_device_cache()
        if progress is not None:
            progress.update(1)
    ran = len(cases) - first - skipped
    cases.append(dict(section="cliff", kind="cliff_budget", dtype=dtype, causal=False, shape={}, results=[],
                      summary=dict(planned=len(plan), start=start, ran=ran, skipped_memory=skipped,
                                   left_by_budget=left,
                                   budget_s=float(budget_s), elapsed_s=round(clock() - t0, 1),
                                   order="centre first, then one axis away, two, ... (cliff_order)")))
    return cases


# --------------------------------------------------------------------------- the captured step
def _capture(step):
    """(graph, outputs): ``step`` captured under torch.cuda.graph after a warm-up on a side stream."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def captured_rows(step_of: dict, work: float, target_ms=None, capture=_capture, synchronize=None) -> list[dict]:
    """Each decode step of ``step_of`` (name -> a function running every layer, returning the
    outputs) timed eager and replayed from a CUDA graph: rows ``<name> eager`` and ``<name>
    captured``.  A step that cannot be captured gives a ``failed: capture: ...`` row (the
    error's first line), not an exception.  The replay's largest difference from the eager
    step is recorded (``max_abs_diff_vs_eager``: a replay of the same kernels gives the same
    bits, but a library may choose other kernels while a graph is captured, which round
    differently); a difference past the benchmark's tolerance for the dtype
    (:data:`~.specs.CHECK_TOL`) marks the row ``suspect``.  ``capture``, ``synchronize``: the
    tests' fakes (None: torch.cuda.synchronize)."""
    if synchronize is None:
        import torch
        synchronize = torch.cuda.synchronize
    rows = []
    for name, step in step_of.items():
        group = name.split(":")[0]
        eager = _measure(f"{name} eager", group, step, work=work, unit="TB/s", check=False, target_ms=target_ms)
        rows.append(eager)
        row = {"runner": f"{name} captured", "group": group}
        try:
            want = [o.clone() for o in step()]
            graph, outs = capture(step)
        except Exception as e:  # noqa: BLE001 -- capture errors come as RuntimeError or CUDA errors
            row["status"] = f"failed: capture: {type(e).__name__}: {_first_line(e)}"
            rows.append(row)
            _recover()
            continue
        try:
            graph.replay()
            synchronize()
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, want))
            row.update(_measure(f"{name} captured", group, graph.replay, work=work, unit="TB/s", check=False,
                                target_ms=target_ms))
            row["max_abs_diff_vs_eager"] = diff
            tol = min(CHECK_TOL.get(str(o.dtype).replace("torch.", ""), 0.0) for o in want)
            if diff > tol:                    # more than another kernel choice's rounding
                row["suspect"] = f"the replay differs from the eager step by {diff:.3g} (> {tol:g})"
        except Exception as e:  # noqa: BLE001
            row["status"] = f"failed: replay: {type(e).__name__}: {_first_line(e)}"
        rows.append(row)
        del graph
    return rows


def _recover():
    """After a failed capture: let the device settle so the next rows start clean."""
    try:
        _Device().synchronize()
    except Exception:  # noqa: BLE001 -- a poisoned context: the next row says so itself
        pass


def captured_cases(spec=CAPTURED, seed=0, progress=None, *, target_ms=None, into=None) -> list[dict]:
    """The captured section: one case, a decode step of ``layers`` layers (one decode a layer
    over its own GQA cache), our default and SDPA's, each eager and captured.  ``speed_vs_sdpa_
    captured`` on every row: SDPA's captured step time / the row's."""
    import torch
    L, B, Hq, Hkv, N, d, dtype = (spec[k] for k in ("layers", "batch", "heads_q", "heads_kv", "seqlen",
                                                       "head_dim", "dtype"))
    kv_bytes = 2.0 * L * B * Hkv * N * d * _torch_dtype(dtype).itemsize
    case = dict(section="captured", kind="decode_step", dtype=dtype, causal=False,
                shape=dict(layers=L, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=N, head_dim=d),
                work=dict(kv_bytes=kv_bytes), unit="TB/s", results=[])
    if progress is not None:
        progress.set_description(f"captured decode step, {L} layers")
    qs, ks, vs = [], [], []
    for layer in range(L):
        q, k, v = _device_randn(seed + layer, dtype, (B, Hq, d), (B, Hkv, N, d), (B, Hkv, N, d))
        qs.append(q)
        ks.append(k)
        vs.append(v)
    scale = 1.0 / np.sqrt(d)
    F = torch.nn.functional

    def sdpa_step():
        return [F.scaled_dot_product_attention(qs[i][:, :, None], ks[i], vs[i], enable_gqa=Hq != Hkv)
                for i in range(L)]

    def ours_step():
        return [ik.decode(qs[i], ks[i], vs[i], scale=scale, backend="cupy") for i in range(L)]

    case["results"] = captured_rows({"sdpa": sdpa_step, "cupy": ours_step}, kv_bytes, target_ms)
    base = next((r for r in case["results"] if r["runner"] == "sdpa captured" and r.get("status") == "ok"), None)
    for r in case["results"]:
        if base is not None and r.get("status") == "ok":
            r["speed_vs_sdpa_captured"] = round(base["ms"] / r["ms"], 4)
    _finish_case(case)
    for layer_tensors in (qs, ks, vs):          # the caches die before the next section
        layer_tensors.clear()
    release_device_cache()
    if progress is not None:
        progress.update(1)
    if into is None:
        return [case]
    into.append(case)
    return into


def captured_text(case) -> str:
    """A captured-section case as a few lines of text (None: says that no run is recorded)."""
    if case is None:
        return ("No run of the captured section is recorded yet: on a GPU, "
                "`python -m iokernels bench --sections captured` times one.")
    s = case["shape"]
    lines = [f"decode step: {s['layers']} layers, B={s['batch']}, GQA {s['heads_q']}/{s['heads_kv']}, "
             f"N={s['seqlen']}, d={s['head_dim']}, {case['dtype']}",
             f"{'runner':<16}{'ms':>9}{'host ms':>10}{'vs SDPA captured':>18}  note"]
    for r in case["results"]:
        ok = r.get("status") == "ok"
        ms = f"{r['ms']:.3f}" if ok else "-"
        host = f"{r['host_ms']:.3f}" if ok and r.get("host_ms") is not None else "-"
        speed = f"{r['speed_vs_sdpa_captured']:.2f}" if r.get("speed_vs_sdpa_captured") is not None else "-"
        lines.append(f"{r['runner']:<16}{ms:>9}{host:>10}{speed:>18}  {'' if ok else r.get('status', '')[:100]}")
    return "\n".join(lines)
