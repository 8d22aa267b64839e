/* engine: latency histograms and the stats snapshot. */
#include <math.h>
#include <string.h>

#include "engine/engine_internal.h"

const double kvs_hist_bounds[KVS_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                  0.5,   1.0,  2.5,   5.0,  7.5, 10.0};

void kvs_hist_add(kvs_histogram *h, double v) {
    int b = 0;
    while (b < KVS_HIST_BUCKETS && v > kvs_hist_bounds[b]) b++;
    h->counts[b]++;
    h->sum += v;
    h->n++;
}

void kvs_stats_refresh(kvs_engine *e) {
    kvs_engine_stats *s = &e->stats;
    const kvs_kv_cache *kv = kvs_runner_kv(e->runner);
    const kvs_kv_config *kc = kvs_kv_get_config(kv);
    e->n_queued = e->waiting.n;
    e->n_running = e->running.n;
    s->running = e->running.n;
    s->kv_blocks_total = kc->n_blocks;
    s->kv_blocks_used = kvs_kv_used_blocks(kv);
    s->kv_tokens_capacity = kc->n_blocks / kc->n_layers * kc->block_size;
    double sparse_blocks = 0;
    int64_t held = 0, full = 0;
    for (kvs_request *r = e->running.head; r; r = r->next) {
        if (r->seq < 0) continue;
        int64_t h, f;
        kvs_kv_seq_usage(kv, r->seq, &h, &f);
        sparse_blocks += kvs_kv_seq_sparse_blocks(kv, r->seq);
        held += h;
        full += f;
    }
    /* blocks in use are in full or in sparse layers; a full layer's (never
       compacted, shared with other requests and the cache) are the rest */
    s->kv_blocks_sparse_layers = llround(sparse_blocks);
    s->kv_blocks_full_layers = s->kv_blocks_used - s->kv_blocks_sparse_layers;
    s->compression_ratio = held > 0 ? (double)full / held : 1.0;
    const kvs_kv_policy *p = &e->cfg.default_policy;
    int full_layers = p->kind == KVS_POLICY_FULL ? kc->n_layers : p->full_layers; /* cached blocks: in those / the others */
    s->kv_blocks_cached_full_layers = s->kv_blocks_cached_sparse_layers = 0;
    for (int l = 0; l < kc->n_layers; l++)
        *(l < full_layers ? &s->kv_blocks_cached_full_layers : &s->kv_blocks_cached_sparse_layers) += kvs_kv_cached_blocks(kv, l);
    s->kv_blocks_evictable = kvs_kv_evictable_blocks(kv);
    s->prefix_cache_reusable_blocks = kvs_kv_reusable_count(kv);
    s->prefix_cache_evictions = kvs_kv_evictions(kv);
    const kvs_batch *b = &e->batch;
    s->step_tokens = b->n_tokens;
    s->step_decode_tokens = 0;
    for (int i = 0; i < b->n_seqs; i++) s->step_decode_tokens += b->query_start[i + 1] - b->query_start[i] == 1;
}

void kvs_engine_get_stats(kvs_engine *e, kvs_engine_stats *s) {
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    s->waiting = e->n_queued + e->incoming.n;
    pthread_mutex_unlock(&e->mu);
}
