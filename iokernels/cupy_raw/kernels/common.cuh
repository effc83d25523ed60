// common.cuh -- helpers shared by the iokernels CUDA C++ kernels.
//
// Written without any CUDA header on purpose: CuPy's run-time compiler (NVRTC) on a
// pip-installed CUDA lacks some toolkit headers (crt/mma.h), so every conversion,
// copy and tensor-core instruction here is a line of inline PTX.  The same file
// compiles with nvcc for sm_75, sm_80 and sm_90 (tests/test_cupy_compile.py).
//
// Storage dtype, chosen by the launcher with -DIK_DTYPE=<n>:
//   0 float32, 1 float16, 2 bfloat16, 3 float64.
// 16-bit values are kept as raw `unsigned short` bit patterns and converted with PTX.
#pragma once
#include "base.cuh"                     // IK_F32 .. IK_F64, u16 / u32, smem_addr, fast_exp2

#if IK_DTYPE == IK_BF16 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "bfloat16 kernels need compute capability 8.0 or newer (bf16 conversions and mma)"
#endif

// ----------------------------------------------------------------------------- dtypes
// elem_t: what lives in HBM.  acc_t: what S, m, l and O accumulate in (float32, or
// float64 for float64 inputs: the accumulation convention of iokernels.core.conventions).
#if IK_DTYPE == IK_F32
typedef float elem_t;
typedef float acc_t;
#elif IK_DTYPE == IK_F64
typedef double elem_t;
typedef double acc_t;
#else
typedef u16 elem_t;
typedef float acc_t;
#endif
// bytes of one stored element (for the preprocessor, which cannot evaluate sizeof)
#define IK_ELEM_BYTES (IK_DTYPE == IK_F32 ? 4 : IK_DTYPE == IK_F64 ? 8 : 2)

__device__ __forceinline__ float f16_to_f32(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
}
__device__ __forceinline__ float bf16_to_f32(u16 x) {
    return __uint_as_float(((u32)x) << 16);  // bfloat16 is the top half of a float32
}
__device__ __forceinline__ u16 f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u16 x;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
#else
    // round to nearest even by hand (only reached by host-side parsing; sm_75 has no bf16)
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
#endif
}

__device__ __forceinline__ acc_t to_acc(elem_t x) {
#if IK_DTYPE == IK_F16
    return f16_to_f32(x);
#elif IK_DTYPE == IK_BF16
    return bf16_to_f32(x);
#else
    return x;
#endif
}
__device__ __forceinline__ elem_t from_acc(acc_t x) {
#if IK_DTYPE == IK_F16
    return f32_to_f16(x);
#elif IK_DTYPE == IK_BF16
    return f32_to_bf16(x);
#else
    return x;
#endif
}

// Minus infinity: the mask value.  A masked score must vanish exactly after exp(),
// and a row whose scores are all masked must be recognisable (its max stays -inf).
// neg_inf_f (float) is base.cuh's.
__device__ __forceinline__ double neg_inf_d() { return __longlong_as_double(0xfff0000000000000LL); }
__device__ __forceinline__ acc_t neg_inf() {
#if IK_DTYPE == IK_F64
    return neg_inf_d();
#else
    return neg_inf_f();
#endif
}

__device__ __forceinline__ float ik_exp(float x) { return expf(x); }
__device__ __forceinline__ double ik_exp(double x) { return exp(x); }
__device__ __forceinline__ float ik_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double ik_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float ik_log2(float x) { return log2f(x); }
__device__ __forceinline__ double ik_log2(double x) { return log2(x); }
__device__ __forceinline__ float ik_log(float x) { return logf(x); }
__device__ __forceinline__ double ik_log(double x) { return log(x); }
__device__ __forceinline__ float ik_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double ik_max(double a, double b) { return fmax(a, b); }

// ----------------------------------------------------------------------------- masks
// The keys query row i may see form one interval [key_lo(i), key_hi(i)) (conventions.py,
// key_range): bottom-right aligned causal/window, (left, right) with -1 = unbounded.
// The launcher folds `causal` into right = min(right, 0).
__device__ __forceinline__ int key_lo(int i, int nq, int nk, int left) {
    if (left < 0) return 0;
    int lo = i + nk - nq - left;
    return lo < 0 ? 0 : (lo > nk ? nk : lo);
}
__device__ __forceinline__ int key_hi(int i, int nq, int nk, int right) {
    if (right < 0) return nk;
    int hi = i + nk - nq + right + 1;
    return hi < 0 ? 0 : (hi > nk ? nk : hi);
}

// ----------------------------------------------------------------------------- shared memory
// Copy 16 bytes HBM -> SRAM.  sm_80+: asynchronous (cp.async, completes at cp_async_wait);
// when `pred` is false the 16 bytes are zero-filled (src-size 0) and nothing is read.
// sm_75: an ordinary load and store (synchronous; the waits below are no-ops).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    int src_bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
#else
    uint4 v;
    v.x = v.y = v.z = v.w = 0u;
    if (pred) v = *reinterpret_cast<const uint4*>(gmem);
    *reinterpret_cast<uint4*>(smem) = v;
#endif
}
// The copy decode_v4.cu streams K and V with (sm_80+): a row chunk that exists is copied by
// the plain 16-byte cp.async (no src-size operand) carrying the L2::128B prefetch hint, so a
// miss brings the whole 128-byte line from HBM in one request; a chunk past the end (pred
// false) is a zero store to SRAM, not a zero-byte copy.  VIA_L1 picks the cache operator:
// false .cg (the copy bypasses L1), true .ca (it passes through L1).  The SRAM side is a
// shared-space address (smem_addr), so a loop of copies converts its base pointer once.
// sm_75: an ordinary load and store.
template <bool VIA_L1 = false>
__device__ __forceinline__ void cp_async16_line_at(u32 saddr, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (pred) {
        if (VIA_L1)
            asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 16;\n"
                         :: "r"(saddr), "l"(gmem) : "memory");
        else
            asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n"
                         :: "r"(saddr), "l"(gmem) : "memory");
        return;
    }
    const uint4 v = make_uint4(0u, 0u, 0u, 0u);
#else
    const uint4 v = pred ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0u, 0u, 0u, 0u);
#endif
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(saddr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
template <bool VIA_L1 = false>
__device__ __forceinline__ void cp_async16_line(void* smem, const void* gmem, bool pred) {
    cp_async16_line_at<VIA_L1>(smem_addr(smem), gmem, pred);
}
// Copy 4 bytes HBM -> SRAM (one float32: a quantized row's scale), as cp_async16: zero-filled
// when `pred` is false; sm_75: an ordinary load and store.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    int src_bytes = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
#else
    *reinterpret_cast<u32*>(smem) = pred ? *reinterpret_cast<const u32*>(gmem) : 0u;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// wait until at most N groups of this thread's copies are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}

// ----------------------------------------------------------------------------- 16-byte words
// Element e of a 16-byte chunk held in registers (a row loaded as uint4 words), as acc_t:
// a 16-bit row stays 16-bit until it is used, which halves the registers it needs.
__device__ __forceinline__ u32 word4(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
__device__ __forceinline__ acc_t chunk_elem(const uint4& u, int e) {
#if IK_DTYPE == IK_F32
    return __uint_as_float(word4(u, e));
#elif IK_DTYPE == IK_F64
    return __hiloint2double((int)word4(u, 2 * e + 1), (int)word4(u, 2 * e));
#else
    return to_acc((u16)(word4(u, e / 2) >> (16 * (e & 1))));
#endif
}

// ----------------------------------------------------------------------------- 1-byte KV codes
// A quantized KV cache (iokernels.paged, kv_dtype) stores each K/V value as a 1-byte code c
// with a float32 power-of-two scale s per (block, KV head) or per block: the value is c * s.
// -DKV_QUANT=<n> picks the code format: 0 none (K/V are elem_t), 1 int8 (symmetric, -127..127),
// 2 float8 e4m3 (OCP FP8 E4M3, "e4m3fn": sign, 4 exponent bits of bias 7, 3 mantissa bits,
// NaN at 0x7f / 0xff, no infinity).  Decoded here bit by bit, for every architecture.
#define IK_KV_NONE 0
#define IK_KV_INT8 1
#define IK_KV_FP8E4M3 2

// float8 e4m3 code -> float32, exactly.  A normal code (exponent field e > 0) keeps its 3
// mantissa bits as float32's top 3 and moves its exponent from bias 7 to float32's bias 127
// (add 120 to the exponent field); a subnormal code (e == 0) is m * 2^-9.
__device__ __forceinline__ float fp8e4m3_to_f32(u32 code) {
    const u32 mag = code & 0x7fu;
    float v = (mag >> 3) ? __uint_as_float((mag << 20) + (120u << 23)) : (float)mag * 0.001953125f;
    if (mag == 0x7fu) v = __uint_as_float(0x7fc00000u);      // the format's NaN
    return (code & 0x80u) ? -v : v;
}
// int8 code -> float32 (the byte read as a signed integer)
__device__ __forceinline__ float int8_to_f32(u32 code) { return (float)(int)(signed char)(code & 0xffu); }

// the code of format KV_QUANT as float32 (the scale is applied by the caller)
__device__ __forceinline__ float kv_code(u32 code) {
#if KV_QUANT == IK_KV_FP8E4M3
    return fp8e4m3_to_f32(code);
#else
    return int8_to_f32(code);
#endif
}
// code e (0..7) of an 8-byte word of codes held in registers, as float32
__device__ __forceinline__ float kv_code_of(const uint2& u, int e) {
    return kv_code(((e < 4 ? u.x : u.y) >> (8 * (e & 3))) & 0xffu);
}

// Butterfly exchange across the lanes of a warp (row max, row sum, the merge of lanes).
__device__ __forceinline__ acc_t shfl_xor(acc_t v, int off) { return __shfl_xor_sync(0xffffffffu, v, off); }
