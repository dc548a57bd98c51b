// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16), sm_80 and newer.
//
// One thread block per (query tile of kBlockM rows, batch*head). The Q tile stays on chip; K/V
// tiles of kBlockN rows stream through a kStages-deep cp.async ring in shared memory. Each warp
// owns 16*kMTiles query rows and the full head_dim of their output, so the softmax statistics
// of a row live in the 4 lanes of one quad and never touch shared memory.
//
// Key tiles are visited from the last to the first: the tiles that need masking (the causal
// diagonal and the sequence tail) come first, and the running max is usually settled by the
// time the unmasked tiles arrive.
//
// FP8 codes (kFp8, e4m3 / e5m2): the same products in fp16, on tiles converted on chip
// (fp8_tiles.cuh). Q's codes are staged where the K/V tiles go and converted once. K/V codes
// stream through a kStages-deep staging ring; after the products of step i each thread converts
// its own copies of what step i+1 needs (K of step i+1+kOverlap, V of step i+1) into the other
// of two fp16 K/V tiles, so the one barrier per step both publishes the conversions and frees
// the tiles of step i-1. The descales of q and k (and e4m3's 2^16) join the softmax scale, v's
// (and e4m3's 2^8) the output scale; the output is kOutBF16's type.
//
// The generated kernel provides Cfg with (all compile-time):
//   Elem, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kCausal, kBF16, kOutBF16, kFp8, kQInRegs,
//   kOverlap, kChunksPerRow, kSmemRowBytes, kSmemQ, kSmemK, kSmemV, kKVTileBytes, the Params
//   struct, and for FP8 kE4M3, kFp8CopyBytes, kFp8CopiesPerRow, kSmemQ8, kSmemStage, kStageBytes.
#pragma once
#include "cuflash/block.cuh"
#include "cuflash/fp8_tiles.cuh"
#include "cuflash/online_softmax.cuh"
#include "cuflash/warp_mma.cuh"
#include "cuflash/mods.cuh"

namespace cuflash {

template <class Cfg>
__device__ __forceinline__ void fwd_mma(const typename Cfg::Params& p, const typename Cfg::Mods& mods) {
    constexpr int kD = Cfg::kHeadDim;
    constexpr int kBM = Cfg::kBlockM;
    constexpr int kBN = Cfg::kBlockN;
    constexpr int kRowB = Cfg::kSmemRowBytes;
    constexpr int kMTiles = kBM / (16 * Cfg::kWarps);  // 16-row MMA tiles per warp
    constexpr int kK16 = kD / 16;                      // k=16 steps of S = Q K^T
    constexpr bool kTail8 = (kD % 16) != 0;            // plus one k=8 step (head_dim = 8 mod 16)
    constexpr int kKSteps = kK16 + (kTail8 ? 1 : 0);
    constexpr int kSTiles = kBN / 8;                   // n=8 tiles of S per warp row block
    constexpr int kOTiles = kD / 8;                    // n=8 tiles of O
    constexpr bool kBF16 = Cfg::kBF16;                 // operand type of the products
    constexpr bool kFp8 = Cfg::kFp8;
    constexpr int kSlots = kFp8 ? 2 : Cfg::kStages;    // K/V tiles the products read (step i: slot i % kSlots)

    extern __shared__ __align__(128) unsigned char smem[];
    const u32 smem_base = smem_addr(smem);
    const u32 sQ = smem_base + Cfg::kSmemQ;
    const u32 sK = smem_base + Cfg::kSmemK;
    const u32 sV = smem_base + Cfg::kSmemV;

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    typedef typename Cfg::Elem Elem;
    const BlockWork<Elem, kBM, kBN, Cfg::kCausal> work(p);
    const int m0 = work.m0, n_tiles = work.n_tiles, causal_offset = work.causal_offset;
    const Elem *q = work.q, *k = work.k, *v = work.v;

    // K/V tile `tile` into ring slot `slot` (FP8: the staging ring of codes)
    auto load_kv = [&](int tile, int slot) {
        const int n0 = tile * kBN;
        if constexpr (kFp8) {
            const u32 stage = smem_base + Cfg::kSmemStage + slot * Cfg::kStageBytes;
            load_fp8_tile_async<Cfg, kBN>(stage, k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, tid);
            load_fp8_tile_async<Cfg, kBN>(stage + kBN * kD, v + n0 * p.v_row_stride, p.v_row_stride,
                                          p.seqlen_k - n0, tid);
        } else {
            load_tile_async<Cfg, kBN>(sK + slot * Cfg::kKVTileBytes, k + n0 * p.k_row_stride,
                                      p.k_row_stride, p.seqlen_k - n0, tid);
            load_tile_async<Cfg, kBN>(sV + slot * Cfg::kKVTileBytes, v + n0 * p.v_row_stride,
                                      p.v_row_stride, p.seqlen_k - n0, tid);
        }
    };
    // FP8: this thread's copies of step i's K (V) codes -> the fp16 tile of slot i % 2
    auto convert_k = [&](int i) {
        if constexpr (kFp8)
            convert_fp8_tile<Cfg, kBN>(sK + (i % 2) * Cfg::kKVTileBytes,
                                       smem_base + Cfg::kSmemStage + (i % Cfg::kStages) * Cfg::kStageBytes, tid);
    };
    auto convert_v = [&](int i) {
        if constexpr (kFp8)
            convert_fp8_tile<Cfg, kBN>(sV + (i % 2) * Cfg::kKVTileBytes,
                                       smem_base + Cfg::kSmemStage + (i % Cfg::kStages) * Cfg::kStageBytes + kBN * kD,
                                       tid);
    };

    // -- prologue: Q, then the first kStages-1 K/V tiles, one commit group each --
    if constexpr (kFp8)
        load_fp8_tile_async<Cfg, kBM>(smem_base + Cfg::kSmemQ8, q, p.q_row_stride, p.seqlen_q - m0, tid);
    else
        load_tile_async<Cfg, kBM>(sQ, q, p.q_row_stride, p.seqlen_q - m0, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
        if (s < n_tiles) load_kv(n_tiles - 1 - s, s);
        cp_async_commit();
    }
    constexpr int kAhead = Cfg::kOverlap ? 1 : 0;
    if constexpr (kFp8) {
        // Q and the tiles of steps 0..kAhead have landed (this thread's copies): convert them.
        cp_async_wait<Cfg::kStages - 2 - kAhead>();
        convert_fp8_tile<Cfg, kBM>(sQ, smem_base + Cfg::kSmemQ8, tid);
        __syncthreads();  // every thread has read its Q codes, which the fp16 K/V tiles overwrite
        if (n_tiles > 0) {
            convert_k(0);
            convert_v(0);
        }
        if (kAhead && n_tiles > 1) convert_k(1);
    }

    // FP8: the descales of q and k scale the scores, v's the output (per batch and head, read
    // from device memory; the output's in the epilogue, which keeps a register free in the loop);
    // e4m3 tiles hold values times 2^-8. A negative product of descales (the max would become
    // the min) makes the rows NaN, not wrong. 16-bit inputs read the scale from the parameters.
    const int kv_descale = work.batch * p.kv_descale_batch_stride + work.head_k * p.kv_descale_head_stride;
    float fp8_scale_log2 = 0.f;
    if constexpr (kFp8) {
        fp8_scale_log2 = p.scale_log2 * (Cfg::kE4M3 ? 65536.f : 1.f) * p.k_descale[kv_descale] *
                         p.q_descale[work.batch * p.q_descale_batch_stride + work.head * p.q_descale_head_stride];
        if (!(fp8_scale_log2 >= 0.f)) fp8_scale_log2 = __int_as_float(0x7fffffff);
    }
    // With mods the scores are scaled (mod_scale) and modded before the softmax, which then takes
    // them in natural units times the score_mod's output factor.
    constexpr bool kMods = Cfg::kScoreMod || Cfg::kMaskMod;
    const float mod_scale = (kFp8 ? fp8_scale_log2 : p.scale_log2) * (kLn2 * Cfg::kScoreInScale);
    auto scale_log2 = [&]() {
        if constexpr (kMods) return kLog2e * Cfg::kScoreOutScale;
        else if constexpr (kFp8) return fp8_scale_log2;
        else return p.scale_log2;
    };

    // Per-lane byte offsets of the ldmatrix row addresses (fragment layouts of m16n8k16).
    const int warp_row0 = warp * 16 * kMTiles;
    // A operand (Q rows): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
    const u32 q_lane = (warp_row0 + lane % 8 + ((lane / 8) % 2) * 8) * kRowB + (lane / 16) * 16;
    // B operand of Q K^T (K rows = n): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, ...)
    const u32 k_lane = (lane % 8 + (lane / 16) * 8) * kRowB + ((lane / 8) % 2) * 16;
    // x2 loads (the k=8 / n=8 tails): lanes 0-15 address rows 0-15 of one 8-column chunk.
    const u32 x2_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kRowB;
    // B operand of P V (V rows = k, transposed load): (k 0-7 | 8-15) x (n 0-7 | 8-15)
    const u32 v_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kRowB + (lane / 16) * 16;

    float acc_o[kMTiles][kOTiles][4];
    float row_max[kMTiles][2];  // running max of the raw scores
    float row_sum[kMTiles][2];  // this lane's share of the running denominator
    softmax_start(acc_o, row_max, row_sum);

    u32 q_frag[Cfg::kQInRegs ? kMTiles : 1][Cfg::kQInRegs ? kKSteps : 1][4];
    auto q_operand = [&](u32 (&a)[4], int mt, int ks) {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[mt][ks][e];
        } else {
            const u32 addr = sQ + q_lane + mt * 16 * kRowB + ks * 32;
            if (ks < kK16) {
                ldmatrix_x4(a, addr);
            } else {  // k=8 tail: a0 (rows 0-7), a1 (rows 8-15)
                u32 half[2];
                ldmatrix_x2(half, addr);
                a[0] = half[0]; a[1] = half[1];
            }
        }
    };

    // -- S = Q K^T for the tile in `slot` (fp32 accumulators) --
    auto gemm_qk = [&](float (&acc_s)[kMTiles][kSTiles][4], int slot) {
        const u32 sKs = sK + slot * Cfg::kKVTileBytes;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
        static_assert(kSTiles % 2 == 0, "key tiles come in n=8 tile pairs");
        auto no_odd_tile = [](auto&) {};
#pragma unroll
        for (int ks = 0; ks < kK16; ++ks) {
            u32 a[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) q_operand(a[mt], mt, ks);
            mma_k16_step<kBF16>(
                acc_s, a, [&](u32 (&b)[4], int np) { ldmatrix_x4(b, sKs + k_lane + np * 16 * kRowB + ks * 32); },
                no_odd_tile);
        }
        if constexpr (kTail8) {
            u32 a[kMTiles][4], a8[kMTiles][2];  // the k=8 step reads the first half of each fragment
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                q_operand(a[mt], mt, kK16);
                a8[mt][0] = a[mt][0];
                a8[mt][1] = a[mt][1];
            }
            mma_k8_step<kBF16>(
                acc_s, a8,
                [&](u32 (&b)[2], int np) { ldmatrix_x2(b, sKs + x2_lane + np * 16 * kRowB + kK16 * 32); },
                no_odd_tile);
        }
    };

    // -- mask: only the causal diagonal and the sequence tail need it --
    auto apply_mask = [&](float (&acc_s)[kMTiles][kSTiles][4], int n0) {
        if constexpr (kMods) apply_mods<Cfg>(acc_s, mods, mod_scale, work.batch, work.head, m0 + warp_row0, n0, lane);
        if (work.needs_mask(n0, p.seqlen_k))
            mask_scores<Cfg::kCausal>(acc_s, n0, m0 + warp_row0, lane, p.seqlen_k, causal_offset);
    };
    // The overlapped schedule keeps one basic block per step, so it always rescales.
    auto softmax_step = [&](float (&acc_s)[kMTiles][kSTiles][4]) {
        softmax_rescale<!Cfg::kOverlap>(acc_s, acc_o, row_max, row_sum, scale_log2());
    };

    // -- O += P V for the tile in `slot`: two n=8 tiles of S form one A fragment of k=16 --
    auto gemm_pv = [&](const float (&acc_s)[kMTiles][kSTiles][4], int slot) {
        const u32 sVs = sV + slot * Cfg::kKVTileBytes;
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
            u32 a[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) probs_operand<kBF16>(a[mt], acc_s[mt], kk);
            mma_k16_step<kBF16>(
                acc_o, a, [&](u32 (&b)[4], int dp) { ldmatrix_x4_trans(b, sVs + v_lane + kk * 16 * kRowB + dp * 32); },
                [&](u32 (&b)[2]) { ldmatrix_x2_trans(b, sVs + x2_lane + kk * 16 * kRowB + (kOTiles - 1) * 16); });
        }
    };

    // Ring bookkeeping: tile t lives in slot t % kStages, one commit group per tile. Before step
    // i the groups committed are Q, tiles 0..kStages-2 and one per earlier step; the step needs
    // tile i (plus tile i+1 when overlapping) complete (FP8: converted; convert_next waits for
    // the codes of tile i+1 (i+2) after step i, by the same count).
    auto wait_and_prefetch = [&](int i) {
        if constexpr (!kFp8) cp_async_wait<Cfg::kStages - 2 - kAhead>();
        // The tiles have landed (FP8: are converted) for every thread, and every warp is done
        // with step i-1's slot, which the next copy (FP8: conversion) overwrites.
        __syncthreads();
        const int ahead = i + Cfg::kStages - 1;
        if (ahead < n_tiles) load_kv(n_tiles - 1 - ahead, ahead % Cfg::kStages);
        cp_async_commit();
    };
    // FP8, after the products of step i: convert K of step i+1+kAhead and V of step i+1 into the
    // fp16 slots that step i-1 read (every warp has passed step i's barrier).
    auto convert_next = [&](int i) {
        if constexpr (kFp8) {
            cp_async_wait<Cfg::kStages - 2 - kAhead>();
            if (i + 1 + kAhead < n_tiles) convert_k(i + 1 + kAhead);
            if (i + 1 < n_tiles) convert_v(i + 1);
        }
    };
    auto load_q_registers = [&]() {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int ks = 0; ks < kKSteps; ++ks) {
                    const u32 addr = sQ + q_lane + mt * 16 * kRowB + ks * 32;
                    if (ks < kK16) {
                        ldmatrix_x4(q_frag[mt][ks], addr);
                    } else {
                        u32 half[2];
                        ldmatrix_x2(half, addr);
                        q_frag[mt][ks][0] = half[0]; q_frag[mt][ks][1] = half[1];
                    }
                }
        }
    };

    if constexpr (!Cfg::kOverlap) {
        for (int i = 0; i < n_tiles; ++i) {
            wait_and_prefetch(i);
            if (i == 0) load_q_registers();
            float acc_s[kMTiles][kSTiles][4];
            gemm_qk(acc_s, i % kSlots);
            apply_mask(acc_s, (n_tiles - 1 - i) * kBN);
            softmax_step(acc_s);
            gemm_pv(acc_s, i % kSlots);
            convert_next(i);
        }
    } else if (n_tiles > 0) {
        // Software pipeline: S of tile i+1 is computed while the softmax of tile i runs, so each
        // warp has independent tensor-core work to hide its softmax behind.
        float acc_s[kMTiles][kSTiles][4];
        if constexpr (!kFp8) cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        load_q_registers();
        gemm_qk(acc_s, 0);
        apply_mask(acc_s, (n_tiles - 1) * kBN);
        for (int i = 0; i < n_tiles - 1; ++i) {
            wait_and_prefetch(i);
            float acc_next[kMTiles][kSTiles][4];
            gemm_qk(acc_next, (i + 1) % kSlots);
            softmax_step(acc_s);
            gemm_pv(acc_s, i % kSlots);
            apply_mask(acc_next, (n_tiles - 2 - i) * kBN);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = acc_next[mt][nt][e];
            convert_next(i);
        }
        if constexpr (kFp8) __syncthreads();  // V of the last step is converted
        softmax_step(acc_s);
        gemm_pv(acc_s, (n_tiles - 1) % kSlots);
    }
    cp_async_wait<0>();

    // -- epilogue: normalize, write O in the output dtype and the natural-log LSE --
    unsigned short* o = static_cast<unsigned short*>(p.o) + work.batch * p.o_batch_stride
                        + work.head * p.o_head_stride;
    float out_scale = 1.f;
    if constexpr (kFp8) out_scale = p.v_descale[kv_descale] * (Cfg::kE4M3 ? 256.f : 1.f);
    const float sink_log2 = Cfg::kSinks ? p.sinks[work.head] * kLog2e : 0.f;
    store_output<Cfg::kOutBF16, 0, 0, Cfg::kSinks>(acc_o, row_max, row_sum, o, p.o_row_stride,
                                                   p.lse + static_cast<long long>(work.bh) * p.seqlen_q, m0 + warp_row0,
                                                   p.seqlen_q, lane, scale_log2(), out_scale, sink_log2);
}

}  // namespace cuflash
