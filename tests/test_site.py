"""The course website, opened in headless Chromium: ``bash dev.sh site-test``.

``bash dev.sh site-test`` builds the site (``bash dev.sh site``: every lesson notebook is executed,
which takes minutes, so the build is not part of ``bash dev.sh test``) and then runs this file
with ``IOKERNELS_SITE_DIR`` pointing at build/site; without that variable the tests skip with
that advice (marked ``site``). A static file server on 127.0.0.1 serves the folder, and
Debian's Chromium (/usr/bin/chromium, through Playwright's Python package; never a browser that
Playwright downloads) opens every page:

* every page loads without a console error, a page error or a failed request;
* every image on it has loaded (naturalWidth > 0);
* every internal link resolves: the file exists, and so does the #fragment on it;
* the table of contents lists one page per lesson notebook, in the README's reading order,
  and each lesson page holds its notebook's outputs; widgets carry the live-kernel note;
* the recorded results page names the GPU, the date and the versions, with figures and tables;
* the lab pages show no solution line; the API page documents every public function;
* the search box finds "online softmax" (Sphinx's search page lists notebook 02).
"""
from __future__ import annotations

import functools
import html
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT / "tests"))
import build_site  # noqa: E402
from browser_support import CHROMIUM_FLAGS, ensure_chromium  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.site, pytest.mark.timeout(900)]
SITE_ENV = "IOKERNELS_SITE_DIR"
LOAD_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def site():
    where = os.environ.get(SITE_ENV)
    if not where:
        pytest.skip(f"the site test runs with `bash dev.sh site-test` (it builds the site first; {SITE_ENV} unset)")
    site = Path(where)
    assert (site / "index.html").is_file(), f"{site}/index.html is missing: run `bash dev.sh site`"
    return site


@pytest.fixture(scope="module")
def pages(site):
    """The site's HTML pages, relative paths (the theme's and the assets' folders left out)."""
    found = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if not p.relative_to(site).parts[0].startswith("_"))
    assert "index.html" in found and "search.html" in found
    return found


@pytest.fixture(scope="module")
def server(site):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(site):
    path = ensure_chromium()
    if path is None:
        pytest.skip("/usr/bin/chromium is missing and could not be installed (needs root and apt-get)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def _open(browser, url):
    """(page, problems): the page loaded (network idle), and its console errors, page errors and
    failed requests."""
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(url, wait_until="networkidle", timeout=LOAD_TIMEOUT_MS)
    return page, problems


def _text(path: Path) -> str:
    """A page's text: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


def _ids(path: Path) -> set:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


def test_every_page_loads_clean_with_its_images_and_links(site, pages, server, browser):
    problems, broken_images, broken_links = {}, {}, {}
    ids_cache: dict = {}
    for rel in pages:
        page, errors = _open(browser, f"{server}/{rel}")
        images = page.evaluate("() => Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0)"
                               ".map(i => i.currentSrc || i.src)")
        hrefs = page.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
        page.close()
        if errors:
            problems[rel] = errors
        if images:
            broken_images[rel] = images
        for href in hrefs:
            url = urllib.parse.urlsplit(href)
            if f"{url.scheme}://{url.netloc}" != server:
                continue                                    # external: not this site's to check
            target = site / urllib.parse.unquote(url.path).lstrip("/")
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken_links.setdefault(rel, []).append(href)
            elif url.fragment and target.suffix == ".html":
                ids = ids_cache.setdefault(target, _ids(target))
                if urllib.parse.unquote(url.fragment) not in ids:
                    broken_links.setdefault(rel, []).append(href)
    assert not problems, f"pages with console errors or failed requests: {json.dumps(problems, indent=1)[:4000]}"
    assert not broken_images, f"images that did not load: {broken_images}"
    assert not broken_links, f"internal links that do not resolve: {json.dumps(broken_links, indent=1)[:4000]}"


def test_the_lessons_are_the_table_of_contents_in_reading_order(site):
    order = build_site.readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))["order"]
    want = [f"lessons/{p.stem}.html" for p in build_site.ordered_lessons(order)]
    assert len(want) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    index = (site / "index.html").read_text(encoding="utf-8")
    nav = re.search(r'<nav class="[^"]*bd-docs-nav[^"]*".*?</nav>', index, re.S)
    assert nav, "the sidebar's navigation"
    listed = [h for h in re.findall(r'href="([^"#]+)"', nav.group(0)) if h.startswith("lessons/")]
    assert listed == want
    text = _text(site / "index.html")
    intro = build_site.readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))["intro"]
    assert " ".join(intro.split()[:12]) in " ".join(text.split()), "the README's introduction"
    assert "Reading order" in text


@pytest.mark.parametrize("nb", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_lesson_page_shows_its_executed_outputs(site, nb):
    page = site / "lessons" / f"{nb.stem}.html"
    assert page.is_file()
    source = json.loads(nb.read_text(encoding="utf-8"))
    code_cells = [c for c in source["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    body = page.read_text(encoding="utf-8")
    outputs = body.count('class="cell_output')
    assert outputs >= len(code_cells) // 2, f"{nb.name}: {outputs} outputs for {len(code_cells)} code cells"
    assert "Traceback (most recent call last)" not in _text(page)
    widgets = sum('interact' in "".join(c["source"]) or "widget" in "".join(c["source"]).lower()
                  for c in code_cells)
    if widgets and "ipywidgets" in json.dumps(source):
        assert "iokernels-widget-note" in body, f"{nb.name} uses a widget: its place needs the live-kernel note"


def test_the_recorded_results_are_labelled_plotted_and_tabled(site):
    from iokernels.core import recorded
    rec = recorded.load("h200")
    env = rec["env"]
    page = site / "results.html"
    text = " ".join(_text(page).split())
    assert recorded.label(rec) in text
    for part in (env["gpu"], env["date_utc"][:10], env["torch"], env["cupy"], env["numba"]):
        assert str(part) in text
    body = page.read_text(encoding="utf-8")
    assert len(re.findall(r"<img [^>]*src=\"_images/", body)) >= 4
    assert body.count("<table") >= 4


def test_the_lab_pages_show_no_solution(site):
    from iokernels.labs import notebooks as labnb
    leaked = {}
    for path in labnb.lab_notebooks(ROOT / "notebooks" / "labs"):
        nb = json.loads(path.read_text(encoding="utf-8"))
        learner = "\n".join("".join(c["source"]) for c in labnb.student_notebook(nb)["cells"])
        solution = []
        for cell in nb["cells"]:
            inside = False
            for line in "".join(cell["source"]).splitlines():
                if line.strip().startswith(labnb.BEGIN):
                    inside = True
                elif line.strip().startswith(labnb.END):
                    inside = False
                elif inside and len(line.strip()) >= 12 and line.strip() not in learner:
                    solution.append(line.strip())
        assert solution, f"{path.name}: no solution lines found to check"
        page = site / "labs" / f"{path.stem}.html"
        text = "\n".join(ln.strip() for ln in _text(page).splitlines())
        shown = [s for s in solution if s in text]
        if shown:
            leaked[path.name] = shown[:3]
    assert not leaked, f"solution lines on the lab pages: {leaked}"
    guide = " ".join(_text(site / "labs" / "index.html").split())
    assert "labs student" in guide and "labs grade" in guide


def test_the_api_reference_documents_every_public_function(site):
    # the public names of the package the site was built from (the checkout, as the build imports it)
    probe = ("import json, types, iokernels as ik\n"
             "print(json.dumps({'public': [n for n in ik.__all__ if callable(getattr(ik, n))\n"
             "                             and not isinstance(getattr(ik, n), types.ModuleType)],\n"
             "                  'doc': ik.attention.__doc__}))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ids = _ids(site / "api.html")
    missing = [n for n in got["public"] if f"iokernels.{n}" not in ids]
    assert not missing, f"the API page lacks {missing}"
    text = " ".join(_text(site / "api.html").split())
    assert " ".join(got["doc"].split("\n")[0].split(";")[0].split()) in text


def test_the_search_box_finds_online_softmax(server, browser):
    page, problems = _open(browser, f"{server}/index.html")
    page.locator("button.search-button__button").first.click()
    box = page.locator("#pst-search-dialog input[name=q]")
    box.fill("online softmax")
    box.press("Enter")
    page.wait_for_url(re.compile(r"search\.html\?q=online"), timeout=LOAD_TIMEOUT_MS)
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=LOAD_TIMEOUT_MS)
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    page.close()
    assert any("lessons/02_online_softmax" in h for h in hrefs), hrefs
    assert not problems, problems


def test_the_math_is_typeset_from_the_site_itself(site, server, browser):
    """MathJax (served from _static/mathjax, no network) typesets the lesson with the most math."""
    counts = {p: p.read_text(encoding="utf-8").count('class="math notranslate')
              for p in (site / "lessons").glob("*.html")}
    page_path = max(counts, key=counts.get)
    assert counts[page_path] > 0, "no lesson page holds math"
    page, problems = _open(browser, f"{server}/lessons/{page_path.name}")
    page.wait_for_function("() => document.querySelectorAll('.MathJax, .MathJax_Display').length > 0",
                           timeout=LOAD_TIMEOUT_MS)
    typeset = page.evaluate("() => document.querySelectorAll('.MathJax, .MathJax_Display').length")
    page.close()
    assert typeset >= counts[page_path] // 2, (page_path.name, typeset, counts[page_path])
    assert not problems, problems


# ---- the build's own parts, without a built site (fast: these run in the suite) ----

def test_the_readme_reading_order_names_every_lesson_once():
    parts = build_site.readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))
    lessons = build_site.ordered_lessons(parts["order"])
    assert sorted(lessons) == sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert parts["order"][:2] == ["00", "01"] and parts["intro"] and "| step |" in parts["progression"]
    with pytest.raises(ValueError, match="missing"):
        build_site.ordered_lessons(parts["order"][1:])


def test_the_index_links_each_notebook_of_the_progression_to_its_page():
    page = build_site.index_page((ROOT / "README.md").read_text(encoding="utf-8"))
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert f"[{nb.stem}](lessons/{nb.stem}.ipynb)" in page
        assert f"\nlessons/{nb.stem}\n" in page


def test_widget_outputs_become_the_note_and_progress_bars_go():
    widget = {"output_type": "display_data", "metadata": {},
              "data": {build_site.WIDGET_MIME: {"model_id": "x"}, "text/plain": "VBox(children=(IntSlider(...),))"}}
    bar = {"output_type": "display_data", "metadata": {},
           "data": {build_site.WIDGET_MIME: {"model_id": "y"}, "text/plain": " 40%|####      | 4/10"}}
    text = {"output_type": "stream", "name": "stdout", "text": "kept\n"}
    nb = {"metadata": {"widgets": {}}, "cells": [{"cell_type": "code", "outputs": [widget, bar, text]}]}
    assert build_site.static_outputs(nb) == 1
    outs = nb["cells"][0]["outputs"]
    assert len(outs) == 2 and outs[1] == text and "widgets" not in nb["metadata"]
    assert "live kernel" in outs[0]["data"]["text/plain"] and build_site.WIDGET_MIME not in outs[0]["data"]


def test_the_api_page_gains_any_public_name_it_does_not_document():
    text = (ROOT / "docs" / "pages" / "api.md").read_text(encoding="utf-8")
    assert build_site.api_page(text) == text or "## More of the public API" in build_site.api_page(text)
    without = text.replace(".. autofunction:: iokernels.merge_states\n", "")
    assert without != text
    added = build_site.api_page(without).split("## More of the public API")[1]
    assert ".. autofunction:: iokernels.merge_states" in added
