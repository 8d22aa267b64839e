/* model: config.json, safetensors checkpoints (mmap, sharded), dummy weights,
 * and the forward pass as a sequence of backend ops. */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include "backend/backend.h"
#include "core/core.h"
#include "gguf/gguf.h"
#include "kv/kv_device.h"

/* ---- config.json ------------------------------------------------------------ */
/* KVS_ROPE_FACTORS: a divisor per frequency, as llama.cpp stores Llama 3's
 * scaling (a GGUF file's rope_freqs.weight). */
typedef enum { KVS_ROPE_NONE, KVS_ROPE_LINEAR, KVS_ROPE_LLAMA3, KVS_ROPE_FACTORS } kvs_rope_type;
#define KVS_MAX_ROPE_FACTORS 512 /* head_dim / 2 at most */

#define KVS_MAX_EOS 8

/* Weight quantization (--quantization; docs/CUDA.md "FP8", docs/CPU.md
 * "Quantized weights"). FP8: the linear layers' weights (q, k, v, o, gate/up,
 * down) quantized at load to FP8 E4M3 with a scale per output channel,
 * activations per token on the fly. Q8_0 / Q4_K (CPU): the linear weights
 * quantized at load into llama.cpp's block formats (Q4_K needs rows of a
 * multiple of 256, else that weight is Q8_0). With both, the embeddings, the
 * LM head, the norms and biases stay in the backend's dtype. GGUF: a GGUF
 * file's quantized weights kept in the file's own blocks, embedding and LM head
 * included (set at load on a backend with matmul_q, one rank; elsewhere they
 * are dequantized to the backend's dtype at load). */
typedef enum { KVS_QUANT_NONE, KVS_QUANT_FP8, KVS_QUANT_Q8_0, KVS_QUANT_Q4_K, KVS_QUANT_GGUF } kvs_quantization;
/* Whether q keeps weights in ggml blocks (Q8_0, Q4_K, GGUF). */
bool kvs_quantization_is_ggml(kvs_quantization q);
const char *kvs_quantization_name(kvs_quantization q);
/* "fp8", "q8_0", "q4_k" -> the method; anything else fails, naming the value. */
kvs_status kvs_quantization_parse(const char *v, kvs_quantization *q);

/* A checkpoint published with FP8 linear weights (config.json's
 * quantization_config; docs/CUDA.md "FP8 checkpoints"): quant_method "fp8"
 * (per-tensor or per-channel weight_scale, not block-wise) or
 * "compressed-tensors" with FP8 channel / tensor weights. Such a checkpoint
 * loads into the form --quantization fp8 gives (codes + a f32 scale per
 * output row), keeping its own codes and scales; activations are quantized
 * per token (a static input_scale is checked, not used). */
typedef struct {
    bool fp8;             /* the linear weights may be F8_E4M3 with a weight_scale each */
    char method[24];      /* quant_method, for messages ("" without quantization_config) */
    bool static_input;    /* static activation scales (input_scale tensors) */
} kvs_ckpt_quant;

#define KVS_MAX_LAYERS 1024 /* num_hidden_layers at most */

typedef struct {
    char architecture[64]; /* LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM */
    int hidden_size, n_layers, n_heads, n_kv_heads, head_dim, intermediate_size;
    int vocab_size, max_position_embeddings;
    float rms_norm_eps, rope_theta;
    kvs_rope_type rope_type;
    float rope_factor;               /* linear and llama3 */
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int rope_original_max_position;  /* llama3 */
    float rope_freq_factors[KVS_MAX_ROPE_FACTORS]; /* factors: frequency i divided by [i], i < head_dim / 2 */
    bool tie_word_embeddings, attention_bias;
    bool qk_norm;                    /* Qwen3: q and k RMS-normalised per head (q_norm, k_norm) before RoPE */
    /* sliding-window attention: a query of a sliding layer sees its own token
       and the sliding_window - 1 before it (Mistral: every layer; Qwen2/3 with
       use_sliding_window: layers from max_window_layers on; or layer_types) */
    int sliding_window;              /* 0: none */
    uint8_t sliding_layers[KVS_MAX_LAYERS]; /* 1: layer l is a sliding layer */
    int bos_token_id;                /* -1 if none */
    int eos_token_ids[KVS_MAX_EOS];  /* config.json, then generation_config.json */
    int n_eos;
    kvs_dtype dtype;                 /* torch_dtype / dtype; BF16 if absent */
    kvs_quantization quantization;   /* --quantization; FP8 too when the checkpoint is (ckpt_quant.fp8) */
    kvs_ckpt_quant ckpt_quant;       /* config.json's quantization_config */
} kvs_config;

/* Parses config.json text (name is used in messages). */
kvs_status kvs_config_parse(const char *json_text, size_t len, const char *name, kvs_config *cfg);
/* model_dir/config.json (+ generation_config.json's eos/bos when present);
 * model_dir may be a .gguf file instead (kvs_gguf_config_load). */
kvs_status kvs_config_load(const char *model_dir, kvs_config *cfg);
/* A GGUF file's config (gguf_config.c): its general.architecture (llama,
 * qwen2, qwen3) and ARCH.* hyper-parameters (block_count, embedding_length, feed_forward_length,
 * attention.head_count(_kv), attention.key_length, context_length,
 * rope.freq_base, rope.scaling, attention.layer_norm_rms_epsilon), the
 * vocabulary's size from tokenizer.ggml.tokens, bos and every end-of-generation
 * id (eos, eot, eom) from tokenizer.ggml.*, tied embeddings where there is no
 * output.weight; written as the equivalent config.json and parsed by
 * kvs_config_parse (its checks, the file named in its messages). The dtype is
 * the embedding's when F32/F16/BF16, float32 for quantized files. */
kvs_status kvs_gguf_config(const kvs_gguf *g, kvs_config *cfg);
kvs_status kvs_gguf_config_load(const char *path, kvs_config *cfg);
/* Llama 3's RoPE scaling as a divisor per frequency (out[head_dim / 2]), as
 * llama.cpp's converter writes it to rope_freqs.weight. */
void kvs_rope_llama3_factors(const kvs_config *cfg, float *out);
/* Layer l's sliding window (config.sliding_window for a sliding layer, else 0). */
int kvs_config_layer_sliding_window(const kvs_config *cfg, int layer);
/* Bytes of K+V per token across all layers for a cache of the given dtype. */
size_t kvs_config_kv_bytes_per_token(const kvs_config *cfg, kvs_dtype kv_dtype);
int64_t kvs_config_param_count(const kvs_config *cfg);
/* Bytes of the weights as the model holds them with weight_dtype: with
 * quantization fp8 the linear weights take a byte each and an f32 scale per
 * output row; everything else weight_dtype. include_embed false leaves out an
 * untied embedding table (read one row per token, not whole). */
double kvs_config_weight_bytes(const kvs_config *cfg, kvs_dtype weight_dtype, bool include_embed);

/* ---- generation_config.json: a request's defaults --------------------------
 * The sampling fields of a checkpoint's generation_config.json (transformers'
 * GenerationConfig), each with its has_ flag (false: the file leaves it out or
 * null). do_sample false sets temperature 0 (greedy), as transformers
 * generates; do_sample true without a temperature sets transformers' 1; no
 * do_sample takes the file's temperature, if any (as vLLM). max_length (prompt
 * included) is not read, as vLLM. */
typedef struct {
    bool has_temperature, has_top_p, has_top_k, has_min_p, has_repetition_penalty, has_max_new_tokens;
    float temperature;        /* >= 0 */
    float top_p;              /* in (0, 1] */
    int top_k;                /* >= 0 (0: off) */
    float min_p;              /* in [0, 1] */
    float repetition_penalty; /* in (0, 100] */
    int max_new_tokens;       /* > 0 */
} kvs_generation_config;

/* Parses generation_config.json text; a field of the wrong type or out of its
 * range fails, naming name (the file) and the field. */
kvs_status kvs_generation_config_parse(const char *json_text, size_t len, const char *name, kvs_generation_config *g);
/* model_dir/generation_config.json's fields (none set when there is no such file). */
kvs_status kvs_generation_config_load(const char *model_dir, kvs_generation_config *g);
/* Whether the file set any field. */
bool kvs_generation_config_any(const kvs_generation_config *g);

/* ---- weights ---------------------------------------------------------------- */
typedef enum {
    KVS_W_EMBED, KVS_W_FINAL_NORM, KVS_W_LM_HEAD,                 /* global (layer -1) */
    KVS_W_ATTN_NORM, KVS_W_Q, KVS_W_K, KVS_W_V, KVS_W_Q_BIAS, KVS_W_K_BIAS, KVS_W_V_BIAS,
    KVS_W_O, KVS_W_MLP_NORM, KVS_W_GATE, KVS_W_UP, KVS_W_DOWN,    /* per layer */
    KVS_W_Q_NORM, KVS_W_K_NORM,                                   /* per layer, Qwen3: [head_dim] */
    KVS_W_KIND_COUNT
} kvs_weight_kind;

/* A host view of one weight: row-major, shape[0] rows x shape[1] cols (ndim 1 or 2). */
typedef struct {
    kvs_dtype dtype;
    int ndim;
    int64_t shape[2];
    const void *data;
    size_t nbytes;
} kvs_host_tensor;

/* Hugging Face name of a weight, e.g. "model.layers.3.self_attn.q_proj.weight". */
void kvs_weight_name(kvs_weight_kind kind, int layer, char *buf, size_t cap);
/* The same weight's name in a GGUF file, e.g. "blk.3.attn_q.weight", and back
 * (false for a name that is no weight of the model's kinds). */
void kvs_gguf_weight_name(kvs_weight_kind kind, int layer, char *buf, size_t cap);
bool kvs_gguf_weight_kind(const char *gguf_name, kvs_weight_kind *kind, int *layer);
/* q, k, v, o, gate, up, down: the weights --quantization fp8 stores in FP8. */
bool kvs_weight_is_linear(kvs_weight_kind kind);
/* Expected shape from the config; returns false if the model has no such weight
 * (biases without attention_bias, lm_head when tied). */
bool kvs_weight_expected(const kvs_config *cfg, kvs_weight_kind kind, int64_t shape[2], int *ndim);
/* The weights cfg's model reads, in order (the globals, then each layer's):
 * start with *layer = -1 and *kind = -1; each call moves to the next one and
 * gives its shape (kvs_weight_expected); false after the last. */
bool kvs_weight_next(const kvs_config *cfg, int *layer, int *kind, int64_t shape[2], int *ndim);

/* A checkpoint: safetensors files (single or sharded) or seeded dummy weights. */
typedef struct kvs_checkpoint kvs_checkpoint;

/* Opens model_dir's model.safetensors or model.safetensors.index.json, maps the
 * files and checks every tensor the config calls for: present, dtype F32/F16/BF16
 * (or, in an FP8 checkpoint, a linear weight in F8_E4M3 with its weight_scale:
 * one element or one per row, finite and not negative; an input_scale, when
 * present, one finite positive element), shape, and data inside the file.
 * Errors name the file and the tensor. model_dir may be a .gguf file instead:
 * every tensor of the file must be a weight the config calls for (others, such
 * as rope_freqs or biases a llama has none of, are refused by name), of the
 * config's shape, in F32, F16, BF16 (read in place) or Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q4_K, Q5_K, Q6_K (dequantized to f32 at read; other types refused by
 * name); the llama architecture's q and k rows are put back from llama.cpp's
 * interleaved order into Hugging Face's at read. */
kvs_status kvs_checkpoint_open(const char *model_dir, const kvs_config *cfg, kvs_checkpoint **out);
/* Seeded random weights for the config alone (--load-format dummy). */
kvs_status kvs_checkpoint_dummy(const kvs_config *cfg, uint64_t seed, kvs_checkpoint **out);
/* The weight's data; valid until the next call on this checkpoint (dummy weights
 * are generated into a scratch buffer). Fails if the model has no such weight. */
kvs_status kvs_checkpoint_read(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_host_tensor *out);
size_t kvs_checkpoint_total_bytes(const kvs_checkpoint *ck);
/* The dtype a weight is stored in (dummy weights: the config's), without reading it. */
kvs_dtype kvs_checkpoint_dtype(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer);
/* A weight in a GGUF file's ggml block format: its rows as stored (llama's q / k
 * rows in HF order), valid until the next read. */
typedef struct {
    uint32_t type; /* ggml type id */
    int64_t rows;
    size_t row_bytes;
    const void *data;
} kvs_ggml_rows;
/* The ggml type of a weight stored quantized in a GGUF file (Q8_0, Q4_K, ...);
 * false for every other weight (F32 / F16 / BF16, safetensors, dummy). */
bool kvs_checkpoint_quantized(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer, uint32_t *type);
/* Whether a GGUF checkpoint stores any linear weight quantized. */
bool kvs_checkpoint_has_quantized(const kvs_checkpoint *ck);
kvs_status kvs_checkpoint_read_blocks(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_ggml_rows *out);
/* An FP8 checkpoint's linear weight (stored F8_E4M3): the f32 scales of its
 * rows [r0, r0 + nr) from its weight_scale (a per-tensor scale repeated on
 * every row). Fails for weights stored in another dtype. */
kvs_status kvs_checkpoint_read_scales(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0, int64_t nr,
                                      float *out);
/* The FP8 KV cache's scales of a layer's KV heads [head0, head0 + n_heads): k[h]
 * and v[h] from the checkpoint's model.layers.N.self_attn.k_scale / v_scale
 * (vLLM's names: one value or one per KV head, checked at open), 1 where the
 * checkpoint has none (and for dummy weights). */
kvs_status kvs_checkpoint_kv_scales(const kvs_checkpoint *ck, int layer, int head0, int n_heads, float *k, float *v);
/* A dummy checkpoint's zero-mean weight (every weight but the norms), for the
 * backends' dummy_fill op: element i of the weight is
 * kvs_dummy_value(seed, i, scale, dtype) (backend/dummy_values.h), the value
 * kvs_checkpoint_read would give. false when ck is not dummy or the weight is
 * a norm or absent. */
typedef struct {
    uint64_t seed;
    float scale;
    kvs_dtype dtype;
    int64_t rows, cols; /* cols 1 for 1-D weights (biases) */
} kvs_dummy_weight;
bool kvs_checkpoint_dummy_weight(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_dummy_weight *out);
void kvs_checkpoint_destroy(kvs_checkpoint *ck);

/* safetensors header parsing, exposed for the fuzz target and tests: parses the
 * 8-byte length + JSON header of a file's bytes, and calls visit for each tensor
 * (data points into buf). Validates offsets against len. */
typedef kvs_status (*kvs_st_visit)(void *ctx, const char *name, kvs_dtype dtype, int ndim,
                                   const int64_t *shape, const void *data, size_t nbytes);
kvs_status kvs_safetensors_parse(const uint8_t *buf, size_t len, const char *file_name,
                                 kvs_st_visit visit, void *ctx);

/* ---- the model ------------------------------------------------------------ */
typedef struct kvs_model kvs_model;
typedef struct kvs_comm kvs_comm; /* backend/comm.h */

/* Uploads the checkpoint's weights into the backend (progress bar on a TTY).
 * The same as kvs_model_create_shard(cfg, ck, be, 0, 1, NULL, out). A step
 * runs on a runner's executor (runner.h), which holds the step buffers. */
kvs_status kvs_model_create(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be, kvs_model **out);

/* ---- tensor parallelism (docs/TP.md) ----------------------------------------
 * Rank r of world N holds query heads [r*H/N, (r+1)*H/N), KV heads
 * [r*KV/N, (r+1)*KV/N), MLP columns [r*I/N, (r+1)*I/N) and LM-head rows
 * [r*Vp, r*Vp + vocab_count) with Vp = ceil(V/N) (the last rank's slice is
 * zero-padded to Vp rows). Q, K, V (and their biases), gate and up are split
 * by rows (column-parallel), O and down by columns (row-parallel, their
 * outputs summed over the ranks with the communicator's all-reduce); norms and
 * embeddings are replicated. */
typedef struct {
    int rank, world;
    int n_heads, n_kv_heads, intermediate; /* this rank's */
    int vocab_begin, vocab_count;          /* LM-head rows of this rank */
    int vocab_pad;                         /* ceil(vocab / world): rows of every rank's slice */
} kvs_shard;

/* Checks that world divides the KV heads, the query heads and the MLP size and,
 * when n_devices >= 0, that world does not exceed n_devices; the error names
 * the numbers. */
kvs_status kvs_tp_validate(const kvs_config *cfg, int world, int n_devices);
/* rank's slice of the model (after kvs_tp_validate). */
kvs_status kvs_shard_dims(const kvs_config *cfg, int rank, int world, kvs_shard *out);
/* Rank's model: the checkpoint's host tensors sliced at upload. comm (comm->rank
 * == rank, comm->world == world) carries the all-reduces and the logits gather;
 * it may be NULL when world is 1. The checkpoint is not thread-safe: create the
 * ranks' models one at a time. A rank's KV cache must hold its local heads
 * (kvs_shard n_kv_heads, n_heads). */
kvs_status kvs_model_create_shard(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be, int rank, int world,
                                  kvs_comm *comm, kvs_model **out);
const kvs_shard *kvs_model_shard(const kvs_model *m);
kvs_comm *kvs_model_comm(const kvs_model *m); /* NULL when world is 1 */
/* The rank's FP8 KV-cache scales from the checkpoint, [n_layers][2][its KV
 * heads] (K's, then V's; 1 where the checkpoint has none): what
 * kvs_kv_device_set_scales takes for the rank's device. */
const float *kvs_model_kv_scales(const kvs_model *m);
kvs_backend *kvs_model_backend(const kvs_model *m);
void kvs_model_destroy(kvs_model *m);
const kvs_config *kvs_model_config(const kvs_model *m);
/* The weight bytes a decode step reads (every layer, the final norm, the LM
 * head; not an untied embedding table): what the weights' formats cost in
 * memory traffic. */
size_t kvs_model_weight_bytes_read(const kvs_model *m);

/* ---- the forward -------------------------------------------------------------
 * What the forward computes in, laid out by the runner's executor for one step
 * (runner.h): the activations (rows: the step's token rows, padding included)
 * and, per layer, the step's metadata in backend memory: its attention batch,
 * the pool slot of each new token's K and V (-1: none), and the rows the
 * observation window captures (query row cap_src[i] into window row
 * cap_dst[i], i < n_cap; cap_dst -1 skips). */
typedef struct {
    kvs_attn_batch attn;
    const int32_t *slots, *cap_src, *cap_dst;
    int n_cap;
} kvs_layer_step;

typedef struct {
    void *x, *xn, *qkv, *q, *att, *tmp, *gate_up, *act; /* [rows][...]; q: qkv's q rotated */
    float *lse;                                         /* [rows][heads] */
    uint8_t *xq; float *xs; /* fp8: a GEMM input's E4M3 codes [rows][widest input] and per-row scales [rows] */
    void *last, *logits;    /* [max_seqs][hidden], [max_seqs][vocab_pad] */
    int n_rows;
    const int32_t *ids, *positions; /* [n_rows] */
    kvs_layer_step *layers;         /* [n_layers] */
} kvs_forward_state;

/* The embedding of the step's ids, then every layer over the KV device's pool
 * and tables (what a decode step's CUDA graph holds): the new tokens' K and V
 * are written, x holds the last layer's output. */
kvs_status kvs_forward_layers(const kvs_model *m, kvs_forward_state *s, const kvs_kv_device *kv);
/* The final norm and this rank's vocabulary slice of the logits of rows
 * last_rows[0 .. n) (backend memory) into s->logits [n][vocab_pad]. */
void kvs_forward_logits(const kvs_model *m, kvs_forward_state *s, const int32_t *last_rows, int n);

#endif
