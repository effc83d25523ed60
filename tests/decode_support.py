"""What the Numba decode version tests share: ragged decode inputs, and the check of (O, LSE)
against the float64 oracle by the 2x rule, with the naive backend's float32 result as the
baseline and empty sequences' rows masked."""
import numpy as np

import iokernels as ik
from iokernels import reference, testing


def decode_inputs(rng, B, Hq, Hkv, N, d, dtype):
    """q (B, Hq, d) and K, V (B, Hkv, N, d) of ``dtype``, standard normal."""
    q = rng.standard_normal((B, Hq, d)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(dtype) for _ in range(2))
    return q, k, v


def check_decode(o, lse, q, k, v, lens, window=None):
    """O and LSE of a decode over ``lens`` keys (and ``window``) against the oracle."""
    ro, rl = reference.decode(q, k, v, seq_lens=lens, window=window)
    bo, bl = ik.decode(q, k, v, seq_lens=lens, backend="naive", return_lse=True, window=window)
    testing.assert_close(o, ro, bo, masked_rows=(np.asarray(lens) == 0)[:, None, None])
    testing.assert_close(lse, rl, bl, name="lse")
