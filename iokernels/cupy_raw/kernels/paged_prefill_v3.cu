// paged_prefill_v3.cu -- prefill on a paged KV cache for Hopper (sm_90a), version 3: fa_v5's
// warp-specialized, ping-pong wgmma forward with its K/V tiles copied by TMA through each
// sequence's block table and the g query heads of a KV head packed into one query tile.
//
// What it adds to paged_prefill_v1.cu (mma.sync, cp.async rows through the table, a thread block
// per query head) and to fa_v5.cu (contiguous K/V, a thread block per query head), and why:
//   * wgmma from SRAM, TMA copies, a producer warpgroup, setmaxnreg, ping-pong and the softmax
//     overlapped with P V: fa_v5's (its tile math from hopper_tile.cuh); that is where the
//     speed of the contiguous Hopper prefill comes from, and v1 has none of it;
//   * paged K/V by TMA: the pools (num_blocks, block_size, Hkv, d) are one 4-D tensor map
//     (d, Hkv, block_size, num_blocks); a box (64 columns, 1 head, BOX_ROWS slots, 1 block) is
//     one cache block (or a Bc-key slice of a block larger than Bc) of one KV head, 64 columns
//     wide.  A K/V tile of Bc keys is Bc / block_size such boxes per 64-column panel, all
//     counted on the stage's one mbarrier (KV_TILE_BYTES expected).  The producer warp issues
//     them, one box of K and one of V per lane (D_PANELS x BOXES <= 32 lanes; TMA takes uniform
//     operands, so the compiler issues the lanes' copies one after another in a short loop),
//     each lane reading its box's block number from the table in HBM before the warp waits for
//     the stage to be free, so the table's latency hides behind the consumers' work.  With the 128-byte swizzle, a box of
//     a multiple of 8 rows lands exactly as those rows of a whole tile (the swizzle atom is 8
//     rows), so the wgmma descriptors are fa_v5's.  FlashAttention-3's hopper/ (code) copies a
//     paged cache by TMA only when its pages suit the tile and otherwise gathers the rows with
//     cp.async, one table entry a row, V rows past the sequence zero-filled; v3 keeps TMA down
//     to blocks of 8 rows by issuing one box per block, at the cost of more copy instructions;
//   * GQA packed (FlashAttention-3's PackGQA idea): the Br = 128 rows of a query tile are
//     128 / g tokens x g query heads, row = token * g + head-in-group.  One TMA box (64 columns,
//     g heads, 128 / g tokens) over q seen as (d, Hq, total_q) lands in exactly that order, so
//     K_j and V_j are read once per KV head and tile instead of g times;
//   * varlen and bottom-right causal per sequence: the chunk of sequence b is packed rows
//     cu_q[b] .. cu_q[b + 1] and the LAST nq of its n cached tokens; chunk token t sees key c iff
//     c < n and (not causal or c <= t + n - nq).  Each row's key limit is computed once from its
//     token; K/V tiles past the tile's last token's limit are never read.
//
// Grid: (Tr = ceil(max_seqlen_q * g / Br) query tiles, Hkv, batch).  Block (x, hk, b) reads its
// chunk's offsets and the sequence's length on the device and exits when the chunk has fewer
// tiles.  Why this grid and not a flattened list of (sequence, tile) pairs: the list needs the
// chunk lengths on the host (a synchronisation, not graph-safe) or a device pass that writes it
// (a second launch); this grid needs only the caller's bound max_seqlen_q, and a block past its
// chunk costs a few instructions.  Causal: the heavy (later) tiles start first.
//
// Rows: a tile row past its chunk's end (the next sequence's tokens, or past total_q: those arrive
// as zeros from TMA) is computed and never written.  A row that sees no key (a chunk longer
// than its sequence) writes O = 0 and LSE = -inf.  Keys past n: blocks past the sequence's last
// one are read at a block index past the pool (TMA fills them with zeros, nothing is read); the
// unwritten slots of the sequence's last, partial block hold whatever the pool holds, which the
// mask's select hides from S, but P V would multiply a zero P by them (0 * NaN = NaN), so the
// producer warp zeroes those V rows in SRAM and hands the tile over on a barrier of its own.
//
// Limits, frankly: block_size must be a multiple of 8 that divides Bc or is a multiple of it
// (8 .. 256 powers of two; the launcher refuses others by name); g a power of two up to 128;
// head_dim 64 and 128; float16 and bfloat16; no sliding window, no quantized cache.  A chunk of
// a few tokens (a decode row) still runs a whole 128-row tile (g rows of it useful when g < 128);
// small blocks cost more, smaller copies (32 boxes a K/V tile pair at block_size 8 and d 128).
//
// Compile-time settings (-D from HopperPagedPrefillConfig.defines): IK_DTYPE, HEAD_DIM,
// BLOCK_M (128), BLOCK_N (Bc), STAGES, PAGE_SIZE (the cache's block_size), PINGPONG.
#ifndef PINGPONG
#error "paged_prefill_v3.cu: -DPINGPONG is missing (HopperPagedPrefillConfig.defines passes it)"
#endif
#include "hopper_paged.cuh"

#if BLOCK_M != 128
#error "paged_prefill_v3: ping-pong takes exactly two consumer warpgroups (BLOCK_M = 128)"
#endif
#if STAGES < 2
#error "paged_prefill_v3: K_j and V_{j-1} are used together, so the ring needs at least two stages"
#endif

#define CONSUMERS 2
#define NTHREADS (128 * (CONSUMERS + 1))
//: registers a thread after setmaxnreg, fa_v5's split (128 * 24 + 256 * 240 fits the SM's 64K):
//: one box a lane keeps the producer's table reads and coordinates within 24
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
//: named barriers 1 and 2: consumer c may issue its products when barrier SCHED_BAR + c opens
//: (bar 0 is __syncthreads); each opens when both consumer warpgroups (256 threads) reached it
#define SCHED_BAR 1
#define SCHED_THREADS 256
//: 16-byte chunks in one 128-byte panel row (the zeroing of V rows past the sequence)
#define ROW_CHUNKS (PANEL_BYTES / 16)

// What this block computes: its sequence's chunk and cache, its first token, the tiles it visits.
struct PagedWork {
    int b, hk;            // sequence, KV head
    int qbeg, nq, n;      // the chunk's first packed row and its rows; the sequence's cached tokens
    int t0, t_last;       // the tile's first and last chunk token (t_last clipped to the chunk)
    int off;              // n - nq: token t sees keys <= t + off (causal)
    int n_tiles;          // K/V tiles [0, n_tiles) some row of the tile can see
    bool zero_tail;       // the last tile holds slots past n of a partial cache block
};

// The producer warp: Q_i -> SRAM once (lane 0), then K_j, V_j -> SRAM stage s, each tile BOXES
// boxes a panel, one box of K and one of V per lane (lane = panel * BOXES + box: at most 2 x 16),
// each lane reading its box's block number through the table; the warp zeroes the tail.
__device__ __forceinline__ void produce_paged(const PagedSmem& sm, const PagedWork& w, const TmaMap* map_q,
                                              const TmaMap* map_k, const TmaMap* map_v,
                                              const int* __restrict__ table, int num_blocks, int group_shift) {
    const int lane = threadIdx.x % 32;
    const bool issues = lane < D_PANELS * BOXES;                   // this lane copies a box of each tile
    const int pnl = lane / BOXES, box = lane % BOXES;
    const int dst = pnl * KV_PANEL_BYTES + box * BOX_ROWS * PANEL_BYTES;   // its box's place in a tile
    if (lane == 0) {
        mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);            // load Q_i -> SRAM, once
        for (int p = 0; p < D_PANELS; ++p)                         // (64 cols, g heads, 128 / g tokens)
            tma_load_3d(sm.q + p * Q_PANEL_BYTES, map_q, sm.q_full, p * PANEL, w.hk << group_shift, w.qbeg + w.t0);
    }
    for (int it = 0; it < w.n_tiles; ++it) {                       // load K_j, V_j -> SRAM stage s
        const int s = it % STAGES, key = it * BLOCK_N + box * BOX_ROWS;
        // the box's block, from the table (HBM), read before the wait so its latency hides;
        // a key past the sequence reads block num_blocks, past the pool: TMA fills zeros
        const int blk = issues && key < w.n ? __ldg(table + key / PAGE_SIZE) : num_blocks;
        mbar_wait(&sm.empty[s], ((it / STAGES) & 1) ^ 1);          // stage s's last tile is consumed
        if (lane == 0) {                                           // the tile's bytes, announced first
            mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
            mbar_arrive_expect_tx(&sm.v_full[s], KV_TILE_BYTES);
        }
        __syncwarp();
        if (issues) {
            const int slot = key % PAGE_SIZE;                      // 0 unless a block holds several tiles
            tma_load_4d(sm.k + s * KV_TILE_BYTES + dst, map_k, &sm.k_full[s], pnl * PANEL, w.hk, slot, blk);
            tma_load_4d(sm.v + s * KV_TILE_BYTES + dst, map_v, &sm.v_full[s], pnl * PANEL, w.hk, slot, blk);
        }
    }
    if (w.zero_tail) {
        // every tile of stage s before the last one has been consumed (the warp waited for that
        // before issuing the last), so the phase pending on v_full[s] is the last tile's
        const int it = w.n_tiles - 1, s = it % STAGES;
        mbar_wait(&sm.v_full[s], (it / STAGES) & 1);
        unsigned char* v = sm.v + s * KV_TILE_BYTES;
        const int r0 = w.n - it * BLOCK_N;                         // the tile's first row past n
        const uint4 zero = {0u, 0u, 0u, 0u};
        for (int idx = lane; idx < (BLOCK_N - r0) * D_PANELS * ROW_CHUNKS; idx += 32) {
            const int row = r0 + idx / (D_PANELS * ROW_CHUNKS), pnl = (idx / ROW_CHUNKS) % D_PANELS;
            // the swizzle only permutes the chunks of a row: zero every chunk of the row
            *reinterpret_cast<uint4*>(v + pnl * KV_PANEL_BYTES + row * PANEL_BYTES + (idx % ROW_CHUNKS) * 16) = zero;
        }
        fence_proxy_async();                                       // ordinary stores -> wgmma's reads
        __syncwarp();
        if (lane == 0) mbar_arrive(sm.v_tail);
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
paged_prefill_v3(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
                 const __grid_constant__ TmaMap map_v, const int* __restrict__ tables,
                 const int* __restrict__ seq_lens, const int* __restrict__ cu_q, u16* __restrict__ o_out,
                 float* __restrict__ lse_out, int max_blocks, int num_blocks, int group_shift,
                 float scale_log2, int causal, long long so_tok, long long so_head, long long sl_head,
                 long long sl_tok) {
    extern __shared__ unsigned char smem_raw[];
    PagedWork w;
    w.hk = blockIdx.y;
    w.b = blockIdx.z;
    w.qbeg = cu_q[w.b];
    w.nq = cu_q[w.b + 1] - w.qbeg;
    w.n = seq_lens[w.b];
    const int tokens = BLOCK_M >> group_shift;                     // chunk tokens a tile holds (128 / g)
    w.t0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * tokens;   // causal: heavy tiles first
    if (w.t0 >= w.nq) return;                                      // the chunk has fewer tiles: the block exits
    w.t_last = min(w.t0 + tokens, w.nq) - 1;
    w.off = w.n - w.nq;
    const int hi = causal ? min(w.n, w.t_last + w.off + 1) : w.n;  // keys [0, hi) some row sees
    w.n_tiles = hi > 0 ? (hi + BLOCK_N - 1) / BLOCK_N : 0;
    w.zero_tail = w.n_tiles > 0 && w.n % PAGE_SIZE != 0 && w.n < w.n_tiles * BLOCK_N;

    const PagedSmem sm = carve_paged_smem(smem_raw);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.k_full[s], 1);
            mbar_init(&sm.v_full[s], 1);
            mbar_init(&sm.empty[s], 4 * CONSUMERS);                // one arrival per consumer warp
        }
        mbar_init(sm.v_tail, 1);
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: HBM -> SRAM
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x < 32 && w.n_tiles > 0)
            produce_paged(sm, w, &map_q, &map_k, &map_v, tables + (long long)w.b * max_blocks, num_blocks,
                          group_shift);
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row_a = 64 * c + 16 * warp + lane / 4;               // this thread's rows of the tile: a, a + 8
    const unsigned char* q_slab = sm.q + c * 64 * PANEL_BYTES;
    int lim[2];                                                    // row r sees keys [0, lim[r])
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int tok = w.t0 + ((row_a + 8 * r) >> group_shift);
        lim[r] = causal ? min(w.n, tok + w.off + 1) : w.n;
    }
    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    RowState st;
    row_state_init(st);
    // does tile j hold a key some row of the tile must not see? (else no mask is applied)
    auto needs_mask = [&](int j) {
        const int c1 = j * BLOCK_N + BLOCK_N - 1;
        return c1 >= w.n || (causal && c1 > w.t0 + w.off);
    };
    // V_j is in SRAM (the last tile, when its tail is zeroed: once the producer warp is done)
    auto wait_v = [&](int it) {
        if (w.zero_tail && it == w.n_tiles - 1) mbar_wait(sm.v_tail, 0);
        else mbar_wait(&sm.v_full[it % STAGES], (it / STAGES) & 1);
    };

    if (w.n_tiles > 0) {
        // Ping-pong, as fa_v5: consumer c issues products only between sched_begin and sched_end
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
        if (needs_mask(0)) softmax_step_limits<true>(sacc, st, alpha, scale_log2, lim, 0);
        else softmax_step_limits<false>(sacc, st, alpha, scale_log2, lim, 0);
        p_fragments(sacc, pa);                                     // O is still 0: nothing to rescale

        // the key loop: K_j (stage s) and V_{j-1} (stage sp) in SRAM -> S, P, O in registers
        for (int j = 1; j < w.n_tiles; ++j) {
            const int s = j % STAGES, sp = (j - 1) % STAGES;
            mbar_wait(&sm.k_full[s], (j / STAGES) & 1);            // K_j in
            wait_v(j - 1);                                         // V_{j-1} in
            sched_begin();                                         // S_j = Q K_j^T and O += P_{j-1} V_{j-1}
            wgmma_fence();
            issue_qk(sacc, q_slab, Q_PANEL_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o, pa, sm.v + sp * KV_TILE_BYTES);
            wgmma_commit();
            sched_end();
            wgmma_wait<1>();                                       // softmax(S_j) while P_{j-1} V_{j-1} runs
            fence_regs(sacc);
            if (needs_mask(j)) softmax_step_limits<true>(sacc, st, alpha, scale_log2, lim, j * BLOCK_N);
            else softmax_step_limits<false>(sacc, st, alpha, scale_log2, lim, j * BLOCK_N);
            wgmma_wait<0>();                                       // then O = alpha (O + P_{j-1} V_{j-1})
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[sp]);             // stage j-1 may be refilled
            rescale_o(o, alpha);
            p_fragments(sacc, pa);
        }

        // epilogue: O += P_last V_last
        const int last = w.n_tiles - 1, sl = last % STAGES;
        wait_v(last);
        sched_begin();
        wgmma_fence();
        issue_pv(o, pa, sm.v + sl * KV_TILE_BYTES);
        wgmma_commit();
        sched_end();
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(&sm.empty[sl]);
    }

    // write O_i -> HBM (packed (total_q, Hq, d), normalised by l) and LSE_i -> HBM (float32):
    // this thread's two rows, if their token is in the chunk
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_a + 8 * r;
        const int tok = w.t0 + (row >> group_shift);
        const int head = (w.hk << group_shift) + (row & ((1 << group_shift) - 1));
        const float l = quad_sum(st.l[r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (tok < w.nq) {
            const long long token = w.qbeg + tok;
            u16* dst = o_out + token * so_tok + head * so_head + 2 * t;
#pragma unroll
            for (int jj = 0; jj < HEAD_DIM / 8; ++jj)
                *(u32*)(dst + 8 * jj) = pack2_cvt_x2(o[4 * jj + 2 * r] * inv, o[4 * jj + 2 * r + 1] * inv);
            if (t == 0) lse_out[head * sl_head + token * sl_tok] = l > 0.f ? (st.m[r] + fast_log2(l)) * LN2 : neg_inf_f();
        }
    }
}
