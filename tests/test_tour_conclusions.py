"""The tour's one-line conclusions say what the counted numbers show."""
import io
import re

from iokernels import tour


def test_conclusions_follow_the_counts():
    buf = io.StringIO()
    rows = {r.step: r for r in tour.run(tour.SMALL, figures_dir=None, file=buf)}
    text = buf.getvalue()
    naive, fa2 = rows["01 naive forward"], rows["03 tiled forward FA2"]
    (ratio,) = re.findall(r"-> tiled moves ([0-9.]+)x naive's bytes: S and P never reach HBM", text)
    assert abs(float(ratio) - fa2.counted / naive.counted) < 0.005
    (share,) = re.findall(r"-> S and P are (\d+)% of naive's bytes", text)
    sp = sum(sum(naive.traffic.by_tensor[t]) for t in ("S", "P"))
    assert int(share) == round(100 * sp / naive.counted)
    (extra,) = re.findall(r"-> paged decode moves ([0-9,]+) B more", text)
    assert int(extra.replace(",", "")) == rows["08 paged decode"].counted - rows["08 decode (split-KV)"].counted > 0
    # every NumPy step that ran has its conclusion right under it
    lines = text.splitlines()
    for name in ("01 naive forward", "03 tiled forward FA1", "04 backward tiled (FA2)", "08 decode (split-KV)"):
        i = next(i for i, ln in enumerate(lines) if ln.startswith(name))
        assert lines[i + 1].startswith("    -> "), lines[i:i + 2]
