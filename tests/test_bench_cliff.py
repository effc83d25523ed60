"""The cliff sweep, the captured decode step and the host-cost loop (CPU-only checks of the
machinery: the plan's order, the time box, the memory skip, capture failures recorded as
rows, the README's cliff and captured tables).  Speeds are never asserted here."""
import importlib.util
import itertools
import os

import pytest

from iokernels import bench
from iokernels.bench import cli, cliff, timer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Clock:
    """A clock that advances ``step`` seconds each time it is read."""

    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_cliff_order_is_the_centre_then_one_axis_away_then_two():
    axes = dict(a=(1, 2, 3), b=("x", "y"), c=(True, False))
    order = cliff.cliff_order(axes, dict(a=2, b="y", c=False))
    assert len(order) == 12 and len({tuple(o.values()) for o in order}) == 12
    assert order[0] == dict(a=2, b="y", c=False)
    dist = [sum(o[k] != v for k, v in dict(a=2, b="y", c=False).items()) for o in order]
    assert dist == sorted(dist) and dist[1:5] == [1] * 4 and dist[-1] == 3
    with pytest.raises(ValueError, match="centre"):
        cliff.cliff_order(axes, dict(a=4, b="x", c=True))


def test_the_plans_cover_the_whole_grid_and_every_axis_early():
    spec = cliff.CLIFF
    d = cliff.decode_plan(spec)
    assert len(d) == 6 * 2 * 3 * 5 * 3
    assert all(c["heads_q"] == c["group"] * c["heads_kv"] for c in d)
    assert {(c["group"], c["heads_kv"]) for c in d} == set(itertools.product((1, 4, 8, 16, 32, 64), (8, 1)))
    axes = dict(group=spec["decode"]["groups"], heads_kv=spec["decode"]["heads_kv"],
                head_dim=spec["decode"]["head_dims"], batch=spec["decode"]["batches"],
                seqlen=spec["decode"]["seqlens"])
    first = d[:1 + sum(len(v) - 1 for v in axes.values())]       # the centre and the one-axis moves
    for name, values in axes.items():
        assert {c[name] for c in first} == set(values), name
    p = cliff.prefill_plan(spec)
    assert len(p) == 3 * 3 * 2 * 2
    assert {(c["head_dim"], c["seqlen"], c["causal"], c["heads_kv"] != c["heads"]) for c in p} == set(
        itertools.product((64, 128, 256), (1000, 3000, 8192), (False, True), (False, True)))
    assert all(c["batch"] == max(1, spec["prefill"]["tokens"] // c["seqlen"]) for c in p)
    assert cliff.interleave([1, 2, 3], ["a"]) == [1, "a", 2, 3]


def test_input_bytes():
    dec = dict(batch=2, heads_q=8, heads_kv=2, seqlen=10, head_dim=4)
    assert cliff.input_bytes("decode", dec, 2) == 2 * (2 * 2 * 8 * 4 + 2 * 2 * 2 * 10 * 4)
    pre = dict(batch=1, heads=4, heads_kv=2, seqlen=8, head_dim=16)
    assert cliff.input_bytes("prefill", pre, 2) == 2 * (2 * 4 * 8 * 16 + 2 * 2 * 8 * 16)


def _fake_case(kind, shape, dtype, seed, target_ms):
    if kind == "decode" and shape["batch"] == 1 and shape["seqlen"] == 1000:
        raise RuntimeError("CUDA out of memory\nmore detail")
    return dict(section="cliff", kind=kind, dtype=dtype, causal=shape.get("causal", False), shape=shape,
                results=[dict(runner="cupy:v6", group="cupy", status="ok", ms=1.0, rate=1.0, unit="TB/s",
                                 default=True)])


def test_cliff_cases_stop_at_the_budget_and_say_what_they_left_out():
    clock = _Clock(1.0)                    # every read of the clock is one second later
    cases = cliff.cliff_cases(budget_s=10.5, clock=clock, run_case=_fake_case, free_bytes=lambda: None)
    summary = cases[-1]
    assert summary["kind"] == "cliff_budget"
    s = summary["summary"]
    assert s["planned"] == 540 + 36 and s["ran"] == len(cases) - 1 and s["skipped_memory"] == 0
    assert s["ran"] + s["left_by_budget"] == s["planned"]
    assert 0 < s["ran"] < 20
    kinds = [c["kind"] for c in cases[:-1]]
    assert kinds[:4] == ["decode", "prefill", "decode", "prefill"]          # interleaved
    earlier = [{"section": "decode"}] * 3                # appended after an earlier section's cases
    into = cliff.cliff_cases(budget_s=10.5, clock=_Clock(1.0), run_case=_fake_case, free_bytes=lambda: None,
                             into=list(earlier))
    assert into[:3] == earlier and into[3:] == cases and into[-1]["summary"]["ran"] == s["ran"]
    with pytest.raises(ValueError, match="budget_s"):
        cliff.cliff_cases(budget_s=0, run_case=_fake_case)


def test_a_cliff_slice_starts_where_the_last_one_stopped():
    """Two slices (the second from the first's start + ran + skipped) run the cases one long
    sweep runs, in its order, each once; a start outside the plan is a ValueError naming it."""
    whole = cliff.cliff_cases(budget_s=30.5, clock=_Clock(1.0), run_case=_fake_case, free_bytes=lambda: None)
    first = cliff.cliff_cases(budget_s=12.5, clock=_Clock(1.0), run_case=_fake_case, free_bytes=lambda: None)
    s1 = first[-1]["summary"]
    second = cliff.cliff_cases(budget_s=12.5, start=s1["start"] + s1["ran"] + s1["skipped_memory"], clock=_Clock(1.0),
                               run_case=_fake_case, free_bytes=lambda: None)
    s2 = second[-1]["summary"]
    assert s1["start"] == 0 and s2["start"] == s1["ran"] > 0
    assert s2["start"] + s2["ran"] + s2["left_by_budget"] == s2["planned"]
    n = s1["ran"] + s2["ran"]
    assert whole[-1]["summary"]["ran"] >= n and first[:-1] + second[:-1] == whole[:n]
    last = cliff.cliff_cases(budget_s=5, start=576, clock=_Clock(1.0), run_case=_fake_case, free_bytes=lambda: None)
    assert last[-1]["summary"]["ran"] == 0 and last[-1]["summary"]["left_by_budget"] == 0
    for bad in (-1, 577, 2.0):
        with pytest.raises(ValueError, match="start"):
            cliff.cliff_cases(start=bad, run_case=_fake_case)


def test_cliff_cases_skip_what_does_not_fit_and_record_failures():
    free = 50 * 2**20                                      # 50 MiB free: the large caches are skipped
    cases = cliff.cliff_cases(budget_s=1e9, clock=_Clock(0.0), run_case=_fake_case, free_bytes=lambda: free)
    body, s = cases[:-1], cases[-1]["summary"]
    skipped = [c for c in body if c.get("status", "").startswith("skipped")]
    failed = [c for c in body if c.get("status", "").startswith("failed")]
    assert s["left_by_budget"] == 0 and len(body) == s["planned"]
    assert len(skipped) == s["skipped_memory"] > 0
    for c in skipped:
        need = cliff.input_bytes(c["kind"], dict(c["shape"]), 2)
        assert need > cliff.MEMORY_FRACTION * free and "GiB" in c["status"]
    assert failed and all(c["status"] == "failed: CUDA out of memory" for c in failed)
    assert len(failed) == 6 * 2 * 3 and all(c["kind"] == "decode" and c["shape"]["batch"] == 1 for c in failed)
    ran = [c for c in body if "status" not in c]
    assert all(cliff.input_bytes(c["kind"], c["shape"], 2) <= cliff.MEMORY_FRACTION * free for c in ran)
    text = cli.table(dict(label="x", cases=cases))         # the end-of-run table prints them
    assert "skipped: inputs" in text and "left_by_budget 0" in text


def test_host_ms_loop_times_the_loop_and_synchronizes_once():
    calls, syncs = [], []
    clock = iter([10.0, 10.5])                              # the loop took 0.5 s
    ms = timer.host_ms_loop(lambda: calls.append(1), 250, synchronize=lambda: syncs.append(1),
                            clock=lambda: next(clock))
    assert len(calls) == 250 and len(syncs) == 1
    assert ms == pytest.approx(2.0)                         # 500 ms / 250 calls
    assert timer.host_calls(0.001) == timer.HOST_MAX_CALLS
    assert timer.host_calls(40.0) == timer.HOST_MIN_CALLS
    assert timer.host_calls(1.0) == 50
    with pytest.raises(ValueError, match="calls"):
        timer.host_ms_loop(lambda: None, 0)


def test_captured_rows_record_a_capture_error_and_a_replay_that_differs():
    torch = pytest.importorskip("torch")
    out = [torch.ones(3)]

    def refuse(step):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    rows = cliff.captured_rows({"cupy": lambda: out}, 1e9, capture=refuse, synchronize=lambda: None)
    assert [r["runner"] for r in rows] == ["cupy eager", "cupy captured"]
    assert rows[1]["status"] == ("failed: capture: RuntimeError: CUDA error: operation not permitted when "
                                 "stream is capturing")

    class Graph:
        def __init__(self):
            self.outs = [torch.zeros(3)]

        def replay(self):
            self.outs[0].fill_(2.0)                         # not what the eager step gave

    def fake_capture(step):
        g = Graph()
        return g, g.outs

    bench_rows = cliff.captured_rows({"sdpa": lambda: out}, 1e9, capture=fake_capture, synchronize=lambda: None)
    cap = bench_rows[1]
    assert cap["runner"] == "sdpa captured" and cap["group"] == "sdpa"
    assert cap["max_abs_diff_vs_eager"] == 1.0 and "differs" in cap["suspect"]

    class Rounding(Graph):                                  # another kernel's rounding, within the tolerance
        def replay(self):
            self.outs[0].fill_(1.0 + 1e-4)

    def rounding_capture(step):
        g = Rounding()
        return g, g.outs

    cap = cliff.captured_rows({"sdpa": lambda: out}, 1e9, capture=rounding_capture, synchronize=lambda: None)[1]
    assert cap["max_abs_diff_vs_eager"] == pytest.approx(1e-4, rel=1e-3) and "suspect" not in cap


def _record():
    def row(runner, group, ms, host, default=False, **kw):
        return dict(runner=runner, group=group, status="ok", ms=ms, rate=1.0, unit="TB/s", host_ms=host,
                    **({"default": True} if default else {}), **kw)
    cases = []
    for g, ours in ((4, 1.0), (32, 4.0), (64, 2.0)):
        cases.append(bench.runners._finish_case(dict(
            section="cliff", kind="decode", dtype="bfloat16", causal=False,
            shape=dict(batch=17, heads_q=8 * g, heads_kv=8, seqlen=4096, head_dim=128),
            results=[row("sdpa:cudnn", "sdpa", 1.0, 0.02), row("sdpa:flash", "sdpa", 1.5, 0.03),
                     row("cupy:v6" if g > 16 else "cupy:v4", "cupy", ours, 0.05, default=True)])))
    cases.append(bench.runners._finish_case(dict(
        section="cliff", kind="prefill", dtype="bfloat16", causal=True,
        shape=dict(batch=2, heads=16, heads_kv=4, seqlen=8192, head_dim=256),
        results=[row("sdpa:flash", "sdpa", 2.0, 0.02), row("cupy:v2", "cupy", 8.0, 0.2, default=True)])))
    cases.append(dict(section="cliff", kind="cliff_budget", dtype="bfloat16", causal=False, shape={}, results=[],
                      summary=dict(planned=576, ran=4, skipped_memory=0, left_by_budget=572, budget_s=150.0,
                                   elapsed_s=150.2, order="centre first")))
    step = dict(section="captured", kind="decode_step", dtype="bfloat16", causal=False,
                shape=dict(layers=32, batch=8, heads_q=32, heads_kv=8, seqlen=4096, head_dim=128),
                results=[row("sdpa eager", "sdpa", 3.0, 1.0), row("sdpa captured", "sdpa", 2.0, 0.01),
                         row("cupy eager", "cupy", 9.0, 8.0),
                         dict(runner="cupy captured", group="cupy",
                              status="failed: capture: RuntimeError: cudaErrorStreamCaptureInvalidated")])
    base = 2.0
    for r in step["results"]:
        if r.get("status") == "ok":
            r["speed_vs_sdpa_captured"] = base / r["ms"]
    cases.append(step)
    return dict(bench=dict(cases=cases))


def test_readme_tables_show_each_familys_worst_cliff_and_the_captured_step():
    rt = _script("readme_table")
    rec = _record()
    text = "\n".join(rt.cliff_table(rec))
    decode = next(ln for ln in text.splitlines() if ln.startswith("| decode"))
    assert "| 3 | 0.25 (cupy:v6) | B=17 256/8 N=4096 d=128 | 0.50 | 0.050 / 0.020 |" in decode
    prefill = next(ln for ln in text.splitlines() if ln.startswith("| prefill"))
    assert "0.25 (cupy:v2)" in prefill and "16/4 N=8192 d=256 causal" in prefill
    assert "4 of 576 planned cases" in text
    cap = "\n".join(rt.captured_table(rec))
    assert "| sdpa captured | 2.000 | 0.010 | 1.00 |" in cap
    assert "| cupy captured | – | – |  | failed: capture: RuntimeError: cudaErrorStreamCaptureInvalidated |" in cap
    assert rt.cliff_table(dict(bench=dict(cases=[]))) == [] and rt.captured_table(dict(bench=dict(cases=[]))) == []


def test_cli_table_and_sections_know_the_new_kinds():
    rec = _record()
    text = cli.table(dict(label="x", cases=rec["bench"]["cases"]))
    assert "32x B8 32/8 N4096 d128" in text and "B2 16/4 N8192 d256 causal" in text
    assert "planned 576" in text
    assert set(bench.SECTIONS) >= {"cliff", "captured"}
    assert not {"cliff", "captured"} & set(bench.specs.DEFAULT_SECTIONS)


def test_captured_text():
    rec = _record()
    case = next(c for c in rec["bench"]["cases"] if c["section"] == "captured")
    text = cliff.captured_text(case)
    assert "32 layers, B=8, GQA 32/8" in text and "failed: capture" in text
    assert "sdpa captured" in text and "1.00" in text
    assert "No run" in cliff.captured_text(None)
