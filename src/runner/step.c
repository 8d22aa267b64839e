/* runner: a step, two hand-offs to the ranks. The model computes, the KV
 * manager keeps and plans on the caller's thread (plan.c), every rank runs the
 * plan. The checks run once, on the caller's thread: what can be wrong with the
 * batch is wrong on every rank alike, and must not break the ranks'
 * communicators. Each rank compacts its own KV heads: no communication. */
#include <stdlib.h>

#include "runner/runner_internal.h"

/* Where rank 0 puts the step's results. */
typedef struct {
    float *logits;
    int32_t *ids;
    float *logprobs;
} step_results;

/* The step's first hand-off: every rank's tables brought up to date and its
 * forward, ending at the backend's fence without waiting for it (a rank reads
 * the plan alone, never the manager). */
static kvs_status job_forward(kvs_runner *g, int rank, void *arg) {
    const step_results *a = arg;
    const kvs_step_plan *p = &g->plan;
    kvs_rank *r = &g->ranks[rank];
    bool out = rank == 0; /* rank 0 copies the results out */
    KVS_TRY(kvs_kv_device_apply_tables(r->kv_dev, &p->tables));
    return kvs_executor_forward_unchecked(r->exec, &p->in, r->kv_dev, p->sample, p->sample_extras,
                                          out ? a->ids : NULL, out ? a->logprobs : NULL, out ? a->logits : NULL);
}

/* The second: the plan's compactions (when the plan was made), then the fence's wait. */
static kvs_status job_finish(kvs_runner *g, int rank, void *arg) {
    const bool *compact = arg;
    kvs_rank *r = &g->ranks[rank];
    kvs_status st = *compact ? kvs_kv_device_compact(r->kv_dev, &g->plan.compactions) : KVS_OK;
    kvs_status end = kvs_executor_step_end(r->exec);
    return st != KVS_OK ? st : end;
}

/* The step's tokens committed and its compactions planned, on the caller's
 * thread while the devices run the forward. */
static kvs_status keep_step_kv(kvs_runner *g, const kvs_batch *b) {
    double t0 = kvs_host_clock_start();
    for (int s = 0; s < b->n_seqs; s++) kvs_kv_commit(g->kv, b->seq_ids[s], b->query_start[s + 1] - b->query_start[s]);
    kvs_status st = kvs_kv_plan_compactions(g->kv, b->seq_ids, b->n_seqs, &g->plan.compactions);
    kvs_host_clock_stop(KVS_HOST_KV_POLICY, t0);
    return st;
}

/* The KV policy's compactions go after the step's fence: the host plans them
 * while the device runs the step, and the device runs them while the host
 * prepares the next step. A failed op (ops return nothing, the backend records
 * it) fails the step that ran it (the fence's wait), or the next one (a fault
 * in the compactions: the next step's wait); a failed step fails the engine,
 * whatever the KV policy did in it. */
static kvs_status step(kvs_runner *g, const kvs_batch *b, float *logits, int32_t *ids, const kvs_sample_row *params,
                       const kvs_sample_extras *x, float *logprobs) {
    KVS_TRY(kvs_runner_need_kv(g));
    if (params) KVS_TRY(kvs_check_sample(b, params, x, kvs_runner_config(g)->vocab_size));
    double t0 = kvs_host_clock_start();
    kvs_status planned = kvs_step_plan_build(&g->plan, g->kv, b, g->ranks[0].exec, g->ranks[0].kv_dev);
    kvs_host_clock_stop(KVS_HOST_METADATA, t0);
    KVS_TRY(planned);
    g->plan.sample = params, g->plan.sample_extras = x;
    step_results a = {logits, ids, logprobs};
    kvs_status st = kvs_ranks_run(g, job_forward, &a, true);
    bool compact = st == KVS_OK && (st = keep_step_kv(g, b)) == KVS_OK;
    if (g->broken) return st; /* a rank failed in a collective: nothing more runs */
    kvs_status end = kvs_ranks_run(g, job_finish, &compact, true);
    return st != KVS_OK ? st : end;
}

kvs_status kvs_runner_step(kvs_runner *g, const kvs_batch *b, float *logits) {
    return step(g, b, logits, NULL, NULL, NULL, NULL);
}

kvs_status kvs_runner_step_sample(kvs_runner *g, const kvs_batch *b, const kvs_sample_row *params,
                                  const kvs_sample_extras *x, int32_t *ids, float *logprobs) {
    if (!ids || !params) return kvs_fail(KVS_ERR_INVALID, "kvs_runner_step_sample: ids or params is NULL");
    return step(g, b, NULL, ids, params, x, logprobs);
}

/* Greedy is the sample op with temperature 0 in every row (the argmax, ties to
 * the lowest id). */
kvs_status kvs_runner_step_argmax(kvs_runner *g, const kvs_batch *b, int32_t *ids) {
    if (!ids) return kvs_fail(KVS_ERR_INVALID, "kvs_runner_step_argmax: ids is NULL");
    int n = 0;
    for (int s = 0; s < b->n_seqs; s++) n += b->wants_logits[s] ? 1 : 0;
    kvs_sample_row *greedy = malloc(sizeof *greedy * (n ? n : 1));
    if (!greedy) return kvs_fail(KVS_ERR_NOMEM, "runner: out of host memory");
    for (int q = 0; q < n; q++) greedy[q] = (kvs_sample_row){.temperature = 0, .top_p = 1};
    kvs_status st = step(g, b, NULL, ids, greedy, NULL, NULL);
    free(greedy);
    return st;
}
