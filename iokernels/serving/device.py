"""The KV cache on the model's device: the same blocks and books, with the values where the model runs.

:class:`~.memory.PagedMemory` keeps its pools in NumPy on the host.  A model on a GPU
then copies every layer's queries, keys and values to the host and the output back,
every step, and a benchmark of that times the copies.  The memories here keep the
values on the model's device (a torch device: "cuda", or "cpu" for the tests) and split
what a paged memory does in two, as vLLM does (Kwon et al., SOSP 2023, paper, section 4:
a block manager on the CPU, the KV blocks in GPU memory):

* **the books, on the host**: block tables, reference counts, the free list, fork and
  copy-on-write, the prefix cache.  They are exactly :class:`~iokernels.paged.PagedKVCache`'s:
  :class:`SlotMap` is a PagedKVCache that keeps no values, one for all layers (vLLM
  keeps one block table per sequence for every layer);
* **the values, on the device**: a K and a V pool per layer, (num_blocks, block_size,
  Hkv, d) torch tensors, written and read by block id.

Once a step, before the first layer, :meth:`DevicePagedMemory.prepare` does the books for
the whole batch and uploads what the layers need in one copy (vLLM's attention metadata):
the **slot** each new row goes to (block * block_size + offset: the slot mapping), the
block tables, the lengths and the query offsets (:class:`StepPlan`).  Each layer then does
two things on the device (:meth:`~DevicePagedMemory.write_attend`): store the chunk's K and
V rows at their slots (one indexed write per pool), and attend.

The attention ``backend``:

* ``"torch"``, the reference, on any device: each sequence's keys are gathered through its
  table (on the device), decodes (one query) in one batched SDPA call with a mask of the
  valid keys, each longer chunk in its own call, causal bottom-right
  (:func:`iokernels.torch_sdpa.sdpa`; SDPA's ``is_causal`` alone is top-left aligned);
* ``"cupy"``: the CuPy kernels reading the pools in place, looked up by name when the
  memory is made (a clear error where they are not there), split as vLLM splits a step's
  attention metadata (``prefill_metadata`` and ``decode_metadata`` in
  vllm/attention/backends/flash_attn.py of vLLM's V0 engine, since removed; code) and as FlashInfer offers
  ``BatchDecodeWithPagedKVCacheWrapper`` beside ``BatchPrefillWithPagedKVCacheWrapper``
  (docs): the step's one-query chunks go to the paged decode,
  ``iokernels.cupy_raw.calls.paged_decode_pools``, in one call, and its longer chunks to the
  tensor-core paged prefill, ``paged_prefill_pools``, in another (both planned once per
  shape).  One prefill call for every row would size its grid by the longest chunk for every
  sequence of the step, so a step of a few long chunks and hundreds of decodes would launch
  a grid of mostly empty tiles.

:class:`DeviceContiguousMemory` is the baseline on the device: one contiguous range per
sample reserved at admission, rounded up to whole blocks so that a range is a run of
consecutive blocks, and the same attention reads both memories (through a table of
consecutive ids here).  What differs between the two is the memory policy alone.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from ..paged import _ROOT_KEY, PagedKVCache, _block_key, blocks_needed
from ..torch_sdpa import sdpa
from .memory import ContiguousMemory, PagedMemory

__all__ = ["SlotMap", "StepPlan", "DevicePagedMemory", "DeviceContiguousMemory", "DEVICE_BACKENDS",
           "cupy_paged_prefill", "cupy_paged_decode"]

#: the attention backends a device memory runs
DEVICE_BACKENDS = ("torch", "cupy")
#: where the CuPy paged prefill and paged decode over device pools live, and their names
CUPY_PREFILL = ("iokernels.cupy_raw.calls", "paged_prefill_pools")
CUPY_DECODE = ("iokernels.cupy_raw.calls", "paged_decode_pools")
_TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


def _cupy_call(where):
    try:
        module = importlib.import_module(where[0])
    except ImportError:
        return None
    return getattr(module, where[1], None)


def cupy_paged_prefill():
    """``paged_prefill_pools`` of the CuPy backend, or None where it (or CuPy) is not installed."""
    return _cupy_call(CUPY_PREFILL)


def cupy_paged_decode():
    """``paged_decode_pools`` of the CuPy backend, or None where it (or CuPy) is not installed."""
    return _cupy_call(CUPY_DECODE)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(_TORCH_DTYPES)}, got {dtype!r}")
    return _TORCH_DTYPES[name]


def _check_backend(backend):
    if backend not in DEVICE_BACKENDS:
        raise ValueError(f"backend: a device memory attends with {', '.join(map(repr, DEVICE_BACKENDS))}; "
                         f"got {backend!r}")
    if backend != "cupy":
        return backend, None
    kernels = (cupy_paged_prefill(), cupy_paged_decode())
    for kernel, where in zip(kernels, (CUPY_PREFILL, CUPY_DECODE)):
        if kernel is None:
            raise ValueError("backend: 'cupy' needs {}.{}, which is not available here (no CuPy, or no such "
                             "kernel yet); use 'torch'".format(*where))
    return backend, kernels


def _pools(layers, rows, kv_heads, head_dim, dtype, device):
    """Per layer a K and a V tensor; unwritten slots hold NaN, as the NumPy pools do."""
    shape = (layers, rows, kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


class SlotMap(PagedKVCache):
    """A :class:`PagedKVCache` that keeps no values: an append says where each row goes.

    The parent's ``append`` makes every decision (copy-on-write, prefix-cache hits, fresh
    blocks) and stores the rows it keeps through ``_write(block, at, k_rows, v_rows)``.
    :meth:`place` appends the chunk's *row numbers* as one-value rows, so ``_write`` learns
    which row goes to which slot; a row that hits the prefix cache never reaches
    ``_write`` (its block already holds it, and is not written again).  A copy-on-write
    copies the block in every pool ``_pools`` names: here, the device pools of every layer.

    **Rows.**  A step reads the block tables and lengths of hundreds of sequences, and most
    of them changed by one token since the last step.  So each live sequence also owns a
    row of two arrays that mirror its books: ``table_rows[row]``, its block table padded
    with -1, and ``row_lens[row]``, its length.  Every change to a table or a length
    (:meth:`new_sequence`, :meth:`fork`, :meth:`free`, :meth:`append`,
    :meth:`one_into_tail`) updates the row in place, so a step gathers the batch's tables
    with one indexed read (:meth:`block_tables_array`) instead of building them from the
    lists, and the scheduler's questions about the batch (:meth:`growths`,
    :meth:`written_slots`) are a few array operations.  A freed sequence's row is reused.
    """

    def __init__(self, num_blocks, block_size, k_pools, v_pools):
        super().__init__(num_blocks, block_size, num_kv_heads=1, head_dim=1, dtype="float64")
        self.k_pool = self.v_pool = None                 # the values live in the device pools
        self.device_pools = [p for layer in zip(k_pools, v_pools) for p in layer]
        self._placed: list = []
        self._row: dict[int, int] = {}                   # sid -> its row of table_rows and row_lens
        self._spare_rows: list[int] = []                 # rows no live sequence holds
        self.table_rows = np.full((0, 1), -1, np.int32)
        self.row_lens = np.zeros(0, np.int64)

    def _pools(self):
        return [(pool, None) for pool in self.device_pools]

    # ---- the rows: every change to a table or a length lands in its row too
    def _take_row(self, sid) -> int:
        """A row for new sequence ``sid`` (-1s and length 0): a spare one, or a new one of twice as many."""
        if not self._spare_rows:                         # every row is held: twice as many rows
            held, grown = len(self.row_lens), max(2 * len(self.row_lens), 16)
            table_rows = np.full((grown, self.table_rows.shape[1]), -1, np.int32)
            table_rows[:held] = self.table_rows
            self.table_rows = table_rows
            self.row_lens = np.concatenate([self.row_lens, np.zeros(grown - held, np.int64)])
            self._spare_rows = list(range(grown - 1, held - 1, -1))        # the lowest row is taken first
        row = self._spare_rows.pop()
        self._row[sid] = row
        return row

    def _fit_width(self, blocks) -> None:
        """Rows wide enough for a table of ``blocks`` blocks (at least twice as wide when they grow)."""
        width = self.table_rows.shape[1]
        if blocks > width:
            wider = np.full((len(self.table_rows), max(2 * width, blocks)), -1, np.int32)
            wider[:, :width] = self.table_rows
            self.table_rows = wider

    def _sync_row(self, sid) -> None:
        """Copy ``sid``'s table and length into its row (after a change the rows did not follow)."""
        table, row = self._tables[sid], self._row[sid]
        self._fit_width(len(table))
        self.table_rows[row, :len(table)] = table
        self.table_rows[row, len(table):] = -1
        self.row_lens[row] = self._lens[sid]

    def _rows_of(self, sids) -> np.ndarray:
        """The rows of live sequence ids the caller has checked (a KeyError for an unknown one)."""
        return np.fromiter(map(self._row.__getitem__, sids), np.int64, len(sids))

    def new_sequence(self) -> int:
        sid = super().new_sequence()
        self._take_row(sid)
        return sid

    def fork(self, sid) -> int:
        child = super().fork(sid)
        row = self._take_row(child)
        self.table_rows[row] = self.table_rows[self._row[sid]]
        self.row_lens[row] = self.row_lens[self._row[sid]]
        return child

    def free(self, sid) -> None:
        sid = self._check_sid(sid)
        super().free(sid)
        row = self._row.pop(sid)
        self.table_rows[row] = -1
        self.row_lens[row] = 0
        self._spare_rows.append(row)

    def append(self, sid, k_new, v_new=None, token_ids=None) -> None:
        super().append(sid, k_new, v_new, token_ids)    # (raises with nothing changed, rows included)
        self._sync_row(self._check_sid(sid))

    def block_tables_array(self, seq_ids):
        """:meth:`PagedKVCache.block_tables_array`, read from the rows: the same arrays."""
        return self.tables_of([self._check_sid(s) for s in seq_ids])

    def tables_of(self, sids):
        """:meth:`block_tables_array` of sequence ids the caller has checked (a step's own)."""
        rows = self._rows_of(sids)
        lens = self.row_lens[rows]
        width = max(int(-(-lens.max(initial=0) // self.block_size)), 1)      # the longest table
        return self.table_rows[rows, :width], lens.astype(np.int32)

    # ---- the scheduler's questions about many sequences at once
    def growths(self, sids, tokens) -> np.ndarray:
        """Per checked sequence id, the free blocks appending ``tokens[i]`` to it takes at most:
        the blocks its longer length needs, and one more when its partial last block is shared
        (copy-on-write), as :meth:`~.memory.PagedMemory.growth` counts them one at a time."""
        rows, bs = self._rows_of(sids), self.block_size
        n, t = self.row_lens[rows], np.asarray(tokens, np.int64)
        need = (-n // bs) - (-(n + t) // bs)
        partial = np.flatnonzero(n % bs)
        last = self.table_rows[rows[partial], (n[partial] - 1) // bs]
        need[partial] += self._ref[last] > 1
        return need

    def written_slots(self) -> int:
        """Slots written in the live blocks, a shared block counted once (see
        :meth:`~.memory.PagedMemory.usage`): every live block is full but for the distinct
        partial last blocks, each as full as its fullest holder."""
        rows, bs = np.fromiter(self._row.values(), np.int64, len(self._row)), self.block_size
        n = self.row_lens[rows]
        fill = n % bs
        partial = np.flatnonzero(fill)
        blocks, fill = self.table_rows[rows[partial], (n[partial] - 1) // bs], fill[partial]
        order = np.lexsort((fill, blocks))                 # by block, the fullest holder last
        blocks, fill = blocks[order], fill[order]
        fullest = np.ones(len(blocks), bool)             # the last holder of each block
        fullest[:-1] = blocks[1:] != blocks[:-1]
        live = self.num_blocks - self.num_free_blocks()
        return int(bs * live - (bs - fill[fullest]).sum())

    # ---- placing a chunk's rows
    def _write(self, block, at, k_rows, v_rows):
        rows = k_rows[:, 0, 0].astype(np.int64)
        self._placed.append((rows, block * self.block_size + at + np.arange(len(rows))))

    def place(self, sid, n, token_ids=None):
        """Append ``n`` tokens to ``sid``'s books: (rows, slots), row rows[i] of the chunk goes to slot slots[i].

        A decode's token that goes into its sequence's own (unshared) last block, or starts a
        fresh one, copies no block and meets no prefix hit: :meth:`one_into_tail` does exactly
        what ``append`` does then, without its general plan (every row of a decode step but the
        ones that copy a shared block).
        """
        slot = self.one_into_tail(sid, token_ids) if n == 1 else None
        if slot is not None:
            return np.zeros(1, np.int64), np.array([slot], np.int64)
        return self.place_by_append(sid, n, token_ids)

    def place_by_append(self, sid, n, token_ids=None):
        """:meth:`place` through ``append``'s general plan (copy-on-write, prefix hits, fresh blocks)."""
        self._placed = []
        rows = np.arange(n, dtype=np.float64).reshape(n, 1, 1)
        self.append(sid, rows, rows, token_ids=token_ids)
        if not self._placed:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return tuple(np.concatenate(x) for x in zip(*self._placed))

    def place_step(self, sids, chunk_lens, token_ids):
        """:meth:`place` for every chunk of a step, in order: sequence ``sids[i]`` takes
        ``chunk_lens[i]`` tokens ``token_ids[i]``; ids the caller has checked, each at most once.
        Returns (rows, slots) over the step's packed rows (chunk i's first row is the sum of
        the chunks before it), in row order.

        Most chunks of a decode step are one token into the sequence's own partial last block,
        short of filling it: only the sequence's length and its tail of token ids change, and
        no other chunk of the step can change that block (it is not shared, not keyed for the
        prefix cache, and nothing is freed during a step).  Those chunks are placed together,
        their slots and lengths as array operations.  The others (a fresh block, a block the
        token fills and keys, a shared block to copy, a longer chunk) go through
        :meth:`one_into_tail` or ``append`` one at a time in the step's order, as the free list
        and the prefix cache need.  The books end as :meth:`place` one chunk at a time leaves them.
        """
        rows, bs = self._rows_of(sids), self.block_size
        c = np.asarray(chunk_lens, np.int64)
        at = np.cumsum(c) - c                            # each chunk's first row
        n = self.row_lens[rows]
        fill = n % bs
        last = self.table_rows[rows, np.maximum(n - 1, 0) // bs]
        quiet = (c == 1) & (fill > 0) & (fill < bs - 1) & (self._ref[last] == 1)
        if len(set(sids)) < len(sids):
            quiet[:] = False                             # a sequence twice: one chunk at a time
        for i in quiet.nonzero()[0].tolist():
            sid, ids = sids[i], token_ids[i]
            tok = ids[0] if ids is not None and len(ids) == 1 else None
            if type(tok) is not int and (type(tok) is bool or not isinstance(tok, np.integer)):
                quiet[i] = False                         # (a bad token: append's checks say what is wrong)
                continue
            tail = self._tail_ids[sid]
            if tail is not None and self._keys[sid] is not None:
                tail.append(int(tok))
            self._lens[sid] += 1
        self.row_lens[rows[quiet]] += 1
        out_rows, out_slots = [at[quiet]], [last[quiet] * bs + fill[quiet]]
        one_chunks, one_slots = [], []                   # the one-token chunks one_into_tail places
        for i in (~quiet).nonzero()[0].tolist():         # in the step's order
            slot = self.one_into_tail(sids[i], token_ids[i]) if chunk_lens[i] == 1 else None
            if slot is not None:
                one_chunks.append(i)
                one_slots.append(slot)
            else:
                r, sl = self.place_by_append(sids[i], int(chunk_lens[i]), token_ids[i])
                out_rows.append(r + at[i])
                out_slots.append(sl)
        out_rows.append(at[one_chunks])
        out_slots.append(np.array(one_slots, np.int64))
        rows_out, slots_out = np.concatenate(out_rows), np.concatenate(out_slots).astype(np.int64)
        order = np.argsort(rows_out, kind="stable")
        return rows_out[order], slots_out[order]

    def one_into_tail(self, sid, token_ids):
        """The slot one token (``token_ids``, a sequence of one int) takes at the end of ``sid``,
        with the books moved as ``append`` moves them: into the sequence's own (unshared) last
        block, keying it for the prefix cache when the token fills it; or, when that block is
        full, into a fresh block from the free list.  None, and nothing changed, otherwise (a
        shared partial block to copy, no free block, blocks of one slot, an empty sequence):
        then :meth:`place` takes the general path."""
        table = self._tables.get(sid) if type(sid) is int else None
        if not table or token_ids is None or len(token_ids) != 1:
            return None
        length, bs = self._lens[sid], self.block_size
        fill = length % bs
        tok = token_ids[0]
        if bs == 1 or type(tok) is bool or not isinstance(tok, (int, np.integer)):
            return None                                  # (a bad token: append's checks say what is wrong)
        row = self._row[sid]
        if fill == 0:
            if not self._free:
                return None                              # (append raises OutOfBlocks)
            block = self._allocate()
            table.append(block)
            self._fit_width(len(table))
            self.table_rows[row, len(table) - 1] = block
        elif self._ref[table[-1]] != 1:
            return None                                  # a shared partial block: copy-on-write first
        else:
            block = table[-1]
        tail, keys = self._tail_ids[sid], self._keys[sid]
        if tail is not None and keys is not None:
            tail.append(int(tok))
            if fill == bs - 1:                           # the block is full: its key, as append makes it
                key = _block_key(keys[-1] if keys else _ROOT_KEY, tail)
                self._register(block, key)
                keys.append(key)
                tail.clear()
        self._lens[sid] = length + 1
        self.row_lens[row] = length + 1
        return block * bs + fill


@dataclass
class StepPlan:
    """What every layer of one step reads, on the device (uploaded once): vLLM's attention metadata.

    rows, slots: chunk row rows[i] is stored at slot slots[i] of a layer's pool viewed as
    (num_blocks * block_size, Hkv, d); rows None when they are every row of the step in order
    (no prefix-cache hit left one out: the common step), so a layer stores K and V as they are,
    without gathering them first; ``cu_host``: the packed queries' offsets (B + 1,), on
    the host.  For the torch reference: block_tables (B, max_blocks) and seq_lens (B,) after
    the step's rows, cu_seqlens_q (the offsets on the device); ``decode``, the one-query
    chunks grouped by length (:func:`decode_buckets`), per group (query rows, key slots
    (B_g, width), mask (B_g, 1, 1, width)); ``chunks`` [(q0, q1, key slots)] for the others.
    For the CuPy kernels (block_tables, seq_lens and cu_seqlens_q None), int32 on the device:
    ``decodes`` (query rows, block tables, lengths, padded as :func:`_padded_decodes` says,
    and how many of the rows are the step's) of the one-query chunks, ``prefills``
    (query rows, block tables, lengths, offsets, longest chunk: it sizes the prefill's grid)
    of the others; None where the step has none; query rows None where the part is the whole
    step (its queries are q itself, no gather).
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_host: np.ndarray
    decode: tuple = ()
    chunks: tuple = ()
    decodes: tuple | None = None
    prefills: tuple | None = None


def upload(parts, device, dtype=np.int64):
    """Host integer arrays -> device tensors of ``dtype`` and the same shapes, in one copy.

    A copy from pageable host memory to a GPU waits until the stream has run everything
    queued before it (PyTorch's ``copy_`` with ``non_blocking=False`` ends in
    ``memcpy_and_sync``, a stream synchronize: c10/cuda/CUDAFunctions.h, code).  So a step
    makes its copies before it queues any work, while the device is idle: a copy between the
    layers would hold the host until the device had run them.
    """
    flat = np.concatenate([np.asarray(p, dtype).ravel() for p in parts])
    dev = torch.from_numpy(flat).to(device)
    out, at = [], 0
    for p in parts:
        p = np.asarray(p)
        out.append(dev[at:at + p.size].view(p.shape))
        at += p.size
    return out


#: decodes are padded to their group's longest length; groups split at powers of two from this
#: length up, so padding at most doubles a group's keys (a batch padded to its one longest
#: sequence reads, for a ShareGPT-like mix of lengths, several times the keys it needs)
DECODE_BUCKET_MIN = 256


def decode_buckets(lens) -> list:
    """The torch reference's decode groups: indices into ``lens`` whose lengths share a
    power-of-two bucket (all below :data:`DECODE_BUCKET_MIN` in one), shortest first."""
    lens = np.asarray(lens, np.int64)
    key = np.ceil(np.log2(np.maximum(lens, DECODE_BUCKET_MIN))).astype(np.int64)
    return [np.flatnonzero(key == b) for b in np.unique(key)]


def _plan(rows, slots, tables, lens, chunk_lens, block_size, backend, device) -> StepPlan:
    """Upload a step's books; for the torch reference, also which key slots each query reads."""
    cu = np.concatenate([[0], np.cumsum(chunk_lens)]).astype(np.int64)
    every = np.array_equal(rows, np.arange(cu[-1]))                  # rows None: all, in order
    if backend == "cupy":                             # the kernels take their own parts (_plan_kernels)
        rows_t, slots_t = upload([rows, slots], device)
        return _plan_kernels(StepPlan(None if every else rows_t, slots_t, None, None, None, cu), tables, lens,
                             chunk_lens, device)
    c = np.asarray(chunk_lens, np.int64)
    one = np.flatnonzero(c == 1)
    d_rows, d_seqs = cu[one], one
    rows_t, slots_t, tables_t, lens_t, cu_t, dq_t, ds_t = upload([rows, slots, tables, lens, cu, d_rows, d_seqs],
                                                                  device)
    plan = StepPlan(None if every else rows_t, slots_t, tables_t, lens_t, cu_t, cu)

    def key_slots(table_rows, length):           # slot of key j: table[j // block_size] * block_size + j % bs
        j = torch.arange(length, device=device)
        return table_rows[..., j // block_size] * block_size + j % block_size

    groups = []
    for idx in decode_buckets(lens[one]) if len(one) else ():
        q_rows, seqs = dq_t[idx], ds_t[idx]
        width = int(lens[one[idx]].max())
        keys = key_slots(tables_t[seqs], width)                           # (B_g, width)
        valid = torch.arange(width, device=device)[None, :] < lens_t[seqs][:, None]
        keys = torch.where(valid, keys, keys[:, :1])     # padding reads a written slot (no NaN), masked out
        groups.append((q_rows, keys, valid[:, None, None, :]))
    plan.decode = tuple(groups)
    plan.chunks = tuple((int(cu[i]), int(cu[i + 1]), key_slots(tables_t[i], int(lens[i])))
                        for i in np.flatnonzero(c > 1).tolist())
    return plan


#: a step's decodes go to the CuPy paged decode as a batch padded to a multiple of this many
#: rows, with block tables padded to a power-of-two width: the kernel's plan, keyed by those
#: shapes (:mod:`iokernels.cupy_raw.plans`), is then made once and reused over many steps
#: instead of made again every step as sequences join, leave and grow.  A padding row has
#: length 0: its program reads no key, and its output is dropped.
DECODE_ROWS_GRANULE = 64


def _padded_decodes(q_rows, tables, lens) -> tuple:
    """(query rows, block tables, lengths) of a step's decodes padded as DECODE_ROWS_GRANULE says:
    padding rows read query row 0 with length 0, padding columns repeat a row's first block."""
    n, width = tables.shape
    rows = -(-max(n, 1) // DECODE_ROWS_GRANULE) * DECODE_ROWS_GRANULE
    cols = 1 << max(width - 1, 0).bit_length()
    padded = np.zeros((rows, cols), tables.dtype)
    padded[:n, :width] = tables
    padded[:n, width:] = tables[:, :1]
    return (np.concatenate([q_rows, np.zeros(rows - n, q_rows.dtype)]), padded,
            np.concatenate([lens, np.zeros(rows - n, lens.dtype)]))


def _plan_kernels(plan, tables, lens, chunk_lens, device) -> StepPlan:
    """The CuPy kernels' parts of a step: the decodes (padded: :func:`_padded_decodes`) and the
    longer chunks, int32, one copy."""
    c = np.asarray(chunk_lens, np.int64)
    dec, pre = np.flatnonzero(c == 1), np.flatnonzero(c > 1)
    cp = c[pre]
    p_cu = np.concatenate([[0], np.cumsum(cp)])
    p_rows = np.arange(p_cu[-1]) + np.repeat(plan.cu_host[pre] - p_cu[:-1], cp)   # each chunk's rows, packed
    d_parts = _padded_decodes(plan.cu_host[dec], tables[dec], lens[dec]) if len(dec) else ([], [], [])
    parts = [*d_parts, p_rows, tables[pre], lens[pre], p_cu]
    d_rows, d_tab, d_lens, p_rows_t, p_tab, p_lens, p_cu_t = upload(parts, device, np.int32)
    whole = len(dec) == len(c) == len(d_rows)         # the part is the whole step, unpadded: q itself
    if len(dec):
        plan.decodes = (None if whole else d_rows.long(), d_tab, d_lens, len(dec))
    if len(pre):
        plan.prefills = (None if not len(dec) else p_rows_t.long(), p_tab, p_lens, p_cu_t, int(cp.max()))
    return plan


class _DeviceAttention:
    """What both device memories do per layer: store the chunk's rows, then attend."""

    k_pools: torch.Tensor
    v_pools: torch.Tensor
    block_size: int
    backend: str
    kernel: tuple | None                              # "cupy": (paged prefill, paged decode)

    def write_attend(self, layer, plan: StepPlan, q, k, v):
        """Store this layer's K, V rows (total_q, Hkv, d) at the plan's slots; the chunks' attention output."""
        k_flat, v_flat = (p[layer].view(-1, *p.shape[2:]) for p in (self.k_pools, self.v_pools))
        k_flat[plan.slots] = k if plan.rows is None else k[plan.rows]
        v_flat[plan.slots] = v if plan.rows is None else v[plan.rows]
        if self.backend == "cupy":
            return self._attend_kernels(layer, plan, q)
        return _attend_torch(q, k_flat, v_flat, plan)

    def _attend_kernels(self, layer, plan: StepPlan, q):
        """The CuPy kernels: the decodes in one paged decode, the longer chunks in one paged prefill."""
        prefill, decode = self.kernel
        k_pool, v_pool = (p[layer].view(-1, self.block_size, *p.shape[2:]) for p in (self.k_pools, self.v_pools))
        o = None
        if plan.decodes is not None:
            rows, tables, lens, n = plan.decodes
            od, _ = decode(q if rows is None else q[rows], k_pool, v_pool, tables, lens)
            od = torch.as_tensor(od, device=q.device)
            if rows is None:
                return od
            o = torch.empty_like(q)
            o[rows[:n]] = od[:n]                      # the padding rows' outputs are dropped
        if plan.prefills is not None:
            rows, tables, lens, cu, longest = plan.prefills
            # the longest chunk sizes the kernel's grid (the offsets stay on the device, unread)
            op, _ = prefill(q if rows is None else q[rows], k_pool, v_pool, tables, lens, cu, causal=True,
                            max_seqlen_q=longest)
            op = torch.as_tensor(op, device=q.device)
            if rows is None:
                return op
            o[rows] = op
        return o

    def attend(self, layer, q, seqs, chunk_lens):
        """A host memory's per-layer call; a device memory attends in :meth:`write_attend`."""
        raise TypeError(f"{type(self).__name__}: attend through write_attend(layer, prepare(seqs, chunk_lens, "
                        f"token_ids), q, k, v), on the device")


def _attend_torch(q, k_flat, v_flat, plan):
    """The reference: gather each sequence's keys through its table, SDPA bottom-right causal."""
    o = torch.empty_like(q)
    hq, hkv, d = q.shape[1], k_flat.shape[1], q.shape[2]
    for q_rows, keys, valid in plan.decode:           # one query each: it sees every key; a call a group
        kd, vd = (x[keys].transpose(1, 2) for x in (k_flat, v_flat))       # (B_d, Hkv, max_len, d)
        # GQA packed: the hq / hkv query heads of a KV head are rows of one (B_d, Hkv) problem
        # (query head h reads KV head h // (hq / hkv)), so K and V are never repeated per query head
        qd = q[q_rows].view(-1, hkv, hq // hkv, d)
        od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=valid)
        o[q_rows] = od.reshape(-1, hq, d)
    for q0, q1, keys in plan.chunks:                  # a longer chunk: bottom-right causal, a call each
        qc = q[q0:q1].transpose(0, 1)[None]
        kc, vc = (x[keys].transpose(0, 1)[None] for x in (k_flat, v_flat))
        o[q0:q1] = sdpa(qc, kc, vc, causal=True)[0].transpose(0, 1)
    return o


class DevicePagedMemory(_DeviceAttention, PagedMemory):
    """A :class:`PagedMemory` with device pools: one :class:`SlotMap` keeps the books for every layer.

    ``caches`` is that one SlotMap, so the scheduler's accounting (``growth``,
    ``free_blocks``, ``usage``, fork, release) is PagedMemory's, unchanged.
    """

    def __init__(self, num_blocks, block_size, *, layers, kv_heads, head_dim, dtype="float64", device="cpu",
                 backend="torch"):
        self.backend, self.kernel = _check_backend(backend)
        self.device, self.dtype = torch.device(device), _dtype(dtype)
        self.k_pools, self.v_pools = _pools(layers, num_blocks * block_size, kv_heads, head_dim, self.dtype,
                                            self.device)
        views = [p.view(layers, num_blocks, block_size, kv_heads, head_dim) for p in (self.k_pools, self.v_pools)]
        self.cache = SlotMap(num_blocks, block_size, *views)
        self.caches = [self.cache]
        self.num_blocks, self.block_size, self.layers = self.cache.num_blocks, self.cache.block_size, layers
        self._placed: dict = {}                       # handle -> (rows, slots) of its last write (checksum model)

    def prepare(self, seqs, chunk_lens, token_ids) -> StepPlan:
        """The step's books, once for every layer: place each chunk's rows, then upload the plan."""
        sids = [s.handle for s in seqs]
        rows, slots = self.cache.place_step(sids, chunk_lens, token_ids)
        tables, lens = self.cache.tables_of(sids)
        tables = np.where(tables < 0, tables[:, :1], tables)   # padding names a block of the sequence's own
        return _plan(rows, slots, tables, lens, list(chunk_lens), self.block_size, self.backend, self.device)

    def growths(self, seqs, tokens) -> list:
        """:meth:`~.memory.PagedMemory.growth` of every (sequence, tokens) pair, read from the rows at once."""
        return self.cache.growths([s.handle for s in seqs], tokens).tolist()

    def usage(self) -> tuple[int, int]:
        """:meth:`~.memory.PagedMemory.usage`, read from the rows at once."""
        return self.cache.written_slots(), self.block_size * (self.num_blocks - self.cache.num_free_blocks())

    def write(self, layer, seq, k_rows, v_rows, token_ids) -> None:
        """One sequence's rows, NumPy or torch (the checksum model's call): layer 0 does the books."""
        if layer == 0:
            self._placed[seq.handle] = self.cache.place(seq.handle, len(k_rows), token_ids)
        rows, slots = (torch.from_numpy(x).to(self.device) for x in self._placed[seq.handle])
        for pool, x in ((self.k_pools, k_rows), (self.v_pools, v_rows)):
            pool[layer][slots] = torch.as_tensor(x, device=self.device).to(self.dtype)[rows]

    def read(self, layer, seq):
        """The sequence's K and V rows (n, Hkv, d), on the device, read through its table."""
        n, table = self.cache.seq_len(seq.handle), self.cache.block_table(seq.handle)
        slots = (np.asarray(table)[:, None] * self.block_size + np.arange(self.block_size)).ravel()[:n]
        idx = torch.from_numpy(slots).to(self.device)
        return self.k_pools[layer][idx], self.v_pools[layer][idx]

    def release(self, seq) -> None:
        self._placed.pop(seq.handle, None)
        super().release(seq)


class DeviceContiguousMemory(_DeviceAttention, ContiguousMemory):
    """A :class:`ContiguousMemory` with device arenas; each reservation is a whole number of blocks."""

    def __init__(self, capacity_slots, *, block_size=16, layers, kv_heads, head_dim, dtype="float64", device="cpu",
                 backend="torch"):
        if capacity_slots % block_size:
            raise ValueError(f"capacity_slots: {capacity_slots} is not a whole number of blocks of {block_size}")
        self.backend, self.kernel = _check_backend(backend)
        self.device, self.dtype = torch.device(device), _dtype(dtype)
        self.capacity_slots, self.block_size = int(capacity_slots), int(block_size)
        self.k_pools, self.v_pools = _pools(layers, self.capacity_slots, kv_heads, head_dim, self.dtype,
                                            self.device)
        self.k, self.v = list(self.k_pools), list(self.v_pools)    # ContiguousMemory's per-layer arenas (views)
        self._holes = [(0, self.capacity_slots)]
        self._regions: dict[int, list] = {}
        self._next = 0

    def reservation(self, request) -> int:
        return blocks_needed(request.max_len, self.block_size) * self.block_size

    def prepare(self, seqs, chunk_lens, token_ids) -> StepPlan:
        """The step's books: each chunk's rows go to the next slots of its range; every layer's count moves."""
        starts, before = [], []
        for s, c in zip(seqs, chunk_lens):
            start, done = self._regions[s.handle]
            starts.append(start)
            before.append(done[0])
            done[:] = [done[0] + c] * len(done)
        bs, c = self.block_size, np.asarray(chunk_lens, np.int64)
        starts, before = np.array(starts, np.int64), np.array(before, np.int64)
        cu, lens = np.concatenate([[0], np.cumsum(c)]), before + c
        slots = np.repeat(starts + before - cu[:-1], c) + np.arange(cu[-1])   # start + done + 0, 1, ...
        blocks = -(-lens // bs)                                              # a table: its range's blocks,
        table = starts[:, None] // bs + np.minimum(np.arange(blocks.max()), blocks[:, None] - 1)  # last repeated
        return _plan(np.arange(cu[-1]), slots, table, lens, list(chunk_lens), bs, self.backend, self.device)

    def write(self, layer, seq, k_rows, v_rows, token_ids) -> None:
        """One sequence's rows, NumPy or torch (the checksum model's call)."""
        k, v = (torch.as_tensor(x, device=self.device).to(self.dtype) for x in (k_rows, v_rows))
        super().write(layer, seq, k, v, token_ids)
