"""What the browser tests share: Debian's Chromium, a JupyterLab server, one page per test.

The browser is Debian's Chromium at /usr/bin/chromium, driven through Playwright (only its
Python package: never a browser that Playwright would download).  When Chromium is missing,
the ``chromium`` fixture installs it with apt-get if it runs as root, and otherwise skips
with the reason.

JupyterLab runs on 127.0.0.1 on a free port with a random token, no browser, and a
temporary root folder holding a copy of notebook 00; it is stopped in teardown.  Other
notebooks reach it through :func:`upload` (the server's contents API).  :func:`browser_page`
opens one page in a persistent context over a new, empty profile and closes it afterwards.
"""
from __future__ import annotations

import contextlib
import json
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


def ensure_chromium() -> str | None:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium():
    path = ensure_chromium()
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
    port, token = free_port(), secrets.token_hex(16)
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


def upload(lab_server, name: str, nb: dict) -> None:
    """Put notebook ``nb`` into the server's root as ``name`` (its contents API)."""
    body = json.dumps({"type": "notebook", "format": "json", "content": nb}).encode()
    req = urllib.request.Request(f"{lab_server['url']}/api/contents/{name}?token={lab_server['token']}", data=body,
                                 method="PUT", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status in (200, 201)


#: true once the current notebook's kernel has started and is idle
WAIT_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                       return w && w.sessionContext && w.sessionContext.session &&
                              w.sessionContext.session.kernel &&
                              w.sessionContext.session.kernel.status === 'idle'; }"""


@contextlib.contextmanager
def browser_page(chromium: str, profile: Path, timeout_ms: int = UI_TIMEOUT_MS):
    """One Chromium page over a new, empty user data dir ``profile``; closed on exit."""
    sync_api = pytest.importorskip("playwright.sync_api")
    profile.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=chromium, headless=True,
                                                    args=CHROMIUM_FLAGS)
        try:
            page = ctx.new_page()
            page.set_default_timeout(timeout_ms)
            yield page
        finally:
            ctx.close()
