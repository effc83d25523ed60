"""Solutions that call the package's own implementation of what the learner writes, one per
exercise of chapters 09-13: while an exercise is graded, each must fail with a message that
says why (the guard of :mod:`iokernels.labs.engine`).  Imported by the guard's tests."""
from __future__ import annotations


def _fwht(x):
    from iokernels import fp8
    return fp8.fwht(x)


def _merge_pair(o, lse, o_b, lse_b):
    from iokernels.context_parallel import merge_pair
    return merge_pair(o, lse, o_b, lse_b)


CHEATS = {"fwht": _fwht, "merge_pair": _merge_pair}
