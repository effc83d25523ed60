// hopper_paged.cuh -- what the Hopper paged prefill (paged_prefill_v3.cu) adds to the tile math of
// hopper_tile.cuh (the register shapes, the row state, the P fragments and the two wgmma products,
// shared with fa_v3 .. fa_v5), where a packed GQA query tile and a paged cache need it:
//   * the mask is a per-row key limit: a row of the tile is a (token, query head) pair, so its
//     horizon comes from its token (row / g), computed once per row, not from the row index;
//   * a K/V tile is several TMA boxes, one per cache block (or one slice of a block larger than
//     the tile) and 64-column panel, read through the block table (4-D tensor map over the pool);
//   * the O / LSE epilogue writes packed (total_q, Hq, d) rows and (Hq, total_q) LSE.
// The P fragments and the two wgmma products are hopper_tile.cuh's; its online softmax is
// softmax_step_limits below (hopper_tile.cuh's softmax_step with the mask as a key limit).
//
// Notation (FlashAttention's):
//   Br = BLOCK_M  packed query rows a thread block owns (128 = 128 / g tokens x g query heads)
//   Bc = BLOCK_N  keys a K/V tile holds; Tc = the tiles a block visits
//   S = Q K^T (float32 wgmma accumulators), P = exp2(S * scale * log2(e) - m)
//   m, l          running row max (log2 units of scaled S) and row sum; O the float32 accumulator
//   LSE           (m + log2(l)) * ln(2): natural log, as the rest of the package
//
// A thread of a consumer warpgroup owns two rows of the 64-row slab (the wgmma accumulator layout,
// hopper_common.cuh): row_a = 16 * warp + g and row_b = row_a + 8, and of each 8-column block of
// S and O the columns 2t and 2t + 1.
#pragma once
#include "hopper_common.cuh"

#ifndef HEAD_DIM
#error "hopper_paged.cuh: -DHEAD_DIM is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#ifndef BLOCK_M
#error "hopper_paged.cuh: -DBLOCK_M is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#ifndef BLOCK_N
#error "hopper_paged.cuh: -DBLOCK_N is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#ifndef STAGES
#error "hopper_paged.cuh: -DSTAGES is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#ifndef PAGE_SIZE
#error "hopper_paged.cuh: -DPAGE_SIZE is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "the Hopper paged prefill takes HEAD_DIM 64 or 128"
#endif
#if BLOCK_N != 64 && BLOCK_N != 128
#error "the Hopper paged prefill takes BLOCK_N 64 or 128 (one wgmma's N)"
#endif
// A cache block lands as PAGE_SIZE rows of one 128-byte swizzle panel.  The 128-byte swizzle
// permutes 16-byte chunks within 8-row (1024-byte) atoms; a box of a multiple of 8 rows starts
// and ends on an atom boundary, so the boxes of a tile land exactly where one box of Bc rows
// would have, and the wgmma descriptors see one ordinary swizzled tile.
#if PAGE_SIZE % 8 != 0 || (BLOCK_N % PAGE_SIZE != 0 && PAGE_SIZE % BLOCK_N != 0)
#error "the Hopper paged prefill takes PAGE_SIZE (the block_size) a multiple of 8 that divides BLOCK_N or is a multiple of it"
#endif

#include "hopper_tile.cuh"                 // S_REGS, O_REGS, the products, RowState, p_fragments

#define Q_TILE_BYTES (BLOCK_M * HEAD_DIM * ELEM_BYTES)
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * ELEM_BYTES)
//: rows one TMA box of the pool holds: a whole cache block, or a tile's slice of a larger one
#define BOX_ROWS (PAGE_SIZE < BLOCK_N ? PAGE_SIZE : BLOCK_N)
//: boxes a K or V tile takes in each panel (cache blocks a tile spans)
#define BOXES (BLOCK_N / BOX_ROWS)


// The pool is read as a 4-D tensor (d, Hkv, block_size, num_blocks): hopper_common.cuh's tma_load_4d.

// ----------------------------------------------------------------------------- SRAM
// The dynamic SRAM of a block, 1024-byte aligned: Q_i, STAGES x K_j, STAGES x V_j, then the
// mbarriers: q_full, k_full[STAGES], v_full[STAGES], empty[STAGES], v_tail (the last V tile once
// the rows past the sequence's end are zeroed: see paged_prefill_v3.cu).
struct PagedSmem {
    unsigned char *q, *k, *v;
    u64 *q_full, *k_full, *v_full, *empty, *v_tail;
};
__device__ __forceinline__ PagedSmem carve_paged_smem(unsigned char* raw) {
    PagedSmem sm;
    sm.q = (unsigned char*)(((size_t)raw + SWIZZLE_ATOM_BYTES - 1) & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    sm.k = sm.q + Q_TILE_BYTES;
    sm.v = sm.k + STAGES * KV_TILE_BYTES;
    sm.q_full = (u64*)(sm.v + STAGES * KV_TILE_BYTES);
    sm.k_full = sm.q_full + 1;
    sm.v_full = sm.k_full + STAGES;
    sm.empty = sm.v_full + STAGES;
    sm.v_tail = sm.empty + STAGES;
    return sm;
}

// ----------------------------------------------------------------------------- online softmax
// One step of the online softmax on S_ij, in place (hopper_tile.cuh's softmax_step with the
// mask as a key limit): S becomes P = exp2(S * scale_log2 - m_new), m and l are updated, and
// alpha[r] = exp2(m_old - m_new) is what O's rows must be multiplied by before P V_j is added.
// lim[r]: this thread's row r sees keys [0, lim[r]); col0: the tile's first key.
template <bool MASK>
__device__ __forceinline__ void softmax_step_limits(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                                    float scale_log2, const int (&lim)[2], int col0) {
    const int t = threadIdx.x % 4;
    float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int r = i % 4 < 2 ? 0 : 1;
        float x = s[i] * scale_log2;
        // a select, not arithmetic: a key past the sequence's end may hold anything
        if (MASK && col0 + 8 * (i / 4) + 2 * t + i % 2 >= lim[r]) x = neg_inf_f();
        s[i] = x;
        mx[r] = fmaxf(mx[r], x);
    }
    softmax_update(s, st, alpha, mx);
}

