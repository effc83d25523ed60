"""The decode launchers: split-KV decode over a contiguous cache and over a paged one.

Both return (O, LSE) of the caller's kind: O (B, Hq, d) in q's dtype, LSE (B, Hq) float32.
``num_splits`` None picks the split count by FlashAttention-2's occupancy rule
(:func:`iokernels.decode.occupancy_splits`) for this GPU's multiprocessors (132, an H100's,
under the interpreter), over the longest visible run of keys; a split count above what the
keys fill leaves trailing splits empty, and the merge weighs them 0.

Lengths: None (every sequence all N keys), host values (NumPy, a list, a CPU tensor on a GPU:
checked against the cache and uploaded, the upload kept while the values repeat) or a torch
integer tensor (B,) on q's device, which is used in place and never read on the host: the split
count is then planned for the cache's capacity (N, or a paged table's width x page) and the
lengths are trusted to lie in [0, capacity], as the CuPy plans trust device lengths.  With
device lengths (and a paged call's device block tables) a call makes no host synchronisation and
no host-to-device copy, so a CUDA graph can capture it and replay it after the lengths, the
tables and the queries change in place (a vLLM-style decode step).

The versions run one kernel (:mod:`.decode_v1`) and differ in how deep they fill the GPU
(:data:`.config.DECODE_DEPTH`).  v1 asks the rule, FlashAttention's ``num_splits_heuristic``
(flash_api.cpp, code), for one program a multiprocessor where FlashAttention-2 counts two of its
128-thread blocks.  v2's idea: a decode is bound by
memory traffic, and one program of four warps a multiprocessor keeps too few loads in flight
to stream at the memory's speed (Little's law: bytes in flight = bandwidth x latency; Volkov,
"Understanding Latency Hiding on GPUs", 2016, PhD thesis), so v2 asks the rule for four
programs a multiprocessor -- more splits at small batches -- each with a two-stage pipeline.
v3 runs its own split kernel (:mod:`.decode_v3`: a paged tile's block ids loaded a step ahead, so
Triton's pipeliner runs the paged K/V copies ahead as it does the contiguous ones), three programs
a multiprocessor deep with three stages.
"""
from __future__ import annotations

import functools

import numpy as np

from ..core import conventions as cv
from ..decode import DEFAULT_NUM_SMS, MAX_SPLITS, occupancy_splits
from . import launch as ln
from .config import LN2, LOG2E, DecodeConfig, next_pow2, padded_head_dim
from .forward import f32_dot


def _splits(num_splits, batch, heads_kv, longest, left, block_n, programs_per_sm=1) -> int:
    """The split count: ``num_splits``, else the occupancy rule over the most keys a query sees
    (``longest`` keys, or the window's left + 1 where that is fewer)."""
    if num_splits is not None:
        return int(num_splits)
    visible = longest if left < 0 else min(longest, left + 1)
    return _occupancy(batch, heads_kv, int(visible), block_n, programs_per_sm)


def split_count(batch: int, heads_kv: int, keys: int, block_n: int, programs_per_sm: int, sms: int) -> int:
    """The split count of a version that fills ``programs_per_sm`` programs on each of ``sms``
    multiprocessors: the occupancy rule asked for that many programs' worth of multiprocessors."""
    return occupancy_splits(batch, heads_kv, keys, sms * programs_per_sm, block_n=block_n, max_splits=MAX_SPLITS)


@functools.lru_cache(maxsize=256)
def _occupancy(batch, heads_kv, visible, block_n, programs_per_sm=1) -> int:
    """:func:`split_count` on this GPU's multiprocessors."""
    return split_count(batch, heads_kv, visible, block_n, programs_per_sm, ln.device_count_sms() or DEFAULT_NUM_SMS)


def _launch(qt, kt, vt, table, lens_t, longest, hkv, kv_strides, paged, page, *, num_splits, scale, config, window):
    """The split kernel and the merge, on torch tensors, the split count planned for ``longest``
    keys; returns (O, LSE) tensors."""
    from .decode_v1 import merge, split_kv
    from .decode_v3 import split_kv_v3
    cfg = config or DecodeConfig(version="v2")
    split = split_kv_v3 if cfg.version == "v3" else split_kv
    B, Hq, d = (int(s) for s in qt.shape)
    dtype = cv.dtype_name(qt)
    left = cv.resolve_window(window)[0]
    bn = cfg.keys_per_tile(ln.interpreting())
    programs, stages = cfg.depth()
    S = _splits(num_splits, B, hkv, longest, left, bn, programs)
    scale = cv.default_scale(d) if scale is None else scale
    o = ln.empty((B, Hq, d), dtype, like=qt)
    lse = ln.empty((B, Hq), "float32", like=qt)
    if B * Hq == 0:
        return o, lse
    o_part = ln.empty((S, B, Hq, d), "float32", like=qt)
    lse_part = ln.empty((S, B, Hq), "float32", like=qt)
    group = Hq // hkv
    warps = cfg.num_warps or 4
    split[(S, B * hkv)](qt, kt, vt, table, lens_t, o_part, lse_part, *ln.strides(qt), *kv_strides,
                        int(table.stride(0)), B, hkv, group, d, float(scale) * LOG2E, left, S, page,
                        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=bn, BLOCK_D=padded_head_dim(d), PAGED=paged,
                        F32=f32_dot(dtype), num_warps=warps,
                        **({} if stages is None else dict(num_stages=stages)))
    merge[(B * Hq,)](o_part, lse_part, o, lse, B * Hq, d, S, LN2=LN2, BLOCK_S=next_pow2(S),
                     BLOCK_D=padded_head_dim(d), num_warps=4)
    return o, lse


def _lens(seq_lens, batch: int, capacity: int, like):
    """(int32 lengths on ``like``'s device, the longest length the split count plans for), with
    ``capacity`` the most keys a sequence can hold: None fills ``capacity`` on the device; a
    torch tensor on ``like``'s device is used in place (:func:`device_lens`); anything else is
    host values (:func:`host_lens`)."""
    if seq_lens is None:
        import torch
        return torch.full((batch,), capacity, dtype=torch.int32, device=like.device), capacity
    if ln.is_torch(seq_lens) and seq_lens.device == like.device:
        return device_lens(seq_lens, batch, capacity), capacity
    return host_lens(seq_lens, batch, capacity, like)


def device_lens(seq_lens, batch: int, capacity: int):
    """Lengths on the kernels' device, used in place (another integer dtype converted there); a
    wrong shape or dtype is a ValueError.  Their values are not read on a GPU (a read would wait
    for the device); under the interpreter the tensor is host memory, and they are checked."""
    import torch
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex \
            or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens: expected {batch} integers (one per sequence), got shape "
                         f"{tuple(seq_lens.shape)} dtype {seq_lens.dtype}")
    if seq_lens.device.type == "cpu":
        _check_values(seq_lens.numpy(), capacity)
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    return seq_lens


def host_lens(seq_lens, batch: int, capacity: int, like):
    """Host lengths checked against ``capacity`` and uploaded (kept while they repeat): (the
    device tensor, the longest).  Refused while a CUDA graph captures the stream."""
    _refuse_in_capture(like, "seq_lens")
    lens = np.asarray(ln.to_caller(seq_lens, True) if ln.is_torch(seq_lens) else seq_lens)
    if lens.shape != (batch,) or lens.dtype.kind not in "iu":
        raise ValueError(f"seq_lens: expected {batch} integers (one per sequence), got shape {lens.shape} "
                         f"dtype {lens.dtype}")
    _check_values(lens, capacity)
    return ln.upload_int32(lens, like), int(lens.max(initial=0))


def _refuse_in_capture(like, name: str) -> None:
    """A ValueError naming ``name`` while a CUDA graph captures the current stream: a host array's
    upload is not captured (or, kept from an earlier call, its values would be replayed forever)."""
    import torch
    if like.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"{name}: a CUDA graph reads it when it replays; pass it as an int32 tensor on q's device "
                         f"(host values would be baked in at capture)")


def _check_values(lens, capacity: int) -> None:
    if np.any(lens < 0) or np.any(lens > capacity):
        raise ValueError(f"seq_lens: each length must be in [0, {capacity}], got {np.asarray(lens).tolist()}")


def _int32():
    import torch
    return torch.int32


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """Split-KV decode over a contiguous (ragged) cache: q (B, Hq, d), k, v (B, Hkv, N, d)."""
    ln.prepare()
    numpy_caller = isinstance(q, np.ndarray)
    qt, kt, vt = (ln.to_torch(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    B, hkv, N = int(kt.shape[0]), int(kt.shape[1]), int(kt.shape[2])
    lens_t, longest = _lens(seq_lens, B, N, qt)
    kv = (*ln.strides(kt), *ln.strides(vt))              # (b, h, n, d) of each
    o, lse = _launch(qt, kt, vt, lens_t.view(1, -1), lens_t, longest, hkv, kv, False, 1, num_splits=num_splits,
                     scale=scale, config=config, window=window)
    return ln.to_caller(o, numpy_caller), ln.to_caller(lse, numpy_caller)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None,
                       window=None):
    """Paged decode over pools (num_blocks, page, Hkv, d) and block tables (B, max_blocks): (O, LSE).

    NumPy or torch arrays (the pools and tables of the kind q is); table entries past a
    sequence's blocks are never read.  A torch int32 table with contiguous rows and lengths on
    q's device are used in place (the module's docstring: what a CUDA graph needs)."""
    ln.prepare()
    numpy_caller = isinstance(q, np.ndarray)
    qt, kp, vp = (ln.to_torch(x, n) for x, n in ((q, "q"), (k_pool, "k_pool"), (v_pool, "v_pool")))
    if isinstance(block_tables, np.ndarray):
        _refuse_in_capture(qt, "block_tables")
        table = ln.upload_int32(block_tables, qt)
    else:                                          # a torch table: int32, rows contiguous (read as table[b, i])
        table = ln.to_torch(block_tables, "block_tables").to(_int32()).contiguous()
    B, page, hkv = int(qt.shape[0]), int(kp.shape[1]), int(kp.shape[2])
    if seq_lens is None:
        raise ValueError("seq_lens: a paged decode needs each sequence's length")
    lens_t, longest = _lens(seq_lens, B, int(table.shape[1]) * page, qt)
    ks, vs = ln.strides(kp), ln.strides(vp)             # (block, slot, head, d)
    kv = (ks[0], ks[2], ks[1], ks[3], vs[0], vs[2], vs[1], vs[3])
    o, lse = _launch(qt, kp, vp, table, lens_t, longest, hkv, kv, True, page, num_splits=num_splits, scale=scale,
                     config=config, window=window)
    return ln.to_caller(o, numpy_caller), ln.to_caller(lse, numpy_caller)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None, window=None):
    """Decode over a :class:`~iokernels.paged.PagedKVCache` (its NumPy pools copied to the device)."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    return paged_decode_pools(q, cache.k_pool, cache.v_pool, tables, lens, num_splits=num_splits, scale=scale,
                              config=config, window=window)
