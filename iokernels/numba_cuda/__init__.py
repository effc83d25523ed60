"""Step 5a: the kernels on a GPU, in Numba CUDA (Python syntax, line by line next to NumPy).

Each kernel mirrors a NumPy version of steps 2-4 and is checked against the float64
oracle; without a GPU the same kernels run on Numba's CUDA simulator (tiny sizes only:
every thread is a Python thread).  Kernels live in :mod:`.flash_fwd` (FlashAttention
forward, versions v1-v3) and :mod:`.decode_kernels` (Flash-Decoding split + combine,
contiguous and paged, and the paged gather).

Public launchers (``ik.attention(..., backend="numba")`` etc. dispatch here):

* :func:`attention` (q, k, v, causal, scale, window, config=:class:`NumbaConfig`)
* :func:`decode`, :func:`paged_decode` (what ``ik.decode`` / ``ik.paged_decode`` call),
  :func:`paged_decode_pools` (device pools + block tables), :func:`paged_gather`
  (what ``cache.gather(sid, backend="numba")`` calls), :func:`gather_pools`.

They take NumPy arrays (copied in and out), Numba device arrays, CuPy arrays or torch CUDA
tensors (through ``__cuda_array_interface__``, no copy) and return the kind given.
float16, float32 and float64 inputs; accumulation in float32 (float64 for float64).
bfloat16 is not supported here (ValueError): use the CuPy backend.

The versions and what they measured (H200, see RESULTS below and
benchmarks/results/numba_h200_*.json; ratios to torch SDPA measured in the same run):

RESULTS (filled in from the GPU run; "not measured" until then)
    forward v1 (thread per row, K/V from global):        not measured
    forward v2 (thread per row, K/V tiles in SRAM):       not measured
    forward v3 (lanes x rows register tiling, shuffles):  not measured
    decode split+combine, paged decode:                   not measured
    paged gather:                                         not measured

Other entry points: :mod:`.counting` (global-memory traffic counted on the simulator),
:mod:`.ptx` (compile to PTX without a GPU), :func:`sanitize_cases` (each kernel once at a
ragged shape, for compute-sanitizer).

The NumPy 2.5 fix for numba-cuda 0.30.4 lives in :mod:`._compat`, imported first.
"""
from __future__ import annotations

from . import _compat  # noqa: F401  (must run before numba is imported)
from .decode_kernels import (decode, gather_pools, paged_decode, paged_decode_pools,  # noqa: E402
                             paged_gather)
from .flash_fwd import NumbaConfig, attention  # noqa: E402

__all__ = ["attention", "decode", "paged_decode", "paged_decode_pools", "paged_gather", "gather_pools",
           "NumbaConfig", "sanitize_cases", "bench_versions"]


def bench_versions(op: str, dtype: str) -> dict:
    """The numbered versions the side-by-side benchmark times: {label: config} (forward only;
    decode and gather have one version, the config None)."""
    if op == "attention":
        return {f"v{v}": NumbaConfig(version=v) for v in (1, 2, 3)}
    return {}


def sanitize_cases(seed: int = 0, verbose: bool = True):
    """Run every Numba kernel once at a ragged shape and check it against the oracle.

    Meant to run under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` on a GPU
    (``python -c "import iokernels.numba_cuda as n; n.sanitize_cases()"``); also runs on the
    simulator.  Raises AssertionError on a wrong result.
    """
    import numpy as np

    from .. import reference, testing
    from ..paged import PagedKVCache
    rng = np.random.default_rng(seed)
    results = []

    def note(name, out, ref):
        err = float(np.max(np.abs(testing.as_numpy(out) - ref))) if np.size(ref) else 0.0
        results.append((name, err))
        if verbose:
            print(f"sanitize_cases: {name}: max err {err:.2e}", flush=True)
        assert np.isfinite(err) and err < 1e-2, f"{name}: max err {err}"

    q, k, v = testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45,
                                  head_dim=59, dtype="float32")
    ref, _ = reference.attention(q, k, v, causal=True)
    for version in (1, 2, 3):
        o, _ = attention(q, k, v, causal=True, scale=59 ** -0.5, window=(-1, -1),
                         config=NumbaConfig(version=version))
        note(f"forward v{version}", o, ref)
    qd = rng.standard_normal((3, 8, 59)).astype(np.float32)
    lens = np.array([45, 7, 0], np.int32)
    ref, _ = reference.decode(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), seq_lens=lens)
    for s in (1, 3):
        o, _ = decode(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), seq_lens=lens, num_splits=s)
        note(f"decode S={s}", o, ref)
    cache = PagedKVCache(12, block_size=16, num_kv_heads=2, head_dim=59, dtype=np.float32)
    sids = [cache.new_sequence() for _ in range(2)]
    for sid, n in zip(sids, (45, 13)):
        cache.append(sid, rng.standard_normal((n, 2, 59)).astype(np.float32),
                     rng.standard_normal((n, 2, 59)).astype(np.float32))
    qp = rng.standard_normal((2, 8, 59)).astype(np.float32)
    tables, plens = cache.block_tables_array(sids)
    kk = np.stack([np.pad(cache.gather(s)[0], ((0, 0), (0, 45 - cache.seq_len(s)), (0, 0))) for s in sids])
    vv = np.stack([np.pad(cache.gather(s)[1], ((0, 0), (0, 45 - cache.seq_len(s)), (0, 0))) for s in sids])
    ref, _ = reference.decode(qp, kk, vv, seq_lens=plens)
    for s in (1, 2):
        o, _ = paged_decode(qp, cache, sids, num_splits=s)
        note(f"paged decode S={s}", o, ref)
    kg, _ = paged_gather(cache, sids[0])
    note("paged gather", kg, cache.gather(sids[0])[0])
    return results
