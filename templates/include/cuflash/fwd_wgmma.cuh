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
// With kWarpSpecialized, warpgroup 0 is a producer that only issues the copies and hands ring
// slots to the compute warpgroups through mbarriers (no block-wide barrier in the loop), with
// setmaxnreg moving registers from the producer to the compute warpgroups.
//
// The generated kernel provides Cfg with kHeadDim, kBlockM, kBlockN, kWarps, kStages, kCausal,
// kOverlap, kWarpSpecialized, kProducerRegisters, kComputeRegisters, kSmemBarriers, kBF16, kChunksPerRow, kSmemQ, kSmemK, kSmemV, kKVTileBytes, the Params struct, and the
// wgmma_ss_n<kBlockN> / wgmma_rs_n<kHeadDim> wrappers.
#pragma once
#include "cuflash/block.cuh"
#include "cuflash/online_softmax.cuh"
#include "cuflash/wgmma.cuh"

namespace cuflash {

template <class Cfg>
__device__ __forceinline__ void fwd_wgmma(const typename Cfg::Params& p) {
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kNT = kBN / 8;           // n=8 tiles of S per warp
    constexpr int kOT = kD / 8;            // n=8 tiles of O per warp
    constexpr int kColBlocks = kD / 64;    // 128-byte column blocks of a swizzled tile
    constexpr bool kBF16 = Cfg::kBF16;

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

    // Warp-specialized: warpgroup 0 only copies (the producer), the others only compute.
    // Otherwise every thread does both, and a block-wide barrier guards the ring.
    constexpr bool kWS = Cfg::kWarpSpecialized;
    constexpr int kLoaders = kWS ? 128 : Cfg::kWarps * 32;
    const int compute_group = kWS ? warpgroup - 1 : warpgroup;

    // Tiles are stored in wgmma's 128-byte swizzled layout (cuflash/wgmma.cuh).
    auto q_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBM); };
    auto kv_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBN); };
    auto load_q = [&](int loader) {
        copy_rows_async<kBM, Cfg::kChunksPerRow, kLoaders, kWS>(q_layout, sQ, q, p.q_row_stride,
                                                                p.seqlen_q - m0, loader);
    };
    auto load_kv = [&](int tile, int slot, int loader) {
        const int n0 = tile * kBN;
        copy_rows_async<kBN, Cfg::kChunksPerRow, kLoaders, kWS>(kv_layout, sK + slot * Cfg::kKVTileBytes,
                                                                k + n0 * p.k_row_stride, p.k_row_stride,
                                                                p.seqlen_k - n0, loader);
        copy_rows_async<kBN, Cfg::kChunksPerRow, kLoaders, kWS>(kv_layout, sV + slot * Cfg::kKVTileBytes,
                                                                v + n0 * p.v_row_stride, p.v_row_stride,
                                                                p.seqlen_k - n0, loader);
    };

    const int warp_row0 = compute_group * 64 + (warp % 4) * 16;  // first query row of this warp
    const u32 q_rows = sQ + compute_group * 64 * 128;             // its warpgroup's rows, block 0

    float acc_s[1][kNT][4];
    float acc_o[1][kOT][4];
    float row_max[1][2], row_sum[1][2];
    auto init_accumulators = [&]() {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][nt][e] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) { row_max[0][r] = neg_inf(); row_sum[0][r] = 0.f; }
    };

    // -- S = Q K^T: both operands K-major in shared memory; k=16 steps are 32 bytes apart inside
    //    a 128-byte column block. Issued asynchronously; the caller waits. --
    auto issue_qk = [&](float (&acc)[kNT][4], int slot) {
        const u32 sKs = sK + slot * Cfg::kKVTileBytes;
        wgmma_fence();
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                Cfg::wgmma_qk(acc, smem_desc(q_rows + cb * kBM * 128 + ks * 32, 16, 1024),
                              smem_desc(sKs + cb * kBN * 128 + ks * 32, 16, 1024), cb + ks);
        wgmma_commit();
    };

    // -- O += P V: P from registers, V (keys x head_dim, head_dim contiguous) read transposed;
    //    16 keys are 2048 bytes apart, 64-column blocks kBlockN*128 bytes apart. Asynchronous. --
    u32 probs[kBN / 16][4];  // all of P first: registers that wgmma reads must be settled
    auto issue_pv = [&](const float (&acc)[kNT][4], int slot) {
        const u32 sVs = sV + slot * Cfg::kKVTileBytes;
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) probs_operand<kBF16>(probs[kk], acc, kk);
        fence_operands(acc_o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)
            Cfg::wgmma_pv(acc_o[0], probs[kk],
                          smem_desc(sVs + kk * 2048, Cfg::kVLeadingBytes, Cfg::kVStrideBytes), 1);
        wgmma_commit();
    };

    auto apply_mask = [&](float (&acc)[1][kNT][4], int n0) {
        if (work.needs_mask(n0, p.seqlen_k))
            mask_scores<Cfg::kCausal>(acc, n0, m0 + warp_row0, lane, p.seqlen_k, causal_offset);
    };

    // One tile, start to finish: S, mask, softmax, O += P V.
    auto compute_tile = [&](int i, int slot) {
        issue_qk(acc_s[0], slot);
        wgmma_wait<0>();
        fence_operands(acc_s[0]);
        apply_mask(acc_s, (n_tiles - 1 - i) * kBN);
        softmax_rescale<true>(acc_s, acc_o, row_max, row_sum, p.scale_log2);
        issue_pv(acc_s[0], slot);
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
    };

    auto store = [&]() {
        unsigned short* o = static_cast<unsigned short*>(p.o) + work.batch * p.o_batch_stride
                            + work.head * p.o_head_stride;
        store_output<kBF16>(acc_o, row_max, row_sum, o, p.o_row_stride,
                            p.lse + static_cast<long long>(work.bh) * p.seqlen_q, m0 + warp_row0,
                            p.seqlen_q, lane, p.scale_log2);
    };

    if constexpr (kWS) {
        // mbarriers: q_full (producer threads arrive once Q landed), full[s] (tile in slot s
        // landed), empty[s] (every compute thread is done reading slot s).
        const u32 q_full = smem_base + Cfg::kSmemBarriers;
        const u32 full = q_full + 8;
        const u32 empty = full + 8 * Cfg::kStages;
        constexpr u32 kComputeThreads = (Cfg::kWarps - 4) * 32;
        if (tid == 0) {
            mbar_init(q_full, 128);
            for (int s = 0; s < Cfg::kStages; ++s) {
                mbar_init(full + 8 * s, 128);
                mbar_init(empty + 8 * s, kComputeThreads);
            }
        }
        __syncthreads();
        if (warpgroup == 0) {
            setmaxnreg_dec<Cfg::kProducerRegisters>();
            const int loader = tid;
            // Each copy group is signalled one tile late, once it has landed (wait_group 1 keeps
            // the newest group in flight); the fence hands the data to wgmma's async proxy.
            load_q(loader);
            cp_async_commit();
            for (int t = 0; t < n_tiles; ++t) {
                const int slot = t % Cfg::kStages;
                if (t >= Cfg::kStages) mbar_wait(empty + 8 * slot, (t / Cfg::kStages - 1) & 1);
                load_kv(n_tiles - 1 - t, slot, loader);
                cp_async_commit();
                cp_async_wait<1>();
                fence_proxy_async();
                mbar_arrive(t == 0 ? q_full : full + 8 * ((t - 1) % Cfg::kStages));
            }
            cp_async_wait<0>();
            fence_proxy_async();
            mbar_arrive(n_tiles == 0 ? q_full : full + 8 * ((n_tiles - 1) % Cfg::kStages));
        } else {
            setmaxnreg_inc<Cfg::kComputeRegisters>();
            init_accumulators();
            mbar_wait(q_full, 0);
            for (int i = 0; i < n_tiles; ++i) {
                const int slot = i % Cfg::kStages;
                mbar_wait(full + 8 * slot, (i / Cfg::kStages) & 1);
                compute_tile(i, slot);
                mbar_arrive(empty + 8 * slot);
            }
            store();
        }
        return;
    }

    // -- one role for all threads: cp.async ring guarded by a block-wide barrier --
    load_q(tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < n_tiles) load_kv(n_tiles - 1 - s, s, tid);
        cp_async_commit();
    }
    init_accumulators();

    // Ring bookkeeping as in the mma.sync kernel: tile t lives in slot t % kStages, one commit
    // group per tile; a step needs tile i (and tile i+1 when overlapping) complete.
    constexpr int kAhead = Cfg::kOverlap ? 1 : 0;
    auto wait_and_prefetch = [&](int i) {
        cp_async_wait<Cfg::kStages - 2 - kAhead>();
        fence_proxy_async();  // the copies were generic-proxy writes; wgmma reads via the async proxy
        // The tiles have landed for every thread, and every warpgroup is done with tile i-1's slot.
        __syncthreads();
        const int ahead = i + Cfg::kStages - 1;
        if (ahead < n_tiles) load_kv(n_tiles - 1 - ahead, ahead % Cfg::kStages, tid);
        cp_async_commit();
    };

    if constexpr (!Cfg::kOverlap) {
        for (int i = 0; i < n_tiles; ++i) {
            wait_and_prefetch(i);
            compute_tile(i, i % Cfg::kStages);
        }
    } else if (n_tiles > 0) {
        // Intra-warpgroup overlap: S of tile i+1 runs on the tensor cores while this warpgroup
        // computes the softmax of tile i.
        cp_async_wait<Cfg::kStages - 2>();
        fence_proxy_async();
        __syncthreads();
        issue_qk(acc_s[0], 0);
        wgmma_wait<0>();
        fence_operands(acc_s[0]);
        apply_mask(acc_s, (n_tiles - 1) * kBN);
        for (int i = 0; i < n_tiles - 1; ++i) {
            wait_and_prefetch(i);
            float acc_next[1][kNT][4];
            issue_qk(acc_next[0], (i + 1) % Cfg::kStages);
            softmax_rescale<false>(acc_s, acc_o, row_max, row_sum, p.scale_log2);
            issue_pv(acc_s[0], i % Cfg::kStages);
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
        issue_pv(acc_s[0], (n_tiles - 1) % Cfg::kStages);
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
    }
    cp_async_wait<0>();
    store();
}

}  // namespace cuflash
