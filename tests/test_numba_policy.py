"""The Numba decode's choose-a-size rules (iokernels.numba_cuda.policy), each held to its rule."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from iokernels.numba_cuda import policy as NP

lesson = importlib.import_module("iokernels.decode")


def test_lanes_per_row_halves_until_every_lane_owns_a_unit():
    assert NP.lanes_per_row(32, 128) == 32
    assert NP.lanes_per_row(32, 16) == 16                  # d=128 float16 in 16-byte words
    assert NP.lanes_per_row(16, 5) == 4
    assert NP.lanes_per_row(32, 1) == 1 and NP.lanes_per_row(8, 0) == 1
    for L in (1, 2, 4, 8, 16, 32):
        for units in range(1, 70):
            got = NP.lanes_per_row(L, units)
            assert got <= max(units, 1) and L % got == 0 and (got == L or 2 * got > units)


def test_the_decode_tilings_use_lanes_per_row():
    dec = importlib.import_module("iokernels.numba_cuda.decode")
    from iokernels.numba_cuda.decode_v3 import split_v3_tiling
    assert dec.lanes_for(5) == NP.lanes_per_row(dec.LANES_PER_KEY, 5) == 4
    assert dec.lanes_v2(24, "float16", "uint64") == NP.lanes_per_row(dec.LANES_PER_KEY_V2, 6) == 4
    assert split_v3_tiling(24, "float16", "uint64")[0] == 4


@pytest.mark.parametrize("s0", [1, 5, 37, 56, 100, 128])
@pytest.mark.parametrize("tiles", [1, 13, 64, 1000, 2048, 4099])
def test_even_tile_splits_moves_to_the_nearest_even_count_within_the_slack(s0, tiles):
    s = NP.even_tile_splits(s0, tiles, lesson.MAX_SPLITS)
    assert 1 <= s <= max(s0, 1) * 2 and s <= max(lesson.MAX_SPLITS, s0)
    window = [t for t in range(1, lesson.MAX_SPLITS + 1)
              if abs(t - s0) <= NP.EVEN_SPLIT_SLACK * s0 and tiles % t == 0]
    if not window:
        assert s == s0                                     # nothing even nearby: unchanged
    else:
        assert tiles % s == 0 and abs(s - s0) == min(abs(t - s0) for t in window)


def test_even_tile_splits_examples():
    assert NP.even_tile_splits(56, 2048, 128) == 64       # 2048 tiles: 64 divides, 56 does not
    assert NP.even_tile_splits(7, 13, 128) == 7           # 13 tiles: nothing even within 25 %
    assert NP.even_tile_splits(120, 4096, 100) == 120     # 128 is past max_splits; nothing else divides


@pytest.mark.parametrize("batch, hkv, n", [(1, 8, 32768), (8, 8, 32768), (64, 8, 32768), (3, 2, 1000), (1, 1, 16)])
@pytest.mark.parametrize("slots, even", [(8, False), (4, True)])
def test_numba_decode_splits_is_occupancy_then_even(batch, hkv, n, slots, even):
    s0 = lesson.occupancy_splits(batch, hkv, n, 132 * slots, block_n=16)
    s = NP.numba_decode_splits(batch, hkv, n, 16, 132, slots, even)
    assert s == (NP.even_tile_splits(s0, math.ceil(n / 16), lesson.MAX_SPLITS) if even else s0)
    assert 1 <= s <= lesson.MAX_SPLITS


def test_each_version_has_its_slots():
    from iokernels.numba_cuda.config import DECODE_VERSIONS
    assert set(DECODE_VERSIONS) == set(NP.DECODE_SLOTS_PER_SM)
    assert set(NP.DECODE_EVEN_SPLITS) <= set(DECODE_VERSIONS)
    assert all(isinstance(v, int) and v >= 1 for v in NP.DECODE_SLOTS_PER_SM.values())


def test_the_numba_split_ranges_agree_with_the_contract_and_the_numpy_lesson():
    """The Numba kernels deal whole tiles by iokernels.core.splits (their device functions
    are compiled from it); here the host form, against the NumPy lesson's split_ranges."""
    from iokernels.core import splits
    from iokernels.numba_cuda.decode_v3 import split_range_dev
    assert split_range_dev.py_func is splits.split_range
    for n in (0, 1, 15, 16, 17, 1000):
        for S in (1, 3, 7):
            for start in sorted({0, max(n - 6, 0)}):
                want = lesson.split_ranges(n, S, 16, start)
                assert [splits.split_range(n, S, s, 16, start) for s in range(S)] == want
                assert np.all(np.diff(np.array(want).ravel()) >= 0)
