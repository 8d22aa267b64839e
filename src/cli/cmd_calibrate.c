/* kvsparse calibrate: how each layer's attention concentrates on the bundled
 * (or any) model, measured with SnapKV's own scores over full-resolution
 * prompts, and the per-layer budgets it recommends: a profile for --kv-profile
 * (docs/SPARSITY.md, "Calibration profiles"). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/calibrate.h"
#include "cli/cli.h"
#include "cli/cli_common.h"
#include "cli/eval.h"

#define DEFAULT_TARGETS "10,20"

typedef struct {
    kvs_load_options load;
    const char *data, *out, *plot_dir;
    int limit, stride, window, pool;
    double targets[KVS_KV_PROFILE_MAX_TARGETS];
    int n_targets;
} calib_options;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse calibrate -m MODEL_DIR --data FILE.jsonl [options]\n"
               "How each layer's attention concentrates (the SnapKV scores of the last W prompt queries over\n"
               "full-resolution prompts), and the per-layer KV budgets that keep the most of it: a profile for\n"
               "--kv-profile (docs/SPARSITY.md, \"Calibration profiles\").\n"
               "  --data FILE.jsonl      the prompts: each line's \"prompt\" (chat-formatted text, as eval retrieval)\n"
               "  --limit N              calibrate N prompts at most (default: every selected line)\n"
               "  --stride K             every K-th line of the file, from the first (default 1)\n"
               "  --out PROFILE.json     write the profile there (default: the table only)\n"
               "  --plot DIR             write DIR/attention_heatmap.png and DIR/concentration.png\n"
               "  --targets C,C          compressions to recommend budgets for, each > 1 (default " DEFAULT_TARGETS ")\n"
               "  --kv-window W          observation window (default 16)\n"
               "  --kv-pool P            max-pool kernel of the scores, odd (default 7): as the policy selects\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP);
}

/* "10,20" -> ascending distinct compressions > 1 */
static bool parse_targets(const char *s, calib_options *o) {
    o->n_targets = 0;
    for (const char *p = s; *p;) {
        char *end;
        double c = strtod(p, &end);
        if (end == p || !(c > 1 && c < 1e6) || (*end && *end != ',') || o->n_targets == KVS_KV_PROFILE_MAX_TARGETS)
            return false;
        if (o->n_targets && c <= o->targets[o->n_targets - 1]) return false; /* ascending, no repeats */
        o->targets[o->n_targets++] = c;
        p = *end ? end + 1 : end;
        if (*end && !*p) return false;
    }
    return o->n_targets > 0;
}

static bool parse_count(const char *s, int lo, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > (1 << 30)) return false;
    *out = (int)v;
    return true;
}

/* 1: run, 0: --help given, 2: a usage error (printed) */
static int parse_args(int argc, char **argv, calib_options *o) {
    memset(o, 0, sizeof *o);
    o->stride = 1, o->window = kvs_kv_policy_default(KVS_POLICY_SNAPKV).window, o->pool = 7;
    parse_targets(DEFAULT_TARGETS, o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int r = kvs_cli_load_option(&o->load, argc, argv, &i);
        if (r > 0) continue;
        bool v = r == 0 && i + 1 < argc, ok = r == 0;
        const char *val = v ? argv[i + 1] : NULL; /* the value, when the option takes one */
        if (r == 0 && (!strcmp(a, "--help") || !strcmp(a, "-h"))) { usage(stdout); return 0; }
        else if (!strcmp(a, "--data") && v) o->data = argv[++i];
        else if (!strcmp(a, "--out") && v) o->out = argv[++i];
        else if (!strcmp(a, "--plot") && v) o->plot_dir = argv[++i];
        else if (!strcmp(a, "--limit") && v) ok = parse_count(argv[++i], 1, &o->limit);
        else if (!strcmp(a, "--stride") && v) ok = parse_count(argv[++i], 1, &o->stride);
        else if (!strcmp(a, "--kv-window") && v) ok = parse_count(argv[++i], 1, &o->window) && o->window <= 512;
        else if (!strcmp(a, "--kv-pool") && v) ok = parse_count(argv[++i], 1, &o->pool) && o->pool % 2 && o->pool <= 255;
        else if (!strcmp(a, "--targets") && v) ok = parse_targets(argv[++i], o);
        else ok = false, val = NULL;
        if (!ok) {
            fprintf(stderr, "kvsparse calibrate: bad or incomplete option '%s'%s%s\n", a, val ? " " : "", val ? val : "");
            usage(stderr);
            return 2;
        }
    }
    if (!o->data) {
        fprintf(stderr, "kvsparse calibrate: --data FILE.jsonl is required\n");
        return 2;
    }
    return 1;
}

/* The runner's cache: one sequence of the model's longest context. */
static kvs_status make_cache(kvs_loaded *l, int window, int *max_len) {
    const kvs_config *c = &l->cfg;
    *max_len = kvs_runner_limits(l->runner).max_len;
    kvs_kv_policy full = kvs_kv_policy_default(KVS_POLICY_FULL); /* calibration keeps every entry */
    kvs_kv_config kc = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                        .n_heads = c->n_heads, .block_size = KVS_KV_BLOCK_SIZE, .max_seqs = 1, .max_window = window};
    kc.n_blocks = kvs_runner_kv_blocks_for_budget(l->runner, &kc, kvs_cli_kv_bytes_for(l, &full, false, *max_len, 0, 1));
    return kvs_runner_kv_create(l->runner, &kc);
}

/* The prompt's prefill (chunks of the model's step size) under p, which
 * captures the window and keeps every entry; then every layer's scores into
 * the statistics (and, for the first prompt, its mass by position). */
static kvs_status measure_prompt(kvs_runner *r, const kvs_kv_policy *p, const int32_t *ids, int n, kvs_calib_stats *s,
                                 kvs_calib_first *first) {
    kvs_kv_cache *kv = kvs_runner_kv(r);
    int seq = kvs_kv_seq_create(kv), chunk = kvs_runner_limits(r).max_tokens, H = s->n_kv_heads;
    if (seq < 0) return kvs_fail(KVS_ERR_NOMEM, "calibrate: no KV sequence free");
    int32_t *pos = malloc(sizeof(int32_t) * n);
    float *scores = malloc(sizeof(float) * (size_t)H * n);
    kvs_status st = pos && scores ? kvs_kv_set_policy(kv, seq, p, n) : kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
    for (int i = 0; pos && i < n; i++) pos[i] = i;
    for (int start = 0; st == KVS_OK && start < n; start += chunk) {
        int len = n - start < chunk ? n - start : chunk, qs[2] = {0, len};
        uint8_t want = 0; /* no logits: only the KV and the window matter */
        kvs_batch b = {len, 1, ids + start, pos + start, qs, &seq, &want};
        st = kvs_kv_reserve(kv, seq, len);
        if (st == KVS_OK) st = kvs_runner_step(r, &b, NULL);
    }
    for (int l = 0; st == KVS_OK && l < s->n_layers; l++) {
        st = kvs_runner_window_scores(r, seq, l, scores);
        if (st == KVS_OK) st = kvs_calib_add_layer(s, l, scores, n);
        if (st != KVS_OK || !first) continue;
        int m = n - p->window; /* the keys before the window */
        double total = 0, *mass = first->mass + (size_t)l * n;
        for (int j = 0; j < n; j++) {
            mass[j] = 0;
            for (int g = 0; j < m && g < H; g++) mass[j] += scores[(size_t)g * m + j];
            total += mass[j];
        }
        for (int j = 0; j < n; j++) mass[j] /= total > 0 ? total : 1;
    }
    if (st == KVS_OK) kvs_calib_prompt_done(s);
    kvs_kv_free(kv, seq);
    free(pos), free(scores);
    return st;
}

/* Lines 0, K, 2K, ... of the file, limit at most: how many. */
static int selected_lines(FILE *f, const calib_options *o) {
    int lines = 0, c;
    while ((c = fgetc(f)) != EOF) lines += c == '\n';
    rewind(f);
    int n = (lines + o->stride - 1) / o->stride;
    return o->limit && o->limit < n ? o->limit : n;
}

typedef struct {
    kvs_calib_stats stats;
    kvs_calib_first first;
    long long tokens;
} calib_run;

/* The ids of a data line's "prompt" (as eval retrieval tokenizes it), of 2w to max_len tokens. */
static kvs_status read_prompt(const kvs_tokenizer *tok, const calib_options *o, const char *line, int line_no,
                              int max_len, int32_t **ids, int *n) {
    json_t *row = json_loads(line, 0, NULL);
    const char *prompt = json_string_value(json_object_get(row, "prompt"));
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
    kvs_status st = prompt ? kvs_tokenizer_encode(tok, prompt, strlen(prompt), eo, ids, n)
                           : kvs_fail(KVS_ERR_FORMAT, "%s:%d: expected an object with a \"prompt\" string", o->data, line_no);
    json_decref(row);
    if (st == KVS_OK && (*n < 2 * o->window || *n > max_len))
        st = kvs_fail(KVS_ERR_INVALID, "%s:%d: a prompt of %d tokens: calibrate takes %d (twice the window) to %d (the model's context)",
                      o->data, line_no, *n, 2 * o->window, max_len);
    return st;
}

static kvs_status calibrate_file(kvs_loaded *l, const calib_options *o, FILE *f, calib_run *run) {
    int max_len;
    KVS_TRY(make_cache(l, o->window, &max_len));
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    p.budget_fraction = 1.0f; /* the window captured, nothing compacted */
    p.window = o->window;
    p.min_prompt = 0;
    kvs_progress bar;
    kvs_progress_start_counted(&bar, "calibrate", selected_lines(f, o), "prompts");
    char *line = NULL;
    size_t cap = 0;
    kvs_status st = KVS_OK;
    for (int line_no = 1; st == KVS_OK && getline(&line, &cap, f) > 0 && (!o->limit || run->stats.n_prompts < o->limit);
         line_no++) {
        if ((line_no - 1) % o->stride || line[0] == '\n') continue;
        int32_t *ids = NULL;
        int n = 0;
        st = read_prompt(l->tok, o, line, line_no, max_len, &ids, &n);
        bool is_first = st == KVS_OK && run->stats.n_prompts == 0;
        if (is_first && !(run->first.mass = malloc(sizeof(double) * (size_t)l->cfg.n_layers * n)))
            st = kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
        if (is_first) run->first.n = n, run->first.window = o->window;
        if (st == KVS_OK) st = measure_prompt(l->runner, &p, ids, n, &run->stats, is_first ? &run->first : NULL);
        if (st != KVS_OK && strncmp(kvs_last_error(), o->data, strlen(o->data))) { /* name the line */
            char why[512];
            snprintf(why, sizeof why, "%s", kvs_last_error());
            st = kvs_fail(st, "%s:%d: %s", o->data, line_no, why);
        }
        run->tokens += st == KVS_OK ? n : 0;
        free(ids);
        kvs_progress_update(&bar, run->stats.n_prompts);
    }
    kvs_progress_finish(&bar);
    free(line);
    if (st == KVS_OK && run->stats.n_prompts == 0) st = kvs_fail(KVS_ERR_INVALID, "%s: no prompts", o->data);
    return st;
}

static kvs_status report(const calib_options *o, calib_run *run, double seconds) {
    int L = run->stats.n_layers;
    double *shares[KVS_KV_PROFILE_MAX_TARGETS] = {0};
    kvs_status st = KVS_OK;
    for (int t = 0; st == KVS_OK && t < o->n_targets; t++) {
        if (!(shares[t] = malloc(sizeof(double) * L))) st = kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
        else kvs_calib_shares(&run->stats, o->targets[t], shares[t]);
    }
    char model[512];
    kvs_calib_result r = {kvs_cli_last_name(o->load.model_dir, model, sizeof model), o->data, o->stride,
                          run->tokens, seconds, o->n_targets, o->targets, shares};
    if (st == KVS_OK) kvs_calib_print_table(stdout, &run->stats, &r);
    if (st == KVS_OK && o->out && (st = kvs_calib_write_profile(o->out, &run->stats, &r)) == KVS_OK)
        printf("profile: %s\n", o->out);
    if (st == KVS_OK && o->plot_dir && (st = kvs_calib_plots(o->plot_dir, &run->stats, &run->first, &r)) == KVS_OK)
        printf("plots: %s/attention_heatmap.png, %s/concentration.png\n", o->plot_dir, o->plot_dir);
    for (int t = 0; t < o->n_targets; t++) free(shares[t]);
    return st;
}

int kvs_cmd_calibrate(int argc, char **argv) {
    calib_options o;
    int rc = parse_args(argc, argv, &o);
    if (rc != 1) return rc;
    if (o.plot_dir && kvs_calib_plot_dir(o.plot_dir) != KVS_OK) return kvs_cli_error();
    FILE *f = fopen(o.data, "rb");
    if (!f) {
        fprintf(stderr, "kvsparse: %s: cannot open\n", o.data);
        return 1;
    }
    o.load.limits = (kvs_step_limits){.max_seqs = 1};
    kvs_loaded l;
    if (kvs_cli_load(&o.load, &l) != KVS_OK) {
        fclose(f);
        return kvs_cli_error();
    }
    double t0 = kvs_now();
    calib_run run = {0};
    kvs_status st = l.tok ? kvs_calib_stats_init(&run.stats, l.cfg.n_layers, l.cfg.n_kv_heads, o.window, o.pool)
                          : kvs_fail(KVS_ERR_UNSUPPORTED, "the model has no tokenizer.json");
    if (st == KVS_OK) st = calibrate_file(&l, &o, f, &run);
    fclose(f);
    if (st == KVS_OK) st = report(&o, &run, kvs_now() - t0);
    kvs_calib_stats_free(&run.stats);
    free(run.first.mass);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
