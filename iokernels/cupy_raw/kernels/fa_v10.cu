// fa_v10.cu -- FlashAttention forward for Hopper, version 10: v8 with three consumer warpgroups at
// head_dim 64 (a 192-row query tile), taking turns on the tensor cores in a round of three.
//
// What changes from v8, and why: at HEAD_DIM 64 a consumer warpgroup's two products of a tile
// (S = Q K^T and P V, 64 x 128 x 64 each) are half those of d = 128, but its softmax (an exp2 of
// each of S's 64 x 128 elements, at 16 a clock on an SM's special-function units: the CUDA C++
// Programming Guide's throughput table for compute capability 9.0, documentation) costs the same at
// any d.  With v8's two consumers in ping-pong, one warpgroup's softmax has only the other's
// products to hide behind, and at d = 64 those can be the shorter: the tensor cores then wait.
// With three consumers a softmax has two other warpgroups' products to hide behind.  FlashAttention-3
// takes a 192-row query tile at this head dim for 16-bit inputs (hopper/tile_size.h, code) and
// keeps its scheduler barriers between the warpgroups when there are two or more
// (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp, code).  fa_v6.cu tried three consumers on v5's
// pipeline, with one softmax whose mask was a run-time flag, and was slower than v5; v10 puts
// them on v8's (K and V released apart, two compiled copies of the softmax, the masked one
// reading two key bounds a row):
//   * 1 producer + 3 consumer warpgroups (512 threads) own BLOCK_M = 192 query rows, 64 a
//     consumer, so each K/V tile the producer brings into SRAM serves 1.5x the rows of v8's;
//   * the ping-pong becomes v6's round: consumer c issues its products once named barrier
//     SCHED_BAR + c opens, then opens consumer c + 1's (mod 3).  Every turn but a consumer's last
//     hands over; the last consumer opens consumer 0's first turn and skips its own last
//     hand-over, so each barrier sees as many arrivals as waits.  The last turn is always the
//     epilogue's P V, so which hand-over to skip is known where it is compiled: no turn counter;
//   * registers: a block of 512 threads starts with 128 a thread; setmaxnreg gives the producer 24
//     and a consumer thread 160 (128 x 24 + 384 x 160 = 64512 of the SM's 65536).  O (32 float32),
//     S_j (64) and P_{j-1} (32 pairs of 16-bit values, read by the P V product in flight while the
//     softmax runs) take 128 of them.  With both softmax copies in the loop, ptxas spilled a few
//     bytes when the named barriers' numbers were kept in registers across the loop; the
//     consumer's index is read again from %tid.x at each turn (consumer_index), and nothing spills.
// A row's arithmetic is v8's: the same 128-key tiles in the same order, the same operations, so
// v10's outputs are v8's (and v5's) bit for bit (a GPU test asserts it).  Measured against v8
// (benchmarks/results/sweeps, file 2026-12-06_2325_attention_v9_v10_h100.txt): faster where a
// query tile has many key tiles, slower on short causal sequences, where a 192-row tile leaves
// more rows of its last tile empty and the causal blocks differ more in their work.
//
// Block: 1 producer warpgroup + 3 consumer warpgroups (BLOCK_M = 192).  Compile-time settings as
// fa_v8.cu (HEAD_DIM 64 only).  SRAM: v8's layout with a 192-row Q (24 KB; a K or V tile 16 KB).
#ifndef STAGES
#error "fa_v10.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v10.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if HEAD_DIM != 64
#error "fa_v10: three consumer warpgroups fit the registers at HEAD_DIM 64 only"
#endif
#if BLOCK_M != 192
#error "fa_v10: the round takes exactly three consumer warpgroups (BLOCK_M = 192)"
#endif
#if STAGES < 2
#error "fa_v10: K_j and V_{j-1} are used together, so the ring needs at least two stages"
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

// this thread's consumer warpgroup, 0 .. 2, read from %tid.x where it is used (a volatile read the
// compiler does not keep in a register across the key loop)
__device__ __forceinline__ int consumer_index() {
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return (int)(tid / 128) - 1;
}

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
fa_v10(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
      const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
      int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
      int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) init_barriers_kv_apart(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && w.n_tiles > 0) produce_kv_apart(sm, w, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers: v8's, three of them
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
        // the round: consumer c issues products only between sched_begin and sched_end, which
        // hands the turn to consumer c + 1 (mod 3); ``last``: the epilogue's turn, where the last
        // consumer (which opened consumer 0's first turn) does not hand over
        auto sched_begin = [&]() {
            if (PINGPONG) named_bar_sync(SCHED_BAR + consumer_index(), SCHED_THREADS);
        };
        auto sched_end = [&](bool last) {
            if (PINGPONG && !(last && c == CONSUMERS - 1))
                named_bar_arrive(SCHED_BAR + (consumer_index() + 1) % CONSUMERS, SCHED_THREADS);
        };
        if (PINGPONG && c == CONSUMERS - 1) named_bar_arrive(SCHED_BAR + 0, SCHED_THREADS);
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
        sched_end(false);
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
            sched_end(false);
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
        sched_end(true);
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(&sm.empty[sl]);
    }
    write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);           // write O_i, LSE_i -> HBM
}
