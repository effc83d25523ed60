"""Notebook 00 in a real JupyterLab, driven by headless Chromium: run it, move a slider.

What a student does: open the notebook in JupyterLab, Run > Run All Cells, drag the N
slider of the roofline calculator, and see the numbers change.  Debian's Chromium and the JupyterLab server
come from tests/browser_support.py.
"""
from __future__ import annotations

import time

import pytest

from browser_support import APT_TIMEOUT_S, NOTEBOOK, WAIT_IDLE, browser_page, chromium, lab  # noqa: F401

#: the first run on a fresh machine may install Chromium with apt-get inside the fixture
pytestmark = [pytest.mark.slow, pytest.mark.timeout(APT_TIMEOUT_S + 300)]


def _calculator_text(page) -> str:
    """The roofline calculator's table (an ipywidgets HTML widget holding 'GFLOP')."""
    return page.locator(".widget-html-content", has_text="GFLOP").first.inner_text()


def test_notebook00_slider_changes_the_numbers(chromium, lab, tmp_path):  # noqa: F811
    with browser_page(chromium, tmp_path / "chromium-profile") as page:
        page.goto(f"{lab['url']}/lab/tree/{NOTEBOOK.name}?token={lab['token']}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        # wait for the kernel, then Run > Run All Cells, as a user would
        page.wait_for_function(WAIT_IDLE)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

        page.wait_for_selector(".widget-html-content:has-text('GFLOP')")
        before = _calculator_text(page)
        assert "8.59 GFLOP" in before, before       # the article's problem on opening
        assert "138.41 MB" in before, before

        # move the N slider: focus its handle and press the arrow key (one step of 256)
        handle = page.locator(".widget-slider .noUi-handle, .widget-hslider .noUi-handle").first
        handle.scroll_into_view_if_needed()
        handle.focus()
        for _ in range(4):
            page.keyboard.press("ArrowRight")
        changed = _wait_for_change(page, before, 15)
        if changed is None:                           # fall back to dragging the handle
            box = handle.bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] / 2 + 60, box["y"] + box["height"] / 2, steps=8)
            page.mouse.up()
            changed = _wait_for_change(page, before, 30)
        assert changed is not None, "moving the N slider did not change the calculator's numbers"
        assert "GFLOP" in changed and "8.59 GFLOP" not in changed, changed
        assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                has_text="Traceback").count()


def _wait_for_change(page, before: str, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = _calculator_text(page)
        if now != before:
            return now
        time.sleep(0.25)
    return None
