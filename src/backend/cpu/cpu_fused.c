/* Fused ops on the CPU: each is the unfused sequence it replaces, so the CPU
 * results are what the separate ops give (add then rmsnorm; rope then kv_write;
 * with fp8 activations add_rmsnorm or swiglu, then quantize_fp8). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* add then rmsnorm, row by row: the same arithmetic in the same order as
 * kvs_cpu_add + kvs_cpu_rmsnorm, so the results are bitwise equal (g: w in f32). */
static void add_rmsnorm_f32(float *a, float *o, const float *c, const float *g, int n, int dim, float eps) {
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

void kvs_cpu_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                         float eps) {
    float *buf = b->weight_dtype == KVS_F32 ? NULL : kvs_cpu_scratch(b, sizeof(float) * dim);
    if (b->weight_dtype != KVS_F32 && !buf) return;
    add_rmsnorm_f32(x, xn, y, kvs_cpu_weights_f32(b, w, dim, buf), n, dim, eps);
}

/* add_rmsnorm into a scratch xn, then quantize_fp8 of it */
void kvs_cpu_add_rmsnorm_fp8(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n,
                             int dim, float eps) {
    if (n <= 0 || dim <= 0) return;
    size_t t = (size_t)n * dim;
    float *xn = kvs_cpu_scratch(b, sizeof(float) * (t + dim)); /* xn, then w in f32 when it is not */
    if (!xn) return;
    add_rmsnorm_f32(x, xn, y, kvs_cpu_weights_f32(b, w, dim, xn + t), n, dim, eps);
    kvs_cpu_quantize_fp8(b, q, scale, xn, KVS_F32, n, dim);
}

/* swiglu into a scratch act, then quantize_fp8 of it */
void kvs_cpu_swiglu_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim) {
    if (n <= 0 || dim <= 0) return;
    float *act = kvs_cpu_scratch(b, sizeof(float) * (size_t)n * dim);
    if (!act) return;
    kvs_cpu_swiglu(b, act, gate_up, n, dim);
    kvs_cpu_quantize_fp8(b, q, scale, act, KVS_F32, n, dim);
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
