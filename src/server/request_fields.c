/* server: the request fields every API shares (OpenAI's chat and completions,
 * Anthropic's messages, OpenAI's responses): typed readers, sampling, stops,
 * the vLLM extensions, kv_policy and response_format. One validator for all,
 * so that each API's parser only maps its own shapes onto kvs_api_request. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

/* ---- typed field readers: each returns false after filling err ------------- */
bool kvs_api_get_number(json_t *v, const char *name, double lo, double hi, double *out, kvs_api_error *err) {
    if (!json_is_number(v)) return kvs_api_fail(err, 400, name, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return kvs_api_fail(err, 400, name, "'%s' must be in [%g, %g], got %g", name, lo, hi, x);
    *out = x;
    return true;
}

/* The engine's sampling rules (kvs_sampling_validate); param: the parameter its message names. */
bool kvs_api_check_sampling(const kvs_sampling_params *p, kvs_api_error *err) {
    if (kvs_sampling_validate(p) == KVS_OK) return true;
    static const char *const names[] = {"temperature", "top_k", "top_p", "min_p"};
    const char *msg = kvs_last_error(), *param = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strncmp(msg, names[i], strlen(names[i])) && msg[strlen(names[i])] == ' ') param = names[i];
    return kvs_api_fail(err, 400, param, "%s", msg);
}

bool kvs_api_get_int(json_t *v, const char *name, json_int_t lo, json_int_t hi, json_int_t *out, kvs_api_error *err) {
    if (!json_is_integer(v)) return kvs_api_fail(err, 400, name, "'%s' must be an integer", name);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return kvs_api_fail(err, 400, name, "'%s' must be in [%lld, %lld], got %lld", name, (long long)lo,
                            (long long)hi, (long long)x);
    *out = x;
    return true;
}

bool kvs_api_get_bool(json_t *v, const char *name, bool *out, kvs_api_error *err) {
    if (!json_is_boolean(v)) return kvs_api_fail(err, 400, name, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return true;
}

/* A stop string or an array of them; param: the field's name in the request's API. */
bool kvs_api_parse_stop(json_t *v, const char *param, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (json_is_string(v)) {
        json_t *arr = json_pack("[O]", v);
        bool ok = kvs_api_parse_stop(arr, param, r, err);
        json_decref(arr);
        return ok;
    }
    if (!json_is_array(v))
        return kvs_api_fail(err, 400, param, "'%s' must be a string or an array of strings", param);
    if (json_array_size(v) > KVS_MAX_STOP_STRINGS)
        return kvs_api_fail(err, 400, param, "'%s' holds at most %d strings", param, KVS_MAX_STOP_STRINGS);
    size_t i;
    json_t *s;
    json_array_foreach(v, i, s) {
        if (!json_is_string(s)) return kvs_api_fail(err, 400, param, "'%s' must hold strings", param);
        size_t n = json_string_length(s);
        if (n == 0 || n > 256) return kvs_api_fail(err, 400, param, "'%s' strings must have 1 to 256 bytes", param);
        if (memchr(json_string_value(s), 0, n)) return kvs_api_fail(err, 400, param, "'%s' strings must not hold NUL", param);
        if (!(r->stop[r->n_stop] = strdup(json_string_value(s)))) return kvs_api_fail(err, 500, NULL, "out of memory");
        r->n_stop++;
    }
    return true;
}

/* vLLM's "cache_salt": a non-empty string (at most the engine's KVS_MAX_CACHE_SALT bytes); null: none. */
static bool parse_cache_salt(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_string(v)) return kvs_api_fail(err, 400, "cache_salt", "'cache_salt' must be a string");
    size_t n = json_string_length(v);
    if (n == 0 || n > KVS_MAX_CACHE_SALT)
        return kvs_api_fail(err, 400, "cache_salt", "'cache_salt' must have 1 to %d bytes", KVS_MAX_CACHE_SALT);
    if (!(r->cache_salt = strdup(json_string_value(v)))) return kvs_api_fail(err, 500, NULL, "out of memory");
    return true;
}

/* "logit_bias": {"token id": bias in [-100, 100], ...}, at most KVS_MAX_LOGIT_BIAS. */
static bool parse_logit_bias(json_t *v, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_object(v))
        return kvs_api_fail(err, 400, "logit_bias", "'logit_bias' must be an object of token ids to biases");
    size_t n = json_object_size(v);
    if (n > KVS_MAX_LOGIT_BIAS)
        return kvs_api_fail(err, 400, "logit_bias", "'logit_bias' holds %zu entries (at most %d)", n,
                            KVS_MAX_LOGIT_BIAS);
    if (n && !(r->logit_bias = malloc(sizeof *r->logit_bias * n))) return kvs_api_fail(err, 500, NULL, "out of memory");
    const char *key;
    json_t *b;
    json_object_foreach(v, key, b) {
        /* a token id written plainly: no sign, space or leading zero (" 5", "+5" and "05" are not 5) */
        char *end;
        long id = key[0] >= '1' && key[0] <= '9' ? strtol(key, &end, 10) : -1;
        if (!strcmp(key, "0")) id = 0, end = (char *)key + 1;
        if (id < 0 || *end || id >= lim->vocab_size)
            return kvs_api_fail(err, 400, "logit_bias", "'logit_bias' key '%.40s' is not a token id in [0, %d)", key,
                                lim->vocab_size);
        if (!json_is_number(b) || !(json_number_value(b) >= -100 && json_number_value(b) <= 100))
            return kvs_api_fail(err, 400, "logit_bias", "'logit_bias' of token %ld must be a number in [-100, 100]",
                                id);
        r->logit_bias[r->n_logit_bias++] = (kvs_logit_bias){(int32_t)id, (float)json_number_value(b)};
    }
    return true;
}

/* vLLM's "stop_token_ids": [id, ...]. */
static bool parse_stop_token_ids(json_t *v, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_array(v) || json_array_size(v) > 1024)
        return kvs_api_fail(err, 400, "stop_token_ids", "'stop_token_ids' must be an array of at most 1024 token ids");
    size_t n = json_array_size(v);
    if (n && !(r->stop_token_ids = malloc(sizeof(int32_t) * n))) return kvs_api_fail(err, 500, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_int_t x;
        if (!kvs_api_get_int(json_array_get(v, i), "stop_token_ids", 0, lim->vocab_size - 1, &x, err)) return false;
        r->stop_token_ids[r->n_stop_token_ids++] = (int32_t)x;
    }
    return true;
}

/* "response_format": {"type": "text" | "json_object"} or {"type": "json_schema",
 * "json_schema": {"name", "schema", "strict", "description"}}; the schema is
 * compiled at submit (route.c), refused there naming what it does not support. */
bool kvs_api_parse_format(json_t *v, const char *param, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    json_t *t = json_object_get(v, "type");
    if (!json_is_object(v) || !json_is_string(t))
        return kvs_api_fail(err, 400, param, "'%s' must be an object with a string 'type'", param);
    const char *type = json_string_value(t);
    if (!strcmp(type, "text")) return true;
    if (!strcmp(type, "json_object")) {
        r->format = KVS_FORMAT_JSON_OBJECT;
        return true;
    }
    if (strcmp(type, "json_schema"))
        return kvs_api_fail(err, 400, param, "'%s.type' must be text, json_object or json_schema", param);
    /* OpenAI's responses API flattens {"json_schema": {...}} into the format object itself */
    bool flat = !strcmp(param, "text.format");
    json_t *js = flat ? v : json_object_get(v, "json_schema"), *schema = json_object_get(js, "schema");
    if (!json_is_object(js) || !json_is_object(schema))
        return kvs_api_fail(err, 400, param, "'%s%s.schema' must be an object", param, flat ? "" : ".json_schema");
    json_t *strict = json_object_get(js, "strict");
    if (strict && !json_is_boolean(strict) && !json_is_null(strict))
        return kvs_api_fail(err, 400, param, "'%s%s.strict' must be a boolean", param, flat ? "" : ".json_schema");
    r->format = KVS_FORMAT_JSON_SCHEMA;
    r->format_schema = json_incref(schema);
    return true;
}

int kvs_api_parse_common_field(const char *key, json_t *v, const kvs_api_limits *lim, kvs_api_request *r,
                               kvs_api_error *err) {
    json_int_t x;
    double d;
    bool null = json_is_null(v);
    if (!strcmp(key, "model")) {
        if (!json_is_string(v)) return kvs_api_fail(err, 400, "model", "'model' must be a string");
        if (!(r->model = strdup(json_string_value(v)))) return kvs_api_fail(err, 500, NULL, "out of memory");
    } else if (!strcmp(key, "stream")) {
        if (!null && !kvs_api_get_bool(v, "stream", &r->stream, err)) return 0;
    } else if (!strcmp(key, "temperature")) { /* its lower bound and the others' ranges: kvs_api_check_sampling */
        if (null) return 1;
        if (!kvs_api_get_number(v, "temperature", -HUGE_VAL, HUGE_VAL, &d, err)) return 0;
        if (d > 100) return kvs_api_fail(err, 400, "temperature", "'temperature' must be at most 100, got %g", d);
        r->sampling.temperature = (float)d;
    } else if (!strcmp(key, "top_p") || !strcmp(key, "min_p")) {
        if (null) return 1;
        if (!kvs_api_get_number(v, key, -HUGE_VAL, HUGE_VAL, &d, err)) return 0;
        *(key[0] == 't' ? &r->sampling.top_p : &r->sampling.min_p) = (float)d;
    } else if (!strcmp(key, "top_k")) {
        if (null) return 1;
        if (!kvs_api_get_int(v, "top_k", -1, 1 << 30, &x, err)) return 0;
        r->sampling.top_k = x < 0 ? 0 : (int)x;
    } else if (!strcmp(key, "seed")) {
        if (null) return 1;
        if (!json_is_integer(v)) return kvs_api_fail(err, 400, "seed", "'seed' must be an integer");
        r->sampling.seed = (uint64_t)json_integer_value(v);
        r->sampling.has_seed = true;
    } else if (!strcmp(key, "presence_penalty") || !strcmp(key, "frequency_penalty")) {
        if (null) return 1;
        if (!kvs_api_get_number(v, key, -2, 2, &d, err)) return 0;
        *(key[0] == 'p' ? &r->sampling.presence_penalty : &r->sampling.frequency_penalty) = (float)d;
    } else if (!strcmp(key, "repetition_penalty")) {
        if (null) return 1;
        if (!kvs_api_get_number(v, key, 0, 100, &d, err)) return 0;
        if (d == 0) return kvs_api_fail(err, 400, key, "'repetition_penalty' must be > 0 (1 disables it)");
        r->sampling.repetition_penalty = (float)d;
    } else if (!strcmp(key, "logit_bias")) {
        return parse_logit_bias(v, lim, r, err);
    } else if (!strcmp(key, "stop_token_ids")) {
        return parse_stop_token_ids(v, lim, r, err);
    } else if (!strcmp(key, "min_tokens")) {
        if (null) return 1;
        if (!kvs_api_get_int(v, "min_tokens", 0, lim->max_model_len, &x, err)) return 0;
        r->min_tokens = (int)x;
    } else if (!strcmp(key, "ignore_eos")) {
        if (!null && !kvs_api_get_bool(v, "ignore_eos", &r->ignore_eos, err)) return 0;
    } else if (!strcmp(key, "kv_policy")) {
        if (!kvs_api_parse_policy(v, lim, &r->policy, err)) return 0;
        r->has_policy = !null;
    } else if (!strcmp(key, "cache_salt")) {
        return parse_cache_salt(v, r, err);
    } else {
        return -1;
    }
    return 1;
}

json_t *kvs_api_load_object(const char *body, size_t len, kvs_api_error *err) {
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        kvs_api_fail(err, 400, NULL, "malformed JSON body: %s (at line %d, column %d)", jerr.text, jerr.line,
                     jerr.column);
        return NULL;
    }
    if (json_is_object(root)) return root;
    json_decref(root);
    kvs_api_fail(err, 400, NULL, "the request body must be a JSON object");
    return NULL;
}

static void rename_in(char *s, size_t cap, const char *from, const char *to) {
    char *p = strstr(s, from);
    if (!p) return;
    char tail[512];
    snprintf(tail, sizeof tail, "%s", p + strlen(from));
    snprintf(p, cap - (size_t)(p - s), "%s%s", to, tail);
}

void kvs_api_error_rename(kvs_api_error *err, const char *from, const char *to) {
    rename_in(err->param, sizeof err->param, from, to);
    rename_in(err->message, sizeof err->message, from, to);
}
