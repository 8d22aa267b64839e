/* Layer-wise sparsity: LSE-based SnapKV scores against an explicit softmax,
 * selection, attention over a compacted cache, chunked vs one-shot prefill,
 * bounded decode, and the policies' budgets. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kv/kv.h"
#include "model/model.h"
#include "testutil.h"

/* A cache of one layer filled with random K/V for one sequence of n entries. */
typedef struct {
    kvs_backend *be;
    kvs_kv_cache *kv;
    int seq, n, H, KVH, d;
    float *k, *v; /* [n][KVH][d] host copies */
} filled_cache;

static void fill_cache(filled_cache *f, int n, int H, int KVH, int d, kvs_rng *rng) {
    memset(f, 0, sizeof *f);
    cr_assert_eq(kvs_backend_cpu_create(1, &f->be), KVS_OK);
    kvs_kv_config kc = {.n_layers = 1, .n_kv_heads = KVH, .head_dim = d, .n_heads = H, .block_size = 16,
                        .n_blocks = (n + 15) / 16 * 2 + 4, .max_seqs = 2};
    cr_assert_eq(kvs_kv_create(&kc, f->be, &f->kv), KVS_OK);
    f->seq = kvs_kv_seq_create(f->kv);
    f->n = n, f->H = H, f->KVH = KVH, f->d = d;
    cr_assert_eq(kvs_kv_reserve(f->kv, f->seq, n), KVS_OK);
    size_t sz = (size_t)n * KVH * d;
    f->k = malloc(sizeof(float) * sz);
    f->v = malloc(sizeof(float) * sz);
    for (size_t i = 0; i < sz; i++) {
        f->k[i] = kvs_rng_normal(rng);
        f->v[i] = kvs_rng_normal(rng);
    }
    int32_t *slots = malloc(sizeof(int32_t) * n);
    for (int e = 0; e < n; e++) slots[e] = kvs_kv_slot(f->kv, f->seq, 0, e);
    f->be->kv_write(f->be, kvs_kv_get_pool(f->kv), f->k, f->v, slots, n);
    kvs_kv_commit(f->kv, f->seq, n);
    free(slots);
}

static void free_cache(filled_cache *f) {
    kvs_kv_destroy(f->kv);
    f->be->destroy(f->be);
    free(f->k);
    free(f->v);
}

/* The attention op's view of one sequence whose last q_len entries are the queries. */
static kvs_attn_batch one_seq_batch(const filled_cache *f, int q_len, int32_t *qs, int32_t *kvlen, int32_t **table) {
    int nb;
    const int32_t *blocks = kvs_kv_blocks(f->kv, f->seq, 0, &nb);
    *table = malloc(sizeof(int32_t) * nb);
    memcpy(*table, blocks, sizeof(int32_t) * nb);
    qs[0] = 0, qs[1] = q_len;
    *kvlen = kvs_kv_len(f->kv, f->seq, 0);
    return (kvs_attn_batch){1, q_len, nb, q_len, *kvlen, qs, kvlen, *table};
}

/* Scores from the prefill's LSE equal the explicit softmax over the window
 * (double-precision reference; relative tolerance 1e-4). GQA 1, 2 and 4. */
Test(sparsity, lse_scores_equal_explicit_softmax) {
    uint64_t seed = kvs_test_seed();
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    int cases[][3] = {{4, 4, 16}, {4, 2, 32}, {8, 2, 64}}; /* H, KVH, d */
    for (int c = 0; c < 3; c++) {
        int H = cases[c][0], KVH = cases[c][1], d = cases[c][2], g = H / KVH;
        int n = 37 + (int)(kvs_rng_u64(&rng) % 200), w = 1 + (int)(kvs_rng_u64(&rng) % 32);
        filled_cache f;
        fill_cache(&f, n, H, KVH, d, &rng);
        float *q = malloc(sizeof(float) * w * H * d), *out = malloc(sizeof(float) * w * H * d);
        float *lse = malloc(sizeof(float) * w * H), *scores = malloc(sizeof(float) * KVH * (n - w));
        for (int i = 0; i < w * H * d; i++) q[i] = kvs_rng_normal(&rng);
        int32_t qs[2], kvlen, *table;
        kvs_attn_batch ab = one_seq_batch(&f, w, qs, &kvlen, &table);
        float scale = 1.0f / sqrtf((float)d);
        f.be->attention(f.be, out, lse, q, kvs_kv_get_pool(f.kv), &ab, H, scale);
        f.be->sparsity_scores(f.be, scores, q, lse, w, kvs_kv_get_pool(f.kv), table, n - w, H, scale);
        for (int kh = 0; kh < KVH; kh++) {
            double *ref = calloc(n, sizeof(double)), mx_ref = 0, mx_diff = 0;
            for (int i = 0; i < w; i++)
                for (int h = kh * g; h < (kh + 1) * g; h++) {
                    int n_keys = n - w + i + 1; /* causal */
                    double *p = malloc(sizeof(double) * n_keys), m = -INFINITY, sum = 0;
                    for (int j = 0; j < n_keys; j++) {
                        double dot = 0;
                        for (int t = 0; t < d; t++) dot += (double)q[(i * H + h) * d + t] * f.k[(j * KVH + kh) * d + t];
                        p[j] = dot * scale;
                        if (p[j] > m) m = p[j];
                    }
                    for (int j = 0; j < n_keys; j++) sum += p[j] = exp(p[j] - m);
                    for (int j = 0; j < n - w; j++) ref[j] += p[j] / sum;
                    free(p);
                }
            for (int j = 0; j < n - w; j++) {
                double diff = fabs(scores[kh * (n - w) + j] - ref[j]);
                if (isnan(scores[kh * (n - w) + j])) diff = INFINITY;
                if (diff > mx_diff) mx_diff = diff;
                if (ref[j] > mx_ref) mx_ref = ref[j];
            }
            cr_expect(mx_diff <= 1e-4 * mx_ref, "seed %llu H %d KVH %d d %d n %d w %d: max diff %g of %g",
                      (unsigned long long)seed, H, KVH, d, n, w, mx_diff, mx_ref);
            free(ref);
        }
        free(q), free(out), free(lse), free(scores), free(table);
        free_cache(&f);
    }
}

Test(sparsity, pooling_and_top_k_match_brute_force) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    for (int trial = 0; trial < 50; trial++) {
        int n = 1 + (int)(kvs_rng_u64(&rng) % 300), p = 1 + 2 * (int)(kvs_rng_u64(&rng) % 5);
        int k = (int)(kvs_rng_u64(&rng) % (n + 2));
        float *s = malloc(sizeof(float) * n), *pooled = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) s[i] = (float)(kvs_rng_u64(&rng) % 50); /* ties on purpose */
        kvs_kv_pool_scores(s, n, p, pooled);
        for (int j = 0; j < n; j++) {
            float m = -INFINITY;
            for (int t = j - p / 2; t <= j + p / 2; t++)
                if (t >= 0 && t < n && s[t] > m) m = s[t];
            cr_assert_eq(pooled[j], m);
        }
        int32_t *top = malloc(sizeof(int32_t) * (n + 2));
        kvs_kv_top_k_sorted(pooled, n, k, top);
        int kk = k < n ? k : n;
        for (int i = 1; i < kk; i++) cr_assert_lt(top[i - 1], top[i]);
        /* every kept score >= every dropped score */
        char *kept = calloc(n, 1);
        for (int i = 0; i < kk; i++) kept[top[i]] = 1;
        float min_kept = INFINITY, max_dropped = -INFINITY;
        for (int j = 0; j < n; j++) {
            if (kept[j] && pooled[j] < min_kept) min_kept = pooled[j];
            if (!kept[j] && pooled[j] > max_dropped) max_dropped = pooled[j];
        }
        if (kk > 0 && kk < n) cr_assert_geq(min_kept, max_dropped);
        free(s), free(pooled), free(top), free(kept);
    }
}

/* Attention over a compacted cache equals dense attention restricted to the
 * kept entries (double reference, 1e-5 relative). */
Test(sparsity, attention_over_compacted_cache_equals_restricted_dense) {
    uint64_t seed = kvs_test_seed();
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    int H = 4, KVH = 2, d = 32, n = 150 + (int)(kvs_rng_u64(&rng) % 100), n_keep = 40;
    filled_cache f;
    fill_cache(&f, n, H, KVH, d, &rng);
    int32_t *keep = malloc(sizeof(int32_t) * KVH * n_keep);
    for (int h = 0; h < KVH; h++) {
        int k = 0;
        for (int e = 0; e < n && k < n_keep; e++)
            if ((int)(kvs_rng_u64(&rng) % (n - e)) < n_keep - k) keep[h * n_keep + k++] = e;
    }
    cr_assert_eq(kvs_kv_compact(f.kv, f.seq, 0, keep, n_keep), KVS_OK, "%s", kvs_last_error());
    /* one decode query appended after the kept entries */
    cr_assert_eq(kvs_kv_reserve(f.kv, f.seq, 1), KVS_OK);
    float qk[2 * 32], qv[2 * 32], q[4 * 32], out[4 * 32], lse[4];
    for (int i = 0; i < KVH * d; i++) qk[i] = kvs_rng_normal(&rng), qv[i] = kvs_rng_normal(&rng);
    for (int i = 0; i < H * d; i++) q[i] = kvs_rng_normal(&rng);
    int32_t slot = kvs_kv_slot(f.kv, f.seq, 0, n_keep);
    f.be->kv_write(f.be, kvs_kv_get_pool(f.kv), qk, qv, &slot, 1);
    kvs_kv_commit(f.kv, f.seq, 1);
    int32_t qs[2], kvlen, *table;
    kvs_attn_batch ab = one_seq_batch(&f, 1, qs, &kvlen, &table);
    float scale = 1.0f / sqrtf((float)d);
    f.be->attention(f.be, out, lse, q, kvs_kv_get_pool(f.kv), &ab, H, scale);
    for (int h = 0; h < H; h++) {
        int kh = h / (H / KVH);
        double s[64], m = -INFINITY, sum = 0, ref[32] = {0};
        for (int i = 0; i <= n_keep; i++) {
            const float *kk = i < n_keep ? f.k + ((size_t)keep[kh * n_keep + i] * KVH + kh) * d : qk + kh * d;
            double dot = 0;
            for (int t = 0; t < d; t++) dot += (double)q[h * d + t] * kk[t];
            s[i] = dot * scale;
            if (s[i] > m) m = s[i];
        }
        for (int i = 0; i <= n_keep; i++) sum += s[i] = exp(s[i] - m);
        for (int i = 0; i <= n_keep; i++) {
            const float *vv = i < n_keep ? f.v + ((size_t)keep[kh * n_keep + i] * KVH + kh) * d : qv + kh * d;
            for (int t = 0; t < d; t++) ref[t] += s[i] / sum * vv[t];
        }
        for (int t = 0; t < d; t++)
            cr_assert(fabs(out[h * d + t] - ref[t]) <= 1e-5 * (1 + fabs(ref[t])), "seed %llu head %d dim %d: %g vs %g",
                      (unsigned long long)seed, h, t, out[h * d + t], ref[t]);
        cr_assert(fabs(lse[h] - (m + log(sum))) < 1e-4);
    }
    free(keep), free(table);
    free_cache(&f);
}

Test(sparsity, policy_budgets) {
    int b[32];
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    kvs_kv_policy_budgets(&p, 8, 2000, b);
    for (int l = 0; l < 8; l++) cr_assert_eq(b[l], 200);
    p.full_layers = 2;
    kvs_kv_policy_budgets(&p, 8, 2000, b);
    cr_assert_eq(b[0], -1);
    cr_assert_eq(b[1], -1);
    cr_assert_eq(b[2], 200);
    p = kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV);
    kvs_kv_policy_budgets(&p, 32, 4000, b);
    long total = 0;
    for (int l = 0; l < 32; l++) {
        total += b[l];
        if (l) cr_assert_leq(b[l], b[l - 1], "pyramid budgets fall with depth");
        cr_assert_geq(b[l], p.window);
    }
    cr_assert(labs(total - 32 * 400) <= 32, "pyramid total %ld vs uniform %d", total, 32 * 400);
    p.min_prompt = 500;
    kvs_kv_policy_budgets(&p, 32, 499, b);
    cr_assert_eq(b[5], -1, "short prompts are not compressed");
    cr_assert_eq(kvs_kv_budget_parse("5%", &p), KVS_OK);
    cr_assert_float_eq(p.budget_fraction, 0.05f, 1e-7);
    cr_assert_eq(kvs_kv_budget_parse("256", &p), KVS_OK);
    cr_assert_eq(p.budget_tokens, 256);
    cr_assert_eq(kvs_kv_budget_parse("-1", &p), KVS_ERR_INVALID);
    cr_assert_eq(kvs_kv_budget_parse("abc", &p), KVS_ERR_INVALID);
    kvs_policy_kind k;
    cr_assert_eq(kvs_kv_policy_kind_parse("h2o", &k), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "h2o"));
    p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    p.pool = 4;
    cr_assert_eq(kvs_kv_policy_validate(&p, 8), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "kv_pool"));
}

/* ---- on the tiny model --------------------------------------------------- */
/* The K vector of (seq, layer, head, entry). */
static const float *key_of(rig *r, int seq, int layer, int head, int entry) {
    const kvs_kv_pool *p = kvs_kv_get_pool(r->kv);
    int32_t slot = kvs_kv_slot(r->kv, seq, layer, entry);
    size_t per_head = (size_t)p->block_size * p->head_dim;
    return (const float *)p->data + (size_t)(slot / p->block_size) * 2 * p->n_kv_heads * per_head +
           (size_t)head * per_head + (size_t)(slot % p->block_size) * p->head_dim;
}

/* Pooled SnapKV scores of (seq, layer) from its captured window, as the kv module computes them. */
static void pooled_scores(rig *r, int seq, int layer, int n, int w, float *pooled /* [2][n - w] */) {
    void *win_q;
    float *win_lse;
    kvs_kv_window_buffers(r->kv, layer, &win_q, &win_lse);
    int row0 = kvs_kv_window_row(r->kv, seq, layer, n - w), nb, H = r->cfg.n_heads, d = r->cfg.head_dim;
    const int32_t *table = kvs_kv_blocks(r->kv, seq, layer, &nb);
    float *raw = malloc(sizeof(float) * 2 * (n - w));
    r->be->sparsity_scores(r->be, raw, (const float *)win_q + (size_t)row0 * H * d, win_lse + (size_t)row0 * H, w,
                           kvs_kv_get_pool(r->kv), table, n - w, H, 1.0f / sqrtf((float)d));
    for (int g = 0; g < 2; g++) kvs_kv_pool_scores(raw + g * (n - w), n - w, 7, pooled + g * (n - w));
    free(raw);
}

/* A prompt prefilled in one step and in chunks (the window may straddle
 * chunks) gets the same scores (within 1e-3 of the head's largest score plus
 * 1e-3 relative: float noise from sgemm over other row counts, amplified by
 * exp through 8 layers) and keeps the same entries,
 * except where two candidates at the selection boundary are tied within that
 * rounding (max-pooling makes plateaus of equal scores; which of them a
 * run keeps is then decided by float noise from sgemm over other row counts).
 * Compaction keeps exactly the selected entries. */
Test(sparsity, chunked_and_one_shot_prefill_select_the_same_entries, .timeout = 600) {
    rig r;
    rig_open(&r, src_path("models/tiny-needle-llama"), NULL, 4 * 8 * 40 + 16, 4);
    kvs_rng rng;
    uint64_t seed = kvs_test_seed();
    kvs_rng_seed(&rng, seed);
    int n = 500 + (int)(kvs_rng_u64(&rng) % 100), w = kvs_kv_policy_default(KVS_POLICY_SNAPKV).window;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(kvs_rng_u64(&rng) % 8187);
    kvs_kv_policy capture = kvs_kv_policy_default(KVS_POLICY_SNAPKV), p = kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV);
    capture.budget_fraction = 1.0f; /* capture the window, keep everything */
    float *logits = malloc(sizeof(float) * r.cfg.vocab_size);
    int a = kvs_kv_seq_create(r.kv), b = kvs_kv_seq_create(r.kv);
    cr_assert_eq(kvs_kv_set_policy(r.kv, a, &capture, n), KVS_OK);
    cr_assert_eq(kvs_kv_set_policy(r.kv, b, &capture, n), KVS_OK);
    rig_run(&r, a, ids, n, 0, logits);
    int chunk = 7 + (int)(kvs_rng_u64(&rng) % 120);
    for (int s = 0; s < n; s += chunk) rig_run(&r, b, ids + s, s + chunk > n ? n - s : chunk, s, logits);
    int budgets[8], m = n - w, ties = 0;
    kvs_kv_policy_budgets(&p, 8, n, budgets);
    int32_t *sel_a = malloc(sizeof(int32_t) * 2 * n), *sel_b = malloc(sizeof(int32_t) * 2 * n);
    float *pa = malloc(sizeof(float) * 2 * m), *pb = malloc(sizeof(float) * 2 * m);
    int a_full, b_full; /* full copies, to check what compaction moved */
    cr_assert_eq(kvs_kv_fork(r.kv, a, &a_full), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_kv_fork(r.kv, b, &b_full), KVS_OK, "%s", kvs_last_error());
    for (int l = 0; l < 8; l++) {
        int k = budgets[l] - w;
        pooled_scores(&r, a, l, n, w, pa);
        pooled_scores(&r, b, l, n, w, pb);
        for (int g = 0; g < 2; g++) {
            float mx = 0;
            for (int j = 0; j < m; j++) mx = fmaxf(mx, pa[g * m + j]);
            for (int j = 0; j < m; j++)
                cr_assert(fabsf(pa[g * m + j] - pb[g * m + j]) <= 1e-3f * (mx + fabsf(pa[g * m + j])), "seed %llu layer %d head %d key %d: %g vs %g",
                          (unsigned long long)seed, l, g, j, pa[g * m + j], pb[g * m + j]);
            kvs_kv_top_k_sorted(pa + g * m, m, k, sel_a + g * n);
            kvs_kv_top_k_sorted(pb + g * m, m, k, sel_b + g * n);
            float kth = INFINITY; /* the selection boundary: the smallest kept score */
            for (int i = 0; i < k; i++) kth = fminf(kth, pa[g * m + sel_a[g * n + i]]);
            char *in_b = calloc(m, 1);
            for (int i = 0; i < k; i++) in_b[sel_b[g * n + i]] = 1;
            for (int i = 0; i < k; i++) {
                int e = sel_a[g * n + i];
                if (in_b[e]) continue;
                ties++;
                cr_assert(fabsf(pa[g * m + e] - kth) <= 1e-3f * (mx + kth), "seed %llu n %d chunk %d layer %d head %d: entry %d "
                          "kept by one run only, score %g vs boundary %g", (unsigned long long)seed, n, chunk, l, g, e,
                          pa[g * m + e], kth);
            }
            free(in_b);
        }
    }
    cr_log_info("n %d chunk %d: %d boundary ties", n, chunk, ties);
    /* now compress both with pyramidkv: each keeps exactly its own selection plus the window */
    cr_assert_eq(kvs_kv_set_policy(r.kv, a, &p, n), KVS_OK);
    cr_assert_eq(kvs_kv_sparsify(r.kv, a), KVS_OK, "%s", kvs_last_error());
    for (int l = 0; l < 8; l++) {
        cr_assert_eq(kvs_kv_len(r.kv, a, l), budgets[l], "layer %d holds its budget", l);
        pooled_scores(&r, a_full, l, n, w, pa);
        for (int g = 0; g < 2; g++) {
            int k = budgets[l] - w;
            kvs_kv_top_k_sorted(pa + g * m, m, k, sel_a);
            for (int i = 0; i < budgets[l]; i++) {
                int src = i < k ? sel_a[i] : m + (i - k);
                cr_assert(!memcmp(key_of(&r, a, l, g, i), key_of(&r, a_full, l, g, src), sizeof(float) * 128),
                          "layer %d head %d: kept entry %d is not entry %d", l, g, i, src);
            }
        }
    }
    int64_t held, full;
    kvs_kv_seq_usage(r.kv, a, &held, &full);
    cr_assert_lt(held * 5, full, "about 10x compression: %lld of %lld", (long long)held, (long long)full);
    for (int s = 0; s < 4; s++) kvs_kv_free(r.kv, s);
    cr_assert_eq(kvs_kv_check(r.kv), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_kv_used_blocks(r.kv), 0);
    free(ids), free(logits), free(sel_a), free(sel_b), free(pa), free(pb);
    rig_close(&r);
}

/* 2,000 decode tokens with a 10% budget: every sparse layer stays <= B_l + w. */
Test(sparsity, decode_stays_bounded, .timeout = 1200) {
    rig r;
    rig_open(&r, src_path("models/tiny-needle-llama"), NULL, 8 * 40, 1);
    int n = 400, steps = 2000;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(kvs_rng_u64(&rng) % 8187);
    float *logits = malloc(sizeof(float) * r.cfg.vocab_size);
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    p.full_layers = 0;
    int seq = kvs_kv_seq_create(r.kv);
    cr_assert_eq(kvs_kv_set_policy(r.kv, seq, &p, n), KVS_OK);
    rig_run(&r, seq, ids, n, 0, logits);
    int budgets[8];
    kvs_kv_policy_budgets(&p, 8, n, budgets);
    int64_t peak_blocks = kvs_kv_used_blocks(r.kv);
    for (int t = 0; t < steps; t++) {
        int32_t id = argmax_f(logits, r.cfg.vocab_size);
        rig_run(&r, seq, &id, 1, n + t, logits);
        for (int l = 0; l < 8; l++)
            cr_assert_leq(kvs_kv_len(r.kv, seq, l), budgets[l] + p.window, "step %d layer %d: %d entries", t, l,
                          kvs_kv_len(r.kv, seq, l));
        if (kvs_kv_used_blocks(r.kv) > peak_blocks) peak_blocks = kvs_kv_used_blocks(r.kv);
    }
    cr_assert_leq(peak_blocks, 8 * ((40 + p.window + 15) / 16 + 1), "blocks held stay bounded: %lld", (long long)peak_blocks);
    cr_assert_eq(kvs_kv_check(r.kv), KVS_OK, "%s", kvs_last_error());
    free(ids), free(logits);
    rig_close(&r);
}

/* StreamingLLM keeps the sinks and the most recent entries. */
Test(sparsity, streamingllm_keeps_sinks_and_recent) {
    rig r;
    rig_open(&r, src_path("models/tiny-needle-llama"), NULL, 8 * 40, 1);
    int n = 300;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(i * 37 % 8187);
    float *logits = malloc(sizeof(float) * r.cfg.vocab_size);
    int seq = kvs_kv_seq_create(r.kv);
    kvs_kv_policy p = kvs_kv_policy_default(KVS_POLICY_STREAMINGLLM);
    /* reference keys: the same prompt in a full sequence, compared entry by entry */
    kvs_kv_cache *kv_sparse = r.kv;
    cr_assert_eq(kvs_kv_set_policy(kv_sparse, seq, &p, n), KVS_OK);
    rig_run(&r, seq, ids, n, 0, logits);
    int B = 30; /* round(10% of 300) */
    for (int l = 0; l < 8; l++) cr_assert_eq(kvs_kv_len(r.kv, seq, l), B);
    float first[128], last[128];
    memcpy(first, key_of(&r, seq, 3, 1, 0), sizeof first);
    memcpy(last, key_of(&r, seq, 3, 1, B - 1), sizeof last);
    kvs_kv_free(r.kv, seq);
    seq = kvs_kv_seq_create(r.kv);
    rig_run(&r, seq, ids, n, 0, logits);
    cr_assert(!memcmp(first, key_of(&r, seq, 3, 1, 0), sizeof first), "sink 0 kept");
    cr_assert(!memcmp(last, key_of(&r, seq, 3, 1, n - 1), sizeof last), "most recent kept");
    free(ids), free(logits);
    rig_close(&r);
}

/* kvs_kv_window_scores gives what selection ranks: pyramidkv keeps, in every
 * head, exactly the top (B - w) of the pooled scores of entries [0, n - w) plus
 * the window (the reference and the compaction score with the same op on this
 * backend, so the comparison is exact). */
Test(sparsity, window_scores_are_what_compaction_ranks, .timeout = 600) {
    rig r;
    rig_open(&r, src_path("models/tiny-needle-llama"), NULL, 4 * 8 * 30 + 16, 2);
    kvs_rng rng;
    uint64_t seed = kvs_test_seed();
    kvs_rng_seed(&rng, seed);
    int n = 300 + (int)(kvs_rng_u64(&rng) % 100);
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(kvs_rng_u64(&rng) % 8187);
    kvs_kv_policy capture = kvs_kv_policy_default(KVS_POLICY_SNAPKV), p = kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV);
    capture.budget_fraction = 1.0f;
    p.budget_fraction = 0.05f + 0.1f * (float)kvs_rng_uniform(&rng);
    p.window = capture.window = 8 + (int)(kvs_rng_u64(&rng) % 25);
    int w = p.window, m = n - w, group = r.cfg.n_heads / r.cfg.n_kv_heads;
    float *logits = malloc(sizeof(float) * r.cfg.vocab_size);
    int a = kvs_kv_seq_create(r.kv), a_full;
    cr_assert_eq(kvs_kv_set_policy(r.kv, a, &capture, n), KVS_OK);
    rig_run(&r, a, ids, n, 0, logits);
    cr_assert_eq(kvs_kv_fork(r.kv, a, &a_full), KVS_OK, "%s", kvs_last_error());
    int budgets[8];
    kvs_kv_policy_budgets(&p, 8, n, budgets);
    float *raw[8], *pooled = malloc(sizeof(float) * m);
    int32_t *sel = malloc(sizeof(int32_t) * m);
    for (int l = 0; l < 8; l++) {
        raw[l] = malloc(sizeof(float) * 2 * m);
        cr_assert_eq(kvs_kv_window_scores(r.kv, a_full, l, raw[l]), KVS_OK, "%s", kvs_last_error());
        for (int g = 0; g < 2; g++) { /* attention rows sum to 1: at most group x w before the window */
            double sum = 0;
            for (int j = 0; j < m; j++) sum += raw[l][g * m + j];
            cr_assert(sum > 0 && sum <= group * w * (1 + 1e-4), "layer %d head %d: mass %g", l, g, sum);
        }
    }
    cr_assert_eq(kvs_kv_set_policy(r.kv, a, &p, n), KVS_OK);
    cr_assert_eq(kvs_kv_sparsify(r.kv, a), KVS_OK, "%s", kvs_last_error());
    for (int l = 0; l < 8; l++) {
        int k = budgets[l] - w;
        cr_assert_eq(kvs_kv_len(r.kv, a, l), budgets[l], "layer %d holds its budget", l);
        for (int g = 0; g < 2; g++) {
            kvs_kv_pool_scores(raw[l] + g * m, m, p.pool, pooled);
            kvs_kv_top_k_sorted(pooled, m, k, sel);
            for (int i = 0; i < budgets[l]; i++) {
                int src = i < k ? sel[i] : m + (i - k);
                cr_assert(!memcmp(key_of(&r, a, l, g, i), key_of(&r, a_full, l, g, src), sizeof(float) * 128),
                          "seed %llu n %d window %d layer %d head %d: kept entry %d is not entry %d",
                          (unsigned long long)seed, n, w, l, g, i, src);
            }
        }
        free(raw[l]);
    }
    kvs_kv_free(r.kv, a), kvs_kv_free(r.kv, a_full);
    cr_assert_eq(kvs_kv_check(r.kv), KVS_OK, "%s", kvs_last_error());
    free(ids), free(logits), free(pooled), free(sel);
    rig_close(&r);
}

/* The sparse layers together keep exactly (sparse layers) x B entries per KV head
 * under every shape (uniform, pyramid, a profile), each layer at least the window
 * and at most the whole prompt; a profile's shares set the proportions. */
Test(sparsity, budgets_keep_the_total_exactly) {
    kvs_rng rng;
    uint64_t seed = kvs_test_seed();
    kvs_rng_seed(&rng, seed);
    float shares[32];
    kvs_kv_profile prof = {.n_layers = 32, .n_targets = 1, .compression = {10}, .share = {shares}};
    for (int trial = 0; trial < 300; trial++) {
        int L = 1 + (int)(kvs_rng_u64(&rng) % 32), n = 64 + (int)(kvs_rng_u64(&rng) % 20000);
        kvs_kv_policy p = kvs_kv_policy_default((kvs_policy_kind)(1 + kvs_rng_u64(&rng) % 2));
        p.budget_fraction = 0.01f + 0.5f * (float)kvs_rng_uniform(&rng);
        p.full_layers = (int)(kvs_rng_u64(&rng) % L);
        p.pyramid_beta = 1 + 30 * (float)kvs_rng_uniform(&rng);
        prof.n_layers = L;
        for (int l = 0; l < L; l++) shares[l] = 0.01f + (float)kvs_rng_uniform(&rng);
        bool with_profile = kvs_rng_u64(&rng) % 2;
        p.profile = with_profile ? &prof : NULL;
        int b[32], B = (int)lround(p.budget_fraction * n), m = L - p.full_layers;
        kvs_kv_policy_budgets(&p, L, n, b);
        long total = 0;
        for (int l = 0; l < L; l++) {
            if (l < p.full_layers) {
                cr_assert_eq(b[l], -1);
                continue;
            }
            cr_assert(b[l] >= p.window && b[l] <= n, "seed %llu trial %d layer %d: budget %d (n %d)",
                      (unsigned long long)seed, trial, l, b[l], n);
            total += b[l];
        }
        if ((long)m * p.window <= (long)m * B && B <= n)
            cr_assert_eq(total, (long)m * B, "seed %llu trial %d: total %ld, not %d x %d", (unsigned long long)seed,
                         trial, total, m, B);
        if (with_profile && B >= 4 * p.window) /* no clamp in reach: budgets follow the shares to within 1 entry */
            for (int l = p.full_layers + 1; l < L; l++) {
                double want = (double)b[p.full_layers] * shares[l] / shares[p.full_layers];
                bool clamped = b[l] == p.window || b[l] == n || b[p.full_layers] == p.window || b[p.full_layers] == n;
                if (!clamped && want >= p.window && want <= n)
                    cr_assert(fabs(b[l] - want) <= 1 + want * 1e-3 + 1.0 * shares[l] / shares[p.full_layers],
                              "seed %llu trial %d layer %d: %d vs %g", (unsigned long long)seed, trial, l, b[l], want);
            }
    }
    cr_assert_eq(kvs_kv_profile_target(&(kvs_kv_profile){.n_targets = 2, .compression = {10, 20}}, 14.0), 0);
    cr_assert_eq(kvs_kv_profile_target(&(kvs_kv_profile){.n_targets = 2, .compression = {10, 20}}, 15.0), 1);
}

/* ---- kvs_kv_sparsify_seqs: one batch for the step's sequences ---------------
 * Three caches on one backend get the same operations: sequences of several
 * policies (SnapKV and PyramidKV with other windows, budgets and pool kernels,
 * StreamingLLM, full, a prompt prefilled in two chunks, and with prefix caching
 * a sequence on a cached prompt, whose compaction writes blocks of its own) and
 * the same K/V and window queries at every position. After each step cache 1
 * compacts the sequences one by one (kvs_kv_sparsify), cache 2 in one call
 * (kvs_kv_sparsify_seqs: the batch), and cache 0 is the reference without the
 * kv module's sparsity: its sequences are full, the test keeps their windows
 * and decides what is due (the rule of kv.h), scores and selects with the
 * backend's per-pair ops and compacts with kvs_kv_compact. Every layer's
 * length and every entry's K and V (the stored bytes: codes for FP8 pools) must
 * be the same in the three. */
enum { BATCH_SEQS = 8, BATCH_L = 4, BATCH_H = 4, BATCH_KVH = 2, BATCH_D = 16, BATCH_CACHES = 3, BATCH_MAX_W = 32 };

typedef struct {
    kvs_backend *be;
    kvs_kv_cache *kv[BATCH_CACHES];
    int seq[BATCH_SEQS][BATCH_CACHES], pos[BATCH_SEQS];
    kvs_kv_policy pol[BATCH_SEQS];
    int prompt[BATCH_SEQS];
    /* the reference's sparsity state: budgets (-1: full), the position of the
       last compaction, whether the prompt's compaction ran, the window rings
       (row = position - the window's first prompt position, then decode
       positions modulo w) */
    int budget[BATCH_SEQS][BATCH_L], last[BATCH_SEQS][BATCH_L];
    bool done[BATCH_SEQS];
    float q[BATCH_SEQS][BATCH_L][BATCH_MAX_W][BATCH_H * BATCH_D], lse[BATCH_SEQS][BATCH_L][BATCH_MAX_W][BATCH_H];
} batch_rig;

static int ref_row(const batch_rig *br, int i, int position) {
    int w = br->pol[i].window, n = br->prompt[i];
    if (position < n) return position >= n - w ? position - (n - w) : -1;
    return (position - n) % w;
}

/* Writes positions pos .. pos + n - 1 of sequence i in the caches: random K/V
 * rows and window queries (q, lse), kept where each cache keeps them. */

/* kvs_kv_slots and kvs_kv_window_rows (a step's tokens at once) give the slots of the
   layer's table (block * block_size + entry % block_size) and what kvs_kv_window_row
   gives one by one: n new entries of (s, l) at positions pos0 .. */
static void expect_ranges_match_one_by_one(const kvs_kv_cache *kv, int s, int l, int pos0, int n) {
    int32_t *got = malloc(sizeof(int32_t) * n), *pos = malloc(sizeof(int32_t) * n);
    int len = kvs_kv_len(kv, s, l), nb, bs = kvs_kv_get_config(kv)->block_size;
    const int32_t *blocks = kvs_kv_blocks(kv, s, l, &nb);
    kvs_kv_slots(kv, s, l, len, n, got);
    for (int t = 0; t < n; t++)
        cr_assert_eq(got[t], blocks[(len + t) / bs] * bs + (len + t) % bs, "slot of new entry %d, layer %d", t, l);
    for (int t = 0; t < n; t++) pos[t] = pos0 + t;
    kvs_kv_window_rows(kv, s, l, pos, n, got);
    for (int t = 0; t < n; t++)
        cr_assert_eq(got[t], kvs_kv_window_row(kv, s, l, pos0 + t), "window row of position %d, layer %d", pos0 + t, l);
    free(got);
    free(pos);
}

static void batch_append(batch_rig *br, kvs_rng *rng, int i, int n) {
    const int row = BATCH_KVH * BATCH_D, qrow = BATCH_H * BATCH_D;
    kvs_backend *be = br->be;
    float *k = malloc(sizeof(float) * n * row), *v = malloc(sizeof(float) * n * row);
    float *q = malloc(sizeof(float) * n * BATCH_L * qrow), *lse = malloc(sizeof(float) * n * BATCH_L * BATCH_H);
    for (int j = 0; j < n * row; j++) k[j] = kvs_rng_normal(rng), v[j] = kvs_rng_normal(rng);
    for (int j = 0; j < n * BATCH_L * qrow; j++) q[j] = kvs_rng_normal(rng);
    for (int j = 0; j < n * BATCH_L * BATCH_H; j++) lse[j] = 2.0f + 3.0f * (float)kvs_rng_uniform(rng);
    int32_t *slots = malloc(sizeof(int32_t) * n);
    for (int c = 0; c < BATCH_CACHES; c++) {
        kvs_kv_cache *kv = br->kv[c];
        int s = br->seq[i][c];
        cr_assert_eq(kvs_kv_reserve(kv, s, n), KVS_OK, "%s", kvs_last_error());
        for (int l = 0; l < BATCH_L; l++) {
            for (int t = 0; t < n; t++) slots[t] = kvs_kv_slot(kv, s, l, kvs_kv_len(kv, s, l) + t);
            expect_ranges_match_one_by_one(kv, s, l, br->pos[i], n);
            kvs_kv_pool pool = kvs_kv_layer_pool(kv, l);
            be->kv_write(be, &pool, k, v, slots, n);
            void *wq = NULL;
            float *wl = NULL;
            kvs_kv_window_buffers(kv, l, &wq, &wl);
            for (int t = 0; t < n; t++) {
                int r = c ? kvs_kv_window_row(kv, s, l, br->pos[i] + t) : ref_row(br, i, br->pos[i] + t);
                if (r < 0 || (c == 0 && br->budget[i][l] < 0)) continue;
                float *dq = c ? (float *)wq + (size_t)r * qrow : br->q[i][l][r], *dl = c ? wl + (size_t)r * BATCH_H : br->lse[i][l][r];
                memcpy(dq, q + ((size_t)t * BATCH_L + l) * qrow, sizeof(float) * qrow);
                memcpy(dl, lse + ((size_t)t * BATCH_L + l) * BATCH_H, sizeof(float) * BATCH_H);
            }
        }
        kvs_kv_commit(kv, s, n);
    }
    br->pos[i] += n;
    free(k), free(v), free(q), free(lse), free(slots);
}

/* The reference: what is due in sequence i of cache 0, compacted with the
 * backend's per-pair ops and kvs_kv_compact. */
static int ref_sparsify(batch_rig *br, int i) {
    const kvs_kv_policy *p = &br->pol[i];
    int s = br->seq[i][0], n = br->pos[i], w = p->window, compacted = 0;
    if (p->kind == KVS_POLICY_FULL || n < br->prompt[i]) return 0;
    bool at_prompt_end = !br->done[i];
    br->done[i] = true;
    for (int l = 0; l < BATCH_L; l++) {
        int b = br->budget[i][l], len = kvs_kv_len(br->kv[0], s, l);
        if (b < 0 || !(at_prompt_end ? len > b : len >= b + w && n - br->last[i][l] >= w)) continue;
        br->last[i][l] = n;
        int32_t *keep = malloc(sizeof(int32_t) * BATCH_KVH * b);
        if (p->kind == KVS_POLICY_STREAMINGLLM) {
            int sinks = p->sinks < b ? p->sinks : b;
            for (int h = 0; h < BATCH_KVH; h++)
                for (int j = 0; j < b; j++) keep[h * b + j] = j < sinks ? j : len - b + j;
        } else {
            int nb;
            const int32_t *table = kvs_kv_blocks(br->kv[0], s, l, &nb);
            float *scores = malloc(sizeof(float) * BATCH_KVH * (len - w));
            kvs_kv_pool pool = kvs_kv_layer_pool(br->kv[0], l);
            br->be->sparsity_scores(br->be, scores, br->q[i][l], br->lse[i][l][0], w, &pool, table, len - w, BATCH_H,
                                    1.0f / sqrtf((float)BATCH_D));
            br->be->snapkv_select(br->be, keep, scores, len - w, BATCH_KVH, p->pool, b - w, w);
            free(scores);
        }
        cr_assert_eq(kvs_kv_compact(br->kv[0], s, l, keep, b), KVS_OK, "%s", kvs_last_error());
        free(keep);
        compacted++;
    }
    return compacted;
}

/* The stored bytes of entry e (K or V of head h) of (seq, layer). */
static const unsigned char *batch_entry(kvs_kv_cache *kv, kvs_backend *be, int seq, int layer, int kind, int h, int e) {
    const kvs_kv_pool *p = kvs_kv_get_pool(kv);
    int32_t slot = kvs_kv_slot(kv, seq, layer, e);
    size_t row = (size_t)p->head_dim * kvs_dtype_size(be->kv_dtype);
    size_t block = kvs_kv_block_bytes(kvs_kv_get_config(kv), be->kv_dtype);
    return (const unsigned char *)p->data + (size_t)(slot / p->block_size) * block +
           (((size_t)kind * p->n_kv_heads + h) * p->block_size + slot % p->block_size) * row;
}

static void batch_case(kvs_dtype kv_dtype, bool prefix_caching, uint64_t seed) {
    batch_rig *br = calloc(1, sizeof *br);
    cr_assert_eq(kvs_backend_cpu_create_typed(1, KVS_F32, kv_dtype, &br->be), KVS_OK);
    kvs_backend *be = br->be;
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    kvs_kv_config kc = {.n_layers = BATCH_L, .n_kv_heads = BATCH_KVH, .head_dim = BATCH_D, .n_heads = BATCH_H,
                        .block_size = 16, .n_blocks = 2000, .max_seqs = BATCH_SEQS, .max_window = BATCH_MAX_W,
                        .prefix_caching = prefix_caching};
    float scales[BATCH_L * 2 * BATCH_KVH];
    for (int i = 0; i < BATCH_L * 2 * BATCH_KVH; i++) scales[i] = 0.25f + 1.75f * (float)kvs_rng_uniform(&rng);
    for (int c = 0; c < BATCH_CACHES; c++) {
        cr_assert_eq(kvs_kv_create(&kc, be, &br->kv[c]), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_kv_set_scales(br->kv[c], scales), KVS_OK, "%s", kvs_last_error());
    }
    /* policy kind, budget (tokens; 0: 25%), window, pool, full layers; prompts of 64 .. 263 tokens */
    const struct { kvs_policy_kind kind; int budget, window, pool, full; } pol[BATCH_SEQS] = {
        {KVS_POLICY_SNAPKV, 0, 8, 3, 1},    {KVS_POLICY_PYRAMIDKV, 0, 16, 7, 0}, {KVS_POLICY_STREAMINGLLM, 0, 8, 7, 1},
        {KVS_POLICY_SNAPKV, 40, 4, 1, 0},   {KVS_POLICY_PYRAMIDKV, 0, 5, 5, 1},  {KVS_POLICY_FULL, 0, 8, 7, 0},
        {KVS_POLICY_PYRAMIDKV, 0, 32, 3, 1}, {KVS_POLICY_SNAPKV, 0, 8, 3, 1}};
    int32_t prompt_ids[264];
    for (int i = 0; i < 264; i++) prompt_ids[i] = (int32_t)(kvs_rng_u64(&rng) % 1000);
    for (int i = 0; i < BATCH_SEQS; i++) {
        /* with prefix caching, sequence 7 takes sequence 0's prompt and reuses its cached blocks */
        br->prompt[i] = prefix_caching && i == 7 ? br->prompt[0] : 64 + (int)(kvs_rng_u64(&rng) % 200);
        kvs_kv_policy p = kvs_kv_policy_default(pol[i].kind);
        p.budget_tokens = pol[i].budget;
        p.budget_fraction = 0.25f;
        p.window = pol[i].window, p.pool = pol[i].pool, p.full_layers = pol[i].full, p.min_prompt = 0;
        br->pol[i] = p;
        kvs_kv_policy_budgets(&p, BATCH_L, br->prompt[i], br->budget[i]);
        for (int l = 0; l < BATCH_L; l++) br->last[i][l] = br->prompt[i];
        kvs_kv_policy full = kvs_kv_policy_default(KVS_POLICY_FULL);
        for (int c = 0; c < BATCH_CACHES; c++) {
            br->seq[i][c] = kvs_kv_seq_create(br->kv[c]);
            cr_assert_geq(br->seq[i][c], 0);
            cr_assert_eq(kvs_kv_set_policy(br->kv[c], br->seq[i][c], c ? &p : &full, br->prompt[i]), KVS_OK, "%s",
                         kvs_last_error());
        }
    }
    int32_t ids[BATCH_CACHES][BATCH_SEQS];
    int compactions = 0, steps = 70;
    for (int step = 0; step < steps; step++) {
        int n = 0;
        for (int i = 0; i < BATCH_SEQS; i++) {
            if (prefix_caching && i == 7 && step < 2) continue; /* once sequence 0's prompt is cached */
            if (prefix_caching && (i == 0 || i == 7) && br->pos[i] == 0) { /* the window stays past the hit */
                int hit[BATCH_CACHES];
                for (int c = 0; c < BATCH_CACHES; c++) {
                    hit[c] = kvs_kv_prefix_attach(br->kv[c], br->seq[i][c], prompt_ids, br->prompt[i], NULL,
                                                  br->prompt[i] - br->pol[i].window);
                    cr_assert_eq(hit[c], hit[0]);
                }
                cr_assert(i == 0 || hit[0] > 0, "sequence 7 should reuse sequence 0's cached prompt");
                br->pos[i] = hit[0];
            }
            /* prompts in one step (sequence 4's in two), then a token a step */
            int left = br->prompt[i] - br->pos[i];
            batch_append(br, &rng, i, left <= 0 ? 1 : i == 4 && left == br->prompt[i] ? left / 2 : left);
            for (int c = 0; c < BATCH_CACHES; c++) ids[c][n] = br->seq[i][c];
            n++;
        }
        for (int j = 0; j < n; j++) {
            int i = 0;
            while (br->seq[i][0] != ids[0][j]) i++;
            compactions += ref_sparsify(br, i);
            cr_assert_eq(kvs_kv_sparsify(br->kv[1], ids[1][j]), KVS_OK, "%s", kvs_last_error());
        }
        cr_assert_eq(kvs_kv_sparsify_seqs(br->kv[2], ids[2], n), KVS_OK, "%s", kvs_last_error());
        size_t bytes = kvs_dtype_size(be->kv_dtype) * BATCH_D;
        for (int i = 0; i < BATCH_SEQS; i++)
            for (int l = 0; l < BATCH_L; l++) {
                int len = kvs_kv_len(br->kv[0], br->seq[i][0], l);
                for (int c = 1; c < BATCH_CACHES; c++) {
                    cr_assert_eq(kvs_kv_len(br->kv[c], br->seq[i][c], l), len,
                                 "seed %llu step %d sequence %d layer %d: %d entries %s, %d in the reference",
                                 (unsigned long long)seed, step, i, l, kvs_kv_len(br->kv[c], br->seq[i][c], l),
                                 c == 1 ? "one by one" : "batched", len);
                    for (int e = 0; e < len; e++)
                        for (int kind = 0; kind < 2; kind++)
                            for (int h = 0; h < BATCH_KVH; h++)
                                cr_assert(!memcmp(batch_entry(br->kv[0], be, br->seq[i][0], l, kind, h, e),
                                                  batch_entry(br->kv[c], be, br->seq[i][c], l, kind, h, e), bytes),
                                          "seed %llu step %d sequence %d layer %d: %s of head %d, entry %d differs %s",
                                          (unsigned long long)seed, step, i, l, kind ? "V" : "K", h, e,
                                          c == 1 ? "one by one" : "batched");
                }
            }
        for (int c = 0; c < BATCH_CACHES; c++) cr_assert_eq(kvs_kv_check(br->kv[c]), KVS_OK, "%s", kvs_last_error());
    }
    cr_log_info("%s pool%s: %d layer compactions in %d steps, the same in the three caches", kvs_dtype_name(kv_dtype),
                prefix_caching ? ", prefix caching" : "", compactions, steps);
    cr_assert_gt(compactions, 6 * BATCH_SEQS, "the decode steps should re-compress the sparse layers");
    for (int c = 0; c < BATCH_CACHES; c++) kvs_kv_destroy(br->kv[c]);
    be->destroy(be);
    free(br);
}

Test(sparsity, batched_sparsify_equals_one_by_one) {
    uint64_t seed = kvs_test_seed();
    batch_case(KVS_F32, false, seed);
    batch_case(KVS_F8_E4M3, false, seed + 1);
    batch_case(KVS_F32, true, seed + 2);
}
