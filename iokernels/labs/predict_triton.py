"""Predict-then-check questions of notebook 15 (Triton), added to :data:`iokernels.labs.predict.QUESTIONS`.

Importing this module registers them; :func:`reveal` is re-exported so a notebook can write::

    from iokernels.labs.predict_triton import reveal

Every answer is computed by the package (:mod:`iokernels.triton_backend.lesson`), never typed in;
none needs triton installed.
"""
from __future__ import annotations

from .predict import QUESTIONS, Question, reveal

__all__ = ["reveal", "TRITON_QUESTIONS"]


def _programs():
    from ..triton_backend.lesson import programs
    return {"programs": programs(2, 8, 1000, 64)}


def _causal_tiles():
    from ..triton_backend.lesson import tiles_visited
    visited, total = tiles_visited(256, 256, 64, 64, causal=True)
    return {"visited": visited, "total": total}


TRITON_QUESTIONS = {
    "triton_v1_programs": Question(
        "triton_v1_programs",
        "how many programs forward v1 launches at batch 2, 8 query heads, Nq = 1000, Br = 64",
        _programs,
        lambda a: (f"ceil(1000 / 64) = 16 Q tiles x 2 x 8 heads = {a['programs']}: one program per (Q tile, "
                   "head), the same grid as the CUDA C++ kernel's thread blocks; the last Q tile is partial "
                   "(1000 = 15 x 64 + 40), so its rows past Nq are masked on load and on store."),
    ),
    "triton_causal_tiles": Question(
        "triton_causal_tiles",
        "causal, Nq = Nk = 256, Br = Bc = 64: how many (Q tile, K/V tile) pairs forward v1's loops load, "
        "and how many the whole score matrix has (parts: visited, total)",
        _causal_tiles,
        lambda a: (f"{a['visited']} of {a['total']}: Q tile i loops over K/V tiles 0 .. i only (1 + 2 + 3 + 4), "
                   "because the loop's range is the tile's key span, which the kernel computes: Triton does "
                   "not skip a masked tile for you. The diagonal tiles are masked inside; v1 masks every tile "
                   "it visits, v2 masks only the diagonal ones."),
    ),
}

QUESTIONS.update(TRITON_QUESTIONS)
