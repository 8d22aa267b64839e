/* Sparsity on the manager's side: per-sequence policies, the observation
 * window's rows, and which layers are due for compaction after a step (the
 * plan: kv.h; the devices score, select and gather, device.c). */
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
    if (kv->cfg.n_heads <= 0) return kvs_fail(KVS_ERR_INVALID, "kv cache: sparsity needs n_heads in the kv config");
    kv->windows_wanted = true;
    if (kv->own) KVS_TRY(kvs_kv_device_prepare_windows(kv->own, kvs_kv_window_cap(kv)));
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
        if (kvs_kv_layer_sliding_window(kv, l) > 0) s->budgets[l] = -1; /* bounded by its window: never compacted */
    }
    return KVS_OK;
}

/* The window row of `position` in s's layer (-1: none); s has sparsity in the layer. */
static int window_row(const kvs_kv_cache *kv, const seq_state *s, int layer, int position) {
    int w = s->policy.window, base = (int)(s - kv->seqs) * kvs_kv_window_cap(kv);
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

int kvs_kv_window_rows_per_seq(const kvs_kv_cache *kv) { return kvs_kv_window_cap(kv); }
bool kvs_kv_windows_wanted(const kvs_kv_cache *kv) { return kv->windows_wanted; }

/* StreamingLLM: the first `sinks` entries and the most recent ones (one list for every head). */
static kvs_status plan_streaming(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer) {
    int n = s->layers[layer].len, budget = s->budgets[layer], sinks = s->policy.sinks < budget ? s->policy.sinks : budget;
    int32_t *keep = malloc(sizeof(int32_t) * (size_t)(budget ? budget : 1));
    if (!keep) return kvs_fail(KVS_ERR_NOMEM, "kv sparsify: out of memory");
    for (int i = 0; i < sinks; i++) keep[i] = i;
    for (int i = sinks; i < budget; i++) keep[i] = n - budget + i;
    kvs_status st = kvs_kv_plan_keep(kv, plan, s, layer, keep, budget, 1);
    free(keep);
    return st;
}

/* Whether (s, layer) is due: after the prefill, compact to B_l; in decode, when
 * the layer reaches B_l + w (and w decode queries came since the last time). */
static bool due(const seq_state *s, const layer_table *t, int layer, bool at_prefill_end) {
    int b = s->budgets[layer], w = s->policy.window;
    if (b < 0) return false;
    return at_prefill_end ? t->len > b : t->len >= b + w && s->n_tokens - s->ring_base[layer] >= w;
}

kvs_status kvs_kv_plan_compactions(kvs_kv_cache *kv, const int32_t *seq_ids, int n, kvs_kv_compactions *plan) {
    kvs_kv_plan_clear(plan);
    for (int i = 0; i < n; i++)
        if (!kvs_kv_get_seq(kv, seq_ids[i])) return kvs_fail(KVS_ERR_INVALID, "kv cache: no sequence %d", seq_ids[i]);
    kvs_status st = KVS_OK;
    for (int i = 0; i < n && st == KVS_OK; i++) {
        seq_state *s = &kv->seqs[seq_ids[i]];
        if (!s->budgets || s->n_tokens < s->prompt_len) continue;
        bool at_prefill_end = !s->prefill_done;
        s->prefill_done = true;
        for (int l = 0; l < kv->cfg.n_layers && st == KVS_OK; l++) {
            if (!due(s, &s->layers[l], l, at_prefill_end)) continue;
            s->ring_base[l] = s->n_tokens; /* set now: a sequence listed twice finds the layer not due */
            st = s->policy.kind == KVS_POLICY_STREAMINGLLM ? plan_streaming(kv, plan, s, l) : kvs_kv_plan_snapkv(kv, plan, s, l);
        }
        /* what the prompt's compaction left (spare blocks are in no table: no job reads them) */
        while (st == KVS_OK && s->n_spare > 0) kvs_block_drop(&kv->blocks, s->spare[--s->n_spare]);
    }
    if (st != KVS_OK) { /* the step fails: the copies' blocks go back, the tables stay as they were */
        kvs_kv_plan_drop(kv, plan);
        return st;
    }
    kvs_kv_plan_apply(kv, plan);
    return KVS_OK;
}
