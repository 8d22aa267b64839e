/* The CPU backend: f32 activations; f32 weights and KV (the oracle that
 * other backends are tested against) or bf16 / f16 ones; all in host memory. */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <cblas.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* The CPU backend's state (b->impl): its first failure, its kernel set and
 * the ops' scratch memory. */
typedef struct {
    pthread_mutex_t mu;
    kvs_status failure; /* KVS_OK: none */
    char message[512];
    const kvs_cpu_kernels *kernels;
    kvs_cpu_pool *pool; /* decode's parallel ops */
    void *scratch; /* grow-only: no allocation per step once warm (a fresh buffer's pages fault in) */
    size_t scratch_cap;
    struct { /* the last RoPE table (kvs_cpu_rope_table), grow-only */
        float *cs, *freq;
        int32_t *pos;
        int n, half;
        size_t cap_n, cap_half;
    } rope;
} cpu_state;

const kvs_cpu_kernels *kvs_cpu_kernels_of(kvs_backend *b) { return ((cpu_state *)b->impl)->kernels; }
kvs_cpu_pool *kvs_cpu_pool_of(kvs_backend *b) { return ((cpu_state *)b->impl)->pool; }

void *kvs_cpu_scratch(kvs_backend *b, size_t bytes) {
    cpu_state *c = b->impl;
    if (bytes > c->scratch_cap) {
        free(c->scratch);
        c->scratch_cap = 0;
        c->scratch = kvs_cpu_alloc_resident(bytes);
        if (!c->scratch) {
            kvs_cpu_fail(b, KVS_ERR_NOMEM, "cpu backend: out of memory (%zu bytes of scratch)", bytes);
            return NULL;
        }
        c->scratch_cap = bytes;
    }
    return c->scratch;
}

const float *kvs_cpu_rope_table(kvs_backend *b, const int32_t *positions, const float *inv_freq, int n, int half) {
    cpu_state *c = b->impl;
    if (c->rope.cs && c->rope.n == n && c->rope.half == half && !memcmp(c->rope.pos, positions, sizeof(int32_t) * n) &&
        !memcmp(c->rope.freq, inv_freq, sizeof(float) * half))
        return c->rope.cs;
    if ((size_t)n > c->rope.cap_n || (size_t)half > c->rope.cap_half || !c->rope.cs) {
        size_t cap_n = (size_t)n > c->rope.cap_n ? (size_t)n : c->rope.cap_n;
        size_t cap_half = (size_t)half > c->rope.cap_half ? (size_t)half : c->rope.cap_half;
        free(c->rope.cs), free(c->rope.pos), free(c->rope.freq);
        c->rope.cs = kvs_aligned_alloc(sizeof(float) * 2 * (cap_n ? cap_n : 1) * (cap_half ? cap_half : 1));
        c->rope.pos = malloc(sizeof(int32_t) * (cap_n ? cap_n : 1));
        c->rope.freq = malloc(sizeof(float) * (cap_half ? cap_half : 1));
        c->rope.cap_n = cap_n, c->rope.cap_half = cap_half;
        if (!c->rope.cs || !c->rope.pos || !c->rope.freq) {
            free(c->rope.cs), free(c->rope.pos), free(c->rope.freq);
            memset(&c->rope, 0, sizeof c->rope);
            kvs_cpu_fail(b, KVS_ERR_NOMEM, "cpu backend: out of memory (a RoPE table of %d positions)", n);
            return NULL;
        }
    }
    float *cs = c->rope.cs;
#pragma omp parallel for if (n > 4)
    for (int i = 0; i < n; i++)
        for (int k = 0; k < half; k++) {
            double ang = (double)positions[i] * inv_freq[k];
            cs[(size_t)i * 2 * half + k] = (float)cos(ang);
            cs[(size_t)i * 2 * half + half + k] = (float)sin(ang);
        }
    memcpy(c->rope.pos, positions, sizeof(int32_t) * n);
    memcpy(c->rope.freq, inv_freq, sizeof(float) * half);
    c->rope.n = n, c->rope.half = half;
    return cs;
}

const float *kvs_cpu_weights_f32(kvs_backend *b, const void *w, size_t n, float *buf) {
    if (b->weight_dtype == KVS_F32) return w;
    kvs_to_f32(buf, w, b->weight_dtype, n);
    return buf;
}

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

/* Weights (the model allocates a layer's as one buffer) on huge pages. */
static void *cpu_alloc_weights(kvs_backend *b, size_t bytes) { return kvs_cpu_alloc_huge(bytes); }

/* Everything else (the KV pool, the step buffers, scratch) from 2 MiB up:
 * on huge pages too, and faulted in at once. The KV pool's blocks are read
 * scattered, and on 4 KiB pages a block's first touch was a TLB miss; the
 * pool is resident from the start, as llama.cpp clears its KV buffer, instead
 * of creeping up as requests first write its blocks; and the first step does
 * not fault in the activation buffers it writes (docs/CPU.md, "Memory"). */
static void *cpu_alloc(kvs_backend *b, size_t bytes) { return kvs_cpu_alloc_resident(bytes); }

static volatile float read_sink; /* keeps the reads from being optimised away */

double kvs_cpu_read_bandwidth(kvs_backend *b, size_t bytes, int reps) {
    if (!b || strcmp(b->name, "cpu") != 0) return 0;
    const kvs_cpu_kernels *k = ((cpu_state *)b->impl)->kernels;
    size_t n = bytes / sizeof(float) / 1024 * 1024;
    float *x = kvs_cpu_alloc_huge(n * sizeof(float)); /* as the weights are */
    if (!x || n == 0) {
        free(x);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = (float)(i & 7); /* touched by the thread that reads it */
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = kvs_now();
        float s = 0;
#pragma omp parallel reduction(+ : s)
        {
            int nt = omp_get_num_threads(), t = omp_get_thread_num();
            size_t per = (n / nt + 1023) / 1024 * 1024, i0 = per * t < n ? per * t : n;
            size_t i1 = i0 + per < n ? i0 + per : n;
            s += k->sum(x + i0, i1 - i0);
        }
        double t = kvs_now() - t0, gbs = (double)n * sizeof(float) / t / 1e9;
        read_sink += s;
        if (gbs > best) best = gbs;
    }
    free(x);
    return best;
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

static void cpu_free(kvs_backend *b, void *p) { free(p); }
static void cpu_copy(kvs_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
static void cpu_scatter_i32(kvs_backend *b, int32_t *dst, const int32_t *pairs, int n) {
    for (int i = 0; i < n; i++) dst[pairs[2 * i]] = pairs[2 * i + 1];
}
/* Weights kept in the backend's weight dtype: the checkpoint's bytes when the
 * dtypes match, else converted (round to nearest even). */
static void cpu_upload_weight(kvs_backend *b, void *dst, const void *src, kvs_dtype t, size_t n) {
    if (b->weight_dtype == KVS_F32) {
        kvs_to_f32(dst, src, t, n);
    } else if (t == b->weight_dtype) {
        memcpy(dst, src, n * kvs_dtype_size(t));
    } else {
        uint16_t *o = dst;
        enum { CHUNK = 4096 };
        float f[CHUNK];
        for (size_t i = 0; i < n; i += CHUNK) {
            size_t m = n - i < CHUNK ? n - i : CHUNK;
            kvs_to_f32(f, (const char *)src + i * kvs_dtype_size(t), t, m);
            for (size_t j = 0; j < m; j++)
                o[i + j] = b->weight_dtype == KVS_BF16 ? kvs_f32_to_bf16(f[j]) : kvs_f32_to_f16(f[j]);
        }
    }
}
static void cpu_synchronize(kvs_backend *b) { b->n_done = b->n_sent; } /* every op has run already */
static void cpu_fence(kvs_backend *b) { (void)b; }
static kvs_status cpu_fence_wait(kvs_backend *b) {
    cpu_synchronize(b);
    return cpu_check(b);
}
static void cpu_to_host_f32(kvs_backend *b, float *dst, const void *src, size_t n) {
    memcpy(dst, src, n * sizeof(float));
}
static void *cpu_mark_create(kvs_backend *b) { return malloc(sizeof(double)); }
static void cpu_mark_record(kvs_backend *b, void *mark) { *(double *)mark = kvs_now(); }
static double cpu_mark_elapsed_ms(kvs_backend *b, void *from, void *to) {
    return 1e3 * (*(double *)to - *(double *)from);
}
static void cpu_mark_destroy(kvs_backend *b, void *mark) { free(mark); }
static void *cpu_host_alloc(kvs_backend *b, size_t bytes) { return malloc(bytes ? bytes : 16); }
static void cpu_host_free(kvs_backend *b, void *p) { free(p); }
static void cpu_destroy(kvs_backend *b) {
    cpu_state *c = b->impl;
    pthread_mutex_destroy(&c->mu);
    kvs_cpu_pool_destroy(c->pool);
    free(c->scratch);
    free(c->rope.cs), free(c->rope.pos), free(c->rope.freq);
    free(c);
    free(b);
}

kvs_status kvs_backend_cpu_create(int n_threads, kvs_backend **out) {
    return kvs_backend_cpu_create_typed(n_threads, KVS_F32, KVS_F32, out);
}

kvs_status kvs_backend_cpu_create_typed(int n_threads, kvs_dtype weight_dtype, kvs_dtype kv_dtype, kvs_backend **out) {
    *out = NULL;
    if (weight_dtype != KVS_F32 && weight_dtype != KVS_BF16 && weight_dtype != KVS_F16)
        return kvs_fail(KVS_ERR_INVALID, "cpu backend: weights of dtype %s (f32, bf16 or f16)",
                        kvs_dtype_name(weight_dtype));
    if (kv_dtype != KVS_F32 && kv_dtype != KVS_BF16 && kv_dtype != KVS_F16 && kv_dtype != KVS_F8_E4M3)
        return kvs_fail(KVS_ERR_INVALID, "cpu backend: a KV cache of dtype %s (f32, bf16, f16 or F8_E4M3)",
                        kvs_dtype_name(kv_dtype));
    kvs_backend *b = calloc(1, sizeof *b);
    cpu_state *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return kvs_fail(KVS_ERR_NOMEM, "cpu backend: out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    b->impl = c;
    c->kernels = kvs_cpu_kernels_pick();
    if (n_threads > 0) omp_set_num_threads(n_threads);
    openblas_set_num_threads(1); /* OpenMP splits the matmuls (cpu_matmul.c) */
    kvs_status st = kvs_cpu_pool_create(omp_get_max_threads(), &c->pool);
    if (st != KVS_OK) {
        pthread_mutex_destroy(&c->mu);
        free(c);
        free(b);
        return st;
    }
    b->name = "cpu";
    b->act_dtype = KVS_F32;
    b->weight_dtype = weight_dtype;
    b->kv_dtype = kv_dtype;
    b->alloc = cpu_alloc;
    b->alloc_weights = cpu_alloc_weights;
    b->free = cpu_free;
    b->to_device = cpu_copy;
    b->to_host = cpu_copy;
    b->upload_weight = cpu_upload_weight;
    b->synchronize = cpu_synchronize;
    b->check = cpu_check;
    b->fence = cpu_fence;
    b->fence_wait = cpu_fence_wait;
    b->to_host_async = cpu_copy;
    b->to_host_f32 = cpu_to_host_f32;
    b->embedding = kvs_cpu_embedding;
    b->rmsnorm = kvs_cpu_rmsnorm;
    b->head_rmsnorm = kvs_cpu_head_rmsnorm;
    b->add = kvs_cpu_add;
    b->matmul = kvs_cpu_matmul;
    b->matmul_q = kvs_cpu_matmul_q;
    b->embedding_q = kvs_cpu_embedding_q;
    b->rope = kvs_cpu_rope;
    b->swiglu = kvs_cpu_swiglu;
    b->gather_rows = kvs_cpu_gather_rows;
    b->kv_write = kvs_cpu_kv_write;
    b->attention = kvs_cpu_attention;
    b->kv_gather = kvs_cpu_kv_gather;
    b->copy = cpu_copy;
    b->scatter_i32 = cpu_scatter_i32;
    b->window_capture = kvs_cpu_window_capture;
    b->sparsity_scores = kvs_cpu_sparsity_scores;
    b->sample = kvs_cpu_sample;
    b->sample_shard = kvs_cpu_sample_shard;
    b->process_logits = kvs_cpu_process_logits;
    b->top_logprobs = kvs_cpu_top_logprobs;
    b->dummy_fill = kvs_cpu_dummy_fill;
    b->snapkv_select = kvs_cpu_snapkv_select;
    b->snapkv_compact_batch = kvs_cpu_snapkv_compact_batch;
    b->host_alloc = cpu_host_alloc;
    b->host_free = cpu_host_free;
    /* no graphs: graph_begin .. graph_destroy stay NULL (calloc) */
    b->add_rmsnorm = kvs_cpu_add_rmsnorm;
    b->rope_kv_write = kvs_cpu_rope_kv_write;
    b->quantize_fp8 = kvs_cpu_quantize_fp8;
    b->add_rmsnorm_fp8 = kvs_cpu_add_rmsnorm_fp8;
    b->swiglu_fp8 = kvs_cpu_swiglu_fp8;
    b->matmul_fp8 = kvs_cpu_matmul_fp8;
    b->mark_create = cpu_mark_create;
    b->mark_record = cpu_mark_record;
    b->mark_elapsed_ms = cpu_mark_elapsed_ms;
    b->mark_destroy = cpu_mark_destroy;
    b->destroy = cpu_destroy;
    *out = b;
    return KVS_OK;
}

#ifndef KVS_HAVE_CUDA
kvs_status kvs_backend_cuda_create(const kvs_cuda_options *opt, kvs_backend **out) {
    *out = NULL;
    return kvs_fail(KVS_ERR_UNSUPPORTED, "this kvsparse was built without CUDA");
}
int kvs_backend_cuda_last_prefill(kvs_backend *b) {
    (void)b;
    return -1;
}
#endif
