/* runner: the state its files share, and a rank's model and KV device for
 * the tests that look inside one (nothing outside src/runner includes this). */
#ifndef KVS_RUNNER_INTERNAL_H
#define KVS_RUNNER_INTERNAL_H

#include <pthread.h>

#include "backend/comm.h"
#include "runner/runner.h"

typedef kvs_status (*kvs_rank_job)(kvs_runner *g, int rank, void *arg);

typedef struct {
    kvs_runner *g;
    int rank;
    pthread_t thread;
    bool started;
    kvs_backend *be;
    kvs_backend *model_be; /* the model's backend when a caller wraps be (kvs_runner_create_cpu_wrapped) */
    kvs_comm *comm;
    kvs_model *model;
    kvs_kv_device *kv_dev; /* the rank's memory of the KV cache (kv_device.h) */
    kvs_status status; /* the rank's answer to the current job */
    char error[1024];
} kvs_rank;

struct kvs_runner {
    kvs_config cfg;
    kvs_model_limits limits; /* every rank model's (creation) */
    int world;
    kvs_rank *ranks;
    bool owns_devices;   /* backends and comms made by kvs_runner_create_cpu */
    bool borrowed_model; /* kvs_runner_wrap: rank 0's model stays the caller's */
    bool inline_rank;    /* world 1: jobs run on the caller's thread, no rank thread */
    bool broken;         /* a rank failed mid-step: the communicators were aborted */
    /* job hand-off: the caller publishes (job, arg) and bumps generation;
       each rank runs it once and counts itself done */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    unsigned long generation;
    int n_done;
    bool quit;
    kvs_rank_job job;
    void *arg;
    bool job_collective;
    kvs_checkpoint *ck;    /* while the ranks' models are created */
    pthread_mutex_t ck_mu; /* the checkpoint is read by one rank at a time */
    kvs_runner_backend_wrap wrap;
    void *wrap_user;
    kvs_kv_cache *kv;          /* the one KV manager (kvs_runner_kv_create) */
    kvs_step_plan plan;        /* the step's (plan.c), its arrays reused */
};

/* ranks.c: runs job on every rank and waits; the first failing rank's error
 * becomes the caller's, prefixed with the rank. collective: the job meets in
 * the communicators, so a failing rank aborts them and the runner is broken. */
kvs_status kvs_ranks_run(kvs_runner *g, kvs_rank_job job, void *arg, bool collective);
kvs_status kvs_ranks_start(kvs_runner *g);
void kvs_ranks_stop(kvs_runner *g);

/* kv_devices.c: KVS_ERR_INVALID before kvs_runner_kv_create. */
kvs_status kvs_runner_need_kv(const kvs_runner *g);

/* For the tests: rank's model and KV device (NULL before kvs_runner_kv_create). */
kvs_model *kvs_runner_model(kvs_runner *g, int rank);
kvs_kv_device *kvs_runner_kv_device(kvs_runner *g, int rank);

#endif
