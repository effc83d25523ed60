"""The attention forward planned once per shape (:mod:`.plans` says why and how).

One class for both families: the portable versions (fa_v1.cu .. fa_v2.cu, whose arguments
are pointers, sizes and strides) and the Hopper ones (fa_v3.cu .. fa_v11.cu, whose Q, K, V
arrive as TMA tensor maps that encode the arrays' addresses: a plan keeps the maps of the
last few address triples it saw; the persistent v9 also takes a tile counter, one a stream, and
v11 the size of its longest-first groups, fixed by the shape).
"""
from __future__ import annotations

import math
from collections import OrderedDict

from ..core import conventions as cv
from ..core.arrays import Call, DeviceArray, device_array
from .forward import run_attention
from .config import CHUNK_BYTES, fit_config
from .hopper.attention import _check_attention_inputs, longest_first_pairs
from .hopper.records import run_attention as hopper_run_attention
from .hopper.checks import require_available
from .hopper.config import LONGEST_FIRST, PERSISTENT, THREADS, grid as hopper_grid
from .launch import HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, device_info, fill, function, unit_rows
from .packed import SLOT, ArgBuffer, function_ptr, kept, slots_of
from .plans import NotPlanned, _Alloc, plan_for, _ptr, _ptrs, _stream_of, _window_key, array_key, int_ptrs
from .registry import REGISTRY, need

#: tensor-map sets (one per address triple of Q, K, V) a Hopper plan keeps
MAPS_KEPT = 16
#: placeholder pointers of a plan's argument template (replaced by the arrays' on every run)
_SLOT = SLOT


def attention_key(q, k, v, causal, scale, window, config):
    """The plan-cache key of an attention call, or None when it takes no plan."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("attention", REGISTRY.generation, kq, array_key(k), array_key(v), type(causal), causal, type(scale),
            scale, _window_key(window), config)


def _slots(args: tuple, ids) -> list[int]:
    """Where the placeholder pointers _SLOT + j (j in ``ids``) sit in ``args``."""
    where = slots_of(args, ids)
    if where is None:
        raise ValueError(f"args: a placeholder of {list(ids)} is missing")
    return where


def mapped_args(maps: OrderedDict, addresses: tuple, build, values: tuple) -> tuple:
    """The arguments of a kernel that takes TMA tensor maps (which encode its inputs' addresses):
    the (template, placeholder positions) that ``build()`` makes for ``addresses``, kept in
    ``maps`` for the last :data:`MAPS_KEPT` address sets, with ``values`` at those positions."""
    template, where = kept(maps, addresses, build, MAPS_KEPT)
    args = list(template)
    for i, x in zip(where, values):
        args[i] = x
    return tuple(args)


def _placeholder(a: DeviceArray, j: int) -> DeviceArray:
    return DeviceArray(_SLOT + j, a.shape, a.strides, a.dtype, a.itemsize, None)


class AttentionPlan:
    """The attention forward over q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) device arrays (torch
    CUDA or CuPy), planned once: the settings of :func:`iokernels.cupy_raw.attention`.
    ``run(q, k, v)`` launches on the caller's current stream and returns (O, LSE) of q's kind."""

    def __init__(self, q, k, v, *, causal=False, scale=None, window=None, config=None):
        info = cv.check_qkv(q, k, v)
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        call = Call(q)
        call.check(k, "k")
        call.check(v, "v")
        causal = cv.check_bool(causal, "causal")
        spec, cfg = REGISTRY.resolve("attention", config,
                                     need("attention", q=q, k=k, v=v, causal=causal, window=window))
        self.hopper = spec.launcher is hopper_run_attention
        if not self.hopper and spec.launcher is not run_attention:
            raise NotPlanned("this version has its own launcher")
        dtype, d = info["dtype"], info["head_dim"]
        B, Hq, Nq, Nk = info["batch"], info["heads_q"], info["seqlen_q"], info["seqlen_k"]
        self.key = (array_key(q), array_key(k), array_key(v))
        self.dtype, self.shape = dtype, (B, Hq, Nq, d)
        self.alloc = _Alloc(q)
        self.empty, self.no_keys = B * Hq * Nq == 0, Nk == 0
        qd, kd, vd = (device_array(x) for x in (q, k, v))
        if self.hopper:
            _, scale, window, cfg = _check_attention_inputs(q, k, v, causal, scale, window, cfg)
            require_available()
            cfg.check_fits(d, device_info()["smem_optin"])
            self.acc = "float32"
            self.copy = [not (a.c_contiguous() and a.ptr % 16 == 0) for a in (qd, kd, vd)]
            self.smem = cfg.smem_bytes(d)
            self.fn = function(spec.file, spec.kernel, cfg.defines(d, dtype), self.smem, options=HOPPER_OPTIONS,
                               sources=HOPPER_SOURCES)
            block_m = cfg.block_m()
            self.grid = hopper_grid(cfg, B, Hq, Nq, device_info()["sms"])
            self.block = (THREADS[cfg.version],)
            self.hargs = dict(dtype=dtype, block_n=cfg.block_n, scale=scale, window=window,
                              heavy_first=window[1] >= 0 and Nq > block_m, block_m=block_m)
            if cfg.version in LONGEST_FIRST:
                self.hargs["lpt_pairs"] = longest_first_pairs((B, Hq, Nq, d), Nk, qd.itemsize,
                                                              self.hargs["heavy_first"])
            self.persistent = cfg.version in PERSISTENT
            self.slots = (3, 4)
            if self.persistent:                            # v9's tile counter: a slot, one a stream
                self.hargs["claimed"] = DeviceArray(_SLOT + 5, (2,), (1,), "int32", 4, None)
                self.slots = (3, 4, 5)
            self._claimed: dict = {}
            self._maps: OrderedDict = OrderedDict()        # argument tuples (CuPy's launch)
            self._buffers: OrderedDict = OrderedDict()     # packed arguments (the driver's launch)
        else:
            scale = cv.resolve_scale(scale, d)
            window = cv.effective_window(causal, window)
            cfg.resolve(d, dtype)                            # config errors before any GPU work
            cfg = fit_config(cfg, d, dtype, device_info())
            self.acc = cv.accum_dtype(dtype).name
            self.copy = [bool(a.shape[-1] > 1 and a.strides[-1] != 1) for a in (qd, kd, vd)]
            qd, kd, vd = (unit_rows(x) if c else a for x, a, c in zip((q, k, v), (qd, kd, vd), self.copy))
            defines = cfg.defines(d, dtype)
            if cfg.version in ("v2", "v1b") and not all(a.aligned(CHUNK_BYTES) for a in (qd, kd, vd)):
                defines["VEC_IO"] = 0                        # rows not 16-byte aligned: element copies
            self.smem = cfg.smem_bytes(d, dtype)
            self.fn = function(spec.file, spec.kernel, defines, self.smem)
            self.grid, self.block = (-(-Nq // cfg.block_q), Hq, B), (cfg.threads(),)
            o = DeviceArray(0, self.shape, _c_strides(self.shape), dtype, qd.itemsize, None)
            lse = DeviceArray(0, self.shape[:3], _c_strides(self.shape[:3]), self.acc, 4, None)
            arrays = (qd, kd, vd, o, lse)
            self.template = spec.args(*(_placeholder(a, j) for j, a in enumerate(arrays)), dtype=dtype, scale=scale,
                                      window=window)
            self.where = _slots(self.template, range(5))
            self.packed = ArgBuffer.of(self.template, self.where)
        self.fn_ptr = function_ptr(self.fn)
        self.config, self.record = cfg, spec

    def _hopper_template(self, q, k, v):
        qd, kd, vd = (device_array(x, self.dtype) for x in (q, k, v))
        od = DeviceArray(_SLOT + 3, self.shape, _c_strides(self.shape), self.dtype, 2, None)
        ld = DeviceArray(_SLOT + 4, self.shape[:3], _c_strides(self.shape[:3]), "float32", 4, None)
        template = self.record.args(qd, kd, vd, od, ld, **self.hargs)
        return template, _slots(template, self.slots)

    def _more(self, stream: int) -> tuple:
        """The slots after O's and LSE's: v9's tile counter on ``stream`` (two int32, zeroed once
        when made: each launch leaves them zero), or nothing."""
        if not self.persistent:
            return ()
        got = self._claimed.get(stream)
        if got is None:
            buf = self.alloc.zeros_int32(2)
            got = self._claimed[stream] = (buf, _ptr(buf))
        return (got[1],)

    def _hopper_args(self, q, k, v, o, lse, stream: int) -> tuple:
        return mapped_args(self._maps, (int(_ptr(q)), int(_ptr(k)), int(_ptr(v))),
                           lambda: self._hopper_template(q, k, v), (_ptr(o), _ptr(lse), *self._more(stream)))

    def _hopper_packed(self, q, k, v, addresses: tuple):
        """The packed arguments of the tensor maps of Q, K, V at ``addresses`` (the last
        :data:`MAPS_KEPT` address sets are kept); O's and LSE's pointers are its slots."""
        return kept(self._buffers, addresses, lambda: ArgBuffer(*self._hopper_template(q, k, v)), MAPS_KEPT)

    def run(self, q, k, v, *, check: bool = True):
        """Launch on the caller's current stream; (O, LSE) of q's kind."""
        if check and (array_key(q), array_key(k), array_key(v)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        o = self.alloc.empty(self.shape, self.dtype)
        lse = self.alloc.empty(self.shape[:3], self.acc)
        if self.empty:
            return o, lse
        stream, sobj = _stream_of(q)
        if (self.hopper and self.no_keys) or self.copy[0] or self.copy[1] or self.copy[2]:
            self._run_copying(q, k, v, o, lse, sobj, stream)
        elif self.hopper:
            pq, pk, pv, po, pl = int_ptrs(self.alloc.torch, q, k, v, o, lse)
            self._hopper_packed(q, k, v, (pq, pk, pv)).launch(self.fn_ptr, self.grid, self.block, self.smem,
                                                              stream, po, pl, *self._more(stream))
        elif self.packed is not None:
            self.packed.launch(self.fn_ptr, self.grid, self.block, self.smem, stream,
                               *int_ptrs(self.alloc.torch, q, k, v, o, lse))
        else:
            self._run_copying(q, k, v, o, lse, sobj, stream)
        return o, lse

    def _run_copying(self, q, k, v, o, lse, sobj, stream: int) -> None:
        """The uncommon runs, through CuPy's own launch on the caller's stream: no keys (Hopper),
        inputs that need a contiguous copy first, arguments the packed launch does not take."""
        with sobj:
            if self.hopper and self.no_keys:          # no keys: every row is fully masked
                fill(o, 0)
                fill(lse, -math.inf)
                return
            if self.copy[0] or self.copy[1] or self.copy[2]:
                fix = (lambda x: contiguous(x, 16)) if self.hopper else (lambda x: unit_rows(x).owner)
                q, k, v = (fix(x) if c else x for x, c in zip((q, k, v), self.copy))
            if self.hopper:
                args = self._hopper_args(q, k, v, o, lse, stream)
            else:
                args = list(self.template)
                w = self.where
                args[w[0]], args[w[1]], args[w[2]], args[w[3]], args[w[4]] = _ptrs(self.alloc.torch, q, k, v, o, lse)
            self.fn(self.grid, self.block, tuple(args), shared_mem=self.smem)


def _c_strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def cached_attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Attention through :data:`.plans.PLANS`: (O, LSE), or NotImplemented without a plan."""
    plan = plan_for(lambda: attention_key(q, k, v, causal, scale, window, config),
                    lambda: AttentionPlan(q, k, v, causal=causal, scale=scale, window=window, config=config))
    if plan is None:
        return NotImplemented
    return plan.run(q, k, v, check=False)
