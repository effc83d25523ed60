// decode_v5.cu -- Flash-Decoding, version 5: version 4 with the cache read as 1-byte codes.
//
// What changed against decode_v4.cu (version 4), and why.  A quantized paged cache
// (iokernels.paged, kv_dtype "int8" or "float8_e4m3fn"; KV_QUANT = 1 or 2, common.cuh)
// holds each K/V value as a 1-byte code c and a float32 power-of-two scale s per (block,
// KV head) or per block: the value is c * s.  Version 3 decodes each code to float32 in
// registers (several integer and float instructions a code) and multiplies it on the CUDA
// cores; at 1 byte a code that is about twice the instructions a byte of the 16-bit cache,
// so the 1-byte caches are bound by instruction issue, and halving the bytes does not halve
// the time.  Here, as in version 4, the products run on the tensor cores, and the codes
// become their float16 operands (mma_codes.cuh):
//   * the cp.async ring copies the 1-byte rows as they are stored (unpadded rows, 16-byte
//     chunks placed by swz_chunk; a 16-bit row's bytes carry twice the keys), and each row's
//     two float32 scales ride along into the stage (cp.async, 4 bytes each);
//   * about two integer instructions a code turn 4 codes into two float16x2 operands (one
//     PRMT and a few bit operations; no conversion instruction, so every architecture runs
//     the same code);
//   * the scales are per key, so they multiply after the products, never per element: s_K
//     scales S's columns (with scale_log2, one multiply an accumulator), s_V scales P's
//     columns before P is rounded to float16, relative to the largest s_V seen (O is kept in
//     those units, sigma; mma_codes.cuh states the rounding);
//   * the products are float16 x float16 for either compute dtype: a bfloat16 query is moved
//     to float16 with a power-of-two row scale, undone on S (exact down to 2^-28 of the row's
//     largest element), because bfloat16 has no exact equivalent of the codes' bit tricks;
//   * P V contracts over keys, which the 1-byte V rows hold across rows, not along them:
//     instead of ldmatrix.trans (16-bit only) a lane reads 4 key rows and transposes their
//     codes in registers with PRMT.
// Unchanged from v4: the warps' rings, the online softmax on the accumulators, the warps'
// merge, the split-KV grid and the fused combine (decode_common.cuh), the staged block table.
// A quantized cache is paged (its scales belong to the pool's blocks): there is no
// contiguous path.
//
// Notation: as decode_v4.cu; s_K, s_V a row's scales; sigma O's unit (the largest s_V seen).
//
// Limits: their one home is iokernels/cupy_raw/decode_config.py (v4_limits, which v5 shares,
// and the head dims 64, 128 or 256 of DECODE_V5_HEAD_DIMS: the swizzle of the unpadded 1-byte
// rows); the registry's check and DecodeConfig.defines call them, and v3 takes what they
// refuse.  The #errors below (and mma_codes.cuh's) refuse only a compile this kernel cannot be.
//
// Compile-time settings, every one passed by DecodeConfig.defines (none has a default here):
// IK_DTYPE (the queries' and outputs' dtype), KV_QUANT, HEAD_DIM, GROUP, PAGED (1),
// BLOCK_SIZE, NUM_WARPS, STAGES, TILE_ROWS, DECODE_MIN_BLOCKS, FUSED, LOAD_L1,
// COMBINE_REG_SPLITS (decode_common.cuh).
// Dynamic SRAM (decode_v5_smem, cupy_raw/decode_config.py): max(rings NUM_WARPS x STAGES x
// (2 x Bc x HEAD_DIM bytes + 2 x Bc float32 scales), the warps' merge buffer, the fused
// combine's weights g x S acc_t), then table_cap int32 entries.
#include "common.cuh"
#include "splits.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "decode_v5.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v5.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode_v5.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#ifndef BLOCK_SIZE
#error "decode_v5.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it)"
#endif
#ifndef NUM_WARPS
#error "decode_v5.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v5.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef TILE_ROWS
#error "decode_v5.cu: -DTILE_ROWS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v5.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef FUSED
#error "decode_v5.cu: -DFUSED is missing (DecodeConfig.defines passes it)"
#endif
#ifndef LOAD_L1
#error "decode_v5.cu: -DLOAD_L1 is missing (DecodeConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "decode_v5 is the 16-bit tensor-core decode: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if GROUP < 1 || GROUP > 16
#error "decode_v5: group 1..16 (the rows of one 16-row mma A operand; policy: decode_config.v4_limits)"
#endif
#if TILE_ROWS % 16 != 0
#error "decode_v5: TILE_ROWS must be a multiple of 16 (the k depth of the P V product)"
#endif
#if STAGES < 2
#error "decode_v5: STAGES must be at least 2 (one tile in use, one in flight)"
#endif
#if KV_QUANT != IK_KV_INT8 && KV_QUANT != IK_KV_FP8E4M3
#error "decode_v5: -DKV_QUANT must be 1 (int8) or 2 (float8 e4m3): the cache's code format"
#endif
#if !PAGED
#error "decode_v5: a quantized cache is paged (its scales belong to the pool's blocks)"
#endif

#define NTHREADS (32 * NUM_WARPS)
typedef unsigned char kv_t;                           // K/V as stored: 1-byte codes
#define VEC 16                                        // codes in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
#define TILE_BYTES (TILE_ROWS * HEAD_DIM)             // codes of K (or V) a tile: unpadded rows, swizzled chunks
#define STAGE_BYTES (2 * TILE_BYTES + 2 * TILE_ROWS * 4)   // K, V, then the rows' s_K and s_V
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define NT_S (TILE_ROWS / 8)                          // 8-key n-tiles of S
#define NT_O (HEAD_DIM / 8)                           // 8-column n-tiles of O
#define KT_Q (HEAD_DIM / 16)                          // 16-deep k-steps of Q K^T
#define HI_ROWS (GROUP > 8)                           // rows 8..15 of the A operand hold heads

#include "decode_common.cuh"
#include "mma_codes.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v5(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const kv_t* __restrict__ K, const kv_t* __restrict__ V,
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
                int table_cap, int table_offset,                      // SRAM table: entries, byte offset
                const float* __restrict__ K_scale, const float* __restrict__ V_scale,
                int scale_blk, int scale_head,                        // scale of block blk, head h:
                                                                      // [blk * scale_blk + h * scale_head]
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
    unsigned char* ring = smem_raw + warp * (STAGES * STAGE_BYTES);
    // load Q_g -> registers as A fragments in float16, d permuted as K's codes are read
    // (mma_codes.cuh), once; S's rows are multiplied by kl2 (scale_log2, the codes' fold and
    // a bfloat16 row's power-of-two scale)
    u32 qf[KT_Q][4];
    float kl2[2];
    load_q_codes_layout<KT_Q, HI_ROWS>(qf, kl2, Q + ((long long)b * heads_q + hk * GROUP) * HEAD_DIM, GROUP, lane);
    kl2[0] *= scale * 1.4426950408889634f * CODE_FOLD;
    kl2[1] *= scale * 1.4426950408889634f * CODE_FOLD;
    float sigma = 0.f;                              // O's unit: the largest s_V (times CODE_FOLD) seen

    float o[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};

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

    // load K_j, V_j codes and their rows' scales -> SRAM (cp.async ring): this warp's tile
    // `tile` into stage tile % STAGES, chunks placed by swz_chunk; rows past n_end zero (codes by
    // zero stores, scales by zero-filled 4-byte copies)
    auto issue = [&](int tile) {
        if (tile < my_tiles) {
            unsigned char* Ks = ring + (tile % STAGES) * STAGE_BYTES;
            unsigned char* Vs = Ks + TILE_BYTES;
            float* scs = reinterpret_cast<float*>(Vs + TILE_BYTES);
            const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = lane + 32 * i;
                if (c < TILE_CHUNKS) {
                    const int r = c / CPR, ch = c % CPR;
                    const int n = start + r;
                    const bool ok = n < n_end;
                    const long long off = (long long)blk_next[i] * s_blk + (long long)(n % BLOCK_SIZE) * s_row
                                          + hk * s_head + ch * VEC;
                    const int dst = 16 * swz_chunk(r, ch);
                    cp_async16_line<LOAD_L1>(Ks + dst, K + off, ok);
                    cp_async16_line<LOAD_L1>(Vs + dst, V + off, ok);
                    if (ch == 0) {                  // one lane a row: its block's s_K, s_V
                        const long long si = (long long)blk_next[i] * scale_blk + hk * scale_head;
                        cp_async4(scs + r, ok ? K_scale + si : K_scale, ok);
                        cp_async4(scs + TILE_ROWS + r, ok ? V_scale + si : V_scale, ok);
                    }
                }
            }
            load_blocks(tile + 1);
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    for (int j = 0; j < my_tiles; ++j) {            // loop over this warp's K_j, V_j tiles (SRAM)
        issue(j + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const unsigned char* Kt = ring + (j % STAGES) * STAGE_BYTES;
        const unsigned char* Vt = Kt + TILE_BYTES;
        const float* Ksc = reinterpret_cast<const float*>(Vt + TILE_BYTES);   // the rows' s_K ...
        const float* Vsc = Ksc + TILE_ROWS;                                   // ... and s_V
        const int start = n_begin + (warp + j * NUM_WARPS) * TILE_ROWS;

        // S = Q_g K_j'^T on the tensor cores from the codes (registers)
        float s[NT_S][4];
        mma_qkt_codes<KT_Q, NT_S>(s, qf, Kt, lane);
        // this lane's keys of 16-key step kk are 16kk + 4t + 0..3 (key_of): their scales <- SRAM
        float4 ks[TILE_ROWS / 16], vs[TILE_ROWS / 16];
        float vmax = 0.f;
#pragma unroll
        for (int kk = 0; kk < TILE_ROWS / 16; ++kk) {
            ks[kk] = *reinterpret_cast<const float4*>(Ksc + 16 * kk + 4 * t);
            vs[kk] = *reinterpret_cast<const float4*>(Vsc + 16 * kk + 4 * t);
            vmax = fmaxf(vmax, fmaxf(fmaxf(vs[kk].x, vs[kk].y), fmaxf(vs[kk].z, vs[kk].w)));
        }
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));   // the quad holds the tile's keys
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
        const float sigma_new = fmaxf(sigma, vmax * CODE_FOLD);
        const float o_rescale = sigma / sigma_new;  // powers of two: exact; 0 before the first tile
        const float v_unit = CODE_FOLD / sigma_new;
        sigma = sigma_new;
        // S times s_K (its column) and kl2 (its row), log2 units; keys at or past the split's
        // end (zero rows) -> -inf
        const bool tail = start + TILE_ROWS > n_end;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float4 k4 = ks[n >> 1];
                const float sk = (n & 1) ? ((e & 1) ? k4.w : k4.z) : ((e & 1) ? k4.y : k4.x);
                const float x = s[n][e] * sk * kl2[e >> 1];
                const int key = start + 16 * (n >> 1) + 4 * t + 2 * (n & 1) + (e & 1);
                s[n][e] = (tail && key >= n_end) ? neg_inf_f() : x;
            }
#pragma unroll
        for (int r = 0; r < 1 + HI_ROWS; ++r) online_softmax_row<NT_S, NT_O>(s, o, m[r], l[r], r, o_rescale);
        // P' = P s_V / sigma (<= 1), column by column (l summed P itself)
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float4 v4 = vs[n >> 1];
                const float sv = (n & 1) ? ((e & 1) ? v4.w : v4.z) : ((e & 1) ? v4.y : v4.x);
                s[n][e] *= sv * v_unit;
            }
        // O += P' V_j' on the tensor cores, V's codes transposed in registers
        mma_pv_codes<TILE_ROWS / 16, NT_O, HI_ROWS>(o, s, Vt, lane);
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
            // O's columns back in order (col_of), out of units of sigma
            float* dst = red_o + (warp * GROUP + gq) * HEAD_DIM;
            const float fs = f * sigma;
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                dst[col_of(n, 2 * t)] = o[n][2 * r] * fs;
                dst[col_of(n, 2 * t + 1)] = o[n][2 * r + 1] * fs;
            }
        }
    }
    __syncthreads();

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
