// The two small kernels around every backward pass, for any dtype, 4 query rows per warp:
//
//   bwd_preprocess: delta = rowsum(dO * O) in float32, the LSE turned into the base-2 row offset
//     the main kernels subtract (lse2 = lse * log2(e); +inf for a row that attends nothing, so
//     its probabilities come out 0, never NaN), and (atomic dQ) the float32 dQ accumulator zeroed.
//     lse2 and delta have `rows_padded` rows per head, the padding set to +inf and 0, so the main
//     kernels copy whole tiles of them without bounds checks. (kOrderedDq) each dQ tile's turn
//     counter set to 0.
//   bwd_convert_dq: dQ = scale * accumulator, in the input dtype and layout.
//
// Cfg provides kHeadDim, kDtype (kFp16, kBf16 or kFp32), kZeroAccum, kOrderedDq, kDqTileRows,
// kAccumDim, kDqChunkCols and the Params struct.
#pragma once
#include "cuflash/ptx.cuh"
#include "cuflash/block.cuh"

namespace cuflash {

enum DtypeKind { kFp16 = 0, kBf16 = 1, kFp32 = 2 };

template <int kKind>
__device__ __forceinline__ float load_as_float(const void* base, long long idx) {
    if constexpr (kKind == kFp32) {
        return static_cast<const float*>(base)[idx];
    } else {
        const unsigned short bits = static_cast<const unsigned short*>(base)[idx];
        if constexpr (kKind == kBf16) {
            return __uint_as_float(static_cast<u32>(bits) << 16);
        } else {
            float f;
            asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
            return f;
        }
    }
}

template <int kKind>
__device__ __forceinline__ void store_from_float(void* base, long long idx, float x) {
    if constexpr (kKind == kFp32) {
        static_cast<float*>(base)[idx] = x;
    } else {
        unsigned short bits;
        if constexpr (kKind == kBf16) {
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
        } else {
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
        }
        static_cast<unsigned short*>(base)[idx] = bits;
    }
}

// Where the rows of one query tile (from row m0 of a query head) start: its Q and dO rows, and
// its index in the per-row arrays (lse2, delta, the dQ accumulator).
struct QueryRows {
    const unsigned short* q;
    const unsigned short* dout;
    long long row;  // (batch * heads + head) * rows_padded + m0
};

template <class Params>
__device__ __forceinline__ QueryRows query_rows(const Params& p, int batch, int head, int m0) {
    QueryRows r;
    r.q = static_cast<const unsigned short*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
          + m0 * p.q_row_stride;
    r.dout = static_cast<const unsigned short*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride
             + m0 * p.do_row_stride;
    r.row = (static_cast<long long>(batch) * p.heads + head) * p.rows_padded + m0;
    return r;
}

// Does the (query tile from m0, key tile from n0) pair need the mask: a sequence tail, or keys
// past the causal diagonal? Only those tiles test their elements (recompute_probs).
template <int kBN, bool kCausal>
__device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int seqlen_k, int causal_offset) {
    const bool tail = n0 + kBN > seqlen_k;
    if constexpr (kCausal) return tail || n0 + kBN - 1 > m0 + causal_offset;
    return tail;
}

// What one block of a K/V-outer kernel works on: a key tile of kBN rows of one kv head, and
// every query tile of kBM rows that can see one of its keys, for each query head of the group.
struct DkdvWork {
    int n0, head_k, batch, causal_offset;
    int m_begin;    // first query row that sees a key of the tile (rounded down to a tile)
    int m_tiles;    // query tiles per query head
    int steps;      // m_tiles * query heads per kv head
    // Packed sequences (set_sequence): this sequence's lengths and first rows in the packed q and k/v
    int seqlen_q, seqlen_k, q_start, k_start;

    // The block's tile in packed sequence `batch` (varlen): its lengths from the offsets; a key
    // tile past the sequence's keys, or of a sequence varlen_sequence_ok rejects (no keys), has
    // no steps and stores nothing.
    template <int kBM, bool kCausal, class Params>
    __device__ __forceinline__ void set_sequence(const Params& p, const VarlenArgs& va) {
        const int q0 = va.cu_seqlens_q[batch], q1 = va.cu_seqlens_q[batch + 1];
        const int k0 = va.cu_seqlens_k[batch], k1 = va.cu_seqlens_k[batch + 1];
        const bool valid = varlen_sequence_ok(va, q0, q1, k0, k1);
        q_start = valid ? q0 : 0;
        k_start = valid ? k0 : 0;
        seqlen_q = valid ? q1 - q0 : 0;
        seqlen_k = valid ? k1 - k0 : 0;
        causal_offset = seqlen_k - seqlen_q;
        m_begin = 0;
        if constexpr (kCausal) {
            const int first = n0 - causal_offset;
            m_begin = first <= 0 ? 0 : first / kBM * kBM;
        }
        m_tiles = n0 < seqlen_k && m_begin < seqlen_q ? (seqlen_q - m_begin + kBM - 1) / kBM : 0;
        steps = m_tiles * p.group;
    }

    // kLocal: only the query tiles with a row that sees a key of the tile within the window
    // (row r sees keys r + causal_offset - left .. r + causal_offset + right; negative: no bound).
    template <int kBM, int kBN>
    __device__ __forceinline__ void bound_to_window(int left, int right, int seqlen_q, int group) {
        int begin = m_begin, end = m_tiles > 0 ? seqlen_q : 0;
        if (right >= 0) {
            const int first = n0 - causal_offset - right;  // first row that sees key n0
            begin = max(begin, first <= 0 ? 0 : first / kBM * kBM);
        }
        if (left >= 0) end = min(end, n0 + kBN - causal_offset + left);  // past the last row that sees the tile's last key
        m_begin = begin;
        m_tiles = end > begin ? (end - begin + kBM - 1) / kBM : 0;
        steps = m_tiles * group;
    }

    // Step t's query head and first row. Query tiles come from the last to the first, head by
    // head of the group: every block of a head starts on the same tile and moves in step with
    // the others, so they share the tile's Q, dO and dQ lines in L2 (with a causal mask too; the
    // diagonal tiles, which need masking, come last).
    __device__ __forceinline__ int step_head(int group, int t) const { return head_k * group + t / m_tiles; }
    template <int kBM>
    __device__ __forceinline__ int step_m0(int t) const { return m_begin + (m_tiles - 1 - t % m_tiles) * kBM; }
};

// Heads (kv head, batch pairs) per chunk of a causal K/V-outer grid; see dkdv_work.
constexpr int kCausalHeadsPerChunk = 8;
// The same for the Hopper kernel with two dQ tiles (bwd_wgmma.cuh kDqDouble) and a causal mask,
// whose ordered adds (kOrderedDq) take turns key tile after key tile: more heads per chunk, fewer
// of each head's key tiles waiting in flight. (Without a mask the turns keep 8: 32 measured
// slower at 16k.)
constexpr int kOrderedHeadsPerChunk = 32;

// kChunked: number the grid in chunks of kHeadsPerChunk heads as a causal one is, without a mask
// too (the ordered dQ adds, where a key tile waits for the one before it, so that few of a head's
// key tiles are in flight at once).
template <int kBM, int kBN, bool kCausal, class Params, bool kChunked = kCausal,
          int kHeadsPerChunk = kCausalHeadsPerChunk>
__device__ __forceinline__ DkdvWork dkdv_work(const Params& p) {
    DkdvWork w;
    int key_tile = blockIdx.x, head_batch = blockIdx.y + gridDim.y * blockIdx.z;
    if constexpr (kCausal || kChunked) {
        // The grid is numbered again: a causal key tile's work falls with its index (the first
        // sees every query, the last the fewest). Blocks start in the order of their linear
        // index; head by head, each head would end on its long first tiles and the grid on the
        // last head's. So the heads come in chunks of kCausalHeadsPerChunk, and within a chunk
        // key tile by key tile, the heaviest first: the grid ends on short blocks, and the blocks
        // in flight share the query tiles of a few heads in L2.
        const int tiles = gridDim.x, heads = gridDim.y * gridDim.z;
        const int linear = blockIdx.x + tiles * head_batch;
        const int chunk = linear / (tiles * kHeadsPerChunk), in_chunk = linear % (tiles * kHeadsPerChunk);
        const int chunk_heads = min(kHeadsPerChunk, heads - chunk * kHeadsPerChunk);
        key_tile = in_chunk / chunk_heads;
        head_batch = chunk * kHeadsPerChunk + in_chunk % chunk_heads;
    }
    w.n0 = key_tile * kBN;
    w.head_k = head_batch % gridDim.y;
    w.batch = head_batch / gridDim.y;
    w.causal_offset = p.seqlen_k - p.seqlen_q;
    w.m_begin = 0;
    if constexpr (kCausal) {
        const int first = w.n0 - w.causal_offset;  // first query row that sees key n0
        w.m_begin = first <= 0 ? 0 : first / kBM * kBM;
    }
    w.m_tiles = w.m_begin < p.seqlen_q ? (p.seqlen_q - w.m_begin + kBM - 1) / kBM : 0;
    w.steps = w.m_tiles * p.group;
    return w;
}

// Rows of 16-byte words: a 16-byte aligned base and element strides of whole 8-element words.
__device__ __forceinline__ bool rows_of_words(const void* base, long long s0, long long s1, long long s2) {
    return (reinterpret_cast<unsigned long long>(base) % 16 == 0) && ((s0 | s1 | s2) % 8 == 0);
}

// The 16-byte path of the two kernels below: kAuxLanes lanes per row, each one 8-element word
// of it at a time, 32 / kAuxLanes rows per load of a warp.
template <int kHeadDim>
struct AuxWords {
    static constexpr int kWords = kHeadDim / 8;  // per row
    static constexpr int kLanes = kWords >= 32 ? 32 : kWords > 8 ? (kWords > 16 ? 32 : 16) : (kWords > 4 ? 8 : 4);
    static constexpr int kPerLane = (kWords + kLanes - 1) / kLanes;
    static constexpr int kRowsPerLoad = 32 / kLanes;
};

constexpr int kRowsPerAuxBlock = 8;  // warps per block of the two kernels below
constexpr int kAuxRowsPerWarp = 4;   // query rows per warp: each warp loads all of its rows first

// The statistics of query row `row` (< rows_padded) once its delta is known: delta, lse2, the
// dQ tile's turn counter and the accumulator's row zeroed, the last by `lanes` lanes from `lane`.
template <class Cfg>
__device__ __forceinline__ void bwd_write_row_stats(const typename Cfg::Params& p, long long bh, int row, float delta,
                                                    int lane, int lanes) {
    float lse2 = __int_as_float(0x7f800000);  // +inf: the row attends nothing
    if (row < p.seqlen_q) {
        const float lse = p.lse[bh * p.seqlen_q + row];
        if (lse != neg_inf()) lse2 = lse * kLog2e;
    }
    if (lane == 0) {
        p.delta[bh * p.rows_padded + row] = delta;
        p.lse2[bh * p.rows_padded + row] = lse2;
        if constexpr (Cfg::kOrderedDq) {
            if (row % Cfg::kDqTileRows == 0)
                p.dq_sem[bh * (p.rows_padded / Cfg::kDqTileRows) + row / Cfg::kDqTileRows] = 0;
        }
    }
    if constexpr (Cfg::kZeroAccum) {
        float* accum = p.dq_accum + (bh * p.rows_padded + row) * Cfg::kAccumDim;
        if constexpr (Cfg::kAccumDim % 4 == 0) {  // rows of whole 16-byte words
            for (int d = lane; d < Cfg::kAccumDim / 4; d += lanes)
                reinterpret_cast<float4*>(accum)[d] = make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            for (int d = lane; d < Cfg::kAccumDim; d += lanes) accum[d] = 0.f;
        }
    }
}

// Per query row: delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for a row that attends
// nothing), the dQ accumulator's row zeroed, and (kOrderedDq) the dQ tiles' turn counters. Each
// warp loads all of its rows before it reduces or stores; in 16-byte words where O and dO allow.
template <class Cfg>
__device__ __forceinline__ void bwd_preprocess(const typename Cfg::Params& p) {
    const int lane = threadIdx.x % 32;
    const int head = blockIdx.y, batch = blockIdx.z;
    const long long bh = static_cast<long long>(batch) * p.heads + head;
    if constexpr (Cfg::kDtype != kFp32 && Cfg::kHeadDim % 8 == 0) {
        if (rows_of_words(p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride)
            && rows_of_words(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride)) {
            using W = AuxWords<Cfg::kHeadDim>;
            constexpr int kLoads = (kAuxRowsPerWarp + W::kRowsPerLoad - 1) / W::kRowsPerLoad;
            const int sub = lane / W::kLanes, word = lane % W::kLanes;
            const int row0 = (blockIdx.x * kRowsPerAuxBlock + threadIdx.x / 32) * kAuxRowsPerWarp + sub;
            uint4 a[kLoads][W::kPerLane], b[kLoads][W::kPerLane];
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {  // the loads of every row before any reduction
                const int row = row0 + i * W::kRowsPerLoad;
                const bool ok = sub + i * W::kRowsPerLoad < kAuxRowsPerWarp && row < p.seqlen_q;
                const long long o_row = batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride;
                const long long do_row = batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride;
#pragma unroll
                for (int j = 0; j < W::kPerLane; ++j) {
                    const int c = word + j * W::kLanes;
                    a[i][j] = b[i][j] = make_uint4(0u, 0u, 0u, 0u);
                    if (ok && c < W::kWords) {
                        a[i][j] = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(p.o) + o_row + 8 * c);
                        b[i][j] = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(p.dout) + do_row + 8 * c);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
                float delta = 0.f;
#pragma unroll
                for (int j = 0; j < W::kPerLane; ++j) {
                    const u32 wa[4] = {a[i][j].x, a[i][j].y, a[i][j].z, a[i][j].w};
                    const u32 wb[4] = {b[i][j].x, b[i][j].y, b[i][j].z, b[i][j].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x0, x1, y0, y1;
                        unpack2<Cfg::kDtype == kBf16>(wa[e], x0, x1);
                        unpack2<Cfg::kDtype == kBf16>(wb[e], y0, y1);
                        delta += x0 * y0 + x1 * y1;
                    }
                }
#pragma unroll
                for (int w = W::kLanes / 2; w >= 1; w /= 2) delta += __shfl_xor_sync(0xffffffffu, delta, w);
                const int row = row0 + i * W::kRowsPerLoad;
                if (sub + i * W::kRowsPerLoad < kAuxRowsPerWarp && row < p.rows_padded)
                    bwd_write_row_stats<Cfg>(p, bh, row, delta, word, W::kLanes);
            }
            return;
        }
    }
    const int row0 = blockIdx.x * kRowsPerAuxBlock * kAuxRowsPerWarp + threadIdx.x / 32;
    float delta[kAuxRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kAuxRowsPerWarp; ++i) {  // the loads of every row before any reduction
        const int row = row0 + i * kRowsPerAuxBlock;
        delta[i] = 0.f;
        if (row < p.seqlen_q) {
            const long long o_row = batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride;
            const long long do_row = batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride;
            for (int d = lane; d < Cfg::kHeadDim; d += 32)
                delta[i] += load_as_float<Cfg::kDtype>(p.dout, do_row + d) * load_as_float<Cfg::kDtype>(p.o, o_row + d);
        }
    }
#pragma unroll
    for (int i = 0; i < kAuxRowsPerWarp; ++i) {
        const int row = row0 + i * kRowsPerAuxBlock;
        if (row >= p.rows_padded) break;
#pragma unroll
        for (int w = 16; w >= 1; w /= 2) delta[i] += __shfl_xor_sync(0xffffffffu, delta[i], w);
        bwd_write_row_stats<Cfg>(p, bh, row, delta[i], lane, 32);
    }
}

// Where element (r, d) of a 64-row query tile sits in a dQ accumulator tile kept in fragment
// order: per chunk of kChunkCols columns, each warp's m16n8 fragments in turn, each as its upper
// and its lower 8 rows of two floats per lane, as the Hopper backward's warpgroups write them
// (bwd_wgmma.cuh).
template <int kChunkCols>
__device__ __forceinline__ int dq_fragment_offset(int r, int d) {
    const int cc = d % kChunkCols, rr = r % 16;
    const int fragment = (r / 16) * (kChunkCols / 8) + cc / 8, lane = (rr % 8) * 4 + (cc % 8) / 2;
    return (d - cc) * 64 + (fragment * 2 + rr / 8) * 64 + lane * 2 + cc % 2;
}

// dQ from its float32 accumulator, times the softmax scale, in the input dtype; each warp loads
// all of its rows before it stores. kVarlen: blocks (rows, head, sequence) over the packed rows,
// whose dQ is at the sequence's first row + 64 * sequence in the accumulator (bwd_wgmma.cuh).
template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq(const typename Cfg::Params& p, const VarlenArgs& va = VarlenArgs{}) {
    constexpr int kPerLane = (Cfg::kHeadDim + 31) / 32;
    const int lane = threadIdx.x % 32;
    const int head = blockIdx.y;
    const int row0 = blockIdx.x * kRowsPerAuxBlock * kAuxRowsPerWarp + threadIdx.x / 32;
    int batch = blockIdx.z, start = 0, rows = p.seqlen_q, gap = 0;  // the block's rows: row0 + 8 i of `rows`
    if constexpr (Cfg::kVarlen) {  // the rows of a sequence varlen_sequence_ok rejects are left as they are
        const int q0 = va.cu_seqlens_q[blockIdx.z], q1 = va.cu_seqlens_q[blockIdx.z + 1];
        const bool ok = varlen_sequence_ok(va, q0, q1, va.cu_seqlens_k[blockIdx.z], va.cu_seqlens_k[blockIdx.z + 1]);
        start = ok ? q0 : 0;
        rows = ok ? q1 - q0 : 0;
        gap = 64 * blockIdx.z;
        batch = 0;
    }
    const long long bh = static_cast<long long>(batch) * p.heads + head;
    auto valid = [&](int row) { return row < rows && start + row < p.seqlen_q; };
    if constexpr (Cfg::kDtype != kFp32 && Cfg::kHeadDim % 8 == 0 && Cfg::kAccumDim % 4 == 0) {
        if (rows_of_words(p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride)) {
            using W = AuxWords<Cfg::kHeadDim>;
            constexpr int kLoads = (kAuxRowsPerWarp + W::kRowsPerLoad - 1) / W::kRowsPerLoad;
            const int sub = lane / W::kLanes, word = lane % W::kLanes;
            const int first = (blockIdx.x * kRowsPerAuxBlock + threadIdx.x / 32) * kAuxRowsPerWarp + sub;
            float4 x[kLoads][W::kPerLane][2];
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {  // 8 consecutive floats per word: in order in both layouts
                const int row = first + i * W::kRowsPerLoad;
                if (sub + i * W::kRowsPerLoad >= kAuxRowsPerWarp || !valid(row)) continue;
#pragma unroll
                for (int j = 0; j < W::kPerLane; ++j) {
                    const int d = 8 * (word + j * W::kLanes);
                    if (d >= Cfg::kHeadDim) continue;
                    const float* src;
                    if constexpr (Cfg::kDqChunkCols) {
                        const long long tile_row = start + gap + row / 64 * 64;
                        src = p.dq_accum + (bh * p.rows_padded + tile_row) * Cfg::kAccumDim
                              + dq_fragment_offset<Cfg::kDqChunkCols>(row % 64, d);
                    } else {
                        src = p.dq_accum + (bh * p.rows_padded + start + row) * Cfg::kAccumDim + d;
                    }
                    x[i][j][0] = reinterpret_cast<const float4*>(src)[0];
                    x[i][j][1] = reinterpret_cast<const float4*>(src)[1];
                }
            }
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
                const int row = first + i * W::kRowsPerLoad;
                if (sub + i * W::kRowsPerLoad >= kAuxRowsPerWarp || !valid(row)) continue;
                const long long dq_row = batch * p.dq_batch_stride + head * p.dq_head_stride + (start + row) * p.dq_row_stride;
#pragma unroll
                for (int j = 0; j < W::kPerLane; ++j) {
                    const int d = 8 * (word + j * W::kLanes);
                    if (d >= Cfg::kHeadDim) continue;
                    constexpr bool kBF16 = Cfg::kDtype == kBf16;
                    const float4 u = x[i][j][0], v = x[i][j][1];
                    const float s = p.scale;
                    const u32 words[4] = {pack2<kBF16>(u.x * s, u.y * s), pack2<kBF16>(u.z * s, u.w * s),
                                          pack2<kBF16>(v.x * s, v.y * s), pack2<kBF16>(v.z * s, v.w * s)};
                    st_global_v4(static_cast<unsigned short*>(p.dq) + dq_row + d, words);
                }
            }
            return;
        }
    }
    float x[kAuxRowsPerWarp][kPerLane];
#pragma unroll
    for (int i = 0; i < kAuxRowsPerWarp; ++i) {
        const int row = row0 + i * kRowsPerAuxBlock;
        if (!valid(row)) continue;
        if constexpr (Cfg::kDqChunkCols) {
            const long long tile_row = start + gap + row / 64 * 64;  // the accumulator's first row of the row's tile
            const float* tile = p.dq_accum + (bh * p.rows_padded + tile_row) * Cfg::kAccumDim;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                const int d = lane + 32 * j;
                if (d < Cfg::kHeadDim) x[i][j] = tile[dq_fragment_offset<Cfg::kDqChunkCols>(row % 64, d)];
            }
        } else {
            const float* accum = p.dq_accum + (bh * p.rows_padded + start + row) * Cfg::kAccumDim;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                const int d = lane + 32 * j;
                if (d < Cfg::kHeadDim) x[i][j] = accum[d];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < kAuxRowsPerWarp; ++i) {
        const int row = row0 + i * kRowsPerAuxBlock;
        if (!valid(row)) continue;
        const long long dq_row = batch * p.dq_batch_stride + head * p.dq_head_stride + (start + row) * p.dq_row_stride;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int d = lane + 32 * j;
            if (d < Cfg::kHeadDim) store_from_float<Cfg::kDtype>(p.dq, dq_row + d, x[i][j] * p.scale);
        }
    }
}

}  // namespace cuflash
