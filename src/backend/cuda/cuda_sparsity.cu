/* SnapKV scores from the window queries' log-sum-exp. One thread owns one key
 * of one KV head: its K row sits in registers and its sum in a register while
 * the window's (query, head) rows of the group stream through shared memory
 * (keys outside, window queries inside). */
#include "backend/cuda/cuda_internal.h"

#define KVS_SCORE_KEYS 128 /* keys (threads) per block */
#define KVS_SCORE_ROWS 16  /* window rows staged per round */

template <int D>
__global__ void __launch_bounds__(KVS_SCORE_KEYS)
    kvs_sparsity_scores_kernel(float *scores, const bf16 *win_q, const float *win_lse, int n_win, const bf16 *pool,
                               const int32_t *table, int n_keys, int n_heads, int n_kv_heads, int block_size,
                               float scale) {
    constexpr int LD = D + 2;
    __shared__ __align__(16) bf16 k_s[KVS_SCORE_KEYS * LD];
    __shared__ float q_s[KVS_SCORE_ROWS][D];
    __shared__ float lse_s[KVS_SCORE_ROWS];
    const int g = blockIdx.y, group = n_heads / n_kv_heads, j0 = blockIdx.x * KVS_SCORE_KEYS;
    const int j = j0 + threadIdx.x;

    /* stage the block's K rows (coalesced pairs), then each thread takes its own */
    for (int idx = threadIdx.x; idx < KVS_SCORE_KEYS * (D / 2); idx += blockDim.x) {
        int r = idx / (D / 2), c = idx % (D / 2), e = j0 + r;
        __nv_bfloat162 v = __floats2bfloat162_rn(0.f, 0.f);
        if (e < n_keys) {
            size_t off = ((((size_t)table[e / block_size] * 2) * n_kv_heads + g) * block_size + e % block_size) * D;
            v = ((const __nv_bfloat162 *)(pool + off))[c];
        }
        *(__nv_bfloat162 *)(k_s + r * LD + 2 * c) = v;
    }
    __syncthreads();
    float2 k[D / 2];
#pragma unroll
    for (int c = 0; c < D / 2; c++) k[c] = __bfloat1622float2(*(const __nv_bfloat162 *)(k_s + threadIdx.x * LD + 2 * c));

    float sum = 0.f;
    const int n_rows = n_win * group;
    for (int r0 = 0; r0 < n_rows; r0 += KVS_SCORE_ROWS) {
        int rows = min(KVS_SCORE_ROWS, n_rows - r0);
        __syncthreads();
        for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
            int rr = r0 + idx / D, i = rr / group, h = g * group + rr % group;
            q_s[idx / D][idx % D] = __bfloat162float(win_q[((size_t)i * n_heads + h) * D + idx % D]) * scale;
        }
        for (int rr = threadIdx.x; rr < rows; rr += blockDim.x) {
            int i = (r0 + rr) / group, h = g * group + (r0 + rr) % group;
            lse_s[rr] = win_lse[(size_t)i * n_heads + h];
        }
        __syncthreads();
        for (int r = 0; r < rows; r++) {
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < D / 2; c++) dot += q_s[r][2 * c] * k[c].x + q_s[r][2 * c + 1] * k[c].y;
            sum += expf(dot - lse_s[r]);
        }
    }
    if (j < n_keys) scores[(size_t)g * n_keys + j] = sum;
}

template <int D>
static void launch_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                          const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale) {
    dim3 grid(kvs_cuda_blocks(n_keys, KVS_SCORE_KEYS), pool->n_kv_heads);
    kvs_sparsity_scores_kernel<D><<<grid, KVS_SCORE_KEYS, 0, kvs_cuda_of(b)->stream>>>(
        scores, (const bf16 *)win_q, win_lse, n_win, (const bf16 *)pool->data, table, n_keys, n_heads,
        pool->n_kv_heads, pool->block_size, scale);
    KVS_CUDA_LAUNCHED(b, "kvs_sparsity_scores_kernel");
}

void kvs_cuda_sparsity_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                              const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale) {
    if (n_keys <= 0) return;
    switch (pool->head_dim) {
    case 32: launch_scores<32>(b, scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale); return;
    case 64: launch_scores<64>(b, scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale); return;
    case 80: launch_scores<80>(b, scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale); return;
    case 96: launch_scores<96>(b, scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale); return;
    case 128: launch_scores<128>(b, scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale); return;
    default:
        kvs_cuda_report(b, "sparsity_scores", "head_dim not supported (32, 64, 80, 96, 128)", __FILE__, __LINE__);
    }
}
