/* A rank's executor (executor.h): made for a model and its limits, and the
 * step up to the logits: the layout (step_meta.c), the layers eagerly or as a
 * graph (graphs.c), the rows whose logits are wanted; sample.c gives them out. */
#include <stdlib.h>

#include "runner/runner_internal.h"

kvs_status kvs_executor_create(kvs_model *m, const kvs_step_limits *limits, kvs_executor **out) {
    *out = NULL;
    kvs_executor *x = calloc(1, sizeof *x);
    if (!x) return kvs_fail(KVS_ERR_NOMEM, "executor: out of memory");
    x->m = m;
    x->cfg = kvs_model_config(m);
    x->shard = kvs_model_shard(m);
    x->be = kvs_model_backend(m);
    x->comm = kvs_model_comm(m);
    x->limits = kvs_limits_resolve(x->cfg, limits);
    kvs_status st = kvs_step_buffers_create(x);
    if (st == KVS_OK) *out = x;
    else kvs_executor_destroy(x);
    return st;
}

void kvs_executor_destroy(kvs_executor *x) {
    if (!x) return;
    kvs_graphs_free(x);
    kvs_step_buffers_free(x);
    free(x);
}

kvs_step_limits kvs_executor_limits(const kvs_executor *x) { return x->limits; }

kvs_status kvs_executor_step(kvs_executor *x, const kvs_step_inputs *in, kvs_kv_device *dev, int *n_logits_out) {
    const kvs_batch *b = &in->batch;
    kvs_step_buffers *sb = &x->buf;
    int n_logits = 0;
    for (int s = 0; s < b->n_seqs; s++)
        if (b->wants_logits[s]) sb->h_last_rows[n_logits++] = b->query_start[s + 1] - 1;
    kvs_step_shape sh;
    double t0 = kvs_host_clock_start();
    kvs_status st = in->window_rows_per_seq > 0 ? kvs_kv_device_prepare_windows(dev, in->window_rows_per_seq) : KVS_OK;
    if (st == KVS_OK) st = kvs_step_prepare(x, in, dev, &sh);
    kvs_host_clock_stop(KVS_HOST_METADATA, t0);
    KVS_TRY(st);
    KVS_TRY(kvs_graphs_run(x, dev, &sh));
    if (n_logits > 0) { /* the last row of every sequence that wants them */
        x->be->to_device(x->be, sb->last_rows, sb->h_last_rows, sizeof(int32_t) * n_logits);
        kvs_forward_logits(x->m, &sb->fs, sb->last_rows, n_logits);
    }
    /* the new tokens' K and V are written: the runner commits them and applies
       the KV policy after the step (step.c) */
    *n_logits_out = n_logits;
    return KVS_OK;
}
