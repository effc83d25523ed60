"""Lab notebooks: learner copies without the solutions, and grading a notebook or a folder.

Solution regions are marked as nbgrader marks them, inside code cells::

    def online_step(m, l, o, s, v):
        \"\"\"...\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

:func:`student_notebook` replaces each region by a stub:

* inside a function (an indented region): ``raise NotImplementedError(<message>)``, the
  message being the text after ``### BEGIN SOLUTION`` or a default that points at the
  docstring and the check cell;
* at the top level of a cell (a prediction): each name the region assigns becomes
  ``name = None``, so the learner copy runs without a traceback and its check says
  "nothing to grade yet";
* ``### BEGIN SOLUTION remove``: the region is dropped (a bug hunt: the learner gets the
  code without the fix, and no marker shows where it was).

:func:`grade_notebook` executes a notebook's code cells in a fresh namespace, in order,
with every :func:`iokernels.labs.check` call collected; a cell that raises is reported and
the next cells still run.  Each exercise the notebook checks (its ``labs.check("name", ...)``
calls) gets a row: passed, failed or skipped, the error and the bytes against the budget.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from .engine import Result, collect

__all__ = ["BEGIN", "END", "student_source", "student_notebook", "write_student_copies", "grade_notebook",
           "grade_path", "score_table", "junit_xml", "lab_notebooks"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
#: the stub's message when the marker carries none
DEFAULT_STUB = "write this part (the docstring above says what it must do), then run the check cell below"
_CHECK_CALL = re.compile(r"""labs\.check\(\s*["']([A-Za-z0-9_]+)["']""")


def lab_notebooks(path) -> list:
    """The lab notebooks under ``path`` (a notebook or a folder), in order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"path: {path} is neither a notebook nor a folder")
    return sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))


def _read(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _stub_for(region: list, indent: str, message: str) -> list:
    if indent:
        return [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError({message!r})"]
    names = []
    try:
        tree = ast.parse("\n".join(region))
    except SyntaxError:
        tree = None
    for node in (tree.body if tree else []):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id not in names:
                names.append(t.id)
    if not names:
        return ["# YOUR CODE HERE"]
    return ["# YOUR ANSWER HERE (replace None)"] + [f"{n} = None" for n in names]


def student_source(source: str) -> str:
    """A cell's source with every solution region replaced by its stub."""
    out, region, begin = [], None, None
    for line in source.split("\n"):
        stripped = line.strip()
        if region is None and stripped.startswith(BEGIN):
            region, begin = [], line
            continue
        if region is not None and stripped.startswith(END):
            indent = begin[:len(begin) - len(begin.lstrip())]
            tail = begin.strip()[len(BEGIN):].strip()
            if tail != "remove":
                body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in region]
                out.extend(_stub_for(body, indent, tail or DEFAULT_STUB))
            region = None
            continue
        if region is not None:
            region.append(line)
        else:
            out.append(line)
    if region is not None:
        raise ValueError(f"source: {BEGIN} without {END}")
    return "\n".join(out)


def _split_lines(text: str) -> list:
    lines = text.split("\n")
    return [ln + "\n" for ln in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def student_notebook(nb: dict) -> dict:
    """A learner copy of a lab notebook: stubs for solutions, no outputs."""
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["source"] = _split_lines(student_source(_source(cell)))
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def write_student_copies(src, outdir) -> list:
    """Write learner copies of the lab notebooks under ``src`` into ``outdir``; returns the paths.

    Other files next to the notebooks (the instructor's README) are not copied.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in lab_notebooks(src):
        target = outdir / path.name
        with open(target, "w", encoding="utf-8") as f:
            json.dump(student_notebook(_read(path)), f, indent=1, ensure_ascii=False)
            f.write("\n")
        written.append(target)
    return written


# --------------------------------------------------------------------------- grading
@dataclass
class NotebookGrade:
    path: Path
    results: list            # of Result, one per exercise the notebook checks
    cell_errors: list        # (cell index, "TypeError: ...")
    seconds: float


def _expected(nb) -> list:
    names = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            for n in _CHECK_CALL.findall(_source(cell)):
                if n not in names:
                    names.append(n)
    return names


def grade_notebook(path) -> NotebookGrade:
    """Execute the notebook's code cells in a fresh namespace and grade every exercise it checks."""
    path = Path(path)
    nb = _read(path)
    namespace = {"__name__": "__lab__"}
    errors = []
    t0 = time.perf_counter()
    with collect() as results, contextlib.redirect_stdout(io.StringIO()):
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            code = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in _source(cell).split("\n"))
            try:
                exec(compile(code, f"{path.name} cell {i}", "exec"), namespace)
            except Exception as exc:     # a learner's cell: report, go on
                errors.append((i, f"{type(exc).__name__}: {exc}"))
    by_name = {}
    for r in results:                    # the last check of an exercise counts
        by_name[r.exercise] = r
    rows = []
    for name in _expected(nb):
        if name in by_name:
            rows.append(by_name[name])
        else:
            why = f"cell {errors[0][0]} raised {errors[0][1]}" if errors else "its check cell never ran"
            rows.append(Result(name, "failed", f"not graded: {why}"))
    return NotebookGrade(path, rows, errors, time.perf_counter() - t0)


def grade_path(path) -> list:
    """Grade one notebook or every lab notebook of a folder."""
    return [grade_notebook(p) for p in lab_notebooks(path)]


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def score_table(grades) -> str:
    """The score table: notebook, exercise, passed, error vs bound, bytes vs budget."""
    w = max([18] + [len(r.exercise) + 2 for g in grades for r in g.results])      # the exercise column
    head = f"{'notebook':<28}{'exercise':<{w}}{'result':<9}{'error':>10}{'bound':>10}{'bytes':>13}{'budget':>13}"
    lines = [head, "-" * len(head)]
    passed = graded = 0
    for g in grades:
        for r in g.results:
            lines.append(f"{g.path.stem[:27]:<28}{r.exercise:<{w}}{r.status:<9}{_num(r.error, '.2g'):>10}"
                         f"{_num(r.bound, '.2g'):>10}{_num(r.bytes, ','):>13}{_num(r.allowed, ','):>13}")
            if r.status != "skipped":
                graded += 1
                passed += r.passed
    lines.append("-" * len(head))
    for g in grades:                     # why each failure failed: the grader's story, as the check cell shows it
        for r in g.results:
            if r.status == "failed":
                story = r.message.splitlines() or [""]
                lines.append(f"{g.path.stem}/{r.exercise}: {story[0]}")
                lines.extend(f"    {ln}" for ln in story[1:] if ln.startswith(("likely mistake:", "hint:")))
    lines.append(f"score: {passed} / {graded} exercises passed"
                 + (" (skipped ones, e.g. GPU-only without a GPU, are not counted)" if any(
                     r.status == "skipped" for g in grades for r in g.results) else ""))
    return "\n".join(lines)


def _attr(text: str) -> str:
    """Text escaped for an XML attribute value in double quotes."""
    return escape(text, {'"': "&quot;", "\n": "&#10;"})


def junit_xml(grades) -> str:
    """JUnit XML: one testsuite per notebook, one testcase per exercise (for course autograders)."""
    out = ['<?xml version="1.0" encoding="utf-8"?>', "<testsuites>"]
    for g in grades:
        rs = g.results
        fails = sum(r.status == "failed" for r in rs)
        skips = sum(r.status == "skipped" for r in rs)
        out.append(f'  <testsuite name="{escape(g.path.stem)}" tests="{len(rs)}" failures="{fails}" '
                   f'skipped="{skips}" errors="0" time="{g.seconds:.2f}">')
        for r in rs:
            out.append(f'    <testcase classname="labs.{escape(g.path.stem)}" name="{escape(r.exercise)}">')
            if r.status == "failed":
                first = r.message.splitlines()[0] if r.message else ""
                out.append(f'      <failure message="{_attr(first)}">{escape(r.message)}</failure>')
            elif r.status == "skipped":
                out.append(f'      <skipped message="{_attr(r.message)}"/>')
            out.append("    </testcase>")
        out.append("  </testsuite>")
    out.append("</testsuites>")
    return "\n".join(out) + "\n"
