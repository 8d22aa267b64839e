/* FP8 E4M3 on the CPU: the reference semantics of the quantize_fp8 and
 * matmul_fp8 ops (backend.h). Codes decode exactly (a 256-entry table), the
 * products of two codes are exact in f32 and OpenBLAS sums them in f32; the
 * scales multiply the sum afterwards, as on the GPU. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

enum { PANEL_FLOATS = 1 << 20 };

static float load(const void *x, kvs_dtype t, size_t i) {
    switch (t) {
    case KVS_BF16: return kvs_bf16_to_f32(((const uint16_t *)x)[i]);
    case KVS_F16: return kvs_f16_to_f32(((const uint16_t *)x)[i]);
    default: return ((const float *)x)[i];
    }
}

void kvs_cpu_quantize_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows,
                          int cols) {
    if (x_dtype != KVS_F32 && x_dtype != KVS_BF16 && x_dtype != KVS_F16) {
        kvs_cpu_fail(b, KVS_ERR_INVALID, "quantize_fp8: input dtype %s (F32, BF16 or F16 expected)",
                     kvs_dtype_name(x_dtype));
        return;
    }
#pragma omp parallel for if ((size_t)rows * cols > 65536)
    for (int r = 0; r < rows; r++) {
        size_t at = (size_t)r * cols;
        float m = 0.f;
        for (int c = 0; c < cols; c++) m = fmaxf(m, fabsf(load(x, x_dtype, at + c)));
        float s = m / KVS_E4M3_MAX;
        if (!(s > 0.f)) s = 1.f;
        scale[r] = s;
        for (int c = 0; c < cols; c++) q[at + c] = kvs_f32_to_e4m3(load(x, x_dtype, at + c) / s);
    }
}

void kvs_cpu_matmul_fp8(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                        const float *ws, const void *bias, int n, int in_dim, int out_dim) {
    if (n <= 0 || out_dim <= 0) return;
    float lut[256]; /* the codes' values */
    for (int i = 0; i < 256; i++) lut[i] = kvs_e4m3_to_f32((uint8_t)i);
    int nt = omp_get_max_threads();
    int panel_rows = PANEL_FLOATS / in_dim > 16 ? PANEL_FLOATS / in_dim : 16;
    size_t xn = (size_t)n * in_dim, panel = (size_t)panel_rows * in_dim;
    size_t bias_floats = bias ? (size_t)(out_dim + 15) / 16 * 16 : 0;
    float *scratch = kvs_cpu_scratch(b, sizeof(float) * (xn + bias_floats + panel * nt));
    if (!scratch) return;
    float *x = scratch, *bias32 = bias ? scratch + xn : NULL, *o = out;
    for (size_t i = 0; i < xn; i++) x[i] = lut[xq[i]];
    if (bias) kvs_to_f32(bias32, bias, b->weight_dtype, (size_t)out_dim);
#pragma omp parallel num_threads(nt)
    {
        int c0, c1, t = omp_get_thread_num();
        kvs_cpu_thread_cols(out_dim, omp_get_num_threads(), t, &c0, &c1);
        float *p = scratch + xn + bias_floats + panel * t;
        for (int r0 = c0; r0 < c1; r0 += panel_rows) {
            int nr = c1 - r0 < panel_rows ? c1 - r0 : panel_rows;
            const uint8_t *w = wq + (size_t)r0 * in_dim;
            for (size_t i = 0; i < (size_t)nr * in_dim; i++) p[i] = lut[w[i]];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, nr, in_dim, 1.0f, x, in_dim, p, in_dim, 0.0f,
                        o + r0, out_dim);
            for (int i = 0; i < n; i++)
                for (int c = r0; c < r0 + nr; c++) {
                    float v = o[(size_t)i * out_dim + c] * xs[i] * ws[c];
                    o[(size_t)i * out_dim + c] = bias32 ? v + bias32[c] : v;
                }
        }
    }
}
