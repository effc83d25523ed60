"""The notebook table: HTML in a notebook, aligned text elsewhere, no pandas."""
import pytest

from iokernels.viz.htmltable import Table


def test_html_and_text():
    t = Table(("name", "value"), [("a <b>", "1.5%"), ("long words stay whole", "12,345")], caption="cap",
              note="a note")
    h = t._repr_html_()
    assert "a &lt;b&gt;" in h and "<b>cap</b>" in h and "a note" in h
    assert "white-space:nowrap'>1.5%" in h and "white-space:nowrap'>12,345" in h     # numbers never wrap
    assert "word-break:normal" in h                                                   # words never break
    lines = str(t).splitlines()
    assert lines[0] == "cap" and lines[1].split() == ["name", "value"] and lines[-1] == "a note"
    assert lines[2].index("1.5%") == lines[3].index("12,345")                       # aligned columns
    assert t.column("value") == ["1.5%", "12,345"] and "12,345" in t


def test_empty_table_shows_its_note_and_bad_rows_raise():
    t = Table(("x",), [], note="nothing recorded yet")
    assert "nothing recorded yet" in t._repr_html_() and str(t) == "nothing recorded yet"
    with pytest.raises(ValueError, match="rows"):
        Table(("a", "b"), [("1",)])
    with pytest.raises(ValueError, match="name"):
        Table(("a",), [("1",)]).column("b")


# --------------------------------------------------------------------------- notebook 10's tables
def _sdpa_record(rng):
    """A prefill case (flash refuses), a decode case over an int8 cache (no SDPA row) and a
    backward case (no default recorded), with random times."""
    def res(name, ok=True):
        return dict(runner=name, group=name.split(":")[0], status="ok" if ok else "unavailable: dtype\nmore",
                    ms=float(rng.uniform(0.1, 2)), rate=float(rng.uniform(1, 100)))
    prefill = dict(section="prefill", kind="prefill", dtype="float32", causal=True, default_ran="efficient",
                   shape=dict(batch=2, heads=4, seqlen=1024, head_dim=64),
                   results=[res("sdpa:flash", False), res("sdpa:efficient"), res("sdpa:math"), res("cupy:v1")])
    quant = dict(section="decode", kind="decode", dtype="bfloat16", kv_dtype="int8",
                 shape=dict(batch=8, seqlen=4096), results=[res("cupy v4 paged int8")])
    backward = dict(section="backward", kind="prefill", dtype="bfloat16", causal=False,
                    shape=dict(batch=8, heads=16, seqlen=4096, head_dim=128),
                    results=[res("sdpa:flash fwd+bwd"), res("sdpa:cudnn fwd+bwd", False)])
    env = {"gpu": "X", "date_utc": "2026-01-01", "torch": "2.0"}
    return {"env": env, "bench": {"cases": [prefill, quant, backward]}}


def test_fallback_table_names_what_was_not_recorded(rng):
    from iokernels import recorded
    from iokernels.viz import sdpa
    rec = _sdpa_record(rng)
    t = sdpa.fallback_table(rec)
    assert t.column("section") == ["prefill", "backward"]            # the int8-cache case times no SDPA kernel
    assert t.column("default ran") == ["efficient", "not recorded"]
    assert t.column("refused when forced") == ["flash", "cudnn"]
    assert "1 decode case over int8" in t.note and "?" not in str(t)
    text = recorded.fallback_report(rec)
    assert "?" not in text and "backward " in text and "not recorded" in text


def test_backend_status_table_gives_each_reason_once():
    from iokernels.viz import sdpa
    long = "No viable backend was found. This is likely due to turning off both kernels."
    t = sdpa.backend_status_table({"flash": "ok", "efficient": "unavailable: " + long,
                                   "cudnn": "unavailable: " + long, "math": "unavailable: other", "default": "flash"})
    assert t.column("result") == ["runs", "refuses", "refuses", "refuses"]
    assert t.column("why") == ["", "reason 1", "reason 1", "reason 2"]
    assert str(t).count(long) == 1 and "default dispatch ran: flash" in str(t)


def test_recorded_tables_are_short_and_complete():
    from iokernels import recorded
    from iokernels.viz import sdpa
    rec = recorded.load("h200")
    compare = sdpa.compare_table(rec)
    rows = recorded.bench_rows(rec, section="compare")
    assert set(compare.column("runner")) == {r["runner"] for r in rows}
    assert len(compare.rows) < len(rows) / 2
    decode = sdpa.decode_table(rec, "float16")
    cupy = next(r for r in recorded.bench_rows(rec, section="decode", dtype="float16", runners=("cupy:v4",),
                                                batch=1, seqlen=32768))
    assert decode.column("B=1 N=32768")[decode.column("runner").index("cupy:v4")] == \
        f"{cupy['speed_vs_best_sdpa']:.2f}x"
    traffic = sdpa.traffic_table(rec)
    assert len(traffic.rows) < len(recorded.traffic_rows(rec))
    assert sum(len(r["sizes"]) for _, rs in sdpa.traffic_groups(rec) for r in rs) == len(recorded.traffic_rows(rec))
    for t in (compare, decode, traffic, sdpa.fallback_table(rec)):
        assert max(len(line) for line in str(t).splitlines()[1:-1]) < 120
