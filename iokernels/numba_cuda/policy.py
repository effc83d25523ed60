"""The Numba kernels' choose-a-size rules: small pure functions, one a rule, with tests.

The config classes (:mod:`.config`) and the decode launchers (:mod:`.decode`) call them for
their defaults; they take the facts they decide on (sizes, the shared-memory limit, the SM
count) and return a size:

======================  ===============================================================
forward_block_k         the forward's K/V tile Bc at a head dim and dtype
backward_block          the backward's square tile
lanes_per_row           lanes per key of the decode split kernels (no lane without a dim)
even_tile_splits        a split count that deals every split the same number of tiles
numba_decode_splits     the decode's ``num_splits=None`` split count (occupancy, then even)
forward_v5_tiles        forward v5's (Br, Bc): the largest that hold Q_i and a K/V tile
forward_v5_row          forward v5's padded row of its shared tiles
forward_v6_tiles        forward v6's (Br, Bc): v5's rule with v6's rows
forward_v6_row          forward v6's padded row (16-byte chunks, one bank group a row)
======================  ===============================================================

Which keys a split owns is not a size but a contract every backend shares:
:func:`iokernels.core.splits.split_range` (the Numba kernels compile it as a device
function, at a granule of one tile).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

from ..decode import MAX_SPLITS, occupancy_splits


def forward_block_k(default: int, floor: int, padded_head_dim: int, acc_itemsize: int, limit: int) -> int:
    """The forward's K/V tile (Bc): the largest power-of-two fraction of ``default`` (not below
    ``floor``, the keys of one step) whose K_j and V_j tiles, ``padded_head_dim`` values a row
    in the accumulator dtype, fit ``limit`` bytes of shared memory.  The same Bc for every
    version at a given head dim and dtype."""
    bc = default
    while bc > floor and 2 * bc * padded_head_dim * acc_itemsize > limit:
        bc //= 2
    return bc


def backward_block(start: int, smem_of: Callable[[int], int], limit: int) -> int:
    """The backward's square tile (Br = Bc): ``start`` halved until ``smem_of(b)`` bytes fit
    ``limit`` (1 at the least)."""
    b = start
    while b > 1 and smem_of(b) > limit:
        b //= 2
    return b


# --------------------------------------------------------------------------- decode sizes
#: the split-count rule counts this many resident split blocks per SM as "SMs", per split
#: kernel version: v1's 4-warp blocks are small (one a SM cannot keep enough loads in flight
#: to stream HBM, so 8 slots); v2's and v3's larger register counts fit 2-3 blocks an SM,
#: and 4 slots give one and a half to two waves of blocks; v4's blocks are half v3's (128
#: threads), so 8 slots ask for the same threads an SM as v3's 4; v5 and v6 have v4's blocks
DECODE_SLOTS_PER_SM = {"v1": 8, "v2": 4, "v3": 4, "v4": 8, "v5": 8, "v6": 8}
#: the versions whose split count is then made even (:func:`even_tile_splits`)
DECODE_EVEN_SPLITS = ("v2", "v3", "v4", "v5", "v6")
#: how far (a fraction of the occupancy count) :func:`even_tile_splits` may move the count
EVEN_SPLIT_SLACK = 0.25


def lanes_per_row(lanes: int, units: int) -> int:
    """The lanes that share one key (or one row): ``lanes``, halved while there are more lanes
    than ``units`` (the row's dims, or its words), so every lane owns at least one; 1 at the
    least.  Decode v1 (units = d), v2 and v3 (units = words a row)."""
    L = lanes
    while L > 1 and L > units:
        L //= 2
    return L


def even_tile_splits(s0: int, tiles: int, max_splits: int, slack: float = EVEN_SPLIT_SLACK) -> int:
    """The split count within ``slack`` (a fraction) of ``s0``, at most ``max_splits``, that
    gives every split the same number of key tiles (no straggler split holding up the
    combine), the nearest one (the smaller on a tie); ``s0`` when none does."""
    lo, hi = max(1, math.ceil(s0 * (1 - slack))), min(max_splits, math.floor(s0 * (1 + slack)))
    even = [s for s in range(lo, hi + 1) if tiles % s == 0]
    return min(even, key=lambda s: (abs(s - s0), s)) if even else s0


@functools.lru_cache(maxsize=1024)
def numba_decode_splits(batch: int, heads_kv: int, max_len: int, block_n: int, num_sms: int,
                        slots_per_sm: int, even: bool) -> int:
    """The ``num_splits=None`` split count of a Numba decode: FlashAttention-2's occupancy
    rule (:func:`iokernels.decode.occupancy_splits`) over ``num_sms * slots_per_sm`` block
    slots, for ``max_len`` keys (the most a query sees) in tiles of ``block_n``; with
    ``even``, moved to a nearby count that divides the tiles (:func:`even_tile_splits`).
    Cached: a decode loop asks for the same shapes."""
    s0 = occupancy_splits(batch, heads_kv, max_len, num_sms * slots_per_sm, block_n=block_n)
    return even_tile_splits(s0, -(-max_len // block_n), MAX_SPLITS) if even else s0


# --------------------------------------------------------------------------- forward v5 tiles
#: forward v5's candidate tiles, tried in order: query rows Br (the most first: each K/V tile
#: loaded into SRAM serves Br rows), then keys Bc
FORWARD_V5_ROWS = (64, 32, 16, 8)
FORWARD_V5_KEYS = (32, 24, 16, 8)


def forward_v5_row(head_dim: int, lanes: int) -> int:
    """Values a row of forward v5's shared tiles holds: at least head_dim + 1 and the dims its
    lanes own (lanes * ceil(head_dim / lanes)), made odd, so that lanes reading the same dim of
    different rows fall in different banks."""
    w = max(head_dim + 1, lanes * -(-head_dim // lanes))
    return w if w % 2 else w + 1


def forward_v5_tiles(head_dim: int, itemsize: int, limit: int, lanes: int, rows_per_thread: int) -> tuple:
    """(Br, Bc) of forward v5: the first candidate (:data:`FORWARD_V5_ROWS` x
    :data:`FORWARD_V5_KEYS`) with Br a multiple of ``rows_per_thread``, Bc a multiple of
    ``lanes``, whose Q_i and one K/V tile, rows of :func:`forward_v5_row` values of
    ``itemsize`` bytes, fit ``limit`` bytes of shared memory; the smallest candidate when none fits (the
    config's check then says why)."""
    return _q_and_tile(forward_v5_row(head_dim, lanes) * itemsize, limit, lanes, rows_per_thread)


def _q_and_tile(row_bytes: int, limit: int, lanes: int, rows_per_thread: int) -> tuple:
    """The first (Br, Bc) of FORWARD_V5_ROWS x FORWARD_V5_KEYS (Br a multiple of
    ``rows_per_thread``, Bc of ``lanes``) whose Br + Bc rows of ``row_bytes`` fit ``limit``."""
    rows = [br for br in FORWARD_V5_ROWS if br % rows_per_thread == 0] or [rows_per_thread]
    keys = [bc for bc in FORWARD_V5_KEYS if bc % lanes == 0] or [lanes]
    for br in rows:
        for bc in keys:
            if (br + bc) * row_bytes <= limit:
                return br, bc
    return rows[-1], keys[-1]


def vector_width(itemsize: int) -> int:
    """Values of ``itemsize`` bytes one 16-byte load carries (forward v6): 4 float32, 2 float64."""
    return 16 // itemsize


def forward_v6_row(head_dim: int, lanes: int, itemsize: int) -> int:
    """Values a row of forward v6's shared tiles holds: at least the dims its 16-byte loads
    cover (head_dim, and lanes x whole chunks of :func:`vector_width` values for the O block),
    a multiple of 16 bytes, padded so that the row is 16 bytes more than a multiple of 128:
    the 8 lanes of one 16-byte load's phase read 8 rows at the same dims, and row r then starts
    in bank group r mod 8 (conflict-free)."""
    w = vector_width(itemsize)
    need = max(-(-head_dim // w) * w, lanes * w * -(-head_dim // (lanes * w)))
    row = -(-need // w) * w
    while (row * itemsize) % 128 != 16:
        row += w
    return row


def forward_v6_tiles(head_dim: int, itemsize: int, limit: int, lanes: int, rows_per_thread: int) -> tuple:
    """(Br, Bc) of forward v6: v5's rule (:func:`forward_v5_tiles`) with v6's rows
    (:func:`forward_v6_row`)."""
    return _q_and_tile(forward_v6_row(head_dim, lanes, itemsize) * itemsize, limit, lanes, rows_per_thread)


# --------------------------------------------------------------------------- versions held back
#: the versions the registry's default does not pick until a recorded GPU run has them ahead of
#: the one it picks now, (op, version) -> what has to be measured; a config naming one runs it
#: (:func:`iokernels.core.records.held_back_reason` reads it).  Empty: decode v5 and v6 were held
#: here until the H200 record of 2026-12-06 (benchmarks/results) had both ahead of v4 at every
#: decode shape; v6, ranked highest, is the default.
HELD_BACK: dict[tuple[str, str], str] = {}
