"""The package's implementations that give a lab's answer away, grouped (an exercise's ``references``).

While a learner's code is graded these are out of reach (:mod:`iokernels.labs.guard`).
Each group names every route to the same result: the public function, the module's
implementation and its inner loops, the float64 oracle, the PyTorch and GPU back ends.
What a learner legitimately uses stays reachable: NumPy, the HBM arrays and the traffic
counter (:mod:`iokernels.core.traffic`), the conventions (``kv_head``, ``mask``,
``tile_state``, ``key_range``), the input factory, tile configs.

The Numba CUDA paths are guarded once a notebook has imported them (see the guard's limits).
"""
from __future__ import annotations

__all__ = ["ORACLE", "FORWARD", "NAIVE_MODEL", "ONLINE_STEP", "BACKWARD", "MERGE", "DECODE", "PAGED_GATHER",
           "PAGED_APPEND", "CUDA_SOURCE", "ALL_GROUPS"]

#: the float64 oracle: the exact answer of every attention exercise
ORACLE = ("iokernels.core.reference.attention", "iokernels.core.reference.attention_backward",
          "iokernels.core.reference.attention_varlen", "iokernels.core.reference.decode")

#: attention forward, every back end, and the tiled module's loops
FORWARD = ORACLE + (
    "iokernels.api.attention", "iokernels.api.attention_varlen",
    "iokernels.naive.attention",
    "iokernels.tiled.attention", "iokernels.tiled.forward_fa2", "iokernels.tiled.forward_fa1",
    "iokernels.tiled._fa2_head", "iokernels.tiled._fa1_head", "iokernels.tiled._online_step",
    "iokernels.tiled._finalize", "iokernels.tiled.attention_varlen", "iokernels.tiled.forward_flex",
    "iokernels.failure_modes.attention_accumulating_in", "iokernels.failure_modes.textbook_softmax",
    "iokernels.torch_sdpa.attention", "iokernels.torch_sdpa.sdpa", "iokernels.torch_sdpa.naive_attention",
    "iokernels.context_parallel.drivers.ring_attention", "iokernels.context_parallel.drivers.simulate",
    "iokernels.cupy_raw.forward.attention", "iokernels.cupy_raw.forward.run_attention",
    "iokernels.numba_cuda.forward.attention", "iokernels.numba_cuda.forward.launch",
    "iokernels.numba_cuda.counting.count_attention")

#: the closed-form byte counts a traffic prediction is checked against
NAIVE_MODEL = ("iokernels.naive.traffic_model", "iokernels.core.traffic.model")

#: the online-softmax update in the package
ONLINE_STEP = ("iokernels.tiled._online_step", "iokernels.tiled._Rescale.new_max", "iokernels.tiled._finalize",
               "iokernels.online_softmax.online_softmax_steps")

#: attention backward, every back end
BACKWARD = ORACLE + (
    "iokernels.api.attention_backward",
    "iokernels.backward.attention_backward_naive", "iokernels.backward.attention_backward_tiled",
    "iokernels.backward.finite_difference_grads",
    "iokernels.failure_modes.dq_contributions", "iokernels.failure_modes.accumulate_dq",
    "iokernels.torch_sdpa.attention_backward", "iokernels.torch_sdpa.naive_backward",
    "iokernels.context_parallel.drivers.ring_attention_backward",
    "iokernels.cupy_raw.backward.attention_backward", "iokernels.cupy_raw.backward.run_attention_backward",
    "iokernels.cupy_raw.calls.attention_backward", "iokernels.cupy_raw.backward_plan.BackwardPlan.run",
    "iokernels.numba_cuda.backward.attention_backward")

#: the exact LSE merge of partial states
MERGE = ("iokernels.api.merge_states", "iokernels.decode.merge_states", "iokernels.decode.merge_kernel",
         "iokernels.context_parallel.merge.merge_pair")

#: decode, split-KV and paged, every back end (attention with one query row is decode too)
DECODE = FORWARD + MERGE + (
    "iokernels.api.decode", "iokernels.api.paged_decode",
    "iokernels.decode.decode_naive", "iokernels.decode.decode_split_kv", "iokernels.decode.split_kv_grid",
    "iokernels.decode._split_worker", "iokernels.decode.paged_decode_split_kv",
    "iokernels.torch_sdpa.decode",
    "iokernels.cupy_raw.decode.decode", "iokernels.cupy_raw.decode.run_decode",
    "iokernels.cupy_raw.calls.decode", "iokernels.cupy_raw.calls.paged_decode_pools",
    "iokernels.cupy_raw.plans.DecodePlan.run", "iokernels.cupy_raw.plans.PagedDecodePlan.run",
    # the CuPy paged prefill: a chunk of one row over the paged cache is a paged decode step
    "iokernels.cupy_raw.paged_prefill.paged_prefill", "iokernels.cupy_raw.paged_prefill.paged_prefill_pools",
    "iokernels.cupy_raw.calls.paged_prefill_pools", "iokernels.cupy_raw.paged_prefill_plan.PagedPrefillPlan.run",
    "iokernels.numba_cuda.decode.decode", "iokernels.numba_cuda.counting.count_decode")

#: reading a sequence through its block table
PAGED_GATHER = (
    "iokernels.paged.paged_gather", "iokernels.paged.PagedKVCache.gather", "iokernels.paged.PagedKVCache._gather_numpy",
    "iokernels.api.paged_gather", "iokernels.decode.paged_tile_loader",
    "iokernels.cupy_raw.gather.paged_gather", "iokernels.cupy_raw.gather.gather_pools",
    "iokernels.cupy_raw.calls.gather_pools", "iokernels.cupy_raw.gather_plan.GatherPlan.run",
    "iokernels.numba_cuda.gather.gather_pools", "iokernels.numba_cuda.gather.paged_gather",
    "iokernels.numba_cuda.counting.count_gather")

#: the block pool's append, allocation and copy-on-write
PAGED_APPEND = ("iokernels.paged.PagedKVCache.append", "iokernels.paged.PagedKVCache._allocate",
                "iokernels.paged.PagedKVCache._write", "iokernels.paged.PagedKVCache.fork")

#: the package's CUDA C++ kernels as text (their online-softmax update is lab 08's answer)
CUDA_SOURCE = ("iokernels.cupy_raw.launch.source", "iokernels.cupy_raw.launch.inline_headers",
               "iokernels.cupy_raw.launch.hopper_source")

ALL_GROUPS = {"ORACLE": ORACLE, "FORWARD": FORWARD, "NAIVE_MODEL": NAIVE_MODEL, "ONLINE_STEP": ONLINE_STEP,
              "BACKWARD": BACKWARD, "MERGE": MERGE, "DECODE": DECODE, "PAGED_GATHER": PAGED_GATHER,
              "PAGED_APPEND": PAGED_APPEND, "CUDA_SOURCE": CUDA_SOURCE}
