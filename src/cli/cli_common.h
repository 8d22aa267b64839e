/* Shared by the subcommands: loading a model from command-line options. */
#ifndef KVS_CLI_COMMON_H
#define KVS_CLI_COMMON_H

#include "backend/backend.h"
#include "backend/profile.h"
#include "engine/engine.h"
#include "kv/kv.h"
#include "model/model.h"
#include "runner/runner.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *model_dir;   /* -m */
    const char *config_path; /* --config (with --load-format dummy) */
    bool dummy;              /* --load-format dummy */
    uint64_t dummy_seed;
    int threads;             /* --threads */
    const char *dtype;       /* --dtype: NULL or "auto" (the checkpoint's), float32, bfloat16, float16 */
    const char *kv_dtype;    /* --kv-cache-dtype: NULL or "auto" (the weights' dtype), float32, bfloat16, float16, fp8 */
    bool skip_model;         /* load config, checkpoint and backend only */
    int tensor_parallel;     /* --tensor-parallel-size (0 or 1: none) */
    bool allow_tp;           /* set by the commands wired for tensor parallelism */
    const char *device;      /* --device cpu (default) | cuda | cuda:N */
    kvs_quantization quantization; /* --quantization fp8, q8_0, q4_k (default none) */
    bool enforce_eager;      /* --enforce-eager: no CUDA graphs for decode steps */
    kvs_step_limits limits; /* what a step of the command may hold (zeros: the defaults) */
    const char *kv_profile;  /* --kv-profile (kvs_cli_policy_option): loaded for the model by kvs_cli_load */
    bool profile;            /* bench throughput --profile: the backend's ops timed (backend/profile.h), world 1 */
} kvs_load_options;

typedef struct {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    kvs_tokenizer *tok; /* NULL when the folder has no tokenizer.json */
    kvs_runner *runner; /* the model over N >= 1 ranks (--tensor-parallel-size); NULL with skip_model */
    kvs_dtype weight_dtype, kv_dtype; /* --dtype, --kv-cache-dtype resolved: the CPU backends' */
    int world;          /* ranks (1 without tensor parallelism) */
    /* --device cuda with N > 1: one CUDA backend and one NCCL communicator per
       rank (be is rank_be[0]); the runner uses them, the CLI owns them */
    kvs_backend **rank_be;
    struct kvs_comm **rank_comm;
    /* --kv-profile's, checked against the model: the commands set it as their
       policies' profile; it lives as long as the model (kvs_cli_unload frees it) */
    kvs_kv_profile *kv_profile;
    kvs_profile *profile; /* load option profile: the timing wrapper's counts (be is the wrapper) */
} kvs_loaded;

#define KVS_CLI_LOAD_HELP                                                                    \
    "  -m, --model DIR        the model folder: config.json, safetensors, tokenizer.json;\n"    \
    "                         or a GGUF file (FILE.gguf: llama.cpp's, nothing beside it)\n"    \
    "  --config FILE          a config.json alone, with --load-format dummy (no checkpoint)\n"   \
    "  --load-format F        auto (default): the safetensors; dummy: seeded random weights\n"   \
    "  --threads N            CPU threads (default: one per core, or $OMP_NUM_THREADS)\n"      \
    "  --dtype D              CPU weights: auto (default: as the checkpoint stores them; bf16 and\n" \
    "                         f16 are widened in registers), float32, bfloat16 or float16\n"   \
    "  --kv-cache-dtype D     KV cache: auto (default: the weights' dtype, as vLLM), float32,\n" \
    "                         bfloat16 or float16 (CPU), or fp8 (E4M3, a byte an entry, a scale\n" \
    "                         per layer and KV head: the checkpoint's k_scale/v_scale, else 1;\n" \
    "                         CPU, and CUDA on compute capability 8.9+)\n"                      \
    "  --quantization Q       fp8: linear weights in FP8 E4M3 (a scale per output channel,\n"      \
    "                         quantized at load), activations per token; CUDA: compute capability\n" \
    "                         8.9+; implied by an FP8 checkpoint (quantization_config fp8 /\n"   \
    "                         compressed-tensors). q8_0, q4_k: linear weights in llama.cpp's block\n" \
    "                         formats, quantized at load (CPU). A GGUF file's quantized weights are\n" \
    "                         kept in its own blocks on the CPU (dequantized to bf16 on CUDA)\n"
#define KVS_CLI_DEVICE_HELP                                                                  \
    "  --device D             cpu (default), cuda or cuda:N\n"                                 \
    "  --enforce-eager        no CUDA graphs for decode steps (default: graphs on cuda)\n"

/* Handles -m, --config, --load-format, --threads, --dtype, --kv-cache-dtype, --quantization, --device, --enforce-eager,
 * --tensor-parallel-size at argv[*i];
 * advances *i.
 * Returns 1 if consumed, 0 if not one of these, -1 on a bad value. */
int kvs_cli_load_option(kvs_load_options *o, int argc, char **argv, int *i);
kvs_status kvs_cli_load(const kvs_load_options *o, kvs_loaded *out);

/* KV policy options at argv[*i]: --kv-policy full|snapkv|pyramidkv|streamingllm,
 * --kv-budget 0.1|10%|256, --kv-full-layers N, --kv-window W, --kv-pool P,
 * --kv-min-prompt N, --kv-pyramid-beta X, and --kv-profile FILE, whose path
 * goes to *profile_path (kvs_load_options.kv_profile: kvs_cli_load reads it
 * once the model's layers are known). Same contract as kvs_cli_load_option (1, 0, -1). */
int kvs_cli_policy_option(kvs_kv_policy *p, const char **profile_path, int argc, char **argv, int *i);
#define KVS_CLI_POLICY_HELP                                                                \
    "  --kv-policy P          full (default), snapkv, pyramidkv or streamingllm\n"         \
    "  --kv-budget B          entries kept per KV head in sparse layers: 0.1, 10%% or 256\n" \
    "  --kv-full-layers N     the first N layers stay full (default 0)\n"                  \
    "  --kv-window W          observation window (default 16)\n"                           \
    "  --kv-pool P            max-pool kernel, odd (default 7)\n"                          \
    "  --kv-min-prompt N      prompts shorter than N are not compressed (default 64)\n"       \
    "  --kv-pyramid-beta X    pyramidkv slope: top layer keeps (B - w) / X (default 1.5)\n"    \
    "  --kv-profile FILE      split the budget among the sparse layers as FILE's shares say (kvsparse\n" \
    "                         calibrate --out; the target nearest the compression)\n"
void kvs_cli_unload(kvs_loaded *l);

/* --enable-prefix-caching / --no-enable-prefix-caching (vLLM's names) as arg:
 * sets *enable, returns 1; 0 when arg is neither. */
int kvs_cli_prefix_caching_option(bool *enable, const char *arg);
#define KVS_CLI_PREFIX_CACHING_HELP                                                             \
    "  --enable-prefix-caching  reuse the cached KV of prompt prefixes across requests (default)\n" \
    "  --no-enable-prefix-caching  prefill every prompt in full, cache nothing\n"

/* --generation-config auto|none (the commands whose requests have defaults:
 * serve, generate) at argv[*i]: *none true for none. Same contract as
 * kvs_cli_load_option (1, 0, -1). */
int kvs_cli_generation_option(bool *none, int argc, char **argv, int *i);
#define KVS_CLI_GENERATION_HELP                                                                 \
    "  --generation-config G  auto (default): a request's defaults (temperature, top_p, top_k, min_p,\n" \
    "                         repetition_penalty, max tokens) from the model's generation_config.json\n" \
    "                         (do_sample false: greedy); none: the built-in ones; values set win\n"
/* The sampling fields of the model folder's generation_config.json (none, or
 * no folder: none set); a bad field fails naming the file and the field. */
kvs_status kvs_cli_generation_config(const kvs_load_options *o, bool none, kvs_generation_config *g);


/* The KV pool's size options of serve and bench throughput. */
typedef struct {
    double kv_gib;   /* --kv-memory GiB: the pool itself (per rank) */
    double gpu_gib;  /* --gpu-memory GiB: a cap on each GPU's memory, emulating a smaller card */
    double gpu_util; /* --gpu-memory-utilization: the share of each card kvsparse takes (0.9) */
} kvs_cli_memory;
#define KVS_CLI_HOST_KV_GIB 1 /* the pool on the CPU without --kv-memory */
#define KVS_CLI_MEMORY_HELP                                                                              \
    "  --kv-memory GiB        the KV pool's size (per rank; default on the CPU 1, on a GPU what\n"        \
    "                         --gpu-memory-utilization leaves)\n"                                         \
    "  --gpu-memory-utilization U  the share of each GPU's memory to take: the KV pool gets U x the\n"   \
    "                         card's memory less what is in use once the model is loaded (default 0.9)\n" \
    "  --gpu-memory GiB       instead, a cap on each GPU's memory: KV = cap - weights - activations\n"
kvs_cli_memory kvs_cli_memory_default(void);
/* --kv-memory, --gpu-memory, --gpu-memory-utilization at argv[*i]: 1, 0 or -1 as kvs_cli_load_option. */
int kvs_cli_memory_option(kvs_cli_memory *m, int argc, char **argv, int *i);
/* KVS_ERR_INVALID naming the conflict when both --kv-memory and --gpu-memory are given. */
kvs_status kvs_cli_memory_check(const kvs_cli_memory *m);

/* The KV pool's bytes per rank: --kv-memory; else --gpu-memory less this
 * rank's weights, step buffers (for the limits the model was loaded with), the
 * backend's scratch and the policy's window buffers; else on a GPU
 * --gpu-memory-utilization x the card less what the loaded model already uses
 * and those lazy allocations; else (CPU) KVS_CLI_HOST_KV_GIB. */
kvs_status kvs_cli_kv_bytes(kvs_loaded *l, const kvs_cli_memory *m, const kvs_kv_policy *policy, size_t *bytes);

/* The KV pool's bytes per rank that hold max_seqs sequences of a prompt_len
 * prompt and max_new generated tokens each, at their peak under the policy
 * (generate, eval, bench model, calibrate). */
size_t kvs_cli_kv_bytes_for(const kvs_loaded *l, const kvs_kv_policy *policy, bool prefix_caching, int prompt_len,
                            int max_new, int max_seqs);
/* The start-up line of every backend: the pool in tokens and how many requests
 * of max_len (the model's maximum) and of 4,000 tokens run at once, with a full
 * cache and under the engine's default policy. */
void kvs_cli_log_capacity(const kvs_loaded *l, const kvs_engine_config *ec, int max_len);

/* An engine over the loaded model's runner (N >= 1 ranks) with the backend's
 * sampler: the one generation path of the commands and the server. */
kvs_status kvs_cli_engine(kvs_loaded *l, const kvs_engine_config *c, kvs_engine **out);
#define KVS_CLI_TP_HELP                                                                     \
    "  -tp, --tensor-parallel-size N  split heads, MLP and vocabulary over N ranks, one thread each:\n" \
    "                         with --device cuda[:K] GPUs K .. K+N-1 over NCCL; on the CPU\n"   \
    "                         backend a simulation (same results as N = 1)\n"

/* bench throughput --profile (profile_table.c): the totals as a table of
 * phases on stdout, or as a JSON object; backend: the timed backend's name. */
void kvs_cli_profile_print(const kvs_profile_totals *t, const char *backend);
struct json_t *kvs_cli_profile_json(const kvs_profile_totals *t, const char *backend);

/* "1,2,3" -> ids (malloc'ed); false on a malformed list. */
bool kvs_cli_parse_ids(const char *s, int32_t **ids, int *n);
/* A path's last component ("models/tiny-needle-llama/" -> "tiny-needle-llama";
 * NULL: "model"), in buf. */
const char *kvs_cli_last_name(const char *path, char *buf, size_t cap);
/* Prints "kvsparse: <last error>" on stderr; returns 1. */
int kvs_cli_error(void);

#endif
