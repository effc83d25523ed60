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
config.py       ForwardConfig, GatherConfig, BackwardConfig, MLADecodeConfig: sizes, SRAM, defines
decode_config   DecodeConfig and the decode kernels' SRAM arithmetic
config_checks   the field checks every config class uses
policy.py       every choose-a-size rule (decode splits, the v4 block shape, MLA splits)
launch.py       the .cu sources, NVRTC compile cache, device facts, dtype ids, contiguity, streams
forward.py      attention: fa_v1.cu, fa_v1b.cu, fa_v2.cu
decode.py       decode, paged decode: decode.cu, decode_v2.cu .. decode_v5.cu
gather.py       paged gather: paged_gather.cu
hopper/         the Hopper (sm_90a) attention kernels, their tensor maps, the GEMM
mla.py          MLA decode (absorbed form) on Hopper: mla_decode.cu
backward.py     attention_backward: bwd_v1.cu, bwd_v2.cu (mma.cuh, mma_common.cuh: the tensor-core helpers)
registry.py     REGISTRY (every (op, version)), need(), the checks
sanitize.py     sanitize_cases(): every registered kernel at ragged shapes
==============  ================================================================

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

Nothing here touches a GPU at import time; the compiled modules (:mod:`.launch`) and
the fused decode combine's counters (v3 to v5) are the only state the package holds.
"""
from .config import BackwardConfig, ForwardConfig, GatherConfig, MLADecodeConfig, fit_config  # noqa: F401
from .decode_config import (DecodeConfig, decode_v2_geometry, decode_v2_smem, decode_v3_smem,  # noqa: F401
                            decode_v4_smem, decode_v5_smem)
from .launch import KERNEL_DIR, SOURCES, device_info, source  # noqa: F401
from .registry import REGISTRY, need  # noqa: F401
from .forward import attention, launch_attention, nonmatmul_budget, v2_registers  # noqa: F401
from .decode import decode, launch_decode, paged_decode, paged_decode_pools  # noqa: F401
from .policy import decode_wave_splits, mla_num_splits, split_cost  # noqa: F401
from .gather import gather_pools, launch_gather, paged_gather  # noqa: F401
from .backward import attention_backward  # noqa: F401
from . import hopper  # noqa: F401  (its records rank above the portable versions, on Hopper only)
from . import mla  # noqa: F401
from .mla import mla_decode, paged_mla_decode  # noqa: F401
from .sanitize import sanitize_cases  # noqa: F401
