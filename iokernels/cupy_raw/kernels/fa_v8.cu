// fa_v8.cu -- FlashAttention forward for Hopper, version 8: a cheaper mask (the masked softmax reads
// two key bounds a row), and at head_dim 256 the tile FlashAttention-3 takes there, 80 keys.
//
// What changes from v7, and why: v5's masked copy of the softmax (hopper_tile.cuh: softmax_step<true>)
// asks visible() of every element of S, which recomputes Nk - Nq and tests Nk, the window and the
// diagonal from the problem's sizes; a tile on the diagonal or at the end of the keys pays that for
// all its Bc x 64 elements, and the copy's registers sit next to S, P and O.  fa_v6.cu computes, once
// before the loop, the first and last key each of a thread's two rows may see (row r sees key c iff
// lo[r] <= c <= hi[r]: the same visibility), and a block's bounds (a tile needs no mask iff every row
// sees all its keys).  v8 keeps v5's two compiled copies -- tiles without a mask run v5's own
// softmax_step<false> -- and gives the masked copy those bounds: two integer compares an element.
//   * The masked tiles are cheaper: causal blocks of a short sequence, where the diagonal is a
//     large share of the work, gain most (the sweep record in benchmarks/results/sweeps, file
//     2026-12-06_1735_attention_v8_h100.txt).
//   * At HEAD_DIM 256 the tile grows from 64 to 80 keys, FlashAttention-3's choice there for 16-bit
//     inputs (hopper/tile_size.h, code): Q 64 KB + 2 stages x (K + V) 2 x 80 KB = 224 KB of SRAM,
//     S 40 and P 20 registers beside O's 128; one m64n80k16 wgmma computes S, P V takes 5 k-steps.
//     Two stages are all that fit, and v7's K/V release keeps them landing.  A tile's fixed cost (a
//     ping-pong turn, two barrier waits, a quad's row max and sum, O's rescale) is then paid for
//     a quarter more keys.  At 64 and 128 v8 keeps v5's 128 keys in three stages (176 at 128,
//     FlashAttention-3's width without a mask, spilled registers here and was not faster overall).
// The arithmetic within a tile is v5's; with 80-key tiles the online softmax rescales at other
// keys, so v8's outputs match v5's by the 2x rule; at its 128-key tiles (head_dim 64, 128) the
// same keys are set to -inf in the same order of operations, so they are v5's bits (a GPU test
// asserts it).
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).  Compile-time settings as
// fa_v5.cu.  SRAM: v7's layout (an empty barrier for K and one for V a stage).
#ifndef STAGES
#error "fa_v8.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#define WIDE_KEY_TILES 1                 // Bc 80 at head_dim 256 too
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v8.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if BLOCK_M != 128
#error "fa_v8: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "fa_v8: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define SCHED_BAR 1
#define SCHED_THREADS 256
#define WORK_AFTER_SETMAXNREG (HEAD_DIM == 256)

// softmax_step<true> (hopper_tile.cuh) with the mask read from the row bounds (hopper_tile.cuh's
// RowBounds, computed once before the loop, as fa_v6.cu does): S scaled into
// log2 units, the keys a row must not see set to -inf, then softmax_update.  Tiles that need no
// mask run softmax_step<false>, v5's own, unchanged.
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
fa_v8(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
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

    // ---------------------------------------------------------------- consumers: v7's, the mask
    // from row bounds
    setmaxnreg_inc<CONSUMER_REGS>();
#if WORK_AFTER_SETMAXNREG
    const BlockWork w = block_work(p, heavy_first);
#endif
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
    const unsigned char* q_slab = sm.q + c * 64 * PANEL_BYTES;
    const RowBounds rb = row_bounds(p, row_a);
    const TileBounds tb = tile_bounds(p, w.r0, w.r_last);
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

        // prologue: S_0 = Q K_0^T, softmax -> P_0 (K_0 is released at the top of the loop's first
        // turn, as in fa_v7.cu; with one tile no K is loaded after K_0)
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
        if (tile_needs_mask_b(tb, w.tiles.begin))
            softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, w.tiles.begin * BLOCK_N);
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
            if (tile_needs_mask_b(tb, j)) softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, j * BLOCK_N);
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
