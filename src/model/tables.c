/* The block tables of the steps' sequences, kept in backend memory from step
 * to step (model_internal.h kvs_block_tables): a row per sequence of the step,
 * kept while the sequence keeps coming back; a row another sequence needs is
 * taken from one the step does not use. Each step compares every (row, layer)
 * table's stamp with the KV module's (kvs_kv_table_gen: a new stamp whenever a
 * table's blocks change) and sends the changed tables' blocks up as (cell,
 * block) pairs for scatter_i32: the appended ones when blocks were only
 * appended since the row was written (the base stamp unchanged), else the
 * whole table. A decode step appends a block to a table every block_size
 * tokens: a few hundred cells a step instead of every table of the batch. */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

void kvs_tables_reset(kvs_block_tables *t) {
    for (int r = 0; r < t->rows; r++) t->row_seq[r] = -1, t->row_step[r] = 0;
    memset(t->held, 0, sizeof(kvs_table_held) * (size_t)t->rows * t->n_layers);
    for (int i = 0; i < t->n_seq_row; i++) t->seq_row[i] = -1;
    t->n_pairs = 0, t->next_free = 0, t->step = 0;
}

static int32_t *half(kvs_block_tables *t) { return t->h_pairs + (size_t)t->pairs_turns.half * 2 * t->cap_pairs; }

/* The pairs gathered so far up and written; the next half of the pinned buffer
 * takes the next ones. (The backend's pairs buffer is reused at once: the
 * scatter ran before the next upload in the stream.) */
static void flush(kvs_model *m) {
    kvs_block_tables *t = &m->buf.tables;
    if (t->n_pairs == 0) return;
    kvs_backend *be = m->be;
    be->to_device(be, t->pairs, half(t), sizeof(int32_t) * 2 * (size_t)t->n_pairs);
    be->scatter_i32(be, t->dev, t->pairs, t->n_pairs);
    kvs_turn_sent(be, &t->pairs_turns);
    t->n_pairs = 0;
}

static void put(kvs_model *m, size_t cell, int32_t block) {
    kvs_block_tables *t = &m->buf.tables;
    if (t->n_pairs == t->cap_pairs) flush(m);
    if (t->n_pairs == 0) kvs_turn_take(m->be, &t->pairs_turns); /* its last upload has run */
    int32_t *h = half(t);
    h[2 * t->n_pairs] = (int32_t)cell;
    h[2 * t->n_pairs + 1] = block;
    t->n_pairs++;
}

/* The row of seq: its own when it still has one, else a row no sequence of
 * this step uses (the search goes round from where the last one ended, so a
 * row just given up is reused last). -1 if none (cannot happen: rows >= the
 * step's sequences). */
static int row_for(kvs_block_tables *t, int seq) {
    if (seq >= t->n_seq_row) {
        int n = t->n_seq_row ? t->n_seq_row : 64;
        while (n <= seq) n *= 2;
        int32_t *g = realloc(t->seq_row, sizeof(int32_t) * (size_t)n);
        if (!g) return -1;
        for (int i = t->n_seq_row; i < n; i++) g[i] = -1;
        t->seq_row = g, t->n_seq_row = n;
    }
    int r = t->seq_row[seq];
    if (r >= 0 && t->row_seq[r] == seq) return r;
    for (int k = 0; k < t->rows; k++) {
        r = (t->next_free + k) % t->rows;
        if (t->row_step[r] == t->step) continue; /* this step's */
        if (t->row_seq[r] >= 0) t->seq_row[t->row_seq[r]] = -1;
        t->row_seq[r] = seq;
        t->seq_row[seq] = r;
        memset(t->held + (size_t)r * t->n_layers, 0, sizeof(kvs_table_held) * t->n_layers); /* nothing of seq yet */
        t->next_free = (r + 1) % t->rows;
        return r;
    }
    return -1;
}

kvs_status kvs_tables_update(kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv, int32_t *rows_out) {
    kvs_block_tables *t = &m->buf.tables;
    t->step++;
    for (int s = 0; s < b->n_seqs; s++) {
        int r = row_for(t, b->seq_ids[s]);
        if (r < 0) return kvs_fail(KVS_ERR_NOMEM, "forward: no block table row for sequence %d", b->seq_ids[s]);
        t->row_step[r] = t->step;
        rows_out[s] = r;
    }
    for (int s = 0; s < b->n_seqs; s++) {
        int seq = b->seq_ids[s], r = rows_out[s];
        kvs_table_held *held = t->held + (size_t)r * t->n_layers;
        for (int l = 0; l < t->n_layers; l++) {
            uint64_t base, gen = kvs_kv_table_gen(kv, seq, l, &base);
            kvs_table_held *h = &held[l];
            if (gen == h->gen) continue;
            int nb;
            const int32_t *blocks = kvs_kv_blocks(kv, seq, l, &nb);
            size_t cell = ((size_t)l * t->rows + r) * t->blocks;
            for (int i = h->gen && base == h->base && nb >= h->n ? h->n : 0; i < nb; i++) put(m, cell + i, blocks[i]);
            *h = (kvs_table_held){gen, base, nb};
        }
    }
    flush(m);
    return KVS_OK;
}

kvs_status kvs_tables_check(kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv) {
    kvs_block_tables *t = &m->buf.tables;
    size_t cells = (size_t)t->n_layers * t->rows * t->blocks;
    int32_t *dev = malloc(sizeof(int32_t) * cells);
    if (!dev) return kvs_fail(KVS_ERR_NOMEM, "tables check: out of memory");
    m->be->to_host(m->be, dev, t->dev, sizeof(int32_t) * cells);
    kvs_status st = KVS_OK;
    for (int s = 0; s < b->n_seqs && st == KVS_OK; s++) {
        int seq = b->seq_ids[s], r = seq < t->n_seq_row ? t->seq_row[seq] : -1;
        if (r < 0 || t->row_seq[r] != seq) {
            st = kvs_fail(KVS_ERR_INTERNAL, "tables check: sequence %d has no row", seq);
            break;
        }
        for (int l = 0; l < t->n_layers && st == KVS_OK; l++) {
            int nb;
            const int32_t *blocks = kvs_kv_blocks(kv, seq, l, &nb);
            size_t base = ((size_t)l * t->rows + r) * t->blocks;
            for (int i = 0; i < nb; i++)
                if (dev[base + i] != blocks[i]) {
                    st = kvs_fail(KVS_ERR_INTERNAL,
                                  "tables check: sequence %d layer %d block %d is %d in the KV cache, %d on the device",
                                  seq, l, i, blocks[i], dev[base + i]);
                    break;
                }
        }
    }
    free(dev);
    return st;
}
