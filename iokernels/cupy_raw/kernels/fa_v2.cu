// fa_v2.cu -- FlashAttention forward, version 2: float16 / bfloat16 on the tensor cores.
//
// FlashAttention-2's structure (Dao, 2023):
//   * one thread block owns one query tile Q_i of Br = 16 * NUM_WARPS rows; each warp owns
//     16 of those rows, for the whole kernel: no other warp ever needs its S, P, m or l;
//   * S_ij = Q_i K_j^T and O_i += P_ij V_j run on the tensor cores (mma.sync m16n8k16,
//     float32 accumulators); S and P never leave registers: the accumulator layout of
//     the first product is exactly the A-operand layout of the second, so P is only
//     converted to 16 bits in place;
//   * online softmax in registers: each lane holds 2 rows x (Bc/4) scores; a row's max
//     is reduced over the 4 lanes of a quad with two shuffles; l stays a per-lane
//     partial sum until the end (one reduction, not one a tile);
//   * K_j, V_j double-buffered in SRAM: while tile j is multiplied, tile j+1 is already
//     on its way with cp.async (sm_80+; on sm_75 the copy is synchronous);
//   * causal / window: tiles no row can see are never loaded; the mask is applied only
//     on tiles that straddle a boundary;
//   * GQA/MQA: query head h reads kv head h / (heads_q / heads_kv);
//   * exp2 with scale * log2(e) folded in; LSE converted back to natural log at the end.
//
// Shared memory: Q_i [Br][SROW] and two buffers each of K_j, V_j [Bc][SROW] (16-bit),
// SROW = D_PAD + 8: the extra 16 bytes a row put the 8 rows one ldmatrix reads in 8
// different bank groups (no conflicts) while keeping rows 16-byte aligned for cp.async.
//
// Compile-time settings (-D from ForwardConfig): HEAD_DIM, D_PAD (HEAD_DIM rounded up to 16),
// NUM_WARPS, BLOCK_K (Bc, a multiple of 16), IK_DTYPE (1 float16, 2 bfloat16),
// VEC_IO (1 when a row is a whole number of 16-byte chunks: HEAD_DIM % 8 == 0).
// What it leaves out: Hopper's asynchronous warpgroup products (wgmma) and bulk copies
// (TMA), and warp specialization; each K_j / V_j tile read into SRAM feeds Br rows, so
// 8 warps (Br = 128) are the default.
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "fa_v2.cu: -DHEAD_DIM is missing (ForwardConfig.defines passes it)"
#endif
#ifndef D_PAD
#error "fa_v2.cu: -DD_PAD is missing (ForwardConfig.defines passes it)"
#endif
#ifndef NUM_WARPS
#error "fa_v2.cu: -DNUM_WARPS is missing (ForwardConfig.defines passes it)"
#endif
#ifndef BLOCK_K
#error "fa_v2.cu: -DBLOCK_K is missing (ForwardConfig.defines passes it)"
#endif
#ifndef VEC_IO
#error "fa_v2.cu: -DVEC_IO is missing (ForwardConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "fa_v2 is the 16-bit tensor-core kernel: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#define BLOCK_Q (16 * NUM_WARPS)          // Br
#define SROW (D_PAD + 8)                  // SRAM row stride, in 16-bit elements
#define CHUNKS (D_PAD / 8)                // 16-byte chunks a row
#define NT_S (BLOCK_K / 8)                // 8-column n-tiles of S
#define NT_O (D_PAD / 8)                  // 8-column n-tiles of O
#define KT_Q (D_PAD / 16)                 // 16-deep k-steps of Q K^T

#include "mma_common.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS)
fa_v2(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
      elem_t* __restrict__ O, float* __restrict__ LSE,
      int nq, int nk, int heads_q, int heads_kv,
      long long sqb, long long sqh, long long sqn,
      long long skb, long long skh, long long skn,
      long long svb, long long svh, long long svn,
      float scale, int win_left, int win_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* Qs = reinterpret_cast<u16*>(smem_raw);
    u16* Ks = Qs + BLOCK_Q * SROW;                   // [2][BLOCK_K][SROW]
    u16* Vs = Ks + 2 * BLOCK_K * SROW;               // [2][BLOCK_K][SROW]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;            // mma fragment coordinates
    const int qtile = gridDim.x - 1 - blockIdx.x;    // heaviest causal tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (heads_q / heads_kv);         // GQA
    const int q0 = qtile * BLOCK_Q;
    const elem_t* Qb = Q + b * sqb + h * sqh;
    const elem_t* Kb = K + b * skb + hk * skh;
    const elem_t* Vb = V + b * svb + hk * svh;

    // the key tiles this query tile can see (tile skipping)
    const int last_row = min(q0 + BLOCK_Q, nq) - 1;
    const int kv_lo = key_lo(q0, nq, nk, win_left);
    const int kv_hi = max(key_hi(last_row, nq, nk, win_right), kv_lo);
    const int j_begin = kv_lo / BLOCK_K, j_end = (kv_hi + BLOCK_K - 1) / BLOCK_K;
    // a tile [c0, c0 + Bc) needs no mask when every row sees all of it
    const int lo_last = key_lo(last_row, nq, nk, win_left);
    const int hi_first = key_hi(q0, nq, nk, win_right);

    // this lane's two rows (g and g + 8 of its warp's 16) and their visible keys
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int lo0 = key_lo(r0, nq, nk, win_left), hi0 = key_hi(r0, nq, nk, win_right);
    const int lo1 = key_lo(r1, nq, nk, win_left), hi1 = key_hi(r1, nq, nk, win_right);
    const float scale_log2 = scale * 1.4426950408889634f;   // exp(x) = exp2(x * log2 e)

    float o[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};
    u32 qf[KT_Q][4];                                 // Q_i's A fragments, kept in registers

    // load Q_i, K_j0, V_j0 -> SRAM (one asynchronous group)
    load_tile<BLOCK_Q>(Qs, Qb, sqn, q0, nq);
    if (j_begin < j_end) {
        load_tile<BLOCK_K>(Ks, Kb, skn, j_begin * BLOCK_K, nk);
        load_tile<BLOCK_K>(Vs, Vb, svn, j_begin * BLOCK_K, nk);
    }
    cp_async_commit();

    for (int j = j_begin; j < j_end; ++j) {          // loop over K_j, V_j tiles
        const int buf = (j - j_begin) & 1;
        const int k0 = j * BLOCK_K;
        // load K_j+1, V_j+1 -> SRAM (the other buffer) while this tile is used
        if (j + 1 < j_end) {
            load_tile<BLOCK_K>(Ks + (buf ^ 1) * BLOCK_K * SROW, Kb, skn, k0 + BLOCK_K, nk);
            load_tile<BLOCK_K>(Vs + (buf ^ 1) * BLOCK_K * SROW, Vb, svn, k0 + BLOCK_K, nk);
        }
        cp_async_commit();
        cp_async_wait<1>();                          // tile j (and Q) have landed
        __syncthreads();
        if (j == j_begin) {
#pragma unroll
            for (int kk = 0; kk < KT_Q; ++kk)        // Q_i: SRAM -> registers, once
                ldmatrix_x4(qf[kk], Qs + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * SROW
                                        + kk * 16 + (lane / 16) * 8);
        }
        const u16* Kt = Ks + buf * BLOCK_K * SROW;
        const u16* Vt = Vs + buf * BLOCK_K * SROW;

        // S_ij = Q_i K_j^T on the tensor cores (registers)
        float s[NT_S][4];
        mma_qkt<KT_Q, NT_S>(s, qf, Kt, SROW, lane);

        // scale (log2 units) and mask; the mask only on tiles that cross a boundary
        const bool need_mask = !(lo_last <= k0 && hi_first >= k0 + BLOCK_K);
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[n][e] * scale_log2;
                if (need_mask) {
                    int col = k0 + n * 8 + 2 * t + (e & 1);
                    bool vis = (e < 2) ? (col >= lo0 && col < hi0) : (col >= lo1 && col < hi1);
                    x = vis ? x : neg_inf_f();
                }
                s[n][e] = x;
            }

        // online softmax in registers (rows g: e = 0,1; g + 8: e = 2,3)
#pragma unroll
        for (int r = 0; r < 2; ++r) online_softmax_row<NT_S, NT_O>(s, o, m[r], l[r], r);

        // O_i += P_ij V_j on the tensor cores; P_ij's accumulators become A fragments
        mma_pv<BLOCK_K / 16, NT_O, true>(o, s, Vt, SROW, lane);
        __syncthreads();                             // everyone is done with buffer `buf`
    }
    cp_async_wait<0>();

    // finish: reduce l over the quad, O = acc / l, LSE = (m + log2 l) * ln 2
    float inv[2], lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        inv[r] = lr > 0.f ? 1.f / lr : 0.f;
        lse[r] = lr > 0.f ? (m[r] + log2f(lr)) * 0.6931471805599453f : neg_inf_f();
    }
    // write O_i -> SRAM (this warp's own 16 rows of Q_i's buffer), then 16-byte rows -> HBM
    __syncthreads();                                 // Q_i's SRAM may still be read (no K tiles)
    u16* Ow = Qs + warp * 16 * SROW;
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
        *reinterpret_cast<u32*>(Ow + g * SROW + n * 8 + 2 * t) = pack2_cvt_each(o[n][0] * inv[0], o[n][1] * inv[0]);
        *reinterpret_cast<u32*>(Ow + (g + 8) * SROW + n * 8 + 2 * t) = pack2_cvt_each(o[n][2] * inv[1], o[n][3] * inv[1]);
    }
    __syncwarp();
    elem_t* Ob = O + ((long long)b * heads_q + h) * nq * HEAD_DIM;
    const int wr0 = q0 + warp * 16;
#if VEC_IO
    for (int idx = lane; idx < 16 * (HEAD_DIM / 8); idx += 32) {
        int r = idx / (HEAD_DIM / 8), c = idx % (HEAD_DIM / 8);
        if (wr0 + r < nq)
            *reinterpret_cast<uint4*>(Ob + (long long)(wr0 + r) * HEAD_DIM + c * 8) =
                *reinterpret_cast<const uint4*>(Ow + r * SROW + c * 8);
    }
#else
    for (int idx = lane; idx < 16 * HEAD_DIM; idx += 32) {
        int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        if (wr0 + r < nq) Ob[(long long)(wr0 + r) * HEAD_DIM + c] = Ow[r * SROW + c];
    }
#endif
    // write LSE_i -> HBM
    if (t == 0) {
        float* L = LSE + ((long long)b * heads_q + h) * nq;
        if (r0 < nq) L[r0] = lse[0];
        if (r1 < nq) L[r1] = lse[1];
    }
}
