"""The attention backward planned once per shape (:mod:`.plans` says why and how).

Once, when the plan is made: every check of the call (:func:`iokernels.core.api.check_backward_args`,
the arrays' kinds, causal), the version and its resolved tiles (:func:`.backward.backward_setup`),
the scale and window, the three compiled kernels (bwd_rowsum, the version's main loop,
bwd_finish), their grids, shared memory and argument templates (sizes, strides, scale, window),
and which inputs need a unit-stride copy.  bwd_v3 and bwd_v4 take TMA tensor maps, which encode
the addresses of q, k, v and do: their template is made per address set and kept for the last few
(:func:`.attention_plan.mapped_args`, as the Hopper forward's plan does); its inputs are copied
where they are not C-contiguous on 16 bytes.  Per call, ``run`` allocates dQ, dK, dV, takes the
caller's stream's workspaces (D = rowsum(dO * O) and dQ's float32 (float64) accumulator, or its
per-tile partials with ``deterministic=True``; one set per plan and stream, allocated once),
zeroes the accumulator with a fill queued on that stream, packs the pointers and launches the
three kernels.  Nothing in ``run`` synchronizes the host or copies host memory, so a plan's
``run`` can be captured in a CUDA graph (the graph replays the fill, so dQ never accumulates
across replays); a captured plan is pinned in :data:`.plans.PLANS`.  CuPy inputs that need a
unit-stride copy are refused under capture (the copy's memory goes back to CuPy's pool after
the call, while the graph would keep writing it); torch's copies stay in the graph's pool.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..core import api as core_api
from ..core import conventions as cv
from ..core.arrays import Call, DeviceArray, device_array
from .attention_plan import _SLOT, _c_strides, _placeholder, _slots, mapped_args
from .backward import (ROW_THREADS, backward_setup, dq_accumulator_shape, finish_kernel, main_function,
                       run_attention_backward, tma_inputs)
from .launch import contiguous, fill, function, unit_rows
from .plans import NotPlanned, _Alloc, _pin_if_capturing, _ptrs, _stream_of, _window_key, array_key, plan_for
from .registry import REGISTRY, need


def backward_key(do, q, k, v, o, lse, causal, scale, window, config):
    """The plan-cache key of a backward call, or None when it takes no plan (NumPy inputs)."""
    kq = array_key(q)
    if kq is None:
        return None
    return ("attention_backward", REGISTRY.generation, array_key(do), kq, array_key(k), array_key(v), array_key(o),
            array_key(lse), type(causal), causal, type(scale), scale, _window_key(window), config)


class BackwardPlan:
    """FlashAttention-2's backward over device arrays (torch CUDA or CuPy), planned once: the
    arguments of :func:`iokernels.cupy_raw.attention_backward` (do, o like q (B, Hq, Nq, d);
    k, v (B, Hkv, Nk, d); lse (B, Hq, Nq)).  ``config``: a :class:`.BackwardConfig` (its
    ``deterministic`` picks dQ by atomic adds or by per-tile partials summed in tile order).
    ``run(do, q, k, v, o, lse)`` launches on the caller's current stream and returns (dq, dk, dv)
    of q's kind and dtype."""

    def __init__(self, do, q, k, v, o, lse, *, causal=False, scale=None, window=None, config=None):
        info = core_api.check_backward_args(do, q, k, v, o, lse)
        if array_key(q) is None:
            raise NotPlanned("q: plans take device arrays (torch CUDA or CuPy)")
        call = Call(q)
        for name, x in (("do", do), ("k", k), ("v", v), ("o", o), ("lse", lse)):
            call.check(x, name)
        causal = cv.check_bool(causal, "causal")
        spec, cfg = REGISTRY.resolve("attention_backward", config, need("attention_backward", q=q, k=k, v=v))
        if spec.launcher is not run_attention_backward:
            raise NotPlanned("this version has its own launcher")
        dtype, d = info["dtype"], info["head_dim"]
        B, Hq, Nq, Hkv, Nk = info["batch"], info["heads_q"], info["seqlen_q"], info["heads_kv"], info["seqlen_k"]
        cfg, smem, defines, row_defines, threads = backward_setup(cfg, d, dtype)
        scale = cv.resolve_scale(scale, d)
        left, right = cv.effective_window(causal, window)
        acc = cv.accum_dtype(dtype)
        self.key = tuple(array_key(x) for x in (do, q, k, v, o, lse))
        self.config, self.record, self.dtype, self.acc = cfg, spec, dtype, acc.name
        self.alloc = _Alloc(q)
        self.pinned = False                              # set once a CUDA graph captures a run
        self.q_shape, self.kv_shape = (B, Hq, Nq, d), (B, Hkv, Nk, d)
        tiles = -(-Nk // cfg.block_k)                               # Tc
        self.acc_shape = dq_accumulator_shape(spec, tiles if cfg.deterministic else 0, B, Hq, Nq, d)
        rows = B * Hq * Nq
        self.do_rows = bool(rows and d)
        self.do_main = bool(B * Hkv * Nk and d)
        self.zero_dkv = self.do_main and rows == 0
        # q, k, v, do, o: rows with unit stride (copied where they are not); lse: contiguous;
        # v3, v4 (TMA): q, k, v, do C-contiguous on 16 bytes
        ins = (q, k, v, do, o)
        self.tma = tma_inputs(spec)
        self.copy = [bool(a.shape[-1] > 1 and a.strides[-1] != 1) for a in (device_array(x) for x in ins)]
        if self.tma:
            self.copy[:4] = [not (a.c_contiguous() and a.ptr % 16 == 0) for a in (device_array(x) for x in ins[:4])]
        self.copy_lse = not device_array(lse).c_contiguous()
        copied = [n for n, c in zip(("q", "k", "v", "do", "o", "lse"), self.copy + [self.copy_lse]) if c]
        # a CuPy copy made during a capture lives in CuPy's pool, which takes it back after the call
        # while the graph keeps writing it on every replay (torch's copies stay in the graph's pool)
        self.under_capture = None if self.alloc.torch or not copied else (
            f"{copied[0]}: a CUDA graph would replay its unit-stride copy into memory CuPy frees after the "
            f"capture; pass rows with unit stride (and a contiguous lse)")
        qd, kd, vd, dod, od = (unit_rows(x) if c else device_array(x) for x, c in zip(ins, self.copy))
        if self.tma:
            qd, kd, vd, dod = (device_array(contiguous(x, 16), dtype) for x in ins[:4])
        lsed = device_array(contiguous(lse)) if self.copy_lse else device_array(lse)
        i32, i64 = np.int32, np.int64
        self._ws: dict = {}
        if self.do_rows:
            self.rowsum = function("bwd_v1", "bwd_rowsum", row_defines)
            self.rowsum_grid = (-(-rows // ROW_THREADS),)
            self.rowsum_tail = (i32(rows), i32(Hq), i32(Nq), *map(i64, dod.strides[:3]), *map(i64, od.strides[:3]))
            self.finish, self.finish_grid, self.finish_tail = finish_kernel(spec, defines, row_defines, B, Hq, Nq, d,
                                                                            tiles)
        if self.do_main and not self.zero_dkv:
            def spot(j, shape, dt, size):                  # a placeholder for a pointer each run sets
                return DeviceArray(_SLOT + j, shape, _c_strides(shape), dt, size, None)
            work = (spot(5, self.q_shape[:3], acc.name, acc.itemsize), spot(6, self.kv_shape, dtype, qd.itemsize),
                    spot(7, self.kv_shape, dtype, qd.itemsize), spot(8, self.acc_shape, acc.name, acc.itemsize))
            self.margs = dict(scale=acc.type(scale), window=(left, right))
            if self.tma:                                   # the maps hold q, k, v, do's addresses
                self._maps: OrderedDict = OrderedDict()
                self._work = (_placeholder(lsed, 4), *work)
            else:
                self.template = spec.args(*(_placeholder(a, j) for j, a in enumerate((qd, kd, vd, dod, lsed))),
                                          *work, **self.margs)
                self.where = _slots(self.template, range(9))
            self.main = main_function(spec, defines, smem)
            self.main_launch = ((tiles, Hkv, B), (threads,), smem)

    def _tma_template(self, q, k, v, do):
        """bwd_v3's (bwd_v4's) arguments for these q, k, v, do (their maps), placeholders for the rest."""
        template = self.record.args(*(device_array(x, self.dtype) for x in (q, k, v, do)), *self._work, **self.margs)
        return template, _slots(template, range(4, 9))

    def _workspace(self, stream: int):
        """(D, dQ accumulator) of ``stream``: allocated on its first run there, then reused."""
        ws = self._ws.get(stream)
        if ws is None:
            ws = self._ws[stream] = (self.alloc.empty(self.q_shape[:3], self.acc),
                                     self.alloc.empty(self.acc_shape, self.acc))
        return ws

    def run(self, do, q, k, v, o, lse, *, check: bool = True):
        """Launch rowsum, the main loop and finish on the caller's current stream; (dq, dk, dv)."""
        if check and (array_key(do), array_key(q), array_key(k), array_key(v), array_key(o),
                      array_key(lse)) != self.key:
            raise ValueError(f"q: this plan was made for {self.key}; got other shapes, dtypes, strides or kinds")
        a = self.alloc
        dq, dk, dv = a.empty(self.q_shape, self.dtype), a.empty(self.kv_shape, self.dtype), \
            a.empty(self.kv_shape, self.dtype)
        stream, sobj = _stream_of(q)
        _pin_if_capturing(self, sobj, self.under_capture)
        c = self.copy
        if c[0] or c[1] or c[2] or c[3] or c[4]:
            fix = [(lambda x: contiguous(x, 16)) if self.tma and i < 4 else (lambda x: unit_rows(x).owner)
                   for i in range(5)]
            q, k, v, do, o = (f(x) if cp else x for f, x, cp in zip(fix, (q, k, v, do, o), c))
        if self.copy_lse:
            lse = contiguous(lse)
        with sobj:
            dvec, dq_acc = self._workspace(stream)
            fill(dq_acc, 0)                               # queued on the stream: no host wait
            pq, pk, pv, pdo, po, plse, pd, pacc, pdq, pdk, pdv = _ptrs(a.torch, q, k, v, do, o, lse, dvec, dq_acc,
                                                                       dq, dk, dv)
            if self.do_rows:
                self.rowsum(self.rowsum_grid, (ROW_THREADS,), (pdo, po, pd, *self.rowsum_tail))
            if self.zero_dkv:
                fill(dk, 0)
                fill(dv, 0)
            elif self.do_main and self.tma:
                args = mapped_args(self._maps, (int(pq), int(pk), int(pv), int(pdo)),
                                   lambda: self._tma_template(q, k, v, do), (plse, pd, pdk, pdv, pacc))
                grid, block, smem = self.main_launch
                self.main(grid, block, args, shared_mem=smem)
            elif self.do_main:
                args = list(self.template)
                for i, p in zip(self.where, (pq, pk, pv, pdo, plse, pd, pdk, pdv, pacc)):
                    args[i] = p
                grid, block, smem = self.main_launch
                self.main(grid, block, tuple(args), shared_mem=smem)
            if self.do_rows:
                self.finish(self.finish_grid, (ROW_THREADS,), (pacc, pdq, *self.finish_tail))
        return dq, dk, dv


def cached_attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=None, config=None):
    """The backward through :data:`.plans.PLANS`: (dq, dk, dv), or NotImplemented without a plan."""
    plan = plan_for(lambda: backward_key(do, q, k, v, o, lse, causal, scale, window, config),
                    lambda: BackwardPlan(do, q, k, v, o, lse, causal=causal, scale=scale, window=window,
                                         config=config))
    if plan is None:
        return NotImplemented
    return plan.run(do, q, k, v, o, lse, check=False)
