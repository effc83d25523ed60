"""iokernels.core.recorded: selecting and comparing rows of a recorded GPU run (synthetic record)."""
import json

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
    assert rows and all(abs(r["change"] - 1.25) < 1e-9 for r in rows if r["section"] not in ("gather", "mla"))


def test_compare_maps_old_runner_names_to_the_registry_names():
    def record(runner, speed):
        return {"bench": {"cases": [{"section": "decode", "kind": "decode", "dtype": "float16", "causal": False,
                                     "shape": {"batch": 1, "seqlen": 4096},
                                     "results": [{"runner": runner, "status": "ok", "ms": 1.0,
                                                  "speed_vs_best_sdpa": speed}]}]}}
    rows = recorded.compare(record("cupy:split paged", 0.5), record("cupy:v3 paged", 0.75))
    assert len(rows) == 1 and rows[0]["runner"] == "cupy:v3 paged" and abs(rows[0]["change"] - 1.5) < 1e-12


def test_sections_without_sdpa_compare_by_their_own_baseline():
    """The gathers by their ratio to the device copy, MLA decode by its ratio to torch's matrix
    products: both records' rows of those sections are compared."""
    def record(speed):
        rows = [("gather", {"batch": 1, "seqlen": 4096}, "cupy:v1 gather", "speed_vs_copy"),
                ("mla", {"batch": 8, "heads_q": 128, "seqlen": 8192}, "cupy:v1", "speed_vs_torch_matmul")]
        return {"bench": {"cases": [{"section": s, "kind": s, "dtype": "bfloat16", "causal": False, "shape": shape,
                                     "results": [{"runner": n, "status": "ok", "ms": 1.0, key: speed}]}
                                    for s, shape, n, key in rows]}}
    rows = recorded.compare(record(2.0), record(2.2))
    assert sorted(r["section"] for r in rows) == ["gather", "mla"]
    assert all(abs(r["change"] - 1.1) < 1e-12 for r in rows)


def test_the_hopper_record_gives_the_gemm_rows():
    rows = recorded.hopper_gemm_rows(recorded.load("hopper"))
    assert rows and all(r["ours_ms"] > 0 and r["torch_ms"] > 0 for r in rows)
    assert all(abs(r["ratio"] - r["torch_ms"] / r["ours_ms"]) < 1e-9 for r in rows)


def test_cache_rows_compare_each_runner_with_its_own_16bit_cache(rng):
    """recorded.cache_rows: every timed runner of a quantized or windowed case, its speed the
    same runner's time over the 16-bit, whole-window cache of that shape over its own; rows
    without a time are left out, and a runner with no 16-bit row gets no speed."""
    ms = {k: float(x) for k, x in zip(("v4_16", "v3_16", "v4_8", "v3_8", "v4_w"), rng.uniform(0.1, 3.0, 5))}
    shape = dict(batch=8, heads_q=32, heads_kv=8, seqlen=32768, head_dim=128)

    def case(kv, window, results):
        return dict(section="decode", kind="decode", dtype="bfloat16", kv_dtype=kv, window=window, shape=shape,
                    results=[dict(runner=f"cupy {v} paged {kv}", group="cupy", ms=m, rate=1.0 / m) for v, m in results]
                    + [dict(runner="cupy v2 paged", group="cupy", status="unavailable: x")])
    rec = {"bench": {"cases": [case("bfloat16", None, [("v4", ms["v4_16"]), ("v3", ms["v3_16"])]),
                               case("int8", None, [("v4", ms["v4_8"]), ("v3", ms["v3_8"]), ("v9", 1.0)]),
                               case("bfloat16", [4096, 0], [("v4", ms["v4_w"])])]}}
    rows = {(r["cache"], r["window"], r["runner"]): r for r in recorded.cache_rows(rec)}
    assert len(rows) == 6
    assert rows[("bfloat16", "all", "cupy v4")]["speed_vs_16bit"] == 1.0
    assert rows[("int8", "all", "cupy v4")]["speed_vs_16bit"] == pytest.approx(ms["v4_16"] / ms["v4_8"])
    assert rows[("int8", "all", "cupy v3")]["speed_vs_16bit"] == pytest.approx(ms["v3_16"] / ms["v3_8"])
    assert rows[("bfloat16", "4096 keys", "cupy v4")]["speed_vs_16bit"] == pytest.approx(ms["v4_16"] / ms["v4_w"])
    assert rows[("int8", "all", "cupy v9")]["speed_vs_16bit"] is None
    assert "speed_vs_16bit" in recorded.format_rows(list(rows.values()), ("cache", "runner", "speed_vs_16bit"))


def test_the_latest_record_of_each_kind_is_a_dated_full_run():
    """``load`` takes the last file of a kind by name, so every committed file its pattern
    matches must be named by the date alone (a partial run filed under the same prefix with a
    suffix, or another GPU's run, would sort after a full H200 run and become "the latest")."""
    import re

    dated = {"h200": r"h200_\d{4}-\d\d-\d\d\.json", "sanitizer": r"sanitizer_\d{4}-\d\d-\d\d\.txt",
             "ceilings": r"ceilings_h200_\d{4}-\d\d-\d\d\.json", "hopper": r"hopper_h200_\d{4}-\d\d-\d\d\.json"}
    assert set(dated) == set(recorded.KINDS)
    for kind, pattern in dated.items():
        files = recorded.available(kind)
        assert files, kind
        for path in files:
            assert re.fullmatch(pattern, path.name), f"{path.name} would be read as a {kind} record"


def test_load_file_reads_one_named_record_and_refuses_others(tmp_path):
    """recorded.load_file: the record of that file name (source_file set), a ValueError naming
    ``name`` for a missing file, a path with folders or a file that is not a .json record."""
    (tmp_path / "h100_2026-01-01_x.json").write_text('{"env": {"gpu": "G"}, "bench": {"cases": []}}')
    rec = recorded.load_file("h100_2026-01-01_x.json", tmp_path)
    assert rec["env"]["gpu"] == "G" and rec["source_file"] == "h100_2026-01-01_x.json"
    for bad in ("h100_2026-01-02_y.json", "../h100_2026-01-01_x.json", "sanitizer_2026-01-01.txt", 3):
        with pytest.raises(ValueError, match="name"):
            recorded.load_file(bad, tmp_path)



def test_load_profiled_takes_the_newest_record_with_a_limits_profile(tmp_path):
    """recorded.load_profiled: the latest H200 record when it has a limits profile, else the
    newest record of any GPU that has one (by the date in its name), else None."""
    def write(name, limits):
        traffic = {"limits": {"cases": [{"case": "c", "kernels": [{"kernel": "k"}]}]}} if limits else {}
        (tmp_path / name).write_text(json.dumps({"env": {"gpu": name}, "bench": {"cases": []}, "traffic": traffic}))
    assert recorded.load_profiled(tmp_path) is None
    write("h200_2026-01-01.json", False)
    write("h100_2026-01-03_probe.json", True)
    write("h100_2026-01-02_older.json", True)
    write("h100_2026-01-04_none.json", False)
    assert recorded.load_profiled(tmp_path)["source_file"] == "h100_2026-01-03_probe.json"
    write("h200_2026-01-05.json", True)
    assert recorded.load_profiled(tmp_path)["source_file"] == "h200_2026-01-05.json"
    assert recorded.limits_table(recorded.load_profiled(tmp_path))
