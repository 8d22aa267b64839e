/* kv: the paged KV cache. One pool of blocks serves every layer; each sequence
 * has a block table and a length per layer, so layers may hold different
 * numbers of entries (sparse layers are compacted to their budget). */
#ifndef KVS_KV_H
#define KVS_KV_H

#include "backend/backend.h"
#include "core/core.h"

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    int block_size; /* tokens per block (16) */
    int64_t n_blocks;
    int max_seqs;   /* sequence ids are 0 .. max_seqs - 1 */
} kvs_kv_config;

typedef struct kvs_kv_cache kvs_kv_cache;

/* Bytes of one block (K and V, all KV heads, one layer) for the backend's kv_dtype. */
size_t kvs_kv_block_bytes(const kvs_kv_config *cfg, kvs_dtype kv_dtype);
/* How many blocks fit in budget_bytes. */
int64_t kvs_kv_blocks_for_budget(const kvs_kv_config *cfg, kvs_dtype kv_dtype, size_t budget_bytes);

kvs_status kvs_kv_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_cache **out);
void kvs_kv_destroy(kvs_kv_cache *kv);
const kvs_kv_config *kvs_kv_get_config(const kvs_kv_cache *kv);
const kvs_kv_pool *kvs_kv_get_pool(const kvs_kv_cache *kv);

/* Sequences: ids are chosen by kv; -1 (and KVS_ERR_NOMEM set) when all are in use. */
int kvs_kv_seq_create(kvs_kv_cache *kv);
void kvs_kv_free(kvs_kv_cache *kv, int seq_id); /* frees every block of the sequence */

/* Blocks needed to grow every layer of seq by n_new tokens (0 if they fit). */
int64_t kvs_kv_blocks_needed(const kvs_kv_cache *kv, int seq_id, int n_new);
/* A fresh prompt of prompt_len tokens fits in every layer at once (its peak). */
bool kvs_kv_can_admit(const kvs_kv_cache *kv, int prompt_len);
/* Allocates blocks so every layer can take n_new more tokens; all or nothing. */
kvs_status kvs_kv_reserve(kvs_kv_cache *kv, int seq_id, int n_new);
/* Marks n_new tokens as written in every layer (after the forward that wrote them). */
void kvs_kv_commit(kvs_kv_cache *kv, int seq_id, int n_new);

/* A layer's block table and length. */
int kvs_kv_len(const kvs_kv_cache *kv, int seq_id, int layer);
const int32_t *kvs_kv_blocks(const kvs_kv_cache *kv, int seq_id, int layer, int *n_blocks);
/* The pool slot of entry e of (seq, layer): block * block_size + e % block_size. */
int32_t kvs_kv_slot(const kvs_kv_cache *kv, int seq_id, int layer, int entry);

/* Keeps, in every KV head h of (seq, layer), entries keep[h * n_keep + i] (each
 * head's list sorted ascending, distinct, < len), moved to entries 0 .. n_keep-1;
 * the layer's length becomes n_keep and blocks past it go back to the pool. */
kvs_status kvs_kv_compact(kvs_kv_cache *kv, int seq_id, int layer, const int32_t *keep, int n_keep);

/* Memory accounting. */
int64_t kvs_kv_free_blocks(const kvs_kv_cache *kv);
int64_t kvs_kv_used_blocks(const kvs_kv_cache *kv);
/* Entries held by seq summed over layers, and what a full cache would hold. */
void kvs_kv_seq_usage(const kvs_kv_cache *kv, int seq_id, int64_t *held, int64_t *full);
/* Checks internal invariants (every block owned once or free); for tests. */
kvs_status kvs_kv_check(const kvs_kv_cache *kv);

#endif
