/* server: the OpenAI-compatible HTTP API over one engine (libmicrohttpd).
 * Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as
 * SSE), POST /v1/messages and /v1/messages/count_tokens (Anthropic's),
 * POST /v1/responses (OpenAI's responses), GET /v1/models, GET /health,
 * GET /metrics (Prometheus text).
 * docs/SERVING.md describes the fields, the kv_policy extension and errors. */
#ifndef KVS_SERVER_H
#define KVS_SERVER_H

#include "core/core.h"
#include "engine/engine.h"
#include "kv/kv.h"
#include "tokenizer/tokenizer.h"

/* ---- OpenAI requests: parsing and validation (no engine needed) ----------- */
typedef enum { KVS_API_COMPLETIONS, KVS_API_CHAT } kvs_api_kind;
/* The wire format of a request and its answers: OpenAI's chat / completions,
 * Anthropic's messages (anthropic.h), OpenAI's responses (responses.h). The
 * last two are chat requests (KVS_API_CHAT) in another shape. */
typedef enum { KVS_DIALECT_OPENAI, KVS_DIALECT_ANTHROPIC, KVS_DIALECT_RESPONSES } kvs_api_dialect;

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}}. */
typedef struct {
    int http_status;   /* 400, 401, 404, 405, 413, 429, 500, 503 */
    const char *type;  /* "invalid_request_error", ... (a constant) */
    const char *code;  /* NULL or a constant such as "model_not_found" */
    char param[64];    /* the offending field ("" when none) */
    char message[512];
} kvs_api_error;

/* What the validator needs to know about the model. */
typedef struct {
    int vocab_size;    /* token ids in prompts must be below this */
    int max_model_len; /* context limit: prompt + max_tokens */
    int n_layers;      /* for kv_policy validation */
    const kvs_kv_profile *kv_profile; /* every kv_policy's budget profile (the server's --kv-profile; NULL: none) */
    const kvs_sampling_params *sampling; /* a request's defaults for what it leaves out (NULL: kvs_api_sampling_default) */
    int max_window;    /* kv_policy.window at most (0: KVS_KV_MAX_WINDOW; with an engine, its own) */
} kvs_api_limits;

/* OpenAI's defaults: temperature 1, the filters and penalties off. */
kvs_sampling_params kvs_api_sampling_default(void);

/* tool_choice (tools_json.c) */
typedef enum { KVS_TOOL_CHOICE_AUTO, KVS_TOOL_CHOICE_NONE, KVS_TOOL_CHOICE_REQUIRED, KVS_TOOL_CHOICE_FUNCTION } kvs_tool_choice;

typedef struct {
    kvs_api_kind kind;
    kvs_api_dialect dialect;            /* the shape it came in and is answered in */
    char *model;                        /* NULL when absent */
    bool stream, include_usage;
    char *prompt;                       /* completions: a text prompt, or NULL */
    int32_t *prompt_ids;                /* completions: a token-id prompt, or NULL */
    int n_prompt_ids;
    kvs_chat_message *messages;         /* chat: strings owned */
    int n_messages;
    kvs_sampling_params sampling;
    int max_tokens;                     /* 0: the default (16 for completions, the rest of the context for chat) */
    const char *max_tokens_param;       /* the field that set it: max_tokens or max_completion_tokens (errors name it) */
    char *stop[KVS_MAX_STOP_STRINGS];
    int n_stop;
    bool ignore_eos;
    bool logprobs;                      /* return the chosen tokens' logprobs */
    int top_logprobs;                   /* completions' integer logprobs / chat's top_logprobs */
    bool has_policy;
    kvs_kv_policy policy;
    char *cache_salt;                   /* NULL: none; requests share cached prefixes only with equal salts */
    bool return_token_ids;              /* vLLM's: the choices carry the generated "token_ids" */
    /* tools (tools_json.c) */
    char *tools;                        /* chat: the tools, JSON text of the array (NULL: none) */
    kvs_tool_choice tool_choice;
    char *tool_choice_name;             /* KVS_TOOL_CHOICE_FUNCTION: the function */
    bool parallel_tool_calls;           /* false: one call at most */
    /* tool_choice required or a function: what the output must be (route.c fills
     * them with kvs_api_tool_constraint): the prefix, then JSON text valid for the
     * schema, then the suffix; NULL: no constraint. >>> the grammar engine's input */
    char *constraint_schema, *constraint_prefix, *constraint_suffix;
    int n;                              /* choices (1 .. KVS_MAX_N) */
    kvs_logit_bias *logit_bias;         /* "logit_bias": {"id": bias, ...} */
    int n_logit_bias;
    int min_tokens;
    int32_t *stop_token_ids;            /* vLLM's "stop_token_ids" */
    int n_stop_token_ids;
    /* response_format: text (none), json_object (any JSON object), json_schema (schema: a reference
       to the parsed schema, compiled without being written out and parsed again) */
    enum { KVS_FORMAT_TEXT, KVS_FORMAT_JSON_OBJECT, KVS_FORMAT_JSON_SCHEMA } format;
    struct json_t *format_schema;
    struct json_t *echo;                /* responses: the request's fields its response object repeats */
} kvs_api_request;

/* Parses and validates a request body. On failure fills err (HTTP status,
 * param naming the field) and returns false; req is then empty. */
bool kvs_api_parse_request(const char *body, size_t len, kvs_api_kind kind, const kvs_api_limits *lim,
                           kvs_api_request *req, kvs_api_error *err);
void kvs_api_request_free(kvs_api_request *req);
/* An empty request of kind with lim's sampling defaults (what every parser starts from). */
void kvs_api_request_init(kvs_api_request *req, kvs_api_kind kind, const kvs_api_limits *lim);
/* Fills err; returns false (for `return kvs_api_fail(...)`). */
bool kvs_api_fail(kvs_api_error *err, int http_status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* {"error": {...}} as a malloc'ed string. */
char *kvs_api_error_json(const kvs_api_error *err);
/* The error in d's shape: Anthropic's {"type": "error", "error": {"type", "message"}}
 * (its status mapped: 503 -> 529 overloaded_error), else OpenAI's. */
char *kvs_api_error_json_as(const kvs_api_error *err, kvs_api_dialect d);
/* The HTTP status err is answered with in d (Anthropic's 529 for 503). */
int kvs_api_error_status(const kvs_api_error *err, kvs_api_dialect d);

/* ---- the HTTP server -------------------------------------------------------- */
typedef struct {
    const char *host;              /* "127.0.0.1" */
    int port;                      /* 0: any free port (kvs_server_port tells which) */
    const char *api_key;           /* NULL: no auth */
    const char *served_model_name; /* the "model" clients name */
    size_t max_body_bytes;         /* 0: 4 MiB */
    int max_model_len;             /* without an engine (the request path's tests): the limits; */
    int n_layers;                  /* with one, the engine's (kvs_engine_get_limits) */
    unsigned connection_limit;     /* 0: 1024 */
    unsigned max_connections_per_ip; /* 0: 256; one address's connections beyond are refused */
    unsigned max_pending;          /* 0: connection_limit / 4; connections not in flight (docs/SERVING.md) */
    unsigned http_timeout_s;       /* 0: 60; a connection that makes no progress this long is closed */
    double header_timeout_s;       /* 0: 10; a request's line and headers within this */
    double body_timeout_s;         /* 0: 10; its body within this, */
    double body_min_rate;          /* 0: 4096; plus a second per this many bytes */
    int max_preparing;             /* requests parsed and tokenized at once (0: 8); more wait, then 429 */
    kvs_grammar_limits grammar_limits; /* a schema's bounds (zeros: kvs_grammar_limits_default()) */
    size_t grammar_cache_bytes;    /* 0: 256 MiB; the compiled grammars kept */
    const char *tool_call_parser;  /* "llama3_json", "hermes", "none"; NULL or "auto": from the chat template */
    int max_tokens_default;        /* a request without max_tokens: at most this many (0: completions 16,
                                      chat the rest of the context); capped by the context */
    /* a request's sampling defaults for the parameters it leaves out (serve: the model's
       generation_config.json over kvs_api_sampling_default); NULL: kvs_api_sampling_default */
    const kvs_sampling_params *sampling_defaults;
    bool no_web_ui;                /* GET / is 404 instead of the chat page */
    bool no_vllm_metrics;          /* /metrics without vLLM's names of its values (routers scrape them) */
    bool no_prefix_caching;        /* the engine's prefix caching is off (kvsparse_kv_admit_tokens: no compaction copies) */
} kvs_server_config;

typedef struct kvs_server kvs_server;

/* Binds and starts serving: one thread for every connection (libmicrohttpd's
 * epoll loop), --max-preparing workers, a watcher of deadlines and disconnects. */
kvs_status kvs_server_start(const kvs_server_config *cfg, kvs_engine *engine, const kvs_tokenizer *tok,
                            kvs_server **out);
int kvs_server_port(const kvs_server *s);
/* Stops accepting connections, answers new requests on open connections 503,
 * and waits up to timeout_s seconds for the generation requests in flight to
 * finish; those still running then are aborted, and get up to 2 s more to
 * send their clients the end (finish "abort", [DONE]). Returns how many were
 * aborted. Then stop the engine (drain), then kvs_server_stop. */
int kvs_server_drain(kvs_server *s, int timeout_s);
/* Closes every connection and frees the server (drain first for a clean stop). */
void kvs_server_stop(kvs_server *s);

/* What the HTTP side adds to /metrics. */
typedef struct {
    uint64_t http_requests, http_errors;
    unsigned connections_pending, connections_in_flight;
    uint64_t header_timeouts, body_timeouts, displaced, refused; /* connections shut or refused (conns.h) */
    size_t grammar_cache_bytes;
    int grammar_cache_entries;
} kvs_server_http_stats;

/* Prometheus text exposition of the engine's stats (malloc'ed); cfg: vLLM's
 * names too (no_vllm_metrics), the engine's prefix caching. */
char *kvs_server_metrics_text(kvs_engine *engine, const kvs_server_config *cfg, const char *model_name,
                              const kvs_server_http_stats *http);
/* kvsparse_kv_admit_tokens (kv_admit.c): the longest prompt a new request
 * under policy p is admitted with when free_blocks blocks are free (0: none):
 * the largest P whose peak (kvs_kv_policy_seq_blocks: the prompt in each of
 * n_layers layers before the compaction, and with prefix caching the
 * compaction's own copies of the sparse layers) fits, what the scheduler's
 * admission asks of a request with no cached prefix (engine/scheduler.c). */
int64_t kvs_server_kv_admit_tokens(const kvs_kv_policy *p, int n_layers, bool prefix_caching, int64_t free_blocks);

#endif
