// Exact float32 forward on CUDA cores: the same tiled online-softmax algorithm as the tensor-core
// kernel, with every product and sum in float32 (no TF32), for inputs that must keep full
// float32 accuracy.
//
// One thread block per (query tile of kBlockM rows, batch*head); kThreadsPerRow consecutive lanes
// share a query row, so the row statistics reduce with warp shuffles.
//
// The generated kernel provides Cfg with kHeadDim, kBlockM, kBlockN, kWarps, kCausal and Params.
#pragma once
#include "cuflash/block.cuh"

namespace cuflash {

template <class Cfg>
__device__ __forceinline__ void fwd_simt(const typename Cfg::Params& p) {
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kThreadsPerRow = kThreads / kBM;
    constexpr int kScoreCols = kBN / kThreadsPerRow;
    constexpr int kOutCols = (kD + kThreadsPerRow - 1) / kThreadsPerRow;
    constexpr int kQPitch = kD + 1;   // odd pitches: column walks hit distinct banks
    constexpr int kPPitch = kBN + 1;
    static_assert(kThreadsPerRow <= 32 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                  "a query row's lanes must be a power-of-two group inside one warp");

    extern __shared__ __align__(16) float smem_f32[];
    float* sQ = smem_f32;
    float* sK = sQ + kBM * kQPitch;
    float* sV = sK + kBN * kQPitch;
    float* sP = sV + kBN * kD;

    const int tid = threadIdx.x;
    const int row_local = tid / kThreadsPerRow;
    const int sub = tid % kThreadsPerRow;
    const BlockWork<float, kBM, kBN, Cfg::kCausal> work(p);
    const int m0 = work.m0, n_tiles = work.n_tiles, causal_offset = work.causal_offset;
    const float *q = work.q, *k = work.k, *v = work.v;
    const int row = m0 + row_local;

    for (int idx = tid; idx < kBM * kD; idx += kThreads) {
        const int r = idx / kD, c = idx % kD;
        sQ[r * kQPitch + c] = m0 + r < p.seqlen_q ? q[r * p.q_row_stride + c] : 0.f;
    }

    float acc_o[kOutCols];
#pragma unroll
    for (int c = 0; c < kOutCols; ++c) acc_o[c] = 0.f;
    float row_max = neg_inf();
    float row_sum = 0.f;

    for (int i = 0; i < n_tiles; ++i) {
        const int n0 = (n_tiles - 1 - i) * kBN;
        __syncthreads();  // the previous tile's K, V and P are no longer read
        for (int idx = tid; idx < kBN * kD; idx += kThreads) {
            const int r = idx / kD, c = idx % kD;
            const bool valid = n0 + r < p.seqlen_k;
            sK[r * kQPitch + c] = valid ? k[(n0 + r) * p.k_row_stride + c] : 0.f;
            sV[r * kD + c] = valid ? v[(n0 + r) * p.v_row_stride + c] : 0.f;
        }
        __syncthreads();

        float score[kScoreCols];
        float tile_max = neg_inf();
#pragma unroll
        for (int j = 0; j < kScoreCols; ++j) {
            const int col_local = sub + j * kThreadsPerRow;
            float dot = 0.f;
#pragma unroll 8
            for (int d = 0; d < kD; ++d) dot = fmaf(sQ[row_local * kQPitch + d], sK[col_local * kQPitch + d], dot);
            const int col = n0 + col_local;
            bool allowed = col < p.seqlen_k;
            if constexpr (Cfg::kCausal) allowed = allowed && col <= row + causal_offset;
            score[j] = allowed ? dot * p.scale_log2 : neg_inf();
            tile_max = fmaxf(tile_max, score[j]);
        }
        tile_max = group_max<kThreadsPerRow>(tile_max);
        const float new_max = fmaxf(row_max, tile_max);
        const float base = new_max == neg_inf() ? 0.f : new_max;
        const float alpha = exp2f(row_max - base);
        row_max = new_max;
        float tile_sum = 0.f;
#pragma unroll
        for (int j = 0; j < kScoreCols; ++j) {
            const float prob = exp2f(score[j] - base);
            sP[row_local * kPPitch + sub + j * kThreadsPerRow] = prob;
            tile_sum += prob;
        }
        row_sum = row_sum * alpha + group_sum<kThreadsPerRow>(tile_sum);
        __syncthreads();

#pragma unroll
        for (int c = 0; c < kOutCols; ++c) {
            const int d = sub + c * kThreadsPerRow;
            if (kD % kThreadsPerRow == 0 || d < kD) {
                float acc = acc_o[c] * alpha;
#pragma unroll 8
                for (int n = 0; n < kBN; ++n) acc = fmaf(sP[row_local * kPPitch + n], sV[n * kD + d], acc);
                acc_o[c] = acc;
            }
        }
    }

    if (row < p.seqlen_q) {
        float* o = static_cast<float*>(p.o) + work.batch * p.o_batch_stride + work.head * p.o_head_stride
                   + row * p.o_row_stride;
        // kSinks: the sum also holds exp(sink), both taken to the larger of the row max and the
        // sink (as online_softmax.cuh row_total), so a row with no key gives O = 0, LSE = the sink.
        float top = row_max, kept = 1.f, total = row_sum;
        if constexpr (Cfg::kSinks) {
            const float sink_log2 = p.sinks[work.head] * kLog2e;
            top = fmaxf(row_max, sink_log2);
            kept = top == neg_inf() ? 0.f : exp2f(row_max - top);
            total = row_sum * kept + (top == neg_inf() ? 0.f : exp2f(sink_log2 - top));
        }
        const float inv = total == 0.f ? 0.f : kept / total;
#pragma unroll
        for (int c = 0; c < kOutCols; ++c) {
            const int d = sub + c * kThreadsPerRow;
            if (kD % kThreadsPerRow == 0 || d < kD) o[d] = acc_o[c] * inv;
        }
        if (sub == 0)
            p.lse[static_cast<long long>(work.bh) * p.seqlen_q + row] =
                total == 0.f ? neg_inf() : top * kLn2 + logf(total);
    }
}

}  // namespace cuflash
