/* The compaction plan (kv.h): a layer keeps some of its entries, moved to its
 * first ones, in place, or into blocks of the sequence's own where its blocks
 * are shared or cached (they stay as they are for their other holders and the
 * cache); then its new length, and the blocks past it go back to the pool.
 * Here the plan's arrays, its jobs with keep lists, and its application to the
 * tables; SnapKV's jobs are sparsify.c's; the devices run the plan (device.c). */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

void kvs_kv_compactions_free(kvs_kv_compactions *plan) {
    free(plan->jobs);
    free(plan->tables);
    free(plan->keep);
    memset(plan, 0, sizeof *plan);
}

/* *buf with room for n more than *len elements of size bytes. */
static bool room(void **buf, size_t *cap, size_t len, size_t n, size_t size) {
    if (len + n <= *cap) return true;
    size_t want = 2 * (len + n) > 64 ? 2 * (len + n) : 64;
    void *p = realloc(*buf, want * size);
    if (!p) return false;
    *buf = p, *cap = want;
    return true;
}

/* A new job of (s, layer) in place, its table before copied into the plan;
 * NULL when out of host memory (the plan unchanged). */
static kvs_kv_compaction *add_job(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer, int kind,
                                  int n_keep) {
    const layer_table *t = &s->layers[layer];
    size_t cap_jobs = (size_t)plan->cap_jobs;
    if (!room((void **)&plan->jobs, &cap_jobs, (size_t)plan->n_jobs, 1, sizeof *plan->jobs) ||
        !room((void **)&plan->tables, &plan->cap_tables, plan->n_tables, (size_t)2 * t->n_blocks, sizeof(int32_t))) {
        plan->cap_jobs = (int)cap_jobs;
        kvs_fail(KVS_ERR_NOMEM, "kv compaction plan: out of host memory");
        return NULL;
    }
    plan->cap_jobs = (int)cap_jobs;
    kvs_kv_compaction *j = &plan->jobs[plan->n_jobs];
    *j = (kvs_kv_compaction){.kind = kind, .seq = (int32_t)(s - kv->seqs), .layer = layer, .n_keep = n_keep,
                             .table = (int32_t)plan->n_tables, .n_blocks = t->n_blocks, .keep = -1};
    memcpy(plan->tables + plan->n_tables, t->blocks, sizeof(int32_t) * t->n_blocks);
    plan->n_tables += t->n_blocks;
    j->dst_table = (int32_t)plan->n_tables;
    return j;
}

/* nb blocks of s's own for a compacted copy (its spare blocks first) at the
 * plan's tables' end; KVS_ERR_NOMEM (none taken) when the pool runs dry. */
static kvs_status take_own_blocks(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int nb) {
    int32_t *own = plan->tables + plan->n_tables;
    int got = 0;
    while (got < nb && s->n_spare > 0) own[got++] = s->spare[--s->n_spare];
    while (got < nb && (own[got] = kvs_block_take(&kv->blocks)) >= 0) got++;
    if (got == nb) {
        plan->n_tables += nb;
        return KVS_OK;
    }
    while (got > 0) kvs_block_drop(&kv->blocks, own[--got]);
    return kvs_fail(KVS_ERR_NOMEM, "kv compact: no free block for a shared layer's compacted copy");
}

/* The job just added gets its copy's blocks when its layer's are shared or cached. */
static kvs_status place(kvs_kv_cache *kv, kvs_kv_compactions *plan, kvs_kv_compaction *j, seq_state *s) {
    if (j->n_keep == 0 || !kvs_kv_table_shared(kv, &s->layers[j->layer])) return KVS_OK;
    int nb = kvs_kv_blocks_for(kv, j->n_keep); /* room: the copy has no more blocks than the table */
    KVS_TRY(take_own_blocks(kv, plan, s, nb));
    j->dst_blocks = nb;
    return KVS_OK;
}

kvs_status kvs_kv_plan_keep(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer, const int32_t *keep,
                            int n_keep, int keep_heads) {
    size_t n = (size_t)keep_heads * n_keep;
    if (!room((void **)&plan->keep, &plan->cap_keep, plan->n_keep, n, sizeof(int32_t)))
        return kvs_fail(KVS_ERR_NOMEM, "kv compaction plan: out of host memory for keep lists");
    kvs_kv_compaction *j = add_job(kv, plan, s, layer, KVS_COMPACT_KEEP, n_keep);
    if (!j) return KVS_ERR_NOMEM;
    j->keep = (int64_t)plan->n_keep, j->keep_heads = keep_heads;
    kvs_status st = place(kv, plan, j, s);
    if (st != KVS_OK) {
        plan->n_tables = (size_t)j->table;
        return st;
    }
    if (n) memcpy(plan->keep + plan->n_keep, keep, sizeof(int32_t) * n); /* an empty plan's keep may be NULL */
    plan->n_keep += n;
    plan->n_jobs++;
    return KVS_OK;
}

kvs_status kvs_kv_plan_snapkv(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer) {
    int w = s->policy.window;
    kvs_kv_compaction *j = add_job(kv, plan, s, layer, KVS_COMPACT_SNAPKV, s->budgets[layer]);
    if (!j) return KVS_ERR_NOMEM;
    j->n_keys = s->layers[layer].len - w, j->n_win = w, j->pool = s->policy.pool;
    j->window_row = (int32_t)(s - kv->seqs) * kvs_kv_window_cap(kv);
    kvs_status st = place(kv, plan, j, s);
    if (st != KVS_OK) {
        plan->n_tables = (size_t)j->table;
        return st;
    }
    plan->n_jobs++;
    return KVS_OK;
}

void kvs_kv_plan_drop(kvs_kv_cache *kv, kvs_kv_compactions *plan) {
    for (int i = plan->n_jobs - 1; i >= 0; i--) {
        const kvs_kv_compaction *j = &plan->jobs[i];
        for (int b = j->dst_blocks - 1; b >= 0; b--) kvs_block_drop(&kv->blocks, plan->tables[j->dst_table + b]);
    }
    kvs_kv_plan_clear(plan);
}

void kvs_kv_plan_apply(kvs_kv_cache *kv, const kvs_kv_compactions *plan) {
    for (int i = 0; i < plan->n_jobs; i++) {
        const kvs_kv_compaction *j = &plan->jobs[i];
        seq_state *s = &kv->seqs[j->seq];
        layer_table *t = &s->layers[j->layer];
        s->n_prompt_blocks = s->n_registered; /* the rest of the prompt is no longer there in full */
        if (j->dst_blocks) { /* the old blocks released, the copy's the table (cap >= the old count >= its) */
            kvs_kv_release_tail(kv, t, 0);
            memcpy(t->blocks, plan->tables + j->dst_table, sizeof(int32_t) * j->dst_blocks);
            t->n_blocks = j->dst_blocks;
            kvs_kv_touch(t);
        } else {
            kvs_kv_release_tail(kv, t, kvs_kv_blocks_for(kv, j->n_keep));
        }
        t->len = j->n_keep;
    }
}
