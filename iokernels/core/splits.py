"""Which keys a split owns: the split-range contract of split-KV decode, written once.

Flash-Decoding (Dao et al., 2023) cuts the keys a decode query sees into S splits, one
thread block each, and merges the partial outputs exactly.  Every backend deals the keys
the same way, by :func:`split_range`:

* the query of a sequence of n keys sees [start, n) (start = 0, or the first key a sliding
  window leaves visible: :func:`visible_first`);
* the granules of ``granule`` keys that meet [start, n) -- aligned to the whole sequence, so
  a window's first granule is the partial one holding ``start`` -- are dealt out in
  contiguous runs of ceil(granules / S); trailing splits may be empty (start == stop).

The NumPy lesson (:func:`iokernels.decode.split_ranges`) and the Numba kernels split whole
tiles (granule = Bc, as FlashAttention-2 does); the CUDA C++ kernels split key by key
(granule = 1: kernels/splits.cuh, tests/test_splits.py runs that header against this module).
"""
from __future__ import annotations


def visible_first(n_keys: int, window_left: int = -1) -> int:
    """The first key the decode query (the last of ``n_keys``) sees: 0, or
    n_keys - 1 - window_left under a window of ``window_left`` keys to the left (-1: none)."""
    return 0 if window_left < 0 else max(n_keys - 1 - window_left, 0)


def split_range(n_keys: int, num_splits: int, split: int, granule: int = 1, start: int = 0) -> tuple:
    """The keys [a, b) split ``split`` of ``num_splits`` owns among [start, n_keys), dealt in
    granules of ``granule`` keys (see the module docstring).  Pure integer arithmetic, so the
    Numba kernels compile it as a device function."""
    t0 = start // granule
    per = ((n_keys + granule - 1) // granule - t0 + num_splits - 1) // num_splits
    a = min(max((t0 + split * per) * granule, start), n_keys)
    b = min((t0 + (split + 1) * per) * granule, n_keys)
    return a, max(a, b)


def split_ranges(n_keys: int, num_splits: int, granule: int = 1, start: int = 0) -> list:
    """[split_range(..., s, ...) for each split s]: the S ranges, in order."""
    if num_splits < 1:
        raise ValueError(f"num_splits: must be at least 1, got {num_splits}")
    if granule < 1:
        raise ValueError(f"granule: must be at least 1, got {granule}")
    return [split_range(n_keys, num_splits, s, granule, start) for s in range(num_splits)]


def wave_tail(pairs: int, keys: int, num_sms: int, *, splits: int = 1, balanced: bool = False) -> float:
    """A model of a split decode's waves: the keys the busiest SM streams, over the keys each SM
    would stream were the work spread evenly (1.0: no tail; 2.0: the launch takes twice the even
    time).

    ``pairs`` (sequence, KV head) pairs of ``keys`` keys each run on ``num_sms`` SMs, one block
    an SM at a time, every key costing the same.  Split-KV (``balanced`` False) gives each pair
    ``splits`` blocks of ceil(keys / splits) keys, so the busiest SM runs ceil(pairs x splits /
    num_sms) of them.  The balanced deal (decode v9) lays the pairs' keys end to end and gives
    each SM one run of ceil(pairs x keys / num_sms).  The model leaves out what a run that
    crosses pairs costs (a second query load, a pipeline refilled, a partial merged after), and
    the launch's fixed cost, so it says where a tail is, not what closing it gains."""
    for name, val in (("pairs", pairs), ("keys", keys), ("num_sms", num_sms), ("splits", splits)):
        if val < 1:
            raise ValueError(f"{name}: must be at least 1, got {val}")
    even = pairs * keys / num_sms
    if balanced:
        return -(-pairs * keys // num_sms) / even
    return -(-pairs * splits // num_sms) * -(-keys // splits) / even
