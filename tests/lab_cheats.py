"""Cheating solutions of the labs: each one calls the package's own implementation of the answer.

Without the reference guard several of them would pass (merge_states, split_kv_decode,
online_step: tests/test_labs_guard.py checks that too).  tests/test_labs_guard.py grades
each and expects a failure that names the function reached.

* ``CHEATS``: exercise -> solution that looks the package function up when it runs (``ik.decode``);
* ``ALIASED``: exercise -> solution that calls an alias bound when this module was imported,
  i.e. before grading (``from iokernels import merge_states as merge_alias``);
* ``NAMES``: exercise -> the dotted path the failure message must name.
"""
from __future__ import annotations

import sys

import numpy as np

import iokernels as ik
from iokernels import merge_states as merge_alias            # bound before any grading
from iokernels.core import reference as ref_module
from iokernels.core.reference import attention as oracle_alias
from iokernels.cupy_raw.launch import source as source_alias

_DECODE = sys.modules["iokernels.decode"]                    # the module (ik.decode is the function)
_Tile = ik.tiled._Tile
_online_alias = ik.tiled._online_step
_forward_alias = ik.tiled.forward_fa2
_backward_alias = ik.backward.attention_backward_tiled
_gather_alias = ik.paged.paged_gather
_append_alias = ik.paged.PagedKVCache.append


# --------------------------------------------------------------------------- builders
def _naive(traffic_model):
    def predict(Nq, Nk, d, itemsize, lse_itemsize):
        dtype = {8: "float64", 4: "float32", 2: "float16"}[itemsize]
        return traffic_model(batch=1, heads_q=1, heads_kv=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                             dtype=dtype).as_dict()

    def kernel(Q, K, V, S, P, O, LSE, scale):
        raise AssertionError("never reached: the prediction is graded first")
    return kernel, predict


def _online(step_fn):
    def online_step(m, l, o, s, v):
        seen = np.isfinite(s)
        tile = _Tile(0, 0, s.shape[1], seen)
        return step_fn(np.where(seen, s, 0.0), np.eye(s.shape[1]), v, tile, m, l, o, 1.0, np.dtype(np.float64))
    return online_step


def _forward(forward):
    def flash_forward(Q, K, V, O, LSE, *, Br, Bc, causal, scale):
        o, lse = forward(Q[:], K[:], V[:], causal=causal, scale=scale, window=None,
                         config=ik.TileConfig(block_q=Br, block_k=Bc))
        O[:] = o
        LSE[:] = lse
    return flash_forward


def _backward(backward):
    def flash_backward(Q, K, V, O, dO, LSE, D, dQaccum, dQ, dK, dV, *, Br, Bc, causal, scale):
        dq, dk, dv = backward(dO[:], Q[:], K[:], V[:], O[:], LSE[:], causal=causal, scale=scale, window=None,
                              config=ik.TileConfig(block_q=Br, block_k=Bc))
        dQ[:], dK[:], dV[:] = dq, dk, dv
    return flash_backward


def _merge(merge):
    return lambda o_parts, lse_parts: merge(o_parts, lse_parts)


def _decode(decode):
    def split_kv_decode(q, k, v, *, num_splits, scale):
        return decode(q, k, v, num_splits=num_splits, scale=scale)
    return split_kv_decode


def _gather(gather):
    def paged_gather(K_cache, V_cache, TABLE, K, V, seq_len):
        k, v = gather(K_cache[:], V_cache[:], TABLE[:], seq_len)
        K[:], V[:] = k, v
    return paged_gather


def _append(append):
    def append_token(table, seq_len, ref_counts, free_list, k_pool, v_pool, k_tok, v_tok):
        cache = ik.PagedKVCache(k_pool.shape[0], block_size=k_pool.shape[1], num_kv_heads=k_pool.shape[2],
                                head_dim=k_pool.shape[3], dtype=k_pool.dtype)
        append(cache, cache.new_sequence(), k_tok[None], v_tok[None])
        return table
    return append_token


def _kernel(attend, lse_only=False):
    """A "kernel" for the Numba labs whose every thread asks the package for the answer."""
    if lse_only:
        def row_lse_kernel(q, k, lse, scale, causal):
            attend(q, k, k, causal)
        return row_lse_kernel

    def flash_fwd_kernel(q, k, v, o, lse, scale, causal):
        attend(q, k, v, causal)
    return flash_fwd_kernel


def _cuda_source(source):
    return lambda: source("fa_v2")


# --------------------------------------------------------------------------- the tables
CHEATS = {
    "naive_traffic": _naive(lambda **kw: ik.naive.traffic_model(**kw)),
    "online_step": _online(lambda *a: ik.tiled._online_step(*a)),
    "flash_forward": _forward(lambda *a, **kw: ik.tiled.forward_fa2(*a, **kw)),
    "flash_backward": _backward(lambda *a, **kw: ik.backward.attention_backward_tiled(*a, **kw)),
    "merge_states": _merge(lambda o, lse: ik.merge_states(o, lse)),
    "split_kv_decode": _decode(lambda *a, **kw: ik.decode(*a, return_lse=True, **kw)),
    "paged_gather": _gather(lambda *a: ik.paged.paged_gather(*a)),
    "copy_on_write": _append(lambda cache, *a: cache.append(*a)),
    "numba_forward": _kernel(lambda q, k, v, causal: ik.reference.attention(q, k, v, causal)),
    "barrier_hunt": _kernel(lambda q, k, v, causal: ik.reference.attention(q, k, v, causal), lse_only=True),
    "cupy_online": _cuda_source(lambda name: sys.modules["iokernels.cupy_raw.launch"].source(name)),
}

ALIASED = {
    "naive_traffic": _naive(ik.naive.traffic_model),
    "online_step": _online(_online_alias),
    "flash_forward": _forward(_forward_alias),
    "flash_backward": _backward(_backward_alias),
    "merge_states": _merge(merge_alias),
    "split_kv_decode": _decode(_DECODE.decode_split_kv),
    "paged_gather": _gather(_gather_alias),
    "copy_on_write": _append(_append_alias),
    "numba_forward": _kernel(oracle_alias),
    "barrier_hunt": _kernel(ref_module.attention, lse_only=True),
    "cupy_online": _cuda_source(source_alias),
}

NAMES = {
    "naive_traffic": "iokernels.naive.traffic_model",
    "online_step": "iokernels.tiled._online_step",
    "flash_forward": "iokernels.tiled.forward_fa2",
    "flash_backward": "iokernels.backward.attention_backward_tiled",
    "merge_states": "iokernels.api.merge_states",
    "split_kv_decode": "iokernels.api.decode",
    "paged_gather": "iokernels.paged.paged_gather",
    "copy_on_write": "iokernels.paged.PagedKVCache.append",
    "numba_forward": "iokernels.core.reference.attention",
    "barrier_hunt": "iokernels.core.reference.attention",
    "cupy_online": "iokernels.cupy_raw.launch.source",
}
#: the aliased form reaches another route to the answer where it says so
ALIAS_NAMES = dict(NAMES, split_kv_decode="iokernels.decode.decode_split_kv")
