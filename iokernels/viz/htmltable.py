"""A small table that shows as HTML in a notebook and as aligned text anywhere else.

No pandas: a header, rows of cells, an optional caption (what the table is, and where its
numbers come from) and an optional note shown when there are no rows.  Text cells wrap
between words only; number cells never wrap.
"""
from __future__ import annotations

import html
import re

__all__ = ["Table"]

_NUMBER = re.compile(r"^[-+~]?[\d.,]+(e[-+]?\d+)?\s*(%|x|s|us)?$")


class Table:
    """``Table(header, rows, caption=None, note=None)``: display it (``_repr_html_``) or print it."""

    def __init__(self, header, rows, caption: str | None = None, note: str | None = None):
        self.header = tuple(str(h) for h in header)
        self.rows = [tuple("" if c is None else str(c) for c in row) for row in rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.header):
                raise ValueError(f"rows: row {i} has {len(row)} cells, the header {len(self.header)}")
        self.caption, self.note = caption, note

    def column(self, name: str) -> list[str]:
        """The cells of one column, by its header."""
        if name not in self.header:
            raise ValueError(f"name: expected one of {', '.join(self.header)}, got {name!r}")
        i = self.header.index(name)
        return [r[i] for r in self.rows]

    def _repr_html_(self) -> str:
        out = []
        if self.caption:
            out.append(f"<p style='margin:4px 0'><b>{html.escape(self.caption)}</b></p>")
        if not self.rows:
            out.append(f"<p>{html.escape(self.note or 'no rows')}</p>")
            return "".join(out)
        cell = "padding:2px 8px;border-bottom:1px solid #ddd;vertical-align:top;"
        out.append("<table style='border-collapse:collapse'><tr>"
                   + "".join(f"<th style='{cell}text-align:left;word-break:normal'>{html.escape(h)}</th>"
                             for h in self.header) + "</tr>")
        for row in self.rows:
            tds = []
            for c in row:
                if _NUMBER.match(c) or c in ("-", ""):
                    tds.append(f"<td style='{cell}text-align:right;white-space:nowrap'>{html.escape(c)}</td>")
                else:
                    tds.append(f"<td style='{cell}text-align:left;word-break:normal;overflow-wrap:normal'>"
                               f"{html.escape(c)}</td>")
            out.append("<tr>" + "".join(tds) + "</tr>")
        out.append("</table>")
        if self.note:
            out.append(f"<p style='font-size:90%'>{html.escape(self.note)}</p>")
        return "".join(out)

    def __str__(self) -> str:
        lines = [self.caption] if self.caption else []
        if not self.rows:
            return "\n".join(lines + [self.note or "no rows"])
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(self.header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(self.header, widths)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in self.rows]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def __contains__(self, text) -> bool:
        return str(text) in str(self)
