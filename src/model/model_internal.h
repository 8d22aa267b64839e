/* The model's weights and scratch buffers in backend memory. Internal to model/. */
#ifndef KVS_MODEL_INTERNAL_H
#define KVS_MODEL_INTERNAL_H

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
} kvs_step_buffers;

struct kvs_model {
    kvs_config cfg;
    kvs_backend *be;
    void *embed, *final_norm, *lm_head; /* lm_head == embed when tied */
    kvs_layer_weights *layers;
    float *inv_freq; /* [head_dim / 2], backend memory */
    kvs_step_buffers buf;
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);

#endif
