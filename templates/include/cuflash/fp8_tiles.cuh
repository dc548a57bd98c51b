// FP8 tiles of the portable forward (fwd_mma.cuh, sm_80 and newer): the codes travel from device
// memory as bytes, through cp.async into a staging ring in shared memory, and are converted on
// chip into the fp16 tiles that the kernel's ldmatrix / mma.sync code reads. Device memory only
// ever holds the 1-byte codes, and nothing here needs sm_89's FP8 conversion instructions.
//
// Both formats convert exactly to fp16:
//   e5m2 (s.eeeee.mm) is the high byte of an fp16: the code shifted left by 8.
//   e4m3 (s.eeee.mmm, e4m3fn: no infinities) becomes the fp16 s.0eeee.mmm0000000, its exponent
//   (bias 7) read with fp16's bias 15: the value times 2^-8, for subnormals too (m * 2^-9 ->
//   m * 2^-17). The kernel puts the 2^8 factors back once per block: 2^16 on the softmax scale
//   (q . k) and 2^8 on the output scale (v). The NaN codes s.1111.111 would land on 1.875, a
//   finite value; they get the top exponent bit as well, which makes them an fp16 NaN.
//
// Each thread converts exactly the copies it issued, so its own cp.async.wait_group makes their
// bytes visible to it: no barrier stands between a tile landing and its conversion.
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// Four codes (byte i = element i) -> four fp16 values: lo holds elements 0 and 1, hi 2 and 3
// (the lower element in the lower half, as in memory). e4m3 values come out times 2^-8.
template <bool kE4M3>
__device__ __forceinline__ void fp8x4_to_fp16x4(u32 codes, u32& lo, u32& hi) {
    if constexpr (kE4M3) {
        const u32 magnitude = codes & 0x7f7f7f7fu;
        // magnitude + 1 carries into bit 7 of its byte for the NaN magnitude 0x7f only.
        const u32 flagged = magnitude | ((magnitude + 0x01010101u) & 0x80808080u);  // NaN, e, m
        const u32 sign = (codes >> 7) & 0x01010101u;
        // Each 16-bit half: sign << 8 | NaN << 7 | e << 3 | m, then shifted to bit 15 | 14 | 13-7.
        lo = __byte_perm(flagged, sign, 0x5140) << 7;
        hi = __byte_perm(flagged, sign, 0x7362) << 7;
    } else {
        lo = __byte_perm(codes, 0u, 0x1404);  // bytes: 0, code 0, 0, code 1
        hi = __byte_perm(codes, 0u, 0x3424);
    }
}

// The copies of an FP8 tile of kRows rows (Cfg::kFp8CopiesPerRow copies of Cfg::kFp8CopyBytes
// codes per row) that thread `tid` handles, as f(row, copy): every kThreads-th, row-major, so a
// warp's copies cover whole rows of contiguous bytes. Where the threads tile the rows evenly,
// each keeps one copy column and steps down kThreads / kFp8CopiesPerRow rows at a time (few live
// registers: the loop runs beside the whole output accumulator). kRolled keeps the loop rolled.
template <class Cfg, int kRows, bool kRolled = false, class F>
__device__ __forceinline__ void for_each_fp8_copy(int tid, F f) {
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kPerRow = Cfg::kFp8CopiesPerRow;
    constexpr int kCopies = kRows * kPerRow;
    constexpr int kIters = (kCopies + kThreads - 1) / kThreads;
    if constexpr (kThreads % kPerRow == 0 && kCopies % kThreads == 0) {
        const int row0 = tid / kPerRow, copy = tid % kPerRow;
#pragma unroll (kRolled ? 1 : kIters)
        for (int it = 0; it < kIters; ++it) f(row0 + it * (kThreads / kPerRow), copy);
    } else {
#pragma unroll (kRolled ? 1 : kIters)
        for (int it = 0; it < kIters; ++it) {
            const int idx = tid + it * kThreads;
            if (kCopies % kThreads == 0 || idx < kCopies) f(idx / kPerRow, idx % kPerRow);
        }
    }
}

// Copy kRows rows of codes into a staging tile (rows of Cfg::kHeadDim bytes, unpadded: each
// thread reads back only its own copies, in order). Rows at or past rows_valid are zero-filled
// (code 0 is +0 in both formats).
template <class Cfg, int kRows>
__device__ __forceinline__ void load_fp8_tile_async(u32 stage, const unsigned char* gmem, long long row_stride,
                                                    int rows_valid, int tid) {
    for_each_fp8_copy<Cfg, kRows>(tid, [&](int row, int copy) {
        const bool valid = row < rows_valid;
        const u32 dst = stage + row * Cfg::kHeadDim + copy * Cfg::kFp8CopyBytes;
        const unsigned char* src = valid ? gmem + row * row_stride + copy * Cfg::kFp8CopyBytes : gmem;
        if constexpr (Cfg::kFp8CopyBytes == 16)
            cp_async_16(dst, src, valid);
        else
            cp_async_8(dst, src, valid);
    });
}

// Convert this thread's copies of a staged tile (after its cp.async.wait_group) into the fp16
// tile at `tile` (row pitch Cfg::kSmemRowBytes, what ldmatrix reads).
template <class Cfg, int kRows>
__device__ __forceinline__ void convert_fp8_tile(u32 tile, u32 stage, int tid) {
    for_each_fp8_copy<Cfg, kRows, true>(tid, [&](int row, int copy) {
        const u32 src = stage + row * Cfg::kHeadDim + copy * Cfg::kFp8CopyBytes;
        const u32 dst = tile + row * Cfg::kSmemRowBytes + copy * 2 * Cfg::kFp8CopyBytes;
        if constexpr (Cfg::kFp8CopyBytes == 16) {
            // 16 codes -> 32 bytes. Copies 4-7 of every 8 take their second 8 codes first: the 8
            // threads of a store phase, 32 bytes apart, then hit 8 distinct 16-byte bank groups.
            const u32 first = (copy & 4) ? 8 : 0;
            u32 codes[2][2], h[2][4];
            ld_shared_v2(codes[0], src + first);
            ld_shared_v2(codes[1], src + (first ^ 8));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                fp8x4_to_fp16x4<Cfg::kE4M3>(codes[j][0], h[j][0], h[j][1]);
                fp8x4_to_fp16x4<Cfg::kE4M3>(codes[j][1], h[j][2], h[j][3]);
            }
            st_shared_v4(dst + 2 * first, h[0][0], h[0][1], h[0][2], h[0][3]);
            st_shared_v4(dst + (2 * first ^ 16), h[1][0], h[1][1], h[1][2], h[1][3]);
        } else {
            u32 codes[2], h[4];
            ld_shared_v2(codes, src);
            fp8x4_to_fp16x4<Cfg::kE4M3>(codes[0], h[0], h[1]);
            fp8x4_to_fp16x4<Cfg::kE4M3>(codes[1], h[2], h[3]);
            st_shared_v4(dst, h[0], h[1], h[2], h[3]);
        }
    });
}

}  // namespace cuflash
