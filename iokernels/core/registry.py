"""One registry per GPU backend: every kernel version, keyed by (op, version).

A backend (:mod:`iokernels.numba_cuda`, :mod:`iokernels.cupy_raw`) owns one
:class:`Registry`, filled with :meth:`Registry.add` from the ``RECORDS`` each family module
ends with: one :class:`~iokernels.core.records.Record` per version, holding its launcher,
the config class it takes, one line saying what the version adds, its rank, and a check
that says whether it can run here (dtype, head dim, compute capability, contiguity) and,
if not, why.  The public functions (:mod:`iokernels.api`) dispatch through it; the
benchmark, the sanitizer cases, the GPU tests, the conformance suite and the version tables
iterate it instead of repeating lists of versions.

Ops (the same names as the public functions):

=================  ===========================================================
attention          prefill forward, (q, k, v) -> (O, LSE)
attention_backward (do, q, k, v, o, lse) -> (dq, dk, dv)
decode             one query token per sequence over a contiguous KV cache
paged_decode       the same over a :class:`~iokernels.paged.PagedKVCache`
paged_gather       a sequence's K, V copied out of the block pool
=================  ===========================================================

A config object carries ``version`` (a string: "v1", "v2", ...); ``None`` or a config whose
version is None means the backend's default, which the registry resolves per call from
what the call needs (:meth:`Registry.resolve`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from .conventions import effective_window
from .records import Record, version_table

OPS = ("attention", "attention_backward", "decode", "paged_decode", "paged_prefill", "paged_gather", "mla_decode")


@dataclass(frozen=True)
class Need:
    """What a call needs of a kernel: the facts a version's ``check`` looks at."""

    dtype: str
    head_dim: int
    cc: int | None = None          # compute capability x 10 (90 for an H100), None: unknown
    contiguous: bool = True        # K/V (or pools) C-contiguous
    simulator: bool = False        # Numba's CUDA simulator, not a GPU
    extra: dict = field(default_factory=dict)


def forward_lengths(op: str, q, k, causal=False, window=None) -> dict:
    """The facts of a forward call (op "attention") a default may choose by, for a
    :class:`Need`'s ``extra``: ``seq_q`` and ``seq_k`` (q's and k's third axis) and ``window``,
    the band as one (left, right) pair (causal folded in:
    :func:`~iokernels.core.conventions.effective_window`); {} for another op or without q, k."""
    if op != "attention" or q is None or k is None:
        return {}
    return dict(seq_q=int(q.shape[2]), seq_k=int(k.shape[2]), window=effective_window(causal, window))


class Registry:
    """The records of one backend, keyed by (op, version)."""

    def __init__(self, backend: str):
        self.backend = backend
        self._kernels: dict[tuple[str, str], Record] = {}
        #: counts the changes of the records (a cache of resolved calls keys on it)
        self.generation = 0
        #: (generation, {op: its records}): :meth:`kernels` of one op without a scan of all
        self._by_op: tuple[int, dict[str, list[Record]]] = (-1, {})

    def add(self, *records: Record) -> None:
        """Register ``records`` (all checked first: a bad one adds none)."""
        seen = set()
        for r in records:
            if not isinstance(r, Record):
                raise ValueError(f"records: expected Record objects, got {type(r).__name__}")
            if r.backend != self.backend:
                raise ValueError(f"record.backend: this registry is {self.backend!r}, got {r.backend!r}")
            if r.op not in OPS:
                raise ValueError(f"record.op: expected one of {', '.join(OPS)}, got {r.op!r}")
            key = (r.op, r.version)
            if key in self._kernels or key in seen:
                raise ValueError(f"record.version: {self.backend} {r.op} {r.version} is registered twice")
            seen.add(key)
        for r in records:
            self._kernels[(r.op, r.version)] = r
        self.generation += 1

    @contextlib.contextmanager
    def added(self, *records: Record) -> Iterator["Registry"]:
        """``records`` registered inside the ``with`` block only (a toy version in a test)."""
        self.add(*records)
        try:
            yield self
        finally:
            for r in records:
                self._kernels.pop((r.op, r.version), None)
            self.generation += 1

    # -- lookup
    def __iter__(self):
        return iter(self._kernels.values())

    def __len__(self):
        return len(self._kernels)

    def ops(self) -> list[str]:
        index = self._index()
        return [op for op in OPS if op in index]

    def versions(self, op: str) -> list[str]:
        return [v for (o, v) in self._kernels if o == op]

    def kernels(self, op: str | None = None) -> list[Record]:
        if op is None:
            return list(self._kernels.values())
        return list(self._index().get(op, ()))

    def _index(self) -> dict[str, list[Record]]:
        """{op: its records}, built again only when the records have changed."""
        if self._by_op[0] != self.generation:
            by_op: dict[str, list[Record]] = {}
            for k in self._kernels.values():
                by_op.setdefault(k.op, []).append(k)
            self._by_op = (self.generation, by_op)
        return self._by_op[1]

    def find(self, op: str, version: str) -> Record | None:
        """The record of (op, version), or None."""
        return self._kernels.get((op, version))

    def get(self, op: str, version: str) -> Record:
        k = self._kernels.get((op, version))
        if k is None:
            have = ", ".join(self.versions(op)) or "none"
            raise ValueError(f"config.version: {self.backend} has no {op} version {version!r}; "
                             f"available: {have}")
        return k

    def default(self, op: str, need: Need) -> Record:
        """The highest-ranked version that can run ``need`` and that its record lets the default
        pick (:meth:`Record.not_default`); ValueError with each reason."""
        ranked = sorted(self.kernels(op), key=lambda k: -k.rank)
        reasons = []
        for k in ranked:
            why = k.not_default(need)
            if why is None:
                return k
            reasons.append(f"{k.version}: {why}")
        raise ValueError(f"q: no {self.backend} {op} kernel runs {need.dtype} at head_dim={need.head_dim}"
                         + (f" ({'; '.join(reasons)})" if reasons else ""))

    def resolve(self, op: str, config, need: Need):
        """(kernel, config) for one call.  ``config`` None or with version None: the default
        version, with its config class's defaults; a config naming a version: that version
        (even one the default does not pick yet, see ``Record.default_check``), or a
        ValueError saying why it cannot run here."""
        version = getattr(config, "version", None) if config is not None else None
        classes = {k.config_class for k in self.kernels(op)}
        if config is not None and not isinstance(config, tuple(classes)):
            names = " or ".join(sorted(c.__name__ for c in classes)) or "no config"
            raise ValueError(f"config: {self.backend} {op} takes a {names} (or None), got {type(config).__name__}")
        if version is None:
            k = self.default(op, need)
            if config is None or not isinstance(config, k.config_class):
                config = k.config_class(version=k.version)
            else:
                config = config.replace(version=k.version)
            return k, config
        k = self.get(op, version)
        if not isinstance(config, k.config_class):
            raise ValueError(f"config: {self.backend} {op} takes a {k.config_class.__name__}, "
                             f"got {type(config).__name__}")
        why = k.unavailable(need)
        if why is not None:
            raise ValueError(f"config.version: {self.backend} {op} {version} cannot run here: {why}")
        return k, config

    def call(self, op: str, config, need: Need, *args, **kwargs):
        """Resolve (:meth:`resolve`), then run the version's launcher on ``args`` with its config.

        The one dispatch every backend's public functions share: ``config`` None picks the
        default for ``need``; a config naming a version runs that version or raises why not.
        """
        kernel, config = self.resolve(op, config, need)
        return kernel.launcher(*args, config=config, **kwargs)

    def table(self) -> list[dict]:
        """One row per record: backend, op, version, file, kernel, config class, rank, summary."""
        return [dict(backend=k.backend, op=k.op, version=k.version, file=k.file, kernel=k.kernel,
                     config=k.config_class.__name__, rank=k.rank, summary=k.summary) for k in self]

    def version_table(self, ops: tuple[str, ...] | None = None, fmt: str = "rst") -> str:
        """The generated version table (:func:`iokernels.core.records.version_table`) of ``ops``
        (None: every op), in op order, the highest rank first within an op."""
        recs = [k for op in OPS if ops is None or op in ops
                for k in sorted(self.kernels(op), key=lambda k: -k.rank)]
        return version_table(recs, fmt)
