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

/* Makes the step buffers large enough for this batch (n_tokens rows, padding
 * included). Graphs baked in the old buffers: growing any invalidates them. */
static kvs_status ensure_buffers(kvs_model *m, int n_tokens, int n_logits) {
    kvs_step_buffers *b = &m->buf;
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    const kvs_shard *sh = &m->shard; /* this rank's heads and MLP columns */
    size_t a = kvs_dtype_size(be->act_dtype);
    if (n_tokens > b->cap_tokens) {
        kvs_graphs_invalidate(m);
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
        KVS_TRY(grow(be, (void **)&b->lse, n * sh->n_heads * sizeof(float)));
        b->cap_tokens = n_tokens;
    }
    if (n_logits > b->cap_logits) {
        KVS_TRY(grow(be, &b->last, (size_t)n_logits * c->hidden_size * a));
        KVS_TRY(grow(be, &b->logits, (size_t)n_logits * sh->vocab_pad * a));
        KVS_TRY(grow(be, (void **)&b->last_rows, (size_t)n_logits * 4));
        KVS_TRY(grow_host(&b->h_last_rows, (size_t)n_logits));
        if (sh->world > 1) {
            size_t all = (size_t)sh->world * n_logits * sh->vocab_pad;
            KVS_TRY(grow_host_f32(&b->h_logits, all));
            KVS_TRY(grow(be, &b->logits_all, all * a));
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

/* ---- per-step metadata: built once, uploaded with one copy ---------------------
 * What a step runs on: n_rows token rows and n_seqs sequences (padding
 * included). Padded steps (the graphs' layout) append dummy sequences of one
 * token each (id 0, position 0, slot -1, kv_len 0, no window row) up to the
 * batch bucket, and give every layer the bucket's table stride and max_kv_len
 * = stride x block_size, so that every pointer and size a graph bakes in is
 * fixed for the bucket. Eager steps pad each layer's tables to that layer's
 * most blocks in the batch (sparse layers are short, full layers long). */
typedef struct {
    int n_rows, n_seqs;
    bool padded;
    int stride;     /* padded: blocks per sequence of every layer's table */
    int bucket, si; /* padded: graph slot [bucket][si] */
} step_shape;

static int ceil_log2(int n) {
    int i = 0;
    while ((1 << i) < n) i++;
    return i;
}

static void plan_step(const kvs_model *m, const kvs_batch *b, int max_blocks, step_shape *sh) {
    *sh = (step_shape){b->n_tokens, b->n_seqs, false, 0, 0, 0};
    const kvs_graphs *g = &m->graphs;
    bool layout = g->mode == KVS_GRAPHS_PADDED || (g->mode == KVS_GRAPHS_ON && m->be->graph_begin);
    if (!layout || b->n_tokens != b->n_seqs) return; /* graphs for pure decode only */
    int bi = ceil_log2(b->n_seqs), si = ceil_log2(max_blocks);
    if (bi >= KVS_GRAPH_BATCHES || si >= KVS_GRAPH_STRIDES) return;
    *sh = (step_shape){1 << bi, 1 << bi, true, 1 << si, bi, si};
}

/* Grows the metadata buffers to n int32 (device and pinned host); the device
 * buffer moving invalidates the graphs. */
static kvs_status ensure_meta(kvs_model *m, size_t n) {
    kvs_step_buffers *sb = &m->buf;
    kvs_backend *be = m->be;
    if (!sb->layer_meta) {
        sb->layer_meta = calloc((size_t)m->cfg.n_layers, sizeof(kvs_layer_meta));
        if (!sb->layer_meta) return kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
    }
    if (n <= sb->cap_meta) return KVS_OK;
    kvs_graphs_invalidate(m);
    size_t want = n + n / 4;
    if (sb->meta) be->free(be, sb->meta);
    if (sb->h_meta) be->host_free ? be->host_free(be, sb->h_meta) : free(sb->h_meta);
    sb->cap_meta = 0;
    sb->meta = be->alloc(be, want * sizeof(int32_t));
    sb->h_meta = be->host_alloc ? be->host_alloc(be, want * sizeof(int32_t)) : malloc(want * sizeof(int32_t));
    if (!sb->meta || !sb->h_meta)
        return kvs_fail(KVS_ERR_NOMEM, "forward: out of memory for the step metadata (%zu bytes)",
                        want * sizeof(int32_t));
    sb->cap_meta = want;
    return KVS_OK;
}

/* Most blocks any sequence of the batch holds in layer l (at least 1). */
static int layer_max_blocks(const kvs_batch *b, const kvs_kv_cache *kv, int l) {
    int mb = 1, nb;
    for (int s = 0; s < b->n_seqs; s++) {
        kvs_kv_blocks(kv, b->seq_ids[s], l, &nb);
        if (nb > mb) mb = nb;
    }
    return mb;
}

/* Builds every layer's slots, lengths, block tables and window-capture rows in
 * the pinned host buffer and uploads it with one copy. The host buffer is
 * reused every step: the backend is synchronized first (cheap: the previous
 * step normally ended with its logits' device-to-host read, which already
 * synchronized; only steps without a read, e.g. prefill chunks, lose their
 * host/GPU overlap here). */
static kvs_status step_metadata(kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv, const step_shape *sh) {
    kvs_step_buffers *sb = &m->buf;
    kvs_backend *be = m->be;
    const int L = m->cfg.n_layers, T = sh->n_rows, S = sh->n_seqs, n = b->n_tokens, bs = kvs_kv_get_config(kv)->block_size;
    size_t off = 0, o_ids = off, o_pos = (off += T), o_qs = (off += T);
    off += S + 1;
    KVS_TRY(ensure_meta(m, 0)); /* layer_meta */
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        lm->max_blocks = sh->padded ? sh->stride : layer_max_blocks(b, kv, l);
        lm->slots = off, off += T;
        lm->kv_len = off, off += S;
        lm->cap_src = off, off += T;
        lm->cap_dst = off, off += T;
        lm->tables = off, off += (size_t)S * lm->max_blocks;
    }
    KVS_TRY(ensure_meta(m, off));
    be->synchronize(be); /* the last step's upload may still read h_meta */
    int32_t *h = sb->h_meta;
    memcpy(h + o_ids, b->token_ids, sizeof(int32_t) * n);
    memcpy(h + o_pos, b->positions, sizeof(int32_t) * n);
    memcpy(h + o_qs, b->query_start, sizeof(int32_t) * (b->n_seqs + 1));
    for (int i = n; i < T; i++) h[o_ids + i] = h[o_pos + i] = 0;
    for (int s = b->n_seqs; s < S; s++) h[o_qs + s + 1] = h[o_qs + s] + 1; /* dummies: one token each */
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        int32_t *slots = h + lm->slots, *kv_len = h + lm->kv_len, *cap_src = h + lm->cap_src,
                *cap_dst = h + lm->cap_dst, *tables = h + lm->tables;
        int max_kv = 0, max_q = 0, n_cap = 0;
        memset(tables, 0, sizeof(int32_t) * (size_t)S * lm->max_blocks);
        for (int s = 0; s < b->n_seqs; s++) {
            int seq = b->seq_ids[s], q0 = b->query_start[s], q_len = b->query_start[s + 1] - q0;
            int len = kvs_kv_len(kv, seq, l), nb;
            const int32_t *blocks = kvs_kv_blocks(kv, seq, l, &nb);
            memcpy(tables + (size_t)s * lm->max_blocks, blocks, sizeof(int32_t) * nb);
            for (int i = 0; i < q_len; i++) {
                slots[q0 + i] = kvs_kv_slot(kv, seq, l, len + i);
                int row = kvs_kv_window_row(kv, seq, l, b->positions[q0 + i]);
                if (sh->padded) { /* every row goes through window_capture; -1 skips */
                    cap_src[q0 + i] = q0 + i;
                    cap_dst[q0 + i] = row;
                } else if (row >= 0) {
                    cap_src[n_cap] = q0 + i;
                    cap_dst[n_cap++] = row;
                }
            }
            kv_len[s] = len + q_len;
            if (len + q_len > max_kv) max_kv = len + q_len;
            if (q_len > max_q) max_q = q_len;
        }
        for (int i = n; i < T; i++) slots[i] = -1, cap_src[i] = i, cap_dst[i] = -1;
        for (int s = b->n_seqs; s < S; s++) kv_len[s] = 0;
        if (sh->padded) { /* the bucket's fixed sizes; LSE and window capture always (when windows exist) */
            void *win_q;
            float *win_lse;
            kvs_kv_window_buffers(kv, l, &win_q, &win_lse);
            max_kv = sh->stride * bs;
            max_q = 1;
            n_cap = win_q ? T : 0;
        }
        lm->max_kv_len = max_kv;
        lm->max_q_len = max_q;
        lm->n_cap = n_cap;
    }
    be->to_device(be, sb->meta, h, sizeof(int32_t) * off);
    sb->ids = sb->meta + o_ids;
    sb->positions = sb->meta + o_pos;
    sb->q_start = sb->meta + o_qs;
    return KVS_OK;
}

/* Points the step buffers at layer l's metadata; its attention batch in ab. */
static int set_layer(kvs_model *m, int l, const step_shape *sh, kvs_attn_batch *ab) {
    kvs_step_buffers *sb = &m->buf;
    const kvs_layer_meta *lm = &sb->layer_meta[l];
    sb->slots = sb->meta + lm->slots;
    sb->kv_len = sb->meta + lm->kv_len;
    sb->cap_src = sb->meta + lm->cap_src;
    sb->cap_dst = sb->meta + lm->cap_dst;
    sb->block_tables = sb->meta + lm->tables;
    *ab = (kvs_attn_batch){sh->n_seqs, sh->n_rows, lm->max_blocks, lm->max_q_len, lm->max_kv_len, sb->q_start,
                           sb->kv_len, sb->block_tables};
    return lm->n_cap;
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

/* Everything a graph holds: embedding and the layers, reading only the step
 * buffers and the metadata buffer. */
static kvs_status step_body(kvs_model *m, const kvs_kv_cache *kv, const step_shape *sh) {
    kvs_backend *be = m->be;
    const kvs_config *c = &m->cfg;
    be->embedding(be, m->buf.x, m->embed, m->buf.ids, sh->n_rows, c->hidden_size);
    for (int l = 0; l < c->n_layers; l++) {
        kvs_attn_batch ab;
        int n_cap = set_layer(m, l, sh, &ab);
        KVS_TRY(attention_block(m, &m->layers[l], kv, l, &ab, sh->n_rows, n_cap));
        KVS_TRY(mlp_block(m, &m->layers[l], l + 1 < c->n_layers ? &m->layers[l + 1] : NULL, sh->n_rows));
    }
    return KVS_OK;
}

/* Runs the step body: eagerly, or for a padded step on a backend with graphs
 * (vLLM's protocol) eagerly the first time its bucket is seen, captured the
 * second time, replayed after. */
static kvs_status run_step(kvs_model *m, const kvs_kv_cache *kv, const step_shape *sh) {
    kvs_backend *be = m->be;
    kvs_graphs *g = &m->graphs;
    if (!sh->padded) {
        g->stats.eager_steps++;
        return step_body(m, kv, sh);
    }
    if (g->mode != KVS_GRAPHS_ON || !be->graph_begin) {
        g->stats.padded_eager_steps++;
        return step_body(m, kv, sh);
    }
    KVS_TRY(kvs_graphs_check_kv(m, kv));
    kvs_graph_slot *slot = &g->slot[sh->bucket][sh->si];
    if (slot->exec) {
        if (be->graph_launch(be, slot->exec) == KVS_OK) {
            g->stats.replays++;
            return KVS_OK;
        }
        /* stale (the backend's scratch moved): eager now, capture next time */
        be->graph_destroy(be, slot->exec);
        slot->exec = NULL;
        slot->seen = 1;
        g->stats.invalidations++;
        g->stats.padded_eager_steps++;
        return step_body(m, kv, sh);
    }
    if (slot->failed || slot->seen++ == 0) {
        g->stats.padded_eager_steps++;
        return step_body(m, kv, sh);
    }
    kvs_status st = be->graph_begin(be);
    if (st == KVS_OK) {
        kvs_status body = step_body(m, kv, sh);
        void *exec = NULL;
        st = be->graph_end(be, &exec); /* always close the capture */
        if (body != KVS_OK) {
            if (exec) be->graph_destroy(be, exec);
            return body;
        }
        if (st == KVS_OK) {
            slot->exec = exec;
            g->stats.captures++;
            st = be->graph_launch(be, exec);
            if (st == KVS_OK) {
                g->stats.replays++;
                return KVS_OK;
            }
            be->graph_destroy(be, exec);
            slot->exec = NULL;
        }
    }
    slot->failed = true;
    g->stats.capture_failures++;
    kvs_log(KVS_LOG_WARN, "forward: no CUDA graph for %d sequences x %d blocks (%s); that bucket stays eager",
            sh->n_seqs, sh->stride, kvs_last_error());
    g->stats.padded_eager_steps++;
    return step_body(m, kv, sh); /* nothing of the failed capture ran */
}

/* The step up to each rank's logits slice in buf.logits [n_logits][vocab_pad]. */
static kvs_status forward_step(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, int *n_logits_out) {
    const kvs_config *c = &m->cfg;
    int n_logits = 0, max_blocks = 1;
    for (int s = 0; s < b->n_seqs; s++) n_logits += b->wants_logits[s] ? 1 : 0;
    for (int l = 0; l < c->n_layers; l++) {
        int mb = layer_max_blocks(b, kv, l);
        if (mb > max_blocks) max_blocks = mb;
    }
    step_shape sh;
    plan_step(m, b, max_blocks, &sh);
    KVS_TRY(ensure_buffers(m, sh.n_rows, n_logits));
    KVS_TRY(step_metadata(m, b, kv, &sh));
    KVS_TRY(run_step(m, kv, &sh));
    if (n_logits > 0) local_logits(m, b, n_logits);
    /* the new tokens stay uncommitted: the runner commits them and applies
       the sequences' KV policies after the step (src/runner/step.c) */
    *n_logits_out = n_logits;
    return KVS_OK;
}

/* Every step ends by asking the backend whether one of its ops failed (ops
 * return nothing; a failed op or a CUDA fault is recorded there): the step
 * that caused a failure reports it. */
static kvs_status step_status(kvs_model *m, kvs_status st) {
    kvs_status health = m->be->check(m->be);
    return st != KVS_OK ? st : health;
}

static kvs_status forward_logits(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, float *logits) {
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

kvs_status kvs_model_forward(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, float *logits) {
    KVS_TRY(kvs_model_check_batch(m, b, kv));
    return step_status(m, forward_logits(m, b, kv, logits));
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

/* ---- sampling on the backend (kvs_model_forward_sample) ---------------------- */

void kvs_model_free_sample_buffers(kvs_model *m) {
    kvs_sample_buffers *s = &m->sample;
    void *dev[] = {s->params, s->out, s->rows, s->order, s->parts, s->parts_all};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) m->be->free(m->be, dev[i]);
    free(s->h_out);
    free(s->h_order);
    free(s->h_parts);
    memset(s, 0, sizeof *s);
}

static kvs_status ensure_sample_buffers(kvs_model *m, int n) {
    kvs_sample_buffers *s = &m->sample;
    if (n <= s->cap_rows) return KVS_OK;
    kvs_backend *be = m->be;
    const kvs_shard *sh = &m->shard;
    KVS_TRY(grow(be, (void **)&s->params, sizeof(kvs_sample_row) * n));
    KVS_TRY(grow(be, (void **)&s->out, sizeof(int32_t) * 2 * n));
    KVS_TRY(grow_host(&s->h_out, 2 * (size_t)n));
    if (sh->world > 1) {
        KVS_TRY(grow(be, &s->rows, (size_t)n * sh->world * sh->vocab_pad * kvs_dtype_size(be->act_dtype)));
        KVS_TRY(grow(be, (void **)&s->order, sizeof(int32_t) * sh->world * n));
        KVS_TRY(grow_host(&s->h_order, (size_t)sh->world * n));
        KVS_TRY(grow(be, (void **)&s->parts, sizeof(kvs_sample_part) * n));
        KVS_TRY(grow(be, (void **)&s->parts_all, sizeof(kvs_sample_part) * sh->world * n));
        free(s->h_parts);
        s->h_parts = malloc(sizeof(kvs_sample_part) * sh->world * n);
        if (!s->h_parts) return kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
    }
    s->cap_rows = n;
    return KVS_OK;
}

static kvs_status check_sample_row(const kvs_sample_row *p, int row) {
    if (!(p->temperature >= 0) || !isfinite(p->temperature) || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) ||
        !(p->min_p >= 0 && p->min_p <= 1))
        return kvs_fail(KVS_ERR_INVALID,
                        "forward_sample: row %d: bad sampling parameters (temperature %g, top_k %d, top_p %g, "
                        "min_p %g)", row, p->temperature, p->top_k, p->top_p, p->min_p);
    return KVS_OK;
}

kvs_status kvs_model_check_sample(const kvs_batch *b, const kvs_sample_row *params) {
    for (int s = 0, q = 0; s < b->n_seqs; s++)
        if (b->wants_logits[s]) {
            KVS_TRY(check_sample_row(&params[q], q));
            q++;
        }
    return KVS_OK;
}

/* Tensor parallelism without the logits gather: every rank reduces its
 * vocabulary slice to one kvs_sample_part per row on the device, the ranks
 * all-gather the parts (28 bytes per row and rank), and the ranks that pass
 * ids pick on the host (backend/sample.h: the same ids as the sample op over
 * the whole row, logprobs up to the order of the sum). */
static kvs_status sample_sharded(kvs_model *m, int n, const kvs_sample_row *params, int32_t *ids, float *logprobs) {
    kvs_backend *be = m->be;
    kvs_sample_buffers *s = &m->sample;
    const kvs_shard *sh = &m->shard;
    be->to_device(be, s->params, params, sizeof(kvs_sample_row) * n);
    be->sample_shard(be, s->parts, m->buf.logits, n, sh->vocab_pad, sh->vocab_count, sh->vocab_begin, s->params);
    size_t floats = sizeof(kvs_sample_part) / sizeof(float) * (size_t)n; /* the gather copies bytes */
    KVS_TRY(m->comm->all_gather(m->comm, s->parts_all, s->parts, floats, KVS_F32));
    if (!ids) return KVS_OK;
    be->to_host(be, s->h_parts, s->parts_all, sizeof(kvs_sample_part) * sh->world * n); /* the one copy back */
    for (int q = 0; q < n; q++)
        ids[q] = kvs_sample_pick(s->h_parts + q, sh->world, (size_t)n, &params[q], logprobs ? &logprobs[q] : NULL);
    return KVS_OK;
}

/* Whether every row can take sample_sharded: greedy or temperature alone. */
static bool all_shardable(const kvs_sample_row *params, int n, int vocab) {
    for (int q = 0; q < n; q++)
        if (!kvs_sample_shardable(&params[q], vocab)) return false;
    return true;
}

static kvs_status forward_sample(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, const kvs_sample_row *params,
                                 int32_t *ids, float *logprobs) {
    const kvs_shard *sh = &m->shard;
    int world = sh->world;
    /* the ranks choose between the parts and the gather from params alone,
       so that they all run the same collectives: every rank needs them */
    if (!params && (ids || world > 1))
        return kvs_fail(KVS_ERR_INVALID, "forward_sample: rank %d of %d has no sampling parameters", sh->rank, world);
    int n;
    KVS_TRY(forward_step(m, b, kv, &n));
    if (n == 0) return KVS_OK;
    KVS_TRY(ensure_sample_buffers(m, n));
    if (world > 1 && all_shardable(params, n, m->cfg.vocab_size)) return sample_sharded(m, n, params, ids, logprobs);
    kvs_backend *be = m->be;
    kvs_sample_buffers *s = &m->sample;
    const void *rows = m->buf.logits;
    int ld = sh->vocab_pad;
    if (world > 1) { /* every rank's slice, then [rank][seq][vp] -> [seq][rank][vp] on the device */
        KVS_TRY(m->comm->all_gather(m->comm, m->buf.logits_all, m->buf.logits, (size_t)n * ld, be->act_dtype));
        if (!ids) return KVS_OK;
        for (int q = 0; q < n; q++)
            for (int r = 0; r < world; r++) s->h_order[q * world + r] = r * n + q;
        be->to_device(be, s->order, s->h_order, sizeof(int32_t) * world * n);
        be->gather_rows(be, s->rows, m->buf.logits_all, s->order, world * n, ld);
        rows = s->rows;
        ld *= world; /* column c is token c: rank r's slice starts at r * vocab_pad */
    }
    if (!ids) return KVS_OK;
    be->to_device(be, s->params, params, sizeof(kvs_sample_row) * n);
    be->sample(be, s->out, logprobs ? (float *)(s->out + n) : NULL, rows, n, ld, m->cfg.vocab_size, s->params);
    be->to_host(be, s->h_out, s->out, sizeof(int32_t) * (logprobs ? 2 : 1) * n); /* the one copy back */
    memcpy(ids, s->h_out, sizeof(int32_t) * n);
    if (logprobs) memcpy(logprobs, s->h_out + n, sizeof(float) * n);
    return KVS_OK;
}

kvs_status kvs_model_forward_sample(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv, const kvs_sample_row *params,
                                    int32_t *ids, float *logprobs) {
    if (params) KVS_TRY(kvs_model_check_sample(b, params)); /* before the step: a bad row changes nothing */
    KVS_TRY(kvs_model_check_batch(m, b, kv));
    return step_status(m, forward_sample(m, b, kv, params, ids, logprobs));
}

kvs_status kvs_model_forward_unchecked(kvs_model *m, const kvs_batch *b, kvs_kv_cache *kv,
                                       const kvs_sample_row *params, int32_t *ids, float *logprobs, float *logits) {
    return params ? forward_sample(m, b, kv, params, ids, logprobs) : forward_logits(m, b, kv, logits);
}
