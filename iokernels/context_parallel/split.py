"""The ring's split of the sequence: who holds which tokens, and what a rank computes
against one K/V block (the causal schedule).  Pure NumPy; see :mod:`iokernels.context_parallel`."""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv

SPLITS = ("contiguous", "zigzag")


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
    from .merge import _namespace
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
