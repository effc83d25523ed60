// hopper_fp8.cuh -- what the FP8 Hopper forward (fa_fp8_v1.cu, fa_fp8_v2.cu) adds to
// hopper_tile.cuh (the key-tile range of a query block, the mask, the row state and the epilogue,
// shared with the 16-bit kernels): the e4m3 wgmma (both operands K-major: PTX has no transpose
// for 8-bit types), the float32 -> e4m3 conversions, and the softmax taking a per-tile factor
// (the FP8 scales of Q_i and K_j fold into it).
//
// FP8 tiles (one byte an element): a row of Q, K (d = 128) or of V^T (Bc = 128 keys) is 128
// bytes, exactly one 128-byte swizzle row, so a tile is one panel and a k-step of 32 elements is
// 32 bytes inside it -- the same descriptor arithmetic as a 16-bit k-step of 16 elements
// (smem_desc_k_major).
#pragma once
#include "hopper_common.cuh"   // TmaMap, mbar_*, tma_load_3d, smem_desc_k_major, wgmma_fence/commit/wait,
                               // setmaxnreg, pack2_cvt_x2 (the 16-bit output), quad_max / quad_sum
#include "hopper_tile.cuh"     // AttnShape, key_tiles, block_work, the mask, RowState, write_o_lse

//: the largest finite e4m3 value (OCP FP8: 1.75 x 2^8); codes are scaled so a block's max lands on it
#define E4M3_MAX 448.0f

// ----------------------------------------------------------------------------- conversions
// four float32 -> four e4m3 codes in one 32-bit word, x0 in the lowest byte (the k order wgmma
// reads): cvt.rn.satfinite.e4m3x2.f32 puts its first source in the upper byte.  Round to nearest
// even; beyond +-448 it saturates (the scales keep |x| <= 448, so only rounding can reach it).
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}
// a 16-bit input element (IK_DTYPE) as float32
__device__ __forceinline__ float in16_to_f32(u16 x) {
#if IK_DTYPE == IK_BF16
    return __uint_as_float(((u32)x) << 16);   // bfloat16 is the top half of a float32
#else
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
#endif
}

// ----------------------------------------------------------------------------- e4m3 wgmma
// D[64 x 128] (+)= A[64 x 32] * B[32 x 128], e4m3 x e4m3 -> float32, A and B from SRAM, both
// K-major (descriptors).  scale_d = 0 overwrites D (the first k-step).
__device__ __forceinline__ void wgmma_ss_e4m3_n128(float (&d)[64], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] += A[64 x 32] * B[32 x 128], A (e4m3) from registers, 4 words a thread: word 0 row
// g, k = 4t .. 4t+3; word 1 row g + 8, same k; words 2, 3 the same rows at k + 16 (lane = 4g + t,
// rows of the warp's 16-row slab, the lowest byte the lowest k); B (e4m3) from SRAM, K-major.
__device__ __forceinline__ void wgmma_rs_e4m3_n128(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, "
        "{%64, %65, %66, %67}, %68, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// ----------------------------------------------------------------------------- online softmax
// (the problem, the key-tile range, the mask, the row state and the epilogue are hopper_tile.cuh's)
// hopper_tile.cuh's softmax_step with the scale a per-tile argument: factor = scale *
// log2(e) * s_Q * s_K turns the FP8 product of codes into scaled S in log2 units.  S (64 x 128
// float32 accumulators, 64 a thread) becomes P = exp2(S factor - m_new) in place; alpha[r] =
// exp2(m_old - m_new).
template <bool MASK>
__device__ __forceinline__ void softmax_step_scaled(float (&s)[64], RowState& st, float (&alpha)[2],
                                                    const AttnShape& p, float factor, int row_a, int col0) {
    float mx[2];
    scale_and_mask<MASK>(s, mx, p, factor, row_a, col0);
    softmax_update(s, st, alpha, mx);
}

// P (float32, accumulator layout) -> e4m3 A fragments of O += P V, times P_SCALE first.  The
// accumulator gives this thread, of each 32-key k-step, keys 2t, 2t+1, 8+2t, 9+2t, 16+2t, 17+2t,
// 24+2t, 25+2t of rows g and g + 8; the e4m3 A fragment wants k = 4t..4t+3 and 16+4t..16+4t+3.
// Rather than move bytes between lanes (FlashAttention-3 permutes registers), the keys of V^T
// are stored in the order the fragment reads them: within each 32-key group, position
// 16h + 4t + i holds key 16h + 8 (i / 2) + 2t + i % 2 (fp8_quantize_vt writes it so).  The sum
// over keys is the same in any order, so each thread packs its own registers.
__device__ __forceinline__ void p_fragments_e4m3(const float (&s)[64], u32 (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const float* x = s + 16 * kk;
        pa[kk][0] = pack4_e4m3(x[0] * P_SCALE, x[1] * P_SCALE, x[4] * P_SCALE, x[5] * P_SCALE);      // row g
        pa[kk][1] = pack4_e4m3(x[2] * P_SCALE, x[3] * P_SCALE, x[6] * P_SCALE, x[7] * P_SCALE);      // row g + 8
        pa[kk][2] = pack4_e4m3(x[8] * P_SCALE, x[9] * P_SCALE, x[12] * P_SCALE, x[13] * P_SCALE);    // row g
        pa[kk][3] = pack4_e4m3(x[10] * P_SCALE, x[11] * P_SCALE, x[14] * P_SCALE, x[15] * P_SCALE);  // row g + 8
    }
}
// the V^T position of key k (0 .. 31) of a 32-key group: the inverse of the order above
__device__ __forceinline__ int vt_position(int k) {
    const int h = k >> 4, r = k & 15;
    return 16 * h + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1);
}

// ============================================================================= the forward's tiles
// (both FP8 forwards, fa_fp8_v1.cu and fa_fp8_v2.cu: BLOCK_M, BLOCK_N, HEAD_DIM, STAGES from -D)
//: bytes of one FP8 tile: Q_i (Br x d), K_j (Bc x d), V_j^T (d x Bc), one byte an element
#define Q_TILE_BYTES (BLOCK_M * HEAD_DIM)
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM)
//: a 128-byte row; a wgmma k-step (32 e4m3) is 32 bytes of it
#define ROW_BYTES 128
#define K_STEP_BYTES 32

typedef unsigned char u8;

// SRAM: Q_i, STAGES x K_j, STAGES x V_j^T, then q_full, k_full[], v_full[], empty[]
struct Fp8Smem {
    u8 *q, *k, *v;
    u64 *q_full, *k_full, *v_full, *empty;
};
__device__ __forceinline__ Fp8Smem carve_fp8_smem(unsigned char* raw) {
    Fp8Smem sm;
    sm.q = (u8*)(((size_t)raw + SWIZZLE_ATOM_BYTES - 1) & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    sm.k = sm.q + Q_TILE_BYTES;
    sm.v = sm.k + STAGES * KV_TILE_BYTES;
    sm.q_full = (u64*)(sm.v + STAGES * KV_TILE_BYTES);
    sm.k_full = sm.q_full + 1;
    sm.v_full = sm.k_full + STAGES;
    sm.empty = sm.v_full + STAGES;
    return sm;
}

// S = Q K_j^T for a warpgroup's 64 rows: both K-major, one panel; 4 k-steps of 32 codes
__device__ __forceinline__ void issue_qk_e4m3(float (&s)[64], const u8* q_slab, const u8* k_tile) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 32; ++kk)
        wgmma_ss_e4m3_n128(s, smem_desc_k_major(q_slab + kk * K_STEP_BYTES),
                           smem_desc_k_major(k_tile + kk * K_STEP_BYTES), kk > 0);
}
// O += P V_j: P from registers, V_j^T (d rows of Bc keys) K-major; 4 k-steps of 32 keys
__device__ __forceinline__ void issue_pv_e4m3(float (&o)[64], const u32 (&pa)[4][4], const u8* vt_tile) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 32; ++kk)
        wgmma_rs_e4m3_n128(o, pa[kk], smem_desc_k_major(vt_tile + kk * K_STEP_BYTES));
}
