/* matmul on the CPU: OpenBLAS sgemm, fp32. */
#include <cblas.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* OpenBLAS runs single-threaded (set at backend creation); the OpenMP threads
 * split the output columns, so one thread pool serves every op. */
void kvs_cpu_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                    int in_dim, int out_dim) {
    float *o = out;
    const float *x = in, *wt = w;
    if (bias) {
        for (int i = 0; i < n; i++) memcpy(o + (size_t)i * out_dim, bias, sizeof(float) * out_dim);
    }
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int per = (out_dim + nt - 1) / nt;
        per = (per + 15) / 16 * 16;
        int c0 = t * per, c1 = c0 + per > out_dim ? out_dim : c0 + per;
        if (c0 < c1)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, c1 - c0, in_dim, 1.0f, x, in_dim,
                        wt + (size_t)c0 * in_dim, in_dim, bias ? 1.0f : 0.0f, o + c0, out_dim);
    }
}
