"""Every registered CuPy kernel once at ragged shapes, against the float64 oracle.

:func:`sanitize_cases` is what ``scripts/sanitize.py`` runs under compute-sanitizer
(memcheck, racecheck, synccheck, initcheck).  It iterates :data:`REGISTRY`: each (op,
version) runs for every dtype its check accepts, at shapes that are multiples of no tile
(Nq = 37, Nk = 77, head dims 64, 72 and 59 -- 59 takes the element-wise copy paths of the
versions that have word paths --, GQA 4/2, a window, ragged decode lengths with an empty
sequence, a paged cache with a partial last block, in the dtypes a PagedKVCache holds,
a sliding-window decode, quantized paged caches of :data:`QUANT_CASES` (read by v1, v3 and
v4's codes path), the larger groups of :data:`DECODE_HEADS` (decode v6, v7, v8; v8 at the head
dims of :data:`DECODE_DIMS_OF`); MLA decode at 80
query heads, contiguous and paged), plus the settings in :data:`VARIANTS`.  A quantized
cache's decode is held against the oracle on the values the cache holds (its codes times
its scales, :meth:`PagedKVCache.gather`).  The paged prefill runs chunks of :data:`PREFILL_CHUNKS`
rows (a partial chunk, a whole prompt, a decode row) over the paged cache, GQA 8/2 and MHA,
causal and not.  After the registry's: the kernels without a record (:data:`UNRECORDED`), the
randomized Hadamard transform and the opt-in FP8 forward (on Hopper).
Inputs are NumPy arrays, so CuPy is the only GPU library loaded.  Each result is held
against :mod:`iokernels.core.reference` with the shared checker (float64 to about 1e-12,
lower precisions by the 2x rule against the naive algorithm in the same precision).
"""
from __future__ import annotations

import functools

import numpy as np

from .. import api, fp8
from ..core import reference
from ..core.testing import check, make_inputs, numpy_dtype
from ..core.testing import GRADIENT_FACTOR
from .policy import decode_v6_team_warps
from . import hopper
from .hadamard import FWHT_HEAD_DIMS, fwht
from .launch import device_info
from .registry import REGISTRY, need

DTYPES = ("float32", "float16", "bfloat16", "float64")
#: forward shapes: (head_dim, causal, window)
FORWARD_CASES = ((64, True, None), (72, False, (5, 3)), (59, True, None))
#: forward shapes a version runs beyond FORWARD_CASES: the Hopper kernels at head_dim 256 (their
#: own tiles there, Bc = 64 and two stages); v6 and v10 (head_dim 64
#: only, where FORWARD_CASES has only a causal case) without a mask and with a window
FORWARD_EXTRA = {("attention", v): ((256, True, None), (256, False, (5, 3)))
                 for v in ("v3", "v4", "v5", "v7", "v8", "v9", "v11")}
FORWARD_EXTRA[("attention", "v6")] = ((64, False, None), (64, False, (5, 3)))
FORWARD_EXTRA[("attention", "v10")] = FORWARD_EXTRA[("attention", "v6")]
#: the forward's sizes: batch 2, 4 query heads over 2, 37 query rows over 77 keys (one query tile
#: a head); v11 (longest first) at 3 x 4 pairs of three 128-row query tiles, so that under the
#: causal mask its group (all 12 pairs: their K and V fit the L2 cache) reorders the blocks; groups
#: of other sizes, a short last one among them, run in its GPU test (tests/test_hopper.py)
FORWARD_SIZES = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=77)
FORWARD_SIZES_OF = {("attention", "v11"): dict(batch=3, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=333)}
#: decode: head dims, batch lengths (one empty), split counts
DECODE_DIMS = (64, 59)
DECODE_LENS = (301, 0, 129)
DECODE_SPLITS = (1, 5)
PAGED_LENS = (301, 45)
PAGED_SPLITS = (3, 1)
BLOCK_SIZE = 16
#: the sliding window of the windowed decode cases: it starts inside the first split of 5
#: and leaves the splits before it without keys
DECODE_WINDOW = (100, 0)
#: quantized paged caches: (code format, scale granularity), at these head dims (decode v5 reads
#: the codes at 64 -- rows of 4 chunks, swizzled in pairs -- and 128 -- rows of 8 --; v1 and v3
#: at 59 too)
QUANT_CASES = (("int8", "block_head"), ("float8_e4m3fn", "block"))
QUANT_DIMS = (64, 128, 59)
#: settings run next to each version's default config (kwargs of its config class)
VARIANTS = {("decode", "v1"): ({}, {"combine": "serial"}),        # decode.cu's combine, not the default's
            ("decode", "v3"): ({}, {"fused": False, "num_warps": 8}),
            ("paged_decode", "v3"): ({}, {"fused": False, "num_warps": 8}, {"fused": False, "combine": "serial"}),
            # v4's default loads with cp.async chunks (through L1 over a contiguous cache); the
            # variants: unfused 8 warps of 32-key tiles, .cg with the 3-stage ring, the 4-warp
            # block of large batches (policy.decode_v4_block: 4 warps, a 2-deep ring)
            ("decode", "v4"): ({}, {"fused": False, "num_warps": 8, "tile_rows": 32},
                               {"load_l1": False}, {"num_warps": 4, "stages": 2, "min_blocks": 2},
                               {"fused": False, "combine": "serial"}),
            # and a 2-deep ring, pages copied through L1, and the large batches' 4-warp block
            ("paged_decode", "v4"): ({}, {"fused": False, "num_warps": 8, "tile_rows": 32},
                                     {"tile_rows": 16, "stages": 2}, {"load_l1": True},
                                     {"num_warps": 4, "stages": 2, "min_blocks": 2}),
            # v6 (teams of warps a group): unfused 4-warp blocks of 16-key tiles, a 2-deep ring
            ("decode", "v6"): ({}, {"fused": False, "num_warps": 4, "tile_rows": 16}, {"stages": 2}),
            ("paged_decode", "v6"): ({}, {"tile_rows": 16, "stages": 2}),
            # v7 (the group split over blocks): unfused 4-warp blocks, a 2-deep ring
            ("decode", "v7"): ({}, {"fused": False, "num_warps": 4}, {"stages": 2}),
            # v8 (Hopper, TMA): by default the fused combine at 4 query heads a KV head and the separate
            # one at 32 and 64 (policy.decode_fuse_combine); the fused one at every group over a 2-deep
            # ring; 64-key tiles (d 64's are 128); decode.cu's combine where the combine is separate
            ("decode", "v8"): ({}, {"fused": True, "stages": 2}, {"tile_rows": 64, "stages": 2},
                               {"combine": "serial"}),
            ("paged_decode", "v7"): ({}, {"fused": False, "num_warps": 4}),
            # v9 (v4 dealt in equal runs across pairs): the separate combine (slots a pair does not
            # use marked empty), and the 4-warp block, two an SM (twice the blocks: shorter runs)
            ("decode", "v9"): ({}, {"fused": False}, {"num_warps": 4, "stages": 2, "min_blocks": 2}),
            ("paged_decode", "v9"): ({}, {"fused": False}),
            # v5 (quantized caches): 16-key tiles with a 2-deep ring (the default tile is 32 keys
            # up to d = 128), and the codes copied through L1
            ("paged_decode", "v5"): ({}, {"tile_rows": 16, "stages": 2}, {"load_l1": True}),
            ("attention", "v1b"): ({}, {"block_q": 64, "block_k": 32}),
            # v6 (three consumer warpgroups share each stage): a two-stage ring (all three must release
            # a stage before it is refilled), and no round (the three issue whenever they are ready)
            ("attention", "v6"): ({}, {"stages": 2}, {"pingpong": False}),
            # v7 (K and V released apart): a two-stage ring at every head dim (K_{j+1} refilled while
            # V_{j-1} is still read), and no ping-pong
            ("attention", "v7"): ({}, {"stages": 2}, {"pingpong": False}),
            # v8 (the masked softmax reading row bounds; 80-key tiles at head_dim 256): no ping-pong,
            # and 64-key tiles, which every head dim takes
            ("attention", "v8"): ({}, {"pingpong": False}, {"block_n": 64}),
            # v9 (persistent): two blocks (each claims many tiles, and the counter is reset between
            # launches), no ping-pong, and one block with 64-key tiles
            ("attention", "v9"): ({}, {"blocks": 2}, {"blocks": 2, "pingpong": False}, {"blocks": 1, "block_n": 64}),
            # v10 (v8 with three consumer warpgroups, head_dim 64): a two-stage ring (three consumers
            # release each K and V tile), no round, and 64-key tiles
            ("attention", "v10"): ({}, {"stages": 2}, {"pingpong": False}, {"block_n": 64}),
            # v11 (v8's blocks longest first): v8's variants
            ("attention", "v11"): ({}, {"pingpong": False}, {"block_n": 64}),
            # 4 warps (Bc = 64) and Br = 16: more K/V tiles, so more blocks add into one dQ row
            ("attention_backward", "v2"): ({}, {"num_warps": 4, "block_q": 16}),
            # a one-stage ring: the producer refills the stage the consumer just released, every step
            ("attention_backward", "v3"): ({}, {"stages": 1}),
            # v4 (two consumer warpgroups): a one-stage ring (both must release the stage before
            # it is refilled), and three stages (a ring the producer can run ahead in)
            ("attention_backward", "v4"): ({}, {"stages": 1}, {"stages": 3}),
            # v5 (v4's kernel, its blocks longest first) and v6 (dQ added from SRAM by a producer
            # warp): v4's rings
            ("attention_backward", "v5"): ({}, {"stages": 1}, {"stages": 3}),
            ("attention_backward", "v6"): ({}, {"stages": 1}, {"stages": 3}),
            # the paged prefill: 2 warps of 16-key tiles (a tile inside one cache block), 8 warps of
            # 128-key tiles (8 blocks a tile)
            ("paged_prefill", "v1"): ({}, {"num_warps": 2, "block_k": 16}, {"num_warps": 8, "block_k": 128}),
            # v2 (the g query heads packed into a tile's rows): the same tiles, so a 32-row tile
            # holds 8 tokens x 4 heads and a token's group may straddle two tiles
            ("paged_prefill", "v2"): ({}, {"num_warps": 2, "block_k": 16}, {"num_warps": 8, "block_k": 128}),
            # the Hopper paged prefill v3: 64-key tiles (4 blocks of 16), 2 stages without ping-pong
            ("paged_prefill", "v3"): ({}, {"block_n": 64}, {"stages": 2, "pingpong": False})}
#: calls a version makes twice in a row (the fused combine's counters must be back at 0 after a call)
TWICE = {("decode", "v3"), ("paged_decode", "v3"), ("decode", "v4"), ("paged_decode", "v4"), ("paged_decode", "v5"),
         ("decode", "v6"), ("paged_decode", "v6"), ("decode", "v7"), ("paged_decode", "v7"), ("decode", "v8"),
         ("decode", "v9"), ("paged_decode", "v9")}
#: decode: (query heads, KV heads) a version also runs at, beyond GQA 4/2 (v6: teams of 4 warps
#: with an idle last warp, g = 40, of 2 warps, g = 32, and one team of 8 warps that fills the
#: block, g = 128, the largest group the default gives v6; v7, which takes only the groups v3's
#: registers do not hold: one block a KV head at float32 g = 16, four at MQA g = 64, one head a
#: block at the prime g = 71); paged: query heads over the cache's 2
DECODE_HEADS = {"v6": ((4, 2), (40, 1), (64, 2), (128, 1)), "v7": ((32, 2), (64, 1), (71, 1)),
                "v8": ((4, 2), (32, 1), (64, 2)), "v9": ((4, 2), (16, 1))}
#: decode: the head dims a version runs at instead of DECODE_DIMS (v8, on Hopper: two consumer
#: warpgroups at 64, one at 256)
DECODE_DIMS_OF = {"v8": (64, 256)}
PAGED_HEADS_Q = {"v6": (4, 64), "v7": (32, 64)}


def _ok(c, label):
    if not c:
        raise AssertionError(f"{label}: {c}")


def _forward(kernel, cfg, dtype, rng, label):
    out = []
    for d, causal, window in FORWARD_CASES + FORWARD_EXTRA.get((kernel.op, kernel.version), ()):
        sizes = FORWARD_SIZES_OF.get((kernel.op, kernel.version), FORWARD_SIZES)
        q, k, v = make_inputs(rng, **sizes, head_dim=d, dtype=dtype)
        if kernel.unavailable(need("attention", q=q, k=k, v=v)) is not None:
            continue
        o, lse = kernel.launcher(q, k, v, causal=causal, scale=None, window=window, config=cfg)
        ref_o, ref_l = reference.attention(q, k, v, causal=causal, window=window)
        base = None if dtype == "float64" else api.attention(q, k, v, causal=causal, window=window, backend="naive")
        masked = ~np.isfinite(ref_l)[..., None]
        name = f"{label} d={d} causal={causal} window={window}"
        _ok(check(o, ref_o, base, dtype=dtype, name="O", masked_rows=masked), name)
        out.append(name)
    return out


def _decode_inputs(rng, d, dtype, lens, heads=(4, 2)):
    q, k, v = make_inputs(rng, batch=len(lens), heads_q=heads[0], heads_kv=heads[1], seqlen_q=1,
                          seqlen_k=max(lens), head_dim=d, dtype=dtype)
    return q[:, :, 0], k, v


def _check_decode(o, q, k, v, lens, dtype, name, window=None):
    lens = np.asarray(lens)
    ref_o, ref_l = reference.decode(q, k, v, seq_lens=lens, window=window)
    base = None if dtype == "float64" else api.decode(q, k, v, seq_lens=lens, backend="naive", window=window)
    _ok(check(o, ref_o, base, dtype=dtype, name="O", masked_rows=~np.isfinite(ref_l)[..., None]), name)


def runs_at_group(kernel, cfg, group: int) -> bool:
    """Whether a variant's config is one ``kernel`` runs at ``group`` query heads a KV head: a
    decode v6 variant that names its warps runs only groups whose teams those warps make whole
    (the launcher refuses the rest, by name); the default config runs every group."""
    if kernel.version != "v6" or cfg.num_warps is None:
        return True
    return cfg.num_warps % decode_v6_team_warps(group) == 0


def _decode(kernel, cfg, dtype, rng, label):
    out = []
    dims = DECODE_DIMS_OF.get(kernel.version, DECODE_DIMS)
    for d, heads in ((d, h) for h in DECODE_HEADS.get(kernel.version, ((4, 2),)) for d in dims):
        if not runs_at_group(kernel, cfg, heads[0] // heads[1]):
            continue
        q, k, v = _decode_inputs(rng, d, dtype, DECODE_LENS, heads)
        if kernel.unavailable(need("decode", q=q, k=k, v=v)) is not None:
            continue
        if heads != (4, 2):
            label_h = f"{label} heads {heads[0]}/{heads[1]}"
        else:
            label_h = label
        for splits in DECODE_SPLITS:
            for _ in range(2 if ("decode", kernel.version) in TWICE else 1):
                o, _ = kernel.launcher(q, k, v, seq_lens=np.array(DECODE_LENS), num_splits=splits, scale=None,
                                       config=cfg)
                name = f"{label_h} d={d} splits={splits}"
                _check_decode(o, q, k, v, DECODE_LENS, dtype, name)
            out.append(name)
        o, _ = kernel.launcher(q, k, v, seq_lens=np.array(DECODE_LENS), num_splits=max(DECODE_SPLITS), scale=None,
                               config=cfg, window=DECODE_WINDOW)
        name = f"{label_h} d={d} splits={max(DECODE_SPLITS)} window={DECODE_WINDOW}"
        _check_decode(o, q, k, v, DECODE_LENS, dtype, name, DECODE_WINDOW)
        out.append(name)
    if kernel.extra.get("balanced") and out:
        out.append(_dealt(kernel, cfg, dtype, rng, label))
    return out


#: decode v9's dealt case: GQA 4/2 at head_dim 64, sequences of this many keys (just enough that a
#: run of the deal reaches policy.DECODE_BALANCED_MIN_KEYS: a wave of blocks under racecheck is
#: slow), the batch one wave of blocks + DEALT_EXTRA_PAIRS pairs (one block a pair would leave
#: those few a last wave)
DEALT_KEYS = 520
DEALT_EXTRA_PAIRS = 4


def _dealt(kernel, cfg, dtype, rng, label):
    """decode v9 without a split count at a batch its launch deals across pairs (the cases of
    named split counts run v4's splits; a call without one at a few pairs launches v4 itself),
    one sequence shorter, called twice where the combine is fused (its counters back at 0);
    AssertionError if this GPU's deal declines it."""
    from .decode_launch import occupancy, split_launch, split_static
    heads, d, dev, batch = (4, 2), 64, device_info(), 1
    for _ in range(3):                   # v4's block shape follows the pairs; so do the blocks of a wave
        st = split_static(kernel, cfg, batch=batch, heads_q=heads[0], heads_kv=heads[1], head_dim=d, dtype=dtype,
                          paged=False, block_size=0, aligned=True, kv=None, dev=dev)
        batch = -(-(dev["sms"] * occupancy(st) + DEALT_EXTRA_PAIRS) // heads[1])
    st = split_static(kernel, cfg, batch=batch, heads_q=heads[0], heads_kv=heads[1], head_dim=d, dtype=dtype,
                      paged=False, block_size=0, aligned=True, kv=None, dev=dev)
    name = f"{label} heads {heads[0]}/{heads[1]} d={d} batch={batch} dealt across pairs"
    if split_launch(st, None, DEALT_KEYS)[4] is not st:
        raise AssertionError(f"{name}: the launch declined the deal on this GPU")
    lens = np.full(batch, DEALT_KEYS)
    lens[batch // 2] = DEALT_KEYS // 3
    q, k, v = _decode_inputs(rng, d, dtype, tuple(lens), heads)
    for _ in range(2 if st.fused else 1):
        o, _ = kernel.launcher(q, k, v, seq_lens=lens, num_splits=None, scale=None, config=cfg)
        _check_decode(o, q, k, v, lens, dtype, name)
    return name


#: the dtypes a PagedKVCache holds (its pools are NumPy arrays; NumPy has no native bfloat16)
PAGED_DTYPES = ("float16", "float32", "float64")


def _paged_cache(rng, d, dtype, **quant):
    """A cache of PAGED_LENS sequences (``quant``: kv_dtype=, scale_granularity= of a quantized one)."""
    from ..paged import PagedKVCache
    cache = PagedKVCache(64, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=d, dtype=numpy_dtype(dtype), **quant)
    sids = []
    for n in PAGED_LENS:
        sid = cache.new_sequence()
        _, k, v = make_inputs(rng, batch=1, heads_q=2, seqlen_q=1, seqlen_k=n, head_dim=d, dtype=dtype)
        cache.append(sid, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
        sids.append(sid)
    return cache, sids


def _contiguous_of(cache, sids):
    ks, vs = zip(*(cache.gather(s, backend="numpy") for s in sids))
    n = max(PAGED_LENS)
    k = np.zeros((len(sids), cache.num_kv_heads, n, cache.head_dim), cache.dtype)   # values, not codes
    v = np.zeros_like(k)
    for b, (kb, vb) in enumerate(zip(ks, vs)):
        k[b, :, :kb.shape[1]], v[b, :, :vb.shape[1]] = kb, vb
    return k, v


def _paged_caches(rng, dtype, quant=False):
    """(head_dim, cache, sequence ids) for each of DECODE_DIMS, in the dtypes a cache holds;
    ``quant``: the quantized caches of QUANT_CASES at QUANT_DIMS too."""
    if dtype in PAGED_DTYPES:
        for d in DECODE_DIMS:
            yield (d, *_paged_cache(rng, d, dtype))
        for d in QUANT_DIMS if quant else ():
            for kv, gran in QUANT_CASES:
                yield (d, *_paged_cache(rng, d, dtype, kv_dtype=kv, scale_granularity=gran))


def _paged_decode(kernel, cfg, dtype, rng, label):
    out = []
    for (d, cache, sids), hq in ((c, hq) for c in _paged_caches(rng, dtype, quant=True)
                                 for hq in PAGED_HEADS_Q.get(kernel.version, (4,))):
        q = make_inputs(rng, batch=len(sids), heads_q=hq, heads_kv=2, seqlen_q=1, seqlen_k=1, head_dim=d,
                        dtype=dtype)[0][:, :, 0]
        if kernel.unavailable(need("paged_decode", q=q, cache=cache)) is not None:
            continue
        k, v = _contiguous_of(cache, sids)                  # what the cache holds (dequantized)
        kind = f" {cache.kv_dtype} {cache.scale_granularity}" if cache.quantized else ""
        kind += f" heads {hq}/2" if hq != 4 else ""
        for splits in PAGED_SPLITS:
            for window in (None, DECODE_WINDOW):
                for _ in range(2 if ("paged_decode", kernel.version) in TWICE else 1):
                    o, _ = kernel.launcher(q, cache, sids, num_splits=splits, scale=None, config=cfg, window=window)
                    name = f"{label}{kind} d={d} splits={splits} window={window}"
                    _check_decode(o, q, k, v, PAGED_LENS, dtype, name, window)
                out.append(name)
    return out


def _gather(kernel, cfg, dtype, rng, label):
    out = []
    for d, cache, sids in _paged_caches(rng, dtype):
        for sid in sids:
            got = kernel.launcher(cache, sid, config=cfg)
            want = cache.gather(sid, backend="numpy")
            if not all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)):
                raise AssertionError(f"{label} d={d} sid={sid}: the gather is not an exact copy")
        out.append(f"{label} d={d}")
    return out


#: the backward's head dims, the first a version takes: 59 (rows not whole 16-byte chunks), else
#: 64 (the Hopper backward takes 64 and 128 only)
BACKWARD_HEAD_DIMS = (59, 64)


def _backward(kernel, cfg, dtype, rng, label):
    """dQ, dK, dV at a ragged GQA shape, causal, by the 3x gradient rule (atomic and deterministic)."""
    out = []
    for d in BACKWARD_HEAD_DIMS:
        q, k, v = make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45, head_dim=d, dtype=dtype)
        if kernel.unavailable(need("attention_backward", q=q, k=k, v=v)) is None:
            break
    else:
        return out
    do = make_inputs(rng, batch=2, heads_q=4, heads_kv=4, seqlen_q=37, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    o, lse = api.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    refs = reference.attention_backward(do, q, k, v, causal=True)
    bases = None if dtype == "float64" else api.attention_backward(do, q, k, v, o, lse, causal=True, backend="naive")
    for det in (False, True):
        got = kernel.launcher(do, q, k, v, o, lse, causal=True, scale=None, window=None,
                              config=cfg.replace(deterministic=det))
        for i, (name, g, r) in enumerate(zip(("dQ", "dK", "dV"), got, refs)):
            _ok(check(g, r, None if bases is None else bases[i], dtype=dtype, name=name,
                      factor=GRADIENT_FACTOR), f"{label} deterministic={det}")
        out.append(f"{label} d={d} causal GQA deterministic={det}")
    return out


#: MLA decode: batch lengths (one empty), query heads (two head blocks, the second partial),
#: split counts, the paged pool's page size
MLA_LENS = (301, 0, 77)
MLA_HEADS = 80
MLA_SPLITS = (1, 3)
MLA_PAGE = 64


def _mla(kernel, cfg, dtype, rng, label):
    """Absorbed MLA decode over a contiguous cache and over a paged pool in shuffled pages."""
    from ..mla import reference_latent
    from ..torch_sdpa import mla_decode_matmul
    from .mla import ROW, paged_mla_decode
    from .config import MLA_LATENT
    out = []
    B, N = len(MLA_LENS), max(MLA_LENS)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, MLA_HEADS, ROW)).astype(dt)
    kv = rng.standard_normal((B, N, ROW)).astype(dt)
    if kernel.unavailable(need("mla_decode", q=q, k=kv)) is not None:
        return out
    lens = np.array(MLA_LENS, np.int32)
    ref_o, _ = reference_latent(q, kv, MLA_LATENT, seq_lens=lens)
    base, _ = mla_decode_matmul(q, kv, latent_dim=MLA_LATENT, seq_lens=lens)
    masked = (lens == 0)[:, None, None]
    per = -(-N // MLA_PAGE)
    tables = rng.permutation(B * per).reshape(B, per).astype(np.int32)
    pool = np.zeros((B * per, MLA_PAGE, ROW), dt)
    pool[tables.ravel()] = np.pad(kv, ((0, 0), (0, per * MLA_PAGE - N), (0, 0))).reshape(B * per, MLA_PAGE, ROW)
    for splits in MLA_SPLITS:
        o, _ = kernel.launcher(q, kv, seq_lens=lens, num_splits=splits, scale=None, config=cfg)
        name = f"{label} Hq={MLA_HEADS} splits={splits}"
        _ok(check(o, ref_o, base, dtype=dtype, name="O", masked_rows=masked), name)
        o, _ = paged_mla_decode(q, pool, tables, lens, num_splits=splits, config=cfg)
        _ok(check(o, ref_o, base, dtype=dtype, name="O paged", masked_rows=masked), name + " paged")
        out.append(name)
    return out


#: paged prefill: per PAGED_LENS sequence, its chunk (the last rows: a partial chunk of 37 and a
#: whole prompt), then a decode row of the first; (query heads, KV heads); head dims
PREFILL_CHUNKS = (37, 45, 1)
PREFILL_HEADS = ((8, 2), (2, 2))
PREFILL_DIMS = (64, 128)


def _paged_prefill(kernel, cfg, dtype, rng, label):
    """Chunks over a paged cache (blocks of 16, the last partial), causal and not, GQA and MHA."""
    out = []
    if dtype not in ("float16", "bfloat16"):
        return out
    for d in PREFILL_DIMS:
        cache, sids = _paged_cache(rng, d, dtype)
        seq = [sids[0], sids[1], sids[0]]
        cq = np.concatenate([[0], np.cumsum(PREFILL_CHUNKS)]).astype(np.int32)
        for hq, hkv in PREFILL_HEADS:
            q = rng.standard_normal((int(cq[-1]), hq, d)).astype(cache.dtype)
            if hkv != cache.num_kv_heads or kernel.unavailable(need("paged_prefill", q=q, cache=cache)) is not None:
                continue
            for causal in (True, False):
                o, lse = kernel.launcher(q, cache, seq, cq, causal=causal, scale=None, config=cfg)
                ref = np.zeros(q.shape)
                for b, sid in enumerate(seq):
                    rows = slice(int(cq[b]), int(cq[b + 1]))
                    k, v = (x.astype(np.float64)[None] for x in cache.gather(sid))
                    ob, _ = reference.attention(q[rows].astype(np.float64).transpose(1, 0, 2)[None], k, v,
                                                causal=causal)
                    ref[rows] = ob[0].transpose(1, 0, 2)
                base = api.paged_prefill(q, cache, seq, cq, causal=causal, backend="naive")
                name = f"{label} d={d} heads {hq}/{hkv} causal={causal}"
                _ok(check(o, ref, base, dtype=dtype, name="O"), name)
                out.append(name)
    return out


#: the rows of the kernels without a record, and the error FP8 attention may reach on unit-variance
#: inputs (e4m3 keeps 3 mantissa bits: about 2e-2 RMSE; the 2x rule does not apply to it)
UNRECORDED_ROWS = (2, 3, 37)
FP8_RMSE_BOUND = 0.05


def _fwht(rng, label):
    """The randomized Hadamard transform (hadamard.fwht) against iokernels.fp8's, by the 2x rule."""
    out = []
    for dtype in ("float16", "bfloat16", "float32"):
        if dtype == "bfloat16" and device_info()["cc"] < 80:
            continue
        for d in FWHT_HEAD_DIMS:
            x = rng.standard_normal(UNRECORDED_ROWS + (d,)).astype(numpy_dtype(dtype))
            signs = fp8.random_signs(d, rng)
            y = fwht(x, signs=signs)
            base = ((x.astype(np.float32) * signs).astype(np.float32)
                    @ fp8.hadamard_matrix(d).astype(np.float32)).astype(numpy_dtype(dtype))
            name = f"{label} {dtype} d={d}"
            _ok(check(y, fp8.randomized_hadamard(x.astype(np.float64), signs), base, dtype=dtype, name="y"), name)
            out.append(name)
    return out


def _fp8_attention(rng, label, version="v1", seqlen_k=37):
    """The opt-in FP8 forward (Hopper only; ``version`` its Fp8Config.version) at a ragged GQA
    shape, causal and not, with and without the Hadamard transform: no NaN, rows that see no key
    exactly 0, RMSE under FP8_RMSE_BOUND."""
    out = []
    if hopper.available() is not None:
        return out
    cfg = hopper.Fp8Config(version=version)
    for causal in (False, True):
        for hadamard in (False, True):
            q, k, v = make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=seqlen_k, head_dim=128,
                                  dtype="bfloat16")
            o, lse = hopper.fp8_attention(q, k, v, causal=causal, hadamard=hadamard, seed=1, config=cfg)
            ref_o, ref_l = reference.attention(q, k, v, causal=causal)
            o = o.astype(np.float64)
            live = np.isfinite(ref_l)
            name = f"{label} causal={causal} hadamard={hadamard}"
            err = float(np.sqrt(np.mean((o - ref_o)[live] ** 2)))
            if np.isnan(o).any() or np.any(o[~live] != 0) or not np.all(np.isneginf(lse[~live])) \
                    or not err < FP8_RMSE_BOUND:
                raise AssertionError(f"{name}: RMSE {err:.3g} (bound {FP8_RMSE_BOUND}), or NaN / masked rows wrong")
            out.append(name)
    return out


#: kernels without a record (a helper, an opt-in version), run after the registry's, by "op:version";
#: FP8 v2 at three key tiles, so its pipeline runs its loop, not only its prologue and epilogue
UNRECORDED = {"hadamard:fwht": _fwht, "fp8_attention:v1": _fp8_attention,
              "fp8_attention:v2": functools.partial(_fp8_attention, version="v2", seqlen_k=300)}


RUNNERS = {"attention": _forward, "decode": _decode, "paged_decode": _paged_decode, "paged_gather": _gather,
           "attention_backward": _backward, "mla_decode": _mla, "paged_prefill": _paged_prefill}


def sanitize_cases(seed: int = 0, verbose: bool = True, kernels=None) -> list:
    """Run every (op, version) of :data:`REGISTRY` (and :data:`VARIANTS`) once per dtype it
    accepts here, each checked against the oracle; returns the names of the cases that ran.
    ``kernels``: only these ("op:version" strings, e.g. "attention_backward:v2").
    A wrong result raises AssertionError."""
    from .launch import cupy
    rng = np.random.default_rng(seed)
    ran = []
    for kernel in REGISTRY:
        if kernels is not None and f"{kernel.op}:{kernel.version}" not in kernels:
            continue
        for kw in VARIANTS.get((kernel.op, kernel.version), ({},)):
            cfg = kernel.config_class(version=kernel.version, **kw)
            for dtype in DTYPES:
                label = f"{kernel.op} {kernel.version}{' ' + repr(kw) if kw else ''} {dtype}"
                names = RUNNERS[kernel.op](kernel, cfg, dtype, rng, label)
                if verbose:
                    for n in names:
                        print(f"  ok {n}", flush=True)
                ran.extend(names)
    for name, run in UNRECORDED.items():
        if kernels is not None and name not in kernels:
            continue
        names = run(rng, name.replace(":", " "))
        if verbose:
            for n in names:
                print(f"  ok {n}", flush=True)
        ran.extend(names)
    cupy().cuda.Device().synchronize()
    return ran
