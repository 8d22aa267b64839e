/* Sparsity orchestration: per-sequence policies, the window queries, scoring,
 * selection and compaction, and forking a sequence. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

void kvs_kv_free_sparsity(kvs_kv_cache *kv, seq_state *s) {
    free(s->budgets);
    free(s->ring_base);
    s->budgets = s->ring_base = NULL;
}

static int window_cap(const kvs_kv_cache *kv) { return kv->cfg.max_window > 0 ? kv->cfg.max_window : 64; }

static kvs_status alloc_windows(kvs_kv_cache *kv) {
    if (kv->win_q) return KVS_OK;
    kvs_backend *be = kv->be;
    int L = kv->cfg.n_layers;
    if (kv->cfg.n_heads <= 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: sparsity needs n_heads in the kv config");
    kv->window_cap = window_cap(kv);
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

kvs_status kvs_kv_set_policy(kvs_kv_cache *kv, int seq_id, const kvs_kv_policy *p, int prompt_len) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    KVS_TRY(kvs_kv_policy_validate(p, kv->cfg.n_layers));
    if (p->kind != KVS_POLICY_FULL && p->window > window_cap(kv))
        return kvs_fail(KVS_ERR_INVALID, "kv_window %d exceeds this server's maximum %d", p->window, window_cap(kv));
    kvs_kv_free_sparsity(kv, s);
    s->policy = *p;
    s->prompt_len = prompt_len;
    s->prefill_done = false; /* kvs_kv_sparsify compacts once n_tokens reaches prompt_len */
    if (p->kind == KVS_POLICY_FULL) return KVS_OK;
    KVS_TRY(alloc_windows(kv));
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

int kvs_kv_window_row(const kvs_kv_cache *kv, int seq_id, int layer, int position) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || !s->budgets || s->budgets[layer] < 0 || s->policy.kind == KVS_POLICY_STREAMINGLLM) return -1;
    int w = s->policy.window, base = seq_id * kv->window_cap;
    if (position < s->prompt_len) return position >= s->prompt_len - w ? base + position - (s->prompt_len - w) : -1;
    return base + (position - s->ring_base[layer]) % w;
}

void kvs_kv_window_buffers(const kvs_kv_cache *kv, int layer, void **q, float **lse) {
    *q = kv->win_q ? kv->win_q[layer] : NULL;
    *lse = kv->win_lse ? kv->win_lse[layer] : NULL;
}

/* The SnapKV scores of (seq, layer)'s entries [0, n - w) from its captured window,
 * into backend scratch (*d_scores [H][n - w]); *d_tab is the layer's table uploaded. */
static kvs_status score_window(kvs_kv_cache *kv, seq_state *s, int layer, float **d_scores, int32_t **d_tab) {
    kvs_backend *be = kv->be;
    int n = s->layers[layer].len, w = s->policy.window, d = kv->cfg.head_dim, nh = kv->cfg.n_heads;
    size_t tab_bytes = sizeof(int32_t) * s->layers[layer].n_blocks;
    *d_tab = kvs_kv_scratch(kv, KVS_KV_SCRATCH_TABLE, tab_bytes);
    *d_scores = kvs_kv_scratch(kv, KVS_KV_SCRATCH_SCORES, sizeof(float) * (size_t)kv->cfg.n_kv_heads * (n - w));
    if (!*d_tab || !*d_scores) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of backend memory");
    size_t row = (size_t)(s - kv->seqs) * kv->window_cap;
    const char *q = (const char *)kv->win_q[layer] + row * nh * d * kvs_dtype_size(be->act_dtype);
    be->to_device(be, *d_tab, s->layers[layer].blocks, tab_bytes);
    kvs_kv_pool pool = kvs_kv_layer_pool(kv, layer);
    be->sparsity_scores(be, *d_scores, q, kv->win_lse[layer] + row * nh, w, &pool, *d_tab, n - w, nh,
                        1.0f / sqrtf((float)d));
    return KVS_OK;
}

/* SnapKV: keep the top (budget - w) of entries [0, n - w) by pooled score, plus the
 * window, and compact. Scores, selection and compaction stay in backend memory:
 * nothing comes back to the host. */
static kvs_status compact_snapkv(kvs_kv_cache *kv, int seq_id, int layer, int budget) {
    seq_state *s = &kv->seqs[seq_id];
    int w = s->policy.window, H = kv->cfg.n_kv_heads;
    float *d_scores;
    int32_t *d_tab, *d_keep = kvs_kv_scratch(kv, KVS_KV_SCRATCH_KEEP, sizeof(int32_t) * (size_t)H * budget);
    if (!d_keep) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of backend memory");
    KVS_TRY(score_window(kv, s, layer, &d_scores, &d_tab));
    kv->be->snapkv_select(kv->be, d_keep, d_scores, s->layers[layer].len - w, H, s->policy.pool, budget - w, w);
    return kvs_kv_compact_uploaded(kv, s, layer, d_keep, d_tab, budget);
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

static kvs_status compress_layer(kvs_kv_cache *kv, int seq_id, int layer) {
    seq_state *s = &kv->seqs[seq_id];
    int budget = s->budgets[layer], H = kv->cfg.n_kv_heads;
    if (s->layers[layer].len <= budget) return KVS_OK;
    kvs_status st;
    if (s->policy.kind == KVS_POLICY_STREAMINGLLM) {
        int32_t *keep = malloc(sizeof(int32_t) * (size_t)H * budget);
        if (!keep) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of memory");
        select_streaming(s, layer, budget, H, keep);
        st = kvs_kv_compact(kv, seq_id, layer, keep, budget);
        free(keep);
    } else {
        st = compact_snapkv(kv, seq_id, layer, budget);
    }
    s->ring_base[layer] = s->n_tokens;
    return st;
}

kvs_status kvs_kv_sparsify(kvs_kv_cache *kv, int seq_id) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    if (!s->budgets || s->n_tokens < s->prompt_len) return KVS_OK;
    bool at_prefill_end = !s->prefill_done;
    s->prefill_done = true;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        int b = s->budgets[l];
        if (b < 0) continue;
        /* after the prefill: compact to B_l; in decode: when the layer reaches B_l + w */
        bool due = at_prefill_end ? s->layers[l].len > b
                                  : s->layers[l].len >= b + s->policy.window &&
                                        s->n_tokens - s->ring_base[l] >= s->policy.window;
        if (due) KVS_TRY(compress_layer(kv, seq_id, l));
    }
    while (s->n_spare > 0) kvs_kv_drop_block(kv, s->spare[--s->n_spare]); /* what the compaction left */
    return KVS_OK;
}

/* A fork shares the cached blocks (the prompt's, which nobody writes again)
 * and copies the others. */
kvs_status kvs_kv_fork(kvs_kv_cache *kv, int seq_id, int *new_seq) {
    seq_state *src = kvs_kv_get_seq(kv, seq_id);
    if (!src) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_id);
    int64_t need = 0;
    for (int l = 0; l < kv->cfg.n_layers; l++)
        for (int i = 0; i < src->layers[l].n_blocks; i++) need += !kv->meta[src->layers[l].blocks[i]].key;
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
            if (kv->meta[from].key) { /* shared */
                kv->meta[from].ref++;
                b->blocks[b->n_blocks++] = from;
                continue;
            }
            int32_t blk = kvs_kv_take_block(kv);
            b->blocks[b->n_blocks++] = blk;
            kv->be->copy(kv->be, (char *)kv->pool.data + (size_t)blk * block_bytes,
                         (char *)kv->pool.data + (size_t)from * block_bytes, block_bytes);
        }
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
