#define _GNU_SOURCE /* qsort_r */
/* The logits ops around the draw on the CPU (the references for the CUDA
 * kernels): process_logits (penalties, logit_bias, bans, grammar masks) and
 * top_logprobs, each against a plain restatement of backend/sample.h on
 * fresh random rows (seeded: kvs_test_seed, printed); then the sample op on
 * processed rows never picks a masked or banned token. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/sample.h"
#include "core/core.h"
#include "testutil.h"

static kvs_backend *cpu(void) {
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(1, &b), KVS_OK);
    return b;
}

/* What one token becomes: the rules of backend/sample.h in double. */
static double expected(float x, bool masked, const kvs_logit_adjust *a, const kvs_process_row *q) {
    if (!isfinite(x)) return x;
    if (masked) return KVS_SAMPLE_MASKED;
    if (!a) return x;
    if (a->bias == -INFINITY) return KVS_SAMPLE_MASKED;
    double v = (double)x + a->bias;
    if (q->repetition != 1 && (a->count > 0 || a->in_prompt)) v = v > 0 ? v / q->repetition : v * q->repetition;
    v -= (double)q->frequency * a->count + (a->count > 0 ? q->presence : 0);
    return v;
}

Test(logits, process_applies_bias_penalties_bans_and_masks_as_stated) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    kvs_backend *b = cpu();
    enum { ROWS = 6, V = 1000, LD = 1003 };
    int words = kvs_sample_mask_words(V);
    float *x = malloc(sizeof(float) * ROWS * LD), *y = malloc(sizeof(float) * ROWS * V);
    uint32_t *masks = malloc(sizeof(uint32_t) * ROWS * words);
    kvs_logit_adjust *adj = malloc(sizeof *adj * ROWS * 300);
    kvs_process_row rows[ROWS];
    int n_adj = 0, n_masks = 0;
    for (int r = 0; r < ROWS; r++) {
        for (int i = 0; i < LD; i++) x[r * LD + i] = kvs_rng_normal(&rng) * 4;
        if (r == 5) x[r * LD + 17] = NAN, x[r * LD + 18] = -INFINITY; /* left as they are */
        rows[r] = (kvs_process_row){.presence = r % 2 ? kvs_rng_uniform(&rng) * 2 - 1 : 0,
                                    .frequency = r % 3 ? kvs_rng_uniform(&rng) * 2 - 1 : 0,
                                    .repetition = r == 0 ? 1 : 0.5f + kvs_rng_uniform(&rng) * 1.5f,
                                    .adjust_begin = n_adj, .mask_row = -1};
        /* distinct ids: every third token at a random offset */
        int off = (int)(kvs_rng_uniform(&rng) * 3), count = 0;
        for (int i = off; i < V && count < 300; i += 3 + (int)(kvs_rng_uniform(&rng) * 4)) {
            float u = kvs_rng_uniform(&rng);
            adj[n_adj + count++] = (kvs_logit_adjust){.id = i, .count = u < 0.3f ? 0 : (int)(u * 5),
                                                      .bias = u < 0.1f ? -INFINITY : (kvs_rng_uniform(&rng) - 0.5f) * 20,
                                                      .in_prompt = kvs_rng_uniform(&rng) < 0.5f};
        }
        rows[r].adjust_count = count;
        n_adj += count;
        if (r % 2 == 1) {
            rows[r].mask_row = n_masks;
            for (int w = 0; w < words; w++) masks[n_masks * words + w] = (uint32_t)kvs_rng_u64(&rng);
            n_masks++;
        }
    }
    b->process_logits(b, y, V, x, LD, ROWS, V, rows, adj, masks);
    int checked = 0;
    for (int r = 0; r < ROWS; r++) {
        const kvs_process_row *q = &rows[r];
        for (int i = 0; i < V; i++) {
            const kvs_logit_adjust *a = NULL;
            for (int e = q->adjust_begin; e < q->adjust_begin + q->adjust_count; e++)
                if (adj[e].id == i) a = &adj[e];
            bool masked = q->mask_row >= 0 && !(masks[q->mask_row * words + i / 32] >> (i % 32) & 1);
            double want = expected(x[r * LD + i], masked, a, q);
            float got = y[r * V + i];
            if (isnan(want)) cr_expect(isnan(got), "row %d token %d: NaN kept", r, i);
            else cr_expect(got == (float)want || fabs(got - want) <= 1e-6 * fabs(want) + 1e-6,
                           "row %d token %d: %.9g, expected %.9g", r, i, got, want);
            checked++;
        }
    }
    cr_expect_eq(checked, ROWS * V);
    free(x), free(y), free(masks), free(adj);
    b->destroy(b);
}

static int cmp_desc(const void *pa, const void *pb, void *ctx) {
    const float *x = ctx;
    int a = *(const int *)pa, c = *(const int *)pb;
    if (x[a] != x[c]) return x[a] > x[c] ? -1 : 1;
    return a - c;
}

Test(logits, top_logprobs_are_the_k_best_of_a_full_log_softmax) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    kvs_backend *b = cpu();
    enum { ROWS = 5, V = 777, K = 20 };
    float *x = malloc(sizeof(float) * ROWS * V);
    int32_t chosen[ROWS], ids[ROWS * K];
    float chosen_lp[ROWS], lp[ROWS * K];
    for (int r = 0; r < ROWS; r++) {
        for (int i = 0; i < V; i++) x[r * V + i] = kvs_rng_normal(&rng) * 3;
        /* ties among the best: equal values go to the lower id */
        if (r == 1) x[r * V + 300] = x[r * V + 200] = x[r * V + 100] = 50;
        chosen[r] = (int32_t)(kvs_rng_uniform(&rng) * V) % V;
    }
    x[3 * V + 400] = NAN; /* a failed row */
    chosen[4] = -1;       /* a row that sampled nothing */
    b->top_logprobs(b, chosen_lp, ids, lp, x, ROWS, V, V, chosen, K);
    int order[V];
    for (int r = 0; r < ROWS; r++) {
        const float *xr = x + r * V;
        if (r >= 3) {
            cr_expect(isnan(chosen_lp[r]), "row %d: chosen logprob NaN", r);
            for (int j = 0; j < K; j++) cr_expect(ids[r * K + j] == -1 && isnan(lp[r * K + j]), "row %d", r);
            continue;
        }
        double m = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) m = fmax(m, xr[i]);
        for (int i = 0; i < V; i++) sum += exp((double)xr[i] - m);
        double lse = m + log(sum);
        for (int i = 0; i < V; i++) order[i] = i;
        qsort_r(order, V, sizeof(int), cmp_desc, (void *)xr);
        cr_expect(fabs(chosen_lp[r] - (xr[chosen[r]] - lse)) <= 1e-5, "row %d: chosen %g", r, chosen_lp[r]);
        for (int j = 0; j < K; j++) {
            cr_expect_eq(ids[r * K + j], order[j], "row %d rank %d: id %d, expected %d", r, j, ids[r * K + j], order[j]);
            cr_expect(fabs(lp[r * K + j] - (xr[order[j]] - lse)) <= 1e-5, "row %d rank %d: %g", r, j, lp[r * K + j]);
        }
        if (r == 1) cr_expect(ids[K] == 100 && ids[K + 1] == 200 && ids[K + 2] == 300, "ties to the lower id");
    }
    /* k beyond a tiny vocabulary: the rest is -1 / -inf */
    float small[3] = {1, 2, 3};
    int32_t c0 = 0, sid[5];
    float slp[5], clp;
    b->top_logprobs(b, &clp, sid, slp, small, 1, 3, 3, &c0, 5);
    cr_expect(sid[0] == 2 && sid[1] == 1 && sid[2] == 0 && sid[3] == -1 && sid[4] == -1);
    cr_expect(slp[3] == -INFINITY && slp[4] == -INFINITY);
    free(x);
    b->destroy(b);
}

/* The sample op on processed rows: masked and banned tokens are never drawn,
 * whatever the temperature and filters, while a row keeps one allowed token;
 * the row does not read as non-finite. */
Test(logits, masked_and_banned_tokens_are_never_sampled) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    kvs_backend *b = cpu();
    enum { V = 300, TRIES = 400 };
    float x[V], y[V];
    uint32_t mask[(V + 31) / 32] = {0};
    int allowed[3] = {5, 150, 299};
    for (int j = 0; j < 3; j++) mask[allowed[j] / 32] |= 1u << (allowed[j] % 32);
    kvs_logit_adjust ban = {.id = 150, .bias = -INFINITY};
    kvs_process_row q = {.repetition = 1, .adjust_begin = 0, .adjust_count = 1, .mask_row = 0};
    for (int t = 0; t < TRIES; t++) {
        for (int i = 0; i < V; i++) x[i] = kvs_rng_normal(&rng) * 5 + (i == 7 ? 100 : 0); /* 7: by far the best, masked */
        b->process_logits(b, y, V, x, V, 1, V, &q, &ban, mask);
        kvs_sample_row p = {.temperature = t % 4 == 0 ? 0 : 0.25f * (t % 4) + 0.1f, .top_k = t % 3 ? 0 : 50,
                            .top_p = t % 5 ? 1 : 0.5f, .min_p = t % 7 ? 0 : 0.1f, .seed = (uint64_t)t};
        int32_t id = -1;
        b->sample(b, &id, NULL, y, 1, V, V, &p);
        cr_assert(id == 5 || id == 299, "try %d: drew %d (allowed: 5, 299)", t, id);
    }
    b->destroy(b);
}
