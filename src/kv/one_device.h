/* kv one device: a KV manager with one device of its own, and views of the
 * manager's state, for the tests and tools that drive a cache by hand (the engine's runner keeps a manager and a
 * device per rank instead: kv.h, kv_device.h). kvs_kv_create makes both; the
 * calls below act on that device at once, on the caller's thread. */
#ifndef KVS_KV_ONE_DEVICE_H
#define KVS_KV_ONE_DEVICE_H

#include "kv/kv.h"

/* A manager with one device of its own on be (destroyed with it by kvs_kv_destroy). */
kvs_status kvs_kv_create(const kvs_kv_config *cfg, kvs_backend *be, kvs_kv_cache **out);
kvs_kv_device *kvs_kv_own_device(const kvs_kv_cache *kv); /* NULL: a manager without one */
const kvs_kv_pool *kvs_kv_get_pool(const kvs_kv_cache *kv);
kvs_kv_pool kvs_kv_layer_pool(const kvs_kv_cache *kv, int layer);
kvs_status kvs_kv_set_scales(kvs_kv_cache *kv, const float *scales);
void kvs_kv_window_buffers(const kvs_kv_cache *kv, int layer, void **q, float **lse);
/* Plans the compactions due after a step of seq_ids (kvs_kv_plan_compactions)
 * and enqueues them on the device. */
kvs_status kvs_kv_sparsify_seqs(kvs_kv_cache *kv, const int32_t *seq_ids, int n);
kvs_status kvs_kv_sparsify(kvs_kv_cache *kv, int seq_id);
/* Keeps, in every KV head h of (seq, layer), entries keep[h * n_keep + i] (each
 * head's list sorted ascending, distinct, < len), moved to entries 0 .. n_keep-1;
 * the layer's length becomes n_keep and blocks past it go back to the pool. */
kvs_status kvs_kv_compact(kvs_kv_cache *kv, int seq_id, int layer, const int32_t *keep, int n_keep);
/* The SnapKV scores of (seq, layer)'s entries before its window, from its
 * captured window, before any compaction (a policy that keeps the whole prompt,
 * e.g. budget 100%, captures the window and compacts nothing): out[g * (len -
 * window) + j] for KV head g and entry j < len - window, the attention mass the
 * window's queries of g's group give entry j, summed (what selection ranks).
 * Host memory. */
kvs_status kvs_kv_window_scores(kvs_kv_cache *kv, int seq_id, int layer, float *out);
/* A copy of seq (blocks, lengths, windows, policy) as a new sequence id: the
 * cached blocks shared, the others copied. */
kvs_status kvs_kv_fork(kvs_kv_cache *kv, int seq_id, int *new_seq);

/* ---- the tests' views of the manager ---- */
/* The pool slot of entry e of (seq, layer) (kvs_kv_slots of one entry). */
int32_t kvs_kv_slot(const kvs_kv_cache *kv, int seq_id, int layer, int entry);
/* The window row the query of (seq, layer) at position fills (kvs_kv_window_rows of one). */
int kvs_kv_window_row(const kvs_kv_cache *kv, int seq_id, int layer, int position);
/* Checks internal invariants (every block free, evictable or held, its
 * reference count its holders, every cached block under its key). */
kvs_status kvs_kv_check(const kvs_kv_cache *kv);

#endif
