/* server: the HTTP request path without sockets: routing, auth, the body
 * limit, the GET endpoints, and a generation request's parsing, validation
 * and encoding, bounded by the prepare slots (see route.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/anthropic.h"
#include "server/responses.h"
#include "server/route.h"

static void answer(kvs_http_answer *a, int status, const char *content_type, char *body) {
    *a = (kvs_http_answer){status, content_type, body, NULL, false};
}

void kvs_http_answer_error(kvs_http_answer *a, const kvs_api_error *err) {
    answer(a, err->http_status, "application/json", kvs_api_error_json(err));
}

void kvs_http_answer_error_as(kvs_http_answer *a, const kvs_api_error *err, kvs_api_dialect d) {
    answer(a, kvs_api_error_status(err, d), "application/json", kvs_api_error_json_as(err, d));
}

kvs_api_dialect kvs_http_dialect(const char *url) {
    url = kvs_http_origin_path(url);
    if (!strncmp(url, "/v1/messages", 12) && (!url[12] || url[12] == '/' || url[12] == '?')) return KVS_DIALECT_ANTHROPIC;
    return KVS_DIALECT_OPENAI; /* the responses API's errors are OpenAI's */
}

kvs_api_dialect kvs_route_dialect(kvs_route r) {
    return r == KVS_ROUTE_MESSAGES || r == KVS_ROUTE_COUNT_TOKENS ? KVS_DIALECT_ANTHROPIC
           : r == KVS_ROUTE_RESPONSES                             ? KVS_DIALECT_RESPONSES
                                                                  : KVS_DIALECT_OPENAI;
}

bool kvs_route_generates(kvs_route r) {
    return r == KVS_ROUTE_COMPLETIONS || r == KVS_ROUTE_CHAT || r == KVS_ROUTE_MESSAGES || r == KVS_ROUTE_RESPONSES;
}

void kvs_http_answer_verrorf(kvs_http_answer *a, int status, const char *type, const char *fmt, va_list ap) {
    char msg[400];
    vsnprintf(msg, sizeof msg, fmt, ap);
    kvs_api_error err;
    kvs_api_fail(&err, status, NULL, "%s", msg);
    if (type) err.type = type;
    kvs_http_answer_error(a, &err);
}

void kvs_http_answer_errorf(kvs_http_answer *a, int status, const char *type, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvs_http_answer_verrorf(a, status, type, fmt, ap);
    va_end(ap);
}

/* d: the shape of the path's errors */
static bool fail_as(kvs_http_answer *a, kvs_api_dialect d, int status, const char *fmt, const char *arg) {
    kvs_api_error err;
    kvs_api_fail(&err, status, NULL, fmt, arg);
    kvs_http_answer_error_as(a, &err, d);
    return true;
}

static bool fail(kvs_http_answer *a, int status, const char *fmt, const char *arg) {
    return fail_as(a, KVS_DIALECT_OPENAI, status, fmt, arg);
}

static void too_large(const kvs_server *s, kvs_http_answer *a, kvs_api_dialect d) {
    kvs_api_error err;
    kvs_api_fail(&err, 413, NULL, "the request body is larger than the limit of %zu bytes", s->cfg.max_body_bytes);
    kvs_http_answer_error_as(a, &err, d);
}

static kvs_route find_route(const char *url) {
    if (!strcmp(url, "/v1/completions")) return KVS_ROUTE_COMPLETIONS;
    if (!strcmp(url, "/v1/chat/completions")) return KVS_ROUTE_CHAT;
    if (!strcmp(url, "/v1/completions/render")) return KVS_ROUTE_COMPLETIONS_RENDER;
    if (!strcmp(url, "/v1/chat/completions/render")) return KVS_ROUTE_CHAT_RENDER;
    if (!strcmp(url, "/v1/messages")) return KVS_ROUTE_MESSAGES;
    if (!strcmp(url, "/v1/messages/count_tokens")) return KVS_ROUTE_COUNT_TOKENS;
    if (!strcmp(url, "/v1/responses")) return KVS_ROUTE_RESPONSES;
    if (!strcmp(url, "/v1/models")) return KVS_ROUTE_MODELS;
    if (!strncmp(url, "/v1/models/", 11)) return KVS_ROUTE_MODEL;
    if (!strcmp(url, "/health")) return KVS_ROUTE_HEALTH;
    if (!strcmp(url, "/metrics")) return KVS_ROUTE_METRICS;
    if (!strcmp(url, "/tokenize")) return KVS_ROUTE_TOKENIZE;
    if (!strcmp(url, "/detokenize")) return KVS_ROUTE_DETOKENIZE;
    if (!strcmp(url, "/reset_prefix_cache")) return KVS_ROUTE_RESET_PREFIX_CACHE;
    if (!strcmp(url, "/")) return KVS_ROUTE_WEB_UI;
    return KVS_ROUTE_NONE;
}

/* key [h, h + a) equals the server's, compared in constant time. */
static bool key_is(const kvs_server *s, const char *h, size_t a) {
    size_t b = strlen(s->api_key);
    unsigned char diff = a != b;
    for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned char)(h[i] ^ s->api_key[i]);
    return diff == 0;
}

/* Authorization: Bearer KEY, or Anthropic's x-api-key: KEY (either one right is enough). */
static bool authorized(const kvs_server *s, const kvs_http_head_fields *f) {
    if (!s->api_key) return true;
    const char *h;
    size_t a;
    if (kvs_http_bearer(f->authorization, f->authorization_len, &h, &a) && key_is(s, h, a)) return true;
    return f->x_api_key && key_is(s, f->x_api_key, f->x_api_key_len);
}

static json_t *model_json(const kvs_server *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->model_name, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "kvsparse", "max_model_len", s->limits.max_model_len);
}

/* The engine has failed (none here: the fuzzer's and the tests' request path). */
static bool engine_failed(const kvs_server *s, const char **why) { return s->engine && kvs_engine_failed(s->engine, why); }

static void answer_get(kvs_server *s, kvs_route r, const char *url, kvs_http_answer *a) {
    const char *why;
    if (r == KVS_ROUTE_WEB_UI) { /* no key needed: the page asks for it and sends it with its requests */
        answer(a, 200, "text/html; charset=utf-8", kvs_web_ui_html());
        return;
    }
    if (r == KVS_ROUTE_HEALTH && engine_failed(s, &why)) { /* a supervisor restarts the process */
        json_t *j = json_pack("{s:s, s:s}", "status", "failed", "reason", why);
        answer(a, 503, "application/json", j ? json_dumps(j, JSON_COMPACT) : strdup("{\"status\":\"failed\"}")); /* not UTF-8 */
        json_decref(j);
        return;
    }
    if (r == KVS_ROUTE_HEALTH) {
        bool d = atomic_load(&s->draining);
        answer(a, d ? 503 : 200, "application/json", strdup(d ? "{\"status\":\"draining\"}" : "{\"status\":\"ok\"}"));
        return;
    }
    if (r == KVS_ROUTE_METRICS) {
        if (!s->engine) {
            fail(a, 503, "%s", "no engine");
            return;
        }
        kvs_server_http_stats hs = kvs_server_http_stats_get(s);
        answer(a, 200, "text/plain; version=0.0.4", kvs_server_metrics_text(s->engine, &s->cfg, s->model_name, &hs));
        return;
    }
    json_t *root;
    if (r == KVS_ROUTE_MODELS) {
        root = json_pack("{s:s, s:[o]}", "object", "list", "data", model_json(s));
    } else {
        if (strcmp(url + 11, s->model_name)) {
            fail(a, 404, "The model '%.200s' does not exist", url + 11);
            return;
        }
        root = model_json(s);
    }
    answer(a, 200, "application/json", json_dumps(root, JSON_COMPACT));
    json_decref(root);
}

bool kvs_http_head(kvs_server *s, const char *method, const char *url, const kvs_http_head_fields *f,
                   kvs_route *route, kvs_http_answer *a) {
    memset(a, 0, sizeof *a);
    url = kvs_http_origin_path(url);
    kvs_api_dialect d = kvs_http_dialect(url);
    kvs_route r = *route = find_route(url);
    if (r == KVS_ROUTE_NONE || (r == KVS_ROUTE_WEB_UI && s->cfg.no_web_ui)) return fail_as(a, d, 404, "Not found: %.200s", url);
    bool post = kvs_route_generates(r) || r == KVS_ROUTE_COUNT_TOKENS || r == KVS_ROUTE_TOKENIZE ||
                r == KVS_ROUTE_DETOKENIZE || r == KVS_ROUTE_RESET_PREFIX_CACHE || r == KVS_ROUTE_CHAT_RENDER ||
                r == KVS_ROUTE_COMPLETIONS_RENDER;
    if (post ? strcmp(method, "POST") : strcmp(method, "GET") && strcmp(method, "HEAD")) {
        fail_as(a, d, 405, "Method not allowed: use %s", post ? "POST" : "GET");
        a->allow = post ? "POST" : "GET, HEAD";
        return true;
    }
    if ((!strncmp(url, "/v1/", 4) || r == KVS_ROUTE_TOKENIZE || r == KVS_ROUTE_DETOKENIZE ||
         r == KVS_ROUTE_RESET_PREFIX_CACHE) && !authorized(s, f)) {
        kvs_api_error err;
        kvs_api_fail(&err, 401, NULL, "Incorrect or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'");
        err.code = "invalid_api_key";
        kvs_http_answer_error_as(a, &err, d);
        return true;
    }
    const char *why;
    if (kvs_route_generates(r) && engine_failed(s, &why)) return fail_as(a, d, 503, "the engine failed: %.400s", why);
    if (post && atomic_load(&s->draining)) return fail_as(a, d, 503, "%s", "the server is shutting down");
    if (!post) {
        answer_get(s, r, url, a);
        return true;
    }
    if (f->has_length && f->content_length > s->cfg.max_body_bytes) {
        too_large(s, a, d);
        return true;
    }
    return false;
}

bool kvs_http_body_add(const kvs_server *s, kvs_http_body *b, const char *p, size_t n, kvs_http_answer *a) {
    if (n > s->cfg.max_body_bytes - b->len) {
        too_large(s, a, KVS_DIALECT_OPENAI); /* only the in-memory path answers it (http.c closes the connection) */
        return false;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        if (cap > s->cfg.max_body_bytes + 1) cap = s->cfg.max_body_bytes + 1;
        char *q = realloc(b->data, cap);
        if (!q) {
            fail(a, 500, "%s", "out of memory");
            return false;
        }
        b->data = q;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return true;
}

void kvs_http_body_free(kvs_http_body *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ---- the prepare slots ------------------------------------------------------ */
bool kvs_http_slot_take(kvs_server *s, kvs_api_error *err) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += s->slot_wait_ms / 1000;
    until.tv_nsec += (long)(s->slot_wait_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&s->slot_mu);
    int rc = 0;
    while (s->slots_used >= s->cfg.max_preparing && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&s->slot_cv, &s->slot_mu, &until);
    bool ok = s->slots_used < s->cfg.max_preparing;
    if (ok) s->slots_used++;
    pthread_mutex_unlock(&s->slot_mu);
    if (!ok) {
        kvs_api_fail(err, 429, NULL,
                     "the server is busy: %d requests are being parsed and tokenized and none finished within %d ms; "
                     "retry later",
                     s->cfg.max_preparing, s->slot_wait_ms);
        err->type = "rate_limit_error";
    }
    return ok;
}

void kvs_http_slot_give(kvs_server *s) {
    pthread_mutex_lock(&s->slot_mu);
    s->slots_used--;
    pthread_cond_signal(&s->slot_cv);
    pthread_mutex_unlock(&s->slot_mu);
}

/* ---- a generation request: validate and encode ------------------------------ */
/* The field that holds the conversation in the request's API. */
static const char *messages_param(const kvs_api_request *r) {
    return r->dialect == KVS_DIALECT_RESPONSES ? "input" : "messages";
}

static bool encode_prompt(kvs_server *s, kvs_http_prepared *p, kvs_api_error *err) {
    kvs_api_request *r = &p->req;
    if (r->prompt_ids) {
        p->ids = r->prompt_ids;
        p->n_ids = r->n_prompt_ids;
        r->prompt_ids = NULL;
        return true;
    }
    if (!s->tok) return kvs_api_fail(err, 400, "prompt", "this model has no tokenizer: send token ids");
    kvs_status st;
    if (r->kind == KVS_API_CHAT) {
        st = kvs_tokenizer_encode_chat_tools(s->tok, s->tpl, r->messages, r->n_messages, r->tools, &p->ids, &p->n_ids);
        if (st != KVS_OK) {
            const char *msg = kvs_last_error();
            return kvs_api_fail(err, 400, strncmp(msg, "tools ", 6) ? messages_param(r) : "tools", "%s", msg);
        }
    } else {
        kvs_encode_options eo = {.add_special_tokens = true, .parse_special = false};
        st = kvs_tokenizer_encode(s->tok, r->prompt, strlen(r->prompt), eo, &p->ids, &p->n_ids);
        if (st != KVS_OK) return kvs_api_fail(err, 400, "prompt", "%s", kvs_last_error());
    }
    if (p->n_ids == 0)
        return kvs_api_fail(err, 400, r->kind == KVS_API_CHAT ? messages_param(r) : "prompt", "the prompt is empty");
    return true;
}

/* The grammar of its response_format or forced tool call (none: true, p->grammar NULL). */
static bool compile_grammar(kvs_server *s, kvs_http_prepared *p, const atomic_bool *cancel, kvs_api_error *err) {
    kvs_api_request *r = &p->req;
    if (r->constraint_schema) /* tool_choice required or a function: a call that fits its schema */
        p->grammar = kvs_server_grammar(s, r->constraint_schema, NULL, r->constraint_prefix, r->constraint_suffix,
                                        "tools", cancel, err);
    else if (r->format != KVS_FORMAT_TEXT) /* structured output: the compiled grammar, shared by its schema */
        p->grammar = kvs_server_grammar(s, NULL, r->format == KVS_FORMAT_JSON_SCHEMA ? r->format_schema : NULL, NULL,
                                        NULL, r->dialect == KVS_DIALECT_RESPONSES ? "text.format" : "response_format.json_schema",
                                        cancel, err);
    else
        return true;
    return p->grammar != NULL;
}

/* The model name, the grammar, then the prompt's length against the context. */
static bool validate(kvs_server *s, kvs_http_prepared *p, const atomic_bool *cancel, kvs_api_error *err) {
    kvs_api_request *r = &p->req;
    if (r->model && strcmp(r->model, s->model_name)) {
        kvs_api_fail(err, 404, "model", "The model '%.200s' does not exist", r->model);
        err->code = "model_not_found";
        return false;
    }
    /* tool_choice required / a named function: r->constraint_* */
    if (!kvs_api_tool_constrain(r, s->tool_format, err)) return false;
    if (cancel && !compile_grammar(s, p, cancel, err)) return false;
    if (!encode_prompt(s, p, err)) return false;
    /* the policy: a request without max_tokens gets the default, capped by the
       context; Anthropic's max_tokens is required and a ceiling: its clients ask
       for what the largest models take (Claude Code: 32000), so it is capped by
       the context, not refused */
    int max_len = s->limits.max_model_len, n = p->n_ids;
    int fallback = s->cfg.max_tokens_default > 0 ? s->cfg.max_tokens_default : r->kind == KVS_API_CHAT ? max_len - n : 16;
    int max_tokens = r->max_tokens ? r->max_tokens : fallback;
    if ((!r->max_tokens || r->dialect == KVS_DIALECT_ANTHROPIC) && max_tokens > max_len - n) max_tokens = max_len - n;
    /* the check: the engine's, run here to name the field */
    switch (kvs_length_check(max_len, n, max_tokens)) {
    case KVS_LENGTH_PROMPT:
        return kvs_api_fail(err, 400, r->kind == KVS_API_CHAT ? messages_param(r) : "prompt", "%s", kvs_last_error());
    case KVS_LENGTH_MAX_TOKENS:
        return kvs_api_fail(err, 400, r->max_tokens_param ? r->max_tokens_param : "max_tokens", "%s",
                            kvs_last_error());
    case KVS_LENGTH_OK: break;
    }
    if (r->min_tokens > max_tokens)
        return kvs_api_fail(err, 400, "min_tokens", "'min_tokens' (%d) must be at most the tokens generated (%d)",
                            r->min_tokens, max_tokens);
    p->max_tokens = max_tokens;
    return true;
}

/* The route's parser: each API's shapes onto the one chat / completions request. */
static bool parse(kvs_server *s, kvs_route route, const char *body, size_t len, kvs_api_request *r, kvs_api_error *err) {
    if (route == KVS_ROUTE_MESSAGES || route == KVS_ROUTE_COUNT_TOKENS)
        return kvs_anth_parse_request(body, len, route == KVS_ROUTE_COUNT_TOKENS, &s->limits, r, err);
    if (route == KVS_ROUTE_RESPONSES) return kvs_rsp_parse_request(body, len, &s->limits, r, err);
    return kvs_api_parse_request(body, len, route == KVS_ROUTE_COMPLETIONS ? KVS_API_COMPLETIONS : KVS_API_CHAT,
                                 &s->limits, r, err);
}

bool kvs_http_prepare(kvs_server *s, kvs_route route, const char *body, size_t len, const atomic_bool *cancel,
                      kvs_http_prepared *p, kvs_api_error *err) {
    memset(p, 0, sizeof *p);
    if (!kvs_http_slot_take(s, err)) return false;
    bool ok = parse(s, route, body, len, &p->req, err) && validate(s, p, cancel, err);
    kvs_http_slot_give(s);
    if (!ok) kvs_http_prepared_free(p);
    return ok;
}

void kvs_http_prepared_free(kvs_http_prepared *p) {
    kvs_api_request_free(&p->req);
    kvs_grammar_unref(p->grammar);
    free(p->ids);
    memset(p, 0, sizeof *p);
}

bool kvs_http_answer_whole(kvs_server *s, kvs_route r, const char *body, size_t len, const atomic_bool *cancel,
                           kvs_http_answer *a) {
    switch (r) {
    case KVS_ROUTE_TOKENIZE:
    case KVS_ROUTE_DETOKENIZE: kvs_http_tokenize(s, r == KVS_ROUTE_DETOKENIZE, body, len, a); return true;
    case KVS_ROUTE_COUNT_TOKENS: kvs_http_count_tokens(s, body, len, a); return true;
    case KVS_ROUTE_RESET_PREFIX_CACHE: kvs_http_reset_prefix_cache(s, a); return true;
    case KVS_ROUTE_CHAT_RENDER:
    case KVS_ROUTE_COMPLETIONS_RENDER: kvs_http_render(s, r, body, len, cancel, a); return true;
    default: return false;
    }
}

bool kvs_http_handle(kvs_server *s, const char *method, const char *url, const char *version,
                     const kvs_http_header *h, int n, const char *body, size_t len, size_t chunk, kvs_http_answer *a,
                     kvs_http_prepared *p) {
    memset(p, 0, sizeof *p);
    kvs_route r;
    kvs_http_head_fields f;
    if (!kvs_http_check_head(version, h, n, &f, a) || kvs_http_head(s, method, url, &f, &r, a)) return false;
    kvs_http_body b = {0};
    if (!chunk) chunk = len;
    for (size_t at = 0; at < len; at += chunk) {
        size_t k = len - at < chunk ? len - at : chunk;
        if (!kvs_http_body_add(s, &b, body + at, k, a)) {
            kvs_http_body_free(&b);
            return false;
        }
    }
    atomic_bool no_cancel = false;
    if (kvs_http_answer_whole(s, r, b.data, b.len, &no_cancel, a)) {
        kvs_http_body_free(&b);
        return false;
    }
    kvs_api_error err;
    bool ok = kvs_http_prepare(s, r, b.data, b.len, NULL, p, &err);
    kvs_http_body_free(&b);
    if (!ok) kvs_http_answer_error_as(a, &err, kvs_http_dialect(url));
    return ok;
}
