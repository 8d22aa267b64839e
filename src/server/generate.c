/* server: one generation request between the HTTP thread and the engine:
 * the shared kvs_gen (filled by the engine callback), and the streaming
 * (SSE) reader that turns its outputs into chunks. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "server/generate.h"
#include "server/http.h"

kvs_gen *kvs_gen_create(void) {
    kvs_gen *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->refs = 1;
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
    free(g->text);
    free(g->ids);
    free(g->lps);
    free(g->error);
    free(g);
}

static bool reserve_text(kvs_gen *g, size_t more) {
    if (g->text_len + more + 1 <= g->text_cap) return true;
    size_t cap = (g->text_len + more + 1) * 2;
    char *p = realloc(g->text, cap);
    if (!p) return false;
    g->text = p;
    g->text_cap = cap;
    return true;
}

static bool reserve_ids(kvs_gen *g, int more) {
    if (g->n_ids + more <= g->cap_ids) return true;
    int cap = (g->n_ids + more) * 2 + 16;
    int32_t *ids = realloc(g->ids, sizeof(int32_t) * cap);
    if (ids) g->ids = ids;
    float *lps = realloc(g->lps, sizeof(float) * cap);
    if (lps) g->lps = lps;
    if (!ids || !lps) return false;
    g->cap_ids = cap;
    return true;
}

void kvs_gen_on_output(void *user, const kvs_request_output *o) {
    kvs_gen *g = user;
    pthread_mutex_lock(&g->mu);
    if (o->text_len && reserve_text(g, o->text_len)) {
        memcpy(g->text + g->text_len, o->text, o->text_len);
        g->text_len += o->text_len;
        g->text[g->text_len] = 0;
    }
    if (o->n_tokens > 0 && reserve_ids(g, o->n_tokens)) {
        memcpy(g->ids + g->n_ids, o->token_ids, sizeof(int32_t) * o->n_tokens);
        for (int i = 0; i < o->n_tokens; i++) g->lps[g->n_ids + i] = o->logprobs ? o->logprobs[i] : 0.0f;
        g->n_ids += o->n_tokens;
    }
    g->prompt_tokens = o->prompt_tokens;
    g->completion_tokens = o->completion_tokens;
    bool last = o->finish != KVS_FINISH_NONE;
    if (last) {
        g->finish = o->finish;
        if (o->error && !g->error) g->error = strdup(o->error);
        g->done = true;
    }
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (last) kvs_gen_release(g); /* the engine's reference */
}

/* Waits up to ms for news; false on timeout. Called with g->mu held. */
bool kvs_gen_wait(kvs_gen *g, int ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return pthread_cond_timedwait(&g->cv, &g->mu, &ts) == 0;
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
    kvs_server_request_done(st->srv, g);
    kvs_gen_release(g);
    kvs_tool_parser_destroy(st->tools);
    free(st->out);
    free(st->req_id);
    free(st);
}

/* Turns what the engine delivered since the last call into SSE events. */
static void take_pending(kvs_stream *st) {
    kvs_gen *g = st->gen;
    /* g->mu is held */
    kvs_resp_slice s = {g->text, g->text_len, g->ids, st->meta.logprobs ? g->lps : NULL, g->n_ids, st->text_offset};
    kvs_finish fin = g->done ? g->finish : KVS_FINISH_NONE;
    bool failed = fin == KVS_FINISH_ERROR;
    if (!st->role_sent && st->meta.kind == KVS_API_CHAT) {
        kvs_resp_slice empty = {0};
        out_event(st, kvs_resp_chunk(&st->meta, &empty, true, KVS_FINISH_NONE, st->include_usage));
        st->role_sent = true;
    }
    kvs_tool_events ev = {0};
    if (st->tools) kvs_resp_tool_stream(st->tools, &s, &ev, fin != KVS_FINISH_NONE);
    if ((st->tools ? ev.n > 0 : s.text_len > 0) || s.n || (fin != KVS_FINISH_NONE && !failed))
        out_event(st, kvs_resp_chunk(&st->meta, &s, false, failed ? KVS_FINISH_NONE : fin, st->include_usage));
    kvs_tool_events_free(&ev);
    st->text_offset += g->text_len;
    g->text_len = 0;
    g->n_ids = 0;
    if (fin == KVS_FINISH_NONE) return;
    if (failed) {
        kvs_api_error err;
        kvs_api_fail(&err, 500, NULL, "generation failed: %s", g->error ? g->error : "unknown error");
        out_event(st, kvs_api_error_json(&err));
    }
    if (st->include_usage) out_event(st, kvs_resp_usage_chunk(&st->meta, g->prompt_tokens, g->completion_tokens));
    out_append(st, "data: [DONE]\n\n", 14);
    st->ended = true;
}

/* The client stopped reading: it has taken none of what waits for it for --http-timeout. */
static bool stalled(kvs_stream *st) {
    unsigned limit = st->srv->cfg.http_timeout_s;
    if (!kvs_peer_stalled(st->fd, &st->progress, limit)) return false;
    kvs_log(KVS_LOG_INFO, "closing a stream whose client read nothing for %u s (--http-timeout)", limit);
    return true;
}

ssize_t kvs_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    kvs_stream *st = cls;
    if (stalled(st)) return MHD_CONTENT_READER_END_WITH_ERROR; /* kvs_stream_free aborts */
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
        bool waited = false, probe = false;
        pthread_mutex_lock(&g->mu);
        while (!g->done && g->text_len == 0 && g->n_ids == 0 && st->role_sent && !probe) {
            waited = true;
            if (kvs_gen_wait(g, 500)) continue;
            kvs_peer ps = kvs_peer_state(st->fd);
            if (ps == KVS_PEER_GONE || stalled(st)) {
                pthread_mutex_unlock(&g->mu);
                return MHD_CONTENT_READER_END_WITH_ERROR; /* kvs_stream_free aborts */
            }
            if (ps == KVS_PEER_EOF && !st->probed) probe = st->probed = true;
        }
        take_pending(st);
        pthread_mutex_unlock(&g->mu);
        /* an SSE comment: clients ignore it, a closed socket answers it with a reset */
        if (probe) out_append(st, ": ping\n\n", 8);
        if (waited && st->conn) kvs_http_touch(st->conn, st->srv->cfg.http_timeout_s);
    }
}
