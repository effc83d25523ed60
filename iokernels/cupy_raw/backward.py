"""FlashAttention-2's backward in CUDA C++: the launchers of bwd_v1.cu and bwd_v2.cu.

Both versions run three kernels (see the headers of ``kernels/bwd_v1.cu`` and
``kernels/bwd_v2.cu``): D_i = rowsum(dO_i * O_i) (bwd_v1.cu's bwd_rowsum); the main loop,
one block per (K/V tile, KV head, sequence) with dK_j, dV_j in registers and S, P
recomputed from the saved LSE; dQ from its float32 (float64) accumulator (bwd_v1.cu's
bwd_finish).  dQ is added with atomic adds (fast, last bits may differ run to run) or, with
``BackwardConfig(deterministic=True)``, written as one partial per K/V tile and summed in
tile order (the same bits every run).

=======  ===================================================================================
version  what its main loop changes, and why
=======  ===================================================================================
v1       CUDA cores, every dtype: a key row a group of lanes, dot products by warp shuffles.
         Plain and readable; limited by the shuffles and SRAM reads per multiply-add.
v2       tensor cores (mma.sync m16n8k16, ldmatrix), float16/bfloat16, head_dim <= 128,
         compute capability 8.0+: a warp owns 16 keys, so S^T, P^T, dP^T, dS^T stay in the
         accumulator layout that feeds dV_j, dK_j's products from registers; only dS^T
         passes through SRAM (16 bits) for dQ.  Q_i, dO_i double-buffered with cp.async.
=======  ===================================================================================

Notation as in :mod:`iokernels.backward`: Br, Bc, Tr, Tc, D_i, S_ij, P_ij, dP_ij, dS_ij.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from ..core.records import Record
from .config import BackwardConfig
from .launch import contiguous, device_info, fill, function, on_stream, unit_rows
from .registry import REGISTRY, check_backward_v1, check_backward_v2, need

#: threads of the row-wise kernels (bwd_rowsum, bwd_finish); the .cu file's ROW_THREADS
ROW_THREADS = 128


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=None, config=None):
    """FlashAttention-2's backward on the GPU: (dq, dk, dv) of q's kind and dtype, dK and dV
    summed over each GQA group.  ``config``: a :class:`BackwardConfig` (None, or version None:
    the registry's default for the call; a version: that one, or a ValueError saying why not)."""
    cv.check_qkv(q, k, v)
    kernel, cfg = REGISTRY.resolve("attention_backward", config, need("attention_backward", q=q, k=k, v=v))
    return kernel.launcher(do, q, k, v, o, lse, causal=causal, scale=scale, window=window, config=cfg)


def run_attention_backward(do, q, k, v, o, lse, *, causal, scale, window, config):
    """The three launches of the version ``config`` names (resolved): rowsum, its main loop, finish."""
    info = cv.check_qkv(q, k, v)
    dtype, d = info["dtype"], info["head_dim"]
    B, Hq, Nq, Hkv, Nk = info["batch"], info["heads_q"], info["seqlen_q"], info["heads_kv"], info["seqlen_k"]
    if config is None or config.version is None:
        raise ValueError("config.version: run_attention_backward needs a resolved config (REGISTRY.resolve)")
    version = config.version
    rec = REGISTRY.get("attention_backward", version)
    cfg, smem, defines, row_defines, threads = backward_setup(config, d, dtype)
    scale = cv.resolve_scale(scale, d)
    left, right = cv.effective_window(bool(causal), window)
    acc = cv.accum_dtype(dtype)
    call = Call(q)
    for name, x in (("do", do), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        call.check(x, name)
    tiles = -(-Nk // cfg.block_k)                              # Tc
    with on_stream(call.stream_ptr()):
        qd, kd, vd, dod, od = (unit_rows(call.to_device(x, n)) for x, n in
                               ((q, "q"), (k, "k"), (v, "v"), (do, "do"), (o, "o")))
        lse_dev = call.to_device(lse, "lse")
        lsed = device_array(lse_dev if device_array(lse_dev).c_contiguous() else contiguous(lse_dev))
        dq, dk, dv = (call.empty(s, dtype) for s in ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d)))
        dvec = call.empty((B, Hq, Nq), acc.name)
        dq_acc = call.empty(((tiles,) if cfg.deterministic else ()) + (B, Hq, Nq, d), acc.name)
        fill(dq_acc, 0)
        rows = B * Hq * Nq
        if rows and d:
            f = function("bwd_v1", "bwd_rowsum", row_defines)
            f((-(-rows // ROW_THREADS),), (ROW_THREADS,),
              (dod.arg, od.arg, device_array(dvec).arg, np.int32(rows), np.int32(Hq), np.int32(Nq),
               *map(np.int64, dod.strides[:3]), *map(np.int64, od.strides[:3])))
        if B * Hkv * Nk and d:
            if rows == 0:
                fill(dk, 0)
                fill(dv, 0)
            else:
                args = rec.args(qd, kd, vd, dod, lsed, *(device_array(x) for x in (dvec, dk, dv, dq_acc)),
                                scale=acc.type(scale), window=(left, right))
                f = function(rec.file, rec.kernel, defines, smem)
                f((tiles, Hkv, B), (threads,), args, shared_mem=smem)
        if rows and d:
            n = rows * d
            f = function("bwd_v1", "bwd_finish", row_defines)
            f((-(-n // ROW_THREADS),), (ROW_THREADS,), (device_array(dq_acc).arg, device_array(dq).arg,
                                                        np.int64(n), np.int32(tiles)))
    return call.finish(dq, dtype), call.finish(dk, dtype), call.finish(dv, dtype)


def backward_setup(config: BackwardConfig, d: int, dtype: str) -> tuple:
    """What a resolved config fixes for head_dim ``d`` and ``dtype``: (the config with concrete
    tiles, the main kernel's dynamic shared memory, its defines, the defines of bwd_v1.cu's
    bwd_rowsum and bwd_finish (v1's, with the same deterministic flag), threads a block)."""
    smem = 0
    if config.version == "v2":
        cfg = config.resolve(d, dtype, device_info()["smem_optin"])
        smem = BackwardConfig.smem_bytes(cfg.block_q, cfg.block_k, d, dtype, "v2")
    else:
        cfg = config.resolve(d, dtype)
    defines = cfg.defines(d, dtype)
    row_defines = BackwardConfig("v1", deterministic=cfg.deterministic).defines(d, dtype) \
        if config.version == "v2" else defines
    threads = 32 * cfg.num_warps if config.version == "v2" else cfg.block_k * cfg.lanes_per_key
    return cfg, smem, defines, row_defines, threads


def backward_args(qd, kd, vd, dod, lsed, dvec, dk, dv, dq_acc, *, scale, window) -> tuple:
    """bwd_v1.cu's bwd_main and bwd_v2.cu's bwd_v2_main: pointers, sizes, strides in elements
    (q, k, v, do), the scale in the accumulator dtype, the window."""
    (_, Hq, Nq, _), (_, Hkv, Nk, _) = qd.shape, kd.shape
    i32, i64 = np.int32, np.int64
    return (qd.arg, kd.arg, vd.arg, dod.arg, lsed.arg, dvec.arg, dk.arg, dv.arg, dq_acc.arg, i32(Nq), i32(Nk),
            i32(Hq), i32(Hkv), *map(i64, qd.strides[:3]), *map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]),
            *map(i64, dod.strides[:3]), scale, i32(window[0]), i32(window[1]))


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("cupy", "attention_backward", "v1", "bwd_v1.cu", "bwd_main", BackwardConfig, run_attention_backward,
           "FlashAttention-2's backward on CUDA cores: K/V tile per block, dK/dV in registers, P recomputed from "
           "LSE, dQ by atomic adds or deterministic per-tile partials", check_backward_v1, 10, backward_args),
    Record("cupy", "attention_backward", "v2", "bwd_v2.cu", "bwd_v2_main", BackwardConfig, run_attention_backward,
           "FlashAttention-2's backward on the tensor cores (mma.sync, ldmatrix): a warp owns 16 keys, P^T/dS^T "
           "feed dV/dK from registers, dS^T through SRAM for dQ, Q/dO tiles by cp.async", check_backward_v2, 20,
           backward_args),
)
REGISTRY.add(*RECORDS)
