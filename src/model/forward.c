/* The forward pass over a batch of sequences (varlen prefill chunks and decode
 * tokens in one step), as a sequence of backend ops. Same code for every backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"


static kvs_status grow(kvs_backend *be, void **p, size_t bytes) {
    if (*p) be->free(be, *p);
    *p = be->alloc(be, bytes ? bytes : 16);
    return *p ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "forward: out of backend memory (%zu bytes)", bytes);
}

static kvs_status grow_host(int32_t **p, size_t n) {
    free(*p);
    *p = malloc(sizeof(int32_t) * (n ? n : 1));
    return *p ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
}

/* Makes the step buffers large enough for this batch. */
static kvs_status ensure_buffers(kvs_model *m, int n_tokens, int n_seqs, int max_blocks, int n_logits) {
    kvs_step_buffers *b = &m->buf;
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    size_t a = kvs_dtype_size(be->act_dtype);
    if (n_tokens > b->cap_tokens) {
        size_t n = (size_t)n_tokens;
        size_t qd = (size_t)c->n_heads * c->head_dim, kd = (size_t)c->n_kv_heads * c->head_dim;
        size_t wide = (size_t)c->intermediate_size > qd ? (size_t)c->intermediate_size : qd;
        if (wide < (size_t)c->hidden_size) wide = c->hidden_size;
        KVS_TRY(grow(be, &b->x, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->xn, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->q, n * qd * a));
        KVS_TRY(grow(be, &b->k, n * kd * a));
        KVS_TRY(grow(be, &b->v, n * kd * a));
        KVS_TRY(grow(be, &b->att, n * qd * a));
        KVS_TRY(grow(be, &b->tmp, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->gate_up, n * 2 * c->intermediate_size * a));
        KVS_TRY(grow(be, &b->act, n * wide * a));
        KVS_TRY(grow(be, (void **)&b->ids, n * 4));
        KVS_TRY(grow(be, (void **)&b->positions, n * 4));
        KVS_TRY(grow(be, (void **)&b->slots, n * 4));
        KVS_TRY(grow(be, (void **)&b->lse, n * c->n_heads * sizeof(float)));
        KVS_TRY(grow(be, (void **)&b->cap_src, n * 4));
        KVS_TRY(grow(be, (void **)&b->cap_dst, n * 4));
        KVS_TRY(grow_host(&b->h_slots, n));
        KVS_TRY(grow_host(&b->h_cap_src, n));
        KVS_TRY(grow_host(&b->h_cap_dst, n));
        b->cap_tokens = n_tokens;
    }
    if (n_seqs > b->cap_seqs || max_blocks > b->cap_blocks) {
        int s = n_seqs > b->cap_seqs ? n_seqs : b->cap_seqs, mb = max_blocks > b->cap_blocks ? max_blocks : b->cap_blocks;
        KVS_TRY(grow(be, (void **)&b->q_start, (size_t)(s + 1) * 4));
        KVS_TRY(grow(be, (void **)&b->kv_len, (size_t)s * 4));
        KVS_TRY(grow(be, (void **)&b->block_tables, (size_t)s * mb * 4));
        KVS_TRY(grow_host(&b->h_kv_len, (size_t)s));
        KVS_TRY(grow_host(&b->h_block_tables, (size_t)s * mb));
        b->cap_seqs = s;
        b->cap_blocks = mb;
    }
    if (n_logits > b->cap_logits) {
        KVS_TRY(grow(be, &b->last, (size_t)n_logits * c->hidden_size * a));
        KVS_TRY(grow(be, &b->logits, (size_t)n_logits * c->vocab_size * a));
        KVS_TRY(grow(be, (void **)&b->last_rows, (size_t)n_logits * 4));
        KVS_TRY(grow_host(&b->h_last_rows, (size_t)n_logits));
        b->cap_logits = n_logits;
    }
    return KVS_OK;
}

static kvs_status check_batch(const kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->query_start[0] != 0 || b->query_start[b->n_seqs] != b->n_tokens)
        return kvs_fail(KVS_ERR_INVALID, "forward: malformed batch (%d tokens, %d sequences)", b->n_tokens,
                        b->n_seqs);
    const kvs_kv_config *kc = kvs_kv_get_config(kv);
    for (int s = 0; s < b->n_seqs; s++) {
        int q_len = b->query_start[s + 1] - b->query_start[s];
        if (q_len <= 0) return kvs_fail(KVS_ERR_INVALID, "forward: sequence %d has no tokens", s);
        for (int l = 0; l < m->cfg.n_layers; l++) {
            int nb;
            kvs_kv_blocks(kv, b->seq_ids[s], l, &nb);
            if ((int64_t)nb * kc->block_size < kvs_kv_len(kv, b->seq_ids[s], l) + q_len)
                return kvs_fail(KVS_ERR_INVALID, "forward: sequence %d has no KV room reserved", b->seq_ids[s]);
        }
    }
    for (int i = 0; i < b->n_tokens; i++)
        if (b->token_ids[i] < 0 || b->token_ids[i] >= m->cfg.vocab_size)
            return kvs_fail(KVS_ERR_INVALID, "forward: token id %d out of range [0, %d)", b->token_ids[i],
                            m->cfg.vocab_size);
    return KVS_OK;
}

/* Fills this layer's slots, lengths, block tables and window-capture rows and
 * uploads them; returns how many tokens' queries the sparsity window captures. */
static int layer_metadata(kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv, int layer, int max_blocks,
                          kvs_attn_batch *ab) {
    kvs_step_buffers *sb = &m->buf;
    kvs_backend *be = m->be;
    int max_kv = 0, max_q = 0, n_cap = 0;
    memset(sb->h_block_tables, 0, sizeof(int32_t) * (size_t)b->n_seqs * max_blocks);
    for (int s = 0; s < b->n_seqs; s++) {
        int seq = b->seq_ids[s], q0 = b->query_start[s], q_len = b->query_start[s + 1] - q0;
        int len = kvs_kv_len(kv, seq, layer), nb;
        const int32_t *blocks = kvs_kv_blocks(kv, seq, layer, &nb);
        memcpy(sb->h_block_tables + (size_t)s * max_blocks, blocks, sizeof(int32_t) * nb);
        for (int i = 0; i < q_len; i++) {
            sb->h_slots[q0 + i] = kvs_kv_slot(kv, seq, layer, len + i);
            int row = kvs_kv_window_row(kv, seq, layer, b->positions[q0 + i]);
            if (row >= 0) {
                sb->h_cap_src[n_cap] = q0 + i;
                sb->h_cap_dst[n_cap++] = row;
            }
        }
        sb->h_kv_len[s] = len + q_len;
        if (len + q_len > max_kv) max_kv = len + q_len;
        if (q_len > max_q) max_q = q_len;
    }
    be->to_device(be, sb->slots, sb->h_slots, sizeof(int32_t) * b->n_tokens);
    be->to_device(be, sb->kv_len, sb->h_kv_len, sizeof(int32_t) * b->n_seqs);
    be->to_device(be, sb->block_tables, sb->h_block_tables, sizeof(int32_t) * (size_t)b->n_seqs * max_blocks);
    if (n_cap) {
        be->to_device(be, sb->cap_src, sb->h_cap_src, sizeof(int32_t) * n_cap);
        be->to_device(be, sb->cap_dst, sb->h_cap_dst, sizeof(int32_t) * n_cap);
    }
    *ab = (kvs_attn_batch){b->n_seqs, b->n_tokens, max_blocks, max_q, max_kv, sb->q_start, sb->kv_len,
                           sb->block_tables};
    return n_cap;
}

static void attention_block(kvs_model *m, const kvs_layer_weights *w, const kvs_kv_cache *kv, int layer,
                            const kvs_attn_batch *ab, int n, int n_cap) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    be->rmsnorm(be, sb->xn, sb->x, w->attn_norm, n, c->hidden_size, c->rms_norm_eps);
    be->matmul(be, sb->q, sb->xn, w->wq, w->bq, n, c->hidden_size, qd);
    be->matmul(be, sb->k, sb->xn, w->wk, w->bk, n, c->hidden_size, kd);
    be->matmul(be, sb->v, sb->xn, w->wv, w->bv, n, c->hidden_size, kd);
    be->rope(be, sb->q, sb->positions, m->inv_freq, n, c->n_heads, c->head_dim);
    be->rope(be, sb->k, sb->positions, m->inv_freq, n, c->n_kv_heads, c->head_dim);
    const kvs_kv_pool *pool = kvs_kv_get_pool(kv);
    be->kv_write(be, pool, sb->k, sb->v, sb->slots, n);
    be->attention(be, sb->att, n_cap ? sb->lse : NULL, sb->q, pool, ab, c->n_heads, 1.0f / sqrtf((float)c->head_dim));
    if (n_cap) { /* the sparsity window keeps these queries and their log-sum-exp */
        void *win_q;
        float *win_lse;
        kvs_kv_window_buffers(kv, layer, &win_q, &win_lse);
        be->window_capture(be, win_q, win_lse, sb->q, sb->lse, sb->cap_src, sb->cap_dst, n_cap, c->n_heads,
                           c->head_dim);
    }
    be->matmul(be, sb->tmp, sb->att, w->wo, NULL, n, qd, c->hidden_size);
    be->add(be, sb->x, sb->tmp, (size_t)n * c->hidden_size);
}

static void mlp_block(kvs_model *m, const kvs_layer_weights *w, int n) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    be->rmsnorm(be, sb->xn, sb->x, w->mlp_norm, n, c->hidden_size, c->rms_norm_eps);
    be->matmul(be, sb->gate_up, sb->xn, w->w_gate_up, NULL, n, c->hidden_size, 2 * c->intermediate_size);
    be->swiglu(be, sb->act, sb->gate_up, n, c->intermediate_size);
    be->matmul(be, sb->tmp, sb->act, w->w_down, NULL, n, c->intermediate_size, c->hidden_size);
    be->add(be, sb->x, sb->tmp, (size_t)n * c->hidden_size);
}

static void final_logits(kvs_model *m, const kvs_batch *b, int n_logits, float *logits);

kvs_status kvs_model_forward(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, float *logits) {
    KVS_TRY(check_batch(m, b, kv));
    const kvs_config *c = &m->cfg;
    kvs_backend *be = m->be;
    int n = b->n_tokens, n_logits = 0, max_blocks = 1;
    for (int s = 0; s < b->n_seqs; s++) {
        n_logits += b->wants_logits[s] ? 1 : 0;
        for (int l = 0; l < c->n_layers; l++) {
            int nb;
            kvs_kv_blocks(kv, b->seq_ids[s], l, &nb);
            if (nb > max_blocks) max_blocks = nb;
        }
    }
    KVS_TRY(ensure_buffers(m, n, b->n_seqs, max_blocks, n_logits));
    kvs_step_buffers *sb = &m->buf;
    be->to_device(be, sb->ids, b->token_ids, sizeof(int32_t) * n);
    be->to_device(be, sb->positions, b->positions, sizeof(int32_t) * n);
    be->to_device(be, sb->q_start, b->query_start, sizeof(int32_t) * (b->n_seqs + 1));
    be->embedding(be, sb->x, m->embed, sb->ids, n, c->hidden_size);
    for (int l = 0; l < c->n_layers; l++) {
        kvs_attn_batch ab;
        int n_cap = layer_metadata(m, b, kv, l, max_blocks, &ab);
        attention_block(m, &m->layers[l], kv, l, &ab, n, n_cap);
        mlp_block(m, &m->layers[l], n);
    }
    for (int s = 0; s < b->n_seqs; s++) kvs_kv_commit(kv, b->seq_ids[s], b->query_start[s + 1] - b->query_start[s]);
    if (n_logits > 0) final_logits(m, b, n_logits, logits);
    /* compaction of what the sequences' policies say is due (after their
       prompt; decode layers reaching B_l + window) */
    for (int s = 0; s < b->n_seqs; s++) KVS_TRY(kvs_kv_sparsify(kv, b->seq_ids[s]));
    return KVS_OK;
}

static void final_logits(kvs_model *m, const kvs_batch *b, int n_logits, float *logits) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int k = 0;
    for (int s = 0; s < b->n_seqs; s++)
        if (b->wants_logits[s]) sb->h_last_rows[k++] = b->query_start[s + 1] - 1;
    be->to_device(be, sb->last_rows, sb->h_last_rows, sizeof(int32_t) * n_logits);
    be->gather_rows(be, sb->last, sb->x, sb->last_rows, n_logits, c->hidden_size);
    be->rmsnorm(be, sb->last, sb->last, m->final_norm, n_logits, c->hidden_size, c->rms_norm_eps);
    be->matmul(be, sb->logits, sb->last, m->lm_head, NULL, n_logits, c->hidden_size, c->vocab_size);
    be->to_host_f32(be, logits, sb->logits, (size_t)n_logits * c->vocab_size);
}
