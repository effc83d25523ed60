"""The exact log scale: matplotlib's log scale with a transform that does not depend on the CPU.

A figure drawn on it is the same PNG, byte for byte, whatever SIMD paths NumPy dispatches
to: the last test draws one in two subprocesses, once with NumPy's dispatched features
switched off (NPY_DISABLE_CPU_FEATURES), and compares the bytes.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure

from iokernels.viz import exact_log

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("base, log", [(10, math.log10), (2, math.log2), (math.e, math.log)])
def test_transform_is_the_scalar_log_bit_for_bit(rng, base, log):
    x = np.exp(rng.uniform(-40, 40, 500))
    got = exact_log.ExactLogTransform(base).transform_non_affine(x)
    want = np.array([log(v) for v in x])
    np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))
    back = exact_log.InvertedExactLogTransform(base).transform_non_affine(got)
    np.testing.assert_allclose(back, x, rtol=1e-13)


def test_nonpositive_values_are_clipped_or_masked_like_matplotlibs():
    x = np.array([[-1.0], [0.0], [np.nan], [100.0]])
    clipped = exact_log.ExactLogTransform(10, "clip").transform_non_affine(x)
    assert clipped.shape == x.shape
    assert clipped[0, 0] == clipped[1, 0] == -1000.0 and np.isnan(clipped[2, 0]) and clipped[3, 0] == 2.0
    masked = exact_log.ExactLogTransform(10, "mask").transform_non_affine(x)
    assert np.isnan(masked[:3]).all() and masked[3, 0] == 2.0
    assert exact_log.InvertedExactLogTransform(10).transform_non_affine(np.array([400.0]))[0] == math.inf


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="base"):
        exact_log.ExactLogTransform(1)
    with pytest.raises(ValueError, match="nonpositive"):
        exact_log.ExactLogTransform(10, "drop")
    with pytest.raises(ValueError, match="axis"):
        exact_log.set_log(Figure().add_subplot(), "z")


def test_same_ticks_and_limits_as_matplotlibs_log_scale():
    def axes(scale, base):
        ax = Figure().add_subplot()
        ax.plot([3, 7e4], [0.02, 9e3])
        ax.set_xscale(scale, base=base)
        ax.set_yscale(scale)
        ax.figure.canvas.draw()
        return ax
    for base in (10, 2):
        a, b = axes("log", base), axes(exact_log.NAME, base)
        np.testing.assert_allclose(a.get_xlim(), b.get_xlim(), rtol=1e-12)
        np.testing.assert_allclose(a.get_ylim(), b.get_ylim(), rtol=1e-12)
        np.testing.assert_allclose(a.get_xticks(), b.get_xticks(), rtol=1e-12)
        assert [t.get_text() for t in a.get_yticklabels()] == [t.get_text() for t in b.get_yticklabels()]
    assert b.get_yscale() == exact_log.NAME


def test_logspace_is_numpys_up_to_rounding():
    np.testing.assert_allclose(exact_log.logspace(0, 4, 200), np.logspace(0, 4, 200), rtol=1e-14)
    assert exact_log.logspace(0, 3, 4).tolist() == [1.0, 10.0, 100.0, 1000.0]


_DRAW = """
import sys
from iokernels.viz import figures
fig = figures.traffic_vs_n()
fig.savefig(sys.argv[1], dpi=figures.DPI, metadata={"Software": None})
"""


#: the features this NumPy build dispatches to and this CPU has, asked of a NumPy that runs
#: with none of them switched off (this process may run under NPY_DISABLE_CPU_FEATURES)
_FEATURES = """
try:
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
except ImportError:                                       # NumPy < 2
    from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
print(" ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f)))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    return dict(env, MPLBACKEND="Agg", PYTHONPATH=str(ROOT), **extra)


def test_a_log_log_figure_is_the_same_png_with_numpys_simd_paths_off(tmp_path):
    features = subprocess.run([sys.executable, "-c", _FEATURES], env=_env(), capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    if not features:
        pytest.skip("NumPy dispatches to no feature beyond its baseline on this CPU: one path only")
    pngs = []
    for name, extra in (("simd", {}), ("baseline", {"NPY_DISABLE_CPU_FEATURES": features})):
        out = tmp_path / f"{name}.png"
        subprocess.run([sys.executable, "-c", _DRAW, str(out)], cwd=ROOT, env=_env(**extra), check=True,
                       timeout=120)
        pngs.append(out.read_bytes())
    assert pngs[0] == pngs[1], f"traffic_vs_n drawn with and without NumPy's {features} differs"


def test_every_log_axis_of_the_package_uses_the_exact_scale():
    """matplotlib's own log scale goes through NumPy's SIMD logarithm: no figure may use it."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "iokernels"
    pattern = re.compile(r"""set_[xy]scale\(\s*["']log["']|(?<!exact_log)\.(loglog|semilogx|semilogy)\(""")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "exact_log.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, f"matplotlib's log scale used at {found}: use iokernels.viz.exact_log"
