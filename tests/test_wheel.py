"""The package as a wheel: built, installed into a fresh virtual environment, run from elsewhere.

``python -m build`` (the ``build`` package, in the dev extra) makes the sdist and, from it, the
wheel, in a copy of the checkout's tracked files (so a file that git does not track cannot make
the test pass, and the checkout is left as it was).  The wheel goes into a new virtual
environment made by ``python -m venv`` (pip installs its dependencies, NumPy, matplotlib, tqdm
and ml_dtypes, from the package index; no editable install, no path to the checkout), and
from a folder outside the repository the test runs ``iokernels --help``, ``iokernels tour``
and a read of the recorded GPU results, then checks that the package came from the new
environment's site-packages.

Slow (a build, a venv and a pip install): marked ``slow``; the suite, and so CI, runs it.
Without a reachable package index it is skipped with the reason, except under CI (``CI`` set),
where it fails.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple/pip/"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _version() -> str:
    text = (ROOT / "iokernels" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert m, "iokernels/__init__.py must hold __version__ = \"X.Y.Z\""
    return m.group(1)


def _index_reachable() -> bool:
    try:
        with urllib.request.urlopen(INDEX, timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def _clean_env() -> dict:
    """The environment for the installed command: nothing that points at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env["MPLBACKEND"] = "Agg"
    return env


def _tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files (as they are in the work tree) copied to ``dest``."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the wheel test builds from the tracked files")
    for name in out.stdout.decode().split("\0"):
        if not name or not (ROOT / name).is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """(sdist, wheel) built by ``python -m build`` from a copy of the tracked files."""
    pytest.importorskip("build", reason="the build package (dev extra) makes the wheel")
    if not _index_reachable():
        if os.environ.get("CI"):
            pytest.fail(f"CI: the package index ({INDEX}) is not reachable")
        pytest.skip(f"the package index ({INDEX}) is not reachable: the build and the install need it")
    src = _tracked_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=300, env=_clean_env())
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    version = _version()
    wheel, sdist = out / f"iokernels-{version}-py3-none-any.whl", out / f"iokernels-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in out.iterdir())
    return sdist, wheel


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh virtual environment with the wheel installed (not editable): its bin/ folder."""
    _, wheel = dist
    where = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    r = subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=400, env=_clean_env())
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return where / "bin"


def _tracked(pattern: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)}


def test_wheel_holds_kernel_sources_data_and_records(dist):
    _, wheel = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    for cu in _tracked("iokernels/**/*.cu") | _tracked("iokernels/**/*.cuh") | _tracked("iokernels/data/*.json"):
        assert cu in names, f"the wheel lacks {cu}"
    for rec in _tracked("benchmarks/results/*.json") | _tracked("benchmarks/results/*.txt"):
        assert f"iokernels/data/results/{Path(rec).name}" in names, f"the wheel lacks the record {rec}"
    for lab in _tracked("notebooks/labs/*.ipynb"):
        assert f"iokernels/data/labs/{Path(lab).name}" in names, f"the wheel lacks the lab {lab}"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert re.search(r"^iokernels = iokernels\.__main__:main$",
                     zipfile.ZipFile(wheel).read(entry).decode(), re.M), "console script `iokernels`"
    assert not any(n.startswith(("tests/", "scripts/", "benchmarks/")) for n in names)


def test_sdist_holds_the_sources_the_wheel_is_built_from(dist):
    sdist, _ = dist
    top = f"iokernels-{_version()}/"
    names = {n[len(top):] for n in tarfile.open(sdist).getnames() if n.startswith(top)}
    want = (_tracked("iokernels/**/*.cu") | _tracked("iokernels/**/*.cuh") | _tracked("benchmarks/results/*")
            | _tracked("notebooks/*.ipynb") | _tracked("notebooks/labs/*.ipynb") | {"setup.py", "MANIFEST.in"})
    missing = sorted(want - names)
    assert not missing, f"the sdist lacks {missing}"


def test_version_is_defined_once():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in data["project"] and "version" in data["project"]["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "iokernels.__version__"}
    import iokernels
    assert iokernels.__version__ == _version()


def test_installed_wheel_runs_from_outside_the_repository(venv, tmp_path):
    env, cwd = _clean_env(), tmp_path / "elsewhere"
    cwd.mkdir()
    assert ROOT not in cwd.parents

    r = subprocess.run([str(venv / "iokernels"), "--help"], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: iokernels ")
    for command in ("tour", "figures", "bench", "dev", "ring", "labs"):
        assert command in r.stdout

    r = subprocess.run([str(venv / "iokernels"), "tour", "--small"], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    done = re.search(r"^tour done: (\d+) ok, (\d+) skipped, (\d+) failed$", r.stdout, re.M)
    assert done and int(done.group(1)) > 0 and done.group(3) == "0", r.stdout[-2000:]
    assert "01 naive forward" in r.stdout and "08 paged decode" in r.stdout
    assert sorted((cwd / "out" / "figures").glob("*.png")), "the tour writes its figures under ./out/figures"

    r = subprocess.run([str(venv / "iokernels"), "labs", "student", "learner"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    labs = sorted(p.name for p in (ROOT / "notebooks" / "labs").glob("*.ipynb"))
    assert sorted(p.name for p in (cwd / "learner").glob("*.ipynb")) == labs
    learner = (cwd / "learner" / labs[0]).read_text(encoding="utf-8")
    assert "BEGIN SOLUTION" not in learner and "NotImplementedError" in learner

    probe = ("import json, iokernels\n"
             "from iokernels.core import recorded\n"
             "from iokernels.cupy_raw import launch\n"
             "rec = recorded.load('h200')\n"
             "print(json.dumps({'file': iokernels.__file__, 'version': iokernels.__version__,\n"
             "  'results': str(recorded.RESULTS_DIR), 'label': recorded.label(rec),\n"
             "  'kernels': sorted(p.name for p in launch.KERNEL_DIR.glob('*.cu'))}))\n")
    r = subprocess.run([str(venv / "python"), "-c", probe], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = Path(got["file"]).resolve()
    assert "site-packages" in site.parts and ROOT not in site.parents, got["file"]
    assert got["version"] == _version()
    assert Path(got["results"]).resolve().parent.parent == site.parent, got["results"]
    assert got["label"].startswith("recorded on ") and "?" not in got["label"]
    assert got["kernels"] == sorted(p.name for p in (ROOT / "iokernels" / "cupy_raw" / "kernels").glob("*.cu"))


# ---- the first cell on a free GPU notebook service (README and the instructor's guide) ----

SMI_HEADER = ("+-----------------------------------------------------------------------------------------+\n"
              "| NVIDIA-SMI {drv}              Driver Version: {drv}      CUDA Version: {cuda}     |\n")


def _recipe(path: Path) -> str:
    text = path.read_text()
    section = re.search(r"^## On a free GPU notebook service\n(.*?)^## ", text, re.S | re.M)
    assert section, f"{path.name} needs a '## On a free GPU notebook service' section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1, f"{path.name}: the section holds one python cell"
    return blocks[0]


def test_the_first_cell_is_the_same_in_the_readme_and_the_instructors_guide():
    assert _recipe(ROOT / "README.md") == _recipe(ROOT / "notebooks" / "labs" / "README.md")


@pytest.mark.parametrize("cuda, extra", [("12.4", "cuda12"), ("13.0", "cuda13")])
def test_the_first_cell_installs_the_wheel_with_the_drivers_cuda_extras(tmp_path, monkeypatch, cuda, extra):
    """The cell, run with a stand-in for subprocess.run: it asks nvidia-smi, then pip installs the
    uploaded wheel with the extra of the driver's CUDA major version, an extra pyproject.toml has."""
    wheel = f"iokernels-{_version()}-py3-none-any.whl"
    (tmp_path / wheel).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        out = SMI_HEADER.format(drv="580.00", cuda=cuda) if cmd[0] == "nvidia-smi" else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(_recipe(ROOT / "README.md"), "first-cell", "exec"), {})
    assert calls[0] == ["nvidia-smi"]
    assert calls[1] == [sys.executable, "-m", "pip", "install", "-q", f"{wheel}[{extra}]"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras


def test_the_first_cell_refuses_a_driver_it_has_no_wheels_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "iokernels-0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout=SMI_HEADER.format(drv="470.00", cuda="11.4"), stderr=""))
    with pytest.raises(AssertionError, match="CUDA 11"):
        exec(compile(_recipe(ROOT / "README.md"), "first-cell", "exec"), {})
