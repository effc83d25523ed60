"""The CuPy public calls dispatch through the registry: the version a call runs is the record's.

No GPU here, so each test swaps the records' launchers for stubs that note the version and
config they were given (``REGISTRY.added`` with copies of the records), and describes the
GPU by a fixed ``need``.  ``attention_backward`` in particular picks its version by rank and
check, like ``attention`` and ``decode``, and runs the version a config names.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace

import numpy as np
import pytest

from iokernels import cupy_raw as cr
from iokernels.core.registry import Need
cb, cd, cf = (importlib.import_module(f"iokernels.cupy_raw.{m}") for m in ("backward", "decode", "forward"))

CALLS: list = []


def _stub(*args, config, **kw):
    CALLS.append((config.version, config))
    return "ran"


@contextlib.contextmanager
def stubbed(op):
    """The records of ``op`` with stub launchers, in place of the real ones, inside the block."""
    recs = cr.REGISTRY.kernels(op)
    saved = dict(cr.REGISTRY._kernels)
    for r in recs:
        del cr.REGISTRY._kernels[(r.op, r.version)]
    CALLS.clear()
    try:
        with cr.REGISTRY.added(*(replace(r, launcher=_stub) for r in recs)):
            yield
    finally:
        cr.REGISTRY._kernels.clear()
        cr.REGISTRY._kernels.update(saved)


def _need(dtype, d, cc=80):
    def need(op, q=None, k=None, v=None, cache=None, *, causal=False, window=None):
        return Need(dtype=dtype, head_dim=d, cc=cc, extra=dict(smem=232448, group=2, aligned16=True))
    return need


def _qkv(dtype, d=64):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, 5, d)).astype(dtype) for h in (4, 2, 2))
    return q, k, v


@pytest.mark.parametrize("dtype, want", [("float16", "v2"), ("float32", "v1"), ("float64", "v1")])
def test_attention_backward_runs_the_registry_default(monkeypatch, dtype, want):
    monkeypatch.setattr(cb, "need", _need(dtype, 64))
    q, k, v = _qkv(dtype)
    with stubbed("attention_backward"):
        assert cr.attention_backward(q, q, k, v, q, q[..., 0]) == "ran"
        assert [c[0] for c in CALLS] == [want]
        assert isinstance(CALLS[0][1], cr.BackwardConfig)


def test_attention_backward_keeps_the_config_it_is_given(monkeypatch):
    monkeypatch.setattr(cb, "need", _need("float16", 64))
    q, k, v = _qkv("float16")
    with stubbed("attention_backward"):
        cfg = cr.BackwardConfig("v1", deterministic=True)
        cr.attention_backward(q, q, k, v, q, q[..., 0], config=cfg)
        assert CALLS == [("v1", cfg)]                        # not overwritten by the default
        cr.attention_backward(q, q, k, v, q, q[..., 0], config=cr.BackwardConfig(deterministic=True))
        version, got = CALLS[-1]
        assert version == "v2" and got.deterministic         # version None: the default, the rest kept


def test_attention_backward_refuses_a_version_that_cannot_run(monkeypatch):
    monkeypatch.setattr(cb, "need", _need("float32", 64))
    q, k, v = _qkv("float32")
    with stubbed("attention_backward"):
        with pytest.raises(ValueError, match="v2 cannot run here"):
            cr.attention_backward(q, q, k, v, q, q[..., 0], config=cr.BackwardConfig("v2"))
        assert CALLS == []


def test_attention_backward_at_a_head_dim_past_v2_runs_v1(monkeypatch):
    monkeypatch.setattr(cb, "need", _need("bfloat16", 256))
    q, k, v = _qkv("float16", 256)
    with stubbed("attention_backward"):
        cr.attention_backward(q, q, k, v, q, q[..., 0])
        assert [c[0] for c in CALLS] == ["v1"]


@pytest.mark.parametrize("dtype, cc, want", [("float16", 80, "v2"), ("float32", 80, "v1b"), ("float32", 75, "v1"),
                                              ("float64", 90, "v1")])
def test_attention_and_decode_dispatch_the_same_way(monkeypatch, dtype, cc, want):
    monkeypatch.setattr(cf, "need", _need(dtype, 64, cc))
    q, k, v = _qkv(dtype)
    with stubbed("attention"):
        cr.attention(q, k, v)
        assert [c[0] for c in CALLS] == [want]
    monkeypatch.setattr(cd, "need", _need(dtype, 64, cc))
    with stubbed("decode"):
        cr.decode(q[:, :, 0], k, v)
        assert [c[0] for c in CALLS] == ["v4" if dtype == "float16" else "v3"]
