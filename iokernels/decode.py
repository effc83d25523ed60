"""Step 4: Flash-Decoding: split the KV cache across workers, merge exactly by log-sum-exp.

At decode time each sequence brings one new query token.  A FlashAttention kernel gives
one thread block to each (sequence, head) pair and walks the keys in order: batch 1 with
32 heads launches about 32 thread blocks on a 132-SM H100, and most of the GPU idles while
those few blocks stream a long cache.  Flash-Decoding (Dao and collaborators, Stanford
CRFM write-up, 2023) also splits the *keys* into ``num_splits`` chunks: each (sequence,
KV head, split) is a thread block that writes a partial output O_s and its log-sum-exp
LSE_s to HBM, and a small second kernel merges them exactly:

    LSE = log sum_s exp(LSE_s),     O = sum_s exp(LSE_s - LSE) * O_s.

This holds because each O_s is already normalized by its own softmax sum l_s = exp(LSE_s):
weighting by l_s / sum l recovers the softmax over all keys.  Splits with no keys have
LSE_s = -inf and weigh nothing; if every split is empty, O = 0 and LSE = -inf.

Notation
========

=========  ===========================================================
B          batch: sequences, one new query token each
Hq, Hkv    query heads and KV heads; g = Hq / Hkv query heads per KV head
N, n_b     cache length (padded) and sequence b's length (``seq_lens``)
d          head dim
Bc         keys per tile (``block_n``; 16, vLLM's block size, so contiguous and
           paged decode tile a sequence the same way)
Tc         tiles of sequence b, ceil(n_b / Bc)
S          ``num_splits``; split s takes tiles [s*ceil(Tc/S), (s+1)*ceil(Tc/S))
m, l       running row max and softmax sum of a split (online softmax)
O_s, LSE_s a split's partial output and log-sum-exp (written to HBM)
O, LSE     the merged result
(l, r)     ``window``: the query is position n_b - 1 (bottom-right), so it sees
           keys [n_b - 1 - l, n_b); keys left of that are never split or read
=========  ===========================================================

GQA is packed: a thread block handles one KV head and all g query heads that read it, so
each K/V row loaded from HBM serves g query rows (decode intensity is about g FLOP/byte).

The versions, side by side (each checked against :func:`iokernels.core.reference.decode`):

* v1 :func:`decode_naive`: materialize the scores S (B, Hq, N) and probabilities P in HBM,
  the way step 1 does prefill.  Traffic adds 4 * B * Hq * N scalars.
* v2 :func:`decode_split_kv`: FlashAttention's online softmax over tiles of Bc keys, the
  keys split S ways, partial O_s, LSE_s in HBM, then :func:`merge_kernel`.  With S = 1 it
  is plain FlashAttention decode: O and LSE written once, no merge.
* v3 :func:`paged_decode_split_kv`: v2 reading K and V through a PagedKVCache's block
  table, one block (page) per tile, never gathering the whole cache.  A quantized cache
  (1-byte fp8 or int8 values with per-block scales) is dequantized as each tile arrives.

v2 and v3 are one launch, :func:`split_kv_grid`, given different tile loaders (and so is
multi-head latent attention's decode, :mod:`iokernels.mla`); :func:`split_kv_model` is the
closed form of its traffic.

Measured (counted HBM bytes, B = 1, Hq = 32, Hkv = 8, N = 4096, d = 128, fp16; K + V alone
are 16.78 MB): v1 18.89 MB (S and P add 2.1 MB); v2 with S = 1 16.79 MB; S = 8 17.12 MB;
S = None (the heuristic picks 14 with tiles of 16 on 132 SMs) 17.36 MB.  v3 moves the same
bytes as v2 plus 4 bytes of block table per (KV head, block).

Frank notes
-----------
* These are NumPy loops written to show the work decomposition (one loop iteration is one
  GPU thread block); they are slow, and timing them says nothing about a GPU.
* The split kernel writes S partial results per (sequence, head) and reads them back:
  S * B * Hq * (d + 1) accumulator values each way.  For short caches or large batches that
  overhead is not worth it, which is why the heuristic picks S = 1 there.
* :func:`occupancy_splits` is modelled on FlashAttention-2's occupancy rule (see its
  docstring); the default SM count is an H100's, a named assumption, not a measurement.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .core import conventions as cv
from .core.traffic import HBM, Traffic
from .core.splits import split_range, visible_first
from .paged import SCALE_ITEMSIZE, dequantize, storage_dtype

__all__ = ["decode_naive", "decode_split_kv", "paged_decode_split_kv", "split_kv_grid", "paged_tile_loader",
           "merge_states", "merge_kernel", "occupancy_splits", "split_ranges", "visible_start",
           "traffic_model", "traffic_model_paged", "traffic_model_naive", "split_kv_model",
           "perturbed_decode_error_bound", "decode_bytes_per_token", "decode_flops", "decode_time_bound",
           "DEFAULT_NUM_SMS", "DEFAULT_BLOCK_N", "MAX_SPLITS"]

#: keys per tile of the NumPy decode kernels: vLLM's block size, so that contiguous and
#: paged decode tile (and therefore split) a sequence identically.
DEFAULT_BLOCK_N = 16
#: SMs the num_splits=None heuristic assumes when not told: an H100 SXM has 132.
DEFAULT_NUM_SMS = 132
#: FlashAttention-2 never splits more than 128 ways (its combine kernel's limit).
MAX_SPLITS = 128
#: FlashAttention-2 stops splitting when the grid already fills 80% of the SMs.
FULL_GRID_FRACTION = 0.8
#: ... and takes the fewest splits whose wave efficiency is within 85% of the best.
EFFICIENCY_FRACTION = 0.85


# --------------------------------------------------------------------------- the heuristic
def occupancy_splits(batch, heads_kv, seqlen, num_sms=DEFAULT_NUM_SMS, *, block_n=DEFAULT_BLOCK_N,
                         max_splits=MAX_SPLITS, q_tiles=1, return_efficiency=False):
    """How many ways to split the keys: FlashAttention-2's occupancy rule, written out.
    (FlashAttention-2's flash_api.cpp applies it to twice the SMs, two of its 128-thread blocks
    an SM; here a wave is ``num_sms`` blocks.)

    The grid without splitting has ``batch * heads_kv * q_tiles`` thread blocks (q_tiles:
    tiles of packed query rows, 1 for decode).  With S splits it has S times as many, run
    in waves of ``num_sms`` blocks; a wave that is only partly full wastes SMs.

    1. If the unsplit grid already fills FULL_GRID_FRACTION (80%) of the SMs, S = 1.
    2. Candidates S = 1 .. min(max_splits, num_sms, Tc) with Tc = ceil(seqlen / block_n); an S
       is eligible only if it changes the tiles per split, ceil(Tc / S) != ceil(Tc / (S-1))
       (otherwise it only adds empty splits).
    3. Efficiency of S: waves = blocks * S / num_sms, efficiency = waves / ceil(waves).
    4. Return the smallest eligible S whose efficiency is >= EFFICIENCY_FRACTION (85%) of
       the best: fewer splits mean less partial-result traffic.

    With ``return_efficiency`` also returns the list of efficiencies (0 for ineligible S).
    """
    for name, v in (("batch", batch), ("heads_kv", heads_kv), ("seqlen", seqlen)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
    for name, v in (("num_sms", num_sms), ("block_n", block_n), ("max_splits", max_splits), ("q_tiles", q_tiles)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    blocks = batch * heads_kv * q_tiles
    tiles = -(-seqlen // block_n)
    if blocks >= FULL_GRID_FRACTION * num_sms or tiles <= 1:
        return (1, [1.0]) if return_efficiency else 1
    top = min(max_splits, num_sms, tiles)

    def eligible(s):
        return s == 1 or -(-tiles // s) != -(-tiles // (s - 1))

    eff = []
    for s in range(1, top + 1):
        if not eligible(s):
            eff.append(0.0)
            continue
        waves = blocks * s / num_sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    choice = next(s for s in range(1, top + 1) if eligible(s) and eff[s - 1] >= EFFICIENCY_FRACTION * best)
    return (choice, eff) if return_efficiency else choice


def split_ranges(seq_len, num_splits, block_n=DEFAULT_BLOCK_N, start=0):
    """The key range [start, stop) of each split of the keys [start, seq_len) of a sequence.

    The tiles are the ``block_n``-aligned blocks of the whole sequence that meet
    [start, seq_len) (so contiguous and paged decode tile alike, and a sliding window's
    first tile is the partial block holding ``start``).  They are dealt out in contiguous
    runs of ceil(Tc / S); trailing splits may be empty (start == stop), as in
    FlashAttention-2.  Keys before ``start`` belong to no split: they are never read.
    This is :func:`iokernels.core.splits.split_range` with granule Bc, the contract every
    backend shares (the CUDA kernels deal single keys: granule 1).
    """
    return [split_range(seq_len, num_splits, s, block_n, start) for s in range(num_splits)]


def visible_start(seq_len, window=None):
    """The first key the decode query of a sequence of ``seq_len`` keys sees.

    The one query sits at the last position (bottom-right alignment), so with
    window (left, right) it sees key j iff j >= seq_len - 1 - left; ``right`` cannot
    reach past the end, and left = -1 (unbounded) gives 0.
    """
    return visible_first(seq_len, cv.resolve_window(window)[0])


def _resolve_splits(num_splits, batch, heads_kv, max_len, block_n):
    if num_splits is None:
        return occupancy_splits(batch, heads_kv, max_len, DEFAULT_NUM_SMS, block_n=block_n)
    return int(num_splits)


def _lens(seq_lens, batch, n):
    return [n] * batch if seq_lens is None else [int(x) for x in np.asarray(seq_lens)]


def _starts(lens, window):
    """Per sequence, the first visible key; the heuristic sees the longest visible run."""
    starts = [visible_start(n, window) for n in lens]
    return starts, max((n - a for n, a in zip(lens, starts)), default=0)


# --------------------------------------------------------------------------- the merge
def merge_states(o_parts, lse_parts):
    """Exact log-sum-exp merge over axis 0: o_parts (S, ..., d), lse_parts (S, ...) -> (o, lse).

    LSE = LSE_max + log sum_s exp(LSE_s - LSE_max) and O = sum_s exp(LSE_s - LSE) O_s, in the
    accumulator precision.  Parts with LSE -inf weigh exactly 0 (their O is not even
    multiplied, so a NaN there cannot leak); all parts -inf gives O = 0, LSE = -inf.
    O comes back in o_parts' dtype, LSE in float32 (float64 for float64 inputs).
    """
    o_parts, lse_parts = np.asarray(o_parts), np.asarray(lse_parts)
    acc = cv.accum_dtype("float64" if np.float64 in (o_parts.dtype, lse_parts.dtype) else "float32")
    lse_s = lse_parts.astype(acc)
    m = lse_s.max(axis=0)                                     # LSE_max per row
    empty = np.isneginf(m)                                    # every part empty
    m_safe = np.where(empty, 0.0, m)
    live = ~np.isneginf(lse_s)
    w = np.where(live, np.exp(np.where(live, lse_s - m_safe, 0.0)), 0.0)   # exp(LSE_s - LSE_max)
    total = w.sum(axis=0)                                     # >= 1 for non-empty rows
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
    wn = w / np.where(empty, 1.0, total)                      # exp(LSE_s - LSE)
    o = np.where(live[..., None], o_parts.astype(acc), 0.0)
    o = (wn[..., None] * o).sum(axis=0)
    return o.astype(o_parts.dtype), lse.astype(acc)


def merge_kernel(O_part: HBM, LSE_part: HBM, O: HBM, LSE: HBM):
    """The second kernel: one thread block per (sequence, query head) row, counted in HBM.

    Reads all S partial rows (O_s and LSE_s), writes the merged O and LSE once.
    """
    S, B, Hq, d = O_part.shape
    for b in range(B):                                        # grid: one block per sequence ...
        lse_s = LSE_part[:, b]                                # load LSE_s (S, Hq) -> SRAM
        o_s = O_part[:, b]                                    # load O_s (S, Hq, d) -> SRAM
        o, lse = merge_states(o_s, lse_s)
        O[b] = o.astype(O.dtype)                              # write O_b -> HBM
        LSE[b] = lse                                          # write LSE_b -> HBM


# --------------------------------------------------------------------------- v1 naive
def _no_config(config, what):
    if config is not None:
        raise ValueError(f"config: {what} has no config, got {type(config).__name__}")


def _block_n(config, default=DEFAULT_BLOCK_N) -> int:
    """Keys per tile: ``config.block_k`` of a TileConfig, or ``default``."""
    if config is None:
        return default
    from .core.config import TileConfig
    if not isinstance(config, TileConfig):
        raise ValueError(f"config: expected a TileConfig (its block_k is the keys per tile) or None, "
                         f"got {type(config).__name__}")
    return config.block_k


def decode_naive(q, k, v, *, seq_lens=None, num_splits=None, scale=None, window=None, config=None):
    """v1: scores and probabilities materialized in HBM (num_splits is ignored).

    q (B, Hq, d); k, v (B, Hkv, N, d).  With ``window`` only the visible keys
    [:func:`visible_start`, n) are read and scored.  Returns (O (B, Hq, d), LSE (B, Hq)).
    """
    _no_config(config, "the naive decode")
    B, Hq, d = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = cv.default_scale(d) if scale is None else scale
    acc = cv.accum_dtype(q.dtype.name)
    lens = _lens(seq_lens, B, N)
    starts, _ = _starts(lens, window)
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    S_ = HBM.zeros((B, Hq, N), acc, "S")
    P_ = HBM.zeros((B, Hq, N), acc, "P")
    O = HBM.zeros((B, Hq, d), q.dtype, "O")
    LSE = HBM.full((B, Hq), -np.inf, acc, "LSE")
    kvh = cv.kv_head_index(Hq, Hkv)
    for b in range(B):
        a, n = starts[b], lens[b]                             # visible keys [a, n)
        if n == 0:
            O[b] = np.zeros((Hq, d), q.dtype)                 # write Hq*d
            LSE[b] = np.full(Hq, -np.inf, acc)                # write Hq
            continue
        qb = Q[b].astype(acc)                                 # read Hq*d
        kb = K[b, :, a:n].astype(acc)                         # read Hkv*(n-a)*d
        S_[b, :, a:n] = scale * np.einsum("hd,hnd->hn", qb, kb[kvh])   # write Hq*(n-a)
        s = S_[b, :, a:n]                                     # read Hq*(n-a)
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        P_[b, :, a:n] = p / l                                 # write Hq*(n-a)
        p = P_[b, :, a:n]                                     # read Hq*(n-a)
        vb = V[b, :, a:n].astype(acc)                         # read Hkv*(n-a)*d
        O[b] = np.einsum("hn,hnd->hd", p, vb[kvh]).astype(q.dtype)   # write Hq*d
        LSE[b] = (m + np.log(l))[:, 0]                        # write Hq
    return O.result(), LSE.result()


def traffic_model_naive(*, batch, heads_q, heads_kv, head_dim, seq_lens, dtype="float32", window=None):
    """Closed-form traffic of :func:`decode_naive` (seq_lens: one length per sequence)."""
    s, a = storage_dtype(dtype).itemsize, cv.accum_dtype(storage_dtype(dtype).name).itemsize
    d = head_dim
    t = Traffic()
    for length in _lens(seq_lens, batch, None):
        n = length - visible_start(length, window)            # keys scored
        if length:
            t.add("Q", read=heads_q * d * s)
            t.add("K", read=heads_kv * n * d * s)
            t.add("V", read=heads_kv * n * d * s)
            t.add("S", read=heads_q * n * a, written=heads_q * n * a)
            t.add("P", read=heads_q * n * a, written=heads_q * n * a)
        t.add("O", written=heads_q * d * s)
        t.add("LSE", written=heads_q * a)
    return t


# --------------------------------------------------------------------------- v2 split-KV
def _tiles(a, z, block_n):
    """The tiles of keys [a, z): cut at the block_n-aligned boundaries of the sequence."""
    cuts = [a] + list(range((a // block_n + 1) * block_n, z, block_n)) + [z]
    return [(x, y) for x, y in zip(cuts[:-1], cuts[1:]) if y > x]


def _split_worker(q_grp, load_tile, tiles, scale, acc, dv=None):
    """One thread block: online softmax of g packed query rows over its tiles.

    q_grp (g, d) is in SRAM; ``load_tile(t)`` loads K_j (Bc, d), V_j (Bc, dv) -> SRAM
    (dv: the value width, d unless given; multi-head latent attention's differs).
    Returns the split's normalized O_s (g, dv) and LSE_s (g,).
    """
    g, d = q_grp.shape
    d = d if dv is None else dv
    m = np.full(g, -np.inf, acc)                              # running row max
    l = np.zeros(g, acc)                                      # running softmax sum
    o = np.zeros((g, d), acc)                                 # unnormalized output
    for t in tiles:                                           # load K_j, V_j -> SRAM
        kj, vj = load_tile(t)
        s = scale * (q_grp @ kj.astype(acc).T)                # S_ij (g, Bc), on chip
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)                             # rescale old sum and output
        p = np.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        o = alpha[:, None] * o + p @ vj.astype(acc)
        m = m_new
    if not len(tiles):                                        # an empty split
        return np.zeros((g, d), acc), np.full(g, -np.inf, acc)
    return o / l[:, None], m + np.log(l)


def split_kv_grid(q, load, *, lens, starts, num_splits, block_n, heads_kv, scale, value_dim=None):
    """The split-KV launch both decode versions (and MLA's) share: workers, then the merge.

    q (B, Hq, d) in HBM; ``load(b, h, t)`` loads tile t = (start, stop) of KV head h of
    sequence b -> SRAM and returns (K_j (Bc, d), V_j (Bc, dv)), counting its own HBM reads
    (so a cache layout decides what a tile costs).  Sequence b's keys are
    [starts[b], lens[b]), split ``num_splits`` ways.  With one split the workers write O and
    LSE directly; otherwise partial O_s, LSE_s go to HBM and :func:`merge_kernel` combines
    them.  Returns (O (B, Hq, dv), LSE (B, Hq)).
    """
    B, Hq, d = q.shape
    g = Hq // heads_kv
    dv = d if value_dim is None else value_dim
    S = num_splits
    acc = cv.accum_dtype(q.dtype.name)
    Q = HBM(q, "Q")
    O = HBM.zeros((B, Hq, dv), q.dtype, "O")
    LSE = HBM.full((B, Hq), -np.inf, acc, "LSE")
    if S > 1:                                                 # partial results live in HBM
        O_part = HBM.zeros((S, B, Hq, dv), acc, "O_partial")
        LSE_part = HBM.full((S, B, Hq), -np.inf, acc, "LSE_partial")
    for b in range(B):                                        # grid: (sequence, KV head, split)
        for h in range(heads_kv):
            rows = slice(h * g, (h + 1) * g)                  # the g query heads of KV head h
            for s, (a, z) in enumerate(split_ranges(lens[b], S, block_n, starts[b])):
                tiles = _tiles(a, z, block_n)
                if tiles:
                    q_grp = Q[b, rows].astype(acc)            # load Q group (g, d) -> SRAM
                else:
                    q_grp = np.zeros((g, d), acc)             # empty split: Q not loaded
                o_s, lse_s = _split_worker(q_grp, lambda t, b=b, h=h: load(b, h, t), tiles, scale, acc, dv)
                if S > 1:
                    O_part[s, b, rows] = o_s                  # write O_s -> HBM
                    LSE_part[s, b, rows] = lse_s              # write LSE_s -> HBM
                else:
                    O[b, rows] = o_s.astype(q.dtype)          # write O -> HBM
                    LSE[b, rows] = lse_s                      # write LSE -> HBM
    if S > 1:
        merge_kernel(O_part, LSE_part, O, LSE)
    return O.result(), LSE.result()


def decode_split_kv(q, k, v, *, seq_lens=None, num_splits=None, scale=None, window=None,
                    block_n=None, config=None):
    """v2: Flash-Decoding over a contiguous cache: split-KV workers, then the merge kernel.

    q (B, Hq, d); k, v (B, Hkv, N, d); sequence b uses keys [0, seq_lens[b]).
    num_splits None: :func:`occupancy_splits` (with DEFAULT_NUM_SMS).  With one split the
    workers write O and LSE directly and no merge runs.  ``window`` (left, right): only the
    keys [:func:`visible_start`, n) are split and read, so a sliding window's traffic
    grows with the window, not with n.  Keys per tile: ``block_n``, else ``config.block_k``
    (a TileConfig), else DEFAULT_BLOCK_N.  Returns (O, LSE).
    """
    block_n = _block_n(config) if block_n is None else block_n
    B, Hq, d = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    lens = _lens(seq_lens, B, N)
    starts, longest = _starts(lens, window)
    S = _resolve_splits(num_splits, B, Hkv, longest, block_n)
    K, V = HBM(k, "K"), HBM(v, "V")

    def load(b, h, t):                                        # load K_j, V_j -> SRAM
        return K[b, h, t[0]:t[1]], V[b, h, t[0]:t[1]]

    return split_kv_grid(q, load, lens=lens, starts=starts, num_splits=S, block_n=block_n, heads_kv=Hkv,
                         scale=cv.default_scale(d) if scale is None else scale, value_dim=v.shape[-1])


# --------------------------------------------------------------------------- v3 paged
def paged_tile_loader(cache, seq_ids, pools=("K", "V")):
    """``load(b, h, t)`` reading tile t of sequence seq_ids[b] through its block table.

    The tile lies in one block (tiles are cut at block boundaries): one table entry is
    read (int32), then the tile's valid slots of each pool named in ``pools``, and for a
    quantized cache the block's scale of each, dequantized on chip.  Returns the loader,
    and the sequences' lengths.
    """
    tables_np, lens_np = cache.block_tables_array(seq_ids)
    bs, acc = cache.block_size, cv.accum_dtype(cache.dtype.name)
    TABLE = HBM(tables_np, "block_table")
    src = [(HBM(getattr(cache, f"{x.lower()}_pool"), f"{x}_cache"),
            HBM(getattr(cache, f"{x.lower()}_scale"), f"{x}_scale") if cache.quantized else None) for x in pools]
    per_head = cache.scale_granularity == "block_head"

    def load(b, h, t):
        blk = int(TABLE[b, t[0] // bs])                       # read the table entry (int32)
        i0 = t[0] % bs                                        # the tile's valid slots in the block
        i1 = i0 + t[1] - t[0]
        out = []
        for CACHE, SCALE in src:
            tile = CACHE[blk, i0:i1, h]                       # load K_j (V_j) -> SRAM
            if SCALE is not None:                             # load the tile's scale -> SRAM
                tile = dequantize(tile, SCALE[blk, h if per_head else 0], acc)
            out.append(tile)
        return tuple(out)

    return load, [int(x) for x in lens_np]


def paged_decode_split_kv(q, cache, seq_ids, *, num_splits=None, scale=None, window=None, config=None):
    """v3: split-KV decode reading K and V through the block tables of a PagedKVCache.

    q (len(seq_ids), Hq, d).  A tile is one block (Bc = cache.block_size); a worker reads
    the table entry of each of its blocks, then the block's valid slots only (the unwritten
    tail of a last block is never read).  A quantized cache (``cache.quantized``) stores
    1-byte values and one float32 scale per (block, KV head) or per block: the worker reads
    the tile's scale next to it and dequantizes on chip (:func:`iokernels.paged.dequantize`),
    so K and V cross HBM at 1 byte a value.  ``window`` as in :func:`decode_split_kv`.
    The tile is the cache's block, so there is no config.  Returns (O, LSE).
    """
    _no_config(config, "the tiled paged decode (its tile is the cache's block)")
    B, Hq, d = q.shape
    load, lens = paged_tile_loader(cache, seq_ids)
    starts, longest = _starts(lens, window)
    S = _resolve_splits(num_splits, B, cache.num_kv_heads, longest, cache.block_size)
    return split_kv_grid(q, load, lens=lens, starts=starts, num_splits=S, block_n=cache.block_size,
                         heads_kv=cache.num_kv_heads, scale=cv.default_scale(d) if scale is None else scale)


# --------------------------------------------------------------------------- traffic models
def split_kv_model(t, *, batch, heads_q, heads_kv, head_dim, lens, starts, S, block_n, s, a, kv_names,
                   table, kv_itemsize=None, scales=False, value_dim=None):
    """Add the traffic of :func:`split_kv_grid` to ``t``: the closed form every decode model uses.

    s, a: storage and accumulator itemsizes; kv_names: the K and V tensors' names (V None:
    the values are read with the keys, as MLA's latent rows are); table: one int32 entry
    per (KV head, tile); scales: one float32 per (KV head, tile) for each of K and V.
    """
    d, g = head_dim, heads_q // heads_kv
    dv = d if value_dim is None else value_dim
    kv_s = s if kv_itemsize is None else kv_itemsize
    for n, start in zip(lens, starts):
        ranges = split_ranges(n, S, block_n, start)
        busy = sum(1 for x, y in ranges if y > x)             # splits with at least one key
        tiles = len(_tiles(start, n, block_n))                # blocks met by the visible keys
        t.add("Q", read=heads_kv * busy * g * d * s)          # each busy worker loads its Q group
        t.add(kv_names[0], read=heads_kv * (n - start) * d * kv_s)   # every visible K row read once
        if kv_names[1] is not None:
            t.add(kv_names[1], read=heads_kv * (n - start) * dv * kv_s)
        if table:
            t.add("block_table", read=heads_kv * tiles * 4)   # one entry per block per head
        if scales:                                            # one float32 scale per tile and pool
            t.add("K_scale", read=heads_kv * tiles * SCALE_ITEMSIZE)
            if kv_names[1] is not None:
                t.add("V_scale", read=heads_kv * tiles * SCALE_ITEMSIZE)
    if S > 1:
        t.add("O_partial", written=S * batch * heads_q * dv * a, read=S * batch * heads_q * dv * a)
        t.add("LSE_partial", written=S * batch * heads_q * a, read=S * batch * heads_q * a)
    t.add("O", written=batch * heads_q * dv * s)
    t.add("LSE", written=batch * heads_q * a)
    return t


def traffic_model(*, batch, heads_q, heads_kv, head_dim, seqlen_k=None, seq_lens=None, num_splits=None,
                  dtype="float32", block_n=DEFAULT_BLOCK_N, window=None):
    """Closed-form traffic of :func:`decode_split_kv` (``traffic.model("decode", ...)``).

    Keywords: batch, heads_q, heads_kv, head_dim, seqlen_k (all sequences this long) or
    seq_lens (one per sequence), num_splits (None: the same heuristic as the kernel),
    dtype, block_n, window.  The visible K and V rows are read once; each busy split reads
    its Q group; with S > 1 the partial O_s, LSE_s (accumulator dtype) are written and
    read back by the merge; O and LSE are written once.
    """
    lens = _lens(seq_lens, batch, seqlen_k)
    starts, longest = _starts(lens, window)
    S = _resolve_splits(num_splits, batch, heads_kv, longest, block_n)
    s, a = _itemsize(dtype), cv.accum_dtype(storage_dtype(dtype).name).itemsize
    return split_kv_model(Traffic(), batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                        lens=lens, starts=starts, S=S, block_n=block_n, s=s, a=a, kv_names=("K", "V"),
                        table=False)


def traffic_model_paged(*, batch, heads_q, heads_kv, head_dim, seq_lens, num_splits=None,
                        dtype="float32", block_size=16, window=None, kv_dtype=None):
    """Closed-form traffic of :func:`paged_decode_split_kv` (``traffic.model("paged_decode", ...)``).

    Keywords: batch, heads_q, heads_kv, head_dim, seq_lens (one per sequence), num_splits,
    dtype (of q and O), block_size, window, kv_dtype (a quantized cache's storage,
    "float8_e4m3fn" or "int8"; None: the pools hold ``dtype``).  As :func:`traffic_model`
    with the pools named K_cache / V_cache, plus the block-table entry each (KV head,
    block) worker reads (int32) and, for a quantized cache, that tile's K and V scales
    (float32): the same count whether the scales are per block or per (block, head).
    """
    lens = _lens(seq_lens, batch, None)
    starts, longest = _starts(lens, window)
    S = _resolve_splits(num_splits, batch, heads_kv, longest, block_size)
    s, a = _itemsize(dtype), cv.accum_dtype(storage_dtype(dtype).name).itemsize
    return split_kv_model(Traffic(), batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                        lens=lens, starts=starts, S=S, block_n=block_size, s=s, a=a,
                        kv_names=("K_cache", "V_cache"), table=True,
                        kv_itemsize=None if kv_dtype is None else _itemsize(kv_dtype), scales=kv_dtype is not None)


def _itemsize(name):
    return storage_dtype(name).itemsize


# --------------------------------------------------------------------------- calculators
def decode_bytes_per_token(context, batch=1, layers=32, kv_heads=8, head_dim=128, itemsize=2,
                           weight_bytes=0):
    """HBM bytes one decode step reads: every sequence's KV cache, plus the weights once.

    Per sequence: context * kv_bytes_per_token (2 x layers x KV heads x d x bytes); the
    weights (``weight_bytes``) are read once per step and shared by the batch.  Returns a
    dict with kv_bytes, weight_bytes and total.  Defaults: Llama-3-8B shapes in FP16
    (128 KiB per token).
    """
    from .paged import kv_bytes_per_token
    kv = int(batch) * int(context) * kv_bytes_per_token(layers, kv_heads, head_dim, itemsize)
    return dict(kv_bytes=kv, weight_bytes=int(weight_bytes), total=kv + int(weight_bytes))


def decode_flops(*, heads_q, head_dim, seq_lens):
    """FLOPs of one decode step: 2*n*d for q.K^T and 2*n*d for P.V, per query head per sequence."""
    return int(sum(4 * heads_q * int(n) * head_dim for n in seq_lens))


def decode_time_bound(nbytes, bandwidth):
    """Lower bound on time (seconds) to move ``nbytes`` at ``bandwidth`` bytes/second.

    4.29 GB of KV at the H100 datasheet's 3.35e12 B/s: about 1.28 ms per token, at best.
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth: expected bytes per second > 0, got {bandwidth!r}")
    return float(nbytes) / float(bandwidth)


def perturbed_decode_error_bound(q, k, v, k_hat, v_hat, *, seq_lens=None, scale=None, window=None):
    """How far decode over perturbed K, V (a quantized cache's k_hat, v_hat) can be from exact.

    With delta_s_j = scale * q . (k_hat_j - k_j) the score change of visible key j and
    D = max_j |delta_s_j|, the softmax weights change by a factor within exp(+-2D), so

        |O_hat - O|   <=  max_j |v_hat_j - v_j|  +  (exp(2D) - 1) * max_j |v_j|
        |LSE_hat - LSE| <=  D

    (per sequence and query head, elementwise in O; arithmetic rounding not included).  The
    bound does not grow with the cache length: O is a weighted average, and so is its error.
    q (B, Hq, d); k, v, k_hat, v_hat (B, Hkv, N, d).  Returns (o_bound, lse_bound), (B, Hq).
    """
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    q, k, v, k_hat, v_hat = f(q), f(k), f(v), f(k_hat), f(v_hat)
    B, Hq, d = q.shape
    scale = cv.default_scale(d) if scale is None else scale
    lens = _lens(seq_lens, B, k.shape[2])
    kvh = cv.kv_head_index(Hq, k.shape[1])
    o_bound, lse_bound = np.zeros((B, Hq)), np.zeros((B, Hq))
    for b, n in enumerate(lens):
        a = visible_start(n, window)
        if n == 0:
            continue
        dk, dv = (k_hat - k)[b, kvh, a:n], (v_hat - v)[b, kvh, a:n]   # (Hq, keys, d)
        D = np.abs(scale * np.einsum("hd,hnd->hn", q[b], dk)).max(axis=1)
        o_bound[b] = np.abs(dv).max(axis=(1, 2)) + np.expm1(2 * D) * np.abs(v[b, kvh, a:n]).max(axis=(1, 2))
        lse_bound[b] = D
    return o_bound, lse_bound
