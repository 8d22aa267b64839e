/* runner: creating the ranks (their backends in the simulation, their models),
 * destroying them, and the calls that speak for every rank. */
#include <stdlib.h>

#include "runner/runner_internal.h"

static kvs_status job_create_model(kvs_runner *g, int rank, void *arg) {
    kvs_rank *r = &g->ranks[rank];
    pthread_mutex_lock(&g->ck_mu);
    kvs_status st = kvs_model_create_shard(&g->cfg, g->ck, r->model_be ? r->model_be : r->be, rank, g->world, r->comm,
                                           &r->model);
    pthread_mutex_unlock(&g->ck_mu);
    return st == KVS_OK ? kvs_executor_create(r->model, &g->limits, &r->exec) : st;
}

static kvs_status job_destroy(kvs_runner *g, int rank, void *arg) {
    kvs_rank *r = &g->ranks[rank];
    kvs_kv_device_destroy(r->kv_dev);
    kvs_executor_destroy(r->exec);
    if (!g->borrowed_model) kvs_model_destroy(r->model);
    r->kv_dev = NULL;
    r->exec = NULL;
    r->model = NULL;
    return KVS_OK;
}

static kvs_status runner_alloc(const kvs_config *cfg, int world, const kvs_step_limits *limits, kvs_runner **out) {
    kvs_runner *g = calloc(1, sizeof *g);
    if (g) g->ranks = calloc((size_t)world, sizeof(kvs_rank));
    if (!g || !g->ranks) {
        free(g);
        return kvs_fail(KVS_ERR_NOMEM, "runner: out of memory");
    }
    g->cfg = *cfg;
    if (limits) g->limits = *limits;
    g->world = world;
    g->inline_rank = world == 1;
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->ck_mu, NULL);
    pthread_cond_init(&g->start, NULL);
    pthread_cond_init(&g->done, NULL);
    *out = g;
    return KVS_OK;
}

/* The CPU simulation's backends, made in the rank threads so that each
 * backend's OpenMP thread count (omp_set_num_threads) is its rank thread's. */
typedef struct {
    int threads;
    kvs_dtype weight_dtype, kv_dtype;
} cpu_rank_options;

static kvs_status job_create_cpu_backend(kvs_runner *g, int rank, void *arg) {
    kvs_rank *r = &g->ranks[rank];
    const cpu_rank_options *o = arg;
    KVS_TRY(kvs_backend_cpu_create_typed(o->threads, o->weight_dtype, o->kv_dtype, &r->be));
    if (g->wrap && !(r->model_be = g->wrap(g->wrap_user, rank, r->be)))
        return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: the backend wrapper of rank %d failed", rank);
    return KVS_OK;
}

/* After st (the caller's setup), the ranks' threads, backends (simulation) and
 * models; destroys g on failure. */
static kvs_status runner_start(kvs_runner *g, kvs_status st, kvs_checkpoint *ck, cpu_rank_options cpu,
                               kvs_runner **out) {
    if (st == KVS_OK) st = kvs_ranks_start(g);
    if (st == KVS_OK && g->owns_devices) st = kvs_ranks_run(g, job_create_cpu_backend, &cpu, false);
    g->ck = ck;
    if (st == KVS_OK) st = kvs_ranks_run(g, job_create_model, NULL, false);
    g->ck = NULL;
    if (st != KVS_OK) {
        kvs_runner_destroy(g);
        return st;
    }
    *out = g;
    return KVS_OK;
}

kvs_status kvs_runner_create(const kvs_config *cfg, kvs_checkpoint *ck, int world, kvs_backend **backends,
                             kvs_comm **comms, int n_devices, const kvs_step_limits *limits, kvs_runner **out) {
    *out = NULL;
    KVS_TRY(kvs_tp_validate(cfg, world, n_devices));
    for (int r = 0; r < world; r++)
        if (!backends[r] || (world > 1 && (!comms || !comms[r] || comms[r]->rank != r || comms[r]->world != world)))
            return kvs_fail(KVS_ERR_INVALID, "tensor parallel: rank %d of %d lacks a backend or a matching communicator",
                            r, world);
    kvs_runner *g;
    KVS_TRY(runner_alloc(cfg, world, limits, &g));
    for (int r = 0; r < world; r++) {
        g->ranks[r].be = backends[r];
        g->ranks[r].comm = comms ? comms[r] : NULL;
    }
    return runner_start(g, KVS_OK, ck, (cpu_rank_options){0, KVS_F32, KVS_F32}, out);
}

kvs_status kvs_runner_create_cpu(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                 kvs_dtype weight_dtype, kvs_dtype kv_dtype, const kvs_step_limits *limits,
                                 kvs_runner **out) {
    return kvs_runner_create_cpu_wrapped(cfg, ck, world, threads_per_rank, weight_dtype, kv_dtype, NULL, NULL, limits,
                                         out);
}

kvs_status kvs_runner_create_cpu_wrapped(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                         kvs_dtype weight_dtype, kvs_dtype kv_dtype, kvs_runner_backend_wrap wrap, void *user, const kvs_step_limits *limits,
                                         kvs_runner **out) {
    *out = NULL;
    KVS_TRY(kvs_tp_validate(cfg, world, -1));
    kvs_runner *g;
    KVS_TRY(runner_alloc(cfg, world, limits, &g));
    g->owns_devices = true;
    g->wrap = wrap;
    g->wrap_user = user;
    kvs_comm **comms = calloc((size_t)world, sizeof *comms);
    kvs_status st = comms ? kvs_comm_host_create(world, comms) : kvs_fail(KVS_ERR_NOMEM, "runner: out of memory");
    for (int r = 0; r < world; r++) g->ranks[r].comm = st == KVS_OK ? comms[r] : NULL;
    free(comms);
    return runner_start(g, st, ck, (cpu_rank_options){threads_per_rank, weight_dtype, kv_dtype}, out);
}

kvs_status kvs_runner_wrap(kvs_model *model, const kvs_step_limits *limits, kvs_runner **out) {
    *out = NULL;
    if (!model) return kvs_fail(KVS_ERR_INVALID, "runner: no model to wrap");
    if (kvs_model_shard(model)->world != 1)
        return kvs_fail(KVS_ERR_INVALID, "runner: a rank model of %d ranks is no whole model to wrap",
                        kvs_model_shard(model)->world);
    kvs_runner *g;
    KVS_TRY(runner_alloc(kvs_model_config(model), 1, limits, &g));
    g->borrowed_model = true;
    g->ranks[0].be = kvs_model_backend(model);
    g->ranks[0].model = model;
    kvs_status st = kvs_executor_create(model, limits, &g->ranks[0].exec);
    if (st == KVS_OK) *out = g;
    else kvs_runner_destroy(g);
    return st;
}

void kvs_runner_destroy(kvs_runner *g) {
    if (!g) return;
    bool threads = !g->inline_rank;
    for (int r = 0; r < g->world; r++) threads = threads && g->ranks[r].started;
    if (threads) {
        g->broken = false; /* destroying needs no collective */
        kvs_ranks_run(g, job_destroy, NULL, false);
    } else {
        for (int r = 0; r < g->world; r++) job_destroy(g, r, NULL);
    }
    kvs_ranks_stop(g);
    kvs_kv_destroy(g->kv);
    kvs_step_plan_free(&g->plan);
    if (g->owns_devices) {
        for (int r = 0; r < g->world; r++) {
            if (g->ranks[r].comm) g->ranks[r].comm->destroy(g->ranks[r].comm);
            if (g->ranks[r].be) g->ranks[r].be->destroy(g->ranks[r].be);
        }
    }
    pthread_cond_destroy(&g->start);
    pthread_cond_destroy(&g->done);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->ck_mu);
    free(g->ranks);
    free(g);
}

int kvs_runner_world(const kvs_runner *g) { return g->world; }
size_t kvs_runner_weight_bytes_read(const kvs_runner *g) { return kvs_model_weight_bytes_read(g->ranks[0].model); }
kvs_quantization kvs_runner_quantization(const kvs_runner *g) {
    return kvs_model_config(g->ranks[0].model)->quantization;
}
const kvs_config *kvs_runner_config(const kvs_runner *g) { return &g->cfg; }
kvs_model *kvs_runner_model(kvs_runner *g, int rank) { return rank >= 0 && rank < g->world ? g->ranks[rank].model : NULL; }
kvs_executor *kvs_runner_executor(kvs_runner *g, int rank) { return rank >= 0 && rank < g->world ? g->ranks[rank].exec : NULL; }
kvs_kv_device *kvs_runner_kv_device(kvs_runner *g, int rank) {
    return rank >= 0 && rank < g->world ? g->ranks[rank].kv_dev : NULL;
}
kvs_kv_cache *kvs_runner_kv(const kvs_runner *g) { return g->kv; }

void kvs_runner_set_graph_mode(kvs_runner *g, kvs_graph_mode mode) {
    for (int r = 0; r < g->world; r++) kvs_executor_set_graph_mode(g->ranks[r].exec, mode);
}
kvs_step_limits kvs_runner_limits(const kvs_runner *g) { return kvs_executor_limits(g->ranks[0].exec); }

kvs_graph_stats kvs_runner_graph_stats(const kvs_runner *g) { return kvs_executor_graph_stats(g->ranks[0].exec); }
