// mma_common.cuh -- the tensor-core pieces shared by fa_v2.cu and bwd_v2.cu.
//
// ldmatrix (plain and .trans) from SRAM, mma.sync m16n8k16 with float32 accumulators,
// packing two float32 into one register of two 16-bit values, exp2, and the 16-byte
// cp.async tile load.  Fragment layouts of m16n8k16 (lane = 4 g + t):
//   A 16x16: a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B 16x8:  b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C 16x8:  c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..2t+1]
//
// The including file defines, before the #include: HEAD_DIM, D_PAD (HEAD_DIM rounded up
// to 16), SROW (the SRAM row stride in 16-bit elements), CHUNKS (16-byte chunks a row),
// NTHREADS and VEC_IO (1 when a row is a whole number of 16-byte chunks).
#pragma once
#include "common.cuh"

// ----------------------------------------------------------------------------- tensor cores
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// d[4] += A (16x16, 4 regs) * B (16x8, 2 regs), float32 accumulators.
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if IK_DTYPE == IK_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
#else
    // sm_75 (Turing) has m16n8k8 only: the k16 product is two k8 products; registers
    // a0,a1 / b0 hold k 0..7 and a2,a3 / b1 hold k 8..15 in both shapes.
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

// two float32 -> one register of two 16-bit values (lo = the lower column)
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)from_acc(lo) | ((u32)from_acc(hi) << 16);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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
