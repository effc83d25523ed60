"""Step 8c: context parallelism: ring attention over torch.distributed.

Splitting a long sequence over W devices divides both the memory its K/V need and the
attention compute (each device does about 1/W of the FLOPs).  Ring attention
(Liu, Zaharia and Abbeel, 2023) splits the *sequence* across W devices: rank r holds the
queries, keys and values of its positions.  The K/V blocks then travel round a ring:
at step s rank r holds the K/V block of rank (r - s) mod W, computes attention of its
own queries against it, and meanwhile sends that block on to rank r + 1 and receives
the next one from rank r - 1.  After W steps every query has met every key, and the W
partial results are joined by the same exact log-sum-exp merge that joins
Flash-Decoding's splits (:mod:`iokernels.decode`).

Notation
========

=============  =============================================================
W              world size: ranks (devices) on the ring
r, s           a rank and a ring step; at step s rank r holds block c = (r - s) mod W
N, n_r         sequence length and the tokens of rank r (n_r ~ N / W)
Q_r, K_c, V_c  rank r's queries and the K/V block that started on rank c
O, LSE         the running (merged) output and log-sum-exp of a rank's queries
O_b, LSE_b     one block's partial output and log-sum-exp
dK_c, dV_c     gradient accumulators of block c; they travel with the block
Hq, Hkv, d     query heads, K/V heads (GQA: Hq % Hkv == 0), head dim
=============  =============================================================

The merge, pairwise, in the accumulator precision (float32; float64 for float64 inputs),
in the numerically stable sigmoid / log-sigmoid form used by ring-flash-attention::

    LSE' = LSE - log sigmoid(LSE - LSE_b)           (= log(exp LSE + exp LSE_b))
    O'   = O - sigmoid(LSE_b - LSE) * (O - O_b)     (= weights exp(LSE_b - LSE'))

A state with LSE = -inf (no key seen yet) weighs nothing: the other side is taken as it
is, and two empty states stay O = 0, LSE = -inf, never NaN.  Chained over all blocks it
equals :func:`iokernels.decode.merge_states` over all parts at once.

Causal attention (bottom-right aligned, N_q = N_k) and the two splits
---------------------------------------------------------------------
The sequence is cut into chunks.  A chunk pair (query chunk, key chunk) is either fully
visible (the key chunk lies before the query chunk), diagonal (the same chunk: causal
inside) or skipped (the key chunk lies after): the work above the diagonal is never
done.  Per query chunk, the fully visible key chunks and the diagonal one are joined
into one call with bottom-right causal masking, which is exactly "all of the earlier
chunks, then causal within its own".

* ``split="contiguous"``: W chunks, rank r takes chunk r.  Causal work is unbalanced:
  rank 0 computes one diagonal block, rank W - 1 computes W - 1 full blocks and one
  diagonal, and every step waits for the slowest rank.
* ``split="zigzag"``: 2W chunks, rank r takes chunks r and 2W - 1 - r (one early, one
  late), so every rank does the same causal work (the load-balanced split of the
  ring-flash-attention and Llama-3 context-parallel implementations).

Lengths need not divide by W (or 2W): chunks differ by at most one token; the receive
buffers are sized from the split, which every rank knows.

Communication
=============
Each step posts one batched send/receive (``torch.distributed.batch_isend_irecv`` of
two ``P2POp`` s), then computes the block in hand, then waits: the transfer is hidden
behind the computation when the block takes longer to compute than to send.  K and V
travel as one packed (2, B, Hkv, n_c, d) tensor.

* forward: rank r sends W - 1 K/V blocks (every block but that of rank r + 1) and
  receives W - 1 (every block but its own);
* backward: the same W - 1 K/V blocks, plus the dK/dV accumulators (accumulator dtype):
  each travels with its block and takes one last hop home, W sends per rank.

:func:`comm_model` gives these byte counts in closed form; the counters of
:class:`RingStats` count what was really sent, and the tests hold them equal.

One code path, two drivers
==========================
A rank's algorithm is a generator (:func:`_forward_steps`, :func:`_backward_steps`)
that yields its communication requests (``_Send``: post a batched send/receive;
``_Wait``: wait for it and take the received tensor).  :func:`ring_attention` drives it
over a real process group (gloo on CPU processes, NCCL on GPUs); :func:`simulate` drives
W such generators in lockstep in one process, passing the arrays round by hand, so a
notebook can run the ring without launching processes, through the same code.  The steps
are written once for NumPy arrays and torch tensors (:mod:`.arrays`): the simulation runs
on NumPy arrays and needs no torch, unless a torch local kernel asks for tensors.

Local kernels
=============
Any backend computes the blocks: ``ik.attention(..., return_lse=True)`` with "naive",
"tiled", "numba" (NumPy arrays; the Numba simulator on a CPU), "cupy" or "torch" (torch
CUDA tensors pass through without copies); or "torch_fused", torch's fused kernels called
directly for the LSE they compute anyway (flash for fp16/bf16 and memory-efficient for
fp32 on a GPU, the CPU flash kernel on a CPU), the one to time on GPUs.  Block gradients come from
``ik.attention_backward`` ("naive" for the naive forward, "tiled" otherwise) on CPU
tensors, and from :func:`_torch_block_backward` (the same recomputation formulas in torch
ops, a few query rows at a time) on CUDA tensors, because the "torch" backward re-runs
SDPA's own forward and cannot take the ring's global LSE.

Frank notes
-----------
* The "torch" local kernel computes its LSE beside SDPA with a second Q K^T (see
  :mod:`iokernels.torch_sdpa`), so on a GPU it does more work than "torch_fused", which
  reads the LSE from torch's private fused operators (``torch.ops.aten._scaled_dot_product_*``:
  not a public API, so they may change between torch versions).  "torch_fused" repeats
  K/V heads for GQA.  The NumPy kernels are there to be read, not timed.
* The backward on CUDA tensors materializes a score block of query rows by keys (the
  recomputation in torch ops, bounded by TORCH_BWD_BLOCK_BYTES), not a fused kernel.
* Causal needs seqlen_q == seqlen_k (self-attention, what context parallelism is for);
  sliding windows are not offered.
* ``partial_dtype="bfloat16"`` stores each block's output and the running output in
  bfloat16 between steps (as a kernel that returns bf16 blocks would): the merged error
  then grows with W.  The default keeps them in the accumulator precision.

Modules
=======

==========================================  ==================================================
:mod:`~iokernels.context_parallel.split`    the splits and the causal block schedule (NumPy)
:mod:`~iokernels.context_parallel.merge`    the pairwise merge (NumPy or torch)
:mod:`~iokernels.context_parallel.arrays`   the array operations the steps use (NumPy or torch)
:mod:`~iokernels.context_parallel.steps`    a rank's step generators and local blocks
:mod:`~iokernels.context_parallel.drivers`  the process-group driver (torch) and the simulation
:mod:`~iokernels.context_parallel.costs`    closed-form bytes, memory, timeline; experiments
==========================================  ==================================================
"""
from __future__ import annotations

from .costs import (_random_qkv, comm_model, memory_per_rank, merge_error_vs_world_size, schedule_timeline,
                    work_per_rank)
from .drivers import (PARTIAL_DTYPES, RING_BACKENDS, _drive, _GroupComm, _lockstep, _np, _on_this_rank,
                      _partial_dtype, _problem, ring_attention, ring_attention_backward, simulate)
from .merge import _namespace, merge_pair
from .split import SPLITS, _length, _pairs, block_schedule, causal_work, chunk_bounds, shard, split_positions, unshard
from .steps import (_TAG_NAME, DKV_TAG, KV_TAG, TORCH_BWD_BLOCK_BYTES, RingStats, _backward_steps, _block_backward,
                    _block_forward, _forward_steps, _fused_call, _nbytes, _Send, _torch_backward_for,
                    _torch_block_backward, _torch_fused_block, _Wait)

__all__ = ["SPLITS", "split_positions", "chunk_bounds", "shard", "unshard", "merge_pair", "RingStats",
           "ring_attention", "ring_attention_backward", "simulate", "comm_model", "memory_per_rank",
           "causal_work", "block_schedule", "schedule_timeline", "work_per_rank", "merge_error_vs_world_size"]
