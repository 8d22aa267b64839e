/* runner: the model runner (docs/TP.md). It alone owns the rank models and
 * the KV cache, for every tensor-parallel size: world ranks, each a thread
 * with one backend, one communicator, one rank model and one KV device of its
 * local KV heads (world 1 runs on the caller's thread), and one KV manager
 * that decides for all of them on the caller's thread. A step runs on every
 * rank and returns when all are done: the caller sees one model and one cache. */
#ifndef KVS_RUNNER_H
#define KVS_RUNNER_H

#include "kv/kv.h"
#include "model/model.h"
#include "runner/executor.h"

typedef struct kvs_runner kvs_runner;

/* Rank models on backends[r] with comms[r] (both stay the caller's; comms may
 * be NULL at world 1), created in the rank threads one after the other, each
 * with its executor of limits (NULL: the defaults). n_devices as for
 * kvs_tp_validate (-1: no device limit). */
kvs_status kvs_runner_create(const kvs_config *cfg, kvs_checkpoint *ck, int world, kvs_backend **backends,
                             kvs_comm **comms, int n_devices, const kvs_step_limits *limits, kvs_runner **out);
/* The CPU simulation: world CPU backends (threads_per_rank OpenMP threads each,
 * 0: the default; weights and KV in weight_dtype and kv_dtype,
 * kvs_backend_cpu_create_typed) and host communicators, owned by the runner. */
kvs_status kvs_runner_create_cpu(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                 kvs_dtype weight_dtype, kvs_dtype kv_dtype, const kvs_step_limits *limits,
                                 kvs_runner **out);
/* The same, each rank's model created on wrap(user, rank, be) instead of its
 * CPU backend be (made in its rank thread; the runner still owns and destroys
 * be; the wrapper is the caller's and outlives the runner; NULL fails the
 * creation). bench model times the ranks' matmuls this way. */
typedef kvs_backend *(*kvs_runner_backend_wrap)(void *user, int rank, kvs_backend *be);
kvs_status kvs_runner_create_cpu_wrapped(const kvs_config *cfg, kvs_checkpoint *ck, int world, int threads_per_rank,
                                         kvs_dtype weight_dtype, kvs_dtype kv_dtype, kvs_runner_backend_wrap wrap, void *user, const kvs_step_limits *limits,
                                         kvs_runner **out);
/* A world-1 runner over an existing whole model (it stays the caller's and
 * outlives the runner) with an executor of limits (NULL: the defaults):
 * kvs_engine_create(model) and the tests. */
kvs_status kvs_runner_wrap(kvs_model *model, const kvs_step_limits *limits, kvs_runner **out);
void kvs_runner_destroy(kvs_runner *r);
int kvs_runner_world(const kvs_runner *r);
const kvs_config *kvs_runner_config(const kvs_runner *r);
kvs_step_limits kvs_runner_limits(const kvs_runner *r); /* every rank's executor's, defaults filled in */
void kvs_runner_set_graph_mode(kvs_runner *r, kvs_graph_mode mode); /* every rank's */
kvs_graph_stats kvs_runner_graph_stats(const kvs_runner *r);        /* rank 0's */
size_t kvs_runner_weight_bytes_read(const kvs_runner *r);           /* rank 0's kvs_model_weight_bytes_read */
/* The weights' form as loaded (a GGUF file's quantized blocks: KVS_QUANT_GGUF). */
kvs_quantization kvs_runner_quantization(const kvs_runner *r);

/* ---- the KV cache: one manager (kv.h) for every rank, a device per rank of
 * its slice of the KV heads and heads, the same n_blocks (kv_device.h);
 * replaces old ones. The caller asks the manager (kvs_runner_kv) for what
 * the scheduler needs: sequences, reservations, prefix attach, accounting. */
kvs_status kvs_runner_kv_create(kvs_runner *r, const kvs_kv_config *global);
/* The blocks of one rank's pool that budget_bytes hold. */
int64_t kvs_runner_kv_blocks_for_budget(const kvs_runner *r, const kvs_kv_config *global, size_t budget_bytes);
kvs_kv_cache *kvs_runner_kv(const kvs_runner *r); /* NULL before kvs_runner_kv_create */
/* The bytes of one KV entry (one token of one layer: K and V of every KV head, every rank). */
size_t kvs_runner_kv_entry_bytes(const kvs_runner *r);
/* kvs_kv_window_scores of (seq, layer) (kvsparse calibrate): host scores
 * out[g * len + j] for every KV head g. World 1 only: with tensor parallelism
 * each rank holds a slice of the KV heads (KVS_ERR_UNSUPPORTED). */
kvs_status kvs_runner_window_scores(kvs_runner *r, int seq_id, int layer, float *out);

/* ---- the step plan ---------------------------------------------------------------
 * What every rank of a step is handed, made once on the caller's thread: the
 * forward's inputs (model.h kvs_step_inputs), the cells of the device tables
 * that changed, the sampling rows, and after the forward the compactions due.
 * Plain arrays and the batch's and the caller's: nothing points into the
 * manager, so a rank in another process could be sent it. Where results go
 * (logits, ids, logprobs) is rank 0's alone and not part of the plan. */
typedef struct {
    kvs_step_inputs in;
    kvs_kv_table_deltas tables;
    const kvs_sample_row *sample;         /* a row per sequence that wants logits; NULL: the logits path */
    const kvs_sample_extras *sample_extras; /* NULL: plain sampling */
    kvs_kv_compactions compactions;
    int32_t *slots, *window_rows, *kv_len, *max_blocks; /* in's arrays, reused from step to step */
    int cap_slots, cap_rows, cap_len, cap_blocks;
} kvs_step_plan;
/* The batch checked against the manager (live sequences, room reserved, tables
 * within the devices' rows) and the executor (x and dev: rank 0's; the ranks
 * are alike), then planned; the tables' changes are taken last (they are
 * forgotten by the manager: the plan must reach the devices). A bad batch is
 * KVS_ERR_INVALID and changes nothing. */
kvs_status kvs_step_plan_build(kvs_step_plan *p, kvs_kv_cache *kv, const kvs_batch *b, const kvs_executor *x,
                               const kvs_kv_device *dev);
void kvs_step_plan_free(kvs_step_plan *p);

/* ---- steps ----------------------------------------------------------------------
 * The batch (and the sampling rows) checked and planned once, before any rank
 * runs (a bad one is KVS_ERR_INVALID and changes nothing); then on every rank
 * the plan's table changes and the model's forward, the new tokens committed
 * and what the sequences' KV policies say is due compacted (the manager's
 * plan, run by every rank's device), the backend asked whether an op failed. The KV must hold room for the new tokens (kvs_kv_reserve). A rank failing
 * mid-step aborts the communicators: the runner is then unusable.
 * kvs_runner_step: rank 0's gathered logits [seqs that want them][vocab]
 * (NULL: gathered, copied out nowhere: benchmarks). */
kvs_status kvs_runner_step(kvs_runner *r, const kvs_batch *b, float *logits);
/* Greedy ids: the sample op with temperature 0 in every row. */
kvs_status kvs_runner_step_argmax(kvs_runner *r, const kvs_batch *b, int32_t *ids);
/* Sampled ids and logprobs (NULL: none), with the extras (NULL: none), as
 * kvs_executor_forward_sample. */
kvs_status kvs_runner_step_sample(kvs_runner *r, const kvs_batch *b, const kvs_sample_row *params,
                                  const kvs_sample_extras *x, int32_t *ids, float *logprobs);

#endif
