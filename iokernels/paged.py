"""Step 3: PagedAttention's KV cache: a pool of fixed-size blocks and per-sequence block tables.

A decoding server does not know how long a request will grow.  Reserving the maximum
length up front wastes most of the reservation (a 4,096-token reservation for a request
that ends at 300 tokens wastes about 93%).  PagedAttention (Kwon et al., SOSP 2023, the
vLLM paper) stores the cache the way an operating system stores a process's memory:

* the K and V caches are **pools** of fixed-size **blocks** (pages) of ``block_size``
  token slots each: ``k_pool``, ``v_pool`` of shape (num_blocks, block_size, Hkv, d);
* each sequence owns a **block table**: the list of physical block ids holding its
  logical blocks 0, 1, 2, ... in order.  Token t of a sequence lives in physical block
  ``table[t // block_size]``, slot ``t % block_size``;
* a **free list** hands out blocks one at a time, so the only waste is the unwritten
  tail of each sequence's last block (at most block_size - 1 slots), and there is no
  external fragmentation;
* blocks are **reference counted**: :meth:`PagedKVCache.fork` (parallel sampling, beam
  search) shares every block of the parent; the first append into a shared, partially
  filled block copies it first (**copy-on-write**); :meth:`PagedKVCache.free` returns the
  blocks whose count drops to zero;
* **prefix caching** across requests, as vLLM does it: a *full* block written with known
  token ids is keyed by a hash of (its parent block's hash, its token ids); a later
  append whose token ids produce the same key reuses that block instead of writing a new
  one.  Freed blocks keep their key while they sit in the free list, so a finished
  request's prefix can still be found until the block is handed out again (the free list
  is first-in first-out: the least recently freed block is evicted first).

Notation
========

==============  ============================================================
block_size      token slots per block (vLLM's default, 16)
num_blocks      blocks in the pool (the same for K and for V)
Hkv, d          KV heads and head dim
n               tokens a sequence holds (``seq_len``)
table           the sequence's block table, ceil(n / block_size) physical ids
ref[b]          how many block tables hold block b (0: b is free)
key[b]          the prefix-cache key of a full block b: sha256(key[parent] + token ids)
==============  ============================================================

Errors: an unknown sequence id, a block id outside the pool, wrong shapes or dtypes, and
an exhausted pool (:class:`OutOfBlocks`, a ValueError) raise before anything changes: a
failing call leaves the cache exactly as it was.

Frank notes
-----------
* Token ids are a promise.  When an append's token ids hit the prefix cache, the cache
  keeps the K/V already stored and does not look at the K/V passed in: equal ids after an
  equal prefix give equal K/V in a deterministic model, and the cache trusts that (as
  vLLM does, which skips computing them at all).
* A prefix-cache hit needs whole blocks, aligned to block boundaries, written within one
  append; the partially filled last block of a sequence is private and never cached.
  After one append without token ids a sequence stops taking part in prefix caching.
* The pools start filled with NaN, so a kernel that reads an unwritten slot shows it at
  once; a block handed out again keeps its previous owner's (finite) values, as on a GPU.
"""
from __future__ import annotations

import hashlib
import numbers
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .core import conventions as cv
from .core.traffic import HBM, Traffic

__all__ = ["PagedKVCache", "OutOfBlocks", "DEFAULT_BLOCK_SIZE", "paged_gather", "check_block_table",
           "traffic_model_gather", "blocks_needed", "paging_waste", "reservation_waste",
           "kv_bytes_per_token", "reservation_bytes", "fragmentation", "LLAMA2_7B", "LLAMA3_8B"]

#: vLLM's default block size: small enough that a sequence wastes under one block
#: (< 16 slots), large enough that a block of K rows is a useful tile for a kernel.
DEFAULT_BLOCK_SIZE = 16

#: the parent key of a sequence's first block (a chain of hashes starts here).
_ROOT_KEY = b"iokernels-prefix-root"

#: Model shapes the article uses (layers, KV heads, head dim, bytes per value in FP16).
LLAMA2_7B = dict(layers=32, kv_heads=32, head_dim=128, itemsize=2)
LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128, itemsize=2)


class OutOfBlocks(ValueError):
    """The block pool cannot supply the blocks an append needs (the cache is unchanged)."""


def _block_key(parent: bytes, token_ids) -> bytes:
    """Prefix-cache key of a full block: a hash of its parent's key and its token ids."""
    ids = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(parent + ids).digest()


def _check_int(value, name, lo=0):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {value!r}")
    return int(value)


class PagedKVCache:
    """K and V caches in fixed-size blocks, addressed through per-sequence block tables.

    ``k_pool`` and ``v_pool`` are plain NumPy arrays of shape
    (num_blocks, block_size, num_kv_heads, head_dim), so GPU kernels can copy them as they
    are together with :meth:`block_tables_array`.
    """

    def __init__(self, num_blocks, block_size=DEFAULT_BLOCK_SIZE, num_kv_heads=1, head_dim=64,
                 dtype=np.float32):
        self.num_blocks = _check_int(num_blocks, "num_blocks", 1)
        self.block_size = _check_int(block_size, "block_size", 1)
        self.num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = _check_int(head_dim, "head_dim", 1)
        dt = np.dtype(dtype)
        if dt.name not in ("float16", "float32", "float64"):
            raise ValueError(f"dtype: expected float16, float32 or float64, got {dt.name}")
        self.dtype = dt
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # unwritten slots hold NaN on purpose: a kernel that reads padding shows it at once
        self.k_pool = np.full(shape, np.nan, dtype=dt)
        self.v_pool = np.full(shape, np.nan, dtype=dt)
        self._ref = np.zeros(self.num_blocks, dtype=np.int64)
        self._free = OrderedDict((b, None) for b in range(self.num_blocks))  # FIFO: evict oldest
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._keys: dict[int, list[bytes] | None] = {}     # sid -> keys of its full blocks
        self._tail_ids: dict[int, list[int] | None] = {}   # sid -> token ids in its last, partial block
        self._block_of_key: dict[bytes, int] = {}          # prefix cache: key -> block
        self._key_of_block: dict[int, bytes] = {}
        self._next_sid = 0
        self.stats = {"prefix_hits": 0, "copy_on_write": 0}

    # ------------------------------------------------------------------ queries
    def __repr__(self):
        return (f"PagedKVCache({self.num_blocks} blocks of {self.block_size} slots, Hkv={self.num_kv_heads}, "
                f"d={self.head_dim}, {self.dtype.name}; {len(self._tables)} sequences, "
                f"{self.num_free_blocks()} free blocks)")

    def _check_sid(self, sid):
        if isinstance(sid, bool) or not isinstance(sid, numbers.Integral) or int(sid) not in self._tables:
            raise ValueError(f"seq_id: unknown sequence id {sid!r}; live ids are {sorted(self._tables)}")
        return int(sid)

    @property
    def seq_ids(self) -> list[int]:
        return sorted(self._tables)

    def block_table(self, sid) -> list[int]:
        """The physical block ids of sequence ``sid``'s logical blocks 0, 1, 2, ... (a copy)."""
        return list(self._tables[self._check_sid(sid)])

    def seq_len(self, sid) -> int:
        return self._lens[self._check_sid(sid)]

    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block) -> int:
        self._check_block(block)
        return int(self._ref[block])

    def ref_counts(self) -> np.ndarray:
        return self._ref.copy()

    def cached_blocks(self) -> dict[int, str]:
        """Blocks holding a prefix-cache key (live or free): block -> short hex key."""
        return {b: k.hex()[:8] for b, k in sorted(self._key_of_block.items())}

    def _check_block(self, block):
        if isinstance(block, bool) or not isinstance(block, numbers.Integral) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block: expected a block id in [0, {self.num_blocks}), got {block!r}")

    def block_tables_array(self, seq_ids):
        """Block tables of ``seq_ids`` as a padded int32 array, with the sequences' lengths.

        Returns (tables (len(seq_ids), max_blocks) int32, seq_lens (len(seq_ids),) int32);
        rows are padded with -1 beyond each sequence's blocks (never read by a kernel that
        respects seq_lens).  The form a GPU kernel takes.
        """
        sids = [self._check_sid(s) for s in seq_ids]
        width = max([len(self._tables[s]) for s in sids] + [1])
        tables = np.full((len(sids), width), -1, dtype=np.int32)
        for i, s in enumerate(sids):
            tables[i, :len(self._tables[s])] = self._tables[s]
        lens = np.array([self._lens[s] for s in sids], dtype=np.int32)
        return tables, lens

    # ------------------------------------------------------------------ changes
    def new_sequence(self) -> int:
        """Start an empty sequence (no blocks yet); returns its id."""
        sid = self._next_sid
        self._next_sid += 1
        self._tables[sid], self._lens[sid] = [], 0
        self._keys[sid], self._tail_ids[sid] = [], []
        return sid

    def fork(self, sid) -> int:
        """A new sequence sharing every block of ``sid`` (reference counts go up; no copy)."""
        sid = self._check_sid(sid)
        child = self._next_sid
        self._next_sid += 1
        self._tables[child] = list(self._tables[sid])
        self._lens[child] = self._lens[sid]
        keys, tail = self._keys[sid], self._tail_ids[sid]
        self._keys[child] = None if keys is None else list(keys)
        self._tail_ids[child] = None if tail is None else list(tail)
        for b in self._tables[child]:
            self._ref[b] += 1
        return child

    def free(self, sid) -> None:
        """Drop sequence ``sid``; blocks no other table holds go back to the free list."""
        sid = self._check_sid(sid)
        for b in self._tables.pop(sid):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None          # keeps its prefix key until handed out again
        del self._lens[sid], self._keys[sid], self._tail_ids[sid]

    def _check_kv(self, k_new, v_new, token_ids):
        want = (self.num_kv_heads, self.head_dim)
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            s = tuple(getattr(x, "shape", ()))
            if not isinstance(x, np.ndarray) or len(s) != 3 or s[1:] != want:
                raise ValueError(f"{name}: expected a NumPy array (tokens, {want[0]}, {want[1]}), got "
                                 f"{s if s else type(x).__name__}")
            if x.dtype != self.dtype:
                raise ValueError(f"{name}: dtype must equal the cache's {self.dtype.name}, got {x.dtype}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"v_new: shape must equal k_new's {k_new.shape}, got {v_new.shape}")
        n = k_new.shape[0]
        if token_ids is None:
            return n, None
        ids = np.asarray(token_ids)
        if ids.shape != (n,) or (n and ids.dtype.kind not in "iu"):
            raise ValueError(f"token_ids: expected {n} integers (one per new token), got shape {ids.shape} "
                             f"dtype {ids.dtype}")
        return n, [int(t) for t in ids]

    def _allocate(self) -> int:
        b, _ = self._free.popitem(last=False)        # the least recently freed block
        key = self._key_of_block.pop(b, None)         # evicted from the prefix cache
        if key is not None:
            del self._block_of_key[key]
        self._ref[b] = 1
        return b

    def append(self, sid, k_new, v_new, token_ids=None) -> None:
        """Append tokens' K and V rows, (tokens, Hkv, d) each, to sequence ``sid``.

        Fills the last block first (copying it first if it is shared), then takes blocks from
        the free list.  With ``token_ids``, every full block is keyed for the prefix cache,
        and a block whose key is already cached is reused instead of written.
        Raises :class:`OutOfBlocks` (the cache unchanged) when the pool runs dry.
        """
        sid = self._check_sid(sid)
        n, ids = self._check_kv(k_new, v_new, token_ids)
        if n == 0:
            return
        bs = self.block_size
        table, length = self._tables[sid], self._lens[sid]
        keys, tail = self._keys[sid], self._tail_ids[sid]
        caching = ids is not None and keys is not None and tail is not None

        # ---- plan (no state changes): copy-on-write, prefix hits, fresh blocks
        fill = length % bs                                # slots used in the last block
        cow = fill > 0 and self._ref[table[-1]] > 1       # shared partial block: copy first
        first = (bs - fill) % bs if fill else 0           # tokens that go into the last block
        first = min(first, n)
        plan = []                                         # per new block: (start, stop, key, hit)
        parent = keys[-1] if caching and keys else _ROOT_KEY
        if caching and fill:                               # the tail block may fill up now
            key_tail = (_block_key(parent, tail + ids[:first]) if fill + first == bs else None)
            if key_tail is not None:
                parent = key_tail
        revived = set()
        t = first
        while t < n:
            stop = min(t + bs, n)
            key = hit = None
            if caching and stop - t == bs:
                key = _block_key(parent, ids[t:stop])
                parent = key
                hit = self._block_of_key.get(key)
                if hit is not None and self._ref[hit] == 0:
                    revived.add(hit)
            plan.append((t, stop, key, hit))
            t = stop
        fresh = int(cow) + sum(1 for p in plan if p[3] is None)
        available = len(self._free) - len(revived)
        if fresh > available:
            raise OutOfBlocks(f"k_new: appending {n} tokens to sequence {sid} needs {fresh} free blocks, "
                              f"only {available} are free (pool of {self.num_blocks})")

        # ---- act: everything below succeeds
        for b in revived:                                 # cached free blocks come back first
            del self._free[b]
        if first:
            last = table[-1]
            if cow:
                new = self._allocate()
                self.k_pool[new, :fill] = self.k_pool[last, :fill]
                self.v_pool[new, :fill] = self.v_pool[last, :fill]
                self._ref[last] -= 1                      # still > 0: another table holds it
                table[-1] = last = new
                self.stats["copy_on_write"] += 1
            self.k_pool[last, fill:fill + first] = k_new[:first]
            self.v_pool[last, fill:fill + first] = v_new[:first]
            if caching:
                tail.extend(ids[:first])
                if fill + first == bs:
                    self._register(last, key_tail)
                    keys.append(key_tail)
                    tail.clear()
        for start, stop, key, hit in plan:
            if hit is not None:
                self._ref[hit] += 1
                table.append(hit)
                self.stats["prefix_hits"] += 1
            else:
                b = self._allocate()
                self.k_pool[b, :stop - start] = k_new[start:stop]
                self.v_pool[b, :stop - start] = v_new[start:stop]
                table.append(b)
                if key is not None:
                    self._register(b, key)
            if caching:
                if key is not None:
                    keys.append(key)
                else:
                    tail.extend(ids[start:stop])
        self._lens[sid] = length + n
        if ids is None:                                   # unknown tokens end prefix caching
            self._keys[sid] = self._tail_ids[sid] = None

    def _register(self, block, key):
        if key not in self._block_of_key:                 # first writer of a prefix wins
            self._block_of_key[key] = block
            self._key_of_block[block] = key

    # ------------------------------------------------------------------ reads
    def gather(self, sid, backend="numpy", config=None):
        """Sequence ``sid``'s K and V as contiguous (Hkv, n, d) arrays, read through its table.

        backend "numpy" (counted HBM traffic), or "numba" / "cupy" (their gather kernels,
        the version chosen by ``config`` like every GPU op: :func:`iokernels.core.api.paged_gather`).
        """
        from .core.api import paged_gather as _dispatch
        return _dispatch(self, sid, backend=backend, config=config)

    def snapshot(self):
        """Everything the cache holds, as plain values (for tests: a failing call changes nothing)."""
        return (self.k_pool.tobytes(), self.v_pool.tobytes(), self._ref.tolist(), list(self._free),
                {s: list(t) for s, t in self._tables.items()}, dict(self._lens),
                {s: (None if k is None else list(k)) for s, k in self._keys.items()},
                {s: (None if t is None else list(t)) for s, t in self._tail_ids.items()},
                dict(self._block_of_key), self._next_sid)


def check_block_table(block_table, seq_len, num_blocks, block_size):
    """Validate a block table against a pool: enough entries for seq_len, each in range."""
    table = np.asarray(block_table)
    seq_len = _check_int(seq_len, "seq_len")
    need = -(-seq_len // block_size)
    if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
        raise ValueError(f"block_table: expected a 1-D list of integer block ids, got shape {table.shape} "
                         f"dtype {table.dtype}")
    if table.size < need:
        raise ValueError(f"block_table: {seq_len} tokens in blocks of {block_size} need {need} entries, "
                         f"got {table.size}")
    bad = np.flatnonzero((table[:need] < 0) | (table[:need] >= num_blocks))   # vectorized: this runs
    if bad.size:                                        # before every GPU gather, on the host
        i = int(bad[0])
        raise ValueError(f"block_table: entry {i} is block {int(table[i])}, outside the pool [0, {num_blocks})")
    return table[:need].astype(np.int32)


def paged_gather(k_pool, v_pool, block_table, seq_len):
    """Read a sequence's K and V through its block table into contiguous (Hkv, n, d) arrays.

    Only the ``seq_len`` written slots are read: the unwritten tail of the last block never is.
    Traffic (counted): the table entries, the valid K/V rows of each block, the outputs.
    """
    num_blocks, bs, hkv, d = k_pool.shape
    table = check_block_table(block_table, seq_len, num_blocks, bs)
    TABLE = HBM(table, "block_table")
    K_CACHE, V_CACHE = HBM(k_pool, "K_cache"), HBM(v_pool, "V_cache")
    K = HBM.empty((hkv, seq_len, d), k_pool.dtype, "K")
    V = HBM.empty((hkv, seq_len, d), v_pool.dtype, "V")
    for j in range(len(table)):                               # one logical block at a time
        blk = int(TABLE[j])                                   # read 1 int32
        t0, t1 = j * bs, min((j + 1) * bs, seq_len)
        k_tile = K_CACHE[blk, :t1 - t0]                       # load K block -> SRAM (valid slots only)
        v_tile = V_CACHE[blk, :t1 - t0]                       # load V block -> SRAM
        K[:, t0:t1] = k_tile.transpose(1, 0, 2)               # write K rows -> HBM (contiguous)
        V[:, t0:t1] = v_tile.transpose(1, 0, 2)               # write V rows -> HBM
    return K.result(), V.result()


def traffic_model_gather(*, seq_len, heads_kv, head_dim, block_size=DEFAULT_BLOCK_SIZE, dtype="float32"):
    """Closed-form traffic of :func:`paged_gather` (``cache.gather``) for one sequence.

    Keywords: seq_len (tokens; a list of lengths sums several gathers), heads_kv, head_dim,
    block_size, dtype.  Per sequence of n tokens: the table's ceil(n / block_size) int32
    entries read; n * Hkv * d values read from each pool; the same written contiguously.
    """
    lens = [seq_len] if isinstance(seq_len, numbers.Integral) else list(seq_len)
    s = np.dtype(dtype).itemsize
    t = Traffic()
    for n in lens:
        n = int(n)
        rows = n * heads_kv * head_dim * s
        t.add("block_table", read=-(-n // block_size) * 4)
        t.add("K_cache", read=rows)
        t.add("V_cache", read=rows)
        t.add("K", written=rows)
        t.add("V", written=rows)
    return t


# --------------------------------------------------------------------------- calculators
@dataclass(frozen=True)
class PagingWaste:
    tokens: int
    block_size: int
    blocks: int
    slots: int
    wasted_slots: int

    @property
    def waste_fraction(self) -> float:
        """Wasted slots over allocated slots."""
        return self.wasted_slots / self.slots if self.slots else 0.0


def blocks_needed(num_tokens, block_size=DEFAULT_BLOCK_SIZE) -> int:
    """ceil(num_tokens / block_size): blocks a sequence of that many tokens holds."""
    return -(-_check_int(num_tokens, "num_tokens") // _check_int(block_size, "block_size", 1))


def paging_waste(num_tokens, block_size=DEFAULT_BLOCK_SIZE) -> PagingWaste:
    """Blocks, slots and unwritten slots of one paged sequence (300 tokens, 16: 19, 304, 4)."""
    b = blocks_needed(num_tokens, block_size)
    return PagingWaste(int(num_tokens), int(block_size), b, b * block_size, b * block_size - int(num_tokens))


def reservation_waste(used_tokens, reserved_tokens=4096) -> float:
    """Fraction of a contiguous reservation left unused (300 of 4,096: about 0.927)."""
    used, res = _check_int(used_tokens, "used_tokens"), _check_int(reserved_tokens, "reserved_tokens", 1)
    if used > res:
        raise ValueError(f"used_tokens: {used} exceeds the reservation of {res}")
    return 1.0 - used / res


def kv_bytes_per_token(layers, kv_heads, head_dim, itemsize) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes: 524,288 B = 0.5 MiB for Llama-2-7B.

    Uses :func:`iokernels.core.roofline.kv_bytes_per_token` when that module provides it.
    """
    try:
        from .core.roofline import kv_bytes_per_token as _kv
    except ImportError:
        return 2 * int(layers) * int(kv_heads) * int(head_dim) * int(itemsize)
    return int(_kv(layers, kv_heads, head_dim, itemsize))


def reservation_bytes(tokens, layers=32, kv_heads=32, head_dim=128, itemsize=2) -> int:
    """Bytes of KV cache for ``tokens`` slots (4,096 with Llama-2-7B shapes: 2 GiB)."""
    return int(tokens) * kv_bytes_per_token(layers, kv_heads, head_dim, itemsize)


def fragmentation(lengths, block_size=DEFAULT_BLOCK_SIZE, max_len=4096) -> dict:
    """Contiguous reservation vs paging for a batch of final request lengths.

    Returns the slots each scheme allocates and the fraction wasted: ``reserved`` gives every
    request ``max_len`` slots; ``paged`` gives it ceil(n / block_size) blocks.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1 or np.any(lens < 0) or np.any(lens > max_len):
        raise ValueError(f"lengths: expected a 1-D list of lengths in [0, {max_len}]")
    used = int(lens.sum())
    reserved = int(len(lens) * max_len)
    paged = int((-(-lens // block_size) * block_size).sum())
    return dict(used=used, reserved_slots=reserved, paged_slots=paged,
                reserved_waste=1 - used / reserved if reserved else 0.0,
                paged_waste=1 - used / paged if paged else 0.0)
