// paged_prefill_v2.cu -- prefill on a paged KV cache, version 2: v1 with the g query heads of a
// KV head packed into the rows of one Q tile (FlashAttention's pack_gqa), so each K/V tile is
// read once per KV head instead of once per query head.
//
// What it adds to paged_prefill_v1.cu (everything else -- mma.sync m16n8k16 with float32
// accumulators, S and P in registers, the online softmax in exp2 units, K/V tiles of whole
// cache blocks read through the block table by cp.async into two buffers, bottom-right causal
// per row, varlen chunks packed by cu_q, one launch -- is v1's, copied forward):
//   * GQA packed into the tile: the rows of a Q tile are (chunk token, head-in-group) pairs,
//     packed row R = token * g + head-in-group (g = heads_q / heads_kv), so a tile of Br rows
//     covers Br / g tokens x the g heads (a tile may start or end inside a token's group).
//     Grid (Q tile over the chunk's nq * g packed rows, KV head, sequence): one block reads
//     each K_j, V_j once for all g query heads of its KV head, where v1 ran g blocks that each
//     read it.  Why: with g = 4 or 8 (Llama-style GQA) v1 issues g times the K/V load
//     instructions and L2 traffic for the same bytes, and a short chunk (a few tokens) fills a
//     tile only g times over;
//   * the causal horizon is per row from that row's token: row R sees key j iff
//     j <= R / g + n - nq;
//   * Q is loaded, and O and LSE are written, through each row's (token, head) address.
//
// What it leaves out: a chunk of one row (a decode step) now fills g rows of the tile, but
// with g < 16 most of a warp's 16 rows still idle; g is a run-time value (an integer division
// a row per address, not a shift); head dims 64 and 128, float16 and bfloat16 only (the
// record's check, v1's); a quantized cache is not read.
//
// Compile-time settings (-D from PagedPrefillConfig.defines, v1's; none has a default here):
// HEAD_DIM, D_PAD (HEAD_DIM rounded up to 16), NUM_WARPS (Br = 16 * NUM_WARPS packed rows),
// BLOCK_K (Bc, a multiple of 16), PAGE_SIZE (the cache's block size), IK_DTYPE (1 float16,
// 2 bfloat16), VEC_IO (1 when every row is whole, aligned 16-byte chunks).
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "paged_prefill_v2.cu: -DHEAD_DIM is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef D_PAD
#error "paged_prefill_v2.cu: -DD_PAD is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef NUM_WARPS
#error "paged_prefill_v2.cu: -DNUM_WARPS is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef BLOCK_K
#error "paged_prefill_v2.cu: -DBLOCK_K is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef PAGE_SIZE
#error "paged_prefill_v2.cu: -DPAGE_SIZE is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef VEC_IO
#error "paged_prefill_v2.cu: -DVEC_IO is missing (PagedPrefillConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "paged_prefill_v2 is a 16-bit tensor-core kernel: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if BLOCK_K % 16 != 0
#error "paged_prefill_v2.cu: BLOCK_K must be a multiple of 16 (one mma k-step)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#define BLOCK_Q (16 * NUM_WARPS)          // Br
#define SROW (D_PAD + 8)                  // SRAM row stride, in 16-bit elements (fa_v2.cu)
#define CHUNKS (D_PAD / 8)                // 16-byte chunks a row
#define NT_S (BLOCK_K / 8)                // 8-column n-tiles of S
#define NT_O (D_PAD / 8)                  // 8-column n-tiles of O
#define KT_Q (D_PAD / 16)                 // 16-deep k-steps of Q K^T

#include "mma_common.cuh"

// K or V tile: keys [k0, k0 + BLOCK_K) of one sequence and KV head -> SRAM, each key's row
// found through the block table: key t is slot t % PAGE_SIZE of block table[t / PAGE_SIZE].
// `pool` already points at the KV head (pool + hk * head stride); keys at or past n, and
// columns past HEAD_DIM, become zeros (nothing is read for them).
__device__ __forceinline__ void load_paged_tile(u16* dst, const elem_t* pool, const int* __restrict__ table,
                                                long long sblk, long long sslot, int k0, int n) {
#if VEC_IO
    for (int idx = threadIdx.x; idx < BLOCK_K * CHUNKS; idx += NTHREADS) {
        int r = idx / CHUNKS, c = idx % CHUNKS;
        int key = k0 + r;
        bool ok = (key < n) && (c * 8 < HEAD_DIM);
        const elem_t* g = pool;
        if (ok) g = pool + (long long)__ldg(table + key / PAGE_SIZE) * sblk + (long long)(key % PAGE_SIZE) * sslot
                    + c * 8;
        cp_async16(dst + r * SROW + c * 8, g, ok);
    }
#else
    // rows not whole (or not aligned) 16-byte chunks: element by element, synchronous
    for (int idx = threadIdx.x; idx < BLOCK_K * D_PAD; idx += NTHREADS) {
        int r = idx / D_PAD, c = idx % D_PAD;
        int key = k0 + r;
        u16 x = 0;
        if (key < n && c < HEAD_DIM)
            x = pool[(long long)__ldg(table + key / PAGE_SIZE) * sblk + (long long)(key % PAGE_SIZE) * sslot + c];
        dst[r * SROW + c] = x;
    }
#endif
}

// Q_i -> SRAM, GQA packed: tile row r is packed row R = q0 + r of the chunk, token R / group and
// query head R % group of the KV head's group.  `Qb` points at the chunk's first token and the
// group's first query head; rows at or past `rows` (nq * group), and columns past HEAD_DIM,
// become zeros.
__device__ __forceinline__ void load_q_packed(u16* dst, const elem_t* Qb, long long sq_tok, long long sq_head,
                                              int q0, int rows, int group) {
#if VEC_IO
    for (int idx = threadIdx.x; idx < BLOCK_Q * CHUNKS; idx += NTHREADS) {
        int r = idx / CHUNKS, c = idx % CHUNKS;
        int R = q0 + r;
        bool ok = (R < rows) && (c * 8 < HEAD_DIM);
        const elem_t* g = ok ? Qb + (long long)(R / group) * sq_tok + (long long)(R % group) * sq_head + c * 8 : Qb;
        cp_async16(dst + r * SROW + c * 8, g, ok);
    }
#else
    // rows not whole (or not aligned) 16-byte chunks: element by element, synchronous
    for (int idx = threadIdx.x; idx < BLOCK_Q * D_PAD; idx += NTHREADS) {
        int r = idx / D_PAD, c = idx % D_PAD;
        int R = q0 + r;
        dst[r * SROW + c] = (R < rows && c < HEAD_DIM)
            ? Qb[(long long)(R / group) * sq_tok + (long long)(R % group) * sq_head + c] : (u16)0;
    }
#endif
}

// __launch_bounds__(NTHREADS, 1): the register budget of one block an SM; without the 1, ptxas
// caps 8 warps at d = 64 at 128 registers and spills (the SRAM of the K/V buffers bounds the
// blocks an SM holds anyway)
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
paged_prefill_v2(const elem_t* __restrict__ Q, const elem_t* __restrict__ Kp, const elem_t* __restrict__ Vp,
                 const int* __restrict__ tables, const int* __restrict__ seq_lens, const int* __restrict__ cu_q,
                 elem_t* __restrict__ O, float* __restrict__ LSE,
                 int heads_q, int heads_kv, int max_blocks,
                 long long sq_tok, long long sq_head, long long so_tok, long long so_head,
                 long long skb, long long skn, long long skh,
                 long long svb, long long svn, long long svh,
                 long long sl_head, long long sl_tok,
                 float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* Qs = reinterpret_cast<u16*>(smem_raw);
    u16* Ks = Qs + BLOCK_Q * SROW;                   // [2][BLOCK_K][SROW]
    u16* Vs = Ks + 2 * BLOCK_K * SROW;               // [2][BLOCK_K][SROW]

    const int hk = blockIdx.y, b = blockIdx.z;       // a block serves all g query heads of KV head hk
    const int group = heads_q / heads_kv;            // g: query heads a KV head, packed into the tile's rows
    const int qbeg = cu_q[b], nq = cu_q[b + 1] - qbeg; // this sequence's chunk: packed rows [qbeg, qbeg + nq)
    const int rows = nq * group;                     // the chunk's (token, head-in-group) rows
    const int n = seq_lens[b];                       // tokens the sequence has cached, the chunk's included
    const int qtile = gridDim.x - 1 - blockIdx.x;    // heaviest causal tiles first
    const int q0 = qtile * BLOCK_Q;                  // first packed row of this tile
    if (q0 >= rows) return;                          // this chunk has fewer tiles: the whole block exits

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;            // mma fragment coordinates
    const int* table = tables + (long long)b * max_blocks;
    const elem_t* Qb = Q + (long long)qbeg * sq_tok + (long long)(hk * group) * sq_head;
    const elem_t* Kb = Kp + hk * skh;
    const elem_t* Vb = Vp + hk * svh;

    // the keys packed row R sees: [0, hi(R)), hi(R) = min(n, R / g + n - nq + 1) (causal) or n: its
    // token's horizon, shared by the g rows of that token
    const int off = n - nq;
    const int last_tok = (min(q0 + BLOCK_Q, rows) - 1) / group;
    const int kv_hi = causal ? max(0, min(n, last_tok + off + 1)) : n;
    const int j_end = (kv_hi + BLOCK_K - 1) / BLOCK_K;   // K tiles past the tile's last token: never read
    const int hi_first = causal ? max(0, min(n, q0 / group + off + 1)) : n;   // what the tile's first row sees

    // this lane's two packed rows (g and g + 8 of its warp's 16) and their tokens' horizons
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int hi0 = causal ? max(0, min(n, r0 / group + off + 1)) : n;
    const int hi1 = causal ? max(0, min(n, r1 / group + off + 1)) : n;
    const float scale_log2 = scale * 1.4426950408889634f;   // exp(x) = exp2(x * log2 e)

    float o[NT_O][4];
#pragma unroll
    for (int nn = 0; nn < NT_O; ++nn) o[nn][0] = o[nn][1] = o[nn][2] = o[nn][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};
    u32 qf[KT_Q][4];                                 // Q_i's A fragments, kept in registers

    // load Q_i (packed (token, head) rows) and K_0, V_0 (through the table) -> SRAM, one async group
    load_q_packed(Qs, Qb, sq_tok, sq_head, q0, rows, group);
    if (j_end > 0) {
        load_paged_tile(Ks, Kb, table, skb, skn, 0, n);
        load_paged_tile(Vs, Vb, table, svb, svn, 0, n);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KT_Q; ++kk)                // Q_i: SRAM -> registers, once
        ldmatrix_x4(qf[kk], Qs + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * SROW
                                + kk * 16 + (lane / 16) * 8);

    for (int j = 0; j < j_end; ++j) {                // loop over the visible K_j, V_j tiles
        const int buf = j & 1;
        const int k0 = j * BLOCK_K;
        // load K_j+1, V_j+1 -> SRAM (the other buffer, through the table) while tile j is used
        if (j + 1 < j_end) {
            load_paged_tile(Ks + (buf ^ 1) * BLOCK_K * SROW, Kb, table, skb, skn, k0 + BLOCK_K, n);
            load_paged_tile(Vs + (buf ^ 1) * BLOCK_K * SROW, Vb, table, svb, svn, k0 + BLOCK_K, n);
        }
        cp_async_commit();
        cp_async_wait<1>();                          // tile j has landed
        __syncthreads();
        const u16* Kt = Ks + buf * BLOCK_K * SROW;
        const u16* Vt = Vs + buf * BLOCK_K * SROW;

        // S_ij = Q_i K_j^T on the tensor cores (registers)
        float s[NT_S][4];
        mma_qkt<KT_Q, NT_S>(s, qf, Kt, SROW, lane);

        // scale (log2 units) and mask; the mask only on tiles some row cannot see whole
        const bool need_mask = hi_first < k0 + BLOCK_K;
#pragma unroll
        for (int nn = 0; nn < NT_S; ++nn)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nn][e] * scale_log2;
                if (need_mask) {
                    int col = k0 + nn * 8 + 2 * t + (e & 1);
                    x = col < ((e < 2) ? hi0 : hi1) ? x : neg_inf_f();
                }
                s[nn][e] = x;
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
    // write O_i -> SRAM (this warp's own 16 rows of Q_i's buffer), then rows -> HBM, each packed
    // row R to token R / g, query head hk * g + R % g
    __syncthreads();
    u16* Ow = Qs + warp * 16 * SROW;
#pragma unroll
    for (int nn = 0; nn < NT_O; ++nn) {
        *reinterpret_cast<u32*>(Ow + g * SROW + nn * 8 + 2 * t) = pack2_cvt_each(o[nn][0] * inv[0], o[nn][1] * inv[0]);
        *reinterpret_cast<u32*>(Ow + (g + 8) * SROW + nn * 8 + 2 * t) =
            pack2_cvt_each(o[nn][2] * inv[1], o[nn][3] * inv[1]);
    }
    __syncwarp();
    elem_t* Ob = O + (long long)qbeg * so_tok + (long long)(hk * group) * so_head;
    const int wr0 = q0 + warp * 16;
#if VEC_IO
    for (int idx = lane; idx < 16 * (HEAD_DIM / 8); idx += 32) {
        int r = idx / (HEAD_DIM / 8), c = idx % (HEAD_DIM / 8);
        int R = wr0 + r;
        if (R < rows)
            *reinterpret_cast<uint4*>(Ob + (long long)(R / group) * so_tok + (long long)(R % group) * so_head
                                      + c * 8) = *reinterpret_cast<const uint4*>(Ow + r * SROW + c * 8);
    }
#else
    for (int idx = lane; idx < 16 * HEAD_DIM; idx += 32) {
        int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        int R = wr0 + r;
        if (R < rows) Ob[(long long)(R / group) * so_tok + (long long)(R % group) * so_head + c] = Ow[r * SROW + c];
    }
#endif
    // write LSE_i -> HBM: (query head, token) of each packed row
    if (t == 0) {
        float* L = LSE + (long long)(hk * group) * sl_head + (long long)qbeg * sl_tok;
        if (r0 < rows) L[(long long)(r0 % group) * sl_head + (long long)(r0 / group) * sl_tok] = lse[0];
        if (r1 < rows) L[(long long)(r1 % group) * sl_head + (long long)(r1 / group) * sl_tok] = lse[1];
    }
}
