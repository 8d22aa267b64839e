/* engine: requests, their sampling parameters, the scheduler (continuous batching,
 * chunked prefill, admission, preemption), the step loop and each request's output stream. */
#ifndef KVS_ENGINE_H
#define KVS_ENGINE_H

#include "core/core.h"
#include "grammar/grammar.h"
#include "kv/kv.h"
#include "model/model.h"
#include "runner/runner.h"
#include "tokenizer/tokenizer.h"

/* ---- sampling ------------------------------------------------------------- */
typedef struct {
    float temperature; /* 0 = greedy */
    int top_k;         /* 0 = off */
    float top_p;       /* 1 = off */
    float min_p;       /* 0 = off */
    uint64_t seed;
    bool has_seed;     /* false: the engine draws a seed per request */
    /* penalties on the logits before the draw (backend/sample.h, vLLM's
       semantics): presence and frequency (OpenAI's, in [-2, 2], on the
       generated tokens), repetition (vLLM's, > 0, on prompt and generated
       tokens; 1 = off) */
    float presence_penalty, frequency_penalty, repetition_penalty;
} kvs_sampling_params;

kvs_sampling_params kvs_sampling_default(void); /* greedy */
/* Checks ranges; errors name the parameter (e.g. "temperature must be >= 0").
 * The engine samples on the backend (kvs_executor_forward_sample,
 * backend/sample.h): a counter-based draw per (seed, generated-token index). */
kvs_status kvs_sampling_validate(const kvs_sampling_params *p);
/* Layers a request's defaults: the fields g sets replace those of *sp and its
 * max_new_tokens *max_tokens (max_tokens NULL: not wanted). Applied to the
 * built-in defaults, then the model's generation_config.json
 * (--generation-config auto), then what the request itself sets, the last to
 * set a field wins. */
void kvs_sampling_apply(const kvs_generation_config *g, kvs_sampling_params *sp, int *max_tokens);
/* "temperature 0.6, top_p 0.9": the temperature ("0 (greedy)"), then the
 * filters and the repetition penalty that are on, into buf. */
void kvs_sampling_describe(const kvs_sampling_params *p, char *buf, size_t cap);

/* ---- the engine: continuous batching over one model ------------------------
 * Requests are submitted from any thread; one engine thread runs steps:
 * running decodes first, then chunked prefill of waiting requests (FCFS)
 * within max_num_batched_tokens; a request is admitted when the pool can hold
 * its prompt in every layer (the peak, before compaction); when the pool runs
 * dry the newest running request is preempted (blocks freed, recomputed
 * later). Outputs are delivered through a callback on the thread that runs the
 * step (the engine thread once started). */
typedef struct {
    int max_num_seqs;           /* running sequences at most (default 64) */
    int max_num_batched_tokens; /* tokens per step (default 2048) */
    int max_model_len;          /* context limit; 0 = the model's max_position_embeddings */
    size_t kv_memory_bytes;     /* the KV pool's size (0: 1 GiB) */
    int max_waiting;            /* queued requests at most; more get KVS_ERR_BUSY (default 1024) */
    kvs_kv_policy default_policy;
    /* Automatic prefix caching (default on; docs/SPARSITY.md): full blocks of
     * prompt tokens stay cached at full resolution after their request (and
     * after its compaction), evicted least recently used when the pool needs
     * them; a request reuses its longest cached prefix and prefills the rest. */
    bool enable_prefix_caching;
    /* KV events (kv.h; serve --kv-events-config): when set, called on the
     * stepping thread after each step (or reset) that logged any, with them. */
    void (*on_kv_events)(void *user, const kvs_kv_event_log *events);
    void *kv_events_user;
} kvs_engine_config;

kvs_engine_config kvs_engine_config_default(void);

#define KVS_MAX_STOP_STRINGS 8
#define KVS_MAX_N 16          /* choices per request */
#define KVS_MAX_LOGIT_BIAS 300 /* entries */

typedef struct {
    int32_t id;
    float bias; /* added to the logit, in [-100, 100] */
} kvs_logit_bias;
#define KVS_MAX_CACHE_SALT 256 /* bytes */

typedef struct {
    const int32_t *prompt_ids; /* copied */
    int n_prompt;
    kvs_sampling_params sampling;
    int max_tokens;            /* > 0 */
    const int32_t *stop_ids;   /* extra stop token ids, copied */
    int n_stop_ids;
    const char *const *stop_strings; /* copied; matched across token boundaries, not emitted */
    int n_stop_strings;
    bool ignore_eos;
    int logprobs;              /* 0: none; > 0: each token's logprob (of the raw logits) */
    int top_logprobs;          /* 0 .. 20: that many most likely alternatives per token (needs logprobs) */
    /* n > 1 (at most KVS_MAX_N; 0 = 1): n sequences from one prompt, each its own
     * draw (choice i > 0 seeds its stream from the seed and i), outputs marked
     * with their index; with prefix caching the prompt is prefilled once and
     * the other choices start from its cached blocks. One request id for all:
     * an abort ends every choice. */
    int n;
    const kvs_logit_bias *logit_bias; /* copied; at most KVS_MAX_LOGIT_BIAS distinct ids */
    int n_logit_bias;
    int min_tokens;            /* EOS and stop ids banned, stop strings not matched, before this many tokens */
    /* Structured output: the output must follow this grammar (NULL: none; the
     * engine takes a reference). Every draw is masked to the tokens that keep
     * the output a valid prefix (grammar/grammar.h, the masks applied on the
     * device before the draw); EOS only once it is complete, and then the
     * request ends (also with ignore_eos). Needs a tokenizer. */
    kvs_grammar *grammar;
    const kvs_kv_policy *policy; /* NULL: the engine's default */
    /* Teacher forcing (scoring a continuation: eval ppl; a conversation's next
     * turn appended to a compressed cache: eval multiturn): the first n_forced
     * generated tokens are these ids (copied; n_forced <= max_tokens), taken in
     * place of a draw, each with the model's logprob and text; they stop nothing
     * (EOS, stop ids and stop strings are checked from the first drawn token on). */
    const int32_t *forced_ids;
    int n_forced;
    /* Prefix caching: requests reuse each other's prompt blocks only when
     * their salts are equal (NULL: no salt; copied; at most KVS_MAX_CACHE_SALT bytes). */
    const char *cache_salt;
} kvs_request_params;

typedef enum { KVS_FINISH_NONE, KVS_FINISH_STOP, KVS_FINISH_LENGTH, KVS_FINISH_ABORT, KVS_FINISH_ERROR } kvs_finish;
const char *kvs_finish_name(kvs_finish f); /* "stop", "length", "abort", "error" (OpenAI's names where they exist) */

/* One delivery for one request: the new tokens of a step and their text. */
typedef struct {
    uint64_t request_id;
    int index;                /* the choice (0 .. n - 1) */
    const int32_t *token_ids; /* new tokens (usually 1) */
    const float *logprobs;    /* [n_tokens] when asked, else NULL */
    int n_tokens;
    const int32_t *top_ids;   /* [n_tokens][n_top]: the most likely tokens, best first (top_logprobs) */
    const float *top_logprobs;
    int n_top;
    const char *text;         /* new UTF-8 text (complete characters; stop strings cut) */
    size_t text_len;
    kvs_finish finish;        /* != NONE on the last delivery */
    const char *error;        /* message when finish == ERROR */
    int prompt_tokens, completion_tokens;
    /* on the first token's delivery: KV entries a full cache would hold / entries
       held after the prompt (its KV policy applied; 1: nothing dropped); else 0 */
    double prompt_compression;
    int cached_tokens;        /* prompt tokens found in the prefix cache (the latest admission) */
    /* on the first token's delivery too (else NULL): each layer's KV entries
       after the prompt and its kind ([n_layers]; kvs_kv_len, kvs_kv_layer_sparse: 0 full,
       1 compacted by the request's policy, 2 a sliding-window layer) */
    const int32_t *layer_entries;
    const uint8_t *layer_kind;
    int n_layers;
    int stop_string;          /* finish STOP by a stop string: 1 + its index in stop_strings (else 0) */
} kvs_request_output;

/* Called on the thread that runs the step; must not block for long and must
 * not call back into the engine except kvs_engine_abort. */
typedef void (*kvs_output_fn)(void *user, const kvs_request_output *out);

typedef struct kvs_engine kvs_engine;

/* tok may be NULL (ids only: no text in outputs, no stop strings). */
kvs_status kvs_engine_create(kvs_model *model, const kvs_tokenizer *tok, const kvs_engine_config *cfg,
                             kvs_engine **out);
/* The same over a runner of any tensor-parallel size (docs/TP.md): the engine
 * schedules once and every rank runs the step. The runner stays the caller's
 * (destroy it after the engine); the engine makes its ranks' KV caches
 * (kvs_runner_kv_create) with kv_memory_bytes per rank: each rank's pool holds
 * its KV heads only, so N ranks hold N times the tokens of one.
 * kvs_engine_create wraps its model in a world-1 runner, so both take the
 * same path. */
kvs_status kvs_engine_create_runner(kvs_runner *runner, const kvs_tokenizer *tok, const kvs_engine_config *cfg,
                                    kvs_engine **out);
/* Starts the engine thread. Without it, drive the engine with kvs_engine_step. */
kvs_status kvs_engine_start(kvs_engine *e);
/* The request's length against the context, the one check of it (the
 * engine's door, kvs_engine_submit, runs it; a server runs it before it
 * submits, to name the field of its 400): a prompt of n_prompt tokens must
 * leave room for one token, and n_prompt + max_tokens must fit in
 * max_model_len. Returns the limit broken, KVS_LENGTH_OK when none; then
 * kvs_last_error() is OpenAI's message: "this model's maximum context length
 * is N tokens; the prompt has M" (KVS_LENGTH_PROMPT), "...; the prompt has M
 * and K were asked for" (KVS_LENGTH_MAX_TOKENS). */
typedef enum { KVS_LENGTH_OK, KVS_LENGTH_PROMPT, KVS_LENGTH_MAX_TOKENS } kvs_length_limit;
kvs_length_limit kvs_length_check(int max_model_len, int n_prompt, int max_tokens);

/* Thread-safe. Errors: KVS_ERR_INVALID (message names the field: empty prompt,
 * max_tokens < 1, the context's limits (kvs_length_check), bad sampling
 * parameter, policy),
 * KVS_ERR_BUSY (queue full), KVS_ERR_UNSUPPORTED (stop strings without a tokenizer),
 * KVS_ERR_INTERNAL when the engine has failed (kvs_engine_failed). */
kvs_status kvs_engine_submit(kvs_engine *e, const kvs_request_params *p, kvs_output_fn fn, void *user,
                             uint64_t *request_id);
/* Thread-safe; the request ends with finish ABORT and its blocks are freed at
 * the next step. Unknown or finished ids are ignored. */
void kvs_engine_abort(kvs_engine *e, uint64_t request_id);
/* One iteration (when not started). Returns KVS_OK also when idle. */
kvs_status kvs_engine_step(kvs_engine *e);
/* Empties the prefix cache (kvs_kv_reset_prefix_cache) on the stepping
 * thread, between two steps; returns once done (the engine thread, if any,
 * does it). Running requests keep their blocks and go on. */
kvs_status kvs_engine_reset_prefix_cache(kvs_engine *e);
bool kvs_engine_idle(kvs_engine *e); /* nothing waiting or running */
/* What a request may ask for: submit refuses beyond these (the server's
 * defaults and its early refusals of oversized bodies use them). */
typedef struct {
    int max_model_len; /* prompt + max_tokens at most */
    int vocab_size;    /* prompt ids below this */
    int n_layers;      /* a KV policy's full_layers at most */
    int max_window;    /* a sparse policy's observation window at most */
    size_t kv_entry_bytes; /* one KV entry: one token of one layer, K and V of every KV head */
} kvs_engine_limits;
kvs_engine_limits kvs_engine_get_limits(const kvs_engine *e);
/* The KV policy of requests that name none. */
kvs_kv_policy kvs_engine_default_policy(const kvs_engine *e);
/* The vocabulary the engine's grammar masks walk (made once, on the calling
 * thread; thread-safe): a server warms a grammar's first masks with it off
 * the engine's thread (kvs_grammar_warm). KVS_ERR_UNSUPPORTED without a
 * tokenizer. */
kvs_status kvs_engine_grammar_vocab(kvs_engine *e, const kvs_grammar_vocab **out);
/* Health. A failed step (a CUDA error or kernel fault, a broken
 * tensor-parallel group, a backend op out of memory: the KV cache and the
 * model's state are then undefined) fails the engine for good: every running
 * and waiting request ends with finish ERROR ("the engine failed: ..."),
 * submit refuses with that message, steps do nothing. The process should
 * drain and exit so that a supervisor restarts it (`kvsparse serve` does).
 * A request whose logits are not finite (NaN or inf) fails alone, with
 * "non-finite logits at generated token N"; the engine carries on.
 * Thread-safe; *reason (when not NULL and failed) stays valid while e lives. */
bool kvs_engine_failed(kvs_engine *e, const char **reason);
/* Stops the thread: drain = finish every request first; else abort them all. */
void kvs_engine_stop(kvs_engine *e, bool drain);
void kvs_engine_destroy(kvs_engine *e);

/* Latency histograms (seconds): counts per bucket with these upper bounds (+Inf last). */
#define KVS_HIST_BUCKETS 12
extern const double kvs_hist_bounds[KVS_HIST_BUCKETS]; /* constant table */
typedef struct {
    uint64_t counts[KVS_HIST_BUCKETS + 1];
    double sum;
    uint64_t n;
} kvs_histogram;

typedef struct {
    int running, waiting;
    int64_t kv_blocks_total, kv_blocks_used, kv_blocks_full_layers, kv_blocks_sparse_layers;
    double compression_ratio;   /* KV entries a full cache would hold / entries held, over running requests */
    uint64_t prompt_tokens_total, generation_tokens_total, requests_finished, preemptions;
    kvs_histogram ttft, itl;     /* time to first token, inter-token latency */
    int64_t kv_tokens_capacity;  /* tokens the pool holds (every layer full) */
    /* prefix caching: prompt tokens looked up and found (vLLM's counts),
       cached blocks evicted; cached blocks (in use or evictable) in the layers
       the default policy keeps full / compacts, and those no request holds
       (evictable: counted in the free blocks) */
    uint64_t prefix_cache_queries, prefix_cache_hits, prefix_cache_evictions;
    int64_t kv_blocks_cached_full_layers, kv_blocks_cached_sparse_layers, kv_blocks_evictable;
    int64_t prefix_cache_reusable_blocks; /* prompt blocks cached in every layer (with KV events on; else 0) */
    /* the last step's batch: its tokens, and those of its sequences with one
       token in it (decodes; bench throughput --profile sorts steps by them) */
    int step_tokens, step_decode_tokens;
} kvs_engine_stats;

void kvs_engine_get_stats(kvs_engine *e, kvs_engine_stats *s); /* thread-safe */

#endif
