"""Count the Numba kernels' global-memory traffic by running them on the simulator.

On Numba's CUDA simulator a kernel is ordinary Python, run one thread at a time, so its
arguments can be any objects that index like arrays.  :class:`CountingArray` is such an
object: every element the kernel reads or writes is added to a
:class:`iokernels.core.traffic.Traffic` under the tensor's name.  Running a kernel on counting
arrays gives the bytes *the kernel as written* moves between global memory and the chip,
which the tests compare with the closed-form models of the NumPy versions it mirrors
(``traffic.model("fa2" | "decode" | "paged_decode" | "paged_gather")``).  A config None (or
without a version) runs the default version for the call, resolved by the registry.

Shared memory and registers are not counted: they are the on-chip side.  Caches are not
modelled either: a read that an L1/L2 cache would serve is still counted, as in the NumPy
versions.  Only on the simulator (a GPU cannot run Python objects): RuntimeError otherwise.
"""
from __future__ import annotations

import threading

import numpy as np

from ..core import conventions as cv
from ..core import gpu
from ..core.traffic import Traffic
from .decode import launch_decode, resolve_splits  # (nc.decode is the function)
from . import forward as fwd
from . import forward_v5 as fv5
from . import forward_v6 as fv6
from . import forward_v7 as fv7
from . import gather as gat
from .config import acc_dtype
from .device import word_layout
from .registry import REGISTRY, need


class CountingArray:
    """A NumPy array in "global memory": each element read or written is counted by name."""

    def __init__(self, data: np.ndarray, name: str, traffic: Traffic, lock: threading.Lock):
        self.data, self.name, self.traffic, self._lock = data, name, traffic, lock
        self.shape, self.dtype, self.ndim = data.shape, data.dtype, data.ndim

    def __getitem__(self, idx):
        value = self.data[idx]
        with self._lock:  # the simulator runs a block's threads as Python threads
            self.traffic.add(self.name, read=np.asarray(value).nbytes)
        return value

    def reshape(self, shape):
        """The same counted storage, another shape (as ``DeviceNDArray.reshape``)."""
        return CountingArray(self.data.reshape(shape), self.name, self.traffic, self._lock)

    def __setitem__(self, idx, value):
        self.data[idx] = value
        with self._lock:
            self.traffic.add(self.name, written=np.asarray(self.data[idx]).nbytes)


def _require_simulator():
    if not gpu.simulator_enabled():
        raise RuntimeError("counting runs the kernels as Python on Numba's CUDA simulator; start Python "
                           "with NUMBA_ENABLE_CUDASIM=1")


class _Counter:
    def __init__(self):
        self.traffic, self.lock = Traffic(), threading.Lock()

    def __call__(self, data, name):
        return CountingArray(np.ascontiguousarray(data), name, self.traffic, self.lock)


def count_attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """Run the forward kernel on counting arrays: returns (o, lse, Traffic)."""
    _require_simulator()
    B, Hq, Nq, d = q.shape
    dtype = q.dtype.name
    _, cfg = REGISTRY.resolve("attention", config, need("attention", q=q, k=k, v=v, causal=causal, window=window))
    cfg = cfg.resolved(d, dtype)
    scale = cv.resolve_scale(scale, d)
    c = _Counter()
    o = c(np.zeros(q.shape, q.dtype), "O")
    lse = c(np.zeros((B, Hq, Nq), acc_dtype(dtype)), "LSE")
    run = {"v5": fv5.launch, "v6": fv6.launch, "v7": fv7.launch}.get(cfg.version, fwd.launch)
    run(cfg, c(q, "Q"), c(k, "K"), c(v, "V"), o, lse, causal=causal, scale=scale, window=cv.resolve_window(window))
    return o.data, lse.data, c.traffic


def _count_decode(q, k, v, tables, lens, num_splits, scale, block_n, paged, names, cfg):
    _require_simulator()
    if cfg.version != "v1":              # K and V as the launcher's 8-byte words (same bytes)
        word, epw = word_layout(q.dtype.name, q.shape[-1])
        if epw > 1:
            k, v = (np.ascontiguousarray(x).view(np.dtype(word)) for x in (k, v))
    B, Hq, d = q.shape
    Hkv = k.shape[2] if paged else k.shape[1]
    acc = acc_dtype(q.dtype.name)
    S = resolve_splits(num_splits, B, Hkv, int(np.max(lens, initial=0)), block_n, cfg.version)
    scale = cv.resolve_scale(scale, d)
    c = _Counter()
    o, lse = c(np.zeros((B, Hq, d), q.dtype), "O"), c(np.zeros((B, Hq), acc), "LSE")
    op = c(np.zeros((S, B, Hq, d) if S > 1 else (1, 1, 1, 1), acc), "O_partial")
    lp = c(np.zeros((S, B, Hq) if S > 1 else (1, 1, 1), acc), "LSE_partial")
    launch_decode(c(q, "Q"), c(k, names[0]), c(v, names[1]), c(tables, "block_table"), c(lens, "seq_lens"),
                  o, lse, op, lp, scale=scale, block_n=block_n, paged=paged, config=cfg,
                  split=REGISTRY.get("paged_decode" if paged else "decode", cfg.version).args)
    return o.data, lse.data, c.traffic


def count_decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """Run split (+ combine) on counting arrays over a contiguous cache: (o, lse, Traffic)."""
    from ..decode import DEFAULT_BLOCK_N
    _, cfg = REGISTRY.resolve("decode", config, need("decode", q=q, k=k, v=v))
    B, N = k.shape[0], k.shape[2]
    lens = np.full(B, N, np.int32) if seq_lens is None else np.asarray(seq_lens, np.int32)
    return _count_decode(q, k, v, np.zeros((1, 1), np.int32), lens, num_splits, scale, DEFAULT_BLOCK_N,
                         False, ("K", "V"), cfg)


def count_paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None):
    """The paged split (+ combine) on counting arrays: (o, lse, Traffic)."""
    _, cfg = REGISTRY.resolve("paged_decode", config, need("paged_decode", q=q, cache=cache))
    tables, lens = cache.block_tables_array(list(seq_ids))
    if tables.size == 0:
        tables = np.zeros((len(lens), 1), np.int32)
    return _count_decode(q, cache.k_pool, cache.v_pool, tables, lens, num_splits, scale, cache.block_size,
                         True, ("K_cache", "V_cache"), cfg)


def count_gather(cache, sid, *, config=None):
    """The gather kernel on counting arrays: (k, v, Traffic).  v1 copies elements here (the
    same bytes as its launcher's words), v3 8-byte words when the rows allow."""
    _require_simulator()
    _, cfg = REGISTRY.resolve("paged_gather", config, need("paged_gather", cache=cache))
    n, table = cache.seq_len(sid), np.asarray(cache.block_table(sid), np.int32)
    hkv, d = cache.num_kv_heads, cache.head_dim
    c = _Counter()
    if table.size == 0:
        table = np.zeros(1, np.int32)
    if cfg.version == "v1":
        k_out, v_out = c(np.zeros((hkv, n, d), cache.dtype), "K"), c(np.zeros((hkv, n, d), cache.dtype), "V")
        gat.launch_gather(c(cache.k_pool, "K_cache"), c(cache.v_pool, "V_cache"), c(table, "block_table"),
                          k_out, v_out, n)
        return k_out.data, v_out.data, c.traffic
    word, _ = word_layout(np.dtype(cache.dtype).name, d)
    wd = np.dtype(word)
    k_out, v_out = np.zeros((hkv, n, d), cache.dtype), np.zeros((hkv, n, d), cache.dtype)
    ko, vo = c(k_out.view(wd), "K"), c(v_out.view(wd), "V")
    gat.launch_gather_v3(c(np.ascontiguousarray(cache.k_pool).view(wd), "K_cache"),
                         c(np.ascontiguousarray(cache.v_pool).view(wd), "V_cache"), c(table, "block_table"),
                         ko, vo, n, config=cfg)
    return ko.data.view(cache.dtype), vo.data.view(cache.dtype), c.traffic
