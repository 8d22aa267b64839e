/* server: the HTTP request path without sockets (route.c): routing, auth, the
 * body limit, the GET endpoints, and a generation request's parsing,
 * validation and encoding (bounded by the prepare slots). http.c drives these
 * pieces from libmicrohttpd; kvs_http_handle runs them over one request held
 * in memory (fuzz/fuzz_http_request.c, tests/test_server_http.c). */
#ifndef KVS_SERVER_ROUTE_H
#define KVS_SERVER_ROUTE_H

#include <stdarg.h>

#include "server/server_internal.h"

typedef enum {
    KVS_ROUTE_NONE,
    KVS_ROUTE_COMPLETIONS,
    KVS_ROUTE_CHAT,
    KVS_ROUTE_MODELS,
    KVS_ROUTE_MODEL,
    KVS_ROUTE_HEALTH,
    KVS_ROUTE_METRICS,
    KVS_ROUTE_TOKENIZE,
    KVS_ROUTE_DETOKENIZE,
    KVS_ROUTE_WEB_UI, /* GET /: the chat page */
    KVS_ROUTE_MESSAGES,     /* Anthropic's POST /v1/messages (anthropic.h) */
    KVS_ROUTE_COUNT_TOKENS, /* and /v1/messages/count_tokens */
    KVS_ROUTE_RESPONSES,    /* OpenAI's POST /v1/responses (responses.h) */
    KVS_ROUTE_RESET_PREFIX_CACHE, /* POST /reset_prefix_cache (vLLM's; KV events say AllBlocksCleared) */
    KVS_ROUTE_CHAT_RENDER,        /* vLLM's POST /v1/chat/completions/render (render.c) */
    KVS_ROUTE_COMPLETIONS_RENDER  /* and /v1/completions/render */
} kvs_route;

/* The shape of a path's answers, errors included (Anthropic's under /v1/messages). */
kvs_api_dialect kvs_http_dialect(const char *url);
/* A route's answers' shape (Anthropic's for messages and count_tokens). */
kvs_api_dialect kvs_route_dialect(kvs_route r);
/* Whether a route generates (goes to the engine). */
bool kvs_route_generates(kvs_route r);

/* A response decided without the engine. */
typedef struct {
    int status;               /* 0: none */
    const char *content_type; /* a constant */
    char *body;               /* malloc'ed; NULL only when out of memory */
    const char *allow;        /* 405: the methods the path takes (a constant) */
    bool close;               /* close the connection after it (the request's framing is not to be trusted) */
} kvs_http_answer;

void kvs_http_answer_error(kvs_http_answer *a, const kvs_api_error *err);
/* The same in d's shape and status (kvs_api_error_json_as). */
void kvs_http_answer_error_as(kvs_http_answer *a, const kvs_api_error *err, kvs_api_dialect d);
/* a's error answer: status, its type (NULL: the status's) and a printf message. */
void kvs_http_answer_errorf(kvs_http_answer *a, int status, const char *type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void kvs_http_answer_verrorf(kvs_http_answer *a, int status, const char *type, const char *fmt, va_list ap);

/* ---- the request's header fields (framing.c) --------------------------------
 * One field as the client sent it (value_len counts any NUL byte in it; cut:
 * the parser cut the value at a NUL byte, so the rest is not there). */
typedef struct {
    const char *name, *value;
    size_t name_len, value_len;
    bool cut;
} kvs_http_header;

/* What the server reads of them, once checked. */
typedef struct {
    bool has_length, chunked;
    uint64_t content_length;
    const char *authorization; /* NULL: absent */
    size_t authorization_len;
    const char *x_api_key;     /* Anthropic's clients send the key here (NULL: absent) */
    size_t x_api_key_len;
} kvs_http_head_fields;

/* RFC 9112's framing rules and the fields the server reads: true, f filled;
 * false, a filled (400, or 501 for a transfer coding other than chunked),
 * the connection to close after it. version: "HTTP/1.0" or "HTTP/1.1". */
bool kvs_http_check_head(const char *version, const kvs_http_header *h, int n, kvs_http_head_fields *f,
                         kvs_http_answer *a);
/* Authorization's value [v, v + n): "Bearer" (any case), spaces, the token. */
bool kvs_http_bearer(const char *v, size_t n, const char **token, size_t *len);
/* The path of a request target in absolute form (http://host/path), else url. */
const char *kvs_http_origin_path(const char *url);

/* The request line and checked fields. True: answered from these alone (a
 * filled; the body is not read). False: read the body, then kvs_http_prepare
 * a request of *route (a generation route), or answer it whole
 * (kvs_http_answer_whole: tokenize, render). HEAD is GET
 * without the body (libmicrohttpd drops it). */
bool kvs_http_head(kvs_server *s, const char *method, const char *url, const kvs_http_head_fields *f,
                   kvs_route *route, kvs_http_answer *a);

/* A request body as it arrives. */
typedef struct {
    char *data;
    size_t len, cap;
} kvs_http_body;

/* Appends n bytes; false (413 in a) once the body passes --max-body-bytes. */
bool kvs_http_body_add(const kvs_server *s, kvs_http_body *b, const char *p, size_t n, kvs_http_answer *a);
void kvs_http_body_free(kvs_http_body *b);

/* A generation request ready for the engine. */
typedef struct {
    kvs_api_request req;
    int32_t *ids; /* the prompt, encoded */
    int n_ids;
    int max_tokens;
    kvs_grammar *grammar; /* its structured output or forced call (a reference; NULL: none, or not compiled) */
} kvs_http_prepared;

/* Parses (by route: completions, chat, messages, count_tokens, responses), validates and encodes a body, holding one of the server's prepare
 * slots meanwhile (429 when none frees within the wait). cancel non-NULL: the
 * request's grammar is compiled too (kvs_server_grammar, stopped when cancel
 * is set), before the chat template and the tokenizer, so a schema past a
 * bound is refused before they run. */
bool kvs_http_prepare(kvs_server *s, kvs_route route, const char *body, size_t len, const atomic_bool *cancel,
                      kvs_http_prepared *p, kvs_api_error *err);
void kvs_http_prepared_free(kvs_http_prepared *p);
/* The routes answered whole by the request workers, no generation: /tokenize,
 * /detokenize, count_tokens, /reset_prefix_cache, the render routes. True: r is one of them, a
 * filled; false: r goes on to kvs_http_prepare and the engine. cancel: as
 * kvs_http_prepare's (a render compiles the request's grammar). */
bool kvs_http_answer_whole(kvs_server *s, kvs_route r, const char *body, size_t len, const atomic_bool *cancel,
                           kvs_http_answer *a);
/* POST /v1/chat/completions/render and /v1/completions/render (render.c): the
 * body of the generating route prepared as for the engine (kvs_http_prepare,
 * the same 400s), answered with vLLM's GenerateRequest (completions: an array
 * of one); nothing reaches the engine. */
void kvs_http_render(kvs_server *s, kvs_route route, const char *body, size_t len, const atomic_bool *cancel,
                     kvs_http_answer *a);
/* POST /tokenize (detokenize false) and /detokenize, answered whole (tokenize.c). */
void kvs_http_tokenize(kvs_server *s, bool detokenize, const char *body, size_t len, kvs_http_answer *a);
/* POST /v1/messages/count_tokens: {"input_tokens": n}, the prompt /v1/messages would encode (tokenize.c). */
void kvs_http_count_tokens(kvs_server *s, const char *body, size_t len, kvs_http_answer *a);
/* POST /reset_prefix_cache: empties the prefix cache between two engine steps (a worker waits for it). */
void kvs_http_reset_prefix_cache(kvs_server *s, kvs_http_answer *a);

/* The prepare slots (a counting semaphore): take fills err (429) on timeout. */
bool kvs_http_slot_take(kvs_server *s, kvs_api_error *err);
void kvs_http_slot_give(kvs_server *s);

/* Every step above for one request held in memory (its fields h[0..n), the
 * body fed in pieces of chunk bytes, 0: whole). True: ready for the engine
 * (p filled, a empty); false: answered (a filled). */
bool kvs_http_handle(kvs_server *s, const char *method, const char *url, const char *version,
                     const kvs_http_header *h, int n, const char *body, size_t len, size_t chunk, kvs_http_answer *a,
                     kvs_http_prepared *p);

#endif
