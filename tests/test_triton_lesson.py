"""Notebook 15's helpers (iokernels.triton_backend.lesson) and its predict-then-check questions."""
from __future__ import annotations

import json

import numpy as np
import pytest

from iokernels.core import conventions as cv
from iokernels.labs.predict_triton import TRITON_QUESTIONS, reveal
from iokernels.triton_backend import launch, lesson

WHY = launch.unavailable()


def test_programs_is_the_grid_and_refuses_bad_sizes():
    assert lesson.programs(2, 8, 1000, 64) == 16 * 16
    assert lesson.programs(1, 1, 64, 64) == 1 and lesson.programs(1, 1, 65, 64) == 2
    assert lesson.programs(3, 2, 0, 16) == 0
    with pytest.raises(ValueError, match="block_q"):
        lesson.programs(1, 1, 10, 0)
    with pytest.raises(ValueError, match="seqlen_q"):
        lesson.programs(1, 1, -1, 16)


@pytest.mark.parametrize("nq,nk,bq,bk,causal,window", [(256, 256, 64, 64, True, None), (37, 45, 16, 16, True, None),
                                                       (45, 37, 16, 8, True, None), (50, 50, 16, 16, False, (8, 0)),
                                                       (33, 70, 16, 32, False, None)])
def test_tiles_visited_counts_the_tiles_that_hold_a_visible_key(nq, nk, bq, bk, causal, window):
    """Brute force: a (Q tile, K tile) pair is loaded when some key between the span's ends lies in it."""
    visited, total = lesson.tiles_visited(nq, nk, bq, bk, causal, window)
    assert total == -(-nq // bq) * -(-nk // bk)
    want = 0
    for r0 in range(0, nq, bq):
        lo, hi = cv.key_range(np.arange(r0, min(r0 + bq, nq)), nq, nk, causal, window)
        a, b = lo.min(), hi.max()
        want += sum(1 for c0 in range(0, nk, bk) if b > a and c0 < b and c0 + bk > (a // bk) * bk)
    assert visited == want
    if not causal and window is None:
        assert visited == total


def test_causal_square_visits_the_lower_triangle_of_tiles():
    assert lesson.tiles_visited(256, 256, 64, 64, causal=True) == (10, 16)


def test_the_questions_reveal_only_after_a_prediction():
    assert set(TRITON_QUESTIONS) == {"triton_v1_programs", "triton_causal_tiles"}
    assert reveal("triton_v1_programs", None).correct is None
    assert reveal("triton_v1_programs", 256).correct
    assert not reveal("triton_v1_programs", 16).correct
    assert reveal("triton_causal_tiles", {"visited": 10, "total": 16}).correct
    assert not reveal("triton_causal_tiles", {"visited": 16, "total": 16}).correct


def test_the_table_names_a_source_for_every_row():
    text = lesson.who_decides_table()
    for what, _, _, src in lesson.WHO_DECIDES:
        assert what in text and src.endswith(("(docs)", "(code)", "(paper)", "(blog post)"))
    assert lesson.FORWARD_V1.exists()


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_check_holds_v1_to_the_oracle(dtype, causal):
    _, check = lesson.interpreter_check(dtype, causal, seqlen_q=19, seqlen_k=23, head_dim=16)
    assert check.ok, check
    assert np.isfinite(check.bound) and check.error > 0


def test_without_triton_the_check_says_what_to_install(monkeypatch):
    monkeypatch.setattr(launch, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match=r"iokernels\[triton\]"):
        lesson.interpreter_check()


def test_the_decode_depth_table_sets_v2s_deeper_split_beside_v1s(tmp_path):
    from iokernels.decode import occupancy_splits
    lines = lesson.decode_depth_table(sms=132, sweep=None).splitlines()
    rows = [ln for ln in lines if "|" in ln and not ln.lstrip().startswith("B")]
    assert len(rows) == 6
    for row in rows:
        b, n, s1, p1, s2, p2, s3, p3 = (int(t) for part in row.split("|")[:4] for t in part.split())
        assert s1 == occupancy_splits(b, 8, n, 132, block_n=32) and p1 == s1 * b * 8
        assert s2 == occupancy_splits(b, 8, n, 4 * 132, block_n=32) and p2 == s2 * b * 8 and s2 >= s1
        assert s3 == occupancy_splits(b, 8, n, 3 * 132, block_n=32) and p3 == s3 * b * 8 and s2 >= s3 >= s1
    # a recorded sweep's speeds, found by the rows of each version's setting; "-" where it has none
    group = "decode float16 B=8 Hq=32 Hkv=8 N=4096 d=128"
    rec = {"env": {"gpu": "a test GPU"}, "rows": [
        dict(group=group, runner=r, ratio_to_best_sdpa=x) for r, x in
        (("triton v1", 0.5), ("triton v1 2 stages x4 deep", 0.75), ("triton v1 paged", 0.25),
         ("triton v1 2 stages x4 deep paged", 1.0), ("triton v3 paged", 0.95))]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(rec))
    table = lesson.decode_depth_table(sweep=path)
    assert "0.50, 0.75, - (0.25, 1.00, 0.95)" in table and "recorded on a test GPU" in table
    assert sum("(" in ln for ln in table.splitlines()[1:-1]) == 1           # the other shapes have no speeds
