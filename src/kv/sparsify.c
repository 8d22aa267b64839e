/* Sparsity orchestration: per-sequence policies, the observation window's
 * rows, scoring, selection, and the step's compactions in one batch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

void kvs_kv_free_sparsity(kvs_kv_cache *kv, seq_state *s) {
    free(s->budgets);
    free(s->ring_base);
    s->budgets = s->ring_base = NULL;
}

kvs_status kvs_kv_set_policy(kvs_kv_cache *kv, int seq_id, const kvs_kv_policy *p, int prompt_len) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    KVS_TRY(kvs_kv_policy_validate(p, kv->cfg.n_layers));
    if (p->kind != KVS_POLICY_FULL && p->window > kvs_kv_window_cap(kv))
        return kvs_fail(KVS_ERR_INVALID, "kv_window %d exceeds this server's maximum %d", p->window, kvs_kv_window_cap(kv));
    kvs_kv_free_sparsity(kv, s);
    s->policy = *p;
    s->prompt_len = prompt_len;
    s->prefill_done = false; /* kvs_kv_sparsify compacts once n_tokens reaches prompt_len */
    if (p->kind == KVS_POLICY_FULL) return KVS_OK;
    KVS_TRY(kvs_kv_alloc_windows(kv));
    int L = kv->cfg.n_layers;
    s->budgets = malloc(sizeof(int) * L);
    s->ring_base = malloc(sizeof(int) * L);
    if (!s->budgets || !s->ring_base) {
        kvs_kv_free_sparsity(kv, s);
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    }
    kvs_kv_policy_budgets(p, L, prompt_len, s->budgets);
    for (int l = 0; l < L; l++) {
        s->ring_base[l] = prompt_len;
        if (kvs_kv_layer_window(kv, l) > 0) s->budgets[l] = -1; /* bounded by its window: never compacted */
    }
    return KVS_OK;
}

/* The window row of `position` in s's layer (-1: none); s has sparsity in the layer. */
static int window_row(const kvs_kv_cache *kv, const seq_state *s, int layer, int position) {
    int w = s->policy.window, base = (int)(s - kv->seqs) * kv->window_cap;
    if (position < s->prompt_len) return position >= s->prompt_len - w ? base + position - (s->prompt_len - w) : -1;
    return base + (position - s->ring_base[layer]) % w;
}

/* Whether s's queries in layer fill window rows at all. */
static bool has_window(const seq_state *s, int layer) {
    return s && s->budgets && s->budgets[layer] >= 0 && s->policy.kind != KVS_POLICY_STREAMINGLLM;
}

int kvs_kv_window_row(const kvs_kv_cache *kv, int seq_id, int layer, int position) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    return has_window(s, layer) ? window_row(kv, s, layer, position) : -1;
}

void kvs_kv_window_rows(const kvs_kv_cache *kv, int seq_id, int layer, const int32_t *positions, int n, int32_t *rows) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!has_window(s, layer)) {
        for (int i = 0; i < n; i++) rows[i] = -1;
        return;
    }
    for (int i = 0; i < n; i++) rows[i] = window_row(kv, s, layer, positions[i]);
}

/* The captured window of (s, layer): its w rows of queries and of LSE. */
static void window_of(const kvs_kv_cache *kv, const seq_state *s, int layer, const void **q, const float **lse) {
    size_t row = (size_t)(s - kv->seqs) * kv->window_cap, nh = kv->cfg.n_heads;
    *q = (const char *)kv->win_q[layer] + row * nh * kv->cfg.head_dim * kvs_dtype_size(kv->be->act_dtype);
    *lse = kv->win_lse[layer] + row * nh;
}

/* The SnapKV scores of (seq, layer)'s entries [0, n - w) from its captured window,
 * into backend scratch (*d_scores [H][n - w]); *d_tab is the layer's table uploaded. */
static kvs_status score_window(kvs_kv_cache *kv, seq_state *s, int layer, float **d_scores, int32_t **d_tab) {
    kvs_backend *be = kv->be;
    int n = s->layers[layer].len, w = s->policy.window;
    size_t tab_bytes = sizeof(int32_t) * s->layers[layer].n_blocks;
    *d_tab = kvs_kv_scratch(kv, KVS_KV_SCRATCH_TABLE, tab_bytes);
    *d_scores = kvs_kv_scratch(kv, KVS_KV_SCRATCH_SCORES, sizeof(float) * (size_t)kv->cfg.n_kv_heads * (n - w));
    if (!*d_tab || !*d_scores) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of backend memory");
    const void *q;
    const float *lse;
    window_of(kv, s, layer, &q, &lse);
    be->to_device(be, *d_tab, s->layers[layer].blocks, tab_bytes);
    kvs_kv_pool pool = kvs_kv_layer_pool(kv, layer);
    be->sparsity_scores(be, *d_scores, q, lse, w, &pool, *d_tab, n - w, kv->cfg.n_heads,
                        1.0f / sqrtf((float)kv->cfg.head_dim));
    return KVS_OK;
}

kvs_status kvs_kv_window_scores(kvs_kv_cache *kv, int seq_id, int layer, float *out) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || layer < 0 || layer >= kv->cfg.n_layers) return kvs_fail(KVS_ERR_INVALID, "kv window scores: no such sequence or layer");
    int n = s->layers[layer].len, w = s->policy.window;
    if (!s->budgets || s->budgets[layer] < 0 || s->policy.kind == KVS_POLICY_STREAMINGLLM || n != s->n_tokens ||
        s->n_tokens != s->prompt_len || n < w)
        return kvs_fail(KVS_ERR_INVALID, "kv window scores: layer %d holds no captured window over its whole prompt", layer);
    if (n == w) return KVS_OK; /* no entry before the window */
    float *d_scores;
    int32_t *d_tab;
    KVS_TRY(score_window(kv, s, layer, &d_scores, &d_tab));
    kv->be->to_host(kv->be, out, d_scores, sizeof(float) * (size_t)kv->cfg.n_kv_heads * (n - w));
    return kv->be->check(kv->be);
}

/* StreamingLLM: the first `sinks` entries and the most recent ones. */
static void select_streaming(const seq_state *s, int layer, int budget, int H, int32_t *keep) {
    int n = s->layers[layer].len, sinks = s->policy.sinks < budget ? s->policy.sinks : budget;
    for (int h = 0; h < H; h++) {
        int32_t *k = keep + (size_t)h * budget;
        for (int i = 0; i < sinks; i++) k[i] = i;
        for (int i = sinks; i < budget; i++) k[i] = n - budget + i;
    }
}

/* StreamingLLM's compaction of a pair (keep lists from the host: no scores). */
static kvs_status compact_streaming(kvs_kv_cache *kv, seq_state *s, int layer) {
    int budget = s->budgets[layer], H = kv->cfg.n_kv_heads;
    int32_t *keep = malloc(sizeof(int32_t) * (size_t)H * budget);
    if (!keep) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of memory");
    select_streaming(s, layer, budget, H, keep);
    kvs_status st = kvs_kv_compact(kv, (int)(s - kv->seqs), layer, keep, budget);
    free(keep);
    return st;
}

/* ---- the batch: every SnapKV pair due in a step --------------------------------- */

/* Adds (s, layer) to the batch; a shared or cached table (the prefix cache holds the
 * prompt) gets its compacted copy's blocks now, from s's spare blocks first. */
static kvs_status batch_add(kvs_kv_cache *kv, seq_state *s, int layer) {
    if (kv->n_batch == kv->batch_cap) {
        int cap = kv->batch_cap ? 2 * kv->batch_cap : 64;
        void *p = realloc(kv->batch, sizeof *kv->batch * (size_t)cap);
        if (!p) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of host memory for %d compactions", cap);
        kv->batch = p;
        kv->batch_cap = cap;
    }
    int nb = kvs_kv_table_shared(kv, &s->layers[layer]) ? kvs_kv_blocks_for(kv, s->budgets[layer]) : 0;
    if (kv->n_batch_own + nb > kv->batch_own_cap) {
        int cap = 2 * (kv->n_batch_own + nb);
        void *p = realloc(kv->batch_own, sizeof(int32_t) * (size_t)cap);
        if (!p) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of host memory for the compacted copies' blocks");
        kv->batch_own = p;
        kv->batch_own_cap = cap;
    }
    if (nb) KVS_TRY(kvs_kv_take_own_blocks(kv, s, nb, kv->batch_own + kv->n_batch_own));
    kv->batch[kv->n_batch].seq = (int32_t)(s - kv->seqs);
    kv->batch[kv->n_batch].layer = layer;
    kv->batch[kv->n_batch].own = kv->n_batch_own;
    kv->batch[kv->n_batch++].n_own = nb;
    kv->n_batch_own += nb;
    return KVS_OK;
}

/* Forgets the batch (a pair failed before it ran): its copies' blocks go back. */
static void batch_drop(kvs_kv_cache *kv) {
    while (kv->n_batch_own > 0) kvs_block_drop(&kv->blocks, kv->batch_own[--kv->n_batch_own]);
    kv->n_batch = 0;
}

/* The collected pairs in one snapkv_compact_batch: their job list and tables
 * (and their copies' tables) in one upload from the pinned staging, then their
 * lengths and blocks. */
static kvs_status run_batch(kvs_kv_cache *kv) {
    int n = kv->n_batch, H = kv->cfg.n_kv_heads, max_keys = 0;
    if (!n) return KVS_OK;
    size_t n_tab = 0;
    int64_t n_scores = 0, n_keep = 0;
    for (int i = 0; i < n; i++) {
        const seq_state *s = &kv->seqs[kv->batch[i].seq];
        const layer_table *t = &s->layers[kv->batch[i].layer];
        int n_keys = t->len - s->policy.window;
        n_tab += t->n_blocks + kv->batch[i].n_own;
        n_scores += (int64_t)H * n_keys;
        n_keep += (int64_t)H * s->budgets[kv->batch[i].layer];
        if (n_keys > max_keys) max_keys = n_keys;
    }
    kvs_backend *be = kv->be;
    size_t job_bytes = sizeof(kvs_snapkv_job) * n, bytes = job_bytes + sizeof(int32_t) * n_tab;
    char *host = kvs_kv_staging(kv, bytes), *d_lists = kvs_kv_scratch(kv, KVS_KV_SCRATCH_BATCH, bytes);
    float *d_scores = kvs_kv_scratch(kv, KVS_KV_SCRATCH_SCORES, sizeof(float) * (size_t)n_scores);
    int32_t *d_keep = kvs_kv_scratch(kv, KVS_KV_SCRATCH_KEEP, sizeof(int32_t) * (size_t)n_keep);
    if (!host || !d_lists || !d_scores || !d_keep) {
        batch_drop(kv);
        return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of memory for a batch of %d compactions (%zu bytes of "
                        "tables, %lld scores)", n, bytes, (long long)n_scores);
    }
    kvs_snapkv_job *jobs = (kvs_snapkv_job *)host;
    int32_t *tables = (int32_t *)(host + job_bytes);
    size_t tab = 0;
    int64_t sc = 0, kp = 0;
    for (int i = 0; i < n; i++) {
        const seq_state *s = &kv->seqs[kv->batch[i].seq];
        int l = kv->batch[i].layer, w = s->policy.window, budget = s->budgets[l];
        const layer_table *t = &s->layers[l];
        kvs_snapkv_job *j = &jobs[i];
        window_of(kv, s, l, &j->win_q, &j->win_lse);
        j->scales = kvs_kv_layer_pool(kv, l).scales;
        j->scores = sc, j->keep = kp, j->table = (int32_t)tab, j->n_blocks = t->n_blocks;
        j->n_keys = t->len - w, j->n_win = w, j->k = budget - w, j->pool = s->policy.pool;
        memcpy(tables + tab, t->blocks, sizeof(int32_t) * t->n_blocks);
        tab += t->n_blocks;
        j->dst_table = (int32_t)tab, j->dst_blocks = kv->batch[i].n_own; /* 0: in place */
        if (j->dst_blocks) memcpy(tables + tab, kv->batch_own + kv->batch[i].own, sizeof(int32_t) * j->dst_blocks);
        tab += j->dst_blocks;
        sc += (int64_t)H * j->n_keys;
        kp += (int64_t)H * budget;
    }
    be->to_device(be, d_lists, host, bytes);
    kvs_kv_staging_sent(kv);
    kvs_snapkv_batch b = {.n_jobs = n, .n_heads = kv->cfg.n_heads, .scale = 1.0f / sqrtf((float)kv->cfg.head_dim),
                          .jobs = (const kvs_snapkv_job *)d_lists, .tables = (const int32_t *)(d_lists + job_bytes),
                          .scores = d_scores, .keep = d_keep, .max_keys = max_keys, .scores_len = n_scores};
    be->snapkv_compact_batch(be, &kv->pool, &b);
    for (int i = 0; i < n; i++) {
        seq_state *s = &kv->seqs[kv->batch[i].seq];
        int l = kv->batch[i].layer, n_own = kv->batch[i].n_own;
        if (n_own) kvs_kv_compacted_into(kv, s, l, kv->batch_own + kv->batch[i].own, n_own, s->budgets[l]);
        else kvs_kv_compacted_in_place(kv, s, l, s->budgets[l]);
    }
    kv->n_batch = kv->n_batch_own = 0;
    return KVS_OK; /* no wait: the host goes on with the next step while the device compacts */
}

/* Whether (s, layer) is due: after the prefill, compact to B_l; in decode, when
 * the layer reaches B_l + w (and w decode queries came since the last time). */
static bool due(const seq_state *s, const layer_table *t, int layer, bool at_prefill_end) {
    int b = s->budgets[layer], w = s->policy.window;
    if (b < 0) return false;
    return at_prefill_end ? t->len > b : t->len >= b + w && s->n_tokens - s->ring_base[layer] >= w;
}

kvs_status kvs_kv_sparsify_seqs(kvs_kv_cache *kv, const int32_t *seq_ids, int n) {
    for (int i = 0; i < n; i++)
        if (!kvs_kv_get_seq(kv, seq_ids[i])) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_ids[i]);
    batch_drop(kv);
    kvs_status st = KVS_OK;
    for (int i = 0; i < n && st == KVS_OK; i++) {
        seq_state *s = &kv->seqs[seq_ids[i]];
        if (!s->budgets || s->n_tokens < s->prompt_len) continue;
        bool at_prefill_end = !s->prefill_done;
        s->prefill_done = true;
        for (int l = 0; l < kv->cfg.n_layers && st == KVS_OK; l++) {
            if (!due(s, &s->layers[l], l, at_prefill_end)) continue;
            s->ring_base[l] = s->n_tokens; /* set now: a sequence listed twice finds the layer not due */
            st = s->policy.kind == KVS_POLICY_STREAMINGLLM ? compact_streaming(kv, s, l) : batch_add(kv, s, l);
        }
        /* what the prompt's compaction left (spare blocks are in no table: the batch never reads them) */
        while (st == KVS_OK && s->n_spare > 0) kvs_block_drop(&kv->blocks, s->spare[--s->n_spare]);
    }
    if (st != KVS_OK) {
        batch_drop(kv);
        return st;
    }
    return run_batch(kv);
}

kvs_status kvs_kv_sparsify(kvs_kv_cache *kv, int seq_id) { return kvs_kv_sparsify_seqs(kv, &(int32_t){seq_id}, 1); }

