/* server: its life: the state shared by its threads, the daemon's start
 * (libmicrohttpd's epoll thread, the workers, the connection watcher), the
 * requests in flight, drain and stop, the counters of /metrics. The request
 * path on libmicrohttpd's thread is http.c. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/http.h"

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

void kvs_server_abort(kvs_server *s, kvs_gen *g) {
    pthread_mutex_lock(&s->mu);
    if (g && g->submitted) kvs_engine_abort(s->engine, g->engine_id);
    pthread_mutex_unlock(&s->mu);
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
    if (!s->cfg.max_pending) s->cfg.max_pending = s->cfg.connection_limit / 4 ? s->cfg.connection_limit / 4 : 1;
    if (!s->cfg.http_timeout_s) s->cfg.http_timeout_s = 60;
    if (s->cfg.header_timeout_s <= 0) s->cfg.header_timeout_s = 10;
    if (s->cfg.body_timeout_s <= 0) s->cfg.body_timeout_s = 10;
    if (s->cfg.body_min_rate <= 0) s->cfg.body_min_rate = 4096;
    if (s->cfg.max_preparing <= 0) s->cfg.max_preparing = 8;
    kvs_grammar_limits gl = kvs_grammar_limits_default(), *l = &s->cfg.grammar_limits;
    if (!l->max_values) l->max_values = gl.max_values;
    if (!l->max_states) l->max_states = gl.max_states;
    if (!l->max_transitions) l->max_transitions = gl.max_transitions;
    if (!l->max_bytes) l->max_bytes = gl.max_bytes;
    if (l->max_seconds <= 0) l->max_seconds = gl.max_seconds;
    if (!l->max_mask_work) l->max_mask_work = gl.max_mask_work;
    if (!s->cfg.grammar_cache_bytes) s->cfg.grammar_cache_bytes = (size_t)256 << 20;
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
        s->limits.max_window = el.max_window;
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
    atomic_init(&s->suspended, 0);
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
    kvs_conns_config cc = {s->cfg.max_pending, s->cfg.header_timeout_s, s->cfg.body_timeout_s, s->cfg.body_min_rate,
                           kvs_work_watch, s};
    st = kvs_conns_create(&cc, &s->conns);
    if (st == KVS_OK) st = kvs_work_start(s, s->cfg.max_preparing, s->slot_wait_ms, &s->work);
    if (st != KVS_OK) {
        freeaddrinfo(ai);
        kvs_work_stop(s->work);
        kvs_conns_destroy(s->conns);
        kvs_server_free(s);
        return st;
    }
    /* one thread for every connection, none waiting: see http.h */
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->daemon = kvs_http_daemon(s, flags, ai->ai_addr);
    freeaddrinfo(ai);
    if (!s->daemon) {
        kvs_work_stop(s->work);
        kvs_conns_destroy(s->conns);
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
        pthread_mutex_unlock(&s->mu);
        kvs_conns_each_request(s->conns, kvs_work_cancel, NULL); /* compiles stop, queued work ends */
        pthread_mutex_lock(&s->mu);
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
    /* every socket ends, the workers answer what waits and stop, and every
       connection waiting for the engine (stopped by now) has been woken:
       libmicrohttpd must not stop with a connection suspended */
    kvs_conns_shut_all(s->conns);
    kvs_work_stop(s->work);
    for (int i = 0; i < 300 && atomic_load(&s->suspended) > 0; i++) usleep(10000);
    if (atomic_load(&s->suspended) > 0)
        kvs_log(KVS_LOG_WARN, "%d connections still suspended at stop", atomic_load(&s->suspended));
    MHD_stop_daemon(s->daemon);
    kvs_conns_destroy(s->conns);
    kvs_server_free(s);
}

kvs_server_http_stats kvs_server_http_stats_get(kvs_server *s) {
    kvs_server_http_stats h = {atomic_load(&s->http_requests), atomic_load(&s->http_errors)};
    if (s->conns) {
        kvs_conns_stats c = kvs_conns_get_stats(s->conns);
        h.connections_pending = c.pending;
        h.connections_in_flight = c.in_flight;
        h.header_timeouts = c.header_timeouts;
        h.body_timeouts = c.body_timeouts;
        h.displaced = c.displaced;
        h.refused = c.refused;
    }
    h.grammar_cache_bytes = kvs_server_grammar_bytes(s, &h.grammar_cache_entries);
    return h;
}
