/* server: the client's socket, the generation request's shared state, the SSE stream
 * reader, and the request's life in the server. */
#ifndef KVS_SERVER_GENERATE_H
#define KVS_SERVER_GENERATE_H

#include <microhttpd.h>
#include <sys/types.h>

#include "server/server_internal.h"

/* ---- the client's socket (peer.c) ------------------------------------------ */
/* What a client's socket says, without reading from it.
 * A FIN alone cannot tell a client that left from one that only shut its
 * sending side after the request (a half-close, which must not abort it):
 * writing tells, as a closed socket answers data with a reset. So EOF is only
 * a reason to probe; GONE (reset, or both directions shut) is the disconnect. */
typedef enum {
    KVS_PEER_OPEN, /* nothing new (bytes it sent after its request are left unread) */
    KVS_PEER_EOF,  /* it sent FIN: closed, or half-closed */
    KVS_PEER_GONE  /* reset, or both directions shut */
} kvs_peer;
kvs_peer kvs_peer_state(int fd);
/* The probe of a request waiting for its answer: "HTTP/1.1 100 Continue" (a
 * client must accept 1xx responses before the final one; HTTP/1.1 only).
 * False when the write fails (the client left). */
bool kvs_peer_probe_1xx(int fd);
/* Whether a client still takes what it is sent. Its kernel acknowledges data
 * into its receive buffer until that is full; the server's send buffer grows
 * to megabytes before a write blocks (and libmicrohttpd's --http-timeout sees
 * no progress), so a stream checks the acknowledgements themselves. */
typedef struct {
    uint64_t acked;     /* bytes the client had acknowledged at progress_at */
    double progress_at; /* kvs_now() when it last took data or had none waiting */
} kvs_peer_progress;
void kvs_peer_progress_init(kvs_peer_progress *p);
/* True when data waits for the client and it acknowledged none for limit_s seconds. */
bool kvs_peer_stalled(int fd, kvs_peer_progress *p, double limit_s);

/* The state of one streamed response (MHD's content reader's cls). */
typedef struct {
    kvs_server *srv;
    kvs_gen *gen;        /* holds one reference */
    kvs_waker *waker;    /* its connection's, while the reader waits for tokens (under gen->mu) */
    kvs_resp_meta meta;
    kvs_kv_policy policy; /* the request's KV policy (the "kv" extension, the log line) */
    char *req_id;        /* meta.id's storage */
    bool include_usage, ended;
    kvs_tool_parser **tools; /* chat with tools: a parser a choice (its calls become delta.tool_calls) */
    kvs_api_stream *api;     /* Anthropic's or the responses API's events (NULL: OpenAI's chunks) */
    char *stop[KVS_MAX_STOP_STRINGS]; /* the request's stop strings (api: the stop_sequence that ended it) */
    int n_stop;
    size_t text_offset;
    char *out;           /* formatted bytes not yet handed to MHD */
    size_t out_len, out_off, out_cap;
} kvs_stream;

/* MHD's content reader: never waits; with nothing to send it suspends the
 * connection (the engine's callback resumes it) and returns 0. */
ssize_t kvs_stream_read(void *cls, uint64_t pos, char *buf, size_t max);
void kvs_stream_free(void *cls);
/* A kvs_sse_emit into the stream's bytes (ctx: the kvs_stream). */
void kvs_stream_emit(void *ctx, const char *event, json_t *data);

/* ---- a generation request's life in the server (http.c) ---------------------
 * begin: counts it in flight (503 while draining); link: puts it on the list
 * the drain aborts (false once the drain has timed out); submitted: records
 * its engine id (false, and aborted, when the drain timed out meanwhile);
 * unlink: off the list (its submit failed); done: answered, off the list
 * (the drain waits for none in flight). */
bool kvs_server_request_begin(kvs_server *s, kvs_api_error *err);
bool kvs_server_request_link(kvs_server *s, kvs_gen *g);
bool kvs_server_request_submitted(kvs_server *s, kvs_gen *g, uint64_t engine_id);
void kvs_server_request_unlink(kvs_server *s, kvs_gen *g);
void kvs_server_request_done(kvs_server *s, kvs_gen *g);

#endif
