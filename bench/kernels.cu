/* Kernel microbenchmarks for the CUDA backend, each against a baseline
 * measured in the same run:
 *   - device-to-device copy bandwidth (bytes read + written per second)
 *   - cuBLASLt bf16 GEMM 8192^3 (TFLOP/s)
 *   - paged decode attention, batch 64 x 4096 context, Llama-3-8B shape
 *     (32 query heads, 8 KV heads, head_dim 128): KV bytes read per second
 *   - causal prefill attention, 4096 tokens, same shape: TFLOP/s
 * Times are wall clock around many queued launches between two stream syncs.
 * Usage: kvs_bench_kernels [device] */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda_internal.h"

__global__ void kvs_bench_fill_kernel(bf16 *x, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f));
    }
}

static void fill(bf16 *x, size_t n, uint32_t seed) {
    kvs_bench_fill_kernel<<<1024, 256>>>(x, n, seed);
    cudaDeviceSynchronize();
}

static double time_it(kvs_backend *b, int iters, void (*fn)(kvs_backend *, void *), void *ctx) {
    fn(b, ctx); /* warm-up */
    b->synchronize(b);
    double t0 = kvs_now();
    for (int i = 0; i < iters; i++) fn(b, ctx);
    b->synchronize(b);
    return (kvs_now() - t0) / iters;
}

struct copy_ctx { void *dst, *src; size_t bytes; };
static void run_copy(kvs_backend *b, void *p) {
    copy_ctx *c = (copy_ctx *)p;
    b->copy(b, c->dst, c->src, c->bytes);
}

struct gemm_ctx { void *out, *in, *w; int n; };
static void run_gemm(kvs_backend *b, void *p) {
    gemm_ctx *c = (gemm_ctx *)p;
    b->matmul(b, c->out, c->in, c->w, NULL, c->n, c->n, c->n);
}

struct attn_ctx { void *out, *q; float *lse; kvs_kv_pool pool; kvs_attn_batch ab; int n_heads; };
static void run_attn(kvs_backend *b, void *p) {
    attn_ctx *c = (attn_ctx *)p;
    b->attention(b, c->out, c->lse, c->q, &c->pool, &c->ab, c->n_heads, 0.08838834764f);
}

/* A batch of n_seqs sequences of ctx entries each (q_len new tokens each), blocks shuffled. */
static bool attn_setup(kvs_backend *b, attn_ctx *c, int n_seqs, int ctx, int q_len, bool with_lse) {
    const int H = 32, KV = 8, D = 128, BS = 16;
    int nb = (ctx + BS - 1) / BS;
    int64_t n_blocks = (int64_t)n_seqs * nb;
    size_t pool_elems = (size_t)n_blocks * 2 * KV * BS * D;
    c->pool = (kvs_kv_pool){b->alloc(b, pool_elems * 2), n_blocks, BS, KV, D};
    int n = n_seqs * q_len;
    c->q = b->alloc(b, (size_t)n * H * D * 2);
    c->out = b->alloc(b, (size_t)n * H * D * 2);
    c->lse = with_lse ? (float *)b->alloc(b, (size_t)n * H * 4) : NULL;
    if (!c->pool.data || !c->q || !c->out) return false;
    fill((bf16 *)c->pool.data, pool_elems, 1);
    fill((bf16 *)c->q, (size_t)n * H * D, 2);
    int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * n_blocks), *qs = (int32_t *)malloc(4 * (n_seqs + 1)),
            *kl = (int32_t *)malloc(4 * n_seqs);
    for (int64_t i = 0; i < n_blocks; i++) perm[i] = (int32_t)i;
    kvs_rng rng;
    kvs_rng_seed(&rng, 7);
    for (int64_t i = n_blocks - 1; i > 0; i--) {
        int64_t j = (int64_t)(kvs_rng_u64(&rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int s = 0; s <= n_seqs; s++) qs[s] = s * q_len;
    for (int s = 0; s < n_seqs; s++) kl[s] = ctx;
    int32_t *d_qs = (int32_t *)b->alloc(b, 4 * (n_seqs + 1)), *d_kl = (int32_t *)b->alloc(b, 4 * n_seqs),
            *d_bt = (int32_t *)b->alloc(b, 4 * n_blocks);
    b->to_device(b, d_qs, qs, 4 * (n_seqs + 1));
    b->to_device(b, d_kl, kl, 4 * n_seqs);
    b->to_device(b, d_bt, perm, 4 * n_blocks);
    b->synchronize(b);
    c->ab = (kvs_attn_batch){n_seqs, n, nb, q_len, ctx, d_qs, d_kl, d_bt};
    c->n_heads = H;
    free(perm), free(qs), free(kl);
    return true;
}

static void attn_free(kvs_backend *b, attn_ctx *c) {
    b->free(b, c->pool.data), b->free(b, c->q), b->free(b, c->out), b->free(b, c->lse);
    b->free(b, (void *)c->ab.q_start), b->free(b, (void *)c->ab.kv_len), b->free(b, (void *)c->ab.block_tables);
}

int main(int argc, char **argv) {
    int device = argc > 1 ? atoi(argv[1]) : 0;
    kvs_backend *b;
    if (kvs_backend_cuda_create(device, &b) != KVS_OK) {
        fprintf(stderr, "kvs_bench_kernels: %s\n", kvs_last_error());
        return 1;
    }
    cudaSetDevice(device);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, device);
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

    /* copy bandwidth: 2 GiB buffers */
    copy_ctx cc = {NULL, NULL, (size_t)2 << 30};
    cc.src = b->alloc(b, cc.bytes), cc.dst = b->alloc(b, cc.bytes);
    if (!cc.src || !cc.dst) return fprintf(stderr, "out of memory\n"), 1;
    fill((bf16 *)cc.src, cc.bytes / 2, 3);
    double t_copy = time_it(b, 10, run_copy, &cc);
    double copy_bw = 2.0 * cc.bytes / t_copy / 1e9; /* GB/s read + written */
    b->free(b, cc.src), b->free(b, cc.dst);
    printf("copy: %.0f GB/s (read + write) over %zu MiB\n", copy_bw, cc.bytes >> 20);

    /* cuBLASLt GEMM 8192^3 */
    gemm_ctx gc = {NULL, NULL, NULL, 8192};
    size_t ge = (size_t)gc.n * gc.n;
    gc.in = b->alloc(b, ge * 2), gc.w = b->alloc(b, ge * 2), gc.out = b->alloc(b, ge * 2);
    fill((bf16 *)gc.in, ge, 4), fill((bf16 *)gc.w, ge, 5);
    double t_gemm = time_it(b, 10, run_gemm, &gc);
    double gemm_tf = 2.0 * gc.n * (double)gc.n * gc.n / t_gemm / 1e12;
    b->free(b, gc.in), b->free(b, gc.w), b->free(b, gc.out);
    printf("gemm: bf16 8192^3 %.1f TFLOP/s (%.3f ms)\n", gemm_tf, t_gemm * 1e3);

    /* decode attention: 64 x 4096 */
    attn_ctx dc;
    if (!attn_setup(b, &dc, 64, 4096, 1, false)) return fprintf(stderr, "out of memory\n"), 1;
    double t_dec = time_it(b, 20, run_attn, &dc);
    double kv_bytes = 64.0 * 4096 * 8 * 128 * 2 * 2;
    double dec_bw = kv_bytes / t_dec / 1e9;
    attn_free(b, &dc);
    printf("decode attention: batch 64 x 4096, 32/8 heads, d 128: %.3f ms, %.0f GB/s of KV read (%.0f%% of copy)\n",
           t_dec * 1e3, dec_bw, 100 * dec_bw / copy_bw);

    /* prefill attention: 4096 tokens, causal */
    attn_ctx pc;
    double pre_tf[2];
    for (int with_lse = 0; with_lse < 2; with_lse++) {
        if (!attn_setup(b, &pc, 1, 4096, 4096, with_lse)) return fprintf(stderr, "out of memory\n"), 1;
        double t_pre = time_it(b, 10, run_attn, &pc);
        double flops = 4.0 * 32 * 128 * (4096.0 * 4097 / 2);
        pre_tf[with_lse] = flops / t_pre / 1e12;
        attn_free(b, &pc);
        printf("prefill attention: 4096 tokens causal, 32/8 heads, d 128%s: %.3f ms, %.1f TFLOP/s (%.0f%% of gemm)\n",
               with_lse ? " + lse" : "", t_pre * 1e3, pre_tf[with_lse], 100 * pre_tf[with_lse] / gemm_tf);
    }
    b->synchronize(b);
    int failed = kvs_cuda_of(b)->failed;
    b->destroy(b);

    printf("\n| benchmark | result | same-run baseline | ratio |\n| --- | --- | --- | --- |\n");
    printf("| decode attention 64 x 4096, 32/8 x 128 | %.0f GB/s KV read (%.3f ms) | D2D copy %.0f GB/s | %.0f%% |\n",
           dec_bw, t_dec * 1e3, copy_bw, 100 * dec_bw / copy_bw);
    printf("| prefill attention 4096 causal, 32/8 x 128 | %.1f TFLOP/s | cuBLASLt bf16 8192^3 %.1f TFLOP/s | %.0f%% |\n",
           pre_tf[0], gemm_tf, 100 * pre_tf[0] / gemm_tf);
    printf("| prefill attention + lse | %.1f TFLOP/s | cuBLASLt bf16 8192^3 %.1f TFLOP/s | %.0f%% |\n", pre_tf[1],
           gemm_tf, 100 * pre_tf[1] / gemm_tf);
    if (failed) fprintf(stderr, "a CUDA call failed: %s\n", kvs_last_error());
    return failed ? 1 : 0;
}
