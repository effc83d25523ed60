// decode_v9.cu -- Flash-Decoding, version 9: every block streams the same number of keys.
//
// What changed against decode_v4.cu (version 4), and why.  Version 4's grid is
// (S, heads_kv, batch): the visible keys of each (b, kv head) pair are dealt to S splits, a
// block a split.  When pairs x S blocks are not close to a whole number of waves, the last
// wave is a few blocks and most SMs wait on them.  At batch 17 with 8 KV heads there are 136
// pairs for 132 SMs: S = 1 leaves 4 blocks a second turn, and no S helps, since 136 x S and
// the SMs' slots share no useful multiple.  Here the grid is G blocks, one wave (the SMs times
// the blocks an SM holds), and the keys of every pair are laid end to end, pair after pair,
// `keys` slots a pair (the longest visible run; a shorter sequence leaves its last slots
// empty).  Block j takes the slots [j W, (j + 1) W), W = ceil(pairs x keys / G): the same count
// for every block, so no block is a tail.  A block's run may end inside one pair and go on
// into the next; it computes a partial (O_s, LSE_s) for each pair it touches (a segment), each
// with v4's key loop, and a pair's segments merge as v4's splits do (fused: the block that
// finishes a pair's last segment, by the pair's counter; else the separate combine).  This is
// Stream-K's idea (Osama, Merrill, Cecka, Garland and Owens, 2023, paper: each thread block an
// equal share of the GEMM's k-loop iterations across tile boundaries, the partial tiles
// fixed up afterwards) put on decode's key axis; CUB's GridEvenShare (code) deals input tiles
// to thread blocks in the same contiguous, even way.  The launcher deals so only where one block
// a pair would leave a last wave (iokernels/cupy_raw/policy.py: decode_balanced_deal); elsewhere
// it launches decode_v4.cu itself, so v9 is v4 there.  A call that names a split count S gets
// v4's splits from this kernel: each pair padded to S runs of W = ceil(keys / S) slots
// (decode_pair_deal), every block's run one split of one pair, as in v4.
//
// A pair p's segments are those of the blocks floor(p keys / W) .. floor(((p + 1) keys - 1) / W);
// segment i is the i-th of them and writes slot i of the pair's partials.  num_splits is the
// most segments of a pair (the launcher's S: the partials' slots a pair).  The
// fused merge takes the pair's own count; without it, the block of a pair's segment 0 marks
// the slots the pair does not use empty (LSE_s = -inf, O_s = 0) for the separate combine,
// which reads all S.  Every segment's keys are v4's split keys: the visible keys [first, len)
// (first = 0, or len - 1 - window_left under a sliding window) from slot first + lo to
// first + hi, a segment past len empty (O_s = 0, LSE_s = -inf).
//
// Unchanged from v4: the tensor-core products (the g query heads as the rows of an mma.sync
// A operand, P kept in registers), each warp's cp.async ring of key tiles, the warps' merge
// through SRAM, a paged segment's block-table entries staged in SRAM when they fit table_cap,
// the acquire-release counter of the fused merge (decode_common.cuh explains it).
//
// Notation (Flash-Decoding, Dao et al., 2023; FlashAttention-2, Dao, 2023):
//   G        the grid: blocks, each W = keys_per_block slots of the pairs laid end to end
//   S        num_splits: the most segments of one pair (the partials' slots a pair)
//   g        GROUP, query heads per KV head: the A operand's rows (at most 16)
//   Bc       TILE_ROWS, key rows of one K_j (and V_j) tile (a multiple of 16)
//   m, l     running max (log2 units) and sum of a query row; O its unnormalised output
//
// Limits: v4's (v4_limits in iokernels/cupy_raw/decode_config.py); the checks below are its.
// Compile-time settings: v4's, every one passed by DecodeConfig.defines.  Dynamic SRAM: v4's
// (decode_v4_smem, with S the slots a pair).
#include "common.cuh"
#include "splits.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "decode_v9.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v9.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode_v9.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode_v9.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode_v9.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v9.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef TILE_ROWS
#error "decode_v9.cu: -DTILE_ROWS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v9.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef FUSED
#error "decode_v9.cu: -DFUSED is missing (DecodeConfig.defines passes it)"
#endif
#ifndef LOAD_L1
#error "decode_v9.cu: -DLOAD_L1 is missing (DecodeConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "decode_v9 is the 16-bit tensor-core decode: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if HEAD_DIM % 16 != 0
#error "decode_v9: HEAD_DIM must be a multiple of 16 (whole mma k-steps; policy: decode_config.v4_limits)"
#endif
#if GROUP < 1 || GROUP > 16
#error "decode_v9: group 1..16 (the rows of one 16-row mma A operand; policy: decode_config.v4_limits)"
#endif
#if TILE_ROWS % 16 != 0
#error "decode_v9: TILE_ROWS must be a multiple of 16 (the k depth of the P V product)"
#endif
#if STAGES < 2
#error "decode_v9: STAGES must be at least 2 (one tile in use, one in flight)"
#endif

#define NTHREADS (32 * NUM_WARPS)
typedef elem_t kv_t;                                  // K/V as stored: 16-bit values
#define VEC 8                                         // 16-bit elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
#define SWIZZLE (CPR % 8 == 0)                        // mma.cuh's XOR swizzle, as v4
#define SROW (SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC)    // SRAM row stride (16-bit)
#define TILE_ELEMS (TILE_ROWS * SROW)                 // 16-bit elements of K (or V) in SRAM a tile
#define STAGE_ELEMS (2 * TILE_ELEMS)                  // K then V
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define NT_S (TILE_ROWS / 8)                          // 8-key n-tiles of S
#define NT_O (HEAD_DIM / 8)                           // 8-column n-tiles of O
#define KT_Q (HEAD_DIM / 16)                          // 16-deep k-steps of Q K^T
#define HI_ROWS (GROUP > 8)                           // rows 8..15 of the A operand hold heads

#include "decode_common.cuh"                          // ld_cg, atom_add_acq_rel

// write a segment's O_s (normalised) and LSE_s -> slot `slot` of its pair's partials (the
// final O, LSE when the pair has one segment and the merge is fused, or every pair has one);
// then, FUSED, the block that finishes the pair's last segment merges its `segs` partials;
// else slot 0's block marks the slots past `segs` empty.  decode_common.cuh's decode_finish
// with a pair's own segment count and slot; where that returns from the kernel, this returns
// to the block's loop over its segments.  `scratch`: SRAM the block no longer needs (at least GROUP x S acc_t).
__device__ __forceinline__ void segment_finish(const acc_t (*red_m)[GROUP], const acc_t (*red_l)[GROUP],
                                               const acc_t* red_o, acc_t* scratch, int slot, int segs,
                                               int num_splits, int b, int hk, int heads_q, int heads_kv,
                                               long long rows, acc_t* __restrict__ O_part,
                                               acc_t* __restrict__ LSE_part, int* __restrict__ counters,
                                               elem_t* __restrict__ O, acc_t* __restrict__ LSE) {
    const long long row = (long long)b * heads_q + hk * GROUP;   // first query head's row
    const long long step = rows * HEAD_DIM;                       // one slot of O_part
#if FUSED
    const bool direct = segs == 1;
#else
    const bool direct = num_splits == 1;
#endif
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {   // write O_s, LSE_s -> HBM
        const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
        acc_t M = neg_inf();
        for (int w = 0; w < NUM_WARPS; ++w) M = ik_max(M, red_m[w][gq]);
        const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
        acc_t L = 0, sum = 0;
        for (int w = 0; w < NUM_WARPS; ++w) {
            L += red_l[w][gq] * ik_exp2(red_m[w][gq] - bs);
            sum += red_o[(w * GROUP + gq) * HEAD_DIM + c];
        }
        const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
        const acc_t lse = L > 0 ? (M + ik_log2(L)) * (acc_t)0.6931471805599453 : neg_inf();
        if (direct) {
            O[(row + gq) * HEAD_DIM + c] = from_acc(sum * inv);
            if (c == 0) LSE[row + gq] = lse;
        } else {
            O_part[slot * step + (row + gq) * HEAD_DIM + c] = sum * inv;
            if (c == 0) LSE_part[(long long)slot * rows + row + gq] = lse;
        }
    }
#if !FUSED
    if (!direct && slot == 0) {                     // the slots this pair does not use: empty
        for (int s = segs; s < num_splits; ++s)
            for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {
                const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
                O_part[s * step + (row + gq) * HEAD_DIM + c] = (acc_t)0;
                if (c == 0) LSE_part[(long long)s * rows + row + gq] = neg_inf();
            }
    }
#else
    __shared__ int is_last;
    __shared__ acc_t lse_out[GROUP];
    if (direct) return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();                                // every thread's partial written ...
    if (threadIdx.x == 0) {                         // ... released with the count, the others' acquired
        const int arrived = atom_add_acq_rel(counters + b * heads_kv + hk, 1);
        is_last = arrived == segs - 1;
    }
    __syncthreads();
    if (!is_last) return;
    if (segs <= COMBINE_REG_SPLITS) {
        // read (LSE_s, O_s) of a column for every segment at once <- L2, merge in registers
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {
            const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
            acc_t x[COMBINE_REG_SPLITS], y[COMBINE_REG_SPLITS];
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) {
                x[s] = s < segs ? ld_cg(LSE_part + (long long)s * rows + row + gq) : neg_inf();
                y[s] = s < segs ? ld_cg(O_part + s * step + (row + gq) * HEAD_DIM + c) : (acc_t)0;
            }
            acc_t M = neg_inf();
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) M = ik_max(M, x[s]);
            const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
            acc_t L = 0, sum = 0;
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) {
                const acc_t w = ik_exp(x[s] - bs);   // exp(-inf) = 0: an empty segment, or s >= segs
                L += w;
                sum += w * y[s];
            }
            O[(row + gq) * HEAD_DIM + c] = from_acc(L > 0 ? sum / L : (acc_t)0);
            if (c == 0) LSE[row + gq] = L > 0 ? M + ik_log(L) : neg_inf();
        }
    } else {
        // weights w_s = exp(LSE_s - LSE) for each head -> SRAM (warp w: heads w, w + NUM_WARPS, ...)
        acc_t* wts = scratch;                                      // [GROUP][segs]
        for (int gq = warp; gq < GROUP; gq += NUM_WARPS) {
            acc_t M = neg_inf();
            for (int s = lane; s < segs; s += 32) {
                const acc_t x = ld_cg(LSE_part + (long long)s * rows + row + gq);
                wts[gq * segs + s] = x;
                M = ik_max(M, x);
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2) M = ik_max(M, shfl_xor(M, off));
            const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
            acc_t L = 0;
            for (int s = lane; s < segs; s += 32) {
                const acc_t w = ik_exp(wts[gq * segs + s] - bs);
                wts[gq * segs + s] = w;
                L += w;
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2) L += shfl_xor(L, off);
            const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
            for (int s = lane; s < segs; s += 32) wts[gq * segs + s] *= inv;
            if (lane == 0) lse_out[gq] = L > 0 ? M + ik_log(L) : neg_inf();
        }
        __syncthreads();
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {   // O = sum_s w_s O_s -> HBM
            const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
            const acc_t* w = wts + gq * segs;
            const acc_t* src = O_part + (row + gq) * HEAD_DIM + c;
            acc_t sum = 0;
#pragma unroll 8
            for (int s = 0; s < segs; ++s) sum += w[s] * ld_cg(src + s * step);
            O[(row + gq) * HEAD_DIM + c] = from_acc(sum);
            if (c == 0) LSE[row + gq] = lse_out[gq];
        }
    }
    if (threadIdx.x == 0) counters[b * heads_kv + hk] = 0;        // ready for the next call
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v9(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const kv_t* __restrict__ K, const kv_t* __restrict__ V,
#if PAGED
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
                int table_cap, int table_offset,                      // SRAM table: entries, byte offset
#else
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
#endif
                int batch, int keys, int keys_per_block,   // the pairs laid end to end: keys slots a pair, W a block
                const int* __restrict__ seq_lens,      // (batch,) int32, or null: every sequence has nk keys
                int nk, int heads_q, int heads_kv, float scale, int num_splits,
                int window_left,                       // keys before n - 1 - window_left unseen; -1: none
                float* __restrict__ O_part, float* __restrict__ LSE_part,   // (S, batch, heads_q[, d])
                int* __restrict__ counters,            // (batch, heads_kv) zeros; FUSED only
                elem_t* __restrict__ O, float* __restrict__ LSE) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float red_m[NUM_WARPS][GROUP];
    __shared__ float red_l[NUM_WARPS][GROUP];

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;             // mma fragment coordinates (rows g, g + 8)
    const long long W = keys_per_block;
    const long long f0 = (long long)blockIdx.x * W;                              // this block's slots
    const long long f1 = min(f0 + W, (long long)batch * heads_kv * keys);        // [f0, f1)
    const long long rows = (long long)batch * heads_q;
    u16* ring = reinterpret_cast<u16*>(smem_raw) + warp * (STAGES * STAGE_ELEMS);
    const float scale_log2 = scale * 1.4426950408889634f;   // scores in log2 units
#if !PAGED && 32 % CPR == 0
    // a lane's SRAM offsets of its chunks in a stage's K: the same in every tile and segment
    constexpr int RPI = 32 / CPR;                    // rows one warp-wide copy covers
    const int r0 = lane / CPR, ch0 = lane % CPR;     // this lane's first row of a tile, its chunk
    u32 soff[CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) soff[i] = 2 * tile_offset<SWIZZLE>(r0 + i * RPI, ch0 * VEC, SROW);
    const u32 ring_addr = smem_addr(ring);
#endif

    for (long long p = f0 / keys; p * keys < f1; ++p) {     // each pair this block's slots touch
        if (p * keys > f0) __syncthreads();         // the last segment's SRAM reads are done
        const int b = (int)(p / heads_kv), hk = (int)(p % heads_kv);
        const long long lo = max(f0, p * keys) - p * keys, hi = min(f1, (p + 1) * keys) - p * keys;
        const long long first_block = p * keys / W;
        const int slot = (int)(blockIdx.x - first_block);
        const int segs = (int)(((p + 1) * keys - 1) / W - first_block + 1);
        const int len = seq_lens ? seq_lens[b] : nk;
        const int first = decode_split_keys(len, window_left, 1, 0).x;   // the visible start (splits.cuh)
        const int n_begin = (int)min((long long)len, first + lo), n_end = (int)min((long long)len, first + hi);

        const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
        const int my_tiles = n_tiles > warp ? (n_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;

        // load Q_g -> registers as A fragments (rows g..15 zero), as v4
        u32 qf[KT_Q][4];
        {
            const u32* q0 = reinterpret_cast<const u32*>(Q + ((long long)b * heads_q + hk * GROUP + g) * HEAD_DIM);
            const u32* q1 = q0 + 8 * HEAD_DIM / 2;
#pragma unroll
            for (int kk = 0; kk < KT_Q; ++kk) {
                const int c = (kk * 16 + 2 * t) / 2;
                qf[kk][0] = g < GROUP ? q0[c] : 0u;
                qf[kk][2] = g < GROUP ? q0[c + 4] : 0u;
                qf[kk][1] = (HI_ROWS && g + 8 < GROUP) ? q1[c] : 0u;
                qf[kk][3] = (HI_ROWS && g + 8 < GROUP) ? q1[c + 4] : 0u;
            }
        }
        float o[NT_O][4];
#pragma unroll
        for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
        float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};

#if PAGED
        // this segment's block-table entries -> SRAM (once), when they fit table_cap
        const int e0 = n_begin / BLOCK_SIZE;
        const int n_entries = n_end > n_begin ? (n_end - 1) / BLOCK_SIZE - e0 + 1 : 0;
        const int* tb = block_table + (long long)b * max_blocks + e0;
        if (n_entries <= table_cap) {
            int* tsm = reinterpret_cast<int*>(smem_raw + table_offset);
            for (int i = threadIdx.x; i < n_entries; i += NTHREADS) tsm[i] = tb[i];
            __syncthreads();
            tb = tsm;
        }
        int blk_next[CPL];                           // entries of the rows of this lane's next tile
        auto load_blocks = [&](int tile) {
            const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int n = start + (lane + 32 * i) / CPR;
                const bool ok = tile < my_tiles && (lane + 32 * i) < TILE_CHUNKS && n < n_end;
                blk_next[i] = ok ? tb[n / BLOCK_SIZE - e0] : 0;
            }
        };
        load_blocks(0);
#else
        const elem_t* Kb = K + b * skb + hk * skh;
        const elem_t* Vb = V + b * svb + hk * svh;
#endif

#if !PAGED && 32 % CPR == 0
        // load K_j, V_j -> SRAM (cp.async ring), v4's contiguous issue: fixed SRAM offsets
        auto issue = [&](int tile) {
            if (tile < my_tiles) {
                const u32 ks = ring_addr + (tile % STAGES) * (2 * STAGE_ELEMS), vs = ks + 2 * TILE_ELEMS;
                const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
                const elem_t* kp = Kb + (long long)(start + r0) * skn + ch0 * VEC;
                const elem_t* vp = Vb + (long long)(start + r0) * svn + ch0 * VEC;
                if (start + TILE_ROWS <= n_end) {
#pragma unroll
                    for (int i = 0; i < CPL; ++i, kp += RPI * skn, vp += RPI * svn) {
                        cp_async16_line_at<LOAD_L1>(ks + soff[i], kp, true);
                        cp_async16_line_at<LOAD_L1>(vs + soff[i], vp, true);
                    }
                } else {                             // the segment's last tile: rows past n_end zero
#pragma unroll
                    for (int i = 0; i < CPL; ++i, kp += RPI * skn, vp += RPI * svn) {
                        const bool ok = start + r0 + i * RPI < n_end;
                        cp_async16_line_at<LOAD_L1>(ks + soff[i], kp, ok);
                        cp_async16_line_at<LOAD_L1>(vs + soff[i], vp, ok);
                    }
                }
            }
            cp_async_commit();
        };
#else
        // load K_j, V_j -> SRAM (cp.async ring), each copy finding its row (pages, other rows)
        auto issue = [&](int tile) {
            if (tile < my_tiles) {
                u16* Ks = ring + (tile % STAGES) * STAGE_ELEMS;
                u16* Vs = Ks + TILE_ELEMS;
                const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
#pragma unroll
                for (int i = 0; i < CPL; ++i) {
                    const int c = lane + 32 * i;
                    if (c < TILE_CHUNKS) {
                        const int r = c / CPR, ch = c % CPR;
                        const int n = start + r;
                        const bool ok = n < n_end;
#if PAGED
                        const long long off = (long long)blk_next[i] * s_blk + (long long)(n % BLOCK_SIZE) * s_row
                                              + hk * s_head + ch * VEC;
                        cp_async16_line<LOAD_L1>(Ks + tile_offset<SWIZZLE>(r, ch * VEC, SROW), K + off, ok);
                        cp_async16_line<LOAD_L1>(Vs + tile_offset<SWIZZLE>(r, ch * VEC, SROW), V + off, ok);
#else
                        cp_async16_line<LOAD_L1>(Ks + tile_offset<SWIZZLE>(r, ch * VEC, SROW), Kb + (long long)n * skn + ch * VEC, ok);
                        cp_async16_line<LOAD_L1>(Vs + tile_offset<SWIZZLE>(r, ch * VEC, SROW), Vb + (long long)n * svn + ch * VEC, ok);
#endif
                    }
                }
#if PAGED
                load_blocks(tile + 1);
#endif
            }
            cp_async_commit();
        };
#endif

#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue(s);

        for (int j = 0; j < my_tiles; ++j) {        // this warp's K_j, V_j tiles of the segment
            issue(j + STAGES - 1);
            cp_async_wait<STAGES - 1>();
            __syncwarp();
            const u16* Kt = ring + (j % STAGES) * STAGE_ELEMS;
            const u16* Vt = Kt + TILE_ELEMS;
            const int start = n_begin + (warp + j * NUM_WARPS) * TILE_ROWS;
            float s[NT_S][4];
            mma_qkt<KT_Q, NT_S, SWIZZLE>(s, qf, Kt, SROW, lane);      // S = Q_g K_j^T
            const bool tail = start + TILE_ROWS > n_end;
#pragma unroll
            for (int n = 0; n < NT_S; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = s[n][e] * scale_log2;
                    s[n][e] = (tail && start + n * 8 + 2 * t + (e & 1) >= n_end) ? neg_inf_f() : x;
                }
#pragma unroll
            for (int r = 0; r < 1 + HI_ROWS; ++r) online_softmax_row<NT_S, NT_O>(s, o, m[r], l[r], r);
            mma_pv<TILE_ROWS / 16, NT_O, HI_ROWS, SWIZZLE>(o, s, Vt, SROW, lane);   // O += P V_j
            __syncwarp();
        }
        cp_async_wait<0>();

        // merge the warps (through SRAM), as v4
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
        const int rows_of[2] = {g, g + 8};
        if (t == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (rows_of[r] < GROUP) { red_m[warp][rows_of[r]] = m[r]; red_l[warp][rows_of[r]] = l[r]; }
        }
        __syncthreads();                            // every warp's ring reads are done, too
        float* red_o = reinterpret_cast<float*>(smem_raw);     // [NUM_WARPS][GROUP][HEAD_DIM]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int gq = rows_of[r];
            if (gq < GROUP) {
                float M = neg_inf_f();
                for (int w = 0; w < NUM_WARPS; ++w) M = fmaxf(M, red_m[w][gq]);
                const float f = ik_exp2(m[r] - ((M == neg_inf_f()) ? 0.f : M));
                float* dst = red_o + (warp * GROUP + gq) * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < NT_O; ++n) {
                    dst[n * 8] = o[n][2 * r] * f;
                    dst[n * 8 + 1] = o[n][2 * r + 1] * f;
                }
            }
        }
        __syncthreads();

        // write O_s, LSE_s -> slot `slot`; FUSED: the pair's last segment merges them all
        segment_finish(red_m, red_l, red_o, red_o, slot, segs, num_splits, b, hk, heads_q, heads_kv, rows,
                       O_part, LSE_part, counters, O, LSE);
    }
}
