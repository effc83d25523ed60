"""The CuPy backend's kernels, keyed by (op, version), and what a call needs of them.

:data:`REGISTRY` is filled where the launchers live: each family module (forward.py,
decode.py, gather.py, paged_prefill.py, backward.py, mla.py, hopper/records.py) ends with
its ``RECORDS`` and ``REGISTRY.add(*RECORDS)``.  A record's check says whether the version
can run a call, described by :func:`need`, and its rank picks the default (the
highest-ranked version whose check passes).  The checks below are the whole of "which
kernel runs where": dtype, head dim, compute capability, row alignment and shared memory.
"""
from __future__ import annotations

from ..core import conventions as cv
from ..core.arrays import DeviceArray, device_array
from ..core.registry import Need, forward_lengths
from . import config as C
from . import decode_config as D
from . import decode_v7_config as V7
from . import paged_prefill_config as PP
from .launch import REGISTRY, cupy_ok, device_info

__all__ = ["REGISTRY", "need"]

#: compute capability (x 10) from which bfloat16 and cp.async exist
CC_AMPERE = 80


def need(op: str, q=None, k=None, v=None, cache=None, *, causal=False, window=None) -> Need:
    """What a call of ``op`` needs of a kernel.  ``k`` / ``v``: the contiguous cache (decode,
    attention) or the pools (paged_decode, paged_gather).  cc and the shared memory per
    block (``extra["smem"]``) are None without a GPU; ``extra["group"]`` is heads_q /
    heads_kv, ``extra["block_size"]`` the paged cache's block size (None without one) and
    ``extra["aligned16"]`` says whether every row starts on 16 bytes.  A
    quantized cache's need has its compute dtype (``cache.dtype``: q's and O's) and
    ``extra["kv_dtype"]`` / ``extra["scale_granularity"]``.  The forward (op "attention")
    adds its lengths and band (:func:`~iokernels.core.registry.forward_lengths`), which the
    Hopper versions' default chooses by (:func:`.policy.hopper_forward_for_length`)."""
    kv = gran = block = None
    if cache is not None:
        dtype, d, hkv = cv.dtype_name(cache.k_pool), cache.head_dim, cache.num_kv_heads
        block = getattr(cache, "block_size", None)
        if cache.quantized:
            dtype, kv, gran = cache.dtype.name, cache.kv_dtype, cache.scale_granularity
        arrays = cache_arrays = ()
    else:
        first = k if k is not None else q
        dtype, d = cv.dtype_name(first), int(first.shape[-1])
        hkv = None
        if k is not None:
            hkv = int(k.shape[2] if op in ("paged_decode", "paged_gather", "paged_prefill") else k.shape[1])
            block = int(k.shape[1]) if op in ("paged_decode", "paged_gather", "paged_prefill") else None
        arrays = tuple(a for a in (q, k, v) if a is not None)
        cache_arrays = tuple(a for a in (k, v) if a is not None) or arrays
    group = int(q.shape[1]) // hkv if q is not None and hkv else 1
    cc = smem = None
    if cupy_ok():
        dev = device_info()
        cc, smem = dev["cc"], dev["smem_optin"]
    aligned = all(_rows_aligned16(a) for a in arrays)
    extra = dict(smem=smem, group=group, aligned16=aligned, kv_dtype=kv, scale_granularity=gran, block_size=block)
    extra.update(forward_lengths(op, q, k, causal, window))
    return Need(dtype=dtype, head_dim=d, cc=cc, contiguous=all(_c_contiguous(a) for a in cache_arrays), extra=extra)


def _device(x) -> DeviceArray | None:
    if type(x).__module__.split(".")[0] == "numpy":
        return None                          # copied in: a fresh, aligned, contiguous buffer
    return device_array(x)


def _rows_aligned16(x) -> bool:
    """Every row of ``x`` starts on 16 bytes, as the kernel will see it (arrays whose rows
    are not unit-stride are copied, so they are aligned)."""
    a = _device(x)
    if a is None or (a.shape and a.shape[-1] > 1 and a.strides[-1] != 1):
        return True
    return a.aligned(C.CHUNK_BYTES)


def _c_contiguous(x) -> bool:
    a = _device(x)
    return True if a is None else a.c_contiguous()


# --------------------------------------------------------------------------- checks
def _bf16_cc(n: Need) -> str | None:
    if n.dtype == "bfloat16" and n.cc is not None and n.cc < CC_AMPERE:
        return f"bfloat16 needs compute capability 8.0 or newer; this GPU is {n.cc / 10:.1f}"
    return None


def _forward_fits(version: str, n: Need) -> str | None:
    smem = n.extra.get("smem")
    least = C.min_forward_smem(version, n.head_dim, n.dtype)
    if smem is not None and least > smem:
        return (f"needs at least {least:,} B of shared memory a block at head_dim={n.head_dim} ({n.dtype}), "
                f"its smallest tiles; this GPU allows {smem:,} B")
    return None


def check_v1(n: Need) -> str | None:
    return _bf16_cc(n) or _forward_fits("v1", n)


def check_v1b(n: Need) -> str | None:
    if n.dtype != "float32":
        return f"the float32 kernel (cp.async copies the stored bytes), got {n.dtype}"
    if n.cc is not None and n.cc < CC_AMPERE:
        return f"cp.async needs compute capability 8.0 or newer; this GPU is {n.cc / 10:.1f}"
    return _forward_fits("v1b", n)


def check_v2(n: Need) -> str | None:
    if n.dtype not in ("float16", "bfloat16"):
        return f"the tensor-core kernel for float16/bfloat16, got {n.dtype}"
    if n.head_dim > C.V2_MAX_HEAD_DIM:
        return f"keeps O in registers up to head_dim {C.V2_MAX_HEAD_DIM}, got {n.head_dim}"
    return _bf16_cc(n) or _forward_fits("v2", n)


#: the quantized caches decode v1, v3 and v5 read: code formats and scale granularities
QUANT_KV = tuple(k for k in C.KV_QUANT_IDS if k is not None)
QUANT_GRANULARITIES = ("block_head", "block")


def _check_quant(version: str, n: Need) -> str | None:
    kv, gran = n.extra.get("kv_dtype"), n.extra.get("scale_granularity")
    if kv is None:
        return None
    if version == "v2":
        return f"kv_dtype: reads unquantized pools; a {kv} cache is read by v1, v3 and v5"
    if kv not in QUANT_KV:
        return f"kv_dtype: {kv} codes are not decoded by this kernel (it decodes {', '.join(QUANT_KV)})"
    if gran not in QUANT_GRANULARITIES:
        return f"scale_granularity: {gran!r} scales are not read (it reads {', '.join(QUANT_GRANULARITIES)})"
    return None


def check_decode_v1(n: Need) -> str | None:
    return _check_quant("v1", n) or _bf16_cc(n)


def _check_ring(version: str, n: Need) -> str | None:
    why = _check_quant(version, n)
    if why:
        return why
    kv = n.extra.get("kv_dtype")
    if C.decode_v2_geometry(n.head_dim, n.dtype, None, kv) is None:
        return (f"rows must be whole 16-byte chunks, at most {C.MAX_ROW_CHUNKS} (and {C.MAX_ROW_CHUNKS} lanes' "
                f"units); head_dim={n.head_dim} ({kv or n.dtype}) is not")
    if not n.extra.get("aligned16", True):
        return "rows must start on 16-byte boundaries (base pointer and strides)"
    smem = n.extra.get("smem")
    bound = C.ring_smem_bound(version, n.head_dim, n.dtype, n.extra.get("group", 1), kv=kv)
    if smem is not None and bound > smem:
        return (f"its shallowest ring needs up to {bound:,} B of shared memory a block at head_dim="
                f"{n.head_dim} ({n.dtype}), group {n.extra.get('group', 1)}; this GPU allows {smem:,} B")
    return _bf16_cc(n)


def check_decode_v2(n: Need) -> str | None:
    return _check_ring("v2", n)


def check_decode_v3(n: Need) -> str | None:
    return _check_ring("v3", n)


def _check_tensor_core(version: str, n: Need) -> str | None:
    """decode v4 / v5: v4's limits (decode_config.v4_limits), the cache each reads, mma.sync
    m16n8k16 and cp.async (compute capability 8.0), then the ring's checks."""
    why = D.v4_limits(n.dtype, n.head_dim, n.extra.get("group", 1))
    if why:
        return why
    kv = n.extra.get("kv_dtype")
    if kv is not None and kv not in QUANT_KV:
        return _check_quant(version, n)
    why = D._v5_cache(version, n.head_dim, kv)
    if why:
        return why
    if n.cc is not None and n.cc < CC_AMPERE:
        return f"mma.sync m16n8k16 and cp.async need compute capability 8.0 or newer; this GPU is {n.cc / 10:.1f}"
    return _check_ring(version, n)


def check_decode_v4(n: Need) -> str | None:
    """The tensor-core decode over a 16-bit cache (decode_v4.cu)."""
    return _check_tensor_core("v4", n)


def check_decode_v5(n: Need) -> str | None:
    """v4 over a quantized paged cache (int8 / float8 e4m3 codes, float16/bfloat16 compute
    dtype) at head dims DECODE_V5_HEAD_DIMS (decode_v5.cu); its codes become float16
    operands with integer instructions every such GPU has."""
    return _check_tensor_core("v5", n)


def check_decode_v7(n: Need) -> str | None:
    """decode v7 (decode_v7.cu): the groups v3 cannot hold in its registers, with v3's checks at
    the slice of the group a block holds (decode_v7_config.check_decode_v7)."""
    return V7.check_decode_v7(n, _check_ring)


def check_backward_v1(n: Need) -> str | None:
    if n.dtype not in ("float16", "bfloat16", "float32", "float64"):
        return f"takes float16, bfloat16, float32 or float64, got {n.dtype}"
    try:
        C.BackwardConfig().resolve(n.head_dim, n.dtype)
    except ValueError as e:
        return str(e)
    return _bf16_cc(n)


def check_backward_v2(n: Need) -> str | None:
    if n.dtype not in ("float16", "bfloat16"):
        return f"the tensor-core backward for float16/bfloat16, got {n.dtype}"
    if n.head_dim > C.BWD_V2_MAX_HEAD_DIM:
        return f"keeps dK_j, dV_j in registers up to head_dim {C.BWD_V2_MAX_HEAD_DIM}, got {n.head_dim}"
    if n.cc is not None and n.cc < CC_AMPERE:
        return (f"needs compute capability 8.0 or newer (mma.sync m16n8k16 and cp.async double "
                f"buffering); this GPU is {n.cc / 10:.1f}")
    smem = n.extra.get("smem")
    least = C.BackwardConfig("v2").v2_min_smem(n.head_dim, n.dtype)
    if smem is not None and least > smem:
        return (f"needs at least {least:,} B of shared memory a block at head_dim={n.head_dim} ({n.dtype}), "
                f"its smallest tiles; this GPU allows {smem:,} B")
    return None


#: the one compute capability bwd_v3.cu .. bwd_v6.cu are built for (sm_90a: wgmma, TMA)
CC_HOPPER = 90


def _hopper_backward_limits(n: Need, dtypes, head_dims, registers: str, least) -> str | None:
    """What both Hopper backwards need: a GPU (not the simulator) of compute capability 9.0,
    ``dtypes`` at ``head_dims`` (``registers`` says why), ``least()`` bytes of SRAM a block, and
    what the Hopper kernels need here (cuda-python's driver bindings for the TMA maps)."""
    if n.simulator:
        return "runs on a GPU only (not the simulator)"
    if n.dtype not in dtypes:
        return f"the Hopper backward for float16/bfloat16, got {n.dtype}"
    if n.head_dim not in head_dims:
        return f"takes head_dim 64 or 128 ({registers}, 64-column TMA panels), got {n.head_dim}"
    if n.cc is not None and n.cc != CC_HOPPER:
        return f"needs compute capability 9.0 (Hopper: wgmma, TMA, sm_90a); this GPU is {n.cc / 10:.1f}"
    smem, need_smem = n.extra.get("smem"), least()
    if smem is not None and need_smem > smem:
        return f"needs {need_smem:,} B of shared memory a block at head_dim={n.head_dim}; this GPU allows {smem:,} B"
    from .hopper.checks import available       # here: hopper imports this module
    return available()


def check_backward_v3(n: Need) -> str | None:
    """The Hopper backward (bwd_v3.cu): :func:`_hopper_backward_limits` with one consumer
    warpgroup's SRAM (Bc = Br = 64)."""
    return _hopper_backward_limits(
        n, C.BWD_V3_DTYPES, C.BWD_V3_HEAD_DIMS, "dK_j, dV_j in one warpgroup's registers",
        lambda: C.BackwardConfig.smem_bytes(C.BWD_V3_BLOCK, C.BWD_V3_BLOCK, n.head_dim, n.dtype, "v3"))


def check_backward_v4(n: Need) -> str | None:
    """bwd_v4.cu: :func:`_hopper_backward_limits` with its own SRAM (Bc = 128, the default ring)."""
    return _hopper_backward_limits(
        n, C.BWD_V4_DTYPES, C.BWD_V4_HEAD_DIMS, "dK_j, dV_j in each consumer warpgroup's registers",
        lambda: C.BackwardConfig.smem_bytes(C.BWD_V4_BLOCK_Q, C.BWD_V4_BLOCK_K, n.head_dim, n.dtype, "v4",
                                            C.BWD_V4_STAGES))


def check_backward_v5(n: Need) -> str | None:
    """bwd_v5.cu: bwd_v4.cu's limits (the same kernel, its blocks in another order)."""
    return check_backward_v4(n)


def check_backward_v6(n: Need) -> str | None:
    """bwd_v6.cu: bwd_v4.cu's limits with its own SRAM (v4's tiles and the consumers' two dQ panels,
    the default ring)."""
    return _hopper_backward_limits(
        n, C.BWD_V4_DTYPES, C.BWD_V4_HEAD_DIMS, "dK_j, dV_j in each consumer warpgroup's registers",
        lambda: C.BackwardConfig.smem_bytes(C.BWD_V4_BLOCK_Q, C.BWD_V4_BLOCK_K, n.head_dim, n.dtype, "v6",
                                            C.BWD_V4_STAGES))


def check_paged_prefill_v1(n: Need) -> str | None:
    """The tensor-core paged prefill (paged_prefill_v1.cu): 16-bit pools, the head dims it is
    built for, bfloat16 from compute capability 8.0, and its smallest tiles in the SRAM."""
    if n.extra.get("kv_dtype") is not None:
        return f"kv_dtype: reads 16-bit pools; a {n.extra['kv_dtype']} cache is not dequantized by this kernel"
    if n.dtype not in PP.PAGED_PREFILL_DTYPES:
        return f"the tensor-core kernel for float16/bfloat16 (float32 accumulation), got {n.dtype}"
    if n.head_dim not in PP.PAGED_PREFILL_HEAD_DIMS:
        dims = " and ".join(map(str, PP.PAGED_PREFILL_HEAD_DIMS))
        return f"built and tested for head_dim {dims} only, got {n.head_dim}"
    why = _bf16_cc(n)
    if why:
        return why
    smem = n.extra.get("smem")
    least = PP.paged_prefill_smem(n.head_dim, 1, min(PP.PAGED_PREFILL_BLOCK_K_CHOICES))
    if smem is not None and least > smem:
        return (f"needs at least {least:,} B of shared memory a block at head_dim={n.head_dim}, its smallest "
                f"tiles; this GPU allows {smem:,} B")
    return None
