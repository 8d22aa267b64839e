/* The CPU backend: fp32 weights, activations and KV in host memory; the
 * reference (oracle) that other backends are tested against. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <cblas.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* The CPU backend's state (b->impl): its first failure. */
typedef struct {
    pthread_mutex_t mu;
    kvs_status failure; /* KVS_OK: none */
    char message[512];
} cpu_state;

void kvs_cpu_fail(kvs_backend *b, kvs_status code, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvs_fail(code, "%s", msg);
    cpu_state *c = b ? b->impl : NULL;
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    if (c->failure == KVS_OK) {
        c->failure = code;
        snprintf(c->message, sizeof c->message, "%s", msg);
    }
    pthread_mutex_unlock(&c->mu);
}

static kvs_status cpu_check(kvs_backend *b) {
    cpu_state *c = b->impl;
    pthread_mutex_lock(&c->mu);
    kvs_status st = c->failure;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", c->message);
    pthread_mutex_unlock(&c->mu);
    return st == KVS_OK ? KVS_OK : kvs_fail(st, "cpu backend: %s", msg);
}

static void *cpu_alloc(kvs_backend *b, size_t bytes) { return kvs_aligned_alloc(bytes); }
static void cpu_free(kvs_backend *b, void *p) { free(p); }
static void cpu_copy(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
static void cpu_upload_weight(kvs_backend *b, void *dst, const void *src, kvs_dtype t, size_t n) {
    kvs_to_f32(dst, src, t, n);
}
static void cpu_synchronize(kvs_backend *b) {}
static void cpu_to_host_f32(kvs_backend *b, float *dst, const void *src, size_t n) {
    memcpy(dst, src, n * sizeof(float));
}
static void *cpu_host_alloc(kvs_backend *b, size_t bytes) { return malloc(bytes ? bytes : 16); }
static void cpu_host_free(kvs_backend *b, void *p) { free(p); }
static void cpu_destroy(kvs_backend *b) {
    cpu_state *c = b->impl;
    pthread_mutex_destroy(&c->mu);
    free(c);
    free(b);
}

kvs_status kvs_backend_cpu_create(int n_threads, kvs_backend **out) {
    kvs_backend *b = calloc(1, sizeof *b);
    cpu_state *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return kvs_fail(KVS_ERR_NOMEM, "cpu backend: out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    b->impl = c;
    if (n_threads > 0) omp_set_num_threads(n_threads);
    openblas_set_num_threads(1); /* OpenMP splits the matmuls (cpu_matmul.c) */
    b->name = "cpu";
    b->weight_dtype = b->act_dtype = b->kv_dtype = KVS_F32;
    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->to_device = cpu_copy;
    b->to_host = cpu_copy;
    b->upload_weight = cpu_upload_weight;
    b->synchronize = cpu_synchronize;
    b->check = cpu_check;
    b->to_host_f32 = cpu_to_host_f32;
    b->embedding = kvs_cpu_embedding;
    b->rmsnorm = kvs_cpu_rmsnorm;
    b->add = kvs_cpu_add;
    b->matmul = kvs_cpu_matmul;
    b->rope = kvs_cpu_rope;
    b->swiglu = kvs_cpu_swiglu;
    b->gather_rows = kvs_cpu_gather_rows;
    b->kv_write = kvs_cpu_kv_write;
    b->attention = kvs_cpu_attention;
    b->kv_gather = kvs_cpu_kv_gather;
    b->copy = cpu_copy;
    b->window_capture = kvs_cpu_window_capture;
    b->sparsity_scores = kvs_cpu_sparsity_scores;
    b->sample = kvs_cpu_sample;
    b->sample_shard = kvs_cpu_sample_shard;
    b->process_logits = kvs_cpu_process_logits;
    b->top_logprobs = kvs_cpu_top_logprobs;
    b->dummy_fill = kvs_cpu_dummy_fill;
    b->snapkv_select = kvs_cpu_snapkv_select;
    b->host_alloc = cpu_host_alloc;
    b->host_free = cpu_host_free;
    /* no graphs: graph_begin .. graph_destroy stay NULL (calloc) */
    b->add_rmsnorm = kvs_cpu_add_rmsnorm;
    b->rope_kv_write = kvs_cpu_rope_kv_write;
    b->destroy = cpu_destroy;
    *out = b;
    return KVS_OK;
}

#ifndef KVS_HAVE_CUDA
kvs_status kvs_backend_cuda_create(const kvs_cuda_options *opt, kvs_backend **out) {
    *out = NULL;
    return kvs_fail(KVS_ERR_UNSUPPORTED, "this kvsparse was built without CUDA");
}
#endif
