// Thin wrappers over the PTX instructions the forward kernels use (sm_80 and newer).
// No CUDA headers are included: 16-bit floats travel as raw bits and are converted with
// cvt instructions, so the generated source compiles under NVRTC with no toolkit headers.
#pragma once

namespace cuflash {

typedef unsigned int u32;
typedef unsigned long long u64;

// A compile-time flag passed as an argument (to generic lambdas).
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

__device__ __forceinline__ u32 smem_addr(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Natural-log values (logits, LSE) to the kernels' base-2 units and back.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// threadIdx.x, read where the call stands: the compiler neither reuses an earlier read nor
// computes what derives from it ahead of the code before the call.
__device__ __forceinline__ int thread_index_reread() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// A global int read that the compiler cannot merge with an earlier read of it, so that a value
// needed before and after a long loop is loaded twice instead of held (or spilled) across it.
__device__ __forceinline__ int ld_global_reread(const int* p) {
    int v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// 2^x with the special-function unit; ex2.approx(-inf) is +0, which the masking relies on.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// n / d for the (magic, shifts) that launch.divider computed for d: a multiply-high, two shifts
// and two adds instead of a division's ~20 dependent instructions.
__device__ __forceinline__ int fast_div(int n, unsigned magic, int shifts) {
    const unsigned t = __umulhi(magic, static_cast<unsigned>(n));
    return static_cast<int>((t + ((static_cast<unsigned>(n) - t) >> (shifts & 0xff))) >> (shifts >> 8));
}

// log2(x) with the special-function unit (absolute error below 2^-22 on the mantissa's range).
__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One 32-bit word of shared memory by its shared-space address.
__device__ __forceinline__ void st_shared(u32 addr, int value) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ int ld_shared(u32 addr) {
    int value;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
    return value;
}
// 8 (16) bytes of shared memory by an 8 (16) byte aligned shared-space address.
__device__ __forceinline__ void ld_shared_v2(u32 (&r)[2], u32 addr) {
    asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ld_shared_v4(u32 (&r)[4], u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// A flag in global memory, written and read across blocks (release / acquire at gpu scope).
__device__ __forceinline__ void st_release(int* flag, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* flag) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
    return value;
}
__device__ __forceinline__ void red_relaxed_add(int* counter, int value) {
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" :: "l"(counter), "r"(value) : "memory");
}

// ---- asynchronous copies (global -> shared, 16 bytes, bypassing L1) ----
// When `valid` is false nothing is read and the 16 bytes are zero-filled, so tile rows past the
// end of a sequence hold zeros (not stale data that could be NaN).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 8 bytes (cp.async.cg moves 16 only; .ca also 4 and 8), for rows that are not whole 16-byte chunks.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes, for per-row statistics that start at any row.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// ---- shared memory -> registers, in the fragment layouts of mma.m16n8k16 ----
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// ---- registers -> shared memory: four 8 x 8 16-bit matrices, lane i addressing row i % 8 of
// matrix i / 8 (sm_90) ----
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x1(u32& r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---- tensor-core MMA, fp32 accumulate: D = A * B + D ----
// kBF16 picks the operand type; fp16 and bf16 differ only in the mnemonic.
template <bool kBF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (kBF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// k = 8 variant, for the last 8 columns of head dims that are not a multiple of 16.
template <bool kBF16>
__device__ __forceinline__ void mma_1688(float (&d)[4], u32 a0, u32 a1, u32 b0) {
    if constexpr (kBF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
    }
}

// Two floats -> two 16-bit floats in one register (round to nearest even); `lo` is the
// element at the lower address / lower column.
template <bool kBF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (kBF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// Four floats -> four float8 e4m3 codes in one register, byte i from b_i (round to nearest even,
// saturating to +-448). cvt's first source goes to the high byte of each pair. sm_89 and later.
__device__ __forceinline__ u32 pack4_e4m3(float b0, float b1, float b2, float b3) {
    u32 r;
    asm("{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(r) : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
    return r;
}

// The inverse of pack2: one register of two 16-bit floats -> two floats (exact).
template <bool kBF16>
__device__ __forceinline__ void unpack2(u32 r, float& lo, float& hi) {
    if constexpr (kBF16) {
        lo = __uint_as_float(r << 16);
        hi = __uint_as_float(r & 0xffff0000u);
    } else {
        asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n }"
            : "=f"(lo), "=f"(hi) : "r"(r));
    }
}

// Butterfly reductions over the 4 lanes of a quad (lanes that share a row of an mma fragment).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A 4 x 4 transpose across the lanes of a quad: lane t holds v[j] = row t, column j on entry
// and row j, column t on return (two butterfly steps, four shuffles). Every lane of the warp
// must take part.
__device__ __forceinline__ void quad_transpose(u32 (&v)[4], int lane) {
    const bool hi = lane & 2, lo = lane & 1;
    // Step 1, with lane t ^ 2: swap the 2 x 2 blocks off the diagonal.
    u32 r0 = __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 2);
    u32 r1 = __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 2);
    if (hi) { v[0] = r0; v[1] = r1; } else { v[2] = r0; v[3] = r1; }
    // Step 2, with lane t ^ 1: transpose within each 2 x 2 block.
    r0 = __shfl_xor_sync(0xffffffffu, lo ? v[0] : v[1], 1);
    r1 = __shfl_xor_sync(0xffffffffu, lo ? v[2] : v[3], 1);
    if (lo) { v[0] = r0; v[2] = r1; } else { v[1] = r0; v[3] = r1; }
}

// 16 bytes to global memory (a 16-byte aligned address).
__device__ __forceinline__ void st_global_v4(void* ptr, const u32 (&v)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" :: "l"(ptr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}

// Two adjacent float32 additions into global memory (the backward's dQ accumulator). Hopper has
// a vector reduction; older targets issue two.
__device__ __forceinline__ void atomic_add2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(addr, a);
    atomicAdd(addr + 1, b);
#endif
}

// Butterfly reductions over aligned groups of kWidth lanes (a power of two).
template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int w = 1; w < kWidth; w *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, w));
    return x;
}
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int w = 1; w < kWidth; w *= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
    return x;
}

}  // namespace cuflash
