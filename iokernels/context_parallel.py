"""Step 8c: context parallelism: ring attention over torch.distributed.

A long context outgrows one GPU's memory before it outgrows its compute.  Ring attention
(Liu, Zaharia and Abbeel, 2023) splits the *sequence* across W devices: rank r holds the
queries, keys and values of its positions.  The K/V blocks then travel round a ring:
at step s rank r holds the K/V block of rank (r - s) mod W, computes attention of its
own queries against it, and meanwhile sends that block on to rank r + 1 and receives
the next one from rank r - 1.  After W steps every query has met every key, and the W
partial results are joined by the same exact log-sum-exp merge that joins
Flash-Decoding's splits (:mod:`iokernels.decode`).

Notation
========

=============  =============================================================
W              world size: ranks (devices) on the ring
r, s           a rank and a ring step; at step s rank r holds block c = (r - s) mod W
N, n_r         sequence length and the tokens of rank r (n_r ~ N / W)
Q_r, K_c, V_c  rank r's queries and the K/V block that started on rank c
O, LSE         the running (merged) output and log-sum-exp of a rank's queries
O_b, LSE_b     one block's partial output and log-sum-exp
dK_c, dV_c     gradient accumulators of block c; they travel with the block
Hq, Hkv, d     query heads, K/V heads (GQA: Hq % Hkv == 0), head dim
=============  =============================================================

The merge, pairwise, in the accumulator precision (float32; float64 for float64 inputs),
in the numerically stable sigmoid / log-sigmoid form used by ring-flash-attention::

    LSE' = LSE - log sigmoid(LSE - LSE_b)           (= log(exp LSE + exp LSE_b))
    O'   = O - sigmoid(LSE_b - LSE) * (O - O_b)     (= weights exp(LSE_b - LSE'))

A state with LSE = -inf (no key seen yet) weighs nothing: the other side is taken as it
is, and two empty states stay O = 0, LSE = -inf, never NaN.  Chained over all blocks it
equals :func:`iokernels.decode.merge_states` over all parts at once.

Causal attention (bottom-right aligned, N_q = N_k) and the two splits
---------------------------------------------------------------------
The sequence is cut into chunks.  A chunk pair (query chunk, key chunk) is either fully
visible (the key chunk lies before the query chunk), diagonal (the same chunk: causal
inside) or skipped (the key chunk lies after): the work above the diagonal is never
done.  Per query chunk, the fully visible key chunks and the diagonal one are joined
into one call with bottom-right causal masking, which is exactly "all of the earlier
chunks, then causal within its own".

* ``split="contiguous"``: W chunks, rank r takes chunk r.  Causal work is unbalanced:
  rank 0 computes one diagonal block, rank W - 1 computes W - 1 full blocks and one
  diagonal, and every step waits for the slowest rank.
* ``split="zigzag"``: 2W chunks, rank r takes chunks r and 2W - 1 - r (one early, one
  late), so every rank does the same causal work (the load-balanced split of the
  ring-flash-attention and Llama-3 context-parallel implementations).

Lengths need not divide by W (or 2W): chunks differ by at most one token; the receive
buffers are sized from the split, which every rank knows.

Communication
=============
Each step posts one batched send/receive (``torch.distributed.batch_isend_irecv`` of
two ``P2POp`` s), then computes the block in hand, then waits: the transfer is hidden
behind the computation when the block takes longer to compute than to send.  K and V
travel as one packed (2, B, Hkv, n_c, d) tensor.

* forward: rank r sends W - 1 K/V blocks (every block but that of rank r + 1) and
  receives W - 1 (every block but its own);
* backward: the same W - 1 K/V blocks, plus the dK/dV accumulators (accumulator dtype):
  each travels with its block and takes one last hop home, W sends per rank.

:func:`comm_model` gives these byte counts in closed form; the counters of
:class:`RingStats` count what was really sent, and the tests hold them equal.

One code path, two drivers
==========================
A rank's algorithm is a generator (:func:`_forward_steps`, :func:`_backward_steps`)
that yields its communication requests (``_Send``: post a batched send/receive;
``_Wait``: wait for it and take the received tensor).  :func:`ring_attention` drives it
over a real process group (gloo on CPU processes, NCCL on GPUs); :func:`simulate` drives
W such generators in lockstep in one process, passing the tensors round by hand, so a
notebook can run the ring without launching processes, through the same code.

Local kernels
=============
Any backend computes the blocks: ``ik.attention(..., return_lse=True)`` with "naive",
"tiled", "numba" (NumPy arrays; the Numba simulator on a CPU), "cupy" or "torch" (torch
CUDA tensors pass through without copies); or "torch_fused", torch's fused kernels called
directly for the LSE they compute anyway (flash for fp16/bf16 and memory-efficient for
fp32 on a GPU, the CPU flash kernel on a CPU), the one to time on GPUs.  Block gradients come from
``ik.attention_backward`` ("naive" for the naive forward, "tiled" otherwise) on CPU
tensors, and from :func:`_torch_block_backward` (the same recomputation formulas in torch
ops, a few query rows at a time) on CUDA tensors, because the "torch" backward re-runs
SDPA's own forward and cannot take the ring's global LSE.

Frank notes
-----------
* The "torch" local kernel computes its LSE beside SDPA with a second Q K^T (see
  :mod:`iokernels.torch_sdpa`), so on a GPU it does more work than "torch_fused", which
  reads the LSE from torch's private fused operators (``torch.ops.aten._scaled_dot_product_*``:
  not a public API, so they may change between torch versions).  "torch_fused" repeats
  K/V heads for GQA.  The NumPy kernels are there to be read, not timed.
* The backward on CUDA tensors materializes a score block of query rows by keys (the
  recomputation in torch ops, bounded by TORCH_BWD_BLOCK_BYTES), not a fused kernel.
* Causal needs seqlen_q == seqlen_k (self-attention, what context parallelism is for);
  sliding windows are not offered.
* ``partial_dtype="bfloat16"`` stores each block's output and the running output in
  bfloat16 between steps (as a kernel that returns bf16 blocks would): the merged error
  then grows with W.  The default keeps them in the accumulator precision.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .core import conventions as cv

__all__ = ["SPLITS", "split_positions", "chunk_bounds", "shard", "unshard", "merge_pair", "RingStats",
           "ring_attention", "ring_attention_backward", "simulate", "comm_model", "memory_per_rank",
           "causal_work", "block_schedule", "schedule_timeline", "work_per_rank", "merge_error_vs_world_size"]

SPLITS = ("contiguous", "zigzag")
#: message tags: K/V blocks and dK/dV accumulators may be in flight at the same time
KV_TAG, DKV_TAG = 0, 1
#: bound on one score block materialized by the torch block backward (bytes): it works
#: through as many query rows at a time as fit
TORCH_BWD_BLOCK_BYTES = 512 * 1024 * 1024
#: local kernels: the package's backends, plus torch's fused kernels called for their LSE
RING_BACKENDS = ("naive", "tiled", "numba", "cupy", "torch", "torch_fused")


# --------------------------------------------------------------------------- the split
def chunk_bounds(n: int, parts: int):
    """[start, stop) of ``parts`` contiguous chunks of n tokens, sizes differing by <= 1."""
    base, extra = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def split_positions(seqlen: int, world_size: int, split: str = "zigzag"):
    """The global token ranges each rank holds: a tuple per rank of (start, stop) segments.

    contiguous: rank r holds chunk r of W.  zigzag: chunks r and 2W - 1 - r of 2W.
    """
    cv.check_choice(split, "split", SPLITS)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < world_size:
        raise ValueError(f"seqlen: expected an integer >= world_size ({world_size}), got {seqlen!r}")
    W = world_size
    if split == "contiguous":
        return tuple((c,) for c in chunk_bounds(seqlen, W))
    if seqlen < 2 * W:
        raise ValueError(f"seqlen: the zigzag split needs at least 2 * world_size = {2 * W} tokens, "
                         f"got {seqlen}")
    ch = chunk_bounds(seqlen, 2 * W)
    return tuple((ch[r], ch[2 * W - 1 - r]) for r in range(W))


def _length(segments) -> int:
    return sum(b - a for a, b in segments)


def shard(x, segments, axis: int = 2):
    """A rank's shard of a full (B, H, N, d) array: its segments, concatenated along ``axis``."""
    xp = _namespace(x)
    parts = [x[(slice(None),) * axis + (slice(a, b),)] for a, b in segments]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis) if xp is np else xp.cat(parts, axis)


def unshard(shards, positions, axis: int = 2):
    """The full array from every rank's shard (NumPy): the inverse of :func:`shard`."""
    shards = [np.asarray(s) for s in shards]
    n = max(b for segs in positions for _, b in segs)
    shape = list(shards[0].shape)
    shape[axis] = n
    out = np.empty(shape, shards[0].dtype)
    for s, segs in zip(shards, positions):
        off = 0
        for a, b in segs:
            idx = (slice(None),) * axis
            out[idx + (slice(a, b),)] = s[idx + (slice(off, off + b - a),)]
            off += b - a
    return out


def block_schedule(q_segments, kv_segments, causal: bool):
    """What a rank computes against one K/V block: a list of calls.

    Each call is (q rows, kv rows, causal): local row ranges of the rank's queries and of
    the block, lists of (start, stop).  Not causal: one call, everything.  Causal: per
    query segment, the key segments lying before it (fully visible) followed by the same
    segment if the block holds it (diagonal), as one bottom-right causal call; key
    segments lying after it are skipped (the work above the diagonal).
    """
    def local(segs):
        out, off = [], 0
        for a, b in segs:
            out.append((off, off + b - a))
            off += b - a
        return out

    ql, kl = local(q_segments), local(kv_segments)
    if not causal:
        return [([(0, ql[-1][1])], [(0, kl[-1][1])], False)]
    calls = []
    for (qa, qb), qloc in zip(q_segments, ql):
        full = [kloc for (ka, kb), kloc in zip(kv_segments, kl) if kb <= qa]
        diag = [kloc for (ka, kb), kloc in zip(kv_segments, kl) if (ka, kb) == (qa, qb)]
        if full or diag:
            calls.append(([qloc], full + diag, bool(diag)))
    return calls


def _pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs a call evaluates: the visible ones (the mask's ones)."""
    lo, hi = cv.key_range(np.arange(nq), nq, nk, causal)
    return int(np.sum(hi - lo))


def causal_work(seqlen: int, world_size: int, split: str, causal: bool = True):
    """(query, key) pairs each rank computes over the whole ring (the schedule's work)."""
    pos = split_positions(seqlen, world_size, split)
    work = []
    for r in range(world_size):
        total = 0
        for s in range(world_size):
            for qrows, krows, c in block_schedule(pos[r], pos[(r - s) % world_size], causal):
                total += _pairs(_length(qrows), _length(krows), c)
        work.append(total)
    return work


# --------------------------------------------------------------------------- the merge
def _namespace(x):
    """NumPy or torch, whichever ``x`` belongs to (the merge is written once for both)."""
    if type(x).__module__.startswith("torch"):
        import torch
        return torch
    return np


def merge_pair(o, lse, o_b, lse_b):
    """Merge a block's (O_b, LSE_b) into the running (O, LSE): exact, stable, NaN-free.

    Arrays are NumPy or torch, in the accumulator precision; O (..., d), LSE (...).
    LSE' = LSE - log sigmoid(LSE - LSE_b);  O' = O - sigmoid(LSE_b - LSE) * (O - O_b).
    A side with LSE = -inf contributes nothing; both -inf stays (O, -inf).
    """
    xp = _namespace(o)
    live, live_b = lse > -math.inf, lse_b > -math.inf
    both = live & live_b
    zero = xp.zeros_like(lse)
    diff = xp.where(both, lse_b, zero) - xp.where(both, lse, zero)  # finite everywhere, no inf - inf
    log_sig = -xp.logaddexp(zero, -diff)                              # log sigmoid(LSE_b - LSE)
    w = xp.exp(log_sig)                                               # sigmoid(LSE_b - LSE)
    o_new = xp.where(both[..., None], o - w[..., None] * (o - o_b), xp.where(live_b[..., None], o_b, o))
    softplus = xp.logaddexp(zero, diff)                               # = -log sigmoid(LSE - LSE_b)
    lse_new = xp.where(both, lse + softplus, xp.where(live_b, lse_b, lse))
    return o_new, lse_new


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
def _acc_torch(dtype):
    import torch
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_backend(t, backend):
    """A torch tensor as the local kernel wants it: torch/CUDA tensors as they are, else NumPy."""
    if backend == "torch" or t.is_cuda:
        return t.contiguous()
    from .torch_sdpa import _to_like
    return np.ascontiguousarray(_to_like(t.contiguous(), np.empty(0)))


def _to_torch(x, like):
    import torch
    from .torch_sdpa import _to_torch as np_to_torch
    t = x if isinstance(x, torch.Tensor) else np_to_torch(np.ascontiguousarray(x))
    return t.to(like.device)


def _rows(x, ranges, axis=2):
    import torch
    parts = [x.narrow(axis, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, axis)


def _block_forward(q, kv, calls, scale, backend, config, stats):
    """O_b, LSE_b (accumulator dtype) of the rank's queries against one K/V block."""
    import torch
    from .api import attention
    acc = _acc_torch(q.dtype)
    B, Hq, nq, d = q.shape
    o_b = torch.zeros((B, Hq, nq, d), dtype=acc, device=q.device)
    lse_b = torch.full((B, Hq, nq), -math.inf, dtype=acc, device=q.device)
    for qrows, krows, causal in calls:                         # load Q rows, K_c, V_c -> the kernel
        qx, kx, vx = _rows(q, qrows), _rows(kv[0], krows), _rows(kv[1], krows)
        if backend == "torch_fused":
            o, lse = _torch_fused_block(qx, kx, vx, causal, scale)
        else:
            o, lse = attention(_to_backend(qx, backend), _to_backend(kx, backend), _to_backend(vx, backend),
                               causal=causal, scale=scale, backend=backend, config=config, return_lse=True)
        (a, b), = qrows
        o_b[:, :, a:b] = _to_torch(o, q).to(acc)
        lse_b[:, :, a:b] = _to_torch(lse, q).to(acc)
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
    acc = _acc_torch(q.dtype)
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
    acc = _acc_torch(q.dtype)
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
    return bool(q.is_cuda)


def _block_backward(do, q, o, lse, kv, calls, scale, backend, config, stats):
    """dQ (rank's rows) and dK_c, dV_c (packed, accumulator dtype) of one block."""
    import torch
    from .api import attention_backward
    acc = _acc_torch(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    bwd = "naive" if backend == "naive" else "tiled"
    for qrows, krows, causal in calls:
        sel = [_rows(x, qrows) for x in (do, q, o)]
        lsex = _rows(lse.unsqueeze(-1), qrows)[..., 0]
        kx, vx = _rows(kv[0], krows), _rows(kv[1], krows)
        if _torch_backward_for(q):
            do_x, q_x, o_x = sel
            g = _torch_block_backward(do_x, q_x, kx, vx, o_x, lsex, causal, scale)
        else:
            args = [_to_backend(x, bwd) for x in (*sel[:2], kx, vx, sel[2])] + [_to_backend(lsex, bwd)]
            g = attention_backward(*args, causal=causal, scale=scale, backend=bwd,
                                   config=config if bwd == backend else None)
        dqx, dkx, dvx = (_to_torch(x, q).to(acc) for x in g)
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
    return x if dtype is None else x.to(dtype).to(x.dtype)


# --------------------------------------------------------------------------- one rank's steps
def _forward_steps(q, kv, rank, W, kv_pos, q_pos, causal, scale, backend, config, partial_dtype, stats):
    """One rank's ring forward as a generator of communication requests; returns (O, LSE)."""
    import torch
    acc = _acc_torch(q.dtype)
    B, Hq, nq, d = q.shape
    o = torch.zeros((B, Hq, nq, d), dtype=acc, device=q.device)
    lse = torch.full((B, Hq, nq), -math.inf, dtype=acc, device=q.device)
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
    return o.to(q.dtype), lse


def _backward_steps(do, q, o, lse, kv, rank, W, kv_pos, q_pos, causal, scale, backend, config, stats):
    """One rank's ring backward: K/V travel as in the forward, dK/dV travel with them."""
    import torch
    acc = _acc_torch(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = None
    stats.resident_bytes = _nbytes(do, q, o, lse, dq) + _nbytes(kv) * (1 + (W > 1)) + \
        2 * kv.numel() * dq.element_size() * (W > 1)
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
    return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)


def _nbytes(*ts) -> int:
    return int(sum(t.numel() * t.element_size() for t in ts))


# --------------------------------------------------------------------------- driver: a process group
class _GroupComm:
    """Carries out a rank's requests over a torch.distributed process group, counting bytes."""

    def __init__(self, group, stats):
        import torch.distributed as dist
        self.dist, self.group, self.stats = dist, group, stats
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        self.pending = {}

    def _global(self, r):
        return self.dist.get_global_rank(self.group, r) if self.group is not None else r

    def send(self, req):
        import torch
        dist = self.dist
        dtype = req.tensor.dtype
        buf = torch.empty(req.shape, dtype=dtype, device=req.tensor.device)
        send = req.tensor.contiguous()
        ops = [dist.P2POp(dist.isend, send, self._global((self.rank + 1) % self.W), self.group, req.tag),
               dist.P2POp(dist.irecv, buf, self._global((self.rank - 1) % self.W), self.group, req.tag)]
        works = dist.batch_isend_irecv(ops)
        self.pending[req.tag] = (works, buf, send, self.stats.now())
        name = _TAG_NAME[req.tag]
        self.stats.sent[name] += _nbytes(send)
        self.stats.received[name] += _nbytes(buf)

    def wait(self, req):
        works, buf, _, posted = self.pending.pop(req.tag)
        t0 = self.stats.now()
        for w in works:
            w.wait()
        if buf.is_cuda:
            import torch
            torch.cuda.current_stream(buf.device).synchronize()
        t1 = self.stats.now()
        self.stats.events.append(("wait", req.step, t0, t1))
        self.stats.events.append(("comm", req.step, posted, t1))
        return buf


def _drive(gen, comm):
    """Run one rank's generator against a communicator; return the generator's result."""
    reply = None
    try:
        while True:
            req = gen.send(reply)
            if isinstance(req, _Send):
                comm.send(req)
                reply = None
            else:
                reply = comm.wait(req)
    except StopIteration as done:
        return done.value


def _problem(q, k, v, seqlen_q, seqlen_k, W, split, causal, scale):
    """Check the arguments; returns (q_pos, kv_pos, scale, causal) of the split."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not type(x).__module__.startswith("torch"):
            raise ValueError(f"{name}: ring attention takes torch tensors (the process group's), got "
                             f"{type(x).__module__}.{type(x).__name__}")
    info = cv.check_qkv(q, k, v)
    causal = cv.check_bool(causal, "causal")
    if causal and seqlen_q != seqlen_k:
        raise ValueError(f"seqlen_k: causal ring attention needs seqlen_q == seqlen_k, got "
                         f"{seqlen_q} and {seqlen_k}")
    q_pos = split_positions(seqlen_q, W, split)
    kv_pos = split_positions(seqlen_k, W, split)
    return q_pos, kv_pos, cv.resolve_scale(scale, info["head_dim"]), causal


def _on_this_rank(q, k, v, seqlen_q, seqlen_k, split, causal, scale, group, backend, stats):
    """Every check of a process-group call, before any communication: the split, this
    rank's shard lengths, the backend.  Returns (W, rank, q_pos, kv_pos, scale, causal, stats)."""
    import torch.distributed as dist
    cv.check_choice(backend, "backend", RING_BACKENDS)
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    q_pos, kv_pos, scale, causal = _problem(q, k, v, seqlen_q, seqlen_k, W, split, causal, scale)
    for name, x, want in (("q", q, _length(q_pos[rank])), ("k", k, _length(kv_pos[rank]))):
        if x.shape[2] != want:
            raise ValueError(f"{name}: this rank's shard must hold {want} tokens (axis 2) for the split, "
                             f"got {x.shape[2]}")
    return W, rank, q_pos, kv_pos, scale, causal, RingStats(rank=rank) if stats is None else stats


#: dtypes the partial outputs may be stored in between steps (None: the accumulator's)
PARTIAL_DTYPES = (None, "float32", "bfloat16", "float16")


def _partial_dtype(name):
    import torch
    cv.check_choice(name, "partial_dtype", PARTIAL_DTYPES)
    return None if name is None else getattr(torch, name)


def ring_attention(q, k, v, *, seqlen_q, seqlen_k=None, causal=False, scale=None, split="zigzag",
                   group=None, backend="tiled", config=None, partial_dtype=None, stats=None):
    """Ring attention forward on this rank: q, k, v are its shards (torch tensors).

    Call on every rank of ``group`` (None: the default group) with the shards that
    :func:`shard` cuts from the full sequence for this rank.  Returns this rank's
    (O, LSE); ``stats`` (a :class:`RingStats`) receives the counters and timeline.
    """
    import torch
    W, rank, q_pos, kv_pos, scale, causal, stats = _on_this_rank(q, k, v, seqlen_q, seqlen_k, split, causal,
                                                                 scale, group, backend, stats)
    pd = _partial_dtype(partial_dtype)
    gen = _forward_steps(q, torch.stack([k, v]), rank, W, kv_pos, q_pos, causal, scale, backend, config,
                         pd, stats)
    return _drive(gen, _GroupComm(group, stats))


def ring_attention_backward(do, q, k, v, o, lse, *, seqlen_q, seqlen_k=None, causal=False, scale=None,
                            split="zigzag", group=None, backend="tiled", config=None, stats=None):
    """Ring attention backward on this rank: (dQ, dK, dV) of its shards, given the global LSE."""
    import torch
    W, rank, q_pos, kv_pos, scale, causal, stats = _on_this_rank(q, k, v, seqlen_q, seqlen_k, split, causal,
                                                                 scale, group, backend, stats)
    gen = _backward_steps(do, q, o, lse, torch.stack([k, v]), rank, W, kv_pos, q_pos, causal, scale, backend,
                          config, stats)
    return _drive(gen, _GroupComm(group, stats))


# --------------------------------------------------------------------------- driver: in one process
def _lockstep(gens, stats):
    """Drive W rank generators together, passing the sent tensors round the ring by hand."""
    W = len(gens)
    replies, results = [None] * W, [None] * W
    mailbox = {}
    alive = set(range(W))
    while alive:
        reqs = {}
        for r in sorted(alive):
            try:
                reqs[r] = gens[r].send(replies[r])
            except StopIteration as done:
                results[r] = done.value
        alive = set(reqs)
        if not reqs:
            break
        kinds = {type(x) for x in reqs.values()}
        if len(kinds) != 1 or len({x.tag for x in reqs.values()}) != 1:
            raise RuntimeError("ring ranks out of step (a bug in the step generators)")
        for r, req in reqs.items():
            name = _TAG_NAME[req.tag]
            if isinstance(req, _Send):
                t = req.tensor.clone()
                mailbox[(req.tag, (r + 1) % W)] = t
                stats[r].sent[name] += _nbytes(t)
                stats[r].received[name] += int(np.prod(req.shape)) * t.element_size()
                replies[r] = None
            else:
                replies[r] = mailbox.pop((req.tag, r))
    return results


def simulate(q, k, v, world_size, *, do=None, causal=False, scale=None, split="zigzag", backend="tiled",
             config=None, partial_dtype=None):
    """Run the ring with ``world_size`` logical ranks in this process, sequentially.

    q, k, v (and ``do`` for the backward) are the full NumPy arrays; each logical rank
    gets its shard and runs the same step generators as :func:`ring_attention`.  Returns
    a dict with o, lse (full, NumPy) and, with ``do``, dq, dk, dv; plus ``stats`` (one
    :class:`RingStats` per rank for the forward) and ``bwd_stats``.
    """
    import torch
    from .torch_sdpa import _to_torch as np_to_torch
    cv.check_choice(backend, "backend", RING_BACKENDS)
    W = world_size
    tq, tk, tv = (np_to_torch(np.ascontiguousarray(x)) for x in (q, k, v))
    q_pos, kv_pos, scale, causal = _problem(tq, tk, tv, tq.shape[2], tk.shape[2], W, split, causal, scale)
    qs = [shard(tq, q_pos[r]) for r in range(W)]
    kvs = [torch.stack([shard(tk, kv_pos[r]), shard(tv, kv_pos[r])]) for r in range(W)]
    pd = _partial_dtype(partial_dtype)
    stats = [RingStats(rank=r) for r in range(W)]
    out = _lockstep([_forward_steps(qs[r], kvs[r], r, W, kv_pos, q_pos, causal, scale, backend, config, pd,
                                    stats[r]) for r in range(W)], stats)
    res = dict(o=unshard([_np(o) for o, _ in out], q_pos), lse=unshard([_np(l) for _, l in out], q_pos),
               stats=stats, q_pos=q_pos, kv_pos=kv_pos)
    if do is not None:
        tdo = np_to_torch(np.ascontiguousarray(do))
        bstats = [RingStats(rank=r) for r in range(W)]
        grads = _lockstep([_backward_steps(shard(tdo, q_pos[r]), qs[r], out[r][0], out[r][1], kvs[r], r, W,
                                           kv_pos, q_pos, causal, scale, backend, config, bstats[r])
                           for r in range(W)], bstats)
        res.update(dq=unshard([_np(g[0]) for g in grads], q_pos), dk=unshard([_np(g[1]) for g in grads], kv_pos),
                   dv=unshard([_np(g[2]) for g in grads], kv_pos), bwd_stats=bstats)
    return res


def _np(t):
    from .torch_sdpa import _to_like
    return _to_like(t.detach().cpu(), np.empty(0))


# --------------------------------------------------------------------------- models
def comm_model(seqlen_k, world_size, split="zigzag", *, batch, heads_kv, head_dim, dtype="float32",
               backward=False):
    """Closed-form bytes each rank sends and receives: a list of dicts per rank.

    K/V block c is 2 * B * Hkv * n_c * d * itemsize bytes.  Forward: rank r sends every
    block but that of rank r + 1 and receives every block but its own (W - 1 each).
    Backward: the same, plus every block's dK/dV accumulator (accumulator itemsize) sent
    and received once by each rank (W hops: W - 1 with the block, one home).
    """
    W = world_size
    pos = split_positions(seqlen_k, W, split)
    s = cv.itemsize_of(dtype)
    a = cv.accum_dtype(dtype).itemsize
    kv = [2 * batch * heads_kv * _length(p) * head_dim * s for p in pos]
    dkv = [2 * batch * heads_kv * _length(p) * head_dim * a for p in pos]
    out = []
    for r in range(W):
        sent = {"kv": (sum(kv) - kv[(r + 1) % W]) if W > 1 else 0, "dkv": 0}
        recv = {"kv": (sum(kv) - kv[r]) if W > 1 else 0, "dkv": 0}
        if backward and W > 1:
            sent["dkv"] = recv["dkv"] = sum(dkv)
        out.append(dict(sent=sent, received=recv, bytes_sent=sum(sent.values()),
                        bytes_received=sum(recv.values())))
    return out


def memory_per_rank(seqlen, world_size, *, batch=1, heads_q, heads_kv, head_dim, dtype="bfloat16"):
    """Bytes a rank holds for the forward against one device holding everything (a dict).

    A rank: Q_r and O_r (n = ceil(N / W) rows, O in the accumulator dtype), LSE_r, its
    K/V block and the one arriving (two blocks).  One device: Q, K, V, O, LSE of all N.
    Activations only: weights, and the kernel's own tiles, are left out.
    """
    s, a = cv.itemsize_of(dtype), cv.accum_dtype(dtype).itemsize
    n = -(-seqlen // world_size)

    def held(rows, kv_blocks, o_bytes):
        return (batch * heads_q * rows * head_dim * (s + o_bytes) + batch * heads_q * rows * a
                + kv_blocks * 2 * batch * heads_kv * rows * head_dim * s)

    return dict(per_rank=held(n, 2 if world_size > 1 else 1, a), one_device=held(seqlen, 1, s))


# --------------------------------------------------------------------------- experiments (notebook 12)
def schedule_timeline(world_size: int, compute: float, comm: float):
    """The events of an idealized ring: each step computes for ``compute`` while its transfer
    takes ``comm`` (any time unit); the next step starts when both are done.

    Returns one event list per rank in :class:`RingStats`' form: the transfer is hidden
    when comm <= compute, and each step waits comm - compute otherwise.
    """
    events, t = [], 0.0
    for step in range(world_size):
        events.append(("compute", step, t, t + compute))
        end = t + compute
        if step < world_size - 1:
            events.append(("comm", step, t, t + comm))
            if comm > compute:
                events.append(("wait", step, t + compute, t + comm))
            end = max(end, t + comm)
        t = end
    return [list(events) for _ in range(world_size)]


def work_per_rank(rng, seqlen: int, world_size: int, *, causal=True, heads=2, head_dim=16, backend="tiled"):
    """Measured work of each rank for both splits: {split: dict(pairs=[...], seconds=[...])}.

    Runs :func:`simulate` and reads each rank's counters: the (query, key) pairs its
    blocks evaluated, and the seconds its block computations took (this machine, now).
    """
    q, k, v = _random_qkv(rng, heads, seqlen, head_dim, "float64")
    out = {}
    for split in SPLITS:
        st = simulate(q, k, v, world_size, causal=causal, split=split, backend=backend)["stats"]
        out[split] = dict(pairs=[s.pairs for s in st],
                          seconds=[sum(t1 - t0 for kind, _, t0, t1 in s.events if kind == "compute") for s in st])
    return out


def merge_error_vs_world_size(rng, world_sizes, *, seqlen=256, heads=2, head_dim=32, dtype="float32",
                              partial_dtypes=("bfloat16", "float32")):
    """mean |O - O_ref64| of the simulated ring for each W and each dtype of the partial outputs.

    Inputs in ``dtype`` (the same inputs for every W); returns {partial_dtype: [errors]}.
    "float32" keeps partials in the accumulator precision (no rounding between steps).
    """
    from .core.reference import attention as oracle
    q, k, v = _random_qkv(rng, heads, seqlen, head_dim, dtype)
    ref = oracle(q, k, v)[0]
    return {pd: [float(np.abs(simulate(q, k, v, W, split="contiguous",
                                       partial_dtype=None if pd == "float32" else pd)["o"] - ref).mean())
                 for W in world_sizes] for pd in partial_dtypes}


def _random_qkv(rng, heads, seqlen, head_dim, dtype):
    from .core.testing import make_inputs
    return make_inputs(rng, heads_q=heads, seqlen_q=seqlen, head_dim=head_dim, dtype=dtype)
