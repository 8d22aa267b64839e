/* runner: a step. The model computes, the KV module keeps and compacts, the
 * runner sequences them. The checks run once, on the caller's thread: what can
 * be wrong with the batch is wrong on every rank alike, and must not break the
 * ranks' communicators. Each rank compacts its own KV heads: no communication. */
#include <stdlib.h>

#include "runner/runner_internal.h"

typedef struct {
    const kvs_batch *b;
    float *logits;
    int32_t *ids;
    const kvs_sample_row *params; /* NULL: the logits path */
    const kvs_sample_extras *extras;
    float *logprobs;
} step_args;

static kvs_status keep_step_kv(kvs_kv_cache *kv, const kvs_batch *b) {
    double t0 = kvs_host_clock_start();
    for (int s = 0; s < b->n_seqs; s++) kvs_kv_commit(kv, b->seq_ids[s], b->query_start[s + 1] - b->query_start[s]);
    kvs_status st = kvs_kv_sparsify_seqs(kv, b->seq_ids, b->n_seqs);
    kvs_host_clock_stop(KVS_HOST_KV_POLICY, t0);
    return st;
}

static kvs_status job_step(kvs_runner *g, int rank, void *arg) {
    const step_args *a = arg;
    kvs_rank *r = &g->ranks[rank];
    bool out = rank == 0; /* rank 0 copies the results out */
    kvs_status st = kvs_model_forward_unchecked(r->model, a->b, r->kv, a->params, a->extras, out ? a->ids : NULL,
                                                out ? a->logprobs : NULL, out ? a->logits : NULL);
    /* the KV policy's compactions go after the step's fence: the host plans them
       while the device runs the step, and the device runs them while the host
       prepares the next step. A failed op (ops return nothing, the backend
       records it) fails the step that ran it (the fence's wait), or the next one
       (a fault in the compactions: the next step's wait); a failed step fails
       the engine, whatever the KV policy did in it */
    if (st == KVS_OK) st = keep_step_kv(r->kv, a->b);
    kvs_status end = kvs_model_step_end(r->model);
    return st != KVS_OK ? st : end;
}

static kvs_status step(kvs_runner *g, const kvs_batch *b, float *logits, int32_t *ids, const kvs_sample_row *params,
                       const kvs_sample_extras *x, float *logprobs) {
    KVS_TRY(kvs_runner_need_kv(g));
    if (params) KVS_TRY(kvs_model_check_sample(b, params, x, kvs_runner_config(g)->vocab_size));
    KVS_TRY(kvs_model_check_batch(g->ranks[0].model, b, g->ranks[0].kv));
    step_args a = {b, logits, ids, params, x, logprobs};
    KVS_TRY(kvs_ranks_run(g, job_step, &a, true));
    for (int s = 0; s < b->n_seqs; s++) KVS_TRY(kvs_runner_lengths_agree(g, b->seq_ids[s], "step"));
    return KVS_OK;
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
