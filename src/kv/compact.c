/* Compaction: a layer keeps the listed entries of each KV head (kv_gather),
 * in place, or into blocks of the sequence's own where its blocks are shared
 * or cached (they stay as they are for their other holders and the cache);
 * then its new length, and the blocks past it go back to the pool. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

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
    while (got < nb && (own[got] = kvs_block_take(&kv->blocks)) >= 0) got++;
    if (got == nb) return KVS_OK;
    while (got > 0) kvs_block_drop(&kv->blocks, own[--got]);
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
