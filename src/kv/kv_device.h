/* kv device: one rank's memory of the KV cache (docs/DESIGN.md, "The memory
 * story"). The pool's bytes for the rank's KV heads, an FP8 pool's scales, the
 * SnapKV observation windows (the last prompt and decode queries of each
 * sequence, and their log-sum-exp), and the scratch and pinned staging the
 * compactions use. It knows nothing of sequences: the KV manager (kv.h)
 * decides which blocks hold what and which compactions are due, and every
 * rank's device runs the same plan (kvs_kv_device_compact) on its own heads. */
#ifndef KVS_KV_DEVICE_H
#define KVS_KV_DEVICE_H

#include "kv/kv.h"

typedef struct kvs_kv_device kvs_kv_device;

/* A device for cfg's geometry, heads as this rank holds them (its slice of
 * n_kv_heads and n_heads), n_blocks blocks on be. An FP8 pool's scales start
 * at 1 (kvs_kv_device_set_scales). */
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

/* The observation windows, made once the manager has a sparse policy
 * (kvs_kv_windows_wanted): rows [max_seqs * kvs_kv_window_rows_per_seq],
 * q [rows][n_heads * head_dim] (act dtype) and lse [rows][n_heads] (f32) per
 * layer. Nothing when they exist or are not wanted. */
kvs_status kvs_kv_device_prepare(kvs_kv_device *d, const kvs_kv_cache *kv);
/* A layer's window buffers (NULL, NULL before they are made). */
void kvs_kv_device_window_buffers(const kvs_kv_device *d, int layer, void **q, float **lse);

/* Enqueues the plan's compactions (kvs_kv_plan_compactions) on this device's
 * heads: the ones with keep lists first, one by one, then every SnapKV job in
 * one snapkv_compact_batch. Returns without waiting (the staging of the
 * batch's lists alternates between two pinned buffers). */
kvs_status kvs_kv_device_compact(kvs_kv_device *d, const kvs_kv_compactions *plan);
/* The SnapKV scores of (seq, layer) of kv from its captured window, on this
 * device's KV heads (kvs_kv_window_scores says what they are). */
kvs_status kvs_kv_device_window_scores(kvs_kv_device *d, const kvs_kv_cache *kv, int seq_id, int layer, float *out);
/* Copies blocks src[i] to dst[i] and the window rows of sequence from_seq to
 * to_seq (a fork; from_seq -1: no windows). */
kvs_status kvs_kv_device_copy(kvs_kv_device *d, const int32_t *src, const int32_t *dst, int n, int from_seq, int to_seq);

/* ---- a manager with one device: the library's world-1 cache and the tests' -------
 * kvs_kv_create makes both; these act on that device at once, on the caller's
 * thread (the runner's ranks call the kvs_kv_device functions instead). */
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
 * Host memory; for kvsparse calibrate. */
kvs_status kvs_kv_window_scores(kvs_kv_cache *kv, int seq_id, int layer, float *out);
/* A copy of seq (blocks, lengths, windows, policy) as a new sequence id: the
 * cached blocks shared, the others copied. */
kvs_status kvs_kv_fork(kvs_kv_cache *kv, int seq_id, int *new_seq);

#endif
