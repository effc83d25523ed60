"""MLA decode on Hopper planned once per shape (:mod:`.plans` says why and how).

Two plans: :class:`MLADecodePlan` over a contiguous latent cache, :class:`PagedMLADecodePlan`
over a paged pool with block tables (device ones used in place and refused nowhere; host ones
checked on every run and refused under capture, as the paged decode plan does).
Once, when the plan is made: the checks of q (B, Hq, 576) and the latent cache kv (B, N, 576),
the registry's availability check (compute capability 9.0, float16/bfloat16; the plan is
refused elsewhere exactly as the eager call is), the resolved config, the scale, the compiled
mla_decode.cu, the shared memory, and the kind of lengths.  Per call, ``run`` allocates O and
LSE, takes the split count (fixed with device lengths or none: planned for all N rows; with
host lengths, from the longest, kept per longest seen), the split partials of the caller's
stream (one set per plan and stream, grown, never shrunk), the tensor maps of q's and kv's
addresses (kept for the last few address pairs), and launches the kernel and, with splits,
decode.cu's combine.  With device lengths (or none) nothing in ``run`` synchronizes the host
or copies host memory, so it can be captured in a CUDA graph; host lengths are refused under
capture (the graph would replay the lengths of the capture).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from ..core.arrays import Call, DeviceArray, device_array
from . import config as C
from .attention_plan import _SLOT, _c_strides, _slots, mapped_args
from .launch import device_info, fill
from .decode import check_paged_lengths
from .mla import (COMBINE_THREADS, ROW, THREADS, _check_cache, _check_pool, _check_pool_shape, _config, _lens, _need,
                  _rows_16b, combine_kernel, default_scale, launch_splits, mla_kernel, run_mla_decode)
from .plans import (_HOST_LENS, _HOST_TABLES, PLAN_LAUNCHES_KEPT, NotPlanned, _Alloc, _device_lens, _kind, _lens_key,
                    _pin_if_capturing, _ptr, _ptrs, _stream_of, array_key, plan_for)
from .registry import REGISTRY


def mla_key(q, kv, seq_lens, num_splits, scale, config):
    """The plan-cache key of an mla_decode call, or None when it takes no plan (NumPy inputs)."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("mla_decode", REGISTRY.generation, kq, array_key(kv), _lens_key(seq_lens), type(num_splits), num_splits,
            type(scale), scale, config)


class MLADecodePlan:
    """MLA decode (absorbed form) over a contiguous latent cache, planned once: q (B, Hq, 576),
    kv (B, N, 576) device arrays (torch CUDA or CuPy) and the settings of
    :func:`iokernels.cupy_raw.mla_decode`.  ``seq_lens``: None, a contiguous device int32 (B,)
    array of q's kind (used in place) or host lengths (checked on every run, uploaded once per
    distinct content).  ``run(q, kv, seq_lens)`` launches on the caller's current stream and
    returns (O (B, Hq, 512), LSE (B, Hq)) of q's kind."""

    def __init__(self, q, kv, *, seq_lens=None, num_splits=None, scale=None, config=None):
        B, Hq, N, dtype = _check_cache(q, kv)
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        spec, cfg = REGISTRY.resolve("mla_decode", _config(config), _need(q, kv))
        if spec.launcher is not run_mla_decode:
            raise NotPlanned("this version has its own launcher")
        Call(q).check(kv, "kv")
        if seq_lens is None:
            self.lens_mode = None
        elif isinstance(seq_lens, (np.ndarray, list, tuple)):
            self.lens_mode = "host"
            _lens(seq_lens, B, N)                        # a bad first call keeps no plan
        else:
            if array_key(seq_lens) is None or _kind(seq_lens) != _kind(q):
                raise NotPlanned("seq_lens: not device lengths of q's kind")
            _device_lens(seq_lens, B)
            self.lens_mode = "device"
        self.key = (array_key(q), array_key(kv), _lens_key(seq_lens))
        self.N, self.nk, self.page, self.max_blocks = N, N, None, 0
        self._setup(q, kv, "kv", spec, cfg, B, Hq, dtype, num_splits, scale)

    def _setup(self, q, kv, kv_name: str, spec, cfg, B: int, Hq: int, dtype: str, num_splits, scale) -> None:
        """What both plans fix once the call is checked: the scale, the kernel, the splits."""
        self.B, self.Hq, self.dtype, self.num_splits = B, Hq, dtype, num_splits
        self.scale = default_scale() if scale is None else float(scale)
        self.alloc = _Alloc(q)
        self.pinned = False                              # set once a CUDA graph captures a run
        self.empty, self.no_rows = B * Hq == 0, self.page is None and self.N == 0
        self.cfg = cfg if cfg.version is not None else cfg.replace(version="v1")
        self.config, self.record = cfg, spec
        self._launches: dict = {}
        self._ws: dict = {}
        self._maps: OrderedDict = OrderedDict()
        if self.empty:
            return
        qd = device_array(q, dtype)
        if qd.strides != (Hq * ROW, ROW, 1) or not qd.aligned(16):
            raise ValueError("q: MLA decode needs a contiguous (batch, heads_q, 576) q on 16 bytes")
        _rows_16b(device_array(kv, dtype), kv_name)
        self.rec, self.fn, self.smem = mla_kernel(self.cfg, dtype, self.page)
        self.sms = device_info()["sms"]
        self.combine = combine_kernel(dtype) if num_splits != 1 else None
        if not self.no_rows:
            self._splits(self.capacity())

    def capacity(self) -> int:
        """The most rows a sequence may have: N, or max_blocks x page_size for a pool."""
        return self.N if self.page is None else self.max_blocks * self.page

    def _splits(self, longest: int) -> tuple[int, int]:
        got = self._launches.get(longest)
        if got is None:
            if len(self._launches) >= PLAN_LAUNCHES_KEPT:
                self._launches.clear()
            got = self._launches[longest] = launch_splits(self.cfg, self.B, self.Hq, longest, self.num_splits,
                                                          self.sms)
        return got

    def _workspace(self, stream: int, S: int) -> tuple:
        """(o_part, lse_part) pointers for ``S`` splits on ``stream`` (grown, never shrunk)."""
        ws = self._ws.get(stream)
        if ws is None or ws[0] < S:
            o_part = self.alloc.empty((S, self.B, self.Hq, C.MLA_LATENT), "float32")
            lse_part = self.alloc.empty((S, self.B, self.Hq), "float32")
            ws = self._ws[stream] = (S, (o_part, lse_part), (_ptr(o_part), _ptr(lse_part)))
        return ws[2]

    def _template(self, q, kv, splits: int, per_split: int) -> tuple:
        """mla_decode's arguments for these q, kv (their tensor maps) and split shape, with
        placeholders for the lengths, O, LSE, the partials and the block tables."""
        o = DeviceArray(_SLOT + 3, (self.B, self.Hq, C.MLA_LATENT), _c_strides((self.B, self.Hq, C.MLA_LATENT)),
                        "float32", 4, None)
        lse = DeviceArray(_SLOT + 4, (self.B, self.Hq), _c_strides((self.B, self.Hq)), "float32", 4, None)
        lens = None if self.lens_mode is None else DeviceArray(_SLOT + 2, (self.B,), (1,), "int32", 4, None)
        parts = (np.uint64(_SLOT + 5), np.uint64(_SLOT + 6)) if splits > 1 else (np.uint64(0), np.uint64(0))
        paged = None if self.page is None else (
            DeviceArray(_SLOT + 7, (self.B, self.max_blocks), (self.max_blocks, 1), "int32", 4, None), self.page)
        template = self.rec.args(device_array(q, self.dtype), device_array(kv, self.dtype), lens, o, lse, parts,
                                 dtype=self.dtype, scale=self.scale, splits=splits, per_split=per_split, nk=self.nk,
                                 paged=paged)
        ids = ((2,) if lens is not None else ()) + (3, 4) + ((5, 6) if splits > 1 else ()) + \
            ((7,) if paged is not None else ())
        return template, _slots(template, ids)

    def _launch(self, stream: int, q, kv, o, lse, longest: int, lens_arg: tuple, tables_arg: tuple) -> None:
        """mla_decode.cu (+ the combine with splits) on the current stream: ``lens_arg`` and
        ``tables_arg`` are () or the one pointer each template slot takes."""
        splits, per_split = self._splits(longest)
        pq, pkv, po, pl = _ptrs(self.alloc.torch, q, kv, o, lse)
        parts = self._workspace(stream, splits) if splits > 1 else ()
        args = mapped_args(self._maps, (int(pq), int(pkv), splits, per_split),
                           lambda: self._template(q, kv, splits, per_split), (*lens_arg, po, pl, *parts, *tables_arg))
        self.fn((-(-self.Hq // C.MLA_HEADS_BLOCK), splits, self.B), (THREADS,), args, shared_mem=self.smem)
        if splits > 1:
            if self.combine is None:
                self.combine = combine_kernel(self.dtype)
            self.combine((self.B * self.Hq,), (COMBINE_THREADS,), (*parts, np.int32(splits),
                                                                    np.int32(self.B * self.Hq), po, pl))

    def run(self, q, kv, seq_lens=None, *, check: bool = True):
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(kv), _lens_key(seq_lens)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        lens = _lens(seq_lens, self.B, self.N) if self.lens_mode == "host" else None
        o = self.alloc.empty((self.B, self.Hq, C.MLA_LATENT), self.dtype)
        lse = self.alloc.empty((self.B, self.Hq), "float32")
        if self.empty:
            return o, lse
        stream, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, _HOST_LENS if self.lens_mode == "host" else None)
        with sobj:
            if self.no_rows:                             # no rows at all: every row is fully masked
                fill(o, 0)
                fill(lse, -math.inf)
                return o, lse
            if lens is not None:
                self._launch(stream, q, kv, o, lse, int(lens.max(initial=0)),
                             (_ptr(Call(q).constant(lens.astype(np.int32))),), ())
            else:
                self._launch(stream, q, kv, o, lse, self.N, () if seq_lens is None else (_ptr(seq_lens),), ())
        return o, lse


class PagedMLADecodePlan(MLADecodePlan):
    """MLA decode over a paged latent pool (num_blocks, page_size, 576), planned once: the
    arguments of :func:`iokernels.cupy_raw.paged_mla_decode`, q and the pool device arrays.
    ``block_tables`` (B, max_blocks) and ``seq_lens`` (B,) are both contiguous device int32
    arrays of q's kind (used in place: a table rewritten in place between runs or graph replays
    is read as it is then; the split count is planned for max_blocks x page_size rows) or both
    host arrays (checked on every run, uploaded once per distinct content, the split count from
    the longest sequence).  ``run(q, pool, block_tables, seq_lens)`` returns (O, LSE)."""

    def __init__(self, q, pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None):
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        device = array_key(block_tables) is not None
        if device != (array_key(seq_lens) is not None) or (device and not (
                _kind(block_tables) == _kind(seq_lens) == _kind(q))):
            raise NotPlanned("block_tables, seq_lens: one on the device, one on the host, or of another kind")
        if device:
            B, Hq, nb, page, dtype = _check_pool_shape(q, pool)
            t = device_array(block_tables)
            if len(t.shape) != 2 or t.shape[0] != B or t.dtype != "int32" or not t.c_contiguous():
                raise NotPlanned("block_tables: device tables other than contiguous int32 (batch, max_blocks)")
            _device_lens(seq_lens, B)
            self.max_blocks = int(t.shape[1])
        else:
            B, Hq, page, tables, _, dtype = _check_pool(q, pool, block_tables, seq_lens)
            nb, self.max_blocks = int(pool.shape[0]), int(tables.shape[1])
        spec, cfg = REGISTRY.resolve("mla_decode", _config(config), _need(q, pool))
        if spec.launcher is not run_mla_decode:
            raise NotPlanned("this version has its own launcher")
        Call(q).check(pool, "pool")
        self.key = (array_key(q), array_key(pool), _lens_key(block_tables), _lens_key(seq_lens))
        self.lens_mode = "device" if device else "host"
        self.N, self.nk, self.page, self.nb = 0, 0, page, nb
        self._setup(q, pool, "pool", spec, cfg, B, Hq, dtype, num_splits, scale)

    def run(self, q, pool, block_tables, seq_lens, *, check: bool = True):  # type: ignore[override]
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(pool), _lens_key(block_tables), _lens_key(seq_lens)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        host = self.lens_mode == "host"
        if host:
            tables, lens = check_paged_lengths(block_tables, seq_lens, self.B, self.nb, self.page)
            if tables.shape[1] != self.max_blocks:
                raise ValueError(f"block_tables: this plan was made for {self.max_blocks} blocks a sequence, got "
                                 f"{tables.shape[1]}")
        o = self.alloc.empty((self.B, self.Hq, C.MLA_LATENT), self.dtype)
        lse = self.alloc.empty((self.B, self.Hq), "float32")
        if self.empty:
            return o, lse
        stream, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, _HOST_TABLES if host else None)
        with sobj:
            if host:
                call = Call(q)
                self._launch(stream, q, pool, o, lse, int(lens.max(initial=0)),
                             (_ptr(call.constant(lens.astype(np.int32))),),
                             (_ptr(call.constant(tables.astype(np.int32))),))
            else:
                ptab, plens = _ptrs(self.alloc.torch, block_tables, seq_lens)
                self._launch(stream, q, pool, o, lse, self.capacity(), (plens,), (ptab,))
        return o, lse


def cached_mla_decode(q, kv, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """mla_decode through :data:`.plans.PLANS`: (O, LSE), or NotImplemented without a plan."""
    plan = plan_for(lambda: mla_key(q, kv, seq_lens, num_splits, scale, config),
                    lambda: MLADecodePlan(q, kv, seq_lens=seq_lens, num_splits=num_splits, scale=scale,
                                          config=config))
    if plan is None:
        return NotImplemented
    return plan.run(q, kv, seq_lens, check=False)


def paged_mla_key(q, pool, block_tables, seq_lens, num_splits, scale, config):
    """The plan-cache key of a paged_mla_decode call, or None when it takes no plan (NumPy inputs)."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("paged_mla_decode", REGISTRY.generation, kq, array_key(pool), _lens_key(block_tables),
            _lens_key(seq_lens), type(num_splits), num_splits, type(scale), scale, config)


def cached_paged_mla_decode(q, pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None):
    """paged_mla_decode through :data:`.plans.PLANS`: (O, LSE), or NotImplemented without a plan."""
    plan = plan_for(lambda: paged_mla_key(q, pool, block_tables, seq_lens, num_splits, scale, config),
                    lambda: PagedMLADecodePlan(q, pool, block_tables, seq_lens, num_splits=num_splits, scale=scale,
                                               config=config))
    if plan is None:
        return NotImplemented
    return plan.run(q, pool, block_tables, seq_lens, check=False)
