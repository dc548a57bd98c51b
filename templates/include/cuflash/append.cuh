// New keys and values written into a KV cache by slot (cuflash.append_kv): token t's rows of k
// and v [tokens, heads_k, head_dim] go to slot slots[t] of the caches, seen as num_slots rows of
// [heads_k, head_dim] (slot = page * page_size + row of a paged cache, b * max_seqlen + position
// of a contiguous one). A slot below 0 or past the caches is skipped: nothing outside them is
// written. One thread per 16-byte chunk of a (token, head) row; rows are 16-byte aligned (the
// caller checks), so each chunk is one vector load and store. One flat grid over tokens x
// heads_k x chunks.
#pragma once

extern "C" __global__ void __launch_bounds__(256)
cuflash_append_kv(const unsigned char* __restrict__ k, const unsigned char* __restrict__ v,
                  unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                  const int* __restrict__ slots, int heads_k, int chunks, long long num_slots,
                  int page_size, long long k_page_stride, long long k_row_stride, long long k_head_stride,
                  long long v_page_stride, long long v_row_stride, long long v_head_stride,
                  long long new_token_stride, long long new_head_stride, long long items) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= items) return;
    const int chunk = static_cast<int>(i % chunks);
    const long long row = i / chunks;  // token * heads_k + head
    const int head = static_cast<int>(row % heads_k);
    const long long token = row / heads_k;
    const long long slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    const long long page = slot / page_size, within = slot - page * page_size;
    const long long src = token * new_token_stride + head * new_head_stride + 16LL * chunk;
    const uint4 kx = *reinterpret_cast<const uint4*>(k + src);
    const uint4 vx = *reinterpret_cast<const uint4*>(v + src);
    *reinterpret_cast<uint4*>(k_cache + page * k_page_stride + within * k_row_stride + head * k_head_stride
                              + 16LL * chunk) = kx;
    *reinterpret_cast<uint4*>(v_cache + page * v_page_stride + within * v_row_stride + head * v_head_stride
                              + 16LL * chunk) = vx;
}
