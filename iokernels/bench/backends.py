"""Which GPU backends a benchmark run gives rows to (``python -m iokernels bench --backends``)."""
from __future__ import annotations

#: the GPU backends whose registered versions get rows in the attention, decode and backward
#: sections (the gather has no Triton version)
GPU_ROW_BACKENDS = ("numba", "cupy", "triton")
#: the ones this run gives rows (``python -m iokernels bench --backends``; :func:`.cli.run` sets it)
_ROW_BACKENDS = list(GPU_ROW_BACKENDS)


def row_backends() -> tuple:
    """The GPU backends whose rows this run times (all of :data:`GPU_ROW_BACKENDS` unless the run
    names fewer); SDPA's rows are timed in every case either way."""
    return tuple(_ROW_BACKENDS)


def set_row_backends(names) -> tuple:
    """Time only ``names`` (a subset of :data:`GPU_ROW_BACKENDS`; None: all); returns the previous
    selection.  A name not among them is a ValueError naming ``backends``."""
    names = GPU_ROW_BACKENDS if names is None else tuple(names)
    bad = [n for n in names if n not in GPU_ROW_BACKENDS]
    if bad or not names:
        raise ValueError(f"backends: expected a non-empty subset of {', '.join(GPU_ROW_BACKENDS)}; got {list(names)}")
    before = row_backends()
    _ROW_BACKENDS[:] = names
    return before
