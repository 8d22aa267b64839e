/* runner: the ranks' KV caches. Every mutation runs on every rank in lockstep
 * and the ranks' answers are checked to agree; the queries read rank 0's cache,
 * whose block tables every rank shares. */
#include "runner/runner_internal.h"

static kvs_kv_config rank_config(const kvs_runner *g, const kvs_kv_config *global) {
    kvs_kv_config kc = *global;
    kc.n_kv_heads /= g->world;
    kc.n_heads /= g->world;
    return kc;
}

/* Each rank's cache, with the model's sliding-window layers (kv.h). */
static kvs_status job_kv_create(kvs_runner *g, int rank, void *arg) {
    kvs_rank *r = &g->ranks[rank];
    kvs_kv_config kc = rank_config(g, arg);
    kvs_kv_destroy(r->kv);
    r->kv = NULL;
    KVS_TRY(kvs_kv_create(&kc, r->be, &r->kv));
    const kvs_config *mc = kvs_runner_config(g);
    int32_t window[KVS_MAX_LAYERS];
    for (int l = 0; l < mc->n_layers; l++) window[l] = kvs_config_layer_window(mc, l);
    KVS_TRY(kvs_kv_set_windows(r->kv, window));
    /* an FP8 pool takes the checkpoint's k_scale / v_scale of the rank's KV heads */
    return r->model ? kvs_kv_set_scales(r->kv, kvs_model_kv_scales(r->model)) : KVS_OK;
}

kvs_status kvs_runner_kv_create(kvs_runner *g, const kvs_kv_config *global) {
    if (global->n_kv_heads % g->world || global->n_heads % g->world)
        return kvs_fail(KVS_ERR_INVALID,
                        "tensor parallel: %d ranks do not divide the KV cache's %d KV heads and %d heads", g->world,
                        global->n_kv_heads, global->n_heads);
    return kvs_ranks_run(g, job_kv_create, (void *)global, false);
}

int64_t kvs_runner_kv_blocks_for_budget(const kvs_runner *g, const kvs_kv_config *global, size_t budget_bytes) {
    kvs_kv_config kc = rank_config(g, global);
    return kvs_kv_blocks_for_budget(&kc, g->ranks[0].be->kv_dtype, budget_bytes);
}

kvs_status kvs_runner_need_kv(const kvs_runner *g) {
    return g->ranks[0].kv ? KVS_OK : kvs_fail(KVS_ERR_INVALID, "runner: no KV caches (kvs_runner_kv_create)");
}

/* ---- rank 0's answers ------------------------------------------------------- */
const kvs_kv_config *kvs_runner_kv_config(const kvs_runner *g) { return kvs_kv_get_config(g->ranks[0].kv); }
int64_t kvs_runner_free_blocks(const kvs_runner *g) { return kvs_kv_free_blocks(g->ranks[0].kv); }

int64_t kvs_runner_blocks_needed(const kvs_runner *g, int seq_id, int n_new) {
    return kvs_kv_blocks_needed(g->ranks[0].kv, seq_id, n_new);
}

kvs_seq_usage kvs_runner_seq_usage(const kvs_runner *g, int seq_id) {
    const kvs_kv_cache *kv = g->ranks[0].kv;
    kvs_seq_usage u = {0};
    u.blocks_sparse_layers = kvs_kv_seq_sparse_blocks(kv, seq_id);
    kvs_kv_seq_usage(kv, seq_id, &u.held, &u.full);
    return u;
}

void kvs_runner_seq_layers(const kvs_runner *g, int seq_id, int32_t *entries, uint8_t *kind) {
    const kvs_kv_cache *kv = g->ranks[0].kv;
    for (int l = 0; l < kvs_kv_get_config(kv)->n_layers; l++) {
        entries[l] = kvs_kv_len(kv, seq_id, l);
        kind[l] = kvs_kv_layer_sparse(kv, seq_id, l) ? 1 : kvs_kv_layer_window(kv, l) > 0 ? 2 : 0;
    }
}

size_t kvs_runner_kv_entry_bytes(const kvs_runner *g) {
    const kvs_kv_config *c = kvs_kv_get_config(g->ranks[0].kv);
    return kvs_kv_block_bytes(c, g->ranks[0].be->kv_dtype) / (size_t)c->block_size * (size_t)g->world;
}

/* ---- lockstep operations ------------------------------------------------------ */
typedef enum { KV_SEQ_CREATE, KV_SEQ_FREE, KV_SET_POLICY, KV_RESERVE, KV_ATTACH } kv_op;
typedef struct {
    kv_op op;
    int seq, n;
    const kvs_kv_policy *p;
    const int32_t *tokens; /* KV_ATTACH: the prompt (n tokens), its salt, at most max tokens */
    const char *salt;
    int max;
} kv_args;

static kvs_status job_kv(kvs_runner *g, int rank, void *arg) {
    const kv_args *a = arg;
    kvs_rank *r = &g->ranks[rank];
    switch (a->op) {
    case KV_SEQ_CREATE: return (r->result = kvs_kv_seq_create(r->kv)) >= 0 ? KVS_OK : KVS_ERR_NOMEM;
    case KV_SEQ_FREE: kvs_kv_free(r->kv, a->seq); return KVS_OK;
    case KV_SET_POLICY: return kvs_kv_set_policy(r->kv, a->seq, a->p, a->n);
    case KV_RESERVE: return kvs_kv_reserve(r->kv, a->seq, a->n);
    case KV_ATTACH: r->result = kvs_kv_prefix_attach(r->kv, a->seq, a->tokens, a->n, a->salt, a->max); return KVS_OK;
    }
    return KVS_OK;
}

/* op on every rank; result -1 first on every rank (the sequence id of a creation) */
static kvs_status run_kv_args(kvs_runner *g, const kv_args *a) {
    for (int r = 0; r < g->world; r++) g->ranks[r].result = -1;
    KVS_TRY(kvs_runner_need_kv(g));
    return kvs_ranks_run(g, job_kv, (void *)a, false);
}

static kvs_status run_kv(kvs_runner *g, kv_op op, int seq_id, int n, const kvs_kv_policy *p) {
    return run_kv_args(g, &(kv_args){op, seq_id, n, p, NULL, NULL, 0});
}

/* The sequence id every rank got (a creation) in *out, or -1 and an
 * error (the ranks' sequences freed) when a rank failed or the ranks disagree. */
static kvs_status agreed_seq(kvs_runner *g, kvs_status st, const char *what, int seq_id, int *out) {
    *out = -1;
    for (int r = 1; st == KVS_OK && r < g->world; r++)
        if (g->ranks[r].result != g->ranks[0].result)
            st = kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: %s %d gave sequence %d on rank %d, %d on rank 0", what,
                          seq_id, g->ranks[r].result, r, g->ranks[0].result);
    if (st == KVS_OK) st = kvs_runner_lengths_agree(g, g->ranks[0].result, what);
    if (st == KVS_OK) *out = g->ranks[0].result;
    else
        for (int r = 0; r < g->world; r++)
            if (g->ranks[r].kv && g->ranks[r].result >= 0) kvs_kv_free(g->ranks[r].kv, g->ranks[r].result);
    return st;
}

int kvs_runner_seq_create(kvs_runner *g) {
    int seq;
    agreed_seq(g, run_kv(g, KV_SEQ_CREATE, -1, 0, NULL), "creating sequence", -1, &seq);
    return seq;
}

void kvs_runner_seq_free(kvs_runner *g, int seq_id) { run_kv(g, KV_SEQ_FREE, seq_id, 0, NULL); }

kvs_status kvs_runner_set_policy(kvs_runner *g, int seq_id, const kvs_kv_policy *p, int prompt_len) {
    return run_kv(g, KV_SET_POLICY, seq_id, prompt_len, p);
}

kvs_status kvs_runner_prefix_attach(kvs_runner *g, int seq_id, const int32_t *prompt, int n_prompt, const char *salt,
                                    int max_tokens, int *hit) {
    *hit = 0;
    KVS_TRY(run_kv_args(g, &(kv_args){KV_ATTACH, seq_id, n_prompt, NULL, prompt, salt, max_tokens}));
    for (int r = 1; r < g->world; r++) /* the ranks' caches take the same decisions */
        if (g->ranks[r].result != g->ranks[0].result)
            return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: sequence %d reused %d cached tokens on rank %d, %d on rank 0",
                            seq_id, g->ranks[r].result, r, g->ranks[0].result);
    *hit = g->ranks[0].result;
    return kvs_runner_lengths_agree(g, seq_id, "prefix cache");
}

kvs_prefix_cache_stats kvs_runner_prefix_cache_stats(const kvs_runner *g, int full_layers) {
    const kvs_kv_cache *kv = g->ranks[0].kv;
    kvs_prefix_cache_stats s = {.evictable = kvs_kv_evictable_blocks(kv), .evictions = kvs_kv_evictions(kv)};
    for (int l = 0; l < g->cfg.n_layers; l++)
        *(l < full_layers ? &s.cached_full_layers : &s.cached_sparse_layers) += kvs_kv_cached_blocks(kv, l);
    return s;
}

kvs_status kvs_runner_reserve(kvs_runner *g, int seq_id, int n_new) {
    kvs_status st = run_kv(g, KV_RESERVE, seq_id, n_new, NULL);
    /* all or nothing on each rank, and the ranks' pools are alike: a split
       answer is a bug, never a full pool */
    for (int r = 0; st != KVS_OK && g->ranks[0].kv && r < g->world; r++)
        if (g->ranks[r].status == KVS_OK)
            return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: rank %d reserved what rank 0 could not", r);
    return st;
}

kvs_status kvs_runner_lengths_agree(const kvs_runner *g, int seq_id, const char *what) {
    for (int r = 1; r < g->world; r++)
        for (int l = 0; l < g->cfg.n_layers; l++) {
            int a = kvs_kv_len(g->ranks[0].kv, seq_id, l), b = kvs_kv_len(g->ranks[r].kv, seq_id, l);
            if (a != b)
                return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel %s: sequence %d layer %d holds %d entries on rank %d, %d on rank 0",
                                what, seq_id, l, b, r, a);
        }
    return KVS_OK;
}

kvs_status kvs_runner_window_scores(kvs_runner *g, int seq_id, int layer, float *out) {
    if (g->world > 1)
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "window scores: not with tensor parallelism (each of the %d ranks holds a slice of the KV "
                        "heads): run with --tensor-parallel-size 1",
                        g->world);
    KVS_TRY(kvs_runner_need_kv(g));
    return kvs_kv_window_scores(g->ranks[0].kv, seq_id, layer, out); /* world 1 runs on the caller's thread */
}
