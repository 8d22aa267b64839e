/* runner: the rank threads. The caller's thread hands every rank the same job
 * and waits for all of them; the ranks meet only inside the communicator's
 * collectives. Threads rather than processes: one process sees every GPU, so
 * the scheduler, the tokenizer and the HTTP server stay single copies and a
 * step is a function call, not a message (docs/TP.md). */
#include <stdio.h>

#include "runner/runner_internal.h"

static void *rank_main(void *p) {
    kvs_rank *r = p;
    kvs_runner *g = r->g;
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
        kvs_rank_job job = g->job;
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

/* After a failed step: every rank's communicator aborted (the failing rank's
 * already is), so that none is left waiting on or holding a dead peer. */
static kvs_status job_abort_comm(kvs_runner *g, int rank, void *arg) {
    if (g->ranks[rank].comm) g->ranks[rank].comm->abort(g->ranks[rank].comm);
    return KVS_OK;
}

kvs_status kvs_ranks_run(kvs_runner *g, kvs_rank_job job, void *arg, bool collective) {
    if (g->broken) return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: the runner is unusable after a failed step");
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
            kvs_ranks_run(g, job_abort_comm, NULL, false);
            g->broken = true;
        }
        return kvs_fail(st, "%s", msg);
    }
    return KVS_OK;
}

kvs_status kvs_ranks_start(kvs_runner *g) {
    for (int r = 0; r < g->world; r++) {
        kvs_rank *k = &g->ranks[r];
        k->g = g;
        k->rank = r;
        if (g->inline_rank) {
            if (k->comm && k->comm->bind_thread) k->comm->bind_thread(k->comm);
            continue;
        }
        if (pthread_create(&k->thread, NULL, rank_main, k) != 0)
            return kvs_fail(KVS_ERR_INTERNAL, "tensor parallel: cannot start the thread of rank %d", r);
        k->started = true;
    }
    return KVS_OK;
}

void kvs_ranks_stop(kvs_runner *g) {
    pthread_mutex_lock(&g->mu);
    g->quit = true;
    pthread_cond_broadcast(&g->start);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->world; r++)
        if (g->ranks[r].started) pthread_join(g->ranks[r].thread, NULL);
}
