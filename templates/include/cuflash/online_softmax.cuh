// The online softmax both tensor-core kernels share, on accumulators in the m16n8 C-fragment
// layout (mma.sync's, and wgmma's for each warp's 16 rows): a warp's scores are
// float[kMT][kNT][4], where tile (mt, nt) holds rows 16*mt + lane/4 (+8) and columns
// 8*nt + 2*(lane%4) (+1). The 4 lanes of a quad share a row.
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// Start of a query tile: no key seen yet (output 0, running max -inf, running sum 0).
template <int kMT, int kOT>
__device__ __forceinline__ void softmax_start(float (&o)[kMT][kOT][4], float (&row_max)[kMT][2],
                                              float (&row_sum)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) { row_max[mt][r] = neg_inf(); row_sum[mt][r] = 0.f; }
    }
}

// Causal and sequence-tail mask of one key tile starting at column n0. row0 is the first query
// row of the warp; a query row r may see key c iff c < seqlen_k and (causal) c <= r + offset.
// Both bounds fold into one last visible column per row, taken relative to the thread's first
// column, so that each score costs one compare with a constant and one select.
template <bool kCausal, int kMT, int kNT>
__device__ __forceinline__ void mask_scores(float (&s)[kMT][kNT][4], int n0, int row0, int lane,
                                            int seqlen_k, int causal_offset) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int last = seqlen_k - 1;
            if constexpr (kCausal) last = min(last, row0 + mt * 16 + lane / 4 + r * 8 + causal_offset);
            last -= n0 + 2 * (lane % 4);  // column n0 + 2 (lane % 4) + 8 nt + e is seen iff 8 nt + e <= last
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (nt * 8 + e > last) s[mt][nt][2 * r + e] = neg_inf();
        }
}

// The window's mask of one key tile (the warp-specialized kernel's kLocal): row r sees key c iff
// c < seqlen_k, r + offset - left <= c (left >= 0) and c <= r + offset + right (right >= 0, and
// kCausal: right 0). Each score costs two compares with constants and one select.
template <bool kCausal, int kMT, int kNT>
__device__ __forceinline__ void mask_scores_window(float (&s)[kMT][kNT][4], int n0, int row0, int lane,
                                                   int seqlen_k, int offset, int left, int right) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + lane / 4 + r * 8 + offset;
            int last = seqlen_k - 1;
            if constexpr (kCausal) last = min(last, row);
            if (right >= 0) last = min(last, row + right);
            const int c0 = n0 + 2 * (lane % 4);
            last -= c0;
            const int first = left >= 0 ? row - left - c0 : -(1 << 30);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (nt * 8 + e > last || nt * 8 + e < first) s[mt][nt][2 * r + e] = neg_inf();
        }
}

// One step of the online softmax on raw scores (scale > 0, so the max commutes with scaling):
// P = exp2(S * scale_log2 - max * scale_log2), one FFMA and one MUFU per score, written over S;
// the running sum is rescaled by alpha = exp2(old max - new max), and alphas[mt][r] is left for
// rescaling the output rows (rescale_output). row_max holds raw scores. kLog2Boost scales P
// and the running sum by 2^kLog2Boost (FP8: P up to 256 keeps e4m3's precision; store_output
// takes it out of the LSE, and the quotient O / sum does not see it). Without kRowSums the
// running sums are left alone: the caller sums P elsewhere (on the tensor cores).
// kLazyMax: the running max (the base of the exponentials) moves only when a tile's max exceeds
// it by more than `slack` (raw-score units): P then runs up to 2^(kLog2Boost + slack *
// scale_log2), and alpha is exactly 1 while the base stays, so that rescale_output<true> can
// skip the output's rescale. Any base gives the same O and LSE; only P's range depends on it.
template <int kLog2Boost = 0, bool kRowSums = true, bool kLazyMax = false, int kMT, int kNT>
__device__ __forceinline__ void softmax_step(float (&s)[kMT][kNT][4], float (&row_max)[kMT][2],
                                             float (&row_sum)[kMT][2], float (&alphas)[kMT][2],
                                             float scale_log2, float slack = 0.f) {
    constexpr int kChains = kNT >= 8 ? 4 : kNT >= 2 ? 2 : 1;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // The max and the sum run in kChains independent chains, merged at the end: a single
            // chain of kNT dependent instructions would leave the warp waiting on each result.
            float chain_max[kChains];
#pragma unroll
            for (int c = 0; c < kChains; ++c) chain_max[c] = neg_inf();
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
                chain_max[nt % kChains] = fmaxf(chain_max[nt % kChains], fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
            float tile_max = chain_max[0];
#pragma unroll
            for (int c = 1; c < kChains; ++c) tile_max = fmaxf(tile_max, chain_max[c]);
            tile_max = quad_max(tile_max);
            const bool moves = kLazyMax ? tile_max > row_max[mt][r] + slack : true;
            const float new_max = kLazyMax ? (moves ? tile_max : row_max[mt][r]) : fmaxf(row_max[mt][r], tile_max);
            // A row with nothing unmasked yet keeps max -inf; using 0 as its base keeps
            // exp2(-inf - base) at 0 rather than NaN.
            const float base = new_max == neg_inf() ? 0.f : new_max * scale_log2;
            alphas[mt][r] = moves ? exp2_approx(row_max[mt][r] * scale_log2 - base) : 1.f;
            row_max[mt][r] = new_max;
            float chain_sum[kChains];
#pragma unroll
            for (int c = 0; c < kChains; ++c) chain_sum[c] = 0.f;
            const float shift = kLog2Boost ? static_cast<float>(kLog2Boost) - base : -base;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    s[mt][nt][e] = exp2_approx(fmaf(s[mt][nt][e], scale_log2, shift));
                    if constexpr (kRowSums) chain_sum[nt % kChains] += s[mt][nt][e];
                }
            }
            float tile_sum = chain_sum[0];
#pragma unroll
            for (int c = 1; c < kChains; ++c) tile_sum += chain_sum[c];
            if constexpr (kRowSums) row_sum[mt][r] = row_sum[mt][r] * alphas[mt][r] + tile_sum;
        }
    }
}

// Output rows times the alphas of softmax_step. kSkipUnmoved: skip it when the max moved in no
// row of the warp (a warp-uniform branch; it splits the basic block, so schedules that
// interleave MMAs with this code turn it off).
template <bool kSkipUnmoved, int kMT, int kOT>
__device__ __forceinline__ void rescale_output(float (&o)[kMT][kOT][4], const float (&alphas)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        if (!kSkipUnmoved || __any_sync(0xffffffffu, alphas[mt][0] != 1.f || alphas[mt][1] != 1.f)) {
#pragma unroll
            for (int nt = 0; nt < kOT; ++nt) {
                o[mt][nt][0] *= alphas[mt][0];
                o[mt][nt][1] *= alphas[mt][0];
                o[mt][nt][2] *= alphas[mt][1];
                o[mt][nt][3] *= alphas[mt][1];
            }
        }
    }
}

// Both at once, for schedules where the output is not in flight on the tensor cores.
template <bool kSkipRescale, int kMT, int kNT, int kOT>
__device__ __forceinline__ void softmax_rescale(float (&s)[kMT][kNT][4], float (&o)[kMT][kOT][4],
                                                float (&row_max)[kMT][2], float (&row_sum)[kMT][2],
                                                float scale_log2) {
    float alphas[kMT][2];
    softmax_step(s, row_max, row_sum, alphas, scale_log2);
    rescale_output<kSkipRescale>(o, alphas);
}

// P of key columns 16*kk .. 16*kk+15 as the A operand (m16n8k16 / wgmma register layout) of
// O += P V: the C-fragments of two adjacent n=8 tiles form one k=16 A-fragment.
template <bool kBF16, int kNT>
__device__ __forceinline__ void probs_operand(u32 (&a)[4], const float (&s)[kNT][4], int kk) {
    a[0] = pack2<kBF16>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack2<kBF16>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack2<kBF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack2<kBF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// P of key columns 32*kk .. 32*kk+31 as the e4m3 A operand (wgmma k=32) of O += P V. Each
// register holds 4 consecutive k-slots of one row; lane t of a quad fills slots 4t..4t+3 with
// its own keys 2t, 2t+1, 8+2t, 9+2t (and 16 more for the upper half), so no data moves between
// lanes: within every 16 keys, slot 4t + 2b + e holds key 8b + 2t + e. V^T's keys are laid out
// in the same order (cuflash.fp8.v_operand), which leaves P V unchanged.
template <int kNT>
__device__ __forceinline__ void fp8_probs_operand(u32 (&a)[4], const float (&s)[kNT][4], int kk) {
    a[0] = pack4_e4m3(s[4 * kk][0], s[4 * kk][1], s[4 * kk + 1][0], s[4 * kk + 1][1]);
    a[1] = pack4_e4m3(s[4 * kk][2], s[4 * kk][3], s[4 * kk + 1][2], s[4 * kk + 1][3]);
    a[2] = pack4_e4m3(s[4 * kk + 2][0], s[4 * kk + 2][1], s[4 * kk + 3][0], s[4 * kk + 3][1]);
    a[3] = pack4_e4m3(s[4 * kk + 2][2], s[4 * kk + 2][3], s[4 * kk + 3][2], s[4 * kk + 3][3]);
}

// The natural-log LSE of a row from its raw running max and its (quad-summed) sum, with
// softmax_step's boost taken out; -inf for a row that saw no key (sum 0). A row that saw a key
// has a sum of at least 1 (its max's own term), where lg2.approx is accurate to 2^-22.
template <int kLog2Boost>
__device__ __forceinline__ float row_lse(float row_max, float sum, float scale_log2) {
    return sum == 0.f ? neg_inf() : (row_max * scale_log2 + log2_approx(sum) - kLog2Boost) * kLn2;
}

// One row's inv (out_scale over its quad-summed sum; 0 for a row that saw no key, so that its
// output is 0) and LSE. kSink: the row's softmax sum also holds 2^sink_log2 (a sink logit times
// log2(e)), which takes a share of the probability and adds no value: the sum and the output are
// taken to the larger of the exponentials' base and the sink, so that a sink far above every
// score gives O near 0 and LSE near the sink. A row that saw no key then has O = 0 and LSE =
// the sink (-inf without one). The quotient is __fdividef's (2 ulp), ample for 16-bit outputs.
template <int kLog2Boost, bool kSink>
__device__ __forceinline__ void row_total(float row_max, float sum, float scale_log2, float out_scale,
                                          float sink_log2, float& inv, float& lse) {
    if constexpr (kSink) {
            const float base = row_max == neg_inf() ? neg_inf() : row_max * scale_log2;
        const float top = fmaxf(base, sink_log2);
        const float kept = top == neg_inf() ? 0.f : exp2_approx(base - top);  // the sum's and O's factor
        const float total = sum * kept + (top == neg_inf() ? 0.f : exp2_approx(sink_log2 - top + kLog2Boost));
        inv = total == 0.f ? 0.f : __fdividef(out_scale * kept, total);
        lse = total == 0.f ? neg_inf() : (top + log2_approx(total) - kLog2Boost) * kLn2;
    } else {
        inv = sum == 0.f ? 0.f : __fdividef(out_scale, sum);
        lse = row_lse<kLog2Boost>(row_max, sum, scale_log2);
    }
}

// row_total for every row of the warp: straight-line code for all rows at once, so that their
// shuffles and special-function ops overlap.
template <int kLog2Boost, bool kSink = false, int kMT>
__device__ __forceinline__ void row_totals(const float (&row_max)[kMT][2], const float (&row_sum)[kMT][2],
                                           float scale_log2, float out_scale, float (&inv)[kMT][2],
                                           float (&lse)[kMT][2], float sink_log2 = 0.f) {
    float sum[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) sum[mt][r] = quad_sum(row_sum[mt][r]);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            row_total<kLog2Boost, kSink>(row_max[mt][r], sum[mt][r], scale_log2, out_scale, sink_log2, inv[mt][r],
                                         lse[mt][r]);
}

// Normalize a warp's output rows (to a 16-bit dtype), hand them to write(row, nt, packed), and
// store the natural-log LSE: row counts from row0, packed holds this lane's two values of n=8
// column tile nt (columns 8 nt + 2 (lane % 4), + 1), for the first kStoredTiles tiles (all of
// them when 0; fewer when the head dim was padded). Every row is written, those at or past
// seqlen_q too (write skips them where they have no place); their LSE is not stored.
// A row whose sum is 0 saw no key: O = 0, LSE = -inf. A NaN sum stays NaN. The rows are
// multiplied by out_scale (FP8: v's descale); kLog2Boost is softmax_step's; kSink, sink_log2:
// row_total's.
template <bool kBF16, int kStoredTiles = 0, int kLog2Boost = 0, bool kSink = false, int kMT, int kOT, class Write>
__device__ __forceinline__ void finish_output(const float (&o)[kMT][kOT][4], const float (&row_max)[kMT][2],
                                              const float (&row_sum)[kMT][2], float* lse_rows, int row0,
                                              int seqlen_q, int lane, float scale_log2, float out_scale,
                                              Write write, float sink_log2 = 0.f) {
    float inv[kMT][2], lse[kMT][2];
    row_totals<kLog2Boost, kSink>(row_max, row_sum, scale_log2, out_scale, inv, lse, sink_log2);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int local_row = mt * 16 + lane / 4 + r * 8;
#pragma unroll
            for (int nt = 0; nt < (kStoredTiles ? kStoredTiles : kOT); ++nt)
                write(local_row, nt, pack2<kBF16>(o[mt][nt][2 * r] * inv[mt][r], o[mt][nt][2 * r + 1] * inv[mt][r]));
            if (row0 + local_row < seqlen_q && lane % 4 == 0) lse_rows[row0 + local_row] = lse[mt][r];
        }
}

// A row block's softmax state split by keys: save_state writes one thread's unnormalized output
// fragments, row maxima and partial row sums (kOT + 1 float4s, `stride` float4s apart, so that
// consecutive threads write consecutive float4s); merge_store (below) merges two such states,
// computed over different keys. Both must share scale_log2 (and the FP8 boost).
template <int kOT>
__device__ __forceinline__ void save_state(float4* dst, int stride, const float (&o)[1][kOT][4],
                                           const float (&row_max)[1][2], const float (&row_sum)[1][2]) {
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt) __stcg(dst + nt * stride, make_float4(o[0][nt][0], o[0][nt][1], o[0][nt][2], o[0][nt][3]));
    __stcg(dst + kOT * stride, make_float4(row_max[0][0], row_max[0][1], row_sum[0][0], row_sum[0][1]));
}

// Column group g (n=8 tiles 4g .. 4g+3) of one row, 16 bytes per lane: on entry words[j] holds
// this lane's two values of tile 4g + j; the quad transposes them (every lane must take part,
// rows past seqlen_q too) and each lane stores one tile's 8 consecutive columns when valid.
__device__ __forceinline__ void store_group_wide(u32* out_row, int g, u32 (&words)[4], int lane, bool valid) {
    quad_transpose(words, lane);
    if (valid) st_global_v4(out_row + (4 * g + lane % 4) * 4, words);
}

// The rows of a tile whose keys were visited in two pieces, from the two states save_state wrote
// (`first` and `second`, `stride` float4s apart as there): merged, normalized and stored as
// store_output_wide stores, with the LSE. The states stream from memory to the output up to
// four column groups (16 float4 of each state) at a time, so that the output's registers need
// not be live (the thread's own state is saved first too): merging into them made ptxas spill at
// head dim 256. The merge ends the launch's last shares, so its loads are few rounds: one at
// head dims up to 128. The loads are volatile, so that the compiler neither hands saved values
// back from registers nor hoists them past the stores.
__device__ __forceinline__ float4 ld_state(const float4* src) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src));
    return v;
}

template <bool kBF16, int kStoredTiles, int kLog2Boost, int kOT, bool kSink = false>
__device__ __forceinline__ void merge_store(const float4* first, const float4* second, int stride, unsigned short* out,
                                            long long out_row_stride, float* lse_rows, int row0, int seqlen_q,
                                            int lane, float scale_log2, float out_scale, float sink_log2 = 0.f) {
    constexpr int kGroups = kStoredTiles / 4;  // whole groups of 4 column tiles; the rest: below
    constexpr int kGroupsPerStep = kGroups % 4 == 0 ? 4 : kGroups % 3 == 0 ? 3 : kGroups % 2 == 0 ? 2 : 1;
    const float4 a = ld_state(first + kOT * stride), b = ld_state(second + kOT * stride);  // maxima, sums
    const float max_a[2] = {a.x, a.y}, max_b[2] = {b.x, b.y}, sum_a[2] = {a.z, a.w}, sum_b[2] = {b.z, b.w};
    float scale_a[2], scale_b[2];  // per row: each piece's weight in the merged, normalized output
    u32* out_row[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float new_max = fmaxf(max_a[r], max_b[r]);
        const float base = new_max == neg_inf() ? 0.f : new_max * scale_log2;  // as in softmax_step
        const float wa = exp2_approx(max_a[r] * scale_log2 - base), wb = exp2_approx(max_b[r] * scale_log2 - base);
        const float sum = quad_sum(sum_a[r] * wa + sum_b[r] * wb);
        float inv, lse;
        row_total<kLog2Boost, kSink>(new_max, sum, scale_log2, out_scale, sink_log2, inv, lse);
        scale_a[r] = wa * inv;
        scale_b[r] = wb * inv;
        const int row = row0 + lane / 4 + r * 8;
        valid[r] = row < seqlen_q;
        out_row[r] = reinterpret_cast<u32*>(out + (valid[r] ? row : row0) * out_row_stride);
        if (valid[r] && lane % 4 == 0) lse_rows[row] = lse;
    }
    // This lane's two merged, normalized values of one column tile in row r (the tile's float4
    // from each state), packed.
    auto merged = [&](const float4& x, const float4& y, int r) {
        return r ? pack2<kBF16>(x.z * scale_a[1] + y.z * scale_b[1], x.w * scale_a[1] + y.w * scale_b[1])
                 : pack2<kBF16>(x.x * scale_a[0] + y.x * scale_b[0], x.y * scale_a[0] + y.y * scale_b[0]);
    };
#pragma unroll
    for (int g0 = 0; g0 < kGroups; g0 += kGroupsPerStep) {
        float4 pa[4 * kGroupsPerStep], pb[4 * kGroupsPerStep];
#pragma unroll
        for (int i = 0; i < 4 * kGroupsPerStep; ++i) {
            pa[i] = ld_state(first + (4 * g0 + i) * stride);
            pb[i] = ld_state(second + (4 * g0 + i) * stride);
        }
#pragma unroll
        for (int g = 0; g < kGroupsPerStep; ++g)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 words[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) words[j] = merged(pa[4 * g + j], pb[4 * g + j], r);
                store_group_wide(out_row[r], g0 + g, words, lane, valid[r]);
            }
    }
#pragma unroll
    for (int nt = 4 * kGroups; nt < kStoredTiles; ++nt) {  // head dims of 8, 16 or 24 mod 32: 4 bytes per lane
        const float4 x = ld_state(first + nt * stride), y = ld_state(second + nt * stride);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (valid[r]) out_row[r][nt * 4 + lane % 4] = merged(x, y, r);
    }
}

// finish_output into global memory: out holds the rows, out_row_stride elements apart.
template <bool kBF16, int kStoredTiles = 0, int kLog2Boost = 0, bool kSink = false, int kMT, int kOT>
__device__ __forceinline__ void store_output(const float (&o)[kMT][kOT][4], const float (&row_max)[kMT][2],
                                             const float (&row_sum)[kMT][2], unsigned short* out,
                                             long long out_row_stride, float* lse_rows, int row0,
                                             int seqlen_q, int lane, float scale_log2, float out_scale = 1.f,
                                             float sink_log2 = 0.f) {
    finish_output<kBF16, kStoredTiles, kLog2Boost, kSink>(
        o, row_max, row_sum, lse_rows, row0, seqlen_q, lane, scale_log2, out_scale, [&](int row, int nt, u32 packed) {
            if (row0 + row < seqlen_q) reinterpret_cast<u32*>(out + (row0 + row) * out_row_stride)[nt * 4 + lane % 4] = packed;
        }, sink_log2);
}

// store_output with 16-byte stores: the 4 lanes of a quad hold one row's columns 2 (lane % 4)
// (+1) of every n=8 tile; per 4 tiles they exchange their words (quad_transpose), so that each
// lane stores one tile's 8 consecutive columns. A quad then writes 64 contiguous bytes of its row
// per store, whole 32-byte sectors, with a quarter of the store instructions. The rows, out and
// out_row_stride must allow 16-byte stores (head dims that are multiples of 8, a 16-byte aligned
// out). The tiles past the last whole group of 4 (head dims of 8, 16 or 24 mod 32) are stored
// 4 bytes per lane.
template <bool kBF16, int kStoredTiles = 0, int kLog2Boost = 0, bool kSink = false, int kOT>
__device__ __forceinline__ void store_output_wide(const float (&o)[1][kOT][4], const float (&row_max)[1][2],
                                                  const float (&row_sum)[1][2], unsigned short* out,
                                                  long long out_row_stride, float* lse_rows, int row0,
                                                  int seqlen_q, int lane, float scale_log2, float out_scale,
                                                  float sink_log2 = 0.f) {
    constexpr int kTiles = kStoredTiles ? kStoredTiles : kOT;
    float inv[1][2], lse[1][2];
    row_totals<kLog2Boost, kSink>(row_max, row_sum, scale_log2, out_scale, inv, lse, sink_log2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + lane / 4 + r * 8;
        const bool valid = row < seqlen_q;
        u32* out_row = reinterpret_cast<u32*>(out + (valid ? row : row0) * out_row_stride);
#pragma unroll
        for (int g = 0; g < kTiles / 4; ++g) {
            u32 words[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                words[j] = pack2<kBF16>(o[0][4 * g + j][2 * r] * inv[0][r], o[0][4 * g + j][2 * r + 1] * inv[0][r]);
            store_group_wide(out_row, g, words, lane, valid);
        }
#pragma unroll
        for (int nt = kTiles / 4 * 4; nt < kTiles; ++nt)
            if (valid) out_row[nt * 4 + lane % 4] = pack2<kBF16>(o[0][nt][2 * r] * inv[0][r], o[0][nt][2 * r + 1] * inv[0][r]);
        if (valid && lane % 4 == 0) lse_rows[row] = lse[0][r];
    }
}

}  // namespace cuflash
