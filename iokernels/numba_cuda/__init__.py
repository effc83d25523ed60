"""Step 5a: the kernels on a GPU, in Numba CUDA (Python syntax, line by line next to NumPy).

Each kernel mirrors a NumPy version of steps 2-4 and is checked against the float64
oracle; without a GPU the same kernels run on Numba's CUDA simulator (tiny sizes only:
every thread is a Python thread).  Kernels live in :mod:`.flash_fwd` (FlashAttention
forward, versions v1-v4, v4 the default), :mod:`.decode_kernels` (Flash-Decoding split +
combine, contiguous and paged, and the paged gather, version 1; the launchers and
:class:`DecodeConfig`), :mod:`.decode_v2` (version 2: 8-byte word loads, a grid-stride
gather) and :mod:`.decode_v3` (version 3: software-pipelined split kernel, reduce-scatter
lane sums, a block-per-page gather; the default decode).

Public launchers (``ik.attention(..., backend="numba")`` etc. dispatch here):

* :func:`attention` (q, k, v, causal, scale, window, config=:class:`NumbaConfig`)
* :func:`decode`, :func:`paged_decode` (what ``ik.decode`` / ``ik.paged_decode`` call),
  :func:`paged_decode_pools` (device pools + block tables), :func:`paged_gather`
  (what ``cache.gather(sid, backend="numba")`` calls), :func:`gather_pools`.

They take NumPy arrays (copied in and out), Numba device arrays, CuPy arrays or torch CUDA
tensors (through ``__cuda_array_interface__``, no copy, launched on the caller's stream)
and return the kind given.  float16, float32 and float64 inputs; accumulation in float32
(float64 for float64).  bfloat16 is not supported here (ValueError): use the CuPy backend.

What the versions measured: NVIDIA H200, driver 580.159.04, CUDA 13.0, torch 2.11, numba
0.68 + numba-cuda 0.30.4, 2026-11-29 12:47 UTC, ``scripts/gpu_all.sh`` (the benchmark
``python -m iokernels bench``); every ratio against torch timed in the same run; the record
is benchmarks/results/h200_2026-11-29.json, the sweeps that chose the defaults are in
benchmarks/results/sweeps/.

FlashAttention forward, float32, B=8, H=16, N=4096, d=128, non-causal (4 N^2 d FLOP a head);
SDPA EFFICIENT 23.6 ms = 46.7 TFLOP/s (FLASH and cuDNN have no float32 kernel):

    v1 thread per row, K/V from global            392 ms    2.8 TFLOP/s   0.060x EFFICIENT
    v2 thread per row, K_j/V_j in shared memory    155 ms    7.1 TFLOP/s   0.152x
    v3 8 lanes x 4 rows a thread, shuffles         103 ms   10.7 TFLOP/s   0.229x
    v4 v3 with a 4-key step, batched butterflies    87 ms   12.7 TFLOP/s   0.271x   (default)
    (causal: v3 0.227x, v4 0.270x)

  Bar 0.25x EFFICIENT: met by v4 (0.271x).  What v4 changed: NVVM unrolls a 4-key step,
  so the step's scores stay in registers (v3's 8-key step is not unrolled: 33 local
  loads/stores a step in its PTX), and the 4 x R partial dot products go through one
  butterfly whose shuffles are independent of each other.  The kernel is still bound by
  instruction issue, not HBM: one shared-memory load per R = 4 multiply-adds, shuffle
  butterflies for every step, ~250 registers a thread (8 warps an SM).  Numba exposes no
  tensor-core (mma) instructions, so float16 gains nothing here: the CuPy backend's v2 is
  the tensor-core step.

Decode, float16, GQA 32 query / 8 KV heads, d=128, B=1, N=32768 (134 MB of K and V), KV
bytes per second; best SDPA backend cuDNN 0.0503 ms = 2.67 TB/s (the default dispatch,
which ran cuDNN, 0.0491 ms; FLASH 2.32 TB/s):

    v1  split + combine, 2-byte loads                 0.425 ms   0.32 TB/s   0.12x
    v2  8-byte word loads, bit-cast unpack            0.153 ms   0.88 TB/s   0.33x
    v2-L32K8 (32 lanes a key, 8 keys in flight)       0.127 ms   1.05 TB/s   0.40x
    v3  pipelined loads, reduce-scatter lane sums     0.098 ms   1.37 TB/s   0.51x   (default)
    paged (random block table, block size 16): v1 0.06x, v2 0.31x, v3 0.112 ms = 0.45x
    v3 at B=64, N=32768 (2 GB): 2.09 TB/s = 0.47x cuDNN's 4.49

  Bar 0.5x the best SDPA backend: met against the forced cuDNN row (0.512x); against the
  default-dispatch row, the same cuDNN kernel timed 2% faster, it is 0.50x: at the bar
  within run-to-run noise.  What moved it from 0.11x: 8-byte word loads (v2); loads of
  the next step issued before this step's math, a reduce-scatter lane sum (31 shuffles a
  step instead of 80), flat raw-pointer indexing (v3); a combine kernel that keeps 8
  partial outputs in flight (the rolled loop took 30 us at 128 splits, by ncu); split
  counts that divide the key tiles evenly (64, not the occupancy heuristic's 56: 0.100 vs
  0.108 ms in a sweep); and kernels launched on the caller's stream without
  ``as_cuda_array``'s host synchronization.  What is left: Numba has no 16-byte loads of
  16-bit rows and no ``cp.async``; at 113 registers two 8-warp blocks fit an SM, so about
  16 warps x 4 keys x 16 bytes a lane are in flight, and the math between loads is issued
  as scalar float32 (CuPy's C++ kernel reaches 0.95x at this shape).

Paged gather, float16, 131072 tokens x 8 KV heads x d=128, block size 16, K and V read and
written (1074 MB moved): a torch device-to-device copy of the same bytes 0.257 ms = 4.18 TB/s;

    v1 block per logical block, 8-byte words          0.285 ms   3.77 TB/s   0.90x copy   (default)
    v2 grid-stride over (block, part) work items      0.285 ms   3.76 TB/s   0.90x
    v3 block per pool block, 8 words a thread          0.273 ms   3.93 TB/s   0.94x
    (4096 tokens: 0.93x, 0.97x, 1.08x of a 2.14 TB/s copy)

  Bar 0.6x: met.  The earlier record's 0.14x was not the kernel: ``paged.check_block_table``
  checked the 8192-entry table in a Python loop on every call, ~2-3 ms of host time, longer
  than the benchmark's 1 ms launch slack, so the GPU sat idle inside the timed window
  (ncu had put the kernel at 283 us).  The check is vectorized now.

compute-sanitizer memcheck, racecheck, synccheck and initcheck on :func:`sanitize_cases`
(every version at ragged shapes, 23 cases): 0 errors (benchmarks/results/sanitizer_2026-11-29.txt).
GPU tests: benchmarks/results/gpu_tests_2026-11-29.txt.

Other entry points: :mod:`.counting` (global-memory traffic counted on the simulator),
:mod:`.ptx` (compile to PTX without a GPU), :func:`sanitize_cases` (each kernel once at a
ragged shape, for compute-sanitizer).

The NumPy 2.5 fix for numba-cuda 0.30.4 is :func:`iokernels.core.gpu.numba_numpy_fix`, applied first.
"""
from __future__ import annotations

from ..core import gpu as _gpu  # noqa: E402
_gpu.numba_numpy_fix()  # before numba is imported
from .decode_kernels import (DecodeConfig, decode, gather_pools, paged_decode,  # noqa: E402
                             paged_decode_pools, paged_gather)
from .flash_fwd import NumbaConfig, attention  # noqa: E402

__all__ = ["attention", "decode", "paged_decode", "paged_decode_pools", "paged_gather", "gather_pools",
           "NumbaConfig", "DecodeConfig", "sanitize_cases", "bench_versions"]


def bench_versions(op: str, dtype: str) -> dict:
    """The numbered versions the side-by-side benchmark (:mod:`iokernels.bench`) times:
    {label: config}.  Rows show up as ``numba:<label>`` (prefill, decode), ``numba:<label>
    paged`` and ``numba:<label> gather``.  The defaults: forward v4, decode v3, gather v1
    (``v2-L32K8``: v2 at 32 lanes a key, 8 keys a group in flight, a tiling kept for the
    comparison; what each measured is in the module docstring)."""
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

    from ..core import reference, testing
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
    # version 3: the word path (float16 d=64), the element path (float32 d=59)
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
