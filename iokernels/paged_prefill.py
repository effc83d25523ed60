"""Prefill on a paged cache: a chunk of new queries per sequence, read through its block table.

Decode (:mod:`iokernels.decode`) brings one new query per sequence.  A server also has to
*prefill*: run a prompt's tokens through the model so that their K and V land in the cache.
A long prompt is cut into **chunks** (chunked prefill, as Sarathi-Serve and vLLM schedule
it), so that one step can mix a few prefill chunks with many decodes under one token
budget.  Each chunk's queries attend to *everything the sequence has cached so far*: the
earlier chunks (already in the pool) and the chunk itself.

The order of work, per chunk, is the one vLLM uses:

1. the chunk's K and V rows are appended to the sequence (:meth:`PagedKVCache.append`),
   so the cache now holds n tokens, the last n_q of them new;
2. the chunk's n_q queries attend to the sequence's n cached keys, with **bottom-right
   causal** masking: the query at chunk row i sits at position p = n - n_q + i and sees
   keys 0..p (:mod:`iokernels.core.conventions`: key j is visible iff j <= i + n - n_q).

A decode step is the chunk of one query: the same kernel serves both, so a mixed batch
is one call.  Queries are packed like :func:`iokernels.attention_varlen`'s: q is
(total_q, Hq, d), sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1].

The kernel (FlashAttention-2's loop order over a paged K/V):

* grid: (sequence, KV head, Q tile of ``block_q`` chunk rows); the g = Hq / Hkv query
  heads of a KV head are packed into the tile (block_q * g rows), as GQA kernels do, so
  each K/V block is read once per Q tile, not once per query head;
* the K/V tile is one cache block: the worker reads the block's table entry (int32), then
  its valid slots; a tile entirely in the future of the Q tile's last row is never read
  (causal skipping), and the unwritten tail of the last block never is;
* online softmax on chip; O and LSE written once.

Traffic (counted by running the kernel, and in closed form by :func:`traffic_model`):
per (sequence, KV head, Q tile) the tile's Q rows, the visible K/V blocks' valid rows and
their table entries (and a quantized cache's scales), then O and LSE.
"""
from __future__ import annotations

import numpy as np

from .core import conventions as cv
from .core.config import TileConfig
from .core.traffic import HBM, Traffic
from .decode import _tiles, paged_tile_loader
from .paged import SCALE_ITEMSIZE, storage_dtype

__all__ = ["DEFAULT_BLOCK_Q", "paged_prefill_tiled", "gather_then_attend", "traffic_model", "chunk_tiles",
           "block_q_of"]

#: chunk rows per Q tile when no config is given
DEFAULT_BLOCK_Q = 32


def block_q_of(config, block_size) -> int:
    """The Q tile rows a config asks for (its K tile must be the cache's block)."""
    if config is None:
        return DEFAULT_BLOCK_Q
    if not isinstance(config, TileConfig):
        raise ValueError(f"config: expected None or a TileConfig, got {type(config).__name__}")
    if config.block_k != block_size:
        raise ValueError(f"config: block_k must be the cache's block size {block_size} (the K/V tile is one "
                         f"block), got {config.block_k}; pass TileConfig(block_q=..., block_k={block_size})")
    return config.block_q


def chunk_tiles(n, n_q, block_q, block_size, causal=True):
    """Per Q tile of a chunk of n_q queries over n cached keys: (i0, i1, key tiles it reads).

    Key tiles are cut at block boundaries; with ``causal`` the tile of chunk rows [i0, i1)
    reads the keys [0, n - n_q + i1) (its last row's horizon), else all n keys.
    """
    out = []
    for i0 in range(0, n_q, block_q):
        i1 = min(i0 + block_q, n_q)
        horizon = n - n_q + i1 if causal else n
        out.append((i0, i1, _tiles(0, horizon, block_size)))
    return out


def paged_prefill_tiled(q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config=None):
    """Chunked prefill over a :class:`~iokernels.paged.PagedKVCache` (NumPy, counted).

    q (total_q, Hq, d) in the cache's dtype; sequence seq_ids[b]'s chunk is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1], and its K/V rows are already the last ones the
    cache holds for it.  Returns (O (total_q, Hq, d), LSE (Hq, total_q)).
    """
    total_q, Hq, d = q.shape
    bs, Hkv = cache.block_size, cache.num_kv_heads
    g = Hq // Hkv
    block_q = block_q_of(config, bs)
    scale = cv.default_scale(d) if scale is None else scale
    acc = cv.accum_dtype(np.dtype(q.dtype).name)
    cq = [int(x) for x in cu_seqlens_q]
    load, lens = paged_tile_loader(cache, seq_ids)
    Q = HBM(q, "Q")
    O = HBM.zeros(q.shape, q.dtype, "O")
    LSE = HBM.full((Hq, total_q), -np.inf, acc, "LSE")
    for b, n in enumerate(lens):                              # grid: (sequence, KV head, Q tile)
        n_q = cq[b + 1] - cq[b]
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            for i0, i1, tiles in chunk_tiles(n, n_q, block_q, bs, causal):
                rows = slice(cq[b] + i0, cq[b] + i1)
                m_rows = i1 - i0
                q_tile = Q[rows, heads].astype(acc).reshape(m_rows * g, d)    # load Q tile -> SRAM
                pos = (n - n_q + i0 + np.arange(m_rows)).repeat(g)            # each row's position
                o, lse = _online_softmax(q_tile, pos, tiles, lambda t, b=b, h=h: load(b, h, t), scale,
                                         acc, causal)
                O[rows, heads] = o.reshape(m_rows, g, d).astype(q.dtype)      # write O -> HBM
                LSE[heads, rows] = lse.reshape(m_rows, g).T                   # write LSE -> HBM
    return O.result(), LSE.result()


def gather_then_attend(attention, q, cache, seq_ids, cu_seqlens_q, *, causal=True, scale=None, config=None):
    """The paged prefill of a backend without a paged kernel: gather, then attend contiguously.

    Each sequence's K and V are copied out of the pool (:meth:`PagedKVCache.gather`) and
    ``attention`` (a backend's (q, k, v, causal, scale, window, config) -> (O, LSE)) runs on
    the contiguous copy, bottom-right causal.  The copy is the cost paging avoids in a
    paged kernel: it writes every cached row once more and reads it back.
    """
    total_q, Hq, d = q.shape
    scale = cv.default_scale(d) if scale is None else scale
    o = np.zeros_like(q)
    lse = np.full((Hq, total_q), -np.inf, dtype=cv.accum_dtype(np.dtype(q.dtype).name))
    for b, sid in enumerate(seq_ids):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        if rows.stop == rows.start:
            continue
        k, v = cache.gather(sid)
        ob, lb = attention(np.ascontiguousarray(q[rows].transpose(1, 0, 2))[None], k[None], v[None], causal=causal,
                           scale=scale, window=(-1, -1), config=config)
        o[rows] = np.asarray(ob)[0].transpose(1, 0, 2)
        lse[:, rows] = np.asarray(lb)[0]
    return o, lse


def _online_softmax(q_tile, pos, tiles, load_tile, scale, acc, causal):
    """One worker: FlashAttention-2's online softmax of q_tile's rows over the key tiles.

    The first tile holds key 0, which every row sees, so every row's maximum is finite
    after it; a later tile may hide a row entirely (its p is then 0).
    """
    rows, d = q_tile.shape
    m = np.full(rows, -np.inf, acc)
    l = np.zeros(rows, acc)
    o = np.zeros((rows, d), acc)
    for t in tiles:
        kj, vj = load_tile(t)                                 # load K_j, V_j -> SRAM (one block)
        s = scale * (q_tile @ kj.astype(acc).T)
        if causal and t[1] - 1 > pos[0]:                      # the tile crosses the diagonal: mask
            s = np.where(np.arange(t[0], t[1])[None, :] <= pos[:, None], s, -np.inf)
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        o = alpha[:, None] * o + p @ vj.astype(acc)
        m = m_new
    return o / l[:, None], m + np.log(l)


def traffic_model(*, heads_q, heads_kv, head_dim, seq_lens, chunk_lens, dtype="float32", block_size=16,
                  block_q=DEFAULT_BLOCK_Q, causal=True, kv_dtype=None):
    """Closed-form traffic of :func:`paged_prefill_tiled` (``traffic.model("paged_prefill", ...)``).

    Keywords: heads_q, heads_kv, head_dim; seq_lens (tokens each sequence holds, its chunk
    included) and chunk_lens (its new queries); dtype (of q and O), block_size, block_q,
    causal, kv_dtype (a quantized cache's storage).  Per (sequence, KV head, Q tile of m
    rows): m * g * d Q values read; each visible block's valid rows of K and V read, one
    int32 table entry per block (and, quantized, the block's float32 scale for this KV head
    from each pool); m * g * d O values and m * g LSE entries written.
    """
    s = storage_dtype(dtype).itemsize
    kv_s = s if kv_dtype is None else storage_dtype(kv_dtype).itemsize
    a = cv.accum_dtype(storage_dtype(dtype).name).itemsize
    g, d = heads_q // heads_kv, head_dim
    t = Traffic()
    for n, n_q in zip(seq_lens, chunk_lens):
        for i0, i1, tiles in chunk_tiles(int(n), int(n_q), block_q, block_size, causal):
            m_rows = i1 - i0
            keys = sum(y - x for x, y in tiles)
            t.add("Q", read=heads_kv * m_rows * g * d * s)
            t.add("block_table", read=heads_kv * len(tiles) * 4)
            t.add("K_cache", read=heads_kv * keys * d * kv_s)
            t.add("V_cache", read=heads_kv * keys * d * kv_s)
            if kv_dtype is not None:
                t.add("K_scale", read=heads_kv * len(tiles) * SCALE_ITEMSIZE)
                t.add("V_scale", read=heads_kv * len(tiles) * SCALE_ITEMSIZE)
            t.add("O", written=heads_kv * m_rows * g * d * s)
            t.add("LSE", written=heads_kv * m_rows * g * a)
    return t
