/* SnapKV scores from the window queries' log-sum-exp, and the window capture. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

void kvs_cpu_window_capture(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                            const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim) {
    size_t row = (size_t)n_heads * head_dim;
    for (int i = 0; i < m; i++) {
        if (dst_rows[i] < 0) continue; /* not a window query (graph mode captures every row) */
        memcpy((float *)win_q + (size_t)dst_rows[i] * row, (const float *)q + (size_t)src_rows[i] * row,
               sizeof(float) * row);
        memcpy(win_lse + (size_t)dst_rows[i] * n_heads, lse + (size_t)src_rows[i] * n_heads,
               sizeof(float) * n_heads);
    }
}

/* Keys outside, window queries inside: each key is read once and its sum
 * stays in a register. */
void kvs_cpu_sparsity_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                             const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale) {
    int d = pool->head_dim, bs = pool->block_size, group = n_heads / pool->n_kv_heads;
    const float *q = win_q;
#pragma omp parallel for collapse(2) schedule(static)
    for (int g = 0; g < pool->n_kv_heads; g++) {
        for (int j = 0; j < n_keys; j++) {
            const float *k = kvs_cpu_kv_at(pool, table[j / bs], 0, g, j % bs);
            double sum = 0;
            for (int i = 0; i < n_win; i++) {
                for (int h = g * group; h < (g + 1) * group; h++) {
                    const float *qi = q + ((size_t)i * n_heads + h) * d;
                    float dot = 0;
                    for (int t = 0; t < d; t++) dot += qi[t] * k[t];
                    sum += exp((double)(scale * dot) - win_lse[(size_t)i * n_heads + h]);
                }
            }
            scores[(size_t)g * n_keys + j] = (float)sum;
        }
    }
}
