// V's FP8 codes -> the V^T operand of the Hopper FP8 kernel (cuflash.fp8.v_operand): for each
// (batch, head), out[d][slot] with the keys padded to whole groups of 16 (zero codes) and, in
// each group, slot 4t + 2b + e holding key 8b + 2t + e.
//
// A block of 256 threads turns a tile of 128 keys by 128 head-dim columns around, so that both
// sides move whole 128-byte lines: each warp reads four keys' rows of the tile into shared memory
// (16 bytes a lane), then each thread takes 16 keys by 4 columns out as 16 four-byte words,
// byte-permutes every 4 x 4 block of them (the 4 keys of one output word by the 4 columns) and
// writes the 4 columns' 16 keys as one 16-byte word each, 8 lanes filling one column's 128 keys.
// The tile's 16-byte chunks are swizzled by key / 16 (chunk ^ (key / 16 % 8)): the 16 keys x 4
// columns reads of a warp then fall in 32 distinct banks. Rows must be 16-byte aligned (the
// caller copies a view that is not); head_dim is a multiple of 16. One flat grid (blocks of keys
// fastest, then of columns, then batch * heads): no grid dimension limits the number of heads.
#pragma once

extern "C" __global__ void __launch_bounds__(256)
cuflash_fp8_v_operand(const unsigned char* __restrict__ v, unsigned char* __restrict__ out, int heads, int seqlen,
                      int head_dim, int keys_padded, long long batch_stride, long long head_stride,
                      long long row_stride) {
    __shared__ __align__(16) unsigned char tile[128 * 128];  // [key][column]
    const int key_blocks = (keys_padded + 127) / 128, col_blocks = (head_dim + 127) / 128;
    const int key_block = blockIdx.x % key_blocks;
    const int col_block = blockIdx.x / key_blocks % col_blocks;
    const int bh = blockIdx.x / key_blocks / col_blocks, batch = bh / heads, head = bh % heads;
    const int k0 = key_block * 128, d0 = col_block * 128;
    const int t = threadIdx.x;
    const unsigned char* src = v + batch * batch_stride + head * head_stride + d0;
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // chunk c: key k0 + c / 8, columns d0 + 16 (c % 8) ..
        const int c = t + 256 * it, row = c / 8, chunk = c % 8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (k0 + row < seqlen && d0 + 16 * chunk < head_dim)
            x = __ldg(reinterpret_cast<const uint4*>(src + (k0 + row) * row_stride + 16 * chunk));
        *reinterpret_cast<uint4*>(tile + row * 128 + 16 * (chunk ^ (row / 16 % 8))) = x;
    }
    __syncthreads();
    const int g = t % 8, q = t / 8;  // this thread's keys k0 + 16 g .. + 15, columns d0 + 4 q .. + 3
    const int col = d0 + 4 * q, key0 = k0 + 16 * g;
    if (col >= head_dim || key0 >= keys_padded) return;
    unsigned int row[16];  // key key0 + j: columns col .. col + 3
#pragma unroll
    for (int j = 0; j < 16; ++j)
        row[j] = *reinterpret_cast<const unsigned int*>(tile + (16 * g + j) * 128 + 16 * ((q / 4) ^ g) + 4 * (q % 4));
    // Output word w of a column holds slots 4w .. 4w+3: keys 2w, 2w+1, 8+2w, 9+2w (byte 0 first).
    unsigned int words[4][4];  // [column col + i][word w]
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const unsigned int a = row[2 * w], b = row[2 * w + 1], c = row[8 + 2 * w], d = row[9 + 2 * w];
        const unsigned int ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);  // a0 b0 a1 b1, a2 b2 a3 b3
        const unsigned int cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
        words[0][w] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
        words[1][w] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
        words[2][w] = __byte_perm(ab_hi, cd_hi, 0x5410);
        words[3][w] = __byte_perm(ab_hi, cd_hi, 0x7632);
    }
    unsigned char* dst = out + (static_cast<long long>(bh) * head_dim + col) * keys_padded + key0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<uint4*>(dst + static_cast<long long>(i) * keys_padded) =
            make_uint4(words[i][0], words[i][1], words[i][2], words[i][3]);
}
