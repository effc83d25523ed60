"""MLA decode on Hopper in CUDA C++: the launcher of kernels/mla_decode.cu.

Multi-head latent attention (DeepSeek-V2/V3; :mod:`iokernels.mla` has the NumPy forms and
the derivation) decodes, once the up-projections are absorbed, as attention with ONE cached
row per token shared by every query head: absorbed queries q (B, Hq, 576) against latent
rows c (B, N, 576), the first 512 columns of each row also its value:
O (B, Hq, 512) = softmax(scale q c^T) c[:, :, :512].  Every head reuses every row, so there
are about 2 Hq (576 + 512) / 1152 FLOPs a cache byte (240 at Hq = 128): past the H200's
ridge point, a job for the tensor cores.

=======  ==============  ====================================================================
version  file            what it is
=======  ==============  ====================================================================
v1       mla_decode.cu   one block per (64 heads, split of the keys, sequence): Q resident in
                         SRAM, 64-row tiles of the cache through a two-stage TMA ring, S on
                         wgmma, online softmax in registers, P through SRAM, O split across
                         two warpgroups (256 columns each); splits merged by decode.cu's exact
                         combine.  Limits: S runs on one warpgroup while the other waits, and
                         the softmax is not overlapped with a product
=======  ==============  ====================================================================

Notation (FlashAttention's and Flash-Decoding's):

=======  ===========================================================================
Br       64 query heads a block (``MLA_HEADS_BLOCK``); a call has ceil(Hq / 64) head blocks
Bc       64 cache rows a tile (``MLA_BLOCK_N``); a split holds a whole number of tiles
S        splits of each sequence's rows; O_s, LSE_s the partial output and its log-sum-exp
m, l     the running row max and sum of the online softmax; LSE = m + log(l)
=======  ===========================================================================

Scope: float16 and bfloat16, rows of 512 + 64 (other widths are refused by name: the kernel's
two warpgroups of 256 output columns and 9 swizzle panels are built for it), any Hq, any N,
per-sequence lengths (a length 0 gives O = 0, LSE = -inf), a contiguous cache or a paged pool
(num_blocks, page_size, 576) with page_size a multiple of 64.  Compute capability 9.0 only
(wgmma, TMA); the registry says so elsewhere.  Nothing here touches a GPU at import.
"""
from __future__ import annotations

import math

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from . import config as C
from . import hopper as hp
from .config import MLADecodeConfig
from ..core.records import Record
from .launch import HOPPER_OPTIONS, HOPPER_SOURCES, device_info, fill, function, on_stream
from .policy import mla_num_splits
from .registry import REGISTRY, need

ROW = C.MLA_LATENT + C.MLA_ROPE
DTYPES = ("float16", "bfloat16")
#: threads a block: two consumer warpgroups
THREADS = 256
#: threads a block of decode.cu's combine (one a column of a 512-wide row, two passes)
COMBINE_THREADS = 256


def default_scale() -> float:
    """DeepSeek-V3's softmax scale, 1 / sqrt(d_h + d_R) (the query width before absorption)."""
    from ..mla import DEEPSEEK_V3_MLA, default_scale as scale_of
    return scale_of(DEEPSEEK_V3_MLA["head_dim"], DEEPSEEK_V3_MLA["rope_dim"])


# --------------------------------------------------------------------------- checks
def check_v1(n) -> str | None:
    """The registry check: why a call cannot run on mla_decode.cu here, or None."""
    if n.simulator:
        return "runs on a GPU only (not the simulator)"
    if n.dtype not in DTYPES:
        return f"takes float16 / bfloat16 (tensor cores), not {n.dtype}"
    if n.head_dim != ROW:
        return (f"rows of latent {C.MLA_LATENT} + rope {C.MLA_ROPE} = {ROW} values only "
                f"(two warpgroups of {C.MLA_LATENT // 2} output columns), got {n.head_dim}")
    if n.cc is not None and n.cc != hp.HOPPER_CC:
        return f"needs compute capability 9.0 (wgmma, TMA: sm_90a); this GPU is {n.cc / 10:.1f}"
    smem = n.extra.get("smem")
    if smem is not None and C.MLADecodeConfig.smem_bytes() > smem:
        return f"needs {C.MLADecodeConfig.smem_bytes():,} B of shared memory a block; this GPU allows {smem:,}"
    return hp.available()


def _check_q(q, dtype=None):
    s = tuple(getattr(q, "shape", ()))
    if len(s) != 3 or s[2] != ROW:
        raise ValueError(f"q: expected absorbed queries (batch, heads_q, {ROW}), got {s}")
    got = cv.check_dtype(q, "q", DTYPES)
    if dtype is not None and got != dtype:
        raise ValueError(f"q: dtype must equal the cache's {dtype}, got {got}")
    return s


def _check_cache(q, kv):
    """(B, Hq, N, dtype) of a contiguous latent cache kv (B, N, 576) and its q (B, Hq, 576)."""
    ks = tuple(getattr(kv, "shape", ()))
    if len(ks) != 3 or ks[2] != ROW:
        raise ValueError(f"kv: expected latent rows (batch, seq, {C.MLA_LATENT} + {C.MLA_ROPE} = {ROW}), got {ks}; "
                         f"other latent / rope widths are not built")
    dtype = cv.check_dtype(kv, "kv", DTYPES)
    B, Hq, _ = _check_q(q, dtype)
    if B != ks[0]:
        raise ValueError(f"q: batch must equal kv's {ks[0]}, got {B}")
    return B, Hq, ks[1], dtype


def _check_pool_shape(q, pool):
    """(B, Hq, num_blocks, page_size, dtype) of a paged latent pool (num_blocks, page_size, 576) and its q."""
    ps = tuple(getattr(pool, "shape", ()))
    if len(ps) != 3 or ps[2] != ROW:
        raise ValueError(f"pool: expected (num_blocks, page_size, {ROW}), got {ps}")
    dtype = cv.check_dtype(pool, "pool", DTYPES)
    nb, page = ps[0], ps[1]
    if page % C.MLA_PAGE_MULTIPLE:
        raise ValueError(f"pool: page_size must be a multiple of {C.MLA_PAGE_MULTIPLE} (whole tiles), got {page}")
    B, Hq, _ = _check_q(q, dtype)
    return B, Hq, nb, page, dtype


def _check_pool(q, pool, block_tables, seq_lens):
    """(B, Hq, page_size, tables, lens, dtype) of a paged latent pool (num_blocks, page_size, 576)."""
    from .decode import check_paged_lengths
    B, Hq, nb, page, dtype = _check_pool_shape(q, pool)
    tables, lens = check_paged_lengths(block_tables, seq_lens, B, nb, page)
    return B, Hq, page, tables, lens, dtype


def _lens(seq_lens, B, N, like=None):
    """Host lengths (checked), a contiguous device int32 (B,) array of ``like``'s kind (used in
    place; its values are not read on the host), or None.  Other device lengths are read on
    the host."""
    if seq_lens is None:
        return None
    from .decode import _host
    if like is not None and not isinstance(seq_lens, (np.ndarray, list, tuple)) and Call(like).kind != "numpy":
        Call(like).check(seq_lens, "seq_lens")
        a = device_array(seq_lens)
        if a.shape == (B,) and a.dtype == "int32" and a.c_contiguous():
            return a                                   # else: read on the host, checked below
    lens = _host(seq_lens).astype(np.int64)
    if lens.shape != (B,) or np.any(lens < 0) or np.any(lens > N):
        raise ValueError(f"seq_lens: expected {B} lengths in [0, {N}], got {lens.tolist()}")
    return lens


def _config(config) -> MLADecodeConfig:
    if config is None:
        return MLADecodeConfig()
    if not isinstance(config, MLADecodeConfig):
        raise ValueError(f"config: expected an MLADecodeConfig or None, got {type(config).__name__}")
    return config


def _need(q, kv):
    return need("mla_decode", q=q, k=kv)


# --------------------------------------------------------------------------- splits
def split_plan(longest: int, num_splits: int) -> tuple[int, int]:
    """(splits launched, rows a split): the rows a split are rounded up to whole tiles of Bc,
    so a tile never straddles two splits (nor, paged, two pages); splits left with no rows of
    the longest sequence are not launched."""
    if longest <= 0:
        return 1, C.MLA_BLOCK_N
    per = -(-longest // max(1, int(num_splits)))
    per = -(-per // C.MLA_BLOCK_N) * C.MLA_BLOCK_N
    return -(-longest // per), per


# --------------------------------------------------------------------------- public calls
def run_mla_decode(q, kv, *, seq_lens, num_splits, scale, config):
    """MLA decode over a contiguous latent cache with a resolved config: (O, LSE) of q's kind."""
    B, Hq, N, dtype = _check_cache(q, kv)
    lens = _lens(seq_lens, B, N, like=q)
    return _run(q, kv, lens, None, dtype=dtype, nk=N, scale=scale, num_splits=num_splits, config=config)


def mla_decode(q, kv, *, seq_lens=None, num_splits=None, scale=None, config=None):
    """MLA decode (absorbed form): q (B, Hq, 576), kv (B, N, 576) -> (O (B, Hq, 512), LSE (B, Hq)).

    ``seq_lens`` (B,) int: sequence b uses rows [0, seq_lens[b]) (None: all N).
    ``num_splits``: splits of the key axis (None: :func:`.policy.mla_num_splits`).  ``scale``
    None: DeepSeek-V3's (:func:`default_scale`).  ``config``: an :class:`MLADecodeConfig`.
    O has q's dtype; LSE is float32, natural log.
    """
    _check_cache(q, kv)
    kernel, cfg = REGISTRY.resolve("mla_decode", _config(config), _need(q, kv))
    return kernel.launcher(q, kv, seq_lens=seq_lens, num_splits=num_splits, scale=scale, config=cfg)


def paged_mla_decode(q, pool, block_tables, seq_lens, *, num_splits=None, scale=None, config=None):
    """MLA decode over a paged latent pool (num_blocks, page_size, 576) with int32 block tables
    (B, max_blocks): row n of sequence b is row n % page_size of block block_tables[b][n // page_size].
    page_size a multiple of 64.  Returns (O (B, Hq, 512), LSE (B, Hq)) as :func:`mla_decode`."""
    B, Hq, page, tables, lens, dtype = _check_pool(q, pool, block_tables, seq_lens)
    kernel, cfg = REGISTRY.resolve("mla_decode", _config(config), _need(q, pool))
    return _run(q, pool, lens, (tables, page), dtype=dtype, nk=0, scale=scale, num_splits=num_splits, config=cfg)


# --------------------------------------------------------------------------- the launch
def _run(q, kv, lens, paged, *, dtype, nk, scale, num_splits, config):
    """Allocate O, LSE of q's kind and launch (the checks are done)."""
    scale = default_scale() if scale is None else float(scale)
    call = Call(q)
    B, Hq, _ = q.shape
    with on_stream(call.stream_ptr()):
        qd = call.to_device(q, "q")
        kvd = call.to_device(kv, "pool" if paged else "kv")
        o, lse = call.empty((B, Hq, C.MLA_LATENT), dtype), call.empty((B, Hq), "float32")
        if isinstance(lens, np.ndarray):
            lens_d, longest = call.constant(lens.astype(np.int32)), int(lens.max(initial=0))
        else:                                          # None, or device lengths: planned for all nk rows
            lens_d, longest = lens, nk
        tables_d = None if paged is None else call.constant(paged[0].astype(np.int32))
        launch_mla(qd, kvd, lens_d, o, lse, dtype=dtype, scale=scale, num_splits=num_splits, longest=longest,
                   nk=nk, paged=None if paged is None else (tables_d, paged[1]), config=config)
    return call.finish(o, dtype), call.finish(lse, "float32")


def _rows_16b(a, name):
    """A DeviceArray whose rows have unit stride and start on 16 bytes (what TMA addresses)."""
    if a.strides[-1] != 1 or not a.aligned(16):
        raise ValueError(f"{name}: rows must have unit stride and start on 16 bytes (base and strides), "
                         f"got strides {a.strides} at {a.ptr:#x}")
    return a


def kernel_args(qd, kvd, lens_d, o, lse, parts, *, dtype, scale, splits, per_split, nk, paged):
    """(tensor maps + arguments) of one mla_decode launch, in the kernel's order."""
    B, Hq, _ = qd.shape
    if paged is None:
        map_kv = hp.tensor_map(kvd.ptr, dtype, (ROW, kvd.shape[1], B), (2 * kvd.strides[1], 2 * kvd.strides[0]),
                               (hp.PANEL, C.MLA_BLOCK_N, 1))
        table, max_blocks = np.uint64(0), 0
    else:
        tables, page = paged
        tables = device_array(tables)
        map_kv = hp.tensor_map(kvd.ptr, dtype, (ROW, page, kvd.shape[0]), (2 * kvd.strides[1], 2 * kvd.strides[0]),
                               (hp.PANEL, C.MLA_BLOCK_N, 1))
        table, max_blocks = tables.arg, tables.shape[1]
    map_q = hp.tensor_map(qd.ptr, dtype, (ROW, Hq, B), (2 * qd.strides[1], 2 * qd.strides[0]),
                          (hp.PANEL, C.MLA_HEADS_BLOCK, 1))
    i32 = np.int32
    lens_arg = device_array(lens_d).arg if lens_d is not None else np.uint64(0)
    return (map_q, map_kv, lens_arg, table, i32(max_blocks), i32(nk), i32(Hq),
            np.float32(scale * math.log2(math.e)), i32(splits), i32(per_split), *parts, o.arg, lse.arg)


def launch_splits(cfg: MLADecodeConfig, B: int, Hq: int, longest: int, num_splits, sms: int) -> tuple[int, int]:
    """(splits launched, rows a split) for a longest sequence of ``longest`` rows: ``num_splits``
    or, None, :func:`.policy.mla_num_splits`'s choice, through :func:`split_plan`."""
    if num_splits is None:
        num_splits = mla_num_splits(B, Hq, longest, sms, min_keys=cfg.keys_per_split(),
                                    heads_block=C.MLA_HEADS_BLOCK, max_splits=C.MLA_MAX_SPLITS)
    return split_plan(longest, num_splits)


def mla_kernel(cfg: MLADecodeConfig, dtype: str, page_size: int | None):
    """(record, compiled mla_decode.cu, its dynamic shared memory) of a resolved config over a
    contiguous cache (``page_size`` None) or a paged pool."""
    smem = C.MLADecodeConfig.smem_bytes()
    defines = cfg.defines(dtype, page_size is not None, C.MLA_BLOCK_N if page_size is None else page_size)
    rec = REGISTRY.get("mla_decode", cfg.version)
    return rec, function(rec.file, rec.kernel, defines, smem, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES), smem


def combine_kernel(dtype: str):
    """decode.cu's combine for 512-wide rows: O = sum_s w_s O_s over the splits."""
    return function("decode", "decode_combine", C.DecodeConfig("v1").combine_defines(C.MLA_LATENT, dtype, 1, False, 16))


def launch_mla(qd, kvd, lens_d, o, lse, *, dtype, scale, num_splits=None, longest, nk, paged=None, config):
    """mla_decode.cu (+ decode.cu's combine when there are splits) on device arrays.

    ``lens_d``: int32 device lengths (B,) or None (every sequence ``nk`` rows).  ``paged``:
    None, or (int32 device block tables (B, max_blocks), page_size); then ``kvd`` is the pool.
    """
    qd, kvd, o, lse = (device_array(a, dtype if i < 3 else "float32") for i, a in enumerate((qd, kvd, o, lse)))
    B, Hq, _ = qd.shape
    if B * Hq == 0:
        return
    if qd.strides != (Hq * ROW, ROW, 1) or not qd.aligned(16):
        raise ValueError("q: MLA decode needs a contiguous (batch, heads_q, 576) q on 16 bytes")
    _rows_16b(kvd, "pool" if paged else "kv")
    if paged is None and kvd.shape[1] == 0:            # no rows at all: every row is fully masked
        fill(o.owner, 0)
        fill(lse.owner, -math.inf)
        return
    cfg = config if config.version is not None else config.replace(version="v1")
    splits, per_split = launch_splits(cfg, B, Hq, longest, num_splits, device_info()["sms"])
    rec, fn, smem = mla_kernel(cfg, dtype, None if paged is None else paged[1])
    if splits > 1:
        scratch = Call(o.owner, name="o")
        o_part = device_array(scratch.empty((splits, B, Hq, C.MLA_LATENT), "float32"))
        lse_part = device_array(scratch.empty((splits, B, Hq), "float32"))
        parts = (o_part.arg, lse_part.arg)
    else:
        parts = (np.uint64(0), np.uint64(0))           # unused by the kernel when splits == 1
    args = rec.args(qd, kvd, lens_d, o, lse, parts, dtype=dtype, scale=scale, splits=splits,
                       per_split=per_split, nk=nk, paged=paged)
    grid = (-(-Hq // C.MLA_HEADS_BLOCK), splits, B)
    fn(grid, (THREADS,), args, shared_mem=smem)
    if splits > 1:                                     # decode.cu's combine: O = sum_s w_s O_s
        combine_kernel(dtype)((B * Hq,), (COMBINE_THREADS,),
                              (o_part.arg, lse_part.arg, np.int32(splits), np.int32(B * Hq), o.arg, lse.arg))


# --------------------------------------------------------------------------- the records
RECORDS = (
    Record("cupy", "mla_decode", "v1", "mla_decode.cu", "mla_decode", MLADecodeConfig, run_mla_decode,
           "Hopper: wgmma S = Q C^T with Q resident, a 2-stage TMA ring of 64 cache rows, P via SRAM, O split "
           "over two warpgroups; split-KV with decode.cu's combine", check_v1, 10, kernel_args,
           dict(options=HOPPER_OPTIONS)),
)
REGISTRY.add(*RECORDS)


# --------------------------------------------------------------------------- checks on a GPU
#: the shapes the GPU tests and scripts/mla_dev.py check, each awkward in its own way:
#: (dtype, batch, heads_q, N, seq_lens or None, num_splits or None, paged page size or None)
CHECK_CASES = (
    ("bfloat16", 1, 64, 64, None, 1, None),                # one tile, one head block: the smallest
    ("bfloat16", 2, 128, 1000, None, None, 64),            # N not a multiple of 64, the heuristic's splits
    ("bfloat16", 3, 16, 777, (777, 0, 65), None, 64),      # 16 heads (48 rows of the block empty), a zero length
    ("float16", 2, 64, 4096, (4096, 1), 4, 128),
    ("bfloat16", 4, 128, 130, (130, 64, 63, 1), 1, None),  # lengths at and around a tile edge
    ("bfloat16", 5, 80, 333, (1, 333, 0, 200, 64), 3, 64), # a partial second head block, empty splits
    ("bfloat16", 1, 128, 8192, None, None, 256),           # B = 1: many splits through the combine
    ("float16", 2, 128, 65, (65, 0), 2, None),
)


def oracle_check(q, kv, *, seq_lens=None, num_splits=None, paged_page=None, config=None, seed=0):
    """Run mla_decode on torch CUDA tensors into NaN-poisoned outputs and hold it to FlashAttention's
    2x rule against the float64 oracle (:func:`iokernels.mla.reference_latent`), the baseline
    being :func:`iokernels.torch_sdpa.mla_decode_matmul` in q's dtype.  ``paged_page``: also run
    it over a paged pool of that page size (pages in a shuffled order).  Returns a list of Checks
    (O and LSE; paged ones named so)."""
    import torch
    from ..core.testing import Check, as_numpy, check
    from ..mla import reference_latent
    from ..torch_sdpa import mla_decode_matmul
    dtype = cv.dtype_name(q)
    B, Hq, _ = q.shape
    N = kv.shape[1]
    lens = np.full(B, N) if seq_lens is None else np.asarray(seq_lens, np.int64)
    ref_o, ref_l = reference_latent(as_numpy(q), as_numpy(kv), C.MLA_LATENT, seq_lens=lens)
    base_o, base_l = mla_decode_matmul(q, kv, latent_dim=C.MLA_LATENT, seq_lens=lens)
    masked = (lens == 0)[:, None, None]
    runs = [("", lambda: mla_decode(q, kv, seq_lens=None if seq_lens is None else lens.astype(np.int32),
                                    num_splits=num_splits, config=config))]
    if paged_page is not None:
        per = -(-max(N, 1) // paged_page)
        order = np.random.default_rng(seed).permutation(B * per)
        pool = torch.full((B * per, paged_page, ROW), float("nan"), dtype=q.dtype, device=q.device)
        # rows past N (the last page's tail) are NaN: the kernel must zero what it masks
        padded = torch.nn.functional.pad(kv, (0, 0, 0, per * paged_page - N), value=float("nan"))
        tables = order.reshape(B, per).astype(np.int32)
        pool[torch.from_numpy(tables.ravel()).to(q.device).long()] = padded.reshape(B * per, paged_page, ROW)
        runs.append((f" paged {paged_page}", lambda: paged_mla_decode(q, pool, tables, lens.astype(np.int32),
                                                                     num_splits=num_splits, config=config)))
    out = []
    for tag, fn in runs:
        o, lse = fn()
        torch.cuda.synchronize()
        for name, x in (("O", o), ("LSE", lse)):
            if torch.isnan(x).any():
                out.append(Check(f"{name}{tag}", float("inf"), 0.0, None, False, "; NaN in the output"))
        out.append(check(o, ref_o, base_o, dtype=dtype, name=f"O{tag}", masked_rows=masked))
        out.append(check(lse, ref_l, base_l, dtype=dtype, name=f"LSE{tag}"))
    return out
