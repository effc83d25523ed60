"""iokernels.core.recorded: selecting and comparing rows of a recorded GPU run (synthetic record)."""
import numpy as np
import pytest

from iokernels import recorded


def _record(rng):
    """Two decode cases with random times; one runner failed in the second case."""
    cases = []
    for batch in (1, 8):
        times = dict(zip(("sdpa:cudnn", "sdpa:flash", "numba:v1", "numba:v2", "cupy:split"),
                         rng.uniform(0.05, 2.0, size=5)))
        results = [dict(runner=n, ms=float(t), status="ok") for n, t in times.items()]
        if batch == 8:
            results[3] = dict(runner="numba:v2", status="unavailable: x")
        cases.append(dict(section="decode", dtype="float16", causal=False, best_sdpa="sdpa:cudnn",
                          shape=dict(batch=batch, seqlen=4096), results=results))
    return {"env": {"gpu": "X"}, "bench": {"cases": cases}}


def test_runner_patterns_keep_order_and_skip_failed_rows(rng):
    rec = _record(rng)
    rows = recorded.bench_rows(rec, runners=("sdpa:*", "numba:*"))
    names = [(r["batch"], r["runner"]) for r in rows]
    assert names == [(1, "sdpa:cudnn"), (1, "sdpa:flash"), (1, "numba:v1"), (1, "numba:v2"),
                     (8, "sdpa:cudnn"), (8, "sdpa:flash"), (8, "numba:v1")]


def test_speed_vs_is_taken_from_the_same_case(rng):
    rec = _record(rng)
    for batch in (1, 8):
        case = next(c for c in rec["bench"]["cases"] if c["shape"]["batch"] == batch)
        ms = {r["runner"]: r["ms"] for r in case["results"] if "ms" in r}
        got = recorded.ratio(rec, "cupy:split", "sdpa:cudnn", batch=batch)
        assert got == pytest.approx(ms["sdpa:cudnn"] / ms["cupy:split"], rel=1e-12)
        rows = recorded.bench_rows(rec, runners=("numba:v1",), vs="sdpa:flash", batch=batch)
        assert len(rows) == 1
        assert rows[0]["speed_vs_sdpa:flash"] == pytest.approx(ms["sdpa:flash"] / ms["numba:v1"], rel=1e-12)


def test_ratio_refuses_ambiguous_or_missing_cases(rng):
    rec = _record(rng)
    with pytest.raises(ValueError, match="filters"):
        recorded.ratio(rec, "cupy:split", "sdpa:cudnn")             # two cases match
    with pytest.raises(ValueError, match="filters"):
        recorded.ratio(rec, "numba:v2", "sdpa:cudnn", batch=8)      # numba:v2 did not run there
    assert np.isfinite(recorded.ratio(rec, "numba:v2", "sdpa:cudnn", batch=1))


def test_compare_two_records_by_same_run_ratios():
    import copy
    rec = recorded.load()
    same = recorded.compare(rec, rec)
    assert same and all(abs(r["change"] - 1) < 1e-12 for r in same)
    faster = copy.deepcopy(rec)
    for c in faster["bench"]["cases"]:
        for r in c["results"]:
            if "speed_vs_best_sdpa" in r:
                r["speed_vs_best_sdpa"] *= 1.25
    rows = recorded.compare(rec, faster)
    assert rows and all(abs(r["change"] - 1.25) < 1e-9 for r in rows if r["section"] != "gather")


def test_compare_maps_old_runner_names_to_the_registry_names():
    def record(runner, speed):
        return {"bench": {"cases": [{"section": "decode", "kind": "decode", "dtype": "float16", "causal": False,
                                     "shape": {"batch": 1, "seqlen": 4096},
                                     "results": [{"runner": runner, "status": "ok", "ms": 1.0,
                                                  "speed_vs_best_sdpa": speed}]}]}}
    rows = recorded.compare(record("cupy:split paged", 0.5), record("cupy:v3 paged", 0.75))
    assert len(rows) == 1 and rows[0]["runner"] == "cupy:v3 paged" and abs(rows[0]["change"] - 1.5) < 1e-12


def test_the_hopper_record_gives_the_gemm_rows():
    rows = recorded.hopper_gemm_rows(recorded.load("hopper"))
    assert rows and all(r["ours_ms"] > 0 and r["torch_ms"] > 0 for r in rows)
    assert all(abs(r["ratio"] - r["torch_ms"] / r["ours_ms"]) < 1e-9 for r in rows)
