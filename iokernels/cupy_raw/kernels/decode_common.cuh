// decode_common.cuh -- the end of a split-KV decode block: write its partial, and the fused
// combine (decode_v3.cu to decode_v6.cu; decode_v2.cu, unfused, only the write).
//
// Notation: S = num_splits, g = GROUP query heads of one KV head, O_s / LSE_s the
// normalised partial output of split s and its log-sum-exp.  The including kernel defines
// HEAD_DIM, GROUP, NUM_WARPS, NTHREADS and FUSED, and has merged its warps' states into
// red_m / red_l (each warp's running max, log2 units, and sum a head) and red_o (each
// warp's O rows, already rescaled to the block's max) before calling decode_finish.
//
// The fused combine: each split block writes (O_s, LSE_s), then one thread adds 1 to the
// counter of its (batch, kv head) with an acquire-release atomic after a block barrier (the
// release publishes every thread's partial device-wide, the acquire makes the others'
// visible to the block that reads them: one round trip to L2, not a fence on either side);
// the block that brings the counter to S is the last of its group: every partial is in L2
// by then, so it reads them with ld.global.cg (skipping its own L1, where a stale line could
// sit), merges O = sum_s exp(LSE_s - LSE) O_s, LSE = log sum_s exp(LSE_s), and sets the
// counter back to 0 for the next call (the launcher keeps one zeroed workspace per device
// and stream).  Up to COMBINE_REG_SPLITS splits a thread loads its column's S pairs
// (LSE_s, O_s) at once into registers and merges them there: the last block's tail is then
// one more round trip, where the general path reads the LSEs, then the O rows.
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
// counter += 1 at GPU scope, acquire-release (sm_70+): returns the old count
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
// COMBINE_REG_SPLITS: splits the register merge takes at once (DecodeConfig.defines passes it)
// DECODE_MERGE_ROWS: the rows of red_m / red_l / red_o, each a state over the whole group:
// one a warp (decode_v3.cu, decode_v4.cu), one a team of warps (decode_v6.cu defines it)
#ifndef DECODE_MERGE_ROWS
#define DECODE_MERGE_ROWS NUM_WARPS
#endif
#if FUSED && !defined(COMBINE_REG_SPLITS)
#error "decode_common.cuh: -DCOMBINE_REG_SPLITS is missing (DecodeConfig.defines passes it)"
#endif

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
        for (int w = 0; w < DECODE_MERGE_ROWS; ++w) M = ik_max(M, red_m[w][gq]);
        const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
        acc_t L = 0, sum = 0;
        for (int w = 0; w < DECODE_MERGE_ROWS; ++w) {
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
    __syncthreads();                                // every thread's partial written ...
    if (threadIdx.x == 0) {                         // ... released with the count, and the
        const int arrived = atom_add_acq_rel(counters + b * heads_kv + hk, 1);   // others' acquired
        is_last = arrived == num_splits - 1;
    }
    __syncthreads();
    if (!is_last) return;

    if (num_splits <= COMBINE_REG_SPLITS) {
        // read (LSE_s, O_s) of a column for every split at once <- L2, merge in registers,
        // write O and LSE -> HBM
        const long long step = rows * HEAD_DIM;
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NTHREADS) {
            const int gq = i / HEAD_DIM, c = i % HEAD_DIM;
            acc_t x[COMBINE_REG_SPLITS], y[COMBINE_REG_SPLITS];
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) {
                x[s] = s < num_splits ? ld_cg(LSE_part + (long long)s * rows + row + gq) : neg_inf();
                y[s] = s < num_splits ? ld_cg(O_part + s * step + (row + gq) * HEAD_DIM + c) : (acc_t)0;
            }
            acc_t M = neg_inf();
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) M = ik_max(M, x[s]);
            const acc_t bs = (M == neg_inf()) ? (acc_t)0 : M;
            acc_t L = 0, sum = 0;
#pragma unroll
            for (int s = 0; s < COMBINE_REG_SPLITS; ++s) {
                const acc_t w = ik_exp(x[s] - bs);   // exp(-inf) = 0: an empty split, or s >= S
                L += w;
                sum += w * y[s];
            }
            O[(row + gq) * HEAD_DIM + c] = from_acc(L > 0 ? sum / L : (acc_t)0);
            if (c == 0) LSE[row + gq] = L > 0 ? M + ik_log(L) : neg_inf();
        }
        if (threadIdx.x == 0) counters[b * heads_kv + hk] = 0;   // ready for the next call
        return;
    }

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
