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
decode         Flash-Decoding split kernels v1, v2, the combine, the decode launchers
decode_v3      split kernel v3
gather         the paged gather v1, v3
device         device functions the versions share (lane sums, word loads, the group merge)
launch         jit cache, the caller's stream, device views, constants uploaded once
counting       global-memory traffic counted by running the kernels on the simulator
ptx            compile to PTX without a GPU (tests look for float64 and local memory in it)
sanitize       every registered kernel at ragged shapes (for compute-sanitizer)
=============  ==================================================================

The versions, each changing one thing from the one before:

=============  =======  ====================================================================
op             version  what it changes, and why
=============  =======  ====================================================================
attention      v1       one thread per query row reading K and V from global memory: the
                        loop of the NumPy kernel, one row a thread
attention      v2       the block loads K_j, V_j into shared memory once for all its rows
                        (FlashAttention-2's loop order), so HBM traffic drops to the model's
attention      v3       several lanes share a row and a thread keeps several rows, so one
                        shared-memory load feeds several multiply-adds; warp-shuffle sums
attention      v4       (default) a 4-key step that NVVM unrolls, so the step's scores stay
                        in registers, and one butterfly for all of a step's partial sums
decode         v1       split-KV with GQA packing: a key's dims over a group of lanes,
                        element loads, split + combine
decode         v2       8-byte word loads unpacked in registers, so each load moves four
                        times the bytes; unrolled loops keep the state in registers
decode         v3       (default for C-contiguous K/V) the next step's loads issued before
                        this step's math, a reduce-scatter lane sum with fewer shuffles,
                        flat raw-pointer addressing
paged_gather   v1       (default) a thread block per logical block, words when rows allow
paged_gather   v3       a thread block per pool block copying flat runs of 8-byte words,
                        several loads in flight before the stores (C-contiguous pools)
attention_     v1       FlashAttention-2's backward (:mod:`.backward`): a block per K/V tile,
backward                dK/dV in registers, P recomputed from LSE, dQ by atomic adds or
                        deterministic per-tile partials
=============  =======  ====================================================================

``paged_decode`` has the decode versions, over the block pool.  ``REGISTRY.table()`` lists
them with one line each; :mod:`.registry` says how the default is chosen.

Public functions (``ik.attention(..., backend="numba")`` etc. dispatch here):
:func:`attention`, :func:`decode`, :func:`paged_decode`, :func:`paged_gather`, and on device
pools :func:`paged_decode_pools`, :func:`gather_pools`.  They take NumPy arrays (copied in
and out), Numba device arrays, CuPy arrays or torch CUDA tensors (no copy, launched on the
caller's stream, outputs from the caller's allocator) and return the kind given.  float16,
float32 and float64 inputs, accumulation in float32 (float64 for float64); bfloat16 is
refused with a ValueError (Numba has no bfloat16 arithmetic type; the CuPy backend runs it).

The NumPy 2.5 fix for numba-cuda is :func:`iokernels.core.gpu.numba_numpy_fix`, applied by
:mod:`.launch` before numba is first imported.  Timing and the tuning sweeps are in
:mod:`iokernels.bench` (:mod:`iokernels.bench.sweeps_numba`).
"""
from __future__ import annotations

from .config import BackwardConfig, DecodeConfig, ForwardConfig, GatherConfig
from .registry import (REGISTRY, attention, decode, gather_pools, need, paged_decode, paged_decode_pools,
                       paged_gather)
from .sanitize import sanitize_cases

__all__ = ["REGISTRY", "need", "attention", "decode", "paged_decode", "paged_decode_pools", "paged_gather",
           "gather_pools", "ForwardConfig", "DecodeConfig", "GatherConfig", "BackwardConfig", "sanitize_cases"]
