// V's FP8 codes -> the V^T operand of the Hopper FP8 kernel (cuflash.fp8.v_operand): for each
// (batch, head), out[d][slot] with the keys padded to whole groups of 16 (zero codes) and, in
// each group, slot 4t + 2b + e holding key 8b + 2t + e.
//
// One block of 256 threads moves a tile of 64 keys by 64 head-dim columns through shared
// memory: rows are read as 16-byte chunks along the head dim and written as 16-byte chunks
// along the keys, so both sides are coalesced. Rows must be 16-byte aligned (the caller copies
// a view that is not).
#pragma once
#include "cuflash/ptx.cuh"

extern "C" __global__ void __launch_bounds__(256)
cuflash_fp8_v_operand(const unsigned char* __restrict__ v, unsigned char* __restrict__ out, int heads, int seqlen,
                      int head_dim, int keys_padded, long long batch_stride, long long head_stride,
                      long long row_stride) {
    __shared__ unsigned char tile[64][64 + 16];  // [key][column]; the pad staggers banks
    const int bh = blockIdx.z, batch = bh / heads, head = bh % heads;
    const int k0 = blockIdx.x * 64, d0 = blockIdx.y * 64;
    const int tid = threadIdx.x;
    const unsigned char* src = v + batch * batch_stride + head * head_stride;

    {   // read: thread -> key k0 + tid/4, columns d0 + 16*(tid%4) ..
        const int key = k0 + tid / 4, col = d0 + 16 * (tid % 4);
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (key < seqlen && col < head_dim)
            chunk = *reinterpret_cast<const uint4*>(src + key * row_stride + col);
        *reinterpret_cast<uint4*>(&tile[tid / 4][16 * (tid % 4)]) = chunk;
    }
    __syncthreads();
    // write: thread -> column d0 + tid/4, the 16-key group g = tid%4 of the tile
    const int col = d0 + tid / 4, g = tid % 4;
    if (col >= head_dim || k0 + 16 * g >= keys_padded) return;
    unsigned int words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // word w = slots 4w .. 4w+3 = t = w: keys 2w, 2w+1, 8+2w, 9+2w
        const unsigned char* c = &tile[16 * g][tid / 4];
        const unsigned int b0 = c[(2 * w) * 80], b1 = c[(2 * w + 1) * 80];
        const unsigned int b2 = c[(8 + 2 * w) * 80], b3 = c[(9 + 2 * w) * 80];
        words[w] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
    }
    unsigned char* dst = out + (static_cast<long long>(bh) * head_dim + col) * keys_padded + k0 + 16 * g;
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}
