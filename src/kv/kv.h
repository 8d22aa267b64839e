/* kv: the KV manager, one per engine whatever the tensor-parallel size
 * (docs/DESIGN.md, "The memory story"). One pool of blocks serves every layer;
 * each sequence has a block table and a length per layer, so layers may hold
 * different numbers of entries (sparse layers are compacted to their budget).
 * Host memory only: the bytes are each rank's kvs_kv_device (kv_device.h),
 * which runs the compactions the manager plans (kvs_kv_plan_compactions). */
#ifndef KVS_KV_H
#define KVS_KV_H

#include "backend/backend.h"
#include "core/core.h"
#include "kv/kv_device.h"
#include "kv/kv_policy.h"

typedef struct kvs_kv_cache kvs_kv_cache;

/* A manager without memory of its own: the runner's, whose ranks each hold a
 * kvs_kv_device of the same n_blocks (one_device.h: a manager with one). */
kvs_status kvs_kv_manager_create(const kvs_kv_config *cfg, kvs_kv_cache **out);
void kvs_kv_destroy(kvs_kv_cache *kv);
const kvs_kv_config *kvs_kv_get_config(const kvs_kv_cache *kv);

/* Sequences: ids are chosen by kv; -1 (and KVS_ERR_NOMEM set) when all are in use. */
int kvs_kv_seq_create(kvs_kv_cache *kv);
void kvs_kv_free(kvs_kv_cache *kv, int seq_id); /* frees every block of the sequence */

/* Blocks needed to grow every layer of seq by n_new tokens (0 if they fit). */
int64_t kvs_kv_blocks_needed(const kvs_kv_cache *kv, int seq_id, int n_new);
/* Allocates blocks so every layer can take n_new more tokens; all or nothing. */
kvs_status kvs_kv_reserve(kvs_kv_cache *kv, int seq_id, int n_new);
/* Marks n_new tokens as written in every layer (after the forward that wrote them). */
void kvs_kv_commit(kvs_kv_cache *kv, int seq_id, int n_new);

/* Sliding-window attention (Mistral's and Qwen's sliding_window): window[l] > 0
 * makes layer l a window layer whose query sees its own entry and the
 * window[l] - 1 before it (backend.h's kvs_attn_batch.window); [n_layers],
 * copied; NULL or all 0: none. A window layer keeps its entries as a run of
 * consecutive positions and its memory bounded: kvs_kv_commit drops its
 * leading blocks once no later query can see them, so it holds fewer than
 * window + block_size + the step's tokens. Sparse policies leave window
 * layers alone (they are bounded already) and compact the others; prefix
 * caching is turned off (a window layer's table no longer starts at the prompt). */
kvs_status kvs_kv_set_sliding_windows(kvs_kv_cache *kv, const int32_t *window);
int kvs_kv_layer_sliding_window(const kvs_kv_cache *kv, int layer); /* 0: not a window layer */

/* A layer's block table and length. */
int kvs_kv_len(const kvs_kv_cache *kv, int seq_id, int layer);
const int32_t *kvs_kv_blocks(const kvs_kv_cache *kv, int seq_id, int layer, int *n_blocks);
/* The changed cells of the seq_ids' tables for the devices' copies
 * (kv_device.h): of each (sequence, layer), the blocks from the first one that
 * changed since the last plan that named the sequence (every block of a
 * sequence new since then); the plan forgets the changes it gives. Refills
 * *out (its arrays reused; free with kvs_kv_table_deltas_free). */
kvs_status kvs_kv_plan_tables(kvs_kv_cache *kv, const int32_t *seq_ids, int n, kvs_kv_table_deltas *out);
void kvs_kv_table_deltas_free(kvs_kv_table_deltas *t);
/* The pool slots (block * block_size + entry % block_size) of entries entry0 ..
   entry0 + n - 1 of (seq, layer) into slots[0 .. n) (a step's new tokens: one
   lookup of the table, then a block's run of slots at a time). */
void kvs_kv_slots(const kvs_kv_cache *kv, int seq_id, int layer, int entry0, int n, int32_t *slots);

/* Sets seq's policy for a prompt of prompt_len tokens (before its prefill). */
kvs_status kvs_kv_set_policy(kvs_kv_cache *kv, int seq_id, const kvs_kv_policy *p, int prompt_len);
/* The rows of the window buffers that the queries of (seq, layer) at
 * positions[0 .. n) fill, into rows[0 .. n), or -1: the last `window` prompt
 * positions, then every decode token of a sparse layer (a ring). Rows index
 * [max_seqs * kvs_kv_window_rows_per_seq]. */
void kvs_kv_window_rows(const kvs_kv_cache *kv, int seq_id, int layer, const int32_t *positions, int n, int32_t *rows);
int kvs_kv_window_rows_per_seq(const kvs_kv_cache *kv);
/* Whether a sparse policy was set: every device then needs its window buffers
 * (kvs_kv_device_prepare_windows). */
bool kvs_kv_windows_wanted(const kvs_kv_cache *kv);

/* ---- the compaction plan ---------------------------------------------------
 * After a step that gave the n sequences seq_ids new tokens (committed), their
 * sparse layers that are due (a prompt just completed, or a layer reached B_l
 * + window) are compacted. The manager decides it all at once and applies it
 * to its tables (new lengths, blocks released, a shared or cached layer's
 * copy given blocks of the sequence's own); every device then runs the same
 * plan on its heads (kvs_kv_device_compact) before the next step's forward.
 * Plain arrays, no pointers into the manager (kv_device.h kvs_kv_compactions):
 * the plan is what a rank in another process would be sent. The plan for seq_ids (arrays reused from the last plan in *plan; free with
 * kvs_kv_compactions_free). All or nothing: on failure (out of memory) the
 * tables are as they were and the plan empty. */
kvs_status kvs_kv_plan_compactions(kvs_kv_cache *kv, const int32_t *seq_ids, int n, kvs_kv_compactions *plan);
void kvs_kv_compactions_free(kvs_kv_compactions *plan);

/* Host helpers of the selection, exposed for tests: max-pool of s[0..n) with
 * kernel p (stride 1, same size, borders use the part inside), then the k
 * largest, returned sorted ascending in out[0..k). */
void kvs_kv_pool_scores(const float *s, int n, int p, float *out);
void kvs_kv_top_k_sorted(const float *s, int n, int k, int32_t *out);

/* ---- prefix caching (cfg.prefix_caching; docs/SPARSITY.md) ------------------
 * Every block has a reference count (the tables holding it). A full block of a
 * sequence's prompt is cached once every layer has committed it: keyed by a
 * hash of the salt, every prompt token up to the block's end and the layer,
 * and verified exactly on a hit (its tokens, its parent block, the salt). A
 * cached block nobody holds is evictable: it counts as free, and is taken
 * (evicted) least recently used first when no free block is left. Compaction
 * never writes a cached or shared block: such a layer is compacted into
 * blocks of its own, reserved with the tokens that complete the prompt
 * (kvs_kv_blocks_needed counts them), and the prompt's blocks stay cached at
 * full resolution. A fork shares the cached blocks and copies the rest. */
/* Gives the fresh sequence seq (after kvs_kv_set_policy, before any token)
 * the longest cached prefix of prompt[0 .. n_prompt) under salt (NULL: none),
 * whole blocks, at most max_tokens tokens, in every layer, as committed
 * tokens; remembers the prompt so that its blocks are cached as they are
 * committed. Returns the tokens reused (0 without prefix caching). */
int kvs_kv_prefix_attach(kvs_kv_cache *kv, int seq_id, const int32_t *prompt, int n_prompt, const char *salt,
                         int max_tokens);
int64_t kvs_kv_cached_blocks(const kvs_kv_cache *kv, int layer); /* cached blocks of a layer, held or evictable */
int64_t kvs_kv_evictable_blocks(const kvs_kv_cache *kv);
uint64_t kvs_kv_evictions(const kvs_kv_cache *kv);                /* cached blocks taken for other use */

/* ---- KV events (serve --kv-events-config; docs/SERVING.md) --------------------
 * A prompt block is reusable while every layer holds it cached (what
 * kvs_kv_prefix_attach can give a new request). With events on, the manager
 * logs each prompt block that becomes reusable (stored: its chain hash, its
 * parent's, its tokens), each that stops being so (removed: a layer's copy
 * was evicted) and a reset of the whole cache (cleared), in order. Compacted
 * blocks are a sequence's own, never cached: never logged. */
typedef enum { KVS_KV_EVENT_STORED, KVS_KV_EVENT_REMOVED, KVS_KV_EVENT_CLEARED } kvs_kv_event_kind;
typedef struct {
    kvs_kv_event_kind kind;
    bool has_parent;           /* stored: not the prompt's first block */
    uint64_t hash, parent_hash;
    int64_t token0;            /* stored: its block_size tokens are tokens[token0 ..] */
} kvs_kv_event;
typedef struct {
    kvs_kv_event *events;
    int n, cap;
    int32_t *tokens;
    int n_tokens, cap_tokens;  /* a step's stored blocks' tokens */
    int block_size;
    bool lost;                 /* an event could not be logged (out of memory): what a
                                  subscriber knows is stale; say AllBlocksCleared after these */
} kvs_kv_event_log;
/* Turns the events on (from now: announce nothing cached before). */
kvs_status kvs_kv_enable_events(kvs_kv_cache *kv);
/* Moves the events logged since the last take into *out (emptied first, its
 * arrays swapped with the manager's: no copy). */
void kvs_kv_take_events(kvs_kv_cache *kv, kvs_kv_event_log *out);
void kvs_kv_event_log_free(kvs_kv_event_log *log);
/* Empties the prefix cache: no block is reusable afterwards (the blocks that
 * requests hold stay theirs); logs cleared. */
void kvs_kv_reset_prefix_cache(kvs_kv_cache *kv);
/* The reusable blocks counted as they come and go (with events on; else 0). */
int64_t kvs_kv_reusable_count(const kvs_kv_cache *kv);
/* The hashes of the reusable blocks, ascending, in a malloc'd *hashes (NULL when none). */
kvs_status kvs_kv_reusable_blocks(const kvs_kv_cache *kv, uint64_t **hashes, int64_t *n);

/* Memory accounting: free blocks include the evictable ones. */
int64_t kvs_kv_free_blocks(const kvs_kv_cache *kv);
int64_t kvs_kv_used_blocks(const kvs_kv_cache *kv);
/* Entries held by seq summed over layers, and what a full cache would hold. */
void kvs_kv_seq_usage(const kvs_kv_cache *kv, int seq_id, int64_t *held, int64_t *full);
/* The pool blocks seq holds in its sparse layers (and for their compaction),
 * a block shared with other sequences counted 1 / its holders. Cheap: after
 * the prompt's compaction a compacted layer's blocks are its own. */
double kvs_kv_seq_sparse_blocks(const kvs_kv_cache *kv, int seq_id);
/* Whether layer of seq is a sparse layer under its policy (compacted to a budget). */
bool kvs_kv_layer_sparse(const kvs_kv_cache *kv, int seq_id, int layer);

/* The SnapKV scores of (seq, layer) on a device of the manager (its KV heads):
 * one_device.h's kvs_kv_window_scores says what they are (kvsparse calibrate). */
kvs_status kvs_kv_device_window_scores(kvs_kv_device *d, const kvs_kv_cache *kv, int seq_id, int layer, float *out);

#endif
