// Attention backward on Hopper tensor cores (wgmma, sm_90a): the K/V-outer kernel.
//
// One thread block per (key tile of kBlockN = 128 rows, kv head, batch) with two warpgroups,
// each owning 64 key rows and their dK / dV accumulators (registers, for the whole loop). K, V
// and a kStages-deep cp.async ring of query tiles (Q, dO, lse2, delta) sit in shared memory in
// wgmma's 128-byte swizzled layout (cuflash/wgmma.cuh). Per query tile of kBlockM rows:
//   S^T = K Q^T and dP^T = V dO^T     both operands from shared memory (K-major);
//   P^T, dS^T = P^T * (dP^T - delta)  in registers, in the accumulators' m16n8 fragment layout;
//   dV += P^T dO and dK += dS^T Q     A from registers, B read transposed by its descriptor;
//   dQ += dS K (unless deterministic) dS^T goes to shared memory and is read back transposed as
//                                     the A operand; each warpgroup takes half of dQ's columns
//                                     and adds them into the float32 accumulator with atomics.
// The masking, the probabilities and the epilogue are those of the mma.sync backward.
//
// The generated kernel provides Cfg with kHeadDim, kBlockM, kBlockN, kStages, kCausal, kBF16,
// kDeterministic, kChunksPerRow, kSmemK, kSmemV, kSmemQ, kSmemDO, kQTileBytes, kSmemLse2,
// kSmemDelta, kSmemDS, the Params struct and the wgmma_scores / wgmma_grad / wgmma_dq wrappers.
#pragma once
#include "cuflash/bwd_mma.cuh"
#include "cuflash/wgmma.cuh"

namespace cuflash {

template <class Cfg>
__device__ __forceinline__ void bwd_dkdv_wgmma(const typename Cfg::Params& p) {
    constexpr bool kBF16 = Cfg::kBF16;
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kQT = kBM / 8;          // n=8 tiles of S^T (query columns)
    constexpr int kOT = kD / 8;           // n=8 tiles of dK / dV
    constexpr int kColBlocks = kD / 64;   // 128-byte column blocks of a swizzled Q/K/V tile
    constexpr int kThreads = 256;
    static_assert(kBN == 128 && kBM == 64 && kD % 64 == 0, "two warpgroups of 64 keys, 64-query steps");

    extern __shared__ unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
    const u32 sK = base + Cfg::kSmemK, sV = base + Cfg::kSmemV;
    const u32 sQ = base + Cfg::kSmemQ, sDO = base + Cfg::kSmemDO, sDS = base + Cfg::kSmemDS;
    const float* s_lse2_all = reinterpret_cast<const float*>(smem + Cfg::kSmemLse2);
    const float* s_delta_all = reinterpret_cast<const float*>(smem + Cfg::kSmemDelta);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4;
    const int key_row0 = wg * 64 + (warp % 4) * 16;  // first key row (in the tile) of this warp
    const DkdvWork w = dkdv_work<kBM, kBN, Cfg::kCausal>(p);

    auto q_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBM); };
    auto kv_layout = [](int row, int chunk) { return swizzled_offset(row, chunk, kBN); };
    const unsigned short* k = static_cast<const unsigned short*>(p.k) + w.batch * p.k_batch_stride
                              + w.head_k * p.k_head_stride + w.n0 * p.k_row_stride;
    const unsigned short* v = static_cast<const unsigned short*>(p.v) + w.batch * p.v_batch_stride
                              + w.head_k * p.v_head_stride + w.n0 * p.v_row_stride;
    copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads>(kv_layout, sK, k, p.k_row_stride, p.seqlen_k - w.n0, tid);
    copy_rows_async<kBN, Cfg::kChunksPerRow, kThreads>(kv_layout, sV, v, p.v_row_stride, p.seqlen_k - w.n0, tid);
    cp_async_commit();

    // Query tiles from the last to the first, so that the blocks of a head move in step (see
    // bwd_mma.cuh).
    auto step_head = [&](int t) { return w.head_k * p.group + t / w.m_tiles; };
    auto step_m0 = [&](int t) { return w.m_begin + (w.m_tiles - 1 - t % w.m_tiles) * kBM; };
    auto load_step = [&](int t, int slot) {
        const int head = step_head(t), m0 = step_m0(t);
        const unsigned short* q = static_cast<const unsigned short*>(p.q) + w.batch * p.q_batch_stride
                                  + head * p.q_head_stride + m0 * p.q_row_stride;
        const unsigned short* dout = static_cast<const unsigned short*>(p.dout) + w.batch * p.do_batch_stride
                                     + head * p.do_head_stride + m0 * p.do_row_stride;
        copy_rows_async<kBM, Cfg::kChunksPerRow, kThreads>(q_layout, sQ + slot * Cfg::kQTileBytes, q,
                                                           p.q_row_stride, p.seqlen_q - m0, tid);
        copy_rows_async<kBM, Cfg::kChunksPerRow, kThreads>(q_layout, sDO + slot * Cfg::kQTileBytes, dout,
                                                           p.do_row_stride, p.seqlen_q - m0, tid);
        const long long stats = (static_cast<long long>(w.batch) * p.heads + head) * p.rows_padded + m0;
        load_row_stats_async<kBM, kThreads>(base + Cfg::kSmemLse2 + slot * kBM * 4,
                                            base + Cfg::kSmemDelta + slot * kBM * 4,
                                            p.lse2 + stats, p.delta + stats, tid);
    };

    float acc_dk[kOT][4], acc_dv[kOT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < w.steps) load_step(s, s);
        cp_async_commit();
    }
    const u32 k_rows = sK + wg * 64 * 128, v_rows = sV + wg * 64 * 128;  // this warpgroup's keys
    for (int t = 0; t < w.steps; ++t) {
        cp_async_wait<Cfg::kStages - 2>();
        fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
        __syncthreads();      // every warpgroup is done with step t-1 (its ring slot and dS^T)
        if (t + Cfg::kStages - 1 < w.steps) load_step(t + Cfg::kStages - 1, (t + Cfg::kStages - 1) % Cfg::kStages);
        cp_async_commit();

        const int slot = t % Cfg::kStages;
        const int head = step_head(t), m0 = step_m0(t);
        const u32 sQs = sQ + slot * Cfg::kQTileBytes, sDOs = sDO + slot * Cfg::kQTileBytes;
        const float* s_lse2 = s_lse2_all + slot * kBM;
        const float* s_delta = s_delta_all + slot * kBM;

        // S^T and dP^T, in two commit groups so the probabilities overlap the second product.
        float st[kQT][4], dpt[kQT][4];
        wgmma_fence();
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                Cfg::wgmma_scores(st, smem_desc(k_rows + cb * kBN * 128 + ks * 32, 16, 1024),
                                  smem_desc(sQs + cb * kBM * 128 + ks * 32, 16, 1024), cb + ks);
        wgmma_commit();
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                Cfg::wgmma_scores(dpt, smem_desc(v_rows + cb * kBN * 128 + ks * 32, 16, 1024),
                                  smem_desc(sDOs + cb * kBM * 128 + ks * 32, 16, 1024), cb + ks);
        wgmma_commit();
        wgmma_wait<1>();
        fence_operands(st);

        const int key0 = w.n0 + key_row0;
        bool masked = w.n0 + kBN > p.seqlen_k;
        if constexpr (Cfg::kCausal) masked = masked || w.n0 + kBN - 1 > m0 + w.causal_offset;
        auto allowed = [&](int row, int col) {
            const int key = key0 + row;
            return key < p.seqlen_k && (!Cfg::kCausal || key <= m0 + col + w.causal_offset);
        };
        recompute_probs<false>(st, s_lse2, p.scale_log2, lane, masked, allowed);
        u32 fp_tiles[kQT][2];
        pack_fragments<kBF16>(fp_tiles, st);
        wgmma_wait<0>();
        fence_operands(dpt);
        recompute_dscores<kBF16, false>(dpt, fp_tiles, s_delta, lane);
        u32 fds_tiles[kQT][2];
        pack_fragments<kBF16>(fds_tiles, dpt);
        const auto& fp = as_operand(fp_tiles);
        const auto& fds = as_operand(fds_tiles);

        if constexpr (!Cfg::kDeterministic) {
            // dS^T -> shared memory ([key][query], swizzled) for the dQ product.
            const int row = key_row0 + lane / 4;
#pragma unroll
            for (int kk = 0; kk < kQT / 2; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // n=8 tile 2kk+h: chunk 2kk+h of rows row, row+8
                    const int chunk = 2 * kk + h;
                    *reinterpret_cast<u32*>(smem + Cfg::kSmemDS + swizzled_offset(row, chunk, kBN) + (lane % 4) * 4) =
                        fds[kk][2 * h];
                    *reinterpret_cast<u32*>(smem + Cfg::kSmemDS + swizzled_offset(row + 8, chunk, kBN) + (lane % 4) * 4) =
                        fds[kk][2 * h + 1];
                }
        }

        // dV += P^T dO and dK += dS^T Q: 16 queries per k step, dO / Q read transposed.
        fence_operands(acc_dv);
        fence_operands(acc_dk);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk)
            Cfg::wgmma_grad(acc_dv, fp[kk], smem_desc(sDOs + kk * 2048, kBM * 128, 1024), 1);
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk)
            Cfg::wgmma_grad(acc_dk, fds[kk], smem_desc(sQs + kk * 2048, kBM * 128, 1024), 1);
        wgmma_commit();

        if constexpr (!Cfg::kDeterministic) {
            fence_proxy_async();
            __syncthreads();  // both warpgroups' halves of dS^T are in shared memory
            // dQ[:, 64*wg ...] = dS K: A = dS (queries x keys) read transposed from dS^T, B = K
            // (keys x head dim) read transposed; 16 keys per k step.
            constexpr int kQCols = kD / 2;
            float dq[kQCols / 8][4];
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk)
                Cfg::wgmma_dq(dq, smem_desc(sDS + kk * 2048, kBN * 128, 1024),
                              smem_desc(sK + (wg * kQCols / 64) * kBN * 128 + (wg * kQCols % 64) * 2 + kk * 2048,
                                        kBN * 128, 1024), kk);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(dq);
            fence_operands(acc_dv);
            fence_operands(acc_dk);
            float* accum = p.dq_accum + ((static_cast<long long>(w.batch) * p.heads + head) * p.rows_padded
                                         + m0 + (warp % 4) * 16 + lane / 4) * kD + wg * kQCols + 2 * (lane % 4);
#pragma unroll
            for (int nt = 0; nt < kQCols / 8; ++nt) {
                atomic_add2(accum + nt * 8, dq[nt][0], dq[nt][1]);
                atomic_add2(accum + 8 * kD + nt * 8, dq[nt][2], dq[nt][3]);
            }
        } else {
            wgmma_wait<0>();
            fence_operands(acc_dv);
            fence_operands(acc_dk);
        }
    }
    cp_async_wait<0>();

    const int key = w.n0 + key_row0;
    unsigned short* dk = static_cast<unsigned short*>(p.dk) + w.batch * p.dk_batch_stride
                         + w.head_k * p.dk_head_stride + key * p.dk_row_stride;
    unsigned short* dv = static_cast<unsigned short*>(p.dv) + w.batch * p.dv_batch_stride
                         + w.head_k * p.dv_head_stride + key * p.dv_row_stride;
    store_fragments<kBF16>(acc_dk, dk, p.dk_row_stride, 0, p.seqlen_k - key, lane, p.scale);
    store_fragments<kBF16>(acc_dv, dv, p.dv_row_stride, 0, p.seqlen_k - key, lane, 1.f);
}

}  // namespace cuflash
