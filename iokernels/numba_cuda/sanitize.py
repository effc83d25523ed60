"""Every registered Numba kernel once at ragged shapes, checked against the float64 oracle.

Meant to run under ``compute-sanitizer --tool memcheck`` (and racecheck, synccheck, initcheck)
on a GPU: ``python -c "import iokernels.numba_cuda as n; n.sanitize_cases()"``
(scripts/sanitize.py); also runs on the simulator.  The cases iterate
:data:`iokernels.numba_cuda.REGISTRY`, so a new version is covered when it is registered.
Each decode and gather version runs its element path (float32, d = 59: rows that are not
whole 8-byte words) and its word path (float16, d = 64); each decode also a sliding window,
and the paged decode the quantized caches of :data:`QUANT_CASES` (held against the oracle
on the values the cache holds, its codes times its scales); the paged prefill runs
:data:`PREFILL_CHUNKS` over the same cache, causal and not.
"""
from __future__ import annotations

import numpy as np

from ..core import reference, testing
from ..paged import PagedKVCache
from .registry import REGISTRY, need

#: the largest error a case may show against the float64 oracle (float16 inputs, float32 sums)
SANITIZE_TOL = 1e-2
#: (dtype, head dim) of the decode/gather cases: the element path, then the 8-byte word path
PATHS = (("float32", 59), ("float16", 64))
#: ragged decode lengths: a partial last tile, a short sequence, an empty one
DECODE_LENS = (45, 7, 0)
#: paged sequences (block size 16: a partial last block each)
PAGED_LENS = (45, 13)
#: the decode cases' sliding window: it starts mid-block, inside the first of 3 splits
WINDOW = (20, 0)
#: the paged prefill's chunks of PAGED_LENS: a whole prompt (several Q tiles), a partial chunk
PREFILL_CHUNKS = (45, 5)
#: quantized paged caches: (code format, scale granularity)
QUANT_CASES = (("int8", "block_head"), ("float8_e4m3fn", "block"))


def _paged(rng, dtype, d, **quant):
    cache = PagedKVCache(12, block_size=16, num_kv_heads=2, head_dim=d, dtype=np.dtype(dtype), **quant)
    sids = [cache.new_sequence() for _ in PAGED_LENS]
    for sid, n in zip(sids, PAGED_LENS):
        cache.append(sid, rng.standard_normal((n, 2, d)).astype(dtype), rng.standard_normal((n, 2, d)).astype(dtype))
    n_max = max(PAGED_LENS)
    kk = np.stack([np.pad(cache.gather(s)[0], ((0, 0), (0, n_max - cache.seq_len(s)), (0, 0))) for s in sids])
    vv = np.stack([np.pad(cache.gather(s)[1], ((0, 0), (0, n_max - cache.seq_len(s)), (0, 0))) for s in sids])
    return cache, sids, kk, vv


def _prefill_reference(q, cache, sids, cq, causal):
    """The float64 oracle of a paged prefill, on a contiguous copy of each sequence."""
    out = np.zeros(q.shape)
    for b, sid in enumerate(sids):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        k, v = (x.astype(np.float64)[None] for x in cache.gather(sid))
        o, _ = reference.attention(q[rows].astype(np.float64).transpose(1, 0, 2)[None], k, v, causal=causal)
        out[rows] = o[0].transpose(1, 0, 2)
    return out


def sanitize_cases(seed: int = 0, verbose: bool = True):
    """Run every (op, version) of the registry at ragged shapes against the oracle; returns
    [(case name, max error)].  Raises AssertionError on a wrong result."""
    rng = np.random.default_rng(seed)
    results = []

    def note(name, out, ref):
        err = float(np.max(np.abs(testing.as_numpy(out).astype(np.float64) - ref))) if np.size(ref) else 0.0
        results.append((name, err))
        if verbose:
            print(f"sanitize_cases: {name}: max err {err:.2e}", flush=True)
        assert np.isfinite(err) and err < SANITIZE_TOL, f"{name}: max err {err}"

    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45,
                                  head_dim=59, dtype="float32")
    ref_fwd, _ = reference.attention(q, k, v, causal=True)
    lens = np.array(DECODE_LENS, np.int32)
    for kern in REGISTRY:
        cfg = kern.config_class(version=kern.version)
        tag = f"{kern.op} {kern.version}"
        if kern.op == "attention":
            o, _ = kern.launcher(q, k, v, causal=True, scale=59 ** -0.5, window=(-1, -1), config=cfg)
            note(tag, o, ref_fwd)
            continue
        if kern.op == "attention_backward":
            do = rng.standard_normal(q.shape).astype(q.dtype)
            o, lse = reference.attention(q, k, v, causal=True)
            o, lse = o.astype(q.dtype), lse.astype(np.float32)
            refs = reference.attention_backward(do, q, k, v, causal=True)
            for det in (False, True):
                got = kern.launcher(do, q, k, v, o, lse, causal=True, scale=59 ** -0.5, window=(-1, -1),
                                    config=cfg.replace(deterministic=det))
                for name, g, r in zip(("dq", "dk", "dv"), got, refs):
                    note(f"{tag} {name} deterministic={det}", g, r)
            continue
        for dtype, d in PATHS:
            qd = rng.standard_normal((len(lens), 8, d)).astype(dtype)
            if kern.op == "decode":
                kd, vd = (rng.standard_normal((len(lens), 2, max(DECODE_LENS), d)).astype(dtype) for _ in range(2))
                if kern.unavailable(need("decode", q=qd, k=kd, v=vd)) is None:
                    ref, _ = reference.decode(qd, kd, vd, seq_lens=lens)
                    for s in (1, 3):
                        o, _ = kern.launcher(qd, kd, vd, seq_lens=lens, num_splits=s, scale=None, config=cfg)
                        note(f"{tag} S={s} {dtype} d={d}", o, ref)
                    ref, _ = reference.decode(qd, kd, vd, seq_lens=lens, window=WINDOW)
                    o, _ = kern.launcher(qd, kd, vd, seq_lens=lens, num_splits=3, scale=None, config=cfg, window=WINDOW)
                    note(f"{tag} S=3 {dtype} d={d} window={WINDOW}", o, ref)
                continue
            if kern.op == "paged_prefill":
                cache, sids, _, _ = _paged(rng, dtype, d)
                cq = np.concatenate([[0], np.cumsum(PREFILL_CHUNKS)]).astype(np.int32)
                qp = rng.standard_normal((int(cq[-1]), 8, d)).astype(dtype)
                if kern.unavailable(need(kern.op, q=qp, cache=cache)) is not None:
                    continue
                for causal in (True, False):
                    o, _ = kern.launcher(qp, cache, sids, cq, causal=causal, scale=None, config=cfg)
                    note(f"{tag} {dtype} d={d} causal={causal}", o, _prefill_reference(qp, cache, sids, cq, causal))
                continue
            if kern.op == "paged_decode":
                for quant in ({},) + tuple(dict(kv_dtype=kv, scale_granularity=g) for kv, g in QUANT_CASES):
                    cache, sids, kk, vv = _paged(rng, dtype, d, **quant)
                    if kern.unavailable(need(kern.op, q=qd[:len(sids)], cache=cache)) is not None:
                        continue
                    kind = f" {cache.kv_dtype} {cache.scale_granularity}" if cache.quantized else ""
                    for window in (None, WINDOW):
                        ref, _ = reference.decode(qd[:len(sids)], kk, vv, seq_lens=np.array(PAGED_LENS), window=window)
                        for s in (1, 2):
                            o, _ = kern.launcher(qd[:len(sids)], cache, sids, num_splits=s, scale=None, config=cfg,
                                                 window=window)
                            note(f"{tag}{kind} S={s} {dtype} d={d} window={window}", o, ref)
                continue
            cache, sids, kk, vv = _paged(rng, dtype, d)
            if kern.unavailable(need(kern.op, q=qd[:len(sids)], cache=cache)) is not None:
                continue
            kg, vg = kern.launcher(cache, sids[0], config=cfg)              # the paged gather
            note(f"{tag} {dtype} d={d}", kg, cache.gather(sids[0])[0])
            note(f"{tag} {dtype} d={d} (V)", vg, cache.gather(sids[0])[1])
    return results
