/* NCCL communicators for tensor parallelism: one process, one thread per GPU
 * (kvs_runner), one communicator per rank made with ncclCommInitAll. Each
 * collective is enqueued on the rank's CUDA backend stream, after the ops that
 * produce its input and before those that consume its output, so nothing
 * synchronizes the host and a CUDA graph captured over a forward step
 * captures the all-reduces too (NCCL >= 2.9 supports stream capture).
 *
 * Compiled to nothing unless the build found NCCL (KVS_HAVE_NCCL, set by the
 * "NCCL" block of CMakeLists.txt); backend/cpu/comm_host.c then provides the
 * stubs that say so. */
#ifdef KVS_HAVE_NCCL

#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"

extern "C" {
#include "backend/comm.h"
}

typedef struct {
    ncclComm_t nccl;
    int device;
    cudaStream_t stream;
} nccl_comm;

static kvs_status nccl_fail(const kvs_comm *c, const char *call, ncclResult_t r) {
    return kvs_fail(KVS_ERR_INTERNAL, "nccl: rank %d of %d: %s failed: %s", c ? c->rank : -1, c ? c->world : 0, call,
                    ncclGetErrorString(r));
}

static bool nccl_type(kvs_dtype t, ncclDataType_t *out) {
    switch (t) {
    case KVS_F32: *out = ncclFloat32; return true;
    case KVS_F16: *out = ncclFloat16; return true;
    case KVS_BF16: *out = ncclBfloat16; return true;
    case KVS_I32: *out = ncclInt32; return true;
    case KVS_I64: *out = ncclInt64; return true;
    case KVS_U8: *out = ncclUint8; return true;
    default: return false;
    }
}

static kvs_status nccl_all_reduce_sum(kvs_comm *c, void *buf, size_t n, kvs_dtype dtype) {
    nccl_comm *h = (nccl_comm *)c->impl;
    ncclDataType_t t;
    if (!nccl_type(dtype, &t)) return kvs_fail(KVS_ERR_UNSUPPORTED, "nccl: all_reduce of %s", kvs_dtype_name(dtype));
    ncclResult_t r = ncclAllReduce(buf, buf, n, t, ncclSum, h->nccl, h->stream);
    return r == ncclSuccess ? KVS_OK : nccl_fail(c, "ncclAllReduce", r);
}

static kvs_status nccl_all_gather(kvs_comm *c, void *out, const void *in, size_t n, kvs_dtype dtype) {
    nccl_comm *h = (nccl_comm *)c->impl;
    ncclDataType_t t;
    if (!nccl_type(dtype, &t)) return kvs_fail(KVS_ERR_UNSUPPORTED, "nccl: all_gather of %s", kvs_dtype_name(dtype));
    ncclResult_t r = ncclAllGather(in, out, n, t, h->nccl, h->stream);
    return r == ncclSuccess ? KVS_OK : nccl_fail(c, "ncclAllGather", r);
}

static void nccl_abort(kvs_comm *c) {
    nccl_comm *h = (nccl_comm *)c->impl;
    if (h->nccl) ncclCommAbort(h->nccl); /* unblocks the peers' pending collectives */
    h->nccl = NULL;
}

static void nccl_bind_thread(kvs_comm *c) { cudaSetDevice(((nccl_comm *)c->impl)->device); }

static void nccl_destroy(kvs_comm *c) {
    if (!c) return;
    nccl_comm *h = (nccl_comm *)c->impl;
    if (h) {
        if (h->nccl) {
            cudaSetDevice(h->device);
            ncclCommDestroy(h->nccl);
        }
        free(h);
    }
    free(c);
}

extern "C" int kvs_comm_gpu_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no GPU: clear the sticky error */
        return 0;
    }
    return n;
}

extern "C" kvs_status kvs_comm_nccl_create(kvs_backend **backends, int world, kvs_comm **comms) {
    for (int r = 0; r < world; r++) comms[r] = NULL;
    int present = kvs_comm_gpu_count();
    if (world < 1 || world > present)
        return kvs_fail(KVS_ERR_INVALID, "--tensor-parallel-size %d exceeds the %d GPU%s present", world, present,
                        present == 1 ? "" : "s");
    int *devs = (int *)calloc((size_t)world, sizeof(int));
    ncclComm_t *raw = (ncclComm_t *)calloc((size_t)world, sizeof(ncclComm_t));
    if (!devs || !raw) {
        free(devs);
        free(raw);
        return kvs_fail(KVS_ERR_NOMEM, "nccl: out of memory");
    }
    for (int r = 0; r < world; r++) {
        if (!backends[r] || !backends[r]->name || strcmp(backends[r]->name, "cuda") != 0) {
            free(devs);
            free(raw);
            return kvs_fail(KVS_ERR_INVALID, "nccl: rank %d's backend is not a CUDA backend", r);
        }
        devs[r] = kvs_cuda_of(backends[r])->device;
        for (int k = 0; k < r; k++)
            if (devs[k] == devs[r]) {
                int dev = devs[r];
                free(devs);
                free(raw);
                return kvs_fail(KVS_ERR_INVALID, "nccl: ranks %d and %d both use GPU %d", k, r, dev);
            }
    }
    /* NVLink SHARP (NVLS) multicast stays off: on the shared H200 hosts this
       project runs on, a program that creates NVLink multicast objects can
       put the host's GPUs, which others share, out of service for a day or
       more. Our all-reduces (a few MB per layer in prefill, a few KB in
       decode) gain little from it; ring/tree over NVLink serves them.
       Overwrite whatever the environment says: this must hold everywhere. */
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclResult_t res = ncclCommInitAll(raw, world, devs);
    if (res != ncclSuccess) {
        free(devs);
        free(raw);
        return nccl_fail(NULL, "ncclCommInitAll", res);
    }
    kvs_status st = KVS_OK;
    for (int r = 0; r < world; r++) {
        kvs_comm *c = (kvs_comm *)calloc(1, sizeof *c);
        nccl_comm *h = (nccl_comm *)calloc(1, sizeof *h);
        if (!c || !h) {
            free(c);
            free(h);
            st = kvs_fail(KVS_ERR_NOMEM, "nccl: out of memory");
            for (int k = r; k < world; k++) ncclCommDestroy(raw[k]);
            for (int k = 0; k < r; k++) {
                nccl_destroy(comms[k]);
                comms[k] = NULL;
            }
            break;
        }
        h->nccl = raw[r];
        h->device = devs[r];
        h->stream = kvs_cuda_of(backends[r])->stream;
        c->name = "nccl";
        c->rank = r;
        c->world = world;
        c->impl = h;
        c->all_reduce_sum = nccl_all_reduce_sum;
        c->all_gather = nccl_all_gather;
        c->abort = nccl_abort;
        c->bind_thread = nccl_bind_thread;
        c->destroy = nccl_destroy;
        comms[r] = c;
    }
    free(devs);
    free(raw);
    return st;
}

#endif /* KVS_HAVE_NCCL */
