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
/* The ggml type the file stores a weight in. */
uint32_t kvs_gguf_weights_type(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer);
/* The weight's blocks as stored (llama's q / k rows put back in HF order). */
kvs_status kvs_gguf_weights_read_blocks(kvs_gguf_weights *w, kvs_weight_kind kind, int layer, kvs_ggml_rows *out);
void kvs_gguf_weights_destroy(kvs_gguf_weights *w);

/* A weight kept in ggml blocks (ggml_weights.c): its rows in up to three
 * parts one after the other, each of one ggml type (w_qkv: q, k, v; w_gate_up:
 * gate, up): a Q4_K_M file keeps some v and down weights in Q6_K beside Q4_K.
 * n_parts 0: the weight is dense (weight_dtype) or FP8. */
typedef struct {
    int n_parts;
    uint32_t type[3];
    int64_t rows[3];
    size_t bytes[3];
} kvs_ggml_weight;
size_t kvs_ggml_row_bytes(uint32_t type, int64_t cols); /* 0: cols is not whole blocks */
/* Which type each of kinds[n_kinds] (rows[p] x cols, one above the other) is
 * kept in, under the model's quantization and the checkpoint's storage. */
kvs_status kvs_ggml_weight_plan(const kvs_model *m, kvs_checkpoint *ck, const kvs_weight_kind *kinds, int n_kinds,
                                int layer, const int64_t *rows, int64_t cols, kvs_ggml_weight *out);
size_t kvs_ggml_weight_bytes(const kvs_ggml_weight *g);
/* Rows [r0, r0 + nr) of (kind, layer), the whole width cols, into part `part`
 * of g at base (the weight's memory): the file's blocks when it stores them
 * in that type, else read as f32 and quantized. */
kvs_status kvs_ggml_weight_upload(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                                  int64_t nr, int64_t cols, const kvs_ggml_weight *g, int part, void *base);

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
    kvs_ggml_weight g_qkv, g_o, g_gate_up, g_down; /* ggml blocks (n_parts 0: not) */
    void *arena; /* the one backend allocation the weights above are parts of */
    size_t arena_bytes;
} kvs_layer_weights;

struct kvs_model {
    kvs_config cfg;
    kvs_backend *be;
    kvs_shard shard; /* this rank's slice (rank 0 of 1 without tensor parallelism) */
    kvs_comm *comm;  /* NULL when world is 1 */
    void *embed, *final_norm, *lm_head; /* lm_head points into embed when tied and unpadded */
    bool lm_head_owned;
    kvs_ggml_weight g_embed, g_lm_head; /* GGUF: kept in the file's blocks (n_parts 0: not) */
    kvs_layer_weights *layers;
    void *staging; /* fp8 at load: one linear weight in weight_dtype before quantize_fp8 (NULL after) */
    float *inv_freq; /* [head_dim / 2], backend memory */
    float *kv_scales; /* [n_layers][2][shard.n_kv_heads], host: the checkpoint's k_scale / v_scale (or 1) */
};

/* RoPE inverse frequencies with the config's scaling (none, linear, llama3). */
void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq);


#endif
