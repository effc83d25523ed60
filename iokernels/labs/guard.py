"""While a learner's code is graded, the package's own implementations of the answer are out of reach.

An exercise names its *references*: dotted paths to the package's functions that compute
what the learner is asked to write (``"iokernels.decode.merge_states"``, the float64
oracle, the tiled loops).  :func:`guarded` wraps the learner's callable so that while it
runs -- and only then -- every reference raises :class:`ReferenceReached`; the grader's
own calls (the oracle, the budgets, the mistake models) happen outside and work as usual.

The guard acts on the function objects, not on names: each reference's ``__code__`` is
swapped for a stub with the same number of free variables, and put back afterwards.  So an
alias bound before grading (``from iokernels import merge_states as m`` at the top of a
notebook, a module attribute fetched earlier, a bound method of a cache) is caught too.
Methods are patched in their class's dict the same way.  A reference reached is recorded
even when the learner's code catches the exception: the solution fails after its call.

Guards nest (a reference-count per function) and are safe with the threads of the SIMT
runner and Numba's simulator (one lock; the patch is global while any guard is active).

Limits: a module of the package that is not imported yet when the learner's code starts is
imported here, except the Numba CUDA modules (importing numba first would fix its mode
before a lab notebook can choose the simulator): those are guarded once imported.  Reading
the package's source files as text is not a call and is not caught.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types

__all__ = ["ReferenceReached", "guarded", "guard", "resolve", "reached"]

#: modules imported only by the lab that needs them (numba fixes its CUDA mode on import)
IMPORTED_ONLY = ("iokernels.numba_cuda",
                 # triton reads TRITON_INTERPRET when a kernel is defined: the lab sets it first
                 "iokernels.triton_backend.forward_v1", "iokernels.triton_backend.forward_v2")

_LOCK = threading.RLock()
_PATCHED: dict = {}          # id(function) -> [function, original code, count]
_PATCHED_AS: dict = {}       # the path a stub was made for -> id(function)
_ACTIVE: list = []           # the active guards' records


class ReferenceReached(RuntimeError):
    """The learner's code called one of the package's reference implementations (``path``)."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class _Record:
    """One active guard: the references it holds, and those the code inside reached."""

    def __init__(self, targets):
        self.paths: set = {p for p, _ in targets}
        self.names: dict = {id(fn): p for p, fn in targets}       # this guard's name for each function
        self.reached: list = []


def reached(path: str):
    """Called by a stubbed reference: record the call in every active guard, then raise."""
    with _LOCK:
        fid = _PATCHED_AS.get(path)
        for record in _ACTIVE:
            name = record.names.get(fid)
            if name is not None and name not in record.reached:
                record.reached.append(name)
    raise ReferenceReached(f"{path} is the package's own implementation; it is not available to the code "
                           f"being graded", path)


@functools.lru_cache(maxsize=None)
def _stub_code(path: str, nfree: int) -> types.CodeType:
    """A code object that calls :func:`reached` (``path``) and has ``nfree`` free variables."""
    names = [f"_cell{i}" for i in range(nfree)]
    lines = ["def _outer():"] + [f"    {n} = None" for n in names] + ["    def _stub(*args, **kwargs):"]
    if names:                      # mention the cells so they are free variables; never read them
        lines.append(f"        if args is None: ({', '.join(names)},)")
    lines += [f"        __import__('iokernels.labs.guard', fromlist=['reached']).reached({path!r})",
              "    return _stub"]
    ns: dict = {}
    exec("\n".join(lines), ns)     # noqa: S102 - a fixed template
    code = ns["_outer"]().__code__
    assert len(code.co_freevars) == nfree
    return code


def _function_of(obj):
    """The plain Python function behind ``obj`` (a method, static/class method, lru_cache), or None."""
    for _ in range(4):
        if isinstance(obj, types.FunctionType):
            return obj
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif hasattr(obj, "run") and getattr(obj, "fn", None) is not None:
            obj = obj.fn                  # a Triton kernel (JITFunction, its interpreter, an Autotuner)
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        else:
            return None
    return None


def _module_part(parts):
    """The longest importable prefix of ``parts`` (a module), or (None, 0)."""
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            return sys.modules[name], i
        if any(name == p or name.startswith(p + ".") for p in IMPORTED_ONLY):
            continue
        try:
            return importlib.import_module(name), i
        except Exception:          # noqa: BLE001 - not a module, or one that cannot load here
            continue
    return None, 0


def resolve(path: str):
    """The function object ``path`` names (``pkg.mod.func`` or ``pkg.mod.Class.method``), or None.

    None when its module cannot be imported here (an optional dependency) or is one of
    :data:`IMPORTED_ONLY` and not imported yet.  A path that names something else raises
    ValueError.
    """
    parts = path.split(".")
    obj, i = _module_part(parts)
    root = next((p for p in IMPORTED_ONLY if path.startswith(p + ".")), None)
    if root is not None and (obj is None or len(".".join(parts[:i])) < len(root)):
        return None                 # not imported yet: nothing can have reached it
    if obj is None:
        raise ValueError(f"path: {path!r} names no importable module")
    for part in parts[i:]:
        owner = obj
        obj = vars(owner).get(part) if isinstance(owner, type) else getattr(owner, part, None)
        if obj is None and root is not None and isinstance(owner, types.ModuleType):
            return None             # a submodule of an imported-only package, not imported yet
        if obj is None:
            raise ValueError(f"path: {path!r}: {owner!r} has no attribute {part!r}")
    fn = _function_of(obj)
    if fn is None:
        raise ValueError(f"path: {path!r} names {type(obj).__name__}, not a function")
    return fn


def _resolve_all(paths) -> list:
    """(path, function) for every reference that resolves, each function once (the first path names it).

    A path that names nothing here is passed over: grading must not stop for it (the labs'
    tests check that every exercise's paths resolve)."""
    seen, out = set(), []
    for path in paths:
        try:
            fn = resolve(path)
        except ValueError:
            continue
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            out.append((path, fn))
    return out


@contextlib.contextmanager
def guard(paths):
    """Within the block every reference in ``paths`` raises; yields the record (``.reached``: paths called).

    On leaving, the references are restored (when no other guard holds them), and if the
    code inside reached one -- even one whose exception it caught -- :class:`ReferenceReached`
    is raised naming the first.
    """
    targets = _resolve_all(paths)
    record = _Record(targets)
    with _LOCK:
        for path, fn in targets:
            entry = _PATCHED.get(id(fn))
            if entry is None:
                entry = _PATCHED[id(fn)] = [fn, fn.__code__, 0]
                fn.__code__ = _stub_code(path, len(fn.__code__.co_freevars))
                _PATCHED_AS[path] = id(fn)
            entry[2] += 1
        _ACTIVE.append(record)
    try:
        yield record
    finally:
        with _LOCK:
            _ACTIVE.remove(record)
            for _, fn in targets:
                entry = _PATCHED[id(fn)]
                entry[2] -= 1
                if entry[2] == 0:
                    fn.__code__ = entry[1]
                    del _PATCHED[id(fn)]
                    for p in [p for p, i in _PATCHED_AS.items() if i == id(fn)]:
                        del _PATCHED_AS[p]
        if record.reached:
            raise ReferenceReached(record.reached[0], record.reached[0])


class Guarded:
    """A learner's function or kernel that runs under :func:`guard`.

    Calling it, or launching it (``kernel[grid, block](...)``), runs the learner's code with
    the references out of reach.  ``py_func`` is the Python function behind it (for the SIMT
    runner, which enters :meth:`lab_guard` itself).
    """

    def __init__(self, target, paths):
        self._target, self._paths = target, tuple(paths)
        self.__name__ = getattr(target, "__name__", type(target).__name__)
        self.__doc__ = getattr(target, "__doc__", None)

    def lab_guard(self):
        return guard(self._paths)

    @property
    def py_func(self):
        for attr in ("py_func", "fn"):
            fn = getattr(self._target, attr, None)
            if isinstance(fn, types.FunctionType):
                return fn
        return self._target

    def __call__(self, *args, **kwargs):
        with guard(self._paths):
            return self._target(*args, **kwargs)

    def __getitem__(self, config):
        return Guarded(self._target[config], self._paths)

    def __getattr__(self, name):
        if name.startswith("_"):          # not set yet (a copy being made): no delegation
            raise AttributeError(name)
        return getattr(self._target, name)

    def __repr__(self):
        return f"Guarded({self._target!r})"


def guarded(solution, paths):
    """``solution`` with each callable in it (a function, a kernel, a tuple of them) run under the guard."""
    if not paths or solution is None:
        return solution
    if isinstance(solution, tuple):
        return tuple(guarded(s, paths) for s in solution)
    if callable(solution) or hasattr(solution, "__getitem__") and hasattr(solution, "py_func"):
        return Guarded(solution, paths)
    return solution
