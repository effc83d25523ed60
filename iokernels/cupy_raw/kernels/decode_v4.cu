// decode_v4.cu -- Flash-Decoding, version 4: the GQA group's products on the tensor cores.
//
// What changed against decode_v3.cu (version 3), and why.  Version 3 computes, for every
// K/V row of a tile, the g dot products q_h . k and the g updates O_h += p_h v on the CUDA
// cores: 2 x g x d float32 FMAs a row, plus the 16-bit -> float32 conversions and the
// shuffle reductions.  At g = 4 and d = 128 that is about 2 FMAs for every byte of K/V a
// block reads, a large share of an SM's float32 issue rate when the cache streams at HBM
// speed: at large batch x length the arithmetic, and not the memory, can set the pace.
// FlashInfer (Ye et al., 2024 and its 2025 paper) can run GQA decode through its tensor-core
// (prefill) kernels (use_tensor_cores, off by default; SGLang turns it on from groups of 4, vLLM
// above 4: their FlashInfer back ends, code): the g query rows of a group make the decode a
// small prefill.  So here
//   * S = scale * Q_g K_j^T and O += P V_j are mma.sync.m16n8k16 products (16-bit in,
//     float32 accumulators): the g query heads of the group are the rows of the A operand,
//     padded to 16 rows.  Rows g..15 are zero and their results ignored: the tensor cores
//     waste (16 - g) / 16 of their work (3/4 at g = 4), and still free the CUDA cores,
//     which only do the online softmax on the accumulator fragments;
//   * K_j's rows (row-major [key][d] in SRAM) are B fragments as they lie (ldmatrix, no
//     transpose); V_j's go through ldmatrix.trans (as fa_v2.cu does).  The 8 rows one
//     ldmatrix reads must fall in 8 different bank groups: rows of whole 128-byte halves
//     (d = 64, 128, 192, 256) are stored unpadded with the XOR swizzle (16-byte chunk c of
//     row r at chunk c ^ (r % 8); mma.cuh's tile_offset), other rows padded to d + 8;
//   * the online softmax works on the accumulators: a row's max and sum are reduced over
//     the 4 lanes of a quad with two shuffles; P is converted to 16-bit A fragments in
//     registers (no SRAM round trip: FlashAttention-2's register reuse).  P is rounded to
//     16 bits before P V, as in FlashAttention-2, while l sums the float32 values.
// Unchanged from v3: each warp owns a stream of key tiles (tiles warp, warp + NUM_WARPS,
// ...) through its own cp.async ring of STAGES tiles with only __syncwarp in the key loop,
// and its own m, l, O; the warps merge through SRAM at the end; the split-KV grid and the
// fused combine (decode_common.cuh: the last block of a group, found by an acquire-release
// counter, merges the partials); a paged split's block-table entries staged in SRAM when
// they fit table_cap; ragged lengths, tail rows zero in SRAM and masked to -inf, a length-0
// sequence gives O = 0 and LSE = -inf; a sliding window splits only the visible keys.
//
// The load path (one): every lane copies 16-byte chunks with cp.async (cp_async16_line,
// common.cuh: the L2::128B prefetch hint, zero stores for rows past the split's end).  Over a
// contiguous cache whose rows are 2^k chunks a warp-wide copy covers whole rows, so a lane's
// SRAM offsets are fixed for the whole loop and only its sources move; pages and other head
// dims find each copy's row.  LOAD_L1 is the copies' cache operator (.ca: 1, through L1;
// .cg: 0), the one setting the defaults of sm_80 and sm_90 differ in (DecodeConfig.v4_load_l1).
// Other load paths (bulk copies, padded rows everywhere) are experiments of the sweeps
// (iokernels/bench/kernels/decode_v4_loads.cu); benchmarks/NOTES.md tells what they measured.
//
// Notation (Flash-Decoding, Dao et al., 2023; FlashAttention-2, Dao, 2023):
//   S        splits of the key axis (num_splits), one thread block per (split, kv head, b)
//   g        GROUP, query heads per KV head: the A operand's rows (at most 16)
//   Bc       TILE_ROWS, key rows of one K_j (and V_j) tile (a multiple of 16)
//   m, l     running max (log2 units) and sum of a query row; O its unnormalised output
//   O_s      split s's normalised partial output; LSE_s its log-sum-exp (natural log)
//
// Limits: their one home is v4_limits in iokernels/cupy_raw/decode_config.py (the registry's
// check and DecodeConfig.defines call it; v3 takes what it refuses).  The #errors below refuse
// only a compile this kernel cannot be: a non-16-bit dtype, head dims that are not whole
// 16-deep k-steps, a group that does not fit one 16-row A operand.  The file still compiles
// for sm_75 (mma16816 is two k8 products there, cp.async a plain copy), float16 only.
//
// Compile-time settings, every one passed by DecodeConfig.defines (none has a default here):
// IK_DTYPE, HEAD_DIM, GROUP, PAGED, BLOCK_SIZE (paged), NUM_WARPS, STAGES, TILE_ROWS,
// DECODE_MIN_BLOCKS, FUSED, LOAD_L1, COMBINE_REG_SPLITS (decode_common.cuh).
// Dynamic SRAM (decode_v4_smem, cupy_raw/decode_config.py): max(rings NUM_WARPS x STAGES x
// 2 x Bc x SROW 16-bit, the warps' merge buffer, the fused combine's weights g x S acc_t),
// then table_cap int32 entries.
#include "common.cuh"
#include "splits.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "decode_v4.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v4.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode_v4.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode_v4.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode_v4.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v4.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef TILE_ROWS
#error "decode_v4.cu: -DTILE_ROWS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v4.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef FUSED
#error "decode_v4.cu: -DFUSED is missing (DecodeConfig.defines passes it)"
#endif
#ifndef LOAD_L1
#error "decode_v4.cu: -DLOAD_L1 is missing (DecodeConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "decode_v4 is the 16-bit tensor-core decode: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if HEAD_DIM % 16 != 0
#error "decode_v4: HEAD_DIM must be a multiple of 16 (whole mma k-steps; policy: decode_config.v4_limits)"
#endif
#if GROUP < 1 || GROUP > 16
#error "decode_v4: group 1..16 (the rows of one 16-row mma A operand; policy: decode_config.v4_limits)"
#endif
#if TILE_ROWS % 16 != 0
#error "decode_v4: TILE_ROWS must be a multiple of 16 (the k depth of the P V product)"
#endif
#if STAGES < 2
#error "decode_v4: STAGES must be at least 2 (one tile in use, one in flight)"
#endif

#define NTHREADS (32 * NUM_WARPS)
typedef elem_t kv_t;                                  // K/V as stored: 16-bit values
#define VEC 8                                         // 16-bit elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
// rows of whole 128-byte halves (d = 64, 128, 192, 256) are stored unpadded with the XOR
// swizzle (mma.cuh, tile_offset), other rows padded
#define SWIZZLE (CPR % 8 == 0)
#define SROW (SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC)    // SRAM row stride (16-bit)
#define TILE_ELEMS (TILE_ROWS * SROW)                 // 16-bit elements of K (or V) in SRAM a tile
#define STAGE_ELEMS (2 * TILE_ELEMS)                  // K then V
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define NT_S (TILE_ROWS / 8)                          // 8-key n-tiles of S
#define NT_O (HEAD_DIM / 8)                           // 8-column n-tiles of O
#define KT_Q (HEAD_DIM / 16)                          // 16-deep k-steps of Q K^T
#define HI_ROWS (GROUP > 8)                           // rows 8..15 of the A operand hold heads

#include "decode_common.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v4(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const kv_t* __restrict__ K, const kv_t* __restrict__ V,
#if PAGED
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
                int table_cap, int table_offset,                      // SRAM table: entries, byte offset
#else
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
#endif
                const int* __restrict__ seq_lens,      // (batch,) int32, or null: every sequence has nk keys
                int nk, int heads_q, int heads_kv, float scale, int num_splits,
                int window_left,                       // keys before n - 1 - window_left unseen; -1: none
                float* __restrict__ O_part, float* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
                int* __restrict__ counters,            // (batch, heads_kv) zeros; FUSED only
                elem_t* __restrict__ O, float* __restrict__ LSE) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float red_m[NUM_WARPS][GROUP];
    __shared__ float red_l[NUM_WARPS][GROUP];

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;             // mma fragment coordinates (rows g, g + 8)
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split (a sliding window hides the ones before first);
    // a split past them is empty (LSE_s = -inf)
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;

    const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
    u16* ring = reinterpret_cast<u16*>(smem_raw) + warp * (STAGES * STAGE_ELEMS);

    // load Q_g -> registers as A fragments (rows g..15 zero), once: row g / g + 8 of the
    // operand is query head hk * GROUP + g / + 8, columns kk * 16 + 2t (+1) and + 8 (+9)
    u32 qf[KT_Q][4];
    {
        const u32* q0 = reinterpret_cast<const u32*>(Q + ((long long)b * heads_q + hk * GROUP + g) * HEAD_DIM);
        const u32* q1 = q0 + 8 * HEAD_DIM / 2;
#pragma unroll
        for (int kk = 0; kk < KT_Q; ++kk) {
            const int c = (kk * 16 + 2 * t) / 2;      // in 32-bit words (two 16-bit values)
            qf[kk][0] = g < GROUP ? q0[c] : 0u;
            qf[kk][2] = g < GROUP ? q0[c + 4] : 0u;
            qf[kk][1] = (HI_ROWS && g + 8 < GROUP) ? q1[c] : 0u;
            qf[kk][3] = (HI_ROWS && g + 8 < GROUP) ? q1[c + 4] : 0u;
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;   // scores in log2 units

    float o[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};

#if PAGED
    // load this split's block-table entries -> SRAM (once), when they fit table_cap
    const int e0 = n_begin / BLOCK_SIZE;
    const int n_entries = n_end > n_begin ? (n_end - 1) / BLOCK_SIZE - e0 + 1 : 0;
    const int* tb = block_table + (long long)b * max_blocks + e0;     // entry i of the split: tb[i]
    if (n_entries <= table_cap) {
        int* tsm = reinterpret_cast<int*>(smem_raw + table_offset);
        for (int i = threadIdx.x; i < n_entries; i += NTHREADS) tsm[i] = tb[i];
        __syncthreads();
        tb = tsm;                                   // a generic pointer: SRAM from here on
    }
    // entries of the rows this lane copies in its next tile (read one tile ahead)
    int blk_next[CPL];
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
    // load K_j, V_j -> SRAM (cp.async ring): this warp's tile `tile` into stage tile % STAGES.
    // A warp-wide copy covers RPI whole rows, so a lane's chunk of a row is the same in every
    // copy and every tile: its SRAM offsets are fixed, its sources step by RPI rows a copy,
    // and only a tile that runs past the split's end checks its rows
    constexpr int RPI = 32 / CPR;                    // rows one warp-wide copy covers
    const int r0 = lane / CPR, ch0 = lane % CPR;     // this lane's first row of a tile, its chunk
    u32 soff[CPL];                                   // byte offsets of its chunks in a stage's K
#pragma unroll
    for (int i = 0; i < CPL; ++i) soff[i] = 2 * tile_offset<SWIZZLE>(r0 + i * RPI, ch0 * VEC, SROW);
    const u32 ring_addr = smem_addr(ring);
    auto issue = [&](int tile) {
        if (tile < my_tiles) {
            const u32 ks = ring_addr + (tile % STAGES) * (2 * STAGE_ELEMS), vs = ks + 2 * TILE_ELEMS;
            const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
            const elem_t* kp = Kb + (long long)(start + r0) * skn + ch0 * VEC;
            const elem_t* vp = Vb + (long long)(start + r0) * svn + ch0 * VEC;
            if (start + TILE_ROWS <= n_end) {        // a whole tile: every copy reads
#pragma unroll
                for (int i = 0; i < CPL; ++i, kp += RPI * skn, vp += RPI * svn) {
                    cp_async16_line_at<LOAD_L1>(ks + soff[i], kp, true);
                    cp_async16_line_at<LOAD_L1>(vs + soff[i], vp, true);
                }
            } else {                                 // the split's last tile: rows past n_end zero
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
    // load K_j, V_j -> SRAM (cp.async ring): this warp's tile `tile` into stage tile % STAGES
    // (pages, or rows whose chunks do not divide a warp: each copy finds its row)
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

    for (int j = 0; j < my_tiles; ++j) {            // loop over this warp's K_j, V_j tiles (SRAM)
        issue(j + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u16* Kt = ring + (j % STAGES) * STAGE_ELEMS;
        const u16* Vt = Kt + TILE_ELEMS;
        const int start = n_begin + (warp + j * NUM_WARPS) * TILE_ROWS;

        // S = Q_g K_j^T on the tensor cores (registers); K_j's rows are the B operand as stored
        float s[NT_S][4];
        mma_qkt<KT_Q, NT_S, SWIZZLE>(s, qf, Kt, SROW, lane);
        // scale (log2 units); keys at or past the split's end (zero rows) -> -inf
        const bool tail = start + TILE_ROWS > n_end;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = s[n][e] * scale_log2;
                s[n][e] = (tail && start + n * 8 + 2 * t + (e & 1) >= n_end) ? neg_inf_f() : x;
            }

        // online softmax on the accumulators: row g is e = 0, 1; row g + 8 (heads 8..15) e = 2, 3
#pragma unroll
        for (int r = 0; r < 1 + HI_ROWS; ++r) online_softmax_row<NT_S, NT_O>(s, o, m[r], l[r], r);

        // O += P V_j on the tensor cores; P's accumulators become A fragments in registers
        mma_pv<TILE_ROWS / 16, NT_O, HI_ROWS, SWIZZLE>(o, s, Vt, SROW, lane);
        __syncwarp();                               // every lane is done with this stage
    }
    cp_async_wait<0>();

    // merge the warps (through SRAM): l over the quad, then each warp's m, l and its O rows
    // rescaled to the block's max -> SRAM (the rings' space, idle now)
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
    __syncthreads();                                // every warp's ring reads are done, too
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

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
