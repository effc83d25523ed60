// bwd_v5.cu -- FlashAttention backward for Hopper (sm_90a), version 5: the blocks in longest-first
// order.
//
// bwd_v4.cu's kernel (read its header first: two consumer warpgroups of 64 keys share every Q_i,
// dO_i tile), with the one change of which block runs which tile.  FlashAttention's Hopper and
// Blackwell kernels schedule causal tiles longest first, the heads taken in sections whose data
// fits the L2 cache (SingleTileLPTScheduler in flash_attn/cute/tile_scheduler.py: code), and its
// causal backward too (SingleTileBwdLPTScheduler in hopper/tile_scheduler.hpp: code); v5 does the
// same for this backward's blocks.
//
// What changes from v4, and why:
//   * a block of v4 takes the K/V tile jt = blockIdx.x of the (KV head, batch) pair (blockIdx.y,
//     blockIdx.z), and the GPU starts blocks in about that order, x fastest (CUDA does not promise
//     an order; the scheduler above relies on the same behaviour).  Under the causal mask the
//     block of tile jt steps over the Q tiles from the diagonal down, Tr - 2 jt of them at Br = 64,
//     Bc = 128 (Nq = Nk): the first tile of a pair is the longest, the last the shortest, and the
//     last pair's long blocks start at the very end of the grid while the other multiprocessors
//     run out of work.  That tail is up to one longest block's time.
//   * v5 reads its block's linear index in a different order (block_tile): the pairs are taken in
//     groups of lpt_pairs (the launcher's policy, cupy_raw/policy.py backward_lpt_pairs: as many
//     pairs as fill one wave of blocks, and no more than keep their Q_i and dO_i tiles within
//     part of the L2 cache), and inside a group
//     tile jt is the slow index: every pair's tile 0 first, then every pair's tile 1, ... .  So
//     each group runs its longest blocks first and its shortest last, and the grid ends on the
//     last group's shortest blocks.  Grouping keeps what v4's order had: the blocks running at
//     once read the Q_i, dO_i tiles of a few pairs, which stay in L2 between them.
//   * tile jt first is the longest first wherever the band has an upper edge (causal, a causal
//     window): the blocks of the last tiles have the fewest rows that see them.  Without a mask
//     every block is as long as the next, and the order would change nothing but the L2
//     grouping, so there the policy passes lpt_pairs = 1: v4's order exactly.
//   * the grid, the launch and every product are v4's; the kernel takes one more argument
//     (lpt_pairs).  dQ's deterministic slots are still indexed by jt, so the deterministic mode
//     gives v4's bits.
//
// Registers, SRAM, notation, compile-time settings and the limits: bwd_v4.cu's.  The producer
// decodes its tile after setmaxnreg like everything else it computes (bwd_v4.cu says why).
#ifndef STAGES
#error "bwd_v5.cu: -DSTAGES is missing (BackwardConfig.defines passes it)"
#endif
#ifndef DETERMINISTIC
#error "bwd_v5.cu: -DDETERMINISTIC is missing (BackwardConfig.defines passes it)"
#endif
#include "hopper_attention.cuh"

#if BLOCK_M != 64 || BLOCK_N != 128
#error "bwd_v5 takes BLOCK_M = 64 and BLOCK_N = 128 (two consumer warpgroups of 64 keys, 64 queries as the rows of dQ)"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "bwd_v5 takes HEAD_DIM 64 or 128 (dK_j and dV_j of 64 keys at 256 need more than a consumer's 232 registers)"
#endif
#if STAGES < 1 || STAGES > 4
#error "bwd_v5 takes STAGES 1 to 4"
#endif

#define CONSUMERS 2                          // consumer warpgroups, 64 keys each
#define NTHREADS (128 * (CONSUMERS + 1))     // producer warpgroup + the consumers
#define PRODUCER_REGS 32
#define CONSUMER_REGS 232
#define WG_KEYS 64                           // keys a consumer warpgroup owns (one wgmma M)
#define ST_REGS (BLOCK_M / 2)                // float32 a thread of S^T (and of dP^T): 64 keys x Br
#define D_REGS (HEAD_DIM / 2)                // float32 a thread of dK_j, of dV_j (64 keys x d)
#define DQ_REGS (PANEL / 2)                  // float32 a thread of one dQ panel (Br x 64)
#define KD_STEPS (HEAD_DIM / 16)             // wgmma k-steps over the head dim (S^T, dP^T)
#define KQ_STEPS (BLOCK_M / 16)              // ... over the Br queries (dV, dK)
#define KK_STEPS (BLOCK_N / 16)              // ... over the Bc = 128 keys (dQ)
#define DQ_PANELS 2                          // the panels the two warpgroups take turns on
#define DS_TILE_BYTES (BLOCK_N * BLOCK_M * ELEM_BYTES)   // dS^T: Bc rows of Br = 64 (one panel)
#define DS_BUFS 2                            // dS^T double-buffered: step i + 1 writes while i's dQ reads
//: the consumers' named barrier (0 is __syncthreads), their threads, and their warps (each
//: arrives once on a stage's "empty" barrier)
#define CONSUMER_BAR 1
#define CONSUMER_THREADS (128 * CONSUMERS)
//: q_full completes on the copy thread's expect_tx arrival plus one arrival from each lane of
//: the warp that stores LSE_i, D_i
#define Q_FULL_ARRIVALS (1 + 32)
#define LOG2E 1.4426950408889634f            // exp(x) = exp2(x * log2 e)

// S^T, dP^T: M = 64 keys, N = Br = 64 queries, both operands K-major from SRAM
#define WGMMA_T wgmma_ss_n64<0>
// dQ, one panel: M = Br queries (A = dS, MN-major: transpose-A), N = 64 columns (B = K_j, MN-major)
#define WGMMA_DQ wgmma_ss_n64<1, 1>

// The dynamic SRAM, 1024-byte aligned (every tile starts a swizzle atom): byte offsets from
// the aligned base.
#define OFF_V KV_TILE_BYTES                                    // K_j at 0, V_j (128 keys each)
#define OFF_Q (2 * KV_TILE_BYTES)                              // STAGES x Q_i
#define OFF_DO (OFF_Q + STAGES * Q_TILE_BYTES)                 // STAGES x dO_i
#define OFF_DS (OFF_DO + STAGES * Q_TILE_BYTES)                // DS_BUFS x dS^T
#define OFF_LSE (OFF_DS + DS_BUFS * DS_TILE_BYTES)             // STAGES x Br float32: LSE_i log2 e
#define OFF_DD (OFF_LSE + STAGES * BLOCK_M * 4)                // STAGES x Br float32: D_i
#define OFF_KV_FULL (OFF_DD + STAGES * BLOCK_M * 4)            // mbarriers: kv_full, q_full[STAGES],
#define OFF_Q_FULL (OFF_KV_FULL + 8)                           // empty[STAGES]
#define OFF_EMPTY (OFF_Q_FULL + 8 * STAGES)

// the consumers' view: generic pointers
struct BwdSmem {
    unsigned char *k, *v, *q, *dO, *ds;
    float *lse, *dd;
    u64 *kv_full, *q_full, *empty;
};
__device__ __forceinline__ BwdSmem carve_bwd_smem(unsigned char* raw) {
    BwdSmem sm;
    sm.k = (unsigned char*)(((size_t)raw + SWIZZLE_ATOM_BYTES - 1) & ~(size_t)(SWIZZLE_ATOM_BYTES - 1));
    sm.v = sm.k + OFF_V;
    sm.q = sm.k + OFF_Q;
    sm.dO = sm.k + OFF_DO;
    sm.ds = sm.k + OFF_DS;
    sm.lse = (float*)(sm.k + OFF_LSE);
    sm.dd = (float*)(sm.k + OFF_DD);
    sm.kv_full = (u64*)(sm.k + OFF_KV_FULL);
    sm.q_full = (u64*)(sm.k + OFF_Q_FULL);
    sm.empty = (u64*)(sm.k + OFF_EMPTY);
    return sm;
}
// The producer's view: one 32-bit shared-window address (the aligned base), every other one a
// constant offset from it.  A producer thread has 32 registers after setmaxnreg, too few to
// keep ten 64-bit pointers beside its loop; these wrappers are mbarrier.cuh's and
// hopper_common.cuh's instructions on 32-bit addresses.
__device__ __forceinline__ u32 smem_base_at(unsigned char* raw) {
    return (smem_addr(raw) + SWIZZLE_ATOM_BYTES - 1) & ~(u32)(SWIZZLE_ATOM_BYTES - 1);
}
__device__ __forceinline__ void mbar_arrive_expect_tx_at(u32 bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_at(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait_at(u32 bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n"
        :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_3d_at(u32 dst, const TmaMap* map, u32 bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void st_shared_f32(u32 addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(x) : "memory");
}

// Copied forward from bwd_v3.cu (a recorded version's file is never changed under it):
// the wgmma descriptors of the SRAM tiles (hopper_common.cuh's smem_desc_k_major and
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

// write this warpgroup's dS_ij^T -> SRAM (16 bits; ds: its 64 rows of the 128-key tile) in the
// 128-byte-swizzled layout wgmma reads: row = key (16 warp + g, + 8), 128 bytes = Br queries; the 16-byte chunk c of row r sits at c ^ (r % 8)
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

// does warpgroup c's half of tile j (keys k0 .. k0 + 63) hold a key some row of [r0, r_last] must
// not see? (hopper_tile.cuh's tile_needs_mask, for 64 of the tile's 128 keys)
__device__ __forceinline__ bool half_needs_mask(const AttnShape& p, int k0, int r0, int r_last) {
    const int off = p.nk - p.nq, k1 = k0 + WG_KEYS - 1;
    return k1 >= p.nk || (p.right >= 0 && k1 > r0 + off + p.right) || (p.left >= 0 && k0 < r_last + off - p.left);
}

// The Q tiles of the query rows that can see a key of this block's tile (the band's diagonal
// bounds), and the (query head, Q tile) steps over them, head-major.  Each warpgroup computes
// it after its own setmaxnreg, in its own branch (with setmaxnreg in an if / else and the work
// computed once after it, ptxas ignored setmaxnreg, C7507, and spilled).
struct BlockBand { int qt_lo, n_qt, n_it; };
__device__ __forceinline__ BlockBand block_band(int jt, int nq, int nk, int heads_q, int heads_kv, int left, int right) {
    const int j0 = jt * BLOCK_N, nk_tile = min(BLOCK_N, nk - j0), off = nk - nq;
    const int i_lo = right >= 0 ? max(0, j0 - right - off) : 0;
    const int i_hi = left >= 0 ? min(nq, j0 + nk_tile - 1 + left - off + 1) : nq;
    BlockBand w;
    w.qt_lo = i_lo / BLOCK_M;
    w.n_qt = i_hi > i_lo ? (i_hi + BLOCK_M - 1) / BLOCK_M - w.qt_lo : 0;
    w.n_it = w.n_qt * (heads_q / heads_kv);
    return w;
}

// The block's work in longest-first order: its K/V tile jt, KV head hk and batch b.  The grid is
// v4's (Tc, Hkv, B); its linear index runs over groups of lpt_pairs (b, hk) pairs, and inside a
// group over the tiles (slow) and the group's pairs (fast).  The last group may hold fewer pairs.
struct BlockTile { int jt, hk, b; };
__device__ __forceinline__ BlockTile block_tile(int lpt_pairs) {
    const int tiles = gridDim.x, pairs = gridDim.y * gridDim.z;
    const int linear = blockIdx.x + tiles * (blockIdx.y + gridDim.y * blockIdx.z);
    const int group = linear / (lpt_pairs * tiles), within = linear - group * lpt_pairs * tiles;
    const int first = group * lpt_pairs, in_group = min(lpt_pairs, pairs - first);
    const int pair = first + within % in_group;
    BlockTile bt;
    bt.jt = within / in_group;
    bt.hk = pair % gridDim.y;
    bt.b = pair / gridDim.y;
    return bt;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
bwd_v5_main(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
            const __grid_constant__ TmaMap map_v, const __grid_constant__ TmaMap map_do,
            const float* __restrict__ LSE, const float* __restrict__ Dv, u16* __restrict__ dK,
            u16* __restrict__ dV, float* __restrict__ dQacc, int nq, int nk, int heads_q, int heads_kv,
            float scale, int left, int right, int lpt_pairs) {
    extern __shared__ unsigned char smem_raw[];
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        const BwdSmem sm = carve_bwd_smem(smem_raw);
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
        setmaxnreg_dec<PRODUCER_REGS>();
        const BlockTile bt = block_tile(lpt_pairs);
        const BlockBand w = block_band(bt.jt, nq, nk, heads_q, heads_kv, left, right);
        if (threadIdx.x >= 64 || w.n_it == 0) return;
        const int hk = bt.hk, b = bt.b, group = heads_q / heads_kv;
        const u32 base = smem_base_at(smem_raw);
        if (threadIdx.x < 32) {
            // warp 0: one thread asks the copy engine for the tiles
            if (threadIdx.x != 0) return;
            const int j0 = bt.jt * BLOCK_N, z = b * heads_kv + hk;
            mbar_arrive_expect_tx_at(base + OFF_KV_FULL, 2 * KV_TILE_BYTES);  // load K_j, V_j -> SRAM, once
#pragma unroll
            for (int pnl = 0; pnl < D_PANELS; ++pnl) {
                tma_load_3d_at(base + pnl * KV_PANEL_BYTES, &map_k, base + OFF_KV_FULL, pnl * PANEL, j0, z);
                tma_load_3d_at(base + OFF_V + pnl * KV_PANEL_BYTES, &map_v, base + OFF_KV_FULL, pnl * PANEL, j0, z);
            }
            for (int it = 0; it < w.n_it; ++it) {    // load Q_i, dO_i -> SRAM stage s
                const int s = it % STAGES;
                const int bh = b * heads_q + hk * group + it / w.n_qt;
                const int i0 = (w.qt_lo + it % w.n_qt) * BLOCK_M;
                const u32 q_full = base + OFF_Q_FULL + 8 * s;
                mbar_wait_at(base + OFF_EMPTY + 8 * s, ((it / STAGES) & 1) ^ 1);   // both consumers are done with stage s
                mbar_arrive_expect_tx_at(q_full, 2 * Q_TILE_BYTES);
#pragma unroll
                for (int pnl = 0; pnl < D_PANELS; ++pnl) {
                    const u32 at = s * Q_TILE_BYTES + pnl * Q_PANEL_BYTES;
                    tma_load_3d_at(base + OFF_Q + at, &map_q, q_full, pnl * PANEL, i0, bh);
                    tma_load_3d_at(base + OFF_DO + at, &map_do, q_full, pnl * PANEL, i0, bh);
                }
            }
            return;
        }
        // warp 1: LSE_i, D_i -> SRAM stage s by ordinary loads (bwd_v3's producer warp did both
        // jobs; split, each fits the producer's 32 registers)
        const int lane = threadIdx.x % 32;
        for (int it = 0; it < w.n_it; ++it) {
            const int s = it % STAGES;
            const int bh = b * heads_q + hk * group + it / w.n_qt;
            const int i0 = (w.qt_lo + it % w.n_qt) * BLOCK_M;
            mbar_wait_at(base + OFF_EMPTY + 8 * s, ((it / STAGES) & 1) ^ 1);
#pragma unroll
            for (int r = lane; r < BLOCK_M; r += 32) {
                const int row = i0 + r;
                const float l = row < nq ? LSE[(size_t)bh * nq + row] : neg_inf_f();
                const u32 at = 4 * (s * BLOCK_M + r);
                // +inf: exp2(S scale log2 e - inf) = 0, a row past Nq or that sees no key
                st_shared_f32(base + OFF_LSE + at, l == neg_inf_f() ? __int_as_float(0x7f800000) : l * LOG2E);
                st_shared_f32(base + OFF_DD + at, row < nq ? Dv[(size_t)bh * nq + row] : 0.f);
            }
            mbar_arrive_at(base + OFF_Q_FULL + 8 * s);   // release: LSE_i, D_i stored
        }
        return;
    }

    // ---------------------------------------------------------------- consumers: the products
    setmaxnreg_inc<CONSUMER_REGS>();
    const BwdSmem sm = carve_bwd_smem(smem_raw);
    const BlockTile bt = block_tile(lpt_pairs);
    const BlockBand w = block_band(bt.jt, nq, nk, heads_q, heads_kv, left, right);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale * LOG2E, left, right};
    const int jt = bt.jt, hk = bt.hk, b = bt.b;
    const int j0 = jt * BLOCK_N, group = heads_q / heads_kv, qt_lo = w.qt_lo, n_qt = w.n_qt, n_it = w.n_it;
    const int c = wg - 1;                            // this warpgroup's half of the K/V tile
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int k0 = j0 + WG_KEYS * c;                 // its first key
    const int key_a = k0 + 16 * warp + g;            // this thread's keys: key_a, key_a + 8
    const u32 half_bytes = WG_KEYS * PANEL_BYTES;    // its rows' offset in a 128-row panel of K_j, V_j, dS^T
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
        // this step's SRAM addresses of K_j, V_j (this warpgroup's rows), Q_i, dO_i, dS^T (see `fresh`)
        const u32 k_at = fresh(smem_addr(sm.k)), v_at = fresh(smem_addr(sm.v));
        const u32 q_at = fresh(smem_addr(qt)), do_at = fresh(smem_addr(dot)), ds_at = fresh(smem_addr(ds));
        mbar_wait(&sm.q_full[s], (it / STAGES) & 1);                 // Q_i, dO_i, LSE_i, D_i in

        // S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T for this warpgroup's 64 keys (SRAM x SRAM)
        float st[ST_REGS], dpt[ST_REGS];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KD_STEPS; ++kk) {
            const int pnl = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
            WGMMA_T(st, desc_k_major_at(k_at + pnl * KV_PANEL_BYTES + half_bytes * c + within),
                    desc_k_major_at(q_at + pnl * Q_PANEL_BYTES + within), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < KD_STEPS; ++kk) {
            const int pnl = kk / 4, within = (kk % 4) * 16 * ELEM_BYTES;
            WGMMA_T(dpt, desc_k_major_at(v_at + pnl * KV_PANEL_BYTES + half_bytes * c + within),
                    desc_k_major_at(do_at + pnl * Q_PANEL_BYTES + within), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(st);
        fence_regs(dpt);

        // P_ij^T, dS_ij^T in registers (16 bits, as A fragments); the mask only where this
        // warpgroup's 64 keys cross the band's edge
        const float* lse2 = sm.lse + s * BLOCK_M;
        const float* dd = sm.dd + s * BLOCK_M;
        u32 pa[KQ_STEPS][4], sa[KQ_STEPS][4];
        if (half_needs_mask(p, k0, i0, min(i0 + BLOCK_M, nq) - 1))
            p_ds_fragments<true>(st, dpt, pa, sa, lse2, dd, p, key_a, i0);
        else p_ds_fragments<false>(st, dpt, pa, sa, lse2, dd, p, key_a, i0);

        // write this warpgroup's rows of dS_ij^T -> SRAM for the dQ product
        store_ds_t(ds + half_bytes * c, sa);
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
        // both warpgroups' halves of dS^T must be in SRAM before either dQ product reads them
        named_bar_sync(CONSUMER_BAR, CONSUMER_THREADS);
        wgmma_wait<0>();
        // this thread is done with stage s: every consumer thread arrives, so each one's reads
        // of LSE_i, D_i (p_ds_fragments) are released by its own arrival before the producer's
        // warp 1 overwrites them with ordinary stores (one arrival a warp after the named barrier
        // orders them too, through the barrier, but compute-sanitizer's racecheck reported those
        // reads racing with the next stores: a write-after-read it could not see ordered)
        mbar_arrive(&sm.empty[s]);

        // dQ_i's panel pnl = dS_ij K_j over all 128 keys (SRAM x SRAM: dS MN-major through the
        // transpose-A bit, K_j MN-major); the warpgroups take the panels in turns
        const int pnl = (c + it) % DQ_PANELS;
        if (pnl < D_PANELS) {
            float dq[DQ_REGS];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KK_STEPS; ++kk)
                WGMMA_DQ(dq, desc_mn_major_at(ds_at + kk * 16 * PANEL_BYTES, DS_TILE_BYTES),
                         desc_mn_major_at(k_at + pnl * KV_PANEL_BYTES + kk * 16 * PANEL_BYTES, KV_PANEL_BYTES),
                         kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(dq);

            // add dQ_i's panel -> HBM (float32 reductions; DETERMINISTIC: plain stores into slot j)
            float* dq_base = dQacc + ((size_t)b * heads_q + h) * nq * HEAD_DIM + pnl * PANEL;
#if DETERMINISTIC
            dq_base += (size_t)jt * gridDim.z * heads_q * nq * HEAD_DIM;
#endif
            const int qa = i0 + 16 * warp + g;       // this thread's query rows: qa, qa + 8
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = qa + 8 * hh;
                if (row < nq) {
                    float* dst = dq_base + (size_t)row * HEAD_DIM + 2 * t;
#pragma unroll
                    for (int n = 0; n < PANEL / 8; ++n)
                        dq_put2(dst + 8 * n, dq[4 * n + 2 * hh] * scale, dq[4 * n + 2 * hh + 1] * scale);
                }
            }
        }
    }
    wgmma_wait<0>();
    fence_regs(dk);
    fence_regs(dv);

    // write dK_j (times scale), dV_j -> HBM for this warpgroup's 64 keys, once
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
