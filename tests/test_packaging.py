"""The packaging stays consistent: pyproject.toml == environment.yml, README == CI.

- environment.yml (conda-forge) lists the same dependencies as pyproject.toml's core and
  extras, with the same version floors, under conda-forge's names where they differ.
- The README's quick start is exactly two commands; .ci/run runs the README's test command.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: pip name -> conda-forge name, where they differ.
PIP_TO_CONDA = {
    "torch": "pytorch",
    "matplotlib": "matplotlib-base",   # matplotlib without the Qt GUI stack
    "cupy-cuda13x": "cupy",            # conda-forge picks the CUDA build through cuda-version
    "build": "python-build",
}
#: pip extras that conda-forge expresses as a separate package pin instead.
PIP_EXTRA_TO_CONDA = {("numba-cuda", "cu13"): ("cuda-version", "13")}
#: conda-only entries that have no pip counterpart.
CONDA_ONLY = {"python", "pip"}
#: pip extras that pick CUDA wheels by the driver's CUDA major version: outside "all" (a machine
#: takes one of them) and outside environment.yml (conda-forge's cuda-version does it there)
CUDA_EXTRAS = {"cuda12": "12", "cuda13": "13"}

_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(?:\[([A-Za-z0-9_,\-]+)\])?\s*(?:>=\s*([0-9][^,;\s]*))?\s*$")


def _parse_req(text: str):
    m = _REQ.match(text)
    assert m, f"unparsed requirement {text!r}: use 'name>=floor' (optionally name[extra]>=floor)"
    name, extras, floor = m.groups()
    return name.lower(), tuple((extras or "").split(",")) if extras else (), floor


def pyproject_requirements() -> dict:
    """{pip name: (extras, floor)} over the core dependencies and every extra but 'all'."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    reqs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra != "all" and extra not in CUDA_EXTRAS:
            reqs.extend(items)
    out = {}
    for r in reqs:
        name, extras, floor = _parse_req(r)
        assert name not in out, f"{name} listed twice in pyproject.toml"
        out[name] = (extras, floor)
    return out


def environment_requirements():
    """({conda name: floor}, {pip name: floor}) from environment.yml's dependencies.

    A small parser for the file's own simple shape ("  - name>=floor", and a "- pip:"
    list), so the test needs no YAML library.
    """
    conda, pip = {}, {}
    in_deps = in_pip = False
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line.startswith(" "):
            in_deps = line.startswith("dependencies:")
            in_pip = False
            continue
        if not in_deps:
            continue
        item = line.strip()
        if item == "- pip:":
            in_pip = True
            continue
        indent = len(line) - len(line.lstrip())
        if in_pip and indent <= 2:
            in_pip = False
        assert item.startswith("- "), f"environment.yml: unexpected line {raw!r}"
        name, _, floor = _parse_req(item[2:])
        target = pip if in_pip else conda
        assert name not in target, f"{name} listed twice in environment.yml"
        target[name] = floor
    return conda, pip


def test_environment_yml_matches_pyproject():
    want = pyproject_requirements()
    conda, pip = environment_requirements()
    expected_conda = {n: None for n in CONDA_ONLY if n in conda}
    expected_conda.update({"python": conda.get("python")})
    for name, (extras, floor) in want.items():
        if name in pip:                     # not on conda-forge: listed under pip: as is
            assert pip[name] == floor, f"{name}: environment.yml pip floor {pip[name]} != pyproject {floor}"
            continue
        cname = PIP_TO_CONDA.get(name, name)
        assert cname in conda, f"{name} (conda-forge: {cname}) is in pyproject.toml but not environment.yml"
        assert conda[cname] == floor, f"{cname}: environment.yml floor {conda[cname]} != pyproject's {floor}"
        expected_conda[cname] = floor
        for extra in extras:
            pair = PIP_EXTRA_TO_CONDA.get((name, extra))
            assert pair, f"{name}[{extra}]: add its conda-forge form to PIP_EXTRA_TO_CONDA"
            assert conda.get(pair[0]) == pair[1], f"{name}[{extra}] needs {pair[0]}>={pair[1]} in environment.yml"
            expected_conda[pair[0]] = pair[1]
    extra_conda = set(conda) - set(expected_conda) - CONDA_ONLY
    extra_pip = set(pip) - set(want)
    assert not extra_conda, f"environment.yml has conda packages pyproject.toml lacks: {sorted(extra_conda)}"
    assert not extra_pip, f"environment.yml has pip packages pyproject.toml lacks: {sorted(extra_pip)}"


def test_python_floor_matches():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    conda, _ = environment_requirements()
    assert data["project"]["requires-python"] == f">={conda['python']}"


def test_all_extra_has_every_extra():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    (all_req,) = extras["all"]
    _, named, _ = _parse_req(all_req)
    assert set(named) == set(extras) - {"all"} - set(CUDA_EXTRAS)


@pytest.mark.parametrize("extra", sorted(CUDA_EXTRAS))
def test_cuda_extras_are_gpu_for_one_cuda_major_version(extra):
    """cuda12 / cuda13: the gpu extra's packages, with CuPy's and numba-cuda's CUDA wheels of that
    major version; cuda13 is the gpu extra itself."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major = CUDA_EXTRAS[extra]
    want = sorted(r.replace("cu13", f"cu{major}").replace("cuda13x", f"cuda{major}x") for r in extras["gpu"])
    assert sorted(extras[extra]) == want


def readme_quick_start() -> list[str]:
    """The commands in the README's quick-start code block (comments and blanks dropped)."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md needs a '## Quick start' section"
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section.group(1), re.S)
    assert blocks, "the quick start needs a code block"
    lines = [ln.strip() for ln in blocks[0].splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def ci_commands() -> list[str]:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_readme_quick_start_is_two_commands():
    cmds = readme_quick_start()
    assert len(cmds) == 2, f"the quick start must be exactly two commands, found {cmds}"
    assert any(" tour" in c for c in cmds) and any(c.endswith(" test") for c in cmds), cmds


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in readme_quick_start() if c.endswith(" test"))
    assert test_cmd in ci_commands(), f".ci/run must run the README's test command {test_cmd!r}"


def test_dev_script_installs_torch_pin_first():
    """The CPU torch wheel is pinned and installed before the package (see dev.sh)."""
    script = (ROOT / "dev.sh").read_text()
    pin = re.search(r'TORCH_PIN="torch==([0-9.]+)"', script)
    assert pin, "dev.sh must pin torch"
    assert script.index('"$TORCH_PIN"') < script.index('-e ".[all]"')
    floor = pyproject_requirements()["torch"][1]
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(pin.group(1)) >= as_tuple(floor), "dev.sh's torch pin is below pyproject's floor"


@pytest.mark.parametrize("marker", ["<!-- recorded-results:start -->", "<!-- recorded-results:end -->"])
def test_readme_keeps_recorded_results_markers(marker):
    assert (ROOT / "README.md").read_text().count(marker) == 1


def test_long_test_files_exist_and_the_suite_runs_them_first():
    """tests/conftest.py's LONG_FILES (handed to the two workers first) are files of tests/,
    and ``dev.sh test`` keeps each file on one worker in that order."""
    import conftest
    assert conftest.LONG_FILES and len(set(conftest.LONG_FILES)) == len(conftest.LONG_FILES)
    missing = [name for name in conftest.LONG_FILES if not (ROOT / "tests" / name).exists()]
    assert not missing, f"LONG_FILES names files that do not exist: {missing}"
    parallel = re.search(r"^TEST_PARALLEL=\((.*)\)$", (ROOT / "dev.sh").read_text(), re.M)
    assert parallel and "--dist loadfile --no-loadscope-reorder" in parallel.group(1), "dev.sh: TEST_PARALLEL"


def test_ci_runs_the_linter_and_type_check_installed_by_the_setup():
    """.ci/run runs ``bash dev.sh lint`` before the tests; dev.sh's lint runs ruff and mypy,
    both in the dev extra (and so in environment.yml, by the test above), both configured."""
    cmds = ci_commands()
    assert any(c.startswith("bash dev.sh lint") for c in cmds), cmds
    assert cmds.index(next(c for c in cmds if c.startswith("bash dev.sh lint"))) < cmds.index("bash dev.sh test")
    script = (ROOT / "dev.sh").read_text()
    lint = re.search(r"^\s*lint\)(.*?);;", script, re.S | re.M)
    assert lint and "-m ruff check" in lint.group(1) and "-m mypy" in lint.group(1)
    dev = {_parse_req(r)[0] for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
           ["project"]["optional-dependencies"]["dev"]}
    assert {"ruff", "mypy"} <= dev
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert {"E", "F", "W"} <= set(tool["ruff"]["lint"]["select"]) and tool["mypy"]["files"]
