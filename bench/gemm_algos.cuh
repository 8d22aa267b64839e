/* kvs_bench_kernels gemmalgo: the algorithm cuBLASLt's heuristic puts first (the one
 * kvs_cuda_gemm_plan_for keeps) against each of its first KVS_BENCH_ALGOS candidates,
 * timed on Llama-3-8B's bf16 GEMM shapes at a mixed step's 8,192 rows and a decode
 * step's 256 and 128: whether timing the candidates once (an autotuner) would pay.
 * Included by kernels.cu after time_it and fill. */
#define KVS_BENCH_ALGOS 16

struct algo_ctx {
    kvs_cuda *c;
    kvs_cuda_gemm_plan *p;
    const cublasLtMatmulAlgo_t *algo;
    void *out, *in, *w;
    bool failed;
};
static void run_algo(kvs_backend *b, void *v) {
    (void)b;
    algo_ctx *a = (algo_ctx *)v;
    float alpha = 1.0f, beta = 0.0f;
    if (cublasLtMatmul(a->c->lt, a->p->op, &alpha, a->w, a->p->a, a->in, a->p->b, &beta, a->out, a->p->c, a->out,
                       a->p->c, a->algo, a->c->lt_workspace, a->c->lt_workspace_bytes,
                       a->c->stream) != CUBLAS_STATUS_SUCCESS)
        a->failed = true;
}

static bool bench_gemm_algos(kvs_backend *b) {
    kvs_cuda *c = kvs_cuda_of(b);
    struct shape { const char *name; int in, out; };
    const shape shapes[] = {{"q/k/v 4096 -> 6144", 4096, 6144},
                            {"o 4096 -> 4096", 4096, 4096},
                            {"gate/up 4096 -> 28672", 4096, 28672},
                            {"down 14336 -> 4096", 14336, 4096}};
    const int rows[] = {8192, 4096, 256, 128};
    size_t max_in = 8192 * (size_t)14336, max_w = 4096 * (size_t)28672, max_out = 8192 * (size_t)28672;
    void *in = b->alloc(b, max_in * 2), *w = b->alloc(b, max_w * 2), *out = b->alloc(b, max_out * 2);
    if (!in || !w || !out) return false;
    fill((bf16 *)in, max_in, 11), fill((bf16 *)w, max_w, 12);
    printf("| bf16 GEMM (cuBLASLt) | rows | heuristic's first: TFLOP/s | best of the first %d (its rank) | "
           "candidates that ran | best / first |\n| --- | --- | --- | --- | --- | --- |\n", KVS_BENCH_ALGOS);
    for (int r = 0; r < (int)(sizeof rows / sizeof rows[0]); r++) {
        double t_first_sum = 0, t_best_sum = 0;
        for (const shape &s : shapes) {
            const int n = rows[r];
            kvs_cuda_gemm_plan *p = kvs_cuda_gemm_plan_for(b, KVS_GEMM_BF16, 0, n, s.in, s.out, 0, 0);
            if (!p) return false;
            cublasLtMatmulPreference_t pref = NULL;
            cublasLtMatmulHeuristicResult_t res[KVS_BENCH_ALGOS];
            int found = 0;
            if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return false;
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &c->lt_workspace_bytes,
                                                 sizeof c->lt_workspace_bytes);
            cublasStatus_t hs =
                cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, KVS_BENCH_ALGOS, res, &found);
            cublasLtMatmulPreferenceDestroy(pref);
            if (hs != CUBLAS_STATUS_SUCCESS || found == 0) return false;
            const double flop = 2.0 * n * s.in * s.out;
            const int iters = n >= 4096 ? 10 : 50;
            double t_first = 0, t_best = 1e30;
            int best = -1, ran = 0;
            for (int i = 0; i < found; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                algo_ctx a = {c, p, &res[i].algo, out, in, w, false};
                double t = time_it(b, iters, run_algo, &a);
                if (a.failed) continue;
                ran++;
                if (i == 0) t_first = t;
                if (t < t_best) t_best = t, best = i;
            }
            if (t_first <= 0) return false;
            t_first_sum += t_first, t_best_sum += t_best;
            printf("| %s | %d | %.1f | %.1f (%d) | %d | %.3f |\n", s.name, n, flop / t_first / 1e12,
                   flop / t_best / 1e12, best, ran, t_first / t_best);
        }
        printf("| a layer's four | %d | %.3f ms | %.3f ms | | %.3f |\n", rows[r], t_first_sum * 1e3, t_best_sum * 1e3,
               t_first_sum / t_best_sum);
    }
    b->free(b, in), b->free(b, w), b->free(b, out);
    return true;
}
