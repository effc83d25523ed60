"""The NumPy exercises of the labs, in the order of the progression (exercises 1-7).

Each exercise is an :class:`~iokernels.labs.engine.Exercise`: the signature the learner
implements, the hidden cases (awkward shapes: lengths not a multiple of the tile, head
dim 59, Nq != Nk, causal, GQA), and a grader that holds the learner's result against the
float64 oracle (FlashAttention's 2x rule, with the package's naive algorithm in the same
precision as the baseline) and, where the exercise is about memory traffic, the counted
bytes of every tensor against the package's closed-form model of the same run.

=================  ==========================================================
exercise           what the learner writes (names as in the lab notebooks)
=================  ==========================================================
naive_traffic      ``predict_naive_bytes`` and ``naive_attention`` (lab 01)
online_step        ``online_step``: one m, l, O update of the online softmax (lab 02)
flash_forward      ``flash_forward``: FlashAttention-2's tile loop on HBM arrays (lab 03)
loop_order         ``prediction``: FA1 or FA2 moves fewer bytes at two shapes (lab 03)
flash_backward     ``flash_backward``: the tiled backward with recomputation (lab 04)
merge_states       ``merge_states``: the exact LSE merge with empty parts (lab 05)
split_kv_decode    ``split_kv_decode``: Flash-Decoding built on that merge (lab 05)
paged_gather       ``paged_gather``: read a sequence through its block table (lab 06)
copy_on_write      ``append_token``: a block table's append with copy-on-write (lab 06; both in
                   :mod:`iokernels.labs.paged_exercises`)
=================  ==========================================================

Notation as in the package: Q, K, V, O, LSE; Br, Bc tile rows; Tr, Tc tile counts; m, l the
running max and sum; S, P the score and probability matrices.
"""
from __future__ import annotations

import numpy as np

from .. import backward as bw
from ..decode import decode_naive
from .. import naive, tiled
from ..core import conventions as cv
from ..core import reference, testing, traffic
from ..core.config import TileConfig
from ..core.traffic import HBM
from . import references as refs
from .engine import CaseReport, Case, Exercise, Mistake, budget_report, fail, oracle_problem
from .engine import case as _case
from .paged_exercises import COPY_ON_WRITE, PAGED_GATHER


def _masked_rows(Nq, Nk, causal):
    """(Nq, 1) booleans: the query rows that see no key (their O must be exactly 0)."""
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal)
    return (hi <= lo)[:, None]


# =========================================================================== 1 naive traffic
S_READ_TWICE = Mistake("S read twice by the softmax",
                       "the softmax holds a row of S on chip for both passes (max, then exp and sum): "
                       "read S once.")
P_NOT_STORED = Mistake("P not written to HBM",
                       "naive attention is three kernels: the softmax writes P to HBM and the PV "
                       "kernel reads it back.")
PREDICTION_MISSING = Mistake("a tensor missing from the prediction",
                             "predict every tensor the three kernels touch: Q, K, V, S, P, O and LSE.")


def _naive_detectors(row, counted, budget):
    if row.tensor == "S" and row.read >= 2 * max(1, row.allowed_read):
        return S_READ_TWICE
    if row.tensor == "P" and row.written < row.allowed_written:
        return P_NOT_STORED
    return None


def _grade_naive(solution, case, rng):
    kernel, predict = solution
    p = case.params
    Nq, Nk, d, dtype = p["Nq"], p["Nk"], p["d"], p["dtype"]
    model = naive.traffic_model(batch=1, heads_q=1, heads_kv=1, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                                dtype=dtype)
    acc = cv.accum_dtype(dtype)
    predicted = predict(Nq, Nk, d, cv.itemsize_of(dtype), acc.itemsize)
    if not isinstance(predicted, dict):
        fail(f"predict_naive_bytes returned {type(predicted).__name__}; expected a dict "
             "{tensor: (bytes_read, bytes_written)}")
    for name, (r, w) in model.as_dict().items():
        if name not in predicted:
            fail(f"the prediction has no entry for {name}", mistake=PREDICTION_MISSING)
        pr, pw = (int(x) for x in predicted[name])
        if (pr, pw) != (r, w):
            fail(f"the prediction for {name} is (read {pr:,} B, written {pw:,} B); the kernels as written move "
                 f"{'more' if pr + pw < r + w else 'fewer'} bytes of it (off by {abs(pr + pw - r - w):,} B). "
                 f"Count elements per kernel, then multiply by the itemsize ({cv.itemsize_of(dtype)} B; "
                 f"LSE is stored in the accumulator dtype, {acc.itemsize} B)")
    extra = sorted(set(predicted) - set(model.as_dict()))
    if extra and any(sum(predicted[n]) for n in extra):
        fail(f"the prediction names tensors the kernels do not have: {', '.join(extra)}")

    q, k, v = testing.make_inputs(rng, 1, 1, 1, Nq, Nk, d, dtype)
    scale = cv.default_scale(d)
    Q, K, V = HBM(q[0, 0], "Q"), HBM(k[0, 0], "K"), HBM(v[0, 0], "V")
    S = HBM.empty((Nq, Nk), q.dtype, "S")
    P = HBM.empty((Nq, Nk), q.dtype, "P")
    O = HBM.empty((Nq, d), q.dtype, "O")
    LSE = HBM.empty((Nq,), acc, "LSE")
    with traffic.count() as counted:
        kernel(Q, K, V, S, P, O, LSE, scale)
    report = budget_report(counted, model, (_naive_detectors,), exact=True)
    ref_o, ref_lse = reference.attention(q, k, v)
    base_o, base_lse = naive.attention(q, k, v, causal=False, scale=scale, window=None)
    oracle_problem(O.result(), ref_o[0, 0], base_o[0, 0], name="O", dtype=dtype, report=report)
    oracle_problem(LSE.result(), ref_lse[0, 0], base_lse[0, 0], name="LSE", dtype=dtype, report=report)
    report.notes.append("counted bytes == your prediction == the model, tensor by tensor")
    return report


NAIVE_TRAFFIC = Exercise(
    name="naive_traffic", title="Naive attention, byte by byte", entry="naive_attention, predict_naive_bytes",
    spec=("predict_naive_bytes(Nq, Nk, d, itemsize, lse_itemsize) -> {tensor: (read, written)} in bytes for "
          "Q, K, V, S, P, O, LSE; naive_attention(Q, K, V, S, P, O, LSE, scale) computes one head as three "
          "kernels on HBM arrays (S = scale Q K^T; P = softmax(S), LSE; O = P V)."),
    cases=lambda: [_case(Nq=37, Nk=45, d=59, dtype="float64"), _case(Nq=20, Nk=13, d=16, dtype="float32"),
                   _case(Nq=33, Nk=17, d=59, dtype="float16")],
    grade_case=_grade_naive, seed=101,
    hint="each kernel reads its inputs from HBM and writes its result back; nothing stays on chip between them.",
    mistakes=(S_READ_TWICE, P_NOT_STORED, PREDICTION_MISSING), references=refs.FORWARD + refs.NAIVE_MODEL)


# =========================================================================== 2 online softmax step
RESCALE_TWICE = Mistake("rescale applied twice",
                        "multiply the old l and O by alpha = exp(m_old - m_new) exactly once per block.")
NO_RESCALE_O = Mistake("O not rescaled", "when the max grows, the old O accumulator must be multiplied by alpha too.")
NO_RESCALE_L = Mistake("l not rescaled", "l_new = alpha * l + rowsum(P): the old sum was taken against the old max.")
OLD_MAX = Mistake("exponentials taken against the old max",
                  "P = exp(S - m_new): use the max that includes this block.")
NO_RUNNING_MAX = Mistake("the running max forgotten",
                         "m_new = max(m, rowmax(S_block)): the block's own max is not enough.")
MASKED_NAN = Mistake("a fully masked block gives NaN",
                     "when m_new is -inf (no visible score yet), exp(-inf - (-inf)) is NaN: subtract 0 "
                     "instead of m_new for those rows, so every exponential of -inf is 0.")


def _fold(step, s, v, bc):
    """Run a step function over the column blocks of s; finalize to (O, LSE)."""
    rows, d = s.shape[0], v.shape[1]
    m, l, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d))
    with np.errstate(all="ignore"):
        for c0 in range(0, s.shape[1], bc):
            m, l, o = step(m.copy(), l.copy(), o.copy(), s[:, c0:c0 + bc].copy(), v[c0:c0 + bc].copy())
            m, l, o = np.asarray(m, float), np.asarray(l, float), np.asarray(o, float)
        empty = l == 0
        out = np.where(empty[:, None], 0.0, o / np.where(empty, 1.0, l)[:, None])
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return out, lse


def _mutant(rescale_o=1, rescale_l=1, old_max=False, running=True, guard=True):
    """The online step with one known mistake (a model of the error, not the kernel)."""
    def step(m, l, o, s, v):
        m_new = np.maximum(m, s.max(axis=1)) if running else s.max(axis=1)
        ref = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
        alpha = np.exp(m - ref)
        p = np.exp(s - ((np.where(np.isneginf(m), 0.0, m) if guard else m) if old_max else ref)[:, None])
        return (m_new, alpha ** rescale_l * l + p.sum(axis=1) if rescale_l else l + p.sum(axis=1),
                alpha[:, None] ** rescale_o * o + p @ v if rescale_o else o + p @ v)
    return step


_STEP_MUTANTS = ((RESCALE_TWICE, dict(rescale_o=2)), (RESCALE_TWICE, dict(rescale_l=2)),
                 (RESCALE_TWICE, dict(rescale_o=2, rescale_l=2)), (NO_RESCALE_O, dict(rescale_o=0)),
                 (NO_RESCALE_L, dict(rescale_l=0)), (OLD_MAX, dict(old_max=True)),
                 (NO_RUNNING_MAX, dict(running=False)), (MASKED_NAN, dict(guard=False)))


def _scores(rng, rows, n, bc):
    """A score block with rising maxima and masks: a fully masked row, a fully masked first
    block, a masked middle block, a row with one visible key."""
    s = rng.standard_normal((rows, n)) * 3 + np.linspace(0, 12, n)[None, :]   # maxima grow to the right
    s[0, :] = -np.inf                          # a row that sees nothing
    s[1, :bc] = -np.inf                        # its first block fully masked
    s[2, bc:2 * bc] = -np.inf                  # a masked block in the middle
    s[3, :-1] = -np.inf                        # only the last key visible
    s[4, ::3] = -np.inf                        # scattered masked entries
    return s


def _grade_online_step(step, case, rng):
    p = case.params
    s = _scores(rng, p["rows"], p["N"], p["Bc"])
    v = rng.standard_normal((p["N"], p["d"]))
    e = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(s).any(1), np.max(s, 1), 0)[:, None]), 0.0)
    tot = e.sum(axis=1)
    with np.errstate(all="ignore"):
        ref_o = np.where(tot[:, None] > 0, (e @ v) / np.where(tot > 0, tot, 1)[:, None], 0.0)
        ref_lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1)) + np.max(s, 1), -np.inf)
    out, lse = _fold(step, s, v, p["Bc"])
    mutants = [(m, _fold(_mutant(**kw), s, v, p["Bc"])) for m, kw in _STEP_MUTANTS]
    report = CaseReport()
    oracle_problem(out, ref_o, None, name="O", dtype="float64", report=report,
                   masked_rows=(tot == 0)[:, None], mistakes=[(m, w[0]) for m, w in mutants])
    oracle_problem(lse, ref_lse, None, name="LSE", dtype="float64", report=report,
                   mistakes=[(m, w[1]) for m, w in mutants])
    return report


ONLINE_STEP = Exercise(
    name="online_step", title="The online-softmax step", entry="online_step",
    spec=("online_step(m, l, o, s, v) -> (m_new, l_new, o_new): fold one block of scores s (rows, Bc; -inf = "
          "masked) and its values v (Bc, d) into the running max m (rows,), sum l (rows,) and unnormalized "
          "output o (rows, d).  The grader starts from m = -inf, l = 0, o = 0, folds every block, then takes "
          "O = o / l and LSE = m + log l (0 and -inf where l = 0)."),
    cases=lambda: [_case(rows=6, N=29, Bc=8, d=5), _case(rows=7, N=16, Bc=16, d=3),
                   _case(rows=5, N=23, Bc=4, d=59)],
    grade_case=_grade_online_step, seed=202,
    hint="alpha = exp(m_old - m_new) rescales the old l and O once; fully masked rows must never give NaN.",
    mistakes=tuple(m for m, _ in _STEP_MUTANTS), references=refs.ONLINE_STEP + refs.FORWARD)


# =========================================================================== 3 FA2 forward under a budget
Q_REREAD = Mistake("Q re-read inside the K/V tile loop",
                   "load Q_i -> SRAM once per query tile, before the loop over K/V tiles.")
O_INNER_WRITE = Mistake("O written inside the K/V tile loop",
                        "keep the O accumulator (and m, l) on chip; write O_i and LSE_i once, after the last tile.")
MASKED_TILES_LOADED = Mistake("fully masked tiles loaded",
                              "skip the K/V tiles that no query row of the tile can see "
                              "(iokernels.conventions.tile_state(...) == 'skip').")
Q_FOR_MASKED_TILE = Mistake("Q loaded for a query tile that sees no key",
                            "find the tile's visible K/V tiles first; when there are none, write O_i = 0 and "
                            "LSE_i = -inf and go on without loading Q_i (the budget has no Q bytes for it).")
KV_REREAD = Mistake("K_j, V_j read more than once per query tile", "load each K/V tile once per query tile.")
SP_IN_HBM = Mistake("S or P stored in HBM", "S_ij and P_ij live on chip only; FlashAttention never writes them.")
GQA_KV = Mistake("K/V of the wrong head (GQA)",
                 "query head h reads KV head h // (Hq // Hkv) (iokernels.conventions.kv_head).")
MASKED_ROW_NAN = Mistake("a fully masked row gives NaN",
                         "a row of the tile that sees no key of this K/V tile (nor of any before) has m_new = -inf, "
                         "and exp(-inf - (-inf)) is NaN: subtract 0 instead of m_new for those rows, so their l "
                         "stays 0 and they end with O = 0, LSE = -inf.")


def _q_bytes_all_tiles(p):
    """The Q bytes of reading every query tile once, the ones that see no key included."""
    return p["B"] * p["Hq"] * p["Nq"] * p["d"] * testing.numpy_dtype(p["dtype"]).itemsize


def _forward_detectors(p):
    causal = p["causal"]

    def detect(row, counted, budget):
        ratio = row.read / max(1, row.allowed_read)
        if row.tensor == "Q" and causal and row.read == _q_bytes_all_tiles(p) > row.allowed_read:
            return Q_FOR_MASKED_TILE
        if row.tensor == "Q" and ratio > 1.5:
            return Q_REREAD
        if row.tensor == "Q" and row.read > row.allowed_read and causal:
            return MASKED_TILES_LOADED
        if row.tensor in ("O", "LSE") and row.written > row.allowed_written:
            return O_INNER_WRITE
        if row.tensor in ("K", "V") and row.read > row.allowed_read:
            return MASKED_TILES_LOADED if causal else KV_REREAD
        if row.allowed == 0:
            return SP_IN_HBM
        return None
    return detect


def _forward_mutant(q, k, v, p, scale, acc, rescale_l=1, rescale_o=1, guard=True, kv_map=None):
    """FlashAttention-2's tile loop with one known mistake (a model of the error, not the kernel):
    l or O rescaled 0 or 2 times, no guard for rows that see nothing yet, a wrong KV head map."""
    B, Hq, Nq, d = q.shape
    Nk, Br, Bc = k.shape[2], p["Br"], p["Bc"]
    kv_map = np.arange(Hq) // (Hq // k.shape[1]) if kv_map is None else kv_map
    o_out, lse_out = np.zeros(q.shape, acc), np.full(q.shape[:3], -np.inf, acc)
    with np.errstate(all="ignore"):
        for b in range(B):
            for h in range(Hq):
                for r0 in range(0, Nq, Br):
                    r1 = min(r0 + Br, Nq)
                    qi = q[b, h, r0:r1].astype(acc)
                    m, l, o = np.full(r1 - r0, -np.inf, acc), np.zeros(r1 - r0, acc), np.zeros((r1 - r0, d), acc)
                    for c0 in range(0, Nk, Bc):
                        c1 = min(c0 + Bc, Nk)
                        if cv.tile_state(r0, r1, c0, c1, Nq, Nk, p["causal"]) == "skip":
                            continue
                        kj, vj = k[b, kv_map[h], c0:c1].astype(acc), v[b, kv_map[h], c0:c1].astype(acc)
                        s = np.where(cv.mask(Nq, Nk, p["causal"], rows=(r0, r1), cols=(c0, c1)),
                                     (qi @ kj.T) * acc.type(scale), -np.inf)
                        m_new = np.maximum(m, s.max(axis=1))
                        m_ref = np.where(np.isneginf(m_new), 0.0, m_new).astype(acc) if guard else m_new
                        alpha = np.exp(m - m_ref)
                        pij = np.exp(s - m_ref[:, None])
                        l = alpha ** rescale_l * l + pij.sum(axis=1)
                        o = alpha[:, None] ** rescale_o * o + pij @ vj
                        m = m_new
                    empty = l == 0
                    o_out[b, h, r0:r1] = np.where(empty[:, None], 0.0, o / np.where(empty, 1, l)[:, None])
                    lse_out[b, h, r0:r1] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))
    return o_out, lse_out


def _wrong_head_maps(Hq, Hkv):
    """KV head maps a learner might write instead of h // (Hq // Hkv), those in range and different."""
    right = np.arange(Hq) // (Hq // Hkv)
    maps = [np.arange(Hq) % Hkv, np.arange(Hq) // Hkv, np.minimum(np.arange(Hq), Hkv - 1)]
    out = []
    for m in maps:
        if m.max() < Hkv and not np.array_equal(m, right) and not any(np.array_equal(m, x) for x in out):
            out.append(m)
    return out


def _forward_mutants(q, k, v, p, scale, acc):
    """(Mistake, (O, LSE)) for each known mistake, computed when first needed."""
    knobs = [(NO_RESCALE_L, dict(rescale_l=0)), (RESCALE_TWICE, dict(rescale_l=2)),
             (RESCALE_TWICE, dict(rescale_o=2)), (RESCALE_TWICE, dict(rescale_l=2, rescale_o=2)),
             (NO_RESCALE_O, dict(rescale_o=0)), (MASKED_ROW_NAN, dict(guard=False))]
    knobs += [(GQA_KV, dict(kv_map=m)) for m in _wrong_head_maps(p["Hq"], p["Hkv"])]
    cache: list = []

    def lazy(which):
        if not cache:
            cache.extend((m, _forward_mutant(q, k, v, p, scale, acc, **kw)) for m, kw in knobs)
        return ((m, out[which]) for m, out in cache)
    return lazy


def _inputs(rng, p, with_grad=False):
    return testing.make_inputs(rng, p["B"], p["Hq"], p["Hkv"], p["Nq"], p["Nk"], p["d"], p["dtype"], with_grad)


def _grade_forward(kernel, case, rng):
    p = case.params
    q, k, v = _inputs(rng, p)
    scale, causal, dtype = cv.default_scale(p["d"]), p["causal"], p["dtype"]
    cfg = TileConfig(block_q=p["Br"], block_k=p["Bc"])
    acc = cv.accum_dtype(dtype)
    Q, K, V = HBM(q, "Q"), HBM(k, "K"), HBM(v, "V")
    O = HBM.full(q.shape, np.nan, q.dtype, "O")
    LSE = HBM.full(q.shape[:3], np.nan, acc, "LSE")
    with traffic.count() as counted:
        try:
            kernel(Q, K, V, O, LSE, Br=p["Br"], Bc=p["Bc"], causal=causal, scale=scale)
        except IndexError as exc:           # K[b, h] with h >= Hkv: the query head used as the KV head
            if p["Hq"] == p["Hkv"] or "axis 1" not in str(exc):
                raise
            fail(f"{type(exc).__name__}: {exc} (Hq={p['Hq']} query heads share Hkv={p['Hkv']} KV heads)",
                 mistake=GQA_KV)
    budget = tiled.traffic_model_fa2(batch=p["B"], heads_q=p["Hq"], heads_kv=p["Hkv"], seqlen_q=p["Nq"],
                                     seqlen_k=p["Nk"], head_dim=p["d"], dtype=dtype, causal=causal, config=cfg)
    ref_o, ref_lse = reference.attention(q, k, v, causal)
    base_o, base_lse = naive.attention(q, k, v, causal=causal, scale=scale, window=None)
    report = CaseReport()
    mutants = _forward_mutants(q, k, v, p, scale, acc)
    oracle_problem(O.result(), ref_o, base_o, name="O", dtype=dtype, report=report,
                   masked_rows=_masked_rows(p["Nq"], p["Nk"], causal), mistakes=mutants(0))
    oracle_problem(LSE.result(), ref_lse, base_lse, name="LSE", dtype=dtype, report=report, mistakes=mutants(1))
    budget_report(counted, budget, (_forward_detectors(p),), report=report)
    return report


FLASH_FORWARD = Exercise(
    name="flash_forward", title="FlashAttention-2's forward tile loop under an IO budget", entry="flash_forward",
    spec=("flash_forward(Q, K, V, O, LSE, *, Br, Bc, causal, scale) on HBM arrays: Q (B, Hq, Nq, d), "
          "K, V (B, Hkv, Nk, d), O like Q, LSE (B, Hq, Nq) in the accumulator dtype.  Q tiles outer, K/V "
          "tiles inner, bottom-right causal; the budget is FlashAttention-2's traffic at these tiles."),
    cases=lambda: [_case(B=1, Hq=2, Hkv=2, Nq=37, Nk=45, d=59, Br=16, Bc=16, dtype="float64", causal=False),
                   # rows 0-15 see no key; the query tile of rows 15-19 mixes a masked row with visible ones
                   _case(B=1, Hq=2, Hkv=1, Nq=45, Nk=29, d=16, Br=5, Bc=16, dtype="float32", causal=True),
                   _case(B=2, Hq=4, Hkv=2, Nq=20, Nk=33, d=8, Br=8, Bc=8, dtype="float16", causal=True),
                   _case(B=1, Hq=1, Hkv=1, Nq=21, Nk=7, d=5, Br=4, Bc=4, dtype="float64", causal=True)],
    grade_case=_grade_forward, seed=303,
    hint=("accumulate in LSE.dtype (float32 for float16 inputs); causal is bottom-right aligned: query i sees "
          "keys j <= i + Nk - Nq."),
    mistakes=(Q_REREAD, O_INNER_WRITE, MASKED_TILES_LOADED, Q_FOR_MASKED_TILE, KV_REREAD, SP_IN_HBM, GQA_KV,
              MASKED_ROW_NAN, NO_RESCALE_L, RESCALE_TWICE, NO_RESCALE_O), references=refs.FORWARD)


# =========================================================================== 4 FA1 vs FA2
#: the two shapes of the loop-order question (fp16, one head, no mask), SRAM in bytes
LOOP_ORDER_SHAPES = {"A": dict(N=4096, d=64, sram_bytes=228 * 1024), "B": dict(N=4096, d=128, sram_bytes=64 * 1024)}


def loop_order_traffic(N, d, sram_bytes, dtype="float16"):
    """{"fa1": bytes, "fa2": bytes} at the paper's tiles for this SRAM (TileConfig.from_sram)."""
    out = {}
    for order in ("fa1", "fa2"):
        cfg = TileConfig.from_sram(sram_bytes, d, dtype, loop_order=order)
        out[order] = traffic.model(order, batch=1, heads_q=1, heads_kv=1, seqlen_q=N, seqlen_k=N, head_dim=d,
                                   dtype=dtype, config=cfg).total
    return out


def _grade_loop_order(prediction, case, rng):
    name = case.params["shape"]
    shape = LOOP_ORDER_SHAPES[name]
    if not isinstance(prediction, dict) or prediction.get(name) is None:
        fail(f"no prediction for shape {name} yet: set prediction = {{'A': 'fa1' or 'fa2', 'B': ...}}")
    guess = str(prediction[name]).lower()
    if guess not in ("fa1", "fa2"):
        fail(f"shape {name}: the prediction must be 'fa1' or 'fa2', got {prediction[name]!r}")
    moved = loop_order_traffic(**shape)
    best = min(moved, key=moved.get)
    cfg = TileConfig.from_sram(shape["sram_bytes"], shape["d"], "float16")
    if guess != best:                   # say how to work it out, not the answer (nor the bytes that give it)
        fail(f"shape {name}: you predicted {guess}, and that is not what the model counts.  Work it out: M = "
             f"SRAM bytes / 2 (the fp16 elements the SRAM holds), Bc = ceil(M / 4d), Br = min(Bc, d), with Bc "
             f"halved while the tiles do not fit (TileConfig.from_sram gives both).  FA2 re-reads K and V once "
             f"per query tile (N / Br times), FA1 re-reads Q and O (and m, l) once per K/V tile (N / Bc times): "
             f"compare the bytes of the two, then predict again")
    report = CaseReport()
    report.notes.append(f"shape {name}: FA1 {moved['fa1']:,} B, FA2 {moved['fa2']:,} B "
                        f"(Br={cfg.block_q}, Bc={cfg.block_k})")
    return report


LOOP_ORDER = Exercise(
    name="loop_order", title="FlashAttention-1 or -2: which moves fewer bytes?", entry="prediction",
    spec=("prediction = {'A': 'fa1' | 'fa2', 'B': 'fa1' | 'fa2'} for the shapes in LOOP_ORDER_SHAPES (fp16, SRAM in "
          "bytes; the paper's M is in elements: M = sram_bytes / 2)."),
    cases=lambda: [Case(f"shape {n}: N={s['N']} d={s['d']} SRAM={s['sram_bytes'] // 1024} KiB fp16",
                        dict(shape=n)) for n, s in LOOP_ORDER_SHAPES.items()],
    grade_case=_grade_loop_order, seed=404,
    hint=("the tiles come from the SRAM size: Bc = ceil(M / 4d), Br = min(Bc, d), where M = SRAM bytes / itemsize "
          "(2 B for fp16: M counts elements, not bytes)."),
    kind="prediction")        # a value, not code: nothing of the learner's runs, so no references


# =========================================================================== 5 backward
P_IN_HBM = Mistake("P (or dS, dP) stored in HBM",
                   "recompute P_ij = exp(S_ij - LSE_i) on chip from Q_i, K_j and LSE_i; never store it.")
KV_REREAD_BWD = Mistake("K_j, V_j re-read inside the Q loop",
                        "K/V tiles are the outer loop of the backward: load K_j, V_j once per (b, kv head, j).")
DKV_INNER_WRITE = Mistake("dK_j / dV_j written per Q tile",
                          "accumulate dK_j and dV_j on chip over the inner loop (and over the GQA group), "
                          "write them once.")
NO_D = Mistake("D forgotten (dS = P * dP)",
               "dS_ij = P_ij * (dP_ij - D_i) with D_i = rowsum(dO_i * O_i), computed before the main loop.")
NO_SCALE = Mistake("softmax scale missing from dQ and dK", "dQ = scale * dS K and dK = scale * dS^T Q.")
DQACC_NOT_ZEROED = Mistake("dQaccum not zeroed",
                           "dQaccum arrives holding whatever was in HBM (here NaN): set dQaccum_i = 0 before the "
                           "main loop (in the pass that computes D) and only then accumulate into it.")


def _backward_detectors(row, counted, budget):
    if row.allowed == 0:
        return P_IN_HBM
    if row.tensor in ("K", "V") and row.read > row.allowed_read:
        return KV_REREAD_BWD
    if row.tensor in ("dK", "dV") and row.over:
        return DKV_INNER_WRITE
    return None


def _wrong_gradients(do, q, k, v, causal, scale):
    """Gradients under the two classic mistakes (models of the error): no D; no scale."""
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal, scale)
    o, lse = reference.attention(q, k, v, causal, scale)
    g = q.shape[1] // k.shape[1]
    ke, ve = (np.repeat(x.astype(np.float64), g, axis=1) for x in (k, v))
    s = np.where(cv.mask(q.shape[2], k.shape[2], causal), np.einsum("bhid,bhjd->bhij", q, ke) * scale, -np.inf)
    with np.errstate(invalid="ignore"):
        pm = np.where(np.isfinite(lse)[..., None], np.exp(s - np.where(np.isfinite(lse), lse, 0)[..., None]), 0.0)
    ds = pm * np.einsum("bhid,bhjd->bhij", do, ve)                         # D left out
    dq0 = np.einsum("bhij,bhjd->bhid", ds, ke) * scale
    dk0 = (np.einsum("bhij,bhid->bhjd", ds, q) * scale).reshape(k.shape[0], k.shape[1], g, *k.shape[2:]).sum(2)
    return {"dQ": [(NO_D, dq0), (NO_SCALE, dq / scale)], "dK": [(NO_D, dk0), (NO_SCALE, dk / scale)],
            "dV": []}


def _grade_backward(kernel, case, rng):
    p = case.params
    q, k, v, do = _inputs(rng, p, with_grad=True)
    scale, causal, dtype = cv.default_scale(p["d"]), p["causal"], p["dtype"]
    acc = cv.accum_dtype(dtype)
    o, lse = tiled.forward_fa2(q, k, v, causal=causal, scale=scale, window=None)
    cfg = TileConfig(block_q=p["Br"], block_k=p["Bc"])
    B, Hq, Nq, d = q.shape
    arrays = dict(Q=HBM(q, "Q"), K=HBM(k, "K"), V=HBM(v, "V"), O=HBM(o, "O"), dO=HBM(do, "dO"),
                  LSE=HBM(lse.astype(acc), "LSE"), D=HBM.empty((B, Hq, Nq), acc, "D"),
                  dQaccum=HBM.full(q.shape, np.nan, acc, "dQaccum"),
                  dQ=HBM.full(q.shape, np.nan, q.dtype, "dQ"), dK=HBM.full(k.shape, np.nan, k.dtype, "dK"),
                  dV=HBM.full(v.shape, np.nan, v.dtype, "dV"))
    with traffic.count() as counted:
        kernel(*arrays.values(), Br=p["Br"], Bc=p["Bc"], causal=causal, scale=scale)
    budget = bw.traffic_model_tiled(batch=B, heads_q=Hq, heads_kv=p["Hkv"], seqlen_q=Nq, seqlen_k=p["Nk"],
                                    head_dim=d, dtype=dtype, causal=causal, config=cfg)
    refs = reference.attention_backward(do, q, k, v, causal, scale)
    base = bw.attention_backward_naive(do, q, k, v, o, lse, causal=causal, scale=scale, window=None)
    wrong = _wrong_gradients(*(testing.as_numpy(x) for x in (do, q, k, v)), causal, scale)
    report = CaseReport()
    out = {name: testing.as_numpy(arrays[name].result()) for name in ("dQ", "dK", "dV", "dQaccum")}
    if np.isnan(out["dQ"]).any() and np.isnan(out["dQaccum"]).any() and not (
            np.isnan(out["dK"]).any() or np.isnan(out["dV"]).any()):
        fail("dQ has NaN where dK and dV have none, and dQaccum still holds NaN after the kernel: dQ was "
             "accumulated into the scratch buffer as it arrived", report, DQACC_NOT_ZEROED)
    for name, ref, b in zip(("dQ", "dK", "dV"), refs, base):
        oracle_problem(out[name], ref, b, name=name, dtype=dtype, factor=testing.GRADIENT_FACTOR,
                       report=report, mistakes=wrong[name])
    budget_report(counted, budget, (_backward_detectors,), report=report)
    return report


FLASH_BACKWARD = Exercise(
    name="flash_backward", title="The backward tile loop with recomputation", entry="flash_backward",
    spec=("flash_backward(Q, K, V, O, dO, LSE, D, dQaccum, dQ, dK, dV, *, Br, Bc, causal, scale) on HBM "
          "arrays: D (B, Hq, Nq) and dQaccum (like Q) in the accumulator dtype are scratch (dQaccum arrives "
          "NaN-filled: zero it before accumulating); dQ, dK, dV are the outputs.  D first (and dQaccum = 0), "
          "then K/V tiles outer with the GQA group and the Q tiles inside, then dQ = scale * dQaccum.  The "
          "budget is the package's FlashAttention-2 backward traffic at these tiles."),
    cases=lambda: [_case(B=1, Hq=2, Hkv=2, Nq=19, Nk=27, d=59, Br=8, Bc=16, dtype="float64", causal=False),
                   _case(B=1, Hq=4, Hkv=2, Nq=24, Nk=17, d=16, Br=8, Bc=8, dtype="float32", causal=True)],
    grade_case=_grade_backward, seed=505,
    hint="P_ij = exp(S_ij - LSE_i) needs no row max; dS_ij = P_ij * (dP_ij - D_i); dQaccum_i += dS_ij K_j.",
    mistakes=(P_IN_HBM, KV_REREAD_BWD, DKV_INNER_WRITE, NO_D, NO_SCALE, DQACC_NOT_ZEROED), references=refs.BACKWARD)


# =========================================================================== 6 merge and split-KV decode
EMPTY_PART_NAN = Mistake("an empty part leaks NaN",
                         "a part with LSE = -inf weighs exactly 0: do not multiply its O (it may hold anything), "
                         "and give O = 0, LSE = -inf when every part is empty.")
NO_MAX_SHIFT = Mistake("exp(LSE_s) without subtracting the max",
                       "exp(LSE_s) overflows for large scores: use exp(LSE_s - max_s LSE_s).")
NOT_NORMALIZED = Mistake("weights not normalized",
                         "O = sum_s exp(LSE_s - LSE) O_s, with LSE = log sum_s exp(LSE_s): the weights sum to 1.")


def _parts(rng, p):
    """Per-row partial (O_s, LSE_s) from the oracle on key chunks, with empty parts (O = NaN)."""
    R, N, S, d = p["rows"], p["N"], p["parts"], p["d"]
    q = rng.standard_normal((1, 1, R, d)) * p.get("boost", 1.0)
    k, v = rng.standard_normal((1, 1, N, d)), rng.standard_normal((1, 1, N, d))
    visible = rng.random((R, N)) < 0.6
    visible[0] = False                                     # a row every part is empty for
    bounds = np.linspace(0, N, S + 1).astype(int)
    o_parts, lse_parts = np.full((S, R, d), np.nan), np.full((S, R), -np.inf)
    for s in range(S):
        a, b = bounds[s], bounds[s + 1]
        if s == 1:
            continue                                       # an empty part: no keys at all
        o, lse = reference.attention(q, k[:, :, a:b], v[:, :, a:b])
        for r in range(R):                                 # row r sees only its visible keys
            cols = np.flatnonzero(visible[r, a:b]) + a
            if cols.size:
                o_r, lse_r = reference.attention(q[:, :, r:r + 1], k[:, :, cols], v[:, :, cols])
                o_parts[s, r], lse_parts[s, r] = o_r[0, 0, 0], lse_r[0, 0, 0]
    keep = np.zeros((R, N), bool)
    for s in range(S):
        if s != 1:
            keep[:, bounds[s]:bounds[s + 1]] = visible[:, bounds[s]:bounds[s + 1]]
    ref_o, ref_lse = np.zeros((R, d)), np.full(R, -np.inf)
    for r in range(R):
        cols = np.flatnonzero(keep[r])
        if cols.size:
            o_r, lse_r = reference.attention(q[:, :, r:r + 1], k[:, :, cols], v[:, :, cols])
            ref_o[r], ref_lse[r] = o_r[0, 0, 0], lse_r[0, 0, 0]
    return o_parts, lse_parts, ref_o, ref_lse


def _wrong_merges(o_parts, lse_parts):
    """The merge under two known mistakes (models of the error)."""
    with np.errstate(all="ignore"):
        w = np.exp(lse_parts)
        naive_o = (w[..., None] * o_parts).sum(0) / w.sum(0)[:, None]
        naive_lse = np.log(w.sum(0))
        m = lse_parts.max(0)
        ws = np.exp(lse_parts - m)
        unnorm = (np.where(np.isneginf(lse_parts), 0, ws)[..., None] * np.nan_to_num(o_parts)).sum(0)
    return [(NO_MAX_SHIFT, naive_o, naive_lse), (NOT_NORMALIZED, unnorm, None)]


def _grade_merge(merge, case, rng):
    o_parts, lse_parts, ref_o, ref_lse = _parts(rng, case.params)
    out = merge(o_parts.copy(), lse_parts.copy())
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("merge_states must return the pair (o, lse)")
    o, lse = (np.asarray(x, dtype=np.float64) for x in out)
    wrong = _wrong_merges(o_parts, lse_parts)
    report = CaseReport()
    if np.isnan(o).any():
        fail("O has NaN", report, EMPTY_PART_NAN if not case.params.get("boost") else NO_MAX_SHIFT)
    oracle_problem(o, ref_o, None, name="O", dtype="float64", report=report,
                   masked_rows=np.isneginf(ref_lse)[:, None], mistakes=[(m, w) for m, w, _ in wrong])
    oracle_problem(lse, ref_lse, None, name="LSE", dtype="float64", report=report,
                   mistakes=[(m, w) for m, _, w in wrong if w is not None])
    return report


MERGE_STATES = Exercise(
    name="merge_states", title="The exact log-sum-exp merge, empty parts included", entry="merge_states",
    spec=("merge_states(o_parts, lse_parts) -> (o, lse): o_parts (S, rows, d) normalized partial outputs, "
          "lse_parts (S, rows) their log-sum-exps (-inf: the part saw no key; its O may be anything, even NaN)."),
    cases=lambda: [_case(rows=6, N=40, parts=4, d=59), _case(rows=5, N=31, parts=3, d=7, boost=400.0)],
    grade_case=_grade_merge, seed=606,
    hint="LSE = m + log sum_s exp(LSE_s - m) with m = max_s LSE_s; O = sum_s exp(LSE_s - LSE) O_s.",
    mistakes=(EMPTY_PART_NAN, NO_MAX_SHIFT, NOT_NORMALIZED), references=refs.MERGE)


def _grade_decode(decode_fn, case, rng):
    p = case.params
    B, Hq, Hkv, N, d, dtype = p["B"], p["Hq"], p["Hkv"], p["N"], p["d"], p["dtype"]
    dt = testing.numpy_dtype(dtype)
    q = rng.standard_normal((B, Hq, d)).astype(dt)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(dt) for _ in range(2))
    scale = cv.default_scale(d)
    out = decode_fn(q, k, v, num_splits=p["splits"], scale=scale)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("split_kv_decode must return the pair (o, lse)")
    ref_o, ref_lse = reference.decode(q, k, v, scale=scale)
    base_o, base_lse = decode_naive(q, k, v, scale=scale)
    report = CaseReport()
    oracle_problem(np.asarray(out[0]), ref_o, base_o, name="O", dtype=dtype, report=report)
    oracle_problem(np.asarray(out[1]), ref_lse, base_lse, name="LSE", dtype=dtype, report=report)
    return report


SPLIT_KV_DECODE = Exercise(
    name="split_kv_decode", title="Flash-Decoding: split the keys, merge exactly", entry="split_kv_decode",
    spec=("split_kv_decode(q, k, v, *, num_splits, scale) -> (o, lse): q (B, Hq, d), k, v (B, Hkv, N, d); "
          "split the N keys into num_splits contiguous chunks of ceil(N / num_splits) (trailing chunks may be "
          "empty), attend within each chunk, merge with your merge_states."),
    cases=lambda: [_case(B=2, Hq=4, Hkv=2, N=37, d=59, splits=3, dtype="float64"),
                   _case(B=1, Hq=4, Hkv=1, N=5, d=16, splits=8, dtype="float32")],
    grade_case=_grade_decode, seed=616,
    hint="query head h reads KV head h // (Hq // Hkv); more splits than keys leaves some splits empty.",
    references=refs.DECODE)


EXERCISES = (NAIVE_TRAFFIC, ONLINE_STEP, FLASH_FORWARD, LOOP_ORDER, FLASH_BACKWARD, MERGE_STATES,
             SPLIT_KV_DECODE, PAGED_GATHER, COPY_ON_WRITE)
