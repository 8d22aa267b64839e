/* The CPU backend's thread pool for decode's many short parallel ops.
 * OpenMP's passive wait puts every worker to sleep between regions, and a
 * decode step has about eight regions a layer: on this project's VM each wake
 * cost tens of microseconds, 10% of decode (docs/CPU.md). Its active wait is
 * worse under contention (two processes on two cores: 70 -> 19 tokens/s
 * each). These workers wait by yielding the core (so a contended machine
 * loses nothing) for SPIN_US, then sleep. Internal to backend/cpu/. */
#ifndef KVS_CPU_POOL_H
#define KVS_CPU_POOL_H

#include "core/core.h"

typedef struct kvs_cpu_pool kvs_cpu_pool;
/* Thread t of nt does its part of the job. */
typedef void (*kvs_cpu_job)(void *arg, int t, int nt);

/* n_threads in all, the caller of kvs_cpu_pool_run included. */
kvs_status kvs_cpu_pool_create(int n_threads, kvs_cpu_pool **out);
/* Runs job(arg, t, n) for t < n, t = 0 on the calling thread; returns when
 * every part is done. One caller at a time. */
void kvs_cpu_pool_run(kvs_cpu_pool *p, kvs_cpu_job job, void *arg);
int kvs_cpu_pool_size(const kvs_cpu_pool *p);
void kvs_cpu_pool_destroy(kvs_cpu_pool *p);

/* The calling thread's scratch: at least bytes, 64-byte aligned, grown as
 * needed and kept for the thread's life (freed when it exits, so a pool's
 * workers leave nothing behind); NULL where there is no memory. Its contents
 * do not survive a call that grows it. */
void *kvs_cpu_thread_scratch(size_t bytes);

#endif
