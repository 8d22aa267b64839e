/* Hopper (sm_90a) device helpers of the wgmma prefill kernel
 * (cuda_attention_hopper.cu): the 128-byte-swizzled shared-memory layout and the
 * wgmma descriptors of it, mbarriers, proxy fences, named barriers, setmaxnreg and
 * the wgmma instructions. Include after cuda_internal.h and cuda_mma.cuh; the
 * helpers exist only in the sm_90a pass (__CUDA_ARCH_FEAT_SM90_ALL). */
#ifndef KVS_CUDA_WGMMA_CUH
#define KVS_CUDA_WGMMA_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* Byte offset of 16-byte chunk c (0 .. D/8 - 1) of row r in a swizzled tile of
 * `rows` rows: [D/64 column blocks][rows][128 B], chunk c of a row at chunk
 * c ^ (r % 8) of it (the 128-byte swizzle, Swizzle<3,4,3> on byte addresses;
 * every tile 1024-byte aligned; TMA's CU_TENSOR_MAP_SWIZZLE_128B layout). */
__device__ __forceinline__ uint32_t kvs_wg_swz(int rows, int r, int c) {
    return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* wgmma shared-memory matrix descriptor, 128-byte swizzle, SBO 1024 (or sbo). */
__device__ __forceinline__ uint64_t kvs_wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo = 1024) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

/* The bf16 d128 prefill's K/V tile layout (what its TMA boxes write: kvs_wg_unit_map):
 * [8-row group][2 column blocks][8 rows][128 B], a 1 KiB 128-byte-swizzled atom a group
 * and column block (a 16-key unit: 4 KiB): byte offset of 16-byte chunk c (0 .. 15) of
 * row r. wgmma descriptors on it: K-major SBO 2048 (the next 8 rows), column block
 * +1024; N-major LBO 1024 (the next 64 columns), SBO 2048 (the next 8 keys). */
__device__ __forceinline__ uint32_t kvs_wg_swz_units(int r, int c) {
    return (uint32_t)((r >> 3) * 2048 + (c >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* ---- mbarriers (CTA scope) ------------------------------------------------------ */
__device__ __forceinline__ void kvs_mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* the inits visible to the other threads and to the async proxy (TMA's complete_tx) */
__device__ __forceinline__ void kvs_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* arrive (release) */
__device__ __forceinline__ void kvs_mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* arrive (release) and announce `bytes` more of asynchronous writes (TMA complete_tx)
   the current phase waits for */
__device__ __forceinline__ void kvs_mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/* box at (0, 0, 0, c3) of a 4D tensor map -> shared dst; complete_tx on bar */
__device__ __forceinline__ void kvs_tma_load_4d(uint32_t dst, const void *map, int c3, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %2, %2, %3}], "
        "[%4];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(0), "r"(c3), "r"(bar)
        : "memory");
}
/* waits (acquire) until the phase of the given parity has completed */
__device__ __forceinline__ void kvs_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

/* generic-proxy writes to shared memory (cp.async, st.shared) -> visible to the async proxy (wgmma) */
__device__ __forceinline__ void kvs_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void kvs_named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* arrive on named barrier id (of `threads` in all) without waiting */
__device__ __forceinline__ void kvs_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* 16 bytes from / to shared memory (a shared-window address) */
__device__ __forceinline__ uint4 kvs_lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ void kvs_sts128(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/* ---- setmaxnreg --------------------------------------------------------------- */
/* the warpgroup's registers a thread (every thread of the warpgroup executes it) */
template <int N>
__device__ __forceinline__ void kvs_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void kvs_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* ---- wgmma --------------------------------------------------------------------- */
__device__ __forceinline__ void kvs_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kvs_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kvs_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* keeps the compiler from moving accesses of wgmma registers across the wait */
template <int N>
__device__ __forceinline__ void kvs_wg_fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

/* the accumulator operands "+f"(d[0]) .. and their names %0 .. in the asm */
#define KVS_WG_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define KVS_WG_ACC16(i) KVS_WG_ACC4(i), KVS_WG_ACC4(i + 4), KVS_WG_ACC4(i + 8), KVS_WG_ACC4(i + 12)
#define KVS_WG_ACC32 KVS_WG_ACC16(0), KVS_WG_ACC16(16)
#define KVS_WG_ACC64 KVS_WG_ACC32, KVS_WG_ACC16(32), KVS_WG_ACC16(48)
#define KVS_WG_ACC88 KVS_WG_ACC64, KVS_WG_ACC16(64), KVS_WG_ACC4(80), KVS_WG_ACC4(84)
#define KVS_WG_D32                                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KVS_WG_D88                                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
        "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
        "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
        "%86, %87}"
#define KVS_WG_D64                                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "  \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/* wgmma m64nNk16, bf16 x bf16 -> f32, N = 64 or 128 (N / 2 accumulators a thread):
 * D = A B (accumulate 0) or D += A B (accumulate 1). ss: A and B from shared memory
 * (descriptors, both K-major). rs: A from registers (4 x bf16x2, the m16n8k16
 * A-fragment layout per warp, rows 16 x warp), B from shared memory N-major
 * (imm-trans-b 1). Accumulator d[4 j + 2 h + c]: row 16 x warp + lane / 4 + 8 h,
 * column 8 j + 2 (lane % 4) + c. */
template <int N>
__device__ __forceinline__ void kvs_wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 64 || N == 128 || N == 176, "N 64, 128 or 176");
    if constexpr (N == 176)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 " KVS_WG_D88 ", %88, %89, p, 1, 1, 0, 0;\n}\n"
                     : KVS_WG_ACC88
                     : "l"(a), "l"(b), "r"(accumulate));
    else if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KVS_WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : KVS_WG_ACC32
                     : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KVS_WG_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : KVS_WG_ACC64
                     : "l"(a), "l"(b), "r"(accumulate));
}
template <int N>
__device__ __forceinline__ void kvs_wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    static_assert(N == 64 || N == 128, "N 64 or 128");
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KVS_WG_D32
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : KVS_WG_ACC32
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KVS_WG_D64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : KVS_WG_ACC64
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#undef KVS_WG_ACC4
#undef KVS_WG_ACC16
#undef KVS_WG_ACC32
#undef KVS_WG_ACC64
#undef KVS_WG_ACC88
#undef KVS_WG_D32
#undef KVS_WG_D64
#undef KVS_WG_D88

#endif /* __CUDA_ARCH_FEAT_SM90_ALL */
#endif
