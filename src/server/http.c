/* server: the request path on libmicrohttpd's thread: the accept policy and
 * the connections' registry (conns.h), a request's headers checked (RFC 9112
 * framing, route.c's routing, auth and limits), its body read, then its work
 * handed to a worker (work.c) and its answer queued when it is ready. Nothing
 * here waits (see http.h).
 *
 * --http-timeout: libmicrohttpd closes a connection whose socket saw no
 * successful read or write for that long: an idle keep-alive connection, a
 * client that stops reading its response. A suspended connection (waiting
 * for a worker or the engine) is not counted: its clock restarts on resume. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "server/http.h"

/* ---- suspend / resume -------------------------------------------------------------- */
void kvs_waker_sleep(kvs_waker *w) {
    w->suspended = true;
    atomic_fetch_add(w->count, 1);
    MHD_suspend_connection(w->conn);
}

void kvs_waker_wake(kvs_waker *w) {
    if (!w->suspended) return;
    w->suspended = false;
    atomic_fetch_sub(w->count, 1);
    MHD_resume_connection(w->conn);
}

/* ---- answers --------------------------------------------------------------------- */
enum MHD_Result kvs_http_send(kvs_server *s, struct MHD_Connection *c, kvs_http_answer *a) {
    if (!a->body) return MHD_NO;
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(a->body), a->body, MHD_RESPMEM_MUST_FREE);
    a->body = NULL;
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, "Content-Type", a->content_type);
    if (a->status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (a->allow) MHD_add_response_header(resp, "Allow", a->allow);
    if (!strncmp(a->content_type, "text/html", 9)) { /* the chat page: its own inline code, this server, nothing else */
        MHD_add_response_header(resp, "Content-Security-Policy",
                                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'");
        MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
    }
    /* 401 and 413 are answered before the body is read: libmicrohttpd reads no
     * more of it and closes the connection after the answer; say so */
    if (a->status == 401 || a->status == 413 || a->close || atomic_load(&s->draining))
        MHD_add_response_header(resp, "Connection", "close");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)a->status, resp);
    MHD_destroy_response(resp);
    atomic_fetch_add(&s->http_requests, 1);
    if (a->status >= 400) atomic_fetch_add(&s->http_errors, 1);
    return ret;
}

enum MHD_Result kvs_http_error(kvs_server *s, struct MHD_Connection *c, const kvs_api_error *err, kvs_api_dialect d) {
    kvs_http_answer a;
    kvs_http_answer_error_as(&a, err, d);
    return kvs_http_send(s, c, &a);
}

/* Called when the request completes (on_completed), not when its answer is
 * queued: a drain then waits for the answer to be written. */
void kvs_http_req_done(kvs_http_req *r) {
    if (!r->counted) return;
    r->counted = false;
    kvs_server_request_done(r->srv, r->gen);
}

/* ---- a request ----------------------------------------------------------------- */
typedef struct {
    kvs_http_header *h;
    int n, cap;
} header_list;

static enum MHD_Result collect(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_len, const char *value,
                               size_t value_len) {
    (void)kind;
    header_list *l = cls;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        kvs_http_header *h = realloc(l->h, (size_t)cap * sizeof *h);
        if (!h) return MHD_NO;
        l->h = h, l->cap = cap;
    }
    l->h[l->n++] = (kvs_http_header){key, value ? value : "", key_len, value ? value_len : 0, false};
    return MHD_YES;
}

/* libmicrohttpd parses the header block in place, zeroing each line's ending,
 * and cuts a value at a NUL byte: such a value ends before its line does. So
 * after a whole value come the zeroed line ending and then the next field (or
 * the zeroed blank line); anything else there is what a NUL hid. */
static void mark_cut(kvs_http_header *h, int n) {
    for (int i = 0; i < n; i++) {
        const char *end = h[i].value + h[i].value_len;
        if (end[0] != '\0') continue; /* not in place: nothing to tell */
        const char *next = i + 1 < n ? h[i + 1].name : NULL;
        h[i].cut = next != end + 1 && next != end + 2 && end[1] != '\0';
    }
}

static kvs_http_req *req_new(kvs_server *s, struct MHD_Connection *c, const char *version) {
    kvs_http_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->srv = s;
    r->conn = c;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    r->sock = ci ? ci->socket_context : NULL;
    ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;
    r->http11 = !strcmp(version, MHD_HTTP_VERSION_1_1);
    pthread_mutex_init(&r->mu, NULL);
    r->wait = (kvs_waker){c, false, &s->suspended};
    r->run_wait = r->wait;
    atomic_init(&r->cancel, false);
    kvs_peer_progress_init(&r->progress);
    return r;
}

/* The headers are in: answer from them, or read the body. */
static enum MHD_Result first_call(kvs_server *s, struct MHD_Connection *c, kvs_http_req *r, const char *url,
                                  const char *method, const char *version) {
    header_list l = {0};
    kvs_http_head_fields f;
    kvs_http_answer a;
    bool listed = MHD_get_connection_values_n(c, MHD_HEADER_KIND, collect, &l) >= 0;
    mark_cut(l.h, l.n);
    bool answered = !kvs_http_check_head(version, l.h, l.n, &f, &a) || kvs_http_head(s, method, url, &f, &r->route, &a);
    free(l.h);
    if (!listed) return MHD_NO;
    bool body = (f.has_length && f.content_length > 0) || f.chunked;
    kvs_conns_headers(s->conns, r->sock, body && !answered);
    if (!answered) return MHD_YES;
    /* an answer queued now, before the body, makes libmicrohttpd discard the
     * body and close the connection after it: what 401, 413 and a framing
     * error want. A request without a body (a GET) is answered at the next
     * call instead, which keeps an HTTP/1.1 connection open. */
    r->queued_answer = true;
    if (body || a.status == 401 || a.status == 413 || a.close) return kvs_http_send(s, c, &a);
    r->pending = a;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kvs_server *s = cls;
    kvs_http_req *r = *con_cls;
    if (!r) {
        if (!(r = *con_cls = req_new(s, c, version))) return MHD_NO;
        return first_call(s, c, r, url, method, version);
    }
    if (r->queued_answer) {
        *upload_size = 0;
        if (!r->pending.status) return MHD_YES;
        kvs_http_answer a = r->pending;
        r->pending = (kvs_http_answer){0};
        return kvs_http_send(s, c, &a);
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        kvs_conns_body(s->conns, r->sock, n);
        kvs_http_answer a;
        if (kvs_http_body_add(s, &r->body, upload, n, &a)) return MHD_YES;
        /* past the limit while the body arrives (chunked, no Content-Length): an
         * answer can only be queued before or after the body, so close now
         * rather than read the rest */
        free(a.body);
        r->queued_answer = true;
        return MHD_NO;
    }
    kvs_conns_request(s->conns, r->sock, r); /* the whole request is in: in flight, watched */
    return kvs_work_continue(s, r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode code) {
    (void)c, (void)code;
    kvs_server *s = cls;
    kvs_http_req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    kvs_conns_done(s->conns, r->sock); /* the watcher no longer sees r */
    if (r->gen) {
        pthread_mutex_lock(&r->gen->mu);
        if (r->gen->waker == &r->run_wait) r->gen->waker = NULL;
        bool done = r->gen->done;
        pthread_mutex_unlock(&r->gen->mu);
        if (!done) kvs_server_abort(s, r->gen); /* never answered: the connection ended first */
    }
    kvs_http_req_done(r); /* its answer has gone out (or its connection ended): a drain may end */
    kvs_gen_release(r->gen);
    kvs_http_body_free(&r->body);
    kvs_http_prepared_free(&r->prep);
    free(r->pending.body);
    free(r->answer.body);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* ---- connections ----------------------------------------------------------------- */
static enum MHD_Result admit(void *cls, const struct sockaddr *addr, socklen_t len) {
    kvs_server *s = cls;
    return kvs_conns_admit(s->conns, addr, len) ? MHD_YES : MHD_NO;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    kvs_server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        kvs_conns_close(s->conns, *socket_context);
        *socket_context = NULL;
        return;
    }
    const union MHD_ConnectionInfo *fd = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *addr = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    *socket_context = fd && addr ? kvs_conns_open(s->conns, fd->connect_fd, addr->client_addr, 0) : NULL;
}

/* A target's %00 would cut it where the server reads it as a C string
 * (/health%00x would be /health): such a target is left as it came, and
 * routes nowhere. */
static size_t unescape(void *cls, struct MHD_Connection *c, char *text) {
    (void)cls, (void)c;
    for (const char *p = strchr(text, '%'); p; p = strchr(p + 1, '%'))
        if (p[1] == '0' && p[2] == '0') return strlen(text);
    return MHD_http_unescape(text);
}

struct MHD_Daemon *kvs_http_daemon(kvs_server *s, unsigned flags, const struct sockaddr *addr) {
    return MHD_start_daemon(flags, (uint16_t)s->cfg.port, admit, s, on_request, s,
                            MHD_OPTION_SOCK_ADDR, addr,
                            MHD_OPTION_CONNECTION_LIMIT, s->cfg.connection_limit,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, s->cfg.max_connections_per_ip,
                            MHD_OPTION_CONNECTION_TIMEOUT, s->cfg.http_timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_UNESCAPE_CALLBACK, unescape, s,
                            MHD_OPTION_END);
}
