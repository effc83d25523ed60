"""The labs: solutions pass, learner copies fail with teaching messages, wrong solutions are named.

* every solution notebook executes in a real kernel (nbclient, one child process per
  notebook, as tests/test_notebooks.py runs the lesson notebooks) and each check cell shows
  PASSED (or SKIPPED, for the GPU-only exercise without a GPU), in under 2 minutes;
* every generated learner notebook executes without a traceback and each check shows NOT YET
  with a message;
* ``python -m iokernels labs grade`` gives full marks on the solutions and zero on the stubs,
  and writes JUnit XML;
* one deliberately wrong solution per exercise fails, with the mistake named where the
  grader knows it;
* the stub conversion and the predict-then-check helper behave as documented.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from iokernels import labs
from iokernels.labs import notebooks as lnb
from iokernels.labs.gpu_exercises import compile_check, cuda_source
from iokernels.labs.engine import LabSkip

from test_notebooks import PARALLEL, ROOT, _execute

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

LAB_DIR = ROOT / "notebooks" / "labs"
LABS = sorted(LAB_DIR.glob("*.ipynb"))
#: each lab (solutions) must run top to bottom in this long on two cores
LAB_BUDGET_S = 120

def _run(src: Path, dst: Path):
    """Execute ``src`` into ``dst`` in a child process, with the notebook tests' runner (IPC
    sockets, one retry of a kernel that does not start): (seconds, error or None)."""
    seconds, _, error = _execute(src, save_to=dst)
    return seconds, error


@pytest.fixture(scope="module")
def learner_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("learner")
    lnb.write_student_copies(LAB_DIR, out)
    return out


@pytest.fixture(scope="module")
def executed(tmp_path_factory, learner_dir):
    """{(kind, name): Future of (seconds, error, executed path)} for solutions and learner copies."""
    out = tmp_path_factory.mktemp("executed")
    pool = ThreadPoolExecutor(max_workers=PARALLEL)

    def job(src, kind):
        dst = out / f"{kind}-{src.name}"
        seconds, error = _run(src, dst)
        return seconds, error, dst

    futures = {("solution", p.name): pool.submit(job, p, "solution") for p in LABS}
    futures.update({("learner", p.name): pool.submit(job, learner_dir / p.name, "learner") for p in LABS})
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _check_outputs(path: Path) -> list:
    """(exercise, text of the check cell's output) for every labs.check cell of an executed notebook."""
    nb = nbformat.read(path, as_version=4)
    found = []
    for cell in nb.cells:
        m = re.search(r"""labs\.check\(\s*["'](\w+)""", cell.source) if cell.cell_type == "code" else None
        if m:
            text = ""
            for o in cell.outputs:
                text += o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values())
            found.append((m.group(1), text))
    return found


def test_there_are_labs_in_order():
    assert [p.name[:2] for p in LABS] == [f"{i:02d}" for i in range(1, len(LABS) + 1)]
    assert len(LABS) >= 8
    checked = {name for p in LABS for name in lnb._expected(json.loads(p.read_text()))}
    assert checked == set(labs.EXERCISES), "every exercise is checked by exactly the labs"


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_lab_committed_without_outputs_and_opens_properly(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i}: strip outputs"
    first = nb.cells[0].source
    for word in ("**You will**", "**Read first:**", "**Time:**", "**Objectives**"):
        assert word in first, f"{path.name} opens without {word}"
    assert "What you can now explain" in nb.cells[-1].source
    assert any(lnb.BEGIN in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_solution_notebook_passes_every_check(path, executed):
    seconds, error, out = executed[("solution", path.name)].result()
    assert error is None, f"{path.name} failed after {seconds:.0f} s:\n{error}"
    assert seconds < LAB_BUDGET_S, f"{path.name} took {seconds:.0f} s"
    checks = _check_outputs(out)
    assert checks, f"{path.name} has no check cell"
    for name, text in checks:
        ok = "PASSED" in text or (name == "cupy_online" and "SKIPPED" in text)
        assert ok and "NOT YET" not in text, f"{path.name}: {name} did not pass:\n{text}"


@pytest.mark.slow
@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_learner_notebook_runs_and_every_check_teaches(path, executed):
    seconds, error, out = executed[("learner", path.name)].result()
    assert error is None, f"learner copy of {path.name} raised:\n{error}"
    nb = nbformat.read(out, as_version=4)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.get("output_type") != "error", f"learner copy of {path.name}: {o.get('ename')}"
    for name, text in _check_outputs(out):
        assert "NOT YET" in text and "PASSED" not in text, f"{name}: {text}"
        assert re.search(r"not written yet|nothing to grade yet|race on shared|keys sliced at the queries",
                         text), f"{name}: {text}"


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "iokernels", "labs", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_labs_grade_full_marks_on_solutions_zero_on_stubs(tmp_path):
    junit = tmp_path / "solutions.xml"
    r = _cli("grade", LAB_DIR, "--junit", junit)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(labs.EXERCISES) - (1 if "SKIPPED" in r.stdout or "skipped" in r.stdout else 0)
    assert f"score: {n} / {n} exercises passed" in r.stdout, r.stdout
    suites = ET.parse(junit).getroot()
    assert sum(int(s.get("tests")) for s in suites) == len(labs.EXERCISES)
    assert sum(int(s.get("failures")) for s in suites) == 0

    learner = tmp_path / "learner"
    r = _cli("student", learner)
    assert r.returncode == 0 and len(list(learner.glob("*.ipynb"))) == len(LABS), r.stdout + r.stderr
    r = _cli("grade", learner, "--junit", tmp_path / "stubs.xml")
    assert r.returncode == 1
    assert re.search(r"score: 0 / \d+ exercises passed", r.stdout), r.stdout
    suites = ET.parse(tmp_path / "stubs.xml").getroot()
    failures = [tc for s in suites for tc in s.iter("testcase") if tc.find("failure") is not None]
    assert len(failures) >= len(labs.EXERCISES) - 1
    for tc in failures:
        assert tc.find("failure").get("message"), "each failure says why"


# --------------------------------------------------------------------------- wrong solutions
def _solution_namespace(lab: str, replace=()):
    """Execute a lab's code cells (check cells left out), after text replacements that plant a mistake."""
    nb = json.loads((LAB_DIR / lab).read_text())
    ns = {"__name__": "__lab__"}
    planted = {old: False for old, _ in replace}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or "labs.check(" in src:
            continue
        for old, new in replace:
            if old in src:
                src, planted[old] = src.replace(old, new), True
        exec(compile(src, lab, "exec"), ns)
    assert all(planted.values()), f"a planted mistake did not match the solution text: {planted}"
    return ns


#: (lab, exercise, entry names, [(solution text, wrong text)], expected words in the message)
WRONG = [
    ("01_naive_traffic.ipynb", "naive_traffic", ("naive_attention", "predict_naive_bytes"),
     [("m = s.max(axis=1, keepdims=True)", "m = S[:].astype(acc).max(axis=1, keepdims=True)")],
     "S read twice by the softmax"),
    ("01_naive_traffic.ipynb", "naive_traffic", ("naive_attention", "predict_naive_bytes"),
     [('"S": (Nq * Nk * e, Nq * Nk * e)', '"S": (Nq * Nk * e, 0)')], "the prediction for S"),
    ("02_online_softmax_step.ipynb", "online_step", ("online_step",),
     [("alpha[:, None] * o + p @ v", "alpha[:, None] * (alpha[:, None] * o) + p @ v")], "rescale applied twice"),
    ("02_online_softmax_step.ipynb", "online_step", ("online_step",),
     [("m_ref = np.where(np.isneginf(m_new), 0.0, m_new)", "m_ref = m_new")], "a fully masked block gives NaN"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("s = (q @ k.T) * acc.type(scale)", "q = Q[b, h, r0:r1].astype(acc)\n"
       "                    s = (q @ k.T) * acc.type(scale)")], "Q re-read inside the K/V tile loop"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [('!= "skip"]', ']')], "fully masked tiles loaded"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("hk = ik.conventions.kv_head(h, Hq, Hkv)", "hk = h % Hkv")], "K/V of the wrong head (GQA)"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("m_ref = np.where(np.isneginf(m_new), 0.0, m_new).astype(acc)", "m_ref = m_new")],
     "a fully masked row gives NaN"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("l = alpha * l + p.sum(axis=1)", "l = l + p.sum(axis=1)")], "l not rescaled"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("l = alpha * l + p.sum(axis=1)", "l = alpha * alpha * l + p.sum(axis=1)"),
      ("o = alpha[:, None] * o + p @ v", "o = alpha[:, None] * alpha[:, None] * o + p @ v")], "rescale applied twice"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("o = alpha[:, None] * o + p @ v", "o = alpha[:, None] * alpha[:, None] * o + p @ v")],
     "rescale applied twice"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("hk = ik.conventions.kv_head(h, Hq, Hkv)", "hk = h")], "K/V of the wrong head (GQA)"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("hk = ik.conventions.kv_head(h, Hq, Hkv)", "hk = h // Hkv")], "K/V of the wrong head (GQA)"),
    ("03_flash_forward.ipynb", "flash_forward", ("flash_forward",),
     [("                if not tiles:  ",
       "                q = Q[b, h, r0:r1].astype(acc)\n                if not tiles:  "),
      ("                q = Q[b, h, r0:r1].astype(acc)                        # load Q_i", "                # Q_i")],
     "Q loaded for a query tile that sees no key"),
    ("03_flash_forward.ipynb", "loop_order", ("prediction",),
     [('prediction = {"A": "fa1"', 'prediction = {"A": "fa2"')], "shape A: you predicted fa2"),
    ("04_backward.ipynb", "flash_backward", ("flash_backward",),
     [("ds = p * (do @ v.T - Di)", "ds = p * (do @ v.T)")], "D forgotten"),
    ("04_backward.ipynb", "flash_backward", ("flash_backward",),
     [("dv += p.T @ do", "dv += p.T @ do\n                        k = K[b, hk, c0:c1].astype(acc)")],
     "K_j, V_j re-read inside the Q loop"),
    ("04_backward.ipynb", "flash_backward", ("flash_backward",),
     [("                dQaccum[b, h, r0:r1] = 0.0\n", "")], "dQaccum not zeroed"),
    ("05_flash_decoding.ipynb", "merge_states", ("merge_states",),
     [("np.where(live[..., None], o_parts, 0.0)", "o_parts")], "an empty part leaks NaN"),
    ("05_flash_decoding.ipynb", "merge_states", ("merge_states",),
     [("np.exp(np.where(live, lse_parts - np.where(empty, 0, m), 0))", "np.exp(np.where(live, lse_parts, 0))"),
      ("m + np.log(np.where(empty, 1, total))", "np.log(np.where(empty, 1, total))")],
     "exp(LSE_s) without subtracting the max"),
    ("05_flash_decoding.ipynb", "split_kv_decode", ("split_kv_decode",),
     [("kvh = np.arange(Hq) // (Hq // Hkv)", "kvh = np.arange(Hq) % Hkv")], "O: max |O - oracle|"),
    ("06_paged_kv_cache.ipynb", "paged_gather", ("paged_gather",),
     [("K_cache[blk, :t1 - t0]", "K_cache[blk][:t1 - t0]")], "the unwritten tail of the last block read"),
    ("06_paged_kv_cache.ipynb", "copy_on_write", ("append_token",),
     [("if ref_counts[blk] > 1:", "if False:")], "no copy-on-write"),
    ("06_paged_kv_cache.ipynb", "copy_on_write", ("append_token",),
     [("            ref_counts[blk] -= 1\n", "")], "the shared block's count not decremented"),
    ("06_paged_kv_cache.ipynb", "copy_on_write", ("append_token",),
     [("k_pool[new, :slot] = k_pool[blk, :slot]", "k_pool[new] = k_pool[blk]"),
      ("v_pool[new, :slot] = v_pool[blk, :slot]", "v_pool[new] = v_pool[blk]")], "the whole block copied"),
    ("06_paged_kv_cache.ipynb", "copy_on_write", ("append_token",),
     [("blk = free_list.pop(0)", "blk = free_list.pop()")], "free blocks taken from the wrong end"),
    ("06_paged_kv_cache.ipynb", "copy_on_write", ("append_token",),
     [("new = free_list.pop(0)", "new = free_list.pop()")], "free blocks taken from the wrong end"),
    ("07_numba_cuda.ipynb", "numba_forward", ("flash_fwd_kernel",),
     [("dot += q_i[dd] * K_j[j - c0, dd]\n                m_new", "dot += q[b, h, i, dd] * K_j[j - c0, dd]\n"
       "                m_new")], "q_i re-read from global memory inside the tile loop"),
    ("07_numba_cuda.ipynb", "numba_forward", ("flash_fwd_kernel",),
     [("cuda.syncthreads()                                   # the tile is complete", "pass  #")],
     "a missing cuda.syncthreads()"),
    ("07_numba_cuda.ipynb", "barrier_hunt", ("row_lse_kernel",),
     [("cuda.syncthreads()                                   # the fix", "pass  #")],
     "a missing cuda.syncthreads()"),
]


@pytest.mark.parametrize("lab, exercise, entries, plant, words", WRONG,
                         ids=[f"{w[1]}-{i}" for i, w in enumerate(WRONG)])
def test_wrong_solution_fails_and_names_the_mistake(lab, exercise, entries, plant, words):
    ns = _solution_namespace(lab, plant)
    result = labs.check(exercise, *(ns[e] for e in entries))
    assert result.status == "failed", str(result)
    assert words in result.message, result.message
    assert "case " in result.message or "shape" in result.message, "the message names the failing case"
    again = labs.check(exercise, *(ns[e] for e in entries))     # seeded: the same verdict every time
    assert again.status == "failed" and again.message == result.message


def test_the_package_merge_is_not_an_answer_to_its_own_exercise():
    import iokernels as ik
    r = labs.check("merge_states", ik.merge_states)
    assert r.status == "failed" and "called iokernels.api.merge_states" in r.message, r.message


def test_a_fully_masked_row_shares_a_query_tile_with_visible_rows():
    """A hidden case where a query tile holds a row that sees no key next to rows that do."""
    import numpy as np
    from iokernels.core import conventions as cv
    mixed = []
    for case in labs.EXERCISES["flash_forward"].cases():
        p = case.params
        if p["causal"]:
            lo, hi = cv.key_range(np.arange(p["Nq"]), p["Nq"], p["Nk"], True)
            blind = hi <= lo
            mixed += [r0 for r0 in range(0, p["Nq"], p["Br"]) if blind[r0:r0 + p["Br"]].any()
                      and not blind[r0:r0 + p["Br"]].all()]
    assert mixed, "no hidden case mixes a fully masked row with visible rows in one query tile"
    assert any(c.params["Nq"] == 45 and c.params["Nk"] == 29 and c.params["Br"] == 5
               for c in labs.EXERCISES["flash_forward"].cases())


def test_dqaccum_must_be_zeroed_says_the_spec_and_the_lab():
    assert "zero it" in labs.spec("flash_backward")
    text = "".join("".join(c["source"]) for c in json.loads((LAB_DIR / "04_backward.ipynb").read_text())["cells"]
                   if c["cell_type"] == "markdown")
    assert "dQaccum" in text and "Set it to 0" in text


def test_a_wrong_loop_order_guess_does_not_print_the_answer():
    from iokernels.labs.exercises import LOOP_ORDER_SHAPES, loop_order_traffic
    r = labs.check("loop_order", {"A": "fa2", "B": "fa1"})
    assert r.status == "failed" and "shape A: you predicted fa2" in r.message
    moved = loop_order_traffic(**LOOP_ORDER_SHAPES["A"])
    for n in moved.values():
        assert f"{n:,}" not in r.message and str(n) not in r.message, r.message
    assert not re.search(r"Br=\d|Bc=\d", r.message), r.message
    for text in (labs.spec("loop_order"), labs.EXERCISES["loop_order"].hint):
        assert "/ 2" in text or "/ itemsize" in text, text      # M's unit, stated for fp16
    lab = "".join("".join(c["source"]) for c in json.loads((LAB_DIR / "03_flash_forward.ipynb").read_text())["cells"])
    assert "M in elements" not in lab and "M = SRAM bytes / 2 for fp16" in lab


def test_grade_summary_shows_the_likely_mistake_and_the_hint(tmp_path):
    ns = _solution_namespace("02_online_softmax_step.ipynb",
                             [("m_ref = np.where(np.isneginf(m_new), 0.0, m_new)", "m_ref = m_new")])
    named = labs.check("online_step", ns["online_step"])
    hinted = labs.check("loop_order", {"A": "fa2", "B": "fa2"})
    table = lnb.score_table([lnb.NotebookGrade(tmp_path / "02_x.ipynb", [named], [], 0.0),
                             lnb.NotebookGrade(tmp_path / "03_x.ipynb", [hinted], [], 0.0)])
    assert "likely mistake: a fully masked block gives NaN. Fix:" in table, table
    assert "hint: the tiles come from the SRAM size" in table, table
    for r in (named, hinted):          # the same lines the check cell shows
        for line in r.message.splitlines():
            if line.startswith(("likely mistake:", "hint:")):
                assert line in table


def test_wrong_cuda_update_does_not_compile_or_is_skipped():
    ns = _solution_namespace("08_cupy_raw_kernel.ipynb", [("fmaxf(m_new, s[j])", "fmaxf(m_new s[j])")])
    result = labs.check("cupy_online", ns["online_update_cuda"])
    if result.status == "skipped":
        pytest.skip(result.message)       # no nvcc here either: nothing can check CUDA C++
    assert result.status == "failed" and "does not compile" in result.message, result.message


def test_the_solution_cuda_update_compiles():
    ns = _solution_namespace("08_cupy_raw_kernel.ipynb")
    try:
        assert compile_check(cuda_source(ns["online_update_cuda"]())) is None
    except LabSkip as exc:
        pytest.skip(str(exc))


def test_over_budget_message_names_tensor_and_bytes():
    ns = _solution_namespace("03_flash_forward.ipynb", [("O[b, h, r0:r1] = o / np.where(empty, 1, l)[:, None]",
                                                        "O[b, h, r0:r1] = o / np.where(empty, 1, l)[:, None]\n"
                                                        "                O[b, h, r0:r1] = O[b, h, r0:r1]")])
    r = labs.check("flash_forward", ns["flash_forward"])
    assert r.status == "failed"
    assert re.search(r"O: read [\d,]+ B and wrote [\d,]+ B; the budget is 0 B read", r.message), r.message
    assert "B over" in r.message and r.bytes > r.allowed


def test_error_message_names_error_and_bound():
    ns = _solution_namespace("02_online_softmax_step.ipynb",
                             [("+ p @ v", "+ p @ v * 1.0001")])
    r = labs.check("online_step", ns["online_step"])
    assert r.status == "failed"
    assert re.search(r"max \|O - oracle\| = [\d.e+-]+, float64 must match", r.message), r.message
    assert r.error > r.bound


# --------------------------------------------------------------------------- stubs, predictions
def test_student_source_replaces_regions_by_stubs():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION say what\n    return x + y\n    ### END SOLUTION\n"
    out = lnb.student_source(src)
    assert "return x + y" not in out and "raise NotImplementedError('say what')" in out
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError, match="say what"):
        ns["f"](1)
    top = "### BEGIN SOLUTION\nprediction = {'A': 'fa1'}\nother: int = 3\n### END SOLUTION\nprint(1)"
    assert lnb.student_source(top).splitlines()[1:] == ["prediction = None", "other = None", "print(1)"]
    gone = "for i in range(2):\n    a = i\n    ### BEGIN SOLUTION remove\n    fix()\n    ### END SOLUTION\n"
    assert "fix()" not in lnb.student_source(gone) and "SOLUTION" not in lnb.student_source(gone)
    with pytest.raises(ValueError, match="source"):
        lnb.student_source("### BEGIN SOLUTION\nx = 1\n")


def test_strict_mode_raises_for_nbgrader(monkeypatch):
    monkeypatch.setenv(labs.STRICT_ENV, "1")
    with pytest.raises(AssertionError, match="nothing to grade yet"):
        labs.check("loop_order", None)
    ns = _solution_namespace("03_flash_forward.ipynb")
    assert labs.check("loop_order", ns["prediction"]).passed


def test_check_with_nothing_and_unknown_names():
    assert "nothing to grade yet" in labs.check("loop_order", None).message
    with pytest.raises(ValueError, match="name"):
        labs.check("no_such_exercise", print)


def test_reveal_hides_the_answer_until_there_is_a_prediction():
    r = labs.reveal("paging_waste_1000", dict(blocks=None, wasted_slots=None, mib=None))
    assert r.correct is None and "63" not in r.text and "126" not in r.text and "Predict first" in str(r)
    r = labs.reveal("paging_waste_1000", dict(blocks=63, wasted_slots=8, mib=126))
    assert r.correct is True and all(r.verdicts.values())
    r = labs.reveal("paging_waste_1000", dict(blocks=62, wasted_slots=8, mib=126))
    assert r.correct is False and r.verdicts == {"blocks": False, "wasted_slots": True, "mib": True}
    r = labs.reveal("backward_block_k", 1)
    assert r.correct is False and "Bc" in r.text
    with pytest.raises(ValueError, match="key"):
        labs.reveal("nope", 1)


def test_a_solution_that_reads_around_the_counter_fails():
    from iokernels.labs import engine, exercises

    def sneaky(Q, K, V, O, LSE, *, Br, Bc, causal, scale):
        q = Q._HBM__store                                  # every byte, uncounted
        raise AssertionError(f"never run: {q.shape}")

    result = engine.grade(exercises.FLASH_FORWARD, sneaky)
    assert result.status == "failed" and "private store" in result.message
