/* The ZeroMQ side of the KV events (kv_events.h): the PUB socket, used only
 * by the thread that steps the engine (a batch is encoded and sent there: a
 * PUB send never blocks, it drops at the high-water mark), and the replay
 * thread that owns the ROUTER socket. The batches kept for replay are shared
 * under a lock. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <zmq.h>

#include "events/kv_events.h"

typedef struct {
    uint64_t seq;
    unsigned char *payload;
    size_t len;
} kept_batch;

struct kvs_kv_event_publisher {
    kvs_kv_events_config cfg;
    char medium[8];
    void *ctx, *pub, *replay;
    pthread_t replay_thread;
    bool replay_started;
    pthread_mutex_t mu; /* the ring and next_seq */
    kept_batch *ring;   /* [buffer_steps]: seq s at s % buffer_steps */
    uint64_t next_seq;
    bool stale;         /* a batch was lost: the next one starts with AllBlocksCleared */
};

static void seq_bytes(uint64_t seq, unsigned char out[8]) {
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(seq >> (56 - 8 * i));
}

static double now_epoch(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + tv.tv_usec * 1e-6;
}

/* ---- the replay socket ----------------------------------------------------------- */
/* frames [identity, empty, ...], the empty delimiter left out unless delimited */
static void send_frames(void *sock, const void *const *data, const size_t *len, bool delimited, int n) {
    for (int i = 0; i < n; i++)
        if (i != 1 || delimited) zmq_send(sock, data[i], len[i], i + 1 < n ? ZMQ_SNDMORE : 0);
}

/* One request: [identity, empty, first seq] (a REQ or vLLM's DEALER client)
 * or [identity, first seq] (a bare DEALER); the answer, in the same envelope:
 * every kept batch from there as [seq, payload], then [-1, empty]. */
static void serve_replay(kvs_kv_event_publisher *p) {
    unsigned char id[256], frame[3][16];
    int id_len = zmq_recv(p->replay, id, sizeof id, 0), len[3] = {0}, n = 0, more = 1;
    size_t more_len = sizeof more;
    if (id_len < 0 || id_len > (int)sizeof id) return;
    for (zmq_getsockopt(p->replay, ZMQ_RCVMORE, &more, &more_len); more; n++) {
        int got = zmq_recv(p->replay, frame[n < 3 ? n : 2], sizeof frame[0], 0);
        if (got < 0) return;
        len[n < 3 ? n : 2] = got;
        zmq_getsockopt(p->replay, ZMQ_RCVMORE, &more, &more_len);
    }
    bool delimited = n == 2 && len[0] == 0;
    const unsigned char *seq = delimited ? frame[1] : frame[0];
    if (!(delimited || n == 1) || len[delimited] != 8) return; /* not a replay request: ignored, as vLLM does */
    uint64_t from = 0;
    for (int i = 0; i < 8; i++) from = from << 8 | seq[i];
    pthread_mutex_lock(&p->mu);
    uint64_t first = p->next_seq > (uint64_t)p->cfg.buffer_steps ? p->next_seq - p->cfg.buffer_steps : 0;
    for (uint64_t s = from > first ? from : first; s < p->next_seq; s++) {
        const kept_batch *b = &p->ring[s % (uint64_t)p->cfg.buffer_steps];
        unsigned char sb[8];
        seq_bytes(b->seq, sb);
        const void *data[4] = {id, "", sb, b->payload};
        size_t lens[4] = {(size_t)id_len, 0, 8, b->len};
        send_frames(p->replay, data, lens, delimited, 4);
    }
    pthread_mutex_unlock(&p->mu);
    unsigned char end[8];
    seq_bytes(UINT64_MAX, end); /* -1 as a signed 8-byte integer */
    const void *data[4] = {id, "", end, ""};
    size_t lens[4] = {(size_t)id_len, 0, 8, 0};
    send_frames(p->replay, data, lens, delimited, 4);
}

static void *replay_main(void *arg) {
    kvs_kv_event_publisher *p = arg;
    for (;;) {
        zmq_pollitem_t item = {.socket = p->replay, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, -1) < 0) {
            if (zmq_errno() == EINTR) continue;
            break; /* ETERM: the publisher is going */
        }
        if (item.revents & ZMQ_POLLIN) serve_replay(p);
    }
    zmq_close(p->replay);
    return NULL;
}

/* ---- publishing ------------------------------------------------------------------ */
void kvs_kv_event_publisher_publish(void *user, const kvs_kv_event_log *log) {
    kvs_kv_event_publisher *p = user;
    unsigned char *payload;
    size_t len;
    if (kvs_kv_events_encode(log, p->stale, p->medium, now_epoch(), 0, &payload, &len) != KVS_OK) {
        kvs_log(KVS_LOG_WARN, "kv events: a batch was lost (%s); the next says AllBlocksCleared", kvs_last_error());
        p->stale = true;
        return;
    }
    p->stale = false;
    pthread_mutex_lock(&p->mu);
    uint64_t seq = p->next_seq++;
    kept_batch *b = &p->ring[seq % (uint64_t)p->cfg.buffer_steps];
    free(b->payload);
    *b = (kept_batch){.seq = seq, .payload = payload, .len = len};
    pthread_mutex_unlock(&p->mu);
    /* the payload stays in the ring, unchanged until buffer_steps batches later,
       on this thread only: it can be sent without the lock */
    unsigned char sb[8];
    seq_bytes(seq, sb);
    const void *data[3] = {p->cfg.topic, sb, payload};
    size_t lens[3] = {strlen(p->cfg.topic), 8, len};
    for (int i = 0; i < 3; i++) zmq_send(p->pub, data[i], lens[i], ZMQ_DONTWAIT | (i < 2 ? ZMQ_SNDMORE : 0));
}

uint64_t kvs_kv_event_publisher_batches(kvs_kv_event_publisher *p) {
    pthread_mutex_lock(&p->mu);
    uint64_t n = p->next_seq;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* ---- life ----------------------------------------------------------------------- */
static kvs_status open_socket(kvs_kv_event_publisher *p, int type, const char *endpoint, void **out) {
    int linger = 0;
    *out = zmq_socket(p->ctx, type);
    if (!*out) return kvs_fail(KVS_ERR_IO, "kv events: a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
    zmq_setsockopt(*out, ZMQ_LINGER, &linger, sizeof linger);
    if (type == ZMQ_PUB) zmq_setsockopt(*out, ZMQ_SNDHWM, &p->cfg.hwm, sizeof p->cfg.hwm);
    if (zmq_bind(*out, endpoint) != 0)
        return kvs_fail(KVS_ERR_IO, "kv events: cannot bind %s: %s", endpoint, zmq_strerror(zmq_errno()));
    return KVS_OK;
}

kvs_status kvs_kv_event_publisher_create(const kvs_kv_events_config *cfg, const char *medium,
                                         kvs_kv_event_publisher **out) {
    *out = NULL;
    kvs_kv_event_publisher *p = calloc(1, sizeof *p);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "kv events: out of memory");
    p->cfg = *cfg;
    snprintf(p->medium, sizeof p->medium, "%s", medium);
    pthread_mutex_init(&p->mu, NULL);
    p->ring = calloc((size_t)cfg->buffer_steps, sizeof *p->ring);
    p->ctx = zmq_ctx_new();
    kvs_status st = p->ring && p->ctx ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "kv events: out of memory");
    if (st == KVS_OK) st = open_socket(p, ZMQ_PUB, cfg->endpoint, &p->pub);
    if (st == KVS_OK && cfg->replay_endpoint[0]) st = open_socket(p, ZMQ_ROUTER, cfg->replay_endpoint, &p->replay);
    if (st == KVS_OK && p->replay) {
        if (pthread_create(&p->replay_thread, NULL, replay_main, p) != 0)
            st = kvs_fail(KVS_ERR_INTERNAL, "kv events: cannot start the replay thread");
        else p->replay_started = true;
    }
    if (st != KVS_OK) {
        kvs_kv_event_publisher_destroy(p);
        return st;
    }
    /* the endpoints as bound (a port given as * is chosen now) */
    char pub[256] = "", replay[256] = "";
    size_t n = sizeof pub;
    zmq_getsockopt(p->pub, ZMQ_LAST_ENDPOINT, pub, &n);
    n = sizeof replay;
    if (p->replay) zmq_getsockopt(p->replay, ZMQ_LAST_ENDPOINT, replay, &n);
    kvs_log(KVS_LOG_INFO, "KV events: publishing on %s%s%s (topic \"%s\", medium %s)", pub, replay[0] ? ", replay on " : "",
            replay, cfg->topic, p->medium);
    *out = p;
    return KVS_OK;
}

void kvs_kv_event_publisher_destroy(kvs_kv_event_publisher *p) {
    if (!p) return;
    if (p->pub) zmq_close(p->pub);
    if (p->ctx) zmq_ctx_shutdown(p->ctx); /* the replay thread's poll returns ETERM */
    if (p->replay_started) pthread_join(p->replay_thread, NULL);
    else if (p->replay) zmq_close(p->replay);
    if (p->ctx) zmq_ctx_term(p->ctx);
    for (int i = 0; p->ring && i < p->cfg.buffer_steps; i++) free(p->ring[i].payload);
    free(p->ring);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
