/* generation_config.json's sampling fields: a request's defaults (--generation-config auto).
 * Its eos/bos are config.c's (they apply whatever the flag says). */
#include "model/model_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A number field in [lo, hi] (lo excluded when open_lo); absent or null: *has stays false. */
static kvs_status get_number(const json_t *root, const char *key, const char *name, double lo, double hi, bool open_lo,
                             const char *range, float *out, bool *has) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_number(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a number %s", name, key, range);
    double x = json_number_value(v);
    if (!isfinite((float)x) || x < lo || (open_lo && x == lo) || x > hi)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a number %s (got %g)", name, key, range, x);
    *out = (float)x;
    *has = true;
    return KVS_OK;
}

static kvs_status get_int(const json_t *root, const char *key, const char *name, long long lo, int *out, bool *has) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_integer(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be an integer >= %lld", name, key, lo);
    long long x = json_integer_value(v);
    if (x < lo || x > (1 << 30))
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be an integer in [%lld, 2^30] (got %lld)", name, key, lo, x);
    *out = (int)x;
    *has = true;
    return KVS_OK;
}

static kvs_status parse_fields(const json_t *root, const char *name, kvs_generation_config *g) {
    if (!json_is_object(root)) return kvs_fail(KVS_ERR_FORMAT, "%s: expected a JSON object", name);
    KVS_TRY(get_number(root, "temperature", name, 0, HUGE_VAL, false, ">= 0", &g->temperature, &g->has_temperature));
    KVS_TRY(get_number(root, "top_p", name, 0, 1, true, "in (0, 1]", &g->top_p, &g->has_top_p));
    KVS_TRY(get_int(root, "top_k", name, 0, &g->top_k, &g->has_top_k));
    KVS_TRY(get_number(root, "min_p", name, 0, 1, false, "in [0, 1]", &g->min_p, &g->has_min_p));
    KVS_TRY(get_number(root, "repetition_penalty", name, 0, 100, true, "in (0, 100]", &g->repetition_penalty,
                       &g->has_repetition_penalty));
    KVS_TRY(get_int(root, "max_new_tokens", name, 1, &g->max_new_tokens, &g->has_max_new_tokens));
    const json_t *d = json_object_get(root, "do_sample");
    if (!d || json_is_null(d)) return KVS_OK;
    if (!json_is_boolean(d)) return kvs_fail(KVS_ERR_FORMAT, "%s: field 'do_sample' must be true or false", name);
    if (json_is_false(d)) g->temperature = 0, g->has_temperature = true; /* transformers: greedy */
    else if (!g->has_temperature) g->temperature = 1, g->has_temperature = true;
    return KVS_OK;
}

kvs_status kvs_generation_config_parse(const char *json_text, size_t len, const char *name, kvs_generation_config *g) {
    memset(g, 0, sizeof *g);
    json_t *root;
    KVS_TRY(kvs_config_json_load(json_text, len, name, &root));
    kvs_status s = parse_fields(root, name, g);
    json_decref(root);
    if (s != KVS_OK) memset(g, 0, sizeof *g);
    return s;
}

kvs_status kvs_generation_config_load(const char *model_dir, kvs_generation_config *g) {
    memset(g, 0, sizeof *g);
    char path[4096];
    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, "generation_config.json"));
    if (!kvs_file_exists(path)) return KVS_OK;
    char *text = NULL;
    size_t len = 0;
    KVS_TRY(kvs_read_file(path, &text, &len));
    kvs_status s = kvs_generation_config_parse(text, len, path, g);
    free(text);
    return s;
}

bool kvs_generation_config_any(const kvs_generation_config *g) {
    return g->has_temperature || g->has_top_p || g->has_top_k || g->has_min_p || g->has_repetition_penalty ||
           g->has_max_new_tokens;
}
