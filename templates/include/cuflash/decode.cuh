// Attention over a KV cache (decode, speculative verification, chunked prefill), sm_80 and newer.
//
// One block per (batch, kv head, row tile, split). The rows of a tile are the query tokens times
// the query heads that share the kv head (row r: token r / group, head hk * group + r % group),
// so each K/V byte is read once per tile of rows. Keys stream through a cp.async ring; the
// block's warps are kWarpsM row groups of 16 rows times kWarps / kWarpsM key groups, each key
// group taking its slice of every key tile with its own online softmax; the key groups merge
// through shared memory at the end. A split covers an equal share of its sequence's key tiles
// and, with more than one split, leaves float32 partials (output normalized by its own sum, and
// its natural-log LSE) that the row tile's last split to finish merges (merge_splits).
//
// A spec with mods (decode.cu.j2 gives Cfg mods.j2's members) evaluates its score_mod and mask_mod
// on every score element of the tile (decode_attention's ModCfg).
//
// Lengths and page ids are read on the device and checked there: a sequence whose length is
// negative or passes the cache's capacity, or whose keys sit on a page id outside the cache,
// gives NaN rows (output and LSE); no copy reads outside the cache.
#pragma once
#include "cuflash/warp_mma.cuh"
#include "cuflash/fp8_tiles.cuh"
#include "cuflash/wgmma.cuh"

namespace cuflash {

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// a * b as a 64-bit product of two 32-bit operands (one instruction).
__device__ __forceinline__ long long mul_wide(int a, int b) {
    long long r;
    asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
    return r;
}

// Where key `key` of one (batch, kv head) sits: byte offsets of its K and V rows from the
// sequence's base pointers; false for a page id outside the cache (offsets then 0). A paged
// cache's page stride and a page's rows span under 2^31 bytes (checked on the host).
template <bool kPaged>
struct CacheRows {
    long long k_row, v_row, k_page, v_page;  // bytes
    const int* pages;                         // the batch's page-table row (paged)
    int page_size, page_shift, num_pages;     // page_shift: log2(page_size), or -1

    __device__ __forceinline__ int page_index(int key) const {
        return page_shift >= 0 ? key >> page_shift : key / page_size;
    }
    // The page id that holds `key` (read from the page table; checked by offsets()).
    __device__ __forceinline__ int page_of(int key) const { return kPaged ? pages[page_index(key)] : 0; }

    __device__ __forceinline__ bool offsets(int key, int page, long long& k_off, long long& v_off) const {
        if constexpr (!kPaged) {
            k_off = key * k_row;
            v_off = key * v_row;
            return true;
        } else {
            return page_offsets(page, key - page_index(key) * page_size, k_off, v_off);
        }
    }
    // The offsets of row `slot` of page id `page` (page 0 for an id outside the cache: false).
    __device__ __forceinline__ bool page_offsets(int page, int slot, long long& k_off, long long& v_off) const {
        const bool ok = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
        page = ok ? page : 0;
        k_off = mul_wide(page, static_cast<int>(k_page)) + slot * static_cast<int>(k_row);
        v_off = mul_wide(page, static_cast<int>(v_page)) + slot * static_cast<int>(v_row);
        return ok;
    }
    __device__ __forceinline__ bool locate(int key, long long& k_off, long long& v_off) const {
        return offsets(key, page_of(key), k_off, v_off);
    }
};

// The cache geometry of sequence b, from the parameter block.
template <class Cfg>
__device__ __forceinline__ CacheRows<Cfg::kPaged> cache_rows(const typename Cfg::Params& p, int b) {
    CacheRows<Cfg::kPaged> cache;
    cache.k_row = p.k_row_stride * Cfg::kCacheElemBytes;
    cache.v_row = p.v_row_stride * Cfg::kCacheElemBytes;
    cache.k_page = p.k_batch_stride * Cfg::kCacheElemBytes;
    cache.v_page = p.v_batch_stride * Cfg::kCacheElemBytes;
    cache.pages = p.page_table + static_cast<long long>(b) * p.page_table_stride;
    cache.page_size = p.page_size;
    cache.page_shift = p.page_shift;
    cache.num_pages = p.num_pages;
    return cache;
}

// Where chunk `chunk` of row `row` of a ring stage sits: 16-bit stages permute each row's chunks
// by XOR with row % 8 (kSwizzled); FP8 stages read as fragments (kFp8Regs) by XOR with
// (row & 1) | (row >> 1 & 6), which keeps both products' 16-byte reads conflict-free.
template <class Cfg>
__device__ __forceinline__ int stage_chunk(int row, int chunk) {
    if constexpr (Cfg::kSwizzled)
        return chunk ^ (row % 8);
    else if constexpr (Cfg::kFp8Regs)
        return chunk ^ ((row & 1) | ((row >> 1) & 6));
    else
        return chunk;
}

// How a block's threads share the copies of a key tile (kBlockN rows of kSrcChunks 16-byte
// chunks): where the threads tile the rows evenly (kEven), each keeps one chunk column and steps
// down kStep rows kIters times, so the page ids of its rows can be read a tile ahead.
template <class Cfg>
struct TileCopies {
    static constexpr int kThreads = Cfg::kWarps * 32;
    static constexpr int kCopies = Cfg::kBlockN * Cfg::kSrcChunks;
    static constexpr bool kEven = kThreads % Cfg::kSrcChunks == 0 && kCopies % kThreads == 0;
    static constexpr int kIters = (kCopies + kThreads - 1) / kThreads;
    static constexpr int kStep = kThreads / Cfg::kSrcChunks;
};

// The page ids of this thread's rows of the tile at key0 (kEven tiles of a paged cache).
template <class Cfg, bool kPaged>
__device__ __forceinline__ void fetch_pages(const CacheRows<kPaged>& rows, int (&pages)[TileCopies<Cfg>::kIters],
                                            int key0, int kv_len, int tid) {
    using T = TileCopies<Cfg>;
#pragma unroll
    for (int it = 0; it < T::kIters; ++it) {
        const int key = key0 + tid / Cfg::kSrcChunks + it * T::kStep;
        pages[it] = key < kv_len ? rows.page_of(key) : 0;
    }
}

// load_key_tile for kEven tiles of a paged cache whose page ids `pages` were fetched ahead: each
// thread's rows step by kStep from tid / kSrcChunks, its chunk column fixed; kPow2: page sizes
// that are powers of two. Returns whether a key before kv_len sits on a page outside the cache.
template <class Cfg, bool kPow2>
__device__ __forceinline__ bool load_paged_tile(const CacheRows<true>& rows, const int (&pages)[TileCopies<Cfg>::kIters],
                                                const unsigned char* k, const unsigned char* v, u32 k_dst,
                                                u32 v_dst, int pitch, int key0, int kv_len, int tid) {
    using T = TileCopies<Cfg>;
    const int r0 = tid / Cfg::kSrcChunks, chunk = tid % Cfg::kSrcChunks;
    const int slot_mask = (1 << rows.page_shift) - 1;
    k += chunk * 16;
    v += chunk * 16;
    bool bad = false;
#pragma unroll
    for (int it = 0; it < T::kIters; ++it) {
        const int row = r0 + it * T::kStep, key = key0 + row;
        const int slot = kPow2 ? key & slot_mask : key % rows.page_size;
        long long k_off, v_off;
        const bool ok = rows.page_offsets(pages[it], slot, k_off, v_off);
        const bool valid = key < kv_len;
        bad |= valid && !ok;
        const u32 dst = Cfg::kWgmma ? swizzled_offset(row, chunk, Cfg::kBlockN)
                                    : row * pitch + stage_chunk<Cfg>(row, chunk) * 16;
        cp_async_16(k_dst + dst, k + k_off, valid && ok);
        cp_async_16(v_dst + dst, v + v_off, valid && ok);
    }
    return bad;
}

// This thread's cp.async copies of one key tile into a K and a V tile of row pitch `pitch`
// bytes; keys at or past kv_len are zero-filled. Sets `bad` for a key on a page id outside the
// cache (also zero-filled). kPrefetched: `pages` holds the rows' page ids (fetch_pages).
template <class Cfg, bool kPaged, bool kPrefetched>
__device__ __forceinline__ void load_key_tile(const CacheRows<kPaged>& rows, const int (&pages)[TileCopies<Cfg>::kIters],
                                              const unsigned char* k, const unsigned char* v, u32 k_dst, u32 v_dst,
                                              int pitch, int key0, int kv_len, int tid, bool& bad) {
    using T = TileCopies<Cfg>;
    if constexpr (kPaged && kPrefetched) {
        bad |= rows.page_shift >= 0 ? load_paged_tile<Cfg, true>(rows, pages, k, v, k_dst, v_dst, pitch, key0, kv_len, tid)
                                    : load_paged_tile<Cfg, false>(rows, pages, k, v, k_dst, v_dst, pitch, key0, kv_len, tid);
        return;
    }
#pragma unroll
    for (int it = 0; it < T::kIters; ++it) {
        const int idx = tid + it * T::kThreads;
        if (T::kCopies % T::kThreads == 0 || idx < T::kCopies) {
            const int row = idx / Cfg::kSrcChunks, chunk = idx % Cfg::kSrcChunks;
            const int key = key0 + row;
            bool valid = key < kv_len;
            long long k_off = 0, v_off = 0;
            if (valid) {
                valid = kPrefetched ? rows.offsets(key, pages[it], k_off, v_off) : rows.locate(key, k_off, v_off);
                bad |= !valid;
            }
            const u32 dst = Cfg::kWgmma ? swizzled_offset(row, chunk, Cfg::kBlockN)
                                        : row * pitch + stage_chunk<Cfg>(row, chunk) * 16;
            cp_async_16(k_dst + dst, k + k_off + chunk * 16, valid);
            cp_async_16(v_dst + dst, v + v_off + chunk * 16, valid);
        }
    }
}

// Four e4m3 codes -> four fp16 values by the conversion instruction (sm_89 and newer): exact.
__device__ __forceinline__ void e4m3x4_to_fp16x4(u32 codes, u32& lo, u32& hi) {
    asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(codes));
}

// Four FP8 codes (byte i = element i) -> fp16 pairs lo (elements 0, 1) and hi (2, 3): e4m3 by
// the conversion instruction where kFp8Cvt, else by fp8_tiles.cuh's bit moves.
template <class Cfg>
__device__ __forceinline__ void fp8x4_fragments(u32 codes, u32& lo, u32& hi) {
    if constexpr (Cfg::kE4M3 && Cfg::kFp8Cvt)
        e4m3x4_to_fp16x4(codes, lo, hi);
    else
        fp8x4_to_fp16x4<Cfg::kE4M3>(codes, lo, hi);
}

// FP8 stages read straight into fragments (kFp8Regs, head dim 128). The products run over
// relabelled keys and dims, so that each thread's codes sit in whole 16-byte chunks:
// - column j of n=8 tile nt of S is key fp8_key(nt, j) of the warp's slice, which puts the four
//   keys a thread needs for a k=16 step of P V (rows 2c, 2c+1, 2c+8, 2c+9, c = lane % 4) in rows
//   4c to 4c+3 of the V stage;
// - k-step ks of Q K^T takes dims 32c + 4ks + {0, 1} (k 2c, 2c+1) and {2, 3} (k 2c+8, 2c+9): a
//   thread's K codes of a key are bytes 32c to 32c+31 of its row;
// - column n of n=8 tile ot of the output is dim fp8_dim(ot, n) = 16n + ot: a thread's V codes of
//   a key are bytes 16g to 16g+15 (g = lane / 4), transposed four keys by four dims in registers.
__device__ __forceinline__ int fp8_key(int nt, int j) { return 16 * (nt / 2) + 4 * (j / 2) + 2 * (nt % 2) + j % 2; }
__device__ __forceinline__ int fp8_dim(int ot, int n) { return 16 * n + ot; }

// s[kNT] += Q K^T over the warp's keys: q_frag from q_fp8_fragments, `k` the K stage's first row
// of the warp's slice (row pitch 128 bytes).
template <class Cfg, int kNT>
__device__ __forceinline__ void fp8_scores(float (&s)[kNT][4], const u32 (&q_frag)[8][4], u32 k, int row0, int lane) {
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        const int row = row0 + fp8_key(nt, g);
        u32 w[2][4];
        ld_shared_v4(w[0], k + row * 128 + stage_chunk<Cfg>(row, 2 * c) * 16);
        ld_shared_v4(w[1], k + row * 128 + stage_chunk<Cfg>(row, 2 * c + 1) * 16);
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            u32 b0, b1;
            fp8x4_fragments<Cfg>(w[ks / 4][ks % 4], b0, b1);
            mma_16816<false>(s[nt], q_frag[ks], b0, b1);
        }
    }
}

// o[16] += P V over the warp's keys: p_frag the P fragments (k=16 steps), `v` the V stage.
template <class Cfg, int kKT>
__device__ __forceinline__ void fp8_values(float (&o)[16][4], const u32 (&p_frag)[kKT][4], u32 v, int row0, int lane) {
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int kk = 0; kk < kKT; ++kk) {
        u32 w[4][4];  // [key 4c + r][dims 16g + 4j .. + 3]
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = row0 + 16 * kk + 4 * c + r;
            ld_shared_v4(w[r], v + row * 128 + stage_chunk<Cfg>(row, g) * 16);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // 4 keys x 4 dims -> per dim, its 4 keys' codes (byte r = key 4c + r)
            const u32 a0 = __byte_perm(w[0][j], w[1][j], 0x5140), a1 = __byte_perm(w[0][j], w[1][j], 0x7362);
            const u32 a2 = __byte_perm(w[2][j], w[3][j], 0x5140), a3 = __byte_perm(w[2][j], w[3][j], 0x7362);
            const u32 t[4] = {__byte_perm(a0, a2, 0x5410), __byte_perm(a0, a2, 0x7632), __byte_perm(a1, a3, 0x5410),
                              __byte_perm(a1, a3, 0x7632)};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 b0, b1;
                fp8x4_fragments<Cfg>(t[i], b0, b1);
                mma_16816<false>(o[4 * j + i], p_frag[kk], b0, b1);
            }
        }
    }
}

// Convert this thread's copies of a staged FP8 tile (rows of kHeadDimStored codes) into the fp16
// tile at `dst` (pitch Cfg::kSmemRowBytes), exactly: e4m3 by the conversion instruction
// (kFp8Cvt), or by fp8_tiles.cuh's bit moves as its value times 2^-8 (the host puts 2^8 back).
template <class Cfg>
__device__ __forceinline__ void convert_key_tile(u32 dst, u32 src, int tid) {
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kCopies = Cfg::kBlockN * Cfg::kSrcChunks;
#pragma unroll
    for (int it = 0; it < (kCopies + kThreads - 1) / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        if (kCopies % kThreads == 0 || idx < kCopies) {
            const int row = idx / Cfg::kSrcChunks, chunk = idx % Cfg::kSrcChunks;
            u32 codes[2][2], h[2][4];
            ld_shared_v2(codes[0], src + row * Cfg::kSrcRowBytes + chunk * 16);
            ld_shared_v2(codes[1], src + row * Cfg::kSrcRowBytes + chunk * 16 + 8);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                fp8x4_fragments<Cfg>(codes[j][0], h[j][0], h[j][1]);
                fp8x4_fragments<Cfg>(codes[j][1], h[j][2], h[j][3]);
            }
            const u32 at = dst + row * Cfg::kSmemRowBytes + chunk * 32;
            st_shared_v4(at, h[0][0], h[0][1], h[0][2], h[0][3]);
            st_shared_v4(at + 16, h[1][0], h[1][1], h[1][2], h[1][3]);
        }
    }
}

// acc[16 x 8*kNT] += A[16 x 16*kKT] * B[8*kNT x 16*kKT]^T: A in registers (k=16 fragments), B
// row-major [n][k] in shared memory (`b` addresses its element (0, 0)); kNT even.
template <bool kBF16, int kKT, int kNT, int kBPitch, bool kBSwizzled>
__device__ __forceinline__ void warp_gemm_rt(float (&acc)[kNT][4], const u32 (&fa)[kKT][4], u32 b, int lane) {
    static_assert(kNT % 2 == 0, "B rows in pairs of n=8 tiles");
    const u32 b_row = b + (lane % 8 + (lane / 16) * 8) * kBPitch;
#pragma unroll
    for (int ks = 0; ks < kKT; ++ks) {
        const u32 b_ks = b_row + chunk_offset<kBSwizzled>(2 * ks + (lane / 8) % 2, lane);
        mma_k16_step<kBF16>(
            reinterpret_cast<float (&)[1][kNT][4]>(acc), reinterpret_cast<const u32 (&)[1][4]>(fa[ks]),
            [&](u32 (&fb)[4], int np) { ldmatrix_x4(fb, b_ks + np * 16 * kBPitch); }, [&](u32 (&)[2]) {});
    }
}

// The keys [lo, hi) query row r may attend. Its token r / group sits at position
// kv_len - seqlen_q + token (bottom-right alignment); it sees keys from position - window_left
// to position + window_right (a negative bound: none), clamped to [0, kv_len]. Causal: right 0.
struct KeyRange {
    int lo, hi;
};
template <class Params>
__device__ __forceinline__ KeyRange key_range(const Params& p, int r, int seqlen_q, int kv_len) {
    const int position = kv_len - seqlen_q + r / p.group;
    const int hi = p.window_right >= 0 ? min(kv_len, max(0, position + p.window_right + 1)) : kv_len;
    const int lo = p.window_left >= 0 ? min(hi, max(0, position - p.window_left)) : 0;
    return {lo, hi};
}

// The states (query rows x heads) of one split's partials: [batch, heads, seqlen_q], or packed
// queries' [heads, total_q].
template <class Cfg>
__device__ __forceinline__ long long split_states(const typename Cfg::Params& p, int seqlen_q) {
    return Cfg::kPackedQ ? static_cast<long long>(p.heads) * p.total_q : static_cast<long long>(p.batch) * p.heads * seqlen_q;
}

// Merges the splits' partials of rows row0 .. row_end - 1 of kv head bh into the output: first
// one warp per query row: its weights exp(LSE_s - LSE) / sum in shared memory (NaN for every
// split when one split is NaN, 0 where no split attends) and its LSE; then every thread takes
// (row, 4 dims) items, kBatch at a time, with eight splits' rows of each in flight at once.
// `scratch`: (row_end - row0) * num_splits floats of shared memory. Packed queries (kPackedQ):
// the sequence's rows start at q_first, and its states at head * total_q + q_first.
template <class Cfg, int kBatch>
__device__ __forceinline__ void merge_rows(const typename Cfg::Params& p, float* scratch, int bh, int row0,
                                           int row_end, int seqlen_q, int q_first) {
    constexpr int kWarps = Cfg::kWarps, kThreads = 32 * kWarps;
    constexpr int kQuads = Cfg::kHeadDimStored / 4;  // 4-dim groups of a row
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int group = p.group, hk = bh % p.heads_k, b = bh / p.heads_k;
    const int n_rows = row_end - row0, n = p.num_splits;
    const long long states = split_states<Cfg>(p, seqlen_q);
    const float qnan = __int_as_float(0x7fffffff);
    // Row r of the tile: its query token and head, its state (LSE index) and its output row.
    auto token_of = [&](int r) { return (row0 + r) / group; };
    auto head_of = [&](int r) { return hk * group + (row0 + r) % group; };
    auto state_of = [&](int r) {
        return Cfg::kPackedQ ? static_cast<long long>(head_of(r)) * p.total_q + q_first + token_of(r)
                             : (static_cast<long long>(b) * p.heads + head_of(r)) * seqlen_q + token_of(r);
    };
    auto out_of = [&](int r) {
        return reinterpret_cast<u32*>(static_cast<unsigned short*>(p.out) + b * p.o_batch_stride
                                      + static_cast<long long>(q_first + token_of(r)) * p.o_row_stride
                                      + head_of(r) * p.o_head_stride);
    };
    for (int r = warp; r < n_rows; r += kWarps) {
        float* w = scratch + r * n;
        const long long state = state_of(r);
        float top = neg_inf();
        bool nan = false;
        for (int s = lane; s < n; s += 32) {
            const float x = __ldcg(p.lse_part + s * states + state);
            nan |= x != x;
            top = fmaxf(top, x);
            w[s] = x;
        }
        // the head's sink logit joins the sum as a split with no values
        const float sink = p.sinks ? __ldg(p.sinks + head_of(r)) : neg_inf();
        top = fmaxf(group_max<32>(top), sink);
        nan = __any_sync(0xffffffffu, nan);
        const float pivot = top == neg_inf() ? 0.f : top;
        float total = 0.f;
        for (int s = lane; s < n; s += 32) {
            w[s] = __expf(w[s] - pivot);
            total += w[s];
        }
        total = group_sum<32>(total) + __expf(sink - pivot);
        const float inv = nan ? qnan : (total > 0.f ? 1.f / total : 0.f);
        for (int s = lane; s < n; s += 32) w[s] *= inv;
        if (lane == 0) p.lse[state] = nan ? qnan : (total > 0.f ? pivot + __logf(total) : neg_inf());
    }
    __syncthreads();
    const int items = n_rows * kQuads;
    const long long split_step = states * Cfg::kHeadDimStored;
    for (int i0 = tid; i0 < items; i0 += kBatch * kThreads) {
        float4 acc[kBatch];
        const float* src[kBatch];
        const float* w[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
            const int item = min(i0 + k * kThreads, items - 1), r = item / kQuads;
            src[k] = p.o_part + state_of(r) * Cfg::kHeadDimStored + 4 * (item - r * kQuads);
            w[k] = scratch + r * n;
            acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll 8
        for (int s = 0; s < n; ++s) {
#pragma unroll
            for (int k = 0; k < kBatch; ++k) {
                const float4 x = __ldcg(reinterpret_cast<const float4*>(src[k] + s * split_step));
                const float ws = w[k][s];
                acc[k].x += ws * x.x; acc[k].y += ws * x.y; acc[k].z += ws * x.z; acc[k].w += ws * x.w;
            }
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
            const int item = i0 + k * kThreads;
            if (item >= items) break;
            const int r = item / kQuads;
            u32* out = out_of(r) + 2 * (item - r * kQuads);
            out[0] = pack2<Cfg::kBF16>(acc[k].x, acc[k].y);
            out[1] = pack2<Cfg::kBF16>(acc[k].z, acc[k].w);
        }
    }
}

// The last block of a row tile's splits to finish merges their partials (merge_rows): each
// split's stores are fenced before its count; the block that brings the count to num_splits
// reads every split's partials (from L2) and resets the count for the next launch. `scratch`:
// shared memory no longer in use (block_m * kMaxSplits floats and one int).
template <class Cfg>
__device__ __forceinline__ void merge_splits(const typename Cfg::Params& p, float* scratch, int bh, int row0,
                                             int row_end, int seqlen_q, int q_first) {
    int* last = reinterpret_cast<int*>(scratch + 16 * Cfg::kWarpsM * Cfg::kMaxSplits);
    unsigned* count = p.split_counts + static_cast<long long>(bh) * gridDim.y + blockIdx.y;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(count, 1u) == static_cast<unsigned>(p.num_splits - 1);
    __syncthreads();
    if (!*last) return;
    __threadfence();
    if (threadIdx.x == 0) *count = 0u;
    merge_rows<Cfg, 4>(p, scratch, bh, row0, row_end, seqlen_q, q_first);
}

// The merge as a kernel of its own (p.merge_apart), after the attention: block (bh, y) merges
// rows kMergeRows * y .. (one (row, 4 dims) item per thread) of kv head bh, for the row tiles
// whose partials are too many for one block to read quickly. Packed queries: the rows of
// sequence bh / heads_k that the attention's grid covered (past them the rows stay NaN).
template <class Cfg>
__device__ __forceinline__ void decode_merge(const typename Cfg::Params& p) {
    constexpr int kMergeRows = Cfg::kMergeRows;
    __shared__ float scratch[kMergeRows * Cfg::kMaxSplits];
    int seqlen_q = p.seqlen_q, q_first = 0;
    if constexpr (Cfg::kPackedQ) {
        const int b = blockIdx.x / p.heads_k;
        q_first = p.cu_seqlens_q[b];
        seqlen_q = p.cu_seqlens_q[b + 1] - q_first;
        if (q_first < 0 || seqlen_q < 0 || q_first > p.total_q - seqlen_q) return;  // as the attention
        seqlen_q = min(seqlen_q, p.seqlen_q);
    }
    const int rows = seqlen_q * p.group;
    for (int row0 = blockIdx.y * kMergeRows; row0 < rows; row0 += gridDim.y * kMergeRows) {
        merge_rows<Cfg, 1>(p, scratch, blockIdx.x, row0, min(rows, row0 + kMergeRows), seqlen_q, q_first);
        __syncthreads();
    }
}

// The mods of a spec without any: decode_attention's default ModCfg (a spec with mods passes Cfg,
// which mods.j2's members give kScoreMod, kMaskMod, Mods, score_mod and mask_mod).
struct NoDecodeMods {
    struct Mods {};
    static constexpr bool kScoreMod = false, kMaskMod = false;
};

// ModCfg's score_mod and mask_mod run per score element, in natural units (the scores here are in
// base 2: x * ln 2 -> score_mod -> * log2 e), after the softcap and before the key range's mask;
// each row passes its own query head and position (the rows of a tile mix heads and tokens).
template <class Cfg, class ModCfg = NoDecodeMods>
__device__ __forceinline__ void decode_attention(const typename Cfg::Params& p,
                                                 const typename ModCfg::Mods& mods = typename ModCfg::Mods()) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    constexpr int D = Cfg::kHeadDim;  // padded to 16
    constexpr int BM = 16 * Cfg::kWarpsM, BN = Cfg::kBlockN;
    constexpr int WK = Cfg::kWarps / Cfg::kWarpsM;
    constexpr int kWarpKeys = BN / WK;
    constexpr int kNT = kWarpKeys / 8, kOT = D / 8;
    constexpr int kPitch = Cfg::kSmemRowBytes;
    // K and V tiles: the ring's stages (swizzled for 16-bit caches), or an FP8 cache's fp16 tiles.
    constexpr int kKVPitch = Cfg::kFp8 ? kPitch : Cfg::kSrcPitch;
    constexpr bool kSwz = Cfg::kSwizzled;
    constexpr int kThreads = Cfg::kWarps * 32;
    static_assert(kWarpKeys % 16 == 0, "each key group takes whole k=16 steps of P V");

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp % Cfg::kWarpsM, wk = warp / Cfg::kWarpsM;
    const int bh = blockIdx.x, row0 = blockIdx.y * BM, split = blockIdx.z;
    const int b = bh / p.heads_k, hk = bh - b * p.heads_k;
    const int group = p.group;
    // Per sequence: its query tokens and their first row in q (kPackedQ: packed), its keys and
    // their first row in the cache (varlen: packed), and whether these are valid.
    int seqlen_q = p.seqlen_q, q_first = 0, kv_len, k_first = 0;
    bool bad_len;
    if constexpr (Cfg::kPackedQ) {
        q_first = p.cu_seqlens_q[b];
        seqlen_q = p.cu_seqlens_q[b + 1] - q_first;
        const bool bad_q = q_first < 0 || seqlen_q < 0 || q_first > p.total_q - seqlen_q;
        if (bad_q) return;  // rows of no valid sequence keep the host's NaN
    }
    if constexpr (Cfg::kVarlen) {
        k_first = p.cu_seqlens_k[b];
        kv_len = p.cu_seqlens_k[b + 1] - k_first;
        bad_len = k_first < 0 || kv_len < 0 || k_first > p.total_k - kv_len;
    } else {
        const int old_len = p.cache_seqlens[b];
        kv_len = old_len + p.seqlen_new;
        bad_len = old_len < 0 || kv_len > p.capacity;
        if constexpr (Cfg::kLeftpad) {  // keys from the sequence's first (left-padded caches)
            const int pad = p.cache_leftpad[b];
            bad_len = bad_len || pad < 0 || pad > old_len;
            if (!bad_len) {
                k_first = pad;
                kv_len -= pad;
            }
        }
    }
    // A sequence with more rows than the grid covers (max_seqlen_q too small) is NaN as well.
    if constexpr (Cfg::kPackedQ)
        bad_len = bad_len || static_cast<long long>(seqlen_q) * group > static_cast<long long>(gridDim.y) * BM;
    if (Cfg::kVarlen && bad_len) kv_len = 0;
    const int rows = seqlen_q * group;
    if (Cfg::kPackedQ && row0 >= rows) return;  // the grid covers the longest sequence
    const int kv_keys = bad_len ? 0 : kv_len;  // keys the copies may read

    // kWgmma: the stages start on 1024-byte boundaries (wgmma's swizzle atoms).
    static_assert(!Cfg::kWgmma || (Cfg::kSmemStages % 1024 == 0 && Cfg::kStageBytes % 2048 == 0 && WK == 1),
                  "wgmma stages on swizzle atoms, one key group");
    const u32 raw_base = smem_addr(smem_raw);
    const u32 base = Cfg::kWgmma ? (raw_base + 1023u) & ~1023u : raw_base;
    unsigned char* smem = smem_raw + (base - raw_base);
    const u32 q_tile = base + Cfg::kSmemQ;
    // Zero the padding chunk of every 16-bit row (head dims of 8 mod 16): copies never write it.
    if constexpr (Cfg::kChunks > Cfg::kHeadDimStored / 8) {
        for (int row = tid; row < Cfg::kPaddedRows; row += kThreads)
            st_shared_v4(base + row * kPitch + (Cfg::kChunks - 1) * 16, 0u, 0u, 0u, 0u);
    }

    // The key tiles of this block, from its first row's first key to its last row's last,
    // split into equal shares; tiles inside every row's range need no mask.
    const int r_last = min(rows, row0 + BM) - 1;
    const KeyRange first = key_range(p, row0, seqlen_q, kv_len), last = key_range(p, r_last, seqlen_q, kv_len);
    const int keys_end = bad_len ? 0 : last.hi;
    const int tile_begin = bad_len ? 0 : min(first.lo, keys_end) / BN;
    const int n_tiles = (keys_end + BN - 1) / BN - tile_begin;
    const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
    const int t0 = tile_begin + split * per_split, t1 = tile_begin + min(n_tiles, split * per_split + per_split);
    const int unmasked_lo = last.lo, unmasked_hi = first.hi;

    // Q rows of the tile (zero-filled past the last row).
    {
        const unsigned short* q = static_cast<const unsigned short*>(p.q) + b * p.q_batch_stride
                                  + static_cast<long long>(q_first) * p.q_row_stride;
        constexpr int kQChunks = Cfg::kHeadDimStored / 8;
        for (int idx = tid; idx < BM * kQChunks; idx += kThreads) {
            const int row = idx / kQChunks, chunk = idx % kQChunks;
            const int r = row0 + row;
            const bool valid = r < rows;
            const int token = valid ? r / group : 0, head = hk * group + (valid ? r % group : 0);
            cp_async_16(q_tile + row * kPitch + chunk * 16,
                        q + token * p.q_row_stride + head * p.q_head_stride + chunk * 8, valid);
        }
        cp_async_commit();
    }

    const CacheRows<Cfg::kPaged> cache = cache_rows<Cfg>(p, b);
    const unsigned char* k = static_cast<const unsigned char*>(p.k_cache) + hk * p.k_head_stride * Cfg::kCacheElemBytes
                             + (Cfg::kPaged ? 0 : b * cache.k_page) + k_first * cache.k_row;
    const unsigned char* v = static_cast<const unsigned char*>(p.v_cache) + hk * p.v_head_stride * Cfg::kCacheElemBytes
                             + (Cfg::kPaged ? 0 : b * cache.v_page) + k_first * cache.v_row;
    bool bad_page = false;

    // Where stage s lands: the 16-bit tiles themselves, or (FP8) a staging ring of codes.
    auto stage_k = [&](int s) { return base + Cfg::kSmemStages + s * Cfg::kStageBytes; };
    auto stage_v = [&](int s) { return stage_k(s) + Cfg::kStageBytes / 2; };
    // A paged cache's page ids are read a tile before their copies are issued (kPrefetch).
    constexpr bool kPrefetch = Cfg::kPaged && TileCopies<Cfg>::kEven;
    int pages[TileCopies<Cfg>::kIters];
    auto issue = [&](int t, auto prefetched) {
        if (t < t1) {
            const int s = (t - t0) % Cfg::kStages;
            load_key_tile<Cfg, Cfg::kPaged, decltype(prefetched)::value>(
                cache, pages, k, v, stage_k(s), stage_v(s), Cfg::kSrcPitch, t * BN, kv_keys, tid, bad_page);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) issue(t0 + s, Flag<false>());
    if constexpr (kPrefetch) fetch_pages<Cfg>(cache, pages, (t0 + Cfg::kStages - 1) * BN, kv_keys, tid);

    float scale_log2 = p.scale_log2;
    if (p.k_descale) scale_log2 *= p.k_descale[hk * p.descale_head_stride];
    float row_scale[2] = {scale_log2, scale_log2};

    // Q has landed (the tiles may not have).
    cp_async_wait<Cfg::kStages - 1>();
    __syncthreads();
    if constexpr (Cfg::kFp8 && Cfg::kBF16) {
        // An FP8 cache runs fp16 products: each bf16 query row becomes fp16 times a power of two
        // that brings its largest magnitude to [2^13, 2^14), taken back out of the row's scale.
        int* shifts = reinterpret_cast<int*>(smem + Cfg::kSmemRowShift);
        for (int row = tid; row < BM; row += kThreads) {
            float top = 0.f;
            for (int c = 0; c < Cfg::kHeadDimStored / 2; ++c) {
                float lo, hi;
                unpack2<true>(static_cast<u32>(ld_shared(q_tile + row * kPitch + 4 * c)), lo, hi);
                top = fmaxf(top, fmaxf(fabsf(lo), fabsf(hi)));
            }
            const int exponent = ((__float_as_int(top) >> 23) & 0xff) - 127;
            shifts[row] = (top > 0.f && exponent < 128) ? max(-100, min(100, 13 - exponent)) : 0;
        }
        __syncthreads();
        for (int idx = tid; idx < BM * Cfg::kHeadDimStored / 2; idx += kThreads) {
            const int row = idx / (Cfg::kHeadDimStored / 2), c = idx % (Cfg::kHeadDimStored / 2);
            const u32 at = q_tile + row * kPitch + 4 * c;
            const float factor = __int_as_float((127 + shifts[row]) << 23);
            float lo, hi;
            unpack2<true>(static_cast<u32>(ld_shared(at)), lo, hi);
            st_shared(at, static_cast<int>(pack2<false>(lo * factor, hi * factor)));
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r)
            row_scale[r] = scale_log2 * __int_as_float((127 - shifts[wm * 16 + lane / 4 + 8 * r]) << 23);
    }

    float o[kOT][4];
    zero_fragments(o);
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    KeyRange range[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        range[r] = key_range(p, min(row0 + wm * 16 + lane / 4 + 8 * r, rows - 1), seqlen_q, kv_len);
    const float softcap = p.softcap_log2, inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
    // The mods' query head and position of each of the thread's two rows (clamped to the last row,
    // as the key ranges are): token `row / group` sits at kv_len - seqlen_q + token (bottom-right),
    // or, packed sequences (varlen), at the token's index in its sequence, as attention_varlen's
    // mods see it.
    constexpr bool kMods = ModCfg::kScoreMod || ModCfg::kMaskMod;
    int mod_head[kMods ? 2 : 1], mod_q[kMods ? 2 : 1];
    if constexpr (kMods) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = min(row0 + wm * 16 + lane / 4 + 8 * r, rows - 1), token = row / group;
            mod_head[r] = hk * group + row % group;
            mod_q[r] = Cfg::kVarlen ? token : kv_len - seqlen_q + token;
        }
    }
    const u32 q_warp = q_tile + wm * 16 * kPitch;
    u32 q_frag[Cfg::kQInRegs ? D / 16 : 1][4];  // Q's A fragments, where registers allow
    if constexpr (Cfg::kFp8Regs) {
        // k-step ks: dims 32c + 4ks + {0, 1} and {2, 3} (fp8_key's comment)
        const u32 at = q_warp + (lane / 4) * kPitch + (32 * (lane % 4)) * 2;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            q_frag[ks][0] = static_cast<u32>(ld_shared(at + 8 * ks));
            q_frag[ks][1] = static_cast<u32>(ld_shared(at + 8 * kPitch + 8 * ks));
            q_frag[ks][2] = static_cast<u32>(ld_shared(at + 8 * ks + 4));
            q_frag[ks][3] = static_cast<u32>(ld_shared(at + 8 * kPitch + 8 * ks + 4));
        }
    } else if constexpr (Cfg::kQInRegs) {
        const u32 a_lane = q_warp + (lane % 8 + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 16;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(q_frag[ks], a_lane + ks * 32);
    }

    for (int t = t0; t < t1; ++t) {
        cp_async_wait<Cfg::kStages - 2>();
        if constexpr (Cfg::kWgmma) fence_proxy_async();  // cp.async wrote through the generic proxy
        __syncthreads();
        u32 k_tile, v_tile;
        if constexpr (Cfg::kFp8 && !Cfg::kFp8Regs) {
            const int s = (t - t0) % Cfg::kStages;
            convert_key_tile<Cfg>(base + Cfg::kSmemK16, stage_k(s), tid);
            convert_key_tile<Cfg>(base + Cfg::kSmemV16, stage_v(s), tid);
            __syncthreads();
            k_tile = base + Cfg::kSmemK16;
            v_tile = base + Cfg::kSmemV16;
        } else {
            k_tile = stage_k((t - t0) % Cfg::kStages);
            v_tile = stage_v((t - t0) % Cfg::kStages);
        }
        issue(t + Cfg::kStages - 1, Flag<kPrefetch>());
        if constexpr (kPrefetch) fetch_pages<Cfg>(cache, pages, (t + Cfg::kStages) * BN, kv_keys, tid);

        float s[kNT][4];
        if constexpr (Cfg::kWgmma) {  // the warpgroup's 64 rows at once; Q's fragments are wgmma's A
            const u64 k_desc = smem_desc(k_tile, 16, 1024);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Cfg::wgmma_qk(s, q_frag[ks], desc_advance(k_desc, (ks / 4) * BN * 128 + (ks % 4) * 32), ks);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(s);
        } else {
            zero_fragments(s);
            if constexpr (Cfg::kFp8Regs)
                fp8_scores<Cfg>(s, q_frag, k_tile, wk * kWarpKeys, lane);
            else if constexpr (Cfg::kQInRegs)
                warp_gemm_rt<Cfg::kMmaBF16, D / 16, kNT, kKVPitch, kSwz>(s, q_frag, k_tile + wk * kWarpKeys * kKVPitch,
                                                                         lane);
            else
                warp_gemm_nt<Cfg::kMmaBF16, D, kNT, kPitch, kKVPitch, kSwz>(s, q_warp, k_tile + wk * kWarpKeys * kKVPitch,
                                                                           lane);
        }
        const bool masked = t * BN < unmasked_lo || (t + 1) * BN > unmasked_hi;
        const int key_base = t * BN + wk * kWarpKeys + 2 * (lane % 4);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float top = neg_inf();
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[nt][2 * r + e] * row_scale[r];
                    if (softcap > 0.f) x = softcap * tanh_approx(x * inv_softcap);
                    const int key = Cfg::kFp8Regs ? key_base - 2 * (lane % 4) + fp8_key(nt, 2 * (lane % 4) + e)
                                                  : key_base + nt * 8 + e;
                    if constexpr (ModCfg::kScoreMod)
                        x = ModCfg::score_mod(x * kLn2, b, mod_head[r], mod_q[r], key, mods) * kLog2e;
                    if (masked && (key < range[r].lo || key >= range[r].hi)) x = neg_inf();
                    if constexpr (ModCfg::kMaskMod) {
                        if (!ModCfg::mask_mod(b, mod_head[r], mod_q[r], key, mods)) x = neg_inf();
                    }
                    s[nt][2 * r + e] = x;
                    top = fmaxf(top, x);
                }
            top = quad_max(top);
            const float m_new = fmaxf(m[r], top);
            const float pivot = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2_approx(m[r] - pivot);
            m[r] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pr = exp2_approx(s[nt][2 * r + e] - pivot);
                    s[nt][2 * r + e] = pr;
                    sum += pr;
                }
            l[r] = l[r] * alpha + sum;
            if (__any_sync(0xffffffffu, alpha != 1.f)) {  // once the row maxima settle, rarely
#pragma unroll
                for (int ot = 0; ot < kOT; ++ot) {
                    o[ot][2 * r] *= alpha;
                    o[ot][2 * r + 1] *= alpha;
                }
            }
        }
        u32 packed[kNT][2];
        pack_fragments<Cfg::kMmaBF16, kNT>(packed, s);
        if constexpr (Cfg::kWgmma) {
            const u64 v_desc = smem_desc(v_tile, BN * 128, 1024);
            const auto& pa = as_operand(packed);
            fence_operands(o);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) Cfg::wgmma_pv(o, pa[kk], desc_advance(v_desc, kk * 2048), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(o);
        } else if constexpr (Cfg::kFp8Regs)
            fp8_values<Cfg>(o, as_operand(packed), v_tile, wk * kWarpKeys, lane);
        else
            warp_gemm_rn<Cfg::kMmaBF16, kNT / 2, kOT, kKVPitch, kSwz>(o, as_operand(packed),
                                                                      v_tile + wk * kWarpKeys * kKVPitch, lane);
    }
    cp_async_wait<0>();
    const bool bad = __syncthreads_or(bad_page) || bad_len;

#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
    float* red = reinterpret_cast<float*>(smem + Cfg::kSmemStages);  // the ring is free now
    if constexpr (WK > 1) {
        float* ml = red;                      // [WK][BM][2]: each key group's max and sum
        float* parts = red + 2 * WK * BM;     // [WK - 1][BM][D]: key groups 1.. 's outputs
        if (lane % 4 == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = wm * 16 + lane / 4 + 8 * r;
                ml[2 * (wk * BM + row)] = m[r];
                ml[2 * (wk * BM + row) + 1] = l[r];
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = wm * 16 + lane / 4 + 8 * r;
            float top = neg_inf();
#pragma unroll
            for (int w = 0; w < WK; ++w) top = fmaxf(top, ml[2 * (w * BM + row)]);
            const float pivot = top == neg_inf() ? 0.f : top;
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < WK; ++w) total += ml[2 * (w * BM + row) + 1] * exp2_approx(ml[2 * (w * BM + row)] - pivot);
            const float mine = exp2_approx(m[r] - pivot);
#pragma unroll
            for (int ot = 0; ot < kOT; ++ot) {
                o[ot][2 * r] *= mine;
                o[ot][2 * r + 1] *= mine;
            }
            m[r] = top;
            l[r] = total;
        }
        if (wk > 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float* dst = parts + ((wk - 1) * BM + wm * 16 + lane / 4 + 8 * r) * D + 2 * (lane % 4);
#pragma unroll
                for (int ot = 0; ot < kOT; ++ot) {
                    dst[ot * 8] = o[ot][2 * r];
                    dst[ot * 8 + 1] = o[ot][2 * r + 1];
                }
            }
        }
        __syncthreads();
        if (wk == 0) {  // key group 0 adds the others' outputs; every warp goes on to the merge
#pragma unroll
            for (int w = 1; w < WK; ++w)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float* src = parts + ((w - 1) * BM + wm * 16 + lane / 4 + 8 * r) * D + 2 * (lane % 4);
#pragma unroll
                    for (int ot = 0; ot < kOT; ++ot) {
                        o[ot][2 * r] += src[ot * 8];
                        o[ot][2 * r + 1] += src[ot * 8 + 1];
                    }
                }
        }
    }

    float v_scale = p.out_scale;
    if (p.v_descale) v_scale *= p.v_descale[hk * p.descale_head_stride];
    const float nan = __int_as_float(0x7fffffff);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + wm * 16 + lane / 4 + 8 * r;
        if (wk > 0 || row >= rows) continue;  // key group 0 holds the merged rows
        const int token = row / group, head = hk * group + row % group;
        float mr = m[r], lr = l[r], kept = 1.f;
        if (p.sinks && p.num_splits == 1) {  // the head's sink logit joins the row's sum (split launches: the merge)
            const float sink = __ldg(p.sinks + head) * kLog2e, top = fmaxf(mr, sink);
            if (top != neg_inf()) {
                kept = lr > 0.f ? exp2_approx(mr - top) : 0.f;
                lr = lr * kept + exp2_approx(sink - top);
                mr = top;
            }
        }
        const float factor = bad ? nan : (lr > 0.f ? v_scale * kept / lr : 0.f);
        const float lse = bad ? nan : (lr > 0.f ? (mr + log2_approx(lr)) * kLn2 : neg_inf());
        // LSE [batch, heads, seqlen_q], or packed queries [heads, total_q]
        const long long state = Cfg::kPackedQ ? static_cast<long long>(head) * p.total_q + q_first + token
                                             : (static_cast<long long>(b) * p.heads + head) * seqlen_q + token;
        // This row's output, columns 2c + e of tiles ot, in pairs of dims: (8 ot + 2c, + 1), or
        // with FP8 fragments, fp8_dim(ot, 2c + e) and the next (tile ot + 1).
        auto store_row = [&](auto* row_out, auto pack) {
            if constexpr (Cfg::kFp8Regs) {
#pragma unroll
                for (int e = 0; e < 2; ++e)
#pragma unroll
                    for (int ot = 0; ot < kOT; ot += 2)
                        row_out[fp8_dim(ot, 2 * (lane % 4) + e) / 2]
                            = pack(o[ot][2 * r + e] * factor, o[ot + 1][2 * r + e] * factor);
            } else {
                auto* dst = row_out + lane % 4;
#pragma unroll
                for (int ot = 0; ot < kOT; ++ot)
                    if (ot * 8 < Cfg::kHeadDimStored) dst[ot * 4] = pack(o[ot][2 * r] * factor, o[ot][2 * r + 1] * factor);
            }
        };
        if (p.num_splits == 1) {
            store_row(reinterpret_cast<u32*>(static_cast<unsigned short*>(p.out) + b * p.o_batch_stride
                                             + static_cast<long long>(q_first + token) * p.o_row_stride
                                             + head * p.o_head_stride),
                      [](float x, float y) { return pack2<Cfg::kBF16>(x, y); });
            if (lane % 4 == 0) p.lse[state] = lse;
        } else {
            const long long part = static_cast<long long>(split) * split_states<Cfg>(p, seqlen_q) + state;
            store_row(reinterpret_cast<float2*>(p.o_part + part * Cfg::kHeadDimStored),
                      [](float x, float y) { return make_float2(x, y); });
            if (lane % 4 == 0) p.lse_part[part] = lse;
        }
    }
    if (p.num_splits > 1 && !p.merge_apart)
        merge_splits<Cfg>(p, reinterpret_cast<float*>(smem + Cfg::kSmemStages), b * p.heads_k + hk, row0,
                          min(rows, row0 + BM), seqlen_q, q_first);
}

// Write the new keys and values of token blockIdx.x into the cache at the sequence's length (the
// cache_seqlens entry, which stays as it was). A sequence whose new length passes the capacity,
// whose length is negative or whose left pad lies outside [0, length], gets none; a row on a page
// id outside the cache is skipped.
template <class Cfg>
__device__ __forceinline__ void decode_append(const typename Cfg::Params& p) {
    const int i = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int old_len = p.cache_seqlens[b];
    if (old_len < 0 || old_len + p.seqlen_new > p.capacity) return;
    if (Cfg::kLeftpad && (p.cache_leftpad[b] < 0 || p.cache_leftpad[b] > old_len)) return;
    const CacheRows<Cfg::kPaged> cache = cache_rows<Cfg>(p, b);
    long long k_off, v_off;
    if (!cache.locate(old_len + i, k_off, v_off)) return;
    const long long batch_k = Cfg::kPaged ? 0 : b * cache.k_page, batch_v = Cfg::kPaged ? 0 : b * cache.v_page;
    uint4* k_dst = reinterpret_cast<uint4*>(static_cast<unsigned char*>(const_cast<void*>(p.k_cache)) + batch_k
                                            + hk * p.k_head_stride * Cfg::kCacheElemBytes + k_off);
    uint4* v_dst = reinterpret_cast<uint4*>(static_cast<unsigned char*>(const_cast<void*>(p.v_cache)) + batch_v
                                            + hk * p.v_head_stride * Cfg::kCacheElemBytes + v_off);
    const uint4* k_src = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.k_new)
        + (b * p.kn_batch_stride + i * p.kn_row_stride + hk * p.kn_head_stride) * Cfg::kCacheElemBytes);
    const uint4* v_src = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.v_new)
        + (b * p.vn_batch_stride + i * p.vn_row_stride + hk * p.vn_head_stride) * Cfg::kCacheElemBytes);
    for (int c = threadIdx.x; c < 2 * Cfg::kSrcChunks; c += blockDim.x) {
        if (c < Cfg::kSrcChunks)
            k_dst[c] = k_src[c];
        else
            v_dst[c - Cfg::kSrcChunks] = v_src[c - Cfg::kSrcChunks];
    }
}

}  // namespace cuflash
