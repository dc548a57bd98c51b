// FlashAttention-2 backward on tensor cores (mma.sync m16n8k16), sm_80 and newer.
//
// With P = softmax(scale * Q K^T) recomputed tile by tile from the saved LSE (lse2 below),
// dP = dO V^T, dS = P * (dP - delta) where delta = rowsum(dO * O):
//   dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K.
//
// bwd_dkdv_mma: one block per (key tile of kBlockN rows, kv head, batch). K and V stay in shared
// memory; Q, dO and the per-row lse2 / delta of each query tile stream through a kStages-deep
// cp.async ring. The block walks every query tile that can see its keys, for every query head of
// its kv head (grouped-query attention sums there, in a fixed order). Warps own 16 key rows each
// and compute the transposed products S^T = K Q^T and dP^T = V dO^T directly, so P^T and dS^T
// land in registers in the layout of an A operand: dV += P^T dO and dK += dS^T Q never leave the
// warp. With kDSplit = 2 (head dims over 128) two warps share 16 key rows and split the head dim:
// each computes half of the contraction of S^T and dP^T, the halves are summed through shared
// memory, and each keeps its half of the dK / dV columns.
//   dQ (unless kDeterministic): dS^T goes to shared memory, and the warps compute the block's
// share of dQ = dS K and add it into a float32 accumulator with atomics; bwd_convert_dq scales
// and converts it afterwards.
//
// bwd_dq_mma (kDeterministic): one block per (query tile, head, batch) walks the key tiles in a
// fixed order and accumulates dQ in registers (the forward's shape, no atomics), so two runs give
// the same bits.
//
// The generated kernel provides Cfg (K/V-outer kernel) and CfgDq (dQ kernel) with every constant.
#pragma once
#include "cuflash/block.cuh"
#include "cuflash/bwd_common.cuh"
#include "cuflash/warp_mma.cuh"

namespace cuflash {

// lse2 / delta of one query tile: kRows floats each, one 16-byte cp.async per 4 rows.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_row_stats_async(u32 s_lse2, u32 s_delta, const float* lse2,
                                                     const float* delta, int tid) {
    constexpr int kChunks = kRows / 4;
    for (int i = tid; i < 2 * kChunks; i += kThreads) {
        if (i < kChunks) cp_async_16(s_lse2 + i * 16, lse2 + i * 4, true);
        else cp_async_16(s_delta + (i - kChunks) * 16, delta + (i - kChunks) * 4, true);
    }
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// P = exp2(S * scale_log2 - lse2) in place on one warp's C fragments, 0 where masked.
// kRowStats: the row statistics follow the fragment rows (dQ kernel) instead of its columns
// (dK/dV kernel, whose rows are keys). allowed(row, col) is consulted only when `masked`.
template <bool kRowStats, int kNT, class Allowed>
__device__ __forceinline__ void recompute_probs(float (&s)[kNT][4], const float* s_lse2, float scale_log2,
                                                int lane, bool masked, Allowed allowed) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = lane / 4 + (e >> 1) * 8;
            const int col = nt * 8 + 2 * (lane % 4) + (e & 1);
            const float prob = exp2_approx(fmaf(s[nt][e], scale_log2, -s_lse2[kRowStats ? row : col]));
            s[nt][e] = masked && !allowed(row, col) ? 0.f : prob;
        }
    }
}

// dS = P * (dP - delta) in place on dP's fragments, P taken from its 16-bit A operand (the value
// the P^T dO / P V products used). Where P is 0 (masked, or a row that attends nothing) dS is 0
// even if dP is not finite, so a NaN in V or dO reaches no gradient it does not belong to.
template <bool kBF16, bool kRowStats, int kNT>
__device__ __forceinline__ void recompute_dscores(float (&dp)[kNT][4], const u32 (&probs)[kNT / 2][4],
                                                  const float* s_delta, int lane) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        float prob[4];
        unpack2<kBF16>(probs[nt / 2][(nt % 2) * 2], prob[0], prob[1]);
        unpack2<kBF16>(probs[nt / 2][(nt % 2) * 2 + 1], prob[2], prob[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = lane / 4 + (e >> 1) * 8;
            const int col = nt * 8 + 2 * (lane % 4) + (e & 1);
            const float ds = prob[e] * (dp[nt][e] - s_delta[kRowStats ? row : col]);
            dp[nt][e] = prob[e] == 0.f ? 0.f : ds;
        }
    }
}

// Head dims split over a pair of warps: sum the two halves of a contraction. Each warp publishes
// its partial fragments and adds its partner's (a + b == b + a: both warps hold identical sums).
// The next write to the buffer comes after the block barrier of the next step.
template <class Cfg, int kNT>
__device__ __forceinline__ void pair_sum(float (&c)[kNT][4], unsigned char* smem, int warp, int lane) {
    float4* mine = reinterpret_cast<float4*>(smem + Cfg::kSmemExchange) + warp * kNT * 32 + lane;
    const float4* theirs = reinterpret_cast<const float4*>(smem + Cfg::kSmemExchange) + (warp ^ 1) * kNT * 32 + lane;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mine[nt * 32] = make_float4(c[nt][0], c[nt][1], c[nt][2], c[nt][3]);
    named_barrier_sync(1 + warp / 2, 64);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        const float4 o = theirs[nt * 32];
        c[nt][0] += o.x; c[nt][1] += o.y; c[nt][2] += o.z; c[nt][3] += o.w;
    }
    named_barrier_sync(1 + warp / 2, 64);
}

// The K/V-outer loop of one warp, which owns head-dim columns [kC0, kC0 + kNC) of dK and dV.
template <class Cfg, int kC0, int kNC>
__device__ __forceinline__ void dkdv_warp(const typename Cfg::Params& p, const DkdvWork& w,
                                          unsigned char* smem, int tid) {
    constexpr bool kBF16 = Cfg::kBF16;
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kP = Cfg::kSmemRowBytes;
    constexpr int kQT = kBM / 8;   // n=8 tiles of S^T (query columns)
    constexpr int kCT = kNC / 8;   // n=8 tiles of this warp's dK / dV columns
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int key_row0 = (warp / Cfg::kDSplit) * 16;  // this warp's first key row in the tile
    const u32 base = smem_addr(smem);
    const u32 sK = base + Cfg::kSmemK, sV = base + Cfg::kSmemV;
    const u32 sQ = base + Cfg::kSmemQ, sDO = base + Cfg::kSmemDO;
    const float* s_lse2_all = reinterpret_cast<const float*>(smem + Cfg::kSmemLse2);
    const float* s_delta_all = reinterpret_cast<const float*>(smem + Cfg::kSmemDelta);

    // Query tiles from the last to the first: every block of a head starts on the same tile and
    // moves in step with the others, so they share the tile's Q, dO and dQ lines in L2 (with a
    // causal mask too; the diagonal tiles, which need masking, come last).
    auto step_head = [&](int t) { return w.head_k * p.group + t / w.m_tiles; };
    auto step_m0 = [&](int t) { return w.m_begin + (w.m_tiles - 1 - t % w.m_tiles) * kBM; };
    auto load_step = [&](int t, int slot) {
        const int head = step_head(t), m0 = step_m0(t);
        const unsigned short* q = static_cast<const unsigned short*>(p.q) + w.batch * p.q_batch_stride
                                  + head * p.q_head_stride + m0 * p.q_row_stride;
        const unsigned short* dout = static_cast<const unsigned short*>(p.dout) + w.batch * p.do_batch_stride
                                     + head * p.do_head_stride + m0 * p.do_row_stride;
        load_tile_async<Cfg, kBM>(sQ + slot * Cfg::kQTileBytes, q, p.q_row_stride, p.seqlen_q - m0, tid);
        load_tile_async<Cfg, kBM>(sDO + slot * Cfg::kQTileBytes, dout, p.do_row_stride, p.seqlen_q - m0, tid);
        const long long stats = (static_cast<long long>(w.batch) * p.heads + head) * p.rows_padded + m0;
        load_row_stats_async<kBM, Cfg::kWarps * 32>(base + Cfg::kSmemLse2 + slot * kBM * 4,
                                                    base + Cfg::kSmemDelta + slot * kBM * 4,
                                                    p.lse2 + stats, p.delta + stats, tid);
    };

    float acc_dk[kCT][4], acc_dv[kCT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < w.steps) load_step(s, s);
        cp_async_commit();
    }
    for (int t = 0; t < w.steps; ++t) {
        // Step t's tiles (and, at t = 0, K and V) have landed for every thread, and every warp is
        // done with step t-1, whose slot the next copy overwrites.
        cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        if (t + Cfg::kStages - 1 < w.steps) load_step(t + Cfg::kStages - 1, (t + Cfg::kStages - 1) % Cfg::kStages);
        cp_async_commit();

        const int slot = t % Cfg::kStages;
        const int head = step_head(t), m0 = step_m0(t);
        const u32 sQs = sQ + slot * Cfg::kQTileBytes, sDOs = sDO + slot * Cfg::kQTileBytes;
        const float* s_lse2 = s_lse2_all + slot * kBM;
        const float* s_delta = s_delta_all + slot * kBM;

        // S^T = K Q^T over this warp's head-dim columns, summed over the pair when split.
        float st[kQT][4];
        zero_fragments(st);
        warp_gemm_nt<kBF16, kNC, kQT, kP, kP>(st, sK + key_row0 * kP + kC0 * 2, sQs + kC0 * 2, lane);
        if constexpr (Cfg::kDSplit == 2) pair_sum<Cfg>(st, smem, warp, lane);

        // P^T (masked only on the sequence tail and the causal diagonal), then dV += P^T dO.
        const int key0 = w.n0 + key_row0;
        bool masked = w.n0 + kBN > p.seqlen_k;
        if constexpr (Cfg::kCausal) masked = masked || w.n0 + kBN - 1 > m0 + w.causal_offset;
        auto allowed = [&](int row, int col) {
            const int key = key0 + row;
            return key < p.seqlen_k && (!Cfg::kCausal || key <= m0 + col + w.causal_offset);
        };
        recompute_probs<false>(st, s_lse2, p.scale_log2, lane, masked, allowed);
        u32 fp[kQT / 2][4];
        fragments_to_operand<kBF16>(fp, st);
        warp_gemm_rn<kBF16, kQT / 2, kCT, kP>(acc_dv, fp, sDOs + kC0 * 2, lane);

        // dP^T = V dO^T, dS^T = P^T * (dP^T - delta), then dK += dS^T Q.
        float dpt[kQT][4];
        zero_fragments(dpt);
        warp_gemm_nt<kBF16, kNC, kQT, kP, kP>(dpt, sV + key_row0 * kP + kC0 * 2, sDOs + kC0 * 2, lane);
        if constexpr (Cfg::kDSplit == 2) pair_sum<Cfg>(dpt, smem, warp, lane);
        recompute_dscores<kBF16, false>(dpt, fp, s_delta, lane);
        u32 fa[kQT / 2][4];
        fragments_to_operand<kBF16>(fa, dpt);
        warp_gemm_rn<kBF16, kQT / 2, kCT, kP>(acc_dk, fa, sQs + kC0 * 2, lane);

        if constexpr (!Cfg::kDeterministic) {
            // dS^T -> shared memory (one warp per key row block), then dQ += dS K by atomics.
            constexpr int kDSP = Cfg::kDSPitch;
            const u32 sDS = base + Cfg::kSmemDS;
            if (warp % Cfg::kDSplit == 0) {
                unsigned char* row_lo = smem + Cfg::kSmemDS + (key_row0 + lane / 4) * kDSP + (lane % 4) * 4;
#pragma unroll
                for (int kk = 0; kk < kQT / 2; ++kk) {
                    *reinterpret_cast<u32*>(row_lo + kk * 32) = fa[kk][0];
                    *reinterpret_cast<u32*>(row_lo + 8 * kDSP + kk * 32) = fa[kk][1];
                    *reinterpret_cast<u32*>(row_lo + kk * 32 + 16) = fa[kk][2];
                    *reinterpret_cast<u32*>(row_lo + 8 * kDSP + kk * 32 + 16) = fa[kk][3];
                }
            }
            __syncthreads();
            // Warp -> (16 query rows, every kDqSplit-th pair of n=8 column tiles of dQ).
            constexpr int kQM = kBM / 16;
            constexpr int kDqSplit = Cfg::kWarps / kQM;
            const int mt = warp % kQM;
            u32 fds[kBN / 16][4];  // dS rows (queries) x keys, read transposed from dS^T
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk)
                ldmatrix_x4_trans(fds[kk], sDS + (kk * 16 + (lane / 16) * 8 + lane % 8) * kDSP
                                           + (mt * 16 + ((lane / 8) % 2) * 8) * 2);
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
                    mma_16816<kBF16>(c[0], fds[kk], fb[0], fb[1]);
                    mma_16816<kBF16>(c[1], fds[kk], fb[2], fb[3]);
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
                        mma_16816<kBF16>(c, fds[kk], fb[0], fb[1]);
                    }
                    atomic_add2(accum + kD - 8, c[0], c[1]);
                    atomic_add2(accum + 8 * kD + kD - 8, c[2], c[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // dK = scale * dS^T Q and dV, in the input dtype.
    const int rows_valid = p.seqlen_k - w.n0 - key_row0;
    unsigned short* dk = static_cast<unsigned short*>(p.dk) + w.batch * p.dk_batch_stride
                         + w.head_k * p.dk_head_stride + (w.n0 + key_row0) * p.dk_row_stride + kC0;
    unsigned short* dv = static_cast<unsigned short*>(p.dv) + w.batch * p.dv_batch_stride
                         + w.head_k * p.dv_head_stride + (w.n0 + key_row0) * p.dv_row_stride + kC0;
    store_fragments<kBF16>(acc_dk, dk, p.dk_row_stride, 0, rows_valid, lane, p.scale);
    store_fragments<kBF16>(acc_dv, dv, p.dv_row_stride, 0, rows_valid, lane, 1.f);
}

template <class Cfg>
__device__ __forceinline__ void bwd_dkdv_mma(const typename Cfg::Params& p) {
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

    if constexpr (Cfg::kDSplit == 1) {
        dkdv_warp<Cfg, 0, Cfg::kHeadDim>(p, w, smem, tid);
    } else {
        if ((tid / 32) % 2 == 0) dkdv_warp<Cfg, 0, Cfg::kSplitCol>(p, w, smem, tid);
        else dkdv_warp<Cfg, Cfg::kSplitCol, Cfg::kHeadDim - Cfg::kSplitCol>(p, w, smem, tid);
    }
}

template <class Cfg>
__device__ __forceinline__ void bwd_dq_mma(const typename Cfg::Params& p) {
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
    const unsigned short* q = static_cast<const unsigned short*>(p.q) + batch * p.q_batch_stride
                              + head * p.q_head_stride + m0 * p.q_row_stride;
    const unsigned short* dout = static_cast<const unsigned short*>(p.dout) + batch * p.do_batch_stride
                                 + head * p.do_head_stride + m0 * p.do_row_stride;
    const unsigned short* k = static_cast<const unsigned short*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride;
    const unsigned short* v = static_cast<const unsigned short*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride;
    const long long stats = (static_cast<long long>(batch) * p.heads + head) * p.rows_padded + m0;
    load_tile_async<Cfg, kBM>(sQ, q, p.q_row_stride, p.seqlen_q - m0, tid);
    load_tile_async<Cfg, kBM>(sDO, dout, p.do_row_stride, p.seqlen_q - m0, tid);
    load_row_stats_async<kBM, Cfg::kWarps * 32>(base + Cfg::kSmemLse2, base + Cfg::kSmemDelta,
                                                p.lse2 + stats, p.delta + stats, tid);
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
        bool masked = n0 + kBN > p.seqlen_k;
        if constexpr (Cfg::kCausal) masked = masked || n0 + kBN - 1 > m0 + causal_offset;
        auto allowed = [&](int row, int col) {
            const int key = n0 + col;
            return key < p.seqlen_k && (!Cfg::kCausal || key <= m0 + row0 + row + causal_offset);
        };
        recompute_probs<true>(s, s_lse2, p.scale_log2, lane, masked, allowed);
        u32 fp[kST / 2][4];
        fragments_to_operand<kBF16>(fp, s);
        float dp[kST][4];
        zero_fragments(dp);
        warp_gemm_nt<kBF16, kD, kST, kP, kP>(dp, sDO + row0 * kP, sVs, lane);
        recompute_dscores<kBF16, true>(dp, fp, s_delta, lane);
        u32 fa[kST / 2][4];
        fragments_to_operand<kBF16>(fa, dp);
        warp_gemm_rn<kBF16, kST / 2, kD / 8, kP>(acc_dq, fa, sKs, lane);
    }
    cp_async_wait<0>();
    unsigned short* dq = static_cast<unsigned short*>(p.dq) + batch * p.dq_batch_stride
                         + head * p.dq_head_stride + (m0 + row0) * p.dq_row_stride;
    store_fragments<kBF16>(acc_dq, dq, p.dq_row_stride, 0, p.seqlen_q - m0 - row0, lane, p.scale);
}

}  // namespace cuflash
