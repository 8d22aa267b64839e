/* The transformer over one step's batch (prefill chunks and decode tokens
 * together) as backend ops, the same for every backend: embedding; for each
 * layer the attention block, then the MLP block; the final norm and the
 * logits. With tensor parallelism each rank runs its heads and MLP columns and
 * the row-parallel outputs are summed over the ranks. Beside it: step_meta.c
 * (the batch's metadata), graphs.c, logits.c (full logits, sampled ids). */
#include <math.h>

#include "model/model_internal.h"

/* The sum over the ranks of this rank's partial output (row-parallel O and
 * down projections); nothing without tensor parallelism. */
static kvs_status tp_sum(kvs_model *m, void *buf, size_t n) {
    return m->comm ? m->comm->all_reduce_sum(m->comm, buf, n, m->be->act_dtype) : KVS_OK;
}

/* fp8: in [n][dim] quantized per row into the step's codes and scales, the
 * input of the GEMMs (matmul_fp8) that follow (add_norm and swiglu quantize
 * their outputs themselves). */
static void quantize_input(kvs_model *m, const void *in, int n, int dim) {
    if (m->cfg.quantization == KVS_QUANT_FP8)
        m->be->quantize_fp8(m->be, m->buf.xq, m->buf.xs, in, m->be->act_dtype, n, dim);
}

/* out = in @ w^T (+ bias): the backend's matmul, or with fp8 matmul_fp8 on the
 * codes of in that quantize_input, add_norm or swiglu_fp8 left (scale: w's per
 * output row). */
static void linear(kvs_model *m, void *out, const void *in, const void *w, const float *scale, const void *bias,
                   int n, int in_dim, int out_dim) {
    kvs_backend *be = m->be;
    if (m->cfg.quantization == KVS_QUANT_FP8)
        be->matmul_fp8(be, out, m->buf.xq, m->buf.xs, w, scale, bias, n, in_dim, out_dim);
    else
        be->matmul(be, out, in, w, bias, n, in_dim, out_dim);
}

/* x += tmp, then the norm with weight w: xn (fp8: its codes, in the op) for the GEMM that follows. */
static void add_norm(kvs_model *m, const void *w, int n) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    if (c->quantization == KVS_QUANT_FP8)
        be->add_rmsnorm_fp8(be, sb->x, sb->xq, sb->xs, sb->tmp, w, n, c->hidden_size, c->rms_norm_eps);
    else
        be->add_rmsnorm(be, sb->x, sb->xn, sb->tmp, w, n, c->hidden_size, c->rms_norm_eps);
}

/* Expects xn = attn_norm(x) (fp8: its codes), made by the previous layer's
 * mlp_block with its residual add; leaves x += attention and xn = mlp_norm(x). */
static kvs_status attention_block(kvs_model *m, const kvs_layer_weights *w, const kvs_kv_device *kv, int layer,
                                  const kvs_attn_batch *ab, int n, int n_cap) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int n_heads = m->shard.n_heads, n_kv_heads = m->shard.n_kv_heads; /* this rank's */
    int qd = n_heads * c->head_dim, kd = n_kv_heads * c->head_dim;
    if (layer == 0) {
        be->rmsnorm(be, sb->xn, sb->x, w->attn_norm, n, c->hidden_size, c->rms_norm_eps);
        quantize_input(m, sb->xn, n, c->hidden_size);
    }
    linear(m, sb->qkv, sb->xn, w->w_qkv, w->s_qkv, w->b_qkv, n, c->hidden_size, qd + 2 * kd); /* one GEMM */
    if (w->q_norm) { /* Qwen3: every q head and k head RMS-normalised before RoPE, in the GEMM's rows */
        void *k = (char *)sb->qkv + (size_t)qd * kvs_dtype_size(be->act_dtype);
        be->head_rmsnorm(be, sb->qkv, w->q_norm, n, qd + 2 * kd, n_heads, c->head_dim, c->rms_norm_eps);
        be->head_rmsnorm(be, k, w->k_norm, n, qd + 2 * kd, n_kv_heads, c->head_dim, c->rms_norm_eps);
    }
    const kvs_kv_pool pool = kvs_kv_device_layer_pool(kv, layer); /* FP8: this layer's scales */
    be->rope_kv_write(be, &pool, sb->q, sb->qkv, sb->positions, m->inv_freq, sb->slots, n, n_heads);
    be->attention(be, sb->att, n_cap ? sb->lse : NULL, sb->q, &pool, ab, n_heads, 1.0f / sqrtf((float)c->head_dim));
    if (n_cap) { /* the sparsity window keeps these queries and their log-sum-exp */
        void *win_q;
        float *win_lse;
        kvs_kv_device_window_buffers(kv, layer, &win_q, &win_lse);
        be->window_capture(be, win_q, win_lse, sb->q, sb->lse, sb->cap_src, sb->cap_dst, n_cap, n_heads,
                           c->head_dim);
    }
    quantize_input(m, sb->att, n, qd);
    linear(m, sb->tmp, sb->att, w->wo, w->so, NULL, n, qd, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel O */
    add_norm(m, w->mlp_norm, n);
    return KVS_OK;
}

/* Expects xn = mlp_norm(x) (fp8: its codes); leaves x += mlp and, when there is
 * a next layer, xn = its attn_norm(x) (the last layer's rows are normed by logits). */
static kvs_status mlp_block(kvs_model *m, const kvs_layer_weights *w, const kvs_layer_weights *next, int n) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int inter = m->shard.intermediate; /* this rank's columns */
    linear(m, sb->gate_up, sb->xn, w->w_gate_up, w->s_gate_up, NULL, n, c->hidden_size, 2 * inter);
    if (c->quantization == KVS_QUANT_FP8) /* act's codes, act not stored */
        be->swiglu_fp8(be, sb->xq, sb->xs, sb->gate_up, n, inter);
    else
        be->swiglu(be, sb->act, sb->gate_up, n, inter);
    linear(m, sb->tmp, sb->act, w->w_down, w->s_down, NULL, n, inter, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel down */
    if (next)
        add_norm(m, next->attn_norm, n);
    else
        be->add(be, sb->x, sb->tmp, (size_t)n * c->hidden_size);
    return KVS_OK;
}

/* The embedding, then every layer: what a decode step's CUDA graph holds. */
kvs_status kvs_forward_layers(kvs_model *m, const kvs_kv_device *kv, const kvs_step_shape *sh) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    be->embedding(be, m->buf.x, m->embed, m->buf.ids, sh->n_rows, c->hidden_size);
    for (int l = 0; l < c->n_layers; l++) {
        kvs_attn_batch ab;
        int n_cap = kvs_step_layer(m, kv, l, sh, &ab);
        KVS_TRY(attention_block(m, &m->layers[l], kv, l, &ab, sh->n_rows, n_cap));
        KVS_TRY(mlp_block(m, &m->layers[l], l + 1 < c->n_layers ? &m->layers[l + 1] : NULL, sh->n_rows));
    }
    return KVS_OK;
}

/* The final norm and this rank's vocab slice of the logits, for the last row
 * of every sequence that wants them. */
static void logits(kvs_model *m, const kvs_batch *b, int n_logits) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int k = 0;
    for (int s = 0; s < b->n_seqs; s++)
        if (b->wants_logits[s]) sb->h_last_rows[k++] = b->query_start[s + 1] - 1;
    be->to_device(be, sb->last_rows, sb->h_last_rows, sizeof(int32_t) * n_logits);
    be->gather_rows(be, sb->last, sb->x, sb->last_rows, n_logits, c->hidden_size);
    be->rmsnorm(be, sb->last, sb->last, m->final_norm, n_logits, c->hidden_size, c->rms_norm_eps);
    be->matmul(be, sb->logits, sb->last, m->lm_head, NULL, n_logits, c->hidden_size, m->shard.vocab_pad);
}

kvs_status kvs_forward_step(kvs_model *m, const kvs_step_inputs *in, kvs_kv_device *dev, int *n_logits_out) {
    const kvs_batch *b = &in->batch;
    int n_logits = 0;
    for (int s = 0; s < b->n_seqs; s++) n_logits += b->wants_logits[s] ? 1 : 0;
    kvs_step_shape sh;
    double t0 = kvs_host_clock_start();
    kvs_status st = in->window_rows_per_seq > 0 ? kvs_kv_device_prepare_windows(dev, in->window_rows_per_seq) : KVS_OK;
    if (st == KVS_OK) st = kvs_step_prepare(m, in, dev, &sh);
    kvs_host_clock_stop(KVS_HOST_METADATA, t0);
    KVS_TRY(st);
    KVS_TRY(kvs_graphs_run(m, dev, &sh));
    if (n_logits > 0) logits(m, b, n_logits);
    /* the new tokens' K and V are written: the runner commits them and applies
       the KV policy after the step (src/runner/step.c) */
    *n_logits_out = n_logits;
    return KVS_OK;
}
