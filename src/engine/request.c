/* engine: one request's state, validation, stop conditions and streamed text. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"

const char *kvs_finish_name(kvs_finish f) {
    switch (f) {
    case KVS_FINISH_NONE: return "none";
    case KVS_FINISH_STOP: return "stop";
    case KVS_FINISH_LENGTH: return "length";
    case KVS_FINISH_ABORT: return "abort";
    case KVS_FINISH_ERROR: return "error";
    }
    return "?";
}

kvs_sampling_params kvs_sampling_default(void) {
    return (kvs_sampling_params){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .seed = 0, .has_seed = false,
                                 .repetition_penalty = 1};
}

kvs_status kvs_sampling_validate(const kvs_sampling_params *p) {
    if (!(p->temperature >= 0) || !isfinite(p->temperature))
        return kvs_fail(KVS_ERR_INVALID, "temperature must be a finite number >= 0 (got %g)", p->temperature);
    if (p->top_k < 0) return kvs_fail(KVS_ERR_INVALID, "top_k must be >= 0 (0 disables it; got %d)", p->top_k);
    if (!(p->top_p > 0 && p->top_p <= 1)) return kvs_fail(KVS_ERR_INVALID, "top_p must be in (0, 1] (got %g)", p->top_p);
    if (!(p->min_p >= 0 && p->min_p <= 1)) return kvs_fail(KVS_ERR_INVALID, "min_p must be in [0, 1] (got %g)", p->min_p);
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return kvs_fail(KVS_ERR_INVALID, "presence_penalty must be in [-2, 2] (got %g)", p->presence_penalty);
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return kvs_fail(KVS_ERR_INVALID, "frequency_penalty must be in [-2, 2] (got %g)", p->frequency_penalty);
    if (!(p->repetition_penalty > 0 && p->repetition_penalty <= 100))
        return kvs_fail(KVS_ERR_INVALID, "repetition_penalty must be in (0, 100] (1 disables it; got %g)",
                        p->repetition_penalty);
    return KVS_OK;
}

void kvs_sampling_apply(const kvs_generation_config *g, kvs_sampling_params *sp, int *max_tokens) {
    if (g->has_temperature) sp->temperature = g->temperature;
    if (g->has_top_p) sp->top_p = g->top_p;
    if (g->has_top_k) sp->top_k = g->top_k;
    if (g->has_min_p) sp->min_p = g->min_p;
    if (g->has_repetition_penalty) sp->repetition_penalty = g->repetition_penalty;
    if (g->has_max_new_tokens && max_tokens) *max_tokens = g->max_new_tokens;
}

/* Appends to buf at *n, clamped to its capacity. */
static void append(char *buf, size_t cap, size_t *n, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t cap, size_t *n, const char *fmt, ...) {
    if (*n + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *n, cap - *n, fmt, ap);
    va_end(ap);
    if (k > 0) *n = *n + (size_t)k < cap ? *n + (size_t)k : cap - 1;
}

void kvs_sampling_describe(const kvs_sampling_params *p, char *buf, size_t cap) {
    size_t n = 0;
    if (cap) buf[0] = 0;
    append(buf, cap, &n, "temperature %g%s", p->temperature, p->temperature == 0 ? " (greedy)" : "");
    if (p->temperature > 0 && p->top_p < 1) append(buf, cap, &n, ", top_p %g", p->top_p);
    if (p->temperature > 0 && p->top_k > 0) append(buf, cap, &n, ", top_k %d", p->top_k);
    if (p->temperature > 0 && p->min_p > 0) append(buf, cap, &n, ", min_p %g", p->min_p);
    if (p->repetition_penalty != 1) append(buf, cap, &n, ", repetition_penalty %g", p->repetition_penalty); /* greedy too */
}

kvs_length_limit kvs_length_check(int max_model_len, int n_prompt, int max_tokens) {
    if (n_prompt >= max_model_len) {
        kvs_fail(KVS_ERR_INVALID, "this model's maximum context length is %d tokens; the prompt has %d",
                 max_model_len, n_prompt);
        return KVS_LENGTH_PROMPT;
    }
    if ((int64_t)n_prompt + max_tokens > max_model_len) {
        kvs_fail(KVS_ERR_INVALID, "this model's maximum context length is %d tokens; the prompt has %d and %d were "
                 "asked for", max_model_len, n_prompt, max_tokens);
        return KVS_LENGTH_MAX_TOKENS;
    }
    return KVS_LENGTH_OK;
}

static kvs_status validate(const kvs_engine *e, const kvs_request_params *p) {
    if (!p->prompt_ids || p->n_prompt <= 0) return kvs_fail(KVS_ERR_INVALID, "prompt: the prompt is empty");
    if (p->max_tokens <= 0) return kvs_fail(KVS_ERR_INVALID, "max_tokens must be > 0 (got %d)", p->max_tokens);
    if (kvs_length_check(e->cfg.max_model_len, p->n_prompt, p->max_tokens) != KVS_LENGTH_OK) return KVS_ERR_INVALID;
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt_ids[i] < 0 || p->prompt_ids[i] >= e->vocab)
            return kvs_fail(KVS_ERR_INVALID, "prompt: token id %d at position %d is outside the vocabulary [0, %d)",
                            p->prompt_ids[i], i, e->vocab);
    if (p->n_stop_ids < 0 || (p->n_stop_ids > 0 && !p->stop_ids))
        return kvs_fail(KVS_ERR_INVALID, "stop_token_ids: bad list");
    if (p->n_stop_ids > 1024) return kvs_fail(KVS_ERR_INVALID, "stop_token_ids: at most 1024 ids");
    if (p->n_stop_strings < 0 || p->n_stop_strings > KVS_MAX_STOP_STRINGS)
        return kvs_fail(KVS_ERR_INVALID, "stop: at most %d stop strings (got %d)", KVS_MAX_STOP_STRINGS,
                        p->n_stop_strings);
    for (int i = 0; i < p->n_stop_strings; i++) {
        if (!p->stop_strings || !p->stop_strings[i] || !p->stop_strings[i][0])
            return kvs_fail(KVS_ERR_INVALID, "stop: stop string %d is empty", i);
        if (strlen(p->stop_strings[i]) > 1024) return kvs_fail(KVS_ERR_INVALID, "stop: stop string %d is too long", i);
    }
    if (p->n_stop_strings > 0 && !e->tok)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "stop: stop strings need a tokenizer");
    if (p->grammar && !e->tok) return kvs_fail(KVS_ERR_UNSUPPORTED, "response_format: structured output needs a tokenizer");
    if (p->logprobs < 0) return kvs_fail(KVS_ERR_INVALID, "logprobs must be >= 0");
    if (p->top_logprobs < 0 || p->top_logprobs > KVS_MAX_TOP_LOGPROBS)
        return kvs_fail(KVS_ERR_INVALID, "top_logprobs must be in [0, %d] (got %d)", KVS_MAX_TOP_LOGPROBS,
                        p->top_logprobs);
    if (p->n < 0 || p->n > KVS_MAX_N) return kvs_fail(KVS_ERR_INVALID, "n must be in [1, %d] (got %d)", KVS_MAX_N, p->n);
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return kvs_fail(KVS_ERR_INVALID, "min_tokens must be in [0, max_tokens %d] (got %d)", p->max_tokens,
                        p->min_tokens);
    if (p->n_logit_bias < 0 || p->n_logit_bias > KVS_MAX_LOGIT_BIAS || (p->n_logit_bias > 0 && !p->logit_bias))
        return kvs_fail(KVS_ERR_INVALID, "logit_bias: at most %d entries (got %d)", KVS_MAX_LOGIT_BIAS,
                        p->n_logit_bias);
    for (int i = 0; i < p->n_logit_bias; i++) {
        if (p->logit_bias[i].id < 0 || p->logit_bias[i].id >= e->vocab)
            return kvs_fail(KVS_ERR_INVALID, "logit_bias: token id %d is outside the vocabulary [0, %d)",
                            p->logit_bias[i].id, e->vocab);
        if (!(p->logit_bias[i].bias >= -100 && p->logit_bias[i].bias <= 100))
            return kvs_fail(KVS_ERR_INVALID, "logit_bias: the bias of token %d must be in [-100, 100] (got %g)",
                            p->logit_bias[i].id, p->logit_bias[i].bias);
    }
    if (p->cache_salt && strlen(p->cache_salt) > KVS_MAX_CACHE_SALT)
        return kvs_fail(KVS_ERR_INVALID, "cache_salt: at most %d bytes", KVS_MAX_CACHE_SALT);
    if (p->n_forced < 0 || p->n_forced > p->max_tokens || (p->n_forced > 0 && !p->forced_ids))
        return kvs_fail(KVS_ERR_INVALID, "forced tokens: %d ids for max_tokens %d", p->n_forced, p->max_tokens);
    for (int i = 0; i < p->n_forced; i++)
        if (p->forced_ids[i] < 0 || p->forced_ids[i] >= e->vocab)
            return kvs_fail(KVS_ERR_INVALID, "forced tokens: id %d at position %d is outside the vocabulary [0, %d)",
                            p->forced_ids[i], i, e->vocab);
    KVS_TRY(kvs_sampling_validate(&p->sampling));
    if (p->policy) {
        KVS_TRY(kvs_kv_policy_validate(p->policy, e->mcfg.n_layers));
        int max_w = kvs_kv_get_config(kvs_runner_kv(e->runner))->max_window;
        if (p->policy->kind != KVS_POLICY_FULL && p->policy->window > max_w)
            return kvs_fail(KVS_ERR_INVALID, "kv_window %d exceeds this server's maximum %d", p->policy->window, max_w);
    }
    return KVS_OK;
}

static int by_id(const void *a, const void *b) {
    int32_t x = ((const kvs_req_adjust *)a)->a.id, y = ((const kvs_req_adjust *)b)->a.id;
    return (x > y) - (x < y);
}

/* The tokens r adjusts before any is generated: the prompt's (repetition
 * penalty), logit_bias's, the stop ids (min_tokens); sorted, merged by id. */
static bool build_adjust(const kvs_engine *e, kvs_request *r, const kvs_request_params *p) {
    const kvs_sampling_params *sp = &p->sampling;
    bool rep = sp->repetition_penalty != 1;
    int n_stop = r->min_tokens > 0 ? r->n_stop_ids + (r->ignore_eos ? 0 : e->mcfg.n_eos) : 0;
    int n = (rep ? r->n_prompt : 0) + p->n_logit_bias + n_stop;
    r->counts = rep || sp->presence_penalty != 0 || sp->frequency_penalty != 0;
    r->process = r->counts || n > 0;
    if (n == 0) return true;
    if (!(r->adj = malloc(sizeof *r->adj * n))) return false;
    r->cap_adj = n;
    int k = 0;
    for (int i = 0; rep && i < r->n_prompt; i++) r->adj[k++] = (kvs_req_adjust){.a = {.id = r->prompt[i], .in_prompt = 1}};
    for (int i = 0; i < p->n_logit_bias; i++)
        r->adj[k++] = (kvs_req_adjust){.a = {.id = p->logit_bias[i].id, .bias = p->logit_bias[i].bias}};
    for (int i = 0; n_stop && i < r->n_stop_ids; i++) r->adj[k++] = (kvs_req_adjust){.a = {.id = r->stop_ids[i]}, .stop = true};
    for (int i = 0; n_stop && !r->ignore_eos && i < e->mcfg.n_eos; i++)
        r->adj[k++] = (kvs_req_adjust){.a = {.id = e->mcfg.eos_token_ids[i]}, .stop = true};
    qsort(r->adj, k, sizeof *r->adj, by_id);
    int m = 0;
    for (int i = 0; i < k; i++) {
        if (m > 0 && r->adj[m - 1].a.id == r->adj[i].a.id) {
            kvs_req_adjust *d = &r->adj[m - 1], *x = &r->adj[i];
            d->a.in_prompt |= x->a.in_prompt;
            d->a.bias += x->a.bias; /* one of them holds it */
            d->stop |= x->stop;
        } else {
            r->adj[m++] = r->adj[i];
        }
    }
    r->n_adj = m;
    return true;
}

/* Counts a generated token (presence, frequency, repetition penalties). */
static bool count_token(kvs_request *r, int32_t id) {
    int lo = 0, hi = r->n_adj;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (r->adj[mid].a.id < id) lo = mid + 1;
        else hi = mid;
    }
    if (lo < r->n_adj && r->adj[lo].a.id == id) {
        r->adj[lo].a.count++;
        return true;
    }
    if (r->n_adj == r->cap_adj) {
        int cap = r->cap_adj ? 2 * r->cap_adj : 16;
        kvs_req_adjust *a = realloc(r->adj, sizeof *a * cap);
        if (!a) return false;
        r->adj = a, r->cap_adj = cap;
    }
    memmove(r->adj + lo + 1, r->adj + lo, sizeof *r->adj * (r->n_adj - lo));
    r->adj[lo] = (kvs_req_adjust){.a = {.id = id, .count = 1}};
    r->n_adj++;
    return true;
}

void kvs_request_process_row(const kvs_request *r, kvs_process_row *row, kvs_logit_adjust *adjust, int *n_adjust) {
    *row = (kvs_process_row){.repetition = 1, .adjust_begin = *n_adjust, .mask_row = -1};
    if (!r->process) return;
    row->presence = r->sampling.presence_penalty;
    row->frequency = r->sampling.frequency_penalty;
    row->repetition = r->sampling.repetition_penalty;
    /* min_tokens bans the stop ids, except where a grammar is complete: then its end is all that may follow */
    bool ban = r->n_gen < r->min_tokens && !(r->matcher && kvs_grammar_matcher_complete(r->matcher));
    for (int i = 0; i < r->n_adj; i++) {
        adjust[*n_adjust + i] = r->adj[i].a;
        if (ban && r->adj[i].stop) adjust[*n_adjust + i].bias = -INFINITY;
    }
    row->adjust_count = r->n_adj;
    *n_adjust += r->n_adj;
}

kvs_status kvs_request_create(const kvs_engine *e, const kvs_request_params *p, kvs_output_fn fn, void *user,
                              kvs_request **out) {
    *out = NULL;
    if (!p) return kvs_fail(KVS_ERR_INVALID, "request: no parameters");
    KVS_TRY(validate(e, p));
    kvs_request *r = calloc(1, sizeof *r);
    if (!r) return kvs_fail(KVS_ERR_NOMEM, "request: out of memory");
    r->fn = fn;
    r->user = user;
    r->seq = -1;
    r->n_prompt = p->n_prompt;
    r->max_tokens = p->max_tokens;
    r->ignore_eos = p->ignore_eos;
    r->logprobs = p->logprobs;
    r->top_logprobs = p->logprobs > 0 ? p->top_logprobs : 0;
    r->min_tokens = p->min_tokens;
    r->policy = p->policy ? *p->policy : e->cfg.default_policy;
    r->prompt = malloc(sizeof(int32_t) * p->n_prompt);
    r->gen = malloc(sizeof(int32_t) * p->max_tokens);
    bool ok = r->prompt && r->gen;
    if (ok) memcpy(r->prompt, p->prompt_ids, sizeof(int32_t) * p->n_prompt);
    if (ok && p->cache_salt) ok = (r->cache_salt = strdup(p->cache_salt)) != NULL;
    if (ok && p->n_forced > 0) {
        ok = (r->forced = malloc(sizeof(int32_t) * p->n_forced)) != NULL;
        if (ok) memcpy(r->forced, p->forced_ids, sizeof(int32_t) * p->n_forced);
        r->n_forced = p->n_forced;
    }
    if (ok && p->n_stop_ids > 0) {
        r->stop_ids = malloc(sizeof(int32_t) * p->n_stop_ids);
        ok = r->stop_ids;
        if (ok) memcpy(r->stop_ids, p->stop_ids, sizeof(int32_t) * p->n_stop_ids);
        r->n_stop_ids = p->n_stop_ids;
    }
    for (int i = 0; ok && i < p->n_stop_strings; i++) {
        ok = (r->stop_strings[i] = strdup(p->stop_strings[i])) != NULL;
        r->n_stop_strings = i + 1;
    }
    if (ok && e->tok) ok = (r->detok = kvs_detokenizer_create(e->tok, true)) != NULL;
    if (ok) ok = build_adjust(e, r, p);
    if (p->grammar) r->grammar = kvs_grammar_ref(p->grammar), r->process = true;
    r->sampling = p->sampling;
    if (!r->sampling.has_seed) { /* a fresh stream per request: the clock and the request's address */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        r->sampling.seed = kvs_sample_mix64(((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^
                                            kvs_sample_mix64((uint64_t)(uintptr_t)r));
        r->sampling.has_seed = true;
    }
    if (!ok) {
        kvs_request_destroy(r);
        return kvs_fail(KVS_ERR_NOMEM, "request: out of memory");
    }
    *out = r;
    return KVS_OK;
}

void kvs_request_destroy(kvs_request *r) {
    if (!r) return;
    if (r->group) { /* the first choice gone (finished, aborted): the others go on without waiting */
        if (r->index == 0) r->group->prompt_ready = true;
        if (--r->group->refs == 0) free(r->group);
    }
    free(r->prompt);
    free(r->gen);
    free(r->layer_entries);
    free(r->layer_kind);
    free(r->forced);
    free(r->cache_salt);
    free(r->stop_ids);
    free(r->adj);
    kvs_grammar_matcher_destroy(r->matcher);
    kvs_grammar_unref(r->grammar);
    for (int i = 0; i < r->n_stop_strings; i++) free(r->stop_strings[i]);
    kvs_detokenizer_destroy(r->detok);
    free(r->pending);
    free(r);
}

static bool pending_add(kvs_request *r, const char *s, size_t n) {
    if (r->pending_len + n + 1 > r->pending_cap) {
        size_t cap = r->pending_cap ? r->pending_cap : 64;
        while (cap < r->pending_len + n + 1) cap *= 2;
        char *p = realloc(r->pending, cap);
        if (!p) return false;
        r->pending = p;
        r->pending_cap = cap;
    }
    memcpy(r->pending + r->pending_len, s, n);
    r->pending_len += n;
    r->pending[r->pending_len] = 0;
    return true;
}

static void set_error(kvs_request *r, const char *msg) {
    r->finish = KVS_FINISH_ERROR;
    snprintf(r->error, sizeof r->error, "%s", msg);
}

static bool is_stop_id(const kvs_engine *e, const kvs_request *r, int32_t id) {
    for (int i = 0; !r->ignore_eos && i < e->mcfg.n_eos; i++)
        if (e->mcfg.eos_token_ids[i] == id) return true;
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

static void deliver(kvs_request *r, const int32_t *ids, const float *lp, const int32_t *top_ids, const float *top_lp,
                    int n, size_t text_len, double compression) {
    if (!r->fn) return;
    kvs_request_output o = {.request_id = r->id, .index = r->index, .token_ids = ids, .logprobs = lp, .n_tokens = n,
                            .top_ids = top_ids, .top_logprobs = top_lp, .n_top = top_ids ? r->top_logprobs : 0,
                            .text = r->pending ? r->pending : "", .text_len = text_len, .finish = r->finish,
                            .error = r->finish == KVS_FINISH_ERROR ? r->error : NULL, .prompt_tokens = r->n_prompt,
                            .completion_tokens = r->n_gen, .prompt_compression = compression,
                            .cached_tokens = r->n_cached, .stop_string = r->stop_string};
    if (compression > 0 && r->n_layers) /* the first token: the prompt's KV per layer */
        o.layer_entries = r->layer_entries, o.layer_kind = r->layer_kind, o.n_layers = r->n_layers;
    r->fn(r->user, &o);
}

/* Sends text_len bytes of the pending text and drops them. */
static void deliver_and_consume(kvs_request *r, const int32_t *ids, const float *lp, const int32_t *top_ids,
                                const float *top_lp, int n, size_t text_len, double compression) {
    deliver(r, ids, lp, top_ids, top_lp, n, text_len, compression);
    if (r->pending) {
        memmove(r->pending, r->pending + text_len, r->pending_len - text_len);
        r->pending_len -= text_len;
        r->pending[r->pending_len] = 0;
    }
}

void kvs_request_append(kvs_engine *e, kvs_request *r, int32_t id, float logprob, const int32_t *top_ids,
                        const float *top_logprobs) {
    double now = kvs_now();
    pthread_mutex_lock(&e->mu);
    if (r->n_gen == 0) kvs_hist_add(&e->stats.ttft, now - r->t_arrival);
    else kvs_hist_add(&e->stats.itl, now - r->t_last_token);
    e->stats.generation_tokens_total++;
    pthread_mutex_unlock(&e->mu);
    r->t_last_token = now;
    r->gen[r->n_gen++] = id;
    if (r->counts && !count_token(r, id)) set_error(r, "out of memory");
    /* given tokens stop nothing, nor do tokens before min_tokens */
    bool quiet = r->n_gen <= r->n_forced || r->n_gen < r->min_tokens;
    bool stop_id = !quiet && is_stop_id(e, r, id);
    if (stop_id) r->finish = KVS_FINISH_STOP;
    else if (r->n_gen >= r->max_tokens || kvs_request_len(r) >= e->cfg.max_model_len) r->finish = KVS_FINISH_LENGTH;
    const char *piece;
    size_t len;
    if (r->detok && !stop_id && kvs_detokenizer_push(r->detok, id, &piece, &len) == KVS_OK && !pending_add(r, piece, len))
        set_error(r, "out of memory");
    if (r->detok && r->finish != KVS_FINISH_NONE && r->finish != KVS_FINISH_ERROR &&
        kvs_detokenizer_finish(r->detok, &piece, &len) == KVS_OK && !pending_add(r, piece, len))
        set_error(r, "out of memory");
    bool stopped = false;
    size_t send = quiet ? r->pending_len
                         : kvs_stop_sendable((const char *const *)r->stop_strings, r->n_stop_strings,
                                             r->pending ? r->pending : "", r->pending_len, r->finish != KVS_FINISH_NONE,
                                             &stopped);
    if (stopped) { /* which string: the first that begins where the sendable text ends (Anthropic's stop_sequence) */
        r->finish = KVS_FINISH_STOP;
        for (int i = 0; !r->stop_string && i < r->n_stop_strings; i++) {
            size_t n = strlen(r->stop_strings[i]);
            if (send + n <= r->pending_len && !memcmp(r->pending + send, r->stop_strings[i], n)) r->stop_string = i + 1;
        }
    }
    double compression = 0; /* the first token comes with the prompt's KV, as compacted by its policy */
    if (r->n_gen == 1 && r->seq >= 0) {
        const kvs_kv_cache *kv = kvs_runner_kv(e->runner);
        int64_t held, full;
        kvs_kv_seq_usage(kv, r->seq, &held, &full);
        compression = held ? (double)full / held : 1;
        int n_layers = e->mcfg.n_layers;
        if (!r->layer_entries) {
            r->layer_entries = malloc(sizeof(int32_t) * (size_t)n_layers);
            r->layer_kind = malloc((size_t)n_layers);
        }
        r->n_layers = r->layer_entries && r->layer_kind ? n_layers : 0; /* out of memory: none reported */
        for (int l = 0; l < r->n_layers; l++) { /* 1: compacted by its policy, 2: a sliding-window layer, 0: full */
            r->layer_entries[l] = kvs_kv_len(kv, r->seq, l);
            r->layer_kind[l] = kvs_kv_layer_sparse(kv, r->seq, l) ? 1 : kvs_kv_layer_sliding_window(kv, l) > 0 ? 2 : 0;
        }
    }
    deliver_and_consume(r, &r->gen[r->n_gen - 1], r->logprobs > 0 ? &logprob : NULL,
                        r->top_logprobs > 0 ? top_ids : NULL, top_logprobs, 1, send, compression);
}

void kvs_request_finish(kvs_engine *e, kvs_request *r, kvs_finish f, const char *error) {
    r->finish = f;
    snprintf(r->error, sizeof r->error, "%s", error ? error : "");
    deliver(r, NULL, NULL, NULL, NULL, 0, 0, 0);
}
