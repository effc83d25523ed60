"""What the decode version tests share: ragged decode inputs, and the check of (O, LSE)
against the float64 oracle by the 2x rule, with the naive backend's float32 result as the
baseline and empty sequences' rows masked (the Numba tests); for the CuPy GPU tests, the naive
decode in the inputs' dtype on the GPU and a check that collects every failure of a run."""
import numpy as np

import iokernels as ik
from iokernels import reference, testing
from iokernels.core.testing import as_numpy, check


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


def gpu_naive_decode(torch, tq, tk, tv, lens, window=None):
    """The naive decode in the inputs' dtype on the GPU (the 2x rule's baseline), per sequence
    over its ``lens`` keys (and ``window``); a length-0 sequence gives zeros."""
    from iokernels.torch_sdpa import naive_attention
    base = torch.zeros_like(tq)
    for b, n in enumerate(lens):
        if n:
            lo = 0 if window is None else max(0, n - 1 - window[0])
            base[b] = naive_attention(tq[b:b + 1, :, None], tk[b:b + 1, :, lo:n], tv[b:b + 1, :, lo:n])[0, :, 0]
    return base


def hold_decode(label, o, lse, ref_o, ref_l, base, dtype, problems, lse_tol):
    """Append to ``problems`` what is wrong with (O, LSE) against the oracle: O by the 2x rule
    against ``base`` (float64: the oracle's tolerance), an empty row's LSE not -inf, and an LSE
    error of ``lse_tol`` or more."""
    masked = ~np.isfinite(ref_l)[..., None]
    c = check(o, ref_o, None if dtype == "float64" else base, dtype=dtype, masked_rows=masked)
    if not c:
        problems.append(f"{label}: O {c}")
    lse = as_numpy(lse)
    fin = np.isfinite(ref_l)
    if not np.all(np.isneginf(lse[~fin])):
        problems.append(f"{label}: LSE of an empty row is not -inf")
    err = float(np.max(np.abs(lse[fin] - ref_l[fin]))) if fin.any() else 0.0
    if err >= lse_tol:
        problems.append(f"{label}: LSE error {err:.3g}")
