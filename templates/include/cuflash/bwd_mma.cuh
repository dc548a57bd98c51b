// FlashAttention-2 backward on tensor cores (mma.sync m16n8k16), sm_80 and newer.
//
// With P = softmax(scale * Q K^T) recomputed tile by tile from the saved LSE (lse2 below),
// dP = dO V^T, dS = P * (dP - delta) where delta = rowsum(dO * O):
//   dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K.
//
// bwd_dkdv_mma: one block per (key tile of kBlockN rows, kv head, batch). K and V stay in shared
// memory; Q, dO and the per-row lse2 / delta of each query tile stream through a kStages-deep
// cp.async ring. The block walks every query tile that can see its keys, for every query head of
// its kv head (grouped-query attention sums there, in a fixed order). Each step computes P and dS
// in square-ish warp tiles, passes them through shared memory in 16 bits, and accumulates dK and
// dV in registers, each warp owning some key rows and (kDSplit > 1) a share of the head dim.
//   dQ (unless kDeterministic): the warps compute the block's share of dQ = dS K and add it into a
// float32 accumulator with atomics; bwd_convert_dq scales and converts it afterwards.
//
// bwd_dq_mma (kDeterministic): one block per (query tile, head, batch) walks the key tiles in a
// fixed order and accumulates dQ in registers (the forward's shape, no atomics), so two runs give
// the same bits.
//
// The generated kernel provides Cfg (K/V-outer kernel) and CfgDq (dQ kernel) with every constant.
#pragma once
#include "cuflash/mods.cuh"
#include "cuflash/block.cuh"
#include "cuflash/bwd_common.cuh"
#include "cuflash/warp_mma.cuh"

namespace cuflash {

// lse2 / delta of one query tile: kRows floats each, one 16-byte cp.async per 4 rows, or with
// kAligned false (packed sequences start at any row) one 4-byte cp.async per row.
template <int kRows, int kThreads, bool kAligned = true>
__device__ __forceinline__ void load_row_stats_async(u32 s_lse2, u32 s_delta, const float* lse2,
                                                     const float* delta, int tid) {
    if constexpr (kAligned) {
        constexpr int kChunks = kRows / 4;
        for (int i = tid; i < 2 * kChunks; i += kThreads) {
            if (i < kChunks) cp_async_16(s_lse2 + i * 16, lse2 + i * 4, true);
            else cp_async_16(s_delta + (i - kChunks) * 16, delta + (i - kChunks) * 4, true);
        }
    } else {
        for (int i = tid; i < 2 * kRows; i += kThreads) {
            if (i < kRows) cp_async_4(s_lse2 + i * 4, lse2 + i);
            else cp_async_4(s_delta + (i - kRows) * 4, delta + (i - kRows));
        }
    }
}

// P = exp2(S * scale_log2 - lse2) in place on one warp's C fragments, 0 where masked.
// kRowStats: the row statistics follow the fragment rows (dQ kernel) instead of its columns
// (dK/dV kernel, whose rows are keys). allowed(row, col) is consulted only when `masked`, in a
// branch that every lane of the block takes alike: unmasked tiles (all but the causal diagonal
// and the sequence tails) do not execute the per-element tests at all.
// kPairs (column statistics 8-byte aligned): each n=8 tile's two columns read as one float2.
template <bool kRowStats, bool kPairs>
__device__ __forceinline__ float fragment_stat(const float* stats, int nt, int e, int lane) {
    if constexpr (kPairs && !kRowStats) {
        const float2 pair = *reinterpret_cast<const float2*>(stats + nt * 8 + 2 * (lane % 4));
        return e & 1 ? pair.y : pair.x;
    } else {
        return stats[kRowStats ? lane / 4 + (e >> 1) * 8 : nt * 8 + 2 * (lane % 4) + (e & 1)];
    }
}

template <bool kRowStats, int kNT, class Allowed, bool kPairs = false>
__device__ __forceinline__ void recompute_probs(float (&s)[kNT][4], const float* s_lse2, float scale_log2,
                                                int lane, bool masked, Allowed allowed, Flag<kPairs> = {}) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[nt][e] = exp2_approx(fmaf(s[nt][e], scale_log2, -fragment_stat<kRowStats, kPairs>(s_lse2, nt, e, lane)));
    }
    if (masked) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!allowed(lane / 4 + (e >> 1) * 8, nt * 8 + 2 * (lane % 4) + (e & 1))) s[nt][e] = 0.f;
        }
    }
}

// dS = P * (dP - delta) in place on dP's fragments, P taken from its packed 16-bit form (the
// value the P^T dO / P V products used). With zero_where_masked, where P is 0 (masked, or a row
// that attends nothing) dS is 0 even if dP is not finite, so a NaN in V reaches no gradient it does
// not belong to. Without it (a tile with no masked pair, no mods) P is 0 only by underflow, where
// the exact product is not finite either, and dS is the plain product.
template <bool kBF16, bool kRowStats, int kNT, bool kPairs = false>
__device__ __forceinline__ void recompute_dscores(float (&dp)[kNT][4], const u32 (&probs)[kNT][2],
                                                  const float* s_delta, int lane, bool zero_where_masked = true,
                                                  Flag<kPairs> = {}) {
    auto dscores = [&](auto keep_zeros) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            float prob[4];
            unpack2<kBF16>(probs[nt][0], prob[0], prob[1]);
            unpack2<kBF16>(probs[nt][1], prob[2], prob[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float ds = prob[e] * (dp[nt][e] - fragment_stat<kRowStats, kPairs>(s_delta, nt, e, lane));
                dp[nt][e] = decltype(keep_zeros)::value && prob[e] == 0.f ? 0.f : ds;
            }
        }
    };
    if (zero_where_masked) dscores(Flag<true>());
    else dscores(Flag<false>());
}

// The K/V-outer loop of one warp. Each step has three phases with their own warp layouts:
//   1. S = Q K^T and dP = dO V^T: warps in a grid (kWarpsN of them along the keys), each with a
//      kTM x kTN tile and the full head dim contracted; P and dS = P * (dP - delta) go to shared
//      memory in 16 bits.
//   2. dV += P^T dO and dK += dS^T Q: warps own kKeysPerWarp key rows and kNC head-dim columns
//      from c0 (kDSplit warps share the key rows, each with its own column range); the
//      accumulators stay in registers for the whole loop.
//   3. (atomic dQ) dQ += dS K: warps own 16 query rows and every kDqSplit-th pair of n=8 columns,
//      added into the float32 accumulator.
template <class Cfg, int kNC>
__device__ __forceinline__ void dkdv_warp(const typename Cfg::Params& p, const DkdvWork& w,
                                          unsigned char* smem, int tid, int c0, const typename Cfg::Mods& mods) {
    constexpr bool kBF16 = Cfg::kBF16;
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kP = Cfg::kSmemRowBytes;   // pitch of the Q, dO, K, V tiles
    constexpr int kSP = Cfg::kScorePitch;    // pitch of the P and dS tiles ([query][key])
    constexpr int kWN = Cfg::kWarpsN;
    constexpr int kTM = kBM / (Cfg::kWarps / kWN), kTN = kBN / kWN;
    constexpr int kSMT = kTM / 16, kSNT = kTN / 8;
    constexpr int kVK = Cfg::kKeysPerWarp;
    constexpr int kVMT = kVK / 16, kCT = kNC / 8;
    constexpr bool kMods = Cfg::kScoreMod || Cfg::kMaskMod;  // scores modded: P from them with log2(e)
    constexpr bool kGrad = Cfg::kScoreModGrad;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int s_row0 = (warp / kWN) * kTM;           // phase 1: query rows ...
    const int s_col0 = (warp % kWN) * kTN;           // ... and keys of this warp's tile
    const int v_key0 = (warp / Cfg::kDSplit) * kVK;  // phase 2: this warp's keys
    const u32 base = smem_addr(smem);
    const u32 sK = base + Cfg::kSmemK, sV = base + Cfg::kSmemV;
    const u32 sQ = base + Cfg::kSmemQ, sDO = base + Cfg::kSmemDO;
    const u32 sP = base + Cfg::kSmemP, sDS = base + Cfg::kSmemDS;
    const float* s_lse2_all = reinterpret_cast<const float*>(smem + Cfg::kSmemLse2);
    const float* s_delta_all = reinterpret_cast<const float*>(smem + Cfg::kSmemDelta);

    // Step t's query tile (DkdvWork::step_head / step_m0) into ring slot `slot`.
    auto load_step = [&](int t, int slot) {
        const int m0 = w.step_m0<kBM>(t);
        const QueryRows rows = query_rows(p, w.batch, w.step_head(p.group, t), m0);
        load_tile_async<Cfg, kBM>(sQ + slot * Cfg::kQTileBytes, rows.q, p.q_row_stride, p.seqlen_q - m0, tid);
        load_tile_async<Cfg, kBM>(sDO + slot * Cfg::kQTileBytes, rows.dout, p.do_row_stride, p.seqlen_q - m0, tid);
        load_row_stats_async<kBM, Cfg::kWarps * 32>(base + Cfg::kSmemLse2 + slot * kBM * 4,
                                                    base + Cfg::kSmemDelta + slot * kBM * 4,
                                                    p.lse2 + rows.row, p.delta + rows.row, tid);
    };
    // A warp's packed fragments -> its part of a [query][key] tile.
    auto store_scores = [&](u32 tile, const u32 (&f)[kSMT][kSNT][2]) {
        unsigned char* at = smem + (tile - base) + (s_row0 + lane / 4) * kSP + (s_col0 + 2 * (lane % 4)) * 2;
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kSNT; ++nt) {
                unsigned char* c = at + mt * 16 * kSP + nt * 16;
                *reinterpret_cast<u32*>(c) = f[mt][nt][0];
                *reinterpret_cast<u32*>(c + 8 * kSP) = f[mt][nt][1];
            }
    };

    float acc_dk[kVMT][kCT][4], acc_dv[kVMT][kCT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < w.steps) load_step(s, s);
        cp_async_commit();
    }
    for (int t = 0; t < w.steps; ++t) {
        // Step t's tiles (and, at t = 0, K and V) have landed for every thread, and every warp is
        // done with step t-1: its ring slot and the P / dS tiles may be overwritten.
        cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        if (t + Cfg::kStages - 1 < w.steps) load_step(t + Cfg::kStages - 1, (t + Cfg::kStages - 1) % Cfg::kStages);
        cp_async_commit();

        const int slot = t % Cfg::kStages;
        const int head = w.step_head(p.group, t), m0 = w.step_m0<kBM>(t);
        const u32 sQs = sQ + slot * Cfg::kQTileBytes, sDOs = sDO + slot * Cfg::kQTileBytes;
        const float* s_lse2 = s_lse2_all + slot * kBM + s_row0;
        const float* s_delta = s_delta_all + slot * kBM + s_row0;

        // -- phase 1: P and dS of this warp's tile --
        u32 fp[kSMT][kSNT][2];
        float dmod[kGrad ? kSMT : 1][kGrad ? kSNT : 1][4];  // d score_mod / d score (kGrad)
        {
            float sc[kSMT][kSNT][4];
            zero_fragments(sc);
            warp_gemm_nt<kBF16, kSMT, kSNT, kD, kP, kP>(sc, sQs + s_row0 * kP, sK + s_col0 * kP, lane);
            const int key0 = w.n0 + s_col0, query0 = m0 + s_row0;
            const bool masked = tile_needs_mask<kBN, Cfg::kCausal>(m0, w.n0, p.seqlen_k, w.causal_offset);
            auto allowed = [&](int row, int col) {
                const int key = key0 + col;
                return key < p.seqlen_k && (!Cfg::kCausal || key <= query0 + row + w.causal_offset);
            };
#pragma unroll
            for (int mt = 0; mt < kSMT; ++mt) {
                if constexpr (kMods)
                    mod_scores_grad<Cfg, kGrad>(sc[mt], dmod[kGrad ? mt : 0], mods, p.scale, w.batch, head, lane,
                                                [&](int row, int col, int& q_idx, int& kv_idx) {
                                                    q_idx = query0 + mt * 16 + row;
                                                    kv_idx = key0 + col;
                                                });
                auto allowed_mt = [&](int row, int col) { return allowed(mt * 16 + row, col); };
                recompute_probs<true>(sc[mt], s_lse2 + mt * 16, kMods ? kLog2e : p.scale_log2, lane, masked,
                                      allowed_mt);
                pack_fragments<kBF16>(fp[mt], sc[mt]);
            }
        }
        store_scores(sP, fp);
        {
            float dp[kSMT][kSNT][4];
            zero_fragments(dp);
            warp_gemm_nt<kBF16, kSMT, kSNT, kD, kP, kP>(dp, sDOs + s_row0 * kP, sV + s_col0 * kP, lane);
            u32 fds[kSMT][kSNT][2];
#pragma unroll
            for (int mt = 0; mt < kSMT; ++mt) {
                recompute_dscores<kBF16, true>(dp[mt], fp[mt], s_delta + mt * 16, lane);
                if constexpr (kGrad) chain_score_mod(dp[mt], dmod[mt]);
                pack_fragments<kBF16>(fds[mt], dp[mt]);
            }
            store_scores(sDS, fds);
        }
        __syncthreads();

        // -- phase 2: dV += P^T dO and dK += dS^T Q over the tile's query rows --
        warp_gemm_tt<kBF16, kVMT, kCT, kBM, kSP, kP>(acc_dv, sP + v_key0 * 2, sDOs + c0 * 2, lane);
        warp_gemm_tt<kBF16, kVMT, kCT, kBM, kSP, kP>(acc_dk, sDS + v_key0 * 2, sQs + c0 * 2, lane);

        // -- phase 3: dQ += dS K by atomics --
        if constexpr (!Cfg::kDeterministic) {
            constexpr int kQM = kBM / 16;
            constexpr int kDqSplit = Cfg::kWarps / kQM;
            const int mt = warp % kQM;
            u32 fa[kBN / 16][4];  // dS rows (queries) x keys
            const u32 ds_lane = sDS + (mt * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kSP + (lane / 16) * 16;
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk) ldmatrix_x4(fa[kk], ds_lane + kk * 32);
            float* accum = p.dq_accum + ((static_cast<long long>(w.batch) * p.heads + head) * p.rows_padded
                                         + m0 + mt * 16 + lane / 4) * kD + 2 * (lane % 4);
            // K read transposed: (keys 0-7 | 8-15) x (columns 0-7 | 8-15) of a 16-column pair.
            const u32 k_lane = sK + (lane % 8 + ((lane / 8) % 2) * 8) * kP + (lane / 16) * 16;
            const u32 k_lane_x2 = sK + (lane % 8 + ((lane / 8) % 2) * 8) * kP;
#pragma unroll 1
            for (int np = warp / kQM; np < kD / 16; np += kDqSplit) {
                float c[2][4] = {};
#pragma unroll
                for (int kk = 0; kk < kBN / 16; ++kk) {
                    u32 fb[4];
                    ldmatrix_x4_trans(fb, k_lane + kk * 16 * kP + np * 32);
                    mma_16816<kBF16>(c[0], fa[kk], fb[0], fb[1]);
                    mma_16816<kBF16>(c[1], fa[kk], fb[2], fb[3]);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    atomic_add2(accum + np * 16 + h * 8, c[h][0], c[h][1]);
                    atomic_add2(accum + 8 * kD + np * 16 + h * 8, c[h][2], c[h][3]);
                }
            }
            if constexpr (kD % 16) {  // the last 8 columns (head dims that are 8 mod 16)
                if (warp / kQM == (kD / 16) % kDqSplit) {
                    float c[4] = {};
#pragma unroll
                    for (int kk = 0; kk < kBN / 16; ++kk) {
                        u32 fb[2];
                        ldmatrix_x2_trans(fb, k_lane_x2 + kk * 16 * kP + (kD / 16) * 32);
                        mma_16816<kBF16>(c, fa[kk], fb[0], fb[1]);
                    }
                    atomic_add2(accum + kD - 8, c[0], c[1]);
                    atomic_add2(accum + 8 * kD + kD - 8, c[2], c[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // dK = scale * dS^T Q and dV, in the input dtype.
#pragma unroll
    for (int mt = 0; mt < kVMT; ++mt) {
        const int key = w.n0 + v_key0 + mt * 16;
        unsigned short* dk = static_cast<unsigned short*>(p.dk) + w.batch * p.dk_batch_stride
                             + w.head_k * p.dk_head_stride + key * p.dk_row_stride + c0;
        unsigned short* dv = static_cast<unsigned short*>(p.dv) + w.batch * p.dv_batch_stride
                             + w.head_k * p.dv_head_stride + key * p.dv_row_stride + c0;
        store_fragments<kBF16>(acc_dk[mt], dk, p.dk_row_stride, 0, p.seqlen_k - key, lane, p.scale);
        store_fragments<kBF16>(acc_dv[mt], dv, p.dv_row_stride, 0, p.seqlen_k - key, lane, 1.f);
    }
}

template <class Cfg>
__device__ __forceinline__ void bwd_dkdv_mma(const typename Cfg::Params& p, const typename Cfg::Mods& mods) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    const int tid = threadIdx.x;
    const DkdvWork w = dkdv_work<kBM, kBN, Cfg::kCausal>(p);
    const u32 base = smem_addr(smem);
    const unsigned short* k = static_cast<const unsigned short*>(p.k) + w.batch * p.k_batch_stride
                              + w.head_k * p.k_head_stride + w.n0 * p.k_row_stride;
    const unsigned short* v = static_cast<const unsigned short*>(p.v) + w.batch * p.v_batch_stride
                              + w.head_k * p.v_head_stride + w.n0 * p.v_row_stride;
    load_tile_async<Cfg, kBN>(base + Cfg::kSmemK, k, p.k_row_stride, p.seqlen_k - w.n0, tid);
    load_tile_async<Cfg, kBN>(base + Cfg::kSmemV, v, p.v_row_stride, p.seqlen_k - w.n0, tid);
    cp_async_commit();

    // Column ranges of dK / dV: equal ones where they are whole n=8 tiles, else (two warps, a
    // head dim that is 8 mod 16) kSplitCol columns and the rest.
    const int role = (tid / 32) % Cfg::kDSplit;
    if constexpr (Cfg::kHeadDim % (8 * Cfg::kDSplit) == 0) {
        constexpr int kNC = Cfg::kHeadDim / Cfg::kDSplit;
        dkdv_warp<Cfg, kNC>(p, w, smem, tid, role * kNC, mods);
    } else {
        static_assert(Cfg::kDSplit == 2, "uneven column ranges come in pairs");
        if (role == 0) dkdv_warp<Cfg, Cfg::kSplitCol>(p, w, smem, tid, 0, mods);
        else dkdv_warp<Cfg, Cfg::kHeadDim - Cfg::kSplitCol>(p, w, smem, tid, Cfg::kSplitCol, mods);
    }
}

template <class Cfg>
__device__ __forceinline__ void bwd_dq_mma(const typename Cfg::Params& p, const typename Cfg::Mods& mods) {
    constexpr bool kMods = Cfg::kScoreMod || Cfg::kMaskMod;  // as in dkdv_warp
    constexpr bool kGrad = Cfg::kScoreModGrad;
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr bool kBF16 = Cfg::kBF16;
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kP = Cfg::kSmemRowBytes;
    constexpr int kST = kBN / 8;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int head = blockIdx.y, batch = blockIdx.z, head_k = head / p.group;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest causal tiles first
    const int causal_offset = p.seqlen_k - p.seqlen_q;
    int n_end = p.seqlen_k;
    if constexpr (Cfg::kCausal) n_end = min(n_end, m0 + kBM + causal_offset);
    const int n_tiles = n_end > 0 ? (n_end + kBN - 1) / kBN : 0;

    const u32 base = smem_addr(smem);
    const u32 sQ = base + Cfg::kSmemQ, sDO = base + Cfg::kSmemDO, sK = base + Cfg::kSmemK, sV = base + Cfg::kSmemV;
    const QueryRows rows = query_rows(p, batch, head, m0);
    const unsigned short* k = static_cast<const unsigned short*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride;
    const unsigned short* v = static_cast<const unsigned short*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride;
    load_tile_async<Cfg, kBM>(sQ, rows.q, p.q_row_stride, p.seqlen_q - m0, tid);
    load_tile_async<Cfg, kBM>(sDO, rows.dout, p.do_row_stride, p.seqlen_q - m0, tid);
    load_row_stats_async<kBM, Cfg::kWarps * 32>(base + Cfg::kSmemLse2, base + Cfg::kSmemDelta,
                                                p.lse2 + rows.row, p.delta + rows.row, tid);
    cp_async_commit();
    auto load_kv = [&](int tile, int slot) {
        const int n0 = tile * kBN;
        load_tile_async<Cfg, kBN>(sK + slot * Cfg::kKVTileBytes, k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, tid);
        load_tile_async<Cfg, kBN>(sV + slot * Cfg::kKVTileBytes, v + n0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - n0, tid);
    };
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < n_tiles) load_kv(s, s);
        cp_async_commit();
    }

    const int row0 = warp * 16;
    const float* s_lse2 = reinterpret_cast<const float*>(smem + Cfg::kSmemLse2) + row0;
    const float* s_delta = reinterpret_cast<const float*>(smem + Cfg::kSmemDelta) + row0;
    float acc_dq[kD / 8][4];
    zero_fragments(acc_dq);
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        if (i + Cfg::kStages - 1 < n_tiles) load_kv(i + Cfg::kStages - 1, (i + Cfg::kStages - 1) % Cfg::kStages);
        cp_async_commit();
        const int slot = i % Cfg::kStages, n0 = i * kBN;
        const u32 sKs = sK + slot * Cfg::kKVTileBytes, sVs = sV + slot * Cfg::kKVTileBytes;

        float s[kST][4];
        zero_fragments(s);
        warp_gemm_nt<kBF16, kD, kST, kP, kP>(s, sQ + row0 * kP, sKs, lane);
        const bool masked = tile_needs_mask<kBN, Cfg::kCausal>(m0, n0, p.seqlen_k, causal_offset);
        auto allowed = [&](int row, int col) {
            const int key = n0 + col;
            return key < p.seqlen_k && (!Cfg::kCausal || key <= m0 + row0 + row + causal_offset);
        };
        float dmod[kGrad ? kST : 1][4];
        if constexpr (kMods)
            mod_scores_grad<Cfg, kGrad>(s, dmod, mods, p.scale, batch, head, lane,
                                        [&](int row, int col, int& q_idx, int& kv_idx) {
                                            q_idx = m0 + row0 + row;
                                            kv_idx = n0 + col;
                                        });
        recompute_probs<true>(s, s_lse2, kMods ? kLog2e : p.scale_log2, lane, masked, allowed);
        u32 fp[kST][2];
        pack_fragments<kBF16>(fp, s);
        float dp[kST][4];
        zero_fragments(dp);
        warp_gemm_nt<kBF16, kD, kST, kP, kP>(dp, sDO + row0 * kP, sVs, lane);
        recompute_dscores<kBF16, true>(dp, fp, s_delta, lane);
        if constexpr (kGrad) chain_score_mod(dp, dmod);
        u32 fds[kST][2];
        pack_fragments<kBF16>(fds, dp);
        warp_gemm_rn<kBF16, kST / 2, kD / 8, kP>(acc_dq, as_operand(fds), sKs, lane);
    }
    cp_async_wait<0>();
    unsigned short* dq = static_cast<unsigned short*>(p.dq) + batch * p.dq_batch_stride
                         + head * p.dq_head_stride + (m0 + row0) * p.dq_row_stride;
    store_fragments<kBF16>(acc_dq, dq, p.dq_row_stride, 0, p.seqlen_q - m0 - row0, lane, p.scale);
}

}  // namespace cuflash
