"""One record per kernel version, written once next to its launcher.

A :class:`Record` names everything about one version of one op of one backend: the file
that holds the kernel (a ``.cu`` file under ``cupy_raw/kernels/`` or a Python module), the
kernel's name in it, the config class it takes, the check that says why it cannot run a
call (or None), its rank among the versions whose check passes, a one-line summary, the
launcher, the argument builder (the kernel's parameter list from a launch's values, where
the backend has one), anything else the backend's launch reads (``extra``) and, for a
version that runs a call only when a config names it, the check that keeps the default from
picking it (``default_check``: a call it can run but that it has not been measured on).

Each backend's modules end with a ``RECORDS`` tuple and one ``REGISTRY.add(*RECORDS)``
(:class:`iokernels.core.registry.Registry`); the dispatch, the sanitizer cases, the GPU
tests and the version tables in the docstrings and the README (:func:`version_table`,
between the markers :func:`sync_tables` keeps in step) all read the records.
"""
from __future__ import annotations

import pathlib
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Record:
    """One version of one op of one backend."""

    backend: str
    op: str
    version: str
    file: str                      # the kernel's source: "fa_v2.cu", "numba_cuda/decode.py"
    kernel: str                    # the kernel function's name in that file
    config_class: type
    launcher: Callable
    summary: str
    check: Callable[[Any], str | None] | None = None
    rank: int = 0                  # higher wins among the versions whose check passes
    args: Callable | None = None   # the kernel's argument tuple from a launch's values
    extra: dict = field(default_factory=dict, compare=False)
    default_check: Callable[[Any], str | None] | None = None

    def unavailable(self, need) -> str | None:
        """None when this version can run the call described by ``need``, else why not."""
        return self.check(need) if self.check is not None else None

    def not_default(self, need) -> str | None:
        """None when the default may pick this version for ``need`` (it can run it, and
        ``default_check`` lets it), else why not; a config naming the version still runs it
        where only ``default_check`` objects."""
        why = self.unavailable(need)
        if why is None and self.default_check is not None:
            why = self.default_check(need)
        return why

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.op}:{self.version}"


def held_back_reason(table: dict, op: str, version: str) -> str | None:
    """Why the registry's default does not pick ``version`` of ``op`` yet -- ``table`` maps (op,
    version) to what has to be measured first (each backend keeps its table with its policy) --
    or None.  A config naming the version still runs it."""
    wait = table.get((op, version))
    return None if wait is None else f"not the default until measured ({wait}); a config naming it runs it"


# --------------------------------------------------------------------------- generated tables
#: a generated docstring table is at most this wide (the last column wraps)
TABLE_WIDTH = 110


def _rst(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    """A reStructuredText simple table; the last column wraps onto lines whose other cells are empty."""
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    last = max(20, TABLE_WIDTH - sum(w + 2 for w in widths))
    widths.append(min(last, max(len(r[-1]) for r in rows + [header])))
    rule = "  ".join("=" * w for w in widths)

    def lines(r):
        first, *more = textwrap.wrap(r[-1], widths[-1]) or [""]
        out = ["  ".join(c.ljust(w) for c, w in zip((*r[:-1], first), widths)).rstrip()]
        pad = "  ".join(" " * w for w in widths[:-1])
        return out + [f"{pad}  {m}" for m in more]
    return "\n".join([rule, *lines(header), rule, *(x for r in rows for x in lines(r)), rule])


def _markdown(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def version_table(records: Iterable[Record], fmt: str = "rst") -> str:
    """The version table of ``records`` (op, version, file, rank, summary), in reStructuredText
    (``fmt="rst"``, for docstrings) or Markdown (``"md"``, for the README).  One kernel serving
    several ops (decode over a contiguous and a paged cache) is one row naming them all."""
    rows: dict[tuple, list[str]] = {}
    for r in records:
        rows.setdefault((r.version, r.file, r.kernel, r.rank, r.summary), []).append(r.op)
    header = ("op", "version", "file", "rank", "what it adds")
    quote = "`" if fmt == "md" else ""
    table: list[tuple[str, ...]] = [(", ".join(ops), v, f"{quote}{file}{quote}", str(rank), summary)
                                    for (v, file, _, rank, summary), ops in rows.items()]
    return _markdown(table, header) if fmt == "md" else _rst(table, header)


def _marker(tag: str) -> tuple[str, str]:
    return f"versions:{tag}:begin", f"versions:{tag}:end"


def between(text: str, tag: str) -> str | None:
    """What ``text`` holds between the lines with the markers of ``tag`` (None: no markers)."""
    begin, end = _marker(tag)
    m = re.search(rf"^[^\n]*{re.escape(begin)}[^\n]*\n(.*?)^[^\n]*{re.escape(end)}", text, re.S | re.M)
    return None if m is None else m.group(1).rstrip("\n")


def replace_between(text: str, tag: str, body: str) -> str:
    """``text`` with what lies between the markers of ``tag`` replaced by ``body``."""
    begin, end = _marker(tag)
    pat = re.compile(rf"(^[^\n]*{re.escape(begin)}[^\n]*\n)(.*?)(^[^\n]*{re.escape(end)})", re.S | re.M)
    if not pat.search(text):
        raise ValueError(f"tag: no {begin} / {end} markers")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def sync_tables(targets: Iterable[tuple[pathlib.Path, str, str]], write: bool = False) -> list[str]:
    """Each (file, tag, generated table): the files whose table differs from the generated one
    (with ``write``: rewritten, and still listed)."""
    stale = []
    for path, tag, table in targets:
        text = path.read_text()
        if between(text, tag) != table:
            stale.append(f"{path.name} [{tag}]")
            if write:
                path.write_text(replace_between(text, tag, table))
    return stale
