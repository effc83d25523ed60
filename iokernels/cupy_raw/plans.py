"""Plan once per shape, run many times: the CuPy backend's launch path for device arrays.

A call of the CuPy kernels does two kinds of work.  Most of it depends only on the call's
shapes, dtypes, strides, device and settings: checking the arguments, resolving the version
and its config, the device facts, the defines, the compiled kernel, the split count, the
shared memory, the workspaces.  The rest is one launch: the arrays' pointers in the
kernel's order.  A plan does the first once, ``run`` the second on every call: the split of
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``, whose ``plan`` is called once per batch
and whose ``run`` once per layer, over a workspace buffer the wrapper owns (FlashInfer's API
documentation, docs.flashinfer.ai/api/decode.html).

The public functions (``iokernels.decode``, ``iokernels.attention``,
``iokernels.attention_backward`` and the CuPy backend's own: :mod:`.calls`) keep their
signatures and use :data:`PLANS`, a bounded cache of plans keyed by the call's shapes,
dtypes, strides, device, 16-byte alignment, array kinds, settings and the registry's
generation (a record added or removed makes every key new: :func:`decode_key`,
:func:`.attention_plan.attention_key`, :func:`.backward_plan.backward_key`,
:func:`.gather_plan.gather_key`, :func:`.mla_plan.mla_key`).  A miss builds a plan, which
runs every check (a bad call raises a ValueError naming the argument, and nothing is
cached); a hit compares one key tuple and launches.  NumPy inputs are copied in and out, so
they take the eager path (no plan).

``run`` does not rebuild the argument list either: the plan lays its kernel's arguments out
once in a host buffer, the way the driver's ``cuLaunchKernel`` reads them, and a run writes
the call's pointers into it and launches through the driver on the caller's stream
(:class:`.packed.ArgBuffer`; a CuPy ``RawKernel`` call would convert every argument again and
switch CuPy's current stream around the launch).  Runs that copy an input first, and the
Hopper forward's call with no keys, take CuPy's launch.

For loops, make the plan yourself and reuse it, say one plan per decode step for every
layer (each layer's cache has the same shape)::

    from iokernels.cupy_raw import DecodePlan
    plan = DecodePlan(q[0], k_cache[0], v_cache[0], seq_lens=lens)        # checks, compiles, allocates
    for layer in range(num_layers):
        o, lse = plan.run(q[layer], k_cache[layer], v_cache[layer], seq_lens=lens)

``run`` checks that the arrays match the plan (one key comparison); ``check=False`` skips
even that.  A plan owns its workspaces (the split partials, the fused combine's counters),
one set per stream it runs on, allocated by the caller's library; nothing in ``run``
synchronizes the host or copies host memory when the lengths and block tables are device
arrays, so a plan's ``run`` can be captured in a CUDA graph (``torch.cuda.graph``) and
replayed; device block tables may be rewritten in place between replays.  Device lengths
and block tables are used as they are (their values are not read on the host: keep them in
range); NumPy ones are checked on every call and uploaded once per distinct content
(:meth:`iokernels.core.arrays.Call.constant`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from ..core import api as core_api
from ..core import conventions as cv
from ..core.arrays import Call, device_array
from .decode import (_check_cache, _check_decode_q, _host, _visible, _window_left, check_device_scales,
                     check_paged_lengths, pools_need, run_decode)
from . import decode_config as DC
from .decode_launch import combine_launch, kernel_ptr, launch_combine, pack, split_launch, split_static
from .launch import contiguous, cupy, device_info, unit_rows
from .packed import ArgBuffer, function_ptr, kept, kept_until_full, placeholder, slots_of
from .registry import REGISTRY, need

#: plans :data:`PLANS` keeps; the least recently used goes first
PLAN_CACHE_ENTRIES = 64
#: launch shapes (split count, shared memory) a plan keeps, one per longest sequence seen with
#: host lengths; past this many they are forgotten and recomputed (and as many packed arguments)
PLAN_LAUNCHES_KEPT = 256
#: placeholders a decode plan's packed arguments may take (q, k, v, O, LSE, lengths, tables,
#: two scales)
PACKED_SLOTS = 9
#: argument sets a decode plan over tensor maps keeps, one per address triple of Q, K, V (the
#: least recently used goes first): a step's layers each have their own cache
MAPPED_KEPT = 64


class NotPlanned(Exception):
    """The call has no plan (NumPy inputs, a record with its own launcher): run it eagerly."""


class PlanCache:
    """A bounded least-recently-used cache of plans, with hit and miss counts."""

    def __init__(self, maxsize: int = PLAN_CACHE_ENTRIES):
        self.maxsize = maxsize
        self._plans: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            self.hits += 1
        return plan

    def put(self, key, plan) -> None:
        """Keep ``plan``; past ``maxsize`` the least recently used plan that no CUDA graph uses
        goes (a pinned plan's workspaces are in a captured graph: freeing them would let the
        graph write into memory handed to someone else)."""
        self.misses += 1
        self._plans[key] = plan
        if len(self._plans) > self.maxsize:
            for old in list(self._plans):
                if len(self._plans) <= self.maxsize:
                    break
                if not getattr(self._plans[old], "pinned", False):
                    del self._plans[old]

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0

    def release(self) -> int:
        """Forget every plan no CUDA graph uses, so their workspaces go back to the library that
        allocated them (a backward plan's deterministic dQ partials are Tc copies of dQ: GBs at
        long sequences); returns how many went.  A program calls it where it would empty its
        allocator's cache; the next call of each shape plans again."""
        gone = [key for key, plan in self._plans.items() if not getattr(plan, "pinned", False)]
        for key in gone:
            del self._plans[key]
        return len(gone)

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()

#: array type -> "torch" / "cupy" (device arrays a plan takes) or None (NumPy, others)
_KINDS: dict = {}


def _kind(x) -> str | None:
    t = type(x)
    k = _KINDS.get(t, False)
    if k is False:
        mod = t.__module__.split(".")[0]
        k = mod if mod in ("torch", "cupy") else None
        _KINDS[t] = k
    return k


def array_key(x):
    """What a plan fixes of one array: type, shape, strides, dtype, device and whether it
    starts on 16 bytes; None for an array a plan does not take (NumPy, None)."""
    k = _kind(x)
    if k == "torch":
        if not x.is_cuda:
            return None
        return (k, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
    if k == "cupy":
        return (k, x.shape, x.strides, x.dtype, x.device.id, x.data.ptr % 16 == 0)
    return None


def _on_device(x) -> bool:
    """True for a device array a plan can take in place (torch CUDA, CuPy); a torch tensor on the
    CPU is host values, like a NumPy array or a list."""
    return array_key(x) is not None


def _ptr(x) -> np.uint64:
    return np.uint64(x.data_ptr() if _kind(x) == "torch" else x.data.ptr)


def _ptrs(torch: bool, *xs) -> tuple:
    """The pointers of device arrays ``xs`` (all torch tensors, or all CuPy arrays), as np.uint64."""
    u = np.uint64
    return tuple(u(x.data_ptr()) for x in xs) if torch else tuple(u(x.data.ptr) for x in xs)


def int_ptrs(torch: bool, *xs) -> tuple:
    """The pointers of device arrays ``xs`` (all torch tensors, or all CuPy arrays), as ints
    (a list comprehension: one call, where a generator is resumed once an item)."""
    return tuple([x.data_ptr() for x in xs]) if torch else tuple([x.data.ptr for x in xs])


# the keys hold a setting's type next to its value: True == 1 == 1.0, and a bool is refused where
# an int is taken (num_splits), so a bad call never matches a good call's plan

def _window_key(window):
    return None if window is None else tuple((type(w), w) for w in window)


def _lens_key(seq_lens):
    """None, ("host", shape, dtype) or the device array's key."""
    if seq_lens is None:
        return None
    a = array_key(seq_lens)
    if a is not None:
        return a
    h = np.asarray(seq_lens)
    return ("host", h.shape, h.dtype.str)


_STREAMS: dict = {}
_RAW_STREAM: list = []


def _torch_stream_ptr(x) -> int:
    """The pointer of torch's current stream on tensor x's device.  One C call where torch has
    ``torch._C._cuda_getCurrentRawStream`` (private, but it is what Triton's launcher asks, for
    the same reason: ``torch.cuda.current_stream`` builds a Stream object on every call, a few
    microseconds of a call that should cost as little as SDPA's); else the public way."""
    if not _RAW_STREAM:
        import torch
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
        _RAW_STREAM.append(torch)
    raw, torch = _RAW_STREAM
    if raw is not None:
        return int(raw(x.get_device()))
    return int(torch.cuda.current_stream(x.device).cuda_stream)


def _stream_of(x) -> tuple[int, Any]:
    """(pointer, a CuPy stream object to launch on) of the caller's current stream on x's device."""
    if hasattr(x, "data_ptr"):
        ptr = _torch_stream_ptr(x)
    else:
        ptr = int(cupy().cuda.get_current_stream().ptr)
    obj = _STREAMS.get(ptr)
    if obj is None:
        obj = cupy().cuda.ExternalStream(ptr) if ptr else _NullStream()
        _STREAMS[ptr] = obj
    return ptr, obj


class _NullStream:
    """The default stream: CuPy's current stream, left as it is."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _capturing(torch_kind: bool, stream_obj) -> bool:
    """Whether the caller's current stream is capturing a CUDA graph."""
    if torch_kind:
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    return bool(getattr(stream_obj, "is_capturing", lambda: False)())


def _pin_if_capturing(plan, sobj, refuse: str | None = None) -> None:
    """The capture rule of every plan's ``run``: when the caller's stream is capturing a CUDA
    graph, raise ``refuse`` (a ValueError naming what the graph would bake in wrongly, say
    host lengths) where given, else pin the plan (its workspaces are in a graph from now on,
    so :class:`PlanCache` never drops it)."""
    if not plan.pinned and _capturing(plan.alloc.torch, sobj):
        if refuse is not None:
            raise ValueError(refuse)
        plan.pinned = True


def plan_for(make_key, make):
    """The plan :data:`PLANS` keeps under ``make_key()``, made by ``make()`` and kept on a miss
    (its checks raise a ValueError naming the argument, and nothing is kept); None where the
    call takes no plan (key None, an unhashable or malformed setting, :class:`NotPlanned`): run
    it eagerly, which reports a bad setting."""
    try:
        key = make_key()
        if key is None:
            return None
        plan = PLANS.get(key)
    except TypeError:
        return None
    if plan is None:
        try:
            plan = make()
        except NotPlanned:
            return None
        PLANS.put(key, plan)
    return plan


class _Alloc:
    """Outputs and workspaces from the caller's library, on the caller's device."""

    def __init__(self, like):
        self.torch = _kind(like) == "torch"
        self.device = like.device
        if self.torch:
            import torch
            self._torch = torch
        else:
            self._cupy = cupy()

    def empty(self, shape, dtype: str):
        if self.torch:
            return self._torch.empty(shape, dtype=getattr(self._torch, dtype), device=self.device)
        with self._cupy.cuda.Device(self.device.id):
            return self._cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else np.dtype(dtype))

    def zeros_int32(self, n: int):
        buf = self.empty((n,), "int32")
        if self.torch:
            buf.zero_()                     # a memset kernel on the current stream
        else:
            buf.fill(0)
        return buf


#: what a capture refuses: host lengths and tables (a graph would replay the values of the capture)
_HOST_LENS = ("seq_lens: a CUDA graph reads the lengths when it replays; pass them as a device int32 array "
              "(host lengths are baked in at capture)")
_HOST_TABLES = ("block_tables: a CUDA graph reads the tables and lengths when it replays; pass them as device "
                "int32 arrays (host ones are baked in at capture)")


def _device_lens(seq_lens, batch: int) -> None:
    """Device lengths a plan uses in place: contiguous int32 (batch,).  Others (int64, strided,
    another shape) take the eager path, which reads them on the host (and reports a bad one)."""
    a = device_array(seq_lens)
    if a.shape != (batch,) or a.dtype != "int32" or not a.c_contiguous():
        raise NotPlanned("seq_lens: device lengths other than contiguous int32 (batch,)")


# =========================================================================== decode
def decode_key(q, k, v, seq_lens, num_splits, scale, config, window):
    """The plan-cache key of a contiguous-cache decode call, or None when it takes no plan."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("decode", REGISTRY.generation, kq, array_key(k), array_key(v), _lens_key(seq_lens),
            type(num_splits), num_splits, type(scale), scale, config, _window_key(window))


def _device_rows(plan, q, k, v, cfg, d):
    """q, k, v as device arrays with unit-stride rows (copied only where they are not); sets the
    plan's ``copy_q`` / ``copy_kv`` (a run copies the same way) and refuses unaligned rows for v2+;
    also whether every row starts on 16 bytes."""
    qd, kd, vd = device_array(q), device_array(k), device_array(v)
    plan.copy_q = qd.strides != (plan.Hq * d, d, 1)
    plan.copy_kv = bool(kd.shape[-1] > 1 and (kd.strides[-1] != 1 or vd.strides[-1] != 1))
    if plan.copy_q:
        qd = unit_rows(contiguous(q))
    if plan.copy_kv:
        kd, vd = unit_rows(k), unit_rows(v)
    aligned = all(a.aligned(DC.CHUNK_BYTES) for a in (qd, kd, vd))
    if cfg.version != "v1" and not aligned:
        raise ValueError(f"config.version: {cfg.version} needs rows that start on 16 bytes (use 'v1')")
    return qd, kd, vd, aligned


class DecodePlan:
    """Decode over a contiguous cache, planned once: q (B, Hq, d), k, v (B, Hkv, N, d) device
    arrays (torch CUDA or CuPy) and the settings of :func:`iokernels.cupy_raw.decode`.

    ``seq_lens``: None (every sequence all N keys), a contiguous device int32 (B,) array (used
    in place: graph-safe; the split count is planned for N keys) or a NumPy array (checked and
    uploaded once per distinct content; the split count follows its longest sequence).  Other
    device lengths take the eager path (:func:`iokernels.cupy_raw.decode.decode`: read on the
    host); constructing a plan for them raises :class:`NotPlanned`.  ``run(q, k, v, seq_lens)``
    launches on the caller's current stream and returns (O, LSE) of q's kind.
    """

    def __init__(self, q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
        info, _ = core_api.check_decode(q, k, v, None if _on_device(seq_lens) else seq_lens)
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        B, Hkv, N, d, dtype = _check_cache(q, k, v)
        call = Call(q)
        call.check(k, "k")
        call.check(v, "v")
        self.num_splits = core_api.check_num_splits(num_splits)
        self.scale = cv.resolve_scale(scale, d)
        self.left = _window_left(window)
        self.lens_mode = None if seq_lens is None else ("device" if _on_device(seq_lens) else "host")
        if self.lens_mode == "device":
            if _kind(seq_lens) != _kind(q):
                raise NotPlanned("seq_lens: device lengths of another kind than q's")
            _device_lens(seq_lens, B)
        spec, cfg = REGISTRY.resolve("decode", config, need("decode", q=q, k=k, v=v))
        if spec.launcher is not run_decode:
            raise NotPlanned("this version has its own launcher")
        self.key = (array_key(q), array_key(k), array_key(v), _lens_key(seq_lens))
        self.B, self.Hq, self.Hkv, self.N, self.d, self.dtype = B, int(q.shape[1]), Hkv, N, d, dtype
        self.acc = cv.accum_dtype(dtype).name
        qd, kd, vd, aligned = _device_rows(self, q, k, v, cfg, d)
        self.config, self.record = cfg, spec
        self.empty = B * self.Hq == 0
        self.alloc = _Alloc(q)
        i64 = np.int64
        self.cache_args = (*map(i64, kd.strides[:3]), *map(i64, vd.strides[:3]))
        self._launches: dict = {}
        self._ws: dict = {}
        self._buffers: dict = {}
        self._mapped_buffers: OrderedDict = OrderedDict()
        self.mapped = 3 if spec.extra.get("layout") == "tma" else 0     # Q, K, V as tensor maps (v8)
        self.pinned = False                              # set once a CUDA graph captures a run
        if not self.empty:
            self.st = split_static(spec, cfg, batch=B, heads_q=self.Hq, heads_kv=Hkv, head_dim=d, dtype=dtype,
                                   paged=False, block_size=0, aligned=aligned, kv=None, dev=device_info())
            self._launch_for(int(min(N, self.left + 1) if self.left >= 0 else N))   # checks the SRAM now

    def _launch_for(self, longest: int):
        """(splits, shared memory, table arguments, grid, the static launched: split_launch's) for a
        longest sequence of ``longest`` keys."""
        got = self._launches.get(longest)
        if got is None:
            if len(self._launches) >= PLAN_LAUNCHES_KEPT:
                self._launches.clear()
            got = self._launches[longest] = split_launch(self.st, self.num_splits, longest)
        return got

    def _workspace(self, stream: int, S: int):
        """(o_part, lse_part, counters) pointers for ``S`` splits on ``stream`` (grown, never shrunk)."""
        ws = self._ws.get(stream)
        if ws is None or ws[0] < S:
            a = self.alloc
            B, Hq = self.B, self.Hq
            o_part = a.empty((S, B, Hq, self.d), self.acc) if S > 1 else None
            lse_part = a.empty((S, B, Hq), self.acc) if S > 1 else None
            counters = a.zeros_int32(max(B * self.st.heads_grid, 1)) if self.st.fused and S > 1 else None
            z = np.uint64(0)
            ws = (S, (o_part, lse_part, counters),
                  (z if o_part is None else _ptr(o_part), z if lse_part is None else _ptr(lse_part),
                   z if counters is None else _ptr(counters)))
            self._ws[stream] = ws
        return ws[2]

    def _packed(self, stream: int, S: int, smem: int, table: tuple, pack_call, qkv: tuple = ()):
        """The packed arguments (:class:`.packed.ArgBuffer`) of a launch of ``S`` splits on
        ``stream``, its workspaces written in, the call's pointers its slots (placeholders 0..n-1
        in ``pack_call(P, parts, counters)``, P the placeholders); False where the arguments do
        not pack (the run then takes CuPy's launch).  A kernel that reads Q, K, V through TMA
        tensor maps (decode v8) takes the maps, which encode the arrays' addresses: its arguments
        are packed once per address triple ``qkv`` (the last :data:`MAPPED_KEPT`), its slots
        start at O's (:attr:`mapped`: the pointers a launch skips)."""
        o_part, lse_part, counters = parts = self._workspace(stream, S)

        def build():
            P = [placeholder(j) for j in range(PACKED_SLOTS)]
            P[:self.mapped] = map(np.uint64, qkv[:self.mapped])     # the maps are encoded for these
            args, n = pack_call(P, (o_part, lse_part), counters)
            where = slots_of(args, range(self.mapped, n))
            return (ArgBuffer.of(args, where) if where is not None else None) or False
        if self.mapped:
            return kept(self._mapped_buffers, (stream, S, smem, table, parts, *qkv[:3]), build, MAPPED_KEPT)
        return kept_until_full(self._buffers, (stream, S, smem, table, parts), build, PLAN_LAUNCHES_KEPT)

    def run(self, q, k, v, seq_lens=None, *, check: bool = True):
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(k), array_key(v), _lens_key(seq_lens)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        o = self.alloc.empty((self.B, self.Hq, self.d), self.dtype)
        lse = self.alloc.empty((self.B, self.Hq), self.acc)
        if self.empty:
            return o, lse
        stream, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, _HOST_LENS if self.lens_mode == "host" else None)
        if self.lens_mode == "host":
            lens = _host(seq_lens).astype(np.int64)
            if np.any(lens < 0) or np.any(lens > self.N):
                raise ValueError(f"seq_lens: expected {self.B} lengths in [0, {self.N}], got {lens.tolist()}")
            longest = int(_visible(lens, self.left).max(initial=0))
            lens_arg = _ptr(Call(q).constant(lens.astype(np.int32)))
        else:
            longest = int(min(self.N, self.left + 1) if self.left >= 0 else self.N)
            lens_arg = np.uint64(0) if seq_lens is None else _ptr(seq_lens)
        if self.copy_q:
            q = contiguous(q)
        if self.copy_kv:
            k, v = unit_rows(k).owner, unit_rows(v).owner
        S, smem, table, grid, st = self._launch_for(longest)

        def pack_call(P, parts, counters):
            return pack(st, S, table, q=P[0], k=P[1], v=P[2], cache=self.cache_args, scales=(), lens=P[5],
                        nk=self.N, scale=self.scale, window_left=self.left, parts=parts, counters=counters,
                        o=P[3], lse=P[4]), 6
        ptrs = int_ptrs(self.alloc.torch, q, k, v, o, lse)
        buf = self._packed(stream, S, smem, table, pack_call, ptrs[:3])
        self._launch(st, stream, sobj, S, grid, smem, buf, pack_call, ptrs, (lens_arg,))
        return o, lse

    def _launch(self, st, stream: int, sobj, S: int, grid: tuple, smem: int, buf, pack_call, ptrs: tuple,
                more: tuple) -> None:
        """The split kernel of ``st`` (split_launch's static: the plan's, or the version its deal
        falls back to) and the combine, where the version does not fuse it, on ``stream``:
        through the packed arguments ``buf``, or, where they do not pack, CuPy's launch of the
        arguments ``pack_call`` makes.  ``ptrs``: q, k, v, O, LSE (ints); ``more``: the other
        slots' values in order (the lengths; the tables and the scales of a paged cache), np.uint64."""
        if buf:
            buf.launch(kernel_ptr(st), grid, (st.threads,), smem, stream,
                       *ptrs[self.mapped:], *map(int, more))
        else:
            args, _ = pack_call((*map(np.uint64, ptrs), *more), *_split_parts(self._workspace(stream, S)))
            with sobj:
                st.fn(grid, (st.threads,), args, shared_mem=smem)
        if S > 1 and not self.st.fused:
            comb = self._combine(stream, S) if buf else None
            if comb:
                comb[0].launch(comb[1], comb[2], comb[3], 0, stream, ptrs[3], ptrs[4])
            else:
                o_part, lse_part, _ = self._workspace(stream, S)
                with sobj:
                    launch_combine(self.st, S, o_part, lse_part, np.uint64(ptrs[3]), np.uint64(ptrs[4]))

    def _combine(self, stream: int, S: int):
        """(packed arguments, kernel, grid, block) of the separate combine of ``S`` splits on
        ``stream`` (the config's: decode.cu's or decode_combine.cu's) over that stream's workspace,
        O's and LSE's pointers its slots; False where the arguments do not pack."""
        parts = self._workspace(stream, S)

        def build():
            fn, grid, block, args = combine_launch(self.st, S, parts[0], parts[1], placeholder(0), placeholder(1))
            buf = ArgBuffer.of(args, slots_of(args, (0, 1)))
            return (buf, function_ptr(fn), grid, block) if buf is not None else False
        return kept_until_full(self._buffers, ("combine", stream, S, parts), build, PLAN_LAUNCHES_KEPT)


def _split_parts(parts: tuple) -> tuple:
    """((o_part, lse_part), counters) of a workspace's pointers."""
    return parts[:2], parts[2]


def cached_decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None, window=None):
    """Decode through :data:`PLANS`: (O, LSE), or NotImplemented where the call takes no plan."""
    plan = plan_for(lambda: decode_key(q, k, v, seq_lens, num_splits, scale, config, window),
                    lambda: DecodePlan(q, k, v, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=config,
                                       window=window))
    if plan is None:
        return NotImplemented
    return plan.run(q, k, v, seq_lens, check=False)


# =========================================================================== paged decode
def _quant_key(quant):
    """What a plan fixes of a quantized cache (None: a 16-bit one): the code format and the
    scales' arrays; False when the scales are not device arrays (NumPy: the eager path copies
    them in on every call)."""
    if quant is None:
        return None
    ks, vs = array_key(quant.get("k_scale")), array_key(quant.get("v_scale"))
    if ks is None or vs is None:
        return False
    return (quant.get("kv"), ks, vs)


def paged_key(q, k_pool, v_pool, block_tables, seq_lens, num_splits, scale, config, window, quant):
    """The plan-cache key of a paged-pools decode call, or None when it takes no plan
    (NumPy inputs, a quantized cache whose scales are NumPy arrays)."""
    kq, qk = array_key(q), _quant_key(quant)
    if kq is None or qk is False:
        return None
    return ("paged_decode", REGISTRY.generation, kq, array_key(k_pool), array_key(v_pool), _lens_key(block_tables),
            _lens_key(seq_lens), type(num_splits), num_splits, type(scale), scale, config,
            _window_key(window), qk)


class PagedDecodePlan:
    """Decode over paged pools (num_blocks, block_size, Hkv, d), planned once: the arguments
    of :func:`iokernels.cupy_raw.paged_decode_pools` for a 16-bit cache, q and the pools device
    arrays (torch CUDA or CuPy).

    ``block_tables`` (B, max_blocks) and ``seq_lens`` (B,) are both device int32 arrays (used
    in place: graph-safe, and a table rewritten in place between runs or graph replays is read
    as it is then; the split count is planned for max_blocks x block_size keys) or both NumPy
    arrays (checked on every run and uploaded once per distinct content).

    ``quant``: None, or a quantized cache's dict(kv=code format, k_scale, v_scale), the pools
    then 1-byte codes and the scales float32 (num_blocks, Hkv or 1) device arrays of q's kind,
    read in place on every run (a CUDA graph sees scales rewritten in place, as it sees the
    tables); NumPy scales take the eager path.
    """

    def __init__(self, q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None,
                 window=None, quant=None):
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        if _quant_key(quant) is False:
            raise NotPlanned("quant: plans take the scales as device arrays of q's kind")
        quant, (nb, bs, Hkv, d, dtype), n = pools_need(q, k_pool, v_pool, quant)
        _check_decode_q(q, Hkv, d, dtype)
        call = Call(q)
        call.check(k_pool, "k_pool")
        call.check(v_pool, "v_pool")
        self.quant = None
        if quant is not None:
            for name in ("k_scale", "v_scale"):
                call.check(quant[name], name)
                check_device_scales(device_array(quant[name]), name)
            self.quant = (quant["kv"], np.int32(quant["k_scale"].shape[1]),
                          np.int32(int(quant["k_scale"].shape[1]) == Hkv))
        B = int(q.shape[0])
        device_tables = _on_device(block_tables)
        if device_tables != _on_device(seq_lens) or (device_tables and not (
                _kind(block_tables) == _kind(seq_lens) == _kind(q))):
            raise NotPlanned("block_tables, seq_lens: one on the device, one on the host, or of another kind")
        if device_tables:
            t = device_array(block_tables)
            if len(t.shape) != 2 or t.shape[0] != B or t.dtype != "int32" or not t.c_contiguous():
                raise NotPlanned("block_tables: device tables other than contiguous int32 (batch, max_blocks)")
            _device_lens(seq_lens, B)
            self.max_blocks = t.shape[1]
        else:
            tables, _ = check_paged_lengths(block_tables, seq_lens, B, nb, bs)
            self.max_blocks = tables.shape[1]
        self.device_tables = device_tables
        self.num_splits = core_api.check_num_splits(num_splits)
        self.scale = cv.resolve_scale(scale, d)
        self.left = _window_left(window)
        spec, cfg = REGISTRY.resolve("paged_decode", config, n)
        self.key = (array_key(q), array_key(k_pool), array_key(v_pool), _lens_key(block_tables),
                    _lens_key(seq_lens), _quant_key(quant))
        self.B, self.Hq, self.Hkv, self.d, self.dtype, self.nb, self.bs = B, int(q.shape[1]), Hkv, d, dtype, nb, bs
        self.acc = cv.accum_dtype(dtype).name
        qd, kd, vd, aligned = _device_rows(self, q, k_pool, v_pool, cfg, d)
        self.config, self.record = cfg, spec
        self.empty = B * self.Hq == 0
        self.alloc = _Alloc(q)
        self.kv_strides = tuple(np.int64(s) for s in kd.strides[:3])
        self._launches: dict = {}
        self._ws: dict = {}
        self._buffers: dict = {}
        self.pinned = False                              # set once a CUDA graph captures a run
        if not self.empty:
            self.st = split_static(spec, cfg, batch=B, heads_q=self.Hq, heads_kv=Hkv, head_dim=d, dtype=dtype,
                                   paged=True, block_size=bs, aligned=aligned,
                                   kv=None if self.quant is None else self.quant[0], dev=device_info())
            self._launch_for(self._capacity())

    def _capacity(self) -> int:
        cap = self.max_blocks * self.bs
        return int(min(cap, self.left + 1) if self.left >= 0 else cap)

    mapped = 0                                           # a paged cache is read through pointers
    _launch_for = DecodePlan._launch_for
    _workspace = DecodePlan._workspace
    _packed = DecodePlan._packed
    _launch = DecodePlan._launch
    _combine = DecodePlan._combine

    def run(self, q, k_pool, v_pool, block_tables, seq_lens, *, quant=None, check: bool = True):
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(k_pool), array_key(v_pool), _lens_key(block_tables),
                      _lens_key(seq_lens), _quant_key(quant)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        o = self.alloc.empty((self.B, self.Hq, self.d), self.dtype)
        lse = self.alloc.empty((self.B, self.Hq), self.acc)
        if self.empty:
            return o, lse
        stream, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, None if self.device_tables else _HOST_TABLES)
        if self.device_tables:
            longest = self._capacity()
            tables_arg, lens_arg = _ptrs(self.alloc.torch, block_tables, seq_lens)
        else:
            tables, lens = check_paged_lengths(block_tables, seq_lens, self.B, self.nb, self.bs)
            if tables.shape[1] != self.max_blocks:
                raise ValueError(f"block_tables: this plan was made for {self.max_blocks} blocks a sequence, got "
                                 f"{tables.shape[1]}")
            longest = int(_visible(lens, self.left).max(initial=0))
            packed = device_array(Call(q).constant(np.concatenate([lens.astype(np.int32),
                                                                   tables.astype(np.int32).ravel()])))
            lens_arg, tables_arg = packed.arg, np.uint64(packed.ptr + 4 * self.B)
        if self.copy_q:
            q = contiguous(q)
        if self.copy_kv:
            k_pool, v_pool = unit_rows(k_pool).owner, unit_rows(v_pool).owner
        S, smem, table, grid, st = self._launch_for(longest)
        quant_tail = () if self.quant is None else self.quant[1:]

        def pack_call(P, parts, counters):
            scales = () if self.quant is None else (P[7], P[8], *quant_tail)
            cache = (P[6], np.int32(self.max_blocks), *self.kv_strides)
            return pack(st, S, table, q=P[0], k=P[1], v=P[2], cache=cache, scales=scales, lens=P[5], nk=0,
                        scale=self.scale, window_left=self.left, parts=parts, counters=counters, o=P[3],
                        lse=P[4]), 7 if self.quant is None else 9
        buf = self._packed(stream, S, smem, table, pack_call)
        scales = () if self.quant is None else _ptrs(self.alloc.torch, quant["k_scale"], quant["v_scale"])
        self._launch(st, stream, sobj, S, grid, smem, buf, pack_call,
                     int_ptrs(self.alloc.torch, q, k_pool, v_pool, o, lse), (lens_arg, tables_arg, *scales))
        return o, lse


def cached_paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None,
                              config=None, window=None, quant=None):
    """Paged-pools decode through :data:`PLANS`: (O, LSE), or NotImplemented without a plan."""
    plan = plan_for(lambda: paged_key(q, k_pool, v_pool, block_tables, seq_lens, num_splits, scale, config,
                                      window, quant),
                    lambda: PagedDecodePlan(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits,
                                            scale=scale, config=config, window=window, quant=quant))
    if plan is None:
        return NotImplemented
    return plan.run(q, k_pool, v_pool, block_tables, seq_lens, quant=quant, check=False)
