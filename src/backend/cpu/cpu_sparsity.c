/* SnapKV on the CPU: the window capture, the scores from the window queries'
 * log-sum-exp, the selection, and the batched compaction (a loop over the
 * per-pair ops: the reference of CUDA's one launch per stage). Selection: max-pool each KV head's scores,
 * sort the entries by (pooled score descending, index ascending), keep the
 * first k in index order, append the window. The oracle of the CUDA radix
 * select; written independently of kv/select.c (the heap the kv module kept
 * before this op), and tests/test_kv.c checks the two against each other. */
#include <math.h>
#include <stdlib.h>
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
    if (d > KVS_CPU_MAX_HEAD_DIM) {
        kvs_cpu_fail(b, KVS_ERR_UNSUPPORTED, "sparsity_scores: head_dim %d above %d", d, KVS_CPU_MAX_HEAD_DIM);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static)
    for (int g = 0; g < pool->n_kv_heads; g++) {
        for (int j = 0; j < n_keys; j++) {
            float k[KVS_CPU_MAX_HEAD_DIM]; /* the key as f32 (FP8: decoded, times its scale) */
            kvs_cpu_kv_rows_f32(b, pool, table[j / bs], 0, g, j % bs, 1, k);
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

typedef struct {
    float score;
    int32_t idx;
} ranked;

static int by_rank(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static int by_index(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

void kvs_cpu_snapkv_select(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                           int k, int n_win) {
    if (n_keys < 0 || n_kv_heads < 0 || k < 0 || n_win < 0 || pool < 1) {
        kvs_cpu_fail(b, KVS_ERR_INVALID,
                     "snapkv_select: bad arguments (n_keys %d, kv heads %d, pool %d, k %d, window %d)", n_keys,
                     n_kv_heads, pool, k, n_win);
        return;
    }
    int r = pool / 2, take = k < n_keys ? k : n_keys, row = k + n_win;
    ranked *rk = malloc(sizeof(ranked) * (size_t)(n_keys ? n_keys : 1));
    if (!rk) {
        kvs_cpu_fail(b, KVS_ERR_NOMEM, "snapkv_select: out of memory for %d keys", n_keys);
        return;
    }
    for (int g = 0; g < n_kv_heads; g++) {
        const float *s = scores + (size_t)g * n_keys;
        int32_t *out = keep + (size_t)g * row;
        for (int j = 0; j < n_keys; j++) {
            int lo = j - r < 0 ? 0 : j - r, hi = j + r >= n_keys ? n_keys - 1 : j + r;
            float m = s[lo];
            for (int t = lo + 1; t <= hi; t++)
                if (s[t] > m) m = s[t];
            rk[j] = (ranked){m, j};
        }
        qsort(rk, (size_t)n_keys, sizeof(ranked), by_rank);
        for (int i = 0; i < take; i++) out[i] = rk[i].idx;
        qsort(out, (size_t)take, sizeof(int32_t), by_index);
        for (int i = 0; i < n_win; i++) out[take + i] = n_keys + i;
        for (int i = take + n_win; i < row; i++) out[i] = -1;
    }
    free(rk);
}

/* The backend's per-pair ops over the jobs (through b, so that a test that
 * replaces one, e.g. to record the selections, sees every pair), stage by stage
 * as the CUDA backend runs them (every job's scores, then every selection, then
 * every gather: jobs whose arrays overlap go wrong here as there). The jobs are
 * checked first: a bad one writes nothing (the CUDA kernels trust them). */
void kvs_cpu_snapkv_compact_batch(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch) {
    int H = pool->n_kv_heads;
    if (batch->n_jobs < 0 || batch->n_heads <= 0 || batch->n_heads % H || pool->head_dim > KVS_CPU_MAX_HEAD_DIM) {
        kvs_cpu_fail(b, KVS_ERR_INVALID, "snapkv_compact_batch: %d jobs, %d query heads for %d KV heads, head_dim %d",
                     batch->n_jobs, batch->n_heads, H, pool->head_dim);
        return;
    }
    for (int i = 0; i < batch->n_jobs; i++) {
        const kvs_snapkv_job *j = &batch->jobs[i];
        if (j->n_keys < 0 || j->n_win < 0 || j->k < 0 || j->k > j->n_keys || j->pool < 1 ||
            (int64_t)j->n_blocks * pool->block_size < (int64_t)j->n_keys + j->n_win || j->dst_blocks < 0 ||
            (j->dst_blocks > 0 && (int64_t)j->dst_blocks * pool->block_size < (int64_t)j->k + j->n_win) ||
            j->scores + (int64_t)H * j->n_keys > batch->scores_len || j->n_keys > batch->max_keys) {
            kvs_cpu_fail(b, KVS_ERR_INVALID,
                         "snapkv_compact_batch: job %d (keys %d, window %d, k %d, pool %d, %d blocks, scores at %lld "
                         "of %lld) is not a compaction of its table",
                         i, j->n_keys, j->n_win, j->k, j->pool, j->n_blocks, (long long)j->scores,
                         (long long)batch->scores_len);
            return;
        }
    }
    for (int stage = 0; stage < 3; stage++)
        for (int i = 0; i < batch->n_jobs; i++) {
            const kvs_snapkv_job *j = &batch->jobs[i];
            kvs_kv_pool p = *pool;
            p.scales = j->scales;
            const int32_t *table = batch->tables + j->table;
            float *scores = batch->scores + j->scores;
            int32_t *keep = batch->keep + j->keep;
            if (stage == 0)
                b->sparsity_scores(b, scores, j->win_q, j->win_lse, j->n_win, &p, table, j->n_keys, batch->n_heads,
                                   batch->scale);
            else if (stage == 1)
                b->snapkv_select(b, keep, scores, j->n_keys, H, j->pool, j->k, j->n_win);
            else
                b->kv_gather(b, &p, table, j->n_blocks, j->dst_blocks > 0 ? batch->tables + j->dst_table : table, keep,
                             j->k + j->n_win);
        }
}
