"""The paged gather over device pools planned once per pool shape (:mod:`.plans` says why and how).

Once, when the plan is made: the pools' checks, the version and its config, whether the pools
need a contiguous copy, the copy unit (16-byte chunks where the rows and pointers allow) and
its compiled kernel, the SM count, the argument template, and the kind of block table: a
contiguous int32 device table of the pools' kind (used in place: its values are not read on
the host, so it may be rewritten between runs or graph replays) or a host one (checked on
every run and uploaded once per distinct content).  Per call, ``run`` checks the length
(``seq_len`` is not part of the plan, so one plan serves a sequence as it grows), allocates
K and V (Hkv, seq_len, d), sizes the grid and launches.  With a device table nothing in
``run`` synchronizes the host or copies host memory, so it can be captured in a CUDA graph;
a host table is refused under capture (the graph would replay the ids of the capture), and so
are CuPy pools that need a contiguous copy (CuPy's pool takes the copy back after the call).
"""
from __future__ import annotations

import numpy as np

from ..core.arrays import Call, DeviceArray, device_array
from .decode import check_pools
from .gather import check_seq_len, gather_grid, gather_kernel, host_table, run_paged_gather, short_table, table_ids
from .launch import contiguous, device_info
from .plans import NotPlanned, _Alloc, _kind, _lens_key, _pin_if_capturing, _ptrs, _stream_of, array_key, plan_for
from .policy import gather_chunk_bytes
from .registry import REGISTRY, need

#: the placeholder length of the argument template (replaced by each run's seq_len)
_LEN_SLOT = np.int32(0x7EADBEEF)
_HOST_TABLE = ("block_table: a CUDA graph reads the table when it replays; pass it as a contiguous device int32 "
               "array (a host table is baked in at capture)")


def gather_key(k_pool, v_pool, block_table, config):
    """The plan-cache key of a gather_pools call, or None when it takes no plan (NumPy pools)."""
    kk = array_key(k_pool)
    if kk is None:
        return None
    return ("paged_gather", REGISTRY.generation, kk, array_key(v_pool), _lens_key(block_table), config)


class GatherPlan:
    """One sequence's K, V copied out of device pools (num_blocks, block_size, Hkv, d) (torch
    CUDA or CuPy) through its block table, planned once: the arguments of
    :func:`iokernels.cupy_raw.gather_pools` but the length.  ``run(k_pool, v_pool, block_table,
    seq_len)`` launches on the caller's current stream and returns contiguous (Hkv, seq_len, d)
    K, V of the pools' kind."""

    def __init__(self, k_pool, v_pool, block_table, seq_len, *, config=None):
        nb, bs, hkv, d, dtype = check_pools(k_pool, v_pool)
        if array_key(k_pool) is None:
            raise NotPlanned("k_pool: plans take device arrays (torch CUDA or CuPy)")
        Call(k_pool, name="k_pool").check(v_pool, "v_pool")
        spec, cfg = REGISTRY.resolve("paged_gather", config, need("paged_gather", k=k_pool, v=v_pool))
        if spec.launcher is not run_paged_gather:
            raise NotPlanned("this version has its own launcher")
        host = isinstance(block_table, (np.ndarray, list, tuple))
        if not host:
            if array_key(block_table) is None or _kind(block_table) != _kind(k_pool):
                raise NotPlanned("block_table: not a device table of the pools' kind")
            t = device_array(block_table)
            if len(t.shape) != 1 or t.dtype != "int32" or not t.c_contiguous():
                raise NotPlanned("block_table: device tables other than contiguous int32 (n,) are read on the host")
        self.device_table = not host
        self.key = (array_key(k_pool), array_key(v_pool), _lens_key(block_table))
        self.nb, self.bs, self.hkv, self.d, self.dtype = nb, bs, hkv, d, dtype
        self.config, self.record = cfg, spec
        self.alloc = _Alloc(k_pool)
        self.pinned = False                              # set once a CUDA graph captures a run
        kd, vd = device_array(k_pool), device_array(v_pool)
        self.copy = (not kd.c_contiguous(), not vd.c_contiguous())
        if self.copy[0]:
            kd = device_array(contiguous(k_pool))
        if self.copy[1]:
            vd = device_array(contiguous(v_pool))
        self.under_capture = _HOST_TABLE if host else None
        if any(self.copy) and not self.alloc.torch:     # CuPy's pool takes a copy back after the call
            self.under_capture = (f"{'k_pool' if self.copy[0] else 'v_pool'}: a CUDA graph would replay its "
                                  f"contiguous copy into memory CuPy frees after the capture; pass contiguous pools")
        self.itemsize, self.row_bytes = kd.itemsize, d * kd.itemsize
        self.empty = hkv * d == 0
        self.sms = device_info()["sms"]
        # the copy unit when the outputs start on 16 bytes (the allocators' blocks do); a run
        # whose pointers allow less takes the unit they allow
        self.chunk = gather_chunk_bytes(self.row_bytes, self.itemsize, (kd.ptr, vd.ptr, 16, 16))
        self._kernels: dict = {}
        slot = DeviceArray(0, kd.shape, kd.strides, dtype, kd.itemsize, None)
        self.template = spec.args(slot, slot, slot, slot, slot, _LEN_SLOT)
        self.where_len = [i for i, a in enumerate(self.template) if type(a) is np.int32 and a == _LEN_SLOT][0]
        self.where = [i for i, a in enumerate(self.template) if type(a) is np.uint64]
        self._table_arg(block_table, check_seq_len(seq_len), k_pool)    # a bad first call keeps no plan

    def _kernel(self, chunk: int):
        got = self._kernels.get(chunk)
        if got is None:
            _, fn, threads = gather_kernel(self.config, self.bs, self.row_bytes, chunk)
            got = self._kernels[chunk] = (fn, threads)
        return got

    def _table_arg(self, block_table, seq_len: int, like):
        """The table's device object for ``seq_len`` tokens (checked: a host one in full, a device
        one for its length)."""
        if self.device_table:
            n = int(block_table.shape[0])
            if n * self.bs < seq_len:
                raise short_table(-(-seq_len // self.bs), seq_len, (n,), "int32")
            return block_table
        return Call(like, name="k_pool").constant(table_ids(host_table(block_table, seq_len, self.nb, self.bs)))

    def run(self, k_pool, v_pool, block_table, seq_len, *, check: bool = True):
        """Launch on the caller's current stream; (K, V) (Hkv, seq_len, d) of the pools' kind."""
        if check and (array_key(k_pool), array_key(v_pool), _lens_key(block_table)) != self.key:
            raise ValueError(f"k_pool: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        seq_len = check_seq_len(seq_len)
        _, sobj = _stream_of(k_pool)
        _pin_if_capturing(self, sobj, self.under_capture)
        table = self._table_arg(block_table, seq_len, k_pool)
        k_out = self.alloc.empty((self.hkv, seq_len, self.d), self.dtype)
        v_out = self.alloc.empty((self.hkv, seq_len, self.d), self.dtype)
        if seq_len == 0 or self.empty:
            return k_out, v_out
        if self.copy[0]:
            k_pool = contiguous(k_pool)
        if self.copy[1]:
            v_pool = contiguous(v_pool)
        ptrs = _ptrs(self.alloc.torch, k_pool, v_pool, table, k_out, v_out)
        chunk = self.chunk
        if (int(ptrs[0]) | int(ptrs[1]) | int(ptrs[3]) | int(ptrs[4])) % chunk:
            chunk = gather_chunk_bytes(self.row_bytes, self.itemsize, tuple(int(p) for p in ptrs[:2] + ptrs[3:]))
        fn, threads = self._kernel(chunk)
        args = list(self.template)
        w = self.where
        args[w[0]], args[w[1]], args[w[2]], args[w[3]], args[w[4]] = ptrs
        args[self.where_len] = np.int32(seq_len)
        grid = gather_grid(self.config, threads, self.hkv * seq_len * (self.row_bytes // chunk), self.sms)
        with sobj:
            fn((grid,), (threads,), tuple(args))
        return k_out, v_out


def cached_gather_pools(k_pool, v_pool, block_table, seq_len, *, config=None):
    """gather_pools through :data:`.plans.PLANS`: (K, V), or NotImplemented without a plan."""
    plan = plan_for(lambda: gather_key(k_pool, v_pool, block_table, config),
                    lambda: GatherPlan(k_pool, v_pool, block_table, seq_len, config=config))
    if plan is None:
        return NotImplemented
    return plan.run(k_pool, v_pool, block_table, seq_len, check=False)
