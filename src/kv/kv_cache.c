/* A sequence's life in the manager: created, its blocks reserved, its tokens
 * committed (a sliding-window layer's dead blocks dropped), freed. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

kvs_status kvs_kv_manager_create(const kvs_kv_config *cfg, kvs_kv_cache **out) {
    *out = NULL;
    if (cfg->n_layers <= 0 || cfg->n_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->block_size <= 0 ||
        cfg->n_blocks <= 0 || cfg->n_blocks > INT32_MAX || cfg->max_seqs <= 0 || cfg->n_heads < 0 ||
        (cfg->n_heads > 0 && cfg->n_heads % cfg->n_kv_heads))
        return kvs_fail(KVS_ERR_INVALID, "kv cache: invalid configuration (%lld blocks, %d sequences)",
                        (long long)cfg->n_blocks, cfg->max_seqs);
    kvs_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    kv->cfg = *cfg;
    kv->hash_block = kvs_kv_hash_block;
    kv->seqs = calloc((size_t)cfg->max_seqs, sizeof(seq_state));
    kvs_status st = kv->seqs ? kvs_block_pool_init(&kv->blocks, cfg->n_blocks, cfg->block_size, cfg->n_layers,
                                                   cfg->prefix_caching)
                             : kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    if (st != KVS_OK) {
        kvs_kv_destroy(kv);
        return st;
    }
    *out = kv;
    return KVS_OK;
}

void kvs_kv_destroy(kvs_kv_cache *kv) {
    if (!kv) return;
    for (int s = 0; kv->seqs && s < kv->cfg.max_seqs; s++) kvs_kv_free(kv, s);
    kvs_kv_device_destroy(kv->own);
    kvs_kv_compactions_free(&kv->own_plan);
    kvs_block_pool_release(&kv->blocks);
    free(kv->sliding);
    free(kv->seqs);
    free(kv);
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

/* The spare blocks the tokens that end s's prompt reserve (kvs_kv_compaction_spare). */
static int compaction_spare(const kvs_kv_cache *kv, const seq_state *s, int n_new) {
    if (!kv->cfg.prefix_caching || !s->budgets || s->prefill_done || s->n_spare ||
        s->n_tokens + n_new < s->prompt_len)
        return 0;
    return kvs_kv_compaction_spare(s->budgets, kv->cfg.n_layers, kv->cfg.block_size, s->prompt_len);
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
        while (s->n_spare < spare) s->spare[s->n_spare++] = kvs_block_take(&kv->blocks);
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
        kvs_kv_touch_from(t, t->n_blocks);
        while (t->n_blocks < want) t->blocks[t->n_blocks++] = kvs_block_take(&kv->blocks);
    }
    return KVS_OK;
}

kvs_status kvs_kv_set_sliding_windows(kvs_kv_cache *kv, const int32_t *window) {
    int L = kv->cfg.n_layers, any = 0;
    for (int l = 0; window && l < L; l++) {
        if (window[l] < 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: layer %d's sliding window %d < 0", l, window[l]);
        any |= window[l] > 0;
    }
    free(kv->sliding);
    kv->sliding = NULL;
    if (!any) return KVS_OK;
    if (!(kv->sliding = malloc(sizeof(int32_t) * (size_t)L))) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    memcpy(kv->sliding, window, sizeof(int32_t) * (size_t)L);
    if (kv->cfg.prefix_caching) kvs_log(KVS_LOG_INFO, "kv cache: sliding-window layers: prefix caching is off");
    kv->cfg.prefix_caching = false;
    return KVS_OK;
}

/* A window layer's leading blocks that no later query sees: the next query
 * (position n_tokens) sees the entries from position n_tokens - window + 1 on;
 * the layer holds positions n_tokens - len .. n_tokens - 1. */
static void slide(kvs_kv_cache *kv, layer_table *t, int window) {
    int bs = kv->cfg.block_size, dead = t->len - (window - 1), drop = dead > 0 ? dead / bs : 0;
    if (drop <= 0) return;
    for (int i = 0; i < drop; i++) kvs_block_drop(&kv->blocks, t->blocks[i]);
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
        if (kv->sliding && kv->sliding[l] > 0) slide(kv, &s->layers[l], kv->sliding[l]);
    }
    if (s->prompt_hash) kvs_kv_register_prompt(kv, s);
}
