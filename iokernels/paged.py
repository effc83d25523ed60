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

* a **quantized** cache stores each K and V value in one byte (``kv_dtype``: OCP FP8
  E4M3 "float8_e4m3fn" or symmetric "int8") with a float32 **scale** per (block, KV head)
  or per block, halving a 16-bit cache's bytes per token.  Rows are quantized as they are
  appended; the readers (gather, paged decode) load a block's scales with it and
  dequantize on chip.  Scales are powers of two (as in the OCP Microscaling formats),
  and a partly filled block whose scale must grow is requantized at the new scale; every
  stored value then stays within :func:`quantization_error_bound` of what was appended.

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
s[b, h]         a quantized cache's scale of block b (and KV head h): a stored code c
                stands for c * s[b, h]
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
import itertools
import numbers
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .core import conventions as cv
from .core.api import GPU_BACKENDS, gpu_gather
from .core.traffic import HBM, Traffic

__all__ = ["PagedKVCache", "OutOfBlocks", "DEFAULT_BLOCK_SIZE", "paged_gather", "check_block_table",
           "QUANT_FORMATS", "SCALE_GRANULARITIES", "SCALE_ITEMSIZE", "storage_dtype", "power_of_two_scale",
           "quantize", "dequantize", "quantization_error_bound",
           "traffic_model_gather", "blocks_needed", "paging_waste", "reservation_waste",
           "kv_bytes_per_token", "reservation_bytes", "fragmentation", "LLAMA2_7B", "LLAMA3_8B"]

#: vLLM's default block size: small enough that a sequence wastes under one block
#: (< 16 slots), large enough that a block of K rows is a useful tile for a kernel.
DEFAULT_BLOCK_SIZE = 16

#: the parent key of a sequence's first block (a chain of hashes starts here).
_ROOT_KEY = b"iokernels-prefix-root"

#: dtypes a cache may hold its values in (and that its queries and outputs use)
CACHE_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: 1-byte storage formats of a quantized cache -> the largest magnitude each represents
#: (float8_e4m3fn: 448, OCP FP8 E4M3, which has NaN but no infinity; int8: 127, symmetric
#: so that -128 is free to mark unwritten slots)
QUANT_FORMATS = {"float8_e4m3fn": 448.0, "int8": 127.0}
#: one scale per (block, KV head), or one per block shared by its KV heads
SCALE_GRANULARITIES = ("block_head", "block")
#: scales are float32
SCALE_ITEMSIZE = 4
#: the int8 code symmetric quantization never produces: unwritten int8 slots hold it and
#: dequantize to NaN, so a kernel that reads padding shows it as the float pools' NaN does
INT8_PAD = -128
#: the scale of an all-zero block (any power of two would do): float32's smallest normal
MIN_SCALE = 2.0 ** -126
#: float8_e4m3fn: half the spacing of the significands in [1, 2) (3 stored bits), the
#: relative rounding error of a normal value; and half its smallest subnormal step (2^-9)
FP8_REL_ERROR = 2.0 ** -4
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10
#: float32's relative rounding error: values are quantized from float32
FLOAT32_REL_ERROR = 2.0 ** -24

#: Model shapes the article uses (layers, KV heads, head dim, bytes per value in FP16).
LLAMA2_7B = dict(layers=32, kv_heads=32, head_dim=128, itemsize=2)
LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128, itemsize=2)


# --------------------------------------------------------------------------- quantization
def storage_dtype(name) -> np.dtype:
    """The NumPy dtype of a cache dtype or storage format name (ml_dtypes for bfloat16, fp8)."""
    name = np.dtype(name).name if not isinstance(name, str) else name
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def power_of_two_scale(amax, kv_dtype):
    """The smallest power of two s with amax / s <= the format's largest value (per entry).

    Powers of two, as the OCP Microscaling (MX) formats' shared block exponents are: the
    division x / s is exact, dequantizing is an exponent shift, and moving a block to a
    larger scale leaves normal fp8 values exact.  An all-zero entry gets MIN_SCALE.
    """
    ratio = np.asarray(amax, dtype=np.float64) / QUANT_FORMATS[kv_dtype]
    m, e = np.frexp(np.where(ratio > 0, ratio, MIN_SCALE))       # ratio = m * 2^e, m in [0.5, 1)
    s = np.ldexp(1.0, np.where(m == 0.5, e - 1, e))
    return np.maximum(s, MIN_SCALE).astype(np.float32)


def quantize(x, scale, kv_dtype):
    """x / scale rounded to the 1-byte format (round to nearest even); scale broadcasts to x."""
    y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)
    if kv_dtype == "int8":
        return np.clip(np.rint(y), -QUANT_FORMATS["int8"], QUANT_FORMATS["int8"]).astype(np.int8)
    return y.astype(storage_dtype(kv_dtype))


def dequantize(codes, scale, out_dtype):
    """codes * scale as ``out_dtype`` (exact in float32: the scale is a power of two).

    int8's padding code INT8_PAD comes back as NaN; fp8's NaN stays NaN.
    """
    x = codes.astype(np.float32) * np.asarray(scale, np.float32)
    if codes.dtype == np.int8:
        x = np.where(codes == INT8_PAD, np.float32(np.nan), x)
    return x.astype(out_dtype)


def quantization_error_bound(x, scale, kv_dtype):
    """Per entry, the most |x - dequantize(quantize(x))| can be in a cache block of this scale.

    ``scale`` is the block's final scale s (broadcast to x).  A block filled by several
    appends is requantized whenever its scale grows, each time by at least 2x, so the
    roundings a value has suffered add up to a bounded total:

    * int8: every rounding errs by at most half a step of that time's scale, and the
      steps double: the total stays below s (s / 2 for a block written in one append).
    * float8_e4m3fn: a normal value is rounded once (2^-4 relative) and moved exactly by
      power-of-two rescaling; subnormal roundings err by at most 2^-10 of that time's
      scale, below 2^-9 s in total; plus float32's rounding of the value (2^-24 relative),
      since values are quantized from float32.
    """
    x = np.abs(np.asarray(x, dtype=np.float64))
    s = np.asarray(scale, dtype=np.float64)
    if kv_dtype == "int8":
        return np.broadcast_to(s, x.shape) + 0.0
    return (FP8_REL_ERROR + 2 * FLOAT32_REL_ERROR) * x + 2 * FP8_SUBNORMAL_HALF_STEP * s


class OutOfBlocks(ValueError):
    """The block pool cannot supply the blocks an append needs (the cache is unchanged)."""


def _block_key(parent: bytes, token_ids) -> bytes:
    """Prefix-cache key of a full block: a hash of its parent's key and its token ids."""
    ids = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(parent + ids).digest()


def _check_int(value, name, lo=0):
    if type(value) is int and value >= lo:            # the common case, without the ABC checks below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {value!r}")
    return int(value)


class PagedKVCache:
    """K and V caches in fixed-size blocks, addressed through per-sequence block tables.

    ``k_pool`` and ``v_pool`` are plain NumPy arrays of shape
    (num_blocks, block_size, num_kv_heads, head_dim), so GPU kernels can copy them as they
    are together with :meth:`block_tables_array`.

    ``dtype`` is the dtype of the rows appended, of the queries that read them and of
    :meth:`gather`'s output (float16, bfloat16 from ml_dtypes, float32, float64).
    ``kv_dtype`` quantizes the pools: "float8_e4m3fn" or "int8" stores each value in one
    byte, with a float32 power-of-two scale per (block, KV head) (``scale_granularity=
    "block_head"``) or per block ("block") in ``k_scale`` / ``v_scale`` of shape
    (num_blocks, Hkv or 1).  Rows are quantized on :meth:`append` (a block whose scale must
    grow is requantized) and dequantized by the readers; the error of every stored value
    is within :func:`quantization_error_bound` of its block's scale.

    ``keys_only=True`` keeps one pool: ``v_pool`` (and ``v_scale``) is None and
    :meth:`append` takes no values.  Multi-head latent attention's cache is one: each
    token's row [latent | rotary key] serves as the key, and its first columns as the value
    (:mod:`iokernels.mla`), so storing it twice would double the bytes per token.
    """

    def __init__(self, num_blocks, block_size=DEFAULT_BLOCK_SIZE, num_kv_heads=1, head_dim=64,
                 dtype=np.float32, kv_dtype=None, scale_granularity="block_head", keys_only=False):
        self.num_blocks = _check_int(num_blocks, "num_blocks", 1)
        self.block_size = _check_int(block_size, "block_size", 1)
        self.num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = _check_int(head_dim, "head_dim", 1)
        name = dtype if isinstance(dtype, str) else getattr(np.dtype(dtype), "name", str(dtype))
        if name not in CACHE_DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(CACHE_DTYPES)}, got {name}")
        self.dtype = storage_dtype(name)
        if kv_dtype is not None and kv_dtype not in QUANT_FORMATS:
            raise ValueError(f"kv_dtype: expected None or one of {', '.join(map(repr, QUANT_FORMATS))}, "
                             f"got {kv_dtype!r}")
        cv.check_choice(scale_granularity, "scale_granularity", SCALE_GRANULARITIES)
        self.kv_dtype, self.scale_granularity = kv_dtype, scale_granularity
        self.keys_only = cv.check_bool(keys_only, "keys_only")
        self.storage_dtype = self.dtype if kv_dtype is None else storage_dtype(kv_dtype)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # unwritten slots hold NaN (int8: INT8_PAD, which dequantizes to NaN) on purpose:
        # a kernel that reads padding shows it at once
        pad = INT8_PAD if kv_dtype == "int8" else np.nan
        self.k_pool = np.full(shape, pad, dtype=self.storage_dtype)
        self.v_pool = None if keys_only else np.full(shape, pad, dtype=self.storage_dtype)
        self.k_scale = self.v_scale = None
        if self.quantized:
            heads = self.num_kv_heads if scale_granularity == "block_head" else 1
            self.k_scale = np.full((self.num_blocks, heads), np.nan, dtype=np.float32)
            self.v_scale = None if keys_only else np.full((self.num_blocks, heads), np.nan, dtype=np.float32)
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
        store = "" if not self.quantized else f" stored as {self.kv_dtype} (scales per {self.scale_granularity})"
        return (f"PagedKVCache({self.num_blocks} blocks of {self.block_size} slots, Hkv={self.num_kv_heads}, "
                f"d={self.head_dim}, {self.dtype.name}{store}; {len(self._tables)} sequences, "
                f"{self.num_free_blocks()} free blocks)")

    @property
    def quantized(self) -> bool:
        """True when the pools hold 1-byte codes and per-block scales."""
        return self.kv_dtype is not None

    def bytes_per_token(self) -> float:
        """Pool bytes one token slot takes, K and V, its share of its block's scales included."""
        pools = 1 if self.keys_only else 2
        per = pools * self.num_kv_heads * self.head_dim * self.storage_dtype.itemsize
        if self.quantized:
            per += pools * self.k_scale.shape[1] * SCALE_ITEMSIZE / self.block_size
        return per

    def _pools(self):
        """(pool, scales) for K, and for V unless the cache keeps keys only."""
        return [(self.k_pool, self.k_scale)] + ([] if self.keys_only else [(self.v_pool, self.v_scale)])

    def _check_sid(self, sid):
        if type(sid) is int and sid in self._tables:      # the common case, without the ABC checks below
            return sid
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

    def last_block(self, sid) -> int:
        """The physical block of sequence ``sid``'s last logical block (-1 while it holds none), uncopied."""
        return (self._tables[self._check_sid(sid)] or [-1])[-1]

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

    def _check_block(self, block):                        # (an int skips the ABC checks)
        if (type(block) is not int and (isinstance(block, bool) or not isinstance(block, numbers.Integral))) \
                or not 0 <= block < self.num_blocks:
            raise ValueError(f"block: expected a block id in [0, {self.num_blocks}), got {block!r}")

    def block_tables_array(self, seq_ids):
        """Block tables of ``seq_ids`` as a padded int32 array, with the sequences' lengths.

        Returns (tables (len(seq_ids), max_blocks) int32, seq_lens (len(seq_ids),) int32); rows
        are padded with -1 beyond each sequence's blocks (never read by a kernel that respects
        seq_lens).  The form a GPU kernel takes."""
        sids = [self._check_sid(s) for s in seq_ids]
        rows = [self._tables[s] for s in sids]
        held = np.fromiter(map(len, rows), np.int64, len(rows))
        tables = np.full((len(rows), max(int(held.max(initial=0)), 1)), -1, dtype=np.int32)
        tables[np.arange(tables.shape[1]) < held[:, None]] = np.fromiter(   # row by row, as the mask runs
            itertools.chain.from_iterable(rows), np.int32, int(held.sum()))
        return tables, np.fromiter((self._lens[s] for s in sids), np.int32, len(sids))

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
        if self.keys_only and v_new is not None:
            raise ValueError("v_new: this cache keeps keys only (keys_only=True); pass v_new=None")
        if self.keys_only:
            v_new = k_new
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

    def append(self, sid, k_new, v_new=None, token_ids=None) -> None:
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
                for pool, scales in self._pools():
                    pool[new, :fill] = pool[last, :fill]
                    if scales is not None:                # the copy keeps the block's scales
                        scales[new] = scales[last]
                self._ref[last] -= 1                      # still > 0: another table holds it
                table[-1] = last = new
                self.stats["copy_on_write"] += 1
            self._write(last, fill, k_new[:first], None if v_new is None else v_new[:first])
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
                self._write(b, 0, k_new[start:stop], None if v_new is None else v_new[start:stop])
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

    def _write(self, block, at, k_rows, v_rows):
        """Store rows (n, Hkv, d) in slots [at, at + n) of a private block.

        A quantized block's scale covers every value it holds: the new rows' power-of-two
        scale, or the block's own if larger.  When it grows, the slots already written are
        dequantized and quantized again at the new scale (at least 2x the old one, so the
        roundings stay within :func:`quantization_error_bound`).  ``at == 0`` starts the
        block afresh: values a previous owner left behind do not count.
        """
        n = len(k_rows)
        for (pool, scales), rows in zip(self._pools(), (k_rows, v_rows)):
            if not self.quantized:
                pool[block, at:at + n] = rows
                continue
            axes = (0, 1, 2) if self.scale_granularity == "block" else (0, 2)
            amax = np.abs(rows.astype(np.float32)).max(axis=axes).reshape(-1)    # per scale entry
            need = power_of_two_scale(amax, self.kv_dtype)
            new = need if at == 0 else np.maximum(scales[block], need)
            if at and np.any(new != scales[block]):       # requantize the slots already written
                old = dequantize(pool[block, :at], scales[block][None, :, None], np.float32)
                pool[block, :at] = quantize(old, new[None, :, None], self.kv_dtype)
            pool[block, at:at + n] = quantize(rows, new[None, :, None], self.kv_dtype)
            scales[block] = new

    def _register(self, block, key):
        if key not in self._block_of_key:                 # first writer of a prefix wins
            self._block_of_key[key] = block
            self._key_of_block[block] = key

    # ------------------------------------------------------------------ reads
    def gather(self, sid, backend="numpy", config=None):
        """Sequence ``sid``'s K and V as contiguous (Hkv, n, d) arrays, read through its table.

        A quantized cache's rows come back dequantized, in ``dtype``; a keys-only cache
        returns (K, None).

        backend "numpy" (counted HBM traffic), or "numba" / "cupy" (their gather kernels,
        the version chosen by ``config`` like every GPU op: :func:`iokernels.core.api.gpu_gather`).
        """
        sid = self._check_sid(sid)
        cv.check_choice(backend, "backend", ("numpy", "tiled") + tuple(GPU_BACKENDS))
        if backend in GPU_BACKENDS:
            return gpu_gather(self, sid, backend, config)
        if config is not None:
            raise ValueError(f"config: the NumPy gather has no config, got {type(config).__name__}")
        return self._gather_numpy(sid)

    def _gather_numpy(self, sid):
        """The NumPy gather (counted); what the dispatch runs for backend "numpy"."""
        return paged_gather(self.k_pool, self.v_pool, self._tables[sid], self._lens[sid],
                            k_scale=self.k_scale, v_scale=self.v_scale, out_dtype=self.dtype)

    def snapshot(self):
        """Everything the cache holds, as plain values (for tests: a failing call changes nothing)."""
        pools = tuple(None if x is None else x.tobytes() for x in (self.k_pool, self.v_pool, self.k_scale,
                                                                     self.v_scale))
        return (pools, self._ref.tolist(), list(self._free),
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


def paged_gather(k_pool, v_pool, block_table, seq_len, *, k_scale=None, v_scale=None, out_dtype=None):
    """Read a sequence's K and V through its block table into contiguous (Hkv, n, d) arrays.

    Only the ``seq_len`` written slots are read: the unwritten tail of the last block never is.
    Quantized pools come with ``k_scale`` / ``v_scale`` (num_blocks, Hkv or 1): each block's
    scales are read next to it and the rows dequantized on chip to ``out_dtype``.  With
    ``v_pool`` None (a keys-only cache) only K is gathered and V comes back None.
    Traffic (counted): the table entries, the valid K/V rows (and scales) of each block,
    the outputs.
    """
    num_blocks, bs, hkv, d = k_pool.shape
    table = check_block_table(block_table, seq_len, num_blocks, bs)
    out_dtype = k_pool.dtype if out_dtype is None else out_dtype
    TABLE = HBM(table, "block_table")
    sides = [("K", k_pool, k_scale)] + ([] if v_pool is None else [("V", v_pool, v_scale)])
    src = [(HBM(pool, f"{x}_cache"), None if sc is None else HBM(sc, f"{x}_scale")) for x, pool, sc in sides]
    out = [HBM.empty((hkv, seq_len, d), out_dtype, x) for x, _, _ in sides]
    for j in range(len(table)):                               # one logical block at a time
        blk = int(TABLE[j])                                   # read 1 int32
        t0, t1 = j * bs, min((j + 1) * bs, seq_len)
        for (CACHE, SCALE), OUT in zip(src, out):
            tile = CACHE[blk, :t1 - t0]                       # load K (V) block -> SRAM (valid slots only)
            if SCALE is not None:                             # load its scales -> SRAM, dequantize
                tile = dequantize(tile, SCALE[blk][None, :, None], out_dtype)
            OUT[:, t0:t1] = tile.transpose(1, 0, 2)           # write K (V) rows -> HBM (contiguous)
    return out[0].result(), (out[1].result() if len(out) > 1 else None)


def traffic_model_gather(*, seq_len, heads_kv, head_dim, block_size=DEFAULT_BLOCK_SIZE, dtype="float32",
                         kv_dtype=None, scale_granularity="block_head", keys_only=False):
    """Closed-form traffic of :func:`paged_gather` (``cache.gather``) for one sequence.

    Keywords: seq_len (tokens; a list of lengths sums several gathers), heads_kv, head_dim,
    block_size, dtype, kv_dtype and scale_granularity (a quantized cache), keys_only (no V
    pool: the V entries drop out).  Per sequence
    of n tokens: the table's ceil(n / block_size) int32 entries read; n * Hkv * d values
    read from each pool (1 byte each when quantized, plus each block's Hkv or 1 float32
    scales); n * Hkv * d values of ``dtype`` written contiguously.
    """
    lens = [seq_len] if isinstance(seq_len, numbers.Integral) else list(seq_len)
    s = storage_dtype(dtype).itemsize
    kv_s = s if kv_dtype is None else storage_dtype(kv_dtype).itemsize
    per_block = heads_kv if scale_granularity == "block_head" else 1
    t = Traffic()
    for n in lens:
        n = int(n)
        blocks = -(-n // block_size)
        t.add("block_table", read=blocks * 4)
        t.add("K_cache", read=n * heads_kv * head_dim * kv_s)
        t.add("V_cache", read=n * heads_kv * head_dim * kv_s)
        if kv_dtype is not None:
            t.add("K_scale", read=blocks * per_block * SCALE_ITEMSIZE)
            t.add("V_scale", read=blocks * per_block * SCALE_ITEMSIZE)
        t.add("K", written=n * heads_kv * head_dim * s)
        t.add("V", written=n * heads_kv * head_dim * s)
    if keys_only:
        for name in ("V_cache", "V_scale", "V"):
            t.by_tensor.pop(name, None)
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
