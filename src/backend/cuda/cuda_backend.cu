/* The CUDA backend: bf16 weights, activations and KV in device memory, fp32
 * accumulation; one stream; GEMMs through cuBLASLt. This file holds creation,
 * memory, transfers and dtype conversion; the ops live beside it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"

void kvs_cuda_report(kvs_backend *b, const char *call, const char *err, const char *file, int line) {
    if (b && b->impl) kvs_cuda_of(b)->failed = 1;
    kvs_fail(KVS_ERR_INTERNAL, "cuda: %s failed: %s (%s:%d)", call, err, file, line);
    kvs_log(KVS_LOG_ERROR, "cuda: %s failed: %s (%s:%d)", call, err, file, line);
}

void *kvs_cuda_scratch(kvs_backend *b, size_t bytes) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (bytes <= c->scratch_bytes) return c->scratch;
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(c->stream));
    if (c->scratch) cudaFree(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    size_t want = bytes + bytes / 4;
    cudaError_t e = cudaMalloc(&c->scratch, want);
    if (e != cudaSuccess) {
        kvs_cuda_report(b, "cudaMalloc(scratch)", cudaGetErrorString(e), __FILE__, __LINE__);
        c->scratch = NULL;
        return NULL;
    }
    c->scratch_bytes = want;
    return c->scratch;
}

static void *cuda_alloc(kvs_backend *b, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear: out of memory is an answer, not a failure */
        return NULL;
    }
    return p;
}

static void cuda_free(kvs_backend *b, void *p) {
    if (!p) return;
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(kvs_cuda_of(b)->stream)); /* kernels may still read p */
    KVS_CUDA_CHECK(b, cudaFree(p));
}

/* Pageable host sources: cudaMemcpyAsync returns once the source is staged, so
 * the caller may reuse its buffer at once. */
static void cuda_to_device(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, kvs_cuda_of(b)->stream));
}

static void cuda_to_host(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(s));
}

static void cuda_copy(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, kvs_cuda_of(b)->stream));
}

static void cuda_synchronize(kvs_backend *b) { KVS_CUDA_CHECK(b, cudaStreamSynchronize(kvs_cuda_of(b)->stream)); }

/* Host-side conversion to bf16 in chunks, then an upload per chunk. */
static void cuda_upload_weight(kvs_backend *b, void *dst, const void *src, kvs_dtype t, size_t n) {
    if (!n) return;
    if (t == KVS_BF16) {
        cuda_to_device(b, dst, src, n * 2);
        return;
    }
    const size_t chunk = (size_t)1 << 22;
    size_t cap = n < chunk ? n : chunk;
    uint16_t *tmp = (uint16_t *)malloc(cap * 2);
    float *f = (float *)malloc(cap * sizeof(float));
    if (!tmp || !f) {
        free(tmp);
        free(f);
        kvs_cuda_report(b, "upload_weight", "out of host memory", __FILE__, __LINE__);
        return;
    }
    size_t esz = kvs_dtype_size(t);
    for (size_t i = 0; i < n; i += cap) {
        size_t m = n - i < cap ? n - i : cap;
        kvs_to_f32(f, (const char *)src + i * esz, t, m);
        for (size_t j = 0; j < m; j++) tmp[j] = kvs_f32_to_bf16(f[j]);
        cuda_to_device(b, (char *)dst + i * 2, tmp, m * 2);
    }
    free(tmp);
    free(f);
}

static void cuda_to_host_f32(kvs_backend *b, float *dst, const void *src, size_t n) {
    if (!n) return;
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp) {
        kvs_cuda_report(b, "to_host_f32", "out of host memory", __FILE__, __LINE__);
        return;
    }
    cuda_to_host(b, tmp, src, n * 2);
    for (size_t i = 0; i < n; i++) dst[i] = kvs_bf16_to_f32(tmp[i]);
    free(tmp);
}

static void cuda_destroy(kvs_backend *b) {
    if (!b) return;
    kvs_cuda *c = kvs_cuda_of(b);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        kvs_cuda_gemm_destroy(c);
        if (c->lt) cublasLtDestroy(c->lt);
        if (c->lt_workspace) cudaFree(c->lt_workspace);
        if (c->scratch) cudaFree(c->scratch);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c);
    }
    free(b);
}

extern "C" kvs_status kvs_backend_cuda_create(int device, kvs_backend **out) {
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda backend: no GPU present (%s)",
                        e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    if (device < 0 || device >= count)
        return kvs_fail(KVS_ERR_INVALID, "cuda backend: device %d does not exist (%d present)", device, count);
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess)
        return kvs_fail(KVS_ERR_INTERNAL, "cuda backend: cudaGetDeviceProperties: %s", cudaGetErrorString(e));
    if (prop.major < 8)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda backend: %s is compute capability %d.%d; bf16 needs 8.0+",
                        prop.name, prop.major, prop.minor);
    kvs_backend *b = (kvs_backend *)calloc(1, sizeof *b);
    kvs_cuda *c = (kvs_cuda *)calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return kvs_fail(KVS_ERR_NOMEM, "cuda backend: out of host memory");
    }
    b->impl = c;
    c->device = device;
    c->n_sms = prop.multiProcessorCount;
    kvs_status st = KVS_OK;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        st = kvs_fail(KVS_ERR_INTERNAL, "cuda backend: device %d: %s", device, cudaGetErrorString(e));
    }
    if (st == KVS_OK) {
        cublasStatus_t cs = cublasLtCreate(&c->lt);
        if (cs != CUBLAS_STATUS_SUCCESS)
            st = kvs_fail(KVS_ERR_INTERNAL, "cuda backend: cublasLtCreate: %s", cublasLtGetStatusString(cs));
    }
    if (st == KVS_OK) {
        c->lt_workspace_bytes = (size_t)32 << 20;
        if ((e = cudaMalloc(&c->lt_workspace, c->lt_workspace_bytes)) != cudaSuccess)
            st = kvs_fail(KVS_ERR_NOMEM, "cuda backend: cuBLASLt workspace: %s", cudaGetErrorString(e));
    }
    if (st != KVS_OK) {
        cuda_destroy(b);
        return st;
    }
    b->name = "cuda";
    b->weight_dtype = b->act_dtype = b->kv_dtype = KVS_BF16;
    b->alloc = cuda_alloc;
    b->free = cuda_free;
    b->to_device = cuda_to_device;
    b->to_host = cuda_to_host;
    b->upload_weight = cuda_upload_weight;
    b->synchronize = cuda_synchronize;
    b->to_host_f32 = cuda_to_host_f32;
    b->embedding = kvs_cuda_embedding;
    b->rmsnorm = kvs_cuda_rmsnorm;
    b->add = kvs_cuda_add;
    b->matmul = kvs_cuda_matmul;
    b->rope = kvs_cuda_rope;
    b->swiglu = kvs_cuda_swiglu;
    b->gather_rows = kvs_cuda_gather_rows;
    b->kv_write = kvs_cuda_kv_write;
    b->attention = kvs_cuda_attention;
    b->kv_gather = kvs_cuda_kv_gather;
    b->copy = cuda_copy;
    b->window_capture = kvs_cuda_window_capture;
    b->sparsity_scores = kvs_cuda_sparsity_scores;
    b->add_rmsnorm = kvs_cuda_add_rmsnorm;
    b->rope_kv_write = kvs_cuda_rope_kv_write;
    b->destroy = cuda_destroy;
    kvs_log(KVS_LOG_INFO, "cuda backend: %s (sm_%d%d, %d SMs, %.1f GiB)", prop.name, prop.major, prop.minor,
            prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
    *out = b;
    return KVS_OK;
}
