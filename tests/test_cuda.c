/* The CUDA backend against the CPU backend (the oracle): every op on fresh
 * random inputs, then whole models. Inputs are rounded to bf16 before the CPU
 * sees them, so the differences measured are the CUDA backend's own (bf16
 * outputs, fp32 accumulation in another order). NaN never passes.
 * Without a GPU every test is skipped ("no GPU: skipped"). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "kv/kv.h"
#include "model/model.h"
#include "testutil.h"

typedef struct {
    kvs_backend *cpu, *gpu;
    kvs_rng rng;
} duo;

static bool duo_open(duo *d) {
    memset(d, 0, sizeof *d);
    if (kvs_backend_cuda_create(0, &d->gpu) != KVS_OK) return false;
    cr_assert_eq(kvs_backend_cpu_create(0, &d->cpu), KVS_OK);
    uint64_t seed = getenv("KVS_TEST_SEED") ? strtoull(getenv("KVS_TEST_SEED"), NULL, 10) : (uint64_t)time(NULL);
    cr_log_info("seed %llu", (unsigned long long)seed);
    kvs_rng_seed(&d->rng, seed);
    return true;
}

static void duo_close(duo *d) {
    d->gpu->destroy(d->gpu);
    d->cpu->destroy(d->cpu);
}

#define OPEN_OR_SKIP(d)                                                          \
    do {                                                                         \
        if (!duo_open(d)) {                                                      \
            cr_skip("no GPU: skipped (%s)", kvs_last_error());                   \
            return;                                                              \
        }                                                                        \
    } while (0)

/* n random values of N(0, scale^2), rounded to bf16. */
static float *rnd(duo *d, size_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = kvs_bf16_to_f32(kvs_f32_to_bf16(kvs_rng_normal(&d->rng) * scale));
    return x;
}

/* Copies of host f32 data (bf16 values) into both backends' dtypes. */
static void *cpu_put(duo *d, const float *x, size_t n) {
    void *p = d->cpu->alloc(d->cpu, sizeof(float) * (n ? n : 1));
    d->cpu->to_device(d->cpu, p, x, sizeof(float) * n);
    return p;
}
static void *gpu_put(duo *d, const float *x, size_t n) {
    void *p = d->gpu->alloc(d->gpu, 2 * (n ? n : 1));
    cr_assert(p, "cuda alloc");
    d->gpu->upload_weight(d->gpu, p, x, KVS_F32, n);
    return p;
}
static void *put_i32(kvs_backend *b, const int32_t *x, size_t n) {
    void *p = b->alloc(b, sizeof(int32_t) * (n ? n : 1));
    b->to_device(b, p, x, sizeof(int32_t) * n);
    return p;
}
static void *put_f32(kvs_backend *b, const float *x, size_t n) {
    void *p = b->alloc(b, sizeof(float) * (n ? n : 1));
    b->to_device(b, p, x, sizeof(float) * n);
    return p;
}
static float *gpu_get(duo *d, const void *p, size_t n) { /* bf16 -> f32 */
    float *x = malloc(sizeof(float) * (n ? n : 1));
    d->gpu->to_host_f32(d->gpu, x, p, n);
    return x;
}
static float *gpu_get_f32(duo *d, const void *p, size_t n) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    d->gpu->to_host(d->gpu, x, p, sizeof(float) * n);
    return x;
}

/* Every |got - ref| <= atol + rtol |ref|, no NaN; logs the max error. */
static void expect_close(const char *what, const float *got, const float *ref, size_t n, double atol, double rtol) {
    double worst = 0, worst_excess = -1;
    size_t at = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]);
        if (isnan(got[i]) || isnan(ref[i]) || isinf(got[i]) != isinf(ref[i])) e = INFINITY;
        if (e > worst) worst = e;
        double excess = e - (atol + rtol * fabs(ref[i]));
        if (excess > 0) bad++;
        if (excess > worst_excess) worst_excess = excess, at = i;
    }
    cr_log_info("%s: max abs err %.3g over %zu values (atol %g, rtol %g)", what, worst, n, atol, rtol);
    cr_expect(bad == 0, "%s: %zu of %zu values off; worst at %zu: got %g want %g (max abs err %g, atol %g rtol %g)",
              what, bad, n, at, got[at], ref[at], worst, atol, rtol);
}

/* ---- row-wise ops ------------------------------------------------------------ */

Test(cuda, rowwise_ops) {
    duo d;
    OPEN_OR_SKIP(&d);
    const int n = 37, dims[2] = {1000, 4096}, vocab = 301;
    for (int k = 0; k < 2; k++) {
        int dim = dims[k];
        char what[96];
        /* embedding + gather_rows */
        float *table = rnd(&d, (size_t)vocab * dim, 1.0f);
        int32_t ids[37];
        for (int i = 0; i < n; i++) ids[i] = (int32_t)(kvs_rng_u64(&d.rng) % vocab);
        void *ct = cpu_put(&d, table, (size_t)vocab * dim), *gt = gpu_put(&d, table, (size_t)vocab * dim);
        void *ci = put_i32(d.cpu, ids, n), *gi = put_i32(d.gpu, ids, n);
        void *co = d.cpu->alloc(d.cpu, sizeof(float) * n * dim), *go = d.gpu->alloc(d.gpu, 2 * (size_t)n * dim);
        d.cpu->embedding(d.cpu, co, ct, ci, n, dim);
        d.gpu->embedding(d.gpu, go, gt, gi, n, dim);
        float *got = gpu_get(&d, go, (size_t)n * dim);
        snprintf(what, sizeof what, "embedding dim %d", dim);
        expect_close(what, got, co, (size_t)n * dim, 0, 0);
        free(got);
        d.cpu->gather_rows(d.cpu, co, ct, ci, n, dim);
        d.gpu->gather_rows(d.gpu, go, gt, gi, n, dim);
        got = gpu_get(&d, go, (size_t)n * dim);
        snprintf(what, sizeof what, "gather_rows dim %d", dim);
        expect_close(what, got, co, (size_t)n * dim, 0, 0);
        free(got);

        /* rmsnorm (out of place, then in place) */
        float *x = rnd(&d, (size_t)n * dim, 2.0f), *w = rnd(&d, dim, 1.0f);
        void *cx = cpu_put(&d, x, (size_t)n * dim), *gx = gpu_put(&d, x, (size_t)n * dim);
        void *cw = cpu_put(&d, w, dim), *gw = gpu_put(&d, w, dim);
        d.cpu->rmsnorm(d.cpu, co, cx, cw, n, dim, 1e-5f);
        d.gpu->rmsnorm(d.gpu, go, gx, gw, n, dim, 1e-5f);
        got = gpu_get(&d, go, (size_t)n * dim);
        snprintf(what, sizeof what, "rmsnorm dim %d", dim);
        expect_close(what, got, co, (size_t)n * dim, 1e-2, 1e-2);
        free(got);
        d.gpu->rmsnorm(d.gpu, gx, gx, gw, n, dim, 1e-5f);
        got = gpu_get(&d, gx, (size_t)n * dim);
        snprintf(what, sizeof what, "rmsnorm in place dim %d", dim);
        expect_close(what, got, co, (size_t)n * dim, 1e-2, 1e-2);
        free(got);

        /* add */
        float *y = rnd(&d, (size_t)n * dim, 1.0f);
        d.gpu->upload_weight(d.gpu, gx, x, KVS_F32, (size_t)n * dim);
        d.cpu->to_device(d.cpu, cx, x, sizeof(float) * n * dim);
        void *cy = cpu_put(&d, y, (size_t)n * dim), *gy = gpu_put(&d, y, (size_t)n * dim);
        d.cpu->add(d.cpu, cx, cy, (size_t)n * dim);
        d.gpu->add(d.gpu, gx, gy, (size_t)n * dim);
        got = gpu_get(&d, gx, (size_t)n * dim);
        snprintf(what, sizeof what, "add dim %d", dim);
        expect_close(what, got, cx, (size_t)n * dim, 1e-6, 8e-3);
        free(got);

        /* swiglu: gate_up [n, 2 dim] */
        float *gu = rnd(&d, (size_t)n * 2 * dim, 2.0f);
        void *cg = cpu_put(&d, gu, (size_t)n * 2 * dim), *gg = gpu_put(&d, gu, (size_t)n * 2 * dim);
        d.cpu->swiglu(d.cpu, co, cg, n, dim);
        d.gpu->swiglu(d.gpu, go, gg, n, dim);
        got = gpu_get(&d, go, (size_t)n * dim);
        snprintf(what, sizeof what, "swiglu dim %d", dim);
        expect_close(what, got, co, (size_t)n * dim, 1e-3, 8e-3);
        free(got);

        void *ptrs_c[] = {ct, ci, co, cx, cw, cy, cg}, *ptrs_g[] = {gt, gi, go, gx, gw, gy, gg};
        for (int i = 0; i < 7; i++) {
            d.cpu->free(d.cpu, ptrs_c[i]);
            d.gpu->free(d.gpu, ptrs_g[i]);
        }
        free(table), free(x), free(w), free(y), free(gu);
    }
    duo_close(&d);
}

Test(cuda, rope) {
    duo d;
    OPEN_OR_SKIP(&d);
    const int n = 29, heads = 8;
    for (int D = 64; D <= 128; D += 64) {
        float *x = rnd(&d, (size_t)n * heads * D, 1.0f), inv_freq[64];
        int32_t pos[29];
        for (int i = 0; i < n; i++) pos[i] = i < 10 ? i : (int32_t)(kvs_rng_u64(&d.rng) % 131072);
        for (int k = 0; k < D / 2; k++) inv_freq[k] = powf(500000.0f, -2.0f * k / D);
        void *cx = cpu_put(&d, x, (size_t)n * heads * D), *gx = gpu_put(&d, x, (size_t)n * heads * D);
        void *cp = put_i32(d.cpu, pos, n), *gp = put_i32(d.gpu, pos, n);
        void *cf = put_f32(d.cpu, inv_freq, D / 2), *gf = put_f32(d.gpu, inv_freq, D / 2);
        d.cpu->rope(d.cpu, cx, cp, cf, n, heads, D);
        d.gpu->rope(d.gpu, gx, gp, gf, n, heads, D);
        float *got = gpu_get(&d, gx, (size_t)n * heads * D);
        char what[64];
        snprintf(what, sizeof what, "rope head_dim %d", D);
        expect_close(what, got, cx, (size_t)n * heads * D, 1e-2, 1e-2);
        free(got), free(x);
        void *pc[] = {cx, cp, cf}, *pg[] = {gx, gp, gf};
        for (int i = 0; i < 3; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
    }
    duo_close(&d);
}

Test(cuda, matmul) {
    duo d;
    OPEN_OR_SKIP(&d);
    const int shapes[][4] = {{1, 128, 256, 0}, {37, 1024, 328, 1}, {100, 512, 8192, 0}, {7, 4096, 1024, 1}};
    for (int k = 0; k < 4; k++) {
        int n = shapes[k][0], in = shapes[k][1], out = shapes[k][2], has_bias = shapes[k][3];
        float *x = rnd(&d, (size_t)n * in, 1.0f), *w = rnd(&d, (size_t)out * in, 1.0f / sqrtf((float)in));
        float *bias = rnd(&d, out, 0.5f);
        void *cx = cpu_put(&d, x, (size_t)n * in), *gx = gpu_put(&d, x, (size_t)n * in);
        void *cw = cpu_put(&d, w, (size_t)out * in), *gw = gpu_put(&d, w, (size_t)out * in);
        void *cb = cpu_put(&d, bias, out), *gb = gpu_put(&d, bias, out);
        void *co = d.cpu->alloc(d.cpu, sizeof(float) * n * out), *go = d.gpu->alloc(d.gpu, 2 * (size_t)n * out);
        d.cpu->matmul(d.cpu, co, cx, cw, has_bias ? cb : NULL, n, in, out);
        d.gpu->matmul(d.gpu, go, gx, gw, has_bias ? gb : NULL, n, in, out);
        float *got = gpu_get(&d, go, (size_t)n * out);
        char what[96];
        snprintf(what, sizeof what, "matmul %dx%d @ %dx%d^T%s", n, in, out, in, has_bias ? " + bias" : "");
        expect_close(what, got, co, (size_t)n * out, 2e-2, 1e-2);
        free(got), free(x), free(w), free(bias);
        void *pc[] = {cx, cw, cb, co}, *pg[] = {gx, gw, gb, go};
        for (int i = 0; i < 4; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
    }
    duo_close(&d);
}

/* ---- paged KV, attention, scores, compaction --------------------------------- */

/* A paged pool on both backends holding n_seqs sequences of kv_len[s] entries
 * (random K/V written through kv_write), each in shuffled blocks. */
typedef struct {
    int n_seqs, max_blocks, n_kv, D, bs;
    int64_t n_blocks;
    kvs_kv_pool cpu, gpu;
    int32_t *tables; /* [n_seqs * max_blocks] */
} paged;

static void paged_build(duo *d, paged *p, int n_seqs, const int *kv_len, int n_kv, int D) {
    memset(p, 0, sizeof *p);
    p->n_seqs = n_seqs, p->n_kv = n_kv, p->D = D, p->bs = 16;
    int total_tokens = 0;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (kv_len[s] + 15) / 16;
        if (nb > p->max_blocks) p->max_blocks = nb;
        p->n_blocks += nb;
        total_tokens += kv_len[s];
    }
    p->n_blocks += 3;
    int32_t *order = malloc(sizeof(int32_t) * p->n_blocks);
    for (int64_t i = 0; i < p->n_blocks; i++) order[i] = (int32_t)i;
    for (int64_t i = p->n_blocks - 1; i > 0; i--) {
        int64_t j = (int64_t)(kvs_rng_u64(&d->rng) % (uint64_t)(i + 1));
        int32_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
    p->tables = calloc((size_t)n_seqs * p->max_blocks, sizeof(int32_t));
    int64_t next = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int b = 0; b < (kv_len[s] + 15) / 16; b++) p->tables[(size_t)s * p->max_blocks + b] = order[next++];
    size_t elems = (size_t)p->n_blocks * 2 * n_kv * 16 * D;
    p->cpu = (kvs_kv_pool){d->cpu->alloc(d->cpu, elems * 4), p->n_blocks, 16, n_kv, D};
    p->gpu = (kvs_kv_pool){d->gpu->alloc(d->gpu, elems * 2), p->n_blocks, 16, n_kv, D};
    cr_assert(p->gpu.data, "cuda alloc of the pool");
    float *zero = calloc(elems, sizeof(float));
    d->cpu->to_device(d->cpu, p->cpu.data, zero, elems * 4);
    d->gpu->upload_weight(d->gpu, p->gpu.data, zero, KVS_F32, elems);
    free(zero);
    /* K, V for every entry, written in one kv_write call */
    size_t row = (size_t)n_kv * D;
    float *k = rnd(d, (size_t)total_tokens * row, 1.0f), *v = rnd(d, (size_t)total_tokens * row, 1.0f);
    int32_t *slots = malloc(sizeof(int32_t) * total_tokens);
    int t = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int e = 0; e < kv_len[s]; e++, t++) slots[t] = p->tables[(size_t)s * p->max_blocks + e / 16] * 16 + e % 16;
    void *ck = cpu_put(d, k, total_tokens * row), *cv = cpu_put(d, v, total_tokens * row);
    void *gk = gpu_put(d, k, total_tokens * row), *gv = gpu_put(d, v, total_tokens * row);
    void *cs = put_i32(d->cpu, slots, total_tokens), *gs = put_i32(d->gpu, slots, total_tokens);
    d->cpu->kv_write(d->cpu, &p->cpu, ck, cv, cs, total_tokens);
    d->gpu->kv_write(d->gpu, &p->gpu, gk, gv, gs, total_tokens);
    void *pc[] = {ck, cv, cs}, *pg[] = {gk, gv, gs};
    for (int i = 0; i < 3; i++) d->cpu->free(d->cpu, pc[i]), d->gpu->free(d->gpu, pg[i]);
    free(k), free(v), free(slots), free(order);
}

static void paged_free(duo *d, paged *p) {
    d->cpu->free(d->cpu, p->cpu.data);
    d->gpu->free(d->gpu, p->gpu.data);
    free(p->tables);
}

static void check_pools_equal(duo *d, paged *p, const char *what) {
    size_t elems = (size_t)p->n_blocks * 2 * p->n_kv * 16 * p->D;
    float *got = gpu_get(d, p->gpu.data, elems);
    expect_close(what, got, p->cpu.data, elems, 0, 0);
    free(got);
}

/* One attention call over sequences (kv_len[s], q_len[s]) on both backends.
 * capacity > 1 emulates CUDA-graph mode: the block-table stride and max_kv_len
 * are capacity x what the sequences need (the extra table entries are block 0),
 * so most decode splits start past kv_len[s] and must contribute nothing. */
static void attention_case_cap(int n_heads, int n_kv, int D, int n_seqs, const int *kv_len, const int *q_len,
                               int capacity) {
    duo d;
    OPEN_OR_SKIP(&d);
    paged p;
    paged_build(&d, &p, n_seqs, kv_len, n_kv, D);
    check_pools_equal(&d, &p, "kv_write");
    int32_t *qs = malloc(sizeof(int32_t) * (n_seqs + 1));
    int max_q = 0, max_kv = 0;
    qs[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        qs[s + 1] = qs[s] + q_len[s];
        if (q_len[s] > max_q) max_q = q_len[s];
        if (kv_len[s] > max_kv) max_kv = kv_len[s];
    }
    if (capacity > 1) { /* restride the tables; max_kv_len = capacity x the longest */
        int stride = p.max_blocks * capacity;
        int32_t *wide = calloc((size_t)n_seqs * stride, sizeof(int32_t));
        for (int s = 0; s < n_seqs; s++)
            memcpy(wide + (size_t)s * stride, p.tables + (size_t)s * p.max_blocks, sizeof(int32_t) * p.max_blocks);
        free(p.tables);
        p.tables = wide, p.max_blocks = stride;
        max_kv *= capacity;
    }
    int n = qs[n_seqs];
    size_t qn = (size_t)n * n_heads * D;
    float *q = rnd(&d, qn, 1.5f);
    void *cq = cpu_put(&d, q, qn), *gq = gpu_put(&d, q, qn);
    void *cqs = put_i32(d.cpu, qs, n_seqs + 1), *gqs = put_i32(d.gpu, qs, n_seqs + 1);
    void *ckl = put_i32(d.cpu, kv_len, n_seqs), *gkl = put_i32(d.gpu, kv_len, n_seqs);
    size_t tn = (size_t)n_seqs * p.max_blocks;
    void *ct = put_i32(d.cpu, p.tables, tn), *gt = put_i32(d.gpu, p.tables, tn);
    void *co = d.cpu->alloc(d.cpu, qn * 4), *go = d.gpu->alloc(d.gpu, qn * 2);
    float *cl = d.cpu->alloc(d.cpu, sizeof(float) * n * n_heads), *gl = d.gpu->alloc(d.gpu, sizeof(float) * n * n_heads);
    kvs_attn_batch cab = {n_seqs, n, p.max_blocks, max_q, max_kv, cqs, ckl, ct};
    kvs_attn_batch gab = {n_seqs, n, p.max_blocks, max_q, max_kv, gqs, gkl, gt};
    float scale = 1.0f / sqrtf((float)D);
    d.cpu->attention(d.cpu, co, cl, cq, &p.cpu, &cab, n_heads, scale);
    d.gpu->attention(d.gpu, go, gl, gq, &p.gpu, &gab, n_heads, scale);
    float *got = gpu_get(&d, go, qn), *got_lse = gpu_get_f32(&d, gl, (size_t)n * n_heads);
    char what[160];
    snprintf(what, sizeof what, "attention %s heads %d/%d head_dim %d, %d seqs max_kv %d: out",
             max_q <= 1 ? "decode" : "varlen", n_heads, n_kv, D, n_seqs, max_kv);
    expect_close(what, got, co, qn, 2e-2, 2e-2);
    snprintf(what, sizeof what, "attention %s heads %d/%d head_dim %d, %d seqs max_kv %d: lse",
             max_q <= 1 ? "decode" : "varlen", n_heads, n_kv, D, n_seqs, max_kv);
    expect_close(what, got_lse, cl, (size_t)n * n_heads, 2e-3, 1e-3);
    /* without lse the output is the same */
    d.gpu->attention(d.gpu, go, NULL, gq, &p.gpu, &gab, n_heads, scale);
    float *got2 = gpu_get(&d, go, qn);
    expect_close("attention without lse", got2, got, qn, 0, 0);
    free(got), free(got2), free(got_lse), free(q), free(qs);
    void *pc[] = {cq, cqs, ckl, ct, co, cl}, *pg[] = {gq, gqs, gkl, gt, go, gl};
    for (int i = 0; i < 6; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
    paged_free(&d, &p);
    duo_close(&d);
}

static void attention_case(int n_heads, int n_kv, int D, int n_seqs, const int *kv_len, const int *q_len) {
    attention_case_cap(n_heads, n_kv, D, n_seqs, kv_len, q_len, 1);
}

/* prefill chunks (starting fresh or after cached entries) mixed with decode tokens */
static const int mix_kv[] = {1, 17, 100, 300, 33, 64, 130, 700, 16, 255};
static const int mix_q[] = {1, 17, 37, 1, 1, 64, 65, 200, 16, 128};
#define MIX_N 10

Test(cuda, attention_varlen_d128_gqa4) { attention_case(32, 8, 128, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_varlen_d128_gqa8) { attention_case(32, 4, 128, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_varlen_d64_gqa1) { attention_case(8, 8, 64, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_varlen_d64_gqa4) { attention_case(16, 4, 64, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_varlen_d32_gqa2) { attention_case(4, 2, 32, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_varlen_d96_fallback) { attention_case(8, 2, 96, MIX_N, mix_kv, mix_q); }
Test(cuda, attention_prefill_long_d128) {
    const int kv[] = {1500, 333}, q[] = {1500, 333};
    attention_case(32, 8, 128, 2, kv, q);
}

#ifdef KVS_HAVE_CUDA
/* the other prefill block shapes (benchmark variants of cuda_attention.cu) */
extern int kvs_cuda_attn_prefill_variant;
Test(cuda, attention_prefill_variants) {
    const int kv[] = {1500, 333}, q[] = {1500, 333};
    const int def = kvs_cuda_attn_prefill_variant; /* the other tests cover the default */
    for (int v = 0; v <= 10; v++) {
        if (v == def) continue;
        kvs_cuda_attn_prefill_variant = v;
        cr_log_info("prefill variant %d", v);
        attention_case(32, 8, 128, 2, kv, q);
        attention_case(32, 8, 128, MIX_N, mix_kv, mix_q);
        attention_case(16, 4, 64, MIX_N, mix_kv, mix_q);
        attention_case(32, 4, 128, MIX_N, mix_kv, mix_q);
        attention_case(4, 2, 32, MIX_N, mix_kv, mix_q);
    }
    kvs_cuda_attn_prefill_variant = def;
}
#endif

static const int dec_kv[] = {1, 15, 16, 17, 63, 64, 65, 1000, 5000, 4097};
static const int dec_q[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

Test(cuda, attention_decode_d128_gqa8) { attention_case(32, 4, 128, 10, dec_kv, dec_q); }
Test(cuda, attention_decode_d128_gqa4) { attention_case(32, 8, 128, 10, dec_kv, dec_q); }
Test(cuda, attention_decode_d64_gqa1) { attention_case(8, 8, 64, 10, dec_kv, dec_q); }
Test(cuda, attention_decode_d32_gqa2) { attention_case(4, 2, 32, 10, dec_kv, dec_q); }
Test(cuda, attention_decode_single_long) {
    const int kv[] = {20000}, q[] = {1};
    attention_case(32, 8, 128, 1, kv, q);
}

/* CUDA-graph mode: max_kv_len and the table stride 8 x what the sequences need */
Test(cuda, attention_decode_graph_capacity) {
    const int kv[] = {4096, 4000}, q[] = {1, 1};
    attention_case_cap(32, 8, 128, 10, dec_kv, dec_q, 8);
    attention_case_cap(32, 4, 128, 10, dec_kv, dec_q, 8);
    attention_case_cap(8, 8, 64, 10, dec_kv, dec_q, 8);
    attention_case_cap(4, 2, 32, 10, dec_kv, dec_q, 8);
    attention_case_cap(32, 8, 128, 2, kv, q, 8);
    attention_case_cap(32, 8, 128, MIX_N, mix_kv, mix_q, 8); /* prefill chunks too */
}

#ifdef KVS_HAVE_CUDA
/* the decode kernel variants of cuda_attention.cu, each on every decode case,
 * plain and in graph mode (capacity 8) */
extern int kvs_cuda_attn_decode_variant;
Test(cuda, attention_decode_variants) {
    const int def = kvs_cuda_attn_decode_variant;
    const int kv_long[] = {20000}, q_long[] = {1};
    const int kv_batch[] = {4096, 4095, 4097, 3000, 1, 64, 65, 2049}, q_batch[] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int v = 0; v <= 3; v++) {
        kvs_cuda_attn_decode_variant = v;
        cr_log_info("decode variant %d", v);
        attention_case(32, 4, 128, 10, dec_kv, dec_q);
        attention_case(32, 8, 128, 10, dec_kv, dec_q);
        attention_case(8, 8, 64, 10, dec_kv, dec_q);
        attention_case(16, 4, 64, 10, dec_kv, dec_q);
        attention_case(4, 2, 32, 10, dec_kv, dec_q);
        attention_case(32, 8, 128, 1, kv_long, q_long);
        attention_case(32, 8, 128, 8, kv_batch, q_batch);
        attention_case_cap(32, 8, 128, 10, dec_kv, dec_q, 8);
        attention_case_cap(8, 8, 64, 10, dec_kv, dec_q, 8);
        attention_case_cap(32, 8, 128, 8, kv_batch, q_batch, 8);
    }
    kvs_cuda_attn_decode_variant = def;
}
#endif

static void scores_case(int n_heads, int n_kv, int D, int n_keys, int n_win) {
    duo d;
    OPEN_OR_SKIP(&d);
    paged p;
    int kv_len[1] = {n_keys + n_win};
    paged_build(&d, &p, 1, kv_len, n_kv, D);
    size_t qn = (size_t)n_win * n_heads * D;
    float *q = rnd(&d, qn, 1.0f), *lse = malloc(sizeof(float) * n_win * n_heads);
    for (int i = 0; i < n_win * n_heads; i++) lse[i] = 2.0f + (float)kvs_rng_uniform(&d.rng) * 3.0f;
    void *cq = cpu_put(&d, q, qn), *gq = gpu_put(&d, q, qn);
    float *cl = put_f32(d.cpu, lse, (size_t)n_win * n_heads), *gl = put_f32(d.gpu, lse, (size_t)n_win * n_heads);
    void *ct = put_i32(d.cpu, p.tables, p.max_blocks), *gt = put_i32(d.gpu, p.tables, p.max_blocks);
    size_t sn = (size_t)n_kv * n_keys;
    float *cs = d.cpu->alloc(d.cpu, sn * 4), *gs = d.gpu->alloc(d.gpu, sn * 4);
    float scale = 1.0f / sqrtf((float)D);
    d.cpu->sparsity_scores(d.cpu, cs, cq, cl, n_win, &p.cpu, ct, n_keys, n_heads, scale);
    d.gpu->sparsity_scores(d.gpu, gs, gq, gl, n_win, &p.gpu, gt, n_keys, n_heads, scale);
    float *got = gpu_get_f32(&d, gs, sn);
    char what[128];
    snprintf(what, sizeof what, "sparsity_scores heads %d/%d head_dim %d keys %d window %d", n_heads, n_kv, D, n_keys,
             n_win);
    expect_close(what, got, cs, sn, 1e-6, 2e-3);
    free(got), free(q), free(lse);
    void *pc[] = {cq, cl, ct, cs}, *pg[] = {gq, gl, gt, gs};
    for (int i = 0; i < 4; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
    paged_free(&d, &p);
    duo_close(&d);
}

Test(cuda, sparsity_scores_d128_gqa4) { scores_case(32, 8, 128, 1000, 32); }
Test(cuda, sparsity_scores_d64_gqa1) { scores_case(8, 8, 64, 333, 17); }
Test(cuda, sparsity_scores_d32_gqa2) { scores_case(4, 2, 32, 129, 8); }

Test(cuda, window_capture) {
    duo d;
    OPEN_OR_SKIP(&d);
    const int n = 40, m = 9, heads = 8, D = 64, rows = 64;
    float *q = rnd(&d, (size_t)n * heads * D, 1.0f), *lse = rnd(&d, (size_t)n * heads, 3.0f);
    int32_t src[9], dst[9];
    for (int i = 0; i < m; i++) src[i] = n - m + i, dst[i] = (i * 7) % rows;
    void *cq = cpu_put(&d, q, (size_t)n * heads * D), *gq = gpu_put(&d, q, (size_t)n * heads * D);
    float *cl = put_f32(d.cpu, lse, (size_t)n * heads), *gl = put_f32(d.gpu, lse, (size_t)n * heads);
    void *cs = put_i32(d.cpu, src, m), *gs = put_i32(d.gpu, src, m), *cd = put_i32(d.cpu, dst, m),
         *gd = put_i32(d.gpu, dst, m);
    float *zero = calloc((size_t)rows * heads * D, sizeof(float));
    void *cwq = cpu_put(&d, zero, (size_t)rows * heads * D), *gwq = gpu_put(&d, zero, (size_t)rows * heads * D);
    float *cwl = put_f32(d.cpu, zero, (size_t)rows * heads), *gwl = put_f32(d.gpu, zero, (size_t)rows * heads);
    d.cpu->window_capture(d.cpu, cwq, cwl, cq, cl, cs, cd, m, heads, D);
    d.gpu->window_capture(d.gpu, gwq, gwl, gq, gl, gs, gd, m, heads, D);
    float *got_q = gpu_get(&d, gwq, (size_t)rows * heads * D), *got_l = gpu_get_f32(&d, gwl, (size_t)rows * heads);
    expect_close("window_capture q", got_q, cwq, (size_t)rows * heads * D, 0, 0);
    expect_close("window_capture lse", got_l, cwl, (size_t)rows * heads, 0, 0);
    free(got_q), free(got_l), free(q), free(lse), free(zero);
    void *pc[] = {cq, cl, cs, cd, cwq, cwl}, *pg[] = {gq, gl, gs, gd, gwq, gwl};
    for (int i = 0; i < 6; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
    duo_close(&d);
}

Test(cuda, kv_gather_compaction) {
    duo d;
    OPEN_OR_SKIP(&d);
    for (int D = 64; D <= 128; D += 64) {
        paged p;
        int len[1] = {203}, n_kv = 4, keep = 77;
        paged_build(&d, &p, 1, len, n_kv, D);
        int32_t *src = malloc(sizeof(int32_t) * n_kv * keep);
        for (int h = 0; h < n_kv; h++) { /* a sorted random subset of [0, len) per head */
            int chosen = 0;
            for (int e = 0; e < len[0] && chosen < keep; e++)
                if (kvs_rng_u64(&d.rng) % (uint64_t)(len[0] - e) < (uint64_t)(keep - chosen))
                    src[h * keep + chosen++] = e;
            cr_assert_eq(chosen, keep);
        }
        void *ct = put_i32(d.cpu, p.tables, p.max_blocks), *gt = put_i32(d.gpu, p.tables, p.max_blocks);
        void *cs = put_i32(d.cpu, src, (size_t)n_kv * keep), *gs = put_i32(d.gpu, src, (size_t)n_kv * keep);
        d.cpu->kv_gather(d.cpu, &p.cpu, ct, p.max_blocks, cs, keep);
        d.gpu->kv_gather(d.gpu, &p.gpu, gt, p.max_blocks, gs, keep);
        char what[64];
        snprintf(what, sizeof what, "kv_gather head_dim %d", D);
        check_pools_equal(&d, &p, what);
        void *pc[] = {ct, cs}, *pg[] = {gt, gs};
        for (int i = 0; i < 2; i++) d.cpu->free(d.cpu, pc[i]), d.gpu->free(d.gpu, pg[i]);
        free(src);
        paged_free(&d, &p);
    }
    duo_close(&d);
}

Test(cuda, copy_and_transfers) {
    duo d;
    OPEN_OR_SKIP(&d);
    size_t n = 100003;
    float *x = rnd(&d, n, 1.0f);
    void *a = gpu_put(&d, x, n), *b = d.gpu->alloc(d.gpu, 2 * n);
    d.gpu->copy(d.gpu, b, a, 2 * n);
    float *got = gpu_get(&d, b, n);
    expect_close("copy + upload_weight(F32) + to_host_f32", got, x, n, 0, 0);
    /* F16 and BF16 sources */
    uint16_t *h16 = malloc(2 * n), *hb = malloc(2 * n);
    for (size_t i = 0; i < n; i++) h16[i] = kvs_f32_to_f16(x[i]), hb[i] = kvs_f32_to_bf16(x[i]);
    float *ref16 = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) ref16[i] = kvs_bf16_to_f32(kvs_f32_to_bf16(kvs_f16_to_f32(h16[i])));
    d.gpu->upload_weight(d.gpu, a, h16, KVS_F16, n);
    free(got);
    got = gpu_get(&d, a, n);
    expect_close("upload_weight(F16)", got, ref16, n, 0, 0);
    d.gpu->upload_weight(d.gpu, a, hb, KVS_BF16, n);
    free(got);
    got = gpu_get(&d, a, n);
    expect_close("upload_weight(BF16)", got, x, n, 0, 0);
    cr_expect(d.gpu->alloc(d.gpu, (size_t)1 << 50) == NULL, "alloc of 1 PiB returns NULL");
    free(got), free(x), free(h16), free(hb), free(ref16);
    d.gpu->free(d.gpu, a), d.gpu->free(d.gpu, b);
    duo_close(&d);
}

/* ---- end to end: whole models on both backends -------------------------------- */

static void run_tokens(rig *r, int seq, const int32_t *ids, int n, int pos0, int chunk, float *out) {
    for (int start = 0; start < n; start += chunk) {
        int len = n - start < chunk ? n - start : chunk;
        int32_t *pos = malloc(sizeof(int32_t) * len), qs[2] = {0, len};
        for (int i = 0; i < len; i++) pos[i] = pos0 + start + i;
        uint8_t want = start + len == n;
        cr_assert_eq(kvs_kv_reserve(r->kv, seq, len), KVS_OK, "%s", kvs_last_error());
        kvs_batch b = {len, 1, ids + start, pos, qs, &seq, &want};
        cr_assert_eq(kvs_model_forward(r->m, &b, r->kv, out), KVS_OK, "%s", kvs_last_error());
        free(pos);
    }
}

static double max_abs_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        double e = fabs((double)a[i] - b[i]);
        if (e > m) m = e;
    }
    return m;
}

/* Top-2 gap of the reference logits: below `tol`, an argmax flip is a tie, not a bug. */
static double top2_gap(const float *x, int n) {
    int a = argmax_f(x, n);
    double second = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != a && x[i] > second) second = x[i];
    return x[a] - second;
}

/* Prefill (in chunks) then n_greedy greedy tokens on both backends; compares the
 * last-position logits and the greedy tokens. */
static void compare_models(duo *d, const char *dir, const char *name, const int32_t *ids, int n, int chunk,
                           int n_greedy, double max_abs, double rel, const kvs_kv_policy *policy) {
    rig rc, rg;
    rig_open(&rc, dir, d->cpu, RIG_BLOCKS(n + n_greedy + 16, 2), 2);
    rig_open(&rg, dir, d->gpu, RIG_BLOCKS(n + n_greedy + 16, 2), 2);
    int V = rc.cfg.vocab_size;
    float *lc = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V);
    int sc = kvs_kv_seq_create(rc.kv), sg = kvs_kv_seq_create(rg.kv);
    if (policy) {
        cr_assert_eq(kvs_kv_set_policy(rc.kv, sc, policy, n), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_kv_set_policy(rg.kv, sg, policy, n), KVS_OK, "%s", kvs_last_error());
    }
    run_tokens(&rc, sc, ids, n, 0, chunk, lc);
    run_tokens(&rg, sg, ids, n, 0, chunk, lg);
    double peak = 0;
    for (int i = 0; i < V; i++) peak = fabs(lc[i]) > peak ? fabs(lc[i]) : peak;
    if (rel * peak > max_abs) max_abs = rel * peak;
    double diff = max_abs_diff(lg, lc, V), gap = top2_gap(lc, V);
    int ac = argmax_f(lc, V), ag = argmax_f(lg, V);
    cr_log_info("e2e %s: %d tokens: last logits max|gpu - cpu| = %.4f (limit %.2f); argmax cpu %d gpu %d (top-2 gap %.3f)",
                name, n, diff, max_abs, ac, ag, gap);
    cr_expect(diff <= max_abs, "e2e %s: last logits max|gpu - cpu| = %g > %g", name, diff, max_abs);
    cr_expect(ac == ag || gap < 2 * max_abs, "e2e %s: argmax cpu %d gpu %d with a top-2 gap of %g", name, ac, ag, gap);
    /* greedy continuations: each backend follows its own tokens */
    int agree = 0, first_split = -1;
    int32_t tc = ac, tg = ag;
    for (int k = 0; k < n_greedy; k++) {
        if (tc == tg && first_split < 0) agree++;
        else if (first_split < 0) first_split = k;
        if (k + 1 == n_greedy) break;
        run_tokens(&rc, sc, &tc, 1, n + k, 1, lc);
        run_tokens(&rg, sg, &tg, 1, n + k, 1, lg);
        tc = argmax_f(lc, V), tg = argmax_f(lg, V);
    }
    cr_log_info("e2e %s: greedy tokens agree for the first %d of %d", name, agree, n_greedy);
    if (policy) {
        int64_t hc, hg, fc, fg;
        kvs_kv_seq_usage(rc.kv, sc, &hc, &fc);
        kvs_kv_seq_usage(rg.kv, sg, &hg, &fg);
        cr_log_info("e2e %s: KV entries held cpu %lld gpu %lld of %lld", name, (long long)hc, (long long)hg,
                    (long long)fc);
        cr_expect_eq(hc, hg, "e2e %s: compaction kept %lld entries on the cpu, %lld on the gpu", name, (long long)hc,
                     (long long)hg);
    }
    free(lc), free(lg);
    rig_close(&rc);
    rig_close(&rg);
}

Test(cuda, e2e_tiny_needle_llama, .timeout = 600) {
    duo d;
    OPEN_OR_SKIP(&d);
    json_t *cases = load_jsonl(shared_path("fixtures/tiny-needle-llama/logits.jsonl"));
    cr_assert(cases, "cannot read fixtures/tiny-needle-llama/logits.jsonl under %s", shared_path(""));
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        int n;
        int32_t *ids = json_ids(json_object_get(c, "input_ids"), &n);
        char name[96];
        snprintf(name, sizeof name, "tiny-needle-llama %s", json_string_value(json_object_get(c, "name")));
        compare_models(&d, src_path("models/tiny-needle-llama"), name, ids, n, 256, 16, 0.35, 0, NULL);
        free(ids);
    }
    json_decref(cases);
    duo_close(&d);
}

Test(cuda, e2e_tiny_needle_llama_snapkv, .timeout = 600) {
    duo d;
    OPEN_OR_SKIP(&d);
    json_t *cases = load_jsonl(shared_path("fixtures/tiny-needle-llama/logits.jsonl"));
    cr_assert(cases);
    json_t *c = json_array_get(cases, json_array_size(cases) - 1); /* the 638-token retrieval chat */
    int n;
    int32_t *ids = json_ids(json_object_get(c, "input_ids"), &n);
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    p.budget_tokens = 128;
    p.budget_fraction = 0;
    p.full_layers = 1;
    /* the prefill logits come before compaction; the decode steps after it use the compacted layers */
    compare_models(&d, src_path("models/tiny-needle-llama"), "tiny-needle-llama snapkv 128", ids, n, 1000, 16, 0.35, 0,
                   &p);
    free(ids);
    json_decref(cases);
    duo_close(&d);
}

static void e2e_arch(const char *arch) {
    duo d;
    OPEN_OR_SKIP(&d);
    char dir[1024];
    json_t *ref = arch_reference(arch, dir, sizeof dir);
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(ref, "cases"), i, c) {
        int n;
        int32_t *ids = json_ids(json_object_get(c, "input_ids"), &n);
        char name[128];
        snprintf(name, sizeof name, "%s %s", arch, json_string_value(json_object_get(c, "name")));
        compare_models(&d, dir, name, ids, n, 300, 16, 0.25, 0.03, NULL);
        free(ids);
    }
    json_decref(ref);
    duo_close(&d);
}

Test(cuda, e2e_llama3_rope_scaling, .timeout = 600) { e2e_arch("llama3-rope-scaling"); }
Test(cuda, e2e_qwen2_bias_tied, .timeout = 600) { e2e_arch("qwen2-bias-tied"); }
Test(cuda, e2e_mistral, .timeout = 600) { e2e_arch("mistral"); }
