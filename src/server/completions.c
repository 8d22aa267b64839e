/* server: POST /v1/completions and /v1/chat/completions: validate, encode,
 * submit to the engine, then answer with one JSON object or an SSE stream. */
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/generate.h"
#include "server/http.h"

static bool prompt_ids(kvs_server *s, kvs_api_request *r, int32_t **ids, int *n, kvs_api_error *err) {
    if (r->prompt_ids) {
        *ids = r->prompt_ids;
        *n = r->n_prompt_ids;
        r->prompt_ids = NULL;
        return true;
    }
    if (!s->tok) return kvs_api_fail(err, 400, "prompt", "this model has no tokenizer: send token ids");
    kvs_status st;
    if (r->kind == KVS_API_CHAT) {
        st = kvs_api_chat_encode(s->tok, s->tpl, r->messages, r->n_messages, ids, n);
        if (st != KVS_OK) return kvs_api_fail(err, 400, "messages", "%s", kvs_last_error());
    } else {
        kvs_encode_options eo = {.add_special_tokens = true, .parse_special = false};
        st = kvs_tokenizer_encode(s->tok, r->prompt, strlen(r->prompt), eo, ids, n);
        if (st != KVS_OK) return kvs_api_fail(err, 400, "prompt", "%s", kvs_last_error());
    }
    if (*n == 0) return kvs_api_fail(err, 400, r->kind == KVS_API_CHAT ? "messages" : "prompt", "the prompt is empty");
    return true;
}

/* Validates, encodes and submits; on success *gen holds two references (ours and the engine's). */
static bool submit(kvs_server *s, kvs_api_request *r, kvs_gen **gen, kvs_api_error *err) {
    if (r->model && strcmp(r->model, s->model_name)) {
        kvs_api_fail(err, 404, "model", "The model '%.200s' does not exist", r->model);
        err->code = "model_not_found";
        return false;
    }
    int32_t *ids = NULL;
    int n = 0;
    if (!prompt_ids(s, r, &ids, &n, err)) {
        free(ids);
        return false;
    }
    int max_len = s->limits.max_model_len;
    if (n >= max_len) {
        free(ids);
        return kvs_api_fail(err, 400, r->kind == KVS_API_CHAT ? "messages" : "prompt",
                            "this model's maximum context length is %d tokens; the prompt has %d", max_len, n);
    }
    int max_tokens = r->max_tokens ? r->max_tokens : r->kind == KVS_API_CHAT ? max_len - n : 16;
    if (max_tokens > max_len - n) {
        if (r->max_tokens) {
            free(ids);
            return kvs_api_fail(err, 400, r->kind == KVS_API_CHAT ? "max_completion_tokens" : "max_tokens",
                                "this model's maximum context length is %d tokens; the prompt has %d and %d were "
                                "asked for",
                                max_len, n, max_tokens);
        }
        max_tokens = max_len - n;
    }
    kvs_request_params p = {
        .prompt_ids = ids,
        .n_prompt = n,
        .sampling = r->sampling,
        .max_tokens = max_tokens,
        .stop_strings = (const char *const *)r->stop,
        .n_stop_strings = r->n_stop,
        .ignore_eos = r->ignore_eos,
        .logprobs = r->logprobs ? (r->top_logprobs > 0 ? r->top_logprobs : 1) : 0,
        .policy = r->has_policy ? &r->policy : NULL,
    };
    kvs_gen *g = kvs_gen_create();
    if (!g) {
        free(ids);
        return kvs_api_fail(err, 500, NULL, "out of memory");
    }
    g->refs = 2; /* ours and the engine's */
    /* the callback may run before submit returns; it never reads engine_id */
    kvs_status st = kvs_engine_submit(s->engine, &p, kvs_gen_on_output, g, &g->engine_id);
    free(ids);
    if (st != KVS_OK) {
        g->refs = 1;
        kvs_gen_release(g);
        if (kvs_engine_failed(s->engine, NULL)) { /* "the engine failed: ..." */
            kvs_api_fail(err, 503, NULL, "%s", kvs_last_error());
        } else if (st == KVS_ERR_BUSY) {
            kvs_api_fail(err, 429, NULL, "the server is busy (request queue full): retry later");
            err->type = "rate_limit_error";
        } else if (st == KVS_ERR_INVALID || st == KVS_ERR_UNSUPPORTED) {
            kvs_api_fail(err, 400, NULL, "%s", kvs_last_error());
        } else {
            kvs_api_fail(err, 500, NULL, "%s", kvs_last_error());
        }
        return false;
    }
    *gen = g;
    return true;
}

static void make_meta(kvs_server *s, const kvs_api_request *r, char *id, size_t cap, kvs_resp_meta *m) {
    uint64_t n = atomic_fetch_add(&s->next_id, 1);
    snprintf(id, cap, "%s-%llx%06llx", r->kind == KVS_API_CHAT ? "chatcmpl" : "cmpl", (unsigned long long)s->started,
             (unsigned long long)n);
    *m = (kvs_resp_meta){r->kind, id, s->model_name, (long long)time(NULL), s->tok, r->logprobs, r->top_logprobs};
}

static enum MHD_Result answer_whole(kvs_server *s, struct MHD_Connection *c, const kvs_api_request *r, kvs_gen *g) {
    int fd = kvs_http_conn_fd(c);
    pthread_mutex_lock(&g->mu);
    bool aborted = false;
    while (!g->done) {
        if (!kvs_gen_wait(g, 500) && !aborted && kvs_peer_closed(fd)) {
            kvs_engine_abort(s->engine, g->engine_id);
            aborted = true;
        }
    }
    pthread_mutex_unlock(&g->mu);
    enum MHD_Result ret;
    if (g->finish == KVS_FINISH_ERROR) {
        kvs_api_error err;
        kvs_api_fail(&err, 500, NULL, "generation failed: %s", g->error ? g->error : "unknown error");
        ret = kvs_http_error(s, c, &err);
    } else {
        char id[64];
        kvs_resp_meta m;
        make_meta(s, r, id, sizeof id, &m);
        kvs_resp_slice sl = {g->text, g->text_len, g->ids, r->logprobs ? g->lps : NULL, g->n_ids, 0};
        char *body = kvs_resp_full(&m, &sl, g->finish, g->prompt_tokens, g->completion_tokens);
        ret = kvs_http_respond(s, c, 200, "application/json", body);
    }
    kvs_gen_release(g);
    kvs_server_request_done(s);
    return ret;
}

static enum MHD_Result answer_stream(kvs_server *s, struct MHD_Connection *c, const kvs_api_request *r, kvs_gen *g) {
    kvs_stream *st = calloc(1, sizeof *st);
    char *id = malloc(64);
    if (!st || !id) {
        free(st);
        free(id);
        kvs_engine_abort(s->engine, g->engine_id);
        kvs_gen_release(g);
        kvs_server_request_done(s);
        return MHD_NO;
    }
    st->srv = s;
    st->gen = g;
    st->req_id = id;
    make_meta(s, r, id, 64, &st->meta);
    st->fd = kvs_http_conn_fd(c);
    st->include_usage = r->include_usage;
    st->role_sent = r->kind != KVS_API_CHAT;
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, kvs_stream_read, st,
                                                                  kvs_stream_free);
    if (!resp) {
        kvs_stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp); /* kvs_stream_free runs when MHD is done with it */
    atomic_fetch_add(&s->http_requests, 1);
    return ret;
}

enum MHD_Result kvs_http_generate(kvs_server *s, struct MHD_Connection *c, kvs_api_kind kind, const char *body,
                                  size_t len) {
    kvs_api_request r;
    kvs_api_error err;
    if (!kvs_api_parse_request(body, len, kind, &s->limits, &r, &err)) return kvs_http_error(s, c, &err);
    pthread_mutex_lock(&s->mu);
    s->in_flight++;
    pthread_mutex_unlock(&s->mu);
    kvs_gen *g = NULL;
    if (!submit(s, &r, &g, &err)) {
        kvs_api_request_free(&r);
        kvs_server_request_done(s);
        return kvs_http_error(s, c, &err);
    }
    enum MHD_Result ret = r.stream ? answer_stream(s, c, &r, g) : answer_whole(s, c, &r, g);
    kvs_api_request_free(&r);
    return ret;
}
