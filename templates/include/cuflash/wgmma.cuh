// Hopper (sm_90a) warpgroup MMA: shared-memory descriptors, the 128-byte swizzled tile layout
// they describe, and the fence/commit/wait protocol. The m64nNk16 instruction wrappers
// themselves are generated per N by the template (templates/wgmma_ops.j2).
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `rows` rows stored the way
// wgmma's 128-byte swizzle expects: the row is cut into 64-element (128-byte) column blocks,
// each block holds all rows back to back (128 bytes each), and inside every 8-row, 1024-byte
// atom the chunk index is XORed with the row index. Tile bases must be 1024-byte aligned.
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk, int rows) {
    return (chunk / 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// Shared-memory matrix descriptor of a tile in the kSwizzleBytes-byte swizzle (128, 64 or 32:
// layout types 1, 2 and 3 in bits 62-63; 8-row atoms of 8 * kSwizzleBytes bytes). Addresses and
// offsets are encoded in 16-byte units.
template <int kSwizzleBytes = 128>
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
    static_assert(kSwizzleBytes == 128 || kSwizzleBytes == 64 || kSwizzleBytes == 32, "a wgmma swizzle");
    constexpr u64 kLayout = kSwizzleBytes == 128 ? 1 : kSwizzleBytes == 64 ? 2 : 3;
    return static_cast<u64>((addr & 0x3FFFF) >> 4)
           | (static_cast<u64>(leading_bytes >> 4) << 16)
           | (static_cast<u64>(stride_bytes >> 4) << 32)
           | (kLayout << 62);
}

// The descriptor of the tile `bytes` further on in shared memory (a multiple of 16). Only the
// start address (the low 14 bits, in 16-byte units) moves; it never carries out of them, as
// the tile stays inside shared memory. One 32-bit add, where a descriptor built anew from the
// address costs four instructions: loops over k-steps advance one base descriptor.
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (static_cast<u32>(desc) + (bytes >> 4));
}

// FP8 V^T (K-major B operand of P V): k-step kk (32 keys) of a tile of kHeadDim rows stored as
// boxes of kBoxKeys keys, each box kHeadDim rows of kBoxKeys bytes swizzled by its width.
template <int kBoxKeys, int kHeadDim>
__device__ __forceinline__ u64 fp8_v_desc(u32 v_tile, int kk) {
    constexpr int kStepsPerBox = kBoxKeys / 32;
    const u32 offset = (kk / kStepsPerBox) * kHeadDim * kBoxKeys + (kk % kStepsPerBox) * 32;
    return desc_advance(smem_desc<kBoxKeys>(v_tile, 16, 8 * kBoxKeys), offset);
}

// Registers that wgmma reads or accumulates into were written by ordinary instructions.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// Shared memory written through the generic proxy (cp.async, st.shared) must be made visible to
// the async proxy that wgmma reads it through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Global memory written by the async proxy (bulk reductions) and flags of the generic proxy that
// order those writes between blocks.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

}  // namespace cuflash

namespace cuflash {

// ---- mbarriers in shared memory (producer/consumer hand-off of ring slots) ----
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Block until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// ---- register reallocation between warpgroups (needs a register cap at kernel entry) ----
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegs)); }

}  // namespace cuflash
