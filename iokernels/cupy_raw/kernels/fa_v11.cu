// fa_v11.cu -- FlashAttention forward for Hopper, version 11: v8's blocks in longest-first order.
//
// fa_v8.cu's kernel (read its header first), with the one change of which block runs which query
// tile: the order bwd_v5.cu gave the backward's blocks.  FlashAttention's Hopper and Blackwell
// kernels schedule causal tiles longest first, the heads taken in sections whose data fits the L2
// cache (SingleTileLPTScheduler in flash_attn/cute/tile_scheduler.py, and the L2 swizzle of
// hopper/tile_scheduler.hpp: code).
//
// What changes from v8, and why:
//   * a block of v8 takes query tile blockIdx.x of the (head, batch) pair (blockIdx.y, blockIdx.z),
//     the heavy tiles first within a pair when the band has an upper edge (heavy_first), and the
//     GPU starts blocks in about that order, x fastest (CUDA does not promise an order; the
//     scheduler above relies on the same behaviour).  Under the causal mask the pair's first tile
//     (its last rows) reads every key tile and its last tile one: the pairs run one after another,
//     so the last pair's longest blocks start near the very end of the grid while the other
//     multiprocessors run out of work.  That tail is up to one longest block's time: at Nq = Nk =
//     8192 and Br = 128 a longest block reads 64 key tiles where the average reads 32.
//   * v11 reads its block's linear index in a different order (lpt_tile): the pairs are
//     taken in groups of lpt_pairs (the launcher's policy, cupy_raw/policy.py forward_lpt_pairs:
//     as many pairs as fill one wave of blocks, and no more than keep their K and V within part of
//     the L2 cache), and inside a group the tile's rank is the slow index: every pair's heaviest
//     tile first, then every pair's next, ... .  So each group runs its longest blocks first and
//     its shortest last, and the grid ends on the last group's shortest blocks.  Grouping keeps
//     what v8's order had: the blocks at work at once read the K and V of a few pairs (consecutive
//     query heads, so with grouped queries a few KV heads), which stay in L2 between them.
//   * without an upper edge every block of a pair is as long as the next, and the order would
//     change nothing but the L2 grouping; the policy then passes lpt_pairs = 1: v8's order exactly.
//   * the grid, the launch and every product are v8's; the kernel takes one more argument
//     (lpt_pairs).  A tile's arithmetic does not depend on which block computes it, so v11's
//     outputs are v8's bit for bit (a GPU test asserts it).
//
// Block: 1 producer warpgroup + 2 consumer warpgroups (BLOCK_M = 128).  Compile-time settings, SRAM,
// registers and tiles: fa_v8.cu's (80-key tiles at head_dim 256).
#ifndef STAGES
#error "fa_v11.cu: -DSTAGES is missing (HopperConfig.defines passes it)"
#endif
#define WIDE_KEY_TILES 1                 // Bc 80 at head_dim 256 too (v8's tile)
#include "hopper_attention.cuh"

#ifndef PINGPONG
#error "fa_v11.cu: -DPINGPONG is missing (HopperConfig.defines passes it)"
#endif
#if BLOCK_M != 128
#error "fa_v11: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "fa_v11: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define SCHED_BAR 1
#define SCHED_THREADS 256
#define WORK_AFTER_SETMAXNREG (HEAD_DIM == 256)

// The block's query tile in longest-first order.  The grid is v8's (Tr, Hq, B); its linear index
// runs over groups of lpt_pairs (b, h) pairs, and inside a group over the tile's rank (slow,
// heaviest first when heavy_first) and the group's pairs (fast).  The last group may hold fewer
// pairs.  Two ints, computed before setmaxnreg (where every thread still has 168 registers);
// block_work_at makes the rest of the block's work from them (at head_dim 256 after setmaxnreg,
// as v8 does: with all of it live across, ptxas spilled).
struct LptTile { int tile_q, pair; };
__device__ __forceinline__ LptTile lpt_tile(int heavy_first, int lpt_pairs, uint3 block) {
    const int tiles = gridDim.x, pairs = gridDim.y * gridDim.z;
    const int linear = block.x + tiles * (block.y + gridDim.y * block.z);
    const int group = linear / (lpt_pairs * tiles), within = linear - group * lpt_pairs * tiles;
    const int first = group * lpt_pairs, in_group = min(lpt_pairs, pairs - first);
    const int rank = within / in_group;
    LptTile t;
    t.pair = first + (within - rank * in_group);
    t.tile_q = heavy_first ? tiles - 1 - rank : rank;
    return t;
}

// the block's index, read again (volatile) where it is used: in v8 the pair's (b, h) comes from
// blockIdx, which ptxas reads again for O's stores after the key loop; in v11 it comes from
// divisions, and at head_dim 256, where a consumer's 240 registers are all taken, keeping it
// across the loop spilled 4 bytes.  The epilogue computes it again from this read.
__device__ __forceinline__ uint3 block_index() {
    uint3 b;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b.x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(b.y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(b.z));
    return b;
}

// the flattened (batch, query head) index O and LSE are written at
__device__ __forceinline__ int pair_bh(const AttnShape& p, LptTile t) {
    return (t.pair / gridDim.y) * p.heads_q + t.pair % gridDim.y;
}

// block_work (hopper_tile.cuh) for the query tile and (b, h) pair lpt_tile chose
__device__ __forceinline__ BlockWork block_work_at(const AttnShape& p, LptTile t) {
    const int h = t.pair % gridDim.y, b = t.pair / gridDim.y;
    BlockWork w;
    w.bh = pair_bh(p, t);
    w.bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
    w.r0 = t.tile_q * BLOCK_M;
    w.r_last = min(w.r0 + BLOCK_M, p.nq) - 1;
    w.tiles = key_tiles(p, w.r0, w.r_last);
    w.n_tiles = w.tiles.end - w.tiles.begin;
    return w;
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
fa_v11(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
       const __grid_constant__ TmaMap map_v, u16* __restrict__ o_out, float* __restrict__ lse_out,
       int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left, int right,
       int heavy_first, int lpt_pairs) {
    extern __shared__ unsigned char smem_raw[];
    const AttnSmem sm = carve_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const LptTile lt = lpt_tile(heavy_first, lpt_pairs, blockIdx);
#if !WORK_AFTER_SETMAXNREG
    const BlockWork w = block_work_at(p, lt);
#endif
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) init_barriers_kv_apart(sm, 4 * CONSUMERS);
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<PRODUCER_REGS>();
#if WORK_AFTER_SETMAXNREG
        const BlockWork w = block_work_at(p, lt);
#endif
        if (threadIdx.x == 0 && w.n_tiles > 0) produce_kv_apart(sm, w, &map_q, &map_k, &map_v);
        return;
    }

    // ---------------------------------------------------------------- consumers: v8's
    setmaxnreg_inc<CONSUMER_REGS>();
#if WORK_AFTER_SETMAXNREG
    const BlockWork w = block_work_at(p, lt);
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
    const int bh = pair_bh(p, lpt_tile(heavy_first, lpt_pairs, block_index()));   // w.bh, computed again
    write_o_lse(o, st, o_out, lse_out, p, bh, row_a);             // write O_i, LSE_i -> HBM
}
