// Attention forward on Hopper, warp-specialized (sm_90a): a TMA producer and two or three
// consumer warpgroups that take turns on the tensor cores.
//
// Work tiles (query tile of 64 rows per consumer, head, batch) are handed out at run time: the
// producer takes the next one from a global counter (p.tile_counter) whenever it can load a new
// Q, in the order a one-tile-per-block grid would run them (with a causal mask: heaviest first
// across a band of heads, BlockWork in block.cuh), until none are left, and passes its
// number on to each consumer apart, so that a consumer goes on to the next tile without waiting
// for the others. The grid may hold one block per tile,
// or fewer (persistent): then a block walks several tiles, and the producer loads the next
// tile's Q and first K/V tiles while the consumers finish the last one and store it; tiles of
// unequal (causal) work balance themselves. Without a causal mask, the tiles that would leave
// the last wave of blocks part-empty are dealt out by keys instead (WorkItem, block.cuh): a
// block may then visit part of a tile's keys and leave its unnormalized output to the block
// that visits the rest, which merges the two and stores the rows.
//
// Roles:
//  - warpgroup 0, the producer, gives most of its registers away (setmaxnreg); in its first
//    warp one thread takes the work tiles and issues every copy: Q once, then K and V tiles into a kStages-deep shared-memory ring. Each
//    copy is a TMA box (a column block of 128 bytes by rows, 128-byte swizzle, or of 64 bytes
//    with the 64-byte swizzle at FP8 head dims up to 64: the layout wgmma's descriptors read,
//    cuflash/wgmma.cuh) completing on an mbarrier; rows past the end of a sequence arrive
//    as zeros. Before reusing a slot it waits on that slot's `empty` mbarrier (K and V apart).
//  - warpgroups 1.. (2 or 3), the consumers, own 64 query rows each. Per key tile i they issue
//    S_i = Q K_i^T and O += P_{i-1} V_{i-1} together (the next tile's scores go to the tensor
//    cores before this tile's softmax), then run the softmax of S_i while the matrix products
//    run; K_i is released once S_i is done, V_{i-1} once its product is. A consumer whose rows
//    all lie past seqlen_q (the last query tile of a head, when seqlen_q is not a multiple of
//    kBlockM) computes nothing: it only keeps its place in the barriers.
//  - With kPingPong the consumers issue their matrix products in turn, round robin, ordered by
//    named barriers, so one warpgroup's softmax runs under the others' products.
//
// Head dims that are not a multiple of 64 are padded: kHeadDim is rounded up to whole 64-column
// blocks, TMA fills the columns past kHeadDimStored with zeros (they add nothing to Q K^T, and V's
// give output columns that are not stored).
//
// FP8 inputs (kFp8): Q, K and V are 1-byte e4m3/e5m2 codes and both products run on FP8 wgmma
// (k=32). Column blocks of Q and K are 128 elements wide (head dims pad to multiples of 128),
// or 64 with the 64-byte swizzle at head dims up to 64, which pad to 64 (Cfg::kColBlockBytes).
// FP8 operands must be K-major, so V arrives as V^T (head_dim rows of keys,
// cuflash.fp8.v_operand) and each key tile of it is TMA boxes of 128, 64 or 32 keys by kHeadDim
// rows (spec.fp8_v_box_keys). P is scaled by 2^8 and rounded to e4m3 in registers
// (fp8_probs_operand); the descale factors of q and k multiply the softmax scale and v's
// multiplies the output.
//
// The generated kernel provides Cfg with kHeadDim, kHeadDimStored, kBlockM (128 or 192),
// kBlockN, kStages, kCausal, kBF16, kPingPong, kProducerRegisters, kComputeRegisters, kSmemQ,
// kSmemK, kSmemV, kSmemBarriers, kKVTileBytes, kVLeadingBytes, kVStrideBytes, the Params struct,
// the tensor maps and the wgmma_qk / wgmma_pv wrappers.
#pragma once
#include "cuflash/fwd_wgmma.cuh"
#include "cuflash/tma.cuh"
#include "cuflash/mods.cuh"

namespace cuflash {

// Tensor maps of q, k and v, as 4-d tensors (head_dim, seqlen, heads, batch); boxes of 64
// columns by kBlockM (q) or kBlockN (k, v) rows.
struct FwdTensorMaps {
    TensorMap q, k, v;
};

template <class Cfg>
__device__ __forceinline__ void fwd_wgmma_ws(const typename Cfg::Params& p, const FwdTensorMaps& maps,
                                             const TensorMap* out_map, const typename Cfg::Mods& mods,
                                             const VarlenArgs& varlen = VarlenArgs{}) {
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kNT = kBN / 8;            // n=8 tiles of S per warp
    constexpr int kOT = Cfg::kHeadDim / 8;  // n=8 tiles of O per warp
    constexpr int kColBlocks = Cfg::kColBlocks;
    constexpr int kStages = Cfg::kStages;
    constexpr int kConsumers = kBM / 64;
    constexpr int kConsumerWarps = 4 * kConsumers;
    // Tiles may be dealt out by keys (block.cuh): without a causal mask and with two consumers;
    // bf16/fp16 up to head dim 192, FP8 at every head dim (spec.split_keys).
    constexpr bool kSplitKeys = Cfg::kSplitKeys;
    // kLocal: a window of keys per query row (block.cuh); whole tiles, no block mask.
    static_assert(!(Cfg::kLocal && (kSplitKeys || Cfg::kBlockSparse)), "local: whole tiles, no block mask");
    typedef BlockWork<unsigned short, kBM, kBN, Cfg::kCausal, Cfg::kLocal> Work;

    extern __shared__ unsigned char smem_raw[];
    const u32 smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms: 1024 bytes
    const u32 sQ = smem_base + Cfg::kSmemQ;
    const u32 sK = smem_base + Cfg::kSmemK;
    const u32 sV = smem_base + Cfg::kSmemV;
    // mbarriers: q_full and, per ring slot, full_k and full_v: one arrival (the producer's) plus
    // the copies' bytes. q_empty and, per slot, empty_k and empty_v: one arrival per consumer
    // warp. Q is released once a tile's last scores are done, K_i once S_i is, V_i once P_i V_i is.
    const u32 q_full = smem_base + Cfg::kSmemBarriers;
    const u32 q_empty = q_full + 8;
    auto full_k = [&](int slot) { return q_full + 16 + 8 * slot; };
    auto full_v = [&](int slot) { return q_full + 16 + 8 * kStages + 8 * slot; };
    auto empty_k = [&](int slot) { return q_full + 16 + 16 * kStages + 8 * slot; };
    auto empty_v = [&](int slot) { return q_full + 16 + 24 * kStages + 8 * slot; };
    // The block's next work item (block.cuh; tile -1: none left), handed from the producer warp
    // to the consumers through named barriers: the producer writes it and arrives on each
    // consumer's kTileFull + group; each consumer syncs there (with the producer alone), reads
    // it and arrives on kTileEmpty, where the producer syncs before writing the next one. Items
    // alternate between two 16-byte slots (the n-th in slot n & 1), so that an item is never
    // written over the one just read: compute-sanitizer's racecheck reported the single slot
    // as a potential write-after-read hazard on causal problems with fully masked query tiles.
    // The producer carries the slot's address from item to item (the other slot: 2 * item_slots +
    // 16 - at) rather than derive it from its count: derived, it moved the producer's tile
    // arithmetic off the uniform datapath (docs/tuning.md).
    const u32 item_slots = q_full + 16 + 32 * kStages;
    constexpr int kTileFull = 7, kTileEmpty = 15;  // 1..3 take turns, 4..6 order a warpgroup (below)
    constexpr int kTileThreads = 32 + 128 * kConsumers;

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int warpgroup = warp / 4;
    const int q_tiles = (p.seqlen_q + kBM - 1) / kBM;
    // kVarlen: packed sequences (block.cuh set_sequence). The maps see q and k/v as one sequence
    // of all packed rows (batch 1): a tile's rows start at its sequence's first row, and rows
    // past its end (the next sequence's) are masked as keys and not stored as queries.
    constexpr bool kVarlen = Cfg::kVarlen;
    static_assert(!(kVarlen && (Cfg::kTmaStore || kSplitKeys || Cfg::kFp8)), "varlen: stores per thread, whole tiles, 16-bit");
    auto work_of = [&](int tile) {
        Work w(p, tile, q_tiles);
        if constexpr (kVarlen) w.set_sequence(p, varlen);
        if constexpr (Cfg::kBlockSparse)  // the x-th heaviest tile by the block mask's counts
            w.move_to(p, mods.sparse.nth_heaviest(w.batch, w.head, q_tiles - 1 - w.m0 / kBM));
        return w;
    };
    auto seqlen_q_of = [&](const Work& w) { return kVarlen ? w.seqlen_q : p.seqlen_q; };
    auto seqlen_k_of = [&](const Work& w) { return kVarlen ? w.seqlen_k : p.seqlen_k; };

    if (tid == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        mbar_init(q_full, 1);
        mbar_init(q_empty, kConsumerWarps);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), kConsumerWarps);
            mbar_init(empty_v(s), kConsumerWarps);
        }
        fence_barrier_init();
    }
    if constexpr (Cfg::kSumsOnTensorCores) {  // the block of ones that P's row sums read
        if (tid < Cfg::kOnesBytes / 4) st_shared(smem_base + Cfg::kSmemOnes + 4 * tid, static_cast<int>(Cfg::kOnes));
        fence_proxy_async();
    }
    __syncthreads();

    // Ring positions run on across work tiles: the block's c-th K (V) tile goes to slot
    // c % kStages, in phase (c / kStages) & 1 of that slot's barriers.
    // The key tiles a work tile visits, last first: those below the causal bound, or
    // (kBlockSparse) its row of the block mask's visit lists (entries: key tile << 1 | full).
    constexpr bool kSparse = Cfg::kBlockSparse;
    struct KeyTiles {
        int count;
        const int* row;
        int first;  // the first key tile (kLocal: the window's; else 0)
    };
    auto key_tiles_of = [&](const Work& work) -> KeyTiles {
        if constexpr (kSparse) {
            const int q_tile = work.m0 / kBM;
            return {mods.sparse.count(work.batch, work.head, q_tile), mods.sparse.row(work.batch, work.head, q_tile), 0};
        } else {
            return {work.n_tiles, nullptr, work.n_first};
        }
    };
    // The entry of the t-th tile visited (t < count) and its first key.
    auto visit_entry = [](const KeyTiles& kt, int t) { return kSparse ? kt.row[kt.count - 1 - t] : 0; };
    auto visit_n0 = [&](const KeyTiles& kt, int t) {
        return kSparse ? (visit_entry(kt, t) >> 1) * kBN : (kt.first + kt.count - 1 - t) * kBN;
    };
    auto slot_of = [](int c) { return c % kStages; };
    auto phase_of = [](int c) { return static_cast<u32>((c / kStages) & 1); };

    if (warpgroup == 0) {
        // ---- producer: warp 0; its lane 0 takes tiles and issues every copy ----
        setmaxnreg_dec<Cfg::kProducerRegisters>();
        if (warp != 0) return;
        const bool leader = lane == 0;
        constexpr u32 kQBytes = kBM * kColBlocks * Cfg::kColBlockBytes;
        constexpr u32 kTileBytes = kBN * kColBlocks * Cfg::kColBlockBytes;
        int ring = 0, q_count = 0;
        u32 item_at = item_slots;  // where the next item goes
        int share = -1, share_index = 0;  // the share being dealt out (block.cuh), its next item
        const int key_tiles = (p.seqlen_k + kBN - 1) / kBN;  // of every tile, when tiles are shared out
        for (;;) {
            WorkItem item;
            if (share < 0 || !item.of_share(p, share, share_index++, key_tiles)) {
                int value = 0;
                if (leader) value = atomicAdd(p.tile_counter, 1);
                value = __shfl_sync(0xffffffffu, value, 0);
                share = value - p.dp_tiles;
                share_index = 0;
                if (share >= 0 && share < p.shares) {
                    item.of_share(p, share, share_index++, key_tiles);  // a share has at least one item
                } else {
                    share = -1;
                    item = WorkItem::whole(value < p.dp_tiles ? value : -1);
                }
            }
            if constexpr (kVarlen)  // a tile past its sequence's queries: the next one
                if (item.tile >= 0) {
                    const Work w = work_of(item.tile);
                    if (w.m0 >= w.seqlen_q) continue;
                }
            if (q_count > 0) {
                mbar_wait(q_empty, (q_count - 1) & 1);              // the consumers are done with Q
                named_barrier_sync(kTileEmpty, kTileThreads);      // and have read its work item
            }
            const bool done = item.tile < 0;
            if (leader) st_shared_v4(item_at, item.tile, item.t_begin, item.t_end, item.kind | item.slot << 2);
            item_at = 2 * item_slots + 16 - item_at;
            for (int g = 0; g < kConsumers; ++g) named_barrier_arrive(kTileFull + g, 32 + 128);
            if (done) break;
            const Work work = work_of(item.tile);
            if (leader) {
                mbar_arrive_expect_tx(q_full, kQBytes);
#pragma unroll
                for (int cb = 0; cb < kColBlocks; ++cb)
                    tma_load_4d(sQ + cb * kBM * Cfg::kColBlockBytes, &maps.q, q_full, cb * Cfg::kBoxCols,
                                kVarlen ? work.q_start + work.m0 : work.m0, work.head, kVarlen ? 0 : work.batch);
            }
            ++q_count;
            const KeyTiles kt = key_tiles_of(work);  // kSparse: read from the visit lists after Q's copy is issued
            const int n_tiles = kt.count;
            const int t_begin = item.t_begin, t_end = min(item.t_end, n_tiles);
            // Key tile t (diagonal, masked tiles first) once tile c - kStages of the same ring
            // was released; issued in the order consumed: K_{t+1} before V_t.
            // n0: the tile's first key, read (kSparse: from the visit list) before the wait for its slot.
            auto load = [&](const TensorMap* map, u32 ring_base, u32 full, u32 empty, int t, int n0, bool is_v) {
                const int c = ring + t - t_begin, slot = slot_of(c);
                if (c >= kStages) mbar_wait(empty + 8 * slot, phase_of(c - kStages));
                if (!leader) return;
                const u32 dst = ring_base + slot * Cfg::kKVTileBytes;
                mbar_arrive_expect_tx(full + 8 * slot, kTileBytes);
                if constexpr (Cfg::kFp8) {
                    if (is_v) {  // V^T: boxes of kVBoxKeys keys (bytes) by kHeadDim rows
#pragma unroll
                        for (int kb = 0; kb < kBN / Cfg::kVBoxKeys; ++kb)
                            tma_load_4d(dst + kb * Cfg::kHeadDim * Cfg::kVBoxKeys, map, full + 8 * slot,
                                        n0 + kb * Cfg::kVBoxKeys, 0, work.head_k, work.batch);
                        return;
                    }
                }
#pragma unroll
                for (int cb = 0; cb < kColBlocks; ++cb)
                    tma_load_4d(dst + cb * kBN * Cfg::kColBlockBytes, map, full + 8 * slot, cb * Cfg::kBoxCols,
                                kVarlen ? work.k_start + n0 : n0, work.head_k, kVarlen ? 0 : work.batch);
            };
            // Each tile's first key is read a tile ahead of its K copy (kSparse: a list entry).
            auto n0_of = [&](int t) { return t < t_end ? visit_n0(kt, t) : 0; };
            int n0_v = n0_of(t_begin), n0_k = n0_of(t_begin + 1);
            if (t_begin < t_end) load(&maps.k, sK, full_k(0), empty_k(0), t_begin, n0_v, false);
            for (int t = t_begin; t < t_end; ++t) {
                const int n0_next = n0_of(t + 2);
                if (t + 1 < t_end) load(&maps.k, sK, full_k(0), empty_k(0), t + 1, n0_k, false);
                load(&maps.v, sV, full_v(0), empty_v(0), t, n0_v, true);
                n0_v = n0_k;
                n0_k = n0_next;
            }
            ring += max(t_end - t_begin, 0);
        }
        // The last block to finish taking tiles sets the counter back to zero for the next launch.
        __threadfence();
        if (leader && atomicAdd(p.tile_counter + 1, 1) == gridDim.x - 1) {
            p.tile_counter[0] = 0;
            p.tile_counter[1] = 0;
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<Cfg::kComputeRegisters>();
    // Taken from lane 0, so that the compiler sees it warp-uniform: the Q descriptors derived
    // from it then stay on the uniform datapath instead of being moved there for every wgmma.
    const int group = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    const int warp_row0 = group * 64 + (warp % 4) * 16;  // first query row of this warp in its tile
    const u32 q_rows = sQ + group * 64 * Cfg::kColBlockBytes;  // its warpgroup's rows, block 0

    // Turn-taking: consumer g waits on barrier 1+g before issuing its products and then lets
    // the next one go (arrives on the barrier of g+1, round robin). The last consumer lets
    // consumer 0 go first, and consumer 0 takes one extra turn at the end to absorb the last
    // consumer's final arrival: every barrier phase sees 128 arrivals and 128 waiters.
    constexpr int kTurnThreads = 256;
    const int next_turn = 1 + (group + 1) % kConsumers;
    auto take_turn = [&]() {
        if constexpr (Cfg::kPingPong) named_barrier_sync(1 + group, kTurnThreads);
    };
    auto pass_turn = [&]() {
        if constexpr (Cfg::kPingPong) named_barrier_arrive(next_turn, kTurnThreads);
    };
    if constexpr (Cfg::kPingPong)
        if (group == kConsumers - 1) named_barrier_arrive(1, kTurnThreads);
    auto release = [&](u32 empty) {
        if (lane == 0) mbar_arrive(empty);
    };

    int ring = 0;
    for (int q_count = 0;; ++q_count) {
        named_barrier_sync(kTileFull + group, 32 + 128);
        const u32 item_at = item_slots + 16 * (q_count & 1);  // the q_count-th item
        const int tile = ld_shared(item_at);
        if (tile < 0) break;
        const int t_begin = ld_shared(item_at + 4), t_end = ld_shared(item_at + 8);
        const int kind_slot = ld_shared(item_at + 12);  // kind | slot << 2
        named_barrier_arrive(kTileEmpty, kTileThreads);
        mbar_wait(q_full, q_count & 1);
        const Work work = work_of(tile);
        const KeyTiles kt = key_tiles_of(work);
        const int n_tiles = min(t_end, kt.count) - t_begin;  // key tiles this item visits
        const int first_n0 = kSparse ? (n_tiles > 0 ? visit_n0(kt, t_begin) : 0)
                                     : (kt.first + kt.count - 1 - t_begin) * kBN;  // the first one's keys
        // Visit i's first key; kSparse: `entry` holds its list entry, read ahead of its scores.
        int entry = kSparse && n_tiles > 0 ? visit_entry(kt, t_begin) : 0;
        auto n0_at = [&](int i) { return kSparse ? (entry >> 1) * kBN : first_n0 - i * kBN; };
        // No row of this consumer exists. Taken from lane 0, so that the compiler sees a
        // warp-uniform branch: otherwise the key loop's descriptor arithmetic leaves the uniform
        // datapath (24 more instructions per key tile at hd128).
        const bool idle = __shfl_sync(0xffffffffu, work.m0 + group * 64 >= seqlen_q_of(work), 0);
        if (idle) {
            if (n_tiles == 0) release(q_empty);
            // The same waits, turns and releases as below, without the products: tile i's turn
            // stands for S_i and P_{i-1} V_{i-1}, the last one for the last P V (none without keys).
            for (int i = 0; n_tiles > 0 && i <= n_tiles; ++i) {
                const int c = ring + i;
                if (i < n_tiles) mbar_wait(full_k(slot_of(c)), phase_of(c));
                if (i > 0) mbar_wait(full_v(slot_of(c - 1)), phase_of(c - 1));
                take_turn();
                pass_turn();
                if (i < n_tiles) release(empty_k(slot_of(c)));
                if (i == n_tiles - 1) release(q_empty);
                if (i > 0) release(empty_v(slot_of(c - 1)));
            }
            ring += n_tiles;
            continue;
        }
        float acc_s[1][kNT][4];
        float acc_o[1][kOT][4];
        float row_max[1][2], row_sum[1][2], alphas[1][2];
        u32 probs[kBN / Cfg::kPVStep][4];
        softmax_start(acc_o, row_max, row_sum);
        // kSumsOnTensorCores: every column of acc_sum is the row's sum of P (as rounded for P V),
        // P times the block of ones (any 8 x 32 of it reads ones) beside each k-step of P V.
        float acc_sum[1][1][4] = {};
        constexpr bool kSums = Cfg::kSumsOnTensorCores;
        // Pins the sums' registers around their products (generic, so that kernels without the
        // sums never see the n=8 accumulator's fence).
        auto sums_landed = [&](auto& sums) {
            if constexpr (kSums) fence_operands(sums[0]);
        };
        auto pv = [&](u32 v_tile) {
            if constexpr (kSums) {
                const u64 ones = smem_desc<64>(smem_base + Cfg::kSmemOnes, 16, 512);
                sums_landed(acc_sum);
                issue_pv<Cfg>(acc_o[0], probs, v_tile, [&](int kk) { Cfg::wgmma_sums(acc_sum[0], probs[kk], ones); });
            } else {
                issue_pv<Cfg>(acc_o[0], probs, v_tile);
            }
        };
        // FP8: the descales of q and k scale the scores, v's the output. A negative product of
        // descales (the max would become the min) makes the tile's scores NaN, not wrong.
        float scale_log2 = p.scale_log2, out_scale = 1.f;
        if constexpr (Cfg::kFp8) {
            scale_log2 *= p.q_descale[work.batch * p.q_descale_batch_stride + work.head * p.q_descale_head_stride] *
                          p.k_descale[work.batch * p.kv_descale_batch_stride + work.head_k * p.kv_descale_head_stride];
            out_scale = p.v_descale[work.batch * p.kv_descale_batch_stride + work.head_k * p.kv_descale_head_stride];
            if (!(scale_log2 >= 0.f)) scale_log2 = __int_as_float(0x7fffffff);
        }
        // With mods the scores are scaled (mod_scale) and modded before the softmax, which then
        // takes them in natural units times the score_mod's output factor.
        constexpr bool kMods = Cfg::kScoreMod || Cfg::kMaskMod;
        const float mod_scale = scale_log2 * (kLn2 * Cfg::kScoreInScale);
        if constexpr (kMods) scale_log2 = kLog2e * Cfg::kScoreOutScale;
        constexpr int kLog2Boost = Cfg::kFp8 ? 8 : 0;
        // kLazyRescale: the row max moves only when a tile's max exceeds it by more than the
        // slack (softmax_step), in raw-score units here; max() keeps it finite at a scale of 0.
        constexpr bool kLazy = Cfg::kLazyRescale;
        const float slack = kLazy ? Cfg::kLazySlackLog2 / fmaxf(scale_log2, 1e-30f) : 0.f;

        // S_i has landed in s (acc_s, or its first half: half_s below, always masked): mask it
        // where it needs a mask (may_mask: Flag<false> where none does), softmax it.
        auto scores_ready = [&](auto& s, int i, auto may_mask) {
            constexpr bool kHalf = sizeof(s) < sizeof(acc_s);
            fence_operands(s[0]);
            const int n0 = n0_at(i);
            if constexpr (kMods)
                apply_mods<Cfg>(s, mods, mod_scale, work.batch, work.head, work.m0 + warp_row0, n0, lane,
                                !kSparse || !(entry & 1));
            if (kHalf || (decltype(may_mask)::value && work.needs_mask(n0, seqlen_k_of(work)))) {
                if constexpr (Cfg::kLocal)
                    mask_scores_window<Cfg::kCausal>(s, n0, work.m0 + warp_row0, lane, seqlen_k_of(work),
                                                     work.causal_offset, work.win_left, work.win_right);
                else
                    mask_scores<Cfg::kCausal>(s, n0, work.m0 + warp_row0, lane, seqlen_k_of(work), work.causal_offset);
            }
            softmax_step<kLog2Boost, !kSums, kLazy>(s, row_max, row_sum, alphas, scale_log2, slack);
        };

        // kHalfFirstTile: no row of this warpgroup sees the second half of the first key tile
        // (the causal diagonal's, or the tail of the keys): its scores are computed half wide
        // (the first kNT / 2 n=8 tiles of acc_s) and P there is 0. Each branch waits for its
        // own product: a wgmma left in flight across the branch makes ptxas serialize them all.
        float (&half_s)[1][kNT / 2][4] = reinterpret_cast<float (&)[1][kNT / 2][4]>(acc_s);
        bool half_first = false;
        if constexpr (Cfg::kHalfFirstTile) {
            int last_key = seqlen_k_of(work) - 1;  // the last key any row of the warpgroup sees
            if constexpr (Cfg::kCausal) last_key = min(last_key, work.m0 + group * 64 + 63 + work.causal_offset);
            if constexpr (Cfg::kLocal)
                if (work.win_right >= 0)
                    last_key = min(last_key, work.m0 + group * 64 + 63 + work.causal_offset + work.win_right);
            half_first = __shfl_sync(0xffffffffu, last_key < first_n0 + kBN / 2, 0);
        }

        if (n_tiles == 0) release(q_empty);  // no key to attend: the rows are stored as zeros
        if (n_tiles > 0) {
            mbar_wait(full_k(slot_of(ring)), phase_of(ring));
            const u32 k_first = sK + slot_of(ring) * Cfg::kKVTileBytes;
            auto first_scores = [&](auto& s) {
                issue_scores<Cfg>(s[0], q_rows, k_first);
                pass_turn();
                wgmma_wait<0>();
            };
            take_turn();
            if (half_first) first_scores(half_s);
            else first_scores(acc_s);
            release(empty_k(slot_of(ring)));
            if (n_tiles == 1) release(q_empty);
            auto first_probs = [&](auto& s) {
                scores_ready(s, 0, Flag<true>());
                probs_registers<Cfg>(probs, s[0]);
            };
            if (half_first) first_probs(half_s);
            else first_probs(acc_s);
            // Key tile i >= 1: S_i issued with P_{i-1} V_{i-1}, then S_i's softmax. kEarlyRescale:
            // O takes the last tile's alphas before P_{i-1} V_{i-1} is issued, under S_i, rather
            // than this tile's once that product is done.
            auto key_step = [&](int i, auto may_mask) {
                const int c = ring + i;
                if constexpr (kSparse) entry = visit_entry(kt, t_begin + i);
                mbar_wait(full_k(slot_of(c)), phase_of(c));
                take_turn();
                issue_scores<Cfg>(acc_s[0], q_rows, sK + slot_of(c) * Cfg::kKVTileBytes);
                if constexpr (Cfg::kEarlyRescale) {
                    rescale_output<kLazy>(acc_o, alphas);
                    if constexpr (kSums) rescale_output<kLazy>(acc_sum, alphas);
                }
                mbar_wait(full_v(slot_of(c - 1)), phase_of(c - 1));
                pv(sV + slot_of(c - 1) * Cfg::kKVTileBytes);
                pass_turn();
                wgmma_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
                release(empty_k(slot_of(c)));
                if (i == n_tiles - 1) release(q_empty);
                scores_ready(acc_s, i, may_mask);
                wgmma_wait<0>();
                fence_operands(acc_o[0]);
                sums_landed(acc_sum);
                release(empty_v(slot_of(c - 1)));
                if constexpr (!Cfg::kEarlyRescale) {
                    rescale_output<kLazy>(acc_o, alphas);
                    if constexpr (kSums) rescale_output<kLazy>(acc_sum, alphas);
                }
                probs_registers<Cfg>(probs, acc_s[0]);
            };
            // The tiles that need a mask are the first ones visited: without a causal mask only
            // the keys' tail (tile 0, above), with one also the diagonal's. Unless kMaskInLoop, they
            // run in a loop of their own and the loop of the others has no masking branch: ptxas
            // places the wait for P_{i-1} V_{i-1} where that branch joins, and without it lets
            // the softmax's max and first exponentials run before the wait.
            // kLocal: the tiles that hold keys left of the window's edge are the last ones visited,
            // and also loop apart.
            int i = 1;
            if constexpr ((Cfg::kCausal || Cfg::kLocal) && !Cfg::kMaskInLoop)
                for (; i < n_tiles && work.needs_mask(kSparse ? visit_n0(kt, t_begin + i) : first_n0 - i * kBN,
                                                      seqlen_k_of(work)); ++i)
                    key_step(i, Flag<true>());
            if constexpr (Cfg::kLocal && !Cfg::kMaskInLoop) {
                int unmasked_end = n_tiles;
                while (unmasked_end > i && work.needs_left_mask(first_n0 - (unmasked_end - 1) * kBN)) --unmasked_end;
                for (; i < unmasked_end; ++i) key_step(i, Flag<false>());
                for (; i < n_tiles; ++i) key_step(i, Flag<true>());
            } else {
                for (; i < n_tiles; ++i) key_step(i, Flag<Cfg::kMaskInLoop>());
            }
            const int c = ring + n_tiles - 1;
            if constexpr (Cfg::kEarlyRescale) {
                rescale_output<kLazy>(acc_o, alphas);
                if constexpr (kSums) rescale_output<kLazy>(acc_sum, alphas);
            }
            mbar_wait(full_v(slot_of(c)), phase_of(c));
            take_turn();
            pv(sV + slot_of(c) * Cfg::kKVTileBytes);
            pass_turn();
            wgmma_wait<0>();
            fence_operands(acc_o[0]);
            sums_landed(acc_sum);
            release(empty_v(slot_of(c)));
            ring += n_tiles;
        }
        // The epilogue's thread coordinates; kEpilogueRereadsThread: read anew after the key
        // loop, where registers are shortest (spec.epilogue_rereads_thread). Derived from the
        // earlier read, the compiler computes the epilogue's addresses before the loop and holds
        // them across it.
        const int epi_thread = Cfg::kEpilogueRereadsThread ? thread_index_reread() : tid;
        const int epi_lane = epi_thread % 32;
        const int epi_row0 = group * 64 + (epi_thread / 32 % 4) * 16;
        // The tensor cores' sums, a quarter in each lane of the quad, as the epilogue (which adds
        // up the quad's partial sums) expects them.
        if constexpr (kSums)
            for (int r = 0; r < 2; ++r) row_sum[0][r] = 0.25f * acc_sum[0][0][2 * r];
        // kVarlen: the LSE is [heads, total_q] and O's rows are the packed rows. The sequence's
        // offsets are read again here rather than held across the key loop.
        int epi_q_start = 0, epi_rows = 0;  // kVarlen: the sequence's first row and its queries
        if constexpr (kVarlen) {
            Work w = work;
            w.template set_sequence<true>(p, varlen);
            epi_q_start = w.q_start;
            epi_rows = w.seqlen_q;
        }
        auto epi_seqlen_q = [&]() { return kVarlen ? epi_rows : p.seqlen_q; };
        float* lse_rows = kVarlen ? p.lse + static_cast<long long>(work.head) * varlen.total_q + epi_q_start
                                  : p.lse + static_cast<long long>(work.bh) * p.seqlen_q;
        unsigned short* o = static_cast<unsigned short*>(p.o) + work.batch * p.o_batch_stride + work.head * p.o_head_stride;
        if constexpr (kVarlen) o += epi_q_start * p.o_row_stride;
        const float sink_log2 = Cfg::kSinks ? p.sinks[work.head] * kLog2e : 0.f;  // natural -> log2
        const int kind = kind_slot & 3;
        if (kSplitKeys && kind != kWholeTile) {
            // A piece of a tile dealt out by keys (block.cuh): the piece that ends a share leaves
            // its state in the workspace slot (side 0) and raises the slot's flag; the piece that
            // starts the next share saves its own (side 1), waits for the flag, and merges the two
            // into the rows it stores. Named barrier 4 + group orders the warpgroup's threads.
            const int flag_index = (kind_slot >> 2) * kConsumers + group;
            float4* state = reinterpret_cast<float4*>(p.split_ws) + flag_index * 2 * 128 * (kOT + 1) + epi_thread % 128;
            float4* own = state + (kind == kMergeTile ? 128 * (kOT + 1) : 0);
            save_state(own, 128, acc_o, row_max, row_sum);
            if (kind == kPartialTile) {
                __threadfence();
                named_barrier_sync(4 + group, 128);
                if (epi_thread % 128 == 0) st_release(p.split_flags + flag_index, 1);
                continue;
            }
            if (epi_thread % 128 == 0) {
                while (ld_acquire(p.split_flags + flag_index) == 0) __nanosleep(100);
                p.split_flags[flag_index] = 0;  // for the next launch
            }
            named_barrier_sync(4 + group, 128);
            merge_store<Cfg::kBF16, Cfg::kHeadDimStored / 8, kLog2Boost, kOT, Cfg::kSinks>(
                state, own, 128, o, p.o_row_stride, lse_rows, work.m0 + epi_row0, epi_seqlen_q(), epi_lane, scale_log2,
                out_scale, sink_log2);
            continue;
        }
        if constexpr (Cfg::kTmaStore) {
            // Through shared memory: the warpgroup's 64 rows go into its rows of the staging tile
            // (64-column swizzled blocks, Q's layout) and leave as TMA stores, which clip rows past
            // seqlen_q and columns past the head dim. The staging rows are reused once the
            // warpgroup's last stores have read them. One thread of the warpgroup issues the
            // stores; named barrier 4 + group (1..3 take turns) orders its 128 threads.
            const bool store_leader = epi_thread % 128 == 0;
            const int store_barrier = 4 + group;
            const u32 sO = smem_base + Cfg::kSmemO;
            if (store_leader) bulk_wait_group_read<0>();
            named_barrier_sync(store_barrier, 128);
            finish_output<Cfg::kBF16, Cfg::kHeadDimStored / 8, kLog2Boost, Cfg::kSinks>(
                acc_o, row_max, row_sum, lse_rows, work.m0 + epi_row0, epi_seqlen_q(), epi_lane, scale_log2, out_scale,
                [&](int row, int nt, u32 packed) {
                    st_shared(sO + swizzled_offset(epi_row0 + row, nt, kBM) + (epi_lane % 4) * 4, static_cast<int>(packed));
                }, sink_log2);
            fence_proxy_async();  // written through the generic proxy, read by the TMA store
            named_barrier_sync(store_barrier, 128);
            if (store_leader) {
#pragma unroll
                for (int cb = 0; cb < (Cfg::kHeadDimStored + 63) / 64; ++cb)
                    tma_store_4d(out_map, sO + cb * kBM * 128 + group * 64 * 128, cb * 64, work.m0 + group * 64,
                                 work.head, work.batch);
                bulk_commit_group();
            }
        } else {
            store_output_wide<Cfg::kBF16, Cfg::kHeadDimStored / 8, kLog2Boost, Cfg::kSinks>(
                acc_o, row_max, row_sum, o, p.o_row_stride, lse_rows, work.m0 + epi_row0, epi_seqlen_q(), epi_lane,
                scale_log2, out_scale, sink_log2);
        }
    }
    if constexpr (Cfg::kTmaStore)
        if (tid % 128 == 0) bulk_wait_group<0>();  // the block's shared memory outlives its last stores
    if constexpr (Cfg::kPingPong)
        if (group == 0) take_turn();
}

}  // namespace cuflash
