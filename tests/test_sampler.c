/* Sampling: greedy, seeded reproducibility, top-k / top-p / min-p filtering,
 * the distribution at temperature 1, and parameter validation. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

enum { V = 50 };

static void random_logits(float *x, uint64_t seed) {
    kvs_rng r;
    kvs_rng_seed(&r, seed);
    for (int i = 0; i < V; i++) x[i] = 3.0f * kvs_rng_normal(&r);
}

static int32_t sample_once(kvs_sampling_params p, const float *logits, kvs_sampler **keep) {
    float tmp[V];
    memcpy(tmp, logits, sizeof tmp);
    kvs_sampler *s = *keep;
    if (!s) cr_assert_eq(kvs_sampler_create(&p, V, &s), KVS_OK, "%s", kvs_last_error());
    *keep = s;
    return kvs_sampler_sample(s, tmp, NULL);
}

static int argmax(const float *x) {
    int b = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

Test(sampler, greedy_is_argmax_with_logprob) {
    float x[V];
    random_logits(x, 1);
    kvs_sampling_params p = kvs_sampling_default();
    kvs_sampler *s;
    cr_assert_eq(kvs_sampler_create(&p, V, &s), KVS_OK);
    float lp;
    cr_assert_eq(kvs_sampler_sample(s, x, &lp), argmax(x));
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp(x[i] - x[argmax(x)]);
    cr_assert_float_eq(lp, -log(sum), 1e-5);
    kvs_sampler_destroy(s);
}

Test(sampler, seeded_runs_repeat) {
    float x[V];
    random_logits(x, 2);
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = 1.0f;
    p.seed = 1234;
    kvs_sampler *a = NULL, *b = NULL;
    int differ_from_greedy = 0;
    for (int i = 0; i < 200; i++) {
        int32_t ta = sample_once(p, x, &a), tb = sample_once(p, x, &b);
        cr_assert_eq(ta, tb, "draw %d", i);
        differ_from_greedy += ta != argmax(x);
    }
    cr_assert_gt(differ_from_greedy, 0, "temperature 1 never left the argmax");
    kvs_sampler_destroy(a);
    kvs_sampler_destroy(b);
}

Test(sampler, filters_reduce_to_argmax) {
    float x[V];
    random_logits(x, 3);
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = 1.5f;
    kvs_sampling_params k1 = p, pp = p, mp = p;
    k1.top_k = 1;
    pp.top_p = 1e-6f;
    mp.min_p = 1.0f;
    kvs_sampler *s1 = NULL, *s2 = NULL, *s3 = NULL;
    for (int i = 0; i < 100; i++) {
        cr_assert_eq(sample_once(k1, x, &s1), argmax(x));
        cr_assert_eq(sample_once(pp, x, &s2), argmax(x));
        cr_assert_eq(sample_once(mp, x, &s3), argmax(x));
    }
    kvs_sampler_destroy(s1);
    kvs_sampler_destroy(s2);
    kvs_sampler_destroy(s3);
}

Test(sampler, top_k_only_draws_from_the_k_best) {
    float x[V];
    random_logits(x, 4);
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = 2.0f;
    p.top_k = 5;
    float kth = 0; /* 5th largest */
    float sorted[V];
    memcpy(sorted, x, sizeof sorted);
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < V; j++)
            if (sorted[j] > sorted[i]) { float t = sorted[i]; sorted[i] = sorted[j]; sorted[j] = t; }
    kth = sorted[4];
    kvs_sampler *s = NULL;
    for (int i = 0; i < 500; i++) cr_assert_geq(x[sample_once(p, x, &s)], kth);
    kvs_sampler_destroy(s);
}

/* At temperature 1 the empirical frequencies follow softmax(logits). */
Test(sampler, temperature_one_follows_softmax) {
    float x[V] = {0};
    x[0] = 2.0f, x[1] = 1.0f, x[2] = 0.0f; /* the rest 0 too */
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = 1.0f;
    p.seed = 7;
    kvs_sampler *s = NULL;
    int counts[V] = {0}, N = 40000;
    for (int i = 0; i < N; i++) counts[sample_once(p, x, &s)]++;
    double z = exp(2.0) + exp(1.0) + (V - 2);
    double p0 = exp(2.0) / z, p1 = exp(1.0) / z;
    /* 5 standard deviations */
    cr_assert_lt(fabs(counts[0] / (double)N - p0), 5 * sqrt(p0 * (1 - p0) / N));
    cr_assert_lt(fabs(counts[1] / (double)N - p1), 5 * sqrt(p1 * (1 - p1) / N));
    kvs_sampler_destroy(s);
}

Test(sampler, validation_names_the_parameter) {
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = -1;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "temperature"));
    p = kvs_sampling_default();
    p.top_p = 0;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "top_p"));
    p = kvs_sampling_default();
    p.min_p = 2;
    cr_assert(strstr((kvs_sampling_validate(&p), kvs_last_error()), "min_p"));
    p = kvs_sampling_default();
    p.top_k = -3;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    p = kvs_sampling_default();
    p.temperature = NAN;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
}

/* NaN or inf anywhere in the row: no token (-1, logprob NaN), greedy or not. */
Test(sampler, nonfinite_logits_sample_nothing) {
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int t = 0; t < 2; t++)
        for (int b = 0; b < 3; b++) {
            float x[V];
            random_logits(x, 3 + b);
            x[(b * 17 + 5) % V] = bad[b];
            kvs_sampling_params p = kvs_sampling_default();
            p.temperature = t ? 0.8f : 0;
            p.top_k = t ? 10 : 0;
            kvs_sampler *s;
            cr_assert_eq(kvs_sampler_create(&p, V, &s), KVS_OK);
            float lp = 0;
            cr_expect_eq(kvs_sampler_sample(s, x, &lp), -1, "T %g, %g in the row", p.temperature, bad[b]);
            cr_expect(isnan(lp));
            kvs_sampler_destroy(s);
        }
}
