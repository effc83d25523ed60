"""A deterministic stand-in for a model, for testing the scheduler fast and exactly.

:class:`ChecksumModel` writes, for every token, a K and V row of (token id, position),
reads the whole sequence back from the memory and draws its logits from a checksum of
what it read.  So the next token depends on every token the cache holds, in order: a
block lost, shared by mistake, copied wrong or recomputed wrong changes the tokens of
the run (and a position out of place raises at once).  It does no arithmetic to speak of,
so a test can serve a thousand requests.  It runs over host and device memories alike.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ChecksumModel"]


def _host(x):
    """A NumPy array of what a memory read back (a device memory's rows are torch tensors)."""
    return x.cpu().numpy() if hasattr(x, "cpu") else x


class ChecksumModel:
    """One layer, one KV head, head dim 2: K = V = (token id, position) per token."""

    layers, kv_heads, head_dim = 1, 1, 2

    def __init__(self, vocab=64):
        self.vocab = int(vocab)

    def forward(self, memory, seqs, chunk_lens):
        out = np.empty((len(seqs), self.vocab))
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            ids = s.tokens[s.computed:s.computed + c]
            rows = np.stack([ids, np.arange(s.computed, s.computed + c)], axis=-1)[:, None]
            rows = rows.astype(memory.dtype) if isinstance(memory.dtype, np.dtype) else rows.astype(np.float64)
            memory.write(0, s, rows, rows.copy(), ids)
            k, v = (_host(x) for x in memory.read(0, s))
            n = s.computed + c
            if not (np.array_equal(k[:, 0, 1], np.arange(n)) and np.array_equal(k, v)):
                raise AssertionError(f"sequence {s.group.request.rid!r}/{s.sample}: the cache's rows are out of place")
            checksum = int(((k[:, 0, 0] + 1) * (k[:, 0, 1] + 1)).sum()) % (2 ** 32)
            out[i] = np.random.default_rng(checksum).standard_normal(self.vocab)
        return out
