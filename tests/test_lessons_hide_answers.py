"""No lesson shows a lab's answer before the lab.

Lessons print package code with ``show_source(...)``.  For every lab exercise, ``ANSWERS`` names
the package's version of exactly what the learner writes; no lesson notebook that the syllabus
(notebooks/labs/README.md: its lab table and its weeks) puts before the exercise's lab may
show any line of it.  A lesson comes before a lab when its week is the lab's week or earlier:
a week's lessons are read before its labs.

The calls are found statically: each code cell is parsed with ``ast``, the first argument of a
``show_source`` call is evaluated in a namespace built from the notebook's imports (and simple
assignments such as ``dec = importlib.import_module("iokernels.decode")``), and the lines it
prints (``start`` / ``stop`` applied as ``show_source`` applies them) are compared with the
answer's source lines.  A target that does not resolve fails the test with its expression, so
the test cannot pass by not seeing a call.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")      # notebook 05 imports the Numba kernels

import iokernels  # noqa: E402
from iokernels import labs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: where the imported package lives (the CUDA sources a lesson shows are found through it)
PACKAGE = Path(iokernels.__file__).resolve().parent
NOTEBOOKS = ROOT / "notebooks"
README = NOTEBOOKS / "labs" / "README.md"
FA_V1 = "cupy_raw/kernels/fa_v1.cu"          # relative to the package

#: exercise -> the package's version of what the learner writes: dotted paths, or
#: (file in the package, start, stop) for a region of a CUDA source (the lines show_source prints)
ANSWERS = {
    # naive.attention (three steps through HBM) and the closed-form bytes the learner predicts
    "naive_traffic": ("iokernels.naive.attention", "iokernels.naive.traffic_model"),
    "online_step": ("iokernels.tiled._online_step",),
    "flash_forward": ("iokernels.tiled._fa2_head", "iokernels.tiled.forward_fa2"),
    "loop_order": (),                     # a prediction (a value, not code): there is nothing to show
    "flash_backward": ("iokernels.backward.attention_backward_tiled",),
    "merge_states": ("iokernels.decode.merge_states", "iokernels.decode.merge_kernel"),
    "split_kv_decode": ("iokernels.decode.decode_split_kv", "iokernels.decode.split_kv_grid",
                        "iokernels.decode._split_worker", "iokernels.decode.split_ranges"),
    "paged_gather": ("iokernels.paged.paged_gather", "iokernels.paged.PagedKVCache._gather_numpy"),
    "copy_on_write": ("iokernels.paged.PagedKVCache.append", "iokernels.paged.PagedKVCache._allocate"),
    # v2: one thread per row, K_j and V_j loaded into shared memory together, the barriers
    "numba_forward": ("iokernels.numba_cuda.forward.make_v2",),
    "barrier_hunt": ("iokernels.numba_cuda.forward.make_v2",),      # where v2's barriers go
    # the online-softmax update in CUDA C++ (the lab's template has one thread per row)
    "cupy_online": ((FA_V1, "// online softmax, in registers", "// write O_i, LSE_i"),),
    "kv_bytes_per_token": ("iokernels.models.kv_bytes_per_token", "iokernels.models.kv_values_per_token"),
    "absorbed_mla_query": ("iokernels.mla.absorb_query", "iokernels.mla._latent_attention",
                           "iokernels.mla.mla_decode_absorbed"),
    "varlen_bug_hunt": ("iokernels.tiled.attention_varlen",),
    "merge_pair": ("iokernels.context_parallel.merge.merge_pair",),
    "zigzag_split": ("iokernels.context_parallel.split.split_positions",
                     "iokernels.context_parallel.split.chunk_bounds"),
    "rescale_threshold_step": ("iokernels.tiled._Rescale.new_max",),
    "fwht": ("iokernels.fp8.fwht",),
    "randomized_hadamard": ("iokernels.fp8.randomized_hadamard",),
    # the body of forward v1's loop over K/V tiles (the lab gives the kernel's first and last lines)
    "triton_forward": (("triton_backend/forward_v1.py", "        kt = tl.load(k_base", "        m = m_new"),),
}

#: (lesson, exercise) -> why that lesson shows the answer's code before the lab, on purpose.
#: Not listed, because their labs come earlier in the syllabus: notebook 05's tiled._fa2_head
#: (lab 03), notebook 11's tiled loops (labs 02, 03), notebook 13's PagedKVCache._write and
#: decode.paged_tile_loader (lab 06).
KEPT = {
    ("01_naive_attention", "naive_traffic"):
        "naive attention is the lesson's subject; lab 01 asks for it written as three kernels on "
        "counted HBM arrays and for a prediction of each tensor's bytes, which the lesson does not show",
    ("08_flash_decoding", "split_kv_decode"):
        "only the launch grid (which sequence, KV head and split a thread block owns, where its "
        "partial result goes), as the figure and the prose before it say; the split bounds "
        "(split_ranges), the per-split softmax (_split_worker) and the merge, what the learner "
        "writes, are not shown",
    ("06_cupy_tensor_cores", "cupy_online"):
        "the CUDA C++ kernels are the lesson's subject: fa_v1.cu's update splits a row over 16 "
        "lanes with shuffles; lab 08's template has one thread per row",
}


# --------------------------------------------------------------------------- the syllabus
def _lab_table() -> dict[str, str]:
    """{exercise: lab number} from the README's lab table."""
    out = {}
    for row in README.read_text(encoding="utf-8").splitlines():
        cols = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cols) == 5 and re.fullmatch(r"\d\d .+", cols[0]):
            for name in re.findall(r"`([a-z0-9_]+)`", cols[1]):
                out[name] = cols[0][:2]
    return out


def _weeks() -> tuple[dict[str, int], dict[str, int]]:
    """({lesson number: week}, {lab number: week}) from the README's syllabus table."""
    text = README.read_text(encoding="utf-8").split("## A syllabus", 1)[1]
    lessons, lab_weeks = {}, {}
    for row in text.splitlines():
        cols = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cols) == 4 and cols[0].isdigit():
            week = int(cols[0])
            for num in re.findall(r"(?:^|, )(\d\d[ab]?) [a-zA-Z]", cols[1]):
                lessons[num] = week
            for num in re.findall(r"\b(\d\d)\b", cols[2].split("(")[0]):
                lab_weeks[num] = week
    return lessons, lab_weeks


def _lesson_paths() -> dict[str, Path]:
    return {p.stem.split("_")[0]: p for p in sorted(NOTEBOOKS.glob("*.ipynb"))}


def lessons_before(exercise: str) -> list[Path]:
    """The lesson notebooks a learner has read before the exercise's lab."""
    lesson_week, lab_week = _weeks()
    week = lab_week[_lab_table()[exercise]]
    return [p for num, p in _lesson_paths().items() if lesson_week[num] <= week]


# --------------------------------------------------------------------------- what a lesson shows
def _code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in "".join(c["source"]).splitlines())
            for c in cells if c["cell_type"] == "code"]


def _is_simple(value: ast.expr) -> bool:
    """``importlib.import_module("...")`` or a dotted name: safe to evaluate for the namespace."""
    if isinstance(value, ast.Call):
        return (ast.unparse(value.func) == "importlib.import_module" and len(value.args) == 1
                and isinstance(value.args[0], ast.Constant) and not value.keywords)
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name)


def _namespace(trees: list[ast.Module]) -> dict:
    """The notebook's imports (anywhere in a cell) and simple assignments, executed in order."""
    ns: dict = {}
    for tree in trees:
        for node in ast.walk(tree):
            stmt = None
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
                stmt = node
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name) and _is_simple(node.value)):
                stmt = node
            if stmt is not None:
                try:
                    exec(compile(ast.Module([stmt], []), "<notebook>", "exec"), ns)   # noqa: S102
                except (ImportError, AttributeError, NameError):
                    pass             # an optional back end: a target needing it fails to resolve
    return ns


def _span(lines: list[str], first: int, start: str | None, stop: str | None) -> tuple[int, int]:
    """The line numbers show_source prints of ``lines`` (line ``first`` is lines[0])."""
    i0, i1 = 0, len(lines) - 1
    if start is not None:
        i0 = next(i for i, ln in enumerate(lines) if start in ln)
        i1 = next((i for i, ln in enumerate(lines[i0 + 1:], i0 + 1) if stop and stop in ln), len(lines) - 1)
    return first + i0, first + i1


def source_span(obj, start: str | None = None, stop: str | None = None) -> tuple[str, int, int]:
    """(file, first line, last line) that ``show_source(obj, start=..., stop=...)`` prints."""
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        return (str(path.resolve()), *_span(path.read_text(encoding="utf-8").splitlines(), 1, start, stop))
    lines, first = inspect.getsourcelines(obj)
    path = inspect.getsourcefile(inspect.unwrap(obj))
    return (str(Path(path).resolve()), *_span(lines, max(first, 1), start, stop))


def shown(path: Path) -> tuple[list[tuple[str, tuple[str, int, int]]], list[str]]:
    """([(call, span)], [unresolved call]) of every show_source call in a notebook."""
    trees = [ast.parse(src) for src in _code_cells(path)]
    ns = _namespace(trees)
    found, unresolved = [], []
    for tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "show_source"):
                continue
            call = ast.unparse(node)
            try:
                obj = eval(ast.unparse(node.args[0]), dict(ns))     # noqa: S307 (the notebook's own code)
                kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                found.append((call, source_span(obj, kw.get("start"), kw.get("stop"))))
            except Exception as exc:  # noqa: BLE001 (any failure is reported with the call)
                unresolved.append(f"{call}: {type(exc).__name__}: {exc}")
    return found, unresolved


# --------------------------------------------------------------------------- the answers
def _resolve(path: str):
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for name in parts[n:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def answer_spans(exercise: str) -> list[tuple[str, tuple[str, int, int]]]:
    out = []
    for a in ANSWERS[exercise]:
        if isinstance(a, tuple):
            file, start, stop = a
            out.append((f"{file} from {start!r}", source_span(PACKAGE / file, start, stop)))
        else:
            out.append((a, source_span(_resolve(a))))
    return out


def _overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] <= b[2] and b[1] <= a[2]


def violations(exercise: str) -> list[tuple[str, str, str]]:
    """(lesson, call, answer) for every lesson before the lab that shows a line of an answer."""
    answers = answer_spans(exercise)
    out = []
    for path in lessons_before(exercise):
        calls, _ = shown(path)
        out += [(path.stem, call, name) for call, span in calls for name, a in answers if _overlap(span, a)]
    return out


# --------------------------------------------------------------------------- tests
def test_answers_name_every_exercise_and_resolve():
    assert set(ANSWERS) == set(labs.EXERCISES), set(ANSWERS) ^ set(labs.EXERCISES)
    for name, exercise in labs.EXERCISES.items():
        assert bool(ANSWERS[name]) == (exercise.kind != "prediction"), name   # only a prediction has none
        for label, (file, first, last) in answer_spans(name):
            assert Path(file).is_file() and 0 < first <= last, (name, label)


def test_the_syllabus_places_every_lab_and_lesson():
    lesson_week, lab_week = _weeks()
    assert set(_lab_table()) == set(labs.EXERCISES)
    assert set(_lab_table().values()) == set(lab_week)
    assert set(lesson_week) == set(_lesson_paths()), "every lesson notebook has a week in the syllabus"
    # the order the README gives: a week's lessons before its labs, so lesson 02 precedes lab 02,
    # lesson 08 precedes lab 05 (week 5), lesson 12 lab 11; lesson 09b comes after every lab but 12
    assert NOTEBOOKS / "02_online_softmax.ipynb" in lessons_before("online_step")
    assert NOTEBOOKS / "08_flash_decoding.ipynb" in lessons_before("merge_states")
    assert NOTEBOOKS / "09b_low_precision.ipynb" not in lessons_before("merge_pair")
    assert NOTEBOOKS / "09b_low_precision.ipynb" in lessons_before("fwht")


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_show_source_call_resolves(path):
    calls, unresolved = shown(path)
    assert not unresolved, f"{path.name}: show_source targets that do not resolve: {unresolved}"
    assert all(file and first <= last for _, (file, first, last) in calls), path.name


def test_the_resolver_sees_each_kind_of_target():
    """A module with start="def name", a class (its methods), a method, a .cu file region."""
    import iokernels as ik
    from iokernels import paged, tiled
    online = source_span(tiled._online_step)
    assert _overlap(source_span(ik.tiled, "def _online_step", "return"), online)
    assert _overlap(source_span(tiled._Rescale), source_span(tiled._Rescale.new_max))
    assert not _overlap(source_span(tiled._Rescale), online)
    plan = source_span(ik.PagedKVCache.append, "# ---- plan", "# ---- act")
    assert _overlap(plan, source_span(paged.PagedKVCache.append)) and plan[2] - plan[1] > 5
    region = source_span(PACKAGE / FA_V1, "// online softmax, in registers", "// write O_i, LSE_i")
    assert _overlap(source_span(PACKAGE / FA_V1), region)
    assert not _overlap(source_span(PACKAGE / FA_V1, "for (int j = j_begin", "// S_ij = Q_i K_j^T"), region)


@pytest.mark.parametrize("exercise", sorted(ANSWERS))
def test_no_lesson_before_the_lab_shows_its_answer(exercise):
    found = [v for v in violations(exercise) if (v[0], exercise) not in KEPT]
    assert not found, (f"lab exercise {exercise!r}: lessons read before its lab show its answer "
                       f"(lesson, call, answer): {found}")


@pytest.mark.parametrize("key", sorted(KEPT))
def test_each_kept_showing_is_still_there(key):
    """A kept entry names a call that still shows the answer before the lab (else remove it)."""
    lesson, exercise = key
    assert KEPT[key].strip()
    assert any(v[0] == lesson for v in violations(exercise)), f"{key} no longer shows the answer: remove it"
