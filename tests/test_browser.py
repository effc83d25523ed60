"""Notebook 00 in a real JupyterLab, driven by headless Chromium: run it, move a slider.

What a student does: open the notebook in JupyterLab, Run > Run All Cells, drag the N
slider of the roofline calculator, and see the numbers change.  The browser is Debian's
Chromium at /usr/bin/chromium, driven through Playwright (only its Python package: never
a browser that Playwright would download).  When Chromium is missing the test installs it
with apt-get if it runs as root, and otherwise skips with the reason.

JupyterLab runs on 127.0.0.1 on a free port with a random token, no browser, and a
temporary root folder holding a copy of the notebook; it is stopped in teardown.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "00_memory_hierarchy_roofline.ipynb"
CHROMIUM = "/usr/bin/chromium"
#: flags for Chromium as root on a machine with a closed network (see the module docstring)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_S = 90       # JupyterLab's first start on two cores builds nothing but is slow
UI_TIMEOUT_MS = 120_000   # running the whole notebook in the browser, kernel start included
APT_TIMEOUT_S = 900

#: the first run on a fresh machine may install Chromium with apt-get inside the fixture
pytestmark = [pytest.mark.slow, pytest.mark.timeout(APT_TIMEOUT_S + 300)]


def _ensure_chromium() -> str | None:
    """Path of Chromium, installing Debian's package when missing and root; None if impossible."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        if r.returncode != 0:
            return None
    return CHROMIUM if os.path.exists(CHROMIUM) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium():
    path = _ensure_chromium()
    if path is None:
        pytest.skip(f"{CHROMIUM} is missing and could not be installed (needs root and apt-get)")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 over a temp folder with a copy of notebook 00."""
    pytest.importorskip("jupyterlab")
    root = tmp_path_factory.mktemp("lab-root")
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    runtime = tmp_path_factory.mktemp("lab-runtime")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path_factory.mktemp("lab-workspaces")),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("MPLBACKEND", None)
    log = open(runtime / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True",
         "--ServerApp.port_retries=0", "--LabApp.news_url=None", "--LabApp.expose_app_in_browser=True",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({proc.returncode}):\n{(runtime / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer in {SERVER_START_S} s:\n"
                            f"{(runtime / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": url, "token": token, "log": runtime / "lab.log"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)     # the server and the kernels it started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _calculator_text(page) -> str:
    """The roofline calculator's table (an ipywidgets HTML widget holding 'GFLOP')."""
    return page.locator(".widget-html-content", has_text="GFLOP").first.inner_text()


def test_notebook00_slider_changes_the_numbers(chromium, lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    profile = tmp_path / "chromium-profile"      # a new, empty user data dir
    profile.mkdir()
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=chromium, headless=True,
                                                    args=CHROMIUM_FLAGS)
        try:
            page = ctx.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{lab['url']}/lab/tree/{NOTEBOOK.name}?token={lab['token']}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            # wait for the kernel, then Run > Run All Cells, as a user would
            page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-Notebook')")
            page.wait_for_function(
                """() => { const w = window.jupyterapp.shell.currentWidget;
                           return w && w.sessionContext && w.sessionContext.session &&
                                  w.sessionContext.session.kernel &&
                                  w.sessionContext.session.kernel.status === 'idle'; }""")
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
        finally:
            ctx.close()


def _wait_for_change(page, before: str, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = _calculator_text(page)
        if now != before:
            return now
        time.sleep(0.25)
    return None
