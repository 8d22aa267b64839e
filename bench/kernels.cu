/* Kernel microbenchmarks for the CUDA backend, each against a baseline
 * measured in the same run:
 *   - device-to-device copy bandwidth (bytes read + written per second)
 *   - cuBLASLt bf16 GEMM 8192^3 (TFLOP/s)
 *   - paged decode attention, batch 64 x 4096 context, Llama-3-8B shape
 *     (32 query heads, 8 KV heads, head_dim 128): KV bytes read per second, one
 *     line per decode variant (and variant 0 with a split target of 16 blocks
 *     per SM), plus the default in graph mode (max_kv_len and table stride 8x)
 *   - causal prefill attention, 4096 tokens, same shape: TFLOP/s, one line per
 *     prefill variant (bench/sdpa_prefill.py times PyTorch's SDPA at the same shape)
 *   - SnapKV cost for one layer of a 4000-token Llama-3-8B prompt: sparsity_scores
 *     (32 window queries x 4000 keys x 8 KV heads), the host selection (pool +
 *     top-k), kv_gather compaction (keep 2000), against the prefill of that layer
 *     (attention over 4000 tokens + its four GEMMs)
 * Times are wall clock around many queued launches between two stream syncs.
 * Usage: kvs_bench_kernels [device] */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda_internal.h"

extern "C" {
#include "kv/kv.h"
}

/* tuning knobs of cuda_attention.cu */
extern "C" int kvs_cuda_attn_prefill_variant;      /* 0: 4 warps x 32 rows, 1: 8 x 32, 2: 4 x 16, 3: 0 + FFMA/skip,
                                                       4-8: see cuda_attention.cu */
extern "C" int kvs_cuda_attn_decode_blocks_per_sm; /* split target of decode variants 0/1, default 8 */
extern "C" int kvs_cuda_attn_decode_variant;       /* 0: block pipeline, 1-3: per-warp rings (see cuda_attention.cu) */

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

    /* decode attention: 64 x 4096, every variant; then the default in graph mode */
    attn_ctx dc;
    double kv_bytes = 64.0 * 4096 * 8 * 128 * 2 * 2;
    enum { N_DEC = 6 };
    const char *dec_name[N_DEC] = {"v0 block pipeline, 8 blocks/SM", "v0 block pipeline, 16 blocks/SM",
                                   "v1 per-warp rings x3, 8 blocks/SM", "v2 per-warp rings x3, wave splits",
                                   "v3 per-warp rings x6, wave splits", "default, graph mode (max_kv_len 8x)"};
    const int dec_variant[N_DEC] = {0, 0, 1, 2, 3, -1}, dec_bps[N_DEC] = {8, 16, 8, 8, 8, 8};
    const int dec_default = kvs_cuda_attn_decode_variant;
    double dec_bw_v[N_DEC], t_dec_v[N_DEC];
    if (!attn_setup(b, &dc, 64, 4096, 1, false)) return fprintf(stderr, "out of memory\n"), 1;
    for (int v = 0; v < N_DEC; v++) {
        kvs_cuda_attn_decode_variant = dec_variant[v] < 0 ? dec_default : dec_variant[v];
        kvs_cuda_attn_decode_blocks_per_sm = dec_bps[v];
        attn_ctx gc_ = dc;
        if (dec_variant[v] < 0) gc_.ab.max_kv_len *= 8; /* the table stride stays: only max_kv_len is read */
        t_dec_v[v] = time_it(b, 50, run_attn, &gc_);
        dec_bw_v[v] = kv_bytes / t_dec_v[v] / 1e9;
        printf("decode attention: batch 64 x 4096, 32/8 heads, d 128, %s: %.3f ms, %.0f GB/s of KV read "
               "(%.0f%% of copy)\n",
               dec_name[v], t_dec_v[v] * 1e3, dec_bw_v[v], 100 * dec_bw_v[v] / copy_bw);
    }
    kvs_cuda_attn_decode_blocks_per_sm = 8;
    kvs_cuda_attn_decode_variant = dec_default;
    attn_free(b, &dc);

    /* prefill attention: 4096 tokens, causal; every variant (the default also with lse) */
    attn_ctx pc;
    enum { N_PRE = 12 };
    double pre_tf[N_PRE], flops = 4.0 * 32 * 128 * (4096.0 * 4097 / 2);
    const char *pre_name[N_PRE] = {"v0 4 warps x 32 rows", "v1 8 warps x 32 rows", "v2 4 warps x 16 rows",
                                   "v3 4 warps x 32 rows, FFMA + rescale skip",
                                   "v4 8 warps x 32 rows, FFMA + rescale skip",
                                   "v5 v3 with 32-key softmax steps (no spills)",
                                   "v6 v4 with 3 K/V stages",
                                   "v7 v3 without the rescale skip",
                                   "v8 v6 with 32-key softmax steps (no spills)",
                                   "v9 v7 with the m-tiles one after the other (ping-pong)",
                                   "v10 v9 with 32-key softmax steps (no spills)", "default + lse"};
    const int pre_default = kvs_cuda_attn_prefill_variant;
    const int pre_variant[N_PRE] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1};
    for (int v = 0; v < N_PRE; v++) {
        kvs_cuda_attn_prefill_variant = pre_variant[v] < 0 ? pre_default : pre_variant[v];
        if (!attn_setup(b, &pc, 1, 4096, 4096, pre_variant[v] < 0)) return fprintf(stderr, "out of memory\n"), 1;
        double t_pre = time_it(b, 20, run_attn, &pc);
        pre_tf[v] = flops / t_pre / 1e12;
        attn_free(b, &pc);
        printf("prefill attention: 4096 tokens causal, 32/8 heads, d 128, %s: %.3f ms, %.1f TFLOP/s (%.0f%% of gemm)\n",
               pre_name[v], t_pre * 1e3, pre_tf[v], 100 * pre_tf[v] / gemm_tf);
    }
    kvs_cuda_attn_prefill_variant = pre_default;

    /* SnapKV cost vs the prefill of one layer, 4000-token prompt, Llama-3-8B shape */
    const int P = 4000, W = 32, H = 32, KV = 8, D = 128, KEEP = 2000;
    double t_layer_attn, t_layer_gemm = 0, t_scores, t_gather, t_select;
    {
        attn_ctx lc;
        if (!attn_setup(b, &lc, 1, P, P, true)) return fprintf(stderr, "out of memory\n"), 1;
        t_layer_attn = time_it(b, 20, run_attn, &lc);
        /* GEMMs of the layer: qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096 */
        const int shapes[4][2] = {{4096, 6144}, {4096, 4096}, {4096, 28672}, {14336, 4096}};
        for (int i = 0; i < 4; i++) {
            struct lg { void *out, *in, *w; int n, in_dim, out_dim; } g = {NULL, NULL, NULL, P, shapes[i][0], shapes[i][1]};
            g.in = b->alloc(b, (size_t)P * g.in_dim * 2), g.w = b->alloc(b, (size_t)g.in_dim * g.out_dim * 2);
            g.out = b->alloc(b, (size_t)P * g.out_dim * 2);
            fill((bf16 *)g.in, (size_t)P * g.in_dim, 11 + i), fill((bf16 *)g.w, (size_t)g.in_dim * g.out_dim, 21 + i);
            auto fn = [](kvs_backend *bb, void *p) {
                lg *c = (lg *)p;
                bb->matmul(bb, c->out, c->in, c->w, NULL, c->n, c->in_dim, c->out_dim);
            };
            t_layer_gemm += time_it(b, 10, fn, &g);
            b->free(b, g.in), b->free(b, g.w), b->free(b, g.out);
        }
        /* sparsity_scores over the layer's 4000 - 32 keys */
        struct sc { float *scores; void *win_q; float *win_lse; kvs_kv_pool pool; const int32_t *table; int n_keys; } s_;
        s_.n_keys = P - W;
        s_.scores = (float *)b->alloc(b, sizeof(float) * KV * P);
        s_.win_q = b->alloc(b, (size_t)W * H * D * 2);
        s_.win_lse = (float *)b->alloc(b, sizeof(float) * W * H);
        fill((bf16 *)s_.win_q, (size_t)W * H * D, 31);
        cudaMemset(s_.win_lse, 0, sizeof(float) * W * H);
        s_.pool = lc.pool, s_.table = lc.ab.block_tables;
        t_scores = time_it(b, 50, [](kvs_backend *bb, void *p) {
            sc *c = (sc *)p;
            bb->sparsity_scores(bb, c->scores, c->win_q, c->win_lse, W, &c->pool, c->table, c->n_keys, H, 0.08838834764f);
        }, &s_);
        /* host selection as src/kv/sparsify.c does it: copy scores back, pool, top-k per KV head */
        float *scores = (float *)malloc(sizeof(float) * KV * s_.n_keys), *pooled = (float *)malloc(sizeof(float) * s_.n_keys);
        int32_t *keep = (int32_t *)malloc(sizeof(int32_t) * KV * KEEP);
        double t0 = kvs_now();
        for (int it = 0; it < 10; it++) {
            b->sparsity_scores(b, s_.scores, s_.win_q, s_.win_lse, W, &s_.pool, s_.table, s_.n_keys, H, 0.08838834764f);
            b->to_host(b, scores, s_.scores, sizeof(float) * KV * s_.n_keys);
            for (int h = 0; h < KV; h++) {
                kvs_kv_pool_scores(scores + (size_t)h * s_.n_keys, s_.n_keys, 7, pooled);
                kvs_kv_top_k_sorted(pooled, s_.n_keys, KEEP - W, keep + (size_t)h * KEEP);
            }
        }
        t_select = (kvs_now() - t0) / 10 - t_scores;
        /* kv_gather: keep every other entry (2000 of 4000) per head, in place */
        struct gc_ { kvs_kv_pool pool; const int32_t *blocks; int n_blocks; int32_t *src; } g_;
        int32_t *src = (int32_t *)malloc(sizeof(int32_t) * KV * KEEP);
        for (int h = 0; h < KV; h++)
            for (int i = 0; i < KEEP; i++) src[h * KEEP + i] = 2 * i;
        g_.pool = lc.pool, g_.blocks = lc.ab.block_tables, g_.n_blocks = (P + 15) / 16;
        g_.src = (int32_t *)b->alloc(b, sizeof(int32_t) * KV * KEEP);
        b->to_device(b, g_.src, src, sizeof(int32_t) * KV * KEEP);
        t_gather = time_it(b, 50, [](kvs_backend *bb, void *p) {
            gc_ *c = (gc_ *)p;
            bb->kv_gather(bb, &c->pool, c->blocks, c->n_blocks, c->src, KEEP);
        }, &g_);
        free(scores), free(pooled), free(keep), free(src);
        b->free(b, s_.scores), b->free(b, s_.win_q), b->free(b, s_.win_lse), b->free(b, g_.src);
        attn_free(b, &lc);
    }
    double t_layer = t_layer_attn + t_layer_gemm;
    printf("snapkv, one layer of a %d-token prompt: scores %.1f us, host select %.1f us, kv_gather %.1f us; "
           "prefill attention %.1f us + gemms %.1f us\n",
           P, t_scores * 1e6, t_select * 1e6, t_gather * 1e6, t_layer_attn * 1e6, t_layer_gemm * 1e6);
    b->synchronize(b);
    int failed = kvs_cuda_of(b)->failed;
    b->destroy(b);

    printf("\n| benchmark | result | same-run baseline | ratio |\n| --- | --- | --- | --- |\n");
    for (int v = 0; v < N_DEC; v++)
        printf("| decode attention 64 x 4096, 32/8 x 128, %s%s | %.0f GB/s KV read (%.3f ms) | D2D copy %.0f GB/s | %.0f%% |\n",
               dec_name[v], dec_variant[v] == dec_default && dec_bps[v] == 8 ? " (default)" : "", dec_bw_v[v],
               t_dec_v[v] * 1e3, copy_bw, 100 * dec_bw_v[v] / copy_bw);
    for (int v = 0; v < N_PRE; v++)
        printf("| prefill attention 4096 causal, 32/8 x 128, %s%s | %.1f TFLOP/s | cuBLASLt bf16 8192^3 %.1f TFLOP/s | %.0f%% |\n",
               pre_name[v], pre_variant[v] == pre_default ? " (default)" : "", pre_tf[v], gemm_tf,
               100 * pre_tf[v] / gemm_tf);
    printf("| sparsity_scores, 32 x 4000 x 8/32 heads | %.1f us | layer prefill attention %.1f us | %.2f%% |\n",
           t_scores * 1e6, t_layer_attn * 1e6, 100 * t_scores / t_layer_attn);
    printf("| scores + host select + kv_gather | %.1f us | layer prefill (attention + gemms) %.1f us | %.2f%% |\n",
           (t_scores + t_select + t_gather) * 1e6, t_layer * 1e6, 100 * (t_scores + t_select + t_gather) / t_layer);
    if (failed) fprintf(stderr, "a CUDA call failed: %s\n", kvs_last_error());
    return failed ? 1 : 0;
}
