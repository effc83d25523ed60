"""Adding a kernel version takes its kernel, its record and its test: here all three in this file.

A toy decode version for the Numba backend (one thread per query head, the whole softmax in
float64, no splits) is registered for the duration of each test with ``REGISTRY.added``, and
the test proves what the registry promises of any version: it is registered, it appears in
the generated version tables, the public ``decode`` dispatches to it (it outranks the others
where its check passes, and its check refuses what it cannot run, with the reason), and it
matches the float64 oracle on Numba's CUDA simulator.  The global registry is unchanged
afterwards.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass, replace

import numpy as np
import pytest

import iokernels as ik
from iokernels import numba_cuda as nc
from iokernels.core import reference
from iokernels.core.records import Record
from iokernels.core.testing import check

numba_cuda = pytest.importorskip("numba.cuda")
cuda = numba_cuda

TOY = "v99"


# --------------------------------------------------------------------------- 1. the kernel
@cuda.jit
def toy_decode(q, k, v, lens, o, lse, scale, left):
    """Block b, thread h: query head h of sequence b over its visible keys, two passes."""
    b, h = cuda.blockIdx.x, cuda.threadIdx.x
    hkv = h // (q.shape[1] // k.shape[1])
    n = lens[b]
    start = 0 if left < 0 else max(0, n - 1 - left)
    m = -math.inf
    for j in range(start, n):
        s = 0.0
        for c in range(q.shape[2]):
            s += q[b, h, c] * k[b, hkv, j, c]
        m = max(m, s * scale)
    total = 0.0
    for c in range(q.shape[2]):
        o[b, h, c] = 0.0
    for j in range(start, n):
        s = 0.0
        for c in range(q.shape[2]):
            s += q[b, h, c] * k[b, hkv, j, c]
        p = math.exp(s * scale - m)
        total += p
        for c in range(q.shape[2]):
            o[b, h, c] += p * v[b, hkv, j, c]
    if total > 0.0:
        for c in range(q.shape[2]):
            o[b, h, c] /= total
        lse[b, h] = m + math.log(total)
    else:
        lse[b, h] = -math.inf


# --------------------------------------------------------------------------- 2. its record
@dataclass(frozen=True)
class ToyConfig:
    version: str | None = None

    def replace(self, **kw) -> "ToyConfig":
        return replace(self, **kw)


CALLS: list = []


def run_toy(q, k, v, *, seq_lens, num_splits, scale, config, window=None):
    CALLS.append(config.version)
    B, Hq, d = q.shape
    lens = np.full(B, k.shape[2], np.int32) if seq_lens is None else np.asarray(seq_lens, np.int32)
    o, lse = np.zeros((B, Hq, d)), np.zeros((B, Hq))
    left = -1 if window is None else int(window[0])
    scale = 1 / math.sqrt(d) if scale is None else scale
    toy_decode[B, Hq](np.asarray(q), np.asarray(k), np.asarray(v), lens, o, lse, scale, left)
    return o, lse


def toy_check(n) -> str | None:
    return None if n.dtype == "float64" else f"the toy kernel computes in float64 only, got {n.dtype}"


RECORD = Record("numba", "decode", TOY, "tests/test_toy_version.py", "toy_decode", ToyConfig, run_toy,
                "toy: one thread per query head, the whole softmax in float64", toy_check, rank=1000)


# --------------------------------------------------------------------------- 3. its test
@pytest.fixture
def toy():
    before = nc.REGISTRY.table()
    CALLS.clear()
    with nc.REGISTRY.added(RECORD):
        yield RECORD
    assert nc.REGISTRY.table() == before                   # the global registry is left as it was


def _inputs(rng, dtype="float64"):
    q = rng.standard_normal((3, 4, 8)).astype(dtype)
    k, v = (rng.standard_normal((3, 2, 37, 8)).astype(dtype) for _ in range(2))
    return q, k, v, np.array([37, 0, 5])


def test_the_toy_is_registered_and_in_the_generated_tables(toy):
    assert nc.REGISTRY.get("decode", TOY) is toy and TOY in nc.REGISTRY.versions("decode")
    assert any(r["version"] == TOY and r["file"] == toy.file for r in nc.REGISTRY.table())
    rst, md = nc.REGISTRY.version_table(), nc.REGISTRY.version_table(fmt="md")
    assert re.search(rf"^decode +{TOY} +tests/test_toy_version.py +1000 +toy: one thread", rst, re.M)
    assert f"| decode | {TOY} | `tests/test_toy_version.py` | 1000 |" in md
    from test_records import targets                       # the committed tables now lag the records
    from iokernels.core.records import sync_tables
    assert sorted(sync_tables(targets())) == ["README.md [numba]", "__init__.py [numba]"]


def test_the_toy_is_dispatched_and_matches_the_oracle(toy, rng):
    q, k, v, lens = _inputs(rng)
    o, lse = ik.decode(q, k, v, seq_lens=lens, backend="numba", return_lse=True)    # the default: the toy
    assert CALLS == [TOY]
    ref_o, ref_lse = reference.decode(q, k, v, seq_lens=lens)
    assert check(o, ref_o, name="O").ok and check(lse, ref_lse, name="LSE").ok
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))                        # the empty sequence
    o, lse = nc.decode(q, k, v, seq_lens=lens, config=ToyConfig(TOY), window=(3, 0))
    ref_o, ref_lse = reference.decode(q, k, v, seq_lens=lens, window=(3, 0))
    assert CALLS == [TOY, TOY] and check(o, ref_o, name="O window").ok and check(lse, ref_lse).ok


def test_the_toy_check_refuses_with_its_reason_and_the_default_falls_back(toy, rng):
    q, k, v, lens = _inputs(rng, "float32")
    with pytest.raises(ValueError, match="float64 only"):
        nc.decode(q, k, v, seq_lens=lens, config=ToyConfig(TOY))
    o = ik.decode(q, k, v, seq_lens=lens, backend="numba")             # float32: the next-ranked version
    assert CALLS == [] and np.allclose(o, reference.decode(q, k, v, seq_lens=lens)[0], rtol=0, atol=1e-5)


def test_without_the_toy_the_version_is_unknown(rng):
    q, k, v, lens = _inputs(rng)
    assert TOY not in nc.REGISTRY.versions("decode")
    with pytest.raises(ValueError, match=f"no decode version '{TOY}'"):
        nc.REGISTRY.get("decode", TOY)


# =========================================================================== the CuPy decode
# A CuPy decode version is a .cu file, its record and its tests.  The record says which launch
# layout the kernel has (``extra["layout"]``) and which caches it reads (``extra["reads"]``);
# DecodeConfig asks the record, so the config module needs no edit.  Here the toy's kernel
# file is decode_v4.cu with its kernel renamed (how a new version starts: a copy of the one
# before), written where the record's ``extra["sources"]`` points.
CUPY_TOY = "v98"


def _cupy_toy(tmp_path):
    cd = importlib.import_module("iokernels.cupy_raw.decode")     # (cupy_raw.decode is the function)
    from iokernels.cupy_raw import launch as cl
    from iokernels.cupy_raw.decode_config import DecodeConfig
    src = (cl.KERNEL_DIR / "decode_v4.cu").read_text().replace("decode_split_v4", "decode_split_toy")
    path = tmp_path / "decode_toy.cu"
    path.write_text(src)
    rec = Record("cupy", "decode", CUPY_TOY, "decode_toy.cu", "decode_split_toy", DecodeConfig, _cupy_run,
                 "toy: v4's kernel under a new name", cd.check_decode_v4, 1000, cd._args_v4,
                 dict(layout="tensor_core", reads=("16-bit",), smem=cd._smem_v4,
                      sources={"decode_toy": str(path)}))
    return rec


def _cupy_run(q, k, v, *, seq_lens, num_splits, scale, config, window=None):
    CALLS.append(config.version)
    return "ran"


def test_a_cupy_toy_decode_needs_no_config_edit(tmp_path, monkeypatch):
    from iokernels import cupy_raw as cr
    from iokernels.core.registry import Need
    cd = importlib.import_module("iokernels.cupy_raw.decode")
    from iokernels.cupy_raw import decode_config as D
    with pytest.raises(ValueError, match=f"config.version: no decode version '{CUPY_TOY}'"):
        D.DecodeConfig(CUPY_TOY)
    rec = _cupy_toy(tmp_path)
    CALLS.clear()
    before = cr.REGISTRY.table()
    with cr.REGISTRY.added(rec):
        cfg = D.DecodeConfig(CUPY_TOY, num_warps=4, load_l1=True)      # v4's settings: the record's layout
        assert cfg.layout == "tensor_core"
        with pytest.raises(ValueError, match="config.unroll: a v1 setting"):
            D.DecodeConfig(CUPY_TOY, unroll=2)
        args = (128, "bfloat16", 4, False, 0)
        kw = dict(smem_limit=232448, cc=90, pairs=8, sms=132)
        assert D.DecodeConfig(CUPY_TOY).defines(*args, **kw) == D.DecodeConfig("v4").defines(*args, **kw)
        assert D.ring_smem_bound(CUPY_TOY, 128, "bfloat16", 4) == D.ring_smem_bound("v4", 128, "bfloat16", 4)
        assert "decode_split_toy" in cr.launch.source("decode_toy", rec.extra["sources"])
        assert re.search(rf"^decode +{CUPY_TOY} +decode_toy.cu +1000 +toy: v4", cr.REGISTRY.version_table(), re.M)
        assert "decode_toy" not in cr.launch.SOURCES and "decode_toy" not in cr.launch.HOPPER_SOURCES
        monkeypatch.setattr(cd, "need", lambda op, **kw: Need(dtype="bfloat16", head_dim=128, cc=90,
                                                              extra=dict(smem=232448, group=4, aligned16=True)))
        q = np.zeros((2, 8, 128), np.float16)
        k = v = np.zeros((2, 2, 16, 128), np.float16)
        assert cr.decode(q, k, v) == "ran" and CALLS == [CUPY_TOY]          # the default: it outranks v4
    assert cr.REGISTRY.table() == before
    with pytest.raises(ValueError, match="no decode version"):
        D.DecodeConfig(CUPY_TOY)
    bare = replace(rec, extra=dict(rec.extra, layout=None))                # a record must name its layout
    with cr.REGISTRY.added(bare), pytest.raises(ValueError, match="record.extra: decode v98's record must name"):
        D.DecodeConfig(CUPY_TOY)
