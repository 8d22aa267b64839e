/* server: POST /v1/completions and /v1/chat/completions once prepared
 * (route.c: validate, encode; on a worker, work.c): compile the grammar and
 * submit to the engine, then answer with one JSON object when the generation
 * is done, or an SSE stream. Nothing here waits: the connection sleeps until
 * the engine's callback wakes it. */
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/anthropic.h"
#include "server/http.h"
#include "server/responses.h"

/* Submits p; on success *gen holds two references (ours and the engine's). */
static bool submit_params(kvs_server *s, const kvs_request_params *pp, bool stream, kvs_gen **gen,
                          kvs_api_error *err) {
    const kvs_request_params p = *pp;
    kvs_gen *g = kvs_gen_create(p.n > 1 ? p.n : 1, p.top_logprobs);
    if (!g) return kvs_api_fail(err, 500, NULL, "out of memory");
    g->wake_each = stream; /* a whole answer waits for the end only */
    if (!kvs_server_request_link(s, g)) {
        kvs_gen_release(g);
        return kvs_api_fail(err, 503, NULL, "the server is shutting down");
    }
    g->refs = 2; /* ours and the engine's */
    g->kv_entry_bytes = kvs_engine_get_limits(s->engine).kv_entry_bytes;
    /* the callback may run before submit returns; it never reads engine_id */
    uint64_t id = 0;
    kvs_status st = kvs_engine_submit(s->engine, &p, kvs_gen_on_output, g, &id);
    if (st != KVS_OK) {
        g->refs = 1;
        kvs_server_request_unlink(s, g);
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
    g->t_submit = kvs_now();
    kvs_server_request_submitted(s, g, id); /* aborted at once when the drain timed out meanwhile */
    *gen = g;
    return true;
}

bool kvs_http_submit(kvs_server *s, kvs_http_req *req, kvs_api_error *err) {
    kvs_http_prepared *pr = &req->prep;
    kvs_api_request *r = &pr->req;
    kvs_request_params p = {
        .prompt_ids = pr->ids,
        .n_prompt = pr->n_ids,
        .sampling = r->sampling,
        .max_tokens = pr->max_tokens,
        .stop_strings = (const char *const *)r->stop,
        .n_stop_strings = r->n_stop,
        .ignore_eos = r->ignore_eos,
        .logprobs = r->logprobs,
        .top_logprobs = r->logprobs ? r->top_logprobs : 0,
        .n = r->n,
        .logit_bias = r->logit_bias,
        .n_logit_bias = r->n_logit_bias,
        .min_tokens = r->min_tokens,
        .stop_ids = r->stop_token_ids,
        .n_stop_ids = r->n_stop_token_ids,
        .policy = r->has_policy ? &r->policy : NULL,
        .cache_salt = r->cache_salt,
    };
    p.grammar = pr->grammar; /* compiled while it was prepared */
    kvs_gen *g = NULL;
    bool ok = !atomic_load(&req->cancel) || !kvs_api_fail(err, 503, NULL, "the request was cancelled");
    ok = ok && submit_params(s, &p, r->stream, &g, err);
    pthread_mutex_lock(&req->mu); /* the watcher reads it */
    req->gen = g;
    pthread_mutex_unlock(&req->mu);
    return ok;
}

void kvs_api_response_id(kvs_server *s, const kvs_api_request *r, char *id, size_t cap) {
    uint64_t n = atomic_fetch_add(&s->next_id, 1);
    const char *prefix = r->dialect == KVS_DIALECT_ANTHROPIC   ? "msg_"
                         : r->dialect == KVS_DIALECT_RESPONSES ? "resp_"
                         : r->kind == KVS_API_CHAT             ? "chatcmpl-"
                                                               : "cmpl-";
    snprintf(id, cap, "%s%llx%06llx", prefix, (unsigned long long)s->started, (unsigned long long)n);
}

static void make_meta(kvs_server *s, const kvs_api_request *r, char *id, size_t cap, kvs_resp_meta *m) {
    kvs_api_response_id(s, r, id, cap);
    *m = (kvs_resp_meta){r->kind, id, s->model_name, (long long)time(NULL), s->tok, r->logprobs, r->top_logprobs,
                         r->return_token_ids};
    m->dialect = r->dialect;
    if (r->tools && r->tool_choice != KVS_TOOL_CHOICE_NONE) { /* tools: the output is parsed for calls */
        m->tools = s->tool_format;
        m->one_call = !r->parallel_tool_calls;
    }
}

/* The request's KV policy: its own or the engine's default. */
static kvs_kv_policy request_policy(const kvs_server *s, const kvs_api_request *r) {
    if (r->has_policy) return r->policy;
    return s->engine ? kvs_engine_default_policy(s->engine) : kvs_kv_policy_default(KVS_POLICY_FULL);
}

static enum MHD_Result answer_whole(kvs_server *s, kvs_http_req *req) {
    kvs_gen *g = req->gen;
    const kvs_api_request *r = &req->prep.req;
    pthread_mutex_lock(&g->mu);
    if (!g->done) { /* the engine's last output wakes it */
        g->waker = &req->run_wait;
        kvs_waker_sleep(&req->run_wait);
        pthread_mutex_unlock(&g->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_lock(&req->mu); /* the watcher writes no probe from now on */
    req->stage = KVS_STAGE_ANSWER;
    pthread_mutex_unlock(&req->mu);
    enum MHD_Result ret;
    if (g->finish == KVS_FINISH_ERROR) {
        kvs_api_error err;
        kvs_api_fail(&err, 500, NULL, "generation failed: %s", g->error ? g->error : "unknown error");
        ret = kvs_http_error(s, req->conn, &err, r->dialect);
    } else {
        char id[64];
        kvs_resp_meta m;
        make_meta(s, r, id, sizeof id, &m);
        kvs_resp_slice sl[KVS_MAX_N];
        for (int i = 0; i < g->n_choices; i++) {
            const kvs_gen_choice *ch = &g->choices[i];
            sl[i] = (kvs_resp_slice){ch->text, ch->text_len, ch->ids, r->logprobs ? ch->lps : NULL, ch->n_ids, 0, i,
                                     ch->top_ids, ch->top_lps, g->n_top, ch->finish};
        }
        kvs_kv_policy pol = request_policy(s, r);
        kvs_resp_kv kv = kvs_gen_kv(g, &pol);
        kvs_http_answer a = {200, "application/json", NULL, NULL, false};
        if (r->dialect == KVS_DIALECT_OPENAI) {
            a.body = kvs_resp_full(&m, sl, g->n_choices, g->prompt_tokens, kvs_gen_completion_tokens(g), &kv);
        } else { /* one choice */
            const kvs_gen_choice *ch = &g->choices[0];
            kvs_resp_end e = {ch->finish, ch->stop_string > 0 && ch->stop_string <= r->n_stop ? r->stop[ch->stop_string - 1] : NULL,
                              false, g->prompt_tokens, g->cached_tokens, kvs_gen_completion_tokens(g), NULL};
            a.body = r->dialect == KVS_DIALECT_ANTHROPIC ? kvs_anth_full(&m, ch->text, ch->text_len, &e)
                                                         : kvs_rsp_full(&m, r->echo, m.created, ch->text, ch->text_len, &e);
        }
        kvs_gen_log(g, m.id, &pol);
        ret = kvs_http_send(s, req->conn, &a);
    }
    return ret;
}

/* Anthropic's or the responses API's stream: its writer's state (false: out of memory). */
static bool api_stream(kvs_stream *st, const kvs_api_request *r, int prompt_tokens) {
    for (int i = 0; i < r->n_stop; i++)
        if ((st->stop[i] = strdup(r->stop[i]))) st->n_stop = i + 1;
    if (r->dialect == KVS_DIALECT_OPENAI) return st->n_stop == r->n_stop;
    kvs_api_stream *w = st->api = calloc(1, sizeof *w);
    if (!w) return false;
    *w = (kvs_api_stream){.dialect = r->dialect, .meta = st->meta, .open = -1, .prompt_tokens = prompt_tokens,
                          .emit = kvs_stream_emit, .ctx = st, .created = st->meta.created};
    w->echo = r->echo ? json_deep_copy(r->echo) : NULL; /* the request is freed when its connection ends */
    return st->n_stop == r->n_stop && (!r->echo || w->echo);
}

static enum MHD_Result answer_stream(kvs_server *s, kvs_http_req *req) {
    kvs_gen *g = req->gen;
    const kvs_api_request *r = &req->prep.req;
    kvs_stream *st = calloc(1, sizeof *st);
    char *id = malloc(64);
    if (!st || !id) {
        free(st);
        free(id);
        kvs_server_abort(s, g);
        return MHD_NO; /* on_completed ends its count */
    }
    st->srv = s;
    st->gen = kvs_gen_ref(g);
    st->waker = &req->run_wait;
    st->req_id = id;
    make_meta(s, r, id, 64, &st->meta);
    st->include_usage = r->include_usage;
    st->policy = request_policy(s, r);
    req->counted = false; /* the stream's now: kvs_stream_free ends it */
    if ((st->meta.tools != KVS_TOOL_FORMAT_NONE && !(st->tools = kvs_resp_tool_parsers(&st->meta, g->n_choices))) ||
        !api_stream(st, r, req->prep.n_ids)) {
        kvs_stream_free(st);
        return MHD_NO;
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, kvs_stream_read, st,
                                                                  kvs_stream_free);
    if (!resp) {
        kvs_stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    if (r->dialect == KVS_DIALECT_ANTHROPIC) MHD_add_response_header(resp, "request-id", st->meta.id);
    enum MHD_Result ret = MHD_queue_response(req->conn, 200, resp);
    MHD_destroy_response(resp); /* kvs_stream_free runs when MHD is done with it */
    atomic_fetch_add(&s->http_requests, 1);
    return ret;
}

enum MHD_Result kvs_http_answer_gen(kvs_server *s, kvs_http_req *r) {
    return r->stream ? answer_stream(s, r) : answer_whole(s, r);
}
