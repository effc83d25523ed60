"""One rank's ring, as generators of communication requests; the local block kernels.

The statistics a rank keeps (:class:`RingStats`), the requests it yields (``_Send``,
``_Wait``), the block forward and backward through the package's backends or torch, and
the forward and backward step generators that both drivers run.  The steps run on NumPy
arrays or torch tensors (:mod:`iokernels.context_parallel.arrays`); the "torch" and
"torch_fused" local kernels, and the process group, need torch tensors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..core import conventions as cv
from . import arrays as xa
from .merge import merge_pair
from .split import _length, _pairs, block_schedule

#: message tags: K/V blocks and dK/dV accumulators may be in flight at the same time
KV_TAG, DKV_TAG = 0, 1
#: bound on one score block materialized by the torch block backward (bytes): it works
#: through as many query rows at a time as fit
TORCH_BWD_BLOCK_BYTES = 512 * 1024 * 1024


# --------------------------------------------------------------------------- statistics
@dataclass
class RingStats:
    """What one rank did: bytes sent/received per tag, pairs computed, a timeline.

    ``events``: (kind, step, t0, t1) with kind "compute" (a block computed), "comm"
    (a transfer from its post to the end of its wait) or "wait" (time blocked in the
    wait); times in seconds from the rank's start.
    """

    rank: int = 0
    sent: dict = field(default_factory=lambda: {"kv": 0, "dkv": 0})
    received: dict = field(default_factory=lambda: {"kv": 0, "dkv": 0})
    pairs: int = 0
    events: list = field(default_factory=list)
    resident_bytes: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.received.values())

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def as_dict(self) -> dict:
        return dict(rank=self.rank, sent=dict(self.sent), received=dict(self.received), pairs=self.pairs,
                    events=list(self.events), resident_bytes=self.resident_bytes)


_TAG_NAME = {KV_TAG: "kv", DKV_TAG: "dkv"}


@dataclass
class _Send:
    """Request: send ``tensor`` to rank r + 1; receive from r - 1 a tensor of ``shape`` (same dtype)."""

    tensor: object
    tag: int
    shape: tuple
    step: int


@dataclass
class _Wait:
    """Request: wait for the transfer posted with ``tag``; the reply is the received tensor."""

    tag: int
    step: int


# --------------------------------------------------------------------------- local blocks
def _to_backend(t, backend):
    """An array as the local kernel wants it: torch/CUDA tensors as they are, else NumPy."""
    if not xa.is_torch(t):
        return np.ascontiguousarray(t)
    if backend == "torch" or t.is_cuda:
        return t.contiguous()
    from ..torch_sdpa import _to_like
    return np.ascontiguousarray(_to_like(t.contiguous(), np.empty(0)))


def _to_torch(x, like):
    """``x`` (a kernel's result) as an array of ``like``'s kind: NumPy, or torch on its device."""
    if not xa.is_torch(like):
        from ..core.testing import as_numpy
        return np.asarray(as_numpy(x))
    import torch
    from ..torch_sdpa import _to_torch as np_to_torch
    t = x if isinstance(x, torch.Tensor) else np_to_torch(np.ascontiguousarray(x))
    return t.to(like.device)


def _rows(x, ranges, axis=2):
    parts = [x[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else xa.cat(parts, axis)


def _block_forward(q, kv, calls, scale, backend, config, stats):
    """O_b, LSE_b (accumulator dtype) of the rank's queries against one K/V block."""
    from ..api import attention
    acc = xa.accumulator(q)
    B, Hq, nq, d = q.shape
    o_b = xa.zeros((B, Hq, nq, d), acc, q)
    lse_b = xa.full((B, Hq, nq), -math.inf, acc, q)
    for qrows, krows, causal in calls:                         # load Q rows, K_c, V_c -> the kernel
        qx, kx, vx = _rows(q, qrows), _rows(kv[0], krows), _rows(kv[1], krows)
        if backend == "torch_fused":
            o, lse = _torch_fused_block(qx, kx, vx, causal, scale)
        else:
            o, lse = attention(_to_backend(qx, backend), _to_backend(kx, backend), _to_backend(vx, backend),
                               causal=causal, scale=scale, backend=backend, config=config, return_lse=True)
        (a, b), = qrows
        o_b[:, :, a:b] = xa.cast(_to_torch(o, q), acc)
        lse_b[:, :, a:b] = xa.cast(_to_torch(lse, q), acc)
        stats.pairs += _pairs(qx.shape[2], kx.shape[2], causal)
    return o_b, lse_b


def _fused_call(q, k, v, causal, scale):
    """torch's fused kernel that returns (O, LSE): flash (fp16/bf16) or memory-efficient on
    a GPU, the CPU flash kernel on a CPU.  Causal is top-left here: only for nq == nk."""
    import torch
    aten = torch.ops.aten
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif q.is_cuda:
        o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    else:
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None,
                                                                   scale=scale)
    return o, lse[..., :q.shape[2]]                             # efficient pads the LSE's rows


def _torch_fused_block(q, k, v, causal, scale):
    """(O, LSE) of one block call through torch's fused kernels, which compute the LSE anyway.

    GQA by repeating K/V heads (the fused ops take equal heads).  A bottom-right causal call
    with nk > nq (earlier chunks, then the diagonal) is two calls, merged: the first nk - nq
    keys fully visible, the last nq causal.
    """
    acc = xa.accumulator(q)
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    if not causal or nq == nk:
        return _fused_call(q, k, v, causal, scale)
    o1, l1 = _fused_call(q, k[:, :, :nk - nq], v[:, :, :nk - nq], False, scale)
    o2, l2 = _fused_call(q, k[:, :, nk - nq:], v[:, :, nk - nq:], True, scale)
    return merge_pair(o1.to(acc), l1.to(acc), o2.to(acc), l2.to(acc))


def _torch_block_backward(do, q, k, v, o, lse, causal, scale):
    """Block gradients in torch ops with the given (global) O and LSE: the recomputation.

    P = exp(S - LSE); dV = P^T dO; dP = dO V^T; D = rowsum(dO * O); dS = P (dP - D);
    dQ = scale dS K; dK = scale dS^T Q, a chunk of query rows at a time (the chunk's score
    block stays under TORCH_BWD_BLOCK_BYTES).
    """
    import torch
    acc = xa.accumulator(q)
    B, Hq, nq, d = q.shape
    Hkv, nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    ke = k.to(acc).repeat_interleave(g, dim=1)
    ve = v.to(acc).repeat_interleave(g, dim=1)
    dq = torch.zeros((B, Hq, nq, d), dtype=acc, device=q.device)
    dk = torch.zeros((B, Hq, nk, d), dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    rows = max(1, TORCH_BWD_BLOCK_BYTES // max(1, B * Hq * nk * dq.element_size()))
    for r0 in range(0, nq, rows):                              # a chunk of query rows
        r1 = min(nq, r0 + rows)
        qi, doi = q[:, :, r0:r1].to(acc), do[:, :, r0:r1].to(acc)
        li = lse[:, :, r0:r1, None]
        s = torch.matmul(qi, ke.transpose(-1, -2)) * scale
        vis = torch.from_numpy(cv.mask(nq, nk, causal, rows=(r0, r1))).to(q.device)
        p = torch.where(vis & torch.isfinite(li), torch.exp(s - torch.where(torch.isfinite(li), li, 0)), 0)
        D = (doi * o[:, :, r0:r1].to(acc)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doi, ve.transpose(-1, -2)) - D)
        dv += torch.matmul(p.transpose(-1, -2), doi)
        dq[:, :, r0:r1] = torch.matmul(ds, ke) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qi) * scale
    return dq, dk.view(B, Hkv, g, nk, d).sum(2), dv.view(B, Hkv, g, nk, d).sum(2)


def _torch_backward_for(q) -> bool:
    """Whether a block's gradients come from :func:`_torch_block_backward` (CUDA tensors: the
    GPU has no other backward for a ring block) rather than the package's attention_backward."""
    return xa.is_cuda(q)


def _block_backward(do, q, o, lse, kv, calls, scale, backend, config, stats):
    """dQ (rank's rows) and dK_c, dV_c (packed, accumulator dtype) of one block."""
    from ..api import attention_backward
    acc = xa.accumulator(q)
    dq = xa.zeros(q.shape, acc, q)
    dkv = xa.zeros(kv.shape, acc, q)
    bwd = "naive" if backend == "naive" else "tiled"
    for qrows, krows, causal in calls:
        sel = [_rows(x, qrows) for x in (do, q, o)]
        lsex = _rows(lse[..., None], qrows)[..., 0]
        kx, vx = _rows(kv[0], krows), _rows(kv[1], krows)
        if _torch_backward_for(q):
            do_x, q_x, o_x = sel
            g = _torch_block_backward(do_x, q_x, kx, vx, o_x, lsex, causal, scale)
        else:
            args = [_to_backend(x, bwd) for x in (*sel[:2], kx, vx, sel[2])] + [_to_backend(lsex, bwd)]
            g = attention_backward(*args, causal=causal, scale=scale, backend=bwd,
                                   config=config if bwd == backend else None)
        dqx, dkx, dvx = (xa.cast(_to_torch(x, q), acc) for x in g)
        (a, b), = qrows
        dq[:, :, a:b] += dqx
        off = 0
        for ka, kb in krows:                                   # scatter dK, dV back to the block
            dkv[0, :, :, ka:kb] += dkx[:, :, off:off + kb - ka]
            dkv[1, :, :, ka:kb] += dvx[:, :, off:off + kb - ka]
            off += kb - ka
        stats.pairs += _pairs(sel[1].shape[2], kx.shape[2], causal)
    return dq, dkv


def _round(x, dtype):
    """Store ``x`` in ``dtype`` between steps (None: keep), computing on in its own dtype."""
    return x if dtype is None else xa.cast(xa.cast(x, dtype), x.dtype)


# --------------------------------------------------------------------------- one rank's steps
def _forward_steps(q, kv, rank, W, kv_pos, q_pos, causal, scale, backend, config, partial_dtype, stats):
    """One rank's ring forward as a generator of communication requests; returns (O, LSE)."""
    acc = xa.accumulator(q)
    B, Hq, nq, d = q.shape
    o = xa.zeros((B, Hq, nq, d), acc, q)
    lse = xa.full((B, Hq, nq), -math.inf, acc, q)
    stats.resident_bytes = _nbytes(q, kv, o, lse) + _nbytes(kv) * (W > 1)   # + the block arriving
    for step in range(W):                                       # the ring: W steps, K_c, V_c in HBM
        c = (rank - step) % W                                   # K_c, V_c in hand
        if step < W - 1:                                        # post: send K_c, V_c -> rank + 1;
            nxt = (c - 1) % W                                   #       receive K_c-1, V_c-1 <- rank - 1
            yield _Send(kv, KV_TAG, (2,) + kv.shape[1:3] + (_length(kv_pos[nxt]), kv.shape[-1]), step)
        t0 = stats.now()
        o_b, lse_b = _block_forward(q, kv, block_schedule(q_pos[rank], kv_pos[c], causal), scale, backend,
                                    config, stats)
        o, lse = merge_pair(o, lse, _round(o_b, partial_dtype), lse_b)
        o = _round(o, partial_dtype)
        stats.events.append(("compute", step, t0, stats.now()))
        if step < W - 1:
            kv = yield _Wait(KV_TAG, step)                      # K_c-1, V_c-1 have arrived
    return xa.cast(o, q.dtype), lse


def _backward_steps(do, q, o, lse, kv, rank, W, kv_pos, q_pos, causal, scale, backend, config, stats):
    """One rank's ring backward: K/V travel as in the forward, dK/dV travel with them."""
    acc = xa.accumulator(q)
    dq = xa.zeros(q.shape, acc, q)
    dkv = None
    stats.resident_bytes = _nbytes(do, q, o, lse, dq) + _nbytes(kv) * (1 + (W > 1)) + \
        2 * xa.nbytes(kv) // xa.itemsize(kv) * xa.itemsize(dq) * (W > 1)
    for step in range(W):                                       # the ring: K_c, V_c, dK_c, dV_c in HBM
        c = (rank - step) % W
        nxt = (c - 1) % W
        nxt_shape = (2,) + kv.shape[1:3] + (_length(kv_pos[nxt]), kv.shape[-1])
        if step < W - 1:
            yield _Send(kv, KV_TAG, nxt_shape, step)            # K_c, V_c -> rank + 1
        t0 = stats.now()
        dq_b, dkv_b = _block_backward(do, q, o, lse, kv, block_schedule(q_pos[rank], kv_pos[c], causal),
                                      scale, backend, config, stats)
        dq += dq_b
        stats.events.append(("compute", step, t0, stats.now()))
        if step > 0:
            dkv_b = dkv_b + (yield _Wait(DKV_TAG, step))        # dK_c, dV_c so far <- rank - 1
        dkv = dkv_b
        if W > 1:
            yield _Send(dkv, DKV_TAG, nxt_shape, step)          # dK_c, dV_c -> rank + 1 (last: home)
        if step < W - 1:
            kv = yield _Wait(KV_TAG, step)
    if W > 1:
        dkv = yield _Wait(DKV_TAG, W)                           # my own block's dK, dV, complete
    return xa.cast(dq, q.dtype), xa.cast(dkv[0], q.dtype), xa.cast(dkv[1], q.dtype)


def _nbytes(*ts) -> int:
    return xa.nbytes(*ts)
