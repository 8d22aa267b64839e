/* The model's weights and scratch buffers in backend memory. Internal to model/. */
#ifndef KVS_MODEL_INTERNAL_H
#define KVS_MODEL_INTERNAL_H

#include "backend/comm.h"
#include "model/model.h"

typedef struct {
    void *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *wo; /* biases NULL when absent */
    void *mlp_norm, *w_gate_up /* [2 * intermediate, hidden]: gate rows, then up rows */, *w_down;
} kvs_layer_weights;

/* Where one layer's metadata sits in the step's metadata buffer (int32
 * offsets), and what its attention op is told. */
typedef struct {
    size_t slots, kv_len, cap_src, cap_dst, tables;
    int max_blocks, max_kv_len, max_q_len, n_cap;
} kvs_layer_meta;

/* Per-step buffers, grown on demand. */
typedef struct {
    int cap_tokens, cap_logits;
    void *x, *xn, *q, *k, *v, *att, *tmp, *gate_up, *act, *last, *logits;
    float *lse; /* [tokens, heads] */
    int32_t *last_rows;
    /* Per-step metadata (forward.c, step_metadata): token ids, positions,
       q_start, then every layer's slots, kv lengths, window-capture rows and
       block tables, built in h_meta (pinned) and uploaded with one copy into
       meta. The pointers below point into meta (not owned): ids, positions and
       q_start for the step, the others at the layer being run. */
    int32_t *meta, *h_meta;
    size_t cap_meta; /* int32 elements of both */
    kvs_layer_meta *layer_meta; /* [n_layers] */
    int32_t *ids, *positions, *slots, *q_start, *kv_len, *block_tables, *cap_src, *cap_dst;
    /* host staging */
    int32_t *h_last_rows;
    /* tensor parallelism: every rank's logits slices [world][cap_logits][vocab_pad] */
    void *logits_all;
    float *h_logits; /* their host staging (kvs_model_forward) */
} kvs_step_buffers;

/* kvs_model_forward_sample's buffers, grown on demand (forward.c). */
typedef struct {
    int cap_rows;
    struct kvs_sample_row *params; /* [cap_rows] */
    int32_t *out;                  /* [2][cap_rows]: the ids, then the logprobs' f32 bits */
    void *rows;                    /* tensor parallelism: the gathered logits as [cap_rows][world * vocab_pad] */
    int32_t *order;                /* [world * cap_rows]: the rows of that gather */
    int32_t *h_out, *h_order;      /* host staging */
    /* tensor parallelism without the gather (rows kvs_sample_shardable accepts):
       this rank's parts [cap_rows], every rank's [world][cap_rows], host copy */
    struct kvs_sample_part *parts, *parts_all, *h_parts;
} kvs_sample_buffers;
/* CUDA graphs of pure-decode steps (graphs.c, forward.c), one per bucket:
 * batch padded to 2^bi sequences (1 .. 256), block tables to a stride of 2^si
 * blocks per sequence. */
#define KVS_GRAPH_BATCHES 9
#define KVS_GRAPH_STRIDES 20
typedef struct {
    void *exec; /* the backend's graph; NULL until captured */
    int seen;   /* steps of this bucket so far (0: next one runs eagerly, 1: captures) */
    bool failed; /* capture failed once: this bucket stays eager */
} kvs_graph_slot;

typedef struct {
    kvs_graph_mode mode;
    kvs_graph_slot slot[KVS_GRAPH_BATCHES][KVS_GRAPH_STRIDES];
    /* the KV memory the graphs baked in: pool, then each layer's window q and lse */
    const void **baked;
    int n_baked;
    kvs_graph_stats stats;
} kvs_graphs;

struct kvs_model {
    kvs_config cfg;
    kvs_backend *be;
    kvs_shard shard; /* this rank's slice (rank 0 of 1 without tensor parallelism) */
    kvs_comm *comm;  /* NULL when world is 1 */
    void *embed, *final_norm, *lm_head; /* lm_head points into embed when tied and unpadded */
    bool lm_head_owned;
    kvs_layer_weights *layers;
    float *inv_freq; /* [head_dim / 2], backend memory */
    kvs_step_buffers buf;
    kvs_sample_buffers sample;
    kvs_graphs graphs;
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);
/* graphs.c: destroys every captured graph (step buffers or KV memory moved). */
void kvs_graphs_invalidate(kvs_model *m);
/* graphs.c: invalidates the graphs when the KV memory they baked in is not kv's. */
kvs_status kvs_graphs_check_kv(kvs_model *m, const kvs_kv_cache *kv);
/* graphs.c: frees what kvs_model_destroy must (graphs, metadata buffers). */
void kvs_graphs_free(kvs_model *m);

/* Frees m->sample (forward.c). */
void kvs_model_free_sample_buffers(kvs_model *m);

#endif
