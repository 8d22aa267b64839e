#include "testutil.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
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
    snprintf(rel, sizeof rel, "fixtures/arch/%s", name);
    snprintf(dir, cap, "%s", shared_path(rel));
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

void rig_open(rig *r, const char *dir, kvs_backend *be, int64_t n_blocks, int max_seqs) {
    memset(r, 0, sizeof *r);
    cr_assert_eq(kvs_config_load(dir, &r->cfg), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(dir, &r->cfg, &r->ck), KVS_OK, "%s", kvs_last_error());
    r->be = be;
    r->owns_be = !be;
    if (!be) cr_assert_eq(kvs_backend_cpu_create(0, &r->be), KVS_OK);
    cr_assert_eq(kvs_model_create(&r->cfg, r->ck, r->be, &r->m), KVS_OK, "%s", kvs_last_error());
    kvs_kv_config kc = {.n_layers = r->cfg.n_layers, .n_kv_heads = r->cfg.n_kv_heads, .head_dim = r->cfg.head_dim,
                        .n_heads = r->cfg.n_heads, .block_size = 16, .n_blocks = n_blocks, .max_seqs = max_seqs};
    cr_assert_eq(kvs_kv_create(&kc, r->be, &r->kv), KVS_OK, "%s", kvs_last_error());
}

void rig_close(rig *r) {
    kvs_kv_destroy(r->kv);
    kvs_model_destroy(r->m);
    kvs_checkpoint_destroy(r->ck);
    if (r->owns_be) r->be->destroy(r->be);
}

void rig_run(rig *r, int seq, const int32_t *ids, int n, int pos0, float *logits) {
    int32_t *pos = malloc(sizeof(int32_t) * n), qs[2] = {0, n};
    for (int i = 0; i < n; i++) pos[i] = pos0 + i;
    uint8_t want = 1;
    cr_assert_eq(kvs_kv_reserve(r->kv, seq, n), KVS_OK, "%s", kvs_last_error());
    kvs_batch b = {n, 1, ids, pos, qs, &seq, &want};
    cr_assert_eq(kvs_model_forward(r->m, &b, r->kv, logits), KVS_OK, "%s", kvs_last_error());
    free(pos);
}
