"""The two drivers of a rank's steps: a torch.distributed process group
(:func:`ring_attention`, :func:`ring_attention_backward`) and W logical ranks in one
process (:func:`simulate`).  The process group needs torch; the simulation runs on NumPy
arrays (no torch needed) unless a torch local kernel or ``arrays="torch"`` asks for tensors."""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from . import arrays as xa
from .split import _length, shard, split_positions, unshard
from .steps import _TAG_NAME, RingStats, _backward_steps, _forward_steps, _nbytes, _Send

#: local kernels: the package's backends, plus torch's fused kernels called for their LSE
RING_BACKENDS = ("naive", "tiled", "numba", "cupy", "torch", "torch_fused")


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


def _problem(q, k, v, seqlen_q, seqlen_k, W, split, causal, scale, torch_only=True):
    """Check the arguments; returns (q_pos, kv_pos, scale, causal) of the split."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if torch_only and not xa.is_torch(x):
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


#: how :func:`simulate` holds the ranks' arrays: NumPy (no torch needed) or torch tensors
SIM_ARRAYS = ("numpy", "torch")
#: the local kernels that take torch tensors only
TORCH_BACKENDS = ("torch", "torch_fused")


def _partial_dtype(name, like=None):
    cv.check_choice(name, "partial_dtype", PARTIAL_DTYPES)
    if like is None:
        import torch
        like = torch.empty(0)
    return xa.storage_dtype(name, like)


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
                t = xa.copy(req.tensor)
                mailbox[(req.tag, (r + 1) % W)] = t
                stats[r].sent[name] += _nbytes(t)
                stats[r].received[name] += int(np.prod(req.shape)) * xa.itemsize(t)
                replies[r] = None
            else:
                replies[r] = mailbox.pop((req.tag, r))
    return results


def simulate(q, k, v, world_size, *, do=None, causal=False, scale=None, split="zigzag", backend="tiled",
             config=None, partial_dtype=None, arrays=None):
    """Run the ring with ``world_size`` logical ranks in this process, sequentially.

    q, k, v (and ``do`` for the backward) are the full NumPy arrays; each logical rank
    gets its shard and runs the same step generators as :func:`ring_attention`.  ``arrays``:
    "numpy" (the default for the package's NumPy-facing backends: no torch needed) or
    "torch" (CPU tensors, as the process group passes them; the default for the "torch"
    and "torch_fused" local kernels, which need it).  Returns a dict with o, lse (full,
    NumPy) and, with ``do``, dq, dk, dv; plus ``stats`` (one :class:`RingStats` per rank for
    the forward) and ``bwd_stats``.
    """
    cv.check_choice(backend, "backend", RING_BACKENDS)
    arrays = ("torch" if backend in TORCH_BACKENDS else "numpy") if arrays is None else arrays
    cv.check_choice(arrays, "arrays", SIM_ARRAYS)
    if arrays == "numpy" and backend in TORCH_BACKENDS:
        raise ValueError(f"arrays: the {backend!r} local kernel takes torch tensors; pass arrays='torch'")
    if arrays == "torch":
        from ..torch_sdpa import _to_torch as convert
    else:
        convert = np.asarray
    W = world_size
    tq, tk, tv = (convert(np.ascontiguousarray(x)) for x in (q, k, v))
    q_pos, kv_pos, scale, causal = _problem(tq, tk, tv, tq.shape[2], tk.shape[2], W, split, causal, scale,
                                            torch_only=arrays == "torch")
    pd = _partial_dtype(partial_dtype, tq)
    qs = [shard(tq, q_pos[r]) for r in range(W)]
    kvs = [xa.stack([shard(tk, kv_pos[r]), shard(tv, kv_pos[r])]) for r in range(W)]
    stats = [RingStats(rank=r) for r in range(W)]
    out = _lockstep([_forward_steps(qs[r], kvs[r], r, W, kv_pos, q_pos, causal, scale, backend, config, pd,
                                    stats[r]) for r in range(W)], stats)
    res = dict(o=unshard([_np(o) for o, _ in out], q_pos), lse=unshard([_np(l) for _, l in out], q_pos),
               stats=stats, q_pos=q_pos, kv_pos=kv_pos)
    if do is not None:
        tdo = convert(np.ascontiguousarray(do))
        bstats = [RingStats(rank=r) for r in range(W)]
        grads = _lockstep([_backward_steps(shard(tdo, q_pos[r]), qs[r], out[r][0], out[r][1], kvs[r], r, W,
                                           kv_pos, q_pos, causal, scale, backend, config, bstats[r])
                           for r in range(W)], bstats)
        res.update(dq=unshard([_np(g[0]) for g in grads], q_pos), dk=unshard([_np(g[1]) for g in grads], kv_pos),
                   dv=unshard([_np(g[2]) for g in grads], kv_pos), bwd_stats=bstats)
    return res


def _np(t):
    if not xa.is_torch(t):
        return np.asarray(t)
    from ..torch_sdpa import _to_like
    return _to_like(t.detach().cpu(), np.empty(0))
