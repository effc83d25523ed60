"""Where a benchmark's paged decode rows keep their block tables and lengths.

A program that calls a paged decode in a loop (a server's decode step) keeps its block
tables on the device, as vLLM keeps its block tables and FlashInfer its page indices; a row
timed with NumPy tables would time the launcher checking and uploading them on every call.
Each launcher reads them where it reads them: the CuPy plan and the Triton launcher take
device tables and lengths in place (both size the launch for the tables' capacity), the Numba
launcher both on the host.
"""
from __future__ import annotations

import numpy as np

#: per backend, where a program that calls a paged decode in a loop keeps its block tables and
#: lengths: on the device, as a server keeps them (vLLM's block tables, FlashInfer's indices),
#: where the launcher reads them there; the Numba launcher reads both on the host
PAGED_TABLES_ON_DEVICE = {"cupy": (True, True), "triton": (True, True), "numba": (False, False)}


def paged_call_tables(backend, tables, lens, device):
    """(block tables, lengths) as ``backend``'s paged decode is called in a loop: the NumPy
    ``tables`` and ``lens``, each moved to ``device`` (once, before the timed calls) where
    :data:`PAGED_TABLES_ON_DEVICE` says the launcher reads it there."""
    import torch
    on_dev = PAGED_TABLES_ON_DEVICE.get(backend, (False, False))
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device) if d else x
                 for x, d in zip((tables, lens), on_dev))
