"""One registry per GPU backend: every kernel version, keyed by (op, version).

A backend (:mod:`iokernels.numba_cuda`, :mod:`iokernels.cupy_raw`) owns one
:class:`Registry`.  Each entry is a :class:`Kernel`: the launcher that runs that version,
the config class it takes, one line saying what the version adds, and a check that says
whether it can run here (dtype, head dim, compute capability, contiguity) and, if not,
why.  The public functions (:mod:`iokernels.core.api`) dispatch through it; the benchmark,
the sanitizer cases, the GPU tests and the conformance suite iterate it instead of
repeating lists of versions.

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

from dataclasses import dataclass, field
from typing import Callable

OPS = ("attention", "attention_backward", "decode", "paged_decode", "paged_gather", "mla_decode")


@dataclass(frozen=True)
class Need:
    """What a call needs of a kernel: the facts a version's ``check`` looks at."""

    dtype: str
    head_dim: int
    cc: int | None = None          # compute capability x 10 (90 for an H100), None: unknown
    contiguous: bool = True        # K/V (or pools) C-contiguous
    simulator: bool = False        # Numba's CUDA simulator, not a GPU
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kernel:
    """One version of one op of one backend."""

    backend: str
    op: str
    version: str
    launcher: Callable
    config_class: type
    summary: str
    check: Callable[[Need], str | None] | None = None
    default_rank: int = 0          # higher wins among the versions that can run

    def unavailable(self, need: Need) -> str | None:
        """None when this version can run the call described by ``need``, else why not."""
        return self.check(need) if self.check is not None else None

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.op}:{self.version}"


class Registry:
    """The kernels of one backend.  ``register`` is a decorator for launchers."""

    def __init__(self, backend: str):
        self.backend = backend
        self._kernels: dict[tuple[str, str], Kernel] = {}

    def register(self, op: str, version: str, *, config: type, summary: str, check=None,
                 default_rank: int = 0):
        if op not in OPS:
            raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")

        def deco(fn):
            key = (op, version)
            if key in self._kernels:
                raise ValueError(f"version: {self.backend} {op} {version} is registered twice")
            self._kernels[key] = Kernel(self.backend, op, version, fn, config, summary, check, default_rank)
            return fn
        return deco

    # -- lookup
    def __iter__(self):
        return iter(self._kernels.values())

    def __len__(self):
        return len(self._kernels)

    def ops(self) -> list[str]:
        return [op for op in OPS if any(o == op for o, _ in self._kernels)]

    def versions(self, op: str) -> list[str]:
        return [v for (o, v) in self._kernels if o == op]

    def kernels(self, op: str | None = None) -> list[Kernel]:
        return [k for k in self._kernels.values() if op is None or k.op == op]

    def get(self, op: str, version: str) -> Kernel:
        k = self._kernels.get((op, version))
        if k is None:
            have = ", ".join(self.versions(op)) or "none"
            raise ValueError(f"config.version: {self.backend} has no {op} version {version!r}; "
                             f"available: {have}")
        return k

    def default(self, op: str, need: Need) -> Kernel:
        """The highest-ranked version that can run ``need``; ValueError with each reason."""
        ranked = sorted(self.kernels(op), key=lambda k: -k.default_rank)
        reasons = []
        for k in ranked:
            why = k.unavailable(need)
            if why is None:
                return k
            reasons.append(f"{k.version}: {why}")
        raise ValueError(f"q: no {self.backend} {op} kernel runs {need.dtype} at head_dim={need.head_dim}"
                         + (f" ({'; '.join(reasons)})" if reasons else ""))

    def resolve(self, op: str, config, need: Need):
        """(kernel, config) for one call.  ``config`` None or with version None: the default
        version, with its config class's defaults; a config naming a version: that version,
        or a ValueError saying why it cannot run here."""
        classes = tuple({k.config_class for k in self.kernels(op)})
        if config is not None and classes and not isinstance(config, classes):
            names = " or ".join(sorted(c.__name__ for c in classes))
            raise ValueError(f"config: {self.backend} {op} takes a {names} or None, got {type(config).__name__}")
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

    def table(self) -> list[dict]:
        """One row per kernel: backend, op, version, config class, summary (for docs)."""
        return [dict(backend=k.backend, op=k.op, version=k.version, config=k.config_class.__name__,
                     summary=k.summary) for k in self]
