/* Creating a model: weights from a checkpoint uploaded into the backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq) {
    int half = cfg->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)(1.0 / pow((double)cfg->rope_theta, (double)(2 * i) / cfg->head_dim));
        if (cfg->rope_type == KVS_ROPE_LINEAR) {
            f /= cfg->rope_factor;
        } else if (cfg->rope_type == KVS_ROPE_LLAMA3) {
            /* Llama 3.1: scale low frequencies by 1/factor, keep high ones, blend between */
            double old_ctx = cfg->rope_original_max_position;
            double low_wavelen = old_ctx / cfg->rope_low_freq_factor;
            double high_wavelen = old_ctx / cfg->rope_high_freq_factor;
            double wavelen = 2 * M_PI / f;
            if (wavelen > low_wavelen) {
                f = f / cfg->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old_ctx / wavelen - cfg->rope_low_freq_factor) /
                                (cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
                f = (float)((1 - smooth) * f / cfg->rope_factor + smooth * f);
            }
        }
        inv_freq[i] = f;
    }
}

static kvs_status upload(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, void **dst,
                         size_t offset_elems, size_t alloc_elems) {
    kvs_host_tensor t;
    KVS_TRY(kvs_checkpoint_read(ck, kind, layer, &t));
    size_t n = (size_t)t.shape[0] * (t.ndim == 2 ? (size_t)t.shape[1] : 1);
    if (!*dst) {
        *dst = m->be->alloc(m->be, (alloc_elems ? alloc_elems : n) * kvs_dtype_size(m->be->weight_dtype));
        if (!*dst) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
    }
    m->be->upload_weight(m->be, (char *)*dst + offset_elems * kvs_dtype_size(m->be->weight_dtype), t.data,
                         t.dtype, n);
    return KVS_OK;
}

static kvs_status upload_layer(kvs_model *m, kvs_checkpoint *ck, int l) {
    const kvs_config *c = &m->cfg;
    kvs_layer_weights *w = &m->layers[l];
    KVS_TRY(upload(m, ck, KVS_W_ATTN_NORM, l, &w->attn_norm, 0, 0));
    KVS_TRY(upload(m, ck, KVS_W_Q, l, &w->wq, 0, 0));
    KVS_TRY(upload(m, ck, KVS_W_K, l, &w->wk, 0, 0));
    KVS_TRY(upload(m, ck, KVS_W_V, l, &w->wv, 0, 0));
    if (c->attention_bias) {
        KVS_TRY(upload(m, ck, KVS_W_Q_BIAS, l, &w->bq, 0, 0));
        KVS_TRY(upload(m, ck, KVS_W_K_BIAS, l, &w->bk, 0, 0));
        KVS_TRY(upload(m, ck, KVS_W_V_BIAS, l, &w->bv, 0, 0));
    }
    KVS_TRY(upload(m, ck, KVS_W_O, l, &w->wo, 0, 0));
    KVS_TRY(upload(m, ck, KVS_W_MLP_NORM, l, &w->mlp_norm, 0, 0));
    size_t gate_elems = (size_t)c->intermediate_size * c->hidden_size;
    KVS_TRY(upload(m, ck, KVS_W_GATE, l, &w->w_gate_up, 0, 2 * gate_elems));
    KVS_TRY(upload(m, ck, KVS_W_UP, l, &w->w_gate_up, gate_elems, 0));
    KVS_TRY(upload(m, ck, KVS_W_DOWN, l, &w->w_down, 0, 0));
    return KVS_OK;
}

kvs_status kvs_model_create(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be, kvs_model **out) {
    *out = NULL;
    kvs_model *m = calloc(1, sizeof *m);
    if (!m) return kvs_fail(KVS_ERR_NOMEM, "model: out of memory");
    m->cfg = *cfg;
    m->be = be;
    m->layers = calloc((size_t)cfg->n_layers, sizeof(kvs_layer_weights));
    kvs_status st = m->layers ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "model: out of memory");
    kvs_progress bar;
    kvs_progress_start(&bar, "loading weights", cfg->n_layers + 2);
    if (st == KVS_OK) st = upload(m, ck, KVS_W_EMBED, -1, &m->embed, 0, 0);
    if (st == KVS_OK) st = upload(m, ck, KVS_W_FINAL_NORM, -1, &m->final_norm, 0, 0);
    if (st == KVS_OK && !cfg->tie_word_embeddings) st = upload(m, ck, KVS_W_LM_HEAD, -1, &m->lm_head, 0, 0);
    if (st == KVS_OK && cfg->tie_word_embeddings) m->lm_head = m->embed;
    kvs_progress_update(&bar, 2);
    for (int l = 0; l < cfg->n_layers && st == KVS_OK; l++) {
        st = upload_layer(m, ck, l);
        kvs_progress_update(&bar, 3 + l);
    }
    kvs_progress_finish(&bar);
    if (st == KVS_OK) {
        float host[1024];
        size_t bytes = sizeof(float) * (size_t)(cfg->head_dim / 2);
        m->inv_freq = be->alloc(be, bytes);
        if (!m->inv_freq || cfg->head_dim / 2 > 1024) {
            st = kvs_fail(KVS_ERR_NOMEM, "model: cannot allocate RoPE tables");
        } else {
            kvs_rope_inv_freq(cfg, host);
            be->to_device(be, m->inv_freq, host, bytes);
        }
    }
    if (st != KVS_OK) {
        kvs_model_destroy(m);
        return st;
    }
    *out = m;
    return KVS_OK;
}

static void free_step_buffers(kvs_backend *be, kvs_step_buffers *b) {
    void *dev[] = {b->x, b->xn, b->q, b->k, b->v, b->att, b->tmp, b->gate_up, b->act, b->last, b->logits,
                   b->ids, b->positions, b->slots, b->q_start, b->kv_len, b->block_tables, b->last_rows,
                   b->lse, b->cap_src, b->cap_dst};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->free(be, dev[i]);
    free(b->h_slots);
    free(b->h_kv_len);
    free(b->h_block_tables);
    free(b->h_last_rows);
    free(b->h_cap_src);
    free(b->h_cap_dst);
    memset(b, 0, sizeof *b);
}

void kvs_model_destroy(kvs_model *m) {
    if (!m) return;
    kvs_backend *be = m->be;
    free_step_buffers(be, &m->buf);
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kvs_layer_weights *w = &m->layers[l];
            void *p[] = {w->attn_norm, w->wq, w->wk, w->wv, w->bq, w->bk, w->bv, w->wo, w->mlp_norm,
                         w->w_gate_up, w->w_down};
            for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
                if (p[i]) be->free(be, p[i]);
        }
        free(m->layers);
    }
    if (m->lm_head && m->lm_head != m->embed) be->free(be, m->lm_head);
    if (m->embed) be->free(be, m->embed);
    if (m->final_norm) be->free(be, m->final_norm);
    if (m->inv_freq) be->free(be, m->inv_freq);
    free(m);
}

const kvs_config *kvs_model_config(const kvs_model *m) { return &m->cfg; }

