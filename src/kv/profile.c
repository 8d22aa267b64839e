/* Calibration profiles (kvsparse calibrate writes them): per-layer shares of
 * the KV budget for a few compression targets. The loader reads format,
 * version, n_layers and budgets and refuses anything else that is wrong,
 * naming the field; the file's other fields are for people and plots. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"

#define PROFILE_FORMAT "kvsparse-kv-profile"
#define PROFILE_MAX_LAYERS 4096

/* "kv profile FILE: " or "kv profile: " before every message */
typedef struct {
    const char *name;
} where;

static kvs_status refuse(const where *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kvs_status refuse(const where *w, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return kvs_fail(KVS_ERR_FORMAT, "kv profile%s%s: %s", w->name ? " " : "", w->name ? w->name : "", why);
}

/* What a value is, for messages: its number, or its kind ("a string"). */
static const char *describe(const json_t *v, char *buf, size_t cap) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: case JSON_REAL: snprintf(buf, cap, "%.6g", json_number_value(v)); return buf;
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static const char *expected_name(json_type t) {
    return t == JSON_REAL ? "a number" : t == JSON_INTEGER ? "an integer" : t == JSON_STRING ? "a string"
           : t == JSON_ARRAY ? "an array" : "an object";
}

/* The field key of obj, of the type `want` (JSON_REAL: any number); named `field` in messages. */
static kvs_status field(const where *w, json_t *obj, const char *key, const char *field, json_type want, json_t **out) {
    *out = json_object_get(obj, key);
    if (!*out) return refuse(w, "%s is missing", field);
    if (want == JSON_REAL ? json_is_number(*out) : json_typeof(*out) == want) return KVS_OK;
    char buf[32];
    return refuse(w, "%s is %s, must be %s", field, describe(*out, buf, sizeof buf), expected_name(want));
}

static kvs_status check_header(const where *w, json_t *root, int n_layers, int *file_layers) {
    json_t *v;
    KVS_TRY(field(w, root, "format", "format", JSON_STRING, &v));
    if (strcmp(json_string_value(v), PROFILE_FORMAT))
        return refuse(w, "format is \"%.64s\", must be \"" PROFILE_FORMAT "\"", json_string_value(v));
    KVS_TRY(field(w, root, "version", "version", JSON_INTEGER, &v));
    if (json_integer_value(v) != 1)
        return refuse(w, "version is %lld, this kvsparse reads version 1", (long long)json_integer_value(v));
    KVS_TRY(field(w, root, "n_layers", "n_layers", JSON_INTEGER, &v));
    json_int_t L = json_integer_value(v);
    if (n_layers > 0 && L != n_layers) return refuse(w, "n_layers is %lld, the model has %d", (long long)L, n_layers);
    if (L < 1 || L > PROFILE_MAX_LAYERS) return refuse(w, "n_layers is %lld, must be in [1, %d]", (long long)L, PROFILE_MAX_LAYERS);
    *file_layers = (int)L;
    return KVS_OK;
}

/* budgets[t]: its compression (> 1, above the previous target's) and layer_share. */
static kvs_status read_target(const where *w, json_t *b, int t, kvs_kv_profile *p) {
    char name[96];
    json_t *v, *shares;
    snprintf(name, sizeof name, "budgets[%d]", t);
    char buf[32];
    if (!json_is_object(b)) return refuse(w, "%s is %s, must be an object", name, describe(b, buf, sizeof buf));
    snprintf(name, sizeof name, "budgets[%d].compression", t);
    KVS_TRY(field(w, b, "compression", name, JSON_REAL, &v));
    double c = json_number_value(v);
    if (!isfinite(c) || c <= 1) return refuse(w, "%s is %g, must be a finite number > 1", name, c);
    if (t > 0 && c <= p->compression[t - 1])
        return refuse(w, "%s is %g, must be above budgets[%d].compression (%g): targets in ascending order", name, c, t - 1,
                      p->compression[t - 1]);
    p->compression[t] = c;
    snprintf(name, sizeof name, "budgets[%d].layer_share", t);
    KVS_TRY(field(w, b, "layer_share", name, JSON_ARRAY, &shares));
    if ((int)json_array_size(shares) != p->n_layers)
        return refuse(w, "%s has %zu numbers, must have n_layers = %d", name, json_array_size(shares), p->n_layers);
    if (!(p->share[t] = malloc(sizeof(float) * p->n_layers))) return kvs_fail(KVS_ERR_NOMEM, "kv profile: out of memory");
    double sum = 0;
    for (int l = 0; l < p->n_layers; l++) {
        json_t *s = json_array_get(shares, l);
        if (!json_is_number(s)) return refuse(w, "%s[%d] is %s, must be a number", name, l, describe(s, buf, sizeof buf));
        double x = json_number_value(s);
        if (!(x > 0 && x <= 1)) return refuse(w, "%s[%d] is %g, must be in (0, 1]", name, l, x);
        if (x < 1e-9) return refuse(w, "%s[%d] is %g, too small a share (below 1e-9)", name, l, x);
        p->share[t][l] = (float)x;
        sum += x;
    }
    double mean = sum / p->n_layers;
    if (fabs(mean * c - 1) > 0.02)
        return refuse(w, "%s has mean %.6g, must be within 2%% of 1 / compression = %.6g", name, mean, 1 / c);
    return KVS_OK;
}

static kvs_status read_profile(const where *w, json_t *root, int n_layers, kvs_kv_profile *p) {
    char buf[32];
    if (!json_is_object(root)) return refuse(w, "the top level is %s, must be an object", describe(root, buf, sizeof buf));
    KVS_TRY(check_header(w, root, n_layers, &p->n_layers));
    json_t *budgets;
    KVS_TRY(field(w, root, "budgets", "budgets", JSON_ARRAY, &budgets));
    size_t n = json_array_size(budgets);
    if (n == 0 || n > KVS_KV_PROFILE_MAX_TARGETS)
        return refuse(w, "budgets has %zu targets, must have 1 to %d", n, KVS_KV_PROFILE_MAX_TARGETS);
    for (int t = 0; t < (int)n; t++) {
        KVS_TRY(read_target(w, json_array_get(budgets, t), t, p));
        p->n_targets = t + 1;
    }
    return KVS_OK;
}

static kvs_status parse_named(const char *text, size_t len, const char *name, int n_layers, kvs_kv_profile **out) {
    *out = NULL;
    where w = {name};
    json_error_t err;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (!root) return refuse(&w, "not JSON (line %d: %s)", err.line, err.text);
    kvs_kv_profile *p = calloc(1, sizeof *p);
    kvs_status st = p ? read_profile(&w, root, n_layers, p) : kvs_fail(KVS_ERR_NOMEM, "kv profile: out of memory");
    json_decref(root);
    if (st != KVS_OK) {
        kvs_kv_profile_free(p);
        return st;
    }
    *out = p;
    return KVS_OK;
}

kvs_status kvs_kv_profile_parse(const char *text, size_t len, int n_layers, kvs_kv_profile **out) {
    return parse_named(text, len, NULL, n_layers, out);
}

kvs_status kvs_kv_profile_load(const char *path, int n_layers, kvs_kv_profile **out) {
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    if (kvs_read_file(path, &text, &len) != KVS_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvs_last_error()); /* "PATH: cannot open: REASON" */
        return kvs_fail(KVS_ERR_IO, "kv profile %s", why);
    }
    kvs_status st = parse_named(text, len, path, n_layers, out);
    free(text);
    return st;
}

void kvs_kv_profile_free(kvs_kv_profile *p) {
    if (!p) return;
    for (int t = 0; t < KVS_KV_PROFILE_MAX_TARGETS; t++) free(p->share[t]);
    free(p);
}
