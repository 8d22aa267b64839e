/* A rank's copies of the block tables (kv_device.h): [n_layers][max_seqs]
 * [table_blocks] in backend memory, kept from step to step and written from
 * the manager's deltas (kvs_kv_plan_tables) as (cell, block) pairs that the
 * scatter_i32 op writes: a step uploads the cells that changed, not the
 * tables (a decode step's padded tables were up to 16.8 MB, filled and
 * uploaded while the GPU waited). */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

int kvs_kv_table_blocks(const kvs_kv_config *cfg) {
    int64_t b = cfg->max_len > 0 ? (cfg->max_len + cfg->block_size - 1) / cfg->block_size : cfg->n_blocks;
    return b > 0 ? (int)(b < INT32_MAX ? b : INT32_MAX) : 1;
}

static size_t table_cells(const kvs_kv_config *cfg) {
    return (size_t)cfg->n_layers * (size_t)cfg->max_seqs * (size_t)kvs_kv_table_blocks(cfg);
}

/* The pairs' rounds: at most this many cells at a time. */
static int pairs_cap(const kvs_kv_config *cfg) {
    size_t cells = table_cells(cfg);
    return (int)(cells < (1u << 20) ? cells : (1u << 20));
}

size_t kvs_kv_device_table_bytes(const kvs_kv_config *cfg) {
    return sizeof(int32_t) * (table_cells(cfg) + 2 * (size_t)pairs_cap(cfg));
}

kvs_status kvs_kv_device_tables_create(kvs_kv_device *d) {
    const kvs_kv_config *c = &d->cfg;
    kvs_backend *be = d->be;
    size_t cells = table_cells(c);
    if (cells > INT32_MAX)
        return kvs_fail(KVS_ERR_INVALID, "kv cache: the block tables of %d sequences of %d blocks in %d layers are "
                        "%zu cells, more than 2^31: lower max_num_seqs or max_model_len", c->max_seqs,
                        kvs_kv_table_blocks(c), c->n_layers, cells);
    d->table_blocks = kvs_kv_table_blocks(c);
    d->cap_pairs = pairs_cap(c);
    d->tables = be->alloc(be, sizeof(int32_t) * cells);
    d->pairs = be->alloc(be, sizeof(int32_t) * 2 * (size_t)d->cap_pairs);
    d->h_pairs = be->host_alloc(be, sizeof(int32_t) * 4 * (size_t)d->cap_pairs); /* two halves */
    if (!d->tables || !d->pairs || !d->h_pairs)
        return kvs_fail(KVS_ERR_NOMEM, "kv cache: cannot allocate the block tables (%zu bytes)",
                        kvs_kv_device_table_bytes(c));
    /* block 0 wherever a kernel might look past a table */
    size_t chunk = 4 * (size_t)d->cap_pairs;
    memset(d->h_pairs, 0, sizeof(int32_t) * chunk);
    for (size_t i = 0; i < cells; i += chunk) {
        be->to_device(be, d->tables + i, d->h_pairs, sizeof(int32_t) * (cells - i < chunk ? cells - i : chunk));
        be->synchronize(be); /* h_pairs is read by the copy */
    }
    return KVS_OK;
}

void kvs_kv_device_tables_free(kvs_kv_device *d) {
    kvs_backend *be = d->be;
    if (d->tables) be->free(be, d->tables);
    if (d->pairs) be->free(be, d->pairs);
    if (d->h_pairs) be->host_free(be, d->h_pairs);
}

static int32_t *half(kvs_kv_device *d) { return d->h_pairs + (size_t)d->pairs_turns.half * 2 * d->cap_pairs; }

/* The pairs gathered so far up and written; the next half of the pinned buffer
 * takes the next ones. (The backend's pairs buffer is reused at once: the
 * scatter ran before the next upload in the stream.) */
static void flush(kvs_kv_device *d) {
    if (d->n_pairs == 0) return;
    kvs_backend *be = d->be;
    be->to_device(be, d->pairs, half(d), sizeof(int32_t) * 2 * (size_t)d->n_pairs);
    be->scatter_i32(be, d->tables, d->pairs, d->n_pairs);
    kvs_turn_sent(be, &d->pairs_turns);
    d->n_pairs = 0;
}

kvs_status kvs_kv_device_apply_tables(kvs_kv_device *d, const kvs_kv_table_deltas *t) {
    const kvs_kv_config *c = &d->cfg;
    for (int i = 0; i < t->n_deltas; i++) {
        const kvs_kv_table_delta *x = &t->deltas[i];
        if (x->seq < 0 || x->seq >= c->max_seqs || x->layer < 0 || x->layer >= c->n_layers || x->first < 0 ||
            x->n < 0 || x->first + (int64_t)x->n > d->table_blocks || x->at < 0 || x->at + x->n > t->n_blocks)
            return kvs_fail(KVS_ERR_INVALID, "kv device: a table change (sequence %d, layer %d, blocks %d + %d) "
                            "outside the tables (%d sequences, %d layers, %d blocks)", x->seq, x->layer, x->first,
                            x->n, c->max_seqs, c->n_layers, d->table_blocks);
        size_t row = ((size_t)x->layer * c->max_seqs + x->seq) * d->table_blocks;
        for (int k = 0; k < x->n; k++) {
            if (d->n_pairs == d->cap_pairs) flush(d);
            if (d->n_pairs == 0) kvs_turn_take(d->be, &d->pairs_turns); /* its last upload has run */
            int32_t *h = half(d) + 2 * (size_t)d->n_pairs++;
            h[0] = (int32_t)(row + x->first + k);
            h[1] = t->blocks[x->at + k];
        }
    }
    flush(d);
    return KVS_OK;
}

const int32_t *kvs_kv_device_layer_tables(const kvs_kv_device *d, int layer, int *stride) {
    *stride = d->table_blocks;
    return d->tables + (size_t)layer * d->cfg.max_seqs * d->table_blocks;
}
