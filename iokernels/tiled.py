"""Step 2: tiled attention with the online softmax (FlashAttention), forward pass.

S and P never reach HBM.  Q, K and V are cut into tiles small enough for on-chip
memory (SRAM); for each pair of tiles the scores are computed on chip, folded into
running softmax statistics, and thrown away.  Only O and the per-row log-sum-exp are
written back.  (Dao, Fu, Ermon, Rudra, Re, "FlashAttention", 2022; Dao, "FlashAttention-2",
2023.  The online softmax comes from Milakov and Gimelshein, 2018.)

Notation (the papers' names):

=====  ===========================================================================
N_q    query rows (seqlen_q);  N_k  key rows (seqlen_k);  d  head_dim
Br     query rows per tile (``config.block_q``)
Bc     key/value rows per tile (``config.block_k``)
Tr     number of query tiles, ceil(N_q / Br);  tile i holds rows [i*Br, min((i+1)*Br, N_q))
Tc     number of key/value tiles, ceil(N_k / Bc); the last tile of each may be ragged
S_ij   (Br, Bc) score tile, scale * Q_i K_j^T, lives only on chip
P_ij   exp(S_ij - m): unnormalized probabilities, on chip only
m      running row maximum of the scores seen so far
l      running row sum of exp(S - m)
O      output; on chip the unnormalized accumulator, in HBM the final (N_q, d) result
LSE    log-sum-exp per row, m + log(l): all the backward pass needs besides O
M      SRAM capacity (``config.sram_bytes``; the paper counts elements, we count bytes)
=====  ===========================================================================

The online-softmax recurrence, for one query tile and its key tiles j = 1, 2, ...
(all in the accumulator dtype, float32, or float64 for float64 inputs)::

    m_new  = max(m, rowmax(S_ij))
    alpha  = exp(m - m_new)                    # rescales what was summed so far
    P_ij   = exp(S_ij - m_new)
    l      = alpha * l + rowsum(P_ij)
    O      = alpha * O + P_ij V_j
    m      = m_new
    ...after the last tile:  O = O / l,   LSE = m + log(l)

A row that has seen no visible key yet has m = -inf; exp(m - m_new) would then be
exp(-inf - (-inf)) = NaN.  The kernels therefore subtract ``m_ref`` = m_new where it is
finite and 0 where it is -inf: every exponential of a masked score is then exp(-inf) = 0,
and a row that stays fully masked ends with l = 0, O = 0 and LSE = -inf, never NaN.

Two loop orders, both counted by :mod:`iokernels.core.traffic`:

- :func:`forward_fa2` (FlashAttention-2): Q tiles outer, K/V tiles inner.  m, l and the
  O accumulator stay on chip for a whole row of tiles; O_i and LSE_i are written once.
  K and V are read once per query tile: Tr times in all.
- :func:`forward_fa1` (FlashAttention-1, the paper's Algorithm 1): K/V tiles outer, Q
  tiles inner.  O, m and l live in HBM and are read, updated and written back at every
  inner step; K and V are read once, but Q, O, m, l are read Tc times.

How much is saved, counted honestly (no caches): FA2 reads K and V Tr times, 2 N^2 d / Br
elements, where naive attention moves 4 N^2 for S and P; with the paper's tile choice
Br = min(Bc, d) that is d / (2 Br) >= 1/2 of naive's extra traffic, so at d = 64 to 128 the
win *in HBM bytes as written* is a small constant factor that grows with SRAM only through
Bc in FA1's order (3 N^2 d / Bc for Q and O) -- the paper's Theta(N^2 d^2 / M).  On a GPU
the thread blocks that run at once read the same K/V tiles, so most of FA2's re-reads are
served by the L2 cache; the profiler notebook measures that difference.

Conditional rescaling (FlashAttention-4; Zadouri, Hoehnerbach, Shah, Liu, Thakkar, Dao, 2026):
with ``config.rescale_threshold`` = tau (log2 units; FlashAttention-4 uses 8 for 16-bit
inputs), a row keeps its old maximum m while the new tile's maximum exceeds it by at most
tau, and O and l are not rescaled (alpha = 1).  The exponentials then subtract a maximum
that is slightly stale, so P can reach 2^tau instead of 1 -- harmless in a float32
accumulator -- and the final O / l and LSE = m + log l are unchanged in exact arithmetic,
because O and l carry the same factor.  On a GPU the skipped rescale saves a multiply of
the whole O accumulator; here it only shows the arithmetic.  Pass ``rescale_stats=``
(a :class:`RescaleCount`) to :func:`forward_fa2` / :func:`forward_fa1` to count how many
rescales were needed (the maximum grew on a row that had seen keys) and how many were
skipped.

Causal (bottom-right aligned) and sliding-window masks skip every tile in which no
query row sees any key (such tiles are never loaded) and apply the mask only inside
tiles that are partly visible (:func:`iokernels.core.conventions.tile_state`).

The closed-form traffic models :func:`traffic_model_fa2` and :func:`traffic_model_fa1`
predict the counted bytes exactly; :func:`io_complexity_table` sets them beside the
paper's Theta(N d + N^2) and Theta(N^2 d^2 / M).

Frank notes: this is NumPy, one Python iteration per tile pair: it teaches the
algorithm and its memory traffic, and is orders of magnitude slower than a GPU kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core import conventions as cv
from .core.config import TileConfig
from .core.traffic import HBM, Traffic
from .score_mods import alibi, alibi_slopes, document_mask, softcap

__all__ = ["attention", "forward_fa2", "forward_fa1", "attention_varlen", "RescaleCount",
           "traffic_model_fa2", "traffic_model_fa1", "traffic_model_varlen", "io_complexity_table"]


# --------------------------------------------------------------------------- tiles
def _resolve_config(config, head_dim: int, dtype: str) -> TileConfig:
    if config is None:
        return TileConfig.default(head_dim, dtype)
    if not isinstance(config, TileConfig):
        raise ValueError(f"config: expected an iokernels.TileConfig or None, got {type(config).__name__}")
    config.check_fits(head_dim, dtype)
    return config


def _row_tiles(n: int, size: int):
    """[(start, stop), ...] tiles of ``size`` rows covering [0, n); the last may be ragged."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


@dataclass
class _Tile:
    """A key/value tile a query tile visits: its rows, and the mask when it is partial."""
    j: int
    c0: int
    c1: int
    mask: np.ndarray | None     # (rows, cols) visibility for a 'partial' tile, None for 'full'


def _schedule(Nq, Nk, Br, Bc, causal, window):
    """For each query tile i: the K/V tiles it visits (never the 'skip' ones)."""
    sched = []
    for r0, r1 in _row_tiles(Nq, Br):
        row = []
        for j, (c0, c1) in enumerate(_row_tiles(Nk, Bc)):
            state = cv.tile_state(r0, r1, c0, c1, Nq, Nk, causal, window)
            if state == "skip":
                continue
            m = None if state == "full" else cv.mask(Nq, Nk, causal, window, rows=(r0, r1), cols=(c0, c1))
            row.append(_Tile(j, c0, c1, m))
        sched.append(((r0, r1), row))
    return sched


@dataclass
class _Index:
    """Where one (sequence, query head) problem lives in the HBM arrays.

    Batched layout: q[b, h, rows], k[b, hk, rows], lse[b, h, rows].
    Packed varlen layout: q[off_q + rows, h], k[off_k + rows, hk], lse[h, off_q + rows].
    """
    b: int | None
    h: int
    hk: int
    off_q: int = 0
    off_k: int = 0

    def q(self, r0, r1):
        if self.b is None:
            return (slice(self.off_q + r0, self.off_q + r1), self.h)
        return (self.b, self.h, slice(r0, r1))

    def k(self, c0, c1):
        if self.b is None:
            return (slice(self.off_k + c0, self.off_k + c1), self.hk)
        return (self.b, self.hk, slice(c0, c1))

    def lse(self, r0, r1):
        if self.b is None:
            return (self.h, slice(self.off_q + r0, self.off_q + r1))
        return (self.b, self.h, slice(r0, r1))


#: log2(e): converts a difference of natural-log scores to the log2 units of the threshold
LOG2_E = 1.4426950408889634


@dataclass
class RescaleCount:
    """Counted per (query row, K/V tile) step: ``needed``, the row's maximum grew on a row
    that had already seen keys; ``skipped``, conditional rescaling kept the old maximum."""
    needed: int = 0
    skipped: int = 0


@dataclass
class _Rescale:
    """Conditional rescaling: the threshold tau (log2 units; None: always rescale) and a count."""
    threshold: float | None = None
    count: RescaleCount | None = None

    def new_max(self, m, tile_max):
        """The maximum the exponentials subtract from now on, per row."""
        grown = np.maximum(m, tile_max)
        if self.threshold is None and self.count is None:
            return grown
        need = np.isfinite(m) & (tile_max > m)
        keep = np.zeros_like(need)
        if self.threshold is not None:
            with np.errstate(invalid="ignore"):              # -inf - -inf on rows that saw nothing
                keep = need & ((tile_max - m) * LOG2_E <= self.threshold)
        if self.count is not None:
            self.count.needed += int(need.sum())
            self.count.skipped += int(keep.sum())
        return np.where(keep, m, grown)


def _online_step(q_i, k_j, v_j, tile, m, l, o, scale, acc, rescale=None):
    """One step of the recurrence on chip: fold S_ij = scale Q_i K_j^T into (m, l, O).

    ``o`` is the unnormalized accumulator; ``rescale`` (a :class:`_Rescale`) makes the
    rescaling conditional.  Returns the new (m, l, o).
    """
    s = (q_i @ k_j.T) * acc.type(scale)                      # S_ij, (Br, Bc), on chip
    if tile.mask is not None:                                # partial tile: mask inside it
        s = np.where(tile.mask, s, -np.inf)
    m_new = np.maximum(m, s.max(axis=1)) if rescale is None else rescale.new_max(m, s.max(axis=1))
    m_ref = np.where(np.isneginf(m_new), 0.0, m_new).astype(acc)  # 0 for rows that saw nothing
    alpha = np.exp(m - m_ref)                                # exp(-inf) = 0: never NaN
    p = np.exp(s - m_ref[:, None])                           # P_ij; masked entries give 0
    l = alpha * l + p.sum(axis=1)
    o = alpha[:, None] * o + p @ v_j
    return m_new, l, o


def _finalize(m, l, o):
    """O = O / l and LSE = m + log l; rows with l = 0 (fully masked) give 0 and -inf."""
    empty = l == 0
    o = o / np.where(empty, 1.0, l)[:, None]
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return o, lse


# --------------------------------------------------------------------------- FA2
def _fa2_head(Q, K, V, O, LSE, ix, sched, scale, acc, rescale=None):
    """FlashAttention-2's loops for one (sequence, query head)."""
    d = Q.shape[-1]
    for (r0, r1), tiles in sched:                           # for each query tile i (one thread block)
        n = r1 - r0
        if not tiles:                                       # every key masked for these rows:
            O[ix.q(r0, r1)] = 0                             #   write O_i = 0 -> HBM (Q_i never loaded)
            LSE[ix.lse(r0, r1)] = -np.inf                   #   write LSE_i = -inf -> HBM
            continue
        q_i = Q[ix.q(r0, r1)].astype(acc)                   # load Q_i -> SRAM
        m = np.full(n, -np.inf, acc)                        # m, l, O: on chip (registers/SRAM)
        l = np.zeros(n, acc)
        o = np.zeros((n, d), acc)
        for tile in tiles:                                  # for each visible K/V tile j
            k_j = K[ix.k(tile.c0, tile.c1)].astype(acc)     # load K_j -> SRAM
            v_j = V[ix.k(tile.c0, tile.c1)].astype(acc)     # load V_j -> SRAM
            m, l, o = _online_step(q_i, k_j, v_j, tile, m, l, o, scale, acc, rescale)
        o, lse = _finalize(m, l, o)
        O[ix.q(r0, r1)] = o                                 # write O_i -> HBM (once)
        LSE[ix.lse(r0, r1)] = lse                           # write LSE_i -> HBM (once)


def forward_fa2(q, k, v, *, causal, scale, window, config=None, rescale_stats=None):
    """FlashAttention-2 loop order: Q tiles outer, K/V tiles inner.  Returns (O, LSE).

    ``rescale_stats``: a :class:`RescaleCount` to add this run's rescale counts to."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = _resolve_config(config, d, q.dtype.name)
    acc = cv.accum_dtype(q.dtype.name)
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    O = HBM.empty(q.shape, q.dtype, "O")
    LSE = HBM.empty((B, Hq, Nq), acc, "LSE")
    sched = _schedule(Nq, Nk, cfg.block_q, cfg.block_k, causal, window)
    for b in range(B):                                      # grid: one program per (b, h, i)
        for h in range(Hq):
            ix = _Index(b, h, cv.kv_head(h, Hq, Hkv))
            _fa2_head(Q, K, V, O, LSE, ix, sched, scale, acc, _Rescale(cfg.rescale_threshold, rescale_stats))
    return O.result(), LSE.result()


# --------------------------------------------------------------------------- FA1
def _fa1_head(Q, K, V, O, Mst, Lst, LSE, ix, sched, Nq, scale, acc, rescale=None):
    """FlashAttention-1's Algorithm 1 for one (sequence, query head).

    Counted: the initialisation of O, l, m in HBM; per visited tile pair, Q_i read and
    O_i, m_i, l_i read and written back; K_j, V_j read once; and an epilogue that reads
    m and l and writes LSE = m + log l.  O is kept normalized in HBM, as Algorithm 1
    does, and in the input dtype, this model's choice (Algorithm 1 fixes no dtype; the released
    FlashAttention-1 kept a float32 buffer), so it is rounded to that dtype after every inner step.
    """
    # visits per K/V tile j: the query tiles (and tile masks) that see it
    by_kv = {}
    for (r0, r1), tiles in sched:
        for tile in tiles:
            by_kv.setdefault(tile.j, []).append(((r0, r1), tile))

    O[ix.q(0, Nq)] = 0                                      # init O = 0 in HBM: write Nq*d
    Mst[ix.lse(0, Nq)] = -np.inf                            # init m = -inf in HBM: write Nq
    Lst[ix.lse(0, Nq)] = 0                                  # init l = 0 in HBM: write Nq
    for j in sorted(by_kv):                                 # for each K/V tile j (outer)
        tile0 = by_kv[j][0][1]                              # tile j's rows (same for every visit)
        k_j = K[ix.k(tile0.c0, tile0.c1)].astype(acc)       # load K_j -> SRAM (once)
        v_j = V[ix.k(tile0.c0, tile0.c1)].astype(acc)       # load V_j -> SRAM (once)
        for (r0, r1), tile in by_kv[j]:                     # for each query tile i that sees tile j
            q_i = Q[ix.q(r0, r1)].astype(acc)               # load Q_i -> SRAM
            o_i = O[ix.q(r0, r1)].astype(acc)               # load O_i -> SRAM (normalized)
            m_i = Mst[ix.lse(r0, r1)]                       # load m_i -> SRAM
            l_i = Lst[ix.lse(r0, r1)]                       # load l_i -> SRAM
            # the recurrence on the unnormalized accumulator l_i * O_i
            m_new, l_new, o_un = _online_step(q_i, k_j, v_j, tile, m_i, l_i, l_i[:, None] * o_i,
                                              scale, acc, rescale)
            O[ix.q(r0, r1)] = o_un / np.where(l_new == 0, 1.0, l_new)[:, None]  # write O_i -> HBM
            Mst[ix.lse(r0, r1)] = m_new                     # write m_i -> HBM
            Lst[ix.lse(r0, r1)] = l_new                     # write l_i -> HBM
    m = Mst[ix.lse(0, Nq)]                                  # epilogue: read m (Nq)
    l = Lst[ix.lse(0, Nq)]                                  #           read l (Nq)
    with np.errstate(divide="ignore"):
        LSE[ix.lse(0, Nq)] = np.where(l == 0, -np.inf, m + np.log(np.where(l == 0, 1.0, l)))  # write LSE


def forward_fa1(q, k, v, *, causal, scale, window, config=None, rescale_stats=None):
    """FlashAttention-1 loop order (Algorithm 1): K/V tiles outer, Q tiles inner.  Returns (O, LSE).

    ``rescale_stats``: a :class:`RescaleCount` to add this run's rescale counts to."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = _resolve_config(config, d, q.dtype.name)
    acc = cv.accum_dtype(q.dtype.name)
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    O = HBM.empty(q.shape, q.dtype, "O")
    Mst = HBM.empty((B, Hq, Nq), acc, "m")
    Lst = HBM.empty((B, Hq, Nq), acc, "l")
    LSE = HBM.empty((B, Hq, Nq), acc, "LSE")
    sched = _schedule(Nq, Nk, cfg.block_q, cfg.block_k, causal, window)
    for b in range(B):
        for h in range(Hq):
            ix = _Index(b, h, cv.kv_head(h, Hq, Hkv))
            _fa1_head(Q, K, V, O, Mst, Lst, LSE, ix, sched, Nq, scale, acc,
                      _Rescale(cfg.rescale_threshold, rescale_stats))
    return O.result(), LSE.result()


def attention(q, k, v, *, causal, scale, window, config=None, rescale_stats=None):
    """Tiled attention; ``config.loop_order`` picks FlashAttention-2 ("fa2") or -1 ("fa1")."""
    cfg = _resolve_config(config, q.shape[-1], q.dtype.name)
    forward = forward_fa2 if cfg.loop_order == "fa2" else forward_fa1
    return forward(q, k, v, causal=causal, scale=scale, window=window, config=cfg, rescale_stats=rescale_stats)


# --------------------------------------------------------------------------- varlen
def attention_varlen(q, k, v, cu_q, cu_k, *, causal, scale, window, config=None):
    """Tiled attention over packed sequences.  Returns (O, LSE) with LSE (Hq, total_q).

    q: (total_q, Hq, d), k, v: (total_k, Hkv, d); sequence b owns rows
    cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1] of k, v.  Each sequence is tiled on its
    own, so no tile ever straddles two sequences (which would let one attend to another).
    Zero-length sequences do nothing (no keys: their rows are 0 with LSE -inf).
    """
    total_q, Hq, d = q.shape
    Hkv = k.shape[1]
    cfg = _resolve_config(config, d, q.dtype.name)
    acc = cv.accum_dtype(q.dtype.name)
    cu_q = np.asarray(cu_q, dtype=np.int64)
    cu_k = np.asarray(cu_k, dtype=np.int64)
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    O = HBM.empty(q.shape, q.dtype, "O")
    LSE = HBM.empty((Hq, total_q), acc, "LSE")
    if cfg.loop_order == "fa1":
        Mst = HBM.empty((Hq, total_q), acc, "m")
        Lst = HBM.empty((Hq, total_q), acc, "l")
    schedules = {}
    for b in range(len(cu_q) - 1):                          # for each sequence
        Nq, Nk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        if Nq == 0:
            continue
        key = (Nq, Nk)
        if key not in schedules:
            schedules[key] = _schedule(Nq, Nk, cfg.block_q, cfg.block_k, causal, window)
        for h in range(Hq):
            ix = _Index(None, h, cv.kv_head(h, Hq, Hkv), int(cu_q[b]), int(cu_k[b]))
            if cfg.loop_order == "fa2":
                _fa2_head(Q, K, V, O, LSE, ix, schedules[key], scale, acc, _Rescale(cfg.rescale_threshold))
            else:
                _fa1_head(Q, K, V, O, Mst, Lst, LSE, ix, schedules[key], Nq, scale, acc,
                          _Rescale(cfg.rescale_threshold))
    return O.result(), LSE.result()


# --------------------------------------------------------------------------- traffic models
def _kv_span(r0, r1, Nq, Nk, Bc, causal, window):
    """The K/V tiles [j_lo, j_hi) that query rows [r0, r1) visit, by interval arithmetic.

    Each row sees one contiguous key interval [lo, hi) whose ends never decrease with the
    row, so the rows' non-empty intervals cover one contiguous range [a, z); the tiles
    touching it are floor(a / Bc) .. ceil(z / Bc) - 1.  Returns (0, 0) if every row is
    fully masked.
    """
    lo, hi = cv.key_range(np.arange(r0, r1), Nq, Nk, causal, window)
    seen = hi > lo
    if not seen.any():
        return 0, 0
    a, z = int(lo[seen].min()), int(hi[seen].max())
    return a // Bc, -(-z // Bc)


def _keys_in(j_lo, j_hi, Nk, Bc):
    """Key rows in tiles [j_lo, j_hi), the last tile possibly ragged."""
    return max(0, min(j_hi * Bc, Nk) - j_lo * Bc)


def _problem(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, config):
    config = _resolve_config(config, head_dim, dtype)
    st = cv.itemsize_of(dtype)
    acc = cv.accum_dtype(dtype).itemsize
    return config, st, acc, batch * heads_q


def traffic_model_fa2(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                      causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`forward_fa2`, tensor by tensor.

    Per (b, query head) and query tile i of n_i rows that visits key tiles [j_lo, j_hi)
    holding k_i keys: read n_i*d (Q_i), k_i*d (K) and k_i*d (V); write n_i*d (O_i) and
    n_i (LSE_i).  A query tile that sees no key reads nothing and writes O_i = 0 and
    LSE_i = -inf.  Without masks k_i = N_k for every tile, so K and V are read
    Tr = ceil(N_q / Br) times: B*Hq*Tr*N_k*d elements each.

    ``heads_kv`` does not change the count: each query head's programs load their KV
    head's tiles themselves (a kernel that packs a whole GQA group into one program
    would read them once per group; this one does not).
    """
    cfg, st, acc, heads = _problem(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, config)
    d = head_dim
    q_el = kv_el = 0
    for r0, r1 in _row_tiles(seqlen_q, cfg.block_q):
        j_lo, j_hi = _kv_span(r0, r1, seqlen_q, seqlen_k, cfg.block_k, causal, window)
        if j_hi > j_lo:
            q_el += (r1 - r0) * d
            kv_el += _keys_in(j_lo, j_hi, seqlen_k, cfg.block_k) * d
    t = Traffic()
    t.add("Q", read=heads * q_el * st)
    t.add("K", read=heads * kv_el * st)
    t.add("V", read=heads * kv_el * st)
    t.add("O", written=heads * seqlen_q * d * st)
    t.add("LSE", written=heads * seqlen_q * acc)
    return t


def traffic_model_fa1(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                      causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`forward_fa1`, tensor by tensor.

    Per (b, query head): initialise O (N_q*d), m and l (N_q each) in HBM; for each
    visited pair (query tile i of n_i rows, key tile j): read n_i*d (Q_i), read and write
    n_i*d (O_i), n_i (m_i) and n_i (l_i); read each visited key tile's K_j and V_j once;
    finally read m and l and write LSE (N_q each).  Without masks that is Q read Tc
    times and O read and written Tc times, but K and V read only once.
    """
    cfg, st, acc, heads = _problem(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, config)
    d, Nq, Nk, Bc = head_dim, seqlen_q, seqlen_k, cfg.block_k
    rows_pairs = 0          # sum over visited (i, j) of n_i
    kv_tiles = set()        # key tiles visited by at least one query tile
    for r0, r1 in _row_tiles(Nq, cfg.block_q):
        j_lo, j_hi = _kv_span(r0, r1, Nq, Nk, Bc, causal, window)
        rows_pairs += (r1 - r0) * max(0, j_hi - j_lo)
        kv_tiles.update(range(j_lo, j_hi))
    kv_rows = sum(_keys_in(j, j + 1, Nk, Bc) for j in kv_tiles)
    t = Traffic()
    t.add("Q", read=heads * rows_pairs * d * st)
    t.add("K", read=heads * kv_rows * d * st)
    t.add("V", read=heads * kv_rows * d * st)
    t.add("O", read=heads * rows_pairs * d * st, written=heads * (Nq + rows_pairs) * d * st)
    t.add("m", read=heads * (rows_pairs + Nq) * acc, written=heads * (Nq + rows_pairs) * acc)
    t.add("l", read=heads * (rows_pairs + Nq) * acc, written=heads * (Nq + rows_pairs) * acc)
    t.add("LSE", written=heads * Nq * acc)
    return t


def traffic_model_varlen(*, seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, dtype,
                         causal=False, window=None, config=None) -> Traffic:
    """Closed-form HBM bytes of :func:`attention_varlen`: the sum of its sequences' models.

    Each sequence is tiled on its own, so the packed run moves exactly what one batched
    run per sequence would (``config.loop_order`` picks the FA2 or FA1 model); sequences
    with no queries move nothing.
    """
    cfg = _resolve_config(config, head_dim, dtype)
    one = traffic_model_fa2 if cfg.loop_order == "fa2" else traffic_model_fa1
    t = Traffic()
    for nq, nk in zip(seqlens_q, seqlens_k):
        if nq:
            t.merge(one(batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=int(nq), seqlen_k=int(nk),
                        head_dim=head_dim, dtype=dtype, causal=causal, window=window, config=cfg))
    return t


# --------------------------------------------------------------------------- IO complexity
def io_complexity_table(seqlens=(512, 1024, 2048, 4096, 8192), sram_bytes=(32 * 1024, 64 * 1024,
                        128 * 1024, 228 * 1024), head_dim=64, dtype="float16", loop_order="fa2"):
    """Rows comparing naive and FlashAttention HBM traffic as N and M vary (one head).

    For each sequence length N (N_q = N_k = N, no mask) and SRAM size M in bytes, the
    tile config is the paper's choice for that M (:meth:`TileConfig.from_sram`).  Each row
    is a dict with: ``seqlen``, ``sram_bytes``, ``block_q``, ``block_k``,
    ``naive_bytes`` and ``flash_bytes`` (the exact models), and the paper's asymptotic
    shapes in bytes, ``naive_theta`` = (N d + N^2) * itemsize and
    ``flash_theta`` = N^2 d^2 / M_elems * itemsize with M_elems = M / itemsize.  The
    Theta forms have no constants: compare how columns grow, not their values.
    """
    from .naive import traffic_model as naive_model
    st = cv.itemsize_of(dtype)
    rows = []
    for N in seqlens:
        for M in sram_bytes:
            cfg = TileConfig.from_sram(M, head_dim, dtype, loop_order=loop_order)
            prob = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=N, seqlen_k=N, head_dim=head_dim,
                        dtype=dtype)
            flash = (traffic_model_fa2 if loop_order == "fa2" else traffic_model_fa1)(config=cfg, **prob)
            m_elems = M / st
            rows.append(dict(seqlen=N, sram_bytes=M, block_q=cfg.block_q, block_k=cfg.block_k,
                             naive_bytes=naive_model(**prob).total, flash_bytes=flash.total,
                             naive_theta=(N * head_dim + N * N) * st,
                             flash_theta=N * N * head_dim * head_dim / m_elems * st))
    return rows


# --------------------------------------------------------------------------- score_mod, block masks
# Arbitrary masks and biases without an N x N tensor (the idea of FlexAttention: He, Guessous,
# Liang, Dong, "FlexAttention", 2024).  A dense bias B (batch, heads, N_q, N_k) in HBM costs
# N_q * N_k elements of reads per head, the quadratic traffic FlashAttention removed.  A
# ``score_mod`` instead computes the change from the indices, on chip, inside the tile loop;
# a ``mask_mod`` says which (query, key) pairs are visible, and its block mask (one state per
# tile: skip / partial / full) lets the loop skip fully masked tiles without loading them.
#
#   score_mod(s, b, h, q_idx, kv_idx) -> s'     s: (Br, Bc) scores scale * Q_i K_j^T
#   mask_mod(b, h, q_idx, kv_idx) -> bool       True = visible
#
# b, h are ints; q_idx is a (Br, 1) and kv_idx a (1, Bc) array of absolute positions, so
# the functions broadcast (the oracle calls them with whole-matrix index arrays).

__all__ += ["BlockMask", "block_mask", "forward_flex", "traffic_model_flex",
            "alibi_slopes", "alibi", "softcap", "document_mask"]

#: bytes per entry of the block mask the kernel reads per query tile (one int8 state per tile)
BLOCK_MASK_ITEMSIZE = 1
_SKIP, _PARTIAL, _FULL = 0, 1, 2


@dataclass
class BlockMask:
    """Tile states of a ``mask_mod`` (and causal / window) for one problem and tile size.

    ``states[b, h, i, j]`` is 0 (skip: no pair visible, the tile is never loaded),
    1 (partial: the mask is applied inside the tile) or 2 (full: no mask needed).
    """
    states: np.ndarray
    block_q: int
    block_k: int

    @property
    def num_skipped(self) -> int:
        return int((self.states == _SKIP).sum())

    @property
    def num_visited(self) -> int:
        return int((self.states != _SKIP).sum())


def _tile_visible(mask_mod, b, h, r0, r1, c0, c1, Nq, Nk, causal, window):
    """(r1 - r0, c1 - c0) visibility of one tile: the causal/window band AND mask_mod."""
    vis = cv.mask(Nq, Nk, causal, window, rows=(r0, r1), cols=(c0, c1))
    if mask_mod is not None:
        q_idx, kv_idx = np.arange(r0, r1)[:, None], np.arange(c0, c1)[None, :]
        vis = vis & np.broadcast_to(np.asarray(mask_mod(b, h, q_idx, kv_idx), dtype=bool), vis.shape)
    return vis


def block_mask(mask_mod=None, *, batch, heads, seqlen_q, seqlen_k, block_q, block_k,
               causal=False, window=None) -> BlockMask:
    """Evaluate ``mask_mod`` tile by tile into a :class:`BlockMask` (computed once, ahead of the
    kernel, from indices alone: it reads nothing from HBM)."""
    Tr, Tc = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    states = np.empty((batch, heads, Tr, Tc), np.int8)
    for b in range(batch):
        for h in range(heads):
            for i, (r0, r1) in enumerate(_row_tiles(seqlen_q, block_q)):
                for j, (c0, c1) in enumerate(_row_tiles(seqlen_k, block_k)):
                    vis = _tile_visible(mask_mod, b, h, r0, r1, c0, c1, seqlen_q, seqlen_k, causal, window)
                    states[b, h, i, j] = _FULL if vis.all() else (_PARTIAL if vis.any() else _SKIP)
    return BlockMask(states, block_q, block_k)


def forward_flex(q, k, v, *, scale=None, score_mod=None, mask_mod=None, bias=None, causal=False,
                 window=None, config=None, blocks=None):
    """FlashAttention-2's loops with a ``score_mod`` and a block-sparse ``mask_mod``.  Returns (O, LSE).

    ``bias`` (batch, heads_q, N_q, N_k), if given, is a dense additive bias that lives in HBM:
    each visited tile loads its (Br, Bc) slice, which the counter sees as the tensor "bias".
    It is here to be compared with a ``score_mod`` that adds the same values from indices.
    The block mask (``blocks``, or computed here) is read per query tile: Tc int8 states,
    counted as "block_mask".  Fully masked tiles are skipped; rows that see no key give O = 0
    and LSE = -inf.
    """
    cv.check_qkv(q, k, v)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name}: expected a function or None, got {type(fn).__name__}")
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = _resolve_config(config, d, q.dtype.name)
    if bias is not None and tuple(bias.shape) != (B, Hq, Nq, Nk):
        raise ValueError(f"bias: expected shape {(B, Hq, Nq, Nk)}, got {tuple(bias.shape)}")
    scale = cv.resolve_scale(scale, d)
    acc = cv.accum_dtype(q.dtype.name)
    bm = blocks if blocks is not None else block_mask(
        mask_mod, batch=B, heads=Hq, seqlen_q=Nq, seqlen_k=Nk, block_q=cfg.block_q,
        block_k=cfg.block_k, causal=causal, window=window)
    if bm.states.shape != (B, Hq, -(-Nq // cfg.block_q), -(-Nk // cfg.block_k)):
        raise ValueError(f"blocks: states of shape {bm.states.shape} do not match the problem's tiles")
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    BIAS = HBM(bias, "bias") if bias is not None else None
    BM = HBM(bm.states, "block_mask")
    O = HBM.empty(q.shape, q.dtype, "O")
    LSE = HBM.empty((B, Hq, Nq), acc, "LSE")
    kv_tiles = _row_tiles(Nk, cfg.block_k)
    for b in range(B):                                      # grid: one program per (b, h, i)
        for h in range(Hq):
            hk = cv.kv_head(h, Hq, Hkv)
            for i, (r0, r1) in enumerate(_row_tiles(Nq, cfg.block_q)):
                states = BM[b, h, i]                        # load block-mask row i -> SRAM (Tc bytes)
                if not (states != _SKIP).any():             # every key masked for these rows:
                    O[b, h, r0:r1] = 0                      #   write O_i = 0 -> HBM
                    LSE[b, h, r0:r1] = -np.inf              #   write LSE_i = -inf -> HBM
                    continue
                q_i = Q[b, h, r0:r1].astype(acc)            # load Q_i -> SRAM
                n = r1 - r0
                m, l, o = np.full(n, -np.inf, acc), np.zeros(n, acc), np.zeros((n, d), acc)
                q_idx = np.arange(r0, r1)[:, None]
                for j, (c0, c1) in enumerate(kv_tiles):     # for each K/V tile j
                    if states[j] == _SKIP:                  #   fully masked: never loaded
                        continue
                    k_j = K[b, hk, c0:c1].astype(acc)       # load K_j -> SRAM
                    v_j = V[b, hk, c0:c1].astype(acc)       # load V_j -> SRAM
                    s = (q_i @ k_j.T) * acc.type(scale)     # S_ij on chip
                    if BIAS is not None:
                        s = s + BIAS[b, h, r0:r1, c0:c1].astype(acc)   # load bias_ij -> SRAM (Br*Bc)
                    if score_mod is not None:               # computed from indices: no HBM bytes
                        s = np.asarray(score_mod(s, b, h, q_idx, np.arange(c0, c1)[None, :]), acc)
                    if states[j] == _PARTIAL:               # mask inside the tile
                        vis = _tile_visible(mask_mod, b, h, r0, r1, c0, c1, Nq, Nk, causal, window)
                        s = np.where(vis, s, -np.inf)
                    m_new = np.maximum(m, s.max(axis=1))
                    m_ref = np.where(np.isneginf(m_new), 0.0, m_new).astype(acc)
                    alpha = np.exp(m - m_ref)
                    p = np.exp(s - m_ref[:, None])
                    l = alpha * l + p.sum(axis=1)
                    o = alpha[:, None] * o + p @ v_j
                    m = m_new
                o, lse = _finalize(m, l, o)
                O[b, h, r0:r1] = o                          # write O_i -> HBM (once)
                LSE[b, h, r0:r1] = lse                      # write LSE_i -> HBM (once)
    return O.result(), LSE.result()


def traffic_model_flex(*, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                       mask_mod=None, bias=False, causal=False, window=None, config=None,
                       blocks=None) -> Traffic:
    """Closed-form HBM bytes of :func:`forward_flex`, from its block mask.

    Per (b, query head) and query tile i of n_i rows: read its Tc block-mask states; if a
    tile is visited, read Q_i; for every visited key tile of c_j keys read c_j*d of K and of
    V (and n_i*c_j of the dense bias when ``bias``); write O_i and LSE_i.  A score_mod adds
    nothing: it reads no tensor.
    """
    cfg, st, acc, _ = _problem(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, config)
    bm = blocks if blocks is not None else block_mask(
        mask_mod, batch=batch, heads=heads_q, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        block_q=cfg.block_q, block_k=cfg.block_k, causal=causal, window=window)
    rows = np.array([r1 - r0 for r0, r1 in _row_tiles(seqlen_q, cfg.block_q)])
    cols = np.array([c1 - c0 for c0, c1 in _row_tiles(seqlen_k, cfg.block_k)])
    visited = bm.states != _SKIP                                    # (B, H, Tr, Tc)
    any_row = visited.any(axis=-1)                                  # (B, H, Tr)
    kv_el = int((visited * cols).sum()) * head_dim
    t = Traffic()
    t.add("block_mask", read=bm.states.size * BLOCK_MASK_ITEMSIZE)
    t.add("Q", read=int((any_row * rows).sum()) * head_dim * st)
    t.add("K", read=kv_el * st)
    t.add("V", read=kv_el * st)
    if bias:
        t.add("bias", read=int((visited * rows[:, None] * cols[None, :]).sum()) * st)
    t.add("O", written=batch * heads_q * seqlen_q * head_dim * st)
    t.add("LSE", written=batch * heads_q * seqlen_q * acc)
    return t
