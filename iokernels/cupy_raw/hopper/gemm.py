"""C = A B on Hopper's tensor cores (hopper_gemm.cu): the ceiling the attention kernels are held to."""
from __future__ import annotations

import numpy as np

from ...core import conventions as cv
from ...core.arrays import Call, device_array
from ..launch import DTYPE_IDS, HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, fill, function, on_stream
from .checks import require_available
from .config import (DTYPES, GEMM_BK, GEMM_BM, GEMM_BN, GEMM_GROUP_M, GEMM_STAGES, GEMM_THREADS, MBARRIER_BYTES,
                     PANEL, SMEM_ALIGN)
from .tensor_maps import tensor_map


def gemm_smem_bytes() -> int:
    tiles = GEMM_STAGES * 2 * (GEMM_BM * GEMM_BK + GEMM_BK * GEMM_BN)
    return tiles + MBARRIER_BYTES * 2 * GEMM_STAGES + SMEM_ALIGN


def gemm_defines(dtype: str) -> dict:
    return dict(IK_DTYPE=DTYPE_IDS[dtype], BM=GEMM_BM, BN=GEMM_BN, BK=GEMM_BK, STAGES=GEMM_STAGES,
                GROUP_M=GEMM_GROUP_M)


def gemm(a, b):
    """C = A B on the tensor cores (wgmma + TMA): a (M, K), b (K, N), float16 or bfloat16, row-major
    like torch.matmul; C (M, N) in the same dtype, accumulated in float32.  K and N must be
    multiples of 8 (rows of 16 bytes, what TMA addresses)."""
    for name, x in (("a", a), ("b", b)):
        if len(getattr(x, "shape", ())) != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {getattr(x, 'shape', None)}")
    dtype = cv.check_dtype(a, "a", DTYPES)
    if cv.check_dtype(b, "b", DTYPES) != dtype:
        raise ValueError(f"b: dtype must match a's ({dtype})")
    M, K = (int(s) for s in a.shape)
    K2, N = (int(s) for s in b.shape)
    if K2 != K:
        raise ValueError(f"b: rows (axis 0) must equal a's columns {K}, got {K2}")
    if K % 8 or N % 8:
        raise ValueError(f"a, b: K ({K}) and N ({N}) must be multiples of 8 (16-byte rows for TMA)")
    require_available()
    call = Call(a, name="a")
    with on_stream(call.stream_ptr()):
        ad, bd = (device_array(contiguous(call.to_device(x, n), 16), dtype) for x, n in ((a, "a"), (b, "b")))
        c = call.empty((M, N), dtype)
        if M * N == 0:
            return call.finish(c, dtype)
        if K == 0:
            fill(c, 0)
            return call.finish(c, dtype)
        cd = device_array(c, dtype)
        smem = gemm_smem_bytes()
        fn = function("hopper_gemm", "hopper_gemm", gemm_defines(dtype), smem, options=HOPPER_OPTIONS,
                      sources=HOPPER_SOURCES)
        map_a = tensor_map(ad.ptr, dtype, (K, M), (2 * K,), (GEMM_BK, GEMM_BM))
        map_b = tensor_map(bd.ptr, dtype, (N, K), (2 * N,), (PANEL, GEMM_BK))
        tiles = -(-M // GEMM_BM) * -(-N // GEMM_BN)
        fn((tiles,), (GEMM_THREADS,), (map_a, map_b, cd.arg, np.int32(M), np.int32(N), np.int32(K)),
           shared_mem=smem)
    return call.finish(c, dtype)
