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

struct kvs_model {
    kvs_config cfg;
    kvs_backend *be;
    kvs_shard shard; /* this rank's slice (rank 0 of 1 without tensor parallelism) */
    kvs_comm *comm;  /* NULL when world is 1 */
    void *embed, *final_norm, *lm_head; /* lm_head points into embed when tied and unpadded */
    bool lm_head_owned;
    kvs_layer_weights *layers;
    void *staging; /* fp8 at load: one linear weight in weight_dtype before quantize_fp8 (NULL after) */
    float *inv_freq; /* [head_dim / 2], backend memory */
    float *kv_scales; /* [n_layers][2][shard.n_kv_heads], host: the checkpoint's k_scale / v_scale (or 1) */
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);


#endif
