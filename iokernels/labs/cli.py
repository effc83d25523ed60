"""``python -m iokernels labs {student,grade}``: the instructor's two commands.

student OUTDIR [--source DIR]   write learner copies of the lab notebooks (solutions -> stubs)
grade PATH [--junit FILE]       grade a notebook or a folder; print the score table; JUnit XML

``grade`` exits 0 when every graded exercise passed, 1 otherwise (skipped ones, such as
the GPU-only exercise without a GPU, do not count either way).
"""
from __future__ import annotations

import argparse
from pathlib import Path

#: the lab notebooks of a checkout (the solution source)
DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "notebooks" / "labs"


def add_parser(sub) -> None:
    """Add the ``labs`` subcommand to the top-level parser's subparsers."""
    p = sub.add_parser("labs", help="lab notebooks: learner copies and grading")
    lsub = p.add_subparsers(dest="labs_command", required=True)
    s = lsub.add_parser("student", help="write learner copies (solution regions replaced by stubs)")
    s.add_argument("outdir", help="folder for the learner notebooks")
    s.add_argument("--source", default=str(DEFAULT_SOURCE), help="the solution notebooks (default: notebooks/labs)")
    g = lsub.add_parser("grade", help="grade a lab notebook or a folder of them")
    g.add_argument("path", help="a notebook or a folder of notebooks")
    g.add_argument("--junit", metavar="FILE", help="also write JUnit XML here")


def run(args) -> int:
    from . import notebooks
    if args.labs_command == "student":
        src = Path(args.source)
        if not src.exists():
            print(f"labs student: --source {src} does not exist")
            return 2
        for path in notebooks.write_student_copies(src, args.outdir):
            print(path)
        return 0
    grades = notebooks.grade_path(args.path)
    if not grades:
        print(f"labs grade: no notebooks under {args.path}")
        return 2
    print(notebooks.score_table(grades))
    if args.junit:
        Path(args.junit).write_text(notebooks.junit_xml(grades), encoding="utf-8")
    ok = all(r.status != "failed" for g in grades for r in g.results)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iokernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))
