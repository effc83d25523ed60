// hopper_tile.cuh -- what every Hopper attention kernel does to one tile, whatever the layout
// its Q, K and V have in HBM (contiguous tensors: fa_v3 .. fa_v8 and bwd_v3, through
// hopper_attention.cuh; a paged cache: paged_prefill_v3, through hopper_paged.cuh; FP8 codes:
// fa_fp8_v1 and v2, through hopper_fp8.cuh): the register shapes of S and O, the key-tile range
// of a query block, the mask, the online softmax of one S tile held in wgmma accumulator
// registers (and the mask as two bounds a row), the two products from SRAM, the P fragments, and
// the epilogue.  One home for each, so a kernel that reads its tiles another way does not fork them.
//
// Notation (FlashAttention's):
//   Br = BLOCK_M  query rows a thread block owns (64 per consumer warpgroup)
//   Bc = BLOCK_N  keys a K/V tile holds; Tc = the tiles a block visits
//   S = Q K^T (raw dot products, float32 registers), P = exp2(S * scale * log2(e) - m)
//   m, l          running row max (log2 units of scaled S) and row sum; O the float32 accumulator
//   LSE           (m + log2(l)) * ln(2): natural log, as the rest of the package
//
// Visibility (bottom-right aligned, like FlashAttention >= 2.1): query row r sees key c iff
//   c < Nk, and c <= r + (Nk - Nq) + right (right >= 0), and c >= r + (Nk - Nq) - left (left >= 0);
// causal is right = 0.  A row that sees nothing ends with l = 0: O = 0 and LSE = -inf.
//
// A thread of a consumer warpgroup owns two rows of the 64-row slab (the wgmma accumulator layout,
// hopper_common.cuh): row_a = 16 * warp + g and row_b = row_a + 8, and of each 8-column block of
// S and O the columns 2t and 2t + 1.  A row's max and sum are reduced over the 4 lanes (t) that
// share it with two shuffles.
#pragma once
#include "hopper_common.cuh"

#ifndef HEAD_DIM
#error "hopper_tile.cuh: -DHEAD_DIM is missing (the kernel's config passes it)"
#endif
#ifndef BLOCK_M
#error "hopper_tile.cuh: -DBLOCK_M is missing (the kernel's config passes it)"
#endif
#ifndef BLOCK_N
#error "hopper_tile.cuh: -DBLOCK_N is missing (the kernel's config passes it)"
#endif

#define D_PANELS (HEAD_DIM / PANEL)          // 64-column swizzle panels a row of Q, K or V spans
#define S_REGS (BLOCK_N / 2)                 // float32 registers a thread holds of S (64 x Bc)
#define O_REGS (HEAD_DIM / 2)                // ... of O (64 x d)
#define QK_STEPS (HEAD_DIM / 16)             // wgmma k-steps of S = Q K^T
#define PV_STEPS (BLOCK_N / 16)              // wgmma k-steps of O += P V
#define Q_PANEL_BYTES (BLOCK_M * PANEL_BYTES)
#define KV_PANEL_BYTES (BLOCK_N * PANEL_BYTES)

#if BLOCK_N == 128
#define WGMMA_S wgmma_ss_n128<0>
#elif BLOCK_N == 80
#define WGMMA_S wgmma_ss_n80<0>               // attention v8's key tile at head_dim 256
#else
#define WGMMA_S wgmma_ss_n64<0>
#endif
#if HEAD_DIM == 128
#define WGMMA_O wgmma_rs_n128
#elif HEAD_DIM == 256
#define WGMMA_O wgmma_rs_n256                // O is 64 x 256: one wgmma spans V's four panels
#else
#define WGMMA_O wgmma_rs_n64
#endif

// The problem, as every version receives it.
struct AttnShape {
    int nq, nk, heads_q, heads_kv;
    float scale_log2;        // softmax scale * log2(e)
    int left, right;         // window; -1 unbounded (causal: right = 0)
};

// K/V tiles [begin, end) that some row of [r0, r_last] can see
struct TileRange { int begin, end; };
__device__ __forceinline__ TileRange key_tiles(const AttnShape& p, int r0, int r_last) {
    const int off = p.nk - p.nq;
    const int hi = p.right >= 0 ? min(p.nk, r_last + off + p.right + 1) : p.nk;   // exclusive
    const int lo = p.left >= 0 ? max(0, r0 + off - p.left) : 0;
    if (hi <= lo) return {0, 0};
    return {lo / BLOCK_N, (hi + BLOCK_N - 1) / BLOCK_N};
}

// What this block computes.  Grid: (Tr = ceil(Nq / Br), heads_q, batch).  heavy_first (causal,
// right-bounded windows): the last query tiles, which see the most keys, start first
// (tile Tr - 1 - blockIdx.x), so the short ones fill the tail of the grid.
struct BlockWork {
    int bh;              // Q / O / LSE slab: b * heads_q + h
    int bh_kv;           // the K / V slab it reads (GQA: kv head h / (heads_q / heads_kv))
    int r0, r_last;      // its first and last query row
    TileRange tiles;     // the K/V tiles those rows can see
    int n_tiles;
};
__device__ __forceinline__ BlockWork block_work(const AttnShape& p, int heavy_first) {
    const int tile_q = heavy_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    BlockWork w;
    w.bh = b * p.heads_q + h;
    w.bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
    w.r0 = tile_q * BLOCK_M;
    w.r_last = min(w.r0 + BLOCK_M, p.nq) - 1;
    w.tiles = key_tiles(p, w.r0, w.r_last);
    w.n_tiles = w.tiles.end - w.tiles.begin;
    return w;
}

// does tile j hold a key that some row of [r0, r_last] must not see? (else no mask is applied)
__device__ __forceinline__ bool tile_needs_mask(const AttnShape& p, int j, int r0, int r_last) {
    const int off = p.nk - p.nq, c0 = j * BLOCK_N, c1 = c0 + BLOCK_N - 1;
    return c1 >= p.nk || (p.right >= 0 && c1 > r0 + off + p.right) || (p.left >= 0 && c0 < r_last + off - p.left);
}
__device__ __forceinline__ bool visible(const AttnShape& p, int r, int c) {
    const int off = p.nk - p.nq;
    return c < p.nk && (p.right < 0 || c <= r + off + p.right) && (p.left < 0 || c >= r + off - p.left);
}

// The same visibility as two bounds a row, computed once (fa_v6, fa_v8): row r sees key c iff
// lo[r] <= c <= hi[r] (c < Nk, c <= r + Nk - Nq + right, c >= r + Nk - Nq - left); and a block's
// (a tile needs no mask iff every row of the block sees all its keys: cmin <= its first key and
// its last <= cmax)
struct RowBounds {
    int lo[2], hi[2];
};
__device__ __forceinline__ RowBounds row_bounds(const AttnShape& p, int row_a) {
    const int off = p.nk - p.nq;
    RowBounds b;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_a + 8 * r;
        b.lo[r] = p.left >= 0 ? row + off - p.left : 0;                  // keys are >= 0 anyway
        b.hi[r] = p.right >= 0 ? min(p.nk - 1, row + off + p.right) : p.nk - 1;
    }
    return b;
}
struct TileBounds {
    int cmin, cmax;
};
__device__ __forceinline__ TileBounds tile_bounds(const AttnShape& p, int r0, int r_last) {
    const int off = p.nk - p.nq;
    return {p.left >= 0 ? r_last + off - p.left : 0, p.right >= 0 ? min(p.nk - 1, r0 + off + p.right) : p.nk - 1};
}
__device__ __forceinline__ bool tile_needs_mask_b(const TileBounds& tb, int j) {
    return j * BLOCK_N < tb.cmin || j * BLOCK_N + BLOCK_N - 1 > tb.cmax;
}

// the online-softmax state of this thread's two rows
struct RowState {
    float m[2];   // running max, log2 units
    float l[2];   // running sum of this thread's columns (reduced over the quad at the end)
};
__device__ __forceinline__ void row_state_init(RowState& st) {
    st.m[0] = st.m[1] = neg_inf_f();
    st.l[0] = st.l[1] = 0.f;
}

// S_ij scaled into log2 units (times ``scale_log2``: the softmax scale times log2(e), and for FP8
// codes their block scales too), masked keys set to -inf, and this thread's max of each of its
// two rows in mx
template <bool MASK>
__device__ __forceinline__ void scale_and_mask(float (&s)[S_REGS], float (&mx)[2], const AttnShape& p,
                                               float scale_log2, int row_a, int col0) {
    const int t = threadIdx.x % 4;
    mx[0] = mx[1] = neg_inf_f();
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int r = i % 4 < 2 ? 0 : 1;
        float x = s[i] * scale_log2;
        if (MASK && !visible(p, row_a + 8 * r, col0 + 8 * (i / 4) + 2 * t + i % 2)) x = neg_inf_f();
        s[i] = x;
        mx[r] = fmaxf(mx[r], x);
    }
}

// The online softmax's update, once S is scaled and masked (mx: this thread's row maxima): S
// becomes P = exp2(S - m_new) in place, m and l are updated, and alpha[r] = exp2(m_old - m_new)
// is what O's rows must be multiplied by before P V_j is added.
__device__ __forceinline__ void softmax_update(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                               const float (&mx)[2]) {
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(st.m[r], quad_max(mx[r]));
        base[r] = m_new == neg_inf_f() ? 0.f : m_new;         // a row with nothing visible yet: P = 0, not NaN
        alpha[r] = fast_exp2(st.m[r] - base[r]);          // exp2(-inf) = 0 on the first visible tile
        st.m[r] = m_new;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int r = i % 4 < 2 ? 0 : 1;
        s[i] = fast_exp2(s[i] - base[r]);
        sum[r] += s[i];
    }
    st.l[0] = st.l[0] * alpha[0] + sum[0];
    st.l[1] = st.l[1] * alpha[1] + sum[1];
}

// One step of the online softmax on S_ij, in place: S becomes P = exp2(S * scale_log2 - m_new)
// (float32, still in the accumulator registers), m and l are updated, and alpha[r] =
// exp2(m_old - m_new) is what O's rows must be multiplied by before P V_j is added.
// row_a: this thread's first row (global index); col0: the tile's first key.
template <bool MASK>
__device__ __forceinline__ void softmax_step(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                             const AttnShape& p, int row_a, int col0) {
    float mx[2];
    scale_and_mask<MASK>(s, mx, p, p.scale_log2, row_a, col0);
    softmax_update(s, st, alpha, mx);
}

__device__ __forceinline__ void rescale_o(float (&o)[O_REGS], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[i % 4 < 2 ? 0 : 1];
}

// P (float32 accumulator layout) -> the A-operand fragments of O += P V, 16 keys a k-step.  The
// accumulator layout of 16 columns (two 8-column blocks) is exactly the register layout wgmma
// takes for a 64 x 16 A tile, so this is a conversion to 16 bits in place, no data movement.
__device__ __forceinline__ void p_fragments(const float (&s)[S_REGS], u32 (&pa)[PV_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) {
        pa[kk][0] = pack2_cvt_x2(s[8 * kk + 0], s[8 * kk + 1]);   // row a, keys 16kk + 2t, +1
        pa[kk][1] = pack2_cvt_x2(s[8 * kk + 2], s[8 * kk + 3]);   // row b
        pa[kk][2] = pack2_cvt_x2(s[8 * kk + 4], s[8 * kk + 5]);   // row a, keys 16kk + 8 + 2t, +1
        pa[kk][3] = pack2_cvt_x2(s[8 * kk + 6], s[8 * kk + 7]);   // row b
    }
}

// S = Q K_j^T for this warpgroup's 64 rows: q_slab = its rows of the Q tile (q_panel_bytes
// apart panel to panel), k_tile = the K_j tile; both K-major, 128-byte swizzled.
__device__ __forceinline__ void issue_qk(float (&s)[S_REGS], const unsigned char* q_slab, u32 q_panel_bytes,
                                         const unsigned char* k_tile) {
#pragma unroll
    for (int kk = 0; kk < QK_STEPS; ++kk) {
        const int panel = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
        WGMMA_S(s, smem_desc_k_major(q_slab + panel * q_panel_bytes + within),
                smem_desc_k_major(k_tile + panel * KV_PANEL_BYTES + within), kk > 0);
    }
}
// O += P V_j: P from registers, V_j MN-major (16 keys = 16 rows of 128 bytes a k-step)
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&pa)[PV_STEPS][4],
                                         const unsigned char* v_tile) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk)
        WGMMA_O(o, pa[kk], smem_desc_mn_major(v_tile + kk * 16 * PANEL_BYTES, KV_PANEL_BYTES));
}

// ----------------------------------------------------------------------------- epilogue
// write O_i -> HBM (16-bit, normalised by l) and LSE_i -> HBM (float32) for this thread's two rows
__device__ __forceinline__ void write_o_lse(const float (&o)[O_REGS], RowState& st, u16* __restrict__ o_out,
                                            float* __restrict__ lse_out, const AttnShape& p, int bh, int row_a) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_a + 8 * r;
        const float l = quad_sum(st.l[r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (row < p.nq) {
            u16* dst = o_out + ((size_t)bh * p.nq + row) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j)
                *(u32*)(dst + 8 * j) = pack2_cvt_x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            if (t == 0) lse_out[(size_t)bh * p.nq + row] = l > 0.f ? (st.m[r] + fast_log2(l)) * LN2 : neg_inf_f();
        }
    }
}
