/* Host memory of the CPU backend for what every step streams: the weights
 * and the KV pool, on 2 MiB-aligned transparent huge pages (docs/CPU.md,
 * "Memory"), and the background thread that faults the KV pool in. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "backend/cpu/cpu_ops.h"

enum { HUGE_PAGE = 2 << 20 };

/* Streamed, huge pages read 10-20% faster here than 4 KiB ones (fewer TLB
 * misses); a buffer under 2 MiB gains nothing and stays on small pages. */
void *kvs_cpu_alloc_huge(size_t bytes) {
    if (bytes < HUGE_PAGE) return kvs_aligned_alloc(bytes);
    void *p = NULL;
    size_t rounded = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (posix_memalign(&p, HUGE_PAGE, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE); /* advice: ignored where THP is off */
#endif
    return p;
}

struct kvs_cpu_populate {
    char *p;
    size_t bytes;
    atomic_bool stop;
    pthread_t thread;
};

/* Faults the range in a huge page at a time (MADV_POPULATE_WRITE leaves the
 * contents alone, so the engine may be writing blocks of it meanwhile), at
 * idle priority, checking the stop flag between pages: a stop waits for one
 * page at most, and no long call holds the address space's lock. */
static void *populate(void *arg) {
    kvs_cpu_populate *t = arg;
    struct sched_param idle = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
#ifdef MADV_POPULATE_WRITE
    for (size_t off = 0; off < t->bytes && !atomic_load(&t->stop); off += HUGE_PAGE) {
        size_t n = t->bytes - off < HUGE_PAGE ? t->bytes - off : HUGE_PAGE;
        if (madvise(t->p + off, n, MADV_POPULATE_WRITE) != 0 && errno != EINTR && errno != EAGAIN)
            break; /* a kernel before 5.14 (EINVAL), or out of memory: pages fault in when first written */
    }
#endif
    return NULL;
}

kvs_cpu_populate *kvs_cpu_populate_start(void *p, size_t bytes) {
    kvs_cpu_populate *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->p = p;
    t->bytes = bytes;
    atomic_init(&t->stop, false);
    if (pthread_create(&t->thread, NULL, populate, t) != 0) {
        free(t);
        return NULL; /* no thread: the pages fault in when first written */
    }
    return t;
}

void kvs_cpu_populate_stop(kvs_cpu_populate *t) {
    if (!t) return;
    atomic_store(&t->stop, true);
    pthread_join(t->thread, NULL);
    free(t);
}
