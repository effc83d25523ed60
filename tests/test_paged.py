"""PagedKVCache: a state machine against a dense model, copy-on-write, prefix caching,
errors that change nothing, the NaN-in-padding hazard, gather traffic, the calculators."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import iokernels as ik
from iokernels import paged, traffic
from iokernels.paged import OutOfBlocks, PagedKVCache

HKV, D = 2, 3


def rows(rng, n, hkv=HKV, d=D, dtype=np.float64):
    return rng.standard_normal((n, hkv, d)).astype(dtype), rng.standard_normal((n, hkv, d)).astype(dtype)


# --------------------------------------------------------------------------- the state machine
STEPS = {"count": 0}
#: a common "system prompt": drawn often, so prefix-cache hits happen in the random runs
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]


class CacheMachine(RuleBasedStateMachine):
    """Random new / append (with and without token ids) / fork / free against a dense model.

    The dense model keeps each sequence's K and V rows as plain lists.  Rows of tokens
    appended with ids depend only on the ids of the whole prefix (a deterministic model),
    so prefix-cache hits must return exactly the rows the dense model expects.
    """

    NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS = 20, 4, 6
    #: the cache's dtype and storage (subclasses run the same machine on 16-bit and 1-byte caches)
    DTYPE, KV_DTYPE, GRANULARITY = "float64", None, "block_head"

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(1234)
        self.cache = PagedKVCache(self.NUM_BLOCKS, self.BLOCK_SIZE, num_kv_heads=HKV, head_dim=D,
                                  dtype=self.DTYPE, kv_dtype=self.KV_DTYPE, scale_granularity=self.GRANULARITY)
        self.dense = {}        # sid -> (ids list or None, k rows list, v rows list)
        self.by_prefix = {}    # tuple of ids -> (k row, v row)

    def _live(self, i):
        live = sorted(self.dense)
        return live[-1] if i is None else live[i % len(live)]     # None: the newest

    def _row_for(self, prefix):
        if prefix not in self.by_prefix:
            k, v = rows(self.rng, 1, dtype=self.cache.dtype)
            self.by_prefix[prefix] = (k[0], v[0])
        return self.by_prefix[prefix]

    @precondition(lambda self: len(self.dense) < self.MAX_SEQS)
    @rule()
    def new(self):
        STEPS["count"] += 1
        sid = self.cache.new_sequence()
        assert sid not in self.dense
        self.dense[sid] = ([], [], [])

    @precondition(lambda self: len(self.dense) < self.MAX_SEQS)
    @rule(n=st.integers(1, 9))
    def new_with_prompt(self, n):
        """A new request that starts with the common prompt (where prefix hits come from)."""
        self.new()
        self.append(None, n, True, PROMPT)

    @precondition(lambda self: self.dense)
    @rule(i=st.integers(0, 10), n=st.integers(0, 9), with_ids=st.booleans(),
          ids=st.one_of(st.just(PROMPT), st.lists(st.integers(0, 1), min_size=9, max_size=9)))
    def append(self, i, n, with_ids, ids):
        STEPS["count"] += 1
        sid = self._live(i)
        known, ks, vs = self.dense[sid]
        if with_ids and known is not None:
            new_ids = ids[:n]
            kv = [self._row_for(tuple(known + new_ids[:j + 1])) for j in range(n)]
            k_new = np.array([r[0] for r in kv], dtype=self.cache.dtype).reshape(n, HKV, D)
            v_new = np.array([r[1] for r in kv], dtype=self.cache.dtype).reshape(n, HKV, D)
        else:
            new_ids = ids[:n] if with_ids else None
            k_new, v_new = rows(self.rng, n, dtype=self.cache.dtype)
        refs = self.cache.ref_counts()
        shared = {b: self._block_state(b) for b in np.flatnonzero(refs > 1)}
        before = self.cache.snapshot()
        free_before = self.cache.num_free_blocks()
        try:
            self.cache.append(sid, k_new, v_new, token_ids=new_ids)
        except OutOfBlocks:
            assert self.cache.snapshot() == before               # a failing call changes nothing
            # it can only fail if the pool really lacked blocks: n tokens need at most
            # ceil(n / bs) fresh blocks plus one copy-on-write
            assert free_before < math.ceil(n / self.BLOCK_SIZE) + 1
            return
        for b, state in shared.items():                          # shared blocks never written in place
            assert self._block_state(b) == state
        ks.extend(k_new)
        vs.extend(v_new)
        if known is not None and new_ids is not None:
            known.extend(new_ids)
            self.dense[sid] = (known, ks, vs)
        elif n:
            self.dense[sid] = (None, ks, vs)

    @precondition(lambda self: self.dense and len(self.dense) < self.MAX_SEQS)
    @rule(i=st.integers(0, 10))
    def fork(self, i):
        STEPS["count"] += 1
        sid = self._live(i)
        free_before = self.cache.num_free_blocks()
        child = self.cache.fork(sid)
        assert self.cache.num_free_blocks() == free_before       # fork copies nothing
        assert self.cache.block_table(child) == self.cache.block_table(sid)
        known, ks, vs = self.dense[sid]
        self.dense[child] = (None if known is None else list(known), list(ks), list(vs))

    @precondition(lambda self: self.dense)
    @rule(i=st.integers(0, 10))
    def free(self, i):
        STEPS["count"] += 1
        sid = self._live(i)
        self.cache.free(sid)
        del self.dense[sid]
        with pytest.raises(ValueError, match="seq_id"):
            self.cache.seq_len(sid)

    def _block_state(self, b):
        c = self.cache
        scales = () if not c.quantized else (c.k_scale[b].tobytes(), c.v_scale[b].tobytes())
        return (c.k_pool[b].tobytes(), c.v_pool[b].tobytes()) + scales

    @invariant()
    def matches_dense_model(self):
        bs = self.BLOCK_SIZE
        for sid, (_, ks, vs) in self.dense.items():
            n = len(ks)
            assert self.cache.seq_len(sid) == n
            table = self.cache.block_table(sid)
            assert len(table) == -(-n // bs) and len(set(table)) == len(table)
            k, v = self.cache.gather(sid)
            assert k.dtype == self.cache.dtype
            for got, want, scales in ((k, ks, self.cache.k_scale), (v, vs, self.cache.v_scale)):
                want = np.array(want, dtype=self.cache.dtype).reshape(n, HKV, D).transpose(1, 0, 2)
                if not self.cache.quantized:
                    assert np.array_equal(got, want)
                    continue
                # each value's block scale
                per_token = scales[np.repeat(np.asarray(table, dtype=np.int64), bs)[:n]].T[:, :, None]
                err = np.abs(got.astype(np.float64) - want.astype(np.float64))
                assert np.all(err <= paged.quantization_error_bound(want, per_token, self.cache.kv_dtype))

    @invariant()
    def refcounts_and_free_list(self):
        holders = np.zeros(self.NUM_BLOCKS, dtype=np.int64)
        for sid in self.dense:
            for b in self.cache.block_table(sid):
                holders[b] += 1
        assert np.array_equal(self.cache.ref_counts(), holders)
        free = set(self.cache._free)
        assert free == set(np.flatnonzero(holders == 0).tolist())     # nothing lost or leaked
        assert len(free) == self.cache.num_free_blocks()
        assert self.cache.num_free_blocks() + int((holders > 0).sum()) == self.NUM_BLOCKS


def test_state_machine_against_dense_model():
    STEPS["count"] = 0
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=50, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    assert STEPS["count"] >= 1000, STEPS["count"]


@pytest.mark.parametrize("dtype,kv_dtype,granularity", [("bfloat16", None, "block_head"),
                                                        ("float32", "float8_e4m3fn", "block_head"),
                                                        ("float16", "int8", "block"),
                                                        ("bfloat16", "int8", "block_head")])
def test_state_machine_on_16_bit_and_quantized_caches(dtype, kv_dtype, granularity):
    """The same machine: refcounts, copy-on-write, prefix hits and OutOfBlocks on the new dtypes;
    a quantized cache's rows match the dense model within the stated quantization bound."""
    machine = type("Machine", (CacheMachine,), dict(DTYPE=dtype, KV_DTYPE=kv_dtype, GRANULARITY=granularity))
    STEPS["count"] = 0
    run_state_machine_as_test(machine, settings=settings(
        max_examples=20, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    assert STEPS["count"] >= 400, STEPS["count"]


# --------------------------------------------------------------------------- focused behaviour
def test_fork_then_append_copies_the_shared_partial_block(rng):
    cache = PagedKVCache(8, 4, num_kv_heads=HKV, head_dim=D, dtype=np.float64)
    a = cache.new_sequence()
    k, v = rows(rng, 6)                                        # 1 full block + 2 slots
    cache.append(a, k, v)
    b = cache.fork(a)
    full, tail = cache.block_table(a)
    assert cache.ref_count(full) == cache.ref_count(tail) == 2
    k2, v2 = rows(rng, 1)
    cache.append(b, k2, v2)
    tb = cache.block_table(b)
    assert tb[0] == full and tb[1] != tail                     # full block still shared, tail copied
    assert cache.ref_count(full) == 2 and cache.ref_count(tail) == 1 and cache.ref_count(tb[1]) == 1
    assert cache.stats["copy_on_write"] == 1
    ka, _ = cache.gather(a)
    kb, _ = cache.gather(b)
    assert np.array_equal(ka, k.transpose(1, 0, 2))
    assert np.array_equal(kb, np.concatenate([k, k2]).transpose(1, 0, 2))
    cache.free(a)
    assert cache.ref_count(full) == 1 and cache.ref_count(tail) == 0
    assert cache.num_free_blocks() == 8 - 2


def test_prefix_cache_reuses_blocks_across_requests_even_after_free(rng):
    cache = PagedKVCache(6, 4, num_kv_heads=HKV, head_dim=D, dtype=np.float64)
    ids = rng.integers(0, 1000, size=10)
    k, v = rows(rng, 10)
    a = cache.new_sequence()
    cache.append(a, k, v, token_ids=ids)
    blocks_a = cache.block_table(a)                            # 2 full blocks keyed, 1 partial
    b = cache.new_sequence()
    cache.append(b, k[:9], v[:9], token_ids=ids[:9])           # same prompt prefix, another request
    tb = cache.block_table(b)
    assert tb[:2] == blocks_a[:2] and tb[2] != blocks_a[2]     # partial blocks are never shared
    assert cache.stats["prefix_hits"] == 2
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks() == 6
    c = cache.new_sequence()                                   # the blocks are free but still keyed
    cache.append(c, k[:8] + 1.0, v[:8] + 1.0, token_ids=ids[:8])
    assert cache.block_table(c) == blocks_a[:2] and cache.stats["prefix_hits"] == 4
    kc, _ = cache.gather(c)
    assert np.array_equal(kc, k[:8].transpose(1, 0, 2))         # the cached rows (token ids are a promise)
    # a different first token changes every key down the chain: no hit
    d_ = cache.new_sequence()
    other = ids[:8].copy()
    other[0] += 1
    cache.append(d_, k[:8], v[:8], token_ids=other)
    assert set(cache.block_table(d_)).isdisjoint(blocks_a[:2]) and cache.stats["prefix_hits"] == 4


def test_allocation_evicts_the_least_recently_freed_cached_block(rng):
    cache = PagedKVCache(2, 4, num_kv_heads=HKV, head_dim=D, dtype=np.float64)
    k, v = rows(rng, 4)
    a = cache.new_sequence()
    cache.append(a, k, v, token_ids=[1, 2, 3, 4])
    cache.free(a)
    b = cache.new_sequence()
    cache.append(b, *rows(rng, 8))                             # needs both blocks: evicts the cached one
    assert cache.cached_blocks() == {}
    cache.free(b)
    c = cache.new_sequence()
    cache.append(c, k, v, token_ids=[1, 2, 3, 4])
    assert cache.stats["prefix_hits"] == 0


def test_out_of_blocks_changes_nothing(rng):
    cache = PagedKVCache(3, 4, num_kv_heads=HKV, head_dim=D, dtype=np.float64)
    a = cache.new_sequence()
    cache.append(a, *rows(rng, 6), token_ids=list(range(6)))
    b = cache.fork(a)
    before = cache.snapshot()
    with pytest.raises(OutOfBlocks, match="k_new"):
        cache.append(b, *rows(rng, 7))                         # CoW 1 + 2 new > 1 free
    assert cache.snapshot() == before
    assert issubclass(OutOfBlocks, ValueError)
    cache.append(b, *rows(rng, 2))                             # CoW only: fits
    assert cache.num_free_blocks() == 0


@pytest.mark.parametrize("call", ["append", "fork", "free", "block_table", "seq_len", "gather"])
def test_unknown_sequence_id_is_a_clear_error(rng, call):
    cache = PagedKVCache(4, 4, num_kv_heads=HKV, head_dim=D)
    cache.new_sequence()
    before = cache.snapshot()
    args = {"append": (7, *rows(rng, 1, dtype=np.float32))}.get(call, (7,))
    with pytest.raises(ValueError, match="seq_id: unknown sequence id 7"):
        getattr(cache, call)(*args)
    assert cache.snapshot() == before


def test_bad_arguments_name_themselves(rng):
    cache = PagedKVCache(4, 4, num_kv_heads=HKV, head_dim=D)
    s = cache.new_sequence()
    before = cache.snapshot()
    k, v = rows(rng, 3, dtype=np.float32)
    with pytest.raises(ValueError, match="k_new"):
        cache.append(s, k[:, :1], v)
    with pytest.raises(ValueError, match="v_new"):
        cache.append(s, k, v[:2])
    with pytest.raises(ValueError, match="k_new: dtype must equal the cache's float32"):
        cache.append(s, k.astype(np.float64), v)
    with pytest.raises(ValueError, match="token_ids"):
        cache.append(s, k, v, token_ids=[1, 2])
    with pytest.raises(ValueError, match="backend"):
        cache.gather(s, backend="bogus")
    assert cache.snapshot() == before
    for kw, name in ((dict(num_blocks=0), "num_blocks"), (dict(num_blocks=4, block_size=0), "block_size"),
                     (dict(num_blocks=4, dtype=np.int32), "dtype")):
        with pytest.raises(ValueError, match=name):
            PagedKVCache(**kw)


def test_block_table_out_of_range_is_a_clear_error(rng):
    cache = PagedKVCache(4, 4, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match=r"block_table: entry 1 is block 9, outside the pool \[0, 4\)"):
        paged.paged_gather(cache.k_pool, cache.v_pool, [0, 9], 6)
    with pytest.raises(ValueError, match="block_table: 6 tokens"):
        paged.paged_gather(cache.k_pool, cache.v_pool, [0], 6)
    with pytest.raises(ValueError, match="block"):
        cache.ref_count(-1)


def test_nan_in_unwritten_slots_never_reaches_results(rng):
    hq, d = 4, 5
    cache = PagedKVCache(8, 4, num_kv_heads=HKV, head_dim=d, dtype=np.float64)
    lens = [5, 3, 9]
    ks, vs, sids = [], [], []
    for n in lens:
        s = cache.new_sequence()
        k, v = rows(rng, n, d=d)
        cache.append(s, k, v)
        ks.append(k), vs.append(v), sids.append(s)
    tables, seq_lens = cache.block_tables_array(sids)
    for t, n in zip(tables, seq_lens):                        # poison every unwritten slot
        last = t[(n - 1) // 4]
        cache.k_pool[last, n % 4 or 4:] = np.nan
        cache.v_pool[last, n % 4 or 4:] = np.nan
    assert np.isnan(cache.k_pool).any()
    for s, k in zip(sids, ks):
        kg, vg = cache.gather(s)
        assert np.isfinite(kg).all() and np.array_equal(kg, k.transpose(1, 0, 2))
    q = rng.standard_normal((3, hq, d))
    for ns in (1, 2, 5):
        o, lse = ik.paged_decode(q, cache, sids, num_splits=ns, return_lse=True)
        assert np.isfinite(o).all() and np.isfinite(lse).all()


def test_block_tables_array_pads_with_minus_one(rng):
    cache = PagedKVCache(8, 4, num_kv_heads=HKV, head_dim=D)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, *rows(rng, 9, dtype=np.float32))
    cache.append(b, *rows(rng, 2, dtype=np.float32))
    tables, lens = cache.block_tables_array([b, a])
    assert tables.dtype == np.int32 and lens.dtype == np.int32
    assert tables.shape == (2, 3) and lens.tolist() == [2, 9]
    assert tables[0].tolist() == cache.block_table(b) + [-1, -1] and tables[1].tolist() == cache.block_table(a)


@pytest.mark.parametrize("n", [1, 16, 37])
def test_gather_traffic_counted_equals_modelled(rng, n):
    cache = PagedKVCache(10, 16, num_kv_heads=3, head_dim=59, dtype=np.float32)
    s = cache.new_sequence()
    cache.append(s, *rows(rng, n, hkv=3, d=59, dtype=np.float32))
    with traffic.count() as t:
        cache.gather(s)
    m = traffic.model("paged_gather", seq_len=n, heads_kv=3, head_dim=59, block_size=16, dtype="float32")
    assert t.as_dict() == m.as_dict()
    assert t.by_tensor["K_cache"][0] == n * 3 * 59 * 4          # only valid slots are read


# --------------------------------------------------------------------------- calculators
def test_calculators_reproduce_the_articles_numbers():
    w = paged.paging_waste(300, 16)
    assert (w.blocks, w.slots, w.wasted_slots) == (19, 304, 4)
    assert round(w.waste_fraction * 100, 1) == 1.3
    assert round(paged.reservation_waste(300, 4096) * 100) == 93
    assert paged.kv_bytes_per_token(**paged.LLAMA2_7B) == 2 ** 19            # 0.5 MiB
    assert paged.kv_bytes_per_token(**paged.LLAMA3_8B) == 128 * 1024
    assert paged.reservation_bytes(4096, **paged.LLAMA2_7B) == 2 * 2 ** 30   # 2 GiB
    f = paged.fragmentation([300, 4096, 17], block_size=16, max_len=4096)
    assert f["paged_slots"] == 304 + 4096 + 32 and f["reserved_slots"] == 3 * 4096
    with pytest.raises(ValueError, match="used_tokens"):
        paged.reservation_waste(5000, 4096)


def test_explorer_actions_and_figures():
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from iokernels.viz import paged as vp
    ex = vp.PoolExplorer(num_blocks=6, block_size=4, rng=np.random.default_rng(3))
    a = ex.new()
    assert ex.append(a, 6)
    b = ex.fork(a)
    assert ex.append(b, 3)                                     # copy-on-write of the shared tail
    c = ex.new()
    assert ex.append(c, 8)                                     # the same prompt: two prefix hits
    assert ex.cache.stats == {"prefix_hits": 2, "copy_on_write": 1}
    assert not ex.append(c, 40) and "OutOfBlocks" not in ex.log[-1] and "free blocks" in ex.log[-1]
    ex.free(a)
    assert isinstance(ex.draw(), Figure)
    cache, tokens, labels = vp.demo_cache()
    shared = np.flatnonzero(cache.ref_counts() > 1)
    assert len(shared) == 1 and set(labels.values()) == {"A", "B"}
    assert isinstance(vp.block_table_figure(), Figure)
    fig = vp.split_cost_figure(batches=(8, 17), max_splits=20)
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 4      # a curve and a circle each
    for line in fig.axes[0].lines[::2]:
        assert min(line.get_ydata()) == 1.0                                # relative to the best S
    ex1 = vp.split_kv_example(seqlen=100, num_splits=7, seed=2)
    assert ex1["o_error"] < 1e-12 and abs(ex1["weights"].sum() - 1) < 1e-12


def test_last_block_is_the_tables_last_entry_uncopied():
    from iokernels.paged import PagedKVCache
    c = PagedKVCache(8, 4, num_kv_heads=1, head_dim=2)
    sid = c.new_sequence()
    assert c.last_block(sid) == -1
    c.append(sid, np.zeros((6, 1, 2), np.float32), np.zeros((6, 1, 2), np.float32))
    assert c.last_block(sid) == c.block_table(sid)[-1] and len(c.block_table(sid)) == 2
    with pytest.raises(ValueError, match="seq_id"):
        c.last_block(sid + 1)
