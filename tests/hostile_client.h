/* Hostile clients for the server tests (test_server_hostile.c,
 * test_server_schemas.c): connections from chosen loopback addresses
 * (127.0.0.0/8 only), a slow-headers attacker that holds many of them, the
 * server process's threads and memory, latency percentiles, and a stream
 * whose inter-token gaps are timed. */
#ifndef KVS_TEST_HOSTILE_CLIENT_H
#define KVS_TEST_HOSTILE_CLIENT_H

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>

#include "server_client.h"

/* A connection from 127.0.0.<host> (host in 1..254); -1 when refused. */
static inline int connect_from(int host, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | (uint32_t)host)};
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&me, sizeof me) != 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* "Threads:" or "VmRSS:" (kB) of a process; -1 when unknown. */
static inline long proc_status(pid_t pid, const char *field) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n)) v = atol(line + n);
    if (f) fclose(f);
    return v;
}

static inline int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The p-th percentile (0..100) of v[0..n) (sorted in place). */
static inline double percentile(double *v, int n, double p) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)(p / 100 * (n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* ---- slow headers: many connections, each a request line, then a header byte now and then ---- */
typedef struct {
    int port, n_conns, n_addrs, first_host; /* addresses 127.0.0.first_host .. + n_addrs - 1 */
    double seconds, byte_every;             /* how long; a byte per connection this often */
    uint64_t seed;
    /* results */
    long connects, closed_by_server, max_open;
    atomic_bool stop;
} slowloris;

static inline void *slowloris_run(void *arg) {
    slowloris *a = arg;
    int *fd = malloc(sizeof(int) * (size_t)a->n_conns);
    double *next = malloc(sizeof(double) * (size_t)a->n_conns);
    struct pollfd *pf = malloc(sizeof(struct pollfd) * (size_t)a->n_conns);
    kvs_rng rng;
    kvs_rng_seed(&rng, a->seed);
    double t0 = kvs_now();
    for (int i = 0; i < a->n_conns; i++) fd[i] = -1, next[i] = t0 + a->byte_every * (double)(kvs_rng_u64(&rng) % 1000) / 1000;
    while (!atomic_load(&a->stop) && kvs_now() - t0 < a->seconds) {
        double now = kvs_now();
        long open = 0;
        for (int i = 0; i < a->n_conns; i++) {
            if (now < next[i]) {
                open += fd[i] >= 0;
                continue;
            }
            /* jittered, so the connections do not act in lockstep */
            next[i] = now + a->byte_every * (0.5 + (double)(kvs_rng_u64(&rng) % 1000) / 1000);
            if (fd[i] < 0) {
                fd[i] = connect_from(a->first_host + i % a->n_addrs, a->port);
                if (fd[i] < 0) continue;
                a->connects++;
                fcntl(fd[i], F_SETFL, O_NONBLOCK);
                send(fd[i], "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", 39, MSG_NOSIGNAL);
            } else if (send(fd[i], "x", 1, MSG_NOSIGNAL) != 1 && errno != EAGAIN) {
                close(fd[i]);
                fd[i] = -1;
                a->closed_by_server++;
                continue;
            }
            open++;
        }
        if (open > a->max_open) a->max_open = open;
        /* the server's closes: a connection it shut reads as EOF or a reset; reconnect later */
        int n = 0;
        for (int i = 0; i < a->n_conns; i++)
            if (fd[i] >= 0) pf[n++] = (struct pollfd){.fd = fd[i], .events = POLLIN};
        if (n && poll(pf, (nfds_t)n, 0) > 0)
            for (int k = 0; k < n; k++) {
                if (!pf[k].revents) continue;
                char b[256];
                if (recv(pf[k].fd, b, sizeof b, MSG_DONTWAIT) > 0) continue; /* an answer: not expected */
                for (int i = 0; i < a->n_conns; i++)
                    if (fd[i] == pf[k].fd) {
                        close(fd[i]);
                        fd[i] = -1;
                        a->closed_by_server++;
                    }
            }
        usleep(20000);
    }
    for (int i = 0; i < a->n_conns; i++)
        if (fd[i] >= 0) close(fd[i]);
    free(fd), free(next), free(pf);
    return NULL;
}

/* ---- a stream's inter-token gaps ------------------------------------------------------- */
typedef struct {
    int port;
    const char *body;
    /* results */
    double max_gap, t_first, t_last;
    int events;
    bool done;
} timed_stream;

/* Reads an SSE stream event by event, timing the gaps between events after the first. */
static inline void *timed_stream_run(void *arg) {
    timed_stream *t = arg;
    int fd = connect_to(t->port);
    if (fd < 0) return NULL;
    send_request(fd, "POST", "/v1/completions", NULL, t->body, strlen(t->body));
    char buf[65536];
    size_t have = 0;
    double last = 0;
    for (;;) {
        ssize_t n = recv(fd, buf + have, sizeof buf - have - 1, 0);
        if (n <= 0) break;
        double now = kvs_now();
        have += (size_t)n;
        buf[have] = 0;
        char *p = buf, *e;
        while ((e = strstr(p, "\n\n"))) { /* every complete event */
            if (!strncmp(p, "data: ", 6) || strstr(p, "\r\n\r\ndata: ")) {
                if (strstr(p, "[DONE]") && strstr(p, "[DONE]") < e) t->done = true;
                if (t->events++ == 0) t->t_first = now;
                else if (now - last > t->max_gap) t->max_gap = now - last;
                last = now;
            }
            p = e + 2;
        }
        have -= (size_t)(p - buf);
        memmove(buf, p, have);
    }
    t->t_last = last;
    close(fd);
    return NULL;
}

#endif
