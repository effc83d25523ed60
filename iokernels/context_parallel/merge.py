"""The pairwise exact merge of (O, LSE) states, written once for NumPy and torch arrays.
See :mod:`iokernels.context_parallel` for the formula."""
from __future__ import annotations

import math

import numpy as np


# --------------------------------------------------------------------------- the merge
def _namespace(x):
    """NumPy or torch, whichever ``x`` belongs to (the merge is written once for both)."""
    if type(x).__module__.startswith("torch"):
        import torch
        return torch
    return np


def merge_pair(o, lse, o_b, lse_b):
    """Merge a block's (O_b, LSE_b) into the running (O, LSE): exact, stable, NaN-free.

    Arrays are NumPy or torch, in the accumulator precision; O (..., d), LSE (...).
    LSE' = LSE - log sigmoid(LSE - LSE_b);  O' = O - sigmoid(LSE_b - LSE) * (O - O_b).
    A side with LSE = -inf contributes nothing; both -inf stays (O, -inf).
    """
    xp = _namespace(o)
    live, live_b = lse > -math.inf, lse_b > -math.inf
    both = live & live_b
    zero = xp.zeros_like(lse)
    diff = xp.where(both, lse_b, zero) - xp.where(both, lse, zero)  # finite everywhere, no inf - inf
    log_sig = -xp.logaddexp(zero, -diff)                              # log sigmoid(LSE_b - LSE)
    w = xp.exp(log_sig)                                               # sigmoid(LSE_b - LSE)
    o_new = xp.where(both[..., None], o - w[..., None] * (o - o_b), xp.where(live_b[..., None], o_b, o))
    softplus = xp.logaddexp(zero, diff)                               # = -log sigmoid(LSE - LSE_b)
    lse_new = xp.where(both, lse + softplus, xp.where(live_b, lse_b, lse))
    return o_new, lse_new
