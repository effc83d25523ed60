// decode_common.cuh -- the end of a split-KV decode block: write its partial, and the fused
// combine (decode_v3.cu and decode_v4.cu; decode_v2.cu, unfused, only the write).
//
// Notation: S = num_splits, g = GROUP query heads of one KV head, O_s / LSE_s the
// normalised partial output of split s and its log-sum-exp.  The including kernel defines
// HEAD_DIM, GROUP, NUM_WARPS, NTHREADS and FUSED, and has merged its warps' states into
// red_m / red_l (each warp's running max, log2 units, and sum a head) and red_o (each
// warp's O rows, already rescaled to the block's max) before calling decode_finish.
//
// The fused combine: each split block writes (O_s, LSE_s), `__threadfence()` (visible
// device-wide), one atomicAdd on the counter of its (batch, kv head); the block that brings
// it to S is the last of its group: every partial is in L2 by then, so it reads them with
// ld.global.cg (skipping its own L1, where a stale line could sit), merges
// O = sum_s exp(LSE_s - LSE) O_s, LSE = log sum_s exp(LSE_s), and sets the counter back to
// 0 for the next call (the launcher keeps one zeroed workspace per device and stream).
#pragma once
#include "common.cuh"

// a load that goes to L2 (skips this SM's L1): partials other blocks wrote this launch
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ double ld_cg(const double* p) {
    double v;
    asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(v) : "l"(p));
    return v;
}

// write this split's O_s (normalised) and LSE_s -> HBM (the final O, LSE when S == 1);
// then, FUSED, the last block of the (batch, kv head) merges the S partials -> HBM.
// `scratch`: dynamic SRAM the block no longer needs (at least GROUP * S acc_t).
__device__ __forceinline__ void decode_finish(const acc_t (*red_m)[GROUP], const acc_t (*red_l)[GROUP],
                                              const acc_t* red_o, acc_t* scratch,
                                              int split, int b, int hk, int heads_q, int heads_kv,
                                              int num_splits, acc_t* __restrict__ O_part,
                                              acc_t* __restrict__ LSE_part, int* __restrict__ counters,
                                              elem_t* __restrict__ O, acc_t* __restrict__ LSE) {
    const long long row = (long long)b * heads_q + hk * GROUP;   // first query head's row
    const long long rows = (long long)gridDim.z * heads_q;       // batch * heads_q
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
        if (num_splits == 1) O[(row + gq) * HEAD_DIM + c] = from_acc(sum * inv);
        else O_part[((long long)split * rows + row + gq) * HEAD_DIM + c] = sum * inv;
        if (c == 0) {
            const acc_t lse = L > 0 ? (M + ik_log2(L)) * (acc_t)0.6931471805599453 : neg_inf();
            if (num_splits == 1) LSE[row + gq] = lse;
            else LSE_part[(long long)split * rows + row + gq] = lse;
        }
    }
#if FUSED
    __shared__ int is_last;
    __shared__ acc_t lse_out[GROUP];
    if (num_splits == 1) return;
    // ---- the fused combine: the last split block of this (batch, kv head) merges them all
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __threadfence();                                // this block's partial -> visible to all
    __syncthreads();                                // every thread's writes fenced
    if (threadIdx.x == 0) {
        const int arrived = atomicAdd(counters + b * heads_kv + hk, 1);
        is_last = arrived == num_splits - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();                                // order: the count before the partials' reads

    // weights w_s = exp(LSE_s - LSE) for each head -> SRAM; warp w takes heads w,
    // w + NUM_WARPS, ...; its lanes take splits lane, lane + 32, ...
    acc_t* wts = scratch;                                          // [GROUP][num_splits]
    for (int gq = warp; gq < GROUP; gq += NUM_WARPS) {
        acc_t M = neg_inf();
        for (int s = lane; s < num_splits; s += 32) {             // read LSE_s <- L2
            const acc_t x = ld_cg(LSE_part + (long long)s * rows + row + gq);
            wts[gq * num_splits + s] = x;
            M = ik_max(M, x);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) M = ik_max(M, shfl_xor(M, off));
        const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
        acc_t L = 0;
        for (int s = lane; s < num_splits; s += 32) {
            const acc_t w = ik_exp(wts[gq * num_splits + s] - bs);   // exp(-inf) = 0: an empty split
            wts[gq * num_splits + s] = w;
            L += w;
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) L += shfl_xor(L, off);
        const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
        for (int s = lane; s < num_splits; s += 32) wts[gq * num_splits + s] *= inv;
        if (lane == 0) lse_out[gq] = L > 0 ? M + ik_log(L) : neg_inf();
    }
    __syncthreads();
    // read O_s <- L2, write O = sum_s w_s O_s and LSE -> HBM (independent loads, unrolled)
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {
        const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
        const acc_t* w = wts + gq * num_splits;
        const acc_t* src = O_part + (row + gq) * HEAD_DIM + c;
        const long long step = rows * HEAD_DIM;
        acc_t sum = 0;
#pragma unroll 8
        for (int s = 0; s < num_splits; ++s) sum += w[s] * ld_cg(src + s * step);
        O[(row + gq) * HEAD_DIM + c] = from_acc(sum);
        if (c == 0) LSE[row + gq] = lse_out[gq];
    }
    if (threadIdx.x == 0) counters[b * heads_kv + hk] = 0;   // ready for the next call
#endif
}
