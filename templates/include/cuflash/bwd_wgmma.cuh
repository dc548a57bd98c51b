// Attention backward on Hopper tensor cores (wgmma, sm_90a): the K/V-outer kernel.
//
// One thread block per (key tile, kv head, batch) with two warpgroups. K, V and a kStages-deep
// ring of query tiles (Q, dO, lse2, delta) sit in shared memory in wgmma's 128-byte swizzled
// layout (cuflash/wgmma.cuh). kTma: thread 0 loads them by TMA (tensor maps of q, k, v and dout;
// bulk copies of lse2 and delta), each ring slot completing on its mbarrier; else every thread
// copies its share with cp.async (views TMA cannot read). Packed sequences (kVarlen) read their
// tiles at the sequence's first rows of arrays of batch 1, and their lse2 / delta copies start at
// the 16-byte boundary below the tile's first row (kStatsRows values per slot). Head dims up to 128: the key tile has 128 rows and each
// warpgroup owns 64 of them with their dK / dV accumulators (registers, for the whole loop).
// Per query tile of kBlockM rows:
//   S^T = K Q^T and dP^T = V dO^T     both operands from shared memory (K-major);
//   P^T, dS^T = P^T * (dP^T - delta)  in registers, in the accumulators' m16n8 fragment layout;
//   dV += P^T dO and dK += dS^T Q     A from registers, B read transposed by its descriptor;
//   dQ += dS K (unless kDqKernel)     dS^T goes to shared memory and is read back transposed as
//                                     the A operand; each warpgroup takes half of dQ's columns
//                                     and adds them into the float32 accumulator: (kBulkDq) both
//                                     write their fragments to shared memory, and one thread
//                                     adds the whole tile by one bulk reduce-add: (kDqDouble)
//                                     thread 128 in the next step, while dV and dK are
//                                     computed, the partial tiles alternating between two
//                                     places in shared memory; else thread 0 at the next
//                                     step's start. The accumulator keeps fragment order
//                                     (bwd_common.cuh's dq_fragment_offset).
// kOrderedDq (deterministic, with kDqDouble): the key tiles of a head add into each dQ tile one
// after the other, in their order. A counter per (batch, query head, query tile) holds how many
// have added: a block adds step t-1's tile once the counter reads its key tile's index, and
// raises it at the end of step t+1, once the add has landed. Every key tile before a block's
// visits every query tile the block visits, and precedes it in the grid's order, so each wait
// ends.
// Wider head dims (kSplitD): the key tile has 64 rows, and both warpgroups own all of them with
// half of the head dim each. Warpgroup 0 computes S^T and P^T, warpgroup 1 dP^T and dS^T, trading
// P^T and dS^T through shared memory (swizzled, K-major), from where both read them as the A
// operands of their halves of dV += P^T dO and dK += dS^T Q. Its dQ partial tile (64 x 256
// floats) has no room of its own: each warpgroup writes its two 64-column chunks over the halves
// of the step's Q and dO tiles that only its own dK and dV read, thread 0 adds them at the next
// step's start, and the slot's next load waits for that add's reads (kDqInSlot).
// The masking, the probabilities and the epilogue are those of the mma.sync backward.
//
// Head dims other than 64, 128 and 256 are computed padded to the next of them (kHeadDim; the
// problem's is kHeadDimStored): the copies fill the missing columns of Q, K, V and dO with zeros,
// which add nothing to S^T, dP^T or the products, and the extra columns of dK, dV and dQ are
// neither stored nor accumulated.
//
// The generated kernel provides Cfg with kHeadDim, kHeadDimStored, kBlockM, kBlockN, kStages,
// kCausal, kBF16, kDqKernel, kDqDouble, kOrderedDq, kSplitD, kChunksPerRow (of the padded tile), kChunksValid (of
// the problem's rows), kSmemK, kSmemV, kSmemQ, kSmemDO, kQTileBytes, kSmemLse2,
// kSmemDelta, kSmemDS, kSmemP, kTma, kStatsRows, kSmemBars, the Params struct and the wgmma_scores / wgmma_grad (or
// wgmma_grad_ss) / wgmma_dq wrappers.
#pragma once
#include "cuflash/bwd_mma.cuh"
#include "cuflash/tma.cuh"
#include "cuflash/wgmma.cuh"

namespace cuflash {

// The kTma kernel's maps: 4-d tensors (head dim, rows, heads, batch) in boxes of 64 columns by a
// tile's rows; columns past the head dim and rows past a sequence arrive as zeros.
struct BwdTensorMaps {
    TensorMap q, k, v, dout;
};

template <class Cfg>
__device__ __forceinline__ void bwd_dkdv_wgmma(const typename Cfg::Params& p, const typename Cfg::Mods& mods,
                                               const VarlenArgs& varlen = VarlenArgs{},
                                               const BwdTensorMaps* maps = nullptr) {
    constexpr bool kMods = Cfg::kScoreMod || Cfg::kMaskMod;  // scores modded: P from them with log2(e)
    constexpr bool kGrad = Cfg::kScoreModGrad;
    constexpr bool kBF16 = Cfg::kBF16;
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kDStored = Cfg::kHeadDimStored;  // <= kD; dQ's accumulator rows are this wide
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kQT = kBM / 8;          // n=8 tiles of S^T (query columns)
    constexpr int kColBlocks = kD / 64;   // 128-byte column blocks of a swizzled Q/K/V tile
    constexpr int kThreads = 256;
    constexpr bool kSplitD = Cfg::kSplitD;
    constexpr int kGradCols = kSplitD ? kD / 2 : kD;  // dK / dV columns of one warpgroup
    constexpr int kGT = kGradCols / 8;
    static_assert(kBN == (kSplitD ? 64 : 128) && kBM == 64 && kD % 64 == 0, "warpgroups of 64 keys, 64-query steps");
    // A transposed (MN-major) operand may start inside a 64-column block only if it ends there.
    static_assert(kGradCols % 64 == 0 && (kD / 2 <= 64 || kD % 256 == 0), "column ranges on 64-column blocks");

    extern __shared__ unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
    const u32 sK = base + Cfg::kSmemK, sV = base + Cfg::kSmemV;
    const u32 sQ = base + Cfg::kSmemQ, sDO = base + Cfg::kSmemDO, sDS = base + Cfg::kSmemDS;
    const float* s_lse2_all = reinterpret_cast<const float*>(smem + Cfg::kSmemLse2);
    const float* s_delta_all = reinterpret_cast<const float*>(smem + Cfg::kSmemDelta);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Taken from lane 0, so that the compiler sees it warp-uniform: the descriptors derived from
    // it then stay on the uniform datapath instead of being moved there for every wgmma.
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
    const int key_row0 = (kSplitD ? 0 : wg * 64) + (warp % 4) * 16;  // first key row (in the tile) of this warp
    const int grad_col0 = kSplitD ? wg * kGradCols : 0;             // first dK / dV column of this warpgroup
    constexpr bool kDqDouble = Cfg::kDqDouble;
    constexpr bool kDqInSlot = Cfg::kBulkDq && kSplitD;  // the dQ tile in the step's ring slot
    static_assert(!kDqInSlot || (Cfg::kQTileBytes == kBM * kD * 2 && !kDqDouble), "half a dQ tile per Q / dO tile");
    constexpr bool kOrderedDq = Cfg::kOrderedDq;
    static_assert(!kDqDouble || (Cfg::kBulkDq && !Cfg::kVarlen && !Cfg::kBlockSparse), "two whole dQ tiles");
    static_assert(!kOrderedDq || kDqDouble, "ordered adds from two dQ tiles");
    // Chunks of heads in the grid's order: with a causal mask, and for the turns of kOrderedDq.
    DkdvWork w = dkdv_work<kBM, kBN, Cfg::kCausal, typename Cfg::Params, Cfg::kCausal || kOrderedDq,
                           kDqDouble && Cfg::kCausal ? kOrderedHeadsPerChunk : kCausalHeadsPerChunk>(p);
    // kVarlen: block (key tile, kv head, sequence) of packed sequences; rows sit at the sequence's
    // first rows of the packed arrays (batch strides 0), and lse2 / delta / the dQ accumulator are
    // [heads, rows_padded] over all packed query rows.
    constexpr bool kVarlen = Cfg::kVarlen;
    if constexpr (kVarlen) {
        w.set_sequence<kBM, Cfg::kCausal>(p, varlen);
        if (w.n0 >= w.seqlen_k) return;  // past the sequence's keys: nothing to compute or store
    }
    auto seqlen_q_of = [&]() { return kVarlen ? w.seqlen_q : p.seqlen_q; };
    auto seqlen_k_of = [&]() { return kVarlen ? w.seqlen_k : p.seqlen_k; };
    // kLocal: a window of keys per query row (params window_left / window_right): the key tile
    // visits only the query tiles that see it, and masks those at the window's edges.
    constexpr bool kLocal = Cfg::kLocal;
    static_assert(!(kLocal && (Cfg::kBlockSparse || kOrderedDq)), "local: not deterministic, no block mask");
    if constexpr (kLocal) w.bound_to_window<kBM, kBN>(p.window_left, p.window_right, seqlen_q_of(), p.group);
    // kLocal: a key at rel keys from the query's own position is seen iff win_lo <= rel <= win_hi.
    int win_hi = Cfg::kCausal ? 0 : 1 << 30, win_lo = -(1 << 30);
    if constexpr (kLocal) {
        if (p.window_right >= 0) win_hi = min(win_hi, p.window_right);
        if (p.window_left >= 0) win_lo = -p.window_left;
    }
    // kBlockSparse: the key tile's query tiles from the block mask's lists (one list for every
    // head: cuflash.sparsity), last first; entries are query tile << 1 | full.
    const int* visits = nullptr;
    if constexpr (Cfg::kBlockSparse) {
        const int key_tile = w.n0 / kBN;
        w.m_tiles = mods.sparse.count(w.batch, 0, key_tile);
        w.steps = w.m_tiles * p.group;
        visits = mods.sparse.row(w.batch, 0, key_tile);
    }
    auto step_m0 = [&](int t) {
        if constexpr (Cfg::kBlockSparse) return (visits[w.m_tiles - 1 - t % w.m_tiles] >> 1) * kBM;
        else return w.step_m0<kBM>(t);
    };

    auto q_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBM); };
    auto kv_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBN); };
    const unsigned short* k = static_cast<const unsigned short*>(p.k) + w.batch * p.k_batch_stride
                              + w.head_k * p.k_head_stride + w.n0 * p.k_row_stride;
    const unsigned short* v = static_cast<const unsigned short*>(p.v) + w.batch * p.v_batch_stride
                              + w.head_k * p.v_head_stride + w.n0 * p.v_row_stride;
    if constexpr (kVarlen) {
        k += w.k_start * p.k_row_stride;
        v += w.k_start * p.v_row_stride;
    }
    constexpr int kValid = Cfg::kChunksValid;
    // kTma: mbarriers at kSmemBars, the K/V tiles' first, then one per ring slot.
    constexpr bool kTma = Cfg::kTma;
    // The tensor maps' coordinates: packed sequences are arrays of batch 1, the sequence's rows from
    // its first one (rows past it are the next sequence's, which the masks leave out).
    const int q_row0 = kVarlen ? w.q_start : 0, k_row0 = kVarlen ? w.k_start : 0, map_batch = kVarlen ? 0 : w.batch;
    const u32 kv_full = base + Cfg::kSmemBars;
    auto slot_full = [&](int slot) { return kv_full + 8 + 8 * slot; };
    if constexpr (kTma) {
        if (tid == 0) {
            mbar_init(kv_full, 1);
#pragma unroll
            for (int s = 0; s < Cfg::kStages; ++s) mbar_init(slot_full(s), 1);
            fence_barrier_init();
            mbar_arrive_expect_tx(kv_full, 2 * kColBlocks * kBN * 128);
#pragma unroll
            for (int cb = 0; cb < kColBlocks; ++cb) {
                tma_load_4d(sK + cb * kBN * 128, &maps->k, kv_full, cb * 64, k_row0 + w.n0, w.head_k, map_batch);
                tma_load_4d(sV + cb * kBN * 128, &maps->v, kv_full, cb * 64, k_row0 + w.n0, w.head_k, map_batch);
            }
        }
        __syncthreads();  // the barriers are initialized
    } else {
        copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads, false, kValid>(kv_layout, sK, k, p.k_row_stride,
                                                                          seqlen_k_of() - w.n0, tid);
        copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads, false, kValid>(kv_layout, sV, v, p.v_row_stride,
                                                                          seqlen_k_of() - w.n0, tid);
        cp_async_commit();
    }

    constexpr bool kStatsShifted = Cfg::kStatsRows != kBM;
    static_assert(!kStatsShifted || (kTma && kVarlen && Cfg::kStatsRows == kBM + 4), "4 more values per slot");
    constexpr Flag<!kStatsShifted> kStatPairs{};  // the slots' statistics start 16-byte aligned: columns read in pairs
    // Step t's query tile (DkdvWork::step_head / step_m0) into ring slot `slot` (kTma: by thread 0).
    auto load_step = [&](int t, int slot) {
        const int m0 = step_m0(t);
        const QueryRows rows = kVarlen ? query_rows(p, 0, w.step_head(p.group, t), w.q_start + m0)
                                       : query_rows(p, w.batch, w.step_head(p.group, t), m0);
        const u32 s_lse2 = base + Cfg::kSmemLse2 + slot * Cfg::kStatsRows * 4;
        const u32 s_delta = base + Cfg::kSmemDelta + slot * Cfg::kStatsRows * 4;
        if constexpr (kTma) {
            const u32 bar = slot_full(slot);
            const int head = w.step_head(p.group, t);
            mbar_arrive_expect_tx(bar, 2 * Cfg::kQTileBytes + 2 * Cfg::kStatsRows * 4);
#pragma unroll
            for (int cb = 0; cb < kColBlocks; ++cb) {
                tma_load_4d(sQ + slot * Cfg::kQTileBytes + cb * kBM * 128, &maps->q, bar, cb * 64, q_row0 + m0, head,
                            map_batch);
                tma_load_4d(sDO + slot * Cfg::kQTileBytes + cb * kBM * 128, &maps->dout, bar, cb * 64, q_row0 + m0,
                            head, map_batch);
            }
            const long long first = kStatsShifted ? rows.row & ~3ll : rows.row;  // bulk copies start 16-byte aligned
            bulk_load(s_lse2, p.lse2 + first, Cfg::kStatsRows * 4, bar);
            bulk_load(s_delta, p.delta + first, Cfg::kStatsRows * 4, bar);
            return;
        }
        copy_rows_async<kBM, Cfg::kChunksPerRow, kThreads, false, kValid>(
            q_layout, sQ + slot * Cfg::kQTileBytes, rows.q, p.q_row_stride, seqlen_q_of() - m0, tid);
        copy_rows_async<kBM, Cfg::kChunksPerRow, kThreads, false, kValid>(
            q_layout, sDO + slot * Cfg::kQTileBytes, rows.dout, p.do_row_stride, seqlen_q_of() - m0, tid);
        load_row_stats_async<kBM, kThreads, !kVarlen>(s_lse2, s_delta, p.lse2 + rows.row, p.delta + rows.row, tid);
    };

    // kOrderedDq: the turn counter of step t's dQ tile; the block's turn is its key tile's index.
    const int dq_turn = w.n0 / kBN;
    auto dq_sem = [&](int t) {
        return p.dq_sem + (static_cast<long long>(w.batch) * p.heads + w.step_head(p.group, t)) * (p.rows_padded / kBM)
               + step_m0(t) / kBM;
    };
    // kBulkDq: step t's dQ partial tile (both warpgroups' halves, in fragment order; kDqDouble:
    // two tiles, by the step's parity) added into the accumulator's tile by one bulk reduce-add,
    // issued by one thread (kDqThread; kOrderedDq: on its turn).
    auto add_dq_tile = [&](int t) {
        if constexpr (kOrderedDq) {
            const int* sem = dq_sem(t);
            while (ld_acquire(sem) != dq_turn) {
            }
            fence_proxy_async_global();
        }
        const long long row = kVarlen  // sequence w.batch's tiles start 64 * w.batch rows past its first row
            ? static_cast<long long>(w.step_head(p.group, t)) * p.rows_padded + w.q_start + 64 * w.batch + step_m0(t)
            : (static_cast<long long>(w.batch) * p.heads + w.step_head(p.group, t)) * p.rows_padded + step_m0(t);
        if constexpr (kDqInSlot) {  // chunk j of 64 columns: in Q's (j even) or dO's tile, half j / 2
            const int slot = t % Cfg::kStages;
#pragma unroll
            for (int j = 0; j < kD / 64; ++j)
                if (j * 64 < kDStored)  // chunks wholly in the padding are zeros
                    bulk_reduce_add_f32(p.dq_accum + row * kD + j * 64 * kBM,
                                        (j % 2 ? sDO : sQ) + slot * Cfg::kQTileBytes + (j / 2) * 64 * kBM * 4,
                                        64 * kBM * 4);
        } else {
            bulk_reduce_add_f32(p.dq_accum + row * kD, base + Cfg::kSmemDq + (kDqDouble ? t % 2 : 0) * kBM * kD * 4,
                                kBM * kD * 4);
        }
        bulk_commit_group();
    };
    // kOrderedDq: once step t's add has landed (one_later: the next step's may still be in
    // flight), the next key tile's turn. The wait returns when the reduction is complete in
    // memory, before the counter is raised, and the next key tile issues its own only after it
    // reads the counter; the order of the adds needs no release fence, which measured slower
    // (docs/tuning.md).
    auto pass_dq_turn = [&](int t, bool one_later) {
        if (one_later) bulk_wait_group<1>();
        else bulk_wait_group<0>();
        fence_proxy_async_global();
        red_relaxed_add(dq_sem(t), 1);
    };
    // The thread that adds the dQ tiles (kOrderedDq: waits for the turns and passes them): with
    // kDqDouble one of warpgroup 1 (warpgroup 0's thread 0 issues the TMA loads).
    constexpr int kDqThread = kDqDouble ? 128 : 0;

    float acc_dk[kGT][4], acc_dv[kGT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < w.steps && (!kTma || tid == 0)) load_step(s, s);
        if constexpr (!kTma) cp_async_commit();
    }
    if constexpr (kTma) mbar_wait(kv_full, 0);  // K and V (also when there are no steps)
    const u32 k_rows = sK + (kSplitD ? 0 : wg * 64 * 128), v_rows = sV + (kSplitD ? 0 : wg * 64 * 128);
    for (int t = 0; t < w.steps; ++t) {
        if constexpr (kTma) {
            mbar_wait(slot_full(t % Cfg::kStages), (t / Cfg::kStages) & 1);
        } else {
            cp_async_wait<Cfg::kStages - 2>();
            fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
        }
        __syncthreads();  // every warpgroup is done with step t-1 (its ring slot and dS^T)
        // kDqInSlot: the next load goes where step t-1's dQ tile is, once its add has read it.
        auto load_next = [&]() {
            if (t + Cfg::kStages - 1 < w.steps && (!kTma || tid == 0))
                load_step(t + Cfg::kStages - 1, (t + Cfg::kStages - 1) % Cfg::kStages);
            if constexpr (!kTma) cp_async_commit();
        };
        if constexpr (!kDqInSlot) load_next();
        if (Cfg::kBulkDq && !kDqDouble && tid == 0 && t > 0) add_dq_tile(t - 1);

        const int slot = t % Cfg::kStages;
        const int head = w.step_head(p.group, t), m0 = step_m0(t);
        const u32 sQs = sQ + slot * Cfg::kQTileBytes, sDOs = sDO + slot * Cfg::kQTileBytes;
        // kStatsShifted: the step's first row of lse2 / delta sits (sequence's first row) % 4 past the
        // 16-byte boundary below it, since rows_padded and m0 are multiples of 4 (varlen.py).
        const int stats_shift = kStatsShifted ? w.q_start & 3 : 0;
        const float* s_lse2 = s_lse2_all + slot * Cfg::kStatsRows + stats_shift;
        const float* s_delta = s_delta_all + slot * Cfg::kStatsRows + stats_shift;

        const int key0 = w.n0 + key_row0;
        // kVarlen: the rows past the sequence's queries (the next sequence's statistics) are masked
        // too, so that they add nothing to the next sequence's dQ.
        const bool masked = tile_needs_mask<kBN, Cfg::kCausal>(m0, w.n0, seqlen_k_of(), w.causal_offset)
                            || (kVarlen && m0 + kBM > seqlen_q_of())
                            || (kLocal && ((p.window_right >= 0 && w.n0 + kBN - 1 > m0 + w.causal_offset + p.window_right)
                                           || (p.window_left >= 0 && w.n0 < m0 + kBM - 1 + w.causal_offset - p.window_left)));
        auto allowed = [&](int row, int col) {
            const int key = key0 + row;
            if constexpr (kLocal) {  // the key's place from the query's own position, within the window
                const int rel = key - (m0 + col + w.causal_offset);
                return key < seqlen_k_of() && rel <= win_hi && rel >= win_lo && (!kVarlen || m0 + col < seqlen_q_of());
            }
            return key < seqlen_k_of() && (!Cfg::kCausal || key <= m0 + col + w.causal_offset)
                   && (!kVarlen || m0 + col < seqlen_q_of());
        };
        // kBlockSparse: a tile the block mask found full skips the mask_mod's elements.
        bool mask_elements = true;
        if constexpr (Cfg::kBlockSparse) mask_elements = !(visits[w.m_tiles - 1 - t % w.m_tiles] & 1);
        // S^T (from K, Q) or dP^T (from V, dO) over the whole head dim, asynchronously.
        auto issue_scores = [&](float (&acc)[kQT][4], u32 a_rows, u32 b_tile) {
            const u64 a_desc = smem_desc(a_rows, 16, 1024), b_desc = smem_desc(b_tile, 16, 1024);
#pragma unroll
            for (int cb = 0; cb < kColBlocks; ++cb)
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    Cfg::wgmma_scores(acc, desc_advance(a_desc, cb * kBN * 128 + ks * 32),
                                      desc_advance(b_desc, cb * kBM * 128 + ks * 32), cb + ks);
            wgmma_commit();
        };
        // Packed 16-bit fragments <-> a [key][query] tile in shared memory (swizzled, one column
        // block of kBM = 64 queries); the threads of both warpgroups hold the same coordinates.
        auto tile_word = [&](int tile, int nt, int half) {
            return reinterpret_cast<u32*>(smem + tile + swizzled_offset(key_row0 + lane / 4 + 8 * half, nt, kBN)
                                          + (lane % 4) * 4);
        };
        // Stored by stmatrix, two n=8 tiles at a time: lane l addresses row l % 8 of matrix l / 8,
        // the (tile nt + l / 16, half l / 8 % 2) one.
        auto store_tile = [&](int tile, const u32 (&f)[kQT][2]) {
            static_assert(kQT % 2 == 0, "pairs of n=8 tiles");
            const int row = key_row0 + lane % 8 + 8 * (lane / 8 % 2);
#pragma unroll
            for (int nt = 0; nt < kQT; nt += 2)
                stmatrix_x4(base + tile + swizzled_offset(row, nt + lane / 16, kBN), f[nt][0], f[nt][1], f[nt + 1][0],
                            f[nt + 1][1]);
        };

        u32 fp_tiles[kQT][2], fds_tiles[kQT][2];
        if constexpr (!kSplitD) {
            // S^T and dP^T in two commit groups, so the probabilities overlap the second product.
            float st[kQT][4], dpt[kQT][4];
            wgmma_fence();
            issue_scores(st, k_rows, sQs);
            issue_scores(dpt, v_rows, sDOs);
            wgmma_wait<1>();
            fence_operands(st);
            float dmod[kGrad ? kQT : 1][4];  // d score_mod / d score (kGrad)
            if constexpr (kMods)
                mod_scores_t<Cfg, kGrad>(st, dmod, mods, p.scale, w.batch, head, lane, key0, m0, mask_elements);
            recompute_probs<false>(st, s_lse2, kMods ? kLog2e : p.scale_log2, lane, masked, allowed, kStatPairs);
            pack_fragments<kBF16>(fp_tiles, st);
            wgmma_wait<0>();
            fence_operands(dpt);
            recompute_dscores<kBF16, false>(dpt, fp_tiles, s_delta, lane, masked || kMods, kStatPairs);
            if constexpr (kGrad) chain_score_mod(dpt, dmod);
            pack_fragments<kBF16>(fds_tiles, dpt);
            if constexpr (!Cfg::kDqKernel) store_tile(Cfg::kSmemDS, fds_tiles);  // for dQ
        } else {
            float sc[kQT][4];
            wgmma_fence();
            issue_scores(sc, wg == 0 ? k_rows : v_rows, wg == 0 ? sQs : sDOs);
            wgmma_wait<0>();
            fence_operands(sc);
            static_assert(!kGrad, "the split-head-dim backward takes score_mods whose derivative is 1 only");
            if (wg == 0) {
                float none[1][4];
                if constexpr (kMods)
                    mod_scores_t<Cfg, false>(sc, none, mods, p.scale, w.batch, head, lane, key0, m0, mask_elements);
                recompute_probs<false>(sc, s_lse2, kMods ? kLog2e : p.scale_log2, lane, masked, allowed, kStatPairs);
                pack_fragments<kBF16>(fp_tiles, sc);
                store_tile(Cfg::kSmemP, fp_tiles);
            }
            fence_proxy_async();
            __syncthreads();  // P^T is in shared memory
            if (wg == 1) {
#pragma unroll
                for (int nt = 0; nt < kQT; ++nt) {
                    fp_tiles[nt][0] = *tile_word(Cfg::kSmemP, nt, 0);
                    fp_tiles[nt][1] = *tile_word(Cfg::kSmemP, nt, 1);
                }
                recompute_dscores<kBF16, false>(sc, fp_tiles, s_delta, lane, true, kStatPairs);
                pack_fragments<kBF16>(fds_tiles, sc);
                store_tile(Cfg::kSmemDS, fds_tiles);
            }
            fence_proxy_async();
            if (kDqInSlot && tid == 0) bulk_wait_group_read<0>();  // step t-1's dQ tile was read
            __syncthreads();  // dS^T is in shared memory
            if constexpr (kDqInSlot) load_next();
        }

        // dV += P^T dO and dK += dS^T Q: 16 queries per k step, dO / Q read transposed.
        fence_operands(acc_dv);
        fence_operands(acc_dk);
        wgmma_fence();
        if constexpr (!kSplitD) {
            const auto& fp = as_operand(fp_tiles);
            const auto& fds = as_operand(fds_tiles);
            const u64 do_desc = smem_desc(sDOs, kBM * 128, 1024), q_desc = smem_desc(sQs, kBM * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < kBM / 16; ++kk)
                Cfg::wgmma_grad(acc_dv, fp[kk], desc_advance(do_desc, kk * 2048), 1);
#pragma unroll
            for (int kk = 0; kk < kBM / 16; ++kk)
                Cfg::wgmma_grad(acc_dk, fds[kk], desc_advance(q_desc, kk * 2048), 1);
        } else {
            // P^T and dS^T (keys x queries, K-major) from shared memory; this warpgroup's half of
            // the head dim starts grad_col0 columns into dO and Q.
            const u32 col = (grad_col0 / 64) * kBM * 128 + (grad_col0 % 64) * 2;
            const u64 p_desc = smem_desc(base + Cfg::kSmemP, 16, 1024), ds_desc = smem_desc(sDS, 16, 1024);
            const u64 do_desc = smem_desc(sDOs + col, kBM * 128, 1024), q_desc = smem_desc(sQs + col, kBM * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < kBM / 16; ++kk)
                Cfg::wgmma_grad_ss(acc_dv, desc_advance(p_desc, kk * 32), desc_advance(do_desc, kk * 2048), 1);
#pragma unroll
            for (int kk = 0; kk < kBM / 16; ++kk)
                Cfg::wgmma_grad_ss(acc_dk, desc_advance(ds_desc, kk * 32), desc_advance(q_desc, kk * 2048), 1);
        }
        wgmma_commit();

        if constexpr (!Cfg::kDqKernel) {
            if constexpr (!kSplitD) {
                if (Cfg::kBulkDq && !kDqDouble && tid == 0) bulk_wait_group_read<0>();  // the last tile's dQ was read
                if (kDqDouble && tid == kDqThread && t >= 1) {
                    // Step t-2's add frees this step's tile; step t-1's goes in on this block's
                    // turn, under dV and dK.
                    bulk_wait_group_read<0>();
                    add_dq_tile(t - 1);
                }
                fence_proxy_async();
                __syncthreads();  // both warpgroups' halves of dS^T are in shared memory
            }
            // dQ[:, kQCols*wg ...] = dS K: A = dS (queries x keys) read transposed from dS^T, B = K
            // (keys x head dim) read transposed; 16 keys per k step.
            // Columns in chunks of at most 64, to bound the accumulator's registers.
            constexpr int kQCols = kD / 2;
            constexpr int kChunks = kQCols > 64 ? 2 : 1;
            constexpr int kChunkCols = kQCols / kChunks;
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                const int col0 = wg * kQCols + c * kChunkCols;
                float dq[kChunkCols / 8][4];
                wgmma_fence();  // the previous chunk's registers were read by ordinary instructions
                const u64 ds_desc = smem_desc(sDS, kBN * 128, 1024);
                const u64 k_desc = smem_desc(sK + (col0 / 64) * kBN * 128 + (col0 % 64) * 2, kBN * 128, 1024);
#pragma unroll
                for (int kk = 0; kk < kBN / 16; ++kk)
                    Cfg::wgmma_dq(dq, desc_advance(ds_desc, kk * 2048), desc_advance(k_desc, kk * 2048), kk);
                wgmma_commit();
                wgmma_wait<0>();
                fence_operands(dq);
                fence_operands(acc_dv);
                fence_operands(acc_dk);
                // To shared memory, added in the next step.
                static_assert(Cfg::kBulkDq && (kChunks == 1 || kDqInSlot) && kBM == 64, "whole partial tiles");
                static_assert(!kDqInSlot || (kChunkCols == 64 && kD == 256), "four chunks over the slot's halves");
                const int tile = kDqInSlot  // this warpgroup's own half of Q's (c = 0) or dO's (c = 1) tile
                    ? (c ? Cfg::kSmemDO : Cfg::kSmemQ) + slot * Cfg::kQTileBytes + wg * 64 * kBM * 4
                    : Cfg::kSmemDq + (kDqDouble ? t % 2 : 0) * kBM * kD * 4 + col0 * kBM * 4;
                float2* frags = reinterpret_cast<float2*>(smem + tile) + (warp % 4) * kChunkCols * 8 + lane;
#pragma unroll
                for (int nt = 0; nt < kChunkCols / 8; ++nt) {
                    frags[nt * 64] = make_float2(dq[nt][0], dq[nt][1]);
                    frags[nt * 64 + 32] = make_float2(dq[nt][2], dq[nt][3]);
                }
            }
            if constexpr (!kDqDouble) fence_proxy_async();  // the tile is read by the bulk add (async proxy)
        } else {
            wgmma_wait<0>();
            fence_operands(acc_dv);
            fence_operands(acc_dk);
        }
        // kOrderedDq: step t-2's add, issued a step and a half ago, has landed by now.
        if (kOrderedDq && tid == kDqThread && t >= 2) pass_dq_turn(t - 2, true);
    }
    if constexpr (!kTma) cp_async_wait<0>();
    if constexpr (Cfg::kBulkDq) {
        fence_proxy_async();
        __syncthreads();  // the last step's dQ tile is in shared memory
        if (tid == kDqThread) {
            if (kOrderedDq && w.steps >= 2) pass_dq_turn(w.steps - 2, false);
            if (w.steps > 0) add_dq_tile(w.steps - 1);
            // Read before the block's shared memory goes (kOrderedDq: landed, before the next turn).
            if constexpr (kOrderedDq) bulk_wait_group<0>();
            else bulk_wait_group_read<0>();
            if (kOrderedDq && w.steps > 0) pass_dq_turn(w.steps - 1, false);
        }
    }

    const int key = w.n0 + key_row0;
    unsigned short* dk = static_cast<unsigned short*>(p.dk) + w.batch * p.dk_batch_stride
                         + w.head_k * p.dk_head_stride + key * p.dk_row_stride + grad_col0;
    unsigned short* dv = static_cast<unsigned short*>(p.dv) + w.batch * p.dv_batch_stride
                         + w.head_k * p.dv_head_stride + key * p.dv_row_stride + grad_col0;
    if constexpr (kVarlen) {
        dk += w.k_start * p.dk_row_stride;
        dv += w.k_start * p.dv_row_stride;
    }
    // Only the problem's columns; a warpgroup of kSplitD whose half lies wholly in the padding
    // stores nothing.
    const int cols_valid = kDStored == kD ? kGradCols : kDStored - grad_col0;
    store_fragments<kBF16>(acc_dk, dk, p.dk_row_stride, 0, seqlen_k_of() - key, lane, p.scale, cols_valid);
    store_fragments<kBF16>(acc_dv, dv, p.dv_row_stride, 0, seqlen_k_of() - key, lane, 1.f, cols_valid);
}

}  // namespace cuflash
