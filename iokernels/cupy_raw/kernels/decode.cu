// decode.cu -- Flash-Decoding: split-KV decode and the exact log-sum-exp combine.
//
// One new query token per sequence.  Decode is memory bound (each K/V byte is used for
// about g FLOPs, g = heads_q / heads_kv), so everything here is about reading the KV
// cache once, at full bandwidth:
//
//   decode_split   grid (num_splits, heads_kv, batch).  A block owns one kv head of one
//                  sequence and one chunk of its keys, and ALL g query heads that read
//                  that kv head (GQA packed: each K/V row is read from HBM once per group,
//                  not once per query head).  LANES lanes cooperate on one key row, each
//                  reading 16 bytes (VEC elements) at once; a block walks its chunk
//                  UNROLL rows per sub-group at a time so many loads are in flight.
//                  Output: the chunk's normalised partial O and its LSE (float32 /
//                  float64), or, with one split, the final O and LSE directly.
//   decode_combine grid (batch * heads_q).  O = sum_s w_s O_s with w_s = exp(LSE_s - LSE),
//                  LSE = log sum_s exp(LSE_s): exact, and a chunk with LSE = -inf (no keys)
//                  weighs nothing.
//
// PAGED=1 reads K and V from a paged pool (num_blocks, BLOCK_SIZE, heads_kv, head_dim)
// through an int32 block table (batch, max_blocks): key n of sequence b lives in
// physical block table[b][n / BLOCK_SIZE], row n % BLOCK_SIZE.  PAGED=0 reads a
// contiguous (batch, heads_kv, seq, head_dim) cache with strides.
//
// KV_QUANT (paged only; common.cuh): the pools hold 1-byte codes (1 int8, 2 float8 e4m3) and
// float32 scales per (block, KV head) or per block.  A lane loads 8 codes (8 bytes) of a row
// at once and decodes them in registers; the row's K and V scales are read next to it and
// folded into its score and its weight (s_K (q . c_K), (p s_V) c_V: exact, the scales are
// powers of two).  window_left >= 0 (sliding window): only keys [n - 1 - window_left, n)
// are split among the blocks, the query being the last key n - 1.
//
// Compile-time settings: HEAD_DIM, GROUP (g), IK_DTYPE, PAGED, BLOCK_SIZE (paged),
// VEC_IO (rows are whole 16-byte chunks; 8-byte words of codes when quantized), NUM_WARPS,
// UNROLL, KV_QUANT.
// What limits it: the rows in flight are held in registers (UNROLL rows a lane), so few
// blocks fit an SM and few bytes are in flight; decode_v2.cu moves them into SRAM.
#include "common.cuh"
#include "splits.cuh"

#ifndef KV_QUANT
#error "decode.cu: -DKV_QUANT is missing (DecodeConfig.defines passes it: 0 for a 16-bit cache)"
#endif
#ifndef HEAD_DIM
#error "decode.cu: -DHEAD_DIM is missing (DecodeConfig.defines passes it)"
#endif
#ifndef GROUP
#error "decode.cu: -DGROUP is missing (DecodeConfig.defines passes it)"
#endif
#ifndef PAGED
#error "decode.cu: -DPAGED is missing (DecodeConfig.defines passes it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode.cu: -DBLOCK_SIZE is missing (DecodeConfig.defines passes it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode.cu: -DNUM_WARPS is missing (DecodeConfig.defines passes it)"
#endif
#ifndef UNROLL
#error "decode.cu: -DUNROLL is missing (DecodeConfig.defines passes it)"
#endif
#if KV_QUANT
#if !PAGED
#error "decode: a quantized cache is paged (its scales belong to the pool's blocks)"
#endif
typedef unsigned char kv_t;                           // K/V as stored: 1-byte codes
#define KV_BYTES 1
#define LOAD_BYTES 8                                  // one load: 8 codes (a 16-bit row's 8 values' registers)
#else
typedef elem_t kv_t;
#define KV_BYTES IK_ELEM_BYTES
#define LOAD_BYTES 16
#endif
#ifndef VEC_IO
#error "decode.cu: -DVEC_IO is missing (DecodeConfig.defines passes it)"
#endif

#define NTHREADS (32 * NUM_WARPS)
// ask the compiler to fit 4 blocks an SM (at most 128 registers a thread): more blocks,
// more loads in flight, which is what a memory-bound kernel lives on
#ifndef DECODE_MIN_BLOCKS
#error "decode.cu: -DDECODE_MIN_BLOCKS is missing (DecodeConfig.defines passes it)"
#endif
#define VEC (LOAD_BYTES / KV_BYTES)                   // K/V elements in one vector load

// lanes per key row: enough 16-byte loads to cover a row, rounded up to a power of two
// (a row's lanes must be an aligned group of a warp for the shuffles); the scalar path
// uses a whole warp per row.
#if VEC_IO
#define LANES_RAW ((HEAD_DIM + VEC - 1) / VEC)
#define LANES (LANES_RAW <= 1 ? 1 : LANES_RAW <= 2 ? 2 : LANES_RAW <= 4 ? 4 : LANES_RAW <= 8 ? 8 : LANES_RAW <= 16 ? 16 : 32)
#define EPL VEC                                        // elements per lane
#else
#define LANES 32
#define EPL ((HEAD_DIM + 31) / 32)
#endif
#define SLOTS (NTHREADS / LANES)                       // key rows a block reads side by side

#if VEC_IO && LANES_RAW > 32
#error "decode: head_dim too large for one warp per row (at most 32 vector loads)"
#endif

// element e of this lane's share of a row
__device__ __forceinline__ int elem_index(int sub, int e) {
#if VEC_IO
    return sub * VEC + e;
#else
    return sub + 32 * e;
#endif
}

// One lane's share of a key row, held in registers as loaded (16 bytes on the vector
// path: a float16 row stays 16-bit until it is used, which halves the registers it needs;
// 8 bytes of 1-byte codes, decoded when used).
#if VEC_IO && KV_QUANT
struct RowBuf { uint2 u; };
__device__ __forceinline__ void load_row(RowBuf& r, const kv_t* row, int sub, bool ok) {
    r.u.x = r.u.y = 0u;
    if (ok && sub * VEC < HEAD_DIM) r.u = *reinterpret_cast<const uint2*>(row + sub * VEC);
}
__device__ __forceinline__ acc_t elem(const RowBuf& r, int e) { return kv_code_of(r.u, e); }
#elif VEC_IO
struct RowBuf { uint4 u; };
__device__ __forceinline__ void load_row(RowBuf& r, const elem_t* row, int sub, bool ok) {
    r.u.x = r.u.y = r.u.z = r.u.w = 0u;
    if (ok && sub * VEC < HEAD_DIM) r.u = *reinterpret_cast<const uint4*>(row + sub * VEC);
}
__device__ __forceinline__ acc_t elem(const RowBuf& r, int e) { return chunk_elem(r.u, e); }
#else
struct RowBuf { acc_t x[EPL]; };
__device__ __forceinline__ void load_row(RowBuf& r, const kv_t* row, int sub, bool ok) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        int c = sub + 32 * e;
#if KV_QUANT
        r.x[e] = (ok && c < HEAD_DIM) ? (acc_t)kv_code(row[c]) : (acc_t)0;
#else
        r.x[e] = (ok && c < HEAD_DIM) ? to_acc(row[c]) : (acc_t)0;
#endif
    }
}
__device__ __forceinline__ acc_t elem(const RowBuf& r, int e) { return r.x[e]; }
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
             const kv_t* __restrict__ K, const kv_t* __restrict__ V,
#if PAGED
             const int* __restrict__ block_table, int max_blocks,
             long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
#if KV_QUANT
             const float* __restrict__ K_scale, const float* __restrict__ V_scale,
             int scale_blk, int scale_head,        // scale of block blk, head h: [blk * scale_blk + h * scale_head]
#endif
#else
             long long skb, long long skh, long long skn,
             long long svb, long long svh, long long svn,
#endif
             const int* __restrict__ seq_lens,      // (batch,) int32, or null: every sequence has nk keys
             int nk, int heads_q, int heads_kv, acc_t scale, int num_splits,
             int window_left,                       // keys before n - 1 - window_left unseen; -1: none
             acc_t* __restrict__ O_part, acc_t* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
             elem_t* __restrict__ O, acc_t* __restrict__ LSE) {        // used when num_splits == 1
    __shared__ acc_t red_m[NUM_WARPS][GROUP];
    __shared__ acc_t red_l[NUM_WARPS][GROUP];
    __shared__ acc_t red_o[NUM_WARPS][LANES * EPL];

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane % LANES;                   // this lane's part of a row
    const int slot = threadIdx.x / LANES;           // which row of the SLOTS side by side
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split; a split past them is empty (LSE_s = -inf)
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;

    // the g query rows of this kv head, pre-scaled by scale * log2(e): scores in log2 units
    const acc_t qscale = scale * (acc_t)1.4426950408889634;
    acc_t q[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
#if KV_QUANT
        // q's element type differs from the codes': one load a value (once a block)
        const elem_t* qr = Q + ((long long)b * heads_q + hk * GROUP + gq) * HEAD_DIM;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const int c = elem_index(sub, e);
            q[gq][e] = c < HEAD_DIM ? to_acc(qr[c]) * qscale : (acc_t)0;
        }
#else
        RowBuf r;
        load_row(r, Q + ((long long)b * heads_q + hk * GROUP + gq) * HEAD_DIM, sub, true);
#pragma unroll
        for (int e = 0; e < EPL; ++e) q[gq][e] = elem(r, e) * qscale;
#endif
    }
    acc_t m[GROUP], l[GROUP], acc[GROUP][EPL];
#pragma unroll
    for (int gq = 0; gq < GROUP; ++gq) {
        m[gq] = neg_inf(); l[gq] = 0;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[gq][e] = 0;
    }

#if !PAGED
    const kv_t* Kb = K + b * skb + hk * skh;
    const kv_t* Vb = V + b * svb + hk * svh;
#endif
    // load K, V rows -> registers, UNROLL rows per slot at a time; update (m, l, acc).
    // The trip count is the block's, not the slot's: every lane of a warp must reach the
    // shuffles below together (a slot past the end just sees masked, all -inf scores).
    for (int base = n_begin; base < n_end; base += SLOTS * UNROLL) {
        const int n0 = base + slot;
        RowBuf kr[UNROLL], vr[UNROLL];
#if KV_QUANT
        acc_t ks[UNROLL], vs[UNROLL];               // each row's scales (its block's)
#endif
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int n = n0 + u * SLOTS;
            bool ok = n < n_end;
#if PAGED
            int blk = ok ? block_table[(long long)b * max_blocks + n / BLOCK_SIZE] : 0;
            long long off = blk * s_blk + (n % BLOCK_SIZE) * s_row + hk * s_head;
            load_row(kr[u], K + off, sub, ok);
            load_row(vr[u], V + off, sub, ok);
#if KV_QUANT
            const long long sidx = (long long)blk * scale_blk + hk * scale_head;
            ks[u] = ok ? (acc_t)K_scale[sidx] : (acc_t)0;
            vs[u] = ok ? (acc_t)V_scale[sidx] : (acc_t)0;
#endif
#else
            load_row(kr[u], Kb + (long long)n * skn, sub, ok);
            load_row(vr[u], Vb + (long long)n * svn, sub, ok);
#endif
        }
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) {
            acc_t s[UNROLL];
            acc_t mx = neg_inf();
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                acc_t d = 0;
#pragma unroll
                for (int e = 0; e < EPL; ++e) d += q[gq][e] * elem(kr[u], e);
#pragma unroll
                for (int off = LANES / 2; off > 0; off /= 2) d += shfl_xor(d, off);
#if KV_QUANT
                d *= ks[u];                         // q . (s_K c) = s_K (q . c)
#endif
                s[u] = (n0 + u * SLOTS < n_end) ? d : neg_inf();
                mx = ik_max(mx, s[u]);
            }
            acc_t m_new = ik_max(m[gq], mx);
            acc_t base = (m_new == neg_inf()) ? (acc_t)0 : m_new;
            acc_t alpha = ik_exp2(m[gq] - base);
            l[gq] *= alpha;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[gq][e] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                acc_t p = ik_exp2(s[u] - base);
                l[gq] += p;
#if KV_QUANT
                const acc_t pv = p * vs[u];         // p (s_V c) = (p s_V) c
#else
                const acc_t pv = p;
#endif
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[gq][e] += pv * elem(vr[u], e);
            }
            m[gq] = m_new;
        }
    }

    // merge the slots of a warp (lanes with the same `sub`), then the warps, through SRAM
#pragma unroll
    for (int off = LANES; off < 32; off *= 2) {
#pragma unroll
        for (int gq = 0; gq < GROUP; ++gq) {
            acc_t mo = shfl_xor(m[gq], off), lo = shfl_xor(l[gq], off);
            acc_t mn = ik_max(m[gq], mo);
            acc_t base = (mn == neg_inf()) ? (acc_t)0 : mn;
            acc_t a = ik_exp2(m[gq] - base), c = ik_exp2(mo - base);
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

    const long long row = (long long)b * heads_q + hk * GROUP;   // first query head's row
#pragma unroll 1
    for (int gq = 0; gq < GROUP; ++gq) {
        acc_t M = neg_inf();
        for (int w = 0; w < NUM_WARPS; ++w) M = ik_max(M, red_m[w][gq]);
        acc_t base = (M == neg_inf()) ? (acc_t)0 : M;
        if (lane < LANES) {
            acc_t f = ik_exp2(m[gq] - base);
#pragma unroll
            for (int e = 0; e < EPL; ++e) red_o[warp][lane * EPL + e] = acc[gq][e] * f;
        }
        __syncthreads();
        acc_t L = 0;
        for (int w = 0; w < NUM_WARPS; ++w) L += red_l[w][gq] * ik_exp2(red_m[w][gq] - base);
        const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
        const acc_t lse = L > 0 ? (M + ik_log2(L)) * (acc_t)0.6931471805599453 : neg_inf();
        // write this chunk's O (normalised) and LSE -> HBM
        for (int i = threadIdx.x; i < LANES * EPL; i += NTHREADS) {
            int sb = i / EPL, e = i % EPL;
            int c = elem_index(sb, e);
            if (c >= HEAD_DIM) continue;
            acc_t sum = 0;
            for (int w = 0; w < NUM_WARPS; ++w) sum += red_o[w][i];
            if (num_splits == 1) O[(row + gq) * HEAD_DIM + c] = from_acc(sum * inv);
            else O_part[((long long)split * gridDim.z * heads_q + row + gq) * HEAD_DIM + c] = sum * inv;
        }
        if (threadIdx.x == 0) {
            if (num_splits == 1) LSE[row + gq] = lse;
            else LSE_part[(long long)split * gridDim.z * heads_q + row + gq] = lse;
        }
        __syncthreads();                            // red_o is reused by the next head
    }
}

// O = sum_s exp(LSE_s - LSE) O_s ; LSE = log sum_s exp(LSE_s)   (one block a query row)
extern "C" __global__ void decode_combine(const acc_t* __restrict__ O_part, const acc_t* __restrict__ LSE_part,
                                          int num_splits, int rows, elem_t* __restrict__ O,
                                          acc_t* __restrict__ LSE) {
    const int row = blockIdx.x;
    acc_t M = neg_inf();
    for (int s = 0; s < num_splits; ++s) M = ik_max(M, LSE_part[(long long)s * rows + row]);
    const acc_t base = (M == neg_inf()) ? (acc_t)0 : M;
    acc_t L = 0;
    for (int s = 0; s < num_splits; ++s) L += ik_exp(LSE_part[(long long)s * rows + row] - base);
    const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
    for (int c = threadIdx.x; c < HEAD_DIM; c += blockDim.x) {
        acc_t sum = 0;
        for (int s = 0; s < num_splits; ++s) {
            acc_t w = ik_exp(LSE_part[(long long)s * rows + row] - base);
            sum += w * O_part[((long long)s * rows + row) * HEAD_DIM + c];
        }
        O[(long long)row * HEAD_DIM + c] = from_acc(sum * inv);
    }
    if (threadIdx.x == 0) LSE[row] = L > 0 ? M + ik_log(L) : neg_inf();
}
