// The score stage of kernels with a score_mod or mask_mod (generated from Python, cuflash.mods):
// Cfg provides kScoreMod, kMaskMod, the Mods struct of the captured arrays and the functions
// score_mod(score, b, h, q_idx, kv_idx, mods) and mask_mod(b, h, q_idx, kv_idx, mods).
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// A block mask's visit lists at the kernel's tiles (cuflash.sparsity): per (batch, head, query
// tile) a count and that many entries, key tile << 1 | full, ascending; strides in elements (0
// for a broadcast batch or head). The forward's `order` (laid out as the counts) lists each
// (batch, head)'s query tiles by falling count: the forward takes its tiles in that order.
struct BlockSparse {
    const int* counts;
    const int* entries;
    const int* order;
    long long count_batch, count_head, entry_batch, entry_head;
    int max_entries, unused;

    __device__ __forceinline__ int count(int batch, int head, int q_tile) const {
        return counts[batch * count_batch + head * count_head + q_tile];
    }
    // The query tile a (batch, head) takes x-th, heaviest first.
    __device__ __forceinline__ int nth_heaviest(int batch, int head, int x) const {
        return order[batch * count_batch + head * count_head + x];
    }
    __device__ __forceinline__ const int* row(int batch, int head, int q_tile) const {
        return entries + batch * entry_batch + head * entry_head + static_cast<long long>(q_tile) * max_entries;
    }
};

// A mod's parts (Cfg::score_row / score_col / score_pair, the same for the mask) seen from a
// fragment: kQueryRows, its rows are queries and its columns keys (the forward's S), else the
// other way round (the backward's S^T). row / col: the part of a fragment row's or column's index.
template <class Cfg, bool kQueryRows>
struct FragmentParts {
    typedef typename Cfg::Mods Mods;
    static __device__ __forceinline__ auto score_row(int b, int h, int i, const Mods& m) {
        if constexpr (kQueryRows) return Cfg::score_row(b, h, i, m);
        else return Cfg::score_col(b, h, i, m);
    }
    static __device__ __forceinline__ auto score_col(int b, int h, int i, const Mods& m) {
        if constexpr (kQueryRows) return Cfg::score_col(b, h, i, m);
        else return Cfg::score_row(b, h, i, m);
    }
    template <class R, class C>
    static __device__ __forceinline__ float score_pair(float x, int b, int h, int r, int c, const R& row, const C& col,
                                                       const Mods& m) {
        if constexpr (kQueryRows) return Cfg::score_pair(x, b, h, r, c, row, col, m);
        else return Cfg::score_pair(x, b, h, c, r, col, row, m);
    }
    static __device__ __forceinline__ auto mask_row(int b, int h, int i, const Mods& m) {
        if constexpr (kQueryRows) return Cfg::mask_row(b, h, i, m);
        else return Cfg::mask_col(b, h, i, m);
    }
    static __device__ __forceinline__ auto mask_col(int b, int h, int i, const Mods& m) {
        if constexpr (kQueryRows) return Cfg::mask_col(b, h, i, m);
        else return Cfg::mask_row(b, h, i, m);
    }
    template <class R, class C>
    static __device__ __forceinline__ bool mask_pair(int b, int h, int r, int c, const R& row, const C& col,
                                                     const Mods& m) {
        if constexpr (kQueryRows) return Cfg::mask_pair(b, h, r, c, row, col, m);
        else return Cfg::mask_pair(b, h, c, r, col, row, m);
    }
};

// The mods in place on C fragments float[kN][4] of 16 rows: rows r0 (+8), columns c0 + 8 nt (+1)
// (r0 and c0 with the lane's offsets). Raw scores -> scale * score, through score_mod (kGrad:
// dmod gets d score_mod / d score, Cfg::dscore_mod), -inf where mask_mod refuses the pair. What
// depends on a row alone runs once per row, on a column alone once per column. mask_elements:
// false on a tile the block mask found full (every pair allowed).
template <class Cfg, bool kQueryRows, bool kGrad, int kN, int kG>
__device__ __forceinline__ void mods_in_parts(float (&s)[kN][4], float (&dmod)[kG][4], const typename Cfg::Mods& mods,
                                              float scale, int batch, int head, int r0, int c0, bool mask_elements) {
    typedef FragmentParts<Cfg, kQueryRows> Parts;
    auto q_of = [](int r, int c) { return kQueryRows ? r : c; };
    auto kv_of = [](int r, int c) { return kQueryRows ? c : r; };
    if constexpr (Cfg::kScoreMod) {
        const auto row0 = Parts::score_row(batch, head, r0, mods), row8 = Parts::score_row(batch, head, r0 + 8, mods);
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
            const int c = c0 + nt * 8;
            const auto col0 = Parts::score_col(batch, head, c, mods), col1 = Parts::score_col(batch, head, c + 1, mods);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = r0 + (e >> 1) * 8, cc = c + (e & 1);
                const float x = s[nt][e] * scale;
                if constexpr (kGrad) dmod[nt][e] = Cfg::dscore_mod(x, batch, head, q_of(r, cc), kv_of(r, cc), mods);
                s[nt][e] = Parts::score_pair(x, batch, head, r, cc, e >> 1 ? row8 : row0, e & 1 ? col1 : col0, mods);
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
            const auto row0 = Parts::mask_row(batch, head, r0, mods), row8 = Parts::mask_row(batch, head, r0 + 8, mods);
#pragma unroll
            for (int nt = 0; nt < kN; ++nt) {
                const int c = c0 + nt * 8;
                const auto col0 = Parts::mask_col(batch, head, c, mods), col1 = Parts::mask_col(batch, head, c + 1, mods);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!Parts::mask_pair(batch, head, r0 + (e >> 1) * 8, c + (e & 1), e >> 1 ? row8 : row0,
                                          e & 1 ? col1 : col0, mods))
                        s[nt][e] = neg_inf();
            }
        }
    }
}

// The forward's scores, rows = queries: fragment (mt, nt) holds rows row0 + 16 mt + lane / 4 (+8)
// and columns n0 + 8 nt + 2 (lane % 4) (+1), as mask_scores (online_softmax.cuh) reads them.
template <class Cfg, int kMT, int kNT>
__device__ __forceinline__ void apply_mods(float (&s)[kMT][kNT][4], const typename Cfg::Mods& mods, float scale,
                                           int batch, int head, int row0, int n0, int lane,
                                           bool mask_elements = true) {
    float none[1][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
        mods_in_parts<Cfg, true, false>(s[mt], none, mods, scale, batch, head, row0 + mt * 16 + lane / 4,
                                        n0 + 2 * (lane % 4), mask_elements);
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
// key0 + lane / 4 (+8), columns queries m0 + 8 nt + 2 (lane % 4) (+1).
template <class Cfg, bool kGrad, int kN, int kG>
__device__ __forceinline__ void mod_scores_t(float (&s)[kN][4], float (&dmod)[kG][4], const typename Cfg::Mods& mods,
                                             float scale, int batch, int head, int lane, int key0, int m0,
                                             bool mask_elements = true) {
    mods_in_parts<Cfg, false, kGrad>(s, dmod, mods, scale, batch, head, key0 + lane / 4, m0 + 2 * (lane % 4),
                                     mask_elements);
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
