// decode_v6.cu -- Flash-Decoding, version 6: a query group of more than 16 heads on the tensor cores.
//
// What changed against decode_v4.cu (version 4), and why.  Version 4 makes the g query heads
// of one KV head the rows of one 16-row mma A operand, so it takes g <= 16; a larger group
// (g = 32 or 64, multi-query attention's Hq query heads over one KV head) went to version 3,
// the CUDA-core decode, whose 2 x g x d float32 FMAs a key row grow with g: at g = 32 the
// arithmetic, not HBM, sets its pace.  Splitting the group over more blocks (16 heads each)
// would read each K/V row once per block.  Here the group is split across the warps of a
// block instead, and the warps share each tile they read:
//   * a team of TEAM_WARPS warps (the smallest power of two with 16 x TEAM_WARPS >= g) serves
//     one stream of key tiles; warp w of a team holds the 16 query rows w * 16 .. w * 16 + 15
//     of the group as its A operand (rows past g zero, their results dropped), its own
//     S tile, m, l and O, exactly what one v4 warp holds (so the registers are v4's);
//   * the team copies each K_j, V_j tile once into its cp.async ring: its 32 x TEAM_WARPS
//     lanes share the 16-byte copies; every warp of the team then reads the whole tile from
//     SRAM for its 16 rows.  K/V leave HBM once per (split, KV head), as in v4;
//   * one barrier a tile orders the ring (v4's __syncwarp when a team is one warp, else the
//     block's __syncthreads, see the ordering rule below): the wait for tile j comes first,
//     then the copy of tile j + STAGES - 1 into the stage that tile j - 1 used, then the
//     products;
//   * NUM_WARPS / TEAM_WARPS teams take tiles team, team + TEAMS, ...; the teams (not the
//     warps) merge through SRAM at the end (decode_common.cuh with DECODE_MERGE_ROWS = TEAMS).
// With g <= 16 a team is one warp and this is v4 with the one-barrier ring order.
//
// The ordering rule of the ring (what every SRAM access of the key loop relies on):
//   (1) step j of the loop starts with cp.async.wait_group STAGES - 2 (this thread's copies
//       of its team's tile j have landed) and then one barrier B_j that every thread whose
//       copies or reads touch the ring passes: with a team of one warp its __syncwarp, with
//       teams of several warps the block's barrier (bar.sync 0, all NTHREADS threads);
//   (2) only after B_j does a thread refill a stage: tile j + STAGES - 1 into stage
//       (j - 1) % STAGES, the one tile j - 1 was read from in step j - 1, before B_j;
//       cp.async completion is per thread, so a warp reads another's copies of tile j only
//       after B_j, which comes after their wait_group;
//   (3) every thread passes the same barriers the same number of times: with several-warp
//       teams the loop runs ceil(n_tiles / TEAMS) steps in every team (a team past its last
//       tile only waits), so the merge's __syncthreads is every thread's next barrier after
//       its last ring read, and red_m / red_l / red_o (which reuse the rings' SRAM) are
//       written only after it.
// Per-team named barriers (bar.sync team + 1, 32 x TEAM_WARPS) order the same accesses by the
// PTX rules, but compute-sanitizer's racecheck reported hazards with them (ring reads against
// the refills and against the merge's writes, the merge's writes against its reads across
// __syncthreads) when several teams ran rings of three or more stages; the block barrier
// has one barrier sequence for all warps, which racecheck follows.  It costs the teams their
// independence: a team waits each tile for the slowest.
// Unchanged from v4: the mma.sync m16n8k16 products (mma.cuh), the online softmax on the
// accumulators, P kept in registers, the swizzled or padded SRAM rows, the split-KV grid and
// the fused combine, the staged paged block table, ragged lengths, the sliding window.
//
// Notation (Flash-Decoding, Dao et al., 2023; FlashAttention-2, Dao, 2023):
//   S        splits of the key axis (num_splits), one thread block per (split, kv head, b)
//   g        GROUP, query heads per KV head (at most 16 x TEAM_WARPS)
//   TEAM     TEAM_WARPS warps that share one key stream, one 16-row slice of the group each
//   Bc       TILE_ROWS, key rows of one K_j (and V_j) tile (a multiple of 16)
//   m, l     running max (log2 units) and sum of a query row; O its unnormalised output
//
// Limits: their one home is v6_limits in iokernels/cupy_raw/decode_v6_config.py (the
// registry's check and the config's defines call it).  The #errors below refuse only a
// compile this kernel cannot be.  The file compiles for sm_75 (float16 only) as v4 does.
//
// Compile-time settings, every one passed by the config (none has a default here):
// IK_DTYPE, HEAD_DIM, GROUP, TEAM_WARPS, PAGED, BLOCK_SIZE (paged), NUM_WARPS, STAGES,
// TILE_ROWS, DECODE_MIN_BLOCKS, FUSED, LOAD_L1, COMBINE_REG_SPLITS (decode_common.cuh).
// Dynamic SRAM (decode_v6_smem, cupy_raw/decode_v6_config.py): max(rings TEAMS x STAGES x
// 2 x Bc x SROW 16-bit, the teams' merge buffer TEAMS x g x d float32, the fused combine's
// weights g x S float32), then table_cap int32 entries.
#include "common.cuh"
#include "splits.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#error "decode_v6.cu: -DHEAD_DIM is missing (the config's defines pass it)"
#endif
#ifndef GROUP
#error "decode_v6.cu: -DGROUP is missing (the config's defines pass it)"
#endif
#ifndef TEAM_WARPS
#error "decode_v6.cu: -DTEAM_WARPS is missing (the config's defines pass it)"
#endif
#ifndef PAGED
#error "decode_v6.cu: -DPAGED is missing (the config's defines pass it)"
#endif
#if PAGED && !defined(BLOCK_SIZE)
#error "decode_v6.cu: -DBLOCK_SIZE is missing (the config's defines pass it for a paged cache)"
#endif
#ifndef NUM_WARPS
#error "decode_v6.cu: -DNUM_WARPS is missing (the config's defines pass it)"
#endif
#ifndef STAGES
#error "decode_v6.cu: -DSTAGES is missing (the config's defines pass it)"
#endif
#ifndef TILE_ROWS
#error "decode_v6.cu: -DTILE_ROWS is missing (the config's defines pass it)"
#endif
#ifndef DECODE_MIN_BLOCKS
#error "decode_v6.cu: -DDECODE_MIN_BLOCKS is missing (the config's defines pass it)"
#endif
#ifndef FUSED
#error "decode_v6.cu: -DFUSED is missing (the config's defines pass it)"
#endif
#ifndef LOAD_L1
#error "decode_v6.cu: -DLOAD_L1 is missing (the config's defines pass it)"
#endif

#if IK_DTYPE != IK_F16 && IK_DTYPE != IK_BF16
#error "decode_v6 is the 16-bit tensor-core decode: IK_DTYPE must be 1 (float16) or 2 (bfloat16)"
#endif
#if HEAD_DIM % 16 != 0
#error "decode_v6: HEAD_DIM must be a multiple of 16 (whole mma k-steps; policy: decode_v6_config.v6_limits)"
#endif
#if TEAM_WARPS != 1 && TEAM_WARPS != 2 && TEAM_WARPS != 4 && TEAM_WARPS != 8
#error "decode_v6: TEAM_WARPS must be 1, 2, 4 or 8 (policy: decode_v6_config.v6_limits)"
#endif
#if GROUP < 1 || GROUP > 16 * TEAM_WARPS
#error "decode_v6: group 1..16 x TEAM_WARPS (one 16-row A operand a warp of the team; policy: decode_v6_config.v6_limits)"
#endif
#if NUM_WARPS % TEAM_WARPS != 0
#error "decode_v6: NUM_WARPS must be a multiple of TEAM_WARPS (whole teams)"
#endif
#if TILE_ROWS % 16 != 0
#error "decode_v6: TILE_ROWS must be a multiple of 16 (the k depth of the P V product)"
#endif
#if STAGES < 2
#error "decode_v6: STAGES must be at least 2 (one tile in use, one in flight)"
#endif

#define NTHREADS (32 * NUM_WARPS)
#define TEAMS (NUM_WARPS / TEAM_WARPS)                // key streams a block
#define TEAM_THREADS (32 * TEAM_WARPS)                // lanes that share a stream's copies
#define DECODE_MERGE_ROWS TEAMS                       // decode_common.cuh merges the teams
typedef elem_t kv_t;                                  // K/V as stored: 16-bit values
#define VEC 8                                         // 16-bit elements in one 16-byte chunk
#define CPR (HEAD_DIM / VEC)                          // chunks a row
#define SWIZZLE (CPR % 8 == 0)                        // rows of whole 128-byte halves: XOR swizzle
#define SROW (SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC)    // SRAM row stride (16-bit)
#define TILE_ELEMS (TILE_ROWS * SROW)                 // 16-bit elements of K (or V) in SRAM a tile
#define STAGE_ELEMS (2 * TILE_ELEMS)                  // K then V
#define TILE_CHUNKS (TILE_ROWS * CPR)                 // 16-byte chunks of K (or V) in a tile
#define CPL ((TILE_CHUNKS + TEAM_THREADS - 1) / TEAM_THREADS)   // chunks of K (or V) a lane copies a tile
#define NT_S (TILE_ROWS / 8)                          // 8-key n-tiles of S
#define NT_O (HEAD_DIM / 8)                           // 8-column n-tiles of O
#define KT_Q (HEAD_DIM / 16)                          // 16-deep k-steps of Q K^T
#define HI_ROWS (GROUP > 8)                           // rows 8..15 of a warp's A operand hold heads
// a lane's copies have fixed SRAM offsets: a contiguous cache whose rows divide a warp and
// whose tile is whole team-wide copies
#define FIXED_ROWS (!PAGED && 32 % CPR == 0 && TILE_CHUNKS % TEAM_THREADS == 0)

#include "decode_common.cuh"

// the barrier of a ring step (the ordering rule above): a one-warp team's lanes wait for each
// other with __syncwarp; teams of several warps wait with the whole block (bar.sync 0), so
// every warp passes one barrier sequence
__device__ __forceinline__ void ring_sync() {
#if TEAM_WARPS == 1
    __syncwarp();
#else
    __syncthreads();
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)
decode_split_v6(const elem_t* __restrict__ Q,          // (batch, heads_q, head_dim), contiguous
                const kv_t* __restrict__ K, const kv_t* __restrict__ V,
#if PAGED
                const int* __restrict__ block_table, int max_blocks,
                long long s_blk, long long s_row, long long s_head,   // pool strides (elements)
                int table_cap, int table_offset,                      // SRAM table: entries, byte offset
#else
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
#endif
                const int* __restrict__ seq_lens,      // (batch,) int32, or null: every sequence has nk keys
                int nk, int heads_q, int heads_kv, float scale, int num_splits,
                int window_left,                       // keys before n - 1 - window_left unseen; -1: none
                float* __restrict__ O_part, float* __restrict__ LSE_part,   // (splits, batch, heads_q[, d])
                int* __restrict__ counters,            // (batch, heads_kv) zeros; FUSED only
                elem_t* __restrict__ O, float* __restrict__ LSE) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float red_m[TEAMS][GROUP];
    __shared__ float red_l[TEAMS][GROUP];

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int team = warp / TEAM_WARPS, slice = warp % TEAM_WARPS;   // slice: the warp's 16 rows
    const int tl = slice * 32 + lane;                 // this lane's index among the team's copiers
    const int g = lane / 4, t = lane % 4;             // mma fragment coordinates (rows g, g + 8)
    const int row0 = slice * 16 + g;                  // the group's rows this lane holds: row0, row0 + 8
    const int len = seq_lens ? seq_lens[b] : nk;
    // the visible keys [first, len) are split (a sliding window hides the ones before first);
    // a split past them is empty (LSE_s = -inf)
    const int3 keys = decode_split_keys(len, window_left, num_splits, split);   // splits.cuh
    const int n_begin = keys.y, n_end = keys.z;

    const int n_tiles = (n_end - n_begin + TILE_ROWS - 1) / TILE_ROWS;
    const int my_tiles = n_tiles > team ? (n_tiles - team + TEAMS - 1) / TEAMS : 0;   // the team's
    // steps of the key loop: a one-warp team its own tiles; teams of several warps all run
    // team 0's count (the largest), so every warp passes the same block barriers (rule (3))
    const int steps = TEAM_WARPS == 1 ? my_tiles : (n_tiles + TEAMS - 1) / TEAMS;
    u16* ring = reinterpret_cast<u16*>(smem_raw) + team * (STAGES * STAGE_ELEMS);

    // load this warp's 16 rows of Q_g -> registers as A fragments (rows past g zero), once:
    // row g / g + 8 of the operand is query head hk * GROUP + row0 / + 8
    u32 qf[KT_Q][4];
    {
        const bool ok0 = row0 < GROUP, ok1 = HI_ROWS && row0 + 8 < GROUP;
        const u32* q0 = reinterpret_cast<const u32*>(Q + ((long long)b * heads_q + hk * GROUP + row0) * HEAD_DIM);
        const u32* q1 = q0 + 8 * HEAD_DIM / 2;
#pragma unroll
        for (int kk = 0; kk < KT_Q; ++kk) {
            const int c = (kk * 16 + 2 * t) / 2;      // in 32-bit words (two 16-bit values)
            qf[kk][0] = ok0 ? q0[c] : 0u;
            qf[kk][2] = ok0 ? q0[c + 4] : 0u;
            qf[kk][1] = ok1 ? q1[c] : 0u;
            qf[kk][3] = ok1 ? q1[c + 4] : 0u;
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;   // scores in log2 units

    float o[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};

#if PAGED
    // load this split's block-table entries -> SRAM (once), when they fit table_cap
    const int e0 = n_begin / BLOCK_SIZE;
    const int n_entries = n_end > n_begin ? (n_end - 1) / BLOCK_SIZE - e0 + 1 : 0;
    const int* tb = block_table + (long long)b * max_blocks + e0;     // entry i of the split: tb[i]
    if (n_entries <= table_cap) {
        int* tsm = reinterpret_cast<int*>(smem_raw + table_offset);
        for (int i = threadIdx.x; i < n_entries; i += NTHREADS) tsm[i] = tb[i];
        __syncthreads();
        tb = tsm;                                   // a generic pointer: SRAM from here on
    }
    // entries of the rows this lane copies in its team's next tile (read one tile ahead)
    int blk_next[CPL];
    auto load_blocks = [&](int tile) {
        const int start = n_begin + (team + tile * TEAMS) * TILE_ROWS;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int n = start + (tl + TEAM_THREADS * i) / CPR;
            const bool ok = tile < my_tiles && (tl + TEAM_THREADS * i) < TILE_CHUNKS && n < n_end;
            blk_next[i] = ok ? tb[n / BLOCK_SIZE - e0] : 0;
        }
    };
    load_blocks(0);
#else
    const elem_t* Kb = K + b * skb + hk * skh;
    const elem_t* Vb = V + b * svb + hk * svh;
#endif

#if FIXED_ROWS
    // load K_j, V_j -> SRAM (the team's cp.async ring): the team's tile `tile` into stage
    // tile % STAGES.  A team-wide copy covers RPI whole rows, so a lane's SRAM offsets are
    // fixed for the whole loop, its sources step by RPI rows a copy
    constexpr int RPI = TEAM_THREADS / CPR;          // rows one team-wide copy covers
    const int r0 = tl / CPR, ch0 = tl % CPR;         // this lane's first row of a tile, its chunk
    u32 soff[CPL];                                   // byte offsets of its chunks in a stage's K
#pragma unroll
    for (int i = 0; i < CPL; ++i) soff[i] = 2 * tile_offset<SWIZZLE>(r0 + i * RPI, ch0 * VEC, SROW);
    const u32 ring_addr = smem_addr(ring);
    auto issue = [&](int tile) {
        if (tile < my_tiles) {
            const u32 ks = ring_addr + (tile % STAGES) * (2 * STAGE_ELEMS), vs = ks + 2 * TILE_ELEMS;
            const int start = n_begin + (team + tile * TEAMS) * TILE_ROWS;
            const elem_t* kp = Kb + (long long)(start + r0) * skn + ch0 * VEC;
            const elem_t* vp = Vb + (long long)(start + r0) * svn + ch0 * VEC;
            if (start + TILE_ROWS <= n_end) {        // a whole tile: every copy reads
#pragma unroll
                for (int i = 0; i < CPL; ++i, kp += RPI * skn, vp += RPI * svn) {
                    cp_async16_line_at<LOAD_L1>(ks + soff[i], kp, true);
                    cp_async16_line_at<LOAD_L1>(vs + soff[i], vp, true);
                }
            } else {                                 // the split's last tile: rows past n_end zero
#pragma unroll
                for (int i = 0; i < CPL; ++i, kp += RPI * skn, vp += RPI * svn) {
                    const bool ok = start + r0 + i * RPI < n_end;
                    cp_async16_line_at<LOAD_L1>(ks + soff[i], kp, ok);
                    cp_async16_line_at<LOAD_L1>(vs + soff[i], vp, ok);
                }
            }
        }
        cp_async_commit();
    };
#else
    // load K_j, V_j -> SRAM (the team's cp.async ring): tile `tile` into stage tile % STAGES
    // (pages, or rows whose chunks do not divide a team's copy: each copy finds its row)
    auto issue = [&](int tile) {
        if (tile < my_tiles) {
            u16* Ks = ring + (tile % STAGES) * STAGE_ELEMS;
            u16* Vs = Ks + TILE_ELEMS;
            const int start = n_begin + (team + tile * TEAMS) * TILE_ROWS;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = tl + TEAM_THREADS * i;
                if (c < TILE_CHUNKS) {
                    const int r = c / CPR, ch = c % CPR;
                    const int n = start + r;
                    const bool ok = n < n_end;
#if PAGED
                    const long long off = (long long)blk_next[i] * s_blk + (long long)(n % BLOCK_SIZE) * s_row
                                          + hk * s_head + ch * VEC;
                    cp_async16_line<LOAD_L1>(Ks + tile_offset<SWIZZLE>(r, ch * VEC, SROW), K + off, ok);
                    cp_async16_line<LOAD_L1>(Vs + tile_offset<SWIZZLE>(r, ch * VEC, SROW), V + off, ok);
#else
                    cp_async16_line<LOAD_L1>(Ks + tile_offset<SWIZZLE>(r, ch * VEC, SROW), Kb + (long long)n * skn + ch * VEC, ok);
                    cp_async16_line<LOAD_L1>(Vs + tile_offset<SWIZZLE>(r, ch * VEC, SROW), Vb + (long long)n * svn + ch * VEC, ok);
#endif
                }
            }
#if PAGED
            load_blocks(tile + 1);
#endif
        }
        cp_async_commit();
    };
#endif

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    for (int j = 0; j < steps; ++j) {               // loop over the team's K_j, V_j tiles (SRAM)
        cp_async_wait<STAGES - 2>();                // this lane's copies of tile j have landed
        ring_sync();                                // ... and the team's; every warp is past tile j - 1
        issue(j + STAGES - 1);                      // into the stage tile j - 1 used (none past my_tiles)
        if (j >= my_tiles) continue;                // this team is past its last tile: it only waits
        const u16* Kt = ring + (j % STAGES) * STAGE_ELEMS;
        const u16* Vt = Kt + TILE_ELEMS;
        const int start = n_begin + (team + j * TEAMS) * TILE_ROWS;

        // S = Q_g K_j^T on the tensor cores (registers), this warp's 16 rows of the group
        float s[NT_S][4];
        mma_qkt<KT_Q, NT_S, SWIZZLE>(s, qf, Kt, SROW, lane);
        // scale (log2 units); keys at or past the split's end (zero rows) -> -inf
        const bool tail = start + TILE_ROWS > n_end;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = s[n][e] * scale_log2;
                s[n][e] = (tail && start + n * 8 + 2 * t + (e & 1) >= n_end) ? neg_inf_f() : x;
            }

        // online softmax on the accumulators: row g is e = 0, 1; row g + 8 e = 2, 3
#pragma unroll
        for (int r = 0; r < 1 + HI_ROWS; ++r) online_softmax_row<NT_S, NT_O>(s, o, m[r], l[r], r);

        // O += P V_j on the tensor cores; P's accumulators become A fragments in registers
        mma_pv<TILE_ROWS / 16, NT_O, HI_ROWS, SWIZZLE>(o, s, Vt, SROW, lane);
    }
    cp_async_wait<0>();

    // merge the teams (through SRAM): l over the quad, then each team's m, l and O rows
    // rescaled to the block's max -> SRAM (the rings' space, idle after the barrier)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const int rows_of[2] = {row0, row0 + 8};
    if (t == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (rows_of[r] < GROUP) { red_m[team][rows_of[r]] = m[r]; red_l[team][rows_of[r]] = l[r]; }
    }
    __syncthreads();                                // every warp's ring reads are done, too
    float* red_o = reinterpret_cast<float*>(smem_raw);     // [TEAMS][GROUP][HEAD_DIM]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int gq = rows_of[r];
        if (gq < GROUP) {
            float M = neg_inf_f();
            for (int w = 0; w < TEAMS; ++w) M = fmaxf(M, red_m[w][gq]);
            const float f = ik_exp2(m[r] - ((M == neg_inf_f()) ? 0.f : M));
            float* dst = red_o + (team * GROUP + gq) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                dst[n * 8] = o[n][2 * r] * f;
                dst[n * 8 + 1] = o[n][2 * r + 1] * f;
            }
        }
    }
    __syncthreads();

    // write O_s, LSE_s -> HBM; FUSED: the last split block merges the group's partials
    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,
                  O_part, LSE_part, counters, O, LSE);
}
