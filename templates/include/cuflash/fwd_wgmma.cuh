// Attention forward on Hopper tensor cores (wgmma, sm_90a).
//
// One thread block per (query tile, head, batch), as in the mma.sync kernel, with kWarps/4
// warpgroups of 64 query rows each. Q and a kStages-deep ring of K/V tiles sit in shared memory
// in the 128-byte swizzled layout wgmma reads through descriptors (cuflash/wgmma.cuh):
// S = Q K^T takes both operands from shared memory; O += P V takes P from registers (the S
// accumulators, rounded to 16 bits) and V from shared memory, transposed by the descriptor.
// The accumulators of each warp are in the m16n8 C-fragment layout, so the online softmax,
// masking and epilogue are the ones the mma.sync kernel uses (cuflash/online_softmax.cuh).
//
// The warp-specialized schedule (TMA producer, ping-pong consumers) is fwd_wgmma_ws.cuh.
//
// The generated kernel provides Cfg with kHeadDim, kBlockM, kBlockN, kWarps, kStages, kCausal,
// kOverlap, kBF16, kChunksPerRow, kSmemQ, kSmemK, kSmemV, kKVTileBytes, kVLeadingBytes,
// kVStrideBytes, the Params struct, and the wgmma_qk / wgmma_pv wrappers.
#pragma once
#include "cuflash/block.cuh"
#include "cuflash/online_softmax.cuh"
#include "cuflash/wgmma.cuh"

namespace cuflash {

// S = Q K^T for one warpgroup's 64 query rows (q_rows: their first column block) against the
// key tile at k_tile: both operands K-major in shared memory, swizzled over column blocks of
// Cfg::kColBlockBytes (128 bytes, or 64 for FP8 head dims up to 64); k-steps (16 elements, 32 for
// FP8) are 32 bytes apart inside a column block. kNT n=8 tiles: the whole key tile, or
// (kHalfFirstTile) its first half. Issued and committed; the caller waits.
template <class Cfg, int kNT>
__device__ __forceinline__ void issue_scores(float (&acc)[kNT][4], u32 q_rows, u32 k_tile) {
    constexpr int kBlock = Cfg::kColBlockBytes;
    const u64 q_desc = smem_desc<kBlock>(q_rows, 16, 8 * kBlock), k_desc = smem_desc<kBlock>(k_tile, 16, 8 * kBlock);
    wgmma_fence();
#pragma unroll
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
#pragma unroll
        for (int ks = 0; ks < kBlock / 32; ++ks)
            Cfg::wgmma_qk(acc, desc_advance(q_desc, cb * Cfg::kBlockM * kBlock + ks * 32),
                          desc_advance(k_desc, cb * Cfg::kBlockN * kBlock + ks * 32), cb + ks);
    wgmma_commit();
}

// P (the softmax numerators in the S accumulators) as wgmma's A operand: rounded to 16 bits,
// or (FP8) to e4m3, 32 keys per k-step in the order of fp8_probs_operand. Accumulators of kNT
// n=8 tiles fill the first 8 kNT keys; P past them (a half-wide first tile) is 0.
template <class Cfg, int kNT>
__device__ __forceinline__ void probs_registers(u32 (&probs)[Cfg::kBlockN / Cfg::kPVStep][4],
                                                const float (&acc)[kNT][4]) {
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockN / Cfg::kPVStep; ++kk) {
        if (kk >= kNT * 8 / Cfg::kPVStep) {
#pragma unroll
            for (int r = 0; r < 4; ++r) probs[kk][r] = 0u;
        } else if constexpr (Cfg::kFp8) {
            fp8_probs_operand(probs[kk], acc, kk);
        } else {
            probs_operand<Cfg::kBF16>(probs[kk], acc, kk);
        }
    }
}

// O += P V: P from registers (settled before the call: wgmma reads them asynchronously), V
// (keys x head_dim, head_dim contiguous) read transposed, 16 keys 2048 bytes apart; FP8: V^T
// (head_dim rows of 128 keys), K-major, 32 keys 32 bytes apart. beside(kk) runs after k-step
// kk's product, in the same commit group (the FP8 row sums on the tensor cores issue theirs).
// Issued and committed; the caller waits.
struct NoStep {
    __device__ __forceinline__ void operator()(int) const {}
};

template <class Cfg, class Beside = NoStep>
__device__ __forceinline__ void issue_pv(float (&acc_o)[Cfg::kHeadDim / 8][4],
                                         const u32 (&probs)[Cfg::kBlockN / Cfg::kPVStep][4], u32 v_tile,
                                         Beside beside = {}) {
    const u64 v_desc = smem_desc(v_tile, Cfg::kVLeadingBytes, Cfg::kVStrideBytes);
    fence_operands(acc_o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockN / Cfg::kPVStep; ++kk) {
        if constexpr (Cfg::kFp8)
            Cfg::wgmma_pv(acc_o, probs[kk], fp8_v_desc<Cfg::kVBoxKeys, Cfg::kHeadDim>(v_tile, kk), 1);
        else
            Cfg::wgmma_pv(acc_o, probs[kk], desc_advance(v_desc, kk * 2048), 1);
        beside(kk);
    }
    wgmma_commit();
}

template <class Cfg>
__device__ __forceinline__ void fwd_wgmma(const typename Cfg::Params& p) {
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kNT = kBN / 8;           // n=8 tiles of S per warp
    constexpr int kOT = Cfg::kHeadDim / 8; // n=8 tiles of O per warp
    constexpr int kThreads = Cfg::kWarps * 32;

    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms are 1024 bytes; the launch reserves the slack to align the base.
    const u32 smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = smem_base + Cfg::kSmemQ;
    const u32 sK = smem_base + Cfg::kSmemK;
    const u32 sV = smem_base + Cfg::kSmemV;

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int warpgroup = warp / 4;
    const BlockWork<unsigned short, kBM, kBN, Cfg::kCausal> work(p);
    const int m0 = work.m0, n_tiles = work.n_tiles, causal_offset = work.causal_offset;
    const unsigned short *q = work.q, *k = work.k, *v = work.v;

    // Tiles are stored in wgmma's 128-byte swizzled layout (cuflash/wgmma.cuh).
    auto q_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBM); };
    auto kv_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBN); };
    auto load_kv = [&](int tile, int slot) {
        const int n0 = tile * kBN;
        copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads>(kv_layout, sK + slot * Cfg::kKVTileBytes,
                                                           k + n0 * p.k_row_stride, p.k_row_stride,
                                                           p.seqlen_k - n0, tid);
        copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads>(kv_layout, sV + slot * Cfg::kKVTileBytes,
                                                           v + n0 * p.v_row_stride, p.v_row_stride,
                                                           p.seqlen_k - n0, tid);
    };

    const int warp_row0 = warpgroup * 64 + (warp % 4) * 16;  // first query row of this warp
    const u32 q_rows = sQ + warpgroup * 64 * 128;             // its warpgroup's rows, block 0

    float acc_s[1][kNT][4];
    float acc_o[1][kOT][4];
    float row_max[1][2], row_sum[1][2];
    u32 probs[kBN / 16][4];
    softmax_start(acc_o, row_max, row_sum);

    auto apply_mask = [&](float (&acc)[1][kNT][4], int n0) {
        if (work.needs_mask(n0, p.seqlen_k))
            mask_scores<Cfg::kCausal>(acc, n0, m0 + warp_row0, lane, p.seqlen_k, causal_offset);
    };

    // -- cp.async ring guarded by a block-wide barrier: tile t lives in slot t % kStages, one
    //    commit group per tile; a step needs tile i (and tile i+1 when overlapping) complete. --
    copy_rows_async<kBM, Cfg::kChunksPerRow, kThreads>(q_layout, sQ, q, p.q_row_stride, p.seqlen_q - m0, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < n_tiles) load_kv(n_tiles - 1 - s, s);
        cp_async_commit();
    }
    constexpr int kAhead = Cfg::kOverlap ? 1 : 0;
    auto wait_and_prefetch = [&](int i) {
        cp_async_wait<Cfg::kStages - 2 - kAhead>();
        fence_proxy_async();  // the copies were generic-proxy writes; wgmma reads via the async proxy
        // The tiles have landed for every thread, and every warpgroup is done with tile i-1's slot.
        __syncthreads();
        const int ahead = i + Cfg::kStages - 1;
        if (ahead < n_tiles) load_kv(n_tiles - 1 - ahead, ahead % Cfg::kStages);
        cp_async_commit();
    };
    auto key_tile = [&](int i) { return (i % Cfg::kStages) * Cfg::kKVTileBytes; };

    if constexpr (!Cfg::kOverlap) {
        // One tile, start to finish: S, mask, softmax, O += P V.
        for (int i = 0; i < n_tiles; ++i) {
            wait_and_prefetch(i);
            issue_scores<Cfg>(acc_s[0], q_rows, sK + key_tile(i));
            wgmma_wait<0>();
            fence_operands(acc_s[0]);
            apply_mask(acc_s, (n_tiles - 1 - i) * kBN);
            softmax_rescale<true>(acc_s, acc_o, row_max, row_sum, p.scale_log2);
            probs_registers<Cfg>(probs, acc_s[0]);
            issue_pv<Cfg>(acc_o[0], probs, sV + key_tile(i));
            wgmma_wait<0>();
            fence_operands(acc_o[0]);
        }
    } else if (n_tiles > 0) {
        // Intra-warpgroup overlap: S of tile i+1 runs on the tensor cores while this warpgroup
        // computes the softmax of tile i.
        cp_async_wait<Cfg::kStages - 2>();
        fence_proxy_async();
        __syncthreads();
        issue_scores<Cfg>(acc_s[0], q_rows, sK);
        wgmma_wait<0>();
        fence_operands(acc_s[0]);
        apply_mask(acc_s, (n_tiles - 1) * kBN);
        for (int i = 0; i < n_tiles - 1; ++i) {
            wait_and_prefetch(i);
            float acc_next[1][kNT][4];
            issue_scores<Cfg>(acc_next[0], q_rows, sK + key_tile(i + 1));
            softmax_rescale<false>(acc_s, acc_o, row_max, row_sum, p.scale_log2);
            probs_registers<Cfg>(probs, acc_s[0]);
            issue_pv<Cfg>(acc_o[0], probs, sV + key_tile(i));
            wgmma_wait<0>();
            fence_operands(acc_next[0]);
            fence_operands(acc_o[0]);
            apply_mask(acc_next, (n_tiles - 2 - i) * kBN);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = acc_next[0][nt][e];
        }
        softmax_rescale<false>(acc_s, acc_o, row_max, row_sum, p.scale_log2);
        probs_registers<Cfg>(probs, acc_s[0]);
        issue_pv<Cfg>(acc_o[0], probs, sV + key_tile(n_tiles - 1));
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
    }
    cp_async_wait<0>();
    unsigned short* o = static_cast<unsigned short*>(p.o) + work.batch * p.o_batch_stride + work.head * p.o_head_stride;
    const float sink_log2 = Cfg::kSinks ? p.sinks[work.head] * kLog2e : 0.f;
    store_output<Cfg::kBF16, 0, 0, Cfg::kSinks>(acc_o, row_max, row_sum, o, p.o_row_stride,
                                                p.lse + static_cast<long long>(work.bh) * p.seqlen_q, m0 + warp_row0,
                                                p.seqlen_q, lane, p.scale_log2, 1.f, sink_log2);
}

}  // namespace cuflash
