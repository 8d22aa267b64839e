/* The backend's sample op on the CPU (the reference for the CUDA kernel):
 * greedy, the draw's statistics, what the filters keep (checked against a
 * sort-based restatement of backend/sample.h), determinism, padded rows; then
 * kvs_runner_step_sample on the CPU simulation against the single-rank model;
 * the sample_shard op + kvs_sample_pick (tensor parallelism without the
 * logits gather) against the op over whole rows.
 * Inputs are fixed (seeded) so every check is deterministic. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/sample.h"
#include "model/model.h"
#include "runner/runner_internal.h" /* which way out a rank took */
#include "testutil.h"

static kvs_backend *cpu(void) {
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(1, &b), KVS_OK);
    return b;
}

static kvs_sample_row row_params(float t, int k, float p, float mp, uint64_t seed, uint64_t step) {
    return (kvs_sample_row){.temperature = t, .top_k = k, .top_p = p, .min_p = mp, .seed = seed, .step = step};
}

/* One row through the op. */
static int32_t sample1(kvs_backend *b, const float *x, int vocab, kvs_sample_row p, float *lp) {
    int32_t id = -1;
    b->sample(b, &id, lp, x, 1, vocab, vocab, &p);
    return id;
}

static float *random_logits(kvs_rng *rng, int n, float scale) {
    float *x = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) x[i] = kvs_rng_normal(rng) * scale;
    return x;
}

Test(sample, greedy_is_the_first_argmax_with_its_logprob) {
    kvs_backend *b = cpu();
    float x[7] = {0.5f, 2.0f, -1.0f, 2.0f, -40.0f, 1.0f, 0.0f};
    float lp = 0;
    cr_expect_eq(sample1(b, x, 7, row_params(0, 0, 1, 0, 1, 0), &lp), 1, "ties go to the lowest id");
    double sum = 0;
    for (int i = 0; i < 7; i++) sum += exp(x[i] - 2.0);
    cr_expect_float_eq(lp, (float)(-log(sum)), 1e-6, "logprob %g", lp);
    /* the filters do not apply to greedy */
    cr_expect_eq(sample1(b, x, 7, row_params(0, 1, 0.1f, 0.9f, 1, 0), NULL), 1);
    b->destroy(b);
}

/* A row with a NaN or infinite logit is a numerical failure, not a
 * distribution: id -1 and logprob NaN, for every kind of row and wherever the
 * bad value sits; the other rows of the same call are sampled as if alone.
 * The same through sample_shard + kvs_sample_pick (one bad slice is enough). */
Test(sample, nonfinite_rows_sample_nothing) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, 17);
    enum { V = 300, KINDS = 4, ROWS = 3 * KINDS * 2 };
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    const kvs_sample_row kinds[KINDS] = {row_params(0, 0, 1, 0, 5, 0), row_params(1, 0, 1, 0, 5, 1),
                                         row_params(0.8f, 20, 0.9f, 0, 5, 2), row_params(1.2f, 0, 1, 0.05f, 5, 3)};
    float *x = malloc(sizeof(float) * ROWS * V);
    kvs_sample_row p[ROWS];
    for (int r = 0; r < ROWS; r++) { /* odd rows finite; even rows one bad value at a row-dependent column */
        for (int i = 0; i < V; i++) x[r * V + i] = kvs_rng_normal(&rng) * 2;
        if (r % 2 == 0) x[r * V + (r * 37) % V] = bad[r / 2 % 3];
        p[r] = kinds[r / 2 % KINDS];
    }
    int32_t ids[ROWS];
    float lp[ROWS];
    b->sample(b, ids, lp, x, ROWS, V, V, p);
    for (int r = 0; r < ROWS; r++) {
        if (r % 2 == 0) {
            cr_expect_eq(ids[r], -1, "row %d (%g at column %d, T %g): id %d", r, bad[r / 2 % 3], (r * 37) % V,
                         p[r].temperature, ids[r]);
            cr_expect(isnan(lp[r]), "row %d: logprob %g", r, lp[r]);
        } else {
            float lp1;
            int32_t one = sample1(b, x + r * V, V, p[r], &lp1);
            cr_expect(one >= 0 && one == ids[r], "row %d: %d in the call, %d alone", r, ids[r], one);
            cr_expect_float_eq(lp[r], lp1, 1e-6);
        }
    }
    /* two slices; the bad value in the second one only */
    const int vp = V / 2;
    for (int r = 0; r < 4; r++) {
        kvs_sample_row q = kinds[r];
        float row[V];
        for (int i = 0; i < V; i++) row[i] = kvs_rng_normal(&rng);
        for (int poison = 0; poison < 2; poison++) {
            if (poison) row[vp + 3] = NAN;
            kvs_sample_part parts[2];
            b->sample_shard(b, &parts[0], row, 1, V, vp, 0, &q);
            b->sample_shard(b, &parts[1], row + vp, 1, V, V - vp, vp, &q);
            float lp2 = 0;
            int32_t id = kvs_sample_pick(parts, 2, 1, &q, &lp2);
            cr_expect_eq(parts[1].nonfinite, poison);
            cr_expect_eq(parts[0].nonfinite, 0);
            if (poison) {
                cr_expect_eq(id, -1, "kind %d: a NaN in slice 1 gave id %d", r, id);
                cr_expect(isnan(lp2));
            } else {
                cr_expect(id >= 0 && id < V, "kind %d: id %d", r, id);
            }
        }
    }
    free(x);
    b->destroy(b);
}

/* Teacher forcing: a forced row returns its forced id whatever its other
 * parameters, with logprob log softmax(x)[id] (against a plain double
 * computation, within 1e-5); the same through sample_shard + kvs_sample_pick
 * over 2 and 3 uneven slices, whichever slice holds the id; a non-finite row
 * still samples nothing. */
Test(sample, forced_rows_take_the_given_id_with_its_logprob) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    enum { V = 301, ROWS = 24 };
    const kvs_sample_row kinds[4] = {row_params(0, 0, 1, 0, 5, 0), row_params(1, 0, 1, 0, 5, 1),
                                     row_params(0.8f, 20, 0.9f, 0, 5, 2), row_params(1.2f, 0, 1, 0.05f, 5, 3)};
    float *x = random_logits(&rng, ROWS * V, 3.0f);
    kvs_sample_row p[ROWS];
    for (int r = 0; r < ROWS; r++) {
        p[r] = kinds[r % 4];
        p[r].forced = 1;
        p[r].forced_id = r < 3 ? (int32_t[]){0, V - 1, V / 2}[r] : (int32_t)(kvs_rng_u64(&rng) % V);
    }
    x[(ROWS - 1) * V + 7] = NAN; /* the last row: non-finite */
    int32_t ids[ROWS];
    float lp[ROWS];
    b->sample(b, ids, lp, x, ROWS, V, V, p);
    for (int r = 0; r < ROWS; r++) {
        const float *row = x + (size_t)r * V;
        if (r == ROWS - 1) {
            cr_expect(ids[r] == -1 && isnan(lp[r]), "non-finite forced row: id %d, logprob %g", ids[r], lp[r]);
            continue;
        }
        double m = row[0], sum = 0;
        for (int i = 1; i < V; i++) m = row[i] > m ? row[i] : m;
        for (int i = 0; i < V; i++) sum += exp((double)row[i] - m);
        double want = (double)row[p[r].forced_id] - m - log(sum);
        cr_expect_eq(ids[r], p[r].forced_id, "row %d (T %g): id %d, forced %d", r, p[r].temperature, ids[r],
                     p[r].forced_id);
        cr_expect(fabs(lp[r] - want) <= 1e-5 * fmax(1, fabs(want)), "row %d: logprob %g, want %g", r, lp[r], want);
        for (int world = 2; world <= 3; world++) {
            kvs_sample_part parts[3];
            int begin[4] = {0, world == 2 ? 100 : 37, world == 2 ? V : 200, V};
            for (int k = 0; k < world; k++)
                b->sample_shard(b, &parts[k], row + begin[k], 1, V, begin[k + 1] - begin[k], begin[k], &p[r]);
            float lps = 0;
            int32_t id = kvs_sample_pick(parts, world, 1, &p[r], &lps);
            cr_expect_eq(id, p[r].forced_id, "row %d over %d slices: id %d", r, world, id);
            cr_expect(fabs(lps - want) <= 1e-5 * fmax(1, fabs(want)), "row %d over %d slices: logprob %g, want %g", r,
                      world, lps, want);
        }
    }
    free(x);
    b->destroy(b);
}

Test(sample, temperature_follows_the_softmax) {
    kvs_backend *b = cpu();
    const float x[6] = {1.0f, 0.2f, -0.5f, 1.5f, 0.0f, -3.0f};
    const float T = 0.7f;
    double p[6], sum = 0;
    for (int i = 0; i < 6; i++) sum += p[i] = exp((double)(x[i] / T));
    int count[6] = {0}, N = 40000;
    for (int s = 0; s < N; s++) count[sample1(b, x, 6, row_params(T, 0, 1, 0, 42, (uint64_t)s), NULL)]++;
    for (int i = 0; i < 6; i++) {
        double q = p[i] / sum, sd = sqrt(q * (1 - q) / N), f = (double)count[i] / N;
        cr_expect(fabs(f - q) <= 5 * sd + 1e-9, "token %d: frequency %.4f, softmax %.4f (5 sigma %.4f)", i, f, q, 5 * sd);
    }
    b->destroy(b);
}

Test(sample, top_k_draws_from_the_renormalized_k_best) {
    kvs_backend *b = cpu();
    const float x[8] = {0.1f, 1.0f, -0.2f, 0.9f, 0.3f, 1.1f, -1.0f, 0.0f}; /* the 3 best: 5, 1, 3 */
    double p[8] = {0}, sum = 0;
    for (int i = 0; i < 8; i++)
        if (i == 5 || i == 1 || i == 3) sum += p[i] = exp((double)x[i]);
    int count[8] = {0}, N = 30000;
    for (int s = 0; s < N; s++) count[sample1(b, x, 8, row_params(1, 3, 1, 0, 9, (uint64_t)s), NULL)]++;
    for (int i = 0; i < 8; i++) {
        double q = p[i] / sum, sd = sqrt(q * (1 - q) / N), f = (double)count[i] / N;
        cr_expect(fabs(f - q) <= 5 * sd + 1e-9, "token %d: frequency %.4f, expected %.4f", i, f, q);
    }
    b->destroy(b);
}

/* What backend/sample.h keeps, restated by sorting (independent of the op's radix select). */
static int by_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static void kept_by_sorting(const float *x, int V, kvs_sample_row p, bool *kept) {
    float *z = malloc(sizeof(float) * V), *s = malloc(sizeof(float) * V), m = -INFINITY;
    for (int i = 0; i < V; i++) z[i] = x[i] / p.temperature, m = z[i] > m ? z[i] : m;
    double lmp = p.min_p > 0 ? log((double)p.min_p) : -INFINITY;
    float kth = -INFINITY;
    if (p.top_k > 0 && p.top_k < V) {
        memcpy(s, z, sizeof(float) * V);
        qsort(s, V, sizeof(float), by_desc);
        kth = s[p.top_k - 1];
    }
    int n = 0;
    uint64_t total = 0;
    for (int i = 0; i < V; i++) {
        kept[i] = z[i] >= kth && (double)z[i] - m >= lmp;
        if (kept[i]) s[n++] = z[i], total += kvs_sample_weight(z[i], m);
    }
    if (p.top_p < 1) {
        qsort(s, n, sizeof(float), by_desc);
        uint64_t acc = 0;
        float tau = s[0];
        for (int j = 0; j < n; j++) {
            acc += kvs_sample_weight(s[j], m);
            tau = s[j];
            if ((double)acc >= (double)p.top_p * (double)total) break;
        }
        for (int i = 0; i < V; i++) kept[i] = kept[i] && z[i] >= tau;
    }
    free(z);
    free(s);
}

Test(sample, filters_never_pick_a_filtered_token) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, 2024);
    const int V = 1001;
    bool *kept = malloc(V);
    const kvs_sample_row cases[] = {
        row_params(1, 5, 1, 0, 0, 0),       row_params(0.8f, 0, 0.5f, 0, 0, 0), row_params(1.3f, 0, 1, 0.2f, 0, 0),
        row_params(1, 40, 0.9f, 0.05f, 0, 0), row_params(0.5f, 1, 1, 0, 0, 0),  row_params(1, 0, 0.001f, 0, 0, 0),
        row_params(1, 0, 1, 1, 0, 0),       row_params(2, 1000, 0.99f, 0, 0, 0), row_params(1, 2000, 1, 0, 0, 0)};
    int n_cases = sizeof cases / sizeof cases[0];
    for (int c = 0; c < n_cases; c++) {
        float *x = random_logits(&rng, V, 3);
        x[17] = x[400] = 9.0f; /* a tie at the top */
        kvs_sample_row p = cases[c];
        kept_by_sorting(x, V, p, kept);
        int n_kept = 0;
        for (int i = 0; i < V; i++) n_kept += kept[i];
        bool *seen = calloc(V, 1);
        for (int s = 0; s < 400; s++) {
            p.seed = 77 + c, p.step = (uint64_t)s;
            int32_t id = sample1(b, x, V, p, NULL);
            cr_assert(id >= 0 && id < V && kept[id], "case %d draw %d: token %d (logit %g) was filtered (%d kept)", c,
                      s, id, id >= 0 && id < V ? x[id] : NAN, n_kept);
            seen[id] = true;
        }
        if (n_kept >= 2 && n_kept <= 5) /* a small kept set: every member shows up */
            for (int i = 0; i < V; i++) cr_expect(!kept[i] || seen[i], "case %d: kept token %d never drawn", c, i);
        free(seen);
        free(x);
    }
    free(kept);
    b->destroy(b);
}

Test(sample, rows_are_independent_reproducible_and_padding_is_ignored) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, 5);
    const int n = 5, V = 333, ld = 340;
    float *x = malloc(sizeof(float) * n * ld);
    kvs_sample_row p[5];
    for (int r = 0; r < n; r++) {
        for (int i = 0; i < ld; i++) x[r * ld + i] = i < V ? kvs_rng_normal(&rng) : 1e30f; /* padding: huge */
        p[r] = row_params(r == 0 ? 0 : 1, r == 2 ? 10 : 0, r == 3 ? 0.8f : 1, r == 4 ? 0.1f : 0, 100 + r, 3);
    }
    int32_t ids[5], again[5], one;
    float lp[5], lp1;
    b->sample(b, ids, lp, x, n, ld, V, p);
    b->sample(b, again, NULL, x, n, ld, V, p);
    for (int r = 0; r < n; r++) {
        cr_expect(ids[r] >= 0 && ids[r] < V, "row %d: id %d in the padding", r, ids[r]);
        cr_expect_eq(again[r], ids[r], "row %d: the same (seed, step) draws the same token", r);
        one = sample1(b, x + r * ld, V, p[r], &lp1);
        cr_expect_eq(one, ids[r], "row %d alone: %d, in the batch: %d", r, one, ids[r]);
        cr_expect_float_eq(lp1, lp[r], 1e-6);
        cr_expect(lp[r] <= 0 && isfinite(lp[r]));
    }
    /* another step of the same seed: a different draw somewhere */
    int differ = 0;
    for (int s = 0; s < 20; s++) differ += sample1(b, x + ld, V, row_params(1, 0, 1, 0, 101, 4 + s), NULL) != ids[1];
    cr_expect(differ > 0, "20 further steps all drew token %d", ids[1]);
    free(x);
    b->destroy(b);
}

/* Gumbel-max over vocabulary slices: each slice's max of z + g (global ids in
 * the hash), then the max over slices, is the full draw (what a TP pairs
 * exchange would compute). */
Test(sample, gumbel_max_is_shardable) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, 11);
    const int V = 515, vp = 258;
    float *x = random_logits(&rng, V, 2);
    for (int s = 0; s < 50; s++) {
        kvs_sample_row p = row_params(0.9f, 0, 1, 0, 3, (uint64_t)s);
        int32_t full = sample1(b, x, V, p, NULL);
        uint64_t stream = kvs_sample_stream(p.seed, p.step);
        float best = -INFINITY;
        int32_t id = -1;
        for (int r = 0; r < 2; r++) {
            float lb = -INFINITY;
            int32_t li = -1;
            for (int i = r * vp; i < V && i < (r + 1) * vp; i++) {
                float v = x[i] / p.temperature + kvs_sample_gumbel(stream, i);
                if (li < 0 || v > lb) lb = v, li = i;
            }
            if (id < 0 || lb > best) best = lb, id = li;
        }
        cr_expect_eq(id, full, "step %d: sharded %d, full %d", s, id, full);
    }
    free(x);
    b->destroy(b);
}

/* ---- sample_shard + kvs_sample_pick: a row split into world slices ------------
 * Every row kind where the slices could disagree with the whole row: random,
 * a slice of -inf only, NaN, +inf (in one slice or everywhere), the maximum
 * tied across a slice boundary, everything -inf, a temperature so small that
 * z overflows; greedy and temperature rows, several draws (rows holding NaN or
 * inf sample nothing: -1 both ways). Ids must equal the
 * sample op's exactly; logprobs within 1e-5 (the sum's order differs) where
 * the whole row's is finite, else not finite either. */
static void fill_row_kind(kvs_rng *rng, float *x, int V, int vp, int kind) {
    for (int i = 0; i < V; i++) x[i] = kvs_rng_normal(rng) * 2;
    switch (kind) {
    case 1: for (int i = 0; i < vp && i < V; i++) x[i] = -INFINITY; break;             /* rank 0 all -inf */
    case 2: for (int i = V - 1; i >= vp; i--) x[i] = -INFINITY; break;                 /* ranks >= 1 all -inf */
    case 3: for (int i = 0; i < V; i += 3) x[i] = NAN; break;
    case 4: x[V - 1] = INFINITY; break;
    case 5: for (int i = 0; i < V; i++) x[i] = i % 2 ? INFINITY : -INFINITY; break;
    case 6: x[V / 2] = x[vp < V ? vp : 0] = x[1] = 9.0f; break;                        /* ties across slices */
    case 7: for (int i = 0; i < V; i++) x[i] = -INFINITY; break;
    case 8: for (int i = 0; i < V; i++) x[i] = NAN; break;
    case 9: for (int i = vp; i < V; i++) x[i] = INFINITY; break;                       /* +inf slices, one finite */
    case 10: for (int i = 0; i < V; i++) x[i] = i < vp ? -INFINITY : INFINITY; break;  /* only -inf is kept */
    }
}

Test(sample, shard_parts_pick_what_the_whole_row_picks) {
    kvs_backend *b = cpu();
    kvs_rng rng;
    kvs_rng_seed(&rng, 99);
    const int vocabs[] = {515, 7, 64, 1000};
    const float temps[] = {0, 1.0f, 0.7f, 1e-38f, 3.0f};
    enum { KINDS = 11, DRAWS = 6, ROWS = KINDS * 5 * DRAWS };
    int checked = 0, bad_id = 0, bad_lp = 0;
    for (size_t vi = 0; vi < sizeof vocabs / sizeof vocabs[0]; vi++)
        for (int world = 2; world <= 5; world++) {
            int V = vocabs[vi], vp = (V + world - 1) / world;
            float *x = malloc(sizeof(float) * (size_t)ROWS * V);
            kvs_sample_row p[ROWS];
            for (int r = 0; r < ROWS; r++) {
                int kind = r / (5 * DRAWS), ti = r / DRAWS % 5;
                fill_row_kind(&rng, x + (size_t)r * V, V, vp, kind);
                p[r] = row_params(temps[ti], 0, 1, 0, 7 + kind, (uint64_t)r);
            }
            kvs_sample_part *parts = malloc(sizeof(kvs_sample_part) * (size_t)world * ROWS);
            for (int k = 0; k < world; k++) { /* rank k's columns of every row (ld = V) */
                int count = V - k * vp < vp ? V - k * vp : vp;
                b->sample_shard(b, parts + (size_t)k * ROWS, x + (size_t)k * vp, ROWS, V, count < 0 ? 0 : count,
                                k * vp, p);
            }
            for (int r = 0; r < ROWS; r++) {
                float lp_full = 0, lp = 0;
                int32_t full = sample1(b, x + (size_t)r * V, V, p[r], &lp_full);
                int32_t id = kvs_sample_pick(parts + r, world, ROWS, &p[r], &lp);
                bool finite = true;
                for (int i = 0; i < V; i++) finite &= isfinite(x[(size_t)r * V + i]) != 0;
                cr_expect_eq(full == -1, !finite, "V %d row kind %d: id %d from a row %s finite", V,
                             r / (5 * DRAWS), full, finite ? "all" : "not all");
                checked++;
                if (id != full) {
                    bad_id++;
                    cr_expect_eq(id, full, "V %d world %d row kind %d T %g: sharded %d, whole row %d", V, world,
                                 r / (5 * DRAWS), p[r].temperature, id, full);
                }
                bool ok = isfinite(lp_full) ? fabsf(lp - lp_full) <= 1e-5f * (1 + fabsf(lp_full)) : !isfinite(lp);
                if (!ok) {
                    bad_lp++;
                    cr_expect(ok, "V %d world %d row kind %d T %g: logprob %g, whole row %g", V, world,
                              r / (5 * DRAWS), p[r].temperature, lp, lp_full);
                }
            }
            free(parts);
            free(x);
        }
    cr_log_info("sample_shard + pick: %d rows, %d ids and %d logprobs off", checked, bad_id, bad_lp);
    /* filters make a row unshardable; greedy ignores them */
    kvs_sample_row q = row_params(1, 0, 1, 0, 1, 0);
    cr_expect(kvs_sample_shardable(&q, 515));
    q.top_k = 515;
    cr_expect(kvs_sample_shardable(&q, 515), "top_k >= vocab is off");
    q.top_k = 50;
    cr_expect(!kvs_sample_shardable(&q, 515));
    q = row_params(1, 0, 0.9f, 0, 1, 0);
    cr_expect(!kvs_sample_shardable(&q, 515));
    q = row_params(1, 0, 1, 0.01f, 1, 0);
    cr_expect(!kvs_sample_shardable(&q, 515));
    q = row_params(0, 50, 0.5f, 0.5f, 1, 0);
    cr_expect(kvs_sample_shardable(&q, 515));
    b->destroy(b);
}

/* ---- kvs_runner_step_sample on the CPU simulation ---------------------------- */
static const char *odd_vocab_json =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 8, \"num_key_value_heads\": 4, \"head_dim\": 16,"
    " \"intermediate_size\": 96, \"vocab_size\": 515, \"max_position_embeddings\": 1024,"
    " \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false,"
    " \"torch_dtype\": \"float32\"}";

typedef struct {
    kvs_backend *be;
    kvs_model *m;
    kvs_executor *x;
    kvs_kv_cache *kv;
    kvs_runner *g;
} sample_rig;

static void srig_open(sample_rig *r, const kvs_config *c, kvs_checkpoint *ck, int world) {
    memset(r, 0, sizeof *r);
    kvs_kv_config kc = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                        .n_heads = c->n_heads, .block_size = 16, .max_seqs = 4, .n_blocks = 4 * 2 * 8};
    if (world == 1) {
        cr_assert_eq(kvs_backend_cpu_create(1, &r->be), KVS_OK);
        cr_assert_eq(kvs_model_create(c, ck, r->be, &r->m), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_executor_create(r->m, NULL, &r->x), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_kv_create(&kc, r->be, &r->kv), KVS_OK, "%s", kvs_last_error());
    } else {
        cr_assert_eq(kvs_runner_create_cpu(c, ck, world, 1, KVS_F32, KVS_F32, NULL, &r->g), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_runner_kv_create(r->g, &kc), KVS_OK, "%s", kvs_last_error());
    }
}

static void srig_close(sample_rig *r) {
    if (r->g) kvs_runner_destroy(r->g);
    else {
        kvs_kv_destroy(r->kv);
        kvs_executor_destroy(r->x);
        kvs_model_destroy(r->m);
        r->be->destroy(r->be);
    }
}

/* Prefills n_seqs sequences (the same 20 tokens) in one step, then decodes
 * n_steps - 1 steps, each sequence with its own parameters (draw number =
 * step); ids and logprobs [step][seq]. */
static void srig_generate(sample_rig *r, int n_seqs, const kvs_sample_row *params, int n_steps, int32_t *ids,
                          float *lps) {
    int seqs[4], n = 20;
    int32_t toks[4 * 20], pos[4 * 20], qs[5];
    uint8_t want[4];
    for (int s = 0; s < n_seqs; s++) {
        seqs[s] = r->g ? kvs_kv_seq_create(kvs_runner_kv(r->g)) : kvs_kv_seq_create(r->kv);
        cr_assert_geq(seqs[s], 0);
    }
    for (int step = 0; step < n_steps; step++) {
        int nt = 0;
        for (int s = 0; s < n_seqs; s++) {
            qs[s] = nt;
            int len = step == 0 ? n : 1;
            for (int i = 0; i < len; i++, nt++) {
                toks[nt] = step == 0 ? (i * 37 + 11) % 515 : ids[(step - 1) * n_seqs + s];
                pos[nt] = step == 0 ? i : n + step - 1;
            }
            want[s] = 1;
            kvs_status st = r->g ? kvs_kv_reserve(kvs_runner_kv(r->g), seqs[s], len) : kvs_kv_reserve(r->kv, seqs[s], len);
            cr_assert_eq(st, KVS_OK, "%s", kvs_last_error());
        }
        qs[n_seqs] = nt;
        kvs_batch b = {nt, n_seqs, toks, pos, qs, seqs, want};
        kvs_sample_row p[4];
        for (int s = 0; s < n_seqs; s++) p[s] = params[s], p[s].step = (uint64_t)step;
        kvs_status st = r->g ? kvs_runner_step_sample(r->g, &b, p, NULL, ids + step * n_seqs, lps + step * n_seqs)
                             : rig_forward_sample(r->x, &b, r->kv, p, NULL, ids + step * n_seqs, lps + step * n_seqs);
        cr_assert_eq(st, KVS_OK, "%s", kvs_last_error());
        if (!r->g) kv_keep(r->kv, &b);
    }
}

Test(sample, tp_forward_sample_matches_the_single_rank_model, .timeout = 600) {
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_parse(odd_vocab_json, strlen(odd_vocab_json), "test config", &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_dummy(&cfg, 1234, &ck), KVS_OK);
    const kvs_sample_row params[4] = {row_params(0, 0, 1, 0, 1, 0), row_params(1, 0, 1, 0, 2, 0),
                                      row_params(0.8f, 50, 0.9f, 0, 3, 0), row_params(1.2f, 0, 1, 0.05f, 4, 0)};
    enum { STEPS = 12 };
    int32_t ids1[STEPS * 4], ids2[STEPS * 4], ids4[STEPS * 4];
    float lp1[STEPS * 4], lp2[STEPS * 4], lp4[STEPS * 4];
    sample_rig one, two, four;
    srig_open(&one, &cfg, ck, 1);
    srig_generate(&one, 4, params, STEPS, ids1, lp1);
    srig_close(&one);
    srig_open(&two, &cfg, ck, 2);
    srig_generate(&two, 4, params, STEPS, ids2, lp2);
    srig_close(&two);
    srig_open(&four, &cfg, ck, 4);
    srig_generate(&four, 4, params, STEPS, ids4, lp4);
    srig_close(&four);
    /* the ranks' partial sums add in another order (logits within ~1e-5): a
       draw may flip at a near-tie and then the sequences part; compare up to
       each sequence's first difference, which must come late if at all */
    for (int s = 0; s < 4; s++) {
        int same2 = 0, same4 = 0;
        while (same2 < STEPS && ids2[same2 * 4 + s] == ids1[same2 * 4 + s]) same2++;
        while (same4 < STEPS && ids4[same4 * 4 + s] == ids1[same4 * 4 + s]) same4++;
        cr_expect(same2 >= STEPS / 2 && same4 >= STEPS / 2,
                  "sequence %d: TP=2 agrees for %d of %d steps, TP=4 for %d", s, same2, STEPS, same4);
        for (int k = 0; k < same2; k++)
            cr_expect(fabsf(lp2[k * 4 + s] - lp1[k * 4 + s]) <= 1e-4, "seq %d step %d: logprob %g vs %g", s, k,
                      lp2[k * 4 + s], lp1[k * 4 + s]);
        if (s == 0) cr_expect_eq(same2, STEPS, "greedy over 2 ranks");
    }
    /* bad parameters are refused before the step, naming the row, and the group stays usable */
    sample_rig g;
    srig_open(&g, &cfg, ck, 2);
    kvs_sample_row bad[4] = {params[0], params[1], params[2], params[3]};
    bad[2].top_p = 0;
    int seq = kvs_kv_seq_create(kvs_runner_kv(g.g));
    int32_t t[1] = {5}, pos[1] = {0}, qs[2] = {0, 1}, out[1];
    uint8_t want = 1;
    kvs_batch b = {1, 1, t, pos, qs, &seq, &want};
    cr_assert_eq(kvs_kv_reserve(kvs_runner_kv(g.g), seq, 1), KVS_OK);
    cr_expect_eq(kvs_runner_step_sample(g.g, &b, &bad[2], NULL, out, NULL), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "row 0"), "%s", kvs_last_error());
    cr_expect_eq(kvs_runner_step_sample(g.g, &b, &params[1], NULL, out, NULL), KVS_OK, "%s", kvs_last_error());
    cr_expect(out[0] >= 0 && out[0] < 515);
    srig_close(&g);
    kvs_checkpoint_destroy(ck);
}

/* Greedy and temperature-only rows take the parts path (no logits gather):
 * at TP = 2 and 4 the same ids as TP = 1 (up to near-ties of the ranks'
 * other summation order, as above; greedy rows every step), and at TP = 2
 * exactly the ids of the gather path over the same logits (one row given a
 * min-p of 1e-30 sends the whole batch through the gather; the other rows'
 * logits are bitwise the same), logprobs within 1e-5. */
Test(sample, tp_greedy_and_temperature_without_the_gather, .timeout = 600) {
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_parse(odd_vocab_json, strlen(odd_vocab_json), "test config", &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_dummy(&cfg, 1234, &ck), KVS_OK);
    kvs_sample_row params[4] = {row_params(0, 0, 1, 0, 1, 0), row_params(1, 0, 1, 0, 2, 0),
                                row_params(0.7f, 515, 1, 0, 3, 0), row_params(0, 40, 0.5f, 0.5f, 4, 0)};
    enum { STEPS = 12 };
    int32_t ids1[STEPS * 4], ids2[STEPS * 4], ids4[STEPS * 4], idsg[STEPS * 4];
    float lp1[STEPS * 4], lp2[STEPS * 4], lp4[STEPS * 4], lpg[STEPS * 4];
    sample_rig one, two, four, gather;
    srig_open(&one, &cfg, ck, 1);
    srig_generate(&one, 4, params, STEPS, ids1, lp1);
    srig_close(&one);
    srig_open(&two, &cfg, ck, 2);
    srig_generate(&two, 4, params, STEPS, ids2, lp2);
    for (int k = 0; k < 2; k++)
        cr_expect(kvs_runner_executor(two.g, k)->sample.sharded_steps > 0, "rank %d took the parts path", k);
    srig_close(&two);
    srig_open(&four, &cfg, ck, 4);
    srig_generate(&four, 4, params, STEPS, ids4, lp4);
    srig_close(&four);
    kvs_sample_row with_filter[4] = {params[0], params[1], params[2], row_params(1, 0, 1, 1e-30f, 4, 0)};
    srig_open(&gather, &cfg, ck, 2);
    srig_generate(&gather, 4, with_filter, STEPS, idsg, lpg);
    srig_close(&gather);
    for (int s = 0; s < 4; s++) {
        int same2 = 0, same4 = 0;
        while (same2 < STEPS && ids2[same2 * 4 + s] == ids1[same2 * 4 + s]) same2++;
        while (same4 < STEPS && ids4[same4 * 4 + s] == ids1[same4 * 4 + s]) same4++;
        cr_log_info("sequence %d (T %g): TP=2 agrees with TP=1 for %d of %d steps, TP=4 for %d", s,
                    params[s].temperature, same2, STEPS, same4);
        cr_expect(same2 >= STEPS / 2 && same4 >= STEPS / 2, "sequence %d: TP=2 agrees for %d of %d steps, TP=4 for %d",
                  s, same2, STEPS, same4);
        if (params[s].temperature == 0)
            cr_expect(same2 == STEPS && same4 == STEPS, "greedy sequence %d: TP=2 %d, TP=4 %d of %d steps", s, same2,
                      same4, STEPS);
        for (int k = 0; k < same2; k++)
            cr_expect(fabsf(lp2[k * 4 + s] - lp1[k * 4 + s]) <= 1e-4, "seq %d step %d: logprob %g vs %g", s, k,
                      lp2[k * 4 + s], lp1[k * 4 + s]);
        if (s == 3) continue; /* the row whose filter forced the gather */
        for (int k = 0; k < STEPS; k++) {
            cr_expect_eq(ids2[k * 4 + s], idsg[k * 4 + s], "seq %d step %d: parts %d, gather %d", s, k,
                         ids2[k * 4 + s], idsg[k * 4 + s]);
            cr_expect(fabsf(lp2[k * 4 + s] - lpg[k * 4 + s]) <= 1e-5, "seq %d step %d: logprob %g vs gather %g", s, k,
                      lp2[k * 4 + s], lpg[k * 4 + s]);
        }
    }
    kvs_checkpoint_destroy(ck);
}
