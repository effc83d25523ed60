"""Lab 13 (the Triton tile loop): the solution passes, each known mistake is named, the models are exact.

The kernels graded here are the lab notebook's own kernel cell with one mistake written in, run on
Triton's interpreter (the conftest sets TRITON_INTERPRET=1 where there is no GPU).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from iokernels import labs
from iokernels.core import reference, testing
from iokernels.labs import exercises_triton as X
from iokernels.triton_backend import launch

WHY = launch.unavailable()
needs_triton = pytest.mark.skipif(WHY is not None, reason=WHY or "")
LAB = Path(__file__).resolve().parents[1] / "notebooks" / "labs" / "13_triton_forward.ipynb"

#: mistake -> (the solution's line, what the mistaken kernel has instead)
EDITS = {
    X.NO_ACC_RESCALE: ("acc = acc * alpha[:, None] + ", "acc = acc + "),
    X.NO_L_RESCALE: ("l = l * alpha + ", "l = l + "),
    X.MASKED_TO_ZERO: ('tl.where(seen, s, float("-inf"))', "tl.where(seen, s, 0.0)"),
    X.NO_MASK: ('s = tl.where(seen, s, float("-inf"))', "s = s"),
    X.MASKED_NAN: ('m_use = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_use = m_new"),
}


def _kernel_source() -> str:
    cells = json.loads(LAB.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    src = next(s for s in sources if "def fwd_lab" in s)
    return "\n".join(ln for ln in src.splitlines() if "### " not in ln)


def _load(tmp_path, src: str, name: str):
    head = ("import triton\nimport triton.language as tl\nfrom iokernels.triton_backend.tiles import mm, key_bounds, "
            "tile_span, LN2 as _LN2\nLN2 = tl.constexpr(_LN2)\n\n")
    path = tmp_path / f"{name}.py"
    path.write_text(head + src + "\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fwd_lab


@needs_triton
def test_the_solution_passes(tmp_path):
    launch.prepare()
    assert labs.check("triton_forward", _load(tmp_path, _kernel_source(), "lab13_solution")).passed


@needs_triton
@pytest.mark.parametrize("mistake", list(EDITS), ids=lambda m: m.name.replace(" ", "_"))
def test_each_mistake_is_named(tmp_path, mistake):
    launch.prepare()
    old, new = EDITS[mistake]
    src = _kernel_source()
    assert old in src
    result = labs.check("triton_forward", _load(tmp_path, src.replace(old, new), "lab13_" + str(abs(hash(old)))))
    assert result.status == "failed" and result.mistake == mistake.name, str(result)


@pytest.mark.parametrize("interpreting", [True, False])
def test_every_case_catches_a_missing_rescale_wherever_it_runs(monkeypatch, interpreting):
    """On the interpreter and on a GPU alike, the grader's tiles split every case's keys over
    several tiles, so a kernel that does not rescale l or acc gives another answer in every
    case (with one tile a row, the rescale never happens and the mistake would pass)."""
    monkeypatch.setattr(launch, "interpreting", lambda: interpreting)
    bq, bk = X.lab_tile()
    for i, case in enumerate(X.TRITON_FORWARD.cases()):
        p = case.params
        q, k, v = testing.make_inputs(np.random.default_rng(i), heads_q=p["hq"], heads_kv=p["hkv"], seqlen_q=p["nq"],
                                      seqlen_k=p["nk"], head_dim=p["d"])
        ref, _ = reference.attention(q, k, v, causal=p["causal"])
        for mistake in (X.NO_ACC_RESCALE, X.NO_L_RESCALE):
            wrong = X.tile_model(q, k, v, p["causal"], bq, bk, mistake)[0]
            assert np.nanmax(np.abs(wrong - ref)) > 1e-2, (case.label, mistake.name)


def test_without_triton_the_exercise_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(launch, "triton_installed", lambda: False)
    result = labs.check("triton_forward", lambda *a: None)
    assert result.status == "skipped" and "iokernels[triton]" in str(result)


@pytest.mark.parametrize("nq,nk,causal", [(37, 45, False), (45, 37, True), (33, 33, True), (5, 40, True)])
def test_the_tile_model_without_a_mistake_is_the_oracle(nq, nk, causal):
    q, k, v = testing.make_inputs(np.random.default_rng(nq), heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk,
                                  head_dim=24)
    o, lse = X.tile_model(q, k, v, causal, 16, 16)
    ref, ref_lse = reference.attention(q, k, v, causal=causal)
    assert np.abs(o - ref).max() < 1e-12
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-12
    for mistake in EDITS:
        wrong = X.tile_model(q, k, v, causal, 16, 16, mistake)[0]
        if mistake is not X.MASKED_NAN:                   # NaN only where a row sees nothing in a visited tile
            assert np.nanmax(np.abs(wrong - ref)) > 1e-3, mistake.name
