"""The records: one per registered version, and the version tables generated from them.

The tables between the ``versions:<backend>:begin/end`` markers in README.md and in the
backends' docstrings are what :meth:`Registry.version_table` makes of the records; this test
fails while one differs, and ``IK_WRITE_TABLES=1`` rewrites them (then fails once, naming
what it rewrote, so a rewrite is never silent).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from iokernels import cupy_raw, numba_cuda, triton_backend
from iokernels.core import records as R
from iokernels.core.registry import OPS, Registry

ROOT = Path(__file__).resolve().parents[1]


def targets(cupy_reg=cupy_raw.REGISTRY, numba_reg=numba_cuda.REGISTRY):
    return [(ROOT / "README.md", "numba", numba_reg.version_table(fmt="md")),
            (ROOT / "README.md", "cupy", cupy_reg.version_table(fmt="md")),
            (ROOT / "README.md", "triton", triton_backend.REGISTRY.version_table(fmt="md")),
            (ROOT / "iokernels/numba_cuda/__init__.py", "numba", numba_reg.version_table()),
            (ROOT / "iokernels/cupy_raw/__init__.py", "cupy", cupy_reg.version_table()),
            (ROOT / "iokernels/triton_backend/__init__.py", "triton", triton_backend.REGISTRY.version_table())]


def test_committed_tables_are_the_generated_ones():
    stale = R.sync_tables(targets(), write=os.environ.get("IK_WRITE_TABLES") == "1")
    assert not stale, f"version tables differ from the records (IK_WRITE_TABLES=1 rewrites them): {stale}"


@pytest.mark.parametrize("reg", [cupy_raw.REGISTRY, numba_cuda.REGISTRY, triton_backend.REGISTRY],
                         ids=["cupy", "numba", "triton"])
def test_every_record_is_complete(reg):
    assert len(reg) > 0
    for r in reg:
        assert r.backend == reg.backend and r.op in OPS and r.version.startswith("v"), r.name
        assert r.summary and len(r.summary) < 250 and r.kernel and callable(r.launcher), r.name
        assert reg.get(r.op, r.version) is r
        if reg.backend == "cupy":                   # the file is a kernel file the launch compiles
            stem = r.file.removesuffix(".cu")
            assert stem in cupy_raw.launch.SOURCES or stem in cupy_raw.launch.HOPPER_SOURCES, r.name
            assert callable(r.args), r.name
        else:
            assert (ROOT / "iokernels" / r.file).exists(), r.name
        assert re.search(_definition(r), _source(r)), f"{r.name}: no kernel {r.kernel} in {r.file}"


def _source(r):
    if r.file.endswith(".cu"):
        return (cupy_raw.launch.KERNEL_DIR / r.file).read_text()
    return (ROOT / "iokernels" / r.file).read_text()


def _definition(r):
    if r.file.endswith(".cu"):
        return r'extern "C"[^;{]*\b' + r.kernel + r"\s*\("
    return r"\bdef " + r.kernel + r"\("


def _record(version, op="decode", rank=0, backend="numba"):
    return R.Record(backend, op, version, "numba_cuda/decode.py", "split", object, lambda *a, **k: None, "toy",
                    rank=rank)


def test_add_refuses_bad_records_and_adds_none_of_them():
    reg = Registry("numba")
    for bad in ([_record("v1"), _record("v1")], [_record("v1"), _record("v2", op="prefill")],
                [_record("v1"), _record("v2", backend="cupy")], [_record("v1"), "v2"]):
        with pytest.raises(ValueError, match="record"):
            reg.add(*bad)
        assert len(reg) == 0
    reg.add(_record("v1"))
    with pytest.raises(ValueError, match="registered twice"):
        reg.add(_record("v1"))


def test_added_is_undone_even_when_the_block_raises():
    reg = Registry("numba")
    reg.add(_record("v1", rank=1))
    with pytest.raises(RuntimeError):
        with reg.added(_record("v9", rank=9)):
            assert reg.versions("decode") == ["v1", "v9"]
            raise RuntimeError
    assert reg.versions("decode") == ["v1"]


def test_call_runs_the_resolved_version_with_its_config():
    from dataclasses import dataclass, replace

    from iokernels.core.registry import Need

    @dataclass(frozen=True)
    class Cfg:
        version: str | None = None

        def replace(self, **kw):
            return replace(self, **kw)

    calls = []

    def launcher(version):
        return lambda *a, config, **kw: calls.append((version, a, config, kw)) or version

    def rec(version, rank, check=None):
        return R.Record("numba", "decode", version, "numba_cuda/decode.py", "split", Cfg, launcher(version), "toy",
                        check, rank)

    reg = Registry("numba")
    reg.add(rec("v1", 1), rec("v2", 2, lambda n: "too wide" if n.head_dim > 128 else None))
    need = Need("float16", 64)
    assert reg.call("decode", None, need, "q", "k", scale=0.5) == "v2"
    assert calls[-1] == ("v2", ("q", "k"), Cfg("v2"), {"scale": 0.5})
    assert reg.call("decode", None, Need("float16", 256), "q") == "v1"   # v2's check refuses
    assert reg.call("decode", Cfg("v1"), need, "q") == "v1" and calls[-1][2] == Cfg("v1")
    with pytest.raises(ValueError, match="v2 cannot run here: too wide"):
        reg.call("decode", Cfg("v2"), Need("float16", 256), "q")


def test_default_check_keeps_the_default_off_a_version_a_config_still_runs():
    from dataclasses import dataclass, replace

    from iokernels.core.registry import Need

    @dataclass(frozen=True)
    class Cfg:
        version: str | None = None

        def replace(self, **kw):
            return replace(self, **kw)

    def rec(version, rank, default_check=None):
        return R.Record("numba", "decode", version, "numba_cuda/decode.py", "split", Cfg,
                        lambda *a, config, **kw: config.version, "toy", None, rank,
                        default_check=default_check)

    wide = rec("v2", 2, lambda n: "not measured at this head dim" if n.head_dim > 128 else None)
    reg = Registry("numba")
    reg.add(rec("v1", 1), wide)
    assert reg.call("decode", None, Need("float16", 128), "q") == "v2"
    assert reg.call("decode", None, Need("float16", 256), "q") == "v1"          # the default skips v2 ...
    assert reg.call("decode", Cfg(), Need("float16", 256), "q") == "v1"
    assert reg.call("decode", Cfg("v2"), Need("float16", 256), "q") == "v2"    # ... a config naming it runs it
    assert wide.unavailable(Need("float16", 256)) is None
    assert wide.not_default(Need("float16", 256)) == "not measured at this head dim"
    only = Registry("numba")
    only.add(wide)
    with pytest.raises(ValueError, match="v2: not measured at this head dim"):
        only.default("decode", Need("float16", 256))


def test_version_table_orders_by_op_then_rank_and_wraps():
    reg = Registry("numba")
    reg.add(_record("v1", rank=1), _record("v2", rank=5), _record("v1", op="attention", rank=3))
    rows = [line.split()[:2] for line in reg.version_table().splitlines() if line.startswith(("attention", "decode"))]
    assert rows == [["attention", "v1"], ["decode", "v2"], ["decode", "v1"]]
    long = R.Record("numba", "decode", "v3", "f.py", "k", object, print, "word " * 60)
    table = R.version_table([long])
    assert all(len(line) <= R.TABLE_WIDTH for line in table.splitlines())
    assert " ".join(table.split()).count("word") == 60            # wrapped, nothing lost
    md = R.version_table([long], fmt="md")
    assert md.splitlines()[2].startswith("| decode | v3 | `f.py` | 0 |")


def test_between_and_replace_between_round_trip():
    text = "a\n<!-- versions:x:begin -->\nold\n<!-- versions:x:end -->\nb\n"
    assert R.between(text, "x") == "old" and R.between(text, "y") is None
    new = R.replace_between(text, "x", "new\nrows")
    assert R.between(new, "x") == "new\nrows" and new.startswith("a\n") and new.endswith("end -->\nb\n")
    with pytest.raises(ValueError, match="markers"):
        R.replace_between(text, "y", "z")
