// fa_fp8_v2.cu -- FlashAttention forward for Hopper with FP8 (e4m3) products, version 2: fa_v5's
// two overlaps (FlashAttention-3's ping-pong and softmax / product pipeline; Shah, Bikshandi,
// Zhang, Thakkar, Ramani and Dao, 2024) brought to the FP8 kernel.
//
// What changes from fa_fp8_v1, and why: FP8 halves the time of both products, but not the
// softmax's exp2, which runs on the multi-function units; in v1 each consumer warpgroup issues
// S = Q K_j^T, waits, computes the softmax, issues P V_j and waits, so the tensor cores idle
// during every softmax and the softmax becomes the larger share of a tile's time.  v2 changes the
// issue order only, as fa_v5.cu does for 16-bit inputs:
//   * ping-pong between the two consumer warpgroups: a pair of named barriers makes them take
//     turns issuing their products, so the tensor cores run warpgroup A's products while
//     warpgroup B computes its softmax, and the other way round;
//   * inside a warpgroup, a two-stage pipeline across key tiles: S_j = Q K_j^T and
//     O += P_{j-1} V_{j-1} are issued together, the warpgroup waits only for S_j and computes
//     softmax(S_j) while P_{j-1} V_{j-1} is still running; O is rescaled once that product is done.
//
// The FP8 bookkeeping of O.  v1 keeps O in units of the current V tile's scale s_V(j): before
// adding P_j V_j (codes of V_j) it multiplies O by alpha_j * s_V(j-1) / s_V(j), so that after
// tile j
//     O_j = alpha_j * (s_V(j-1) / s_V(j)) * O_{j-1} + P_j V_j,   in units of s_V(j).
// In the pipeline, the product issued with S_j is P_{j-1} V_{j-1}, which lands in units of
// s_V(j-1) -- the units O is still in at that point, since nothing has rescaled it since tile
// j-1's own change.  So the change to s_V(j) is applied exactly where alpha_j is: after the wait
// for P_{j-1} V_{j-1} (O is then O_{j-1}, complete, in units of s_V(j-1)) and before P_j V_j is
// issued in the next turn, as one multiply by alpha_j * s_V(j-1) / s_V(j) -- v1's factor, on v1's
// O_{j-1}.  The first tile needs none (O is 0), and after the last product O is in units of
// s_V(last): the epilogue multiplies by s_V(last) / P_SCALE, as v1's does.  Every element sees
// v1's operations in v1's order (only their issue order changes), so the result is v1's up to the
// float32 reordering a compiler may make.
//
// Registers: S_j (64 float32) and P_{j-1} (16 words of e4m3, half of fa_v5's 16-bit P) are live
// with O (64) while the products run: within the consumers' setmaxnreg budget.
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128), as in v1.  Compile-time
// settings as fa_fp8_v1.cu (no QUANT_THREADS: the quantization kernels stay in fa_fp8_v1.cu),
// and PINGPONG (1; 0 keeps only the overlap inside a warpgroup, to measure what each of the two
// adds).  STAGES >= 2: a consumer holds K_j and V_{j-1} at once, so only STAGES - 2 further tiles
// can be on their way while it computes.  Limits otherwise v1's: head_dim 128, Bc = 128, no
// window, no backward.
#ifndef STAGES
#error "fa_fp8_v2.cu: -DSTAGES is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#ifndef HEAD_DIM
#error "fa_fp8_v2.cu: -DHEAD_DIM is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#ifndef BLOCK_M
#error "fa_fp8_v2.cu: -DBLOCK_M is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#ifndef BLOCK_N
#error "fa_fp8_v2.cu: -DBLOCK_N is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#ifndef P_SCALE
#error "fa_fp8_v2.cu: -DP_SCALE is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#ifndef PINGPONG
#error "fa_fp8_v2.cu: -DPINGPONG is missing (fp8_forward.Fp8Config.defines passes it)"
#endif
#if HEAD_DIM != 128
#error "fa_fp8_v2.cu takes HEAD_DIM 128 (a row of codes is one 128-byte swizzle row)"
#endif
#if BLOCK_N != 128 || BLOCK_M != 128
#error "fa_fp8_v2.cu takes BLOCK_M 128 and BLOCK_N 128 (ping-pong: two consumer warpgroups; a V^T row of Bc codes is one 128-byte swizzle row)"
#endif
#if STAGES < 2 || STAGES > 4
#error "fa_fp8_v2.cu takes STAGES 2 .. 4 (K_j and V_{j-1} are used together)"
#endif
#include "hopper_fp8.cuh"

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
//: registers a thread after setmaxnreg (fa_v5's split: the producer needs a few dozen)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
//: named barriers 1 and 2: consumer c may issue its products when barrier SCHED_BAR + c opens
//: (bar 0 is __syncthreads); each opens when both consumer warpgroups (256 threads) reached it
#define SCHED_BAR 1
#define SCHED_THREADS 256
// the tiles in SRAM (v1's layout) and the two products: hopper_fp8.cuh
// the online softmax of S_j with the tile's factor (scale * log2(e) * s_Q * s_K(j)), masked only
// where tile j holds a key some row of the block must not see
__device__ __forceinline__ void softmax_tile(float (&s)[64], RowState& st, float (&alpha)[2], const AttnShape& p,
                                             const BlockWork& w, float factor, int row_a, int j) {
    if (tile_needs_mask(p, j, w.r0, w.r_last))
        softmax_step_scaled<true>(s, st, alpha, p, factor, row_a, j * BLOCK_N);
    else
        softmax_step_scaled<false>(s, st, alpha, p, factor, row_a, j * BLOCK_N);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_fp8_v2(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
          const __grid_constant__ TmaMap map_vt, const float* __restrict__ q_scale,
          const float* __restrict__ k_scale, const float* __restrict__ v_scale, u16* __restrict__ o_out,
          float* __restrict__ lse_out, int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left,
          int right, int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const Fp8Smem sm = carve_fp8_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);
    const int wg = threadIdx.x / 128;          // 0: producer; 1, 2: consumers
    const int tiles_k = (nk + BLOCK_N - 1) / BLOCK_N;   // K / V scales a KV head

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.k_full[s], 1);
            mbar_init(&sm.v_full[s], 1);
            mbar_init(&sm.empty[s], 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: HBM -> SRAM, as in v1
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && w.n_tiles > 0) {
            mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);                   // load Q_i codes, once
            tma_load_3d(sm.q, &map_q, sm.q_full, 0, w.r0, w.bh);
            for (int it = 0; it < w.n_tiles; ++it) {                          // K_j, V_j^T -> stage s
                const int s = it % STAGES, key0 = (w.tiles.begin + it) * BLOCK_N;
                mbar_wait(&sm.empty[s], ((it / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
                tma_load_3d(sm.k + s * KV_TILE_BYTES, &map_k, &sm.k_full[s], 0, key0, w.bh_kv);
                mbar_arrive_expect_tx(&sm.v_full[s], KV_TILE_BYTES);
                tma_load_3d(sm.v + s * KV_TILE_BYTES, &map_vt, &sm.v_full[s], key0, 0, w.bh_kv);
            }
        }
        return;
    }

    // ---------------------------------------------------------------- consumers: the math
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
    const u8* q_slab = sm.q + c * 64 * ROW_BYTES;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);
    float vs_prev = 1.f;                       // O is kept in units of this tile's s_V (see the top)

    if (w.n_tiles > 0) {
        // S's factor without K_j's scale: scale * log2(e) * s_Q(i)
        const float q_factor = scale_log2 * q_scale[(size_t)w.bh * gridDim.x + w.r0 / BLOCK_M];
        const float* ks = k_scale + (size_t)w.bh_kv * tiles_k;
        const float* vs = v_scale + (size_t)w.bh_kv * tiles_k;
        // Ping-pong: consumer c issues products only between sched_begin and sched_end, which
        // hand the turn to the other consumer.  Each consumer takes n_tiles + 1 turns; consumer 1
        // opens consumer 0's first turn, and its own last hand-over is skipped (nobody waits).
        int turns_left = w.n_tiles + 1;
        auto sched_begin = [&]() {
            if (PINGPONG) named_bar_sync(SCHED_BAR + c, SCHED_THREADS);
        };
        auto sched_end = [&]() {
            if (PINGPONG && (--turns_left > 0 || c == 0)) named_bar_arrive(SCHED_BAR + (1 - c), SCHED_THREADS);
        };
        if (PINGPONG && c == 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);
        mbar_wait(sm.q_full, 0);

        // prologue: S_first = Q K_first^T (codes), softmax -> P_first
        float sacc[64];
        u32 pa[4][4];
        float alpha[2];
        mbar_wait(&sm.k_full[0], 0);
        sched_begin();
        wgmma_fence();
        issue_qk_e4m3(sacc, q_slab, sm.k);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(sacc);
        softmax_tile(sacc, st, alpha, p, w, q_factor * ks[w.tiles.begin], row_a, w.tiles.begin);
        vs_prev = vs[w.tiles.begin];           // O is still 0: nothing to rescale, only its units set
        p_fragments_e4m3(sacc, pa);

        // the key loop: K_j (stage s) and V_{j-1}^T (stage sp) in SRAM -> S, P, O in registers
        for (int it = 1; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES, sp = (it - 1) % STAGES;
            const float ks_j = ks[j], vs_j = vs[j];
            mbar_wait(&sm.k_full[s], (it / STAGES) & 1);          // K_j in
            mbar_wait(&sm.v_full[sp], ((it - 1) / STAGES) & 1);   // V_{j-1}^T in
            // issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back (codes)
            sched_begin();
            wgmma_fence();
            issue_qk_e4m3(sacc, q_slab, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv_e4m3(o, pa, sm.v + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            // softmax(S_j) while P_{j-1} V_{j-1} runs
            wgmma_wait<1>();
            fence_regs(sacc);
            softmax_tile(sacc, st, alpha, p, w, q_factor * ks_j, row_a, j);
            // then O = alpha_j (s_V(j-1) / s_V(j)) (O + P_{j-1} V_{j-1}): O_{j-1} complete, in units
            // of s_V(j-1), moved to s_V(j) before P_j V_j is added next turn; stage j-1 is free
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[sp]);
            const float to_tile = vs_prev / vs_j;                 // O: units of s_V(j-1) -> s_V(j)
            vs_prev = vs_j;
#pragma unroll
            for (int i = 0; i < 64; ++i) o[i] *= alpha[i % 4 < 2 ? 0 : 1] * to_tile;
            p_fragments_e4m3(sacc, pa);
        }

        // epilogue: O += P_last V_last (O then in units of s_V(last))
        const int sl = (w.n_tiles - 1) % STAGES;
        mbar_wait(&sm.v_full[sl], ((w.n_tiles - 1) / STAGES) & 1);
        sched_begin();
        wgmma_fence();
        issue_pv_e4m3(o, pa, sm.v + sl * KV_TILE_BYTES);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(&sm.empty[sl]);
    }
    const float o_units = vs_prev / P_SCALE;                      // codes of V and scaled P -> values
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= o_units;
    write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);           // write O_i, LSE_i -> HBM
}
