/* The cache's internal state, shared by kv_cache.c and sparsify.c. */
#ifndef KVS_KV_INTERNAL_H
#define KVS_KV_INTERNAL_H

#include "kv/kv.h"

enum { KVS_KV_SCRATCH_TABLE, KVS_KV_SCRATCH_SCORES, KVS_KV_SCRATCH_KEEP, KVS_KV_SCRATCH_SLOTS };

typedef struct {
    int32_t *blocks; /* physical block ids */
    int n_blocks, cap;
    int len;         /* entries held */
} layer_table;

typedef struct {
    bool used;
    int n_tokens;    /* tokens appended so far (what a full cache would hold) */
    layer_table *layers;
    /* sparsity */
    kvs_kv_policy policy;
    int prompt_len;
    bool prefill_done;
    int *budgets;    /* [n_layers], -1 = full; NULL when the policy is full */
    int *ring_base;  /* [n_layers]: position of the first decode query since the last compaction */
} seq_state;

struct kvs_kv_cache {
    kvs_kv_config cfg;
    kvs_backend *be;
    kvs_kv_pool pool;
    int32_t *free_blocks; /* stack */
    int64_t n_free;
    seq_state *seqs;
    /* window queries and their LSE, per layer: [max_seqs * window_cap] rows; allocated
       when the first sparse policy is set */
    int window_cap;
    void **win_q;
    float **win_lse;
    /* backend scratch for scoring and compaction (block tables, scores, keep
       lists), kept between calls: a device allocation per layer and sequence
       would cost more than the work (and cudaFree synchronises the device) */
    void *scratch[KVS_KV_SCRATCH_SLOTS];
    size_t scratch_cap[KVS_KV_SCRATCH_SLOTS];
};


seq_state *kvs_kv_get_seq(const kvs_kv_cache *kv, int seq_id);
int kvs_kv_blocks_for(const kvs_kv_cache *kv, int entries);
void kvs_kv_release_tail(kvs_kv_cache *kv, layer_table *t, int keep_blocks);
void kvs_kv_free_sparsity(kvs_kv_cache *kv, seq_state *s);
/* kvs_kv_compact from keep lists already in backend memory (d_keep [n_kv_heads *
 * n_keep], each head's list sorted, distinct, < len; not checked) and the layer's
 * block table uploaded to d_tab: kv_gather, then the new length and the freed tail. */
void kvs_kv_compact_uploaded(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *d_keep, const int32_t *d_tab,
                             int n_keep);
/* Backend scratch buffer `slot` of at least bytes (grown on demand); NULL when out of memory. */
void *kvs_kv_scratch(kvs_kv_cache *kv, int slot, size_t bytes);

#endif
