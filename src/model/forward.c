/* The transformer over one step's batch (prefill chunks and decode tokens
 * together) as backend ops, the same for every backend: embedding; for each
 * layer the attention block, then the MLP block; the final norm and the
 * logits. With tensor parallelism each rank runs its heads and MLP columns and
 * the row-parallel outputs are summed over the ranks. The step's layout, the
 * graphs and the sampling are the runner's executor's (src/runner/). */
#include <math.h>

#include "model/model_internal.h"

/* The sum over the ranks of this rank's partial output (row-parallel O and
 * down projections); nothing without tensor parallelism. */
static kvs_status tp_sum(const kvs_model *m, void *buf, size_t n) {
    return m->comm ? m->comm->all_reduce_sum(m->comm, buf, n, m->be->act_dtype) : KVS_OK;
}

/* fp8: in [n][dim] quantized per row into the step's codes and scales, the
 * input of the GEMMs (matmul_fp8) that follow (add_norm and swiglu quantize
 * their outputs themselves). */
static void quantize_input(const kvs_model *m, kvs_forward_state *s, const void *in, int n, int dim) {
    if (m->cfg.quantization == KVS_QUANT_FP8) m->be->quantize_fp8(m->be, s->xq, s->xs, in, m->be->act_dtype, n, dim);
}

/* out = in @ w^T (+ bias): the backend's matmul, or with fp8 matmul_fp8 on the
 * codes of in that quantize_input, add_norm or swiglu_fp8 left (scale: w's per
 * output row). */
static void linear(const kvs_model *m, kvs_forward_state *s, void *out, const void *in, const void *w,
                   const float *scale, const kvs_ggml_weight *g, const void *bias, int n, int in_dim, int out_dim) {
    kvs_backend *be = m->be;
    if (g->n_parts) { /* ggml blocks: each part's rows into its columns of out */
        size_t row = 0, at = 0, as = kvs_dtype_size(be->act_dtype), ws = kvs_dtype_size(be->weight_dtype);
        for (int p = 0; p < g->n_parts; p++) {
            be->matmul_q(be, (char *)out + row * as, out_dim, in, (const char *)w + at, g->type[p],
                         bias ? (const char *)bias + row * ws : NULL, n, in_dim, (int)g->rows[p]);
            row += (size_t)g->rows[p], at += g->bytes[p];
        }
    } else if (m->cfg.quantization == KVS_QUANT_FP8)
        be->matmul_fp8(be, out, s->xq, s->xs, w, scale, bias, n, in_dim, out_dim);
    else
        be->matmul(be, out, in, w, bias, n, in_dim, out_dim);
}

/* x += tmp, then the norm with weight w: xn (fp8: its codes, in the op) for the GEMM that follows. */
static void add_norm(const kvs_model *m, kvs_forward_state *sb, const void *w, int n) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    if (c->quantization == KVS_QUANT_FP8)
        be->add_rmsnorm_fp8(be, sb->x, sb->xq, sb->xs, sb->tmp, w, n, c->hidden_size, c->rms_norm_eps);
    else
        be->add_rmsnorm(be, sb->x, sb->xn, sb->tmp, w, n, c->hidden_size, c->rms_norm_eps);
}

/* Expects xn = attn_norm(x) (fp8: its codes), made by the previous layer's
 * mlp_block with its residual add; leaves x += attention and xn = mlp_norm(x). */
static kvs_status attention_block(const kvs_model *m, kvs_forward_state *sb, const kvs_layer_weights *w,
                                  const kvs_kv_device *kv, int layer, int n) {
    kvs_backend *be = m->be;
    const kvs_layer_step *ls = &sb->layers[layer];
    const kvs_config *c = &m->cfg;
    int n_heads = m->shard.n_heads, n_kv_heads = m->shard.n_kv_heads; /* this rank's */
    int qd = n_heads * c->head_dim, kd = n_kv_heads * c->head_dim;
    if (layer == 0) {
        be->rmsnorm(be, sb->xn, sb->x, w->attn_norm, n, c->hidden_size, c->rms_norm_eps);
        quantize_input(m, sb, sb->xn, n, c->hidden_size);
    }
    linear(m, sb, sb->qkv, sb->xn, w->w_qkv, w->s_qkv, &w->g_qkv, w->b_qkv, n, c->hidden_size, qd + 2 * kd); /* one GEMM */
    if (w->q_norm) { /* Qwen3: every q head and k head RMS-normalised before RoPE, in the GEMM's rows */
        void *k = (char *)sb->qkv + (size_t)qd * kvs_dtype_size(be->act_dtype);
        be->head_rmsnorm(be, sb->qkv, w->q_norm, n, qd + 2 * kd, n_heads, c->head_dim, c->rms_norm_eps);
        be->head_rmsnorm(be, k, w->k_norm, n, qd + 2 * kd, n_kv_heads, c->head_dim, c->rms_norm_eps);
    }
    const kvs_kv_pool pool = kvs_kv_device_layer_pool(kv, layer); /* FP8: this layer's scales */
    be->rope_kv_write(be, &pool, sb->q, sb->qkv, sb->positions, m->inv_freq, ls->slots, n, n_heads);
    be->attention(be, sb->att, ls->n_cap ? sb->lse : NULL, sb->q, &pool, &ls->attn, n_heads,
                  1.0f / sqrtf((float)c->head_dim));
    if (ls->n_cap) { /* the sparsity window keeps these queries and their log-sum-exp */
        void *win_q;
        float *win_lse;
        kvs_kv_device_window_buffers(kv, layer, &win_q, &win_lse);
        be->window_capture(be, win_q, win_lse, sb->q, sb->lse, ls->cap_src, ls->cap_dst, ls->n_cap, n_heads,
                           c->head_dim);
    }
    quantize_input(m, sb, sb->att, n, qd);
    linear(m, sb, sb->tmp, sb->att, w->wo, w->so, &w->g_o, NULL, n, qd, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel O */
    add_norm(m, sb, w->mlp_norm, n);
    return KVS_OK;
}

/* Expects xn = mlp_norm(x) (fp8: its codes); leaves x += mlp and, when there is
 * a next layer, xn = its attn_norm(x) (the last layer's rows are normed by logits). */
static kvs_status mlp_block(const kvs_model *m, kvs_forward_state *sb, const kvs_layer_weights *w,
                            const kvs_layer_weights *next, int n) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    int inter = m->shard.intermediate; /* this rank's columns */
    linear(m, sb, sb->gate_up, sb->xn, w->w_gate_up, w->s_gate_up, &w->g_gate_up, NULL, n, c->hidden_size, 2 * inter);
    if (c->quantization == KVS_QUANT_FP8) /* act's codes, act not stored */
        be->swiglu_fp8(be, sb->xq, sb->xs, sb->gate_up, n, inter);
    else
        be->swiglu(be, sb->act, sb->gate_up, n, inter);
    linear(m, sb, sb->tmp, sb->act, w->w_down, w->s_down, &w->g_down, NULL, n, inter, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel down */
    if (next)
        add_norm(m, sb, next->attn_norm, n);
    else
        be->add(be, sb->x, sb->tmp, (size_t)n * c->hidden_size);
    return KVS_OK;
}

kvs_status kvs_forward_layers(const kvs_model *m, kvs_forward_state *s, const kvs_kv_device *kv) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    if (m->g_embed.n_parts)
        be->embedding_q(be, s->x, m->embed, m->g_embed.type[0], s->ids, s->n_rows, c->hidden_size);
    else
        be->embedding(be, s->x, m->embed, s->ids, s->n_rows, c->hidden_size);
    for (int l = 0; l < c->n_layers; l++) {
        KVS_TRY(attention_block(m, s, &m->layers[l], kv, l, s->n_rows));
        KVS_TRY(mlp_block(m, s, &m->layers[l], l + 1 < c->n_layers ? &m->layers[l + 1] : NULL, s->n_rows));
    }
    return KVS_OK;
}

void kvs_forward_logits(const kvs_model *m, kvs_forward_state *s, const int32_t *last_rows, int n) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    be->gather_rows(be, s->last, s->x, last_rows, n, c->hidden_size);
    be->rmsnorm(be, s->last, s->last, m->final_norm, n, c->hidden_size, c->rms_norm_eps);
    if (m->g_lm_head.n_parts)
        be->matmul_q(be, s->logits, m->shard.vocab_pad, s->last, m->lm_head, m->g_lm_head.type[0], NULL, n,
                     c->hidden_size, m->shard.vocab_pad);
    else
        be->matmul(be, s->logits, s->last, m->lm_head, NULL, n, c->hidden_size, m->shard.vocab_pad);
}
