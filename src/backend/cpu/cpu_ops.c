/* Row-wise CPU ops: embedding, RMSNorm, add, RoPE, SwiGLU, row gathers. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

void kvs_cpu_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim) {
    float *o = out;
    size_t row = (size_t)dim * kvs_dtype_size(b->weight_dtype);
    for (int i = 0; i < n; i++) kvs_to_f32(o + (size_t)i * dim, (const char *)table + ids[i] * row, b->weight_dtype, dim);
}

void kvs_cpu_rmsnorm(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps) {
    float *o = out, *buf = b->weight_dtype == KVS_F32 ? NULL : kvs_cpu_scratch(b, sizeof(float) * dim);
    if (b->weight_dtype != KVS_F32 && !buf) return;
    const float *x = in, *g = kvs_cpu_weights_f32(b, w, dim, buf);
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * dim;
        double ss = 0;
        for (int j = 0; j < dim; j++) ss += (double)xi[j] * xi[j];
        float r = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int j = 0; j < dim; j++) o[(size_t)i * dim + j] = xi[j] * r * g[j];
    }
}

void kvs_cpu_head_rmsnorm(kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim,
                          float eps) {
    float *buf = b->weight_dtype == KVS_F32 ? NULL : kvs_cpu_scratch(b, sizeof(float) * head_dim);
    if (b->weight_dtype != KVS_F32 && !buf) return;
    const float *g = kvs_cpu_weights_f32(b, w, head_dim, buf);
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++)
        for (int p = 0; p < n_pieces; p++) { /* kvs_cpu_rmsnorm's arithmetic on one piece */
            float *xi = (float *)x + (size_t)i * row_stride + (size_t)p * head_dim;
            double ss = 0;
            for (int j = 0; j < head_dim; j++) ss += (double)xi[j] * xi[j];
            float r = 1.0f / sqrtf((float)(ss / head_dim) + eps);
            for (int j = 0; j < head_dim; j++) xi[j] = xi[j] * r * g[j];
        }
}

void kvs_cpu_add(kvs_backend *b, void *x, const void *y, size_t n) {
    float *a = x;
    const float *c = y;
    for (size_t i = 0; i < n; i++) a[i] += c[i];
}

void kvs_cpu_rope(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n,
                  int n_heads, int head_dim) {
    float *v = x;
    int half = head_dim / 2;
    const float *cs = kvs_cpu_rope_table(b, positions, inv_freq, n, half);
    if (!cs) return;
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++) {
        const float *c = cs + (size_t)i * 2 * half, *s = c + half;
        for (int h = 0; h < n_heads; h++) {
            float *r = v + ((size_t)i * n_heads + h) * head_dim;
            for (int k = 0; k < half; k++) {
                float x1 = r[k], x2 = r[k + half];
                r[k] = x1 * c[k] - x2 * s[k];
                r[k + half] = x2 * c[k] + x1 * s[k];
            }
        }
    }
}

void kvs_cpu_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim) {
    float *o = out;
    const float *gu = gate_up;
    const kvs_cpu_kernels *k = kvs_cpu_kernels_of(b);
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++) k->silu_mul(o + (size_t)i * dim, gu + (size_t)i * 2 * dim, gu + (size_t)i * 2 * dim + dim, dim);
}

void kvs_cpu_gather_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim) {
    float *o = out;
    const float *x = in;
    for (int i = 0; i < m; i++) memcpy(o + (size_t)i * dim, x + (size_t)idx[i] * dim, sizeof(float) * dim);
}
