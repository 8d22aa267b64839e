/* The per-(sequence, layer) block tables: lookups, slots, and the changes
 * the devices' copies of them need. Host memory; blocks come from and go back
 * to block_pool.c. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

const kvs_kv_config *kvs_kv_get_config(const kvs_kv_cache *kv) { return &kv->cfg; }

seq_state *kvs_kv_get_seq(const kvs_kv_cache *kv, int seq_id) {
    if (seq_id < 0 || seq_id >= kv->cfg.max_seqs || !kv->seqs[seq_id].used) return NULL;
    return &kv->seqs[seq_id];
}

int kvs_kv_blocks_for(const kvs_kv_cache *kv, int entries) {
    return (entries + kv->cfg.block_size - 1) / kv->cfg.block_size;
}

void kvs_kv_release_tail(kvs_kv_cache *kv, layer_table *t, int keep_blocks) {
    /* the last block first: a cached prompt's end is evicted before its start */
    while (t->n_blocks > keep_blocks) kvs_block_drop(&kv->blocks, t->blocks[--t->n_blocks]);
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

/* *cap at least n (doubled, at least 64); false when out of memory. */
static bool grow(void **p, int64_t *cap, int64_t n, size_t size) {
    if (n <= *cap) return true;
    int64_t c = *cap ? 2 * *cap : 64;
    while (c < n) c *= 2;
    void *g = realloc(*p, (size_t)c * size);
    if (!g) return false;
    *p = g, *cap = c;
    return true;
}

kvs_status kvs_kv_plan_tables(kvs_kv_cache *kv, const int32_t *seq_ids, int n, kvs_kv_table_deltas *out) {
    out->n_deltas = 0, out->n_blocks = 0;
    int64_t cap_deltas = out->cap_deltas;
    for (int i = 0; i < n; i++) {
        seq_state *s = kvs_kv_get_seq(kv, seq_ids[i]);
        for (int l = 0; s && l < kv->cfg.n_layers; l++) {
            layer_table *t = &s->layers[l];
            if (t->changed >= t->n_blocks) continue;
            int64_t nd = out->n_deltas + 1, nb = out->n_blocks + (t->n_blocks - t->changed);
            if (!grow((void **)&out->deltas, &cap_deltas, nd, sizeof *out->deltas) ||
                !grow((void **)&out->blocks, &out->cap_blocks, nb, sizeof *out->blocks)) {
                out->cap_deltas = (int)cap_deltas;
                return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory for the tables' changes");
            }
            out->deltas[out->n_deltas++] = (kvs_kv_table_delta){seq_ids[i], l, t->changed, t->n_blocks - t->changed,
                                                                out->n_blocks};
            memcpy(out->blocks + out->n_blocks, t->blocks + t->changed, sizeof(int32_t) * (t->n_blocks - t->changed));
            out->n_blocks = nb;
        }
    }
    out->cap_deltas = (int)cap_deltas;
    /* given: forgotten only once the whole plan is made (a failure above sends them next time) */
    for (int i = 0; i < n; i++) {
        seq_state *s = kvs_kv_get_seq(kv, seq_ids[i]);
        for (int l = 0; s && l < kv->cfg.n_layers; l++) s->layers[l].changed = KVS_KV_UNCHANGED;
    }
    return KVS_OK;
}

void kvs_kv_table_deltas_free(kvs_kv_table_deltas *t) {
    free(t->deltas);
    free(t->blocks);
    *t = (kvs_kv_table_deltas){0};
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

int kvs_kv_layer_sliding_window(const kvs_kv_cache *kv, int layer) {
    return kv->sliding && layer >= 0 && layer < kv->cfg.n_layers ? kv->sliding[layer] : 0;
}

int64_t kvs_kv_free_blocks(const kvs_kv_cache *kv) { return kvs_block_pool_available(&kv->blocks); }

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
