"""Every registered Triton kernel once at ragged shapes, checked against the float64 oracle.

Meant to run under ``compute-sanitizer`` on a GPU (torch's caching allocator off, so an
out-of-bounds access past a tensor is not hidden inside a larger pooled block)::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        --error-exitcode 99 python3 -c "import iokernels.triton_backend as t; t.sanitize_cases()"

and under Triton's interpreter on a CPU (tests/test_triton.py runs it there).  The cases
iterate :data:`iokernels.triton_backend.REGISTRY`, so a new version is covered when it is
registered: lengths that are not a multiple of any tile, a head dim that is not a power of
two (padded tiles), Nq != Nk under the causal mask, empty sequences, a sliding window, the
atomic and the deterministic dQ.
"""
from __future__ import annotations

import numpy as np

from ..core import reference, testing
from ..paged import PagedKVCache
from .registry import REGISTRY

#: the largest error a case may show against the float64 oracle (float16 inputs, float32 sums)
SANITIZE_TOL = 1e-2
#: ragged decode lengths (a partial last tile, a short sequence, an empty one), paged lengths
DECODE_LENS = (45, 7, 0)
PAGED_LENS = (45, 13)
WINDOW = (20, 0)
HEAD_DIM = 40


def sanitize_cases(seed: int = 0, verbose: bool = True):
    """Run every (op, version) of the registry at ragged shapes against the oracle; returns
    [(case name, max error)].  Raises AssertionError on a wrong result."""
    rng = np.random.default_rng(seed)
    results = []

    def note(name, out, ref):
        err = float(np.max(np.abs(testing.as_numpy(out) - ref))) if np.size(ref) else 0.0
        results.append((name, err))
        if verbose:
            print(f"sanitize_cases: {name}: max err {err:.2e}", flush=True)
        assert np.isfinite(err) and err < SANITIZE_TOL, f"{name}: max err {err}"

    d = HEAD_DIM
    q, k, v, do = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45, head_dim=d,
                                      dtype="float16", with_grad=True)
    lens = np.array(DECODE_LENS, np.int32)
    for kern in REGISTRY:
        cfg = kern.config_class(version=kern.version)
        tag = f"{kern.op} {kern.version}"
        if kern.op == "attention":
            for causal, window in ((True, (-1, -1)), (False, (9, 3))):
                ref, _ = reference.attention(q, k, v, causal=causal, window=window)
                o, _ = kern.launcher(q, k, v, causal=causal, scale=None, window=window, config=cfg)
                note(f"{tag} causal={causal} window={window}", o, ref)
        elif kern.op == "attention_backward":
            o, lse = reference.attention(q, k, v, causal=True)
            o, lse = o.astype(q.dtype), lse.astype(np.float32)
            refs = reference.attention_backward(do, q, k, v, causal=True)
            for det in (False, True):
                got = kern.launcher(do, q, k, v, o, lse, causal=True, scale=None, window=(-1, -1),
                                    config=cfg.replace(deterministic=det))
                for name, g, r in zip(("dq", "dk", "dv"), got, refs):
                    note(f"{tag} {name} deterministic={det}", g, r)
        elif kern.op == "decode":
            qd = rng.standard_normal((len(lens), 8, d)).astype(np.float16)
            kd, vd = (rng.standard_normal((len(lens), 2, max(DECODE_LENS), d)).astype(np.float16) for _ in range(2))
            for s, window in ((1, None), (3, None), (3, WINDOW)):
                ref, _ = reference.decode(qd, kd, vd, seq_lens=lens, window=window)
                o, _ = kern.launcher(qd, kd, vd, seq_lens=lens, num_splits=s, scale=None, config=cfg, window=window)
                note(f"{tag} S={s} window={window}", o, ref)
        elif kern.op == "paged_decode":
            cache = PagedKVCache(12, block_size=16, num_kv_heads=2, head_dim=d, dtype=np.float16)
            sids = [cache.new_sequence() for _ in PAGED_LENS]
            for sid, n in zip(sids, PAGED_LENS):
                cache.append(sid, *(rng.standard_normal((n, 2, d)).astype(np.float16) for _ in range(2)))
            n_max = max(PAGED_LENS)
            kk, vv = (np.stack([np.pad(cache.gather(s)[i], ((0, 0), (0, n_max - cache.seq_len(s)), (0, 0)))
                                for s in sids]) for i in (0, 1))
            qd = rng.standard_normal((len(sids), 8, d)).astype(np.float16)
            for s, window in ((1, None), (2, WINDOW)):
                ref, _ = reference.decode(qd, kk, vv, seq_lens=np.array(PAGED_LENS), window=window)
                o, _ = kern.launcher(qd, cache, sids, num_splits=s, scale=None, config=cfg, window=window)
                note(f"{tag} S={s} window={window}", o, ref)
    return results
