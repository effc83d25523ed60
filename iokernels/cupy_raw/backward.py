"""FlashAttention-2's backward in CUDA C++: the launchers of bwd_v1.cu .. bwd_v6.cu.

Every version runs three kernels (see the headers of ``kernels/bwd_v1.cu``,
``kernels/bwd_v2.cu`` .. ``kernels/bwd_v6.cu``): D_i = rowsum(dO_i * O_i) (bwd_v1.cu's
bwd_rowsum); the main loop, one block per (K/V tile, KV head, sequence) with dK_j, dV_j in
registers and S, P recomputed from the saved LSE; dQ from its float32 (float64) accumulator
(bwd_v1.cu's bwd_finish; bwd_v6.cu's own bwd_v6_finish, whose accumulator keeps another
order).  dQ is added with atomic adds (fast, last bits may differ run to run) or, with
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
v3       Hopper only (sm_90a), float16/bfloat16, head_dim 64 or 128: FlashAttention-3's
         structure.  wgmma reads K_j, V_j, Q_i, dO_i straight from SRAM (64-row products of a
         warpgroup, asynchronous); a producer warpgroup streams Q_i, dO_i by TMA into a ring of
         stages behind mbarriers; one consumer warpgroup of Bc = 64 keys, Br = 64 rows a step;
         dS^T stored once to SRAM and read back by the dQ product with wgmma's transpose bit.
v4       v3 with two consumer warpgroups: a block owns Bc = 128 keys, 64 a warpgroup, each with
         its own dK_j, dV_j in registers, so every Q_i, dO_i tile the producer brings into SRAM
         feeds twice the keys (half v3's Q/dO loads and TMA copies per key); the two halves of
         dS^T meet in one SRAM tile and one product over the 128 keys gives dQ_i, so dQ gets
         one atomic add (or one deterministic partial) an element a block: half v3's per key.
         setmaxnreg shares the registers between 1 producer and 2 consumer warpgroups.
v5       v4's kernel with its blocks in longest-first order: the (batch, KV head) pairs in
         groups that fill a wave of blocks and whose Q_i, dO_i fit part of the L2 cache
         (:func:`.policy.backward_lpt_pairs`), inside a group every pair's first K/V tile, then
         every pair's second, ...  Under the causal mask a block's work shrinks with its tile,
         so the grid ends on short blocks instead of a late long one; without an upper edge to
         the band the policy keeps v4's order.  Held back from the default until a benchmark records it
         ahead of v4 (cupy_raw/policy.py's gate); run it with ``BackwardConfig(version="v5")``.
v6       v5 with dQ handed over through SRAM: each consumer warpgroup stores its step's dQ panel
         in SRAM, and a warp of the producer warpgroup adds it to HBM with one bulk reduction
         of the copy engine (FlashAttention-3's backward), so the consumers no longer queue 16
         atomic adds a thread a step.  The accumulator keeps the panels in the order SRAM holds
         them; bwd_v6.cu's own finish kernel reads them back.  The default on Hopper.
=======  ===================================================================================

Notation as in :mod:`iokernels.backward`: Br, Bc, Tr, Tc, D_i, S_ij, P_ij, dP_ij, dS_ij.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from ..core.records import Record
from .config import BWD_RING_VERSIONS, BWD_V3_THREADS, BWD_V4_BLOCK_Q, BWD_V4_THREADS, BackwardConfig
from .launch import (HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, device_info, fill, function, on_stream, round_up,
                     unit_rows)
from .policy import backward_lpt_pairs, default_check_for, held_back_note
from .registry import (REGISTRY, check_backward_v1, check_backward_v2, check_backward_v3, check_backward_v4,
                       check_backward_v5, check_backward_v6, need)

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
    # v3 reads q, k, v, do by TMA: C-contiguous, 16-byte aligned; the others take row strides
    rows_of = (lambda x: device_array(contiguous(x, 16), dtype)) if tma_inputs(rec) else unit_rows
    with on_stream(call.stream_ptr()):
        qd, kd, vd, dod, od = (rows_of(call.to_device(x, n)) for x, n in
                               ((q, "q"), (k, "k"), (v, "v"), (do, "do"), (o, "o")))
        lse_dev = call.to_device(lse, "lse")
        lsed = device_array(lse_dev if device_array(lse_dev).c_contiguous() else contiguous(lse_dev))
        dq, dk, dv = (call.empty(s, dtype) for s in ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d)))
        dvec = call.empty((B, Hq, Nq), acc.name)
        dq_acc = call.empty(dq_accumulator_shape(rec, tiles if cfg.deterministic else 0, B, Hq, Nq, d), acc.name)
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
                f = main_function(rec, defines, smem)
                f((tiles, Hkv, B), (threads,), args, shared_mem=smem)
        if rows and d:
            f, grid, tail = finish_kernel(rec, defines, row_defines, B, Hq, Nq, d, tiles)
            f(grid, (ROW_THREADS,), (device_array(dq_acc).arg, device_array(dq).arg, *tail))
    return call.finish(dq, dtype), call.finish(dk, dtype), call.finish(dv, dtype)


def dq_accumulator_shape(rec, slots: int, B: int, Hq: int, Nq: int, d: int) -> tuple:
    """dQ's float32 (float64) accumulator for record ``rec``: (B, Hq, Nq, d), and one such array per
    K/V tile (``slots``, 0: none) in the deterministic mode.  A record with its own finish kernel
    (bwd_v6.cu) keeps whole Br-row tiles, each in the wgmma accumulator's order, so its rows are
    Nq rounded up to Br."""
    rows = round_up(Nq, BWD_V4_BLOCK_Q) if rec.extra.get("finish") else Nq
    return ((slots,) if slots else ()) + (B, Hq, rows, d)


def finish_kernel(rec, defines: dict, row_defines: dict, B: int, Hq: int, Nq: int, d: int, tiles: int) -> tuple:
    """(kernel, grid, the arguments after (dQaccum, dQ)) of the launch that turns the accumulator
    into dQ: bwd_v1.cu's bwd_finish (a thread an element of a row-major accumulator), or the
    record's own (``extra["finish"]``: bwd_v6.cu's bwd_v6_finish, a thread a pair of columns read
    from the accumulator's tiles).  ``tiles``: the K/V tiles, summed in order when deterministic."""
    own = rec.extra.get("finish")
    if own:
        f = function(rec.file, own, defines, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
        pairs = B * Hq * Nq * d // 2
        return f, (-(-pairs // ROW_THREADS),), (np.int32(B * Hq), np.int32(Nq), np.int32(tiles))
    n = B * Hq * Nq * d
    return function("bwd_v1", "bwd_finish", row_defines), (-(-n // ROW_THREADS),), (np.int64(n), np.int32(tiles))


def tma_inputs(rec) -> bool:
    """Whether a backward record's main kernel takes TMA tensor maps (bwd_v3.cu .. bwd_v6.cu: sm_90a)."""
    return rec.extra.get("options") == HOPPER_OPTIONS


def main_function(rec, defines: dict, smem: int):
    """The compiled main-loop kernel of a backward record (bwd_v3 .. bwd_v6: NVRTC with -arch=sm_90a)."""
    if tma_inputs(rec):
        return function(rec.file, rec.kernel, defines, smem, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
    return function(rec.file, rec.kernel, defines, smem)


def backward_setup(config: BackwardConfig, d: int, dtype: str) -> tuple:
    """What a resolved config fixes for head_dim ``d`` and ``dtype``: (the config with concrete
    tiles, the main kernel's dynamic shared memory, its defines, the defines of bwd_v1.cu's
    bwd_rowsum and bwd_finish (v1's, with the same deterministic flag), threads a block)."""
    smem = 0
    if config.version in ("v2", *BWD_RING_VERSIONS):
        cfg = config.resolve(d, dtype, device_info()["smem_optin"])
        smem = BackwardConfig.smem_bytes(cfg.block_q, cfg.block_k, d, dtype, config.version, cfg.stages or 0)
    else:
        cfg = config.resolve(d, dtype)
    defines = cfg.defines(d, dtype)
    row_defines = BackwardConfig("v1", deterministic=cfg.deterministic).defines(d, dtype) \
        if config.version in ("v2", *BWD_RING_VERSIONS) else defines
    if config.version in BWD_RING_VERSIONS:
        threads = BWD_V3_THREADS if config.version == "v3" else BWD_V4_THREADS
    else:
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


def _qkv_map(x, rows_box: int):
    """The TMA map (head_dim, seq, batch * heads) of a contiguous (B, H, N, d) device array:
    boxes of 64 columns (one 128-byte swizzle panel) x ``rows_box`` rows; rows past N read 0."""
    from . import hopper as hp                  # here: hopper imports the registry this module fills
    B, H, N, d = x.shape
    return hp.tensor_map(x.ptr, x.dtype, (d, N, B * H), (2 * d, 2 * d * N), (hp.PANEL, rows_box, 1))


def backward_v3_args(qd, kd, vd, dod, lsed, dvec, dk, dv, dq_acc, *, scale, window) -> tuple:
    """bwd_v3.cu's bwd_v3_main: the TMA maps of Q, K, V, dO (C-contiguous; Br = Bc = 64-row
    boxes), LSE, D, dK, dV, the dQ accumulator, sizes, the scale (float32), the window."""
    from .config import BWD_V3_BLOCK
    (_, Hq, Nq, _), (_, Hkv, Nk, _) = qd.shape, kd.shape
    i32 = np.int32
    maps = tuple(_qkv_map(x, BWD_V3_BLOCK) for x in (qd, kd, vd, dod))
    return (*maps, lsed.arg, dvec.arg, dk.arg, dv.arg, dq_acc.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            np.float32(scale), i32(window[0]), i32(window[1]))


def backward_v4_args(qd, kd, vd, dod, lsed, dvec, dk, dv, dq_acc, *, scale, window) -> tuple:
    """bwd_v4.cu's bwd_v4_main: bwd_v3_main's arguments, with K and V in boxes of Bc = 128 rows
    (Q and dO in Br = 64-row boxes, as v3)."""
    from .config import BWD_V4_BLOCK_K, BWD_V4_BLOCK_Q
    (_, Hq, Nq, _), (_, Hkv, Nk, _) = qd.shape, kd.shape
    i32 = np.int32
    maps = (_qkv_map(qd, BWD_V4_BLOCK_Q), _qkv_map(kd, BWD_V4_BLOCK_K), _qkv_map(vd, BWD_V4_BLOCK_K),
            _qkv_map(dod, BWD_V4_BLOCK_Q))
    return (*maps, lsed.arg, dvec.arg, dk.arg, dv.arg, dq_acc.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            np.float32(scale), i32(window[0]), i32(window[1]))


def backward_v5_args(qd, kd, vd, dod, lsed, dvec, dk, dv, dq_acc, *, scale, window) -> tuple:
    """bwd_v5.cu's bwd_v5_main: bwd_v4_main's arguments, then ``lpt_pairs`` (the (batch, KV head)
    pairs a longest-first group: :func:`.policy.backward_lpt_pairs` for this band, this GPU's SMs
    and L2 cache)."""
    from .config import BWD_V4_BLOCK_K
    (B, Hq, Nq, d), (Hkv, Nk), info = qd.shape, kd.shape[1:3], device_info()
    lpt = backward_lpt_pairs(B * Hkv, Hq // Hkv, Nq, d, qd.itemsize, info.get("l2", 0), banded=window[1] >= 0,
                             tiles=-(-Nk // BWD_V4_BLOCK_K), sms=info.get("sms", 1))
    return (*backward_v4_args(qd, kd, vd, dod, lsed, dvec, dk, dv, dq_acc, scale=scale, window=window),
            np.int32(lpt))


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("cupy", "attention_backward", "v1", "bwd_v1.cu", "bwd_main", BackwardConfig, run_attention_backward,
           "FlashAttention-2's backward on CUDA cores: K/V tile per block, dK/dV in registers, P recomputed from "
           "LSE, dQ by atomic adds or deterministic per-tile partials", check_backward_v1, 10, backward_args),
    Record("cupy", "attention_backward", "v2", "bwd_v2.cu", "bwd_v2_main", BackwardConfig, run_attention_backward,
           "FlashAttention-2's backward on the tensor cores (mma.sync, ldmatrix): a warp owns 16 keys, P^T/dS^T "
           "feed dV/dK from registers, dS^T through SRAM for dQ, Q/dO tiles by cp.async", check_backward_v2, 20,
           backward_args),
    Record("cupy", "attention_backward", "v3", "bwd_v3.cu", "bwd_v3_main", BackwardConfig, run_attention_backward,
           "Hopper (FlashAttention-3's structure): wgmma from SRAM, Q/dO by TMA from a producer warpgroup, one "
           "consumer warpgroup of 64 keys, dS^T through SRAM for dQ"
           + held_back_note("attention_backward", "v3"),
           check_backward_v3, 30, backward_v3_args, dict(options=HOPPER_OPTIONS),
           default_check_for("attention_backward", "v3")),
    Record("cupy", "attention_backward", "v4", "bwd_v4.cu", "bwd_v4_main", BackwardConfig, run_attention_backward,
           "Hopper: two consumer warpgroups of 64 keys share each Q/dO tile; their halves of dS^T meet in "
           "SRAM for one dQ product"
           + held_back_note("attention_backward", "v4"),
           check_backward_v4, 40, backward_v4_args, dict(options=HOPPER_OPTIONS),
           default_check_for("attention_backward", "v4")),
    Record("cupy", "attention_backward", "v5", "bwd_v5.cu", "bwd_v5_main", BackwardConfig, run_attention_backward,
           "Hopper: v4 with its blocks longest first (the causal mask's long K/V tiles start first, in "
           "groups of heads whose Q/dO tiles share the L2 cache)"
           + held_back_note("attention_backward", "v5"),
           check_backward_v5, 50, backward_v5_args, dict(options=HOPPER_OPTIONS),
           default_check_for("attention_backward", "v5")),
    Record("cupy", "attention_backward", "v6", "bwd_v6.cu", "bwd_v6_main", BackwardConfig, run_attention_backward,
           "Hopper: v5 with dQ handed to a producer warp through SRAM and added to HBM by one bulk "
           "reduction a panel, not by the consumers' atomics"
           + held_back_note("attention_backward", "v6"),
           check_backward_v6, 60, backward_v5_args, dict(options=HOPPER_OPTIONS, finish="bwd_v6_finish"),
           default_check_for("attention_backward", "v6")),
)
REGISTRY.add(*RECORDS)
