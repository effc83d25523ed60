// decode_v2.cu -- Flash-Decoding, version 2: K/V rows stream through a cp.async ring in SRAM.
//
// What changed against decode.cu (version 1), and why.  Version 1 reads each key row with
// plain 16-byte loads straight into registers, four rows a lane in flight, and does the
// math in between: the rows in flight cost registers, so few blocks fit an SM and too few
// bytes are in flight to keep HBM busy.  Here:
//   * each warp owns a private ring of STAGES tiles in SRAM (a tile: TILE_ROWS rows of K
//     and the same rows of V).  While the warp computes on tile t, the copies of tiles
//     t+1 .. t+STAGES-1 are already in flight with cp.async (sm_80+), which does not hold
//     a register until the data lands: bytes in flight no longer cost registers;
//   * the ring is private to its warp, so the only barriers in the key loop are
//     __syncwarp(): a warp never waits for another warp;
//   * registers hold only q (pre-scaled), the running (m, l, O) of the g heads, and one
//     row's worth of K or V at a time; __launch_bounds__ asks for DECODE_MIN_BLOCKS blocks
//     an SM (128 registers a thread at 4);
//   * paged caches: the block-table entries a lane needs for tile t+1 are loaded while
//     tile t is issued, so a table lookup is never on the path of a copy;
//   * tail rows (past the split's end) are zero-filled by cp.async's src-size form (0
//     bytes read, 16 written) and their scores masked to -inf: no garbage in SRAM can turn
//     0 * P into NaN.
// Unchanged: grid (num_splits, heads_kv, batch), GQA packed (a block reads each K/V row
// once for all g = heads_q / heads_kv query heads), ragged lengths (a sequence of length
// 0 writes O = 0, LSE = -inf), the split / combine contract (partial O normalised, LSE in
// natural log; decode.cu's decode_combine merges them) and the output layout.
// On sm_75 cp_async16 is a plain load + store (common.cuh): the same code, synchronous.
//
// Limits (the launcher uses version 1 for these): a row must be whole 16-byte chunks, at
// most 32 of them (e.g. float64 at d = 128 is 64 chunks), and 16-byte aligned.
//
// Per-warp pipeline (t = this warp's tile counter; one cp.async group per tile):
//   prologue: issue tiles 0 .. STAGES-2
//   loop t:   issue tile t+STAGES-1 into stage (t-1) % STAGES   (freed at the end of t-1)
//             cp.async.wait_group STAGES-1   -> this lane's copies of tile t have landed
//             __syncwarp                     -> ... and every lane's
//             compute tile t from stage t % STAGES
//             __syncwarp                     -> no lane still reads the stage refilled next
//
// Compile-time settings: HEAD_DIM, GROUP (g), IK_DTYPE, PAGED, BLOCK_SIZE (paged),
// NUM_WARPS, STAGES, TILE_ROWS (a multiple of the rows a warp reads side by side),
// DECODE_MIN_BLOCKS.
// Dynamic SRAM (the launcher's decode_v2_smem, cupy_raw/config.py): max(the rings, NUM_WARPS * GROUP * HEAD_DIM
// acc_t for the final merge of the warps, which reuses the rings' space).
#include "common.cuh"
#include "splits.cuh"

#ifndef HEAD_DIM
#error "decode_v2.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v2.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode_v2.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode_v2.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode_v2.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v2.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v2.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#define FUSED 0                                       // the combine is decode.cu's second launch
#include "decode_common.cuh"                         // decode_finish: write O_s, LSE_s
#define VEC (16 / IK_ELEM_BYTES)                      // elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
// lanes per key row: CPR rounded up to a power of two (a row's lanes are an aligned
// group of the warp, so the dot product reduces with xor shuffles inside the group)
#define LANES (CPR <= 1 ? 1 : CPR <= 2 ? 2 : CPR <= 4 ? 4 : CPR <= 8 ? 8 : CPR <= 16 ? 16 : 32)
#define RPW (32 / LANES)                              // rows a warp reads side by side
#define EPL VEC                                       // elements a lane holds of a row

#if STAGES < 2
#error "decode_v2: STAGES must be at least 2 (one tile in use, one in flight)"
#endif
#if (HEAD_DIM % VEC) != 0 || CPR > 32
#error "decode_v2: a row must be whole 16-byte chunks, at most 32 of them (use decode.cu)"
#endif

#ifndef TILE_ROWS
#error "decode_v2.cu: -DTILE_ROWS is missing (DecodeConfig.defines passes it)"
#endif
#if TILE_ROWS % RPW != 0
#error "decode_v2: TILE_ROWS must be a multiple of the rows a warp reads side by side"
#endif
#define STEPS (TILE_ROWS / RPW)                       // row steps a tile takes
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define STAGE_CHUNKS (2 * TILE_CHUNKS)                // K then V

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v2(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const elem_t* __restrict__ K, const elem_t* __restrict__ V,
#if PAGED
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
#else
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
#endif
                const int* __restrict__ seq_lens,      // (batch,) int32, or null: every sequence has nk keys
                int nk, int heads_q, int heads_kv, acc_t scale, int num_splits,
                int window_left,                       // keys before n - 1 - window_left unseen; -1: none
                acc_t* __restrict__ O_part, acc_t* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
                elem_t* __restrict__ O, acc_t* __restrict__ LSE) {        // used when num_splits == 1
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ acc_t red_m[NUM_WARPS][GROUP];
    __shared__ acc_t red_l[NUM_WARPS][GROUP];

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane % LANES;                   // this lane's chunk of a row
    const int slot = lane / LANES;                  // which of the RPW rows side by side
    const bool has_chunk = sub < CPR;               // LANES > CPR: the extra lanes hold zeros
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split; a split past them is empty (LSE_s = -inf)
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;

    // this warp's tiles: tile i of the split covers keys [n_begin + i * TILE_ROWS, ...);
    // warp w takes tiles w, w + NUM_WARPS, ...  (my_tiles is the same for all its lanes)
    const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
    uint4* ring = reinterpret_cast<uint4*>(smem_raw) + warp * (STAGES * STAGE_CHUNKS);

    // the g query rows of this kv head, pre-scaled by scale * log2(e): scores in log2 units
    const acc_t qscale = scale * (acc_t)1.4426950408889634;
    acc_t q[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (has_chunk) u = *reinterpret_cast<const uint4*>(Q + ((long long)b * heads_q + hk * GROUP + gq) * HEAD_DIM + sub * VEC);
#pragma unroll
        for (int e = 0; e < EPL; ++e) q[gq][e] = chunk_elem(u, e) * qscale;
    }
    acc_t m[GROUP], l[GROUP], acc[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        m[gq] = neg_inf(); l[gq] = 0;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[gq][e] = 0;
    }

#if PAGED
    // block-table entries of the rows this lane copies in its next tile (loaded one tile ahead)
    int blk_next[CPL];
    auto load_blocks = [&](int t) {
        const int start = n_begin + (warp + t * NUM_WARPS) * TILE_ROWS;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int n = start + (lane + 32 * i) / CPR;
            const bool ok = t < my_tiles && (lane + 32 * i) < TILE_CHUNKS && n < n_end;
            blk_next[i] = ok ? block_table[(long long)b * max_blocks + n / BLOCK_SIZE] : 0;
        }
    };
    load_blocks(0);
#else
    const elem_t* Kb = K + b * skb + hk * skh;
    const elem_t* Vb = V + b * svb + hk * svh;
#endif

    // load K, V rows of this warp's tile t -> SRAM stage t % STAGES (asynchronous; one group;
    // a tile past the warp's last commits an empty group, so the group count stays uniform)
    auto issue = [&](int t) {
        if (t < my_tiles) {
            uint4* Ks = ring + (t % STAGES) * STAGE_CHUNKS;
            uint4* Vs = Ks + TILE_CHUNKS;
            const int start = n_begin + (warp + t * NUM_WARPS) * TILE_ROWS;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = lane + 32 * i;
                if (c < TILE_CHUNKS) {
                    const int r = c / CPR, ch = c % CPR;
                    const int n = start + r;
                    const bool ok = n < n_end;              // tail rows: zero-filled, nothing read
#if PAGED
                    const long long off = (long long)blk_next[i] * s_blk + (long long)(n % BLOCK_SIZE) * s_row
                                          + hk * s_head + ch * VEC;
                    cp_async16(Ks + c, ok ? K + off : K, ok);
                    cp_async16(Vs + c, ok ? V + off : V, ok);
#else
                    cp_async16(Ks + c, ok ? Kb + (long long)n * skn + ch * VEC : Kb, ok);
                    cp_async16(Vs + c, ok ? Vb + (long long)n * svn + ch * VEC : Vb, ok);
#endif
                }
            }
#if PAGED
            load_blocks(t + 1);                             // table entries for the next tile
#endif
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    for (int t = 0; t < my_tiles; ++t) {            // loop over this warp's K/V tiles
        issue(t + STAGES - 1);                      // its stage was released by the __syncwarp below
        cp_async_wait<STAGES - 1>();                // tile t's copies (this lane's) have landed
        __syncwarp();                               // ... and every lane's are visible
        const uint4* Ks = ring + (t % STAGES) * STAGE_CHUNKS;
        const uint4* Vs = Ks + TILE_CHUNKS;
        const int start = n_begin + (warp + t * NUM_WARPS) * TILE_ROWS;

        // scores of the tile's rows (slot's rows: step * RPW + slot), log2 units, tail masked
        acc_t sc[GROUP][STEPS];
#pragma unroll
        for (int st = 0; st < STEPS; ++st) {
            const int r = st * RPW + slot;
            uint4 u = make_uint4(0u, 0u, 0u, 0u);
            if (has_chunk) u = Ks[r * CPR + sub];   // SRAM -> registers; the warp reads RPW whole rows
            acc_t kf[EPL];
#pragma unroll
            for (int e = 0; e < EPL; ++e) kf[e] = chunk_elem(u, e);
            const bool vis = start + r < n_end;
#pragma unroll
            for (int gq = 0; gq < GROUP; ++gq) {
                acc_t d = 0;
#pragma unroll
                for (int e = 0; e < EPL; ++e) d += q[gq][e] * kf[e];
#pragma unroll
                for (int off = LANES / 2; off > 0; off /= 2) d += shfl_xor(d, off);   // all 32 lanes
                sc[gq][st] = vis ? d : neg_inf();
            }
        }
        // online softmax: one max / rescale a tile per head
        acc_t base[GROUP];
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) {
            acc_t mx = neg_inf();
#pragma unroll
            for (int st = 0; st < STEPS; ++st) mx = ik_max(mx, sc[gq][st]);
            const acc_t m_new = ik_max(m[gq], mx);
            base[gq] = (m_new == neg_inf()) ? (acc_t)0 : m_new;   // all masked so far: exp2(-inf) = 0
            const acc_t alpha = ik_exp2(m[gq] - base[gq]);
            l[gq] *= alpha;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[gq][e] *= alpha;
            m[gq] = m_new;
        }
        // O += P V  (V rows from SRAM, one row a step)
#pragma unroll
        for (int st = 0; st < STEPS; ++st) {
            const int r = st * RPW + slot;
            uint4 u = make_uint4(0u, 0u, 0u, 0u);
            if (has_chunk) u = Vs[r * CPR + sub];
            acc_t vf[EPL];
#pragma unroll
            for (int e = 0; e < EPL; ++e) vf[e] = chunk_elem(u, e);
#pragma unroll
            for (int gq = 0; gq < GROUP; ++gq) {
                const acc_t p = ik_exp2(sc[gq][st] - base[gq]);
                l[gq] += p;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[gq][e] += p * vf[e];
            }
        }
        __syncwarp();                               // every lane is done with stage t % STAGES
    }
    cp_async_wait<0>();                             // only empty groups remain; leave none behind

    // merge the slots of a warp (lanes with the same `sub`), then the warps, through SRAM
#pragma unroll
    for (int off = LANES; off < 32; off *= 2) {
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) {
            const acc_t mo = shfl_xor(m[gq], off), lo = shfl_xor(l[gq], off);
            const acc_t mn = ik_max(m[gq], mo);
            const acc_t bs = (mn == neg_inf()) ? (acc_t)0 : mn;
            const acc_t a = ik_exp2(m[gq] - bs), c = ik_exp2(mo - bs);
            l[gq] = l[gq] * a + lo * c;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[gq][e] = acc[gq][e] * a + shfl_xor(acc[gq][e], off) * c;
            m[gq] = mn;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) { red_m[warp][gq] = m[gq]; red_l[warp][gq] = l[gq]; }
    }
    __syncthreads();                                // every warp is done with its ring, too

    // each warp's O, rescaled to the block's max, -> SRAM (the ring's space, now idle):
    // red_o[warp][gq][c].  All heads at once, so acc[gq] is indexed only by unrolled loops
    // (a run-time head index would move acc to local memory).
    acc_t* red_o = reinterpret_cast<acc_t*>(smem_raw);
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        acc_t M = neg_inf();
        for (int w = 0; w < NUM_WARPS; ++w) M = ik_max(M, red_m[w][gq]);
        const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
        if (has_chunk && lane < LANES) {            // one copy of each chunk (slot 0's lanes)
            const acc_t f = ik_exp2(m[gq] - bs);
#pragma unroll
            for (int e = 0; e < EPL; ++e) red_o[(warp * GROUP + gq) * HEAD_DIM + sub * VEC + e] = acc[gq][e] * f;
        }
    }
    __syncthreads();

    // write this split's O (normalised) and LSE -> HBM (decode_common.cuh: O and LSE when
    // S == 1, else O_s and LSE_s for decode.cu's combine launch)
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, nullptr, O, LSE);
}
