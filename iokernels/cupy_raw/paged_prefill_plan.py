"""The paged prefill over device pools planned once per shape (:mod:`.plans` says why and how).

Once, when the plan is made: the checks of q, the pools and the settings, the version and its
config (tiles resolved for the GPU's SRAM and the batch's mean chunk in tile rows), the defines
and the compiled kernel, its shared memory and threads, the grid rule (a block a query head,
or, where the version packs the g query heads of a KV head into one Q tile, a block a KV
head), the argument template, and the kind of each of ``block_tables``, ``seq_lens`` and
``cu_seqlens_q``: a contiguous int32 device array of q's kind (used in place: its values are
never read on the host, so it may be rewritten between runs or graph replays) or host values
(checked on every run as the eager call checks them, then uploaded once per distinct content).

Per call, ``run`` checks ``max_seqlen_q`` (not part of the plan: a server's scheduler passes
each step's longest chunk, and one plan serves every step of a shape), allocates O and LSE,
sizes the grid and launches.  With all three on the device nothing in ``run`` synchronizes the
host or copies host memory, so it can be captured in a CUDA graph; host values are refused
under capture (the graph would replay the values of the capture).  The grid of a captured run
is the one of its capture: pass a ``max_seqlen_q`` that bounds every replay's chunks (None:
total_q, which always does).

The Hopper v3 (a :class:`.hopper.paged_prefill.HopperPagedPrefillConfig` naming it) is planned by
the same class: its checks are its eager call's (:func:`.hopper.paged_prefill.checked`, so a bad
call raises the same from either), and its kernel takes TMA tensor maps of q and the pools, which
encode their addresses: the arguments are made once per (q, k_pool, v_pool) address set and kept
for the last few (:func:`.attention_plan.mapped_args`, as the Hopper forward's and the backward's
plans do), so a layer loop over a fixed set of pools encodes each layer's maps once.  Encoding a
map is host work only, so a run under capture may make one.

Calls the plans cannot take run eagerly (:func:`.paged_prefill.paged_prefill_pools`, or v3's
:func:`.hopper.paged_prefill.paged_prefill_pools`): NumPy q or pools, rows of q or a pool whose
last axis is not unit-stride, or for v3 not on 16 bytes (the eager call copies them).

For a loop over layers (each layer's pools have the same shape), make the plan once::

    plan = PagedPrefillPlan(q, k_pools[0], v_pools[0], tables, lens, cu_q, max_seqlen_q=longest)
    for layer in range(num_layers):
        o, lse = plan.run(q[layer], k_pools[layer], v_pools[layer], tables, lens, cu_q, max_seqlen_q=longest)
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, DeviceArray, device_array
from .attention_plan import _SLOT, _slots, mapped_args
from .config import CHUNK_BYTES
from .decode import check_pools
from .hopper.config import BLOCK_M
from .hopper.paged_prefill import checked as v3_checked, names_v3, tma_ready
from .launch import HOPPER_OPTIONS, HOPPER_SOURCES, device_info, function
from .paged_prefill import paged_prefill, tile_rows_per_token
from .paged_prefill_args import call_values, check_max_seqlen, check_q, table_or_one
from .plans import NotPlanned, _Alloc, _lens_key, _pin_if_capturing, _ptrs, _stream_of, array_key, plan_for
from .registry import REGISTRY, need

__all__ = ["PagedPrefillPlan", "paged_prefill_key", "cached_paged_prefill_pools"]

#: the names of the values a plan reads on the device, in the kernel's order
_VALUES = ("block_tables", "seq_lens", "cu_seqlens_q")
#: how a checked host value is uploaded: the tables at least one column wide (a batch of empty
#: sequences still passes a valid pointer), lengths and offsets as int32
_UPLOADS = (table_or_one, lambda lens: lens.astype(np.int32), lambda cq: cq.astype(np.int32))


def _host_refused(name: str) -> str:
    """What a capture refuses: host tables, lengths or offsets (a graph would replay the values of
    the capture); ``name``, the first one given on the host."""
    return (f"{name}: a CUDA graph reads the tables, lengths and offsets when it replays; pass them as device "
            f"int32 arrays (host ones are baked in at capture)")


def paged_prefill_key(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal, scale, config):
    """The plan-cache key of a paged_prefill_pools call, or None when it takes no plan (NumPy q)."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("paged_prefill", REGISTRY.generation, kq, array_key(k_pool), array_key(v_pool),
            _lens_key(block_tables), _lens_key(seq_lens), _lens_key(cu_seqlens_q),
            type(causal), causal, type(scale), scale, config)


class PagedPrefillPlan:
    """Paged prefill of a packed batch of chunks over device pools (num_blocks, block_size, Hkv,
    d), planned once: the arguments of :func:`iokernels.cupy_raw.paged_prefill_pools`, q and the
    pools device arrays (torch CUDA or CuPy) of one kind.  ``run(q, k_pool, v_pool,
    block_tables, seq_lens, cu_seqlens_q, max_seqlen_q=None)`` launches on the caller's current
    stream and returns (O (total_q, Hq, d), LSE (Hq, total_q)) of q's kind.  Every version of
    the registry's paged_prefill records is planned the same way; ``config`` picks one (a
    :class:`.PagedPrefillConfig`, or a :class:`.HopperPagedPrefillConfig` naming v3, whose
    checks are the Hopper launcher's and whose arguments hold tensor maps)."""

    def __init__(self, q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                 config=None, max_seqlen_q=None):
        self.hopper = names_v3(config)
        if not self.hopper:
            nb, bs, Hkv, d, dtype = check_pools(k_pool, v_pool)
            check_q(q, Hkv, d, dtype)
            if array_key(q) is None:
                raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
            spec, cfg = REGISTRY.resolve("paged_prefill", config, need("paged_prefill", q=q, k=k_pool, v=v_pool))
            self.hopper, config = names_v3(cfg), cfg     # a default that is the Hopper v3 takes its path
            if not self.hopper:
                if spec.launcher is not paged_prefill:
                    raise NotPlanned("this version has its own launcher")
                self.causal = cv.check_bool(causal, "causal")
                self.scale = cv.resolve_scale(scale, d)
                call = Call(q)
        if self.hopper:                                  # v3's checks, in its eager call's order
            call, (nb, bs, Hkv, d, dtype), self.causal, self.scale, values, spec, cfg = v3_checked(
                q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal, scale=scale, config=config,
                max_seqlen_q=max_seqlen_q)                   # a bad first call keeps no plan
            if array_key(q) is None:
                raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        if array_key(k_pool) is None or array_key(v_pool) is None:
            raise NotPlanned("k_pool, v_pool: host pools are copied in by the eager call")
        call.check(k_pool, "k_pool")
        call.check(v_pool, "v_pool")
        qd, kd, vd = device_array(q), device_array(k_pool), device_array(v_pool)
        if self.hopper and not all(tma_ready(a) for a in (qd, kd, vd)):
            raise NotPlanned("q, k_pool, v_pool: rows TMA cannot read in place are copied by the eager call")
        if any(a.shape[-1] > 1 and a.strides[-1] != 1 for a in (qd, kd, vd)):
            raise NotPlanned("q, k_pool, v_pool: rows that are not unit-stride are copied by the eager call")
        total_q, Hq = int(q.shape[0]), int(q.shape[1])
        if not self.hopper:
            values = call_values(call, block_tables, seq_lens, cu_seqlens_q, nb, bs, total_q, max_seqlen_q)
        modes, B, max_blocks, _, _, _, _ = values       # a bad first call keeps no plan
        self.modes, self.device_values = modes, all(modes)
        host = [n for n, on_device in zip(_VALUES, modes) if not on_device]
        self.under_capture = _host_refused(host[0]) if host else None
        self.key = (array_key(q), array_key(k_pool), array_key(v_pool), _lens_key(block_tables),
                    _lens_key(seq_lens), _lens_key(cu_seqlens_q))
        self.nb, self.bs, self.B, self.total_q, self.Hq, self.Hkv, self.d = nb, bs, B, total_q, Hq, Hkv, d
        self.dtype = dtype
        self.acc = "float32" if self.hopper else cv.accum_dtype(dtype).name
        self.record = spec
        self.alloc = _Alloc(q)
        self.pinned = False                              # set once a CUDA graph captures a run
        self.empty = B * total_q * Hq == 0
        itemsize = qd.itemsize
        # placeholders _SLOT + j of q, the pools, tables, lengths, offsets, O, LSE (replaced on every run)
        i32 = "int32"
        slots = [DeviceArray(_SLOT + j, a.shape, a.strides, dtype, itemsize, None) for j, a in enumerate((qd, kd, vd))]
        slots += [DeviceArray(_SLOT + 3, (B, max(max_blocks, 1)), (max(max_blocks, 1), 1), i32, 4, None),
                  DeviceArray(_SLOT + 4, (B,), (1,), i32, 4, None),
                  DeviceArray(_SLOT + 5, (B + 1,), (1,), i32, 4, None),
                  DeviceArray(_SLOT + 6, (total_q, Hq, d), (Hq * d, d, 1), dtype, itemsize, None),
                  DeviceArray(_SLOT + 7, (Hq, total_q), (total_q, 1), self.acc, 4, None)]
        if self.hopper:
            # a block a (128 packed rows, KV head, sequence); q's and the pools' tensor maps encode
            # their addresses, so the arguments are made per address set (mapped_args)
            self.config = cfg
            self.rows_per_token, self.block_q, self.heads = Hq // Hkv, BLOCK_M, Hkv
            self.smem = cfg.smem_bytes(d)
            self.fn = function(spec.file, spec.kernel, cfg.defines(d, dtype, bs), self.smem, options=HOPPER_OPTIONS,
                               sources=HOPPER_SOURCES)
            self._maps: OrderedDict = OrderedDict()
            self._outs = slots[3:]
            self._margs = dict(dtype=dtype, config=cfg, max_blocks=max(max_blocks, 1), scale=self.scale,
                               causal=self.causal)
        else:
            self.rows_per_token = tile_rows_per_token(spec, Hq // Hkv)
            self.config = cfg.resolve(d, device_info()["smem_optin"], self.rows_per_token * total_q / max(B, 1))
            self.block_q, self.heads = self.config.block_q, Hq // self.rows_per_token
            # O is allocated contiguous (total_q, Hq, d): its rows start on 16 bytes where d's do
            o_aligned = all(s * itemsize % CHUNK_BYTES == 0 for s in (Hq * d, d))
            vec = o_aligned and all(a.aligned(CHUNK_BYTES) for a in (qd, kd, vd))
            self.smem = self.config.smem_bytes(d)
            self.fn = function(spec.file, spec.kernel, self.config.defines(d, dtype, bs, vec_io=vec), self.smem)
            self.template = spec.args(*slots, max_blocks=max(max_blocks, 1), scale=self.scale, causal=self.causal)
            self.where = _slots(self.template, range(8))
        self.threads = (self.config.threads(),)

    def _v3_template(self, q, k_pool, v_pool):
        """v3's arguments for these q and pools (their tensor maps), placeholders for the rest."""
        template = self.record.args(*(device_array(x, self.dtype) for x in (q, k_pool, v_pool)), *self._outs,
                                    **self._margs)
        return template, _slots(template, range(3, 8))

    def run(self, q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, max_seqlen_q=None,
            check: bool = True):
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(k_pool), array_key(v_pool), _lens_key(block_tables),
                      _lens_key(seq_lens), _lens_key(cu_seqlens_q)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        if self.device_values:
            if max_seqlen_q is None:
                longest = self.total_q
            else:
                check_max_seqlen(max_seqlen_q, self.total_q)
                longest = int(max_seqlen_q)
        else:
            call = Call(q)
            _, _, _, tables_h, lens_h, cq, longest = call_values(call, block_tables, seq_lens, cu_seqlens_q,
                                                             self.nb, self.bs, self.total_q, max_seqlen_q)
        o = self.alloc.empty((self.total_q, self.Hq, self.d), self.dtype)
        lse = self.alloc.empty((self.Hq, self.total_q), self.acc)
        if self.empty or longest == 0:
            return o, lse
        _, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, self.under_capture)
        if self.device_values:
            xs = (q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, o, lse)
            u = np.uint64             # one comprehension, not a generator resumed a pointer: a hit stays lean
            ptrs = [u(x.data_ptr()) for x in xs] if self.alloc.torch else [u(x.data.ptr) for x in xs]
        else:                                            # host ones uploaded (once per distinct content)
            vals = [device_array(x).arg if on_device else device_array(call.constant(upload(h))).arg
                    for x, on_device, h, upload in zip((block_tables, seq_lens, cu_seqlens_q), self.modes,
                                                       (tables_h, lens_h, cq), _UPLOADS)]
            ptrs = [*_ptrs(self.alloc.torch, q, k_pool, v_pool), *vals, *_ptrs(self.alloc.torch, o, lse)]
        if self.hopper:                                  # the maps of this address set: encoded once, then kept
            args = mapped_args(self._maps, (int(ptrs[0]), int(ptrs[1]), int(ptrs[2])),
                               lambda: self._v3_template(q, k_pool, v_pool), ptrs[3:])
        else:
            args = list(self.template)
            for i, p in zip(self.where, ptrs):
                args[i] = p
            args = tuple(args)
        with sobj:
            self.fn((-(-longest * self.rows_per_token // self.block_q), self.heads, self.B), self.threads,
                    args, shared_mem=self.smem)
        return o, lse


def cached_paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                               config=None, max_seqlen_q=None):
    """paged_prefill_pools through :data:`.plans.PLANS`: (O, LSE), or NotImplemented without a plan."""
    plan = plan_for(lambda: paged_prefill_key(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal, scale,
                                              config),
                    lambda: PagedPrefillPlan(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, causal=causal,
                                             scale=scale, config=config, max_seqlen_q=max_seqlen_q))
    if plan is None:
        return NotImplemented
    return plan.run(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q=max_seqlen_q, check=False)
