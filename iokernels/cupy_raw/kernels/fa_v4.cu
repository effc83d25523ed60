// fa_v4.cu -- FlashAttention forward for Hopper, version 4: warp specialization.
//
// What changes from v3, and why:
//   * a producer warpgroup: one of its threads does nothing but issue TMA copies (Q_i once,
//     then K_j and V_j for every stage that is free); the consumer warpgroups only compute.
//     A stage is handed back through an "empty" mbarrier that each consumer warp arrives on once
//     its products have read the tile, so the loads never wait for a block-wide __syncthreads
//     and the producer runs STAGES tiles ahead of the slowest consumer.
//   * K_j and V_j complete on separate barriers (k_full, v_full): S = Q K_j^T starts as soon as
//     K_j is in, while V_j is still arriving.
//   * setmaxnreg: the producer needs a few dozen registers, the consumers need S (64 x Bc), P
//     and O (64 x d) in registers; the producer gives its registers back and the consumers take
//     them, so the consumers' working set fits without spilling.
// Still one after the other inside a consumer: S, softmax, O += P V.  v5 overlaps them.
//
// Block: 1 producer warpgroup + BLOCK_M / 64 consumer warpgroups (64 query rows each).
// Compile-time settings as fa_v3.cu.
#ifndef STAGES
#error "fa_v4.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#define CONSUMERS (BLOCK_M / 64)
#define NTHREADS (128 * (CONSUMERS + 1))
//: registers a thread after setmaxnreg (CONSUMERS * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS
//: must fit the SM's 64K; multiples of 8)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v4(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);
    const int wg = threadIdx.x / 128;        // 0: producer; 1..CONSUMERS: consumers

    if (threadIdx.x == 0) init_specialized_barriers(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: HBM -> SRAM
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && w.n_tiles > 0) produce(sm, w, &map_q, &map_k, &map_v);
    } else {
        // ------------------------------------------------------------ consumers: the math
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
        const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
        float o[O_REGS];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
        RowState st;
        row_state_init(st);
        if (w.n_tiles > 0) mbar_wait(sm.q_full, 0);

        // the key loop: K_j, V_j in SRAM stage s -> S, P, O in registers
        for (int it = 0; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES;
            const u32 parity = (it / STAGES) & 1;

            mbar_wait(&sm.k_full[s], parity);                    // S = Q_i K_j^T
            float sacc[S_REGS];
            wgmma_fence();
            issue_qk(sacc, sm.q + c * 64 * PANEL_BYTES, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sacc);

            float alpha[2];                                       // online softmax in registers
            if (tile_needs_mask(p, j, w.r0, w.r_last)) softmax_step<true>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
            rescale_o(o, alpha);
            u32 pa[PV_STEPS][4];
            p_fragments(sacc, pa);

            mbar_wait(&sm.v_full[s], parity);                    // O += P V_j
            wgmma_fence();
            issue_pv(o, pa, sm.v + s * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[s]);            // stage s may be refilled
        }
        write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);       // write O_i, LSE_i -> HBM
    }
}
