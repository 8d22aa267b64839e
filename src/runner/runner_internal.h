/* runner: the state its files share, and a rank's model and KV device for
 * the tests that look inside one (nothing outside src/runner includes this). */
#ifndef KVS_RUNNER_INTERNAL_H
#define KVS_RUNNER_INTERNAL_H

#include <pthread.h>

#include "backend/comm.h"
#include "runner/runner.h"

typedef kvs_status (*kvs_rank_job)(kvs_runner *g, int rank, void *arg);

typedef struct {
    kvs_runner *g;
    int rank;
    pthread_t thread;
    bool started;
    kvs_backend *be;
    kvs_backend *model_be; /* the model's backend when a caller wraps be (kvs_runner_create_cpu_wrapped) */
    kvs_comm *comm;
    kvs_model *model;
    kvs_executor *exec; /* the model's step buffers, graphs and sampling (executor.h) */
    kvs_kv_device *kv_dev; /* the rank's memory of the KV cache (kv_device.h) */
    kvs_status status; /* the rank's answer to the current job */
    char error[1024];
} kvs_rank;

struct kvs_runner {
    kvs_config cfg;
    kvs_step_limits limits; /* every rank executor's (creation) */
    int world;
    kvs_rank *ranks;
    bool owns_devices;   /* backends and comms made by kvs_runner_create_cpu */
    bool borrowed_model; /* kvs_runner_wrap: rank 0's model stays the caller's */
    bool inline_rank;    /* world 1: jobs run on the caller's thread, no rank thread */
    bool broken;         /* a rank failed mid-step: the communicators were aborted */
    /* job hand-off: the caller publishes (job, arg) and bumps generation;
       each rank runs it once and counts itself done */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    unsigned long generation;
    int n_done;
    bool quit;
    kvs_rank_job job;
    void *arg;
    bool job_collective;
    kvs_checkpoint *ck;    /* while the ranks' models are created */
    pthread_mutex_t ck_mu; /* the checkpoint is read by one rank at a time */
    kvs_runner_backend_wrap wrap;
    void *wrap_user;
    kvs_kv_cache *kv;          /* the one KV manager (kvs_runner_kv_create) */
    kvs_step_plan plan;        /* the step's (plan.c), its arrays reused */
};

/* ranks.c: runs job on every rank and waits; the first failing rank's error
 * becomes the caller's, prefixed with the rank. collective: the job meets in
 * the communicators, so a failing rank aborts them and the runner is broken. */
kvs_status kvs_ranks_run(kvs_runner *g, kvs_rank_job job, void *arg, bool collective);
kvs_status kvs_ranks_start(kvs_runner *g);
void kvs_ranks_stop(kvs_runner *g);

/* kv_devices.c: KVS_ERR_INVALID before kvs_runner_kv_create. */
kvs_status kvs_runner_need_kv(const kvs_runner *g);

/* For the tests: rank's model, executor and KV device (NULL before kvs_runner_kv_create). */
kvs_model *kvs_runner_model(kvs_runner *g, int rank);
kvs_executor *kvs_runner_executor(kvs_runner *g, int rank);
kvs_kv_device *kvs_runner_kv_device(kvs_runner *g, int rank);


/* ---- a rank's executor (executor.h): step_buffers.c, step_meta.c, graphs.c, sample.c ---- */
/* Where one layer's metadata sits in the step's metadata buffer (int32
 * offsets), and what its attention op is told. kv_blocks: the layer's longest
 * table in the batch (padded steps: its kvs_stride_bucket, which a graph bakes
 * in through max_kv_len). */
typedef struct {
    size_t slots, kv_len, cap_src, cap_dst;
    int kv_blocks, max_kv_len, max_q_len, n_cap;
} kvs_layer_meta;

/* The step buffers (step_buffers.c), for the executor's limits: rows are
 * max_tokens or the largest padded graph bucket. */
typedef struct {
    kvs_forward_state fs; /* the activations, and the step's layout the forward reads */
    int32_t *last_rows, *h_last_rows; /* [max_seqs] */
    /* Per-step metadata (step_meta.c): token ids, positions, q_start, the
       sequences' table rows, then every layer's slots, kv lengths and
       window-capture rows, copied from the step's inputs into h_meta (pinned)
       and uploaded with one copy into meta; fs points into it (not owned). */
    int32_t *meta, *h_meta; /* h_meta: two halves of meta_words, used in turn (no wait for the last upload) */
    size_t meta_words;
    kvs_upload_turns h_turns; /* which half of h_meta the next step writes */
    kvs_layer_meta *layer_meta; /* [n_layers] */
    kvs_layer_step *layer_step; /* [n_layers]: fs.layers */
    /* tensor parallelism: every rank's logits slices [world][max_seqs][vocab_pad] */
    void *logits_all;
    float *h_logits; /* their host staging (kvs_executor_forward) */
} kvs_step_buffers;

/* A step's sampled results on their way to the host (to_host_async into the
 * staging below): where kvs_executor_step_end puts them; n 0: none. */
typedef struct {
    int n, top_k, world;
    bool parts; /* h_parts to pick from (tensor parallelism's parts), else h_out */
    int32_t *ids, *top_ids;
    float *logprobs, *top_logprobs;
    const struct kvs_sample_row *params;
} kvs_sample_pending;

/* kvs_executor_forward_sample's buffers (step_buffers.c, sample.c). */
typedef struct {
    struct kvs_sample_row *params; /* [max_seqs] */
    int32_t *out;                  /* [2][max_seqs]: the ids, then the logprobs' f32 bits */
    void *rows;                    /* tensor parallelism: the gathered logits as [max_seqs][world * vocab_pad] */
    int32_t *order;                /* [world * max_seqs]: the rows of that gather */
    int32_t *h_out, *h_order;      /* host staging */
    /* tensor parallelism without the gather (rows kvs_sample_shardable accepts):
       this rank's parts [max_seqs], every rank's [world][max_seqs], host copy */
    struct kvs_sample_part *parts, *parts_all, *h_parts;
    int64_t sharded_steps;         /* steps sampled through the parts */
    /* logits processing and top logprobs (kvs_sample_extras) */
    void *processed;                  /* [max_seqs][vocab] act_dtype */
    struct kvs_process_row *process;  /* [max_seqs] */
    uint32_t *masks;                  /* [max_seqs][mask words] */
    int32_t *top;                     /* [2][max_seqs][KVS_MAX_TOP_LOGPROBS]: ids, then logprobs' f32 bits */
    int32_t *h_top;
    struct kvs_logit_adjust *adjust;  /* grown on demand (cap_adjust entries) */
    int cap_adjust;
    kvs_sample_pending pending;
} kvs_sample_buffers;

/* CUDA graphs of pure-decode steps (graphs.c): the batch padded to 2^bi
 * sequences (1 .. 256), each layer's max_kv_len padded to its own bucket of
 * blocks (kvs_stride_bucket of its longest table in the batch: full layers
 * long, sparse layers short; it sizes the attention's grid). A graph bakes
 * those lengths in, so a batch bucket keeps up to KVS_GRAPH_VARIANTS graphs,
 * one per vector of layer lengths (the least recently used one makes room). */
#define KVS_GRAPH_BATCHES 9
#define KVS_GRAPH_VARIANTS 8
typedef struct {
    void *exec; /* the backend's graph; NULL until captured */
    int seen;   /* steps of this variant so far (0: next one runs eagerly, 1: captures) */
    bool failed; /* capture failed once: this variant stays eager */
    int32_t *kv_blocks; /* [n_layers]: the layers' bucketed lengths it is for; NULL: unused */
    uint64_t used;    /* the step it last ran (least recently used goes first) */
} kvs_graph_slot;

typedef struct {
    kvs_graph_mode mode;
    kvs_graph_slot slot[KVS_GRAPH_BATCHES][KVS_GRAPH_VARIANTS];
    uint64_t clock; /* padded steps run (for kvs_graph_slot.used) */
    /* the KV memory the graphs baked in: pool, tables, then each layer's
       window q and lse; then the same of the step's KV device */
    const void **baked;
    kvs_graph_stats stats;
} kvs_graphs;

struct kvs_executor {
    kvs_model *m; /* the caller's */
    const kvs_config *cfg;
    const kvs_shard *shard;
    kvs_backend *be;
    kvs_comm *comm; /* NULL when world is 1 */
    kvs_step_limits limits; /* defaults filled in */
    kvs_step_buffers buf;
    kvs_sample_buffers sample;
    kvs_graphs graphs;
};

/* step_buffers.c: the limits with their defaults filled in; every step buffer
 * allocated, or freed. */
kvs_step_limits kvs_limits_resolve(const kvs_config *cfg, const kvs_step_limits *in);
kvs_status kvs_step_buffers_create(kvs_executor *x);
void kvs_step_buffers_free(kvs_executor *x);

/* step_meta.c: what a step runs on: n_rows token rows and n_seqs sequences,
 * padding included (the graphs' layout: up to the bucket, each layer's
 * kv_blocks bucketed by kvs_stride_bucket, in buf.layer_meta[l].kv_blocks). */
typedef struct {
    int n_rows, n_seqs;
    bool padded;
    int bucket;   /* padded: the graphs' batch bucket (n_seqs = 2^bucket) */
    int n_decode; /* the leading sequences of one token each (kvs_attn_batch.n_decode) */
} kvs_step_shape;
int kvs_ceil_log2(int n);
/* The table stride the graphs' layout pads `blocks` to: the next of 1, 2, 3,
 * 4, 6, 8, 12, ... (powers of two and 1.5 times them: at most a third padding). */
int kvs_stride_bucket(int blocks);
/* Plans the step's shape, uploads its metadata (one copy) and points the
 * forward state at it (every layer's kvs_layer_step). */
kvs_status kvs_step_prepare(kvs_executor *x, const kvs_step_inputs *in, const kvs_kv_device *dev, kvs_step_shape *sh);
/* The step up to each rank's logits slice in buf.fs.logits [n_logits][vocab_pad]
 * (after the checks): the layout, the layers (graphs.c), the logits rows. */
kvs_status kvs_executor_step(kvs_executor *x, const kvs_step_inputs *in, kvs_kv_device *dev, int *n_logits);

/* graphs.c: kvs_forward_layers for the step: eagerly, or as its bucket's
 * graph; destroying every graph. */
kvs_status kvs_graphs_run(kvs_executor *x, const kvs_kv_device *kv, const kvs_step_shape *sh);
void kvs_graphs_free(kvs_executor *x);

#endif
