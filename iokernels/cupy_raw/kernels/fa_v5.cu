// fa_v5.cu -- FlashAttention forward for Hopper, version 5: ping-pong scheduling and softmax
// overlapped with the products (FlashAttention-3's two overlaps; Shah, Bikshandi, Zhang,
// Thakkar, Ramani and Dao, 2024).
//
// What changes from v4, and why: the exp2 of the softmax runs on the multi-function units,
// which are far slower than the tensor cores; in v4 the tensor cores idle while a warpgroup
// computes its softmax.  Two remedies, both about issue order only (the arithmetic is v4's):
//   * ping-pong between the two consumer warpgroups: a pair of named barriers makes them take
//     turns issuing their products, so the tensor cores run warpgroup A's products while
//     warpgroup B computes its softmax, and the other way round;
//   * inside a warpgroup, a two-stage pipeline across key tiles: the products S_j = Q K_j^T
//     and O += P_{j-1} V_{j-1} are issued together, then the warpgroup waits only for S_j and
//     computes softmax(S_j) while P_{j-1} V_{j-1} is still running; O is rescaled once that
//     product is done (O = alpha_j (O + P_{j-1} V_{j-1}), then + P_j V_j next round: the same sum).
// Registers: S_j (float32) and P_{j-1} (16-bit) are both live while the products run, which
// setmaxnreg's larger consumer budget makes room for.
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).
// Compile-time settings as fa_v3.cu, and PINGPONG (1; 0 keeps only the overlap inside a
// warpgroup, to measure what each of the two adds).  STAGES >= 2: a consumer holds K_j and
// V_{j-1} at once, so only STAGES - 2 further tiles can be on their way while it computes.
#include "hopper_attention.cuh"

#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef STAGES
#define STAGES 2
#endif
#if BLOCK_M != 128
#error "fa_v5: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#ifndef PINGPONG
#define PINGPONG 1
#endif
#if STAGES < 2
#error "fa_v5: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define Q_TILE_BYTES (BLOCK_M * HEAD_DIM * ELEM_BYTES)
#define Q_PANEL_BYTES (BLOCK_M * PANEL_BYTES)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
//: named barriers 1 and 2: consumer c may issue its products when barrier SCHED_BAR + c opens
//: (bar 0 is __syncthreads); each opens when both consumer warpgroups (256 threads) reached it
#define SCHED_BAR 1
#define SCHED_THREADS 256

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v5(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((size_t)smem_raw + SWIZZLE_ATOM_BYTES - 1)
                                           & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    unsigned char* sQ = smem;
    unsigned char* sK = sQ + Q_TILE_BYTES;
    unsigned char* sV = sK + STAGES * KV_TILE_BYTES;
    u64* q_full = (u64*)(sV + STAGES * KV_TILE_BYTES);
    u64* k_full = q_full + 1;
    u64* v_full = k_full + STAGES;
    u64* empty = v_full + STAGES;

    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const int tile_q = heavy_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int bh = b * heads_q + h;
    const int bh_kv = b * heads_kv + h / (heads_q / heads_kv);
    const int r0 = tile_q * BLOCK_M, r_last = min(r0 + BLOCK_M, nq) - 1;
    const TileRange tiles = key_tiles(p, r0, r_last);
    const int n_tiles = tiles.end - tiles.begin;
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&empty[s], 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: as in v4
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && n_tiles > 0) {
            mbar_arrive_expect_tx(q_full, Q_TILE_BYTES);          // load Q_i -> SRAM, once
            for (int pnl = 0; pnl < D_PANELS; ++pnl)
                tma_load_3d(sQ + pnl * Q_PANEL_BYTES, &map_q, q_full, pnl * PANEL, r0, bh);
            for (int it = 0; it < n_tiles; ++it) {                // load K_j, V_j -> SRAM stage s
                const int s = it % STAGES, key0 = (tiles.begin + it) * BLOCK_N;
                mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&k_full[s], KV_TILE_BYTES);
                load_kv_tile(sK + s * KV_TILE_BYTES, &map_k, &k_full[s], key0, bh_kv);
                mbar_arrive_expect_tx(&v_full[s], KV_TILE_BYTES);
                load_kv_tile(sV + s * KV_TILE_BYTES, &map_v, &v_full[s], key0, bh_kv);
            }
        }
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = r0 + 64 * c + 16 * warp + lane / 4;
    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);

    if (n_tiles > 0) {
        // Ping-pong: consumer c issues products only between sched_begin and sched_end, which
        // hand the turn to the other consumer.  Each consumer takes n_tiles + 1 turns; consumer 1
        // opens consumer 0's first turn, and its own last hand-over is skipped (nobody waits).
        int turns_left = n_tiles + 1;
        auto sched_begin = [&]() {
            if (PINGPONG) named_bar_sync(SCHED_BAR + c, SCHED_THREADS);
        };
        auto sched_end = [&]() {
            if (PINGPONG && (--turns_left > 0 || c == 0)) named_bar_arrive(SCHED_BAR + (1 - c), SCHED_THREADS);
        };
        if (PINGPONG && c == 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);
        mbar_wait(q_full, 0);

        // prologue: S_0 = Q K_0^T, softmax -> P_0
        float sacc[S_REGS];
        u32 pa[PV_STEPS][4];
        float alpha[2];
        mbar_wait(&k_full[0], 0);
        sched_begin();
        wgmma_fence();
        issue_qk(sacc, sQ + c * 64 * PANEL_BYTES, Q_PANEL_BYTES, sK);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(sacc);
        if (tile_needs_mask(p, tiles.begin, r0, r_last))
            softmax_step<true>(sacc, st, alpha, p, row_a, tiles.begin * BLOCK_N);
        else softmax_step<false>(sacc, st, alpha, p, row_a, tiles.begin * BLOCK_N);
        p_fragments(sacc, pa);                                    // O is still 0: nothing to rescale

        for (int it = 1; it < n_tiles; ++it) {
            const int j = tiles.begin + it, s = it % STAGES, sp = (it - 1) % STAGES;
            mbar_wait(&k_full[s], (it / STAGES) & 1);             // K_j in
            mbar_wait(&v_full[sp], ((it - 1) / STAGES) & 1);      // V_{j-1} in
            // issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back
            sched_begin();
            wgmma_fence();
            issue_qk(sacc, sQ + c * 64 * PANEL_BYTES, Q_PANEL_BYTES, sK + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o, pa, sV + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            // softmax(S_j) while P_{j-1} V_{j-1} runs
            wgmma_wait<1>();
            fence_regs(sacc);
            if (tile_needs_mask(p, j, r0, r_last)) softmax_step<true>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            // then O = alpha (O + P_{j-1} V_{j-1}); stage j-1 is free
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&empty[sp]);
            rescale_o(o, alpha);
            p_fragments(sacc, pa);
        }

        // epilogue: O += P_last V_last
        const int sl = (n_tiles - 1) % STAGES;
        mbar_wait(&v_full[sl], ((n_tiles - 1) / STAGES) & 1);
        sched_begin();
        wgmma_fence();
        issue_pv(o, pa, sV + sl * KV_TILE_BYTES);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(&empty[sl]);
    }
    write_o_lse(o, st, o_out, lse_out, p, bh, row_a);             // write O_i, LSE_i -> HBM
}
