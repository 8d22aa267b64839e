/* Fused ops on the CPU: each is the unfused sequence it replaces, so the CPU
 * results are what the separate ops give (add then rmsnorm; rope then kv_write). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* add then rmsnorm, row by row: the same arithmetic in the same order as
 * kvs_cpu_add + kvs_cpu_rmsnorm, so the results are bitwise equal. */
void kvs_cpu_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                         float eps) {
    float *a = x, *o = xn, *buf = b->weight_dtype == KVS_F32 ? NULL : kvs_cpu_scratch(b, sizeof(float) * dim);
    if (b->weight_dtype != KVS_F32 && !buf) return;
    const float *c = y, *g = kvs_cpu_weights_f32(b, w, dim, buf);
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++) {
        float *xi = a + (size_t)i * dim;
        const float *yi = c + (size_t)i * dim;
        double ss = 0;
        for (int j = 0; j < dim; j++) {
            xi[j] += yi[j];
            ss += (double)xi[j] * xi[j];
        }
        float r = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int j = 0; j < dim; j++) o[(size_t)i * dim + j] = xi[j] * r * g[j];
    }
}

/* The CPU reference of the fused op is the unfused sequence on qkv's parts:
 * q copied out and roped in place, k copied and roped, then kv_write with v
 * (padding rows skipped there). */
void kvs_cpu_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                           const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                           int n_heads) {
    size_t qd = (size_t)n_heads * pool->head_dim, kd = (size_t)pool->n_kv_heads * pool->head_dim, ld = qd + 2 * kd;
    float *k = kvs_cpu_scratch(b, sizeof(float) * (2 * n * kd + 1)), *v = k + n * kd, *qq = q;
    const float *in = qkv;
    if (!k) return;
    for (int i = 0; i < n; i++) {
        memcpy(qq + i * qd, in + i * ld, sizeof(float) * qd);
        memcpy(k + i * kd, in + i * ld + qd, sizeof(float) * kd);
        memcpy(v + i * kd, in + i * ld + qd + kd, sizeof(float) * kd);
    }
    kvs_cpu_rope(b, q, positions, inv_freq, n, n_heads, pool->head_dim);
    kvs_cpu_rope(b, k, positions, inv_freq, n, pool->n_kv_heads, pool->head_dim);
    kvs_cpu_kv_write(b, pool, k, v, slots, n);
}
