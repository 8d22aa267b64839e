/* GEMM rates of kvs_bench_kernels: cuBLASLt bf16 against the FP8 matmul_fp8
 * op in each of its scaling modes (kvs_cuda_options.fp8_gemm), on the same
 * backend in the same run, at 8192^3 and at a prefill shape of Llama-3-8B's
 * down projection (4096 tokens x 14336 in -> 4096 out); and the per-token
 * activation quantization (quantize_fp8) that an FP8 GEMM's input needs.
 * Then decode shapes (1 and 64 tokens through 8B's gate/up, 4096 -> 28672),
 * where the weights' bytes set the time: microseconds and weight GB/s.
 * Included by bench/kernels.cu (uses its fill and time_it). */

struct gemm_shape { int n, in_dim, out_dim; const char *name; };
struct fp8_gemm_ctx { void *out; const void *in, *w; uint8_t *xq, *wq; float *xs, *ws; int n, in_dim, out_dim; };

static void run_bf16_gemm(kvs_backend *b, void *p) {
    fp8_gemm_ctx *c = (fp8_gemm_ctx *)p;
    b->matmul(b, c->out, c->in, c->w, NULL, c->n, c->in_dim, c->out_dim);
}
static void run_fp8_gemm(kvs_backend *b, void *p) {
    fp8_gemm_ctx *c = (fp8_gemm_ctx *)p;
    b->matmul_fp8(b, c->out, c->xq, c->xs, c->wq, c->ws, NULL, c->n, c->in_dim, c->out_dim);
}
/* The ceiling of the scaled forms: cuBLASLt e4m3 -> bf16 with unit scales, fast accumulation. */
static void run_fp8_unscaled(kvs_backend *b, void *p) {
    fp8_gemm_ctx *c = (fp8_gemm_ctx *)p;
    kvs_cuda *cu = kvs_cuda_of(b);
    kvs_cuda_gemm_plan *pl = kvs_cuda_gemm_plan_for(b, KVS_GEMM_FP8_BF16, 1, c->n, c->in_dim, c->out_dim, 0, 0);
    float alpha = 1.0f, beta = 0.0f;
    int ok = 1;
    if (pl)
        LT_CHECK(b, cublasLtMatmul(cu->lt, pl->op, &alpha, c->wq, pl->a, c->xq, pl->b, &beta, c->out, pl->c, c->out,
                                   pl->c, &pl->algo, cu->lt_workspace, cu->lt_workspace_bytes, cu->stream),
                 ok);
    if (!ok) return; /* reported */
}
static void run_fp8_quantize(kvs_backend *b, void *p) {
    fp8_gemm_ctx *c = (fp8_gemm_ctx *)p;
    b->quantize_fp8(b, c->xq, c->xs, c->in, KVS_BF16, c->n, c->in_dim);
}

enum { N_FP8_MODES = 4, N_GEMM_SHAPES = 4, N_PREFILL_SHAPES = 2 };
static const int fp8_modes[N_FP8_MODES] = {KVS_CUDA_FP8_OUTER_FAST, KVS_CUDA_FP8_OUTER, KVS_CUDA_FP8_EPILOGUE_FAST,
                                           KVS_CUDA_FP8_EPILOGUE};
static const char *fp8_mode_names[N_FP8_MODES] = {"outer-vector scales, fast accum", "outer-vector scales",
                                                  "f32 out + scale kernel, fast accum", "f32 out + scale kernel"};

struct gemm_rates {
    gemm_shape shape;
    double bf16_tf, fp8_tf[N_FP8_MODES]; /* 0: the mode failed */
    double unscaled_tf;                  /* e4m3 -> bf16, unit scales: no per-row scaling at all */
    double t_quant;                      /* activation quantize_fp8 of [n][in_dim], seconds */
};

/* Rates of every shape into r[N_GEMM_SHAPES]; false when memory or FP8 is missing. */
static bool bench_gemm_rates(kvs_backend *b, gemm_rates *r) {
    const gemm_shape shapes[N_GEMM_SHAPES] = {{8192, 8192, 8192, "8192^3"},
                                              {4096, 14336, 4096, "4096 tokens x 14336 -> 4096 (8B down proj)"},
                                              {1, 4096, 28672, "decode 1 token x 4096 -> 28672 (8B gate/up)"},
                                              {64, 4096, 28672, "decode 64 tokens x 4096 -> 28672 (8B gate/up)"}};
    if (!b->matmul_fp8) return fprintf(stderr, "gemm: no FP8 on this GPU\n"), false;
    kvs_cuda *c = kvs_cuda_of(b);
    int saved_mode = c->fp8_gemm;
    for (int s = 0; s < N_GEMM_SHAPES; s++) {
        const gemm_shape &g = shapes[s];
        size_t xe = (size_t)g.n * g.in_dim, we = (size_t)g.out_dim * g.in_dim, oe = (size_t)g.n * g.out_dim;
        fp8_gemm_ctx ctx = {b->alloc(b, oe * 2), b->alloc(b, xe * 2), b->alloc(b, we * 2),
                            (uint8_t *)b->alloc(b, xe), (uint8_t *)b->alloc(b, we), (float *)b->alloc(b, 4 * g.n),
                            (float *)b->alloc(b, 4 * g.out_dim), g.n, g.in_dim, g.out_dim};
        if (!ctx.out || !ctx.in || !ctx.w || !ctx.xq || !ctx.wq || !ctx.xs || !ctx.ws)
            return fprintf(stderr, "gemm: out of memory\n"), false;
        fill((bf16 *)ctx.in, xe, 11), fill((bf16 *)ctx.w, we, 12);
        b->quantize_fp8(b, ctx.wq, ctx.ws, ctx.w, KVS_BF16, g.out_dim, g.in_dim);
        b->quantize_fp8(b, ctx.xq, ctx.xs, ctx.in, KVS_BF16, g.n, g.in_dim);
        double flop = 2.0 * g.n * (double)g.in_dim * g.out_dim;
        r[s].shape = g;
        r[s].bf16_tf = flop / time_it(b, 10, run_bf16_gemm, &ctx) / 1e12;
        for (int m = 0; m < N_FP8_MODES; m++) {
            c->fp8_gemm = fp8_modes[m];
            int failed_before = c->failed;
            double t = time_it(b, 20, run_fp8_gemm, &ctx);
            r[s].fp8_tf[m] = c->failed && !failed_before ? 0 : flop / t / 1e12;
            if (c->failed && !failed_before) { /* a mode cuBLASLt lacks: say so, go on */
                fprintf(stderr, "gemm %s, fp8 %s: failed (%s)\n", g.name, fp8_mode_names[m], c->failure);
                c->failed = 0;
                cudaGetLastError();
            }
            printf("gemm: %s, fp8 %s: %.1f TFLOP/s\n", g.name, fp8_mode_names[m], r[s].fp8_tf[m]);
        }
        c->fp8_gemm = saved_mode;
        r[s].unscaled_tf = flop / time_it(b, 20, run_fp8_unscaled, &ctx) / 1e12;
        printf("gemm: %s, fp8 unit scales, bf16 out (ceiling): %.1f TFLOP/s\n", g.name, r[s].unscaled_tf);
        r[s].t_quant = time_it(b, 20, run_fp8_quantize, &ctx);
        printf("gemm: %s, bf16 %.1f TFLOP/s; activation quantize_fp8 [%d][%d] %.1f us\n", g.name, r[s].bf16_tf, g.n,
               g.in_dim, r[s].t_quant * 1e6);
        void *all[] = {ctx.out, (void *)ctx.in, (void *)ctx.w, ctx.xq, ctx.wq, ctx.xs, ctx.ws};
        for (void *p : all) b->free(b, p);
    }
    return true;
}

/* The decode shapes: microseconds a GEMM and the weights' bytes per second. */
static void print_decode_gemms(const gemm_rates *r) {
    printf("| decode GEMM | bf16 us (weight GB/s) |");
    for (int m = 0; m < N_FP8_MODES; m++) printf(" fp8 %s |", fp8_mode_names[m]);
    printf(" fp8 unit scales | quantize_fp8 of the input |\n| --- | --- |");
    for (int m = 0; m < N_FP8_MODES; m++) printf(" --- |");
    printf(" --- | --- |\n");
    for (int s = N_PREFILL_SHAPES; s < N_GEMM_SHAPES; s++) {
        const gemm_shape &g = r[s].shape;
        double flop = 2.0 * g.n * (double)g.in_dim * g.out_dim, wb = (double)g.in_dim * g.out_dim;
        double t = flop / (r[s].bf16_tf * 1e12);
        printf("| %s | %.1f (%.0f) |", g.name, t * 1e6, 2 * wb / t / 1e9);
        for (int m = 0; m < N_FP8_MODES; m++) {
            double tm = r[s].fp8_tf[m] > 0 ? flop / (r[s].fp8_tf[m] * 1e12) : 0;
            printf(" %.1f (%.0f) |", tm * 1e6, tm > 0 ? wb / tm / 1e9 : 0.0);
        }
        double tu = flop / (r[s].unscaled_tf * 1e12);
        printf(" %.1f (%.0f) | %.1f us |\n", tu * 1e6, wb / tu / 1e9, r[s].t_quant * 1e6);
    }
}

static void print_gemm_rates(const gemm_rates *r) {
    printf("| GEMM (cuBLASLt, same run) | bf16 TFLOP/s |");
    for (int m = 0; m < N_FP8_MODES; m++) printf(" fp8 %s |", fp8_mode_names[m]);
    printf(" fp8 unit scales, bf16 out (ceiling) | quantize_fp8 of the input | best fp8 incl. the quantize / bf16 |\n"
           "| --- | --- | --- |");
    for (int m = 0; m < N_FP8_MODES; m++) printf(" --- |");
    printf(" --- | --- |\n");
    for (int s = 0; s < N_PREFILL_SHAPES; s++) {
        const gemm_shape &g = r[s].shape;
        double flop = 2.0 * g.n * (double)g.in_dim * g.out_dim, best = 0;
        printf("| %s | %.1f |", g.name, r[s].bf16_tf);
        for (int m = 0; m < N_FP8_MODES; m++) {
            printf(" %.1f (%.2fx) |", r[s].fp8_tf[m], r[s].fp8_tf[m] / r[s].bf16_tf);
            if (r[s].fp8_tf[m] > best) best = r[s].fp8_tf[m];
        }
        double t_best = best > 0 ? flop / (best * 1e12) : 0;
        printf(" %.1f (%.2fx) | %.1f us | %.2fx |\n", r[s].unscaled_tf, r[s].unscaled_tf / r[s].bf16_tf, r[s].t_quant * 1e6,
               best > 0 ? (flop / (r[s].bf16_tf * 1e12)) / (t_best + r[s].t_quant) : 0.0);
    }
    printf("\n");
    print_decode_gemms(r);
}
