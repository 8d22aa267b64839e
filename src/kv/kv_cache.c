/* The block pool and the per-(sequence, layer) block tables. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

size_t kvs_kv_block_bytes(const kvs_kv_config *cfg, kvs_dtype kv_dtype) {
    return 2 * (size_t)cfg->n_kv_heads * cfg->block_size * cfg->head_dim * kvs_dtype_size(kv_dtype);
}

int64_t kvs_kv_blocks_for_budget(const kvs_kv_config *cfg, kvs_dtype kv_dtype, size_t budget_bytes) {
    size_t bb = kvs_kv_block_bytes(cfg, kv_dtype);
    return bb ? (int64_t)(budget_bytes / bb) : 0;
}

kvs_status kvs_kv_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_cache **out) {
    *out = NULL;
    if (cfg->n_layers <= 0 || cfg->n_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->block_size <= 0 ||
        cfg->n_blocks <= 0 || cfg->n_blocks > INT32_MAX || cfg->max_seqs <= 0 || cfg->n_heads < 0 ||
        (cfg->n_heads > 0 && cfg->n_heads % cfg->n_kv_heads))
        return kvs_fail(KVS_ERR_INVALID, "kv cache: invalid configuration (%lld blocks, %d sequences)",
                        (long long)cfg->n_blocks, cfg->max_seqs);
    kvs_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    kv->cfg = *cfg;
    kv->be = be;
    size_t bytes = (size_t)cfg->n_blocks * kvs_kv_block_bytes(cfg, be->kv_dtype);
    kv->pool = (kvs_kv_pool){be->alloc(be, bytes), cfg->n_blocks, cfg->block_size, cfg->n_kv_heads,
                             cfg->head_dim};
    kv->free_blocks = malloc(sizeof(int32_t) * (size_t)cfg->n_blocks);
    kv->seqs = calloc((size_t)cfg->max_seqs, sizeof(seq_state));
    if (!kv->pool.data || !kv->free_blocks || !kv->seqs) {
        kvs_kv_destroy(kv);
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate %zu bytes for %lld blocks", bytes,
                        (long long)cfg->n_blocks);
    }
    kvs_status st = kvs_kv_meta_create(kv);
    if (st == KVS_OK && be->kv_dtype == KVS_F8_E4M3) st = kvs_kv_set_scales(kv, NULL);
    if (st != KVS_OK) {
        kvs_kv_destroy(kv);
        return st;
    }
    for (int64_t i = 0; i < cfg->n_blocks; i++) kv->free_blocks[i] = (int32_t)(cfg->n_blocks - 1 - i);
    kv->n_free = cfg->n_blocks;
    *out = kv;
    return KVS_OK;
}

void kvs_kv_destroy(kvs_kv_cache *kv) {
    if (!kv) return;
    for (int s = 0; kv->seqs && s < kv->cfg.max_seqs; s++) kvs_kv_free(kv, s);
    if (kv->pool.data) kv->be->free(kv->be, kv->pool.data);
    if (kv->scales) kv->be->free(kv->be, kv->scales);
    for (int l = 0; kv->win_q && l < kv->cfg.n_layers; l++) {
        if (kv->win_q[l]) kv->be->free(kv->be, kv->win_q[l]);
        if (kv->win_lse[l]) kv->be->free(kv->be, kv->win_lse[l]);
    }
    free(kv->win_q);
    free(kv->win_lse);
    for (int i = 0; i < KVS_KV_SCRATCH_SLOTS; i++)
        if (kv->scratch[i]) kv->be->free(kv->be, kv->scratch[i]);
    for (int i = 0; i < 2; i++)
        if (kv->staging[i]) kv->be->host_free(kv->be, kv->staging[i]);
    free(kv->batch);
    free(kv->batch_own);
    kvs_kv_meta_destroy(kv);
    free(kv->window);
    free(kv->free_blocks);
    free(kv->seqs);
    free(kv);
}

const kvs_kv_config *kvs_kv_get_config(const kvs_kv_cache *kv) { return &kv->cfg; }
const kvs_kv_pool *kvs_kv_get_pool(const kvs_kv_cache *kv) { return &kv->pool; }

kvs_kv_pool kvs_kv_layer_pool(const kvs_kv_cache *kv, int layer) {
    kvs_kv_pool p = kv->pool;
    if (kv->scales) p.scales = kv->scales + (size_t)layer * 2 * kv->cfg.n_kv_heads;
    return p;
}

/* NULL scales: every one 1 (what kvs_kv_create sets for an FP8 pool). */
kvs_status kvs_kv_set_scales(kvs_kv_cache *kv, const float *scales) {
    if (kv->be->kv_dtype != KVS_F8_E4M3) return KVS_OK;
    size_t n = (size_t)kv->cfg.n_layers * 2 * kv->cfg.n_kv_heads;
    for (size_t i = 0; scales && i < n; i++)
        if (!(scales[i] > 0) || !isfinite(scales[i]))
            return kvs_fail(KVS_ERR_INVALID, "kv cache: FP8 %s scale of layer %zu, KV head %zu is %g (must be finite "
                            "and positive)", i / kv->cfg.n_kv_heads % 2 ? "V" : "K",
                            i / (2 * (size_t)kv->cfg.n_kv_heads), i % kv->cfg.n_kv_heads, scales[i]);
    float *host = malloc(sizeof(float) * n);
    if (!host) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory for %zu scales", n);
    for (size_t i = 0; i < n; i++) host[i] = scales ? scales[i] : 1.0f;
    if (!kv->scales) kv->scales = kv->be->alloc(kv->be, sizeof(float) * n);
    if (kv->scales) {
        kv->be->to_device(kv->be, kv->scales, host, sizeof(float) * n);
        kv->be->synchronize(kv->be); /* the host copy goes now */
    }
    free(host);
    return kv->scales ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate %zu FP8 scales", n);
}

int kvs_kv_seq_create(kvs_kv_cache *kv) {
    for (int s = 0; s < kv->cfg.max_seqs; s++) {
        if (kv->seqs[s].used) continue;
        layer_table *layers = calloc((size_t)kv->cfg.n_layers, sizeof(layer_table));
        if (!layers) break;
        kv->seqs[s] = (seq_state){.used = true, .layers = layers, .policy = kvs_kv_policy_default(KVS_POLICY_FULL)};
        for (int l = 0; l < kv->cfg.n_layers; l++) kvs_kv_touch(&layers[l]);
        return s;
    }
    kvs_fail(KVS_ERR_NOMEM, "kv cache: all %d sequence slots are in use", kv->cfg.max_seqs);
    return -1;
}

seq_state *kvs_kv_get_seq(const kvs_kv_cache *kv, int seq_id) {
    if (seq_id < 0 || seq_id >= kv->cfg.max_seqs || !kv->seqs[seq_id].used) return NULL;
    return &kv->seqs[seq_id];
}

void kvs_kv_release_tail(kvs_kv_cache *kv, layer_table *t, int keep_blocks) {
    /* the last block first: a cached prompt's end is evicted before its start */
    if (t->n_blocks > keep_blocks) kvs_kv_touch(t);
    while (t->n_blocks > keep_blocks) kvs_kv_drop_block(kv, t->blocks[--t->n_blocks]);
}

void kvs_kv_free(kvs_kv_cache *kv, int seq_id) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        kvs_kv_release_tail(kv, &s->layers[l], 0);
        free(s->layers[l].blocks);
    }
    free(s->layers);
    kvs_kv_free_sparsity(kv, s);
    kvs_kv_free_prefix(kv, s);
    memset(s, 0, sizeof *s);
}

int kvs_kv_blocks_for(const kvs_kv_cache *kv, int entries) {
    return (entries + kv->cfg.block_size - 1) / kv->cfg.block_size;
}

/* With prefix caching, a sparse sequence compacts its prompt into blocks of
 * its own (the prompt's blocks stay cached): they are reserved with the
 * tokens that end the prompt, so that the compaction never runs dry. */
static int compaction_spare(const kvs_kv_cache *kv, const seq_state *s, int n_new) {
    if (!kv->cfg.prefix_caching || !s->budgets || s->prefill_done || s->n_spare ||
        s->n_tokens + n_new < s->prompt_len)
        return 0;
    int spare = 0;
    for (int l = 0; l < kv->cfg.n_layers; l++)
        if (s->budgets[l] >= 0 && s->budgets[l] < s->prompt_len) spare += kvs_kv_blocks_for(kv, s->budgets[l]);
    return spare;
}

int64_t kvs_kv_blocks_needed(const kvs_kv_cache *kv, int seq_id, int n_new) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return 0;
    int64_t need = compaction_spare(kv, s, n_new);
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        int want = kvs_kv_blocks_for(kv, s->layers[l].len + n_new);
        if (want > s->layers[l].n_blocks) need += want - s->layers[l].n_blocks;
    }
    return need;
}

bool kvs_kv_can_admit(const kvs_kv_cache *kv, int prompt_len) {
    return (int64_t)kvs_kv_blocks_for(kv, prompt_len) * kv->cfg.n_layers <= kvs_kv_free_blocks(kv);
}

kvs_status kvs_kv_reserve(kvs_kv_cache *kv, int seq_id, int n_new) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    if (n_new < 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: negative reservation");
    int64_t need = kvs_kv_blocks_needed(kv, seq_id, n_new);
    if (need > kvs_kv_free_blocks(kv))
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: %lld blocks needed, %lld free", (long long)need,
                        (long long)kvs_kv_free_blocks(kv));
    int spare = compaction_spare(kv, s, n_new);
    if (spare) {
        free(s->spare);
        if (!(s->spare = malloc(sizeof(int32_t) * spare))) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of host memory");
        while (s->n_spare < spare) s->spare[s->n_spare++] = kvs_kv_take_block(kv);
    }
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        layer_table *t = &s->layers[l];
        int want = kvs_kv_blocks_for(kv, t->len + n_new);
        if (want > t->cap) {
            int cap = t->cap ? t->cap : 4;
            while (cap < want) cap *= 2;
            int32_t *nb = realloc(t->blocks, sizeof(int32_t) * (size_t)cap);
            if (!nb) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of host memory for block tables");
            t->blocks = nb;
            t->cap = cap;
        }
        if (t->n_blocks < want) kvs_kv_touch_append(t);
        while (t->n_blocks < want) t->blocks[t->n_blocks++] = kvs_kv_take_block(kv);
    }
    return KVS_OK;
}

kvs_status kvs_kv_set_windows(kvs_kv_cache *kv, const int32_t *window) {
    int L = kv->cfg.n_layers, any = 0;
    for (int l = 0; window && l < L; l++) {
        if (window[l] < 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: layer %d's sliding window %d < 0", l, window[l]);
        any |= window[l] > 0;
    }
    free(kv->window);
    kv->window = NULL;
    if (!any) return KVS_OK;
    if (!(kv->window = malloc(sizeof(int32_t) * (size_t)L))) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    memcpy(kv->window, window, sizeof(int32_t) * (size_t)L);
    if (kv->cfg.prefix_caching) kvs_log(KVS_LOG_INFO, "kv cache: sliding-window layers: prefix caching is off");
    kv->cfg.prefix_caching = false;
    return KVS_OK;
}

int kvs_kv_layer_window(const kvs_kv_cache *kv, int layer) {
    return kv->window && layer >= 0 && layer < kv->cfg.n_layers ? kv->window[layer] : 0;
}

/* A window layer's leading blocks that no later query sees: the next query
 * (position n_tokens) sees the entries from position n_tokens - window + 1 on;
 * the layer holds positions n_tokens - len .. n_tokens - 1. */
static void slide(kvs_kv_cache *kv, layer_table *t, int window) {
    int bs = kv->cfg.block_size, dead = t->len - (window - 1), drop = dead > 0 ? dead / bs : 0;
    if (drop <= 0) return;
    for (int i = 0; i < drop; i++) kvs_kv_drop_block(kv, t->blocks[i]);
    memmove(t->blocks, t->blocks + drop, sizeof(int32_t) * (size_t)(t->n_blocks - drop));
    t->n_blocks -= drop;
    kvs_kv_touch(t);
    t->len -= drop * bs;
}

void kvs_kv_commit(kvs_kv_cache *kv, int seq_id, int n_new) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return;
    s->n_tokens += n_new;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        s->layers[l].len += n_new;
        if (kv->window && kv->window[l] > 0) slide(kv, &s->layers[l], kv->window[l]);
    }
    if (s->prompt_hash) kvs_kv_register_prompt(kv, s);
}

int kvs_kv_len(const kvs_kv_cache *kv, int seq_id, int layer) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    return s && layer >= 0 && layer < kv->cfg.n_layers ? s->layers[layer].len : 0;
}

const int32_t *kvs_kv_blocks(const kvs_kv_cache *kv, int seq_id, int layer, int *n_blocks) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || layer < 0 || layer >= kv->cfg.n_layers) {
        *n_blocks = 0;
        return NULL;
    }
    *n_blocks = s->layers[layer].n_blocks;
    return s->layers[layer].blocks;
}

uint64_t kvs_kv_new_stamp(void) {
    static _Atomic uint64_t last;
    return atomic_fetch_add(&last, 1) + 1;
}

uint64_t kvs_kv_table_gen(const kvs_kv_cache *kv, int seq_id, int layer, uint64_t *base) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    bool ok = s && layer >= 0 && layer < kv->cfg.n_layers;
    if (base) *base = ok ? s->layers[layer].base : 0;
    return ok ? s->layers[layer].gen : 0;
}

int32_t kvs_kv_slot(const kvs_kv_cache *kv, int seq_id, int layer, int entry) {
    int32_t slot;
    kvs_kv_slots(kv, seq_id, layer, entry, 1, &slot);
    return slot;
}

void kvs_kv_slots(const kvs_kv_cache *kv, int seq_id, int layer, int entry0, int n, int32_t *slots) {
    const int32_t *blocks = kv->seqs[seq_id].layers[layer].blocks;
    const int bs = kv->cfg.block_size;
    for (int i = 0, b = entry0 / bs, off = entry0 % bs; i < n; b++, off = 0) { /* block b's run of entries */
        int run = bs - off < n - i ? bs - off : n - i;
        int32_t first = blocks[b] * bs + off;
        for (int j = 0; j < run; j++) slots[i + j] = first + j;
        i += run;
    }
}

kvs_status kvs_kv_compact(kvs_kv_cache *kv, int seq_id, int layer, const int32_t *keep, int n_keep) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || layer < 0 || layer >= kv->cfg.n_layers)
        return kvs_fail(KVS_ERR_INVALID, "kv compact: no sequence %d layer %d", seq_id, layer);
    layer_table *t = &s->layers[layer];
    if (n_keep < 0 || n_keep > t->len)
        return kvs_fail(KVS_ERR_INVALID, "kv compact: keeping %d of %d entries", n_keep, t->len);
    int H = kv->cfg.n_kv_heads;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < n_keep; i++) {
            int32_t e = keep[(size_t)h * n_keep + i];
            if (e < 0 || e >= t->len || (i > 0 && e <= keep[(size_t)h * n_keep + i - 1]))
                return kvs_fail(KVS_ERR_INVALID, "kv compact: head %d keep list not sorted, distinct and < %d",
                                h, t->len);
        }
    int32_t *d_keep = NULL, *d_tab = NULL;
    if (n_keep > 0) {
        kvs_backend *be = kv->be;
        size_t keep_bytes = sizeof(int32_t) * (size_t)H * n_keep, tab_bytes = sizeof(int32_t) * t->n_blocks;
        d_keep = kvs_kv_scratch(kv, KVS_KV_SCRATCH_KEEP, keep_bytes);
        d_tab = kvs_kv_scratch(kv, KVS_KV_SCRATCH_TABLE, tab_bytes);
        if (!d_keep || !d_tab) return kvs_fail(KVS_ERR_NOMEM, "kv compact: out of backend memory");
        be->to_device(be, d_keep, keep, keep_bytes);
        be->to_device(be, d_tab, t->blocks, tab_bytes);
    }
    return kvs_kv_compact_uploaded(kv, s, layer, d_keep, d_tab, n_keep);
}

/* Compaction into blocks of the sequence's own (the spare ones first) when the
 * layer's blocks are shared or cached: they stay as they are for their other
 * holders and the cache. */
kvs_status kvs_kv_take_own_blocks(kvs_kv_cache *kv, seq_state *s, int nb, int32_t *own) {
    int got = 0;
    while (got < nb && s->n_spare > 0) own[got++] = s->spare[--s->n_spare];
    while (got < nb && (own[got] = kvs_kv_take_block(kv)) >= 0) got++;
    if (got == nb) return KVS_OK;
    while (got > 0) kvs_kv_drop_block(kv, own[--got]);
    return kvs_fail(KVS_ERR_NOMEM, "kv compact: no free block for a shared layer's compacted copy");
}

void kvs_kv_compacted_into(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *own, int nb, int n_keep) {
    layer_table *t = &s->layers[layer];
    s->n_prompt_blocks = s->n_registered; /* the rest of the prompt is no longer there in full */
    kvs_kv_release_tail(kv, t, 0);
    memcpy(t->blocks, own, sizeof(int32_t) * nb); /* cap >= the old count >= nb */
    t->n_blocks = nb;
    kvs_kv_touch(t);
    t->len = n_keep;
}

/* A shared or cached layer compacted into blocks of the sequence's own. */
static kvs_status compact_into_own_blocks(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *d_keep,
                                          const int32_t *d_tab, int n_keep) {
    layer_table *t = &s->layers[layer];
    int nb = kvs_kv_blocks_for(kv, n_keep);
    int32_t *own = malloc(sizeof(int32_t) * nb);
    int32_t *d_own = own ? kvs_kv_scratch(kv, KVS_KV_SCRATCH_DST, sizeof(int32_t) * nb) : NULL;
    if (!d_own) {
        free(own);
        return kvs_fail(KVS_ERR_NOMEM, "kv compact: out of memory for a shared layer's compacted copy");
    }
    kvs_status st = kvs_kv_take_own_blocks(kv, s, nb, own);
    if (st == KVS_OK) {
        kvs_backend *be = kv->be;
        be->to_device(be, d_own, own, sizeof(int32_t) * nb);
        be->kv_gather(be, &kv->pool, d_tab, t->n_blocks, d_own, d_keep, n_keep);
        kvs_kv_compacted_into(kv, s, layer, own, nb, n_keep);
    }
    free(own);
    return st;
}

kvs_status kvs_kv_compact_uploaded(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *d_keep,
                                   const int32_t *d_tab, int n_keep) {
    layer_table *t = &s->layers[layer];
    if (n_keep > 0 && kvs_kv_table_shared(kv, t)) return compact_into_own_blocks(kv, s, layer, d_keep, d_tab, n_keep);
    if (n_keep > 0) kv->be->kv_gather(kv->be, &kv->pool, d_tab, t->n_blocks, d_tab, d_keep, n_keep);
    kvs_kv_compacted_in_place(kv, s, layer, n_keep);
    return KVS_OK;
}

void kvs_kv_compacted_in_place(kvs_kv_cache *kv, seq_state *s, int layer, int n_keep) {
    layer_table *t = &s->layers[layer];
    s->n_prompt_blocks = s->n_registered;
    t->len = n_keep;
    kvs_kv_release_tail(kv, t, kvs_kv_blocks_for(kv, n_keep));
}

/* *buf at least bytes long (grown to bytes or twice its size, its contents
 * dropped) through the backend's alloc / release pair; NULL when out of memory. */
static void *grow(kvs_backend *be, void **buf, size_t *cap, size_t bytes, void *(*alloc)(kvs_backend *, size_t),
                  void (*release)(kvs_backend *, void *)) {
    if (bytes > *cap) {
        size_t want = bytes > 2 * *cap ? bytes : 2 * *cap;
        if (*buf) release(be, *buf);
        *buf = alloc(be, want);
        *cap = *buf ? want : 0;
    }
    return *buf;
}

void *kvs_kv_scratch(kvs_kv_cache *kv, int slot, size_t bytes) {
    return grow(kv->be, &kv->scratch[slot], &kv->scratch_cap[slot], bytes, kv->be->alloc, kv->be->free);
}

void *kvs_kv_staging(kvs_kv_cache *kv, size_t bytes) {
    int h = kvs_turn_take(kv->be, &kv->staging_turns); /* before writing or freeing it */
    return grow(kv->be, &kv->staging[h], &kv->staging_cap[h], bytes, kv->be->host_alloc, kv->be->host_free);
}

void kvs_kv_staging_sent(kvs_kv_cache *kv) { kvs_turn_sent(kv->be, &kv->staging_turns); }

int64_t kvs_kv_free_blocks(const kvs_kv_cache *kv) { return kv->n_free + kv->n_evictable; }
int64_t kvs_kv_used_blocks(const kvs_kv_cache *kv) { return kv->cfg.n_blocks - kvs_kv_free_blocks(kv); }

void kvs_kv_seq_usage(const kvs_kv_cache *kv, int seq_id, int64_t *held, int64_t *full) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    *held = *full = 0;
    if (!s) return;
    for (int l = 0; l < kv->cfg.n_layers; l++) *held += s->layers[l].len;
    *full = (int64_t)s->n_tokens * kv->cfg.n_layers;
}

bool kvs_kv_layer_sparse(const kvs_kv_cache *kv, int seq_id, int layer) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    return s && s->budgets && layer >= 0 && layer < kv->cfg.n_layers && s->budgets[layer] >= 0;
}
