"""The paged KV cache exercises of the labs (lab 06): the gather, and the append with copy-on-write.

=================  ==========================================================
exercise           what the learner writes
=================  ==========================================================
paged_gather       ``paged_gather``: read a sequence through its block table
copy_on_write      ``append_token``: a block table's append with copy-on-write
=================  ==========================================================

Notation as in :mod:`iokernels.paged`: a pool of ``num_blocks`` blocks of ``block_size``
token slots; a sequence's block table maps its logical block j to a physical block.
"""
from __future__ import annotations

import numpy as np

from .. import paged
from ..core import traffic
from ..core.traffic import HBM
from . import references as refs
from .engine import CaseReport, Exercise, Mistake, budget_report, fail
from .engine import case as _case

# =========================================================================== 7 paged KV cache
TAIL_READ = Mistake("the unwritten tail of the last block read",
                    "read only the seq_len - j * block_size valid slots of the last block.")
TABLE_REREAD = Mistake("a block table entry read more than once", "read table[j] once per logical block.")


def _gather_detectors(row, counted, budget):
    if row.tensor in ("K_cache", "V_cache") and row.read > row.allowed_read:
        return TAIL_READ
    if row.tensor == "block_table" and row.read > row.allowed_read:
        return TABLE_REREAD
    return None


def _filled_cache(rng, p):
    """A PagedKVCache with a few sequences (one forked), so block tables are not in order."""
    cache = paged.PagedKVCache(p["blocks"], block_size=p["block_size"], num_kv_heads=p["Hkv"], head_dim=p["d"],
                               dtype=np.float32)
    sids = [cache.new_sequence() for _ in range(3)]
    for step, n in enumerate(p["lens"]):
        for sid in sids:
            kv = rng.standard_normal((2, n + step, p["Hkv"], p["d"])).astype(np.float32)
            cache.append(sid, kv[0], kv[1])
    child = cache.fork(sids[1])
    kv = rng.standard_normal((2, 3, p["Hkv"], p["d"])).astype(np.float32)
    cache.append(child, kv[0], kv[1])
    return cache, sids + [child]


def _grade_gather(gather, case, rng):
    p = case.params
    cache, sids = _filled_cache(rng, p)
    report = CaseReport()
    for sid in sids:
        n, table = cache.seq_len(sid), np.asarray(cache.block_table(sid), np.int32)
        K = HBM.full((p["Hkv"], n, p["d"]), np.nan, np.float32, "K")
        V = HBM.full((p["Hkv"], n, p["d"]), np.nan, np.float32, "V")
        with traffic.count() as counted:
            gather(HBM(cache.k_pool, "K_cache"), HBM(cache.v_pool, "V_cache"), HBM(table, "block_table"), K, V, n)
        ref_k, ref_v = paged.paged_gather(cache.k_pool, cache.v_pool, table, n)
        for name, out, ref in (("K", K.result(), ref_k), ("V", V.result(), ref_v)):
            if not np.array_equal(out, ref):
                bad = np.argwhere(~(out == ref))
                h, t, _ = bad[0]
                fail(f"sequence {sid} (seq_len {n}, table {table.tolist()}): {name}[{h}, {t}] differs from the "
                     f"cache's token {t} (block table[{t // p['block_size']}] = {table[t // p['block_size']]}, "
                     f"slot {t % p['block_size']})", report)
        budget = paged.traffic_model_gather(seq_len=n, heads_kv=p["Hkv"], head_dim=p["d"],
                                            block_size=p["block_size"], dtype="float32")
        budget_report(counted, budget, (_gather_detectors,), report=report)
    return report


PAGED_GATHER = Exercise(
    name="paged_gather", title="A paged gather through the block table", entry="paged_gather",
    spec=("paged_gather(K_cache, V_cache, TABLE, K, V, seq_len): HBM arrays; pools (num_blocks, block_size, "
          "Hkv, d), the table of physical block ids, outputs K, V (Hkv, seq_len, d).  Token t lives in block "
          "TABLE[t // block_size], slot t % block_size."),
    cases=lambda: [_case(blocks=40, block_size=4, Hkv=2, d=3, lens=(5, 2)),
                   _case(blocks=30, block_size=16, Hkv=1, d=59, lens=(17, 14))],
    grade_case=_grade_gather, seed=707,
    hint="loop over the logical blocks; the last one may be partly filled.",
    mistakes=(TAIL_READ, TABLE_REREAD), references=refs.PAGED_GATHER)


NO_COW = Mistake("no copy-on-write",
                 "before writing into a block whose reference count is > 1, copy its filled slots to a fresh "
                 "block from the free list, point the table at the copy, and decrement the shared block's count.")
REF_NOT_DECREMENTED = Mistake("the shared block's count not decremented",
                              "after the copy, the old block is held by one table fewer.")
COPY_INCOMPLETE = Mistake("the copy misses the earlier slots",
                          "copy every filled slot (0 .. seq_len % block_size - 1) of the shared block, in K and V.")
COPY_WHOLE_BLOCK = Mistake("the whole block copied",
                           "copy only the filled slots 0 .. seq_len % block_size - 1 of the shared block: the rest "
                           "of it holds nothing of this sequence (and on a GPU every slot copied is HBM traffic).")
FREE_LIST_ORDER = Mistake("free blocks taken from the wrong end",
                          "take free_list.pop(0): the front of the free list is the block freed longest ago, the "
                          "order the pool hands blocks out in (iokernels.paged.PagedKVCache), so a block just freed "
                          "-- whose prefix may still be cached -- is reused last; pop() takes the newest.")
#: what the grader writes into a held block's unfilled slots before each call (a copy of it shows)
UNFILLED = np.float32(-1.0e30)
COPY_AT_BOUNDARY = Mistake("a copy at a block boundary",
                           "when seq_len % block_size == 0 the token starts a new block: there is nothing to copy.")


def _check_invariants(tables, ref_counts, free_list, num_blocks, where):
    held = np.zeros(num_blocks, int)
    for t in tables.values():
        for b in t:
            held[b] += 1
    if len(set(free_list)) != len(free_list):
        fail(f"{where}: a block appears twice in the free list")
    for b in range(num_blocks):
        if ref_counts[b] != held[b]:
            fail(f"{where}: block {b} has reference count {ref_counts[b]} but {held[b]} block tables hold it",
                 mistake=REF_NOT_DECREMENTED if ref_counts[b] > held[b] else None)
        if (held[b] == 0) != (b in free_list):
            fail(f"{where}: block {b} is {'held' if held[b] else 'unheld'} yet "
                 f"{'in' if b in free_list else 'not in'} the free list")


def _mark_unfilled(pools, tables, lens, bs):
    """Free blocks NaN; each held block's slots past its filled ones UNFILLED (so copying them shows)."""
    filled = {}
    for s, t in tables.items():
        for j, b in enumerate(t):
            filled[b] = max(filled.get(b, 0), min(bs, lens[s] - j * bs))
    for pool in pools:
        held = np.zeros(pool.shape[0], bool)
        held[list(filled)] = True
        pool[~held] = np.nan
        for b, n in filled.items():
            pool[b, n:] = UNFILLED


def _check_append(before_free, free_list, table, old_table, seq_len, shared, pools, bs, where):
    """The blocks taken come from the front of the free list; a copy-on-write copies only filled slots."""
    taken = [b for b in before_free if b not in free_list]
    if taken and taken != before_free[:len(taken)]:
        fail(f"{where}: append_token took block {taken[0]} from the free list {before_free}, where "
             f"free_list.pop(0) takes block {before_free[0]}", mistake=FREE_LIST_ORDER)
    slot, j = seq_len % bs, seq_len // bs
    if slot and shared and len(table) > j and table[j] != old_table[j]:
        new = int(table[j])
        for pool in pools:
            if np.any(pool[new, slot + 1:] == UNFILLED):
                fail(f"{where}: the copy of shared block {old_table[j]} into block {new} also copied its unfilled "
                     f"slots {slot + 1}..{bs - 1} (the sequence had filled {slot} of its {bs} slots)",
                     mistake=COPY_WHOLE_BLOCK)


def _grade_cow(append_token, case, rng):
    p = case.params
    bs, H, d, nb = p["block_size"], 2, 3, p["blocks"]
    pools = [np.full((nb, bs, H, d), np.nan, np.float32) for _ in range(2)]
    ref_counts, free_list = np.zeros(nb, int), list(range(nb))
    tables, lens, tokens = {0: []}, {0: 0}, {0: []}
    ref = paged.PagedKVCache(nb, block_size=bs, num_kv_heads=H, head_dim=d, dtype=np.float32)
    ref_ids = {0: ref.new_sequence()}
    for step, (op, sid) in enumerate(p["script"]):
        where = f"after step {step + 1} ({op} {sid}) of the script {p['script']}"
        if op == "fork":                                   # the grader forks: share every block
            new = max(tables) + 1
            tables[new], lens[new], tokens[new] = list(tables[sid]), lens[sid], list(tokens[sid])
            for b in tables[sid]:
                ref_counts[b] += 1
            ref_ids[new] = ref.fork(ref_ids[sid])
        else:
            for _ in range(op):                            # append `op` tokens, one call each
                kt, vt = rng.standard_normal((2, H, d)).astype(np.float32)
                _mark_unfilled(pools, tables, lens, bs)
                before_free, old_table = list(free_list), list(tables[sid])
                last = old_table[lens[sid] // bs] if len(old_table) > lens[sid] // bs else None
                shared = last is not None and ref_counts[last] > 1
                table = append_token(list(tables[sid]), lens[sid], ref_counts, free_list, pools[0], pools[1],
                                     kt, vt)
                if table is None:
                    fail("append_token must return the (new) block table of the sequence")
                _check_append(before_free, free_list, [int(b) for b in table], old_table, lens[sid], shared, pools,
                              bs, where)
                blk = int(table[lens[sid] // bs]) if len(table) > lens[sid] // bs else None
                others = [s for s in tables if s != sid and blk in tables[s]]
                if others:
                    fail(f"{where}: sequence {sid} wrote its token {lens[sid]} into block {blk}, which sequence "
                         f"{others[0]} also holds", mistake=NO_COW)
                tables[sid], lens[sid] = [int(b) for b in table], lens[sid] + 1
                tokens[sid].append((kt, vt))
                ref.append(ref_ids[sid], kt[None], vt[None])
        _check_invariants(tables, ref_counts, free_list, nb, where)
        for s in tables:                                   # every sequence still reads its own tokens
            k, v = paged.paged_gather(pools[0], pools[1], tables[s], lens[s])
            for t, (kt, vt) in enumerate(tokens[s]):
                if not (np.array_equal(k[:, t], kt) and np.array_equal(v[:, t], vt)):
                    blk = tables[s][t // bs]
                    shared = sum(blk in tb for tb in tables.values()) > 1
                    mistake = COPY_INCOMPLETE if (t // bs == len(tables[s]) - 1 and not shared) else NO_COW
                    fail(f"{where}: sequence {s} token {t} (block {blk}, slot {t % bs}) no longer holds what was "
                         f"appended", mistake=mistake)
        if len(free_list) != ref.num_free_blocks():
            fail(f"{where}: {nb - len(free_list)} blocks in use where {nb - ref.num_free_blocks()} are needed",
                 mistake=COPY_AT_BOUNDARY if len(free_list) < ref.num_free_blocks() else None)
    return CaseReport()


COPY_ON_WRITE = Exercise(
    name="copy_on_write", title="Block tables: append with copy-on-write after a fork", entry="append_token",
    spec=("append_token(table, seq_len, ref_counts, free_list, k_pool, v_pool, k_tok, v_tok) -> table: write "
          "one token (k_tok, v_tok: (Hkv, d)) at position seq_len; take new blocks with free_list.pop(0) (the "
          "front: the block freed longest ago) and set their count to 1; copy a shared (count > 1) partly filled "
          "last block before writing into it, only its filled slots."),
    cases=lambda: [_case(block_size=4, blocks=12, script=((6, 0), ("fork", 0), (1, 1), (3, 0), (2, 1))),
                   _case(block_size=4, blocks=12, script=((8, 0), ("fork", 0), (1, 1), (1, 0), ("fork", 1),
                                                          (2, 2), (5, 1)))],
    grade_case=_grade_cow, seed=717,
    hint="three cases: the last block is full (take a new one), shared (copy it first), or private (write).",
    mistakes=(NO_COW, REF_NOT_DECREMENTED, COPY_INCOMPLETE, COPY_AT_BOUNDARY, COPY_WHOLE_BLOCK, FREE_LIST_ORDER),
    references=refs.PAGED_APPEND)
