/* The cache's internal state, shared by its files. They call each other one
 * way only (scripts/check-deps checks it), each using only those above it:
 *   block_pool.c  which blocks are free, held or cached
 *   tables.c      the per-(sequence, layer) block tables
 *   device.c      the backend memory: pool bytes, scales, windows, scratch
 *   prefix_cache.c, compact.c, sparsify.c, policy.c, select.c, profile.c
 *   kv_cache.c    a sequence's life: create, reserve, commit, fork, free */
#ifndef KVS_KV_INTERNAL_H
#define KVS_KV_INTERNAL_H

#include "kv/kv.h"

enum {
    KVS_KV_SCRATCH_TABLE, KVS_KV_SCRATCH_SCORES, KVS_KV_SCRATCH_KEEP, KVS_KV_SCRATCH_DST,
    KVS_KV_SCRATCH_BATCH, /* a sparsify batch's job list and tables (sparsify.c) */
    KVS_KV_SCRATCH_SLOTS
};

typedef struct {
    int32_t *blocks; /* physical block ids */
    int n_blocks, cap;
    int len;         /* entries held */
    uint64_t gen;    /* kvs_kv_touch's stamp of the last change of blocks / n_blocks (kvs_kv_table_gen) */
    uint64_t base;   /* the stamp of the last change other than blocks appended at the end */
} layer_table;

typedef struct {
    bool used;
    int n_tokens;    /* tokens appended so far (what a full cache would hold) */
    layer_table *layers;
    /* prefix caching (prefix_cache.c): the chain hash of each full prompt
       block, the prompt's tokens, how many prompt blocks are cached in every
       layer, and blocks reserved for the compaction at the prompt's end */
    uint64_t *prompt_hash;
    int32_t *prompt_tokens;
    int n_prompt_blocks, n_registered;
    uint64_t salt_check;
    int32_t *spare;
    int n_spare;
    /* sparsity */
    kvs_kv_policy policy;
    int prompt_len;
    bool prefill_done;
    int *budgets;    /* [n_layers], -1 = full; NULL when the policy is full */
    int *ring_base;  /* [n_layers]: position of the first decode query since the last compaction */
} seq_state;

/* A physical block: the tables (and spare lists) holding it and, while it is
 * cached, what it holds: key = hash(salt, every prompt token up to its end,
 * layer); its tokens (kv->tokens), its layer's block for the previous prompt
 * block (parent, with that block's generation) and the salt's second hash
 * verify a hit exactly (a key collision never gives another prompt's KV). */
typedef struct {
    int32_t ref;
    uint64_t key;        /* 0: not cached */
    uint64_t salt_check;
    uint32_t gen;        /* bumped whenever the block is cached anew */
    int32_t parent;      /* -1: the prompt's first block */
    uint32_t parent_gen;
    int32_t layer;
    int32_t hnext;       /* the key's bucket chain */
    int32_t lru_prev, lru_next; /* the evictable list (ref 0, cached) */
} block_meta;

/* ---- block_pool.c: which blocks are free, held or cached ------------------- */
typedef struct {
    int64_t n_blocks;
    int block_size, n_layers;
    int32_t *free_blocks; /* stack of blocks neither held nor cached */
    int64_t n_free;
    block_meta *meta;     /* [n_blocks] */
    /* the cached blocks: their tokens, the hash index by key, the evictable
       ones (no holder) least recently used first */
    int32_t *tokens;      /* [n_blocks * block_size] */
    int32_t *buckets;     /* [n_buckets], -1: empty */
    int64_t n_buckets;
    int32_t lru_head, lru_tail;
    int64_t n_evictable, *cached_per_layer;
    uint64_t evictions;
} kvs_block_pool;

/* Every block free; with caching, the index and the tokens too. */
kvs_status kvs_block_pool_init(kvs_block_pool *p, int64_t n_blocks, int block_size, int n_layers, bool caching);
void kvs_block_pool_release(kvs_block_pool *p);
/* A block for a new holder (ref 1): a free one, else the least recently used
 * evictable one (evicted); -1 when neither exists. */
int32_t kvs_block_take(kvs_block_pool *p);
/* One holder more for a held or evictable (cached) block. */
void kvs_block_hold(kvs_block_pool *p, int32_t b);
/* One holder fewer; at none the block is free, or evictable when cached. */
void kvs_block_drop(kvs_block_pool *p, int32_t b);
/* The cached block under key whose salt, parent (-1: a prompt's first block)
 * and tokens match; -1 when none verifies. */
int32_t kvs_block_lookup(const kvs_block_pool *p, uint64_t key, uint64_t salt_check, int32_t parent,
                         const int32_t *tokens);
/* Caches held block b under key (its gen bumped: the children cached under
 * its old content no longer verify). */
void kvs_block_cache(kvs_block_pool *p, int32_t b, uint64_t key, uint64_t salt_check, int32_t parent, int layer,
                     const int32_t *tokens);
static inline bool kvs_block_cached(const kvs_block_pool *p, int32_t b) { return p->meta[b].key != 0; }
static inline int32_t kvs_block_refs(const kvs_block_pool *p, int32_t b) { return p->meta[b].ref; }
/* Free blocks, the evictable ones included (what a reservation may take). */
static inline int64_t kvs_block_pool_available(const kvs_block_pool *p) { return p->n_free + p->n_evictable; }
/* The pool's invariants, holders[b] being what the tables and spare lists hold. */
kvs_status kvs_block_pool_check(const kvs_block_pool *p, const int32_t *holders);

struct kvs_kv_cache {
    kvs_kv_config cfg;
    kvs_backend *be;
    kvs_kv_pool pool;
    float *scales; /* FP8 pools: [n_layers][2][n_kv_heads] in backend memory (kvs_kv_set_scales); else NULL */
    kvs_block_pool blocks;
    uint64_t (*hash_block)(uint64_t parent_hash, const int32_t *tokens, int n); /* tests force collisions */
    int32_t *window;      /* [n_layers]: sliding windows (kvs_kv_set_windows); NULL: none */
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
    /* kvs_kv_sparsify_seqs's batch: the (sequence, layer) pairs it collects (a pair
       whose table is shared or cached: n_own blocks of the sequence's own for the
       compacted copy, batch_own[own ..]), and the pinned host staging of their job
       list and tables (backend host_alloc) */
    struct { int32_t seq, layer, own, n_own; } *batch;
    int n_batch, batch_cap;
    int32_t *batch_own;
    int n_batch_own, batch_own_cap;
    void *staging[2]; /* two, used in turn: a batch is built while the last one's copy may still run */
    size_t staging_cap[2];
    kvs_upload_turns staging_turns; /* which of the two the next batch writes */
};

/* Every change of a layer table's blocks or n_blocks goes with a touch: a
 * stamp never given before in the process (any cache, any thread), so a copy
 * of the table taken at stamp g is current while the table's gen is g (the
 * model's device-resident block tables, which may outlive a cache).
 * kvs_kv_touch_append after blocks appended at the end, and nothing else
 * changed: a copy whose base stamp is still the table's needs only the new
 * blocks. */
uint64_t kvs_kv_new_stamp(void);
static inline void kvs_kv_touch(layer_table *t) { t->gen = t->base = kvs_kv_new_stamp(); }
static inline void kvs_kv_touch_append(layer_table *t) { t->gen = kvs_kv_new_stamp(); }


seq_state *kvs_kv_get_seq(const kvs_kv_cache *kv, int seq_id);
/* With prefix caching, a layer compacted at the prompt's end (budget < the
 * prompt) is compacted into blocks of the sequence's own, the prompt's blocks
 * staying cached: the blocks of its budget, reserved with the tokens that end
 * the prompt so that the compaction never runs dry. Their sum over the layers
 * (budgets as kvs_kv_policy_budgets; -1 full). The pool's reservation
 * (kv_cache.c) and a workload's sizing (kvs_kv_policy_seq_blocks) both count
 * them this way. */
int kvs_kv_compaction_spare(const int *budgets, int n_layers, int block_size, int prompt_len);
/* ---- prefix_cache.c ------------------------------------------------------------ */
/* The chain hash of a prompt block (its tokens after its parent's hash); a
 * cache's hash_block unless a test forces collisions. */
uint64_t kvs_kv_hash_block(uint64_t parent_hash, const int32_t *tokens, int n);
/* After a commit: caches the prompt blocks that every layer now holds in full. */
void kvs_kv_register_prompt(kvs_kv_cache *kv, seq_state *s);
/* Whether compacting the layer must write to other blocks (its blocks are
 * shared or cached), and the prefix state's host memory freed. */
bool kvs_kv_table_shared(const kvs_kv_cache *kv, const layer_table *t);
void kvs_kv_free_prefix(kvs_kv_cache *kv, seq_state *s);
int kvs_kv_blocks_for(const kvs_kv_cache *kv, int entries);
void kvs_kv_release_tail(kvs_kv_cache *kv, layer_table *t, int keep_blocks);
void kvs_kv_free_sparsity(kvs_kv_cache *kv, seq_state *s);
/* kvs_kv_compact from keep lists already in backend memory (d_keep [n_kv_heads *
 * n_keep], each head's list sorted, distinct, < len; not checked) and the layer's
 * block table uploaded to d_tab: kv_gather (in place, or into blocks of the
 * sequence's own when the layer's are shared or cached), then the new length
 * and the released blocks. */
kvs_status kvs_kv_compact_uploaded(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *d_keep,
                                   const int32_t *d_tab, int n_keep);
/* The host side of an in-place compaction of (s, layer) to n_keep entries (its
 * kv_gather enqueued): the new length, the blocks past it released. */
void kvs_kv_compacted_in_place(kvs_kv_cache *kv, seq_state *s, int layer, int n_keep);
/* nb blocks of s's own for a compacted copy (its spare blocks first) into own;
 * KVS_ERR_NOMEM (none taken) when the pool runs dry. */
kvs_status kvs_kv_take_own_blocks(kvs_kv_cache *kv, seq_state *s, int nb, int32_t *own);
/* The host side of a compaction of (s, layer) into own[0 .. nb) (its kv_gather
 * enqueued): the old blocks released, own the table, n_keep its length. */
void kvs_kv_compacted_into(kvs_kv_cache *kv, seq_state *s, int layer, const int32_t *own, int nb, int n_keep);
/* The observation-window rows each sequence has in the window buffers. */
static inline int kvs_kv_window_cap(const kvs_kv_cache *kv) { return kv->cfg.max_window > 0 ? kv->cfg.max_window : 64; }
/* The window buffers (win_q, win_lse: every layer's), made at the first sparse policy. */
kvs_status kvs_kv_alloc_windows(kvs_kv_cache *kv);
/* Backend scratch buffer `slot` of at least bytes (grown on demand); NULL when out of memory. */
void *kvs_kv_scratch(kvs_kv_cache *kv, int slot, size_t bytes);
/* The pinned host staging (backend host_alloc) of at least bytes, grown the same
 * way: the one of the two whose copy has run (waited for only when no wait for
 * the device came since it was sent); kvs_kv_staging_sent after its to_device. */
void *kvs_kv_staging(kvs_kv_cache *kv, size_t bytes);
void kvs_kv_staging_sent(kvs_kv_cache *kv);

#endif
