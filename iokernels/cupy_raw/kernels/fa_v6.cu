// fa_v6.cu -- FlashAttention forward for Hopper, version 6: three consumer warpgroups at
// head_dim 64 (a 192-row query tile), taking turns on the tensor cores in a round of three.
//
// What changes from v5, and why: at HEAD_DIM 64 the two products of a tile are half those of
// d = 128, but the softmax of a 64 x 128 S tile (the exp2 of every element) costs the same at any
// d, so v5's block of 128 query rows spends a larger share of its time on softmax and on waiting
// for K/V tiles.  FlashAttention-3 (hopper/tile_size.h) takes a taller query tile there; so does v6:
//   * 1 producer + 3 consumer warpgroups (512 threads) own BLOCK_M = 192 query rows, 64 a
//     consumer, so each K/V tile the producer brings into SRAM serves 1.5x the rows of v5's block
//     (a head's blocks read a third fewer K/V bytes from HBM, before the L2 cache);
//   * v5's ping-pong becomes a round: consumer c issues its products once named barrier
//     SCHED_BAR + c opens, then opens consumer c + 1's (mod 3), so the tensor cores run one
//     warpgroup's products while the two others compute their softmax;
//   * v5's pipeline inside a warpgroup is kept as it is (S_j and P_{j-1} V_{j-1} issued together,
//     softmax(S_j) while P_{j-1} V_{j-1} runs);
//   * one softmax with a run-time mask flag, from row bounds computed once, instead of v5's two
//     compiled copies (masked and not) that test Nk, the window and the diagonal key by key:
//     with both copies in the loop a consumer needed more than its 160 registers (below).
// Registers: a block of 512 threads starts with 65536 / 512 = 128 registers a thread.  setmaxnreg
// moves them: the producer drops to 24 and each consumer thread takes 160 (128 x 24 + 384 x 160 =
// 64512 of the SM's 65536; 168, the next multiple of 8, would need 67584).  A consumer thread
// holds O (32 float32 at d = 64), S_j (64 at Bc = 128) and P_{j-1} (32 16-bit pairs) at once:
// 128 of its 160.
// Bc = 128, not FlashAttention-3's 192 without a mask: S of 192 keys is 96 registers and P 48, so
// O + S + P (176) would not fit in 160 with P in registers (FlashAttention-3 passes P through SRAM
// there), and a 192-wide wgmma is no width of our wrappers (64, 128, 256).  128 is also its causal
// choice.
// SRAM (d = 64, 16-bit): Q 192 x 64 = 24 KB, a K or V tile 128 x 64 = 16 KB, so STAGES = 4 takes
// 24 + 4 x 32 = 152 KB (+ 13 mbarriers + 1 KB alignment slack) of the 227 KB a block may have.  A
// K/V stage is held from the first consumer's S_j to the last consumer's P_j V_j, which the round
// staggers by two turns: three tiles are in use at once, and the fourth is the one landing.
//
// Block: 1 producer warpgroup + 3 consumer warpgroups (BLOCK_M = 192).  Compile-time settings as
// fa_v5.cu (HEAD_DIM 64 only).
#ifndef STAGES
#error "fa_v6.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v6.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if HEAD_DIM != 64
#error "fa_v6: three consumer warpgroups fit the registers at HEAD_DIM 64 only"
#endif
#if BLOCK_M != 192
#error "fa_v6: the round takes exactly three consumer warpgroups (BLOCK_M = 192)"
#endif
#if STAGES < 2
#error "fa_v6: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 3
#define NTHREADS (128 * (CONSUMERS + 1))
//: registers a thread after setmaxnreg: 128 x PRODUCER_REGS + 3 x 128 x CONSUMER_REGS = 64512
//: fits the SM's 65536 (multiples of 8)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 160
//: named barriers 1, 2, 3: consumer c may issue its products when barrier SCHED_BAR + c opens
//: (bar 0 is __syncthreads); each opens when consumer c (waiting) and consumer c - 1 (handing
//: the turn over) have reached it: 256 threads
#define SCHED_BAR 1
#define SCHED_THREADS 256

// The mask of v5 (hopper_tile.cuh: tile_needs_mask, visible) tests each key against Nk, the window and
// the causal diagonal, from the problem's sizes, in a second copy of the softmax (softmax_step<true>);
// with both copies in the key loop a consumer needed more than its 160 registers (ptxas spilled).
// v6 computes, once before the loop, the two bounds of each of a thread's two rows (row r sees key
// c iff lo[r] <= c <= hi[r]: c < Nk, c <= r + Nk - Nq + right, c >= r + Nk - Nq - left, the same
// visibility) and of the block (a tile needs no mask iff cmin <= its first key and its last <=
// cmax), and runs one softmax whose mask is a run-time flag (the bounds: hopper_tile.cuh's
// RowBounds and TileBounds).
// softmax_step (hopper_tile.cuh) with the mask read from the row bounds, applied where ``mask``:
// S scaled into log2 units, the keys a row must not see set to -inf, then softmax_update
__device__ __forceinline__ void softmax_step_rows(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                                  float scale_log2, const RowBounds& b, int col0, bool mask) {
    const int t = threadIdx.x % 4;
    float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int r = i % 4 < 2 ? 0 : 1;
        const int col = col0 + 8 * (i / 4) + 2 * t + i % 2;
        float x = s[i] * scale_log2;
        if (mask && (col < b.lo[r] || col > b.hi[r])) x = neg_inf_f();
        s[i] = x;
        mx[r] = fmaxf(mx[r], x);
    }
    softmax_update(s, st, alpha, mx);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_v6(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) init_specialized_barriers(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: as in v4, v5
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && w.n_tiles > 0) produce(sm, w, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<CONSUMER_REGS>();
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
        // The round: consumer c issues products only between sched_begin and sched_end, which
        // hands the turn to consumer c + 1 (mod 3).  Each consumer takes n_tiles + 1 turns, in
        // the order 0, 1, 2, 0, 1, 2, ...; the last consumer opens consumer 0's first turn, and its
        // own last hand-over is skipped (consumer 0 has no turn left to wait for).
        int turns_left = w.n_tiles + 1;
        const int next = c + 1 == CONSUMERS ? 0 : c + 1;
        auto sched_begin = [&]() {
            if (PINGPONG) named_bar_sync(SCHED_BAR + c, SCHED_THREADS);
        };
        auto sched_end = [&]() {
            if (PINGPONG && (--turns_left > 0 || c != CONSUMERS - 1)) named_bar_arrive(SCHED_BAR + next, SCHED_THREADS);
        };
        if (PINGPONG && c == CONSUMERS - 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);
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
        softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, w.tiles.begin * BLOCK_N,
                          tile_needs_mask_b(tb, w.tiles.begin));
        p_fragments(sacc, pa);                                    // O is still 0: nothing to rescale

        // the key loop: K_j (stage s) and V_{j-1} (stage sp) in SRAM -> S, P, O in registers
        for (int it = 1; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES, sp = (it - 1) % STAGES;
            mbar_wait(&sm.k_full[s], (it / STAGES) & 1);          // K_j in
            mbar_wait(&sm.v_full[sp], ((it - 1) / STAGES) & 1);   // V_{j-1} in
            // issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, in this consumer's turn
            sched_begin();
            wgmma_fence();
            issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o, pa, sm.v + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            // softmax(S_j) while P_{j-1} V_{j-1} runs (and the other two consumers take their turns)
            wgmma_wait<1>();
            fence_regs(sacc);
            softmax_step_rows(sacc, st, alpha, p.scale_log2, rb, j * BLOCK_N, tile_needs_mask_b(tb, j));
            // then O = alpha (O + P_{j-1} V_{j-1}); this consumer is done with stage j-1
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
