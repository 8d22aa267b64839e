/* Paged KV write, causal GQA attention over the paged cache (with LSE), and
 * the per-head gather used by compaction. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

#define kv_at kvs_cpu_kv_at

void kvs_cpu_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v,
                      const int32_t *slots, int n) {
    const float *kk = k, *vv = v;
    size_t row = (size_t)pool->n_kv_heads * pool->head_dim;
    for (int i = 0; i < n; i++) {
        int32_t block = slots[i] / pool->block_size, off = slots[i] % pool->block_size;
        for (int h = 0; h < pool->n_kv_heads; h++) {
            memcpy(kv_at(pool, block, 0, h, off), kk + i * row + (size_t)h * pool->head_dim,
                   sizeof(float) * pool->head_dim);
            memcpy(kv_at(pool, block, 1, h, off), vv + i * row + (size_t)h * pool->head_dim,
                   sizeof(float) * pool->head_dim);
        }
    }
}

/* A dot product the compiler can vectorise (independent partial sums). */
static inline float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* One (query token, head): scores over entries 0..n_keys-1 of the sequence's table. */
static void attend_one(const kvs_kv_pool *pool, const int32_t *table, int n_keys, int kv_head,
                       const float *q, float scale, float *scores, float *out, float *lse) {
    int d = pool->head_dim, bs = pool->block_size;
    float mx = -INFINITY;
    for (int e = 0; e < n_keys; e++) {
        const float *kv = kv_at(pool, table[e / bs], 0, kv_head, e % bs);
        float s = dot(q, kv, d) * scale;
        scores[e] = s;
        if (s > mx) mx = s;
    }
    double sum = 0;
    for (int e = 0; e < n_keys; e++) {
        scores[e] = expf(scores[e] - mx);
        sum += scores[e];
    }
    memset(out, 0, sizeof(float) * d);
    for (int e = 0; e < n_keys; e++) {
        const float *vv = kv_at(pool, table[e / bs], 1, kv_head, e % bs);
        float p = scores[e];
        for (int j = 0; j < d; j++) out[j] += p * vv[j];
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < d; j++) out[j] *= inv;
    if (lse) *lse = mx + (float)log(sum);
}

void kvs_cpu_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                       const kvs_attn_batch *ab, int n_heads, float scale) {
    int d = pool->head_dim, group = n_heads / pool->n_kv_heads;
    const float *qq = q;
    float *o = out;
    int total = ab->n_tokens * n_heads;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(ab->max_kv_len > 0 ? ab->max_kv_len : 1));
        int s = 0;
#pragma omp for schedule(dynamic, 4)
        for (int th = 0; th < total; th++) {
            int t = th / n_heads, h = th % n_heads;
            while (s > 0 && t < ab->q_start[s]) s--;
            while (t >= ab->q_start[s + 1]) s++;
            int q_len = ab->q_start[s + 1] - ab->q_start[s];
            int n_keys = ab->kv_len[s] - q_len + (t - ab->q_start[s]) + 1;
            attend_one(pool, ab->block_tables + (size_t)s * ab->max_blocks, n_keys, h / group,
                       qq + ((size_t)t * n_heads + h) * d, scale, scores, o + ((size_t)t * n_heads + h) * d,
                       lse ? lse + (size_t)t * n_heads + h : NULL);
        }
        free(scores);
    }
}

void kvs_cpu_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                       const int32_t *src_entry, int n) {
    int bs = pool->block_size;
    size_t bytes = sizeof(float) * pool->head_dim;
    for (int h = 0; h < pool->n_kv_heads; h++) {
        const int32_t *src = src_entry + (size_t)h * n;
        for (int i = 0; i < n; i++) { /* src[i] >= i (sorted, distinct): in-place safe */
            if (src[i] == i) continue;
            for (int kind = 0; kind < 2; kind++)
                memcpy(kv_at(pool, blocks[i / bs], kind, h, i % bs),
                       kv_at(pool, blocks[src[i] / bs], kind, h, src[i] % bs), bytes);
        }
    }
}
