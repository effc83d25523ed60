// mma_common.cuh -- what fa_v2.cu and bwd_v2.cu share beyond mma.cuh's tensor-core helpers:
// the tile load that brings rows of a (seq, head_dim) matrix into SRAM by 16-byte cp.async
// copies (element by element when a row is not whole 16-byte chunks).
//
// The including file defines, before the #include: HEAD_DIM, D_PAD (HEAD_DIM rounded up
// to 16), SROW (the SRAM row stride in 16-bit elements), CHUNKS (16-byte chunks a row),
// NTHREADS and VEC_IO (1 when a row is a whole number of 16-byte chunks).
#pragma once
#include "mma.cuh"

// ----------------------------------------------------------------------------- tile loads
// rows [row0, row0 + ROWS) of a (seq, head_dim) matrix with row stride `ld` -> SRAM;
// rows at or past `nrows`, and columns past HEAD_DIM, become zeros.
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* dst, const elem_t* src, long long ld, int row0, int nrows) {
#if VEC_IO
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += NTHREADS) {
        int r = idx / CHUNKS, c = idx % CHUNKS;
        bool ok = (row0 + r < nrows) && (c * 8 < HEAD_DIM);
        const elem_t* g = ok ? src + (row0 + r) * ld + c * 8 : src;
        cp_async16(dst + r * SROW + c * 8, g, ok);
    }
#else
    // a row is not a whole number of 16-byte chunks: element by element, synchronous
    for (int idx = threadIdx.x; idx < ROWS * D_PAD; idx += NTHREADS) {
        int r = idx / D_PAD, c = idx % D_PAD;
        dst[r * SROW + c] = (row0 + r < nrows && c < HEAD_DIM) ? src[(row0 + r) * ld + c] : (u16)0;
    }
#endif
}
