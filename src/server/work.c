/* server: a request's work once its body is in, off libmicrohttpd's thread:
 * a fixed pool of --max-preparing workers takes the requests in arrival
 * order, parses, validates and tokenizes (route.c), compiles the grammar and
 * submits (completions.c), or answers /tokenize and /detokenize. A request
 * that waited for a worker longer than the slot wait (5 s) gets 429, as when
 * the queue of the engine is full. Meanwhile its connection is suspended,
 * and the watcher looks at its socket every 200 ms: a client that leaves
 * cancels the work (a compile stops within its next budget check), the
 * engine's request is aborted. */
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server/http.h"

/* Workers run below the engine's threads: what a request costs to prepare
 * (a 4 MiB body parsed, a schema compiled to its bounds) then takes the
 * engine's idle moments, not its steps, on a machine with few cores. Below
 * the process's own priority, whatever it is (a server started under nice 19
 * must not have its workers raised above its engine). */
#define WORKER_NICE 10
#define TRIM_BODY_BYTES (64 << 10) /* after a body this large, freed memory goes back to the system */

struct kvs_work {
    kvs_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvs_http_req *head, *tail; /* waiting for a worker */
    pthread_t *threads;
    int n_threads, wait_ms;
    bool stop;
};

/* r's work is done (an answer, or a gen): wake its connection */
static void finish(kvs_http_req *r) {
    pthread_mutex_lock(&r->mu);
    r->worked = true;
    r->stream = r->prep.req.stream;
    kvs_waker_wake(&r->wait);
    pthread_mutex_unlock(&r->mu);
}

static void run(kvs_work *w, kvs_http_req *r) {
    kvs_server *s = w->srv;
    kvs_api_error err;
    kvs_api_dialect d = kvs_route_dialect(r->route);
    if (atomic_load(&r->cancel)) {
        kvs_api_fail(&err, 503, NULL, "the request was cancelled (its client left, or the server is shutting down)");
        kvs_http_answer_error_as(&r->answer, &err, d);
    } else if ((kvs_now() - r->queued_at) * 1e3 > w->wait_ms) {
        kvs_api_fail(&err, 429, NULL, "the server is busy: %d requests are being parsed and tokenized and none "
                     "finished within %d ms; retry later", w->n_threads, w->wait_ms);
        err.type = "rate_limit_error";
        kvs_http_answer_error_as(&r->answer, &err, d);
    } else if (!kvs_http_answer_whole(s, r->route, r->body.data, r->body.len, &r->cancel, &r->answer)) {
        if (!kvs_http_prepare(s, r->route, r->body.data, r->body.len, &r->cancel, &r->prep, &err) ||
            !kvs_http_submit(s, r, &err))
            kvs_http_answer_error_as(&r->answer, &err, d);
    }
    /* a large body's parse (and its schema's compile) freed tens of megabytes
       of small blocks: give them back, or a few such requests keep the
       process's memory up for good */
    bool large = r->body.len >= TRIM_BODY_BYTES;
    finish(r);
    if (large) malloc_trim(0);
}

static void *worker(void *arg) {
    kvs_work *w = arg;
    errno = 0;
    int base = getpriority(PRIO_PROCESS, 0), nice = errno ? WORKER_NICE : base + WORKER_NICE;
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice < 19 ? nice : 19) != 0)
        kvs_log(KVS_LOG_DEBUG, "request workers: setpriority: %s", strerror(errno));
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && !w->head) pthread_cond_wait(&w->cv, &w->mu);
        if (w->stop) break;
        kvs_http_req *r = w->head;
        if (!(w->head = r->next)) w->tail = NULL;
        pthread_mutex_unlock(&w->mu);
        run(w, r);
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

kvs_status kvs_work_start(kvs_server *s, int n, int wait_ms, kvs_work **out) {
    *out = NULL;
    kvs_work *w = calloc(1, sizeof *w);
    if (!w || !(w->threads = calloc((size_t)n, sizeof *w->threads))) {
        free(w);
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    w->srv = s;
    w->wait_ms = wait_ms;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    *out = w;
    for (; w->n_threads < n; w->n_threads++)
        if (pthread_create(&w->threads[w->n_threads], NULL, worker, w) != 0)
            return kvs_fail(KVS_ERR_INTERNAL, "could not start the request workers");
    return KVS_OK;
}

void kvs_work_stop(kvs_work *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    kvs_http_req *left = w->head;
    w->head = w->tail = NULL;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < w->n_threads; i++) pthread_join(w->threads[i], NULL);
    while (left) {
        kvs_http_req *r = left;
        left = r->next;
        kvs_api_error err;
        kvs_api_fail(&err, 503, NULL, "the server is shutting down");
        kvs_http_answer_error_as(&r->answer, &err, kvs_route_dialect(r->route));
        finish(r);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->threads);
    free(w);
}

static void push(kvs_work *w, kvs_http_req *r) {
    pthread_mutex_lock(&w->mu);
    r->next = NULL;
    if (w->tail) w->tail->next = r;
    else w->head = r;
    w->tail = r;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

enum MHD_Result kvs_work_continue(kvs_server *s, kvs_http_req *r) {
    bool generates = kvs_route_generates(r->route);
    kvs_api_error err;
    pthread_mutex_lock(&r->mu);
    if (r->stage == KVS_STAGE_READ && !r->settled) {
        /* Not yet: libmicrohttpd (0.9.75) marks a connection as reading
         * nothing more only at the end of a call that leaves it unsuspended;
         * one suspended at this first call would be read first when resumed,
         * and a half-closed client's end of input, read once the request is
         * whole, closes the connection unanswered. Left without an answer it
         * stays ready and is called again at the next turn of the event loop
         * (one that does not wait); the work starts there, so that nothing of
         * it is under way should libmicrohttpd close the connection between
         * the two calls (a reset). */
        r->settled = true;
        pthread_mutex_unlock(&r->mu);
        return MHD_YES;
    }
    if (r->stage == KVS_STAGE_READ) {
        if (generates && !(r->counted = kvs_server_request_begin(s, &err))) {
            pthread_mutex_unlock(&r->mu);
            r->queued_answer = true;
            return kvs_http_error(s, r->conn, &err, kvs_route_dialect(r->route));
        }
        r->stage = KVS_STAGE_WORK;
        r->queued_at = kvs_now();
        push(s->work, r);
    }
    if (r->stage == KVS_STAGE_WORK && !r->worked) { /* finish() wakes it */
        kvs_waker_sleep(&r->wait);
        pthread_mutex_unlock(&r->mu);
        return MHD_YES;
    }
    bool answer = r->stage == KVS_STAGE_WORK && r->answer.status;
    r->stage = answer ? KVS_STAGE_ANSWER : KVS_STAGE_RUN;
    pthread_mutex_unlock(&r->mu);
    if (answer) {
        r->queued_answer = true;
        return kvs_http_send(s, r->conn, &r->answer);
    }
    enum MHD_Result ret = kvs_http_answer_gen(s, r);
    return ret;
}

/* ---- the watcher's look ---------------------------------------------------------- */
/* A stream: a reset ends it, a FIN gets an SSE comment (a closed socket answers
 * it with a reset), a client that took none of its data for --http-timeout is
 * cut. */
static void watch_stream(kvs_server *s, kvs_http_req *r, kvs_gen *g, kvs_peer ps) {
    bool cut = ps == KVS_PEER_GONE;
    if (!cut && kvs_peer_stalled(r->fd, &r->progress, s->cfg.http_timeout_s)) {
        kvs_log(KVS_LOG_INFO, "closing a stream whose client read nothing for %u s (--http-timeout)",
                s->cfg.http_timeout_s);
        cut = true;
    }
    bool ping = !cut && ps == KVS_PEER_EOF && !r->probed;
    if (!cut && !ping) return;
    r->probed |= ping;
    if (cut) {
        shutdown(r->fd, SHUT_RDWR);
        kvs_server_abort(s, g);
    }
    pthread_mutex_lock(&g->mu);
    if (cut) g->cut = true;
    else g->want_ping = true;
    if (g->waker) kvs_waker_wake(g->waker);
    pthread_mutex_unlock(&g->mu);
}

void kvs_work_watch(void *req, void *server) {
    kvs_http_req *r = req;
    kvs_server *s = server;
    kvs_peer ps = kvs_peer_state(r->fd);
    pthread_mutex_lock(&r->mu);
    kvs_stage stage = r->stage;
    kvs_gen *g = r->gen;
    if (stage == KVS_STAGE_RUN && r->stream) {
        pthread_mutex_unlock(&r->mu);
        watch_stream(s, r, g, ps);
        return;
    }
    /* waiting for its work or its whole answer: a FIN alone may be a half-close,
       which an HTTP/1.1 client is asked about (an HTTP/1.0 one cannot be); under
       r->mu, so that libmicrohttpd's thread writes no answer meanwhile */
    bool waiting = stage == KVS_STAGE_WORK || stage == KVS_STAGE_RUN;
    if (waiting && ps == KVS_PEER_EOF && r->http11 && !r->probed) {
        r->probed = true;
        if (!kvs_peer_probe_1xx(r->fd)) ps = KVS_PEER_GONE;
    }
    pthread_mutex_unlock(&r->mu);
    if (!waiting || ps != KVS_PEER_GONE) return;
    atomic_store(&r->cancel, true); /* its compile stops; nothing more is submitted */
    if (g) kvs_server_abort(s, g);
}

void kvs_work_cancel(void *req, void *unused) {
    (void)unused;
    kvs_http_req *r = req;
    atomic_store(&r->cancel, true);
}
