/* model: config.json, safetensors checkpoints (mmap, sharded), dummy weights,
 * and the forward pass as a sequence of backend ops. */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include "backend/backend.h"
#include "backend/sample.h"
#include "core/core.h"
#include "gguf/gguf.h"
#include "kv/kv_device.h"

/* ---- config.json ------------------------------------------------------------ */
typedef enum { KVS_ROPE_NONE, KVS_ROPE_LINEAR, KVS_ROPE_LLAMA3 } kvs_rope_type;

#define KVS_MAX_EOS 8

/* Weight quantization (--quantization; docs/CUDA.md "FP8"). FP8: the linear
 * layers' weights (q, k, v, o, gate/up, down) quantized at load to FP8 E4M3
 * with a scale per output channel, activations per token on the fly; the
 * embeddings, the LM head, the norms and biases stay in the backend's dtype. */
typedef enum { KVS_QUANT_NONE, KVS_QUANT_FP8 } kvs_quantization;
/* "fp8" -> KVS_QUANT_FP8; anything else fails, naming the value. */
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

/* What one step may hold: the model sizes its step buffers for it once, when
 * it is created; a larger batch fails (KVS_ERR_INVALID). 0: the default. */
typedef struct {
    int max_tokens; /* tokens per step: the engine's max_num_batched_tokens (2048) */
    int max_seqs;   /* sequences per step: max_num_seqs (64) */
    int max_len;    /* KV entries of a sequence in a layer: max_model_len (the config's max_position_embeddings) */
    int block_size; /* the KV cache's entries per block (16) */
} kvs_model_limits;

/* Uploads the checkpoint's weights into the backend (progress bar on a TTY)
 * and allocates the step buffers for limits (NULL: the defaults).
 * The same as kvs_model_create_shard(cfg, ck, be, 0, 1, NULL, limits, out). */
kvs_status kvs_model_create(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be,
                            const kvs_model_limits *limits, kvs_model **out);

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
                                  kvs_comm *comm, const kvs_model_limits *limits, kvs_model **out);
/* The backend bytes of a rank model's step buffers (what it allocates besides
 * the weights) on a backend of act_dtype activations. */
size_t kvs_model_step_bytes(const kvs_config *cfg, const kvs_shard *shard, const kvs_model_limits *limits,
                            kvs_dtype act_dtype);
/* The limits the model was created for, defaults filled in. */
kvs_model_limits kvs_model_get_limits(const kvs_model *m);
const kvs_shard *kvs_model_shard(const kvs_model *m);
/* The rank's FP8 KV-cache scales from the checkpoint, [n_layers][2][its KV
 * heads] (K's, then V's; 1 where the checkpoint has none): what
 * kvs_kv_device_set_scales takes for the rank's device. */
const float *kvs_model_kv_scales(const kvs_model *m);
kvs_backend *kvs_model_backend(const kvs_model *m);
void kvs_model_destroy(kvs_model *m);
const kvs_config *kvs_model_config(const kvs_model *m);

/* What one step computes: a flat list of tokens from several sequences. */
typedef struct {
    int n_tokens, n_seqs;
    const int32_t *token_ids, *positions; /* [n_tokens] */
    const int32_t *query_start;           /* [n_seqs + 1] prefix sums (varlen) */
    const int32_t *seq_ids;               /* [n_seqs] KV cache sequence ids */
    const uint8_t *wants_logits;          /* [n_seqs]: logits of the seq's last token */
} kvs_batch;

/* What the forward reads besides the weights: the batch and what the KV
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
kvs_status kvs_model_forward(kvs_model *m, const kvs_step_inputs *in, kvs_kv_device *dev, float *logits);
/* With tensor parallelism every rank calls kvs_model_forward for the same batch
 * (collectives inside); each computes the logits of its vocabulary slice and
 * they are all-gathered, so logits is the full [n][vocab] on every rank that
 * passes one (NULL: the rank takes part in the gather, copies nothing out).
 * Greedy without the full logits: kvs_model_forward_sample with temperature 0
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
 * step: the KV cache and the model's state are then undefined. */
typedef struct kvs_sample_extras kvs_sample_extras;
kvs_status kvs_model_forward_sample(kvs_model *m, const kvs_step_inputs *in, kvs_kv_device *dev,
                                    const kvs_sample_row *params, const kvs_sample_extras *x, int32_t *ids,
                                    float *logprobs);
/* What a step may add to plain sampling (x NULL: nothing):
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
 * wrong): the batch against m's limits and dev's geometry; the step's inputs
 * (the batch's, and its tables within the device's rows); the rows, one per
 * sequence wanting logits. */
kvs_status kvs_model_check_batch(const kvs_model *m, const kvs_batch *b, const kvs_kv_device *dev);
kvs_status kvs_model_check_inputs(const kvs_model *m, const kvs_step_inputs *in, const kvs_kv_device *dev);
kvs_status kvs_model_check_sample(const kvs_batch *b, const kvs_sample_row *params, const kvs_sample_extras *x,
                                  int vocab);
/* The runner's forward: kvs_model_forward_sample (params) or kvs_model_forward
 * without the checks (the runner runs them once for every rank), ending at the
 * backend's fence without waiting for it: the sampled ids, logprobs and top
 * logprobs are in ids, logprobs and x's arrays once kvs_model_step_end has
 * returned KVS_OK (the runner enqueues the KV policy's work in between; full
 * logits are copied before it returns). */
kvs_status kvs_model_forward_unchecked(kvs_model *m, const kvs_step_inputs *in, kvs_kv_device *dev,
                                       const kvs_sample_row *params, const kvs_sample_extras *x, int32_t *ids,
                                       float *logprobs, float *logits);
/* Waits for the step's fence (backend.h fence_wait: its health) and puts the
 * sampled results where the forward was told to. */
kvs_status kvs_model_step_end(kvs_model *m);
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
void kvs_model_set_graph_mode(kvs_model *m, kvs_graph_mode mode);

typedef struct {
    int64_t eager_steps;        /* steps run on the batch as given */
    int64_t padded_eager_steps; /* padded steps run eagerly (a bucket's first, failed buckets, PADDED mode) */
    int64_t captures;           /* graphs captured */
    int64_t replays;            /* steps run as a graph */
    int64_t capture_failures;
    int64_t invalidations;      /* graphs destroyed because memory they baked in moved */
} kvs_graph_stats;
kvs_graph_stats kvs_model_graph_stats(const kvs_model *m);

#endif
