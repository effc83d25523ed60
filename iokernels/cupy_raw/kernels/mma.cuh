// mma.cuh -- the 16-bit tensor-core helpers of the CuPy kernels (fa_v2.cu, bwd_v2.cu, decode_v4.cu).
//
// ldmatrix loads 8x8 tiles of 16-bit values from SRAM straight into the fragment layout
// of mma.sync (".trans": transposed on the way in); mma16816 is one m16n8k16 product with
// float32 accumulators (two m16n8k8 products on sm_75, which has no k16 shape); pack2_cvt_each
// turns two float32 accumulators into one register of a 16-bit A fragment; the online
// softmax's exp2 is base.cuh's fast_exp2.
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

// d[4] += A (16x16, 4 regs) * B (16x8, 2 regs), float16 operands whatever IK_DTYPE is
// (decode_v5.cu's 1-byte codes are float16 operands for either compute dtype),
// float32 accumulators.
__device__ __forceinline__ void mma16816_f16(float* d, const u32* a, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// d[4] += A (16x16, 4 regs) * B (16x8, 2 regs) in IK_DTYPE (float16 or bfloat16), float32
// accumulators.
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
#if IK_DTYPE == IK_BF16 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    mma16816_f16(d, a, b0, b1);
#endif
}

// two float32 -> one register of two 16-bit IK_DTYPE values (lo = the lower column), each
// value rounded by its own cvt (cvt.rn.f16.f32 / cvt.rn.bf16.f32), then shifted and or-ed:
// sm_75 has no paired cvt.  hopper_common.cuh's pack2_cvt_x2 is the one-instruction form.
__device__ __forceinline__ u32 pack2_cvt_each(float lo, float hi) {
    return (u32)from_acc(lo) | ((u32)from_acc(hi) << 16);
}
// ... of two float16 values, whatever IK_DTYPE is
__device__ __forceinline__ u32 pack2_f16(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}


// ----------------------------------------------------------------------------- a warp's tile products
// One warp's 16 query rows against one K_j / V_j tile in SRAM (row-major [key][d], row
// stride `ld` 16-bit elements), FlashAttention-2's inner loop (fa_v2.cu, decode_v4.cu).
// SWZ = 0: element (row, col) at row * ld + col (rows padded so ldmatrix's 8 rows fall in 8
// bank groups).  SWZ = 1: rows unpadded (ld = the row's elements, a multiple of 64) and
// 16-byte chunk c of row r stored at chunk c ^ (r % 8), the XOR swizzle: ldmatrix's 8 rows
// still hit 8 bank groups, and 8 lanes that copy a row's 128 contiguous bytes write one
// whole 128-byte bank window (decode_v4.cu's cp.async ring).

// the SRAM offset (16-bit elements) of (row, col), col a multiple of 8 (one 16-byte chunk)
template <int SWZ>
__device__ __forceinline__ int tile_offset(int row, int col, int ld) {
    return SWZ ? row * ld + ((((col >> 3) ^ (row & 7))) << 3) : row * ld + col;
}

// S (16 x 8 NT) = Q (16 x 16 KT: A fragments qf) K_j^T: K_j's rows are the B operand as
// stored (ldmatrix, no transpose), two 8-key n-tiles a load
template <int KT, int NT, int SWZ = 0>
__device__ __forceinline__ void mma_qkt(float (*s)[4], const u32 (*qf)[4], const u16* Kt, int ld, int lane) {
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            u32 kb[4];   // two n-tiles (keys nn*16 .. +15) x 16 dims
            ldmatrix_x4(kb, Kt + tile_offset<SWZ>(nn * 16 + (lane % 8) + (lane / 16) * 8,
                                                  kk * 16 + ((lane / 8) % 2) * 8, ld));
            mma16816(s[2 * nn], qf[kk], kb[0], kb[1]);
            mma16816(s[2 * nn + 1], qf[kk], kb[2], kb[3]);
        }
    }
}

// online softmax of one row of the lane's two (r = 0: row g, elements 0, 1; r = 1: row
// g + 8, elements 2, 3), S in log2 units: the row max over the quad (two shuffles), S -> P
// in place, O's row rescaled by exp2(m_old - m_new) (times o_scale: a change of the units O is
// kept in, decode_v5.cu's quantized cache), l kept as this lane's partial sum
template <int NT_S, int NT_O>
__device__ __forceinline__ void online_softmax_row(float (*s)[4], float (*o)[4], float& m, float& l, int r,
                                                   float o_scale = 1.f) {
    float mx = neg_inf_f();
#pragma unroll
    for (int n = 0; n < NT_S; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));   // the quad shares a row
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float m_new = fmaxf(m, mx);
    float base = (m_new == neg_inf_f()) ? 0.f : m_new;
    float alpha = fast_exp2(m - base);
    float rs = 0.f;
#pragma unroll
    for (int n = 0; n < NT_S; ++n) {
        s[n][2 * r] = fast_exp2(s[n][2 * r] - base);
        s[n][2 * r + 1] = fast_exp2(s[n][2 * r + 1] - base);
        rs += s[n][2 * r] + s[n][2 * r + 1];
    }
    l = l * alpha + rs;                          // this lane's partial row sum
    m = m_new;
    alpha *= o_scale;
#pragma unroll
    for (int n = 0; n < NT_O; ++n) { o[n][2 * r] *= alpha; o[n][2 * r + 1] *= alpha; }
}

// O (16 x 8 NT) += P (16 x 16 KS, the accumulators of mma_qkt) V_j: P's accumulators become
// A fragments in registers (pack2_cvt_each), V_j's rows go through ldmatrix.trans.  HI = false:
// rows 8..15 of P are known to be unused and enter as zeros
template <int KS, int NT, bool HI, int SWZ = 0>
__device__ __forceinline__ void mma_pv(float (*o)[4], const float (*p)[4], const u16* Vt, int ld, int lane) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 pa[4];
        pa[0] = pack2_cvt_each(p[2 * kk][0], p[2 * kk][1]);
        pa[1] = HI ? pack2_cvt_each(p[2 * kk][2], p[2 * kk][3]) : 0u;
        pa[2] = pack2_cvt_each(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[3] = HI ? pack2_cvt_each(p[2 * kk + 1][2], p[2 * kk + 1][3]) : 0u;
#pragma unroll
        for (int dn = 0; dn < NT / 2; ++dn) {
            u32 vb[4];   // 16 keys x two n-tiles of 8 dims, transposed on the way in
            ldmatrix_x4_trans(vb, Vt + tile_offset<SWZ>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                        dn * 16 + (lane / 16) * 8, ld));
            mma16816(o[2 * dn], pa, vb[0], vb[1]);
            mma16816(o[2 * dn + 1], pa, vb[2], vb[3]);
        }
    }
}
