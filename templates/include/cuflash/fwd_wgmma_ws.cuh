// Attention forward on Hopper, warp-specialized (sm_90a): a TMA producer and two consumer
// warpgroups that take turns on the tensor cores.
//
// Roles (one thread block per query tile of 128 rows, head and batch; 3 warpgroups):
//  - warpgroup 0, the producer, gives most of its registers away (setmaxnreg) and one thread
//    issues every copy: Q once, then K and V tiles into a kStages-deep shared-memory ring. Each
//    copy is a TMA box (64 columns x rows, 128-byte swizzle: the layout wgmma's descriptors
//    read, cuflash/wgmma.cuh) completing on an mbarrier; rows past the end of a sequence arrive
//    as zeros. Before reusing a slot it waits on that slot's `empty` mbarrier (K and V apart).
//  - warpgroups 1 and 2, the consumers, own 64 query rows each. Per key tile i they issue
//    S_i = Q K_i^T and O += P_{i-1} V_{i-1} together (the next tile's scores go to the tensor
//    cores before this tile's softmax), then run the softmax of S_i while the matrix products
//    run; K_i is released once S_i is done, V_{i-1} once its product is.
//  - With kPingPong the two consumers issue their matrix products in turn, ordered by two named
//    barriers, so one warpgroup's softmax runs under the other's products.
//
// Head dims that are not a multiple of 64 are padded: kHeadDim is rounded up to whole 64-column
// blocks, TMA fills the columns past kHeadDimStored with zeros (they add nothing to Q K^T, and V's
// give output columns that are not stored).
//
// The generated kernel provides Cfg with kHeadDim, kHeadDimStored, kBlockM (128), kBlockN, kStages, kCausal,
// kBF16, kPingPong, kProducerRegisters, kComputeRegisters, kSmemQ, kSmemK, kSmemV,
// kSmemBarriers, kKVTileBytes, kVLeadingBytes, kVStrideBytes, the Params struct, the tensor maps
// and the wgmma_qk / wgmma_pv wrappers.
#pragma once
#include "cuflash/fwd_wgmma.cuh"
#include "cuflash/tma.cuh"

namespace cuflash {

// Tensor maps of q, k and v, as 4-d tensors (head_dim, seqlen, heads, batch); boxes of 64
// columns by kBlockM (q) or kBlockN (k, v) rows.
struct FwdTensorMaps {
    TensorMap q, k, v;
};

template <class Cfg>
__device__ __forceinline__ void fwd_wgmma_ws(const typename Cfg::Params& p, const FwdTensorMaps& maps) {
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kNT = kBN / 8;            // n=8 tiles of S per warp
    constexpr int kOT = Cfg::kHeadDim / 8;  // n=8 tiles of O per warp
    constexpr int kColBlocks = Cfg::kHeadDim / 64;
    constexpr int kStages = Cfg::kStages;
    constexpr int kConsumerWarps = 8;

    extern __shared__ unsigned char smem_raw[];
    const u32 smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms: 1024 bytes
    const u32 sQ = smem_base + Cfg::kSmemQ;
    const u32 sK = smem_base + Cfg::kSmemK;
    const u32 sV = smem_base + Cfg::kSmemV;
    // mbarriers: q_full, then per slot full_k, full_v (one arrival: the producer's, plus the
    // copies' bytes) and empty_k, empty_v (one arrival per consumer warp). K and V of a slot are
    // released separately: K once its scores are done, V once its product is.
    const u32 q_full = smem_base + Cfg::kSmemBarriers;
    auto full_k = [&](int slot) { return q_full + 8 + 8 * slot; };
    auto full_v = [&](int slot) { return q_full + 8 + 8 * kStages + 8 * slot; };
    auto empty_k = [&](int slot) { return q_full + 8 + 16 * kStages + 8 * slot; };
    auto empty_v = [&](int slot) { return q_full + 8 + 24 * kStages + 8 * slot; };

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int warpgroup = warp / 4;
    const BlockWork<unsigned short, kBM, kBN, Cfg::kCausal> work(p);
    const int m0 = work.m0, n_tiles = work.n_tiles;

    if (tid == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        mbar_init(q_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), kConsumerWarps);
            mbar_init(empty_v(s), kConsumerWarps);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---- producer ----
        setmaxnreg_dec<Cfg::kProducerRegisters>();
        if (tid == 0 && n_tiles > 0) {  // no key tile: the consumers read nothing, not even Q
            constexpr u32 kQBytes = kBM * Cfg::kHeadDim * 2;
            constexpr u32 kTileBytes = kBN * Cfg::kHeadDim * 2;
            mbar_arrive_expect_tx(q_full, kQBytes);
#pragma unroll
            for (int cb = 0; cb < kColBlocks; ++cb)
                tma_load_4d(sQ + cb * kBM * 128, &maps.q, q_full, cb * 64, m0, work.head, work.batch);
            // Tile t of K (V) goes to slot t % kStages once the consumers released tile
            // t - kStages there. Copies are issued in the order they are consumed: K_{t+1} before V_t.
            auto load = [&](const TensorMap* map, u32 ring, u32 full, u32 empty, int t) {
                const int slot = t % kStages;
                if (t >= kStages) mbar_wait(empty + 8 * slot, (t / kStages - 1) & 1);
                const int n0 = (n_tiles - 1 - t) * kBN;  // diagonal (masked) tiles first
                const u32 tile = ring + slot * Cfg::kKVTileBytes;
                mbar_arrive_expect_tx(full + 8 * slot, kTileBytes);
#pragma unroll
                for (int cb = 0; cb < kColBlocks; ++cb)
                    tma_load_4d(tile + cb * kBN * 128, map, full + 8 * slot, cb * 64, n0, work.head_k, work.batch);
            };
            load(&maps.k, sK, full_k(0), empty_k(0), 0);
            for (int t = 0; t < n_tiles; ++t) {
                if (t + 1 < n_tiles) load(&maps.k, sK, full_k(0), empty_k(0), t + 1);
                load(&maps.v, sV, full_v(0), empty_v(0), t);
            }
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<Cfg::kComputeRegisters>();
    const int group = warpgroup - 1;
    const int warp_row0 = group * 64 + (warp % 4) * 16;  // first query row of this warp
    const u32 q_rows = sQ + group * 64 * 128;             // its warpgroup's rows, block 0

    float acc_s[1][kNT][4];
    float acc_o[1][kOT][4];
    float row_max[1][2], row_sum[1][2], alphas[1][2];
    u32 probs[kBN / 16][4];
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][nt][e] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) { row_max[0][r] = neg_inf(); row_sum[0][r] = 0.f; }

    // Turn-taking: consumer g waits on barrier 1+g before issuing its products and then lets
    // the other one go (arrives on 2-g). Group 1 lets group 0 go first and skips its last
    // arrival, so every barrier phase sees 128 arrivals and 128 waiters.
    constexpr int kTurnThreads = 256;
    auto take_turn = [&]() {
        if constexpr (Cfg::kPingPong) named_barrier_sync(1 + group, kTurnThreads);
    };
    auto pass_turn = [&](bool last) {
        if constexpr (Cfg::kPingPong)
            if (!(last && group == 1)) named_barrier_arrive(2 - group, kTurnThreads);
    };
    auto release = [&](u32 empty) {
        if (lane == 0) mbar_arrive(empty);
    };
    auto phase = [](int i) { return static_cast<u32>((i / kStages) & 1); };
    auto scores_ready = [&](int i) {  // wait for S_i, then mask and softmax it
        fence_operands(acc_s[0]);
        const int n0 = (n_tiles - 1 - i) * kBN;
        if (work.needs_mask(n0, p.seqlen_k))
            mask_scores<Cfg::kCausal>(acc_s, n0, m0 + warp_row0, lane, p.seqlen_k, work.causal_offset);
        softmax_step(acc_s, row_max, row_sum, alphas, p.scale_log2);
    };

    if (n_tiles > 0) {
        if constexpr (Cfg::kPingPong)
            if (group == 1) named_barrier_arrive(1, kTurnThreads);
        mbar_wait(q_full, 0);
        mbar_wait(full_k(0), 0);
        take_turn();
        issue_scores<Cfg>(acc_s[0], q_rows, sK);
        pass_turn(false);
        wgmma_wait<0>();
        release(empty_k(0));
        scores_ready(0);
        probs_registers<Cfg>(probs, acc_s[0]);
        for (int i = 1; i < n_tiles; ++i) {
            const int slot = i % kStages, prev = (i - 1) % kStages;
            mbar_wait(full_k(slot), phase(i));
            take_turn();
            issue_scores<Cfg>(acc_s[0], q_rows, sK + slot * Cfg::kKVTileBytes);
            mbar_wait(full_v(prev), phase(i - 1));
            issue_pv<Cfg>(acc_o[0], probs, sV + prev * Cfg::kKVTileBytes);
            pass_turn(false);
            wgmma_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
            release(empty_k(slot));
            scores_ready(i);
            wgmma_wait<0>();
            fence_operands(acc_o[0]);
            release(empty_v(prev));
            rescale_output<false>(acc_o, alphas);
            probs_registers<Cfg>(probs, acc_s[0]);
        }
        const int last = (n_tiles - 1) % kStages;
        mbar_wait(full_v(last), phase(n_tiles - 1));
        take_turn();
        issue_pv<Cfg>(acc_o[0], probs, sV + last * Cfg::kKVTileBytes);
        pass_turn(true);
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
        release(empty_v(last));
    }
    unsigned short* o = static_cast<unsigned short*>(p.o) + work.batch * p.o_batch_stride + work.head * p.o_head_stride;
    store_output<Cfg::kBF16, Cfg::kHeadDimStored / 8>(acc_o, row_max, row_sum, o, p.o_row_stride,
                             p.lse + static_cast<long long>(work.bh) * p.seqlen_q, m0 + warp_row0,
                             p.seqlen_q, lane, p.scale_log2);
}

}  // namespace cuflash
