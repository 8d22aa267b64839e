/* A manager with one device of its own (kvs_kv_create): the world-1 cache of
 * the library, the commands and the tests. Its device work runs at once, on
 * the caller's thread; the runner's ranks call the kvs_kv_device functions on
 * their own devices instead. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

kvs_status kvs_kv_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_cache **out) {
    *out = NULL;
    kvs_kv_cache *kv;
    KVS_TRY(kvs_kv_manager_create(cfg, &kv));
    kvs_status st = kvs_kv_device_create(cfg, be, &kv->own);
    if (st != KVS_OK) {
        kvs_kv_destroy(kv);
        return st;
    }
    *out = kv;
    return KVS_OK;
}

kvs_kv_device *kvs_kv_own_device(const kvs_kv_cache *kv) { return kv->own; }
const kvs_kv_pool *kvs_kv_get_pool(const kvs_kv_cache *kv) { return kvs_kv_device_pool(kv->own); }
kvs_kv_pool kvs_kv_layer_pool(const kvs_kv_cache *kv, int layer) { return kvs_kv_device_layer_pool(kv->own, layer); }
kvs_status kvs_kv_set_scales(kvs_kv_cache *kv, const float *scales) { return kvs_kv_device_set_scales(kv->own, scales); }

void kvs_kv_window_buffers(const kvs_kv_cache *kv, int layer, void **q, float **lse) {
    kvs_kv_device_window_buffers(kv->own, layer, q, lse);
}

static kvs_status need_device(const kvs_kv_cache *kv) {
    return kv->own ? KVS_OK : kvs_fail(KVS_ERR_INVALID, "kv cache: a manager without a device of its own");
}

kvs_status kvs_kv_sparsify_seqs(kvs_kv_cache *kv, const int32_t *seq_ids, int n) {
    KVS_TRY(need_device(kv));
    KVS_TRY(kvs_kv_plan_compactions(kv, seq_ids, n, &kv->own_plan));
    return kvs_kv_device_compact(kv->own, &kv->own_plan);
}

kvs_status kvs_kv_sparsify(kvs_kv_cache *kv, int seq_id) { return kvs_kv_sparsify_seqs(kv, &(int32_t){seq_id}, 1); }

kvs_status kvs_kv_compact(kvs_kv_cache *kv, int seq_id, int layer, const int32_t *keep, int n_keep) {
    KVS_TRY(need_device(kv));
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || layer < 0 || layer >= kv->cfg.n_layers)
        return kvs_fail(KVS_ERR_INVALID, "kv compact: no sequence %d layer %d", seq_id, layer);
    const layer_table *t = &s->layers[layer];
    if (n_keep < 0 || n_keep > t->len)
        return kvs_fail(KVS_ERR_INVALID, "kv compact: keeping %d of %d entries", n_keep, t->len);
    int H = kvs_kv_device_config(kv->own)->n_kv_heads;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < n_keep; i++) {
            int32_t e = keep[(size_t)h * n_keep + i];
            if (e < 0 || e >= t->len || (i > 0 && e <= keep[(size_t)h * n_keep + i - 1]))
                return kvs_fail(KVS_ERR_INVALID, "kv compact: head %d keep list not sorted, distinct and < %d", h, t->len);
        }
    kvs_kv_compactions *plan = &kv->own_plan;
    kvs_kv_plan_clear(plan);
    KVS_TRY(kvs_kv_plan_keep(kv, plan, s, layer, keep, n_keep, H));
    kvs_kv_plan_apply(kv, plan);
    return kvs_kv_device_compact(kv->own, plan);
}

kvs_status kvs_kv_window_scores(kvs_kv_cache *kv, int seq_id, int layer, float *out) {
    KVS_TRY(need_device(kv));
    return kvs_kv_device_window_scores(kv->own, kv, seq_id, layer, out);
}

/* A fork shares the cached blocks (the prompt's, which nobody writes again)
 * and copies the others. */
kvs_status kvs_kv_fork(kvs_kv_cache *kv, int seq_id, int *new_seq) {
    KVS_TRY(need_device(kv));
    seq_state *src = kvs_kv_get_seq(kv, seq_id);
    if (!src) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    int64_t need = 0;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        for (int i = 0; i < src->layers[l].n_blocks; i++) need += !kvs_block_cached(&kv->blocks, src->layers[l].blocks[i]);
    }
    if (need > kvs_kv_free_blocks(kv))
        return kvs_fail(KVS_ERR_NOMEM, "kv fork: %lld blocks needed, %lld free", (long long)need,
                        (long long)kvs_kv_free_blocks(kv));
    int32_t *from = malloc(sizeof(int32_t) * (size_t)(need ? need : 1)), *to = malloc(sizeof(int32_t) * (size_t)(need ? need : 1));
    int id = from && to ? kvs_kv_seq_create(kv) : -1;
    if (id < 0) {
        free(from), free(to);
        return from && to ? KVS_ERR_NOMEM : kvs_fail(KVS_ERR_NOMEM, "kv fork: out of memory");
    }
    seq_state *dst = &kv->seqs[id];
    int n_copy = 0;
    kvs_status st = KVS_OK;
    for (int l = 0; l < kv->cfg.n_layers && st == KVS_OK; l++) {
        layer_table *a = &src->layers[l], *b = &dst->layers[l];
        b->blocks = malloc(sizeof(int32_t) * (a->n_blocks ? a->n_blocks : 1));
        if (!b->blocks) {
            st = kvs_fail(KVS_ERR_NOMEM, "kv fork: out of memory");
            break;
        }
        b->cap = a->n_blocks ? a->n_blocks : 1;
        for (int i = 0; i < a->n_blocks; i++) {
            int32_t blk = a->blocks[i];
            if (kvs_block_cached(&kv->blocks, blk)) { /* shared */
                kvs_block_hold(&kv->blocks, blk);
            } else {
                from[n_copy] = blk;
                blk = to[n_copy++] = kvs_block_take(&kv->blocks);
            }
            b->blocks[b->n_blocks++] = blk;
        }
        kvs_kv_touch(b);
        b->len = a->len;
    }
    dst->n_tokens = src->n_tokens;
    if (st == KVS_OK) st = kvs_kv_set_policy(kv, id, &src->policy, src->prompt_len);
    if (st == KVS_OK && src->budgets) {
        memcpy(dst->budgets, src->budgets, sizeof(int) * kv->cfg.n_layers);
        memcpy(dst->ring_base, src->ring_base, sizeof(int) * kv->cfg.n_layers);
        dst->prefill_done = src->prefill_done;
    }
    if (st == KVS_OK) st = kvs_kv_device_copy(kv->own, from, to, n_copy, src->budgets ? seq_id : -1, id);
    free(from), free(to);
    if (st != KVS_OK) {
        kvs_kv_free(kv, id);
        return st;
    }
    *new_seq = id;
    return KVS_OK;
}
