"""Flash-Decoding and the paged gather in Numba CUDA, mirroring iokernels.decode and .paged.

This module holds version 1 of each kernel and the launchers; version 2 (wide loads, a
grid-stride gather) is in :mod:`.decode_v2` (``config=DecodeConfig(version=2)``), and
version 3 (a software-pipelined split kernel, a block-per-pool-block gather) in
:mod:`.decode_v3` (``DecodeConfig(version=3)``).  A config without a version runs
``DEFAULT_VERSIONS``: the version 3 split kernels and the version 1 gather, the fastest
measured.

Read next to :func:`iokernels.decode.decode_split_kv` (contiguous cache),
:func:`iokernels.decode.paged_decode_split_kv` (paged cache) and
:func:`iokernels.paged.paged_gather`.

Notation:

=========  ===========================================================================
B, Hq, Hkv sequences, query heads, KV heads; g = Hq / Hkv query heads per KV head
n_b        keys of sequence b (``seq_lens``); Bn keys per tile (16; the block size if paged)
S          ``num_splits``: split s takes tiles [s*ceil(Tc/S), (s+1)*ceil(Tc/S)), as
           :func:`iokernels.decode.split_ranges`
L          lanes per key (``lanes_per_key``): a key's d dims are shared by L lanes
KG         key groups per block (KEY_GROUPS = 8); threads = KG * L; group k takes keys start+k, start+k+KG, ...
m, l, O    running max, sum and unnormalized output, per (group, query head), registers
O_s, LSE_s a split's partial output (float32) and log-sum-exp, in HBM
=========  ===========================================================================

Kernels:

* **split** (grid (S, Hkv, B)): one thread block per (split, KV head, sequence), GQA
  packed: the block's g query heads all use each K/V row it loads (the g rows of Q are
  staged through shared memory once).  Each key group walks its keys with the online
  softmax (one key at a time, so no tile of scores is held), then the KG groups' states
  are merged through shared memory (the same log-sum-exp merge as the combine kernel),
  and the block writes O_s, LSE_s; with S = 1 it writes O and LSE directly.  Paged: the
  block first stages its block-table entries in shared memory (``TABLE_STAGE`` at a
  time), then reads key c at ``pool[table[c // Bn], c % Bn, kv_head]``.
* **combine** (grid B*Hq): LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s,
  exactly :func:`iokernels.decode.merge_kernel`; all splits empty gives 0 and -inf.
* **gather** (grid: logical blocks of one sequence): block j reads its table entry once,
  then copies the block's valid slots into contiguous (Hkv, n, d) K and V; the launcher
  copies 8- or 4-byte words when a row's bytes allow (e.g. float16 rows with d % 4 == 0).

Measured on an H200 (2026-11-29 12:47 UTC; float16, GQA 32/8, d=128, B=1, N=32768; cuDNN
SDPA 2.67 TB/s of KV in the same run): version 1's split+combine 0.32 TB/s (0.12x), paged
0.17 TB/s; its gather 3.77 TB/s read+write at 131072 tokens, 0.90x a device copy.  Frank
note: version 1's scalar 2-byte loads (Numba has no 16-byte vector loads of float16) leave
too few bytes in flight; versions 2 and 3 and what they measured: :mod:`iokernels.numba_cuda`.

Counted traffic (simulator, :mod:`iokernels.numba_cuda.counting`) equals
``traffic.model("decode")`` / ``("paged_decode")`` / ``("paged_gather")`` of the NumPy
versions; the device kernels also read ``seq_lens`` (one int per block), which the NumPy
versions hold on the host.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..core import conventions as cv
from ..core import gpu
from ..decode import DEFAULT_BLOCK_N, MAX_SPLITS, num_splits_heuristic
from . import _arrays as arr
from .flash_fwd import SHARED_LIMIT_BYTES, _acc_types, _make_lane_sum, warp_mask
from numba import cuda, int32  # noqa: E402
import numba  # noqa: E402

#: block-table entries a paged split block stages in shared memory at once.
TABLE_STAGE = 32
#: lanes per key and key groups per split block: 8 groups of 16 lanes = 128 threads for
#: d = 128 (8 dims a lane); lanes stay inside one warp so their sum is a shuffle.  Small d
#: gets fewer lanes (and so fewer threads).
LANES_PER_KEY = 16
KEY_GROUPS = 8
#: keys each group loads per iteration before any arithmetic: more loads in flight per
#: thread (decode is bound by how many bytes are in flight), one softmax rescale per 4 keys.
KEYS_PER_ITER = 4
#: threads of a combine block (they share the d dims of one (sequence, head)).
COMBINE_THREADS = 128
#: partial outputs O_s a combine thread loads before it adds them up (the loop over s is
#: unrolled by this much, so the loads overlap; rolled, each waited ~0.5 us for the last:
#: 30 us for S = 128 on the H200, by ncu, next to a 62 us split kernel)
COMBINE_UNROLL = 8
#: the num_splits=None heuristic counts this many resident blocks per SM as "SMs": one
#: 4-warp block per SM cannot keep enough loads in flight to stream HBM.
RESIDENT_BLOCKS_PER_SM = 8
#: ... and for the version 2 / 3 split kernels (2-3 blocks fit an SM: v3's default 113
#: registers x 256 threads, v2's 155 x 128).  4 slots, one and a half to two waves: at B=1,
#: N=32768, GQA 32/8 on the H200 (12:26 UTC sweep) v3 took 0.122 ms with 64 splits and
#: 0.144 ms with 128 (what 8 slots chose)
RESIDENT_BLOCKS_PER_SM_V3 = 4
#: ... then rounded to a split count that divides the key tiles evenly, within this fraction:
#: at B=1 N=32768 the heuristic's 56 splits (37 tiles, the last split shorter) took 0.108-0.128
#: ms, 64 (32 tiles each) 0.100-0.114, 32 0.104 (12:40 UTC sweep)
EVEN_SPLIT_SLACK = 0.25
#: the gather kernel's block: 32 threads along a row's words, 8 rows at a time; each thread
#: issues GATHER_UNROLL rows' loads before their stores (stores could alias later loads as
#: far as the compiler knows, so without this each load waits for the previous store).
GATHER_BLOCK = (32, 8)
GATHER_UNROLL = 4


@dataclass(frozen=True)
class DecodeConfig:
    """Which decode / gather kernels run: ``version`` 1 (one thread group a key, 2-byte loads),
    2 (wide loads and a grid-stride gather, :mod:`.decode_v2`) or 3 (a software-pipelined split
    kernel with a reduce-scatter lane sum, and a block-per-pool-block gather,
    :mod:`.decode_v3`); None: the fastest measured for the call (``DEFAULT_VERSIONS``: the
    split kernels of version 3, the gather of version 1).

    lanes_per_key, keys_per_iter: version 2's and 3's split tiling (None: the version's
    defaults); key_groups (version 3 only): key groups per split block (None: KEY_GROUPS_V3);
    gather_unroll (version 3 only): words of K and of V a gather thread loads before storing
    (None: GATHER3_UNROLL).  Version 1 ignores them all.
    """

    version: int | None = None
    lanes_per_key: int | None = None
    keys_per_iter: int | None = None
    key_groups: int | None = None
    gather_unroll: int | None = None

    def __post_init__(self):
        if self.version not in (None, 1, 2, 3):
            raise ValueError(f"config: decode version must be None, 1, 2 or 3, got {self.version!r}")
        L = self.lanes_per_key
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1 or 32 % L):
            raise ValueError(f"config: lanes_per_key must divide 32 (lanes of one warp), got {L!r}")
        K = self.keys_per_iter
        if K is not None and (isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= 16):
            raise ValueError(f"config: keys_per_iter must be an integer in 1..16, got {K!r}")
        for name in ("key_groups", "gather_unroll"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 32):
                raise ValueError(f"config: {name} must be an integer in 1..32, got {x!r}")
        if self.version not in (None, 3) and (self.key_groups is not None or self.gather_unroll is not None):
            raise ValueError("config: key_groups and gather_unroll are version 3 settings")


#: the version a DecodeConfig without one runs, per operation: the split kernels that
#: measured fastest on the H200 (12:47 UTC record, B=1 N=32768 float16: v3 1.37 TB/s, v2
#: 0.88, v1 0.32) and the simplest gather, already at 0.90x a device copy (v3's 0.94x needs
#: C-contiguous pools)
DEFAULT_VERSIONS = {"decode": 3, "gather": 1}


def resolve_decode_config(config, op="decode") -> DecodeConfig:
    """``config`` (None: ``DecodeConfig()``) with its version filled in for ``op``."""
    if config is None:
        config = DecodeConfig()
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config: expected an iokernels.numba_cuda.DecodeConfig or None, got "
                         f"{type(config).__name__}")
    if config.version is None:
        config = replace(config, version=DEFAULT_VERSIONS[op])
    return config


def lanes_for(head_dim: int) -> int:
    """Lanes per key: LANES_PER_KEY, fewer for small d (at least one dim per lane)."""
    L = LANES_PER_KEY
    while L > 1 and L > head_dim:
        L //= 2
    return L


# --------------------------------------------------------------------------- split
@functools.lru_cache(maxsize=None)
def make_split(D: int, G: int, L: int, paged: bool, acc_name: str, simulated: bool):
    """The split kernel for head_dim D, g = G query heads per KV head, NT threads, L lanes."""
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    KG = KEY_GROUPS                                           # key groups per block
    NT = KG * L                                               # threads per block
    DPT = -(-D // L)                                          # dims per lane
    DPAD = DPT * L
    KPI = KEYS_PER_ITER
    KPIG = KPI * G
    SCRATCH = (KPI * G, NT) if simulated else (1, 1)
    STAGE = TABLE_STAGE
    PAGED = paged
    lane_sum = _make_lane_sum(L, KPI * G, simulated, warp_mask(NT))

    def split(q, k, v, tables, lens, o, lse, o_part, lse_part, scale, bn, nsplit):
        sp, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg, lane = tid // L, tid % L
        n_s = cuda.shared.array(1, int32)
        if tid == 0:
            n_s[0] = lens[b]                                  # read n_b (once per block)
        cuda.syncthreads()
        n = n_s[0]
        tiles = (n + bn - 1) // bn                            # split_ranges, in tiles of bn keys
        per = (tiles + nsplit - 1) // nsplit
        start, end = min(sp * per * bn, n), min((sp + 1) * per * bn, n)
        Q_s = cuda.shared.array((G, DPAD), ACC)               # SRAM: the g query rows
        tbl = cuda.shared.array(STAGE, int32)                 # SRAM: block-table entries
        red_m = cuda.shared.array(KG, ACC)                    # SRAM: per-group states to merge
        red_l = cuda.shared.array(KG, ACC)
        red_o = cuda.shared.array((KG, DPAD), ACC)
        scratch = cuda.shared.array(SCRATCH, ACC)
        for e in range(tid, G * DPAD, NT):                    # load Q group -> SRAM (if busy)
            g, dd = e // DPAD, e % DPAD
            Q_s[g, dd] = ZERO
            if dd < D and end > start:
                Q_s[g, dd] = ACC(q[b, hk * G + g, dd]) * scale
        cuda.syncthreads()
        q_r = cuda.local.array((G, DPT), ACC)                 # registers
        o_r = cuda.local.array((G, DPT), ACC)
        m = cuda.local.array(G, ACC)
        l = cuda.local.array(G, ACC)
        sc = cuda.local.array(KPIG, ACC)                      # scores of KPI keys x g heads
        kk = cuda.local.array((KPI, DPT), ACC)
        vv = cuda.local.array((KPI, DPT), ACC)
        for g in range(G):
            m[g], l[g] = NEG_INF, ZERO
            for u in range(DPT):
                q_r[g, u] = Q_s[g, lane + L * u]
                o_r[g, u] = ZERO
        chunk = STAGE * bn if PAGED else max(end - start, 1)
        for p0 in range(start, end, chunk):                   # paged: a stage of table entries
            p1 = min(p0 + chunk, end)
            if PAGED:
                for e in range(tid, (p1 - p0 + bn - 1) // bn, NT):
                    tbl[e] = tables[b, p0 // bn + e]          # load table entries -> SRAM
                cuda.syncthreads()
            for base in range(p0, p1, KG * KPI):              # every thread the same trip count
                for e in range(KPI):                          # load KPI keys' k, v -> registers
                    c = base + kg + e * KG                    # (all loads issued before any math)
                    for u in range(DPT):
                        dd = lane + L * u
                        kk[e, u] = ZERO
                        vv[e, u] = ZERO
                        if c < p1 and dd < D:
                            if PAGED:
                                blk, slot = tbl[(c - p0) // bn], (c - p0) % bn
                                kk[e, u] = ACC(k[blk, slot, hk, dd])
                                vv[e, u] = ACC(v[blk, slot, hk, dd])
                            else:
                                kk[e, u] = ACC(k[b, hk, c, dd])
                                vv[e, u] = ACC(v[b, hk, c, dd])
                for e in range(KPI):                          # s = q . k, lanes summed below
                    for g in range(G):
                        dot = ZERO
                        for u in range(DPT):
                            dot += q_r[g, u] * kk[e, u]
                        sc[e * G + g] = dot
                lane_sum(sc, scratch, tid)                    # KPI*G independent butterflies
                for g in range(G):                            # online softmax over the KPI keys
                    m_new = m[g]
                    for e in range(KPI):
                        if base + kg + e * KG < p1:
                            m_new = max(m_new, sc[e * G + g])
                    if m_new != NEG_INF:
                        alpha = math.exp(m[g] - m_new)
                        for u in range(DPT):
                            o_r[g, u] *= alpha
                        row_sum = ZERO
                        for e in range(KPI):
                            if base + kg + e * KG < p1:
                                p = math.exp(sc[e * G + g] - m_new)
                                row_sum += p
                                for u in range(DPT):
                                    o_r[g, u] += p * vv[e, u]
                        l[g] = alpha * l[g] + row_sum
                        m[g] = m_new
            if PAGED:
                cuda.syncthreads()                            # before the next stage's entries
        for g in range(G):                                    # merge the KG groups (SRAM)
            if lane == 0:
                red_m[kg] = m[g]
                red_l[kg] = l[g]
            for u in range(DPT):
                red_o[kg, lane + L * u] = o_r[g, u]
            cuda.syncthreads()
            mx = NEG_INF
            for w in range(KG):
                mx = max(mx, red_m[w])
            m_ref = ZERO if mx == NEG_INF else mx
            den = ZERO
            for w in range(KG):
                den += red_l[w] * math.exp(red_m[w] - m_ref)
            inv = ZERO if den == ZERO else ONE / den
            h = hk * G + g
            for dd in range(tid, D, NT):
                num = ZERO
                for w in range(KG):
                    num += red_o[w, dd] * math.exp(red_m[w] - m_ref)
                if nsplit == 1:
                    o[b, h, dd] = num * inv                   # write O -> HBM
                else:
                    o_part[sp, b, h, dd] = num * inv          # write O_s -> HBM
            if tid == 0:
                val = NEG_INF if den == ZERO else m_ref + math.log(den)
                if nsplit == 1:
                    lse[b, h] = val                           # write LSE -> HBM
                else:
                    lse_part[sp, b, h] = val                  # write LSE_s -> HBM
            cuda.syncthreads()

    return split


# --------------------------------------------------------------------------- combine
@functools.lru_cache(maxsize=None)
def make_combine(D: int, NT: int, acc_name: str):
    ACC = getattr(numba, acc_name)
    NEG_INF, ZERO, ONE = (np.dtype(acc_name).type(x) for x in (-np.inf, 0, 1))
    SMAX = MAX_SPLITS
    UN = COMBINE_UNROLL

    def combine(o_part, lse_part, o, lse):
        Hq = o.shape[1]
        b, h = cuda.blockIdx.x // Hq, cuda.blockIdx.x % Hq
        tid = cuda.threadIdx.x
        S = lse_part.shape[0]
        lse_s = cuda.shared.array(SMAX, ACC)
        w_s = cuda.shared.array(SMAX, ACC)
        part = cuda.local.array(UN, ACC)
        for s in range(tid, S, NT):
            lse_s[s] = lse_part[s, b, h]                      # load LSE_s -> SRAM (once)
        cuda.syncthreads()
        mx = NEG_INF
        for s in range(S):
            mx = max(mx, lse_s[s])
        m_ref = ZERO if mx == NEG_INF else mx                 # all empty: weights exp(-inf) = 0
        for s in range(tid, S, NT):
            w_s[s] = math.exp(lse_s[s] - m_ref)               # each weight once -> SRAM
        cuda.syncthreads()
        den = ZERO
        for s in range(S):
            den += w_s[s]
        inv = ZERO if den == ZERO else ONE / den
        for dd in range(tid, D, NT):
            num = ZERO
            for s0 in range(0, S, UN):                        # UN independent loads in flight:
                for e in range(UN):                           # a rolled loop would wait for
                    part[e] = ZERO                            # each O_s before asking for the next
                    if s0 + e < S:
                        part[e] = o_part[s0 + e, b, h, dd]    # read O_s <- HBM
                for e in range(UN):
                    if s0 + e < S:
                        num += w_s[s0 + e] * part[e]
            o[b, h, dd] = num * inv                           # write O -> HBM
        if tid == 0:
            lse[b, h] = NEG_INF if den == ZERO else m_ref + math.log(den)

    return combine


# --------------------------------------------------------------------------- gather
@functools.lru_cache(maxsize=None)
def make_gather(word_name: str = "uint32"):
    """The gather kernel for pool elements (or reinterpreted words) of dtype ``word_name``."""
    TX, TY = GATHER_BLOCK
    UN = GATHER_UNROLL
    WORD = numba.from_dtype(np.dtype(word_name))

    def gather(k_pool, v_pool, table, k_out, v_out, n):
        j = cuda.blockIdx.x                                   # logical block j of the sequence
        bs, H, W = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        blk_s = cuda.shared.array(1, int32)
        if tx == 0 and ty == 0:
            blk_s[0] = table[j]                               # read the table entry (once)
        cuda.syncthreads()
        blk = blk_s[0]
        t0 = j * bs
        rows = min(bs, n - t0) * H                            # valid (slot, head) rows only
        ka = cuda.local.array(UN, WORD)
        va = cuda.local.array(UN, WORD)
        for w in range(tx, W, TX):
            for r0 in range(ty, rows, TY * UN):
                for e in range(UN):                           # UN rows' loads first ...
                    r = r0 + e * TY
                    if r < rows:
                        slot, hh = r // H, r % H              # pool order: heads fastest
                        ka[e] = k_pool[blk, slot, hh, w]
                        va[e] = v_pool[blk, slot, hh, w]
                for e in range(UN):                           # ... then their stores
                    r = r0 + e * TY
                    if r < rows:
                        slot, hh = r // H, r % H
                        k_out[hh, t0 + slot, w] = ka[e]
                        v_out[hh, t0 + slot, w] = va[e]

    return gather


@functools.lru_cache(maxsize=None)
def _jitted(pyfunc):
    return cuda.jit(pyfunc)


# --------------------------------------------------------------------------- launchers
def _num_sms() -> int:
    try:
        n = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None)
        return int(n) if n else 132
    except Exception:  # the simulator's fake device has no SM count
        return 132


def default_num_splits(batch, heads_kv, max_len, block_n, config=None) -> int:
    """decode.num_splits_heuristic, counting the split kernel's block slots per SM
    (RESIDENT_BLOCKS_PER_SM for version 1, RESIDENT_BLOCKS_PER_SM_V3 for versions 2 and 3)."""
    version = resolve_decode_config(config).version
    if version == 1:
        return num_splits_heuristic(batch, heads_kv, max_len, _num_sms() * RESIDENT_BLOCKS_PER_SM,
                                    block_n=block_n)
    s0 = num_splits_heuristic(batch, heads_kv, max_len, _num_sms() * RESIDENT_BLOCKS_PER_SM_V3, block_n=block_n)
    return even_splits(s0, -(-max_len // block_n))


def even_splits(s0: int, tiles: int, slack: float = EVEN_SPLIT_SLACK) -> int:
    """The split count within ``slack`` (a fraction) of ``s0`` that gives every split the same
    number of key tiles (no straggler holding up the combine), the nearest one; ``s0`` when
    none does."""
    lo, hi = max(1, math.ceil(s0 * (1 - slack))), min(MAX_SPLITS, math.floor(s0 * (1 + slack)))
    even = [s for s in range(lo, hi + 1) if tiles % s == 0]
    return min(even, key=lambda s: (abs(s - s0), s)) if even else s0


def split_kernel_function(head_dim, g, dtype, paged, simulated=None):
    acc_name = np.dtype(_acc_types(dtype)[0]).name
    if simulated is None:
        simulated = gpu.simulator_enabled()
    return make_split(head_dim, g, lanes_for(head_dim), paged, acc_name, simulated)


def combine_kernel_function(head_dim, dtype):
    return make_combine(head_dim, COMBINE_THREADS, np.dtype(_acc_types(dtype)[0]).name)


def check_split_smem(head_dim, g, dtype):
    acc = np.dtype(_acc_types(dtype)[0]).itemsize
    L = lanes_for(head_dim)
    dpad = -(-head_dim // L) * L
    need = (g * dpad + KEY_GROUPS * (dpad + 2)) * acc + TABLE_STAGE * 4
    if need > SHARED_LIMIT_BYTES:
        raise ValueError(f"q: {g} query heads per KV head at head_dim {head_dim} ({dtype}) need {need:,} B of "
                         f"shared memory in the numba decode kernel, more than {SHARED_LIMIT_BYTES:,}")


def lanes_v2(head_dim, dtype, word_name, config=None):
    """Version 2's lanes per key: the config's (or LANES_PER_KEY_V2), fewer when a row has
    fewer words than lanes."""
    from . import decode_v2 as v2
    cfg = resolve_decode_config(config)
    epw = np.dtype(word_name).itemsize // np.dtype(dtype).itemsize
    words = -(-head_dim // epw)
    L = cfg.lanes_per_key or v2.LANES_PER_KEY_V2
    while L > 1 and L > words:
        L //= 2
    return L


def split_v2_kernel_function(head_dim, g, dtype, paged, block_n, word_name, config=None, simulated=None):
    from . import decode_v2 as v2
    cfg = resolve_decode_config(config)
    if simulated is None:
        simulated = gpu.simulator_enabled()
    acc_name = np.dtype(_acc_types(dtype)[0]).name
    return v2.make_split_v2(head_dim, g, lanes_v2(head_dim, dtype, word_name, cfg),
                            cfg.keys_per_iter or v2.KEYS_PER_ITER_V2, int(block_n), paged, dtype, word_name,
                            acc_name, simulated)


def launch_decode(q, k, v, tables, lens, o, lse, o_part, lse_part, *, scale, block_n, paged, config=None,
                  stream=0):
    """Launch split (+ combine when S > 1) on device or counting arrays already allocated, on
    ``stream`` (:func:`._arrays.stream_of`).

    o_part / lse_part: (S, B, Hq, d) / (S, B, Hq) float32 scratch (any shape when S == 1).
    Version 2 (``config``): k and v are the word views of :func:`_kv_words`.
    """
    cfg = resolve_decode_config(config)
    B, Hq, d = q.shape
    Hkv = k.shape[2] if paged else k.shape[1]
    dtype = str(np.dtype(o.dtype))
    acc_t = _acc_types(dtype)[0]
    S = int(lse_part.shape[0])
    if B == 0:
        return
    if cfg.version == 3:
        from .decode_v3 import launch_split_v3
        launch_split_v3(q, k, v, tables, lens, o, lse, o_part, lse_part, scale=scale, block_n=block_n,
                        paged=paged, config=cfg, stream=stream)
    elif cfg.version == 2:
        from .decode_v2 import KEY_GROUPS_V2
        word = str(np.dtype(k.dtype))
        split = _jitted(split_v2_kernel_function(d, Hq // Hkv, dtype, paged, block_n, word, cfg))
        split[(S, Hkv, B), KEY_GROUPS_V2 * lanes_v2(d, dtype, word, cfg), stream](
            q, k, v, tables, lens, o, lse, o_part, lse_part, acc_t(scale), S)
    else:
        split = _jitted(split_kernel_function(d, Hq // Hkv, dtype, paged))
        split[(S, Hkv, B), KEY_GROUPS * lanes_for(d), stream](q, k, v, tables, lens, o, lse, o_part,
                                                              lse_part, acc_t(scale), block_n, S)
    if S > 1:
        comb = _jitted(combine_kernel_function(d, dtype))
        comb[B * Hq, COMBINE_THREADS, stream](o_part, lse_part, o, lse)


def _resolve_splits(num_splits, B, Hkv, max_len, block_n, config=None):
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, max_len, block_n, config)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: the numba combine kernel merges at most {MAX_SPLITS} splits, "
                         f"got {num_splits}")
    return num_splits


def _aligned(x, nbytes) -> bool:
    """Whether a (C-contiguous) device array starts on an nbytes boundary: word views need it
    (a torch slice with an odd storage offset does not)."""
    try:
        return x.__cuda_array_interface__["data"][0] % nbytes == 0
    except (AttributeError, KeyError, TypeError):   # the simulator's arrays wrap NumPy ones
        ary = getattr(x, "_ary", x)
        return isinstance(ary, np.ndarray) and ary.flags.c_contiguous and ary.ctypes.data % nbytes == 0


def _contiguous(x) -> bool:
    f = getattr(x, "is_c_contiguous", None)
    if callable(f):
        return bool(f())
    ary = getattr(x, "_ary", x)
    return isinstance(ary, np.ndarray) and ary.flags.c_contiguous


def _kv_words(k, v, head_dim, dtype):
    """Version 2's K and V: 8-byte word views (no copy) when the row bytes, contiguity and
    alignment allow, else the arrays themselves (one element a word)."""
    from .decode_v2 import WORD_BYTES, word_layout
    ok = all(_contiguous(x) and _aligned(x, WORD_BYTES) for x in (k, v))
    word, epw = word_layout(dtype, head_dim, aligned=ok)
    if epw == 1:
        return k, v, word
    return k.view(np.dtype(word)), v.view(np.dtype(word)), word


def _decode_common(kind, q, k, v, tables_h, lens_h, num_splits, scale, block_n, paged, max_len, config=None):
    chosen = isinstance(config, DecodeConfig) and config.version is not None
    cfg = resolve_decode_config(config)
    dtype = arr.check_dtype(q, "q")
    B, Hq, d = (int(x) for x in q.shape)
    scale = cv.resolve_scale(scale, d)
    Hkv = int(k.shape[2] if paged else k.shape[1])
    check_split_smem(d, Hq // Hkv, dtype)
    acc_t = _acc_types(dtype)[0]
    dq, dk, dv = (arr.to_device(x, kind) for x in (q, k, v))
    if cfg.version == 3 and not chosen:
        from .decode_v3 import c_contiguous
        if not all(c_contiguous(x) for x in (dk, dv)):   # the default, on a strided cache:
            cfg = replace(cfg, version=1)                  # the kernel that takes any strides
    S = _resolve_splits(num_splits, B, Hkv, max_len, block_n, cfg)
    tables = arr.upload_constant(np.asarray(tables_h, dtype=np.int32))
    lens = arr.upload_constant(np.asarray(lens_h, dtype=np.int32))
    o_h, o_d = arr.empty(kind, q, (B, Hq, d), dtype)
    lse_h, lse_d = arr.empty(kind, q, (B, Hq), acc_t)
    if S > 1:
        _, op = arr.empty(kind, q, (S, B, Hq, d), acc_t)
        _, lp = arr.empty(kind, q, (S, B, Hq), acc_t)
    else:
        op = arr.upload_constant(np.zeros((1, 1, 1, 1), acc_t))   # unused: S == 1 writes O, LSE
        lp = arr.upload_constant(np.zeros((1, 1, 1), acc_t))
    if cfg.version in (2, 3):
        from .decode_v2 import split_v2_smem_bytes
        from .decode_v3 import split_v3_smem_bytes, split_v3_tiling
        from .decode_v3 import c_contiguous
        if cfg.version == 3 and not all(c_contiguous(x) for x in (dk, dv)):
            raise ValueError("k, v: decode version 3 reads the cache through flat views and needs C-contiguous "
                             "K and V (call .contiguous() / np.ascontiguousarray, or use version 1 or 2)")
        dk, dv, word = _kv_words(dk, dv, d, dtype)
        if cfg.version == 2:
            need = split_v2_smem_bytes(d, Hq // Hkv, dtype, word, lanes_v2(d, dtype, word, cfg))
        else:
            L3, _, KG3 = split_v3_tiling(d, dtype, word, cfg)
            need = split_v3_smem_bytes(d, Hq // Hkv, dtype, word, L3, KG3)
        if need > SHARED_LIMIT_BYTES:
            raise ValueError(f"q: {Hq // Hkv} query heads per KV head at head_dim {d} ({dtype}) need {need:,} B "
                             f"of shared memory in the numba decode kernel v{cfg.version}, more than "
                             f"{SHARED_LIMIT_BYTES:,}")
    launch_decode(dq, dk, dv, tables, lens, o_d, lse_d, op, lp, scale=scale, block_n=block_n, paged=paged,
                  config=cfg, stream=arr.stream_of(kind, q))
    return arr.finish(kind, o_h), arr.finish(kind, lse_h)


def decode(q, k, v, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """Public backend: Flash-Decoding over a contiguous (ragged) cache. Returns (o, lse).

    ``config``: a :class:`DecodeConfig` (None: version 3; version 1 for a strided cache)."""
    resolve_decode_config(config)
    kind = arr.check_kinds(q=q, k=k, v=v)
    B, N = int(k.shape[0]), int(k.shape[2])
    lens = np.full(B, N, np.int32) if seq_lens is None else np.asarray(seq_lens, np.int32)
    dummy_table = np.zeros((1, 1), np.int32)
    return _decode_common(kind, q, k, v, dummy_table, lens, num_splits, scale, DEFAULT_BLOCK_N, False,
                          int(lens.max(initial=0)), config)


def paged_decode_pools(q, k_pool, v_pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None):
    """Paged Flash-Decoding over pools (num_blocks, block_size, Hkv, d) of any array kind.

    block_tables: int32 (B, max_blocks) NumPy, seq_lens: (B,) NumPy (host: they size the launch).
    ``config``: a :class:`DecodeConfig` (None: version 3; version 1 for strided pools).
    """
    resolve_decode_config(config)
    kind = arr.check_kinds(q=q, k_pool=k_pool, v_pool=v_pool)
    lens = np.asarray(seq_lens, np.int32)
    tables = np.asarray(block_tables, np.int32)
    if tables.ndim != 2 or tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables: expected ({q.shape[0]}, max_blocks) int32, got shape {tables.shape}")
    if tables.size == 0:
        tables = np.zeros((q.shape[0], 1), np.int32)
    return _decode_common(kind, q, k_pool, v_pool, tables, lens, num_splits, scale, int(k_pool.shape[1]),
                          True, int(lens.max(initial=0)), config)


def paged_decode(q, cache, seq_ids, *, num_splits=None, scale=None, config=None):
    """Public backend: decode over a PagedKVCache (its NumPy pools are copied to the device)."""
    resolve_decode_config(config)
    tables, lens = cache.block_tables_array(list(seq_ids))
    kind = arr.check_kinds(q=q)
    if kind == "numpy":
        pools = (cache.k_pool, cache.v_pool)
    else:
        pools = _pools_like(kind, q, cache)
    return paged_decode_pools(q, pools[0], pools[1], tables, lens, num_splits=num_splits, scale=scale,
                              config=config)


def _pools_like(kind, like, cache):
    if kind == "torch":
        import torch
        return tuple(torch.as_tensor(p, device=like.device) for p in (cache.k_pool, cache.v_pool))
    if kind == "cupy":
        import cupy
        return tuple(cupy.asarray(p) for p in (cache.k_pool, cache.v_pool))
    return tuple(cuda.to_device(p) for p in (cache.k_pool, cache.v_pool))


def _word_view(x, d, itemsize):
    """View a device array's rows as 8- or 4-byte words when d * itemsize allows (fewer, wider
    copies); else leave it as elements."""
    for word in (np.uint64, np.uint32):
        size = np.dtype(word).itemsize
        if (d * itemsize) % size == 0 and itemsize < size:
            return x.view(word)
    return x


def launch_gather(k_pool, v_pool, table, k_out, v_out, seq_len, stream=0):
    bs = int(k_pool.shape[1])
    nblk = -(-seq_len // bs)
    if nblk == 0:
        return
    kern = _jitted(make_gather(str(np.dtype(k_pool.dtype))))
    kern[nblk, GATHER_BLOCK, stream](k_pool, v_pool, table, k_out, v_out, seq_len)


def launch_gather_v2(kw, vw, table, k_out, v_out, seq_len, *, parts=None, stream=0):
    """Gather v2 on pools (num_blocks, bs, Hkv, W) and outputs (Hkv, n, W) of words (device or
    counting arrays); ``parts``: P (None: :func:`decode_v2.gather_v2_plan` picks it)."""
    from . import decode_v2 as v2
    nb, bs, hkv, W = (int(x) for x in kw.shape)
    nblk = -(-seq_len // bs)
    if nblk == 0:
        return
    grid, P, part_words = v2.gather_v2_plan(nblk, bs * hkv * W, _num_sms())
    if parts is not None:
        P = int(parts)
        part_words = -(-(bs * hkv * W) // P)
        grid = max(1, min(-(-(nblk * P) // (v2.GATHER2_THREADS // v2.WARP_SIZE)),
                          _num_sms() * v2.GATHER2_BLOCKS_PER_SM))
    kern = _jitted(v2.make_gather_v2(str(np.dtype(kw.dtype)), W, hkv, bs, gpu.simulator_enabled()))
    flat = (nb, bs * hkv * W)
    kern[grid, v2.GATHER2_THREADS, stream](kw.reshape(flat), vw.reshape(flat), table, k_out, v_out, seq_len,
                                           nblk, P, part_words)


def gather_pools(k_pool, v_pool, block_table, seq_len, *, words=True, config=None):
    """Paged gather: pools (num_blocks, bs, Hkv, d) + a block table -> contiguous (Hkv, n, d) K, V.

    ``config``: a :class:`DecodeConfig`; version 2 is the grid-stride gather of
    :mod:`.decode_v2` (8-byte words whenever the rows and alignment allow)."""
    cfg = resolve_decode_config(config, "gather")
    from ..paged import check_block_table
    kind = arr.check_kinds(k_pool=k_pool, v_pool=v_pool)
    arr.check_dtype(k_pool, "k_pool")
    nb, bs, hkv, d = (int(x) for x in k_pool.shape)
    table = check_block_table(np.asarray(block_table), seq_len, nb, bs)
    dtype = np.dtype(str(k_pool.dtype).replace("torch.", ""))
    kp, vp = arr.to_device(k_pool, kind), arr.to_device(v_pool, kind)
    k_h, k_d = arr.empty(kind, k_pool, (hkv, seq_len, d), dtype)
    v_h, v_d = arr.empty(kind, k_pool, (hkv, seq_len, d), dtype)
    tbl = arr.upload_constant(np.asarray(table, np.int32) if table.size else np.zeros(1, np.int32))
    if cfg.version in (2, 3):
        if seq_len:
            from .decode_v2 import WORD_BYTES, word_layout
            ok = all(_aligned(x, WORD_BYTES) and _contiguous(x) for x in (kp, vp, k_d, v_d))
            word, epw = word_layout(dtype.name, d, aligned=ok and words)
            if epw > 1:
                kp, vp, k_d, v_d = (x.view(np.dtype(word)) for x in (kp, vp, k_d, v_d))
            if cfg.version == 3:
                from .decode_v3 import c_contiguous, launch_gather_v3
                if not all(c_contiguous(x) for x in (kp, vp)):
                    raise ValueError("k_pool, v_pool: gather version 3 reads the pools through flat views and "
                                     "needs C-contiguous pools (or use version 1 or 2)")
                launch_gather_v3(kp, vp, tbl, k_d, v_d, seq_len, config=cfg, stream=arr.stream_of(kind, k_pool))
            else:
                launch_gather_v2(kp, vp, tbl, k_d, v_d, seq_len, stream=arr.stream_of(kind, k_pool))
        return arr.finish(kind, k_h), arr.finish(kind, v_h)
    if words and seq_len:
        kp, vp, k_d, v_d = (_word_view(x, d, dtype.itemsize) for x in (kp, vp, k_d, v_d))
    launch_gather(kp, vp, tbl, k_d, v_d, seq_len, stream=arr.stream_of(kind, k_pool))
    return arr.finish(kind, k_h), arr.finish(kind, v_h)


def paged_gather(cache, sid, *, config=None):
    """What ``cache.gather(sid, backend="numba")`` calls: NumPy pools in, NumPy K, V out."""
    return gather_pools(cache.k_pool, cache.v_pool, cache.block_table(sid), cache.seq_len(sid), config=config)
