"""The exercises of chapters 09-13: a correct solution passes, a stub fails, each known mistake
is named, and a wrong shape gets a message that says what was expected."""
from __future__ import annotations

import numpy as np
import pytest

from iokernels import labs
from iokernels.labs import exercises_hopper as eh
from iokernels.labs import exercises_scale as es


# --------------------------------------------------------------------------- correct solutions
def fwht(x):
    a = np.array(x, dtype=np.float64)
    d = a.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: the last axis must have a power-of-two length, got {d}")
    h = 1
    while h < d:
        pairs = a.reshape(*a.shape[:-1], d // (2 * h), 2, h)
        top, bottom = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :] = top + bottom
        pairs[..., 1, :] = top - bottom
        h *= 2
    return a / np.sqrt(d)


def merge_pair(o, lse, o_b, lse_b):
    live, live_b = np.isfinite(lse), np.isfinite(lse_b)
    both = live & live_b
    m = np.where(both, np.maximum(lse, lse_b), 0.0)
    w = np.where(both, np.exp(np.where(both, lse - m, 0.0)), 0.0)
    w_b = np.where(both, np.exp(np.where(both, lse_b - m, 0.0)), 0.0)
    tot = np.where(both, w + w_b, 1.0)
    o_both = (w[:, None] * o + w_b[:, None] * np.where(both[:, None], o_b, 0.0)) / tot[:, None]
    o_new = np.where(both[:, None], o_both, np.where(live_b[:, None], o_b, o))
    lse_new = np.where(both, m + np.log(tot), np.where(live_b, lse_b, lse))
    return o_new, lse_new


def randomized_hadamard(x, signs):
    x, signs = np.asarray(x, dtype=np.float64), np.asarray(signs, dtype=np.float64)
    if signs.shape != (x.shape[-1],):
        raise ValueError(f"signs: expected shape ({x.shape[-1]},), got {signs.shape}")
    return fwht(x * signs)


def rescale_step(m, l, o, s, v, threshold):
    tile = s.max(axis=1)
    with np.errstate(invalid="ignore"):
        keep = np.isfinite(m) & (tile > m) & ((tile - m) * np.log2(np.e) <= threshold)
    m_new = np.where(keep, m, np.maximum(m, tile))
    ref = np.where(np.isneginf(m_new), 0.0, m_new)
    alpha = np.exp(m - ref)
    p = np.exp(s - ref[:, None])
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v


def zigzag_split(seqlen, world_size):
    W = world_size
    if seqlen < 2 * W:
        raise ValueError(f"seqlen: the zigzag split needs at least {2 * W} tokens, got {seqlen}")
    base, extra = divmod(seqlen, 2 * W)
    edges = [0]
    for c in range(2 * W):
        edges.append(edges[-1] + base + (1 if c < extra else 0))
    chunks = list(zip(edges[:-1], edges[1:]))
    return [[chunks[r], chunks[2 * W - 1 - r]] for r in range(W)]


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_bytes_per_token(config):
    layers = config["num_hidden_layers"]
    size = ITEMSIZE[config["torch_dtype"]]
    if "kv_lora_rank" in config:
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * size
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", 1 if config.get("multi_query") else heads)
    d = config.get("head_dim", config["hidden_size"] // heads)
    return 2 * layers * kv * d * size


def absorbed_mla(q_nope, q_rope, KV_latent, w_uk, w_uv, *, scale):
    rows = KV_latent[:]                                    # every latent row, once, for all heads
    dc = w_uk.shape[1]
    c, k_rope = rows[..., :dc], rows[..., dc:]
    acc = np.float64 if q_nope.dtype == np.float64 else np.float32
    q_lat = np.einsum("bhd,hcd->bhc", q_nope.astype(acc), w_uk.astype(acc))
    s = (np.einsum("bhc,bnc->bhn", q_lat, c.astype(acc))
         + np.einsum("bhr,bnr->bhn", q_rope.astype(acc), k_rope.astype(acc))) * acc(scale)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    o_lat = np.einsum("bhn,bnc->bhc", e / l, c.astype(acc))
    return np.einsum("bhc,hcv->bhv", o_lat, w_uv.astype(acc)), (m + np.log(l))[..., 0]


VARLEN_SOURCE = '''
def varlen_attention(q, k, v, cu_q, cu_k, *, causal, scale):
    total_q, H, d = q.shape
    o = np.zeros((total_q, H, d))
    lse = np.full((H, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        k0, k1 = cu_q[b], cu_q[b + 1]
        ### BEGIN SOLUTION remove
        k0, k1 = cu_k[b], cu_k[b + 1]
        ### END SOLUTION
        nq, nk = q1 - q0, k1 - k0
        s = np.einsum("ihd,jhd->hij", q[q0:q1], k[k0:k1]) * scale
        if causal:
            visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
            s = np.where(visible, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        ### BEGIN SOLUTION remove
        m = np.where(np.isfinite(m), m, 0.0)
        ### END SOLUTION
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse[:, q0:q1] = (m + np.log(l))[..., 0]
        ### BEGIN SOLUTION remove
        l = np.where(l > 0, l, 1.0)
        ### END SOLUTION
        o[q0:q1] = np.einsum("hij,jhd->ihd", p / l, v[k0:k1])
    return o, lse
'''


def _define(source):
    ns = {"np": np}
    exec(source, ns)
    return ns["varlen_attention"]


varlen_attention = _define(VARLEN_SOURCE)


SOLUTIONS = {"zigzag_split": zigzag_split, "kv_bytes_per_token": kv_bytes_per_token,
             "absorbed_mla_query": absorbed_mla, "varlen_bug_hunt": varlen_attention,
             "fwht": fwht, "merge_pair": merge_pair, "randomized_hadamard": randomized_hadamard,
             "rescale_threshold_step": rescale_step}


def _grade(name, solution):
    return labs.check(name, solution)


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_solution_passes(name):
    r = _grade(name, SOLUTIONS[name])
    assert r.passed, str(r)
    assert r.cases_run == len(labs.EXERCISES[name].cases())


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_stub_and_none_fail(name):
    def stub(*args, **kw):
        raise NotImplementedError("write this part")
    r = _grade(name, stub)
    assert not r.passed and "not written yet" in r.message
    r = labs.check(name, None)
    assert not r.passed and "nothing to grade yet" in r.message


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_exercise_declares_references_and_mistakes(name):
    e = labs.EXERCISES[name]
    assert e.references and all(r.startswith("iokernels.") for r in e.references)
    assert e.mistakes


# --------------------------------------------------------------------------- fwht
def test_fwht_mutants_are_named():
    for mistake, wrong in [(eh.NOT_NORMALIZED, lambda x: eh._butterflies(x)),
                           (eh.DIVIDED_BY_D, lambda x: eh._butterflies(x) / x.shape[-1]),
                           (eh.PAIR_OVERWRITTEN, lambda x: eh._butterflies(x, overwrite=True) / np.sqrt(x.shape[-1])),
                           (eh.SWAPPED_DIFFERENCE, lambda x: eh._butterflies(x, swapped=True) / np.sqrt(x.shape[-1]))]:
        r = labs.check("fwht", wrong)
        assert not r.passed and r.mistake == mistake.name, str(r)


def test_fwht_in_place_and_missing_check_are_named():
    def in_place(x):
        x[...] = fwht(x)
        return x
    r = labs.check("fwht", in_place)
    assert r.mistake == eh.INPUT_OVERWRITTEN.name, str(r)

    def no_check(x):
        d = x.shape[-1]
        if d & (d - 1):
            return np.zeros_like(x)
        return fwht(x)
    r = labs.check("fwht", no_check)
    assert r.mistake == eh.NO_POWER_CHECK.name and "not a power of two" in r.message, str(r)


def test_fwht_bad_shape_teaches():
    r = labs.check("fwht", lambda x: fwht(x).reshape(-1))
    assert not r.passed and "expected" in r.message and "last axis" in r.message, str(r)


def test_fwht_grader_agrees_with_the_matrix():
    x = np.random.default_rng(0).standard_normal((3, 16))
    from iokernels import fp8
    assert np.allclose(fwht(x), x @ fp8.hadamard_matrix(16), atol=1e-13)


# --------------------------------------------------------------------------- merge_pair
@pytest.mark.parametrize("mistake, kind", es._PAIR_MUTANTS)
def test_merge_pair_mutants_are_named(mistake, kind):
    r = labs.check("merge_pair", es._mutant_pair(kind))
    assert not r.passed and r.mistake == mistake.name, str(r)


def test_merge_pair_empty_block_nan_is_named():
    def careless(o, lse, o_b, lse_b):              # multiplies an empty block's NaN O by weight 0
        m = np.maximum(lse, lse_b)
        mm = np.where(np.isfinite(m), m, 0.0)
        w, w_b = np.exp(lse - mm), np.exp(lse_b - mm)
        return ((w[:, None] * o + w_b[:, None] * o_b) / (w + w_b)[:, None], mm + np.log(w + w_b))
    with np.errstate(all="ignore"):
        r = labs.check("merge_pair", careless)
    assert not r.passed and r.mistake == es.EMPTY_PART_NAN.name and "NaN" in r.message, str(r)


def test_merge_pair_bad_shape_and_return_teach():
    r = labs.check("merge_pair", lambda o, lse, o_b, lse_b: merge_pair(o, lse, o_b, lse_b)[0])
    assert not r.passed and "pair" in r.message, str(r)
    r = labs.check("merge_pair", lambda o, lse, o_b, lse_b: (merge_pair(o, lse, o_b, lse_b)[0].T,
                                                               merge_pair(o, lse, o_b, lse_b)[1]))
    assert not r.passed and "expected" in r.message and "shape" in r.message, str(r)


def test_the_package_merge_passes_its_own_grader_and_is_refused_as_an_answer():
    import types

    from iokernels.context_parallel.merge import merge_pair as package_merge
    r = labs.check("merge_pair", package_merge)
    assert not r.passed and "the package's own implementation" in r.message, str(r)
    # the same code as a function of its own (not the guarded object): the grader agrees with it
    clone = types.FunctionType(package_merge.__code__, package_merge.__globals__, "merge_pair",
                               package_merge.__defaults__, package_merge.__closure__)
    assert labs.check("merge_pair", clone).passed


# --------------------------------------------------------------------------- randomized Hadamard
def test_randomized_hadamard_mutants_are_named():
    wrong = {eh.SIGNS_AFTER: lambda x, s: fwht(x) * s, eh.SIGNS_IGNORED: lambda x, s: fwht(x),
             eh.RH_NOT_NORMALIZED: lambda x, s: fwht(x * s) * np.sqrt(x.shape[-1])}
    for mistake, fn in wrong.items():
        r = labs.check("randomized_hadamard", fn)
        assert not r.passed and r.mistake == mistake.name, str(r)

    def no_check(x, s):
        return fwht(x * np.resize(s, x.shape[-1]))
    r = labs.check("randomized_hadamard", no_check)
    assert r.mistake == eh.NO_SIGNS_CHECK.name, str(r)


def test_randomized_hadamard_reports_the_outlier_reduction_and_bad_shapes():
    r = labs.check("randomized_hadamard", randomized_hadamard)
    assert r.passed
    r = labs.check("randomized_hadamard", lambda x, s: randomized_hadamard(x, s)[..., :-1])
    assert not r.passed and "expected" in r.message and "shape" in r.message, str(r)


def test_outliers_shrink_on_the_hidden_inputs():
    from iokernels import fp8
    rng = np.random.default_rng(3)
    q, k, _ = fp8.outlier_inputs(rng, seqlen_q=4, seqlen_k=64, head_dim=64)
    s = fp8.random_signs(64, rng)
    assert eh._incoherence(randomized_hadamard(k, s)) < eh._incoherence(k) / 2


# --------------------------------------------------------------------------- rescale threshold
@pytest.mark.parametrize("mistake, kind", eh._THRESHOLD_MUTANTS)
def test_rescale_threshold_mutants_are_named(mistake, kind):
    r = labs.check("rescale_threshold_step", eh._threshold_mutant(kind))
    assert not r.passed and r.mistake == mistake.name, str(r)


def test_rescale_threshold_counts_are_the_package_rule():
    """The hidden cases skip some rescales and do others (the count is a real test), and the
    always-rescale step gets O and LSE right but the count wrong."""
    e = labs.EXERCISES["rescale_threshold_step"]
    for i, case in enumerate(e.cases()):
        from iokernels.labs.exercises import _scores
        p = case.params
        rng = e.rng(i)
        s = _scores(rng, p["rows"], p["N"], p["Bc"]) * p.get("spread", 1.0)
        v = rng.standard_normal((p["N"], p["d"]))
        _, _, moves = eh._fold_counting(rescale_step, s, v, p["Bc"], p["tau"])
        _, _, always = eh._fold_counting(eh._threshold_mutant("always"), s, v, p["Bc"], p["tau"])
        assert moves == eh._reference_rescales(s, p["Bc"], p["tau"])
        assert moves < always or p["tau"] == 0
    r = labs.check("rescale_threshold_step", eh._threshold_mutant("always"))
    assert "rescales" in r.message and "O:" not in r.message, str(r)


def test_rescale_threshold_bad_return_teaches():
    r = labs.check("rescale_threshold_step", lambda m, l, o, s, v, t: rescale_step(m, l, o, s, v, t)[:2])
    assert not r.passed and "triple" in r.message
    r = labs.check("rescale_threshold_step", lambda m, l, o, s, v, t: (m, l, o.T))
    assert not r.passed and "expected" in r.message


# --------------------------------------------------------------------------- zigzag split
@pytest.mark.parametrize("mistake, kind", es._SPLIT_MUTANTS)
def test_zigzag_mutants_are_named(mistake, kind):
    def wrong(n, w):
        if n < 2 * w:
            raise ValueError("seqlen: too short")
        return es._wrong_split(kind, n, w)
    r = labs.check("zigzag_split", wrong)
    assert not r.passed and r.mistake == mistake.name, str(r)


def test_zigzag_short_sequence_and_bad_returns_teach():
    r = labs.check("zigzag_split", lambda n, w: zigzag_split(max(n, 2 * w), w))
    assert r.mistake == es.NO_LENGTH_CHECK.name, str(r)

    def flat(n, w):
        zigzag_split(n, w)
        return [a for segs in zigzag_split(n, w) for a in segs]
    r = labs.check("zigzag_split", flat)
    assert not r.passed and "one list of (start, stop) segments per rank" in r.message, str(r)

    def twice(n, w):
        zigzag_split(n, w)
        return [[(0, n)]] + [[] for _ in range(w - 1)] if w > 1 else [[(0, n), (0, 1)]]
    r = labs.check("zigzag_split", twice)
    assert not r.passed and ("over" in r.message or "held by" in r.message), str(r)


def test_zigzag_work_and_bytes_match_the_package():
    from iokernels.context_parallel import causal_work, split_positions
    for n, w in [(64, 4), (37, 3), (29, 2)]:
        ours = zigzag_split(n, w)
        assert [list(map(tuple, s)) for s in ours] == [list(s) for s in split_positions(n, w, "zigzag")]
        work = [sum(t + 1 for a, b in segs for t in range(a, b)) for segs in ours]
        assert work == causal_work(n, w, "zigzag")


# --------------------------------------------------------------------------- KV bytes per token
def test_kv_bytes_mutants_are_named():
    def wrong(field):
        def f(c):
            c = dict(c)
            if field == "query heads":
                c["num_key_value_heads"] = c["num_attention_heads"] if "kv_lora_rank" not in c else 0
                if "kv_lora_rank" in c:
                    return kv_bytes_per_token(c)
            if field == "half":
                return kv_bytes_per_token(c) // 2 if "kv_lora_rank" not in c else kv_bytes_per_token(c)
            if field == "dtype":
                c["torch_dtype"] = "bfloat16"
            if field == "rope":
                c["qk_rope_head_dim"] = 0
            if field == "mla heads" and "kv_lora_rank" in c:
                del c["kv_lora_rank"]
                c["head_dim"] = c["qk_nope_head_dim"]
            if field == "mq" and c.get("multi_query"):
                del c["multi_query"]
            return kv_bytes_per_token(c)
        return f
    for field, mistake in [("query heads", es.QUERY_HEADS), ("half", es.K_OR_V_ONLY), ("dtype", es.DTYPE_IGNORED),
                           ("rope", es.ROPE_MISSING), ("mla heads", es.MLA_AS_HEADS),
                           ("mq", es.MULTI_QUERY_IGNORED)]:
        r = labs.check("kv_bytes_per_token", wrong(field))
        assert not r.passed and r.mistake == mistake.name, (field, str(r))
    r = labs.check("kv_bytes_per_token", lambda c: kv_bytes_per_token(c) // c["num_hidden_layers"])
    assert r.mistake == es.LAYERS_MISSING.name, str(r)


def test_kv_bytes_wrong_type_teaches():
    r = labs.check("kv_bytes_per_token", lambda c: kv_bytes_per_token(c) + 0.5)
    assert not r.passed and "whole number" in r.message
    r = labs.check("kv_bytes_per_token", lambda c: str(kv_bytes_per_token(c)))
    assert not r.passed and "return an int" in r.message


def test_kv_bytes_configs_are_the_package_models():
    from iokernels import models
    assert kv_bytes_per_token(es._config(models.MODELS["Llama-3-8B"])) == 128 * 1024
    assert kv_bytes_per_token(es._config(models.MODELS["Llama-2-7B"], kv_key=False)) == 512 * 1024


# --------------------------------------------------------------------------- absorbed MLA
@pytest.mark.parametrize("kind, mistake", [("transposed", es.W_UK_TRANSPOSED), ("no rope", es.ROPE_DROPPED),
                                           ("row scale", es.ROW_WIDTH_SCALE), ("latent", es.NOT_UP_PROJECTED)])
def test_absorbed_mla_mutants_are_named(kind, mistake):
    def wrong(q_nope, q_rope, KV_latent, w_uk, w_uv, *, scale):
        x = dict(q_nope=q_nope, q_rope=q_rope, kv_latent=KV_latent[:], w_uk=w_uk, w_uv=w_uv)
        return es._mla_variant(x, scale, kind)
    r = labs.check("absorbed_mla_query", wrong)
    assert not r.passed and r.mistake == mistake.name, str(r)


def test_absorbed_mla_reading_per_head_is_named():
    def per_head(q_nope, q_rope, KV_latent, w_uk, w_uv, *, scale):
        for _ in range(q_nope.shape[1]):
            rows = KV_latent[:]
        x = dict(q_nope=q_nope, q_rope=q_rope, kv_latent=rows, w_uk=w_uk, w_uv=w_uv)
        return es._mla_variant(x, scale)
    r = labs.check("absorbed_mla_query", per_head)
    assert not r.passed and r.mistake == es.LATENT_PER_HEAD.name and "KV_latent" in r.message, str(r)


def test_absorbed_mla_matches_the_package():
    from iokernels import mla
    from iokernels.core.traffic import HBM
    rng = np.random.default_rng(5)
    x = mla.make_mla_inputs(rng, batch=2, heads=4, seqlen=19, latent_dim=16, rope_dim=4, head_dim=8)
    o, lse = absorbed_mla(x["q_nope"], x["q_rope"], HBM(x["kv_latent"], "KV_latent"), x["w_uk"], x["w_uv"],
                          scale=mla.default_scale(8, 4))
    ref_o, ref_lse = mla.mla_decode_absorbed(**x)
    assert np.allclose(o, ref_o, atol=1e-12) and np.allclose(lse, ref_lse, atol=1e-12)


# --------------------------------------------------------------------------- varlen bug hunt
def test_the_varlen_kernel_as_given_fails_on_its_first_bug():
    from iokernels.labs import notebooks as lnb
    given = _define(lnb.student_source(VARLEN_SOURCE))
    r = labs.check("varlen_bug_hunt", given)
    assert not r.passed and r.mistake == es.KEYS_AT_QUERY_OFFSETS.name, str(r)
    half = VARLEN_SOURCE.replace("        m = np.where(np.isfinite(m), m, 0.0)\n", "")
    r = labs.check("varlen_bug_hunt", _define(half))
    assert not r.passed and r.mistake == es.EMPTY_ROW_NAN.name, str(r)
    late = VARLEN_SOURCE.replace("        l = np.where(l > 0, l, 1.0)\n", "")
    r = labs.check("varlen_bug_hunt", _define(late))
    assert not r.passed and r.mistake == es.EMPTY_ROW_NAN.name, str(r)


def test_varlen_other_mistakes_are_named():
    top_left = VARLEN_SOURCE.replace(" + (nk - nq)", "")
    r = labs.check("varlen_bug_hunt", _define(top_left))
    assert not r.passed and r.mistake == es.MASK_TOP_LEFT.name, str(r)
    lse_zero = VARLEN_SOURCE.replace("        l = np.where(l > 0, l, 1.0)\n", "").replace(
        "        with np.errstate", "        l = np.where(l > 0, l, 1.0)\n        with np.errstate")
    r = labs.check("varlen_bug_hunt", _define(lse_zero))
    assert not r.passed and r.mistake == es.EMPTY_ROW_LSE.name, str(r)


def test_varlen_oracle_is_the_package_s():
    from iokernels import tiled
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 3, 10, 10, 14]), np.array([0, 9, 12, 16, 16])
    q, k, v = rng.standard_normal((14, 2, 5)), rng.standard_normal((16, 2, 5)), rng.standard_normal((16, 2, 5))
    o, lse = es._varlen_oracle(q, k, v, cu_q, cu_k, True, 0.4)
    ref_o, ref_lse = tiled.attention_varlen(q, k, v, cu_q, cu_k, causal=True, scale=0.4, window=None)
    assert np.allclose(o, ref_o, atol=1e-12) and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert np.allclose(np.nan_to_num(lse, neginf=0), np.nan_to_num(ref_lse, neginf=0), atol=1e-12)
    got_o, _ = varlen_attention(q, k, v, cu_q, cu_k, causal=True, scale=0.4)
    assert np.allclose(got_o, ref_o, atol=1e-12)


def test_every_late_exercise_has_a_cheat_that_passes_without_the_guard():
    """The cheats call the package's own implementation: what the reference guard must block."""
    from lab_cheats_late import CHEATS
    late = set(SOLUTIONS) | {"triton_forward"}       # lab 13's solution is a kernel: tests/test_labs_triton.py
    assert set(CHEATS) == late
    for name in late:
        e = labs.EXERCISES[name]
        assert e.references, name
