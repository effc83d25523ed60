"""The CuPy kernels' choose-a-size rules: small pure functions, one a rule, with tests.

Each rule takes the facts it decides on (sizes, the GPU's SMs, an occupancy) and returns a
size; the config classes and launchers call them, and no .cu file holds a default.
"""
from __future__ import annotations

import functools

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
#: decode v4's block shape where its copies pass through L1 (DecodeConfig.v4_load_l1): when
#: the batch's (b, kv head) pairs give every SM at least DECODE_V4_PAIRS_SPLIT_BLOCK of them,
#: a block is DECODE_V4_SMALL_WARPS warps and two share an SM (the same warps and ring bytes
#: an SM): one block's start (its first tiles' latency) and end (the warps' merge, the write
#: of O) then overlap the other's streaming, where one 8-warp block an SM leaves the SM idle
#: for both, once per (b, kv head)
DECODE_V4_PAIRS_SPLIT_BLOCK = 2


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


def decode_v4_block_warps(warps: int, small_warps: int, via_l1: bool, pairs: int | None,
                          sms: int | None) -> int:
    """decode v4's warps a block: ``small_warps`` (two blocks share an SM) where the copies
    pass through L1 (``via_l1``) and the batch's (b, kv head) ``pairs`` give each of the
    ``sms`` SMs at least DECODE_V4_PAIRS_SPLIT_BLOCK; else ``warps`` (what fits the SRAM).
    Only a larger block is ever made smaller (``warps`` > ``small_warps``)."""
    if (via_l1 and warps > small_warps and pairs is not None and sms
            and pairs >= DECODE_V4_PAIRS_SPLIT_BLOCK * sms):
        return small_warps
    return warps


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
