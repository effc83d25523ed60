"""Notebook metadata exactly as JupyterLab writes it, so a notebook opens unmodified.

When JupyterLab opens a notebook and its kernel starts, it copies the kernel's spec and
the kernel's ``language_info`` (from the kernel's info reply) into the notebook's
metadata; if they differ from what the file holds, the notebook is marked modified before
anything has run.  Opening the project's notebooks in JupyterLab 4 with the set-up's
``python3`` kernel (``bash dev.sh setup``: display name "Python 3 (iokernels)"), and saving
them, gives the metadata in :data:`KERNELSPEC` and :func:`language_info`; a notebook that
holds exactly that opens clean.  ``language_info.version`` is the kernel's Python version:
committed for :data:`PYTHON_VERSION`, so with another Python, JupyterLab still writes its own
version on open.

``python -m iokernels.notebook_meta [PATH ...]`` normalises the notebooks in place (default:
every notebook under notebooks/, recursively); ``--check`` only lists those that are not.
Only the top-level ``"metadata"`` block of the file changes: the rest of the text, cells
included, is kept byte for byte.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["KERNELSPEC", "PYTHON_VERSION", "language_info", "normalised_metadata", "normalise_text",
           "notebook_paths", "main"]

#: the kernelspec of the set-up's kernel (dev.sh: ipykernel install --name python3
#: --display-name "Python 3 (iokernels)")
KERNELSPEC = {"display_name": "Python 3 (iokernels)", "language": "python", "name": "python3"}
#: the Python version the committed notebooks name (the set-up's interpreter)
PYTHON_VERSION = "3.11.7"
#: the notebook-level keys JupyterLab sets from the kernel; any other key is kept as it is
KERNEL_KEYS = ("kernelspec", "language_info")


def language_info(version: str = PYTHON_VERSION) -> dict:
    """ipykernel's ``language_info`` for a Python ``version``, as JupyterLab stores it."""
    if not isinstance(version, str) or not version[:1].isdigit():
        raise ValueError(f"version: expected a Python version such as '3.11.7', got {version!r}")
    return {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
            "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
            "pygments_lexer": "ipython3", "version": version}


def normalised_metadata(metadata: dict, version: str = PYTHON_VERSION) -> dict:
    """``metadata`` with the kernel keys JupyterLab writes on open, other keys untouched."""
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata: expected a dict, got {type(metadata).__name__}")
    out = {k: v for k, v in metadata.items() if k not in KERNEL_KEYS}
    out["kernelspec"] = dict(KERNELSPEC)
    out["language_info"] = language_info(version)
    return out


def _dump(value, indent: int, level: int) -> str:
    """``value`` as nbformat writes it (sorted keys, non-ASCII kept), nested ``level`` deep."""
    text = json.dumps(value, indent=indent, sort_keys=True, ensure_ascii=False)
    return text.replace("\n", "\n" + " " * (indent * level))


def normalise_text(text: str, version: str = PYTHON_VERSION) -> str:
    """The notebook file's text with its top-level metadata normalised; nothing else changes.

    The top-level ``"metadata"`` value is found at one level of indentation (as nbformat
    writes a notebook, indent=1) and replaced in place; a file laid out otherwise is
    rewritten whole, the way nbformat writes one.
    """
    nb = json.loads(text)
    if not isinstance(nb, dict) or "cells" not in nb:
        raise ValueError("text: not a notebook (no top-level 'cells')")
    want = normalised_metadata(nb.get("metadata", {}), version)
    key = '\n "metadata": '
    start = text.find(key)
    if start >= 0:
        begin = start + len(key)
        try:
            value, end = json.JSONDecoder().raw_decode(text, begin)
        except json.JSONDecodeError:
            value, end = None, begin
        if value == nb.get("metadata"):
            new = text[:begin] + _dump(want, 1, 1) + text[end:]
            if json.loads(new) == dict(nb, metadata=want):
                return new
    return json.dumps(dict(nb, metadata=want), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def notebook_paths(paths) -> list[Path]:
    """Every .ipynb named, or under a folder named (recursively), sorted; checkpoints left out."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.suffix == ".ipynb":
            out.append(p)
        else:
            raise ValueError(f"paths: {p} is neither a folder nor a .ipynb file")
    return sorted(set(out))


def main(argv=None) -> int:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(prog="python -m iokernels.notebook_meta",
                                     description="Normalise notebooks' kernel metadata to what JupyterLab writes.")
    parser.add_argument("paths", nargs="*", default=[str(root / "notebooks")],
                        help="notebooks or folders (default: notebooks/, recursively)")
    parser.add_argument("--check", action="store_true", help="list the notebooks that are not normalised; change none")
    args = parser.parse_args(argv)
    stale = []
    for path in notebook_paths(args.paths):
        text = path.read_text(encoding="utf-8")
        new = normalise_text(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
            print(f"{'not normalised' if args.check else 'normalised'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
