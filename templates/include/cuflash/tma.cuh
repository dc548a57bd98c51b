// Hopper (sm_90) bulk tensor copies and the barriers that order them: TMA loads that complete on
// an mbarrier's transaction count, and named barriers that let two warpgroups take turns.
// Tensor maps are encoded on the host (cuflash/tma.py) and arrive as __grid_constant__ kernel
// parameters, so their address is a parameter-space address the copy engine may read.
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// One CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// mbarrier.init must be made visible to the copy engine (the async proxy) before its first use.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive once and announce `bytes` more bytes that TMA copies will deliver to this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

// Copy one box of a 4-d tensor (coordinates innermost first) into shared memory at dst; the
// bytes are counted against mbarrier bar. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Copy `bytes` (a multiple of 16) from global memory at src to shared memory at dst (both
// 16-byte aligned), counted against mbarrier bar.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar) : "memory");
}

// Copy one box of a 4-d tensor from shared memory at src to global memory (coordinates innermost
// first), in this thread's bulk async-group. Elements out of the tensor's bounds are not written.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Add `bytes` (a multiple of 16) of float32 at shared-memory src element-wise into global memory
// at dst (both 16-byte aligned), in this thread's bulk async-group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(reinterpret_cast<u64>(dst)), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's bulk groups still read their shared memory (.read) or still run.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_group() { asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory"); }

// Named barriers (ids 1-15; 0 is __syncthreads): `threads` counts every thread that syncs or
// arrives, a multiple of 32. arrive does not wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

}  // namespace cuflash
