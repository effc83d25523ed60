// mma_codes.cuh -- 1-byte KV codes (int8, float8 e4m3) as float16 mma.sync operands: what
// decode_v5.cu (v4 on a quantized cache) adds to v4 (-DKV_QUANT=1 int8, 2 float8 e4m3; common.cuh).
//
// A tile of K_j (or V_j) lies in SRAM as it is stored: TILE_ROWS rows of HEAD_DIM 1-byte codes,
// no padding, its 16-byte chunks placed by swz_chunk (an XOR swizzle, below) so that the two
// read patterns of this file hit 8 different 16-byte bank groups in every phase of a
// 128-bit (or 64-bit) shared-memory load.  Codes become float16 values in registers:
//   * int8 x: the float16 bits 0x6400 | (x ^ 0x80) are 1024 + (x + 128); minus 1152 that is x,
//     exactly (one LOP3 and one HSUB2 for two codes);
//   * e4m3 byte b: the float16 bits ((b & 0x80) << 8) | ((b & 0x7f) << 7) are b's value times
//     2^-8 exactly, subnormals included (e4m3's exponent field lands in float16's, bias 7
//     against 15; e4m3's subnormal m 2^-9 becomes float16's m 2^-17).  CODE_FOLD = 2^8 goes
//     into the scales.  The format's NaN (0x7f, 0xff: never the code of a stored value,
//     only of unwritten slots, which the ring never reads) would read as +-480.
// Two codes of one register go to one float16x2 register through one PRMT (which places them,
// and copies of them, in the two 16-bit halves) and the bit operations above.
//
// The mma operands want pairs of values adjacent along the contraction index.  Two
// permutations (each a bijection, used the same way on both sides of a product, so the
// products are the same sums) make every operand one 32-bit word of codes away:
//   * S = Q K^T contracts over d.  Within each 64-dim group G, lane t's k-slots 2t, 2t+1,
//     2t+8, 2t+9 of k-step 4G + j are dims G*64 + 16t + 4j + 0..3: a lane reads 16
//     consecutive codes of a key row with one 128-bit load (4 k-steps), and Q's A fragments
//     are loaded with the same permutation (16 consecutive values of a query row);
//   * O += P V contracts over keys.  In the 16-key step kk, lane t's k-slots 2t, 2t+1, 2t+8,
//     2t+9 are keys 16kk + 4t + 0..3 (S's n-tile 2kk column 2t + e is key 16kk + 4t + e; n-tile
//     2kk + 1 column 2t + e is key 16kk + 4t + 2 + e: QK^T's lane g reads key key_of(nt, g)).
//     A lane reads its 4 keys' rows; O's columns are permuted (col_of) so that the columns
//     of lane g (the B operand's n) are LW consecutive codes of each row: 4 loads of LW bytes
//     and one PRMT per float16x2 operand transpose the 4 x LW codes in registers.  O's
//     permutation is undone when O is written to SRAM for the merge.
// The alternative for V -- dequantize the tile into a per-warp 16-bit staging tile and keep
// ldmatrix.trans -- costs a store of 2 bytes a code, a __syncwarp and an extra SRAM tile a
// warp; the register transpose costs one PRMT a register of operands and no SRAM.
//
// Scales: one float32 power of two a key (its block's, per KV head or per block), copied into
// the stage next to the codes by cp.async.  s_K multiplies S's column after the product
// (exact: a power of two).  s_V cannot multiply O after the product (O sums over keys of
// different blocks), so it goes into P's column before P is rounded to float16, relative to
// a per-warp reference sigma, the largest s_V the warp has seen: P' = p s_V / sigma <= 1 stays
// in float16's range, and O is kept in units of sigma (a new, larger sigma rescales O with
// the online softmax's alpha).  Rounding P' to float16 errs by at most 2^-11 P' + 2^-25 (the
// subnormal half-step): per output row at most (2^-11 + 2 n 2^-25) max|V| over n keys
// (sigma times the largest code is below twice the largest value of its block).
//
// The including kernel defines HEAD_DIM, TILE_ROWS, KV_QUANT, NT_S, NT_O, KT_Q and CPR.
#pragma once
#include "mma.cuh"

#if !(HEAD_DIM == 64 || (HEAD_DIM % 128 == 0 && HEAD_DIM <= 256))
#error "mma_codes.cuh: head_dim 64, 128 or 256 (rows of 64 bytes or whole 128-byte lines: the swizzle; policy: decode_config.DECODE_V5_HEAD_DIMS)"
#endif

#if KV_QUANT == IK_KV_FP8E4M3
#define CODE_FOLD 256.f                               // the bit trick's 2^-8, folded into the scales
#else
#define CODE_FOLD 1.f
#endif
#define LW (NT_O < 16 ? NT_O : 16)                    // codes of a V row a lane reads at a time (8 or 16)
#define CG (NT_O / LW)                                // ... groups of them (HEAD_DIM / (8 LW))

// the 16-byte chunk (of the tile, 16 bytes each) that holds chunk ch of row r: XOR of the low
// three bits with 2 ((r / 4) % 4) (V's 4 rows 4t + i of one phase apart) and, for rows of
// 8 or more chunks, 4 (r % 2) (K's rows 2m, 2m + 1 of one phase apart).  Rows of 4 chunks
// (d = 64) share a group of 8 chunks in pairs, which the XOR keeps together.
__device__ __forceinline__ int swz_chunk(int r, int ch) {
    const int h = (((r >> 2) & 3) << 1) ^ (CPR >= 8 ? ((r & 1) << 2) : 0);
    return (r * CPR + ch) ^ h;
}

// the key (tile row) of S's n-tile nt, column c (QK^T's B operand column c: lane g = c reads it)
__device__ __forceinline__ int key_of(int nt, int c) { return 16 * (nt >> 1) + 4 * (c >> 1) + (c & 1) + 2 * (nt & 1); }
// the head-dim column of O's n-tile dn, column c (P V's B operand column c)
__device__ __forceinline__ int col_of(int dn, int c) { return (dn / LW) * (8 * LW) + c * LW + dn % LW; }

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
// w holds codes c0 (bytes 0, 1) and c1 (bytes 2, 3): float16x2 of (c0, c1) / CODE_FOLD
__device__ __forceinline__ u32 codes_to_f16x2(u32 w) {
#if KV_QUANT == IK_KV_FP8E4M3
    return (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
#else
    const u32 h = (w & 0x00ff00ffu) ^ 0x64806480u;    // 1152 + x in each half
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(h), "r"(0x64806480u));
    return d;
#endif
}
// byte i of a and byte i of b, as float16x2 (lo: a's): V's transpose
__device__ __forceinline__ u32 pair_f16x2(u32 a, u32 b, int i) {
    return codes_to_f16x2(prmt(a, b, (u32)(i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12))));
}
// bytes i and i + 1 of w, as float16x2 (lo: byte i): K's pairs
__device__ __forceinline__ u32 word_f16x2(u32 w, int i) {
    return codes_to_f16x2(prmt(w, 0u, (u32)(i | (i << 4) | ((i + 1) << 8) | ((i + 1) << 12))));
}

// load Q_g -> registers as A fragments with the d permutation above, rows g..15 zero.  A
// float16 query is used as it is (rowinv = 1); a bfloat16 row is multiplied by 2^k (k =
// 14 - floor(log2 max|q_row|), clamped to [-100, 100]: a power of two, its max in [2^14,
// 2^15)) and rounded to float16, exact down to 2^-28 max|q_row|, below that within
// 2^-39 max|q_row|; rowinv = 2^-k multiplies S's row after the product.
template <int KT, bool HI>
__device__ __forceinline__ void load_q_codes_layout(u32 (*qf)[4], float* rowinv, const elem_t* Qg, int group, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        u32 w[KT][2];
#pragma unroll
        for (int G = 0; G < KT / 4; ++G) {
            uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
            if ((r == 0 || HI) && row < group) {
                const uint4* src = reinterpret_cast<const uint4*>(Qg + (long long)row * HEAD_DIM + G * 64 + 16 * t);
                a = src[0];
                b = src[1];
            }
            const u32 ws[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) { w[4 * G + j][0] = ws[2 * j]; w[4 * G + j][1] = ws[2 * j + 1]; }
        }
#if IK_DTYPE == IK_BF16
        float mx = 0.f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                mx = fmaxf(mx, fmaxf(fabsf(bf16_to_f32((u16)w[kk][h])), fabsf(bf16_to_f32((u16)(w[kk][h] >> 16)))));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));   // the quad holds the row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const int e = mx > 0.f ? (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127 : 14;
        const int k = min(100, max(-100, 14 - e));
        const float up = __uint_as_float((u32)(127 + k) << 23);
        rowinv[r] = __uint_as_float((u32)(127 - k) << 23);
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                w[kk][h] = pack2_f16(bf16_to_f32((u16)w[kk][h]) * up, bf16_to_f32((u16)(w[kk][h] >> 16)) * up);
#else
        rowinv[r] = 1.f;
#endif
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) { qf[kk][r] = w[kk][0]; qf[kk][r + 2] = w[kk][1]; }
    }
}

// S (16 x 8 NT) = Q' K_j'^T from the codes of K_j (float16 products, float32 accumulators);
// the caller multiplies by the keys' scales
template <int KT, int NT>
__device__ __forceinline__ void mma_qkt_codes(float (*s)[4], const u32 (*qf)[4], const unsigned char* Kt, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        const int key = key_of(n, g);
#pragma unroll
        for (int G = 0; G < KT / 4; ++G) {
            const uint4 w = *reinterpret_cast<const uint4*>(Kt + 16 * swz_chunk(key, 4 * G + t));
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j)
                mma16816_f16(s[n], qf[4 * G + j], word_f16x2(ws[j], 0), word_f16x2(ws[j], 2));
        }
    }
}

// O (16 x 8 NT, columns permuted by col_of) += P' V_j' from the codes of V_j: P' (the
// accumulators, already times s_V / sigma) as float16 A fragments in registers; the 4 rows a
// lane reads are transposed by pair_f16x2.  HI = false: rows 8..15 of P enter as zeros
template <int KS, int NT, bool HI>
__device__ __forceinline__ void mma_pv_codes(float (*o)[4], const float (*p)[4], const unsigned char* Vt, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 pa[4];
        pa[0] = pack2_f16(p[2 * kk][0], p[2 * kk][1]);
        pa[1] = HI ? pack2_f16(p[2 * kk][2], p[2 * kk][3]) : 0u;
        pa[2] = pack2_f16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[3] = HI ? pack2_f16(p[2 * kk + 1][2], p[2 * kk + 1][3]) : 0u;
#pragma unroll
        for (int cg = 0; cg < CG; ++cg) {
            u32 rw[4][LW / 4];                        // keys 16kk + 4t + i: codes of lane g's LW columns
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 16 * kk + 4 * t + i;
                const int byte = cg * 8 * LW + g * LW;            // the row's first code of this lane
                const unsigned char* src = Vt + 16 * swz_chunk(r, byte / 16) + byte % 16;
#if LW == 16
                const uint4 w = *reinterpret_cast<const uint4*>(src);
                rw[i][0] = w.x; rw[i][1] = w.y; rw[i][2] = w.z; rw[i][3] = w.w;
#else
                const uint2 w = *reinterpret_cast<const uint2*>(src);
                rw[i][0] = w.x; rw[i][1] = w.y;
#endif
            }
#pragma unroll
            for (int c = 0; c < LW; ++c) {
                const u32 b0 = pair_f16x2(rw[0][c / 4], rw[1][c / 4], c % 4);   // keys 4t, 4t + 1
                const u32 b1 = pair_f16x2(rw[2][c / 4], rw[3][c / 4], c % 4);   // keys 4t + 2, 4t + 3
                mma16816_f16(o[cg * LW + c], pa, b0, b1);
            }
        }
    }
}
