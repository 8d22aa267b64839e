/* Tensor-core device helpers shared by the attention and SnapKV-score kernels
 * (internal to src/backend/cuda): mma.sync m16n8k16 bf16 (and f16), ldmatrix, cp.async,
 * movmatrix, exp2 and bf16 / f16 packing. Include after cuda_internal.h. */
#ifndef KVS_CUDA_MMA_CUH
#define KVS_CUDA_MMA_CUH

#include <stdint.h>

#define KVS_LOG2E 1.4426950408889634f
#define KVS_LN2 0.6931471805599453f

__device__ __forceinline__ uint32_t kvs_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16-byte async copy global -> shared; zero fill when !valid (src must still be a
 * valid address). */
__device__ __forceinline__ void kvs_cp_async16(uint32_t dst, const void *src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
/* N = 4 or 8 bytes through L1 (.cg takes 16 only); 16: kvs_cp_async16 */
template <int N>
__device__ __forceinline__ void kvs_cp_async_n(uint32_t dst, const void *src, bool valid) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
    if (N == 16) kvs_cp_async16(dst, src, valid);
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(valid ? N : 0)
                      : "memory");
}
__device__ __forceinline__ void kvs_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kvs_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void kvs_ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                                uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void kvs_ldmatrix_x4_trans(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                                      uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

/* The 8x8 b16 matrix whose row lane / 4, columns 2 (lane % 4) and + 1 this lane
 * holds (the lower column in the lower half), transposed, in the same layout. */
__device__ __forceinline__ uint32_t kvs_movmatrix_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* c += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulators */
__device__ __forceinline__ void kvs_mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* c += a (16x16 f16, row) * b (16x8 f16, col), fp32 accumulators (the FP8 decode kernel) */
__device__ __forceinline__ void kvs_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float kvs_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t kvs_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
__device__ __forceinline__ uint32_t kvs_pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}

#endif
