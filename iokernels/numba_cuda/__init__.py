"""Step 5a: the kernels on a GPU, in Numba CUDA (Python syntax, line by line next to NumPy).

Each kernel mirrors a NumPy version of steps 2-4 and is checked against the float64
oracle; without a GPU the same kernels run on Numba's CUDA simulator (tiny sizes only:
every thread is a Python thread).  Kernels live in :mod:`.flash_fwd` (FlashAttention
forward, versions v1-v3), :mod:`.decode_kernels` (Flash-Decoding split + combine,
contiguous and paged, and the paged gather: version 1, the default) and :mod:`.decode_v2`
(version 2 of the split kernels and the gather: candidates, selected with
``DecodeConfig(version=2)``, not yet measured on a GPU).

Public launchers (``ik.attention(..., backend="numba")`` etc. dispatch here):

* :func:`attention` (q, k, v, causal, scale, window, config=:class:`NumbaConfig`)
* :func:`decode`, :func:`paged_decode` (what ``ik.decode`` / ``ik.paged_decode`` call),
  :func:`paged_decode_pools` (device pools + block tables), :func:`paged_gather`
  (what ``cache.gather(sid, backend="numba")`` calls), :func:`gather_pools`.

They take NumPy arrays (copied in and out), Numba device arrays, CuPy arrays or torch CUDA
tensors (through ``__cuda_array_interface__``, no copy) and return the kind given.
float16, float32 and float64 inputs; accumulation in float32 (float64 for float64).
bfloat16 is not supported here (ValueError): use the CuPy backend.

The versions and what they measured: one H200 (driver 580.159.04, torch 2.11, numba 0.68 +
numba-cuda 0.30.4, numpy 2.5), 2026-11-29, ``python -m iokernels.numba_cuda.bench_gpu``,
every ratio against torch measured in the same run; the file is
benchmarks/results/numba_h200_2026-11-29.json.

FlashAttention forward, float32, B=8, H=16, N=4096, d=128, non-causal (4 N^2 d FLOP a head);
SDPA EFFICIENT 23.4 ms = 47.0 TFLOP/s (FLASH and cuDNN have no float32 kernel):

    v1 thread per row, K/V from global            391 ms    2.8 TFLOP/s   0.06x EFFICIENT
    v2 thread per row, K_j/V_j in shared memory    153 ms    7.2 TFLOP/s   0.15x
    v3 8 lanes x 4 rows a thread, shuffles         102 ms   10.8 TFLOP/s   0.23x   (default)
    v4 v3 with a 2-key step (unrolled: no local memory)   candidate, not yet measured (bench row numba:v4)
       v3 with batched lane sums                   120 ms    9.2 TFLOP/s   0.20x
       v3 batched, 2 rows a thread / Bc = 16       119 / 122 ms   9.2 / 9.0 TFLOP/s
    float16 inputs, v3 batched (float32 math):     117 ms    9.4 TFLOP/s   vs FLASH 359, cuDNN 657

  Bar 0.25x EFFICIENT: missed by 8% (0.23x).  v3 is bound by instruction issue, not by
  HBM: each multiply-add needs a shared-memory load (one value feeds R = 4 rows), each key
  a 3-step shuffle butterfly per row, and NVVM does not unroll the key loop, so the step's
  scores live in local memory (33 local loads/stores in v3's PTX; 98 with batched sums,
  the likely reason batching measured slower).  Our estimate of ~170 registers a thread
  (q and O: 2 x 4 x 16 values) would leave about 12 warps an SM; not profiled.  Numba exposes no tensor-core (mma) instructions, so float16 gains nothing: it is the
  float32 kernel with half the bytes loaded.  The CuPy backend's tensor-core kernels are
  the next step.

Decode, float16, GQA 32 query / 8 KV heads, d=128, B=1, N=32768 (134 MB of K and V), KV
bytes per second; best SDPA backend cuDNN 0.050 ms = 2.70 TB/s (FLASH 2.32):

    split + combine, num_splits heuristic (S=None)   0.448 ms   0.30 TB/s   0.11x best SDPA   (v1, default)
    split + combine, S = 128                         0.411 ms   0.33 TB/s   0.12x
    paged (random block table, bs 16), S=None        0.794 ms   0.17 TB/s   0.06x              (v1, default)
    v2: 8-byte word loads, bit-cast unpack           candidate, not yet measured   (bench row numba:v2)
    v2-L32K8: 32 lanes a key, 8 keys in flight       candidate, not yet measured   (numba:v2-L32K8)
    v3: pipelined loads, reduce-scatter lane sum     candidate, not yet measured   (numba:v3, numba:v3 paged;
        :mod:`.decode_v3`)
    v2 paged (table stage 128, Bn a constant)        candidate, not yet measured   (numba:v2 paged)

  Version 2 (:mod:`.decode_v2`) answers the diagnosis below: K/V rows read as uint64 words
  (4 halves a load, a warp moves 256 bytes per load instruction), each word unpacked in
  registers by a bit-cast intrinsic, all per-thread arrays indexed by compile-time loops
  (PTX: 16 ld.global.u64 in the main loop, no 2-byte K/V loads; ptxas: 155 registers, no
  spills, for float16 d=128 at sm_90; the 160-byte stack frame is the state handed to
  the final merge, as in v1).  Predicted: a few x v1; the next GPU run measures it.

  Bar 0.5x: missed (0.11x).  Each lane loads its 8 of d's 128 dims as scalar 2-byte loads
  (Numba has no 16-byte vector loads of float16 rows), so a warp instruction moves 64 bytes
  where CUDA C++ moves 512; too few bytes are in flight per SM to stream HBM.  The first
  run's version (one key per group per iteration) reached 0.40 TB/s (0.15x) contiguous at
  S=None and 0.50 TB/s (0.19x) at S=64, but 0.105 TB/s paged; loading 4 keys per group
  before the math (this code) helped the paged kernel and hurt the contiguous one
  (register pressure): both numbers are recorded.

Paged gather, float16, 32K tokens x 8 KV heads x d=128, block size 16, K and V read and
written (268 MB moved): a torch device-to-device copy of the same bytes 0.072 ms = 3.74 TB/s;

    gather, 8-byte words, 4 rows' loads before their stores   0.198 ms   1.35 TB/s   0.36x copy   (v1)
    gather, float16 elements                                  0.262 ms   1.03 TB/s   0.27x
    gather v2, grid-stride over (block, part) work items      candidate, not yet measured (numba:v2 gather)

  (The day's later scripts/gpu_all.sh run, bench rows "numba gather": 0.91x a copy at 4096
  tokens, 0.14x at 131072.)  Version 2: one warp per (logical block, part), the table
  entry read once by lane 0 and shuffled to the warp (no barrier), 8 words of K and of V in
  flight per lane, at most 8 blocks per SM looping over the work items; sequences with few
  blocks are cut into parts so that ~32 warps per SM have work.

  Bar 0.6x: missed (0.36x).  One thread block per 16-token logical block moves only 64 KiB,
  starts with a barrier for its table entry, and each thread keeps 8 loads of 8 bytes in
  flight; a copy kernel streams with fewer, larger blocks and 16-byte accesses.

compute-sanitizer on :func:`sanitize_cases` (every kernel at ragged shapes), same code:
memcheck 0 errors, racecheck 0 hazards.  tests/test_numba_gpu.py: 11 passed on the H200.

Other entry points: :mod:`.counting` (global-memory traffic counted on the simulator),
:mod:`.ptx` (compile to PTX without a GPU), :func:`sanitize_cases` (each kernel once at a
ragged shape, for compute-sanitizer).

The NumPy 2.5 fix for numba-cuda 0.30.4 lives in :mod:`._compat`, imported first.
"""
from __future__ import annotations

from . import _compat  # noqa: F401  (must run before numba is imported)
from .decode_kernels import (DecodeConfig, decode, gather_pools, paged_decode,  # noqa: E402
                             paged_decode_pools, paged_gather)
from .flash_fwd import NumbaConfig, attention  # noqa: E402

__all__ = ["attention", "decode", "paged_decode", "paged_decode_pools", "paged_gather", "gather_pools",
           "NumbaConfig", "DecodeConfig", "sanitize_cases", "bench_versions"]


def bench_versions(op: str, dtype: str) -> dict:
    """The numbered versions the side-by-side benchmark (:mod:`iokernels.bench`) times:
    {label: config}.  Rows show up as ``numba:<label>`` (prefill, decode), ``numba:<label>
    paged`` and ``numba:<label> gather``.  Version 1 of decode and gather is the default;
    the v2 rows are candidates not yet measured (``v2-L32K8``: 32 lanes a key, 8 keys a group
    in flight, an alternative tiling to compare)."""
    if op == "attention":
        return {f"v{v}": NumbaConfig(version=v) for v in (1, 2, 3, 4)}
    if op in ("decode", "paged_decode"):
        return {"v1": DecodeConfig(version=1), "v2": DecodeConfig(version=2),
                "v2-L32K8": DecodeConfig(version=2, lanes_per_key=32, keys_per_iter=8),
                "v3": DecodeConfig(version=3)}
    if op == "gather":
        return {"v1": DecodeConfig(version=1), "v2": DecodeConfig(version=2), "v3": DecodeConfig(version=3)}
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
    for version in (1, 2, 3, 4):
        o, _ = attention(q, k, v, causal=True, scale=59 ** -0.5, window=(-1, -1),
                         config=NumbaConfig(version=version))
        note(f"forward v{version}", o, ref)
    qd = rng.standard_normal((3, 8, 59)).astype(np.float32)
    lens = np.array([45, 7, 0], np.int32)
    ref, _ = reference.decode(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), seq_lens=lens)
    for s in (1, 3):
        o, _ = decode(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), seq_lens=lens, num_splits=s)
        note(f"decode S={s}", o, ref)
    # version 2: the element path (d = 59, float32) and the 8-byte word path (float16, d = 64)
    o, _ = decode(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), seq_lens=lens, num_splits=3,
                  config=DecodeConfig(version=2))
    note("decode v2 S=3 float32 d=59", o, ref)
    qh = rng.standard_normal((3, 8, 64)).astype(np.float16)
    kh = rng.standard_normal((3, 2, 45, 64)).astype(np.float16)
    vh = rng.standard_normal((3, 2, 45, 64)).astype(np.float16)
    refh, _ = reference.decode(qh, kh, vh, seq_lens=lens)
    for s in (1, 3):
        o, _ = decode(qh, kh, vh, seq_lens=lens, num_splits=s, config=DecodeConfig(version=2))
        note(f"decode v2 S={s} float16 d=64", o, refh)
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
    o, _ = paged_decode(qp, cache, sids, num_splits=2, config=DecodeConfig(version=2))
    note("paged decode v2 S=2", o, ref)
    kg, _ = paged_gather(cache, sids[0], config=DecodeConfig(version=2))
    note("paged gather v2 float32 d=59", kg, cache.gather(sids[0])[0])
    ch = PagedKVCache(12, block_size=16, num_kv_heads=2, head_dim=64, dtype=np.float16)
    sh = [ch.new_sequence() for _ in range(2)]
    for sid, n in zip(sh, (45, 13)):
        ch.append(sid, rng.standard_normal((n, 2, 64)).astype(np.float16),
                  rng.standard_normal((n, 2, 64)).astype(np.float16))
    qq = rng.standard_normal((2, 8, 64)).astype(np.float16)
    kk = np.stack([np.pad(ch.gather(s)[0], ((0, 0), (0, 45 - ch.seq_len(s)), (0, 0))) for s in sh])
    vv = np.stack([np.pad(ch.gather(s)[1], ((0, 0), (0, 45 - ch.seq_len(s)), (0, 0))) for s in sh])
    refp, _ = reference.decode(qq, kk, vv, seq_lens=np.array([45, 13]))
    o, _ = paged_decode(qq, ch, sh, num_splits=2, config=DecodeConfig(version=2))
    note("paged decode v2 S=2 float16 d=64", o, refp)
    kg, _ = paged_gather(ch, sh[0], config=DecodeConfig(version=2))
    note("paged gather v2 float16 d=64", kg, ch.gather(sh[0])[0])
    # version 3 (candidates): the word path (float16 d=64), the element path (float32 d=59)
    v3 = DecodeConfig(version=3)
    for s in (1, 3):
        o, _ = decode(qh, kh, vh, seq_lens=lens, num_splits=s, config=v3)
        note(f"decode v3 S={s} float16 d=64", o, refh)
    kc3, vc3 = k[:1].repeat(3, 0), v[:1].repeat(3, 0)
    o, _ = decode(qd, kc3, vc3, seq_lens=lens, num_splits=3, config=v3)
    note("decode v3 S=3 float32 d=59", o, reference.decode(qd, kc3, vc3, seq_lens=lens)[0])
    o, _ = paged_decode(qq, ch, sh, num_splits=2, config=v3)
    note("paged decode v3 S=2 float16 d=64", o, refp)
    kg, _ = paged_gather(ch, sh[0], config=v3)
    note("paged gather v3 float16 d=64", kg, ch.gather(sh[0])[0])
    kg, _ = paged_gather(cache, sids[0], config=v3)
    note("paged gather v3 float32 d=59", kg, cache.gather(sids[0])[0])
    return results
