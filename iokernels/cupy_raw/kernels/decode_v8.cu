// decode_v8.cu -- Flash-Decoding, version 8: on Hopper, the query group is the 64 rows of one wgmma
// tile, and the copy engine (TMA) streams K/V tiles into a ring that one producer thread keeps full.
//
// What changed against decode_v6.cu (version 6), and why.  v4 and v6 give the g query heads of a KV
// head to mma.sync's 16-row A operands, 16 rows a warp: at g = 32 or 64 a team of 2 or 4 warps
// shares each K/V tile and the whole block waits at one barrier a tile for the slowest team, and
// every warp copies its share of each tile with 16-byte cp.async instructions.  A decode query is
// one row per head, so a KV head's group is a small matrix of g rows: exactly what the Hopper
// forward's consumer warpgroup multiplies (FlashAttention-2's mha_fwd swaps seqlen_q = 1 with the
// group for the same reason, "seqlenq_ngroups_swapped" in csrc/flash_attn/flash_api.cpp, code;
// FlashAttention-3 calls it PackGQA, hopper/, code).  Here:
//   * Q_g (the g heads' rows, zero past g: the tensor map's row extent is g) is one 64-row A
//     operand in SRAM; S = Q_g K_j^T is wgmma m64nBck16 from SRAM, O += P V_j wgmma with P from
//     registers, the online softmax on the accumulators: hopper_tile.cuh's, as the forward does;
//   * one thread (the producer warpgroup's first) asks the copy engine for each K_j and V_j
//     (hopper_common.cuh's tma_load_4d: the map spans (d, N, Hkv, B) with the cache's own
//     strides, so a view of a longer cache is read in place) and they land already swizzled,
//     counting down one full barrier a stage; the consumers never issue a copy;
//   * CONSUMERS warpgroups take the split's tiles in turn (c, c + CONSUMERS, ...), each with its
//     own m, l and O: while one waits for its products the other runs its softmax, and they merge
//     through SRAM at the end (decode_common.cuh, DECODE_MERGE_ROWS = CONSUMERS).  A tile has one
//     consumer, so its stage's empty barrier counts that warpgroup's 4 warps.
// Unchanged from v4: the split-KV grid (split, kv head, batch) and which keys a split owns
// (splits.cuh), ragged lengths, the sliding window, the partials and the fused combine
// (decode_common.cuh).  No paged cache: a page's rows are not one box of a tensor map.
//
// Keys a split does not own.  A tile starts at the split's first key, so only the split's last
// tile can run past its end n_end, into the next split's keys, a shorter sequence's unused rows,
// or past the map's extent N (those arrive as zeros).  Their scores are set to -inf, so P is 0
// there; and before P V those rows of V_j are zeroed in SRAM (whole 128-byte panel rows, whatever
// the swizzle), since 0 x NaN is NaN and a cache's unused rows may hold anything.  The producer
// warp zeroes them once the tile lands and releases it on one more mbarrier (tail_ready), which
// the tile's consumer waits on before P V: no barrier of a subset of the block's threads (a named
// barrier there made compute-sanitizer's racecheck report the merge's SRAM writes against its
// reads, as decode_v6.cu's header describes for its teams).
//
// Notation (Flash-Decoding, Dao et al., 2023; FlashAttention-3, Shah et al., 2024):
//   S        splits of the key axis (num_splits), one thread block per (split, kv head, b)
//   g        GROUP, query heads per KV head (at most 64: one consumer warpgroup's rows)
//   Bc       BLOCK_N, keys a K_j (and V_j) tile holds
//   m, l     running max (log2 units) and sum of a query row; O its unnormalised output
//
// Block: 1 producer warpgroup (one warp: its lane 0 issues the copies, the warp zeroes the tail;
// all 128 threads join the merge) +
// CONSUMERS consumer warpgroups.  SRAM: Q_g (64 rows), STAGES x (K_j, V_j), 1024-byte aligned;
// after the key loop the ring holds the consumers' merge buffer and the combine's weights.
// Compile-time settings, every one passed by the config (decode_v8_config.py; none has a default
// here): IK_DTYPE (1 float16, 2 bfloat16), HEAD_DIM (64, 128, 256), GROUP, BLOCK_N, STAGES,
// CONSUMERS, NUM_WARPS, FUSED, COMBINE_REG_SPLITS.
#ifndef HEAD_DIM
#error "decode_v8.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v8.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef BLOCK_N
#error "decode_v8.cu: -DBLOCK_N is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v8.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef CONSUMERS
#error "decode_v8.cu: -DCONSUMERS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef FUSED
#error "decode_v8.cu: -DFUSED is missing (DecodeConfig.defines passes it)"
#endif
#define BLOCK_M 64                        // one consumer warpgroup's rows: the group, zero past g
#include "hopper_tile.cuh"                // hopper_common.cuh: TMA, mbarriers, wgmma
#include "common.cuh"                     // elem_t, acc_t, the portable helpers of the merge
#include "splits.cuh"

#if GROUP < 1 || GROUP > BLOCK_M
#error "decode_v8: group 1..64 (the rows of one consumer warpgroup's tile; policy: decode_v8_config.v8_limits)"
#endif
#if STAGES < 2
#error "decode_v8: STAGES must be at least 2 (one tile in use, one in flight)"
#endif
#if CONSUMERS < 1 || CONSUMERS > 2
#error "decode_v8: one or two consumer warpgroups"
#endif
#if STAGES % CONSUMERS != 0
// stage s holds tiles s, s + STAGES, ...; with STAGES a multiple of CONSUMERS they all go to one
// consumer, which has finished the stage's last tile before it waits on the stage's next phase.
// Otherwise a consumer could wait on a full barrier two phases ahead, and its parity would read
// the previous tile as landed
#error "decode_v8: STAGES must be a multiple of CONSUMERS (each stage's tiles go to one consumer)"
#endif

#ifndef NUM_WARPS
#error "decode_v8.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#if NUM_WARPS != 4 * (CONSUMERS + 1)
#error "decode_v8: NUM_WARPS is the producer warpgroup's 4 and each consumer's 4"
#endif
#define NTHREADS (32 * NUM_WARPS)
#define DECODE_MERGE_ROWS CONSUMERS
#include "decode_common.cuh"

#define Q_BYTES (BLOCK_M * HEAD_DIM * ELEM_BYTES)
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * ELEM_BYTES)
#define STAGE_BYTES (2 * KV_TILE_BYTES)    // K_j, then V_j
#if CONSUMERS * GROUP * HEAD_DIM * 4 > STAGES * STAGE_BYTES
#error "decode_v8: the consumers' merge buffer must fit the ring it reuses"
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
decode_split_v8(const __grid_constant__ TmaMap map_q,    // (d, g, batch * heads_kv): Q as the groups' rows
                const __grid_constant__ TmaMap map_k,    // (d, N, heads_kv, batch), the cache's strides
                const __grid_constant__ TmaMap map_v,
                const int* __restrict__ seq_lens,        // (batch,) int32, or null: every sequence has nk keys
                int nk, int heads_q, int heads_kv, float scale, int num_splits,
                int window_left,                         // keys before n - 1 - window_left unseen; -1: none
                float* __restrict__ O_part, float* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
                int* __restrict__ counters,              // (batch, heads_kv) zeros; FUSED only
                elem_t* __restrict__ O, float* __restrict__ LSE) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ float red_m[CONSUMERS][GROUP];
    __shared__ float red_l[CONSUMERS][GROUP];
    __shared__ __align__(8) u64 bars[2 + 2 * STAGES];   // Q's full, each stage's full and empty, the tail's
    unsigned char* q_s = (unsigned char*)(((size_t)smem_raw + SWIZZLE_ATOM_BYTES - 1)
                                          & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    unsigned char* ring = q_s + Q_BYTES;
    u64* q_full = bars;
    u64* full = bars + 1;
    u64* empty = bars + 1 + STAGES;
    u64* tail_ready = bars + 1 + 2 * STAGES;   // the split's last tile, its rows past n_end zeroed

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int len = seq_lens ? seq_lens[b] : nk;
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;
    const int n_tiles = (n_end - n_begin + BLOCK_N - 1) / BLOCK_N;
    const int tail_rows = n_tiles * BLOCK_N - (n_end - n_begin);   // rows of the last tile past n_end
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);           // the producer's expect_tx arrival + the copy's bytes
            mbar_init(&empty[s], 4);          // one arrival a warp of the tile's consumer
        }
        mbar_init(tail_ready, 1);
        mbar_fence_init();
    }
    __syncthreads();

    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int row_a = 16 * warp + lane / 4;   // a consumer thread's rows of the group: row_a, row_a + 8

    if (threadIdx.x < 32 && n_tiles > 0) {
        // ------------------------------------------------------------ producer warp: its lane 0 asks
        // for Q_g once, then K_j, V_j -> stage j % STAGES as soon as the tile that stage held is consumed
        if (lane == 0) {
            mbar_arrive_expect_tx(q_full, Q_BYTES);
            for (int pnl = 0; pnl < D_PANELS; ++pnl)
                tma_load_3d(q_s + pnl * Q_PANEL_BYTES, &map_q, q_full, pnl * PANEL, 0, b * heads_kv + hk);
            for (int j = 0; j < n_tiles; ++j) {
                const int s = j % STAGES, key0 = n_begin + j * BLOCK_N;
                unsigned char* kt = ring + s * STAGE_BYTES;
                mbar_wait(&empty[s], ((j / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
#pragma unroll
                for (int pnl = 0; pnl < D_PANELS; ++pnl) {
                    tma_load_4d(kt + pnl * KV_PANEL_BYTES, &map_k, &full[s], pnl * PANEL, key0, hk, b);
                    tma_load_4d(kt + KV_TILE_BYTES + pnl * KV_PANEL_BYTES, &map_v, &full[s], pnl * PANEL, key0,
                                hk, b);
                }
            }
        }
        __syncwarp();
        if (tail_rows > 0) {
            // the last tile's V rows past the split's end -> 0 in SRAM, once it has landed (each panel
            // row is 128 bytes, so the swizzle only permutes chunks inside the row); the stores are
            // made visible to the consumer's wgmma (the async proxy), then released on tail_ready
            const int j = n_tiles - 1, s = j % STAGES, valid = BLOCK_N - tail_rows;
            unsigned char* vt = ring + s * STAGE_BYTES + KV_TILE_BYTES;
            mbar_wait(&full[s], (j / STAGES) & 1);
            for (int i = lane; i < tail_rows * D_PANELS * (PANEL_BYTES / 16); i += 32) {
                const int chunk = i % (PANEL_BYTES / 16), rest = i / (PANEL_BYTES / 16);
                const int row = valid + rest % tail_rows, pnl = rest / tail_rows;
                *reinterpret_cast<uint4*>(vt + pnl * KV_PANEL_BYTES + row * PANEL_BYTES + 16 * chunk) =
                    make_uint4(0u, 0u, 0u, 0u);
            }
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(tail_ready);
        }
    } else if (wg > 0 && n_tiles > c) {
        // ------------------------------------------------------------ consumer c: tiles c, c + CONSUMERS, ...
        const float scale_log2 = scale * 1.4426950408889634f;   // scores in log2 units
        mbar_wait(q_full, 0);
        for (int j = c; j < n_tiles; j += CONSUMERS) {
            const int s = j % STAGES;
            const int valid = n_end - (n_begin + j * BLOCK_N);   // keys of the tile the split owns
            const unsigned char* kt = ring + s * STAGE_BYTES;
            const unsigned char* vt = kt + KV_TILE_BYTES;
            mbar_wait(&full[s], (j / STAGES) & 1);             // K_j, V_j in

            // S = Q_g K_j^T (SRAM x SRAM -> registers)
            float sacc[S_REGS];
            wgmma_fence();
            issue_qk(sacc, q_s, Q_PANEL_BYTES, kt);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sacc);

            // scale into log2 units; keys past the split's end -> -inf; the online softmax
            float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int r = i % 4 < 2 ? 0 : 1, col = 8 * (i / 4) + 2 * t + i % 2;
                const float x = col < valid ? sacc[i] * scale_log2 : neg_inf_f();
                sacc[i] = x;
                mx[r] = fmaxf(mx[r], x);
            }
            float alpha[2];
            softmax_update(sacc, st, alpha, mx);
            rescale_o(o, alpha);
            u32 pa[PV_STEPS][4];
            p_fragments(sacc, pa);

            if (valid < BLOCK_N) mbar_wait(tail_ready, 0);      // the producer warp zeroed V_j's rows past n_end

            // O += P V_j (P from registers, V_j from SRAM)
            wgmma_fence();
            issue_pv(o, pa, vt);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&empty[s]);                // stage s is free
        }
    }

    // ---------------------------------------------------------------- merge the consumers
    // each consumer's m and l (summed over the quad) -> SRAM
    float lsum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) lsum[r] = quad_sum(st.l[r]);
    if (wg > 0 && t == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (row_a + 8 * r < GROUP) { red_m[c][row_a + 8 * r] = st.m[r]; red_l[c][row_a + 8 * r] = lsum[r]; }
    }
    __syncthreads();                        // every copy has landed and been read: the ring is free
    float* red_o = reinterpret_cast<float*>(ring);           // [CONSUMERS][GROUP][HEAD_DIM]
    if (wg > 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int gq = row_a + 8 * r;
            if (gq < GROUP) {
                float M = neg_inf_f();
#pragma unroll
                for (int w = 0; w < CONSUMERS; ++w) M = fmaxf(M, red_m[w][gq]);
                const float f = fast_exp2(st.m[r] - (M == neg_inf_f() ? 0.f : M));   // 0 for an idle consumer
                float* dst = red_o + (c * GROUP + gq) * HEAD_DIM + 2 * t;
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 8; ++j) {
                    dst[8 * j] = o[4 * j + 2 * r] * f;
                    dst[8 * j + 1] = o[4 * j + 2 * r + 1] * f;
                }
            }
        }
    }
    __syncthreads();

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
