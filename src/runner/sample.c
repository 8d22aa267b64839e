/* What a step gives out: the full logits on the host (kvs_executor_forward; with
 * tensor parallelism every rank's vocabulary slice all-gathered), or ids the
 * backend's sample op draws from the logits in backend memory, one small copy
 * back (kvs_executor_forward_sample; with tensor parallelism through the per-rank
 * parts or the logits gathered on the device). Greedy is the sample op at
 * temperature 0. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runner/runner_internal.h"

/* Ops return nothing; a failed op or a CUDA fault is recorded in the backend:
 * the step that caused a failure reports it. */
static kvs_status step_status(kvs_executor *ex, kvs_status st) {
    kvs_status health = ex->be->check(ex->be);
    return st != KVS_OK ? st : health;
}

static kvs_status forward_logits(kvs_executor *ex, const kvs_step_inputs *in, kvs_kv_device *dev, float *logits) {
    int n_logits;
    KVS_TRY(kvs_executor_step(ex, in, dev, &n_logits));
    if (n_logits == 0) return KVS_OK;
    kvs_backend *be = ex->be;
    kvs_step_buffers *sb = &ex->buf;
    const kvs_shard *sh = ex->shard;
    int V = ex->cfg->vocab_size, vp = sh->vocab_pad;
    if (sh->world == 1) { /* vocab_pad == vocab */
        if (logits) be->to_host_f32(be, logits, sb->fs.logits, (size_t)n_logits * V);
        return KVS_OK;
    }
    /* every rank's slice, then [rank][seq][vp] -> [seq][vocab] without the padding */
    size_t per_rank = (size_t)n_logits * vp;
    KVS_TRY(ex->comm->all_gather(ex->comm, sb->logits_all, sb->fs.logits, per_rank, be->act_dtype));
    if (!logits) return KVS_OK;
    be->to_host_f32(be, sb->h_logits, sb->logits_all, (size_t)sh->world * per_rank);
    for (int r = 0; r < sh->world; r++) {
        int begin = r * vp, count = V - begin < vp ? V - begin : vp;
        for (int s = 0; s < n_logits && count > 0; s++)
            memcpy(logits + (size_t)s * V + begin, sb->h_logits + r * per_rank + (size_t)s * vp,
                   sizeof(float) * count);
    }
    return KVS_OK;
}

kvs_status kvs_executor_forward(kvs_executor *ex, const kvs_step_inputs *in, kvs_kv_device *dev, float *logits) {
    KVS_TRY(kvs_executor_check_inputs(ex, in, dev));
    return step_status(ex, forward_logits(ex, in, dev, logits));
}

/* The extras against the n rows: adjust ranges and ids, mask rows, top_k. */
static kvs_status check_extras(const kvs_sample_extras *x, int n, int vocab) {
    if (x->top_k < 0 || x->top_k > KVS_MAX_TOP_LOGPROBS || (x->top_k > 0 && (!x->top_ids || !x->top_logprobs)))
        return kvs_fail(KVS_ERR_INVALID, "forward_sample: top_k %d (0 .. %d, with outputs)", x->top_k,
                        KVS_MAX_TOP_LOGPROBS);
    if (!x->process) return KVS_OK;
    if (x->n_adjust < 0 || (x->n_adjust > 0 && !x->adjust) || x->n_masks < 0 || x->n_masks > n ||
        (x->n_masks > 0 && !x->masks))
        return kvs_fail(KVS_ERR_INVALID, "forward_sample: bad adjust list or masks");
    for (int q = 0; q < n; q++) {
        const kvs_process_row *p = &x->process[q];
        if (p->adjust_begin < 0 || p->adjust_count < 0 || p->adjust_count > x->n_adjust - p->adjust_begin ||
            p->mask_row < -1 || p->mask_row >= x->n_masks || !(p->repetition > 0) || !isfinite(p->repetition) ||
            !isfinite(p->presence) || !isfinite(p->frequency))
            return kvs_fail(KVS_ERR_INVALID, "forward_sample: row %d: bad processing parameters", q);
        for (int e = p->adjust_begin; e < p->adjust_begin + p->adjust_count; e++)
            if (x->adjust[e].id < 0 || x->adjust[e].id >= vocab || isnan(x->adjust[e].bias) ||
                x->adjust[e].bias == INFINITY)
                return kvs_fail(KVS_ERR_INVALID, "forward_sample: row %d: bad adjust entry (token %d)", q,
                                x->adjust[e].id);
    }
    return KVS_OK;
}

kvs_status kvs_check_sample(const kvs_batch *b, const kvs_sample_row *params, const kvs_sample_extras *x,
                                  int vocab) {
    int n = 0;
    for (int s = 0; s < b->n_seqs; s++) n += b->wants_logits[s] ? 1 : 0;
    if (x) KVS_TRY(check_extras(x, n, vocab));
    for (int s = 0, q = 0; s < b->n_seqs; s++) {
        const kvs_sample_row *p = &params[q];
        if (!b->wants_logits[s]) continue;
        if (!(p->temperature >= 0) || !isfinite(p->temperature) || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) ||
            !(p->min_p >= 0 && p->min_p <= 1))
            return kvs_fail(KVS_ERR_INVALID,
                            "forward_sample: row %d: bad sampling parameters (temperature %g, top_k %d, top_p %g, "
                            "min_p %g)", q, p->temperature, p->top_k, p->top_p, p->min_p);
        if (p->forced && (p->forced_id < 0 || p->forced_id >= vocab))
            return kvs_fail(KVS_ERR_INVALID, "forward_sample: row %d: forced id %d is outside the vocabulary [0, %d)",
                            q, p->forced_id, vocab);
        q++;
    }
    return KVS_OK;
}

/* Tensor parallelism without the logits gather: every rank reduces its
 * vocabulary slice to one kvs_sample_part per row on the device, the ranks
 * all-gather the parts (28 bytes per row and rank), and the ranks that pass
 * ids pick on the host (backend/sample.h: the same ids as the sample op over
 * the whole row, logprobs up to the order of the sum). */
static kvs_status sample_sharded(kvs_executor *ex, int n, const kvs_sample_row *params, int32_t *ids, float *logprobs) {
    kvs_backend *be = ex->be;
    kvs_sample_buffers *s = &ex->sample;
    const kvs_shard *sh = ex->shard;
    s->sharded_steps++;
    be->to_device(be, s->params, params, sizeof(kvs_sample_row) * n);
    be->sample_shard(be, s->parts, ex->buf.fs.logits, n, sh->vocab_pad, sh->vocab_count, sh->vocab_begin, s->params);
    size_t floats = sizeof(kvs_sample_part) / sizeof(float) * (size_t)n; /* the gather copies bytes */
    KVS_TRY(ex->comm->all_gather(ex->comm, s->parts_all, s->parts, floats, KVS_F32));
    if (!ids) return KVS_OK;
    be->to_host_async(be, s->h_parts, s->parts_all, sizeof(kvs_sample_part) * sh->world * n); /* the one copy back */
    s->pending = (kvs_sample_pending){.n = n, .world = sh->world, .parts = true, .ids = ids, .logprobs = logprobs,
                                      .params = params};
    return KVS_OK;
}

/* Whether every row can take sample_sharded: greedy or temperature alone. */
static bool all_shardable(const kvs_sample_row *params, const kvs_sample_extras *x, int n, int vocab) {
    if (x && (x->process || x->top_k > 0)) return false;
    for (int q = 0; q < n; q++)
        if (!kvs_sample_shardable(&params[q], vocab)) return false;
    return true;
}

/* Room for n adjust entries (grown on demand, before the step changes anything). */
static kvs_status reserve_adjust(kvs_executor *ex, int n) {
    kvs_sample_buffers *s = &ex->sample;
    if (n <= s->cap_adjust) return KVS_OK;
    int cap = kvs_grown_capacity(s->cap_adjust, n, 1024);
    void *p = ex->be->alloc(ex->be, sizeof(kvs_logit_adjust) * (size_t)cap);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "forward_sample: out of memory for %d logit adjustments", n);
    if (s->adjust) ex->be->free(ex->be, s->adjust);
    s->adjust = p;
    s->cap_adjust = cap;
    return KVS_OK;
}

/* The extras around the draw on rows [n][ld] (backend memory): processing into
 * the processed rows, the draw, then the raw logits' top logprobs and the
 * chosen ids' logprobs; one copy back. */
static kvs_status sample_rows(kvs_executor *ex, const void *rows, int ld, int n, const kvs_sample_row *params,
                              const kvs_sample_extras *x, int32_t *ids, float *logprobs) {
    kvs_backend *be = ex->be;
    kvs_sample_buffers *s = &ex->sample;
    int V = ex->cfg->vocab_size;
    be->to_device(be, s->params, params, sizeof(kvs_sample_row) * n);
    const void *draw_from = rows;
    int draw_ld = ld;
    if (x && x->process) {
        be->to_device(be, s->process, x->process, sizeof(kvs_process_row) * n);
        if (x->n_adjust > 0) be->to_device(be, s->adjust, x->adjust, sizeof(kvs_logit_adjust) * x->n_adjust);
        if (x->n_masks > 0)
            be->to_device(be, s->masks, x->masks, sizeof(uint32_t) * kvs_sample_mask_words(V) * x->n_masks);
        be->process_logits(be, s->processed, V, rows, ld, n, V, s->process, s->adjust, x->n_masks ? s->masks : NULL);
        draw_from = s->processed, draw_ld = V;
    }
    bool extras_lp = x && (x->process || x->top_k > 0);
    float *lp_dev = (float *)(s->out + n);
    be->sample(be, s->out, logprobs && !extras_lp ? lp_dev : NULL, draw_from, n, draw_ld, V, s->params);
    int k = x ? x->top_k : 0;
    if (extras_lp && (logprobs || k > 0)) {
        int32_t *top_ids = s->top;
        float *top_lp = (float *)(s->top + (size_t)n * k);
        be->top_logprobs(be, lp_dev, k ? top_ids : NULL, k ? top_lp : NULL, rows, n, ld, V, s->out, k);
    }
    if (!ids) return KVS_OK;
    be->to_host_async(be, s->h_out, s->out, sizeof(int32_t) * (logprobs ? 2 : 1) * n); /* the copy back */
    if (k > 0) be->to_host_async(be, s->h_top, s->top, sizeof(int32_t) * 2 * (size_t)n * k);
    s->pending = (kvs_sample_pending){.n = n, .top_k = k, .ids = ids, .logprobs = logprobs,
                                      .top_ids = k ? x->top_ids : NULL, .top_logprobs = k ? x->top_logprobs : NULL};
    return KVS_OK;
}

kvs_status kvs_executor_step_end(kvs_executor *ex) {
    double t0 = kvs_host_clock_start();
    kvs_status st = ex->be->fence_wait(ex->be);
    kvs_host_clock_stop(KVS_HOST_WAIT, t0);
    kvs_sample_buffers *s = &ex->sample;
    kvs_sample_pending *p = &s->pending;
    int n = p->n, k = p->top_k;
    p->n = 0;
    if (st != KVS_OK || n == 0) return st;
    if (p->parts) {
        for (int q = 0; q < n; q++)
            p->ids[q] = kvs_sample_pick(s->h_parts + q, p->world, (size_t)n, &p->params[q],
                                        p->logprobs ? &p->logprobs[q] : NULL);
        return KVS_OK;
    }
    memcpy(p->ids, s->h_out, sizeof(int32_t) * n);
    if (p->logprobs) memcpy(p->logprobs, s->h_out + n, sizeof(float) * n);
    if (k > 0) {
        memcpy(p->top_ids, s->h_top, sizeof(int32_t) * (size_t)n * k);
        memcpy(p->top_logprobs, s->h_top + (size_t)n * k, sizeof(float) * (size_t)n * k);
    }
    return KVS_OK;
}

static kvs_status forward_sample(kvs_executor *ex, const kvs_step_inputs *in, kvs_kv_device *dev,
                                 const kvs_sample_row *params, const kvs_sample_extras *x, int32_t *ids,
                                 float *logprobs) {
    const kvs_shard *sh = ex->shard;
    int world = sh->world;
    /* the ranks choose between the parts and the gather from params alone,
       so that they all run the same collectives: every rank needs them */
    if (!params && (ids || world > 1))
        return kvs_fail(KVS_ERR_INVALID, "forward_sample: rank %d of %d has no sampling parameters", sh->rank, world);
    if (x && x->process && ids) KVS_TRY(reserve_adjust(ex, x->n_adjust)); /* only the rank that samples uploads them */
    int n;
    KVS_TRY(kvs_executor_step(ex, in, dev, &n));
    if (n == 0) return KVS_OK;
    if (world > 1 && all_shardable(params, x, n, ex->cfg->vocab_size)) return sample_sharded(ex, n, params, ids, logprobs);
    kvs_backend *be = ex->be;
    kvs_sample_buffers *s = &ex->sample;
    const void *rows = ex->buf.fs.logits;
    int ld = sh->vocab_pad;
    if (world > 1) { /* every rank's slice, then [rank][seq][vp] -> [seq][rank][vp] on the device */
        KVS_TRY(ex->comm->all_gather(ex->comm, ex->buf.logits_all, ex->buf.fs.logits, (size_t)n * ld, be->act_dtype));
        if (!ids) return KVS_OK;
        for (int q = 0; q < n; q++)
            for (int r = 0; r < world; r++) s->h_order[q * world + r] = r * n + q;
        be->to_device(be, s->order, s->h_order, sizeof(int32_t) * world * n);
        be->gather_rows(be, s->rows, ex->buf.logits_all, s->order, world * n, ld);
        rows = s->rows;
        ld *= world; /* column c is token c: rank r's slice starts at r * vocab_pad */
    }
    if (!ids) return KVS_OK;
    return sample_rows(ex, rows, ld, n, params, x, ids, logprobs);
}

kvs_status kvs_executor_forward_sample(kvs_executor *ex, const kvs_step_inputs *in, kvs_kv_device *dev,
                                    const kvs_sample_row *params, const kvs_sample_extras *x, int32_t *ids,
                                    float *logprobs) {
    KVS_TRY(kvs_executor_check_inputs(ex, in, dev));
    if (params) KVS_TRY(kvs_check_sample(&in->batch, params, x, ex->cfg->vocab_size)); /* before the step: a bad row changes nothing */
    kvs_status st = forward_sample(ex, in, dev, params, x, ids, logprobs);
    ex->be->fence(ex->be);
    kvs_status end = kvs_executor_step_end(ex);
    return step_status(ex, st != KVS_OK ? st : end);
}

kvs_status kvs_executor_forward_unchecked(kvs_executor *ex, const kvs_step_inputs *in, kvs_kv_device *dev,
                                       const kvs_sample_row *params, const kvs_sample_extras *x, int32_t *ids,
                                       float *logprobs, float *logits) {
    kvs_status st = params ? forward_sample(ex, in, dev, params, x, ids, logprobs) : forward_logits(ex, in, dev, logits);
    ex->be->fence(ex->be);
    return st;
}
