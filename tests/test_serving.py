"""The serving engine: continuous batching, chunked prefill under a budget, preemption by
recomputation, parallel sampling and prefix caching, checked against the block pool's
invariants and against a contiguous run's tokens."""
import numpy as np
import pytest

from iokernels.serving import ContiguousMemory, Engine, PagedMemory, Request, pool_invariants
from iokernels.serving.fake import ChecksumModel

SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]          # a shared system prompt: prefix-cache hits


def random_trace(rng, count, vocab=64, max_prompt=24, max_out=12, rate=2.0):
    t, reqs = 0.0, []
    for i in range(count):
        t += rng.exponential(1 / rate)
        out = int(rng.integers(1, max_out + 1))
        prompt = (SYSTEM if rng.random() < 0.3 else []) + rng.integers(0, vocab, rng.integers(1, max_prompt)).tolist()
        reqs.append(Request(i, prompt, out + int(rng.integers(0, 8)), n=int(rng.choice([1, 1, 1, 2, 3])),
                            temperature=0.0 if rng.random() < 0.3 else 1.0, seed=7, stop_after=out, arrival=t))
    return reqs


def paged(blocks=40, bs=4):
    return PagedMemory(blocks, bs, layers=1, kv_heads=1, head_dim=2)


def contiguous(slots=160):
    return ContiguousMemory(slots, layers=1, kv_heads=1, head_dim=2)


def serve(memory, reqs, check=None, **kw):
    engine = Engine(ChecksumModel(), memory, step_time=1.0, check=check, **kw)
    for r in reqs:
        engine.submit(r)
    return engine, engine.run()


def invariants(engine):
    problems = pool_invariants(engine.memory.caches[0])
    assert not problems, problems
    live = {s.handle for g in engine.running for s in g.live}
    assert live == set(engine.memory.caches[0].seq_ids)           # no sequence leaked, none lost
    assert all(g.live == [s for s in g.seqs if not s.done] for g in engine.running)   # kept up to date
    assert sum(c for _, _, c in engine.results.steps[-1].batch) <= engine.token_budget


def test_thousand_random_requests_with_preemption_match_contiguous():
    reqs = random_trace(np.random.default_rng(2026), 1000)
    pe, rp = serve(paged(), reqs, check=invariants, token_budget=32)
    _, rc = serve(contiguous(), reqs, token_budget=32)
    cache = pe.memory.caches[0]
    assert len(rp.preemptions) > 20 and cache.stats["copy_on_write"] > 20 and cache.stats["prefix_hits"] > 20
    assert rp.outputs == rc.outputs
    for r in reqs:
        assert [len(t) for t in rp.outputs[r.rid]] == [r.stop_after] * r.n
    assert cache.num_free_blocks() == cache.num_blocks and not cache.seq_ids
    assert rp.max_concurrent > rc.max_concurrent
    assert all(p["victim"] in {r.rid for r in reqs} and "needs" in p["reason"] for p in rp.preemptions)


class OneAtATime(Engine):
    """The engine with its one-pass plan switched off: every step through the per-sequence loop."""

    def _everyone_fits(self, todo, needs):
        return False


def records(results):
    return [(s.batch, s.running, s.used_slots, s.allocated_slots, s.free_blocks, s.preempted)
            for s in results.steps]


@pytest.mark.parametrize("memory", [paged, contiguous])
def test_the_one_pass_plan_is_the_per_sequence_loops_plan(memory):
    """Steps where every running chunk fits take the one-pass plan, the others the loop; an engine
    that always loops makes the same steps: batches, preemptions, memory, tokens."""
    reqs = random_trace(np.random.default_rng(11), 300)
    engine = Engine(ChecksumModel(), memory(), step_time=1.0, token_budget=24,
                    check=invariants if memory is paged else None)
    passes = []
    fits = engine._everyone_fits
    engine._everyone_fits = lambda todo, needs: passes.append(fits(todo, needs)) or passes[-1]
    slow = OneAtATime(ChecksumModel(), memory(), step_time=1.0, token_budget=24)
    for r in reqs:
        engine.submit(r)
        slow.submit(r)
    fast_res, slow_res = engine.run(), slow.run()
    taken = sum(passes)
    assert 0 < taken < len(passes) and taken > len(passes) // 4      # both ways, often
    assert records(fast_res) == records(slow_res) and fast_res.outputs == slow_res.outputs
    if memory is paged:
        assert len(slow_res.preemptions) > 10


def test_finished_sequences_leave_and_waiting_ones_join_the_next_step():
    reqs = [Request("a", [1, 2], 2), Request("b", [3, 4], 6), Request("c", [5], 3)]
    _, res = serve(contiguous(), reqs, max_seqs=2)
    batches = [{rid for rid, _, _ in s.batch} for s in res.steps]
    assert batches[0] == {"a", "b"}
    done_a = max(i for i, b in enumerate(batches) if "a" in b)
    assert "c" in batches[done_a + 1] and "b" in batches[done_a + 1]


def test_chunked_prefill_shares_a_step_with_decode_under_the_budget():
    reqs = [Request("short", [1, 2, 3], 10), Request("long", list(range(30)), 2, arrival=2.0)]
    _, res = serve(paged(), reqs, token_budget=9)
    assert all(sum(c for *_, c in s.batch) <= 9 for s in res.steps)
    mixed = [s.batch for s in res.steps if {("short", 0, 1)} <= set(s.batch) and any(r == "long" for r, *_ in s.batch)]
    long_chunks = [c for b in mixed for r, _, c in b if r == "long"]
    assert long_chunks == [8, 8, 8, 6, 1]         # chunks end on blocks; the last one ends the prompt


def test_parallel_samples_share_the_prompt_and_copy_on_write():
    req = Request("p", list(range(10)), 4, n=3, temperature=1.0)
    seen = {}

    def look(engine):
        cache = engine.memory.caches[0]
        if len(cache.seq_ids) == 3 and "ref" not in seen:
            seen["ref"] = [cache.ref_count(b) for b in cache.block_table(cache.seq_ids[0])]
        invariants(engine)

    pe, res = serve(paged(), [req], check=look)
    assert seen["ref"] == [3, 3, 3]               # 10 prompt tokens: blocks 0, 1 full, block 2 partial
    assert pe.memory.caches[0].stats["copy_on_write"] == 2
    assert len({tuple(t) for t in res.outputs["p"]}) > 1


def test_contiguous_reserves_every_samples_maximum_at_admission():
    m = contiguous(100)
    engine = Engine(ChecksumModel(), m, step_time=1.0)
    engine.submit(Request("x", [1, 2, 3], 20, n=2, stop_after=2))
    rec = engine.step()
    assert rec.allocated_slots == 2 * 23 and rec.used_slots == 2 * 3     # the fork copied the prompt


def test_preemption_victim_is_the_newest_and_recomputes():
    reqs = [Request(i, list(range(1, 8)), 12) for i in range(3)]
    pe, res = serve(paged(blocks=10, bs=4), reqs, check=invariants)
    assert res.preemptions and res.preemptions[0]["victim"] == 2
    _, rc = serve(contiguous(), reqs)
    assert res.outputs == rc.outputs


@pytest.mark.parametrize("memory", [paged, contiguous])
def test_bad_requests_raise_and_lose_nothing(memory):
    engine = Engine(ChecksumModel(vocab=64), memory(), step_time=1.0)
    engine.submit(Request("ok", [1, 2], 3))
    before = (list(engine.pending), set(engine._ids))
    with pytest.raises(ValueError, match="prompt: request 'e' has an empty prompt"):
        engine.submit(Request("e", [], 3))
    with pytest.raises(ValueError, match="id 'ok' is already queued"):
        engine.submit(Request("ok", [3], 3))
    with pytest.raises(ValueError, match="can never be served"):
        engine.submit(Request("huge", [1] * 100, 100))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.submit(Request("v", [64], 3))
    with pytest.raises(ValueError, match="257 samples; the engine runs at most max_seqs=256"):
        engine.submit(Request("many", [1], 1, n=257))
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("m", [1], 0)
    with pytest.raises(ValueError, match="stop_after"):
        Request("s", [1], 3, stop_after=4)
    assert (list(engine.pending), set(engine._ids)) == before
    assert engine.run().outputs["ok"][0] and len(engine.results.outputs) == 1


def test_trace_is_seeded_and_sharegpt_shaped():
    from iokernels.serving.trace import SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, sharegpt_like_trace
    a = sharegpt_like_trace(4000, seed=5, max_prompt=10 ** 6, max_new_tokens=10 ** 6, rate=4.0)
    assert a == sharegpt_like_trace(4000, seed=5, max_prompt=10 ** 6, max_new_tokens=10 ** 6, rate=4.0)
    assert np.mean([len(r.prompt) for r in a]) == pytest.approx(SHAREGPT_MEAN_PROMPT, rel=0.08)
    assert np.mean([r.stop_after for r in a]) == pytest.approx(SHAREGPT_MEAN_OUTPUT, rel=0.08)
    gaps = np.diff([0.0] + [r.arrival for r in a])
    assert gaps.mean() == pytest.approx(0.25, rel=0.08) and gaps.std() == pytest.approx(0.25, rel=0.1)


def test_decode_throughput_model():
    from iokernels.serving.lesson import decode_throughput, weights
    assert weights()["total"] == 8_030_261_248          # the parameters Llama-3-8B's shapes add up to
    c = decode_throughput([1, 4, 16, 64, 256])
    assert np.all(np.diff(c["tokens_per_s"]) > 0) and np.all(np.diff(c["kv_fraction"]) > 0)
    assert np.all(c["memory_s"] > c["compute_s"])        # decode stays memory-bound at these batches


def test_step_phases_add_up_and_a_time_limit_stops_between_steps():
    """Each step's wall time is split into schedule / model / sample / books; max_seconds stops the run
    after the step that crosses it, keeping what finished and saying the run is incomplete."""
    reqs = random_trace(np.random.default_rng(5), 40)
    _, whole = serve(paged(), reqs, token_budget=32)
    assert whole.complete and len(whole.outputs) == len(reqs)
    assert all(set(s.phases) == {"schedule", "model", "sample", "books"} for s in whole.steps)
    assert all(min(s.phases.values()) >= 0.0 for s in whole.steps)
    assert whole.busy_s == pytest.approx(sum(sum(s.phases.values()) for s in whole.steps), rel=1e-9)
    ph = whole.summary()["phase_ms"]
    assert ph["model"]["total"] == pytest.approx(1e3 * sum(s.phases["model"] for s in whole.steps))

    class Slow(ChecksumModel):                  # about 2 ms a step: the limit falls after a few steps
        def forward(self, memory, seqs, chunk_lens):
            import time
            time.sleep(0.002)
            return super().forward(memory, seqs, chunk_lens)

    engine = Engine(Slow(), paged(), step_time=1.0, token_budget=32)
    for r in reqs:
        engine.submit(r)
    cut = engine.run(max_seconds=0.02)
    assert not cut.complete and cut.summary()["complete"] is False
    assert 0 < len(cut.steps) < len(whole.steps) and len(cut.outputs) < len(reqs)
    for rid, out in cut.outputs.items():                  # what finished is what the whole run made
        assert out == whole.outputs[rid]
    # throughput counts every drawn token: a whole run's are its outputs; a cut run drew more
    # than its finished requests hold (the ones still running), and fewer than the whole run
    assert whole.generated_tokens == whole.output_tokens
    assert cut.output_tokens < cut.generated_tokens < whole.generated_tokens
    assert cut.summary()["tokens_per_s"] == pytest.approx(cut.generated_tokens / cut.busy_s)
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="max_seconds"):
            Engine(ChecksumModel(), paged()).run(max_seconds=bad)


def test_the_recorded_runs_summarize_with_their_ratios():
    """Notebook 14's view of a recorded serve-bench run: per side the concurrency, tokens/s and
    waste, and the paged / contiguous ratios, computed from the record itself."""
    from iokernels.serving import lesson
    recorded = lesson.recorded_serving()
    if not recorded:
        pytest.skip("no serve_bench*.json record in this checkout")
    for name, rec in recorded.items():
        s = lesson.serving_summary(rec)
        p, c = rec["paged"], rec["contiguous"]
        assert s["paged"]["max_concurrent"] == p["max_concurrent"] and s["gpu"] == rec["setup"]["gpu"]
        assert s["concurrency_ratio"] == round(p["max_concurrent"] / c["max_concurrent"], 2), name
        assert s["tokens_per_s_ratio"] == round(p["tokens_per_s"] / c["tokens_per_s"], 2), name
        pairs = rec.get("repeats")
        if pairs:                                            # served as several pairs in turn
            ratios = [r["paged"]["tokens_per_s"] / r["contiguous"]["tokens_per_s"] for r in pairs]
            spread = s["tokens_per_s_ratio_over_pairs"]
            assert spread["pairs"] == len(pairs) and spread["median"] == round(float(np.median(ratios)), 2), name
            assert (spread["min"], spread["max"]) == (round(min(ratios), 2), round(max(ratios), 2)), name
        else:
            assert "tokens_per_s_ratio_over_pairs" not in s, name
        assert s.get("rows_granule", 1) == rec["setup"].get("rows_granule", 1), name


def test_the_roofline_model_of_a_recorded_run():
    """modelled_serving: each side is decode_throughput at its batch and the context its written
    slots give, on the record's GPU's datasheet figures and its layer count; the ratios at scale 1
    agree with the sides; the budget's ratio falls once the paged batch is compute-bound; the
    measured ratio is a repeated run's median; a GPU without a datasheet entry gives None."""
    from iokernels.serving import lesson
    from iokernels.serving.llama import llama3_8b_shape
    assert lesson.compute_bound_batch("H100 SXM") == pytest.approx(989.4 / 3.35, rel=1e-3)   # datasheet figures
    assert lesson.compute_bound_batch("H200") < lesson.compute_bound_batch("H100 SXM")        # same FLOP/s, faster HBM
    assert [lesson.datasheet_gpu(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                               "NVIDIA A10", None)] == ["H200", "H100 SXM", "H100 PCIe", None, None]
    rec = dict(setup=dict(gpu="NVIDIA H200", model="llama3-8b-shape (32 layers)", kv_slots=100_000),
               paged=dict(max_concurrent=800, waste_fraction=0.02, tokens_per_s=9000.0),
               contiguous=dict(max_concurrent=100, waste_fraction=0.7, tokens_per_s=4000.0),
               tokens_per_s_ratio=dict(median=2.2))
    m = lesson.modelled_serving(rec)
    assert (m["gpu"], m["layers"], m["measured_ratio"]) == ("H200", 32, 2.2)
    for side, batch, context in (("paged", 800, 100_000 * 0.98 / 800), ("contiguous", 100, 100_000 * 0.3 / 100)):
        ref = lesson.decode_throughput([batch], context=context, shape=llama3_8b_shape(32), gpu="H200")
        got = m[side]
        assert got["context"] == round(context, 1)
        assert got["modelled_tokens_per_s"] == pytest.approx(ref["tokens_per_s"][0], abs=0.05)
        assert got["bound"] == ("compute" if ref["compute_s"][0] > ref["memory_s"][0] else "memory")
        assert got["fraction_of_modelled"] == round(rec[side]["tokens_per_s"] / ref["tokens_per_s"][0], 3)
    assert (m["paged"]["bound"], m["contiguous"]["bound"]) == ("compute", "memory")
    one = m["paged"]["modelled_tokens_per_s"] / m["contiguous"]["modelled_tokens_per_s"]
    assert m["modelled_ratio"][1.0] == m["modelled_ratio_by_budget"][1.0] == pytest.approx(one, abs=0.006)
    by_budget = [m["modelled_ratio_by_budget"][b] for b in (0.25, 0.5, 1.0, 2.0)]
    assert by_budget == sorted(by_budget, reverse=True) and by_budget[0] > 2 * by_budget[-1]
    del rec["tokens_per_s_ratio"]
    assert lesson.modelled_serving(rec)["measured_ratio"] == 2.25
    rec["setup"]["gpu"] = "NVIDIA A10"
    assert lesson.modelled_serving(rec) is None


def test_every_recorded_run_stays_under_its_roofline():
    """The roofline model is an upper bound: on every recorded GPU run both sides served fewer
    tokens/s than the model allows them at their batch and context."""
    from iokernels.serving import lesson
    recorded = {n: lesson.modelled_serving(r) for n, r in lesson.recorded_serving().items()}
    recorded = {n: m for n, m in recorded.items() if m is not None}
    if not recorded:
        pytest.skip("no serve_bench*.json record of a GPU with a datasheet entry in this checkout")
    for name, m in recorded.items():
        for side in ("paged", "contiguous"):
            assert 0 < m[side]["fraction_of_modelled"] < 1, (name, side)


def test_admission_leaves_the_watermark_free_while_others_run():
    """A paged memory keeps WATERMARK of its blocks free for the running sequences' growth: a
    request that would dip into them waits; with nothing running the head of the line is admitted."""
    mem = PagedMemory(200, 4, layers=1, kv_heads=1, head_dim=2)
    assert mem.watermark_blocks == 2 and ContiguousMemory(800, layers=1, kv_heads=1, head_dim=2).watermark_blocks == 0
    engine = Engine(ChecksumModel(), mem, token_budget=10_000, max_seqs=1000, step_time=1.0)
    engine.submit(Request("big", [1] * (199 * 4), 1))        # 199 of the 200 blocks, admitted alone
    engine.submit(Request("small", [2] * 4, 1))              # one block: 1 free, but 2 are kept
    first = engine.step()
    assert [b[0] for b in first.batch] == ["big"] and not first.preempted
    fresh = Engine(ChecksumModel(), PagedMemory(200, 4, layers=1, kv_heads=1, head_dim=2), token_budget=10_000,
                   max_seqs=1000, step_time=1.0)
    fresh.memory.WATERMARK = 0.0                               # without the watermark it would have joined
    for r in (Request("big", [1] * (199 * 4), 1), Request("small", [2] * 4, 1)):
        fresh.submit(r)
    assert [b[0] for b in fresh.step().batch] == ["big", "small"]


def test_usage_counts_each_live_block_once_at_its_fullest():
    """PagedMemory.usage against a block-by-block count, at every step of a run with forks (shared
    blocks), prefix hits and preemptions."""
    def by_block(cache, bs):
        filled = {}
        for sid in cache.seq_ids:
            n = cache.seq_len(sid)
            for j, b in enumerate(cache.block_table(sid)):
                filled[b] = max(filled.get(b, 0), min(bs, n - j * bs))
        return sum(filled.values()), len(filled) * bs

    seen = []

    def check(engine):
        want = by_block(engine.memory.caches[0], engine.memory.block_size)
        assert engine.memory.usage() == want
        seen.append(want)

    engine = Engine(ChecksumModel(), paged(), token_budget=32, step_time=1.0, check=check)
    for r in random_trace(np.random.default_rng(11), 150):
        engine.submit(r)
    res = engine.run()
    assert res.preemptions and max(u for u, _ in seen) > 0 and any(u < a for u, a in seen)
    assert engine.memory.caches[0].stats["copy_on_write"] > 0
