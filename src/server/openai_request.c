/* server: OpenAI request bodies -> kvs_api_request, strictly validated.
 * Every rejection names the field at fault (error.param). */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

bool kvs_api_fail(kvs_api_error *err, int http_status, const char *param, const char *fmt, ...) {
    err->http_status = http_status;
    err->type = http_status == 401   ? "authentication_error"
                : http_status == 404 ? "not_found_error"
                : http_status >= 500 ? "server_error"
                                     : "invalid_request_error";
    err->code = NULL;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return false;
}

/* A JSON string of s. A message may quote a client's bytes (a URL, a field
 * name) or cut a character short at its length limit: when s is not valid
 * UTF-8, its non-ASCII bytes become '?'. */
static json_t *json_text(const char *s) {
    json_t *j = json_string(s);
    if (j) return j;
    char *c = strdup(s);
    if (!c) return json_string("?");
    for (char *p = c; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    j = json_string(c);
    free(c);
    return j;
}

char *kvs_api_error_json(const kvs_api_error *err) {
    json_t *e = json_object();
    json_object_set_new(e, "message", json_text(err->message[0] ? err->message : "error"));
    json_object_set_new(e, "type", json_string(err->type ? err->type : "invalid_request_error"));
    json_object_set_new(e, "param", err->param[0] ? json_text(err->param) : json_null());
    json_object_set_new(e, "code", err->code ? json_string(err->code) : json_null());
    json_t *root = json_pack("{s:o}", "error", e);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s) s = strdup("{\"error\":{\"message\":\"error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
    return s;
}

int kvs_api_error_status(const kvs_api_error *err, kvs_api_dialect d) {
    /* Anthropic's clients read 529 as "overloaded, retry": a draining or failed server */
    return d == KVS_DIALECT_ANTHROPIC && err->http_status == 503 ? 529 : err->http_status;
}

/* Anthropic's error type of a status (its clients map the type and the status to their error classes). */
static const char *anthropic_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 529: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

char *kvs_api_error_json_as(const kvs_api_error *err, kvs_api_dialect d) {
    if (d != KVS_DIALECT_ANTHROPIC) return kvs_api_error_json(err);
    /* Anthropic's shape has no param: the message names the field, as every message here does */
    json_t *root = json_pack("{s:s, s:{s:s, s:o}}", "type", "error", "error", "type",
                             anthropic_type(kvs_api_error_status(err, d)), "message",
                             json_text(err->message[0] ? err->message : "error"));
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s ? s : strdup("{\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"error\"}}");
}

void kvs_api_request_free(kvs_api_request *r) {
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    kvs_api_tools_free(r);
    for (int i = 0; i < r->n_messages; i++) {
        free((char *)r->messages[i].role);
        free((char *)r->messages[i].content);
    }
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->cache_salt);
    free(r->logit_bias);
    free(r->stop_token_ids);
    json_decref(r->format_schema);
    json_decref(r->echo);
    memset(r, 0, sizeof *r);
}

/* ---- prompts and messages ------------------------------------------------------ */
static bool parse_ids(json_t *arr, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    size_t n = json_array_size(arr), i;
    if (n == 0) return kvs_api_fail(err, 400, "prompt", "'prompt' is empty");
    r->prompt_ids = malloc(sizeof(int32_t) * n);
    if (!r->prompt_ids) return kvs_api_fail(err, 500, NULL, "out of memory");
    json_t *t;
    json_array_foreach(arr, i, t) {
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= lim->vocab_size)
            return kvs_api_fail(err, 400, "prompt", "prompt token ids must be integers in [0, %d)", lim->vocab_size);
        r->prompt_ids[i] = (int32_t)json_integer_value(t);
    }
    r->n_prompt_ids = (int)n;
    return true;
}

/* Text far beyond the context is refused before it is tokenized: a token of
 * a real vocabulary holds fewer bytes than this on average. */
#define BYTES_PER_TOKEN 64

static unsigned long long max_text_bytes(const kvs_api_limits *lim) {
    return (unsigned long long)BYTES_PER_TOKEN * (unsigned long long)(lim->max_model_len > 0 ? lim->max_model_len : 0);
}

static bool too_much_text(kvs_api_error *err, const char *param, const char *what, size_t n, const kvs_api_limits *lim) {
    return kvs_api_fail(err, 400, param,
                        "%s %zu bytes, more than this model's context of %d tokens can hold: the limit is %llu bytes "
                        "(%d per token), checked before tokenizing",
                        what, n, lim->max_model_len, max_text_bytes(lim), BYTES_PER_TOKEN);
}

static bool parse_prompt(json_t *v, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    if (!v) return kvs_api_fail(err, 400, "prompt", "'prompt' is required");
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0); /* a batch of one */
    if (json_is_string(v)) {
        size_t n = json_string_length(v);
        if (n == 0) return kvs_api_fail(err, 400, "prompt", "'prompt' is empty");
        if (n > max_text_bytes(lim)) return too_much_text(err, "prompt", "the prompt has", n, lim);
        if (memchr(json_string_value(v), 0, n)) return kvs_api_fail(err, 400, "prompt", "'prompt' must not hold NUL");
        r->prompt = strdup(json_string_value(v));
        return true;
    }
    if (json_is_array(v)) {
        json_t *first = json_array_get(v, 0);
        if (first && !json_is_integer(first))
            return kvs_api_fail(err, 400, "prompt", "batched prompts are not supported: send one prompt per request");
        return parse_ids(v, lim, r, err);
    }
    return kvs_api_fail(err, 400, "prompt", "'prompt' must be a string or an array of token ids");
}

/* content: a string, or an array of {"type": "text", "text": ...} parts (joined). */
static bool parse_content(json_t *c, int i, char **out, kvs_api_error *err) {
    char param[48];
    snprintf(param, sizeof param, "messages[%d].content", i);
    if (!c || json_is_null(c)) { *out = strdup(""); return true; }
    if (json_is_string(c)) {
        if (memchr(json_string_value(c), 0, json_string_length(c)))
            return kvs_api_fail(err, 400, param, "'%s' must not hold NUL", param);
        *out = strdup(json_string_value(c));
        return true;
    }
    if (!json_is_array(c)) return kvs_api_fail(err, 400, param, "'%s' must be a string or an array of text parts", param);
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") || !json_is_string(text))
            return kvs_api_fail(err, 400, param, "'%s': only parts {\"type\": \"text\", \"text\": ...} are supported", param);
        if (memchr(json_string_value(text), 0, json_string_length(text)))
            return kvs_api_fail(err, 400, param, "'%s' must not hold NUL", param);
        total += json_string_length(text);
    }
    char *s = malloc(total + 1);
    if (!s) return kvs_api_fail(err, 500, NULL, "out of memory");
    size_t at = 0;
    json_array_foreach(c, k, part) {
        json_t *text = json_object_get(part, "text");
        memcpy(s + at, json_string_value(text), json_string_length(text));
        at += json_string_length(text);
    }
    s[at] = 0;
    *out = s;
    return true;
}

bool kvs_api_parse_messages(json_t *v, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    if (!v) return kvs_api_fail(err, 400, "messages", "'messages' is required");
    if (!json_is_array(v) || json_array_size(v) == 0)
        return kvs_api_fail(err, 400, "messages", "'messages' must be a non-empty array");
    if (json_array_size(v) > 4096) return kvs_api_fail(err, 400, "messages", "'messages' holds at most 4096 messages");
    if (json_array_size(v) > (size_t)(lim->max_model_len > 0 ? lim->max_model_len : 0))
        return kvs_api_fail(err, 400, "messages", "'messages' holds %zu messages, more than this model's context of %d "
                            "tokens can hold", json_array_size(v), lim->max_model_len);
    size_t total = 0;
    r->messages = calloc(json_array_size(v), sizeof *r->messages);
    if (!r->messages) return kvs_api_fail(err, 500, NULL, "out of memory");
    size_t i;
    json_t *m;
    json_array_foreach(v, i, m) {
        char param[48];
        snprintf(param, sizeof param, "messages[%d].role", (int)i);
        if (!json_is_object(m)) return kvs_api_fail(err, 400, "messages", "messages[%d] must be an object", (int)i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) return kvs_api_fail(err, 400, param, "'%s' must be a string", param);
        const char *rs = json_string_value(role);
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "developer") &&
            strcmp(rs, "tool"))
            return kvs_api_fail(err, 400, param,
                                "'%s' must be one of system, developer, user, assistant, tool", param);
        char *content = NULL;
        if (!parse_content(json_object_get(m, "content"), (int)i, &content, err)) return false;
        if (!content) return kvs_api_fail(err, 500, NULL, "out of memory");
        total += strlen(content);
        if (total > max_text_bytes(lim)) {
            free(content);
            return too_much_text(err, "messages", "the messages' contents have", total, lim);
        }
        r->messages[i].role = strdup(!strcmp(rs, "developer") ? "system" : rs);
        r->messages[i].content = content;
        r->n_messages = (int)i + 1;
        if (!kvs_api_parse_message_tools(m, (int)i, &r->messages[i], err)) return false;
    }
    return true;
}

/* Fields accepted with their neutral value only (so clients that send the defaults work). */
static bool check_neutral(const char *key, json_t *v, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!strcmp(key, "best_of")) {
        if (json_is_integer(v) && json_integer_value(v) == 1) return true;
        return kvs_api_fail(err, 400, key, "'best_of' must be 1");
    }
    if (!strcmp(key, "echo")) {
        if (json_is_false(v)) return true;
        return kvs_api_fail(err, 400, key, "'echo' is not supported");
    }
    if (!strcmp(key, "user")) {
        if (json_is_string(v)) return true;
        return kvs_api_fail(err, 400, key, "'user' must be a string");
    }
    if (!strcmp(key, "tools") || !strcmp(key, "functions")) {
        if (json_is_array(v) && json_array_size(v) == 0) return true;
        return kvs_api_fail(err, 400, key, "'%s' (tool calling) is not supported", key);
    }
    return kvs_api_fail(err, 400, key, "unrecognized request argument supplied: %.40s", key);
}

static bool parse_fields(json_t *root, kvs_api_kind kind, const kvs_api_limits *lim, kvs_api_request *r,
                         kvs_api_error *err) {
    const char *key;
    json_t *v;
    bool want_logprobs = false;
    json_int_t top = -1;
    json_object_foreach(root, key, v) {
        json_int_t x;
        int common = kvs_api_parse_common_field(key, v, lim, r, err); /* request_fields.c */
        if (common == 0) return false;
        if (common > 0) continue;
        if (!strcmp(key, "prompt") && kind == KVS_API_COMPLETIONS) {
            if (!parse_prompt(v, lim, r, err)) return false;
        } else if (!strcmp(key, "messages") && kind == KVS_API_CHAT) {
            if (!kvs_api_parse_messages(v, lim, r, err)) return false;
        } else if (!strcmp(key, "stream_options")) {
            if (json_is_null(v)) continue;
            /* include_usage; vLLM's continuous_usage_stats is accepted (usage still comes in the last chunk) */
            json_t *u = json_object_get(v, "include_usage"), *cu = json_object_get(v, "continuous_usage_stats");
            bool shape = json_is_object(v) && json_object_size(v) == (size_t)(u != NULL) + (cu != NULL);
            if (!shape || (u && !json_is_boolean(u) && !json_is_null(u)) || (cu && !json_is_boolean(cu) && !json_is_null(cu)))
                return kvs_api_fail(err, 400, "stream_options",
                                    "'stream_options' must be {\"include_usage\": bool, \"continuous_usage_stats\": bool}");
            r->include_usage = json_is_true(u);
        } else if (!strcmp(key, "max_tokens") || !strcmp(key, "max_completion_tokens")) {
            if (json_is_null(v)) continue;
            if (!kvs_api_get_int(v, key, 1, lim->max_model_len, &x, err)) return false;
            r->max_tokens = (int)x;
            r->max_tokens_param = !strcmp(key, "max_tokens") ? "max_tokens" : "max_completion_tokens";
        } else if (!strcmp(key, "stop")) {
            if (!kvs_api_parse_stop(v, "stop", r, err)) return false;
        } else if (!strcmp(key, "n")) {
            if (json_is_null(v)) continue;
            if (!kvs_api_get_int(v, "n", 1, KVS_MAX_N, &x, err)) return false;
            r->n = (int)x;
        } else if (!strcmp(key, "response_format")) {
            if (!kvs_api_parse_format(v, "response_format", r, err)) return false;
        } else if (!strcmp(key, "logprobs")) {
            if (json_is_null(v)) continue;
            if (kind == KVS_API_CHAT) {
                if (!kvs_api_get_bool(v, "logprobs", &want_logprobs, err)) return false;
            } else {
                if (json_is_boolean(v)) return kvs_api_fail(err, 400, "logprobs", "'logprobs' must be an integer");
                if (!kvs_api_get_int(v, "logprobs", 0, 20, &x, err)) return false;
                want_logprobs = true;
                top = x;
            }
        } else if (!strcmp(key, "top_logprobs") && kind == KVS_API_CHAT) {
            if (json_is_null(v)) continue;
            if (!kvs_api_get_int(v, "top_logprobs", 0, 20, &top, err)) return false;
        } else if (!strcmp(key, "return_token_ids")) {
            if (!json_is_null(v) && !kvs_api_get_bool(v, "return_token_ids", &r->return_token_ids, err)) return false;
        } else if (!strcmp(key, "suffix") && kind == KVS_API_COMPLETIONS) {
            if (!json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
                return kvs_api_fail(err, 400, "suffix", "'suffix' is not supported");
        } else if (kind == KVS_API_CHAT && kvs_api_is_tools_field(key)) {
            if (!kvs_api_parse_tools_field(key, v, r, err)) return false;
        } else if (!check_neutral(key, v, err)) {
            return false;
        }
    }
    if (kind == KVS_API_CHAT && top >= 0 && !want_logprobs)
        return kvs_api_fail(err, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r->logprobs = want_logprobs;
    r->top_logprobs = top > 0 ? (int)top : 0;
    if (kind == KVS_API_COMPLETIONS && !r->prompt && !r->prompt_ids)
        return kvs_api_fail(err, 400, "prompt", "'prompt' is required");
    if (kind == KVS_API_CHAT && !r->messages) return kvs_api_fail(err, 400, "messages", "'messages' is required");
    if (kind == KVS_API_CHAT && !kvs_api_tools_check(r, err)) return false;
    if (r->include_usage && !r->stream)
        return kvs_api_fail(err, 400, "stream_options", "'stream_options' is only allowed with 'stream': true");
    return kvs_api_check_sampling(&r->sampling, err); /* the prompt's length against the context: route.c */
}

kvs_sampling_params kvs_api_sampling_default(void) {
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = 1.0f;
    return p;
}

void kvs_api_request_init(kvs_api_request *r, kvs_api_kind kind, const kvs_api_limits *lim) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->sampling = lim->sampling ? *lim->sampling : kvs_api_sampling_default(); /* what the request sets wins */
    kvs_api_tools_defaults(r);
}

bool kvs_api_parse_request(const char *body, size_t len, kvs_api_kind kind, const kvs_api_limits *lim,
                           kvs_api_request *r, kvs_api_error *err) {
    kvs_api_request_init(r, kind, lim);
    memset(err, 0, sizeof *err);
    json_t *root = kvs_api_load_object(body, len, err);
    bool ok = root && parse_fields(root, kind, lim, r, err);
    json_decref(root); /* the engine checks the sampling parameters again at submit */
    if (!ok) kvs_api_request_free(r);
    return ok;
}
