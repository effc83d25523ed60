// decode_combine.cu -- Flash-Decoding's log-sum-exp combine with the splits read side by side.
//
// decode.cu's combine gives each thread one column of a query row and walks the S splits one
// after another, reading each split's LSE again for the maximum, the sum and the weight.  Every
// step waits for the load before it, so the combine's time grows with S although all S partials
// sit in L2 at once: the split kernel's blocks ran side by side, their merge does not.  This
// kernel does decode.cu's arithmetic with the splits read together:
//
//   1. the block's threads read the row's S LSEs, a split a thread, and reduce their maximum
//      M and the sum L = sum_s exp(LSE_s - M) across the block (warp shuffles, then SRAM);
//   2. a chunk of COMBINE_CHUNK splits at a time, the threads write the weights
//      w_s = exp(LSE_s - M) to SRAM, a split a thread;
//   3. each thread sums its columns over the chunk, sum_s w_s O_s[c], COMBINE_UNROLL loads
//      issued before the first is used (the rows of one split are side by side, so a warp's
//      loads are whole lines).
//
//   O = sum / L and LSE = M + log L, as decode.cu's combine: exact, and a split whose LSE is
//   -inf (no keys) weighs nothing, whatever its partial holds.
//
// grid (batch * heads_q): one block a query row, COMBINE_THREADS threads (a multiple of 32).
// The arguments are decode.cu's decode_combine's: the partials O_part (S, rows, HEAD_DIM) and
// LSE_part (S, rows) in acc_t, the split count, the rows, and the outputs O and LSE.
// Compile-time settings: HEAD_DIM, IK_DTYPE, COMBINE_THREADS.
#include "common.cuh"

#ifndef COMBINE_THREADS
#error "decode_combine.cu: -DCOMBINE_THREADS is missing (decode_launch.combine_launch passes it)"
#endif
#if COMBINE_THREADS % 32 != 0 || COMBINE_THREADS > 1024
#error "decode_combine.cu: COMBINE_THREADS must be a multiple of 32, at most 1024"
#endif
#define COMBINE_WARPS (COMBINE_THREADS / 32)
#define COMBINE_COLS ((HEAD_DIM + COMBINE_THREADS - 1) / COMBINE_THREADS)   // columns a thread
#define COMBINE_CHUNK 1024                                                  // weights in SRAM at once
#define COMBINE_UNROLL 8                                                    // loads in flight a thread

// The block's maximum (is_max) or sum of v, the same value in every thread: each warp reduces
// by shuffles, then every thread adds the warps' results in the same order (deterministic).
__device__ __forceinline__ acc_t block_reduce(acc_t v, bool is_max, acc_t* red) {
    for (int off = 16; off > 0; off >>= 1) {
        const acc_t o = shfl_xor(v, off);
        v = is_max ? ik_max(v, o) : v + o;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < COMBINE_WARPS; ++w) v = is_max ? ik_max(v, red[w]) : v + red[w];
    __syncthreads();                                // red is written again by the next reduction
    return v;
}

// w x a split's partial value, exactly 0 where the split weighs nothing (a split with no keys:
// whatever its partial holds, it adds nothing)
__device__ __forceinline__ acc_t weigh(acc_t w, acc_t v) { return w != 0 ? w * v : (acc_t)0; }

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
decode_combine_parallel(const acc_t* __restrict__ O_part, const acc_t* __restrict__ LSE_part, int num_splits,
                        int rows, elem_t* __restrict__ O, acc_t* __restrict__ LSE) {
    __shared__ acc_t red[COMBINE_WARPS];
    __shared__ acc_t w[COMBINE_CHUNK];
    const int row = blockIdx.x;
    const acc_t* lse = LSE_part + row;              // split s's LSE at lse[s * rows]

    // 1. M and L over every split, a split a thread
    acc_t m = neg_inf();
    for (int s = threadIdx.x; s < num_splits; s += COMBINE_THREADS) m = ik_max(m, lse[(long long)s * rows]);
    const acc_t M = block_reduce(m, true, red);
    const acc_t base = (M == neg_inf()) ? (acc_t)0 : M;
    acc_t l = 0;
    for (int s = threadIdx.x; s < num_splits; s += COMBINE_THREADS) l += ik_exp(lse[(long long)s * rows] - base);
    const acc_t L = block_reduce(l, false, red);

    // 2. and 3. a chunk of weights in SRAM, then each thread's columns over the chunk
    const long long step = (long long)rows * HEAD_DIM;      // from one split's partial row to the next
    acc_t sum[COMBINE_COLS];
#pragma unroll
    for (int j = 0; j < COMBINE_COLS; ++j) sum[j] = 0;
    for (int s0 = 0; s0 < num_splits; s0 += COMBINE_CHUNK) {
        const int n = min(COMBINE_CHUNK, num_splits - s0);
        for (int s = threadIdx.x; s < n; s += COMBINE_THREADS) w[s] = ik_exp(lse[(long long)(s0 + s) * rows] - base);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < COMBINE_COLS; ++j) {
            const int c = threadIdx.x + j * COMBINE_THREADS;
            if (c >= HEAD_DIM) break;
            const acc_t* o = O_part + ((long long)s0 * rows + row) * HEAD_DIM + c;
            acc_t acc = sum[j];
            int s = 0;
            for (; s + COMBINE_UNROLL <= n; s += COMBINE_UNROLL) {
                acc_t v[COMBINE_UNROLL];
#pragma unroll
                for (int u = 0; u < COMBINE_UNROLL; ++u) v[u] = o[(s + u) * step];     // all in flight
#pragma unroll
                for (int u = 0; u < COMBINE_UNROLL; ++u) acc += weigh(w[s + u], v[u]);
            }
            for (; s < n; ++s) acc += weigh(w[s], o[s * step]);
            sum[j] = acc;
        }
        __syncthreads();                            // w is written again by the next chunk
    }
    const acc_t inv = L > 0 ? (acc_t)1 / L : (acc_t)0;
#pragma unroll
    for (int j = 0; j < COMBINE_COLS; ++j) {
        const int c = threadIdx.x + j * COMBINE_THREADS;
        if (c < HEAD_DIM) O[(long long)row * HEAD_DIM + c] = from_acc(sum[j] * inv);
    }
    if (threadIdx.x == 0) LSE[row] = L > 0 ? M + ik_log(L) : neg_inf();
}
