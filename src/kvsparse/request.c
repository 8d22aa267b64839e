/* kvsparse (the embedding API): requests, delivered through a callback (push)
 * or queued on a stream (pull). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvsparse/kvsparse_internal.h"

void kvsparse_request_init(kvsparse_request *r) {
    memset(r, 0, sizeof *r);
    r->max_tokens = r->top_k = KVSPARSE_MODEL_DEFAULT;
    r->temperature = r->top_p = KVSPARSE_MODEL_DEFAULT;
}

/* The request's sampling and max tokens: what it sets over the engine's
 * defaults (a NaN counts as set: the engine refuses it). A default max tokens
 * is capped by the context left after the prompt's n tokens. */
static void sampling_of(const kvsparse_engine *e, const kvsparse_request *r, int n, kvs_sampling_params *sp,
                        int *max_tokens) {
    kvs_generation_config set = {
        .has_temperature = !(r->temperature < 0), .temperature = r->temperature,
        .has_top_p = !(r->top_p < 0), .top_p = r->top_p,
        .has_top_k = r->top_k >= 0, .top_k = r->top_k,
        .has_max_new_tokens = r->max_tokens >= 0, .max_new_tokens = r->max_tokens};
    *sp = e->sampling;
    *max_tokens = e->max_tokens;
    kvs_sampling_apply(&set, sp, max_tokens);
    int room = kvs_engine_get_limits(e->engine).max_model_len - n;
    if (!set.has_max_new_tokens && *max_tokens > room && room > 0) *max_tokens = room;
    sp->seed = r->seed;
    sp->has_seed = true;
}

/* The request's prompt ids: its text, or a chat (system, user) through the template. */
static kvs_status encode(const kvsparse_engine *e, const kvsparse_request *r, int32_t **ids, int *n) {
    if (!r->prompt) return kvs_fail(KVS_ERR_INVALID, "request: prompt is NULL");
    if (r->chat) {
        kvs_chat_message m[2] = {{"system", r->system}, {"user", r->prompt}};
        int first = r->system ? 0 : 1;
        return kvs_tokenizer_encode_chat(e->tok, e->tpl, m + first, 2 - first, ids, n);
    }
    kvs_encode_options eo = {.add_special_tokens = true, .parse_special = false}; /* user text: no control tokens */
    return kvs_tokenizer_encode(e->tok, r->prompt, strlen(r->prompt), eo, ids, n);
}

/* What a request delivers to: the caller's callback, or a stream. */
typedef struct {
    kvsparse_callback fn;
    void *user;
    double ratio; /* the prompt's compression, from the first token's delivery */
} pusher;

static kvsparse_output convert(const kvs_request_output *o, double ratio) {
    return (kvsparse_output){.request_id = o->request_id, .text = o->text, .text_len = o->text_len,
                             .token_ids = o->token_ids, .n_tokens = o->n_tokens, .finish = (kvsparse_finish)o->finish,
                             .error = o->error, .prompt_tokens = o->prompt_tokens,
                             .completion_tokens = o->completion_tokens, .compression_ratio = ratio};
}

static void on_push(void *user, const kvs_request_output *o) {
    pusher *p = user;
    if (o->prompt_compression > 0) p->ratio = o->prompt_compression;
    kvsparse_output out = convert(o, p->ratio);
    p->fn(p->user, &out);
    if (o->finish != KVS_FINISH_NONE) free(p);
}

static kvs_status submit(kvsparse_engine *e, const kvsparse_request *r, kvs_output_fn fn, void *user, uint64_t *id) {
    if (!e || !r) return kvs_fail(KVS_ERR_INVALID, "kvsparse_submit: engine or request is NULL");
    if (r->max_tokens == 0) return kvs_fail(KVS_ERR_INVALID, "request: max_tokens must be >= 1, got 0");
    int32_t *ids = NULL;
    int n = 0;
    KVS_TRY(encode(e, r, &ids, &n));
    kvs_sampling_params sp;
    int max_tokens;
    sampling_of(e, r, n, &sp, &max_tokens);
    kvs_request_params p = {.prompt_ids = ids, .n_prompt = n, .sampling = sp, .max_tokens = max_tokens,
                            .ignore_eos = r->ignore_eos != 0};
    kvs_status st = kvs_engine_submit(e->engine, &p, fn, user, id);
    free(ids);
    return st;
}

kvsparse_status kvsparse_submit(kvsparse_engine *e, const kvsparse_request *r, kvsparse_callback fn, void *user,
                                uint64_t *request_id) {
    if (!fn) return kvsparse_from(kvs_fail(KVS_ERR_INVALID, "kvsparse_submit: the callback is NULL"));
    pusher *p = calloc(1, sizeof *p);
    if (!p) return kvsparse_from(kvs_fail(KVS_ERR_NOMEM, "out of memory"));
    *p = (pusher){fn, user, 1};
    kvs_status st = submit(e, r, on_push, p, request_id);
    if (st != KVS_OK) free(p); /* never delivered to */
    return kvsparse_from(st);
}

void kvsparse_abort(kvsparse_engine *e, uint64_t request_id) {
    if (e) kvs_engine_abort(e->engine, request_id);
}

/* ---- streams ------------------------------------------------------------------ */
typedef struct {
    char *text;
    size_t text_len, text_cap;
    int32_t *ids;
    int n_ids, ids_cap;
} pieces;

struct kvsparse_stream {
    kvsparse_engine *engine;
    uint64_t id;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                /* the caller's and, until the last delivery, the engine's */
    pieces pending, read;    /* arrived and not yet read; handed out by the last kvsparse_stream_next */
    kvsparse_finish finish;  /* of the last delivery (NONE: more to come) */
    char *error;
    int prompt_tokens, completion_tokens;
    double ratio;
    bool finish_read, failed_alloc;
};

static bool pieces_add(pieces *p, const kvs_request_output *o) {
    if (p->text_len + o->text_len + 1 > p->text_cap) {
        size_t cap = (p->text_len + o->text_len + 1) * 2;
        char *t = realloc(p->text, cap);
        if (!t) return false;
        p->text = t, p->text_cap = cap;
    }
    if (p->n_ids + o->n_tokens > p->ids_cap) {
        int cap = (p->n_ids + o->n_tokens) * 2;
        int32_t *t = realloc(p->ids, sizeof(int32_t) * (size_t)cap);
        if (!t) return false;
        p->ids = t, p->ids_cap = cap;
    }
    if (o->text_len) memcpy(p->text + p->text_len, o->text, o->text_len);
    p->text_len += o->text_len;
    p->text[p->text_len] = 0;
    if (o->n_tokens) memcpy(p->ids + p->n_ids, o->token_ids, sizeof(int32_t) * (size_t)o->n_tokens);
    p->n_ids += o->n_tokens;
    return true;
}

static void stream_unref(kvsparse_stream *s) { /* with mu held; unlocks it */
    bool last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (!last) return;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s->pending.text), free(s->pending.ids), free(s->read.text), free(s->read.ids);
    free(s->error);
    free(s);
}

static void on_stream(void *user, const kvs_request_output *o) {
    kvsparse_stream *s = user;
    pthread_mutex_lock(&s->mu);
    if (!pieces_add(&s->pending, o)) s->failed_alloc = true;
    if (o->prompt_compression > 0) s->ratio = o->prompt_compression;
    s->prompt_tokens = o->prompt_tokens;
    s->completion_tokens = o->completion_tokens;
    pthread_cond_broadcast(&s->cv);
    if (o->finish == KVS_FINISH_NONE) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->finish = (kvsparse_finish)o->finish;
    if (o->error) s->error = strdup(o->error);
    stream_unref(s);
}

kvsparse_status kvsparse_submit_stream(kvsparse_engine *e, const kvsparse_request *r, kvsparse_stream **out) {
    if (!out) return kvsparse_from(kvs_fail(KVS_ERR_INVALID, "kvsparse_submit_stream: out is NULL"));
    *out = NULL;
    kvsparse_stream *s = calloc(1, sizeof *s);
    if (!s) return kvsparse_from(kvs_fail(KVS_ERR_NOMEM, "out of memory"));
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->engine = e;
    s->refs = 2;
    s->ratio = 1;
    pthread_mutex_lock(&s->mu); /* the id is set before the first delivery is read */
    kvs_status st = submit(e, r, on_stream, s, &s->id);
    if (st != KVS_OK) s->refs = 1; /* never delivered to */
    pthread_mutex_unlock(&s->mu);
    if (st != KVS_OK) {
        pthread_mutex_lock(&s->mu);
        stream_unref(s);
        return kvsparse_from(st);
    }
    *out = s;
    return KVSPARSE_OK;
}

uint64_t kvsparse_stream_id(const kvsparse_stream *s) { return s->id; }

kvsparse_status kvsparse_stream_next(kvsparse_stream *s, kvsparse_output *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&s->mu);
    while (!s->pending.text_len && !s->pending.n_ids && s->finish == KVSPARSE_FINISH_NONE)
        pthread_cond_wait(&s->cv, &s->mu);
    kvsparse_status st = KVSPARSE_OK;
    if (s->finish_read) {
        kvs_fail(KVS_ERR_INVALID, "kvsparse_stream_next: the request has ended");
        st = KVSPARSE_ERR_CLOSED;
    } else if (s->failed_alloc) {
        st = kvsparse_from(kvs_fail(KVS_ERR_NOMEM, "out of memory while queueing the request's tokens"));
    } else {
        pieces t = s->read; /* hand out what arrived; its buffers become the next ones to fill */
        s->read = s->pending;
        s->pending = t;
        s->pending.text_len = 0, s->pending.n_ids = 0;
        *out = (kvsparse_output){.request_id = s->id, .text = s->read.text ? s->read.text : "",
                                 .text_len = s->read.text_len, .token_ids = s->read.ids, .n_tokens = s->read.n_ids,
                                 .finish = s->finish, .error = s->error, .prompt_tokens = s->prompt_tokens,
                                 .completion_tokens = s->completion_tokens, .compression_ratio = s->ratio};
        s->finish_read = s->finish != KVSPARSE_FINISH_NONE;
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

void kvsparse_stream_close(kvsparse_stream *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    if (s->finish == KVSPARSE_FINISH_NONE) kvsparse_abort(s->engine, s->id); /* the engine is alive while it runs */
    stream_unref(s);
}
