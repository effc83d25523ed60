"""The benchmark, declared as data: which shapes each section times.

``python -m iokernels bench`` runs every section listed here; each runner row comes from
the backends' kernel registries (every registered version of the op) and from torch
SDPA's kernels, so adding a kernel version adds its rows without touching the benchmark.
The tuning sweeps (alternative tilings of one version) are declared in
:mod:`iokernels.bench.sweeps_numba` and :mod:`iokernels.bench.sweeps_cupy`.
"""
from __future__ import annotations

#: the article's prefill sweep, the head-to-head shape, and the decode sweep (serving batch sizes)
PREFILL_SWEEP = dict(batch=4, heads=16, head_dim=128, seqlens=(1024, 2048, 4096, 8192),
                     causal=(True,), dtypes=("bfloat16", "float32"))
PREFILL_COMPARE = dict(batch=8, heads=16, head_dim=128, seqlens=(4096,), causal=(False, True),
                       dtypes=("bfloat16", "float32"))
DECODE_SWEEP = dict(heads_q=32, heads_kv=8, head_dim=128, batches=(1, 8, 64), seqlens=(4096, 32768),
                    dtypes=("float16", "bfloat16"))
#: quantized paged caches (1-byte codes + block scales) against the 16-bit paged cache of the
#: same values, and a sliding window against the full cache: (kv_dtype, window) per row,
#: None = the bfloat16 pools / no window.  The CuPy rows run each of cupy_versions (None: the
#: registry's default): decode v4 (codes as tensor-core operands) next to v3 (codes decoded
#: on the CUDA cores), each on the 1-byte and on the 16-bit cache
DECODE_QUANT = dict(heads_q=32, heads_kv=8, head_dim=128, batches=(8, 64), seqlens=(32768,), dtypes=("bfloat16",),
                    variants=((None, None), ("float8_e4m3fn", None), ("int8", None), (None, (4096, 0)),
                              ("float8_e4m3fn", (4096, 0))),
                    cupy_versions=("v4", "v3"))
#: paged prefill against our own contiguous prefill of the same chunks: (batch, cached tokens a
#: sequence, chunk rows) -- whole prompts, a chunked prefill's later chunk, short chunks
PAGED_PREFILL = dict(heads_q=32, heads_kv=8, head_dim=128, shapes=((4, 4096, 4096), (8, 8192, 512), (32, 2048, 128)),
                     dtypes=("bfloat16",))
GATHER_SIZES = dict(heads_kv=8, head_dim=128, seqlens=(4096, 131072), dtype="float16")
#: --quick: tiny shapes that run everywhere in seconds (also on a CPU, NumPy only)
QUICK = dict(prefill=dict(batch=1, heads=2, head_dim=64, seqlens=(256,), causal=(True,),
                          dtypes=("float32",)),
             decode=dict(heads_q=4, heads_kv=2, head_dim=64, batches=(2,), seqlens=(512,),
                         dtypes=("float16",)),
             gather=dict(heads_kv=2, head_dim=64, seqlens=(512,), dtype="float16"),
             backward=dict(batch=1, heads=2, head_dim=64, seqlens=(256,), causal=(True,), dtypes=("float32",)),
             mla=dict(heads_q=128, latent_dim=512, rope_dim=64, shapes=((2, 1024),), dtypes=("bfloat16",)),
             paged_prefill=dict(heads_q=4, heads_kv=2, head_dim=64, shapes=((2, 512, 128),), dtypes=("float16",)))

SDPA_NAMES = ("flash", "efficient", "cudnn", "math")
#: NumPy runs (host, one repetition) only when the problem is this small (FLOPs): beyond it
#: a CPU run takes longer than the whole GPU sweep and teaches nothing new.
NUMPY_MAX_FLOPS = 2.0e10
#: each runner's timed loop aims at about this much device time (reps adapt, 3..DEFAULT_REPS)
TARGET_MS_PER_RUNNER = 400.0
#: calls slower than this (ms) get one warm-up call, not DEFAULT_WARMUP (they are past any
#: start-up effect after the check call and the probe, and each costs a lot of the time box)
SLOW_CALL_MS = 50.0
#: a row whose whole cost (compile, check, timing) passes this many seconds of wall time says so on
#: stderr as it ends, so a time box's log shows which runner a case spent its time on
SLOW_ROW_S = 10.0
#: largest |out - SDPA| accepted before a row is flagged "suspect" (per storage dtype)
CHECK_TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 6e-2}
#: a problem's block size for the paged cache (vLLM's default)
PAGED_BLOCK = 16

#: forward + backward (a training step): bf16 at the head-to-head shape, and float32 (where the
#: Numba backward runs) at a smaller one, since its CUDA-core kernels take seconds at the large
BACKWARD = dict(batch=8, heads=16, head_dim=128, seqlens=(4096,), causal=(False, True), dtypes=("bfloat16",))
BACKWARD_FP32 = dict(batch=2, heads=16, head_dim=128, seqlens=(2048,), causal=(False, True), dtypes=("float32",))

#: MLA decode (absorbed form, DeepSeek-V3's shapes: 128 heads, rows of 512 + 64), one query
#: token a sequence: (batch, cache length) pairs, the serving shape B=64 N=8192 first
MLA = dict(heads_q=128, latent_dim=512, rope_dim=64,
           shapes=((64, 8192), (8, 8192), (1, 8192), (64, 4096), (8, 32768), (1, 32768)), dtypes=("bfloat16",))
#: the roofline the MLA rows are placed on: the measured ceilings of this GPU when recorded
#: (iokernels.core.roofline.MEASURED), else the H200's datasheet row
MLA_ROOFLINE_GPU = ("H200 (measured)", "H200")

#: what ``python -m iokernels bench`` runs without --sections
DEFAULT_SECTIONS = ("prefill", "compare", "paged_prefill", "decode", "gather", "backward", "mla")
#: every section; "cliff" (a time-boxed sweep of shapes off the serving grid), "captured" (a
#: 32-layer decode step, eager and as a CUDA graph: iokernels.bench.cliff) and "fp8" (the opt-in
#: FP8 Hopper forward: iokernels.bench.runners_fp8) run when asked for
SECTIONS = DEFAULT_SECTIONS + ("cliff", "captured", "fp8")
