"""The kernels' parameter blocks: one list of fields each, the single definition of its layout.

Every kernel takes one struct by value. The template renders the C struct from these lists and
the launcher packs a byte string with the same layout (:data:`FORWARD_STRUCT`,
:data:`BACKWARD_STRUCT`). 8-byte fields come first so neither side inserts padding.
"""
from __future__ import annotations

import struct

PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k", "const void*", "u8"), ("v", "const void*", "u8"),
    ("o", "void*", "u8"), ("lse", "float*", "u8"),
    ("tile_counter", "int*", "u8"),  # warp-specialized kernel: [next work tile, blocks done], zero between launches
    # warp-specialized kernel, tiles dealt out by keys (launch.split_plan): the pieces' states
    # and their flags (zero between launches)
    ("split_ws", "float*", "u8"), ("split_flags", "int*", "u8"),
    # FP8 inputs: descale factors, per tensor (strides 0) or per (batch, head); q's over query
    # heads, k's and v's over key/value heads
    ("q_descale", "const float*", "u8"), ("k_descale", "const float*", "u8"), ("v_descale", "const float*", "u8"),
    # KernelSpec.sinks: float32 [heads], each query head's sink logit (natural units)
    ("sinks", "const float*", "u8"),
    ("q_batch_stride", "long long", "i8"), ("q_head_stride", "long long", "i8"), ("q_row_stride", "long long", "i8"),
    ("k_batch_stride", "long long", "i8"), ("k_head_stride", "long long", "i8"), ("k_row_stride", "long long", "i8"),
    ("v_batch_stride", "long long", "i8"), ("v_head_stride", "long long", "i8"), ("v_row_stride", "long long", "i8"),
    ("o_batch_stride", "long long", "i8"), ("o_head_stride", "long long", "i8"), ("o_row_stride", "long long", "i8"),
    ("heads", "int", "i4"), ("group", "int", "i4"),          # query heads; query heads per kv head
    ("seqlen_q", "int", "i4"), ("seqlen_k", "int", "i4"),
    ("scale_log2", "float", "f4"), ("batch", "int", "i4"),   # softmax scale * log2(e)
    ("q_descale_batch_stride", "int", "i4"), ("q_descale_head_stride", "int", "i4"),
    ("kv_descale_batch_stride", "int", "i4"), ("kv_descale_head_stride", "int", "i4"),
    # warp-specialized kernel: work counter values below dp_tiles are whole tiles, the next
    # `shares` values shares of the share_units key tiles of the remaining tiles (block.cuh)
    ("dp_tiles", "int", "i4"), ("shares", "int", "i4"), ("share_units", "int", "i4"),
    # Division without a divide instruction (launch.divider, ptx.cuh fast_div) by the query tiles
    # per head (warp-specialized kernel), the query heads and the query heads per kv head
    ("q_tiles_magic", "unsigned", "u4"), ("q_tiles_shifts", "int", "i4"),
    ("heads_magic", "unsigned", "u4"), ("heads_shifts", "int", "i4"),
    ("group_magic", "unsigned", "u4"), ("group_shifts", "int", "i4"),
    # warp-specialized kernel with a causal mask: (batch, head) pairs per band of work tiles
    # (launch.band_heads), and division by the band's tiles and by its pairs
    ("band_heads", "int", "i4"), ("band_tiles_magic", "unsigned", "u4"), ("band_tiles_shifts", "int", "i4"),
    ("band_heads_magic", "unsigned", "u4"), ("band_heads_shifts", "int", "i4"),
    # warp-specialized kernel with KernelSpec.local: keys a query at position i (bottom-right
    # aligned) sees, i - window_left .. i + window_right (negative: unbounded)
    ("window_left", "int", "i4"), ("window_right", "int", "i4"),
)


#: The backward kernels' parameter block (same conventions as PARAM_FIELDS). lse2 and delta hold
#: ``rows_padded`` rows per head (seqlen_q rounded up to whole query tiles); so does the float32
#: dq accumulator, [batch, heads, rows_padded, head_dim].
BWD_PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k", "const void*", "u8"), ("v", "const void*", "u8"),
    ("o", "const void*", "u8"), ("dout", "const void*", "u8"), ("lse", "const float*", "u8"),
    ("dq", "void*", "u8"), ("dk", "void*", "u8"), ("dv", "void*", "u8"),
    ("dq_accum", "float*", "u8"), ("lse2", "float*", "u8"), ("delta", "float*", "u8"),
    # ordered dQ (BwdSpec.ordered_dq): per (batch, query head, query tile of block_m rows) the key
    # tiles that have added into that dQ tile; zeroed by the preprocess
    ("dq_sem", "int*", "u8"),
) + tuple(
    (f"{t}_{s}_stride", "long long", "i8") for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
    for s in ("batch", "head", "row")
) + (
    ("heads", "int", "i4"), ("group", "int", "i4"), ("seqlen_q", "int", "i4"), ("seqlen_k", "int", "i4"),
    ("rows_padded", "int", "i4"), ("scale", "float", "f4"), ("scale_log2", "float", "f4"),
    # BwdSpec.local: the window's bounds, as the forward's window_left / window_right
    ("window_left", "int", "i4"), ("window_right", "int", "i4"), ("_pad", "int", "i4"),
)

#: The KV-cache kernels' parameter block (decode.cuh; same conventions). Cache strides are in
#: elements; k_batch_stride / v_batch_stride step over sequences, or with a page table over pages.
#: The partials of a split launch are float32 [splits, batch, heads, seqlen_q, head_dim] and
#: [splits, batch, heads, seqlen_q].
DECODE_PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k_cache", "const void*", "u8"), ("v_cache", "const void*", "u8"),
    ("k_new", "const void*", "u8"), ("v_new", "const void*", "u8"),
    ("out", "void*", "u8"), ("lse", "float*", "u8"), ("o_part", "float*", "u8"), ("lse_part", "float*", "u8"),
    ("split_counts", "unsigned*", "u8"),  # splits finished per row tile (zero between launches)
    ("page_table", "const int*", "u8"), ("cache_seqlens", "const int*", "u8"),
    ("cache_leftpad", "const int*", "u8"),  # each sequence's first key in a contiguous cache, null: 0
    # FP8 caches: descales per kv head (descale_head_stride 1) or per tensor (0); null: 1
    ("k_descale", "const float*", "u8"), ("v_descale", "const float*", "u8"),
    # varlen: packed sequences, int32 [batch + 1] offsets into q and k/v (total_q, total_k rows)
    ("cu_seqlens_q", "const int*", "u8"), ("cu_seqlens_k", "const int*", "u8"),
    ("sinks", "const float*", "u8"),  # attention sinks: a logit per query head, null for none
) + tuple(
    (f"{t}_{s}_stride", "long long", "i8") for t in ("q", "k", "v", "kn", "vn", "o") for s in ("batch", "row", "head")
) + (
    ("batch", "int", "i4"), ("heads", "int", "i4"), ("heads_k", "int", "i4"), ("group", "int", "i4"),
    ("seqlen_q", "int", "i4"), ("seqlen_new", "int", "i4"),
    ("capacity", "int", "i4"),        # keys one sequence's cache holds
    ("page_size", "int", "i4"), ("page_shift", "int", "i4"),  # log2(page_size), or -1
    ("num_pages", "int", "i4"), ("page_table_stride", "int", "i4"),
    ("num_splits", "int", "i4"),
    ("merge_apart", "int", "i4"),  # 1: the merge kernel merges the splits, 0: each row tile's last split
    ("descale_head_stride", "int", "i4"),
    # keys a query at position i sees: i - window_left .. i + window_right (negative: unbounded;
    # causal: window_right 0)
    ("window_left", "int", "i4"), ("window_right", "int", "i4"),
    ("softcap_log2", "float", "f4"),  # softcap * log2(e), 0 for none
    ("scale_log2", "float", "f4"),    # softmax scale * log2(e) (e4m3: times 2^8)
    ("out_scale", "float", "f4"),     # the output's factor (e4m3: 2^8)
    ("total_q", "int", "i4"), ("total_k", "int", "i4"),
)

_FORMATS = {"u8": "Q", "i8": "q", "u4": "I", "i4": "i", "f4": "f"}

#: Packers of the forward, backward and KV-cache parameter blocks (little-endian, no padding).
FORWARD_STRUCT = struct.Struct("<" + "".join(_FORMATS[fmt] for _, _, fmt in PARAM_FIELDS))
BACKWARD_STRUCT = struct.Struct("<" + "".join(_FORMATS[fmt] for _, _, fmt in BWD_PARAM_FIELDS))
DECODE_STRUCT = struct.Struct("<" + "".join(_FORMATS[fmt] for _, _, fmt in DECODE_PARAM_FIELDS))
