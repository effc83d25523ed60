"""The online softmax, one score row at a time, with every intermediate kept for display.

This is the idea under FlashAttention's tiles, from "Online normalizer calculation for
softmax" (Milakov and Gimelshein, 2018): a softmax row can be normalised in one pass
over blocks of the row, keeping only a running maximum m and a running sum l.  When a
block raises the maximum from m_old to m_new, everything summed so far was scaled by
e^(-m_old) instead of e^(-m_new), so it is multiplied by the rescale factor
e^(m_old - m_new) <= 1.  The output accumulator (sum of p_j * v_j) is rescaled by the
same factor; dividing by l at the end gives the exact softmax.

Notation (FlashAttention paper, one row of S):

===========  ===========================================================
x_j          the scores of block j (a slice of the row, length <= block)
m_j          running maximum after block j;  m_0 = -inf
l_j          running sum of e^(x - m_j) over the blocks seen so far;  l_0 = 0
alpha_j      rescale factor e^(m_{j-1} - m_j) applied to l (and O) at block j
O_j          running unnormalised output sum(e^(x - m_j) * v) (when values are given)
LSE          m + log(l), the row's log-sum-exp (natural log)
===========  ===========================================================

Worked example (the source article): the row [2, 1, 3, 0] in blocks of two gives
m_1 = 2, l_1 = e^0 + e^-1 = 1.3679; then m_2 = 3, alpha_2 = e^-1, the old sum becomes
0.5032, block 2 adds e^0 + e^-3 = 1.0498, and l_2 = 1.5530.

Masked entries are -inf: a block of only -inf leaves m and l unchanged (alpha = 1), and
a row of only -inf ends with l = 0, LSE = -inf and an output of 0, never NaN.

Pure NumPy in float64; nothing here is a kernel, it is the arithmetic a kernel does per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Step", "OnlineSoftmax", "online_softmax_steps"]


@dataclass(frozen=True)
class Step:
    """What happens to the running statistics when block ``index`` (1-based) arrives."""

    index: int
    start: int                 # the block's first column in the row
    block: tuple               # its scores x_j
    m_old: float               # running max before the block
    block_max: float           # max of the block alone
    m_new: float               # running max after the block
    alpha: float               # rescale factor e^(m_old - m_new) (1 when nothing to rescale)
    l_old: float               # running sum before the block
    l_rescaled: float          # alpha * l_old
    block_sum: float           # sum over the block of e^(x - m_new)
    l_new: float               # l_rescaled + block_sum
    o_new: float | None = None  # running unnormalised output, when values were given

    def describe(self) -> str:
        """One line of arithmetic, as written on a whiteboard."""
        xs = ", ".join(f"{x:g}" for x in self.block)
        if self.l_old == 0.0:      # nothing summed yet: there is nothing to rescale
            return (f"block {self.index} [{xs}]: m {self.m_old:g} -> {self.m_new:g}, nothing to rescale yet, "
                    f"l = {self.block_sum:.4f}")
        return (f"block {self.index} [{xs}]: m {self.m_old:g} -> {self.m_new:g}, "
                f"alpha = e^({self.m_old:g} - {self.m_new:g}) = {self.alpha:.4f}, "
                f"l = {self.alpha:.4f} * {self.l_old:.4f} + {self.block_sum:.4f} = {self.l_new:.4f}")


@dataclass(frozen=True)
class OnlineSoftmax:
    """The steps of one row and the results they end with."""

    row: tuple
    block: int
    steps: tuple               # of Step
    m: float                   # final running max
    l: float                   # final running sum
    lse: float                 # m + log(l); -inf for a fully masked row
    softmax: np.ndarray        # e^(x - m) / l, the exact softmax (zeros for a masked row)
    output: float | None       # sum(softmax * values), when values were given

    def direct_softmax(self) -> np.ndarray:
        """The two-pass softmax of the whole row, to compare with :attr:`softmax`."""
        x = np.asarray(self.row, dtype=np.float64)
        if not np.isfinite(x).any():
            return np.zeros_like(x)
        e = np.exp(x - x.max())
        return e / e.sum()

    def table(self) -> list[dict]:
        """The steps as rows of a table (for display)."""
        return [{"block": s.index, "scores": list(s.block), "m_old": s.m_old, "m_new": s.m_new,
                 "alpha": s.alpha, "l_old": s.l_old, "alpha*l_old": s.l_rescaled,
                 "block sum": s.block_sum, "l_new": s.l_new} for s in self.steps]


def _exp_shifted(x: np.ndarray, m: float) -> np.ndarray:
    """e^(x - m), with 0 where x is -inf (also when m is -inf: nothing visible yet)."""
    if m == -np.inf:
        return np.zeros_like(x)
    return np.exp(x - m)


def online_softmax_steps(row, block: int, values=None) -> OnlineSoftmax:
    """Run the online softmax over ``row`` in blocks of ``block`` entries, keeping every step.

    ``values``: optional numbers v_j, one per entry of the row (a one-column V), to show
    the output accumulator being rescaled by the same alpha.
    """
    x = np.asarray(row, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"row: expected a non-empty 1-D sequence of scores, got shape {x.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("row: scores must be finite or -inf (a masked entry)")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block: expected a positive integer, got {block!r}")
    v = None
    if values is not None:
        v = np.asarray(values, dtype=np.float64)
        if v.shape != x.shape:
            raise ValueError(f"values: expected shape {x.shape} (one per score), got {v.shape}")

    m, l, o = -np.inf, 0.0, 0.0                                # m_0, l_0, O_0
    steps = []
    for j, start in enumerate(range(0, x.size, block), start=1):
        xb = x[start:start + block]                            # the block of scores x_j
        block_max = float(xb.max())
        m_new = max(m, block_max)
        alpha = 1.0 if m_new == -np.inf else float(np.exp(m - m_new))  # e^(m_old - m_new)
        e = _exp_shifted(xb, m_new)
        block_sum = float(e.sum())
        l_new = alpha * l + block_sum
        o_new = None
        if v is not None:
            o = alpha * o + float(e @ v[start:start + block])  # same factor rescales O
            o_new = o
        steps.append(Step(j, start, tuple(float(t) for t in xb), float(m), block_max, float(m_new),
                          alpha, float(l), alpha * l, block_sum, float(l_new), o_new))
        m, l = m_new, l_new

    if l == 0.0:                                               # fully masked row
        soft, lse, out = np.zeros_like(x), -np.inf, (0.0 if v is not None else None)
    else:
        soft = _exp_shifted(x, m) / l                          # the final division by l
        lse = float(m + np.log(l))
        out = float(o / l) if v is not None else None
    return OnlineSoftmax(tuple(float(t) for t in x), int(block), tuple(steps), float(m), float(l),
                         lse, soft, out)
