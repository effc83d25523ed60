"""HBM traffic: counted by running the code, and predicted in closed form.

"HBM traffic" is the bytes an algorithm moves between device memory (HBM) and on-chip
memory (SRAM / registers) *as written*: every tile load and every tile store, with no
caches.  The NumPy kernels keep the arrays that live "in HBM" inside :class:`HBM`
wrappers; reading a slice (``Q[i0:i1]``) counts its bytes as read, assigning one
(``O[i0:i1] = x``) counts them as written, and ``O[i0:i1] += x`` counts both, which is
exactly a read-modify-write.  Everything else is on-chip and free.  In use::

    with ik.traffic.count() as t:
        ik.attention(q, k, v, backend="tiled")
    t.bytes_read, t.bytes_written, t.by_tensor["K"]

:func:`model` predicts the same numbers from the problem's sizes alone; the tests assert
that counted == modelled exactly, tensor by tensor.

SRAM capacity (the paper's M) is checked by the kernels' tile configs
(:class:`iokernels.core.config.TileConfig`): a tile set that does not fit is a ValueError.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["Traffic", "HBM", "count", "model", "MODELS", "decompose", "PARTS"]


@dataclass
class Traffic:
    """Bytes read from and written to HBM, in total and per named tensor."""

    by_tensor: dict = field(default_factory=dict)  # name -> [bytes_read, bytes_written]

    @property
    def bytes_read(self) -> int:
        return sum(r for r, _ in self.by_tensor.values())

    @property
    def bytes_written(self) -> int:
        return sum(w for _, w in self.by_tensor.values())

    @property
    def total(self) -> int:
        return self.bytes_read + self.bytes_written

    def add(self, name: str, read: int = 0, written: int = 0) -> "Traffic":
        entry = self.by_tensor.setdefault(name, [0, 0])
        entry[0] += int(read)
        entry[1] += int(written)
        return self

    def merge(self, other: "Traffic") -> "Traffic":
        for name, (r, w) in other.by_tensor.items():
            self.add(name, r, w)
        return self

    def as_dict(self) -> dict:
        """{name: (read, written)} with zero entries dropped: the form tests compare."""
        return {k: (int(r), int(w)) for k, (r, w) in sorted(self.by_tensor.items()) if r or w}

    def __eq__(self, other) -> bool:
        return isinstance(other, Traffic) and self.as_dict() == other.as_dict()

    def table(self) -> str:
        rows = [f"{'tensor':<10}{'read (B)':>16}{'written (B)':>16}"]
        for name, (r, w) in self.as_dict().items():
            rows.append(f"{name:<10}{r:>16,}{w:>16,}")
        rows.append(f"{'total':<10}{self.bytes_read:>16,}{self.bytes_written:>16,}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"Traffic(read={self.bytes_read:,} B, written={self.bytes_written:,} B)"


# The counters that are listening now (a stack, so counts can nest). A ContextVar keeps
# threads and notebooks' async cells apart; nothing is counted outside ``count()``.
_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("iokernels_traffic", default=())


@contextlib.contextmanager
def count():
    """Count the HBM traffic of the NumPy kernels run inside the block."""
    t = Traffic()
    token = _ACTIVE.set(_ACTIVE.get() + (t,))
    try:
        yield t
    finally:
        _ACTIVE.reset(token)


def _record(name: str, read: int = 0, written: int = 0) -> None:
    for t in _ACTIVE.get():
        t.add(name, read, written)


class HBM:
    """An array that lives in HBM: every slice read or written is counted.

    ``name`` labels the tensor in :attr:`Traffic.by_tensor` (Q, K, V, S, P, O, LSE, ...).
    Reads return copies (the data now sits "in SRAM"), so kernels cannot cheat by
    holding views into HBM.

    The only way to the bytes is indexing, which counts them.  There is no public
    ``.data``; ``np.asarray(x)``, NumPy functions and ufuncs on an HBM array raise a
    TypeError (they would read it all without counting).  A kernel hands its outputs
    back with :meth:`result`, which only output arrays allow (made by :meth:`empty`,
    :meth:`zeros` or :meth:`full`) and which ends the array's life: any later access
    raises.  Python cannot truly hide an attribute; the private store is named so that
    reaching it is visibly deliberate, and the labs' grader refuses code that does.
    """

    __slots__ = ("__store", "name", "_output")       # "__store" is stored as _HBM__store

    def __init__(self, data: np.ndarray, name: str, *, output: bool = False):
        if isinstance(data, HBM):
            raise TypeError(f"{name}: already an HBM array ({data.name})")
        self.__store: np.ndarray | None = np.asarray(data)
        self.name = name
        self._output = bool(output)

    @classmethod
    def empty(cls, shape, dtype, name: str) -> "HBM":
        """An output array, uninitialised."""
        return cls(np.empty(shape, dtype=dtype), name, output=True)

    @classmethod
    def zeros(cls, shape, dtype, name: str) -> "HBM":
        """An output array, zero-filled (the fill is not counted: a memset at allocation)."""
        return cls(np.zeros(shape, dtype=dtype), name, output=True)

    @classmethod
    def full(cls, shape, value, dtype, name: str) -> "HBM":
        """An output array filled with ``value`` (not counted, like :meth:`zeros`)."""
        return cls(np.full(shape, value, dtype=dtype), name, output=True)

    def _live(self) -> np.ndarray:
        store = self.__store
        if store is None:
            raise ValueError(f"{self.name}: this HBM array was handed back by result(); it can no "
                             f"longer be read or written")
        return store

    @property
    def shape(self):
        return self._live().shape

    @property
    def dtype(self):
        return self._live().dtype

    @property
    def ndim(self) -> int:
        return self._live().ndim

    @property
    def itemsize(self) -> int:
        return self._live().dtype.itemsize

    def __len__(self) -> int:
        return len(self._live())

    def __getitem__(self, idx) -> np.ndarray:
        tile = np.array(self._live()[idx], copy=True)
        _record(self.name, read=tile.nbytes)
        return tile

    def __setitem__(self, idx, value) -> None:
        store = self._live()
        view = store[idx]
        nbytes = np.asarray(view).nbytes if np.ndim(view) else self.itemsize
        store[idx] = value
        _record(self.name, written=nbytes)

    def result(self) -> np.ndarray:
        """The finished output, handed back to the caller (not counted: its bytes were counted
        as they were written).  Only for output arrays; the HBM array is unusable afterwards."""
        if not self._output:
            raise ValueError(f"{self.name}: result() hands back an output; an input in HBM is read "
                             f"tile by tile, by indexing (which counts the bytes)")
        store = self._live()
        self.__store = None
        return store

    def __array__(self, *args, **kwargs):
        raise TypeError(f"{self.name}: an HBM array cannot be converted with np.asarray (it would read "
                        f"every byte uncounted); index it (x[i0:i1]) to load a tile")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise TypeError(f"{self.name}: NumPy ufuncs ({ufunc.__name__}) do not take HBM arrays; load a "
                        f"tile by indexing first")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"{self.name}: NumPy functions ({func.__name__}) do not take HBM arrays; load "
                        f"a tile by indexing first")

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __reduce__(self):
        raise TypeError(f"{self.name}: HBM arrays cannot be pickled or copied")

    def __copy__(self):
        raise TypeError(f"{self.name}: HBM arrays cannot be copied; load a tile by indexing")

    def __deepcopy__(self, memo):
        raise TypeError(f"{self.name}: HBM arrays cannot be copied; load a tile by indexing")

    def _no_arithmetic(self, *args):
        raise TypeError(f"{self.name}: no arithmetic on an HBM array (it would read every byte "
                        f"uncounted); load a tile by indexing (x[i0:i1]) and compute on the tile")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _no_arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = _no_arithmetic

    def __repr__(self) -> str:
        if self.__store is None:
            return f"HBM({self.name}, handed back)"
        return f"HBM({self.name}, shape={self.shape}, dtype={self.dtype})"


# --------------------------------------------------------------------------- models
#: kind -> the closed form of its traffic.  Each kernel module owns the closed form of its own
#: traffic; :mod:`iokernels.api` (one layer up, which imports every kernel module) registers
#: them here when the package is imported (:func:`register_models`), so this module names none.
MODELS: dict[str, Callable[..., Traffic]] = {}


def register_models(**models: Callable[..., Traffic]) -> None:
    """Add traffic models by kind (``fa2=tiled.traffic_model_fa2``); a kind is registered once."""
    for kind, fn in models.items():
        if MODELS.get(kind, fn) is not fn:
            raise ValueError(f"kind: {kind!r} already has a traffic model ({MODELS[kind].__qualname__})")
        MODELS[kind] = fn


def model(kind: str, **problem) -> Traffic:
    """Closed-form HBM bytes that the kernel ``kind`` moves on the given problem.

    kind: one of :data:`MODELS`.  The keyword arguments describe the problem (batch,
    heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, causal, window, config, ...);
    each model's docstring lists what it takes.
    """
    if kind not in MODELS:
        raise ValueError(f"kind: expected one of {', '.join(sorted(MODELS))}; got {kind!r}")
    return MODELS[kind](**problem)


# --------------------------------------------------------------------------- where the bytes go
#: the parts :func:`decompose` splits a traffic total into, in plotting order
PARTS = ("mandatory", "S and P", "tile re-reads", "LSE", "other")
#: tensors that every attention kernel must move once: read Q, K, V; write O
_ONCE = {"Q": ("read", "q"), "K": ("read", "k"), "V": ("read", "k"), "O": ("written", "q")}


def decompose(t: Traffic, *, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
              itemsize: int) -> dict:
    """Split a traffic total into the parts that explain it: {part: bytes}, summing to ``t.total``.

    ========================  ==========================================================
    mandatory                 Q, K, V read once and O written once (``heads`` = batch x
                              query heads; a tensor moved less than once counts what it moved)
    S and P                   naive attention's N_q x N_k intermediates, written and read
    tile re-reads             every further read or write of Q, K, V, O and the running
                              statistics m, l of FlashAttention-1: the price of tiling,
                              quadratic in N but divided by the tile size
    LSE                       the log-sum-exp per row (linear in N)
    other                     any other tensor (a dense bias, a block mask, ...)
    ========================  ==========================================================
    """
    rows = {"q": seqlen_q, "k": seqlen_k}
    out = dict.fromkeys(PARTS, 0)
    for name, (r, w) in t.by_tensor.items():
        if name in _ONCE:
            direction, n = _ONCE[name]
            moved = r if direction == "read" else w
            once = min(moved, heads * rows[n] * head_dim * itemsize)
            out["mandatory"] += once
            out["tile re-reads"] += r + w - once
        elif name in ("S", "P"):
            out["S and P"] += r + w
        elif name in ("m", "l"):
            out["tile re-reads"] += r + w
        elif name == "LSE":
            out["LSE"] += r + w
        else:
            out["other"] += r + w
    return out
