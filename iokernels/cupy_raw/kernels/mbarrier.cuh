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
// Included by hopper_common.cuh (the wgmma kernels) and by decode_v4.cu when it loads with
// bulk copies (-DLOAD_BULK=1).
#pragma once

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// a generic pointer into SRAM -> the 32-bit shared-window address the instructions take
__device__ __forceinline__ unsigned mbar_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(mbar_addr(bar)), "r"(arrivals));
}
// make the initialised barriers visible to the copy engine (the async proxy) and other threads
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival that also announces `bytes` still to come from the copy engine
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(mbar_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(mbar_addr(bar)) : "memory");
}
// spin until the phase with parity `parity` has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n"
        :: "r"(mbar_addr(bar)), "r"(parity) : "memory");
}
// order this thread's earlier ordinary (generic-proxy) SRAM accesses before later copy-engine
// writes to the same SRAM: a stage that was just read is about to be refilled
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// copy `bytes` (a multiple of 16; both addresses 16-byte aligned) HBM -> SRAM with the copy
// engine; the bytes count down `bar`'s transaction count as they land
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        :: "r"(mbar_addr(dst)), "l"(src), "r"(bytes), "r"(mbar_addr(bar)) : "memory");
}
#endif
