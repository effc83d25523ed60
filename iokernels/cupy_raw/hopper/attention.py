"""The Hopper attention launch (fa_v3.cu .. fa_v11.cu) and its argument builders."""
from __future__ import annotations

import math

import numpy as np

from ...core import conventions as cv
from ...core.arrays import Call, device_array
from ..launch import HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, cupy, device_info, fill, function, on_stream
from ..policy import forward_lpt_pairs, hopper_forward_for_length
from ..registry import REGISTRY
from .checks import require_available
from .config import BLOCK_M, DTYPES, HEAD_DIMS, LONGEST_FIRST, PANEL, PERSISTENT, THREADS, HopperConfig, grid
from .tensor_maps import tensor_map


def _qkv_map(x, dtype, rows_box):
    """The 3-D map (head_dim, seq, batch * heads) of a contiguous (B, H, N, d) device array."""
    B, H, N, d = x.shape
    return tensor_map(x.ptr, dtype, (d, N, B * H), (2 * d, 2 * d * N), (PANEL, rows_box, 1))


def _check_attention_inputs(q, k, v, causal, scale, window, config):
    info = cv.check_qkv(q, k, v, allowed=DTYPES)
    if info["head_dim"] not in HEAD_DIMS:
        raise ValueError(f"q: the Hopper kernels take head_dim in {HEAD_DIMS}, got {info['head_dim']}")
    if config is None:
        config = HopperConfig()
    if not isinstance(config, HopperConfig):
        raise ValueError(f"config: expected a HopperConfig or None, got {type(config).__name__}")
    scale = cv.resolve_scale(scale, info["head_dim"])
    left, right = cv.effective_window(bool(causal), window)
    if config.version is None:                    # the registry's choice for these lengths and this band
        config = config.replace(version=hopper_forward_for_length(info["head_dim"], info["seqlen_q"],
                                                                  info["seqlen_k"], (left, right)))
    return info, scale, (left, right), config.resolve(info["head_dim"])


def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """FlashAttention forward on Hopper: (O, LSE).  ``config``: a :class:`HopperConfig` (None, or
    version None: the version the registry's default picks for these lengths and this band,
    :func:`~iokernels.cupy_raw.policy.hopper_forward_for_length`).

    q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d), float16 or bfloat16, d in (64, 128, 256): torch CUDA
    tensors or CuPy arrays (used in place when contiguous) or NumPy arrays (copied).  O has q's
    dtype; LSE is float32 (B, Hq, Nq), natural log; rows that see no key give O = 0, LSE = -inf.
    """
    info, scale, win, cfg = _check_attention_inputs(q, k, v, causal, scale, window, config)
    require_available()
    cfg.check_fits(info["head_dim"], device_info()["smem_optin"])
    call = Call(q, name="q")
    dtype = info["dtype"]
    B, Hq, Nq, d = info["batch"], info["heads_q"], info["seqlen_q"], info["head_dim"]
    with on_stream(call.stream_ptr()):
        qd, kd, vd = (call.to_device(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        o = call.empty((B, Hq, Nq, d), dtype)
        lse = call.empty((B, Hq, Nq), "float32")
        launch_attention(qd, kd, vd, o, lse, dtype=dtype, scale=scale, window=win, config=cfg)
    return call.finish(o, dtype), call.finish(lse, "float32")


def launch_attention(q, k, v, o, lse, *, dtype, scale, window, config):
    """Launch one version on device arrays, on CuPy's current stream (the caller's, through
    :func:`~iokernels.cupy_raw.launch.on_stream`); ``o`` (B, Hq, Nq, d) and ``lse`` (B, Hq, Nq)
    are preallocated and contiguous (the checks poison them first)."""
    qd, kd, vd = (device_array(contiguous(x, 16), dtype) for x in (q, k, v))
    B, Hq, Nq, d = qd.shape
    cfg = config.resolve(d)
    Nk = kd.shape[2]
    if B * Hq * Nq == 0:
        return
    if Nk == 0:                                   # no keys: every row is fully masked
        fill(o, 0)
        fill(lse, -math.inf)
        return
    od, ld = device_array(o, dtype), device_array(lse, "float32")
    left, right = window
    # causal / right-bounded: later query tiles see more keys; start those first
    block_m = cfg.block_m()
    heavy_first = right >= 0 and Nq > block_m
    rec = REGISTRY.get("attention", cfg.version)
    smem = cfg.smem_bytes(d)
    fn = function(rec.file, rec.kernel, cfg.defines(d, dtype), smem, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
    extra = {}
    if cfg.version in PERSISTENT:                 # the tile counter: zeros, and zeros again after the launch
        extra["claimed"] = device_array(cupy().zeros(2, dtype=np.int32))
    if cfg.version in LONGEST_FIRST:              # the pairs of a longest-first group
        extra["lpt_pairs"] = longest_first_pairs(qd.shape, Nk, qd.itemsize, heavy_first)
    args = rec.args(qd, kd, vd, od, ld, dtype=dtype, block_n=cfg.block_n, scale=scale, window=window,
                    heavy_first=heavy_first, block_m=block_m, **extra)
    fn(grid(cfg, B, Hq, Nq, device_info()["sms"]), (THREADS[cfg.version],), args, shared_mem=smem)


def attention_args(qd, kd, vd, od, ld, *, dtype, block_n, scale, window, heavy_first, block_m=BLOCK_M) -> tuple:
    """fa_v3.cu .. fa_v8.cu, fa_v10.cu: the tensor maps of Q (boxes of ``block_m`` rows: the version's Br), K, V,
    the outputs, sizes, the scale in log2 units, the window, whether the heavy (later) query tiles
    start first."""
    (_, Hq, Nq, _), (_, Hkv, Nk, _) = qd.shape, kd.shape
    maps = (_qkv_map(qd, dtype, block_m), _qkv_map(kd, dtype, block_n), _qkv_map(vd, dtype, block_n))
    i32 = np.int32
    return (*maps, od.arg, ld.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            np.float32(scale * math.log2(math.e)), i32(window[0]), i32(window[1]), i32(heavy_first))


def longest_first_pairs(q_shape: tuple, seq_k: int, itemsize: int, heavy_first: bool) -> int:
    """fa_v11.cu's group of (batch, head) pairs for q of ``q_shape`` (B, Hq, Nq, d) over ``seq_k``
    keys on this GPU: :func:`~iokernels.cupy_raw.policy.forward_lpt_pairs`, banded where the heavy
    query tiles go first (the band has an upper edge and a pair has more than one tile)."""
    B, Hq, _, d = q_shape
    return forward_lpt_pairs(B * Hq, seq_k, d, itemsize, device_info().get("l2", 0), banded=bool(heavy_first))


def lpt_attention_args(qd, kd, vd, od, ld, *, dtype, block_n, scale, window, heavy_first, lpt_pairs,
                       block_m=BLOCK_M) -> tuple:
    """fa_v11.cu: :func:`attention_args`, then ``lpt_pairs``, the (batch, head) pairs a
    longest-first group holds (:func:`longest_first_pairs`; 1: v8's order)."""
    return (*attention_args(qd, kd, vd, od, ld, dtype=dtype, block_n=block_n, scale=scale, window=window,
                            heavy_first=heavy_first, block_m=block_m), np.int32(lpt_pairs))


def persistent_attention_args(qd, kd, vd, od, ld, *, dtype, block_n, scale, window, heavy_first, claimed,
                              block_m=BLOCK_M) -> tuple:
    """fa_v9.cu: :func:`attention_args`, then the batch (the kernel counts the query tiles itself)
    and ``claimed``, two int32 that are zero before a launch (and again after it): the tiles
    claimed so far and the blocks that have run out.  A stream's launches take turns on one
    counter; launches that may run at the same time need one each."""
    return (*attention_args(qd, kd, vd, od, ld, dtype=dtype, block_n=block_n, scale=scale, window=window,
                            heavy_first=heavy_first, block_m=block_m), np.int32(qd.shape[0]), claimed.arg)
