// bwd_v3.cu -- FlashAttention backward for Hopper (sm_90a): wgmma, TMA, a producer warpgroup.
//
// The algorithm of bwd_v2.cu (FlashAttention-2's Algorithm 2, Dao 2023) with the structure of
// FlashAttention-3's backward (Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, 2024; its
// hopper/ folder, mainloop_bwd_sm90_tma_gmma_ws.hpp (code)).  The row sums D_i = rowsum(dO_i * O_i)
// and the final dQ conversion stay bwd_v1.cu's kernels (bwd_rowsum, bwd_finish); this file is the
// main loop, bwd_v3_main.
//
// One thread block owns one K/V tile j of Bc = 64 keys of one KV head of one sequence.  K_j and
// V_j are loaded once by TMA and stay in SRAM; per (query head of the GQA group, Q tile i of
// Br = 64 rows) the consumer warpgroup computes, recomputing P from the saved LSE:
//
//   S_ij^T  = K_j Q_i^T                 (wgmma, both operands from SRAM; 64 keys x Br, registers)
//   dP_ij^T = V_j dO_i^T                (wgmma, both from SRAM; registers)
//   P_ij^T  = exp(scale S^T - LSE_i)    (registers; 0 where masked or LSE_i = -inf)
//   dS_ij^T = P^T * (dP^T - D_i)        (registers)
//   dV_j   += P_ij^T dO_i               (wgmma, P^T from registers, dO_i from SRAM)
//   dK_j   += dS_ij^T Q_i               (wgmma, dS^T from registers, Q_i from SRAM; times scale
//                                        once, at the end)
//   dQ_i   += scale dS_ij K_j           (wgmma, dS from SRAM, K_j from SRAM; -> HBM by atomic
//                                        adds, or one partial a K/V tile: DETERMINISTIC)
//
// What it adds to bwd_v2, and why (FlashAttention-3's ideas):
//   * wgmma: a warpgroup (4 warps) issues 64-row products that read their operands straight
//     from SRAM by descriptor, asynchronously, instead of a warp's 16-row mma.sync fed by
//     ldmatrix; the tensor cores of an H100/H200 reach their rate only this way.
//   * TMA + mbarriers + warp specialization: a producer warpgroup (one thread of it issues the
//     copies) streams Q_i and dO_i into a ring of STAGES SRAM stages, 128-byte swizzled, while
//     the consumer computes; "full" mbarriers say a stage has landed, "empty" ones that the
//     consumer is done with it.  No __syncthreads in the loop, no address arithmetic for loads
//     in the consumer.  Rows past Nq arrive as zeros (TMA's out-of-bounds fill).
//   * dS through SRAM once, for dQ: as in FlashAttention-3, dS is stored (16 bits) and read back
//     by the dQ product as an SRAM operand.
//
// The transposes, and why they cost nothing.  The consumer owns the 64 keys as the ROWS (M) of
// its accumulators (bwd_v2's orientation; FlashAttention-3's "SdP_swapAB" setting), so S^T,
// P^T, dP^T, dS^T are 64 keys x Br queries:
//   * S^T = K_j Q_i^T: A = K_j (rows keys, contiguous along d: "K-major"), B = Q_i (rows
//     queries, contiguous along d: K-major too) -- both exactly as TMA lays them down.
//   * dV += P^T dO: the reduction runs over the queries; P^T's accumulator layout (keys x
//     queries) is the register layout of a wgmma A operand (as P in fa_v4.cu), so P^T is only
//     converted to 16 bits in place.  B = dO_i (rows = queries = the reduction, contiguous along
//     d): "MN-major", as V is for the forward's O += P V.  dK += dS^T Q: the same with dS^T, Q_i.
//   * dQ = dS K_j needs dS with the QUERIES as rows, the transpose of what the registers hold.
//     dS^T is stored to SRAM as it is (rows = keys, 128 bytes = Br = 64 queries, swizzled); for
//     the dQ product that is an A operand whose M (queries) is contiguous: MN-major, which wgmma
//     reads with its transpose-A bit set (16-bit types only).  B = K_j (rows = keys = the
//     reduction, contiguous along d): MN-major.  No data is moved to transpose anything.
//
// What lives where (d = HEAD_DIM):
//   registers  dK_j, dV_j (64 keys x d, float32: d / 2 + d / 2 a thread), S^T / P^T and
//              dP^T / dS^T (64 x Br: Br / 2 each a thread), dQ_i (Br x d: d / 2 a thread)
//   SRAM       K_j, V_j [Bc x d] for the whole block; STAGES x (Q_i, dO_i [Br x d], LSE_i, D_i);
//              2 x dS_ij^T [Bc x Br] (two buffers: the one the dQ product of step i may still
//              read is not overwritten by step i + 1)
//   HBM        Q, K, V, dO, LSE, D read; dK, dV written once; dQaccum (float32) added to
//
// Notation as in iokernels/backward.py: Br (BLOCK_M), Bc (BLOCK_N), Tr = ceil(Nq / Br),
// Tc = ceil(Nk / Bc), D_i, S_ij, P_ij, dP_ij, dS_ij, LSE_i.
//
// Causal / window: the Q tiles that see no key of tile j are never loaded; the visibility mask
// is applied only where a (Q tile, K/V tile) pair crosses the band's edge or runs past Nk.
//
// Limits, frankly:
//   * one consumer warpgroup of Bc = 64 keys and Br = 64 rows a step, one block an SM: a
//     first version meant to be right.  FlashAttention-3 (hopper/flash_bwd_launch_template.h
//     and flash_bwd_kernel_sm90.h, code) runs two or three MMA warpgroups over Bc = 128 keys
//     (Br = 128 at d = 64; 64 causal or 80 otherwise at d = 128), so each Q_i, dO_i brought into SRAM feeds twice the keys;
//     the second warp of its producer warpgroup drains dQ from SRAM to HBM, so the consumers
//     never wait on the reductions; and LSE_i, D_i arrive by TMA from buffers its
//     preprocessing pass pads (here a producer warp copies them with ordinary loads, so the
//     forward's LSE and bwd_v1.cu's row sums serve as they are).  None of that is here, so
//     expect it well below FlashAttention-3's rate.
//   * the products of a step run one after another (S^T and dP^T together, then dV and dK,
//     then dQ, each waited for): the tensor cores idle while P and dS are computed and while
//     dQ is added to HBM.
//   * head_dim 64 and 128 only.  256 does not fit: dK_j and dV_j (64 x 256 float32 each) alone
//     take 128 + 128 = 256 registers a thread of one warpgroup, more than the 255 a thread may
//     have, before S^T, dP^T or dQ (FlashAttention-3 spreads a K/V tile's rows over two or more
//     consumer warpgroups).  At d = 128 ptxas fills nearly all 255, without spilling.
//   * dQ: one float32 reduction (red.global.add.v2) per element per K/V tile, as bwd_v2.
//
// Block: warpgroup 0 = producer (one thread issues the TMA copies; one warp fills LSE_i, D_i),
// warpgroup 1 = the consumer.  With 256 threads a thread may already have 255 registers (64K
// a block), so no setmaxnreg is needed to give the consumer its accumulators.
//
// Compile-time settings (-D from BackwardConfig): IK_DTYPE (1 float16, 2 bfloat16), HEAD_DIM
// (64, 128), BLOCK_M (Br = 64), BLOCK_N (Bc = 64), STAGES (Q/dO ring depth), DETERMINISTIC.
#ifndef STAGES
#error "bwd_v3.cu: -DSTAGES is missing (BackwardConfig.defines passes it)"
#endif
#ifndef DETERMINISTIC
#error "bwd_v3.cu: -DDETERMINISTIC is missing (BackwardConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#if BLOCK_M != 64 || BLOCK_N != 64
#error "bwd_v3 takes BLOCK_M = BLOCK_N = 64 (one consumer warpgroup: 64 keys as the rows of S^T, 64 queries as the rows of dQ)"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "bwd_v3 takes HEAD_DIM 64 or 128 (dK_j and dV_j of 64 keys at 256 need more than a thread's 255 registers)"
#endif
#if STAGES < 1 || STAGES > 4
#error "bwd_v3 takes STAGES 1 to 4"
#endif

#define NTHREADS 256                         // producer warpgroup + one consumer warpgroup
#define ST_REGS (BLOCK_M / 2)                // float32 a thread of S^T (and of dP^T): 64 keys x Br
#define D_REGS (HEAD_DIM / 2)                // float32 a thread of dK_j, of dV_j, of dQ_i (64 x d)
#define KD_STEPS (HEAD_DIM / 16)             // wgmma k-steps over the head dim (S^T, dP^T)
#define KQ_STEPS (BLOCK_M / 16)              // ... over the Br queries (dV, dK)
#define KK_STEPS (BLOCK_N / 16)              // ... over the Bc keys (dQ)
#define DS_TILE_BYTES (BLOCK_N * BLOCK_M * ELEM_BYTES)   // dS^T: Bc rows of Br = 64 (one panel)
#define DS_BUFS 2                            // dS^T double-buffered: step i + 1 writes while i's dQ reads
//: the consumer warpgroup's named barrier (0 is __syncthreads) and its threads (each arrives once
//: on a stage's "empty" barrier)
#define CONSUMER_BAR 1
#define CONSUMER_THREADS 128
//: q_full completes on the copy thread's expect_tx arrival plus one arrival from each lane of
//: the warp that stores LSE_i, D_i
#define Q_FULL_ARRIVALS (1 + 32)
#define LOG2E 1.4426950408889634f            // exp(x) = exp2(x * log2 e)

// S^T, dP^T: M = 64 keys, N = Br = 64 queries, both operands K-major from SRAM
#define WGMMA_T wgmma_ss_n64<0>
// dQ: M = Br queries (A = dS, MN-major: transpose-A), N = d (B = K_j, MN-major)
#if HEAD_DIM == 128
#define WGMMA_DQ wgmma_ss_n128<1, 1>
#else
#define WGMMA_DQ wgmma_ss_n64<1, 1>
#endif

// The dynamic SRAM, 1024-byte aligned (every tile starts a swizzle atom).
struct BwdSmem {
    unsigned char *k, *v, *q, *dO, *ds;      // K_j, V_j; STAGES x Q_i, dO_i; DS_BUFS x dS^T
    float *lse, *dd;                         // STAGES x Br: LSE_i in log2 units, D_i
    u64 *kv_full, *q_full, *empty;           // 1, STAGES, STAGES
};
__device__ __forceinline__ BwdSmem carve_bwd_smem(unsigned char* raw) {
    BwdSmem sm;
    sm.k = (unsigned char*)(((size_t)raw + SWIZZLE_ATOM_BYTES - 1) & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    sm.v = sm.k + KV_TILE_BYTES;
    sm.q = sm.v + KV_TILE_BYTES;
    sm.dO = sm.q + STAGES * Q_TILE_BYTES;
    sm.ds = sm.dO + STAGES * Q_TILE_BYTES;
    sm.lse = (float*)(sm.ds + DS_BUFS * DS_TILE_BYTES);
    sm.dd = sm.lse + STAGES * BLOCK_M;
    sm.kv_full = (u64*)(sm.dd + STAGES * BLOCK_M);
    sm.q_full = sm.kv_full + 1;
    sm.empty = sm.q_full + STAGES;
    return sm;
}

// The wgmma descriptors of the SRAM tiles (hopper_common.cuh's smem_desc_k_major and
// smem_desc_mn_major), from a 32-bit shared-window address.  K_j and V_j never move, so a
// compiler would compute their 2 x HEAD_DIM / 16 + BLOCK_N / 16 descriptors once and keep them
// (64-bit each) in registers for the whole loop, registers dK_j and dV_j need; `fresh` hands the
// loop each base address anew every step (an asm volatile is never hoisted), so a descriptor is
// a few integer additions recomputed right before its wgmma instead.
__device__ __forceinline__ u32 fresh(u32 x) {
    u32 y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ u64 desc_k_major_at(u32 addr) {
    return desc_field(addr) | (desc_field(16) << 16) | (desc_field(SWIZZLE_ATOM_BYTES) << 32) | DESC_SWIZZLE_128B;
}
__device__ __forceinline__ u64 desc_mn_major_at(u32 addr, u32 panel_bytes) {
    return desc_field(addr) | (desc_field(panel_bytes) << 16) | (desc_field(SWIZZLE_ATOM_BYTES) << 32)
           | DESC_SWIZZLE_128B;
}

// dQaccum[p], dQaccum[p + 1] += a, b (DETERMINISTIC: = a, b, into this K/V tile's own slot);
// one vector reduction, 8-byte aligned (HEAD_DIM and the column are even)
__device__ __forceinline__ void dq_put2(float* p, float a, float b) {
#if DETERMINISTIC
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#else
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#endif
}

// P^T and dS^T from the S^T / dP^T accumulators (this thread: keys key_a, key_a + 8; queries
// i0 + 8n + 2t, + 1), straight into the A fragments of the products that reduce over the Br
// queries (dV += P^T dO, dK += dS^T Q): the accumulator layout of 16 columns is wgmma's A
// register layout, so this is a conversion to 16 bits in place.  Done 16 columns (one k-step)
// at a time, so each float32 value dies as soon as it is packed.  lse2: LSE_i log2 e, +inf for
// a row past Nq or with nothing visible (its P is exp2(-inf) = 0); dd: D_i (0 there).
template <bool MASK>
__device__ __forceinline__ void p_ds_fragments(const float (&s)[ST_REGS], const float (&dp)[ST_REGS],
                                               u32 (&pa)[KQ_STEPS][4], u32 (&sa)[KQ_STEPS][4],
                                               const float* lse2, const float* dd, const AttnShape& p,
                                               int key_a, int i0) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < KQ_STEPS; ++kk) {
        float pv[8], ds[8];
#pragma unroll
        for (int half = 0; half < 2; ++half) {      // the 8-column block n = 2 kk + half
            const int n = 2 * kk + half;
            const float2 l = *reinterpret_cast<const float2*>(lse2 + 8 * n + 2 * t);
            const float2 di = *reinterpret_cast<const float2*>(dd + 8 * n + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {           // e: (row key_a or key_a + 8) x (column 2t, 2t + 1)
                const int i = 4 * n + e;
                float x = s[i] * p.scale_log2 - ((e & 1) ? l.y : l.x);
                if (MASK && !visible(p, i0 + 8 * n + 2 * t + (e & 1), key_a + 8 * (e / 2))) x = neg_inf_f();
                pv[4 * half + e] = fast_exp2(x);                                       // P_ij^T
                ds[4 * half + e] = pv[4 * half + e] * (dp[i] - ((e & 1) ? di.y : di.x));  // dS_ij^T
            }
        }
        pa[kk][0] = pack2_cvt_x2(pv[0], pv[1]);     // key_a, queries 16 kk + 2t, + 1
        pa[kk][1] = pack2_cvt_x2(pv[2], pv[3]);     // key_a + 8
        pa[kk][2] = pack2_cvt_x2(pv[4], pv[5]);     // key_a, queries 16 kk + 8 + 2t, + 1
        pa[kk][3] = pack2_cvt_x2(pv[6], pv[7]);     // key_a + 8
        sa[kk][0] = pack2_cvt_x2(ds[0], ds[1]);
        sa[kk][1] = pack2_cvt_x2(ds[2], ds[3]);
        sa[kk][2] = pack2_cvt_x2(ds[4], ds[5]);
        sa[kk][3] = pack2_cvt_x2(ds[6], ds[7]);
    }
}

// write dS_ij^T -> SRAM (16 bits) in the 128-byte-swizzled layout wgmma reads: row = key
// (16 warp + g, + 8), 128 bytes = Br queries; the 16-byte chunk c of row r sits at c ^ (r % 8)
__device__ __forceinline__ void store_ds_t(unsigned char* ds, const u32 (&a)[KQ_STEPS][4]) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {                                   // rows g and g + 8
        const int r = 16 * warp + g + 8 * h;
        unsigned char* row = ds + r * PANEL_BYTES + 4 * t;
#pragma unroll
        for (int kk = 0; kk < KQ_STEPS; ++kk)
#pragma unroll
            for (int half = 0; half < 2; ++half) {                  // queries 16 kk + 8 half + 2t
                const int c = 2 * kk + half;
                *reinterpret_cast<u32*>(row + ((c ^ (r % 8)) * 16)) = a[kk][2 * half + h];
            }
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
bwd_v3_main(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
            const __grid_constant__ TmaMap map_v, const __grid_constant__ TmaMap map_do,
            const float* __restrict__ LSE, const float* __restrict__ Dv, u16* __restrict__ dK,
            u16* __restrict__ dV, float* __restrict__ dQacc, int nq, int nk, int heads_q, int heads_kv,
            float scale, int left, int right) {
    extern __shared__ unsigned char smem_raw[];
    const BwdSmem sm = carve_bwd_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale * LOG2E, left, right};
    const int wg = threadIdx.x / 128;
    const int jt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int j0 = jt * BLOCK_N, group = heads_q / heads_kv;
    const int nk_tile = min(BLOCK_N, nk - j0);

    // the query rows that can see a key of this tile (the band's diagonal bounds), as Q tiles
    const int off = nk - nq;
    const int i_lo = right >= 0 ? max(0, j0 - right - off) : 0;
    const int i_hi = left >= 0 ? min(nq, j0 + nk_tile - 1 + left - off + 1) : nq;
    const int qt_lo = i_lo / BLOCK_M;
    const int n_qt = i_hi > i_lo ? (i_hi + BLOCK_M - 1) / BLOCK_M - qt_lo : 0;
    const int n_it = n_qt * group;                   // (query head, Q tile) pairs, head-major

    if (threadIdx.x == 0) {
        mbar_init(sm.kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.q_full[s], Q_FULL_ARRIVALS);
            mbar_init(&sm.empty[s], CONSUMER_THREADS); // one arrival a consumer thread
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: HBM -> SRAM
        if (threadIdx.x >= 32 || n_it == 0) return;
        const int lane = threadIdx.x;
        if (lane == 0) {                             // load K_j, V_j -> SRAM, once
            mbar_arrive_expect_tx(sm.kv_full, 2 * KV_TILE_BYTES);
            load_kv_tile(sm.k, &map_k, sm.kv_full, j0, b * heads_kv + hk);
            load_kv_tile(sm.v, &map_v, sm.kv_full, j0, b * heads_kv + hk);
        }
        for (int it = 0; it < n_it; ++it) {          // load Q_i, dO_i, LSE_i, D_i -> SRAM stage s
            const int s = it % STAGES;
            const int bh = b * heads_q + hk * group + it / n_qt;
            const int i0 = (qt_lo + it % n_qt) * BLOCK_M;
            mbar_wait(&sm.empty[s], ((it / STAGES) & 1) ^ 1);        // stage s's last tile is consumed
            if (lane == 0) {
                mbar_arrive_expect_tx(&sm.q_full[s], 2 * Q_TILE_BYTES);
#pragma unroll
                for (int pnl = 0; pnl < D_PANELS; ++pnl) {
                    tma_load_3d(sm.q + s * Q_TILE_BYTES + pnl * Q_PANEL_BYTES, &map_q, &sm.q_full[s],
                                pnl * PANEL, i0, bh);
                    tma_load_3d(sm.dO + s * Q_TILE_BYTES + pnl * Q_PANEL_BYTES, &map_do, &sm.q_full[s],
                                pnl * PANEL, i0, bh);
                }
            }
            for (int r = lane; r < BLOCK_M; r += 32) {
                const int row = i0 + r;
                const float l = row < nq ? LSE[(size_t)bh * nq + row] : neg_inf_f();
                // +inf: exp2(S scale log2 e - inf) = 0, a row past Nq or that sees no key
                sm.lse[s * BLOCK_M + r] = l == neg_inf_f() ? __int_as_float(0x7f800000) : l * LOG2E;
                sm.dd[s * BLOCK_M + r] = row < nq ? Dv[(size_t)bh * nq + row] : 0.f;
            }
            mbar_arrive(&sm.q_full[s]);              // release: LSE_i, D_i stored
        }
        return;
    }

    // ---------------------------------------------------------------- consumer: the products
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int key_a = j0 + 16 * warp + g;            // this thread's keys: key_a, key_a + 8
    float dk[D_REGS], dv[D_REGS];
#pragma unroll
    for (int i = 0; i < D_REGS; ++i) dk[i] = dv[i] = 0.f;

    if (n_it > 0) mbar_wait(sm.kv_full, 0);
    for (int it = 0; it < n_it; ++it) {              // loop over (query head, Q tile i): SRAM -> registers
        const int s = it % STAGES;
        const int h = hk * group + it / n_qt;
        const int i0 = (qt_lo + it % n_qt) * BLOCK_M;
        const unsigned char* qt = sm.q + s * Q_TILE_BYTES;
        const unsigned char* dot = sm.dO + s * Q_TILE_BYTES;
        unsigned char* ds = sm.ds + (it % DS_BUFS) * DS_TILE_BYTES;
        // this step's SRAM addresses of K_j, V_j, Q_i, dO_i, dS^T (see `fresh`)
        const u32 k_at = fresh(smem_addr(sm.k)), v_at = fresh(smem_addr(sm.v));
        const u32 q_at = fresh(smem_addr(qt)), do_at = fresh(smem_addr(dot)), ds_at = fresh(smem_addr(ds));
        mbar_wait(&sm.q_full[s], (it / STAGES) & 1);                 // Q_i, dO_i, LSE_i, D_i in

        // S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T (SRAM x SRAM -> registers)
        float st[ST_REGS], dpt[ST_REGS];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KD_STEPS; ++kk) {
            const int pnl = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
            WGMMA_T(st, desc_k_major_at(k_at + pnl * KV_PANEL_BYTES + within),
                    desc_k_major_at(q_at + pnl * Q_PANEL_BYTES + within), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < KD_STEPS; ++kk) {
            const int pnl = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
            WGMMA_T(dpt, desc_k_major_at(v_at + pnl * KV_PANEL_BYTES + within),
                    desc_k_major_at(do_at + pnl * Q_PANEL_BYTES + within), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(st);
        fence_regs(dpt);

        // P_ij^T, dS_ij^T in registers (16 bits, as A fragments); the mask only where the tile
        // pair crosses the band's edge
        const float* lse2 = sm.lse + s * BLOCK_M;
        const float* dd = sm.dd + s * BLOCK_M;
        u32 pa[KQ_STEPS][4], sa[KQ_STEPS][4];
        if (tile_needs_mask(p, jt, i0, min(i0 + BLOCK_M, nq) - 1))
            p_ds_fragments<true>(st, dpt, pa, sa, lse2, dd, p, key_a, i0);
        else p_ds_fragments<false>(st, dpt, pa, sa, lse2, dd, p, key_a, i0);

        // write dS_ij^T -> SRAM for the dQ product, before dS^T's fragments feed an asynchronous
        // wgmma (the registers of a wgmma in flight may not be touched until it is waited for)
        store_ds_t(ds, sa);
        fence_proxy_async();

        // dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i (registers x SRAM, MN-major B)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KQ_STEPS; ++kk)
            WGMMA_O(dv, pa[kk], desc_mn_major_at(do_at + kk * 16 * PANEL_BYTES, Q_PANEL_BYTES));
#pragma unroll
        for (int kk = 0; kk < KQ_STEPS; ++kk)
            WGMMA_O(dk, sa[kk], desc_mn_major_at(q_at + kk * 16 * PANEL_BYTES, Q_PANEL_BYTES));
        wgmma_commit();
        // the whole warpgroup's dS^T must be in SRAM before dQ's product reads it
        named_bar_sync(CONSUMER_BAR, CONSUMER_THREADS);
        // dV, dK's products done before dQ's is issued: P^T, dS^T's fragments die here, so
        // dQ's 64 x d accumulator never shares the registers with them (at d = 128 it would
        // not fit beside dK_j, dV_j without spilling); Q_i, dO_i, LSE_i, D_i are no longer read
        wgmma_wait<0>();
        // this thread is done with stage s: every consumer thread arrives, so each one's reads
        // of LSE_i, D_i (p_ds_fragments) are released by its own arrival before the producer
        // overwrites them with ordinary stores (compute-sanitizer's racecheck reported those
        // reads racing with the next stores when one lane a warp arrived after the named barrier)
        mbar_arrive(&sm.empty[s]);

        // dQ_i = dS_ij K_j (SRAM x SRAM: dS MN-major through the transpose-A bit, K_j MN-major)
        float dq[D_REGS];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KK_STEPS; ++kk)
            WGMMA_DQ(dq, desc_mn_major_at(ds_at + kk * 16 * PANEL_BYTES, DS_TILE_BYTES),
                     desc_mn_major_at(k_at + kk * 16 * PANEL_BYTES, KV_PANEL_BYTES), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);

        // add dQ_i -> HBM (float32 reductions; DETERMINISTIC: plain stores into slot j)
        float* dq_base = dQacc + ((size_t)b * heads_q + h) * nq * HEAD_DIM;
#if DETERMINISTIC
        dq_base += (size_t)jt * gridDim.z * heads_q * nq * HEAD_DIM;
#endif
        const int qa = i0 + 16 * warp + g;           // this thread's query rows: qa, qa + 8
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = qa + 8 * hh;
            if (row < nq) {
                float* dst = dq_base + (size_t)row * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    dq_put2(dst + 8 * n, dq[4 * n + 2 * hh] * scale, dq[4 * n + 2 * hh + 1] * scale);
            }
        }
    }
    wgmma_wait<0>();
    fence_regs(dk);
    fence_regs(dv);

    // write dK_j (times scale), dV_j -> HBM, once (16 bits, two columns a store)
    const size_t kv_base = ((size_t)b * heads_kv + hk) * nk;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int key = key_a + 8 * hh;
        if (key < nk) {
            u16* kd = dK + (kv_base + key) * HEAD_DIM + 2 * t;
            u16* vd = dV + (kv_base + key) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                *reinterpret_cast<u32*>(kd + 8 * n) = pack2_cvt_x2(dk[4 * n + 2 * hh] * scale, dk[4 * n + 2 * hh + 1] * scale);
                *reinterpret_cast<u32*>(vd + 8 * n) = pack2_cvt_x2(dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1]);
            }
        }
    }
}
