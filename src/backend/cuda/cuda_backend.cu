/* The CUDA backend: bf16 weights, activations and KV in device memory, fp32
 * accumulation; one stream; GEMMs through cuBLASLt. This file holds creation,
 * memory, transfers and dtype conversion; the ops live beside it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"

void kvs_cuda_report(kvs_backend *b, const char *call, const char *err, const char *file, int line) {
    kvs_fail(KVS_ERR_INTERNAL, "cuda: %s failed: %s (%s:%d)", call, err, file, line);
    if (b && b->impl) {
        kvs_cuda *c = kvs_cuda_of(b);
        if (!c->failed) snprintf(c->failure, sizeof c->failure, "%s", kvs_last_error());
        c->failed = 1;
        if (c->capturing) c->capture_broken = 1;
    }
    kvs_log(KVS_LOG_ERROR, "cuda: %s failed: %s (%s:%d)", call, err, file, line);
}

/* The first recorded failure, if any. */
static kvs_status cuda_health(kvs_cuda *c) {
    return c->failed ? kvs_fail(KVS_ERR_INTERNAL, "cuda backend (device %d): %s", c->device, c->failure) : KVS_OK;
}

/* Waits for the stream (a kernel fault shows at the synchronization), then
 * reports the first recorded failure. */
static kvs_status cuda_check(kvs_backend *b) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (!c->failed && !c->capturing) {
        KVS_CUDA_CHECK(b, cudaStreamSynchronize(c->stream));
        b->n_done = b->n_sent; /* everything enqueued has run */
    }
    return cuda_health(c);
}

static kvs_status cuda_memory_info(kvs_backend *b, size_t *free_bytes, size_t *total_bytes) {
    kvs_cuda *c = kvs_cuda_of(b);
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) return kvs_fail(KVS_ERR_INTERNAL, "cuda backend: cudaMemGetInfo: %s", cudaGetErrorString(e));
    return KVS_OK;
}

static void cuda_fence(kvs_backend *b) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (c->failed || c->capturing) return;
    KVS_CUDA_CHECK(b, cudaEventRecord(c->fence, c->stream));
    c->fence_sent = b->n_sent;
}

/* A fault of the work before the fence shows here (the event's wait returns
   the sticky error); one after it, at the next wait. */
static kvs_status cuda_fence_wait(kvs_backend *b) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (!c->failed && !c->capturing) {
        KVS_CUDA_CHECK(b, cudaEventSynchronize(c->fence));
        if (c->fence_sent > b->n_done) b->n_done = c->fence_sent;
    }
    return cuda_health(c);
}

static void cuda_to_host_async(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, kvs_cuda_of(b)->stream));
}

void *kvs_cuda_scratch(kvs_backend *b, size_t bytes) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (bytes <= c->scratch_bytes) return c->scratch;
    if (c->capturing) { /* no synchronize or cudaMalloc inside a capture */
        c->capture_broken = 1;
        return NULL;
    }
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(c->stream));
    c->scratch_gen++;
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
 * the caller may reuse its buffer at once. Pinned sources (host_alloc): truly
 * asynchronous; the source must stay unchanged until the stream runs the copy. */
static void cuda_to_device(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, kvs_cuda_of(b)->stream));
}

static void cuda_to_host(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(s));
    b->n_done = b->n_sent;
}

static void cuda_copy(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    KVS_CUDA_CHECK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, kvs_cuda_of(b)->stream));
}

static void cuda_synchronize(kvs_backend *b) {
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(kvs_cuda_of(b)->stream));
    b->n_done = b->n_sent;
}

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

/* ---- pinned host memory and CUDA graphs ---------------------------------------- */

static void *cuda_host_alloc(kvs_backend *b, size_t bytes) {
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 16, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_host_free(kvs_backend *b, void *p) {
    if (!p) return;
    KVS_CUDA_CHECK(b, cudaStreamSynchronize(kvs_cuda_of(b)->stream)); /* a copy may still read p */
    KVS_CUDA_CHECK(b, cudaFreeHost(p));
}

/* A captured graph, with the scratch generation it baked in. */
typedef struct {
    cudaGraphExec_t exec;
    unsigned scratch_gen;
} kvs_cuda_graph;

static kvs_status cuda_graph_begin(kvs_backend *b) {
    kvs_cuda *c = kvs_cuda_of(b);
    if (c->capturing) return kvs_fail(KVS_ERR_INTERNAL, "cuda graph: a capture is already open");
    /* thread-local: tensor-parallel ranks capture on their own threads at once */
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvs_fail(KVS_ERR_INTERNAL, "cuda graph: cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    }
    c->capturing = 1;
    c->capture_broken = 0;
    return KVS_OK;
}

static kvs_status cuda_graph_end(kvs_backend *b, void **graph) {
    kvs_cuda *c = kvs_cuda_of(b);
    *graph = NULL;
    if (!c->capturing) return kvs_fail(KVS_ERR_INTERNAL, "cuda graph: no capture is open");
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    c->capturing = 0;
    if (e != cudaSuccess || !g || c->capture_broken) {
        cudaGetLastError(); /* an invalidated capture is an answer: stay eager */
        if (g) cudaGraphDestroy(g);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda graph: capture failed (%s)",
                        e != cudaSuccess ? cudaGetErrorString(e) : "an op could not be captured");
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda graph: cudaGraphInstantiate: %s", cudaGetErrorString(e));
    }
    kvs_cuda_graph *h = (kvs_cuda_graph *)malloc(sizeof *h);
    if (!h) {
        cudaGraphExecDestroy(exec);
        return kvs_fail(KVS_ERR_NOMEM, "cuda graph: out of host memory");
    }
    h->exec = exec;
    h->scratch_gen = c->scratch_gen;
    *graph = h;
    return KVS_OK;
}

static kvs_status cuda_graph_launch(kvs_backend *b, void *graph) {
    kvs_cuda *c = kvs_cuda_of(b);
    kvs_cuda_graph *h = (kvs_cuda_graph *)graph;
    if (h->scratch_gen != c->scratch_gen)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda graph: stale (the backend's scratch moved since the capture)");
    cudaError_t e = cudaGraphLaunch(h->exec, c->stream);
    if (e != cudaSuccess) {
        kvs_cuda_report(b, "cudaGraphLaunch", cudaGetErrorString(e), __FILE__, __LINE__);
        return KVS_ERR_INTERNAL;
    }
    return KVS_OK;
}

static void cuda_graph_destroy(kvs_backend *b, void *graph) {
    if (!graph) return;
    kvs_cuda_graph *h = (kvs_cuda_graph *)graph;
    KVS_CUDA_CHECK(b, cudaGraphExecDestroy(h->exec));
    free(h);
}

/* Timing marks: events on the stream (timing on: cudaEventElapsedTime). */
static void *cuda_mark_create(kvs_backend *b) {
    cudaEvent_t e;
    if (cudaEventCreate(&e) != cudaSuccess) {
        cudaGetLastError(); /* out of resources is an answer, not a failure */
        return NULL;
    }
    return (void *)e;
}

static void cuda_mark_record(kvs_backend *b, void *mark) {
    KVS_CUDA_CHECK(b, cudaEventRecord((cudaEvent_t)mark, kvs_cuda_of(b)->stream));
}

static double cuda_mark_elapsed_ms(kvs_backend *b, void *from, void *to) {
    float ms = 0;
    KVS_CUDA_CHECK(b, cudaEventElapsedTime(&ms, (cudaEvent_t)from, (cudaEvent_t)to));
    return ms;
}

static void cuda_mark_destroy(kvs_backend *b, void *mark) {
    if (mark) KVS_CUDA_CHECK(b, cudaEventDestroy((cudaEvent_t)mark));
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
        if (c->fence) cudaEventDestroy(c->fence);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c);
    }
    free(b);
}

extern "C" int kvs_backend_cuda_last_prefill(kvs_backend *b) {
    return b && b->name && !strcmp(b->name, "cuda") ? kvs_cuda_of(b)->last_prefill : -1;
}

extern "C" kvs_status kvs_backend_cuda_create(const kvs_cuda_options *opt, kvs_backend **out) {
    *out = NULL;
    const int device = opt->device;
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
    /* KVSPARSE_CUDA_PREFILL (a benchmarking knob, docs/CUDA.md "Hopper prefill kernel"):
       the prefill kernel where the options leave it AUTO */
    kvs_cuda_prefill prefill = opt->prefill;
    const char *pf = getenv("KVSPARSE_CUDA_PREFILL");
    if (prefill == KVS_CUDA_PREFILL_AUTO && pf && *pf) {
        const char *names[] = {"auto", "gqa", "head", "small", "wgmma"};
        const kvs_cuda_prefill kinds[] = {KVS_CUDA_PREFILL_AUTO, KVS_CUDA_PREFILL_GQA, KVS_CUDA_PREFILL_HEAD,
                                          KVS_CUDA_PREFILL_SMALL, KVS_CUDA_PREFILL_WGMMA};
        int found = -1;
        for (int i = 0; i < 5; i++)
            if (!strcmp(pf, names[i])) found = i;
        if (found < 0)
            return kvs_fail(KVS_ERR_INVALID, "KVSPARSE_CUDA_PREFILL=%s: not auto, gqa, head, small or wgmma", pf);
        prefill = kinds[found];
    }
    if (opt->kv_fp8 && prop.major * 10 + prop.minor < 89)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "cuda backend: --kv-cache-dtype fp8 needs a GPU of compute capability 8.9 "
                        "or later (FP8 E4M3; %s is %d.%d): use --kv-cache-dtype auto (bfloat16)", prop.name, prop.major,
                        prop.minor);
    kvs_backend *b = (kvs_backend *)calloc(1, sizeof *b);
    kvs_cuda *c = (kvs_cuda *)calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return kvs_fail(KVS_ERR_NOMEM, "cuda backend: out of host memory");
    }
    b->impl = c;
    c->device = device;
    c->prefill = prefill;
    c->last_prefill = -1;
    c->fp8_gemm = opt->fp8_gemm;
    c->n_sms = prop.multiProcessorCount;
    /* the WGMMA prefill's diagnostic knob (docs/CUDA.md "Hopper prefill kernel") */
    const char *variant = getenv("KVSPARSE_WGMMA_VARIANT"); /* a bench variant's KVS_WG_AB_* mask, for the tests */
    c->wgmma_variant = variant ? atoi(variant) : 0;
    kvs_status st = KVS_OK;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->fence, cudaEventDisableTiming)) != cudaSuccess) {
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
    /* AUTO takes the WGMMA prefill where the device runs it (Hopper, sm_90a code in
       this build), GQA elsewhere (measured: docs/CUDA.md "Hopper prefill kernel") */
    if (st == KVS_OK && prefill == KVS_CUDA_PREFILL_AUTO) c->wgmma_auto = kvs_cuda_wgmma_supported(device) == NULL;
    if (st == KVS_OK && prefill == KVS_CUDA_PREFILL_WGMMA) { /* refused where it cannot run (the others fall back) */
        const char *why = kvs_cuda_wgmma_supported(device);
        if (why)
            st = kvs_fail(KVS_ERR_UNSUPPORTED, "cuda backend: the WGMMA prefill kernel on %s (sm_%d%d): %s", prop.name,
                          prop.major, prop.minor, why);
    }
    if (st != KVS_OK) {
        cuda_destroy(b);
        return st;
    }
    b->name = "cuda";
    b->weight_dtype = b->act_dtype = KVS_BF16;
    b->kv_dtype = opt->kv_fp8 ? KVS_F8_E4M3 : KVS_BF16; /* FP8: codes + per-(layer, KV head) scales (backend.h) */
    b->alloc = cuda_alloc;
    b->free = cuda_free;
    b->to_device = cuda_to_device;
    b->to_host = cuda_to_host;
    b->upload_weight = cuda_upload_weight;
    b->synchronize = cuda_synchronize;
    b->check = cuda_check;
    b->memory_info = cuda_memory_info;
    b->fence = cuda_fence;
    b->fence_wait = cuda_fence_wait;
    b->to_host_async = cuda_to_host_async;
    b->to_host_f32 = cuda_to_host_f32;
    b->embedding = kvs_cuda_embedding;
    b->rmsnorm = kvs_cuda_rmsnorm;
    b->head_rmsnorm = kvs_cuda_head_rmsnorm;
    b->add = kvs_cuda_add;
    b->matmul = kvs_cuda_matmul;
    b->rope = kvs_cuda_rope;
    b->swiglu = kvs_cuda_swiglu;
    b->gather_rows = kvs_cuda_gather_rows;
    b->scatter_i32 = kvs_cuda_scatter_i32;
    b->kv_write = kvs_cuda_kv_write;
    b->attention = kvs_cuda_attention;
    b->kv_gather = kvs_cuda_kv_gather;
    b->copy = cuda_copy;
    b->window_capture = kvs_cuda_window_capture;
    b->sparsity_scores = kvs_cuda_sparsity_scores;
    b->sample = kvs_cuda_sample;
    b->sample_shard = kvs_cuda_sample_shard;
    b->process_logits = kvs_cuda_process_logits;
    b->top_logprobs = kvs_cuda_top_logprobs;
    b->dummy_fill = kvs_cuda_dummy_fill;
    b->snapkv_select = kvs_cuda_snapkv_select;
    b->snapkv_compact_batch = kvs_cuda_snapkv_compact_batch;
    b->host_alloc = cuda_host_alloc;
    b->host_free = cuda_host_free;
    b->graph_begin = cuda_graph_begin;
    b->graph_end = cuda_graph_end;
    b->graph_launch = cuda_graph_launch;
    b->graph_destroy = cuda_graph_destroy;
    b->add_rmsnorm = kvs_cuda_add_rmsnorm;
    b->rope_kv_write = kvs_cuda_rope_kv_write;
    if (prop.major * 10 + prop.minor >= 89) { /* FP8 tensor cores: Ada and Hopper on */
        b->quantize_fp8 = kvs_cuda_quantize_fp8;
        b->add_rmsnorm_fp8 = kvs_cuda_add_rmsnorm_fp8;
        b->swiglu_fp8 = kvs_cuda_swiglu_fp8;
        b->matmul_fp8 = kvs_cuda_matmul_fp8;
    }
    b->mark_create = cuda_mark_create;
    b->mark_record = cuda_mark_record;
    b->mark_elapsed_ms = cuda_mark_elapsed_ms;
    b->mark_destroy = cuda_mark_destroy;
    b->destroy = cuda_destroy;
    kvs_log(KVS_LOG_INFO, "cuda backend: %s (sm_%d%d, %d SMs, %.1f GiB)", prop.name, prop.major, prop.minor,
            prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
    *out = b;
    return KVS_OK;
}
