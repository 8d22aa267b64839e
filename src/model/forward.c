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

static kvs_status grow_host_f32(float **p, size_t n) {
    free(*p);
    *p = malloc(sizeof(float) * (n ? n : 1));
    return *p ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
}

/* The sum over the ranks of this rank's partial output (row-parallel O and
 * down projections); nothing without tensor parallelism. */
static kvs_status tp_sum(kvs_model *m, void *buf, size_t n) {
    return m->comm ? m->comm->all_reduce_sum(m->comm, buf, n, m->be->act_dtype) : KVS_OK;
}

/* Makes the step buffers large enough for this batch. */
static kvs_status ensure_buffers(kvs_model *m, int n_tokens, int n_seqs, int max_blocks, int n_logits) {
    kvs_step_buffers *b = &m->buf;
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    const kvs_shard *sh = &m->shard; /* this rank's heads and MLP columns */
    size_t a = kvs_dtype_size(be->act_dtype);
    if (n_tokens > b->cap_tokens) {
        size_t n = (size_t)n_tokens;
        size_t qd = (size_t)sh->n_heads * c->head_dim, kd = (size_t)sh->n_kv_heads * c->head_dim;
        size_t wide = (size_t)sh->intermediate > qd ? (size_t)sh->intermediate : qd;
        if (wide < (size_t)c->hidden_size) wide = c->hidden_size;
        KVS_TRY(grow(be, &b->x, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->xn, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->q, n * qd * a));
        KVS_TRY(grow(be, &b->k, n * kd * a));
        KVS_TRY(grow(be, &b->v, n * kd * a));
        KVS_TRY(grow(be, &b->att, n * qd * a));
        KVS_TRY(grow(be, &b->tmp, n * c->hidden_size * a));
        KVS_TRY(grow(be, &b->gate_up, n * 2 * sh->intermediate * a));
        KVS_TRY(grow(be, &b->act, n * wide * a));
        KVS_TRY(grow(be, (void **)&b->ids, n * 4));
        KVS_TRY(grow(be, (void **)&b->positions, n * 4));
        KVS_TRY(grow(be, (void **)&b->slots, n * 4));
        KVS_TRY(grow(be, (void **)&b->lse, n * sh->n_heads * sizeof(float)));
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
        KVS_TRY(grow(be, &b->logits, (size_t)n_logits * sh->vocab_pad * a));
        KVS_TRY(grow(be, (void **)&b->last_rows, (size_t)n_logits * 4));
        KVS_TRY(grow_host(&b->h_last_rows, (size_t)n_logits));
        size_t all = (size_t)sh->world * n_logits * sh->vocab_pad;
        KVS_TRY(grow_host_f32(&b->h_logits, sh->world > 1 ? all : (size_t)n_logits * sh->vocab_pad));
        KVS_TRY(grow(be, (void **)&b->pairs, (size_t)n_logits * 2 * sizeof(float)));
        KVS_TRY(grow_host_f32(&b->h_pairs, (size_t)sh->world * n_logits * 2));
        if (sh->world > 1) {
            KVS_TRY(grow(be, &b->logits_all, all * a));
            KVS_TRY(grow(be, (void **)&b->pairs_all, (size_t)sh->world * n_logits * 2 * sizeof(float)));
        }
        b->cap_logits = n_logits;
    }
    return KVS_OK;
}

kvs_status kvs_model_check_batch(const kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->query_start[0] != 0 || b->query_start[b->n_seqs] != b->n_tokens)
        return kvs_fail(KVS_ERR_INVALID, "forward: malformed batch (%d tokens, %d sequences)", b->n_tokens,
                        b->n_seqs);
    const kvs_kv_config *kc = kvs_kv_get_config(kv);
    const kvs_shard *sh = &m->shard;
    if (kc->n_kv_heads != sh->n_kv_heads || kc->head_dim != m->cfg.head_dim || kc->n_layers != m->cfg.n_layers ||
        (kc->n_heads && kc->n_heads != sh->n_heads))
        return kvs_fail(KVS_ERR_INVALID,
                        "forward: the KV cache (%d layers, %d KV heads, %d heads, head_dim %d) does not match "
                        "rank %d of %d of the model (%d layers, %d KV heads, %d heads, head_dim %d)",
                        kc->n_layers, kc->n_kv_heads, kc->n_heads, kc->head_dim, sh->rank, sh->world,
                        m->cfg.n_layers, sh->n_kv_heads, sh->n_heads, m->cfg.head_dim);
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

/* Expects xn = attn_norm(x) (the previous layer's mlp_block fuses it into its
 * residual add); leaves x += attention and xn = mlp_norm(x). */
static kvs_status attention_block(kvs_model *m, const kvs_layer_weights *w, const kvs_kv_cache *kv, int layer,
                                  const kvs_attn_batch *ab, int n, int n_cap) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int n_heads = m->shard.n_heads, n_kv_heads = m->shard.n_kv_heads; /* this rank's */
    int qd = n_heads * c->head_dim, kd = n_kv_heads * c->head_dim;
    if (layer == 0) be->rmsnorm(be, sb->xn, sb->x, w->attn_norm, n, c->hidden_size, c->rms_norm_eps);
    be->matmul(be, sb->q, sb->xn, w->wq, w->bq, n, c->hidden_size, qd);
    be->matmul(be, sb->k, sb->xn, w->wk, w->bk, n, c->hidden_size, kd);
    be->matmul(be, sb->v, sb->xn, w->wv, w->bv, n, c->hidden_size, kd);
    const kvs_kv_pool *pool = kvs_kv_get_pool(kv);
    be->rope_kv_write(be, pool, sb->q, sb->k, sb->v, sb->positions, m->inv_freq, sb->slots, n, n_heads);
    be->attention(be, sb->att, n_cap ? sb->lse : NULL, sb->q, pool, ab, n_heads, 1.0f / sqrtf((float)c->head_dim));
    if (n_cap) { /* the sparsity window keeps these queries and their log-sum-exp */
        void *win_q;
        float *win_lse;
        kvs_kv_window_buffers(kv, layer, &win_q, &win_lse);
        be->window_capture(be, win_q, win_lse, sb->q, sb->lse, sb->cap_src, sb->cap_dst, n_cap, n_heads,
                           c->head_dim);
    }
    be->matmul(be, sb->tmp, sb->att, w->wo, NULL, n, qd, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel O */
    be->add_rmsnorm(be, sb->x, sb->xn, sb->tmp, w->mlp_norm, n, c->hidden_size, c->rms_norm_eps);
    return KVS_OK;
}

/* Expects xn = mlp_norm(x); leaves x += mlp and, when there is a next layer,
 * xn = its attn_norm(x) (the last layer's rows are normed by local_logits). */
static kvs_status mlp_block(kvs_model *m, const kvs_layer_weights *w, const kvs_layer_weights *next, int n) {
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_config *c = &m->cfg;
    int inter = m->shard.intermediate; /* this rank's columns */
    be->matmul(be, sb->gate_up, sb->xn, w->w_gate_up, NULL, n, c->hidden_size, 2 * inter);
    be->swiglu(be, sb->act, sb->gate_up, n, inter);
    be->matmul(be, sb->tmp, sb->act, w->w_down, NULL, n, inter, c->hidden_size);
    KVS_TRY(tp_sum(m, sb->tmp, (size_t)n * c->hidden_size)); /* row-parallel down */
    if (next)
        be->add_rmsnorm(be, sb->x, sb->xn, sb->tmp, next->attn_norm, n, c->hidden_size, c->rms_norm_eps);
    else
        be->add(be, sb->x, sb->tmp, (size_t)n * c->hidden_size);
    return KVS_OK;
}

static void local_logits(kvs_model *m, const kvs_batch *b, int n_logits);

/* The step up to each rank's logits slice in buf.logits [n_logits][vocab_pad]. */
static kvs_status forward_step(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, int *n_logits_out) {
    KVS_TRY(kvs_model_check_batch(m, b, kv));
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
        KVS_TRY(attention_block(m, &m->layers[l], kv, l, &ab, n, n_cap));
        KVS_TRY(mlp_block(m, &m->layers[l], l + 1 < c->n_layers ? &m->layers[l + 1] : NULL, n));
    }
    for (int s = 0; s < b->n_seqs; s++) kvs_kv_commit(kv, b->seq_ids[s], b->query_start[s + 1] - b->query_start[s]);
    if (n_logits > 0) local_logits(m, b, n_logits);
    /* compaction of what the sequences' policies say is due (after their
       prompt; decode layers reaching B_l + window); with tensor parallelism
       each rank scores and compacts its own KV heads: no communication */
    for (int s = 0; s < b->n_seqs; s++) KVS_TRY(kvs_kv_sparsify(kv, b->seq_ids[s]));
    *n_logits_out = n_logits;
    return KVS_OK;
}

kvs_status kvs_model_forward(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, float *logits) {
    int n_logits;
    KVS_TRY(forward_step(m, b, kv, &n_logits));
    if (n_logits == 0) return KVS_OK;
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_shard *sh = &m->shard;
    int V = m->cfg.vocab_size, vp = sh->vocab_pad;
    if (sh->world == 1) { /* vocab_pad == vocab */
        if (logits) be->to_host_f32(be, logits, sb->logits, (size_t)n_logits * V);
        return KVS_OK;
    }
    /* every rank's slice, then [rank][seq][vp] -> [seq][vocab] without the padding */
    size_t per_rank = (size_t)n_logits * vp;
    KVS_TRY(m->comm->all_gather(m->comm, sb->logits_all, sb->logits, per_rank, be->act_dtype));
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

/* Index bits travel in a float slot: the gather copies bytes, never converts. */
static float index_bits(int32_t i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

static int32_t bits_index(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i;
}

kvs_status kvs_model_forward_argmax(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, int32_t *ids) {
    int n_logits;
    KVS_TRY(forward_step(m, b, kv, &n_logits));
    if (n_logits == 0) return KVS_OK;
    kvs_backend *be = m->be;
    kvs_step_buffers *sb = &m->buf;
    const kvs_shard *sh = &m->shard;
    int vp = sh->vocab_pad;
    /* this rank's best (value, global id) per sequence: the first maximum of its real rows */
    be->to_host_f32(be, sb->h_logits, sb->logits, (size_t)n_logits * vp);
    for (int s = 0; s < n_logits; s++) {
        const float *row = sb->h_logits + (size_t)s * vp;
        int best = -1;
        for (int v = 0; v < sh->vocab_count; v++)
            if (best < 0 || row[v] > row[best]) best = v;
        sb->h_pairs[2 * s] = best < 0 ? -INFINITY : row[best];
        sb->h_pairs[2 * s + 1] = index_bits(best < 0 ? -1 : sh->vocab_begin + best);
    }
    const float *pairs = sb->h_pairs; /* [world][n_logits][2] */
    if (sh->world > 1) {
        size_t bytes = sizeof(float) * 2 * (size_t)n_logits;
        be->to_device(be, sb->pairs, sb->h_pairs, bytes);
        KVS_TRY(m->comm->all_gather(m->comm, sb->pairs_all, sb->pairs, 2 * (size_t)n_logits, KVS_F32));
        if (!ids) return KVS_OK;
        be->to_host(be, sb->h_pairs, sb->pairs_all, bytes * sh->world);
    }
    if (!ids) return KVS_OK;
    /* ranks in vocabulary order and a strict '>': ties go to the lowest id,
       as an argmax over the full logits would */
    for (int s = 0; s < n_logits; s++) {
        float best_v = 0;
        int32_t best = -1;
        for (int r = 0; r < sh->world; r++) {
            const float *p = pairs + ((size_t)r * n_logits + s) * 2;
            int32_t id = bits_index(p[1]);
            if (id >= 0 && (best < 0 || p[0] > best_v)) best_v = p[0], best = id;
        }
        ids[s] = best;
    }
    return KVS_OK;
}

/* This rank's vocab slice of the logits of the tokens that want them. */
static void local_logits(kvs_model *m, const kvs_batch *b, int n_logits) {
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
