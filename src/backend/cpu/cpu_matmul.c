/* matmul on the CPU: the gemv kernels (cpu_simd.h) for decode's few rows,
 * which read each weight once at the memory's pace; OpenBLAS sgemm for
 * prefill (bf16 / f16 weights widened a panel at a time). */
#include <cblas.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* Floats of w a thread widens at a time when bf16 / f16 weights go to sgemm:
 * large panels, since each sgemm call packs the whole input again. */
enum { PANEL_FLOATS = 2 << 20 };

/* Input rows [r0, r1) of thread t of nt (prefill). */
static void thread_rows(int n, int nt, int t, int *r0, int *r1) {
    int per = (n + nt - 1) / nt;
    *r0 = t * per < n ? t * per : n;
    *r1 = *r0 + per > n ? n : *r0 + per;
}

typedef struct {
    const kvs_cpu_kernels *k;
    float *out;
    const float *x, *bias;
    const void *w;
    kvs_dtype wt;
    int n, in_dim, out_dim;
} gemv_job;

static void run_gemv(void *arg, int t, int nt) {
    const gemv_job *g = arg;
    int c0, c1;
    kvs_cpu_thread_cols(g->out_dim, nt, t, &c0, &c1);
    if (c0 < c1) g->k->gemv(g->out, g->out_dim, g->x, g->w, g->wt, g->bias, g->n, g->in_dim, c0, c1);
}

int kvs_cpu_panel_rows(int in_dim) { return PANEL_FLOATS / in_dim > 16 ? PANEL_FLOATS / in_dim : 16; }

/* OpenBLAS runs single-threaded (set at backend creation); the OpenMP threads
 * split the input rows, and widen each panel together (the for's barrier:
 * the panel is whole before any thread multiplies by it). */
void kvs_cpu_sgemm_panels(float *o, int ld_out, const float *x, int n, int in_dim, int out_dim, float beta,
                          const void *w, kvs_cpu_widen_fn widen, const void *ctx, float *p) {
    int panel_rows = kvs_cpu_panel_rows(in_dim);
#pragma omp parallel num_threads(omp_get_max_threads())
    {
        int r0, r1;
        thread_rows(n, omp_get_num_threads(), omp_get_thread_num(), &r0, &r1);
        if (!widen) {
            if (r0 < r1)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, out_dim, in_dim, 1.0f, x + (size_t)r0 * in_dim,
                            in_dim, w, in_dim, beta, o + (size_t)r0 * ld_out, ld_out);
        } else {
            for (int c0 = 0; c0 < out_dim; c0 += panel_rows) {
                int nc = out_dim - c0 < panel_rows ? out_dim - c0 : panel_rows;
#pragma omp for schedule(static)
                for (int j = 0; j < nc; j++) widen(p + (size_t)j * in_dim, w, c0 + j, in_dim, ctx);
                if (r0 < r1)
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, nc, in_dim, 1.0f, x + (size_t)r0 * in_dim,
                                in_dim, p, in_dim, beta, o + (size_t)r0 * ld_out + c0, ld_out);
#pragma omp barrier /* before the next panel is widened over this one */
            }
        }
    }
}

/* a row of bf16 / f16 weights (ctx: the dtype) */
static void widen_dtype(float *dst, const void *w, int row, int in_dim, const void *ctx) {
    kvs_dtype wt = *(const kvs_dtype *)ctx;
    kvs_to_f32(dst, (const char *)w + (size_t)row * in_dim * kvs_dtype_size(wt), wt, in_dim);
}

void kvs_cpu_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                    int in_dim, int out_dim) {
    float *o = out;
    const float *x = in;
    kvs_dtype wt = b->weight_dtype;
    bool gemv = n <= KVS_CPU_GEMV_MAX_N, widen = !gemv && wt != KVS_F32;
    /* scratch: the bias as f32, then the widened panel */
    size_t bias_floats = bias && wt != KVS_F32 ? (size_t)(out_dim + 15) / 16 * 16 : 0;
    size_t panel = (size_t)kvs_cpu_panel_rows(in_dim) * in_dim;
    float *scratch = NULL;
    if (bias_floats || widen) {
        scratch = kvs_cpu_scratch(b, sizeof(float) * (bias_floats + (widen ? panel : 0)));
        if (!scratch) return;
    }
    const float *bias32 = bias ? kvs_cpu_weights_f32(b, bias, out_dim, scratch) : NULL;
    const kvs_cpu_kernels *k = kvs_cpu_kernels_of(b);
    if (gemv) { /* decode: the pool's threads split the rows of w */
        gemv_job job = {k, o, x, bias32, w, wt, n, in_dim, out_dim};
        kvs_cpu_pool_run(kvs_cpu_pool_of(b), run_gemv, &job);
        return;
    }
    if (bias32)
        for (int i = 0; i < n; i++) memcpy(o + (size_t)i * out_dim, bias32, sizeof(float) * out_dim);
    kvs_cpu_sgemm_panels(o, out_dim, x, n, in_dim, out_dim, bias32 ? 1.0f : 0.0f, w, widen ? widen_dtype : NULL, &wt,
                         widen ? scratch + bias_floats : NULL);
}
