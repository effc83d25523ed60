"""The figures in git are what ``python -m iokernels figures`` writes.

Each figure is regenerated into a temporary folder (fixed seeds, matplotlib's default
style, no metadata) and compared with the committed copy: same pixel size and an RMS
difference of at most FIGURE_RMS_TOL grey levels, a tolerance that absorbs font
rasterisation differences between FreeType builds but not a moved line or a changed label.
"""
from pathlib import Path

import numpy as np
import pytest

from iokernels.viz import figures

ROOT = Path(__file__).resolve().parents[1]
#: RMS difference allowed, in grey levels of 0..255 (a changed character of a label is ~2)
FIGURE_RMS_TOL = 1.0
ADVICE = "regenerate them with `bash dev.sh figures` and commit figures/"


def _pixels(path):
    from matplotlib import image
    return np.asarray(image.imread(path), dtype=np.float64)[..., :3] * 255


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    return {p.name: p for p in figures.write_all(out, progress=False)}


def test_every_generated_figure_is_committed(regenerated):
    committed = {p.name for p in (ROOT / "figures").glob("*.png")}
    assert committed == set(regenerated), f"figures/ holds {sorted(committed)}; {ADVICE}"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "figures").glob("*.png")))
def test_committed_figure_equals_generated(regenerated, name):
    new, old = _pixels(regenerated[name]), _pixels(ROOT / "figures" / name)
    assert new.shape == old.shape, f"figures/{name} is {old.shape[:2]}, the command draws {new.shape[:2]}; {ADVICE}"
    rms = float(np.sqrt(np.mean((new - old) ** 2)))
    assert rms <= FIGURE_RMS_TOL, f"figures/{name} differs from what the command draws (RMS {rms:.2f}); {ADVICE}"


@pytest.mark.parametrize("kind", ["naive", "fa1", "fa2"])
def test_decompose_sums_to_total_and_names_the_parts(rng, kind):
    import iokernels as ik
    from iokernels import traffic
    nq, nk, d = int(rng.integers(70, 200)), int(rng.integers(70, 200)), 48
    cfg = None if kind == "naive" else ik.TileConfig(block_q=32, block_k=48, loop_order=kind)
    q, k, v = ik.testing.make_inputs(rng, batch=2, heads_q=3, seqlen_q=nq, seqlen_k=nk, head_dim=d,
                                     dtype="float32")
    with traffic.count() as t:
        ik.attention(q, k, v, backend="naive" if kind == "naive" else "tiled", config=cfg)
    parts = traffic.decompose(t, heads=6, seqlen_q=nq, seqlen_k=nk, head_dim=d, itemsize=4)
    assert sum(parts.values()) == t.total
    assert parts["mandatory"] == 6 * (2 * nq + 2 * nk) * d * 4
    assert parts["LSE"] == 6 * nq * 4
    if kind == "naive":
        assert parts["S and P"] == 6 * 4 * nq * nk * 4 and parts["tile re-reads"] == 0
    elif kind == "fa2":                                  # K, V read Tr times: Tr - 1 extra each
        assert parts["tile re-reads"] == 6 * 2 * (-(-nq // 32) - 1) * nk * d * 4
        assert parts["S and P"] == 0


def test_traffic_parts_follow_the_tile_law():
    """FA2's re-reads are 2 N^2 d / Br - 2 N d elements; FA1's fall as Bc (so M) grows."""
    p = figures.traffic_parts(seqlens=(1024, 4096), head_dim=64, dtype="float16", sram_kib=(16, 64, 228))
    for m, entry in p["fa2"].items():
        br = entry["config"].block_q
        assert entry["tile re-reads"] == [2 * (n // br - 1) * n * 64 * 2 for n in p["N"]]
    fa1 = [p["fa1"][m]["tile re-reads"][1] for m in (16, 64, 228)]
    assert fa1[0] > fa1[1] > fa1[2]
    assert p["S and P"] == [4 * n * n * 2 for n in p["N"]]
