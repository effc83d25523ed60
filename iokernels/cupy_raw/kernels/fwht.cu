// fwht.cu -- the randomized fast Walsh-Hadamard transform of rows: y = x D H / sqrt(d).
//
// Incoherent processing (the FlashAttention-3 paper's FP8 method; its released kernel has no
// transform) multiplies Q and K by one random
// orthogonal matrix M = D H / sqrt(d) before they are quantized: D = diag(random signs), H the
// d x d Hadamard matrix.  Exact in real arithmetic (Q M (K M)^T = Q K^T), it spreads an outlier
// coordinate over all d, so one large value no longer sets a whole block's FP8 scale.  H is
// never formed: log2(d) butterfly stages replace each pair (a, b) at distance h (h = 1, 2, 4,
// ..., d/2) by (a + b, a - b): O(d log d) a row instead of a d x d matmul.
//
// This is exactly iokernels.fp8.randomized_hadamard (signs applied first, then fwht's stages in
// the same order and pairing, then one multiplication by 1/sqrt(d)), in float32 registers.
//
// Layout: one warp a row (d a power of two, 64..256).  Lane L holds the E = d / 32 consecutive
// elements L*E .. L*E + E - 1, so the stages h < E pair two registers of one thread and the
// stages h >= E pair lane L with lane L ^ (h / E) through one __shfl_xor_sync each: no shared
// memory.  ROWS_PER_BLOCK warps a block, one row each.
//
// Input dtype (-DIK_DTYPE): 0 float32, 1 float16, 2 bfloat16 (common.cuh).  Output: the input's
// dtype, or float32 with -DOUT_F32=1 (what an FP8 quantization that follows wants: one rounding,
// to FP8, instead of two).  Signs: a 256-bit mask by value (bit i set: element i is negated).
//
// Frank notes: a memory-bound kernel with scalar loads (each lane reads E consecutive elements
// with E loads; a warp's loads still cover one contiguous row); fusing the transform into the
// FP8 quantization that follows would save one write and one read of Q and K.
#include "common.cuh"

#ifndef HEAD_DIM
#error "fwht.cu: -DHEAD_DIM is missing (hadamard.fwht_defines passes it)"
#endif
#ifndef ROWS_PER_BLOCK
#error "fwht.cu: -DROWS_PER_BLOCK is missing (hadamard.fwht_defines passes it)"
#endif
#ifndef OUT_F32
#error "fwht.cu: -DOUT_F32 is missing (hadamard.fwht_defines passes it)"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128 && HEAD_DIM != 256
#error "fwht.cu: HEAD_DIM must be 64, 128 or 256 (a power of two, whole registers a lane)"
#endif
#if IK_DTYPE == IK_F64
#error "fwht.cu: IK_DTYPE float32, float16 or bfloat16"
#endif

//: elements a lane holds
#define PER_LANE (HEAD_DIM / 32)
//: the largest row the sign mask covers (8 words of 32 bits)
#define SIGN_WORDS 8

#if OUT_F32
typedef float out_t;
__device__ __forceinline__ out_t to_out(float x) { return x; }
#else
typedef elem_t out_t;
__device__ __forceinline__ out_t to_out(float x) { return from_acc(x); }
#endif

// the diagonal D, one bit an element (passed by value: no upload, nothing to capture)
struct SignBits {
    unsigned w[SIGN_WORDS];
};

extern "C" __global__ void __launch_bounds__(32 * ROWS_PER_BLOCK)
fwht(SignBits signs, const elem_t* __restrict__ x, out_t* __restrict__ y, int rows, int use_signs) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= rows) return;                     // a whole warp leaves together: shuffles stay full
    const elem_t* src = x + row * HEAD_DIM + lane * PER_LANE;
    float v[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {         // load x -> registers, times D
        v[i] = (float)to_acc(src[i]);
        const int e = lane * PER_LANE + i;
        if (use_signs && (signs.w[e / 32] >> (e % 32)) & 1u) v[i] = -v[i];
    }
#pragma unroll
    for (int h = 1; h < PER_LANE; h *= 2) {      // stages inside a lane: pairs (i, i + h)
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            if (i & h) continue;
            const float a = v[i], b = v[i + h];
            v[i] = a + b;
            v[i + h] = a - b;
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {            // stages across lanes: h = m * PER_LANE
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
            v[i] = (lane & m) ? other - v[i] : v[i] + other;   // bottom of the pair: a - b; top: a + b
        }
    }
    const float norm = 1.0f / sqrtf((float)HEAD_DIM);          // orthonormal: H / sqrt(d)
    out_t* dst = y + row * HEAD_DIM + lane * PER_LANE;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) dst[i] = to_out(v[i] * norm);   // write y -> HBM
}
