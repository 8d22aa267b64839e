/* server: the registry of connections, their deadlines and the fair share of
 * pending connections per address (see conns.h). */
#include <errno.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "server/conns.h"

#define TICK_MS 100      /* the deadlines' resolution */
#define WATCH_TICKS 2    /* requests in flight are looked at every 200 ms */

typedef enum { PHASE_HEADERS, PHASE_BODY, PHASE_REQUEST, PHASE_IDLE } phase;

/* an address holding connections: IPv4 (an IPv4-mapped IPv6 address as its IPv4) or IPv6 */
typedef struct {
    unsigned char key[16];
    unsigned len;
    unsigned pending, total;
} address;

struct kvs_conn {
    kvs_conn *prev, *next; /* oldest first */
    int fd;
    unsigned char key[16];
    unsigned key_len;
    phase ph;
    double since;        /* when the phase began */
    uint64_t body_bytes; /* PHASE_BODY: received so far */
    uint64_t rx_mark;    /* PHASE_IDLE: the socket's bytes received when the last response ended */
    bool shut;           /* shut by the registry: no longer pending, closing */
    void *req;           /* PHASE_REQUEST: what the watch callback gets */
};

struct kvs_conns {
    kvs_conns_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvs_conn *head, *tail;
    address *addrs; /* the addresses holding connections */
    int n_addrs, cap_addrs;
    kvs_conns_stats stats;
    pthread_t thread;
    bool started, stop;
};

static void address_key(const struct sockaddr *sa, unsigned char key[16], unsigned *len) {
    *len = 0;
    if (sa && sa->sa_family == AF_INET) {
        memcpy(key, &((const struct sockaddr_in *)sa)->sin_addr, 4);
        *len = 4;
    } else if (sa && sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) memcpy(key, a->s6_addr + 12, 4), *len = 4;
        else memcpy(key, a->s6_addr, 16), *len = 16;
    }
}

static address *find(kvs_conns *c, const unsigned char *key, unsigned len) {
    for (int i = 0; i < c->n_addrs; i++)
        if (c->addrs[i].len == len && !memcmp(c->addrs[i].key, key, len)) return &c->addrs[i];
    return NULL;
}

static bool pending(const kvs_conn *k) { return !k->shut && k->ph != PHASE_REQUEST; }

/* moves k's counts by d (its address's and the registry's) */
static void count(kvs_conns *c, const kvs_conn *k, int d) {
    address *a = find(c, k->key, k->key_len);
    if (pending(k)) {
        if (a) a->pending += (unsigned)d;
        c->stats.pending += (unsigned)d;
    } else if (!k->shut) {
        c->stats.in_flight += (unsigned)d;
    }
}

static void set_phase(kvs_conns *c, kvs_conn *k, phase ph) {
    count(c, k, -1);
    k->ph = ph;
    k->since = kvs_now();
    count(c, k, +1);
}

static void shut(kvs_conns *c, kvs_conn *k) {
    count(c, k, -1);
    k->shut = true;
    shutdown(k->fd, SHUT_RDWR);
}

/* the bytes the socket has received, or false */
static bool bytes_received(int fd, uint64_t *n) {
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
        len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received)
        return false;
    *n = ti.tcpi_bytes_received;
    return true;
}

static void check(kvs_conns *c, kvs_conn *k, double now, bool watch) {
    const kvs_conns_config *cfg = &c->cfg;
    uint64_t rx;
    switch (k->ph) {
    case PHASE_HEADERS:
        if (cfg->header_timeout_s > 0 && now - k->since > cfg->header_timeout_s) {
            c->stats.header_timeouts++;
            shut(c, k);
        }
        break;
    case PHASE_BODY:
        if (cfg->body_timeout_s > 0 &&
            now - k->since > cfg->body_timeout_s + (cfg->body_min_rate > 0 ? (double)k->body_bytes / cfg->body_min_rate : 0)) {
            c->stats.body_timeouts++;
            shut(c, k);
        }
        break;
    case PHASE_IDLE: /* the next request's first byte starts its header deadline */
        if (bytes_received(k->fd, &rx) && rx > k->rx_mark) set_phase(c, k, PHASE_HEADERS);
        break;
    case PHASE_REQUEST:
        if (watch && k->req && cfg->watch) cfg->watch(k->req, cfg->watch_arg);
        break;
    }
}

static void *watcher(void *arg) {
    kvs_conns *c = arg;
    pthread_mutex_lock(&c->mu);
    for (unsigned tick = 1; !c->stop; tick++) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += TICK_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&c->cv, &c->mu, &until);
        double now = kvs_now();
        for (kvs_conn *k = c->head; k && !c->stop; k = k->next)
            if (!k->shut) check(c, k, now, tick % WATCH_TICKS == 0);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

kvs_status kvs_conns_create(const kvs_conns_config *cfg, kvs_conns **out) {
    kvs_conns *c = calloc(1, sizeof *c);
    if (!c) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    c->cfg = *cfg;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (pthread_create(&c->thread, NULL, watcher, c) != 0) {
        kvs_conns_destroy(c);
        return kvs_fail(KVS_ERR_INTERNAL, "could not start the connection watcher thread");
    }
    c->started = true;
    *out = c;
    return KVS_OK;
}

void kvs_conns_destroy(kvs_conns *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->started) pthread_join(c->thread, NULL);
    while (c->head) {
        kvs_conn *k = c->head;
        c->head = k->next;
        free(k);
    }
    free(c->addrs);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* the address holding most pending connections, and its oldest pending one */
static kvs_conn *displaceable(kvs_conns *c) {
    address *most = NULL;
    for (int i = 0; i < c->n_addrs; i++)
        if (!most || c->addrs[i].pending > most->pending) most = &c->addrs[i];
    if (!most || !most->pending) return NULL;
    for (kvs_conn *k = c->head; k; k = k->next)
        if (pending(k) && k->key_len == most->len && !memcmp(k->key, most->key, most->len)) return k;
    return NULL;
}

bool kvs_conns_admit(kvs_conns *c, const struct sockaddr *addr, socklen_t len) {
    (void)len;
    unsigned char key[16];
    unsigned key_len;
    address_key(addr, key, &key_len);
    pthread_mutex_lock(&c->mu);
    bool ok = !c->cfg.max_pending || c->stats.pending < c->cfg.max_pending;
    if (!ok) {
        address *a = find(c, key, key_len);
        unsigned held = a ? a->pending : 0, holders = held ? 0 : 1;
        for (int i = 0; i < c->n_addrs; i++) holders += c->addrs[i].pending > 0;
        unsigned share = c->cfg.max_pending / holders;
        kvs_conn *victim = held < (share ? share : 1) ? displaceable(c) : NULL;
        if (victim && !(victim->key_len == key_len && !memcmp(victim->key, key, key_len))) {
            shut(c, victim);
            c->stats.displaced++;
            ok = true;
        } else {
            c->stats.refused++;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return ok;
}

kvs_conn *kvs_conns_open(kvs_conns *c, int fd, const struct sockaddr *addr, socklen_t len) {
    (void)len;
    kvs_conn *k = calloc(1, sizeof *k);
    if (!k) {
        shutdown(fd, SHUT_RDWR);
        return NULL;
    }
    k->fd = fd;
    address_key(addr, k->key, &k->key_len);
    k->ph = PHASE_HEADERS;
    k->since = kvs_now();
    pthread_mutex_lock(&c->mu);
    address *a = find(c, k->key, k->key_len);
    if (!a && c->n_addrs == c->cap_addrs) {
        int cap = c->cap_addrs ? c->cap_addrs * 2 : 16;
        address *na = realloc(c->addrs, (size_t)cap * sizeof *na);
        if (na) c->addrs = na, c->cap_addrs = cap;
    }
    if (!a && c->n_addrs < c->cap_addrs) {
        a = &c->addrs[c->n_addrs++];
        memset(a, 0, sizeof *a);
        memcpy(a->key, k->key, k->key_len);
        a->len = k->key_len;
    }
    if (!a) { /* out of memory: not registered, so shut at once */
        pthread_mutex_unlock(&c->mu);
        shutdown(fd, SHUT_RDWR);
        free(k);
        return NULL;
    }
    a->total++;
    k->prev = c->tail;
    if (c->tail) c->tail->next = k;
    else c->head = k;
    c->tail = k;
    count(c, k, +1);
    pthread_mutex_unlock(&c->mu);
    return k;
}

void kvs_conns_close(kvs_conns *c, kvs_conn *k) {
    if (!k) return;
    pthread_mutex_lock(&c->mu);
    count(c, k, -1);
    address *a = find(c, k->key, k->key_len);
    if (a && --a->total == 0) *a = c->addrs[--c->n_addrs];
    if (k->prev) k->prev->next = k->next;
    else c->head = k->next;
    if (k->next) k->next->prev = k->prev;
    else c->tail = k->prev;
    pthread_mutex_unlock(&c->mu);
    free(k);
}

void kvs_conns_headers(kvs_conns *c, kvs_conn *k, bool body) {
    if (!k) return;
    pthread_mutex_lock(&c->mu);
    k->body_bytes = 0;
    set_phase(c, k, body ? PHASE_BODY : PHASE_REQUEST);
    pthread_mutex_unlock(&c->mu);
}

void kvs_conns_body(kvs_conns *c, kvs_conn *k, size_t n) {
    if (!k) return;
    pthread_mutex_lock(&c->mu);
    k->body_bytes += n;
    pthread_mutex_unlock(&c->mu);
}

void kvs_conns_request(kvs_conns *c, kvs_conn *k, void *req) {
    if (!k) return;
    pthread_mutex_lock(&c->mu);
    if (k->ph != PHASE_REQUEST) set_phase(c, k, PHASE_REQUEST);
    k->req = req;
    pthread_mutex_unlock(&c->mu);
}

void kvs_conns_done(kvs_conns *c, kvs_conn *k) {
    if (!k) return;
    pthread_mutex_lock(&c->mu);
    k->req = NULL;
    if (!bytes_received(k->fd, &k->rx_mark)) k->rx_mark = UINT64_MAX; /* unknown: idle until --http-timeout */
    set_phase(c, k, PHASE_IDLE);
    pthread_mutex_unlock(&c->mu);
}

void kvs_conns_each_request(kvs_conns *c, void (*fn)(void *req, void *arg), void *arg) {
    pthread_mutex_lock(&c->mu);
    for (kvs_conn *k = c->head; k; k = k->next)
        if (k->ph == PHASE_REQUEST && k->req) fn(k->req, arg);
    pthread_mutex_unlock(&c->mu);
}

void kvs_conns_shut_all(kvs_conns *c) {
    pthread_mutex_lock(&c->mu);
    for (kvs_conn *k = c->head; k; k = k->next)
        if (!k->shut) shut(c, k);
    pthread_mutex_unlock(&c->mu);
}

kvs_conns_stats kvs_conns_get_stats(kvs_conns *c) {
    pthread_mutex_lock(&c->mu);
    kvs_conns_stats s = c->stats;
    pthread_mutex_unlock(&c->mu);
    return s;
}
