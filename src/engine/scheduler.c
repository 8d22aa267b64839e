/* engine: the scheduler. Each step: running decodes first (one token each),
 * then prefill chunks of running requests still in their prefill, then new
 * requests from the waiting queue (FCFS), within max_num_batched_tokens and
 * max_num_seqs. A request is admitted when the pool can hold its whole prompt
 * in every layer (its peak, before compaction) beyond what the running
 * requests need for their next token; its prompt's blocks are reserved at
 * admission. When a decode finds the pool dry, the newest running request is
 * preempted: its blocks are freed and it goes back to the front of the
 * waiting queue, to be recomputed later, its sampler and sent text kept.
 * A full-policy request recomputes prompt ++ generated tokens as one prefill.
 * A sparse one must rebuild the same compacted KV: its policy's prompt stays
 * the request's prompt (the budgets and the observation window are those of
 * the prompt), so it prefills the prompt alone (compacted at its end as the
 * first time), then re-feeds its generated tokens one a step like the decode
 * steps that first made them (the same window queries, and the decode
 * re-compressions at the same tokens), without logits until the last. */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

void kvs_list_push_back(kvs_req_list *l, kvs_request *r) {
    r->next = NULL;
    r->prev = l->tail;
    if (l->tail) l->tail->next = r;
    else l->head = r;
    l->tail = r;
    l->n++;
}

void kvs_list_push_front(kvs_req_list *l, kvs_request *r) {
    r->prev = NULL;
    r->next = l->head;
    if (l->head) l->head->prev = r;
    else l->tail = r;
    l->head = r;
    l->n++;
}

void kvs_list_remove(kvs_req_list *l, kvs_request *r) {
    if (r->prev) r->prev->next = r->next;
    else l->head = r->next;
    if (r->next) r->next->prev = r->prev;
    else l->tail = r->prev;
    r->prev = r->next = NULL;
    l->n--;
}

void kvs_release_seq(kvs_engine *e, kvs_request *r) {
    if (r->seq >= 0) kvs_kv_free(kvs_runner_kv(e->runner), r->seq);
    r->seq = -1;
    r->n_computed = 0;
    r->n_sched = 0;
}

void kvs_preempt(kvs_engine *e, kvs_request *r) {
    kvs_release_seq(e, r);
    kvs_list_remove(&e->running, r);
    kvs_list_push_front(&e->waiting, r);
    r->recompute = r->n_gen > 0;
    pthread_mutex_lock(&e->mu);
    e->stats.preemptions++;
    pthread_mutex_unlock(&e->mu);
}

/* Adds r's next n tokens (from n_computed) to the batch. */
static void batch_add(kvs_engine *e, kvs_request *r, int n) {
    kvs_batch *b = &e->batch;
    int s = b->n_seqs++;
    e->rows.reqs[s] = r;
    e->rows.seq_ids[s] = r->seq;
    e->rows.query_start[s] = b->n_tokens;
    for (int i = 0; i < n; i++) {
        e->rows.token_ids[b->n_tokens] = kvs_request_token(r, r->n_computed + i);
        e->rows.positions[b->n_tokens++] = r->n_computed + i;
    }
    e->rows.query_start[s + 1] = b->n_tokens;
    e->rows.wants_logits[s] = r->n_computed + n == kvs_request_len(r);
    r->n_sched = n;
}

/* A sparse request recomputing after preemption: prompt, then one token a step. */
static bool replays(const kvs_request *r) { return r->recompute && r->policy.kind != KVS_POLICY_FULL; }

/* The tokens r's prefill covers: the prompt, or what it has to recompute. */
static int prefill_len(const kvs_request *r) { return replays(r) ? r->n_prompt : kvs_request_len(r); }

/* r's next step feeds one token: a decode, or a replayed generated token. */
static bool is_decode(const kvs_request *r) {
    int len = kvs_request_len(r);
    return r->n_computed > 0 && r->n_gen > 0 && r->n_computed < len &&
           (len - r->n_computed == 1 || (replays(r) && r->n_computed >= r->n_prompt));
}

/* Reserves a decode token for r, preempting the newest running requests while
 * the pool is dry. Returns false when r itself was preempted or failed. */
static bool reserve_decode(kvs_engine *e, kvs_request *r) {
    while (kvs_kv_reserve(kvs_runner_kv(e->runner), r->seq, 1) != KVS_OK) {
        kvs_request *victim = e->running.tail;
        if (victim == r && e->running.n == 1) { /* alone and still no room: the pool is too small */
            kvs_request_retire(e, &e->running, r, KVS_FINISH_ERROR, "the KV cache is too small for this request");
            return false;
        }
        kvs_preempt(e, victim);
        if (victim == r) return false;
    }
    return true;
}

/* Blocks the running requests need beyond what they hold for what is scheduled plus one more token. */
static int64_t running_headroom(const kvs_engine *e) {
    int64_t need = 0;
    for (kvs_request *r = e->running.head; r; r = r->next)
        need += kvs_kv_blocks_needed(kvs_runner_kv(e->runner), r->seq, kvs_request_len(r) - r->n_computed + 1);
    return need;
}

/* The tokens of r's prefill that a cached prefix may cover: all but the
 * last (its logits are wanted); a sparse policy's observation window must be
 * computed too (its queries score the whole prompt). */
static int reusable_len(const kvs_request *r) {
    int n = prefill_len(r) - 1;
    if (r->policy.kind != KVS_POLICY_FULL && n > r->n_prompt - r->policy.window) n = r->n_prompt - r->policy.window;
    return n < r->n_prompt ? n : r->n_prompt;
}

/* Starts the waiting head r when the pool holds what it needs beyond the
 * running requests' headroom: a KV sequence, its policy (for its prompt), its
 * longest cached prefix reused, the rest of its prefill reserved (its peak,
 * before compaction). KVS_ERR_BUSY: not now. */
static kvs_status admit(kvs_engine *e, kvs_request *r, int64_t headroom) {
    kvs_kv_cache *kv = kvs_runner_kv(e->runner);
    int n = prefill_len(r), hit = 0;
    r->seq = kvs_kv_seq_create(kv);
    if (r->seq < 0) return KVS_ERR_NOMEM;
    kvs_status st = kvs_kv_set_policy(kv, r->seq, &r->policy, r->n_prompt);
    if (st == KVS_OK) hit = kvs_kv_prefix_attach(kv, r->seq, r->prompt, r->n_prompt, r->cache_salt, reusable_len(r));
    if (st == KVS_OK && kvs_kv_free_blocks(kv) - headroom < kvs_kv_blocks_needed(kv, r->seq, n - hit)) st = KVS_ERR_BUSY;
    if (st == KVS_OK) st = kvs_kv_reserve(kv, r->seq, n - hit);
    if (st != KVS_OK) {
        kvs_release_seq(e, r);
        return st;
    }
    r->n_computed = hit;
    r->n_cached = hit;
    kvs_list_remove(&e->waiting, r);
    kvs_list_push_back(&e->running, r);
    pthread_mutex_lock(&e->mu);
    if (!r->recompute) e->stats.prompt_tokens_total += r->n_prompt;
    e->stats.prefix_cache_queries += r->n_prompt;
    e->stats.prefix_cache_hits += hit;
    pthread_mutex_unlock(&e->mu);
    return KVS_OK;
}

kvs_status kvs_schedule(kvs_engine *e) {
    e->batch.n_tokens = e->batch.n_seqs = 0;
    e->rows.query_start[0] = 0;
    int budget = e->cfg.max_num_batched_tokens;
    const kvs_kv_config *kc = kvs_kv_get_config(kvs_runner_kv(e->runner));
    /* 1. decodes (and replayed tokens), oldest first */
    for (kvs_request *r = e->running.head; r; r = r->next) r->n_sched = 0;
    for (kvs_request *r = e->running.head; r && budget > 0;) {
        if (!is_decode(r)) {
            r = r->next;
            continue;
        }
        /* victims come from the tail: when r itself goes, nothing after it remains */
        if (!reserve_decode(e, r)) break;
        batch_add(e, r, 1);
        budget--;
        r = r->next;
    }
    /* 2. running requests in the middle of their prefill (their blocks are reserved) */
    for (kvs_request *r = e->running.head; r && budget > 0; r = r->next) {
        if (is_decode(r) || r->n_sched) continue;
        int n = prefill_len(r) - r->n_computed;
        if (n > budget) n = budget;
        if (kvs_kv_reserve(kvs_runner_kv(e->runner), r->seq, n) != KVS_OK) break; /* cannot happen: reserved at admission */
        batch_add(e, r, n);
        budget -= n;
    }
    /* 3. admit waiting requests, FCFS */
    while (e->waiting.head && budget > 0 && e->running.n < e->cfg.max_num_seqs) {
        kvs_request *r = e->waiting.head;
        if (r->group && r->index > 0 && !r->group->prompt_ready) break; /* n > 1: after the first choice's prefill */
        int n = prefill_len(r);
        int64_t peak = (int64_t)((n + kc->block_size - 1) / kc->block_size) * kc->n_layers;
        bool never = peak > kc->n_blocks;
        kvs_status st = never ? KVS_ERR_BUSY : admit(e, r, running_headroom(e));
        if (st == KVS_ERR_BUSY && (never || e->running.n == 0)) { /* the whole pool would not hold it */
            kvs_request_retire(e, &e->waiting, r, KVS_FINISH_ERROR, "the prompt does not fit in the KV cache");
            continue;
        }
        if (st != KVS_OK) break;
        n -= r->n_computed; /* a cached prefix's tokens are there already */
        int chunk = n < budget ? n : budget;
        batch_add(e, r, chunk);
        budget -= chunk;
    }
    return KVS_OK;
}
