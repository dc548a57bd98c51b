// The score stage of kernels with a score_mod or mask_mod (generated from Python, cuflash.mods):
// Cfg provides kScoreMod, kMaskMod, the Mods struct of the captured arrays and the functions
// score_mod(score, b, h, q_idx, kv_idx, mods) and mask_mod(b, h, q_idx, kv_idx, mods).
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// Raw scores of C fragments float[kN][4] -> scale * score, through score_mod, -inf where mask_mod
// refuses the pair. at(nt, e, q_idx, kv_idx) gives element (nt, e)'s query and key positions.
template <class Cfg, int kN, class At>
__device__ __forceinline__ void mod_fragments(float (&s)[kN][4], const typename Cfg::Mods& mods, float scale,
                                              int batch, int head, At at) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int q_idx, kv_idx;
            at(nt, e, q_idx, kv_idx);
            float x = s[nt][e] * scale;
            if constexpr (Cfg::kScoreMod) x = Cfg::score_mod(x, batch, head, q_idx, kv_idx, mods);
            if constexpr (Cfg::kMaskMod)
                if (!Cfg::mask_mod(batch, head, q_idx, kv_idx, mods)) x = neg_inf();
            s[nt][e] = x;
        }
}

// The forward's scores, rows = queries: fragment (mt, nt) holds rows row0 + 16 mt + lane / 4 (+8)
// and columns n0 + 8 nt + 2 (lane % 4) (+1), as mask_scores (online_softmax.cuh) reads them.
template <class Cfg, int kMT, int kNT>
__device__ __forceinline__ void apply_mods(float (&s)[kMT][kNT][4], const typename Cfg::Mods& mods, float scale,
                                           int batch, int head, int row0, int n0, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
        mod_fragments<Cfg>(s[mt], mods, scale, batch, head, [&](int nt, int e, int& q_idx, int& kv_idx) {
            q_idx = row0 + mt * 16 + lane / 4 + (e >> 1) * 8;
            kv_idx = n0 + nt * 8 + 2 * (lane % 4) + (e & 1);
        });
}

}  // namespace cuflash
