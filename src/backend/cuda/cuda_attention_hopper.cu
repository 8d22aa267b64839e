/* Prefill attention on Hopper's warpgroup MMA (KVS_CUDA_PREFILL_WGMMA; sm_90a,
 * head_dim 64 and 128, bf16 pools). The semantics are cuda_attention.cu's
 * prefill kernels' (backend.h kvs_attn_batch: varlen, chunks after cached
 * entries, causal within the chunk, GQA, LSE as the natural log of the softmax
 * denominator of the scaled scores).
 *
 * Structure (FlashAttention-3's, with cp.async instead of TMA for the paged rows):
 *  - A block owns 128 query rows of one KV group: HEADS query heads of the group
 *    (4 when the group is a multiple of 4, else 2, else 1) x 128 / HEADS
 *    positions, so each K/V tile in shared memory feeds 128 rows. 9 warps:
 *    two consumer warpgroups (warps 0-3 and 4-7, 64 rows each) and one producer
 *    warp (warp 8). No setmaxnreg: 168 registers a thread (one SM sub-partition
 *    holds 3 of the 9 warps), which the consumers' 64 S + 64 O accumulators fit
 *    without spills (ptxas: 166).
 *  - The producer streams 128-key K and V tiles (8 paged blocks of 16 entries;
 *    rows past the block's last key zero-filled) through a STAGES-deep ring with
 *    16-byte cp.async, writing the 128-byte-swizzled layout wgmma reads. Per
 *    tile, each producer lane waits for its own copies (cp.async.wait_group),
 *    fences them to the async proxy (fence.proxy.async) and arrives on the
 *    stage's `full` mbarrier (32 arrivals); consumers release a stage through its
 *    `empty` mbarrier (one arrival per consumer warp, 8).
 *  - Each consumer warpgroup: S = Q K^T with wgmma m64n128k16 (Q and K from shared
 *    memory, K-major, 128-byte swizzle), online softmax in registers (row max
 *    over raw scores, one FFMA + ex2 a probability, O rescale skipped by warp vote
 *    when no row max changed), then O += P V with wgmma m64nDk16, P straight
 *    from the S accumulators packed to bf16 (the f32 accumulator layout of a
 *    16-column slice is the A-fragment layout), V from shared memory as the
 *    N-major (transposed) B operand. The two warpgroups run unsynchronized, so
 *    one's softmax overlaps the other's GEMMs where the scheduler allows; with
 *    KVSPARSE_WGMMA_PINGPONG=1 they take turns issuing (named barriers), which
 *    forces that overlap but spills ~190 bytes at head_dim 128 (not the default
 *    until measured).
 *
 * Shared memory (every tile 1024-byte aligned; a "column block" is 64 bf16 =
 * 128 bytes of each row): Q [D/64 column blocks][128 rows][128 B], then STAGES x
 * (K [D/64][128 keys][128 B], V [D/64][128 keys][128 B]), then the mbarriers.
 * 16-byte chunk c (0..7) of row r of a column block is stored at chunk
 * c ^ (r % 8) of that row: the 128-byte swizzle (Swizzle<3,4,3> on byte
 * addresses), which the hardware applies to address bits [4,7) ^ [7,10).
 * Descriptors: K-major (Q, K) start + 32 bytes per k16 step inside a column
 * block, LBO 16 (unused), SBO 1024 (8-row groups); N-major (V) start + 2048
 * bytes per 16 keys, LBO = 128 keys x 128 B (the next 64 head_dim columns), SBO
 * 1024 (the next 8 keys). */
#include <math.h>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mma.cuh"

/* 1 in the sm_90a code of this file, 0 in any other: read by the host to tell
 * whether the device runs the wgmma kernel (a build for other architectures
 * compiles it empty). */
__device__ int kvs_wgmma_built =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    1;
#else
    0;
#endif

#define KVS_WG_BM 128     /* query rows a block (two consumer warpgroups of 64) */
#define KVS_WG_BN 128     /* keys a K/V tile */
#define KVS_WG_THREADS 288 /* 8 consumer warps + the producer warp */

template <int D, int STAGES>
struct kvs_wg_smem {
    static constexpr size_t TILE = (size_t)KVS_WG_BN * D * 2; /* one K (or V) tile */
    static constexpr size_t q = 0, kv = (size_t)KVS_WG_BM * D * 2, bar = kv + (size_t)STAGES * 2 * TILE;
    static constexpr size_t bytes = bar + 2 * STAGES * 8 + 1024; /* + slack to align the base to 1024 */
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* Byte offset of 16-byte chunk c (0 .. D/8 - 1) of row r in a swizzled tile of `rows` rows. */
__device__ __forceinline__ uint32_t kvs_wg_swz(int rows, int r, int c) {
    return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* wgmma shared-memory matrix descriptor, 128-byte swizzle, SBO 1024. */
__device__ __forceinline__ uint64_t kvs_wg_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void kvs_mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* arrive (release, CTA scope); returns the barrier state, which the callers ignore */
__device__ __forceinline__ uint64_t kvs_mbar_arrive(uint32_t bar) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(bar) : "memory");
    return state;
}
/* waits (acquire, CTA scope) until the phase of the given parity has completed */
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
__device__ __forceinline__ void kvs_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* the warpgroups' turns (no memory is handed over: no memory clobber, ordered
   against the wgmma asm's as volatile asm's are) */
__device__ __forceinline__ void kvs_turn_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id)); }
__device__ __forceinline__ void kvs_turn_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id)); }
__device__ __forceinline__ void kvs_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kvs_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kvs_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* keeps the compiler from moving accesses of wgmma accumulators across the wait */
template <int N>
__device__ __forceinline__ void kvs_wg_fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

/* ---- wgmma m64nNk16, bf16 x bf16 -> f32 (N = 64, 128) ----------------------------
 * ss: A and B from shared memory (descriptors, both K-major); _zero: D = A B,
 * otherwise D += A B. rs: A from registers (4 x bf16x2, the m16n8k16 A-fragment
 * layout per warp, rows 16 x warp), B from shared memory N-major (imm-trans-b 1);
 * D += A B. Accumulator d[4 j + 2 h + c]: row 16 x warp + lane / 4 + 8 h, column
 * 8 j + 2 (lane % 4) + c. */
__device__ __forceinline__ void kvs_wgmma_ss_n64_zero(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
                   "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
                   "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
                   "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
                 : "l"(a), "l"(b), "r"(0));
}
__device__ __forceinline__ void kvs_wgmma_ss_n64(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(1));
}
__device__ __forceinline__ void kvs_wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
__device__ __forceinline__ void kvs_wgmma_ss_n128_zero(float (&d)[64], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, "
                 "%40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
                   "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
                   "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
                   "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]),
                   "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]),
                   "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]),
                   "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]),
                   "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
                 : "l"(a), "l"(b), "r"(0));
}
__device__ __forceinline__ void kvs_wgmma_ss_n128(float (&d)[64], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, "
                 "%40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(1));
}
__device__ __forceinline__ void kvs_wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, "
                 "%40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

/* HEADS query heads of KV group blockIdx.x / ... x 128 / HEADS positions a block
 * (positions from the last tile down: the heaviest blocks first), sequence blockIdx.z.
 * Needs scale > 0 (the row max is taken over raw scores). */
template <int D, int STAGES, int HEADS, bool PINGPONG>
__global__ void __launch_bounds__(KVS_WG_THREADS, 1)
    kvs_attn_wgmma_kernel(kvs_attn_args a, bf16 *out, float *lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = kvs_wg_smem<D, STAGES>;
    constexpr int BM = KVS_WG_BM, BN = KVS_WG_BN, MH = BM / HEADS; /* positions a block */
    constexpr int CH = D / 8;                                       /* 16-byte chunks a row */
    constexpr int LAG = STAGES - 2; /* tiles the producer keeps in flight unsignalled */
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static_assert(STAGES >= 2, "two stages at least");
    extern __shared__ unsigned char kvs_wg_smem_raw[];
    const uint32_t base = (kvs_smem_u32(kvs_wg_smem_raw) + 1023u) & ~1023u;
    const uint32_t q_s = base + (uint32_t)L::q, kv_s = base + (uint32_t)L::kv, bar_s = base + (uint32_t)L::bar;
    /* full[st] at bar_s + 8 st, empty[st] at bar_s + 8 (STAGES + st) */

    const int h0 = blockIdx.x * HEADS, g = h0 / (a.n_heads / a.n_kv_heads), seq = blockIdx.z;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * MH;
    const int t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, kv_len = a.kv_len[seq];
    if (q0 >= q_len) return; /* the whole block: before any barrier */
    const int past = kv_len - q_len; /* query i sees keys 0 .. past + i */
    const int n_keys = past + min(q0 + MH, q_len); /* keys any row of the block sees */
    const int n_tiles = (n_keys + BN - 1) / BN;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; st++) {
            kvs_mbar_init(bar_s + 8 * st, 32);                          /* the producer warp's lanes */
            kvs_mbar_init(bar_s + 8 * (STAGES + st), 8);                /* the consumer warps */
        }
    }
    __syncthreads();

    if (warp == 8) {
        /* ---- producer: tile i into stage i % STAGES ---- */
        const int32_t *table = kvs_attn_table(a, seq);
        constexpr int RPI = 32 / CH;  /* rows one warp-wide copy covers */
        constexpr int NG = BN / 16;   /* 16-key groups a tile (one paged block each: block_size % 16 == 0) */
        constexpr int VPG = 16 / RPI; /* copies a lane issues per group, for K (and as many for V) */
        const int c = lane % CH, rs = lane / CH;
        const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
        /* lane j < NG: the paged block of group j of tile i (0 past the block's keys) */
        auto block_of = [&](int i) -> int {
            const int e = i * BN + 16 * lane;
            return lane < NG && e < n_keys ? table[e / a.block_size] : 0;
        };
        int blk_next = block_of(0);
        for (int i = 0; i < n_tiles; i++) {
            const int blk_lanes = blk_next;
            if (i + 1 < n_tiles) blk_next = block_of(i + 1); /* consumed next iteration */
            const int st = i % STAGES;
            if (i >= STAGES) kvs_mbar_wait(bar_s + 8 * (STAGES + st), ((i / STAGES) - 1) & 1); /* tile i - STAGES read */
            const uint32_t k_st = kv_s + (uint32_t)(st * 2 * L::TILE), v_st = k_st + (uint32_t)L::TILE;
#pragma unroll
            for (int gi = 0; gi < NG; gi++) {
                const int e0 = i * BN + 16 * gi;
                const int blk = __shfl_sync(0xffffffffu, blk_lanes, gi);
                const bf16 *src0 =
                    a.pool + (e0 < n_keys ? kvs_kv_offset(blk, 0, g, e0 % a.block_size, a.n_kv_heads, a.block_size, D)
                                          : (size_t)0) + c * 8;
#pragma unroll
                for (int v = 0; v < VPG; v++) {
                    const int rr = rs + RPI * v, r = 16 * gi + rr;
                    const bool ok = e0 + rr < n_keys;
                    const bf16 *src = ok ? src0 + (size_t)rr * D : a.pool;
                    const uint32_t off = kvs_wg_swz(BN, r, c);
                    kvs_cp_async16(k_st + off, src, ok);
                    kvs_cp_async16(v_st + off, ok ? src + v_delta : a.pool, ok);
                }
            }
            kvs_cp_async_commit();
            if (i >= LAG) { /* tile i - LAG landed (this lane's copies): publish it */
                kvs_cp_async_wait<LAG>();
                kvs_fence_proxy_async();
                kvs_mbar_arrive(bar_s + 8 * ((i - LAG) % STAGES));
            }
        }
        kvs_cp_async_wait<0>();
        kvs_fence_proxy_async();
        for (int j = n_tiles - LAG > 0 ? n_tiles - LAG : 0; j < n_tiles; j++) kvs_mbar_arrive(bar_s + 8 * (j % STAGES));
        return;
    }

    /* ---- consumers: warpgroup wg owns block rows 64 wg .. 64 wg + 63 ---- */
    const int wg = warp / 4, tid = threadIdx.x % 128;
    /* block row R: head h0 + R / MH, position q0 + R % MH */
    for (int p = tid; p < 64 * CH; p += 128) {
        const int R = 64 * wg + p / CH, c = p % CH, pos = q0 + R % MH;
        const bool ok = pos < q_len;
        const bf16 *src = ok ? a.q + ((size_t)(t0 + pos) * a.n_heads + h0 + R / MH) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + kvs_wg_swz(BM, R, c), src, ok);
    }
    kvs_cp_async_commit();
    kvs_cp_async_wait<0>();
    kvs_fence_proxy_async();
    kvs_named_sync(1 + wg, 128); /* the warpgroup's Q rows landed */

    /* (few values live across the key loop: the kernel sits at the 168 registers 9
       warps allow, 3 warps on one SM sub-partition; the epilogue recomputes its own) */
    const int R0 = 64 * wg + 16 * (warp % 4) + lane / 4; /* this thread's rows R0 and R0 + 8 (one head) */
    const int lim0 = past + q0 + R0 % MH;                /* the last key row R0 sees (R0 + 8: lim0 + 8) */
    /* the warpgroup's positions: [wg_first, wg_first + min(MH, 64)) */
    const int wg_first = q0 + (HEADS == 1 ? 64 * wg : 0);
    /* keys past it: no live row of the warpgroup sees them (-1: no live row) */
    const int wg_last_key = wg_first < q_len ? past + min(wg_first + (MH < 64 ? MH : 64), q_len) - 1 : -1;
    const int wg_full_key = past + wg_first; /* every row sees keys up to it */
    const float scale_log2 = a.scale * KVS_LOG2E;
    const uint32_t q_wg = q_s + (uint32_t)wg * 64 * 128;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    /* PINGPONG: the warpgroups take turns issuing their GEMMs (named barrier 3:
       warpgroup 0's turn, 4: warpgroup 1's), S of warpgroup 0, S of 1, P V of 0,
       P V of 1, ..., so one's softmax runs while the other's GEMM occupies the
       tensor cores. Each takes two turns a tile, issuing or not (a warpgroup
       past its keys), and the last arrive is dropped, so every arrive meets a sync. */
    if (PINGPONG && wg == 1) kvs_turn_arrive(3); /* warpgroup 0 goes first */
    for (int i = 0; i < n_tiles; i++) {
        const int st = i % STAGES, k0 = i * BN;
        const bool live = k0 <= wg_last_key; /* warpgroup-uniform */
        kvs_mbar_wait(bar_s + 8 * st, (i / STAGES) & 1); /* tile i landed */
        const uint32_t k_st = kv_s + (uint32_t)(st * 2 * L::TILE), v_st = k_st + (uint32_t)L::TILE;
        float s[BN / 2];
        if (PINGPONG) kvs_turn_sync(3 + wg);
        if (live) {
            kvs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const uint64_t da = kvs_wg_desc(q_wg + (kk / 4) * (BM * 128) + (kk % 4) * 32, 16);
                const uint64_t db = kvs_wg_desc(k_st + (kk / 4) * (BN * 128) + (kk % 4) * 32, 16);
                if (kk == 0) kvs_wgmma_ss_n128_zero(s, da, db);
                else kvs_wgmma_ss_n128(s, da, db);
            }
            kvs_wgmma_commit();
        }
        if (PINGPONG) kvs_turn_arrive(4 - wg);
        uint32_t pa[BN / 16][4]; /* P as the A fragments of k16 step kk: keys 16 kk .. 16 kk + 15 */
        if (live) {
            kvs_wgmma_wait<0>();
            kvs_wg_fence_regs(s);

            /* online softmax (log2 domain; m over scaled scores) */
            if (k0 + BN - 1 > wg_full_key) { /* tile crosses some row's diagonal: mask */
                const int col = k0 + 2 * (lane & 3);
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        if (col + 8 * j + (c & 1) > lim0 + 8 * (c >> 1)) s[4 * j + c] = -INFINITY;
                    }
                }
            }
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
                mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            mx0 *= scale_log2, mx1 *= scale_log2; /* -inf stays -inf (scale > 0) */
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
            const float alpha0 = kvs_exp2(m0 - mu0), alpha1 = kvs_exp2(m1 - mu1);
            const bool grew = mn0 != m0 || mn1 != m1;
            m0 = mn0, m1 = mn1;
            float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const float p0 = kvs_exp2(fmaf(s[4 * j], scale_log2, -mu0));
                const float p1 = kvs_exp2(fmaf(s[4 * j + 1], scale_log2, -mu0));
                const float p2 = kvs_exp2(fmaf(s[4 * j + 2], scale_log2, -mu1));
                const float p3 = kvs_exp2(fmaf(s[4 * j + 3], scale_log2, -mu1));
                sum0 += p0 + p1;
                sum1 += p2 + p3;
                pa[j / 2][(j & 1) * 2] = kvs_pack_bf16(p0, p1);     /* row lane/4, keys 8 j + 2 (lane % 4) */
                pa[j / 2][(j & 1) * 2 + 1] = kvs_pack_bf16(p2, p3); /* row lane/4 + 8 */
            }
            l0 = l0 * alpha0 + sum0;
            l1 = l1 * alpha1 + sum1;
            if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
                for (int j = 0; j < D / 8; j++) {
                    o[4 * j] *= alpha0, o[4 * j + 1] *= alpha0;
                    o[4 * j + 2] *= alpha1, o[4 * j + 3] *= alpha1;
                }
            }

        }
        /* O += P V */
        if (PINGPONG) kvs_turn_sync(3 + wg);
        if (live) {
            kvs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                const uint64_t db = kvs_wg_desc(v_st + kk * 16 * 128, BN * 128);
                if constexpr (D == 128) kvs_wgmma_rs_n128(o, pa[kk], db);
                else kvs_wgmma_rs_n64(o, pa[kk], db);
            }
            kvs_wgmma_commit();
        }
        if (PINGPONG && !(wg == 1 && i == n_tiles - 1)) kvs_turn_arrive(4 - wg);
        if (live) {
            kvs_wgmma_wait<0>();
            kvs_wg_fence_regs(o);
        }
        /* stage st is read (this warp's wgmma's completed above): hand it back */
        kvs_fence_proxy_async();
        __syncwarp();
        if (lane == 0) kvs_mbar_arrive(bar_s + 8 * (STAGES + st));
    }

    if (wg_last_key < 0) return; /* no live row */
    const int head = h0 + R0 / MH, pos0 = q0 + R0 % MH, pos1 = pos0 + 8;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int cq = 2 * (lane & 3);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int pos = hf ? pos1 : pos0;
        if (pos < q_len) {
            const size_t t = (size_t)t0 + pos;
            const float lt = hf ? l1 : l0, inv = 1.f / lt;
            bf16 *orow = out + (t * a.n_heads + head) * D + cq;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(uint32_t *)(orow + 8 * j) = kvs_pack_bf16(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
            if (lse && (lane & 3) == 0) lse[t * a.n_heads + head] = ((hf ? m1 : m0) + __log2f(lt)) * KVS_LN2;
        }
    }
#else
    __trap(); /* not built for sm_90a: kvs_cuda_wgmma_supported refuses such devices */
#endif
}

/* ---- host ------------------------------------------------------------------------ */

const char *kvs_cuda_wgmma_supported(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return "cannot query the compute capability";
    }
    if (major != 9 || minor != 0) return "needs compute capability 9.0 (Hopper wgmma)";
    int built = 0;
    if (cudaMemcpyFromSymbol(&built, kvs_wgmma_built, sizeof built) != cudaSuccess) {
        cudaGetLastError();
        return "cannot read the kernel's build flag";
    }
    if (!built) return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES must include 90a)";
    return NULL;
}

bool kvs_cuda_wgmma_fits(int head_dim, int block_size, float scale, bool fp8) {
    return !fp8 && (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && scale > 0.f;
}

template <int D, int STAGES, int HEADS>
static void launch_wgmma(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    using L = kvs_wg_smem<D, STAGES>;
    auto kernel = kvs_cuda_of(b)->wgmma_pingpong ? kvs_attn_wgmma_kernel<D, STAGES, HEADS, true>
                                                  : kvs_attn_wgmma_kernel<D, STAGES, HEADS, false>;
    constexpr int MH = KVS_WG_BM / HEADS;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::bytes));
    dim3 grid((unsigned)(a.n_heads / HEADS), (unsigned)((max_q_len + MH - 1) / MH), (unsigned)a.n_seqs);
    kernel<<<grid, KVS_WG_THREADS, L::bytes, kvs_cuda_of(b)->stream>>>(a, out, lse);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_wgmma_kernel");
}

template <int D, int STAGES>
static void launch_wgmma_group(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    const int group = a.n_heads / a.n_kv_heads;
    if (group % 4 == 0) launch_wgmma<D, STAGES, 4>(b, a, out, lse, max_q_len);
    else if (group % 2 == 0) launch_wgmma<D, STAGES, 2>(b, a, out, lse, max_q_len);
    else launch_wgmma<D, STAGES, 1>(b, a, out, lse, max_q_len);
}

/* K/V stages: 3 at head_dim 128 (32 KiB of Q + 3 x 64 KiB: 225 KiB with the
 * barriers and the alignment slack, under sm_90's 227 KiB), 4 at 64 (145 KiB). */
#define KVS_WG_STAGES(D) ((D) == 128 ? 3 : 4)

size_t kvs_cuda_wgmma_smem_bytes(int head_dim) {
    if (head_dim == 128) return kvs_wg_smem<128, KVS_WG_STAGES(128)>::bytes;
    if (head_dim == 64) return kvs_wg_smem<64, KVS_WG_STAGES(64)>::bytes;
    return 0;
}

void kvs_cuda_prefill_wgmma(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int head_dim,
                            int max_q_len) {
    if (head_dim == 128) launch_wgmma_group<128, KVS_WG_STAGES(128)>(b, a, out, lse, max_q_len);
    else if (head_dim == 64) launch_wgmma_group<64, KVS_WG_STAGES(64)>(b, a, out, lse, max_q_len);
    else kvs_cuda_report(b, "attention", "the wgmma prefill kernel takes head_dim 64 or 128", __FILE__, __LINE__);
}
