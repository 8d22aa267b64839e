/* SnapKV on the GPU: the window capture, the scores from the window queries'
 * log-sum-exp on the tensor cores, and the selection (max-pool + top-k +
 * window) straight into the keep lists that kv_gather consumes; nothing goes
 * back to the host.
 *
 * Scores: a block owns 128 keys (32 per warp, 64 for head_dim 256: 16) of one KV
 * head. A warp loads its keys' K rows once as mma A fragments (keys are the M
 * rows); the group's window (query, head) rows stream through shared memory 64
 * at a time (cp.async, double buffered) as the B columns, so S = K Q^T comes out
 * 16 keys x 8 rows per mma and each thread sums exp(scale s - lse) over its
 * columns in registers; a quad shuffle finishes each key's sum.
 *
 * Selection: one 1024-thread block per KV head: pool into shared memory (global
 * scratch past 11,776 keys) as order-preserving uint32 keys, a 4-pass 8-bit
 * radix select finds the k-th largest value T and how many entries equal to T
 * to take (the lowest indices), then an ordered compaction (ballots + a block
 * scan per 1024 entries) writes the kept indices ascending.
 *
 * Both kernels and the gather (cuda_kv.cu) run one job (the per-pair ops) or
 * a batch's list (snapkv_compact_batch: every (sequence, layer) pair due in a
 * step, one launch per stage): the job index is a grid dimension, and blocks
 * past a shorter job's keys return at once. */
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mma.cuh"

/* ---- sparsity window capture: q rows (bf16) and lse rows (f32) ---------------- */

__global__ void kvs_window_capture_kernel(bf16 *win_q, float *win_lse, const bf16 *q, const float *lse,
                                          const int32_t *src_rows, const int32_t *dst_rows, int n_heads,
                                          int head_dim) {
    int i = blockIdx.x;
    size_t row = (size_t)n_heads * head_dim;
    if (dst_rows[i] < 0) return; /* not a window query (graph mode captures every row) */
    size_t s = (size_t)src_rows[i], d = (size_t)dst_rows[i];
    for (size_t j = threadIdx.x; j < row; j += blockDim.x) win_q[d * row + j] = q[s * row + j];
    for (int h = threadIdx.x; h < n_heads; h += blockDim.x) win_lse[d * n_heads + h] = lse[s * n_heads + h];
}

void kvs_cuda_window_capture(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                             const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim) {
    if (m <= 0) return;
    kvs_window_capture_kernel<<<m, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)win_q, win_lse, (const bf16 *)q, lse,
                                                                      src_rows, dst_rows, n_heads, head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_window_capture_kernel");
}

/* ---- scores ------------------------------------------------------------------ */

#define KVS_SC_WARPS 4
#define KVS_SC_ROWS 64 /* window (query, head) rows per shared-memory chunk */

template <int D>
struct kvs_sc_shape {
    static constexpr int MT = D <= 128 ? 2 : 1;         /* 16-key m-tiles per warp */
    static constexpr int KEYS = KVS_SC_WARPS * 16 * MT; /* keys per block */
    static constexpr int RB = (D + 8) * 2;              /* shared row bytes (16 of padding: ldmatrix conflict free) */
    static constexpr size_t K_BYTES = (size_t)KEYS * RB, Q_BYTES = (size_t)KVS_SC_ROWS * RB;
    static constexpr size_t BYTES = K_BYTES + 2 * Q_BYTES + 2 * KVS_SC_ROWS * sizeof(float);
};

/* Issues the copies of window rows [r0, r0 + 64) of KV head g (row r = query
 * r / group, head g * group + r % group) and their lse * log2 e (+inf past the
 * end, so padded rows add exp2(-inf) = 0). */
template <int D>
__device__ __forceinline__ void kvs_sc_issue_rows(uint32_t q_s, float *lse_s, const bf16 *win_q,
                                                  const float *win_lse, int r0, int n_rows, int g, int group,
                                                  int n_heads) {
    constexpr int CH = D / 8, RB = kvs_sc_shape<D>::RB;
    for (int p = threadIdx.x; p < KVS_SC_ROWS * CH; p += KVS_SC_WARPS * 32) {
        int rr = p / CH, c = p % CH, r = r0 + rr;
        bool ok = r < n_rows;
        const bf16 *src = win_q;
        if (ok) src = win_q + ((size_t)(r / group) * n_heads + g * group + r % group) * D + c * 8;
        kvs_cp_async16(q_s + rr * RB + c * 16, src, ok);
    }
    for (int rr = threadIdx.x; rr < KVS_SC_ROWS; rr += KVS_SC_WARPS * 32) {
        int r = r0 + rr;
        lse_s[rr] = r < n_rows ? win_lse[(size_t)(r / group) * n_heads + g * group + r % group] * KVS_LOG2E
                               : INFINITY;
    }
}

/* FP8 pools: the block's K codes are read and decoded into the bf16 rows
 * (exact), and the K scale of head g joins the softmax scale. */
template <int D, bool FP8>
__global__ void __launch_bounds__(KVS_SC_WARPS * 32)
    kvs_sparsity_scores_mma_kernel(kvs_snapkv_job one, const kvs_snapkv_job *jobs, float *all_scores,
                                   const int32_t *tables, const bf16 *pool, int n_heads, int n_kv_heads,
                                   int block_size, float scale) {
    using S = kvs_sc_shape<D>;
    constexpr int MT = S::MT, RB = S::RB, CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const kvs_snapkv_job job = kvs_job(jobs, one, blockIdx.z);
    const int n_keys = job.n_keys, n_win = job.n_win, key0 = blockIdx.x * S::KEYS;
    if (key0 >= n_keys) return; /* past a shorter job's keys: the grid covers the batch's longest */
    float *scores = all_scores + job.scores;
    const int32_t *table = tables + job.table;
    const bf16 *win_q = (const bf16 *)job.win_q;
    const float *win_lse = job.win_lse, *scales = job.scales;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = blockIdx.y, group = n_heads / n_kv_heads;
    const int n_rows = n_win * group, n_chunks = (n_rows + KVS_SC_ROWS - 1) / KVS_SC_ROWS;
    const uint32_t k_s = kvs_smem_u32(smem), q_s0 = k_s + (uint32_t)S::K_BYTES;
    float *lse_s0 = (float *)(smem + S::K_BYTES + 2 * S::Q_BYTES);

    /* the block's K rows (zero past n_keys), then the first window chunk */
    for (int p = threadIdx.x; p < S::KEYS * CH; p += KVS_SC_WARPS * 32) {
        int r = p / CH, c = p % CH, e = key0 + r;
        bool ok = e < n_keys;
        size_t off = ok ? kvs_kv_offset(table[e / block_size], 0, g, e % block_size, n_kv_heads, block_size, D) + c * 8 : 0;
        if (FP8) /* plain loads: the stores are seen after the barrier before the A fragments are read */
            *(uint4 *)(smem + r * RB + c * 16) =
                ok ? kvs_fp8x8_to_bf16x8(*(const uint2 *)((const uint8_t *)pool + off)) : make_uint4(0, 0, 0, 0);
        else
            kvs_cp_async16(k_s + r * RB + c * 16, ok ? pool + off : pool, ok);
    }
    kvs_sc_issue_rows<D>(q_s0, lse_s0, win_q, win_lse, 0, n_rows, g, group, n_heads);
    kvs_cp_async_commit();

    uint32_t ka[MT][D / 16][4];
    float acc[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) acc[mt][0] = acc[mt][1] = 0.f;
    const float scale_log2 = scale * KVS_LOG2E * (FP8 ? kvs_kv_scale(scales, 0, g, n_kv_heads) : 1.f);

    for (int ch = 0; ch < n_chunks; ch++) {
        const int buf = ch & 1;
        if (ch + 1 < n_chunks) /* the other buffer was released by the barrier that ended chunk ch - 1 */
            kvs_sc_issue_rows<D>(q_s0 + (1 - buf) * (uint32_t)S::Q_BYTES, lse_s0 + (1 - buf) * KVS_SC_ROWS, win_q,
                                 win_lse, (ch + 1) * KVS_SC_ROWS, n_rows, g, group, n_heads);
        kvs_cp_async_commit();
        kvs_cp_async_wait<1>();
        __syncthreads();
        if (ch == 0) { /* A fragments of the warp's keys, once */
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uint32_t base = k_s + (warp * 16 * MT + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RB +
                                (lane >> 4) * 16;
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++)
                    kvs_ldmatrix_x4(ka[mt][kk][0], ka[mt][kk][1], ka[mt][kk][2], ka[mt][kk][3], base + kk * 32);
            }
        }
        const uint32_t q_w = q_s0 + buf * (uint32_t)S::Q_BYTES;
        const float *lse_w = lse_s0 + buf * KVS_SC_ROWS;
        const uint32_t q_lane = q_w + (((lane >> 4) * 8) + (lane & 7)) * RB + ((lane >> 3) & 1) * 16;
        const int rows_here = min(KVS_SC_ROWS, n_rows - ch * KVS_SC_ROWS);
        for (int j = 0; j < KVS_SC_ROWS / 8 && j * 8 < rows_here; j += 2) { /* two 8-row n-tiles */
            float c[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int t = 0; t < 4; t++) c[mt][0][t] = c[mt][1][t] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t b0, b1, b2, b3;
                kvs_ldmatrix_x4(b0, b1, b2, b3, q_lane + j * 8 * RB + kk * 32);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    kvs_mma_bf16(c[mt][0], ka[mt][kk], b0, b1);
                    kvs_mma_bf16(c[mt][1], ka[mt][kk], b2, b3);
                }
            }
            const int col = j * 8 + 2 * (lane & 3);
            const float l00 = lse_w[col], l01 = lse_w[col + 1], l10 = lse_w[col + 8], l11 = lse_w[col + 9];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                acc[mt][0] += kvs_exp2(fmaf(c[mt][0][0], scale_log2, -l00)) +
                              kvs_exp2(fmaf(c[mt][0][1], scale_log2, -l01)) +
                              kvs_exp2(fmaf(c[mt][1][0], scale_log2, -l10)) +
                              kvs_exp2(fmaf(c[mt][1][1], scale_log2, -l11));
                acc[mt][1] += kvs_exp2(fmaf(c[mt][0][2], scale_log2, -l00)) +
                              kvs_exp2(fmaf(c[mt][0][3], scale_log2, -l01)) +
                              kvs_exp2(fmaf(c[mt][1][2], scale_log2, -l10)) +
                              kvs_exp2(fmaf(c[mt][1][3], scale_log2, -l11));
            }
        }
        __syncthreads(); /* this chunk's buffer may be refilled */
    }
    kvs_cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float v = acc[mt][h];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            int e = key0 + warp * 16 * MT + mt * 16 + lane / 4 + 8 * h;
            if ((lane & 3) == 0 && e < n_keys) scores[(size_t)g * n_keys + e] = v;
        }
}

template <int D>
static void launch_scores(kvs_backend *b, const kvs_snapkv_job &one, const kvs_snapkv_job *jobs, int n_jobs,
                          int max_keys, float *scores, const int32_t *tables, const kvs_kv_pool *pool, int n_heads,
                          float scale) {
    using S = kvs_sc_shape<D>;
    /* every launch, like the attention kernels: the attribute is per device (tensor parallelism) */
    bool fp8 = b->kv_dtype == KVS_F8_E4M3;
    auto kernel = fp8 ? kvs_sparsity_scores_mma_kernel<D, true> : kvs_sparsity_scores_mma_kernel<D, false>;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S::BYTES));
    for (int j0 = 0; j0 < n_jobs; j0 += KVS_CUDA_MAX_JOBS) {
        dim3 grid(kvs_cuda_blocks(max_keys, S::KEYS), pool->n_kv_heads,
                  n_jobs - j0 < KVS_CUDA_MAX_JOBS ? n_jobs - j0 : KVS_CUDA_MAX_JOBS);
        kernel<<<grid, KVS_SC_WARPS * 32, S::BYTES, kvs_cuda_of(b)->stream>>>(
            one, jobs ? jobs + j0 : NULL, scores, tables, (const bf16 *)pool->data, n_heads, pool->n_kv_heads,
            pool->block_size, scale);
        KVS_CUDA_LAUNCHED(b, "kvs_sparsity_scores_mma_kernel");
    }
}

static bool scores_head_dim(int d) { return d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

/* The scores of one job or a batch's (max_keys > 0, head_dim one of scores_head_dim's). */
static void scores_stage(kvs_backend *b, const kvs_snapkv_job &one, const kvs_snapkv_job *jobs, int n_jobs,
                         int max_keys, float *scores, const int32_t *tables, const kvs_kv_pool *pool, int n_heads,
                         float scale) {
    switch (pool->head_dim) {
#define KVS_SC_CASE(D) \
    case D: launch_scores<D>(b, one, jobs, n_jobs, max_keys, scores, tables, pool, n_heads, scale); return;
        KVS_SC_CASE(32) KVS_SC_CASE(64) KVS_SC_CASE(80) KVS_SC_CASE(96) KVS_SC_CASE(128) KVS_SC_CASE(256)
#undef KVS_SC_CASE
    }
}

__global__ void kvs_zero_f32_kernel(float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = 0.f;
}

void kvs_cuda_sparsity_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                              const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale) {
    if (n_keys <= 0) return;
    if (n_heads <= 0 || n_heads % pool->n_kv_heads || n_win < 0) {
        kvs_cuda_report(b, "sparsity_scores", "n_heads must be a positive multiple of the KV heads", __FILE__,
                        __LINE__);
        return;
    }
    if (n_win == 0) { /* no window: every score is an empty sum */
        size_t n = (size_t)pool->n_kv_heads * n_keys;
        kvs_zero_f32_kernel<<<kvs_cuda_blocks(n, 256) < 4096 ? kvs_cuda_blocks(n, 256) : 4096, 256, 0,
                              kvs_cuda_of(b)->stream>>>(scores, n);
        KVS_CUDA_LAUNCHED(b, "kvs_zero_f32_kernel");
        return;
    }
    if (!scores_head_dim(pool->head_dim)) {
        kvs_cuda_report(b, "sparsity_scores", "head_dim not supported (32, 64, 80, 96, 128, 256)", __FILE__,
                        __LINE__);
        return;
    }
    kvs_snapkv_job one = {};
    one.win_q = win_q, one.win_lse = win_lse, one.scales = pool->scales, one.n_keys = n_keys, one.n_win = n_win;
    scores_stage(b, one, NULL, 1, n_keys, scores, table, pool, n_heads, scale);
}

/* ---- selection: max-pool + radix top-k + ordered compaction ------------------- */

#define KVS_SEL_THREADS 1024
#define KVS_SEL_WARPS (KVS_SEL_THREADS / 32)
/* pooled keys kept in shared memory (46 KiB: with the kernel's ~1.1 KiB of static
   arrays within the 48 KiB a block gets without opting in; 12,288 keys did not
   fit beside them and failed to launch); beyond: global scratch */
#define KVS_SEL_SMEM_KEYS 11776

/* Order-preserving map of a float to uint32 (larger float, larger key); -0 as +0. */
__device__ __forceinline__ uint32_t kvs_sel_key(float x) {
    if (x == 0.f) x = 0.f;
    uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Exclusive prefix sums of v[0..32) in place (one whole warp calls it). */
__device__ __forceinline__ void kvs_sel_warp_exclusive(int *v, int lane) {
    int x = v[lane], incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    v[lane] = incl - x;
}

/* scratch: NULL, or the pooled keys of every job in global memory, laid out as
 * the scores are (the batch's longest job is past shared memory). */
__global__ void __launch_bounds__(KVS_SEL_THREADS)
    kvs_snapkv_select_kernel(kvs_snapkv_job one, const kvs_snapkv_job *jobs, int32_t *keep, const float *all_scores,
                             uint32_t *scratch) {
    extern __shared__ uint32_t keys_s[];
    __shared__ int hist[256];
    __shared__ int warp_gt[KVS_SEL_WARPS], warp_eq[KVS_SEL_WARPS];
    __shared__ uint32_t sh_prefix;
    __shared__ int sh_want, sh_base_gt, sh_base_eq;
    const kvs_snapkv_job job = kvs_job(jobs, one, blockIdx.y);
    const int n_keys = job.n_keys, pool = job.pool, k = job.k, n_win = job.n_win;
    const float *scores = all_scores + job.scores;
    const int g = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int take = min(k, n_keys), row = k + n_win;
    int32_t *out = keep + job.keep + (size_t)g * row;
    for (int i = tid; i < row - take; i += KVS_SEL_THREADS) out[take + i] = i < n_win ? n_keys + i : -1;
    if (take == n_keys) { /* everything (also n_keys == 0) */
        for (int j = tid; j < n_keys; j += KVS_SEL_THREADS) out[j] = j;
        return;
    }
    if (take == 0) return;

    /* pooled keys (the CPU's loop and comparison, so NaN-free inputs pool alike) */
    const float *s = scores + (size_t)g * n_keys;
    uint32_t *v = scratch ? scratch + job.scores + (size_t)g * n_keys : keys_s;
    const int r = pool / 2;
    for (int j = tid; j < n_keys; j += KVS_SEL_THREADS) {
        int lo = max(j - r, 0), hi = min(j + r, n_keys - 1);
        float m = s[lo];
        for (int t = lo + 1; t <= hi; t++) {
            float x = s[t];
            if (x > m) m = x;
        }
        v[j] = kvs_sel_key(m);
    }

    /* radix select from the top byte: the k-th largest key T, and how many keys
     * equal to T to take (the rest of k after every key above T) */
    uint32_t prefix = 0, mask = 0;
    int want = take;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += KVS_SEL_THREADS) hist[i] = 0;
        __syncthreads();
        for (int j0 = 0; j0 < n_keys; j0 += KVS_SEL_THREADS) {
            int j = j0 + tid;
            bool in = false;
            int bin = 0;
            if (j < n_keys) {
                uint32_t u = v[j];
                in = (u & mask) == prefix;
                bin = (int)((u >> shift) & 255u);
            }
            /* warp-aggregated: one atomic per distinct bin (most keys share the top byte) */
            unsigned active = __ballot_sync(0xffffffffu, in);
            if (in) {
                unsigned same = __match_any_sync(active, bin);
                if (lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
            }
        }
        __syncthreads();
        if (warp == 0) { /* lane l holds bins 255 - 8l down to 248 - 8l */
            int local = 0;
#pragma unroll
            for (int t = 0; t < 8; t++) local += hist[255 - 8 * lane - t];
            int incl = local;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            int excl = incl - local;
            if (excl < want && want <= incl) {
                int cum = excl;
                for (int t = 0; t < 8; t++) {
                    int bin = 255 - 8 * lane - t, c = hist[bin];
                    if (cum + c >= want) {
                        sh_prefix = prefix | ((uint32_t)bin << shift);
                        sh_want = want - cum;
                        break;
                    }
                    cum += c;
                }
            }
        }
        __syncthreads();
        prefix = sh_prefix, want = sh_want, mask |= 255u << shift;
    }
    const uint32_t T = prefix;

    /* ordered compaction: entry j is kept when key > T, or key == T and fewer than
     * `want` keys equal to T come before it; its slot = (keys > T before j) +
     * min(keys == T before j, want) */
    if (tid == 0) sh_base_gt = sh_base_eq = 0;
    for (int j0 = 0; j0 < n_keys; j0 += KVS_SEL_THREADS) {
        int j = j0 + tid;
        uint32_t u = j < n_keys ? v[j] : 0u;
        bool gt = j < n_keys && u > T, eq = j < n_keys && u == T;
        unsigned bgt = __ballot_sync(0xffffffffu, gt), beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_gt[warp] = __popc(bgt), warp_eq[warp] = __popc(beq);
        __syncthreads();
        if (warp == 0) {
            kvs_sel_warp_exclusive(warp_gt, lane);
            kvs_sel_warp_exclusive(warp_eq, lane);
        }
        __syncthreads();
        const unsigned lt = (1u << lane) - 1u;
        int n_gt = sh_base_gt + warp_gt[warp] + __popc(bgt & lt);
        int n_eq = sh_base_eq + warp_eq[warp] + __popc(beq & lt);
        if (gt || (eq && n_eq < want)) out[n_gt + min(n_eq, want)] = j;
        __syncthreads(); /* everyone has read the bases and the warp offsets */
        if (tid == KVS_SEL_THREADS - 1) {
            sh_base_gt = n_gt + (gt ? 1 : 0);
            sh_base_eq = n_eq + (eq ? 1 : 0);
        }
        __syncthreads();
    }
}

/* The selection of one job or a batch's (scores_len: the scores' extent, for
 * the global scratch). */
static void select_stage(kvs_backend *b, const kvs_snapkv_job &one, const kvs_snapkv_job *jobs, int n_jobs,
                         int max_keys, int64_t scores_len, int32_t *keep, const float *scores, int n_kv_heads) {
    uint32_t *scratch = NULL;
    size_t smem = 0;
    if (max_keys > KVS_SEL_SMEM_KEYS) {
        scratch = (uint32_t *)kvs_cuda_scratch(b, sizeof(uint32_t) * (size_t)scores_len);
        if (!scratch) return;
    } else {
        smem = sizeof(uint32_t) * (size_t)max_keys;
    }
    for (int j0 = 0; j0 < n_jobs; j0 += KVS_CUDA_MAX_JOBS) {
        dim3 grid(n_kv_heads, n_jobs - j0 < KVS_CUDA_MAX_JOBS ? n_jobs - j0 : KVS_CUDA_MAX_JOBS);
        kvs_snapkv_select_kernel<<<grid, KVS_SEL_THREADS, smem, kvs_cuda_of(b)->stream>>>(
            one, jobs ? jobs + j0 : NULL, keep, scores, scratch);
        KVS_CUDA_LAUNCHED(b, "kvs_snapkv_select_kernel");
    }
}

void kvs_cuda_snapkv_select(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                            int k, int n_win) {
    if (n_keys < 0 || n_kv_heads < 0 || k < 0 || n_win < 0 || pool < 1) {
        kvs_cuda_report(b, "snapkv_select", "bad arguments (negative size or pool < 1)", __FILE__, __LINE__);
        return;
    }
    if (n_kv_heads == 0 || k + n_win == 0) return;
    kvs_snapkv_job one = {};
    one.n_keys = n_keys, one.n_win = n_win, one.k = k, one.pool = pool;
    select_stage(b, one, NULL, 1, n_keys, (int64_t)n_kv_heads * n_keys, keep, scores, n_kv_heads);
}

/* ---- the batch: scores, selection and gather, one launch each ------------------- */

void kvs_cuda_snapkv_compact_batch(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch) {
    if (batch->n_jobs < 0 || batch->max_keys < 0 || batch->n_heads <= 0 || pool->n_kv_heads <= 0 ||
        batch->n_heads % pool->n_kv_heads) {
        kvs_cuda_report(b, "snapkv_compact_batch", "bad arguments (negative sizes, or query heads not a multiple of "
                        "the KV heads)", __FILE__, __LINE__);
        return;
    }
    if (!scores_head_dim(pool->head_dim)) {
        kvs_cuda_report(b, "snapkv_compact_batch", "head_dim not supported (32, 64, 80, 96, 128, 256)", __FILE__,
                        __LINE__);
        return;
    }
    if (batch->n_jobs == 0) return;
    const kvs_snapkv_job none = {};
    if (batch->max_keys > 0)
        scores_stage(b, none, batch->jobs, batch->n_jobs, batch->max_keys, batch->scores, batch->tables, pool,
                     batch->n_heads, batch->scale);
    select_stage(b, none, batch->jobs, batch->n_jobs, batch->max_keys, batch->scores_len, batch->keep, batch->scores,
                 pool->n_kv_heads);
    kvs_cuda_kv_gather_jobs(b, pool, none, batch->jobs, batch->n_jobs, batch->tables, NULL, batch->keep);
}
