// Warp-level matrix products on mma.sync m16n8k16: the k-step over n=8 tile pairs every
// tensor-core kernel runs, and, for the backward kernels, whole products in which one warp
// computes a 16-row block and the operands sit in padded shared-memory tiles (row pitches of an
// odd number of 16-byte chunks, so every ldmatrix phase is conflict-free) or, for A, in
// registers. Accumulators use the C-fragment layout of online_softmax.cuh: float[kNT][4], tile nt
// holding rows lane/4 (+8) and columns 8*nt + 2*(lane%4) (+1).
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// Byte offset of 16-byte chunk `chunk` in a row of a tile read by ldmatrix at lane `lane`, whose
// row is lane % 8 modulo 8. Swizzled tiles have unpadded rows (a multiple of 8 chunks) with each
// row's chunks permuted by XOR with row % 8: every ldmatrix phase stays conflict-free, and the
// cp.async copies that fill the rows stay aligned to whole sectors.
template <bool kSwizzled>
__device__ __forceinline__ u32 chunk_offset(int chunk, int lane) {
    return static_cast<u32>(kSwizzled ? chunk ^ (lane % 8) : chunk) * 16;
}

// One k=16 step of acc[16*kMT x 8*kNT] += A * B: a[mt] is the A fragment of row tile mt; the B
// fragments come in n=8 tile pairs, load_pair(b, np) filling b[0..1] (tile 2np) and b[2..3]
// (tile 2np+1), and an odd last tile from load_last(b) (b[0..1]).
template <bool kBF16, int kMT, int kNT, class LoadPair, class LoadLast>
__device__ __forceinline__ void mma_k16_step(float (&acc)[kMT][kNT][4], const u32 (&a)[kMT][4],
                                             LoadPair load_pair, LoadLast load_last) {
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
        u32 b[4];
        load_pair(b, np);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<kBF16>(acc[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<kBF16>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
    }
    if constexpr (kNT % 2) {
        u32 b[2];
        load_last(b);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma_16816<kBF16>(acc[mt][kNT - 1], a[mt], b[0], b[1]);
    }
}

// The k=8 step (m16n8k8) that closes a head dim of 8 mod 16: a[mt][0..1]; load_pair(b, np)
// fills b[0] (tile 2np) and b[1] (tile 2np+1), load_last(b) the odd last tile's b.
template <bool kBF16, int kMT, int kNT, class LoadPair, class LoadLast>
__device__ __forceinline__ void mma_k8_step(float (&acc)[kMT][kNT][4], const u32 (&a)[kMT][2],
                                            LoadPair load_pair, LoadLast load_last) {
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
        u32 b[2];
        load_pair(b, np);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            mma_1688<kBF16>(acc[mt][2 * np], a[mt][0], a[mt][1], b[0]);
            mma_1688<kBF16>(acc[mt][2 * np + 1], a[mt][0], a[mt][1], b[1]);
        }
    }
    if constexpr (kNT % 2) {
        u32 b;
        load_last(b);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma_1688<kBF16>(acc[mt][kNT - 1], a[mt][0], a[mt][1], b);
    }
}

// acc[16*kMT x 8*kNT] += A[16*kMT x kK] * B[8*kNT x kK]^T, both operands row-major in shared
// memory: `a` addresses A's element (0, 0), `b` B's element (0, 0); kK is a multiple of 8 (a k=8
// step closes a head dim that is 8 mod 16). B rows are loaded 16 at a time, an odd last 8 apart.
template <bool kBF16, int kMT, int kNT, int kK, int kAPitch, int kBPitch, bool kBSwizzled = false>
__device__ __forceinline__ void warp_gemm_nt(float (&acc)[kMT][kNT][4], u32 a, u32 b, int lane) {
    static_assert(kK % 8 == 0, "8-column k steps");
    static_assert(!kBSwizzled || (kK % 16 == 0 && kNT % 2 == 0), "a swizzled B takes whole k=16 steps and n=8 tile pairs");
    // The odd last n=8 tile: x2 as (n 0-7, k lo), (n 0-7, k hi); x1 (k=8 step): rows n 0-7.
    const u32 b_last = b + (lane % 8 + (kNT - 1) * 8) * kBPitch;
    // ldmatrix.x4 lane addresses: A as (rows 0-7 | 8-15) x (k 0-7 | 8-15); B as (n 0-7, k lo),
    // (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi). x2 (the k=8 step): lanes 0-15 -> rows 0-15.
    const u32 a_lane = a + (lane % 8 + ((lane / 8) % 2) * 8) * kAPitch + (lane / 16) * 16;
    const u32 b_row = b + (lane % 8 + (lane / 16) * 8) * kBPitch;
#pragma unroll 2
    for (int ks = 0; ks < kK / 16; ++ks) {
        u32 fa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(fa[mt], a_lane + mt * 16 * kAPitch + ks * 32);
        const u32 b_ks = b_row + chunk_offset<kBSwizzled>(2 * ks + (lane / 8) % 2, lane);
        mma_k16_step<kBF16>(
            acc, fa, [&](u32 (&fb)[4], int np) { ldmatrix_x4(fb, b_ks + np * 16 * kBPitch); },
            [&](u32 (&fb)[2]) { ldmatrix_x2(fb, b_last + ((lane / 8) % 2) * 16 + ks * 32); });
    }
    if constexpr (kK % 16) {
        const u32 x2_row = (lane % 8 + ((lane / 8) % 2) * 8);
        u32 fa[kMT][2];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x2(fa[mt], a + (x2_row + mt * 16) * kAPitch + (kK / 16) * 32);
        mma_k8_step<kBF16>(
            acc, fa, [&](u32 (&fb)[2], int np) { ldmatrix_x2(fb, b + (x2_row + np * 16) * kBPitch + (kK / 16) * 32); },
            [&](u32& fb) { ldmatrix_x1(fb, b_last + (kK / 16) * 32); });
    }
}

// The same product for one 16-row tile.
template <bool kBF16, int kK, int kNT, int kAPitch, int kBPitch, bool kBSwizzled = false>
__device__ __forceinline__ void warp_gemm_nt(float (&acc)[kNT][4], u32 a, u32 b, int lane) {
    warp_gemm_nt<kBF16, 1, kNT, kK, kAPitch, kBPitch, kBSwizzled>(reinterpret_cast<float (&)[1][kNT][4]>(acc), a, b,
                                                                   lane);
}

// acc[16*kMT x 8*kNT] += A[16*kMT x kK] * B[kK x 8*kNT] with both operands stored k-major in
// shared memory (A as [k][m], B as [k][n]) and read transposed: `a` addresses A's element
// (m=0, k=0), `b` B's element (k=0, n=0). kK is a multiple of 16; kNT may be odd.
template <bool kBF16, int kMT, int kNT, int kK, int kAPitch, int kBPitch>
__device__ __forceinline__ void warp_gemm_tt(float (&acc)[kMT][kNT][4], u32 a, u32 b, int lane) {
    static_assert(kK % 16 == 0, "k=16 steps");
    // x4.trans of A: (m 0-7, k lo), (m 8-15, k lo), (m 0-7, k hi), (m 8-15, k hi).
    const u32 a_lane = a + ((lane / 16) * 8 + lane % 8) * kAPitch + ((lane / 8) % 2) * 16;
    // x4.trans of B: (k lo, n 0-7), (k hi, n 0-7), (k lo, n 8-15), (k hi, n 8-15).
    const u32 b_lane = b + (lane % 8 + ((lane / 8) % 2) * 8) * kBPitch + (lane / 16) * 16;
    const u32 b_x2 = b + (lane % 8 + ((lane / 8) % 2) * 8) * kBPitch;
#pragma unroll 2
    for (int kk = 0; kk < kK / 16; ++kk) {
        u32 fa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4_trans(fa[mt], a_lane + kk * 16 * kAPitch + mt * 32);
        mma_k16_step<kBF16>(
            acc, fa, [&](u32 (&fb)[4], int np) { ldmatrix_x4_trans(fb, b_lane + kk * 16 * kBPitch + np * 32); },
            [&](u32 (&fb)[2]) { ldmatrix_x2_trans(fb, b_x2 + kk * 16 * kBPitch + (kNT - 1) * 16); });
    }
}

// acc[16 x 8*kNT] += A[16 x 16*kKT] * B[16*kKT x 8*kNT], A in registers (k=16 fragments), B
// row-major [k][n] in shared memory, read transposed: `b` addresses B's element (0, 0).
template <bool kBF16, int kKT, int kNT, int kBPitch, bool kBSwizzled = false>
__device__ __forceinline__ void warp_gemm_rn(float (&acc)[kNT][4], const u32 (&fa)[kKT][4], u32 b, int lane) {
    static_assert(!kBSwizzled || kNT % 2 == 0, "a swizzled B takes n=8 tile pairs");
    // x4.trans: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
    const u32 b_row = b + (lane % 8 + ((lane / 8) % 2) * 8) * kBPitch;
#pragma unroll
    for (int kk = 0; kk < kKT; ++kk)
        mma_k16_step<kBF16>(
            reinterpret_cast<float (&)[1][kNT][4]>(acc), reinterpret_cast<const u32 (&)[1][4]>(fa[kk]),
            [&](u32 (&fb)[4], int np) {
                ldmatrix_x4_trans(fb, b_row + kk * 16 * kBPitch + chunk_offset<kBSwizzled>(2 * np + lane / 16, lane));
            },
            [&](u32 (&fb)[2]) { ldmatrix_x2_trans(fb, b_row + kk * 16 * kBPitch + (kNT - 1) * 16); });
}

// C fragments (fp32) -> 16-bit pairs, per n=8 tile: [nt][0] holds row lane/4, [nt][1] row
// lane/4 + 8. Two adjacent tiles are, register for register, an A fragment (see as_operand).
template <bool kBF16, int kNT>
__device__ __forceinline__ void pack_fragments(u32 (&packed)[kNT][2], const float (&c)[kNT][4]) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        packed[nt][0] = pack2<kBF16>(c[nt][0], c[nt][1]);
        packed[nt][1] = pack2<kBF16>(c[nt][2], c[nt][3]);
    }
}

// Packed tiles viewed as the A operands (k=16 fragments) of the product that contracts over them.
template <int kNT>
__device__ __forceinline__ const u32 (&as_operand(const u32 (&packed)[kNT][2]))[kNT / 2][4] {
    static_assert(kNT % 2 == 0, "k=16 fragments take two n=8 tiles");
    return reinterpret_cast<const u32 (&)[kNT / 2][4]>(packed);
}

template <int kMT, int kNT>
__device__ __forceinline__ void zero_fragments(float (&c)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.f;
}

template <int kNT>
__device__ __forceinline__ void zero_fragments(float (&c)[kNT][4]) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[nt][e] = 0.f;
}

// Store a warp's 16 x 8*kNT fp32 block, times `scale`, as 16-bit values into rows `row0 + ...`
// of a global tile (rows at or past rows_valid are skipped, and n=8 tiles at or past column
// cols_valid, a multiple of 8, where a tile was padded past the head dim).
template <bool kBF16, int kNT>
__device__ __forceinline__ void store_fragments(const float (&c)[kNT][4], unsigned short* out,
                                                long long row_stride, int row0, int rows_valid,
                                                int lane, float scale, int cols_valid = 8 * kNT) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + lane / 4 + r * 8;
        if (row >= rows_valid) continue;
        u32* dst = reinterpret_cast<u32*>(out + row * row_stride) + lane % 4;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
            if (nt * 8 < cols_valid) dst[nt * 4] = pack2<kBF16>(c[nt][2 * r] * scale, c[nt][2 * r + 1] * scale);
    }
}

}  // namespace cuflash
