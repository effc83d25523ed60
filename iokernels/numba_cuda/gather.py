"""The paged gather in Numba CUDA: a sequence's K and V copied out of the block pool into
contiguous (Hkv, n, d) arrays, mirroring :func:`iokernels.paged.paged_gather`.

Notation: Bs slots a pool block, Hkv KV heads, d head dim; a *logical* block j of the
sequence holds tokens [j*Bs, (j+1)*Bs) and lives in pool block ``table[j]``; W words a row
(8- or 4-byte words when the row's bytes allow, else elements); UN words a thread loads
before it stores any.

The versions (``GatherConfig(version=...)``):

* **v1** (the default: it takes any strides) one thread block per logical block j: the
  block reads its table entry once (shared memory, one barrier), then its (32, 8) threads
  copy the block's valid (slot, head) rows, ``GATHER_UNROLL`` rows' loads issued before
  their stores (a store could alias a later load as far as the compiler knows, so without
  this each load would wait for the previous store).  The launcher copies 8- or 4-byte
  words when a row's bytes allow (e.g. float16 rows with d % 4 == 0).
* **v3** one thread block per pool block, reading the pool block as one flat run of 8-byte
  words (coalesced) through raw pointers, UN words of K and of V a thread loaded before
  its stores, the index divisions by compile-time constants (multiply-shifts).  Needs
  C-contiguous pools (flat views).

Counted traffic (simulator, :mod:`.counting`): both == ``traffic.model("paged_gather")``
(one table read per block).
"""
from __future__ import annotations

import functools

import numpy as np

from . import launch as ln
from .device import WORD_BYTES, make_flat_access, word_layout
from .launch import cuda
import numba  # noqa: E402
from numba import int32  # noqa: E402

#: v1's block: 32 threads along a row's words, 8 rows at a time; each thread issues
#: GATHER_UNROLL rows' loads before their stores.
GATHER_BLOCK = (32, 8)
GATHER_UNROLL = 4
#: v3: threads per block (8 warps) and words of K and of V each thread loads before it
#: stores any (at float16 d=128, Bs=16, Hkv=8 a pool block is two passes of 256 x 8 words;
#: a larger UN makes it one pass for about twice the registers).
GATHER3_THREADS = 256
GATHER3_UNROLL = 8


# --------------------------------------------------------------------------- v1
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


# --------------------------------------------------------------------------- v3
@functools.lru_cache(maxsize=None)
def make_gather_v3(word_name: str, W: int, H: int, BS: int, NT: int, UN: int, simulated: bool):
    """Gather v3 for pools of ``word_name`` words: W words a row, H KV heads, BS slots a block,
    NT threads, UN words of K and of V in flight a thread.  Pools and outputs come in flat
    (1-D); W, H and BS are compile-time constants, so the index divisions are multiply-shifts."""
    WORD = numba.from_dtype(np.dtype(word_name))
    ROWW = H * W                                              # words of one slot (all heads)
    BLKW = BS * ROWW                                          # words of one pool block
    PASS = NT * UN                                            # words a block moves per pass
    load, store = make_flat_access(simulated)

    def gather_v3(k_pool, v_pool, table, k_out, v_out, n):
        j = cuda.blockIdx.x                                   # logical block j of the sequence
        tid = cuda.threadIdx.x
        blk_s = cuda.shared.array(1, int32)
        if tid == 0:
            blk_s[0] = table[j]                               # read the table entry (once)
        cuda.syncthreads()
        src = blk_s[0] * BLKW                                 # the pool block's first word
        t0 = j * BS
        valid = min(BS, n - t0) * ROWW                        # valid slots only
        ka = cuda.local.array(UN, WORD)
        va = cuda.local.array(UN, WORD)
        for x0 in range(0, valid, PASS):                      # one pass at the defaults
            for e in range(UN):                               # UN words of K and V: loads ...
                x = x0 + tid + e * NT                         # (coalesced: a flat run)
                if x < valid:
                    ka[e] = load(k_pool, src + x)
                    va[e] = load(v_pool, src + x)
            for e in range(UN):                               # ... then their stores
                x = x0 + tid + e * NT
                if x < valid:
                    slot = x // ROWW                          # constants: multiply-shifts
                    hh = (x - slot * ROWW) // W
                    w = x - slot * ROWW - hh * W
                    dst = (hh * n + t0 + slot) * W + w        # out[hh, t0 + slot, w]
                    store(k_out, dst, ka[e])
                    store(v_out, dst, va[e])

    return gather_v3


def gather_v3_kernel_function(word_name, W, H, BS, config=None, simulated=None):
    if simulated is None:
        simulated = ln.simulated()
    UN = (config.unroll if config is not None else None) or GATHER3_UNROLL
    return make_gather_v3(word_name, int(W), int(H), int(BS), GATHER3_THREADS, UN, simulated)


# --------------------------------------------------------------------------- launch
def word_view(x, d, itemsize):
    """v1: a device array's rows as 8- or 4-byte words when d * itemsize allows (fewer, wider
    copies); else the elements."""
    for word in (np.uint64, np.uint32):
        size = np.dtype(word).itemsize
        if (d * itemsize) % size == 0 and itemsize < size:
            return x.view(word)
    return x


def launch_gather(k_pool, v_pool, table, k_out, v_out, seq_len, stream=0):
    """Gather v1 on pools (num_blocks, bs, Hkv, W) and outputs (Hkv, n, W) (device or counting)."""
    bs = int(k_pool.shape[1])
    nblk = -(-seq_len // bs)
    if nblk == 0:
        return
    kern = ln.jitted(make_gather(str(np.dtype(k_pool.dtype))))
    kern[nblk, GATHER_BLOCK, stream](k_pool, v_pool, table, k_out, v_out, seq_len)


def launch_gather_v3(kw, vw, table, k_out, v_out, seq_len, *, config=None, stream=0):
    """Gather v3 on pools (num_blocks, bs, Hkv, W) and outputs (Hkv, n, W) of words (device or
    counting arrays): one thread block per logical block."""
    nb, bs, hkv, W = (int(x) for x in kw.shape)
    nblk = -(-seq_len // bs)
    if nblk == 0:
        return
    kern = ln.jitted(gather_v3_kernel_function(str(np.dtype(kw.dtype)), W, hkv, bs, config))
    ps, os_ = nb * bs * hkv * W, hkv * seq_len * W
    kern[nblk, GATHER3_THREADS, stream](kw.reshape(ps), vw.reshape(ps), table, k_out.reshape(os_),
                                        v_out.reshape(os_), seq_len)


def gather_pools(k_pool, v_pool, block_table, seq_len, *, words=True, config):
    """The gather launcher (every version): pools (num_blocks, bs, Hkv, d) + a block table ->
    contiguous (Hkv, n, d) K, V of the pools' kind.  ``words=False``: v1 copies elements."""
    from ..paged import check_block_table
    call = ln.call_for(k_pool, "k_pool")
    call.check(v_pool, "v_pool")
    dtype = ln.check_dtype(k_pool, "k_pool")
    nb, bs, hkv, d = (int(x) for x in k_pool.shape)
    table = check_block_table(np.asarray(block_table), seq_len, nb, bs)
    kp, vp = ln.device_in(call, k_pool, "k_pool"), ln.device_in(call, v_pool, "v_pool")
    k_h, k_d = ln.empty(call, (hkv, seq_len, d), dtype)
    v_h, v_d = ln.empty(call, (hkv, seq_len, d), dtype)
    tbl = ln.upload_constant(np.asarray(table, np.int32) if table.size else np.zeros(1, np.int32))
    if config.version == "v3":
        if not all(ln.c_contiguous(x) for x in (kp, vp)):
            raise ValueError("k_pool, v_pool: gather v3 reads the pools through flat views and needs "
                             "C-contiguous pools (or use v1)")
        if seq_len:
            ok = all(ln.aligned(x, WORD_BYTES) for x in (kp, vp, k_d, v_d))
            word, epw = word_layout(dtype, d, aligned=ok and words)
            if epw > 1:
                kp, vp, k_d, v_d = (x.view(np.dtype(word)) for x in (kp, vp, k_d, v_d))
            launch_gather_v3(kp, vp, tbl, k_d, v_d, seq_len, config=config, stream=ln.stream(call))
    else:
        if words and seq_len:
            itemsize = np.dtype(dtype).itemsize
            kp, vp, k_d, v_d = (word_view(x, d, itemsize) for x in (kp, vp, k_d, v_d))
        launch_gather(kp, vp, tbl, k_d, v_d, seq_len, stream=ln.stream(call))
    return call.finish(k_h, dtype), call.finish(v_h, dtype)


def paged_gather(cache, sid, *, config):
    """What ``cache.gather(sid, backend="numba")`` calls: NumPy pools in, NumPy K, V out."""
    return gather_pools(cache.k_pool, cache.v_pool, cache.block_table(sid), cache.seq_len(sid), config=config)

