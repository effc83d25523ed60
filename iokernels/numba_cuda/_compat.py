"""The one compatibility fix, applied before numba is imported (and so before any compile).

numba-cuda 0.30.4 calls ``np.row_stack`` while compiling a kernel; NumPy 2.5 removed that
alias of ``np.vstack`` (deprecated since NumPy 2.0), and the first compile then fails with
``module 'numpy' has no attribute 'row_stack'``.  We restore the alias only when it is
missing, so NumPy versions that still have it are left untouched.
"""
from __future__ import annotations

import numpy as np


def apply_numpy_row_stack_fix() -> bool:
    """Set ``np.row_stack = np.vstack`` when NumPy lacks it; True when the fix was needed."""
    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    return True


ROW_STACK_FIX_APPLIED = apply_numpy_row_stack_fix()
