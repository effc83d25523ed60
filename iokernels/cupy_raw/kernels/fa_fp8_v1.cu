// fa_fp8_v1.cu -- FlashAttention forward for Hopper with FP8 (e4m3) products, and the two small
// kernels that prepare its inputs.  FlashAttention-3's FP8 ideas (Shah, Bikshandi, Zhang,
// Thakkar, Ramani and Dao, 2024: paper) on fa_v4.cu's structure.
//
// What it adds to fa_v4 (warp specialization: a producer warpgroup issues every TMA copy, two
// consumer warpgroups of 64 query rows compute), and why:
//   * both products in e4m3 (wgmma m64n128k32, float32 accumulators): twice the 16-bit
//     tensor-core rate on Hopper and half the bytes of Q, K, V a tile.
//   * block quantization (paper): one float32 scale per (query tile of Br = 128 rows, head) for
//     Q, per (key tile of Bc = 128 keys, KV head) for K and for V; an outlier coarsens only
//     its own tile.  S = (codes of Q_i)(codes of K_j)^T times s_Q s_K: the scales fold into the
//     softmax's factor (one multiply a score, which the softmax does anyway).
//   * V per key tile, like K (what the CPU experiment, iokernels.fp8.fp8_attention, models): the
//     accumulator O is kept in units of the current tile's s_V, so moving to tile j multiplies
//     O's rows by alpha * s_V(j-1) / s_V(j) -- folded into the online softmax's rescale, free --
//     and the epilogue multiplies by the last s_V.  (A per-channel scale would cost nothing in
//     the loop either, but would not match the experiment the tests hold this kernel to.)
//   * P scaled into e4m3's range (FA3's released code subtracts a max offset of 8 in log2 units for
//     FP8: Max_offset in hopper/softmax.h, set in flash_fwd_kernel_sm90.h): P is in
//     [0, 1]; P_SCALE (2^8, iokernels.fp8.P_SCALE) maps it to [0, 256], below e4m3's 448, and lifts
//     probabilities down to 2^-14 out of the subnormals; l sums P before its cast, and the epilogue
//     divides O by P_SCALE.
//   * fp8 wgmma takes K-major operands only (PTX: no transpose for 8-bit types), so for O += P V
//     the B operand is V^T: fp8_quantize_vt writes V transposed into (B, Hkv, d, Nk_pad) codes
//     (a pass over V that the forward's time counts).  Within each 32-key group the keys of V^T
//     are stored in the order the e4m3 A fragment of P reads them (hopper_fp8.cuh,
//     p_fragments_e4m3), so P needs no shuffle between lanes (FA3 permutes registers instead).
//   * fp8_quantize_rows: per-tile amax -> scale = amax / 448 -> codes, for Q and K (float32 input
//     when the randomized Hadamard transform, fwht.cu, ran first; 16-bit otherwise).
//
// Limits, frankly: head_dim 128 and Bc = 128 only (a 128-byte row of Q, K and V^T is one
// swizzle row; d = 64 would need the 64-byte swizzle); Nq, Nk any; causal (bottom-right) and
// GQA; no ping-pong and no softmax / P V overlap (fa_v5's ideas are not carried over), so the
// tensor cores idle during each softmax; the quantization passes are separate kernels (a fused
// Hadamard + quantize would save a write and a read of Q and K); no backward.  The output is
// 16-bit (-DIK_DTYPE), LSE float32, natural log.  Scales are per tile, not per (batch, KV head)
// as the released FA3 FP8 kernel takes them (its descale factors; code: hopper/flash_api.cpp in
// the FlashAttention repository), which also applies no Hadamard transform itself.
#ifndef STAGES
#error "fa_fp8_v1.cu: -DSTAGES is missing (fp8_forward.fp8_defines passes it)"
#endif
#ifndef HEAD_DIM
#error "fa_fp8_v1.cu: -DHEAD_DIM is missing (fp8_forward.fp8_defines passes it)"
#endif
#ifndef BLOCK_M
#error "fa_fp8_v1.cu: -DBLOCK_M is missing (fp8_forward.fp8_defines passes it)"
#endif
#ifndef BLOCK_N
#error "fa_fp8_v1.cu: -DBLOCK_N is missing (fp8_forward.fp8_defines passes it)"
#endif
#ifndef P_SCALE
#error "fa_fp8_v1.cu: -DP_SCALE is missing (fp8_forward.fp8_defines passes it)"
#endif
#ifndef QUANT_THREADS
#error "fa_fp8_v1.cu: -DQUANT_THREADS is missing (fp8_forward.fp8_defines passes it)"
#endif
#if HEAD_DIM != 128
#error "fa_fp8_v1.cu takes HEAD_DIM 128 (a row of codes is one 128-byte swizzle row)"
#endif
#if BLOCK_N != 128 || BLOCK_M != 128
#error "fa_fp8_v1.cu takes BLOCK_M 128 and BLOCK_N 128 (a V^T row of Bc codes is one 128-byte swizzle row)"
#endif
#if STAGES < 1 || STAGES > 4
#error "fa_fp8_v1.cu takes STAGES 1 .. 4"
#endif
#include "hopper_fp8.cuh"

#define CONSUMERS (BLOCK_M / 64)
#define NTHREADS (128 * (CONSUMERS + 1))
//: registers a thread after setmaxnreg (fa_v4's split: the producer needs a few dozen)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
// the tiles in SRAM and the two products: hopper_fp8.cuh

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fa_fp8_v1(const __grid_constant__ TmaMap map_q, const __grid_constant__ TmaMap map_k,
          const __grid_constant__ TmaMap map_vt, const float* __restrict__ q_scale,
          const float* __restrict__ k_scale, const float* __restrict__ v_scale, u16* __restrict__ o_out,
          float* __restrict__ lse_out, int nq, int nk, int heads_q, int heads_kv, float scale_log2, int left,
          int right, int heavy_first) {
    extern __shared__ unsigned char smem_raw[];
    const Fp8Smem sm = carve_fp8_smem(smem_raw);
    const AttnShape p = {nq, nk, heads_q, heads_kv, scale_log2, left, right};
    const BlockWork w = block_work(p, heavy_first);
    const int wg = threadIdx.x / 128;          // 0: producer; 1..CONSUMERS: consumers
    const int tiles_k = (nk + BLOCK_N - 1) / BLOCK_N;   // K / V scales a KV head

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.k_full[s], 1);
            mbar_init(&sm.v_full[s], 1);
            mbar_init(&sm.empty[s], 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer: HBM -> SRAM
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && w.n_tiles > 0) {
            mbar_arrive_expect_tx(sm.q_full, Q_TILE_BYTES);                   // load Q_i codes, once
            tma_load_3d(sm.q, &map_q, sm.q_full, 0, w.r0, w.bh);
            for (int it = 0; it < w.n_tiles; ++it) {                          // K_j, V_j^T -> stage s
                const int s = it % STAGES, key0 = (w.tiles.begin + it) * BLOCK_N;
                mbar_wait(&sm.empty[s], ((it / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&sm.k_full[s], KV_TILE_BYTES);
                tma_load_3d(sm.k + s * KV_TILE_BYTES, &map_k, &sm.k_full[s], 0, key0, w.bh_kv);
                mbar_arrive_expect_tx(&sm.v_full[s], KV_TILE_BYTES);
                tma_load_3d(sm.v + s * KV_TILE_BYTES, &map_vt, &sm.v_full[s], key0, 0, w.bh_kv);
            }
        }
    } else {
        // ------------------------------------------------------------ consumers: the math
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
        const int row_a = w.r0 + 64 * c + 16 * warp + lane / 4;
        float o[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] = 0.f;
        RowState st;
        row_state_init(st);
        // S's factor without K_j's scale: scale * log2(e) * s_Q(i)
        const float q_factor = scale_log2 * (w.n_tiles > 0 ? q_scale[(size_t)w.bh * gridDim.x + w.r0 / BLOCK_M] : 0.f);
        const float* ks = k_scale + (size_t)w.bh_kv * tiles_k;
        const float* vs = v_scale + (size_t)w.bh_kv * tiles_k;
        float vs_prev = 1.f;                   // O is kept in units of the current tile's s_V
        if (w.n_tiles > 0) mbar_wait(sm.q_full, 0);

        for (int it = 0; it < w.n_tiles; ++it) {
            const int j = w.tiles.begin + it, s = it % STAGES;
            const u32 parity = (it / STAGES) & 1;
            const float ks_j = ks[j], vs_j = vs[j];

            mbar_wait(&sm.k_full[s], parity);                    // S = Q_i K_j^T (codes)
            float sacc[64];
            wgmma_fence();
            issue_qk_e4m3(sacc, sm.q + c * 64 * ROW_BYTES, sm.k + s * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sacc);

            float alpha[2];                                       // online softmax, scales folded in
            if (tile_needs_mask(p, j, w.r0, w.r_last))
                softmax_step_scaled<true>(sacc, st, alpha, p, q_factor * ks_j, row_a, j * BLOCK_N);
            else
                softmax_step_scaled<false>(sacc, st, alpha, p, q_factor * ks_j, row_a, j * BLOCK_N);
            const float to_tile = vs_prev / vs_j;                 // O: units of s_V(j-1) -> s_V(j)
            vs_prev = vs_j;
#pragma unroll
            for (int i = 0; i < 64; ++i) o[i] *= alpha[i % 4 < 2 ? 0 : 1] * to_tile;
            u32 pa[4][4];
            p_fragments_e4m3(sacc, pa);

            mbar_wait(&sm.v_full[s], parity);                    // O += P V_j (codes)
            wgmma_fence();
            issue_pv_e4m3(o, pa, sm.v + s * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.empty[s]);            // stage s may be refilled
        }
        const float o_units = vs_prev / P_SCALE;                  // codes of V and scaled P -> values
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= o_units;
        write_o_lse(o, st, o_out, lse_out, p, w.bh, row_a);       // write O_i, LSE_i -> HBM
    }
}

// ============================================================================= quantization
// a block's amax: max over its threads of their partial maxima (QUANT_THREADS, whole warps)
__device__ __forceinline__ float block_max(float x, float* red) {
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
    __syncthreads();
    float r = 0.f;
    for (int i = 0; i < QUANT_THREADS / 32; ++i) r = fmaxf(r, red[i]);
    return r;
}
// iokernels.fp8.quantize's scale: max|X| / 448 over the block (1 for an all-zero block)
__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.f ? amax / E4M3_MAX : 1.f; }

__device__ __forceinline__ float load_in(const void* x, int in_f32, size_t i) {
    return in_f32 ? ((const float*)x)[i] : in16_to_f32(((const u16*)x)[i]);
}

// Q or K: rows (B * H slabs of n rows of HEAD_DIM) -> e4m3 codes (same layout) and one scale a
// tile of tile_rows rows a slab: scales[slab * tiles + tile].  Grid (tiles, slabs); two passes
// over the tile (the second mostly from L1 / L2): amax, then codes = x / scale, four a thread.
extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
fp8_quantize_rows(const void* __restrict__ x, int in_f32, unsigned* __restrict__ codes, float* __restrict__ scales,
                  int n, int tile_rows) {
    __shared__ float red[QUANT_THREADS / 32];
    const int tile = blockIdx.x, slab = blockIdx.y;
    const int r0 = tile * tile_rows, r1 = min(n, r0 + tile_rows);
    const size_t base = ((size_t)slab * n + r0) * HEAD_DIM;
    const int count = (r1 - r0) * HEAD_DIM;
    float amax = 0.f;
    for (int i = threadIdx.x; i < count; i += QUANT_THREADS) amax = fmaxf(amax, fabsf(load_in(x, in_f32, base + i)));
    const float scale = e4m3_scale(block_max(amax, red));
    if (threadIdx.x == 0) scales[(size_t)slab * gridDim.x + tile] = scale;
    for (int i = 4 * threadIdx.x; i < count; i += 4 * QUANT_THREADS)
        codes[(base + i) / 4] = pack4_e4m3(load_in(x, in_f32, base + i) / scale, load_in(x, in_f32, base + i + 1) / scale,
                                           load_in(x, in_f32, base + i + 2) / scale,
                                           load_in(x, in_f32, base + i + 3) / scale);
}

// V (B * Hkv slabs of nk rows of HEAD_DIM, 16-bit) -> V^T codes (B * Hkv slabs of HEAD_DIM rows
// of nk_pad keys; keys past nk are 0) and one scale a tile of BLOCK_N keys.  Within each group of
// 32 keys, key k goes to position vt_position(k) (the order p_fragments_e4m3 reads).  Grid
// (nk_pad / BLOCK_N, slabs): amax over the tile, codes into an SRAM tile transposed (a warp reads
// 32 channels of one key from HBM, coalesced, and writes them down a column), then written row by
// row (8 bytes a thread).
//: an SRAM row of the transposed tile: Bc codes + 8 bytes of padding, so the 32 channels a warp
//: writes down a column fall in 16 different banks (2-way conflicts instead of 32-way), and rows
//: stay 8-byte aligned for the copy out
#define VT_ROW_BYTES (BLOCK_N + 8)
extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
fp8_quantize_vt(const u16* __restrict__ v, u8* __restrict__ vt, float* __restrict__ scales, int nk, int nk_pad) {
    __shared__ float red[QUANT_THREADS / 32];
    __shared__ __align__(16) u8 tile_t[HEAD_DIM * VT_ROW_BYTES];   // [channel][position]
    const int tile = blockIdx.x, slab = blockIdx.y;
    const int k0 = tile * BLOCK_N, k1 = min(nk, k0 + BLOCK_N);
    const u16* src = v + ((size_t)slab * nk + k0) * HEAD_DIM;
    const int count = (k1 - k0) * HEAD_DIM;
    float amax = 0.f;
    for (int i = threadIdx.x; i < count; i += QUANT_THREADS) amax = fmaxf(amax, fabsf(in16_to_f32(src[i])));
    const float scale = e4m3_scale(block_max(amax, red));
    if (threadIdx.x == 0) scales[(size_t)slab * gridDim.x + tile] = scale;
    for (int i = threadIdx.x; i < BLOCK_N * HEAD_DIM; i += QUANT_THREADS) {   // consecutive threads: one key's row
        const int key = i / HEAD_DIM, ch = i % HEAD_DIM;
        const float x = key < k1 - k0 ? in16_to_f32(src[i]) / scale : 0.f;
        const int pos = (key & ~31) + vt_position(key & 31);
        tile_t[ch * VT_ROW_BYTES + pos] = (u8)(pack4_e4m3(x, 0.f, 0.f, 0.f) & 0xffu);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HEAD_DIM * BLOCK_N / 8; i += QUANT_THREADS) {   // write V^T rows -> HBM
        const int ch = i / (BLOCK_N / 8), chunk = i % (BLOCK_N / 8);
        *(uint2*)(vt + ((size_t)slab * HEAD_DIM + ch) * nk_pad + k0 + 8 * chunk) =
            *(const uint2*)(tile_t + ch * VT_ROW_BYTES + 8 * chunk);
    }
}
