/* runner: the KV cache of every rank. One manager (kv.h) on the caller's
 * thread decides for all of them; each rank holds a device of its slice of the
 * KV heads and heads with the same n_blocks (kv_device.h), and runs what a
 * step asks of it (step.c). */
#include "runner/runner_internal.h"

static kvs_kv_config rank_config(const kvs_runner *g, const kvs_kv_config *global) {
    kvs_kv_config kc = *global;
    kc.max_len = kvs_runner_limits(g).max_len; /* the devices' table rows: the models' max_len */
    kc.n_kv_heads /= g->world;
    kc.n_heads /= g->world;
    return kc;
}

/* The rank's device; an FP8 pool takes the checkpoint's k_scale / v_scale of the rank's KV heads. */
static kvs_status job_device_create(kvs_runner *g, int rank, void *arg) {
    kvs_rank *r = &g->ranks[rank];
    kvs_kv_config kc = rank_config(g, arg);
    kvs_kv_device_destroy(r->kv_dev);
    r->kv_dev = NULL;
    KVS_TRY(kvs_kv_device_create(&kc, r->be, &r->kv_dev));
    return r->model ? kvs_kv_device_set_scales(r->kv_dev, kvs_model_kv_scales(r->model)) : KVS_OK;
}

kvs_status kvs_runner_kv_create(kvs_runner *g, const kvs_kv_config *global) {
    if (global->n_kv_heads % g->world || global->n_heads % g->world)
        return kvs_fail(KVS_ERR_INVALID,
                        "tensor parallel: %d ranks do not divide the KV cache's %d KV heads and %d heads", g->world,
                        global->n_kv_heads, global->n_heads);
    kvs_kv_destroy(g->kv);
    g->kv = NULL;
    kvs_kv_config kc = *global;
    kc.max_len = kvs_runner_limits(g).max_len;
    KVS_TRY(kvs_kv_manager_create(&kc, &g->kv));
    /* the model's sliding-window layers (kv.h) */
    int32_t window[KVS_MAX_LAYERS];
    for (int l = 0; l < g->cfg.n_layers; l++) window[l] = kvs_config_layer_sliding_window(&g->cfg, l);
    kvs_status st = kvs_kv_set_sliding_windows(g->kv, window);
    if (st == KVS_OK) st = kvs_ranks_run(g, job_device_create, (void *)global, false);
    if (st != KVS_OK) {
        kvs_kv_destroy(g->kv);
        g->kv = NULL;
    }
    return st;
}

int64_t kvs_runner_kv_blocks_for_budget(const kvs_runner *g, const kvs_kv_config *global, size_t budget_bytes) {
    kvs_kv_config kc = rank_config(g, global);
    return kvs_kv_blocks_for_budget(&kc, g->ranks[0].be->kv_dtype, budget_bytes);
}

kvs_status kvs_runner_need_kv(const kvs_runner *g) {
    return g->kv ? KVS_OK : kvs_fail(KVS_ERR_INVALID, "runner: no KV cache (kvs_runner_kv_create)");
}

size_t kvs_runner_kv_entry_bytes(const kvs_runner *g) {
    const kvs_kv_config *c = kvs_kv_device_config(g->ranks[0].kv_dev);
    return kvs_kv_block_bytes(c, g->ranks[0].be->kv_dtype) / (size_t)c->block_size * (size_t)g->world;
}

typedef struct {
    int seq, layer;
    float *out;
} scores_args;

static kvs_status job_window_scores(kvs_runner *g, int rank, void *arg) {
    const scores_args *a = arg;
    return kvs_kv_device_window_scores(g->ranks[rank].kv_dev, g->kv, a->seq, a->layer, a->out);
}

kvs_status kvs_runner_window_scores(kvs_runner *g, int seq_id, int layer, float *out) {
    if (g->world > 1)
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "window scores: not with tensor parallelism (each of the %d ranks holds a slice of the KV "
                        "heads): run with --tensor-parallel-size 1",
                        g->world);
    KVS_TRY(kvs_runner_need_kv(g));
    return kvs_ranks_run(g, job_window_scores, &(scores_args){seq_id, layer, out}, false);
}
