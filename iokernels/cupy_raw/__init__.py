"""FlashAttention and Flash-Decoding in CUDA C++, compiled at run time and launched through CuPy.

The .cu files in ``kernels/`` hold the kernels; the modules here hold their launchers:
argument checks, the config of each op (:mod:`.config`), compilation with the config's
``-D`` defines (NVRTC, through ``cupy.RawModule``: :mod:`.launch`), the launch, and the
conversion of inputs and outputs (:mod:`iokernels.core.arrays`).  Read each .cu file next
to the NumPy step it implements (:mod:`iokernels.tiled`, :mod:`iokernels.decode`,
:mod:`iokernels.paged`).

==============  ================================================================
module          what it holds
==============  ================================================================
config.py       ForwardConfig, DecodeConfig, GatherConfig, BackwardConfig: sizes, SRAM, defines
launch.py       the .cu sources, NVRTC compile cache, device info, streams
forward.py      attention: fa_v1.cu, fa_v1b.cu, fa_v2.cu
decode.py       decode, paged decode: decode.cu, decode_v2.cu .. decode_v4.cu
gather.py       paged gather: paged_gather.cu
hopper.py       the Hopper (sm_90a) attention kernels and their tensor maps
mla.py          MLA decode (absorbed form) on Hopper: mla_decode.cu
backward.py     attention_backward: bwd_v1.cu, bwd_v2.cu (mma.cuh, mma_common.cuh: the tensor-core helpers)
registry.py     REGISTRY (every (op, version)), need(): what a call needs
sanitize.py     sanitize_cases(): every registered kernel at ragged shapes
==============  ================================================================

The versions (``REGISTRY``; ``config=ForwardConfig(version=...)`` etc.; None: the default)
----------------------------------------------------------------------------------------
FlashAttention forward (``attention``):

* **v1** ``fa_v1.cu``: CUDA cores, any dtype (float64 matches the oracle to about 1e-12;
  float16/bfloat16 load and store 16 bits and compute in float32).  A block owns Q_i, loads
  K_j, V_j into SRAM, ``__syncthreads``, folds the tile into (m, l, O); 256 threads as a
  16 x 16 grid, each owning Br/16 rows x Bc/16 keys of S_ij (register tiling); Q_i and K_j
  stored transposed so the inner loop reads vectors.  What limits it: its tile loads are
  synchronous, so the block waits for memory every tile with nothing else to do.  The
  default for float64, and for float32 where cp.async does not exist (sm_75).
* **v1b** ``fa_v1b.cu`` (float32, compute capability 8.0+; the float32 default there):
  v1 with every tile in HBM's row layout, copied as coalesced 16-byte chunks by
  ``cp.async``; K_j+1 is copied while O += P V_j runs and V_j+1 while S_j+1 = Q K_j+1^T
  runs, so each load hides behind a product while SRAM holds one K and one V tile;
  XOR-swizzled K and P^T chunks avoid bank conflicts without padding; exp2 with the scale
  folded in.
* **v2** ``fa_v2.cu`` (float16/bfloat16; their default): the tensor cores through inline-PTX
  ``mma.sync.m16n8k16`` and ``ldmatrix``, FlashAttention-2's structure: each warp owns 16
  query rows, S and P never leave registers, online softmax in registers with exp2, K_j /
  V_j double-buffered with ``cp.async`` (synchronous copies and two m16n8k8 steps a
  product on sm_75), causal/window tile skipping.  What it leaves out: Hopper's wgmma and
  TMA (asynchronous warpgroup products and bulk copies).

Decode (``decode`` and ``paged_decode``): Flash-Decoding's split kernel, GQA packed (one
block reads a K/V row once for all g query heads of its group), over a contiguous or a
paged cache, and the exact LSE combine; the split count from the SM count and the kernel's
occupancy (:func:`.policy.decode_wave_splits`, a cost model of the split kernel's waves).

* **v1** ``decode.cu``: each warp walks its keys with plain 16-byte loads into registers,
  four rows a lane in flight and the math in between; a separate combine kernel merges
  the splits.  What limits it: the loads in flight hold registers, so few bytes are in
  flight per SM.  The default where v3 cannot run (rows that are not whole 16-byte chunks,
  more than 32 of them, or not 16-byte aligned).
* **v2** ``decode_v2.cu``: each warp streams its tiles of K/V rows through a private ring of
  stages in SRAM with ``cp.async`` (copies in flight hold no registers), only
  ``__syncwarp`` in the key loop; block-table entries loaded a tile ahead; tail rows
  zero-filled by cp.async's src-size form.  At v1's 4 warps a block, the deeper queue
  alone does not fill the memory system.
* **v3** ``decode_v3.cu`` (the default where v4 cannot run): v2's ring at 8 warps a block x 4 stages, and the
  combine fused into the split kernel -- each split block writes its partial, waits at a
  block barrier, and one thread bumps the atomic counter of its (batch, kv head) with an
  acquire-release add at GPU scope (the release publishes the block's partial, the acquire
  makes the others' visible); the last block to arrive reads the S partials from L2
  (``ld.global.cg``), merges them and resets the counter (one launch instead of two; the
  counters are a per-stream workspace); ``fused=False`` keeps the paper's two kernels.
  Paged splits stage their block-table entries in SRAM once.
* **v4** ``decode_v4.cu`` (the default for float16/bfloat16, head dims multiples of 16 up
  to 256, g <= 16, compute capability 8.0+): v3's ring, split grid and fused combine, with
  S = Q_g K_j^T and O += P V_j on the tensor cores (``mma.sync.m16n8k16``) -- the g query
  heads of a GQA group are the rows of the A operand, padded to 16 (FlashInfer, Ye et
  al., 2024-2025, runs GQA decode through its tensor-core prefill kernels); K_j through ``ldmatrix``,
  V_j through ``ldmatrix.trans``, P converted to A fragments in registers.  The padding
  wastes (16 - g) / 16 of the tensor cores' work and frees the CUDA cores, which v3 keeps
  busy with 2 x g x d FMAs for every K/V row.  One load path: 16-byte ``cp.async`` chunks,
  through L1 (``.ca``) over a contiguous cache on compute capability 9.0, around it
  (``.cg``) elsewhere.
* **v5** ``decode_v5.cu`` (the default for a quantized paged cache -- int8, float8 e4m3 --
  at head dims 64, 128, 256 where v4's limits hold): v4 reading the cache as its 1-byte
  codes: integer bit tricks turn them into float16 operands (``mma_codes.cuh``), V's
  transpose is done in registers (PRMT), and the per-key power-of-two scales multiply S's
  and P's columns, not the values.

FlashAttention-2 backward (``attention_backward``, ``config=BackwardConfig(...)``): D_i =
rowsum(dO_i * O_i), a main loop with one block per K/V tile (dK_j, dV_j in registers, summed
over the GQA group; S and P recomputed from the saved LSE), dQ by float32 atomic adds or, with
``deterministic=True``, per-tile partials summed in tile order.

* **v1** ``bwd_v1.cu``: CUDA cores, every dtype; a key row a group of lanes, dot products
  joined by warp shuffles.  What limits it: the shuffles and SRAM reads per multiply-add.
  The default for float32 and float64, and for 16-bit inputs where v2 cannot run.
* **v2** ``bwd_v2.cu`` (float16/bfloat16, head_dim <= 128, compute capability 8.0+; their
  default): every product on the tensor cores (``mma.sync.m16n8k16``, ``ldmatrix``); a warp
  owns 16 keys, so S^T, P^T, dP^T and dS^T sit in the accumulator layout that is the A
  operand of dV_j += P^T dO_i and dK_j += dS^T Q_i, straight from registers; dS^T goes
  through SRAM once, in 16 bits, for dQ_i += dS_ij K_j; Q_i, dO_i double-buffered with
  ``cp.async``.  What it leaves out: wgmma/TMA, and the dQ atomics are FlashAttention-2's
  (one float32 add per element per K/V tile).

Paged gather (``paged_gather``): **v1** ``paged_gather.cu``, 16-byte chunks through the
block table, one output chunk a thread.

MLA decode (``mla_decode``, :mod:`.mla`): **v1** ``mla_decode.cu`` (Hopper only), the absorbed
form of multi-head latent attention -- one shared 576-value row a token for all query heads --
on wgmma with the query heads as the rows of S, TMA tiles of cache rows and split-KV.

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

Nothing here touches a GPU at import time; the compiled modules (:mod:`.launch`) and
the fused decode combine's counters (v3 to v5) are the only state the package holds.
"""
from .config import ForwardConfig, GatherConfig, fit_config  # noqa: F401
from .decode_config import (DecodeConfig, decode_v2_geometry, decode_v2_smem, decode_v3_smem,  # noqa: F401
                            decode_v4_smem, decode_v5_smem)
from .launch import KERNEL_DIR, SOURCES, device_info, source  # noqa: F401
from .registry import REGISTRY, need  # noqa: F401
from .forward import attention, launch_attention, nonmatmul_budget, v2_registers  # noqa: F401
from .decode import decode, launch_decode, paged_decode, paged_decode_pools  # noqa: F401
from .policy import decode_wave_splits, split_cost  # noqa: F401
from .gather import gather_pools, launch_gather, paged_gather  # noqa: F401
from .backward import attention_backward  # noqa: F401
from . import hopper  # noqa: E402
from .config import BackwardConfig  # noqa: F401
hopper.register(REGISTRY)          # after the portable versions: ranks above them, on Hopper only
from . import mla  # noqa: E402,F401  (registers mla_decode v1)
from .config import MLADecodeConfig  # noqa: F401
from .mla import mla_decode, paged_mla_decode  # noqa: F401
from .sanitize import sanitize_cases  # noqa: F401
