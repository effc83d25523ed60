// mbarrier.cuh -- Hopper's transaction barrier and the bulk copy that completes on it (sm_90).
//
// An mbarrier is a 64-bit SRAM object that counts two things down in each phase: arrivals of
// threads and bytes delivered by the copy engine (its "transaction count").  A phase completes
// when both reach zero; a waiter polls the parity of the phase it waits for (0, 1, 0, ...).
// One thread announces the bytes still to come (arrive.expect_tx), the copy engine subtracts
// them as they land (complete_tx), and every waiter sees the bytes once the phase flips.
// Each wrapper is one PTX instruction (PTX ISA, "Parallel synchronization and communication
// instructions: mbarrier" and "Data movement: cp.async.bulk").
//
// Included by hopper_common.cuh (the wgmma kernels) and by the sweeps' decode_v4_loads.cu
// (iokernels/bench/kernels) when it loads with bulk copies (-DLOAD_BULK=1).
#pragma once
#include "base.cuh"                     // smem_addr, fence_proxy_async

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(arrivals));
}
// make the initialised barriers visible to the copy engine (the async proxy) and other threads
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival that also announces `bytes` still to come from the copy engine
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
// spin until the phase with parity `parity` has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n"
        :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// a stage that was just read by ordinary loads and is about to be refilled by the copy engine
// is ordered by base.cuh's fence_proxy_async first
// copy `bytes` (a multiple of 16; both addresses 16-byte aligned) HBM -> SRAM with the copy
// engine; the bytes count down `bar`'s transaction count as they land
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
#endif
