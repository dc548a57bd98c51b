// Rotary position embeddings of the KV-cache call (cuflash.core.rotary): x [batch, seqlen, heads,
// head_dim] -> out, C-contiguous, with the first 2 * half dims rotated by the cos / sin tables
// [seqlen_ro, half] at each token's position, computed in float32 and rounded once.
//
// Token s of sequence b sits at lens[b * lens_stride] + first + s (per_token), or at
// lens[b * lens_stride] for every token; positions are clamped into the table. The pairs are
// (j, j + half), or (2j, 2j + 1) when interleaved. One thread per pair of dims: pair j < half is
// rotated, the pairs past it are copied. One flat grid over batch * seqlen * heads * head_dim / 2.
// The element types come from the module's options: CUFLASH_ROTARY_BF16 (else float16) for x and
// out, CUFLASH_ROTARY_TABLE 0 / 1 / 2 for float16 / bfloat16 / float32 tables; 16-bit values are
// passed as their bits and converted by PTX (no CUDA headers).
#pragma once

typedef unsigned short cuflash_rotary_t;  // float16 or bfloat16 bits
#if CUFLASH_ROTARY_TABLE == 2
typedef float cuflash_rotary_table_t;
#else
typedef unsigned short cuflash_rotary_table_t;
#endif

template <bool Bf16>
__device__ __forceinline__ float cuflash_rotary_float(unsigned short x) {
    if (Bf16) return __uint_as_float(static_cast<unsigned>(x) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
template <bool Bf16>
__device__ __forceinline__ float cuflash_rotary_float(float x) { return x; }
template <bool Bf16>
__device__ __forceinline__ unsigned short cuflash_rotary_round(float x) {
    unsigned short r;
    if (Bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
#ifdef CUFLASH_ROTARY_BF16
#define CUFLASH_ROTARY_X_BF16 true
#else
#define CUFLASH_ROTARY_X_BF16 false
#endif
#define CUFLASH_ROTARY_TABLE_BF16 (CUFLASH_ROTARY_TABLE == 1)

extern "C" __global__ void __launch_bounds__(256)
cuflash_rotary(const cuflash_rotary_t* __restrict__ x, cuflash_rotary_t* __restrict__ out,
               const cuflash_rotary_table_t* __restrict__ cos_table,
               const cuflash_rotary_table_t* __restrict__ sin_table, const int* __restrict__ lens,
               int lens_stride, int seqlen, int heads, int head_dim, int half, int seqlen_ro, int first,
               int per_token, int interleaved, long long batch_stride, long long token_stride,
               long long head_stride, long long pairs) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    const int pairs_per_head = head_dim / 2;
    const int j = static_cast<int>(i % pairs_per_head);
    const long long row = i / pairs_per_head;  // (b * seqlen + s) * heads + h
    const int h = static_cast<int>(row % heads);
    const long long bs = row / heads;
    const int s = static_cast<int>(bs % seqlen);
    const long long b = bs / seqlen;
    const cuflash_rotary_t* src = x + b * batch_stride + s * token_stride + h * head_stride;
    cuflash_rotary_t* dst = out + row * head_dim;
    if (j >= half) {  // past the rotary dims: copied
        const int d = 2 * j;
        dst[d] = src[d];
        dst[d + 1] = src[d + 1];
        return;
    }
    long long pos = static_cast<long long>(lens[b * lens_stride]) + (per_token ? first + s : 0);
    pos = pos < 0 ? 0 : (pos >= seqlen_ro ? seqlen_ro - 1 : pos);
    const float c = cuflash_rotary_float<CUFLASH_ROTARY_TABLE_BF16>(cos_table[pos * half + j]);
    const float sn = cuflash_rotary_float<CUFLASH_ROTARY_TABLE_BF16>(sin_table[pos * half + j]);
    const int d1 = interleaved ? 2 * j : j, d2 = interleaved ? 2 * j + 1 : j + half;
    const float x1 = cuflash_rotary_float<CUFLASH_ROTARY_X_BF16>(src[d1]);
    const float x2 = cuflash_rotary_float<CUFLASH_ROTARY_X_BF16>(src[d2]);
    // each product and sum rounded on its own (no fused multiply-add): NumPy's float32 rotation, bit for bit
    dst[d1] = cuflash_rotary_round<CUFLASH_ROTARY_X_BF16>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn)));
    dst[d2] = cuflash_rotary_round<CUFLASH_ROTARY_X_BF16>(__fadd_rn(__fmul_rn(x1, sn), __fmul_rn(x2, c)));
}
