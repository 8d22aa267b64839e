/* kvsparse bench model: prefill and decode tokens/s, and the matmuls' GFLOP/s
 * against the sgemm rate measured in the same run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "backend/comm.h"
#include "cli/cli_common.h"

/* A backend whose matmuls (bf16/f32 and fp8) and attention are timed; every other op is the inner backend's. */
typedef struct {
    kvs_backend base; /* first: the model sees this */
    kvs_backend *inner;
    double seconds, flops; /* matmul */
    double attn_seconds;
} timed_backend;

/* The inner backend idle (its work done), then the clock: what each timed op starts with. */
static double timed_start(timed_backend *t) {
    t->inner->synchronize(t->inner);
    return kvs_now();
}

/* Seconds since t0 once the op just enqueued has run. */
static double timed_stop(timed_backend *t, double t0) {
    t->inner->synchronize(t->inner);
    return kvs_now() - t0;
}

static void timed_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                         int in_dim, int out_dim) {
    timed_backend *t = (timed_backend *)b;
    double t0 = timed_start(t);
    t->inner->matmul(t->inner, out, in, w, bias, n, in_dim, out_dim);
    t->seconds += timed_stop(t, t0);
    t->flops += 2.0 * n * in_dim * out_dim;
}

static void timed_matmul_q(kvs_backend *b, void *out, int ld_out, const void *in, const void *w, uint32_t type,
                           const void *bias, int n, int in_dim, int out_dim) {
    timed_backend *t = (timed_backend *)b;
    double t0 = timed_start(t);
    t->inner->matmul_q(t->inner, out, ld_out, in, w, type, bias, n, in_dim, out_dim);
    t->seconds += timed_stop(t, t0);
    t->flops += 2.0 * n * in_dim * out_dim;
}

static void timed_matmul_fp8(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                             const float *ws, const void *bias, int n, int in_dim, int out_dim) {
    timed_backend *t = (timed_backend *)b;
    double t0 = timed_start(t);
    t->inner->matmul_fp8(t->inner, out, xq, xs, wq, ws, bias, n, in_dim, out_dim);
    t->seconds += timed_stop(t, t0);
    t->flops += 2.0 * n * in_dim * out_dim;
}

static void timed_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                            const kvs_attn_batch *ab, int n_heads, float scale) {
    timed_backend *t = (timed_backend *)b;
    double t0 = timed_start(t);
    t->inner->attention(t->inner, out, lse, q, pool, ab, n_heads, scale);
    t->attn_seconds += timed_stop(t, t0);
}

/* GFLOP/s of the backend's matmul on a square problem of size n (best of reps):
 * on the CPU, OpenBLAS sgemm on all threads. */
static double sgemm_rate(kvs_backend *be, int n, int reps) {
    size_t bytes = sizeof(float) * n * n;
    float *host = malloc(bytes);
    void *a = be->alloc(be, bytes), *c = be->alloc(be, bytes);
    for (int i = 0; i < n * n; i++) host[i] = (float)(i % 7) * 0.1f;
    be->upload_weight(be, a, host, KVS_F32, (size_t)n * n);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = kvs_now();
        be->matmul(be, c, a, a, NULL, n, n, n);
        be->synchronize(be);
        double t = kvs_now() - t0;
        if (t < best) best = t;
    }
    be->free(be, a);
    be->free(be, c);
    free(host);
    return 2.0 * n * n * n / best / 1e9;
}

/* Decode against the memory (the CPU backend, one rank): the bytes a decode
 * step reads (every weight but the untied embedding table, once, and the KV of
 * the mean context) times the tokens/s, beside a read benchmark's rate. */
static void print_decode_bandwidth(const kvs_loaded *l, const kvs_runner *g, int ctx0, int ctx1, double tokens_per_s,
                                   double attn_s_per_token) {
    if (l->world != 1) return;
    double bw = kvs_cpu_read_bandwidth(l->be, (size_t)512 << 20, 5);
    if (bw <= 0) return;
    const kvs_config *c = &l->cfg;
    double weights = (double)kvs_runner_weight_bytes_read(g); /* the formats the model keeps */
    const char *format = kvs_quantization_is_ggml(kvs_runner_quantization(g)) ? kvs_quantization_name(kvs_runner_quantization(g))
                         : c->quantization == KVS_QUANT_FP8 ? "FP8"
                                                           : kvs_dtype_name(l->be->weight_dtype);
    double kv = (double)kvs_config_kv_bytes_per_token(c, l->be->kv_dtype) * (ctx0 + ctx1) / 2;
    double rate = (weights + kv) * tokens_per_s / 1e9;
    printf("memory read rate (this run, same threads, 512 MiB): %.1f GB/s\n", bw);
    printf("decode reads %.1f MB a token (%s weights %.1f MB + %s KV %.1f MB): %.1f GB/s = %.0f%% of the read rate\n",
           (weights + kv) / 1e6, format, weights / 1e6, kvs_dtype_name(l->be->kv_dtype),
           kv / 1e6, rate, 100 * rate / bw);
    printf("decode attention: %.0f%% of decode time, its KV read at %.1f GB/s = %.0f%% of the read rate\n",
           100 * attn_s_per_token * tokens_per_s, kv / attn_s_per_token / 1e9, 100 * kv / attn_s_per_token / 1e9 / bw);
}

/* The rank's backend with its matmul timed (kvs_runner_backend_wrap): tb[rank]. */
static kvs_backend *wrap_timed(void *user, int rank, kvs_backend *be) {
    timed_backend *t = &((timed_backend *)user)[rank];
    *t = (timed_backend){*be, be, 0, 0, 0};
    t->base.matmul = timed_matmul;
    t->base.attention = timed_attention;
    if (be->matmul_fp8) t->base.matmul_fp8 = timed_matmul_fp8;
    if (be->matmul_q) t->base.matmul_q = timed_matmul_q;
    return &t->base;
}

/* The runner that bench model times: N ranks, each rank's matmul timed in
 * tb[rank]. */
static kvs_status timed_group(kvs_loaded *l, const kvs_load_options *lo, timed_backend *tb, kvs_runner **g) {
    if (l->world == 1) {
        kvs_backend *timed = wrap_timed(tb, 0, l->be);
        return kvs_runner_create(&l->cfg, l->ck, 1, &timed, NULL, -1, &lo->limits, g);
    }
    if (!l->rank_be) { /* the CPU simulation: backends made in the rank threads, wrapped there */
        int per_rank = lo->threads > 0 ? (lo->threads + l->world - 1) / l->world : 0;
        return kvs_runner_create_cpu_wrapped(&l->cfg, l->ck, l->world, per_rank, l->weight_dtype, l->kv_dtype, wrap_timed, tb,
                                             &lo->limits, g);
    }
    kvs_backend **be = calloc((size_t)l->world, sizeof *be); /* GPUs: kvs_cli_load made backends and NCCL comms */
    if (!be) return kvs_fail(KVS_ERR_NOMEM, "bench: out of memory");
    for (int r = 0; r < l->world; r++) be[r] = wrap_timed(tb, r, l->rank_be[r]);
    kvs_status st = kvs_runner_create(&l->cfg, l->ck, l->world, be, l->rank_comm, -1, &lo->limits, g);
    free(be);
    return st;
}

/* Counts what the engine delivers: tokens, and the requests that have their first token. */
typedef struct {
    int64_t tokens;
    int started, finished;
    char error[256];
} bench_counts;

static void on_output(void *user, const kvs_request_output *out) {
    bench_counts *c = user;
    c->started += out->n_tokens && out->completion_tokens == out->n_tokens;
    c->tokens += out->n_tokens;
    c->finished += out->finish != KVS_FINISH_NONE;
    if (out->finish == KVS_FINISH_ERROR) snprintf(c->error, sizeof c->error, "%s", out->error ? out->error : "error");
}

/* Submits n requests of prompt_len random tokens (seeded) generating max_tokens
 * each; their ids into req_ids (when not NULL). */
static kvs_status submit_random(kvs_engine *e, const kvs_config *cfg, int n, int prompt_len, int max_tokens,
                                uint64_t seed, bench_counts *c, uint64_t *req_ids) {
    int32_t *ids = malloc(sizeof(int32_t) * prompt_len);
    if (!ids) return kvs_fail(KVS_ERR_NOMEM, "bench: out of memory");
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    kvs_request_params p = {.prompt_ids = ids, .n_prompt = prompt_len, .sampling = kvs_sampling_default(),
                            .max_tokens = max_tokens, .ignore_eos = true};
    kvs_status st = KVS_OK;
    for (int r = 0; st == KVS_OK && r < n; r++) {
        for (int i = 0; i < prompt_len; i++) ids[i] = (int32_t)(kvs_rng_u64(&rng) % (uint64_t)cfg->vocab_size);
        st = kvs_engine_submit(e, &p, on_output, c, req_ids ? &req_ids[r] : NULL);
    }
    free(ids);
    return st;
}

/* Steps e until `started` requests have their first token and `tokens` came
 * (or it is idle); the step's error, or a request's. */
static kvs_status step_until(kvs_engine *e, bench_counts *c, int started, int64_t tokens) {
    kvs_status st = KVS_OK;
    while (st == KVS_OK && !kvs_engine_idle(e) && (c->started < started || c->tokens < tokens))
        st = kvs_engine_step(e);
    if (st == KVS_OK && c->error[0]) st = kvs_fail(KVS_ERR_INTERNAL, "%s", c->error);
    return st;
}

/* Decode-step time at batch sizes `batches` over a context of about ctx
 * tokens per sequence, eager vs CUDA graphs, through the engine: in each mode
 * B requests of ctx random tokens are prefilled (one a step), then n_steps
 * steps of the B decodes are timed after 3 warm-up steps (a bucket's first
 * step runs eagerly, the second is captured), and the requests are aborted.
 * Every step ends with the sampled ids read back. Graph counts are rank 0's. */
static kvs_status bench_decode_steps(kvs_loaded *l, kvs_runner *g, const int32_t *batches, int n_batches, int ctx,
                                     int n_steps) {
    int max_b = 0;
    for (int i = 0; i < n_batches; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = max_b;
    c.max_num_batched_tokens = ctx > max_b ? ctx : max_b;
    c.max_waiting = max_b;
    int max_tokens = max_b + 3 + n_steps; /* the first ones decode while the others prefill */
    c.kv_memory_bytes = kvs_cli_kv_bytes_for(l, &c.default_policy, c.enable_prefix_caching, ctx, max_tokens, max_b);
    uint64_t *req_ids = malloc(sizeof(uint64_t) * max_b);
    kvs_engine *e = NULL;
    kvs_status st = req_ids ? kvs_engine_create_runner(g, NULL, &c, &e) : kvs_fail(KVS_ERR_NOMEM, "bench: out of memory");
    if (st != KVS_OK) {
        free(req_ids);
        return st;
    }
    printf("decode steps (context %d per sequence, %d timed steps; graphs %s on this backend):\n", ctx, n_steps,
           l->be->graph_begin ? "available" : "not available");
    for (int bi = 0; st == KVS_OK && bi < n_batches; bi++) {
        int B = batches[bi];
        double ms[2] = {0, 0};
        kvs_graph_stats gs = {0};
        for (int mode = 0; st == KVS_OK && mode < 2; mode++) {
            kvs_runner_set_graph_mode(g, mode == 0 ? KVS_GRAPHS_OFF : KVS_GRAPHS_ON);
            bench_counts n = {0};
            st = submit_random(e, &l->cfg, B, ctx, max_tokens, (uint64_t)bi, &n, req_ids);
            if (st == KVS_OK) st = step_until(e, &n, B, 0); /* the prefills */
            kvs_graph_stats g0 = kvs_runner_graph_stats(g);
            if (st == KVS_OK) st = step_until(e, &n, B, n.tokens + 3 * B); /* warm-up */
            double t0 = kvs_now();
            if (st == KVS_OK) st = step_until(e, &n, B, n.tokens + (int64_t)n_steps * B);
            ms[mode] = (kvs_now() - t0) * 1e3 / n_steps;
            if (mode == 1) {
                kvs_graph_stats g1 = kvs_runner_graph_stats(g);
                gs.captures = g1.captures - g0.captures, gs.replays = g1.replays - g0.replays;
                gs.capture_failures = g1.capture_failures - g0.capture_failures;
            }
            for (int r = 0; r < B; r++) kvs_engine_abort(e, req_ids[r]);
            if (st == KVS_OK) st = step_until(e, &n, B + 1, 0); /* runs the aborts: idle */
        }
        if (st == KVS_OK)
            printf("  batch %3d: eager %.3f ms/step, graphs %.3f ms/step (%.2fx; %lld captures, %lld replays, "
                   "%lld capture failures)\n",
                   B, ms[0], ms[1], ms[0] / ms[1], (long long)gs.captures, (long long)gs.replays,
                   (long long)gs.capture_failures);
    }
    kvs_runner_set_graph_mode(g, KVS_GRAPHS_ON);
    kvs_engine_destroy(e);
    free(req_ids);
    return st;
}

static void bench_model_usage(FILE *f) {
    fprintf(f, "usage: kvsparse bench model (-m MODEL_DIR | --config CONFIG.json --load-format dummy) [options]\n"
               "Prefill and decode tokens/s of one sequence, and the matmul rate against sgemm's.\n"
               "  --prompt-len N         prompt tokens, random ids (default 1024)\n"
               "  --decode-len N         tokens decoded after the prompt (default 128)\n"
               "  --decode-batches B,..  also time decode steps of B sequences at context --prompt-len,\n"
               "                         eager vs CUDA graphs (--decode-len steps each)\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP
               "With --tensor-parallel-size N > 1 the tokens/s are the group's, the matmul figures rank 0's slice.\n");
}

static int bench_model(int argc, char **argv) {
    kvs_load_options lo = {.skip_model = true, .allow_tp = true};
    int prompt_len = 1024, decode_len = 128, n_batches = 0;
    int32_t *batches = NULL;
    for (int i = 1; i < argc; i++) {
        int r = kvs_cli_load_option(&lo, argc, argv, &i);
        if (r > 0) continue;
        if (r == 0 && (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))) {
            bench_model_usage(stdout);
            free(batches);
            return 0;
        }
        if (r == 0 && !strcmp(argv[i], "--prompt-len") && i + 1 < argc) prompt_len = atoi(argv[++i]);
        else if (r == 0 && !strcmp(argv[i], "--decode-len") && i + 1 < argc) decode_len = atoi(argv[++i]);
        else if (r == 0 && !strcmp(argv[i], "--decode-batches") && i + 1 < argc && !batches &&
                 kvs_cli_parse_ids(argv[++i], &batches, &n_batches))
            continue;
        else {
            fprintf(stderr, "kvsparse bench model: bad or incomplete option '%s'\n", argv[i]);
            bench_model_usage(stderr);
            free(batches);
            return 2;
        }
    }
    for (int i = 0; i < n_batches; i++)
        if (batches[i] < 1 || batches[i] > 1024) {
            fprintf(stderr, "kvsparse bench model: --decode-batches: %d is not in 1..1024\n", batches[i]);
            free(batches);
            return 2;
        }
    if (prompt_len <= 0 || decode_len <= 0) {
        fprintf(stderr, "kvsparse bench model: --prompt-len and --decode-len must be positive\n");
        return 2;
    }
    /* the prefill in one step; decode steps of up to the largest batch (whose
       requests decode while the later ones prefill: max_b more tokens each) */
    lo.limits = (kvs_step_limits){prompt_len, 1, prompt_len + decode_len + 8, 0};
    for (int i = 0; i < n_batches; i++) {
        if (batches[i] > lo.limits.max_seqs) lo.limits.max_seqs = batches[i];
        if (batches[i] > lo.limits.max_tokens) lo.limits.max_tokens = batches[i];
    }
    if (n_batches > 0) lo.limits.max_len += lo.limits.max_seqs + 3;
    kvs_loaded l;
    if (kvs_cli_load(&lo, &l) != KVS_OK) return kvs_cli_error();
    int world = l.world;
    timed_backend *tb = calloc((size_t)world, sizeof *tb);
    kvs_runner *g = NULL;
    kvs_status st = tb ? timed_group(&l, &lo, tb, &g) : kvs_fail(KVS_ERR_NOMEM, "bench: out of memory");
    /* the timed matmul synchronizes, which no graph can capture: this part runs eagerly */
    if (st == KVS_OK) kvs_runner_set_graph_mode(g, KVS_GRAPHS_OFF);
    /* one request: its prompt in one prefill step, then decode_len decode steps */
    int total = prompt_len + decode_len;
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 1;
    c.max_num_batched_tokens = prompt_len;
    c.kv_memory_bytes = kvs_cli_kv_bytes_for(&l, &c.default_policy, c.enable_prefix_caching, prompt_len, decode_len + 1, 1);
    kvs_engine *e = NULL;
    bench_counts n = {0};
    if (st == KVS_OK) st = kvs_engine_create_runner(g, NULL, &c, &e);
    if (st == KVS_OK) st = submit_random(e, &l.cfg, 1, prompt_len, decode_len + 1, 1, &n, NULL);
    double t0 = kvs_now();
    if (st == KVS_OK) st = step_until(e, &n, 1, 0);
    double t_prefill = kvs_now() - t0, mm_prefill = tb[0].seconds, fl_prefill = tb[0].flops;
    for (int r = 0; r < world; r++) tb[r].seconds = tb[r].flops = tb[r].attn_seconds = 0;
    t0 = kvs_now();
    if (st == KVS_OK) st = step_until(e, &n, 1, decode_len + 1);
    double t_decode = kvs_now() - t0;
    kvs_engine_destroy(e);
    if (st != KVS_OK) {
        kvs_cli_error();
    } else {
        /* on GPUs the calling thread works on rank 0's device, like the rank 0 thread */
        if (l.rank_comm && l.rank_comm[0]->bind_thread) l.rank_comm[0]->bind_thread(l.rank_comm[0]);
        double peak = sgemm_rate(l.be, 1024, 5);
        char ranks[64] = "";
        if (world > 1) snprintf(ranks, sizeof ranks, " (rank 0's slice of %d)", world);
        printf("model: %s, %d layers, hidden %d, backend %s, tensor parallel %d\n", l.cfg.architecture,
               l.cfg.n_layers, l.cfg.hidden_size, l.be->name, world);
        printf("prefill: %d tokens in %.3f s = %.1f tokens/s\n", prompt_len, t_prefill, prompt_len / t_prefill);
        printf("decode:  %d tokens in %.3f s = %.1f tokens/s (context %d..%d)\n", decode_len, t_decode,
               decode_len / t_decode, prompt_len, total);
        printf("matmul 1024^3 rate (this run, same backend): %.1f GFLOP/s\n", peak);
        printf("prefill matmuls%s: %.1f GFLOP/s = %.0f%% of sgemm; %.0f%% of prefill time\n", ranks,
               fl_prefill / mm_prefill / 1e9, 100 * fl_prefill / mm_prefill / 1e9 / peak,
               100 * mm_prefill / t_prefill);
        printf("decode matmuls%s:  %.1f GFLOP/s = %.0f%% of sgemm; %.0f%% of decode time\n", ranks,
               tb[0].flops / tb[0].seconds / 1e9, 100 * tb[0].flops / tb[0].seconds / 1e9 / peak,
               100 * tb[0].seconds / t_decode);
        print_decode_bandwidth(&l, g, prompt_len, total, decode_len / t_decode, tb[0].attn_seconds / decode_len);
    }
    if (st == KVS_OK && n_batches > 0) {
        /* untimed: the timing synchronizes, which no graph can capture */
        for (int r = 0; r < world; r++) tb[r].base.matmul = tb[r].inner->matmul;
        st = bench_decode_steps(&l, g, batches, n_batches, prompt_len, decode_len);
        if (st != KVS_OK) kvs_cli_error();
    }
    free(batches);
    kvs_runner_destroy(g); /* the ranks' models and caches */
    free(tb);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : 1;
}

int kvs_cmd_bench(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "model")) return bench_model(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "tokenizer")) return kvs_cmd_bench_tokenizer(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "throughput")) return kvs_cmd_bench_throughput(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "serve")) return kvs_cmd_bench_serve(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    fprintf(help ? stdout : stderr,
            "usage: kvsparse bench (model | tokenizer | throughput | serve) [options]\n"
            "  model       prefill and decode tokens/s of one sequence, matmul GFLOP/s\n"
            "  tokenizer   tokenizer.json load time and encode MB/s\n"
            "  throughput  offline serving: many requests through the engine, tokens/s\n"
            "  serve       a running server over HTTP: throughput and latency per concurrency\n"
            "Run 'kvsparse bench COMMAND --help' for a command's options.\n");
    return help ? 0 : 2;
}
