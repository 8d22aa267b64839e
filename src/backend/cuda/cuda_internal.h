/* Internal to the CUDA backend: the implementation state, error checks and
 * the launchers each .cu file provides. Host code is C++ compiled by nvcc; the
 * project headers are C, so they are included with C linkage. */
#ifndef KVS_CUDA_INTERNAL_H
#define KVS_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <math.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

extern "C" {
#include "backend/backend.h"
}

typedef __nv_bfloat16 bf16;

/* Element offset of (block, kind, head, offset) in a paged KV pool (bf16 or
 * FP8: elements of 2 bytes or 1). */
__device__ __forceinline__ size_t kvs_kv_offset(int block, int kind, int head, int offset, int n_kv_heads,
                                                int block_size, int head_dim) {
    return ((((size_t)block * 2 + kind) * n_kv_heads + head) * block_size + offset) * (size_t)head_dim;
}

/* ---- FP8 KV pools (backend.h kvs_kv_pool; docs/CUDA.md "FP8 KV cache") ---------- */
/* The scale of K (kind 0) or V (kind 1) of KV head g; 1 without scales. */
__device__ __forceinline__ float kvs_kv_scale(const float *scales, int kind, int g, int n_kv_heads) {
    return scales ? scales[kind * n_kv_heads + g] : 1.f;
}
/* The stored code of x: e4m3(x / s), IEEE division, round to nearest even,
 * saturating (kvs_f32_to_e4m3 bit for bit). */
__device__ __forceinline__ uint8_t kvs_kv_fp8_code(float x, float s) {
    return (uint8_t)__nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, __NV_E4M3);
}
/* Codes 0-1 (hi 0) or 2-3 (hi 1) of a word of four as an f16 pair, exactly (the
 * lower byte in the lower half): one cvt.rn.f16x2.e4m3x2 from compute capability 8.9. */
__device__ __forceinline__ uint32_t kvs_e4m3x2_to_f16x2(uint32_t w, int hi) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * hi)), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}
/* 8 codes as 8 f16, exactly: one cvt a pair. */
__device__ __forceinline__ uint4 kvs_fp8x8_to_f16x8(uint2 c) {
    return make_uint4(kvs_e4m3x2_to_f16x2(c.x, 0), kvs_e4m3x2_to_f16x2(c.x, 1), kvs_e4m3x2_to_f16x2(c.y, 0),
                      kvs_e4m3x2_to_f16x2(c.y, 1));
}
/* 8 codes (8 bytes) as 8 bf16 (16 bytes), exactly: every E4M3 value is an f16
 * value and a bf16 value (the f16 conversion above, then each pair through f32). */
__device__ __forceinline__ uint4 kvs_fp8x8_to_bf16x8(uint2 c) {
    uint4 out = kvs_fp8x8_to_f16x8(c);
    uint32_t *o = (uint32_t *)&out;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __half22float2(*(const __half2 *)&o[i]);
        __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
        o[i] = *(uint32_t *)&b;
    }
    return out;
}

/* Sum (MAX: max) of v over the block, returned to every thread (blockDim.x a
 * multiple of 32, at most 1024). Its barriers also publish the block's earlier
 * shared-memory writes; call it from every thread, at most once per kernel
 * for each of the two. */
template <bool MAX>
__device__ __forceinline__ float kvs_block_reduce(float v) {
    __shared__ float part[32];
    for (int k = 16; k > 0; k >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, v, k);
        v = MAX ? fmaxf(v, o) : v + o;
    }
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : (MAX ? -INFINITY : 0.f);
        for (int k = 16; k > 0; k >>= 1) {
            float o = __shfl_xor_sync(0xffffffffu, w, k);
            w = MAX ? fmaxf(w, o) : w + o;
        }
        if (threadIdx.x == 0) part[0] = w;
    }
    __syncthreads();
    return part[0];
}
__device__ __forceinline__ float kvs_block_sum(float v) { return kvs_block_reduce<false>(v); }
__device__ __forceinline__ float kvs_block_max(float v) { return kvs_block_reduce<true>(v); }

/* silu(g) * u: swiglu's arithmetic (cuda_ops.cu, and fused with the fp8 quantize in cuda_fused.cu) */
__device__ __forceinline__ float kvs_silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* What a cached GEMM plan multiplies (cuda_matmul.cu, cuda_fp8.cu). */
typedef enum {
    KVS_GEMM_BF16,      /* bf16 x bf16 -> bf16 */
    KVS_GEMM_FP8_OUTER, /* e4m3 x e4m3 -> bf16, outer-vector scales */
    KVS_GEMM_FP8_F32,   /* e4m3 x e4m3 -> f32, unit scales (the epilogue kernel scales) */
    KVS_GEMM_FP8_BF16,  /* e4m3 x e4m3 -> bf16, unit scales: the benchmark's ceiling for the scaled forms */
} kvs_gemm_kind;

/* A cached cuBLASLt plan for one (kind, n, in_dim, out_dim) shape, with or without the bias epilogue. */
typedef struct {
    int n, in_dim, out_dim, valid;
    int kind, fast_accum; /* kvs_gemm_kind; FP8 fast accumulation */
    int bias; /* CUBLASLT_EPILOGUE_BIAS; the pointer is set on op before each call */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} kvs_cuda_gemm_plan;

#define KVS_CUDA_GEMM_PLANS 64

typedef struct {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace;
    size_t lt_workspace_bytes;
    kvs_cuda_gemm_plan plans[KVS_CUDA_GEMM_PLANS];
    int next_plan;
    /* grow-only scratch (attention split partials, the FP8 GEMM epilogue's f32
       output, snapkv_select's pooled keys past shared memory) */
    void *scratch;
    size_t scratch_bytes;
    unsigned scratch_gen; /* bumped when scratch moves: graphs captured before are stale */
    int capturing;        /* a graph capture is open on stream */
    int capture_broken;   /* something during this capture could not be captured */
    int n_sms;
    int prefill; /* kvs_cuda_prefill: the prefill attention kernel (cuda_attention.cu) */
    int fp8_gemm; /* kvs_cuda_fp8_gemm, resolved (never AUTO): how matmul_fp8 scales (cuda_fp8.cu) */
    int wgmma_auto; /* AUTO runs the WGMMA prefill where it fits (a Hopper device, sm_90a code built) */
    /* bench-only (kvs_bench_kernels ablate; docs/CUDA.md "Where a tile's time goes"): a
       KVS_WG_AB_* mask picking a compiled variant of the bf16 d128 4-heads-a-block
       kernel (other shapes, FP8 pools and unknown masks run the default); 0: the default;
       KVSPARSE_WGMMA_VARIANT=mask for the tests */
    int wgmma_variant;
    /* the WGMMA prefill's TMA view of the pool (kvs_wg_unit_map), cached for one pool */
    alignas(64) unsigned char wgmma_map[128];
    const void *wgmma_map_pool;
    int64_t wgmma_map_groups;
    int wgmma_map_ok, wgmma_map_warned;
    int last_prefill; /* the kvs_cuda_prefill kernel of the last prefill launch (-1: none yet; tests) */
    int fp8_outer_missing; /* cuBLASLt found no outer-vector FP8 algorithm once: AUTO falls back to EPILOGUE_FAST */
    cudaEvent_t fence; /* the step's fence (backend.h fence / fence_wait) */
    uint64_t fence_sent; /* b->n_sent when it was recorded */
    int failed; /* sticky: a CUDA call failed; check reports failure */
    char failure[512]; /* the first failure's message */
} kvs_cuda;

static inline kvs_cuda *kvs_cuda_of(kvs_backend *b) { return (kvs_cuda *)b->impl; }

/* Records a failed CUDA / cuBLASLt call (kvs_fail + an error log line); the
 * backend's check reports the first one from then on. */
void kvs_cuda_report(kvs_backend *b, const char *call, const char *err, const char *file, int line);

#define KVS_CUDA_CHECK(b, call)                                                        \
    do {                                                                               \
        cudaError_t kvs_e_ = (call);                                                   \
        if (kvs_e_ != cudaSuccess)                                                     \
            kvs_cuda_report((b), #call, cudaGetErrorString(kvs_e_), __FILE__, __LINE__); \
    } while (0)

/* A cuBLASLt call: reports a failure and clears ok. */
#define LT_CHECK(b, call, ok)                                                                     \
    do {                                                                                          \
        cublasStatus_t kvs_s_ = (call);                                                           \
        if (kvs_s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            kvs_cuda_report((b), #call, cublasLtGetStatusString(kvs_s_), __FILE__, __LINE__);       \
            ok = 0;                                                                               \
        }                                                                                         \
    } while (0)

/* After a kernel launch: reports launch errors (bad configuration etc.). */
#define KVS_CUDA_LAUNCHED(b, name) KVS_CUDA_CHECK(b, cudaGetLastError())

/* Scratch of at least bytes (synchronizes the stream when it must grow); NULL on
 * failure. During a graph capture it cannot grow: NULL, and the capture fails
 * (run the same shapes eagerly once before capturing them). */
void *kvs_cuda_scratch(kvs_backend *b, size_t bytes);

static inline unsigned kvs_cuda_blocks(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

/* ---- SnapKV jobs (backend.h kvs_snapkv_job) ------------------------------------
 * The compaction kernels take either a batch's job list in device memory (job
 * blockIdx.y or .z) or, for the per-pair ops, one job by value whose offsets
 * are 0 into the arrays the op was given (jobs NULL). Grids put the jobs on y
 * or z: at most 65,535 a launch. */
#define KVS_CUDA_MAX_JOBS 65535
__device__ __forceinline__ kvs_snapkv_job kvs_job(const kvs_snapkv_job *jobs, const kvs_snapkv_job &one, int j) {
    return jobs ? jobs[j] : one;
}

/* ops (cuda_ops.cu) */
void kvs_cuda_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim);
void kvs_cuda_rmsnorm(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps);
void kvs_cuda_head_rmsnorm(kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim,
                           float eps);
void kvs_cuda_add(kvs_backend *b, void *x, const void *y, size_t n);
void kvs_cuda_rope(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n, int n_heads,
                   int head_dim);
void kvs_cuda_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim);
void kvs_cuda_gather_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim);
void kvs_cuda_scatter_i32(kvs_backend *b, int32_t *dst, const int32_t *pairs, int n);
void kvs_cuda_add_bias(kvs_backend *b, void *out, const void *bias, int n, int dim);
void kvs_cuda_f32_to_bf16(kvs_backend *b, void *dst, const float *src, size_t n);

/* paged KV (cuda_kv.cu) */
void kvs_cuda_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v, const int32_t *slots,
                       int n);
void kvs_cuda_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks, const int32_t *dst,
                        const int32_t *src_entry, int n);
/* kv_gather of every job: each job's k + n_win entries of keep (keep + its
 * offset) from its table (tables + its offset) into dst (NULL: in place, its
 * own table). */
void kvs_cuda_kv_gather_jobs(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_job &one,
                             const kvs_snapkv_job *jobs, int n_jobs, const int32_t *tables, const int32_t *dst,
                             const int32_t *keep);

/* fused ops (cuda_fused.cu) */
void kvs_cuda_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                          float eps);
void kvs_cuda_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                            const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                            int n_heads);
/* fp8 activations: add_rmsnorm / swiglu with their output quantized per row instead of stored */
void kvs_cuda_add_rmsnorm_fp8(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n,
                              int dim, float eps);
void kvs_cuda_swiglu_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim);

/* matmul (cuda_matmul.cu) */
void kvs_cuda_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n, int in_dim,
                     int out_dim);
void kvs_cuda_gemm_destroy(kvs_cuda *c);
/* The cached plan for C(out x n) = op_T(A) B of that kind (A = w [out][in], B =
 * the input [n][in], both K-major), with the bias epilogue when bias; NULL
 * (reported, unless quiet) when cuBLASLt has no algorithm for it. */
kvs_cuda_gemm_plan *kvs_cuda_gemm_plan_for(kvs_backend *b, kvs_gemm_kind kind, int fast_accum, int n, int in_dim,
                                           int out_dim, int bias, int quiet);

/* FP8 (cuda_fp8.cu) */
void kvs_cuda_quantize_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows,
                           int cols);
void kvs_cuda_matmul_fp8(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                         const float *ws, const void *bias, int n, int in_dim, int out_dim);

/* attention (cuda_attention.cu) */
void kvs_cuda_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                        const kvs_attn_batch *ab, int n_heads, float scale);
/* One attention launch's view of the batch (cuda_attention.cu builds it from
 * kvs_attn_batch; launch_mixed shifts it past a mixed step's leading decodes). */
struct kvs_attn_args {
    const bf16 *q;
    const bf16 *pool; /* FP8 pools: the codes' bytes (kvs_attn_pool8) */
    int64_t pool_blocks; /* the pool's blocks (the WGMMA prefill's TMA view of it) */
    const int32_t *q_start, *kv_len, *block_tables;
    const int32_t *table_rows; /* sequence s's table: block_tables + table_rows[s] * max_blocks; NULL: row s */
    int n_seqs, n_tokens, max_blocks, n_heads, n_kv_heads, block_size;
    int window; /* sliding window (split kernel only): keys [n_keys - window, n_keys); 0: all */
    float scale;
    const float *scales; /* FP8 pools: the layer's [2][n_kv_heads] (backend.h kvs_kv_pool); NULL: 1 */
};
/* An FP8 pool's codes (kvs_attn_args.pool). */
__device__ __forceinline__ const uint8_t *kvs_attn_pool8(const kvs_attn_args &a) { return (const uint8_t *)a.pool; }
/* Sequence seq's block table (backend.h kvs_attn_batch). */
__device__ __forceinline__ const int32_t *kvs_attn_table(const kvs_attn_args &a, int seq) {
    return a.block_tables + (size_t)(a.table_rows ? a.table_rows[seq] : seq) * a.max_blocks;
}
/* The Hopper prefill kernel (cuda_attention_hopper.cu, KVS_CUDA_PREFILL_WGMMA).
 * kvs_cuda_wgmma_supported: whether device can run it (compute capability 9.0
 * and this build holds its sm_90a code); NULL message on success, else why not.
 * kvs_cuda_wgmma_fits: whether a call can go through it (bf16 or FP8 pool,
 * head_dim 64 or 128, block_size a multiple of 16, scale > 0). */
const char *kvs_cuda_wgmma_supported(int device);
bool kvs_cuda_wgmma_fits(int head_dim, int block_size, float scale);
/* dynamic shared memory a block (fp8: an FP8 pool's kernel); 0: head_dim not taken */
size_t kvs_cuda_wgmma_smem_bytes(int head_dim, bool fp8);
/* Bench-only variants of the WGMMA prefill (kvs_cuda.wgmma_variant; docs/CUDA.md "Where
 * a tile's time goes"), each its own instantiation so that the default's code is
 * untouched: NO_V the producer loads K only (V stages left as they are), NO_LOAD no
 * copies after the first STAGES tiles (the producer only arrives), NO_EXP the
 * softmax without its ex2 (p = the FFMA's argument), NO_SOFTMAX P = S (no mask, max,
 * exp, sums or rescale), DIAG clock64 counters into kvs_cuda_wgmma_diag_read's
 * buffer, CP_ASYNC the producer's 128 threads copying bf16 K/V by 16-byte
 * cp.async (the default before 2026-12-04; the fallback where no tensor map can be
 * made; head_dim 64 always; 128-key tiles, three stages). Free masks, each what it
 * was: 8192 (WIDE, 176-key tiles: the default since session 19), 32 and 64 (K_ORDER,
 * the K release before the softmax, and SERIAL, the P V wait before it: the default's
 * order since session 18), 256, 512 and 1024 (PIPE2, RESCALE_EARLY, PINGPONG: the
 * default since session 17), 2048 (GROUP_ORDER, a KV group's q-blocks launched
 * together: 1.0x, deleted), 4096 (Q_REGS, Q as register fragments and S by wgmma RS:
 * 0.98-1.03x, deleted). */
enum {
    KVS_WG_AB_NO_V = 1,
    KVS_WG_AB_NO_LOAD = 2,
    KVS_WG_AB_NO_EXP = 4,
    KVS_WG_AB_NO_SOFTMAX = 8,
    KVS_WG_AB_DIAG = 16,
    KVS_WG_AB_CP_ASYNC = 128,
};
/* the DIAG counters (KVS_WG_DIAG_*), summed over the CTAs of every DIAG launch since
   the last reset */
enum {
    KVS_WG_DIAG_LOOP,     /* consumer warpgroups: cycles of the tile loop */
    KVS_WG_DIAG_FULL,     /* ... waiting on K / V full barriers */
    KVS_WG_DIAG_WAIT_S,   /* ... in wgmma.wait_group 1 (S of tile i) */
    KVS_WG_DIAG_SOFTMAX,  /* ... in the softmax (mask, max, exp, sums; the K release after it) */
    KVS_WG_DIAG_WAIT_PV,  /* ... in wgmma.wait_group 0 (P V of tile i - 1) */
    KVS_WG_DIAG_TAIL,     /* ... from P V done to the loop's end (V release, rescale, pack) */
    KVS_WG_DIAG_ITERS,    /* loop iterations (tiles 1 .. n_live - 1) */
    KVS_WG_DIAG_WGS,      /* warpgroups counted */
    KVS_WG_DIAG_PROD_LOOP,  /* the producer warp: cycles of its tile loop */
    KVS_WG_DIAG_PROD_EMPTY, /* ... waiting on empty barriers */
    KVS_WG_DIAG_PROD_TILES, /* tiles it loaded */
    KVS_WG_DIAG_CTA_CYCLES, /* thread 0: cycles from after the barrier init to the end */
    KVS_WG_DIAG_CTA_NS,     /* thread 0: the same in globaltimer nanoseconds */
    KVS_WG_DIAG_CTAS,
    KVS_WG_DIAG_N
};
void kvs_cuda_wgmma_diag_reset(void);
void kvs_cuda_wgmma_diag_read(unsigned long long out[KVS_WG_DIAG_N]);
void kvs_cuda_prefill_wgmma(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int head_dim,
                            int max_q_len, bool fp8);

/* sparsity (cuda_sparsity.cu) */
void kvs_cuda_window_capture(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                             const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim);
void kvs_cuda_sparsity_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                              const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale);
void kvs_cuda_snapkv_select(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                            int k, int n_win);
void kvs_cuda_snapkv_compact_batch(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch);

/* sampling (cuda_sample.cu) */
void kvs_cuda_process_logits(kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
                             const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust,
                             const uint32_t *masks);
void kvs_cuda_top_logprobs(kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits,
                           int n_rows, int ld, int vocab, const int32_t *chosen, int k);
void kvs_cuda_sample(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
                     const struct kvs_sample_row *params);
void kvs_cuda_sample_shard(kvs_backend *b, struct kvs_sample_part *parts, const void *logits, int n_rows, int ld,
                           int count, int id0, const struct kvs_sample_row *params);
/* cuda_dummy.cu */
void kvs_cuda_dummy_fill(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                         int64_t r0, int64_t nr, int64_t c0, int64_t nc);

#endif
