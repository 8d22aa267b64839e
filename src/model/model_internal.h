/* The model's weights and scratch buffers in backend memory. Internal to model/. */
#ifndef KVS_MODEL_INTERNAL_H
#define KVS_MODEL_INTERNAL_H

#include "backend/comm.h"
#include "model/model.h"

/* config.json's quantization_config into out (quant_config.c); no field: none. */
struct json_t;
kvs_status kvs_quant_config_parse(const struct json_t *root, const char *name, kvs_ckpt_quant *out);
/* JSON text (duplicate keys refused) into *out; a failure names name, the line and column. */
kvs_status kvs_config_json_load(const char *text, size_t len, const char *name, struct json_t **out);

/* A GGUF file's weights for the checkpoint (gguf_weights.c; kvs_checkpoint_open
 * says what is checked); a read is valid until the next read. */
typedef struct kvs_gguf_weights kvs_gguf_weights;
kvs_status kvs_gguf_weights_open(const char *path, const kvs_config *cfg, kvs_gguf_weights **out);
kvs_status kvs_gguf_weights_read(kvs_gguf_weights *w, kvs_weight_kind kind, int layer, kvs_host_tensor *out);
kvs_dtype kvs_gguf_weights_dtype(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer);
size_t kvs_gguf_weights_bytes(const kvs_gguf_weights *w);
void kvs_gguf_weights_destroy(kvs_gguf_weights *w);

typedef struct {
    void *attn_norm;
    void *w_qkv; /* [(heads + 2 * kv_heads) * head_dim, hidden]: this rank's Q rows, then K's, then V's */
    void *b_qkv; /* their biases in the same order; NULL when absent */
    void *q_norm, *k_norm; /* Qwen3: [head_dim] each, every q / k head's RMSNorm weight; NULL when absent */
    void *wo;
    void *mlp_norm, *w_gate_up /* [2 * intermediate, hidden]: gate rows, then up rows */, *w_down;
    /* --quantization fp8: the four linear weights above hold E4M3 codes, and
       these their scales, one per output row (NULL without quantization) */
    float *s_qkv, *so, *s_gate_up, *s_down;
    void *arena; /* the one backend allocation the weights above are parts of */
} kvs_layer_weights;

/* Where one layer's metadata sits in the step's metadata buffer (int32
 * offsets), and what its attention op is told. kv_blocks: the layer's longest
 * table in the batch (padded steps: its kvs_stride_bucket, which a graph bakes
 * in through max_kv_len). */
typedef struct {
    size_t slots, kv_len, cap_src, cap_dst;
    int kv_blocks, max_kv_len, max_q_len, n_cap;
} kvs_layer_meta;

/* The step buffers (buffers.c), for the model's limits: rows are max_tokens or
 * the largest padded graph bucket. */
typedef struct {
    void *x, *xn, *qkv, *q, *att, *tmp, *gate_up, *act; /* [rows][...]; q: qkv's q rotated */
    float *lse;                                         /* [rows][heads] */
    uint8_t *xq; float *xs; /* fp8: a GEMM input's E4M3 codes [rows][widest input] and per-row scales [rows] */
    void *last, *logits;                                /* [max_seqs][hidden], [max_seqs][vocab_pad] */
    int32_t *last_rows, *h_last_rows;                   /* [max_seqs] */
    /* Per-step metadata (step_meta.c): token ids, positions, q_start, the
       sequences' table rows, then every layer's slots, kv lengths and
       window-capture rows, copied from the step's inputs into h_meta (pinned)
       and uploaded with one copy into meta. The pointers below point into
       meta (not owned): ids, positions and q_start for the step, the others
       at the layer being run. */
    int32_t *meta, *h_meta; /* h_meta: two halves of meta_words, used in turn (no wait for the last upload) */
    size_t meta_words;
    kvs_upload_turns h_turns; /* which half of h_meta the next step writes */
    kvs_layer_meta *layer_meta; /* [n_layers] */
    int32_t *ids, *positions, *slots, *q_start, *table_rows, *kv_len, *cap_src, *cap_dst;
    /* tensor parallelism: every rank's logits slices [world][max_seqs][vocab_pad] */
    void *logits_all;
    float *h_logits; /* their host staging (kvs_model_forward) */
} kvs_step_buffers;

/* A step's sampled results on their way to the host (to_host_async into the
 * staging below): where kvs_model_step_end puts them; n 0: none. */
typedef struct {
    int n, top_k, world;
    bool parts; /* h_parts to pick from (tensor parallelism's parts), else h_out */
    int32_t *ids, *top_ids;
    float *logprobs, *top_logprobs;
    const struct kvs_sample_row *params;
} kvs_sample_pending;

/* kvs_model_forward_sample's buffers (buffers.c, logits.c). */
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

struct kvs_model {
    kvs_config cfg;
    kvs_backend *be;
    kvs_shard shard; /* this rank's slice (rank 0 of 1 without tensor parallelism) */
    kvs_comm *comm;  /* NULL when world is 1 */
    kvs_model_limits limits; /* defaults filled in */
    void *embed, *final_norm, *lm_head; /* lm_head points into embed when tied and unpadded */
    bool lm_head_owned;
    kvs_layer_weights *layers;
    void *staging; /* fp8 at load: one linear weight in weight_dtype before quantize_fp8 (NULL after) */
    float *inv_freq; /* [head_dim / 2], backend memory */
    float *kv_scales; /* [n_layers][2][shard.n_kv_heads], host: the checkpoint's k_scale / v_scale (or 1) */
    kvs_step_buffers buf;
    kvs_sample_buffers sample;
    kvs_graphs graphs;
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);

/* buffers.c: the limits with their defaults filled in; every step buffer
 * allocated, or freed. */
kvs_model_limits kvs_limits_resolve(const kvs_config *cfg, const kvs_model_limits *in);
kvs_status kvs_step_buffers_create(kvs_model *m);
void kvs_step_buffers_free(kvs_model *m);

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
/* Plans the step's shape and uploads its metadata (one copy). */
kvs_status kvs_step_prepare(kvs_model *m, const kvs_step_inputs *in, const kvs_kv_device *dev, kvs_step_shape *sh);
/* Points the step buffers at layer l's metadata, its attention batch in ab;
 * returns the rows the window captures. */
int kvs_step_layer(kvs_model *m, const kvs_kv_device *dev, int l, const kvs_step_shape *sh, kvs_attn_batch *ab);

/* forward.c: the embedding and the layers (all a graph holds); the step up
 * to each rank's logits slice in buf.logits [n_logits][vocab_pad], after
 * kvs_model_check_batch. */
kvs_status kvs_forward_layers(kvs_model *m, const kvs_kv_device *kv, const kvs_step_shape *sh);
kvs_status kvs_forward_step(kvs_model *m, const kvs_step_inputs *in, kvs_kv_device *dev, int *n_logits);

/* graphs.c: kvs_forward_layers for the step: eagerly, or as its bucket's
 * graph; destroying every graph. */
kvs_status kvs_graphs_run(kvs_model *m, const kvs_kv_device *kv, const kvs_step_shape *sh);
void kvs_graphs_free(kvs_model *m);


#endif
