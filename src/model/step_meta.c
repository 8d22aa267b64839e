/* A step's metadata: the batch checks, the shape it runs on (padded for the
 * graphs or as given), and every layer's slots, lengths and window-capture
 * rows packed into one buffer and uploaded with one copy; the block tables
 * stay on the device from step to step (tables.c), the sequences' rows in them
 * go with the metadata.
 *
 * Padded steps (the graphs' layout) append dummy sequences of one token each
 * (id 0, position 0, slot -1, kv_len 0, no window row, table row 0) up to the
 * batch bucket, and give each layer max_kv_len = kvs_stride_bucket(its most
 * blocks in the batch) x block_size, so that every pointer and size a graph
 * bakes in is fixed for the bucket and the vector of those layer lengths
 * (graphs.c keeps a graph per vector). Eager steps take each layer's longest
 * table as it is (sparse layers are short, full layers long). */
#include <string.h>

#include "model/model_internal.h"

/* Most blocks any sequence of the batch holds in layer l (at least 1). */
static int layer_max_blocks(const kvs_batch *b, const kvs_kv_cache *kv, int l) {
    int mb = 1, nb;
    for (int s = 0; s < b->n_seqs; s++) {
        kvs_kv_blocks(kv, b->seq_ids[s], l, &nb);
        if (nb > mb) mb = nb;
    }
    return mb;
}

kvs_status kvs_model_check_batch(const kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv,
                                 const kvs_kv_device *dev) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->query_start[0] != 0 || b->query_start[b->n_seqs] != b->n_tokens)
        return kvs_fail(KVS_ERR_INVALID, "forward: malformed batch (%d tokens, %d sequences)", b->n_tokens,
                        b->n_seqs);
    const kvs_model_limits *lim = &m->limits;
    if (b->n_tokens > lim->max_tokens || b->n_seqs > lim->max_seqs)
        return kvs_fail(KVS_ERR_INVALID, "forward: a batch of %d tokens and %d sequences exceeds the model's limits "
                        "(%d tokens, %d sequences per step)", b->n_tokens, b->n_seqs, lim->max_tokens, lim->max_seqs);
    const kvs_kv_config *kc = kvs_kv_device_config(dev);
    const kvs_shard *sh = &m->shard;
    if (kc->n_kv_heads != sh->n_kv_heads || kc->head_dim != m->cfg.head_dim || kc->n_layers != m->cfg.n_layers ||
        (kc->n_heads && kc->n_heads != sh->n_heads))
        return kvs_fail(KVS_ERR_INVALID,
                        "forward: the KV cache (%d layers, %d KV heads, %d heads, head_dim %d) does not match "
                        "rank %d of %d of the model (%d layers, %d KV heads, %d heads, head_dim %d)",
                        kc->n_layers, kc->n_kv_heads, kc->n_heads, kc->head_dim, sh->rank, sh->world,
                        m->cfg.n_layers, sh->n_kv_heads, sh->n_heads, m->cfg.head_dim);
    int max_blocks = kvs_table_blocks(lim);
    for (int s = 0; s < b->n_seqs; s++) {
        int q_len = b->query_start[s + 1] - b->query_start[s];
        if (q_len <= 0) return kvs_fail(KVS_ERR_INVALID, "forward: sequence %d has no tokens", s);
        for (int l = 0; l < m->cfg.n_layers; l++) {
            int nb;
            kvs_kv_blocks(kv, b->seq_ids[s], l, &nb);
            if ((int64_t)nb * kc->block_size < kvs_kv_len(kv, b->seq_ids[s], l) + q_len)
                return kvs_fail(KVS_ERR_INVALID, "forward: sequence %d has no KV room reserved", b->seq_ids[s]);
            if (nb > max_blocks)
                return kvs_fail(KVS_ERR_INVALID,
                                "forward: sequence %d holds %d KV blocks in layer %d: more than the model's limit "
                                "of %d (max_model_len %d / block size %d)",
                                b->seq_ids[s], nb, l, max_blocks, lim->max_len, lim->block_size);
        }
    }
    for (int i = 0; i < b->n_tokens; i++)
        if (b->token_ids[i] < 0 || b->token_ids[i] >= m->cfg.vocab_size)
            return kvs_fail(KVS_ERR_INVALID, "forward: token id %d out of range [0, %d)", b->token_ids[i],
                            m->cfg.vocab_size);
    return KVS_OK;
}

/* Pure-decode steps take the graphs' padded layout (in the graph modes). */
static void plan(const kvs_model *m, const kvs_batch *b, kvs_step_shape *sh) {
    int n_decode = 0; /* the scheduler puts a mixed step's decodes first */
    while (n_decode < b->n_seqs && b->query_start[n_decode + 1] - b->query_start[n_decode] == 1) n_decode++;
    *sh = (kvs_step_shape){b->n_tokens, b->n_seqs, false, 0, n_decode};
    const kvs_graphs *g = &m->graphs;
    bool layout = g->mode == KVS_GRAPHS_PADDED || (g->mode == KVS_GRAPHS_ON && m->be->graph_begin);
    if (!layout || b->n_tokens != b->n_seqs) return; /* graphs for pure decode only */
    int bi = kvs_ceil_log2(b->n_seqs);
    if (bi >= KVS_GRAPH_BATCHES) return;
    *sh = (kvs_step_shape){1 << bi, 1 << bi, true, bi, 1 << bi};
}

/* Builds the metadata in the pinned host buffer and uploads it with one copy.
 * The buffer's two halves take turns: a step writes the half the step before
 * last uploaded, whose copy has run when any wait for the device came since
 * (normally the last step's read of its sampled ids), so the host builds this
 * step while the device still runs the last one's compactions. */
kvs_status kvs_step_prepare(kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv, const kvs_kv_device *dev,
                            kvs_step_shape *sh) {
    plan(m, b, sh);
    kvs_step_buffers *sb = &m->buf;
    kvs_backend *be = m->be;
    const int L = m->cfg.n_layers, T = sh->n_rows, S = sh->n_seqs, n = b->n_tokens, bs = kvs_kv_get_config(kv)->block_size;
    size_t off = 0, o_ids = off, o_pos = (off += T), o_qs = (off += T), o_rows = (off += S + 1);
    off += S;
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        int mb = layer_max_blocks(b, kv, l);
        lm->kv_blocks = sh->padded ? kvs_stride_bucket(mb) : mb;
        lm->slots = off, off += T;
        lm->kv_len = off, off += S;
        lm->cap_src = off, off += T;
        lm->cap_dst = off, off += T;
    }
    /* this step's half of h_meta: the upload that last read it (two steps back) has
       run, unless no step since waited for the device (then wait now) */
    int32_t *h = sb->h_meta + (size_t)kvs_turn_take(be, &sb->h_turns) * sb->meta_words;
    KVS_TRY(kvs_tables_update(m, b, kv, h + o_rows));
    for (int s = b->n_seqs; s < S; s++) h[o_rows + s] = 0; /* dummies read no table */
    memcpy(h + o_ids, b->token_ids, sizeof(int32_t) * n);
    memcpy(h + o_pos, b->positions, sizeof(int32_t) * n);
    memcpy(h + o_qs, b->query_start, sizeof(int32_t) * (b->n_seqs + 1));
    for (int i = n; i < T; i++) h[o_ids + i] = h[o_pos + i] = 0;
    for (int s = b->n_seqs; s < S; s++) h[o_qs + s + 1] = h[o_qs + s] + 1; /* dummies: one token each */
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        int32_t *slots = h + lm->slots, *kv_len = h + lm->kv_len, *cap_src = h + lm->cap_src,
                *cap_dst = h + lm->cap_dst;
        int max_kv = 0, max_q = 0, n_cap = 0;
        for (int s = 0; s < b->n_seqs; s++) {
            int seq = b->seq_ids[s], q0 = b->query_start[s], q_len = b->query_start[s + 1] - q0;
            int len = kvs_kv_len(kv, seq, l);
            kvs_kv_slots(kv, seq, l, len, q_len, slots + q0);
            /* the rows at q0 ..; padded: every row goes through window_capture (-1 skips), eager: only
               rows >= 0, moved down to n_cap (<= q0 + i: never past the row read next) */
            kvs_kv_window_rows(kv, seq, l, b->positions + q0, q_len, cap_dst + q0);
            for (int i = 0; i < q_len; i++) {
                if (sh->padded) {
                    cap_src[q0 + i] = q0 + i;
                } else if (cap_dst[q0 + i] >= 0) {
                    cap_src[n_cap] = q0 + i;
                    cap_dst[n_cap++] = cap_dst[q0 + i];
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
            kvs_kv_device_window_buffers(dev, l, &win_q, &win_lse);
            max_kv = lm->kv_blocks * bs;
            max_q = 1;
            n_cap = win_q ? T : 0;
        }
        lm->max_kv_len = max_kv;
        lm->max_q_len = max_q;
        lm->n_cap = n_cap;
    }
    be->to_device(be, sb->meta, h, sizeof(int32_t) * off);
    kvs_turn_sent(be, &sb->h_turns);
    sb->ids = sb->meta + o_ids;
    sb->positions = sb->meta + o_pos;
    sb->q_start = sb->meta + o_qs;
    sb->table_rows = sb->meta + o_rows;
    return KVS_OK;
}

int kvs_step_layer(kvs_model *m, int l, const kvs_step_shape *sh, kvs_attn_batch *ab) {
    kvs_step_buffers *sb = &m->buf;
    const kvs_layer_meta *lm = &sb->layer_meta[l];
    sb->slots = sb->meta + lm->slots;
    sb->kv_len = sb->meta + lm->kv_len;
    sb->cap_src = sb->meta + lm->cap_src;
    sb->cap_dst = sb->meta + lm->cap_dst;
    const kvs_block_tables *t = &sb->tables;
    *ab = (kvs_attn_batch){sh->n_seqs, sh->n_rows, t->blocks, lm->max_q_len, lm->max_kv_len, sb->q_start,
                           sb->kv_len, t->dev + (size_t)l * t->rows * t->blocks, sb->table_rows,
                           kvs_config_layer_sliding_window(&m->cfg, l), sh->n_decode};
    return lm->n_cap;
}
