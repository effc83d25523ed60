"""A lab in a real JupyterLab, driven by headless Chromium: run it, fill in the stub, see green.

What a learner does: open the learner copy of lab 02, Run All Cells, see the check cell say
NOT YET (red), write the online-softmax step into the stub, run again, and see PASSED (green).
The stub is filled in through JupyterLab's own notebook model (``window.jupyterapp``), the
way an editor change reaches the kernel; the check cell's output is then read from the page.

The JupyterLab server and Chromium come from tests/browser_support.py (Debian's
Chromium through Playwright's executable_path; never a downloaded browser). The learner copy
is uploaded through the server's contents API.
"""
from __future__ import annotations

import json

import pytest

from iokernels.labs import notebooks as lnb

from browser_support import ROOT, WAIT_IDLE, browser_page, chromium, lab, upload  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LAB = ROOT / "notebooks" / "labs" / "02_online_softmax_step.ipynb"
NAME = "lab02_learner.ipynb"
#: the check cell's output element, by its verdict (classes set by iokernels.labs.engine.Result)
FAILED, PASSED = ".iokernels-lab-failed", ".iokernels-lab-passed"
#: the background a passing check shows (engine.Result._repr_html_)
GREEN = "rgb(230, 244, 234)"


def _solution_of(nb: dict, marker: str) -> str:
    """The solution cell's source that contains ``marker``."""
    sources = ("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return next(s for s in sources if marker in s)


_FILL_STUB = """(src) => { const nb = window.jupyterapp.shell.currentWidget.content;
    for (const cell of nb.widgets) {
        const s = cell.model.sharedModel.getSource();
        if (s.includes('NotImplementedError')) { cell.model.sharedModel.setSource(src); return true; }
    }
    return false; }"""


def test_lab_stub_filled_in_turns_the_check_green(chromium, lab, tmp_path):  # noqa: F811
    solution_nb = json.loads(LAB.read_text())
    learner_nb = lnb.student_notebook(solution_nb)
    assert "NotImplementedError" in json.dumps(learner_nb)
    upload(lab, NAME, learner_nb)
    solution = _solution_of(solution_nb, "def online_step")
    with browser_page(chromium, tmp_path / "chromium-profile") as page:
        page.goto(f"{lab['url']}/lab/tree/{NAME}?token={lab['token']}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function(WAIT_IDLE)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_selector(FAILED)                       # the stub: NOT YET, in red
        assert "not written yet" in page.locator(FAILED).first.inner_text()
        assert page.locator(PASSED).count() == 0

        assert page.evaluate(_FILL_STUB, solution), "no stub cell found in the learner copy"
        page.wait_for_function(WAIT_IDLE)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_selector(PASSED)                       # filled in: PASSED, in green
        out = page.locator(PASSED).first
        assert "PASSED" in out.inner_text() and "online_step" in out.inner_text()
        assert out.evaluate("e => getComputedStyle(e).backgroundColor") == GREEN
        assert page.locator(FAILED).count() == 0
        assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                has_text="Traceback").count()
