// What one thread block of a forward kernel works on, shared by every kernel family: the
// (query tile, head, batch) of its grid position, the key tiles it visits and where its rows live.
#pragma once
#include "cuflash/ptx.cuh"

namespace cuflash {

// The offsets of packed sequences (cuflash.attention_varlen), int32 [batch + 1] each, the
// packed row counts, and the most queries and keys a sequence may have (the grid covers them):
// the kernel argument of the warp-specialized forward and the varlen backward when kVarlen.
struct VarlenArgs {
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q, total_k;
    int max_q, max_k;
};

// Whether sequence b's offsets lie in the packed rows, rise, and fit the grid; a sequence that
// does not has no rows (its outputs are left as they are).
__device__ __forceinline__ bool varlen_sequence_ok(const VarlenArgs& va, int q0, int q1, int k0, int k1) {
    return 0 <= q0 && q0 <= q1 && q1 <= va.total_q && q1 - q0 <= va.max_q && 0 <= k0 && k0 <= k1 &&
           k1 <= va.total_k && k1 - k0 <= va.max_k;
}

// kLocal (the warp-specialized kernel's window, Params window_left / window_right): query row r
// sees keys r + causal_offset - window_left .. r + causal_offset + window_right, a negative bound
// being none; the tile visits the key tiles [n_first, n_first + n_tiles) that hold such a key.
template <class T, int kBlockM, int kBlockN, bool kCausal, bool kLocal = false>
struct BlockWork {
    int head, batch, bh, head_k;
    int m0;             // first query row of the tile
    int causal_offset;  // seqlen_k - seqlen_q: causal masks align bottom-right
    int n_tiles;        // key tiles with at least one visible key
    int n_first;        // the first of them (kLocal; else 0)
    int win_left, win_right;  // kLocal: the window's bounds (negative: none)
    // Packed sequences (set_sequence; the warp-specialized kernel's kVarlen): this sequence's
    // lengths and its first rows in the packed q and k/v
    int seqlen_q, seqlen_k, q_start, k_start;
    const T* q;         // row m0 of this head's queries
    const T* k;         // row 0 of this head's keys / values (grouped-query: its kv head)
    const T* v;

    // The block's own tile: grid (query tiles, heads, batch).
    template <class Params>
    __device__ __forceinline__ explicit BlockWork(const Params& p) {
        init(p, blockIdx.x, gridDim.x, blockIdx.y, blockIdx.z);
    }

    // Work tile `tile` of the warp-specialized kernel (q_tiles: p.seqlen_q over kBlockM, rounded
    // up). Without a causal mask every tile costs the same: tiles are numbered as the blocks of
    // the grid (query tiles, heads, batch) would be, as p.q_tiles_magic divides. With one, tiles
    // come in bands of p.band_heads (batch, head) pairs (launch.band_heads): within a band, the
    // heaviest query tile of every pair, then the next heaviest, and so on, so that the launch
    // ends on its lightest tiles (p.band_tiles_magic divides by the band's tiles).
    template <class Params>
    __device__ __forceinline__ BlockWork(const Params& p, int tile, int q_tiles) {
        int x, rest;
        if constexpr (kCausal) {
            const int band = fast_div(tile, p.band_tiles_magic, p.band_tiles_shifts);
            const int in_band = tile - band * p.band_heads * q_tiles;
            x = fast_div(in_band, p.band_heads_magic, p.band_heads_shifts);
            rest = band * p.band_heads + in_band - x * p.band_heads;
        } else {
            rest = fast_div(tile, p.q_tiles_magic, p.q_tiles_shifts);
            x = tile - rest * q_tiles;
        }
        const int batch_ = fast_div(rest, p.heads_magic, p.heads_shifts);
        init(p, x, q_tiles, rest - batch_ * p.heads, batch_);
    }

    template <class Params>
    __device__ __forceinline__ void init(const Params& p, int x, int q_tiles, int head_, int batch_) {
        head = head_;
        batch = batch_;
        bh = batch * p.heads + head;
        head_k = fast_div(head, p.group_magic, p.group_shifts);
        // Query tiles vary fastest, so the blocks resident together share one head's K/V in L2;
        // within a head the heaviest (last) tiles go first, so a causal grid ends on short blocks.
        m0 = (q_tiles - 1 - x) * kBlockM;
        causal_offset = p.seqlen_k - p.seqlen_q;
        if constexpr (kLocal) {
            win_left = p.window_left;
            win_right = p.window_right;
        }
        set_range(p.seqlen_k);
        q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride + m0 * p.q_row_stride;
        k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride;
        v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride;
    }

    // The same (batch, head)'s query tile q_tile instead (a block mask's order of work).
    template <class Params>
    __device__ __forceinline__ void move_to(const Params& p, int q_tile) {
        const int new_m0 = q_tile * kBlockM;
        q += static_cast<long long>(new_m0 - m0) * p.q_row_stride;
        m0 = new_m0;
        set_range(p.seqlen_k);
    }

    // The key tiles with a key that some row of the tile sees.
    __device__ __forceinline__ void set_range(int seqlen_k) {
        int n_end = seqlen_k, n_begin = 0;
        if constexpr (kCausal) n_end = min(n_end, m0 + kBlockM + causal_offset);
        if constexpr (kLocal) {
            if (win_right >= 0) n_end = min(n_end, m0 + kBlockM + causal_offset + win_right);
            if (win_left >= 0) n_begin = max(0, m0 + causal_offset - win_left);
        }
        n_first = n_begin / kBlockN;
        n_tiles = n_end > n_begin ? (n_end + kBlockN - 1) / kBlockN - n_first : 0;
    }

    // The tile of packed sequence `batch` (varlen): its lengths from the offsets. A sequence whose
    // offsets fall outside the packed rows or decrease, or with more than p.seqlen_q queries (the
    // longest, which sized the work), has no rows: its tiles are skipped and its rows left as they are.
    // kReread: the offsets are loaded anew (ld_global_reread), not taken from an earlier load.
    template <bool kReread = false, class Params>
    __device__ __forceinline__ void set_sequence(const Params& p, const VarlenArgs& va) {
        auto ld = [](const int* x) { return kReread ? ld_global_reread(x) : *x; };
        const int q0 = ld(va.cu_seqlens_q + batch), q1 = ld(va.cu_seqlens_q + batch + 1);
        const int k0 = ld(va.cu_seqlens_k + batch), k1 = ld(va.cu_seqlens_k + batch + 1);
        const bool valid = varlen_sequence_ok(va, q0, q1, k0, k1) && q1 - q0 <= p.seqlen_q;
        q_start = q0;
        k_start = k0;
        seqlen_q = valid ? q1 - q0 : 0;
        seqlen_k = valid ? k1 - k0 : 0;
        causal_offset = seqlen_k - seqlen_q;
        set_range(seqlen_k);
    }

    // Does key tile starting at n0 need masking (the sequence tail, the causal diagonal, or, kLocal,
    // either edge of the window)?
    __device__ __forceinline__ bool needs_mask(int n0, int seqlen_k) const {
        bool tail = n0 + kBlockN > seqlen_k;
        if constexpr (kCausal) tail = tail || n0 + kBlockN - 1 > m0 + causal_offset;
        if constexpr (kLocal) tail = tail || needs_left_mask(n0) ||
                                     (win_right >= 0 && n0 + kBlockN - 1 > m0 + causal_offset + win_right);
        return tail;
    }
    // kLocal: does key tile n0 hold a key left of the window of the tile's last row?
    __device__ __forceinline__ bool needs_left_mask(int n0) const {
        return kLocal && win_left >= 0 && n0 < m0 + kBlockM - 1 + causal_offset - win_left;
    }
};

// What the warp-specialized kernel's blocks take from the work counter. Values below
// p.dp_tiles are whole work tiles. Without a causal mask, when the tiles would leave the last
// wave of blocks part-empty, the last tiles are instead dealt out by keys: the next p.shares
// values are shares of equal length, share s taking key tiles [s U / shares, (s + 1) U / shares)
// of the U = p.share_units key tiles of the remaining tiles, tile after tile. A share that ends
// inside a tile leaves that piece's unnormalized output in the workspace (kPartialTile, slot
// s + 1); the share that starts inside it merges it into its own piece (kMergeTile, slot s) and
// stores the rows. Each share visits its last piece first and its first piece last, so the piece
// it merges was written at the start of a share taken earlier: no share waits for one that has
// not started. Shares are at least one tile long, so a tile has at most two pieces.
enum : int { kWholeTile = 0, kPartialTile = 1, kMergeTile = 2 };

struct WorkItem {
    int tile;              // work tile, numbered as BlockWork(p, tile, q_tiles) takes it; -1: none left
    int t_begin, t_end;    // its key tiles [t_begin, t_end), in the order the kernel visits them
    int kind, slot;        // kWholeTile, kPartialTile or kMergeTile; the workspace slot of a piece

    // The whole tile (t_end is clamped to its key tiles by the caller).
    __device__ __forceinline__ static WorkItem whole(int tile) { return {tile, 0, 0x7fffffff, kWholeTile, 0}; }

    // Item `index` of share s, in visiting order; false past its last item.
    template <class Params>
    __device__ __forceinline__ bool of_share(const Params& p, int s, int index, int n_kt) {
        const int begin = static_cast<int>(static_cast<long long>(s) * p.share_units / p.shares);
        const int end = static_cast<int>(static_cast<long long>(s + 1) * p.share_units / p.shares);
        const int first_whole = (begin + n_kt - 1) / n_kt, end_whole = end / n_kt;
        const bool tail_piece = end % n_kt != 0, head_piece = begin % n_kt != 0;
        if (tail_piece && index-- == 0) {
            *this = {p.dp_tiles + end / n_kt, 0, end % n_kt, kPartialTile, s + 1};
            return true;
        }
        if (index < end_whole - first_whole) {
            *this = whole(p.dp_tiles + first_whole + index);
            return true;
        }
        if (head_piece && index == end_whole - first_whole) {
            *this = {p.dp_tiles + begin / n_kt, begin % n_kt, n_kt, kMergeTile, s};
            return true;
        }
        return false;
    }
};

// Copy kRows rows of kChunksPerRow 16-byte chunks with cp.async, thread `tid` of kThreads taking
// every kThreads-th chunk; smem_offset(row, chunk) places a chunk in the tile. Rows at or past
// rows_valid are zero-filled, and so are the chunks at or past kChunksValid of every row (a
// tile padded past the head dim). kRolled keeps the loop rolled (for threads short of registers).
template <int kRows, int kChunksPerRow, int kThreads, bool kRolled = false, int kChunksValid = kChunksPerRow,
          class SmemOffset>
__device__ __forceinline__ void copy_rows_async(SmemOffset smem_offset, u32 smem_tile,
                                                const unsigned short* gmem, long long row_stride,
                                                int rows_valid, int tid) {
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll (kRolled ? 1 : (kChunks + kThreads - 1) / kThreads)
    for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        if (kChunks % kThreads == 0 || idx < kChunks) {
            const int row = idx / kChunksPerRow;
            const int chunk = idx % kChunksPerRow;
            const bool valid = row < rows_valid && (kChunksValid == kChunksPerRow || chunk < kChunksValid);
            const unsigned short* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
            cp_async_16(smem_tile + smem_offset(row, chunk), src, valid);
        }
    }
}

// Copy kRows rows of one head (kChunksPerRow 16-byte chunks each) into a padded shared tile
// (row pitch Cfg::kSmemRowBytes), the block's Cfg::kWarps warps sharing the copies.
// Rows at or past rows_valid are zero-filled.
template <class Cfg, int kRows>
__device__ __forceinline__ void load_tile_async(u32 smem_tile, const unsigned short* gmem,
                                                long long row_stride, int rows_valid, int tid) {
    constexpr int kThreads = Cfg::kWarps * 32;
    constexpr int kChunks = kRows * Cfg::kChunksPerRow;
    if constexpr (kThreads % Cfg::kChunksPerRow == 0 && kChunks % kThreads == 0) {
        // Each thread keeps one chunk column and steps down the tile kRowsPerStep rows at a time:
        // one pointer add per copy.
        constexpr int kRowsPerStep = kThreads / Cfg::kChunksPerRow;
        const int row0 = tid / Cfg::kChunksPerRow;
        const int chunk = tid % Cfg::kChunksPerRow;
        const unsigned short* src = gmem + row0 * row_stride + chunk * 8;
        const u32 dst = smem_tile + row0 * Cfg::kSmemRowBytes + chunk * 16;
#pragma unroll
        for (int it = 0; it < kChunks / kThreads; ++it) {
            const int row = row0 + it * kRowsPerStep;
            const bool valid = row < rows_valid;
            cp_async_16(dst + it * kRowsPerStep * Cfg::kSmemRowBytes,
                        valid ? src + it * kRowsPerStep * row_stride : gmem, valid);
        }
    } else {
        auto padded = [](int row, int chunk) { return u32(row * Cfg::kSmemRowBytes + chunk * 16); };
        copy_rows_async<kRows, Cfg::kChunksPerRow, kThreads>(padded, smem_tile, gmem, row_stride, rows_valid, tid);
    }
}

}  // namespace cuflash
