"""Prefill on a paged cache in Numba CUDA: one launch for a packed batch of chunks.

Read this next to :func:`iokernels.paged_prefill.paged_prefill_tiled`: its three host loops
(sequence, KV head, Q tile) become the grid, and its loop over the cache blocks stays a
loop inside one thread block.

* grid ``(max Q tiles of a chunk, sequences, KV heads)``, as FlashAttention-2's varlen
  kernels launch but by KV head, the group packed, where theirs go by query head (code,
  Dao-AILab/flash-attention ``flash_fwd_launch_template.h``): thread
  block (x, b, h) reads sequence b's offsets from ``cu_seqlens_q`` and its length on the
  device, and exits when its chunk has fewer than x + 1 tiles.  The host sizes the grid by
  the longest chunk and loops over no sequence.
* a thread block holds ``block_q`` chunk rows times the g = Hq / Hkv query heads of its KV
  head (GQA packed, one thread a packed row), so each K/V block is read once per Q tile;
* the K/V tile is one cache block: the threads read its table entry, stage its valid rows
  in shared memory together, ``syncthreads``, and each thread folds them into its row's
  running (m, l, O) (the online softmax); blocks entirely in the future of the tile's last
  row are never read (causal skipping), nor is the unwritten tail of the last block;
* bottom-right causal masking per sequence: chunk row i of a sequence holding n tokens, of
  which the chunk is the last n_q, sees keys 0 .. n - n_q + i;
* a row that sees no key writes O = 0 and LSE = -inf.

Accumulation in float32 (float64 for float64 input); float16 rows are widened on load.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core import conventions as cv
from . import launch as ln
from .config import MAX_THREADS, SHARED_LIMIT_BYTES, PrefillConfig, acc_dtype
from .decode import pools_like
from .launch import cuda
import numba  # noqa: E402  (after the NumPy fix, through .launch)

#: the packed rows (chunk rows x query heads of a KV head) a thread block aims for by default
DEFAULT_ROWS = 64


@functools.lru_cache(maxsize=None)
def make_prefill(D: int, G: int, BQ: int, BS: int, acc_name: str):
    """The kernel for head dim D, g = G query heads a KV head, BQ chunk rows a tile, BS keys a block."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO = (np.dtype(acc_name).type(x) for x in (-np.inf, 0))
    ROWS = BQ * G

    def paged_prefill(q, k_pool, v_pool, tables, lens, cu, o, lse, scale, causal):
        tile, b, h = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        q0, n = cu[b], lens[b]
        n_q = cu[b + 1] - q0
        i0 = tile * BQ
        if i0 >= n_q:                                       # this chunk has fewer tiles: the whole block exits
            return
        t = cuda.threadIdx.x
        r, hq = t // G, h * G + t % G                        # chunk row i0 + r, query head hq
        i = i0 + r
        live = i < n_q
        last = min(i0 + BQ, n_q)
        horizon = n - n_q + last if causal else n           # keys the tile's last row sees
        pos = n - n_q + i                                    # this row's position in its sequence
        hi = n
        if causal:
            hi = min(pos + 1, n)
        k_s = cuda.shared.array((BS, D), ACC)               # SRAM: one cache block of K, of V
        v_s = cuda.shared.array((BS, D), ACC)
        q_i = cuda.local.array(D, ACC)
        o_i = cuda.local.array(D, ACC)
        for dd in range(D):
            o_i[dd] = ZERO
            q_i[dd] = ACC(q[q0 + i, hq, dd]) if live else ZERO  # read q_i <- HBM (once)
        m_i, l_i = NEG_INF, ZERO
        for j0 in range(0, horizon, BS):                    # K/V tiles: the visible blocks
            blk = tables[b, j0 // BS]                        # the block table entry
            rows = min(BS, n - j0)                           # the last block's valid slots only
            for e in range(t, rows * D, ROWS):               # stage K_j, V_j -> SRAM together
                jj, dd = e // D, e % D
                k_s[jj, dd] = ACC(k_pool[blk, jj, h, dd])
                v_s[jj, dd] = ACC(v_pool[blk, jj, h, dd])
            cuda.syncthreads()
            if live:
                for jj in range(min(rows, hi - j0)):         # this row's visible keys of the block
                    dot = ZERO
                    for dd in range(D):
                        dot += q_i[dd] * k_s[jj, dd]
                    s = scale * dot
                    if s > m_i:                              # online softmax: rescale on a new max
                        alpha = math.exp(m_i - s) if m_i > NEG_INF else ZERO
                        l_i = l_i * alpha
                        for dd in range(D):
                            o_i[dd] *= alpha
                        m_i = s
                    p = math.exp(s - m_i)
                    l_i += p
                    for dd in range(D):
                        o_i[dd] += p * v_s[jj, dd]
            cuda.syncthreads()
        if live:
            for dd in range(D):                              # write O -> HBM (0 for a row that sees no key)
                o[q0 + i, hq, dd] = o_i[dd] / l_i if l_i > ZERO else ZERO
            lse[hq, q0 + i] = m_i + math.log(l_i) if l_i > ZERO else NEG_INF

    return paged_prefill


def rows_of(config: PrefillConfig, g: int) -> int:
    """Chunk rows a Q tile: config.block_q, or as many as make DEFAULT_ROWS packed rows (at least 1)."""
    return config.block_q if config.block_q is not None else max(1, DEFAULT_ROWS // g)


def smem_bytes(block_size: int, head_dim: int, dtype: str) -> int:
    """Shared memory of one thread block: a cache block of K and of V in the accumulator type."""
    return 2 * block_size * head_dim * np.dtype(acc_dtype(dtype)).itemsize


def launch_reason(config: PrefillConfig, g: int, block_size: int, head_dim: int, dtype: str) -> str | None:
    """Why this launch shape cannot run (threads or shared memory), or None."""
    threads = rows_of(config, g) * g
    if threads > MAX_THREADS:
        return (f"block_q: {rows_of(config, g)} chunk rows x {g} query heads a KV head = {threads} threads, more "
                f"than {MAX_THREADS}; choose block_q <= {max(1, MAX_THREADS // g)}")
    need = smem_bytes(block_size, head_dim, dtype)
    if need > SHARED_LIMIT_BYTES:
        return (f"cache: a block of {block_size} keys at head_dim {head_dim} ({dtype}) needs {need:,} B of shared "
                f"memory for K and V, more than {SHARED_LIMIT_BYTES:,}")
    return None


def paged_prefill_pools(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                        config: PrefillConfig):
    """Paged prefill over pools (num_blocks, block_size, Hkv, d) of any array kind: (O, LSE).

    block_tables (B, max_blocks) int32, seq_lens (B,), cu_seqlens_q (B + 1,): host arrays (they
    size the grid), uploaded once per content."""
    call = ln.call_for(q)
    call.check(k_pool, "k_pool")
    call.check(v_pool, "v_pool")
    dtype = ln.check_dtype(q, "q")
    total_q, Hq, d = (int(x) for x in q.shape)
    bs, Hkv = int(k_pool.shape[1]), int(k_pool.shape[2])
    g = Hq // Hkv
    why = launch_reason(config, g, bs, d, dtype)
    if why is not None:
        raise ValueError(why if why.startswith("cache") else f"config.{why}")
    scale = cv.resolve_scale(scale, d)
    acc = acc_dtype(dtype)
    cq = np.asarray(cu_seqlens_q, np.int32)
    lens_h = np.asarray(seq_lens, np.int32)
    tables_h = np.asarray(block_tables, np.int32)
    if tables_h.ndim != 2 or tables_h.shape[1] == 0:
        tables_h = np.zeros((len(lens_h), 1), np.int32)
    BQ = rows_of(config, g)
    o_h, o_d = ln.empty(call, (total_q, Hq, d), dtype)
    lse_h, lse_d = ln.empty(call, (Hq, total_q), acc)
    B = len(lens_h)
    tiles = int(-(-np.diff(cq).max(initial=0) // BQ))
    if B and tiles and total_q:
        dq, dk, dv = (ln.device_in(call, x, n) for x, n in ((q, "q"), (k_pool, "k_pool"), (v_pool, "v_pool")))
        kern = ln.jitted(make_prefill(d, g, BQ, bs, np.dtype(acc).name))
        kern[(tiles, B, Hkv), BQ * g, ln.stream(call)](
            dq, dk, dv, ln.upload_constant(tables_h), ln.upload_constant(lens_h), ln.upload_constant(cq), o_d, lse_d,
            acc(scale), np.int32(bool(causal)))
    return call.finish(o_h, dtype), call.finish(lse_h, np.dtype(acc).name)


def paged_prefill(q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config: PrefillConfig):
    """The launcher of ``ik.paged_prefill(..., backend="numba")``: the cache's NumPy pools are
    copied to the device as the caller's kind, then one launch runs every chunk."""
    tables, lens = cache.block_tables_array(list(seq_ids))
    call = ln.call_for(q)
    k_pool, v_pool = pools_like(call, cache)
    return paged_prefill_pools(q, k_pool, v_pool, tables, lens, cu_seqlens_q, causal=causal, scale=scale,
                               config=config)
