/* The block pool and the per-(sequence, layer) block tables. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

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
    kv->seqs = calloc((size_t)cfg->max_seqs, sizeof(seq_state));
    if (!kv->pool.data || !kv->seqs) {
        kvs_kv_destroy(kv);
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate %zu bytes for %lld blocks", bytes,
                        (long long)cfg->n_blocks);
    }
    kv->hash_block = kvs_kv_hash_block;
    kvs_status st = kvs_block_pool_init(&kv->blocks, cfg->n_blocks, cfg->block_size, cfg->n_layers, cfg->prefix_caching);
    if (st == KVS_OK && be->kv_dtype == KVS_F8_E4M3) st = kvs_kv_set_scales(kv, NULL);
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
    kvs_block_pool_release(&kv->blocks);
    free(kv->window);
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
        if (t->n_blocks < want) kvs_kv_touch_append(t);
        while (t->n_blocks < want) t->blocks[t->n_blocks++] = kvs_block_take(&kv->blocks);
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
        if (kv->window && kv->window[l] > 0) slide(kv, &s->layers[l], kv->window[l]);
    }
    if (s->prompt_hash) kvs_kv_register_prompt(kv, s);
}

/* A fork shares the cached blocks (the prompt's, which nobody writes again)
 * and copies the others. */
kvs_status kvs_kv_fork(kvs_kv_cache *kv, int seq_id, int *new_seq) {
    seq_state *src = kvs_kv_get_seq(kv, seq_id);
    if (!src) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    int64_t need = 0;
    for (int l = 0; l < kv->cfg.n_layers; l++)
        for (int i = 0; i < src->layers[l].n_blocks; i++) need += !kvs_block_cached(&kv->blocks, src->layers[l].blocks[i]);
    if (need > kvs_kv_free_blocks(kv))
        return kvs_fail(KVS_ERR_NOMEM, "kv fork: %lld blocks needed, %lld free", (long long)need,
                        (long long)kvs_kv_free_blocks(kv));
    int id = kvs_kv_seq_create(kv);
    if (id < 0) return KVS_ERR_NOMEM;
    seq_state *dst = &kv->seqs[id];
    size_t block_bytes = kvs_kv_block_bytes(&kv->cfg, kv->be->kv_dtype);
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        layer_table *a = &src->layers[l], *b = &dst->layers[l];
        b->blocks = malloc(sizeof(int32_t) * (a->n_blocks ? a->n_blocks : 1));
        if (!b->blocks) {
            kvs_kv_free(kv, id);
            return kvs_fail(KVS_ERR_NOMEM, "kv fork: out of memory");
        }
        b->cap = a->n_blocks ? a->n_blocks : 1;
        for (int i = 0; i < a->n_blocks; i++) {
            int32_t from = a->blocks[i];
            if (kvs_block_cached(&kv->blocks, from)) { /* shared */
                kvs_block_hold(&kv->blocks, from);
                b->blocks[b->n_blocks++] = from;
                continue;
            }
            int32_t blk = kvs_block_take(&kv->blocks);
            b->blocks[b->n_blocks++] = blk;
            kv->be->copy(kv->be, (char *)kv->pool.data + (size_t)blk * block_bytes,
                         (char *)kv->pool.data + (size_t)from * block_bytes, block_bytes);
        }
        kvs_kv_touch(b);
        b->len = a->len;
    }
    dst->n_tokens = src->n_tokens;
    kvs_status st = kvs_kv_set_policy(kv, id, &src->policy, src->prompt_len);
    if (st == KVS_OK && src->budgets) {
        memcpy(dst->budgets, src->budgets, sizeof(int) * kv->cfg.n_layers);
        memcpy(dst->ring_base, src->ring_base, sizeof(int) * kv->cfg.n_layers);
        dst->prefill_done = src->prefill_done;
        size_t rows = kv->window_cap, nh = kv->cfg.n_heads;
        size_t qrow = nh * kv->cfg.head_dim * kvs_dtype_size(kv->be->act_dtype);
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            kv->be->copy(kv->be, (char *)kv->win_q[l] + (size_t)id * rows * qrow,
                         (char *)kv->win_q[l] + (size_t)seq_id * rows * qrow, rows * qrow);
            kv->be->copy(kv->be, kv->win_lse[l] + (size_t)id * rows * nh, kv->win_lse[l] + (size_t)seq_id * rows * nh,
                         rows * nh * sizeof(float));
        }
    }
    if (st != KVS_OK) {
        kvs_kv_free(kv, id);
        return st;
    }
    *new_seq = id;
    return KVS_OK;
}
