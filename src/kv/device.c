/* The cache's backend memory: the pool's bytes, an FP8 pool's scales, the
 * scratch of scoring and compaction and the pinned staging of their uploads.
 * Nothing here knows of sequences. */
#include <math.h>
#include <stdlib.h>

#include "kv/kv_internal.h"

size_t kvs_kv_block_bytes(const kvs_kv_config *cfg, kvs_dtype kv_dtype) {
    return 2 * (size_t)cfg->n_kv_heads * cfg->block_size * cfg->head_dim * kvs_dtype_size(kv_dtype);
}

int64_t kvs_kv_blocks_for_budget(const kvs_kv_config *cfg, kvs_dtype kv_dtype, size_t budget_bytes) {
    size_t bb = kvs_kv_block_bytes(cfg, kv_dtype);
    return bb ? (int64_t)(budget_bytes / bb) : 0;
}

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

kvs_status kvs_kv_alloc_windows(kvs_kv_cache *kv) {
    if (kv->win_q) return KVS_OK;
    kvs_backend *be = kv->be;
    int L = kv->cfg.n_layers;
    if (kv->cfg.n_heads <= 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: sparsity needs n_heads in the kv config");
    kv->window_cap = kvs_kv_window_cap(kv);
    kv->win_q = calloc((size_t)L, sizeof(void *));
    kv->win_lse = calloc((size_t)L, sizeof(float *));
    if (!kv->win_q || !kv->win_lse) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    size_t rows = (size_t)kv->cfg.max_seqs * kv->window_cap;
    size_t qbytes = rows * kv->cfg.n_heads * kv->cfg.head_dim * kvs_dtype_size(be->act_dtype);
    for (int l = 0; l < L; l++) {
        kv->win_q[l] = be->alloc(be, qbytes);
        kv->win_lse[l] = be->alloc(be, rows * kv->cfg.n_heads * sizeof(float));
        if (!kv->win_q[l] || !kv->win_lse[l])
            return kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate the sparsity windows (%zu bytes per layer)", qbytes);
    }
    return KVS_OK;
}

void kvs_kv_window_buffers(const kvs_kv_cache *kv, int layer, void **q, float **lse) {
    *q = kv->win_q ? kv->win_q[layer] : NULL;
    *lse = kv->win_lse ? kv->win_lse[layer] : NULL;
}
