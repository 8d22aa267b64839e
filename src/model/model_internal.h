/* The model's weights and scratch buffers in backend memory. Internal to model/. */
#ifndef KVS_MODEL_INTERNAL_H
#define KVS_MODEL_INTERNAL_H

#include "backend/comm.h"
#include "model/model.h"

typedef struct {
    void *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *wo; /* biases NULL when absent */
    void *mlp_norm, *w_gate_up /* [2 * intermediate, hidden]: gate rows, then up rows */, *w_down;
} kvs_layer_weights;

/* Per-step buffers, grown on demand. */
typedef struct {
    int cap_tokens, cap_seqs, cap_blocks, cap_logits;
    void *x, *xn, *q, *k, *v, *att, *tmp, *gate_up, *act, *last, *logits;
    float *lse; /* [tokens, heads] */
    int32_t *ids, *positions, *slots, *q_start, *kv_len, *block_tables, *last_rows, *cap_src, *cap_dst;
    /* host staging */
    int32_t *h_slots, *h_kv_len, *h_block_tables, *h_last_rows, *h_cap_src, *h_cap_dst;
    /* tensor parallelism: every rank's logits slices [world][cap_logits][vocab_pad]
       and the argmax pairs (value, index bits) [cap_logits][2] / [world][cap_logits][2] */
    void *logits_all;
    float *pairs, *pairs_all;
    float *h_logits, *h_pairs; /* host staging */
} kvs_step_buffers;

/* kvs_model_forward_sample's buffers, grown on demand (forward.c). */
typedef struct {
    int cap_rows;
    struct kvs_sample_row *params; /* [cap_rows] */
    int32_t *out;                  /* [2][cap_rows]: the ids, then the logprobs' f32 bits */
    void *rows;                    /* tensor parallelism: the gathered logits as [cap_rows][world * vocab_pad] */
    int32_t *order;                /* [world * cap_rows]: the rows of that gather */
    int32_t *h_out, *h_order;      /* host staging */
} kvs_sample_buffers;

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
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);
/* The batch checks of kvs_model_forward (tp.c runs them once before a step). */
kvs_status kvs_model_check_batch(const kvs_model *m, const kvs_batch *b, const kvs_kv_cache *kv);

/* The parameters of kvs_model_forward_sample (one row per sequence that wants logits). */
kvs_status kvs_model_check_sample(const kvs_batch *b, const struct kvs_sample_row *params);
/* Frees m->sample (forward.c). */
void kvs_model_free_sample_buffers(kvs_model *m);

#endif
