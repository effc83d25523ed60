"""The code and notebooks speak to a reader who has only the clone.

Measured figures (times, rates, same-run ratios) live in benchmarks/results and the tables
generated from them, never in docstrings, comments, .cu headers or notebook prose: they go
stale the moment a kernel changes, and a reader cannot tell which run they came from.  Nor
does anything speak of issues, bars, a steering folder or the times of past runs.

Datasheet and paper figures are facts the lessons teach, with their source beside them;
they live in the data modules listed in CITED_DATA, which this check leaves alone.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: modules whose numbers are cited datasheet or paper figures (each with its source)
CITED_DATA = {"iokernels/core/roofline.py", "iokernels/models.py",
              "iokernels/hopper_schedule.py", "iokernels/fp8.py"}

MEASURED = re.compile(r"\b\d+(\.\d+)?\s*(TFLOP/s|TB/s|GB/s)|\b0\.\d{2,3}x\b"
                      r"|\b\d+(\.\d+)?\s*(ms|us|µs)\b(?! [a-z]*budget)")
RATIO_OR_TIME = re.compile(r"\b0\.\d{2,3}x\b|\b\d+\.\d+\s*ms\b")
BUILDER_VOICE = re.compile(r"\bthe issue\b|\bissue #?\d|\bbars? (met|short|missed)\b|\.\./shared|DESIGN\.md"
                           r"|\b\d\d:\d\d UTC\b|\bticket\b", re.I)


def _code_files():
    for p in sorted((ROOT / "iokernels").rglob("*")):
        if p.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in p.parts:
            yield p


def test_no_measured_figures_or_builder_voice_in_the_code():
    hits = []
    for p in _code_files():
        rel = str(p.relative_to(ROOT))
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if BUILDER_VOICE.search(line):
                hits.append(f"{rel}:{i}: {line.strip()[:100]}")
            elif rel not in CITED_DATA and MEASURED.search(line) and not _is_code_constant(line) \
                    and "datasheet" not in line:          # a bound worked from a cited datasheet figure
                hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not hits, "measured figures or builder's voice in the code:\n" + "\n".join(hits[:40])


def _is_code_constant(line: str) -> bool:
    """A named setting in code (``LAUNCH_SLACK_US = 1000``), not a measurement in prose."""
    s = line.strip()
    return bool(re.match(r"^[A-Za-z_][A-Za-z_0-9]*\s*=", s)) and "#" not in s


def test_no_measured_figures_or_builder_voice_in_notebook_prose():
    hits = []
    for p in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        for j, c in enumerate(cells):
            if c["cell_type"] != "markdown":
                continue
            text = "".join(c["source"])
            for pat in (BUILDER_VOICE, RATIO_OR_TIME):
                m = pat.search(text)
                if m:
                    hits.append(f"{p.relative_to(ROOT)} cell {j}: ...{text[max(0, m.start() - 40):m.end() + 20]!r}")
    assert not hits, "measured figures or builder's voice in notebook prose:\n" + "\n".join(hits[:40])


def test_readme_outside_the_generated_table():
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- recorded-results:start -->", "<!-- recorded-results:end -->"
    if start in text:
        text = text[:text.index(start)] + text[text.index(end) + len(end):]
    text = re.sub(r"```text\n.*?```", "", text, flags=re.S)     # program output (the tour's), not prose
    hits = [m.group(0) for pat in (BUILDER_VOICE, RATIO_OR_TIME) for m in pat.finditer(text)]
    assert not hits, f"README prose quotes measurements or speaks of issues: {hits[:10]}"
