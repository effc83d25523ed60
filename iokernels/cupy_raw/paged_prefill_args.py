"""The host-side checks of a paged prefill call's arguments, for every version's launcher.

q (total_q, Hq, d) against the pools; block tables, lengths and query offsets either host
values (checked, read) or contiguous int32 device arrays of q's kind (their shapes checked,
their values never read: a call with device ones neither synchronizes the host nor copies host
memory).  Shared by :mod:`.paged_prefill` (v1, v2), :mod:`.hopper.paged_prefill` (v3) and
their plans (:mod:`.paged_prefill_plan`), so a bad call is refused in the same words whichever
version it names.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.arrays import device_array, kind_of
from .decode import check_paged_lengths


def check_q(q, heads_kv, d, dtype):
    s = tuple(getattr(q, "shape", ()))
    if len(s) != 3 or s[2] != d or s[1] < 1 or s[1] % heads_kv:
        raise ValueError(f"q: expected (total_q, a multiple of {heads_kv} heads, {d}), got {s}")
    if cv.dtype_name(q) != dtype:
        raise ValueError(f"q: dtype must equal the pools' {dtype}, got {cv.dtype_name(q)}")


def on_device(call, x, name):
    """True for a device array (then of q's kind); False for host values (NumPy, lists)."""
    if isinstance(x, (list, tuple)) or np.isscalar(x) or kind_of(x, name) == "numpy":
        return False
    call.check(x, name)
    return True


def device_ints(x, name, shape):
    """A device int32 array used in place: its shape and layout checked, its values never read."""
    a = device_array(x)
    if a.dtype != "int32" or tuple(a.shape) != tuple(shape) or not a.c_contiguous():
        raise ValueError(f"{name}: a device array must be contiguous int32 of shape {tuple(shape)}, got "
                         f"{a.dtype} {tuple(a.shape)}")
    return a


def host_offsets(cu_seqlens_q, batch, total_q, lens):
    cq = np.asarray(cv.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q), np.int64)
    if len(cq) != batch + 1:
        raise ValueError(f"cu_seqlens_q: expected {batch + 1} offsets (one more than sequences), got {len(cq)}")
    if lens is not None:
        over = np.flatnonzero(np.diff(cq) > lens)
        if over.size:
            b = int(over[0])
            raise ValueError(f"cu_seqlens_q: sequence {b} has a chunk of {int(cq[b + 1] - cq[b])} queries but "
                             f"{int(lens[b])} cached tokens; append the chunk's K and V before attending")
    return cq


def call_values(call, block_tables, seq_lens, cu_seqlens_q, nb, bs, total_q, max_seqlen_q):
    """The tables, lengths and offsets of a call, checked: ((device?) x 3, batch, table width,
    host tables, host lengths, host offsets (None where on the device), the grid's bound on a
    chunk's rows).  Device ones (of q's kind: contiguous int32 of their shapes) are not read."""
    tables_h = cq = None
    dev_t, dev_l, dev_c = (on_device(call, x, n) for x, n in ((block_tables, "block_tables"),
                                                                  (seq_lens, "seq_lens"),
                                                                  (cu_seqlens_q, "cu_seqlens_q")))
    # the batch and the table width: from shapes (device arrays) or the host values
    lens_h = None if dev_l else np.asarray(seq_lens)
    B = int(seq_lens.shape[0]) if dev_l else int(lens_h.shape[0]) if lens_h.ndim == 1 else -1
    if B < 0:
        raise ValueError(f"seq_lens: expected one length per sequence (1-D), got shape {lens_h.shape}")
    if dev_t:
        max_blocks = int(block_tables.shape[1]) if len(block_tables.shape) == 2 else -1
        device_ints(block_tables, "block_tables", (B, max(max_blocks, 0)))
        if dev_l:
            device_ints(seq_lens, "seq_lens", (B,))
        else:
            lens_h = host_lengths(lens_h, B, max_blocks * bs)
    else:
        tables_h = np.asarray(block_tables)
        if dev_l:
            device_ints(seq_lens, "seq_lens", (B,))
            if tables_h.ndim != 2 or tables_h.shape[0] != B:
                raise ValueError(f"block_tables: expected ({B}, max_blocks), got {tables_h.shape}")
            if tables_h.size and ((tables_h < 0) | (tables_h >= nb)).any():
                raise ValueError(f"block_tables: every entry must be a block of the pool, in [0, {nb})")
        else:
            tables_h, lens_h = check_paged_lengths(tables_h, lens_h, B, nb, bs)
        max_blocks = int(tables_h.shape[1])
    check_max_seqlen(max_seqlen_q, total_q)
    if dev_c:
        device_ints(cu_seqlens_q, "cu_seqlens_q", (B + 1,))
        longest = total_q if max_seqlen_q is None else int(max_seqlen_q)   # not read: the caller's bound
    else:
        cq = host_offsets(cu_seqlens_q, B, total_q, lens_h)
        longest = int(np.diff(cq).max(initial=0))
        if max_seqlen_q is not None and max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is shorter than the longest chunk, {longest} rows")
    return (dev_t, dev_l, dev_c), B, max_blocks, tables_h, lens_h, cq, longest


def check_max_seqlen(max_seqlen_q, total_q):
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, np.integer))
                                     or not 0 <= max_seqlen_q <= total_q):
        raise ValueError(f"max_seqlen_q: expected None or an integer in [0, total_q = {total_q}], got "
                         f"{max_seqlen_q!r}")


def host_lengths(lens_h, batch, cap):
    lens = lens_h.astype(np.int64)
    if lens.shape != (batch,) or np.any(lens < 0) or np.any(lens > cap):
        raise ValueError(f"seq_lens: expected {batch} lengths in [0, {cap}], got {lens.tolist()}")
    return lens


def table_or_one(tables):
    """int32 tables, at least one column (a batch of empty sequences still passes a valid pointer)."""
    t = np.ascontiguousarray(tables, np.int32)
    return t if t.ndim == 2 and t.shape[1] else np.zeros((max(len(t), 1), 1), np.int32)
