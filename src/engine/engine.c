/* engine: create / start / submit / abort / step / stop / destroy, the engine
 * thread and the locked queues. The stepping thread owns the waiting and
 * running lists; other threads touch only `incoming`, the live requests (aborts), the
 * flags and the stats, under `mu`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

kvs_engine_config kvs_engine_config_default(void) {
    return (kvs_engine_config){.max_num_seqs = 64, .max_num_batched_tokens = 2048, .max_model_len = 0,
                               .kv_memory_bytes = 0, .max_waiting = 1024,
                               .default_policy = kvs_kv_policy_default(KVS_POLICY_FULL),
                               .enable_prefix_caching = true};
}

static kvs_status resolve_config(const kvs_config *mc, kvs_engine_config *c) {
    if (c->max_num_seqs < 0 || c->max_num_seqs > 4096)
        return kvs_fail(KVS_ERR_INVALID, "max_num_seqs must be in [1, 4096] (got %d)", c->max_num_seqs);
    if (c->max_num_batched_tokens < 0)
        return kvs_fail(KVS_ERR_INVALID, "max_num_batched_tokens must be >= 1 (got %d)", c->max_num_batched_tokens);
    if (c->max_model_len < 0 || c->max_model_len > mc->max_position_embeddings)
        return kvs_fail(KVS_ERR_INVALID, "max_model_len must be in [1, %d] (the model's context; got %d)",
                        mc->max_position_embeddings, c->max_model_len);
    if (c->max_waiting < 0) return kvs_fail(KVS_ERR_INVALID, "max_waiting must be >= 1 (got %d)", c->max_waiting);
    if (!c->max_num_seqs) c->max_num_seqs = 64;
    if (!c->max_num_batched_tokens) c->max_num_batched_tokens = 2048;
    if (!c->max_model_len) c->max_model_len = mc->max_position_embeddings;
    if (!c->kv_memory_bytes) c->kv_memory_bytes = (size_t)1 << 30;
    if (!c->max_waiting) c->max_waiting = 1024;
    if (c->max_num_batched_tokens < c->max_num_seqs)
        return kvs_fail(KVS_ERR_INVALID, "max_num_batched_tokens (%d) must be >= max_num_seqs (%d)",
                        c->max_num_batched_tokens, c->max_num_seqs);
    return kvs_kv_policy_validate(&c->default_policy, mc->n_layers);
}

static kvs_status engine_create(kvs_runner *g, bool owns_runner, const kvs_tokenizer *tok,
                                const kvs_engine_config *cfg, kvs_engine **out) {
    kvs_engine_config c = cfg ? *cfg : kvs_engine_config_default();
    const kvs_config *mc = kvs_runner_config(g);
    kvs_step_limits lim = kvs_runner_limits(g); /* the step buffers the model was made for */
    if (!c.max_model_len && lim.max_len < mc->max_position_embeddings) c.max_model_len = lim.max_len;
    KVS_TRY(resolve_config(mc, &c));
    if (c.max_num_batched_tokens > lim.max_tokens || c.max_num_seqs > lim.max_seqs || c.max_model_len > lim.max_len)
        return kvs_fail(KVS_ERR_INVALID,
                        "engine: max_num_batched_tokens %d, max_num_seqs %d, max_model_len %d exceed the model's "
                        "limits (%d tokens, %d sequences per step, %d tokens of context)",
                        c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len, lim.max_tokens, lim.max_seqs,
                        lim.max_len);
    kvs_engine *e = calloc(1, sizeof *e);
    if (!e) return kvs_fail(KVS_ERR_NOMEM, "engine: out of memory");
    e->runner = g; /* owns_runner is set on success: on failure the caller keeps the runner */
    e->tok = tok;
    e->cfg = c;
    e->mcfg = *mc;
    e->vocab = mc->vocab_size;
    e->next_id = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->gvocab_mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->reset_cv, NULL);
    kvs_kv_config kc = {.n_layers = mc->n_layers, .n_kv_heads = mc->n_kv_heads, .head_dim = mc->head_dim,
                        .n_heads = mc->n_heads, .block_size = KVS_KV_BLOCK_SIZE, .max_seqs = c.max_num_seqs,
                        .max_window = c.default_policy.window, /* requests may use windows up to the default's */
                        .prefix_caching = c.enable_prefix_caching};
    kc.n_blocks = kvs_runner_kv_blocks_for_budget(g, &kc, c.kv_memory_bytes); /* one rank's pool */
    kvs_status st = KVS_OK;
    if (kc.n_blocks < mc->n_layers)
        st = kvs_fail(KVS_ERR_INVALID, "kv_memory_bytes (%zu) holds %lld blocks: less than one token in every layer",
                      c.kv_memory_bytes, (long long)kc.n_blocks);
    if (st == KVS_OK) st = kvs_runner_kv_create(g, &kc);
    if (st == KVS_OK && c.on_kv_events) st = kvs_kv_enable_events(kvs_runner_kv(g));
    int cap_tokens = c.max_num_batched_tokens, cap_seqs = c.max_num_seqs;
    e->rows.token_ids = malloc(sizeof(int32_t) * cap_tokens);
    e->rows.positions = malloc(sizeof(int32_t) * cap_tokens);
    e->rows.query_start = malloc(sizeof(int32_t) * (cap_seqs + 1));
    e->rows.seq_ids = malloc(sizeof(int32_t) * cap_seqs);
    e->rows.wants_logits = malloc(cap_seqs);
    e->rows.reqs = malloc(sizeof(kvs_request *) * cap_seqs);
    e->batch = (kvs_batch){.token_ids = e->rows.token_ids, .positions = e->rows.positions,
                           .query_start = e->rows.query_start, .seq_ids = e->rows.seq_ids,
                           .wants_logits = e->rows.wants_logits};
    e->sample_rows = malloc(sizeof(kvs_sample_row) * cap_seqs);
    e->sample_ids = malloc(sizeof(int32_t) * cap_seqs);
    e->sample_lp = malloc(sizeof(float) * cap_seqs);
    e->process_rows = malloc(sizeof(kvs_process_row) * cap_seqs);
    e->top_ids = malloc(sizeof(int32_t) * KVS_MAX_TOP_LOGPROBS * cap_seqs);
    e->top_lp = malloc(sizeof(float) * KVS_MAX_TOP_LOGPROBS * cap_seqs);
    if (st == KVS_OK && (!e->rows.token_ids || !e->rows.positions || !e->rows.query_start || !e->rows.seq_ids ||
                         !e->rows.wants_logits || !e->rows.reqs || !e->sample_rows || !e->sample_ids ||
                         !e->sample_lp || !e->process_rows || !e->top_ids || !e->top_lp))
        st = kvs_fail(KVS_ERR_NOMEM, "engine: out of memory");
    if (st != KVS_OK) {
        kvs_engine_destroy(e);
        return st;
    }
    kvs_stats_refresh(e);
    e->owns_runner = owns_runner;
    *out = e;
    return KVS_OK;
}

kvs_status kvs_engine_create_runner(kvs_runner *runner, const kvs_tokenizer *tok, const kvs_engine_config *cfg,
                                    kvs_engine **out) {
    *out = NULL;
    if (!runner) return kvs_fail(KVS_ERR_INVALID, "engine: no model");
    return engine_create(runner, false, tok, cfg, out);
}

kvs_status kvs_engine_create(kvs_model *model, const kvs_tokenizer *tok, const kvs_engine_config *cfg,
                             kvs_engine **out) {
    *out = NULL;
    if (!model) return kvs_fail(KVS_ERR_INVALID, "engine: no model");
    /* the model's executor holds what the configuration's steps need */
    kvs_engine_config c = cfg ? *cfg : kvs_engine_config_default();
    KVS_TRY(resolve_config(kvs_model_config(model), &c));
    kvs_step_limits limits = {c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len, KVS_KV_BLOCK_SIZE};
    kvs_runner *g;
    KVS_TRY(kvs_runner_wrap(model, &limits, &g));
    kvs_status st = engine_create(g, true, tok, cfg, out);
    if (st != KVS_OK) kvs_runner_destroy(g);
    return st;
}

static void free_list(kvs_req_list *l) {
    while (l->head) {
        kvs_request *r = l->head;
        kvs_list_remove(l, r);
        kvs_request_destroy(r);
    }
}

void kvs_engine_destroy(kvs_engine *e) {
    if (!e) return;
    if (e->thread_started) kvs_engine_stop(e, false);
    for (kvs_request *r = e->running.head; r; r = r->next) kvs_release_seq(e, r);
    free_list(&e->incoming);
    free_list(&e->waiting);
    free_list(&e->running);
    if (e->owns_runner) kvs_runner_destroy(e->runner); /* its rank caches go with it */
    free(e->rows.token_ids);
    free(e->rows.positions);
    free(e->rows.query_start);
    free(e->rows.seq_ids);
    free(e->rows.wants_logits);
    free(e->rows.reqs);
    free(e->sample_rows);
    free(e->sample_ids);
    free(e->sample_lp);
    free(e->process_rows);
    free(e->adjust);
    free(e->top_ids);
    free(e->top_lp);
    free(e->masks);
    free(e->mask_reqs);
    kvs_grammar_vocab_destroy(e->gvocab);
    pthread_mutex_destroy(&e->gvocab_mu);
    free(e->live);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->reset_cv);
    kvs_kv_event_log_free(&e->kv_events);
    free(e);
}

/* Room for one more live request (with mu held). */
static bool grow_live(kvs_engine *e) {
    if (e->n_live < e->cap_live) return true;
    int cap = e->cap_live ? 2 * e->cap_live : 64;
    struct kvs_live_request *l = realloc(e->live, sizeof *l * (size_t)cap);
    if (!l) return false;
    e->live = l, e->cap_live = cap;
    return true;
}

/* The live entry of request id, or NULL (with mu held). */
static struct kvs_live_request *find_live(kvs_engine *e, uint64_t id) {
    int lo = 0, hi = e->n_live;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (e->live[mid].id < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < e->n_live && e->live[lo].id == id ? &e->live[lo] : NULL;
}

static void destroy_all(kvs_request **rs, int n) {
    for (int i = 0; i < n; i++) kvs_request_destroy(rs[i]);
}

kvs_status kvs_engine_submit(kvs_engine *e, const kvs_request_params *p, kvs_output_fn fn, void *user,
                             uint64_t *request_id) {
    int n = p && p->n > 1 ? p->n : 1;
    kvs_request *rs[KVS_MAX_N];
    KVS_TRY(kvs_request_create(e, p, fn, user, &rs[0]));
    kvs_req_group *group = NULL;
    if (n > 1 && e->cfg.enable_prefix_caching && !(group = calloc(1, sizeof *group))) {
        destroy_all(rs, 1);
        return kvs_fail(KVS_ERR_NOMEM, "request: out of memory");
    }
    for (int i = 1; i < n; i++) {
        kvs_status st = kvs_request_create(e, p, fn, user, &rs[i]);
        if (st != KVS_OK) {
            destroy_all(rs, i);
            free(group);
            return st;
        }
        rs[i]->index = i;
        if (p->sampling.has_seed) rs[i]->sampling.seed = kvs_sample_mix64(p->sampling.seed + (uint64_t)i);
    }
    for (int i = 0; group && i < n; i++) rs[i]->group = group, group->refs++;
    pthread_mutex_lock(&e->mu);
    kvs_status st = KVS_OK;
    if (e->failed) st = kvs_fail(KVS_ERR_INTERNAL, "the engine failed: %s", e->failure);
    else if (e->stop_requested) st = kvs_fail(KVS_ERR_BUSY, "the engine is shutting down");
    else if (e->n_queued + e->incoming.n + n > e->cfg.max_waiting)
        st = kvs_fail(KVS_ERR_BUSY, "the engine's queue is full (max_waiting %d requests)", e->cfg.max_waiting);
    else if (!grow_live(e))
        st = kvs_fail(KVS_ERR_NOMEM, "request: out of memory");
    if (st == KVS_OK) {
        uint64_t id = e->next_id++;
        e->live[e->n_live++] = (struct kvs_live_request){id, n, false};
        double now = kvs_now();
        for (int i = 0; i < n; i++) {
            rs[i]->id = id;
            rs[i]->t_arrival = now;
            kvs_list_push_back(&e->incoming, rs[i]);
        }
        if (request_id) *request_id = id;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    if (st != KVS_OK) destroy_all(rs, n);
    return st;
}

/* Marks the request (every choice) for take_inputs; an id that is not live
 * (ended, or never given) is ignored. */
void kvs_engine_abort(kvs_engine *e, uint64_t request_id) {
    pthread_mutex_lock(&e->mu);
    struct kvs_live_request *l = find_live(e, request_id);
    if (l && !l->aborted) {
        l->aborted = true;
        e->n_abort_pending++;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

void kvs_request_retire(kvs_engine *e, kvs_req_list *l, kvs_request *r, kvs_finish f, const char *msg) {
    kvs_release_seq(e, r);
    kvs_list_remove(l, r);
    if (f != KVS_FINISH_NONE) kvs_request_finish(e, r, f, msg);
    uint64_t id = r->id;
    kvs_request_destroy(r);
    pthread_mutex_lock(&e->mu);
    struct kvs_live_request *lr = find_live(e, id);
    if (lr && --lr->choices == 0) { /* its last choice */
        int i = (int)(lr - e->live);
        memmove(lr, lr + 1, sizeof *lr * (size_t)(e->n_live - i - 1));
        e->n_live--;
        e->stats.requests_finished++;
    }
    pthread_mutex_unlock(&e->mu);
}

/* Retires every request of l that an abort named. */
static void retire_aborted(kvs_engine *e, kvs_req_list *l) {
    for (kvs_request *r = l->head, *next; r; r = next) {
        next = r->next;
        if (r->aborted) kvs_request_retire(e, l, r, KVS_FINISH_ABORT, NULL);
    }
}

/* Takes new requests and aborts from the other threads. */
static void take_inputs(kvs_engine *e) {
    pthread_mutex_lock(&e->mu);
    while (e->incoming.head) {
        kvs_request *r = e->incoming.head;
        kvs_list_remove(&e->incoming, r);
        kvs_list_push_back(&e->waiting, r);
    }
    bool aborts = e->n_abort_pending > 0;
    if (aborts) { /* every choice of an aborted id is in waiting or running now */
        kvs_req_list *lists[2] = {&e->running, &e->waiting};
        for (int k = 0; k < 2; k++)
            for (kvs_request *r = lists[k]->head; r; r = r->next) {
                const struct kvs_live_request *l = find_live(e, r->id);
                r->aborted = l && l->aborted;
            }
        e->n_abort_pending = 0;
    }
    bool all = e->abort_all, reset = e->reset_pending;
    e->abort_all = e->reset_pending = false;
    if (reset) { /* between two steps: no block of the cache is being written */
        kvs_kv_reset_prefix_cache(kvs_runner_kv(e->runner));
        e->resets_done++;
        pthread_cond_broadcast(&e->reset_cv);
    }
    kvs_stats_refresh(e);
    pthread_mutex_unlock(&e->mu);
    if (aborts) retire_aborted(e, &e->running), retire_aborted(e, &e->waiting);
    while (all && e->running.head) kvs_request_retire(e, &e->running, e->running.head, KVS_FINISH_ABORT, NULL);
    while (all && e->waiting.head) kvs_request_retire(e, &e->waiting, e->waiting.head, KVS_FINISH_ABORT, NULL);
}

bool kvs_engine_failed(kvs_engine *e, const char **reason) {
    pthread_mutex_lock(&e->mu);
    bool failed = e->failed;
    pthread_mutex_unlock(&e->mu);
    if (failed && reason) *reason = e->failure;
    return failed;
}

/* Ends every request with finish ERROR and msg (incoming ones too). */
static void fail_all(kvs_engine *e, const char *msg) {
    pthread_mutex_lock(&e->mu);
    while (e->incoming.head) {
        kvs_request *r = e->incoming.head;
        kvs_list_remove(&e->incoming, r);
        kvs_list_push_back(&e->waiting, r);
    }
    pthread_mutex_unlock(&e->mu);
    while (e->running.head) kvs_request_retire(e, &e->running, e->running.head, KVS_FINISH_ERROR, msg);
    while (e->waiting.head) kvs_request_retire(e, &e->waiting, e->waiting.head, KVS_FINISH_ERROR, msg);
}

/* An unrecoverable failure (the step's state is undefined): the engine is
 * failed for good and every request ends with the reason. */
static void engine_fail(kvs_engine *e, const char *reason) {
    pthread_mutex_lock(&e->mu);
    bool first = !e->failed;
    if (first) snprintf(e->failure, sizeof e->failure, "%s", reason);
    e->failed = true; /* submit refuses from here on */
    pthread_mutex_unlock(&e->mu);
    if (first) kvs_log(KVS_LOG_ERROR, "engine: failed: %s (every request ends with an error; the engine takes no more)", reason);
    char msg[sizeof e->failure + 32];
    snprintf(msg, sizeof msg, "the engine failed: %s", e->failure);
    fail_all(e, msg);
}

/* Room for n adjust entries in the step's list. */
static bool reserve_adjust(kvs_engine *e, int n) {
    if (n <= e->cap_adjust) return true;
    int cap = kvs_grown_capacity(e->cap_adjust, n, 256);
    kvs_logit_adjust *a = realloc(e->adjust, sizeof *a * cap);
    if (!a) return false;
    e->adjust = a, e->cap_adjust = cap;
    return true;
}

kvs_status kvs_engine_grammar_vocab(kvs_engine *e, const kvs_grammar_vocab **out) {
    *out = NULL;
    if (!e->tok) return kvs_fail(KVS_ERR_UNSUPPORTED, "structured output needs a tokenizer");
    int32_t ends[KVS_MAX_EOS];
    int n = 0;
    for (int i = 0; i < e->mcfg.n_eos && n < KVS_MAX_EOS; i++) ends[n++] = e->mcfg.eos_token_ids[i];
    pthread_mutex_lock(&e->gvocab_mu);
    kvs_status st = e->gvocab ? KVS_OK : kvs_grammar_vocab_from_tokenizer(e->tok, ends, n, &e->gvocab);
    *out = e->gvocab;
    pthread_mutex_unlock(&e->gvocab_mu);
    return st;
}

/* r's matcher, made at its first draw (the vocabulary too, at the first
 * grammar request); false, with *why, when that fails. */
static bool need_matcher(kvs_engine *e, kvs_request *r, const char **why) {
    if (r->matcher) return true;
    int cap_seqs = e->cfg.max_num_seqs;
    if (!e->masks) e->masks = malloc(sizeof(uint32_t) * kvs_sample_mask_words(e->vocab) * cap_seqs);
    if (!e->mask_reqs) e->mask_reqs = malloc(sizeof(kvs_request *) * cap_seqs);
    if (!e->masks || !e->mask_reqs) { /* either may have failed: the next grammar request tries again */
        *why = "out of memory for the grammar masks";
        return false;
    }
    const kvs_grammar_vocab *v;
    if (kvs_engine_grammar_vocab(e, &v) != KVS_OK) {
        *why = kvs_last_error();
        return false;
    }
    if (kvs_grammar_matcher_create(r->grammar, v, &r->matcher) != KVS_OK) {
        *why = kvs_last_error();
        return false;
    }
    return true;
}

/* Tokens of margin before a grammar request must close its output: a closing
 * token takes at least one byte off what is left to complete, but the token
 * before the switch may add some (an escape, a new key or element). */
#define CLOSING_SLACK 8

/* r's mask for its next draw: ids past the tokenizer's vocabulary (padded
 * logits) stay masked; near the end of its budget, only the tokens that finish
 * the output fastest. A mask past its grammar's bound (or out of memory)
 * fails the request alone, after the step. */
static void grammar_mask(kvs_request *r, uint32_t *mask, int words) {
    memset(mask, 0, sizeof(uint32_t) * words);
    int to_close = kvs_grammar_matcher_bytes_to_complete(r->matcher);
    kvs_status st = to_close >= 0 && r->max_tokens - r->n_gen <= to_close + CLOSING_SLACK
                        ? kvs_grammar_matcher_closing_mask(r->matcher, mask)
                        : kvs_grammar_matcher_mask(r->matcher, mask);
    if (st != KVS_OK) {
        snprintf(r->error, sizeof r->error, "%s", kvs_last_error());
        r->grammar_failed = true;
    }
}

/* The step's extras (kvs_sample_extras) from the rows' requests: NULL when no
 * row needs processing or alternatives. Grammar rows get their masks. */
static const kvs_sample_extras *step_extras(kvs_engine *e, kvs_sample_extras *x) {
    const kvs_batch *b = &e->batch;
    *x = (kvs_sample_extras){0};
    int need = 0;
    bool any = false;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvs_request *r = e->rows.reqs[s];
        if (!b->wants_logits[s]) continue;
        need += r->process ? r->n_adj : 0;
        any |= r->process;
        if (r->top_logprobs > x->top_k) x->top_k = r->top_logprobs;
    }
    if (any && reserve_adjust(e, need)) {
        int words = kvs_sample_mask_words(e->vocab);
        for (int s = 0, q = 0; s < b->n_seqs; s++) {
            if (!b->wants_logits[s]) continue;
            kvs_request *r = e->rows.reqs[s];
            kvs_process_row *row = &e->process_rows[q++];
            kvs_request_process_row(r, row, e->adjust, &x->n_adjust);
            const char *why;
            if (r->grammar && !need_matcher(e, r, &why)) { /* fails alone after the step */
                snprintf(r->error, sizeof r->error, "structured output: %s", why);
                r->grammar_failed = true;
            } else if (r->matcher) { /* its mask below, with the others' */
                e->mask_reqs[x->n_masks] = r;
                row->mask_row = x->n_masks++;
            }
        }
        /* the masks, a row per thread (a grammar's caches take a lock; a matcher is its row's) */
#pragma omp parallel for schedule(dynamic, 1) if (x->n_masks > 1)
        for (int m = 0; m < x->n_masks; m++) grammar_mask(e->mask_reqs[m], e->masks + (size_t)m * words, words);
        x->process = e->process_rows;
        x->adjust = e->adjust;
        x->masks = e->masks;
    } else if (any) {
        kvs_log(KVS_LOG_WARN, "engine: out of memory for the logit adjustments: this step samples without them");
    }
    x->top_ids = e->top_ids;
    x->top_logprobs = e->top_lp;
    return x->process || x->top_k > 0 ? x : NULL;
}

/* The KV events logged since the last call (a reset, admissions' evictions,
 * the forward's commits): published before the step's outputs go out, so a
 * client that has its answer can find its blocks announced. */
static void publish_kv_events(kvs_engine *e) {
    if (!e->cfg.on_kv_events) return;
    kvs_kv_take_events(kvs_runner_kv(e->runner), &e->kv_events);
    if (e->kv_events.n > 0 || e->kv_events.lost) e->cfg.on_kv_events(e->cfg.kv_events_user, &e->kv_events);
}

/* Runs the step's batch through the model and samples the requests that want
 * a token, on the backend: only their ids (and logprobs) come back. Draw
 * number n_gen of the request's seed: a preempted request recomputes the same
 * tokens. */
static kvs_status run_batch(kvs_engine *e) {
    const kvs_batch *b = &e->batch;
    bool want_lp = false;
    int n_rows = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvs_request *r = e->rows.reqs[s];
        if (!b->wants_logits[s]) continue;
        const kvs_sampling_params *p = &r->sampling;
        e->sample_rows[n_rows++] = (kvs_sample_row){.temperature = p->temperature, .top_k = p->top_k,
                                                    .top_p = p->top_p, .min_p = p->min_p, .seed = p->seed,
                                                    .step = (uint64_t)r->n_gen, .forced = r->n_gen < r->n_forced,
                                                    .forced_id = r->n_gen < r->n_forced ? r->forced[r->n_gen] : 0};
        want_lp |= r->logprobs > 0;
    }
    kvs_sample_extras extras;
    const kvs_sample_extras *x = step_extras(e, &extras);
    kvs_status st = kvs_runner_step_sample(e->runner, b, e->sample_rows, x, e->sample_ids,
                                           want_lp ? e->sample_lp : NULL);
    if (st != KVS_OK) {
        char msg[sizeof e->failure];
        snprintf(msg, sizeof msg, "model forward failed: %s", kvs_last_error());
        engine_fail(e, msg);
        return kvs_fail(st, "%s", msg);
    }
    publish_kv_events(e);
    for (int s = 0, k = 0; s < b->n_seqs; s++) {
        kvs_request *r = e->rows.reqs[s];
        r->n_computed += r->n_sched;
        r->n_sched = 0;
        if (r->group && r->index == 0 && r->n_computed >= r->n_prompt) r->group->prompt_ready = true;
        if (!b->wants_logits[s]) continue;
        float lp = r->logprobs > 0 ? e->sample_lp[k] : 0;
        const int32_t *top_ids = x ? e->top_ids + (size_t)k * x->top_k : NULL;
        const float *top_lp = x ? e->top_lp + (size_t)k * x->top_k : NULL;
        int32_t id = e->sample_ids[k++];
        if (r->grammar_failed || (id >= 0 && r->matcher && kvs_grammar_matcher_accept(r->matcher, id) != KVS_OK)) {
            char msg[sizeof r->error + 32];
            snprintf(msg, sizeof msg, "%s", r->grammar_failed ? r->error : "structured output: no token keeps the output valid");
            kvs_log(KVS_LOG_WARN, "engine: request %llu: %s", (unsigned long long)r->id, msg);
            kvs_request_retire(e, &e->running, r, KVS_FINISH_ERROR, msg);
            continue;
        }
        if (id < 0) { /* NaN or inf in its logits: this request alone fails */
            char msg[128];
            snprintf(msg, sizeof msg, "non-finite logits (NaN or infinity) at generated token %d", r->n_gen + 1);
            kvs_log(KVS_LOG_WARN, "engine: request %llu: %s", (unsigned long long)r->id, msg);
            kvs_request_retire(e, &e->running, r, KVS_FINISH_ERROR, msg);
            continue;
        }
        kvs_request_append(e, r, id, lp, top_ids, top_lp);
        /* a grammar's end (its EOS) ends the request, ignore_eos or not */
        if (r->finish == KVS_FINISH_NONE && r->matcher && kvs_grammar_matcher_ended(r->matcher))
            kvs_request_retire(e, &e->running, r, KVS_FINISH_STOP, NULL);
        else if (r->finish != KVS_FINISH_NONE) kvs_request_retire(e, &e->running, r, KVS_FINISH_NONE, NULL);
    }
    return KVS_OK;
}

static kvs_status step(kvs_engine *e) {
    take_inputs(e);
    if (e->failed) { /* only this thread sets it: no lock needed to read it here */
        engine_fail(e, e->failure); /* ends what is left: nothing normally, submit refuses */
        return kvs_fail(KVS_ERR_INTERNAL, "the engine failed: %s", e->failure);
    }
    double t0 = kvs_host_clock_start();
    kvs_status st = kvs_schedule(e);
    kvs_host_clock_stop(KVS_HOST_SCHEDULE, t0);
    if (st == KVS_OK && e->batch.n_seqs > 0) st = run_batch(e);
    publish_kv_events(e);
    pthread_mutex_lock(&e->mu);
    kvs_stats_refresh(e);
    pthread_mutex_unlock(&e->mu);
    return st;
}

kvs_status kvs_engine_step(kvs_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool threaded = e->thread_started;
    pthread_mutex_unlock(&e->mu);
    if (threaded) return kvs_fail(KVS_ERR_INVALID, "kvs_engine_step: the engine thread is running");
    return step(e);
}

kvs_status kvs_engine_reset_prefix_cache(kvs_engine *e) {
    pthread_mutex_lock(&e->mu);
    kvs_status st = KVS_OK;
    if (e->failed) st = kvs_fail(KVS_ERR_INTERNAL, "the engine failed: %s", e->failure);
    else if (e->stop_requested) st = kvs_fail(KVS_ERR_BUSY, "the engine is shutting down");
    bool threaded = e->thread_started;
    if (st == KVS_OK) {
        uint64_t done = e->resets_done;
        e->reset_pending = true;
        pthread_cond_signal(&e->cv);
        /* the engine thread does it at its next turn; stopping or failing ends the wait */
        while (threaded && e->resets_done == done && !e->failed && e->thread_started) pthread_cond_wait(&e->reset_cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    if (st == KVS_OK && !threaded) { /* the caller steps the engine: do it now */
        take_inputs(e);
        publish_kv_events(e);
    }
    return st;
}

kvs_engine_limits kvs_engine_get_limits(const kvs_engine *e) {
    return (kvs_engine_limits){.max_model_len = e->cfg.max_model_len, .vocab_size = e->vocab,
                               .n_layers = e->mcfg.n_layers, .max_window = kvs_kv_get_config(kvs_runner_kv(e->runner))->max_window,
                               .kv_entry_bytes = kvs_runner_kv_entry_bytes(e->runner)};
}

bool kvs_engine_idle(kvs_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool idle = !e->incoming.n && !e->n_queued && !e->n_running && !e->n_abort_pending && !e->abort_all &&
                !e->reset_pending;
    pthread_mutex_unlock(&e->mu);
    return idle;
}

static bool has_work(const kvs_engine *e) { /* with mu held */
    return e->incoming.n || e->n_queued || e->n_running || e->n_abort_pending || e->abort_all || e->reset_pending;
}

static void *engine_main(void *arg) {
    kvs_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (!has_work(e)) {
            if (e->stop_requested) break;
            pthread_cond_wait(&e->cv, &e->mu);
            continue;
        }
        pthread_mutex_unlock(&e->mu);
        if (step(e) != KVS_OK && !e->failed) kvs_log(KVS_LOG_WARN, "engine: step failed: %s", kvs_last_error());
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

kvs_status kvs_engine_start(kvs_engine *e) {
    pthread_mutex_lock(&e->mu);
    kvs_status st = KVS_OK;
    if (e->thread_started || e->stop_requested) st = kvs_fail(KVS_ERR_INVALID, "engine: already started or stopped");
    else if (pthread_create(&e->thread, NULL, engine_main, e) != 0)
        st = kvs_fail(KVS_ERR_INTERNAL, "engine: cannot start the engine thread");
    else e->thread_started = true;
    pthread_mutex_unlock(&e->mu);
    return st;
}

void kvs_engine_stop(kvs_engine *e, bool drain) {
    pthread_mutex_lock(&e->mu);
    bool threaded = e->thread_started;
    e->stop_requested = true;
    if (!drain) e->abort_all = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (threaded) {
        pthread_join(e->thread, NULL);
        pthread_mutex_lock(&e->mu);
        e->thread_started = false;
        pthread_cond_broadcast(&e->reset_cv);
        pthread_mutex_unlock(&e->mu);
    } else {
        while (!kvs_engine_idle(e))
            if (step(e) != KVS_OK && !e->failed) kvs_log(KVS_LOG_WARN, "engine: step failed: %s", kvs_last_error());
    }
}

kvs_kv_policy kvs_engine_default_policy(const kvs_engine *e) { return e->cfg.default_policy; }
