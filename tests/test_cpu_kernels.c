/* The CPU backend's kernel sets (backend/cpu/cpu_simd.h), each one this CPU
 * runs, against double-precision references on fresh random inputs: gemv with
 * f32, bf16 and f16 weights, attention's qk and pv on f32, bf16 and f16
 * keys and values; a row's gemv result the
 * same bits whatever the batch size and the row split; the matmul op on bf16
 * weights equal to the f32 oracle on the same values; the vector exp of the
 * softmax and SwiGLU kernels against expf (within 2 ulp of the double exp), the
 * same bits wherever an element sits; the thread pool.
 *
 * Tolerance: |got - ref| <= 1e-5 * sum_k |w_k x_k| + 1e-30 (f32 accumulation
 * in any order is within n * eps of the exact sum of magnitudes; 1e-5 covers
 * n up to ~80 at eps 6e-8 per step and the pairwise tails used here). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_pool.h"
#include "backend/cpu/cpu_simd.h"
#include "core/core.h"
#include "testutil.h"

static kvs_rng seeded(void) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    return rng;
}

/* The sets this CPU runs: generic always, then avx2 and avx512 where present. */
static int runnable_sets(const kvs_cpu_kernels **sets) {
    int n = 0;
    sets[n++] = &kvs_cpu_kernels_generic;
    if (kvs_cpu_kernels_avx2 && kvs_cpu_runs_avx2()) sets[n++] = kvs_cpu_kernels_avx2;
    if (kvs_cpu_kernels_avx512 && kvs_cpu_runs_avx512()) sets[n++] = kvs_cpu_kernels_avx512;
    return n;
}

/* n weights of dtype wt from normal draws, and their f32 values. */
static void *weights(kvs_rng *rng, kvs_dtype wt, size_t n, float **values) {
    float *v = malloc(sizeof(float) * (n ? n : 1));
    uint16_t *h = malloc(sizeof(uint16_t) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        float f = kvs_rng_normal(rng);
        if (wt == KVS_BF16) h[i] = kvs_f32_to_bf16(f), f = kvs_bf16_to_f32(h[i]);
        if (wt == KVS_F16) h[i] = kvs_f32_to_f16(f), f = kvs_f16_to_f32(h[i]);
        v[i] = f;
    }
    *values = v;
    if (wt == KVS_F32) {
        free(h);
        float *c = malloc(sizeof(float) * (n ? n : 1));
        memcpy(c, v, sizeof(float) * n);
        return c;
    }
    return h;
}

static float *normal(kvs_rng *rng, size_t n) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = kvs_rng_normal(rng);
    return x;
}

Test(cpu_kernels, gemv_matches_reference_every_set_and_dtype) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    const int in_dims[] = {1, 7, 33, 64, 511, 1029, 2048 + 17};
    const kvs_dtype types[] = {KVS_F32, KVS_BF16, KVS_F16};
    double worst = 0;
    for (int s = 0; s < n_sets; s++)
        for (int ti = 0; ti < 3; ti++)
            for (size_t di = 0; di < sizeof in_dims / sizeof in_dims[0]; di++) {
                int in = in_dims[di], rows = 1 + (int)(kvs_rng_u64(&rng) % 40), n = 1 + (int)(kvs_rng_u64(&rng) % 8);
                int j0 = (int)(kvs_rng_u64(&rng) % rows), j1 = j0 + 1 + (int)(kvs_rng_u64(&rng) % (rows - j0));
                bool with_bias = kvs_rng_u64(&rng) & 1;
                float *wv, *x = normal(&rng, (size_t)n * in), *bias = normal(&rng, rows);
                void *w = weights(&rng, types[ti], (size_t)rows * in, &wv);
                float *out = calloc((size_t)n * rows, sizeof(float));
                sets[s]->gemv(out, rows, x, w, types[ti], with_bias ? bias : NULL, n, in, j0, j1);
                for (int i = 0; i < n; i++)
                    for (int j = 0; j < rows; j++) {
                        float got = out[(size_t)i * rows + j];
                        if (j < j0 || j >= j1) {
                            cr_expect(got == 0, "%s: row %d outside [%d, %d) written", sets[s]->name, j, j0, j1);
                            continue;
                        }
                        double ref = with_bias ? bias[j] : 0, mag = with_bias ? fabs(bias[j]) : 0;
                        for (int k = 0; k < in; k++) {
                            double p = (double)wv[(size_t)j * in + k] * x[(size_t)i * in + k];
                            ref += p, mag += fabs(p);
                        }
                        double err = fabs(got - ref) / (mag + 1e-30);
                        if (err > worst) worst = err;
                        cr_expect(err <= 1e-5, "%s %s in %d n %d row %d: %g vs %g", sets[s]->name,
                                  kvs_dtype_name(types[ti]), in, n, j, got, ref);
                    }
                free(wv), free(x), free(bias), free(w), free(out);
            }
    cr_log_info("gemv: %d sets, worst error / sum|w x| %.2e", n_sets, worst);
}

Test(cpu_kernels, gemv_row_does_not_depend_on_batch_or_split) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    int rows = 37, in = 1500;
    for (int s = 0; s < n_sets; s++) {
        float *wv, *x = normal(&rng, (size_t)8 * in);
        void *w = weights(&rng, KVS_BF16, (size_t)rows * in, &wv);
        float *all = malloc(sizeof(float) * 8 * rows), *one = malloc(sizeof(float) * rows);
        sets[s]->gemv(all, rows, x, w, KVS_BF16, NULL, 8, in, 0, rows);
        for (int i = 0; i < 8; i++) {
            int cut = 1 + (int)(kvs_rng_u64(&rng) % (rows - 1));
            sets[s]->gemv(one, rows, x + (size_t)i * in, w, KVS_BF16, NULL, 1, in, 0, cut);
            sets[s]->gemv(one, rows, x + (size_t)i * in, w, KVS_BF16, NULL, 1, in, cut, rows);
            cr_expect(memcmp(one, all + (size_t)i * rows, sizeof(float) * rows) == 0,
                      "%s: input %d alone (rows split at %d) differs from the batch of 8", sets[s]->name, i, cut);
        }
        free(wv), free(x), free(w), free(all), free(one);
    }
}

Test(cpu_kernels, qk_and_pv_match_reference) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    const int dims[] = {64, 100, 128};
    const kvs_dtype types[] = {KVS_F32, KVS_BF16, KVS_F16};
    for (int s = 0; s < n_sets; s++)
        for (int ti = 0; ti < 3; ti++)
            for (int di = 0; di < 3; di++)
                for (int g = 1; g <= 10; g++) {
                    int d = dims[di], cnt = 1 + (int)(kvs_rng_u64(&rng) % 16), ld_q = d + 3, ld_s = cnt + 5;
                    kvs_dtype t = types[ti];
                    float *kf, *vf, *q = normal(&rng, (size_t)g * ld_q), *p = normal(&rng, (size_t)g * ld_s);
                    void *k = weights(&rng, t, (size_t)cnt * d, &kf), *v = weights(&rng, t, (size_t)cnt * d, &vf);
                    float *sc = calloc((size_t)g * ld_s, sizeof(float)), *out = normal(&rng, (size_t)g * d);
                    float *out0 = malloc(sizeof(float) * g * d);
                    memcpy(out0, out, sizeof(float) * g * d);
                    sets[s]->qk(sc, ld_s, q, ld_q, g, k, t, cnt, d, 0.125f);
                    sets[s]->pv(out, d, p, ld_s, g, v, t, cnt, d);
                    for (int h = 0; h < g; h++) {
                        for (int e = 0; e < cnt; e++) {
                            double ref = 0, mag = 0;
                            for (int c = 0; c < d; c++) {
                                double x = (double)q[(size_t)h * ld_q + c] * kf[(size_t)e * d + c];
                                ref += x, mag += fabs(x);
                            }
                            cr_expect(fabs(sc[(size_t)h * ld_s + e] - 0.125 * ref) <= 1e-5 * 0.125 * mag + 1e-30,
                                      "%s %s qk d %d g %d head %d key %d", sets[s]->name, kvs_dtype_name(t), d, g, h,
                                      e);
                        }
                        for (int c = 0; c < d; c++) {
                            double ref = out0[(size_t)h * d + c], mag = fabs(ref);
                            for (int e = 0; e < cnt; e++) {
                                double x = (double)p[(size_t)h * ld_s + e] * vf[(size_t)e * d + c];
                                ref += x, mag += fabs(x);
                            }
                            cr_expect(fabs(out[(size_t)h * d + c] - ref) <= 1e-5 * mag + 1e-30,
                                      "%s %s pv d %d g %d head %d column %d", sets[s]->name, kvs_dtype_name(t), d, g,
                                      h, c);
                        }
                    }
                    free(q), free(k), free(v), free(kf), free(vf), free(p), free(sc), free(out), free(out0);
                }
}

/* |got - want| in units of want's last place (float). */
static double ulps(float got, double want) {
    if (want == 0) return got == 0 ? 0 : INFINITY;
    int e;
    frexp(want, &e);
    return fabs(got - want) / ldexp(1.0, e - 24);
}

/* exp_sum: elements within 2 ulp of exp(x - m) over the normal range, 0 below;
 * the sum of its own elements within the float summation bound (n - 1) * 2^-24
 * of their double sum (nonnegative terms added in any order and grouping,
 * Higham's (4.4)): a 4,099-term float sum is ~1e-6 off as often as not; an
 * element's value the same bits at every offset and length (vector body or tail). */
Test(cpu_kernels, exp_sum_matches_exp_and_not_its_position) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    enum { N = 4099 };
    static float x[N], y[N], z[N]; /* static: a failed assertion leaks nothing */
    for (int s = 0; s < n_sets; s++)
        for (int round = 0; round < 20; round++) {
            float m = (float)(kvs_rng_normal(&rng) * 4);
            for (int i = 0; i < N; i++) /* x - m over [-100, 0], some exactly at the edges */
                x[i] = i % 97 == 0 ? m - 87.3365447504f : i % 89 == 0 ? m : m - (float)(kvs_rng_u64(&rng) % 100000) * 1e-3f;
            memcpy(y, x, sizeof(float) * N);
            double got = sets[s]->exp_sum(y, N, m), want = 0, worst = 0;
            for (int i = 0; i < N; i++) {
                float d = x[i] - m; /* as the kernel subtracts */
                double e = exp((double)d);
                if (d < -87.3365447504f) {
                    cr_assert(y[i] == 0, "%s: exp(%g) = %g, want 0 below the normal range", sets[s]->name, d, y[i]);
                } else {
                    double u = ulps(y[i], e);
                    worst = u > worst ? u : worst;
                    cr_assert(u <= 2, "%s: exp(%.9g) = %.9g, want %.9g (%.2f ulp)", sets[s]->name, d, y[i], e, u);
                }
                want += y[i];
            }
            cr_assert(fabs(got - want) <= (N - 1) * 0x1p-24 * want, "%s: sum %.9g, want %.9g", sets[s]->name, got,
                      want);
            /* the same element in a tail, at another offset */
            int off = 1 + (int)(kvs_rng_u64(&rng) % 37), len = 1 + (int)(kvs_rng_u64(&rng) % 40);
            memcpy(z, x + off, sizeof(float) * len);
            sets[s]->exp_sum(z, len, m);
            cr_assert(!memcmp(z, y + off, sizeof(float) * len), "%s: an element's exp depends on its position",
                      sets[s]->name);
            if (round == 0) cr_log_info("%s: worst %.2f ulp", sets[s]->name, worst);
        }
}

/* exp_sum counts every element once, body and tail: with x - m either 0 (exp
 * exactly 1) or below the normal range (exactly 0), the float sum is an integer
 * below 2^24 and must equal the count of ones exactly, at every length 1..80
 * and at 4,099 (the bound above is loose; this one is exact). */
Test(cpu_kernels, exp_sum_counts_each_element_once) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    enum { N = 4099 };
    static float x[N];
    for (int s = 0; s < n_sets; s++)
        for (int n = 1; n <= N; n = n == 80 ? N : n + 1) {
            float m = (float)(kvs_rng_normal(&rng) * 4);
            int ones = 0;
            for (int i = 0; i < n; i++) {
                bool one = kvs_rng_u64(&rng) % 3 != 0;
                x[i] = one ? m : m - 90.0f;
                ones += one;
            }
            float got = sets[s]->exp_sum(x, n, m);
            cr_assert(got == (float)ones, "%s n %d: sum %.9g, want %d", sets[s]->name, n, got, ones);
            for (int i = 0; i < n; i++) cr_assert(x[i] == 0.0f || x[i] == 1.0f, "%s n %d: element %d is %g", sets[s]->name, n, i, x[i]);
        }
}

/* silu_mul: g / (1 + exp(-g)) * u within 4e-7 relative of the double formula
 * (1e-36 absolute: a gate below -88.72 gives 0 for e^88.7 g, as expf's +inf did),
 * including gates far past exp's range either way. */
Test(cpu_kernels, silu_mul_matches_reference) {
    kvs_rng rng = seeded();
    const kvs_cpu_kernels *sets[3];
    int n_sets = runnable_sets(sets);
    enum { N = 1031 };
    float *g = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N), *o = malloc(sizeof(float) * N);
    for (int s = 0; s < n_sets; s++)
        for (int round = 0; round < 10; round++) {
            for (int i = 0; i < N; i++) {
                g[i] = (float)(kvs_rng_normal(&rng) * (round < 5 ? 3 : 60));
                u[i] = (float)kvs_rng_normal(&rng);
            }
            g[0] = 100, g[1] = -100, g[2] = 0, g[3] = -88.5f, g[4] = 90;
            int n = N - (int)(kvs_rng_u64(&rng) % 16);
            sets[s]->silu_mul(o, g, u, n);
            for (int i = 0; i < n; i++) {
                double want = (double)g[i] / (1 + exp(-(double)g[i])) * u[i];
                cr_assert(fabs(o[i] - want) <= 4e-7 * fabs(want) + 1e-36, "%s: silu(%g) * %g = %.9g, want %.9g",
                          sets[s]->name, g[i], u[i], o[i], want);
            }
        }
    free(g), free(u), free(o);
}

/* The matmul op with bf16 weights against the f32 oracle holding the same
 * values: decode's rows (gemv) bitwise, prefill's (sgemm on widened panels)
 * within 1e-5 relative. */
Test(cpu_kernels, matmul_bf16_weights_equal_f32_oracle) {
    kvs_rng rng = seeded();
    kvs_backend *f32, *b16;
    cr_assert_eq(kvs_backend_cpu_create(2, &f32), KVS_OK);
    cr_assert_eq(kvs_backend_cpu_create_typed(2, KVS_BF16, KVS_F32, &b16), KVS_OK);
    int in = 300, out_dim = 517;
    float *wv;
    uint16_t *w = weights(&rng, KVS_BF16, (size_t)out_dim * in, &wv);
    float *bias = normal(&rng, out_dim);
    void *dw32 = f32->alloc(f32, sizeof(float) * out_dim * in), *dw16 = b16->alloc(b16, 2 * (size_t)out_dim * in);
    void *db32 = f32->alloc(f32, sizeof(float) * out_dim), *db16 = b16->alloc(b16, 2 * (size_t)out_dim);
    f32->upload_weight(f32, dw32, w, KVS_BF16, (size_t)out_dim * in);
    b16->upload_weight(b16, dw16, w, KVS_BF16, (size_t)out_dim * in);
    cr_assert(memcmp(dw16, w, 2 * (size_t)out_dim * in) == 0, "bf16 weights are not kept as they are");
    uint16_t *bias16 = malloc(2 * (size_t)out_dim);
    for (int j = 0; j < out_dim; j++) bias16[j] = kvs_f32_to_bf16(bias[j]);
    f32->upload_weight(f32, db32, bias16, KVS_BF16, out_dim);
    b16->upload_weight(b16, db16, bias16, KVS_BF16, out_dim);
    const int ns[] = {1, 3, 8, 9, 40};
    for (int a = 0; a < 5; a++) {
        int n = ns[a];
        float *x = normal(&rng, (size_t)n * in), *o32 = malloc(sizeof(float) * n * out_dim);
        float *o16 = malloc(sizeof(float) * n * out_dim);
        f32->matmul(f32, o32, x, dw32, db32, n, in, out_dim);
        b16->matmul(b16, o16, x, dw16, db16, n, in, out_dim);
        if (n <= KVS_CPU_GEMV_MAX_N) {
            cr_expect(memcmp(o32, o16, sizeof(float) * n * out_dim) == 0, "n %d: bf16 != f32 oracle", n);
        } else {
            double worst = 0, top = 0;
            for (size_t i = 0; i < (size_t)n * out_dim; i++) {
                worst = fmax(worst, fabs(o32[i] - o16[i]));
                top = fmax(top, fabs(o32[i]));
            }
            cr_expect(worst <= 1e-5 * top, "n %d: max|bf16 - f32| %g of max %g", n, worst, top);
        }
        free(x), free(o32), free(o16);
    }
    cr_expect_eq(f32->check(f32), KVS_OK);
    cr_expect_eq(b16->check(b16), KVS_OK);
    f32->free(f32, dw32), f32->free(f32, db32), b16->free(b16, dw16), b16->free(b16, db16);
    f32->destroy(f32), b16->destroy(b16);
    free(wv), free(w), free(bias), free(bias16);
}

typedef struct {
    atomic_int parts[8];
    atomic_long sum;
} pool_probe;

static void probe_job(void *arg, int t, int nt) {
    pool_probe *p = arg;
    atomic_fetch_add(&p->parts[t], 1);
    atomic_fetch_add(&p->sum, (long)t + 1);
}

/* Every part runs once per job, jobs back to back and after the workers fell asleep. */
Test(cpu_kernels, pool_runs_every_part_once) {
    for (int n = 1; n <= 4; n++) {
        kvs_cpu_pool *p;
        cr_assert_eq(kvs_cpu_pool_create(n, &p), KVS_OK);
        pool_probe probe = {0};
        for (int j = 0; j < 2000; j++) {
            if (j == 1000) {
                struct timespec ts = {0, 5 * 1000 * 1000}; /* past the yield phase: the workers sleep */
                nanosleep(&ts, NULL);
            }
            kvs_cpu_pool_run(p, probe_job, &probe);
        }
        for (int t = 0; t < n; t++) cr_expect_eq(atomic_load(&probe.parts[t]), 2000, "pool of %d: part %d", n, t);
        cr_expect_eq(atomic_load(&probe.sum), 2000L * n * (n + 1) / 2);
        kvs_cpu_pool_destroy(p);
    }
}
