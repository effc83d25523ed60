"""Every notebook executes top to bottom; none is committed with outputs; none defines logic.

The notebooks run with nbclient on the ``python3`` kernel, two at a time (CI has two
cores): a module fixture starts them all, and each notebook's test waits for its own.
Each notebook runs in a child process of its own (``python -c`` running nbclient), under
a hard wall-clock limit, so two clients never share ZeroMQ sockets or an event loop.

What keeps the runs from stalling:

* the stall once seen: a cell (notebook 00's widget cell, which sends many messages at
  once) "took" exactly the cell timeout and then succeeded.  nbclient waits for a reply
  with one ZeroMQ poll over the whole timeout; when that poll misses its wake-up (the
  reply had arrived; the poll only looks again when it times out), the notebook sits idle
  until the deadline.  The child process therefore polls in slices of POLL_SLICE_S
  seconds: a missed wake-up costs at most one slice;
* one warm-up kernel runs first, alone: it imports matplotlib (building its font cache
  on a fresh machine), ipywidgets and the package, so two notebooks starting at once
  never both build caches;
* kernels talk over IPC sockets in a folder of their own, never TCP: two kernels started
  at the same moment cannot pick the same port (jupyter_client picks a free TCP port by
  binding and releasing it, which races with another kernel starting);
* a kernel that fails to start is started once more (reported);
* each cell has a timeout equal to the notebook's budget, and the child reports the time
  of every cell, so a slow or stalled notebook names its cell.

The kernel inherits this process's environment, in which the conftest has switched
Numba's CUDA simulator on when there is no GPU; PYTHONPATH points at the checkout so
the kernel imports this copy of the package.
"""
from __future__ import annotations

import ast
import json
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
#: notebooks run at once: one per core on CI's two cores
PARALLEL = 2
#: a notebook may define a tiny helper (a formatter, a lambda-sized function), nothing longer:
#: logic belongs in the package, where it is tested
MAX_DEF_LINES = 3
#: each notebook must run in this long on two cores, kernel start-up excluded
NOTEBOOK_BUDGET_S = 120
#: seconds one cell may take before the run stops and names it
CELL_TIMEOUT_S = NOTEBOOK_BUDGET_S
#: seconds a kernel may take to start (then it is started once more)
STARTUP_TIMEOUT_S = 60
#: the whole child process, start-up and retry included; past this it is killed and fails
NOTEBOOK_HARD_LIMIT_S = 2 * STARTUP_TIMEOUT_S + NOTEBOOK_BUDGET_S + 60
#: the longest single ZeroMQ poll of the notebook client (see the module docstring)
POLL_SLICE_S = 1.0
#: how instructors and contributors strip outputs after running a notebook in JupyterLab
STRIP_ADVICE = "strip outputs with `bash dev.sh strip` (every notebook, in place)"


def _ids(paths):
    return [p.stem for p in paths]


#: what the child process runs: execute one notebook (argv: path, cell timeout, startup
#: timeout, cwd), print one JSON line of timings on stdout, exit 1 with the error on stderr
_RUNNER = r"""
import json, os, sys, tempfile, time
import nbformat, nbclient
from traitlets.config import Config
import queue
from jupyter_client.channels import AsyncZMQSocketChannel
path, timeout, startup, cwd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
poll_slice = float(sys.argv[5])
_get_msg = AsyncZMQSocketChannel.get_msg


async def sliced_get_msg(self, timeout=None):   # one missed ZeroMQ wake-up costs one slice, not the timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = poll_slice if deadline is None else min(poll_slice, max(0.0, deadline - time.monotonic()))
        try:
            return await _get_msg(self, timeout=left)
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline:
                raise


AsyncZMQSocketChannel.get_msg = sliced_get_msg
config = Config()
if os.name == "posix":                      # IPC sockets in a folder of this run's own
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = os.path.join(tempfile.mkdtemp(prefix="nbkernel-"), "kernel")
report = {"retried": 0, "cells": []}
t0 = time.perf_counter()
for attempt in (1, 2):
    nb = nbformat.read(path, as_version=4)
    started = {}
    client = nbclient.NotebookClient(
        nb, timeout=timeout, startup_timeout=startup, kernel_name="python3", config=config,
        shutdown_kernel="immediate",                # the run is over: no graceful wait
        resources={"metadata": {"path": cwd}},
        on_notebook_start=lambda notebook: report.__setitem__("startup_s", time.perf_counter() - t0),
        on_cell_start=lambda cell, cell_index: started.__setitem__(cell_index, time.perf_counter()),
        on_cell_executed=lambda cell, cell_index, execute_reply: report["cells"].append(
            [cell_index, round(time.perf_counter() - started[cell_index], 2),
             (cell.source.splitlines() or [""])[0][:60]]))
    try:
        client.execute()
        break
    except Exception as e:
        stalled = sorted(set(started) - {c[0] for c in report["cells"]})
        if started or attempt == 2:             # a cell ran, or the retry failed too: report
            if stalled:
                i = stalled[0]
                print(f"stalled or failed in cell {i}: {nb.cells[i].source.splitlines()[:1]}", file=sys.stderr)
            print(json.dumps(report))
            raise
        report["retried"] += 1                  # the kernel did not start: once more
        print(f"kernel start failed ({type(e).__name__}: {e}); starting it again", file=sys.stderr)
        t0 = time.perf_counter()
report["cells_s"] = round(sum(c[1] for c in report["cells"]), 2)
if len(sys.argv) > 6:                       # keep the executed notebook, outputs and all
    nbformat.write(nb, sys.argv[6])
print(json.dumps(report))
"""

#: the warm-up the fixture runs once, alone, before the notebooks
_WARMUP = "import matplotlib.pyplot, ipywidgets, iokernels, iokernels.viz.figures"


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _execute(path: Path, save_to: Path | None = None):
    """Run one notebook in a child process; returns (cell seconds, report, error or None).
    ``save_to``: write the executed notebook there (the labs' tests read its check cells)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path), str(CELL_TIMEOUT_S),
                               str(STARTUP_TIMEOUT_S), str(path.parent), str(POLL_SLICE_S),
                               *([str(save_to)] if save_to is not None else [])],
                              env=_child_env(), capture_output=True, text=True, timeout=NOTEBOOK_HARD_LIMIT_S)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, {}, f"killed after {NOTEBOOK_HARD_LIMIT_S} s (hung or far too slow)"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0:   # CellExecutionError's message carries the failing cell and traceback
        return report.get("cells_s", time.perf_counter() - t0), report, (proc.stderr or proc.stdout)[-6000:]
    return report.get("cells_s", time.perf_counter() - t0), report, None


def _slowest(report, n=3) -> str:
    cells = sorted(report.get("cells", []), key=lambda c: -c[1])[:n]
    start = report.get("startup_s")
    head = f"kernel start {start:.1f} s; " if start is not None else ""
    return head + "slowest cells: " + "; ".join(f"cell {i} {s:.1f} s ({src!r})" for i, s, src in cells)


@pytest.fixture(scope="module")
def executions(request):
    """{notebook path: Future of (seconds, report, error)}: a warm-up first, then the notebooks
    whose tests were selected (all by default), PARALLEL at a time."""
    selected = [p for p in NOTEBOOKS if any(
        getattr(item, "originalname", "") == "test_notebook_executes" and item.callspec.params.get("path") == p
        for item in request.session.items)]
    subprocess.run([sys.executable, "-c", _WARMUP], env=_child_env(), capture_output=True,
                   timeout=NOTEBOOK_HARD_LIMIT_S)
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {p: pool.submit(_execute, p) for p in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    for required in ("00_memory_hierarchy_roofline.ipynb", "01_naive_attention.ipynb",
                     "02_online_softmax.ipynb", "03_tiled_flash_attention.ipynb",
                     "11_what_goes_wrong.ipynb"):
        assert required in names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_executes(path, executions):
    seconds, report, error = executions[path].result()
    assert error is None, f"{path.name} failed after {seconds:.0f} s ({_slowest(report)}):\n{error}"
    assert seconds < NOTEBOOK_BUDGET_S, f"{path.name}'s cells took {seconds:.0f} s: {_slowest(report)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.get("outputs", []) == [], f"{path.name} cell {i} has outputs: {STRIP_ADVICE}"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count: {STRIP_ADVICE}"
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
