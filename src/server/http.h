/* server: the libmicrohttpd side, shared by http.c (the daemon, its callbacks,
 * drain and stop), work.c (a request's work off libmicrohttpd's thread),
 * completions.c (submitting and answering a generation) and generate.c (the
 * stream reader).
 *
 * One thread serves every connection (libmicrohttpd's internal epoll thread)
 * and never waits: a request whose answer is not ready suspends its
 * connection (MHD_suspend_connection), and whoever makes it ready (a worker,
 * the engine's callback, the watcher) resumes it. A kvs_waker is that
 * handshake; both sides hold the lock that guards the readiness. */
#ifndef KVS_SERVER_HTTP_H
#define KVS_SERVER_HTTP_H

#include <microhttpd.h>

#include "server/conns.h"
#include "server/generate.h"
#include "server/route.h"

/* Under the lock of what it waits for: sleep (libmicrohttpd's thread, in an
 * access handler or content reader, with nothing to do) suspends the
 * connection; wake (any thread, once there is something) resumes it. */
void kvs_waker_sleep(kvs_waker *w);
void kvs_waker_wake(kvs_waker *w);

typedef enum {
    KVS_STAGE_READ,   /* its headers and body arriving */
    KVS_STAGE_WORK,   /* waiting for a worker, or on one */
    KVS_STAGE_RUN,    /* submitted: generating */
    KVS_STAGE_ANSWER  /* its answer queued (a stream: its reader runs) */
} kvs_stage;

/* One request from its headers to its answer (libmicrohttpd's con_cls). */
typedef struct kvs_http_req {
    kvs_server *srv;
    struct MHD_Connection *conn;
    kvs_conn *sock; /* its connection in the registry */
    int fd;
    kvs_route route;
    bool http11;
    kvs_http_body body;
    kvs_http_answer pending; /* decided from the headers of a bodyless request: queued at the next call */
    bool queued_answer;      /* a response was queued (more calls only discard) */
    /* under mu: the work after the body (work.c) and the watcher's view */
    pthread_mutex_t mu;
    kvs_stage stage;
    bool settled;          /* its request's last call came once, unsuspended (work.c) */
    kvs_waker wait;        /* its connection, while it waits for a worker (under mu) */
    kvs_waker run_wait;    /* and while it waits for the engine's outputs (under gen->mu, as gen->waker) */
    bool worked;           /* the worker is done: answer or gen */
    bool stream;           /* the request asked for a stream (once parsed) */
    bool counted;          /* in the server's in-flight count (kvs_server_request_begin) until answered */
    bool probed;           /* the watcher wrote once to tell a FIN's meaning */
    kvs_peer_progress progress; /* a stream's client taking its data */
    atomic_bool cancel;    /* the client left or the drain gave up: stop the work */
    double queued_at;
    kvs_http_answer answer; /* the worker's answer (an error, /tokenize) */
    kvs_http_prepared prep; /* the parsed request */
    kvs_gen *gen;           /* submitted: one reference */
    struct kvs_http_req *next; /* the work queue */
} kvs_http_req;

/* ---- http.c ------------------------------------------------------------------ */
/* The daemon with the server's callbacks (NULL when it cannot listen on addr). */
struct MHD_Daemon *kvs_http_daemon(kvs_server *s, unsigned flags, const struct sockaddr *addr);
/* Queues a's response (its body taken) and counts it. */
enum MHD_Result kvs_http_send(kvs_server *s, struct MHD_Connection *c, kvs_http_answer *a);
/* err in d's shape (route.h's kvs_route_dialect) */
enum MHD_Result kvs_http_error(kvs_server *s, struct MHD_Connection *c, const kvs_api_error *err, kvs_api_dialect d);
/* The request's in-flight count ends (once; when it completes). */
void kvs_http_req_done(kvs_http_req *r);
/* Aborts g's engine request when it was submitted. */
void kvs_server_abort(kvs_server *s, kvs_gen *g);

/* ---- work.c ------------------------------------------------------------------- */
typedef struct kvs_work kvs_work;
/* n threads taking requests in arrival order; a request that waited more than
 * wait_ms for one is answered 429. */
kvs_status kvs_work_start(kvs_server *s, int n, int wait_ms, kvs_work **out);
void kvs_work_stop(kvs_work *w); /* the queued requests answered 503, the threads joined */
/* The body is in: queue the request (the connection suspended until it is
 * worked), or answer it when it is done. */
enum MHD_Result kvs_work_continue(kvs_server *s, kvs_http_req *r);
/* The watcher's look at a request in flight (kvs_conns_config.watch). */
void kvs_work_watch(void *req, void *server);
/* The drain gave up: stop every request's work (compiles stop). */
void kvs_work_cancel(void *req, void *unused);

/* ---- completions.c ------------------------------------------------------------ */
/* On a worker: submit r's prepared request (r->gen set). */
bool kvs_http_submit(kvs_server *s, kvs_http_req *r, kvs_api_error *err);
/* On libmicrohttpd's thread once r is submitted: a stream's response, or the
 * whole answer when the generation is done (else the connection sleeps). */
enum MHD_Result kvs_http_answer_gen(kvs_server *s, kvs_http_req *r);

#endif
