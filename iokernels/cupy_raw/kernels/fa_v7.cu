// fa_v7.cu -- FlashAttention forward for Hopper, version 7: K and V tiles released apart, so a
// two-stage ring keeps the next tiles on their way (FlashAttention-3 keeps one pipeline for K
// and one for V; Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, 2024, and its hopper/ code).
//
// What changes from v5, and why: in v5 a stage holds K_j and V_j and is released once, when
// the last product that reads it, P_j V_j, is done.  But v5's consumer is done with K_j a whole
// turn earlier: S_j = Q K_j^T is waited for first, and P_j V_j is issued only in the next turn.
// With two stages (all that fits at HEAD_DIM 256: Q is 64 KB and a K + V stage 64 KB) that
// single release means the producer may start K_{j+1} only when P_{j-1} V_{j-1} has finished,
// which is when the consumer already waits for it: every tile's load is exposed.  v7 gives every
// stage two empty barriers, one for its K tile and one for its V tile:
//   * a consumer releases K_j as soon as S_j is in its registers (right after wgmma_wait<1>),
//     and V_{j-1} once P_{j-1} V_{j-1} is (after wgmma_wait<0>), as before;
//   * the producer loads in the order the consumers use the tiles, K_j then V_{j-1}, each as
//     soon as its own stage is free.
// With two stages K_{j+1} now lands while the consumers still compute tile j, and V_j while
// they compute S_{j+1}: one tile ahead, where v5 needed a third stage for that (at HEAD_DIM 64
// and 128 the third stage is kept: the next tiles then arrive earlier still).  The arithmetic,
// the ping-pong and the overlap inside a warpgroup are v5's, unchanged, so v7's outputs are v5's
// bit for bit.  Where the registry's default takes it: policy.hopper_v7_default_at (head_dim 256;
// at 64 and 128 v5's third stage already keeps the tiles landing).
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).  Compile-time settings as
// fa_v5.cu.  SRAM: v5's, and STAGES more mbarriers (the K empties).
#ifndef STAGES
#error "fa_v7.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v7.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if BLOCK_M != 128
#error "fa_v7: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "fa_v7: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define SCHED_BAR 1
#define SCHED_THREADS 256
#define WORK_AFTER_SETMAXNREG (HEAD_DIM == 256)

// The two empty barriers a stage, their initialisation and the producer that loads K_j then V_{j-1}:
// hopper_attention.cuh ("K and V released apart"), shared with fa_v8.cu.

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v7(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
#if !WORK_AFTER_SETMAXNREG
    const BlockWork w = block_work(p, heavy_first);
#endif
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) init_barriers_kv_apart(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<PRODUCER_REGS>();
#if WORK_AFTER_SETMAXNREG
        const BlockWork w = block_work(p, heavy_first);
#endif
        if (threadIdx.x == 0 && w.n_tiles > 0) produce_kv_apart(sm, w, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers: v5's, and K_j
    // released once S_j is in registers
    setmaxnreg_inc<CONSUMER_REGS>();
#if WORK_AFTER_SETMAXNREG
    const BlockWork w = block_work(p, heavy_first);
#endif
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
    const unsigned char* q_slab = sm.q + c * 64 * PANEL_BYTES;
    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);

    if (w.n_tiles > 0) {
        int turns_left = w.n_tiles + 1;
        auto sched_begin = [&]() {
            if (PINGPONG) named_bar_sync(SCHED_BAR + c, SCHED_THREADS);
        };
        auto sched_end = [&]() {
            if (PINGPONG && (--turns_left > 0 || c == 0)) named_bar_arrive(SCHED_BAR + (1 - c), SCHED_THREADS);
        };
        if (PINGPONG && c == 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);
        mbar_wait(sm.q_full, 0);

        // prologue: S_0 = Q K_0^T, softmax -> P_0 (K_0 is released at the top of the first turn of
        // the loop, where the consumer's other arrivals are: released here, ptxas kept 8 bytes
        // on the stack at HEAD_DIM 256.  With one tile no K is loaded after K_0.)
        float sacc[S_REGS];
        u32 pa[PV_STEPS][4];
        float alpha[2];
        mbar_wait(&sm.k_full[0], 0);
        sched_begin();
        wgmma_fence();
        issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(sacc);
        if (tile_needs_mask(p, w.tiles.begin, w.r0, w.r_last))
            softmax_step<true>(sacc, st, alpha, p, row_a, w.tiles.begin * BLOCK_N);
        else softmax_step<false>(sacc, st, alpha, p, row_a, w.tiles.begin * BLOCK_N);
        p_fragments(sacc, pa);

        // the key loop: K_j (stage s) and V_{j-1} (stage sp) in SRAM -> S, P, O in registers
        for (int it = 1; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES, sp = (it - 1) % STAGES;
            if (it == 1 && lane == 0) mbar_arrive(&k_empty_of(sm)[0]);   // K_0 is free
            mbar_wait(&sm.k_full[s], (it / STAGES) & 1);          // K_j in
            mbar_wait(&sm.v_full[sp], ((it - 1) / STAGES) & 1);   // V_{j-1} in
            sched_begin();
            wgmma_fence();
            issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o, pa, sm.v + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            wgmma_wait<1>();                                      // S_j in registers: K_j is free
            fence_regs(sacc);
            if (lane == 0) mbar_arrive(&k_empty_of(sm)[s]);
            if (tile_needs_mask(p, j, w.r0, w.r_last)) softmax_step<true>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            wgmma_wait<0>();                                      // P_{j-1} V_{j-1} done: V_{j-1} is free
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[sp]);
            rescale_o(o, alpha);
            p_fragments(sacc, pa);
        }

        // epilogue: O += P_last V_last
        const int sl = (w.n_tiles - 1) % STAGES;
        mbar_wait(&sm.v_full[sl], ((w.n_tiles - 1) / STAGES) & 1);
        sched_begin();
        wgmma_fence();
        issue_pv(o, pa, sm.v + sl * KV_TILE_BYTES);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(&sm.empty[sl]);
    }
    write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);           // write O_i, LSE_i -> HBM
}
