/* Kernel microbenchmarks for the CUDA backend, each against a baseline
 * measured in the same run:
 *   - device-to-device copy bandwidth (bytes read + written per second)
 *   - cuBLASLt bf16 GEMM 8192^3 (TFLOP/s); FP8 (matmul_fp8, each scaling mode)
 *     beside bf16 at 8192^3 and at 4096 x 14336 -> 4096, with the activation
 *     quantization (bench/gemm_fp8.cuh)
 *   - paged decode attention, batch 64 x 4096 context, Llama-3-8B shape
 *     (32 query heads, 8 KV heads, head_dim 128): KV bytes read per second, the
 *     decode kernel, then in graph mode (max_kv_len 8x)
 *   - causal prefill attention, 4096 tokens, same shape: TFLOP/s, one line per
 *     prefill kernel (kvs_cuda_options.prefill: SMALL, HEAD, GQA, WGMMA on
 *     compute capability 9.0), the version kept in bench/prefill_versions.cuh
 *     (v0), the default with lse, the WGMMA kernel with and without lse and
 *     with its cp.async producer (diagnostic): v0's output checked against the
 *     default's, WGMMA's output and lse against GQA's, the cp.async producer's
 *     against the default WGMMA's; GQA and WGMMA at 16384 and 32768 tokens
 *     (one sequence, with lse; checked the same way); on an FP8 pool the default
 *     at 4096, then GQA (FA2-style) and WGMMA at 4096, 16384 and 32768 tokens
 *     (WGMMA's output and lse against GQA's)
 *     (bench/sdpa_prefill.py times PyTorch's SDPA at the same shape)
 *   - sampling 256 rows of 128,256 logits on the GPU (greedy, temperature,
 *     top-k + top-p + min-p; with logprobs) against copying them to the host as f32
 *   - SnapKV cost for one layer of a 4000-token Llama-3-8B prompt: sparsity_scores
 *     (32 window queries x 4000 keys x 8 KV heads), snapkv_select on the device
 *     (pool + top-k + window), kv_gather compaction (keep 2000), alone and queued
 *     together, against the prefill of that layer (attention over 4000 tokens +
 *     its four GEMMs): the target is <= 3%
 *   - fused ops against the unfused pairs they replace, same shapes, same run:
 *     add_rmsnorm vs add + rmsnorm (64 and 4096 rows x 4096), rope_kv_write vs
 *     rope(q) + rope(k) + kv_write (64 and 4096 tokens, 32/8 heads x 128), and
 *     with FP8 (compute capability 8.9+) add_rmsnorm_fp8 vs add_rmsnorm +
 *     quantize_fp8 (64 and 4096 x 4096), swiglu_fp8 vs swiglu + quantize_fp8
 *     (64 and 4096 x 14336):
 *     time, the fused op's nominal bytes per second as a share of copy
 *     bandwidth, and the speed-up
 * Times are wall clock around many queued launches between two stream syncs.
 *   - SnapKV batches as the engine runs them (snapkv_compact_batch): decode-time
 *     recompactions (64 and 240 pairs of 432 entries -> 400) and a prompt's (30 x 4000 -> 400)
 *   - global -> shared memory bandwidth, every SM: 16-byte cp.async and 4 KiB bulk copies from
 *     L2-resident and HBM regions (bench/l2_bandwidth.cuh; mode l2)
 *   - cuBLASLt's first bf16 GEMM algorithm against its next 15, Llama-3-8B shapes at
 *     8,192 / 4,096 / 256 / 128 rows (bench/gemm_algos.cuh)
 *   - ablate: the WGMMA prefill's bench variants at 4k/16k/32k (bench_ablate)
 * Usage: kvs_bench_kernels [device] [gemm | fp8 | snapkv | gemmalgo | ablate | l2]   (gemm: the GEMM rates alone; snapkv:
 * the batches alone; gemmalgo: the GEMM algorithms alone; ablate: the WGMMA prefill's variants alone; fp8: copy,
 * decode attention on bf16 and FP8 caches (and the FP8 prefill lines), the fused ops) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mma.cuh"
#include "prefill_versions.cuh"

extern "C" {
#include "backend/sample.h"
#include "kv/kv.h"
}

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

#include "gemm_fp8.cuh"
#include "gemm_algos.cuh"
#include "backend/cuda/cuda_wgmma.cuh"
#include "l2_bandwidth.cuh"

struct sample_ctx { void *logits; int32_t *ids; float *lp; kvs_sample_row *params; float *host; int n, vocab; };
static void run_sample(kvs_backend *b, void *p) {
    sample_ctx *c = (sample_ctx *)p;
    b->sample(b, c->ids, c->lp, c->logits, c->n, c->vocab, c->vocab, c->params);
}
struct logits_ctx {
    void *logits, *out;
    kvs_process_row *rows;
    kvs_logit_adjust *adjust;
    uint32_t *masks, *h_masks;
    int32_t *ids, *top_ids;
    float *lp, *top_lp;
    int n, vocab, k;
};
static void run_masks_h2d(kvs_backend *b, void *p) {
    logits_ctx *c = (logits_ctx *)p;
    b->to_device(b, c->masks, c->h_masks, (size_t)c->n * ((c->vocab + 31) / 32) * 4);
}
static void run_process(kvs_backend *b, void *p) {
    logits_ctx *c = (logits_ctx *)p;
    b->process_logits(b, c->out, c->vocab, c->logits, c->vocab, c->n, c->vocab, c->rows, c->adjust, c->masks);
}
static void run_top(kvs_backend *b, void *p) {
    logits_ctx *c = (logits_ctx *)p;
    b->top_logprobs(b, c->lp, c->top_ids, c->top_lp, c->logits, c->n, c->vocab, c->vocab, c->ids, c->k);
}
static void run_logits_d2h(kvs_backend *b, void *p) {
    sample_ctx *c = (sample_ctx *)p;
    b->to_host_f32(b, c->host, c->logits, (size_t)c->n * c->vocab);
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
static void run_attn_v0(kvs_backend *b, void *p) {
    attn_ctx *c = (attn_ctx *)p;
    prefill_v0::attention(b, c->out, c->lse, c->q, &c->pool, &c->ab, c->n_heads, 0.08838834764f);
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
    if (b->kv_dtype == KVS_F8_E4M3) { /* FP8 pools: random codes of magnitude < 2, no NaN code (0x7f, 0xff) */
        uint8_t *codes = (uint8_t *)malloc(pool_elems);
        kvs_rng crng;
        kvs_rng_seed(&crng, 3);
        for (size_t i = 0; i < pool_elems; i++) {
            const uint64_t r = kvs_rng_u64(&crng);
            codes[i] = (uint8_t)((r & 0x80) | (r >> 8) % 0x40);
        }
        b->to_device(b, c->pool.data, codes, pool_elems);
        free(codes);
    }
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

/* fused ops vs the unfused pairs */
struct norm_ctx { void *x, *xn, *y, *w; int n, dim; };
static void run_add_rmsnorm(kvs_backend *b, void *p) {
    norm_ctx *c = (norm_ctx *)p;
    b->add_rmsnorm(b, c->x, c->xn, c->y, c->w, c->n, c->dim, 1e-5f);
}
static void run_add_then_rmsnorm(kvs_backend *b, void *p) {
    norm_ctx *c = (norm_ctx *)p;
    b->add(b, c->x, c->y, (size_t)c->n * c->dim);
    b->rmsnorm(b, c->xn, c->x, c->w, c->n, c->dim, 1e-5f);
}

/* the fp8 activation ops: the norm's or swiglu's output quantized in the op, vs the pair */
struct quant_ctx { norm_ctx norm; void *gate_up, *act; uint8_t *q; float *s; };
static void run_add_rmsnorm_fp8(kvs_backend *b, void *p) {
    quant_ctx *c = (quant_ctx *)p;
    b->add_rmsnorm_fp8(b, c->norm.x, c->q, c->s, c->norm.y, c->norm.w, c->norm.n, c->norm.dim, 1e-5f);
}
static void run_add_rmsnorm_then_quantize(kvs_backend *b, void *p) {
    quant_ctx *c = (quant_ctx *)p;
    b->add_rmsnorm(b, c->norm.x, c->norm.xn, c->norm.y, c->norm.w, c->norm.n, c->norm.dim, 1e-5f);
    b->quantize_fp8(b, c->q, c->s, c->norm.xn, KVS_BF16, c->norm.n, c->norm.dim);
}
static void run_swiglu_fp8(kvs_backend *b, void *p) {
    quant_ctx *c = (quant_ctx *)p;
    b->swiglu_fp8(b, c->q, c->s, c->gate_up, c->norm.n, c->norm.dim);
}
static void run_swiglu_then_quantize(kvs_backend *b, void *p) {
    quant_ctx *c = (quant_ctx *)p;
    b->swiglu(b, c->act, c->gate_up, c->norm.n, c->norm.dim);
    b->quantize_fp8(b, c->q, c->s, c->act, KVS_BF16, c->norm.n, c->norm.dim);
}

struct rope_ctx { kvs_kv_pool pool; void *q, *k, *v, *qkv; int32_t *pos, *slots; float *inv_freq; int n, n_heads; };
static void run_rope_kv_write(kvs_backend *b, void *p) {
    rope_ctx *c = (rope_ctx *)p;
    b->rope_kv_write(b, &c->pool, c->q, c->qkv, c->pos, c->inv_freq, c->slots, c->n, c->n_heads);
}
static void run_rope_then_kv_write(kvs_backend *b, void *p) {
    rope_ctx *c = (rope_ctx *)p;
    b->rope(b, c->q, c->pos, c->inv_freq, c->n, c->n_heads, c->pool.head_dim);
    b->rope(b, c->k, c->pos, c->inv_freq, c->n, c->pool.n_kv_heads, c->pool.head_dim);
    b->kv_write(b, &c->pool, c->k, c->v, c->slots, c->n);
}

/* One fused-op measurement: fused and unfused times, the fused op's nominal bytes. */
struct fused_result { const char *what; int n; double t_fused, t_unfused, bytes; };

static fused_result bench_add_rmsnorm(kvs_backend *b, int n, int dim) {
    norm_ctx c = {NULL, NULL, NULL, NULL, n, dim};
    size_t t = (size_t)n * dim;
    c.x = b->alloc(b, t * 2), c.xn = b->alloc(b, t * 2), c.y = b->alloc(b, t * 2), c.w = b->alloc(b, (size_t)dim * 2);
    fill((bf16 *)c.x, t, 41), fill((bf16 *)c.y, t, 42), fill((bf16 *)c.w, dim, 43);
    /* x grows by y each call: values stay finite over the iterations (|y| <= 1, a few hundred calls) */
    fused_result r = {"add_rmsnorm", n, 0, 0, 4.0 * t * 2 + dim * 2.0};
    r.t_fused = time_it(b, 200, run_add_rmsnorm, &c);
    r.t_unfused = time_it(b, 200, run_add_then_rmsnorm, &c);
    b->free(b, c.x), b->free(b, c.xn), b->free(b, c.y), b->free(b, c.w);
    return r;
}

/* add_rmsnorm_fp8 (mlp false) or swiglu_fp8 on n x dim (swiglu: gate_up n x 2 dim);
 * nominal bytes: x, y read, x and the codes written; gate_up read, the codes written */
static fused_result bench_fp8_act(kvs_backend *b, bool mlp, int n, int dim) {
    quant_ctx c = {};
    size_t t = (size_t)n * dim;
    c.norm.n = n, c.norm.dim = dim;
    c.q = (uint8_t *)b->alloc(b, t), c.s = (float *)b->alloc(b, sizeof(float) * n);
    fused_result r = {mlp ? "swiglu_fp8" : "add_rmsnorm_fp8", n, 0, 0, mlp ? 5.0 * t : 7.0 * t + dim * 2.0};
    if (mlp) {
        c.gate_up = b->alloc(b, t * 4), c.act = b->alloc(b, t * 2);
        fill((bf16 *)c.gate_up, 2 * t, 44);
        r.t_fused = time_it(b, 200, run_swiglu_fp8, &c);
        r.t_unfused = time_it(b, 200, run_swiglu_then_quantize, &c);
        b->free(b, c.gate_up), b->free(b, c.act);
    } else {
        norm_ctx &m = c.norm;
        m.x = b->alloc(b, t * 2), m.xn = b->alloc(b, t * 2), m.y = b->alloc(b, t * 2), m.w = b->alloc(b, (size_t)dim * 2);
        fill((bf16 *)m.x, t, 41), fill((bf16 *)m.y, t, 42), fill((bf16 *)m.w, dim, 43);
        r.t_fused = time_it(b, 200, run_add_rmsnorm_fp8, &c);
        r.t_unfused = time_it(b, 200, run_add_rmsnorm_then_quantize, &c);
        b->free(b, m.x), b->free(b, m.xn), b->free(b, m.y), b->free(b, m.w);
    }
    b->free(b, c.q), b->free(b, c.s);
    return r;
}

static fused_result bench_rope_kv_write(kvs_backend *b, int n) {
    const int H = 32, KV = 8, D = 128, BS = 16;
    rope_ctx c;
    c.n = n, c.n_heads = H;
    int64_t nb = (n + BS - 1) / BS;
    c.pool = (kvs_kv_pool){b->alloc(b, (size_t)nb * 2 * KV * BS * D * 2), nb, BS, KV, D};
    c.q = b->alloc(b, (size_t)n * H * D * 2), c.k = b->alloc(b, (size_t)n * KV * D * 2);
    c.v = b->alloc(b, (size_t)n * KV * D * 2), c.qkv = b->alloc(b, (size_t)n * (H + 2 * KV) * D * 2);
    fill((bf16 *)c.q, (size_t)n * H * D, 51), fill((bf16 *)c.k, (size_t)n * KV * D, 52);
    fill((bf16 *)c.v, (size_t)n * KV * D, 53), fill((bf16 *)c.qkv, (size_t)n * (H + 2 * KV) * D, 54);
    int32_t *pos = (int32_t *)malloc(4 * n), *slots = (int32_t *)malloc(4 * n);
    float inv_freq[D / 2];
    for (int i = 0; i < n; i++) pos[i] = 4000 + i, slots[i] = i;
    for (int k = 0; k < D / 2; k++) inv_freq[k] = powf(500000.0f, -2.0f * k / D);
    c.pos = (int32_t *)b->alloc(b, 4 * n), c.slots = (int32_t *)b->alloc(b, 4 * n);
    c.inv_freq = (float *)b->alloc(b, sizeof inv_freq);
    b->to_device(b, c.pos, pos, 4 * n), b->to_device(b, c.slots, slots, 4 * n);
    b->to_device(b, c.inv_freq, inv_freq, sizeof inv_freq);
    b->synchronize(b);
    /* q read (from the QKV rows) and written, k read, v read, k and v written to the pool */
    fused_result r = {"rope_kv_write", n, 0, 0, (double)n * (4.0 * H * D + 8.0 * KV * D)};
    r.t_fused = time_it(b, 200, run_rope_kv_write, &c);
    r.t_unfused = time_it(b, 200, run_rope_then_kv_write, &c);
    b->free(b, c.pool.data), b->free(b, c.q), b->free(b, c.k), b->free(b, c.v), b->free(b, c.qkv);
    b->free(b, c.pos), b->free(b, c.slots), b->free(b, c.inv_freq);
    free(pos), free(slots);
    return r;
}

/* The fused ops vs the unfused pairs (Llama-3-8B shapes; decode batch 64 and a
 * 4096-token prefill): 4 results, 8 with the FP8 activation ops. */
static int bench_fused(kvs_backend *b, fused_result *fr) {
    fr[0] = bench_add_rmsnorm(b, 64, 4096), fr[1] = bench_add_rmsnorm(b, 4096, 4096);
    fr[2] = bench_rope_kv_write(b, 64), fr[3] = bench_rope_kv_write(b, 4096);
    if (!b->add_rmsnorm_fp8) return 4;
    fr[4] = bench_fp8_act(b, false, 64, 4096), fr[5] = bench_fp8_act(b, false, 4096, 4096);
    fr[6] = bench_fp8_act(b, true, 64, 14336), fr[7] = bench_fp8_act(b, true, 4096, 14336);
    return 8;
}

static void print_fused(const fused_result *fr, int n, double copy_bw) {
    for (int i = 0; i < n; i++)
        printf("fused %s, %d rows: %.2f us (%.0f GB/s, %.0f%% of copy) vs unfused %.2f us: %.2fx\n", fr[i].what,
               fr[i].n, fr[i].t_fused * 1e6, fr[i].bytes / fr[i].t_fused / 1e9,
               100 * fr[i].bytes / fr[i].t_fused / 1e9 / copy_bw, fr[i].t_unfused * 1e6,
               fr[i].t_unfused / fr[i].t_fused);
}

static void attn_free(kvs_backend *b, attn_ctx *c) {
    b->free(b, c->pool.data), b->free(b, c->q), b->free(b, c->out), b->free(b, c->lse);
    b->free(b, (void *)c->ab.q_start), b->free(b, (void *)c->ab.kv_len), b->free(b, (void *)c->ab.block_tables);
}

/* The largest |difference| of the output (and lse) of the attention just run on c
 * (n tokens, 32 heads x 128) from prefill kernel `ref`'s (run on the same
 * inputs; NaN counts as infinite). */
static double max_diff_against(kvs_backend *b, attn_ctx *c, int n, int ref, double *worst_l) {
    kvs_cuda *bc = kvs_cuda_of(b);
    size_t n_out = (size_t)n * 32 * 128, n_l = (size_t)n * 32;
    float *got = (float *)malloc(n_out * 4), *want = (float *)malloc(n_out * 4);
    float *got_l = (float *)malloc(n_l * 4), *want_l = (float *)malloc(n_l * 4);
    b->to_host_f32(b, got, c->out, n_out);
    if (c->lse) b->to_host(b, got_l, c->lse, n_l * 4);
    const int kernel = bc->prefill;
    bc->prefill = ref;
    run_attn(b, c);
    bc->prefill = kernel;
    b->to_host_f32(b, want, c->out, n_out);
    if (c->lse) b->to_host(b, want_l, c->lse, n_l * 4);
    double worst = 0;
    *worst_l = 0;
    for (size_t i = 0; i < n_out; i++) worst = fmax(worst, isnan(got[i]) ? INFINITY : fabs((double)got[i] - want[i]));
    for (size_t i = 0; c->lse && i < n_l; i++)
        *worst_l = fmax(*worst_l, isnan(got_l[i]) ? INFINITY : fabs((double)got_l[i] - want_l[i]));
    free(got), free(want), free(got_l), free(want_l);
    return worst;
}

/* Prefill attention on an FP8 pool (backend b8), one sequence of n tokens causal,
 * 32/8 heads x 128, with lse: the FA2-style kernel (GQA: codes decoded in shared
 * memory) and, where wgmma_why is NULL, the WGMMA kernel (its producer warpgroup
 * converting the codes), WGMMA's output and lse against GQA's on the same inputs. */
static bool bench_prefill_fp8(kvs_backend *b8, int n, const char *wgmma_why) {
    kvs_cuda *c8 = kvs_cuda_of(b8);
    const int kernels[2] = {KVS_CUDA_PREFILL_GQA, KVS_CUDA_PREFILL_WGMMA};
    const char *names[2] = {"GQA (FA2-style, codes decoded in shared memory)",
                            "WGMMA (producer warpgroup converting the codes)"};
    double tf[2] = {0, 0};
    for (int v = 0; v < 2; v++) {
        if (v == 1 && wgmma_why) {
            printf("prefill attention FP8 KV: %d tokens, %s: skipped (%s)\n", n, names[v], wgmma_why);
            continue;
        }
        attn_ctx p8;
        c8->prefill = kernels[v];
        if (!attn_setup(b8, &p8, 1, n, n, true)) return false;
        double t = time_it(b8, n > 16384 ? 3 : n > 4096 ? 5 : 20, run_attn, &p8);
        tf[v] = 4.0 * 32 * 128 * ((double)n * (n + 1) / 2) / t / 1e12;
        printf("prefill attention FP8 KV: %d tokens causal, 32/8 heads, d 128, + lse, %s: %.3f ms, %.1f TFLOP/s", n,
               names[v], t * 1e3, tf[v]);
        if (v == 1) {
            double worst_l, worst = max_diff_against(b8, &p8, n, KVS_CUDA_PREFILL_GQA, &worst_l);
            printf(" (%.2fx GQA); against GQA: max |difference| %.3g, lse %.3g", tf[1] / tf[0], worst, worst_l);
        }
        printf("\n");
        attn_free(b8, &p8);
    }
    c8->prefill = KVS_CUDA_PREFILL_AUTO;
    return true;
}

/* kvs_bench_kernels [device] ablate: where a tile's time goes in the WGMMA prefill (docs/CUDA.md "Where a tile's
 * time goes"). One sequence of 4096, 16384 and 32768 tokens, causal, 32/8 heads x 128, with lse, bf16 pool (the
 * long prefill rows' setup); each row a compiled variant of the kernel (kvs_cuda.wgmma_variant, KVS_WG_AB_*):
 * time, TFLOP/s counted as the full causal FLOP for every row (rows compare by time), the time a 128-key tile
 * takes an SM (time x SMs / the tiles the CTAs walk) and the ratio to the default's time. The default's output
 * and lse are checked against GQA's, the variants that compute what the default does against the default's
 * (expect exactly 0: the same arithmetic); the DIAG rows print the clock64
 * breakdown of a consumer warpgroup's tile loop; the last row runs the default again (the drift within the
 * call, against the first row's time). */
static bool bench_ablate(kvs_backend *b, int n_sms, const char *wgmma_why) {
    if (wgmma_why) {
        printf("ablate: skipped (%s)\n", wgmma_why);
        return true;
    }
    kvs_cuda *bc = kvs_cuda_of(b);
    enum { NO_V = KVS_WG_AB_NO_V, NO_LOAD = KVS_WG_AB_NO_LOAD, NO_EXP = KVS_WG_AB_NO_EXP,
           NO_SM = KVS_WG_AB_NO_SOFTMAX, DIAG = KVS_WG_AB_DIAG,
           CP = KVS_WG_AB_CP_ASYNC };
    struct ab_row {
        const char *name;
        int ab;
        int check; /* 0: none, 1: against GQA, 2: against the default (expect 0) */
    };
    const ab_row rows[] = {
        {"default", 0, 1},
        {"CP_ASYNC (K/V by the producer's cp.async)", CP, 2},
        {"CP_ASYNC + NO_LOAD", CP | NO_LOAD, 0},
        {"NO_V (the producer loads K only)", NO_V, 0},
        {"NO_LOAD (no copies after the first 3 tiles)", NO_LOAD, 0},
        {"NO_EXP (softmax without its ex2)", NO_EXP, 0},
        {"NO_SOFTMAX (P = S)", NO_SM, 0},
        {"NO_LOAD + NO_SOFTMAX (wgmma + barriers)", NO_LOAD | NO_SM, 0},
        {"DIAG (clock64 counters)", DIAG, 2},
        {"DIAG + CP_ASYNC", DIAG | CP, 2},
        {"default again (the call's drift)", 0, 2},
    };
    const int ns[3] = {4096, 16384, 32768};
    for (int ni = 0; ni < 3; ni++) {
        const int n = ns[ni];
        attn_ctx c;
        if (!attn_setup(b, &c, 1, n, n, true)) return false;
        /* 128-key tiles the CTAs walk (the unit of "a tile" below whatever the kernel's tile
           width: the default's are 176 keys): 4 heads x 32 positions a CTA, keys 0 .. q0 + 31 */
        double tiles = 0;
        for (int q0 = 0; q0 < n; q0 += 32) tiles += 8 * ((q0 + 32 + 127) / 128);
        const double flops = 4.0 * 32 * 128 * ((double)n * (n + 1) / 2);
        const int iters = n > 16384 ? 6 : n > 4096 ? 10 : 30;
        const size_t n_out = (size_t)n * 32 * 128, n_l = (size_t)n * 32;
        float *want = (float *)malloc(n_out * 4), *want_l = (float *)malloc(n_l * 4);
        float *got = (float *)malloc(n_out * 4), *got_l = (float *)malloc(n_l * 4);
        double t_def = 0;
        for (const ab_row &r : rows) {
            bc->prefill = KVS_CUDA_PREFILL_WGMMA;
            bc->wgmma_variant = r.ab;
            kvs_cuda_wgmma_diag_reset();
            const double t = time_it(b, iters, run_attn, &c);
            unsigned long long d[KVS_WG_DIAG_N];
            kvs_cuda_wgmma_diag_read(d);
            if (r.ab == 0 && r.check == 1) t_def = t; /* the first row */
            printf("ablate: %d tokens, %-44s %8.3f ms %6.1f TFLOP/s %6.3f us a 128-key tile a SM, %.3fx the default's time", n,
                   r.name, t * 1e3, flops / t / 1e12, t * 1e6 * n_sms / tiles, t / t_def);
            if (r.check == 1) {
                b->to_host_f32(b, want, c.out, n_out);
                b->to_host(b, want_l, c.lse, n_l * 4);
                double worst_l, worst = max_diff_against(b, &c, n, KVS_CUDA_PREFILL_GQA, &worst_l);
                printf("; against GQA: max |difference| %.3g, lse %.3g", worst, worst_l);
            } else if (r.check == 2) { /* this row's output (the last launch) against the default's */
                b->to_host_f32(b, got, c.out, n_out);
                b->to_host(b, got_l, c.lse, n_l * 4);
                double worst = 0, worst_l = 0;
                for (size_t i = 0; i < n_out; i++)
                    worst = fmax(worst, isnan(got[i]) ? INFINITY : fabs((double)got[i] - want[i]));
                for (size_t i = 0; i < n_l; i++)
                    worst_l = fmax(worst_l, isnan(got_l[i]) ? INFINITY : fabs((double)got_l[i] - want_l[i]));
                printf("; against the default: max |difference| %.3g, lse %.3g", worst, worst_l);
            }
            printf("\n");
            if ((r.ab & DIAG) && d[KVS_WG_DIAG_ITERS] > 0 && d[KVS_WG_DIAG_CTA_NS] > 0) {
                const double it = (double)d[KVS_WG_DIAG_ITERS], ghz = (double)d[KVS_WG_DIAG_CTA_CYCLES] / d[KVS_WG_DIAG_CTA_NS];
                const double loop = d[KVS_WG_DIAG_LOOP] / it, full = d[KVS_WG_DIAG_FULL] / it, ws = d[KVS_WG_DIAG_WAIT_S] / it;
                const double sm = d[KVS_WG_DIAG_SOFTMAX] / it, wpv = d[KVS_WG_DIAG_WAIT_PV] / it, tail = d[KVS_WG_DIAG_TAIL] / it;
                printf("ablate: %d tokens, %s: a consumer warpgroup's loop %.0f cycles a tile (%.3f us at the measured %.3f GHz; "
                       "%.1f tiles a warpgroup): full-barrier waits %.0f, wgmma wait for S %.0f, softmax %.0f, wgmma wait for "
                       "P V %.0f, %s %.0f, the rest (wgmma issue, first / last tile) %.0f; the producer "
                       "waits on empty barriers %.1f%% of its loop (%.0f cycles a tile)\n",
                       n, r.name, loop, loop / ghz / 1e3, ghz, it / d[KVS_WG_DIAG_WGS], full, ws, sm, wpv,
                       "V release + pack (the rescale: in the rest)", tail,
                       loop - full - ws - sm - wpv - tail, 100.0 * d[KVS_WG_DIAG_PROD_EMPTY] / fmax(1.0, (double)d[KVS_WG_DIAG_PROD_LOOP]),
                       (double)d[KVS_WG_DIAG_PROD_LOOP] / fmax(1.0, (double)d[KVS_WG_DIAG_PROD_TILES]));
            }
        }
        bc->wgmma_variant = 0;
        free(want), free(want_l), free(got), free(got_l);
        attn_free(b, &c);
    }
    bc->prefill = KVS_CUDA_PREFILL_AUTO;
    return true;
}

/* SnapKV batches as the engine runs them (src/kv/sparsify.c run_batch: one snapkv_compact_batch for every
 * pair due in a step), Llama-3-8B shape (32/8 heads x 128), window 32, pool 7: the decode-time
 * recompactions (a layer at budget + window, 432 entries, back to 400: 64 and 240 pairs) and the prompts'
 * (4000 entries to 400: 30 pairs, one prompt's sparse layers); time a batch and a pair. Compacting the same
 * blocks again each time: the cost does not depend on the data. */
struct snapkv_batch_ctx { kvs_kv_pool pool; kvs_snapkv_batch batch; };
static void run_snapkv_batch(kvs_backend *b, void *p) {
    snapkv_batch_ctx *c = (snapkv_batch_ctx *)p;
    b->snapkv_compact_batch(b, &c->pool, &c->batch);
}
static bool bench_snapkv_batches(kvs_backend *b) {
    const int H = 32, KV = 8, D = 128, W = 32, BS = 16;
    const struct { const char *name; int jobs, keys, keep; } cases[] = {
        {"decode-time recompaction", 64, 432, 400}, {"decode-time recompaction", 240, 432, 400},
        {"the prompt's compaction", 30, 4000, 400}};
    for (const auto &cs : cases) {
        const int nb = (cs.keys + BS - 1) / BS, n_keys = cs.keys - W;
        snapkv_batch_ctx c = {};
        size_t pool_elems = (size_t)cs.jobs * nb * 2 * KV * BS * D;
        c.pool = (kvs_kv_pool){b->alloc(b, pool_elems * 2), (int64_t)cs.jobs * nb, BS, KV, D};
        void *win_q = b->alloc(b, (size_t)cs.jobs * W * H * D * 2);
        float *win_lse = (float *)b->alloc(b, sizeof(float) * cs.jobs * W * H);
        kvs_snapkv_job *jobs = (kvs_snapkv_job *)malloc(sizeof(kvs_snapkv_job) * cs.jobs);
        int32_t *tables = (int32_t *)malloc(sizeof(int32_t) * cs.jobs * nb);
        for (int j = 0; j < cs.jobs; j++) {
            for (int i = 0; i < nb; i++) tables[j * nb + i] = j * nb + i;
            jobs[j] = (kvs_snapkv_job){(const char *)win_q + (size_t)j * W * H * D * 2, win_lse + (size_t)j * W * H,
                                       NULL, (int64_t)j * KV * n_keys, (int64_t)j * KV * cs.keep, j * nb, nb, n_keys,
                                       W, cs.keep - W, 7};
        }
        kvs_snapkv_job *d_jobs = (kvs_snapkv_job *)b->alloc(b, sizeof(kvs_snapkv_job) * cs.jobs);
        int32_t *d_tables = (int32_t *)b->alloc(b, sizeof(int32_t) * cs.jobs * nb);
        float *scores = (float *)b->alloc(b, sizeof(float) * cs.jobs * KV * n_keys);
        int32_t *keep = (int32_t *)b->alloc(b, sizeof(int32_t) * cs.jobs * KV * cs.keep);
        if (!c.pool.data || !win_q || !win_lse || !d_jobs || !d_tables || !scores || !keep) return false;
        fill((bf16 *)c.pool.data, pool_elems, 41), fill((bf16 *)win_q, (size_t)cs.jobs * W * H * D, 42);
        cudaMemset(win_lse, 0, sizeof(float) * cs.jobs * W * H);
        b->to_device(b, d_jobs, jobs, sizeof(kvs_snapkv_job) * cs.jobs);
        b->to_device(b, d_tables, tables, sizeof(int32_t) * cs.jobs * nb);
        c.batch = (kvs_snapkv_batch){cs.jobs, H, 0.08838834764f, d_jobs, d_tables, scores, keep, n_keys,
                                     (int64_t)cs.jobs * KV * n_keys};
        double t = time_it(b, 20, run_snapkv_batch, &c);
        printf("snapkv batch, %s: %d pairs of %d entries -> %d: %.1f us a batch, %.2f us a pair\n", cs.name,
               cs.jobs, cs.keys, cs.keep, t * 1e6, t * 1e6 / cs.jobs);
        b->free(b, c.pool.data), b->free(b, win_q), b->free(b, win_lse), b->free(b, d_jobs), b->free(b, d_tables);
        b->free(b, scores), b->free(b, keep);
        free(jobs), free(tables);
    }
    return true;
}

int main(int argc, char **argv) {
    int device = argc > 1 ? atoi(argv[1]) : 0;
    kvs_backend *b;
    kvs_cuda_options opt = {};
    opt.device = device;
    if (kvs_backend_cuda_create(&opt, &b) != KVS_OK) {
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

    if (argc > 2 && !strcmp(argv[2], "gemmalgo")) { /* the heuristic's GEMM algorithm against its next ones */
        bool ok = bench_gemm_algos(b);
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed || !ok ? 1 : 0;
    }
    if (argc > 2 && !strcmp(argv[2], "snapkv")) { /* the SnapKV batches alone */
        bool ok = bench_snapkv_batches(b);
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed || !ok ? 1 : 0;
    }
    if (argc > 2 && !strcmp(argv[2], "l2")) { /* global -> shared memory bandwidth alone */
        bool ok = bench_l2_bandwidth(b, prop.multiProcessorCount);
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed || !ok ? 1 : 0;
    }
    if (argc > 2 && !strcmp(argv[2], "ablate")) { /* the WGMMA prefill's variants alone */
        bool ok = bench_ablate(b, prop.multiProcessorCount, kvs_cuda_wgmma_supported(device));
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed || !ok ? 1 : 0;
    }
    const bool only_fp8 = argc > 2 && !strcmp(argv[2], "fp8");
    if (only_fp8) {
        fused_result fr[8];
        int n_fused = bench_fused(b, fr);
        print_fused(fr, n_fused, copy_bw);
        /* the decode lines below: bf16, then the FP8 cache (its prefill line too) */
    }

    /* cuBLASLt GEMM 8192^3 */
    double gemm_tf = 0;
    gemm_rates rates[N_GEMM_SHAPES];
    bool have_rates = false;
    if (!only_fp8) {
        gemm_ctx gc = {NULL, NULL, NULL, 8192};
        size_t ge = (size_t)gc.n * gc.n;
        gc.in = b->alloc(b, ge * 2), gc.w = b->alloc(b, ge * 2), gc.out = b->alloc(b, ge * 2);
        fill((bf16 *)gc.in, ge, 4), fill((bf16 *)gc.w, ge, 5);
        double t_gemm = time_it(b, 10, run_gemm, &gc);
        gemm_tf = 2.0 * gc.n * (double)gc.n * gc.n / t_gemm / 1e12;
        b->free(b, gc.in), b->free(b, gc.w), b->free(b, gc.out);
        printf("gemm: bf16 8192^3 %.1f TFLOP/s (%.3f ms)\n", gemm_tf, t_gemm * 1e3);
        have_rates = bench_gemm_rates(b, rates);
    }
    if (argc > 2 && !strcmp(argv[2], "gemm")) {
        if (have_rates) printf("\n"), print_gemm_rates(rates);
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed || !have_rates ? 1 : 0;
    }

    /* decode attention: 64 x 4096, the per-warp kernel; then in graph mode */
    attn_ctx dc;
    double kv_bytes = 64.0 * 4096 * 8 * 128 * 2 * 2;
    enum { N_DEC = 2 };
    const char *dec_name[N_DEC] = {"per-warp rings x3, wave splits", "graph mode (max_kv_len 8x)"};
    const int dec_graph[N_DEC] = {0, 1};
    double dec_bw_v[N_DEC], t_dec_v[N_DEC];
    if (!attn_setup(b, &dc, 64, 4096, 1, false)) return fprintf(stderr, "out of memory\n"), 1;
    for (int v = 0; v < N_DEC; v++) {
        attn_ctx gc_ = dc;
        if (dec_graph[v]) gc_.ab.max_kv_len *= 8; /* the table stride stays: only max_kv_len is read */
        t_dec_v[v] = time_it(b, 50, run_attn, &gc_);
        dec_bw_v[v] = kv_bytes / t_dec_v[v] / 1e9;
        printf("decode attention: batch 64 x 4096, 32/8 heads, d 128, %s: %.3f ms, %.0f GB/s of KV read "
               "(%.0f%% of copy)\n",
               dec_name[v], t_dec_v[v] * 1e3, dec_bw_v[v], 100 * dec_bw_v[v] / copy_bw);
    }
    attn_free(b, &dc);

    /* the same with an FP8 KV cache (--kv-cache-dtype fp8): half the bytes per entry;
       and the default prefill kernel on it (FP8 tiles decoded in shared memory) */
    kvs_cuda_options opt8 = opt;
    opt8.kv_fp8 = true;
    kvs_backend *b8 = NULL;
    if (kvs_backend_cuda_create(&opt8, &b8) == KVS_OK) {
        attn_ctx d8;
        if (!attn_setup(b8, &d8, 64, 4096, 1, false)) return fprintf(stderr, "out of memory\n"), 1;
        const char *dec8_name[N_DEC] = {"codes into the mma fragments, 4-stage rings, wave splits",
                                        "graph mode (max_kv_len 8x)"};
        for (int v = 0; v < N_DEC; v++) {
            attn_ctx g8 = d8;
            if (dec_graph[v]) g8.ab.max_kv_len *= 8;
            double t8 = time_it(b8, 50, run_attn, &g8), bw8 = kv_bytes / 2 / t8 / 1e9;
            printf("decode attention FP8 KV: batch 64 x 4096, 32/8 heads, d 128, %s: %.3f ms, %.0f GB/s of KV read "
                   "(%.0f%% of copy); %.2fx the bf16 cache's time\n",
                   dec8_name[v], t8 * 1e3, bw8, 100 * bw8 / copy_bw, t_dec_v[v] / t8);
        }
        attn_free(b8, &d8);
        attn_ctx p8;
        if (!attn_setup(b8, &p8, 1, 4096, 4096, true)) return fprintf(stderr, "out of memory\n"), 1;
        double t8 = time_it(b8, 20, run_attn, &p8), tf8 = 4.0 * 32 * 128 * (4096.0 * 4097 / 2) / t8 / 1e12;
        printf("prefill attention FP8 KV: 4096 tokens causal, 32/8 heads, d 128, default + lse: %.3f ms, %.1f TFLOP/s\n",
               t8 * 1e3, tf8);
        attn_free(b8, &p8);
        const int fp8_n[3] = {4096, 16384, 32768};
        for (int i = 0; i < 3; i++)
            if (!bench_prefill_fp8(b8, fp8_n[i], kvs_cuda_wgmma_supported(device)))
                return fprintf(stderr, "out of memory\n"), 1;
        int failed8 = kvs_cuda_of(b8)->failed;
        b8->destroy(b8);
        if (failed8) return fprintf(stderr, "kvs_bench_kernels: the FP8 KV backend failed\n"), 1;
    } else {
        printf("decode attention FP8 KV: skipped (%s)\n", kvs_last_error());
    }
    if (only_fp8) {
        int failed = kvs_cuda_of(b)->failed;
        b->destroy(b);
        return failed ? 1 : 0;
    }

    /* prefill attention: 4096 tokens, causal; every kernel (the default also with
       lse), chosen by the backend's prefill option; v0 from bench/prefill_versions.cuh
       (-1). A row's output (and lse) is checked against the kernel `ref`'s on the same
       inputs (the WGMMA kernel's against GQA's) */
    attn_ctx pc;
    struct pre_row {
        const char *name;
        int kernel; /* -1: v0 */
        bool lse;
        int ref; /* the kernel whose output it is checked against; -2: none */
    };
    const int AUTO = KVS_CUDA_PREFILL_AUTO, WG = KVS_CUDA_PREFILL_WGMMA, GQA = KVS_CUDA_PREFILL_GQA;
    const pre_row pre[] = {
        {"v0 4 warps x 32 rows (bench/prefill_versions.cuh)", -1, false, AUTO},
        {"SMALL (v2) 4 warps x 16 rows", KVS_CUDA_PREFILL_SMALL, false, -2},
        {"HEAD (v4) 8 warps x 32 rows, FFMA + rescale skip", KVS_CUDA_PREFILL_HEAD, false, -2},
        {"GQA (v13) HEAD with 4 heads x 64 rows a block, warps skipping fully masked tiles", GQA, false, -2},
        {"default (AUTO: WGMMA on Hopper, else GQA where it fits) + lse", AUTO, true, -2},
        {"WGMMA (cp.async producer warpgroup, 2 consumer warpgroups, intra-warpgroup overlap)", WG, false, GQA},
        {"WGMMA + lse", WG, true, GQA},
    };
    const int N_PRE = (int)(sizeof pre / sizeof pre[0]);
    double pre_tf[sizeof pre / sizeof pre[0]] = {0}; /* 0: skipped */
    const double flops = 4.0 * 32 * 128 * (4096.0 * 4097 / 2);
    /* the Hopper kernel runs only where the backend would take it (compute capability 9.0, sm_90a code) */
    const char *wgmma_why = kvs_cuda_wgmma_supported(device);
    kvs_cuda *bc = kvs_cuda_of(b);
    auto against = [&](attn_ctx *c, int n, int ref, double *worst_l) { return max_diff_against(b, c, n, ref, worst_l); };
    auto ref_name = [&](int ref) { return ref == AUTO ? "the default" : "GQA"; };
    for (int v = 0; v < N_PRE; v++) {
        const pre_row &r = pre[v];
        if (r.kernel == WG && wgmma_why) {
            printf("prefill attention: %s: skipped (%s)\n", r.name, wgmma_why);
            continue;
        }
        bc->prefill = r.kernel < 0 ? AUTO : r.kernel;
        if (!attn_setup(b, &pc, 1, 4096, 4096, r.lse)) return fprintf(stderr, "out of memory\n"), 1;
        double t_pre = time_it(b, 20, r.kernel < 0 ? run_attn_v0 : run_attn, &pc), tf = flops / t_pre / 1e12;
        pre_tf[v] = tf;
        printf("prefill attention: 4096 tokens causal, 32/8 heads, d 128, %s: %.3f ms, %.1f TFLOP/s (%.0f%% of gemm)\n",
               r.name, t_pre * 1e3, tf, 100 * tf / gemm_tf);
        if (r.ref != -2) {
            double worst_l, worst = against(&pc, 4096, r.ref, &worst_l);
            printf("prefill attention: %s against %s: max |difference| %.3g (bf16 outputs)", r.name, ref_name(r.ref),
                   worst);
            if (pc.lse) printf(", lse %.3g", worst_l);
            printf("\n");
        }
        attn_free(b, &pc);
    }
    /* the issue-15 targets at 16k and 32k tokens (one sequence, causal, with lse): GQA and the WGMMA kernel, a
       few runs each; WGMMA's output and lse against GQA's */
    struct long_row {
        const char *name;
        int kernel;
        int ref;
    };
    const long_row lr[] = {{"GQA (v13)", GQA, -2}, {"WGMMA", WG, GQA}};
    const int N_LONG = (int)(sizeof lr / sizeof lr[0]), long_n[2] = {16384, 32768};
    double long_tf[2][sizeof lr / sizeof lr[0]] = {{0}};
    for (int li = 0; li < 2; li++) {
        const int n = long_n[li];
        double *tf_n = long_tf[li];
        for (int v = 0; v < N_LONG; v++) {
            if (lr[v].kernel == WG && wgmma_why) {
                printf("prefill attention: %d tokens, %s: skipped (%s)\n", n, lr[v].name, wgmma_why);
                continue;
            }
            bc->prefill = lr[v].kernel;
            if (!attn_setup(b, &pc, 1, n, n, true)) return fprintf(stderr, "out of memory\n"), 1;
            double t = time_it(b, n > 16384 ? 3 : 5, run_attn, &pc);
            tf_n[v] = 4.0 * 32 * 128 * ((double)n * (n + 1) / 2) / t / 1e12;
            printf("prefill attention: %d tokens causal, 32/8 heads, d 128, + lse, %s: %.3f ms, %.1f TFLOP/s", n,
                   lr[v].name, t * 1e3, tf_n[v]);
            if (tf_n[0] > 0 && v > 0) printf(" (%.2fx GQA)", tf_n[v] / tf_n[0]);
            if (lr[v].ref != -2) {
                double worst_l, worst = against(&pc, n, lr[v].ref, &worst_l);
                printf("; against %s: max |difference| %.3g, lse %.3g", ref_name(lr[v].ref), worst, worst_l);
            }
            printf("\n");
            attn_free(b, &pc);
        }
    }
    bc->prefill = KVS_CUDA_PREFILL_AUTO;

    /* SnapKV cost vs the prefill of one layer, 4000-token prompt, Llama-3-8B shape */
    const int P = 4000, W = 32, H = 32, KV = 8, D = 128, KEEP = 2000;
    double t_layer_attn, t_layer_gemm = 0, t_scores, t_gather, t_select, t_all;
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
        /* snapkv_select on the device: pool 7, keep 2000 - 32 per KV head + the window */
        struct sel_ { int32_t *keep; const float *scores; int n_keys; } sel;
        sel.keep = (int32_t *)b->alloc(b, sizeof(int32_t) * KV * KEEP), sel.scores = s_.scores, sel.n_keys = s_.n_keys;
        t_select = time_it(b, 50, [](kvs_backend *bb, void *p) {
            sel_ *c = (sel_ *)p;
            bb->snapkv_select(bb, c->keep, c->scores, c->n_keys, KV, 7, KEEP - W, W);
        }, &sel);
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
            bb->kv_gather(bb, &c->pool, c->blocks, c->n_blocks, c->blocks, c->src, KEEP);
        }, &g_);
        /* the three queued back to back, as src/kv/sparsify.c runs them (compacting
           the same blocks again each time: the cost does not depend on the data) */
        struct all_ { sc *s; sel_ *sel; gc_ *g; } all = {&s_, &sel, &g_};
        t_all = time_it(b, 50, [](kvs_backend *bb, void *p) {
            all_ *c = (all_ *)p;
            bb->sparsity_scores(bb, c->s->scores, c->s->win_q, c->s->win_lse, W, &c->s->pool, c->s->table,
                                c->s->n_keys, H, 0.08838834764f);
            bb->snapkv_select(bb, c->sel->keep, c->sel->scores, c->sel->n_keys, KV, 7, KEEP - W, W);
            bb->kv_gather(bb, &c->g->pool, c->g->blocks, c->g->n_blocks, c->g->blocks, c->sel->keep, KEEP);
        }, &all);
        b->free(b, sel.keep);
        free(src);
        b->free(b, s_.scores), b->free(b, s_.win_q), b->free(b, s_.win_lse), b->free(b, g_.src);
        attn_free(b, &lc);
    }
    double t_layer = t_layer_attn + t_layer_gemm;
    printf("snapkv, one layer of a %d-token prompt: scores %.1f us, select %.1f us, kv_gather %.1f us "
           "(sum %.1f us), the three queued together %.1f us; prefill attention %.1f us + gemms %.1f us\n",
           P, t_scores * 1e6, t_select * 1e6, t_gather * 1e6, (t_scores + t_select + t_gather) * 1e6, t_all * 1e6,
           t_layer_attn * 1e6, t_layer_gemm * 1e6);
    if (!bench_snapkv_batches(b)) return fprintf(stderr, "out of memory\n"), 1;
    /* sampling on the GPU (backend/sample.h) vs copying the f32 logits to the host */
    double t_sample[3], t_logits_d2h;
    const int SR = 256, SV = 128256;
    {
        sample_ctx sc = {};
        sc.n = SR, sc.vocab = SV;
        sc.logits = b->alloc(b, (size_t)SR * SV * 2);
        sc.ids = (int32_t *)b->alloc(b, SR * 4);
        sc.lp = (float *)b->alloc(b, SR * 4);
        sc.params = (kvs_sample_row *)b->alloc(b, SR * sizeof(kvs_sample_row));
        sc.host = (float *)malloc((size_t)SR * SV * 4);
        if (!sc.logits || !sc.ids || !sc.lp || !sc.params || !sc.host) return fprintf(stderr, "out of memory\n"), 1;
        fill((bf16 *)sc.logits, (size_t)SR * SV, 99);
        kvs_sample_row *hp = (kvs_sample_row *)malloc(SR * sizeof(kvs_sample_row));
        const kvs_sample_row kinds[3] = {{0, 0, 1, 0, 1, 0, 0, 0}, {0.8f, 0, 1, 0, 1, 0, 0, 0}, {0.8f, 50, 0.9f, 0.05f, 1, 0, 0, 0}};
        for (int k = 0; k < 3; k++) {
            for (int r = 0; r < SR; r++) hp[r] = kinds[k], hp[r].seed = r;
            b->to_device(b, sc.params, hp, SR * sizeof(kvs_sample_row));
            t_sample[k] = time_it(b, 20, run_sample, &sc);
        }
        t_logits_d2h = time_it(b, 5, run_logits_d2h, &sc);
        printf("sample %d x %d (+ logprobs): greedy %.1f us, temperature %.1f us, top-k 50 + top-p 0.9 + min-p 0.05 "
               "%.1f us; logits to the host as f32 (the old path, before any host sampling) %.1f us\n",
               SR, SV, t_sample[0] * 1e6, t_sample[1] * 1e6, t_sample[2] * 1e6, t_logits_d2h * 1e6);
        free(hp), free(sc.host);
        b->free(b, sc.logits), b->free(b, sc.ids), b->free(b, sc.lp), b->free(b, sc.params);
    }

    /* structured output and sampling controls at decode batch 64, 128k vocabulary: the
       masks' upload, process_logits (every row masked, 300 adjust entries a row) and
       top_logprobs (k 20), against a Llama-3-8B decode step's floor (16 GB of weights
       at the copy bandwidth + the decode attention above) */
    double t_masks_h2d, t_process, t_top;
    {
        const int MR = 64, MV = 128256, MW = (MV + 31) / 32, MA = 300;
        logits_ctx lc = {};
        lc.n = MR, lc.vocab = MV, lc.k = 20;
        lc.logits = b->alloc(b, (size_t)MR * MV * 2), lc.out = b->alloc(b, (size_t)MR * MV * 2);
        lc.rows = (kvs_process_row *)b->alloc(b, MR * sizeof(kvs_process_row));
        lc.adjust = (kvs_logit_adjust *)b->alloc(b, (size_t)MR * MA * sizeof(kvs_logit_adjust));
        lc.masks = (uint32_t *)b->alloc(b, (size_t)MR * MW * 4);
        lc.ids = (int32_t *)b->alloc(b, MR * 4), lc.lp = (float *)b->alloc(b, MR * 4);
        lc.top_ids = (int32_t *)b->alloc(b, MR * 20 * 4), lc.top_lp = (float *)b->alloc(b, MR * 20 * 4);
        lc.h_masks = (uint32_t *)b->host_alloc(b, (size_t)MR * MW * 4);
        if (!lc.logits || !lc.out || !lc.rows || !lc.adjust || !lc.masks || !lc.h_masks) return fprintf(stderr, "out of memory\n"), 1;
        fill((bf16 *)lc.logits, (size_t)MR * MV, 77);
        kvs_process_row *hr = (kvs_process_row *)malloc(MR * sizeof(kvs_process_row));
        kvs_logit_adjust *ha = (kvs_logit_adjust *)malloc((size_t)MR * MA * sizeof(kvs_logit_adjust));
        for (int r = 0; r < MR; r++) {
            hr[r] = kvs_process_row{0.5f, 0.5f, 1.1f, r * MA, MA, r};
            for (int e = 0; e < MA; e++) ha[r * MA + e] = kvs_logit_adjust{e * 401 % MV, e % 3, 0.5f, e % 2};
        }
        for (size_t i = 0; i < (size_t)MR * MW; i++) lc.h_masks[i] = (uint32_t)(i * 2654435761u);
        b->to_device(b, lc.rows, hr, MR * sizeof(kvs_process_row));
        b->to_device(b, lc.adjust, ha, (size_t)MR * MA * sizeof(kvs_logit_adjust));
        cudaMemset(lc.ids, 0, MR * 4); /* the drawn ids: any in range */
        t_masks_h2d = time_it(b, 20, run_masks_h2d, &lc);
        t_process = time_it(b, 20, run_process, &lc);
        t_top = time_it(b, 20, run_top, &lc);
        printf("batch 64 x 128256: masks upload %.1f us, process_logits %.1f us, top_logprobs (k 20) %.1f us\n",
               t_masks_h2d * 1e6, t_process * 1e6, t_top * 1e6);
        free(hr), free(ha);
        b->host_free(b, lc.h_masks);
        void *dev[] = {lc.logits, lc.out, lc.rows, lc.adjust, lc.masks, lc.ids, lc.lp, lc.top_ids, lc.top_lp};
        for (void *d : dev) b->free(b, d);
    }
    double t_step_floor = 16.06e9 / (copy_bw * 1e9) + t_dec_v[0]; /* copy_bw counts read + write: the DRAM rate */

    fused_result fr[8];
    const int n_fused = bench_fused(b, fr);
    print_fused(fr, n_fused, copy_bw);
    b->synchronize(b);
    int failed = kvs_cuda_of(b)->failed;
    b->destroy(b);

    printf("\n| benchmark | result | same-run baseline | ratio |\n| --- | --- | --- | --- |\n");
    for (int v = 0; v < N_DEC; v++)
        printf("| decode attention 64 x 4096, 32/8 x 128, %s%s | %.0f GB/s KV read (%.3f ms) | D2D copy %.0f GB/s | %.0f%% |\n",
               dec_name[v], dec_graph[v] ? "" : " (default)", dec_bw_v[v],
               t_dec_v[v] * 1e3, copy_bw, 100 * dec_bw_v[v] / copy_bw);
    for (int v = 0; v < N_PRE; v++)
        if (pre_tf[v] > 0)
            printf("| prefill attention 4096 causal, 32/8 x 128, %s | %.1f TFLOP/s | cuBLASLt bf16 8192^3 %.1f TFLOP/s | %.0f%% |\n",
                   pre[v].name, pre_tf[v], gemm_tf, 100 * pre_tf[v] / gemm_tf);
    for (int li = 0; li < 2; li++)
        for (int v = 0; v < N_LONG; v++)
            if (long_tf[li][v] > 0)
                printf("| prefill attention %d causal + lse, 32/8 x 128, %s | %.1f TFLOP/s | cuBLASLt bf16 8192^3 %.1f "
                       "TFLOP/s | %.0f%% |\n",
                       long_n[li], lr[v].name, long_tf[li][v], gemm_tf, 100 * long_tf[li][v] / gemm_tf);
    printf("| sparsity_scores, 32 x 4000 x 8/32 heads | %.1f us | layer prefill attention %.1f us | %.2f%% |\n",
           t_scores * 1e6, t_layer_attn * 1e6, 100 * t_scores / t_layer_attn);
    const double t_layer_us = t_layer * 1e6;
    printf("| snapkv_select (pool 7, top 1968 of 3968, 8 KV heads) | %.1f us | layer prefill (attention + gemms) %.1f us "
           "| %.2f%% |\n", t_select * 1e6, t_layer_us, 100 * t_select / t_layer);
    printf("| kv_gather (keep 2000 of 4000, 8 KV heads, in place) | %.1f us | layer prefill (attention + gemms) %.1f us "
           "| %.2f%% |\n", t_gather * 1e6, t_layer_us, 100 * t_gather / t_layer);
    printf("| scores + select + kv_gather (sum of the three) | %.1f us | layer prefill (attention + gemms) %.1f us | "
           "%.2f%% (target <= 3%%) |\n",
           (t_scores + t_select + t_gather) * 1e6, t_layer_us, 100 * (t_scores + t_select + t_gather) / t_layer);
    printf("| scores + select + kv_gather (queued together) | %.1f us | layer prefill (attention + gemms) %.1f us | "
           "%.2f%% (target <= 3%%) |\n", t_all * 1e6, t_layer_us, 100 * t_all / t_layer);
    printf("| sample 256 x 128256: greedy / temperature / top-k+top-p+min-p | %.1f / %.1f / %.1f us | logits to host (f32) %.1f us | %.0f%% |\n",
           t_sample[0] * 1e6, t_sample[1] * 1e6, t_sample[2] * 1e6, t_logits_d2h * 1e6, 100 * t_sample[2] / t_logits_d2h);
    printf("| masks upload + process_logits + top_logprobs k 20, 64 x 128256 | %.1f + %.1f + %.1f us | 8B decode step floor "
           "(weights at copy rate + attention 64 x 4096) %.0f us | %.1f%% (mask target <= 10%%) |\n",
           t_masks_h2d * 1e6, t_process * 1e6, t_top * 1e6, t_step_floor * 1e6,
           100 * (t_masks_h2d + t_process) / t_step_floor);
    const char *fused_pair[8] = {"add + rmsnorm", "add + rmsnorm", "rope q + rope k + kv_write",
                                 "rope q + rope k + kv_write", "add_rmsnorm + quantize_fp8", "add_rmsnorm + quantize_fp8",
                                 "swiglu + quantize_fp8", "swiglu + quantize_fp8"};
    const char *fused_shape[8] = {"64 x 4096", "4096 x 4096", "64 tokens, 32/8 x 128", "4096 tokens, 32/8 x 128",
                                  "64 x 4096", "4096 x 4096", "64 x 14336", "4096 x 14336"};
    for (int i = 0; i < n_fused; i++)
        printf("| %s %s | %.2f us, %.0f GB/s (%.0f%% of copy) | %s %.2f us | %.2fx |\n", fr[i].what, fused_shape[i],
               fr[i].t_fused * 1e6, fr[i].bytes / fr[i].t_fused / 1e9, 100 * fr[i].bytes / fr[i].t_fused / 1e9 / copy_bw,
               fused_pair[i], fr[i].t_unfused * 1e6, fr[i].t_unfused / fr[i].t_fused);
    if (have_rates) printf("\n"), print_gemm_rates(rates);
    if (failed) fprintf(stderr, "a CUDA call failed: %s\n", kvs_last_error());
    return failed ? 1 : 0;
}
