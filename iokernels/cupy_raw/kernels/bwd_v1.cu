// bwd_v1.cu -- FlashAttention-2 backward, version 1: CUDA cores.
//
// The same algorithm as the NumPy tiled backward (iokernels/backward.py) and the Numba
// kernel (iokernels/numba_cuda/backward.py), FlashAttention-2's Algorithm 2:
//
//   bwd_rowsum   D_i = rowsum(dO_i * O_i)                     one thread per query row
//   bwd_main     one block per (K/V tile j, KV head, sequence): K_j, V_j stay on chip,
//                dK_j, dV_j accumulate in registers over every Q tile i and every query
//                head of the GQA group; S_ij and P_ij are recomputed from the saved LSE
//   bwd_finish   dQ from the float32 (float64) accumulator, in the storage dtype
//
// Per Q tile i, inside bwd_main:
//   load Q_i, dO_i, LSE_i, D_i -> SRAM
//   S_ij = scale Q_i K_j^T,  P_ij = exp(S_ij - LSE_i)     (0 where masked; LSE = -inf: 0)
//   dP_ij = dO_i V_j^T,      dS_ij = P_ij * (dP_ij - D_i)
//   dV_j += P_ij^T dO_i,     dK_j += scale dS_ij^T Q_i    (registers)
//   dQ_i += scale dS_ij K_j                               (-> HBM: atomic adds, or a partial)
//
// Threads: NTHREADS = BC x LPK.  Key row c of the tile belongs to LPK neighbouring lanes of
// one warp; lane l owns the head dims l, l + LPK, l + 2 LPK, ... (DPL of them), so a key's
// dot products are LPK partial sums joined by log2(LPK) warp shuffles, and its dK_c, dV_c
// (2 x DPL values a lane) live in registers.  dQ_i's Br x d products are dealt out to all
// threads, each summing over the tile's BC keys from SRAM.
//
// DETERMINISTIC = 0: dQ_i is added into dQaccum with atomicAdd, as FlashAttention-2 does:
// blocks add in whatever order they arrive, so dQ's last bits can change between runs.
// DETERMINISTIC = 1: each block writes its dS_ij K_j to slot j of a (Tc, ...) buffer and
// bwd_finish adds the slots in tile order: the same bits every run, Tc times the bytes.
//
// Version 1 is plain: every product on CUDA cores (no tensor cores), scores recomputed one
// query row at a time, two warp-shuffle reductions per (row, key).  What limits it: the
// shuffles and the SRAM reads per multiply-add, not HBM.
//
// Compile-time settings (-D from the launcher): HEAD_DIM, BC, BR, LPK, DETERMINISTIC, IK_DTYPE.
#include "common.cuh"

#ifndef HEAD_DIM
#error "bwd_v1.cu: -DHEAD_DIM is missing (BackwardConfig.defines passes it)"
#endif
#ifndef BC
#error "bwd_v1.cu: -DBC is missing (BackwardConfig.defines passes it)"
#endif
#ifndef BR
#error "bwd_v1.cu: -DBR is missing (BackwardConfig.defines passes it)"
#endif
#ifndef LPK
#error "bwd_v1.cu: -DLPK is missing (BackwardConfig.defines passes it)"
#endif
#ifndef DETERMINISTIC
#error "bwd_v1.cu: -DDETERMINISTIC is missing (BackwardConfig.defines passes it)"
#endif

#define NTHREADS (BC * LPK)
#define DPL ((HEAD_DIM + LPK - 1) / LPK)         // head dims per lane
#define ROW_THREADS 128

#if (LPK & (LPK - 1)) != 0 || LPK > 32
#error "LPK must be a power of two <= 32 (a key's lanes sit in one warp)"
#endif
#if NTHREADS > 1024
#error "BC * LPK must be at most 1024 threads"
#endif

__device__ __forceinline__ bool visible(int i, int j, int nq, int nk, int left, int right) {
    int diag = i + nk - nq;                      // bottom-right aligned diagonal
    if (left >= 0 && j < diag - left) return false;
    if (right >= 0 && j > diag + right) return false;
    return true;
}

__device__ __forceinline__ acc_t lane_sum(acc_t x) {
#pragma unroll
    for (int off = LPK / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// ----------------------------------------------------------------------------- kernel 1
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
bwd_rowsum(const elem_t* __restrict__ dO, const elem_t* __restrict__ O, acc_t* __restrict__ Dv,
           int rows, int heads_q, int nq,
           long long sdb, long long sdh, long long sdn, long long sob, long long soh, long long son) {
    int t = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (t >= rows) return;
    int i = t % nq, h = (t / nq) % heads_q, b = t / (nq * heads_q);
    const elem_t* d = dO + b * sdb + h * sdh + (long long)i * sdn;
    const elem_t* o = O + b * sob + h * soh + (long long)i * son;
    acc_t s = 0;
    for (int x = 0; x < HEAD_DIM; ++x) s += to_acc(d[x]) * to_acc(o[x]);   // read dO_i, O_i
    Dv[t] = s;                                                             // write D_i
}

// ----------------------------------------------------------------------------- kernel 2
extern "C" __global__ void __launch_bounds__(NTHREADS)
bwd_main(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
         const elem_t* __restrict__ dO, const acc_t* __restrict__ LSE, const acc_t* __restrict__ Dv,
         elem_t* __restrict__ dK, elem_t* __restrict__ dV, acc_t* __restrict__ dQacc,
         int nq, int nk, int heads_q, int heads_kv,
         long long sqb, long long sqh, long long sqn, long long skb, long long skh, long long skn,
         long long svb, long long svh, long long svn, long long sdb, long long sdh, long long sdn,
         acc_t scale, int win_left, int win_right) {
    __shared__ acc_t Qs[BR][HEAD_DIM];
    __shared__ acc_t dOs[BR][HEAD_DIM];
    __shared__ acc_t Ks[BC][HEAD_DIM];
    __shared__ acc_t dSs[BR][BC + 1];            // +1: rows start in different banks
    __shared__ acc_t Ls[BR];
    __shared__ acc_t Ds[BR];

    const int tid = threadIdx.x, c = tid / LPK, lane = tid % LPK;
    const int j0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z;
    const int g = heads_q / heads_kv;
    const int nk_tile = min(BC, nk - j0);
    const int j = j0 + c;

    // load K_j -> SRAM (the dQ product reads it); this lane's dims of k_c, v_c -> registers
    for (int e = tid; e < BC * HEAD_DIM; e += NTHREADS) {
        int r = e / HEAD_DIM, x = e % HEAD_DIM;
        Ks[r][x] = r < nk_tile ? to_acc(K[b * skb + hk * skh + (long long)(j0 + r) * skn + x]) : acc_t(0);
    }
    acc_t kr[DPL], vr[DPL], dk[DPL], dv[DPL];
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
        int x = lane + LPK * e;
        bool ok = c < nk_tile && x < HEAD_DIM;
        kr[e] = ok ? to_acc(K[b * skb + hk * skh + (long long)j * skn + x]) : acc_t(0);
        vr[e] = ok ? to_acc(V[b * svb + hk * svh + (long long)j * svn + x]) : acc_t(0);
        dk[e] = 0;
        dv[e] = 0;
    }
    // the query rows that can see a key of this tile (the window's diagonal bounds)
    int i_lo = 0, i_hi = nq;
    if (win_right >= 0) i_lo = max(0, j0 - win_right - (nk - nq));
    if (win_left >= 0) i_hi = min(nq, j0 + nk_tile - 1 + win_left - (nk - nq) + 1);
    __syncthreads();

    for (int hh = 0; hh < g; ++hh) {                                // query heads of the group
        const int h = hk * g + hh;
        for (int i0 = (i_lo / BR) * BR; i0 < i_hi; i0 += BR) {       // loop over Q tiles i
            const int nq_tile = min(BR, nq - i0);
            for (int e = tid; e < BR * HEAD_DIM; e += NTHREADS) {    // load Q_i, dO_i -> SRAM
                int r = e / HEAD_DIM, x = e % HEAD_DIM;
                bool ok = r < nq_tile;
                Qs[r][x] = ok ? to_acc(Q[b * sqb + h * sqh + (long long)(i0 + r) * sqn + x]) : acc_t(0);
                dOs[r][x] = ok ? to_acc(dO[b * sdb + h * sdh + (long long)(i0 + r) * sdn + x]) : acc_t(0);
            }
            for (int r = tid; r < BR; r += NTHREADS) {               // load LSE_i, D_i -> SRAM
                long long row = ((long long)b * heads_q + h) * nq + i0 + r;
                Ls[r] = r < nq_tile ? LSE[row] : neg_inf();
                Ds[r] = r < nq_tile ? Dv[row] : acc_t(0);
            }
            __syncthreads();
            for (int r = 0; r < BR; ++r) {                           // one query row at a time
                acc_t s = 0, dp = 0;
#pragma unroll
                for (int e = 0; e < DPL; ++e) {
                    int x = lane + LPK * e;
                    if (x < HEAD_DIM) {
                        s += Qs[r][x] * kr[e];
                        dp += dOs[r][x] * vr[e];
                    }
                }
                s = lane_sum(s);                                     // S_ij (before scale)
                dp = lane_sum(dp);                                   // dP_ij
                acc_t lse = Ls[r];
                bool live = c < nk_tile && r < nq_tile && lse != neg_inf() &&
                            visible(i0 + r, j, nq, nk, win_left, win_right);
                acc_t p = live ? ik_exp(s * scale - lse) : acc_t(0); // P_ij, recomputed
                acc_t ds = p * (dp - Ds[r]);                         // dS_ij
#pragma unroll
                for (int e = 0; e < DPL; ++e) {
                    int x = lane + LPK * e;
                    if (x < HEAD_DIM) {
                        dv[e] += p * dOs[r][x];                      // dV_j += P^T dO
                        dk[e] += ds * Qs[r][x];                      // dK_j += dS^T Q
                    }
                }
                if (lane == 0) dSs[r][c] = ds;
            }
            __syncthreads();
            for (int e = tid; e < BR * HEAD_DIM; e += NTHREADS) {    // dQ_i += scale dS_ij K_j
                int r = e / HEAD_DIM, x = e % HEAD_DIM;
                if (r >= nq_tile) continue;
                acc_t acc = 0;
#pragma unroll 8
                for (int cc = 0; cc < BC; ++cc) acc += dSs[r][cc] * Ks[cc][x];
                long long at = (((long long)b * heads_q + h) * nq + i0 + r) * HEAD_DIM + x;
#if DETERMINISTIC
                long long slot = (long long)blockIdx.x * gridDim.z * heads_q * nq * HEAD_DIM;
                dQacc[slot + at] = acc * scale;                      // write partial -> HBM
#else
                atomicAdd(dQacc + at, acc * scale);                  // add -> HBM
#endif
            }
            __syncthreads();
        }
    }
    if (c < nk_tile) {                                               // write dK_j, dV_j -> HBM, once
        long long row = (((long long)b * heads_kv + hk) * nk + j) * HEAD_DIM;
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
            int x = lane + LPK * e;
            if (x < HEAD_DIM) {
                dK[row + x] = from_acc(dk[e] * scale);
                dV[row + x] = from_acc(dv[e]);
            }
        }
    }
}

// ----------------------------------------------------------------------------- kernel 3
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
bwd_finish(const acc_t* __restrict__ dQacc, elem_t* __restrict__ dQ, long long n, int tiles) {
    long long t = (long long)blockIdx.x * ROW_THREADS + threadIdx.x;
    if (t >= n) return;
#if DETERMINISTIC
    acc_t s = 0;
    for (int jt = 0; jt < tiles; ++jt) s += dQacc[(long long)jt * n + t];   // tile order: same bits
    dQ[t] = from_acc(s);
#else
    dQ[t] = from_acc(dQacc[t]);
#endif
}
