#include "testutil.h"

#include <criterion/criterion.h>
#include <criterion/hooks.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

uint64_t kvs_test_seed(void) {
    static bool have;
    static uint64_t seed;
    if (have) return seed;
    const char *e = getenv("KVS_TEST_SEED");
    if (e && *e) {
        char *end;
        seed = strtoull(e, &end, 0);
        cr_assert(*end == 0, "KVS_TEST_SEED=%s is not a number", e);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = (uint64_t)ts.tv_sec * 1000000007u ^ (uint64_t)ts.tv_nsec ^ (uint64_t)getpid() << 20;
        x ^= x >> 29, x *= 0xbf58476d1ce4e5b9ull, x ^= x >> 32; /* mix, then keep it short to type */
        seed = x % 4294967296u;
    }
    have = true;
    const struct criterion_test *t = criterion_current_test;
    /* stderr, not cr_log_info (shown only with --verbose): ctest --output-on-failure prints it */
    fprintf(stderr, "%s::%s: seed %llu (set KVS_TEST_SEED=%llu to repeat)\n", t ? t->category : "?",
            t ? t->name : "?", (unsigned long long)seed, (unsigned long long)seed);
    return seed;
}

static const char *join_rotating(const char *base, const char *rel) {
    static _Thread_local char bufs[4][4096];
    static _Thread_local int next;
    char *b = bufs[next++ & 3];
    snprintf(b, 4096, "%s/%s", base, rel);
    return b;
}

const char *src_path(const char *rel) { return join_rotating(env_or("KVS_SOURCE_DIR", "."), rel); }
const char *shared_path(const char *rel) { return join_rotating(env_or("KVS_SHARED_DIR", "../shared"), rel); }
const char *kvsparse_binary(void) { return env_or("KVS_BINARY", "./build/kvsparse"); }

void kvs_test_need(const char *path, const char *what) {
    if (access(path, R_OK) != 0) cr_skip("needs %s (%s): skipped", what, path);
}

const char *shared_input(const char *rel) {
    const char *p = shared_path(rel);
    kvs_test_need(p, "the shared fixtures ($KVS_SHARED_DIR, ../shared)");
    return p;
}

/* ---- the test binaries' main: Criterion's, plus the skipped-tests exit code ---- */

static int tests_skipped, tests_ran; /* ran: passed or failed (the runner process counts) */

ReportHook(POST_TEST)(struct criterion_test_stats *st) {
    if (st->test_status == CR_STATUS_SKIPPED) {
        tests_skipped++;
        fprintf(stderr, "[SKIP] %s::%s: %s\n", st->test->category, st->test->name,
                st->message ? st->message : "skipped");
    } else {
        tests_ran++;
    }
}

int main(int argc, char *argv[]) {
    struct criterion_test_set *tests = criterion_initialize();
    int rc = 0;
    if (criterion_handle_args(argc, argv, true)) rc = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    if (rc == 0 && tests_skipped > 0 && tests_ran == 0) {
        fprintf(stderr, "all %d tests run were skipped: exit %d (skipped)\n", tests_skipped, KVS_TEST_SKIPPED);
        return KVS_TEST_SKIPPED;
    }
    if (tests_skipped > 0) fprintf(stderr, "%d tests passed or failed, %d skipped\n", tests_ran, tests_skipped);
    return rc;
}

json_t *load_jsonl(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    json_t *arr = json_array();
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        if (n <= 1) continue;
        json_error_t err;
        json_t *o = json_loadb(line, (size_t)n, 0, &err);
        if (o) json_array_append_new(arr, o);
    }
    free(line);
    fclose(f);
    return arr;
}

json_t *load_json(const char *path) {
    json_error_t err;
    return json_load_file(path, 0, &err);
}

json_t *arch_reference(const char *name, char *dir, size_t cap) {
    char rel[512];
    snprintf(rel, sizeof rel, "tests/fixtures/arch/%s/reference.json", name);
    if (kvs_file_exists(src_path(rel))) { /* the project's own (tests/fixtures/arch/README.md) */
        json_t *ref = load_json(src_path(rel));
        cr_assert(ref, "cannot read %s", src_path(rel));
        snprintf(rel, sizeof rel, "tests/fixtures/arch/%s", name);
        snprintf(dir, cap, "%s", src_path(rel));
        return ref;
    }
    snprintf(rel, sizeof rel, "fixtures/arch/%s", name);
    snprintf(dir, cap, "%s", shared_input(rel));
    snprintf(rel, sizeof rel, "fixtures/arch/%s/reference.json", name);
    json_t *ref = load_json(shared_path(rel));
    cr_assert(ref, "cannot read %s", shared_path(rel));
    return ref;
}

static int b64_value(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

double expect_logits_near(const char *what, const float *ref, const float *got, int V, double kl_bound) {
    double peak = 0, diff = 0, second = -INFINITY, mr = -INFINITY, mg = -INFINITY, zr = 0, zg = 0, kl = 0;
    int ar = 0, ag = 0;
    for (int i = 0; i < V; i++) {
        peak = fmax(peak, fabs(ref[i]));
        diff = fmax(diff, fabs((double)got[i] - ref[i]));
        if (ref[i] > ref[ar]) ar = i;
        if (got[i] > got[ag]) ag = i;
        mr = fmax(mr, ref[i]), mg = fmax(mg, got[i]);
    }
    for (int i = 0; i < V; i++) {
        if (i != ar && ref[i] > second) second = ref[i];
        zr += exp(ref[i] - mr), zg += exp(got[i] - mg);
    }
    for (int i = 0; i < V; i++) {
        double lr = ref[i] - mr - log(zr), lg = got[i] - mg - log(zg);
        kl += exp(lr) * (lr - lg);
    }
    cr_log_info("%s: KL %.5f nats; max |logit diff| %.4f, peak %.3f (%.1f%%); argmax %d vs %d (gap %.3f)", what, kl,
                diff, peak, 100 * diff / peak, ar, ag, ref[ar] - second);
    cr_expect_leq(kl, kl_bound, "%s: next-token distributions %g nats apart (bound %g)", what, kl, kl_bound);
    cr_expect(ar == ag || ref[ar] - ref[ag] <= 2 * diff, "%s: argmax %d vs %d", what, ar, ag);
    return kl;
}

float *qkv_rows(const float *q, const float *k, const float *v, int n, size_t qd, size_t kd) {
    size_t ld = qd + 2 * kd;
    float *out = malloc(sizeof(float) * (ld * (size_t)n + 1));
    for (size_t i = 0; out && i < (size_t)n; i++) {
        memcpy(out + i * ld, q + i * qd, sizeof(float) * qd);
        memcpy(out + i * ld + qd, k + i * kd, sizeof(float) * kd);
        memcpy(out + i * ld + qd + kd, v + i * kd, sizeof(float) * kd);
    }
    return out;
}

float *b64_floats(const char *b64, size_t *n) {
    size_t len = strlen(b64);
    unsigned char *bytes = malloc(len * 3 / 4 + 4);
    size_t nb = 0;
    unsigned acc = 0;
    int bits = 0;
    for (size_t i = 0; i < len; i++) {
        int v = b64_value((unsigned char)b64[i]);
        if (v < 0) continue;
        acc = (acc << 6) | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            bytes[nb++] = (unsigned char)((acc >> bits) & 0xff);
        }
    }
    *n = nb / 4;
    float *out = malloc(*n * sizeof(float) + 4);
    memcpy(out, bytes, *n * 4);
    free(bytes);
    return out;
}

int32_t *json_ids(const json_t *arr, int *n) {
    *n = (int)json_array_size(arr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
    return ids;
}

double rel_max_diff(const float *a, const float *b, size_t n) {
    double md = 0, mr = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        if (d > md) md = d;
        if (fabs(b[i]) > mr) mr = fabs(b[i]);
    }
    return mr > 0 ? md / mr : md;
}

int argmax_f(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

const char *make_temp_dir(void) {
    static _Thread_local char buf[256];
    snprintf(buf, sizeof buf, "/tmp/kvs-test-XXXXXX");
    return mkdtemp(buf);
}

void write_file(const char *dir, const char *name, const void *data, size_t len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(data, 1, len, f);
    fclose(f);
}

int run_capture(const char *cmd, char **out) {
    char full[8192];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += got;
        if (n + 1 >= cap) buf = realloc(buf, cap *= 2);
    }
    buf[n] = 0;
    int st = pclose(p);
    if (out) *out = buf; else free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void expect_refused_without_fp8(const char *dir, kvs_quantization q, const char *want) {
    kvs_backend *cpu;
    cr_assert_eq(kvs_backend_cpu_create(1, &cpu), KVS_OK);
    kvs_backend no_fp8 = *cpu; /* the same state, without the FP8 ops */
    no_fp8.quantize_fp8 = NULL;
    no_fp8.matmul_fp8 = NULL;
    no_fp8.add_rmsnorm_fp8 = NULL;
    no_fp8.swiglu_fp8 = NULL;
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_load(dir, &cfg), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(dir, &cfg, &ck), KVS_OK, "%s", kvs_last_error());
    if (q != KVS_QUANT_NONE) cfg.quantization = q;
    kvs_model *m = NULL;
    cr_expect_eq(kvs_model_create(&cfg, ck, &no_fp8, &m), KVS_ERR_UNSUPPORTED);
    cr_expect_null(m);
    cr_expect(strstr(kvs_last_error(), want) && strstr(kvs_last_error(), "8.9"), "message: %s", kvs_last_error());
    kvs_checkpoint_destroy(ck);
    cpu->destroy(cpu);
}

void rig_open(rig *r, const char *dir, kvs_backend *be, int64_t n_blocks, int max_seqs) {
    rig_open_quantized(r, dir, be, n_blocks, max_seqs, KVS_QUANT_NONE);
}

void rig_open_quantized(rig *r, const char *dir, kvs_backend *be, int64_t n_blocks, int max_seqs,
                        kvs_quantization q) {
    memset(r, 0, sizeof *r);
    cr_assert_eq(kvs_config_load(dir, &r->cfg), KVS_OK, "%s", kvs_last_error());
    r->cfg.quantization = q;
    cr_assert_eq(kvs_checkpoint_open(dir, &r->cfg, &r->ck), KVS_OK, "%s", kvs_last_error());
    r->be = be;
    r->owns_be = !be;
    if (!be) cr_assert_eq(kvs_backend_cpu_create(0, &r->be), KVS_OK);
    cr_assert_eq(kvs_model_create(&r->cfg, r->ck, r->be, &r->m), KVS_OK, "%s", kvs_last_error());
    kvs_step_limits lim = {.max_seqs = max_seqs > 64 ? max_seqs : 0};
    cr_assert_eq(kvs_executor_create(r->m, &lim, &r->x), KVS_OK, "%s", kvs_last_error());
    kvs_kv_config kc = {.n_layers = r->cfg.n_layers, .n_kv_heads = r->cfg.n_kv_heads, .head_dim = r->cfg.head_dim,
                        .n_heads = r->cfg.n_heads, .block_size = 16, .n_blocks = n_blocks, .max_seqs = max_seqs};
    cr_assert_eq(kvs_kv_create(&kc, r->be, &r->kv), KVS_OK, "%s", kvs_last_error());
    int32_t window[KVS_MAX_LAYERS]; /* the model's sliding-window layers, as the runner sets them */
    for (int l = 0; l < r->cfg.n_layers; l++) window[l] = kvs_config_layer_sliding_window(&r->cfg, l);
    cr_assert_eq(kvs_kv_set_sliding_windows(r->kv, window), KVS_OK, "%s", kvs_last_error());
    /* an FP8 pool takes the checkpoint's k_scale / v_scale, as the runner's caches do */
    cr_assert_eq(kvs_kv_set_scales(r->kv, kvs_model_kv_scales(r->m)), KVS_OK, "%s", kvs_last_error());
}

void rig_close(rig *r) {
    kvs_kv_destroy(r->kv);
    kvs_executor_destroy(r->x);
    kvs_model_destroy(r->m);
    kvs_checkpoint_destroy(r->ck);
    if (r->owns_be) r->be->destroy(r->be);
}

/* The plan of b on kv's own device, its tables applied. */
static kvs_status plan_on_own_device(kvs_step_plan *p, kvs_executor *x, const kvs_batch *b, kvs_kv_cache *kv,
                                     kvs_kv_device **dev) {
    *dev = kvs_kv_own_device(kv);
    if (!*dev) return kvs_fail(KVS_ERR_INVALID, "rig_forward: the KV cache has no device of its own (kvs_kv_create)");
    KVS_TRY(kvs_step_plan_build(p, kv, b, x, *dev));
    return kvs_kv_device_apply_tables(*dev, &p->tables);
}

kvs_status rig_forward(kvs_executor *x, const kvs_batch *b, kvs_kv_cache *kv, float *logits) {
    kvs_step_plan p = {0};
    kvs_kv_device *dev;
    kvs_status st = plan_on_own_device(&p, x, b, kv, &dev);
    if (st == KVS_OK) st = kvs_executor_forward(x, &p.in, dev, logits);
    kvs_step_plan_free(&p);
    return st;
}

kvs_status rig_forward_sample(kvs_executor *x, const kvs_batch *b, kvs_kv_cache *kv, const kvs_sample_row *params,
                              const kvs_sample_extras *extras, int32_t *ids, float *logprobs) {
    kvs_step_plan p = {0};
    kvs_kv_device *dev;
    kvs_status st = plan_on_own_device(&p, x, b, kv, &dev);
    if (st == KVS_OK) st = kvs_executor_forward_sample(x, &p.in, dev, params, extras, ids, logprobs);
    kvs_step_plan_free(&p);
    return st;
}

kvs_status rig_tables_check(const kvs_batch *b, const kvs_kv_cache *kv) {
    const kvs_kv_device *dev = kvs_kv_own_device(kv);
    const kvs_kv_config *c = kvs_kv_device_config(dev);
    kvs_backend *be = kvs_kv_device_backend(dev);
    int stride;
    const int32_t *tables = kvs_kv_device_layer_tables(dev, 0, &stride);
    size_t cells = (size_t)c->n_layers * c->max_seqs * stride;
    int32_t *host = malloc(sizeof(int32_t) * cells);
    if (!host) return kvs_fail(KVS_ERR_NOMEM, "tables check: out of memory");
    be->to_host(be, host, tables, sizeof(int32_t) * cells);
    kvs_status st = KVS_OK;
    for (int s = 0; s < b->n_seqs && st == KVS_OK; s++)
        for (int l = 0; l < c->n_layers && st == KVS_OK; l++) {
            int seq = b->seq_ids[s], nb;
            const int32_t *blocks = kvs_kv_blocks(kv, seq, l, &nb), *row = host + ((size_t)l * c->max_seqs + seq) * stride;
            for (int i = 0; i < nb && st == KVS_OK; i++)
                if (row[i] != blocks[i])
                    st = kvs_fail(KVS_ERR_INTERNAL,
                                  "tables check: sequence %d layer %d block %d is %d in the KV cache, %d on the device",
                                  seq, l, i, blocks[i], row[i]);
        }
    free(host);
    return st;
}

void kv_keep(kvs_kv_cache *kv, const kvs_batch *b) {
    for (int s = 0; s < b->n_seqs; s++) kvs_kv_commit(kv, b->seq_ids[s], b->query_start[s + 1] - b->query_start[s]);
    cr_assert_eq(kvs_kv_sparsify_seqs(kv, b->seq_ids, b->n_seqs), KVS_OK, "%s", kvs_last_error());
}

bool kv_try_append(kvs_kv_cache *kv, int seq, int n) {
    int64_t need = kvs_kv_blocks_needed(kv, seq, n), free_before = kvs_kv_free_blocks(kv);
    kvs_status st = kvs_kv_reserve(kv, seq, n);
    if (need > free_before) {
        cr_assert_eq(st, KVS_ERR_NOMEM);
        cr_assert_eq(kvs_kv_free_blocks(kv), free_before, "a failed reserve must take nothing");
        return false;
    }
    cr_assert_eq(st, KVS_OK, "%s", kvs_last_error());
    kvs_kv_commit(kv, seq, n);
    return true;
}

void rig_run(rig *r, int seq, const int32_t *ids, int n, int pos0, float *logits) {
    int32_t *pos = malloc(sizeof(int32_t) * n), qs[2] = {0, n};
    for (int i = 0; i < n; i++) pos[i] = pos0 + i;
    uint8_t want = 1;
    cr_assert_eq(kvs_kv_reserve(r->kv, seq, n), KVS_OK, "%s", kvs_last_error());
    kvs_batch b = {n, 1, ids, pos, qs, &seq, &want};
    cr_assert_eq(rig_forward(r->x, &b, r->kv, logits), KVS_OK, "%s", kvs_last_error());
    kv_keep(r->kv, &b);
    free(pos);
}

/* ---- the decode-step graph scenario (testutil.h) ------------------------------ */

static kvs_graph_stats stats_minus(kvs_graph_stats a, kvs_graph_stats b) {
    return (kvs_graph_stats){a.eager_steps - b.eager_steps, a.padded_eager_steps - b.padded_eager_steps,
                             a.captures - b.captures, a.replays - b.replays,
                             a.capture_failures - b.capture_failures, a.invalidations - b.invalidations};
}

static kvs_graph_stats stats_plus(kvs_graph_stats a, kvs_graph_stats b) {
    return (kvs_graph_stats){a.eager_steps + b.eager_steps, a.padded_eager_steps + b.padded_eager_steps,
                             a.captures + b.captures, a.replays + b.replays,
                             a.capture_failures + b.capture_failures, a.invalidations + b.invalidations};
}

/* One run's side of the scenario: its mode, logits rows and graph stats. */
typedef struct {
    kvs_graph_mode mode;
    scen_run *out;
    kvs_graph_stats total; /* this run's forwards only */
} scen_side;

/* Runs the step's batch over seqs in side's mode; appends its logits rows. */
static void scen_forward(rig *r, scen_side *side, const int32_t *tok, const int32_t *ps, const int32_t *qs,
                         const int *seqs, int n_active, bool decode) {
    int V = r->cfg.vocab_size, n = qs[n_active];
    scen_run *out = side->out;
    uint8_t want[40];
    for (int a = 0; a < n_active; a++) want[a] = 1;
    int st = out->n_steps++;
    cr_assert(st < SCEN_MAX_STEPS);
    out->logits = realloc(out->logits, sizeof(float) * (size_t)V * (out->n_rows + n_active));
    cr_assert(out->logits);
    kvs_executor_set_graph_mode(r->x, side->mode);
    kvs_graph_stats before = kvs_executor_graph_stats(r->x);
    kvs_batch b = {n, n_active, tok, ps, qs, seqs, want};
    cr_assert_eq(rig_forward(r->x, &b, r->kv, out->logits + (size_t)out->n_rows * V), KVS_OK, "%s",
                 kvs_last_error());
    /* the device-resident block tables the step ran on are the cache's */
    cr_assert_eq(rig_tables_check(&b, r->kv), KVS_OK, "%s", kvs_last_error());
    kv_keep(r->kv, &b);
    side->total = stats_plus(side->total, stats_minus(kvs_executor_graph_stats(r->x), before));
    out->n_rows += n_active;
    out->rows[st] = n_active;
    out->decode[st] = decode;
    out->after[st] = side->total;
}

/* Entries [0, len) of (seq, layer) vs (fork, layer), K and V of every KV head:
 * max|diff| / max|value| (NaN: infinity). */
static double kv_rel_diff(const rig *r, int seq, int fork, int layer, int len) {
    const kvs_kv_pool *pool = kvs_kv_get_pool(r->kv);
    int nb, bs = pool->block_size, d = pool->head_dim;
    const int32_t *ta = kvs_kv_blocks(r->kv, seq, layer, &nb), *tb = kvs_kv_blocks(r->kv, fork, layer, &nb);
    size_t per_head = (size_t)bs * d, per_block = 2 * (size_t)pool->n_kv_heads * per_head;
    double md = 0, mv = 0;
    for (int e = 0; e < len; e++)
        for (int kind = 0; kind < 2; kind++)
            for (int h = 0; h < pool->n_kv_heads; h++) {
                size_t in_block = ((size_t)kind * pool->n_kv_heads + h) * per_head + (size_t)(e % bs) * d;
                const float *x = (const float *)pool->data + (size_t)ta[e / bs] * per_block + in_block,
                            *y = (const float *)pool->data + (size_t)tb[e / bs] * per_block + in_block;
                for (int t = 0; t < d; t++) {
                    double dd = fabs((double)x[t] - y[t]);
                    if (!(dd == dd)) return INFINITY;
                    md = dd > md ? dd : md;
                    mv = fabs(x[t]) > mv ? fabs(x[t]) : mv;
                }
            }
    return mv > 0 ? md / mv : md;
}

/* Window rows a (the sequence's) and b (its fork's) of layer l: the query's
 * max|diff| relative to the row's max|q| into *dq, the LSE's max|diff| / max(1, |lse|) into *dl. */
static void window_diff(const rig *r, int layer, int a, int b, double *dq, double *dl) {
    void *wq;
    float *wl;
    kvs_kv_window_buffers(r->kv, layer, &wq, &wl);
    int H = r->cfg.n_heads, row = H * r->cfg.head_dim;
    const float *qa = (const float *)wq + (size_t)a * row, *qb = (const float *)wq + (size_t)b * row;
    *dq = rel_max_diff(qb, qa, (size_t)row);
    *dl = 0;
    for (int h = 0; h < H; h++) {
        double x = wl[(size_t)a * H + h], d = fabs(x - wl[(size_t)b * H + h]) / (fabs(x) > 1 ? fabs(x) : 1);
        if (!(d <= *dl)) *dl = d; /* NaN too */
    }
}

/* What the lockstep compares after a step: the shadow run's sequences (forks)
 * against the main run's. */
typedef struct {
    int n_active, *fork;
    int *len_before; /* [n_active][L] */
} scen_check;

static void lockstep_compare(rig *r, const scen_check *c, const int *active, const int32_t *qs, scen_lockstep *ls) {
    int L = r->cfg.n_layers, max_window = kvs_kv_get_config(r->kv)->max_window;
    int cap = max_window > 0 ? max_window : 64; /* window rows per sequence (kv/sparsify.c) */
    for (int a = 0; a < c->n_active; a++) {
        int seq = active[a], fork = c->fork[a], q_len = qs[a + 1] - qs[a];
        for (int l = 0; l < L; l++) { /* every window row: the fork started as a copy */
            for (int i = 0; i < cap; i++) {
                double dq, dl;
                window_diff(r, l, seq * cap + i, fork * cap + i, &dq, &dl);
                if (!(dq <= ls->worst_window_q)) ls->worst_window_q = dq;
                if (!(dl <= ls->worst_window_lse)) ls->worst_window_lse = dl;
            }
        }
        for (int l = 0; l < L; l++) {
            int len = kvs_kv_len(r->kv, seq, l);
            cr_assert_eq(kvs_kv_len(r->kv, fork, l), len, "sequence %d layer %d: %d entries in the shadow run, %d",
                         seq, l, kvs_kv_len(r->kv, fork, l), len);
            double d = kv_rel_diff(r, seq, fork, l, len);
            if (len < c->len_before[a * L + l] + q_len) { /* compacted in this step */
                ls->compactions++;
                ls->compactions_other += !(d <= 1e-5);
            } else if (!(d <= ls->worst_kv)) {
                ls->worst_kv = d;
            }
        }
    }
}

/* One step over the active sequences: prompts for the ones with pos 0, else
 * one token each; with a shadow, first on forks of the sequences. */
static void scen_step(rig *r, scen_side *main, scen_side *shadow, scen_lockstep *ls, kvs_rng *rng, int *active,
                      int n_active, int *pos, const int *prompt) {
    int V = r->cfg.vocab_size, L = r->cfg.n_layers, n = 0;
    for (int a = 0; a < n_active; a++) n += pos[active[a]] == 0 ? prompt[active[a]] : 1;
    int32_t *tok = calloc((size_t)n, sizeof(int32_t)), *ps = calloc((size_t)n, sizeof(int32_t)), qs[41] = {0};
    bool decode = true;
    int k = 0;
    for (int a = 0; a < n_active; a++) {
        int s = active[a], len = pos[s] == 0 ? prompt[s] : 1;
        decode = decode && len == 1;
        cr_assert_eq(kvs_kv_reserve(r->kv, s, len), KVS_OK, "%s", kvs_last_error());
        for (int i = 0; i < len; i++, k++) {
            tok[k] = (int32_t)(kvs_rng_u64(rng) % (uint64_t)V);
            ps[k] = pos[s] + i;
        }
        pos[s] += len;
        qs[a + 1] = k;
    }
    int fork[40] = {0};
    scen_check c = {n_active, fork, NULL};
    if (shadow) {
        c.len_before = malloc(sizeof(int) * (size_t)n_active * L);
        for (int a = 0; a < n_active; a++) {
            cr_assert_eq(kvs_kv_fork(r->kv, active[a], &fork[a]), KVS_OK, "%s", kvs_last_error());
            for (int l = 0; l < L; l++) c.len_before[a * L + l] = kvs_kv_len(r->kv, active[a], l);
        }
        scen_forward(r, shadow, tok, ps, qs, fork, n_active, decode);
    }
    scen_forward(r, main, tok, ps, qs, active, n_active, decode);
    if (shadow) {
        lockstep_compare(r, &c, active, qs, ls);
        for (int a = 0; a < n_active; a++) kvs_kv_free(r->kv, c.fork[a]);
        free(c.len_before);
    }
    free(tok);
    free(ps);
}

static void scen_run_sides(rig *r, scen_side *main, scen_side *shadow, scen_lockstep *ls, uint64_t seed) {
    memset(main->out, 0, sizeof *main->out);
    main->out->vocab = r->cfg.vocab_size;
    if (shadow) {
        memset(shadow->out, 0, sizeof *shadow->out);
        shadow->out->vocab = r->cfg.vocab_size;
        memset(ls, 0, sizeof *ls);
    }
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    p.budget_tokens = 24, p.budget_fraction = 0, p.full_layers = 1, p.window = 8, p.pool = 3, p.min_prompt = 16;
    int active[40], n_active = 0, pos[40] = {0}, prompt[40] = {0};
    /* phases: join, then decode steps; -k: the k-th active sequence leaves (then every other one for -99) */
    static const int joins[] = {3, 2, 0, 32, 0}, decodes[] = {4, 3, 2, 3, 2};
    for (int ph = 0; ph < 5; ph++) {
        if (ph == 2) { /* the second sequence leaves: 5 -> 4 */
            kvs_kv_free(r->kv, active[1]);
            memmove(active + 1, active + 2, sizeof(int) * (n_active - 2));
            n_active--;
        }
        if (ph == 4) { /* every other sequence but the first leaves: 37 -> 19 */
            int kept = 1;
            for (int a = 1; a < n_active; a++) {
                if (a % 2) kvs_kv_free(r->kv, active[a]);
                else active[kept++] = active[a];
            }
            n_active = kept;
        }
        for (int j = 0; j < joins[ph]; j++) {
            int s = kvs_kv_seq_create(r->kv);
            cr_assert(s >= 0 && s < 40, "%s", kvs_last_error());
            /* the first sequence's 70-token prompt keeps the table stride bucket at 8
               blocks for the whole run (its full layer holds 5 to 7 blocks) */
            prompt[s] = n_active == 0 ? 70 : 20 + (int)(kvs_rng_u64(&rng) % 41);
            pos[s] = 0;
            cr_assert_eq(kvs_kv_set_policy(r->kv, s, &p, prompt[s]), KVS_OK, "%s", kvs_last_error());
            active[n_active++] = s;
        }
        if (joins[ph]) scen_step(r, main, shadow, ls, &rng, active, n_active, pos, prompt);
        for (int d = 0; d < decodes[ph]; d++) scen_step(r, main, shadow, ls, &rng, active, n_active, pos, prompt);
    }
    main->out->compacted = kvs_kv_len(r->kv, active[0], r->cfg.n_layers - 1) < pos[active[0]];
    if (shadow) shadow->out->compacted = main->out->compacted;
    for (int a = 0; a < n_active; a++) kvs_kv_free(r->kv, active[a]);
    cr_assert_eq(kvs_kv_used_blocks(r->kv), 0);
}

void scen_decode_run(rig *r, kvs_graph_mode mode, uint64_t seed, scen_run *out) {
    scen_side main = {mode, out, {0}};
    scen_run_sides(r, &main, NULL, NULL, seed);
}

void scen_lockstep_run(rig *r, kvs_graph_mode mode, kvs_graph_mode shadow_mode, uint64_t seed, scen_run *out,
                       scen_run *shadow, scen_lockstep *ls) {
    cr_assert(kvs_kv_get_config(r->kv)->max_seqs >= 80, "the lockstep forks every sequence: 80 sequence slots");
    scen_side main = {mode, out, {0}}, sh = {shadow_mode, shadow, {0}};
    scen_run_sides(r, &main, &sh, ls, seed);
}

void scen_free(scen_run *s) {
    free(s->logits);
    s->logits = NULL;
}
