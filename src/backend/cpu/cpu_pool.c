/* The CPU thread pool (cpu_pool.h): a generation counter the workers watch,
 * yielding, then sleeping on a condition variable. */
#include "backend/cpu/cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

enum { SPIN_US = 200 }; /* longer than the host work between two decode steps */
/* Polls before each yield: a yield is a system call of about 1.2 us on this
 * project's VM, longer than most waits between two ops of a decode step; this
 * many pauses take well under a microsecond, so a contended machine loses
 * little. */
enum { POLLS = 32 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

typedef struct {
    kvs_cpu_pool *p;
    int t;
} worker_arg;

struct kvs_cpu_pool {
    int n;
    pthread_t *threads;
    worker_arg *args;
    kvs_cpu_job job;
    void *arg;
    atomic_uint gen;    /* bumped once per job */
    atomic_int pending; /* workers still on the current job */
    atomic_int sleepers;
    atomic_bool stop;
    pthread_mutex_t mu;
    pthread_cond_t wake;
};

/* Waits until p->gen differs from seen; false when the pool stops. */
static bool wait_job(kvs_cpu_pool *p, unsigned seen) {
    double t0 = kvs_now();
    while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
        if (kvs_now() - t0 < SPIN_US * 1e-6) {
            for (int i = 0; i < POLLS && atomic_load(&p->gen) == seen; i++) cpu_relax();
            if (atomic_load(&p->gen) == seen) sched_yield();
            continue;
        }
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->sleepers, 1); /* before the check: kvs_cpu_pool_run sees it or we see its job */
        while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->wake, &p->mu);
        atomic_fetch_sub(&p->sleepers, 1);
        pthread_mutex_unlock(&p->mu);
    }
    return !atomic_load(&p->stop);
}

static void *worker(void *a) {
    worker_arg *w = a;
    kvs_cpu_pool *p = w->p;
    unsigned seen = 0;
    while (wait_job(p, seen)) {
        seen = atomic_load(&p->gen);
        p->job(p->arg, w->t, p->n);
        atomic_fetch_sub(&p->pending, 1);
    }
    return NULL;
}

static void wake_all(kvs_cpu_pool *p) {
    if (atomic_load(&p->sleepers) == 0) return;
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

void kvs_cpu_pool_run(kvs_cpu_pool *p, kvs_cpu_job job, void *arg) {
    if (p->n == 1) {
        job(arg, 0, 1);
        return;
    }
    p->job = job;
    p->arg = arg;
    atomic_store(&p->pending, p->n - 1);
    atomic_fetch_add(&p->gen, 1);
    wake_all(p);
    job(arg, 0, p->n);
    while (atomic_load(&p->pending) > 0) {
        for (int i = 0; i < POLLS && atomic_load(&p->pending) > 0; i++) cpu_relax();
        if (atomic_load(&p->pending) > 0) sched_yield();
    }
}

int kvs_cpu_pool_size(const kvs_cpu_pool *p) { return p->n; }

kvs_status kvs_cpu_pool_create(int n_threads, kvs_cpu_pool **out) {
    *out = NULL;
    kvs_cpu_pool *p = calloc(1, sizeof *p);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "cpu pool: out of memory");
    p->n = n_threads > 0 ? n_threads : 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->threads = calloc((size_t)p->n, sizeof *p->threads);
    p->args = calloc((size_t)p->n, sizeof *p->args);
    if (!p->threads || !p->args) {
        kvs_cpu_pool_destroy(p);
        return kvs_fail(KVS_ERR_NOMEM, "cpu pool: out of memory");
    }
    for (int t = 1; t < p->n; t++) {
        p->args[t] = (worker_arg){p, t};
        if (pthread_create(&p->threads[t], NULL, worker, &p->args[t]) != 0) {
            p->n = t; /* the ones started so far, joined by destroy */
            kvs_cpu_pool_destroy(p);
            return kvs_fail(KVS_ERR_INTERNAL, "cpu pool: cannot start thread %d", t);
        }
    }
    *out = p;
    return KVS_OK;
}

void kvs_cpu_pool_destroy(kvs_cpu_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int t = 1; t < p->n && p->threads; t++) pthread_join(p->threads[t], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p->args);
    free(p);
}

/* A thread's scratch is one block: its capacity, then the 64-byte-aligned
 * bytes handed out. The key's destructor frees it when the thread exits. */
typedef struct {
    size_t cap;
    _Alignas(64) unsigned char bytes[];
} scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static bool scratch_key_ok;

static void scratch_key_create(void) { scratch_key_ok = pthread_key_create(&scratch_key, free) == 0; }

void *kvs_cpu_thread_scratch(size_t bytes) {
    pthread_once(&scratch_once, scratch_key_create);
    if (!scratch_key_ok) return NULL;
    scratch *s = pthread_getspecific(scratch_key);
    if (s && s->cap >= bytes) return s->bytes;
    if (bytes > SIZE_MAX - sizeof(scratch)) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(scratch) + bytes)) return NULL;
    if (pthread_setspecific(scratch_key, p) != 0) {
        free(p);
        return NULL;
    }
    free(s);
    s = p;
    s->cap = bytes;
    return s->bytes;
}
