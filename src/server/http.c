/* server: the libmicrohttpd daemon over route.c's request path: connections,
 * timeouts and limits, the requests in flight, drain and stop.
 *
 * Threading: one thread per connection (MHD_USE_THREAD_PER_CONNECTION with
 * poll). A non-streaming request's handler simply waits for its result; a
 * streaming response's reader waits for the next tokens. Both wake every
 * 500 ms to notice a client that went away (generate.c), and abort its
 * request.
 *
 * --http-timeout: libmicrohttpd closes a connection whose socket saw no
 * successful read or write for that long: an idle or slow client, and a
 * client that stops reading its response (the write blocks). Time the server
 * itself spends producing a response does not count (kvs_http_touch). */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/generate.h"
#include "server/http.h"
#include "server/route.h"

typedef struct {
    kvs_route r;
    kvs_http_body body;
    bool answered;
    kvs_http_answer pending; /* decided from the headers of a request without a body */
} conn_state;

enum MHD_Result kvs_http_respond(kvs_server *s, struct MHD_Connection *c, unsigned status, const char *content_type,
                                 char *body) {
    if (!body) return MHD_NO;
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", content_type);
    if (status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (status == 405) MHD_add_response_header(resp, "Allow", "GET, POST");
    if (!strncmp(content_type, "text/html", 9)) { /* the chat page: its own inline code, this server, nothing else */
        MHD_add_response_header(resp, "Content-Security-Policy",
                                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'");
        MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
    }
    /* 401 and 413 are answered before the body is read: libmicrohttpd reads no
     * more of it and closes the connection after the answer; say so */
    if (status == 401 || status == 413 || atomic_load(&s->draining))
        MHD_add_response_header(resp, "Connection", "close");
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    atomic_fetch_add(&s->http_requests, 1);
    if (status >= 400) atomic_fetch_add(&s->http_errors, 1);
    return ret;
}

enum MHD_Result kvs_http_error(kvs_server *s, struct MHD_Connection *c, const kvs_api_error *err) {
    return kvs_http_respond(s, c, err->http_status, "application/json", kvs_api_error_json(err));
}

static enum MHD_Result respond_answer(kvs_server *s, struct MHD_Connection *c, kvs_http_answer *a) {
    return kvs_http_respond(s, c, (unsigned)a->status, a->content_type, a->body);
}

int kvs_http_conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

void kvs_http_touch(struct MHD_Connection *c, unsigned timeout_s) {
    /* libmicrohttpd counts only socket reads and writes as activity; setting
     * the connection's timeout from 0 restarts its clock */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, timeout_s);
}

bool kvs_server_request_begin(kvs_server *s, kvs_api_error *err) {
    pthread_mutex_lock(&s->mu);
    bool ok = !atomic_load(&s->draining);
    if (ok) s->in_flight++;
    pthread_mutex_unlock(&s->mu);
    if (!ok) kvs_api_fail(err, 503, NULL, "the server is shutting down");
    return ok;
}

bool kvs_server_request_submitted(kvs_server *s, kvs_gen *g, uint64_t engine_id) {
    pthread_mutex_lock(&s->mu);
    g->engine_id = engine_id;
    g->submitted = true;
    bool ok = !s->aborting;
    pthread_mutex_unlock(&s->mu);
    if (!ok) kvs_engine_abort(s->engine, engine_id);
    return ok;
}

bool kvs_server_request_link(kvs_server *s, kvs_gen *g) {
    pthread_mutex_lock(&s->mu);
    bool ok = !s->aborting;
    if (ok) {
        g->live = true;
        g->live_prev = NULL;
        g->live_next = s->live;
        if (s->live) s->live->live_prev = g;
        s->live = g;
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void unlink_gen(kvs_server *s, kvs_gen *g) {
    if (!g || !g->live) return;
    if (g->live_prev) g->live_prev->live_next = g->live_next;
    else s->live = g->live_next;
    if (g->live_next) g->live_next->live_prev = g->live_prev;
    g->live = false;
}

void kvs_server_request_unlink(kvs_server *s, kvs_gen *g) {
    pthread_mutex_lock(&s->mu);
    unlink_gen(s, g);
    pthread_mutex_unlock(&s->mu);
}

void kvs_server_request_done(kvs_server *s, kvs_gen *g) {
    pthread_mutex_lock(&s->mu);
    unlink_gen(s, g);
    s->in_flight--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kvs_server *s = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof *cs);
        if (!cs) return MHD_NO;
        *con_cls = cs;
        kvs_http_answer a;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (!kvs_http_head(s, method, url, MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization"), cl,
                           &cs->r, &a))
            return MHD_YES;
        cs->answered = true;
        /* an answer queued now, before the body, makes libmicrohttpd discard the
         * body and close the connection after it: what 401 and 413 want. A
         * request without a body (a GET) is answered at the next call instead,
         * which keeps an HTTP/1.1 connection open. */
        bool bodyless = (!cl || !strcmp(cl, "0")) &&
                        !MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
        if (!bodyless || a.status == 401 || a.status == 413) return respond_answer(s, c, &a);
        cs->pending = a;
        return MHD_YES;
    }
    if (cs->answered) {
        *upload_size = 0;
        if (!cs->pending.status) return MHD_YES;
        kvs_http_answer a = cs->pending;
        cs->pending.status = 0;
        return respond_answer(s, c, &a);
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        kvs_http_answer a;
        if (kvs_http_body_add(s, &cs->body, upload, n, &a)) return MHD_YES;
        /* past the limit while the body arrives (chunked, no Content-Length): an
         * answer can only be queued before or after the body, so close now
         * rather than read the rest */
        free(a.body);
        cs->answered = true;
        return MHD_NO;
    }
    cs->answered = true;
    if (cs->r == KVS_ROUTE_TOKENIZE || cs->r == KVS_ROUTE_DETOKENIZE) {
        kvs_http_answer a;
        kvs_http_tokenize(s, cs->r == KVS_ROUTE_DETOKENIZE, cs->body.data, cs->body.len, &a);
        return respond_answer(s, c, &a);
    }
    return kvs_http_generate(s, c, cs->r == KVS_ROUTE_CHAT ? KVS_API_CHAT : KVS_API_COMPLETIONS, cs->body.data,
                             cs->body.len, !strcmp(version, MHD_HTTP_VERSION_1_1));
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode code) {
    conn_state *cs = *con_cls;
    if (!cs) return;
    kvs_http_body_free(&cs->body);
    if (cs->pending.status) free(cs->pending.body);
    free(cs);
    *con_cls = NULL;
}

void kvs_server_free(kvs_server *s) {
    if (!s) return;
    kvs_chat_template_destroy(s->tpl);
    kvs_server_grammars_free(s);
    pthread_mutex_destroy(&s->grammar_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->slot_mu);
    pthread_cond_destroy(&s->slot_cv);
    free(s->host);
    free(s->api_key);
    free(s->model_name);
    free(s);
}

kvs_status kvs_server_create(const kvs_server_config *cfg, kvs_engine *engine, const kvs_tokenizer *tok,
                             kvs_server **out) {
    kvs_server *s = calloc(1, sizeof *s);
    if (!s) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    s->cfg = *cfg;
    if (!s->cfg.max_body_bytes) s->cfg.max_body_bytes = 4u << 20;
    if (!s->cfg.connection_limit) s->cfg.connection_limit = 1024;
    if (!s->cfg.max_connections_per_ip) s->cfg.max_connections_per_ip = 256;
    if (!s->cfg.http_timeout_s) s->cfg.http_timeout_s = 60;
    if (s->cfg.max_preparing <= 0) s->cfg.max_preparing = 8;
    s->slot_wait_ms = 5000;
    s->host = strdup(cfg->host ? cfg->host : "127.0.0.1");
    s->api_key = cfg->api_key && *cfg->api_key ? strdup(cfg->api_key) : NULL;
    s->model_name = strdup(cfg->served_model_name ? cfg->served_model_name : "model");
    s->engine = engine;
    s->tok = tok;
    s->started = (long long)time(NULL);
    s->limits = (kvs_api_limits){tok ? kvs_tokenizer_vocab_size(tok) : 1 << 30, cfg->max_model_len, cfg->n_layers};
    if (engine) { /* the engine's limits are the authority */
        kvs_engine_limits el = kvs_engine_get_limits(engine);
        s->limits.max_model_len = el.max_model_len;
        s->limits.n_layers = el.n_layers;
        s->limits.kv_profile = kvs_engine_default_policy(engine).profile; /* serve --kv-profile */
    }
    s->sampling = cfg->sampling_defaults ? *cfg->sampling_defaults : kvs_api_sampling_default();
    s->limits.sampling = &s->sampling;
    s->cfg.sampling_defaults = &s->sampling;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->slot_mu, NULL);
    pthread_cond_init(&s->slot_cv, NULL);
    pthread_mutex_init(&s->grammar_mu, NULL);
    atomic_init(&s->draining, false);
    atomic_init(&s->next_id, 1);
    atomic_init(&s->http_requests, 0);
    atomic_init(&s->http_errors, 0);
    if (tok) {
        const char *src = kvs_tokenizer_chat_template(tok);
        if (!src) src = kvs_chat_template_default();
        if (kvs_chat_template_compile(src, strlen(src), &s->tpl) != KVS_OK) {
            kvs_status st = kvs_fail(KVS_ERR_FORMAT, "the model's chat template: %s", kvs_last_error());
            kvs_server_free(s);
            return st;
        }
    }
    /* how outputs with tools are parsed: --tool-call-parser, or what the template's model writes */
    const char *parser = cfg->tool_call_parser ? cfg->tool_call_parser : "auto";
    if (!kvs_tool_format_parse(parser, &s->tool_format)) {
        kvs_server_free(s);
        return kvs_fail(KVS_ERR_INVALID, "--tool-call-parser: '%s' is not llama3_json, hermes, none or auto", parser);
    }
    if (!strcmp(parser, "auto")) {
        const char *src = tok ? kvs_tokenizer_chat_template(tok) : NULL;
        s->tool_format = kvs_tool_format_for_template(src ? src : kvs_chat_template_default());
    }
    *out = s;
    return KVS_OK;
}

bool kvs_addr_is_loopback(const struct sockaddr *sa) {
    if (sa->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family != AF_INET6) return false;
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(a)) return true;
    return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
}

kvs_status kvs_server_start(const kvs_server_config *cfg, kvs_engine *engine, const kvs_tokenizer *tok,
                            kvs_server **out) {
    kvs_server *s;
    kvs_status st = kvs_server_create(cfg, engine, tok, &s);
    if (st != KVS_OK) return st;
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    if (getaddrinfo(s->host, port, &hints, &ai) != 0 || !ai) {
        kvs_server_free(s);
        return kvs_fail(KVS_ERR_INVALID, "--host %s: not an address this machine can listen on", cfg->host);
    }
    if (!s->api_key && !kvs_addr_is_loopback(ai->ai_addr))
        kvs_log(KVS_LOG_WARN, "listening on %s without an API key: anyone who can reach this address can use the "
                "server (set --api-key-file FILE or KVSPARSE_API_KEY)", s->host);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ITC;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->daemon = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, s,
                                 MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                 MHD_OPTION_CONNECTION_LIMIT, s->cfg.connection_limit,
                                 MHD_OPTION_PER_IP_CONNECTION_LIMIT, s->cfg.max_connections_per_ip,
                                 MHD_OPTION_CONNECTION_TIMEOUT, s->cfg.http_timeout_s,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                 MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->daemon) {
        kvs_server_free(s);
        return kvs_fail(KVS_ERR_IO, "could not listen on %s:%d (in use, or no permission)", cfg->host, cfg->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    *out = s;
    return KVS_OK;
}

int kvs_server_port(const kvs_server *s) { return s->port; }

int kvs_server_drain(kvs_server *s, int timeout_s) {
    atomic_store(&s->draining, true);
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_s > 0 ? timeout_s : 0;
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (s->in_flight > 0 && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int left = s->in_flight;
    if (left > 0) {
        /* the rest are aborted; a request submitted from now on is aborted at once */
        s->aborting = true;
        for (kvs_gen *g = s->live; g; g = g->live_next)
            if (g->submitted) kvs_engine_abort(s->engine, g->engine_id);
        /* up to 2 s more for their last events ("abort", [DONE]) to go out;
         * a client that reads nothing is cut by kvs_server_stop */
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 2;
        rc = 0;
        while (s->in_flight > 0 && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    }
    pthread_mutex_unlock(&s->mu);
    return left;
}

void kvs_server_stop(kvs_server *s) {
    if (!s) return;
    MHD_stop_daemon(s->daemon); /* shuts every connection's socket, then joins its thread */
    kvs_server_free(s);
}
