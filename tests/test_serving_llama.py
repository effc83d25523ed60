"""The Llama-architecture model: the paged engine's greedy tokens equal a contiguous cache's
and a cache-free recomputation's (float64, CPU); serve-bench's acceptance in small."""
import json

import numpy as np
import pytest
import torch

from iokernels.__main__ import main as cli
from iokernels.serving import ContiguousMemory, Engine, PagedMemory, Request, pool_invariants
from iokernels.serving.llama import LLAMA3_8B, TINY, Llama, LlamaShape, llama3_8b_shape, rope
from iokernels.serving.requests import Group

MODEL = Llama(TINY, seed=3)


def _serve(memory, reqs):
    def check(engine):
        if isinstance(memory, PagedMemory):
            for cache in memory.caches:
                assert not pool_invariants(cache)
            first = memory.caches[0]                           # the layers' tables stay in lockstep
            assert all(c.seq_ids == first.seq_ids and all(c.block_table(s) == first.block_table(s)
                                                          for s in first.seq_ids) for c in memory.caches)
    engine = Engine(MODEL, memory, token_budget=12, step_time=1.0, check=check)
    for r in reqs:
        engine.submit(r)
    return engine.run()


def test_greedy_paged_equals_contiguous_and_recomputation():
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, TINY.vocab, int(n)).tolist(), 7, arrival=0.5 * i)
            for i, n in enumerate([3, 17, 9, 26, 5])]
    ms = MODEL.memory_shape()
    paged = _serve(PagedMemory(14, 4, **ms), reqs)           # small: chunked prefill and preemption
    contiguous = _serve(ContiguousMemory(80, **ms), reqs)
    assert paged.preemptions and paged.outputs == contiguous.outputs
    for r in reqs:
        assert paged.outputs[r.rid][0] == MODEL.reference_greedy(r.prompt, 7)


def test_chunked_forward_logits_match_the_cache_free_model():
    tokens = list(range(40, 63))
    mem = PagedMemory(10, 4, **MODEL.memory_shape())
    seq = Group(Request("x", tokens, 1), 0).seqs[0]
    mem.start(seq)
    logits = []
    for c in (5, 8, 10):                                       # three chunks of one prompt
        logits.append(MODEL.forward(mem, [seq], [c])[0].numpy())
        seq.computed += c
    ref = MODEL.reference_logits(tokens)
    got, want = np.stack(logits), ref[[4, 12, 22]]
    assert np.max(np.abs(got - want)) <= 1e-12 * max(1.0, np.abs(want).max())


def test_rope_scores_depend_on_distance_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 8, generator=g,
                                                                                dtype=torch.float64)

    def score(i, j):
        return float((rope(q, torch.tensor([i]), 1e4) * rope(k, torch.tensor([j]), 1e4)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)


def test_a_forward_pass_makes_the_rotary_tables_once(monkeypatch):
    """Every layer's Q and K rotate by the same (cos, sin): a step computes them once, not twice
    a layer (each is a handful of float64 kernels on a GPU); rotating by them is rope."""
    from iokernels.serving import llama as L
    calls, real = [], L.rope_tables
    monkeypatch.setattr(L, "rope_tables", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    tokens = np.random.default_rng(1).integers(0, TINY.vocab, 9).tolist()
    logits = MODEL.reference_logits(tokens)
    assert len(calls) == 1 and TINY.layers > 1
    x = MODEL.embed[torch.tensor(tokens)]
    q = (x @ MODEL.layers[0]["wqkv"][:TINY.heads * TINY.head_dim].T).view(len(tokens), TINY.heads, TINY.head_dim)
    assert torch.equal(L.rotate(q, *real(torch.arange(9), TINY.head_dim, TINY.rope_theta, q.dtype, q.device)),
                       L.rope(q, torch.arange(9), TINY.rope_theta))
    assert np.isfinite(logits).all()


def test_shapes():
    s = llama3_8b_shape(2)
    assert (s.dim, s.heads, s.kv_heads, s.head_dim, s.ffn_dim, s.vocab, s.layers) == \
        (4096, 32, 8, 128, 14336, 128256, 2)
    assert LLAMA3_8B.layers == 32 and TINY.heads // TINY.kv_heads == 2
    with pytest.raises(ValueError, match="shape"):
        LlamaShape("bad", vocab=8, dim=30, layers=1, heads=4, kv_heads=2, ffn_dim=8)


@pytest.mark.parametrize("where", [["--backend", "tiled"], ["--device", "cpu"]])
def test_serve_bench_small(tmp_path, where):
    """NumPy pools on the host, and torch pools on a torch device (here the CPU): the same acceptance."""
    out = tmp_path / "serve.json"
    rc = cli(["serve-bench", "--model", "tiny", *where, "--requests", "10", "--kv-slots", "512",
              "--step-time", "0.01", "--quiet", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["tokens_equal"] is True and res["requests_equal_fraction"] == 1.0
    assert res["kv_budget_gb"] == pytest.approx(512 * 2 * 2 * 2 * 16 * 8 / 1e9)
    assert res["device"] == ("cpu" if "--device" in where else "cpu (NumPy pools)")
    assert res["setup"]["pools"] == ("torch" if "--device" in where else "numpy")
    for side in ("paged", "contiguous"):
        assert {"max_concurrent", "tokens_per_s", "waste_fraction", "p50_ms", "p99_ms"} <= set(res[side])
    assert res["paged"]["max_concurrent"] >= 2 * res["contiguous"]["max_concurrent"]
    assert res["paged"]["waste_fraction"] < res["contiguous"]["waste_fraction"]


def test_torch_backend_serves_the_same_tokens():
    """SDPA on both sides (the paged side gathers each sequence first): the tiled run's tokens."""
    rng = np.random.default_rng(1)
    reqs = [Request(i, rng.integers(0, TINY.vocab, int(n)).tolist(), 4) for i, n in enumerate([4, 11, 7])]
    ms = MODEL.memory_shape()
    tiled = _serve(PagedMemory(12, 4, **ms), reqs).outputs
    assert _serve(PagedMemory(12, 4, backend="torch", **ms), reqs).outputs == tiled
    assert _serve(ContiguousMemory(64, backend="torch", **ms), reqs).outputs == tiled


def test_serve_bench_kv_budget_in_gb_and_bad_options(capsys):
    from iokernels.serving.bench import serve_bench
    res = serve_bench("tiny", requests=2, kv_budget_gb=0.0005, step_time=0.01, device="cpu")
    per_token = 2 * TINY.layers * TINY.kv_heads * TINY.head_dim * 8
    assert res["setup"]["kv_slots"] == int(0.0005e9 // per_token) // 16 * 16
    with pytest.raises(SystemExit):
        cli(["serve-bench", "--kv-slots", "512", "--kv-budget-gb", "1", "--quiet"])
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["serve-bench", "--device", "cpu", "--backend", "tiled", "--quiet"])
    assert "a device memory attends with 'torch', 'cupy'" in capsys.readouterr().err


def test_serve_bench_rows_granule_is_recorded_and_serves_every_request(tmp_path):
    """``--rows-granule 8`` pads each step's model rows on the device memories: the setup says so,
    every request finishes, and paged and contiguous still serve the same tokens (float64, torch
    pools on the CPU; that padded rows reach neither cache nor logits is tested on the model)."""
    runs = {}
    for g in (None, 8):
        out = tmp_path / f"serve{g}.json"
        rc = cli(["serve-bench", "--model", "tiny", "--device", "cpu", "--requests", "6", "--kv-slots", "256",
                  "--step-time", "0.01", "--quiet", "--json", str(out)] + (["--rows-granule", str(g)] if g else []))
        runs[g] = json.loads(out.read_text())
        assert rc == 0 and runs[g]["tokens_equal"] is True
    assert (runs[None]["setup"]["rows_granule"], runs[8]["setup"]["rows_granule"]) == (1, 8)
    for side in ("paged", "contiguous"):
        assert runs[8][side]["finished"] == runs[None][side]["finished"] == 6
    from iokernels.serving.bench import serve_bench
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="rows_granule"):
            serve_bench("tiny", requests=2, device="cpu", rows_granule=bad)


def test_serve_bench_repeats_lists_each_pair():
    """``repeats=3``: three pairs in turn, each pair's tokens/s and ratio listed, the summary
    of the ratios consistent with them, and the first pair still the headline."""
    from iokernels.serving.bench import serve_bench
    res = serve_bench("tiny", requests=4, kv_slots=256, step_time=0.01, device="cpu", repeats=3)
    assert len(res["repeats"]) == 3 and res["setup"]["repeats"] == 3
    first = res["repeats"][0]
    assert first["paged"]["tokens_per_s"] == res["paged"]["tokens_per_s"]
    assert first["contiguous"]["tokens_per_s"] == res["contiguous"]["tokens_per_s"]
    for pair in res["repeats"]:
        assert pair["ratio"] == pytest.approx(pair["paged"]["tokens_per_s"] / pair["contiguous"]["tokens_per_s"])
        assert set(pair["paged"]["phase_median_ms"]) == {"schedule", "model", "sample", "books"}
        assert pair["paged"]["finished"] == pair["contiguous"]["finished"] == 4
    r = res["tokens_per_s_ratio"]
    assert r["each"] == [p["ratio"] for p in res["repeats"]] and r["min"] <= r["median"] <= r["max"]
    assert "repeats" not in serve_bench("tiny", requests=2, kv_slots=256, step_time=0.01, device="cpu")
    for bad in (0, 1.5, False):
        with pytest.raises(ValueError, match="repeats"):
            serve_bench("tiny", requests=2, device="cpu", repeats=bad)


def test_serve_bench_time_limit_compares_what_both_sides_finished():
    from iokernels.serving.bench import serve_bench
    res = serve_bench("tiny", requests=24, kv_slots=512, step_time=0.01, device="cpu", max_seconds=0.05)
    for side in ("paged", "contiguous"):
        assert res[side]["complete"] is False and res[side]["finished"] < 24
        assert set(res[side]["phase_ms"]) == {"schedule", "model", "sample", "books"}
    both = min(res["paged"]["finished"], res["contiguous"]["finished"])
    assert res["requests_compared"] <= both and res["tokens_equal"] is True
    assert set(res["wall_s"]) == {"model", "warm_up", "paged", "contiguous"}
    assert res["setup"]["max_seconds"] == 0.05
    with pytest.raises(ValueError, match="max_seconds"):
        serve_bench("tiny", requests=2, max_seconds=0)


def test_a_block_with_stacked_projections_is_the_block_with_separate_ones():
    """Wq, Wk, Wv stacked in one matrix and W1, W3 in another: a layer computes what it computes
    with the five products apart (the heads split where they should, the gate is W1's), in
    float64 to 1e-12."""
    from iokernels.serving.llama import rms_norm, rotate
    s, p = TINY, MODEL.layers[0]
    n, d, hq, hkv = 6, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    assert p["wqkv"].shape == (hq + 2 * hkv, s.dim) and p["w13"].shape == (2 * s.ffn_dim, s.dim)
    wq, wk, wv = p["wqkv"].split([hq, hkv, hkv])
    w1, w3 = p["w13"].split([s.ffn_dim, s.ffn_dim])
    x = torch.randn(n, s.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    angles = MODEL._angles(torch.arange(3, 3 + n))
    seen = []

    def attend(q, k, v):
        seen.append((q, k, v))
        return q * 2.0                                    # any function of q: the output path is what is checked

    got = MODEL._block(p, x, angles, attend)
    h = rms_norm(x, p["attn_norm"], s.norm_eps)
    q = rotate((h @ wq.T).view(n, s.heads, d), *angles)
    k = rotate((h @ wk.T).view(n, s.kv_heads, d), *angles)
    v = (h @ wv.T).view(n, s.kv_heads, d)
    for a, b in zip(seen[0], (q, k, v)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    x2 = x + (q * 2.0).reshape(n, hq) @ p["wo"].T
    h2 = rms_norm(x2, p["mlp_norm"], s.norm_eps)
    want = x2 + (torch.nn.functional.silu(h2 @ w1.T) * (h2 @ w3.T)) @ p["w2"].T
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_rotate_and_rms_norm_are_the_formulas(dtype):
    """rotate's four operations give the pairs (x1 cos - x2 sin, x2 cos + x1 sin) written out, with
    the same roundings (IEEE products and sums, so equal); rms_norm is x / sqrt(mean(x^2) + eps) * w
    (float64, to 1e-12)."""
    from iokernels.serving.llama import rms_norm, rope_tables, rotate
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 3, 16, generator=g, dtype=torch.float64).to(dtype)
    cos, sin = rope_tables(torch.arange(100, 107), 16, 1e4, dtype, "cpu")
    c, s = cos[..., :8], sin[..., 8:]
    assert torch.equal(cos[..., 8:], c) and torch.equal(sin[..., :8], -s)
    x1, x2 = x[..., :8], x[..., 8:]
    assert torch.equal(rotate(x, cos, sin), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    if dtype == torch.float64:
        w = torch.randn(16, generator=g, dtype=dtype)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        assert torch.allclose(rms_norm(x, w, 1e-5), want, rtol=1e-12, atol=1e-12)


def test_weights_depend_on_the_seed_and_their_place_not_on_the_threads():
    """Each matrix is drawn by a generator of its own: drawn by one thread or four, or with the
    matrices after it left out, it is the same, bit for bit; another seed or place gives other
    values; the values are N(0, std^2), std 1/sqrt(fan-in) unless given."""
    from iokernels.serving.llama import draw_weights
    specs = [("a", (300, 400), None), ("b", (300, 400), None), ("c", (200, 100), 1.0)]
    one = draw_weights(specs, 5, torch.float64, "cpu", workers=1)
    four = draw_weights(specs, 5, torch.float64, "cpu", workers=4)
    first = draw_weights(specs[:1], 5, torch.float64, "cpu")
    assert list(one) == ["a", "b", "c"] and all(torch.equal(one[k], four[k]) for k in one)
    assert torch.equal(first["a"], one["a"])
    assert not torch.equal(one["a"], one["b"])                       # same shape, another place
    assert not torch.equal(draw_weights(specs[:1], 6, torch.float64, "cpu")["a"], one["a"])
    for name, std in (("a", 400 ** -0.5), ("c", 1.0)):
        x = one[name]
        assert abs(float(x.mean())) < 4 * std / x.numel() ** 0.5
        assert abs(float(x.std()) / std - 1) < 0.02
    assert one["c"].dtype == torch.float64
    model = Llama(TINY, seed=3)
    assert torch.equal(model.layers[1]["w2"], Llama(TINY, seed=3).layers[1]["w2"])
