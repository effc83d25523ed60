"""The command line: ``python -m iokernels tour`` and ``python -m iokernels figures``.

Both run in a subprocess, as a user would run them, with the test's environment (the
conftest switched Numba's simulator on when there is no GPU).
"""
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every step the tour must print, in order
TOUR_STEPS = ["01 naive forward", "03 tiled forward FA1", "03 tiled forward FA2", "09a FA2, FA4 rescaling",
              "04 backward naive", "04 backward tiled (FA2)", "07 paged gather", "08 decode (split-KV)",
              "08 paged decode", "05 Numba CUDA forward", "06 CuPy forward", "10 torch SDPA forward"]
#: the figures `figures` must write (the paged ones come from iokernels.viz.paged)
FIGURES = ["memory_hierarchy.png", "flash_forward_loop.png", "traffic_vs_n.png", "roofline.png",
           "paged_block_table.png", "paged_split_kv.png"]
TOUR_LIMIT_S = 60


def _run(*args, timeout=TOUR_LIMIT_S * 2):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "iokernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _png_size(path: Path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_tour_prints_every_step(tmp_path):
    t0 = time.perf_counter()
    r = _run("tour", "--small", "--out", str(tmp_path))
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for step in TOUR_STEPS:
        hits = [ln for ln in lines if ln.startswith(step)]
        assert len(hits) == 1, f"tour output lacks step {step!r}:\n{r.stdout}"
        assert "FAILED" not in hits[0] and "FAIL" not in hits[0].split(), hits[0]
    # the NumPy steps count their traffic and the count equals the model
    for step in TOUR_STEPS[:8]:
        (line,) = [ln for ln in lines if ln.startswith(step)]
        assert " ok " in line and "=" in line, f"counted != modelled or check failed: {line}"
    # the CuPy step runs only with a GPU; without one it says why
    (cupy_line,) = [ln for ln in lines if ln.startswith("06 CuPy")]
    from iokernels import gpu
    if not gpu.cupy_gpu():
        assert "skipped:" in cupy_line and "GPU" in cupy_line
    assert "tour done:" in lines[-1]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(FIGURES)
    assert elapsed < TOUR_LIMIT_S, f"the small tour took {elapsed:.0f} s"


def test_figures_writes_expected_pngs(tmp_path):
    r = _run("figures", "--out", str(tmp_path), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(FIGURES)
    for name in FIGURES:
        w, h = _png_size(tmp_path / name)
        assert 300 < w < 2000 and 200 < h < 1500, (name, w, h)


def test_figures_are_reproducible(tmp_path):
    """Fixed seeds and no dates in the metadata: the same bytes twice."""
    from iokernels.viz import figures
    a = figures.write_all(tmp_path / "a", progress=False)
    b = figures.write_all(tmp_path / "b", progress=False)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


@pytest.mark.parametrize("argv", [["nonsense"], ["tour", "--seed", "x"], []])
def test_bad_command_line_exits_with_usage(argv):
    r = _run(*argv, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr.lower()


def test_the_tour_writes_outside_tracked_files_and_figures_rewrites_figures():
    """The tour's default folder is one git ignores (a tour never dirties a clean checkout);
    `figures` alone writes the committed figures/."""
    import shutil

    from iokernels import __main__ as cli
    assert cli.DEFAULT_FIGURES == ROOT / "figures"
    assert cli.TOUR_FIGURES.is_relative_to(ROOT / "out")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    probe = cli.TOUR_FIGURES / "traffic_vs_n.png"
    r = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert r.returncode == 0, f"{probe} is not ignored by git: a tour would leave the checkout modified"
    r = subprocess.run(["git", "check-ignore", "-q", str(ROOT / "figures" / "traffic_vs_n.png")], cwd=ROOT)
    assert r.returncode == 1, "figures/ must stay tracked"
