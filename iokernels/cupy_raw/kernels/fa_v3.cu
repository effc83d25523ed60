// fa_v3.cu -- FlashAttention forward for Hopper, version 3: TMA, an mbarrier pipeline and wgmma.
//
// What changes from the Ampere kernel (fa_v2.cu, mma.sync + cp.async), and why:
//   * wgmma instead of mma.sync: a warpgroup (4 warps) issues one asynchronous 64 x Bc x 16
//     product that reads Q and K_j straight from SRAM through descriptors: no ldmatrix, no
//     operand registers for them, and the tensor cores run at Hopper's full rate, which
//     mma.sync cannot reach.  O += P V_j takes P from registers (the S accumulators converted
//     to 16 bits in place) and V_j from SRAM as it lies in HBM (MN-major: no transpose).
//   * TMA instead of cp.async: one thread asks the copy engine for a whole K_j or V_j tile
//     (tensor maps made on the host); the tile arrives 128-byte swizzled, the same swizzle the
//     wgmma descriptors name, so no bank conflicts and no address arithmetic in the kernel.
//     Rows past Nq or Nk arrive as zeros (the mask then hides the keys).
//   * an mbarrier a stage: full[s] completes when all of stage s's bytes have landed; threads
//     wait on its phase parity instead of a block-wide barrier after every copy.  STAGES K/V
//     tiles are in flight ahead of the math.
// What it does not do yet: every warpgroup both loads and computes, and one __syncthreads a
// tile tells the loading thread that a stage may be refilled; softmax and the two products of a
// warpgroup run one after the other.  v4 moves the loads to a producer warpgroup; v5 overlaps
// the softmax with the products.
//
// Grid: (Tr = ceil(Nq / Br), heads_q, batch); block: BLOCK_M / 64 warpgroups, each owning 64
// query rows (hopper_attention.cuh: block_work).
//
// Compile-time settings (-D from hopper.py): HEAD_DIM (64, 128, 256), BLOCK_M (64 per warpgroup),
// BLOCK_N (64, 128; 64 at HEAD_DIM 256), STAGES, IK_DTYPE.
#ifndef STAGES
#error "fa_v3.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#define WARPGROUPS (BLOCK_M / 64)
#define NTHREADS (128 * WARPGROUPS)

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v3(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    u64* kv_full = sm.k_full;                                    // one barrier for K_j and V_j
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);

    const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = w.r0 + 64 * wg + 16 * warp + lane / 4;    // this thread's rows: row_a, row_a + 8

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) mbar_init(&kv_full[s], 1);
        mbar_fence_init();
        // load Q_i -> SRAM (unless no row sees a key), and the first STAGES tiles of K, V -> SRAM
        if (w.n_tiles > 0) {
            mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);
            for (int pnl = 0; pnl < D_PANELS; ++pnl)
                tma_load_3d(sm.q + pnl * Q_PANEL_BYTES, &map_q, sm.q_full, pnl * PANEL, w.r0, w.bh);
        }
        for (int s = 0; s < STAGES && s < w.n_tiles; ++s) {
            mbar_arrive_expect_tx(&kv_full[s], 2 * KV_TILE_BYTES);
            load_kv_tile(sm.k + s * KV_TILE_BYTES, &map_k, &kv_full[s], (w.tiles.begin + s) * BLOCK_N, w.bh_kv);
            load_kv_tile(sm.v + s * KV_TILE_BYTES, &map_v, &kv_full[s], (w.tiles.begin + s) * BLOCK_N, w.bh_kv);
        }
    }
    __syncthreads();                                             // barriers initialised

    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);
    if (w.n_tiles > 0) mbar_wait(sm.q_full, 0);

    // the key loop: tiles j of K_j, V_j, each already on its way to SRAM stage s
    for (int it = 0; it < w.n_tiles; ++it) {
        const int j = w.tiles.begin + it, s = it % STAGES;
        mbar_wait(&kv_full[s], (it / STAGES) & 1);               // K_j, V_j have landed

        // S = Q_i K_j^T on the tensor cores (SRAM operands)
        float sacc[S_REGS];
        wgmma_fence();
        issue_qk(sacc, sm.q + wg * 64 * PANEL_BYTES, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sacc);

        // online softmax in registers; O's rows rescaled by exp2(m_old - m_new)
        float alpha[2];
        if (tile_needs_mask(p, j, w.r0, w.r_last)) softmax_step<true>(sacc, st, alpha, p, row_a, j * BLOCK_N);
        else softmax_step<false>(sacc, st, alpha, p, row_a, j * BLOCK_N);
        rescale_o(o, alpha);
        u32 pa[PV_STEPS][4];
        p_fragments(sacc, pa);

        // O += P V_j (P from registers, V_j from SRAM)
        wgmma_fence();
        issue_pv(o, pa, sm.v + s * KV_TILE_BYTES);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);

        // every warpgroup is done with stage s: refill it with tile j + STAGES
        __syncthreads();
        if (threadIdx.x == 0 && it + STAGES < w.n_tiles) {
            mbar_arrive_expect_tx(&kv_full[s], 2 * KV_TILE_BYTES);
            load_kv_tile(sm.k + s * KV_TILE_BYTES, &map_k, &kv_full[s], (j + STAGES) * BLOCK_N, w.bh_kv);
            load_kv_tile(sm.v + s * KV_TILE_BYTES, &map_v, &kv_full[s], (j + STAGES) * BLOCK_N, w.bh_kv);
        }
    }

    // write O_i, LSE_i -> HBM
    write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);
}
