/* kvsparse bench throughput: offline throughput of the engine loop with every
 * request queued at once (random prompt ids, seeded), like vLLM's
 * benchmark_throughput. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "engine/engine.h"

typedef struct {
    kvs_load_options load;
    kvs_kv_policy policy;
    int input_len, output_len, num_prompts, max_num_seqs, max_num_batched_tokens;
    int n;           /* --n: choices per prompt (num_prompts sequences in all) */
    bool n_separate; /* --n-separate: the same prompt n times as separate requests (the baseline of --n) */
    kvs_cli_memory mem;
    uint64_t seed;
    bool ignore_eos, json, prefix_caching;
} tp_options;

typedef struct {
    uint64_t tokens, finished;
} tp_counts;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse bench throughput (-m MODEL_DIR | --config CONFIG.json --load-format dummy) [options]\n"
               "  --input-len N          prompt tokens per request (default 4000)\n"
               "  --output-len N         tokens generated per request (default 500)\n"
               "  --num-prompts N        requests, all queued at once (default 100)\n"
               "  --ignore-eos           always generate --output-len tokens\n"
               "  --n N                  N choices per prompt (temperature 1; --num-prompts sequences in all):\n"
               "                         one request with n = N each (the prompt prefilled once)\n"
               "  --n-separate           with --n: the same prompt in N separate requests instead\n"
               "  --max-num-seqs N       running sequences at most (default 64)\n"
               "  --max-num-batched-tokens N  tokens per step (default 2048)\n"
               KVS_CLI_MEMORY_HELP
               "  --seed S               prompt ids seed (default 0)\n"
               KVS_CLI_PREFIX_CACHING_HELP
               "  --json                 print one JSON object\n"
               "  --profile              time every op and add up the wall time by phase (GEMMs, attention,\n"
               "                         other kernels of prefill, decode and mixed steps; sparsify; sampling;\n"
               "                         host): a table, or \"profile\" in the JSON; decode runs without graphs\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP);
}

static bool parse_pos_int(const char *s, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v <= 0 || v > (1 << 30)) return false;
    *out = (int)v;
    return true;
}

static int parse_args(int argc, char **argv, tp_options *o) {
    memset(o, 0, sizeof *o);
    o->policy = kvs_kv_policy_default(KVS_POLICY_FULL);
    o->load.allow_tp = true;
    o->input_len = 4000;
    o->output_len = 500;
    o->num_prompts = 100;
    o->max_num_seqs = 64;
    o->max_num_batched_tokens = 2048;
    o->prefix_caching = kvs_engine_config_default().enable_prefix_caching;
    o->mem = kvs_cli_memory_default();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int r = kvs_cli_load_option(&o->load, argc, argv, &i);
        if (r == 0) r = kvs_cli_policy_option(&o->policy, &o->load.kv_profile, argc, argv, &i);
        if (r == 0) r = kvs_cli_prefix_caching_option(&o->prefix_caching, a);
        if (r == 0) r = kvs_cli_memory_option(&o->mem, argc, argv, &i);
        if (r < 0) goto bad;
        if (r > 0) continue;
        bool v = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = true;
        else if (!strcmp(a, "--json")) o->json = true;
        else if (!strcmp(a, "--profile")) o->load.profile = true;
        else if (!strcmp(a, "--n-separate")) o->n_separate = true;
        else if (!strcmp(a, "--n") && v) { if (!parse_pos_int(argv[++i], &o->n) || o->n > KVS_MAX_N) goto bad; }
        else if (!strcmp(a, "--input-len") && v) { if (!parse_pos_int(argv[++i], &o->input_len)) goto bad; }
        else if (!strcmp(a, "--output-len") && v) { if (!parse_pos_int(argv[++i], &o->output_len)) goto bad; }
        else if (!strcmp(a, "--num-prompts") && v) { if (!parse_pos_int(argv[++i], &o->num_prompts)) goto bad; }
        else if (!strcmp(a, "--max-num-seqs") && v) { if (!parse_pos_int(argv[++i], &o->max_num_seqs)) goto bad; }
        else if (!strcmp(a, "--max-num-batched-tokens") && v) {
            if (!parse_pos_int(argv[++i], &o->max_num_batched_tokens)) goto bad;
        } else if (!strcmp(a, "--seed") && v) o->seed = strtoull(argv[++i], NULL, 10);
        else goto bad;
        continue;
    bad:
        fprintf(stderr, "kvsparse bench throughput: bad or incomplete option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    if (kvs_cli_memory_check(&o->mem) != KVS_OK) {
        fprintf(stderr, "kvsparse bench throughput: %s\n", kvs_last_error());
        return 2;
    }
    return -1;
}

static void on_output(void *user, const kvs_request_output *out) {
    tp_counts *c = user;
    c->tokens += out->n_tokens;
    if (out->finish != KVS_FINISH_NONE) c->finished++;
    if (out->finish == KVS_FINISH_ERROR) kvs_log(KVS_LOG_WARN, "request %llu: %s", (unsigned long long)out->request_id,
                                                 out->error ? out->error : "error");
}

typedef struct {
    double elapsed, mean_batch, mean_blocks;
    int64_t peak_blocks, peak_running, steps; /* peak_running: the most sequences a step ran (how many fit) */
    kvs_engine_stats stats;
} tp_result;

static kvs_status run(const tp_options *o, kvs_loaded *l, tp_counts *counts, tp_result *res) {
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = o->max_num_seqs;
    c.max_num_batched_tokens = o->max_num_batched_tokens;
    c.max_waiting = o->num_prompts + 1;
    c.default_policy = o->policy;
    c.enable_prefix_caching = o->prefix_caching;
    KVS_TRY(kvs_cli_kv_bytes(l, &o->mem, &o->policy, &c.kv_memory_bytes));
    kvs_engine *e;
    KVS_TRY(kvs_cli_engine(l, &c, &e));
    kvs_cli_log_capacity(l, &c, kvs_engine_get_limits(e).max_model_len);
    int32_t *prompt = malloc(sizeof(int32_t) * o->input_len);
    kvs_status st = prompt ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_rng rng;
    kvs_rng_seed(&rng, o->seed);
    kvs_request_params p = {.prompt_ids = prompt, .n_prompt = o->input_len, .sampling = kvs_sampling_default(),
                            .max_tokens = o->output_len, .ignore_eos = o->ignore_eos};
    int n = o->n > 1 ? o->n : 1, copies = o->n_separate ? n : 1;
    if (n > 1) p.sampling.temperature = 1, p.n = o->n_separate ? 1 : n;
    for (int r = 0; st == KVS_OK && r < o->num_prompts; r += n) {
        for (int i = 0; i < o->input_len; i++) prompt[i] = (int32_t)(kvs_rng_u64(&rng) % l->cfg.vocab_size);
        for (int c = 0; st == KVS_OK && c < copies; c++) st = kvs_engine_submit(e, &p, on_output, counts, NULL);
    }
    if (st != KVS_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvs_last_error());
        st = kvs_fail(st, "--input-len %d, --output-len %d: %s", o->input_len, o->output_len, why);
    }
    free(prompt);
    kvs_progress bar;
    kvs_progress_start(&bar, "requests", o->num_prompts);
    if (l->profile) kvs_profile_start(l->profile);
    double t0 = kvs_now(), batch_sum = 0, block_sum = 0;
    while (st == KVS_OK && !kvs_engine_idle(e)) {
        st = kvs_engine_step(e);
        kvs_engine_stats s;
        kvs_engine_get_stats(e, &s);
        if (st == KVS_OK && l->profile)
            st = kvs_profile_step(l->profile, s.step_tokens, s.step_decode_tokens);
        res->steps++;
        batch_sum += s.running;
        block_sum += s.kv_blocks_used;
        if (s.kv_blocks_used > res->peak_blocks) res->peak_blocks = s.kv_blocks_used;
        if (s.running > res->peak_running) res->peak_running = s.running;
        kvs_progress_update(&bar, (double)counts->finished);
    }
    res->elapsed = kvs_now() - t0;
    kvs_progress_finish(&bar);
    kvs_engine_get_stats(e, &res->stats);
    res->mean_batch = res->steps ? batch_sum / res->steps : 0;
    res->mean_blocks = res->steps ? block_sum / res->steps : 0;
    kvs_engine_destroy(e);
    return st;
}

static void report(const tp_options *o, const kvs_loaded *l, const tp_counts *c, const tp_result *r) {
    double in_tok = (double)o->num_prompts * o->input_len, t = r->elapsed > 0 ? r->elapsed : 1e-9;
    char policy[128];
    kvs_kv_policy_describe(&o->policy, policy, sizeof policy);
    const kvs_engine_stats *s = &r->stats;
    double total = (double)s->kv_blocks_total;
    if (o->json) {
        json_t *j = json_pack("{s:i, s:i, s:i, s:s, s:f, s:f, s:f, s:f, s:f, s:I, s:f, s:f, s:I, s:I, s:I, s:I, s:I}",
                              "num_prompts", o->num_prompts, "input_len", o->input_len, "output_len", o->output_len,
                              "kv_policy", policy, "elapsed_s", r->elapsed, "requests_per_s", c->finished / t,
                              "input_tokens_per_s", in_tok / t, "output_tokens_per_s", c->tokens / t,
                              "mean_running_batch", r->mean_batch, "output_tokens", (json_int_t)c->tokens,
                              "mean_kv_blocks_used", r->mean_blocks, "mean_kv_usage",
                              total > 0 ? r->mean_blocks / total : 0.0, "peak_kv_blocks_used",
                              (json_int_t)r->peak_blocks, "kv_blocks_total", (json_int_t)s->kv_blocks_total,
                              "kv_tokens_capacity", (json_int_t)s->kv_tokens_capacity, "preemptions",
                              (json_int_t)s->preemptions, "steps", (json_int_t)r->steps);
        json_object_set_new(j, "peak_running_batch", json_integer((json_int_t)r->peak_running));
        json_object_set_new(j, "prefix_caching", json_boolean(o->prefix_caching));
        json_object_set_new(j, "prefix_cache_queries", json_integer((json_int_t)s->prefix_cache_queries));
        json_object_set_new(j, "prefix_cache_hits", json_integer((json_int_t)s->prefix_cache_hits));
        if (l->profile) json_object_set_new(j, "profile", kvs_cli_profile_json(kvs_profile_get(l->profile), l->be->name));
        char *text = json_dumps(j, JSON_COMPACT);
        printf("%s\n", text);
        free(text);
        json_decref(j);
        return;
    }
    printf("requests:            %d x (%d in, %d out), kv policy: %s\n", o->num_prompts, o->input_len, o->output_len,
           policy);
    printf("elapsed:             %.2f s over %lld steps\n", r->elapsed, (long long)r->steps);
    printf("throughput:          %.2f requests/s, %.1f input tokens/s, %.1f output tokens/s\n", c->finished / t,
           in_tok / t, c->tokens / t);
    printf("running batch:       mean %.1f, peak %lld sequences\n", r->mean_batch, (long long)r->peak_running);
    printf("KV blocks in use:    mean %.0f, peak %lld of %lld (%.1f%%), %lld tokens capacity\n", r->mean_blocks,
           (long long)r->peak_blocks, (long long)s->kv_blocks_total, total > 0 ? 100.0 * r->peak_blocks / total : 0,
           (long long)s->kv_tokens_capacity);
    printf("preemptions:         %llu\n", (unsigned long long)s->preemptions);
    printf("prefix cache:        %s, %llu of %llu prompt tokens found\n", o->prefix_caching ? "on" : "off",
           (unsigned long long)s->prefix_cache_hits, (unsigned long long)s->prefix_cache_queries);
    if (l->profile) kvs_cli_profile_print(kvs_profile_get(l->profile), l->be->name);
}

int kvs_cmd_bench_throughput(int argc, char **argv) {
    tp_options o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;
    kvs_loaded l;
    o.load.limits = (kvs_step_limits){o.max_num_batched_tokens, o.max_num_seqs, 0, 0};
    if (kvs_cli_load(&o.load, &l) != KVS_OK) return kvs_cli_error();
    o.policy.profile = l.kv_profile;
    tp_counts counts = {0};
    tp_result res = {0};
    kvs_status st = run(&o, &l, &counts, &res);
    if (st == KVS_OK) report(&o, &l, &counts, &res);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
