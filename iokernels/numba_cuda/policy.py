"""The Numba kernels' choose-a-size rules: small pure functions, one a rule, with tests.

The config classes (:mod:`.config`) call them for their defaults; they take the facts they
decide on (sizes, the shared-memory limit) and return a size.
"""
from __future__ import annotations

from typing import Callable


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
