"""One seeded input factory and one checker, shared by every backend, test and notebook.

The checker teaches FlashAttention's own rule for low precision: an implementation in
a low precision is judged against the float64 oracle *relative to* the naive algorithm
computed in that same precision,

    max|out - ref64|  <=  factor * max|baseline - ref64|  +  atol,

with factor 2 for forward outputs and LSE, and 3 for gradients.  Float64 runs are held
to an absolute bound near 1e-12 instead.  Rows whose reference LSE is -inf (fully
masked) must be exactly -inf (LSE) and exactly 0 (output): never NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import conventions as cv
from . import reference
from .reference import _f64

#: float64 runs must match the float64 oracle to about this (scaled by max(1, max|ref|)).
FLOAT64_TOL = 1e-12
#: FlashAttention's factor for forward outputs / LSE, and for gradients.
FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
#: a tiny absolute slack for low precision, so a baseline that happens to be exact does
#: not demand exactness (half an fp16 ulp at 1.0 is 4.9e-4; bf16's is 3.9e-3).
LOW_PRECISION_ATOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-6}


def as_numpy(x) -> np.ndarray:
    """Any array (NumPy, CuPy, Numba device, torch incl. bfloat16) as a float64 NumPy array."""
    return _f64(x)


def numpy_dtype(name: str):
    """The NumPy dtype for a storage dtype name; bfloat16 comes from ml_dtypes when installed."""
    if name == "bfloat16":
        try:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        except ImportError as e:  # pragma: no cover
            raise ValueError("dtype: bfloat16 NumPy arrays need the ml_dtypes package") from e
    return np.dtype(name)


def make_inputs(rng: np.random.Generator, batch=1, heads_q=2, heads_kv=None, seqlen_q=64,
                seqlen_k=None, head_dim=32, dtype="float64", with_grad=False):
    """Seeded random q, k, v (and dO when ``with_grad``) in the conventional layout.

    Values are standard normal (never zeros), then rounded to ``dtype``.  ``rng`` is
    passed in: there is no hidden global generator.
    """
    heads_kv = heads_q if heads_kv is None else heads_kv
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, heads_q, seqlen_q, head_dim)).astype(dt)
    k = rng.standard_normal((batch, heads_kv, seqlen_k, head_dim)).astype(dt)
    v = rng.standard_normal((batch, heads_kv, seqlen_k, head_dim)).astype(dt)
    if with_grad:
        do = rng.standard_normal((batch, heads_q, seqlen_q, head_dim)).astype(dt)
        return q, k, v, do
    return q, k, v



#: the smallest normal float16 magnitude: below it float16 rounds a bfloat16 value
FLOAT16_TINY = 2.0 ** -14


def make_grid_inputs(rng: np.random.Generator, batch=1, heads_q=2, heads_kv=None, seqlen_q=64,
                     seqlen_k=None, head_dim=32):
    """Seeded q, k, v, dO in float64 whose every value float16, bfloat16 and float32 hold exactly.

    Standard normal values rounded to bfloat16 (7 mantissa bits, which float16's 10 and
    float32's 23 contain), magnitudes below float16's smallest normal raised to it (sign
    kept: never zero).  One float64 oracle then serves the same problem in all three dtypes.
    """
    bf16 = numpy_dtype("bfloat16")
    out = []
    for x in make_inputs(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, "float64", with_grad=True):
        x = x.astype(bf16).astype(np.float64)
        out.append(np.where(np.abs(x) < FLOAT16_TINY, np.copysign(FLOAT16_TINY, x), x))
    return tuple(out)


def oracle_by_head(do, q, k, v, causal=False, window=None):
    """The float64 oracle's (O, LSE, dQ, dK, dV), one query head at a time.

    The same numbers as :func:`iokernels.core.reference.attention` and
    :func:`~iokernels.core.reference.attention_backward` on the whole problem; holding one
    head's N_q x N_k matrices at a time keeps large N (4096 and up) in memory.  dK, dV are
    summed over each GQA group.
    """
    do, q, k, v = (as_numpy(x) for x in (do, q, k, v))
    B, Hq, Nq, d = q.shape
    Hkv = k.shape[1]
    o, dq = np.empty_like(q), np.empty_like(q)
    lse = np.empty((B, Hq, Nq))
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(Hq):
        hk = cv.kv_head(h, Hq, Hkv)
        one = (do[:, h:h + 1], q[:, h:h + 1], k[:, hk:hk + 1], v[:, hk:hk + 1])
        oh, lh = reference.attention(*one[1:], causal=causal, window=window)
        gq, gk, gv = reference.attention_backward(*one, causal=causal, window=window)
        o[:, h], lse[:, h], dq[:, h] = oh[:, 0], lh[:, 0], gq[:, 0]
        dk[:, hk] += gk[:, 0]
        dv[:, hk] += gv[:, 0]
    return o, lse, dq, dk, dv

def paged_prefill_oracle(q, cache, seq_ids, cu_seqlens_q, causal=True):
    """The float64 oracle of a paged prefill: (O (total_q, Hq, d), LSE (Hq, total_q)).

    Sequence b's chunk is q's rows cu_seqlens_q[b]:cu_seqlens_q[b + 1], the last rows of the
    sequence; it attends (bottom-right causal unless ``causal`` is False) to a contiguous copy
    of everything ``cache`` holds for ``seq_ids[b]`` (``cache.gather``), in float64.  Rows of
    an empty chunk stay 0 with LSE -inf.
    """
    o = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b, sid in enumerate(seq_ids):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        if rows.stop == rows.start:
            continue
        k, v = (np.asarray(x, dtype=np.float64)[None] for x in cache.gather(sid))
        ob, lb = reference.attention(np.asarray(q[rows], dtype=np.float64).transpose(1, 0, 2)[None], k, v,
                                     causal=causal)
        o[rows], lse[:, rows] = ob[0].transpose(1, 0, 2), lb[0]
    return o, lse


def make_varlen_inputs(rng: np.random.Generator, seqlens_q, seqlens_k=None, heads_q=2,
                       heads_kv=None, head_dim=32, dtype="float64"):
    """Packed (total, heads, head_dim) q, k, v and int32 cu_seqlens for the given lengths."""
    seqlens_k = seqlens_q if seqlens_k is None else seqlens_k
    heads_kv = heads_q if heads_kv is None else heads_kv
    dt = numpy_dtype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads_q, head_dim)).astype(dt)
    k = rng.standard_normal((int(cu_k[-1]), heads_kv, head_dim)).astype(dt)
    v = rng.standard_normal((int(cu_k[-1]), heads_kv, head_dim)).astype(dt)
    return q, k, v, cu_q, cu_k


@dataclass
class Check:
    """The outcome of one comparison against the oracle."""

    name: str
    error: float            # max |out - ref64| over finite reference entries
    bound: float            # what the error had to stay under
    baseline_error: float | None
    ok: bool
    detail: str = ""

    def __str__(self) -> str:
        base = "" if self.baseline_error is None else f", baseline {self.baseline_error:.3g}"
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: max err {self.error:.3g} <= {self.bound:.3g}{base}: {verdict}{self.detail}"

    def __bool__(self) -> bool:
        return self.ok


def _max_err(out, ref):
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(out[finite] - ref[finite])))


def check(out, ref64, baseline=None, *, dtype=None, name="out", factor=FORWARD_FACTOR,
          atol=None, masked_rows=None) -> Check:
    """Compare ``out`` with the float64 oracle ``ref64``.

    float64 (``dtype`` given or inferred): max error <= FLOAT64_TOL * max(1, max|ref|).
    Lower precision: max error <= factor * max|baseline - ref64| + atol, where ``baseline``
    is the naive algorithm in the same precision (FlashAttention's rule).

    Entries where ``ref64`` is -inf (LSE of fully masked rows) must be -inf in ``out``;
    ``masked_rows`` (a boolean mask broadcastable to out) marks outputs that must be 0.
    NaN anywhere in ``out`` fails the check.
    """
    dtype = dtype or cv.dtype_name(out)
    o = as_numpy(out)
    r = np.asarray(ref64, dtype=np.float64)
    if o.shape != r.shape:
        return Check(name, np.inf, 0.0, None, False, f" (shape {o.shape} != {r.shape})")
    problems = []
    if np.isnan(o).any():
        problems.append("NaN in output")
    neg_inf = np.isneginf(r)
    if neg_inf.any() and not np.all(np.isneginf(o[neg_inf])):
        problems.append("masked rows' LSE is not -inf")
    if (~neg_inf & ~np.isfinite(o)).any() and not np.isnan(o).any():
        problems.append("non-finite value where the reference is finite")
    if masked_rows is not None:
        zeros = np.broadcast_to(masked_rows, o.shape)
        if zeros.any() and np.any(o[zeros] != 0):
            problems.append("fully masked rows are not exactly 0")
    err = _max_err(np.nan_to_num(o, nan=np.inf), r)
    if dtype == "float64":
        scale = max(1.0, float(np.max(np.abs(r[np.isfinite(r)]))) if np.isfinite(r).any() else 1.0)
        bound, base_err = FLOAT64_TOL * scale, None
    else:
        if baseline is None:
            raise ValueError("baseline: low-precision checks need the naive result in the same precision")
        base_err = _max_err(as_numpy(baseline), r)
        bound = factor * base_err + (LOW_PRECISION_ATOL.get(dtype, 0.0) if atol is None else atol)
    ok = err <= bound and not problems
    return Check(name, err, bound, base_err, ok, ("; " + "; ".join(problems)) if problems else "")



def check_gradients(got, refs64, baselines, *, factor, dtype=None, label="") -> list:
    """:func:`check` of (dQ, dK, dV) at once: three Checks named "<label> dq" and so on."""
    return [check(g, r, b, dtype=dtype, name=f"{label} {n}".strip(), factor=factor)
            for n, g, r, b in zip(("dq", "dk", "dv"), got, refs64, baselines)]


def report(checks) -> str:
    """The failed checks first, then every check: an assertion message that tells the whole story."""
    failed = [str(c) for c in checks if not c]
    return (f"{len(failed)} of {len(checks)} checks failed:\n" + "\n".join(failed)
            + "\nall checks:\n" + "\n".join(map(str, checks)))

def assert_close(out, ref64, baseline=None, **kw) -> Check:
    """:func:`check`, raising AssertionError with the whole story when it fails."""
    c = check(out, ref64, baseline, **kw)
    if not c.ok:
        raise AssertionError(str(c))
    return c
