"""The device-resident memories on device="cpu" (torch pools): the NumPy memories' tokens, the
block pool's invariants, copy-on-write and the prefix cache on the device pools, the same errors."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from iokernels.paged import PagedKVCache
from iokernels.serving import ContiguousMemory, Engine, PagedMemory, Request, pool_invariants
from iokernels.serving.device import (DECODE_ROWS_GRANULE, DeviceContiguousMemory, DevicePagedMemory, SlotMap,
                                      StepPlan, cupy_paged_prefill)
from iokernels.serving.fake import ChecksumModel
from iokernels.serving.llama import TINY, Llama
from iokernels.serving.requests import Group

from test_serving import random_trace

MODEL = Llama(TINY, seed=3)


def serve(model, memory, reqs, check=None, **kw):
    engine = Engine(model, memory, step_time=1.0, check=check, **kw)
    for r in reqs:
        engine.submit(r)
    return engine, engine.run()


def invariants(engine):
    cache = engine.memory.caches[0]
    problems = pool_invariants(cache)
    assert not problems, problems
    assert {s.handle for g in engine.running for s in g.live} == set(cache.seq_ids)


def checksum_paged(blocks=40, bs=4):
    return DevicePagedMemory(blocks, bs, layers=1, kv_heads=1, head_dim=2)


def test_checksum_trace_with_preemption_matches_the_numpy_memories():
    reqs = random_trace(np.random.default_rng(2026), 400)
    pe, rp = serve(ChecksumModel(), checksum_paged(), reqs, check=invariants, token_budget=32)
    _, rh = serve(ChecksumModel(), PagedMemory(40, 4, layers=1, kv_heads=1, head_dim=2), reqs, token_budget=32)
    _, rc = serve(ChecksumModel(), DeviceContiguousMemory(160, block_size=4, layers=1, kv_heads=1, head_dim=2),
                  reqs, token_budget=32)
    cache = pe.memory.cache
    assert len(rp.preemptions) > 10 and cache.stats["copy_on_write"] > 10 and cache.stats["prefix_hits"] > 10
    assert rp.outputs == rh.outputs == rc.outputs
    assert [s.batch for s in rp.steps] == [s.batch for s in rh.steps]      # the same schedule, step by step
    assert cache.num_free_blocks() == cache.num_blocks and not cache.seq_ids


def _reqs(seed=0, lens=(3, 17, 9, 26, 5)):
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(0, TINY.vocab, int(n)).tolist(), 7, arrival=0.5 * i,
                    n=2 if n < 20 and i % 2 else 1, temperature=0.7 if i % 2 else 0.0)
            for i, n in enumerate(lens)]


@pytest.mark.parametrize("token_budget", [12, 64])
def test_llama_tokens_equal_numpy_paged_and_contiguous(token_budget):
    """float64: device paged == NumPy paged == device contiguous == NumPy contiguous, with preemption."""
    reqs, ms = _reqs(), MODEL.memory_shape()
    runs = [serve(MODEL, m, reqs, token_budget=token_budget)[1] for m in
            (DevicePagedMemory(14, 4, **ms), PagedMemory(14, 4, **ms),
             DeviceContiguousMemory(96, block_size=4, **ms), ContiguousMemory(96, **ms))]
    assert runs[0].preemptions or token_budget > 12
    assert runs[0].outputs == runs[1].outputs == runs[2].outputs == runs[3].outputs
    assert runs[0].outputs[0][0] == MODEL.reference_greedy(reqs[0].prompt, 7)


def test_chunked_logits_match_the_cache_free_model():
    tokens = list(range(40, 63))
    for mem in (DevicePagedMemory(10, 4, **MODEL.memory_shape()),
                DeviceContiguousMemory(32, block_size=4, **MODEL.memory_shape())):
        group = Group(Request("x", tokens, 1), 0)
        seq = group.seqs[0]
        assert mem.admit(group)
        mem.start(seq)
        logits = []
        for c in (5, 1, 7, 10):                                   # chunks and a one-query step
            logits.append(MODEL.forward(mem, [seq], [c])[0].numpy())
            seq.computed += c
        want = MODEL.reference_logits(tokens)[[4, 5, 12, 22]]
        assert np.max(np.abs(np.stack(logits) - want)) <= 1e-12 * max(1.0, np.abs(want).max())


def test_copy_on_write_copies_every_layers_block_on_the_device():
    mem = DevicePagedMemory(8, 4, layers=2, kv_heads=1, head_dim=2)
    group = Group(Request("p", [1, 2, 3, 4, 5, 6], 3, n=2), 0)
    parent = group.seqs[0]
    mem.start(parent)
    rows = np.arange(12, dtype=np.float64).reshape(6, 1, 2)
    for layer in (0, 1):
        mem.write(layer, parent, rows + 100 * layer, -rows, [1, 2, 3, 4, 5, 6])
    child = Group(Request("c", [1], 1), 1).seqs[0]
    mem.fork(parent, child)
    assert mem.cache.ref_count(mem.cache.block_table(parent.handle)[1]) == 2
    new = np.full((1, 1, 2), 7.0)
    for layer in (0, 1):
        mem.write(layer, child, new, new, [9])                     # the shared, partial block is copied first
    assert mem.cache.stats["copy_on_write"] == 1
    for layer in (0, 1):
        kp, _ = mem.read(layer, parent)
        kc, vc = mem.read(layer, child)
        assert torch.equal(kc[:6], kp) and torch.equal(kc[6], torch.full((1, 2), 7.0, dtype=torch.float64))
        assert torch.equal(kp[:, 0], torch.from_numpy(rows[:, 0] + 100 * layer))
    assert not pool_invariants(mem.cache)


def test_prefix_hits_are_not_written_again():
    mem = DevicePagedMemory(8, 4, layers=1, kv_heads=1, head_dim=2)
    a, b = (Group(Request(r, list(range(1, 9)), 1), i).seqs[0] for i, r in enumerate("ab"))
    mem.start(a)
    mem.start(b)
    plan = mem.prepare([a], [8], [list(range(1, 9))])
    assert isinstance(plan, StepPlan) and plan.slots.tolist() == list(range(8))
    assert plan.rows is None                                      # every row stored, in order: no gather
    plan = mem.prepare([b], [8], [list(range(1, 9))])             # both full blocks hit the prefix cache
    assert len(plan.slots) == 0 and plan.rows is not None and len(plan.rows) == 0
    assert mem.cache.stats["prefix_hits"] == 2
    assert mem.cache.block_table(b.handle) == mem.cache.block_table(a.handle)


def test_slot_map_keeps_the_books_of_a_paged_cache():
    k = torch.zeros(1, 4, 2, 1, 1)
    sm = SlotMap(4, 2, k, k.clone())
    sid = sm.new_sequence()
    rows, slots = sm.place(sid, 3)
    assert rows.tolist() == [0, 1, 2] and slots.tolist() == [0, 1, 2] and sm.block_table(sid) == [0, 1]
    rows, slots = sm.place(sid, 2)
    assert rows.tolist() == [0, 1] and slots.tolist() == [3, 4] and sm.seq_len(sid) == 5
    assert not pool_invariants(sm)


def _books(sm):
    return (sm._tables, sm._lens, sm._keys, sm._tail_ids, list(sm._free), sm._ref.tolist(),
            dict(sm._block_of_key), dict(sm.stats))


def test_one_token_fast_path_keeps_the_books_append_keeps():
    """SlotMap.place's one-token path (into the sequence's own last block, keying it when the token
    fills it, or into a fresh block) against the general append, over random appends, forks
    (shared last blocks), frees and repeated prompts (prefix hits)."""
    rng = np.random.default_rng(7)
    k = torch.zeros(1, 64, 8, 1, 1)
    fast, slow = SlotMap(64, 8, k, k.clone()), SlotMap(64, 8, k, k.clone())
    slow.one_into_tail = lambda sid, token_ids: None              # always the general path
    taken, fills, one = [], set(), fast.one_into_tail

    def counted(sid, token_ids):
        fill = fast.seq_len(sid) % fast.block_size
        slot = one(sid, token_ids)
        taken.append(slot is not None)
        if slot is not None:
            fills.add(fill)
        return slot
    fast.one_into_tail = counted
    for _ in range(3000):
        live = fast.seq_ids
        op = rng.integers(0, 20)
        if (op == 0 or not live) and fast.num_free_blocks() > 4:   # a new sequence with a shared prompt
            sid = fast.new_sequence()
            assert slow.new_sequence() == sid
            prompt = [1, 2, 0, 1, 2, 0, 1, 2, 2, 1][:int(rng.integers(8, 11))]
            got, want = fast.place(sid, len(prompt), prompt), slow.place(sid, len(prompt), prompt)
            assert [x.tolist() for x in got] == [x.tolist() for x in want]
        elif op == 1:
            sid = int(rng.choice(live))
            assert fast.fork(sid) == slow.fork(sid)
        elif op == 2 and len(live) > 3:
            sid = int(rng.choice(live))
            fast.free(sid)
            slow.free(sid)
        else:
            sid, n = int(rng.choice(live)), int(rng.choice([1, 1, 1, 1, 2, 5]))
            ids = [int(t) for t in rng.integers(0, 3, n)]              # a small vocabulary: prefix hits
            if fast.num_free_blocks() < 3:
                continue
            got, want = fast.place(sid, n, ids), slow.place(sid, n, ids)
            assert [x.tolist() for x in got] == [x.tolist() for x in want]
        assert _books(fast) == _books(slow)
        assert not pool_invariants(fast)
    assert sum(taken) > 300 and not all(taken)                     # both paths ran, often
    assert fills == set(range(8))              # a fresh block (0), a block filled and keyed (7), the rest
    assert fast.stats["prefix_hits"] > 0 and fast.stats["copy_on_write"] > 0
    sid = fast.seq_ids[0]
    assert one(sid, [True]) is None and one(sid, [1.5]) is None and one(sid, None) is None   # left to append


PROMPT = [1, 2, 0, 1, 2, 0, 1, 2, 2, 1]


def _rows_agree(mem):
    """A SlotMap's rows against its lists, and the memory's batch answers against one at a time."""
    sm = mem.cache
    sids = sm.seq_ids
    for sid in sids:
        table, row = sm.block_table(sid), sm._row[sid]
        assert sm.table_rows[row, :len(table)].tolist() == table and (sm.table_rows[row, len(table):] == -1).all()
        assert sm.row_lens[row] == sm.seq_len(sid)
    got, want = sm.block_tables_array(sids), PagedKVCache.block_tables_array(sm, sids)
    assert all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))
    seqs = [SimpleNamespace(handle=sid) for sid in sids]
    for t in (1, 3, 8):
        assert mem.growths(seqs, [t] * len(seqs)) == [PagedMemory.growth(mem, s, t) for s in seqs]
    assert mem.usage() == PagedMemory.usage(mem)


def test_a_steps_placement_and_the_rows_keep_the_books_of_one_chunk_at_a_time():
    """SlotMap.place_step (its quiet decodes placed together, the rest in order) against place one
    chunk at a time, over random steps of mixed chunks, forks (shared last blocks), frees and
    repeated prompts (prefix hits); the rows mirror the tables through all of it, and the memory's
    batch questions (growths, usage) answer what the one-at-a-time ones do."""
    rng = np.random.default_rng(5)
    mems = [DevicePagedMemory(128, 8, layers=1, kv_heads=1, head_dim=1) for _ in range(2)]
    batch, one = (m.cache for m in mems)
    quiet = 0
    for _ in range(400):
        live, op = batch.seq_ids, rng.integers(0, 12)
        if (op == 0 or len(live) < 3) and batch.num_free_blocks() > 12:
            assert batch.new_sequence() == one.new_sequence()
        elif op == 1 and live:
            sid = int(rng.choice(live))
            assert batch.fork(sid) == one.fork(sid)
        elif (op == 2 or batch.num_free_blocks() < 3 * len(live) + 12) and len(live) > 2:
            sid = int(rng.choice(live))
            batch.free(sid)
            one.free(sid)
        elif live:
            sids = [int(x) for x in rng.permutation(live)[:int(rng.integers(1, len(live) + 1))]]
            chunks = [int(rng.choice([1, 1, 1, 1, 2, 8, 11])) if batch.seq_len(s) else 10 for s in sids]
            ids = [[int(t) for t in rng.integers(0, 2, c)] if batch.seq_len(s) else PROMPT  # prefix hits
                   for s, c in zip(sids, chunks)]
            n = batch.row_lens[batch._rows_of(sids)]
            quiet += sum(c == 1 and 0 < x % 8 < 7 for c, x in zip(chunks, n))
            rows, slots = batch.place_step(sids, chunks, ids)
            at = np.cumsum([0] + chunks)
            want = [one.place(s, c, t) for s, c, t in zip(sids, chunks, ids)]
            assert rows.tolist() == [int(r) + at[i] for i, (rs, _) in enumerate(want) for r in rs]
            assert slots.tolist() == [int(x) for _, sl in want for x in sl]
        assert _books(batch) == _books(one)
        assert not pool_invariants(batch)
        _rows_agree(mems[0])
    assert quiet > 300 and batch.stats["prefix_hits"] > 20 and batch.stats["copy_on_write"] > 10


@pytest.mark.parametrize("memory", [lambda: checksum_paged(),
                                    lambda: DeviceContiguousMemory(160, block_size=4, layers=1, kv_heads=1,
                                                                   head_dim=2)])
def test_bad_requests_raise_the_same_errors(memory):
    engine = Engine(ChecksumModel(vocab=64), memory(), step_time=1.0)
    engine.submit(Request("ok", [1, 2], 3))
    with pytest.raises(ValueError, match="can never be served"):
        engine.submit(Request("huge", [1] * 100, 100))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.submit(Request("v", [64], 3))
    with pytest.raises(ValueError, match="id 'ok' is already queued"):
        engine.submit(Request("ok", [3], 3))
    assert engine.run().outputs["ok"][0]


def test_bad_memories_raise():
    with pytest.raises(ValueError, match="a device memory attends with 'torch', 'cupy'; got 'tiled'"):
        DevicePagedMemory(4, 4, layers=1, kv_heads=1, head_dim=2, backend="tiled")
    with pytest.raises(ValueError, match="dtype"):
        DevicePagedMemory(4, 4, layers=1, kv_heads=1, head_dim=2, dtype="int8")
    with pytest.raises(ValueError, match="whole number of blocks"):
        DeviceContiguousMemory(10, block_size=4, layers=1, kv_heads=1, head_dim=2)
    if cupy_paged_prefill() is None:
        with pytest.raises(ValueError, match="paged_prefill_pools"):
            DevicePagedMemory(4, 4, layers=1, kv_heads=1, head_dim=2, backend="cupy")


# --------------------------------------------------------------------------- low precision: the 2x rule
def upcast(model):
    """The same model with its (rounded) weights in float64: the oracle of a low-precision model."""
    ref = Llama(model.shape, dtype=torch.float64, device=model.device)
    ref.embed, ref.norm, ref.lm_head = (x.double() for x in (model.embed, model.norm, model.lm_head))
    ref.layers = [{k: w.double() for k, w in p.items()} for p in model.layers]
    return ref


class Recorder:
    """A model that remembers, per step, each sequence's tokens up to its chunk's end and the logits."""

    def __init__(self, model):
        self.model, self.vocab, self.rows = model, model.vocab, []

    def forward(self, memory, seqs, chunk_lens):
        logits = self.model.forward(memory, seqs, chunk_lens)
        for s, c, row in zip(seqs, chunk_lens, logits.double().cpu().numpy()):
            self.rows.append((tuple(s.tokens[:s.computed + c]), row))
        return logits


def step_logits_against_reference(model, memory, reqs, token_budget=24):
    """(engine's logits, float64 oracle's, the same-precision cache-free model's) for every row of every step."""
    rec = Recorder(model)
    serve(rec, memory, reqs, token_budget=token_budget)
    oracle = upcast(model)
    got = np.stack([row for _, row in rec.rows])
    ref = np.stack([oracle.reference_logits(t)[-1] for t, _ in rec.rows])
    base = np.stack([model.reference_logits(t)[-1] for t, _ in rec.rows])
    return got, ref, base


def low_precision_requests():
    rng = np.random.default_rng(5)
    return [Request(i, rng.integers(0, TINY.vocab, int(n)).tolist(), 6, arrival=0.3 * i)
            for i, n in enumerate([3, 30, 9, 17, 1])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_step_logits_within_the_2x_rule_on_cpu(dtype):
    """Chunked prefill, decodes batched and preemption, paged and contiguous, against the float64 oracle."""
    from iokernels.core.testing import check
    model = Llama(TINY, seed=4, dtype=dtype)
    for mem in (DevicePagedMemory(20, 4, **model.memory_shape()),
                DeviceContiguousMemory(128, block_size=4, **model.memory_shape())):
        got, ref, base = step_logits_against_reference(model, mem, low_precision_requests())
        c = check(got, ref, base, dtype=str(dtype).replace("torch.", ""), name=type(mem).__name__)
        assert c.ok, str(c)


def test_the_books_are_done_once_a_step_not_once_a_layer():
    mem = DevicePagedMemory(16, 4, **MODEL.memory_shape())
    calls = {"prepare": 0, "write": 0}
    prepare = mem.prepare

    def counted(*a):
        calls["prepare"] += 1
        return prepare(*a)

    def write(*a):
        calls["write"] += 1

    mem.prepare, mem.write = counted, write
    _, res = serve(MODEL, mem, _reqs()[:3], token_budget=12)
    assert calls == {"prepare": len(res.steps), "write": 0} and MODEL.shape.layers > 1


def test_sample_tokens_draws_what_sample_token_draws_from_numpy_and_torch():
    from iokernels.serving.requests import sample_token, sample_tokens
    logits = np.random.default_rng(0).standard_normal((5, 40))
    reqs = [Request(i, [1], 3, temperature=t, seed=2) for i, t in enumerate([0.0, 0.8, 0.0, 1.5, 0.3])]
    draws = [(i, r, s, 7) for i, r in enumerate(reqs) for s in range(2)]
    want = [sample_token(logits[i], r, s, p) for i, r, s, p in draws]
    assert sample_tokens(logits, draws) == want == sample_tokens(torch.from_numpy(logits), draws)
    assert sample_tokens(logits, []) == []


def test_a_host_memorys_attend_is_refused_with_the_device_call_named():
    with pytest.raises(TypeError, match="write_attend"):
        checksum_paged().attend(0, None, [], [])


def test_decode_buckets_pad_a_group_at_most_twice_and_cover_each_sequence_once():
    from iokernels.serving.device import DECODE_BUCKET_MIN, decode_buckets
    lens = np.array([1, 5, DECODE_BUCKET_MIN, DECODE_BUCKET_MIN + 1, 700, 1024, 1025, 4000, 3])
    groups = decode_buckets(lens)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lens)))
    assert [int(lens[g].max()) for g in groups] == sorted(int(lens[g].max()) for g in groups)   # shortest first
    for g in groups:
        longest = lens[g].max()
        assert longest <= DECODE_BUCKET_MIN or longest < 2 * lens[g].min()
    assert len(decode_buckets(np.full(5, 3))) == 1


def test_decodes_of_mixed_lengths_in_several_groups_give_the_same_tokens(monkeypatch):
    """Groups as small as 4 keys, so this short trace's decodes fall into several groups a step."""
    import iokernels.serving.device as dev
    monkeypatch.setattr(dev, "DECODE_BUCKET_MIN", 4)
    reqs, ms = _reqs(), MODEL.memory_shape()
    lens = [len(r.prompt) for r in reqs]
    assert len(dev.decode_buckets(lens)) > 1
    groups, attend = [], dev._attend_torch
    monkeypatch.setattr(dev, "_attend_torch", lambda q, k, v, plan: groups.append(len(plan.decode)) or
                        attend(q, k, v, plan))
    paged_dev = serve(MODEL, DevicePagedMemory(14, 4, **ms), reqs, token_budget=64)[1]
    assert max(groups) > 1                                    # some step attended in several groups
    paged_np = serve(MODEL, PagedMemory(14, 4, **ms), reqs, token_budget=64)[1]
    assert paged_dev.outputs == paged_np.outputs


def _stand_in_kernels(monkeypatch, seen=None):
    """The CuPy paged prefill and paged decode as torch loops with their signatures (exact in float64)."""
    import iokernels.serving.device as dev

    def keys(pool, table, n):
        return pool[table.long()].reshape(-1, *pool.shape[2:])[:n]       # (n, Hkv, d) through the table

    def attend(q, k, v, visible):                                        # q (r, Hq, d); rows see keys < visible
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("rhd,nhd->rhn", q, k) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] >= visible[:, None, None], float("-inf"))
        return torch.einsum("rhn,nhd->rhd", torch.softmax(s, dim=-1), v)

    def prefill(q, k_pool, v_pool, tables, lens, cu, *, causal, max_seqlen_q=None):
        if seen is not None:
            seen.append(("prefill", int(cu[-1]), max_seqlen_q))
        o = torch.empty_like(q)
        for i in range(len(lens)):
            q0, q1, n = int(cu[i]), int(cu[i + 1]), int(lens[i])
            visible = torch.arange(1, q1 - q0 + 1) + (n - (q1 - q0))          # bottom-right causal
            o[q0:q1] = attend(q[q0:q1], keys(k_pool, tables[i], n), keys(v_pool, tables[i], n), visible)
        return o, None

    def decode(q, k_pool, v_pool, tables, lens):
        if seen is not None:
            seen.append(("decode", q.shape[0], None))
        n = [int(x) for x in lens]
        return torch.cat([attend(q[b:b + 1], keys(k_pool, tables[b], n[b]), keys(v_pool, tables[b], n[b]),
                                 torch.tensor([n[b]])) for b in range(q.shape[0])]), None
    monkeypatch.setattr(dev, "cupy_paged_prefill", lambda: prefill)
    monkeypatch.setattr(dev, "cupy_paged_decode", lambda: decode)


def test_the_kernels_take_the_decodes_and_the_chunks_apart(monkeypatch):
    """The CuPy path: one-query chunks in one paged decode, longer chunks in one paged prefill whose
    grid the longest of them sizes (max_seqlen_q), so a step of a long chunk and many decodes is
    not launched as a grid of that chunk's tiles for every sequence."""
    seen = []
    _stand_in_kernels(monkeypatch, seen)
    mem = DevicePagedMemory(16, 4, layers=1, kv_heads=1, head_dim=2, backend="cupy")
    groups = [Group(Request(i, list(range(1, n + 1)), 4), i) for i, n in enumerate([20, 1, 33])]
    for g in groups:
        assert mem.admit(g)
        mem.start(g.seqs[0])
    seqs = [g.seqs[0] for g in groups]
    for chunks in ([20, 1, 33], [1, 1, 1], [2, 3, 2]):
        plan = mem.prepare(seqs, chunks, [list(range(1, c + 1)) for c in chunks])
        n = sum(chunks)
        mem.write_attend(0, plan, *(torch.rand(n, 1, 2, dtype=torch.float64) for _ in range(3)))
        for s, c in zip(seqs, chunks):
            s.computed += c
    # the decodes' batch is padded to DECODE_ROWS_GRANULE rows (1 and 3 real ones: _padded_decodes)
    assert seen == [("decode", DECODE_ROWS_GRANULE, None), ("prefill", 53, 33), ("decode", DECODE_ROWS_GRANULE, None),
                    ("prefill", 7, 3)]


@pytest.mark.parametrize("token_budget", [12, 64])
def test_the_kernel_path_gives_the_torch_paths_tokens(monkeypatch, token_budget):
    """float64, with exact stand-ins for the two kernels: the CuPy path's split of each step
    (decodes, chunks) serves the tokens the torch reference serves, paged and contiguous."""
    _stand_in_kernels(monkeypatch)
    reqs, ms = _reqs(), MODEL.memory_shape()
    runs = [serve(MODEL, m, reqs, token_budget=token_budget)[1] for m in
            (DevicePagedMemory(14, 4, backend="cupy", **ms), DevicePagedMemory(14, 4, **ms),
             DeviceContiguousMemory(96, block_size=4, backend="cupy", **ms))]
    mixed = [s for s in runs[0].steps if any(c == 1 for *_, c in s.batch) and any(c > 1 for *_, c in s.batch)]
    assert mixed and runs[0].outputs == runs[1].outputs == runs[2].outputs


def test_a_steps_decodes_are_padded_to_shapes_that_repeat():
    """The CuPy decode's batch: rows to a multiple of DECODE_ROWS_GRANULE, tables to a power-of-two
    width; the step's rows, tables and lengths unchanged, padding rows of length 0 (they read no
    key) and padding columns that name a block of the row's own."""
    from iokernels.serving.device import _padded_decodes
    rng = np.random.default_rng(0)
    for n, width in ((1, 1), (3, 5), (DECODE_ROWS_GRANULE, 8), (DECODE_ROWS_GRANULE + 1, 9)):
        q_rows = rng.integers(0, 1000, n)
        tables = rng.integers(0, 50, (n, width)).astype(np.int32)
        lens = rng.integers(1, 4 * width + 1, n).astype(np.int32)
        rows, padded, plens = _padded_decodes(q_rows, tables, lens)
        R, W = padded.shape
        assert R % DECODE_ROWS_GRANULE == 0 and R - DECODE_ROWS_GRANULE < n <= R
        assert W >= width and W & (W - 1) == 0 and W < 2 * width + (width == 1)
        assert np.array_equal(rows[:n], q_rows) and np.array_equal(padded[:n, :width], tables)
        assert np.array_equal(plens[:n], lens) and not plens[n:].any() and not rows[n:].any()
        assert np.array_equal(padded[:n, width:], np.repeat(tables[:, :1], W - width, axis=1))
    # the shapes of a growing, changing batch repeat: one plan serves many steps
    shapes = {_padded_decodes(np.arange(n), np.zeros((n, w), np.int32), np.ones(n, np.int32))[1].shape
              for n, w in zip(range(800, 877), range(100, 177))}
    assert len(shapes) <= 4


def test_padded_rows_reach_neither_the_cache_nor_the_logits():
    """A step's rows padded to a granule (the model's matrix products then see few row counts) give
    the unpadded step's logits and leave the same cache behind, in float64 to the oracle's 1e-12."""
    from iokernels.serving.llama import padded_rows
    assert padded_rows(np.arange(3), 4).tolist() == [0, 1, 2, 0]
    assert len(padded_rows(np.arange(8), 4)) == 8 and len(padded_rows(np.arange(0), 4)) == 4
    reqs, ms = _reqs(lens=(3, 17, 9)), MODEL.memory_shape()
    runs = []
    for granule in (1, 5, 64):
        model = Llama(TINY, seed=3)
        model.rows_granule = granule
        mem = DevicePagedMemory(40, 4, **ms)
        seqs, chunks = [], []
        for r in reqs:
            group = Group(Request(r.rid, r.prompt, 1), 0)
            assert mem.admit(group)
            mem.start(group.seqs[0])
            seqs.append(group.seqs[0])
            chunks.append(len(r.prompt) - 1)
        first = model.forward(mem, seqs, chunks)
        for s, c in zip(seqs, chunks):
            s.computed += c
        second = model.forward(mem, seqs, [1] * len(seqs))                  # decodes read the cache
        assert first.shape == second.shape == (len(seqs), TINY.vocab)
        runs.append((first.numpy(), second.numpy(), mem.k_pools.clone(), mem.v_pools.clone()))
    for first, second, k, v in runs[1:]:
        assert np.max(np.abs(first - runs[0][0])) <= 1e-12 * np.abs(runs[0][0]).max()
        assert np.max(np.abs(second - runs[0][1])) <= 1e-12 * np.abs(runs[0][1]).max()
        for got, want in ((k, runs[0][2]), (v, runs[0][3])):        # unwritten slots hold NaN: the same ones
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=0, equal_nan=True)
