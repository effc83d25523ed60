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
// setmaxnreg's larger consumer budget makes room for.  At HEAD_DIM 256 O alone is 128 of a
// consumer's 240 registers: Bc = 64 and two stages (hopper_attention.cuh, policy.hopper_tiles),
// so a K/V tile is refilled only once it is already needed there (the limit three stages lift at
// d = 128), and the block's work is computed after setmaxnreg (WORK_AFTER_SETMAXNREG).
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).
// Compile-time settings as fa_v3.cu, and PINGPONG (1; 0 keeps only the overlap inside a
// warpgroup, to measure what each of the two adds).  STAGES >= 2: a consumer holds K_j and
// V_{j-1} at once, so only STAGES - 2 further tiles can be on their way while it computes.
#ifndef STAGES
#error "fa_v5.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v5.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if BLOCK_M != 128
#error "fa_v5: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "fa_v5: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
//: named barriers 1 and 2: consumer c may issue its products when barrier SCHED_BAR + c opens
//: (bar 0 is __syncthreads); each opens when both consumer warpgroups (256 threads) reached it
#define SCHED_BAR 1
#define SCHED_THREADS 256
//: at HEAD_DIM 256 a consumer's O (128 float32 registers) and S_j (32 at Bc = 64) reach past the
//: first 168 registers, all a thread has before setmaxnreg (the launch bound, 65536 / 384); a
//: value computed before setmaxnreg and still used after it must stay in those 168, so ptxas
//: spilled two of the block's bounds to the stack.  At that head dim each warpgroup computes the
//: block's work after its setmaxnreg instead (the same values; no stack frame).
#define WORK_AFTER_SETMAXNREG (HEAD_DIM == 256)

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v5(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
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

    if (threadIdx.x == 0) init_specialized_barriers(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: as in v4
        setmaxnreg_dec<PRODUCER_REGS>();
#if WORK_AFTER_SETMAXNREG
        const BlockWork w = block_work(p, heavy_first);
#endif
        if (threadIdx.x == 0 && w.n_tiles > 0) produce(sm, w, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers
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

        // prologue: S_0 = Q K_0^T, softmax -> P_0
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
        p_fragments(sacc, pa);                                    // O is still 0: nothing to rescale

        // the key loop: K_j (stage s) and V_{j-1} (stage sp) in SRAM -> S, P, O in registers
        for (int it = 1; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES, sp = (it - 1) % STAGES;
            mbar_wait(&sm.k_full[s], (it / STAGES) & 1);          // K_j in
            mbar_wait(&sm.v_full[sp], ((it - 1) / STAGES) & 1);   // V_{j-1} in
            // issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back
            sched_begin();
            wgmma_fence();
            issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o, pa, sm.v + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            // softmax(S_j) while P_{j-1} V_{j-1} runs
            wgmma_wait<1>();
            fence_regs(sacc);
            if (tile_needs_mask(p, j, w.r0, w.r_last)) softmax_step<true>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            // then O = alpha (O + P_{j-1} V_{j-1}); stage j-1 is free
            wgmma_wait<0>();
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
