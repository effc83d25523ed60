"""FlashAttention forward in CUDA C++: the launchers of fa_v1.cu, fa_v1b.cu and fa_v2.cu.

The three versions share one launcher: the version names the .cu file, the config's
sizes become its ``-D`` defines (:class:`~iokernels.cupy_raw.config.ForwardConfig`), and
the arguments are the same (pointers, sizes, strides in elements, scale, window).

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows per thread block, key/value rows per K/V tile (block_q, block_k)
Tr, Tc   ceil(Nq / Br) query tiles (the grid's x), ceil(Nk / Bc) K/V tiles (inner loop)
S, P     S_ij = scale * Q_i K_j^T and P_ij = exp(S_ij - m): registers (v2) or SRAM (v1's P)
m, l     running row max and row sum of the online softmax, in registers
O        output accumulator (float32; float64 for float64 inputs), written once to HBM
LSE      m + log(l), natural log, float32 (float64 for float64 inputs)
=======  ===========================================================================

Also here: :func:`nonmatmul_budget` and :func:`v2_registers`, the arithmetic notebook 06
uses to explain why v2 keeps S and P in registers and uses exp2.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from ..core.records import Record
from . import config as C
from .config import ForwardConfig, fit_config
from .launch import device_info, function, on_stream, round_up, unit_rows
from .registry import REGISTRY, check_v1, check_v1b, check_v2, need


def run_attention(q, k, v, *, causal, scale, window, config):
    """One forward call with a resolved config (its version set): (O, LSE) of q's kind."""
    info = cv.check_qkv(q, k, v)
    dtype, d = info["dtype"], info["head_dim"]
    scale = cv.resolve_scale(scale, d)
    left, right = cv.effective_window(bool(causal), window)
    config.resolve(d, dtype)                             # config errors before any GPU work
    cfg = fit_config(config, d, dtype, device_info())
    call = Call(q)
    B, Hq, Nq = info["batch"], info["heads_q"], info["seqlen_q"]
    acc = cv.accum_dtype(dtype).name
    with on_stream(call.stream_ptr()):
        qd, kd, vd = (unit_rows(call.to_device(x, n)) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        o = call.empty((B, Hq, Nq, d), dtype)
        lse = call.empty((B, Hq, Nq), acc)
        launch_attention(qd, kd, vd, o, lse, dtype=dtype, scale=scale, window=(left, right), config=cfg)
    return call.finish(o, dtype), call.finish(lse, acc)


def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """FlashAttention forward on the GPU: (O, LSE).  ``config``: a :class:`ForwardConfig`
    (None, or version None: the registry's default for the call)."""
    cv.check_qkv(q, k, v)
    kernel, cfg = REGISTRY.resolve("attention", config, need("attention", q=q, k=k, v=v, causal=causal, window=window))
    return kernel.launcher(q, k, v, causal=causal, scale=scale, window=window, config=cfg)


def launch_attention(qd, kd, vd, o, lse, *, dtype, scale, window, config):
    """Launch v1, v1b or v2 on device arrays (anything :func:`iokernels.core.arrays.device_array`
    takes; o, lse preallocated and contiguous: tests poison them first).  ``config`` resolved
    and fitted (:func:`fit_config`)."""
    qd, kd, vd, o, lse = (device_array(a) for a in (qd, kd, vd, o, lse))
    B, Hq, Nq, d = qd.shape
    if B * Hq * Nq == 0:
        return
    cfg = config
    defines = cfg.defines(d, dtype)
    if cfg.version in ("v2", "v1b") and not all(a.aligned(C.CHUNK_BYTES) for a in (qd, kd, vd)):
        defines["VEC_IO"] = 0                            # rows not 16-byte aligned: element copies
    smem = cfg.smem_bytes(d, dtype)
    rec = REGISTRY.get("attention", cfg.version)
    fn = function(rec.file, rec.kernel, defines, smem)
    grid = (-(-Nq // cfg.block_q), Hq, B)
    fn(grid, (cfg.threads(),), rec.args(qd, kd, vd, o, lse, dtype=dtype, scale=scale, window=window), shared_mem=smem)


def forward_args(qd, kd, vd, o, lse, *, dtype, scale, window) -> tuple:
    """fa_v1.cu, fa_v1b.cu, fa_v2.cu: pointers, sizes, strides in elements, scale, window."""
    (_, Hq, Nq, _), (_, Hkv, Nk, _) = qd.shape, kd.shape
    acc_t = np.float64 if dtype == "float64" else np.float32
    i32, i64 = np.int32, np.int64
    return (qd.arg, kd.arg, vd.arg, o.arg, lse.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            *map(i64, qd.strides[:3]), *map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]),
            acc_t(scale), i32(window[0]), i32(window[1]))


# --------------------------------------------------------------------------- for notebook 06
def nonmatmul_budget(head_dim: int, matmul_flops_per_s: float = 989e12, exp_per_s: float = 3.9e12) -> dict:
    """Time for the exponentials against time for the matmuls, per score S_ij.

    Each score costs 4 * head_dim matmul FLOPs (2d in Q K^T, 2d in P V) and one exp.
    Defaults: H100 SXM's dense 16-bit tensor-core peak and its special-function (exp)
    throughput as the FlashAttention-3 paper quotes them (Shah et al., 2024).
    """
    t_mm = 4 * head_dim / matmul_flops_per_s
    t_exp = 1 / exp_per_s
    return dict(matmul_ps_per_score=t_mm * 1e12, exp_ps_per_score=t_exp * 1e12,
                exp_over_matmul=t_exp / t_mm)


def v2_registers(head_dim: int, block_k: int) -> dict:
    """32-bit registers a lane of v2 holds for its 16 query rows (fa_v2.cu): the O
    accumulator, the S/P tile, the Q fragments, (m, l) -- before addresses and temporaries."""
    d = round_up(head_dim, 16)
    o = d // 8 * 4            # NT_O n-tiles x 4 floats
    s = block_k // 8 * 4      # NT_S n-tiles x 4 floats
    q = d // 16 * 4           # KT_Q k-steps x 4 registers of two 16-bit values
    return dict(O=o, S_P=s, Q=q, m_l=4, total=o + s + q + 4)


# --------------------------------------------------------------------------- the records
def _record(version, file, check, rank, summary):
    return Record("cupy", "attention", version, file, file.removesuffix(".cu"), ForwardConfig, run_attention,
                  summary, check, rank, forward_args)


RECORDS = (
    _record("v1", "fa_v1.cu", check_v1, 10, "CUDA cores, any dtype: a block owns Q_i, loads K_j, V_j into SRAM, "
            "register-tiled 16 x 16 threads"),
    _record("v1b", "fa_v1b.cu", check_v1b, 20, "float32: tiles in row layout copied by cp.async, K_j+1 and V_j+1 "
            "in flight behind the two products, swizzled SRAM, exp2"),
    _record("v2", "fa_v2.cu", check_v2, 30, "tensor cores (mma.sync, ldmatrix) for float16/bfloat16, "
            "FlashAttention-2's warp-per-16-rows structure, S and P in registers, cp.async double buffering"),
)
REGISTRY.add(*RECORDS)
