"""FlashAttention and Flash-Decoding in CUDA C++, compiled at run time and launched through CuPy.

The .cu files in ``kernels/`` hold the kernels; the modules here hold their launchers:
argument checks, the config of each op (:mod:`.config`), compilation with the config's
``-D`` defines (NVRTC, through ``cupy.RawModule``: :mod:`.launch`), the launch, and the
conversion of inputs and outputs (:mod:`iokernels.core.arrays`).  Read each .cu file next
to the NumPy step it implements (:mod:`iokernels.tiled`, :mod:`iokernels.decode`,
:mod:`iokernels.paged`).

==================  ================================================================
module              what it holds
==================  ================================================================
config.py           every config class and its constants, re-exported from their homes:
forward_config      ForwardConfig, fit_config (fa_v1.cu .. fa_v2.cu: sizes, SRAM, defines)
decode_config       DecodeConfig and the decode kernels' SRAM arithmetic (v6's: decode_v6_config.py;
                    v7's group split: decode_v7_config.py; v8's Hopper tiles and tensor maps:
                    decode_v8_config.py)
backward_config     BackwardConfig (bwd_v1.cu .. bwd_v4.cu)
gather_config       GatherConfig (paged_gather.cu)
mla_config          MLADecodeConfig (mla_decode.cu)
config_checks       the field checks every config class uses
policy.py           every choose-a-size rule (decode splits, the v4 block shape, MLA splits, the Hopper
                    tiles by head dim) and the gate of versions not yet measured (HELD_BACK)
launch.py           the .cu sources, NVRTC compile cache, device facts, dtype ids, contiguity, streams
forward.py          attention: fa_v1.cu, fa_v1b.cu, fa_v2.cu
decode.py           decode, paged decode: decode.cu, decode_v2.cu .. decode_v9.cu (v8: Hopper, contiguous;
                    v9: v4 dealt in equal runs of keys, policy.decode_balanced_deal);
                    decode_combine.cu, the separate combine with the splits read side by side
                    (DecodeConfig(combine="parallel"); decode.cu's walks them in turn)
decode_launch       the split kernels' launch: what a shape fixes, what a call packs, the grid
gather.py           paged gather: paged_gather.cu
paged_prefill       paged prefill: paged_prefill_v1.cu, one launch for a packed batch of chunks, and
                    paged_prefill_v2.cu (GQA packed; PagedPrefillConfig: paged_prefill_config.py;
                    the argument checks every version shares: paged_prefill_args.py)
hopper/             the Hopper (sm_90a) attention kernels (fa_v3.cu .. fa_v8.cu; hopper_tile.cuh: their
                    tile math), their tensor maps, the GEMM, the paged prefill v3
                    (hopper/paged_prefill.py: paged_prefill_v3.cu) and the opt-in FP8 forward
                    (hopper/fp8_forward.py: fa_fp8_v1.cu, fa_fp8_v2.cu)
hadamard.py         the randomized Hadamard transform of rows (fwht.cu), FP8's incoherent processing
mla.py              MLA decode (absorbed form) on Hopper: mla_decode.cu
plans.py            DecodePlan, PagedDecodePlan, PLANS: plan once per shape, run many times
packed.py           ArgBuffer: a plan's kernel arguments packed once, launched through the driver
attention_plan      AttentionPlan (the portable and the Hopper forward)
backward_plan       BackwardPlan (rowsum, the main loop, finish; dQ atomic or deterministic)
gather_plan         GatherPlan (the paged gather over device pools)
mla_plan            MLADecodePlan, PagedMLADecodePlan (MLA decode on Hopper)
paged_prefill_plan  PagedPrefillPlan (the paged prefill over device pools, every version; v3's tensor
                    maps once per address set)
calls.py            the public attention, decode, paged_decode_pools, attention_backward, gather_pools,
                    mla_decode, paged_mla_decode, paged_prefill_pools: a cached plan, else eager
backward.py         attention_backward: bwd_v1.cu, bwd_v2.cu (mma.cuh, mma_common.cuh: the tensor-core helpers),
                    bwd_v3.cu, bwd_v4.cu (Hopper: hopper_attention.cuh, the TMA maps of hopper/)
registry.py         REGISTRY (every (op, version)), need(), the checks
sanitize.py         sanitize_cases(): every registered kernel at ragged shapes
==================  ================================================================

The versions
------------
Each family module ends with one record per version (:class:`iokernels.core.records.Record`:
file, kernel, config class, check, rank, summary, argument builder) and
``REGISTRY.add(*RECORDS)``; ``config=ForwardConfig(version=...)`` etc. picks one, None the
highest-ranked version whose check passes for the call.  Each .cu file's header says what
its version changes against the one before, why, and what limits it.  The table is
generated from the records (``REGISTRY.version_table()``; tests/test_records.py keeps it in
step):

.. versions:cupy:begin
====================  =======  ===================  ====  ====================================================
op                    version  file                 rank  what it adds
====================  =======  ===================  ====  ====================================================
attention             v11      fa_v11.cu            180   Hopper: v8 with its blocks longest first (causal:
                                                          each head's heaviest query tiles first, in groups of
                                                          heads whose K and V fit the L2 cache)
attention             v10      fa_v10.cu            170   Hopper, head_dim 64: v8 with three consumer
                                                          warpgroups (a 192-row query tile) taking turns on
                                                          the tensor cores
attention             v9       fa_v9.cu             160   Hopper: v8 as a persistent kernel (a block an SM
                                                          claims query tiles, the next tile's Q and K loaded
                                                          during the last one's end)
attention             v8       fa_v8.cu             150   Hopper: v7 with the masked softmax reading two key
                                                          bounds a row, and 80-key tiles at head_dim 256 (the
                                                          default)
attention             v7       fa_v7.cu             140   Hopper: v5 with K and V tiles released apart, so two
                                                          stages keep the next tile landing
attention             v6       fa_v6.cu             130   Hopper, head_dim 64: v5 with three consumer
                                                          warpgroups (a 192-row query tile) taking turns on
                                                          the tensor cores (held back from the default until
                                                          measured)
attention             v5       fa_v5.cu             120   Hopper: v4 + ping-pong between consumer warpgroups,
                                                          softmax overlapped with P V
attention             v4       fa_v4.cu             110   Hopper: v3 + a producer warpgroup (warp
                                                          specialization), setmaxnreg
attention             v3       fa_v3.cu             100   Hopper: wgmma from SRAM, TMA tile loads, an mbarrier
                                                          a stage
attention             v2       fa_v2.cu             30    tensor cores (mma.sync, ldmatrix) for
                                                          float16/bfloat16, FlashAttention-2's warp-
                                                          per-16-rows structure, S and P in registers,
                                                          cp.async double buffering
attention             v1b      fa_v1b.cu            20    float32: tiles in row layout copied by cp.async,
                                                          K_j+1 and V_j+1 in flight behind the two products,
                                                          swizzled SRAM, exp2
attention             v1       fa_v1.cu             10    CUDA cores, any dtype: a block owns Q_i, loads K_j,
                                                          V_j into SRAM, register-tiled 16 x 16 threads
attention_backward    v6       bwd_v6.cu            60    Hopper: v5 with dQ handed to a producer warp through
                                                          SRAM and added to HBM by one bulk reduction a panel,
                                                          not by the consumers' atomics
attention_backward    v5       bwd_v5.cu            50    Hopper: v4 with its blocks longest first (the causal
                                                          mask's long K/V tiles start first, in groups of
                                                          heads whose Q/dO tiles share the L2 cache) (held
                                                          back from the default until measured)
attention_backward    v4       bwd_v4.cu            40    Hopper: two consumer warpgroups of 64 keys share
                                                          each Q/dO tile; their halves of dS^T meet in SRAM
                                                          for one dQ product
attention_backward    v3       bwd_v3.cu            30    Hopper (FlashAttention-3's structure): wgmma from
                                                          SRAM, Q/dO by TMA from a producer warpgroup, one
                                                          consumer warpgroup of 64 keys, dS^T through SRAM for
                                                          dQ
attention_backward    v2       bwd_v2.cu            20    FlashAttention-2's backward on the tensor cores
                                                          (mma.sync, ldmatrix): a warp owns 16 keys, P^T/dS^T
                                                          feed dV/dK from registers, dS^T through SRAM for dQ,
                                                          Q/dO tiles by cp.async
attention_backward    v1       bwd_v1.cu            10    FlashAttention-2's backward on CUDA cores: K/V tile
                                                          per block, dK/dV in registers, P recomputed from
                                                          LSE, dQ by atomic adds or deterministic per-tile
                                                          partials
decode, paged_decode  v9       decode_v9.cu         47    v4 with the (b, kv head) pairs' keys laid end to end
                                                          and dealt in equal runs to one wave of blocks where
                                                          one block a pair would leave a last wave (held back
                                                          from the default until measured)
decode                v8       decode_v8.cu         45    Hopper: the group's query heads are the rows of one
                                                          warpgroup's wgmma tile, and the copy engine streams
                                                          K/V tiles into a ring one thread keeps full
decode, paged_decode  v4       decode_v4.cu         40    v3's ring and fused combine with S = Q_g K^T and O
                                                          += P V on the tensor cores (mma.sync m16n8k16, the g
                                                          query heads as the rows of the A operand, P kept in
                                                          registers)
decode, paged_decode  v6       decode_v6.cu         35    v4 with a group past 16 query heads split across a
                                                          team of warps (16 rows each) sharing each K/V tile
                                                          of its cp.async ring: g = 32, 64 and MQA read K/V
                                                          once a KV head
decode, paged_decode  v7       decode_v7.cu         32    v3 with the query group split over blocks (a slice
                                                          of g / GROUP_SPLIT heads each, reading the same K/V
                                                          rows, the repeats from L2) so a lane's registers
                                                          hold its slice, at one 8-warp block an SM
decode, paged_decode  v3       decode_v3.cu         30    v2's ring at 8 warps x 4 stages, the combine fused
                                                          into the split kernel (the last block of a group
                                                          merges), paged block-table entries staged in SRAM
decode, paged_decode  v1       decode.cu            10    each warp reads its key rows with plain 16-byte
                                                          loads into registers, four rows a lane in flight;
                                                          decode.cu's combine kernel merges the splits
decode, paged_decode  v2       decode_v2.cu         0     K/V tiles stream through a per-warp cp.async ring in
                                                          SRAM (copies in flight hold no registers), only
                                                          __syncwarp in the key loop
paged_decode          v5       decode_v5.cu         50    v4 reading a quantized paged cache as it is stored:
                                                          1-byte codes turned into float16 tensor-core
                                                          operands in registers, the per-key scales applied to
                                                          S's and P's columns
paged_prefill         v3       paged_prefill_v3.cu  30    Hopper: fa_v5's pipeline over a paged cache, K/V
                                                          tiles as TMA boxes through the block table, GQA
                                                          packed into the 128-row tile
paged_prefill         v2       paged_prefill_v2.cu  20    v1 with the g query heads of a KV head packed into
                                                          the Q tile's rows (pack_gqa): a block a KV head
                                                          reads each K/V tile once for all g heads
paged_prefill         v1       paged_prefill_v1.cu  10    fa_v2's tensor-core forward over a paged cache: K/V
                                                          tiles of several cache blocks read through the block
                                                          table, bottom-right causal per sequence, one launch
                                                          for a packed batch of chunks
paged_gather          v1       paged_gather.cu      10    16-byte chunks through the block table, one output
                                                          chunk a thread (coalesced stores), a grid-stride
                                                          loop over the sequence
mla_decode            v1       mla_decode.cu        10    Hopper: wgmma S = Q C^T with Q resident, a 2-stage
                                                          TMA ring of 64 cache rows, P via SRAM, O split over
                                                          two warpgroups; split-KV with decode.cu's combine
====================  =======  ===================  ====  ====================================================
.. versions:cupy:end

Decode is Flash-Decoding's split kernel, GQA packed (one block reads a K/V row once for all
g query heads of its group), over a contiguous or a paged cache, with the exact LSE combine;
the split count comes from the SM count and the kernel's occupancy
(:func:`.policy.decode_wave_splits`, a cost model of the split kernel's waves).  The
backward computes D_i = rowsum(dO_i * O_i), then one block per K/V tile (dK_j, dV_j in
registers, summed over the GQA group; S and P recomputed from the saved LSE), dQ by float32
atomic adds or, with ``deterministic=True``, per-tile partials summed in tile order.

The measured speed of each version, next to torch's SDPA in the same run, is in the
benchmark records (``python -m iokernels bench``; :mod:`iokernels.core.recorded`); the
tuning sweeps around the defaults are :mod:`iokernels.bench.sweeps_cupy`.

Inputs and outputs
------------------
CuPy arrays, torch CUDA tensors (float16, bfloat16, float32, float64) and other
``__cuda_array_interface__`` arrays are used in place (no copies) and the result is the
same kind of array, allocated by the caller's library and computed on the caller's stream;
NumPy arrays are copied in and out.  bfloat16 travels as its 16-bit pattern (CuPy has no
bfloat16 dtype).  Rows must have unit stride on head_dim (other strides are fine);
otherwise one copy is made.

Plan once, run many times
-------------------------
For device arrays, :func:`attention`, :func:`decode`, :func:`paged_decode_pools`,
:func:`attention_backward`, :func:`gather_pools`, :func:`mla_decode`,
:func:`paged_mla_decode` and :func:`paged_prefill_pools` (and ``iokernels.attention`` /
``iokernels.decode`` / ``iokernels.attention_backward`` with ``backend="cupy"``) keep a plan per shape in
:data:`PLANS` (:mod:`.plans`): the checks, the version, the compiled kernel, the split count
and the workspaces are settled on the first call of a shape, and later calls compare one key
and launch.  :class:`DecodePlan`, :class:`PagedDecodePlan`, :class:`AttentionPlan`,
:class:`BackwardPlan`, :class:`GatherPlan`, :class:`MLADecodePlan`,
:class:`PagedMLADecodePlan` and :class:`PagedPrefillPlan` are the same plans made by hand, for
loops (one plan per decode step, reused by every layer).  With device lengths and block tables, a plan's ``run`` neither
synchronizes the host nor copies host memory, so it can be captured in a CUDA graph.

Nothing here touches a GPU at import time; the compiled modules (:mod:`.launch`), the plans
(:data:`PLANS`, each with its workspaces) and the eager path's fused-combine counters (v3 to
v6) are the only state the package holds.
"""
from .config import BackwardConfig, ForwardConfig, GatherConfig, MLADecodeConfig, fit_config  # noqa: F401
from .decode_config import (DecodeConfig, decode_v2_geometry, decode_v2_smem, decode_v3_smem,  # noqa: F401
                            decode_v4_smem, decode_v5_smem)
from .launch import KERNEL_DIR, SOURCES, device_info, source  # noqa: F401
from .registry import REGISTRY, need  # noqa: F401
from .forward import launch_attention, nonmatmul_budget, v2_registers  # noqa: F401
from .decode import launch_decode, paged_decode  # noqa: F401
from .policy import decode_wave_splits, mla_num_splits, split_cost  # noqa: F401
from .gather import launch_gather, paged_gather  # noqa: F401
from . import hopper  # noqa: F401  (its records rank above the portable versions, on Hopper only)
from . import mla  # noqa: F401
from .sanitize import sanitize_cases  # noqa: F401
from .plans import PLANS, DecodePlan, PagedDecodePlan, PlanCache  # noqa: F401
from .attention_plan import AttentionPlan  # noqa: F401
from .backward_plan import BackwardPlan  # noqa: F401
from .gather_plan import GatherPlan  # noqa: F401
from .mla_plan import MLADecodePlan, PagedMLADecodePlan  # noqa: F401
from .paged_prefill_plan import PagedPrefillPlan  # noqa: F401
from .calls import (PLANNED, attention, attention_backward, decode, gather_pools, mla_decode,  # noqa: F401
                    paged_decode_pools, paged_mla_decode, paged_prefill_pools)
from .paged_prefill import paged_prefill  # noqa: F401
from .paged_prefill_config import PagedPrefillConfig  # noqa: F401
from .hopper import paged_prefill as hopper_paged_prefill  # noqa: F401  (v3, the default on Hopper)
