"""The kernels on a GPU, in Numba CUDA (Python syntax, line by line next to NumPy).

Each kernel mirrors a NumPy version of the progression and is checked against the float64
oracle; without a GPU the same kernels run on Numba's CUDA simulator (tiny sizes only:
every thread is a Python thread).

=============  ==================================================================
module         what it holds
=============  ==================================================================
config         ForwardConfig, DecodeConfig, GatherConfig: what a caller may choose
registry       REGISTRY (every (op, version)), ``need``, the dispatching functions
forward        FlashAttention forward v1-v4
forward_v5     forward v5 (register tiling as a GEMM does it)
forward_v6     forward v6 (v5 with 16-byte shared-memory loads)
forward_v7     forward v7 (v6 with its K/V tile copies in 16-byte chunks)
decode         Flash-Decoding split kernels v1, v2, the combine, the decode launchers
decode_v3      split kernel v3
decode_v4      split kernel v4 (16-byte loads)
decode_v5      split kernel v5 (v4 with exp2: scores in log2 units)
decode_v6      split kernel v6 (v5 with no bounds checks in a split's interior)
gather         the paged gather v1, v3
paged_prefill  the paged prefill v1 (one launch for a packed batch of chunks)
device         device functions the versions share (lane sums, word loads, the group merge)
launch         jit cache, the caller's stream, device views, constants uploaded once
counting       global-memory traffic counted by running the kernels on the simulator
ptx            compile to PTX without a GPU (tests look for float64 and local memory in it)
sanitize       every registered kernel at ragged shapes (for compute-sanitizer)
=============  ==================================================================

The versions, each changing one thing from the one before (generated from the records in
:mod:`.registry`; ``REGISTRY.version_table()``; the highest rank whose check passes is the
default, and :mod:`.registry` says when each one's check fails):

.. versions:numba:begin
====================  =======  ===========================  ====  ============================================
op                    version  file                         rank  what it adds
====================  =======  ===========================  ====  ============================================
attention             v7       numba_cuda/forward_v7.py     7     v6 with its K/V tile copies in 16-byte
                                                                  chunks: one vector load a chunk from the
                                                                  row's flat offset (C-contiguous, 16-byte
                                                                  aligned K/V; else v6's element copy)
attention             v4       numba_cuda/forward.py        4     v3 with a 4-key step NVVM unrolls (scores in
                                                                  registers) and batched butterflies
attention             v3       numba_cuda/forward.py        3     several lanes a row and several rows a
                                                                  thread (register tiling), warp-shuffle sums
attention             v2       numba_cuda/forward.py        2     the block stages K_j, V_j in shared memory
                                                                  once for all its rows (FlashAttention-2's
                                                                  loop)
attention             v1       numba_cuda/forward.py        1     one thread per query row, K and V read from
                                                                  global memory by every row
attention             v5       numba_cuda/forward_v5.py     0     register tiling as a GEMM does it: each
                                                                  thread a TM x TN block of S and a TM-row
                                                                  block of O, Q_i and K_j/V_j in shared
                                                                  memory, no lane sums
attention             v6       numba_cuda/forward_v6.py     0     v5 with 16-byte shared-memory loads: W = 4
                                                                  float32 values a load along the head dim,
                                                                  rows padded by one 16-byte bank group
attention_backward    v1       numba_cuda/backward.py       1     FlashAttention-2's backward: K/V tile per
                                                                  block, dK/dV in registers over the GQA
                                                                  group, P recomputed from LSE, dQ by atomics
                                                                  or deterministic partials
decode, paged_decode  v6       numba_cuda/decode_v6.py      6     v5 with no bounds checks in a split's
                                                                  interior (the steps whose keys and next keys
                                                                  all exist); v5's checked step for the last
                                                                  ones
decode, paged_decode  v5       numba_cuda/decode_v5.py      5     v4 with its scores in log2 units: every
                                                                  exponential one exp2 (the SFU's
                                                                  instruction), no expf argument reduction
decode, paged_decode  v4       numba_cuda/decode_v4.py      4     v3 with 16-byte loads (two words by one
                                                                  vector load): half the lanes a key, so half
                                                                  the lane sums and softmax work a key
decode, paged_decode  v3       numba_cuda/decode_v3.py      3     software-pipelined word loads, reduce-
                                                                  scatter lane sums, flat raw-pointer loads
decode, paged_decode  v1       numba_cuda/decode.py         2     a key's dims over L lanes, element loads,
                                                                  split + combine
decode, paged_decode  v2       numba_cuda/decode.py         1     8-byte word loads unpacked by bit-casts in
                                                                  registers, unrolled loops
paged_prefill         v1       numba_cuda/paged_prefill.py  1     one launch for a packed batch of chunks: a
                                                                  block per (Q tile of a chunk, KV head), its
                                                                  query heads packed, one cache block of K/V
                                                                  staged in shared memory through the block
                                                                  table, bottom-right causal
paged_gather          v1       numba_cuda/gather.py         2     a thread block per logical block, 8- or
                                                                  4-byte words, loads before stores
paged_gather          v3       numba_cuda/gather.py         1     a thread block per pool block, flat runs of
                                                                  8-byte words, UN loads before stores
====================  =======  ===========================  ====  ============================================
.. versions:numba:end

Public functions (``ik.attention(..., backend="numba")`` etc. dispatch here):
:func:`attention`, :func:`decode`, :func:`paged_decode`, :func:`paged_prefill`, :func:`paged_gather`, and on device
pools :func:`paged_decode_pools`, :func:`gather_pools`.  They take NumPy arrays (copied in
and out), Numba device arrays, CuPy arrays or torch CUDA tensors (no copy, launched on the
caller's stream, outputs from the caller's allocator) and return the kind given.  float16,
float32 and float64 inputs, accumulation in float32 (float64 for float64); bfloat16 is
refused with a ValueError (these Numba kernels are written for float16/32/64 only; the CuPy backend runs bfloat16).

Host cost of a call.  A call costs Python time on the host before its kernels run, more
than the CuPy backend's (the benchmark's ``host_ms`` measures it), and most of it is not
this package's to remove:

* Numba's own launch: for every launch its dispatcher types each argument, looks the
  compiled specialization up and packs every array argument as a struct (data pointer,
  shape, strides, item size) in Python; the kernels take 8 (forward) to 18 (decode split)
  arguments, and a decode is two launches (split, combine);
* wrapping each of the caller's arrays, inputs and every output and scratch buffer, as a
  Numba device array (``cuda.as_cuda_array``, from its ``__cuda_array_interface__``);
* the call's own checks, the registry's need and the checks of the versions it ranks.

What is cached, so that a repeated call at the same shape does no more than the above:
each compiled kernel (:func:`.launch.jitted` and Numba's table of specializations), each
kernel factory's function per shape and tiling (``functools.lru_cache``), the split counts
(:func:`.policy.numba_decode_splits`), the device facts (SM count, compute capability: once
per device) and the block tables and lengths uploaded to the device (by content, no copy
while unchanged).  A loop whose host time matters calls the CuPy backend, whose launches
pass raw pointers.

The NumPy 2.5 fix for numba-cuda is :func:`iokernels.core.gpu.numba_numpy_fix`, applied by
:mod:`.launch` before numba is first imported.  Timing and the tuning sweeps are in
:mod:`iokernels.bench` (:mod:`iokernels.bench.sweeps_numba`).
"""
from __future__ import annotations

from .config import BackwardConfig, DecodeConfig, ForwardConfig, GatherConfig, PrefillConfig
from .registry import (REGISTRY, attention, decode, gather_pools, need, paged_decode, paged_decode_pools,
                       paged_gather, paged_prefill)
from .sanitize import sanitize_cases

__all__ = ["REGISTRY", "need", "attention", "decode", "paged_decode", "paged_decode_pools", "paged_gather",
           "paged_prefill", "gather_pools", "ForwardConfig", "DecodeConfig", "GatherConfig", "BackwardConfig",
           "PrefillConfig", "sanitize_cases"]
