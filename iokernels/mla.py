"""Multi-head latent attention (MLA) decode: one cached row per token, shared by every head.

DeepSeek-V2 (DeepSeek-AI, 2024) replaced the per-head keys and values of the KV cache by
one low-rank *latent* vector c_t per token, from which every head's key and value are
up-projected, plus one small rotary key k_R,t shared by all heads:

    k_i,t = [W_UK,i^T c_t ; k_R,t]        v_i,t = W_UV,i^T c_t        q_i = [q_C,i ; q_R,i]
    s_i,t = scale * q_i . k_i,t           o_i = sum_t softmax_t(s_i,t) v_i,t

The rotary part is kept apart ("decoupled rotary position embedding") because a rotation
that depends on the key's position cannot be moved past W_UK; the 64 rotary values are
cached as they are.  DeepSeek-V3 (DeepSeek-AI, technical report, 2024; its config.json:
kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, 128 heads)
caches 512 + 64 = 576 values per token per layer, the row [c_t | k_R,t].

Two ways to decode over that cache, checked exact against each other and the float64
oracle :func:`reference_mla`:

* :func:`mla_decode_unabsorbed`: up-project every cached latent to per-head keys and
  values (H * (d_h + d_R) and H * d_v values per token, written to HBM), then run ordinary
  multi-head Flash-Decoding over them.  It is the definition, and it moves H times the
  cache's bytes twice (written, then read back).
* :func:`mla_decode_absorbed`: since q_C,i . (W_UK,i^T c_t) = (W_UK,i q_C,i) . c_t, each
  query is projected into the latent space once (q_lat,i, d_c values); since
  sum_t p_t W_UV,i^T c_t = W_UV,i^T (sum_t p_t c_t), attention runs over the latents
  themselves and its d_c-wide output is up-projected once.  What is left is multi-query
  attention with one KV head: the key is the whole row [c_t | k_R,t], the value its first
  d_c columns, and one load of the row serves all H heads.  In the model W_UK and W_UV are
  folded into the query and output projections (DeepSeek-V2 paper, section 2.1.2).
  :func:`paged_mla_decode` is the same over a keys-only :class:`iokernels.paged.PagedKVCache`
  (num_kv_heads 1, head_dim d_c + d_R), quantized or not.

Notation
========

=========  ==============================================================
B, H       batch (sequences, one new query token each), query heads
N, n_b     cache length (padded) and sequence b's length
d_c        latent width (kv_lora_rank; 512 in DeepSeek-V3)
d_R        rotary key width, shared by all heads (qk_rope_head_dim; 64)
d_h, d_v   per-head key width without the rotary part, value width (128, 128)
c_t, k_R,t token t's latent (d_c) and rotary key (d_R): its cache row (d_c + d_R)
W_UK       (H, d_c, d_h): head i's key up-projection, k_C,i,t = c_t @ W_UK[i]
W_UV       (H, d_c, d_v): head i's value up-projection, v_i,t = c_t @ W_UV[i]
q_C, q_R   a head's query without and with rotary position (d_h, d_R)
q_lat      the absorbed query, W_UK[i] @ q_C,i (d_c)
scale      1 / sqrt(d_h + d_R) unless given (the query width before absorption)
Bc, S      keys per tile (16, as the other decode kernels) and splits
=========  ==============================================================

Traffic is counted (HBM arrays) and modelled in closed form (:func:`traffic_model`), with
the same split-KV grid as :mod:`iokernels.decode`.  FLOPs: :func:`mla_flops`.

Frank notes
-----------
* The absorbed form does more attention arithmetic per token (2 (d_c + d_R) + 2 d_c per
  head instead of 2 (d_h + d_R) + 2 d_v): the point is bytes, not FLOPs.  With 128 heads
  sharing each row it has enough FLOPs per byte to reach the compute roof
  (:mod:`iokernels.models`), which is why GPU kernels for it use tensor cores.
* DeepSeek-V3 multiplies the softmax scale by a YaRN factor for its long-context
  extension; pass ``scale`` to use it.
* The weight products (absorbing the query, up-projecting the output) are plain matmuls
  outside the counted kernels: in the model they merge with the query and output
  projections, whose weights are read once a step for the whole batch either way.
"""
from __future__ import annotations

import math

import numpy as np

from .core import conventions as cv
from .core import reference
from .core.testing import numpy_dtype
from .core.traffic import HBM, Traffic
from .decode import (DEFAULT_BLOCK_N, _lens, _resolve_splits, _starts, paged_tile_loader, split_kv_grid,
                     split_kv_model)
from .paged import PagedKVCache, storage_dtype

__all__ = ["DEEPSEEK_V3_MLA", "default_scale", "make_mla_inputs", "reference_mla", "reference_latent", "absorb_query",
           "up_project_cache", "mla_decode_unabsorbed", "mla_decode_absorbed", "paged_mla_decode",
           "latent_cache", "traffic_model", "mla_flops"]

#: DeepSeek-V3's attention shapes (its config.json): latent, rotary, per-head key and value
#: widths, query heads.
DEEPSEEK_V3_MLA = dict(latent_dim=512, rope_dim=64, head_dim=128, v_head_dim=128, heads=128)


def default_scale(head_dim, rope_dim) -> float:
    """1 / sqrt(d_h + d_R): a head's query width before absorption, not the 576 of the row."""
    return 1.0 / math.sqrt(head_dim + rope_dim)


def make_mla_inputs(rng, batch=1, heads=8, seqlen=40, latent_dim=32, rope_dim=8, head_dim=16, v_head_dim=None,
                    dtype="float64"):
    """Seeded MLA decode inputs: a dict of q_nope, q_rope, kv_latent (B, N, d_c + d_R), w_uk, w_uv.

    Standard normal activations; weights N(0, 1 / d_c), so per-head keys and values are
    O(1) like the activations.  ``rng`` is passed in; values are rounded to ``dtype``.
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    dt = numpy_dtype(dtype)
    w = 1.0 / math.sqrt(latent_dim)
    return dict(
        q_nope=rng.standard_normal((batch, heads, head_dim)).astype(dt),
        q_rope=rng.standard_normal((batch, heads, rope_dim)).astype(dt),
        kv_latent=rng.standard_normal((batch, seqlen, latent_dim + rope_dim)).astype(dt),
        w_uk=(w * rng.standard_normal((heads, latent_dim, head_dim))).astype(dt),
        w_uv=(w * rng.standard_normal((heads, latent_dim, dv))).astype(dt))


def _check(q_nope, q_rope, w_uk, w_uv, row_dim, batch=None, kv_dtype=None):
    """Shapes and dtypes of an MLA problem; returns (B, H, d_c, d_R, d_h, d_v)."""
    for name, x, rank in (("q_nope", q_nope, 3), ("q_rope", q_rope, 3), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
        if not isinstance(x, np.ndarray) or x.ndim != rank:
            raise ValueError(f"{name}: expected a rank-{rank} NumPy array, got {getattr(x, 'shape', type(x).__name__)}")
    B, H, dh = q_nope.shape
    dc, dr = w_uk.shape[1], q_rope.shape[2]
    if q_rope.shape[:2] != (B, H):
        raise ValueError(f"q_rope: expected shape ({B}, {H}, d_R), got {q_rope.shape}")
    if w_uk.shape != (H, dc, dh):
        raise ValueError(f"w_uk: expected shape ({H}, d_c, {dh}), got {w_uk.shape}")
    if w_uv.shape[:2] != (H, dc):
        raise ValueError(f"w_uv: expected shape ({H}, {dc}, d_v), got {w_uv.shape}")
    if row_dim != dc + dr:
        raise ValueError(f"kv_latent: rows must be d_c + d_R = {dc} + {dr} = {dc + dr} wide, got {row_dim}")
    if batch is not None and batch != B:
        raise ValueError(f"q_nope: expected {batch} sequences (axis 0), got {B}")
    names = {cv.dtype_name(x) for x in (q_nope, q_rope, w_uk, w_uv)}
    if len(names) != 1:
        raise ValueError(f"q_rope, w_uk, w_uv: dtypes must match q_nope's {q_nope.dtype}; got {sorted(names)}")
    if kv_dtype is not None and kv_dtype != q_nope.dtype:
        raise ValueError(f"kv_latent: dtype must equal q_nope's {q_nope.dtype}, got {kv_dtype}")
    return B, H, dc, dr, dh, w_uv.shape[2]


# --------------------------------------------------------------------------- the oracle
def reference_mla(q_nope, q_rope, kv_latent, w_uk, w_uv, *, seq_lens=None, scale=None, window=None):
    """Float64 MLA decode by the definition: up-project, then plain attention. Returns (O, LSE).

    O (B, H, d_v), LSE (B, H).  Sequence b uses rows [0, seq_lens[b]) of kv_latent (B, N, d_c + d_R).
    """
    f = reference._f64
    qn, qr, kv, wk, wv = f(q_nope), f(q_rope), f(kv_latent), f(w_uk), f(w_uv)
    B, H, dh = qn.shape
    dc, dr = wk.shape[1], qr.shape[2]
    scale = default_scale(dh, dr) if scale is None else scale
    lens = _lens(seq_lens, B, kv.shape[1])
    c, kr = kv[..., :dc], kv[..., dc:]
    k = np.concatenate([np.einsum("bnc,hcd->bhnd", c, wk), np.broadcast_to(kr[:, None], (B, H) + kr.shape[1:])], -1)
    v = np.einsum("bnc,hcd->bhnd", c, wv)
    q = np.concatenate([qn, qr], -1)
    O, lse = np.zeros((B, H, wv.shape[2])), np.full((B, H), -np.inf)
    for b, n in enumerate(lens):
        if n:
            o_b, l_b = reference.attention(q[b][None, :, None], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                           scale=scale, window=window)
            O[b], lse[b] = o_b[0, :, 0], l_b[0, :, 0]
    return O, lse


def reference_latent(q_abs, kv_latent, latent_dim, *, seq_lens=None, scale=None):
    """Float64 attention of the absorbed form itself: what a latent-attention kernel computes.

    q_abs (B, H, d_c + d_R): the absorbed queries [q_lat | q_R]; kv_latent (B, N, d_c + d_R).
    O (B, H, d_c) = softmax(scale q_abs c^T) c[:, :d_c] over rows [0, seq_lens[b]); LSE (B, H);
    a sequence with no rows gives O = 0, LSE = -inf.  ``scale`` None: DeepSeek-V3's
    1 / sqrt(d_h + d_R) (:data:`DEEPSEEK_V3_MLA`).
    """
    q, kv = reference._f64(q_abs), reference._f64(kv_latent)
    B, H, row = q.shape
    if scale is None:
        scale = default_scale(DEEPSEEK_V3_MLA["head_dim"], DEEPSEEK_V3_MLA["rope_dim"])
    lens = _lens(seq_lens, B, kv.shape[1])
    O, lse = np.zeros((B, H, latent_dim)), np.full((B, H), -np.inf)
    for b, n in enumerate(lens):
        if n:
            o_b, l_b = reference.attention(q[b][None, :, None], kv[b, None, None, :n],
                                           kv[b, None, None, :n, :latent_dim], scale=scale)
            O[b], lse[b] = o_b[0, :, 0], l_b[0, :, 0]
    return O, lse


# --------------------------------------------------------------------------- the two forms
def absorb_query(q_nope, w_uk):
    """q_lat[b, i] = W_UK[i] @ q_C[b, i]: each head's query in the latent space (d_c).

    Kept in the accumulator precision (float32; float64 for float64 inputs), not rounded
    to a 16-bit storage dtype: a rounding error in q_lat shifts *every* score of its head
    coherently (by delta_q . c_t), so it would not average out over the keys the way the
    unabsorbed form's independent per-key roundings do.  It is H (d_c + d_R) values per
    sequence, nothing beside the cache.
    """
    acc = cv.accum_dtype(q_nope.dtype.name)
    return np.einsum("bhd,hcd->bhc", q_nope.astype(acc), w_uk.astype(acc))


def _up_project_output(o_lat, w_uv):
    """o[b, i] = o_lat[b, i] @ W_UV[i] (d_c -> d_v), in the weights' (the inputs') dtype."""
    acc = cv.accum_dtype(w_uv.dtype.name)
    return np.einsum("bhc,hcd->bhd", o_lat.astype(acc), w_uv.astype(acc)).astype(w_uv.dtype)


def up_project_cache(kv_latent, w_uk, w_uv, lens, starts):
    """The unabsorbed form's first kernel: per-head K, V from the latent rows, written to HBM.

    Per sequence b: load rows [starts[b], lens[b]) of the cache -> SRAM once; write
    K (H, n, d_h + d_R) = [c W_UK[i] | k_R] and V (H, n, d_v) = c W_UV[i] -> HBM, in the
    cache's dtype.  Returns the K and V arrays (B, H, N, .).
    """
    B, N, row = kv_latent.shape
    H, dc, dh = w_uk.shape
    acc = cv.accum_dtype(kv_latent.dtype.name)
    LAT = HBM(kv_latent, "KV_latent")
    K = HBM.zeros((B, H, N, dh + row - dc), kv_latent.dtype, "K")
    V = HBM.zeros((B, H, N, w_uv.shape[2]), kv_latent.dtype, "V")
    wk, wv = w_uk.astype(acc), w_uv.astype(acc)
    for b in range(B):                                        # grid: one block per sequence
        a, n = starts[b], lens[b]
        if n == a:
            continue
        rows = LAT[b, a:n].astype(acc)                        # load the latent rows -> SRAM
        c, kr = rows[:, :dc], rows[:, dc:]
        k_c = np.einsum("nc,hcd->hnd", c, wk)
        K[b, :, a:n] = np.concatenate([k_c, np.broadcast_to(kr, (H,) + kr.shape)], -1).astype(K.dtype)  # write K
        V[b, :, a:n] = np.einsum("nc,hcd->hnd", c, wv).astype(V.dtype)                                 # write V
    return K.result(), V.result()


def mla_decode_unabsorbed(q_nope, q_rope, kv_latent, w_uk, w_uv, *, seq_lens=None, num_splits=None, scale=None,
                          window=None):
    """MLA decode by the definition: :func:`up_project_cache`, then multi-head split-KV decode.

    q_nope (B, H, d_h), q_rope (B, H, d_R), kv_latent (B, N, d_c + d_R), w_uk (H, d_c, d_h),
    w_uv (H, d_c, d_v).  The per-head K and V live in HBM in the inputs' dtype (as a
    framework that decompresses the cache would hold them).  With ``window`` only the
    visible rows are up-projected and read.  Returns (O (B, H, d_v), LSE).
    """
    B, H, dc, dr, dh, dv = _check(q_nope, q_rope, w_uk, w_uv, kv_latent.shape[-1], kv_latent.shape[0],
                                  kv_latent.dtype)
    lens = _lens(seq_lens, B, kv_latent.shape[1])
    starts, longest = _starts(lens, window)
    k, v = up_project_cache(kv_latent, w_uk, w_uv, lens, starts)
    K, V = HBM(k, "K"), HBM(v, "V")

    def load(b, h, t):                                        # load K_j, V_j of head h -> SRAM
        return K[b, h, t[0]:t[1]], V[b, h, t[0]:t[1]]

    q = np.concatenate([q_nope, q_rope], -1)
    return split_kv_grid(q, load, lens=lens, starts=starts,
                         num_splits=_resolve_splits(num_splits, B, H, longest, DEFAULT_BLOCK_N),
                         block_n=DEFAULT_BLOCK_N, heads_kv=H, value_dim=dv,
                         scale=default_scale(dh, dr) if scale is None else scale)


def _latent_attention(q_nope, q_rope, w_uk, w_uv, load_row, lens, window, num_splits, scale, block_n, dc, dh, dr):
    """The absorbed form: absorb the query, one-KV-head attention over the rows, up-project O."""
    B = q_nope.shape[0]
    starts, longest = _starts(lens, window)
    q_lat = absorb_query(q_nope, w_uk)
    q_abs = np.concatenate([q_lat, q_rope.astype(q_lat.dtype)], -1)     # (B, H, d_c + d_R), accumulator dtype

    def load(b, h, t):                                        # one row tile -> SRAM: K is the row,
        row = load_row(b, t)                                  # V its first d_c columns (no second read)
        return row, row[:, :dc]

    o_lat, lse = split_kv_grid(q_abs, load, lens=lens, starts=starts,
                               num_splits=_resolve_splits(num_splits, B, 1, longest, block_n),
                               block_n=block_n, heads_kv=1, value_dim=dc,
                               scale=default_scale(dh, dr) if scale is None else scale)
    return _up_project_output(o_lat, w_uv), lse


def mla_decode_absorbed(q_nope, q_rope, kv_latent, w_uk, w_uv, *, seq_lens=None, num_splits=None, scale=None,
                        window=None):
    """MLA decode with the weights absorbed: every head reads the same latent rows, once.

    Arguments as :func:`mla_decode_unabsorbed`.  The kernel is split-KV decode with one KV
    head and g = H: a worker loads a tile of rows [c | k_R] (Bc, d_c + d_R) -> SRAM, scores
    all H absorbed queries against it and accumulates its first d_c columns as values.
    Returns (O (B, H, d_v), LSE).
    """
    B, H, dc, dr, dh, dv = _check(q_nope, q_rope, w_uk, w_uv, kv_latent.shape[-1], kv_latent.shape[0],
                                  kv_latent.dtype)
    LAT = HBM(kv_latent, "KV_latent")
    return _latent_attention(q_nope, q_rope, w_uk, w_uv, lambda b, t: LAT[b, t[0]:t[1]],
                             _lens(seq_lens, B, kv_latent.shape[1]), window, num_splits, scale,
                             DEFAULT_BLOCK_N, dc, dh, dr)


def latent_cache(num_blocks, latent_dim, rope_dim, block_size=16, dtype=np.float32, kv_dtype=None):
    """A keys-only PagedKVCache for latent rows: num_kv_heads 1, head_dim d_c + d_R."""
    return PagedKVCache(num_blocks, block_size, num_kv_heads=1, head_dim=latent_dim + rope_dim, dtype=dtype,
                        kv_dtype=kv_dtype, keys_only=True)


def paged_mla_decode(q_nope, q_rope, cache, seq_ids, w_uk, w_uv, *, num_splits=None, scale=None, window=None):
    """:func:`mla_decode_absorbed` over a paged latent cache (:func:`latent_cache`).

    Each tile is one block's valid rows, found through the block table (one int32 entry
    per tile); a quantized cache's block scale is read with it and the rows dequantized on
    chip.  Returns (O (len(seq_ids), H, d_v), LSE).
    """
    if not isinstance(cache, PagedKVCache) or not cache.keys_only or cache.num_kv_heads != 1:
        raise ValueError("cache: expected a keys-only PagedKVCache with one KV head (iokernels.mla.latent_cache)")
    seq_ids = [cache._check_sid(s) for s in seq_ids]
    B, H, dc, dr, dh, dv = _check(q_nope, q_rope, w_uk, w_uv, cache.head_dim, len(seq_ids))
    if q_nope.dtype != cache.dtype:
        raise ValueError(f"q_nope: dtype must equal the cache's {cache.dtype.name}, got {q_nope.dtype}")
    load, lens = paged_tile_loader(cache, seq_ids, pools=("K",))
    return _latent_attention(q_nope, q_rope, w_uk, w_uv, lambda b, t: load(b, 0, t)[0], lens, window,
                             num_splits, scale, cache.block_size, dc, dh, dr)


# --------------------------------------------------------------------------- models
def traffic_model(form, *, batch, heads, latent_dim, rope_dim, head_dim, v_head_dim=None, seq_lens, num_splits=None,
                  dtype="float32", window=None, paged=False, block_size=DEFAULT_BLOCK_N, kv_dtype=None):
    """Closed-form HBM traffic of one MLA decode step, ``form`` "absorbed" or "unabsorbed".

    absorbed: split-KV decode with one KV head over rows of d_c + d_R values (named
    KV_latent, or K_cache with ``paged``: plus a table entry, and with ``kv_dtype`` a
    scale, per tile), H absorbed queries of d_c + d_R and latent outputs of d_c, both in
    the accumulator dtype (see :func:`absorb_query`).  unabsorbed: the
    up-projection reads the visible rows once and writes per-head K (d_h + d_R) and
    V (d_v), which multi-head split-KV decode reads back.  Weights are not counted (see
    the module's notes).
    """
    cv.check_choice(form, "form", ("absorbed", "unabsorbed"))
    dv = head_dim if v_head_dim is None else v_head_dim
    lens = _lens(seq_lens, batch, None)
    starts, longest = _starts(lens, window)
    s = storage_dtype(dtype).itemsize
    a = cv.accum_dtype(storage_dtype(dtype).name).itemsize
    row = latent_dim + rope_dim
    t = Traffic()
    if form == "absorbed":
        bn = block_size if paged else DEFAULT_BLOCK_N
        S = _resolve_splits(num_splits, batch, 1, longest, bn)
        kv_s = s if kv_dtype is None else storage_dtype(kv_dtype).itemsize
        return split_kv_model(t, batch=batch, heads_q=heads, heads_kv=1, head_dim=row, lens=lens, starts=starts,
                              S=S, block_n=bn, s=a, a=a, kv_names=("K_cache" if paged else "KV_latent", None),
                              table=paged, kv_itemsize=kv_s, scales=kv_dtype is not None, value_dim=latent_dim)
    for n, start in zip(lens, starts):
        t.add("KV_latent", read=(n - start) * row * s)
        t.add("K", written=heads * (n - start) * (head_dim + rope_dim) * s)
        t.add("V", written=heads * (n - start) * dv * s)
    S = _resolve_splits(num_splits, batch, heads, longest, DEFAULT_BLOCK_N)
    return split_kv_model(t, batch=batch, heads_q=heads, heads_kv=heads, head_dim=head_dim + rope_dim, lens=lens,
                          starts=starts, S=S, block_n=DEFAULT_BLOCK_N, s=s, a=a, kv_names=("K", "V"), table=False,
                          value_dim=dv)


def mla_flops(form, *, heads, latent_dim, rope_dim, head_dim, v_head_dim=None, seq_lens):
    """FLOPs of one MLA decode step (2 per multiply-add): dict(attention, projection, total).

    absorbed: per cached token and head, 2 (d_c + d_R) for the score and 2 d_c for the
    value sum; per query head, 2 d_h d_c to absorb the query and 2 d_c d_v to up-project O.
    unabsorbed: per cached token and head, 2 d_c (d_h + d_v) to up-project K and V, then
    2 (d_h + d_R) + 2 d_v of attention.
    """
    cv.check_choice(form, "form", ("absorbed", "unabsorbed"))
    dv = head_dim if v_head_dim is None else v_head_dim
    tokens = int(sum(int(n) for n in seq_lens))
    if form == "absorbed":
        attn = tokens * heads * (2 * (latent_dim + rope_dim) + 2 * latent_dim)
        proj = len(list(seq_lens)) * heads * (2 * head_dim * latent_dim + 2 * latent_dim * dv)
    else:
        attn = tokens * heads * (2 * (head_dim + rope_dim) + 2 * dv)
        proj = tokens * heads * 2 * latent_dim * (head_dim + dv)
    return dict(attention=attn, projection=proj, total=attn + proj)
