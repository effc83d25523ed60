"""The timing helper, the benchmark harness and the GPU scripts' parsers (CPU-only checks).

Speeds are never asserted here: these tests check the machinery (statistics, ratios, the
silent fall-back verdict, paged pools, the ncu CSV grouping, the sanitizer summary).
"""
import importlib.util
import json
import os
import time

import numpy as np
import pytest

from iokernels import bench
from iokernels.paged import paged_gather

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_time_cpu_statistics():
    delays = iter([0.004, 0.001, 0.002, 0.003, 0.005, 0.0])
    t = bench.time_cpu(lambda: time.sleep(next(delays)), warmup=1, reps=5)
    assert t.reps == 5
    assert t.p10 <= t.median_ms <= t.p90
    assert 1.5 <= t.median_ms < 20          # the median of sleeps of 1..5 ms is about 2-3 ms


@pytest.mark.parametrize("kw", [dict(reps=0), dict(warmup=-1)])
def test_timers_reject_bad_counts(kw):
    with pytest.raises(ValueError, match="reps"):
        bench.time_cpu(lambda: None, **kw)


def test_timing_rates():
    t = bench.Timing(median_ms=2.0, p10=1.9, p90=2.2, reps=7)
    assert t.tflops(4e12) == pytest.approx(2000.0)      # 4 TFLOP in 2 ms
    assert t.tbps(3e9) == pytest.approx(1.5)            # 3 GB in 2 ms
    assert t.as_dict()["reps"] == 7


def test_time_cuda_needs_a_gpu():
    if bench.timer._torch_cuda() is not None or bench.timer._cupy_cuda() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        bench.time_cuda(lambda: None)


class _FakeCuda:
    """torch.cuda as release_device_cache sees it: a cache holding ``held`` bytes of which
    ``kept`` stay reserved after empty_cache."""

    def __init__(self, held, kept):
        self.reserved, self.kept, self.calls = held, kept, []

    def synchronize(self):
        self.calls.append("synchronize")

    def memory_reserved(self):
        return self.reserved

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.reserved = self.kept


@pytest.mark.parametrize("held_gib, kept_gib", [(0.0, 0.0), (9.0, 8.0), (120.5, 8.5), (900.0, 0.0)])
def test_release_device_cache_pauses_only_after_a_large_release(monkeypatch, held_gib, kept_gib):
    timer = bench.timer
    held, kept = int(held_gib * 2**30), int(kept_gib * 2**30)
    fake = _FakeCuda(held, kept)
    monkeypatch.setattr(timer, "_torch_cuda", lambda: type("T", (), {"cuda": fake})())
    slept = []
    freed = timer.release_device_cache(sleep=slept.append)
    assert freed == held - kept
    assert fake.calls == ["synchronize", "empty_cache"]           # the queue drained before the release
    if freed > timer.RELEASE_SETTLE_BYTES:
        want = min(timer.RELEASE_SETTLE_MAX_S, timer.RELEASE_SETTLE_S_PER_GIB * freed / 2**30)
        assert slept == [pytest.approx(want)] and 0 < slept[0] <= timer.RELEASE_SETTLE_MAX_S
    else:
        assert slept == []


def test_release_device_cache_without_a_gpu_does_nothing(monkeypatch):
    monkeypatch.setattr(bench.timer, "_torch_cuda", lambda: None)
    slept = []
    assert bench.release_device_cache(sleep=slept.append) == 0 and slept == []


def test_release_device_cache_forgets_the_plans_no_graph_uses(monkeypatch):
    """A case's plans (their workspaces: a deterministic backward's dQ partials are GBs) do not
    outlive the case; a plan a CUDA graph captured stays (the graph writes its workspaces)."""
    from types import SimpleNamespace
    from iokernels.cupy_raw import plans
    cache = plans.PlanCache()
    monkeypatch.setattr(plans, "PLANS", cache)
    monkeypatch.setattr(bench.timer, "_torch_cuda", lambda: None)
    for key, pinned in (("a", False), ("b", True), ("c", False)):
        cache.put(key, SimpleNamespace(pinned=pinned))
    bench.release_device_cache(sleep=lambda s: None)
    assert list(cache._plans) == ["b"]
    assert cache.release() == 0 and len(cache) == 1


def test_finish_case_ratios_and_silent_fallback():
    rows = [dict(runner="sdpa:flash", group="sdpa", status="unavailable: No available kernel"),
            dict(runner="sdpa:efficient", group="sdpa", status="ok", ms=2.0),
            dict(runner="sdpa:math", group="sdpa", status="ok", ms=8.0),
            dict(runner="sdpa:default", group="sdpa", status="ok", ms=8.1),
            dict(runner="numba", group="numba", status="ok", ms=4.0)]
    case = bench.runners._finish_case(dict(results=rows, default_ran="math"))
    assert case["best_sdpa"] == "sdpa:efficient"
    assert rows[4]["speed_vs_best_sdpa"] == pytest.approx(0.5)
    assert rows[2]["speed_vs_best_sdpa"] == pytest.approx(0.25)
    assert "efficient" in case["silent_fallback"]
    ok = bench.runners._finish_case(dict(results=[dict(r) for r in rows], default_ran="efficient"))
    assert "silent_fallback" not in ok


def test_a_slow_row_says_which_runner_on_stderr(monkeypatch, capsys):
    """A row whose whole cost passes SLOW_ROW_S names its runner, time and status on stderr as it
    ends (a time box's log then shows where a case spent its time); a quick one says nothing."""
    from iokernels.bench import runners
    slow = lambda: time.sleep(0.05) or np.zeros(1)                                     # noqa: E731
    monkeypatch.setattr(runners, "SLOW_ROW_S", 0.04)
    row = runners._measure("numpy slow", "numpy", slow, work=1.0, unit="TFLOP/s", device=False)
    assert row["status"] == "ok" and row["wall_s"] >= 0.05
    assert f"    numpy slow: {row['wall_s']:.1f} s (ok)" in capsys.readouterr().err
    monkeypatch.setattr(runners, "SLOW_ROW_S", 60.0)
    runners._measure("numpy quick", "numpy", slow, work=1.0, unit="TFLOP/s", device=False)
    assert "numpy quick" not in capsys.readouterr().err


def test_device_pages_hold_the_same_kv(rng):
    torch = pytest.importorskip("torch")
    k = torch.from_numpy(rng.standard_normal((3, 2, 80, 8)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((3, 2, 80, 8)).astype(np.float32))
    kp, vp, tables, lens = bench.device_pages(k, v, seed=1)
    assert tables.shape == (3, 5) and sorted(tables.ravel().tolist()) == list(range(15))
    assert lens.tolist() == [80, 80, 80]
    for b in range(3):
        kk, vv = paged_gather(kp.numpy(), vp.numpy(), tables[b], 80)
        np.testing.assert_array_equal(kk, k[b].numpy())
        np.testing.assert_array_equal(vv, v[b].numpy())


def test_main_quick_writes_a_record(tmp_path, capsys):
    if bench.timer._torch_cuda() is not None:
        pytest.skip("on a GPU the quick run times kernels; covered by scripts/gpu_all.sh")
    out = tmp_path / "rec.json"
    assert bench.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["env"]["date_utc"] and "recorded on" in rec["label"] and rec["complete"] is True
    rows = [r for c in rec["cases"] for r in c["results"]]
    assert {r["runner"] for r in rows} == {"numpy naive", "numpy tiled"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    assert all(r["wall_s"] >= r["ms"] / 1e3 for r in rows)             # what the row cost the time box
    assert "numpy tiled" in capsys.readouterr().out


def test_backends_restricts_the_gpu_rows_for_one_run_and_says_so(tmp_path, monkeypatch):
    """--backends: the run times only those backends' rows (the record's settings say which), the
    selection ends with the run (a run stopped by its time box too), and a name that is not a GPU
    backend is refused before anything runs."""
    from iokernels.bench import cli, runners
    monkeypatch.setattr(cli, "_torch_cuda", lambda: object())        # take the GPU branch
    seen = []

    def cases(p, seed, bar, *, into, **kw):
        seen.append(runners.row_backends())
        into.append({"section": "decode", "results": []})
        return into
    monkeypatch.setattr(cli, "decode_cases", cases)
    monkeypatch.setattr(cli, "quant_decode_cases", lambda *a, into, **kw: into)
    rec = cli.run(("decode",), progress=False, backends=("triton",))
    assert seen == [("triton",)] and rec["settings"]["backends"] == ["triton"]
    assert runners.row_backends() == runners.GPU_ROW_BACKENDS
    monkeypatch.setattr(cli, "decode_cases", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        cli.run(("decode",), progress=False, backends=("cupy", "triton"))
    assert runners.row_backends() == runners.GPU_ROW_BACKENDS
    for bad in ("sdpa", ""):
        with pytest.raises(SystemExit):
            bench.main(["--backends", bad, "--no-progress", "--out", str(tmp_path / "x.json")])
        assert not (tmp_path / "x.json").exists()
    with pytest.raises(ValueError, match="backends"):
        runners.set_row_backends(["numba", "jax"])
    assert runners.row_backends() == runners.GPU_ROW_BACKENDS


def test_run_checkpoints_each_section_so_a_time_box_keeps_what_finished(tmp_path, monkeypatch, capsys):
    """A bench stopped by its time box must still leave the sections it finished on disk."""
    from iokernels.bench import cli
    monkeypatch.setattr(cli, "_torch_cuda", lambda: object())        # take the GPU branch
    done = []

    def section(name):
        def cases(p, seed, bar, *, into, **kw):
            for i in range(2):
                bar.set_description(f"{name} case {i}")
                if name == "gather" and i == 1:
                    raise KeyboardInterrupt("the time box ends the run here")
                into.append({"section": name, "case": i, "results": []})
            done.append(name)
            return into
        return cases

    for fn, name in [("prefill_cases", "prefill"), ("decode_cases", "decode"),
                     ("quant_decode_cases", "decode_quant"), ("gather_cases", "gather")]:
        monkeypatch.setattr(cli, fn, section(name))
    out = tmp_path / "bench.json"
    seen = []

    def checkpoint(rec):
        seen.append([c["section"] for c in rec["cases"]])
        cli.write_record(rec, out)

    with pytest.raises(KeyboardInterrupt):
        cli.run(("prefill", "decode", "gather"), progress=False, checkpoint=checkpoint)
    assert done == ["prefill", "decode", "decode_quant"]
    rec = json.loads(out.read_text())
    # saved when each case starts: the first gather case, finished before the time box, is kept
    assert rec["complete"] is False and [c["section"] for c in rec["cases"]] == seen[-1] == \
        ["prefill"] * 2 + ["decode"] * 2 + ["decode_quant"] * 2 + ["gather"]
    assert seen[0] == [] and all(len(a) <= len(b) for a, b in zip(seen, seen[1:]))
    assert not list(tmp_path.glob("*.part"))                          # written whole, by one rename
    log = capsys.readouterr().out.splitlines()                          # without a bar: a line a case
    assert [ln.split("] ", 1)[1] for ln in log] == [f"{s} case {i}" for s in ("prefill", "decode", "decode_quant")
                                                    for i in (0, 1)] + ["gather case 0", "gather case 1"]
    assert all(ln.startswith("[") and " s] " in ln for ln in log)


def test_main_rejects_unknown_sections():
    with pytest.raises(SystemExit):
        bench.main(["--sections", "prefill,bogus"])


def test_ncu_csv_grouping_by_markers(tmp_path):
    pt = _script("profile_traffic")
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"')
    lines = ["==PROF== Connected", header, '"","","","","","","","","","","","byte","byte","nsecond"']

    def k(i, name, r, w):
        lines.append(f'"{i}","1","p","h","{name}","1","7","(1,1,1)","(1,1,1)","0","9.0","{r}","{w}","1000"')
    k(0, "ik_l2flush", 9e8, 0)
    k(1, "ik_marker", 0, 0)
    k(2, "gemm_a", 100, 10)
    k(3, "softmax_b", 50, 40)
    k(4, "ik_l2flush", 9e8, 0)
    k(5, "ik_marker", 0, 0)
    k(6, "copy_c", 1000, 1000)
    (tmp_path / "ncu_raw.csv").write_text("\n".join(lines) + "\n")
    plan = [dict(index=0, case="naive attention", family="torch", size="small", status="ok", marker=0,
                 model_read=150, model_written=50, mandatory_read=100, mandatory_written=10),
            dict(index=1, case="numba decode", family="numba", size="small", status="unavailable: x"),
            dict(index=2, case="copy", family="torch", size="large", status="ok", marker=1,
                 model_read=1000, model_written=1000, mandatory_read=1000, mandatory_written=1000)]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rec = pt.parse(str(tmp_path))
    a, b, c = rec["cases"]
    assert (a["measured_read"], a["measured_written"]) == (150, 50)
    assert a["kernels"] == ["gemm_a", "softmax_b"] and a["measured_over_model"] == 1.0
    assert "measured_read" not in b and b["status"].startswith("unavailable")
    assert (c["measured_read"], c["measured_written"]) == (1000, 1000)



def test_traffic_plan_has_every_backward_version_and_every_family_first():
    """The dry run (no GPU): every registered backward version in both dQ modes, with its
    per-kernel model; the first case of every family comes before any family's second."""
    pt = _script("profile_traffic")
    from iokernels import cupy_raw, numba_cuda
    entries = pt.plan()
    names = [e["case"] for e in entries]
    for fam, reg in (("cupy", cupy_raw.REGISTRY), ("numba", numba_cuda.REGISTRY)):
        for kern in reg.kernels("attention_backward"):
            mine = [e for e in entries if e["case"] == f"{fam} backward {kern.version}"]
            assert {e["problem"]["deterministic"] for e in mine} == {False, True}, fam
            for e in mine:
                assert "model_error" not in e, e
                parts = e["model_by_kernel"]
                assert set(parts) == {"zero", "rowsum", "main", "finish"}
                assert sum(r + w for r, w in parts.values()) == e["model_read"] + e["model_written"]
    firsts = [names.index(n) for n in dict.fromkeys(names)]
    seconds = [i for i, n in enumerate(names) if i not in firsts]
    assert max(firsts) < min(seconds)
    assert "cupy backward v1" in pt.plan_table(entries)


def test_ncu_csv_backward_kernels_split_by_part(tmp_path):
    """A backward case: each profiled kernel is filed under the model's part by its name."""
    pt = _script("profile_traffic")
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"')
    lines = [header, '"","","","","","","","","","","","byte","byte","nsecond"']
    kernels = [("ik_l2flush", 9e8, 0), ("ik_marker", 0, 0),
               ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 0, 64),
               ("bwd_rowsum", 64, 16), ("bwd_main", 200, 100), ("bwd_finish", 64, 32),
               ("_ZN9iokernels10numba_cuda8backward13_make_kernels12main_kernel", 7, 3)]
    for i, (name, r, w) in enumerate(kernels):
        lines.append(f'"{i}","1","p","h","{name}","1","7","(1,1,1)","(1,1,1)","0","9.0","{r}","{w}","1000"')
    (tmp_path / "ncu_raw.csv").write_text("\n".join(lines) + "\n")
    model = {"zero": [0, 64], "rowsum": [64, 16], "main": [200, 100], "finish": [64, 32]}
    plan = [dict(index=0, case="cupy backward v1", family="cupy", size="small", status="ok", marker=0,
                 model_read=328, model_written=212, model_by_kernel=model, mandatory_read=100,
                 mandatory_written=50)]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rec = pt.parse(str(tmp_path))
    (c,) = rec["cases"]
    assert c["measured_by_kernel"] == {"zero": [0, 64, 1], "rowsum": [64, 16, 1], "main": [207, 103, 2],
                                       "finish": [64, 32, 1]}
    assert (c["measured_read"], c["measured_written"]) == (335, 215)
    assert pt.backward_kernel_part("cupy_copy") == "other"
    main = [ln for ln in pt.table(rec).splitlines() if ln.startswith("cupy backward v1") and " main " in ln]
    assert len(main) == 1 and main[0].split()[-1] == "1.03"             # (207 + 103) / 300

def test_limits_plan_pairs_each_kernel_of_ours_with_the_kernel_its_bar_names():
    """The limits profile's dry run (no GPU): every case says what its bar holds it to, each
    family of ours comes before the SDPA kernel it is held to, and the table prints."""
    pt = _script("profile_traffic")
    entries = pt.plan(limits=True)
    names = [e["case"] for e in entries]
    assert {"numba decode", "numba attention", "cupy fp8 forward v1", "cupy backward causal"} <= set(names)
    # the float32 forward's bar: Numba's v5 (register tiles) and CUDA C++'s v1b on the same CUDA cores beside it
    fp32 = [n for n, e in zip(names, entries) if "attention" in n and e["problem"].get("dtype") == "float32"]
    assert fp32 == ["numba attention", "numba attention v5", "numba attention v6", "numba attention v7",
                    "cupy attention v1b", "sdpa attention efficient"]
    assert all(e["held_to"] and "model_read" not in e for e in entries)
    for ours, sdpa in (("numba decode", "sdpa decode cudnn"), ("numba attention", "sdpa attention efficient"),
                       ("cupy backward causal", "sdpa backward flash causal"), ("cupy decode", "sdpa decode flash"),
                       ("cupy decode g16", "sdpa decode g16 cudnn")):
        assert names.index(ours) < names.index(sdpa)
        assert entries[names.index(ours)]["problem"] == entries[names.index(sdpa)]["problem"]
    table = pt.plan_table(entries)
    assert "held to" in table and "0.8x SDPA cuDNN" in table
    assert [e["case"] for e in pt.plan("fp8", limits=True)] == ["cupy fp8 forward v1", "cupy fp8 forward v2"]
    assert [e["case"] for e in pt.plan("g16", limits=True)] == ["cupy decode g16", "sdpa decode g16 cudnn"]


def test_limits_profile_summarizes_each_kernel_and_joins_the_traffic_record(tmp_path):
    """A limits case: each kernel's figures from whichever spelling of a metric was collected, its
    busiest pipes and costliest stalls (not "selected"), its share of the case's time; the
    table shows the kernels that take a tenth of a case, and the traffic record carries it all."""
    pt = _script("profile_traffic")
    from iokernels.core import recorded
    metrics = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed",
               "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
               "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
               "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
               "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
               "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio",
               "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
               "smsp__average_warp_latency_issue_stalled_barrier.ratio"]
    ident = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",' \
            '"Grid Size","Device","CC"'
    lines = [ident + "," + ",".join(f'"{m}"' for m in metrics), '"","","","","","","","","","","",' +
             ",".join('"x"' for _ in metrics)]
    numba = "_ZN" + "".join(f"{len(p)}{p}" for p in ("iokernels", "numba_cuda", "decode_v4", "split")) + "B2v1E"

    def k(i, name, t_ns, fma=0.0):
        vals = [t_ns, 40, 61.5, 88, 45, 96, fma, fma + 5, 30, 12, 4.25, 9.0, 1.0, 2.5, 0.75]
        lines.append(f'"{i}","1","p","h","{name}","1","7","(1,1,1)","(1,1,1)","0","9.0",' +
                     ",".join(f'"{v}"' for v in vals))
    k(0, "ik_l2flush", 5e5)
    k(1, "ik_marker", 1e3)
    k(2, numba, 9e5, fma=70)
    k(3, "void combine<float, 128>(float*)", 1e5)
    (tmp_path / "limits_raw.csv").write_text("==PROF== Connected\n" + "\n".join(lines) + "\n")
    plan = [dict(index=0, case="numba decode", family="numba", held_to="0.8x SDPA cuDNN", status="ok", marker=0),
            dict(index=1, case="sdpa decode cudnn", family="torch", held_to="its bar", status="unavailable: x")]
    (tmp_path / "limits_plan.json").write_text(json.dumps(plan))
    rec = pt.parse_limits(str(tmp_path))
    split, combine = rec["cases"][0]["kernels"]
    assert split["kernel"] == "decode_v4.split" and combine["kernel"] == "combine"
    assert (split["time_us"], split["share"], combine["share"]) == (900.0, 0.9, 0.1)
    assert (split["sm_pct"], split["dram_pct"], split["issue_pct"], split["occupancy_pct"], split["registers"]) \
        == (40, 61.5, 88, 45, 96)
    assert split["cycles_per_issue"] is None                            # not collected
    assert split["pipes"] == {"fma": 75, "xu": 30, "lsu": 12}           # the larger spelling of fma
    assert split["stalls"] == {"long_scoreboard": 4.25, "math_pipe_throttle": 2.5, "barrier": 0.75}
    assert "kernels" not in rec["cases"][1]
    table = recorded.limits_table({"traffic": {"limits": rec}})
    rows = table.splitlines()[1:]
    assert len(rows) == 2 and rows[0].startswith("numba decode") and "decode_v4.split" in rows[0]
    assert "fma 75, xu 30, lsu 12" in rows[0] and "long_scoreboard 4.2" in rows[0]
    assert recorded.limits_table({"traffic": {}}) == ""
    assert recorded.limits_table({"traffic": {"limits": rec}}, cases=("sdpa decode cudnn",)) == ""
    assert recorded.limits_table({"traffic": {"limits": rec}}, cases=("numba decode",)) == table
    readme = _script("readme_table").limits_table({"traffic": {"limits": rec}})     # the README's block
    assert readme[0].startswith("**What bounds") and readme[2:5] == ["```", table, "```"]
    assert _script("readme_table").limits_table({"traffic": {}}) == []
    # the traffic's parse files the limits with the bytes
    (tmp_path / "ncu_raw.csv").write_text(ident + ',"dram__bytes_read.sum"\n')
    (tmp_path / "plan.json").write_text("[]")
    assert pt.parse(str(tmp_path))["limits"] == rec
    assert json.loads((tmp_path / "traffic.json").read_text())["limits"]["cases"][0]["case"] == "numba decode"


def test_sanitizer_summary(tmp_path):
    sz = _script("sanitize")
    (tmp_path / "sanitize_memcheck.log").write_text(
        "========= COMPUTE-SANITIZER\n[ 0.1s] case selftest:ik_selftest: ok\n"
        "[ 2.0s] family numba: 3 cases ok, 0 failed\n[ 2.0s] case numba:forward_v1: ok\n"
        "========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "sanitize_memcheck.rc").write_text("0\n")
    (tmp_path / "sanitize_initcheck_cupy.log").write_text("========= ERROR SUMMARY: 0 errors\n")
    # past --print-limit a second line counts the errors not printed (seen on the H200)
    (tmp_path / "sanitize_memcheck_cupy.log").write_text(
        "========= ERROR SUMMARY: 352 errors\n========= ERROR SUMMARY: 302 errors were not printed. Use "
        "--print-limit option to adjust the number of printed errors\n")
    (tmp_path / "sanitize_memcheck_cupy.rc").write_text("99\n")
    (tmp_path / "sanitize_racecheck.log").write_text(
        "========= COMPUTE-SANITIZER\n========= Error: Race reported between Write access ...\n"
        "[ 1.0s] case cupy:decode: FAILED AssertionError: x\n========= ERROR SUMMARY: 2 errors\n")
    (tmp_path / "sanitize_racecheck.rc").write_text("99\n")
    # racecheck's own closing line (seen on the H200): no "ERROR SUMMARY" at all
    (tmp_path / "sanitize_racecheck_numba.log").write_text(
        "[ 1.0s] case numba:gather: ok\n"
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    (tmp_path / "sanitize_racecheck_numba.rc").write_text("0\n")
    text = sz.summarize(str(tmp_path), "recorded on X")
    assert "memcheck           0 errors" in text and "racecheck          2 errors" in text
    assert "racecheck_numba    0 errors" in text
    assert "memcheck_cupy      352 errors" in text
    assert "synccheck  not run" in text and "total sanitizer errors: 354" in text
    assert "initcheck_cupy     0 errors" in text
    assert "INCOMPLETE: synccheck did not finish" in text
    assert "FAILED: cupy:decode:" in text or "FAILED: cupy:decode" in text


def test_sanitizer_families_each_name_a_module_with_its_cases():
    """gpu_all.sh runs one sanitizer process per family of scripts/sanitize.py: each must exist."""
    import importlib
    sz = _script("sanitize")
    assert set(sz.FAMILIES) == {"numba", "cupy", "triton"}
    for family, module in sz.FAMILIES.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, family
        text = open(spec.origin).read()
        assert "sanitize_cases" in text, f"{module} does not export sanitize_cases"
    script = open(os.path.join(ROOT, "scripts", "gpu_all.sh")).read()
    assert f"SAN_FAMILIES=${{SAN_FAMILIES:-{' '.join(sz.FAMILIES)}}}" in script
    assert "for fam in $SAN_FAMILIES; do" in script


def test_every_test_skipped_without_a_gpu_is_marked_gpu():
    """scripts/gpu_all.sh selects the GPU tests with ``-m gpu``: a test under a module's ``gpu``
    skip decorator that lacks ``@pytest.mark.gpu`` skips here and is never selected there."""
    import ast
    import glob
    unmarked = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            names = {ast.unparse(d) for d in node.decorator_list}
            if "gpu" in names and "pytest.mark.gpu" not in names:
                unmarked.append(f"{os.path.basename(path)}::{node.name}")
    assert not unmarked, f"skipped without a GPU but not marked gpu: {unmarked}"


def test_paged_prefill_section_is_declared_and_tabled():
    """The paged prefill rows: a default section, their shape text and their ratio (vs the
    contiguous CuPy prefill of the same chunks) in the table."""
    from iokernels.bench import cli, specs
    assert "paged_prefill" in specs.DEFAULT_SECTIONS and "paged_prefill" in specs.QUICK
    for B, n, nq in specs.PAGED_PREFILL["shapes"]:
        assert nq <= n and n % specs.PAGED_BLOCK == 0
    case = dict(section="paged_prefill", kind="paged_prefill", dtype="bfloat16", causal=True,
                shape=dict(batch=8, heads_q=32, heads_kv=8, seqlen=8192, chunk=512, head_dim=128),
                results=[dict(runner="cupy contiguous", group="cupy", status="ok", ms=2.0, rate=1.0,
                              unit="TFLOP/s", speed_vs_contiguous=1.0),
                         dict(runner="cupy:v1", group="cupy", status="ok", ms=2.1, rate=0.9, unit="TFLOP/s",
                              speed_vs_contiguous=0.9524)])
    text = cli.table(dict(label="x", cases=[case]))
    assert "B8 32/8 n8192 c512 d128" in text and "0.952" in text


def test_paged_prefill_rows_are_every_version_v2_the_default():
    """The paged prefill section times one row per registered CuPy version (v2, the GQA group
    packed into the tile, and v3, the Hopper one, each its own row next to v1), the default marked
    (v2 here, where no Hopper GPU runs v3)."""
    from iokernels.bench.runners import registry_versions
    q, pool = np.zeros((5, 8, 64), np.float16), np.zeros((4, 16, 2, 64), np.float16)
    rows = registry_versions("cupy", "paged_prefill", q=q, k=pool, v=pool)
    if isinstance(rows[0][1], Exception):
        pytest.skip(f"the CuPy backend is not importable here: {rows[0][1]}")
    assert [(name, cfg.version, default) for name, cfg, default in rows] == [
        ("cupy:v1", "v1", False), ("cupy:v2", "v2", True), ("cupy:v3", "v3", False)]


def _without_attention_v9_v10(monkeypatch, versions=("v9", "v10", "v11")):
    """The registry as it was before attention v9, v10 and v11 (held back, ranked above every version)
    were registered (or without ``versions``), for the tests of v8's gates below; restored after the test."""
    from iokernels.cupy_raw import REGISTRY
    for version in versions:
        monkeypatch.delitem(REGISTRY._kernels, ("attention", version))
    monkeypatch.setattr(REGISTRY, "generation", REGISTRY.generation + 1)
    monkeypatch.setattr(REGISTRY, "_by_op", (-1, {}))      # another test may have cached this generation


def test_the_held_back_row_is_the_highest_ranked_version_the_default_does_not_pick(monkeypatch, rng):
    """As if on a Hopper GPU, at 8 query rows over 8 keys: the default is v9 (few key tiles,
    policy.hopper_forward_for_length), and the cliff's extra prefill row is the highest-ranked version
    above it the default does not pick there, v11, with the length policy's reason; without v11, v10
    at head_dim 64 and none at 128 and 256 (v9 the highest-ranked version that runs there); with v9
    held back (policy.HELD_BACK), v9 itself, with that reason."""
    from iokernels.bench.cliff import registry_held_back
    from iokernels.bench.runners import registry_versions
    from iokernels.core.testing import make_inputs
    from iokernels.cupy_raw import policy
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    inputs = {d: make_inputs(rng, heads_q=2, seqlen_q=8, seqlen_k=8, head_dim=d, dtype="bfloat16")
              for d in (64, 128, 256)}
    for d, (q, k, v) in inputs.items():
        got = registry_held_back("cupy", "attention", q=q, k=k, v=v, causal=True)
        if got is None:
            pytest.skip("the CuPy backend is not importable here")
        assert got[0] == "cupy:v11" and "v9 is (policy.hopper_forward_for_length)" in got[2]
        assert [name for name, _, default in registry_versions("cupy", "attention", q=q, k=k, v=v, causal=True)
                if default] == ["cupy:v9"]
    _without_attention_v9_v10(monkeypatch, versions=("v11",))
    for d, (q, k, v) in inputs.items():
        got = registry_held_back("cupy", "attention", q=q, k=k, v=v)
        assert (got[0] if got else None) == ("cupy:v10" if d == 64 else None)
    monkeypatch.setitem(policy.HELD_BACK, ("attention", "v9"), "a record")
    name, cfg, why = registry_held_back("cupy", "attention", q=q, k=k, v=v)
    assert name == "cupy:v9" and cfg.version == "v9" and "a record" in why


def test_registry_held_back_names_the_version_the_default_gate_keeps_out(monkeypatch, rng):
    """The cliff's extra prefill row: the highest-ranked version the default may not pick here, with
    the first reason it gives.  As if on a Hopper GPU without v9 and v10, with v8 held back (policy.HELD_BACK): at
    head_dim 256 v7 is the default and v8 the row; with 256 out of the Hopper gate the default keeps
    the portable kernel and v8's row says so; at 128 (v5 the default) v8 is the row, by HELD_BACK
    and, once that lets it go, by its head-dim gate (policy.hopper_v8_default_at) where that gate
    leaves 128 out."""
    from iokernels.bench.cliff import registry_held_back
    from iokernels.core.testing import make_inputs
    from iokernels.cupy_raw import policy
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    _without_attention_v9_v10(monkeypatch)
    monkeypatch.setitem(policy.HELD_BACK, ("attention", "v8"), "a cliff record")
    wide = make_inputs(rng, heads_q=2, seqlen_q=8, seqlen_k=8, head_dim=256, dtype="bfloat16")
    name, cfg, why = registry_held_back("cupy", "attention", q=wide[0], k=wide[1], v=wide[2])
    assert name == "cupy:v8" and cfg.version == "v8" and "a cliff record" in why
    monkeypatch.setattr(policy, "HOPPER_DEFAULT_HEAD_DIMS", (64, 128))
    name, cfg, why = registry_held_back("cupy", "attention", q=wide[0], k=wide[1], v=wide[2])
    assert name == "cupy:v8" and why.startswith("not the default at head_dim 256 until")
    q, k, v = make_inputs(rng, heads_q=2, seqlen_q=8, seqlen_k=8, head_dim=128, dtype="bfloat16")
    assert registry_held_back("cupy", "attention", q=q, k=k, v=v)[0] == "cupy:v8"
    monkeypatch.delitem(policy.HELD_BACK, ("attention", "v8"))
    assert registry_held_back("cupy", "attention", q=q, k=k, v=v) is None           # v8 the default
    monkeypatch.setattr(policy, "HOPPER_V8_DEFAULT_HEAD_DIMS", (256,))
    name, cfg, why = registry_held_back("cupy", "attention", q=q, k=k, v=v)
    assert name == "cupy:v8" and why.startswith("not the default at head_dim 128 (policy.hopper_v8_default_at)")


def test_held_back_hopper_versions_get_their_own_row(monkeypatch, rng):
    """As if on a Hopper GPU at head_dim 64, without v9 and v10: the prefill sections time one row per registered
    version, cupy:v6, v7 and v8 among them (not the default: v5 is), and the cliff adds the row of
    the highest-ranked version the default does not pick there, with its reason: v8, by
    policy.HELD_BACK while it holds v8, else by v8's head-dim gate where it leaves 64 out; none once
    that gate opens (v8 the default, v6 and v7 ranked below it); at 128 v6's row is there (it says
    why it cannot run)."""
    from iokernels.bench.cliff import registry_held_back
    from iokernels.bench.runners import registry_versions
    from iokernels.core.testing import make_inputs
    from iokernels.cupy_raw import policy
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    _without_attention_v9_v10(monkeypatch)
    monkeypatch.setitem(policy.HELD_BACK, ("attention", "v8"), "a cliff record")
    q, k, v = make_inputs(rng, heads_q=2, seqlen_q=8, seqlen_k=8, head_dim=64, dtype="bfloat16")
    rows = registry_versions("cupy", "attention", q=q, k=k, v=v)
    if isinstance(rows[0][1], Exception):
        pytest.skip(f"the CuPy backend is not importable here: {rows[0][1]}")
    names = [name for name, _, _ in rows]
    assert names[-5:] == ["cupy:v4", "cupy:v5", "cupy:v6", "cupy:v7", "cupy:v8"]
    assert [name for name, _, default in rows if default] == ["cupy:v5"]
    name, cfg, why = registry_held_back("cupy", "attention", q=q, k=k, v=v)
    assert name == "cupy:v8" and cfg.version == "v8" and "a cliff record" in why
    monkeypatch.delitem(policy.HELD_BACK, ("attention", "v8"))
    monkeypatch.setattr(policy, "HOPPER_V8_DEFAULT_HEAD_DIMS", (256,))
    name, cfg, why = registry_held_back("cupy", "attention", q=q, k=k, v=v)
    assert name == "cupy:v8" and why.startswith("not the default at head_dim 64 (policy.hopper_v8_default_at)")
    monkeypatch.setattr(policy, "HOPPER_V8_DEFAULT_HEAD_DIMS", (64, 128, 256))
    assert [name for name, _, default in registry_versions("cupy", "attention", q=q, k=k, v=v) if default] \
        == ["cupy:v8"]
    assert registry_held_back("cupy", "attention", q=q, k=k, v=v) is None
    q, k, v = make_inputs(rng, heads_q=2, seqlen_q=8, seqlen_k=8, head_dim=128, dtype="bfloat16")
    assert "cupy:v6" in [name for name, _, _ in registry_versions("cupy", "attention", q=q, k=k, v=v)]


def test_held_back_decode_v6_gets_its_own_row_past_16_query_heads(monkeypatch):
    """The cliff's decode cases: past 16 query heads a KV head (g = 32, 64) v6 is the default and
    nothing is held back; while policy.HELD_BACK holds decode v6 (as a test puts it back) the
    default is v7 (v3 while v7 is held back too) and v6 is the held-back row, with the reason;
    at g = 8 (v4, ranked above v6) v6 is not held back (v9, ranked above v4, is while policy.HELD_BACK
    holds it), at g = 129 (v6 refuses it) only v7
    while it is; with the group gate
    (policy.decode_v6_default_at) set below 128, v6 is held back at g = 128 by it."""
    from iokernels.bench.cliff import registry_held_back
    from iokernels.bench.runners import registry_versions
    from iokernels.cupy_raw import policy

    def qkv(group):
        return dict(q=np.zeros((2, 2 * group, 128), np.float16), k=np.zeros((2, 2, 40, 128), np.float16),
                    v=np.zeros((2, 2, 40, 128), np.float16))
    rows = registry_versions("cupy", "decode", **qkv(32))
    if isinstance(rows[0][1], Exception):
        pytest.skip(f"the CuPy backend is not importable here: {rows[0][1]}")
    for group in (32, 64):
        assert [name for name, _, default in registry_versions("cupy", "decode", **qkv(group)) if default] \
            == ["cupy:v6"]
        assert registry_held_back("cupy", "decode", **qkv(group)) is None
    for op in ("decode", "paged_decode"):
        monkeypatch.setitem(policy.HELD_BACK, (op, "v6"), "a cliff record")
    fallback = "cupy:v3" if policy.held_back("decode", "v7") else "cupy:v7"   # the CUDA-core decodes
    for group in (32, 64):
        assert [name for name, _, default in registry_versions("cupy", "decode", **qkv(group)) if default] \
            == [fallback]
        name, cfg, why = registry_held_back("cupy", "decode", **qkv(group))
        assert name == "cupy:v6" and cfg.version == "v6" and "a cliff record" in why
    held = registry_held_back("cupy", "decode", **qkv(8))          # v4's groups: v9 while it is held back
    assert (held and held[0]) == ("cupy:v9" if policy.held_back("decode", "v9") else None)
    # g = 129: v6 refuses it; v7 (the CUDA-core decode with the group split over blocks) takes it,
    # the held-back row while policy.HELD_BACK lists it
    past = registry_held_back("cupy", "decode", **qkv(129))
    assert (past is None) == (policy.held_back("decode", "v7") is None)
    assert past is None or past[0] == "cupy:v7"
    monkeypatch.setattr(policy, "DECODE_V6_DEFAULT_MAX_GROUP", 64)      # a group gate below 128
    name, _, why = registry_held_back("cupy", "decode", **qkv(128))      # v6 runs it, by name only
    assert name == "cupy:v6" and why.startswith("not the default at group 128")


def test_the_fp8_section_is_asked_for_and_its_table_rates_fp8_against_the_16_bit_forward():
    """``--sections fp8`` (not a default section: the forward is opt-in); the README table gives
    each row's time, rate, speed against the 16-bit v5 and against the best SDPA kernel."""
    from iokernels.bench.runners import _finish_case, speed_vs_first
    assert "fp8" in bench.SECTIONS and "fp8" not in bench.specs.DEFAULT_SECTIONS

    def row(name, group, ms):
        return dict(runner=name, group=group, status="ok", ms=ms, rate=100.0 / ms)
    rows = [row("cupy:v5", "cupy", 2.0), row("cupy:fp8", "cupy", 1.6), row("cupy:fp8 forward", "cupy", 1.0),
            dict(runner="cupy:fp8+hadamard", group="cupy", status="failed: RuntimeError: x")]
    speed_vs_first(rows, "speed_vs_bf16")
    rows += [row("sdpa:cudnn", "sdpa", 1.8), row("sdpa:flash", "sdpa", 3.0), row("sdpa:default", "sdpa", 1.8)]
    case = _finish_case(dict(section="fp8", kind="prefill", dtype="bfloat16", causal=False,
                             shape=dict(batch=8, heads=16, seqlen=4096, head_dim=128), results=rows))
    text = "\n".join(_script("readme_table").fp8_table(dict(bench=dict(cases=[case]))))
    assert "B=8 H=16 N=4096 d=128, bfloat16 in and out, non-causal" in text
    assert "| cupy:fp8 | 1.600 | 62 | 1.25 | 1.12 |  |" in text                 # 2.0 / 1.6, 1.8 / 1.6
    assert "| cupy:fp8 forward | 1.000 | 100 | 2.00 | 1.80 |  |" in text
    assert "| cupy:fp8+hadamard | – | – |  |  | failed: RuntimeError: x |" in text
    assert "sdpa:default" not in text


@pytest.mark.gpu
def test_the_fp8_section_runs_on_hopper():
    from iokernels.cupy_raw import hopper as hp
    if hp.available() is not None:
        pytest.skip(f"the FP8 forward needs Hopper: {hp.available()}")
    from iokernels.bench.runners_fp8 import fp8_cases

    class Bar:
        def set_description(self, _):
            pass

        def update(self, _):
            pass
    (case,) = fp8_cases(dict(batch=1, heads=2, head_dim=128, seqlens=(512,), causal=(True,), dtype="bfloat16"),
                        0, Bar(), target_ms=5.0)
    names = [r["runner"] for r in case["results"]]
    fp8_names = ["cupy:v5", "cupy:fp8", "cupy:fp8+hadamard", "cupy:fp8 quantize", "cupy:fp8 forward",
                 "cupy:fp8 v2", "cupy:fp8 v2 forward", "cupy:fp8 v2 forward no-pingpong"]
    assert names[:len(fp8_names)] == fp8_names                  # v2's rows in the same case as v1's
    assert all(r["status"] == "ok" for r in case["results"][:len(fp8_names)]), case["results"][:len(fp8_names)]
    assert case["results"][0]["speed_vs_bf16"] == 1.0 and case["best_sdpa"]


def test_paged_decode_rows_hold_the_tables_where_each_launcher_reads_them():
    """A paged decode timed in a loop gets its tables as a program holds them: on the device for
    the launchers that read them there (CuPy and Triton: tables and lengths), NumPy for Numba."""
    import torch

    from iokernels.bench.paged_tables import PAGED_TABLES_ON_DEVICE, paged_call_tables
    tables, lens = np.arange(6, dtype=np.int32).reshape(2, 3), np.array([40, 7], np.int32)
    for backend, (t_dev, l_dev) in PAGED_TABLES_ON_DEVICE.items():
        t, n = paged_call_tables(backend, tables, lens, torch.device("cpu"))
        assert isinstance(t, torch.Tensor) == t_dev and isinstance(n, torch.Tensor) == l_dev, backend
        assert np.array_equal(np.asarray(t), tables) and np.array_equal(np.asarray(n), lens)
        assert (t is tables) == (not t_dev) and (n is lens) == (not l_dev)
    assert PAGED_TABLES_ON_DEVICE["cupy"] == PAGED_TABLES_ON_DEVICE["triton"] == (True, True)
    assert PAGED_TABLES_ON_DEVICE["numba"] == (False, False)
