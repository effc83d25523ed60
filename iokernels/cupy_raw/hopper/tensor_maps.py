"""TMA tensor maps (CUtensorMap), encoded on the host by the driver's ``cuTensorMapEncodeTiled``."""
from __future__ import annotations

import ctypes

import numpy as np

from .config import PANEL


def tensor_map(ptr: int, dtype: str, dims, strides_bytes, box) -> np.ndarray:
    """A TMA tensor map (CUtensorMap, 128 bytes) for a tensor at ``ptr`` of ``dtype`` (float16,
    bfloat16, or uint8: FP8 codes), as a one-element NumPy array that CuPy passes to the kernel by
    value.

    dims: sizes, innermost first; strides_bytes: the byte stride of each dim but the first
    (multiples of 16); box: the tile the copy engine moves, innermost first (innermost = 128
    bytes, the swizzle width: 64 16-bit elements, 128 codes).  128-byte swizzle; out-of-range elements read
    as zeros.
    """
    from cuda.bindings import driver as drv
    types = {"float16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             "bfloat16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             "uint8": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}
    rank = len(dims)
    err, tmap = drv.cuTensorMapEncodeTiled(
        types[dtype], rank, int(ptr),
        [drv.cuuint64_t(int(x)) for x in dims], [drv.cuuint64_t(int(s)) for s in strides_bytes],
        [drv.cuuint32_t(int(b)) for b in box], [drv.cuuint32_t(1)] * rank,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"q: cuTensorMapEncodeTiled refused dims={list(dims)} strides={list(strides_bytes)} "
                         f"box={list(box)}: {err}")
    raw = ctypes.string_at(int(tmap.getPtr()), 128)
    return np.frombuffer(raw, dtype=np.dtype((np.void, 128))).copy()


def _qkv_map(x, dtype, rows_box):
    """The 3-D map (head_dim, seq, batch * heads) of a contiguous (B, H, N, d) device array."""
    B, H, N, d = x.shape
    return tensor_map(x.ptr, dtype, (d, N, B * H), (2 * d, 2 * d * N), (PANEL, rows_box, 1))
