/* server: hostile clients at the connection level, against the real binary
 * over loopback (127.0.0.0/8 only): slow headers from many addresses while a
 * well-behaved client measures its latency (threads, memory, the header
 * deadline), the fair share of pending connections per address, a body below
 * the minimum rate, idle connections costing no thread, and the framing and
 * header-field cases a proxy could read differently (each refused with one
 * answer and the connection closed).
 *
 * The slow-headers attack lasts KVS_HOSTILE_SECONDS (default 6, with a 2 s
 * header deadline so that it passes several); scripts/hostile-attack runs it
 * for 60 s against the default deadlines. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostile_client.h"
#include "testutil.h"

TestSuite(hostile, .timeout = 400);

static double env_seconds(const char *name, double dflt) {
    const char *v = getenv(name);
    return v && atof(v) > 0 ? atof(v) : dflt;
}

static double metric_of(int port, const char *name) {
    double v = 0;
    metrics_value(port, name, &v);
    return v;
}

/* A well-behaved client: GET /health and a short completion from 127.0.0.1,
 * n of each; latencies (seconds) into h[] and c[]; how many failed. */
static int good_client(int port, int n, double *h, double *c) {
    int failed = 0;
    for (int i = 0; i < n; i++) {
        double t0 = kvs_now();
        http_resp r = http(port, "GET", "/health", NULL, NULL);
        h[i] = kvs_now() - t0;
        failed += r.status != 200;
        free(r.body);
        t0 = kvs_now();
        r = http(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Hello\", \"max_tokens\": 4, \"temperature\": 0}");
        c[i] = kvs_now() - t0;
        failed += r.status != 200;
        free(r.body);
    }
    return failed;
}

/* 1,024 connections from 8 addresses send a request line and then a header
 * byte a second. The well-behaved client's requests all succeed and its P99
 * stays within 2x of the unloaded one (plus 50 ms of scheduling noise on a
 * shared 2-core machine); the server's threads stay those of its pools (not
 * one per connection), its memory grows by kilobytes a connection, and the
 * attacker's connections are closed by the header deadline. */
Test(hostile, slow_headers_from_many_addresses) {
    double seconds = env_seconds("KVS_HOSTILE_SECONDS", 6);
    const char *deadline = getenv("KVS_HOSTILE_SECONDS") ? "" : "--header-timeout 2";
    uint64_t seed = kvs_test_seed();
    fprintf(stderr, "hostile::slow_headers_from_many_addresses: seed %llu (KVS_TEST_SEED), %.0f s\n",
            (unsigned long long)seed, seconds);
    server_proc s = start_server(deadline);
    enum { N = 60, MAX = 2000 };
    double h0[N], c0[N];
    double *h1 = calloc(MAX, sizeof *h1), *c1 = calloc(MAX, sizeof *c1);
    cr_assert_eq(good_client(s.port, N, h0, c0), 0, "the unloaded client failed");
    long threads0 = proc_status(s.pid, "Threads:"), rss0 = proc_status(s.pid, "VmRSS:");
    slowloris a = {.port = s.port, .n_conns = (int)env_seconds("KVS_HOSTILE_CONNS", 1024), .n_addrs = 8, .first_host = 2,
                   .seconds = seconds,
                   .byte_every = 1.0, .seed = seed};
    pthread_t th;
    double t_end = kvs_now() + seconds;
    pthread_create(&th, NULL, slowloris_run, &a);
    usleep(1500000); /* the attack in place */
    long threads = 0, rss = 0;
    int n = 0, failed = 0;
    while (kvs_now() < t_end - 0.3 && n < MAX) { /* a request pair every 100 ms or so, for the whole attack */
        failed += good_client(s.port, 1, &h1[n], &c1[n]);
        n++;
        long t = proc_status(s.pid, "Threads:"), m = proc_status(s.pid, "VmRSS:");
        if (t > threads) threads = t;
        if (m > rss) rss = m;
        usleep(50000);
    }
    pthread_join(th, NULL);
    double header_timeouts = metric_of(s.port, "kvsparse_http_connections_closed_total{model_name=\"tiny-needle-llama\",reason=\"header_timeout\"}");
    double refused = metric_of(s.port, "kvsparse_http_connections_closed_total{model_name=\"tiny-needle-llama\",reason=\"refused\"}");
    double h0m = percentile(h0, N, 50), c0m = percentile(c0, N, 50), h1m = percentile(h1, n, 50), c1m = percentile(c1, n, 50);
    double h0p = percentile(h0, N, 99), c0p = percentile(c0, N, 99), h1p = percentile(h1, n, 99), c1p = percentile(c1, n, 99);
    fprintf(stderr,
            "slow headers, %d connections from %d addresses for %.0f s (%ld connects, %ld closed by the server, "
            "at most %ld open at once; server: %.0f header timeouts, %.0f refused at accept):\n"
            "  client P50 / P99 unloaded (%d each): health %.2f / %.2f ms, completion %.2f / %.2f ms\n"
            "  under attack (%d each, %d failed): health %.2f / %.2f ms (P99 %.2fx), completion %.2f / %.2f ms (P99 %.2fx)\n"
            "  server threads %ld -> %ld, RSS %.1f -> %.1f MB\n",
            a.n_conns, a.n_addrs, seconds, a.connects, a.closed_by_server, a.max_open, header_timeouts, refused, N,
            h0m * 1e3, h0p * 1e3, c0m * 1e3, c0p * 1e3, n, failed, h1m * 1e3, h1p * 1e3, h1p / h0p, c1m * 1e3,
            c1p * 1e3, c1p / c0p, threads0, threads,
            rss0 / 1024.0, rss / 1024.0);
    cr_expect_eq(failed, 0, "%d of the well-behaved client's requests failed under attack", failed);
    cr_expect_leq(h1p, 2 * h0p + 0.05 * SLOWDOWN, "health P99 %.1f ms vs %.1f ms unloaded", h1p * 1e3, h0p * 1e3);
    cr_expect_leq(c1p, 2 * c0p + 0.05 * SLOWDOWN, "completion P99 %.1f ms vs %.1f ms unloaded", c1p * 1e3, c0p * 1e3);
    cr_expect_lt(threads, threads0 + 8, "threads grew from %ld to %ld: a thread per connection?", threads0, threads);
#if !defined(__SANITIZE_ADDRESS__)
    cr_expect_lt(rss - rss0, 100 * 1024, "RSS grew by %ld kB", rss - rss0);
#endif
    cr_expect_gt(header_timeouts, 0, "no attacker connection was closed by the header deadline");
    cr_expect_gt(a.closed_by_server, 0);
    free(h1), free(c1);
    cr_expect_eq(stop_server(&s), 0);
}

/* Whether the server closed fd (EOF or reset) within ms. */
static bool closed_within(int fd, int ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return fd < 0 || (poll(&p, 1, ms) > 0 && recv(fd, &(char){0}, 1, MSG_DONTWAIT) <= 0);
}

/* --max-pending-connections 8, all held by 127.0.0.2: a newcomer from
 * another address displaces its oldest; one more from it (at its share) is
 * refused; one from a third address displaces another of its. */
Test(hostile, pending_connections_fair_share) {
    server_proc s = start_server("--max-pending-connections 8 --header-timeout 60");
    int busy[8];
    for (int i = 0; i < 8; i++) cr_assert_geq(busy[i] = connect_from(2, s.port), 0);
    usleep(300000);
    int other = connect_from(3, s.port);
    cr_expect(!closed_within(other, 500), "the newcomer from another address was refused");
    int displaced = 0;
    for (int i = 0; i < 8; i++) displaced += closed_within(busy[i], 0);
    cr_expect_eq(displaced, 1, "%d of the busy address's connections were displaced (1 expected)", displaced);
    cr_expect(closed_within(busy[0], 0), "the busy address's oldest connection was not the one displaced");
    int more = connect_from(2, s.port); /* 7 held, its share 4: refused */
    cr_expect(closed_within(more, 1000), "a connection over the busy address's share was kept");
    int third = connect_from(4, s.port);
    cr_expect(!closed_within(third, 500), "the newcomer from a third address was refused");
    displaced = 0;
    for (int i = 0; i < 8; i++) displaced += closed_within(busy[i], 0);
    cr_expect_eq(displaced, 2, "%d displaced after the third address came (2 expected)", displaced);
    cr_expect(!closed_within(other, 0), "the second address's only connection was displaced");
    send_all(other, "GET /health HTTP/1.0\r\n\r\n", 24);
    http_resp r = read_response(other);
    cr_expect_eq(r.status, 200);
    free(r.body);
    for (int i = 0; i < 8; i++) close(busy[i]);
    close(other), close(third);
    if (more >= 0) close(more);
    double d = metric_of(s.port, "kvsparse_http_connections_closed_total{model_name=\"tiny-needle-llama\",reason=\"displaced\"}");
    cr_expect_eq(d, 2);
    cr_expect_eq(stop_server(&s), 0);
}

/* A body sent at 20 bytes a second against --body-timeout 1 --body-min-rate
 * 1000 is cut within about a second; one sent at once is served. */
Test(hostile, slow_body_is_cut_at_the_minimum_rate) {
    server_proc s = start_server("--body-timeout 1 --body-min-rate 1000");
    int fd = connect_to(s.port);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n";
    send_all(fd, head, strlen(head));
    double t0 = kvs_now();
    bool cut = false;
    for (int i = 0; i < 400 && !cut; i++) {
        cut = send(fd, " ", 1, MSG_NOSIGNAL) != 1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        cut |= poll(&p, 1, 50) > 0 && recv(fd, &(char){0}, 1, MSG_DONTWAIT) <= 0;
    }
    double took = kvs_now() - t0;
    close(fd);
    fprintf(stderr, "a body at 20 bytes/s: cut after %.2f s (--body-timeout 1, --body-min-rate 1000)\n", took);
    cr_expect(cut, "the slow body was never cut");
    cr_expect_lt(took, 5 * SLOWDOWN, "cut after %.1f s", took);
    http_resp r = http(s.port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Hi\", \"max_tokens\": 2}");
    cr_expect_eq(r.status, 200, "%s", r.body);
    free(r.body);
    cr_expect_eq(stop_server(&s), 0);
}

/* 200 open connections (idle, or half a request line) add no thread. */
Test(hostile, idle_connections_cost_no_thread) {
    server_proc s = start_server("--max-connections-per-ip 1024");
    long t0 = proc_status(s.pid, "Threads:"), m0 = proc_status(s.pid, "VmRSS:");
    int fd[200];
    for (int i = 0; i < 200; i++) {
        fd[i] = connect_from(2 + i % 4, s.port);
        if (i % 2 && fd[i] >= 0) send_all(fd[i], "GET /hea", 8);
    }
    usleep(500000);
    long t1 = proc_status(s.pid, "Threads:"), m1 = proc_status(s.pid, "VmRSS:");
    fprintf(stderr, "200 idle connections: threads %ld -> %ld, RSS +%ld kB (%.1f kB each)\n", t0, t1, m1 - m0,
            (m1 - m0) / 200.0);
    cr_expect_eq(t1, t0, "threads grew from %ld to %ld", t0, t1);
    for (int i = 0; i < 200; i++)
        if (fd[i] >= 0) close(fd[i]);
    cr_expect_eq(stop_server(&s), 0);
}

/* ---- framing -------------------------------------------------------------------------- */
typedef struct {
    char *data;
    size_t len;
    int responses; /* status lines at the start of a response */
    bool closed;
} raw_result;

/* Sends a raw request, reads until the server closes (or 5 s pass). */
static raw_result raw_exchange(int port, const char *req, size_t len) {
    raw_result r = {calloc(1, 1 << 16), 0, 0, false};
    int fd = connect_to(port);
    send_all(fd, req, len);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n;
    while ((n = recv(fd, r.data + r.len, (1 << 16) - r.len - 1, 0)) > 0) r.len += (size_t)n;
    r.closed = n == 0 || (n < 0 && errno == ECONNRESET);
    close(fd);
    /* a status line begins the data or follows a header block's blank line */
    for (const char *p = r.data; p && *p; p = strstr(p, "\r\n\r\n")) {
        if (p != r.data) p += 4;
        r.responses += !strncmp(p, "HTTP/1.", 7);
        if (p == r.data) p++;
    }
    return r;
}

static int status_of(const raw_result *r) {
    int st = 0;
    sscanf(r->data, "HTTP/%*s %d", &st);
    return st;
}

#define BODY "{\"prompt\": \"hi\", \"max_tokens\": 2}"
#define POST_HEAD "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"

/* Each case answered once, with its status, and the connection closed (the
 * framing of what follows cannot be trusted); none reaches the engine. */
Test(hostile, framing_refused_once_and_closed) {
    server_proc s = start_server("--api-key k");
    static const struct {
        const char *name, *req;
        int status;
    } cases[] = {
        {"two different Content-Length", POST_HEAD "Authorization: Bearer k\r\nContent-Length: 33\r\nContent-Length: 5\r\n\r\n" BODY, 400},
        {"two equal Content-Length", POST_HEAD "Authorization: Bearer k\r\nContent-Length: 33\r\nContent-Length: 33\r\n\r\n" BODY, 400},
        {"Content-Length and Transfer-Encoding", POST_HEAD "Authorization: Bearer k\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n21\r\n" BODY "\r\n0\r\n\r\n", 400},
        {"an unknown transfer coding", POST_HEAD "Authorization: Bearer k\r\nTransfer-Encoding: gzip\r\n\r\n" BODY, 501},
        {"gzip then chunked", POST_HEAD "Authorization: Bearer k\r\nTransfer-Encoding: gzip, chunked\r\n\r\n21\r\n" BODY "\r\n0\r\n\r\n", 501},
        {"chunked twice", POST_HEAD "Authorization: Bearer k\r\nTransfer-Encoding: chunked, chunked\r\n\r\n21\r\n" BODY "\r\n0\r\n\r\n", 400},
        {"Transfer-Encoding in HTTP/1.0", "POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer k\r\nTransfer-Encoding: chunked\r\n\r\n21\r\n" BODY "\r\n0\r\n\r\n", 400},
        {"HTTP/1.1 without Host", "GET /health HTTP/1.1\r\n\r\n", 400},
        {"two Host fields", "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
        {"a NUL inside Authorization", "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\0junk\r\n\r\n", 400},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t len = strlen(cases[i].req);
        if (strstr(cases[i].name, "NUL")) len = strlen(cases[i].req) + 1 + strlen(cases[i].req + strlen(cases[i].req) + 1);
        raw_result r = raw_exchange(s.port, cases[i].req, len);
        cr_expect_eq(status_of(&r), cases[i].status, "%s: %.200s", cases[i].name, r.data);
        cr_expect_eq(r.responses, 1, "%s: %d responses: %.400s", cases[i].name, r.responses, r.data);
        cr_expect(r.closed, "%s: the connection was kept", cases[i].name);
        cr_expect(strstr(r.data, "Connection: close"), "%s: no Connection: close", cases[i].name);
        free(r.data);
    }
    /* a Content-Length that is not a decimal number: libmicrohttpd answers
       before the server sees the request (see docs/SERVING.md) */
    static const char *const lengths[] = {"-1", "abc", "+33", "18446744073709551616", "33, 33"};
    for (size_t i = 0; i < sizeof lengths / sizeof *lengths; i++) {
        char req[512];
        int n = snprintf(req, sizeof req, POST_HEAD "Authorization: Bearer k\r\nContent-Length: %s\r\n\r\n" BODY, lengths[i]);
        raw_result r = raw_exchange(s.port, req, (size_t)n);
        int st = status_of(&r);
        fprintf(stderr, "Content-Length: %s -> %d, %d status line(s), %s\n", lengths[i], st, r.responses,
                r.closed ? "closed" : "kept open");
        cr_expect(st == 400 || st == 413, "Content-Length %s: %.200s", lengths[i], r.data);
        cr_expect(r.closed, "Content-Length %s: the connection was kept", lengths[i]);
        free(r.data);
    }
    double requests = metric_of(s.port, "kvsparse_prompt_tokens_total{");
    cr_expect_eq(requests, 0, "a refused request reached the engine");
    cr_expect_eq(stop_server(&s), 0);
}

/* What a conforming client may send: the absolute form, HEAD, the Bearer
 * scheme in any case; and what must not pass: a target with %00. */
Test(hostile, header_fields_conformance) {
    server_proc s = start_server("--api-key k");
    const char *absolute = "GET http://localhost/health HTTP/1.0\r\n\r\n";
    raw_result r = raw_exchange(s.port, absolute, strlen(absolute));
    cr_expect_eq(status_of(&r), 200, "absolute form: %s", r.data);
    free(r.data);
    r = raw_exchange(s.port, "HEAD /health HTTP/1.0\r\n\r\n", 25);
    cr_expect_eq(status_of(&r), 200, "HEAD: %s", r.data);
    cr_expect(!strstr(r.data, "{\"status\""), "HEAD answered with a body: %s", r.data);
    free(r.data);
    const char *bearer = "GET /v1/models HTTP/1.0\r\nAuthorization: bearer k\r\n\r\n";
    r = raw_exchange(s.port, bearer, strlen(bearer));
    cr_expect_eq(status_of(&r), 200, "lower-case bearer: %s", r.data);
    free(r.data);
    r = raw_exchange(s.port, "GET /health%00x HTTP/1.0\r\n\r\n", 28);
    cr_expect_eq(status_of(&r), 404, "/health%%00x: %s", r.data);
    free(r.data);
    r = raw_exchange(s.port, "PUT /health HTTP/1.0\r\n\r\n", 24);
    cr_expect_eq(status_of(&r), 405);
    cr_expect(strstr(r.data, "Allow: GET, HEAD"), "%s", r.data);
    free(r.data);
    cr_expect_eq(stop_server(&s), 0);
}
