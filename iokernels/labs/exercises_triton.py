"""The Triton lab (lab 13): the forward tile loop of a ``@triton.jit`` kernel.

==============  ==================================================================
exercise        what the learner writes (names as in the lab notebook)
==============  ==================================================================
triton_forward  the body of ``fwd_lab``'s loop over K/V tiles: load K_j^T, the
                scores, the key-band mask, the online-softmax update, load V_j
==============  ==================================================================

The kernel's signature, its prologue (program ids, pointers, Q_i, the key band, the loop's
range) and its epilogue (O / l, the LSE, fully masked rows) are given: they are those of
the package's forward v1 (:mod:`iokernels.triton_backend.forward_v1`), whose launcher
arguments :func:`launch_lab_kernel` passes.  The grader runs the learner's kernel on
Triton's interpreter on a CPU (``TRITON_INTERPRET=1``, which the notebook's first cell
sets through :func:`iokernels.triton_backend.launch.prepare`) or live on a GPU, on ragged
lengths, causal and not, GQA, float32 and float16, and holds O and the LSE to the float64
oracle with FlashAttention's 2x rule.  A wrong answer that one of :func:`tile_model`'s known
mistakes reproduces is named.  Where triton is missing the exercise is skipped with the
reason.
"""
from __future__ import annotations

import inspect

import numpy as np

from ..core import conventions as cv
from ..core import reference, testing
from ..naive import attention as _naive
from ..triton_backend import launch as _ln
from . import references as R
from .engine import Case, CaseReport, Exercise, LabSkip, Mistake, fail, oracle_problem
from .exercises import MASKED_NAN

__all__ = ["TRITON_FORWARD", "EXERCISES", "TRITON_REFERENCES", "launch_lab_kernel", "tile_model", "lab_tile",
           "lab_imports"]

#: the package's Triton forward: launchers, the dispatcher and the kernels themselves
TRITON_REFERENCES = (
    "iokernels.triton_backend.registry.attention",
    "iokernels.triton_backend.forward.attention_v1", "iokernels.triton_backend.forward.attention_v2",
    "iokernels.triton_backend.forward_v1.fwd_v1", "iokernels.triton_backend.forward_v2.fwd_v2",
)

NO_ACC_RESCALE = Mistake("the accumulator not rescaled",
                         "when the running max grows, the old terms of O were weighted by 2^(s - m_old): multiply "
                         "acc by alpha = 2^(m_old - m_new) before adding P V_j (acc = acc * alpha[:, None] + ...).")
NO_L_RESCALE = Mistake("the running sum not rescaled",
                       "l holds sums taken against the old max: l = l * alpha + sum(P, 1), not l + sum(P, 1).")
MASKED_TO_ZERO = Mistake("masked scores set to 0 instead of -inf",
                         "a masked score must contribute nothing: tl.where(seen, s, float('-inf')), so that "
                         "2^(-inf - m) = 0; a score of 0 still carries weight 2^(0 - m).")
NO_MASK = Mistake("the key band not applied to the scores",
                  "the load's mask only zeroes K past Nk (their scores are 0, not -inf); every score outside "
                  "[lo, hi) of its row (causal, the end of the sequence) must be -inf before the row max is taken.")


def lab_imports():
    """(why, triton, tl, tiles) for the lab notebook, Triton's interpreter switched on first where there
    is no CUDA GPU.  Where triton is missing: the reason, and stand-ins with which the kernel cell still
    defines its function (its check then says SKIPPED with the reason)."""
    _ln.prepare()
    why = _ln.unavailable()
    if why is not None:
        import types
        stand_in = types.SimpleNamespace(constexpr=lambda x=None: x)
        return why, types.SimpleNamespace(jit=lambda fn=None, **_: fn), stand_in, types.SimpleNamespace(LN2=0.0)
    import triton
    import triton.language as tl

    from ..triton_backend import tiles
    return None, triton, tl, tiles


#: (BLOCK_Q, BLOCK_K) the grader launches the learner's kernel with, on the interpreter and on a GPU alike
LAB_TILE = (16, 16)


def lab_tile() -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_K) the lab launches with: :data:`LAB_TILE` wherever it runs.

    The grading cases hold a few dozen keys a row, so 16-key tiles make every case cross
    several key tiles, and a missing rescale (which only matters from a row's second tile on)
    changes the answer.  With the 64-key tiles the package's kernels take on a GPU, one tile
    would hold every key of a case, and a kernel that never rescales would pass."""
    return LAB_TILE


def launch_lab_kernel(kernel, q, k, v, causal: bool):
    """Launch ``kernel`` (forward v1's signature) on NumPy q, k, v: (O, LSE) as NumPy arrays."""
    from ..triton_backend import forward as fw
    from ..triton_backend.config import padded_head_dim
    _, tensors, sizes, band, dtype = fw._problem(q, k, v, bool(causal), None)
    B, Hq, _, Nq, _, d = sizes
    bq, bk = lab_tile()
    kernel[(-(-Nq // bq), B * Hq)](*fw._args(tensors, sizes, band, cv.default_scale(d)), BLOCK_Q=bq,
                                   BLOCK_K=bk, BLOCK_D=padded_head_dim(d), F32=fw.f32_dot(dtype))
    return _ln.to_caller(tensors[3], True), _ln.to_caller(tensors[4], True)


def tile_model(q, k, v, causal: bool, block_q: int, block_k: int, mistake: Mistake | None = None):
    """Forward v1's tile loop in float64 NumPy, optionally with one known mistake: (O, LSE).

    It visits the key tiles the kernel visits (the Q tile's span, rounded out to whole tiles)
    so a mistake that depends on the tiling (a missing rescale) is modelled tile for tile.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = cv.default_scale(d)
    o = np.zeros_like(q)
    lse = np.full((B, Hq, Nq), -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b in range(B):
            for h in range(Hq):
                hk = h // (Hq // Hkv)
                for r0 in range(0, Nq, block_q):
                    rows = np.arange(r0, min(r0 + block_q, Nq))
                    lo, hi = cv.key_range(rows, Nq, Nk, causal)
                    span_lo, span_hi = int(lo.min()), int(hi.max())
                    m = np.full(len(rows), -np.inf)
                    l = np.zeros(len(rows))
                    acc = np.zeros((len(rows), d))
                    for c0 in range((span_lo // block_k) * block_k, span_hi, block_k):
                        cols = np.arange(c0, c0 + block_k)
                        ok = cols < Nk
                        kt = np.where(ok[:, None], k[b, hk, np.minimum(cols, Nk - 1)], 0.0)
                        vt = np.where(ok[:, None], v[b, hk, np.minimum(cols, Nk - 1)], 0.0)
                        s = q[b, h, rows] @ kt.T * scale
                        seen = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
                        if mistake is MASKED_TO_ZERO:
                            s = np.where(seen, s, 0.0)
                        elif mistake is not NO_MASK:          # NO_MASK: keys past Nk score 0 (K loaded as 0)
                            s = np.where(seen, s, -np.inf)
                        m_new = np.maximum(m, s.max(axis=1))
                        m_use = m_new if mistake is MASKED_NAN else np.where(np.isneginf(m_new), 0.0, m_new)
                        alpha = np.exp(m - m_use)
                        p = np.exp(s - m_use[:, None])
                        l = (l if mistake is NO_L_RESCALE else l * alpha) + p.sum(axis=1)
                        acc = (acc if mistake is NO_ACC_RESCALE else acc * alpha[:, None]) + p @ vt
                        m = m_new
                    empty = l == 0.0
                    l_use = np.where(empty, 1.0, l)
                    o[b, h, rows] = acc / l_use[:, None]
                    lse[b, h, rows] = np.where(empty, -np.inf, m + np.log(l_use))
    return o, lse


def _not_written(kernel) -> bool:
    """Whether the learner's kernel still holds the stub (its source raises NotImplementedError)."""
    src = getattr(kernel, "src", None)
    if not isinstance(src, str):
        fn = getattr(kernel, "fn", None)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            src = ""
    return "NotImplementedError" in src


def _grade_triton_forward(kernel, case, rng):
    why = _ln.unavailable()
    if why is not None:
        raise LabSkip(f"the Triton kernels cannot run here: {why}")
    _ln.prepare()
    from ..triton_backend import forward_v1, forward_v2  # noqa: F401  (imported first: then guarded)
    if _not_written(kernel):
        raise NotImplementedError("the body of fwd_lab's tile loop: load K_j^T, the scores, the mask, "
                                  "the online-softmax update of m, l and acc, load V_j")
    p = case.params
    dtype, causal = p["dtype"], p["causal"]
    q, k, v = testing.make_inputs(rng, heads_q=p["hq"], heads_kv=p["hkv"], seqlen_q=p["nq"], seqlen_k=p["nk"],
                                  head_dim=p["d"], dtype=dtype)
    o, lse = launch_lab_kernel(kernel, q, k, v, causal)
    ref, ref_lse = reference.attention(q, k, v, causal=causal)
    base, base_lse = _naive(q, k, v, causal=causal, scale=cv.default_scale(p["d"]), window=None)
    masked = np.isneginf(ref_lse)[..., None]
    bq, bk = lab_tile()
    mutants = [(m, tile_model(q, k, v, causal, bq, bk, m)[0])
               for m in (NO_ACC_RESCALE, NO_L_RESCALE, MASKED_TO_ZERO, NO_MASK, MASKED_NAN)]
    report = CaseReport()
    if np.isnan(np.asarray(o, np.float64)[np.broadcast_to(masked, o.shape)]).any():
        fail("O is NaN on rows that see no key", report, MASKED_NAN)
    oracle_problem(np.asarray(o, np.float64), ref, base, name="O", dtype=dtype, masked_rows=masked, report=report,
                   mistakes=mutants)
    c = testing.check(lse, ref_lse, base_lse, dtype=dtype, atol=1e-4, name="LSE")
    if not c.ok:
        fail(f"LSE: max |LSE - oracle| = {c.error:.3g}, allowed {c.bound:.3g}{c.detail}: the epilogue is given, so "
             "m and l are off (m is the max in base 2 units: LSE = (m + log2 l) ln 2)", report)
    return report


def _case(label: str, **p) -> Case:
    return Case(label, p)


TRITON_FORWARD = Exercise(
    name="triton_forward", title="The FlashAttention forward tile loop in Triton", entry="fwd_lab",
    spec=("fwd_lab: a @triton.jit kernel with forward v1's signature, its prologue and its epilogue given; "
          "write the body of its loop over K/V tiles (start = the first key of the tile): load K_j^T (d x Bc) "
          "with a mask for keys past NK and dims past HEAD_DIM; s = mm(q, kt, F32) * qk_scale (base-2 scores); "
          "set every score outside its row's band [lo, hi) to -inf; update m, l and acc by the online softmax "
          "(alpha = 2^(m - m_new), a row with m_new = -inf kept without NaN); load V_j (Bc x d) and add P V_j.  "
          "Graded on Triton's interpreter (CPU) or a GPU against the float64 oracle, 2x rule, float32 and "
          "float16, causal (bottom-right) and not, ragged lengths, GQA."),
    cases=lambda: [_case("Nq 37, Nk 45, d 32, causal, float32", nq=37, nk=45, d=32, hq=2, hkv=1, causal=True,
                         dtype="float32"),
                   _case("Nq 37, Nk 45, d 32, float32", nq=37, nk=45, d=32, hq=2, hkv=1, causal=False,
                         dtype="float32"),
                   _case("Nq 45, Nk 37, d 24, causal (rows with no key), float16", nq=45, nk=37, d=24, hq=2,
                         hkv=2, causal=True, dtype="float16"),
                   _case("Nq 20, Nk 50, d 16, GQA 4 / 2, float16", nq=20, nk=50, d=16, hq=4, hkv=2, causal=False,
                         dtype="float16"),
                   _case("Nq 33, Nk 33, d 40, causal, GQA 2 / 1, float16", nq=33, nk=33, d=40, hq=2, hkv=1,
                         causal=True, dtype="float16")],
    grade_case=_grade_triton_forward, seed=1301,
    hint="per tile: the mask before the max; alpha rescales both l and acc; m_use = 0 where m_new is -inf.",
    mistakes=(NO_ACC_RESCALE, NO_L_RESCALE, MASKED_TO_ZERO, NO_MASK, MASKED_NAN),
    references=R.FORWARD + TRITON_REFERENCES,
)

EXERCISES = (TRITON_FORWARD,)
