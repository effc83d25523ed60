// base.cuh -- what both kernel families share, each defined once: the portable kernels
// (through common.cuh) and the Hopper ones (through hopper_common.cuh) include it first.
//
//   IK_F32 .. IK_F64   the storage dtype ids of -DIK_DTYPE (each family's header says which
//                      it takes: common.cuh all four, hopper_common.cuh the 16-bit two)
//   u16, u32, u64      raw words: 16-bit values are kept as bit patterns and converted in PTX
//   smem_addr          a generic pointer into SRAM -> the 32-bit shared-window address
//   neg_inf_f          float32 minus infinity, the mask value
//   fast_exp2          the hardware's exp2 (ex2.approx.ftz: exp2(-inf) = +0, which the
//                      online softmax relies on)
//   fence_proxy_async  order ordinary (generic-proxy) SRAM accesses against the async proxy's
//                      (wgmma operands, TMA and bulk copies), sm_90
//
// Each helper is one or two PTX instructions (PTX ISA: "cvta", "ex2", "Memory consistency
// model: proxies" and "membar/fence"); no CUDA header is needed (common.cuh says why).
#pragma once

#define IK_F32 0
#define IK_F16 1
#define IK_BF16 2
#define IK_F64 3

#ifndef IK_DTYPE
#error "base.cuh: -DIK_DTYPE is missing (every config's defines passes it)"
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// a generic pointer into SRAM -> the 32-bit shared-window address PTX instructions take
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// minus infinity in float32, the mask value (a masked score vanishes exactly after exp2)
__device__ __forceinline__ float neg_inf_f() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// SRAM written (or read) by ordinary loads and stores, accessed next by the async proxy: a
// tile stored for wgmma to read, a stage just read that the copy engine is about to refill
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif
