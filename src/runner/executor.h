/* runner executor: what runs one rank model's steps (docs/DESIGN.md). The
 * model (model.h) holds the weights and computes; its executor holds the step
 * buffers (activations, the step's metadata in backend memory, logits and
 * sampling), lays a step out on them from the step's inputs, runs the
 * forward eagerly or as a decode step's CUDA graph, and samples. The runner
 * keeps one per rank; tests and tools that drive a model by hand make their own. */
#ifndef KVS_RUNNER_EXECUTOR_H
#define KVS_RUNNER_EXECUTOR_H

#include "backend/sample.h"
#include "model/model.h"

/* What one step may hold: an executor sizes its step buffers for it once, when
 * it is created; a larger batch fails (KVS_ERR_INVALID). 0: the default. */
typedef struct {
    int max_tokens; /* tokens per step: the engine's max_num_batched_tokens (2048) */
    int max_seqs;   /* sequences per step: max_num_seqs (64) */
    int max_len;    /* KV entries of a sequence in a layer: max_model_len (the config's max_position_embeddings) */
    int block_size; /* the KV cache's entries per block (16) */
} kvs_step_limits;

typedef struct kvs_executor kvs_executor;

/* The executor of model m (a whole model or a rank's; m stays the caller's and
 * outlives it): its step buffers for limits (NULL: the defaults), allocated on
 * the model's backend once, so that the pointers a CUDA graph bakes in stay
 * put. */
kvs_status kvs_executor_create(kvs_model *m, const kvs_step_limits *limits, kvs_executor **out);
void kvs_executor_destroy(kvs_executor *x);
/* The limits it was created for, defaults filled in. */
kvs_step_limits kvs_executor_limits(const kvs_executor *x);
/* The backend bytes of a rank's step buffers (what its executor allocates) on
 * a backend of act_dtype activations. */
size_t kvs_executor_bytes(const kvs_config *cfg, const kvs_shard *shard, const kvs_step_limits *limits,
                          kvs_dtype act_dtype);

/* What one step computes: a flat list of tokens from several sequences. */
typedef struct {
    int n_tokens, n_seqs;
    const int32_t *token_ids, *positions; /* [n_tokens] */
    const int32_t *query_start;           /* [n_seqs + 1] prefix sums (varlen) */
    const int32_t *seq_ids;               /* [n_seqs] KV cache sequence ids */
    const uint8_t *wants_logits;          /* [n_seqs]: logits of the seq's last token */
} kvs_batch;

/* What an executor reads besides its model: the batch and what the KV
 * manager decided for it, as plain arrays (the runner's step plan, runner.h,
 * made once for every rank). The KV device (kv_device.h) holds the pool, the
 * tables' copies (a sequence's row: its id) and the observation windows. */
typedef struct {
    kvs_batch batch;
    const int32_t *slots;       /* [n_layers][n_tokens]: the pool slot a token's K and V go to */
    const int32_t *kv_len;      /* [n_layers][n_seqs]: a sequence's entries after the step */
    const int32_t *window_rows; /* [n_layers][n_tokens]: the observation-window row a query fills, or -1 */
    const int32_t *max_blocks;  /* [n_layers]: the most blocks a sequence of the batch holds (at least 1) */
    int window_rows_per_seq;    /* > 0: a sparse policy wants the device's observation windows */
} kvs_step_inputs;

/* One forward over the step. The device's tables must be current for the
 * batch's sequences (kvs_kv_device_apply_tables) and the pool hold room for
 * the new tokens; the forward writes them, the caller commits them and applies
 * the KV policy (src/runner/step.c). logits: [number of seqs that want
 * them][vocab], in order of the sequences. */
kvs_status kvs_executor_forward(kvs_executor *x, const kvs_step_inputs *in, kvs_kv_device *dev, float *logits);
/* With tensor parallelism every rank calls kvs_executor_forward for the same batch
 * (collectives inside); each computes the logits of its vocabulary slice and
 * they are all-gathered, so logits is the full [n][vocab] on every rank that
 * passes one (NULL: the rank takes part in the gather, copies nothing out).
 * Greedy without the full logits: kvs_executor_forward_sample with temperature 0
 * in every row (the argmax on the device, ties to the lowest token id; with
 * tensor parallelism each rank reduces its slice and the ranks all-gather 28
 * bytes per row). */

/* The forward, then the backend's sample op on the logits in backend memory
 * (backend/sample.h: greedy, temperature, top-k, top-p, min-p, a counter-based
 * seeded draw), then one small copy back: ids [n] and, when logprobs is not
 * NULL, logprobs [n] (log softmax of the raw logits at the chosen id), n = the
 * sequences that want logits, in order; params [n] (host) their parameters.
 * With tensor parallelism every rank calls it for the same batch and the same
 * params (every rank needs them: the way out depends on them). When every row
 * is greedy or temperature alone (kvs_sample_shardable), each rank reduces its
 * vocabulary slice on the device (the sample_shard op) and the ranks
 * all-gather 28 bytes per row instead of the logits; otherwise the logits
 * slices are all-gathered on the device and sampled whole. Either way the ranks
 * that pass ids get the ids (ids NULL: the rank takes part and samples
 * nothing). A row whose logits are not all finite (NaN or inf: a numerical
 * failure) gets id -1 and logprob NaN; the other rows are sampled as usual.
 * Errors: KVS_ERR_INVALID for bad or missing parameters (before the step,
 * nothing changed); a failed backend op during the step (backend check: a CUDA
 * error, an op out of memory; with tensor parallelism on any rank) fails the
 * step: the KV cache and the executor's state are then undefined. */
typedef struct kvs_sample_extras kvs_sample_extras;
kvs_status kvs_executor_forward_sample(kvs_executor *x, const kvs_step_inputs *in, kvs_kv_device *dev,
                                       const kvs_sample_row *params, const kvs_sample_extras *extras, int32_t *ids,
                                       float *logprobs);
/* What a step may add to plain sampling (extras NULL: nothing):
 * - logits processing before the draw (backend/sample.h, the process_logits
 *   op): process [n] (host) per row, their adjust entries and grammar mask
 *   rows (host; [n_masks][kvs_sample_mask_words(vocab)]);
 * - top logprobs of the raw logits (the top_logprobs op): top_k per row (the
 *   step's largest ask, at most KVS_MAX_TOP_LOGPROBS), written to top_ids /
 *   top_logprobs [n][top_k] by the ranks that pass ids.
 * With either, logprobs are still those of the raw logits (the model's
 * distribution, vLLM's default), and the rows are sampled whole (with tensor
 * parallelism: the logits gathered). */
struct kvs_sample_extras {
    const kvs_process_row *process; /* NULL: no processing */
    const kvs_logit_adjust *adjust;
    int n_adjust;
    const uint32_t *masks;
    int n_masks;
    int top_k;
    int32_t *top_ids;
    float *top_logprobs;
};
/* The checks the forwards above run first (KVS_ERR_INVALID naming what is
 * wrong): the batch against x's limits and model and dev's geometry; the
 * step's inputs (the batch's, and its tables within the device's rows); the
 * rows, one per sequence wanting logits. */
kvs_status kvs_executor_check_batch(const kvs_executor *x, const kvs_batch *b, const kvs_kv_device *dev);
kvs_status kvs_executor_check_inputs(const kvs_executor *x, const kvs_step_inputs *in, const kvs_kv_device *dev);
kvs_status kvs_check_sample(const kvs_batch *b, const kvs_sample_row *params, const kvs_sample_extras *extras,
                            int vocab);
/* The runner's forward: kvs_executor_forward_sample (params) or
 * kvs_executor_forward without the checks (the runner runs them once for every
 * rank), ending at the backend's fence without waiting for it: the sampled ids,
 * logprobs and top logprobs are in ids, logprobs and extras' arrays once kvs_executor_step_end has
 * returned KVS_OK (the runner enqueues the KV policy's work in between; full
 * logits are copied before it returns). */
kvs_status kvs_executor_forward_unchecked(kvs_executor *x, const kvs_step_inputs *in, kvs_kv_device *dev,
                                          const kvs_sample_row *params, const kvs_sample_extras *extras,
                                          int32_t *ids, float *logprobs, float *logits);
/* Waits for the step's fence (backend.h fence_wait: its health) and puts the
 * sampled results where the forward was told to. */
kvs_status kvs_executor_step_end(kvs_executor *x);
/* ---- CUDA graphs for decode steps ---------------------------------------------
 * A pure-decode step (every sequence has one new token) on a backend with graphs
 * runs as a graph captured per bucket: the batch padded with dummy rows (slot -1:
 * no KV write; kv_len 0: no attention; no logits) to 1, 2, 4, ..., 256 sequences,
 * every layer's block table padded to a power-of-two stride, all per-step
 * metadata in fixed device buffers re-uploaded every step. The first step of a
 * bucket runs eagerly (growing scratch to the bucket's sizes), the second is
 * captured, later ones replay. A failed capture is logged once and the bucket
 * stays eager. Steps with prefill tokens, larger batches and the CPU backend
 * run eagerly on the batch as given. */
typedef enum {
    KVS_GRAPHS_ON = 0, /* the default: graphs where the backend has them */
    KVS_GRAPHS_OFF,    /* eager, the batch as given (--enforce-eager) */
    KVS_GRAPHS_PADDED, /* the graphs' padded layout, always run eagerly (any backend): tests, benchmarks */
} kvs_graph_mode;
void kvs_executor_set_graph_mode(kvs_executor *x, kvs_graph_mode mode);

typedef struct {
    int64_t eager_steps;        /* steps run on the batch as given */
    int64_t padded_eager_steps; /* padded steps run eagerly (a bucket's first, failed buckets, PADDED mode) */
    int64_t captures;           /* graphs captured */
    int64_t replays;            /* steps run as a graph */
    int64_t capture_failures;
    int64_t invalidations;      /* graphs destroyed because memory they baked in moved */
} kvs_graph_stats;
kvs_graph_stats kvs_executor_graph_stats(const kvs_executor *x);

#endif
