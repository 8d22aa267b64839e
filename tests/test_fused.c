/* The fused backend ops on the CPU backend (the reference) against the
 * unfused sequences they replace: add_rmsnorm == add + rmsnorm,
 * rope_kv_write == rope(q) + rope(k) + kv_write, add_rmsnorm_fp8 ==
 * add_rmsnorm + quantize_fp8 and swiglu_fp8 == swiglu + quantize_fp8, bitwise;
 * negative (padding) slots leave the pool untouched; and a whole model (bf16
 * and fp8 weights) gives bitwise the same logits with the fused ops as with the
 * unfused sequences. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/model_internal.h"
#include "testutil.h"

static kvs_rng seeded(void) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    return rng;
}

static float *normal(kvs_rng *rng, size_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = kvs_rng_normal(rng) * scale;
    return x;
}

static float *dup(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    memcpy(y, x, sizeof(float) * n);
    return y;
}

Test(fused, add_rmsnorm_equals_add_then_rmsnorm) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create(0, &be), KVS_OK);
    kvs_rng rng = seeded();
    const int ns[] = {1, 5, 37}, dims[] = {1000, 1003, 4096};
    for (int a = 0; a < 3; a++)
        for (int c = 0; c < 3; c++) {
            int n = ns[a], dim = dims[c];
            size_t t = (size_t)n * dim;
            float *x = normal(&rng, t, 3.0f), *y = normal(&rng, t, 1.0f), *w = normal(&rng, dim, 1.0f);
            float *x1 = dup(x, t), *xn1 = malloc(sizeof(float) * t), *x2 = dup(x, t), *xn2 = malloc(sizeof(float) * t);
            be->add(be, x1, y, t);
            be->rmsnorm(be, xn1, x1, w, n, dim, 1e-5f);
            be->add_rmsnorm(be, x2, xn2, y, w, n, dim, 1e-5f);
            cr_expect(memcmp(x1, x2, sizeof(float) * t) == 0, "add_rmsnorm n %d dim %d: x differs", n, dim);
            cr_expect(memcmp(xn1, xn2, sizeof(float) * t) == 0, "add_rmsnorm n %d dim %d: xn differs", n, dim);
            free(x), free(y), free(w), free(x1), free(xn1), free(x2), free(xn2);
        }
    be->destroy(be);
}

/* x, codes and scales of add_rmsnorm_fp8 against add_rmsnorm + quantize_fp8, on
 * f32 weights and on bf16 ones (w widened into the scratch beside xn), rows of
 * zeros included; swiglu_fp8 against swiglu + quantize_fp8. Bit for bit. */
Test(fused, fp8_quantize_in_add_rmsnorm_and_swiglu_equals_the_pairs) {
    kvs_backend *be[2];
    cr_assert_eq(kvs_backend_cpu_create(0, &be[0]), KVS_OK);
    cr_assert_eq(kvs_backend_cpu_create_typed(0, KVS_BF16, KVS_F32, &be[1]), KVS_OK);
    kvs_rng rng = seeded();
    const int ns[] = {1, 5, 37}, dims[] = {16, 1000, 1003, 4096};
    for (int k = 0; k < 2; k++)
        for (int a = 0; a < 3; a++)
            for (int c = 0; c < 4; c++) {
                kvs_backend *b = be[k];
                int n = ns[a], dim = dims[c];
                size_t t = (size_t)n * dim;
                float *x = normal(&rng, t, 3.0f), *y = normal(&rng, t, 1.0f), *wf = normal(&rng, dim, 1.0f);
                float *gu = normal(&rng, 2 * t, 2.0f), *act = malloc(sizeof(float) * t);
                if (n > 1)
                    for (int j = 0; j < dim; j++) x[dim + j] = -y[dim + j], gu[2 * dim + j] = 0.f; /* zero rows */
                uint16_t *wb = malloc(sizeof(uint16_t) * dim);
                for (int j = 0; j < dim; j++) wb[j] = kvs_f32_to_bf16(wf[j]);
                const void *w = k ? (const void *)wb : (const void *)wf;
                float *x1 = dup(x, t), *xn1 = malloc(sizeof(float) * t), *x2 = dup(x, t);
                uint8_t *q1 = malloc(t), *q2 = malloc(t);
                float *s1 = malloc(sizeof(float) * n), *s2 = malloc(sizeof(float) * n);
                b->add_rmsnorm(b, x1, xn1, y, w, n, dim, 1e-5f);
                b->quantize_fp8(b, q1, s1, xn1, KVS_F32, n, dim);
                b->add_rmsnorm_fp8(b, x2, q2, s2, y, w, n, dim, 1e-5f);
                cr_expect(memcmp(x1, x2, sizeof(float) * t) == 0, "add_rmsnorm_fp8 n %d dim %d: x differs", n, dim);
                cr_expect(memcmp(q1, q2, t) == 0 && memcmp(s1, s2, sizeof(float) * n) == 0,
                          "add_rmsnorm_fp8 n %d dim %d (%s weights): codes or scales differ", n, dim, k ? "bf16" : "f32");
                b->swiglu(b, act, gu, n, dim);
                b->quantize_fp8(b, q1, s1, act, KVS_F32, n, dim);
                b->swiglu_fp8(b, q2, s2, gu, n, dim);
                cr_expect(memcmp(q1, q2, t) == 0 && memcmp(s1, s2, sizeof(float) * n) == 0,
                          "swiglu_fp8 n %d dim %d: codes or scales differ", n, dim);
                if (n > 1) cr_expect(s2[1] == 1.0f, "swiglu_fp8: a row of zeros has scale %g, not 1", s2[1]);
                cr_expect_eq(b->check(b), KVS_OK, "%s", kvs_last_error());
                free(x), free(y), free(wf), free(wb), free(gu), free(act), free(x1), free(xn1), free(x2);
                free(q1), free(q2), free(s1), free(s2);
            }
    be[0]->destroy(be[0]);
    be[1]->destroy(be[1]);
}

/* Llama 3.1's scaled inverse frequencies for head_dim d. */
static void llama3_inv_freq(int d, float *inv_freq) {
    kvs_config cfg = {0};
    cfg.head_dim = d;
    cfg.rope_theta = 500000.0f;
    cfg.rope_type = KVS_ROPE_LLAMA3;
    cfg.rope_factor = 8.0f;
    cfg.rope_low_freq_factor = 1.0f;
    cfg.rope_high_freq_factor = 4.0f;
    cfg.rope_original_max_position = 8192;
    kvs_rope_inv_freq(&cfg, inv_freq);
}

#define SENTINEL 12345.0f

Test(fused, rope_kv_write_equals_rope_then_kv_write) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create(0, &be), KVS_OK);
    kvs_rng rng = seeded();
    /* heads, KV heads, head_dim (an odd one too: its last element is not rotated) */
    const int shapes[][3] = {{32, 8, 128}, {8, 8, 64}, {8, 1, 128}, {28, 4, 64}, {4, 2, 21}};
    for (int sh = 0; sh < 5; sh++) {
        int H = shapes[sh][0], KV = shapes[sh][1], D = shapes[sh][2], n = 37, n_blocks = 7;
        size_t qn = (size_t)n * H * D, kn = (size_t)n * KV * D, pool_n = (size_t)n_blocks * 2 * KV * 16 * D;
        float *q = normal(&rng, qn, 1.0f), *k = normal(&rng, kn, 1.0f), *v = normal(&rng, kn, 1.0f);
        float inv_freq[128];
        llama3_inv_freq(D, inv_freq);
        /* positions 0.. then up to 131072; slots: shuffled entries of 7 blocks, every 5th row padding (-1) */
        int32_t pos[37], slots[37], entries[7 * 16];
        for (int e = 0; e < n_blocks * 16; e++) entries[e] = e;
        for (int e = n_blocks * 16 - 1; e > 0; e--) {
            int j = (int)(kvs_rng_u64(&rng) % (uint64_t)(e + 1)), t = entries[e];
            entries[e] = entries[j], entries[j] = t;
        }
        for (int i = 0; i < n; i++) {
            pos[i] = i < 8 ? i : (int32_t)(kvs_rng_u64(&rng) % 131073);
            slots[i] = i % 5 == 4 ? -1 : entries[i];
        }
        float *pool1 = malloc(sizeof(float) * pool_n), *pool2 = malloc(sizeof(float) * pool_n);
        for (size_t i = 0; i < pool_n; i++) pool1[i] = pool2[i] = SENTINEL;
        kvs_kv_pool p1 = {pool1, n_blocks, 16, KV, D}, p2 = {pool2, n_blocks, 16, KV, D};
        float *q1 = dup(q, qn), *k1 = dup(k, kn), *q2 = malloc(sizeof(float) * qn);
        float *qkv = qkv_rows(q, k, v, n, (size_t)H * D, (size_t)KV * D), *qkv0 = dup(qkv, qn + 2 * kn);
        be->rope(be, q1, pos, inv_freq, n, H, D);
        be->rope(be, k1, pos, inv_freq, n, KV, D);
        be->kv_write(be, &p1, k1, v, slots, n);
        be->rope_kv_write(be, &p2, q2, qkv, pos, inv_freq, slots, n, H);
        cr_expect(memcmp(qkv, qkv0, sizeof(float) * (qn + 2 * kn)) == 0, "rope_kv_write %d/%d x %d: qkv changed", H,
                  KV, D);
        cr_expect(memcmp(q1, q2, sizeof(float) * qn) == 0, "rope_kv_write %d/%d x %d: q differs", H, KV, D);
        cr_expect(memcmp(pool1, pool2, sizeof(float) * pool_n) == 0, "rope_kv_write %d/%d x %d: pool differs", H,
                  KV, D);
        /* exactly the non-padding rows' slots were written, in K and V of every head */
        int written = 0, want = 0;
        for (int i = 0; i < n; i++) want += slots[i] >= 0;
        for (int blk = 0; blk < n_blocks; blk++)
            for (int off = 0; off < 16; off++) {
                bool hit = pool2[(((size_t)blk * 2 + 0) * KV + 0) * 16 * D + (size_t)off * D] != SENTINEL;
                written += hit;
                for (int kind = 0; kind < 2; kind++)
                    for (int h = 0; h < KV; h++)
                        cr_assert_eq(pool2[(((size_t)blk * 2 + kind) * KV + h) * 16 * D + (size_t)off * D] != SENTINEL,
                                     hit, "block %d offset %d: heads/kinds disagree on being written", blk, off);
            }
        cr_expect_eq(written, want, "%d slots written, %d non-padding rows", written, want);
        free(q), free(k), free(v), free(q1), free(k1), free(q2), free(qkv), free(qkv0), free(pool1), free(pool2);
    }
    be->destroy(be);
}

/* The unfused sequences, as a backend's fused ops. */
static void unfused_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                                float eps) {
    b->add(b, x, y, (size_t)n * dim);
    b->rmsnorm(b, xn, x, w, n, dim, eps);
}

static void unfused_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                                  const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                                  int n_heads) {
    int qd = n_heads * pool->head_dim, kd = pool->n_kv_heads * pool->head_dim, ld = qd + 2 * kd;
    float *k = malloc(sizeof(float) * (size_t)(2 * n * kd + 1)), *v = k + (size_t)n * kd;
    for (int i = 0; i < n; i++) { /* the columns of the one QKV GEMM's rows */
        memcpy((float *)q + (size_t)i * qd, (const float *)qkv + (size_t)i * ld, sizeof(float) * qd);
        memcpy(k + (size_t)i * kd, (const float *)qkv + (size_t)i * ld + qd, sizeof(float) * kd);
        memcpy(v + (size_t)i * kd, (const float *)qkv + (size_t)i * ld + qd + kd, sizeof(float) * kd);
    }
    b->rope(b, q, positions, inv_freq, n, n_heads, pool->head_dim);
    b->rope(b, k, positions, inv_freq, n, pool->n_kv_heads, pool->head_dim);
    b->kv_write(b, pool, k, v, slots, n);
    free(k);
}

/* The fp8 activation ops as their unfused pairs (xn and act in buffers of their own). */
static void unfused_add_rmsnorm_fp8(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w,
                                    int n, int dim, float eps) {
    float *xn = malloc(sizeof(float) * (size_t)n * dim);
    unfused_add_rmsnorm(b, x, xn, y, w, n, dim, eps);
    b->quantize_fp8(b, q, scale, xn, KVS_F32, n, dim);
    free(xn);
}

static void unfused_swiglu_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim) {
    float *act = malloc(sizeof(float) * (size_t)n * dim);
    b->swiglu(b, act, gate_up, n, dim);
    b->quantize_fp8(b, q, scale, act, KVS_F32, n, dim);
    free(act);
}

static void model_logits_case(kvs_quantization quant) {
    kvs_backend *plain;
    cr_assert_eq(kvs_backend_cpu_create(0, &plain), KVS_OK);
    plain->add_rmsnorm = unfused_add_rmsnorm;
    plain->rope_kv_write = unfused_rope_kv_write;
    plain->add_rmsnorm_fp8 = unfused_add_rmsnorm_fp8;
    plain->swiglu_fp8 = unfused_swiglu_fp8;
    rig fused, ref;
    rig_open_quantized(&fused, src_path("models/tiny-needle-llama"), NULL, RIG_BLOCKS(200, 1), 1, quant);
    rig_open_quantized(&ref, src_path("models/tiny-needle-llama"), plain, RIG_BLOCKS(200, 1), 1, quant);
    kvs_rng rng = seeded();
    int V = fused.cfg.vocab_size, n = 61;
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)(kvs_rng_u64(&rng) % (uint64_t)V);
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    int sa = kvs_kv_seq_create(fused.kv), sb = kvs_kv_seq_create(ref.kv);
    rig_run(&fused, sa, ids, n, 0, a); /* a prefill, then three decode steps */
    rig_run(&ref, sb, ids, n, 0, b);
    cr_expect(memcmp(a, b, sizeof(float) * V) == 0, "prefill logits differ");
    for (int i = n; i < 64; i++) {
        rig_run(&fused, sa, ids + i, 1, i, a);
        rig_run(&ref, sb, ids + i, 1, i, b);
        cr_expect(memcmp(a, b, sizeof(float) * V) == 0, "decode step at position %d: logits differ", i);
    }
    free(a), free(b);
    rig_close(&fused);
    rig_close(&ref);
    plain->destroy(plain);
}

Test(fused, model_logits_equal_unfused) { model_logits_case(KVS_QUANT_NONE); }
Test(fused, model_logits_equal_unfused_fp8) { model_logits_case(KVS_QUANT_FP8); }
