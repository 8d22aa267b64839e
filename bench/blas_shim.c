/* A minimal stand-in for libopenblas.so.0 (cblas_sgemm, openblas_set_num_threads)
 * for running the CPU oracle on the GPU machine, whose image has no OpenBLAS and
 * where the real library (36 MB) does not fit the transfer limit. Correct for
 * every row-major transpose combination; fast only for A x B^T (the matmul
 * shape the CPU backend uses). Built by scripts/gpu-check --pack; never linked
 * into the project. */
#include <stddef.h>

enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112 };

void openblas_set_num_threads(int n) { (void)n; }

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == ColMajor) { /* C^T = B^T A^T in row-major terms */
        cblas_sgemm(RowMajor, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static)
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            float acc[8] = {0};
            float s = 0;
            if (ta == NoTrans && tb == Trans) {
                const float *x = a + (size_t)i * lda, *y = b + (size_t)j * ldb;
                int p = 0;
                for (; p + 8 <= k; p += 8)
                    for (int u = 0; u < 8; u++) acc[u] += x[p + u] * y[p + u];
                for (; p < k; p++) s += x[p] * y[p];
            } else {
                for (int p = 0; p < k; p++) {
                    float x = ta == NoTrans ? a[(size_t)i * lda + p] : a[(size_t)p * lda + i];
                    float y = tb == NoTrans ? b[(size_t)p * ldb + j] : b[(size_t)j * ldb + p];
                    s += x * y;
                }
            }
            for (int u = 0; u < 8; u++) s += acc[u];
            float *o = c + (size_t)i * ldc + j;
            *o = alpha * s + (beta == 0.0f ? 0.0f : beta * *o);
        }
    }
}
