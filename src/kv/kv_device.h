/* kv device: one rank's memory of the KV cache (docs/DESIGN.md, "The memory
 * story"). The pool's bytes for the rank's KV heads, an FP8 pool's scales, the
 * copies of the block tables the attention reads, the SnapKV observation
 * windows (the last prompt and decode queries of each sequence, and their
 * log-sum-exp), and the scratch and pinned staging the compactions use. It
 * knows nothing of sequences but their ids as row numbers: the KV manager
 * (kv.h) decides which blocks hold what, which table cells changed and which
 * compactions are due, and every rank's device applies the same plans on its
 * own heads. Everything a device is handed is plain arrays, so that a rank in
 * another process could be sent it. */
#ifndef KVS_KV_DEVICE_H
#define KVS_KV_DEVICE_H

#include "backend/backend.h"
#include "core/core.h"

/* Tokens per block of the pools the engine and the commands make. */
#define KVS_KV_BLOCK_SIZE 16

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    int n_heads;    /* query heads (for the sparsity scores' window queries) */
    int block_size; /* tokens per block (KVS_KV_BLOCK_SIZE) */
    int64_t n_blocks;
    int max_seqs;   /* sequence ids are 0 .. max_seqs - 1 */
    int max_len;    /* entries a sequence may hold in a layer (0: as many as n_blocks hold) */
    int max_window; /* largest observation window a policy may use (0: 64) */
    bool prefix_caching; /* keep full prompt blocks cached for later sequences (kvs_kv_prefix_attach) */
} kvs_kv_config;

/* Bytes of one block (K and V, all KV heads, one layer) for the backend's kv_dtype. */
size_t kvs_kv_block_bytes(const kvs_kv_config *cfg, kvs_dtype kv_dtype);
/* How many blocks fit in budget_bytes. */
int64_t kvs_kv_blocks_for_budget(const kvs_kv_config *cfg, kvs_dtype kv_dtype, size_t budget_bytes);
/* The blocks a sequence's table may hold in a layer (max_len's, or n_blocks),
 * and the bytes of a device's table copies ([n_layers][max_seqs][that]). */
int kvs_kv_table_blocks(const kvs_kv_config *cfg);
size_t kvs_kv_device_table_bytes(const kvs_kv_config *cfg);

typedef struct kvs_kv_device kvs_kv_device;

/* A device for cfg's geometry, heads as this rank holds them (its slice of
 * n_kv_heads and n_heads), n_blocks blocks on be. An FP8 pool's scales start
 * at 1 (kvs_kv_device_set_scales); the tables at block 0 everywhere. */
kvs_status kvs_kv_device_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_device **out);
void kvs_kv_device_destroy(kvs_kv_device *d);
const kvs_kv_config *kvs_kv_device_config(const kvs_kv_device *d);
kvs_backend *kvs_kv_device_backend(const kvs_kv_device *d);
const kvs_kv_pool *kvs_kv_device_pool(const kvs_kv_device *d);
/* Layer's view of the pool for the backend's ops: the same blocks, with that
 * layer's K and V scales when the pool is FP8 (backend.h kvs_kv_pool). */
kvs_kv_pool kvs_kv_device_layer_pool(const kvs_kv_device *d, int layer);
/* An FP8 pool's scales: host [n_layers][2][n_kv_heads] (per layer the K scales
 * of this device's KV heads, then the V scales), each finite and positive
 * (NULL: every one 1). Ignored (KVS_OK) when the pool is not FP8. Set them
 * before the first write: codes already written keep the old scales. */
kvs_status kvs_kv_device_set_scales(kvs_kv_device *d, const float *scales);

/* ---- the block tables' copies ----------------------------------------------
 * Backend memory [n_layers][max_seqs][kvs_kv_table_blocks], the row of a
 * sequence its id (past a table's end: stale). The manager says which cells
 * changed (kvs_kv_plan_tables): blocks first .. first + n of (seq, layer) are
 * blocks[at .. at + n). A decode step appends a block to a table every
 * block_size tokens: a few cells a step, not every table of the batch. */
typedef struct {
    int32_t seq, layer, first, n;
    int64_t at;
} kvs_kv_table_delta;
typedef struct {
    int n_deltas, cap_deltas;
    kvs_kv_table_delta *deltas;
    int32_t *blocks;
    int64_t n_blocks, cap_blocks;
} kvs_kv_table_deltas;
/* Writes the cells (uploaded as (cell, block) pairs in rounds and scattered;
 * returns without waiting). */
kvs_status kvs_kv_device_apply_tables(kvs_kv_device *d, const kvs_kv_table_deltas *t);
/* Layer's tables: the row of sequence s starts at the result + s * stride. */
const int32_t *kvs_kv_device_layer_tables(const kvs_kv_device *d, int layer, int *stride);

/* ---- the observation windows ---------------------------------------------------
 * Made once the manager has a sparse policy (kvs_kv_windows_wanted): rows
 * [max_seqs * rows_per_seq], q [rows][n_heads * head_dim] (act dtype) and lse
 * [rows][n_heads] (f32) per layer. Nothing when they exist. */
kvs_status kvs_kv_device_prepare_windows(kvs_kv_device *d, int rows_per_seq);
/* A layer's window buffers (NULL, NULL before they are made). */
void kvs_kv_device_window_buffers(const kvs_kv_device *d, int layer, void **q, float **lse);

/* ---- the compaction plan -------------------------------------------------------
 * Made by the manager (kvs_kv_plan_compactions), applied to its tables there,
 * run by every device on its heads before the next step's forward. */
typedef enum {
    KVS_COMPACT_SNAPKV, /* keep lists chosen on the device from the window's scores */
    KVS_COMPACT_KEEP,   /* keep lists given: keep[keep .. + n_keep] for every head (StreamingLLM), or
                           [n_keep_heads][n_keep] (kvs_kv_compact) */
} kvs_compaction_kind;
typedef struct {
    int32_t kind, seq, layer;
    int32_t n_keep;              /* the layer's new length */
    int32_t table, n_blocks;     /* its table before: tables[table .. + n_blocks) */
    int32_t dst_table, dst_blocks; /* its copy's table: tables[dst_table .. + dst_blocks); 0 blocks: in place */
    int32_t n_keys, n_win, pool; /* SnapKV: entries scored [0, n_keys), the window after them, the max-pool */
    int32_t window_row;          /* SnapKV: the sequence's first window row */
    int64_t keep;                /* KEEP: its lists in keep[] */
    int32_t keep_heads;          /* KEEP: 1 (one list for every head) or the lists' heads */
} kvs_kv_compaction;
typedef struct {
    int n_jobs;
    kvs_kv_compaction *jobs;
    int32_t *tables;
    int32_t *keep;
    int cap_jobs;
    size_t n_tables, cap_tables, n_keep, cap_keep;
} kvs_kv_compactions;
/* Enqueues the plan's compactions on this device's heads: the ones with keep
 * lists first, one by one, then every SnapKV job in one snapkv_compact_batch.
 * Returns without waiting (the staging of the batch's lists alternates between
 * two pinned buffers). */
kvs_status kvs_kv_device_compact(kvs_kv_device *d, const kvs_kv_compactions *plan);
/* Copies blocks src[i] to dst[i] and the window rows of sequence from_seq to
 * to_seq (a fork; from_seq -1: no windows). */
kvs_status kvs_kv_device_copy(kvs_kv_device *d, const int32_t *src, const int32_t *dst, int n, int from_seq, int to_seq);

#endif
