// mma.cuh -- the 16-bit tensor-core helpers of the CuPy kernels (fa_v2.cu, decode_v4.cu).
//
// ldmatrix loads 8x8 tiles of 16-bit values from SRAM straight into the fragment layout
// of mma.sync (".trans": transposed on the way in); mma16816 is one m16n8k16 product with
// float32 accumulators (two m16n8k8 products on sm_75, which has no k16 shape); pack2
// turns two float32 accumulators into one register of a 16-bit A fragment; fast_exp2 is
// the hardware's exp2 (ex2.approx: exp2(-inf) = +0, which the online softmax relies on).
// Fragment coordinates of m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane
// = 4 * g + t; A regs a0..a3 hold (row g, k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..),
// (row g+8, k 2t+8..); B regs b0, b1 hold (k 2t.., col g), (k 2t+8.., col g); the
// accumulators c0..c3 hold (row g, cols 2t, 2t+1) and (row g+8, cols 2t, 2t+1).
#pragma once
#include "common.cuh"

// Only for 16-bit inputs (IK_DTYPE float16 or bfloat16): each kernel that includes it says so.

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

