"""Where the KV cache lives: paged blocks, or one contiguous region reserved per sample.

Both memories give the model the same three operations per layer (``write`` a chunk's K
and V, ``attend`` a batch of chunks, ``read`` a sequence back) and give the scheduler
the same accounting (``growth``: blocks an append needs, ``growths`` for a batch;
``free_blocks``; ``usage``).  Their policies differ, and the difference is
PagedAttention's argument (Kwon et al., SOSP 2023, paper):

* :class:`PagedMemory` takes blocks as a sequence grows, from one
  :class:`~iokernels.paged.PagedKVCache` per layer; the layers' caches see the same calls
  in the same order, so their block tables are equal, as vLLM keeps one block table for
  all layers.  Parallel samples fork (share blocks, copy-on-write), equal prefixes hit
  the prefix cache, and when blocks run out the scheduler preempts.
* :class:`ContiguousMemory` reserves, at admission, ``max_len`` = prompt +
  max_new_tokens slots per sample in one contiguous range of a slot arena (first fit),
  as servers did before PagedAttention: nothing ever runs out after admission, and
  everything reserved but not yet written is waste.

Memory is counted in slots (token positions of one layer): a paged memory of
``num_blocks`` blocks of ``block_size`` slots holds as many tokens as a contiguous
memory of ``num_blocks * block_size`` slots.

Both keep their values in NumPy on the host, where every kernel of the course can read
them.  :mod:`.device` holds the same two memories with their values in torch tensors on
the model's device (a GPU), the books kept by the same code.
"""
from __future__ import annotations

import numpy as np

from ..api import attention_varlen, backends_implementing, paged_prefill
from ..paged import PagedKVCache, blocks_needed

__all__ = ["PagedMemory", "ContiguousMemory", "pool_invariants"]


def _check_backend(backend, op):
    if backend in ("tiled", "naive", "torch"):        # these run both ops without a GPU module
        return backend
    have = backends_implementing(op)
    if backend not in have:
        raise ValueError(f"backend: {op} runs on {', '.join(map(repr, have))}; got {backend!r}")
    return backend


def _packed_offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class PagedMemory:
    """One :class:`PagedKVCache` per layer, in lockstep; memory in blocks.

    ``WATERMARK``: the fraction of the blocks a new request may not take while others run, so
    that the running sequences have blocks to grow into; vLLM's block manager keeps the same
    1% ("to avoid frequent cache eviction": ``watermark`` in ``can_allocate``,
    vllm/core/block_manager.py of vLLM's V0 engine, since removed; code).  Without it a burst of
    arrivals fills the pool with prompts, and the next steps preempt sequences to make room for the others' tokens.
    """

    kind = "paged"
    WATERMARK = 0.01

    def __init__(self, num_blocks, block_size, *, layers, kv_heads, head_dim, dtype="float64",
                 backend="tiled"):
        _check_backend(backend, "paged_prefill")
        self.caches = [PagedKVCache(num_blocks, block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                                    dtype=dtype) for _ in range(layers)]
        self.num_blocks, self.block_size, self.backend = num_blocks, block_size, backend
        self.dtype = self.caches[0].dtype

    @property
    def capacity_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def watermark_blocks(self) -> int:
        """Blocks a request's admission must leave free while other requests run."""
        return int(self.WATERMARK * self.num_blocks)

    def fits(self, request) -> str | None:
        """Why ``request`` can never be served (None: it can): its samples, each at its longest."""
        need = request.n * blocks_needed(request.max_len, self.block_size)
        if need > self.num_blocks:
            return (f"request {request.rid!r} needs up to {need} blocks ({request.n} x {request.max_len} tokens "
                    f"in blocks of {self.block_size}); the pool holds {self.num_blocks}")
        return None

    # ---- lifetime (the same call on every layer's cache)
    def admit(self, group) -> bool:
        return True                                   # blocks come as the sequence grows

    def start(self, seq) -> None:
        sids = {c.new_sequence() for c in self.caches}
        seq.handle = sids.pop()

    def fork(self, parent, child) -> None:
        sids = {c.fork(parent.handle) for c in self.caches}
        child.handle = sids.pop()

    def release(self, seq) -> None:
        if seq.handle is not None:
            for c in self.caches:
                c.free(seq.handle)
            seq.handle = None

    def release_group(self, group) -> None:
        for s in group.seqs:
            self.release(s)

    # ---- accounting
    def free_blocks(self) -> int:
        return self.caches[0].num_free_blocks()

    def growth(self, seq, tokens) -> int:
        """At most how many free blocks appending ``tokens`` to ``seq`` takes (a copy-on-write included)."""
        cache, sid, bs = self.caches[0], seq.handle, self.block_size
        n = cache.seq_len(sid)
        need = (-n // bs) - (-(n + tokens) // bs)    # ceil((n + tokens) / bs) - ceil(n / bs) blocks
        if n % bs and cache.ref_count(cache.last_block(sid)) > 1:
            need += 1                                 # the shared partial last block is copied first
        return need

    def growths(self, seqs, tokens) -> list:
        """:meth:`growth` of each (sequence, tokens) pair: the scheduler asks for a whole batch at once."""
        return [self.growth(s, t) for s, t in zip(seqs, tokens)]

    def usage(self) -> tuple[int, int]:
        """(slots written, slots allocated) over the live blocks, a shared block counted once.

        Every live block is held by a table (:func:`pool_invariants`), and only a table's last
        block can be partly written: a block a sequence has written past is full, and one it
        shares is copied before either holder writes into it.  So the live blocks are full but
        for the distinct partial last blocks, each as full as its fullest holder."""
        cache, bs = self.caches[0], self.block_size
        short: dict = {}                                            # partial last block -> its fill
        for sid in cache.seq_ids:
            fill = cache.seq_len(sid) % bs
            if fill:
                b = cache.last_block(sid)
                if short.get(b, 0) < fill:
                    short[b] = fill
        live = cache.num_blocks - cache.num_free_blocks()
        return bs * live - sum(bs - f for f in short.values()), bs * live

    # ---- what the model calls
    def write(self, layer, seq, k_rows, v_rows, token_ids) -> None:
        self.caches[layer].append(seq.handle, k_rows, v_rows, token_ids=token_ids)

    def attend(self, layer, q, seqs, chunk_lens):
        return paged_prefill(q, self.caches[layer], [s.handle for s in seqs], _packed_offsets(chunk_lens),
                             backend=self.backend)

    def read(self, layer, seq):
        """The sequence's K and V rows (n, Hkv, d), read straight from the pool (not a kernel)."""
        cache = self.caches[layer]
        n, table = cache.seq_len(seq.handle), cache.block_table(seq.handle)
        k = cache.k_pool[table].reshape(-1, cache.num_kv_heads, cache.head_dim)[:n]
        v = cache.v_pool[table].reshape(-1, cache.num_kv_heads, cache.head_dim)[:n]
        return k, v


class ContiguousMemory:
    """A slot arena per layer; each admitted sample reserves ``max_len`` contiguous slots (first fit)."""

    kind = "contiguous"
    #: a reservation holds all a sample will ever write: nothing needs to be kept free for growth
    watermark_blocks = 0

    def __init__(self, capacity_slots, *, layers, kv_heads, head_dim, dtype="float64", backend="tiled"):
        self.capacity_slots, self.backend = int(capacity_slots), _check_backend(backend, "attention_varlen")
        shape = (self.capacity_slots, kv_heads, head_dim)
        self.k = [np.full(shape, np.nan, dtype=dtype) for _ in range(layers)]
        self.v = [np.full(shape, np.nan, dtype=dtype) for _ in range(layers)]
        self.dtype = self.k[0].dtype
        self._holes = [(0, self.capacity_slots)]      # free ranges [start, stop), sorted
        self._regions: dict[int, list] = {}           # handle -> [start, rows written per layer]
        self._next = 0

    def reservation(self, request) -> int:
        """Slots one sample of ``request`` reserves: its longest, prompt + max_new_tokens."""
        return request.max_len

    def fits(self, request) -> str | None:
        size = self.reservation(request)
        if request.n * size > self.capacity_slots:
            return (f"request {request.rid!r} reserves {request.n} x {size} slots; the arena holds "
                    f"{self.capacity_slots}")
        return None

    # ---- reservation: first fit over the holes
    def _take(self, size):
        for i, (a, z) in enumerate(self._holes):
            if z - a >= size:
                self._holes[i:i + 1] = [(a + size, z)] if z - a > size else []
                return a
        return None

    def _give(self, start, size):
        holes = sorted(self._holes + [(start, start + size)])
        merged = [holes[0]]
        for a, z in holes[1:]:
            if a == merged[-1][1]:
                merged[-1] = (merged[-1][0], z)
            else:
                merged.append((a, z))
        self._holes = merged

    def admit(self, group) -> bool:
        """Reserve max_len slots for every sample of the request, or nothing."""
        size, starts = self.reservation(group.request), []
        for _ in range(group.request.n):
            a = self._take(size)
            if a is None:
                for s in starts:
                    self._give(s, size)
                return False
            starts.append(a)
        group.reservation = starts
        return True

    def start(self, seq) -> None:
        h, self._next = self._next, self._next + 1
        self._regions[h] = [seq.group.reservation[seq.sample], [0] * len(self.k)]   # start, rows per layer
        seq.handle = h

    def fork(self, parent, child) -> None:
        self.start(child)
        (a, lens), dst = self._regions[parent.handle], self._regions[child.handle]
        for layer, n in enumerate(lens):              # no sharing: the prompt's rows are copied
            for arena in (self.k[layer], self.v[layer]):
                arena[dst[0]:dst[0] + n] = arena[a:a + n]
        dst[1] = list(lens)

    def release(self, seq) -> None:
        if seq.handle is not None:
            del self._regions[seq.handle]
            seq.handle = None

    def release_group(self, group) -> None:
        for s in group.seqs:
            self.release(s)
        for a in group.reservation or []:
            self._give(a, self.reservation(group.request))
        group.reservation = None

    # ---- accounting
    def free_blocks(self) -> int:
        return 0

    def growth(self, seq, tokens) -> int:
        return 0                                      # reserved at admission

    def growths(self, seqs, tokens) -> list:
        return [0] * len(seqs)

    def usage(self) -> tuple[int, int]:
        reserved = self.capacity_slots - sum(z - a for a, z in self._holes)
        return sum(r[1][0] for r in self._regions.values()), reserved

    # ---- what the model calls
    def write(self, layer, seq, k_rows, v_rows, token_ids) -> None:
        start, lens = self._regions[seq.handle]
        at, n = start + lens[layer], len(k_rows)
        self.k[layer][at:at + n], self.v[layer][at:at + n] = k_rows, v_rows
        lens[layer] += n

    def attend(self, layer, q, seqs, chunk_lens):
        """One varlen call over the batch: each sequence's K, V are its region's written rows."""
        spans = [(self._regions[s.handle][0], self._regions[s.handle][1][layer]) for s in seqs]
        k = np.concatenate([self.k[layer][a:a + n] for a, n in spans])
        v = np.concatenate([self.v[layer][a:a + n] for a, n in spans])
        return attention_varlen(q, k, v, _packed_offsets(chunk_lens), _packed_offsets([n for _, n in spans]),
                                causal=True, backend=self.backend)

    def read(self, layer, seq):
        start, lens = self._regions[seq.handle]
        return self.k[layer][start:start + lens[layer]], self.v[layer][start:start + lens[layer]]


def pool_invariants(cache: PagedKVCache) -> list[str]:
    """What is wrong with a block pool's bookkeeping (empty: nothing).

    Every block is either free (reference count 0, in the free list once) or held
    (count = the number of block tables that hold it, not in the free list): no block is
    leaked (held by nobody but not free) or doubly owned (free and held at once).
    """
    problems = []
    held = np.zeros(cache.num_blocks, dtype=np.int64)
    for sid in cache.seq_ids:
        table = cache.block_table(sid)
        if len(table) != blocks_needed(cache.seq_len(sid), cache.block_size):
            problems.append(f"sequence {sid}: {len(table)} blocks for {cache.seq_len(sid)} tokens")
        for b in table:
            held[b] += 1
    free = list(cache._free)                          # the free list, read for checking only
    if len(set(free)) != len(free):
        problems.append("a block is in the free list twice")
    ref = cache.ref_counts()
    for b in np.flatnonzero(ref != held):
        problems.append(f"block {b}: reference count {ref[b]}, held by {held[b]} tables")
    for b in set(free) & set(np.flatnonzero(held).tolist()):
        problems.append(f"block {b}: free and held at once")
    for b in set(range(cache.num_blocks)) - set(free) - set(np.flatnonzero(held).tolist()):
        problems.append(f"block {b}: leaked (neither free nor held)")
    return problems
