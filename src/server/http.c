/* server: the libmicrohttpd daemon: routing, auth, the body limit, the simple
 * endpoints, drain and stop.
 *
 * Threading: one thread per connection (MHD_USE_THREAD_PER_CONNECTION with
 * poll). A non-streaming request's handler simply waits for its result; a
 * streaming response's reader waits for the next tokens. Both wake every
 * 500 ms to notice a client that went away, and abort its request. */
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/generate.h"
#include "server/http.h"

typedef enum { ROUTE_NONE, ROUTE_COMPLETIONS, ROUTE_CHAT, ROUTE_MODELS, ROUTE_MODEL, ROUTE_HEALTH, ROUTE_METRICS } route;

typedef struct {
    route r;
    char *body;
    size_t len, cap;
    bool too_large, answered;
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
    if (atomic_load(&s->draining)) MHD_add_response_header(resp, "Connection", "close");
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    atomic_fetch_add(&s->http_requests, 1);
    if (status >= 400) atomic_fetch_add(&s->http_errors, 1);
    return ret;
}

enum MHD_Result kvs_http_error(kvs_server *s, struct MHD_Connection *c, const kvs_api_error *err) {
    return kvs_http_respond(s, c, err->http_status, "application/json", kvs_api_error_json(err));
}

static enum MHD_Result fail(kvs_server *s, struct MHD_Connection *c, int status, const char *fmt, const char *arg) {
    kvs_api_error err;
    kvs_api_fail(&err, status, NULL, fmt, arg);
    return kvs_http_error(s, c, &err);
}

static enum MHD_Result too_large(kvs_server *s, struct MHD_Connection *c) {
    kvs_api_error err;
    kvs_api_fail(&err, 413, NULL, "the request body is larger than the limit of %zu bytes", s->cfg.max_body_bytes);
    return kvs_http_error(s, c, &err);
}

int kvs_http_conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

void kvs_server_request_done(kvs_server *s) {
    pthread_mutex_lock(&s->mu);
    s->in_flight--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static route find_route(const kvs_server *s, const char *url) {
    if (!strcmp(url, "/v1/completions")) return ROUTE_COMPLETIONS;
    if (!strcmp(url, "/v1/chat/completions")) return ROUTE_CHAT;
    if (!strcmp(url, "/v1/models")) return ROUTE_MODELS;
    if (!strncmp(url, "/v1/models/", 11)) return ROUTE_MODEL;
    if (!strcmp(url, "/health")) return ROUTE_HEALTH;
    if (!strcmp(url, "/metrics")) return ROUTE_METRICS;
    return ROUTE_NONE;
}

/* Authorization: Bearer KEY, compared in constant time. */
static bool authorized(const kvs_server *s, struct MHD_Connection *c) {
    if (!s->api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return false;
    h += 7;
    size_t a = strlen(h), b = strlen(s->api_key);
    unsigned char diff = a != b;
    for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned char)(h[i] ^ s->api_key[i]);
    return diff == 0;
}

static json_t *model_json(const kvs_server *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->model_name, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "kvsparse", "max_model_len", s->limits.max_model_len);
}

static enum MHD_Result answer_get(kvs_server *s, struct MHD_Connection *c, route r, const char *url) {
    const char *why;
    if (r == ROUTE_HEALTH && kvs_engine_failed(s->engine, &why)) { /* a supervisor restarts the process */
        json_t *j = json_pack("{s:s, s:s}", "status", "failed", "reason", why);
        char *body = j ? json_dumps(j, JSON_COMPACT) : strdup("{\"status\":\"failed\"}"); /* not UTF-8 */
        json_decref(j);
        return kvs_http_respond(s, c, 503, "application/json", body);
    }
    if (r == ROUTE_HEALTH) {
        bool d = atomic_load(&s->draining);
        return kvs_http_respond(s, c, d ? 503 : 200, "application/json",
                                strdup(d ? "{\"status\":\"draining\"}" : "{\"status\":\"ok\"}"));
    }
    if (r == ROUTE_METRICS)
        return kvs_http_respond(s, c, 200, "text/plain; version=0.0.4",
                                kvs_server_metrics_text(s->engine, s->model_name, atomic_load(&s->http_requests),
                                                        atomic_load(&s->http_errors)));
    json_t *root;
    if (r == ROUTE_MODELS) {
        root = json_pack("{s:s, s:[o]}", "object", "list", "data", model_json(s));
    } else {
        if (strcmp(url + 11, s->model_name)) return fail(s, c, 404, "The model '%.200s' does not exist", url + 11);
        root = model_json(s);
    }
    char *body = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return kvs_http_respond(s, c, 200, "application/json", body);
}

/* The first call for a request: everything that can be decided from the headers. */
static enum MHD_Result on_headers(kvs_server *s, struct MHD_Connection *c, conn_state *cs, const char *url,
                                  const char *method) {
    cs->r = find_route(s, url);
    if (cs->r == ROUTE_NONE) return cs->answered = true, fail(s, c, 404, "Not found: %.200s", url);
    bool post = cs->r == ROUTE_COMPLETIONS || cs->r == ROUTE_CHAT;
    if (strcmp(method, post ? "POST" : "GET"))
        return cs->answered = true, fail(s, c, 405, "Method not allowed: use %s", post ? "POST" : "GET");
    if (!strncmp(url, "/v1/", 4) && !authorized(s, c)) {
        cs->answered = true;
        kvs_api_error err;
        kvs_api_fail(&err, 401, NULL, "Incorrect or missing API key: send 'Authorization: Bearer KEY'");
        err.code = "invalid_api_key";
        return kvs_http_error(s, c, &err);
    }
    const char *why;
    if (post && kvs_engine_failed(s->engine, &why))
        return cs->answered = true, fail(s, c, 503, "the engine failed: %.400s", why);
    if (post && atomic_load(&s->draining))
        return cs->answered = true, fail(s, c, 503, "%s", "the server is shutting down");
    if (!post) return cs->answered = true, answer_get(s, c, cs->r, url);
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoull(cl, NULL, 10) > s->cfg.max_body_bytes)
        return cs->answered = true, too_large(s, c);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kvs_server *s = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof *cs);
        if (!cs) return MHD_NO;
        *con_cls = cs;
        return on_headers(s, c, cs, url, method);
    }
    if (cs->answered) {
        *upload_size = 0; /* discard the rest of a rejected body */
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cs->too_large || cs->len + n > s->cfg.max_body_bytes) {
            cs->too_large = true;
            return MHD_YES;
        }
        if (cs->len + n + 1 > cs->cap) {
            size_t cap = (cs->len + n + 1) * 2;
            if (cap > s->cfg.max_body_bytes + 1) cap = s->cfg.max_body_bytes + 1;
            char *p = realloc(cs->body, cap);
            if (!p) return MHD_NO;
            cs->body = p;
            cs->cap = cap;
        }
        memcpy(cs->body + cs->len, upload, n);
        cs->len += n;
        return MHD_YES;
    }
    cs->answered = true;
    if (cs->too_large) return too_large(s, c);
    return kvs_http_generate(s, c, cs->r == ROUTE_CHAT ? KVS_API_CHAT : KVS_API_COMPLETIONS, cs->body, cs->len);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode code) {
    conn_state *cs = *con_cls;
    if (!cs) return;
    free(cs->body);
    free(cs);
    *con_cls = NULL;
}

static void free_server(kvs_server *s) {
    kvs_chat_template_destroy(s->tpl);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s->host);
    free(s->api_key);
    free(s->model_name);
    free(s);
}

kvs_status kvs_server_start(const kvs_server_config *cfg, kvs_engine *engine, const kvs_tokenizer *tok,
                            kvs_server **out) {
    kvs_server *s = calloc(1, sizeof *s);
    if (!s) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    s->cfg = *cfg;
    if (!s->cfg.max_body_bytes) s->cfg.max_body_bytes = 4u << 20;
    if (!s->cfg.connection_limit) s->cfg.connection_limit = 1024;
    s->host = strdup(cfg->host ? cfg->host : "127.0.0.1");
    s->api_key = cfg->api_key && *cfg->api_key ? strdup(cfg->api_key) : NULL;
    s->model_name = strdup(cfg->served_model_name ? cfg->served_model_name : "model");
    s->engine = engine;
    s->tok = tok;
    s->started = (long long)time(NULL);
    s->limits = (kvs_api_limits){tok ? kvs_tokenizer_vocab_size(tok) : 1 << 30, cfg->max_model_len, cfg->n_layers};
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->draining, false);
    atomic_init(&s->next_id, 1);
    atomic_init(&s->http_requests, 0);
    atomic_init(&s->http_errors, 0);
    if (tok) {
        const char *src = kvs_tokenizer_chat_template(tok);
        if (!src) src = kvs_chat_template_default();
        if (kvs_chat_template_compile(src, strlen(src), &s->tpl) != KVS_OK) {
            kvs_status st = kvs_fail(KVS_ERR_FORMAT, "the model's chat template: %s", kvs_last_error());
            free_server(s);
            return st;
        }
    }
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    if (getaddrinfo(s->host, port, &hints, &ai) != 0 || !ai) {
        free_server(s);
        return kvs_fail(KVS_ERR_INVALID, "--host %s: not an address this machine can listen on", cfg->host);
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ITC;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->daemon = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, s,
                                 MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                 MHD_OPTION_CONNECTION_LIMIT, s->cfg.connection_limit,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                 MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->daemon) {
        free_server(s);
        return kvs_fail(KVS_ERR_IO, "could not listen on %s:%d (in use, or no permission)", cfg->host, cfg->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    *out = s;
    return KVS_OK;
}

int kvs_server_port(const kvs_server *s) { return s->port; }

void kvs_server_drain(kvs_server *s) {
    atomic_store(&s->draining, true);
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    pthread_mutex_lock(&s->mu);
    while (s->in_flight > 0) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

void kvs_server_stop(kvs_server *s) {
    if (!s) return;
    MHD_stop_daemon(s->daemon);
    free_server(s);
}
