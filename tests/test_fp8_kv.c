/* The FP8 KV cache on the CPU (--kv-cache-dtype fp8; the oracle of the CUDA
 * kernels, docs/CUDA.md "FP8 KV cache"): entries stored as e4m3(x / scale)
 * with a scale per (layer, K/V, KV head), read as code x scale; attention and
 * the SnapKV scores over an FP8 pool equal the same ops over an f32 pool that
 * holds the decoded values; compaction, forks and the prefix cache move codes;
 * bad scales are refused; the tiny model with an FP8 cache stays near bf16. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"
#include "kv/kv.h"
#include "model/model.h"
#include "testutil.h"

Test(fp8_kv, the_decoding_table_is_the_conversion) {
    for (int c = 0; c < 256; c++) {
        float t = kvs_e4m3_values[c], v = kvs_e4m3_to_f32((uint8_t)c);
        cr_expect(isnan(t) ? isnan(v) : t == v && signbit(t) == signbit(v), "code 0x%02x: table %g, conversion %g", c,
                  t, v);
    }
}

/* An FP8 pool of one layer with random scales in [0.05, 2] (K's, then V's). */
typedef struct {
    kvs_backend *be8, *be32; /* f32 activations; FP8 and f32 pools */
    kvs_kv_cache *kv8, *kv32;
    kvs_kv_pool p8, p32;
    float scales[2 * 8];
    int seq8, seq32;
} pools;

static void pools_open(pools *p, int KVH, int H, int d, int64_t n_blocks, kvs_rng *rng) {
    memset(p, 0, sizeof *p);
    cr_assert_eq(kvs_backend_cpu_create_typed(2, KVS_F32, KVS_F8_E4M3, &p->be8), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_backend_cpu_create_typed(2, KVS_F32, KVS_F32, &p->be32), KVS_OK);
    kvs_kv_config kc = {.n_layers = 1, .n_kv_heads = KVH, .head_dim = d, .n_heads = H, .block_size = 16,
                        .n_blocks = n_blocks, .max_seqs = 2};
    cr_assert_eq(kvs_kv_create(&kc, p->be8, &p->kv8), KVS_OK);
    cr_assert_eq(kvs_kv_create(&kc, p->be32, &p->kv32), KVS_OK);
    for (int i = 0; i < 2 * KVH; i++) p->scales[i] = 0.05f + 1.95f * (float)kvs_rng_uniform(rng);
    cr_assert_eq(kvs_kv_set_scales(p->kv8, p->scales), KVS_OK, "%s", kvs_last_error());
    p->p8 = kvs_kv_layer_pool(p->kv8, 0), p->p32 = kvs_kv_layer_pool(p->kv32, 0);
    cr_assert_not_null(p->p8.scales, "an FP8 pool's layer view has scales");
    cr_assert_null(p->p32.scales, "an f32 pool has none");
    p->seq8 = kvs_kv_seq_create(p->kv8), p->seq32 = kvs_kv_seq_create(p->kv32);
}

static void pools_close(pools *p) {
    kvs_kv_destroy(p->kv8), kvs_kv_destroy(p->kv32);
    p->be8->destroy(p->be8), p->be32->destroy(p->be32);
}

/* n random entries (normal x 3, a few far past 448 x scale: saturated) written
 * into both pools: the FP8 pool by kv_write, the f32 pool with the values
 * the FP8 codes decode to (code x scale), so both hold the same numbers. */
static void pools_fill(pools *p, int n, kvs_rng *rng) {
    const kvs_kv_config *c = kvs_kv_get_config(p->kv8);
    int KVH = c->n_kv_heads, d = c->head_dim;
    size_t sz = (size_t)n * KVH * d;
    float *k = malloc(sizeof(float) * sz), *v = malloc(sizeof(float) * sz);
    for (size_t i = 0; i < sz; i++) {
        k[i] = kvs_rng_normal(rng) * 3, v[i] = kvs_rng_normal(rng) * 3;
        if (kvs_rng_u64(rng) % 500 == 0) k[i] *= 400;
    }
    int32_t *s8 = malloc(sizeof(int32_t) * n), *s32 = malloc(sizeof(int32_t) * n);
    cr_assert_eq(kvs_kv_reserve(p->kv8, p->seq8, n), KVS_OK);
    cr_assert_eq(kvs_kv_reserve(p->kv32, p->seq32, n), KVS_OK);
    for (int e = 0; e < n; e++) s8[e] = kvs_kv_slot(p->kv8, p->seq8, 0, e), s32[e] = kvs_kv_slot(p->kv32, p->seq32, 0, e);
    p->be8->kv_write(p->be8, &p->p8, k, v, s8, n);
    for (int e = 0; e < n; e++)
        for (int h = 0; h < KVH; h++)
            for (int j = 0; j < d; j++) {
                size_t i = ((size_t)e * KVH + h) * d + j;
                k[i] = kvs_e4m3_to_f32(kvs_f32_to_e4m3(k[i] / p->scales[h])) * p->scales[h];
                v[i] = kvs_e4m3_to_f32(kvs_f32_to_e4m3(v[i] / p->scales[KVH + h])) * p->scales[KVH + h];
            }
    p->be32->kv_write(p->be32, &p->p32, k, v, s32, n);
    kvs_kv_commit(p->kv8, p->seq8, n), kvs_kv_commit(p->kv32, p->seq32, n);
    free(k), free(v), free(s8), free(s32);
}

/* The code of entry (kind, head, e) of seq's layer 0 in an FP8 pool. */
static const uint8_t *code_at(const kvs_kv_cache *kv, int seq, int kind, int h, int e) {
    const kvs_kv_pool *p = kvs_kv_get_pool(kv);
    int32_t slot = kvs_kv_slot(kv, seq, 0, e), blk = slot / p->block_size, off = slot % p->block_size;
    return (const uint8_t *)p->data +
           (((size_t)blk * 2 + kind) * p->n_kv_heads + h) * p->block_size * p->head_dim + (size_t)off * p->head_dim;
}

/* kv_write and rope_kv_write store e4m3(x / scale) of every element, bit for
 * bit (saturating), each (K/V, head) with its own scale; padding rows (slot
 * -1) write nothing. */
Test(fp8_kv, writes_store_the_code_of_x_over_its_scale) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int KVH = 3, H = 6, d = 20, n = 37;
    pools p;
    pools_open(&p, KVH, H, d, 8, &rng);
    memset(p.p8.data, 0xAB, (size_t)8 * kvs_kv_block_bytes(kvs_kv_get_config(p.kv8), KVS_F8_E4M3));
    size_t sz = (size_t)n * KVH * d;
    float *k = malloc(sizeof(float) * sz), *v = malloc(sizeof(float) * sz), *q = malloc(sizeof(float) * n * H * d);
    float *kr = malloc(sizeof(float) * sz);
    for (size_t i = 0; i < sz; i++) k[i] = kvs_rng_normal(&rng) * 50, v[i] = kvs_rng_normal(&rng) * 50;
    for (int i = 0; i < n * H * d; i++) q[i] = kvs_rng_normal(&rng);
    k[5] = INFINITY, v[7] = -1e9f; /* saturate to +-448 */
    int32_t slots[37], pos[37];
    cr_assert_eq(kvs_kv_reserve(p.kv8, p.seq8, n), KVS_OK);
    for (int e = 0; e < n; e++) slots[e] = e % 5 == 3 ? -1 : kvs_kv_slot(p.kv8, p.seq8, 0, e), pos[e] = 100 + 7 * e;
    for (int pass = 0; pass < 2; pass++) { /* kv_write, then rope_kv_write (k rotated: the f32 backend's rope) */
        memcpy(kr, k, sizeof(float) * sz);
        if (pass == 0) {
            p.be8->kv_write(p.be8, &p.p8, k, v, slots, n);
        } else {
            float inv_freq[10];
            for (int j = 0; j < d / 2; j++) inv_freq[j] = powf(10000.0f, -2.0f * j / d);
            p.be32->rope(p.be32, kr, pos, inv_freq, n, KVH, d);
            float *qkv = qkv_rows(q, k, v, n, (size_t)H * d, (size_t)KVH * d), *qr = malloc(sizeof(float) * n * H * d);
            p.be8->rope_kv_write(p.be8, &p.p8, qr, qkv, pos, inv_freq, slots, n, H);
            free(qkv), free(qr);
        }
        for (int e = 0; e < n; e++)
            for (int h = 0; h < KVH; h++) {
                const uint8_t *ck = code_at(p.kv8, p.seq8, 0, h, e), *cv = code_at(p.kv8, p.seq8, 1, h, e);
                for (int j = 0; j < d; j++) {
                    size_t i = ((size_t)e * KVH + h) * d + j;
                    uint8_t wk = slots[e] < 0 ? 0xAB : kvs_f32_to_e4m3(kr[i] / p.scales[h]);
                    uint8_t wv = slots[e] < 0 ? 0xAB : kvs_f32_to_e4m3(v[i] / p.scales[KVH + h]);
                    cr_assert_eq(ck[j], wk, "pass %d entry %d head %d elem %d: K code 0x%02x, want 0x%02x", pass, e, h, j,
                                 ck[j], wk);
                    cr_assert_eq(cv[j], wv, "pass %d entry %d head %d elem %d: V code 0x%02x, want 0x%02x", pass, e, h, j,
                                 cv[j], wv);
                }
            }
    }
    cr_expect_eq(p.be8->check(p.be8), KVS_OK);
    free(k), free(v), free(q), free(kr);
    pools_close(&p);
}

/* Attention (prefill chunks after cached entries, and one-token decode rows)
 * and the SnapKV scores over an FP8 pool equal the same ops over an f32 pool
 * of the decoded values: bit for bit (the FP8 pool's rows are decoded into f32
 * and run through the same kernels). GQA 1, 2 and 4; head_dim 16, 64, 128. */
Test(fp8_kv, attention_and_scores_read_code_times_scale) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int cases[][3] = {{2, 2, 16}, {4, 2, 64}, {8, 2, 128}}; /* H, KVH, d */
    for (int c = 0; c < 3; c++) {
        int H = cases[c][0], KVH = cases[c][1], d = cases[c][2];
        int n = 40 + (int)(kvs_rng_u64(&rng) % 300);
        pools p;
        pools_open(&p, KVH, H, d, (n + 15) / 16 + 2, &rng);
        pools_fill(&p, n, &rng);
        for (int q_len = 1; q_len <= 33; q_len += 32) { /* decode row; a 33-query chunk after n - 33 cached */
            float *q = malloc(sizeof(float) * q_len * H * d), *o8 = malloc(sizeof(float) * q_len * H * d);
            float *o32 = malloc(sizeof(float) * q_len * H * d), *l8 = malloc(sizeof(float) * q_len * H);
            float *l32 = malloc(sizeof(float) * q_len * H);
            for (int i = 0; i < q_len * H * d; i++) q[i] = kvs_rng_normal(&rng);
            int nb;
            const int32_t *t8 = kvs_kv_blocks(p.kv8, p.seq8, 0, &nb), *t32 = kvs_kv_blocks(p.kv32, p.seq32, 0, &nb);
            int32_t qs[2] = {0, q_len}, kvlen = n;
            kvs_attn_batch a8 = {1, q_len, nb, q_len, n, qs, &kvlen, t8}, a32 = {1, q_len, nb, q_len, n, qs, &kvlen, t32};
            float scale = 1.0f / sqrtf((float)d);
            p.be8->attention(p.be8, o8, l8, q, &p.p8, &a8, H, scale);
            p.be32->attention(p.be32, o32, l32, q, &p.p32, &a32, H, scale);
            cr_expect(!memcmp(o8, o32, sizeof(float) * q_len * H * d) && !memcmp(l8, l32, sizeof(float) * q_len * H),
                      "H %d KVH %d d %d n %d q_len %d: FP8 attention differs from f32 of the decoded values", H, KVH,
                      d, n, q_len);
            if (q_len > 1) {
                float *s8 = malloc(sizeof(float) * KVH * (n - q_len)), *s32 = malloc(sizeof(float) * KVH * (n - q_len));
                p.be8->sparsity_scores(p.be8, s8, q, l8, q_len, &p.p8, t8, n - q_len, H, scale);
                p.be32->sparsity_scores(p.be32, s32, q, l32, q_len, &p.p32, t32, n - q_len, H, scale);
                cr_expect(!memcmp(s8, s32, sizeof(float) * KVH * (n - q_len)), "H %d d %d: FP8 scores differ", H, d);
                free(s8), free(s32);
            }
            free(q), free(o8), free(o32), free(l8), free(l32);
        }
        cr_expect_eq(p.be8->check(p.be8), KVS_OK);
        pools_close(&p);
    }
}

/* Compaction (kv_gather in place and into new blocks for a shared prompt) and
 * forks move an FP8 layer's codes untouched: each kept entry's codes are the
 * ones it had. */
Test(fp8_kv, compaction_and_forks_move_codes) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int KVH = 2, d = 24, n = 100;
    pools p;
    pools_open(&p, KVH, 4, d, 32, &rng);
    pools_fill(&p, n, &rng);
    uint8_t *before = malloc((size_t)n * 2 * KVH * d);
    for (int e = 0; e < n; e++)
        for (int kind = 0; kind < 2; kind++)
            for (int h = 0; h < KVH; h++)
                memcpy(before + (((size_t)e * 2 + kind) * KVH + h) * d, code_at(p.kv8, p.seq8, kind, h, e), d);
    int fork;
    cr_assert_eq(kvs_kv_fork(p.kv8, p.seq8, &fork), KVS_OK, "%s", kvs_last_error());
    enum { N = 23 };
    int32_t keep[2 * N];
    for (int h = 0; h < KVH; h++)
        for (int i = 0; i < N; i++) keep[h * N + i] = i * 4 + (h + i) % 4; /* ascending, distinct, < 100 */
    cr_assert_eq(kvs_kv_compact(p.kv8, p.seq8, 0, keep, N), KVS_OK, "%s", kvs_last_error());
    for (int h = 0; h < KVH; h++)
        for (int i = 0; i < N; i++)
            for (int kind = 0; kind < 2; kind++) {
                int e = keep[h * N + i];
                cr_assert(!memcmp(code_at(p.kv8, p.seq8, kind, h, i), before + (((size_t)e * 2 + kind) * KVH + h) * d, d),
                          "head %d kept entry %d (was %d), kind %d", h, i, e, kind);
            }
    for (int e = 0; e < n; e++) /* the fork still holds every entry as written */
        for (int kind = 0; kind < 2; kind++)
            for (int h = 0; h < KVH; h++)
                cr_assert(!memcmp(code_at(p.kv8, fork, kind, h, e), before + (((size_t)e * 2 + kind) * KVH + h) * d, d),
                          "fork entry %d", e);
    cr_expect_eq(kvs_kv_check(p.kv8), KVS_OK, "%s", kvs_last_error());
    free(before);
    pools_close(&p);
}

/* Scales must be finite and positive; the refusal names the layer, K or V
 * and the head. A non-FP8 pool ignores scales. */
Test(fp8_kv, bad_scales_are_refused_by_name) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create_typed(1, KVS_F32, KVS_F8_E4M3, &be), KVS_OK);
    kvs_kv_config kc = {.n_layers = 3, .n_kv_heads = 2, .head_dim = 8, .n_heads = 2, .block_size = 16, .n_blocks = 4,
                        .max_seqs = 1};
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK);
    float s[12];
    const float bad[] = {0.0f, -1.0f, NAN, INFINITY};
    for (int b = 0; b < 4; b++) {
        for (int i = 0; i < 12; i++) s[i] = 1.0f;
        s[2 * 2 * 2 + 2 + 1] = bad[b]; /* layer 2, V, head 1 */
        cr_expect_eq(kvs_kv_set_scales(kv, s), KVS_ERR_INVALID, "scale %g accepted", bad[b]);
        cr_expect(strstr(kvs_last_error(), "V scale of layer 2, KV head 1"), "message: %s", kvs_last_error());
    }
    kvs_kv_pool l2 = kvs_kv_layer_pool(kv, 2);
    cr_expect(l2.scales && l2.scales[3] == 1.0f, "a refused set keeps the scales (1)");
    kvs_kv_destroy(kv);
    be->destroy(be);
    cr_assert_eq(kvs_backend_cpu_create_typed(1, KVS_F32, KVS_BF16, &be), KVS_OK);
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK);
    cr_expect_eq(kvs_kv_set_scales(kv, s), KVS_OK, "a bf16 pool ignores scales");
    cr_expect_null(kvs_kv_layer_pool(kv, 0).scales);
    kvs_kv_destroy(kv);
    be->destroy(be);
}

/* The tiny model with an FP8 KV cache against a bf16 one (bf16 weights, f32
 * activations, CPU): 200 random tokens in one prefill. Bound: KL of the
 * next-token distributions <= 0.02 nats (0.0003-0.0056 over seeds 1-30,
 * 2026-12-03; the largest logit difference was 0.7-3.6% of the peak logit), the
 * argmax equal unless the bf16 top-2 gap is below the largest difference. */
Test(fp8_kv, tiny_model_with_fp8_cache_stays_near_bf16, .timeout = 300) {
    const char *dir = src_path("models/tiny-needle-llama");
    kvs_backend *b16, *b8;
    cr_assert_eq(kvs_backend_cpu_create_typed(0, KVS_BF16, KVS_BF16, &b16), KVS_OK);
    cr_assert_eq(kvs_backend_cpu_create_typed(0, KVS_BF16, KVS_F8_E4M3, &b8), KVS_OK);
    rig r16, r8;
    rig_open(&r16, dir, b16, RIG_BLOCKS(256, 2), 2);
    rig_open(&r8, dir, b8, RIG_BLOCKS(256, 2), 2);
    int V = r16.cfg.vocab_size, n = 200;
    int32_t *ids = malloc(sizeof(int32_t) * (n + 1));
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    float *l16 = malloc(sizeof(float) * V), *l8 = malloc(sizeof(float) * V), *lf = malloc(sizeof(float) * V);
    /* The mean KL over 16 random prompts: one prompt's is heavy-tailed (over
       200 seeds: median 0.0014, p99 0.022, max 0.079 nats; a flat next-token
       distribution moves most), so one prompt against a bound failed 3 seeds
       of 200. Each prompt's argmax is still checked. */
    enum { PROMPTS = 16 };
    double kl = 0;
    int s16 = -1, s8 = -1;
    for (int p = 0; p < PROMPTS; p++) {
        if (p) kvs_kv_free(r16.kv, s16), kvs_kv_free(r8.kv, s8);
        for (int i = 0; i <= n; i++) ids[i] = (int32_t)(kvs_rng_uniform(&rng) * (V - 16));
        s16 = kvs_kv_seq_create(r16.kv), s8 = kvs_kv_seq_create(r8.kv);
        rig_run(&r16, s16, ids, n, 0, l16);
        rig_run(&r8, s8, ids, n, 0, l8);
        kl += expect_logits_near("tiny model fp8 vs bf16 KV", l16, l8, V, INFINITY) / PROMPTS;
    }
    cr_expect_leq(kl, 0.02, "tiny model fp8 vs bf16 KV: next-token distributions %g nats apart on average (bound 0.02)", kl);
    /* a fork decodes the next token exactly as its parent (it holds the same codes) */
    int f8;
    cr_assert_eq(kvs_kv_fork(r8.kv, s8, &f8), KVS_OK, "%s", kvs_last_error());
    rig_run(&r8, s8, ids + n, 1, n, l8);
    rig_run(&r8, f8, ids + n, 1, n, lf);
    cr_expect(!memcmp(l8, lf, sizeof(float) * V), "the fork's next logits equal its parent's");
    free(ids), free(l16), free(l8), free(lf);
    rig_close(&r16), rig_close(&r8);
    b16->destroy(b16), b8->destroy(b8);
}
