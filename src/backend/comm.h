/* comm: the collectives tensor parallelism needs, over the memory of one
 * backend per rank. Two implementations:
 *   - host (backend/cpu/comm_host.c): N ranks as N threads of one process,
 *     through shared host memory; the CPU simulation that CI runs;
 *   - NCCL (backend/cuda/comm_nccl.cu): one process, one thread per GPU,
 *     collectives enqueued on each rank's CUDA backend stream (so a CUDA graph
 *     captured over a forward captures them too).
 * Every rank must call the same collectives in the same order. */
#ifndef KVS_COMM_H
#define KVS_COMM_H

#include "backend/backend.h"
#include "core/core.h"

typedef struct kvs_comm kvs_comm;
struct kvs_comm {
    const char *name; /* "host", "nccl" */
    int rank, world;
    void *impl;

    /* In place: buf[n] (backend memory, dtype) becomes the sum over the ranks'
     * bufs, the same on every rank. */
    kvs_status (*all_reduce_sum)(kvs_comm *c, void *buf, size_t n, kvs_dtype dtype);
    /* out[world * n] (backend memory): rank r's in[n] lands at out + r * n. */
    kvs_status (*all_gather)(kvs_comm *c, void *out, const void *in, size_t n, kvs_dtype dtype);
    /* A rank that fails between collectives calls abort: the other ranks'
     * pending and later collectives fail instead of waiting forever. */
    void (*abort)(kvs_comm *c);
    /* Optional (NULL: nothing to do): makes the calling thread use this rank's
     * device. The thread that runs a rank calls it once before anything else. */
    void (*bind_thread)(kvs_comm *c);
    void (*destroy)(kvs_comm *c);
};

/* world communicators sharing host memory, comms[r] for rank r (threads of this
 * process). Sums add rank 0's values first, then 1, ... world - 1, on every
 * rank: results are reproducible and identical across ranks. dtype: F32. Each
 * comm is destroyed on its own (the shared state goes with the last one). */
kvs_status kvs_comm_host_create(int world, kvs_comm **comms);

/* NCCL communicators for the CUDA backends backends[0 .. world) (one GPU each,
 * distinct devices), created with ncclCommInitAll from the calling thread;
 * collectives run on each backend's stream. Sets NCCL_NVLS_ENABLE=0 first.
 * KVS_ERR_UNSUPPORTED when built without NCCL; KVS_ERR_INVALID when world
 * exceeds the GPUs present (the message names both numbers). */
kvs_status kvs_comm_nccl_create(kvs_backend **backends, int world, kvs_comm **comms);
/* GPUs visible to CUDA (0 when built without CUDA + NCCL or none is present). */
int kvs_comm_gpu_count(void);

#endif
