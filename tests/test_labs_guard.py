"""The labs grade the learner, not the package: its implementations are out of reach while a solution runs.

For every exercise that runs the learner's code, a solution that calls the package's own
implementation of the answer fails with a message naming the function it reached: when it
looks the function up as it runs (``ik.decode``), when it holds an alias bound before
grading (``from iokernels import merge_states as m``), and when it catches the error and
carries on.  After grading -- passed, failed or raised -- every reference works again.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import iokernels as ik
from iokernels import labs
from iokernels.labs import guard as G
from iokernels.labs import references as R

from lab_cheats import ALIAS_NAMES, ALIASED, CHEATS, NAMES

try:                                   # cheats for exercises added later, in the same form as CHEATS
    from lab_cheats_late import CHEATS as LATE
except ImportError:
    LATE = {}

ALL_CHEATS = {**CHEATS, **LATE}
GUARDED = [n for n, e in labs.EXERCISES.items() if e.kind != "prediction"]


def _all_references():
    paths = {p for e in labs.EXERCISES.values() for p in e.references}
    return {p: fn for p in sorted(paths) if (fn := G.resolve(p)) is not None}


def _snapshot():
    return {p: fn.__code__ for p, fn in _all_references().items()}


def _swallowing(solution):
    """The cheat with every error it meets caught: it returns, with whatever it has."""
    if isinstance(solution, tuple):
        return tuple(_swallowing(s) for s in solution)
    if hasattr(solution, "__getitem__"):          # a kernel, launched as kernel[grid](...)
        class QuietKernel:
            __name__ = getattr(solution, "__name__", "kernel")

            def __getitem__(self, grid):
                return _swallowing(solution[grid])

            def __call__(self, *args, **kwargs):
                return _swallowing(solution)(*args, **kwargs)
        return QuietKernel()

    def quiet(*args, **kwargs):
        try:
            return solution(*args, **kwargs)
        except Exception:               # noqa: BLE001 - the point of the test
            return None
    return quiet


def _grade(name, solution):
    before = _snapshot()
    result = labs.check(name, *(solution if isinstance(solution, tuple) else (solution,)))
    after = _snapshot()                 # (grading may import more modules: compare what was there)
    assert {p: after[p] for p in before} == before, "a reference was left patched after grading"
    assert not [p for p, code in after.items() if code.co_name == "_stub"]
    return result


def _assert_caught(result, path):
    assert result.status == "failed", str(result)
    first = result.message.splitlines()[0]
    assert "the package's own implementation" in first, result.message
    if path is not None:
        assert f"called {path}," in first, result.message
    else:
        assert "called iokernels." in first, result.message
    assert result.mistake == "the package's implementation called"


def test_every_exercise_that_runs_code_names_its_references():
    for name, ex in labs.EXERCISES.items():
        assert ex.kind in ("code", "prediction"), name
        if ex.kind == "prediction":
            assert ex.references == (), f"{name}: a prediction runs no learner code"
            continue
        assert ex.references, f"{name} runs the learner's code but names no reference implementation"
        for path in ex.references:
            G.resolve(path)             # raises for a path that names nothing (None: not imported yet)
    assert labs.EXERCISES["loop_order"].kind == "prediction"


def test_reference_groups_resolve_and_leave_the_learners_tools_alone():
    tools = [ik.conventions.kv_head, ik.conventions.mask, ik.conventions.tile_state, ik.conventions.key_range,
             ik.traffic.count, ik.testing.make_inputs]
    tools += [f for f in vars(ik.traffic.HBM).values() if callable(f)]
    blocked = {id(fn) for group in R.ALL_GROUPS.values() for p in group if (fn := G.resolve(p)) is not None}
    for group in R.ALL_GROUPS.values():
        assert group and len(set(group)) == len(group)
    for fn in tools:
        assert id(G._function_of(fn) or fn) not in blocked, fn


def test_every_guarded_exercise_has_a_cheat():
    missing = [n for n in GUARDED if n not in ALL_CHEATS]
    assert not missing, f"no cheating solution tested for {missing} (tests/lab_cheats.py or lab_cheats_late.py)"


@pytest.mark.parametrize("name", sorted(ALL_CHEATS))
def test_a_solution_calling_the_package_fails_and_says_so(name):
    _assert_caught(_grade(name, ALL_CHEATS[name]), NAMES.get(name))


@pytest.mark.parametrize("name", sorted(ALIASED))
def test_an_alias_bound_before_grading_is_caught(name):
    _assert_caught(_grade(name, ALIASED[name]), ALIAS_NAMES.get(name))


@pytest.mark.parametrize("name", sorted(ALL_CHEATS))
def test_catching_the_error_does_not_hide_the_call(name):
    _assert_caught(_grade(name, _swallowing(ALL_CHEATS[name])), NAMES.get(name))


def test_without_the_guard_the_cheats_would_pass():
    """The cheats are real: graded with the references left reachable, they get full marks."""
    from iokernels.labs import engine
    for name in ("merge_states", "split_kv_decode", "online_step"):
        ex = labs.EXERCISES[name]
        open_ex = engine.Exercise(**{**ex.__dict__, "references": ()})
        assert engine.grade(open_ex, CHEATS[name]).passed, name


def test_references_work_after_grading_and_after_the_learner_raised():
    o = np.zeros((2, 3, 4))
    lse = np.log(np.ones((2, 3)))

    def raises_after_reaching(o_parts, lse_parts):
        try:
            ik.merge_states(o_parts, lse_parts)
        finally:
            raise ValueError("the learner's own error")

    result = _grade("merge_states", raises_after_reaching)
    _assert_caught(result, "iokernels.api.merge_states")
    merged, total = ik.merge_states(o, lse)            # the package works again, with the same code
    assert np.allclose(total, np.log(2.0)) and np.all(merged == 0)
    with pytest.raises(KeyboardInterrupt):
        with G.guard(R.MERGE):
            raise KeyboardInterrupt
    assert ik.merge_states(o, lse)[1].shape == (3,)


def test_guards_nest_and_hold_across_threads():
    o, lse = np.zeros((2, 3, 4)), np.zeros((2, 3))
    seen = []

    def in_thread():
        try:
            ik.merge_states(o, lse)
            seen.append("ran")
        except G.ReferenceReached:
            seen.append("blocked")

    with pytest.raises(G.ReferenceReached):
        with G.guard(R.MERGE):
            with G.guard(R.MERGE + R.ORACLE):
                pass                                    # the inner guard reached nothing
            t = threading.Thread(target=in_thread)      # still blocked: the outer guard holds it
            t.start()
            t.join()
    assert seen == ["blocked"]
    assert ik.merge_states(o, lse)[1].shape == (3,)


def test_a_bound_method_fetched_before_grading_is_caught():
    cache = ik.PagedKVCache(8, block_size=4, num_kv_heads=2, head_dim=3, dtype=np.float32)
    sid = cache.new_sequence()
    bound = cache.append                                # fetched before grading

    def append_token(table, seq_len, ref_counts, free_list, k_pool, v_pool, k_tok, v_tok):
        bound(sid, k_tok[None], v_tok[None])
        return table

    _assert_caught(_grade("copy_on_write", append_token), "iokernels.paged.PagedKVCache.append")
    cache.append(sid, np.ones((1, 2, 3), np.float32), np.ones((1, 2, 3), np.float32))
    assert cache.seq_len(sid) == 1


def test_a_numba_kernel_launched_with_a_grid_runs_under_the_guard():
    from iokernels.core import gpu, reference
    if not gpu.simulator_enabled():        # compiled for a GPU, the kernel could not call Python at all
        pytest.skip("needs Numba's CUDA simulator (a kernel that calls Python runs only there)")
    from numba import cuda                 # the simulator without a GPU (tests/conftest.py)

    def kernel(out):
        out[0] = reference.attention(np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2)))[1][0, 0, 0]

    launched = G.guarded(cuda.jit(kernel), R.ORACLE)
    assert launched.py_func is kernel
    with pytest.raises(G.ReferenceReached) as caught:
        launched[1, 1](np.zeros(1))
    assert caught.value.path == "iokernels.core.reference.attention"
    out = np.zeros(1)
    cuda.jit(kernel)[1, 1](out)            # outside the guard the same kernel runs
    assert np.isclose(out[0], 2.0 / np.sqrt(2.0))


def test_a_stale_reference_path_is_an_error_for_the_tests_not_for_grading():
    with pytest.raises(ValueError, match="path"):
        G.resolve("iokernels.decode.no_such_function")
    with G.guard(("iokernels.decode.no_such_function",) + R.MERGE) as record:
        pass
    assert record.paths == set(R.MERGE)


def test_a_submodule_of_an_imported_only_package_not_imported_yet_resolves_to_none(monkeypatch):
    """Whatever imported the package (and not yet its submodule), a reference into the
    submodule is out of the learner's reach, as the package itself is before its import."""
    import sys
    import types
    pkg = types.ModuleType("ik_fake_backend")
    monkeypatch.setitem(sys.modules, "ik_fake_backend", pkg)
    monkeypatch.setattr(G, "IMPORTED_ONLY", G.IMPORTED_ONLY + ("ik_fake_backend",))
    assert G.resolve("ik_fake_backend.counting.count_attention") is None
    pkg.counting = types.SimpleNamespace(count_attention=lambda: 1)       # once reachable, resolved
    assert G.resolve("ik_fake_backend.counting.count_attention") is pkg.counting.count_attention


def test_an_inner_guard_naming_a_function_another_way_still_sees_the_call():
    o, lse = np.zeros((2, 3, 4)), np.zeros((2, 3))
    with pytest.raises(G.ReferenceReached) as outer:
        with G.guard(("iokernels.api.merge_states",)):
            with pytest.raises(G.ReferenceReached) as inner:
                with G.guard(("iokernels.merge_states",)):        # the same function, by its public name
                    try:
                        ik.merge_states(o, lse)
                    except G.ReferenceReached:
                        pass
            assert inner.value.path == "iokernels.merge_states"
    assert outer.value.path == "iokernels.api.merge_states"
    assert ik.merge_states(o, lse)[1].shape == (3,)


def test_a_learner_copy_that_calls_the_package_scores_zero(tmp_path):
    """The lab 05 learner copy with ik.merge_states and ik.decode as its answers: zero, and the summary says why."""
    import json
    from iokernels.labs import notebooks as lnb
    from test_notebooks import ROOT
    lnb.write_student_copies(ROOT / "notebooks" / "labs", tmp_path)
    path = tmp_path / "05_flash_decoding.ipynb"
    nb = json.loads(path.read_text())
    answers = iter(["return ik.merge_states(o_parts, lse_parts)",
                    "return ik.decode(q, k, v, num_splits=num_splits, scale=scale, return_lse=True)"])
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if "raise NotImplementedError(" in src:
            stub = next(ln for ln in src.split("\n") if "raise NotImplementedError(" in ln)
            cell["source"] = src.replace(stub.strip(), next(answers))
    path.write_text(json.dumps(nb))
    grade = lnb.grade_notebook(path)
    by_name = {r.exercise: r for r in grade.results}
    assert set(by_name) == {"merge_states", "split_kv_decode"} and not grade.cell_errors
    assert "called iokernels.api.merge_states," in by_name["merge_states"].message
    assert "called iokernels.api.decode," in by_name["split_kv_decode"].message
    table = lnb.score_table([grade])
    assert "score: 0 / 2 exercises passed" in table
    assert table.count("likely mistake: the package's implementation called") == 2, table
