"""Every notebook executes top to bottom; none is committed with outputs; none defines logic.

The notebooks run with nbclient on the ``python3`` kernel, two at a time (CI has two
cores): a module fixture starts them all, and each notebook's test waits for its own.
Each notebook runs in a child process of its own (``python -c`` running nbclient), under
a hard wall-clock limit: two nbclient clients driven from threads of one process once
stalled for good with both kernel and client idle (seen in a CI run on this machine),
and a separate process per notebook keeps their ZeroMQ sockets and event loops apart.
The kernel inherits this process's environment, in which the conftest has switched
Numba's CUDA simulator on when there is no GPU; PYTHONPATH points at the checkout so
the kernel imports this copy of the package.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: seconds one cell may take (the Numba simulator cells are the slow ones)
CELL_TIMEOUT_S = 300
#: notebooks run at once: one per core on CI's two cores
PARALLEL = 2
#: a notebook may define a tiny helper (a formatter, a lambda-sized function), nothing longer:
#: logic belongs in the package, where it is tested
MAX_DEF_LINES = 3
#: each notebook should run in about this long on two cores (reported, and asserted loosely)
NOTEBOOK_BUDGET_S = 120


def _ids(paths):
    return [p.stem for p in paths]


#: the whole notebook, start-up included, in its own process; past this it is killed and fails
NOTEBOOK_HARD_LIMIT_S = 420

#: what the child process runs: execute one notebook with nbclient, exit 1 with the error
_RUNNER = """
import sys, nbformat, nbclient
path, timeout = sys.argv[1], int(sys.argv[2])
nb = nbformat.read(path, as_version=4)
client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                 resources={"metadata": {"path": sys.argv[3]}})
client.execute()
"""


def _execute(path: Path):
    """Run one notebook in a child process; returns (seconds, error or None)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path), str(CELL_TIMEOUT_S), str(path.parent)],
                              env=env, capture_output=True, text=True, timeout=NOTEBOOK_HARD_LIMIT_S)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, f"killed after {NOTEBOOK_HARD_LIMIT_S} s (hung or far too slow)"
    if proc.returncode != 0:   # CellExecutionError's message carries the failing cell and traceback
        return time.perf_counter() - t0, (proc.stderr or proc.stdout)[-6000:]
    return time.perf_counter() - t0, None


@pytest.fixture(scope="module")
def executions():
    """{notebook path: Future of (seconds, error)}, all started at once, PARALLEL at a time."""
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {p: pool.submit(_execute, p) for p in NOTEBOOKS}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    for required in ("00_memory_hierarchy_roofline.ipynb", "01_naive_attention.ipynb",
                     "02_online_softmax.ipynb", "03_tiled_flash_attention.ipynb"):
        assert required in names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_executes(path, executions):
    seconds, error = executions[path].result()
    assert error is None, f"{path.name} failed after {seconds:.0f} s:\n{error}"
    assert seconds < NOTEBOOK_BUDGET_S, f"{path.name} took {seconds:.0f} s"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.get("outputs", []) == [], f"{path.name} cell {i} has outputs: strip them"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
    assert nb.metadata.get("kernelspec", {}).get("name", "python3") == "python3"


def _code(cell_source: str) -> str:
    """Cell source with IPython magics and shell lines blanked (so ast can parse it)."""
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in cell_source.splitlines())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_defines_no_logic(path):
    """Kernels and algorithms live in the package: no classes, no functions over a few lines."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(_code(cell.source))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                pytest.fail(f"{path.name} cell {i} defines class {node.name}: move it into iokernels/")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= MAX_DEF_LINES, (
                    f"{path.name} cell {i} defines {node.name}() of {length} lines: move it into iokernels/")
