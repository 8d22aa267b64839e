/* server: internals shared by http.c, generate.c, openai_response.c and metrics.c. */
#ifndef KVS_SERVER_INTERNAL_H
#define KVS_SERVER_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>

#include "server/server.h"
#include "server/tool_calls.h"

/* ---- request fields (request_fields.c, openai_request.c, kv_policy_json.c) --- */
/* Typed fields: false after filling err (400 naming name). */
bool kvs_api_get_int(json_t *v, const char *name, json_int_t lo, json_int_t hi, json_int_t *out, kvs_api_error *err);
bool kvs_api_get_number(json_t *v, const char *name, double lo, double hi, double *out, kvs_api_error *err);
bool kvs_api_get_bool(json_t *v, const char *name, bool *out, kvs_api_error *err);
/* The body as a JSON object (NULL: a 400 in err). */
json_t *kvs_api_load_object(const char *body, size_t len, kvs_api_error *err);
/* A field every API shares (model, stream, sampling, the vLLM extensions,
 * kv_policy, cache_salt): 1 taken, 0 refused (err filled), -1 not one of them. */
int kvs_api_parse_common_field(const char *key, json_t *v, const kvs_api_limits *lim, kvs_api_request *r,
                               kvs_api_error *err);
/* Stop strings (a string or an array), named param in errors. */
bool kvs_api_parse_stop(json_t *v, const char *param, kvs_api_request *r, kvs_api_error *err);
/* A structured-output format {"type": text | json_object | json_schema, ...};
 * param "text.format": the responses API's flat json_schema object. */
bool kvs_api_parse_format(json_t *v, const char *param, kvs_api_request *r, kvs_api_error *err);
/* Chat messages in OpenAI's shape (every API's messages are mapped to these). */
bool kvs_api_parse_messages(json_t *v, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err);
/* Replaces the first "from" in err's param and message with "to": the name the
 * client used for what the chat validator saw under its own (another API's field). */
void kvs_api_error_rename(kvs_api_error *err, const char *from, const char *to);
/* The engine's sampling rules, after every field. */
bool kvs_api_check_sampling(const kvs_sampling_params *p, kvs_api_error *err);
/* "kv_policy": {...} (null leaves *out alone); false after filling err. */
bool kvs_api_parse_policy(json_t *v, const kvs_api_limits *lim, kvs_kv_policy *out, kvs_api_error *err);

/* ---- tools (tools_json.c) ------------------------------------------------------ */
bool kvs_api_is_tools_field(const char *key);  /* tools, tool_choice, parallel_tool_calls */
bool kvs_api_parse_tools_field(const char *key, json_t *v, kvs_api_request *r, kvs_api_error *err);
void kvs_api_tools_defaults(kvs_api_request *r);
/* After every field: tool_choice against tools. */
bool kvs_api_tools_check(kvs_api_request *r, kvs_api_error *err);
/* A message's name, tool_call_id and (assistant) tool_calls into out (role set). */
bool kvs_api_parse_message_tools(json_t *m, int i, kvs_chat_message *out, kvs_api_error *err);
void kvs_api_tools_free(kvs_api_request *r); /* the fields above, the messages' included */
/* For tool_choice required or a named function: the output must be prefix, then
 * JSON text valid for schema, then suffix (malloc'ed; all NULL for other choices).
 * The schema is one call's object: {"name": {"const": ...}, "arguments" (hermes)
 * or "parameters" (llama3_json): the function's parameters}; anyOf over the tools
 * for required. One call: parallel calls are not forced. */
kvs_status kvs_tool_constraint(const char *tools, kvs_tool_choice choice, const char *function, kvs_tool_format f,
                               char **schema, char **prefix, char **suffix);
/* r's constraint_* from kvs_tool_constraint; false (400 naming tool_choice) when it cannot be. */
bool kvs_api_tool_constrain(kvs_api_request *r, kvs_tool_format f, kvs_api_error *err);

/* ---- response shapes (openai_response.c); every string is malloc'ed ------- */
typedef struct {
    kvs_api_kind kind;
    const char *id;    /* "cmpl-..." / "chatcmpl-..." / "msg_..." / "resp_..." */
    const char *model;
    long long created;
    const kvs_tokenizer *tok;
    bool logprobs;
    int top_logprobs;
    bool token_ids; /* the choice's "token_ids": the slice's ids */
    kvs_tool_format tools; /* chat with tools: the output is parsed for calls (NONE: not) */
    bool one_call;         /* parallel_tool_calls false: the first call only */
    kvs_api_dialect dialect; /* ANTHROPIC / RESPONSES: anthropic.h / responses.h write the answer */
} kvs_resp_meta;

/* A slice of one choice's generated tokens and their text. */
typedef struct {
    const char *text;
    size_t text_len;
    const int32_t *ids;
    const float *lps; /* NULL when not asked */
    int n;
    size_t text_offset; /* completions' logprobs.text_offset of the first token */
    int index;          /* the choice */
    const int32_t *top_ids; /* [n][n_top]: the alternatives (top_logprobs) */
    const float *top_lps;
    int n_top;
    kvs_finish finish;  /* NONE: not the choice's last slice */
    const kvs_tool_events *tool_events; /* a stream with tools: the delta is these, not text */
    bool tools_called;  /* a stream with tools: calls were sent (finish "tool_calls") */
    const char *stop_sequence; /* finish STOP by a stop string: that string (NULL: none) */
} kvs_resp_slice;

/* The whole response: one slice per choice, in index order. */
/* What the KV cache did with the prompt (an extension beside usage: "kv", and
 * usage.prompt_tokens_details.cached_tokens). */
typedef struct {
    const char *policy;       /* NULL: not known (no "kv" object) */
    double compression_ratio; /* entries a full cache would hold / entries held (1: nothing dropped) */
    int cached_tokens;        /* prompt tokens found in the prefix cache */
    int min_prompt;           /* the policy's min_prompt: a shorter prompt keeps its cache full */
    /* the prompt's KV per layer (n_layers 0: not known): entries, kind (engine.h) and an entry's bytes */
    const int32_t *layer_entries;
    const uint8_t *layer_kind;
    int n_layers;
    size_t entry_bytes;
} kvs_resp_kv;

char *kvs_resp_full(const kvs_resp_meta *m, const kvs_resp_slice *s, int n_choices, int prompt_tokens,
                    int completion_tokens, const kvs_resp_kv *kv);
/* One SSE chunk's JSON for one choice: chat's first chunk carries role; its finish NONE gives null.
 * NULL for a chat chunk whose delta would be empty (no role, content or tool_calls) before the last. */
char *kvs_resp_chunk(const kvs_resp_meta *m, const kvs_resp_slice *s, bool first, bool usage_field);
char *kvs_resp_usage_chunk(const kvs_resp_meta *m, int prompt_tokens, int completion_tokens, const kvs_resp_kv *kv);
const char *kvs_resp_finish_reason(kvs_finish f);
/* A JSON string of generated text of n bytes (invalid UTF-8, never expected, as U+FFFD). */
json_t *kvs_resp_text_json(const char *s, size_t n);

/* ---- the other APIs' answers (anthropic_response.c, responses_response.c) --- */
/* How a generation ended, for a whole answer or a stream's last events. */
typedef struct {
    kvs_finish finish;
    const char *stop_sequence; /* the stop string that ended it (NULL: none) */
    bool called;               /* the output was (or held) tool calls */
    int prompt_tokens, cached_tokens, completion_tokens;
    const char *error;         /* finish ERROR: why */
} kvs_resp_end;

/* An SSE event out: "event: NAME" and data's JSON (its reference taken). */
typedef void (*kvs_sse_emit)(void *ctx, const char *event, json_t *data);

/* A stream in Anthropic's or the responses API's events: content blocks (output
 * items) opened and closed as the output turns from text to calls. */
typedef struct {
    kvs_api_dialect dialect;
    kvs_resp_meta meta;  /* its strings are the stream's own */
    bool started;
    int open;            /* the open block's (item's) index: -1 none */
    bool open_call;      /* it is a call (else text) */
    int n_opened;
    int seq;             /* responses: the next sequence_number */
    char *acc;           /* responses: the open item's text or arguments so far (its .done events) */
    size_t acc_len, acc_cap;
    char *call_id, *call_name; /* responses: the open call's */
    json_t *items;       /* responses: the items closed so far (response.completed) */
    json_t *echo;        /* responses: the request's fields echoed in the response object */
    long long created;   /* responses: created_at */
    int prompt_tokens;   /* as encoded (message_start's usage) */
    kvs_sse_emit emit;
    void *ctx;
} kvs_api_stream;

/* A whole output of choice `index` split into its text and its tool calls
 * (tool_response.c): when the request has tools and the output parses
 * (kvs_tool_parse_text), the calls (one at most when the request forced one)
 * and the text between them, dropped when it is only whitespace beside calls;
 * else no call and the text as it is. Free with kvs_resp_split_free. */
typedef struct {
    const char *text;
    size_t text_len;
    int n_calls;      /* r.calls.v[0 .. n_calls) */
    bool parsed;
    kvs_tool_result r;
} kvs_resp_split;
void kvs_resp_split_calls(const kvs_resp_meta *m, int index, const char *text, size_t n, kvs_resp_split *out);
void kvs_resp_split_free(kvs_resp_split *s);
/* With tools (tool_response.c): the chat message of a whole output (content,
 * tool_calls; *called: calls were made), and a stream chunk's delta. */
json_t *kvs_resp_tool_message(const kvs_resp_meta *m, int index, const char *text, size_t n, bool *called);
void kvs_resp_tool_delta(const kvs_resp_meta *m, json_t *delta, const kvs_tool_events *ev);
/* The calls' ids: from the response's id and the choice. */
uint64_t kvs_resp_tool_seed(const kvs_resp_meta *m, int index);
/* A stream's parsers, one a choice (NULL when out of memory), and their end. */
kvs_tool_parser **kvs_resp_tool_parsers(const kvs_resp_meta *m, int n_choices);
void kvs_resp_tool_parsers_free(kvs_tool_parser **p, int n_choices);
/* A stream's slice through its choice's parser p (last: the choice ended): s's tool_events become ev. */
void kvs_resp_tool_stream(kvs_tool_parser *p, kvs_resp_slice *s, kvs_tool_events *ev, bool last);

/* ---- a connection waiting for something (server/http.h) -------------------- */
struct MHD_Connection;
typedef struct {
    struct MHD_Connection *conn;
    bool suspended;   /* suspended by libmicrohttpd's thread, not yet resumed */
    atomic_int *count; /* the server's count of suspended connections */
} kvs_waker;

/* ---- one generation request, shared by the HTTP thread and the engine ------ */
/* One choice's outputs (filled by the engine callback, under the gen's mu). */
typedef struct {
    char *text;         /* pending text (streaming) or all of it */
    size_t text_len, text_cap;
    int32_t *ids;
    float *lps;
    int32_t *top_ids;   /* [cap_ids][n_top] */
    float *top_lps;
    int n_ids, cap_ids;
    kvs_finish finish;  /* NONE until its last output */
    int stop_string;    /* finish STOP by a stop string: 1 + its index (kvs_request_output) */
    int completion_tokens;
    /* streaming: what the reader sent of it */
    size_t text_offset;
    bool role_sent, end_sent;
} kvs_gen_choice;

typedef struct kvs_gen {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;           /* the request's, its stream's and, until its last output, the engine's */
    uint64_t engine_id;
    kvs_gen_choice *choices;
    int n_choices, n_top;
    int n_done;         /* choices finished */
    kvs_finish finish;  /* ERROR when any choice failed, else the first choice's */
    char *error;
    int prompt_tokens;
    double compression; /* choice 0's prompt compression (its first output) */
    int cached_tokens;  /* choice 0's prefix-cache hit */
    int32_t *layer_entries; /* choice 0's KV entries per layer after the prompt ([n_layers]; NULL: not yet) */
    uint8_t *layer_kind;
    int n_layers;
    size_t kv_entry_bytes;  /* one KV entry's bytes (the engine's kvs_engine_limits) */
    double t_submit;    /* when it went to the engine */
    bool done;          /* every choice finished */
    double t_first;     /* when the first token arrived (0: not yet) */
    /* the server's list of submitted requests (under the server's mu) */
    struct kvs_gen *live_prev, *live_next;
    bool live, submitted; /* linked; engine_id is set */
    /* its connection, waiting (NULL: none): woken at each output when wake_each, else at the end */
    kvs_waker *waker;
    bool wake_each;
    bool cut;       /* the client left or stopped reading: its stream ends (the watcher sets it) */
    bool want_ping; /* write an SSE comment to tell a closed client from a half-closed one */
} kvs_gen;

/* n_choices choices, n_top alternatives per token (0: none). */
kvs_gen *kvs_gen_create(int n_choices, int n_top);
int kvs_gen_completion_tokens(const kvs_gen *g); /* over the choices */
/* The "kv" extension of its response; one log line when it ends (id, tokens, TTFT, rate, policy, ratio, finish). */
kvs_resp_kv kvs_gen_kv(const kvs_gen *g, const kvs_kv_policy *policy);
void kvs_gen_log(const kvs_gen *g, const char *id, const kvs_kv_policy *policy);
kvs_gen *kvs_gen_ref(kvs_gen *g);
void kvs_gen_release(kvs_gen *g);
/* The engine's output callback (user = the kvs_gen). */
void kvs_gen_on_output(void *user, const kvs_request_output *out);

/* ---- the server ------------------------------------------------------------ */
/* The compiled grammars (grammars.c): at most this many, within --grammar-cache-bytes. */
#define KVS_SERVER_GRAMMARS 64
typedef struct {
    char *key;
    size_t len;
    kvs_grammar *g; /* NULL: the schema was refused, */
    uint64_t used;
    char *error;    /* for this reason */
} kvs_server_grammar_entry;

struct kvs_conns;
struct kvs_work;

struct kvs_server {
    kvs_server_config cfg;     /* strings below are copies */
    char *host, *api_key, *model_name;
    kvs_engine *engine;
    const kvs_tokenizer *tok;
    kvs_chat_template *tpl;
    kvs_tool_format tool_format; /* how outputs with tools are parsed (--tool-call-parser or the template) */
    kvs_api_limits limits;
    kvs_sampling_params sampling; /* a request's defaults (cfg.sampling_defaults' copy; limits point here) */
    struct MHD_Daemon *daemon;
    struct kvs_conns *conns; /* the connections' registry and deadlines (conns.h) */
    struct kvs_work *work;   /* the workers that prepare requests (work.c) */
    atomic_int suspended;    /* connections suspended now (none may be when the daemon stops) */
    int port;
    long long started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_flight;             /* generation requests not yet answered (under mu) */
    kvs_gen *live;             /* the submitted ones (under mu) */
    bool aborting;             /* the drain timed out: abort, submit nothing more (under mu) */
    atomic_bool draining;
    atomic_uint_fast64_t next_id, http_requests, http_errors;
    /* the prepare slots: requests in parse + template + tokenize */
    pthread_mutex_t slot_mu;
    pthread_cond_t slot_cv;
    int slots_used;
    int slot_wait_ms;          /* how long a request waits for a slot before 429 */
    pthread_mutex_t grammar_mu;
    kvs_server_grammar_entry grammars[KVS_SERVER_GRAMMARS];
    int n_grammars;
    uint64_t grammar_clock;
};

/* The grammar of a JSON schema given as its text (schema) or parsed (value;
 * schema then NULL), or of any JSON object (both NULL), with a literal prefix /
 * suffix (NULL: none), compiled once within the server's bounds and
 * shared (a reference for the caller); NULL with a 400 naming param (and the
 * bound) when the schema is refused, 503 when cancel was set meanwhile. */
kvs_grammar *kvs_server_grammar(kvs_server *s, const char *schema, json_t *value, const char *prefix,
                                const char *suffix, const char *param, const atomic_bool *cancel, kvs_api_error *err);
/* The cache's bytes now (grammars, their mask caches, keys) and entries (n, may be NULL). */
size_t kvs_server_grammar_bytes(kvs_server *s, int *n);
void kvs_server_grammars_free(kvs_server *s);

/* A new response's id: "chatcmpl-...", "cmpl-...", "msg_..." or "resp_..." by r's API (completions.c). */
void kvs_api_response_id(kvs_server *s, const kvs_api_request *r, char *id, size_t cap);

/* The HTTP side's counters for /metrics (http.c). */
kvs_server_http_stats kvs_server_http_stats_get(kvs_server *s);

/* The chat page of GET / (web_ui.c; malloc'ed). */
char *kvs_web_ui_html(void);

/* The server's state without a listening socket (kvs_server_start listens). */
kvs_status kvs_server_create(const kvs_server_config *cfg, kvs_engine *engine, const kvs_tokenizer *tok,
                             kvs_server **out);
void kvs_server_free(kvs_server *s);
/* 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104. */
bool kvs_addr_is_loopback(const struct sockaddr *sa);

#endif
