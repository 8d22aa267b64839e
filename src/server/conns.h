/* server: the connections libmicrohttpd holds, as the server sees them
 * (conns.c). A connection is *pending* while it is not a request in flight:
 * from its accept until its request's headers and body are in, and again
 * (keep-alive) once its response has gone out. Pending connections are what
 * a slow or idle client holds, so they are what is bounded:
 *  - a deadline for the headers (from the accept, or from the first byte
 *    after a keep-alive response) and a minimum rate for the body: past
 *    either the connection is shut (nginx's client_header_timeout /
 *    client_body_timeout, as a rate rather than progress);
 *  - a cap on pending connections with a fair share per address: when it is
 *    full, a connection from an address holding less than its share (the cap
 *    over the addresses holding pending connections) displaces the oldest
 *    pending connection of the address holding most; any other is refused.
 * So a slow client costs a few kilobytes of libmicrohttpd's buffers, never a
 * thread, and never the room of requests in flight or of other addresses.
 *
 * One watcher thread checks the deadlines every 100 ms and hands the
 * requests in flight to a callback every 200 ms (disconnects, a client that
 * stopped reading). A connection is "shut" with shutdown(2): libmicrohttpd
 * then sees the socket end and closes it on its own thread. */
#ifndef KVS_SERVER_CONNS_H
#define KVS_SERVER_CONNS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "core/core.h"

typedef struct kvs_conns kvs_conns;
typedef struct kvs_conn kvs_conn;

typedef struct {
    unsigned max_pending;    /* pending connections at most (0: no cap) */
    double header_timeout_s; /* the request line and headers within this */
    double body_timeout_s;   /* the body within this, */
    double body_min_rate;    /* plus a second per this many bytes received */
    /* requests in flight, every 200 ms, with the registry's lock held (so req is alive) */
    void (*watch)(void *req, void *arg);
    void *watch_arg;
} kvs_conns_config;

/* what the registry did (for /metrics) */
typedef struct {
    unsigned pending, in_flight;           /* connections now */
    uint64_t header_timeouts, body_timeouts; /* shut past a deadline */
    uint64_t displaced, refused;           /* by the cap on pending connections */
} kvs_conns_stats;

kvs_status kvs_conns_create(const kvs_conns_config *cfg, kvs_conns **out);
/* Stops the watcher, frees the registry (every connection closed first). */
void kvs_conns_destroy(kvs_conns *c);

/* libmicrohttpd's accept policy: whether a connection from addr may be
 * accepted (false: refused); may displace another pending connection. */
bool kvs_conns_admit(kvs_conns *c, const struct sockaddr *addr, socklen_t len);
/* A connection libmicrohttpd started (NULL when out of memory: it is shut). */
kvs_conn *kvs_conns_open(kvs_conns *c, int fd, const struct sockaddr *addr, socklen_t len);
void kvs_conns_close(kvs_conns *c, kvs_conn *k);

/* Its request's headers are in (body: a body follows). */
void kvs_conns_headers(kvs_conns *c, kvs_conn *k, bool body);
void kvs_conns_body(kvs_conns *c, kvs_conn *k, size_t n); /* n more body bytes */
/* The whole request is in: in flight, watched with req (NULL: not watched). */
void kvs_conns_request(kvs_conns *c, kvs_conn *k, void *req);
/* Its request ended (its req no longer watched): pending again, idle. */
void kvs_conns_done(kvs_conns *c, kvs_conn *k);

/* fn(req, arg) for every request in flight, with the registry's lock held. */
void kvs_conns_each_request(kvs_conns *c, void (*fn)(void *req, void *arg), void *arg);
/* Shuts every connection (the server stops). */
void kvs_conns_shut_all(kvs_conns *c);
kvs_conns_stats kvs_conns_get_stats(kvs_conns *c);

#endif
