// The score stage of kernels with a score_mod or mask_mod (generated from Python, cuflash.mods):
// Cfg provides kScoreMod, kMaskMod, the Mods struct of the captured arrays and the functions
// score_mod(score, b, h, q_idx, kv_idx, mods) and mask_mod(b, h, q_idx, kv_idx, mods).
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// A block mask's visit lists at the kernel's tiles (cuflash.sparsity): per (batch, head, query
// tile) a count and that many entries, key tile << 1 | full, ascending; strides in elements (0
// for a broadcast batch or head).
struct BlockSparse {
    const int* counts;
    const int* entries;
    long long count_batch, count_head, entry_batch, entry_head;
    int max_entries, unused;

    __device__ __forceinline__ int count(int batch, int head, int q_tile) const {
        return counts[batch * count_batch + head * count_head + q_tile];
    }
    __device__ __forceinline__ const int* row(int batch, int head, int q_tile) const {
        return entries + batch * entry_batch + head * entry_head + static_cast<long long>(q_tile) * max_entries;
    }
};

// The forward's scores, rows = queries: fragment (mt, nt) holds rows row0 + 16 mt + lane / 4 (+8)
// and columns n0 + 8 nt + 2 (lane % 4) (+1), as mask_scores (online_softmax.cuh) reads them.
// The mods run in parts (Cfg::score_row / score_col / score_pair, the same for the mask): what
// depends on the row alone once per row, on the column alone once per column.
// mask_elements: false on a tile the block mask found full (every pair allowed).
template <class Cfg, int kMT, int kNT>
__device__ __forceinline__ void apply_mods(float (&s)[kMT][kNT][4], const typename Cfg::Mods& mods, float scale,
                                           int batch, int head, int row0, int n0, int lane,
                                           bool mask_elements = true) {
    const int col0 = n0 + 2 * (lane % 4);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        const int q0 = row0 + mt * 16 + lane / 4;
        if constexpr (Cfg::kScoreMod) {
            const typename Cfg::ScoreRow rows[2] = {Cfg::score_row(batch, head, q0, mods),
                                                    Cfg::score_row(batch, head, q0 + 8, mods)};
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const int kv0 = col0 + nt * 8;
                const typename Cfg::ScoreCol cols[2] = {Cfg::score_col(batch, head, kv0, mods),
                                                        Cfg::score_col(batch, head, kv0 + 1, mods)};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] = Cfg::score_pair(s[mt][nt][e] * scale, batch, head, q0 + (e >> 1) * 8, kv0 + (e & 1),
                                                   rows[e >> 1], cols[e & 1], mods);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale;
        }
        if constexpr (Cfg::kMaskMod) {
            if (mask_elements) {
                const typename Cfg::MaskRow rows[2] = {Cfg::mask_row(batch, head, q0, mods),
                                                       Cfg::mask_row(batch, head, q0 + 8, mods)};
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    const int kv0 = col0 + nt * 8;
                    const typename Cfg::MaskCol cols[2] = {Cfg::mask_col(batch, head, kv0, mods),
                                                           Cfg::mask_col(batch, head, kv0 + 1, mods)};
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!Cfg::mask_pair(batch, head, q0 + (e >> 1) * 8, kv0 + (e & 1), rows[e >> 1], cols[e & 1],
                                            mods))
                            s[mt][nt][e] = neg_inf();
                }
            }
        }
    }
}

// The backward's recomputed scores, in place on one warp's C fragments float[kN][4]: raw scores ->
// score_mod(scale * score), -inf where mask_mod refuses the pair, so that the probabilities
// follow from the LSE with a scale of log2(e). kGrad: dmod gets d score_mod / d score at each
// element (Cfg::kScoreModGrad). at(row, col, q_idx, kv_idx) maps a fragment element (row
// lane / 4 (+8), column 8 nt + 2 (lane % 4) (+1)) to its query and key positions.
template <class Cfg, bool kGrad, int kN, int kG, class At>
__device__ __forceinline__ void mod_scores_grad(float (&s)[kN][4], float (&dmod)[kG][4],
                                                const typename Cfg::Mods& mods, float scale, int batch, int head,
                                                int lane, At at) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int q_idx, kv_idx;
            at(lane / 4 + (e >> 1) * 8, nt * 8 + 2 * (lane % 4) + (e & 1), q_idx, kv_idx);
            float x = s[nt][e] * scale;
            if constexpr (kGrad) dmod[nt][e] = Cfg::dscore_mod(x, batch, head, q_idx, kv_idx, mods);
            if constexpr (Cfg::kScoreMod) x = Cfg::score_mod(x, batch, head, q_idx, kv_idx, mods);
            if constexpr (Cfg::kMaskMod) x = Cfg::mask_mod(batch, head, q_idx, kv_idx, mods) ? x : neg_inf();
            s[nt][e] = x;
        }
}

// The Hopper backward's S^T fragments float[kN][4], in place as mod_scores_grad does: rows are keys
// key0 + lane / 4 (+8), columns queries m0 + 8 nt + 2 (lane % 4) (+1). The mods run in parts
// (Cfg::score_row / score_col / score_pair, the same for the mask): the key's part once per
// row, the query's once per column. mask_elements: false on a tile the block mask found full.
template <class Cfg, bool kGrad, int kN, int kG>
__device__ __forceinline__ void mod_scores_t(float (&s)[kN][4], float (&dmod)[kG][4], const typename Cfg::Mods& mods,
                                             float scale, int batch, int head, int lane, int key0, int m0,
                                             bool mask_elements = true) {
    const int k0 = key0 + lane / 4, q_col0 = m0 + 2 * (lane % 4);
    if constexpr (Cfg::kScoreMod) {
        const typename Cfg::ScoreCol keys[2] = {Cfg::score_col(batch, head, k0, mods),
                                                Cfg::score_col(batch, head, k0 + 8, mods)};
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
            const int q0 = q_col0 + nt * 8;
            const typename Cfg::ScoreRow queries[2] = {Cfg::score_row(batch, head, q0, mods),
                                                       Cfg::score_row(batch, head, q0 + 1, mods)};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int q_idx = q0 + (e & 1), kv_idx = k0 + (e >> 1) * 8;
                const float x = s[nt][e] * scale;
                if constexpr (kGrad) dmod[nt][e] = Cfg::dscore_mod(x, batch, head, q_idx, kv_idx, mods);
                s[nt][e] = Cfg::score_pair(x, batch, head, q_idx, kv_idx, queries[e & 1], keys[e >> 1], mods);
            }
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < kN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
    }
    if constexpr (Cfg::kMaskMod) {
        if (mask_elements) {
            const typename Cfg::MaskCol keys[2] = {Cfg::mask_col(batch, head, k0, mods),
                                                   Cfg::mask_col(batch, head, k0 + 8, mods)};
#pragma unroll
            for (int nt = 0; nt < kN; ++nt) {
                const int q0 = q_col0 + nt * 8;
                const typename Cfg::MaskRow queries[2] = {Cfg::mask_row(batch, head, q0, mods),
                                                          Cfg::mask_row(batch, head, q0 + 1, mods)};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!Cfg::mask_pair(batch, head, q0 + (e & 1), k0 + (e >> 1) * 8, queries[e & 1], keys[e >> 1],
                                        mods))
                        s[nt][e] = neg_inf();
            }
        }
    }
}

// dS (of the modded scores) times d score_mod / d score; a dS of 0 (P = 0: masked) stays 0.
template <int kN>
__device__ __forceinline__ void chain_score_mod(float (&ds)[kN][4], const float (&dmod)[kN][4]) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = ds[nt][e] == 0.f ? 0.f : ds[nt][e] * dmod[nt][e];
}

}  // namespace cuflash
