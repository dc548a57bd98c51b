// Exact float32 backward on CUDA cores: the same two loops as the tensor-core backward (see
// bwd_mma.cuh), with every product and sum in float32 and dQ always from its own kernel, so the
// result is deterministic.
//
// bwd_dkdv_simt: one block per (key tile of kBlockN rows, kv head, batch); kThreadsPerRow
// consecutive lanes share a key row and hold its K, V, dK and dV columns in registers, while the
// query tiles of every query head of the group pass through shared memory.
// bwd_dq_simt: one block per (query tile of kBlockM rows, head, batch); lanes share a query row
// the same way and the key tiles pass through shared memory.
//
// Cfg provides kHeadDim, kBlockM, kBlockN, kWarps, kCausal and the Params struct.
#pragma once
#include "cuflash/bwd_common.cuh"

namespace cuflash {

// Two dot products of one row each, shared by the kTPR lanes of a group: this lane holds
// a[j] and c[j] of columns sub + kTPR*j, and reads b and d (already offset by sub) at the same
// columns. The sums s = a.b and t = c.d come back complete in every lane of the group.
template <int kCols, int kTPR>
__device__ __forceinline__ void dot_pair(const float (&a)[kCols], const float* b, const float (&c)[kCols],
                                         const float* d, float& s, float& t) {
    s = 0.f;
    t = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        s = fmaf(a[j], b[kTPR * j], s);
        t = fmaf(c[j], d[kTPR * j], t);
    }
    s = group_sum<kTPR>(s);
    t = group_sum<kTPR>(t);
}

template <class Cfg>
__device__ __forceinline__ void bwd_dkdv_simt(const typename Cfg::Params& p) {
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kTPR = kThreads / kBN;  // lanes per key row
    constexpr int kCols = kD / kTPR;      // columns per lane: sub, sub + kTPR, ...
    static_assert(kTPR <= 32 && (kTPR & (kTPR - 1)) == 0 && kD % kTPR == 0, "key rows split evenly over lanes");
    extern __shared__ __align__(16) float smem_f32[];
    float* sQ = smem_f32;
    float* sDO = sQ + kBM * kD;
    float* sLse2 = sDO + kBM * kD;
    float* sDelta = sLse2 + kBM;

    const DkdvWork w = dkdv_work<kBM, kBN, Cfg::kCausal>(p);
    const int tid = threadIdx.x, sub = tid % kTPR;
    const int key = w.n0 + tid / kTPR;
    const bool key_valid = key < p.seqlen_k;
    const float* k_row = static_cast<const float*>(p.k) + w.batch * p.k_batch_stride + w.head_k * p.k_head_stride + key * p.k_row_stride;
    const float* v_row = static_cast<const float*>(p.v) + w.batch * p.v_batch_stride + w.head_k * p.v_head_stride + key * p.v_row_stride;
    float kr[kCols], vr[kCols], dk[kCols], dv[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        kr[j] = key_valid ? k_row[sub + kTPR * j] : 0.f;
        vr[j] = key_valid ? v_row[sub + kTPR * j] : 0.f;
        dk[j] = dv[j] = 0.f;
    }
    for (int t = 0; t < w.steps; ++t) {
        const int head = w.head_k * p.group + t / w.m_tiles;
        const int m0 = w.m_begin + (t % w.m_tiles) * kBM;
        const float* q = static_cast<const float*>(p.q) + w.batch * p.q_batch_stride + head * p.q_head_stride + m0 * p.q_row_stride;
        const float* dout = static_cast<const float*>(p.dout) + w.batch * p.do_batch_stride + head * p.do_head_stride + m0 * p.do_row_stride;
        const long long stats = (static_cast<long long>(w.batch) * p.heads + head) * p.rows_padded + m0;
        __syncthreads();  // every thread is done with the previous tile
        for (int idx = tid; idx < kBM * kD; idx += kThreads) {
            const int r = idx / kD, c = idx % kD;
            const bool valid = m0 + r < p.seqlen_q;
            sQ[idx] = valid ? q[r * p.q_row_stride + c] : 0.f;
            sDO[idx] = valid ? dout[r * p.do_row_stride + c] : 0.f;
        }
        for (int r = tid; r < kBM; r += kThreads) {
            sLse2[r] = p.lse2[stats + r];
            sDelta[r] = p.delta[stats + r];
        }
        __syncthreads();
        for (int r = 0; r < kBM; ++r) {
            const float* q_r = sQ + r * kD + sub;
            const float* do_r = sDO + r * kD + sub;
            float s, dp;
            dot_pair<kCols, kTPR>(kr, q_r, vr, do_r, s, dp);
            const bool allowed = key_valid && (!Cfg::kCausal || key <= m0 + r + w.causal_offset);
            const float prob = allowed ? exp2f(fmaf(s, p.scale_log2, -sLse2[r])) : 0.f;
            const float ds = prob * (dp - sDelta[r]);
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                dv[j] = fmaf(prob, do_r[kTPR * j], dv[j]);
                dk[j] = fmaf(ds, q_r[kTPR * j], dk[j]);
            }
        }
    }
    if (!key_valid) return;
    float* dk_row = static_cast<float*>(p.dk) + w.batch * p.dk_batch_stride + w.head_k * p.dk_head_stride + key * p.dk_row_stride;
    float* dv_row = static_cast<float*>(p.dv) + w.batch * p.dv_batch_stride + w.head_k * p.dv_head_stride + key * p.dv_row_stride;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        dk_row[sub + kTPR * j] = dk[j] * p.scale;
        dv_row[sub + kTPR * j] = dv[j];
    }
}

template <class Cfg>
__device__ __forceinline__ void bwd_dq_simt(const typename Cfg::Params& p) {
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kTPR = kThreads / kBM;  // lanes per query row
    constexpr int kCols = kD / kTPR;
    static_assert(kTPR <= 32 && (kTPR & (kTPR - 1)) == 0 && kD % kTPR == 0, "query rows split evenly over lanes");
    extern __shared__ __align__(16) float smem_f32[];
    float* sK = smem_f32;
    float* sV = sK + kBN * kD;

    const int tid = threadIdx.x, sub = tid % kTPR;
    const int head = blockIdx.y, batch = blockIdx.z, head_k = head / p.group;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest causal tiles first
    const int row = m0 + tid / kTPR;
    const bool row_valid = row < p.seqlen_q;
    const int causal_offset = p.seqlen_k - p.seqlen_q;
    const float* q_row = static_cast<const float*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride + row * p.q_row_stride;
    const float* do_row = static_cast<const float*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride;
    const float* k = static_cast<const float*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride;
    const float* v = static_cast<const float*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride;
    const long long stat = (static_cast<long long>(batch) * p.heads + head) * p.rows_padded + row;
    const float lse2 = p.lse2[stat], delta = p.delta[stat];
    float qr[kCols], dor[kCols], dq[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        qr[j] = row_valid ? q_row[sub + kTPR * j] : 0.f;
        dor[j] = row_valid ? do_row[sub + kTPR * j] : 0.f;
        dq[j] = 0.f;
    }
    int n_end = p.seqlen_k;
    if constexpr (Cfg::kCausal) n_end = min(n_end, m0 + kBM + causal_offset);
    for (int n0 = 0; n0 < n_end; n0 += kBN) {
        __syncthreads();
        for (int idx = tid; idx < kBN * kD; idx += kThreads) {
            const int r = idx / kD, c = idx % kD;
            const bool valid = n0 + r < p.seqlen_k;
            sK[idx] = valid ? k[(n0 + r) * p.k_row_stride + c] : 0.f;
            sV[idx] = valid ? v[(n0 + r) * p.v_row_stride + c] : 0.f;
        }
        __syncthreads();
        for (int c = 0; c < kBN; ++c) {
            const float* k_c = sK + c * kD + sub;
            const float* v_c = sV + c * kD + sub;
            float s, dp;
            dot_pair<kCols, kTPR>(qr, k_c, dor, v_c, s, dp);
            const int key = n0 + c;
            const bool allowed = key < p.seqlen_k && (!Cfg::kCausal || key <= row + causal_offset);
            const float ds = allowed ? exp2f(fmaf(s, p.scale_log2, -lse2)) * (dp - delta) : 0.f;
#pragma unroll
            for (int j = 0; j < kCols; ++j) dq[j] = fmaf(ds, k_c[kTPR * j], dq[j]);
        }
    }
    if (!row_valid) return;
    float* dq_row = static_cast<float*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride + row * p.dq_row_stride;
#pragma unroll
    for (int j = 0; j < kCols; ++j) dq_row[sub + kTPR * j] = dq[j] * p.scale;
}

}  // namespace cuflash
