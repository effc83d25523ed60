// bwd_v2.cu -- FlashAttention-2 backward, version 2: float16 / bfloat16 on the tensor cores.
//
// The algorithm of bwd_v1.cu (FlashAttention-2's Algorithm 2, Dao 2023), with every product
// on the tensor cores (mma.sync m16n8k16, float32 accumulators) and operands read from SRAM
// with ldmatrix.  The row sums D_i = rowsum(dO_i * O_i) and the final dQ conversion are
// bwd_v1.cu's kernels (bwd_rowsum, bwd_finish); this file is the main loop, bwd_v2_main.
//
// One thread block owns one K/V tile j of Bc = 16 * NUM_WARPS keys of one KV head of one
// sequence; warp w owns keys 16w .. 16w + 15 of it for the whole kernel.  Per Q tile i
// (Br rows), for every query head of the GQA group:
//
//   S_ij^T  = K_j Q_i^T                 (per warp 16 x Br, registers)
//   P_ij^T  = exp(scale S_ij^T - LSE_i) (registers; 0 where masked or LSE_i = -inf)
//   dP_ij^T = V_j dO_i^T                (per warp 16 x Br, registers)
//   dS_ij^T = P_ij^T * (dP_ij^T - D_i)  (registers)
//   dV_j   += P_ij^T dO_i               (registers, over every i and every head of the group)
//   dK_j   += dS_ij^T Q_i               (registers; times scale once, at the end)
//   dQ_i   += scale dS_ij K_j           (dS_ij^T -> SRAM in 16 bits; -> HBM by atomic adds,
//                                        or one partial a K/V tile: DETERMINISTIC)
//
// Why the transposed orientation: a warp that owns 16 keys computes S^T and dP^T with its
// keys as the rows of the accumulator, and the accumulator layout of an m16n8k16 product is
// exactly the A-operand layout of the next one (as P in fa_v2.cu).  So P^T and dS^T feed
// dV_j += P^T dO_i and dK_j += dS^T Q_i straight from registers, converted to 16 bits in
// place.  Only dQ_i = dS_ij K_j needs dS with the queries as rows: dS^T goes through SRAM
// once (16 bits) and is read back transposed by ldmatrix.trans.
//
// What lives where:
//   registers  dK_j, dV_j (16 keys x D_PAD a warp: D_PAD / 2 floats each a lane),
//              S^T / P^T and dP^T / dS^T (16 x Br a warp: Br / 2 floats each a lane)
//   SRAM       K_j, V_j [Bc][SROW] for the whole kernel; Q_i, dO_i [2][Br][SROW] and
//              LSE_i, D_i [2][Br] double-buffered (tile i + 1 arrives by cp.async while
//              tile i is used); dS_ij^T [Bc][Br + 8]
//   HBM        Q, K, V, dO, LSE, D read; dK, dV written once; dQaccum (float32) added to
//
// Notation as in iokernels/backward.py: Br (BLOCK_Q), Bc (BLOCK_KV), Tr = ceil(Nq / Br),
// Tc = ceil(Nk / Bc), D_i, S_ij, P_ij, dP_ij, dS_ij.
//
// Tile sizes.  FlashAttention-2 runs 8 warps with Bc = 128, and Br = 128 at d = 64 and Br = 64
// at d = 128 where a block may take 144 KB of shared memory (less: Br = 64 at d = 64, Bc = 64 at
// d = 128; csrc/flash_attn/src/flash_bwd_launch_template.h, code).  Here Bc = 16 * NUM_WARPS: 8 warps give Bc = 128, so each Q_i,
// dO_i read into SRAM feeds 128 keys.  Br is bounded by registers: dK_j, dV_j take D_PAD
// floats a lane together, S^T and dP^T another Br, and the fragments and addresses need
// the rest of the 255 registers a thread may have; so the default Br is 64 while
// D_PAD + Br <= 160 (d <= 96) and 32 above (at d = 128, Br = 64 spills a few registers).
// The defaults (BackwardConfig) shrink Bc, then Br, until the SRAM fits the GPU.  Head dims
// up to 128; one that is not a multiple of 16 is padded with zero columns, and rows that
// are not whole 16-byte chunks are copied element by element.
//
// Causal / window: the Q tiles that see no key of tile j are never loaded; the mask is
// applied only where a (Q tile, K/V tile) pair crosses a boundary of the visible band, or
// where the K/V tile runs past Nk (its zero rows must not reach dQ).  Rows past Nq read
// LSE = -inf, so their P is 0: zero-filled rows add nothing.
//
// What it leaves out: Hopper's wgmma and TMA, and splitting a K/V tile's Q loop over
// several blocks; the dQ atomics are FlashAttention-2's, one float32 add per element per
// K/V tile.
//
// Compile-time settings (-D from BackwardConfig): HEAD_DIM, D_PAD, NUM_WARPS, BLOCK_Q (Br,
// a multiple of 16), VEC_IO, DETERMINISTIC, IK_DTYPE (1 float16, 2 bfloat16).
#include "common.cuh"

#ifndef HEAD_DIM
#error "bwd_v2.cu: -DHEAD_DIM is missing (BackwardConfig.defines passes it)"
#endif
#ifndef D_PAD
#error "bwd_v2.cu: -DD_PAD is missing (BackwardConfig.defines passes it)"
#endif
#ifndef NUM_WARPS
#error "bwd_v2.cu: -DNUM_WARPS is missing (BackwardConfig.defines passes it)"
#endif
#ifndef BLOCK_Q
#error "bwd_v2.cu: -DBLOCK_Q is missing (BackwardConfig.defines passes it)"
#endif
#ifndef VEC_IO
#error "bwd_v2.cu: -DVEC_IO is missing (BackwardConfig.defines passes it)"
#endif
#ifndef DETERMINISTIC
#error "bwd_v2.cu: -DDETERMINISTIC is missing (BackwardConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "bwd_v2 is the 16-bit tensor-core kernel: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if BLOCK_Q % 16 != 0
#error "BLOCK_Q (Br) must be a multiple of 16 (the m16n8k16 k-steps of dV, dK run over it)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#define BLOCK_KV (16 * NUM_WARPS)         // Bc: 16 keys a warp
#define SROW (D_PAD + 8)                  // Q, dO, K, V row stride in SRAM (16-bit elements)
#define DSROW (BLOCK_Q + 8)               // dS^T row stride: 8 ldmatrix rows in 8 bank groups
#define CHUNKS (D_PAD / 8)                // 16-byte chunks a row
#define NT_Q (BLOCK_Q / 8)                // 8-column n-tiles of S^T, dP^T (queries)
#define NT_D (D_PAD / 8)                  // 8-column n-tiles of dK, dV, dQ (head dims)
#define KT_D (D_PAD / 16)                 // 16-deep k-steps over the head dim
#define LOG2E 1.4426950408889634f         // exp(x) = exp2(x * log2 e)

#include "mma_common.cuh"

// dQaccum[p], dQaccum[p + 1] += a, b (DETERMINISTIC: = a, b, into this K/V tile's own slot);
// `two`: p + 1 is still inside the row.  sm_90 adds both with one vector reduction
// (red.global.add.v2.f32; 8-byte aligned when HEAD_DIM is even), older GPUs with two atomics.
__device__ __forceinline__ void dq_put(float* p, float a, float b, bool two) {
#if DETERMINISTIC
    p[0] = a;
    if (two) p[1] = b;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && HEAD_DIM % 2 == 0
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    if (two) atomicAdd(p + 1, b);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
bwd_v2_main(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
            const elem_t* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ Dv,
            elem_t* __restrict__ dK, elem_t* __restrict__ dV, float* __restrict__ dQacc,
            int nq, int nk, int heads_q, int heads_kv,
            long long sqb, long long sqh, long long sqn, long long skb, long long skh, long long skn,
            long long svb, long long svh, long long svn, long long sdb, long long sdh, long long sdn,
            float scale, int win_left, int win_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* Ks = reinterpret_cast<u16*>(smem_raw);      // [BLOCK_KV][SROW]
    u16* Vs = Ks + BLOCK_KV * SROW;                  // [BLOCK_KV][SROW]
    u16* Qs = Vs + BLOCK_KV * SROW;                  // [2][BLOCK_Q][SROW]
    u16* dOs = Qs + 2 * BLOCK_Q * SROW;              // [2][BLOCK_Q][SROW]
    u16* dSs = dOs + 2 * BLOCK_Q * SROW;             // [BLOCK_KV][DSROW]: dS_ij^T
    float* Ls = reinterpret_cast<float*>(dSs + BLOCK_KV * DSROW);   // [2][BLOCK_Q]: LSE_i log2 e
    float* Ds = Ls + 2 * BLOCK_Q;                    // [2][BLOCK_Q]: D_i

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;            // mma fragment coordinates
    const int j0 = blockIdx.x * BLOCK_KV, hk = blockIdx.y, b = blockIdx.z;
    const int group = heads_q / heads_kv;
    const int nk_tile = min(BLOCK_KV, nk - j0);
    const float scale_log2 = scale * LOG2E;
    // this lane's two keys (rows g and g + 8 of its warp's 16)
    const int key0 = j0 + warp * 16 + g, key1 = key0 + 8;

    // the query rows that can see a key of this tile (the band's diagonal bounds), as Q tiles
    int i_lo = 0, i_hi = nq;
    if (win_right >= 0) i_lo = max(0, j0 - win_right - (nk - nq));
    if (win_left >= 0) i_hi = min(nq, j0 + nk_tile - 1 + win_left - (nk - nq) + 1);
    const int qt_lo = i_lo / BLOCK_Q;
    const int n_qt = i_hi > i_lo ? (i_hi + BLOCK_Q - 1) / BLOCK_Q - qt_lo : 0;
    const int n_it = n_qt * group;                   // (query head, Q tile) pairs, head-major

    float dk[NT_D][4], dv[NT_D][4];
#pragma unroll
    for (int n = 0; n < NT_D; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

    // load Q_i, dO_i, LSE_i, D_i of iteration `it` -> SRAM buffer `buf` (cp.async for Q, dO)
    auto load_q_tile = [&](int it, int buf) {
        const int h = hk * group + it / n_qt;
        const int i0 = (qt_lo + it % n_qt) * BLOCK_Q;
        load_tile<BLOCK_Q>(Qs + buf * BLOCK_Q * SROW, Q + b * sqb + h * sqh, sqn, i0, nq);
        load_tile<BLOCK_Q>(dOs + buf * BLOCK_Q * SROW, dO + b * sdb + h * sdh, sdn, i0, nq);
        for (int r = threadIdx.x; r < BLOCK_Q; r += NTHREADS) {
            long long row = ((long long)b * heads_q + h) * nq + i0 + r;
            float lse = i0 + r < nq ? LSE[row] : neg_inf_f();
            Ls[buf * BLOCK_Q + r] = lse == neg_inf_f() ? lse : lse * LOG2E;
            Ds[buf * BLOCK_Q + r] = i0 + r < nq ? Dv[row] : 0.f;
        }
    };

    // load K_j, V_j -> SRAM (resident), with the first Q tile (one asynchronous group)
    load_tile<BLOCK_KV>(Ks, K + b * skb + hk * skh, skn, j0, nk);
    load_tile<BLOCK_KV>(Vs, V + b * svb + hk * svh, svn, j0, nk);
    if (n_it > 0) load_q_tile(0, 0);
    cp_async_commit();

    for (int it = 0; it < n_it; ++it) {              // loop over (query head, Q tile i)
        const int buf = it & 1;
        const int h = hk * group + it / n_qt;
        const int i0 = (qt_lo + it % n_qt) * BLOCK_Q;
        // load Q_i+1, dO_i+1, LSE_i+1, D_i+1 -> SRAM (the other buffer) while tile i is used
        if (it + 1 < n_it) load_q_tile(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();                          // tile i (and K_j, V_j) have landed
        __syncthreads();
        const u16* Qt = Qs + buf * BLOCK_Q * SROW;
        const u16* dOt = dOs + buf * BLOCK_Q * SROW;
        const float* Lt = Ls + buf * BLOCK_Q;
        const float* Dt = Ds + buf * BLOCK_Q;

        // S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T on the tensor cores (registers)
        float s[NT_Q][4], dp[NT_Q][4];
#pragma unroll
        for (int n = 0; n < NT_Q; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KT_D; ++kk) {
            u32 ka[4], va[4];                        // this warp's 16 keys x 16 dims of K_j, V_j
            const int arow = (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * SROW + kk * 16 + (lane / 16) * 8;
            ldmatrix_x4(ka, Ks + arow);
            ldmatrix_x4(va, Vs + arow);
#pragma unroll
            for (int nn = 0; nn < NT_Q / 2; ++nn) {
                u32 qb[4], ob[4];                    // two n-tiles (queries nn*16 .. +15) x 16 dims
                const int brow = (nn * 16 + (lane % 8) + (lane / 16) * 8) * SROW + kk * 16 + ((lane / 8) % 2) * 8;
                ldmatrix_x4(qb, Qt + brow);
                ldmatrix_x4(ob, dOt + brow);
                mma16816(s[2 * nn], ka, qb[0], qb[1]);
                mma16816(s[2 * nn + 1], ka, qb[2], qb[3]);
                mma16816(dp[2 * nn], va, ob[0], ob[1]);
                mma16816(dp[2 * nn + 1], va, ob[2], ob[3]);
            }
        }

        // P_ij^T = exp2(S^T scale log2 e - LSE_i log2 e), dS_ij^T = P^T (dP^T - D_i); the
        // visibility mask only on tile pairs that cross the band's edge or run past Nk
        const int last = min(i0 + BLOCK_Q, nq) - 1;
        const bool need_mask = !(key_lo(last, nq, nk, win_left) <= j0 &&
                                 key_hi(i0, nq, nk, win_right) >= j0 + BLOCK_KV);
#pragma unroll
        for (int n = 0; n < NT_Q; ++n) {
            const int c = n * 8 + 2 * t;             // this lane's two query columns c, c + 1
            const float2 lse = *reinterpret_cast<const float2*>(Lt + c);
            const float2 dd = *reinterpret_cast<const float2*>(Dt + c);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float l = (e & 1) ? lse.y : lse.x;
                const float di = (e & 1) ? dd.y : dd.x;
                bool live = l != neg_inf_f();        // a fully masked row has no gradient
                if (need_mask) {
                    const int qi = i0 + c + (e & 1), key = (e < 2) ? key0 : key1;
                    live = live && key >= key_lo(qi, nq, nk, win_left) && key < key_hi(qi, nq, nk, win_right);
                }
                const float p = live ? fast_exp2(s[n][e] * scale_log2 - l) : 0.f;
                s[n][e] = p;                         // P_ij^T
                dp[n][e] = p * (dp[n][e] - di);      // dS_ij^T
            }
        }

        // dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i on the tensor cores; P^T and dS^T's
        // accumulators become A fragments (16 keys x 16 queries a k-step)
#pragma unroll
        for (int kk = 0; kk < BLOCK_Q / 16; ++kk) {
            u32 pa[4], sa[4];
            pa[0] = pack2_cvt_each(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack2_cvt_each(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack2_cvt_each(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack2_cvt_each(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            sa[0] = pack2_cvt_each(dp[2 * kk][0], dp[2 * kk][1]);
            sa[1] = pack2_cvt_each(dp[2 * kk][2], dp[2 * kk][3]);
            sa[2] = pack2_cvt_each(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
            sa[3] = pack2_cvt_each(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            // write dS_ij^T -> SRAM (16 bits; this warp's 16 key rows) for the dQ product
            u16* w = dSs + (warp * 16 + g) * DSROW + kk * 16 + 2 * t;
            *reinterpret_cast<u32*>(w) = sa[0];
            *reinterpret_cast<u32*>(w + 8 * DSROW) = sa[1];
            *reinterpret_cast<u32*>(w + 8) = sa[2];
            *reinterpret_cast<u32*>(w + 8 * DSROW + 8) = sa[3];
#pragma unroll
            for (int dn = 0; dn < NT_D / 2; ++dn) {
                u32 ob[4], qb[4];                    // 16 queries x two n-tiles of 8 dims, transposed
                const int brow = (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * SROW + dn * 16 + (lane / 16) * 8;
                ldmatrix_x4_trans(ob, dOt + brow);
                ldmatrix_x4_trans(qb, Qt + brow);
                mma16816(dv[2 * dn], pa, ob[0], ob[1]);
                mma16816(dv[2 * dn + 1], pa, ob[2], ob[3]);
                mma16816(dk[2 * dn], sa, qb[0], qb[1]);
                mma16816(dk[2 * dn + 1], sa, qb[2], qb[3]);
            }
        }
        __syncthreads();                             // dS_ij^T complete in SRAM

        // dQ_i += scale dS_ij K_j: 16 queries x 16 dims a unit, the units dealt out to the
        // warps; dS_ij read transposed from dS_ij^T, K_j as the B operand (transposed)
        float* dq_base = dQacc + ((long long)b * heads_q + h) * nq * HEAD_DIM;
#if DETERMINISTIC
        dq_base += (long long)blockIdx.x * gridDim.z * heads_q * nq * HEAD_DIM;   // slot j
#endif
        for (int u = warp; u < (BLOCK_Q / 16) * KT_D; u += NUM_WARPS) {
            const int mt = u % (BLOCK_Q / 16), dpair = u / (BLOCK_Q / 16);
            float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < BLOCK_KV / 16; ++kk) {
                u32 a[4], kb[4];
                ldmatrix_x4_trans(a, dSs + (kk * 16 + (lane % 8) + (lane / 16) * 8) * DSROW
                                         + mt * 16 + ((lane / 8) % 2) * 8);
                ldmatrix_x4_trans(kb, Ks + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * SROW
                                          + dpair * 16 + (lane / 16) * 8);
                mma16816(acc[0], a, kb[0], kb[1]);
                mma16816(acc[1], a, kb[2], kb[3]);
            }
            // add dQ_i -> HBM (atomic adds; DETERMINISTIC: a plain store to this tile's slot)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {            // rows g and g + 8
                    const int row = i0 + mt * 16 + g + half * 8;
                    const int col = dpair * 16 + nt * 8 + 2 * t;
                    if (row < nq && col < HEAD_DIM)
                        dq_put(dq_base + (long long)row * HEAD_DIM + col, acc[nt][2 * half] * scale,
                               acc[nt][2 * half + 1] * scale, col + 1 < HEAD_DIM);
                }
        }
        // the next iteration's first barrier keeps dS_ij^T until every warp has read it
    }
    cp_async_wait<0>();

    // write dK_j (times scale), dV_j -> HBM, once
    const long long kv_base = ((long long)b * heads_kv + hk) * nk;
#pragma unroll
    for (int n = 0; n < NT_D; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = (e < 2) ? key0 : key1;
            const int col = n * 8 + 2 * t + (e & 1);
            if (key < nk && col < HEAD_DIM) {
                dK[(kv_base + key) * HEAD_DIM + col] = from_acc(dk[n][e] * scale);
                dV[(kv_base + key) * HEAD_DIM + col] = from_acc(dv[n][e]);
            }
        }
}
