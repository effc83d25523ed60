// fa_v1.cu -- FlashAttention forward, version 1: CUDA cores, shared-memory tiles.
//
// The same algorithm as the NumPy tiled kernel (iokernels/tiled.py, FlashAttention-2 loop
// order) and the Numba kernel: one thread block owns one query tile Q_i (Br rows) of one
// (batch, head), walks the key/value tiles K_j, V_j (Bc rows each) through shared memory,
// and keeps the online-softmax state (m, l) and the output accumulator O_i in registers.
// O_i and LSE_i are written to HBM once, at the end.
//
// Threads: 256 = TY (16) x TX (16).  Thread (ty, tx) owns RM = Br/16 query rows
// (ty*RM ... ty*RM+RM-1) and, for S_ij, RN = Bc/16 keys (tx*RN ...), for O_i the
// columns {tx*4 + 64*c + e}.  A row's 16 owners are 16 neighbouring lanes of one warp,
// so its max and sum are reduced with warp shuffles, never through SRAM.
//
// SRAM layout (acc_t = float, double for float64 inputs):
//   QsT [D][Br]   Q_i transposed: for one k, a thread's RM query values are contiguous
//   KsT [D][Bc]   K_j transposed: the same for its RN keys
//   Vs  [Bc][DV]  V_j as stored (DV = 64 * ceil(D/64): padded with zeros)
//   PsT [Bc][Br]  P_ij transposed, handed from the softmax to the P V product
// The transposes make every inner-loop SRAM read a vector read (float4 / float2).
//
// Compile-time settings (-D from ForwardConfig): HEAD_DIM, RM, RN, IK_DTYPE.
// What limits it: the tile loads are synchronous (the block waits for memory every tile,
// with nothing else to do) and the tiles' SRAM leaves room for few blocks an SM to hide
// that wait; fa_v1b.cu overlaps the loads with the products.
#include "common.cuh"

#ifndef HEAD_DIM
#error "fa_v1.cu: -DHEAD_DIM is missing (ForwardConfig.defines passes it)"
#endif
#ifndef RM
#error "fa_v1.cu: -DRM is missing (ForwardConfig.defines passes it)"
#endif
#ifndef RN
#error "fa_v1.cu: -DRN is missing (ForwardConfig.defines passes it)"
#endif

#define TX 16
#define TY 16
#define NTHREADS (TX * TY)
#define BR (TY * RM)                               // Br: query rows per block
#define BC (TX * RN)                               // Bc: key rows per tile
#define DV (64 * ((HEAD_DIM + 63) / 64))           // V / O columns, padded to 4 per thread x 16
#define OC (DV / 64)                               // float4 column groups per thread

// Read N consecutive acc_t from SRAM into registers (one vector load when it fits).
template <int N>
__device__ __forceinline__ void lds(acc_t* r, const acc_t* p) {
#pragma unroll
    for (int e = 0; e < N; ++e) r[e] = p[e];
}
#if IK_DTYPE != IK_F64
template <>
__device__ __forceinline__ void lds<4>(acc_t* r, const acc_t* p) {
    float4 v = *reinterpret_cast<const float4*>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
template <>
__device__ __forceinline__ void lds<2>(acc_t* r, const acc_t* p) {
    float2 v = *reinterpret_cast<const float2*>(p);
    r[0] = v.x; r[1] = v.y;
}
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS)
fa_v1(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
      elem_t* __restrict__ O, acc_t* __restrict__ LSE,
      int nq, int nk, int heads_q, int heads_kv,
      long long sqb, long long sqh, long long sqn,     // strides of Q (elements; head_dim is 1)
      long long skb, long long skh, long long skn,     // strides of K
      long long svb, long long svh, long long svn,     // strides of V
      acc_t scale, int win_left, int win_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    acc_t* QsT = reinterpret_cast<acc_t*>(smem_raw);
    acc_t* KsT = QsT + HEAD_DIM * BR;
    acc_t* Vs = KsT + HEAD_DIM * BC;
    acc_t* PsT = Vs + BC * DV;

    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    const int qtile = gridDim.x - 1 - blockIdx.x;  // heaviest causal tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (heads_q / heads_kv);       // GQA: query head h reads kv head hk
    const int q0 = qtile * BR;
    const elem_t* Qb = Q + b * sqb + h * sqh;
    const elem_t* Kb = K + b * skb + hk * skh;
    const elem_t* Vb = V + b * svb + hk * svh;

    // load Q_i -> SRAM (transposed; rows past nq are zeros)
    for (int idx = tid; idx < BR * HEAD_DIM; idx += NTHREADS) {
        int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        QsT[c * BR + r] = (q0 + r < nq) ? to_acc(Qb[(q0 + r) * sqn + c]) : (acc_t)0;
    }

    // the key tiles this query tile can see (tile skipping for causal / window)
    const int last_row = min(q0 + BR, nq) - 1;
    const int kv_lo = key_lo(q0, nq, nk, win_left);
    const int kv_hi = max(key_hi(last_row, nq, nk, win_right), kv_lo);
    const int j_begin = kv_lo / BC, j_end = (kv_hi + BC - 1) / BC;

    // per-row state in registers: m (running max), l (running sum), O accumulator
    acc_t m[RM], l[RM], o[RM][OC][4];
    int row_lo[RM], row_hi[RM];
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        m[i] = neg_inf(); l[i] = 0;
        int r = q0 + ty * RM + i;
        row_lo[i] = key_lo(r, nq, nk, win_left);
        row_hi[i] = key_hi(r, nq, nk, win_right);
#pragma unroll
        for (int c = 0; c < OC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][c][e] = 0;
    }

    for (int j = j_begin; j < j_end; ++j) {            // loop over K_j, V_j tiles
        const int k0 = j * BC;
        __syncthreads();                               // previous tile fully consumed
        // load K_j, V_j -> SRAM (rows past nk are zeros: 0 * P stays 0, never NaN)
        for (int idx = tid; idx < BC * HEAD_DIM; idx += NTHREADS) {
            int r = idx % BC, c = idx / BC;            // lanes walk rows: conflict-free KsT stores
            KsT[c * BC + r] = (k0 + r < nk) ? to_acc(Kb[(k0 + r) * skn + c]) : (acc_t)0;
        }
        for (int idx = tid; idx < BC * DV; idx += NTHREADS) {
            int r = idx / DV, c = idx % DV;
            Vs[r * DV + c] = (k0 + r < nk && c < HEAD_DIM) ? to_acc(Vb[(k0 + r) * svn + c]) : (acc_t)0;
        }
        __syncthreads();

        // S_ij = Q_i K_j^T  (registers; RM x RN per thread)
        acc_t s[RM][RN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[i][jj] = 0;
#pragma unroll 8
        for (int kk = 0; kk < HEAD_DIM; ++kk) {
            acc_t a[RM], bk[RN];
            lds<RM>(a, &QsT[kk * BR + ty * RM]);
            lds<RN>(bk, &KsT[kk * BC + tx * RN]);
#pragma unroll
            for (int i = 0; i < RM; ++i)
#pragma unroll
                for (int jj = 0; jj < RN; ++jj) s[i][jj] += a[i] * bk[jj];
        }

        // online softmax, in registers: scale, mask, new max, rescale, P_ij -> SRAM
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            acc_t mx = neg_inf();
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                int col = k0 + tx * RN + jj;
                bool visible = col >= row_lo[i] && col < row_hi[i];
                s[i][jj] = visible ? s[i][jj] * scale : neg_inf();
                mx = ik_max(mx, s[i][jj]);
            }
#pragma unroll
            for (int off = TX / 2; off > 0; off /= 2)  // the row's 16 owners: one half-warp
                mx = ik_max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            acc_t m_new = ik_max(m[i], mx);
            acc_t base = (m_new == neg_inf()) ? (acc_t)0 : m_new;  // all masked so far: exp(-inf) = 0
            acc_t alpha = ik_exp(m[i] - base);
            acc_t rs = 0;
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                acc_t p = ik_exp(s[i][jj] - base);
                rs += p;
                PsT[(tx * RN + jj) * BR + ty * RM + i] = p;
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
        __syncthreads();

        // O_i += P_ij V_j  (P from SRAM, V_j from SRAM, O in registers)
#pragma unroll 4
        for (int jj = 0; jj < BC; ++jj) {
            acc_t p[RM];
            lds<RM>(p, &PsT[jj * BR + ty * RM]);
#pragma unroll
            for (int c = 0; c < OC; ++c) {
                acc_t vv[4];
                lds<4>(vv, &Vs[jj * DV + c * 64 + tx * 4]);
#pragma unroll
                for (int i = 0; i < RM; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[i][c][e] += p[i] * vv[e];
            }
        }
    }

    // write O_i, LSE_i -> HBM (O = acc / l; a fully masked row: O = 0, LSE = -inf)
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        int r = q0 + ty * RM + i;
        if (r >= nq) continue;
        acc_t inv = l[i] > 0 ? (acc_t)1 / l[i] : (acc_t)0;
        elem_t* Orow = O + (((long long)b * heads_q + h) * nq + r) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < OC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = c * 64 + tx * 4 + e;
                if (col < HEAD_DIM) Orow[col] = from_acc(o[i][c][e] * inv);
            }
        if (tx == 0)
            LSE[((long long)b * heads_q + h) * nq + r] = l[i] > 0 ? m[i] + ik_log(l[i]) : neg_inf();
    }
}
