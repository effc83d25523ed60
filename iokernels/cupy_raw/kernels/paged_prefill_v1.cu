// paged_prefill_v1.cu -- prefill on a paged KV cache, version 1: fa_v2's tensor-core forward
// with its K/V tiles read through each sequence's block table, one launch for a packed batch.
//
// What it adds to fa_v2.cu (the rest -- a warp owns 16 query rows, S = Q K^T and O += P V on
// mma.sync m16n8k16 with float32 accumulators, S and P in registers, the online softmax in
// exp2 units, K_j / V_j double-buffered with cp.async -- is fa_v2's, copied forward):
//   * paged K/V: the keys live in pools (num_blocks, PAGE_SIZE, Hkv, d); key t of sequence b
//     is slot t % PAGE_SIZE of block tables[b][t / PAGE_SIZE].  A K tile of Bc keys spans
//     Bc / PAGE_SIZE cache blocks (Bc = 64 = 4 blocks of 16 by default), so each mma still
//     sees a full tile; every row of the tile takes its base address from the table (16-byte
//     cp.async chunks, as fa_v2's contiguous rows);
//   * varlen: one launch serves a packed batch of chunks.  Grid (Q tile, query head,
//     sequence): block (x, h, b) reads its chunk's offsets cu_q[b], cu_q[b + 1] and the
//     sequence's cached length seq_lens[b] on the device, and exits when the chunk has fewer
//     than x + 1 tiles (the host sizes the grid by an upper bound; it never reads a length);
//   * bottom-right causal per sequence: the chunk is the LAST nq of the n cached tokens, so
//     chunk row i sees key j iff j <= i + n - nq; K tiles entirely in the future of the Q
//     tile's last row are never read, the unwritten tail of the last block never is;
//   * O packed (total_q, Hq, d) and LSE at (head, token) strides the launcher passes.
// A row that sees no key (a chunk longer than its sequence) writes O = 0 and LSE = -inf.
//
// What it leaves out: the g query heads of a KV head are g thread blocks that each read the
// K/V tiles (L2 serves the repeats; packing them into one tile's rows is the next idea); a
// short chunk (a decode row) still runs a whole Br-row tile of tensor-core work.
//
// Compile-time settings (-D from PagedPrefillConfig.defines; none has a default here):
// HEAD_DIM, D_PAD (HEAD_DIM rounded up to 16), NUM_WARPS (Br = 16 * NUM_WARPS), BLOCK_K (Bc,
// a multiple of 16), PAGE_SIZE (the cache's block size), IK_DTYPE (1 float16, 2 bfloat16),
// VEC_IO (1 when every row is whole, aligned 16-byte chunks).
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "paged_prefill_v1.cu: -DHEAD_DIM is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef D_PAD
#error "paged_prefill_v1.cu: -DD_PAD is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef NUM_WARPS
#error "paged_prefill_v1.cu: -DNUM_WARPS is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef BLOCK_K
#error "paged_prefill_v1.cu: -DBLOCK_K is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef PAGE_SIZE
#error "paged_prefill_v1.cu: -DPAGE_SIZE is missing (PagedPrefillConfig.defines passes it)"
#endif
#ifndef VEC_IO
#error "paged_prefill_v1.cu: -DVEC_IO is missing (PagedPrefillConfig.defines passes it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "paged_prefill_v1 is a 16-bit tensor-core kernel: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if BLOCK_K % 16 != 0
#error "paged_prefill_v1.cu: BLOCK_K must be a multiple of 16 (one mma k-step)"
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

// __launch_bounds__(NTHREADS, 1): the register budget of one block an SM; without the 1, ptxas
// caps 8 warps at d = 64 at 128 registers and spills (the SRAM of the K/V buffers bounds the
// blocks an SM holds anyway)
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
paged_prefill_v1(const elem_t* __restrict__ Q, const elem_t* __restrict__ Kp, const elem_t* __restrict__ Vp,
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

    const int h = blockIdx.y, b = blockIdx.z;
    const int qbeg = cu_q[b], nq = cu_q[b + 1] - qbeg; // this sequence's chunk: packed rows [qbeg, qbeg + nq)
    const int n = seq_lens[b];                       // tokens the sequence has cached, the chunk's included
    const int qtile = gridDim.x - 1 - blockIdx.x;    // heaviest causal tiles first
    const int q0 = qtile * BLOCK_Q;
    if (q0 >= nq) return;                            // this chunk has fewer tiles: the whole block exits

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;            // mma fragment coordinates
    const int hk = h / (heads_q / heads_kv);         // GQA
    const int* table = tables + (long long)b * max_blocks;
    const elem_t* Qb = Q + (long long)qbeg * sq_tok + h * sq_head;
    const elem_t* Kb = Kp + hk * skh;
    const elem_t* Vb = Vp + hk * svh;

    // the keys row i sees: [0, hi(i)), hi(i) = min(n, i + n - nq + 1) (causal) or n
    const int off = n - nq;
    const int last_row = min(q0 + BLOCK_Q, nq) - 1;
    const int kv_hi = causal ? max(0, min(n, last_row + off + 1)) : n;
    const int j_end = (kv_hi + BLOCK_K - 1) / BLOCK_K;   // K tiles past the tile's last row: never read
    const int hi_first = causal ? max(0, min(n, q0 + off + 1)) : n;   // what the tile's first row sees

    // this lane's two rows (g and g + 8 of its warp's 16) and their horizons
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int hi0 = causal ? max(0, min(n, r0 + off + 1)) : n;
    const int hi1 = causal ? max(0, min(n, r1 + off + 1)) : n;
    const float scale_log2 = scale * 1.4426950408889634f;   // exp(x) = exp2(x * log2 e)

    float o[NT_O][4];
#pragma unroll
    for (int nn = 0; nn < NT_O; ++nn) o[nn][0] = o[nn][1] = o[nn][2] = o[nn][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};
    u32 qf[KT_Q][4];                                 // Q_i's A fragments, kept in registers

    // load Q_i (chunk rows, packed) and K_0, V_0 (through the table) -> SRAM, one async group
    load_tile<BLOCK_Q>(Qs, Qb, sq_tok, q0, nq);
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
    // write O_i -> SRAM (this warp's own 16 rows of Q_i's buffer), then rows -> HBM (packed)
    __syncthreads();
    u16* Ow = Qs + warp * 16 * SROW;
#pragma unroll
    for (int nn = 0; nn < NT_O; ++nn) {
        *reinterpret_cast<u32*>(Ow + g * SROW + nn * 8 + 2 * t) = pack2_cvt_each(o[nn][0] * inv[0], o[nn][1] * inv[0]);
        *reinterpret_cast<u32*>(Ow + (g + 8) * SROW + nn * 8 + 2 * t) =
            pack2_cvt_each(o[nn][2] * inv[1], o[nn][3] * inv[1]);
    }
    __syncwarp();
    elem_t* Ob = O + (long long)qbeg * so_tok + h * so_head;
    const int wr0 = q0 + warp * 16;
#if VEC_IO
    for (int idx = lane; idx < 16 * (HEAD_DIM / 8); idx += 32) {
        int r = idx / (HEAD_DIM / 8), c = idx % (HEAD_DIM / 8);
        if (wr0 + r < nq)
            *reinterpret_cast<uint4*>(Ob + (long long)(wr0 + r) * so_tok + c * 8) =
                *reinterpret_cast<const uint4*>(Ow + r * SROW + c * 8);
    }
#else
    for (int idx = lane; idx < 16 * HEAD_DIM; idx += 32) {
        int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        if (wr0 + r < nq) Ob[(long long)(wr0 + r) * so_tok + c] = Ow[r * SROW + c];
    }
#endif
    // write LSE_i -> HBM
    if (t == 0) {
        float* L = LSE + h * sl_head + (long long)qbeg * sl_tok;
        if (r0 < nq) L[(long long)r0 * sl_tok] = lse[0];
        if (r1 < nq) L[(long long)r1 * sl_tok] = lse[1];
    }
}
