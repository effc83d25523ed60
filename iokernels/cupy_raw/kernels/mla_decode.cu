// mla_decode.cu -- multi-head latent attention (MLA) decode for Hopper: wgmma, TMA, split-KV.
//
// In the absorbed form (iokernels/mla.py) MLA decode is attention with ONE cached row per token
// shared by every query head: the row c_t = [latent (LATENT) | rotary key (ROPE)] is the key, and
// its first LATENT columns are the value.  For query head h of sequence b:
//     S[h, t] = q[b, h] . c_t            (LATENT + ROPE wide)
//     O[b, h] = sum_t softmax_t(scale S[h, t]) c_t[:LATENT]
// With 64 heads sharing each row, a 64 x 64 tile of S is a real matrix product: the tensor cores.
//
// Block: two warpgroups (256 threads), one block per (64 query heads, split of the keys, sequence);
// grid (ceil(Hq / 64), num_splits, batch), head blocks of one split side by side so they read the
// same rows close in time (the second read is an L2 hit).  SRAM (the launcher's smem_bytes):
//   Q      64 heads x (LATENT + ROPE), resident (9 panels of 64 rows x 128 bytes at 512 + 64)
//   KV[2]  two stages of BLOCK_N = 64 cache rows x (LATENT + ROPE): the key tile of S = Q KV^T, and
//          its first LATENT columns the value tile of O += P V (the same bytes, read as an
//          MN-major operand: no second copy)
//   P      64 x 64 probabilities (16-bit), written by warpgroup 0, read by both
//   alpha, l, m   one float per head row
// Warpgroup 0 computes S_j = Q KV_j^T (wgmma m64n64k16, A and B from SRAM), the online softmax in
// registers, writes P_j and the rescale factors alpha to SRAM; then both warpgroups rescale their
// half of O and add P_j V_j (wgmma m64n256k16): warpgroup c owns O's columns [256 c, 256 c + 256)
// (128 float32 registers a thread).  Thread 0 issues the TMA copies: Q once, tiles 0 and 1 up
// front, then tile j + 2 as soon as both warpgroups are done with tile j (its stage is free).
// Each named barrier is one instruction that both warpgroups execute (bar.sync is .aligned, and
// a barrier reached from two branches is divergent to compute-sanitizer's synccheck).
//
// Notation (FlashAttention's):
//   Br = 64       query heads a block owns (the rows of S and O)
//   Bc = BLOCK_N  cache rows a KV tile holds; Tc the tiles of this block's split
//   m, l          running row max (log2 units of scaled S) and row sum; O the float32 accumulator
//   LSE           (m + log2(l)) * ln(2), natural log
//   O_s, LSE_s    a split's partial (normalised) output and log-sum-exp; decode.cu's combine merges
//
// Lengths: sequence b has seq_lens[b] rows (all nk when seq_lens is null); its rows are split
// into chunks of keys_per_split (a multiple of Bc, so a tile never crosses a split or a page).
// Rows at or past the length are masked (-inf) in S and zeroed in SRAM before P V (whatever
// bytes lie there, 0 * NaN would otherwise poison O).  A sequence (or split) with no rows
// writes O = 0 and LSE = -inf.
// PAGED=1: the cache is a pool (num_blocks, PAGE_SIZE, LATENT + ROPE) read through an int32
// block table (batch, max_blocks); row n of sequence b is row n % PAGE_SIZE of block
// table[b][n / PAGE_SIZE].  PAGE_SIZE is a multiple of Bc.
//
// Left out: the S product runs on warpgroup 0 alone while warpgroup 1 waits, and the softmax
// is not overlapped with a product (FlashMLA overlaps both); the ring has two stages because
// Q and two tiles fill the SRAM a block may have.
//
// Compile-time settings: IK_DTYPE (1 float16, 2 bfloat16), LATENT (512), ROPE (64), PAGED,
// PAGE_SIZE.
#include "hopper_common.cuh"

#ifndef LATENT
#error "mla_decode.cu: -DLATENT is missing (MLADecodeConfig.defines passes it)"
#endif
#ifndef ROPE
#error "mla_decode.cu: -DROPE is missing (MLADecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "mla_decode.cu: -DPAGED is missing (MLADecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(PAGE_SIZE)
#error "mla_decode.cu: -DPAGE_SIZE is missing (MLADecodeConfig.defines passes it for a paged cache)"
#endif
#if LATENT != 512 || ROPE != 64
#error "mla_decode: LATENT 512 and ROPE 64 only (two warpgroups of 256 output columns, 9 panels)"
#endif

#define BLOCK_N 64                            // Bc: cache rows a tile (one m64n64 wgmma for S)
#define HEADS_BLOCK 64                        // Br: query heads a block (one warpgroup's 64 rows)
#if PAGED && (PAGE_SIZE % BLOCK_N) != 0
#error "mla_decode: PAGE_SIZE must be a multiple of 64 (a tile never crosses a page)"
#endif
#define ROW (LATENT + ROPE)                   // values a cache row
#define ROW_PANELS (ROW / PANEL)              // 64-column swizzle panels a row spans (9)
#define TILE_PANEL_BYTES (BLOCK_N * PANEL_BYTES)       // one panel of a KV tile (8 KB)
#define Q_PANEL_BYTES (HEADS_BLOCK * PANEL_BYTES)      // one panel of Q (8 KB)
#define TILE_BYTES (ROW_PANELS * TILE_PANEL_BYTES)     // a KV tile (72 KB)
#define Q_BYTES (ROW_PANELS * Q_PANEL_BYTES)           // Q (72 KB)
#define P_BYTES (HEADS_BLOCK * BLOCK_N * ELEM_BYTES)   // P, one panel (8 KB)
#define STAGES 2
#define NTHREADS 256
#define HALF (LATENT / 2)                     // O columns a warpgroup owns (256)
#define HALF_PANELS (HALF / PANEL)            // V panels a warpgroup reads (4)
#define QK_STEPS (ROW / 16)                   // wgmma k-steps of S = Q KV^T (36)
#define PV_STEPS (BLOCK_N / 16)               // wgmma k-steps of O += P V (4)
#define S_REGS (BLOCK_N / 2)                  // float32 registers a thread holds of S (32)
#define O_REGS (HALF / 2)                     // ... of its half of O (128)
//: named barriers (0 is __syncthreads), each among both warpgroups (256 threads):
//: BAR_P opens when P_j and alpha are in SRAM; BAR_FREE when warpgroup 1 is done with tile j
#define BAR_P 1
#define BAR_FREE 2

// load cache rows [key0, key0 + 64) of sequence b -> SRAM tile `dst` (9 boxes of 64 x 64)
__device__ __forceinline__ void load_tile(unsigned char* dst, const TmaMap* map, u64* bar, int key0, int b,
                                          const int* __restrict__ block_table, int max_blocks) {
    mbar_arrive_expect_tx(bar, TILE_BYTES);
#if PAGED
    const int blk = block_table[(long long)b * max_blocks + key0 / PAGE_SIZE];
    const int r = key0 % PAGE_SIZE, z = blk;
#else
    const int r = key0, z = b;
#endif
#pragma unroll
    for (int p = 0; p < ROW_PANELS; ++p) tma_load_3d(dst + p * TILE_PANEL_BYTES, map, bar, p * PANEL, r, z);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
mla_decode(const __grid_constant__ TmaMap map_q,     // q (batch, heads_q, ROW) as (ROW, heads_q, batch)
           const __grid_constant__ TmaMap map_kv,    // cache (batch, nk, ROW) or pool (blocks, PAGE_SIZE, ROW)
           const int* __restrict__ seq_lens,         // (batch,) int32, or null: every sequence has nk rows
           const int* __restrict__ block_table, int max_blocks,   // PAGED only
           int nk, int heads_q, float scale_log2, int num_splits, int keys_per_split,
           float* __restrict__ O_part, float* __restrict__ LSE_part,   // (splits, batch, heads_q[, LATENT])
           u16* __restrict__ O, float* __restrict__ LSE) {             // (batch, heads_q[, LATENT])
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sq = (unsigned char*)(((size_t)smem_raw + SWIZZLE_ATOM_BYTES - 1)
                                         & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    unsigned char* skv = sq + Q_BYTES;                       // STAGES tiles
    unsigned char* sp = skv + STAGES * TILE_BYTES;           // P
    float* s_alpha = (float*)(sp + P_BYTES);                 // [64] rescale of O's rows
    float* s_l = s_alpha + HEADS_BLOCK;                      // [64] final row sums
    float* s_m = s_l + HEADS_BLOCK;                          // [64] final row maxima
    u64* q_full = (u64*)(s_m + HEADS_BLOCK);
    u64* full = q_full + 1;                                  // [STAGES]

    const int hb = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int h0 = hb * HEADS_BLOCK;
    const int len = seq_lens ? seq_lens[b] : nk;
    const int n_begin = min(split * keys_per_split, len), n_end = min(n_begin + keys_per_split, len);
    const int n_tiles = (n_end - n_begin + BLOCK_N - 1) / BLOCK_N;

    const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int t = lane % 4;
    const int ra = 16 * warp + lane / 4, rb = ra + 8;        // this thread's two head rows (0..63)

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);
        mbar_fence_init();
        tma_prefetch_map(&map_q);
        tma_prefetch_map(&map_kv);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(q_full, Q_BYTES);              // load Q -> SRAM, once
#pragma unroll
        for (int p = 0; p < ROW_PANELS; ++p) tma_load_3d(sq + p * Q_PANEL_BYTES, &map_q, q_full, p * PANEL, h0, b);
        for (int j = 0; j < STAGES && j < n_tiles; ++j)       // load KV_0, KV_1 -> SRAM
            load_tile(skv + j * TILE_BYTES, &map_kv, &full[j], n_begin + j * BLOCK_N, b, block_table, max_blocks);
    }

    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};     // warpgroup 0's softmax state
    mbar_wait(q_full, 0);

    for (int it = 0; it < n_tiles; ++it) {                  // loop over KV tiles (stage s in SRAM)
        const int s = it % STAGES;
        const u32 parity = (it / STAGES) & 1;
        const int key0 = n_begin + it * BLOCK_N;
        unsigned char* tile = skv + s * TILE_BYTES;
        if (wg == 0) {
            mbar_wait(&full[s], parity);
            __syncwarp();                                    // the spin may leave lanes apart; wgmma is .aligned
            // S = Q KV^T (64 heads x 64 rows), 36 k-steps, both operands K-major from SRAM
            float sacc[S_REGS];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < QK_STEPS; ++kk) {
                const int panel = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
                wgmma_ss_n64<0>(sacc, smem_desc_k_major(sq + panel * Q_PANEL_BYTES + within),
                                smem_desc_k_major(tile + panel * TILE_PANEL_BYTES + within), kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sacc);
            // online softmax of this thread's two rows; rows at or past the length are masked
            float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int col = key0 + 8 * (i / 4) + 2 * t + (i % 2);
                const float x = col < n_end ? sacc[i] * scale_log2 : neg_inf_f();
                sacc[i] = x;
                mx[(i % 4) / 2] = fmaxf(mx[(i % 4) / 2], x);
            }
            float base[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m_new = fmaxf(m[r], quad_max(mx[r]));
                base[r] = m_new == neg_inf_f() ? 0.f : m_new;
                alpha[r] = fast_exp2(m[r] - base[r]);        // 0 on the first tile (m = -inf)
                m[r] = m_new;
            }
            float sum[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int r = (i % 4) / 2;
                sacc[i] = fast_exp2(sacc[i] - base[r]);
                sum[r] += sacc[i];
            }
            l[0] = l[0] * alpha[0] + sum[0];
            l[1] = l[1] * alpha[1] + sum[1];
            // write P (16-bit, 128-byte swizzled, K-major: the A operand of P V) and alpha -> SRAM
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = r ? rb : ra;
                    *(u32*)(sp + row * PANEL_BYTES + ((j ^ (row % 8)) * 16) + 4 * t) =
                        pack2_cvt_x2(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1]);
                }
            }
            if (t == 0) { s_alpha[ra] = alpha[0]; s_alpha[rb] = alpha[1]; }
            // a tile that ends past the length: zero its rows there (all panels; 16 bytes a store)
            const int valid = n_end - key0;
            if (valid < BLOCK_N) {
                const int chunks = (BLOCK_N - valid) * ROW_PANELS * (PANEL_BYTES / 16);
                for (int i = threadIdx.x; i < chunks; i += 128) {
                    const int c = i % (PANEL_BYTES / 16), rest = i / (PANEL_BYTES / 16);
                    const int p = rest % ROW_PANELS, r = valid + rest / ROW_PANELS;
                    *(uint4*)(tile + p * TILE_PANEL_BYTES + r * PANEL_BYTES + 16 * c) = make_uint4(0u, 0u, 0u, 0u);
                }
            }
            fence_proxy_async();                             // generic stores -> visible to wgmma
            __syncwarp();                                    // bar.sync is .aligned: whole warps,
        }                                                    // reconverged after the t == 0 / tail stores
        // every barrier is one instruction both warpgroups execute (none in a warpgroup's branch)
        named_bar_sync(BAR_P, NTHREADS);                     // P_j, alpha in SRAM
        if (wg == 1) {
            mbar_wait(&full[s], parity);                     // (completed: warpgroup 0 saw it)
            __syncwarp();
        }
        // both warpgroups: O_half = alpha O_half + P V_half  (V = the tile's first LATENT columns)
        const float a0 = s_alpha[ra], a1 = s_alpha[rb];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] *= (i % 4) < 2 ? a0 : a1;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_ss_n256<1>(o, smem_desc_k_major(sp + kk * 16 * ELEM_BYTES),
                             smem_desc_mn_major(tile + wg * HALF_PANELS * TILE_PANEL_BYTES + kk * 16 * PANEL_BYTES,
                                                TILE_PANEL_BYTES), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        if (it + 1 < n_tiles) {
            named_bar_sync(BAR_FREE, NTHREADS);              // both are done with tile it and P_j
            if (threadIdx.x == 0 && it + STAGES < n_tiles)   // load KV_{it+STAGES} -> SRAM, into its stage
                load_tile(tile, &map_kv, &full[s], key0 + STAGES * BLOCK_N, b, block_table, max_blocks);
        }
    }

    // epilogue: warpgroup 0's row sums and maxima -> SRAM, then each writes its half of O
    if (wg == 0) {
        const float la = quad_sum(l[0]), lb = quad_sum(l[1]);
        if (t == 0) { s_l[ra] = la; s_l[rb] = lb; s_m[ra] = m[0]; s_m[rb] = m[1]; }
    }
    __syncwarp();                                            // reconverged before the aligned barrier
    named_bar_sync(BAR_P, NTHREADS);
    const long long rows = (long long)gridDim.z * heads_q;   // batch * heads_q
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r ? rb : ra, h = h0 + row;
        if (h >= heads_q) continue;
        const float L = s_l[row];
        const float inv = L > 0.f ? 1.f / L : 0.f;
        const float lse = L > 0.f ? (s_m[row] + fast_log2(L)) * LN2 : neg_inf_f();
        const long long orow = (long long)b * heads_q + h;
        if (num_splits == 1) {                                // write O, LSE -> HBM
            u16* dst = O + orow * LATENT + wg * HALF + 2 * t;
#pragma unroll
            for (int j = 0; j < HALF / 8; ++j)
                *(u32*)(dst + 8 * j) = pack2_cvt_x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            if (wg == 0 && t == 0) LSE[orow] = lse;
        } else {                                              // write O_s, LSE_s -> HBM
            float* dst = O_part + ((long long)split * rows + orow) * LATENT + wg * HALF + 2 * t;
#pragma unroll
            for (int j = 0; j < HALF / 8; ++j)
                *(float2*)(dst + 8 * j) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            if (wg == 0 && t == 0) LSE_part[(long long)split * rows + orow] = lse;
        }
    }
}
