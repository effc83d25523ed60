"""The CuPy kernels' choose-a-size rules: small pure functions, one a rule, with tests.

Each rule takes the facts it decides on (sizes, the GPU's SMs, an occupancy) and returns a
size; the config classes and launchers call them, and no .cu file holds a default.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..core import conventions as cv
from ..core.splits import wave_tail
from ..core.records import held_back_reason

# =========================================================================== decode
#: decode_wave_splits, a cost model of the split kernel's waves (blocks_per_sm x SMs blocks
#: run at once): a wave of n blocks of k keys streams for about k x max(n, rho) key-times, as
#: rho = DECODE_SATURATING_FRACTION of a full wave's blocks already keep HBM busy (fewer
#: stream at their own rate, more share it), and each wave adds what rho blocks take to
#: stream DECODE_WAVE_COST_BYTES of K and V (its blocks' first tiles in flight, the warps'
#: merge, the partials and the fused combine); fitted to decode v4's timings at batches 1 to
#: 32 on the H200 (benchmarks/results/sweeps), which hold one full wave, two waves whose second
#: is nearly empty, and split counts that leave a sliver of a last wave
DECODE_SATURATING_FRACTION = 0.7
DECODE_WAVE_COST_BYTES = 160 * 1024
#: ... keep at least this many keys a split (its partial O write is amortized) ...
DECODE_MIN_KEYS_PER_SPLIT = 256
#: ... and at most this many splits (the combine reads them all)
DECODE_MAX_SPLITS = 128
#: decode v4's block shape: when the batch's (b, kv head) pairs give every SM at least
#: DECODE_V4_PAIRS_SPLIT_BLOCK of them, a block is DECODE_V4_SMALL_WARPS warps with a ring of
#: DECODE_V4_SMALL_STAGES stages (its registers, about 180-210 a thread, leave room for two such
#: blocks an SM): one block's start (its first tiles' latency) and end (the warps' merge, the
#: write of O) then overlap the other's streaming, where one 8-warp block an SM leaves the SM
#: idle for both, once per (b, kv head).  One pair an SM is enough: at batch 17 x 8 KV heads
#: (136 pairs, 132 SMs) 4 warps x 2 stages ran 1.03-1.41x faster than the 8-warp block over a
#: contiguous cache and 0.99-1.35x over a paged one, at 4 and 16 query heads a KV head over 256
#: to 4096 keys, and as fast or faster than 4 warps x 3 stages at each of those shapes (an H100:
#: benchmarks/results/sweeps/2026-12-07_2141_decode_v4_tunings_short_lines_h100.json, the rows
#: "4w x 2" and "4w x 3"); at batches 64 and 128 the two were level; with fewer pairs than SMs
#: (batches 1 and 3) the 8-warp block was the faster
#: (sweeps/2026-12-07_2137_decode_v4_tunings_g16_h100.json)
DECODE_V4_PAIRS_SPLIT_BLOCK = 1
#: ... and the small block's ring depth (at most: a given or shallower default stays)
DECODE_V4_SMALL_STAGES = 2
#: decode v4's group: the 16 rows of one mma.sync A operand (decode_config.DECODE_V4_MAX_GROUP)
DECODE_V4_MAX_GROUP_ROWS = 16


def split_cost(pairs: int, seq_len: int, splits: int, num_sms: int, blocks_per_sm: int = 4,
               row_bytes: int = 512) -> float:
    """:func:`decode_wave_splits`'s modelled time of ``splits`` splits of ``pairs`` (b, kv
    head) pairs over ``seq_len`` keys, in key-times of one block (only ratios mean anything).

    The blocks run in waves of slots = num_sms * blocks_per_sm.  A wave of n blocks of
    k = seq_len / splits keys costs k * max(n, rho), rho = DECODE_SATURATING_FRACTION * slots
    (that many blocks already keep HBM busy: fewer stream at their own rate, more share it),
    plus rho * w for the wave itself, w = DECODE_WAVE_COST_BYTES / ``row_bytes`` keys
    (``row_bytes``: one key's K and V rows in HBM)."""
    slots = num_sms * max(1, blocks_per_sm)
    rho = max(1.0, DECODE_SATURATING_FRACTION * slots)
    full, rest = divmod(max(1, pairs) * splits, slots)
    stream = seq_len / splits * (full * slots + (max(rest, rho) if rest else 0))
    return stream + (full + (rest > 0)) * rho * DECODE_WAVE_COST_BYTES / max(1, row_bytes)


@functools.lru_cache(maxsize=4096)      # pure, and on every launch's host path: a shape is costed once
def decode_wave_splits(batch: int, heads_kv: int, seq_len: int, num_sms: int,
                       blocks_per_sm: int = 4, row_bytes: int = 512) -> int:
    """Splits of the key axis for the whole batch: the S of least :func:`split_cost`.

    There are batch * heads_kv * S blocks, ``blocks_per_sm`` fit on an SM at once (the
    launcher asks the driver for its kernel's occupancy).  Where the pairs fit one wave this
    is the one-wave fill, slots // pairs splits; where they do not, it weighs a nearly empty
    last wave against more, shorter waves.  A tie goes to more splits.  Each split keeps at
    least DECODE_MIN_KEYS_PER_SPLIT keys; at most DECODE_MAX_SPLITS.
    """
    if seq_len <= 0:
        return 1
    cap = max(1, min(seq_len // DECODE_MIN_KEYS_PER_SPLIT, DECODE_MAX_SPLITS))
    best_s, best = 1, None
    for s in range(1, cap + 1):
        cost = split_cost(batch * heads_kv, seq_len, s, num_sms, blocks_per_sm, row_bytes)
        if best is None or cost <= best * (1 + 1e-9):          # a tie goes to the larger S
            best_s = s
            best = cost if best is None else min(best, cost)
    return int(best_s)


#: decode v8 runs one split a (b, kv head) pair where the pairs cover the SMs, up to this many keys
#: a sequence (the longest cache at which that was measured faster: policy.decode_v8_splits)
DECODE_V8_ONE_SPLIT_MAX_KEYS = 4096


def decode_v8_splits(batch: int, heads_kv: int, seq_len: int, num_sms: int, blocks_per_sm: int = 1,
                     row_bytes: int = 512) -> int:
    """decode v8's splits of the key axis: one block a (b, kv head) pair where the pairs already
    give every SM a block and the cache is at most DECODE_V8_ONE_SPLIT_MAX_KEYS long, else
    :func:`decode_wave_splits`.  A v8 block streams its split through a deep TMA ring, so the few
    pairs past a whole wave run at a lone block's rate rather than a saturated wave's (what
    :func:`split_cost` prices them at); on an H100 at B = 17, 8 KV heads (136 pairs, 132 SMs),
    N = 1000 and 4096, one split ran faster than the wave model's choice
    (benchmarks/results/sweeps/2026-12-07_0417_decode_v8_h100_h200.txt).  Over a long cache that
    tail is long too: at N = 50000 one split ran slower than v6 under the wave model."""
    if batch * heads_kv >= num_sms and seq_len <= DECODE_V8_ONE_SPLIT_MAX_KEYS:
        return 1
    return decode_wave_splits(batch, heads_kv, seq_len, num_sms, blocks_per_sm, row_bytes)


#: decode v9 deals runs across pairs only when a block's run would be at least this many keys
#: (shorter runs cost a second query load and pipeline fill for little): on an H100 at batch 17 x
#: 8 KV heads (136 pairs, 132 one-block SMs), runs of about 264 keys (N = 256) were slower than
#: one block a pair and runs of about 1055 (N = 1024) faster
#: (benchmarks/results/sweeps/2026-12-07_1519_decode_v9_short_lines_h100.json) ...
DECODE_BALANCED_MIN_KEYS = 512
#: ... and only where one block a pair leaves a last wave this much longer than an even share
#: (core.splits.wave_tail at one split): 1.94 at batch 17 x 8 KV heads on 132 SMs, where the deal
#: was faster; 1.03 at batches 64 and 128 x 8, where the cliff record had it level with v4 or
#: slower, and where there are fewer pairs than blocks (few sequences, MQA) it was slower than v4's
#: splits at most shapes (benchmarks/results/h100_2026-12-07_cliff_v9_held_back.json).  Elsewhere
#: v9's launch is v4's own (its kernel, splits and grid: decode_launch.split_launch)
DECODE_BALANCED_MIN_TAIL = 1.25


@functools.lru_cache(maxsize=4096)      # pure, and on every launch's host path
def decode_balanced_deal(pairs: int, keys: int, blocks: int) -> tuple[int, int, int] | None:
    """decode v9's balanced deal: (G blocks, W keys a block, S the most segments of one pair)
    for ``pairs`` (b, kv head) pairs of ``keys`` keys each, laid end to end, over ``blocks``
    blocks (one wave: SMs x blocks an SM), where it pays; None where it does not (then v4's
    launch).

    W = ceil(pairs x keys / blocks), at least what keeps S <= DECODE_MAX_SPLITS; G = ceil(pairs x
    keys / W) <= blocks.  It pays where the pairs are at least ``blocks``, W is at least
    DECODE_BALANCED_MIN_KEYS and one block a pair leaves a last wave of at least
    DECODE_BALANCED_MIN_TAIL (:func:`~iokernels.core.splits.wave_tail`).  Pair p's segments are
    the blocks floor(p keys / W) .. floor(((p + 1) keys - 1) / W): S is the most of them."""
    keys, pairs = max(1, keys), max(1, pairs)
    total = pairs * keys
    w = max(-(-total // max(1, blocks)), -(-(keys - 1) // (DECODE_MAX_SPLITS - 1)))
    if pairs < blocks or w < DECODE_BALANCED_MIN_KEYS or wave_tail(pairs, keys, blocks) < DECODE_BALANCED_MIN_TAIL:
        return None
    most = max(((p + 1) * keys - 1) // w - p * keys // w + 1 for p in range(pairs))
    return -(-total // w), w, most


def decode_pair_deal(keys: int, splits: int) -> tuple[int, int, int]:
    """decode v9's deal of v4's splits: (W keys a block, S segments a pair, keys a pair in the
    kernel's layout) for ``splits`` splits of ``keys``: W = ceil(keys / splits), S = ceil(keys /
    W), and each pair padded to S x W slots, so every block's run is one pair's split (the slots
    past a sequence's keys are empty)."""
    keys = max(1, keys)
    w = -(-keys // max(1, splits))
    s = -(-keys // w)
    return w, s, s * w


#: the decode versions whose combine follows :func:`decode_fuse_combine` when their config leaves
#: ``fused`` unset (the versions it was measured on, and v9, v4's kernel dealt another way; the
#: others fuse)
DECODE_FUSE_BY_RULE = ("v4", "v8", "v9")
#: ... which fuses the combine up to this many of a split's merged values a block (group x head_dim)
DECODE_FUSED_COMBINE_MAX_VALUES = 1024


#: the separate combine's kernels (DecodeConfig.combine): "serial", decode.cu's (a thread a column
#: walks the splits one after another) and "parallel", decode_combine.cu's (the splits read side by
#: side, their weights in SRAM); a config that leaves it unset runs DECODE_COMBINE_DEFAULT.  Timed
#: both ways at the split rule's counts and at fixed ones (v8 and v4 at one to three sequences, MQA
#: g 16 / 64 and 256/8, N 1000-50000, an H200:
#: benchmarks/results/sweeps/2026-12-07_1316_decode_small_batch_combine_h200.json), "parallel" was
#: slower at no shape and split count beyond the timing noise, and the faster the more splits;
#: records before that sweep were timed with "serial"
DECODE_COMBINES = ("serial", "parallel")
DECODE_COMBINE_DEFAULT = "parallel"


def decode_fuse_combine(group: int, head_dim: int) -> bool:
    """Whether a split kernel whose block holds ``group`` query heads of ``head_dim`` merges the
    splits itself (the fused combine: the last block of a (b, kv head) pair walks the group's
    group x head_dim merged values, an L2 round trip after another, over every split) rather
    than leaving them to decode.cu's combine (one more launch, one block a query row, side by
    side; few blocks where the batch has few rows).  Timed both ways on an H100
    (benchmarks/results/sweeps/2026-12-07_0758_decode_fused_combine_h100.txt), the separate
    combine was the faster at 19 of the 20 shapes of more than 1024 values (g 16 x d 128 and up)
    and the slower at 6 of the 7 of at most 1024 (g 1 to 8 x d 128; not at g 16 x d 64): fused
    up to DECODE_FUSED_COMBINE_MAX_VALUES."""
    return group * head_dim <= DECODE_FUSED_COMBINE_MAX_VALUES


def decode_v8_default_at(group: int) -> bool:
    """Whether the registry's default may pick decode v8 (on Hopper) for ``group`` query heads a
    KV head: past decode v4's one 16-row operand, where v6's teams of warps were the default and v8
    ran faster at every g = 32 / 64 shape timed but one (B = 17 over 50000 keys at one split a
    pair, the case :func:`decode_v8_splits` now gives the wave model's splits; the sweep record
    above), up to 64 (one warpgroup's rows); up to 16 v4 stays the default (v8 computes 64 rows
    whatever the group, and was not faster there).  Over pages and past 64, v6."""
    return group > DECODE_V4_MAX_GROUP_ROWS


def decode_v4_block(warps: int, stages: int, small_warps: int, pairs: int | None,
                    sms: int | None) -> tuple[int, int]:
    """decode v4's (warps, stages) a block: ``small_warps`` and at most DECODE_V4_SMALL_STAGES
    stages where the batch's (b, kv head) ``pairs`` give each of the ``sms`` SMs at least
    DECODE_V4_PAIRS_SPLIT_BLOCK; else ``warps`` and ``stages`` (what fits the SRAM).  Only a
    larger block is ever made smaller (``warps`` > ``small_warps``)."""
    if warps > small_warps and pairs is not None and sms and pairs >= DECODE_V4_PAIRS_SPLIT_BLOCK * sms:
        return small_warps, min(stages, DECODE_V4_SMALL_STAGES)
    return warps, stages


# =========================================================================== MLA decode
def mla_num_splits(batch: int, heads_q: int, longest: int, num_sms: int, *, min_keys: int, heads_block: int,
                   max_splits: int) -> int:
    """MLA decode's splits of the key axis: enough that one wave of blocks (one an SM: Q and
    the ring fill its SRAM) covers the GPU, batch * ceil(heads_q / heads_block) * S blocks,
    each split at least ``min_keys`` rows, at most ``max_splits``; 1 for an empty cache."""
    if longest <= 0:
        return 1
    blocks = batch * -(-heads_q // heads_block)
    want = max(1, num_sms // max(1, blocks))
    cap = max(1, -(-longest // min_keys))
    return int(max(1, min(want, cap, max_splits)))


# =========================================================================== forward
#: fa_v2's default Bc: 64 keys up to d = 128; 32 above (the S/P tile and O share the registers)
V2_BLOCK_K_UP_TO_128, V2_BLOCK_K_ABOVE_128 = 64, 32


def v2_default_block_k(head_dim: int) -> int:
    """fa_v2.cu's default K/V tile (Bc) at ``head_dim``: 64 keys up to d = 128, 32 above, where
    the S/P tile and the O accumulator share a lane's registers."""
    return V2_BLOCK_K_UP_TO_128 if head_dim <= 128 else V2_BLOCK_K_ABOVE_128


# =========================================================================== backward
def backward_v1_tiles(block_q: int | None, block_k: int | None, smem_of: Callable[[int, int], int], limit: int,
                      start: tuple[int, int], floor: int = 8) -> tuple[int, int] | None:
    """bwd_v1.cu's (Br, Bc): the given sizes, and for each None the largest of ``start``
    halved (Br first, down to ``floor``) until ``smem_of(Br, Bc)`` fits ``limit`` bytes; None
    when no such tile set fits."""
    bq, bk = block_q or start[0], block_k or start[1]
    while smem_of(bq, bk) > limit:
        if block_q is None and bq > floor:
            bq //= 2
        elif block_k is None and bk > floor:
            bk //= 2
        else:
            return None
    return bq, bk


# =========================================================================== versions not yet measured
#: versions the registry's default does not pick yet, and what has to be recorded before it
#: may: each runs where a config names it.  A version leaves this table once its GPU tests pass
#: and the benchmark has recorded what the entry asks (the record's ``default_check`` reads it:
#: :func:`held_back`); the Hopper forward's head dims have their own gate,
#: :func:`hopper_default_at`
HELD_BACK = {
    ("attention", "v6"): "its GPU tests and a benchmark record faster than v5 at head_dim 64 on Hopper",
    ("attention_backward", "v5"): "its GPU tests and a benchmark record faster than v4 under the causal mask",
    ("decode", "v9"): "its GPU tests and a cliff record beside v4 at every decode shape it takes",
    ("paged_decode", "v9"): "its GPU tests and a record beside v4 over pages",
}


def held_back(op: str, version: str) -> str | None:
    """Why the default does not pick ``version`` of ``op`` yet (:data:`HELD_BACK`), or None."""
    return held_back_reason(HELD_BACK, op, version)


def held_back_note(op: str, version: str) -> str:
    """What a held-back version's summary adds in the version tables ("" once it is measured)."""
    return " (held back from the default until measured)" if (op, version) in HELD_BACK else ""


def default_check_for(op: str, version: str):
    """A record's ``default_check`` that asks :func:`held_back` on every call (so a change to
    :data:`HELD_BACK` takes effect at once)."""
    return lambda need: held_back(op, version)


# =========================================================================== backward on Hopper
#: bwd_v3.cu's Q_i / dO_i ring: two stages (tile i + 1 lands while tile i is used; 105 KB of
#: SRAM at d = 128, so a third fits too, should a measurement favour it)
BWD_V3_STAGES = 2
#: bwd_v4.cu's ring: two stages as v3's (162 KB of SRAM at d = 128 with its 128-key K_j, V_j; a
#: third fits, 195 KB; a fourth does not)
BWD_V4_STAGES = 2
#: bwd_v5.cu's longest-first order takes the (batch, KV head) pairs in groups whose Q_i and dO_i
#: tiles fill at most this share of the L2 cache (the other blocks' K_j, V_j, dQ sums and dK, dV
#: writes pass through it too)
BWD_V5_L2_SHARE = 0.5


def backward_lpt_pairs(pairs: int, group: int, seq_q: int, head_dim: int, itemsize: int, l2_bytes: int, *,
                       banded: bool, tiles: int, sms: int) -> int:
    """bwd_v5.cu's ``lpt_pairs``: the (batch, KV head) pairs whose blocks run as one group, longest
    first.  1 (v4's order) unless the band has an upper edge (``banded``: causal, a causal window),
    since without one every block is as long as the next and a larger group only spreads the
    blocks running at once over more pairs' Q and dO rows.  With one: as many pairs as it takes
    for their blocks (``tiles`` a pair) to fill one wave of ``sms`` blocks (one block an SM; a
    larger group runs more pairs at once than v4's order does, for no shorter tail), and no more
    than keep the Q and dO rows of their ``group`` query heads each (2 x group x seq_q x
    head_dim x itemsize bytes a pair) within BWD_V5_L2_SHARE of ``l2_bytes`` (0: not reported,
    one pair).  At least 1 (a pair larger than
    that share is a group of its own), at most ``pairs``."""
    if not banded:
        return 1
    wave = -(-max(1, sms) // max(1, tiles))
    per_pair = 2 * group * seq_q * head_dim * itemsize
    return max(1, min(pairs, wave, int(BWD_V5_L2_SHARE * l2_bytes) // max(1, per_pair)))


# =========================================================================== forward longest first
def forward_lpt_pairs(pairs: int, seq_k: int, head_dim: int, itemsize: int, l2_bytes: int, *,
                      banded: bool) -> int:
    """fa_v11.cu's ``lpt_pairs``: the (batch, query head) pairs whose blocks run as one group,
    longest first.  1 (v8's order) unless the band has an upper edge (``banded``: causal, a causal
    window), since without one every block of a pair is as long as the next.  With one:
    FlashAttention's rule (SingleTileLPTScheduler in flash_attn/cute/tile_scheduler.py, code): as
    many pairs as have their K and V (2 x seq_k x head_dim x itemsize bytes a pair, counted for
    each query head as that rule does, though grouped query heads share them) within ``l2_bytes``
    (0: not reported, one pair), rounded down to a power of two, which that code notes ran faster;
    at least 1, at most ``pairs``.

    What the order is worth, in a model (each block starts on the first free SM, in grid order, and
    takes its key tiles plus one; 132 SMs, causal, Nq = Nk; tests/test_policy.py): 32 pairs of 64
    query tiles end over 5% after the even share in v8's order and within 1% in the groups this
    rule gives at head_dim 64, 128 and 256 on a 50 MB L2 cache, while groups of 3, whose blocks
    span a wave and a half, keep a tail of their own (over 4%).  A model, not a measurement: the
    hardware's block order is not promised, and K/V reuse in L2 is not in it."""
    if not banded or l2_bytes <= 0:
        return 1
    per_pair = 2 * max(1, seq_k) * head_dim * itemsize
    fit = l2_bytes // per_pair
    if fit < 1:
        return 1
    return max(1, min(pairs, 1 << (int(fit).bit_length() - 1)))


# =========================================================================== paged prefill
#: paged_prefill_v1.cu's block: 4 warps (Br = 64 chunk rows) where chunks are short on average
#: (decode rows, tails: a Q tile larger than its chunk is tensor-core work thrown away), 8 warps
#: (Br = 128, fa_v2's default: each K/V tile read feeds twice the rows) from chunks of
#: PAGED_PREFILL_LONG_CHUNK rows on average
PAGED_PREFILL_WARPS, PAGED_PREFILL_WARPS_LONG = 4, 8
PAGED_PREFILL_LONG_CHUNK = 128
#: ... and its K tiles, largest first: 64 keys (4 cache blocks of 16) feed the tensor cores as
#: fa_v2's default does; smaller ones only where the SRAM of the larger does not fit
PAGED_PREFILL_BLOCK_K_CHOICES = (64, 32, 16)


def paged_prefill_tiles(num_warps: int | None, block_k: int | None, smem_of: Callable[[int, int], int],
                        limit: int | None, mean_rows: float | None = None) -> tuple[int, int] | None:
    """paged_prefill_v1.cu's (warps, Bc): the given sizes, and for a None the default: warps
    PAGED_PREFILL_WARPS_LONG where the batch's chunks average ``mean_rows`` >=
    PAGED_PREFILL_LONG_CHUNK (else, or unknown, PAGED_PREFILL_WARPS), Bc the largest of
    PAGED_PREFILL_BLOCK_K_CHOICES whose ``smem_of(warps, Bc)`` fits ``limit`` bytes (None: no
    limit known); default long-chunk warps that fit at no Bc fall back to PAGED_PREFILL_WARPS.
    None when no such tile set fits."""
    if num_warps:
        warps = (num_warps,)
    elif mean_rows is not None and mean_rows >= PAGED_PREFILL_LONG_CHUNK:
        warps = (PAGED_PREFILL_WARPS_LONG, PAGED_PREFILL_WARPS)
    else:
        warps = (PAGED_PREFILL_WARPS,)
    for nw in warps:
        for bk in (block_k,) if block_k else PAGED_PREFILL_BLOCK_K_CHOICES:
            if limit is None or smem_of(nw, bk) <= limit:
                return nw, bk
    return None


# =========================================================================== paged gather
#: chunk sizes a row may be moved in, widest first (a row of 1-byte elements does not occur)
GATHER_CHUNK_CHOICES = (16, 8, 4, 2)


def gather_chunk_bytes(row_bytes: int, itemsize: int, pointers: tuple[int, ...]) -> int:
    """paged_gather.cu's copy unit: the widest of GATHER_CHUNK_CHOICES that divides a row and
    every pointer, else the element size."""
    fits = [c for c in GATHER_CHUNK_CHOICES if row_bytes % c == 0 and all(p % c == 0 for p in pointers)]
    return fits[0] if fits else itemsize


# =========================================================================== Hopper attention
#: default K/V tile (Bc) at head_dim 64 and 128: one m64n128 wgmma for S
HOPPER_BLOCK_N = 128
#: default pipeline depth: v3, v4 use one tile while the next lands (Q + 2 x (K + V) = 160 KB at
#: d = 128); a v5 consumer holds two tiles at once (K_j and V_{j-1}), so a third stage is the one
#: that lands meanwhile (Q + 3 x (K + V) = 224 KB at d = 128, inside the 227 KB a block may have);
#: v6 (d = 64 only) staggers three consumers by a turn each, so a stage is held from the first
#: one's S_j to the last one's P_j V_j: three tiles in use, a fourth landing (Q 24 KB + 4 x (K + V)
#: 4 x 32 KB = 152 KB); v7 releases K_j and V_{j-1} apart, so two stages already keep a tile
#: landing, and it keeps v5's third where that fits; v10 (v6's three consumers with v7's release)
#: keeps three too: two and four stages timed no different (benchmarks/results/sweeps); v9 and v11
#: are v8's block and keep its three
HOPPER_STAGES = {"v3": 2, "v4": 2, "v5": 3, "v6": 4, "v7": 3, "v8": 3, "v9": 3, "v10": 3, "v11": 3}
#: head_dim 256: a consumer thread's O (64 x 256) is 128 float32 registers, so Bc = 64 keeps
#: S (32) and P (16) beside it in the 240 that setmaxnreg gives (at Bc = 128 ptxas spills); and
#: Q (128 x 256, 64 KB) + 2 x (K + V) (2 x 64 KB) = 192 KB leaves no room for a third stage
#: (256 KB > 227 KB), so every version, v5 too, runs two (v5's consumers then release a
#: stage only when its refill is already needed; v7, releasing K and V apart, is the version
#: that keeps a tile landing with two).  FlashAttention-3's hopper/tile_size.h
#: (code) picks a 128 x 80 tile at this head dim for 16-bit inputs (64 keys with a local
#: window), noting that 128 x 80 reaches the SRAM limit: v8 takes it (HOPPER_V8_WIDE_TILES), and
#: v9 and v11 after it; the versions before it keep 64
HOPPER_WIDE_HEAD_DIM = 256
HOPPER_WIDE_TILES = (64, 2)
#: v8's at head_dim 256: FlashAttention-3's 80 keys, two stages (224 KB of SRAM); measured against
#: 64 keys of the same kernel and against v7 in benchmarks/results/sweeps/2026-12-06_1735_attention_v8_h100.txt
HOPPER_V8_WIDE_TILES = (80, 2)
#: the head dims at which the registry's default may pick a Hopper version (see
#: :func:`hopper_default_at`): all three, each measured on a GPU
HOPPER_DEFAULT_HEAD_DIMS = (64, 128, 256)
#: the head dims at which the default may pick attention v7 (:func:`hopper_v7_default_at`)
HOPPER_V7_DEFAULT_HEAD_DIMS = (HOPPER_WIDE_HEAD_DIM,)
#: ... attention v8 (:func:`hopper_v8_default_at`): all three
HOPPER_V8_DEFAULT_HEAD_DIMS = (64, 128, HOPPER_WIDE_HEAD_DIM)


def hopper_tiles(version: str, head_dim: int, block_n: int | None = None,
                 stages: int | None = None) -> tuple[int, int]:
    """(Bc, stages) of Hopper attention ``version`` at ``head_dim``: the given ones, else at
    HOPPER_WIDE_HEAD_DIM the HOPPER_WIDE_TILES (v8, v9, v11: HOPPER_V8_WIDE_TILES), at the others
    HOPPER_BLOCK_N and the version's HOPPER_STAGES.

    At head_dim 64 FlashAttention-3's hopper/tile_size.h (code) takes a taller query tile and
    wider key tile: Br x Bc = 192 x 192 without a mask (P read from SRAM for P V, not from
    registers), 192 x 128 causal, where ours is fixed at Br = 128 (and Bc at 64 or 128).
    v3, v4 and v5 keep Br = 128 there.  v6 (fa_v6.cu, head_dim 64 only) takes the taller
    query tile: a third consumer warpgroup (192 rows of 64), a block of 1 producer + 3
    consumers (512 threads), setmaxnreg budgets that fit 64K registers for four warpgroups
    (24 for the producer, 160 a consumer thread, where v5 takes 240), v5's ping-pong turned
    into a round of three named barriers, a 192-row Q in SRAM.  Its Bc stays HOPPER_BLOCK_N
    (128) causal or not: S and P of 192 keys beside O do not fit 160 registers with P in
    registers, and 192 is no width of our wgmma wrappers; its stages are HOPPER_STAGES["v6"]."""
    if head_dim == HOPPER_WIDE_HEAD_DIM:
        wide_n, wide_stages = HOPPER_V8_WIDE_TILES if version in ("v8", "v9", "v11") else HOPPER_WIDE_TILES
        return block_n or wide_n, stages or wide_stages
    return block_n or HOPPER_BLOCK_N, stages or HOPPER_STAGES[version]


def hopper_default_at(head_dim: int) -> bool:
    """Whether the registry's default (a config of None, or a version of None) may pick a
    Hopper version at ``head_dim``: the head dims in HOPPER_DEFAULT_HEAD_DIMS.

    A head dim joins that tuple once the GPU tests (tests/test_hopper.py at that head dim) have
    passed and the benchmark's cliff section has recorded the Hopper kernels there beside the
    SDPA kernels and the portable version the default picked before.  Until then a config
    naming the version runs it (``HopperConfig(version="v5")``).  256 joined on two records in
    benchmarks/results: the GPU tests (sections_h200_2026-12-05_gpu_tests.txt) and the cliff
    cases at head_dim 256 (sections_h200_2026-12-05_decode_paged_prefill_cliff.json, v5 faster
    than the portable v2 in each)."""
    return head_dim in HOPPER_DEFAULT_HEAD_DIMS


def hopper_v7_default_at(head_dim: int) -> bool:
    """Whether the registry's default may pick attention v7 (fa_v7.cu: K and V tiles released
    apart) at ``head_dim``: the head dims in HOPPER_V7_DEFAULT_HEAD_DIMS, 256 only.

    There v5's ring has two stages and v7's release keeps the next tiles landing, where v5 waits
    for every load; at 64 and 128 v5's third stage already does that, and v7's extra barrier
    arrivals made it a few percent slower.  Both measured side by side, v7 against v5 and cuDNN
    at each head dim, causal and not, in benchmarks/results/sweeps/2026-12-06_1655_attention_v7_h100.txt
    (an H100).  v7 computes v5's bits exactly, so where it runs only the time differs.  v8, ranked
    above it and faster still, takes head_dim 256 from it (:func:`hopper_v8_default_at`)."""
    return head_dim in HOPPER_V7_DEFAULT_HEAD_DIMS


def hopper_v8_default_at(head_dim: int) -> bool:
    """Whether the registry's default may pick attention v8 (fa_v8.cu: the masked softmax reading
    two key bounds a row; 80-key tiles at head_dim 256) at ``head_dim``: the head dims in
    HOPPER_V8_DEFAULT_HEAD_DIMS, all three.

    256: its tiles there (80 keys, two stages) ran the GPU tests and were timed faster than v7 at
    every shape of benchmarks/results/sweeps/2026-12-06_1735_attention_v8_h100.txt (an H100).  64
    and 128: its tiles there are v5's (128 keys, three stages) and give v5's bits; the GPU tests
    ran them, and they were timed against v5 in
    benchmarks/results/sweeps/2026-12-06_1903_attention_v8_default_h100.txt (an H100): faster under
    the causal mask (most at short sequences), as fast without one at 64 and slightly slower at
    128.  The causal gain is the larger, and prefill for a language model is causal, so v8's gate
    opens at every head dim (v9, v10 and v11, ranked above it, take the lengths
    :func:`hopper_forward_for_length` gives them)."""
    return head_dim in HOPPER_V8_DEFAULT_HEAD_DIMS


#: the Hopper forward's default by length (:func:`hopper_forward_for_length`): attention v9 (the
#: persistent kernel) where a query tile reads at most this many key tiles on average (v8's key
#: tile at the head dim: 128 keys at 64 and 128, 80 at 256): each threshold at or above the tile
#: counts at which v9 measured faster than v8 and below those at which it measured slower (at d 64:
#: at which v10 was the faster), in benchmarks/results/sweeps/2026-12-07_0226_attention_v9_v10_v11_h100.txt;
#: at d 128 v9 also gained at 23 tiles without the mask, left out until counts between 12 and 32 are timed
HOPPER_V9_MAX_KEY_TILES = {64: 8.0, 128: 12.0, 256: 13.0}
#: ... and attention v11 (longest first) under a band with an upper edge from this many key tiles on
#: average at head_dim 128 and 256: between the counts at which it measured slower and faster than
#: v8 in the same record
HOPPER_V11_MIN_KEY_TILES = 16.0


def mean_visible_keys(seq_q: int, seq_k: int, window=(-1, -1)) -> float:
    """The keys a query row sees, averaged over the ``seq_q`` rows (``window``: the band as one
    (left, right) pair, causal folded in, bottom-right aligned as everywhere here:
    :func:`~iokernels.core.conventions.key_range`); 0.0 without rows."""
    if seq_q <= 0:
        return 0.0
    lo, hi = cv.key_range(np.arange(seq_q), seq_q, seq_k, False, window)
    return float(np.mean(hi - lo))


def hopper_forward_for_length(head_dim: int, seq_q: int, seq_k: int, window=(-1, -1)) -> str:
    """The Hopper attention version the default runs for these lengths and this band: "v9",
    "v10", "v11" or "v8".

    A query tile's work is its key tiles, about ``mean_visible_keys / Bc`` (Bc: v8's key tile at
    ``head_dim``, :func:`hopper_tiles`).  v9 launches a block an SM that claims query tiles in
    turn and loads the next tile's Q and first K while the last one's output is written: it pays
    where a tile is short, its start and end a large share of its time; where a tile has many key
    tiles that share is small, and v9 ran slower than v8.  v10's three consumers (head_dim 64
    only) pay back their round of barriers over many key tiles and lose on few, most under the
    causal mask.  v11 (v8's blocks longest first) shortens the tail of a grid whose blocks differ
    in length, which needs a band with an upper edge (``window[1] >= 0``: causal) and long tiles;
    on short ones its groups lost to v8's order.  So: v9 up to HOPPER_V9_MAX_KEY_TILES, then v10 at
    head_dim 64, v11 under such a band from HOPPER_V11_MIN_KEY_TILES, else v8.  The thresholds come
    from the sweep record of the four side by side (HOPPER_V9_MAX_KEY_TILES names it): one H100 run
    of 18 shapes, so a threshold sits somewhere between two measured tile counts."""
    block_n, _ = hopper_tiles("v8", head_dim)
    tiles = mean_visible_keys(seq_q, seq_k, window) / block_n
    if tiles <= HOPPER_V9_MAX_KEY_TILES.get(head_dim, 0.0):
        return "v9"
    if head_dim == 64:
        return "v10"
    if window[1] >= 0 and tiles >= HOPPER_V11_MIN_KEY_TILES:
        return "v11"
    return "v8"


# =========================================================================== decode v6
#: decode v6 (decode_v6.cu): each warp of a team holds 16 query rows of the group
DECODE_V6_ROWS_A_WARP = 16


def decode_v6_team_warps(group: int) -> int:
    """decode v6's warps a team (a key stream whose tiles they share): the smallest power of two
    whose 16-row slices cover the ``group`` query heads of a KV head (1 up to g = 16, 2 up to
    32, 4 up to 64, 8 up to 128)."""
    if group < 1:
        raise ValueError(f"group: at least one query head a KV head, got {group}")
    slices = -(-group // DECODE_V6_ROWS_A_WARP)
    return 1 << (slices - 1).bit_length()


#: the groups at which the registry's default may pick decode v6 (:func:`decode_v6_default_at`):
#: all it runs, up to 128.  Up to 64 the cliff section measured it; past 64 the alternative is
#: decode v1 (v3's ring does not fit the group), which a timing at g = 71 (Falcon-7B's
#: multi-query shape) found far slower than v6 (benchmarks/results/h100_2026-12-05_decode_v6_g71.txt)
DECODE_V6_DEFAULT_MAX_GROUP = 128


def decode_v6_default_at(group: int) -> bool:
    """Whether the registry's default may pick decode v6 for ``group`` query heads a KV head.
    v6 runs up to 128 (one team of 8 warps); a group past DECODE_V6_DEFAULT_MAX_GROUP would run
    it only when a config names it, until GPU tests and a timing at that group raise the bound
    (the Hopper forward's head dims have the same kind of gate, :func:`hopper_default_at`)."""
    return group <= DECODE_V6_DEFAULT_MAX_GROUP


def decode_v6_stages(ring_rows: int, teams: int, tile_rows: int, max_stages: int, min_stages: int = 2) -> int:
    """decode v6's ring depth before the SRAM check: as many stages as keep ``ring_rows`` key
    rows in the block's rings (``teams`` rings of ``tile_rows``-row tiles), so fewer, wider
    teams keep as many bytes in flight as more one-warp streams; between ``min_stages`` and
    ``max_stages``."""
    want = ring_rows // max(1, teams * tile_rows)
    return int(min(max_stages, max(min_stages, want)))


# =========================================================================== decode v7
#: decode v3 and v7 (the CUDA-core decodes) keep, in each lane, for each query head of their
#: block: its share of q and of O (EPL values each), one score a row step of the tile, m, l and
#: the tile's softmax base (decode_config.lane_words_a_head counts them, in 32-bit words).
#: v3 at its default (8 warps, two blocks an SM: 128 registers a thread) keeps the groups of at
#: most this many of those words; decode v7 takes the groups past it.  ptxas -v (sm_90) finds v3
#: spilling at most a few dozen bytes a thread up to about 100 words (none at float32 g = 6, 90
#: words; 36 B at bfloat16 d = 72, g = 4, 104 words), 40 B at float32 g = 8 (120 words), about
#: 2 KB at g = 16; the smallest group v7 was timed faster at is float32 g = 8
#: (benchmarks/results/sweeps/2026-12-06_1425_decode_v7_h100.txt), and below it v7's one block an
#: SM against v3's two is not measured, so v3 keeps those
DECODE_V3_LANE_WORDS = 112
#: ... and v7 (one 8-warp block an SM: 255 registers a thread) this many, float32 and 16-bit
#: accumulators (240 at float32 d = 128, g = 16, hold), fewer with float64's pairs of registers
#: (176 at d = 64, g = 8, spill)
DECODE_V7_LANE_WORDS = 240
DECODE_V7_LANE_WORDS_FLOAT64 = 160
#: v7's blocks an SM its registers are capped for (DecodeConfig.min_blocks overrides it)
DECODE_V7_MIN_BLOCKS = 1


def decode_v7_group_split(group: int, words_a_head: int, budget: int) -> int:
    """decode v7's blocks a KV head (GROUP_SPLIT): the fewest that divide the ``group`` query
    heads into equal slices of at most ``budget`` // ``words_a_head`` heads (a lane's registers
    for its slice; :data:`DECODE_V7_LANE_WORDS`).  A group of prime size larger than the slice
    takes one head a block; ``group`` itself when even one head does not fit."""
    if group < 1 or words_a_head < 1:
        raise ValueError(f"group, words_a_head: at least 1, got {group}, {words_a_head}")
    fits = max(1, budget // words_a_head)
    for split in range(1, group + 1):
        if group % split == 0 and group // split <= fits:
            return split
    return group
