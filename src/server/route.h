/* server: the HTTP request path without sockets (route.c): routing, auth, the
 * body limit, the GET endpoints, and a generation request's parsing,
 * validation and encoding (bounded by the prepare slots). http.c drives these
 * pieces from libmicrohttpd; kvs_http_handle runs them over one request held
 * in memory (fuzz/fuzz_http_request.c, tests/test_server_http.c). */
#ifndef KVS_SERVER_ROUTE_H
#define KVS_SERVER_ROUTE_H

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
    KVS_ROUTE_WEB_UI /* GET /: the chat page */
} kvs_route;

/* A response decided without the engine. */
typedef struct {
    int status;               /* 0: none */
    const char *content_type; /* a constant */
    char *body;               /* malloc'ed; NULL only when out of memory */
} kvs_http_answer;

void kvs_http_answer_error(kvs_http_answer *a, const kvs_api_error *err);

/* The request line and headers (NULL: absent). True: answered from these
 * alone (a filled; the body is not read). False: read the body, then
 * kvs_http_prepare a request of *route (completions or chat). */
bool kvs_http_head(kvs_server *s, const char *method, const char *url, const char *authorization,
                   const char *content_length, kvs_route *route, kvs_http_answer *a);

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
} kvs_http_prepared;

/* Parses, validates and encodes a body, holding one of the server's prepare
 * slots meanwhile (429 when none frees within the wait). */
bool kvs_http_prepare(kvs_server *s, kvs_api_kind kind, const char *body, size_t len, kvs_http_prepared *p,
                      kvs_api_error *err);
void kvs_http_prepared_free(kvs_http_prepared *p);
/* POST /tokenize (detokenize false) and /detokenize, answered whole (tokenize.c). */
void kvs_http_tokenize(kvs_server *s, bool detokenize, const char *body, size_t len, kvs_http_answer *a);

/* The prepare slots (a counting semaphore): take fills err (429) on timeout. */
bool kvs_http_slot_take(kvs_server *s, kvs_api_error *err);
void kvs_http_slot_give(kvs_server *s);

/* Every step above for one request held in memory, the body fed in pieces of
 * chunk bytes (0: whole). True: ready for the engine (p filled, a empty);
 * false: answered (a filled). */
bool kvs_http_handle(kvs_server *s, const char *method, const char *url, const char *authorization,
                     const char *content_length, const char *body, size_t len, size_t chunk, kvs_http_answer *a,
                     kvs_http_prepared *p);

#endif
