"""The development tool (python -m iokernels dev): any op, version and shape, checked and timed.

On a CPU: the NumPy backends and Numba's CUDA simulator at tiny shapes.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from iokernels.bench import dev
from iokernels.core.config import TileConfig


def test_parse_shape_defaults_and_errors():
    s = dev.parse_shape("B=2,Hq=8,Hkv=2,N=100,d=16")
    assert (s["B"], s["Hq"], s["Hkv"], s["N"], s["Nq"], s["d"]) == (2, 8, 2, 100, 100, 16)
    assert dev.parse_shape(None)["Hkv"] == dev.DEFAULT_SHAPE["Hq"]
    for bad in ("B=2,X=3", "B=two", "Hq=6,Hkv=4", "N=0", "B"):
        with pytest.raises(ValueError, match="shape"):
            dev.parse_shape(bad)


def test_parse_config_values():
    assert dev.parse_config(["block_q=16", "deterministic=true", "version=v2", "x=0.5"]) == dict(
        block_q=16, deterministic=True, version="v2", x=0.5)
    with pytest.raises(ValueError, match="config"):
        dev.parse_config(["block_q"])


def test_config_for_looks_up_the_registry():
    from iokernels.numba_cuda import REGISTRY
    cfg = dev.config_for("numba", "decode", "v3", {})
    assert isinstance(cfg, REGISTRY.get("decode", "v3").config_class) and cfg.version == "v3"
    assert dev.config_for("numba", "decode", None, {}) is None
    with pytest.raises(ValueError, match="version"):
        dev.config_for("numba", "decode", "v99", {})
    assert dev.config_for("tiled", "attention", None, dict(block_q=8, block_k=16)) == TileConfig(block_q=8, block_k=16)
    with pytest.raises(ValueError, match="version"):
        dev.config_for("tiled", "attention", "v2", {})
    with pytest.raises(ValueError, match="config"):
        dev.config_for("naive", "attention", None, dict(block_q=8))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_tiled_attention_checks_and_times(dtype):
    lines = []
    rec = dev.run("attention", backend="tiled", shape="B=1,Hq=2,Hkv=1,N=24,Nq=17,d=8", dtype=dtype, causal=True,
                  rounds=3, against=["naive"], config=["block_q=8", "block_k=8"], out=lines.append)
    assert rec["ok"] and [c["name"] for c in rec["checks"]] == ["o", "lse"]
    assert all(c["error"] <= c["bound"] for c in rec["checks"])
    assert rec["config"]["block_q"] == 8
    naive = rec["times"]["naive"]
    assert len(naive["rounds_ms"]) == 3 and len(naive["speed_ratios"]) == 3
    assert naive["median_speed_ratio"] == pytest.approx(np.median(naive["speed_ratios"]))
    assert sum(line.startswith("check") for line in lines) == 2 and sum(line.startswith("time") for line in lines) == 2


def test_a_wrong_output_fails_the_check():
    p = dev.make_problem("attention", dev.parse_shape("B=1,Hq=2,N=12,d=8"), "float16")
    o, lse = dev.public_call(p, "tiled", None, device=False)()
    assert all(dev.check(p, (o, lse)))
    bad = dev.check(p, (o * np.float16(1.05), lse))
    assert not bad[0] and bad[1]
    g = dev.make_problem("paged_gather", dev.parse_shape("B=2,Hq=2,N=20,d=8"), "float32")
    k, v = dev.public_call(g, "tiled", None, device=False)()
    assert all(dev.check(g, (k, v)))
    assert not dev.check(g, (k + np.float32(1e-6), v))[0]           # a copy must be exact


def test_backward_uses_the_gradient_factor():
    p = dev.make_problem("attention_backward", dev.parse_shape("B=1,Hq=2,N=16,d=8"), "float16")
    checks = dev.check(p, dev.public_call(p, "tiled", None, device=False)())
    assert [c.name for c in checks] == ["dq", "dk", "dv"] and all(checks)
    assert all(c.bound == pytest.approx(3.0 * c.baseline_error + 1e-4) for c in checks)


@pytest.mark.parametrize("op, extra", [("decode", dict(version="v3")), ("paged_decode", {}),
                                       ("paged_gather", {})])
def test_numba_simulator_ops(op, extra):
    rec = dev.run(op, backend="numba", shape="B=2,Hq=4,Hkv=2,N=20,d=16", dtype="float32", rounds=1,
                  out=lambda s: None, **extra)
    assert rec["ok"] and rec["checks"] and not rec["device"]
    assert rec["subject"] == ("numba:v3" if extra else "numba")


def test_quantized_paged_decode_on_tiled():
    rec = dev.run("paged_decode", backend="tiled", shape="B=2,Hq=4,Hkv=2,N=40,d=16", dtype="float16",
                  kv_dtype="int8", timing=False, out=lambda s: None)
    assert rec["ok"] and "times" not in rec


def test_runners_take_turns():
    log = []
    runners = {"a": lambda: log.append("a"), "b": lambda: log.append("b"), "c": lambda: log.append("c")}
    times = dev.time_interleaved(runners, 3, device=False)
    assert log == ["a", "b", "c"] * 3 and all(len(v) == 3 for v in times.values())
    s = dev.summarize({"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}, "a")
    assert s["b"]["speed_ratios"] == [2.0, 1.0, 0.5] and s["b"]["median_speed_ratio"] == 1.0
    assert "speed_ratios" not in s["a"] and s["a"]["median_ms"] == 2.0


def test_a_runner_that_cannot_run_the_problem_is_skipped_and_named(monkeypatch):
    def refuses():
        raise RuntimeError("No available kernel. Aborting execution.\nmore")
    real = dev.runner
    monkeypatch.setattr(dev, "runner", lambda spec, p, device: refuses if spec == "tiled:v1" else real(spec, p, device))
    lines = []
    rec = dev.run("attention", backend="tiled", shape="B=1,Hq=2,N=16,d=8", dtype="float32", rounds=2,
                  against=["naive", "tiled:v1"], out=lines.append)
    assert set(rec["times"]) == {"tiled", "naive"}
    assert rec["skipped"] == {"tiled:v1": "RuntimeError: No available kernel. Aborting execution."}
    assert any(line.startswith("skip  tiled:v1") for line in lines)
    assert dev.cannot_run(lambda: None) is None


def test_a_timing_only_run_computes_no_oracle(monkeypatch):
    def never(*a, **k):
        raise AssertionError("the oracle ran")
    monkeypatch.setattr(dev.reference, "decode", never)
    rec = dev.run("decode", backend="tiled", shape="B=1,Hq=4,Hkv=2,N=32,d=8", dtype="float32", rounds=1,
                  correctness=False, out=lambda s: None)
    assert "checks" not in rec and set(rec["times"]) == {"tiled"}
    assert dev.make_problem("decode", dev.parse_shape("B=1,Hq=4,Hkv=2,N=32,d=8"), "float16", oracle=False).refs == {}
    with pytest.raises(AssertionError, match="oracle"):
        dev.make_problem("decode", dev.parse_shape("B=1,Hq=4,Hkv=2,N=32,d=8"), "float16")


def test_bad_requests_are_value_errors():
    with pytest.raises(ValueError, match="causal"):
        dev.run("decode", backend="tiled", causal=True, out=lambda s: None)
    with pytest.raises(ValueError, match="against"):
        dev.run("attention", backend="tiled", dtype="float32", rounds=1, against=["sdpa:fast"], out=lambda s: None)
    with pytest.raises(ValueError, match="op"):
        dev.make_problem("prefill", dev.parse_shape(None), "float32")


def test_main_writes_a_record_and_exit_codes(tmp_path):
    path = tmp_path / "rec.json"
    assert dev.main(["attention", "--backend", "tiled", "--dtype", "float32", "--shape", "B=1,Hq=2,N=16,d=8",
                     "--rounds", "1", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["op"] == "attention" and rec["ok"] and "tiled" in rec["times"]
    assert dev.main(["attention", "--backend", "tiled", "--shape", "B=x"]) == 2


def test_command_line_entry(capsys):
    from iokernels.__main__ import main
    assert main(["dev", "decode", "--backend", "naive", "--dtype", "float32", "--shape", "B=1,Hq=2,N=9,d=4",
                 "--no-timing"]) == 0
    assert "check naive o:" in capsys.readouterr().out


def _numba_versions():
    from iokernels.numba_cuda import REGISTRY
    return [(k.op, k.version) for k in REGISTRY]


@pytest.mark.parametrize("op, version", _numba_versions())
def test_every_registered_numba_version_checks_on_the_simulator(op, version):
    """The tool iterates the registry generically: each (op, version) at a tiny GQA shape, float32."""
    shape = "B=2,Hq=4,Hkv=2,N=24,Nq=9,d=16" if op.startswith("attention") else "B=2,Hq=4,Hkv=2,N=24,d=16"
    rec = dev.run(op, backend="numba", version=version, shape=shape, dtype="float32", timing=False,
                  out=lambda s: None)
    assert rec["ok"], rec["checks"]
    assert rec["config"]["version"] == version and len(rec["checks"]) == len(dev._names(op))


def test_mla_is_a_cupy_op():
    p = dev.make_problem("mla_decode", dev.parse_shape("B=1,Hq=2,N=8,dc=16,dr=4"), "float32")
    assert p.refs["o"].shape == (1, 2, 16) and p.refs["lse"].shape == (1, 2)
    with pytest.raises(ValueError, match="mla_decode is a CuPy kernel"):
        dev.public_call(p, "tiled", None, device=False)


@pytest.mark.parametrize("op, kv", [("paged_decode", None), ("paged_decode", "int8"), ("paged_gather", None)])
def test_paged_ops_over_pools_match_the_public_call(op, kv, monkeypatch):
    """On a GPU the tool times the paged ops over pools moved once (the pools path of the backend);
    that path checks the same as the public call (here both run on the simulator)."""
    monkeypatch.setattr(dev, "_on_device", lambda x: x)           # no torch CUDA here: arrays stay put
    p = dev.make_problem(op, dev.parse_shape("B=2,Hq=4,Hkv=2,N=20,d=16"), "float32", kv_dtype=kv)
    pools = dev._paged_on_device(p, "numba", None)()
    public = dev.public_call(p, "numba", None, device=False)()
    assert all(dev.check(p, pools)) and all(dev.check(p, public))
    np.testing.assert_allclose(dev.testing.as_numpy(pools[0]), dev.testing.as_numpy(public[0]), rtol=1e-6, atol=1e-6)
