"""The roofline: is a kernel limited by memory bandwidth or by arithmetic?

A kernel that performs F floating-point operations and moves B bytes between HBM and
the chip needs at least

    memory time   = B / bandwidth
    compute time  = F / peak FLOP/s

and runs no faster than the larger of the two.  Its arithmetic intensity I = F / B
(FLOP per byte) decides which: below the GPU's *ridge point* peak / bandwidth it is
memory-bound, above it compute-bound.  (Williams, Waterman, Patterson, "Roofline",
CACM 2009.)

This module holds a table of GPUs (datasheet figures, each with the datasheet named),
the first-principles FLOP and byte counts of attention, and the worked example of the
source article ("FlashAttention-3 and PagedAttention: IO-Aware Attention Kernels",
2026): one head, N = 4096, d = 128, FP16, where naive attention moves about 138 MB for
8.59 GFLOP, an intensity of about 62 FLOP/byte, far below an H100's ridge of about 295.

Units: bytes and FLOP are plain counts; bandwidth in bytes/s; peaks in FLOP/s; times in
seconds.  "MB" and "GB" in the docs are decimal (1e6, 1e9); "MiB", "KiB" binary.

Frank notes: these are bounds, not predictions.  They ignore caches (L2 can serve
re-reads), launch overhead, the softmax's exponentials (which FlashAttention-4 shows can
matter) and the fact that peaks are rarely reached: the measured H200 ceilings below
(about 89% of the datasheet bandwidth, 72% of the dense BF16 peak) show the gap.
"""
from __future__ import annotations

import numpy as np

from . import conventions as cv

__all__ = ["GPUS", "MEASURED", "get_gpu", "attention_flops", "mandatory_bytes",
           "naive_extra_bytes", "arithmetic_intensity", "ridge_point", "time_bounds",
           "kv_bytes_per_token", "decode_intensity", "worked_example"]

TB = 1e12        #: bytes in a (decimal) terabyte: datasheets quote bandwidth in TB/s
TFLOPS = 1e12    #: FLOP/s in one TFLOP/s

# --------------------------------------------------------------------------- the GPU table
#: Datasheet figures per GPU.  ``fp16_tflops``: dense FP16/BF16 tensor-core peak (the
#: structured-sparsity figures on the datasheets are twice these); ``fp32_tflops``:
#: non-tensor FP32; ``hbm_tbps``: memory bandwidth (TB/s, decimal); ``smem_per_sm_kib``:
#: the most shared memory one SM can give a thread block set (part of a larger L1/shared
#: array, ``l1_smem_per_sm_kib``); ``l2_mib``: L2 cache.  ``source`` names the document
#: the compute and bandwidth figures come from; ``notes`` says where any field comes
#: from elsewhere.
GPUS = {
    "A100 40GB SXM": dict(
        arch="Ampere", memory_gb=40, hbm_tbps=1.555, fp16_tflops=312.0, fp32_tflops=19.5,
        sms=108, smem_per_sm_kib=164, l1_smem_per_sm_kib=192, l2_mib=40, measured=False,
        source="NVIDIA A100 Tensor Core GPU datasheet; NVIDIA A100 Tensor Core GPU Architecture "
               "whitepaper (SMs, shared memory, L2)",
        notes=""),
    "A100 80GB SXM": dict(
        arch="Ampere", memory_gb=80, hbm_tbps=2.039, fp16_tflops=312.0, fp32_tflops=19.5,
        sms=108, smem_per_sm_kib=164, l1_smem_per_sm_kib=192, l2_mib=40, measured=False,
        source="NVIDIA A100 Tensor Core GPU datasheet; NVIDIA A100 Tensor Core GPU Architecture "
               "whitepaper (SMs, shared memory, L2)",
        notes=""),
    "H100 SXM": dict(
        arch="Hopper", memory_gb=80, hbm_tbps=3.35, fp16_tflops=989.4, fp32_tflops=67.0,
        sms=132, smem_per_sm_kib=228, l1_smem_per_sm_kib=256, l2_mib=50, measured=False,
        source="NVIDIA H100 Tensor Core GPU datasheet; NVIDIA H100 Tensor Core GPU Architecture "
               "whitepaper (SMs, shared memory, L2)",
        notes="1,979 TFLOP/s on the datasheet is the 2:4 structured-sparsity figure"),
    "H100 PCIe": dict(
        arch="Hopper", memory_gb=80, hbm_tbps=2.0, fp16_tflops=756.5, fp32_tflops=51.0,
        sms=114, smem_per_sm_kib=228, l1_smem_per_sm_kib=256, l2_mib=50, measured=False,
        source="NVIDIA H100 Tensor Core GPU datasheet; NVIDIA H100 Tensor Core GPU Architecture "
               "whitepaper (SMs, shared memory, L2)",
        notes="1,513 TFLOP/s on the datasheet is the sparsity figure"),
    "H200": dict(
        arch="Hopper", memory_gb=141, hbm_tbps=4.8, fp16_tflops=989.4, fp32_tflops=67.0,
        sms=132, smem_per_sm_kib=228, l1_smem_per_sm_kib=256, l2_mib=60, measured=False,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); SMs and shared memory as H100 SXM "
               "(same GH100 configuration)",
        notes="same compute as H100 SXM, faster and larger HBM3e; L2 as the device reports it "
              "(CUDA's device properties, l2_bytes in the recorded runs' environment: 60 MiB; "
              "the datasheet does not list it)"),
    "L4": dict(
        arch="Ada Lovelace", memory_gb=24, hbm_tbps=0.300, fp16_tflops=121.0, fp32_tflops=30.3,
        sms=58, smem_per_sm_kib=100, l1_smem_per_sm_kib=128, l2_mib=48, measured=False,
        source="NVIDIA L4 Tensor Core GPU datasheet; NVIDIA Ada GPU Architecture whitepaper "
               "(shared memory); CUDA C++ Programming Guide, compute capability 8.9",
        notes="GDDR6, not HBM; 242 TFLOP/s on the datasheet is the sparsity figure"),
    "T4": dict(
        arch="Turing", memory_gb=16, hbm_tbps=0.320, fp16_tflops=65.0, fp32_tflops=8.1,
        sms=40, smem_per_sm_kib=64, l1_smem_per_sm_kib=96, l2_mib=4, measured=False,
        source="NVIDIA T4 Tensor Core GPU datasheet; NVIDIA Turing GPU Architecture whitepaper "
               "(SMs, shared memory, L2)",
        notes="GDDR6, not HBM; FP16 with FP32 accumulate; no BF16 tensor cores on Turing"),
    "B200": dict(
        arch="Blackwell", memory_gb=180, hbm_tbps=7.7, fp16_tflops=2250.0, fp32_tflops=75.0,
        sms=148, smem_per_sm_kib=228, l1_smem_per_sm_kib=256, l2_mib=None, measured=False,
        source="NVIDIA HGX B200 datasheet (per-GPU column: FP16/BF16 4.5 PFLOP/s with sparsity, "
               "FP32 75 TFLOP/s, 180 GB HBM3e at 7.7 TB/s)",
        notes="SM count and shared memory per SM are not on the datasheet (SMs from third-party "
              "spec listings; shared memory per SM as Hopper, CUDA Programming Guide, compute "
              "capability 10.0); L2 size left unset (not published there). FlashAttention-4's "
              "1,613 TFLOP/s at 71% of peak (Zadouri et al., 2026) agrees with 2.25 PFLOP/s dense"),
}

def _measured_rows() -> dict:
    """GPUs whose ceilings were measured (benchmarks/results/ceilings_*.json, through
    :mod:`iokernels.core.recorded`): a device-to-device copy (bytes read plus bytes written per
    second), a large BF16 matmul, and an FP32 matmul with TF32 off.  Empty in a copy of the
    package without the records."""
    from . import recorded
    try:
        rec = recorded.load("ceilings")
    except FileNotFoundError:
        return {}
    env, c = rec["env"], rec["ceilings"]
    base = GPUS["H200"] if "H200" in env.get("gpu", "") else {}
    return {f"{env['gpu'].replace('NVIDIA ', '')} (measured)": dict(
        arch=base.get("arch", "?"), memory_gb=base.get("memory_gb"), hbm_tbps=round(c["copy_TBps_rw"], 2),
        fp16_tflops=round(c["bf16_mm_TFLOPs"], 1), fp32_tflops=round(c["fp32_mm_TFLOPs_noTF32"], 1),
        sms=env.get("sms", base.get("sms")), smem_per_sm_kib=base.get("smem_per_sm_kib"),
        l1_smem_per_sm_kib=base.get("l1_smem_per_sm_kib"), l2_mib=base.get("l2_mib"), measured=True,
        source=f"measured on an {env['gpu']}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')} "
               f"(benchmarks/results/{rec['source_file']})",
        notes="copy bandwidth counts read + write; BF16 matmul; FP32 matmul without TF32")}


#: the measured rows, next to the datasheet rows of GPUS
MEASURED = _measured_rows()

#: which peak a precision uses
_PEAK_FIELD = {"fp16": "fp16_tflops", "bf16": "fp16_tflops", "float16": "fp16_tflops",
               "bfloat16": "fp16_tflops", "fp32": "fp32_tflops", "float32": "fp32_tflops"}


def get_gpu(name) -> dict:
    """A GPU's row (a copy, with its ``name``), from :data:`GPUS` or :data:`MEASURED`.

    ``name`` may also be a dict with at least ``hbm_tbps`` and ``fp16_tflops`` (your own GPU).
    """
    if isinstance(name, dict):
        missing = [f for f in ("hbm_tbps", "fp16_tflops") if f not in name]
        if missing:
            raise ValueError(f"gpu: a custom GPU needs the fields {missing}")
        return dict(name)
    table = {**GPUS, **MEASURED}
    if name not in table:
        raise ValueError(f"gpu: expected one of {', '.join(map(repr, table))}; got {name!r}")
    return dict(table[name], name=name)


def _peak_and_bw(gpu, precision):
    g = get_gpu(gpu)
    if precision not in _PEAK_FIELD:
        raise ValueError(f"precision: expected one of {', '.join(_PEAK_FIELD)}; got {precision!r}")
    return g[_PEAK_FIELD[precision]] * TFLOPS, g["hbm_tbps"] * TB


# --------------------------------------------------------------------------- counts
def attention_flops(seqlen_q, seqlen_k, head_dim, batch=1, heads=1, causal=False, window=None):
    """Forward FLOPs of attention: 2 matmuls (Q K^T and P V), 2 FLOP per multiply-add.

    4 * N_q * N_k * d per head without a mask.  With ``causal`` or ``window`` only the
    visible (query, key) pairs count, exactly (bottom-right causal with N_q = N_k = N has
    N (N + 1) / 2 of them; benchmark tables often use N^2 / 2).  Softmax FLOPs are left
    out, as is usual.
    """
    if causal or window is not None:
        lo, hi = cv.key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window)
        pairs = int(np.sum(hi - lo))
    else:
        pairs = seqlen_q * seqlen_k
    return 4 * pairs * head_dim * batch * heads


def mandatory_bytes(seqlen_q, seqlen_k, head_dim, batch=1, heads=1, heads_kv=None, itemsize=2):
    """Bytes any attention must move: read Q, K, V once and write O once."""
    heads_kv = heads if heads_kv is None else heads_kv
    q_o = 2 * batch * heads * seqlen_q * head_dim          # read Q, write O
    k_v = 2 * batch * heads_kv * seqlen_k * head_dim       # read K, read V
    return (q_o + k_v) * itemsize


def naive_extra_bytes(seqlen_q, seqlen_k, batch=1, heads=1, itemsize=2):
    """Bytes naive attention adds: write S, read S, write P, read P (4 * N_q * N_k entries)."""
    return 4 * batch * heads * seqlen_q * seqlen_k * itemsize


def arithmetic_intensity(flops, nbytes):
    """FLOP per byte moved."""
    if nbytes <= 0:
        raise ValueError(f"nbytes: must be positive, got {nbytes!r}")
    return flops / nbytes


def ridge_point(gpu, precision="fp16"):
    """The intensity (FLOP/byte) where memory time equals compute time: peak / bandwidth."""
    peak, bw = _peak_and_bw(gpu, precision)
    return peak / bw


def time_bounds(flops, nbytes, gpu, precision="fp16"):
    """Lower bounds on run time: dict(memory_s, compute_s, bound, time_s, intensity, ridge).

    ``bound`` is "memory" or "compute", whichever time is larger; ``time_s`` is that time.
    """
    peak, bw = _peak_and_bw(gpu, precision)
    memory_s, compute_s = nbytes / bw, flops / peak
    return dict(memory_s=memory_s, compute_s=compute_s,
                bound="memory" if memory_s >= compute_s else "compute",
                time_s=max(memory_s, compute_s),
                intensity=flops / nbytes if nbytes else float("inf"), ridge=peak / bw)


def kv_bytes_per_token(layers, kv_heads, head_dim, itemsize=2):
    """KV-cache bytes per token: K and V, for every layer and KV head."""
    return 2 * layers * kv_heads * head_dim * itemsize


def decode_intensity(group_size, itemsize=2):
    """FLOP per byte of decode attention: ~ g for g query heads per KV head at FP16.

    Each cached key and value (d elements each) is read once and used by the g query
    heads of its group: 2 * d multiply-adds per head for the score and the output, i.e.
    4 * g * d FLOP for 2 * d * itemsize bytes.  The few bytes of q and o are ignored.
    """
    return 4 * group_size / (2 * itemsize)


# --------------------------------------------------------------------------- the article's numbers
def worked_example(seqlen=4096, head_dim=128, itemsize=2, gpu="H100 SXM"):
    """The source article's first-principles numbers (one head, N = 4096, d = 128, FP16).

    Returns a dict; the defaults reproduce 8.59 GFLOP, 4.19 MB mandatory, 33.5 MB per
    N x N matrix, ~134 MB for S and P, ~138 MB in all, ~62 FLOP/byte, a ridge of ~295 on
    an H100 SXM, ~41 us of memory time against ~8.7 us of compute, and the KV-cache
    figures of the decode section.
    """
    N, d = seqlen, head_dim
    flops = attention_flops(N, N, d)
    mand = mandatory_bytes(N, N, d, itemsize=itemsize)
    extra = naive_extra_bytes(N, N, itemsize=itemsize)
    total = mand + extra
    tb = time_bounds(flops, total, gpu)
    flash = time_bounds(flops, mand, gpu)
    ridge = ridge_point(gpu)
    llama2 = kv_bytes_per_token(32, 32, 128, 2)             # Llama-2-7B shapes
    llama3 = kv_bytes_per_token(32, 8, 128, 2)              # Llama-3-8B shapes (GQA, 8 KV heads)
    ctx = 32 * 1024
    kv_32k = llama3 * ctx
    return dict(
        seqlen=N, head_dim=d, itemsize=itemsize, gpu=gpu,
        flops=flops,                                        # 8.59e9
        mandatory_bytes=mand,                               # 4.19e6
        s_matrix_bytes=N * N * itemsize,                    # 33.5e6, one N x N matrix
        naive_extra_bytes=extra,                            # 134e6: S and P, each written and read
        naive_total_bytes=total,                            # 138e6
        naive_intensity=flops / total,                      # ~62 FLOP/byte
        flash_intensity=flops / mand,                       # ~2048 FLOP/byte if only Q, K, V, O moved
        ridge=ridge,                                        # ~295 on H100 SXM
        below_ridge=ridge / (flops / total),                # ~4.7x
        memory_s=tb["memory_s"],                            # ~41 us
        compute_s=tb["compute_s"],                          # ~8.7 us
        bound=tb["bound"],
        fraction_moving_s_p=1 - tb["compute_s"] / tb["memory_s"],  # ~0.8 of the time
        flash_bound=flash["bound"],
        kv_bytes_per_token_llama2_7b=llama2,                # 0.5 MiB
        kv_bytes_per_token_llama3_8b=llama3,                # 128 KiB
        kv_bytes_32k_llama3_8b=kv_32k,                      # 4.29e9
        decode_ms_per_token_32k=kv_32k / (get_gpu(gpu)["hbm_tbps"] * TB) * 1e3,  # ~1.28 ms
    )
