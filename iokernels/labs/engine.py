"""The grading engine: an exercise is a spec, hidden cases, and a grader per case.

A learner's function (or kernel) is run on each hidden case in order; the first case
that goes wrong stops the grading and its story becomes the message.  Every case is
checked two ways, where they apply:

* exactness: the output against the float64 oracle (:mod:`iokernels.core.reference`)
  through the shared checker :func:`iokernels.core.testing.check` (FlashAttention's rule:
  max|out - ref64| <= 2 x max|naive in the same precision - ref64| + a tiny atol; float64
  to about 1e-12);
* an IO budget: the learner's kernel works on :class:`iokernels.core.traffic.HBM` arrays,
  its traffic is counted with :func:`iokernels.core.traffic.count`, and each tensor's
  bytes read and written are held against the package's closed-form model of the same run.

Failures teach: the message names the case (its shape), the error against what was
allowed, the tensor over budget and by how many bytes, and a hint.  A mistake detector
(:class:`Mistake`) names a known error when the evidence fits it ("rescale applied
twice", "Q re-read inside the tile loop").

The grader grades the learner, not the package: while the learner's code runs, the
package's own implementations of the answer (the exercise's ``references``: the oracle,
the tiled loops, the merge, ...) raise, and a solution that reaches one fails with a
message naming it (:mod:`iokernels.labs.guard`).

Hidden cases are seeded: the seed of case c of exercise e is ``[e.seed, c]``, so a
correct solution passes every time and a wrong one fails every time.

Notation: a *case* is one problem (shape, dtype, mask); a *budget* is a
:class:`~iokernels.core.traffic.Traffic` of allowed bytes per tensor.
"""
from __future__ import annotations

import contextlib
import contextvars
import html
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..core import testing
from ..core.traffic import Traffic
from .guard import ReferenceReached, guarded

__all__ = ["Case", "Mistake", "CaseReport", "BudgetRow", "Result", "Exercise", "LabFailure",
           "grade", "collect", "budget_report", "oracle_problem", "first_mistake"]



@dataclass(frozen=True)
class Case:
    """One hidden problem.  ``label`` is what a failure message calls it."""

    label: str
    params: dict


#: the parameters a case's label shows, in this order
LABEL_KEYS = ("B", "Hq", "Hkv", "rows", "Nq", "Nk", "N", "d", "Br", "Bc", "parts", "splits", "block_size", "dtype")


def case(**p) -> Case:
    """A case whose label names its shape (the keys of :data:`LABEL_KEYS` it has, and "causal")."""
    parts = [f"{k}={p[k]}" for k in LABEL_KEYS if k in p]
    if p.get("causal"):
        parts.append("causal")
    return Case(" ".join(parts), p)


@dataclass(frozen=True)
class Mistake:
    """A known wrong idea: its name, how it shows, and what to do instead."""

    name: str
    hint: str


class LabFailure(Exception):
    """Raised inside a grader to fail a case with a teaching message (and a mistake, if known)."""

    def __init__(self, message: str, mistake: Mistake | None = None):
        super().__init__(message)
        self.mistake = mistake


class LabSkip(Exception):
    """Raised by a grader when the exercise cannot run here (no GPU, no compiler)."""


@dataclass
class BudgetRow:
    """One tensor's counted bytes against its budget."""

    tensor: str
    read: int
    written: int
    allowed_read: int
    allowed_written: int

    @property
    def over(self) -> int:
        return max(0, self.read - self.allowed_read) + max(0, self.written - self.allowed_written)

    @property
    def total(self) -> int:
        return self.read + self.written

    @property
    def allowed(self) -> int:
        return self.allowed_read + self.allowed_written


@dataclass
class CaseReport:
    """What one case measured: the worst error and its bound, and the budget rows."""

    error: float | None = None
    bound: float | None = None
    budget: list = field(default_factory=list)     # of BudgetRow
    notes: list = field(default_factory=list)      # lines shown on a pass too

    @property
    def bytes(self) -> int | None:
        return sum(r.total for r in self.budget) if self.budget else None

    @property
    def allowed(self) -> int | None:
        return sum(r.allowed for r in self.budget) if self.budget else None


@dataclass
class Result:
    """The outcome of grading one exercise."""

    exercise: str
    status: str                         # "passed" | "failed" | "skipped"
    message: str
    case: str | None = None             # the failing case's label (or the last case run)
    error: float | None = None
    bound: float | None = None
    bytes: int | None = None
    allowed: int | None = None
    mistake: str | None = None
    cases_run: int = 0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def headline(self) -> str:
        return {"passed": "PASSED", "failed": "NOT YET", "skipped": "SKIPPED"}[self.status]

    def __str__(self) -> str:
        return f"[{self.headline()}] {self.exercise}: {self.message}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colours = {"passed": ("#e6f4ea", "#1e8e3e", "#0d652d"), "failed": ("#fce8e6", "#d93025", "#a50e0e"),
                   "skipped": ("#fef7e0", "#f9ab00", "#7a4f01")}
        bg, edge, fg = colours[self.status]
        body = html.escape(self.message).replace("\n", "<br>")
        return (f'<div class="iokernels-lab-result iokernels-lab-{self.status}" '
                f'style="background:{bg};border-left:6px solid {edge};color:{fg};padding:6px 10px;'
                f'font-family:monospace;white-space:normal"><b>{self.headline()}</b> '
                f'{html.escape(self.exercise)}<br>{body}</div>')


@dataclass(frozen=True)
class Exercise:
    """One exercise: what to write, the hidden cases, and how one case is graded.

    ``grade_case(solution, case, rng) -> CaseReport`` raises :class:`LabFailure` to fail
    the case.  ``cases()`` returns the hidden cases (deterministic).  ``entry`` is the
    name the learner's notebook gives the function or kernel.  ``references`` names the
    package's own implementations of what the learner writes (dotted paths such as
    ``"iokernels.decode.merge_states"``): while the learner's code runs they must not
    be reachable from it (:mod:`iokernels.labs.guard`).  ``kind`` is "code" (the learner
    writes a function or kernel: it must name references) or "prediction" (a value, such as
    ``loop_order``'s dict: no code of the learner's runs, so there is nothing to guard).
    """

    name: str
    title: str
    entry: str
    spec: str
    cases: Callable[[], list]
    grade_case: Callable
    seed: int
    hint: str = ""
    mistakes: tuple = ()
    references: tuple = ()
    kind: str = "code"

    def rng(self, index: int) -> np.random.Generator:
        """The generator of hidden case ``index``: seeded, so every run sees the same inputs."""
        return np.random.default_rng([self.seed, index])


# --------------------------------------------------------------------------- collecting
_COLLECTORS: contextvars.ContextVar[tuple] = contextvars.ContextVar("iokernels_lab_results", default=())


@contextlib.contextmanager
def collect():
    """Collect every :class:`Result` graded inside the block (``labs grade`` uses this)."""
    results: list = []
    token = _COLLECTORS.set(_COLLECTORS.get() + (results,))
    try:
        yield results
    finally:
        _COLLECTORS.reset(token)


def _record(result: Result) -> None:
    for sink in _COLLECTORS.get():
        sink.append(result)


# --------------------------------------------------------------------------- grading
def _stub_message(exc: NotImplementedError) -> str:
    text = str(exc).strip()
    return text or "the function still raises NotImplementedError"


#: frames inside the package or an installed library are not the learner's code
_NOT_LEARNER = (str(Path(__file__).resolve().parents[1]), "site-packages", "dist-packages")


def _raised(exc: BaseException) -> str:
    """The exception and the learner's line that raised it (the innermost frame of their code)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if not f.filename.startswith(_NOT_LEARNER[0])
                  and not any(s in f.filename for s in _NOT_LEARNER[1:])), None)
    at = f" (line {where.lineno}: {where.line})" if where is not None and where.line else ""
    return f"{type(exc).__name__}: {exc}{at}"


#: names a solution must not use: the HBM array's private store and its output flag (the only
#: ways around the traffic counter, see :class:`iokernels.core.traffic.HBM`)
PRIVATE_NAMES = ("_HBM__store", "__store", "_output")


def reaches_around_the_counter(solution) -> str | None:
    """The private name ``solution``'s code uses to read HBM arrays uncounted, or None."""
    import types
    code = getattr(solution, "__code__", None)
    if code is None:
        return None
    stack = [code]
    while stack:
        c = stack.pop()
        for name in c.co_names + c.co_varnames:
            if name in PRIVATE_NAMES:
                return name
        stack.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
    return None


#: the learner's code called the package's own implementation of the exercise
PACKAGE_CALLED = Mistake("the package's implementation called",
                         "write the computation yourself (NumPy and the HBM arrays are yours to use); the "
                         "package's own version is what your result is checked against, not part of the answer.")


def _reached_message(exercise: Exercise, exc: ReferenceReached, index: int, n: int, case: Case) -> str:
    path = getattr(exc, "path", None) or str(exc)
    who = exercise.entry if "," not in exercise.entry else f"your code ({exercise.entry})"
    return (f"case {index + 1} of {n} ({case.label}): {who} called {path}, the package's own "
            f"implementation: the grader needs your code, so that function is out of reach while yours runs "
            f"(it raises, and catching the error does not help).\nlikely mistake: {PACKAGE_CALLED.name}. "
            f"Fix: {PACKAGE_CALLED.hint}")


def grade(exercise: Exercise, solution) -> Result:
    """Run ``solution`` on every hidden case of ``exercise``; the first failure is the result."""
    if solution is None:
        result = Result(exercise.name, "failed",
                        f"nothing to grade yet: write {exercise.entry} (replace None), then run the check again")
        _record(result)
        return result
    private = reaches_around_the_counter(solution)
    if private is not None:
        result = Result(exercise.name, "failed",
                        f"{exercise.entry} uses {private!r}, the HBM array's private store: read tiles by "
                        f"indexing (x[i0:i1]), which is what the IO budget counts")
        _record(result)
        return result
    cases = exercise.cases()
    report = CaseReport()
    learner = guarded(solution, exercise.references)
    for index, case in enumerate(cases):
        try:
            report = exercise.grade_case(learner, case, exercise.rng(index))
        except ReferenceReached as exc:
            result = Result(exercise.name, "failed", _reached_message(exercise, exc, index, len(cases), case),
                            case.label, mistake=PACKAGE_CALLED.name, cases_run=index)
        except NotImplementedError as exc:
            result = Result(exercise.name, "failed", f"not written yet: {_stub_message(exc)}", case.label,
                            cases_run=index)
        except LabSkip as exc:
            result = Result(exercise.name, "skipped", str(exc), case.label, cases_run=index)
        except LabFailure as exc:
            lines = [f"case {index + 1} of {len(cases)} ({case.label}): {exc}"]
            if exc.mistake is not None:
                lines.append(f"likely mistake: {exc.mistake.name}. Fix: {exc.mistake.hint}")
            elif exercise.hint:
                lines.append(f"hint: {exercise.hint}")
            result = Result(exercise.name, "failed", "\n".join(lines), case.label,
                            mistake=None if exc.mistake is None else exc.mistake.name, cases_run=index)
            _fill_numbers(result, getattr(exc, "report", None))
        except Exception as exc:        # the learner's code raised: say where, never a traceback
            hint = f"\nhint: {exercise.hint}" if exercise.hint else ""
            result = Result(exercise.name, "failed",
                            f"case {index + 1} of {len(cases)} ({case.label}) raised {_raised(exc)}{hint}",
                            case.label, cases_run=index)
        else:
            continue
        _record(result)
        return result
    summary = f"all {len(cases)} hidden cases pass"
    if report.error is not None:
        summary += f" (last: max error {report.error:.3g} <= {report.bound:.3g})"
    if report.bytes is not None:
        summary += f"; bytes {report.bytes:,} within the budget of {report.allowed:,}"
    notes = "".join(f"\n{n}" for n in report.notes)
    result = Result(exercise.name, "passed", summary + notes, cases[-1].label if cases else None,
                    cases_run=len(cases))
    _fill_numbers(result, report)
    _record(result)
    return result


def _fill_numbers(result: Result, report: CaseReport | None) -> None:
    if report is None:
        return
    result.error, result.bound = report.error, report.bound
    result.bytes, result.allowed = report.bytes, report.allowed


def fail(message: str, report: CaseReport | None = None, mistake: Mistake | None = None):
    """Raise a :class:`LabFailure` carrying the case's numbers (for the score table)."""
    exc = LabFailure(message, mistake)
    exc.report = report
    raise exc


# --------------------------------------------------------------------------- checks
def oracle_problem(out, ref64, baseline, *, name: str, dtype: str, factor=testing.FORWARD_FACTOR,
                   masked_rows=None, report: CaseReport | None = None, mistakes=()):
    """Check ``out`` against the oracle with the 2x rule; fail the case with the story if not.

    ``mistakes``: (Mistake, wrong_output) pairs; when ``out`` matches a wrong output, the
    failure names that mistake.  Returns the :class:`~iokernels.core.testing.Check`.
    """
    report = report if report is not None else CaseReport()
    out = np.asarray(out) if not hasattr(out, "shape") else out
    if getattr(out, "shape", None) != np.shape(ref64):
        fail(f"{name} has shape {getattr(out, 'shape', None)}, expected {np.shape(ref64)}", report)
    c = testing.check(out, ref64, baseline, dtype=dtype, name=name, factor=factor, masked_rows=masked_rows)
    report.error = c.error if report.error is None else max(report.error, c.error)
    report.bound = c.bound if report.bound is None else report.bound
    if not c.ok:
        rule = ("float64 must match the float64 oracle to about 1e-12" if c.baseline_error is None else
                f"allowed {factor:g} x naive-in-{dtype}'s {c.baseline_error:.3g} + atol = {c.bound:.3g}")
        detail = c.detail.lstrip("; ") if c.detail else ""
        message = f"{name}: max |{name} - oracle| = {c.error:.3g}, {rule}" + (f"; {detail}" if detail else "")
        fail(message, report, first_mistake(out, mistakes, c.bound))
    return c


def first_mistake(out, mistakes, bound: float = 0.0) -> Mistake | None:
    """The first (Mistake, wrong_output) that ``out`` reproduces, or None.

    ``out`` reproduces a wrong output when it is as close to it as a correct solution must
    be to the oracle (``bound``, at least 1e-9 relative); NaN matches NaN.
    """
    o = testing.as_numpy(out)
    for mistake, wrong in mistakes:
        w = testing.as_numpy(wrong)
        if w.shape != o.shape or not np.array_equal(np.isnan(o), np.isnan(w)):
            continue
        if not np.array_equal(np.where(np.isinf(o), np.sign(o), 0), np.where(np.isinf(w), np.sign(w), 0)):
            continue
        fin = np.isfinite(o)
        tol = max(bound, 1e-9 * max(1.0, float(np.max(np.abs(w[fin]), initial=0.0))))
        if float(np.max(np.abs(o[fin] - w[fin]), initial=0.0)) <= tol:
            return mistake
    return None


def budget_report(counted: Traffic, budget: Traffic, detectors=(), report: CaseReport | None = None,
                  exact: bool = False) -> CaseReport:
    """Hold counted bytes against the budget, tensor by tensor; fail the case if over.

    ``detectors``: callables ``(row, counted, budget) -> Mistake | None`` tried on the first
    tensor over budget.  ``exact``: the counted bytes must equal the budget (a prediction).
    Tensors the budget does not name are allowed zero bytes.
    """
    report = report if report is not None else CaseReport()
    names = sorted(set(counted.by_tensor) | set(budget.by_tensor))
    rows = []
    for name in names:
        r, w = counted.by_tensor.get(name, (0, 0))
        ar, aw = budget.by_tensor.get(name, (0, 0))
        if r or w or ar or aw:
            rows.append(BudgetRow(name, int(r), int(w), int(ar), int(aw)))
    report.budget = rows
    for row in rows:
        short = exact and (row.read < row.allowed_read or row.written < row.allowed_written)
        if row.over or short:
            mistake = next((m for m in (d(row, counted, budget) for d in detectors) if m is not None), None)
            if row.allowed == 0:
                what = f"{row.tensor} moved {row.total:,} B but has no budget at all: it must stay on chip"
            else:
                what = (f"{row.tensor}: read {row.read:,} B and wrote {row.written:,} B; the budget is "
                        f"{row.allowed_read:,} B read and {row.allowed_written:,} B written "
                        + (f"({row.over:,} B over)" if row.over else "(fewer bytes than the model: "
                           "does it read everything it needs?)"))
            fail(what, report, mistake)
    return report


def budget_table(rows) -> str:
    """The budget rows as a small text table."""
    lines = [f"{'tensor':<12}{'read':>12}{'budget':>12}{'written':>12}{'budget':>12}"]
    for r in rows:
        lines.append(f"{r.tensor:<12}{r.read:>12,}{r.allowed_read:>12,}{r.written:>12,}{r.allowed_written:>12,}")
    return "\n".join(lines)
