"""The exercises of chapters 11-13 (varlen batches, the ring, decode at model scale), in NumPy.

=======================  ==================================================================
exercise                 what the learner writes (names as in the lab notebooks)
=======================  ==================================================================
merge_pair               ``merge_pair``: ring attention's exact merge of two (O, LSE) states
zigzag_split             ``zigzag_split``: the load-balanced causal split of a sequence over
                         W ranks (exact attention after reassembly, bytes and work per rank)
kv_bytes_per_token       ``kv_bytes_per_token``: a model's KV-cache bytes per token from its
                         config.json (MHA, GQA, MQA, MLA's latent row)
absorbed_mla_query       ``absorbed_mla``: MLA decode with W_UK absorbed into the query, each
                         latent row read once for all heads
varlen_bug_hunt          ``varlen_attention``: a packed-sequence kernel with two bugs (keys at
                         the queries' offsets, NaN on rows that see no key), found and fixed
=======================  ==================================================================

The graders use the package's own implementations as the reference
(:mod:`iokernels.context_parallel`, :mod:`iokernels.models`), bound when this module is
imported; each exercise names them in ``references`` so a solution cannot call them.
Notation as in :mod:`iokernels.context_parallel`: W ranks, O and LSE the running state,
O_b and LSE_b one block's partial result.
"""
from __future__ import annotations

import numpy as np

import numbers

from ..context_parallel.merge import merge_pair as _ref_merge_pair
from ..context_parallel.split import causal_work as _ref_causal_work
from ..context_parallel.split import split_positions as _ref_split_positions
from ..core import reference, testing, traffic
from ..core.traffic import HBM, Traffic
from ..mla import default_scale as _mla_default_scale
from ..mla import make_mla_inputs as _make_mla_inputs
from ..mla import reference_mla as _reference_mla
from ..models import MODELS, ModelShape
from ..models import kv_bytes_per_token as _ref_kv_bytes
from .engine import Case, CaseReport, Exercise, Mistake, budget_report, fail, oracle_problem
from .exercises import EMPTY_PART_NAN, NO_MAX_SHIFT, _parts

__all__ = ["KV_BYTES_PER_TOKEN", "ABSORBED_MLA_QUERY", "VARLEN_BUG_HUNT", "MERGE_PAIR", "ZIGZAG_SPLIT",
           "EXERCISES"]


def _case(label: str, **p) -> Case:
    return Case(label, p)


# =========================================================================== merge_pair (12)
SWAPPED_WEIGHTS = Mistake("the two sides' weights swapped",
                          "O' = O - sigmoid(LSE_b - LSE) (O - O_b): the block's weight grows with LSE_b, "
                          "so a block that saw much larger scores takes over O.")
MAX_NOT_LOGADDEXP = Mistake("LSE' = max(LSE, LSE_b)",
                            "the merged LSE is log(exp LSE + exp LSE_b) = max + log(1 + exp(-|LSE - LSE_b|)), "
                            "not the max: the smaller side's keys still add to the sum.")


def _mutant_pair(kind):
    """merge_pair with one known mistake (a model of the error; empty sides handled correctly)."""
    def merge(o, lse, o_b, lse_b):
        live, live_b = np.isfinite(lse), np.isfinite(lse_b)
        both = live & live_b
        with np.errstate(all="ignore"):
            if kind == "no shift":
                w, w_b = np.exp(lse), np.exp(lse_b)
                o_m = (w[:, None] * o + w_b[:, None] * o_b) / (w + w_b)[:, None]
                lse_m = np.log(w + w_b)
            else:
                sig = 1.0 / (1.0 + np.exp(-(lse_b - lse)))
                if kind == "swapped":
                    sig = 1.0 - sig
                o_m = o - sig[:, None] * (o - o_b)
                lse_m = np.maximum(lse, lse_b) if kind == "max" else np.logaddexp(lse, lse_b)
        o_new = np.where(both[:, None], o_m, np.where(live_b[:, None], o_b, o))
        lse_new = np.where(both, lse_m, np.where(live_b, lse_b, lse))
        return o_new, lse_new
    return merge


_PAIR_MUTANTS = ((NO_MAX_SHIFT, "no shift"), (SWAPPED_WEIGHTS, "swapped"), (MAX_NOT_LOGADDEXP, "max"))


def _ring_chain(merge, o_parts, lse_parts, acc=np.float64):
    """Fold every block into the running state as a ring does: start O = 0, LSE = -inf."""
    S, R, d = o_parts.shape
    o, lse = np.zeros((R, d), acc), np.full(R, -np.inf, acc)
    for s in range(S):
        out = merge(o.copy(), lse.copy(), o_parts[s].astype(acc), lse_parts[s].astype(acc))
        if not (isinstance(out, tuple) and len(out) == 2):
            fail("merge_pair must return the pair (o_new, lse_new)")
        o, lse = out
        if np.shape(o) != (R, d) or np.shape(lse) != (R,):
            fail(f"merge_pair returned o of shape {np.shape(o)} and lse of shape {np.shape(lse)}; expected "
                 f"{(R, d)} and {(R,)}: the same shapes as the running state it was given")
        o, lse = np.asarray(o), np.asarray(lse)
    return o, lse


def _grade_merge_pair(merge, case, rng):
    p = case.params
    o_parts, lse_parts, ref_o, ref_lse = _parts(rng, p)
    acc = np.dtype(p.get("dtype", "float64"))
    with np.errstate(all="ignore"):
        o, lse = _ring_chain(merge, o_parts, lse_parts, acc)
        wrong = [(m, _ring_chain(_mutant_pair(kind), o_parts, lse_parts)) for m, kind in _PAIR_MUTANTS]
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    report = CaseReport()
    if np.isnan(o).any() or np.isnan(lse).any():
        rows = sorted(set(np.flatnonzero(np.isnan(o).any(1))) | set(np.flatnonzero(np.isnan(lse))))
        mistake = NO_MAX_SHIFT if p.get("boost") else EMPTY_PART_NAN
        fail(f"the merged state has NaN in rows {rows[:6]} (row 0 sees no key in any block; block 1 is "
             f"empty, with O_b = NaN)", report, mistake)
    baseline = None
    if acc != np.float64:                                    # the package's merge in the same precision
        b_o, b_lse = _ring_chain(_ref_merge_pair, o_parts, lse_parts, acc)
        baseline = (b_o.astype(np.float64), b_lse.astype(np.float64))
    dtype = acc.name
    oracle_problem(o, ref_o, None if baseline is None else baseline[0], name="O", dtype=dtype, report=report,
                   masked_rows=np.isneginf(ref_lse)[:, None], mistakes=[(m, w[0]) for m, w in wrong])
    oracle_problem(lse, ref_lse, None if baseline is None else baseline[1], name="LSE", dtype=dtype,
                   report=report, mistakes=[(m, w[1]) for m, w in wrong])
    return report


MERGE_PAIR = Exercise(
    name="merge_pair", title="Ring attention's pairwise merge, empty blocks included", entry="merge_pair",
    spec=("merge_pair(o, lse, o_b, lse_b) -> (o_new, lse_new): merge one block's partial result (o_b (rows, d) "
          "normalized, lse_b (rows,)) into the running state (o, lse), exactly: lse_new = log(exp lse + exp "
          "lse_b), o_new = the two outputs weighted by exp(lse - lse_new) and exp(lse_b - lse_new).  No "
          "overflow for LSEs in the hundreds; a side with LSE = -inf (no key seen) weighs exactly 0 and its O "
          "may hold anything, even NaN; two empty sides give (o, -inf).  The grader chains it over a ring's "
          "blocks from o = 0, lse = -inf, in the precision of its inputs (float64, and float32: 2x the package's "
          "merge in float32)."),
    cases=lambda: [_case("rows=6 blocks=4 d=9", rows=6, N=40, parts=4, d=9),
                   _case("rows=5 blocks=3 d=7, scores in the hundreds", rows=5, N=31, parts=3, d=7, boost=400.0),
                   _case("rows=7 blocks=5 d=16 float32", rows=7, N=45, parts=5, d=16, dtype="float32")],
    grade_case=_grade_merge_pair, seed=1212,
    hint="LSE' = max + log(exp(LSE - max) + exp(LSE_b - max)); O' = O - sigmoid(LSE_b - LSE) (O - O_b).",
    mistakes=(EMPTY_PART_NAN, NO_MAX_SHIFT, SWAPPED_WEIGHTS, MAX_NOT_LOGADDEXP),
    references=("iokernels.context_parallel.merge.merge_pair", "iokernels.context_parallel.merge_pair",
                "iokernels.decode.merge_states", "iokernels.merge_states", "iokernels.api.merge_states"))



# =========================================================================== zigzag split (12)
CONTIGUOUS = Mistake("a contiguous split (one chunk per rank)",
                     "cut the sequence into 2W chunks and give rank r chunks r and 2W - 1 - r: with one chunk "
                     "each, the last rank computes about 2W - 1 times the first rank's causal work.")
STRIDED = Mistake("chunks r and r + W (a stride, not a mirror)",
                  "the second chunk mirrors the first: 2W - 1 - r, so an early chunk (little causal work) is "
                  "paired with a late one (much work); r + W keeps the imbalance.")
MIRROR_OFF_BY_ONE = Mistake("chunk 2W - r instead of 2W - 1 - r",
                            "chunks are numbered 0 .. 2W - 1, so rank r's mirror is 2W - 1 - r.")
UNEVEN_CHUNKS = Mistake("the remainder piled onto one chunk",
                        "make the 2W chunk lengths differ by at most one (the first N mod 2W chunks one longer), "
                        "so no rank holds more than ceil(N / W) tokens.")
NO_LENGTH_CHECK = Mistake("no check that seqlen >= 2 * world_size",
                          "raise ValueError naming seqlen when the sequence has fewer than 2W tokens (some chunk "
                          "would be empty).")


def _chunks(n, parts, even=True):
    if even:
        base, extra = divmod(n, parts)
        sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    else:
        sizes = [n // parts] * (parts - 1) + [n - (n // parts) * (parts - 1)]
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(parts)]


def _wrong_split(kind, n, w):
    """A split with one known mistake (a model of the error)."""
    if kind == "contiguous":
        return [[c] for c in _chunks(n, w)]
    ch = _chunks(n, 2 * w, even=kind != "uneven")
    if kind == "strided":
        return [[ch[r], ch[r + w]] for r in range(w)]
    if kind == "off by one":
        return [[ch[r], ch[(2 * w - r) % (2 * w)]] for r in range(w)]
    return [[ch[r], ch[2 * w - 1 - r]] for r in range(w)]


_SPLIT_MUTANTS = ((CONTIGUOUS, "contiguous"), (STRIDED, "strided"), (MIRROR_OFF_BY_ONE, "off by one"),
                  (UNEVEN_CHUNKS, "uneven"))


def _positions(split, n, w, mistake_of):
    """Each rank's global token positions from a split; fail unless it is a partition of range(n)."""
    if not isinstance(split, (list, tuple)) or len(split) != w:
        fail(f"zigzag_split must return one list of (start, stop) segments per rank: {w} lists, got "
             f"{type(split).__name__}" + (f" of length {len(split)}" if hasattr(split, "__len__") else ""))
    held = []
    for r, segs in enumerate(split):
        idx: list[int] = []
        for seg in segs:
            if len(seg) != 2 or not all(isinstance(x, numbers.Integral) for x in seg):
                fail(f"rank {r}'s segment {seg!r} is not a pair of integers (start, stop)")
            a, b = int(seg[0]), int(seg[1])
            if not 0 <= a <= b <= n:
                fail(f"rank {r}'s segment ({a}, {b}) is outside [0, {n}]", mistake=mistake_of(split))
            idx.extend(range(a, b))
        held.append(np.asarray(idx, dtype=np.int64))
    count = np.bincount(np.concatenate(held + [np.zeros(0, np.int64)]), minlength=n)
    if (count != 1).any():
        t = int(np.flatnonzero(count != 1)[0])
        fail(f"token {t} is held by {count[t]} ranks: every token must be held by exactly one",
             mistake=mistake_of(split))
    return held


def _ring_causal(q, k, v, held, scale):
    """Causal attention of every rank's queries against every rank's K/V block, merged as the ring does,
    then reassembled in sequence order."""
    B, H, n, d = q.shape
    o_full, lse_full = np.zeros_like(q), np.full((B, H, n), -np.inf)
    for pos_q in held:
        o = np.zeros((B * H * len(pos_q), d))
        lse = np.full(B * H * len(pos_q), -np.inf)
        for pos_k in held:                                   # the K/V blocks arriving round the ring
            visible = pos_k[None, :] <= pos_q[:, None]
            if not visible.any():
                continue                                     # a block entirely in this rank's future
            s = np.einsum("bhqd,bhkd->bhqk", q[:, :, pos_q], k[:, :, pos_k]) * scale
            s = np.where(visible, s, -np.inf)
            mx = np.max(s, axis=-1, keepdims=True)
            mref = np.where(np.isfinite(mx), mx, 0.0)
            e = np.exp(s - mref)
            tot = e.sum(-1, keepdims=True)
            with np.errstate(all="ignore"):
                o_b = np.einsum("bhqk,bhkd->bhqd", e, v[:, :, pos_k]) / tot
                lse_b = np.where(tot > 0, mref + np.log(tot), -np.inf)[..., 0]
            o, lse = _ref_merge_pair(o, lse, o_b.reshape(-1, d), lse_b.reshape(-1))
        o_full[:, :, pos_q], lse_full[:, :, pos_q] = o.reshape(B, H, -1, d), lse.reshape(B, H, -1)
    return o_full, lse_full


def _grade_zigzag(zigzag_split, case, rng):
    p = case.params
    n, w = p["N"], p["W"]
    if p.get("bad"):
        try:
            zigzag_split(n, w)
        except ValueError as exc:
            return CaseReport(notes=[f"{n} tokens over {w} ranks are refused: {exc}"])
        fail(f"zigzag_split({n}, {w}) returned a split: {n} tokens cannot fill 2W = {2 * w} chunks; raise "
             f"ValueError naming seqlen", mistake=NO_LENGTH_CHECK)
    mutants = [(m, _wrong_split(kind, n, w)) for m, kind in _SPLIT_MUTANTS]

    def mistake_of(split):
        try:
            norm = [[(int(a), int(b)) for a, b in segs] for segs in split]
        except (TypeError, ValueError):
            return None
        return next((m for m, wrong in mutants if norm == wrong), None)

    split = zigzag_split(n, w)
    held = _positions(split, n, w, mistake_of)
    B, H, d, itemsize = 1, 2, p["d"], 8
    q, k, v = (rng.standard_normal((B, H, n, d)) for _ in range(3))
    scale = d ** -0.5
    o, lse = _ring_causal(q, k, v, held, scale)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, scale=scale)
    report = CaseReport()
    oracle_problem(o, ref_o, None, name="O (reassembled)", dtype="float64", report=report)
    oracle_problem(lse, ref_lse, None, name="LSE (reassembled)", dtype="float64", report=report)
    # bytes per rank: the Q, K and V rows a rank holds; the budget is the package's zigzag split's largest rank
    ref_pos = _ref_split_positions(n, w, "zigzag")
    ref_tokens = max(sum(b - a for a, b in segs) for segs in ref_pos)
    per_token = 3 * B * H * d * itemsize
    counted, budget = Traffic(), Traffic()
    for r, pos in enumerate(held):
        counted.add(f"rank {r}", read=len(pos) * per_token)
        budget.add(f"rank {r}", read=ref_tokens * per_token)
    budget_report(counted, budget, report=report, detectors=(lambda row, c, b: mistake_of(split) or UNEVEN_CHUNKS,))
    # causal work per rank: query token t attends to keys 0..t (t + 1 pairs per head)
    work = [int(np.sum(pos + 1)) for pos in held]
    ref_work = _ref_causal_work(n, w, "zigzag")
    if max(work) > max(ref_work):
        fail(f"causal (query, key) pairs per rank {work}: the slowest rank computes {max(work):,}, the zigzag "
             f"split's slowest {max(ref_work):,} (every ring step waits for the slowest rank)", report,
             mistake_of(split))
    report.notes.append(f"pairs per rank {work} (a contiguous split: {_ref_causal_work(n, w, 'contiguous')}); "
                        f"{ref_tokens * per_token:,} B of Q, K, V on the fullest rank")
    return report


ZIGZAG_SPLIT = Exercise(
    name="zigzag_split", title="The zig-zag split: causal ring attention, load-balanced", entry="zigzag_split",
    spec=("zigzag_split(seqlen, world_size) -> a list of W lists of (start, stop) segments: the token ranges "
          "rank r holds.  Cut the N = seqlen tokens into 2W contiguous chunks whose lengths differ by at most one "
          "(the first N mod 2W one longer) and give rank r chunks r and 2W - 1 - r.  Raise ValueError naming "
          "seqlen when N < 2W.  Graded on: a partition of the tokens; causal attention computed rank by rank "
          "over the ring and reassembled (float64 oracle); the bytes of Q, K, V each rank holds (within the "
          "package's zigzag split's largest rank); the causal (query, key) pairs of the slowest rank."),
    cases=lambda: [_case("N=5 W=4: too short", N=5, W=4, d=4, bad=True), _case("N=23 W=1", N=23, W=1, d=3),
                   _case("N=37 W=3", N=37, W=3, d=5), _case("N=16 W=8: one token per chunk", N=16, W=8, d=4),
                   _case("N=29 W=2", N=29, W=2, d=6), _case("N=64 W=4", N=64, W=4, d=8)],
    grade_case=_grade_zigzag, seed=1213,
    hint="chunks = [(start_c, stop_c) for c in range(2W)]; rank r: [chunks[r], chunks[2W - 1 - r]].",
    mistakes=(CONTIGUOUS, STRIDED, MIRROR_OFF_BY_ONE, UNEVEN_CHUNKS, NO_LENGTH_CHECK),
    references=("iokernels.context_parallel.split.split_positions", "iokernels.context_parallel.split_positions",
                "iokernels.context_parallel.split.chunk_bounds", "iokernels.context_parallel.chunk_bounds"))


# =========================================================================== KV bytes per token (13)
#: bytes per value of the dtypes a config.json's torch_dtype names
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

QUERY_HEADS = Mistake("query heads counted instead of KV heads",
                      "the cache holds num_key_value_heads heads (GQA shares each between a group of query heads).")
K_OR_V_ONLY = Mistake("K or V only (the factor 2 missing)", "every KV head caches a key and a value row: 2 Hkv d.")
LAYERS_MISSING = Mistake("one layer only", "every layer has its own cache: multiply by num_hidden_layers.")
DTYPE_IGNORED = Mistake("2 bytes per value whatever the dtype",
                        "bytes per value come from torch_dtype: 4 for float32, 2 for float16 / bfloat16, 1 for fp8.")
MULTI_QUERY_IGNORED = Mistake("multi_query ignored",
                              "a config without num_key_value_heads but with multi_query: true caches one KV head "
                              "(MQA); without either, every query head has its own (MHA).")
HEAD_DIM_IGNORED = Mistake("hidden_size / heads used although head_dim is given",
                           "an explicit head_dim wins: some models' heads are wider or narrower than hidden / heads.")
MLA_AS_HEADS = Mistake("MLA counted as per-head K and V",
                       "with kv_lora_rank in the config the cache holds one latent row of kv_lora_rank + "
                       "qk_rope_head_dim values per token and layer, shared by all heads (the K/V heads are "
                       "rebuilt from it).")
ROPE_MISSING = Mistake("MLA's rotary part forgotten",
                       "the latent row is kv_lora_rank values plus the qk_rope_head_dim rotary key, cached apart.")


def _config(m: ModelShape, dtype="bfloat16", explicit_head_dim=False, kv_key=True) -> dict:
    """A config.json dict (Hugging Face field names) for a model shape."""
    hidden = m.heads_q * m.head_dim
    c = {"num_hidden_layers": m.layers, "num_attention_heads": m.heads_q, "hidden_size": hidden,
         "torch_dtype": dtype}
    if m.kind == "MLA":
        c.update(num_key_value_heads=m.heads_q, kv_lora_rank=m.latent_dim, qk_rope_head_dim=m.rope_dim,
                 qk_nope_head_dim=m.head_dim, v_head_dim=m.v_head_dim, hidden_size=7168)
    elif m.kind == "MQA" and not kv_key:
        c["multi_query"] = True
    elif kv_key:
        c["num_key_value_heads"] = m.heads_kv
    if explicit_head_dim:
        c["head_dim"] = m.head_dim
        c["hidden_size"] = m.heads_q * m.head_dim // 2          # hidden / heads would be wrong
    return c


def _wrong_bytes(c: dict) -> list:
    """(Mistake, answer) pairs: the bytes per token under each known mistake."""
    L, hq = c["num_hidden_layers"], c["num_attention_heads"]
    hkv = c.get("num_key_value_heads", 1 if c.get("multi_query") else hq)
    d = c.get("head_dim", c["hidden_size"] // hq)
    s = ITEMSIZE[c["torch_dtype"]]
    out = []
    if "kv_lora_rank" in c:
        out += [(MLA_AS_HEADS, 2 * L * hkv * c.get("qk_nope_head_dim", d) * s),
                (MLA_AS_HEADS, 2 * L * hkv * (c.get("qk_nope_head_dim", d) + c["qk_rope_head_dim"]) * s),
                (MLA_AS_HEADS, 2 * L * hkv * d * s), (ROPE_MISSING, L * c["kv_lora_rank"] * s)]
        per_layer = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        return out + [(LAYERS_MISSING, per_layer * s), (DTYPE_IGNORED, L * per_layer * 2)]
    out += [(DTYPE_IGNORED, 2 * L * hkv * d * 2),    # first: earlier (16-bit) cases have passed the factor 2
            (QUERY_HEADS, 2 * L * hq * d * s), (K_OR_V_ONLY, L * hkv * d * s), (LAYERS_MISSING, 2 * hkv * d * s),
            (HEAD_DIM_IGNORED, 2 * L * hkv * (c["hidden_size"] // hq) * s)]
    if c.get("multi_query"):
        out.insert(0, (MULTI_QUERY_IGNORED, 2 * L * hq * d * s))
    return out


def _kv_cases():
    M = MODELS
    custom = ModelShape("a GQA model with 256-wide heads", "GQA", layers=18, heads_q=8, heads_kv=1, head_dim=256,
                        source="a made-up shape: head_dim differs from hidden_size / heads")
    return [_case("Llama-2-7B (MHA)", model=M["Llama-2-7B"], kv_key=False),
            _case("Llama-3-8B (GQA)", model=M["Llama-3-8B"]),
            _case("Llama-3-70B (GQA) in float32", model=M["Llama-3-70B"], dtype="float32"),
            _case("Falcon-7B (MQA, multi_query)", model=M["Falcon-7B"], kv_key=False),
            _case("DeepSeek-V3 (MLA)", model=M["DeepSeek-V3"]),
            _case("GQA, explicit head_dim, fp8", model=custom, dtype="float8_e4m3fn", explicit_head_dim=True)]


def _grade_kv_bytes(kv_bytes, case, rng):
    p = case.params
    m = p["model"]
    c = _config(m, p.get("dtype", "bfloat16"), p.get("explicit_head_dim", False), p.get("kv_key", True))
    want = int(_ref_kv_bytes(m, ITEMSIZE[c["torch_dtype"]]))
    got = kv_bytes(dict(c))
    report = CaseReport(notes=[f"{m.name}: {want:,} B per token, {want * 32768 / 2 ** 30:.2f} GiB for a "
                               f"32,768-token context"])
    if isinstance(got, bool) or not isinstance(got, (numbers.Integral, float)):
        fail(f"kv_bytes_per_token returned {got!r}: return an int (bytes)")
    if isinstance(got, float) and not got.is_integer():
        fail(f"kv_bytes_per_token returned {got!r}: bytes per token are a whole number")
    got = int(got)
    if got != want:
        named = next((mk for mk, w in _wrong_bytes(c) if w == got and w != want), None)
        fail(f"{got:,} B per token for config {c}; the package's model of {m.name} says {want:,} B", report, named)
    return report


KV_BYTES_PER_TOKEN = Exercise(
    name="kv_bytes_per_token", title="KV-cache bytes per token from a model's config.json",
    entry="kv_bytes_per_token",
    spec=("kv_bytes_per_token(config) -> int: the bytes one token adds to the KV cache over all layers, from a "
          "config.json dict (Hugging Face field names).  Layers: num_hidden_layers.  KV heads: "
          "num_key_value_heads; if absent, 1 when multi_query is true (MQA), else num_attention_heads (MHA).  "
          "Head dim: head_dim if present, else hidden_size // num_attention_heads.  Bytes per value from "
          "torch_dtype (float32 4, float16 / bfloat16 2, float8_e4m3fn / float8_e5m2 1).  MHA/GQA/MQA cache a K "
          "and a V row per KV head per layer; MLA (the config has kv_lora_rank) caches one latent row of "
          "kv_lora_rank + qk_rope_head_dim values per layer.  Graded exactly against the package's model "
          "(iokernels.models) of Llama-2-7B, Llama-3-8B/70B, Falcon-7B, DeepSeek-V3 and a made-up GQA shape."),
    cases=_kv_cases, grade_case=_grade_kv_bytes, seed=1313,
    hint="bytes = layers x values per layer (2 Hkv d, or d_c + d_R for MLA) x bytes per value.",
    mistakes=(QUERY_HEADS, K_OR_V_ONLY, LAYERS_MISSING, DTYPE_IGNORED, MULTI_QUERY_IGNORED, HEAD_DIM_IGNORED,
              MLA_AS_HEADS, ROPE_MISSING),
    references=("iokernels.models.kv_bytes_per_token", "iokernels.models.kv_values_per_token",
                "iokernels.models.decode_step", "iokernels.paged.kv_bytes_per_token",
                "iokernels.decode.decode_bytes_per_token"))



# =========================================================================== absorbed MLA query (13)
W_UK_TRANSPOSED = Mistake("W_UK applied transposed",
                          "q_lat[b, i] = W_UK[i] @ q_C[b, i]: w_uk is (H, d_c, d_h), so contract q's d_h with "
                          "w_uk's last axis: einsum('bhd,hcd->bhc').")
ROPE_DROPPED = Mistake("the rotary part of the score dropped",
                       "s_t = scale (q_lat . c_t + q_R . k_R,t): the last d_R columns of each cached row are the "
                       "rotary key, shared by every head.")
ROW_WIDTH_SCALE = Mistake("the softmax scale taken from the cached row's width",
                          "use the scale you are given (1 / sqrt(d_h + d_R) by default, the query width before "
                          "absorption), not 1 / sqrt(d_c + d_R).")
NOT_UP_PROJECTED = Mistake("the output left in the latent space",
                           "o[b, i] = o_lat[b, i] @ W_UV[i]: the attention over latents gives d_c values per head; "
                           "up-project them once with w_uv.")
LATENT_PER_HEAD = Mistake("the latent rows read once per head",
                          "every head scores the same rows [c_t | k_R,t]: load each row tile once and use it for "
                          "all H absorbed queries (that is the point of absorbing W_UK).")


def _mla_variant(x, scale, kind=""):
    """The absorbed decode in float64 (or under one known mistake: a model of the error)."""
    f = testing.as_numpy
    qn, qr, kv, wk, wv = f(x["q_nope"]), f(x["q_rope"]), f(x["kv_latent"]), f(x["w_uk"]), f(x["w_uv"])
    dc = wk.shape[1]
    q_lat = np.einsum("bhd,hdc->bhc", qn, wk) if kind == "transposed" else np.einsum("bhd,hcd->bhc", qn, wk)
    if kind == "row scale":
        scale = 1.0 / np.sqrt(kv.shape[-1])
    s = np.einsum("bhc,bnc->bhn", q_lat, kv[..., :dc])
    if kind != "no rope":
        s = s + np.einsum("bhr,bnr->bhn", qr, kv[..., dc:])
    s = s * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    o_lat = np.einsum("bhn,bnc->bhc", e / e.sum(-1, keepdims=True), kv[..., :dc])
    o = o_lat if kind == "latent" else np.einsum("bhc,hcv->bhv", o_lat, wv)
    return o, (m[..., 0] + np.log(e.sum(-1)))


def _mla_naive_low(x, scale, dtype):
    """The definition (up-project, then attend) in the inputs' precision: the 2x rule's baseline."""
    dt = testing.numpy_dtype(dtype)
    qn, qr, kv, wk, wv = (np.asarray(x[n]).astype(dt) for n in ("q_nope", "q_rope", "kv_latent", "w_uk", "w_uv"))
    dc = wk.shape[1]
    k_c = np.einsum("bnc,hcd->bhnd", kv[..., :dc], wk)
    v = np.einsum("bnc,hcv->bhnv", kv[..., :dc], wv)
    s = (np.einsum("bhd,bhnd->bhn", qn, k_c) + np.einsum("bhr,bnr->bhn", qr, kv[..., dc:])) * dt.type(scale)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    return np.einsum("bhn,bhnv->bhv", e / l, v).astype(np.float64), (m + np.log(l))[..., 0].astype(np.float64)


def _grade_absorbed(absorbed, case, rng):
    p = case.params
    dtype = p.get("dtype", "float64")
    x = _make_mla_inputs(rng, batch=p["B"], heads=p["H"], seqlen=p["N"], latent_dim=p["dc"], rope_dim=p["dr"],
                         head_dim=p["dh"], v_head_dim=p["dv"], dtype=dtype)
    scale = _mla_default_scale(p["dh"], p["dr"]) * p.get("scale_factor", 1.0)
    with traffic.count() as counted:
        out = absorbed(x["q_nope"].copy(), x["q_rope"].copy(), HBM(x["kv_latent"], "KV_latent"), x["w_uk"].copy(),
                       x["w_uv"].copy(), scale=scale)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("absorbed_mla must return the pair (o, lse)")
    o, lse = out
    B, H, dv = p["B"], p["H"], p["dv"]
    if np.shape(o) != (B, H, dv):
        fail(f"o has shape {np.shape(o)}, expected (B, H, d_v) = {(B, H, dv)}: up-project o_lat (d_c = {p['dc']} "
             f"values per head) with w_uv", mistake=NOT_UP_PROJECTED if np.shape(o)[-1:] == (p["dc"],) else None)
    ref_o, ref_lse = _reference_mla(x["q_nope"], x["q_rope"], x["kv_latent"], x["w_uk"], x["w_uv"], scale=scale)
    base_o, base_lse = (None, None) if dtype == "float64" else _mla_naive_low(x, scale, dtype)
    mutants = []
    for m, kind in ((W_UK_TRANSPOSED, "transposed"), (ROPE_DROPPED, "no rope"), (ROW_WIDTH_SCALE, "row scale"),
                    (NOT_UP_PROJECTED, "latent")):
        if kind == "transposed" and p["dc"] != p["dh"] or kind == "latent" and p["dc"] != p["dv"]:
            continue                                     # that mistake cannot even run at these widths
        mutants.append((m, _mla_variant(x, scale, kind)))
    report = CaseReport()
    oracle_problem(testing.as_numpy(o), ref_o, base_o, name="O", dtype=dtype, report=report,
                   mistakes=[(m, w[0]) for m, w in mutants])
    oracle_problem(testing.as_numpy(lse), ref_lse, base_lse, name="LSE", dtype=dtype, report=report,
                   mistakes=[(m, w[1]) for m, w in mutants])
    budget = Traffic().add("KV_latent", read=x["kv_latent"].nbytes)

    def per_head(row, counted, budget):
        return LATENT_PER_HEAD if row.tensor == "KV_latent" and row.read >= 2 * row.allowed_read else None
    budget_report(counted, budget, (per_head,), report=report)
    unabsorbed = 2 * p["N"] * H * (p["dh"] + p["dr"] + dv) * x["kv_latent"].itemsize * B
    report.notes.append(f"the latent cache read once: {x['kv_latent'].nbytes:,} B; the up-projected per-head K and V "
                        f"would be {unabsorbed:,} B (written, then read back)")
    return report


ABSORBED_MLA_QUERY = Exercise(
    name="absorbed_mla_query", title="MLA decode with the absorbed query: one latent row for every head",
    entry="absorbed_mla",
    spec=("absorbed_mla(q_nope, q_rope, KV_latent, w_uk, w_uv, *, scale) -> (o (B, H, d_v), lse (B, H)): one "
          "decode step of multi-head latent attention.  q_nope (B, H, d_h), q_rope (B, H, d_R); KV_latent an HBM "
          "array (B, N, d_c + d_R) of rows [c_t | k_R,t]; w_uk (H, d_c, d_h), w_uv (H, d_c, d_v).  Absorb W_UK "
          "into the query, q_lat[b, i] = w_uk[i] @ q_nope[b, i] (d_c values), score s_t = scale (q_lat . c_t + "
          "q_R . k_R,t), softmax over the N rows, o_lat = sum_t p_t c_t, and o = o_lat @ w_uv[i].  Read the "
          "latent rows by indexing KV_latent (a tile at a time or all at once), each row once for all H heads.  "
          "Graded against the float64 oracle of the definition (up-project, then attend; float32: 2x the "
          "definition in float32) and on KV_latent's bytes (the budget: the cache once)."),
    cases=lambda: [_case("B=2 H=4 N=23 d_c=16 d_R=4 d_h=16 d_v=16", B=2, H=4, N=23, dc=16, dr=4, dh=16, dv=16),
                   _case("B=1 H=8 N=40 d_c=32 d_R=8 d_h=12 d_v=10, scale x1.3", B=1, H=8, N=40, dc=32, dr=8, dh=12,
                         dv=10, scale_factor=1.3),
                   _case("B=2 H=3 N=17 d_c=24 d_R=8 d_h=16 d_v=16 float32", B=2, H=3, N=17, dc=24, dr=8, dh=16,
                         dv=16, dtype="float32")],
    grade_case=_grade_absorbed, seed=1314,
    hint="c, k_R = rows[..., :d_c], rows[..., d_c:]; q_lat = einsum('bhd,hcd->bhc', q_nope, w_uk); then it is "
         "multi-query attention with one KV head.",
    mistakes=(W_UK_TRANSPOSED, ROPE_DROPPED, ROW_WIDTH_SCALE, NOT_UP_PROJECTED, LATENT_PER_HEAD),
    references=("iokernels.mla.absorb_query", "iokernels.mla.mla_decode_absorbed", "iokernels.mla.reference_mla",
                "iokernels.mla.reference_latent", "iokernels.mla.mla_decode_unabsorbed",
                "iokernels.mla.paged_mla_decode", "iokernels.mla._latent_attention"))


# =========================================================================== varlen bug hunt (11)
KEYS_AT_QUERY_OFFSETS = Mistake("keys sliced at the queries' offsets",
                                "sequence b's keys are rows cu_k[b]:cu_k[b + 1] of k and v; cu_q only says where "
                                "its queries are (they differ as soon as a sequence has more keys than queries).")
EMPTY_ROW_NAN = Mistake("a row that sees no key gives NaN",
                        "a causal row of a sequence with more queries than keys, or any row of a sequence with no "
                        "keys, has max = -inf: exp(-inf - (-inf)) is NaN.  Subtract 0 for those rows, and divide "
                        "its zero sum by 1: O = 0, LSE = -inf.")
EMPTY_ROW_LSE = Mistake("the LSE of a row without keys is not -inf",
                        "take LSE = m + log l before replacing the empty rows' l = 0 by 1: log 0 = -inf.")
MASK_TOP_LEFT = Mistake("the causal mask aligned top-left",
                        "bottom-right alignment: query i of a sequence with Nq queries and Nk keys sees keys "
                        "j <= i + Nk - Nq (the last query sees every key).")


def _varlen_oracle(q, k, v, cu_q, cu_k, causal, scale, *, top_left=False, keys_at_q=False):
    """Per-sequence float64 attention (or under one known mistake); O (total_q, H, d), LSE (H, total_q)."""
    total_q, H, d = q.shape
    o, lse = np.zeros((total_q, H, d)), np.full((H, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0, k1 = (int(cu_q[b]), int(cu_q[b + 1])) if keys_at_q else (int(cu_k[b]), int(cu_k[b + 1]))
        kb, vb = k[k0:k1], v[k0:k1]
        if q1 == q0 or kb.shape[0] == 0:
            continue
        qq, kk, vv = (np.transpose(t, (1, 0, 2))[None] for t in (q[q0:q1], kb, vb))
        if top_left and causal:
            nq, nk = q1 - q0, kb.shape[0]
            allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None]
            ob, lb = reference.attention(qq, kk, vv, scale=scale, mask_mod=lambda b_, h_, i, j: allowed[i, j])
        else:
            ob, lb = reference.attention(qq, kk, vv, causal=causal, scale=scale)
        o[q0:q1], lse[:, q0:q1] = np.transpose(ob[0], (1, 0, 2)), lb[0]
    return o, lse


def _grade_varlen(varlen, case, rng):
    p = case.params
    H, d, causal = p["H"], p["d"], p["causal"]
    lens_q, lens_k = zip(*p["lens"])
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    q = rng.standard_normal((int(cu_q[-1]), H, d))
    k, v = (rng.standard_normal((int(cu_k[-1]), H, d)) for _ in range(2))
    scale = d ** -0.5
    with np.errstate(all="ignore"):
        out = varlen(q.copy(), k.copy(), v.copy(), cu_q.copy(), cu_k.copy(), causal=causal, scale=scale)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("varlen_attention must return the pair (o, lse)")
    o, lse = (testing.as_numpy(x) for x in out)
    ref_o, ref_lse = _varlen_oracle(q, k, v, cu_q, cu_k, causal, scale)
    report = CaseReport()
    if np.shape(o) != ref_o.shape or np.shape(lse) != ref_lse.shape:
        fail(f"o has shape {np.shape(o)} and lse {np.shape(lse)}; expected (total_q, H, d) = {ref_o.shape} and "
             f"(H, total_q) = {ref_lse.shape}")
    if np.isnan(o).any() or np.isnan(lse).any():
        rows = np.flatnonzero(np.isnan(o).any(axis=(1, 2)) | np.isnan(lse).any(axis=0)).tolist()
        fail(f"NaN in the packed rows {rows[:8]}; the rows that see no key are "
             f"{np.flatnonzero(np.isneginf(ref_lse).any(axis=0))[:8].tolist()}", report, EMPTY_ROW_NAN)
    with np.errstate(all="ignore"):
        mutants = [(KEYS_AT_QUERY_OFFSETS, _varlen_oracle(q, k, v, cu_q, cu_k, causal, scale, keys_at_q=True)),
                   (MASK_TOP_LEFT, _varlen_oracle(q, k, v, cu_q, cu_k, causal, scale, top_left=True))]
    empty = np.isneginf(ref_lse)
    if (lse[empty] != -np.inf).any() and np.allclose(o[empty.T], 0.0):
        fail("a row without keys has O = 0 but a finite LSE", report, EMPTY_ROW_LSE)
    oracle_problem(o, ref_o, None, name="O", dtype="float64", report=report,
                   masked_rows=empty.T[..., None],
                   mistakes=[(m, w[0]) for m, w in mutants])
    oracle_problem(lse, ref_lse, None, name="LSE", dtype="float64", report=report,
                   mistakes=[(m, w[1]) for m, w in mutants])
    report.notes.append(f"{int(empty.sum())} (head, row) pairs see no key: O = 0, LSE = -inf, no NaN")
    return report


VARLEN_BUG_HUNT = Exercise(
    name="varlen_bug_hunt", title="Bug hunt: packed sequences, cu_seqlens and rows that see no key",
    entry="varlen_attention",
    spec=("varlen_attention(q, k, v, cu_q, cu_k, *, causal, scale) -> (o (total_q, H, d), lse (H, total_q)): "
          "attention over packed sequences; sequence b owns rows cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b + 1] "
          "of k and v; causal masks are bottom-right aligned (query i sees keys j <= i + Nk - Nq).  A row that "
          "sees no key (causal with Nq > Nk, or Nk = 0) gives O = 0 and LSE = -inf, never NaN.  As given, the "
          "kernel has two bugs; find and fix them.  Graded against a float64 oracle run sequence by sequence."),
    cases=lambda: [_case("3 sequences, Nq = Nk, not causal", H=2, d=5, causal=False, lens=((4, 4), (7, 7), (2, 2))),
                   _case("4 sequences, Nk > Nq, causal", H=2, d=7, causal=True, lens=((3, 9), (5, 5), (1, 6), (4, 8))),
                   _case("Nq > Nk (rows that see no key), causal", H=1, d=4, causal=True,
                         lens=((7, 3), (4, 4), (6, 2))),
                   _case("an empty query and a sequence without keys", H=2, d=59, causal=False,
                         lens=((3, 5), (0, 4), (4, 0), (2, 3)))],
    grade_case=_grade_varlen, seed=1111,
    hint="print cu_q and cu_k of the failing case: which rows of k does sequence b read?  Then a row whose every "
         "score is -inf: what is exp(s - m)?",
    mistakes=(KEYS_AT_QUERY_OFFSETS, EMPTY_ROW_NAN, EMPTY_ROW_LSE, MASK_TOP_LEFT),
    references=("iokernels.tiled.attention_varlen", "iokernels.api.attention_varlen", "iokernels.attention_varlen",
                "iokernels.core.reference.attention_varlen"))


EXERCISES = (KV_BYTES_PER_TOKEN, ABSORBED_MLA_QUERY, VARLEN_BUG_HUNT, MERGE_PAIR, ZIGZAG_SPLIT)
