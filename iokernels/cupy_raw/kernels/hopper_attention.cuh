// hopper_attention.cuh -- what the Hopper FlashAttention versions over contiguous tensors
// (fa_v3 .. fa_v8; bwd_v3 reuses it) share beyond the tile math of hopper_tile.cuh: the
// tile sizes in SRAM, the SRAM layout of a block, and the TMA copies of the producer (Q, K, V
// seen as 3-D tensors (head_dim, seq, batch * heads)); and (fa_v7, fa_v8) K and V released apart.
#pragma once
#include "hopper_common.cuh"

#ifndef HEAD_DIM
#error "hopper_attention.cuh: -DHEAD_DIM is missing (HopperConfig.defines passes it)"
#endif
#ifndef BLOCK_M
#error "hopper_attention.cuh: -DBLOCK_M is missing (HopperConfig.defines passes it)"
#endif
#ifndef BLOCK_N
#error "hopper_attention.cuh: -DBLOCK_N is missing (HopperConfig.defines passes it)"
#endif
#ifndef STAGES
#error "each kernel file sets its default STAGES before including hopper_attention.cuh"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128 && HEAD_DIM != 256
#error "the Hopper attention kernels take HEAD_DIM 64, 128 or 256"
#endif
// WIDE_KEY_TILES (fa_v8.cu defines it): the kernel also takes the 80-key tile FlashAttention-3
// takes at HEAD_DIM 256 (two stages of it fill the SRAM)
#ifndef WIDE_KEY_TILES
#define WIDE_KEY_TILES 0
#endif
#if BLOCK_N != 64 && BLOCK_N != 128 && !(WIDE_KEY_TILES && BLOCK_N == 80)
#error "the Hopper attention kernels take BLOCK_N 64 or 128 (one wgmma's N; fa_v8 also 80)"
#endif
#if HEAD_DIM == 256 && BLOCK_N != 64 && !(WIDE_KEY_TILES && BLOCK_N == 80)
// O (64 x 256: 128 float32 registers a thread) with S and P of a 128-key tile spill past a
// consumer's registers; 64-key tiles leave O, S (32) and P (16) in registers (80-key: 40 and 20)
#error "at HEAD_DIM 256 the Hopper attention kernels take BLOCK_N 64 (fa_v8 also 80)"
#endif
#if HEAD_DIM != 256 && BLOCK_N == 80
#error "BLOCK_N 80 is the wide key tile of HEAD_DIM 256 only"
#endif

#include "hopper_tile.cuh"

#define Q_TILE_BYTES (BLOCK_M * HEAD_DIM * ELEM_BYTES)
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * ELEM_BYTES)

// The dynamic SRAM of a block, 1024-byte aligned: Q_i, STAGES x K_j, STAGES x V_j, then the
// mbarriers: q_full, k_full[STAGES], v_full[STAGES], empty[STAGES] (v3 uses k_full as one
// barrier for K_j and V_j together, and no empty barriers).
struct AttnSmem {
    unsigned char *q, *k, *v;
    u64 *q_full, *k_full, *v_full, *empty;
};
__device__ __forceinline__ AttnSmem carve_smem(unsigned char* raw) {
    AttnSmem sm;
    sm.q = (unsigned char*)(((size_t)raw + SWIZZLE_ATOM_BYTES - 1) & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    sm.k = sm.q + Q_TILE_BYTES;
    sm.v = sm.k + STAGES * KV_TILE_BYTES;
    sm.q_full = (u64*)(sm.v + STAGES * KV_TILE_BYTES);
    sm.k_full = sm.q_full + 1;
    sm.v_full = sm.k_full + STAGES;
    sm.empty = sm.v_full + STAGES;
    return sm;
}
// ask the copy engine for one K or V tile (D_PANELS boxes of Bc rows x 64 columns)
__device__ __forceinline__ void load_kv_tile(unsigned char* dst, const TmaMap* map, u64* bar, int key0, int z) {
#pragma unroll
    for (int pnl = 0; pnl < D_PANELS; ++pnl)
        tma_load_3d(dst + pnl * KV_PANEL_BYTES, map, bar, pnl * PANEL, key0, z);
}

// ----------------------------------------------------------------------------- warp specialization
// (v4, v5) one thread initialises the barriers: full ones complete on the producer's expect_tx
// arrival plus the copy engine's bytes; empty ones on one arrival per consumer warp
__device__ __forceinline__ void init_specialized_barriers(const AttnSmem& sm, int consumer_warps) {
    mbar_init(sm.q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(&sm.k_full[s], 1);
        mbar_init(&sm.v_full[s], 1);
        mbar_init(&sm.empty[s], consumer_warps);
    }
    mbar_fence_init();
}
// (v4, v5) the producer's one thread: Q_i -> SRAM once, then K_j, V_j -> SRAM stage s as soon as
// every consumer warp has released the tile that stage held before
__device__ __forceinline__ void produce(const AttnSmem& sm, const BlockWork& w, const TmaMap* map_q,
                                        const TmaMap* map_k, const TmaMap* map_v) {
    mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);               // load Q_i -> SRAM, once
    for (int pnl = 0; pnl < D_PANELS; ++pnl)
        tma_load_3d(sm.q + pnl * Q_PANEL_BYTES, map_q, sm.q_full, pnl * PANEL, w.r0, w.bh);
    for (int it = 0; it < w.n_tiles; ++it) {                      // load K_j, V_j -> SRAM stage s
        const int s = it % STAGES, key0 = (w.tiles.begin + it) * BLOCK_N;
        mbar_wait(&sm.empty[s], ((it / STAGES) & 1) ^ 1);         // stage s's last tile is consumed
        mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
        load_kv_tile(sm.k + s * KV_TILE_BYTES, map_k, &sm.k_full[s], key0, w.bh_kv);
        mbar_arrive_expect_tx(&sm.v_full[s], KV_TILE_BYTES);
        load_kv_tile(sm.v + s * KV_TILE_BYTES, map_v, &sm.v_full[s], key0, w.bh_kv);
    }
}

// ----------------------------------------------------------------------------- K and V released apart
// (v7, v8) v5's barriers (q_full, k_full, v_full, empty: here the V tiles' empties) and, after
// them, k_empty[STAGES]: the launcher's SRAM size counts 1 + 4 x STAGES barriers for these versions
// (HopperConfig.smem_bytes, BARRIERS_A_STAGE).
__device__ __forceinline__ u64* k_empty_of(const AttnSmem& sm) { return sm.empty + STAGES; }

// (v7, v8) one thread: the full barriers complete on the producer's expect_tx arrival plus the copy
// engine's bytes; each empty one on one arrival per consumer warp
__device__ __forceinline__ void init_barriers_kv_apart(const AttnSmem& sm, int consumer_warps) {
    mbar_init(sm.q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(&sm.k_full[s], 1);
        mbar_init(&sm.v_full[s], 1);
        mbar_init(&sm.empty[s], consumer_warps);
        mbar_init(&k_empty_of(sm)[s], consumer_warps);
    }
    mbar_fence_init();
}

// (v7, v8) the producer's one thread: Q_i once, then K_j and V_{j-1} in the order the consumers use them,
// each into its stage as soon as that stage's last K (or V) tile has been released
__device__ __forceinline__ void produce_kv_apart(const AttnSmem& sm, const BlockWork& w, const TmaMap* map_q,
                                                 const TmaMap* map_k, const TmaMap* map_v) {
    u64* k_empty = k_empty_of(sm);
    mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);               // load Q_i -> SRAM, once
    for (int pnl = 0; pnl < D_PANELS; ++pnl)
        tma_load_3d(sm.q + pnl * Q_PANEL_BYTES, map_q, sm.q_full, pnl * PANEL, w.r0, w.bh);
    for (int it = 0; it <= w.n_tiles; ++it) {
        if (it < w.n_tiles) {                                     // K_j -> stage it % STAGES
            const int s = it % STAGES;
            mbar_wait(&k_empty[s], ((it / STAGES) & 1) ^ 1);
            mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
            load_kv_tile(sm.k + s * KV_TILE_BYTES, map_k, &sm.k_full[s], (w.tiles.begin + it) * BLOCK_N, w.bh_kv);
        }
        if (it > 0) {                                             // V_{j-1} -> stage (it - 1) % STAGES
            const int sp = (it - 1) % STAGES;
            mbar_wait(&sm.empty[sp], (((it - 1) / STAGES) & 1) ^ 1);
            mbar_arrive_expect_tx(&sm.v_full[sp], KV_TILE_BYTES);
            load_kv_tile(sm.v + sp * KV_TILE_BYTES, map_v, &sm.v_full[sp], (w.tiles.begin + it - 1) * BLOCK_N,
                         w.bh_kv);
        }
    }
}
