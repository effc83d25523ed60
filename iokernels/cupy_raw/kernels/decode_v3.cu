// decode_v3.cu -- Flash-Decoding, version 3: decode_v2's cp.async ring, with the combine
// fused into the split kernel and the paged block table staged in SRAM.
//
// The default decode kernel where decode_v4.cu (the tensor-core version) does not run:
// float32 and float64 rows, head dims that are not whole 16-deep mma steps, GQA groups
// above 16 (8 warps x 4 stages; the tuning sweep in iokernels/bench/sweeps_cupy.py times
// the shapes around it).
//
// What changed against decode_v2.cu (version 2), and why.  A decode call reads the whole
// cache once and is short, so the second launch of version 2 (decode.cu's combine), with
// its own ramp-up and tail, is a visible part of the call's time; and at 4 warps a block
// too few bytes are in flight.  So:
//   * FUSED=1: the combine runs inside the split kernel.  Each split block writes its
//     partial (O_s normalised, LSE_s) as before, waits at a block barrier, and then one
//     thread adds 1 to a counter of its (batch, kv head) with an acquire-release atomic at
//     GPU scope (atom.acq_rel.gpu: the release publishes every thread's partial, ordered
//     before it by the barrier, and the acquire makes the other blocks' partials visible to
//     this one).  The block that brings the counter to num_splits is the last of its
//     group: every partial is in L2 by then, so it merges the S partials of its g query
//     heads (reading them with ld.global.cg, which skips the SM's own L1, where a stale
//     line could sit) and writes O and LSE.  It then sets the counter back to 0, so
//     the next call needs no memset: the counters are a workspace the launcher keeps one
//     of per device and stream (cupy_raw/decode.py, _decode_counters).  FUSED=0 keeps v2's structure
//     (a separate combine launch: the split kernel and the combine kernel FlashAttention-2 ships
//     Flash-Decoding as, flash_fwd_splitkv_combine_kernel) for comparison.
//     The partial's write and the combine are decode_finish (decode_common.cuh), which
//     decode_v4.cu and decode_v5.cu end with too.
//   * NUM_WARPS is a setting (4 or 8 a block): more warps, more bytes in flight a block.
//   * paged: the block-table entries of the block's split are copied into SRAM once, at
//     the start (one coalesced read), when they fit the space the launcher gives
//     (table_cap entries); the per-tile lookups then read SRAM, not HBM/L2.  A split longer
//     than that reads its entries from global memory one tile ahead, as v2 does.
// Unchanged from v2: the per-warp ring of STAGES tiles (TILE_ROWS rows of K and of V a
// tile) filled by cp.async with only __syncwarp in the key loop; GQA packed (each K/V row
// read once for the g query heads); ragged lengths, a length-0 sequence gives O = 0 and
// LSE = -inf; tail rows zero-filled by cp.async's src-size form and masked to -inf; LSE in
// natural log.  On sm_75 cp_async16 is a plain load + store (common.cuh).
//
// Limits (the launcher runs version 1 instead): rows must be whole 16-byte chunks, at most
// 32 of them, 16-byte aligned.  Two calls that share a counter workspace must not run at
// the same time (the launcher keys it by stream; a call aborted mid-kernel would leave
// counts behind: the launcher zeroes a workspace when it creates it, and after an error
// CUDA's context is lost anyway).
//
// Quantized paged caches (KV_QUANT = 1 int8, 2 float8 e4m3; common.cuh): the pools hold
// 1-byte codes, so a row of d values is d bytes and the ring carries twice the rows of a
// 16-bit cache in the same SRAM.  A lane computes on 8 codes (one 8-byte word from SRAM,
// decoded in registers), the 8 values a lane holds on the 16-bit path, so the registers
// stay where they are.  Each row's scales (its block's, per KV head or per block) are read
// next to it; with power-of-two scales s_K, s_V the products fold exactly:
// q . (s_K c_K) = s_K (q . c_K) and p (s_V c_V) = (p s_V) c_V, one multiply a row, not a value.
// Sliding window (window_left >= 0): the query is the last key n - 1, so only keys
// [n - 1 - window_left, n) are split among the blocks; keys before them are never read.
//
// Per-warp pipeline: as decode_v2.cu (prologue issues tiles 0 .. STAGES-2; loop t issues
// t+STAGES-1, waits for t, computes t).
//
// Compile-time settings, every one passed by DecodeConfig.defines (none has a default here):
// HEAD_DIM, GROUP (g), IK_DTYPE, PAGED, BLOCK_SIZE (paged), NUM_WARPS, STAGES, TILE_ROWS,
// DECODE_MIN_BLOCKS, FUSED, COMBINE_REG_SPLITS (decode_common.cuh), KV_QUANT (paged only).
// Dynamic SRAM (the launcher's decode_v3_smem, cupy_raw/decode_config.py): max(rings, the warps' merge buffer,
// the fused combine's weights GROUP * num_splits acc_t), then table_cap int32 entries.
#include "common.cuh"
#include "splits.cuh"

#ifndef KV_QUANT
#error "decode_v3.cu: -DKV_QUANT is missing (DecodeConfig.defines passes it: 0 for a 16-bit cache)"
#endif
#ifndef HEAD_DIM
#error "decode_v3.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode_v3.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode_v3.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode_v3.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode_v3.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef STAGES
#error "decode_v3.cu: -DSTAGES is missing (DecodeConfig.defines passes it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v3.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef FUSED
#error "decode_v3.cu: -DFUSED is missing (DecodeConfig.defines passes it)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#if KV_QUANT
#if !PAGED
#error "decode_v3: a quantized cache is paged (its scales belong to the pool's blocks)"
#endif
typedef unsigned char kv_t;                           // K/V as stored: 1-byte codes
#define KV_BYTES 1
#define UNIT_BYTES 8                                  // bytes of a row one lane computes on
#else
typedef elem_t kv_t;
#define KV_BYTES IK_ELEM_BYTES
#define UNIT_BYTES 16
#endif
#define VEC (16 / KV_BYTES)                           // K/V elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row (what cp.async copies)
#define EPL (UNIT_BYTES / KV_BYTES)                   // elements a lane holds of a row
#define UPR (HEAD_DIM / EPL)                          // lanes' units a row (CPR unquantized)
// lanes per key row: UPR rounded up to a power of two (xor shuffles inside the group)
#define LANES (UPR <= 1 ? 1 : UPR <= 2 ? 2 : UPR <= 4 ? 4 : UPR <= 8 ? 8 : UPR <= 16 ? 16 : 32)
#define RPW (32 / LANES)                              // rows a warp reads side by side

#if STAGES < 2
#error "decode_v3: STAGES must be at least 2 (one tile in use, one in flight)"
#endif
#if (HEAD_DIM % VEC) != 0 || CPR > 32 || UPR > 32
#error "decode_v3: a row must be whole 16-byte chunks, at most 32 of them, and 32 lanes' units (use decode.cu)"
#endif

#ifndef TILE_ROWS
#error "decode_v3.cu: -DTILE_ROWS is missing (DecodeConfig.defines passes it)"
#endif
#if TILE_ROWS % RPW != 0
#error "decode_v3: TILE_ROWS must be a multiple of the rows a warp reads side by side"
#endif
#define STEPS (TILE_ROWS / RPW)                       // row steps a tile takes
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + 31) / 32)                 // chunks of K (or V) a lane copies a tile
#define STAGE_CHUNKS (2 * TILE_CHUNKS)                // K then V
#define RING_BYTES (NUM_WARPS * STAGES * STAGE_CHUNKS * 16)
#define MERGE_BYTES (NUM_WARPS * GROUP * HEAD_DIM * (int)sizeof(acc_t))
// the block table (paged) lives after the rings / merge buffer / combine weights; the
// launcher passes its byte offset (the weights' size depends on num_splits, a run-time value)

#include "decode_common.cuh"                         // decode_finish: write O_s, the fused combine

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v3(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
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
                int nk, int heads_q, int heads_kv, acc_t scale, int num_splits,
                int window_left,                       // keys before n - 1 - window_left unseen; -1: none
                acc_t* __restrict__ O_part, acc_t* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
                int* __restrict__ counters,            // (batch, heads_kv) zeros; FUSED only
                elem_t* __restrict__ O, acc_t* __restrict__ LSE) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ acc_t red_m[NUM_WARPS][GROUP];
    __shared__ acc_t red_l[NUM_WARPS][GROUP];

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane % LANES;
    const int slot = lane / LANES;
    const bool has_chunk = sub < UPR;
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split; a split past them is empty (LSE_s = -inf)
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;

    const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
    const int my_tiles = n_tiles > warp ? (n_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
    uint4* ring = reinterpret_cast<uint4*>(smem_raw) + warp * (STAGES * STAGE_CHUNKS);

    const acc_t qscale = scale * (acc_t)1.4426950408889634;   // scores in log2 units
    acc_t q[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
#if KV_QUANT
        // q's element type differs from the codes': its EPL values, one load each (once a block)
        const elem_t* qr = Q + ((long long)b * heads_q + hk * GROUP + gq) * HEAD_DIM + sub * EPL;
#pragma unroll
        for (int e = 0; e < EPL; ++e) q[gq][e] = has_chunk ? to_acc(qr[e]) * qscale : (acc_t)0;
#else
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (has_chunk) u = *reinterpret_cast<const uint4*>(Q + ((long long)b * heads_q + hk * GROUP + gq) * HEAD_DIM + sub * VEC);
#pragma unroll
        for (int e = 0; e < EPL; ++e) q[gq][e] = chunk_elem(u, e) * qscale;
#endif
    }
    acc_t m[GROUP], l[GROUP], acc[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        m[gq] = neg_inf(); l[gq] = 0;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[gq][e] = 0;
    }

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
    auto load_blocks = [&](int t) {
        const int start = n_begin + (warp + t * NUM_WARPS) * TILE_ROWS;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int n = start + (lane + 32 * i) / CPR;
            const bool ok = t < my_tiles && (lane + 32 * i) < TILE_CHUNKS && n < n_end;
            blk_next[i] = ok ? tb[n / BLOCK_SIZE - e0] : 0;
        }
    };
    load_blocks(0);
#else
    const kv_t* Kb = K + b * skb + hk * skh;
    const kv_t* Vb = V + b * svb + hk * svh;
#endif

    // load K, V rows of this warp's tile t -> SRAM stage t % STAGES (asynchronous; one group)
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
                    const bool ok = n < n_end;
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
            load_blocks(t + 1);
#endif
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    for (int t = 0; t < my_tiles; ++t) {            // loop over this warp's K/V tiles
        issue(t + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const uint4* Ks = ring + (t % STAGES) * STAGE_CHUNKS;
        const uint4* Vs = Ks + TILE_CHUNKS;
        const int start = n_begin + (warp + t * NUM_WARPS) * TILE_ROWS;

        acc_t sc[GROUP][STEPS];                     // scores, log2 units, tail masked
#if KV_QUANT
        acc_t vsc[STEPS];                           // each row's V scale, for P V
#endif
#pragma unroll
        for (int st = 0; st < STEPS; ++st) {
            const int r = st * RPW + slot;
            acc_t kf[EPL];
            const bool vis = start + r < n_end;
#if KV_QUANT
            uint2 u = make_uint2(0u, 0u);
            if (has_chunk) u = reinterpret_cast<const uint2*>(Ks)[r * UPR + sub];
#pragma unroll
            for (int e = 0; e < EPL; ++e) kf[e] = kv_code_of(u, e);
            // load this row's scales (its block's) <- HBM/L2
            const long long sidx = vis ? (long long)tb[(start + r) / BLOCK_SIZE - e0] * scale_blk + hk * scale_head : 0;
            const acc_t ks = vis ? (acc_t)K_scale[sidx] : (acc_t)0;
            vsc[st] = vis ? (acc_t)V_scale[sidx] : (acc_t)0;
#else
            uint4 u = make_uint4(0u, 0u, 0u, 0u);
            if (has_chunk) u = Ks[r * CPR + sub];
#pragma unroll
            for (int e = 0; e < EPL; ++e) kf[e] = chunk_elem(u, e);
#endif
#pragma unroll
            for (int gq = 0; gq < GROUP; ++gq) {
                acc_t d = 0;
#pragma unroll
                for (int e = 0; e < EPL; ++e) d += q[gq][e] * kf[e];
#pragma unroll
                for (int off = LANES / 2; off > 0; off /= 2) d += shfl_xor(d, off);
#if KV_QUANT
                d *= ks;                            // q . (s_K c) = s_K (q . c), exact for s_K = 2^k
#endif
                sc[gq][st] = vis ? d : neg_inf();
            }
        }
        acc_t base[GROUP];                          // online softmax: one rescale a tile per head
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) {
            acc_t mx = neg_inf();
#pragma unroll
            for (int st = 0; st < STEPS; ++st) mx = ik_max(mx, sc[gq][st]);
            const acc_t m_new = ik_max(m[gq], mx);
            base[gq] = (m_new == neg_inf()) ? (acc_t)0 : m_new;
            const acc_t alpha = ik_exp2(m[gq] - base[gq]);
            l[gq] *= alpha;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[gq][e] *= alpha;
            m[gq] = m_new;
        }
#pragma unroll
        for (int st = 0; st < STEPS; ++st) {        // O += P V  (V rows from SRAM)
            const int r = st * RPW + slot;
            acc_t vf[EPL];
#if KV_QUANT
            uint2 u = make_uint2(0u, 0u);
            if (has_chunk) u = reinterpret_cast<const uint2*>(Vs)[r * UPR + sub];
#pragma unroll
            for (int e = 0; e < EPL; ++e) vf[e] = kv_code_of(u, e);
#else
            uint4 u = make_uint4(0u, 0u, 0u, 0u);
            if (has_chunk) u = Vs[r * CPR + sub];
#pragma unroll
            for (int e = 0; e < EPL; ++e) vf[e] = chunk_elem(u, e);
#endif
#pragma unroll
            for (int gq = 0; gq < GROUP; ++gq) {
                const acc_t p = ik_exp2(sc[gq][st] - base[gq]);
                l[gq] += p;
#if KV_QUANT
                const acc_t pv = p * vsc[st];       // p (s_V c) = (p s_V) c
#else
                const acc_t pv = p;
#endif
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[gq][e] += pv * vf[e];
            }
        }
        __syncwarp();                               // every lane is done with this stage
    }
    cp_async_wait<0>();

    // merge the slots of a warp, then the warps (through SRAM), as decode_v2.cu
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
    __syncthreads();

    acc_t* red_o = reinterpret_cast<acc_t*>(smem_raw);
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        acc_t M = neg_inf();
        for (int w = 0; w < NUM_WARPS; ++w) M = ik_max(M, red_m[w][gq]);
        const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
        if (has_chunk && lane < LANES) {
            const acc_t f = ik_exp2(m[gq] - bs);
#pragma unroll
            for (int e = 0; e < EPL; ++e) red_o[(warp * GROUP + gq) * HEAD_DIM + sub * EPL + e] = acc[gq][e] * f;
        }
    }
    __syncthreads();

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    // (the weights in the rings' space, idle now)
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
