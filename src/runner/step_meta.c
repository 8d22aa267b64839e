/* A step's metadata: the checks of its inputs, the shape it runs on (padded
 * for the graphs or as given), and every layer's slots, lengths and
 * window-capture rows (the runner's plan, made once for every rank) packed
 * into one buffer and uploaded with one copy; the block tables are the KV
 * device's (a sequence's row its id).
 *
 * Padded steps (the graphs' layout) append dummy sequences of one token each
 * (id 0, position 0, slot -1, kv_len 0, no window row, table row 0) up to the
 * batch bucket, and give each layer max_kv_len = kvs_stride_bucket(its most
 * blocks in the batch) x block_size, so that every pointer and size a graph
 * bakes in is fixed for the bucket and the vector of those layer lengths
 * (graphs.c keeps a graph per vector). Eager steps take each layer's longest
 * table as it is (sparse layers are short, full layers long). */
#include <string.h>

#include "runner/runner_internal.h"

kvs_status kvs_executor_check_batch(const kvs_executor *x, const kvs_batch *b, const kvs_kv_device *dev) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->query_start[0] != 0 || b->query_start[b->n_seqs] != b->n_tokens)
        return kvs_fail(KVS_ERR_INVALID, "forward: malformed batch (%d tokens, %d sequences)", b->n_tokens,
                        b->n_seqs);
    const kvs_step_limits *lim = &x->limits;
    if (b->n_tokens > lim->max_tokens || b->n_seqs > lim->max_seqs)
        return kvs_fail(KVS_ERR_INVALID, "forward: a batch of %d tokens and %d sequences exceeds the model's limits "
                        "(%d tokens, %d sequences per step)", b->n_tokens, b->n_seqs, lim->max_tokens, lim->max_seqs);
    const kvs_kv_config *kc = kvs_kv_device_config(dev);
    const kvs_shard *sh = x->shard;
    const kvs_config *c = x->cfg;
    if (kc->n_kv_heads != sh->n_kv_heads || kc->head_dim != c->head_dim || kc->n_layers != c->n_layers ||
        (kc->n_heads && kc->n_heads != sh->n_heads))
        return kvs_fail(KVS_ERR_INVALID,
                        "forward: the KV cache (%d layers, %d KV heads, %d heads, head_dim %d) does not match "
                        "rank %d of %d of the model (%d layers, %d KV heads, %d heads, head_dim %d)",
                        kc->n_layers, kc->n_kv_heads, kc->n_heads, kc->head_dim, sh->rank, sh->world,
                        c->n_layers, sh->n_kv_heads, sh->n_heads, c->head_dim);
    for (int s = 0; s < b->n_seqs; s++) {
        if (b->query_start[s + 1] - b->query_start[s] <= 0)
            return kvs_fail(KVS_ERR_INVALID, "forward: sequence %d has no tokens", s);
        if (b->seq_ids[s] < 0 || b->seq_ids[s] >= kc->max_seqs)
            return kvs_fail(KVS_ERR_INVALID, "forward: sequence id %d outside the KV cache's [0, %d)", b->seq_ids[s],
                            kc->max_seqs);
    }
    for (int i = 0; i < b->n_tokens; i++)
        if (b->token_ids[i] < 0 || b->token_ids[i] >= c->vocab_size)
            return kvs_fail(KVS_ERR_INVALID, "forward: token id %d out of range [0, %d)", b->token_ids[i],
                            c->vocab_size);
    return KVS_OK;
}

kvs_status kvs_executor_check_inputs(const kvs_executor *x, const kvs_step_inputs *in, const kvs_kv_device *dev) {
    KVS_TRY(kvs_executor_check_batch(x, &in->batch, dev));
    int stride;
    kvs_kv_device_layer_tables(dev, 0, &stride);
    for (int l = 0; l < x->cfg->n_layers; l++)
        if (in->max_blocks[l] < 1 || in->max_blocks[l] > stride)
            return kvs_fail(KVS_ERR_INVALID, "forward: layer %d's tables of %d blocks (the device's hold 1 .. %d)", l,
                            in->max_blocks[l], stride);
    return KVS_OK;
}

/* Pure-decode steps take the graphs' padded layout (in the graph modes). */
static void plan(const kvs_executor *x, const kvs_batch *b, kvs_step_shape *sh) {
    int n_decode = 0; /* the scheduler puts a mixed step's decodes first */
    while (n_decode < b->n_seqs && b->query_start[n_decode + 1] - b->query_start[n_decode] == 1) n_decode++;
    *sh = (kvs_step_shape){b->n_tokens, b->n_seqs, false, 0, n_decode};
    const kvs_graphs *g = &x->graphs;
    bool layout = g->mode == KVS_GRAPHS_PADDED || (g->mode == KVS_GRAPHS_ON && x->be->graph_begin);
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
kvs_status kvs_step_prepare(kvs_executor *x, const kvs_step_inputs *in, const kvs_kv_device *dev, kvs_step_shape *sh) {
    const kvs_batch *b = &in->batch;
    plan(x, b, sh);
    kvs_step_buffers *sb = &x->buf;
    kvs_backend *be = x->be;
    const int L = x->cfg->n_layers, T = sh->n_rows, S = sh->n_seqs, n = b->n_tokens, ns = b->n_seqs;
    const int bs = kvs_kv_device_config(dev)->block_size;
    size_t off = 0, o_ids = off, o_pos = (off += T), o_qs = (off += T), o_rows = (off += S + 1);
    off += S;
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        lm->kv_blocks = sh->padded ? kvs_stride_bucket(in->max_blocks[l]) : in->max_blocks[l];
        lm->slots = off, off += T;
        lm->kv_len = off, off += S;
        lm->cap_src = off, off += T;
        lm->cap_dst = off, off += T;
    }
    /* this step's half of h_meta: the upload that last read it (two steps back) has
       run, unless no step since waited for the device (then wait now) */
    int32_t *h = sb->h_meta + (size_t)kvs_turn_take(be, &sb->h_turns) * sb->meta_words;
    memcpy(h + o_rows, b->seq_ids, sizeof(int32_t) * ns); /* a sequence's table row is its id */
    for (int s = ns; s < S; s++) h[o_rows + s] = 0;      /* dummies read no table */
    memcpy(h + o_ids, b->token_ids, sizeof(int32_t) * n);
    memcpy(h + o_pos, b->positions, sizeof(int32_t) * n);
    memcpy(h + o_qs, b->query_start, sizeof(int32_t) * (ns + 1));
    for (int i = n; i < T; i++) h[o_ids + i] = h[o_pos + i] = 0;
    for (int s = ns; s < S; s++) h[o_qs + s + 1] = h[o_qs + s] + 1; /* dummies: one token each */
    for (int l = 0; l < L; l++) {
        kvs_layer_meta *lm = &sb->layer_meta[l];
        int32_t *slots = h + lm->slots, *kv_len = h + lm->kv_len, *cap_src = h + lm->cap_src,
                *cap_dst = h + lm->cap_dst;
        const int32_t *rows = in->window_rows + (size_t)l * n;
        memcpy(slots, in->slots + (size_t)l * n, sizeof(int32_t) * n);
        memcpy(kv_len, in->kv_len + (size_t)l * ns, sizeof(int32_t) * ns);
        int max_kv = 0, max_q = 0, n_cap = 0;
        for (int s = 0; s < ns; s++) {
            int q_len = b->query_start[s + 1] - b->query_start[s];
            if (kv_len[s] > max_kv) max_kv = kv_len[s];
            if (q_len > max_q) max_q = q_len;
        }
        /* padded: every row goes through window_capture (-1 skips); eager: only the rows that fill one */
        for (int i = 0; i < n; i++) {
            if (sh->padded) {
                cap_src[i] = i, cap_dst[i] = rows[i];
            } else if (rows[i] >= 0) {
                cap_src[n_cap] = i;
                cap_dst[n_cap++] = rows[i];
            }
        }
        for (int i = n; i < T; i++) slots[i] = -1, cap_src[i] = i, cap_dst[i] = -1;
        for (int s = ns; s < S; s++) kv_len[s] = 0;
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
    /* the forward's view: ids and positions, and every layer's attention batch and rows */
    kvs_forward_state *fs = &sb->fs;
    fs->n_rows = T;
    fs->ids = sb->meta + o_ids;
    fs->positions = sb->meta + o_pos;
    const int32_t *q_start = sb->meta + o_qs, *table_rows = sb->meta + o_rows;
    for (int l = 0; l < L; l++) {
        const kvs_layer_meta *lm = &sb->layer_meta[l];
        int stride;
        const int32_t *tables = kvs_kv_device_layer_tables(dev, l, &stride);
        sb->layer_step[l] = (kvs_layer_step){
            .attn = {S, T, stride, lm->max_q_len, lm->max_kv_len, q_start, sb->meta + lm->kv_len, tables, table_rows,
                     kvs_config_layer_sliding_window(x->cfg, l), sh->n_decode},
            .slots = sb->meta + lm->slots, .cap_src = sb->meta + lm->cap_src, .cap_dst = sb->meta + lm->cap_dst,
            .n_cap = lm->n_cap};
    }
    return KVS_OK;
}
