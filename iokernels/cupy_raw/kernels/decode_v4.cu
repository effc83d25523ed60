// decode_v4.cu -- Flash-Decoding, version 4: the GQA group's products on the tensor cores.
//
// What changed against decode_v3.cu (version 3), and why.  Version 3 computes, for every
// K/V row of a tile, the g dot products q_h . k and the g updates O_h += p_h v on the CUDA
// cores: 2 x g x d float32 FMAs a row, plus the 16-bit -> float32 conversions and the
// shuffle reductions.  At g = 4 and d = 128 that is about 2 FMAs for every byte of K/V a
// block reads, a large share of an SM's float32 issue rate when the cache streams at HBM
// speed: at large batch x length the arithmetic, and not the memory, can set the pace.
// FlashInfer (Ye et al., 2024 and its 2025 paper) runs GQA decode with groups of 4 and
// more through its tensor-core (prefill) kernels: the g query rows of a group make the
// decode a small prefill.  So here
//   * S = scale * Q_g K_j^T and O += P V_j are mma.sync.m16n8k16 products (16-bit in,
//     float32 accumulators): the g query heads of the group are the rows of the A operand,
//     padded to 16 rows.  Rows g..15 are zero and their results ignored: the tensor cores
//     waste (16 - g) / 16 of their work (3/4 at g = 4), and still free the CUDA cores,
//     which only do the online softmax on the accumulator fragments;
//   * K_j's rows (row-major [key][d] in SRAM) are B fragments as they lie (ldmatrix, no
//     transpose); V_j's go through ldmatrix.trans (FlashAttention-2's kernel, fa_v2.cu,
//     does the same).  The 8 rows one ldmatrix reads must fall in 8 different bank groups:
//     rows of whole 128-byte halves (d = 64, 128, 192, 256) are stored unpadded with the
//     XOR swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); mma.cuh's tile_offset),
//     other rows padded to d + 8 elements.  The swizzle also keeps the copies whole: the 8
//     lanes that copy 128 contiguous bytes of a row write one 128-byte bank window of SRAM,
//     where a padded row's 16-byte shift split them and Nsight Compute counted more L2
//     sector requests than the tile has sectors (benchmarks/results/sweeps has the counts;
//     SWIZZLE=0 keeps the padded rows, for comparison);
//   * the online softmax works on the accumulators: a row's max and sum are reduced over
//     the 4 lanes of a quad with two shuffles; P is converted to 16-bit A fragments in
//     registers (no SRAM round trip: FlashAttention-2's register reuse).  P is rounded to
//     16 bits before P V, as in FlashAttention-2, while l sums the float32 values.
// Unchanged from v3 in idea: each warp owns a stream of key tiles (tiles warp, warp +
// NUM_WARPS, ...) through its own cp.async ring of STAGES tiles with only __syncwarp in
// the key loop, and its own m, l, O; the warps merge through SRAM at the end; the split-KV
// grid and the fused combine (decode_common.cuh); a paged split's block-table entries
// staged in SRAM when they fit table_cap; ragged lengths, tail rows zero in SRAM
// and masked to -inf, a length-0 sequence gives O = 0 and LSE = -inf.
// A sliding window (window_left >= 0) splits only the visible keys [n - 1 - window_left, n),
// as v3 does: keys before them are never read.
//
// The loads.  Every lane copies 16-byte chunks with cp.async (any GPU from sm_80), CPL of K
// and CPL of V a tile, and waits on its own copy groups (cp_async16_line, common.cuh): each
// copy carries the L2::128B prefetch hint, so a miss brings the whole 128-byte line from HBM
// in one request rather than sector by sector, and the chunks of rows past the split's end
// are zero stores, so every copy is a whole, unpredicated 16 bytes.
//   * The addresses.  Over a contiguous cache whose rows are 2^k chunks (d = 16, 32, 64, 128,
//     256), one warp-wide copy covers RPI = 32 / CPR whole rows, so a lane copies the same
//     chunk of every row it copies: its SRAM offsets are fixed for the whole loop, its
//     sources step by RPI rows a copy, and only the split's last tile tests its rows against
//     n_end.  Finding each copy's row, chunk, swizzled offset and 64-bit address afresh (the
//     paged path and other head dims still do) costs about a dozen instructions a copy, a
//     large share of all the instructions the kernel issues at 16 copies a tile.
//   * The cache operator (-DLOAD_L1).  0: cp.async.cg, the copy bypasses L1.  1: cp.async.ca,
//     it passes through L1.  Nsight Compute counts one L2 request a 128-byte line for this
//     kernel's .ca copies and two for its .cg copies (a stand-alone copy loop's .cg copies
//     make one; benchmarks/results/sweeps has both).  A missed line is allocated in L1, and
//     L1 is what the SM's 256 KB of SRAM (on Hopper) leaves beside the shared memory, so the
//     launcher allocates the rings exactly (decode_v4_smem, swizzled rows unpadded): the
//     default 3-stage ring of 8 warps then leaves L1 60 KB.  Allocated for padded rows it
//     leaves 28 KB, and there .ca is slower than .cg.  DecodeConfig's default: .ca over a
//     contiguous cache on sm_90, .cg elsewhere.
//   * Bulk copies (-DLOAD_BULK=1, sm_90): Hopper's copy engine.  Lane r asks for one whole
//     row (d x 2 bytes) with one bulk copy (cp.async.bulk), K's rows from lanes 0..Bc-1 and
//     V's from the next Bc, into padded SRAM rows (a whole-row copy cannot swizzle); the rows
//     of a stage complete on one mbarrier of the warp's ring (lane 0 announces the stage's
//     bytes, mbarrier.cuh), which the warp polls before it reads the stage.  One instruction
//     a lane a tile instead of 2 x CPL, and 256-byte requests instead of 16-byte ones: fewer
//     issue slots and more bytes in flight per instruction, the copy engine's promise on
//     Hopper.  Rows past the split's end are not copied; their lane zero-fills them (V's rows
//     must be finite, as P = 0 multiplies them).  It stays a setting, not the default: in the
//     benchmark record the row copies stream no faster than the hinted cp.async chunks over a
//     contiguous cache and slower over pages.
// Block shape (DecodeConfig): 8 warps, one block an SM; where the copies pass through L1,
// when the batch's (b, kv head) pairs give every SM two or more, 4-warp blocks two an SM, so
// one block's start and end overlap the other's streaming.
//
// Notation (Flash-Decoding, Dao et al., 2023; FlashAttention-2, Dao, 2023):
//   S        splits of the key axis (num_splits), one thread block per (split, kv head, b)
//   g        GROUP, query heads per KV head: the A operand's rows (at most 16)
//   Bc       TILE_ROWS, key rows of one K_j (and V_j) tile (a multiple of 16)
//   m, l     running max (log2 units) and sum of a query row; O its unnormalised output
//   O_s      split s's normalised partial output; LSE_s its log-sum-exp (natural log)
//
// Limits (the registry's check_decode_v4 refuses the rest; v3 takes them): float16 or
// bfloat16, head_dim a multiple of 16 up to 256 (a quantized cache: 64, 128 or 256), g <= 16,
// rows 16-byte aligned, compute capability 8.0 or newer.  The file still compiles for sm_75
// (mma16816 is two k8 products there, cp.async a plain copy), float16 only.
//
// Quantized paged caches (KV_QUANT = 1 int8, 2 float8 e4m3; common.cuh).  Version 3 decodes
// each code to float32 in registers (several integer and float instructions a code) and
// multiplies it on the CUDA cores; at 1 byte a code that is about twice the instructions a
// byte of the 16-bit cache, so there the 1-byte caches are bound by instruction issue, not
// by memory, and halving the bytes does not halve the time.  Here the codes
// become float16 mma operands (mma_codes.cuh): the cp.async ring copies the 1-byte rows as
// they are stored (a 16-bit row's bytes carry twice the keys), each row's two float32
// power-of-two scales ride along into the stage (cp.async, 4 bytes each), and about two
// integer instructions a code turn 4 codes into two float16x2 operands (one PRMT and a few
// bit operations; no conversion instruction, so every architecture runs the same code).
// The scales are per key, so they multiply after the products, never per element: s_K
// scales S's columns (with scale_log2, one multiply an accumulator), s_V scales P's columns
// before P is rounded to float16, relative to the largest s_V seen (O is kept in those units;
// mma_codes.cuh states the rounding).  The products are float16 x float16 for either compute
// dtype: a bfloat16 query is moved to float16 with a power-of-two row scale, undone on S
// (exact down to 2^-28 of the row's largest element), because bfloat16 has no exact
// equivalent of the codes' float16 bit tricks.  P V contracts over keys, which the 1-byte
// V rows hold across rows, not along them: instead of ldmatrix.trans (16-bit only) a lane
// reads 4 key rows and transposes their codes in registers with PRMT.  Head dims 64, 128,
// 256 (the swizzle of the unpadded rows); the 16-bit path below is unchanged by KV_QUANT = 0.
//
// Compile-time settings: HEAD_DIM, GROUP, IK_DTYPE, PAGED, BLOCK_SIZE (paged), NUM_WARPS,
// STAGES, TILE_ROWS, DECODE_MIN_BLOCKS, FUSED, LOAD_BULK, LOAD_L1, KV_QUANT (paged only),
// SWIZZLE (16-bit rows; default: on where the rows allow it).
// Dynamic SRAM (decode_v4_smem, cupy_raw/config.py): max(rings NUM_WARPS x STAGES x 2 x Bc x
// SROW 16-bit (KV_QUANT: x HEAD_DIM bytes, plus 2 x Bc float32 scales a stage), the warps'
// merge buffer, the fused combine's weights g x S acc_t), then table_cap int32 entries.
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef PAGED
#define PAGED 0
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef TILE_ROWS
#define TILE_ROWS 16
#endif
#ifndef DECODE_MIN_BLOCKS
#define DECODE_MIN_BLOCKS 2
#endif
#ifndef FUSED
#define FUSED 1
#endif
#ifndef LOAD_BULK
#define LOAD_BULK 0
#endif
#ifndef LOAD_L1
#define LOAD_L1 0                                     // 1: cp.async.ca (through L1), 0: .cg
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "decode_v4 is the 16-bit tensor-core decode: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if HEAD_DIM % 16 != 0 || HEAD_DIM > 256
#error "decode_v4: head_dim must be a multiple of 16, at most 256 (use decode_v3.cu)"
#endif
#if GROUP < 1 || GROUP > 16
#error "decode_v4: the GQA group must fit the 16 rows of one mma A operand (use decode_v3.cu)"
#endif
#if TILE_ROWS % 16 != 0
#error "decode_v4: TILE_ROWS must be a multiple of 16 (the k depth of the P V product)"
#endif
#if STAGES < 2
#error "decode_v4: STAGES must be at least 2 (one tile in use, one in flight)"
#endif
#if LOAD_BULK && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "decode_v4: LOAD_BULK=1 needs sm_90 (cp.async.bulk and mbarrier transaction counts)"
#endif
#if LOAD_BULK && KV_QUANT
#error "decode_v4: the bulk copies read 16-bit rows; a quantized cache loads with cp.async"
#endif

#define NTHREADS (32 * NUM_WARPS)
#if KV_QUANT
#if !PAGED
#error "decode_v4: a quantized cache is paged (its scales belong to the pool's blocks)"
#endif
typedef unsigned char kv_t;                           // K/V as stored: 1-byte codes
#define VEC 16                                        // codes in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
#define TILE_BYTES (TILE_ROWS * HEAD_DIM)             // codes of K (or V) a tile: unpadded rows, swizzled chunks
#define STAGE_BYTES (2 * TILE_BYTES + 2 * TILE_ROWS * 4)   // K, V, then the rows' s_K and s_V
#else
typedef elem_t kv_t;
#define VEC 8                                         // 16-bit elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
// rows of whole 128-byte halves (d = 64, 128, 192, 256) are stored unpadded with the XOR
// swizzle (mma.cuh, tile_offset), other rows (and the bulk copies' whole-row writes) padded
#ifndef SWIZZLE
#define SWIZZLE (CPR % 8 == 0 && !LOAD_BULK)
#endif
#if SWIZZLE && (CPR % 8 != 0 || LOAD_BULK)
#error "decode_v4: the swizzle needs rows of whole 128-byte halves, loaded in 16-byte chunks"
#endif
#define SROW (SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC)    // SRAM row stride (16-bit)
#define TILE_ELEMS (TILE_ROWS * SROW)                 // 16-bit elements of K (or V) in SRAM a tile
#define STAGE_ELEMS (2 * TILE_ELEMS)                  // K then V
#endif
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define NT_S (TILE_ROWS / 8)                          // 8-key n-tiles of S
#define NT_O (HEAD_DIM / 8)                           // 8-column n-tiles of O
#define KT_Q (HEAD_DIM / 16)                          // 16-deep k-steps of Q K^T
#define HI_ROWS (GROUP > 8)                           // rows 8..15 of the A operand hold heads
#define ROW_BYTES (HEAD_DIM * 2)                      // one K (or V) row in HBM
#define CPL_BULK ((2 * TILE_ROWS + 31) / 32)          // rows (K's, then V's) a lane copies a tile, bulk

#include "decode_common.cuh"
#if LOAD_BULK
#include "mbarrier.cuh"
#endif
#if KV_QUANT
#include "mma_codes.cuh"
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v4(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const kv_t* __restrict__ K, const kv_t* __restrict__ V,
#if PAGED
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
                int table_cap, int table_offset,                      // SRAM table: entries, byte offset
#if KV_QUANT
                const float* __restrict__ K_scale, const float* __restrict__ V_scale,
                int scale_blk, int scale_head,                        // scale of block blk, head h:
                                                                      // [blk * scale_blk + h * scale_head]
#endif
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
#if LOAD_BULK
    __shared__ unsigned long long full[NUM_WARPS][STAGES];   // stage s of warp w's ring has landed
#endif

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;             // mma fragment coordinates (rows g, g + 8)
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split (a sliding window hides the ones before first);
    // a split past them is empty (LSE_s = -inf)
    const int first = window_left < 0 ? 0 : max(len - 1 - window_left, 0);
    const int per_split = (len - first + num_splits - 1) / num_splits;
    const int n_begin = min(first + split * per_split, len), n_end = min(n_begin + per_split, len);

    const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
#if KV_QUANT
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
#else
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
#endif

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
#if LOAD_BULK
    int blk_next[CPL_BULK];
    auto load_blocks = [&](int tile) {
        const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
#pragma unroll
        for (int i = 0; i < CPL_BULK; ++i) {
            const int n = start + (lane + 32 * i) % TILE_ROWS;
            const bool ok = tile < my_tiles && (lane + 32 * i) < 2 * TILE_ROWS && n < n_end;
            blk_next[i] = ok ? tb[n / BLOCK_SIZE - e0] : 0;
        }
    };
#else
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
#endif
    load_blocks(0);
#else
    const elem_t* Kb = K + b * skb + hk * skh;
    const elem_t* Vb = V + b * svb + hk * svh;
#endif

#if LOAD_BULK
    if (lane == 0) {
        for (int st = 0; st < STAGES; ++st) mbar_init(&full[warp][st], 1);
        mbar_fence_init();
    }
    __syncwarp();
    // load K_j, V_j -> SRAM (bulk copies, one row a copy): this warp's tile `tile` into stage
    // tile % STAGES, completing on full[warp][stage]
    auto issue = [&](int tile) {
        if (tile < my_tiles) {
            const int stage = tile % STAGES;
            u16* Ks = ring + stage * STAGE_ELEMS;
            const int start = n_begin + (warp + tile * NUM_WARPS) * TILE_ROWS;
            const int rows = min(TILE_ROWS, n_end - start);        // rows of this tile that exist
            if (lane == 0) mbar_arrive_expect_tx(&full[warp][stage], 2u * rows * ROW_BYTES);
            __syncwarp();                                          // the bytes announced first
#pragma unroll
            for (int i = 0; i < CPL_BULK; ++i) {
                const int c = lane + 32 * i;
                if (c < 2 * TILE_ROWS) {
                    const int r = c % TILE_ROWS, is_v = c / TILE_ROWS;
                    u16* dst = Ks + is_v * TILE_ELEMS + r * SROW;
                    if (r < rows) {
                        const int n = start + r;
#if PAGED
                        const long long off = (long long)blk_next[i] * s_blk
                                              + (long long)(n % BLOCK_SIZE) * s_row + hk * s_head;
                        const elem_t* src = (is_v ? V : K) + off;
#else
                        const elem_t* src = is_v ? Vb + (long long)n * svn : Kb + (long long)n * skn;
#endif
                        fence_proxy_async_smem();                  // this stage's last reads come first
                        bulk_copy_g2s(dst, src, ROW_BYTES, &full[warp][stage]);
                    } else {                                       // past the split: a zero row
#pragma unroll
                        for (int ch = 0; ch < CPR; ++ch)
                            *reinterpret_cast<uint4*>(dst + ch * VEC) = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
#if PAGED
            load_blocks(tile + 1);
#endif
        }
    };
#elif KV_QUANT
    // load K_j, V_j codes and their rows' scales -> SRAM (cp.async ring): this warp's tile
    // `tile` into stage tile % STAGES, chunks placed by swz_chunk; rows past n_end zero (codes by zero stores, scales by
    // zero-filled 4-byte copies)
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
#elif !PAGED && 32 % CPR == 0
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
#if LOAD_BULK
        mbar_wait(&full[warp][j % STAGES], (j / STAGES) & 1);
#else
        cp_async_wait<STAGES - 1>();
#endif
        __syncwarp();
#if KV_QUANT
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
#else
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
#endif
        __syncwarp();                               // every lane is done with this stage
    }
#if !LOAD_BULK
    cp_async_wait<0>();
#endif

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
#if KV_QUANT
            // O's columns back in order (col_of), out of units of sigma
            float* dst = red_o + (warp * GROUP + gq) * HEAD_DIM;
            const float fs = f * sigma;
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                dst[col_of(n, 2 * t)] = o[n][2 * r] * fs;
                dst[col_of(n, 2 * t + 1)] = o[n][2 * r + 1] * fs;
            }
#else
            float* dst = red_o + (warp * GROUP + gq) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                dst[n * 8] = o[n][2 * r] * f;
                dst[n * 8 + 1] = o[n][2 * r + 1] * f;
            }
#endif
        }
    }
    __syncthreads();

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
