/* server: one generation request between the HTTP thread and the engine:
 * the shared kvs_gen (filled by the engine callback, which wakes the
 * connection waiting for it), and the streaming (SSE) reader that turns its
 * outputs into chunks. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "server/anthropic.h"
#include "server/http.h"
#include "server/responses.h"

kvs_gen *kvs_gen_create(int n_choices, int n_top) {
    kvs_gen *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->choices = calloc(n_choices > 0 ? n_choices : 1, sizeof *g->choices);
    if (!g->choices) {
        free(g);
        return NULL;
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->refs = 1;
    g->n_choices = n_choices > 0 ? n_choices : 1;
    g->n_top = n_top;
    return g;
}

kvs_gen *kvs_gen_ref(kvs_gen *g) {
    pthread_mutex_lock(&g->mu);
    g->refs++;
    pthread_mutex_unlock(&g->mu);
    return g;
}

void kvs_gen_release(kvs_gen *g) {
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    int left = --g->refs;
    pthread_mutex_unlock(&g->mu);
    if (left > 0) return;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    for (int i = 0; i < g->n_choices; i++) {
        kvs_gen_choice *c = &g->choices[i];
        free(c->text), free(c->ids), free(c->lps), free(c->top_ids), free(c->top_lps);
    }
    free(g->choices);
    free(g->error);
    free(g->layer_entries), free(g->layer_kind);
    free(g);
}

kvs_resp_kv kvs_gen_kv(const kvs_gen *g, const kvs_kv_policy *policy) {
    return (kvs_resp_kv){kvs_kv_policy_name(policy->kind), g->compression > 0 ? g->compression : 1, g->cached_tokens,
                         policy->kind == KVS_POLICY_FULL ? 0 : policy->min_prompt, g->layer_entries, g->layer_kind,
                         g->layer_entries ? g->n_layers : 0, g->kv_entry_bytes};
}

void kvs_gen_log(const kvs_gen *g, const char *id, const kvs_kv_policy *policy) {
    double now = kvs_now(), ttft = g->t_first ? g->t_first - g->t_submit : 0;
    int gen = kvs_gen_completion_tokens(g);
    double rate = g->t_first && now > g->t_first && gen > g->n_choices ? (gen - g->n_choices) / (now - g->t_first) : 0;
    const char *finish = kvs_resp_finish_reason(g->finish);
    kvs_log(KVS_LOG_INFO, "request %s: prompt %d tokens (%d cached), generated %d%s, TTFT %.0f ms, %.1f tokens/s, "
            "kv %s x%.2f, finish %s", id, g->prompt_tokens, g->cached_tokens, gen, g->n_choices > 1 ? " (all choices)" : "",
            ttft * 1e3, rate, kvs_kv_policy_name(policy->kind), g->compression > 0 ? g->compression : 1,
            finish ? finish : (g->done ? "?" : "client gone"));
}

int kvs_gen_completion_tokens(const kvs_gen *g) {
    int n = 0;
    for (int i = 0; i < g->n_choices; i++) n += g->choices[i].completion_tokens;
    return n;
}

static bool reserve_text(kvs_gen_choice *c, size_t more) {
    if (c->text_len + more + 1 <= c->text_cap) return true;
    size_t cap = (c->text_len + more + 1) * 2;
    char *p = realloc(c->text, cap);
    if (!p) return false;
    c->text = p;
    c->text_cap = cap;
    return true;
}

static bool grow(void **p, size_t bytes) {
    void *q = realloc(*p, bytes ? bytes : 1);
    if (q) *p = q;
    return q != NULL;
}

static bool reserve_ids(kvs_gen_choice *c, int more, int n_top) {
    if (c->n_ids + more <= c->cap_ids) return true;
    int cap = (c->n_ids + more) * 2 + 16;
    bool ok = grow((void **)&c->ids, sizeof(int32_t) * cap) && grow((void **)&c->lps, sizeof(float) * cap) &&
              grow((void **)&c->top_ids, sizeof(int32_t) * cap * n_top) &&
              grow((void **)&c->top_lps, sizeof(float) * cap * n_top);
    if (ok) c->cap_ids = cap;
    return ok;
}

void kvs_gen_on_output(void *user, const kvs_request_output *o) {
    kvs_gen *g = user;
    pthread_mutex_lock(&g->mu);
    kvs_gen_choice *c = &g->choices[o->index >= 0 && o->index < g->n_choices ? o->index : 0];
    if (o->text_len && reserve_text(c, o->text_len)) {
        memcpy(c->text + c->text_len, o->text, o->text_len);
        c->text_len += o->text_len;
        c->text[c->text_len] = 0;
    }
    if (o->n_tokens > 0 && reserve_ids(c, o->n_tokens, g->n_top)) {
        memcpy(c->ids + c->n_ids, o->token_ids, sizeof(int32_t) * o->n_tokens);
        for (int i = 0; i < o->n_tokens; i++) {
            c->lps[c->n_ids + i] = o->logprobs ? o->logprobs[i] : 0.0f;
            for (int j = 0; j < g->n_top; j++) { /* -1: not computed (never expected) */
                bool have = o->top_ids && j < o->n_top;
                c->top_ids[(c->n_ids + i) * g->n_top + j] = have ? o->top_ids[i * o->n_top + j] : -1;
                c->top_lps[(c->n_ids + i) * g->n_top + j] = have ? o->top_logprobs[i * o->n_top + j] : 0.0f;
            }
        }
        c->n_ids += o->n_tokens;
    }
    g->prompt_tokens = o->prompt_tokens;
    c->completion_tokens = o->completion_tokens;
    if (o->n_tokens && !g->t_first) g->t_first = kvs_now();
    if (o->index == 0 && o->prompt_compression > 0) g->compression = o->prompt_compression, g->cached_tokens = o->cached_tokens;
    if (o->index == 0 && o->n_layers && !g->layer_entries) { /* out of memory: the response has no layers */
        g->layer_entries = malloc(sizeof(int32_t) * (size_t)o->n_layers);
        g->layer_kind = malloc((size_t)o->n_layers);
        if (g->layer_entries && g->layer_kind) {
            memcpy(g->layer_entries, o->layer_entries, sizeof(int32_t) * (size_t)o->n_layers);
            memcpy(g->layer_kind, o->layer_kind, (size_t)o->n_layers);
            g->n_layers = o->n_layers;
        } else {
            free(g->layer_entries), free(g->layer_kind);
            g->layer_entries = NULL, g->layer_kind = NULL;
        }
    }
    bool last = o->finish != KVS_FINISH_NONE && c->finish == KVS_FINISH_NONE;
    if (last) {
        c->finish = o->finish;
        c->stop_string = o->stop_string;
        if (o->finish == KVS_FINISH_ERROR || g->n_done == 0) g->finish = o->finish;
        if (o->error && !g->error) g->error = strdup(o->error);
        g->done = ++g->n_done == g->n_choices;
    }
    bool released = last && g->done;
    if (g->waker && (g->wake_each || g->done)) kvs_waker_wake(g->waker);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (released) kvs_gen_release(g); /* the engine's reference */
}

/* ---- streaming ----------------------------------------------------------- */
static bool out_append(kvs_stream *st, const char *a, size_t n) {
    if (st->out_len + n > st->out_cap) {
        size_t cap = (st->out_len + n) * 2 + 256;
        char *p = realloc(st->out, cap);
        if (!p) return false;
        st->out = p;
        st->out_cap = cap;
    }
    memcpy(st->out + st->out_len, a, n);
    st->out_len += n;
    return true;
}

static void out_event(kvs_stream *st, char *json) {
    if (!json) return;
    out_append(st, "data: ", 6);
    out_append(st, json, strlen(json));
    out_append(st, "\n\n", 2);
    free(json);
}

void kvs_stream_free(void *cls) {
    kvs_stream *st = cls;
    kvs_gen *g = st->gen;
    pthread_mutex_lock(&g->mu);
    bool done = g->done;
    pthread_mutex_unlock(&g->mu);
    if (!done) kvs_engine_abort(st->srv->engine, g->engine_id); /* the client went away */
    pthread_mutex_lock(&g->mu);
    kvs_gen_log(g, st->meta.id, &st->policy);
    pthread_mutex_unlock(&g->mu);
    kvs_resp_tool_parsers_free(st->tools, g->n_choices);
    if (st->api) {
        free(st->api->acc), free(st->api->call_id), free(st->api->call_name);
        json_decref(st->api->items);
        json_decref(st->api->echo);
        free(st->api);
    }
    for (int i = 0; i < st->n_stop; i++) free(st->stop[i]);
    kvs_server_request_done(st->srv, g);
    kvs_gen_release(g);
    free(st->out);
    free(st->req_id);
    free(st);
}

/* Whether any choice has something the reader has not sent. */
static bool pending(const kvs_gen *g) {
    for (int i = 0; i < g->n_choices; i++) {
        const kvs_gen_choice *c = &g->choices[i];
        if (c->text_len || c->n_ids || !c->role_sent || (c->finish != KVS_FINISH_NONE && !c->end_sent)) return true;
    }
    return false;
}

/* An event of Anthropic's or the responses API's stream (kvs_sse_emit). */
void kvs_stream_emit(void *ctx, const char *event, json_t *data) {
    kvs_stream *st = ctx;
    char *s = json_dumps(data, JSON_COMPACT);
    json_decref(data);
    if (!s) return;
    out_append(st, "event: ", 7);
    out_append(st, event, strlen(event));
    out_append(st, "\ndata: ", 7);
    out_append(st, s, strlen(s));
    out_append(st, "\n\n", 2);
    free(s);
}

/* take_pending in Anthropic's or the responses API's events: one choice, its
 * text (or its tool parser's content and calls) into blocks / output items. */
static void take_pending_api(kvs_stream *st) {
    kvs_gen *g = st->gen;
    kvs_gen_choice *c = &g->choices[0];
    bool end = c->finish != KVS_FINISH_NONE && !c->end_sent;
    c->role_sent = true;
    kvs_tool_events ev = {0};
    kvs_tool_event text = {-1, NULL, NULL, c->text, c->text_len};
    kvs_tool_events plain = {&text, c->text_len ? 1 : 0, 1};
    if (st->tools) {
        kvs_resp_slice s = {c->text, c->text_len};
        kvs_resp_tool_stream(st->tools[0], &s, &ev, end);
    }
    bool anth = st->api->dialect == KVS_DIALECT_ANTHROPIC;
    if (anth) kvs_anth_stream_events(st->api, st->tools ? &ev : &plain);
    else kvs_rsp_stream_events(st->api, st->tools ? &ev : &plain);
    kvs_tool_events_free(&ev);
    c->text_offset += c->text_len;
    c->text_len = 0;
    c->n_ids = 0;
    c->end_sent |= end;
    if (!g->done) return;
    kvs_resp_end e = {g->finish == KVS_FINISH_ERROR ? KVS_FINISH_ERROR : c->finish,
                      c->stop_string > 0 && c->stop_string <= st->n_stop ? st->stop[c->stop_string - 1] : NULL,
                      st->tools && kvs_tool_parser_n_calls(st->tools[0]) > 0, g->prompt_tokens, g->cached_tokens,
                      kvs_gen_completion_tokens(g), g->error};
    if (anth) kvs_anth_stream_end(st->api, &e);
    else kvs_rsp_stream_end(st->api, &e);
    st->ended = true;
}

/* Turns what the engine delivered since the last call into SSE events: per
 * choice, in index order. */
static void take_pending(kvs_stream *st) {
    kvs_gen *g = st->gen;
    /* g->mu is held */
    if (st->api) {
        take_pending_api(st);
        return;
    }
    bool chat = st->meta.kind == KVS_API_CHAT;
    for (int i = 0; i < g->n_choices; i++) {
        kvs_gen_choice *c = &g->choices[i];
        if (!c->role_sent) {
            if (chat) {
                kvs_resp_slice empty = {.index = i};
                out_event(st, kvs_resp_chunk(&st->meta, &empty, true, st->include_usage));
            }
            c->role_sent = true;
        }
        bool failed = c->finish == KVS_FINISH_ERROR, end = c->finish != KVS_FINISH_NONE && !c->end_sent;
        kvs_resp_slice s = {c->text, c->text_len, c->ids, st->meta.logprobs ? c->lps : NULL, c->n_ids, c->text_offset,
                            i, c->top_ids, c->top_lps, g->n_top, failed || !end ? KVS_FINISH_NONE : c->finish};
        kvs_tool_events ev = {0};
        if (st->tools) kvs_resp_tool_stream(st->tools[i], &s, &ev, end);
        /* tokens whose text a tool parser holds back make no chunk of their own (an empty delta;
           kvs_resp_chunk makes none either when their logprobs or ids are asked for) */
        bool per_token = s.n && (!st->tools || st->meta.logprobs || st->meta.token_ids);
        if ((st->tools ? ev.n > 0 : s.text_len > 0) || per_token || (end && !failed))
            out_event(st, kvs_resp_chunk(&st->meta, &s, false, st->include_usage));
        kvs_tool_events_free(&ev);
        c->text_offset += c->text_len;
        c->text_len = 0;
        c->n_ids = 0;
        c->end_sent |= end;
    }
    if (!g->done) return;
    if (g->finish == KVS_FINISH_ERROR) {
        kvs_api_error err;
        kvs_api_fail(&err, 500, NULL, "generation failed: %s", g->error ? g->error : "unknown error");
        out_event(st, kvs_api_error_json(&err));
    }
    if (st->include_usage) {
        kvs_resp_kv kv = kvs_gen_kv(g, &st->policy);
        out_event(st, kvs_resp_usage_chunk(&st->meta, g->prompt_tokens, kvs_gen_completion_tokens(g), &kv));
    }
    out_append(st, "data: [DONE]\n\n", 14);
    st->ended = true;
}

ssize_t kvs_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    kvs_stream *st = cls;
    for (;;) {
        if (st->out_off < st->out_len) {
            size_t n = st->out_len - st->out_off;
            if (n > max) n = max;
            memcpy(buf, st->out + st->out_off, n);
            st->out_off += n;
            return (ssize_t)n;
        }
        st->out_len = st->out_off = 0;
        if (st->ended) return MHD_CONTENT_READER_END_OF_STREAM;
        kvs_gen *g = st->gen;
        pthread_mutex_lock(&g->mu);
        if (g->cut) { /* the watcher saw the client leave or stop reading: kvs_stream_free aborts */
            pthread_mutex_unlock(&g->mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        bool ping = g->want_ping;
        if (!g->done && !pending(g) && !ping) {
            g->waker = st->waker; /* the engine's next output resumes it */
            if (st->waker) kvs_waker_sleep(st->waker);
            pthread_mutex_unlock(&g->mu);
            return 0;
        }
        g->want_ping = false;
        take_pending(st);
        pthread_mutex_unlock(&g->mu);
        /* an SSE comment: clients ignore it, a closed socket answers it with a reset */
        if (ping) out_append(st, ": ping\n\n", 8);
    }
}
