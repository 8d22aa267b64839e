/* Host communicators: tensor-parallel ranks as threads of one process, the
 * collectives through shared host memory and a barrier. The barrier is a
 * mutex + condition variable rather than pthread_barrier_t so that abort() can
 * release ranks waiting for one that failed. Each collective:
 *   publish my pointer -> barrier -> read everyone's (sum in rank order into
 *   my scratch, or copy) -> barrier -> write my buffer.
 * The second barrier keeps a rank from overwriting its buffer while another
 * still reads it. Nothing else is shared between the ranks. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend/comm.h"

typedef struct {
    int world;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long generation;
    int aborted_by; /* -1, or the rank that aborted */
    const void **slots; /* [world]: each rank's buffer for the collective in progress */
    atomic_int refs;
} host_shared;

typedef struct {
    host_shared *s;
    float *scratch;
    size_t scratch_n;
} host_comm;

static kvs_status aborted(const host_shared *s, int rank) {
    return kvs_fail(KVS_ERR_INTERNAL, "comm: rank %d of %d: the group was aborted by rank %d", rank, s->world,
                    s->aborted_by);
}

static kvs_status barrier(host_shared *s, int rank) {
    pthread_mutex_lock(&s->mu);
    if (s->aborted_by >= 0) {
        pthread_mutex_unlock(&s->mu);
        return aborted(s, rank);
    }
    unsigned long gen = s->generation;
    if (++s->arrived == s->world) {
        s->arrived = 0;
        s->generation++;
        pthread_cond_broadcast(&s->cv);
    } else {
        while (gen == s->generation && s->aborted_by < 0) pthread_cond_wait(&s->cv, &s->mu);
    }
    bool failed = gen == s->generation; /* released by an abort, not by the last arrival */
    pthread_mutex_unlock(&s->mu);
    return failed ? aborted(s, rank) : KVS_OK;
}

static kvs_status check_dtype(kvs_comm *c, kvs_dtype dtype, const char *op) {
    if (dtype == KVS_F32) return KVS_OK;
    return kvs_fail(KVS_ERR_UNSUPPORTED, "comm host: %s of %s (only f32: the CPU backend's activations)", op,
                    kvs_dtype_name(dtype));
}

static kvs_status host_all_reduce_sum(kvs_comm *c, void *buf, size_t n, kvs_dtype dtype) {
    KVS_TRY(check_dtype(c, dtype, "all_reduce_sum"));
    host_comm *h = c->impl;
    host_shared *s = h->s;
    if (n > h->scratch_n) {
        free(h->scratch);
        h->scratch = malloc(sizeof(float) * n);
        h->scratch_n = h->scratch ? n : 0;
        if (!h->scratch) return kvs_fail(KVS_ERR_NOMEM, "comm host: out of memory (%zu floats)", n);
    }
    s->slots[c->rank] = buf;
    KVS_TRY(barrier(s, c->rank));
    float *acc = h->scratch;
    memcpy(acc, s->slots[0], sizeof(float) * n);
    for (int r = 1; r < c->world; r++) { /* rank order: every rank adds the same way */
        const float *x = s->slots[r];
        for (size_t i = 0; i < n; i++) acc[i] += x[i];
    }
    KVS_TRY(barrier(s, c->rank));
    memcpy(buf, acc, sizeof(float) * n);
    return KVS_OK;
}

static kvs_status host_all_gather(kvs_comm *c, void *out, const void *in, size_t n, kvs_dtype dtype) {
    host_comm *h = c->impl;
    host_shared *s = h->s;
    size_t bytes = n * kvs_dtype_size(dtype);
    s->slots[c->rank] = in;
    KVS_TRY(barrier(s, c->rank));
    for (int r = 0; r < c->world; r++)
        if ((const char *)out + (size_t)r * bytes != s->slots[r])
            memcpy((char *)out + (size_t)r * bytes, s->slots[r], bytes);
    return barrier(s, c->rank);
}

static void host_abort(kvs_comm *c) {
    host_shared *s = ((host_comm *)c->impl)->s;
    pthread_mutex_lock(&s->mu);
    if (s->aborted_by < 0) s->aborted_by = c->rank;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void host_destroy(kvs_comm *c) {
    if (!c) return;
    host_comm *h = c->impl;
    if (h) {
        host_shared *s = h->s;
        if (atomic_fetch_sub(&s->refs, 1) == 1) {
            pthread_cond_destroy(&s->cv);
            pthread_mutex_destroy(&s->mu);
            free(s->slots);
            free(s);
        }
        free(h->scratch);
        free(h);
    }
    free(c);
}

kvs_status kvs_comm_host_create(int world, kvs_comm **comms) {
    if (world < 1 || world > 4096) return kvs_fail(KVS_ERR_INVALID, "comm host: world size %d out of range", world);
    for (int r = 0; r < world; r++) comms[r] = NULL;
    host_shared *s = calloc(1, sizeof *s);
    const void **slots = calloc((size_t)world, sizeof *slots);
    if (!s || !slots) {
        free(s);
        free(slots);
        return kvs_fail(KVS_ERR_NOMEM, "comm host: out of memory");
    }
    s->world = world;
    s->slots = slots;
    s->aborted_by = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->refs, 0);
    for (int r = 0; r < world; r++) {
        kvs_comm *c = calloc(1, sizeof *c);
        host_comm *h = calloc(1, sizeof *h);
        if (!c || !h) {
            free(c);
            free(h);
            if (r == 0) { /* nothing refers to s yet */
                pthread_cond_destroy(&s->cv);
                pthread_mutex_destroy(&s->mu);
                free(s->slots);
                free(s);
            }
            for (int k = 0; k < r; k++) {
                host_destroy(comms[k]);
                comms[k] = NULL;
            }
            return kvs_fail(KVS_ERR_NOMEM, "comm host: out of memory");
        }
        h->s = s;
        atomic_fetch_add(&s->refs, 1);
        *c = (kvs_comm){.name = "host", .rank = r, .world = world, .impl = h,
                        .all_reduce_sum = host_all_reduce_sum, .all_gather = host_all_gather,
                        .abort = host_abort, .bind_thread = NULL, .destroy = host_destroy};
        comms[r] = c;
    }
    return KVS_OK;
}

#ifndef KVS_HAVE_NCCL
kvs_status kvs_comm_nccl_create(kvs_backend **backends, int world, kvs_comm **comms) {
    for (int r = 0; r < world; r++) comms[r] = NULL;
    return kvs_fail(KVS_ERR_UNSUPPORTED,
                    "tensor parallelism on GPUs needs NCCL: this kvsparse was built without it");
}
int kvs_comm_gpu_count(void) { return 0; }
#endif
