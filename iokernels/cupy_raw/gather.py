"""PagedAttention's block table on the GPU: the launcher of paged_gather.cu.

One sequence's K and V copied out of the paged pools (num_blocks, block_size, Hkv, d) into
contiguous (Hkv, n, d) arrays: token t lives in block ``table[t // block_size]``, row
``t % block_size`` (Kwon et al., 2023).  The kernel moves bytes, not elements: a row is
copied as 16-byte chunks where its size and alignment allow (else in the element size), so
one kernel serves every dtype.
"""
from __future__ import annotations

import numpy as np

from ..core.arrays import Call, device_array
from ..core.records import Record
from . import config as C
from .config import GatherConfig
from .decode import _check_tables, _host, check_pools
from .launch import contiguous, device_info, function, on_stream
from .policy import gather_chunk_bytes
from .registry import REGISTRY, need

def run_paged_gather(cache, sid, *, config):
    """What ``cache.gather(sid, backend="cupy")`` calls: NumPy pools in, NumPy K, V out."""
    return _gather(cache.k_pool, cache.v_pool, cache.block_table(sid), cache.seq_len(sid), config)


def paged_gather(cache, sid, *, config=None):
    """A sequence's (K, V) as contiguous (Hkv, n, d) arrays (``config``: a :class:`GatherConfig`)."""
    kernel, cfg = REGISTRY.resolve("paged_gather", config, need("paged_gather", cache=cache))
    return kernel.launcher(cache, sid, config=cfg)


def gather_pools(k_pool, v_pool, block_table, seq_len, *, config=None):
    """Paged gather: pools (num_blocks, bs, Hkv, d) + a block table -> contiguous (Hkv, n, d) K, V.

    Device pools (CuPy / torch CUDA) give device outputs of the same kind, with no copy of
    the pools; NumPy pools are copied in and the result copied out.  ``block_table``: host
    ids (checked, uploaded once per distinct content) or, with device pools, a device int32
    array used in place where it is contiguous int32 (its values are not read on the host: keep
    them in the pool), which makes the call capturable in a CUDA graph and lets the table change
    between replays.
    """
    check_pools(k_pool, v_pool)
    _, cfg = REGISTRY.resolve("paged_gather", config, need("paged_gather", k=k_pool, v=v_pool))
    return _gather(k_pool, v_pool, block_table, seq_len, cfg)


def check_seq_len(seq_len) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
        raise ValueError(f"seq_len: expected an integer >= 0, got {seq_len!r}")
    return int(seq_len)


def short_table(want: int, seq_len: int, shape, dtype) -> ValueError:
    return ValueError(f"block_table: expected at least {want} integer block ids for {seq_len} tokens, "
                      f"got shape {tuple(shape)} dtype {dtype}")


def host_table(block_table, seq_len: int, nb: int, bs: int) -> np.ndarray:
    """A host block table checked for ``seq_len`` tokens: its first ceil(seq_len / bs) ids."""
    want = -(-seq_len // bs)
    table = _host(block_table)
    if table.ndim != 1 or (table.size and table.dtype.kind not in "iu") or table.size < want:
        raise short_table(want, seq_len, table.shape, table.dtype)
    table = table[:want]
    _check_tables(table[None], np.array([seq_len]), nb, bs, "block_table")
    return table


def _gather(k_pool, v_pool, block_table, seq_len, config):
    nb, bs, hkv, d, dtype = check_pools(k_pool, v_pool)
    seq_len = check_seq_len(seq_len)
    want = -(-seq_len // bs)
    call = Call(k_pool, name="k_pool")
    device_table = not isinstance(block_table, (np.ndarray, list, tuple)) and call.kind != "numpy"
    if device_table:
        # a contiguous int32 device table is used in place (graph-safe: no host copy, no host read
        # of its values); any other is read on the host and checked there
        call.check(block_table, "block_table")
        t = device_array(block_table)
        device_table = len(t.shape) == 1 and t.dtype == "int32" and t.shape[0] >= want and t.c_contiguous()
    if not device_table:
        table = host_table(block_table, seq_len, nb, bs)
    with on_stream(call.stream_ptr()):
        # the gather reads pools as contiguous (num_blocks, block_size, Hkv, d): any other is copied
        kp = device_array(contiguous(call.to_device(k_pool, "k_pool")))
        vp = device_array(contiguous(call.to_device(v_pool, "v_pool")))
        k_out, v_out = call.empty((hkv, seq_len, d), dtype), call.empty((hkv, seq_len, d), dtype)
        t_d = block_table if device_table else call.constant(table_ids(table))
        launch_gather(kp, vp, t_d, k_out, v_out, seq_len, config=config)
    return call.finish(k_out, dtype), call.finish(v_out, dtype)


def table_ids(table: np.ndarray) -> np.ndarray:
    """What a checked host table uploads: its ids as int32 (one 0 for an empty table)."""
    return table.astype(np.int32) if len(table) else np.zeros(1, np.int32)


def gather_kernel(config: GatherConfig, block_size: int, row_bytes: int, chunk: int):
    """(record, compiled paged_gather.cu, threads a block) for rows of ``row_bytes`` copied in ``chunk``s."""
    defines = dict(BLOCK_SIZE=block_size, CHUNK_BYTES=chunk, CHUNKS_PER_ROW=row_bytes // chunk)
    rec = REGISTRY.get("paged_gather", config.version or "v1")
    return rec, function(rec.file, rec.kernel, defines), config.threads or C.GATHER_THREADS


def gather_grid(config: GatherConfig, threads: int, chunks: int, sms: int) -> int:
    """Blocks of the grid-stride loop over ``chunks`` output chunks: enough for one chunk a
    thread, at most blocks_per_sm a streaming multiprocessor."""
    per_sm = config.blocks_per_sm or C.GATHER_BLOCKS_PER_SM
    return max(1, min(-(-chunks // threads), per_sm * sms))


def launch_gather(kp, vp, t_d, k_out, v_out, seq_len, *, config=GatherConfig()):
    """The gather kernel on device arrays (pools and outputs contiguous)."""
    kp, vp, k_out, v_out, t_d = (device_array(a) for a in (kp, vp, k_out, v_out, t_d))
    nb, bs, hkv, d = kp.shape
    if seq_len == 0 or hkv * d == 0:
        return
    row_bytes = d * kp.itemsize
    chunk = gather_chunk_bytes(row_bytes, kp.itemsize, tuple(a.ptr for a in (kp, vp, k_out, v_out)))
    rec, fn, threads = gather_kernel(config, bs, row_bytes, chunk)
    grid = gather_grid(config, threads, hkv * seq_len * (row_bytes // chunk), device_info()["sms"])
    fn((grid,), (threads,), rec.args(kp, vp, t_d, k_out, v_out, seq_len))


def gather_args(kp, vp, t_d, k_out, v_out, seq_len) -> tuple:
    """paged_gather.cu: the pools, the block table, the length, the KV heads, the outputs."""
    return (kp.arg, vp.arg, t_d.arg, np.int32(seq_len), np.int32(kp.shape[2]), k_out.arg, v_out.arg)


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("cupy", "paged_gather", "v1", "paged_gather.cu", "paged_gather", GatherConfig, run_paged_gather,
           "16-byte chunks through the block table, one output chunk a thread (coalesced stores), a "
           "grid-stride loop over the sequence", rank=10, args=gather_args),
)
REGISTRY.add(*RECORDS)
