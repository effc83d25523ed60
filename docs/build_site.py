"""Build the course website: ``bash dev.sh site`` (or ``python docs/build_site.py``).

1. Stage the sources in build/site-src/ (git ignores build/):
   - index.md: the README's introduction, its progression table (each notebook linked to its
     page) and its reading order, with the lessons' table of contents in that order;
   - lessons/: every lesson notebook of notebooks/, executed here on the CPU (Numba's CUDA
     simulator when there is no GPU, two at a time, as tests/test_notebooks.py runs them), with
     each widget's output replaced by a note that the widget needs a live kernel;
   - labs/: the instructor's guide (notebooks/labs/README.md) and the learner copy of each lab
     (``iokernels.labs`` turns solutions into stubs), not executed: no solution is shown;
   - the pages of docs/pages/ (the recorded GPU results, which run at build time, and the API
     reference), docs/conf.py, and MathJax from the jupyter-server-mathjax package.
2. ``sphinx-build -b html`` into build/site/ (build/site/index.html).

Nothing outside build/ is written, so a build leaves a clean checkout clean.
Options: ``--out DIR`` (default build/site), ``--only NAME...`` executes only those lesson
notebooks (the others are shown without outputs; for working on one page), ``--jobs N``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = ROOT / "notebooks"
LABS = NOTEBOOKS / "labs"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: seconds one notebook may run (kernel start included) before the build stops and names it
NOTEBOOK_LIMIT_S = 600
#: the note that replaces a widget's output on a static page
WIDGET_NOTE = ("This widget needs a live kernel: open the notebook in JupyterLab (<code>bash dev.sh lab</code>) "
               "or on a notebook service and run it to move its controls.")


# --------------------------------------------------------------------------- the README's parts
def readme_sections(text: str) -> dict:
    """{"title", "intro", "progression", "order"} from the README: the title line, the
    introduction (up to the first ## heading), the progression section (with its reading
    order) and the reading order as notebook labels ("00", ..., "09b")."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError("text: the README must open with a '# title' line")
    first_h2 = next(i for i, ln in enumerate(lines) if ln.startswith("## "))
    prog = re.search(r"^## The progression\n(.*?)(?=^## )", text, re.S | re.M)
    if not prog:
        raise ValueError("text: the README needs a '## The progression' section")
    order = re.search(r"^\*\*((?:\w+ → )+\w+)\*\*$", prog.group(1), re.M)
    if not order:
        raise ValueError("text: the progression needs its reading order as **00 → 01 → ...**")
    return {"title": lines[0][2:].strip(), "intro": "\n".join(lines[1:first_h2]).strip(),
            "progression": prog.group(1).strip(), "order": order.group(1).split(" → ")}


def lesson_notebooks() -> dict:
    """{label: path} of the lesson notebooks ("00" -> notebooks/00_memory_hierarchy_roofline.ipynb)."""
    return {p.name.split("_", 1)[0]: p for p in sorted(NOTEBOOKS.glob("*.ipynb"))}


def ordered_lessons(order: list) -> list:
    """The lesson notebooks in reading order; every lesson must be in it, once."""
    lessons = lesson_notebooks()
    missing, unknown = sorted(set(lessons) - set(order)), sorted(set(order) - set(lessons))
    if missing or unknown or len(order) != len(set(order)):
        raise ValueError(f"order: the README's reading order must name every notebook once "
                         f"(missing {missing}, unknown {unknown})")
    return [lessons[label] for label in order]


def link_notebooks(progression: str) -> str:
    """The progression table with each `NN_name` notebook cell a link to its page."""
    names = {p.stem for p in lesson_notebooks().values()}
    return re.sub(r"`(\w+)`", lambda m: f"[{m.group(1)}](lessons/{m.group(1)}.ipynb)"
                  if m.group(1) in names else m.group(0), progression)


def index_page(readme: str) -> str:
    parts = readme_sections(readme)
    toc = "\n".join(f"lessons/{p.stem}" for p in ordered_lessons(parts["order"]))
    return f"""# {parts['title']}

{parts['intro']}

This site shows every lesson notebook executed on a CPU (the Numba sections on Numba's CUDA
simulator), the [recorded GPU results](results.md), the [labs](labs/index.md) and the
[API reference](api.md). A widget needs a live kernel: its place on a page holds a note
saying so. To run the notebooks, clone the repository and run `bash dev.sh lab`.

## The progression

{link_notebooks(parts['progression'])}

```{{toctree}}
:caption: Lessons, in reading order
:maxdepth: 1
:hidden:

{toc}
```

```{{toctree}}
:caption: Results, labs, reference
:maxdepth: 1
:hidden:

results
labs/index
api
```
"""


def recorded_block(readme: str) -> str:
    """The README's generated tables of the recorded GPU run (between its markers)."""
    m = re.search(r"<!-- recorded-results:start -->\n(.*?)<!-- recorded-results:end -->", readme, re.S)
    if not m:
        raise ValueError("readme: no recorded-results markers")
    return m.group(1).replace("benchmarks/NOTES.md", "`benchmarks/NOTES.md` in the repository").strip()


# --------------------------------------------------------------------------- the API page
def api_page(text: str) -> str:
    """docs/pages/api.md with every public name of ``iokernels.__all__`` that it does not
    document yet appended (a function added to the package appears without editing the page)."""
    sys.path.insert(0, str(ROOT))
    import iokernels
    documented = set(re.findall(r"\.\. auto(?:function|class|data):: iokernels\.(\w+)", text))
    rest = []
    for name in iokernels.__all__:
        obj = getattr(iokernels, name)
        if name in documented or isinstance(obj, type(iokernels)):
            continue                                        # documented above, or a module
        kind = "autoclass" if isinstance(obj, type) else "autofunction" if callable(obj) else "autodata"
        rest.append(f".. {kind}:: iokernels.{name}")
    if not rest:
        return text
    return text.rstrip() + "\n\n## More of the public API\n\n```{eval-rst}\n" + "\n".join(rest) + "\n```\n"


# --------------------------------------------------------------------------- labs
def labs_pages(dest: Path) -> list:
    """labs/index.md (the instructor's guide, with the learner copies' table of contents) and
    labs/<lab>.ipynb (learner copies: solutions replaced by stubs); returns the lab stems."""
    sys.path.insert(0, str(ROOT))
    from iokernels.labs import notebooks as labnb
    dest.mkdir(parents=True, exist_ok=True)
    stems = []
    for path in labnb.lab_notebooks(LABS):
        nb = labnb.student_notebook(json.loads(path.read_text(encoding="utf-8")))
        (dest / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        stems.append(path.stem)
    guide = (LABS / "README.md").read_text(encoding="utf-8")
    guide = re.sub(r"^# .*\n", "# Labs\n\n"
                   "The pages below show each lab as a learner gets it (its solutions replaced by stubs), "
                   "without outputs; the instructor's guide follows.\n\n", guide, count=1)
    toc = "\n".join(stems)
    (dest / "index.md").write_text(guide + f"\n\n```{{toctree}}\n:caption: The labs (learner copies)\n"
                                   f":maxdepth: 1\n\n{toc}\n```\n", encoding="utf-8")
    return stems


# --------------------------------------------------------------------------- executing notebooks
_RUNNER = r"""
import json, os, queue, sys, tempfile, time
import nbformat, nbclient
from traitlets.config import Config
from jupyter_client.channels import AsyncZMQSocketChannel
src, dest, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
_get = AsyncZMQSocketChannel.get_msg

async def sliced(self, timeout=None):   # a missed ZeroMQ wake-up costs one second, not the timeout
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return await _get(self, timeout=1.0 if end is None else min(1.0, max(0.0, end - time.monotonic())))
        except queue.Empty:
            if end is not None and time.monotonic() >= end:
                raise

AsyncZMQSocketChannel.get_msg = sliced
config = Config()
if os.name == "posix":                  # IPC sockets of this run's own: no TCP port races
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = os.path.join(tempfile.mkdtemp(prefix="sitekernel-"), "kernel")
nb = nbformat.read(src, as_version=4)
nbclient.NotebookClient(nb, timeout=timeout, startup_timeout=120, kernel_name="python3", config=config,
                        shutdown_kernel="immediate", resources={"metadata": {"path": os.path.dirname(src)}}).execute()
nbformat.write(nb, dest)
"""


def kernel_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"   # figures become outputs
    env.setdefault("JUPYTER_PREFER_ENV_PATH", "1")
    if not os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is None:
        env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return env


def static_outputs(nb: dict) -> int:
    """Replace each widget output of ``nb`` by the live-kernel note (a progress bar is dropped);
    the number of widgets noted."""
    noted = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        outs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME not in data:
                outs.append(out)
                continue
            plain = "".join(data.get("text/plain", ""))
            if re.search(r"\d+%\|", plain) or plain.startswith("HBox(children=(HTML(value="):
                continue                                    # a tqdm progress bar: nothing to show
            noted += 1
            outs.append({"output_type": "display_data", "metadata": {},
                         "data": {"text/html": f'<p class="iokernels-widget-note">{WIDGET_NOTE}</p>',
                                  "text/plain": re.sub("<[^>]+>", "", WIDGET_NOTE)}})
        cell["outputs"] = outs
    nb.get("metadata", {}).pop("widgets", None)
    return noted


def execute(src: Path, dest: Path) -> tuple:
    """Execute ``src`` into ``dest`` in a child process; (seconds, error text or None)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(src), str(dest), str(NOTEBOOK_LIMIT_S)],
                              env=kernel_env(), capture_output=True, text=True, timeout=NOTEBOOK_LIMIT_S + 180)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, f"killed after {NOTEBOOK_LIMIT_S + 180} s"
    if proc.returncode != 0:
        return time.perf_counter() - t0, (proc.stderr or proc.stdout)[-5000:]
    nb = json.loads(dest.read_text(encoding="utf-8"))
    static_outputs(nb)
    dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return time.perf_counter() - t0, None


def execute_lessons(dest: Path, jobs: int, only=None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    lessons = sorted(NOTEBOOKS.glob("*.ipynb"))
    run = [p for p in lessons if only is None or p.stem in only or p.stem.split("_", 1)[0] in only]
    for p in lessons:
        if p not in run:
            shutil.copy(p, dest / p.name)
    # one warm-up first, alone: matplotlib's font cache and the imports, built once
    subprocess.run([sys.executable, "-c", "import matplotlib.pyplot, ipywidgets, iokernels.viz.figures"],
                   env=kernel_env(), capture_output=True, timeout=600)
    failed = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {p: pool.submit(execute, p, dest / p.name) for p in run}
        for p, fut in futures.items():
            seconds, error = fut.result()
            print(f"[site] executed {p.name} in {seconds:.0f} s" + (" FAILED" if error else ""), flush=True)
            if error:
                failed.append(f"{p.name}:\n{error}")
    if failed:
        raise SystemExit("[site] notebooks failed:\n" + "\n\n".join(failed))


# --------------------------------------------------------------------------- MathJax
def copy_mathjax(static: Path) -> None:
    """MathJax 2 from the jupyter-server-mathjax package into _static/mathjax (no CDN)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise SystemExit("[site] needs the jupyter-server-mathjax package (pip install -e '.[site]')")
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(src, static / "mathjax", ignore=shutil.ignore_patterns("unpacked", "*.md", "*.txt"))


# --------------------------------------------------------------------------- the build
def stage(src: Path, jobs: int, only=None) -> None:
    if src.exists():
        shutil.rmtree(src)
    (src / "_static").mkdir(parents=True)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    for asset in sorted((DOCS / "static").iterdir()):
        shutil.copy(asset, src / "_static" / asset.name)
    for page in sorted((DOCS / "pages").iterdir()):
        if page.is_file():
            shutil.copy(page, src / page.name)
    (src / "index.md").write_text(index_page(readme), encoding="utf-8")
    (src / "api.md").write_text(api_page((DOCS / "pages" / "api.md").read_text(encoding="utf-8")), encoding="utf-8")
    results = src / "results.md"
    results.write_text(results.read_text(encoding="utf-8").replace("{{README_RECORDED_RESULTS}}",
                                                                   recorded_block(readme)), encoding="utf-8")
    copy_mathjax(src / "_static")
    labs_pages(src / "labs")
    execute_lessons(src / "lessons", jobs, only)


def build(out: Path, jobs: int = 2, only=None) -> Path:
    t0 = time.perf_counter()
    src, doctrees = out.parent / f"{out.name}-src", out.parent / f"{out.name}-doctrees"
    stage(src, jobs, only)
    if out.exists():
        shutil.rmtree(out)
    env = kernel_env()
    env["IOKERNELS_ROOT"] = str(ROOT)
    warnings = out.parent / f"{out.name}-warnings.txt"
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-E", "-d", str(doctrees),
                    "-w", str(warnings), str(src), str(out)], check=True, env=env)
    print(f"[site] {out / 'index.html'} in {time.perf_counter() - t0:.0f} s "
          f"(Sphinx warnings, if any: {warnings})", flush=True)
    return out / "index.html"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/build_site.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "site"), help="output folder (default build/site)")
    ap.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    ap.add_argument("--only", nargs="+", help="execute only these lesson notebooks (labels or names)")
    a = ap.parse_args(argv)
    build(Path(a.out).resolve(), a.jobs, set(a.only) if a.only else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
