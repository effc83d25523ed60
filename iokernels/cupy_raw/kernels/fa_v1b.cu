// fa_v1b.cu -- FlashAttention forward, version 1b: float32 on the CUDA cores, K_j / V_j
// arriving with cp.async while the previous product is computed.
//
// The float32 default on compute capability 8.0+.
//
// What changed against fa_v1.cu, and why.  v1's tile loads are synchronous and poorly
// shaped: K_j is stored transposed, so neighbouring lanes read neighbouring *rows*
// of HBM (4 useful bytes of each 32-byte sector), and the whole block then waits at a
// barrier for the slowest load, every tile, with nothing else to do.  Here:
//   * every SRAM tile keeps the row layout of HBM, so a tile is copied as 16-byte chunks,
//     coalesced, with cp.async (sm_80+), which needs no registers while it flies;
//   * K_j and V_j are separate stages of one pipeline: K_j+1 is copied while O += P_ij V_j
//     runs, V_j+1 while S_j+1 = Q_i K_j+1^T runs.  Each load hides behind one product, and
//     SRAM holds ONE K tile and ONE V tile (plain double buffering of both would need
//     Q + 2K + 2V + P = 179 KB at Br = Bc = 64, d = 128: one block an SM; this needs 112 KB,
//     two blocks an SM, and Bc = 32 needs 72 KB);
//   * K_j in row layout would put the 8 lanes of a quarter-warp (8 different key rows, the
//     same column) in one bank group; an XOR swizzle of the 16-byte chunks (chunk c of row
//     r is stored at c ^ (r & 7)) spreads them over all 32 banks without padding;
//   * a thread owns keys tx, tx + 16, tx + 32, ... of S_ij (v1: tx*RN ... tx*RN+RN-1), so
//     those 8 lanes read 8 consecutive rows;
//   * exp2 with scale * log2(e) folded into the scores (one multiply fewer a score); LSE is
//     converted back to natural log at the end.
// Unchanged: 256 threads as 16 x 16, RM x RN scores a thread, the online softmax with
// half-warp shuffles, P_ij handed to the P V product through SRAM (transposed), O_i in
// registers, causal / window tile skipping, GQA, bottom-right masks, LSE convention.
// float32 only: cp.async copies stored bytes, so a 16-bit tile would land 16-bit in SRAM
// (v1 converts as it loads; v2 is the kernel for 16-bit inputs).
//
// Pipeline (one cp.async group per stage; "wait<n>": at most n of this thread's groups in flight):
//   prologue: group {Q_i, K_j0}, group {V_j0}
//   loop j:   wait<1>, sync (A)       K_j has landed (V_j may still fly)
//             S_ij = Q_i K_j^T, online softmax, P_ij -> SRAM
//             wait<0>, sync (B)       V_j and P_ij are visible; nobody reads K_j any more
//             issue K_j+1 (group)     -> overlaps the P V product below
//             O_i += P_ij V_j
//             sync (C)                nobody reads V_j or P_ij any more
//             issue V_j+1 (group)     -> overlaps S_j+1 of the next iteration
//
// SRAM (floats): Qs [Br][DQ] (row layout), Ks [Bc][DK] (row layout, swizzled),
// Vs [Bc][DV] (row layout, zero columns past HEAD_DIM), PsT [Bc][Br] (P transposed, its
// 16-byte chunks swizzled like K's: a warp's P stores are at most 4-way bank conflicts,
// 16-way without the swizzle, as in v1).
// Compile-time settings (-D from ForwardConfig): HEAD_DIM, RM, RN, VEC_IO (1: rows are whole
// 16-byte chunks at 16-byte aligned addresses; 0: synchronous element loads, same layout).
#include "common.cuh"

#if IK_DTYPE != IK_F32
#error "fa_v1b is the float32 kernel (cp.async copies stored bytes): IK_DTYPE must be 0 (use fa_v1 or fa_v2)"
#endif

#ifndef HEAD_DIM
#error "fa_v1b.cu: -DHEAD_DIM is missing (ForwardConfig.defines passes it)"
#endif
#ifndef RM
#error "fa_v1b.cu: -DRM is missing (ForwardConfig.defines passes it)"
#endif
#ifndef RN
#error "fa_v1b.cu: -DRN is missing (ForwardConfig.defines passes it)"
#endif
#ifndef VEC_IO
#error "fa_v1b.cu: -DVEC_IO is missing (ForwardConfig.defines passes it)"
#endif
// blocks an SM the register budget must allow (two at Br = Bc = 64, d = 128: 112 KB each)
#ifndef V1B_MIN_BLOCKS
#error "fa_v1b.cu: -DV1B_MIN_BLOCKS is missing (ForwardConfig.defines passes it)"
#endif

#define TX 16
#define TY 16
#define NTHREADS (TX * TY)
#define BR (TY * RM)                               // Br: query rows per block
#define BC (TX * RN)                               // Bc: key rows per tile
#define DQ ((HEAD_DIM + 3) / 4 * 4)                // Q row in SRAM: whole 16-byte chunks
#define DK ((HEAD_DIM + 31) / 32 * 32)             // K row: a multiple of 8 chunks (the swizzle stays in the row)
#define DV (64 * ((HEAD_DIM + 63) / 64))           // V row = O columns (4 a thread x 16, as in v1)
#define OC (DV / 64)                               // float4 column groups of O a thread owns
#define QCH (DQ / 4)                               // 16-byte chunks of a row that hold data (or zeros)

// physical float offset of K_j element (r, c) in SRAM: chunk c/4 of row r at (c/4) ^ (r & 7)
__device__ __forceinline__ int k_off(int r, int c) {
    return r * DK + ((((c >> 2) ^ (r & 7))) << 2) + (c & 3);
}
// P_ij^T element (key r, query row c): the same kind of swizzle, inside the Br columns of a
// row (without it the 16 lanes tx, which write 16 key rows of one column, hit one bank:
// 16-way conflicts; with it at most 4-way)
#define P_MASK ((BR / 4) >= 8 ? 7 : (BR / 4) - 1)
__device__ __forceinline__ int p_off(int r, int c) {
    return r * BR + ((((c >> 2) ^ (r & P_MASK))) << 2) + (c & 3);
}

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// rows [row0, row0 + ROWS) of a (seq, HEAD_DIM) matrix with row stride ld -> SRAM rows of
// `stride` floats, chunks [0, nch); rows at or past nrows and columns past HEAD_DIM: zeros.
// SWZ: K's chunk swizzle.
template <int ROWS, int NCH, bool SWZ>
__device__ __forceinline__ void load_tile(float* dst, int stride, const float* src, long long ld, int row0, int nrows) {
#if VEC_IO
    for (int idx = threadIdx.x; idx < ROWS * NCH; idx += NTHREADS) {
        const int r = idx / NCH, ch = idx % NCH;
        const bool ok = (row0 + r < nrows) && (ch * 4 < HEAD_DIM);
        const int pch = SWZ ? (ch ^ (r & 7)) : ch;
        cp_async16(dst + r * stride + pch * 4, ok ? src + (row0 + r) * ld + ch * 4 : src, ok);
    }
#else
    // a row is not a whole number of 16-byte chunks (or not aligned): element by element, synchronous
    for (int idx = threadIdx.x; idx < ROWS * NCH * 4; idx += NTHREADS) {
        const int r = idx / (NCH * 4), c = idx % (NCH * 4);
        const float x = (row0 + r < nrows && c < HEAD_DIM) ? src[(row0 + r) * ld + c] : 0.f;
        dst[SWZ ? k_off(r, c) : r * stride + c] = x;
    }
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, V1B_MIN_BLOCKS)
fa_v1b(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
       float* __restrict__ O, float* __restrict__ LSE,
       int nq, int nk, int heads_q, int heads_kv,
       long long sqb, long long sqh, long long sqn,     // strides of Q (elements; head_dim is 1)
       long long skb, long long skh, long long skn,     // strides of K
       long long svb, long long svh, long long svn,     // strides of V
       float scale, int win_left, int win_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* Qs = reinterpret_cast<float*>(smem_raw);
    float* Ks = Qs + BR * DQ;
    float* Vs = Ks + BC * DK;
    float* PsT = Vs + BC * DV;

    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    const int qtile = gridDim.x - 1 - blockIdx.x;  // heaviest causal tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (heads_q / heads_kv);       // GQA: query head h reads kv head hk
    const int q0 = qtile * BR;
    const float* Qb = Q + b * sqb + h * sqh;
    const float* Kb = K + b * skb + hk * skh;
    const float* Vb = V + b * svb + hk * svh;

    // the key tiles this query tile can see (tile skipping for causal / window)
    const int last_row = min(q0 + BR, nq) - 1;
    const int kv_lo = key_lo(q0, nq, nk, win_left);
    const int kv_hi = max(key_hi(last_row, nq, nk, win_right), kv_lo);
    const int j_begin = kv_lo / BC, j_end = (kv_hi + BC - 1) / BC;

    // load Q_i, K_j0 -> SRAM (group 1), V_j0 -> SRAM (group 2); rows past nq / nk are zeros
    load_tile<BR, QCH, false>(Qs, DQ, Qb, sqn, q0, nq);
    if (j_begin < j_end) load_tile<BC, QCH, true>(Ks, DK, Kb, skn, j_begin * BC, nk);
    cp_async_commit();
    if (j_begin < j_end) load_tile<BC, DV / 4, false>(Vs, DV, Vb, svn, j_begin * BC, nk);
    cp_async_commit();

    // per-row state in registers: m (running max, log2 units), l (running sum), O accumulator
    const float scale_log2 = scale * 1.4426950408889634f;
    float m[RM], l[RM], o[RM][OC][4];
    int row_lo[RM], row_hi[RM];
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        m[i] = neg_inf_f(); l[i] = 0.f;
        const int r = q0 + ty * RM + i;
        row_lo[i] = key_lo(r, nq, nk, win_left);
        row_hi[i] = key_hi(r, nq, nk, win_right);
#pragma unroll
        for (int c = 0; c < OC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][c][e] = 0.f;
    }

    for (int j = j_begin; j < j_end; ++j) {            // loop over K_j, V_j tiles
        const int k0 = j * BC;
        cp_async_wait<1>();                            // (Q_i and) K_j have landed
        __syncthreads();                               // (A) ... for every thread

        // S_ij = Q_i K_j^T  (registers; RM rows x RN keys a thread: keys tx + 16 jj)
        float s[RM][RN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[i][jj] = 0.f;
#pragma unroll 2
        for (int kc = 0; kc < QCH; ++kc) {             // 4 columns of head_dim at a time
            float4 a[RM];
#pragma unroll
            for (int i = 0; i < RM; ++i) a[i] = lds4(&Qs[(ty * RM + i) * DQ + kc * 4]);   // broadcast
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int r = tx + TX * jj;
                const float4 bk = lds4(&Ks[r * DK + ((kc ^ (r & 7)) << 2)]);   // swizzled: no conflicts
#pragma unroll
                for (int i = 0; i < RM; ++i)
                    s[i][jj] += a[i].x * bk.x + a[i].y * bk.y + a[i].z * bk.z + a[i].w * bk.w;
            }
        }

        // online softmax, in registers: scale (log2 units), mask, new max, rescale, P_ij -> SRAM
        // (PsT is free: sync (C) of the previous iteration)
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            float mx = neg_inf_f();
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int col = k0 + tx + TX * jj;
                const bool visible = col >= row_lo[i] && col < row_hi[i];
                s[i][jj] = visible ? s[i][jj] * scale_log2 : neg_inf_f();
                mx = fmaxf(mx, s[i][jj]);
            }
#pragma unroll
            for (int off = TX / 2; off > 0; off /= 2)  // the row's 16 owners: one half-warp
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[i], mx);
            const float base = (m_new == neg_inf_f()) ? 0.f : m_new;   // all masked so far: exp2(-inf) = 0
            const float alpha = exp2f(m[i] - base);
            float rs = 0.f;
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const float p = exp2f(s[i][jj] - base);
                rs += p;
                PsT[p_off(tx + TX * jj, ty * RM + i)] = p;
            }
#pragma unroll
            for (int off = TX / 2; off > 0; off /= 2)
                rs += __shfl_xor_sync(0xffffffffu, rs, off);
            l[i] = l[i] * alpha + rs;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < OC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[i][c][e] *= alpha;
        }
        cp_async_wait<0>();                            // V_j has landed
        __syncthreads();                               // (B) V_j, P_ij visible; K_j no longer read

        // load K_j+1 -> SRAM while the P V product runs
        if (j + 1 < j_end) load_tile<BC, QCH, true>(Ks, DK, Kb, skn, k0 + BC, nk);
        cp_async_commit();

        // O_i += P_ij V_j  (P from SRAM, V_j from SRAM, O in registers)
#pragma unroll 4
        for (int jj = 0; jj < BC; ++jj) {
            float p[RM];
#if RM == 4
            const float4 p4 = lds4(&PsT[p_off(jj, ty * 4)]);   // this thread's 4 rows: one chunk
            p[0] = p4.x; p[1] = p4.y; p[2] = p4.z; p[3] = p4.w;
#else
#pragma unroll
            for (int i = 0; i < RM; ++i) p[i] = PsT[p_off(jj, ty * RM + i)];
#endif
#pragma unroll
            for (int c = 0; c < OC; ++c) {
                const float4 vv = lds4(&Vs[jj * DV + c * 64 + tx * 4]);
#pragma unroll
                for (int i = 0; i < RM; ++i) {
                    o[i][c][0] += p[i] * vv.x; o[i][c][1] += p[i] * vv.y;
                    o[i][c][2] += p[i] * vv.z; o[i][c][3] += p[i] * vv.w;
                }
            }
        }
        __syncthreads();                               // (C) nobody reads V_j or P_ij any more

        // load V_j+1 -> SRAM while the next S product runs
        if (j + 1 < j_end) load_tile<BC, DV / 4, false>(Vs, DV, Vb, svn, k0 + BC, nk);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // write O_i, LSE_i -> HBM (O = acc / l; a fully masked row: O = 0, LSE = -inf)
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const int r = q0 + ty * RM + i;
        if (r >= nq) continue;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        float* Orow = O + (((long long)b * heads_q + h) * nq + r) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < OC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = c * 64 + tx * 4 + e;
                if (col < HEAD_DIM) Orow[col] = o[i][c][e] * inv;
            }
        if (tx == 0)
            LSE[((long long)b * heads_q + h) * nq + r] =
                l[i] > 0.f ? (m[i] + log2f(l[i])) * 0.6931471805599453f : neg_inf_f();
    }
}
