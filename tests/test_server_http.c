/* server: the connection level. In process, the request path without sockets
 * (route.c: routing, auth, body limits, the prepare slots, the size checks
 * before tokenizing); against the real binary over loopback: --http-timeout,
 * the per-address limit, early 401/413, disconnects (extra bytes, half-close,
 * a client that stops reading), the drain timeout, the API key sources. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "core/core.h"
#include "server/route.h"
#include "server_client.h"
#include "testutil.h"

/* ---- in process: the request path ----------------------------------------- */
static kvs_server *path_server(const char *key, size_t max_body, int max_len, const kvs_tokenizer *tok) {
    kvs_server_config cfg = {.api_key = key, .served_model_name = "m", .max_body_bytes = max_body,
                             .max_model_len = max_len, .n_layers = 8};
    kvs_server *s;
    cr_assert_eq(kvs_server_create(&cfg, NULL, tok, &s), KVS_OK, "%s", kvs_last_error());
    return s;
}

/* An HTTP/1.1 request's fields: Host, and Authorization and Content-Length when given (n: how many). */
static int fields(kvs_http_header *h, const char *auth, const char *cl) {
    int n = 0;
    h[n++] = (kvs_http_header){"Host", "localhost", 4, 9, false};
    if (auth) h[n++] = (kvs_http_header){"Authorization", auth, 13, strlen(auth), false};
    if (cl) h[n++] = (kvs_http_header){"Content-Length", cl, 14, strlen(cl), false};
    return n;
}

/* Runs one request; returns its status (0: ready for the engine) and frees what it made. */
static int path_status(kvs_server *s, const char *method, const char *url, const char *auth, const char *cl,
                       const char *body, size_t chunk, char *msg, size_t cap) {
    kvs_http_answer a;
    kvs_http_prepared p;
    kvs_http_header h[3];
    int n = fields(h, auth, cl);
    bool ready = kvs_http_handle(s, method, url, "HTTP/1.1", h, n, body, body ? strlen(body) : 0, chunk, &a, &p);
    if (msg) snprintf(msg, cap, "%s", a.body ? a.body : "");
    if (ready) {
        cr_expect_eq(a.status, 0);
        kvs_http_prepared_free(&p);
        return 0;
    }
    cr_expect(a.body, "an answer without a body");
    json_t *j = a.content_type && strstr(a.content_type, "json") ? json_loads(a.body, 0, NULL) : NULL;
    if (a.status >= 400 && strcmp(url, "/health"))
        cr_expect(json_is_string(json_object_get(json_object_get(j, "error"), "message")), "not an error object: %s",
                  a.body);
    json_decref(j);
    free(a.body);
    return a.status;
}

Test(http_path, routing_auth_and_body_limit) {
    kvs_server *s = path_server("k", 2048, 64, NULL);
    const char *ok = "Bearer k", *ids = "{\"prompt\": [1, 2, 3], \"max_tokens\": 4}";
    cr_expect_eq(path_status(s, "GET", "/nowhere", ok, NULL, NULL, 0, NULL, 0), 404);
    /* a URL that is not UTF-8 (quoted in the message): still a JSON error object (found by fuzz_http_request) */
    cr_expect_eq(path_status(s, "GET", "/v2/\xff\xfe\x91", ok, NULL, NULL, 0, NULL, 0), 404);
    char url[300];
    memset(url, 'a', sizeof url);
    memcpy(url, "/x", 2);
    memcpy(url + 196, "\xc3\xa9\xc3\xa9\xc3\xa9", 6); /* "Not found: %.200s" cuts an é in two */
    url[299] = 0;
    cr_expect_eq(path_status(s, "GET", url, ok, NULL, NULL, 0, NULL, 0), 404);
    cr_expect_eq(path_status(s, "GET", "/v1/completions", ok, NULL, NULL, 0, NULL, 0), 405);
    cr_expect_eq(path_status(s, "DELETE", "/health", NULL, NULL, NULL, 0, NULL, 0), 405);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, ids, 0, NULL, 0), 401);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", "Bearer x", NULL, ids, 0, NULL, 0), 401);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", "Bearer kk", NULL, ids, 0, NULL, 0), 401);
    cr_expect_eq(path_status(s, "GET", "/health", NULL, NULL, NULL, 0, NULL, 0), 200, "/health needs no key");
    cr_expect_eq(path_status(s, "GET", "/v1/models", ok, NULL, NULL, 0, NULL, 0), 200);
    cr_expect_eq(path_status(s, "GET", "/v1/models/m", ok, NULL, NULL, 0, NULL, 0), 200);
    cr_expect_eq(path_status(s, "GET", "/v1/models/other", ok, NULL, NULL, 0, NULL, 0), 404);
    cr_expect_eq(path_status(s, "GET", "/metrics", NULL, NULL, NULL, 0, NULL, 0), 503, "no engine here");
    /* the body limit: from Content-Length before any byte, or as the bytes come */
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, "2049", ids, 0, NULL, 0), 413);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, "99999999999999999999999", ids, 0, NULL, 0), 413);
    char *big = malloc(3001);
    memset(big, ' ', 3000);
    big[3000] = 0;
    memcpy(big, ids, strlen(ids));
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, NULL, big, 100, NULL, 0), 413);
    big[2048] = 0;
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, NULL, big, 100, NULL, 0), 0, "exactly the limit");
    free(big);
    /* ready for the engine; a text prompt needs a tokenizer */
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, "38", ids, 7, NULL, 0), 0);
    char msg[600];
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, NULL, "{\"prompt\": \"hi\"}", 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "no tokenizer"), "%s", msg);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, NULL, "{\"prompt\": [1], \"model\": \"x\"}", 0, NULL, 0),
                 404);
    atomic_store(&s->draining, true);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", ok, NULL, ids, 0, NULL, 0), 503);
    cr_expect_eq(path_status(s, "GET", "/health", NULL, NULL, NULL, 0, NULL, 0), 503);
    kvs_server_free(s);
}

static char *repeat(const char *head, const char *unit, int n, const char *tail) {
    size_t u = strlen(unit), len = strlen(head) + u * n + strlen(tail);
    char *b = malloc(len + 1), *p = b;
    p += sprintf(p, "%s", head);
    for (int i = 0; i < n; i++) memcpy(p, unit, u), p += u;
    sprintf(p, "%s", tail);
    return b;
}

/* GET /: the chat page, without the key the API needs (the page asks for it);
 * --no-web-ui: 404; any other method: 405. */
Test(http_path, chat_page) {
    kvs_server *s = path_server("k", 2048, 64, NULL);
    kvs_http_answer a;
    kvs_http_prepared p;
    kvs_http_header h[3];
    int n = fields(h, NULL, NULL);
    cr_assert_not(kvs_http_handle(s, "GET", "/", "HTTP/1.1", h, n, NULL, 0, 0, &a, &p));
    cr_expect_eq(a.status, 200);
    cr_expect_str_eq(a.content_type, "text/html; charset=utf-8");
    cr_expect(a.body && !strncmp(a.body, "<!DOCTYPE html>", 15) && strstr(a.body, "</html>"), "the whole page");
    free(a.body);
    cr_expect_eq(path_status(s, "POST", "/", "Bearer k", NULL, "{}", 0, NULL, 0), 405);
    kvs_server_free(s);
    kvs_server_config cfg = {.served_model_name = "m", .max_model_len = 64, .n_layers = 8, .no_web_ui = true};
    cr_assert_eq(kvs_server_create(&cfg, NULL, NULL, &s), KVS_OK);
    cr_expect_eq(path_status(s, "GET", "/", NULL, NULL, NULL, 0, NULL, 0), 404);
    kvs_server_free(s);
}

Test(http_path, text_far_beyond_the_context_is_refused_before_tokenizing) {
    kvs_tokenizer *tok;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &tok), KVS_OK, "%s", kvs_last_error());
    kvs_server *s = path_server(NULL, 8u << 20, 32, tok); /* 32 tokens: 2048 bytes of text at most */
    char msg[600];
    /* 2,100 bytes: refused by its size, naming the limit */
    char *b = repeat("{\"prompt\": \"", "ab ", 700, "\"}");
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "2048 bytes") && strstr(msg, "before tokenizing") && strstr(msg, "\"param\":\"prompt\""), "%s",
              msg);
    free(b);
    /* 1,500 bytes: within the byte limit, tokenized, then too many tokens */
    b = repeat("{\"prompt\": \"", "ab ", 500, "\"}");
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "maximum context length is 32 tokens; the prompt has"), "%s", msg);
    free(b);
    /* chat: more messages than tokens, or too many content bytes */
    b = repeat("{\"messages\": [", "{\"role\": \"user\", \"content\": \"x\"},", 32, "{\"role\": \"user\", \"content\": \"y\"}]}");
    cr_expect_eq(path_status(s, "POST", "/v1/chat/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "33 messages"), "%s", msg);
    free(b);
    b = repeat("{\"messages\": [{\"role\": \"user\", \"content\": \"", "abcd", 600,
               "\"}, {\"role\": \"user\", \"content\": \"1234567890\"}]}");
    cr_expect_eq(path_status(s, "POST", "/v1/chat/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "2048 bytes") && strstr(msg, "\"param\":\"messages\""), "%s", msg);
    free(b);
    /* more tokens asked for than the context leaves: the error names the field the request used */
    const char *fields[] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++) {
        char body[200], want[64];
        snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"%s\": 30}", fields[i]);
        snprintf(want, sizeof want, "\"param\":\"%s\"", fields[i]);
        cr_expect_eq(path_status(s, "POST", "/v1/chat/completions", NULL, NULL, body, 0, msg, sizeof msg), 400);
        cr_expect(strstr(msg, "were asked for") && strstr(msg, want), "%s: %s", fields[i], msg);
    }
    kvs_server_free(s);

    /* the cost: 4 MiB of text against an 8192-token context is refused in the parser */
    s = path_server(NULL, 8u << 20, 8192, tok);
    b = repeat("{\"prompt\": \"", "word ", 800 * 1024, "\"}");
    double t0 = kvs_now();
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    double dt = kvs_now() - t0;
    cr_expect(strstr(msg, "524288 bytes"), "%s", msg);
    free(b);
    b = repeat("{\"prompt\": \"", "word ", 100 * 1024, "\"}"); /* 500 KiB: under the limit, tokenized */
    t0 = kvs_now();
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, b, 0, msg, sizeof msg), 400);
    double dt_tok = kvs_now() - t0;
    free(b);
    cr_log_info("4 MiB prompt refused in %.1f ms; a 500 KiB one tokenized (then refused) in %.1f ms", dt * 1e3,
                dt_tok * 1e3);
    fprintf(stderr, "size check: 4 MiB prompt refused in %.1f ms; a 500 KiB one tokenized (then refused) in %.1f ms\n",
            dt * 1e3, dt_tok * 1e3);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

/* The context's limits, the engine's check (kvs_length_check) with its words:
 * a 400 naming the field the request used for the prompt or for max_tokens;
 * a default max_tokens, or Anthropic's, is capped by the context instead. */
static void expect_limit(kvs_server *s, const char *url, const char *body, const char *param, const char *want) {
    char msg[800];
    cr_expect_eq(path_status(s, "POST", url, NULL, NULL, body, 0, msg, sizeof msg), 400, "%s: %s", body, msg);
    json_t *j = json_loads(msg, 0, NULL), *e = json_object_get(j, "error");
    const char *m = json_string_value(json_object_get(e, "message"));
    const char *got = json_string_value(json_object_get(e, "param"));
    cr_expect(got && !strcmp(got, param), "%s: param %s, not %s", body, got ? got : "(none)", param);
    cr_expect(m && !strncmp(m, want, strlen(want)), "%s: '%s' does not start with '%s'", body, m ? m : "", want);
    json_decref(j);
}

Test(http_path, context_limits_name_the_field) {
    kvs_tokenizer *tok;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &tok), KVS_OK, "%s", kvs_last_error());
    kvs_server *s = path_server(NULL, 8u << 20, 32, tok);
    const char *too_long = "this model's maximum context length is 32 tokens; the prompt has ";
    char ids[200] = "{\"prompt\": [1";
    for (int i = 1; i < 32; i++) strcat(ids, ", 5");
    strcat(ids, "]}");
    expect_limit(s, "/v1/completions", ids, "prompt",
                 "this model's maximum context length is 32 tokens; the prompt has 32");
    char *b = repeat("{\"prompt\": \"", "ab ", 40, "\"}");
    expect_limit(s, "/v1/completions", b, "prompt", too_long);
    free(b);
    b = repeat("{\"messages\": [{\"role\": \"user\", \"content\": \"", "ab ", 40, "\"}]}");
    expect_limit(s, "/v1/chat/completions", b, "messages", too_long);
    free(b);
    b = repeat("{\"input\": \"", "ab ", 40, "\"}");
    expect_limit(s, "/v1/responses", b, "input", too_long);
    free(b);
    /* prompt + max_tokens beyond the context: the field the request used */
    expect_limit(s, "/v1/completions", "{\"prompt\": [1, 5, 5], \"max_tokens\": 30}", "max_tokens",
                 "this model's maximum context length is 32 tokens; the prompt has 3 and 30 were asked for");
    expect_limit(s, "/v1/chat/completions",
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": 31}",
                 "max_completion_tokens", too_long);
    expect_limit(s, "/v1/responses", "{\"input\": \"hi\", \"max_output_tokens\": 31}", "max_output_tokens", too_long);
    /* within the context; a default (completions: 16, chat: the rest) and Anthropic's ceiling are capped */
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, "{\"prompt\": [1, 5, 5], \"max_tokens\": 29}", 0,
                             NULL, 0), 0);
    const struct {
        const char *url, *body;
        int max_tokens;
    } capped[] = {
        {"/v1/completions", "{\"prompt\": [1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]}", 12},
        {"/v1/completions", "{\"prompt\": [1, 5, 5]}", 16},
        {"/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", -1},
        {"/v1/messages", "{\"max_tokens\": 32000, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", -1},
    };
    for (size_t i = 0; i < sizeof capped / sizeof capped[0]; i++) {
        kvs_http_answer a;
        kvs_http_prepared p;
        kvs_http_header h[3];
        int n = fields(h, NULL, NULL);
        const char *body = capped[i].body;
        bool ready = kvs_http_handle(s, "POST", capped[i].url, "HTTP/1.1", h, n, body, strlen(body), 0, &a, &p);
        cr_expect(ready, "%s: %d %s", body, a.status, a.body ? a.body : "");
        if (!ready) {
            free(a.body);
            continue;
        }
        int want = capped[i].max_tokens > 0 ? capped[i].max_tokens : 32 - p.n_ids; /* -1: the rest of the context */
        cr_expect_eq(p.max_tokens, want, "%s: %d tokens of prompt", body, p.n_ids);
        kvs_http_prepared_free(&p);
    }
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

Test(http_path, prepare_slots_bound_parsing) {
    kvs_server_config cfg = {.served_model_name = "m", .max_model_len = 64, .n_layers = 8, .max_preparing = 2};
    kvs_server *s;
    cr_assert_eq(kvs_server_create(&cfg, NULL, NULL, &s), KVS_OK);
    s->slot_wait_ms = 100;
    kvs_api_error err;
    cr_assert(kvs_http_slot_take(s, &err));
    cr_assert(kvs_http_slot_take(s, &err));
    const char *ids = "{\"prompt\": [1, 2, 3]}";
    char msg[600];
    double t0 = kvs_now();
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, ids, 0, msg, sizeof msg), 429);
    cr_expect_geq(kvs_now() - t0, 0.09, "answered before the wait");
    cr_expect(strstr(msg, "rate_limit_error") && strstr(msg, "2 requests are being parsed and tokenized"), "%s", msg);
    kvs_http_slot_give(s);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, ids, 0, NULL, 0), 0, "a slot is free");
    kvs_http_slot_give(s);
    cr_expect_eq(s->slots_used, 0);
    kvs_server_free(s);
}

static bool loopback(const char *addr) {
    struct sockaddr_storage ss = {0};
    if (strchr(addr, ':')) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        cr_assert_eq(inet_pton(AF_INET6, addr, &a->sin6_addr), 1, "%s", addr);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        cr_assert_eq(inet_pton(AF_INET, addr, &a->sin_addr), 1, "%s", addr);
    }
    return kvs_addr_is_loopback((struct sockaddr *)&ss);
}

Test(http_path, loopback_addresses) {
    cr_expect(loopback("127.0.0.1") && loopback("127.5.6.7") && loopback("::1") && loopback("::ffff:127.0.0.1"));
    cr_expect(!loopback("0.0.0.0") && !loopback("10.1.2.3") && !loopback("128.0.0.1") && !loopback("::") &&
              !loopback("::ffff:10.0.0.1") && !loopback("fe80::1"));
}

/* ---- against the real binary -------------------------------------------------- */
TestSuite(http, .timeout = 300);

static void set_recv_timeout(int fd, int seconds) {
    struct timeval tv = {seconds, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/* Reads until EOF; 1: the server closed, -1: reset, 0: the timeout passed first. */
static int wait_closed(int fd, int seconds) {
    set_recv_timeout(fd, seconds);
    char b[4096];
    for (;;) {
        ssize_t n = recv(fd, b, sizeof b, 0);
        if (n == 0) return 1;
        if (n < 0) return errno == ECONNRESET ? -1 : 0;
    }
}

/* A socket with a tiny receive buffer (set before connect): a client that stops reading stalls the server's writes soon. */
static int connect_small(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 2048;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

#define LONG_STREAM "{\"prompt\": \"Once upon a time\", \"max_tokens\": 8000, \"ignore_eos\": true, \"stream\": true}"
#define LONG_WHOLE "{\"prompt\": \"Once upon a time\", \"max_tokens\": 8000, \"ignore_eos\": true}"

Test(http, idle_connection_closed_after_http_timeout) {
    server_proc s = start_server("--http-timeout 1");
    int fd = connect_to(s.port);
    double t0 = kvs_now();
    cr_expect_eq(wait_closed(fd, 20), 1, "a connection that sent nothing was not closed");
    double idle = kvs_now() - t0;
    close(fd);
    fd = connect_to(s.port); /* half a request line, then nothing */
    send_all(fd, "POST /v1/compl", 14);
    t0 = kvs_now();
    cr_expect_eq(wait_closed(fd, 20), 1, "a connection that stalled mid-request was not closed");
    double partial = kvs_now() - t0;
    close(fd);
    fd = connect_to(s.port); /* an HTTP/1.1 keep-alive connection, idle after its answer */
    send_request_v(fd, "1.1", "GET", "/health", NULL, NULL, 0);
    t0 = kvs_now();
    cr_expect_eq(wait_closed(fd, 20), 1, "an idle keep-alive connection was not closed");
    double keepalive = kvs_now() - t0;
    close(fd);
    cr_expect_geq(keepalive, 0.9, "the keep-alive connection was closed after its answer");
    fprintf(stderr, "--http-timeout 1: closed after %.2f s (nothing sent), %.2f s (half a request), %.2f s (keep-alive)\n",
            idle, partial, keepalive);
    cr_expect_geq(idle, 0.9);
    cr_expect_geq(partial, 0.9);
    http_resp r = http(s.port, "GET", "/health", NULL, NULL);
    cr_expect_eq(r.status, 200);
    free(r.body);
    cr_expect_eq(stop_server(&s), 0);
}

Test(http, per_address_connection_limit) {
    server_proc s = start_server("--max-connections-per-ip 4");
    int held[4];
    for (int i = 0; i < 4; i++) held[i] = connect_to(s.port);
    usleep(200000);
    int fd = connect_to(s.port); /* the kernel accepts it; the server closes it at once */
    cr_expect_neq(wait_closed(fd, 10), 0, "a fifth connection from one address was kept");
    close(fd);
    for (int i = 0; i < 4; i++) {
        set_recv_timeout(held[i], 0);
        char b;
        int fl = MSG_DONTWAIT;
        cr_expect_lt(recv(held[i], &b, 1, fl), 0, "connection %d was closed", i); /* still open: no EOF */
        close(held[i]);
    }
    int status = 0;
    for (int i = 0; i < 50 && status != 200; i++) { /* their slots free once the server has seen them close */
        http_resp r = http(s.port, "GET", "/health", NULL, NULL);
        status = r.status;
        free(r.body);
        if (status != 200) usleep(100000);
    }
    cr_expect_eq(status, 200);
    cr_expect_eq(stop_server(&s), 0);
}

/* The headers of a request whose body is never sent; returns the raw answer. */
static char *head_only(int port, const char *extra_headers, int *closed) {
    int fd = connect_to(port);
    char head[512];
    int n = snprintf(head, sizeof head,
                     "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n%sContent-Length: 1000000\r\n\r\n",
                     extra_headers);
    send_all(fd, head, (size_t)n);
    set_recv_timeout(fd, 20);
    size_t len = 0, cap = 8192;
    char *buf = calloc(1, cap);
    ssize_t got;
    while ((got = recv(fd, buf + len, cap - len - 1, 0)) > 0) len += (size_t)got;
    *closed = got == 0 || (got < 0 && errno == ECONNRESET);
    close(fd);
    return buf;
}

Test(http, early_401_and_413_close_without_reading_the_body) {
    server_proc s = start_server("--api-key k --max-body-bytes 4096");
    int closed;
    char *a = head_only(s.port, "", &closed);
    cr_expect(!strncmp(a, "HTTP/1.1 401", 12), "%s", a);
    cr_expect(closed, "401: the server waited for the body");
    cr_expect(strstr(a, "Connection: close"), "%s", a);
    free(a);
    a = head_only(s.port, "Authorization: Bearer k\r\n", &closed);
    cr_expect(!strncmp(a, "HTTP/1.1 413", 12), "%s", a);
    cr_expect(closed, "413: the server waited for the body");
    free(a);
    /* a chunked body that passes the limit: the connection is closed, the rest is not read */
    int fd = connect_to(s.port);
    const char *h = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer k\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n";
    send_all(fd, h, strlen(h));
    char chunk[1100];
    int n = snprintf(chunk, sizeof chunk, "400\r\n");
    memset(chunk + n, 'x', 1024);
    memcpy(chunk + n + 1024, "\r\n", 2);
    for (int i = 0; i < 6; i++) send_all(fd, chunk, (size_t)n + 1026); /* 6 KiB */
    cr_expect_neq(wait_closed(fd, 20), 0, "a chunked body past the limit kept the connection open");
    close(fd);
    http_resp r = http(s.port, "POST", "/v1/completions", "Authorization: Bearer k\r\n",
                       "{\"prompt\": \"hi\", \"max_tokens\": 2}");
    cr_expect_eq(r.status, 200, "%s", r.body);
    free(r.body);
    cr_expect_eq(stop_server(&s), 0);
}

/* A client that sent bytes after its request, then closed: its request is aborted. */
static void extra_bytes_then_close(int port, const char *version, const char *body) {
    int fd = connect_to(port);
    send_request_v(fd, version, "POST", "/v1/completions", NULL, body, strlen(body));
    send_all(fd, "EXTRA BYTES", 11);
    cr_assert(wait_running(port, 1), "the request never ran");
    usleep(300000);
    close(fd);
    expect_no_blocks(port); /* aborted: 8,000 tokens would take minutes here */
}

Test(http, disconnect_after_extra_bytes_is_seen) {
    server_proc s = start_server(NULL);
    double t0 = kvs_now();
    extra_bytes_then_close(s.port, "1.0", LONG_STREAM);
    double t_stream = kvs_now() - t0;
    t0 = kvs_now();
    extra_bytes_then_close(s.port, "1.1", LONG_WHOLE);
    fprintf(stderr, "extra bytes, then close: aborted and freed in %.2f s (stream), %.2f s (non-streaming)\n", t_stream,
            kvs_now() - t0);
    cr_expect_eq(stop_server(&s), 0);
}

/* The server, not the client, is slow (a queue): a request that runs for
 * seconds first. arg: {port, its status (out), max_tokens}. */
static void *whole_request(void *arg) {
    int *a = arg;
    char body[160];
    snprintf(body, sizeof body, "{\"prompt\": \"Once upon a time\", \"max_tokens\": %d, \"ignore_eos\": true}", a[2]);
    http_resp r = http(a[0], "POST", "/v1/completions", NULL, body);
    a[1] = r.status;
    free(r.body);
    return NULL;
}

/* shutdown(SHUT_WR) after the request, which then waits in the queue (the
 * server looks at its socket meanwhile) and runs: the answer comes, whole. */
static void half_close(int port, const char *version, bool stream) {
    /* 300 tokens: long enough to be seen running (polled every 50 ms) on a machine
       that decodes 400 tokens/s (40 were over in under 50 ms on 2026-12-02) */
    int arg[3] = {port, 0, 300};
    pthread_t th;
    pthread_create(&th, NULL, whole_request, arg);
    cr_assert(wait_running(port, 1));
    char body[256];
    snprintf(body, sizeof body,
             "{\"prompt\": \"Once upon a time\", \"max_tokens\": 24, \"ignore_eos\": true, \"temperature\": 0%s}",
             stream ? ", \"stream\": true, \"stream_options\": {\"include_usage\": true}" : "");
    int fd = connect_to(port);
    send_request_v(fd, version, "POST", "/v1/completions", NULL, body, strlen(body));
    shutdown(fd, SHUT_WR);
    set_recv_timeout(fd, 120);
    http_resp r = read_response(fd);
    close(fd);
    pthread_join(th, NULL);
    cr_expect_eq(arg[1], 200);
    cr_expect_eq(r.status, 200, "HTTP/%s%s: %d %s", version, stream ? " stream" : "", r.status, r.body);
    cr_expect_leq(r.interim, 1);
    if (stream) {
        stream_result sr;
        parse_stream(r.body, false, &sr);
        cr_expect(sr.done && sr.usage && sr.completion_tokens == 24, "half-closed stream cut: %s", r.body);
    } else {
        json_t *j = json_loads(r.body, 0, NULL);
        cr_expect_eq(usage_of(j, "completion_tokens"), 24, "%s", r.body);
        json_decref(j);
    }
    free(r.body);
}

Test(http, half_close_is_not_a_disconnect) {
    server_proc s = start_server("--max-num-seqs 1");
    half_close(s.port, "1.1", false); /* probed with a 100 Continue, which it must accept */
    half_close(s.port, "1.0", false);
    half_close(s.port, "1.0", true);  /* probed with an SSE comment */
    cr_expect_eq(stop_server(&s), 0);
}

Test(http, client_that_stops_reading_is_cut_by_http_timeout) {
    server_proc s = start_server("--http-timeout 2");
    int fd = connect_small(s.port);
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a long story\"}], \"max_tokens\": 8000, "
                       "\"ignore_eos\": true, \"stream\": true, \"logprobs\": true, \"top_logprobs\": 1}";
    send_request(fd, "POST", "/v1/chat/completions", NULL, body, strlen(body));
    cr_assert(wait_running(s.port, 1));
    double t0 = kvs_now(), running = 1;
    /* its writes fill both socket buffers, then make no progress for 2 s: the server closes it */
    while (running > 0 && kvs_now() - t0 < 120) {
        metrics_value(s.port, "kvsparse_num_requests_running{", &running);
        if (running > 0) usleep(200000);
    }
    fprintf(stderr, "a client that never reads: its request ended %.1f s after it started\n", kvs_now() - t0);
    cr_expect_eq(running, 0, "the server kept writing to a client that never reads");
    expect_no_blocks(s.port);
    close(fd);
    cr_expect_eq(stop_server(&s), 0);
}

Test(http, stream_waiting_longer_than_http_timeout_is_kept) {
    server_proc s = start_server("--http-timeout 1 --max-num-seqs 1");
    int arg[3] = {s.port, 0, 100};
    pthread_t th;
    pthread_create(&th, NULL, whole_request, arg); /* runs for seconds, longer than the timeout: the stream waits */
    cr_assert(wait_running(s.port, 1));
    double t0 = kvs_now();
    http_resp r = http(s.port, "POST", "/v1/completions", NULL,
                       "{\"prompt\": \"Queued\", \"max_tokens\": 4, \"ignore_eos\": true, \"stream\": true}");
    double waited = kvs_now() - t0;
    pthread_join(th, NULL);
    stream_result sr;
    parse_stream(r.body, false, &sr);
    fprintf(stderr, "a queued stream waited %.1f s (--http-timeout 1) and %s\n", waited, sr.done ? "completed" : "was cut");
    cr_expect(sr.done, "the queued stream was cut: %s", r.body);
    cr_expect_eq(arg[1], 200, "the long non-streaming request");
    free(r.body);
    cr_expect_eq(stop_server(&s), 0);
}

/* A stream read to its end (with its finish reason). */
typedef struct {
    int port;
    stream_result sr;
} stream_job_result;

static void *reading_stream(void *arg) {
    stream_job_result *res = arg;
    http_resp r = http(res->port, "POST", "/v1/completions", NULL, LONG_STREAM);
    if (r.status == 200) parse_stream(r.body, false, &res->sr);
    free(r.body);
    return NULL;
}

Test(http, sigterm_with_a_client_that_never_reads_exits_within_drain_timeout) {
    server_proc s = start_server("--drain-timeout 2");
    int stuck = connect_small(s.port);
    send_request(stuck, "POST", "/v1/completions", NULL, LONG_STREAM, strlen(LONG_STREAM));
    stream_job_result reader = {.port = s.port};
    pthread_t th;
    pthread_create(&th, NULL, reading_stream, &reader);
    cr_assert(wait_running(s.port, 2));
    int status = 0;
    double took;
    bool exited = term_and_wait(s.pid, 30, &status, &took);
    pthread_join(th, NULL);
    close(stuck);
    fprintf(stderr, "SIGTERM with --drain-timeout 2: exited after %.1f s\n", took);
    cr_expect(exited && WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit status %d", status);
    cr_expect_lt(took, 2 + 5, "the drain took %.1f s", took);
    cr_expect(reader.sr.done, "the reading client's stream did not end with [DONE]");
    cr_expect_str_eq(reader.sr.finish, "abort");
}

/* ---- where the API key comes from --------------------------------------------- */
static int status_with_key(int port, const char *key) {
    char h[128] = "";
    if (key) snprintf(h, sizeof h, "Authorization: Bearer %s\r\n", key);
    http_resp r = http(port, "GET", "/v1/models", key ? h : NULL, NULL);
    free(r.body);
    return r.status;
}

static int serve_fails(const char *args, const char *env, char **out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s '%s' serve -m '%s' --port 0 %s", env ? env : "", kvsparse_binary(),
             src_path("models/tiny-needle-llama"), args);
    return run_capture(cmd, out);
}

Test(http, api_key_from_file_or_environment) {
    const char *dir = make_temp_dir();
    write_file(dir, "key", "  from-file\n", 12);
    write_file(dir, "empty", " \n", 2);
    char opt[1024];
    snprintf(opt, sizeof opt, "--api-key-file %s/key", dir);
    server_proc s = start_server(opt);
    cr_expect_eq(status_with_key(s.port, NULL), 401);
    cr_expect_eq(status_with_key(s.port, "from-file"), 200);
    cr_expect_eq(stop_server(&s), 0);
    s = start_server_env(NULL, "KVSPARSE_API_KEY=from-env");
    cr_expect_eq(status_with_key(s.port, NULL), 401);
    cr_expect_eq(status_with_key(s.port, "from-env"), 200);
    cr_expect_eq(stop_server(&s), 0);
    /* precedence: --api-key, then --api-key-file, then the environment */
    s = start_server_env(opt, "KVSPARSE_API_KEY=from-env");
    cr_expect_eq(status_with_key(s.port, "from-env"), 401);
    cr_expect_eq(status_with_key(s.port, "from-file"), 200);
    cr_expect_eq(stop_server(&s), 0);
    char both[1100];
    snprintf(both, sizeof both, "--api-key from-line %s", opt);
    s = start_server_env(both, "KVSPARSE_API_KEY=from-env");
    cr_expect_eq(status_with_key(s.port, "from-file"), 401);
    cr_expect_eq(status_with_key(s.port, "from-line"), 200);
    cr_expect_eq(stop_server(&s), 0);
    /* a missing, empty or unreadable key file, or an empty variable: a clear error at start */
    char *out = NULL, args[1024];
    snprintf(args, sizeof args, "--api-key-file %s/missing", dir);
    cr_expect_neq(serve_fails(args, NULL, &out), 0);
    cr_expect(strstr(out, "missing") && strstr(out, "No such file"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "--api-key-file %s/empty", dir);
    cr_expect_neq(serve_fails(args, NULL, &out), 0);
    cr_expect(strstr(out, "is empty"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "--api-key-file %s", dir); /* a folder */
    cr_expect_neq(serve_fails(args, NULL, &out), 0);
    cr_expect(strstr(out, "--api-key-file"), "%s", out);
    free(out);
    cr_expect_neq(serve_fails("", "KVSPARSE_API_KEY=", &out), 0);
    cr_expect(strstr(out, "KVSPARSE_API_KEY") && strstr(out, "empty"), "%s", out);
    free(out);
}

/* Numbers are read as written: a logit_bias key is a token id in plain
 * decimal, a KV budget string a plain decimal (or percentage), kv_policy.window
 * has one bound; null leaves repetition_penalty and min_tokens unset; errors
 * name the field. */
Test(http_path, numeric_fields_are_parsed_strictly) {
    kvs_server *s = path_server(NULL, 8192, 64, NULL);
    char msg[600], body[300];
    static const char *const bad_keys[] = {" 5", "05", "+5", "5 ", "0x5", "-0", "", "5e0"};
    for (size_t i = 0; i < sizeof bad_keys / sizeof *bad_keys; i++) {
        snprintf(body, sizeof body, "{\"prompt\": [1, 2], \"max_tokens\": 4, \"logit_bias\": {\"%s\": 1}}", bad_keys[i]);
        cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, body, 0, msg, sizeof msg), 400, "'%s'", bad_keys[i]);
        cr_expect(strstr(msg, "\"param\":\"logit_bias\""), "'%s': %s", bad_keys[i], msg);
    }
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL,
                             "{\"prompt\": [1, 2], \"max_tokens\": 4, \"logit_bias\": {\"0\": 1, \"57\": -1}}", 0, msg,
                             sizeof msg), 0, "%s", msg);
    static const char *const bad_budgets[] = {"0x10", " 10%", "10% ", "1e1", "+5", "inf", "nan", "10%%", "%", "."};
    for (size_t i = 0; i < sizeof bad_budgets / sizeof *bad_budgets; i++) {
        snprintf(body, sizeof body, "{\"prompt\": [1, 2], \"kv_policy\": {\"budget\": \"%s\"}}", bad_budgets[i]);
        cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, body, 0, msg, sizeof msg), 400, "'%s'",
                     bad_budgets[i]);
        cr_expect(strstr(msg, "\"param\":\"kv_policy.budget\""), "'%s': %s", bad_budgets[i], msg);
    }
    static const char *const budgets[] = {"10%", "0.1", "256", ".5", "12.5%"};
    for (size_t i = 0; i < sizeof budgets / sizeof *budgets; i++) {
        snprintf(body, sizeof body, "{\"prompt\": [1, 2], \"kv_policy\": {\"budget\": \"%s\"}}", budgets[i]);
        cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, body, 0, msg, sizeof msg), 0, "'%s': %s",
                     budgets[i], msg);
    }
    static const int windows[] = {513, 600, 70000};
    for (size_t i = 0; i < sizeof windows / sizeof *windows; i++) {
        snprintf(body, sizeof body, "{\"prompt\": [1, 2], \"kv_policy\": {\"window\": %d}}", windows[i]);
        cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL, body, 0, msg, sizeof msg), 400);
        cr_expect(strstr(msg, "'kv_policy.window' must be in [1, 512]") && strstr(msg, "\"param\":\"kv_policy.window\""),
                  "window %d: %s", windows[i], msg);
    }
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL,
                             "{\"prompt\": [1, 2], \"max_tokens\": 4, \"repetition_penalty\": null, \"min_tokens\": null}",
                             0, msg, sizeof msg), 0, "null as unset: %s", msg);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL,
                             "{\"prompt\": [1, 2], \"max_tokens\": 4, \"min_tokens\": 5}", 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "\"param\":\"min_tokens\""), "%s", msg);
    cr_expect_eq(path_status(s, "POST", "/v1/completions", NULL, NULL,
                             "{\"prompt\": [1, 2], \"repetition_penalty\": 0}", 0, msg, sizeof msg), 400);
    cr_expect(strstr(msg, "\"param\":\"repetition_penalty\""), "%s", msg);
    kvs_server_free(s);
}
