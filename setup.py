"""The build's one addition to pyproject.toml: data that lives outside the package in a
checkout travels inside the wheel.

- ``benchmarks/results/*`` (the recorded GPU runs that notebooks, the figures and the README
  tables read through :mod:`iokernels.core.recorded`) -> ``iokernels/data/results/``
- ``notebooks/labs/*.ipynb`` (the lab notebooks, the source of the learners' copies)
  -> ``iokernels/data/labs/``

A checkout reads them where they are (so nothing is duplicated in git); an installed wheel
reads these copies.  ``python -m build`` makes the sdist first (MANIFEST.in puts both folders
in it) and the wheel from the sdist, so this runs on the sdist's files too.  An editable
install copies nothing: it runs from the checkout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
#: (source folder in the checkout, file pattern, destination inside the package)
COPIES = [("benchmarks/results", "*.json", "data/results"),
          ("benchmarks/results", "*.txt", "data/results"),
          ("notebooks/labs", "*.ipynb", "data/labs")]


class build_py_with_data(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for src, pattern, dest in COPIES:
            files = sorted((HERE / src).glob(pattern))
            if not files:
                raise SystemExit(f"setup.py: no {pattern} under {src}: the wheel would lack them")
            out = Path(self.build_lib) / "iokernels" / dest
            out.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copy2(f, out / f.name)


setup(cmdclass={"build_py": build_py_with_data})
