/* A tensor-parallel group: one thread per rank, each owning its backend (one
 * GPU, or a CPU backend in the simulation), its communicator, its slice of the
 * model and its KV cache. The caller's thread hands every rank the same job
 * and waits for all of them; the ranks meet only inside the communicator's
 * collectives. Threads rather than processes: one process sees every GPU, so
 * the scheduler, the tokenizer and the HTTP server stay single copies and a
 * step is a function call, not a message (docs/TP.md). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/comm.h"
#include "model/model_internal.h"

typedef struct kvs_tp_group kvs_tp_group;
typedef kvs_status (*tp_job)(kvs_tp_group *g, int rank, void *arg);

typedef struct {
    kvs_tp_group *g;
    int rank;
    pthread_t thread;
    bool started;
    kvs_backend *be;
    kvs_backend *model_be; /* the model's backend when a caller wraps be (kvs_tp_group_create_cpu_wrapped) */
    kvs_comm *comm;
    kvs_model *model;
    kvs_kv_cache *kv;
    /* the rank's answer to the current job */
    kvs_status status;
    char error[1024];
    int result; /* integer results (sequence ids) */
} tp_rank;

struct kvs_tp_group {
    kvs_config cfg;
    int world;
    tp_rank *ranks;
    bool owns_devices; /* backends and comms made by kvs_tp_group_create_cpu */
    bool borrowed_model; /* kvs_tp_group_wrap: rank 0's model stays the caller's */
    bool inline_rank;    /* world 1: jobs run on the caller's thread, no rank thread */
    bool broken;       /* a rank failed mid-step: the communicators were aborted */
    /* job hand-off: the caller publishes (job, arg) and bumps generation;
       each rank runs it once and counts itself done */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    unsigned long generation;
    int n_done;
    bool quit;
    tp_job job;
    void *arg;
    bool job_collective; /* a failing rank aborts the communicators */
    /* kvs_tp_group_create's inputs for the create job */
    kvs_checkpoint *ck;
    kvs_model_limits limits;
    pthread_mutex_t ck_mu; /* the checkpoint is read by one rank at a time */
    kvs_tp_backend_wrap wrap; /* kvs_tp_group_create_cpu_wrapped */
    void *wrap_user;
};

static void *rank_main(void *p) {
    tp_rank *r = p;
    kvs_tp_group *g = r->g;
    if (r->comm && r->comm->bind_thread) r->comm->bind_thread(r->comm);
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        while (g->generation == seen && !g->quit) pthread_cond_wait(&g->start, &g->mu);
        if (g->quit) {
            pthread_mutex_unlock(&g->mu);
            return NULL;
        }
        seen = g->generation;
        tp_job job = g->job;
        void *arg = g->arg;
        bool collective = g->job_collective;
        pthread_mutex_unlock(&g->mu);

        r->error[0] = 0;
        r->status = job(g, r->rank, arg);
        if (r->status != KVS_OK) {
            snprintf(r->error, sizeof r->error, "%s", kvs_last_error());
            if (collective && r->comm) r->comm->abort(r->comm);
        }
        pthread_mutex_lock(&g->mu);
        if (++g->n_done == g->world) pthread_cond_signal(&g->done);
        pthread_mutex_unlock(&g->mu);
    }
}

static kvs_status run_all(kvs_tp_group *g, tp_job job, void *arg, bool collective);

/* After a failed step: every rank's communicator aborted (the failing rank's
 * already is), so that none is left waiting on or holding a dead peer. */
static kvs_status job_abort_comm(kvs_tp_group *g, int rank, void *arg) {
    if (g->ranks[rank].comm) g->ranks[rank].comm->abort(g->ranks[rank].comm);
    return KVS_OK;
}

/* Runs job on every rank and waits; the first failing rank's error becomes
 * the caller's (its message prefixed with the rank). */
static kvs_status run_all(kvs_tp_group *g, tp_job job, void *arg, bool collective) {
    if (g->broken)
        return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: the group is unusable after a failed step");
    if (g->inline_rank) { /* world 1: no thread hop, no communicator to abort, the error as it is */
        g->ranks[0].status = job(g, 0, arg);
        return g->ranks[0].status;
    }
    pthread_mutex_lock(&g->mu);
    g->job = job;
    g->arg = arg;
    g->job_collective = collective;
    g->n_done = 0;
    g->generation++;
    pthread_cond_broadcast(&g->start);
    while (g->n_done < g->world) pthread_cond_wait(&g->done, &g->mu);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->world; r++) {
        if (g->ranks[r].status == KVS_OK) continue;
        kvs_status st = g->ranks[r].status;
        char msg[sizeof g->ranks[r].error + 64];
        snprintf(msg, sizeof msg, "tensor parallel rank %d of %d: %s", r, g->world, g->ranks[r].error);
        if (collective) {
            run_all(g, job_abort_comm, NULL, false);
            g->broken = true;
        }
        return kvs_fail(st, "%s", msg);
    }
    return KVS_OK;
}

static kvs_status job_create_model(kvs_tp_group *g, int rank, void *arg) {
    tp_rank *r = &g->ranks[rank];
    pthread_mutex_lock(&g->ck_mu);
    kvs_status st = kvs_model_create_shard(&g->cfg, g->ck, r->model_be ? r->model_be : r->be, rank, g->world, r->comm,
                                           &g->limits, &r->model);
    pthread_mutex_unlock(&g->ck_mu);
    return st;
}

static void destroy_rank_state(kvs_tp_group *g, int rank) {
    tp_rank *r = &g->ranks[rank];
    kvs_kv_destroy(r->kv);
    if (!g->borrowed_model) kvs_model_destroy(r->model);
    r->kv = NULL;
    r->model = NULL;
}

static kvs_status job_destroy(kvs_tp_group *g, int rank, void *arg) {
    destroy_rank_state(g, rank);
    return KVS_OK;
}

static kvs_status group_alloc(const kvs_config *cfg, int world, kvs_tp_group **out) {
    kvs_tp_group *g = calloc(1, sizeof *g);
    if (g) g->ranks = calloc((size_t)world, sizeof(tp_rank));
    if (!g || !g->ranks) {
        free(g);
        return kvs_fail(KVS_ERR_NOMEM, "tensor parallel: out of memory");
    }
    g->cfg = *cfg;
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
static kvs_status job_create_cpu_backend(kvs_tp_group *g, int rank, void *arg) {
    tp_rank *r = &g->ranks[rank];
    KVS_TRY(kvs_backend_cpu_create(*(const int *)arg, &r->be));
    if (g->wrap && !(r->model_be = g->wrap(g->wrap_user, rank, r->be)))
        return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: the backend wrapper of rank %d failed", rank);
    return KVS_OK;
}

static kvs_status group_start(kvs_tp_group *g, kvs_checkpoint *ck, const kvs_model_limits *limits, int cpu_threads) {
    for (int r = 0; r < g->world; r++) {
        g->ranks[r].g = g;
        g->ranks[r].rank = r;
        if (g->inline_rank) {
            if (g->ranks[r].comm && g->ranks[r].comm->bind_thread) g->ranks[r].comm->bind_thread(g->ranks[r].comm);
            continue;
        }
        if (pthread_create(&g->ranks[r].thread, NULL, rank_main, &g->ranks[r]) != 0)
            return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: cannot start the thread of rank %d", r);
        g->ranks[r].started = true;
    }
    if (g->owns_devices) KVS_TRY(run_all(g, job_create_cpu_backend, &cpu_threads, false));
    g->ck = ck;
    if (limits) g->limits = *limits;
    kvs_status st = run_all(g, job_create_model, NULL, false);
    g->ck = NULL;
    return st;
}

kvs_status kvs_tp_group_create(const kvs_config *cfg, kvs_checkpoint *ck, int world, kvs_backend **backends,
                               kvs_comm **comms, int n_devices, const kvs_model_limits *limits, kvs_tp_group **out) {
    *out = NULL;
    KVS_TRY(kvs_tp_validate(cfg, world, n_devices));
    for (int r = 0; r < world; r++)
        if (!backends[r] || (world > 1 && (!comms || !comms[r] || comms[r]->rank != r || comms[r]->world != world)))
            return kvs_fail(KVS_ERR_INVALID, "tensor parallel: rank %d of %d lacks a backend or a matching communicator",
                            r, world);
    kvs_tp_group *g;
    KVS_TRY(group_alloc(cfg, world, &g));
    for (int r = 0; r < world; r++) {
        g->ranks[r].be = backends[r];
        g->ranks[r].comm = comms ? comms[r] : NULL;
    }
    kvs_status st = group_start(g, ck, limits, 0);
    if (st != KVS_OK) {
        kvs_tp_group_destroy(g);
        return st;
    }
    *out = g;
    return KVS_OK;
}

kvs_status kvs_tp_group_create_cpu(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                   const kvs_model_limits *limits, kvs_tp_group **out) {
    return kvs_tp_group_create_cpu_wrapped(cfg, ck, world, threads_per_rank, NULL, NULL, limits, out);
}

kvs_status kvs_tp_group_create_cpu_wrapped(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                           kvs_tp_backend_wrap wrap, void *user, const kvs_model_limits *limits,
                                           kvs_tp_group **out) {
    *out = NULL;
    KVS_TRY(kvs_tp_validate(cfg, world, -1));
    kvs_tp_group *g;
    KVS_TRY(group_alloc(cfg, world, &g));
    g->owns_devices = true;
    g->wrap = wrap;
    g->wrap_user = user;
    kvs_comm **comms = calloc((size_t)world, sizeof *comms);
    kvs_status st = comms ? kvs_comm_host_create(world, comms) : kvs_fail(KVS_ERR_NOMEM, "tensor parallel: out of memory");
    for (int r = 0; r < world; r++) g->ranks[r].comm = st == KVS_OK ? comms[r] : NULL;
    free(comms);
    if (st == KVS_OK) st = group_start(g, ck, limits, threads_per_rank);
    if (st != KVS_OK) {
        kvs_tp_group_destroy(g);
        return st;
    }
    *out = g;
    return KVS_OK;
}

kvs_status kvs_tp_group_wrap(kvs_model *model, kvs_tp_group **out) {
    *out = NULL;
    if (!model) return kvs_fail(KVS_ERR_INVALID, "tensor parallel: no model to wrap");
    if (kvs_model_shard(model)->world != 1)
        return kvs_fail(KVS_ERR_INVALID, "tensor parallel: a rank model of %d ranks is no whole model to wrap",
                        kvs_model_shard(model)->world);
    kvs_tp_group *g;
    KVS_TRY(group_alloc(kvs_model_config(model), 1, &g));
    g->borrowed_model = true;
    g->ranks[0].g = g;
    g->ranks[0].be = kvs_model_backend(model);
    g->ranks[0].model = model;
    *out = g;
    return KVS_OK;
}

void kvs_tp_group_destroy(kvs_tp_group *g) {
    if (!g) return;
    bool threads = !g->inline_rank;
    for (int r = 0; r < g->world; r++) threads = threads && g->ranks[r].started;
    if (threads) {
        g->broken = false; /* destroying needs no collective */
        run_all(g, job_destroy, NULL, false);
    } else {
        for (int r = 0; r < g->world; r++) destroy_rank_state(g, r);
    }
    pthread_mutex_lock(&g->mu);
    g->quit = true;
    pthread_cond_broadcast(&g->start);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->world; r++)
        if (g->ranks[r].started) pthread_join(g->ranks[r].thread, NULL);
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

int kvs_tp_world(const kvs_tp_group *g) { return g->world; }
kvs_model *kvs_tp_model(kvs_tp_group *g, int rank) { return rank >= 0 && rank < g->world ? g->ranks[rank].model : NULL; }
kvs_kv_cache *kvs_tp_kv(kvs_tp_group *g, int rank) { return rank >= 0 && rank < g->world ? g->ranks[rank].kv : NULL; }

/* ---- lockstep KV operations -------------------------------------------------- */
static kvs_status job_kv_create(kvs_tp_group *g, int rank, void *arg) {
    tp_rank *r = &g->ranks[rank];
    kvs_kv_config kc = *(const kvs_kv_config *)arg;
    kc.n_kv_heads /= g->world;
    kc.n_heads /= g->world;
    kvs_kv_destroy(r->kv);
    r->kv = NULL;
    return kvs_kv_create(&kc, r->be, &r->kv);
}

kvs_status kvs_tp_kv_create(kvs_tp_group *g, const kvs_kv_config *global) {
    if (global->n_kv_heads % g->world || global->n_heads % g->world)
        return kvs_fail(KVS_ERR_INVALID,
                        "tensor parallel: %d ranks do not divide the KV cache's %d KV heads and %d heads", g->world,
                        global->n_kv_heads, global->n_heads);
    return run_all(g, job_kv_create, (void *)global, false);
}

static kvs_status need_kv(kvs_tp_group *g) {
    return g->ranks[0].kv ? KVS_OK : kvs_fail(KVS_ERR_INVALID, "tensor parallel: no KV caches (kvs_tp_kv_create)");
}

static kvs_status job_seq_create(kvs_tp_group *g, int rank, void *arg) {
    g->ranks[rank].result = kvs_kv_seq_create(g->ranks[rank].kv);
    return g->ranks[rank].result >= 0 ? KVS_OK : KVS_ERR_NOMEM;
}

static kvs_status job_seq_free(kvs_tp_group *g, int rank, void *arg) {
    kvs_kv_free(g->ranks[rank].kv, *(const int *)arg);
    return KVS_OK;
}

int kvs_tp_seq_create(kvs_tp_group *g) {
    for (int r = 0; r < g->world; r++) g->ranks[r].result = -1;
    if (need_kv(g) != KVS_OK || run_all(g, job_seq_create, NULL, false) != KVS_OK) {
        for (int r = 0; r < g->world; r++) /* undo the ranks that got one */
            if (g->ranks[r].kv && g->ranks[r].result >= 0) kvs_kv_free(g->ranks[r].kv, g->ranks[r].result);
        return -1;
    }
    for (int r = 1; r < g->world; r++)
        if (g->ranks[r].result != g->ranks[0].result) {
            kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: rank %d got sequence %d, rank 0 got %d", r,
                     g->ranks[r].result, g->ranks[0].result);
            return -1;
        }
    return g->ranks[0].result;
}

void kvs_tp_seq_free(kvs_tp_group *g, int seq_id) {
    if (need_kv(g) == KVS_OK) run_all(g, job_seq_free, &seq_id, false);
}

typedef struct {
    int seq, n;
    const kvs_kv_policy *p;
} kv_args;

static kvs_status job_set_policy(kvs_tp_group *g, int rank, void *arg) {
    const kv_args *a = arg;
    return kvs_kv_set_policy(g->ranks[rank].kv, a->seq, a->p, a->n);
}

static kvs_status job_reserve(kvs_tp_group *g, int rank, void *arg) {
    const kv_args *a = arg;
    return kvs_kv_reserve(g->ranks[rank].kv, a->seq, a->n);
}

kvs_status kvs_tp_set_policy(kvs_tp_group *g, int seq_id, const kvs_kv_policy *p, int prompt_len) {
    KVS_TRY(need_kv(g));
    kv_args a = {seq_id, prompt_len, p};
    return run_all(g, job_set_policy, &a, false);
}

static kvs_status job_commit(kvs_tp_group *g, int rank, void *arg) {
    const kv_args *a = arg;
    kvs_kv_commit(g->ranks[rank].kv, a->seq, a->n);
    return KVS_OK;
}

static kvs_status job_fork(kvs_tp_group *g, int rank, void *arg) {
    const kv_args *a = arg;
    return kvs_kv_fork(g->ranks[rank].kv, a->seq, &g->ranks[rank].result);
}

static kvs_status job_sparsify(kvs_tp_group *g, int rank, void *arg) {
    const kv_args *a = arg;
    return kvs_kv_sparsify(g->ranks[rank].kv, a->seq);
}

/* Every rank's layer lengths equal rank 0's (same policy, same budgets, same
 * lengths: a difference is a bug, named here rather than later in a step). */
static kvs_status check_lengths_agree(kvs_tp_group *g, int seq_id, const char *what) {
    for (int r = 1; r < g->world; r++)
        for (int l = 0; l < g->cfg.n_layers; l++) {
            int a = kvs_kv_len(g->ranks[0].kv, seq_id, l), b = kvs_kv_len(g->ranks[r].kv, seq_id, l);
            if (a != b)
                return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel %s: sequence %d layer %d holds %d entries on rank %d, %d on rank 0",
                                what, seq_id, l, b, r, a);
        }
    return KVS_OK;
}

void kvs_tp_commit(kvs_tp_group *g, int seq_id, int n_new) {
    if (need_kv(g) != KVS_OK) return;
    kv_args a = {seq_id, n_new, NULL};
    run_all(g, job_commit, &a, false);
}

kvs_status kvs_tp_fork(kvs_tp_group *g, int seq_id, int *new_seq) {
    *new_seq = -1;
    KVS_TRY(need_kv(g));
    for (int r = 0; r < g->world; r++) g->ranks[r].result = -1;
    kv_args a = {seq_id, 0, NULL};
    kvs_status st = run_all(g, job_fork, &a, false);
    for (int r = 1; st == KVS_OK && r < g->world; r++)
        if (g->ranks[r].result != g->ranks[0].result)
            st = kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: rank %d forked sequence %d into %d, rank 0 into %d", r,
                          seq_id, g->ranks[r].result, g->ranks[0].result);
    if (st == KVS_OK) st = check_lengths_agree(g, g->ranks[0].result, "fork");
    if (st != KVS_OK) {
        for (int r = 0; r < g->world; r++) /* undo the ranks that got one */
            if (g->ranks[r].result >= 0) kvs_kv_free(g->ranks[r].kv, g->ranks[r].result);
        return st;
    }
    *new_seq = g->ranks[0].result;
    return KVS_OK;
}

kvs_status kvs_tp_sparsify(kvs_tp_group *g, int seq_id) {
    KVS_TRY(need_kv(g));
    kv_args a = {seq_id, 0, NULL};
    KVS_TRY(run_all(g, job_sparsify, &a, false));
    return check_lengths_agree(g, seq_id, "sparsify");
}

kvs_status kvs_tp_reserve(kvs_tp_group *g, int seq_id, int n_new) {
    KVS_TRY(need_kv(g));
    kv_args a = {seq_id, n_new, NULL};
    kvs_status st = run_all(g, job_reserve, &a, false);
    /* all or nothing on each rank, and the ranks' pools are alike: a split
       answer is a bug, never a full pool */
    if (st != KVS_OK)
        for (int r = 0; r < g->world; r++)
            if (g->ranks[r].status == KVS_OK)
                return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: rank %d reserved what rank 0 could not", r);
    return st;
}

/* ---- steps -------------------------------------------------------------------- */
typedef struct {
    const kvs_batch *b;
    float *logits;
    int32_t *ids;
    const kvs_sample_row *params; /* kvs_tp_forward_sample */
    float *logprobs;
} step_args;

static kvs_status job_forward(kvs_tp_group *g, int rank, void *arg) {
    const step_args *a = arg;
    tp_rank *r = &g->ranks[rank];
    if (a->params)
        return kvs_model_forward_sample(r->model, a->b, r->kv, a->params, rank == 0 ? a->ids : NULL,
                                        rank == 0 ? a->logprobs : NULL);
    if (a->ids) return kvs_model_forward_argmax(r->model, a->b, r->kv, rank == 0 ? a->ids : NULL);
    return kvs_model_forward(r->model, a->b, r->kv, rank == 0 ? a->logits : NULL);
}

static kvs_status step(kvs_tp_group *g, const kvs_batch *b, float *logits, int32_t *ids,
                       const kvs_sample_row *params, float *logprobs) {
    KVS_TRY(need_kv(g));
    /* what can be wrong with the batch is wrong on every rank alike: check it
       here, so that only real failures inside a step abort the group (world 1:
       the forward's own check is enough) */
    if (!g->inline_rank) KVS_TRY(kvs_model_check_batch(g->ranks[0].model, b, g->ranks[0].kv));
    step_args a = {b, logits, ids, params, logprobs};
    return run_all(g, job_forward, &a, true);
}

kvs_status kvs_tp_forward(kvs_tp_group *g, const kvs_batch *b, float *logits) {
    return step(g, b, logits, NULL, NULL, NULL); /* logits NULL: gathered, not copied out */
}

static kvs_status job_synchronize(kvs_tp_group *g, int rank, void *arg) {
    kvs_backend *be = kvs_model_backend(g->ranks[rank].model);
    be->synchronize(be);
    return KVS_OK;
}

void kvs_tp_synchronize(kvs_tp_group *g) { run_all(g, job_synchronize, NULL, false); }

kvs_status kvs_tp_forward_argmax(kvs_tp_group *g, const kvs_batch *b, int32_t *ids) {
    if (!ids) return kvs_fail(KVS_ERR_INVALID, "kvs_tp_forward_argmax: ids is NULL");
    return step(g, b, NULL, ids, NULL, NULL);
}

kvs_status kvs_tp_forward_sample(kvs_tp_group *g, const kvs_batch *b, const kvs_sample_row *params, int32_t *ids,
                                 float *logprobs) {
    if (!ids || !params) return kvs_fail(KVS_ERR_INVALID, "kvs_tp_forward_sample: ids or params is NULL");
    KVS_TRY(kvs_model_check_sample(b, params)); /* here: a bad row must not break the group */
    return step(g, b, NULL, ids, params, logprobs);
}
