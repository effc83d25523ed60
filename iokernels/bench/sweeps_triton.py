"""Tuning sweep of the Triton split-KV decode: tiles, warps, pipeline depth and split counts
around the default, contiguous and paged, next to torch's SDPA in the same run.

The sweep is data (:data:`DECODE_ROWS`): a label, the :class:`~iokernels.triton_backend.DecodeConfig`
keyword arguments, and how deep the split count fills the GPU -- None for the launcher's
own rule (FlashAttention-2's occupancy rule, one wave of one program a multiprocessor), or
``programs_per_sm``: the same rule asked to fill that many programs on every multiprocessor
(:func:`iokernels.triton_backend.decode.split_count`).  Decode is bound
by memory traffic, and one program of a few warps on a multiprocessor keeps too few bytes in
flight to stream at the memory's speed; the rows measure how deep is enough.  Shapes: the
serving grid (:data:`.sweeps_cupy.SERVING_SHAPES`, float16 GQA 32/8 d=128); paged pools of
16-token blocks from :func:`iokernels.bench.device_pages` (a shuffled block table and the
lengths, on the device, as the benchmark's rows pass them).  Every
time is :func:`iokernels.bench.time_cuda` of the public launcher (what a caller gets).  One
JSON line a row.

    python -m iokernels.bench.sweeps_triton [out.json] [--shapes serving|b8n32768] [--rows "v2,v3,..."]

(``--rows``: only the rows of those labels, comma-separated, underscores for spaces.)

(a GPU with Triton and torch).
"""
from __future__ import annotations

import sys

from .sweeps_cupy import REPS, SERVING_SHAPES, _emit, _save, decode_inputs

#: (label, DecodeConfig keyword arguments, programs_per_sm or None for the launcher's rule)
DECODE_ROWS = (
    ("v1", dict(version="v1"), None),
    ("v1 x2 deep", dict(version="v1"), 2),
    ("v1 x4 deep", dict(version="v1"), 4),
    ("v1 x8 deep", dict(version="v1"), 8),
    ("v1 bn64 x4 deep", dict(version="v1", block_n=64), 4),
    ("v1 bn64 8w x4 deep", dict(version="v1", block_n=64, num_warps=8), 4),
    ("v1 bn16 x8 deep", dict(version="v1", block_n=16), 8),
    ("v1 2 stages x4 deep", dict(version="v1", num_stages=2), 4),
    ("v1 4 stages x4 deep", dict(version="v1", num_stages=4), 4),
    ("v1 bn64 4 stages x4 deep", dict(version="v1", block_n=64, num_stages=4), 4),
    ("v1 2 stages x2 deep", dict(version="v1", num_stages=2), 2),
    ("v1 2 stages x3 deep", dict(version="v1", num_stages=2), 3),
    ("v1 3 stages x3 deep", dict(version="v1", num_stages=3), 3),
    ("v1 2 stages x6 deep", dict(version="v1", num_stages=2), 6),
    ("v1 5 stages x3 deep", dict(version="v1", num_stages=5), 3),
    ("v2", dict(version="v2"), None),
    ("v3", dict(version="v3"), None),
    ("v3 x4 deep", dict(version="v3"), 4),
    ("v3 4 stages x3 deep", dict(version="v3", num_stages=4), 3),
    ("v3 2 stages x4 deep", dict(version="v3", num_stages=2), 4),
)
#: the shape sets ``--shapes`` names: the serving grid, or its one cell B=8 N=32768 alone
SHAPE_SETS = {"serving": SERVING_SHAPES, "b8n32768": tuple(s for s in SERVING_SHAPES
                                                            if (s["batch"], s["seqlen"]) == (8, 32768))}


def sweep_decode(out_path=None, reps=REPS, shapes=SERVING_SHAPES, rows_of=DECODE_ROWS):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from iokernels import bench
    from iokernels import triton_backend as tb
    from iokernels.bench.paged_tables import paged_call_tables
    from iokernels.triton_backend.decode import split_count
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in shapes:
        q, k, v, q4, kv_bytes, group = decode_inputs(shape, "float16")
        best = None
        for name, backend in (("CUDNN", SDPBackend.CUDNN_ATTENTION), ("FLASH", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            try:
                ref = sdpa()[:, :, 0].float()
                ms = bench.time_cuda(sdpa, reps=reps).median_ms
            except RuntimeError as e:                    # a backend that refuses the shape
                print(f"# {group} sdpa {name}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            best = ms if best is None else min(best, ms)
            _emit(rows, dict(group=group, runner=f"sdpa {name}", ms=round(ms, 5),
                             tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3)))
        kp, vp, tables, lens = bench.device_pages(k, v, seed=0, block_size=16)
        tables, lens = paged_call_tables("triton", tables, lens, q.device)     # as the benchmark's rows call it
        for label, kw, deep in rows_of:
            cfg = tb.DecodeConfig(**kw)
            S = None if deep is None else split_count(shape["batch"], shape["heads_kv"], shape["seqlen"],
                                                      cfg.keys_per_tile(False), deep, sms)
            for paged in (False, True):
                fn, args = ((tb.paged_decode_pools, (q, kp, vp, tables, lens)) if paged else (tb.decode, (q, k, v)))
                name = f"triton {label}" + (" paged" if paged else "")
                try:
                    o, _ = fn(*args, num_splits=S, config=cfg)
                    err = float((o.float() - ref).abs().max())
                    ms = bench.time_cuda(fn, *args, num_splits=S, config=cfg, reps=reps).median_ms
                    _emit(rows, dict(group=group, runner=name, ms=round(ms, 5),
                                     tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 3),
                                     ratio_to_best_sdpa=round(best / ms, 3) if best else None,
                                     max_abs_diff_vs_sdpa=err, num_splits=S or "launcher's rule", config=repr(cfg)))
                except Exception as e:                   # a config that does not compile or fit: say so, go on
                    print(f"# {group} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        bench.release_device_cache()
    return _save(out_path, rows)


def _label(word: str) -> str:
    """A row's label as a command line may spell it: underscores for its spaces."""
    return word.strip().replace("_", " ")


def parse_args(argv) -> tuple | None:
    """(out path or None, shapes, rows) of a command line ``[out.json] [--shapes serving|b8n32768]
    [--rows LABEL,LABEL]``; None when it is wrong (a label no row has among them)."""
    rest, out, shapes, rows = list(argv), None, SERVING_SHAPES, DECODE_ROWS
    labels = {label: row for row in DECODE_ROWS for label in (row[0],)}
    while rest:
        a = rest.pop(0)
        if a == "--shapes" and rest and rest[0] in SHAPE_SETS:
            shapes = SHAPE_SETS[rest.pop(0)]
        elif a == "--rows" and rest and all(_label(x) in labels for x in rest[0].split(",")):
            rows = tuple(labels[_label(x)] for x in rest.pop(0).split(","))
        elif out is None and not a.startswith("--"):
            out = a
        else:
            return None
    return out, shapes, rows


def main(argv=None) -> int:
    parsed = parse_args(sys.argv[1:] if argv is None else argv)
    if parsed is None:
        print(f"usage: python -m iokernels.bench.sweeps_triton [out.json] [--shapes {'|'.join(SHAPE_SETS)}] "
              f"[--rows LABEL,...] (labels: {', '.join(r[0] for r in DECODE_ROWS)})")
        return 2
    out, shapes, rows = parsed
    sweep_decode(out, shapes=shapes, rows_of=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
