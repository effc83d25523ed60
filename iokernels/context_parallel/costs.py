"""Closed-form costs of the ring (bytes on the wire, memory per rank, an idealized
timeline) and the experiments notebook 12 runs on the simulated ring."""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from .split import SPLITS, _length, split_positions


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
    from .drivers import simulate
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
    from ..core.reference import attention as oracle
    from .drivers import simulate
    q, k, v = _random_qkv(rng, heads, seqlen, head_dim, dtype)
    ref = oracle(q, k, v)[0]
    return {pd: [float(np.abs(simulate(q, k, v, W, split="contiguous",
                                       partial_dtype=None if pd == "float32" else pd)["o"] - ref).mean())
                 for W in world_sizes] for pd in partial_dtypes}


def _random_qkv(rng, heads, seqlen, head_dim, dtype):
    from ..core.testing import make_inputs
    return make_inputs(rng, heads_q=heads, seqlen_q=seqlen, head_dim=head_dim, dtype=dtype)
