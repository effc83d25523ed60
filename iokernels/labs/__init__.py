"""Labs: the progression with the learner writing the kernels, graded for exactness and bytes.

In a lab notebook the learner fills in a stub and runs its check cell::

    from iokernels import labs
    labs.check("online_step", online_step)      # PASSED / NOT YET, with what went wrong

:func:`check` grades the learner's function on the exercise's hidden cases (seeded,
awkward shapes) and shows the result, green or red.  The exercises, in the order of the
labs (see notebooks/labs/README.md for the instructor's guide):

====  ======================  ==================================================================
lab   exercise                what is graded
====  ======================  ==================================================================
01    naive_traffic           counted bytes == the learner's prediction == the model; O, LSE
02    online_step             O and LSE after folding every block, fully masked blocks included
03    flash_forward           O, LSE (2x rule) and FlashAttention-2's bytes, tensor by tensor
03    loop_order              which loop order moves fewer bytes at two shapes
04    flash_backward          dQ, dK, dV against float64 gradients, and the backward's bytes
05    merge_states            the exact LSE merge with empty parts
05    split_kv_decode         Flash-Decoding against the decode oracle, GQA, empty splits
06    paged_gather            the gather's output and bytes (no read past a sequence's end)
06    copy_on_write           block-table invariants after forks and appends
07    numba_forward           a Numba CUDA kernel: oracle, global bytes per tile, no races
07    barrier_hunt            the same kernel family with a missing barrier, found and fixed
08    cupy_online             (GPU) the online-softmax update of a CUDA C++ tile loop
09    kv_bytes_per_token      (ch. 13) KV-cache bytes per token from config.json, exact, MLA too
09    absorbed_mla_query      (ch. 13) MLA decode, W_UK absorbed: O, LSE, latent rows read once
10    varlen_bug_hunt         (ch. 11) packed sequences: cu_seqlens and rows without keys, fixed
11    merge_pair              (ch. 12) ring attention's pairwise (O, LSE) merge, empty blocks
11    zigzag_split            (ch. 12) the load-balanced causal split: exact O, bytes and work/rank
12    rescale_threshold_step  (ch. 09a) FA4's conditional rescale: O, LSE and the rescale count
12    fwht                    (ch. 09b) the fast Walsh-Hadamard transform, exact, in O(d log d)
12    randomized_hadamard     (ch. 09b) x D H / sqrt(d): Q K^T unchanged, outliers spread
13    triton_forward          (ch. 15) a Triton kernel's tile loop, on the interpreter or a GPU
====  ======================  ==================================================================

The exercises of labs 09-12 live in
:mod:`iokernels.labs.exercises_scale` (chapters 11-13) and
:mod:`iokernels.labs.exercises_hopper` (chapters 09a, 09b); lab 13's in
:mod:`iokernels.labs.exercises_triton` (chapter 15).

The grading engine is :mod:`iokernels.labs.engine`; notebooks are turned into learner
copies and graded by :mod:`iokernels.labs.notebooks` (``python -m iokernels labs``).
"""
from __future__ import annotations

import os

from .engine import Exercise, Result, collect, grade
from .exercises import EXERCISES as _NUMPY_EXERCISES
from .exercises import LOOP_ORDER_SHAPES, loop_order_traffic
from .exercises_hopper import EXERCISES as _HOPPER_EXERCISES
from .exercises_scale import EXERCISES as _SCALE_EXERCISES
from .exercises_triton import EXERCISES as _TRITON_EXERCISES
from .gpu_exercises import GPU_EXERCISES
from .predict import reveal

__all__ = ["check", "EXERCISES", "STRICT_ENV", "Exercise", "Result", "collect", "grade", "reveal", "spec",
           "LOOP_ORDER_SHAPES", "loop_order_traffic"]


#: set to "1" (e.g. in nbgrader's autograding environment) to make a failed check raise
STRICT_ENV = "IOKERNELS_LABS_STRICT"

#: every exercise by name, in the order of the labs (the GPU ones import numba only when graded)
EXERCISES = {e.name: e for e in _NUMPY_EXERCISES + GPU_EXERCISES + _SCALE_EXERCISES + _HOPPER_EXERCISES
             + _TRITON_EXERCISES}


def spec(name: str) -> str:
    """The exercise's specification (the signature and what it must do)."""
    if name not in EXERCISES:
        raise ValueError(f"name: expected one of {', '.join(EXERCISES)}; got {name!r}")
    e = EXERCISES[name]
    return f"{e.title}\n{e.spec}"


def check(name: str, *solution) -> Result:
    """Grade the learner's ``solution`` for exercise ``name`` and return the result.

    Most exercises take one function; ``naive_traffic`` takes the kernel and the
    prediction function.  The result shows green when every hidden case passes, red with
    the first failing case, its error or its bytes over budget, and a hint otherwise.
    Nothing is raised for a wrong or unfinished solution (the message says what to fix),
    unless the environment sets IOKERNELS_LABS_STRICT=1: then a failed check raises
    AssertionError, which is how nbgrader's autograder sees a check cell fail.
    """
    if name not in EXERCISES:
        raise ValueError(f"name: expected one of {', '.join(EXERCISES)}; got {name!r}")
    ex = EXERCISES[name]
    if not solution or any(s is None for s in solution):
        result = grade(ex, None)
    else:
        result = grade(ex, solution[0] if len(solution) == 1 else tuple(solution))
    if os.environ.get(STRICT_ENV) == "1" and result.status == "failed":
        raise AssertionError(str(result))
    return result
