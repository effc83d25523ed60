// fa_v9.cu -- FlashAttention forward for Hopper, version 9: a persistent kernel.  One block an SM
// stays resident and claims query tiles one after another, so the producer loads the next tile's
// Q and first K/V tiles while the consumers still finish the last one (FlashAttention-3's
// persistent tile schedulers; Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, 2024, and its
// hopper/tile_scheduler.hpp, code).
//
// What changes from v8, and why: in v8 (and every version before it) a block owns one query tile.
// Its first products wait for Q_i and K_0 to arrive from HBM, and its last steps are the final
// P V, O's normalisation and O's stores, while the tensor cores of that SM have nothing queued.
// Where a block visits few key tiles -- short sequences, causal blocks near the top of the
// triangle -- these fixed costs can be a large share of its time.  v9 launches min(tiles, SMs)
// blocks, each a loop over query tiles:
//   * the producer claims the next tile (an atomic counter in HBM, the tiles in v8's grid order:
//     a (batch, head)'s query tiles one after another, the heavy ones first when the mask is
//     causal, so the blocks at work share K and V in L2 and finish together, as the hardware's
//     own block order did) before it needs it, and hands its index to the consumers in SRAM next
//     to Q, behind Q's full barrier;
//   * Q has an empty barrier too: the consumers release Q_i as soon as their last S = Q K^T is
//     in registers, and the producer then loads Q_{i'} of the next tile and its K tiles into the
//     ring while the consumers compute the last P V and write O_i;
//   * the ring's position (stage and phase) runs on across tiles, so the K/V pipeline of v7 never
//     drains between two tiles, and so do the ping-pong turns: consumer 0 starts the next tile's
//     first product while consumer 1 still writes its rows of O;
//   * the last block to run out of tiles sets the counter back to zero, so the next launch (and a
//     CUDA graph's replay) starts from tile 0 with no memset (the launcher gives each stream its
//     own counter).
// The arithmetic of a tile is v8's, unchanged (the same two softmax copies, the same ping-pong
// turns), so v9's outputs are v8's bit for bit (a GPU test asserts it).
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).  Compile-time settings as
// fa_v8.cu.  SRAM: v8's, then Q's empty barrier and the claimed tile's index.
#ifndef STAGES
#error "fa_v9.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#define WIDE_KEY_TILES 1                 // Bc 80 at head_dim 256 too (v8's tile)
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v9.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if BLOCK_M != 128
#error "fa_v9: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "fa_v9: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define SCHED_BAR 1
#define SCHED_THREADS 256
#define NO_TILE (-1)                     // the index the producer hands over when the tiles are gone

// after v8's barriers (q_full, k_full, v_full, the V empties, the K empties): Q's empty barrier,
// then the index of the tile Q holds (HopperConfig.smem_bytes counts both)
__device__ __forceinline__ u64* q_empty_of(const AttnSmem& sm) { return sm.empty + 2 * STAGES; }
__device__ __forceinline__ int* tile_slot_of(const AttnSmem& sm) { return (int*)(sm.empty + 2 * STAGES + 1); }

// What query tile t of the launch computes: v8's grid order, (batch, head) outer, its query tiles
// inner (tile t % tiles_q, or tiles_q - 1 - that when heavy_first), the same fields as block_work
__device__ __forceinline__ BlockWork tile_work(const AttnShape& p, int t, int tiles_q, int heavy_first) {
    const int rank = t % tiles_q, bh = t / tiles_q;
    const int tile_q = heavy_first ? tiles_q - 1 - rank : rank;
    const int h = bh % p.heads_q;
    BlockWork w;
    w.bh = bh;
    w.bh_kv = (bh / p.heads_q) * p.heads_kv + h / (p.heads_q / p.heads_kv);
    w.r0 = tile_q * BLOCK_M;
    w.r_last = min(w.r0 + BLOCK_M, p.nq) - 1;
    w.tiles = key_tiles(p, w.r0, w.r_last);
    w.n_tiles = w.tiles.end - w.tiles.begin;
    return w;
}

// the producer's claim of its next tile: the first gridDim.x tiles go to the blocks in order, the
// rest to whoever asks first
__device__ __forceinline__ int claim_tile(int* claimed) { return gridDim.x + atomicAdd(&claimed[0], 1); }

// a block that has run out of tiles counts itself out; the last one sets the counter back to zero
// for the next launch (every block's last claim is done by then: each fences before counting out)
__device__ __forceinline__ void count_out(int* claimed) {
    __threadfence();
    if (atomicAdd(&claimed[1], 1) == (int)gridDim.x - 1) {
        atomicExch(&claimed[0], 0);
        atomicExch(&claimed[1], 0);
    }
}

// The producer's one thread: for each tile it claims, wait until the consumers are done with the
// last Q, hand over the tile's index, load Q and then K_j and V_{j-1} (v7's order) into the ring,
// whose position g (K/V tiles loaded so far) runs on from tile to tile.
__device__ __forceinline__ void produce_tiles(const AttnSmem& sm, const AttnShape& p, int tiles_q, int total,
                                              int heavy_first, int* claimed, const TmaMap* map_q,
                                              const TmaMap* map_k, const TmaMap* map_v) {
    u64* k_empty = k_empty_of(sm);
    u64* q_empty = q_empty_of(sm);
    int* slot = tile_slot_of(sm);
    int t = blockIdx.x, g = 0;
    for (int round = 0;; ++round) {
        mbar_wait(q_empty, (round & 1) ^ 1);                      // the last tile's Q and index read
        if (t >= total) {
            *slot = NO_TILE;
            mbar_arrive(sm.q_full);
            break;
        }
        *slot = t;
        const BlockWork w = tile_work(p, t, tiles_q, heavy_first);
        if (w.n_tiles > 0) {
            mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);       // load Q_i -> SRAM
            for (int pnl = 0; pnl < D_PANELS; ++pnl)
                tma_load_3d(sm.q + pnl * Q_PANEL_BYTES, map_q, sm.q_full, pnl * PANEL, w.r0, w.bh);
        } else {
            mbar_arrive(sm.q_full);                               // rows that see no key: no Q needed
        }
        t = claim_tile(claimed);                                  // the next tile, asked for early
        for (int it = 0; it <= w.n_tiles && w.n_tiles > 0; ++it) {
            if (it < w.n_tiles) {                                 // K_j -> stage (g + it) % STAGES
                const int n = g + it, s = n % STAGES;
                mbar_wait(&k_empty[s], ((n / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
                load_kv_tile(sm.k + s * KV_TILE_BYTES, map_k, &sm.k_full[s], (w.tiles.begin + it) * BLOCK_N, w.bh_kv);
            }
            if (it > 0) {                                         // V_{j-1} -> stage (g + it - 1) % STAGES
                const int n = g + it - 1, sp = n % STAGES;
                mbar_wait(&sm.empty[sp], ((n / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&sm.v_full[sp], KV_TILE_BYTES);
                load_kv_tile(sm.v + sp * KV_TILE_BYTES, map_v, &sm.v_full[sp], (w.tiles.begin + it - 1) * BLOCK_N,
                             w.bh_kv);
            }
        }
        g += w.n_tiles;
    }
    count_out(claimed);
}

// softmax_step<true> (hopper_tile.cuh) with the mask read from the row bounds: fa_v8.cu's, copied
// forward unchanged
__device__ __forceinline__ void softmax_step_rows(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                                  float scale_log2, const RowBounds& b, int col0) {
    const int t = threadIdx.x % 4;
    float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int r = i % 4 < 2 ? 0 : 1;
        const int col = col0 + 8 * (i / 4) + 2 * t + i % 2;
        float x = s[i] * scale_log2;
        if (col < b.lo[r] || col > b.hi[r]) x = neg_inf_f();
        s[i] = x;
        mx[r] = fmaxf(mx[r], x);
    }
    softmax_update(s, st, alpha, mx);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v9(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first, int batch, int* __restrict__ claimed) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const int tiles_q = (nq + BLOCK_M - 1) / BLOCK_M;
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        init_barriers_kv_apart(sm, 4 * CONSUMERS);
        mbar_init(q_empty_of(sm), 4 * CONSUMERS);
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0)
            produce_tiles(sm, p, tiles_q, tiles_q * heads_q * batch, heavy_first, claimed, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers: v8's tile, in a
    // loop over the tiles the producer hands over
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const unsigned char* q_slab = sm.q + c * 64 * PANEL_BYTES;
    u64* k_empty = k_empty_of(sm);
    u64* q_empty = q_empty_of(sm);
    // v8's ping-pong turns, run on from tile to tile: each turn ends with an arrival for the other
    // warpgroup's next turn, so one consumer starts the next tile while the other still writes O
    auto sched_begin = [&]() {
        if (PINGPONG) named_bar_sync(SCHED_BAR + c, SCHED_THREADS);
    };
    auto sched_end = [&]() {
        if (PINGPONG) named_bar_arrive(SCHED_BAR + (1 - c), SCHED_THREADS);
    };
    if (PINGPONG && c == 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);   // consumer 0 goes first
    int g = 0;                                                    // the ring's position: K/V tiles used so far
    for (int round = 0;; ++round) {
        mbar_wait(sm.q_full, round & 1);
        // the index: read from SRAM by lane 0 alone (the lane whose arrival on Q's empty barrier lets
        // the producer overwrite it), then broadcast to the warp.  The broadcast is also a value the
        // compiler knows is the same in every lane, so the ring's stages, the descriptors and the
        // loop bounds stay in uniform registers (read by every lane, they moved into each thread's
        // registers, and every wgmma's descriptors were copied over first)
        const int t = __shfl_sync(0xffffffffu, lane == 0 ? *tile_slot_of(sm) : 0, 0);
        if (t == NO_TILE) {
            // consumer 1's last turn arrived for a turn of consumer 0 that never comes: take it
            if (PINGPONG && c == 0) named_bar_sync(SCHED_BAR + 0, SCHED_THREADS);
            break;
        }
        const BlockWork w = tile_work(p, t, tiles_q, heavy_first);
        const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
        const RowBounds rb = row_bounds(p, row_a);
        const TileBounds tb = tile_bounds(p, w.r0, w.r_last);
        float o[O_REGS];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
        RowState st;
        row_state_init(st);

        if (w.n_tiles > 0) {
            // prologue: S_0 = Q K_0^T, softmax -> P_0
            const int s0 = g % STAGES;
            float sacc[S_REGS];
            u32 pa[PV_STEPS][4];
            float alpha[2];
            mbar_wait(&sm.k_full[s0], (g / STAGES) & 1);
            sched_begin();
            wgmma_fence();
            issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s0 * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            wgmma_wait<0>();
            fence_regs(sacc);
            if (w.n_tiles == 1 && lane == 0) {                    // the last S is in: Q and K_0 are free
                mbar_arrive(q_empty);
                mbar_arrive(&k_empty[s0]);
            }
            if (tile_needs_mask_b(tb, w.tiles.begin))
                softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, w.tiles.begin * BLOCK_N);
            else softmax_step<false>(sacc, st, alpha, p, row_a, w.tiles.begin * BLOCK_N);
            p_fragments(sacc, pa);

            // the key loop: K_j (ring slot n) and V_{j-1} (slot n - 1) in SRAM -> S, P, O in registers
            for (int it = 1; it < w.n_tiles; ++it) {
                const int j = w.tiles.begin + it, n = g + it, s = n % STAGES, sp = (n - 1) % STAGES;
                if (it == 1 && lane == 0) mbar_arrive(&k_empty[s0]);   // K_0 is free
                mbar_wait(&sm.k_full[s], (n / STAGES) & 1);            // K_j in
                mbar_wait(&sm.v_full[sp], ((n - 1) / STAGES) & 1);     // V_{j-1} in
                sched_begin();
                wgmma_fence();
                issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
                wgmma_commit();
                issue_pv(o, pa, sm.v + sp * KV_TILE_BYTES);
                wgmma_commit();
                sched_end();
                wgmma_wait<1>();                                  // S_j in registers: K_j is free
                fence_regs(sacc);
                if (lane == 0) mbar_arrive(&k_empty[s]);
                if (lane == 0 && it == w.n_tiles - 1) mbar_arrive(q_empty);   // the last S: Q is free
                if (tile_needs_mask_b(tb, j)) softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, j * BLOCK_N);
                else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
                wgmma_wait<0>();                                  // P_{j-1} V_{j-1} done: V_{j-1} is free
                fence_regs(o);
                if (lane == 0) mbar_arrive(&sm.empty[sp]);
                rescale_o(o, alpha);
                p_fragments(sacc, pa);
            }

            // the tile's end: O += P_last V_last
            const int nl = g + w.n_tiles - 1, sl = nl % STAGES;
            mbar_wait(&sm.v_full[sl], (nl / STAGES) & 1);
            sched_begin();
            wgmma_fence();
            issue_pv(o, pa, sm.v + sl * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[sl]);
        } else if (lane == 0) {
            mbar_arrive(q_empty);                                 // no keys: Q (not loaded) and the index are free
        }
        write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);       // write O_i, LSE_i -> HBM
        g += w.n_tiles;
    }
}
