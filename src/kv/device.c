/* A rank's memory of the KV cache (kv_device.h): the pool's bytes, an FP8
 * pool's scales, the observation windows, the scratch of scoring and
 * compaction and the pinned staging of their uploads; and what it runs, the
 * manager's compaction plans (the tables' copies: device_tables.c). It reads the manager (a sequence's captured
 * window, for calibrate's scores), never writes it. */
#include <math.h>
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

kvs_status kvs_kv_device_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_device **out) {
    *out = NULL;
    kvs_kv_device *d = calloc(1, sizeof *d);
    if (!d) return kvs_fail(KVS_ERR_NOMEM, "kv device: out of memory");
    d->cfg = *cfg;
    d->be = be;
    size_t bytes = (size_t)cfg->n_blocks * kvs_kv_block_bytes(cfg, be->kv_dtype);
    d->pool = (kvs_kv_pool){be->alloc(be, bytes), cfg->n_blocks, cfg->block_size, cfg->n_kv_heads, cfg->head_dim, NULL};
    /* an FP8 pool's scales start at 1 */
    kvs_status st = !d->pool.data ? kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate %zu bytes for %lld blocks", bytes,
                                             (long long)cfg->n_blocks)
                    : be->kv_dtype == KVS_F8_E4M3 ? kvs_kv_device_set_scales(d, NULL)
                                                  : KVS_OK;
    if (st == KVS_OK) st = kvs_kv_device_tables_create(d);
    if (st == KVS_OK) *out = d;
    else kvs_kv_device_destroy(d);
    return st;
}

void kvs_kv_device_destroy(kvs_kv_device *d) {
    if (!d) return;
    kvs_backend *be = d->be;
    if (d->pool.data) be->free(be, d->pool.data);
    if (d->scales) be->free(be, d->scales);
    kvs_kv_device_tables_free(d);
    for (int l = 0; d->win_q && l < d->cfg.n_layers; l++) {
        if (d->win_q[l]) be->free(be, d->win_q[l]);
        if (d->win_lse[l]) be->free(be, d->win_lse[l]);
    }
    free(d->win_q);
    free(d->win_lse);
    for (int i = 0; i < KVS_KV_SCRATCH_SLOTS; i++)
        if (d->scratch[i]) be->free(be, d->scratch[i]);
    for (int i = 0; i < 2; i++)
        if (d->staging[i]) be->host_free(be, d->staging[i]);
    free(d);
}

const kvs_kv_config *kvs_kv_device_config(const kvs_kv_device *d) { return &d->cfg; }
kvs_backend *kvs_kv_device_backend(const kvs_kv_device *d) { return d->be; }
const kvs_kv_pool *kvs_kv_device_pool(const kvs_kv_device *d) { return &d->pool; }

kvs_kv_pool kvs_kv_device_layer_pool(const kvs_kv_device *d, int layer) {
    kvs_kv_pool p = d->pool;
    if (d->scales) p.scales = d->scales + (size_t)layer * 2 * d->cfg.n_kv_heads;
    return p;
}

kvs_status kvs_kv_device_set_scales(kvs_kv_device *d, const float *scales) {
    if (d->be->kv_dtype != KVS_F8_E4M3) return KVS_OK;
    size_t n = (size_t)d->cfg.n_layers * 2 * d->cfg.n_kv_heads;
    for (size_t i = 0; scales && i < n; i++)
        if (!(scales[i] > 0) || !isfinite(scales[i]))
            return kvs_fail(KVS_ERR_INVALID, "kv cache: FP8 %s scale of layer %zu, KV head %zu is %g (must be finite "
                            "and positive)", i / d->cfg.n_kv_heads % 2 ? "V" : "K",
                            i / (2 * (size_t)d->cfg.n_kv_heads), i % d->cfg.n_kv_heads, scales[i]);
    float *host = malloc(sizeof(float) * n);
    if (!host) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory for %zu scales", n);
    for (size_t i = 0; i < n; i++) host[i] = scales ? scales[i] : 1.0f;
    if (!d->scales) d->scales = d->be->alloc(d->be, sizeof(float) * n);
    if (d->scales) {
        d->be->to_device(d->be, d->scales, host, sizeof(float) * n);
        d->be->synchronize(d->be); /* the host copy goes now */
    }
    free(host);
    return d->scales ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate %zu FP8 scales", n);
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

static void *scratch(kvs_kv_device *d, int slot, size_t bytes) {
    return grow(d->be, &d->scratch[slot], &d->scratch_cap[slot], bytes, d->be->alloc, d->be->free);
}

/* The pinned staging of at least bytes: the one of the two whose copy has run
 * (waited for only when no wait for the device came since it was sent);
 * kvs_turn_sent after its to_device. */
static void *staging(kvs_kv_device *d, size_t bytes) {
    int h = kvs_turn_take(d->be, &d->staging_turns); /* before writing or freeing it */
    return grow(d->be, &d->staging[h], &d->staging_cap[h], bytes, d->be->host_alloc, d->be->host_free);
}

kvs_status kvs_kv_device_prepare_windows(kvs_kv_device *d, int rows_per_seq) {
    if (d->win_q) return KVS_OK;
    kvs_backend *be = d->be;
    int L = d->cfg.n_layers;
    if (d->cfg.n_heads <= 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: sparsity needs n_heads in the kv config");
    void **q = calloc((size_t)L, sizeof(void *));
    float **lse = calloc((size_t)L, sizeof(float *));
    if (!q || !lse) {
        free(q), free(lse);
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    }
    d->win_q = q, d->win_lse = lse;
    d->window_rows = rows_per_seq;
    size_t rows = (size_t)d->cfg.max_seqs * d->window_rows;
    size_t qbytes = rows * d->cfg.n_heads * d->cfg.head_dim * kvs_dtype_size(be->act_dtype);
    for (int l = 0; l < L; l++) {
        d->win_q[l] = be->alloc(be, qbytes);
        d->win_lse[l] = be->alloc(be, rows * d->cfg.n_heads * sizeof(float));
        if (!d->win_q[l] || !d->win_lse[l])
            return kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate the sparsity windows (%zu bytes per layer)", qbytes);
    }
    return KVS_OK;
}

void kvs_kv_device_window_buffers(const kvs_kv_device *d, int layer, void **q, float **lse) {
    *q = d->win_q ? d->win_q[layer] : NULL;
    *lse = d->win_lse ? d->win_lse[layer] : NULL;
}

/* The window rows from row on: queries and LSE. */
static void window_at(const kvs_kv_device *d, int layer, int row, const void **q, const float **lse) {
    size_t nh = d->cfg.n_heads;
    *q = (const char *)d->win_q[layer] + (size_t)row * nh * d->cfg.head_dim * kvs_dtype_size(d->be->act_dtype);
    *lse = d->win_lse[layer] + (size_t)row * nh;
}

/* ---- the plan's compactions ------------------------------------------------------ */

/* A job with keep lists: uploaded (one list repeated for every head when the
 * plan has one), then kv_gather in place or into its copy. */
static kvs_status compact_keep(kvs_kv_device *d, const kvs_kv_compactions *plan, const kvs_kv_compaction *j) {
    if (j->n_keep == 0) return KVS_OK; /* only blocks released */
    kvs_backend *be = d->be;
    int H = d->cfg.n_kv_heads;
    if (j->keep_heads != 1 && j->keep_heads != H)
        return kvs_fail(KVS_ERR_INVALID, "kv compact: %d keep lists for a device of %d KV heads", j->keep_heads, H);
    size_t keep_bytes = sizeof(int32_t) * (size_t)H * j->n_keep, tab_bytes = sizeof(int32_t) * j->n_blocks;
    size_t dst_bytes = sizeof(int32_t) * j->dst_blocks;
    int32_t *d_keep = scratch(d, KVS_KV_SCRATCH_KEEP, keep_bytes), *d_tab = scratch(d, KVS_KV_SCRATCH_TABLE, tab_bytes);
    int32_t *d_dst = j->dst_blocks ? scratch(d, KVS_KV_SCRATCH_DST, dst_bytes) : d_tab;
    int32_t *keep = malloc(keep_bytes);
    if (!d_keep || !d_tab || !d_dst || !keep) {
        free(keep);
        return kvs_fail(KVS_ERR_NOMEM, "kv compact: out of memory");
    }
    for (int h = 0; h < H; h++)
        memcpy(keep + (size_t)h * j->n_keep, plan->keep + j->keep + (j->keep_heads == 1 ? 0 : (size_t)h * j->n_keep),
               sizeof(int32_t) * j->n_keep);
    be->to_device(be, d_keep, keep, keep_bytes);
    be->to_device(be, d_tab, plan->tables + j->table, tab_bytes);
    if (j->dst_blocks) be->to_device(be, d_dst, plan->tables + j->dst_table, dst_bytes);
    free(keep); /* a copy from pageable memory is done with it when to_device returns */
    be->kv_gather(be, &d->pool, d_tab, j->n_blocks, d_dst, d_keep, j->n_keep);
    return KVS_OK;
}

/* Every SnapKV job in one snapkv_compact_batch: the job list and the tables in
 * one upload from the pinned staging. */
static kvs_status compact_snapkv(kvs_kv_device *d, const kvs_kv_compactions *plan, int n) {
    int H = d->cfg.n_kv_heads, max_keys = 0;
    if (!d->win_q) return kvs_fail(KVS_ERR_INTERNAL, "kv compact: SnapKV jobs on a device without its windows");
    int64_t n_scores = 0, n_keep = 0;
    for (int i = 0; i < plan->n_jobs; i++) {
        const kvs_kv_compaction *j = &plan->jobs[i];
        if (j->kind != KVS_COMPACT_SNAPKV) continue;
        n_scores += (int64_t)H * j->n_keys;
        n_keep += (int64_t)H * j->n_keep;
        if (j->n_keys > max_keys) max_keys = j->n_keys;
    }
    kvs_backend *be = d->be;
    size_t job_bytes = sizeof(kvs_snapkv_job) * n, bytes = job_bytes + sizeof(int32_t) * plan->n_tables;
    char *host = staging(d, bytes), *d_lists = scratch(d, KVS_KV_SCRATCH_BATCH, bytes);
    float *d_scores = scratch(d, KVS_KV_SCRATCH_SCORES, sizeof(float) * (size_t)(n_scores ? n_scores : 1));
    int32_t *d_keep = scratch(d, KVS_KV_SCRATCH_KEEP, sizeof(int32_t) * (size_t)(n_keep ? n_keep : 1));
    if (!host || !d_lists || !d_scores || !d_keep)
        return kvs_fail(KVS_ERR_NOMEM, "kv compact: out of memory for a batch of %d compactions (%zu bytes of "
                        "tables, %lld scores)", n, bytes, (long long)n_scores);
    kvs_snapkv_job *jobs = (kvs_snapkv_job *)host;
    memcpy(host + job_bytes, plan->tables, sizeof(int32_t) * plan->n_tables); /* the plan's tables as they are */
    int64_t sc = 0, kp = 0;
    int k = 0;
    for (int i = 0; i < plan->n_jobs; i++) {
        const kvs_kv_compaction *j = &plan->jobs[i];
        if (j->kind != KVS_COMPACT_SNAPKV) continue;
        kvs_snapkv_job *o = &jobs[k++];
        window_at(d, j->layer, j->window_row, &o->win_q, &o->win_lse);
        o->scales = kvs_kv_device_layer_pool(d, j->layer).scales;
        o->scores = sc, o->keep = kp, o->table = j->table, o->n_blocks = j->n_blocks;
        o->n_keys = j->n_keys, o->n_win = j->n_win, o->k = j->n_keep - j->n_win, o->pool = j->pool;
        o->dst_table = j->dst_table, o->dst_blocks = j->dst_blocks;
        sc += (int64_t)H * j->n_keys;
        kp += (int64_t)H * j->n_keep;
    }
    be->to_device(be, d_lists, host, bytes);
    kvs_turn_sent(be, &d->staging_turns);
    kvs_snapkv_batch b = {.n_jobs = n, .n_heads = d->cfg.n_heads, .scale = 1.0f / sqrtf((float)d->cfg.head_dim),
                          .jobs = (const kvs_snapkv_job *)d_lists, .tables = (const int32_t *)(d_lists + job_bytes),
                          .scores = d_scores, .keep = d_keep, .max_keys = max_keys, .scores_len = n_scores};
    be->snapkv_compact_batch(be, &d->pool, &b);
    return KVS_OK; /* no wait: the host goes on with the next step while the device compacts */
}

kvs_status kvs_kv_device_compact(kvs_kv_device *d, const kvs_kv_compactions *plan) {
    int n_snapkv = 0;
    for (int i = 0; i < plan->n_jobs; i++) {
        if (plan->jobs[i].kind == KVS_COMPACT_KEEP) KVS_TRY(compact_keep(d, plan, &plan->jobs[i]));
        else n_snapkv++;
    }
    return n_snapkv ? compact_snapkv(d, plan, n_snapkv) : KVS_OK;
}

kvs_status kvs_kv_device_window_scores(kvs_kv_device *d, const kvs_kv_cache *kv, int seq_id, int layer, float *out) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || layer < 0 || layer >= kv->cfg.n_layers) return kvs_fail(KVS_ERR_INVALID, "kv window scores: no such sequence or layer");
    const layer_table *t = &s->layers[layer];
    int n = t->len, w = s->policy.window, H = d->cfg.n_kv_heads;
    if (!s->budgets || s->budgets[layer] < 0 || s->policy.kind == KVS_POLICY_STREAMINGLLM || n != s->n_tokens ||
        s->n_tokens != s->prompt_len || n < w || !d->win_q)
        return kvs_fail(KVS_ERR_INVALID, "kv window scores: layer %d holds no captured window over its whole prompt", layer);
    if (n == w) return KVS_OK; /* no entry before the window */
    kvs_backend *be = d->be;
    size_t tab_bytes = sizeof(int32_t) * t->n_blocks;
    int32_t *d_tab = scratch(d, KVS_KV_SCRATCH_TABLE, tab_bytes);
    float *d_scores = scratch(d, KVS_KV_SCRATCH_SCORES, sizeof(float) * (size_t)H * (n - w));
    if (!d_tab || !d_scores) return kvs_fail(KVS_ERR_NOMEM, "kv window scores: out of backend memory");
    const void *q;
    const float *lse;
    window_at(d, layer, seq_id * d->window_rows, &q, &lse);
    be->to_device(be, d_tab, t->blocks, tab_bytes);
    kvs_kv_pool pool = kvs_kv_device_layer_pool(d, layer);
    be->sparsity_scores(be, d_scores, q, lse, w, &pool, d_tab, n - w, d->cfg.n_heads, 1.0f / sqrtf((float)d->cfg.head_dim));
    be->to_host(be, out, d_scores, sizeof(float) * (size_t)H * (n - w));
    return be->check(be);
}

kvs_status kvs_kv_device_copy(kvs_kv_device *d, const int32_t *src, const int32_t *dst, int n, int from_seq, int to_seq) {
    kvs_backend *be = d->be;
    size_t block_bytes = kvs_kv_block_bytes(&d->cfg, be->kv_dtype);
    for (int i = 0; i < n; i++)
        be->copy(be, (char *)d->pool.data + (size_t)dst[i] * block_bytes, (char *)d->pool.data + (size_t)src[i] * block_bytes,
                 block_bytes);
    if (!d->win_q || from_seq < 0) return KVS_OK;
    size_t rows = d->window_rows, nh = d->cfg.n_heads, qrow = nh * d->cfg.head_dim * kvs_dtype_size(be->act_dtype);
    for (int l = 0; l < d->cfg.n_layers; l++) {
        be->copy(be, (char *)d->win_q[l] + (size_t)to_seq * rows * qrow, (char *)d->win_q[l] + (size_t)from_seq * rows * qrow,
                 rows * qrow);
        be->copy(be, d->win_lse[l] + (size_t)to_seq * rows * nh, d->win_lse[l] + (size_t)from_seq * rows * nh,
                 rows * nh * sizeof(float));
    }
    return KVS_OK;
}
