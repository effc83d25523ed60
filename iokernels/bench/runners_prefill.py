"""The benchmark's paged prefill rows: the CuPy paged prefill next to our own contiguous prefill.

Each case is B sequences of n cached tokens whose last ``chunk`` tokens are the queries (a
whole prompt when chunk == n, a chunk of a chunked prefill otherwise).  The contiguous row
runs the CuPy forward (``ik.attention(..., backend="cupy")``, bottom-right causal) on
(B, Hq, chunk, d) queries over contiguous (B, Hkv, n, d) K and V; the paged rows run every
registered version of the CuPy paged prefill (each its own row: v1, and v2 with the g query
heads of a KV head packed into one tile) on the same values, packed (B * chunk, Hq, d),
over pools whose blocks are scattered as in a busy server (:func:`.runners.device_pages`),
with device tables, lengths and offsets (no host copy in a call) and the longest chunk
passed as ``max_seqlen_q`` (it sizes the grid, as a server's scheduler knows it), all through
``iokernels.cupy_raw.paged_prefill_pools`` (its plans: the host cost a program pays); the Hopper
v3 row (:mod:`iokernels.cupy_raw.hopper.paged_prefill`, named by its own config class) sits
next to v1's.  ``speed_vs_contiguous``:
the contiguous row's time / this row's time (1 = paging costs nothing).

Split from :mod:`iokernels.bench.runners` (the measuring helpers live there).
"""
from __future__ import annotations

import numpy as np

import iokernels as ik

from .runners import _first_line, _gpu_module, _gpu_rows, _measure, _visible_pairs, device_pages, speed_vs_first
from .timer import release_device_cache


def paged_prefill_call():
    """The CuPy paged prefill over device pools a program calls (its plan cache; every version,
    the Hopper v3 through its own config class): what the paged rows time, host cost included."""
    return _gpu_module("cupy").paged_prefill_pools


def paged_prefill_cases(spec, seed, progress, section="paged_prefill", target_ms=None, into=None):
    """The cases of ``spec`` (dtypes x shapes (batch, cached tokens, chunk rows)); see the module."""
    import torch
    cases = [] if into is None else into
    Hq, Hkv, d = spec["heads_q"], spec["heads_kv"], spec["head_dim"]
    for dtype in spec["dtypes"]:
        tdt = getattr(torch, dtype)
        for B, n, nq in spec["shapes"]:
            flops = 4.0 * B * Hq * d * _visible_pairs(nq, n, True)
            case = dict(section=section, kind="paged_prefill", dtype=dtype, causal=True,
                        shape=dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen=n, chunk=nq, head_dim=d),
                        work=dict(flops=flops), unit="TFLOP/s", results=[])
            progress.set_description(f"{section} {dtype} B={B} n={n} chunk={nq}")
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q = torch.randn((B, Hq, nq, d), device="cuda", dtype=tdt, generator=gen)
            k = torch.randn((B, Hkv, n, d), device="cuda", dtype=tdt, generator=gen)
            v = torch.randn((B, Hkv, n, d), device="cuda", dtype=tdt, generator=gen)
            rows = [_measure("cupy contiguous", "cupy",
                             lambda: ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True),
                             work=flops, unit="TFLOP/s", dtype=dtype, target_ms=target_ms)]
            progress.update(1)
            try:
                ref = ik.attention(q, k, v, causal=True, backend="cupy")
                packed = q.transpose(1, 2).reshape(B * nq, Hq, d).contiguous()
                kp, vp, tables, lens = device_pages(k, v, seed)
                dev = [torch.from_numpy(np.ascontiguousarray(x, np.int32)).cuda()
                       for x in (tables, lens, np.arange(B + 1) * nq)]
                def run(cfg):
                    o, lse = paged_prefill_call()(packed, kp, vp, *dev, causal=True, config=cfg, max_seqlen_q=nq)
                    return o.view(B, nq, Hq, d).transpose(1, 2), lse
                paged = _gpu_rows("cupy", "paged_prefill", run, need=dict(q=packed, k=kp, v=vp), work=flops,
                                  unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms)
                for r in paged:                             # held against the contiguous kernel's output
                    if "max_abs_diff_vs_sdpa" in r:
                        r["max_abs_diff_vs_contiguous"] = r.pop("max_abs_diff_vs_sdpa")
                    if "suspect" in r:
                        r["suspect"] = r["suspect"].replace("SDPA", "the contiguous prefill")
                rows += paged
            except Exception as e:  # a failure of the setup must not stop the sweep
                rows.append({"runner": "cupy:paged_prefill", "group": "cupy",
                             "status": f"failed: {type(e).__name__}: {_first_line(e)}"})
            progress.update(1)
            speed_vs_first(rows, "speed_vs_contiguous")
            case["results"] = rows
            cases.append(case)
            q = k = v = ref = packed = kp = vp = dev = None     # drop the case's tensors first
            release_device_cache()
    return cases
