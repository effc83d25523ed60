"""Notebooks 09a-13 in a real JupyterLab, driven by headless Chromium, as a learner opens them.

For each notebook: open it, wait for its kernel, and check what a learner sees before
anything runs: no news pop-up (dev.sh setup's settings overrides switch JupyterLab's news
off) and no "modified" mark on the notebook (its kernel metadata is what JupyterLab writes
on open: :mod:`iokernels.notebook_meta`).  Then Run All Cells, wait until every code cell
has run, and check that no cell shows an error.

The JupyterLab server and Chromium come from tests/browser_support.py (one server
for the module; Debian's Chromium through Playwright's executable_path, never a downloaded
browser).  Each notebook is uploaded as committed, through the server's contents API.  With
a Python other than the one the notebooks name (notebook_meta.PYTHON_VERSION), JupyterLab
writes its own version on open, so the copy uploaded names this kernel's version instead.
"""
from __future__ import annotations

import json
import platform
import sys

import pytest

from iokernels import notebook_meta as nm

from browser_support import ROOT, WAIT_IDLE, browser_page, chromium, lab, upload  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

COURSE = ("09a_hopper_asynchrony", "09b_low_precision", "10_pytorch_sdpa", "11_what_goes_wrong",
          "12_context_parallel", "13_decode_for_real_models")
#: opening a notebook and starting its kernel
OPEN_TIMEOUT_MS = 120_000
#: Run All Cells of one notebook in the browser (the notebook test's budget, and a margin)
RUN_TIMEOUT_MS = 300_000
#: how long after the kernel is idle a late toast or metadata change may still appear
SETTLE_MS = 2_000
#: JupyterLab's settings overrides that dev.sh setup writes inside the venv
OVERRIDES = f"{sys.prefix}/share/jupyter/lab/settings/overrides.json"

_CURRENT = """(path) => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    return !!(w && w.context && w.context.path === path && w.content && w.content.widgets.length); }"""

_STATE = """() => { const w = window.jupyterapp.shell.currentWidget;
    return { dirty: w.model.dirty,
             dirtyTabs: document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty').length,
             toasts: [...document.querySelectorAll('.Toastify__toast')].map(e => e.innerText) }; }"""

_ALL_RAN = """() => { const w = window.jupyterapp.shell.currentWidget;
    const k = w.sessionContext.session && w.sessionContext.session.kernel;
    if (!k || k.status !== 'idle') return false;
    const failed = w.content.widgets.some(c => c.model.type === 'code' &&   // Run All stops at an error
        [...Array(c.model.outputs.length).keys()].some(j => c.model.outputs.get(j).type === 'error'));
    return failed || w.content.widgets.every(c => c.model.type !== 'code' ||
        (c.model.executionCount !== null && !c.node.querySelector('.jp-InputPrompt')?.innerText.includes('*'))); }"""

_ERRORS = """() => { const w = window.jupyterapp.shell.currentWidget; const bad = [];
    w.content.widgets.forEach((c, i) => { if (c.model.type !== 'code') return;
        for (let j = 0; j < c.model.outputs.length; j++) { const o = c.model.outputs.get(j).toJSON();
            const text = [].concat(o.text || []).join('');
            if (o.output_type === 'error') bad.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
            else if (o.name === 'stderr' && text.includes('Traceback')) bad.push(`cell ${i}: ${text.slice(0, 300)}`);
        } });
    return bad; }"""


def _upload_text(name: str) -> dict:
    text = (ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8")
    version = platform.python_version()
    if version != nm.PYTHON_VERSION:          # JupyterLab will write this kernel's version
        text = nm.normalise_text(text, version)
    return json.loads(text)


def test_the_setup_switches_jupyterlabs_news_off():
    try:
        with open(OVERRIDES, encoding="utf-8") as f:
            overrides = json.load(f)
    except FileNotFoundError:
        pytest.fail(f"{OVERRIDES} is missing: run `bash dev.sh setup`")
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


@pytest.mark.parametrize("name", COURSE)
def test_notebook_opens_clean_and_runs_without_error(chromium, lab, tmp_path, name):  # noqa: F811
    upload(lab, f"{name}.ipynb", _upload_text(name))
    with browser_page(chromium, tmp_path / "chromium-profile", OPEN_TIMEOUT_MS) as page:
        try:
            # ?reset: a fresh workspace, so the notebooks of earlier tests do not reopen beside it
            page.goto(f"{lab['url']}/lab/tree/{name}.ipynb?reset&token={lab['token']}")
            page.wait_for_function(_CURRENT, arg=f"{name}.ipynb")
            page.wait_for_function(WAIT_IDLE)
            page.wait_for_timeout(SETTLE_MS)
            state = page.evaluate(_STATE)
            assert not [t for t in state["toasts"] if "news" in t.lower()], f"news pop-up: {state['toasts']}"
            assert not state["dirty"] and not state["dirtyTabs"], \
                f"{name} is marked modified on open, before anything ran (kernel metadata?)"

            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(_ALL_RAN, timeout=RUN_TIMEOUT_MS, polling=1000)
            errors = page.evaluate(_ERRORS)
            assert not errors, f"{name}: " + "\n".join(errors)
        finally:
            try:     # stop this notebook's kernel and close it: the next notebook gets the CPU
                page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
                page.evaluate("() => window.jupyterapp.commands.execute('application:close-all')")
            except Exception:
                pass
