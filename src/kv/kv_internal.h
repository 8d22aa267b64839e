/* The KV module's internal state, shared by its files. They call each other
 * one way only (scripts/check-deps checks it), each using only those above it:
 *   block_pool.c  which blocks are free, held or cached
 *   tables.c      the per-(sequence, layer) block tables
 *   prefix_cache.c, compact.c (the plan), sparsify.c, policy.c, select.c, profile.c
 *   kv_cache.c    a sequence's life: create, reserve, commit, free
 *   device.c      a rank's memory and what it runs: pool bytes, scales, windows,
 *                 scratch, the plan's compactions (it reads the manager, never writes it)
 *   device_tables.c  a rank's copies of the block tables, written from the plan's deltas
 *   one_device.c  a manager with one device of its own (kv_device.h's last part) */
#ifndef KVS_KV_INTERNAL_H
#define KVS_KV_INTERNAL_H

#include "kv/one_device.h"

enum {
    KVS_KV_SCRATCH_TABLE, KVS_KV_SCRATCH_SCORES, KVS_KV_SCRATCH_KEEP, KVS_KV_SCRATCH_DST,
    KVS_KV_SCRATCH_BATCH, /* a plan's SnapKV job list and tables */
    KVS_KV_SCRATCH_SLOTS
};

struct kvs_kv_device {
    kvs_kv_config cfg; /* this rank's heads */
    kvs_backend *be;
    kvs_kv_pool pool;
    float *scales; /* FP8 pools: [n_layers][2][n_kv_heads] in backend memory; else NULL */
    /* the tables' copies (device_tables.c): [n_layers][max_seqs][table_blocks],
       and their cells' (index, block) pairs on the way, pinned halves in turn */
    int32_t *tables;
    int table_blocks;
    int32_t *pairs, *h_pairs;
    int n_pairs, cap_pairs;
    kvs_upload_turns pairs_turns;
    /* window queries and their LSE, per layer: [max_seqs * window_rows] rows
       (kvs_kv_device_prepare_windows, once a sparse policy is set) */
    int window_rows;
    void **win_q;
    float **win_lse;
    /* backend scratch for scoring and compaction (block tables, scores, keep
       lists), kept between calls: a device allocation per layer and sequence
       would cost more than the work (and cudaFree synchronises the device) */
    void *scratch[KVS_KV_SCRATCH_SLOTS];
    size_t scratch_cap[KVS_KV_SCRATCH_SLOTS];
    void *staging[2]; /* pinned, used in turn: a plan's lists are built while the last one's copy may still run */
    size_t staging_cap[2];
    kvs_upload_turns staging_turns; /* which of the two the next plan writes */
};

typedef struct {
    int32_t *blocks; /* physical block ids */
    int n_blocks, cap;
    int len;         /* entries held */
    int changed;     /* the first block changed since the last plan of the devices' tables (kvs_kv_touch) */
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
    uint64_t hash;       /* the prompt block's chain hash (key = it and the layer; KV events name it) */
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
    /* KV events (kvs_kv_enable_events): a prompt block is reusable while
       every layer has a cached block under its hash; the pool logs when one
       becomes reusable and when it stops being so. NULL: off. */
    kvs_kv_event_log *events;
    int64_t n_reusable; /* with events on: the prompt blocks cached in every layer */
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
/* The cached block of prompt block hash in layer whose salt, parent (-1: a
 * prompt's first block) and tokens match; -1 when none verifies. */
int32_t kvs_block_lookup(const kvs_block_pool *p, uint64_t hash, int layer, uint64_t salt_check, int32_t parent,
                         const int32_t *tokens);
/* Caches held block b as prompt block hash of layer (its gen bumped: the
 * children cached under its old content no longer verify). */
void kvs_block_cache(kvs_block_pool *p, int32_t b, uint64_t hash, uint64_t salt_check, int32_t parent, int layer,
                     const int32_t *tokens);
/* Uncaches every cached block (held ones stay held, and are freed when
 * dropped); logs AllBlocksCleared. */
void kvs_block_uncache_all(kvs_block_pool *p);
/* Whether prompt block hash is reusable: cached in every layer. */
bool kvs_block_reusable(const kvs_block_pool *p, uint64_t hash);
static inline bool kvs_block_cached(const kvs_block_pool *p, int32_t b) { return p->meta[b].key != 0; }
static inline int32_t kvs_block_refs(const kvs_block_pool *p, int32_t b) { return p->meta[b].ref; }
/* Free blocks, the evictable ones included (what a reservation may take). */
static inline int64_t kvs_block_pool_available(const kvs_block_pool *p) { return p->n_free + p->n_evictable; }
/* The pool's invariants, holders[b] being what the tables and spare lists hold. */
kvs_status kvs_block_pool_check(const kvs_block_pool *p, const int32_t *holders);

struct kvs_kv_cache {
    kvs_kv_config cfg;
    kvs_block_pool blocks;
    uint64_t (*hash_block)(uint64_t parent_hash, const int32_t *tokens, int n); /* tests force collisions */
    int32_t *sliding;     /* [n_layers]: sliding windows (kvs_kv_set_sliding_windows); NULL: none */
    seq_state *seqs;
    bool windows_wanted;  /* a sparse policy was set: the devices need their window buffers */
    kvs_kv_device *own;   /* kvs_kv_create's device (one_device.c); NULL for the runner's manager */
    kvs_kv_compactions own_plan; /* one_device.c's plans, their arrays reused */
};

/* Every change of a layer table's blocks goes with a touch from the first
 * block that changed: the next plan of the devices' tables sends the blocks
 * from there (kvs_kv_plan_tables). A new table is all changed; blocks dropped
 * at the end need nothing sent (cells past a table's end are never read). */
enum { KVS_KV_UNCHANGED = 1 << 30 };
static inline void kvs_kv_touch_from(layer_table *t, int block) {
    if (block < t->changed) t->changed = block;
}
static inline void kvs_kv_touch(layer_table *t) { t->changed = 0; }

/* device_tables.c: a device's table copies made (zeroed) or freed. */
kvs_status kvs_kv_device_tables_create(kvs_kv_device *d);
void kvs_kv_device_tables_free(kvs_kv_device *d);

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
/* The observation-window rows each sequence has in the window buffers. */
static inline int kvs_kv_window_cap(const kvs_kv_cache *kv) { return kv->cfg.max_window > 0 ? kv->cfg.max_window : 64; }
/* The plan's compactions of (s, layer) (compact.c), added to an emptied plan
 * (kvs_kv_plan_clear): one with keep lists given (keep_heads lists of n_keep,
 * or one for every head), or a SnapKV one, its copy's blocks taken now when the
 * layer is shared or cached. kvs_kv_plan_apply then applies every job to the
 * tables (new lengths, blocks released): after every job's blocks are taken,
 * so that no job writes a block another job of the batch reads. */
static inline void kvs_kv_plan_clear(kvs_kv_compactions *plan) { plan->n_jobs = 0, plan->n_tables = plan->n_keep = 0; }
kvs_status kvs_kv_plan_keep(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer, const int32_t *keep,
                            int n_keep, int keep_heads);
kvs_status kvs_kv_plan_snapkv(kvs_kv_cache *kv, kvs_kv_compactions *plan, seq_state *s, int layer);
void kvs_kv_plan_apply(kvs_kv_cache *kv, const kvs_kv_compactions *plan);
/* Forgets the plan (a job failed before any ran): its copies' blocks go back, the plan is empty. */
void kvs_kv_plan_drop(kvs_kv_cache *kv, kvs_kv_compactions *plan);

#endif
