"""Every choose-a-size rule is a small named pure function; each is held to its rule here.

The homes: iokernels/core/config.py (the NumPy tiles), iokernels/cupy_raw/policy.py (the
CuPy sizes), iokernels/numba_cuda/policy.py (the Numba sizes), iokernels/decode.py (the
lesson's split rule, tested in tests/test_decode.py).
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from iokernels.core import conventions as cv
from iokernels.core.config import DEFAULT_SRAM_BYTES, TileConfig, paper_tiles
from iokernels.cupy_raw import config as C
from iokernels.cupy_raw import policy as P
from iokernels.cupy_raw.hopper import HopperConfig
from iokernels.numba_cuda import config as NC
from iokernels.numba_cuda import policy as NP

ROOT = Path(__file__).resolve().parents[1]
POLICY_HOMES = ("iokernels/core/config.py", "iokernels/cupy_raw/policy.py", "iokernels/numba_cuda/policy.py",
                "iokernels/decode.py")


# --------------------------------------------------------------------------- one name a rule
def test_every_policy_function_has_its_own_name():
    seen: dict[str, str] = {}
    for rel in POLICY_HOMES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                assert node.name not in seen, f"{node.name} in {rel} and {seen[node.name]}"
                seen[node.name] = rel
    names = [p.name for p in (ROOT / "iokernels").rglob("*.py")
             if "def num_splits_heuristic(" in p.read_text()]
    assert not names, f"num_splits_heuristic defined in {names}: each split rule has its own name"


# --------------------------------------------------------------------------- NumPy tiles
@pytest.mark.parametrize("sram", [DEFAULT_SRAM_BYTES, 100 * 1024, 48 * 1024, 16 * 1024])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_paper_tiles_keep_br_min_bc_d_and_fit(sram, d, dtype):
    br, bc = paper_tiles(sram, d, dtype)
    assert br == min(bc, d)                                         # Algorithm 1, line 1
    cfg = TileConfig.from_sram(sram, d, dtype)
    assert (cfg.block_q, cfg.block_k) == (br, bc)
    if bc > 1:
        assert cfg.sram_usage(d, dtype) <= sram
        # the first of the paper's Bc, halved, that fits: every one before it did not
        b = math.ceil(sram // cv.itemsize_of(dtype) / (4 * d))
        while b != bc:
            assert TileConfig(min(b, d), b, sram_bytes=sram).sram_usage(d, dtype) > sram
            b //= 2


def test_paper_tiles_at_228_kib_d128_float16():
    # Bc = ceil(116736 / 512) = 228 does not fit with Br = 128; Bc = 114 does, and then Br = 114
    assert paper_tiles(228 * 1024, 128, "float16") == (114, 114)
    cfg = TileConfig.from_sram(228 * 1024, 128, "float16")
    assert cfg.block_q == min(cfg.block_k, 128) == 114


def test_default_tiles_halve_the_larger_side_until_they_fit():
    assert (TileConfig.default(64).block_q, TileConfig.default(64).block_k) == (64, 64)
    cfg = TileConfig.default(128, "float64")                        # 64 x 64 does not fit: Bc halves first
    assert (cfg.block_q, cfg.block_k) == (64, 32) and cfg.sram_usage(128, "float64") <= DEFAULT_SRAM_BYTES
    assert TileConfig(64, 64).sram_usage(128, "float64") > DEFAULT_SRAM_BYTES


# --------------------------------------------------------------------------- CuPy sizes
def test_v2_default_block_k_and_the_forward_config_use_it():
    assert [P.v2_default_block_k(d) for d in (32, 64, 128, 129, 256)] == [64, 64, 64, 32, 32]
    assert C.ForwardConfig("v2").resolve(128, "float16").block_k == 64
    assert C.ForwardConfig("v2").resolve(192, "bfloat16").block_k == 32


def test_backward_v1_tiles_shrink_br_first_and_keep_given_sizes():
    def smem(q, k):
        return 100 * q * k
    assert P.backward_v1_tiles(None, None, smem, 100 * 32 * 32, (32, 32)) == (32, 32)
    assert P.backward_v1_tiles(None, None, smem, 100 * 16 * 32, (32, 32)) == (16, 32)
    assert P.backward_v1_tiles(None, None, smem, 100 * 8 * 16, (32, 32)) == (8, 16)
    assert P.backward_v1_tiles(32, None, smem, 100 * 32 * 8, (32, 32)) == (32, 8)
    assert P.backward_v1_tiles(32, 32, smem, 100, (32, 32)) is None
    cfg = C.BackwardConfig("v1").resolve(256, "float32")
    assert C.BackwardConfig.smem_bytes(cfg.block_q, cfg.block_k, 256, "float32") <= C.STATIC_SMEM_BYTES
    assert (cfg.block_q, cfg.block_k) != (C.BWD_DEFAULT_BLOCK_Q, C.BWD_DEFAULT_BLOCK_K)    # it shrank


def test_paged_prefill_tiles_keep_4_warps_and_shrink_bc_to_fit():
    def smem(nw, bk):
        return 1000 * (16 * nw + 4 * bk)
    assert P.paged_prefill_tiles(None, None, smem, None) == (4, 64)          # no limit known: the default
    assert P.paged_prefill_tiles(None, None, smem, smem(4, 64)) == (4, 64)
    assert P.paged_prefill_tiles(None, None, smem, smem(4, 64) - 1) == (4, 32)
    assert P.paged_prefill_tiles(None, None, smem, smem(4, 16)) == (4, 16)
    assert P.paged_prefill_tiles(None, None, smem, smem(4, 16) - 1) is None
    assert P.paged_prefill_tiles(2, 128, smem, smem(2, 128)) == (2, 128)       # given sizes are kept ...
    assert P.paged_prefill_tiles(2, 128, smem, smem(2, 128) - 1) is None       # ... or refused, never shrunk
    # long chunks on average: 8 warps (Br = 128), back to 4 where 8 fit at no Bc
    assert P.paged_prefill_tiles(None, None, smem, None, mean_rows=127.9) == (4, 64)
    assert P.paged_prefill_tiles(None, None, smem, None, mean_rows=128) == (8, 64)
    assert P.paged_prefill_tiles(None, None, smem, smem(8, 32), mean_rows=4096) == (8, 32)
    assert P.paged_prefill_tiles(None, None, smem, smem(8, 16) - 1, mean_rows=4096) == (4, 16)
    # the config uses it: d = 128 at 4 x 64 is 87,040 B (an H100 / A100 block); 64 KB (sm_75) takes Bc = 32
    cfg = C.PagedPrefillConfig("v1").resolve(128, 227 * 1024)
    assert (cfg.num_warps, cfg.block_k, cfg.block_q, cfg.smem_bytes(128)) == (4, 64, 64, 87040)
    assert C.PagedPrefillConfig("v1").resolve(128, 64 * 1024).block_k == 32
    with pytest.raises(ValueError, match="config"):
        C.PagedPrefillConfig("v1", block_k=128, num_warps=8).resolve(128, 64 * 1024)
    with pytest.raises(ValueError, match="config.block_k"):
        C.PagedPrefillConfig("v1", block_k=24)


def test_a_held_back_version_says_what_it_waits_for_and_reads_the_table_on_every_call(monkeypatch):
    check = P.default_check_for("attention", "v6")
    assert P.held_back("attention", "v6").startswith("not the default until measured (its GPU tests")
    assert check(None) == P.held_back("attention", "v6")
    assert P.held_back("paged_prefill", "v3") is None and P.held_back("attention", "v5") is None
    monkeypatch.delitem(P.HELD_BACK, ("attention", "v6"))
    assert check(None) is None


def test_gather_chunk_is_the_widest_that_divides_rows_and_pointers():
    assert P.gather_chunk_bytes(256, 2, (0, 4096, 8192)) == 16
    assert P.gather_chunk_bytes(24, 2, (0, 4096)) == 8                # 24-byte rows: 8-byte chunks
    assert P.gather_chunk_bytes(256, 2, (0, 4100)) == 4                # a pointer on 4 bytes
    assert P.gather_chunk_bytes(6, 2, (0, 2)) == 2
    assert P.gather_chunk_bytes(3, 1, (0,)) == 1                        # the element size


@pytest.mark.parametrize("pairs, seq_len", [(1, 4096), (8, 32768), (256, 1000), (32, 128)])
def test_decode_wave_splits_is_the_cheapest_split_count(pairs, seq_len):
    s = P.decode_wave_splits(pairs, 1, seq_len, 132, 4, 512)
    assert 1 <= s <= P.DECODE_MAX_SPLITS
    cost = P.split_cost(pairs, seq_len, s, 132, 4, 512)
    assert all(cost <= P.split_cost(pairs, seq_len, t, 132, 4, 512) * (1 + 1e-9)
               for t in range(1, s) if seq_len / t >= P.DECODE_MIN_KEYS_PER_SPLIT)


def test_mla_num_splits_fills_one_wave():
    kw = dict(min_keys=C.MLA_MIN_KEYS_PER_SPLIT, heads_block=C.MLA_HEADS_BLOCK, max_splits=C.MLA_MAX_SPLITS)
    assert P.mla_num_splits(64, 128, 8192, 132, **kw) == 1         # 128 blocks already
    assert P.mla_num_splits(8, 128, 8192, 132, **kw) == 8          # 16 blocks x 8
    assert P.mla_num_splits(1, 128, 8192, 132, **kw) == 64         # 2 blocks; 128 rows a split at least
    assert P.mla_num_splits(1, 16, 100, 132, **kw) == 1
    assert P.mla_num_splits(3, 128, 0, 132, **kw) == 1
    assert P.mla_num_splits(1, 64, 10 ** 7, 1000, **kw) == C.MLA_MAX_SPLITS


def test_hopper_tiles_and_the_config_that_uses_them():
    for d in (64, 128):                                  # the tiles these head dims always had
        assert P.hopper_tiles("v3", d) == (128, 2) and P.hopper_tiles("v4", d) == (128, 2)
        assert P.hopper_tiles("v5", d) == (128, 3)
        assert P.hopper_tiles("v5", d, 64, 4) == (64, 4)
    assert all(P.hopper_tiles(v, 256) == (64, 2) for v in ("v3", "v4", "v5"))
    assert P.hopper_tiles("v5", 256, stages=3) == (64, 3)           # given sizes win; check_fits refuses
    for d in (64, 128, 256):
        c = HopperConfig("v5").resolve(d)
        assert (c.block_n, c.stages) == P.hopper_tiles("v5", d)
    # the defaults fit the 227 KB a Hopper block may have at every head dim the kernels take
    assert all(HopperConfig(v).smem_bytes(d) <= 232448 for v in ("v3", "v4", "v5") for d in (64, 128, 256))
    # Q (64 KB) + 2 x (K + V) (2 x 64 KB) at head_dim 256 and Bc = 64, 7 mbarriers, the slack
    assert HopperConfig("v5").smem_bytes(256) == 2 * 256 * (128 + 2 * 2 * 64) + 8 * 7 + 1024
    assert HopperConfig("v5", stages=3).smem_bytes(256) > 232448


def test_hopper_default_gate_is_the_measured_head_dims():
    assert P.hopper_default_at(64) and P.hopper_default_at(128) and P.hopper_default_at(256)
    assert not P.hopper_default_at(96)
    assert P.HOPPER_DEFAULT_HEAD_DIMS == (64, 128, 256)


# --------------------------------------------------------------------------- Numba sizes
def test_numba_forward_block_k_halves_until_k_and_v_fit():
    assert NP.forward_block_k(32, 8, 64, 4, 48 * 1024) == 32
    assert NP.forward_block_k(32, 8, 256, 8, 48 * 1024) == 8           # 2 x 16 x 256 x 8 > 48 KB
    assert NP.forward_block_k(32, 8, 1024, 8, 48 * 1024) == 8          # never below one step
    cfg = NC.ForwardConfig("v2").resolved(128, "float64")
    assert 2 * cfg.block_k * cfg.padded_head_dim(128) * 8 <= NC.SHARED_LIMIT_BYTES


def test_numba_backward_block_halves_until_it_fits():
    assert NP.backward_block(16, lambda b: b * 1000, 16000) == 16
    assert NP.backward_block(16, lambda b: b * 1000, 15999) == 8
    assert NP.backward_block(16, lambda b: 10 ** 9, 1) == 1
    cfg = NC.BackwardConfig().resolved(256, "float64")
    assert cfg.block_q == cfg.block_k and cfg.smem_bytes(256, "float64") <= NC.SHARED_LIMIT_BYTES


def test_decode_v7_group_split_is_the_fewest_equal_slices_that_fit():
    """decode v7's GROUP_SPLIT: the fewest blocks a KV head whose equal slices of the group fit
    the lane's words; a prime group past the slice takes one head a block; the words a head
    are the kernel's q, O, scores, m, l and base (float64: two registers each)."""
    assert P.decode_v7_group_split(16, 15, 240) == 1          # 16 x 15 = 240 words: one block
    assert P.decode_v7_group_split(32, 15, 240) == 2
    assert P.decode_v7_group_split(24, 15, 240) == 2          # 12 heads a block, not 3 blocks of 8
    assert P.decode_v7_group_split(71, 15, 240) == 71         # prime: one head a block
    assert P.decode_v7_group_split(8, 300, 240) == 8          # not even one head fits: one a block
    for group in range(1, 130):
        for words in (15, 22, 25):
            split = P.decode_v7_group_split(group, words, 240)
            assert group % split == 0
            slice_ = group // split
            assert slice_ * words <= 240 or slice_ == 1
            assert all(group % s or (group // s) * words > 240 for s in range(1, split))
    with pytest.raises(ValueError, match="group"):
        P.decode_v7_group_split(0, 15, 240)
    from iokernels.cupy_raw import decode_config as D
    assert D.lane_words_a_head(128, "float32") == 2 * 4 + 4 + 3          # EPL 4, tile of 4 rows, 1 a step
    assert D.lane_words_a_head(64, "float64") == (2 * 2 + 4 + 3) * 2     # EPL 2, pairs of registers
    assert D.lane_words_a_head(128, "bfloat16", kv="int8") == 2 * 8 + D.decode_v2_geometry(
        128, "bfloat16", kv="int8")["tile_rows"] // D.decode_v2_geometry(128, "bfloat16", kv="int8")[
        "rows_side_by_side"] + 3
    assert D.lane_words_a_head(256, "float32") is None                  # 64 chunks a row: not v3's ring


def test_decode_v7_takes_the_groups_v3_cannot_hold():
    """The registry's check of decode v7: it refuses a group v3 holds within
    DECODE_V3_LANE_WORDS (float32 g = 4 at d = 128), takes float32 past it, the groups whose v3
    merge buffer does not fit (g = 64 at d = 128), float64, 16-bit rows at head dims v4 / v6 do
    not take, and refuses rows v3's ring cannot take; and while HELD_BACK lists it the default
    stays v3 (or v1 where v3's ring does not fit)."""
    from iokernels.core.registry import Need
    from iokernels import cupy_raw as cr

    def need(dtype, d, group, kv=None):
        return Need(dtype, d, 90, extra=dict(group=group, kv_dtype=kv, aligned16=True, smem=227 * 1024,
                                             scale_granularity="block_head" if kv else None))
    v7 = cr.REGISTRY.get("decode", "v7")
    assert "v3 holds" in v7.unavailable(need("float32", 128, 4))
    for dtype, d, g in (("float32", 128, 8), ("float32", 128, 64), ("float32", 64, 128), ("float64", 64, 8),
                        ("bfloat16", 72, 16), ("float32", 128, 71)):
        assert v7.unavailable(need(dtype, d, g)) is None, (dtype, d, g)
    assert "16-byte chunks" in v7.unavailable(need("float32", 256, 64))
    with pytest.raises(ValueError, match="config.version: v7 needs rows of whole 16-byte chunks"):
        cr.DecodeConfig("v7").defines(256, "float32", 64, False, 16)        # named past the registry
    d7 = cr.DecodeConfig("v7", min_blocks=2).defines(128, "float32", 64, False, 16)
    assert (d7["GROUP"], d7["GROUP_SPLIT"], d7["DECODE_MIN_BLOCKS"]) == (16, 4, 2)    # a named min_blocks wins
    assert cr.REGISTRY.get("decode", "v3").unavailable(need("float32", 128, 64)) is not None   # its merge
    if P.held_back("decode", "v7") is not None:
        assert cr.REGISTRY.resolve("decode", None, need("float32", 128, 64))[0].version == "v1"
        assert cr.REGISTRY.resolve("decode", None, need("float32", 128, 16))[0].version == "v3"
    else:
        assert cr.REGISTRY.resolve("decode", None, need("float32", 128, 64))[0].version == "v7"
    assert cr.REGISTRY.resolve("decode", None, need("bfloat16", 128, 64))[0].version == "v6"   # tensor cores
    assert cr.REGISTRY.resolve("decode", None, need("bfloat16", 80, 16))[0].version == "v4"


# --------------------------------------------------------------------------- the Hopper forward by length
@pytest.mark.parametrize("nq,nk,window", [(1, 1, (-1, -1)), (7, 300, (-1, 0)), (300, 7, (-1, 0)), (129, 129, (5, 3)),
                                          (64, 1000, (-1, -1)), (1000, 1000, (-1, 0)), (0, 10, (-1, 0))])
def test_mean_visible_keys_counts_the_mask(nq, nk, window):
    want = float(cv.mask(nq, nk, False, window).sum(axis=1).mean()) if nq else 0.0
    assert P.mean_visible_keys(nq, nk, window) == pytest.approx(want, abs=1e-9)


def test_hopper_forward_for_length_takes_v9_on_short_key_ranges_only():
    """v9 up to HOPPER_V9_MAX_KEY_TILES key tiles a query tile (v8's Bc), then v10 at head_dim 64, and at
    the others v11 under an upper band edge from HOPPER_V11_MIN_KEY_TILES, else v8; the choice never returns
    to v9 as the keys grow, and the causal mask halves a tile's keys."""
    for d in (64, 128, 256):
        bc = P.hopper_tiles("v8", d)[0]
        edge = int(P.HOPPER_V9_MAX_KEY_TILES[d] * bc)
        long = "v10" if d == 64 else "v8"
        assert P.hopper_forward_for_length(d, edge, edge) == "v9"
        assert P.hopper_forward_for_length(d, edge + 1, edge + 1) == long
        assert P.hopper_forward_for_length(d, 1, edge + 1) == long                 # one row over many keys
        assert P.hopper_forward_for_length(d, 2 * edge - 1, 2 * edge - 1, (-1, 0)) == "v9"   # causal: (N + 1) / 2 keys
        assert P.hopper_forward_for_length(d, 4 * edge, 4 * edge, (edge // 2, 0)) == "v9"   # a window bounds it
        picks = [P.hopper_forward_for_length(d, n, n) for n in range(1, 40 * bc, bc // 2)]
        assert picks == sorted(picks, key=lambda v: v != "v9") and picks[0] == "v9" and picks[-1] == long
        v11 = int(2 * P.HOPPER_V11_MIN_KEY_TILES * bc)              # causal: about half of N visible
        assert P.hopper_forward_for_length(d, v11, v11, (-1, 0)) == ("v10" if d == 64 else "v11")
        if d != 64:
            assert P.hopper_forward_for_length(d, v11 - 2 * bc, v11 - 2 * bc, (-1, 0)) == "v8"   # 15 tiles


def test_every_backends_need_carries_the_forward_lengths():
    """The forward's need (each backend's ``need``) carries seq_q, seq_k and the band, causal folded in;
    other ops carry none."""
    import numpy as np
    from iokernels.cupy_raw.registry import need as cupy_need
    from iokernels.numba_cuda.registry import need as numba_need
    from iokernels.triton_backend.registry import need as triton_need
    q, k = np.zeros((1, 2, 5, 16), np.float32), np.zeros((1, 2, 9, 16), np.float32)
    for need in (cupy_need, numba_need, triton_need):
        n = need("attention", q=q, k=k, v=k, causal=True, window=(4, 2))
        assert (n.extra["seq_q"], n.extra["seq_k"], n.extra["window"]) == (5, 9, (4, 0)), need
        assert need("attention", q=q, k=k, v=k).extra["window"] == (-1, -1)
        assert "seq_q" not in need("decode", q=q[:, :, 0], k=k, v=k).extra


# --------------------------------------------------------------------------- the forward's blocks longest first
def test_forward_lpt_pairs_fills_the_l2_cache_in_a_power_of_two():
    """policy.forward_lpt_pairs: 1 without an upper band edge or an L2 size; else the pairs whose K and V
    (2 x seq_k x d x itemsize each) fit the L2 cache, rounded down to a power of two, within 1 .. pairs."""
    mb = 1 << 20
    assert P.forward_lpt_pairs(32, 8192, 64, 2, 50 * mb, banded=True) == 16       # 2 MB a pair: 25 fit
    assert P.forward_lpt_pairs(32, 8192, 128, 2, 50 * mb, banded=True) == 8       # 4 MB: 12 fit
    assert P.forward_lpt_pairs(32, 8192, 256, 2, 50 * mb, banded=True) == 4       # 8 MB: 6 fit
    assert P.forward_lpt_pairs(6, 1000, 64, 2, 50 * mb, banded=True) == 6         # every pair fits
    assert P.forward_lpt_pairs(8, 1 << 20, 128, 2, 50 * mb, banded=True) == 1     # one pair over L2
    assert P.forward_lpt_pairs(32, 8192, 64, 2, 0, banded=True) == 1              # no L2 size reported
    assert P.forward_lpt_pairs(32, 8192, 64, 2, 50 * mb, banded=False) == 1       # no band: v8's order
    for pairs in range(1, 40):
        got = P.forward_lpt_pairs(pairs, 3000, 128, 2, 50 * mb, banded=True)
        assert 1 <= got <= pairs and (got == pairs or got & (got - 1) == 0)


def _makespan(order, sms=132):
    """A list-scheduling model of a grid: each block starts on the first free SM, in ``order``."""
    import heapq
    free = [0.0] * sms
    end = 0.0
    for work in order:
        t = heapq.heappop(free) + work
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def _causal_blocks(pairs, tiles, group):
    """The blocks' times (key tiles + 1) under the causal mask, Nq = Nk, in fa_v11's order for ``group``
    pairs a group (1: v8's order: a pair's tiles heaviest first, the pairs one after another)."""
    out = []
    for first in range(0, pairs, group):
        n = min(group, pairs - first)
        out += [tiles - rank + 1 for rank in range(tiles) for _ in range(n)]
    return out


def test_longest_first_groups_shorten_the_causal_tail_in_a_model():
    """The model forward_lpt_pairs's docstring cites: 32 pairs of 64 causal query tiles on 132 SMs end over
    5% after the even share in v8's order, within 1% in the groups the policy gives (16 pairs at d = 64,
    8 at 128, 4 at 256 on a 50 MB L2), and a group whose blocks span a wave and a half (3 pairs) keeps a
    tail of its own."""
    pairs, tiles = 32, 64
    even = sum(_causal_blocks(pairs, tiles, 1)) / 132
    assert _makespan(_causal_blocks(pairs, tiles, 1)) > 1.05 * even
    assert _makespan(_causal_blocks(pairs, tiles, 3)) > 1.04 * even
    for d in (64, 128, 256):
        group = P.forward_lpt_pairs(pairs, 8192, d, 2, 50 << 20, banded=True)
        assert _makespan(_causal_blocks(pairs, tiles, group)) < 1.01 * even, (d, group)


def test_decode_v8_config_registry_and_splits(monkeypatch):
    """decode v8 (Hopper): its tiles and consumers by head dim, a ring of a multiple of its consumers'
    stages within the SRAM, bad settings as ValueErrors naming config; the registry's check (a
    Hopper GPU, 16-bit rows, groups up to 64, a contiguous cache); where the Hopper kernels can run
    the default takes v8 past v4's 16 rows once HELD_BACK lets it (v6 stays the default past 64, v4 up
    to 16); and its
    split rule: one block a (b, kv head) pair once the pairs cover the SMs over a short cache, else the
    wave model's."""
    from iokernels.core.registry import Need
    from iokernels import cupy_raw as cr
    from iokernels.cupy_raw import decode_v8_config as V8
    big = 227 * 1024
    cfg = cr.DecodeConfig("v8")
    for d, bn, stages, consumers in ((64, 128, 6, 2), (128, 64, 6, 2), (256, 64, 3, 1)):
        df = cfg.defines(d, "bfloat16", 32, False, 0, smem_limit=big)
        assert (df["BLOCK_N"], df["STAGES"], df["CONSUMERS"], df["NUM_WARPS"]) == (bn, stages, consumers,
                                                                                   4 * (consumers + 1)), d
        assert V8.decode_v8_smem(d, bn, stages) <= big and V8.decode_v8_smem(d, bn, stages + consumers) > big
    assert cfg.defines(128, "float16", 64, False, 0, smem_limit=120 * 1024)["STAGES"] == 2     # a smaller SRAM
    for bad, match in (({"stages": 3}, "config.stages"), ({"tile_rows": 32}, "config.tile_rows"),
                       ({"num_warps": 4}, "config.num_warps"), ({"load_l1": True}, "config.load_l1")):
        with pytest.raises(ValueError, match=match):
            cr.DecodeConfig("v8", **bad).defines(128, "bfloat16", 32, False, 0)
    with pytest.raises(ValueError, match="config.tile_rows"):
        cr.DecodeConfig("v8", tile_rows=128).defines(256, "bfloat16", 32, False, 0)
    with pytest.raises(ValueError, match="contiguous"):
        cfg.defines(128, "bfloat16", 32, True, 16)
    with pytest.raises(ValueError, match="group"):
        cfg.defines(128, "bfloat16", 65, False, 0)

    def need(dtype="bfloat16", d=128, group=32, cc=90, **extra):
        return Need(dtype, d, cc, extra=dict(dict(group=group, aligned16=True, smem=big), **extra))
    monkeypatch.setattr("iokernels.cupy_raw.hopper.checks.available", lambda: None)
    v8 = cr.REGISTRY.get("decode", "v8")
    assert cr.REGISTRY.find("paged_decode", "v8") is None                     # no pages: not one box a tile
    assert v8.unavailable(need()) is None
    for n, why in ((need(dtype="float32"), "float16/bfloat16"), (need(d=96), "head_dim"),
                   (need(group=65), "group"), (need(cc=80), "compute capability 9.0"),
                   (need(kv_dtype="int8"), "kv_dtype"), (need(aligned16=False), "16-byte"),
                   (need(smem=64 * 1024), "shared memory")):
        assert why in v8.unavailable(n), why
    assert "simulator" in v8.unavailable(Need("bfloat16", 128, 90, simulator=True, extra=dict(group=32)))
    past16 = "v8" if P.held_back("decode", "v8") is None else "v6"     # while HELD_BACK lists it: v6
    for g, want in ((4, "v4"), (16, "v4"), (17, past16), (32, past16), (64, past16), (65, "v6"), (128, "v6")):
        assert cr.REGISTRY.resolve("decode", None, need(group=g))[0].version == want, g
    assert "not the default at group 16" in v8.not_default(need(group=16))
    assert cr.REGISTRY.resolve("decode", cfg, need(group=16))[0].version == "v8"   # by name
    # the split rule: pairs that cover the SMs take one split; fewer take the wave model's
    assert P.decode_v8_splits(17, 8, 4096, 132) == 1 and P.decode_v8_splits(64, 8, 1000, 132) == 1
    assert P.decode_v8_splits(17, 8, 50000, 132) == P.decode_wave_splits(17, 8, 50000, 132, 1, 512) > 1
    for B in (1, 3, 8):
        assert P.decode_v8_splits(B, 8, 4096, 132) == P.decode_wave_splits(B, 8, 4096, 132, 1, 512) > 1


def test_the_combine_is_fused_by_group_x_head_dim_where_measured_and_a_config_can_force_it():
    """policy.decode_fuse_combine: fused up to DECODE_FUSED_COMBINE_MAX_VALUES merged values a block
    (group x head_dim); DecodeConfig(fused=None) follows it for the versions it was measured on
    (v4, v8) and fuses elsewhere; True and False force it; the FUSED define of v4's and v8's
    kernels says the same."""
    from iokernels.cupy_raw.decode_config import DecodeConfig
    from iokernels.cupy_raw.decode_v8_config import v8_defines
    cap = P.DECODE_FUSED_COMBINE_MAX_VALUES
    assert [P.decode_fuse_combine(g, 128) for g in (1, cap // 128, cap // 128 + 1, 64)] == [True, True, False, False]
    assert P.decode_fuse_combine(8, 128) and not P.decode_fuse_combine(8, 256) and P.decode_fuse_combine(16, 64)
    for version in ("v3", "v4", "v5", "v6", "v8"):
        for g in (1, 4, 8, 9, 16, 32):
            for d in (64, 128, 256):
                want = P.decode_fuse_combine(g, d) if version in P.DECODE_FUSE_BY_RULE else True
                assert DecodeConfig(version).combine_fused(g, d) is want, (version, g, d)
                assert DecodeConfig(version, fused=True).combine_fused(g, d) is True
                assert DecodeConfig(version, fused=False).combine_fused(g, d) is False
    base = dict(IK_DTYPE=1, HEAD_DIM=128, PAGED=0, BLOCK_SIZE=0)
    for g, fused in ((4, 1), (8, 1), (16, 0)):
        df = DecodeConfig("v4").defines(128, "bfloat16", g, False, 0, aligned=True, smem_limit=232448, cc=90)
        assert df["FUSED"] == fused, g
    assert v8_defines(DecodeConfig("v8"), dict(base, GROUP=32), 128, "bfloat16", 32, 232448)["FUSED"] == 0
    assert v8_defines(DecodeConfig("v8", fused=True), dict(base, GROUP=32), 128, "bfloat16", 32, 232448)["FUSED"] == 1
    with pytest.raises(ValueError, match="config.fused"):
        DecodeConfig("v4", fused=1)


def test_the_separate_combine_kernel_is_a_config_setting():
    """DecodeConfig.combine names the separate combine's kernel; unset, the policy's default."""
    from iokernels.cupy_raw.decode_config import DecodeConfig
    assert P.DECODE_COMBINE_DEFAULT in P.DECODE_COMBINES == ("serial", "parallel")
    assert DecodeConfig("v4").combine_kernel() == P.DECODE_COMBINE_DEFAULT
    for kind in P.DECODE_COMBINES:
        assert DecodeConfig("v1", combine=kind).combine_kernel() == kind
    for bad in ("fast", True, 1):
        with pytest.raises(ValueError, match="config.combine"):
            DecodeConfig("v4", combine=bad)


def _segments(pairs, keys, W, G):
    """decode_v9.cu's deal, block by block: (block, pair, slot, segs, lo, hi) of every segment."""
    out = []
    for j in range(G):
        f0, f1 = j * W, min((j + 1) * W, pairs * keys)
        p = f0 // keys
        while p * keys < f1:
            first = p * keys // W
            out.append((j, p, j - first, ((p + 1) * keys - 1) // W - first + 1,
                        max(f0, p * keys) - p * keys, min(f1, (p + 1) * keys) - p * keys))
            p += 1
    return out


def _deal(pairs, keys, blocks):
    """(G, W, S, keys a pair in the kernel's layout) of decode v9 without a split count: the
    balanced deal where policy.decode_balanced_deal finds one, else v4's splits at one split a
    pair (the tests' stand-in for the launcher's wave rule)."""
    deal = P.decode_balanced_deal(pairs, keys, blocks)
    if deal is not None:
        return (*deal, keys)
    W, S, padded = P.decode_pair_deal(keys, 1)
    return pairs * S, W, S, padded


@pytest.mark.parametrize("pairs,keys,blocks,splits", [(136, 1000, 132, None), (136, 4096, 132, None),
                                                      (192, 3000, 132, None), (1, 50000, 132, 127),
                                                      (8, 1000, 132, 5), (3, 1, 132, 3), (17, 257, 40, 4),
                                                      (136, 4096, 132, 3)])
def test_decode_v9_covers_every_key_once(pairs, keys, blocks, splits):
    """decode v9's deals (policy.decode_balanced_deal, decode_pair_deal), walked as decode_v9.cu
    walks them: each pair's keys [0, keys) covered exactly once by segments whose slots
    0..segs-1 are all below S <= DECODE_MAX_SPLITS (S the most segments of a pair), every block
    W keys of the layout (the last the rest); the balanced deal within one wave of ``blocks``."""
    if splits is None:
        G, W, S, layout = _deal(pairs, keys, blocks)
    else:
        W, S, layout = P.decode_pair_deal(keys, splits)
        G = pairs * S
    assert 1 <= S <= P.DECODE_MAX_SPLITS and layout >= keys
    assert (G - 1) * W < pairs * layout <= G * W
    if P.decode_balanced_deal(pairs, keys, blocks) is not None and splits is None:
        assert G <= blocks and W >= P.DECODE_BALANCED_MIN_KEYS
    seen = {}
    for j, p, slot, segs, lo, hi in _segments(pairs, layout, W, G):
        assert 0 <= slot < segs <= S and lo < hi
        seen.setdefault(p, []).append((slot, segs, lo, hi))
    assert sorted(seen) == list(range(pairs))
    for p, segs in seen.items():
        segs.sort()
        assert [s[0] for s in segs] == list(range(len(segs))) and all(s[1] == len(segs) for s in segs)
        assert segs[0][2] == 0 and segs[-1][3] == layout
        assert all(a[3] == b[2] for a, b in zip(segs, segs[1:]))          # no gap, no overlap
    assert S == max(len(s) for s in seen.values())


def test_decode_v9_balances_only_a_last_wave_worth_removing():
    """The balanced deal where one block a pair leaves a last wave (batch 17 x 8 KV heads on 132
    SMs: one wave of runs); not where the pairs make whole waves (batch 64 x 8), are fewer than
    the blocks (few sequences) or the runs would be short (N = 256); there v4's splits, each a
    pair's run (decode_pair_deal: S splits of ceil(keys / S), the pair padded to whole runs)."""
    G, W, S = P.decode_balanced_deal(136, 1000, 132)
    assert G == 132 and S == 2 and W == -(-136 * 1000 // 132)
    # the GPU test's batch 34 x 8 deals across pairs at one and at two blocks an SM
    assert all(P.decode_balanced_deal(272, 1000, b) is not None for b in (132, 264))
    assert P.decode_balanced_deal(512, 4096, 132) is None                  # whole waves
    assert P.decode_balanced_deal(8, 50000, 132) is None                   # fewer pairs than blocks
    assert P.decode_balanced_deal(136, 256, 132) is None                   # runs of about 264 keys
    assert P.decode_pair_deal(4096, 3) == (1366, 3, 4098)
    assert P.decode_pair_deal(1000, 1) == (1000, 1, 1000) and P.decode_pair_deal(5, 8) == (1, 5, 5)


def _static(version, fn, batch, undealt=None):
    """A SplitStatic of decode ``version`` built by hand (no GPU: ``fn`` stands in for the kernel,
    its occupancy given): batch x 8 KV heads, g = 4, d = 128, float16, 132 SMs, one block an SM."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.decode_config import DecodeConfig
    from iokernels.cupy_raw.decode_launch import SplitStatic
    cfg = DecodeConfig(version)
    defines = cfg.defines(128, "float16", 4, False, 0, smem_limit=227 * 1024, cc=90, pairs=batch * 8, sms=132)
    return SplitStatic(REGISTRY.get("decode", version), cfg, fn, defines, 32 * defines["NUM_WARPS"],
                       bool(defines.get("FUSED", 0)), True, 0, batch, 32, 8, 128, "float16", 4, None, False, 0,
                       True, 227 * 1024, 132, float, blocks_per_sm=1, undealt=undealt)


@pytest.mark.parametrize("batch,keys,splits,dealt", [(17, 1000, None, True), (17, 256, None, False),
                                                     (64, 4096, None, False), (1, 50000, None, False),
                                                     (17, 1000, 1, None), (17, 4096, 3, None)])
def test_decode_v9_launches_v4_where_its_deal_is_declined(batch, keys, splits, dealt):
    """decode v9's launch (decode_launch.split_launch): the balanced deal on v9's kernel where
    policy.decode_balanced_deal finds one; where it declines, v4's own launch (its static: its
    kernel, its split count, its grid), so v9 is v4 there; a named split count runs v4's splits
    as runs of v9's kernel (dealt None: the pair deal)."""
    from types import SimpleNamespace

    from iokernels.cupy_raw.decode_launch import split_launch
    fn9, fn4 = (SimpleNamespace(max_dynamic_shared_size_bytes=1 << 20) for _ in range(2))
    v4 = _static("v4", fn4, batch)
    v9 = _static("v9", fn9, batch, undealt=v4)
    assert v4.defines == v9.defines                      # one config, one set of defines: v4's kernel
    S, smem, table, grid, st = split_launch(v9, splits, keys)
    if dealt is False:
        assert st is v4 and st.fn is fn4
        assert (S, smem, table, grid) == split_launch(v4, None, keys)[:4]
        assert grid == (S, 8, batch) and table == ()
        return
    assert st is v9 and st.fn is fn9 and grid[1:] == (1, 1)
    W = int(table[-1])
    if dealt:
        assert (grid[0], W, S) == P.decode_balanced_deal(batch * 8, keys, 132)
    else:
        assert (W, S, int(table[-2])) == P.decode_pair_deal(keys, splits) and grid[0] == batch * 8 * S


def test_the_sanitizer_s_dealt_v9_case_is_dealt():
    """sanitize._dealt's batch (a wave of blocks + DEALT_EXTRA_PAIRS pairs, GQA 4/2, DEALT_KEYS keys)
    is one policy.decode_balanced_deal deals, on an H100's or H200's 132 SMs and an A100's 108, at
    one and two blocks an SM: the case reaches v9's own deal, not v4's launch."""
    from iokernels.cupy_raw import sanitize as S
    for sms in (132, 108):
        for per_sm in (1, 2):
            blocks = sms * per_sm
            pairs = 2 * -(-(blocks + S.DEALT_EXTRA_PAIRS) // 2)
            assert P.decode_balanced_deal(pairs, S.DEALT_KEYS, blocks) is not None, (sms, per_sm)
